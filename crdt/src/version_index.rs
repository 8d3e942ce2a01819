//! One origin's lanes in version order: what a delta for a peer is cut from.

use crate::key_table::KeyId;
use crate::Version;
use std::collections::BTreeMap;

/// Each lane of one origin held in a map, by its version, naming its key's id.
///
/// A vector sorted by version, 6 bytes an entry, rather than a `BTreeMap` (whose leaves
/// ascending inserts leave half full: about 26 bytes a lane). An entry holds the low 16
/// bits of its version; the high 48 are held once for each run of entries that share them
/// (`highs`: an origin's versions count up one by one, so a run holds every lane it wrote
/// in 65,536 versions, and the runs cost at most 12 bytes for each 65,536 versions it gave
/// out, whatever lanes are left). Versions mostly arrive in ascending order (an origin's
/// writes, its pushes, and deltas cut in version order), so an insert is almost always a
/// push at the end. One below the vector's top (a gap being filled under pushes merged
/// past it, or a sender's lanes out of order) goes into a small `BTreeMap` beside it
/// instead, which is merged into the vector once it holds an eighth as many (so each such
/// insert costs a few entry moves, not all those above it). A lane rewritten under a newer
/// version leaves its old entry as a hole, and the holes are swept out once they are a
/// fifth of the entries: a lane costs at most 7.5 bytes here while holes wait, plus the
/// vector's unused room (and up to 12 more if a sender gives each lane a run of its own:
/// see [`High`]); a lane waiting in `below` costs a `BTreeMap` entry instead, about 26
/// bytes, for at most 64 lanes or an eighth as many as the vector holds.
#[derive(Debug, Clone, Default)]
pub(crate) struct VersionIndex {
    // Invariant: versions ascend strictly; the last entry, if any, is held (not a hole);
    // `holes` counts the entries whose id is `None`; no version is both here and in
    // `below`.
    entries: Vec<Entry>,
    // Invariant: one run for each high part that the entries' versions have, in order, each
    // starting where the first entry with that high part is (so the first at 0).
    highs: Vec<High>,
    holes: usize,
    // Invariant: at most `below_max()` entries.
    below: BTreeMap<Version, KeyId>,
    // Invariant: the xor of `mixed(version)` over every version indexed.
    versions_hash: u64,
}

/// `below` is merged into the vector once it holds more than this, or more than an eighth
/// of the vector's entries.
const BELOW_MIN: usize = 64;

/// The low bits of a version and a key id. Packed: its fields are read and written by
/// value, never borrowed.
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(2))]
struct Entry {
    low: u16,
    id: Option<KeyId>,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 6, "Entry grew past 6 bytes");

/// How many of a version's bits an entry holds; its run holds the rest.
const LOW_BITS: u32 = 16;

/// The high part of the versions of the entries from `from` up to the next run's start.
/// 12 bytes (packed, as [`Entry`]): an origin's versions count up one by one, so a run
/// holds its lanes of 65,536 versions, but a sender may send any versions, and one that
/// gives each lane a high part of its own costs a run a lane.
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct High {
    from: u32,
    high: u64,
}

const _: () = assert!(std::mem::size_of::<High>() == 12, "High grew past 12 bytes");

/// `version`'s high part (a run's) and its low bits (an entry's).
fn split(version: Version) -> (u64, u16) {
    (version.0 >> LOW_BITS, version.0 as u16)
}

/// The version whose high part is `high` and low bits `low`.
fn joined(high: u64, low: u16) -> Version {
    Version((high << LOW_BITS) | u64::from(low))
}

impl High {
    fn start(self) -> usize {
        self.from as usize
    }
}

impl VersionIndex {
    /// How many lanes are indexed.
    pub(crate) fn len(&self) -> usize {
        self.entries.len() - self.holes + self.below.len()
    }

    /// Whether no lane is indexed.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A hash of the set of versions indexed: equal for equal sets, whatever the order
    /// they came in, and unequal for unequal sets but by a 64-bit collision. Two holders of
    /// an origin with equal watermarks whose hashes differ hold different lanes of it.
    pub(crate) fn versions_hash(&self) -> u64 {
        self.versions_hash
    }

    /// The highest version indexed.
    pub(crate) fn last(&self) -> Option<Version> {
        let below = self.below.keys().next_back().copied();
        self.top().max(below)
    }

    /// The key id at `version`, if a lane is indexed at it.
    pub(crate) fn get(&self, version: Version) -> Option<KeyId> {
        match self.find(version) {
            Ok(at) => self.entries[at].id,
            Err(_) => self.below.get(&version).copied(),
        }
    }

