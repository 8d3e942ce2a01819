//! A counter as a map holds it: each lane in 12 bytes when its decrements are zero and its
//! increments and version fit 32 bits (most lanes of a rate limit), in 16 when its
//! decrements fit 32 bits too, in 24 or 28 otherwise, naming its replica by a small index
//! into the map's table of replicas rather than by its 16-byte id.

use crate::counter::Counter;
use crate::{Lane, ReplicaId, Slot, Version};

/// An origin's place in its map's [`Replicas`] table: fixed while the map holds the
/// origin, reused after. Below 2^30, so that a lane's head word has room for its width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OriginIndex(u32);

impl OriginIndex {
    fn at(self) -> usize {
        self.0 as usize
    }
}

/// The map's table of replicas: the one each [`OriginIndex`] stands for.
#[derive(Debug, Clone, Default)]
pub(crate) struct Replicas {
    // Invariant: `None` exactly at the indexes in `free`.
    replicas: Vec<Option<ReplicaId>>,
    free: Vec<OriginIndex>,
}

impl Replicas {
    /// A new index standing for `replica`.
    pub(crate) fn add(&mut self, replica: ReplicaId) -> OriginIndex {
        if let Some(index) = self.free.pop() {
            self.replicas[index.at()] = Some(replica);
            return index;
        }
        let at = u32::try_from(self.replicas.len())
            .ok()
            .filter(|&at| at <= ORIGIN_MASK)
            .expect("a map holds fewer than 2^30 origins");
        self.replicas.push(Some(replica));
        OriginIndex(at)
    }

    /// Frees `index` for another origin. No cell may name it any more.
    pub(crate) fn remove(&mut self, index: OriginIndex) {
        if self.replicas[index.at()].take().is_some() {
            self.free.push(index);
        }
    }

    /// The replica `index` stands for. Panics if it is free: a cell names an origin the
    /// map no longer holds.
    pub(crate) fn replica(&self, index: OriginIndex) -> ReplicaId {
        self.replicas[index.at()].expect("a cell names an origin its map holds")
    }
}

const WIDTH_SHIFT: u32 = 30;
const ORIGIN_MASK: u32 = (1 << WIDTH_SHIFT) - 1;
/// How many words a lane takes, by the width code in the top two bits of its head.
const WORDS: [usize; 4] = [3, 4, 6, 7];
const WORDS_MAX: usize = 7;

/// One lane read out of its words.
#[derive(Debug, Clone, Copy)]
struct Cell {
    origin: OriginIndex,
    lane: Lane,
    version: Version,
}

impl Cell {
    /// The lane's words, and how many of them it takes. In order: the head (its origin
    /// index, with its width code in the top two bits), the low halves of its increments
    /// and version, the low half of its decrements, the high halves of its increments and
    /// version, and the high half of its decrements. A lane takes the fewest of the four
    /// widths in [`WORDS`] that hold every word that is not zero: 12 bytes for a lane with
    /// no decrements whose increments and version fit 32 bits, 16 with decrements that fit
    /// too, 28 only past 2^32 decrements.
    fn words(&self) -> ([u32; WORDS_MAX], usize) {
        let low = |value: u64| value as u32;
        let high = |value: u64| (value >> 32) as u32;
        let (incr, decr, version) = (self.lane.incr, self.lane.decr, self.version.0);
        let mut words = [
            self.origin.0,
            low(incr),
            low(version),
            low(decr),
            high(incr),
            high(version),
            high(decr),
        ];
        let code = if words[6] != 0 {
            3
        } else if words[4] != 0 || words[5] != 0 {
            2
        } else if words[3] != 0 {
            1
        } else {
            0
        };
        words[0] |= code << WIDTH_SHIFT;
        (words, WORDS[code as usize])
    }

    /// The lane whose head is `words[0]`, and its width in words; `None` if `words` is
    /// empty.
    fn read(words: &[u32]) -> Option<(Cell, usize)> {
        let head = *words.first()?;
        let width = WORDS[(head >> WIDTH_SHIFT) as usize];
        let word = |at: usize| if at < width { words[at] } else { 0 };
        let joined = |low: u32, high: u32| u64::from(low) | (u64::from(high) << 32);
        let cell = Cell {
            origin: OriginIndex(head & ORIGIN_MASK),
            lane: Lane::new(joined(word(1), word(4)), joined(word(3), word(6))),
            version: Version(joined(word(2), word(5))),
        };
        Some((cell, width))
    }
}

/// Every lane laid out in `words`, with the place of its head.
fn lanes_in(words: &[u32]) -> impl Iterator<Item = (usize, Cell)> + Clone + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        let (cell, width) = Cell::read(&words[at..])?;
        let lane = (at, cell);
        at += width;
        Some(lane)
    })
}

/// A counter's lanes, one per origin, each in three to seven 32-bit words.
///
/// Invariant: the lanes follow one another with no gap, each as [`Cell::words`] lays it
/// out, sorted by the replica each lane's origin stands for, one lane per origin. A boxed
/// slice: a counter gains a lane at a time, so its room is exactly its lanes.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cells(Box<[u32]>);

