//! The region's own lanes of its durable admissions: counted through the lane log as an
//! edge's writes are (logged, counted, and written out before this thread can run the
//! gossip task), so gossip carries them to the edges' estimates and a restart republishes
//! them.
//!
//! An admission is durable in the region log before it gets here, and its decision stands
//! whatever happens here. One the lane log has no room for (a full disk) is owed: kept per
//! key and counted in, before any later one, once the log has room again, so the edges'
//! estimates catch up without a restart. One past the lane store's key cap is not counted,
//! and its cost is counted as refused instead, for the metric.

use crate::clock;
use crate::lanelog::{LaneLog, LogError};
use crate::listener::write_out;
use crate::store::LaneStore;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tally_crdt::Key;

/// The region's own lanes, and what they owe.
pub struct OwnLanes {
    store: Arc<LaneStore>,
    log: Option<Arc<Mutex<LaneLog>>>,
    // Durable admissions the lane log refused, summed per key: at most one entry per key
    // of a live window.
    owed: HashMap<Key, u64>,
    // The sum of `owed`, for the metric.
    owed_total: Arc<AtomicU64>,
    // Admitted costs the lane store refused (its key cap): never counted in these lanes.
    refused: Arc<AtomicU64>,
    // What an owed cost's window ends by (see `clock::ExpiryClock`).
    expiry: clock::ExpiryClock,
}

impl OwnLanes {
    /// The lanes of `store`, logged in `log` if the node has a data directory; an owed
    /// cost is forgotten when its window ends by `expiry`.
    pub fn new(
        store: Arc<LaneStore>,
        log: Option<Arc<Mutex<LaneLog>>>,
        expiry: clock::ExpiryClock,
    ) -> OwnLanes {
        OwnLanes {
            store,
            log,
            owed: HashMap::new(),
            owed_total: Arc::new(AtomicU64::new(0)),
            refused: Arc::new(AtomicU64::new(0)),
            expiry,
        }
    }

    /// The costs admitted but not yet counted because the lane log refused their records.
    pub fn owed_total(&self) -> Arc<AtomicU64> {
        self.owed_total.clone()
    }

    /// The admitted costs the lane store refused for its key cap, never counted here: the
    /// edges' estimates of those exact keys lack them for their windows.
    pub fn refused_total(&self) -> Arc<AtomicU64> {
        self.refused.clone()
    }

    /// Whether any admission waits for room in the lane log.
    pub fn is_owing(&self) -> bool {
        !self.owed.is_empty()
    }

    /// Counts `admitted`, a key's cost in its lane. Once the lane log refuses a record, that
    /// admission and every later one are owed; while anything is owed, new admissions are
    /// owed too, behind it, until [`OwnLanes::retry`] counts them in.
    pub fn count(&mut self, admitted: &[(Key, u64)]) {
        let Some(log) = &self.log else {
            for (key, cost) in admitted {
                if self.store.incr(key, *cost).is_err() {
                    self.refused.fetch_add(*cost, Ordering::Relaxed);
                }
            }
            return;
        };
        let mut log = log.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for (key, cost) in admitted {
            if self.owed.is_empty()
                && count_in(&mut log, &self.store, key, *cost, &self.refused).is_ok()
            {
                continue;
            }
            let sum = self.owed.entry(key.clone()).or_default();
            *sum = sum.saturating_add(*cost);
            self.owed_total.fetch_add(*cost, Ordering::Relaxed);
        }
        write_out(&mut log, &self.store);
    }

    /// Counts in what is owed, key by key, until the lane log refuses a record again; drops
    /// what is owed to windows that are over.
    pub fn retry(&mut self) {
        let Some(log) = &self.log else {
            return;
        };
        let mut log = log.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let now_secs = self.expiry.now_secs();
        let mut room = true;
        let mut paid = 0u64;
        self.owed.retain(|key, cost| {
            // A cost owed to a window that is over is dropped, the log full or not: its
            // lanes are gone everywhere (found in review, session 44: after the first
            // refusal they were kept, and grew with every window that ended).
            let counted = !key.window.is_live(now_secs)
                || (room && count_in(&mut log, &self.store, key, *cost, &self.refused).is_ok());
            if !counted {
                room = false;
                return true;
            }
            paid = paid.saturating_add(*cost);
            false
        });
        write_out(&mut log, &self.store);
        self.owed_total.fetch_sub(paid, Ordering::Relaxed);
    }
}

/// Logs `cost` on `key` and counts it in the store; a record the store then refuses (its
/// key cap) is undone, and its cost added to `refused`. An error if the lane log refused
/// the record: nothing is counted.
fn count_in(
    log: &mut LaneLog,
    store: &LaneStore,
    key: &Key,
    cost: u64,
    refused: &AtomicU64,
) -> Result<(), LogError> {
    let mark = log.append(key, cost, 0)?;
    if store.incr(key, cost).is_err() {
        log.undo(mark);
        refused.fetch_add(cost, Ordering::Relaxed);
    }
    Ok(())
}

// The lane store runs on loom's atomics under `tally_loom`, which work only inside a model.
#[cfg(test)]
#[cfg(not(tally_loom))]
mod tests {
    use super::*;
    use tally_crdt::{Lane, NodeId, ReplicaId, Rule, Subject, Window};

    /// A lane log in a new directory, the region's store and its `OwnLanes` over them,
    /// and keys of the rule `quota` in the current hour.
    struct Region {
        dir: std::path::PathBuf,
        now: u64,
        store: Arc<LaneStore>,
        log: Arc<Mutex<LaneLog>>,
        lanes: OwnLanes,
    }

