//! Own lanes on their way from the lane store to the gossip. With a data directory, a
//! collected lane reaches the gossip only once a sync of the lane log that holds its
//! writes has returned, so a peer never holds a lane value the node's disk lacks.
//!
//! Why: after a machine crash the node replays its log and re-publishes the earlier life's
//! lanes at versions above any a peer holds. Were a peer already holding a larger total
//! than the replayed one, it would keep its total under that new version, while this node
//! and every peer that took the re-published one hold the smaller total under the same
//! version: no digest would show the difference, and the nodes would disagree until the
//! window ended. A process crash needs no sync (the page cache keeps the writes); a machine
//! crash still loses the writes acknowledged but not yet collected and synced, which no
//! peer received either.
//!
//! One sync at a time runs on a blocking thread; lanes collected meanwhile wait for the
//! next, which starts as soon as it returns. So a write waits for at most two syncs, and a
//! node under load syncs at most once per collection.

use crate::lanelog::{LaneLog, LogError};
use std::sync::{Arc, Mutex};
use tally_crdt::{Key, Lane};
use tokio::task::JoinHandle;

/// Collected own lanes, handed to the gossip once durable.
#[derive(Debug)]
pub struct Handoff {
    log: Option<Arc<Mutex<LaneLog>>>,
    // Collected since the sync in flight began (or since the last one, if none runs).
    waiting: Vec<(Key, Lane)>,
    syncing: Option<Syncing>,
}

/// A sync in flight, and the lanes it makes durable.
#[derive(Debug)]
struct Syncing {
    task: JoinHandle<Result<(), LogError>>,
    lanes: Vec<(Key, Lane)>,
}

impl Handoff {
    /// Lanes logged to `log` are held until it is synced; without a log they pass at once.
    pub fn new(log: Option<Arc<Mutex<LaneLog>>>) -> Handoff {
        Handoff {
            log,
            waiting: Vec::new(),
            syncing: None,
        }
    }

    /// Takes collected lanes; returns the ones the gossip may have now: all of them
    /// without a log, none with one (they wait for [`Handoff::synced`]).
    pub fn collected(&mut self, lanes: Vec<(Key, Lane)>) -> Vec<(Key, Lane)> {
        if self.log.is_none() {
            return lanes;
        }
        self.waiting.extend(lanes);
        self.start_sync();
        Vec::new()
    }

    /// Whether a sync is in flight.
    pub fn is_syncing(&self) -> bool {
        self.syncing.is_some()
    }

    /// Waits for the sync in flight (forever if none) and returns the lanes it made
    /// durable, starting the next sync if lanes wait. Cancel-safe: dropped before the sync
    /// returns, it leaves the sync in flight for the next call.
    pub async fn synced(&mut self) -> Result<Vec<(Key, Lane)>, LogError> {
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
        result?;
        self.start_sync();
        Ok(synced.lanes)
    }

    /// Every lane collected so far, durable: for a node stopping, whose last push must
    /// carry them.
    pub async fn drain(&mut self) -> Result<Vec<(Key, Lane)>, LogError> {
        let mut lanes = Vec::new();
        while self.is_syncing() {
            lanes.extend(self.synced().await?);
        }
        Ok(lanes)
    }

    fn start_sync(&mut self) {
        if self.syncing.is_some() || self.waiting.is_empty() {
            return;
        }
        let Some(log) = &self.log else {
            return;
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
            lanes: std::mem::take(&mut self.waiting),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_crdt::{NodeId, Rule, Subject, Window};

    const NOW: u64 = 1_767_225_600;

    fn lane(subject: &str, incr: u64) -> (Key, Lane) {
        let key = Key::new(
            Rule::new("r").unwrap(),
            Subject::new(subject).unwrap(),
            Window::containing(NOW, 60).unwrap(),
        );
        (key, Lane::new(incr, 0))
    }

    fn log(name: &str) -> Arc<Mutex<LaneLog>> {
        let dir = std::env::temp_dir().join(format!("tally-handoff-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (log, _) = crate::lanelog::open(&dir, NodeId(1), NOW * 1_000, NOW).unwrap();
        Arc::new(Mutex::new(log))
    }

    #[test]
    fn without_a_data_dir_collected_lanes_pass_at_once() {
        let mut handoff = Handoff::new(None);
        let lanes = vec![lane("a", 1), lane("b", 2)];
        assert_eq!(handoff.collected(lanes.clone()), lanes);
        assert!(!handoff.is_syncing());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn lanes_wait_for_a_sync_and_those_collected_meanwhile_for_the_next() {
        let mut handoff = Handoff::new(Some(log("wait")));
        assert_eq!(handoff.collected(vec![lane("a", 1)]), vec![]);
        assert!(handoff.is_syncing());
        assert_eq!(handoff.collected(vec![lane("b", 2), lane("a", 3)]), vec![]);
        assert_eq!(handoff.synced().await.unwrap(), vec![lane("a", 1)]);
        assert!(
            handoff.is_syncing(),
            "the lanes that waited start the next sync"
        );
        assert_eq!(
            handoff.synced().await.unwrap(),
            vec![lane("b", 2), lane("a", 3)]
        );
        assert!(!handoff.is_syncing());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_stopping_node_gets_every_lane_collected_once_synced() {
        let mut handoff = Handoff::new(Some(log("drain")));
        assert_eq!(handoff.collected(vec![lane("a", 1)]), vec![]);
        assert_eq!(handoff.collected(vec![lane("b", 1)]), vec![]);
        assert_eq!(
            handoff.drain().await.unwrap(),
            vec![lane("a", 1), lane("b", 1)]
        );
        assert!(!handoff.is_syncing());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_log_hands_over_nothing() {
        let log = log("failed");
        let mut handoff = Handoff::new(Some(log.clone()));
        log.lock().unwrap().fail("injected");
        assert_eq!(handoff.collected(vec![lane("a", 1)]), vec![]);
        let err = handoff.synced().await.unwrap_err();
        assert!(err.to_string().contains("injected"), "{err}");
        assert!(!handoff.is_syncing());
    }
}