impl Cells {
    /// Every lane, with the place of its head.
    fn cells(&self) -> impl Iterator<Item = (usize, Cell)> + '_ {
        lanes_in(&self.0)
    }

    /// The lane of the origin at `index`, with the place of its head, if held. Reads only
    /// the heads of the lanes before it.
    fn find(&self, index: OriginIndex) -> Option<(usize, Cell)> {
        let mut at = 0;
        while let Some(&head) = self.0.get(at) {
            if head & ORIGIN_MASK == index.0 {
                return Cell::read(&self.0[at..]).map(|(cell, _)| (at, cell));
            }
            at += WORDS[(head >> WIDTH_SHIFT) as usize];
        }
        None
    }

    /// The lane of the origin at `index`, and its version, if held.
    pub(crate) fn get(&self, index: OriginIndex) -> Option<(Lane, Version)> {
        let (_, cell) = self.find(index)?;
        Some((cell.lane, cell.version))
    }

    /// Merges a lane of the origin at `index` (standing for a replica in `replicas`): the
    /// larger of each total and of the version. Returns whether anything changed.
    pub(crate) fn merge(
        &mut self,
        replicas: &Replicas,
        index: OriginIndex,
        lane: Lane,
        version: Version,
    ) -> bool {
        if let Some((at, held)) = self.find(index) {
            let mut merged = held.lane;
            merged.merge(lane);
            let version = held.version.max(version);
            if merged == held.lane && version == held.version {
                return false;
            }
            let (_, width) = held.words();
            self.replace(
                at..at + width,
                Cell {
                    origin: index,
                    lane: merged,
                    version,
                },
            );
            return true;
        }
        let replica = replicas.replica(index);
        let at = (self.cells())
            .find(|(_, cell)| replicas.replica(cell.origin) > replica)
            .map_or(self.0.len(), |(at, _)| at);
        self.replace(
            at..at,
            Cell {
                origin: index,
                lane,
                version,
            },
        );
        true
    }

    /// Puts `cell`'s words where the words in `held` were: in place if it takes as many,
    /// and otherwise in a new slice.
    fn replace(&mut self, held: std::ops::Range<usize>, cell: Cell) {
        let (words, width) = cell.words();
        let words = &words[..width];
        if held.len() == width {
            self.0[held].copy_from_slice(words);
            return;
        }
        self.0 = [&self.0[..held.start], words, &self.0[held.end..]]
            .concat()
            .into_boxed_slice();
    }

    /// Every lane's origin index and version.
    pub(crate) fn versions(&self) -> impl Iterator<Item = (OriginIndex, Version)> + '_ {
        self.cells().map(|(_, cell)| (cell.origin, cell.version))
    }
}

/// A counter held in a [`CounterMap`](crate::CounterMap), read through the map's table of replicas.
#[derive(Clone, Copy)]
pub struct CounterRef<'a> {
    cells: &'a Cells,
    replicas: &'a Replicas,
}

impl<'a> CounterRef<'a> {
    pub(crate) fn new(cells: &'a Cells, replicas: &'a Replicas) -> CounterRef<'a> {
        CounterRef { cells, replicas }
    }

    /// Every lane, in replica order, for as long as the map is borrowed
    /// ([`Counter::slots`] only for as long as this `CounterRef` is).
    pub fn slots(self) -> impl Iterator<Item = Slot> + Clone + 'a {
        let replicas = self.replicas;
        lanes_in(&self.cells.0).map(move |(_, cell)| Slot {
            replica: replicas.replica(cell.origin),
            lane: cell.lane,
            version: cell.version,
        })
    }
}

impl std::fmt::Debug for CounterRef<'_> {
    /// Its slots, not the map's whole table of replicas.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.slots()).finish()
    }
}

