//! The PN-counter: one lane per replica, merged lane by lane.

use crate::{Lane, NodeId, Overflow, ReplicaId, Version};
use serde::{Deserialize, Serialize};

/// A lane as held in a counter: whose it is, its totals, and the version its writer
/// stamped on its latest write (zero when the counter is used without delta sync).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slot {
    /// The replica that writes this lane.
    pub replica: ReplicaId,
    /// Its totals.
    pub lane: Lane,
    /// The writer's version of these totals.
    pub version: Version,
}

/// A PN-counter: a grow-only lane per replica. Its value is the sum over lanes of
/// `incr - decr`, computed in `i128` so that no sum of `u64` lanes can overflow it.
///
/// Invariant: `slots` is sorted by replica and holds at most one slot per replica.
///
/// A boxed slice, not a `Vec`: most counters hold one or a few lanes and gain one at a
/// time, so the room is always exactly the lanes held, and the counter is 16 bytes, not 24.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ReadSlots")]
pub struct PnCounter {
    slots: Box<[Slot]>,
}

/// A counter's lanes as read from outside: in any order, a replica's maybe more than once.
#[derive(Deserialize)]
struct ReadSlots {
    slots: Vec<Slot>,
}

impl From<ReadSlots> for PnCounter {
    /// Sorted by replica, and a replica's lanes merged into one, so that the counter read
    /// keeps the invariant every merge and read relies on.
    fn from(read: ReadSlots) -> PnCounter {
        let mut slots = read.slots;
        slots.sort_unstable_by_key(|slot| slot.replica);
        slots.dedup_by(|later, kept| {
            let same = later.replica == kept.replica;
            if same {
                kept.lane.merge(later.lane);
                kept.version = kept.version.max(later.version);
            }
            same
        });
        PnCounter {
            slots: slots.into_boxed_slice(),
        }
    }
}

/// Reading a PN-counter's lanes: its value, and the parts of it that a decision takes.
/// Implemented by [`PnCounter`] and by a counter held in a map ([`CounterRef`]).
///
/// [`CounterRef`]: crate::CounterRef
pub trait Counter {
    /// Every lane, in replica order.
    fn slots(&self) -> impl Iterator<Item = Slot> + Clone + '_;

    /// The counter's value: the sum of every lane's `incr - decr`.
    fn value(&self) -> i128 {
        self.slots().map(|slot| slot.lane.value()).sum()
    }

    /// The value of every lane except `replica`'s.
    fn value_without(&self, replica: ReplicaId) -> i128 {
        (self.slots())
            .filter(|slot| slot.replica != replica)
            .map(|slot| slot.lane.value())
            .sum()
    }

    /// The value of the lanes of `replica`'s node under other generations than
    /// `replica`'s: that node's other lives, such as the ones before its last restart.
    fn value_of_other_lives(&self, replica: ReplicaId) -> i128 {
        (self.slots())
            .filter(|slot| slot.replica.node == replica.node && slot.replica != replica)
            .map(|slot| slot.lane.value())
            .sum()
    }

    /// How far below zero the nodes other than `node` are, summed over those whose lanes
    /// (of every life) net below zero: what counting each such node at no less than zero
    /// adds to the value of their lanes. 0 when none is below zero.
    fn below_zero_of_nodes_but(&self, node: NodeId) -> i128 {
        by_node(self.slots())
            .filter(|&(of, _)| of != node)
            .map(|(_, value)| -value)
            .filter(|&below| below > 0)
            .sum()
    }

    /// The value of the nodes `outside` picks, each over all its lives and counted at no
    /// less than zero. 0 when it picks none.
    fn above_zero_of_nodes(&self, outside: impl Fn(NodeId) -> bool) -> i128 {
        by_node(self.slots())
            .filter(|&(node, _)| outside(node))
            .map(|(_, value)| value.max(0))
            .sum()
    }

    /// `replica`'s slot, if it has one.
    fn slot(&self, replica: ReplicaId) -> Option<Slot> {
        self.slots().find(|slot| slot.replica == replica)
    }

    /// `replica`'s lane, or an empty lane if it has none.
    fn lane(&self, replica: ReplicaId) -> Lane {
        self.slot(replica).map(|slot| slot.lane).unwrap_or_default()
    }

    /// How many lanes the counter holds.
    fn lanes(&self) -> usize {
        self.slots().count()
    }
}

