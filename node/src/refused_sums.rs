//! Remote sums the lane store refused at its key cap, published again until it takes them.
//!
//! Near the cap the gossip's map can hold a key the lane store refuses: the two caps count
//! different sets (ARCHITECTURE.md, "Threat model"). While the store lacks the key, a
//! client's write to it is refused too (the store is full). But once expiry makes room, a
//! client's write would create the key with a remote sum of zero, and if the key's lanes
//! never changed again (a peer at the limit only denies, and a denial writes nothing), its
//! estimate here would lack its peers' counts for the rest of its window: decided on this
//! node's lane alone, under a bound that does not know (found in review, session 44). So a
//! refused key is kept here with its sum, and the driver publishes it again every second,
//! right after expiry, until the store takes it or the gossip's map no longer holds it.
//!
//! A `sliding` rule's decisions read the window before's count too, a key no client writes
//! any more and so never refused to one: they read a refused key's sum here (found in review,
//! session 55: it counted 0, and a subject the peers had filled the limit for was admitted).
//! So do a `get` and a check of a refused key (found in review, session 55: a `get`
//! answered 0, and a check was admitted on 0, then refused `KeysFull` when counted).

use crate::store::LaneStore;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use tally_crdt::{Key, KeyRef};

/// The keys whose remote sums the lane store refused, and has not taken since, with the
/// sums as last published. Written by the gossip task alone, read by decisions.
#[derive(Debug, Default)]
pub struct RefusedSums {
    sums: Mutex<HashMap<Key, i128>>,
    /// How many keys `sums` holds: decisions read it without the lock, and take the lock
    /// only when some key is refused.
    held: AtomicUsize,
}

impl RefusedSums {
    /// Publishes `remote` as `key`'s remote sum in `store`; whether the store refused it (at
    /// its key cap), in which case the key is kept with its sum to publish again.
    pub fn publish(&self, store: &LaneStore, key: &Key, remote: i128) -> bool {
        let mut sums = self.lock();
        let refused = store.publish_remote(key, remote).is_err();
        if refused {
            sums.insert(key.clone(), remote);
        } else {
            sums.remove(key);
        }
        self.held.store(sums.len(), Ordering::Release);
        refused
    }

    /// Publishes every kept key's remote sum again, as `remote_sum` reads it now, and keeps
    /// the ones the store refuses again. A key whose window is no longer live at
    /// `now_unix_secs` (the second the store just expired by) is dropped unpublished: the
    /// gossip's map expires on its own rounds, so it may still hold the key, and the room
    /// expiry just made is for live keys. So is a key `remote_sum` has none for.
    pub fn retry(
        &self,
        store: &LaneStore,
        now_unix_secs: u64,
        remote_sum: impl Fn(&Key) -> Option<i128>,
    ) {
        let mut sums = self.lock();
        sums.retain(|key, sum| {
            if !key.window.is_live(now_unix_secs) {
                return false;
            }
            match remote_sum(key) {
                Some(remote) => {
                    *sum = remote;
                    store.publish_remote(key, remote).is_err()
                }
                None => false,
            }
        });
        self.held.store(sums.len(), Ordering::Release);
    }

    /// `key`'s count: its remote sum kept here if the store refused it, else what `count`
    /// reads in the store. Read under the lock when any key is kept, so that a sum the
    /// store takes meanwhile is counted once, here or there.
    pub fn count(&self, key: KeyRef<'_>, count: impl FnOnce(KeyRef<'_>) -> i128) -> i128 {
        if self.held.load(Ordering::Acquire) == 0 {
            return count(key);
        }
        let sums = self.lock();
        match sums.get(&key.to_key()) {
            Some(&sum) => sum,
            None => count(key),
        }
    }

    /// How many keys are kept.
    #[cfg(all(test, not(tally_loom)))]
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no key is kept.
    #[cfg(all(test, not(tally_loom)))]
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Key, i128>> {
        // Every critical section leaves the map whole: a panic in one loses nothing.
        self.sums
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

// The lane store runs on loom's atomics under `tally_loom`, which work only inside a model.
#[cfg(test)]
#[cfg(not(tally_loom))]
mod tests {
    use super::*;
    use tally_crdt::{Generation, NodeId, ReplicaId, Rule, Subject, Window};

    fn key_in(subject: &str, window: Window) -> Key {
        Key::new(
            Rule::new("api").unwrap(),
            Subject::new(subject).unwrap(),
            window,
        )
    }

    #[test]
    fn a_sum_refused_at_the_cap_is_taken_once_expiry_makes_room() {
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 1);
        let ended = key_in("old", Window::new(1, 60).unwrap());
        let live = Window::new(1_000, 60).unwrap();
        let hot = key_in("hot", live);
        store.incr(&ended, 1).unwrap();
        store.collect(&mut Vec::new());
        let refused = RefusedSums::default();
        assert!(refused.publish(&store, &hot, 100), "the store is full");
        assert_eq!((store.estimate(&hot), refused.len()), (0, 1));
        let now = live.start_unix_secs();
        refused.retry(&store, now, |_| Some(100));
        assert_eq!((store.estimate(&hot), refused.len()), (0, 1), "still full");

        assert_eq!(store.expire(now), 1);
        // The peers' sum rose meanwhile: the retry publishes it as it is now.
        refused.retry(&store, now, |_| Some(150));
        assert_eq!(store.estimate(&hot), 150);
        assert!(refused.is_empty());
        // And a client's write counts on top of it, not from zero.
        assert_eq!(store.incr(&hot, 1).unwrap().estimate, 151);
    }

    #[test]
    fn a_refused_key_whose_window_ended_takes_none_of_the_room_expiry_made() {
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 1);
        let ended = Window::new(1, 60).unwrap();
        store.incr(&key_in("own", ended), 1).unwrap();
        store.collect(&mut Vec::new());
        let refused = RefusedSums::default();
        assert!(refused.publish(&store, &key_in("peer", ended), 100));
        // The gossip's map, expiring on its own rounds, still holds the peer's key.
        let now = ended.live_until_unix_secs();
        assert_eq!(store.expire(now), 1);
        refused.retry(&store, now, |_| Some(100));
        assert!(refused.is_empty(), "dropped, not kept");
        let fresh = key_in("fresh", Window::new(now / 60, 60).unwrap());
        assert_eq!(
            store.incr(&fresh, 1).unwrap().estimate,
            1,
            "the room is a live key's"
        );
    }

    #[test]
    fn a_refused_key_the_map_no_longer_holds_is_dropped_and_a_taken_one_forgotten() {
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 1);
        let window = Window::new(1_000, 60).unwrap();
        let (a, b) = (key_in("a", window), key_in("b", window));
        let refused = RefusedSums::default();
        assert!(!refused.publish(&store, &a, 5));
        assert!(refused.publish(&store, &b, 7));
        refused.retry(&store, window.start_unix_secs(), |_| None);
        assert!(refused.is_empty(), "no sum to publish: dropped");
        assert!(refused.publish(&store, &b, 7));
        assert_eq!(refused.len(), 1);
        assert!(store.remove(&a));
        assert!(!refused.publish(&store, &b, 8), "taken");
        assert!(refused.is_empty());
        assert_eq!(store.estimate(&b), 8);
    }
}