    /// Indexes `id`'s lane at `version`, replacing whatever was indexed at it.
    pub(crate) fn insert(&mut self, version: Version, id: KeyId) {
        if self.top().is_none_or(|top| top < version) && !self.below.contains_key(&version) {
            self.push(version, id);
            self.versions_hash ^= mixed(version);
            return;
        }
        match self.find(version) {
            Ok(at) => {
                if { self.entries[at].id }.is_none() {
                    self.holes -= 1;
                    self.versions_hash ^= mixed(version);
                }
                self.entries[at].id = Some(id);
            }
            Err(_) => {
                if self.below.insert(version, id).is_none() {
                    self.versions_hash ^= mixed(version);
                }
                if self.below.len() > self.below_max() {
                    self.sweep();
                }
            }
        }
    }

    /// The most entries `below` holds before it is merged into the vector.
    fn below_max(&self) -> usize {
        BELOW_MIN.max(self.entries.len() / 8)
    }

    /// Stops indexing the lane at `version`, if any.
    pub(crate) fn remove(&mut self, version: Version) {
        let Ok(at) = self.find(version) else {
            if self.below.remove(&version).is_some() {
                self.versions_hash ^= mixed(version);
            }
            return;
        };
        if { self.entries[at].id }.is_none() {
            return;
        }
        self.entries[at].id = None;
        self.versions_hash ^= mixed(version);
        self.holes += 1;
        while self
            .entries
            .last()
            .is_some_and(|entry| { entry.id }.is_none())
        {
            self.entries.pop();
            self.holes -= 1;
            if self
                .highs
                .last()
                .is_some_and(|run| run.start() == self.entries.len())
            {
                self.highs.pop();
            }
        }
        // Popping the top may leave `below` past an eighth of the vector too.
        if self.holes > self.entries.len() / 5 || self.below.len() > self.below_max() {
            self.sweep();
        }
    }

    /// Renames the lane at `version` from key id `from` to `to`, as the key table's
    /// compaction moves a key. Panics if `version` names another key: the index and the
    /// table disagree.
    pub(crate) fn rename(&mut self, version: Version, from: KeyId, to: KeyId) {
        let found = self.find(version);
        let held = match found {
            Ok(at) => self.entries[at].id,
            Err(_) => self.below.get(&version).copied(),
        };
        let Some(id) = held else {
            return;
        };
        assert_eq!(id, from, "version {version:?} names another key");
        match found {
            Ok(at) => self.entries[at].id = Some(to),
            Err(_) => {
                self.below.insert(version, to);
            }
        }
    }

    /// Every indexed lane with a version of at least `from`, in version order.
    pub(crate) fn range_from(&self, from: Version) -> impl Iterator<Item = (Version, KeyId)> + '_ {
        let start = self.find(from).unwrap_or_else(|at| at);
        // Each run's entries from `start` on, with the run's high part.
        let ends = (self.highs.iter().skip(1).map(|next| next.start())).chain([self.entries.len()]);
        let mut entries = (self.highs.iter().zip(ends))
            .flat_map(move |(&run, end)| {
                (self.entries[run.start().max(start)..end.max(start)].iter())
                    .filter_map(move |&entry| Some((joined(run.high, entry.low), entry.id?)))
            })
            .peekable();
        let mut below = (self.below.range(from..))
            .map(|(&version, &id)| (version, id))
            .peekable();
        // The two merged: no version is in both.
        std::iter::from_fn(move || match (entries.peek(), below.peek()) {
            (Some(vector), Some(side)) if side.0 < vector.0 => below.next(),
            (Some(_), _) => entries.next(),
            (None, _) => below.next(),
        })
    }

    /// Every indexed lane's key id, in no particular order.
    pub(crate) fn ids(&self) -> impl Iterator<Item = KeyId> + '_ {
        (self.entries.iter().filter_map(|entry| entry.id)).chain(self.below.values().copied())
    }

    /// Where `version` is in the vector, or where it would go.
    fn find(&self, version: Version) -> Result<usize, usize> {
        let (high, low) = split(version);
        let run = self.highs.partition_point(|run| { run.high } < high);
        let start = self
            .highs
            .get(run)
            .map_or(self.entries.len(), |run| run.start());
        if self.highs.get(run).is_none_or(|run| { run.high } != high) {
            return Err(start);
        }
        let end = self
            .highs
            .get(run + 1)
            .map_or(self.entries.len(), |next| next.start());
        (self.entries[start..end].binary_search_by_key(&low, |entry| entry.low))
            .map(|at| start + at)
            .map_err(|at| start + at)
    }

    /// The highest version in the vector (`below` aside).
    fn top(&self) -> Option<Version> {
        let last = self.entries.len().checked_sub(1)?;
        Some(self.version_at(last))
    }

    /// The version of the entry at `at`.
    fn version_at(&self, at: usize) -> Version {
        let run = self.highs.partition_point(|run| run.start() <= at) - 1;
        joined(self.highs[run].high, self.entries[at].low)
    }

    /// Puts `id`'s lane at `version`, above every version in the vector, at its end.
    fn push(&mut self, version: Version, id: KeyId) {
        let (high, low) = split(version);
        if self.highs.last().is_none_or(|run| { run.high } != high) {
            self.highs.push(High {
                from: u32::try_from(self.entries.len())
                    .expect("an origin's index holds fewer than 2^32 entries"),
                high,
            });
        }
        if self.entries.len() == self.entries.capacity() {
            // By an eighth, not doubling, as the key table grows.
            self.entries.reserve_exact(self.entries.len() / 8 + 16);
        }
        self.entries.push(Entry { low, id: Some(id) });
    }

    /// Merges `below` into the vector, in one pass, and drops the holes and the vector's
    /// room beyond an eighth more than it holds.
    fn sweep(&mut self) {
        let held = self.len();
        let mut merged = VersionIndex {
            entries: Vec::with_capacity(held + held / 8 + 16),
            ..VersionIndex::default()
        };
        for (version, id) in self.range_from(Version::ZERO) {
            merged.push(version, id);
        }
        (self.entries, self.highs) = (merged.entries, merged.highs);
        (self.holes, self.below) = (0, BTreeMap::new());
    }
}