/// Each node's value over all its lives, from slots in replica order (each node's lives
/// next to each other).
fn by_node(slots: impl Iterator<Item = Slot>) -> impl Iterator<Item = (NodeId, i128)> {
    let mut slots = slots.peekable();
    std::iter::from_fn(move || {
        let first = slots.next()?;
        let node = first.replica.node;
        let mut value = first.lane.value();
        while let Some(life) = slots.next_if(|slot| slot.replica.node == node) {
            value += life.lane.value();
        }
        Some((node, value))
    })
}

impl Counter for PnCounter {
    fn slots(&self) -> impl Iterator<Item = Slot> + Clone + '_ {
        self.slots.iter().copied()
    }

    fn slot(&self, replica: ReplicaId) -> Option<Slot> {
        let at = self.find(replica).ok()?;
        Some(self.slots[at])
    }

    fn lanes(&self) -> usize {
        self.slots.len()
    }
}

impl PnCounter {
    /// An empty counter: value zero, no lanes.
    pub fn new() -> PnCounter {
        PnCounter::default()
    }

    /// A copy of `counter`'s lanes, as a counter of its own.
    pub fn copy_of(counter: &impl Counter) -> PnCounter {
        PnCounter {
            slots: counter.slots().collect(),
        }
    }

    /// Adds `amount` to `replica`'s increments. On overflow nothing changes.
    pub fn incr(&mut self, replica: ReplicaId, amount: u64) -> Result<(), Overflow> {
        let mut lane = self.lane(replica);
        lane.incr(amount)?;
        self.merge_slot(Slot {
            replica,
            lane,
            version: Version::ZERO,
        });
        Ok(())
    }

    /// Adds `amount` to `replica`'s decrements. On overflow nothing changes.
    pub fn decr(&mut self, replica: ReplicaId, amount: u64) -> Result<(), Overflow> {
        let mut lane = self.lane(replica);
        lane.decr(amount)?;
        self.merge_slot(Slot {
            replica,
            lane,
            version: Version::ZERO,
        });
        Ok(())
    }

    /// Merges every lane of `other` into `self`. Total: never fails.
    ///
    /// One pass over both sorted lane lists. Lanes `self` lacks are collected on the way
    /// and sorted in once at the end, so a merge between counters with the same replicas
    /// (the usual case once gossip has spread every writer) neither searches nor allocates.
    pub fn merge(&mut self, other: &PnCounter) {
        let mut missing = Vec::new();
        let mut mine = self.slots.iter_mut().peekable();
        for theirs in &other.slots {
            while mine.next_if(|slot| slot.replica < theirs.replica).is_some() {}
            match mine.peek_mut() {
                Some(slot) if slot.replica == theirs.replica => {
                    slot.lane.merge(theirs.lane);
                    slot.version = slot.version.max(theirs.version);
                }
                _ => missing.push(*theirs),
            }
        }
        if !missing.is_empty() {
            let mut slots = Vec::with_capacity(self.slots.len() + missing.len());
            slots.extend_from_slice(&self.slots);
            slots.extend(missing);
            slots.sort_unstable_by_key(|slot| slot.replica);
            self.slots = slots.into_boxed_slice();
        }
    }

    /// Merges one lane, taking the larger of each total and of the version. Returns
    /// whether anything changed.
    pub fn merge_slot(&mut self, incoming: Slot) -> bool {
        match self.find(incoming.replica) {
            Ok(at) => {
                let slot = &mut self.slots[at];
                let before = *slot;
                slot.lane.merge(incoming.lane);
                slot.version = slot.version.max(incoming.version);
                *slot != before
            }
            Err(at) => {
                let mut slots = Vec::with_capacity(self.slots.len() + 1);
                slots.extend_from_slice(&self.slots[..at]);
                slots.push(incoming);
                slots.extend_from_slice(&self.slots[at..]);
                self.slots = slots.into_boxed_slice();
                true
            }
        }
    }

