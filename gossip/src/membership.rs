//! The membership table and a phi-accrual failure detector.
//!
//! A member is heard whenever fresher state of its current generation arrives, directly or
//! relayed: its heartbeat is its own clock stamp, which it advances every round. Silence
//! raises phi; past `suspect_phi` the member is suspected, and after `dead_after` of
//! suspicion it is dead. Dead members are still probed now and then, so a healed
//! partition rejoins; a member that is heard again is alive again.

use crate::message::MemberEntry;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tally_crdt::{NodeId, ReplicaId, Stamp};

/// How a member looks from here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum State {
    /// Heard recently.
    Alive,
    /// Silent for longer than the detector expects.
    Suspect,
    /// Suspected for longer than `dead_after`.
    Dead,
    /// Said goodbye.
    Left,
}

/// A change of a member's state, reported once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// The member.
    pub node: NodeId,
    /// Its replica at the time.
    pub replica: ReplicaId,
    /// Its address.
    pub addr: String,
    /// Its new state.
    pub state: State,
}

/// One member, as this node sees it.
#[derive(Debug, Clone)]
struct Member {
    entry: MemberEntry,
    state: State,
    // The monotonic time it was last heard, and the smoothed interval between hearings.
    heard_at: Option<Duration>,
    interval: Duration,
    suspect_since: Option<Duration>,
    // The newest stamp of its state heard (its wall clock when it made that state), for
    // its generation in `entry`.
    stamp: Stamp,
}

/// The table of members, including this node itself.
#[derive(Debug, Clone)]
pub struct Members {
    me: NodeId,
    members: BTreeMap<NodeId, Member>,
    expected_interval: Duration,
    pending: Vec<Transition>,
    // Whether a peer's table held this node's own life as gone while it had not left: an
    // operator forgot it elsewhere ([`Members::forget`]).
    forgotten: bool,
}

/// Why a member could not be forgotten.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForgetError {
    /// The node asked to forget itself.
    #[error("{0} is this node; a node leaves by stopping")]
    Myself(NodeId),
    /// No row of the node is held here.
    #[error("{0} is not a member this node knows")]
    NotAMember(NodeId),
    /// The member is not dead here: it is heard, or only suspected.
    #[error("{node} is {state:?} here; only a member this node holds dead can be forgotten")]
    NotDead {
        /// The member.
        node: NodeId,
        /// Its state here.
        state: State,
    },
}

impl Members {
    /// A table holding only `me`. `expected_interval` is how often a healthy member is
    /// heard (the gossip interval); the detector starts from it.
    pub fn new(me: MemberEntry, expected_interval: Duration) -> Members {
        let mut members = Members {
            me: me.node,
            members: BTreeMap::new(),
            expected_interval,
            pending: Vec::new(),
            forgotten: false,
        };
        members.insert(me, State::Alive);
        members
    }

    /// A hash of every row, so two nodes can tell cheaply whether their tables differ:
    /// FNV-1a (64-bit) over each row's node and generation (little-endian), address length
    /// and bytes, and `left`, in node order. Its algorithm is fixed, so nodes built by
    /// different toolchains agree (std's `DefaultHasher` promises no such thing, and two
    /// nodes whose hashes never matched would send tables in every exchange).
    pub fn hash(&self) -> u64 {
        let mut hash = FNV_OFFSET_BASIS;
        for member in self.members.values() {
            let MemberEntry {
                node,
                generation,
                addr,
                left,
            } = &member.entry;
            hash = fnv1a(hash, &node.0.to_le_bytes());
            hash = fnv1a(hash, &generation.0.to_le_bytes());
            hash = fnv1a(hash, &(addr.len() as u64).to_le_bytes());
            hash = fnv1a(hash, addr.as_bytes());
            hash = fnv1a(hash, &[u8::from(*left)]);
        }
        hash
    }

    /// This node's own row.
    pub fn me(&self) -> MemberEntry {
        self.members[&self.me].entry.clone()
    }

    /// Every row, for sending.
    pub fn entries(&self) -> Vec<MemberEntry> {
        self.members.values().map(|m| m.entry.clone()).collect()
    }

