//! Rules and decisions: how a check is answered, and the bound each answer reports.
//!
//! Approximate rules are decided here with no network crossing (BRIEF.md, "Rules and the
//! three ways to answer"):
//!
//! - **connected** (every live member fresher than the rule's `stale_after`): admit iff
//!   `estimate + cost <= limit`, the estimate of a `sliding` rule weighting the previous
//!   window's. The bound in force is the admissions the other nodes may have made unseen:
//!   their increment rate on this key times the stalest live member's staleness. (The sum
//!   over origins of rate x staleness is at most this.)
//! - **isolated** (some live member staler): admit iff
//!   `own + cost <= limit / locations + slack`, where `own` counts this node's lanes of
//!   every life it has had as merged here (a restart does not give it a second share; but
//!   a life that lost its state knows its earlier lives' lanes only once they are merged
//!   here again, and until then may admit part of a share again: ARCHITECTURE.md, BOUND),
//!   and under a
//!   `sliding` rule its own previous window, weighted as a connected decision weighs
//!   everyone's. A window's count is net: decrements make room. The bound is
//!   `locations x slack` plus what was admitted before isolation beyond the shares: an
//!   isolated location admits up to its share, or nothing if it already held more, so the
//!   window's total is at most the limit, `locations x slack`, and what each location
//!   held beyond its share when it turned isolated. This node's own excess is exact. The
//!   others' is at most their count less one share, however it is split among them
//!   (BRIEF.md's case: one location admitted the whole limit while connected): their
//!   count as last merged here, each location's at no less than zero (one below zero,
//!   from releases counted in a later window than their acquires, would hide another's
//!   excess in the sum), plus what they may have admitted unseen in the
//!   `stale_after` before this node turned isolated (their rate times `stale_after`).
//!   Nodes that are not locations (members that left, nodes with no row here) hold no
//!   share: all they hold counts beyond the shares. A rule's configured `locations` sets
//!   the share; where this node knows of more locations than that, each one past it may
//!   admit a share as well, and the bound adds a share for each.
//! - **dead** (a member declared dead, a live member whose state here is at least
//!   `dead_after` old, or a seed still unheard past `dead_after`): in either mode the
//!   bound adds what each such member may admit unseen. It may be alive beyond a
//!   partition, reading this node dead too and deciding connected on the whole limit, or
//!   isolated on its share: the larger of the two, less the share an isolated decision
//!   already takes it to admit. A live member that old may have declared this node dead
//!   first (the failure detectors of two nodes do not agree to the round), or, after a
//!   partition heals, be heard again before what it admitted meanwhile arrives. So a
//!   member that crashed for good keeps a whole limit in every bound until it is started
//!   again (and leaves, if stopped), or an operator forgets it (`Gossip::forget`).
//! - **unheard** (a seed not heard yet, or a live member none of whose current life's
//!   state has arrived: this node just started, or the member did; and for a rate
//!   sample's time, 100 ms, after this life first heard every live member): decided as
//!   above, but the bound is infinite. Such a member's count is unknown, not just stale
//!   (it counts as stale, so the decision is isolated), and a new life's rates read 0
//!   until their first sample, so no finite bound this node could report would hold.
//!   A life that lost its state may still hear its earlier lives' lanes later than
//!   every live member's state: the gossip repairs origin by origin (ARCHITECTURE.md,
//!   BOUND).
//!
//! A decision's `remaining` is what the rule that decided would still admit: the limit
//! less the estimate when connected, the share less `own` when isolated.
//!
//! Exact rules go to the region (see `region`); when it cannot answer in time they get
//! `RegionUnavailable` or the rule's `on_region_unavailable` fallback, decided here.

use crate::config::{OnRegionUnavailable, RuleConfig};
use crate::lanelog::LaneLog;
use crate::refused_sums::RefusedSums;
use crate::region::Outcome;
use crate::store::{KeyHasher, LaneStore, StoreError};
use crate::view::{Remote, ViewState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tally_client::wire::{Decision, Estimate, Mode, Refusal};
use tally_crdt::{lane_within_rate, KeyError, KeyRef, Lane, Rule, Stamp, Window};

/// The rules a node answers, by name.
#[derive(Debug, Clone, Default)]
pub struct Rules {
    // The store's hasher: rule names come from clients too.
    by_name: HashMap<String, (Rule, Arc<RuleConfig>), KeyHasher>,
}

impl Rules {
    /// The configured rules. Their names were checked when the config was loaded.
    pub fn new(rules: &[RuleConfig]) -> Result<Rules, KeyError> {
        let mut by_name = HashMap::default();
        for rule in rules {
            by_name.insert(
                rule.name.clone(),
                (Rule::new(rule.name.as_str())?, Arc::new(rule.clone())),
            );
        }
        Ok(Rules { by_name })
    }

    /// The rule named `name`.
    pub fn get(&self, name: &str) -> Result<&(Rule, Arc<RuleConfig>), Refusal> {
        self.by_name.get(name).ok_or_else(|| Refusal::UnknownRule {
            rule: name.to_owned(),
        })
    }
}

/// What a rule's way of answering decided, before it is made a [`Decision`].
struct Verdict {
    allowed: bool,
    // The count the decision was made on.
    estimate: i128,
    // What the rule that decided would still admit.
    room: i128,
    mode: Mode,
    bound: f64,
}

impl Verdict {
    /// The rule's `on_region_unavailable` answered, on this node's `estimate`. An `allow`
    /// admits whatever the count: no bound holds its overshoot, and nothing is left
    /// unadmitted (`remaining` is `u64::MAX`); a `deny` admits nothing (`remaining` 0).
    fn fallback(rule: &RuleConfig, allowed: bool, estimate: i128) -> Verdict {
        let unbounded = rule.on_region_unavailable == OnRegionUnavailable::Allow;
        Verdict {
            allowed,
            estimate,
            room: if unbounded { i128::from(u64::MAX) } else { 0 },
            mode: Mode::RegionFallback,
            bound: if unbounded { f64::INFINITY } else { 0.0 },
        }
    }
}

/// One request's context: the node's state at one moment.
pub struct Context<'a> {
    /// The lane store.
    pub store: &'a LaneStore,
    /// The gossip's view.
    pub view: &'a ViewState,
    /// The wall clock now.
    pub now: Stamp,
    /// The monotonic clock now, as the gossip task reads it: when this context's writes
    /// are made, for the store to tell the gossip task ([`LaneStore::note_written`]).
    pub written_at: Duration,
    /// The lane log, if the node has a data dir.
    pub log: Option<&'a mut LaneLog>,
    /// The most a lane may hold per second its window has run (`lane_rate_max_per_sec`):
    /// peers leave out a lane past it, so this node writes none.
    pub lane_rate_max: u64,
    /// Counts the writes refused because the lane log had no room for their record.
    pub lane_log_refused: &'a AtomicU64,
    /// Counts the writes refused because the store held `keys_max` keys.
    pub keys_refused: &'a AtomicU64,
    /// The remote sums the store refused at its key cap.
    pub refused: &'a RefusedSums,
}

/// How long until `window` ends, at wall-clock `now_ms`: a decision's `reset_after_ms`.
pub fn reset_after_ms(window: Window, now_ms: u64) -> u64 {
    (window.end_unix_secs() * 1_000).saturating_sub(now_ms)
}

