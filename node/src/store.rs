//! The lane store: this node's own lanes for every key it counts, written by many
//! application threads at once, and per key the sum of the other replicas' lanes as gossip
//! last merged them.
//!
//! Writers never take a lock and never wait for each other: a write is a checked add on the
//! key's slot. Reads ([`LaneStore::own`], [`LaneStore::estimate`]) never take a lock either;
//! an estimate only retries while the gossip task is between the two stores of a publish
//! to the same key.
//! The gossip task is the other side: [`LaneStore::collect`] hands it every own lane that
//! changed, and [`LaneStore::publish_remote`] takes back what it merged from peers.
//!
//! The store never does IO, never reads a clock, never holds other replicas' lanes (only
//! their sum), and never wraps a lane: a write that would pass `u64::MAX` is refused whole.
//! It never holds more than `keys_max` keys.
//!
//! # Architecture Invariant: no increment is lost between a write and a collection
//!
//! Each key's `Slot` has its two totals and a dirty flag, and the store has one queue of
//! keys whose slot went from clean to dirty.
//!
//! - A write adds to a total, then sets the flag (`Release`); the writer that finds the
//!   flag clear queues the key.
//! - A collection pops a key, clears the flag (`Acquire`), then reads the totals.
//!
//! A write that found the flag already set did so before the collector cleared it (the
//! read-modify-writes of one atomic are totally ordered), so the collector's `Acquire`
//! clear makes that write's add visible to the reads after it. A write that found the flag
//! clear queued the key again, for the next collection.
//!
//! Enforced by: the loom models at the bottom of this file
//! (`two_writers_and_a_collector_lose_no_increment`, with two deliberately broken
//! collectors as negative controls that must lose a write) and the unit test
//! `concurrent_writes_and_collections_lose_nothing`.

use crate::sync::{wait_a_moment, AtomicU32, AtomicU64, AtomicU8, Ordering};
use crossbeam_queue::SegQueue;
use foldhash::fast::{FoldHasher, SeedableRandomState};
use foldhash::SharedSeed;
use papaya::{Equivalent, Guard};
use std::fmt;
use std::hash::{BuildHasher, Hash, RandomState};
// Not from `crate::sync`: the key count is not part of the slot protocol that the loom
// models check, and the store's map and queue are not loom-aware anyway.
use std::sync::atomic::AtomicUsize;
use std::sync::OnceLock;
use tally_crdt::{Key, KeyRef, Lane, Overflow, ReplicaId};
use tokio::sync::Notify;

/// One replica's own lanes and the remote sums, shared by every thread as `Arc<LaneStore>`.
pub struct LaneStore {
    replica: ReplicaId,
    keys_max: usize,
    // papaya rather than dashmap: reads and writes to existing keys never lock (dashmap
    // takes a shard lock for every read, so a hot key's readers contend on the shard's
    // lock word), and its entries are one exact-size allocation each with a 9-byte table
    // slot, where dashmap's tables double in place and sit half empty after each growth.
    // Looked up by `KeyRef`, so that a write to a held key allocates nothing.
    slots: papaya::HashMap<Key, Slot, KeyHasher>,
    // Keys whose slot went from clean to dirty. A key is here at most once: its slot stays
    // dirty from the push until a collection pops it and takes the slot.
    dirty: SegQueue<Key>,
    // Raised after each push to `dirty`, so the collector can sleep while nothing changes.
    queued: Notify,
    // Keys held plus keys being inserted. Invariant: never above `keys_max`, because an
    // insert reserves its place here first and gives it back if it does not insert.
    keys: AtomicUsize,
}

/// What a write left behind: the key's own lane and its estimate just after the write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    /// The own lane's totals after the write (and any writes that landed alongside it).
    pub own: Lane,
    /// `own`'s value plus the remote sum last published: what [`LaneStore::estimate`]
    /// would have read at that moment.
    pub estimate: i128,
}

/// Why a write or a publish counted nothing. Nothing changed in either case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The write would take the lane past `u64::MAX`. Lanes never wrap.
    #[error(transparent)]
    Overflow(#[from] Overflow),
    /// The key is new and the store already holds `keys_max` keys, counting the keys other
    /// threads are creating at that moment; so a creation racing others near the cap may be
    /// refused a little early.
    #[error("keys: the store holds its maximum of {keys_max} keys; nothing counted")]
    KeysFull {
        /// The configured maximum.
        keys_max: usize,
    },
}

impl LaneStore {
    /// An empty store for `replica`'s lanes, holding at most `keys_max` keys.
    pub fn new(replica: ReplicaId, keys_max: usize) -> LaneStore {
        LaneStore {
            replica,
            keys_max,
            slots: papaya::HashMap::with_hasher(KeyHasher::new()),
            dirty: SegQueue::new(),
            queued: Notify::new(),
            keys: AtomicUsize::new(0),
        }
    }

    /// The replica whose lanes these are.
    pub fn replica(&self) -> ReplicaId {
        self.replica
    }