    /// Merges gossiped rows: a higher generation replaces a lower one (the old replica
    /// retires), and within a generation left beats alive.
    ///
    /// A row taken as new starts alive, or dead if its node is in `dead`, the nodes its
    /// sender holds as dead. So a node that starts takes a cluster's dead members as dead,
    /// instead of as alive members it has no stamp of (which hold its staleness high, and
    /// its decisions isolated) until its own failure detector has found each of them dead.
    /// A dead member is still probed, and is alive again once heard. A row already held
    /// keeps its state: this node's own view wins over a sender's. A row held without an
    /// address (see [`Members::heard`]) takes the address of the same row gossiped.
    ///
    /// This node's own row is never taken from a peer. If a peer holds this node's life as
    /// gone while it has not left, an operator forgot it ([`Members::forget`]) and the
    /// cluster no longer counts it: [`Members::take_forgotten`] says so once.
    pub fn merge(&mut self, entries: &[MemberEntry], dead: &[NodeId]) {
        let dead: BTreeSet<NodeId> = dead.iter().copied().collect();
        for entry in entries {
            if entry.node == self.me {
                let me = &self.members[&self.me];
                if entry.left && entry.generation == me.entry.generation && me.state != State::Left
                {
                    self.forgotten = true;
                }
                continue;
            }
            let rank = |row: &MemberEntry| (row.generation, row.left);
            match self.members.get_mut(&entry.node) {
                Some(held) if rank(&held.entry) == rank(entry) => {
                    if held.entry.addr.is_empty() {
                        held.entry.addr.clone_from(&entry.addr);
                    }
                }
                Some(held) if rank(&held.entry) > rank(entry) => {}
                _ => {
                    let state = if entry.left {
                        State::Left
                    } else if dead.contains(&entry.node) {
                        State::Dead
                    } else {
                        State::Alive
                    };
                    self.insert(entry.clone(), state);
                }
            }
        }
    }

    /// Records that fresh state of `replica` arrived at `now`. A newer generation than
    /// known replaces the row, with no address until the member's own row arrives by a
    /// table merge: a node that restarted may listen elsewhere, and a row kept with the old
    /// address would never match the member's own, so the tables would never agree.
    pub fn heard(&mut self, replica: ReplicaId, now: Duration) {
        if replica.node == self.me {
            return;
        }
        let Some(member) = self.members.get_mut(&replica.node) else {
            return;
        };
        if replica.generation < member.entry.generation {
            return;
        }
        if replica.generation > member.entry.generation {
            let entry = MemberEntry {
                generation: replica.generation,
                left: false,
                addr: String::new(),
                ..member.entry.clone()
            };
            self.insert(entry, State::Alive);
            return;
        }
        if member.state == State::Dead {
            // Back after it was found dead: the silence was not its interval, and taken
            // into the mean it would hold off the detector for many times that silence.
            member.interval = self.expected_interval;
        } else if let Some(last) = member.heard_at.filter(|&last| last < now) {
            // (At the same instant as the last it is the same hearing, not a gap of zero: a
            // frame's sender is heard, then its stamp in the frame. Taken as a gap, it would
            // pull the mean down by an eighth every time, and hold it at its floor.)
            // One gap counts as at most twice the mean: a member back from a pause long
            // enough to be suspected would otherwise hold off the detector for several
            // times that pause once it is silent for good (a 25 s pause made the mean 4 s,
            // and its suspicion 74 s away). A member that is slower for good still moves
            // the mean up, by at most an eighth each time it is heard.
            let gap = now.saturating_sub(last).min(member.interval * 2);
            // An exponentially weighted mean, never below the expected interval, so a
            // burst of fast messages does not make the detector jumpy.
            member.interval = (member.interval * 7 + gap) / 8;
            member.interval = member.interval.max(self.expected_interval);
        }
        member.heard_at = Some(now);
        member.suspect_since = None;
        if matches!(member.state, State::Suspect | State::Dead) {
            member.state = State::Alive;
            self.pending.push(transition(member));
        }
    }