/// The key of `subject` under `rule` in the window containing now, borrowed: building
/// it allocates nothing.
pub fn key<'a>(
    rule: &'a (Rule, Arc<RuleConfig>),
    subject: &'a str,
    now: Stamp,
) -> Result<KeyRef<'a>, Refusal> {
    let window = Window::containing(now.0 / 1_000, rule.1.window_secs)
        .map_err(|err| bad("window", err.to_string()))?;
    KeyRef::new(&rule.0, subject, window).map_err(|err| bad("subject", err.to_string()))
}

impl Context<'_> {
    /// Adds `amount` (or subtracts it) and returns the count after the write.
    pub fn count(&mut self, key: KeyRef<'_>, amount: u64, incr: bool) -> Result<Estimate, Refusal> {
        self.write(key, amount, incr, "amount")
    }

    /// [`Context::count`], a refusal naming the request's `field` that carried `amount`.
    fn write(
        &mut self,
        key: KeyRef<'_>,
        amount: u64,
        incr: bool,
        field: &'static str,
    ) -> Result<Estimate, Refusal> {
        if amount == 0 {
            return Err(bad(field, "must be at least 1".into()));
        }
        let own = self.store.own(key);
        let after = if incr {
            Lane::new(own.incr.saturating_add(amount), own.decr)
        } else {
            Lane::new(own.incr, own.decr.saturating_add(amount))
        };
        if !lane_within_rate(after, key.window(), self.lane_rate_max, self.now.0 / 1_000) {
            let why = format!(
                "would take this node's count of the key past lane_rate_max_per_sec ({}) for \
                 each second of its window so far; peers would not take it",
                self.lane_rate_max
            );
            return Err(bad(field, why));
        }
        // Logged first, so a write the log refuses changes nothing; flushed by the caller
        // before it awaits anything, so the gossip task never sees a lane the log lacks.
        let mark = self.log_write(key, amount, incr)?;
        let written = if incr {
            self.store.incr(key, amount)
        } else {
            self.store.decr(key, amount)
        };
        let counted = written.map_err(|err| {
            if let (Some(log), Some(mark)) = (self.log.as_deref_mut(), mark) {
                log.undo(mark);
            }
            if let StoreError::KeysFull { .. } = err {
                self.keys_refused.fetch_add(1, Ordering::Relaxed);
            }
            refusal(err)
        })?;
        self.store.note_written(self.written_at);
        Ok(Estimate {
            estimate: counted.estimate,
            window: key.window().index(),
            staleness_ms: self.staleness().as_millis() as u64,
        })
    }

    /// The key's estimate now.
    pub fn estimate(&self, key: KeyRef<'_>) -> Estimate {
        Estimate {
            estimate: self.count_of(key),
            window: key.window().index(),
            staleness_ms: self.staleness().as_millis() as u64,
        }
    }

    /// Decides whether `cost` more is allowed under the approximate `rule`, and counts it
    /// if so.
    pub fn check(
        &mut self,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        cost: u64,
    ) -> Result<Decision, Refusal> {
        check_cost(cost)?;
        self.check_approximate(rule, key, cost)
    }

    /// Answers an exact check the region could not (`unavailable`), as the rule's
    /// `on_region_unavailable` says: the error itself, an approximate decision, or a
    /// flat allow (counted here) or deny. A fallback that cannot count here (the key cap,
    /// the lane's rate) answers `unavailable`, saying why: the check was forwarded and may
    /// have been counted at the region, which no other refusal allows for.
    pub fn fallback(
        &mut self,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        cost: u64,
        unavailable: Refusal,
    ) -> Result<Decision, Refusal> {
        let not_here = |refusal: Refusal| match unavailable.clone() {
            Refusal::RegionUnavailable { rule, why } => Refusal::RegionUnavailable {
                rule,
                why: format!("{why}; its fallback could not count here: {refusal}"),
            },
            other => other,
        };
        let (allowed, estimate) = match rule.on_region_unavailable {
            OnRegionUnavailable::Error => return Err(unavailable),
            OnRegionUnavailable::Approximate => {
                return self.check(rule, key, cost).map_err(not_here)
            }
            OnRegionUnavailable::Allow => {
                let written = self.write(key, cost, true, "cost").map_err(not_here)?;
                (true, written.estimate)
            }
            OnRegionUnavailable::Deny => (false, self.count_of(key)),
        };
        let staleness = self.staleness();
        let decided = Verdict::fallback(rule, allowed, estimate);
        Ok(self.decision(rule, key, decided, staleness))
    }

    /// Takes back a fallback's count of `cost` on `key`: a decrement of the own lane.
    pub fn take_back(&mut self, key: KeyRef<'_>, cost: u64) -> Result<(), Refusal> {
        self.write(key, cost, false, "cost").map(|_| ())
    }

    /// The decision the region's durable `outcome` makes: exact, with no overshoot bound.
    pub fn exact(&self, rule: &RuleConfig, key: KeyRef<'_>, outcome: Outcome) -> Decision {
        // The region's count is not stale: its decision is the authoritative one.
        let count = i128::from(outcome.count);
        let decided = Verdict {
            allowed: outcome.allowed,
            estimate: count,
            room: i128::from(rule.limit) - count,
            mode: Mode::Exact,
            bound: 0.0,
        };
        self.decision(rule, key, decided, Duration::ZERO)
    }

    fn check_approximate(
        &mut self,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        cost: u64,
    ) -> Result<Decision, Refusal> {
        let freshness = self.view.freshness(self.now);
        let connected = freshness.staleness <= Duration::from_millis(rule.stale_after_ms);
        let current = self.count_of(key);
        let previous = self.previous_window_part(rule, key, |key| self.count_of(key));
        let cost_i = i128::from(cost);
        let locations = rule.locations.unwrap_or(freshness.locations as u64).max(1);
        let share = (rule.limit / locations).saturating_add(rule.slack);
        // A member declared dead (or whose state is `dead_after` old, or a seed unheard past
        // it) may be alive beyond a partition, deciding on its side without this node's
        // count: connected there (its side reads this one dead too), it admits up to the
        // limit; isolated, up to its share. Neither shows here.
        let dead_may_admit = freshness.dead as f64 * rule.limit.max(share) as f64;
        let remote = self.view.remote(key);
        let ended_may_admit = self.ended_may_admit(rule, key, share, remote);
        let (mode, allowed, bound, room) = if connected {
            let room = i128::from(rule.limit) - (current + previous);
            let unseen = remote.unseen_in(freshness.staleness);
            let bound = unseen + dead_may_admit + ended_may_admit;
            (Mode::ApproximateConnected, cost_i <= room, bound, room)
        } else {
            // This location's count: its lives before a restart admitted under the share
            // too, and they are still counted in the window. A sliding rule weighs this
            // location's previous window as a connected decision weighs everyone's.
            let own_in = |key: KeyRef<'_>| self.store.own(key).value() + self.view.other_lives(key);
            let own = own_in(key) + self.previous_window_part(rule, key, own_in);
            let room = i128::from(share) - own;
            let unseen = remote.unseen_in(Duration::from_millis(rule.stale_after_ms));
            // Each other location counts at no less than zero: one below it would hide
            // another's excess in the sum.
            let below_zero_in = |key: KeyRef<'_>| self.view.below_zero(key);
            let below_zero =
                below_zero_in(key) + self.previous_window_part(rule, key, below_zero_in);
            let others = (current + previous - own + below_zero).max(0) as f64 + unseen;
            // Nodes that are not locations (members that left) hold no share: all they
            // hold is beyond the shares.
            let outside_in = |key: KeyRef<'_>| self.view.outside(key);
            let outside = outside_in(key) + self.previous_window_part(rule, key, outside_in);
            let in_shares = (others - outside as f64).max(0.0);
            let beyond_shares =
                (-room).max(0) as f64 + (in_shares - share as f64).max(0.0) + outside as f64;
            // Locations known here past the configured count each admit a share as well.
            let unconfigured = (freshness.locations as u64).saturating_sub(locations);
            // A dead member is a location, taken here to admit its share; it may admit more.
            let dead_beyond_share = dead_may_admit - freshness.dead as f64 * share as f64;
            let bound = locations as f64 * rule.slack as f64
                + unconfigured as f64 * share as f64
                + beyond_shares
                + dead_beyond_share
                + ended_may_admit;
            (Mode::ApproximateIsolated, cost_i <= room, bound, room)
        };
        // What a member none of whose state has arrived admitted is unknown, and so is
        // what they admit unseen before this life's rates are first sampled.
        let bound = if freshness.heard {
            bound
        } else {
            f64::INFINITY
        };
        let decided = if allowed {
            Verdict {
                allowed,
                estimate: self.write(key, cost, true, "cost")?.estimate + previous,
                room: room - cost_i,
                mode,
                bound,
            }
        } else {
            Verdict {
                allowed,
                estimate: current + previous,
                room,
                mode,
                bound,
            }
        };
        Ok(self.decision(rule, key, decided, freshness.staleness))
    }

    /// What the lives that ended unheard since `key`'s window began (the window before
    /// too, for a sliding rule) may have admitted in their time unheard and taken with
    /// them ([`crate::ended`]): each as much as a live member that stale here may admit
    /// unseen. Past `dead_after` as a member declared dead (it may have declared the
    /// others dead, and decided connected and alone); past the rule's `stale_after_ms` its
    /// share (it decided isolated); within it, what the other replicas make unseen in its
    /// time unheard.
    fn ended_may_admit(
        &self,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        share: u64,
        remote: Remote,
    ) -> f64 {
        if self.view.ended.is_empty() {
            return 0.0;
        }
        let window = key.window();
        let counted_from = match window.previous() {
            Some(previous) if rule.sliding => previous,
            _ => window,
        };
        let since = Stamp(counted_from.start_unix_secs() * 1_000);
        let stale_after = Duration::from_millis(rule.stale_after_ms);
        let dead_after = self.view.dead_after;
        (self.view.ended.unheard_after(since))
            .map(|unheard| {
                if dead_after.is_some_and(|dead_after| unheard >= dead_after) {
                    rule.limit.max(share) as f64
                } else if unheard > stale_after {
                    share as f64
                } else {
                    remote.unseen_in(unheard)
                }
            })
            .sum()
    }

    /// `key`'s estimate in the store, or while the store refuses the key at its cap, its
    /// peers' sum kept in `refused` (found in review, session 55: a `get` read 0, a check
    /// was admitted on 0 and refused `KeysFull` when counted, and a sliding rule's window
    /// before weighed 0).
    fn count_of(&self, key: KeyRef<'_>) -> i128 {
        self.refused.count(key, |key| self.store.estimate(key))
    }

    /// What a `sliding` rule's estimate takes from the previous window: its count (as
    /// `count` counts a key) weighted by the part of it still inside the sliding window,
    /// rounded up. 0 for a fixed window.
    fn previous_window_part(
        &self,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        count: impl Fn(KeyRef<'_>) -> i128,
    ) -> i128 {
        if !rule.sliding {
            return 0;
        }
        let window = key.window();
        let Some(previous) = window.previous() else {
            return 0;
        };
        let len_ms = u64::from(window.len_secs()) * 1_000;
        let elapsed_ms = self.now.0.saturating_sub(window.start_unix_secs() * 1_000);
        // In integers: in floating point, 7 s into a 10 s window weighed 0.30000000000000004,
        // and a count of 10 took 4, and counts past 2^53 lost their last units.
        let weighted = count(key.in_window(previous))
            .saturating_mul(i128::from(len_ms - elapsed_ms.min(len_ms)));
        let len_ms = i128::from(len_ms);
        let (whole, part) = (weighted / len_ms, weighted % len_ms);
        whole + i128::from(part > 0)
    }

    /// The decision on `key` under `rule`, as `decided`, on state `staleness` old.
    fn decision(
        &self,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        decided: Verdict,
        staleness: Duration,
    ) -> Decision {
        let Verdict {
            allowed,
            estimate,
            room,
            mode,
            bound,
        } = decided;
        let remaining = room.clamp(0, i128::from(u64::MAX)) as u64;
        Decision {
            allowed,
            estimate,
            limit: rule.limit,
            remaining,
            reset_after_ms: reset_after_ms(key.window(), self.now.0),
            mode,
            staleness_ms: staleness.as_millis() as u64,
            bound,
        }
    }

    fn staleness(&self) -> Duration {
        self.view.freshness(self.now).staleness
    }

    fn log_write(
        &mut self,
        key: KeyRef<'_>,
        amount: u64,
        incr: bool,
    ) -> Result<Option<usize>, Refusal> {
        let Some(log) = self.log.as_deref_mut() else {
            return Ok(None);
        };
        let (incr, decr) = if incr { (amount, 0) } else { (0, amount) };
        log.append(&key.to_key(), incr, decr)
            .map(Some)
            .map_err(|err| {
                self.lane_log_refused.fetch_add(1, Ordering::Relaxed);
                Refusal::Storage {
                    why: err.to_string(),
                }
            })
    }
}