    /// Adds `amount` to the key's own increments and returns its own lane after the write
    /// (with any writes that landed alongside) and the estimate that follows from it, from
    /// the same lookup. Creates the key if it is new. On error nothing changed.
    pub fn incr<'k>(&self, key: impl Into<KeyRef<'k>>, amount: u64) -> Result<Counted, StoreError> {
        self.write(key.into(), amount, Slot::incr)
    }

    /// Adds `amount` to the key's own decrements and returns its own lane and estimate after
    /// the write. Creates the key if it is new. On error nothing changed.
    pub fn decr<'k>(&self, key: impl Into<KeyRef<'k>>, amount: u64) -> Result<Counted, StoreError> {
        self.write(key.into(), amount, Slot::decr)
    }

    /// The key's own lane: zero if the store does not hold the key.
    ///
    /// The two totals are read one after the other, so a write landing in between may be
    /// seen in one and not the other; each is a total the lane really had, which is all a
    /// merge (the larger of each total) needs.
    pub fn own<'k>(&self, key: impl Into<KeyRef<'k>>) -> Lane {
        let guard = self.slots.guard();
        self.slots
            .get(&key.into(), &guard)
            .map(Slot::own)
            .unwrap_or_default()
    }

    /// The key's estimate: its own lane's value plus the remote sum last published, exact in
    /// `i128`. Zero if the store does not hold the key.
    pub fn estimate<'k>(&self, key: impl Into<KeyRef<'k>>) -> i128 {
        let guard = self.slots.guard();
        self.slots
            .get(&key.into(), &guard)
            .map_or(0, Slot::estimate)
    }

    /// Sets the key's remote sum: the sum of every other replica's lane as gossip last merged
    /// them. Creates the key if it is new; the only error is
    /// [`StoreError::KeysFull`], and then nothing changed.
    ///
    /// Meant for one gossip task: concurrent publishes to one key are safe but wait for each
    /// other. A publish racing the removal of its key may leave with the removed key.
    pub fn publish_remote(&self, key: &Key, remote: i128) -> Result<(), StoreError> {
        let guard = self.slots.guard();
        let (_, slot) = self.slot_or_insert(key.into(), &guard)?;
        slot.publish_remote(remote);
        Ok(())
    }

    /// Appends to `out` every own lane that changed since it was last collected, with its
    /// totals. Each key appears at most once per call.
    ///
    /// A write racing the collection is never lost: it is either in the totals collected
    /// now or its key is queued for the next collection. Only the keys queued when the call
    /// starts are taken, so writers that keep writing cannot keep it from returning.
    pub fn collect(&self, out: &mut Vec<(Key, Lane)>) {
        let guard = self.slots.guard();
        for _ in 0..self.dirty.len() {
            let Some(key) = self.dirty.pop() else {
                // Another collection took the rest.
                break;
            };
            let Some(slot) = self.slots.get(&key, &guard) else {
                unreachable!(
                    "queued key {key} has no slot: a queued key's slot stays dirty until \
                     collected, and only a clean slot is removed"
                );
            };
            out.push((key, slot.take()));
        }
    }

    /// Removes the key if it has nothing left to collect; returns whether it was removed.
    /// A key absent, or with writes not yet collected, stays (collect, then remove again).
    ///
    /// Removal is for windows that are over. A key written again after its removal starts
    /// a new lane from zero, which peers holding the old totals ignore until it passes them
    /// (a merge keeps the larger total), so the node refuses writes to windows that are no
    /// longer live. A write racing the removal is not lost to the store: it lands either
    /// before it (and the key stays) or in the key's new slot.
    pub fn remove(&self, key: &Key) -> bool {
        let guard = self.slots.guard();
        self.unlink(key, Slot::retire, &guard)
    }

    /// Removes every key whose window is no longer live at `now_unix_secs` (see
    /// [`tally_crdt::Window::is_live`]) and has nothing left to collect; returns how many
    /// were removed. Keys with writes not yet collected stay for the next call.
    pub fn expire(&self, now_unix_secs: u64) -> usize {
        let guard = self.slots.guard();
        let mut removed = 0;
        for (key, _) in self.slots.iter(&guard) {
            if !key.window.is_live(now_unix_secs) && self.unlink(key, Slot::retire, &guard) {
                removed += 1;
            }
        }
        removed
    }

    /// Frees the memory this thread retired: removed keys' slots, and the map's old tables.
    ///
    /// papaya replaces its table as it grows and hands the old one to its reclamation
    /// scheme, which frees retired memory a batch at a time, per thread, once the batch
    /// fills; removals are rare between resizes, so without this the old tables would stay,
    /// as much again as the live one. They sit in the batch of the thread that finished the
    /// resize. In tallyd writes, merges and expiry all run on the runtime's one thread,
    /// whose gossip task calls this once a second; writer threads of their own keep theirs
    /// until their batch fills. A flush is a system call (`membarrier`) even when there is
    /// nothing to free.
    pub fn reclaim(&self) {
        self.slots.guard().flush();
    }

    /// Calls `f` with every key held and its own lane, as read at that moment.
    pub fn for_each_own(&self, mut f: impl FnMut(&Key, Lane)) {
        let guard = self.slots.guard();
        for (key, slot) in self.slots.iter(&guard) {
            f(key, slot.own());
        }
    }

    /// Completes once a key has been queued for collection since this last completed (at
    /// once if one was). A key queued after it completes makes the next call complete; so a
    /// collector that waits on this, then calls [`LaneStore::collect`], leaves no key
    /// behind, and sleeps while nothing is written. It may complete for keys a collection
    /// already took. Meant for one collector: a second would take the other's wake-ups.
    pub async fn queued(&self) {
        self.queued.notified().await;
    }

    /// How many keys the store holds, counting keys being created at this moment.
    pub fn len(&self) -> usize {
        self.keys.load(Ordering::Relaxed)
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn write(
        &self,
        key: KeyRef<'_>,
        amount: u64,
        add: fn(&Slot, u64) -> Result<Written, Overflow>,
    ) -> Result<Counted, StoreError> {
        let guard = self.slots.guard();
        loop {
            let (held, slot) = self.slot_or_insert(key, &guard)?;
            match add(slot, amount)? {
                Written::Counted { lane, queue } => {
                    if queue {
                        self.dirty.push(held.clone());
                        self.queued.notify_one();
                    }
                    // The remote sum is read after the write, so the estimate includes
                    // this write and every remote merge published before it.
                    return Ok(Counted {
                        own: lane,
                        estimate: lane.value() + slot.remote(),
                    });
                }
                Written::Retired => {
                    // `remove` retired this slot after our lookup and is taking it out of
                    // the map. Finish that for it, so this write never waits on the
                    // remover, then count in the key's next slot.
                    self.unlink(&key, |current| std::ptr::eq(current, slot), &guard);
                }
            }
        }
    }

    /// The key as the map holds it, and its slot. A new key is built and inserted first, if
    /// there is room: the only allocation of a write.
    fn slot_or_insert<'g>(
        &self,
        key: KeyRef<'_>,
        guard: &'g impl Guard,
    ) -> Result<(&'g Key, &'g Slot), StoreError> {
        loop {
            if let Some(held) = self.slots.get_key_value(&key, guard) {
                return Ok(held);
            }
            let keys_max = self.keys_max;
            let reserved = self
                .keys
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |keys| {
                    (keys < keys_max).then_some(keys + 1)
                });
            if reserved.is_err() {
                // Another thread may have created the key since our lookup: then it is not new.
                return self
                    .slots
                    .get_key_value(&key, guard)
                    .ok_or(StoreError::KeysFull { keys_max });
            }
            if self
                .slots
                .try_insert(key.to_key(), Slot::new(), guard)
                .is_err()
            {
                // Another thread created it meanwhile.
                self.keys.fetch_sub(1, Ordering::Relaxed);
            }
            // Held now, unless a `remove` took it again meanwhile: then the next turn
            // creates it anew.
        }
    }

    /// Removes the key's slot if `which` says so, and gives its place back to `keys`.
    fn unlink<Q>(&self, key: &Q, mut which: impl FnMut(&Slot) -> bool, guard: &impl Guard) -> bool
    where
        Q: Hash + Equivalent<Key> + ?Sized,
    {
        let removed = self.slots.remove_if(key, |_, slot| which(slot), guard);
        let removed = matches!(removed, Ok(Some(_)));
        if removed {
            self.keys.fetch_sub(1, Ordering::Relaxed);
        }
        removed
    }
}

