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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use tally_crdt::Key;

/// How many counted fallbacks, and how many early reports, are remembered: the fallbacks
/// counted last, and the reports by the most recent sequence numbers.
const HELD_MAX: usize = 4_096;

/// Counted fallbacks and late admissions, by the check's sequence number.
#[derive(Debug, Default)]
pub struct LateFallbacks {
    // Fallbacks counted whose check the region has not been reported to admit, by the
    // number of their counting: the key, the cost counted, and the sends of the check's id
    // the count is held under (the one that fell back, and those that timed out with no
    // fallback while it waited), for it to be taken back once. Pushed out in the order
    // they were counted, not by sequence number: rules' timeouts differ, so a check sent
    // first may fall back after thousands sent later, and pushed out by those its count
    // was forgotten as it was made (found in review, session 55).
    counted: BTreeMap<u64, (Key, u64, Vec<u64>)>,
    // The number of the fallback each send's sequence number is held under.
    by_seq: HashMap<u64, u64>,
    // How many fallbacks were counted.
    counts: u64,
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
        if seqs.is_empty() {
            return false;
        }
        self.counts += 1;
        for &seq in seqs {
            self.by_seq.insert(seq, self.counts);
        }
        self.counted.insert(self.counts, (key, cost, seqs.to_vec()));
        while self.counted.len() > HELD_MAX {
            if let Some((_, (_, _, seqs))) = self.counted.pop_first() {
                self.forget_seqs(&seqs);
            }
        }
        false
    }

    /// The region admitted check `seq` after it was answered `RegionUnavailable`: the
    /// fallback's count to take back, if one was counted.
    pub fn admitted(&mut self, seq: u64) -> Option<(Key, u64)> {
        let Some((key, cost, seqs)) = (self.by_seq.get(&seq)).and_then(|n| self.counted.remove(n))
        else {
            self.admitted.insert(seq);
            if self.admitted.len() > HELD_MAX {
                self.admitted.pop_first();
            }
            return None;
        };
        // Taken back once, whichever of the sends the region reports.
        self.forget_seqs(&seqs);
        Some((key, cost))
    }

    /// Forgets the sends `seqs` of a fallback no longer held: a later report of one of
    /// them has no count to take back.
    fn forget_seqs(&mut self, seqs: &[u64]) {
        for seq in seqs {
            self.by_seq.remove(seq);
        }
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

    /// Rules' timeouts differ: a check sent first may fall back after thousands sent later.
    #[test]
    fn a_fallback_counted_after_those_of_later_checks_is_taken_back() {
        let mut late = LateFallbacks::default();
        for seq in 1..=HELD_MAX as u64 {
            late.counted(&[seq], key(), 1);
        }
        assert!(!late.counted(&[0], key(), 5));
        assert_eq!(
            late.admitted(0),
            Some((key(), 5)),
            "the last fallback counted is held"
        );
    }
}