/// A check's cost must be at least 1, for approximate and exact rules alike.
pub fn check_cost(cost: u64) -> Result<(), Refusal> {
    if cost == 0 {
        return Err(bad("cost", "must be at least 1".into()));
    }
    Ok(())
}

fn bad(field: &str, why: String) -> Refusal {
    Refusal::BadField {
        field: field.to_owned(),
        why,
    }
}

fn refusal(err: StoreError) -> Refusal {
    match err {
        StoreError::Overflow(_) => Refusal::Overflow,
        StoreError::KeysFull { keys_max } => Refusal::KeysFull {
            keys_max: keys_max as u64,
        },
    }
}

// The lane store runs on loom's atomics under `tally_loom`, which work only inside a model.
#[cfg(test)]
#[cfg(not(tally_loom))]
mod tests {
    use super::*;
    use crate::view::UnheardSeeds;
    use tally_crdt::{CounterMap, Generation, Key, NodeId, PnCounter, ReplicaId};
    use tally_gossip::membership::State;

    const NOW: Stamp = Stamp(1_767_225_630_000);

    fn rule(limit: u64, slack: u64) -> RuleConfig {
        RuleConfig {
            window_secs: 60,
            slack,
            stale_after_ms: 1_000,
            ..RuleConfig::for_test("api", limit, crate::config::RuleMode::Approximate)
        }
    }

    fn view(peer_stamp: Stamp) -> ViewState {
        view_of(&[(2, State::Alive)], peer_stamp)
    }