impl fmt::Debug for LaneStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaneStore")
            .field("replica", &self.replica)
            .field("keys", &self.len())
            .field("keys_max", &self.keys_max)
            .field("queued", &self.dirty.len())
            .finish()
    }
}

/// The hasher of the store's map and of the node's rule table: foldhash, keyed from the
/// OS's randomness.
///
/// Subjects come from clients, so the hasher must resist chosen collisions: its seeds are
/// secret and differ between processes (the shared seed) and between maps (the per-map
/// seed), both drawn through std's `RandomState`, whose keys come from the OS. foldhash
/// costs a few nanoseconds per key where SipHash cost tens; its resistance is weaker
/// (it does not claim to hold against an attacker who studies a long-running process to
/// recover its seeds), and the map never holds more than `keys_max` keys either way.
#[derive(Clone, Debug)]
pub struct KeyHasher(SeedableRandomState);

impl KeyHasher {
    /// A hasher with fresh per-map seeds, under this process's shared seeds.
    pub fn new() -> KeyHasher {
        static SHARED: OnceLock<SharedSeed> = OnceLock::new();
        let os = RandomState::new();
        let shared = SHARED.get_or_init(|| SharedSeed::from_u64(os.hash_one("shared")));
        KeyHasher(SeedableRandomState::with_seed(os.hash_one("map"), shared))
    }
}

impl Default for KeyHasher {
    fn default() -> KeyHasher {
        KeyHasher::new()
    }
}

impl BuildHasher for KeyHasher {
    type Hasher = FoldHasher<'static>;

    fn build_hasher(&self) -> FoldHasher<'static> {
        self.0.build_hasher()
    }
}

