//! Lives that ended unheard: a member's life that a newer life of its node replaced while
//! the newest state of it held here was older than the newer life's start.
//!
//! What such a life admitted after its newest state held here may never arrive: a node
//! without a data dir keeps nothing of a life past its process. No count anywhere then
//! holds those admissions, and once the newer life is heard the cluster decides as if
//! they had not been made, and admits them again. While the life was live and stale, a
//! decision counted what it may have admitted unseen; this keeps that count for the
//! windows it may have admitted in, after the life is gone (`decide`). Found by the BOUND
//! simulator past its CI seeds (session 50: `node/tests/bound_sim.rs`, seeds 472, 1143,
//! 2319 and 2425, each a node cut off alone and killed with its state lost before the
//! heal).
//!
//! A life is heard whole again, and forgotten here, once a later life of its node has
//! re-published it: a successor with a data dir re-publishes its earlier lives' logged
//! lanes at versions above its generation in microseconds (`daemon::run`), which no life's
//! own versions reach (`ViewState::take_ended`). A stamp does not tell it: a life's stamps
//! keep their monotonic pace while its wall clock is stepped back (`OwnStamps`), and a
//! node may start again on a host whose clock is behind, so a life that went on admitting
//! unheard may hold a state stamped after its successor's start (found in review, session
//! 51: such a life was taken as heard whole, and the bound read 0 against its limit).
//! How long such a life went unheard is unknown, and counted as from the epoch.
//!
//! A life forgotten once its windows are over is not noted again, though the gossip map
//! may hold its lanes for longer (a peer's rule with a longer window than any here): it
//! was counted again, as unheard even if it had been let go, at the next refresh (found
//! in review, session 51).

use std::collections::BTreeMap;
use std::time::Duration;
use tally_crdt::{Generation, NodeId, ReplicaId, Stamp, WINDOW_SECS_MAX};

/// The ended lives this node knows of, each until its unseen admissions' windows are over.
#[derive(Debug, Clone)]
pub struct EndedLives {
    // The lives with a time unheard, by when each ended at the latest (its successor's
    // generation, the wall clock of the successor's start): the newest stamp of it held
    // here, before its end, both on its node's clock. In order of their ends, so that a
    // decision walks only the lives that ended in its key's windows.
    unheard: BTreeMap<(Stamp, ReplicaId), Stamp>,
    // When each life in `unheard` ended.
    ends: BTreeMap<ReplicaId, Stamp>,
    // Lives not counted, each with its end: heard whole, or let go as gone
    // (`EndedLives::let_go`). Held so that a note of them again, from a map that still
    // holds their lanes, does not count them.
    settled: BTreeMap<ReplicaId, Stamp>,
    // How long after its end a life is kept: a window it admitted in may be as long as the
    // longest rule's, and a sliding rule weighs the window before too.
    kept_for: Duration,
    // The lives that ended by this stamp were forgotten (`EndedLives::forget_before`), and
    // are not noted again.
    forgotten_through: Stamp,
}

impl Default for EndedLives {
    /// Lives kept for two of the longest windows a rule may have.
    fn default() -> EndedLives {
        EndedLives::kept_for(Duration::from_secs(2 * u64::from(WINDOW_SECS_MAX)))
    }
}

impl EndedLives {
    /// No ended lives yet, each to be kept `kept_for` after its end.
    pub fn kept_for(kept_for: Duration) -> EndedLives {
        EndedLives {
            unheard: BTreeMap::new(),
            ends: BTreeMap::new(),
            settled: BTreeMap::new(),
            kept_for,
            forgotten_through: Stamp(0),
        }
    }

    /// Notes that `life` ended by `by` (its successor's generation, as a stamp), the
    /// newest state of it held here stamped `newest`. Noted again, a life keeps the newest
    /// of its stamps and the earliest of its ends; once its newest state is stamped at its
    /// end, it was heard up to it and is settled. A newest state stamped after its end came
    /// from a clock that is not its successor's, or that was stepped back: how long the
    /// life went unheard is unknown, and counted from the epoch.
    pub fn note(&mut self, life: ReplicaId, newest: Stamp, by: Stamp) {
        if self.settled.contains_key(&life) || by <= self.forgotten_through {
            return;
        }
        let (newest, by) = match self.remove_unheard(life) {
            Some((held, ended)) => (newest.max(held), by.min(ended)),
            None => (newest, by),
        };
        let newest = if newest > by { Stamp(0) } else { newest };
        if newest >= by {
            self.settled.insert(life, by);
        } else {
            self.unheard.insert((by, life), newest);
            self.ends.insert(life, by);
        }
    }

    /// Lets `life`, ended by `by`, go uncounted: it left, after its last push, or an
    /// operator forgot it as a crashed member that will not come back (`tally forget`).
    pub fn let_go(&mut self, life: ReplicaId, by: Stamp) {
        self.settle(life, by);
    }

    /// Settles `life`, ended by `by`, as heard whole: a later life of its node re-published
    /// it from its data dir.
    pub fn heard_whole(&mut self, life: ReplicaId, by: Stamp) {
        self.settle(life, by);
    }

