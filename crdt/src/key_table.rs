//! The counter map's keys: each held key with its counter's lanes, under a small id that the map's
//! per-origin version indexes hold instead of a copy of the key.

use crate::cells::Cells;
use crate::Key;
use foldhash::fast::FoldHasher;
use foldhash::SharedSeed;
use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use std::hash::{Hash, Hasher};
use std::num::NonZeroU32;

/// A held key's place in its [`KeyTable`]: fixed while the key is held, reused after.
///
/// 32 bits, as the table's hash table and every origin's version index hold one per key
/// or lane: a table holds fewer than 2^32 - 1 keys (each takes over 80 bytes). Held as the
/// position plus one, so that an `Option<KeyId>` is 32 bits too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct KeyId(NonZeroU32);

impl KeyId {
    fn at(self) -> usize {
        self.0.get() as usize - 1
    }

    pub(crate) fn of(at: usize) -> KeyId {
        let id = u32::try_from(at + 1).ok().and_then(NonZeroU32::new);
        KeyId(id.expect("a key table holds fewer than 2^32 - 1 keys"))
    }
}

/// A key and its counter's lanes.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub(crate) key: Key,
    pub(crate) cells: Cells,
}

/// Keys and their counters' lanes, found by key or by id.
///
/// The hash table holds ids only (8 bytes and a control byte a bucket), and hashes an id
/// by the key it names, so each key is held once, beside its lanes.
#[derive(Debug, Clone)]
pub(crate) struct KeyTable {
    // Invariant: the id of every entry that is `Some`, once, at its key's hash.
    ids: HashTable<KeyId>,
    // Invariant: `None` exactly at the ids in `free`.
    entries: Vec<Option<Held>>,
    free: Vec<KeyId>,
    hasher: KeyHasher,
}

/// foldhash, with both its seeds taken from the map's seed: the per-hasher seed and the
/// shared one, which foldhash's own `FixedState` leaves at public constants.
#[derive(Debug, Clone)]
struct KeyHasher {
    seed: u64,
    shared: SharedSeed,
}

impl KeyHasher {
    fn new(seed: u64) -> KeyHasher {
        KeyHasher {
            seed,
            shared: SharedSeed::from_u64(seed),
        }
    }

    fn hash_one(&self, key: &Key) -> u64 {
        let mut hasher = FoldHasher::with_seed(self.seed, &self.shared);
        key.hash(&mut hasher);
        hasher.finish()
    }
}

impl KeyTable {
    /// An empty table whose hasher is keyed by `seed`.
    pub(crate) fn with_seed(seed: u64) -> KeyTable {
        KeyTable {
            ids: HashTable::new(),
            entries: Vec::new(),
            free: Vec::new(),
            hasher: KeyHasher::new(seed),
        }
    }

    /// How many keys are held.
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// The id of `key`, if it is held.
    pub(crate) fn id(&self, key: &Key) -> Option<KeyId> {
        let hash = self.hasher.hash_one(key);
        self.ids
            .find(hash, |&id| names(&self.entries, id, key))
            .copied()
    }

    /// The key and lanes at `id`, if `id` is held.
    pub(crate) fn get(&self, id: KeyId) -> Option<&Held> {
        self.entries.get(id.at())?.as_ref()
    }

    /// The id and lanes of `key`, holding it with no lanes (under a free id or a new one)
    /// if it was not held.
    pub(crate) fn entry(&mut self, key: &Key) -> (KeyId, &mut Cells) {
        let hash = self.hasher.hash_one(key);
        let (entries, hasher) = (&self.entries, &self.hasher);
        let found = self.ids.entry(
            hash,
            |&id| names(entries, id, key),
            |&id| hash_at(entries, hasher, id),
        );
        let id = match found {
            Entry::Occupied(held) => *held.get(),
            Entry::Vacant(free) => {
                let id = self
                    .free
                    .pop()
                    .unwrap_or_else(|| push_empty(&mut self.entries));
                free.insert(id);
                id
            }
        };
        let held = self.entries[id.at()].get_or_insert_with(|| Held {
            key: key.clone(),
            cells: Cells::default(),
        });
        (id, &mut held.cells)
    }