/// One key's own lane, remote sum and collection state: the part of the store that the
/// loom models check, so every atomic the protocol relies on lives here.
///
/// 40 bytes with std's atomics, one exact allocation together with its key in the map.
#[derive(Debug)]
struct Slot {
    // Invariant: the totals only grow, by checked adds, so a lane never wraps. The one
    // exception is a write taken back from a retired slot, whose totals nobody collects.
    incr: AtomicU64,
    decr: AtomicU64,
    // The remote sum, an i128 in two halves behind a seqlock: `remote_seq` is odd while a
    // publish is under way, and each publish adds 2. A reader that sees the same even
    // `remote_seq` before and after reading both halves read one publish whole. A u32
    // only wraps if a reader stalls between its two loads for 2^31 publishes of one key.
    remote_hi: AtomicU64,
    remote_lo: AtomicU64,
    remote_seq: AtomicU32,
    // DIRTY: written since last taken; the key is queued, or about to be by the writer that
    // set it, or being collected. RETIRED: removed from the map, never cleared. Invariant:
    // a dirty slot is never retired.
    state: AtomicU8,
}

const DIRTY: u8 = 1;
const RETIRED: u8 = 2;

// The memory budget per key is tight and the map holds a slot per key; a new field
// should be a decision, not an accident. Loom's atomics are larger, so only std's count.
#[cfg(not(tally_loom))]
const _: () = assert!(std::mem::size_of::<Slot>() == 40, "Slot grew past 40 bytes");

/// What a write did to a slot.
#[derive(Debug)]
enum Written {
    /// The write counted; `lane` is the own lane just after it. `queue`: the slot was
    /// clean, so this writer must queue the key.
    Counted { lane: Lane, queue: bool },
    /// The slot was retired before the write landed. The write was taken back; count it
    /// in the key's next slot.
    Retired,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            incr: AtomicU64::new(0),
            decr: AtomicU64::new(0),
            remote_hi: AtomicU64::new(0),
            remote_lo: AtomicU64::new(0),
            remote_seq: AtomicU32::new(0),
            state: AtomicU8::new(0),
        }
    }

    fn incr(&self, amount: u64) -> Result<Written, Overflow> {
        self.add(&self.incr, "incr", amount)
    }

    fn decr(&self, amount: u64) -> Result<Written, Overflow> {
        self.add(&self.decr, "decr", amount)
    }

    fn add(
        &self,
        total: &AtomicU64,
        field: &'static str,
        amount: u64,
    ) -> Result<Written, Overflow> {
        // Relaxed: the `Release` on `state` just below is what hands this add to the
        // collector, and no other thread reads anything through the total itself.
        total
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |total| {
                total.checked_add(amount)
            })
            .map_err(|total| Overflow {
                field,
                total,
                amount,
            })?;
        // After the add, never before: a collector that clears the flag after this sets it
        // must see the add (see the module doc).
        let state = self.state.fetch_or(DIRTY, Ordering::Release);
        if state & RETIRED != 0 {
            total.fetch_sub(amount, Ordering::Relaxed);
            return Ok(Written::Retired);
        }
        Ok(Written::Counted {
            lane: self.own(),
            queue: state & DIRTY == 0,
        })
    }

    fn own(&self) -> Lane {
        Lane::new(
            self.incr.load(Ordering::Relaxed),
            self.decr.load(Ordering::Relaxed),
        )
    }

    fn estimate(&self) -> i128 {
        self.own().value() + self.remote()
    }

    /// Clears the dirty flag, then reads the totals: the collector's half of the protocol.
    /// Called only by the collector that popped the slot's key.
    fn take(&self) -> Lane {
        // Acquire: every write whose `Release` set the flag before this clear is visible to
        // the reads below. Writes after it find the flag clear and queue the key again.
        self.state.fetch_and(!DIRTY, Ordering::Acquire);
        self.own()
    }

    /// Marks the slot removed if it is clean; returns whether it is retired now. Stays true
    /// once true, because the map may ask again while it completes the removal.
    fn retire(&self) -> bool {
        // Relaxed: the decision reads only `state`; a write that lands after this finds
        // RETIRED in its own read-modify-write of `state` and takes itself back.
        match self
            .state
            .compare_exchange(0, RETIRED, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => true,
            Err(state) => state & RETIRED != 0,
        }
    }

    fn publish_remote(&self, remote: i128) {
        // Take the seqlock: move `remote_seq` from even to odd. Acquire orders this publish
        // after the previous one, so their halves never mix.
        let seq = loop {
            let seq = self.remote_seq.load(Ordering::Relaxed);
            if seq.is_multiple_of(2)
                && self
                    .remote_seq
                    .compare_exchange(
                        seq,
                        seq.wrapping_add(1),
                        Ordering::Acquire,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                break seq;
            }
            wait_a_moment();
        };
        let (hi, lo) = split(remote);
        // Release on each half: a reader that sees either half of this publish also sees
        // the odd `remote_seq` above when it checks again, and retries.
        self.remote_hi.store(hi, Ordering::Release);
        self.remote_lo.store(lo, Ordering::Release);
        self.remote_seq
            .store(seq.wrapping_add(2), Ordering::Release);
    }

    /// The remote sum from one publish, never two publishes' halves mixed. Retries only
    /// while a publish of this key is between its stores.
    fn remote(&self) -> i128 {
        loop {
            // Acquire: the halves written before this even value are visible below.
            let before = self.remote_seq.load(Ordering::Acquire);
            if before.is_multiple_of(2) {
                let hi = self.remote_hi.load(Ordering::Acquire);
                let lo = self.remote_lo.load(Ordering::Acquire);
                // Relaxed is enough: if either half came from a later publish, the Acquire
                // load of it makes that publish's odd `remote_seq` visible here.
                if self.remote_seq.load(Ordering::Relaxed) == before {
                    return join(hi, lo);
                }
            }
            wait_a_moment();
        }
    }
}