    /// Records that state of `replica` stamped `stamp` (its wall clock when it made it)
    /// arrived at `now`, from it or relayed: heard as [`Members::heard`] only if the stamp
    /// is newer than every one heard of that generation before. A node forgets a dead
    /// member's watermark once its lanes are gone, and a peer that still holds the old
    /// stamp hands it back: that is no news of the member, and must not bring it back.
    ///
    /// A dead row with no stamp (taken in as dead from a peer's table by
    /// [`Members::merge`], or found dead before any of its state arrived) has nothing to
    /// tell news from its old state relayed: its first stamp is kept as that reference,
    /// and only a newer one (or a frame from the member) brings it back.
    pub fn heard_stamped(&mut self, replica: ReplicaId, stamp: Stamp, now: Duration) {
        if let Some(member) = (self.members.get(&replica.node))
            .filter(|member| member.entry.generation == replica.generation)
        {
            let unstamped_dead = member.state == State::Dead && member.stamp == Stamp::default();
            if stamp <= member.stamp || unstamped_dead {
                self.keep_stamp(replica, stamp);
                return;
            }
        }
        self.heard(replica, now);
        self.keep_stamp(replica, stamp);
    }

    /// Keeps `stamp` as heard of `replica` (its row's, if it has one of that generation)
    /// without counting it as hearing it: what the map held of a member before it lets the
    /// member's watermark go.
    pub fn keep_stamp(&mut self, replica: ReplicaId, stamp: Stamp) {
        if let Some(member) = self.members.get_mut(&replica.node) {
            if member.entry.generation == replica.generation {
                member.stamp = member.stamp.max(stamp);
            }
        }
    }

    /// Re-evaluates every member at `now` against the detector.
    pub fn check(&mut self, now: Duration, suspect_phi: f64, dead_after: Duration) {
        for member in self.members.values_mut() {
            if member.entry.node == self.me || matches!(member.state, State::Left | State::Dead) {
                continue;
            }
            let heard_at = *member.heard_at.get_or_insert(now);
            let phi = phi(now.saturating_sub(heard_at), member.interval);
            match member.state {
                State::Alive if phi > suspect_phi => {
                    member.state = State::Suspect;
                    member.suspect_since = Some(now);
                    self.pending.push(transition(member));
                }
                State::Suspect
                    if member
                        .suspect_since
                        .is_some_and(|s| now.saturating_sub(s) >= dead_after) =>
                {
                    member.state = State::Dead;
                    self.pending.push(transition(member));
                }
                _ => {}
            }
        }
    }

    /// Forgets `node`, a member this node holds dead, for good: its row is marked gone, as
    /// if its life had left, and the mark spreads with the table, since within a
    /// generation left beats alive. So no node keeps counting what a crashed member that
    /// will not come back may have admitted unseen. Its lanes stay, like any gone life's,
    /// until their windows end. A life of it started later has a newer generation and is
    /// a member again; a life forgotten while alive beyond a partition learns it from the
    /// first table that reaches it ([`Members::take_forgotten`]).
    ///
    /// Returns the life forgotten. A member already gone is forgotten already.
    pub fn forget(&mut self, node: NodeId) -> Result<ReplicaId, ForgetError> {
        if node == self.me {
            return Err(ForgetError::Myself(node));
        }
        let member = (self.members.get_mut(&node)).ok_or(ForgetError::NotAMember(node))?;
        match member.state {
            State::Left => {}
            State::Dead => {
                member.entry.left = true;
                member.state = State::Left;
                self.pending.push(transition(member));
            }
            state @ (State::Alive | State::Suspect) => {
                return Err(ForgetError::NotDead { node, state });
            }
        }
        Ok(member.entry.replica())
    }

    /// Whether a peer's table held this node's own life as gone (an operator forgot it
    /// there) since the last call.
    pub fn take_forgotten(&mut self) -> bool {
        std::mem::take(&mut self.forgotten)
    }

    /// Marks this node as leaving.
    pub fn leave(&mut self) {
        if let Some(me) = self.members.get_mut(&self.me) {
            me.entry.left = true;
            me.state = State::Left;
        }
    }

