//! The region path: exact rules, decided on one authoritative, durable count.
//!
//! An edge forwards exact checks to the region node over its QUIC connection, in frames on
//! one long-lived bidirectional stream (a session, see [`forward`] and [`wire`]). The
//! region decides each on its [`Ledger`] (linearizable: one task decides, in arrival
//! order, on the state every earlier decision left), appends a record, and answers only
//! after the [`committer`] has synced that record's group to disk. Request ids make retries idempotent: a repeated id gets
//! the first answer, after the same sync, and counts nothing more.
//!
//! After a failed write or sync the committer refuses everything, forever (until
//! restart): it never retries and then acknowledges, because a failed `fsync` may have
//! dropped dirty pages the kernel will not write again.

pub mod committer;
pub mod forward;
pub mod log;
pub mod service;
pub mod wire;

use crate::config::RuleConfig;
use log::Record;
use std::collections::HashMap;
use tally_crdt::{Key, Rule, Subject, Window};
pub use wire::{ExactAnswer, ExactCheck, Outcome};

/// The authoritative counts of exact rules, and the outcomes of each edge life's most
/// recent request ids. Pure state: the committer makes it durable.
#[derive(Debug, Default)]
pub struct Ledger {
    // Invariant: a count never decreases within its window.
    counts: HashMap<Key, u64>,
    // Per edge life (node, generation): the outcomes of its last `RECENT_IDS` requests.
    seen: HashMap<(u64, u64), Recent>,
}

/// How many request ids of one edge life the ledger answers retries of. An edge retries
/// only within its rule's timeout, and numbers its requests in order, so its retries are
/// of recent ids; this bounds the memory of a window to this many per edge life instead
/// of one entry per decision.
pub const RECENT_IDS: usize = 65_536;

/// One edge life's recent outcomes.
#[derive(Debug, Default)]
struct Recent {
    outcomes: std::collections::BTreeMap<u64, (Outcome, Window)>,
    // Invariant: every sequence number below this was decided and then forgotten.
    floor: u64,
}

/// What [`Ledger::decide`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decided {
    /// A new decision, to be logged before it is acknowledged.
    New(Outcome, Record),
    /// A retry of a decided request: its first outcome, nothing new to log.
    Repeat(Outcome),
    /// A retry of a request older than the last [`RECENT_IDS`] of its edge life: its
    /// outcome is forgotten, and it is not decided again (that could count it twice).
    Forgotten,
}

impl Ledger {
    /// The ledger the log's records add up to.
    pub fn replay(records: &[Record]) -> Ledger {
        let mut ledger = Ledger::default();
        for record in records {
            ledger.apply(record);
        }
        ledger
    }

    /// Decides `check` under `rule`: admits iff the count plus the cost stays within the
    /// limit. A request id seen before gets its first outcome.
    pub fn decide(&mut self, check: &ExactCheck, rule: &RuleConfig) -> Option<Decided> {
        if let Some(recent) = self.seen.get(&(check.id.node, check.id.generation)) {
            if check.id.seq < recent.floor {
                return Some(Decided::Forgotten);
            }
            if let Some((outcome, _)) = recent.outcomes.get(&check.id.seq) {
                return Some(Decided::Repeat(*outcome));
            }
        }
        let key = key_of(
            &check.rule,
            &check.subject,
            check.window_index,
            check.window_secs,
        )?;
        let count = self.counts.get(&key).copied().unwrap_or(0);
        let allowed = count
            .checked_add(check.cost)
            .is_some_and(|after| after <= rule.limit);
        let record = Record {
            id: check.id,
            rule: check.rule.clone(),
            subject: check.subject.clone(),
            window_index: check.window_index,
            window_secs: check.window_secs,
            cost: check.cost,
            allowed,
        };
        let outcome = self.apply(&record);
        Some(Decided::New(outcome, record))
    }

    /// The count of `key`.
    pub fn count(&self, key: &Key) -> u64 {
        self.counts.get(key).copied().unwrap_or(0)
    }

    /// Every key counted, with its count.
    pub fn counts(&self) -> impl Iterator<Item = (&Key, u64)> {
        self.counts.iter().map(|(key, count)| (key, *count))
    }

    /// Forgets windows that are over at `now_unix_secs`, and their request ids.
    pub fn expire(&mut self, now_unix_secs: u64) {
        self.counts
            .retain(|key, _| key.window.is_live(now_unix_secs));
        for recent in self.seen.values_mut() {
            recent
                .outcomes
                .retain(|_, (_, window)| window.is_live(now_unix_secs));
        }
        self.seen.retain(|_, recent| !recent.outcomes.is_empty());
    }