/// An i128 as its high and low 64 bits.
fn split(value: i128) -> (u64, u64) {
    ((value >> 64) as u64, value as u64)
}

/// The inverse of [`split`].
fn join(hi: u64, lo: u64) -> i128 {
    (i128::from(hi as i64) << 64) | i128::from(lo)
}

#[cfg(test)]
#[cfg(not(tally_loom))]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::future::Future;
    use std::sync::Arc;
    use tally_crdt::{Generation, NodeId, Rule, Subject, Window};

    fn store(keys_max: usize) -> LaneStore {
        LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), keys_max)
    }

    fn key(subject: &str) -> Key {
        key_in(subject, Window::new(1, 60).unwrap())
    }

    fn key_in(subject: &str, window: Window) -> Key {
        Key::new(
            Rule::new("login").unwrap(),
            Subject::new(subject).unwrap(),
            window,
        )
    }

    fn collected(store: &LaneStore) -> Vec<(Key, Lane)> {
        let mut out = Vec::new();
        store.collect(&mut out);
        out
    }

    /// Whether a fresh `queued()` completes at its first poll.
    fn wakes(store: &LaneStore) -> bool {
        let queued = std::pin::pin!(store.queued());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        queued.poll(&mut cx).is_ready()
    }

    #[test]
    fn a_key_queued_wakes_the_collector_once_and_a_write_to_a_queued_key_does_not() {
        let store = store(8);
        let (a, b, c) = (key("a"), key("b"), key("c"));
        assert!(!wakes(&store), "nothing written, nothing to wake for");

        store.incr(&a, 1).unwrap();
        assert!(wakes(&store), "the write queued `a`");
        assert!(!wakes(&store), "one wake-up per queued key, taken");
        store.incr(&a, 1).unwrap();
        assert!(
            !wakes(&store),
            "`a` was queued already: nothing new to collect"
        );

        assert_eq!(collected(&store), vec![(a.clone(), Lane::new(2, 0))]);
        store.decr(&a, 1).unwrap();
        assert!(
            wakes(&store),
            "collected, `a` is queued again by its next write"
        );

        store.incr(&b, 1).unwrap();
        store.incr(&c, 1).unwrap();
        assert!(
            wakes(&store),
            "two keys queued while no collector waited: one wake-up"
        );
        assert!(!wakes(&store));
        assert_eq!(
            collected(&store).len(),
            3,
            "the wake-up's collection takes all three"
        );
    }

    #[test]
    fn a_collector_waiting_for_a_key_is_woken_by_the_write_that_queues_it() {
        struct Count(AtomicUsize);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let store = store(8);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = std::task::Waker::from(count.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        let mut queued = std::pin::pin!(store.queued());
        assert!(queued.as_mut().poll(&mut cx).is_pending());

        store.incr(&key("a"), 1).unwrap();
        assert_eq!(
            count.0.load(Ordering::Relaxed),
            1,
            "the waiting collector was woken"
        );
        assert!(queued.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn a_collector_woken_only_by_queued_keys_misses_no_write() {
        let (store, writers) = spawn_writers(3, 20_000, 10);
        // The collector never collects but when woken: a lost wake-up leaves a write behind
        // with nothing to wake it, and the wait below times out.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let lanes = runtime.block_on(async {
            let mut lanes: HashMap<Key, Lane> = HashMap::new();
            while lanes.len() < writers.keys || lanes.values().any(|lane| *lane != writers.lane) {
                tokio::time::timeout(std::time::Duration::from_secs(10), store.queued())
                    .await
                    .expect("writes are left uncollected and no wake-up came for them");
                lanes.extend(collected(&store));
            }
            lanes
        });
        writers.join();
        assert_eq!(lanes.len(), 10);
        // A write racing the last collection may have queued its key again, already
        // collected: what is left is at most those keys, at the same totals.
        for (key, lane) in collected(&store) {
            assert_eq!(lane, lanes[&key], "{key} was collected whole");
        }
    }

    #[test]
    fn the_store_is_shared_across_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<LaneStore>();
    }

    #[test]
    fn overflowing_increment_is_refused_and_counts_nothing() {
        let store = store(8);
        let a = key("a");
        assert_eq!(
            store.incr(&a, u64::MAX - 1).map(|c| c.own),
            Ok(Lane::new(u64::MAX - 1, 0))
        );
        let err = store.incr(&a, 2).unwrap_err();
        assert_eq!(
            err,
            StoreError::Overflow(Overflow {
                field: "incr",
                total: u64::MAX - 1,
                amount: 2
            })
        );
        assert!(err
            .to_string()
            .contains("incr total 18446744073709551614 cannot take 2"));
        assert_eq!(
            store.decr(&a, u64::MAX),
            Ok(Counted {
                own: Lane::new(u64::MAX - 1, u64::MAX),
                estimate: -1
            })
        );
        assert!(matches!(
            store.decr(&a, 1),
            Err(StoreError::Overflow(Overflow { field: "decr", .. }))
        ));
        assert_eq!(store.own(&a), Lane::new(u64::MAX - 1, u64::MAX));
        assert_eq!(
            collected(&store),
            vec![(a, Lane::new(u64::MAX - 1, u64::MAX))]
        );
    }

    #[test]
    fn a_key_written_by_its_borrowed_parts_is_the_key_held() {
        let store = store(8);
        let a = key("a");
        let rule = Rule::new("login").unwrap();
        let borrowed = KeyRef::new(&rule, "a", a.window).unwrap();
        store.incr(borrowed, 2).unwrap();
        store.incr(&a, 3).unwrap();
        store.decr(borrowed, 1).unwrap();
        assert_eq!(store.len(), 1, "one key, whichever way it is named");
        assert_eq!(store.own(borrowed), Lane::new(5, 1));
        assert_eq!(store.estimate(&a), 4);
        assert_eq!(collected(&store), vec![(a, Lane::new(5, 1))]);
    }

    #[test]
    fn keys_past_the_cap_are_refused() {
        let store = store(2);
        let (a, b, c) = (key("a"), key("b"), key("c"));
        store.incr(&a, 1).unwrap();
        store.publish_remote(&b, 5).unwrap();
        let full = StoreError::KeysFull { keys_max: 2 };
        assert_eq!(store.incr(&c, 1), Err(full));
        assert_eq!(store.decr(&c, 1), Err(full));
        assert_eq!(store.publish_remote(&c, 1), Err(full));
        assert_eq!(
            full.to_string(),
            "keys: the store holds its maximum of 2 keys; nothing counted"
        );
        assert_eq!(
            (store.len(), store.own(&c), store.estimate(&c)),
            (2, Lane::default(), 0)
        );
        assert_eq!(
            store.incr(&a, 1).map(|c| c.own),
            Ok(Lane::new(2, 0)),
            "a held key still counts at the cap"
        );

        collected(&store);
        assert!(store.remove(&a));
        assert_eq!(
            store.incr(&c, 1).map(|c| c.own),
            Ok(Lane::new(1, 0)),
            "a removal frees a place"
        );
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn collect_returns_each_changed_lane_once() {
        let store = store(8);
        let (a, b, c) = (key("a"), key("b"), key("c"));
        store.incr(&a, 1).unwrap();
        store.incr(&b, 2).unwrap();
        store.decr(&a, 3).unwrap();
        store.incr(&a, 4).unwrap();
        store.publish_remote(&c, 9).unwrap();
        assert_eq!(
            collected(&store),
            vec![(a.clone(), Lane::new(5, 3)), (b, Lane::new(2, 0))],
            "in the order the keys first changed; a remote sum is not an own lane"
        );
        assert_eq!(collected(&store), vec![]);
        store.decr(&a, 1).unwrap();
        assert_eq!(collected(&store), vec![(a, Lane::new(5, 4))]);
    }

    #[test]
    fn estimate_is_own_plus_published_remote() {
        let store = store(8);
        let a = key("a");
        assert_eq!(store.estimate(&a), 0);
        store.incr(&a, 5).unwrap();
        store.decr(&a, 2).unwrap();
        assert_eq!(store.estimate(&a), 3);
        store.publish_remote(&a, -10).unwrap();
        assert_eq!(store.estimate(&a), -7);
        assert_eq!(
            store.incr(&a, 1).map(|c| c.estimate),
            Ok(-6),
            "a write returns the estimate it leaves"
        );
        store.decr(&a, 1).unwrap();
        let beyond_u64 = 3 * i128::from(u64::MAX);
        store.publish_remote(&a, beyond_u64).unwrap();
        assert_eq!(
            store.estimate(&a),
            beyond_u64 + 3,
            "the remote sum is exact in i128"
        );

        let b = key("b");
        store.publish_remote(&b, 7).unwrap();
        assert_eq!(
            (store.estimate(&b), store.own(&b), store.len()),
            (7, Lane::default(), 2)
        );
    }

    #[test]
    fn remote_sums_round_trip_through_their_halves() {
        for value in [
            0,
            1,
            -1,
            i128::from(u64::MAX),
            -i128::from(u64::MAX),
            i128::MIN,
            i128::MAX,
        ] {
            let (hi, lo) = split(value);
            assert_eq!(join(hi, lo), value);
        }
    }

    #[test]
    fn a_key_with_uncollected_writes_is_not_removed() {
        let store = store(8);
        let a = key("a");
        assert!(!store.remove(&a), "absent");
        store.incr(&a, 1).unwrap();
        assert!(!store.remove(&a), "written and not yet collected");
        assert_eq!(collected(&store), vec![(a.clone(), Lane::new(1, 0))]);
        assert!(store.remove(&a));
        assert_eq!((store.len(), store.own(&a)), (0, Lane::default()));
        assert!(store.is_empty());
    }

    #[test]
    fn expire_drops_finished_windows_once_collected() {
        let store = store(8);
        let old = key_in("a", Window::new(0, 60).unwrap());
        let current = key_in("a", Window::new(1, 60).unwrap());
        store.incr(&old, 1).unwrap();
        store.incr(&current, 1).unwrap();
        // Window 0 is live until 120 s: one length past its end, for sliding windows.
        assert_eq!(store.expire(119), 0);
        assert_eq!(
            store.expire(120),
            0,
            "the old window's write is not collected yet"
        );
        collected(&store);
        assert_eq!(store.expire(120), 1);
        assert_eq!(
            (store.len(), store.own(&old), store.own(&current)),
            (1, Lane::default(), Lane::new(1, 0))
        );
    }

    /// What [`spawn_writers`] started.
    struct Writers {
        threads: Vec<std::thread::JoinHandle<()>>,
        /// How many keys they write.
        keys: usize,
        /// Every key's own lane once they are done.
        lane: Lane,
    }

    impl Writers {
        fn finished(&self) -> bool {
            self.threads
                .iter()
                .all(std::thread::JoinHandle::is_finished)
        }

        fn join(self) {
            self.threads
                .into_iter()
                .for_each(|writer| writer.join().unwrap());
        }
    }

    /// `threads` threads each making `writes` writes over `keys` keys of a new store, every
    /// key as often; the last thread decrements, the others increment.
    fn spawn_writers(threads: u64, writes: u64, keys: u64) -> (Arc<LaneStore>, Writers) {
        // Room for every key plus one creation in flight per thread, so that no creation is
        // refused for racing another near the cap.
        let store = Arc::new(store((keys + threads) as usize));
        let names: Arc<Vec<Key>> = Arc::new((0..keys).map(|k| key(&format!("user-{k}"))).collect());
        let handles = (0..threads)
            .map(|thread| {
                let (store, names) = (store.clone(), names.clone());
                std::thread::spawn(move || {
                    for write in 0..writes {
                        let key = &names[((write + thread * 7) % keys) as usize];
                        if thread == threads - 1 {
                            store.decr(key, 1).unwrap();
                        } else {
                            store.incr(key, 1).unwrap();
                        }
                    }
                })
            })
            .collect();
        let per_key = writes / keys;
        let writers = Writers {
            threads: handles,
            keys: keys as usize,
            lane: Lane::new((threads - 1) * per_key, per_key),
        };
        (store, writers)
    }

    #[test]
    fn concurrent_writes_and_collections_lose_nothing() {
        // Both totals race collections: the last thread decrements.
        let (store, writers) = spawn_writers(4, 100_000, 100);

        let mut lanes: HashMap<Key, Lane> = HashMap::new();
        let mut record = |batch: Vec<(Key, Lane)>| {
            for (key, lane) in batch {
                let before = lanes.entry(key).or_default();
                assert!(
                    lane.covers(*before),
                    "collected lanes never go back: {lane:?} after {before:?}"
                );
                *before = lane;
            }
        };
        while !writers.finished() {
            record(collected(&store));
        }
        let (keys, expected) = (writers.keys, writers.lane);
        writers.join();
        record(collected(&store));

        assert_eq!(lanes.len(), keys);
        for (key, lane) in &lanes {
            assert_eq!(*lane, expected, "collected totals of {key}");
            assert_eq!(store.own(key), expected);
        }
        assert_eq!(collected(&store), vec![], "nothing is left queued");
    }
}