/// `version` spread over all 64 bits (splitmix64's finalizer), so that the xor of a set of
/// versions, which mostly differ in their low bits, tells sets apart.
fn mixed(version: Version) -> u64 {
    let mut z = version.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
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
        Rename(u64, u32),
    }

    /// Versions with bits in use above 32 as well as in an entry's low bits, so all are read
    /// back; four to a run, so runs hold several entries and a run of one entry is common.
    fn version(v: u64) -> Version {
        Version(((v / 4) << 36) | v)
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few versions for the operations, so inserts often land below the top (past
        // `BELOW_MIN` of them, merged) and on holes.
        prop_oneof![
            4 => (0..400u64, 0..1_000u32).prop_map(|(v, id)| Op::Insert(v, id)),
            2 => (0..400u64).prop_map(Op::Remove),
            1 => (0..400u64, 0..1_000u32).prop_map(|(v, id)| Op::Rename(v, id)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1_000))]

        #[test]
        fn the_index_answers_as_a_btree_map_of_versions_would(ops in prop::collection::vec(op(), 0..600)) {
            let mut index = VersionIndex::default();
            let mut model = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(v, id) => {
                        index.insert(version(v), KeyId::of(id as usize));
                        model.insert(version(v), KeyId::of(id as usize));
                    }
                    Op::Remove(v) => {
                        index.remove(version(v));
                        model.remove(&version(v));
                    }
                    Op::Rename(v, to) => {
                        if let Some(from) = model.get(&version(v)).copied() {
                            index.rename(version(v), from, KeyId::of(to as usize));
                            model.insert(version(v), KeyId::of(to as usize));
                        }
                    }
                }
                prop_assert_eq!(index.len(), model.len());
                let hash = model.keys().fold(0, |hash, &v| hash ^ mixed(v));
                prop_assert_eq!(index.versions_hash(), hash);
                prop_assert_eq!(index.last(), model.keys().next_back().copied());
                prop_assert!(index.holes * 5 <= index.entries.len());
                prop_assert!(index.below.len() <= index.below_max());
                let last_held = index.entries.last().map(|last| last.id);
                prop_assert!(last_held.is_none_or(|id| id.is_some()));
                let versions: Vec<_> = (0..index.entries.len()).map(|at| index.version_at(at)).collect();
                prop_assert!(versions.windows(2).all(|w| w[0] < w[1]));
                prop_assert_eq!(index.highs.first().map(|run| run.start()), (!versions.is_empty()).then_some(0));
                let runs: Vec<(u32, u64)> =
                    index.highs.iter().map(|&run| (run.from, run.high)).collect();
                prop_assert!(runs.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1));
                prop_assert!(index.highs.iter().all(|run| run.start() < versions.len()));
            }
            let all: Vec<_> = index.range_from(Version::ZERO).collect();
            let expected: Vec<_> = model.iter().map(|(v, id)| (*v, *id)).collect();
            prop_assert_eq!(all, expected);
            let mut ids: Vec<_> = index.ids().collect();
            let mut expected: Vec<_> = model.values().copied().collect();
            ids.sort_unstable();
            expected.sort_unstable();
            prop_assert_eq!(ids, expected);
            for v in 0..400u64 {
                prop_assert_eq!(index.get(version(v)), model.get(&version(v)).copied());
            }
            for v in (0..400u64).step_by(37) {
                let above: Vec<_> = index.range_from(version(v)).collect();
                let expected: Vec<_> = model.range(version(v)..).map(|(v, id)| (*v, *id)).collect();
                prop_assert_eq!(above, expected);
            }
        }
    }

    /// Each of `versions` indexed in turn, naming the key id of the same number.
    fn insert_each(index: &mut VersionIndex, versions: std::ops::RangeInclusive<u64>) {
        for v in versions {
            index.insert(Version(v), KeyId::of(v as usize));
        }
    }

    /// The bytes `index` holds a lane, its vectors' room included.
    fn bytes_a_lane(index: &VersionIndex) -> f64 {
        let bytes = index.entries.capacity() * std::mem::size_of::<Entry>()
            + index.highs.capacity() * std::mem::size_of::<High>();
        bytes as f64 / index.len() as f64
    }

    #[test]
    fn versions_that_each_have_a_high_part_of_their_own_cost_a_run_each_and_no_more() {
        // Found in review: a sender may give every lane a high part of its own.
        let mut index = VersionIndex::default();
        for k in 1..=10_000u64 {
            index.insert(Version(k << 32), KeyId::of(k as usize));
        }
        assert_eq!(index.highs.len(), 10_000);
        let spread = bytes_a_lane(&index);
        // An entry and its vector's room after a growth by an eighth (6.75), and a run and
        // its vector's room after a doubling (24).
        assert!(spread <= 31.0, "{spread:.1} bytes a lane");
        // Counting up one by one, as an origin's versions do: a run for each 65,536.
        let mut counted = VersionIndex::default();
        insert_each(&mut counted, 1..=200_000);
        assert_eq!(counted.highs.len(), 4);
        let in_runs = bytes_a_lane(&counted);
        assert!(in_runs <= 6.8, "{in_runs:.2} bytes a lane");
        let all: Vec<u64> = (counted.range_from(Version(65_530)).take(12))
            .map(|(v, _)| v.0)
            .collect();
        assert_eq!(all, (65_530..65_542).collect::<Vec<_>>());
        assert_eq!(counted.get(Version(131_072)), Some(KeyId::of(131_072)));
    }

    #[test]
    fn a_rewritten_lane_leaves_a_hole_until_the_holes_are_a_fifth() {
        let mut index = VersionIndex::default();
        insert_each(&mut index, 1..=100);
        // Each key rewritten once under a newer version: its old entry is a hole.
        for v in 1..=24 {
            index.remove(Version(v));
            index.insert(Version(100 + v), KeyId::of(v as usize));
        }
        assert_eq!(
            index.holes, 24,
            "24 of 124 entries, not past a fifth: not swept yet"
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

    #[test]
    fn a_gap_filled_under_pushes_merged_past_it_goes_beside_the_vector_until_merged() {
        let mut index = VersionIndex::default();
        // Pushes past a gap, then the gap's lanes, each below the vector's top.
        insert_each(&mut index, 10_001..=10_100);
        for v in 1..=10_000 {
            index.insert(Version(v), KeyId::of(v as usize));
            assert!(index.below.len() <= index.below_max());
        }
        assert!(index.entries.len() > 8_000, "merged into the vector");
        // The top removed, with lanes beside the vector: still within an eighth of it.
        let mut small = VersionIndex::default();
        insert_each(&mut small, 2_000..=2_999);
        insert_each(&mut small, 1..=125);
        assert_eq!(small.below.len(), 125);
        for v in 2_990..=2_999 {
            small.remove(Version(v));
            assert!(small.below.len() <= small.below_max());
        }
        assert_eq!(small.len(), 1_115);
        assert_eq!(index.len(), 10_100);
        let all: Vec<u64> = index.range_from(Version::ZERO).map(|(v, _)| v.0).collect();
        assert_eq!(all, (1..=10_100).collect::<Vec<_>>());
        assert_eq!(index.get(Version(5_000)), Some(KeyId::of(5_000)));
    }
}
