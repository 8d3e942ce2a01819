//! Own lanes on their way from the lane store to the gossip. With a data directory, a
//! collected lane reaches the gossip only once a sync of the lane log that holds its
//! writes has returned, so a peer never holds a lane value the node's disk lacks.
//!
//! Why: after a machine crash the node replays its log and re-publishes the earlier life's
//! lanes at versions above any a peer holds. Were a peer already holding a larger total
//! than the replayed one, it would keep its total under that new version, while this node
//! and every peer that took the re-published one hold the smaller total under the same
//! version: no digest would show the difference, and the nodes would disagree until the
//! window ended. (The gossip mends that where it can still happen, from a log behind what
//! peers had, as after a restored disk snapshot: the peer sends its larger totals back to
//! the node, which gives them a new version. A lane the log lacks altogether stays behind.)
//! A process crash needs no sync (the page cache keeps the writes); a machine
//! crash still loses the writes acknowledged but not yet collected and synced, which no
//! peer received either.
//!
//! One sync at a time runs, on a blocking thread, and the driver collects no lanes while
//! it does: keys written meanwhile stay queued in the store, and are collected once it has
//! returned. So a node under load syncs at most once per collection (every half push
//! interval with a data dir: `daemon::collecting`), what waits is bounded by the
//! store's keys, and a write waits for at most two syncs. Lanes go to the gossip stamped
//! with when they were collected, so the staleness peers measure includes the sync. A
//! sync that runs past a limit (the driver's: a second, or a gossip interval) is
//! [`Handoff::overdue`]: the driver then holds its protocol, heartbeats included, until
//! it returns, and the node decides as stale as the writes it holds back.

use crate::answerlog::AnswersSync;
use crate::lanelog::{LaneLog, LogError};
use crate::store::LaneStore;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tally_crdt::{Key, Lane};
use tally_gossip::Now;
use tokio::task::JoinHandle;

/// Own lanes collected at one moment.
pub type Collected = (Now, Vec<(Key, Lane)>);

/// Collected own lanes, handed to the gossip once durable.
#[derive(Debug)]
pub struct Handoff {
    log: Option<Arc<Mutex<LaneLog>>>,
    syncing: Option<Syncing>,
}

/// A sync in flight, and the lanes it makes durable.
#[derive(Debug)]
struct Syncing {
    task: JoinHandle<Result<(), LogError>>,
    lanes: Collected,
    // When the oldest write among them was queued (monotonic).
    oldest: Duration,
}

impl Handoff {
    /// Lanes logged to `log` are held until it is synced; without a log they pass at once.
    pub fn new(log: Option<Arc<Mutex<LaneLog>>>) -> Handoff {
        Handoff { log, syncing: None }
    }

    /// Whether a sync is in flight: collect nothing meanwhile.
    pub fn is_syncing(&self) -> bool {
        self.syncing.is_some()
    }

    /// When the oldest write the sync in flight holds back was queued (monotonic), if a
    /// sync is in flight.
    pub fn oldest_held(&self) -> Option<Duration> {
        self.syncing.as_ref().map(|syncing| syncing.oldest)
    }

    /// If the oldest write the sync in flight holds back was queued more than `limit`
    /// before `now` (monotonic), how long ago: the disk is not answering fast enough, and
    /// no peer has this node's writes since then. Counted from the write, not from its
    /// collection, which waited for the sync before (writes made while a sync runs are
    /// collected once it returns).
    pub fn overdue(&self, now: Duration, limit: Duration) -> Option<Duration> {
        let held_for = now.saturating_sub(self.oldest_held()?);
        (held_for > limit).then_some(held_for)
    }

    /// Takes lanes collected at `now`, the oldest written at `oldest` (monotonic), while no
    /// sync is in flight. Returns them at once without a log; with one, starts their sync
    /// and returns nothing (see [`Handoff::synced`]).
    pub fn collected(&mut self, lanes: Collected, oldest: Duration) -> Option<Collected> {
        assert!(
            self.syncing.is_none(),
            "invariant: nothing is collected while a sync is in flight"
        );
        let Some(log) = &self.log else {
            return Some(lanes);
        };
        // A handle of the file as it is now: every record of a collected lane was written
        // to it before the collection (or to the compacted file that replaced it, which
        // was synced when written).
        let file = log
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .sync_handle();
        self.syncing = Some(Syncing {
            task: tokio::task::spawn_blocking(move || file?.sync()),
            lanes,
            oldest,
        });
        None
    }

    /// Once a second: syncs the answers the log holds under request ids, on a blocking
    /// thread (not a collection's sync, which the lanes' gossip waits for: see
    /// `answerlog`), and ends an empty batch, so that a compaction whose copy is ready is
    /// put in place while no client writes ([`LaneLog::compact_if_large`]).
    pub fn each_second(&self, store: &LaneStore) {
        if let Some(log) = &self.log {
            let mut log = log.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            log.sync_answers();
            crate::listener::write_out(&mut log, store);
        }
    }

