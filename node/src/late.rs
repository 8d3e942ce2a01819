//! Fallbacks counted for exact checks that the region admitted after all.
//!
//! An exact check the region does not answer within its rule's timeout gets the rule's
//! `on_region_unavailable`; with `allow` or `approximate` the sidecar counts the cost in its
//! own lane. If the region decided the check anyway and admitted it, its own lanes count it
//! too, and the estimates would hold it twice. The forwarder reports such late admissions
//! by the check's sequence number ([`crate::region::forward::LateAdmissions`]); the
//! sidecar then takes its fallback's count back (a decrement of its own lane), so the
//! estimates hold the admission once, in the region's lanes. The report and the fallback's
//! count come on different tasks, in either order: whichever comes second matches the
//! first here.

use std::collections::{BTreeMap, BTreeSet};
use tally_crdt::Key;

/// How many counted fallbacks, and how many early reports, are remembered: the most
/// recent by sequence number.
const HELD_MAX: usize = 4_096;

/// Counted fallbacks and late admissions, by the check's sequence number.
#[derive(Debug, Default)]
pub struct LateFallbacks {
    // Fallbacks counted whose check the region has not been reported to admit: the key,
    // the cost counted, and the other sends of the check's id the same count is held under
    // (those that timed out with no fallback while it waited), for it to be taken back once.
    counted: BTreeMap<u64, (Key, u64, Vec<u64>)>,
    // Late admissions reported before their check's fallback was counted.
    admitted: BTreeSet<u64>,
}

impl LateFallbacks {
    /// A fallback counted `cost` on `key` for the sends `seqs` of one check: the one that
    /// fell back, if it was written, and those of its id that timed out with no fallback
    /// while it waited. The region admitting any of them counts the check. True if the
    /// region was already reported to have admitted one: the caller takes the count back
    /// now.
    pub fn counted(&mut self, seqs: &[u64], key: Key, cost: u64) -> bool {
        let mut reported = false;
        for seq in seqs {
            reported |= self.admitted.remove(seq);
        }
        if reported {
            return true;
        }
        for &seq in seqs {
            let others = seqs.iter().copied().filter(|&other| other != seq);
            self.counted
                .insert(seq, (key.clone(), cost, others.collect()));
        }
        while self.counted.len() > HELD_MAX {
            self.counted.pop_first();
        }
        false
    }

    /// The region admitted check `seq` after it was answered `RegionUnavailable`: the
    /// fallback's count to take back, if one was counted.
    pub fn admitted(&mut self, seq: u64) -> Option<(Key, u64)> {
        let Some((key, cost, others)) = self.counted.remove(&seq) else {
            self.admitted.insert(seq);
            if self.admitted.len() > HELD_MAX {
                self.admitted.pop_first();
            }
            return None;
        };
        // Taken back once, whichever of the sends the region reports.
        for other in others {
            self.counted.remove(&other);
        }
        Some((key, cost))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_crdt::{Rule, Subject, Window};

    fn key() -> Key {
        Key::new(
            Rule::new("quota").unwrap(),
            Subject::new("a").unwrap(),
            Window::new(0, 60).unwrap(),
        )
    }

    #[test]
    fn a_late_admission_matches_its_counted_fallback_in_either_order_once() {
        let mut late = LateFallbacks::default();
        assert!(!late.counted(&[1], key(), 5));
        assert_eq!(late.admitted(1), Some((key(), 5)));
        assert_eq!(late.admitted(1), None, "taken back once");

        assert_eq!(late.admitted(2), None);
        assert!(
            late.counted(&[2], key(), 3),
            "reported first: taken back at the count"
        );
        assert!(!late.counted(&[2], key(), 3), "the report matched once");

        for seq in 10..10 + HELD_MAX as u64 + 1 {
            late.counted(&[seq], key(), 1);
        }
        assert_eq!(late.admitted(10), None, "the oldest is forgotten");
        assert!(late.admitted(11).is_some());
    }
}