    /// The state changes since the last call.
    pub fn take_transitions(&mut self) -> Vec<Transition> {
        std::mem::take(&mut self.pending)
    }

    /// Members other than this node in `states`.
    pub fn others_in(&self, states: &[State]) -> Vec<NodeId> {
        self.members
            .values()
            .filter(|m| m.entry.node != self.me && states.contains(&m.state))
            .map(|m| m.entry.node)
            .collect()
    }

    /// `node`'s state, if it is a member.
    pub fn state(&self, node: NodeId) -> Option<State> {
        self.members.get(&node).map(|m| m.state)
    }

    /// `node`'s address, if it is a member.
    pub fn addr(&self, node: NodeId) -> Option<&str> {
        self.members.get(&node).map(|m| m.entry.addr.as_str())
    }

    /// `node`'s current replica, if it is a member.
    pub fn replica(&self, node: NodeId) -> Option<ReplicaId> {
        self.members.get(&node).map(|m| m.entry.replica())
    }

    /// The newest stamp kept of `replica`, if it is its node's row's generation: what the
    /// map held of it, also once its watermark went with its last lanes.
    pub fn stamp(&self, replica: ReplicaId) -> Option<Stamp> {
        (self.members.get(&replica.node))
            .filter(|member| member.entry.generation == replica.generation)
            .map(|member| member.stamp)
    }

    /// Whether `replica` is the current generation of a member that is not dead or gone:
    /// its lanes are kept even when they hold nothing.
    pub fn is_live_replica(&self, replica: ReplicaId) -> bool {
        self.members.get(&replica.node).is_some_and(|m| {
            m.entry.generation == replica.generation
                && matches!(m.state, State::Alive | State::Suspect)
        })
    }

    /// How many members are in each state, in state order.
    pub fn counts(&self) -> BTreeMap<State, usize> {
        let mut counts = BTreeMap::new();
        for member in self.members.values() {
            *counts.entry(member.state).or_default() += 1;
        }
        counts
    }

    fn insert(&mut self, entry: MemberEntry, state: State) {
        let member = Member {
            entry,
            state,
            heard_at: None,
            interval: self.expected_interval,
            suspect_since: None,
            stamp: Stamp::default(),
        };
        if member.entry.node != self.me {
            self.pending.push(transition(&member));
        }
        self.members.insert(member.entry.node, member);
    }
}

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a, 64-bit: `hash` carried on over `bytes`.
fn fnv1a(hash: u64, bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0100_0000_01b3;
    (bytes.iter()).fold(hash, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(PRIME)
    })
}

/// phi for an exponential model of arrival gaps: `-log10(P(gap > silence))`.
fn phi(silence: Duration, mean: Duration) -> f64 {
    let mean = mean.as_secs_f64().max(1e-6);
    silence.as_secs_f64() / mean * std::f64::consts::LOG10_E
}