    fn settle(&mut self, life: ReplicaId, by: Stamp) {
        self.remove_unheard(life);
        if by > self.forgotten_through {
            self.settled.insert(life, by);
        }
    }

    /// Takes `life` out of the unheard lives: its newest stamp and its end, if it was one.
    fn remove_unheard(&mut self, life: ReplicaId) -> Option<(Stamp, Stamp)> {
        let by = self.ends.remove(&life)?;
        let newest = self.unheard.remove(&(by, life))?;
        Some((newest, by))
    }

    /// Forgets the lives that ended more than `kept_for` before `now`.
    pub fn forget_before(&mut self, now: Stamp) {
        let kept_for = self.kept_for.as_millis() as u64;
        let kept = |by: Stamp| by.0.saturating_add(kept_for) > now.0;
        self.forgotten_through =
            (self.forgotten_through).max(Stamp(now.0.saturating_sub(kept_for)));
        self.unheard.retain(|(by, _), _| kept(*by));
        self.ends.retain(|_, by| kept(*by));
        self.settled.retain(|_, by| kept(*by));
    }

    /// How long each life that ended after `since` (a window's start, as a stamp) had gone
    /// unheard when it ended: from its newest state held here to its end. Walks only those
    /// lives.
    pub fn unheard_after(&self, since: Stamp) -> impl Iterator<Item = Duration> + '_ {
        let first = ReplicaId::new(NodeId(0), Generation(0));
        (self
            .unheard
            .range((Stamp(since.0.saturating_add(1)), first)..))
        .map(|((by, _), newest)| Duration::from_millis(by.0 - newest.0))
    }

    /// How many lives that ended unheard are held.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_crdt::{Generation, NodeId};

    fn life(generation: u64) -> ReplicaId {
        ReplicaId::new(NodeId(2), Generation(generation))
    }

    #[test]
    fn a_life_is_unheard_from_its_newest_state_held_to_its_successors_start() {
        let mut ended = EndedLives::default();
        ended.note(life(1_000), Stamp(4_000), Stamp(9_000));
        let unheard: Vec<Duration> = ended.unheard_after(Stamp(0)).collect();
        assert_eq!(unheard, [Duration::from_secs(5)]);
        assert_eq!(
            ended.unheard_after(Stamp(9_000)).count(),
            0,
            "a window that began after the life ended holds nothing of it"
        );
        assert_eq!(ended.unheard_after(Stamp(8_999)).count(), 1);
    }

    #[test]
    fn a_newer_state_shortens_the_time_unheard_and_one_as_new_as_the_end_forgets_it() {
        let mut ended = EndedLives::default();
        ended.note(life(1_000), Stamp(4_000), Stamp(9_000));
        ended.note(life(1_000), Stamp(3_000), Stamp(9_500));
        let unheard: Vec<Duration> = ended.unheard_after(Stamp(0)).collect();
        assert_eq!(
            unheard,
            [Duration::from_secs(5)],
            "an older stamp or a later end noted again changes nothing"
        );
        ended.note(life(1_000), Stamp(8_000), Stamp(9_000));
        let unheard: Vec<Duration> = ended.unheard_after(Stamp(0)).collect();
        assert_eq!(unheard, [Duration::from_secs(1)]);
        ended.note(life(1_000), Stamp(9_000), Stamp(9_000));
        assert!(
            ended.is_empty(),
            "a life re-published after its end was heard whole"
        );
        ended.note(life(1_000), Stamp(4_000), Stamp(9_000));
        assert!(
            ended.is_empty(),
            "a life heard whole stays settled, noted again from a map that holds its lanes"
        );
        ended.note(life(2_000), Stamp(2_000), Stamp(2_000));
        assert!(
            ended.is_empty(),
            "a life heard up to its end was never unheard"
        );
    }

    #[test]
    fn a_life_let_go_is_not_counted_however_it_is_noted() {
        let mut ended = EndedLives::default();
        ended.note(life(1_000), Stamp(4_000), Stamp(9_000));
        ended.let_go(life(1_000), Stamp(9_000));
        assert!(ended.is_empty());
        ended.let_go(life(9_000), Stamp(20_000));
        ended.note(life(9_000), Stamp(10_000), Stamp(20_000));
        assert!(ended.is_empty());
    }

    #[test]
    fn a_life_is_kept_for_its_windows_after_its_end() {
        let mut ended = EndedLives::kept_for(Duration::from_secs(120));
        ended.note(life(1_000), Stamp(4_000), Stamp(9_000));
        ended.note(life(9_000), Stamp(10_000), Stamp(60_000));
        ended.let_go(life(2_000), Stamp(9_000));
        ended.forget_before(Stamp(128_999));
        assert_eq!(ended.len(), 2);
        ended.forget_before(Stamp(129_000));
        assert_eq!(ended.len(), 1);
        assert_eq!(
            ended.unheard_after(Stamp(0)).collect::<Vec<_>>(),
            [Duration::from_secs(50)]
        );
        assert!(
            ended.settled.is_empty(),
            "a life let go is forgotten when its windows are over too"
        );
    }
}