    /// Stops holding `id`'s key, returning it with its lanes.
    pub(crate) fn remove(&mut self, id: KeyId) -> Option<Held> {
        let held = self.entries.get_mut(id.at())?.take()?;
        let hash = self.hasher.hash_one(&held.key);
        if let Ok(found) = self.ids.find_entry(hash, |&other| other == id) {
            found.remove();
        }
        self.free.push(id);
        Some(held)
    }

    /// Every held id with its key and lanes, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (KeyId, &Held)> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(at, held)| Some((KeyId::of(at), held.as_ref()?)))
    }

    /// Whether fewer than a quarter of the ids given out (up to the highest, free ones
    /// included) are held: a table left that sparse by [`KeyTable::remove`] is worth
    /// compacting.
    pub(crate) fn is_sparse(&self) -> bool {
        self.len() < self.entries.len() / 4
    }

    /// Moves the entries at the highest ids into the free ids below them until no id is
    /// free, and gives the room left over back to the allocator. Calls `moved(from, to,
    /// held)` for every entry that changed id, so that whatever holds ids can follow.
    pub(crate) fn compact(&mut self, mut moved: impl FnMut(KeyId, KeyId, &Held)) {
        // Lowest last, so that `pop` takes the lowest free id.
        self.free
            .sort_unstable_by_key(|id| std::cmp::Reverse(id.at()));
        loop {
            while matches!(self.entries.last(), Some(None)) {
                self.entries.pop();
            }
            let Some(to) = self.free.pop() else {
                break;
            };
            if to.at() >= self.entries.len() {
                continue;
            }
            let from = KeyId::of(self.entries.len() - 1);
            let Some(held) = self.entries.pop().flatten() else {
                continue;
            };
            let hash = self.hasher.hash_one(&held.key);
            if let Ok(mut found) = self.ids.find_entry(hash, |&id| id == from) {
                *found.get_mut() = to;
            }
            moved(from, to, &held);
            self.entries[to.at()] = Some(held);
        }
        self.entries.shrink_to_fit();
        self.free.shrink_to_fit();
        let (entries, hasher) = (&self.entries, &self.hasher);
        self.ids.shrink_to_fit(|&id| hash_at(entries, hasher, id));
    }

    /// The table, its hasher keyed by `seed` instead: every id stays.
    pub(crate) fn reseed(&mut self, seed: u64) {
        self.hasher = KeyHasher::new(seed);
        let mut ids = HashTable::with_capacity(self.len());
        for (id, held) in self.iter() {
            let hash = self.hasher.hash_one(&held.key);
            ids.insert_unique(hash, id, |&id| hash_at(&self.entries, &self.hasher, id));
        }
        self.ids = ids;
    }
}

/// Appends an empty entry and returns its id. A full vector grows by a quarter, not by
/// doubling as `Vec::push` would: at most a fifth of its room is left unused rather than
/// half (an entry is 40 bytes, so 10 unused a key held at worst instead of 40), and a growth copies
/// into 1.25 times the room rather than 2 (amortised, each entry is copied about five
/// times rather than twice).
fn push_empty(entries: &mut Vec<Option<Held>>) -> KeyId {
    if entries.len() == entries.capacity() {
        entries.reserve_exact(entries.len() / 4 + 16);
    }
    entries.push(None);
    KeyId::of(entries.len() - 1)
}

/// Whether the entry at `id` holds `key`.
fn names(entries: &[Option<Held>], id: KeyId, key: &Key) -> bool {
    matches!(entries.get(id.at()), Some(Some(held)) if held.key == *key)
}