    /// A sync of the answers the log holds under request ids that no sync has taken yet,
    /// if any (at a graceful stop: a collection's sync takes the others).
    pub fn answers_sync(&self) -> Option<AnswersSync> {
        let log = self.log.as_ref()?;
        let mut log = log.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        log.answers_sync_handle()
    }

    /// Waits for the sync in flight (forever if none) and returns the lanes it made
    /// durable. Cancel-safe: dropped before the sync returns, it leaves the sync in flight
    /// for the next call.
    pub async fn synced(&mut self) -> Result<Collected, LogError> {
        let Some(syncing) = self.syncing.as_mut() else {
            return std::future::pending().await;
        };
        let result = match (&mut syncing.task).await {
            Ok(result) => result,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        };
        let synced = self
            .syncing
            .take()
            .expect("invariant: the sync awaited is the one in flight");
        result.map(|()| synced.lanes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_crdt::{NodeId, Rule, Subject, Window};

    const NOW: u64 = 1_767_225_600;

    fn collected(at_ms: u64, lanes: &[(&str, u64)]) -> Collected {
        let now = Now {
            mono: Duration::from_millis(at_ms),
            wall: tally_crdt::Stamp(NOW * 1_000 + at_ms),
        };
        let lanes = lanes
            .iter()
            .map(|(subject, incr)| {
                let key = Key::new(
                    Rule::new("r").unwrap(),
                    Subject::new(*subject).unwrap(),
                    Window::containing(NOW, 60).unwrap(),
                );
                (key, Lane::new(*incr, 0))
            })
            .collect();
        (now, lanes)
    }

    /// A test's directory, removed when the test ends, by a panic too.
    struct Removed(std::path::PathBuf);

    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn log(name: &str) -> (Arc<Mutex<LaneLog>>, Removed) {
        let dir = std::env::temp_dir().join(format!("tally-handoff-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (log, _) = crate::lanelog::open(&dir, NodeId(1), NOW * 1_000, NOW, |_| {}).unwrap();
        (Arc::new(Mutex::new(log)), Removed(dir))
    }

    #[test]
    fn without_a_data_dir_collected_lanes_pass_at_once() {
        let mut handoff = Handoff::new(None);
        let lanes = collected(1, &[("a", 1), ("b", 2)]);
        assert_eq!(handoff.collected(lanes.clone(), lanes.0.mono), Some(lanes));
        assert!(!handoff.is_syncing());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn lanes_wait_for_their_sync_and_keep_when_they_were_collected() {
        let (log, _dir) = log("wait");
        let mut handoff = Handoff::new(Some(log));
        let lanes = collected(1, &[("a", 1), ("b", 2)]);
        assert_eq!(handoff.collected(lanes.clone(), lanes.0.mono), None);
        assert!(handoff.is_syncing());
        assert_eq!(handoff.synced().await.unwrap(), lanes);
        assert!(!handoff.is_syncing());
        let later = collected(3, &[("a", 4)]);
        assert_eq!(handoff.collected(later.clone(), later.0.mono), None);
        assert_eq!(handoff.synced().await.unwrap(), later);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_sync_is_overdue_once_its_oldest_write_has_waited_longer_than_the_limit() {
        let (log, _dir) = log("overdue");
        let mut handoff = Handoff::new(Some(log));
        let second = Duration::from_secs(1);
        let at = Duration::from_millis;
        assert_eq!(
            handoff.overdue(at(60_000), second),
            None,
            "no sync in flight"
        );
        assert_eq!(
            handoff.collected(collected(1_000, &[("a", 1)]), at(1_000)),
            None
        );
        assert_eq!(handoff.overdue(at(2_000), second), None);
        assert_eq!(handoff.overdue(at(2_001), second), Some(at(1_001)));
        handoff.synced().await.unwrap();
        assert_eq!(handoff.overdue(at(2_001), second), None);
        // A write queued at 1,100, while that sync ran, collected once it returned at
        // 1,900: by 2,500 it has waited 1,400.
        assert_eq!(
            handoff.collected(collected(1_900, &[("a", 2)]), at(1_100)),
            None
        );
        assert_eq!(handoff.overdue(at(2_500), second), Some(at(1_400)));
    }

    #[test]
    #[should_panic(expected = "nothing is collected while a sync is in flight")]
    fn collecting_while_a_sync_is_in_flight_is_a_bug() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let _entered = runtime.enter();
        let (log, _dir) = log("twice");
        let mut handoff = Handoff::new(Some(log));
        let _ = handoff.collected(collected(1, &[("a", 1)]), Duration::ZERO);
        let _ = handoff.collected(collected(2, &[("a", 2)]), Duration::ZERO);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_log_hands_over_nothing() {
        let (log, _dir) = log("failed");
        let mut handoff = Handoff::new(Some(log.clone()));
        log.lock().unwrap().fail("injected");
        assert_eq!(
            handoff.collected(collected(1, &[("a", 1)]), Duration::ZERO),
            None
        );
        let err = handoff.synced().await.unwrap_err();
        assert!(err.to_string().contains("injected"), "{err}");
        assert!(!handoff.is_syncing());
    }
}