    /// A view whose members are `peers` (node id and state, generation 1), every one's
    /// stamp at `peer_stamp`.
    fn view_of(peers: &[(u64, State)], peer_stamp: Stamp) -> ViewState {
        let replica = |node| ReplicaId::new(NodeId(node), Generation(1));
        let mut view = ViewState::default();
        view.set_members(
            (peers.iter())
                .map(|&(node, state)| (NodeId(node), replica(node), state))
                .collect(),
            (peers.iter())
                .map(|&(node, _)| (replica(node), peer_stamp))
                .collect(),
            tally_gossip::Now {
                mono: Duration::from_millis(peer_stamp.0),
                wall: peer_stamp,
            },
        );
        view
    }

    static REFUSED: AtomicU64 = AtomicU64::new(0);
    static KEYS_REFUSED: AtomicU64 = AtomicU64::new(0);
    static NONE_REFUSED: std::sync::LazyLock<RefusedSums> =
        std::sync::LazyLock::new(RefusedSums::default);

    fn context<'a>(store: &'a LaneStore, view: &'a ViewState) -> Context<'a> {
        Context {
            store,
            view,
            now: NOW,
            written_at: Duration::from_millis(NOW.0),
            log: None,
            lane_rate_max: u64::MAX,
            lane_log_refused: &REFUSED,
            keys_refused: &KEYS_REFUSED,
            refused: &NONE_REFUSED,
        }
    }

