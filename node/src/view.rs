//! What the gossip task shows the rest of the node: members, the freshest stamp held per
//! origin, the remote admission rate per key, and the gossip counters.
//!
//! The gossip task owns the [`tally_gossip::Gossip`] and refreshes this after each batch of
//! inputs; the client listener reads it for decisions, the HTTP server for metrics. It is a
//! copy behind a mutex, never the state machine itself.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use tally_crdt::{Key, KeyRef, NodeId, ReplicaId, Stamp};
use tally_gossip::membership::State;
use tally_gossip::Stats;

/// The shared view; see the module docs.
#[derive(Debug, Default)]
pub struct View {
    inner: Mutex<ViewState>,
}

/// The view's contents.
#[derive(Debug, Default, Clone)]
pub struct ViewState {
    /// Every other member: its node, current replica and state.
    pub members: Vec<(NodeId, ReplicaId, State)>,
    /// The newest origin stamp held for each other member's current replica.
    pub stamps: BTreeMap<ReplicaId, Stamp>,
    /// The gossip's counters.
    pub gossip: Stats,
    /// Lanes held in the gossip's map, over all keys and origins.
    pub lanes: usize,
    /// Keys held in the gossip's map.
    pub keys: usize,
    /// Per key, how fast the other replicas' increments have been rising.
    pub remote_rates: HashMap<Key, Rate>,
}

/// A smoothed rate of increments per second, from totals seen at times.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    total: i128,
    at_ms: u64,
    per_sec: f64,
}

impl Rate {
    /// How quickly a new sample replaces the old rate (per second of elapsed time).
    const HALF_LIFE_SECS: f64 = 2.0;

    /// A rate starting at `total` at `at_ms`, with no history.
    pub fn start(total: i128, at_ms: u64) -> Rate {
        Rate {
            total,
            at_ms,
            per_sec: 0.0,
        }
    }

    /// Samples over shorter spans are merged into the next: gossip delivers in bursts
    /// (one push every few milliseconds), and a burst over one millisecond is not a rate.
    const SAMPLE_MS_MIN: u64 = 100;

    /// Takes in that the total was `total` at `at_ms`.
    pub fn observe(&mut self, total: i128, at_ms: u64) {
        if at_ms < self.at_ms + Rate::SAMPLE_MS_MIN || total < self.total {
            return;
        }
        let secs = (at_ms - self.at_ms) as f64 / 1_000.0;
        let sample = (total - self.total) as f64 / secs;
        let keep = 0.5f64.powf(secs / Rate::HALF_LIFE_SECS);
        // Rising at once to a faster sample keeps the bound conservative; falling slowly.
        self.per_sec = if sample > self.per_sec {
            sample
        } else {
            self.per_sec * keep + sample * (1.0 - keep)
        };
        self.total = total;
        self.at_ms = at_ms;
    }

    /// Increments per second.
    pub fn per_sec(&self) -> f64 {
        self.per_sec
    }
}

/// How fresh the live members' state is at one moment, for one decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Freshness {
    /// The stalest live member's staleness (zero when alone).
    pub staleness: Duration,
    /// Live members: alive or suspect, this node excluded.
    pub live: usize,
    /// Members known in any state but left, this node included.
    pub locations: usize,
}

impl View {
    /// Locks the view for reading or replacing.
    pub fn lock(&self) -> MutexGuard<'_, ViewState> {
        // A panic in the gossip task leaves the last complete view, which is still valid.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl ViewState {
    /// The live members' freshness at wall time `now`. A live member with no stamp held
    /// is as stale as the epoch: nothing of it has been seen.
    pub fn freshness(&self, now: Stamp) -> Freshness {
        let mut staleness = Duration::ZERO;
        let mut live = 0;
        let mut locations = 1;
        for (_, replica, state) in &self.members {
            if *state != State::Left {
                locations += 1;
            }
            if matches!(state, State::Alive | State::Suspect) {
                live += 1;
                let stamp = self.stamps.get(replica).copied().unwrap_or(Stamp(0));
                staleness = staleness.max(Duration::from_millis(now.0.saturating_sub(stamp.0)));
            }
        }
        Freshness {
            staleness,
            live,
            locations,
        }
    }

    /// The other replicas' increment rate on `key`, per second (0 if never seen rising).
    pub fn remote_rate(&self, key: KeyRef<'_>) -> f64 {
        if self.remote_rates.is_empty() {
            // Alone, or no remote increments yet: no look-up, and no owned key built for it.
            return 0.0;
        }
        self.remote_rates
            .get(&key.to_key())
            .map_or(0.0, Rate::per_sec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_rises_at_once_and_decays_over_its_half_life() {
        let mut rate = Rate::start(0, 0);
        rate.observe(90, 10);
        assert_eq!(
            rate.per_sec(),
            0.0,
            "a burst within one sample span is no rate yet"
        );
        rate.observe(100, 1_000);
        assert_eq!(rate.per_sec(), 100.0);
        rate.observe(100, 3_000);
        assert!((rate.per_sec() - 50.0).abs() < 1e-9, "{}", rate.per_sec());
    }

    #[test]
    fn the_stalest_live_member_sets_the_freshness() {
        let replica = |n| ReplicaId::new(NodeId(n), tally_crdt::Generation(1));
        let state = ViewState {
            members: vec![
                (NodeId(2), replica(2), State::Alive),
                (NodeId(3), replica(3), State::Suspect),
                (NodeId(4), replica(4), State::Dead),
            ],
            stamps: [
                (replica(2), Stamp(990)),
                (replica(3), Stamp(700)),
                (replica(4), Stamp(0)),
            ]
            .into(),
            ..ViewState::default()
        };
        let freshness = state.freshness(Stamp(1_000));
        assert_eq!(freshness.staleness, Duration::from_millis(300));
        assert_eq!((freshness.live, freshness.locations), (2, 4));
    }
}
