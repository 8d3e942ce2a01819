//! The approximate checks this sidecar decided under a [`CheckId`], remembered so that a
//! retry (after a timeout or a broken connection) gets the first decision and counts
//! nothing more (TESTING.md C3). Exact checks are remembered by the region instead.
//!
//! The memory is bounded: the most recent [`RECENT_CHECKS_MAX`] ids, each while its
//! window is live. An id pushed out by newer ones raises its session's floor, and a retry
//! at or below the floor is refused [`Seen::Forgotten`], never decided again, until the
//! window of every id pushed out is over. Nothing here survives a restart: a retry sent to
//! the next life of the sidecar is decided, and counted, again.

use std::collections::{HashMap, VecDeque};
use tally_client::wire::{CheckId, Decision};

/// How many check ids a sidecar remembers.
pub const RECENT_CHECKS_MAX: usize = 65_536;

/// What the sidecar holds of one check id.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Seen {
    /// Not decided here, or decided in a window that is over: decide it now.
    Unseen,
    /// Decided: answer this again, count nothing.
    Decided(Decision),
    /// Pushed out by newer ids while its window may still be live: not decided again.
    Forgotten,
}

/// The recent approximate checks decided under an id.
#[derive(Debug)]
pub struct RecentChecks {
    // Each id's decision and the second its window ends (exclusive).
    decided: HashMap<CheckId, (Decision, u64)>,
    // The ids of `decided`, oldest first. Invariant: the same ids.
    order: VecDeque<CheckId>,
    // Per session, the highest sequence number pushed out, and the second the last window
    // of the ids pushed out ends.
    floors: HashMap<u64, (u64, u64)>,
    max: usize,
}

impl Default for RecentChecks {
    fn default() -> RecentChecks {
        RecentChecks::with_max(RECENT_CHECKS_MAX)
    }
}

impl RecentChecks {
    /// Remembers at most `max` ids.
    pub fn with_max(max: usize) -> RecentChecks {
        RecentChecks {
            decided: HashMap::new(),
            order: VecDeque::new(),
            floors: HashMap::new(),
            max: max.max(1),
        }
    }

    /// What is held of `id` at `now_unix_secs`.
    pub fn get(&self, id: CheckId, now_unix_secs: u64) -> Seen {
        if let Some(&(decision, live_until)) = self.decided.get(&id) {
            if now_unix_secs < live_until {
                return Seen::Decided(decision);
            }
        }
        match self.floors.get(&id.session) {
            Some(&(floor, live_until)) if id.seq <= floor && now_unix_secs < live_until => {
                Seen::Forgotten
            }
            _ => Seen::Unseen,
        }
    }

    /// Remembers `id`'s decision, in a window that ends at `live_until` (exclusive); pushes
    /// out the oldest id past the bound, and forgets what is over at `now_unix_secs`.
    pub fn insert(&mut self, id: CheckId, decision: Decision, live_until: u64, now_unix_secs: u64) {
        if self.decided.insert(id, (decision, live_until)).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > self.max {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            let Some((_, oldest_until)) = self.decided.remove(&oldest) else {
                continue;
            };
            if now_unix_secs < oldest_until {
                let floor = self.floors.entry(oldest.session).or_insert((0, 0));
                *floor = (floor.0.max(oldest.seq), floor.1.max(oldest_until));
            }
        }
        self.expire_front(now_unix_secs);
    }

    /// Forgets the oldest ids while their windows are over, and every floor that is.
    fn expire_front(&mut self, now_unix_secs: u64) {
        while let Some(oldest) = self.order.front() {
            match self.decided.get(oldest) {
                Some(&(_, live_until)) if now_unix_secs < live_until => break,
                _ => {
                    let oldest = *oldest;
                    self.order.pop_front();
                    self.decided.remove(&oldest);
                }
            }
        }
        if self.floors.len() > self.max {
            self.floors
                .retain(|_, &mut (_, live_until)| now_unix_secs < live_until);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.decided.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_client::wire::Mode;

    fn id(session: u64, seq: u64) -> CheckId {
        CheckId { session, seq }
    }

    fn decision(estimate: i128) -> Decision {
        Decision {
            allowed: true,
            estimate,
            limit: 100,
            remaining: 100 - estimate as u64,
            reset_after_ms: 1_000,
            mode: Mode::ApproximateConnected,
            staleness_ms: 0,
            bound: 0.0,
        }
    }

    #[test]
    fn a_decided_id_is_answered_again_while_its_window_is_live() {
        let mut recent = RecentChecks::default();
        assert_eq!(recent.get(id(1, 1), 10), Seen::Unseen);
        recent.insert(id(1, 1), decision(5), 60, 10);
        assert_eq!(recent.get(id(1, 1), 59), Seen::Decided(decision(5)));
        assert_eq!(recent.get(id(1, 2), 59), Seen::Unseen);
        assert_eq!(recent.get(id(2, 1), 59), Seen::Unseen);
        // Once its window is over, a retry is a new check in its own window.
        assert_eq!(recent.get(id(1, 1), 60), Seen::Unseen);
    }

    #[test]
    fn an_id_pushed_out_is_forgotten_until_its_window_is_over_and_memory_stays_bounded() {
        let mut recent = RecentChecks::with_max(3);
        for seq in 1..=5 {
            recent.insert(id(7, seq), decision(seq as i128), 60, 10);
        }
        assert_eq!(recent.len(), 3);
        assert_eq!(recent.get(id(7, 1), 10), Seen::Forgotten);
        assert_eq!(recent.get(id(7, 2), 10), Seen::Forgotten);
        assert_eq!(recent.get(id(7, 3), 10), Seen::Decided(decision(3)));
        // Another session's ids are not held back by this one's floor.
        assert_eq!(recent.get(id(8, 1), 10), Seen::Unseen);
        assert_eq!(recent.get(id(7, 2), 60), Seen::Unseen);
    }

    #[test]
    fn ids_whose_windows_are_over_are_let_go() {
        let mut recent = RecentChecks::with_max(10);
        recent.insert(id(1, 1), decision(1), 20, 10);
        recent.insert(id(1, 2), decision(2), 60, 10);
        recent.insert(id(1, 3), decision(3), 60, 30);
        assert_eq!(recent.len(), 2, "the first window ended at 20");
        // Pushed out after its window ended: no floor is kept for it.
        let mut small = RecentChecks::with_max(1);
        small.insert(id(1, 1), decision(1), 20, 10);
        small.insert(id(1, 2), decision(2), 60, 30);
        assert_eq!(small.get(id(1, 1), 30), Seen::Unseen);
    }
}
