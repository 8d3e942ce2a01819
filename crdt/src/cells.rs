//! A counter as a map holds it: its lanes packed into 28 bytes each, naming their replica
//! by a small index into the map's table of replicas rather than by its 16-byte id.

use crate::counter::Counter;
use crate::{Lane, ReplicaId, Slot, Version};

/// An origin's place in its map's [`Replicas`] table: fixed while the map holds the
/// origin, reused after.
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
        let at = u32::try_from(self.replicas.len()).expect("a map holds fewer than 2^32 origins");
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

/// A `u64` as two halves, 4-byte aligned, so that a struct of them and `u32`s packs with
/// no padding: a cell is 28 bytes, not 32, and a version-index entry 12, not 16.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Halves([u32; 2]);

impl Halves {
    pub(crate) fn of(value: u64) -> Halves {
        Halves([value as u32, (value >> 32) as u32])
    }

    pub(crate) fn get(self) -> u64 {
        u64::from(self.0[0]) | (u64::from(self.0[1]) << 32)
    }
}

/// One lane: its origin's index, its totals and its version.
#[derive(Debug, Clone, Copy)]
struct Cell {
    origin: OriginIndex,
    incr: Halves,
    decr: Halves,
    version: Halves,
}

const _: () = assert!(std::mem::size_of::<Cell>() == 28, "Cell grew past 28 bytes");

impl Cell {
    fn new(origin: OriginIndex, lane: Lane, version: Version) -> Cell {
        Cell {
            origin,
            incr: Halves::of(lane.incr),
            decr: Halves::of(lane.decr),
            version: Halves::of(version.0),
        }
    }

    fn lane(&self) -> Lane {
        Lane::new(self.incr.get(), self.decr.get())
    }

    fn version(&self) -> Version {
        Version(self.version.get())
    }
}

/// A counter's lanes, one per origin.
///
/// Invariant: sorted by the replica each cell's origin stands for, one cell per origin.
/// A boxed slice: a counter gains a lane at a time, so its room is exactly its lanes.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cells(Box<[Cell]>);

impl Cells {
    /// The lane of the origin at `index`, and its version, if held.
    pub(crate) fn get(&self, index: OriginIndex) -> Option<(Lane, Version)> {
        let cell = self.0.iter().find(|cell| cell.origin == index)?;
        Some((cell.lane(), cell.version()))
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
        if let Some(cell) = self.0.iter_mut().find(|cell| cell.origin == index) {
            let (mut merged, held_version) = (cell.lane(), cell.version());
            merged.merge(lane);
            let version = held_version.max(version);
            let changed = merged != cell.lane() || version != held_version;
            *cell = Cell::new(index, merged, version);
            return changed;
        }
        let replica = replicas.replica(index);
        let at = self
            .0
            .partition_point(|cell| replicas.replica(cell.origin) < replica);
        let mut cells = Vec::with_capacity(self.0.len() + 1);
        cells.extend_from_slice(&self.0[..at]);
        cells.push(Cell::new(index, lane, version));
        cells.extend_from_slice(&self.0[at..]);
        self.0 = cells.into_boxed_slice();
        true
    }

    /// Every lane's origin index and version.
    pub(crate) fn versions(&self) -> impl Iterator<Item = (OriginIndex, Version)> + '_ {
        self.0.iter().map(|cell| (cell.origin, cell.version()))
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
        self.cells.0.iter().map(move |cell| Slot {
            replica: self.replicas.replica(cell.origin),
            lane: cell.lane(),
            version: cell.version(),
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
        self.cells.0.iter().map(|cell| cell.lane().value()).sum()
    }

    fn lanes(&self) -> usize {
        self.cells.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Generation, NodeId};

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
