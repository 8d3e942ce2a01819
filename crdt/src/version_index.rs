//! One origin's lanes in version order: what a delta for a peer is cut from.

use crate::key_table::KeyId;
use crate::Version;

/// Each lane of one origin held in a map, by its version, naming its key's id.
///
/// A vector sorted by version, 12 bytes an entry, rather than a `BTreeMap` (whose leaves
/// ascending inserts leave half full: about 26 bytes a lane). Versions mostly arrive in
/// ascending order (an origin's writes, its pushes, and deltas cut in version order), so an
/// insert is almost always a push at the end; one below the top moves only the entries
/// above it. A lane rewritten under a newer version leaves its old entry as a hole, and
/// the holes are swept out once they are a fifth of the entries, so a lane costs at most
/// 15 bytes here while holes wait, plus the vector's unused room.
#[derive(Debug, Clone, Default)]
pub(crate) struct VersionIndex {
    // Invariant: versions ascend strictly; the last entry, if any, is held (not a hole);
    // `holes` counts the entries whose id is `HOLE`.
    entries: Vec<Entry>,
    holes: usize,
}

/// A version and a key id, 4-byte aligned so that an entry is 12 bytes, not 16.
#[derive(Debug, Clone, Copy)]
struct Entry {
    version: [u32; 2],
    id: Option<KeyId>,
}

const _: () = assert!(
    std::mem::size_of::<Entry>() == 12,
    "Entry grew past 12 bytes"
);

impl Entry {
    fn new(version: Version, id: KeyId) -> Entry {
        let bytes = version.0.to_le_bytes();
        let half = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        Entry {
            version: [half(0), half(4)],
            id: Some(id),
        }
    }

    fn version(&self) -> Version {
        Version(u64::from(self.version[0]) | u64::from(self.version[1]) << 32)
    }
}

impl VersionIndex {
    /// How many lanes are indexed.
    pub(crate) fn len(&self) -> usize {
        self.entries.len() - self.holes
    }

    /// Whether no lane is indexed.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The highest version indexed.
    pub(crate) fn last(&self) -> Option<Version> {
        self.entries.last().map(Entry::version)
    }

    /// The key id at `version`, if a lane is indexed at it.
    pub(crate) fn get(&self, version: Version) -> Option<KeyId> {
        let at = self.find(version).ok()?;
        self.entries[at].id
    }

    /// Indexes `id`'s lane at `version`, replacing whatever was indexed at it.
    pub(crate) fn insert(&mut self, version: Version, id: KeyId) {
        let entry = Entry::new(version, id);
        if self.last().is_none_or(|last| last < version) {
            if self.entries.len() == self.entries.capacity() {
                // By a quarter, not doubling, as the key table grows.
                self.entries.reserve_exact(self.entries.len() / 4 + 16);
            }
            self.entries.push(entry);
            return;
        }
        match self.find(version) {
            Ok(at) => {
                if self.entries[at].id.is_none() {
                    self.holes -= 1;
                }
                self.entries[at] = entry;
            }
            Err(at) => self.entries.insert(at, entry),
        }
    }

    /// Stops indexing the lane at `version`, if any.
    pub(crate) fn remove(&mut self, version: Version) {
        let Ok(at) = self.find(version) else {
            return;
        };
        if self.entries[at].id.take().is_none() {
            return;
        }
        self.holes += 1;
        while self.entries.last().is_some_and(|entry| entry.id.is_none()) {
            self.entries.pop();
            self.holes -= 1;
        }
        if self.holes > self.entries.len() / 5 {
            self.sweep();
        }
    }

    /// Renames the lane at `version` from key id `from` to `to`, as the key table's
    /// compaction moves a key. Panics if `version` names another key: the index and the
    /// table disagree.
    pub(crate) fn rename(&mut self, version: Version, from: KeyId, to: KeyId) {
        let Ok(at) = self.find(version) else {
            return;
        };
        let entry = &mut self.entries[at];
        assert_eq!(
            entry.id,
            Some(from),
            "version {version:?} names another key"
        );
        entry.id = Some(to);
    }

    /// Every indexed lane with a version of at least `from`, in version order.
    pub(crate) fn range_from(&self, from: Version) -> impl Iterator<Item = (Version, KeyId)> + '_ {
        let start = self.entries.partition_point(|entry| entry.version() < from);
        self.entries[start..]
            .iter()
            .filter_map(|entry| Some((entry.version(), entry.id?)))
    }

    /// Every indexed lane's key id, in version order.
    pub(crate) fn ids(&self) -> impl Iterator<Item = KeyId> + '_ {
        self.entries.iter().filter_map(|entry| entry.id)
    }

    fn find(&self, version: Version) -> Result<usize, usize> {
        self.entries.binary_search_by_key(&version, Entry::version)
    }

    /// Drops the holes, and the vector's room beyond a quarter more than it holds.
    fn sweep(&mut self) {
        self.entries.retain(|entry| entry.id.is_some());
        self.holes = 0;
        let room = self.entries.len() + self.entries.len() / 4 + 16;
        if self.entries.capacity() > room {
            self.entries.shrink_to(room);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few versions, so inserts often land below the top and on holes.
        prop_oneof![
            (0..64u64, 0..1_000u32).prop_map(|(v, id)| Op::Insert(v, id)),
            (0..64u64).prop_map(Op::Remove),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1_000))]

        #[test]
        fn the_index_answers_as_a_btree_map_of_versions_would(ops in prop::collection::vec(op(), 0..300)) {
            let mut index = VersionIndex::default();
            let mut model = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(v, id) => {
                        // Versions past 2^32 too, so both halves are read back.
                        let version = Version(v << 26);
                        index.insert(version, KeyId::of(id as usize));
                        model.insert(version, KeyId::of(id as usize));
                    }
                    Op::Remove(v) => {
                        index.remove(Version(v << 26));
                        model.remove(&Version(v << 26));
                    }
                }
                prop_assert_eq!(index.len(), model.len());
                prop_assert_eq!(index.last(), model.keys().next_back().copied());
                prop_assert!(index.holes * 5 <= index.entries.len());
            }
            let all: Vec<_> = index.range_from(Version::ZERO).collect();
            let expected: Vec<_> = model.iter().map(|(v, id)| (*v, *id)).collect();
            prop_assert_eq!(all, expected);
            for v in 0..64u64 {
                let version = Version(v << 26);
                prop_assert_eq!(index.get(version), model.get(&version).copied());
                let above: Vec<_> = index.range_from(version).collect();
                let expected: Vec<_> = model.range(version..).map(|(v, id)| (*v, *id)).collect();
                prop_assert_eq!(above, expected);
            }
        }
    }

    #[test]
    fn a_rewritten_lane_leaves_a_hole_until_the_holes_are_a_fifth() {
        let mut index = VersionIndex::default();
        for v in 1..=100 {
            index.insert(Version(v), KeyId::of(v as usize));
        }
        // Each key rewritten once under a newer version: its old entry is a hole.
        for v in 1..=24 {
            index.remove(Version(v));
            index.insert(Version(100 + v), KeyId::of(v as usize));
        }
        assert_eq!(
            index.holes, 24,
            "24 of 123 entries, not past a fifth: not swept yet"
        );
        assert_eq!(index.len(), 100);
        index.remove(Version(25));
        assert_eq!(index.holes, 0, "25 of 124 is past a fifth: swept");
        index.insert(Version(125), KeyId::of(25));
        assert_eq!(index.entries.len(), 100);
        assert_eq!(index.len(), 100);
        let first = index.range_from(Version::ZERO).next();
        assert_eq!(first, Some((Version(26), KeyId::of(26))));
    }
}