    #[test]
    fn a_remote_sum_refused_at_the_key_cap_is_decided_on_once_expiry_makes_room() {
        // The driver's steps by hand: a peer's 100 of the limit refused at the cap, a key
        // of an ended window expired, the refused sum published again, then checks.
        let rule = rule(100, 0);
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 1);
        let rules = Rules::new(std::slice::from_ref(&rule)).unwrap();
        let owned = key(rules.get("api").unwrap(), "user-1", NOW)
            .unwrap()
            .to_key();
        let ended = Window::new(owned.window.index() - 2, 60).unwrap();
        store
            .incr(KeyRef::from(&owned).in_window(ended), 1)
            .unwrap();
        store.collect(&mut Vec::new());
        let refused = RefusedSums::default();
        assert!(refused.publish(&store, &owned, 100), "the store is full");
        let now_secs = NOW.0 / 1_000;
        assert_eq!(store.expire(now_secs), 1);
        refused.retry(&store, now_secs, |_| Some(100));
        let view = view(Stamp(NOW.0 - 100));
        let mut context = context(&store, &view);
        let decision = context.check(&rule, KeyRef::from(&owned), 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateConnected);
        assert!(
            !decision.allowed,
            "the peer's 100 fill the limit: {decision:?}"
        );
    }

    fn setup(rule: &RuleConfig) -> (LaneStore, Key) {
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 100);
        let rules = Rules::new(std::slice::from_ref(rule)).unwrap();
        let key = key(rules.get("api").unwrap(), "user-1", NOW).unwrap();
        (store, key.to_key())
    }

    #[test]
    fn a_counted_write_tells_the_store_when_it_was_made_and_a_refused_one_does_not() {
        let rule = rule(100, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let view = view(Stamp(NOW.0 - 100));
        let mut context = Context {
            written_at: Duration::from_millis(7),
            ..context(&store, &view)
        };
        context.count(key, 0, true).unwrap_err();
        assert_eq!(store.first_written(), None, "nothing was counted");
        context.count(key, 2, true).unwrap();
        assert_eq!(store.first_written(), Some(Duration::from_millis(7)));
        // The gossip task's `Driver::pending_since` holds this node's stamps to it until a
        // collection takes the write.
        store.collect(&mut Vec::new());
        assert_eq!(store.first_written(), None);
    }

    #[test]
    fn a_write_past_the_lane_rate_over_its_windows_age_is_refused_and_counts_nothing() {
        let rule = rule(1_000_000, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let view = view(Stamp(NOW.0 - 100));
        let mut context = context(&store, &view);
        context.lane_rate_max = 10;
        let seconds_run = NOW.0 / 1_000 - owned.window.start_unix_secs() + 1;
        let most = 10 * seconds_run;
        assert_eq!(
            context.count(key, most - 1, true).unwrap().estimate,
            i128::from(most - 1)
        );
        let over = context.count(key, 2, true);
        assert!(
            matches!(&over, Err(Refusal::BadField { field, .. }) if field == "amount"),
            "{over:?}"
        );
        // A decrement counts toward the lane too.
        assert!(context.count(key, 2, false).is_err());
        assert_eq!(store.own(key), Lane::new(most - 1, 0), "nothing counted");
        assert!(context.count(key, 1, false).is_ok());
        // A check whose cost the rule would admit is refused the same way, naming its cost.
        let checked = context.check(&rule, key, 2);
        assert!(
            matches!(&checked, Err(Refusal::BadField { field, .. }) if field == "cost"),
            "{checked:?}"
        );
        assert_eq!(store.own(key), Lane::new(most - 1, 1), "nothing counted");
    }

    #[test]
    fn connected_checks_admit_up_to_the_limit_counting_remote_lanes() {
        let rule = rule(10, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        store.publish_remote(&owned, 7).unwrap();
        let view = view(Stamp(NOW.0 - 100));
        let mut context = context(&store, &view);
        let decisions: Vec<Decision> = (0..5)
            .map(|_| context.check(&rule, key, 1).unwrap())
            .collect();
        assert_eq!(
            decisions.iter().map(|d| d.allowed).collect::<Vec<_>>(),
            [true, true, true, false, false]
        );
        assert_eq!(decisions[2].estimate, 10);
        assert_eq!(decisions[2].remaining, 0);
        assert_eq!(decisions[0].mode, Mode::ApproximateConnected);
        assert_eq!(decisions[0].staleness_ms, 100);
        assert_eq!(decisions[0].reset_after_ms, 30_000);
        assert_eq!(store.own(key).value(), 3, "a refused check counts nothing");
    }

    /// BOUND, as BRIEF.md computes it: connected, the bound in force is the other nodes'
    /// rate on the key times their staleness, and one for each of its writers (a rate is
    /// an average); isolated, what they admit over `stale_after` so counts toward what the
    /// other locations hold beyond their shares.
    #[test]
    fn the_bound_in_force_is_the_remote_rate_times_the_time_unseen() {
        let rule = rule(40, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let peer = ReplicaId::new(NodeId(2), Generation(1));
        // Node 2's lane of the key rises by 50 in a second: 50 a second.
        let rising = |view: &mut ViewState| {
            let mut counter = PnCounter::default();
            view.take_in(
                &owned,
                &counter,
                || None::<PnCounter>,
                store.replica(),
                1_000,
            );
            counter.incr(peer, 50).unwrap();
            view.take_in(
                &owned,
                &counter,
                || None::<PnCounter>,
                store.replica(),
                2_000,
            );
            assert_eq!(view.remote_rate(key), 50.0);
        };
        let mut connected = view(Stamp(NOW.0 - 500));
        rising(&mut connected);
        let decision = context(&store, &connected).check(&rule, key, 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateConnected);
        assert_eq!(decision.staleness_ms, 500);
        assert_eq!(
            decision.bound, 26.0,
            "50 a second, unseen for half a second, and one more its one writer may make \
             sooner than its average"
        );
        // Isolated, on a share of 40 / 2 = 20: node 2 admits 51 unseen over the rule's
        // stale_after of a second, 31 beyond its share.
        let mut isolated = view(Stamp(NOW.0 - 5_000));
        rising(&mut isolated);
        let decision = context(&store, &isolated).check(&rule, key, 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateIsolated);
        assert_eq!(decision.bound, 31.0, "{decision:?}");
    }

    #[test]
    fn a_stale_peer_puts_the_rule_in_isolated_mode_on_its_share() {
        let rule = rule(10, 1);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let view = view(Stamp(NOW.0 - 5_000));
        let mut context = context(&store, &view);
        // Two locations: a share of 10 / 2 + 1 = 6.
        let allowed = (0..10)
            .filter(|_| context.check(&rule, key, 1).unwrap().allowed)
            .count();
        assert_eq!(allowed, 6);
        let decision = context.check(&rule, key, 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateIsolated);
        assert_eq!(decision.remaining, 0, "the share is used up");
        // Two locations' slack; no location held more than its share.
        assert_eq!(decision.bound, 2.0);
    }

    #[test]
    fn an_isolated_bound_counts_what_was_admitted_before_isolation() {
        // BRIEF.md's case: another location admitted the whole limit while connected; then
        // the partition. Each of the 4 locations may still admit its share on its own count.
        let rule = RuleConfig {
            locations: Some(4),
            ..rule(100, 0)
        };
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        store.publish_remote(&owned, 100).unwrap();
        let view = view(Stamp(NOW.0 - 5_000));
        let mut context = context(&store, &view);
        let decisions: Vec<Decision> = (0..30)
            .map(|_| context.check(&rule, key, 1).unwrap())
            .collect();
        assert_eq!(decisions.iter().filter(|d| d.allowed).count(), 25);
        // Three such locations admit 75 past the limit: the bound every decision reported,
        // the others' 100 less one share.
        assert!(decisions.iter().all(|d| d.bound == 75.0), "{decisions:?}");
        assert_eq!((decisions[0].estimate, decisions[0].remaining), (101, 24));
    }

    #[test]
    fn an_isolated_bound_counts_each_other_location_at_no_less_than_zero() {
        // Three locations, a share of 100 each. Node 2 has released more than it took
        // this window (-50), node 3 has admitted 250 while connected. Node 2 may admit 150
        // more on its own count and this node 100, so the window can end at 450: 150 past
        // the limit, all of it node 3's excess. Netted, the others' 200 would say 100.
        let rule = RuleConfig {
            locations: Some(3),
            ..rule(300, 0)
        };
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let replica = |node| ReplicaId::new(NodeId(node), Generation(1));
        let mut counter = PnCounter::new();
        counter.incr(replica(2), 10).unwrap();
        counter.decr(replica(2), 60).unwrap();
        counter.incr(replica(3), 250).unwrap();
        store.publish_remote(&owned, 200).unwrap();
        let mut view = view_of(
            &[(2, State::Alive), (3, State::Alive)],
            Stamp(NOW.0 - 5_000),
        );
        view.take_in(&owned, &counter, || None::<PnCounter>, replica(1), 0);
        let mut context = context(&store, &view);
        let decision = context.check(&rule, key, 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateIsolated);
        assert!(decision.allowed);
        // And one more for each of nodes 2 and 3, writers of the key whose rate has no
        // second sample yet: each may admit once unseen.
        assert_eq!(decision.bound, 152.0, "{decision:?}");
    }

    #[test]
    fn an_isolated_sliding_rule_counts_each_other_location_at_no_less_than_zero_in_the_window_before(
    ) {
        // As above, in the window before, half of which still weighs: node 2 at -100
        // there, node 3 at 400, so node 3's sliding count is 200, 100 past its share.
        // Netted, the others' 150 would say 50.
        let rule = RuleConfig {
            locations: Some(3),
            sliding: true,
            ..rule(300, 0)
        };
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let previous = key.in_window(owned.window.previous().unwrap()).to_key();
        let replica = |node| ReplicaId::new(NodeId(node), Generation(1));
        let mut counter = PnCounter::new();
        counter.decr(replica(2), 100).unwrap();
        counter.incr(replica(3), 400).unwrap();
        store.publish_remote(&previous, 300).unwrap();
        let mut view = view_of(
            &[(2, State::Alive), (3, State::Alive)],
            Stamp(NOW.0 - 5_000),
        );
        view.take_in(&previous, &counter, || None::<PnCounter>, replica(1), 0);
        let mut context = context(&store, &view);
        let decision = context.check(&rule, key, 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateIsolated);
        // And one more for node 3, the key's one writer (node 2 only released): it may
        // admit once unseen though its rate has no second sample yet.
        assert_eq!(decision.bound, 101.0, "{decision:?}");
    }

    #[test]
    fn an_isolated_bound_counts_all_a_member_that_left_holds_beyond_the_shares() {
        // Node 3 admitted 60 and left; nodes 1 and 2 are cut off from each other, two
        // locations with a share of 50 each. Each admits 50: the window can end at 160,
        // 60 past the limit, all of it node 3's, which had no share to count it against.
        let rule = rule(100, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let replica = |node| ReplicaId::new(NodeId(node), Generation(1));
        let mut counter = PnCounter::new();
        counter.incr(replica(3), 60).unwrap();
        store.publish_remote(&owned, 60).unwrap();
        let mut view = view_of(&[(2, State::Alive), (3, State::Left)], Stamp(NOW.0 - 5_000));
        view.take_in(&owned, &counter, || None::<PnCounter>, replica(1), 0);
        let mut context = context(&store, &view);
        let decisions: Vec<Decision> = (0..60)
            .map(|_| context.check(&rule, key, 1).unwrap())
            .collect();
        assert_eq!(decisions.iter().filter(|d| d.allowed).count(), 50);
        assert!(decisions.iter().all(|d| d.bound == 60.0), "{decisions:?}");
        // Node 3 back: a location again, with a share its 60 counts against.
        let back = view.set_members(
            vec![
                (NodeId(2), replica(2), State::Alive),
                (NodeId(3), replica(3), State::Alive),
            ],
            [(replica(2), Stamp(NOW.0 - 5_000)), (replica(3), NOW)].into(),
            tally_gossip::Now {
                mono: Duration::from_millis(NOW.0),
                wall: NOW,
            },
        );
        assert_eq!((back.joined, back.left), (vec![NodeId(3)], vec![]));
        view.take_outside(&owned, &counter, replica(1));
        assert_eq!(view.outside(key), 0);
    }

    #[test]
    fn a_member_declared_dead_may_admit_a_whole_limit_unseen_and_every_bound_says_so() {
        // Node 3 is dead here: it may be alive beyond a partition, reading this node dead
        // too, and deciding connected on the whole limit without this node's count.
        let rule = rule(100, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let members = [(2, State::Alive), (3, State::Dead)];
        let connected = view_of(&members, Stamp(NOW.0 - 100));
        let decision = context(&store, &connected).check(&rule, key, 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateConnected);
        assert_eq!(
            decision.bound, 100.0,
            "no remote rate: node 3's limit alone"
        );

        // Node 2 stale: isolated, on a share of 100 / 3 = 33. Node 3 is taken to admit its
        // share like every location, and may admit 67 more.
        let isolated = view_of(&members, Stamp(NOW.0 - 5_000));
        let mut context = context(&store, &isolated);
        let decisions: Vec<Decision> = (0..40)
            .map(|_| context.check(&rule, key, 1).unwrap())
            .collect();
        assert!(decisions
            .iter()
            .all(|d| d.mode == Mode::ApproximateIsolated));
        assert_eq!(decisions.iter().filter(|d| d.allowed).count(), 33 - 1);
        assert!(decisions.iter().all(|d| d.bound == 67.0), "{decisions:?}");
    }

    /// A view in which node 2's life of generation 1, last heard at `heard`, was replaced
    /// by one that started at `next` (its generation) and is fresh, `dead_after` set.
    fn replaced(heard: Stamp, next: Stamp, dead_after: Duration) -> ViewState {
        let mut view = view_of(&[(2, State::Alive)], heard);
        view.dead_after = Some(dead_after);
        let life = ReplicaId::new(NodeId(2), Generation(next.0));
        let at = |stamp: Stamp| tally_gossip::Now {
            mono: Duration::from_millis(stamp.0),
            wall: stamp,
        };
        let fresh = Stamp(NOW.0 - 100);
        view.set_members(
            vec![(NodeId(2), life, State::Alive)],
            [(life, fresh)].into(),
            at(fresh),
        );
        view
    }

    #[test]
    fn a_life_that_ended_unheard_keeps_what_it_may_have_admitted_in_the_bound() {
        // Node 2's first life went unheard 6 s before its next life started, 1 s ago: it
        // may have admitted in those 6 s what no count holds now (no data dir kept it).
        // Found by the BOUND simulator: the bound fell to 9 while the cluster passed the
        // limit by the 283 such a life admitted.
        let rule = rule(100, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let decide = |view: &ViewState| context(&store, view).check(&rule, key, 1).unwrap();
        let (heard, next) = (Stamp(NOW.0 - 7_000), Stamp(NOW.0 - 1_000));

        // Past `dead_after`: it may have declared node 1 dead and decided on the whole limit.
        let decision = decide(&replaced(heard, next, Duration::from_secs(4)));
        assert_eq!(decision.mode, Mode::ApproximateConnected);
        assert_eq!(decision.bound, 100.0, "{decision:?}");
        // Past `stale_after_ms` alone: isolated there, on its share of 100 / 2.
        let decision = decide(&replaced(heard, next, Duration::from_secs(10)));
        assert_eq!(decision.bound, 50.0, "{decision:?}");
        // Unheard for less than `stale_after_ms`: the remote rate over that time (none
        // here).
        let decision = decide(&replaced(Stamp(next.0 - 500), next, Duration::from_secs(4)));
        assert_eq!(decision.bound, 0.0, "{decision:?}");

        // A life that ended before the window began admitted nothing in it.
        let window_start = Stamp(key.window().start_unix_secs() * 1_000);
        let before = replaced(
            Stamp(window_start.0 - 10_000),
            window_start,
            Duration::from_secs(4),
        );
        assert_eq!(decide(&before).bound, 0.0);
        // A sliding rule weighs the window before too, where it may have admitted.
        let sliding = RuleConfig {
            sliding: true,
            ..rule.clone()
        };
        let decision = context(&store, &before).check(&sliding, key, 1).unwrap();
        assert_eq!(decision.bound, 100.0, "{decision:?}");

        // Isolated, node 2's new life stale too: its location's share, and the ended
        // life's whole limit beyond it.
        let mut isolated = replaced(heard, next, Duration::from_secs(4));
        let life = ReplicaId::new(NodeId(2), Generation(next.0));
        isolated.set_members(
            vec![(NodeId(2), life, State::Alive)],
            [(life, Stamp(NOW.0 - 2_000))].into(),
            tally_gossip::Now {
                mono: Duration::from_millis(NOW.0),
                wall: NOW,
            },
        );
        let decision = decide(&isolated);
        assert_eq!(decision.mode, Mode::ApproximateIsolated);
        assert_eq!(decision.bound, 100.0, "{decision:?}");
    }

    #[test]
    fn a_life_heard_up_to_its_successors_start_adds_nothing_to_the_bound() {
        // Its successor re-published it from its data dir, stamped after its start.
        let rule = rule(100, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let next = Stamp(NOW.0 - 1_000);
        let mut view = replaced(Stamp(NOW.0 - 7_000), next, Duration::from_secs(4));
        let first = ReplicaId::new(NodeId(2), Generation(1));
        let mut map = CounterMap::new();
        // As `daemon::run` re-publishes it: above the new generation in microseconds.
        map.raise_version(first, tally_crdt::Version(next.0 * 1_000));
        map.write(first, &owned, Lane::new(3, 0), Stamp(next.0 + 1));
        map.write(
            ReplicaId::new(NodeId(2), Generation(next.0)),
            &owned,
            Lane::new(1, 0),
            next,
        );
        view.take_ended(&map, ReplicaId::new(NodeId(1), Generation(1)));
        let decision = context(&store, &view).check(&rule, key, 1).unwrap();
        assert_eq!(decision.bound, 0.0, "{decision:?}");
        assert!(view.ended.is_empty());
    }

    /// `Now` at `wall`, the monotonic clock reading the same.
    fn at(wall: Stamp) -> tally_gossip::Now {
        tally_gossip::Now {
            mono: Duration::from_millis(wall.0),
            wall,
        }
    }

    #[test]
    fn a_life_whose_stamps_ran_ahead_of_its_successors_generation_still_counts() {
        // Node 2's first life stamped its state 10 s ahead of this node's clock and of its
        // successor's: its host's wall clock was stepped back 10 s while it ran (its stamps
        // keep their monotonic pace, `OwnStamps`), or its node moved to a host whose clock
        // is 10 s behind. Its newest state arrived here 9 s ago; its successor started 1 s
        // ago. It may have gone on admitting, cut off, for up to 8 s: past `dead_after`,
        // a whole limit that no count holds. It counts whether this node held it as a
        // member or knows it only by its lanes in the map.
        let rule = rule(100, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let first = ReplicaId::new(NodeId(2), Generation(1));
        let next = ReplicaId::new(NodeId(2), Generation(NOW.0 - 1_000));
        let ahead = Stamp(NOW.0 + 1_000);
        let fresh = Stamp(NOW.0 - 100);
        let with_dead_after = || {
            let mut view = ViewState::default();
            view.dead_after = Some(Duration::from_secs(4));
            view
        };
        let successor_heard = |view: &mut ViewState| {
            view.set_members(
                vec![(NodeId(2), next, State::Alive)],
                [(next, fresh)].into(),
                at(fresh),
            );
        };

        let mut view = with_dead_after();
        view.set_members(
            vec![(NodeId(2), first, State::Alive)],
            [(first, ahead)].into(),
            at(Stamp(NOW.0 - 9_000)),
        );
        successor_heard(&mut view);
        let decision = context(&store, &view).check(&rule, key, 1).unwrap();
        assert_eq!(decision.bound, 100.0, "by the members: {decision:?}");

        let mut view = with_dead_after();
        successor_heard(&mut view);
        let mut map = CounterMap::new();
        map.write(first, &owned, Lane::new(3, 0), ahead);
        map.write(next, &owned, Lane::new(1, 0), fresh);
        view.take_ended(&map, ReplicaId::new(NodeId(1), Generation(1)));
        let decision = context(&store, &view).check(&rule, key, 1).unwrap();
        assert_eq!(decision.bound, 100.0, "by the map: {decision:?}");
    }

    #[test]
    fn a_live_member_whose_state_is_dead_after_old_may_have_admitted_a_whole_limit_unseen() {
        // Node 2's state is 5 s old here: isolated, on a share of 50.
        let rule = rule(100, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let mut view = view_of(&[(2, State::Alive)], Stamp(NOW.0 - 5_000));
        let decide = |view: &ViewState| context(&store, view).check(&rule, key, 1).unwrap();
        let decision = decide(&view);
        assert_eq!(decision.mode, Mode::ApproximateIsolated);
        assert_eq!(
            decision.bound, 0.0,
            "no `dead_after` known: a share's worth of it"
        );
        view.dead_after = Some(Duration::from_secs(10));
        assert_eq!(
            decide(&view).bound,
            0.0,
            "its state younger than `dead_after`"
        );
        // Past `dead_after`, it may have declared this node dead and decided on the whole
        // limit, 50 past its share.
        view.dead_after = Some(Duration::from_secs(4));
        assert_eq!(decide(&view).bound, 50.0);
    }

    #[test]
    fn an_isolated_bound_counts_a_share_for_each_location_known_past_those_configured() {
        // Configured for two locations, four known: each of the four may admit a share of
        // 50, so the window can end at 200; node 4, dead, may admit the whole limit, 50
        // past its share.
        let rule = RuleConfig {
            locations: Some(2),
            ..rule(100, 0)
        };
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let peers = [(2, State::Alive), (3, State::Alive), (4, State::Dead)];
        let view = view_of(&peers, Stamp(NOW.0 - 5_000));
        let mut context = context(&store, &view);
        let decisions: Vec<Decision> = (0..60)
            .map(|_| context.check(&rule, key, 1).unwrap())
            .collect();
        assert_eq!(decisions.iter().filter(|d| d.allowed).count(), 50);
        assert!(decisions.iter().all(|d| d.bound == 150.0), "{decisions:?}");
    }

    #[test]
    fn a_sliding_rule_reports_the_weighted_estimate_it_decided_on_and_its_room() {
        let rule = RuleConfig {
            sliding: true,
            ..rule(100, 0)
        };
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let previous = owned.window.previous().unwrap();
        let view = view(Stamp(NOW.0 - 100));
        let mut context = context(&store, &view);
        context.count(key.in_window(previous), 100, true).unwrap();
        context.count(key, 5, true).unwrap();
        // Half of the window has run: half the previous window's 100 still weighs.
        let admitted = context.check(&rule, key, 10).unwrap();
        assert!(admitted.allowed);
        assert_eq!((admitted.estimate, admitted.remaining), (50 + 5 + 10, 35));
        let refused = context.check(&rule, key, 40).unwrap();
        assert!(!refused.allowed);
        assert_eq!((refused.estimate, refused.remaining), (65, 35));
    }

    #[test]
    fn a_sliding_rules_previous_window_refused_at_the_key_cap_still_weighs_in_its_decisions() {
        // The store is full when the peers' count of the window before comes: refused,
        // and kept by the driver to publish again. The key of this window is held already.
        let rule = RuleConfig {
            sliding: true,
            ..rule(100, 0)
        };
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 1);
        let rules = Rules::new(std::slice::from_ref(&rule)).unwrap();
        let owned = key(rules.get("api").unwrap(), "user-1", NOW)
            .unwrap()
            .to_key();
        let key = KeyRef::from(&owned);
        let before = key.in_window(owned.window.previous().unwrap()).to_key();
        let refused = RefusedSums::default();
        assert!(!refused.publish(&store, &owned, 0));
        assert!(refused.publish(&store, &before, 1_000), "the store is full");
        let view = view(Stamp(NOW.0 - 100));
        let decision = Context {
            refused: &refused,
            ..context(&store, &view)
        }
        .check(&rule, key, 1)
        .unwrap();
        // Half of the window has run: half the peers' 1,000 still weighs.
        assert_eq!(decision.estimate, 500, "{decision:?}");
        assert!(!decision.allowed, "{decision:?}");
    }

    #[test]
    fn a_get_of_a_key_refused_at_the_key_cap_reads_the_peers_sum_kept_for_it() {
        // The store is full when the peers' count of the key comes: refused, and kept by
        // the driver to publish again. Its estimate is theirs, not 0.
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 1);
        let rule = rule(100, 0);
        let rules = Rules::new(std::slice::from_ref(&rule)).unwrap();
        let owned = key(rules.get("api").unwrap(), "user-1", NOW)
            .unwrap()
            .to_key();
        let other = key(rules.get("api").unwrap(), "user-2", NOW)
            .unwrap()
            .to_key();
        let refused = RefusedSums::default();
        assert!(!refused.publish(&store, &other, 0));
        assert!(refused.publish(&store, &owned, 1_000), "the store is full");
        let view = view(Stamp(NOW.0 - 100));
        let context = Context {
            refused: &refused,
            ..context(&store, &view)
        };
        assert_eq!(context.estimate(KeyRef::from(&owned)).estimate, 1_000);
    }

    #[test]
    fn a_check_on_a_key_refused_at_the_key_cap_is_denied_on_the_peers_sum_kept_for_it() {
        // The peers filled the limit on a key the full store refused: a check is denied on
        // their count, as it would be were the key held, not admitted on 0 and then
        // refused `KeysFull` when counted.
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 1);
        let rule = rule(100, 0);
        let rules = Rules::new(std::slice::from_ref(&rule)).unwrap();
        let found = rules.get("api").unwrap();
        let owned = key(found, "user-1", NOW).unwrap().to_key();
        let other = key(found, "user-2", NOW).unwrap().to_key();
        let refused = RefusedSums::default();
        assert!(!refused.publish(&store, &other, 0));
        assert!(refused.publish(&store, &owned, 1_000), "the store is full");
        let view = view(Stamp(NOW.0 - 100));
        let mut context = Context {
            refused: &refused,
            ..context(&store, &view)
        };
        let decision = context.check(&rule, KeyRef::from(&owned), 1);
        assert!(
            matches!(
                decision,
                Ok(Decision {
                    allowed: false,
                    estimate: 1_000,
                    ..
                })
            ),
            "{decision:?}"
        );
    }

    #[test]
    fn a_sliding_weight_that_makes_a_whole_count_takes_that_count_not_one_more() {
        // 7 s of a 10 s window have run: three tenths of the previous window's 10 weigh,
        // 3 (in floating point 0.30000000000000004 of it, which rounded up to 4).
        let rule = RuleConfig {
            sliding: true,
            window_secs: 10,
            ..rule(10, 0)
        };
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let previous = owned.window.previous().unwrap();
        let now = Stamp(NOW.0 + 7_000);
        let view = view(Stamp(now.0 - 100));
        let mut context = Context {
            now,
            ..context(&store, &view)
        };
        context.count(key.in_window(previous), 10, true).unwrap();
        context.count(key, 6, true).unwrap();
        let admitted = context.check(&rule, key, 1).unwrap();
        assert!(admitted.allowed);
        assert_eq!((admitted.estimate, admitted.remaining), (3 + 6 + 1, 0));
    }

    #[test]
    fn an_isolated_sliding_rule_weighs_its_own_previous_window_against_its_share() {
        let rule = RuleConfig {
            sliding: true,
            ..rule(20, 0)
        };
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let previous = owned.window.previous().unwrap();
        store
            .publish_remote(&key.in_window(previous).to_key(), 30)
            .unwrap();
        let view = view(Stamp(NOW.0 - 5_000));
        let mut context = context(&store, &view);
        context.count(key.in_window(previous), 10, true).unwrap();
        // Two locations: a share of 10. Half the window has run: half of this location's
        // 10 in the previous window still weighs, so 5 more are admitted, not 10.
        let decisions: Vec<Decision> = (0..10)
            .map(|_| context.check(&rule, key, 1).unwrap())
            .collect();
        assert_eq!(decisions.iter().filter(|d| d.allowed).count(), 5);
        assert_eq!(decisions[0].mode, Mode::ApproximateIsolated);
        // It reports the weighted estimate it decided on: half of the previous window's
        // 40 and the one admitted.
        assert_eq!((decisions[0].estimate, decisions[0].remaining), (20 + 1, 4));
    }

    #[test]
    fn an_allow_fallback_reports_no_bound_and_the_keys_cap_is_counted() {
        let mut rule = rule(10, 0);
        rule.mode = crate::config::RuleMode::Exact;
        rule.on_region_unavailable = OnRegionUnavailable::Allow;
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 1);
        let rules = Rules::new(std::slice::from_ref(&rule)).unwrap();
        let view = view(NOW);
        let keys_refused = AtomicU64::new(0);
        let mut context = Context {
            keys_refused: &keys_refused,
            ..context(&store, &view)
        };
        let unavailable = Refusal::RegionUnavailable {
            rule: "api".into(),
            why: "cut off".into(),
        };
        let held = key(rules.get("api").unwrap(), "held", NOW).unwrap();
        let decision = context
            .fallback(&rule, held, 11, unavailable.clone())
            .unwrap();
        assert!(decision.allowed);
        assert_eq!(
            decision.bound,
            f64::INFINITY,
            "an allow admits past any bound"
        );
        assert_eq!(decision.remaining, u64::MAX, "it admits whatever the count");
        // At the key cap the fallback cannot count: the answer stays the region's
        // unavailability (the check may have been counted there), saying why.
        let new = key(rules.get("api").unwrap(), "new", NOW).unwrap();
        let refused = context.fallback(&rule, new, 1, unavailable);
        let Err(Refusal::RegionUnavailable { why, .. }) = refused else {
            panic!("the key cap hid the region's unavailability: {refused:?}");
        };
        assert!(why.starts_with("cut off; ") && why.contains("key"), "{why}");
        assert_eq!(keys_refused.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_node_that_holds_no_members_state_yet_reports_an_infinite_bound() {
        let rule = rule(10, 1);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        // Just started: its two seeds unheard.
        let mut started = ViewState::default();
        started.unheard_seeds = UnheardSeeds { live: 2, dead: 0 };
        let decision = context(&store, &started).check(&rule, key, 1).unwrap();
        assert!(decision.allowed, "it still admits on its share");
        assert_eq!(decision.mode, Mode::ApproximateIsolated);
        assert_eq!(decision.bound, f64::INFINITY);
        // Past `dead_after` still unheard, they count as members declared dead: it decides
        // connected, alone, and each of them may have admitted the whole limit, 10.
        let mut unmatched = ViewState::default();
        unmatched.unheard_seeds = UnheardSeeds { live: 0, dead: 2 };
        let decision = context(&store, &unmatched).check(&rule, key, 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateConnected);
        assert_eq!(decision.bound, 20.0);
        // Its table has the members, but none of their state has arrived.
        let table_only = view_of(&[(2, State::Alive), (3, State::Alive)], Stamp(0));
        let decision = context(&store, &table_only).check(&rule, key, 1).unwrap();
        assert_eq!(decision.bound, f64::INFINITY);
        // Its one member's state arrived fresh, 50 ms ago, when the members were first
        // set: connected, but no rate has been sampled yet.
        let just_heard = view(Stamp(NOW.0 - 50));
        let decision = context(&store, &just_heard).check(&rule, key, 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateConnected);
        assert_eq!(decision.bound, f64::INFINITY);
        // Its one member's state arrived 5 s ago, stale now: the isolated bound, finite.
        let heard = view(Stamp(NOW.0 - 5_000));
        let decision = context(&store, &heard).check(&rule, key, 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateIsolated);
        assert_eq!(decision.bound, 2.0);
        // Alone, with no members and no seeds: nothing unheard, the connected bound.
        let alone = ViewState::default();
        let decision = context(&store, &alone).check(&rule, key, 1).unwrap();
        assert_eq!(decision.mode, Mode::ApproximateConnected);
        assert_eq!(decision.bound, 0.0);
    }

    #[test]
    fn an_isolated_node_counts_its_lives_before_a_restart_in_its_share() {
        let rule = rule(10, 1);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        // The life before the restart admitted 4 of its share of 6 in this window; its lane
        // is merged as a remote one, and a peer's 3 are in the remote sum too.
        store.publish_remote(&owned, 4 + 3).unwrap();
        let mut view = view(Stamp(NOW.0 - 5_000));
        view.other_lives.insert(owned.clone(), 4);
        let mut context = context(&store, &view);
        let allowed = (0..10)
            .filter(|_| context.check(&rule, key, 1).unwrap().allowed)
            .count();
        assert_eq!(allowed, 2, "the rest of the share, not a second one");
        assert_eq!(store.own(key).value(), 2);
    }

    #[test]
    fn bad_costs_and_amounts_are_refused_naming_the_field() {
        let rule = rule(10, 0);
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let view = view(NOW);
        let mut context = context(&store, &view);
        let err = context.check(&rule, key, 0).unwrap_err();
        assert!(matches!(err, Refusal::BadField { ref field, .. } if field == "cost"));
        let err = context.count(key, 0, true).unwrap_err();
        assert!(matches!(err, Refusal::BadField { ref field, .. } if field == "amount"));
        let long = "x".repeat(1_000);
        let rules = Rules::new(std::slice::from_ref(&rule)).unwrap();
        let err = self::key(rules.get("api").unwrap(), &long, NOW).unwrap_err();
        assert!(matches!(err, Refusal::BadField { ref field, .. } if field == "subject"));
        assert_eq!(store.own(key).value(), 0);
    }

    #[test]
    fn an_unavailable_region_gets_the_error_or_the_rules_fallback_never_a_silent_answer() {
        let mut rule = rule(10, 0);
        rule.mode = crate::config::RuleMode::Exact;
        let (store, owned) = setup(&rule);
        let key = KeyRef::from(&owned);
        let view = view(NOW);
        let mut context = context(&store, &view);
        let unavailable = Refusal::RegionUnavailable {
            rule: "api".into(),
            why: "cut off".into(),
        };
        let answer = context.fallback(&rule, key, 1, unavailable.clone());
        assert_eq!(answer, Err(unavailable.clone()));
        rule.on_region_unavailable = OnRegionUnavailable::Deny;
        let decision = context
            .fallback(&rule, key, 1, unavailable.clone())
            .unwrap();
        assert_eq!(
            (decision.allowed, decision.mode, decision.remaining),
            (false, Mode::RegionFallback, 0)
        );
        rule.on_region_unavailable = OnRegionUnavailable::Approximate;
        let decision = context.fallback(&rule, key, 1, unavailable).unwrap();
        assert_eq!(
            (decision.allowed, decision.mode),
            (true, Mode::ApproximateConnected)
        );
        assert_eq!(store.own(key).value(), 1);
    }
}