#[cfg(test)]
#[cfg(tally_loom)]
mod loom_models {
    //! Loom models of the slot protocol. They drive the real [`Slot`]; only the dirty queue
    //! is a stand-in (`SegQueue` is not loom-aware), used as `LaneStore` uses its queue.

    use super::*;
    use loom::sync::{Arc, Mutex};
    use loom::thread;
    use std::collections::VecDeque;

    /// One key as the store holds it: its slot, and a loom-aware queue for its key.
    struct OneKey {
        slot: Slot,
        queue: Mutex<VecDeque<()>>,
    }

    impl OneKey {
        fn new() -> OneKey {
            OneKey {
                slot: Slot::new(),
                queue: Mutex::new(VecDeque::new()),
            }
        }

        /// What `LaneStore::write` does with a slot's answer.
        fn write(&self, written: Result<Written, Overflow>) {
            match written.expect("the models' amounts never overflow") {
                Written::Counted { queue: true, .. } => self.queue.lock().unwrap().push_back(()),
                Written::Counted { queue: false, .. } => {}
                Written::Retired => panic!("no model retires this slot"),
            }
        }

        /// What `LaneStore::collect` does, with `take` as the collector under test.
        fn collect(&self, take: fn(&Slot) -> Lane, out: &mut Vec<Lane>) {
            loop {
                // Popped in its own statement, so the lock is not held across `take`.
                let popped = self.queue.lock().unwrap().pop_front();
                if popped.is_none() {
                    return;
                }
                out.push(take(&self.slot));
            }
        }
    }

