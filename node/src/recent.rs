//! The approximate checks this sidecar decided under a [`CheckId`], remembered so that a
//! retry (after a timeout or a broken connection) gets the first decision and counts
//! nothing more (TESTING.md C3). Exact checks are remembered by the region instead.
//!
//! The memory is bounded: the most recent [`RECENT_CHECKS_MAX`] ids, each while its
//! window is live. An id pushed out by newer ones is forgotten, and a retry of it is
//! decided, and counted, again: at 10,000 named checks a second an id is remembered for
//! more than 6 seconds, well past a client's timeout. Nothing here survives a restart, and
//! each sidecar remembers only its own: a retry sent to another sidecar, or to the next
//! life of this one, is decided again.

use std::collections::{HashMap, VecDeque};
use tally_client::wire::{CheckId, Decision};

/// How many check ids a sidecar remembers: about 15 MB when full (a 96-byte entry in a
/// table of 131,072, and the order).
pub const RECENT_CHECKS_MAX: usize = 65_536;

/// The recent approximate checks decided under an id.
#[derive(Debug)]
pub struct RecentChecks {
    // Each id's decision, the second its window stops being live (exclusive), and the
    // number of its insertion.
    decided: HashMap<CheckId, (Decision, u64, u64)>,
    // Each insertion's id and number, oldest first. Invariant: every id of `decided` is
    // here under its number; an entry whose number is not its id's held one is a place
    // left by an id decided again, skipped when it comes to the front.
    order: VecDeque<(CheckId, u64)>,
    inserted: u64,
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
            inserted: 0,
            max: max.max(1),
        }
    }

    /// `id`'s decision, if it is held and its window is live at `now_unix_secs`; `None`:
    /// decide it now.
    pub fn get(&self, id: CheckId, now_unix_secs: u64) -> Option<Decision> {
        let &(decision, live_until, _) = self.decided.get(&id)?;
        (now_unix_secs < live_until).then_some(decision)
    }

    /// Remembers `id`'s decision, in a window live until `live_until` (exclusive); pushes
    /// out the oldest ids past the bound, and those whose windows are over at
    /// `now_unix_secs`.
    pub fn insert(&mut self, id: CheckId, decision: Decision, live_until: u64, now_unix_secs: u64) {
        self.inserted += 1;
        self.decided
            .insert(id, (decision, live_until, self.inserted));
        self.order.push_back((id, self.inserted));
        while let Some(&(oldest, number)) = self.order.front() {
            let held = (self.decided.get(&oldest)).filter(|&&(_, _, held)| held == number);
            let over = held.is_none_or(|&(_, live_until, _)| live_until <= now_unix_secs);
            if self.order.len() <= self.max && !over {
                break;
            }
            self.order.pop_front();
            if held.is_some() {
                self.decided.remove(&oldest);
            }
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
        assert_eq!(recent.get(id(1, 1), 10), None);
        recent.insert(id(1, 1), decision(5), 60, 10);
        assert_eq!(recent.get(id(1, 1), 59), Some(decision(5)));
        assert_eq!(recent.get(id(1, 2), 59), None);
        assert_eq!(recent.get(id(2, 1), 59), None);
        // Once its window is over, a retry is a new check in its own window.
        assert_eq!(recent.get(id(1, 1), 60), None);
    }

    #[test]
    fn an_entry_is_the_size_the_memory_bound_is_reckoned_with() {
        assert_eq!(size_of::<(CheckId, (Decision, u64, u64))>(), 96);
    }

    #[test]
    fn the_oldest_ids_are_pushed_out_past_the_bound() {
        let mut recent = RecentChecks::with_max(3);
        for seq in 1..=5 {
            recent.insert(id(7, seq), decision(seq as i128), 60, 10);
        }
        assert_eq!(recent.len(), 3);
        assert_eq!(recent.get(id(7, 2), 10), None, "pushed out: decided again");
        assert_eq!(recent.get(id(7, 3), 10), Some(decision(3)));
        assert_eq!(recent.get(id(7, 5), 10), Some(decision(5)));
    }

    #[test]
    fn ids_whose_windows_are_over_are_let_go_and_one_decided_again_is_held_once() {
        let mut recent = RecentChecks::with_max(10);
        recent.insert(id(1, 1), decision(1), 20, 10);
        recent.insert(id(1, 2), decision(2), 60, 10);
        recent.insert(id(1, 3), decision(3), 60, 30);
        assert_eq!(recent.len(), 2, "the first window ended at 20");
        // An id decided again in a later window takes a new place in the order: its old
        // place, at the front, does not push out the new decision.
        let mut again = RecentChecks::with_max(2);
        again.insert(id(1, 1), decision(1), 20, 10);
        again.insert(id(1, 2), decision(2), 100, 10);
        again.insert(id(1, 1), decision(7), 80, 15);
        again.insert(id(1, 3), decision(3), 100, 15);
        assert_eq!(again.get(id(1, 1), 15), Some(decision(7)));
        assert_eq!(
            again.get(id(1, 2), 15),
            None,
            "the oldest held is pushed out"
        );
        assert_eq!(again.get(id(1, 3), 15), Some(decision(3)));
        assert_eq!(again.len(), 2);
    }
}