impl Counter for CounterRef<'_> {
    fn slots(&self) -> impl Iterator<Item = Slot> + Clone + '_ {
        CounterRef::slots(*self)
    }

    fn value(&self) -> i128 {
        // Without looking up each lane's replica.
        self.cells.cells().map(|(_, cell)| cell.lane.value()).sum()
    }

    fn lanes(&self) -> usize {
        self.cells.cells().count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Generation, NodeId};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// A total or a version of any width: zero, 32 bits, or past them.
    fn word() -> impl Strategy<Value = u64> {
        prop_oneof![Just(0), 1..=u64::from(u32::MAX), any::<u64>()]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1_000))]

        #[test]
        fn cells_of_every_width_read_back_as_the_larger_of_each_total_and_version(
            merges in prop::collection::vec((0..6u64, word(), word(), word()), 0..40),
        ) {
            let life = |node| ReplicaId::new(NodeId(5 - node), Generation(1));
            let mut replicas = Replicas::default();
            let indexes: Vec<OriginIndex> = (0..6).map(|node| replicas.add(life(node))).collect();
            let mut cells = Cells::default();
            let mut model: BTreeMap<ReplicaId, (Lane, Version)> = BTreeMap::new();
            for (node, incr, decr, version) in merges {
                let (lane, version) = (Lane::new(incr, decr), Version(version));
                let before = model.get(&life(node)).copied();
                let held = model.entry(life(node)).or_insert((lane, version));
                held.0.merge(lane);
                held.1 = held.1.max(version);
                let changed = before != Some(*held);
                prop_assert_eq!(cells.merge(&replicas, indexes[node as usize], lane, version), changed);
                let counter = CounterRef::new(&cells, &replicas);
                let slots: Vec<(ReplicaId, Lane, Version)> =
                    counter.slots().map(|slot| (slot.replica, slot.lane, slot.version)).collect();
                let expected: Vec<(ReplicaId, Lane, Version)> =
                    model.iter().map(|(&replica, &(lane, version))| (replica, lane, version)).collect();
                prop_assert_eq!(slots, expected);
                prop_assert_eq!(counter.lanes(), model.len());
                let width = |&(lane, version): &(Lane, Version)| {
                    Cell { origin: OriginIndex(0), lane, version }.words().1
                };
                prop_assert_eq!(cells.0.len(), model.values().map(width).sum::<usize>());
                for (node, index) in indexes.iter().enumerate() {
                    prop_assert_eq!(cells.get(*index), model.get(&life(node as u64)).copied());
                }
            }
        }
    }

    #[test]
    fn a_lane_takes_three_words_until_it_has_decrements_or_passes_32_bits() {
        let width = |incr, decr, version| {
            let lane = Lane::new(incr, decr);
            (Cell {
                origin: OriginIndex(ORIGIN_MASK),
                lane,
                version: Version(version),
            })
            .words()
            .1
        };
        assert_eq!(width(u64::from(u32::MAX), 0, u64::from(u32::MAX)), 3);
        assert_eq!(width(1, 1, 1), 4, "decrements");
        assert_eq!(width(1, u64::from(u32::MAX), u64::from(u32::MAX)), 4);
        assert_eq!(width(1 << 32, 0, 1), 6, "increments past 32 bits");
        assert_eq!(width(1, 0, 1 << 32), 6, "a version past 32 bits");
        assert_eq!(width(1, 1, 1 << 50), 6, "a republished lane's version");
        assert_eq!(width(1, 1 << 32, 1), 7, "decrements past 32 bits");
        assert_eq!(width(u64::MAX, u64::MAX, u64::MAX), 7);
    }

    #[test]
    fn cells_keep_replica_order_whatever_order_origins_were_added_in() {
        let life = |node, generation| ReplicaId::new(NodeId(node), Generation(generation));
        let mut replicas = Replicas::default();
        let (late, early, middle) = (
            replicas.add(life(9, 1)),
            replicas.add(life(1, 1)),
            replicas.add(life(1, 2)),
        );
        let mut cells = Cells::default();
        assert!(cells.merge(&replicas, late, Lane::new(u64::MAX, 1), Version(1 << 40)));
        assert!(cells.merge(&replicas, early, Lane::new(2, 0), Version(3)));
        assert!(cells.merge(&replicas, middle, Lane::new(5, 0), Version(4)));
        assert!(
            !cells.merge(&replicas, early, Lane::new(1, 0), Version(2)),
            "nothing new"
        );
        assert!(
            cells.merge(&replicas, early, Lane::new(1, 7), Version(2)),
            "a larger decr"
        );

        let counter = CounterRef::new(&cells, &replicas);
        let slots: Vec<Slot> = counter.slots().collect();
        let replicas: Vec<ReplicaId> = slots.iter().map(|slot| slot.replica).collect();
        assert_eq!(replicas, [life(1, 1), life(1, 2), life(9, 1)]);
        assert_eq!(slots[0].lane, Lane::new(2, 7));
        assert_eq!(slots[0].version, Version(3), "the larger version stays");
        assert_eq!(
            slots[2].lane,
            Lane::new(u64::MAX, 1),
            "both halves read back"
        );
        assert_eq!(slots[2].version, Version(1 << 40));
        assert_eq!(counter.value(), i128::from(u64::MAX) - 1 + 2 - 7 + 5);
        assert_eq!(counter.below_zero_of_nodes_but(NodeId(9)), 0);
        assert_eq!(cells.get(middle), Some((Lane::new(5, 0), Version(4))));
    }

    #[test]
    fn a_freed_origin_index_is_given_to_the_next_origin() {
        let replica = |node| ReplicaId::new(NodeId(node), Generation(1));
        let mut replicas = Replicas::default();
        let first = replicas.add(replica(1));
        replicas.add(replica(2));
        replicas.remove(first);
        replicas.remove(first);
        assert_eq!(replicas.add(replica(3)), first);
        assert_eq!(replicas.replica(first), replica(3));
        assert_eq!(
            replicas.add(replica(4)),
            OriginIndex(2),
            "freed once, reused once"
        );
    }
}
