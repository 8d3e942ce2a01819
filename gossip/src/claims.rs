//! The cap on what one origin can claim per second (BRIEF.md, "Transport and trust").
//!
//! Members are trusted to relay other origins' lanes, so a faulty or compromised member
//! could relay a lane of any origin with inflated totals, and a merge keeps the larger. Each
//! origin has a budget here: what its lanes may rise, summed over its lanes and both totals,
//! refilled at `origin_rise_max_per_sec` a second up to one second's worth. An entry of
//! lanes is taken up to its first lane whose rise the budget cannot cover; that lane and the
//! rest are left out, and the entry's watermark is cut below it, as a budget-cut send would
//! be. So the node holds no inflated lane, never claims one it left out, and falls behind
//! that origin (its staleness rises) until the budget allows the rest, which a lane past a
//! whole second's budget never is.

use std::collections::BTreeMap;
use std::time::Duration;
use tally_crdt::{CounterMap, OriginDelta, ReplicaId, Version, Watermark};

/// Every origin's budget of lane rises.
#[derive(Debug, Clone)]
pub(crate) struct Claims {
    per_sec: u64,
    budgets: BTreeMap<ReplicaId, Budget>,
}

/// What an origin's lanes may still rise, as of a moment.
#[derive(Debug, Clone, Copy)]
struct Budget {
    left: u128,
    at: Duration,
}

impl Claims {
    /// Budgets of `per_sec` a second for every origin.
    pub(crate) fn new(per_sec: u64) -> Claims {
        Claims {
            per_sec,
            budgets: BTreeMap::new(),
        }
    }

    /// Cuts `entry` before its first lane whose rise over what `map` holds the origin's
    /// budget cannot cover at `now` (monotonic), spending the budget on the lanes kept.
    /// Lanes of windows over at `unix_secs` rise nothing: the map skips them. Returns how
    /// many lanes it left out.
    pub(crate) fn cut(
        &mut self,
        map: &CounterMap,
        entry: &mut OriginDelta,
        now: Duration,
        unix_secs: u64,
    ) -> usize {
        let full = u128::from(self.per_sec);
        let budget = self.budgets.entry(entry.origin).or_insert(Budget {
            left: full,
            at: now,
        });
        let elapsed = now.saturating_sub(budget.at).as_nanos();
        budget.left = full.min(budget.left + full.saturating_mul(elapsed) / 1_000_000_000);
        budget.at = now;
        for (index, update) in entry.lanes.iter().enumerate() {
            if !update.key.window.is_live(unix_secs) {
                continue;
            }
            let held = map.lane(&update.key, entry.origin);
            let rise = u128::from(update.lane.incr.saturating_sub(held.incr))
                + u128::from(update.lane.decr.saturating_sub(held.decr));
            if rise > budget.left {
                let refused = entry.lanes.len() - index;
                let below = Version(update.version.0.saturating_sub(1));
                entry.through = Watermark {
                    version: below.min(entry.through.version),
                    stamp: map.watermark(entry.origin).stamp,
                };
                entry.lanes.truncate(index);
                return refused;
            }
            budget.left -= rise;
        }
        0
    }

    /// Forgets the budgets of origins `map` no longer holds.
    pub(crate) fn retain_held(&mut self, map: &CounterMap) {
        let held: Vec<ReplicaId> = map.origins().collect();
        self.budgets
            .retain(|origin, _| held.binary_search(origin).is_ok());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_crdt::{Generation, Key, Lane, LaneUpdate, NodeId, Rule, Stamp, Subject, Window};

    const NOW_SECS: u64 = 600;

    fn origin() -> ReplicaId {
        ReplicaId::new(NodeId(2), Generation(1))
    }

    fn key(subject: usize) -> Key {
        Key::new(
            Rule::new("r").unwrap(),
            Subject::new(format!("s{subject}")).unwrap(),
            Window::containing(NOW_SECS, 60).unwrap(),
        )
    }

    /// An entry of `origin()`'s lanes: one per rise, on keys 0, 1, ..., at versions 1, 2, ...
    fn entry(rises: &[u64]) -> OriginDelta {
        OriginDelta {
            origin: origin(),
            through: Watermark {
                version: Version(rises.len() as u64),
                stamp: Stamp(5_000),
            },
            lanes: (rises.iter().enumerate())
                .map(|(i, &rise)| LaneUpdate {
                    key: key(i),
                    lane: Lane::new(rise, 0),
                    version: Version(i as u64 + 1),
                })
                .collect(),
        }
    }

    #[test]
    fn an_entry_is_cut_before_the_first_lane_the_budget_cannot_cover_and_claims_nothing_past_it() {
        let mut claims = Claims::new(100);
        let map = CounterMap::new();
        let mut cut = entry(&[60, 30, 20, 1]);
        assert_eq!(claims.cut(&map, &mut cut, Duration::ZERO, NOW_SECS), 2);
        assert_eq!(cut.lanes.len(), 2);
        assert_eq!(
            cut.through,
            Watermark {
                version: Version(2),
                stamp: Stamp::default(),
            },
            "the watermark stops below the first lane left out; the stamp does not move"
        );
        // Half a second adds 50 to the 10 left: enough for the lanes of 20 and 1, once the
        // two kept are held.
        let mut later = entry(&[60, 30, 20, 1]);
        let mut map = CounterMap::new();
        map.apply(&tally_crdt::Delta { origins: vec![cut] }, NOW_SECS);
        assert_eq!(
            claims.cut(&map, &mut later, Duration::from_millis(500), NOW_SECS),
            0,
            "lanes already held rise nothing"
        );
        assert_eq!(later.lanes.len(), 4);
    }

    #[test]
    fn a_lane_past_a_whole_seconds_budget_is_never_taken() {
        let mut claims = Claims::new(100);
        let map = CounterMap::new();
        for second in 0..5 {
            let mut inflated = entry(&[1, 1_000_000_000_000_000]);
            let now = Duration::from_secs(second);
            assert_eq!(claims.cut(&map, &mut inflated, now, NOW_SECS), 1);
            assert_eq!(inflated.lanes.len(), 1);
        }
    }
}