    fn apply(&mut self, record: &Record) -> Outcome {
        let Some(key) = key_of(
            &record.rule,
            &record.subject,
            record.window_index,
            record.window_secs,
        ) else {
            return Outcome {
                allowed: false,
                count: 0,
            };
        };
        let window = key.window;
        let count = self.counts.entry(key).or_default();
        if record.allowed {
            *count = count.saturating_add(record.cost);
        }
        let outcome = Outcome {
            allowed: record.allowed,
            count: *count,
        };
        let recent = self
            .seen
            .entry((record.id.node, record.id.generation))
            .or_default();
        recent.outcomes.insert(record.id.seq, (outcome, window));
        if recent.outcomes.len() > RECENT_IDS {
            if let Some((oldest, _)) = recent.outcomes.pop_first() {
                recent.floor = recent.floor.max(oldest + 1);
            }
        }
        outcome
    }
}

/// The key of a forwarded check, if its fields are within bounds.
pub fn key_of(rule: &str, subject: &str, window_index: u64, window_secs: u32) -> Option<Key> {
    Some(Key::new(
        Rule::new(rule).ok()?,
        Subject::new(subject).ok()?,
        Window::new(window_index, window_secs).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RuleMode;
    use log::RequestId;

    fn rule(limit: u64) -> RuleConfig {
        RuleConfig::for_test("quota", limit, RuleMode::Exact)
    }

    fn check(seq: u64, cost: u64) -> ExactCheck {
        ExactCheck {
            id: RequestId {
                node: 2,
                generation: 1,
                seq,
            },
            rule: "quota".into(),
            subject: "acct-1".into(),
            window_index: 500_000,
            window_secs: 3_600,
            cost,
        }
    }

    #[test]
    fn checks_admit_up_to_the_limit_and_never_past_it() {
        let mut ledger = Ledger::default();
        let allowed: Vec<bool> = (0..6)
            .map(
                |seq| match ledger.decide(&check(seq, 2), &rule(7)).unwrap() {
                    Decided::New(outcome, _) => outcome.allowed,
                    Decided::Repeat(_) | Decided::Forgotten => panic!("a new id is decided anew"),
                },
            )
            .collect();
        assert_eq!(allowed, [true, true, true, false, false, false]);
        // A cost that fits still goes in after larger ones were refused.
        let Decided::New(outcome, _) = ledger.decide(&check(9, 1), &rule(7)).unwrap() else {
            panic!()
        };
        assert_eq!(
            outcome,
            Outcome {
                allowed: true,
                count: 7
            }
        );
    }

    #[test]
    fn a_retried_request_id_gets_its_first_outcome_and_counts_nothing_more() {
        let mut ledger = Ledger::default();
        let first = ledger.decide(&check(1, 3), &rule(10)).unwrap();
        let Decided::New(outcome, _) = first else {
            panic!()
        };
        for _ in 0..3 {
            assert_eq!(
                ledger.decide(&check(1, 3), &rule(10)),
                Some(Decided::Repeat(outcome))
            );
        }
        let key = key_of("quota", "acct-1", 500_000, 3_600).unwrap();
        assert_eq!(ledger.count(&key), 3);
    }

    #[test]
    fn an_edge_lifes_oldest_ids_are_forgotten_never_decided_twice() {
        let mut ledger = Ledger::default();
        let total = RECENT_IDS as u64 + 10;
        for seq in 0..total {
            assert!(matches!(
                ledger.decide(&check(seq, 1), &rule(u64::MAX)),
                Some(Decided::New(..))
            ));
        }
        for seq in 0..10 {
            assert_eq!(
                ledger.decide(&check(seq, 1), &rule(u64::MAX)),
                Some(Decided::Forgotten)
            );
        }
        assert!(matches!(
            ledger.decide(&check(10, 1), &rule(u64::MAX)),
            Some(Decided::Repeat(_))
        ));
        let key = key_of("quota", "acct-1", 500_000, 3_600).unwrap();
        assert_eq!(ledger.count(&key), total, "nothing counted twice");
    }

    #[test]
    fn replaying_the_records_rebuilds_counts_and_request_ids() {
        let mut ledger = Ledger::default();
        let mut records = Vec::new();
        for seq in 0..5 {
            if let Some(Decided::New(_, record)) = ledger.decide(&check(seq, 3), &rule(10)) {
                records.push(record);
            }
        }
        let mut replayed = Ledger::replay(&records);
        let key = key_of("quota", "acct-1", 500_000, 3_600).unwrap();
        assert_eq!(replayed.count(&key), 9);
        assert!(matches!(
            replayed.decide(&check(2, 3), &rule(10)),
            Some(Decided::Repeat(_))
        ));
    }
}