    /// A model explored up to 5 preemptions per run: about 3 seconds for the two-writer
    /// model, where the unbounded search takes about 2.5 minutes on a 2-core machine. The
    /// negative controls' failures need 2. `LOOM_MAX_PREEMPTIONS` overrides the bound.
    fn bounded() -> loom::model::Builder {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound.get_or_insert(5);
        builder
    }

    /// Two writers (one writes twice) race a collection; a last collection runs after they
    /// join. Every collected lane covers the one before it, and the last one holds every
    /// write.
    fn check_no_write_is_lost(take: fn(&Slot) -> Lane) {
        bounded().check(move || {
            let key = Arc::new(OneKey::new());
            let incrementer = {
                let key = key.clone();
                thread::spawn(move || {
                    key.write(key.slot.incr(1));
                    key.write(key.slot.incr(2));
                })
            };
            let decrementer = {
                let key = key.clone();
                thread::spawn(move || key.write(key.slot.decr(4)))
            };
            let mut lanes = Vec::new();
            key.collect(take, &mut lanes);
            incrementer.join().unwrap();
            decrementer.join().unwrap();
            key.collect(take, &mut lanes);

            for pair in lanes.windows(2) {
                assert!(
                    pair[1].covers(pair[0]),
                    "collected lanes went back: {lanes:?}"
                );
            }
            assert_eq!(
                lanes.last(),
                Some(&Lane::new(3, 4)),
                "lost an increment: collected {lanes:?}"
            );
        });
    }