    fn find(&self, replica: ReplicaId) -> Result<usize, usize> {
        self.slots
            .binary_search_by_key(&replica, |slot| slot.replica)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Generation;

    fn replica(node: u64) -> ReplicaId {
        ReplicaId::new(NodeId(node), Generation(1))
    }

    #[test]
    fn value_sums_lanes_in_i128_without_wrapping() {
        let mut counter = PnCounter::new();
        counter.incr(replica(1), u64::MAX).unwrap();
        counter.incr(replica(2), u64::MAX).unwrap();
        counter.decr(replica(3), 5).unwrap();
        assert_eq!(counter.value(), 2 * i128::from(u64::MAX) - 5);
        assert_eq!(counter.value_without(replica(1)), i128::from(u64::MAX) - 5);
    }

    #[test]
    fn below_zero_counts_each_other_node_over_all_its_lives_and_only_those_below_zero() {
        let life = |node, generation| ReplicaId::new(NodeId(node), Generation(generation));
        let mut counter = PnCounter::new();
        // Node 1 is below zero, but it is the one asking.
        counter.decr(life(1, 1), 7).unwrap();
        // Node 2: -10 in one life, +4 in the next: -6 in all.
        counter.decr(life(2, 1), 10).unwrap();
        counter.incr(life(2, 2), 4).unwrap();
        // Node 3: -3 in one life, +5 in the next: above zero in all.
        counter.decr(life(3, 1), 3).unwrap();
        counter.incr(life(3, 2), 5).unwrap();
        // Node 4: -1.
        counter.incr(life(4, 1), 2).unwrap();
        counter.decr(life(4, 1), 3).unwrap();
        assert_eq!(counter.below_zero_of_nodes_but(NodeId(1)), 6 + 1);
        assert_eq!(counter.below_zero_of_nodes_but(NodeId(2)), 7 + 1);
        assert_eq!(PnCounter::new().below_zero_of_nodes_but(NodeId(1)), 0);
    }

    #[test]
    fn a_nodes_other_lives_are_its_other_generations_lanes() {
        let life = |node, generation| ReplicaId::new(NodeId(node), Generation(generation));
        let mut counter = PnCounter::new();
        counter.incr(life(1, 1), 5).unwrap();
        counter.decr(life(1, 1), 1).unwrap();
        counter.incr(life(1, 2), 3).unwrap();
        counter.incr(life(1, 3), 100).unwrap();
        counter.incr(life(2, 1), 1_000).unwrap();
        assert_eq!(counter.value_of_other_lives(life(1, 3)), 4 + 3);
        assert_eq!(counter.value_of_other_lives(life(2, 1)), 0);
        assert_eq!(
            counter.value_of_other_lives(life(3, 1)),
            0,
            "no lane of node 3"
        );
    }

    #[test]
    fn overflowing_increment_is_refused_whole() {
        let mut counter = PnCounter::new();
        counter.incr(replica(1), u64::MAX).unwrap();
        let before = counter.clone();
        assert!(counter.incr(replica(1), 1).is_err());
        assert_eq!(counter, before);
    }

    #[test]
    fn merge_takes_the_larger_total_per_lane() {
        let mut a = PnCounter::new();
        let mut b = PnCounter::new();
        a.incr(replica(1), 5).unwrap();
        b.incr(replica(1), 3).unwrap();
        b.decr(replica(1), 2).unwrap();
        b.incr(replica(2), 1).unwrap();
        a.merge(&b);
        assert_eq!(a.lane(replica(1)), Lane::new(5, 2));
        assert_eq!(a.value(), 5 - 2 + 1);
    }

    /// A counter read from outside keeps the invariant whatever order its lanes came in and
    /// however often a replica's: merging it stays commutative and its value counts each
    /// replica once (found in review: the derived form took the lanes as they came).
    #[test]
    fn a_counter_read_with_lanes_out_of_order_or_repeated_holds_each_replica_once_in_order() {
        let mut written = PnCounter::new();
        written.incr(replica(1), 5).unwrap();
        written.decr(replica(2), 3).unwrap();
        let mut slots: Vec<Slot> = written.slots().collect();
        slots.reverse();
        let earlier = Slot {
            lane: Lane::new(2, 0),
            ..slots[1]
        };
        slots.push(earlier);
        let read: PnCounter =
            serde_json::from_value(serde_json::json!({ "slots": slots })).unwrap();
        assert_eq!(read, written);
        assert_eq!(read.value(), 5 - 3);
        let mut other = PnCounter::new();
        other.incr(replica(3), 1).unwrap();
        let (mut left, mut right) = (read.clone(), other.clone());
        left.merge(&other);
        right.merge(&read);
        assert_eq!(left, right);
    }
}