/// The hash of the key at `id`, for the hash table's moves (every id it holds is held).
fn hash_at(entries: &[Option<Held>], hasher: &KeyHasher, id: KeyId) -> u64 {
    match entries.get(id.at()) {
        Some(Some(held)) => hasher.hash_one(&held.key),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cells::Replicas;
    use crate::{Generation, Lane, NodeId, ReplicaId, Rule, Subject, Version, Window};

    fn key(subject: usize) -> Key {
        Key::new(
            Rule::new("r").unwrap(),
            Subject::new(format!("subject-{subject}")).unwrap(),
            Window::containing(600, 60).unwrap(),
        )
    }

    #[test]
    fn a_key_keeps_its_id_while_held_and_a_removed_keys_id_is_reused() {
        let mut table = KeyTable::with_seed(7);
        let ids: Vec<KeyId> = (0..100).map(|s| table.entry(&key(s)).0).collect();
        assert_eq!(table.len(), 100);
        assert_eq!(table.entry(&key(5)).0, ids[5], "held: same id");
        let mut replicas = Replicas::default();
        let origin = replicas.add(ReplicaId::new(NodeId(1), Generation(1)));
        let lane = Lane::new(3, 0);
        table
            .entry(&key(5))
            .1
            .merge(&replicas, origin, lane, Version(1));

        let removed = table.remove(ids[5]).unwrap();
        assert_eq!(removed.key, key(5));
        assert_eq!(removed.cells.get(origin), Some((lane, Version(1))));
        assert_eq!(table.id(&key(5)), None);
        assert!(table.get(ids[5]).is_none());
        assert!(table.remove(ids[5]).is_none(), "removed once");
        assert_eq!(table.len(), 99);

        let reused = table.entry(&key(1_000)).0;
        assert_eq!(reused, ids[5]);
        assert_eq!(table.get(reused).unwrap().cells.get(origin), None);
        for (s, id) in ids.iter().enumerate().filter(|&(s, _)| s != 5) {
            assert_eq!(table.id(&key(s)), Some(*id), "key {s}");
        }
        assert_eq!(table.iter().count(), 100);
    }

    #[test]
    fn compacting_moves_the_highest_entries_into_the_free_ids_and_reports_each_move() {
        let mut table = KeyTable::with_seed(7);
        for s in 0..100 {
            table.entry(&key(s));
        }
        // Keep every tenth key, so the free ids are spread under the held ones.
        for s in (0..100).filter(|s| s % 10 != 0) {
            let id = table.id(&key(s)).unwrap();
            table.remove(id).unwrap();
        }
        assert!(table.is_sparse());
        let mut moves = Vec::new();
        table.compact(|from, to, held| moves.push((from, to, held.key.clone())));
        assert!(!table.is_sparse());
        assert_eq!(table.len(), 10);
        assert_eq!(table.entries.len(), 10, "no free id is left");
        for (from, to, moved) in &moves {
            assert!(to.at() < from.at());
            assert_eq!(table.id(moved), Some(*to));
        }
        for s in (0..100).step_by(10) {
            let id = table.id(&key(s)).unwrap();
            assert_eq!(table.get(id).unwrap().key, key(s));
        }
        let fresh = table.entry(&key(1_000)).0;
        assert_eq!(
            fresh,
            KeyId::of(10),
            "the next id follows the compacted ones"
        );
    }

    #[test]
    fn a_reseeded_table_finds_every_key_under_its_old_id() {
        let mut table = KeyTable::with_seed(1);
        let ids: Vec<KeyId> = (0..50).map(|s| table.entry(&key(s)).0).collect();
        let hash_before = table.hasher.hash_one(&key(0));
        table.reseed(2);
        assert_ne!(table.hasher.hash_one(&key(0)), hash_before, "hashed anew");
        for (s, id) in ids.iter().enumerate() {
            assert_eq!(table.id(&key(s)), Some(*id));
        }
    }
}