    #[test]
    fn two_writers_and_a_collector_lose_no_increment() {
        check_no_write_is_lost(Slot::take);
    }

    /// Negative control: reads the totals before clearing the flag. A write landing in
    /// between finds the flag still set, so it does not queue the key, and the clear then
    /// hides it from every later collection.
    #[test]
    #[should_panic(expected = "lost an increment")]
    fn a_collector_that_reads_before_clearing_loses_an_increment() {
        check_no_write_is_lost(|slot| {
            let lane = slot.own();
            slot.state.fetch_and(!DIRTY, Ordering::Acquire);
            lane
        });
    }

    /// Negative control: clears the flag with `Relaxed` instead of `Acquire`. A write that
    /// set the flag before the clear no longer happens-before the reads, which may then
    /// return the totals from before it.
    #[test]
    #[should_panic(expected = "lost an increment")]
    fn a_collector_that_clears_with_relaxed_loses_an_increment() {
        check_no_write_is_lost(|slot| {
            slot.state.fetch_and(!DIRTY, Ordering::Relaxed);
            slot.own()
        });
    }

    /// The remote sums a reader may see: the initial zero, then the one the publisher in
    /// `check_reads_are_whole_and_monotone` publishes. Both of its halves differ from zero's,
    /// so a read that mixed the two halves gives 1 or 2^64, outside this list.
    const PUBLISHED: [i128; 2] = [0, (1 << 64) | 1];

    /// A writer and a publisher race a reader that reads twice: each read of the remote
    /// sum is one published value, and neither it, the own lane nor the estimate goes back.
    fn check_reads_are_whole_and_monotone(remote: fn(&Slot) -> i128) {
        loom::model(move || {
            let slot = Arc::new(Slot::new());
            let writer = {
                let slot = slot.clone();
                thread::spawn(move || slot.incr(1).map(|_| ()))
            };
            let publisher = {
                let slot = slot.clone();
                thread::spawn(move || slot.publish_remote(PUBLISHED[1]))
            };
            let read = || (slot.own(), remote(&slot));
            let (first, second) = (read(), read());
            for (own, remote) in [first, second] {
                assert!(PUBLISHED.contains(&remote), "torn remote sum {remote}");
                assert!(own.incr <= 1 && own.decr == 0, "own lane {own:?}");
            }
            assert!(
                second.0.covers(first.0),
                "own lane went back: {first:?} then {second:?}"
            );
            assert!(
                second.1 >= first.1,
                "remote sum went back: {first:?} then {second:?}"
            );
            writer.join().unwrap().unwrap();
            publisher.join().unwrap();
            assert_eq!(slot.estimate(), 1 + PUBLISHED[1]);
        });
    }

    #[test]
    fn a_reader_sees_whole_and_monotone_totals() {
        check_reads_are_whole_and_monotone(Slot::remote);
    }

    /// Negative control: reads the two halves without the seqlock. (The expected message is
    /// the part common to a torn value and a value going back: loom may find either first.)
    #[test]
    #[should_panic(expected = "remote sum")]
    fn a_reader_without_the_seqlock_sees_a_torn_sum() {
        check_reads_are_whole_and_monotone(|slot| {
            join(
                slot.remote_hi.load(Ordering::Acquire),
                slot.remote_lo.load(Ordering::Acquire),
            )
        });
    }

    /// A write racing a removal either lands first, and the slot is not retired, or finds
    /// the slot retired and takes itself back, leaving nothing behind in it.
    #[test]
    fn a_write_racing_a_removal_lands_or_is_taken_back() {
        loom::model(|| {
            let slot = Arc::new(Slot::new());
            let writer = {
                let slot = slot.clone();
                thread::spawn(move || slot.incr(1))
            };
            let retired = slot.retire();
            match writer.join().unwrap().unwrap() {
                Written::Counted { queue, .. } => {
                    assert!(!retired, "a slot with an uncollected write was retired");
                    assert!(queue, "the first write to a clean slot queues its key");
                }
                Written::Retired => {
                    assert!(retired);
                    assert_eq!(
                        slot.own(),
                        Lane::default(),
                        "the refused write was taken back"
                    );
                }
            }
        });
    }
}