    impl Region {
        fn open(name: &str) -> Region {
            Region::holding(name, 16)
        }

        /// A region whose lane store holds at most `keys_max` keys.
        fn holding(name: &str, keys_max: usize) -> Region {
            let now = clock::wall().0;
            let dir = std::env::temp_dir()
                .join(format!("tally-region-{name}-{}-{now}", std::process::id()));
            let (log, recovered) =
                crate::lanelog::open(&dir, NodeId(1), now, now / 1_000, |_| {}).unwrap();
            let replica = ReplicaId::new(NodeId(1), recovered.generation);
            let store = Arc::new(LaneStore::new(replica, keys_max));
            let log = Arc::new(Mutex::new(log));
            let lanes = OwnLanes::new(
                store.clone(),
                Some(log.clone()),
                clock::ExpiryClock::start(),
            );
            Region {
                dir,
                now,
                store,
                log,
                lanes,
            }
        }

        fn key(&self, subject: &str) -> Key {
            let window = Window::containing(self.now / 1_000, 3_600).unwrap();
            Key::new(
                Rule::new("quota").unwrap(),
                Subject::new(subject).unwrap(),
                window,
            )
        }

        /// Closes the log and reopens the directory: the lanes its next life recovers.
        fn reopen(self) -> Vec<(Key, Lane)> {
            let Region { dir, now, .. } = self;
            let later = now + 1;
            let (_, next) =
                crate::lanelog::open(&dir, NodeId(1), later, later / 1_000, |_| {}).unwrap();
            std::fs::remove_dir_all(dir).unwrap();
            let mut lanes = next.retired[0].1.clone();
            lanes.sort_by(|x, y| x.0.subject.as_str().cmp(y.0.subject.as_str()));
            lanes
        }
    }

    #[test]
    fn the_regions_admissions_in_its_own_lanes_compact_their_lane_log() {
        let mut region = Region::open("compact");
        let key = region.key("acct-1");
        let log = region.log.clone();
        let log_len = || log.lock().unwrap().records_bytes();
        region.lanes.count(&[(key.clone(), 3)]);
        let one_record = log_len();
        log.lock().unwrap().compact_next();
        region.lanes.count(&[(key.clone(), 2), (key.clone(), 4)]);
        // The copy is made on a thread of its own; a later batch puts it in place.
        while log.lock().unwrap().is_compacting() {
            std::thread::sleep(std::time::Duration::from_millis(1));
            region.lanes.count(&[]);
        }
        assert_eq!(
            log_len(),
            one_record,
            "three admissions, compacted to one record"
        );
        drop(log);
        assert_eq!(region.reopen(), vec![(key, Lane::new(9, 0))]);
    }

    #[test]
    fn an_admission_the_lane_store_has_no_key_for_is_counted_as_refused_and_not_logged() {
        let mut region = Region::holding("refused", 1);
        let refused = region.lanes.refused_total();
        let (a, b) = (region.key("a"), region.key("b"));
        region.lanes.count(&[(a.clone(), 2), (b.clone(), 3)]);
        assert_eq!(refused.load(Ordering::Relaxed), 3);
        assert_eq!(region.store.own(&b).incr, 0);
        assert_eq!(region.reopen(), vec![(a, Lane::new(2, 0))]);
    }

    #[test]
    fn admissions_the_lane_log_has_no_room_for_are_owed_and_counted_in_once_it_has() {
        let mut region = Region::open("owed");
        let owed = region.lanes.owed_total();
        let (a, b) = (region.key("a"), region.key("b"));
        let store = region.store.clone();
        let counted = || (store.own(&a).incr, store.own(&b).incr);

        region.lanes.count(&[(a.clone(), 1)]);
        region.log.lock().unwrap().full_disk(true).unwrap();
        region.lanes.count(&[(a.clone(), 2), (b.clone(), 3)]);
        region.lanes.count(&[(b.clone(), 4)]);
        assert!(region.lanes.is_owing());
        assert_eq!(owed.load(Ordering::Relaxed), 9);
        assert_eq!(counted(), (1, 0), "nothing counted that the log lacks");

        region.log.lock().unwrap().full_disk(false).unwrap();
        region.lanes.retry();
        assert!(!region.lanes.is_owing());
        assert_eq!(owed.load(Ordering::Relaxed), 0);
        assert_eq!(counted(), (3, 7), "what was owed is counted");
        assert_eq!(
            region.reopen(),
            vec![(a, Lane::new(3, 0)), (b, Lane::new(7, 0))]
        );
    }

    #[test]
    fn costs_owed_to_windows_that_are_over_are_dropped_while_the_log_is_still_full() {
        let mut region = Region::open("owed-over");
        let owed = region.lanes.owed_total();
        let over = Window::containing(region.now / 1_000 - 7_200, 60).unwrap();
        let old = |i: usize| {
            Key::new(
                Rule::new("quota").unwrap(),
                Subject::new(format!("old-{i}")).unwrap(),
                over,
            )
        };
        let mut admitted = vec![(region.key("live"), 1)];
        admitted.extend((0..64).map(|i| (old(i), 10)));
        region.log.lock().unwrap().full_disk(true).unwrap();
        region.lanes.count(&admitted);
        assert_eq!(owed.load(Ordering::Relaxed), 641);
        region.lanes.retry();
        assert_eq!(
            owed.load(Ordering::Relaxed),
            1,
            "only the live key's cost is owed, the log still full"
        );
        assert!(region.lanes.is_owing());
        region.log.lock().unwrap().full_disk(false).unwrap();
        region.lanes.retry();
        assert!(!region.lanes.is_owing());
        drop(region.reopen());
    }
}