fn transition(member: &Member) -> Transition {
    Transition {
        node: member.entry.node,
        replica: member.entry.replica(),
        addr: member.entry.addr.clone(),
        state: member.state,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_crdt::Generation;

    fn entry(node: u64, generation: u64) -> MemberEntry {
        MemberEntry {
            node: NodeId(node),
            generation: Generation(generation),
            addr: format!("10.0.0.{node}:7000"),
            left: false,
        }
    }

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn an_old_stamp_handed_back_does_not_bring_a_dead_member_back_and_a_new_one_does() {
        let mut members = Members::new(entry(1, 1), SECOND);
        members.merge(&[entry(2, 1)], &[]);
        let two = entry(2, 1).replica();
        for t in 0..5 {
            members.heard_stamped(two, Stamp(1_000 * u64::from(t)), SECOND * t);
        }
        members.check(SECOND * 30, 8.0, SECOND * 10);
        members.check(SECOND * 41, 8.0, SECOND * 10);
        assert_eq!(members.state(NodeId(2)), Some(State::Dead));
        // A peer hands back the stamp this node already had.
        members.heard_stamped(two, Stamp(4_000), SECOND * 50);
        assert_eq!(members.state(NodeId(2)), Some(State::Dead), "no news");
        // News of it: state made after the last this node heard.
        members.heard_stamped(two, Stamp(45_000), SECOND * 60);
        assert_eq!(members.state(NodeId(2)), Some(State::Alive));
        // The silence it came back from is not its interval: silent again, it is suspected
        // after 18.4 expected intervals, as before the silence (taken into the mean, the
        // 56 s would have made that about 145 s).
        members.check(SECOND * 80, 8.0, SECOND * 10);
        assert_eq!(members.state(NodeId(2)), Some(State::Suspect));
    }

    #[test]
    fn only_a_member_held_dead_is_forgotten_and_its_mark_spreads_to_peers_holding_it_alive() {
        let mut one = Members::new(entry(1, 1), SECOND);
        one.merge(&[entry(2, 1), entry(3, 1)], &[]);
        one.take_transitions();
        assert_eq!(one.forget(NodeId(1)), Err(ForgetError::Myself(NodeId(1))));
        assert_eq!(
            one.forget(NodeId(9)),
            Err(ForgetError::NotAMember(NodeId(9)))
        );
        let alive = ForgetError::NotDead {
            node: NodeId(3),
            state: State::Alive,
        };
        assert_eq!(one.forget(NodeId(3)), Err(alive));
        assert_eq!(
            one.state(NodeId(3)),
            Some(State::Alive),
            "refused: unchanged"
        );
        // Node 2 is heard; node 3 falls silent, is suspected, and is then dead.
        for t in 0..5 {
            one.heard(entry(2, 1).replica(), SECOND * t);
            one.heard(entry(3, 1).replica(), SECOND * t);
        }
        one.heard(entry(2, 1).replica(), SECOND * 29);
        one.check(SECOND * 30, 8.0, SECOND * 10);
        let suspect = ForgetError::NotDead {
            node: NodeId(3),
            state: State::Suspect,
        };
        assert_eq!(one.forget(NodeId(3)), Err(suspect));
        one.heard(entry(2, 1).replica(), SECOND * 40);
        one.check(SECOND * 41, 8.0, SECOND * 10);
        assert_eq!(one.state(NodeId(3)), Some(State::Dead));
        one.take_transitions();
        assert_eq!(one.forget(NodeId(3)), Ok(entry(3, 1).replica()));
        assert_eq!(one.state(NodeId(3)), Some(State::Left));
        let states: Vec<State> = one.take_transitions().iter().map(|t| t.state).collect();
        assert_eq!(states, [State::Left]);
        assert_eq!(
            one.forget(NodeId(3)),
            Ok(entry(3, 1).replica()),
            "gone already"
        );
        assert!(one.take_transitions().is_empty());
        assert_eq!(one.others_in(&[State::Dead]), [] as [NodeId; 0]);

        // A peer that holds that life alive takes the mark with the table...
        let mut two = Members::new(entry(2, 1), SECOND);
        two.merge(&[entry(1, 1), entry(3, 1)], &[]);
        let before = two.hash();
        two.merge(&one.entries(), &[]);
        assert_eq!(two.state(NodeId(3)), Some(State::Left));
        assert_ne!(
            two.hash(),
            before,
            "tables that differ by the mark hash apart"
        );
        // ...but a peer holding a later life of it keeps that life.
        let mut four = Members::new(entry(4, 1), SECOND);
        four.merge(&[entry(3, 2)], &[]);
        four.merge(&one.entries(), &[]);
        assert_eq!(four.state(NodeId(3)), Some(State::Alive));
        assert_eq!(four.replica(NodeId(3)), Some(entry(3, 2).replica()));
    }

    #[test]
    fn a_life_learns_once_that_it_was_forgotten_but_not_from_an_earlier_life_or_its_own_leave() {
        let mut one = Members::new(entry(1, 1), SECOND);
        one.merge(&[entry(3, 5)], &[NodeId(3)]);
        one.forget(NodeId(3)).unwrap();
        let mut three = Members::new(entry(3, 5), SECOND);
        three.merge(&one.entries(), &[]);
        assert!(three.take_forgotten());
        assert!(!three.take_forgotten(), "said once");
        assert_eq!(
            three.state(NodeId(3)),
            Some(State::Alive),
            "its own row is its own"
        );
        // A later life of node 3 is not the life forgotten.
        let mut later = Members::new(entry(3, 6), SECOND);
        later.merge(&one.entries(), &[]);
        assert!(!later.take_forgotten());
        // A life that left is gone in its own eyes too.
        let mut leaving = Members::new(entry(3, 5), SECOND);
        leaving.leave();
        leaving.merge(&one.entries(), &[]);
        assert!(!leaving.take_forgotten());
    }

    #[test]
    fn a_silent_member_is_suspected_then_dead_and_alive_again_when_heard() {
        let mut members = Members::new(entry(1, 1), SECOND);
        members.merge(&[entry(2, 1)], &[]);
        members.take_transitions();
        for t in 0..5 {
            members.heard(entry(2, 1).replica(), SECOND * t);
            members.check(SECOND * t, 8.0, SECOND * 10);
        }
        assert_eq!(members.state(NodeId(2)), Some(State::Alive));
        members.check(SECOND * 30, 8.0, SECOND * 10);
        assert_eq!(members.state(NodeId(2)), Some(State::Suspect));
        members.check(SECOND * 41, 8.0, SECOND * 10);
        assert_eq!(members.state(NodeId(2)), Some(State::Dead));
        members.heard(entry(2, 1).replica(), SECOND * 42);
        assert_eq!(members.state(NodeId(2)), Some(State::Alive));
        let states: Vec<State> = members.take_transitions().iter().map(|t| t.state).collect();
        assert_eq!(states, [State::Suspect, State::Dead, State::Alive]);
    }

    #[test]
    fn a_member_back_from_a_pause_it_was_suspected_in_is_suspected_as_soon_once_silent_again() {
        let mut members = Members::new(entry(1, 1), SECOND);
        members.merge(&[entry(2, 1)], &[]);
        let two = entry(2, 1).replica();
        for t in 0..5 {
            members.heard(two, SECOND * t);
        }
        members.check(SECOND * 25, 8.0, SECOND * 10);
        assert_eq!(members.state(NodeId(2)), Some(State::Suspect));
        members.heard(two, SECOND * 29);
        assert_eq!(members.state(NodeId(2)), Some(State::Alive));
        // 18.4 expected intervals, and an eighth more for the pause: 21 s after it was last
        // heard, not the 74 s that the 25 s gap taken whole into the mean would make it.
        members.check(SECOND * 49, 8.0, SECOND * 10);
        assert_eq!(members.state(NodeId(2)), Some(State::Alive));
        members.check(SECOND * 50, 8.0, SECOND * 10);
        assert_eq!(members.state(NodeId(2)), Some(State::Suspect));
    }

    #[test]
    fn a_member_heard_every_3_s_in_frames_that_carry_its_stamp_is_suspected_on_its_own_mean() {
        let mut members = Members::new(entry(1, 1), SECOND);
        members.merge(&[entry(2, 1)], &[]);
        let two = entry(2, 1).replica();
        // Its heartbeats, each heard as a frame from it and then as its stamp inside.
        for beat in 0..60 {
            let now = SECOND * 3 * beat;
            members.heard(two, now);
            members.heard_stamped(two, Stamp(1_000 * now.as_secs()), now);
        }
        let last = SECOND * 3 * 59;
        // phi passes 8 after 18.4 mean gaps: about 55 s at a mean of 3 s, where a mean held
        // at the expected 1 s would suspect it after 18.4 s.
        members.check(last + SECOND * 40, 8.0, SECOND * 10);
        assert_eq!(members.state(NodeId(2)), Some(State::Alive));
        members.check(last + SECOND * 60, 8.0, SECOND * 10);
        assert_eq!(members.state(NodeId(2)), Some(State::Suspect));
    }

    #[test]
    fn the_table_hash_is_fnv_1a_as_specified() {
        // The specification's test vectors (draft-eastlake-fnv).
        assert_eq!(fnv1a(FNV_OFFSET_BASIS, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(FNV_OFFSET_BASIS, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(FNV_OFFSET_BASIS, b"foobar"), 0x8594_4171_f739_67e8);
        let members = Members::new(entry(1, 1), SECOND);
        let mut row = 1u64.to_le_bytes().to_vec();
        row.extend_from_slice(&1u64.to_le_bytes());
        row.extend_from_slice(&(entry(1, 1).addr.len() as u64).to_le_bytes());
        row.extend_from_slice(entry(1, 1).addr.as_bytes());
        row.push(0);
        assert_eq!(members.hash(), fnv1a(FNV_OFFSET_BASIS, &row));
    }

    #[test]
    fn a_newer_generation_replaces_the_old_replica() {
        let mut members = Members::new(entry(1, 1), SECOND);
        members.merge(&[entry(2, 1)], &[]);
        members.merge(&[entry(2, 5)], &[]);
        members.merge(&[entry(2, 3)], &[]);
        assert_eq!(members.replica(NodeId(2)), Some(entry(2, 5).replica()));
        assert!(!members.is_live_replica(entry(2, 1).replica()));
        assert!(members.is_live_replica(entry(2, 5).replica()));
    }

    #[test]
    fn a_generation_heard_before_its_row_takes_the_rows_address_and_the_tables_agree() {
        let mut members = Members::new(entry(1, 1), SECOND);
        members.merge(&[entry(2, 1)], &[]);
        // Node 2 restarts listening elsewhere; its new life is heard before its row comes.
        let moved = MemberEntry {
            addr: "10.9.9.9:7000".into(),
            ..entry(2, 2)
        };
        members.heard(moved.replica(), SECOND);
        assert_eq!(
            members.addr(NodeId(2)),
            Some(""),
            "the old address is not kept"
        );
        members.heard(moved.replica(), SECOND * 2);
        members.merge(std::slice::from_ref(&moved), &[]);
        assert_eq!(members.addr(NodeId(2)), Some("10.9.9.9:7000"));
        assert_eq!(members.state(NodeId(2)), Some(State::Alive));
        let mut told = Members::new(entry(1, 1), SECOND);
        told.merge(&[moved], &[]);
        assert_eq!(
            members.hash(),
            told.hash(),
            "the same table as a node told the row"
        );
    }

    #[test]
    fn a_row_taken_as_new_is_dead_if_its_sender_holds_it_dead_and_a_held_row_keeps_its_state() {
        let mut members = Members::new(entry(1, 1), SECOND);
        members.merge(&[entry(2, 1), entry(3, 1)], &[NodeId(3)]);
        assert_eq!(members.state(NodeId(2)), Some(State::Alive));
        assert_eq!(members.state(NodeId(3)), Some(State::Dead));
        assert!(!members.is_live_replica(entry(3, 1).replica()));
        members.merge(&[entry(2, 1)], &[NodeId(2)]);
        assert_eq!(
            members.state(NodeId(2)),
            Some(State::Alive),
            "a held row keeps this node's view"
        );
        members.merge(&[entry(2, 2)], &[NodeId(2)]);
        assert_eq!(
            members.state(NodeId(2)),
            Some(State::Dead),
            "a new generation is new"
        );
        members.heard(entry(3, 1).replica(), SECOND);
        assert_eq!(members.state(NodeId(3)), Some(State::Alive), "heard again");
        let states: Vec<State> = members.take_transitions().iter().map(|t| t.state).collect();
        let expected = [State::Alive, State::Dead, State::Dead, State::Alive];
        assert_eq!(states, expected);
    }

    #[test]
    fn left_beats_alive_within_a_generation_and_hashes_differ() {
        let mut a = Members::new(entry(1, 1), SECOND);
        a.merge(&[entry(2, 1)], &[]);
        let before = a.hash();
        a.merge(
            &[MemberEntry {
                left: true,
                ..entry(2, 1)
            }],
            &[],
        );
        assert_eq!(a.state(NodeId(2)), Some(State::Left));
        assert_ne!(a.hash(), before);
        a.merge(&[entry(2, 1)], &[]);
        assert_eq!(a.state(NodeId(2)), Some(State::Left));
    }
}
