//! The counter map's keys: each held key with its counter's lanes, under a small id that the map's
//! per-origin version indexes hold instead of a copy of the key.

use crate::cells::Cells;
use crate::scopes::{ScopeId, Scopes};
use crate::{Key, KeyRef, Rule, Subject, Window};
use foldhash::fast::FoldHasher;
use foldhash::SharedSeed;
use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use std::hash::{Hash, Hasher};
use std::num::NonZeroU32;

/// A held key's place in its [`KeyTable`]: fixed while the key is held, reused after.
///
/// 32 bits, as the table's hash table and every origin's version index hold one per key
/// or lane: a table holds fewer than 2^32 - 1 keys (each takes over 50 bytes). Held as the
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

/// A key's subject and its counter's lanes: 24 bytes. With its rule and window's
/// [`ScopeId`], held beside it in [`Entries`], a key and its lanes take 28 bytes where a
/// [`Key`] and the lanes would take 40.
#[derive(Debug, Clone)]
struct Held {
    subject: Subject,
    cells: Cells,
}

const _: () = assert!(
    std::mem::size_of::<Option<Held>>() == 24,
    "a key table entry grew past 24 bytes"
);

/// The entries of a [`KeyTable`] by id, and beside them their keys' scopes: two vectors,
/// as one of entries holding their scope would take 32 bytes an entry, 4 of them padding.
#[derive(Debug, Clone, Default)]
struct Entries {
    held: Vec<Option<Held>>,
    // Invariant: as long as `held`; beside each entry that is `Some`, its key's scope
    // (beside a free one, the scope its last key was in, read by nothing).
    scopes: Vec<ScopeId>,
}

impl Entries {
    /// How many ids are given out, the free ones included.
    fn len(&self) -> usize {
        self.held.len()
    }

    /// The entry at `id` and its key's scope, if `id` is held.
    fn get(&self, id: KeyId) -> Option<(&Held, ScopeId)> {
        let held = self.held.get(id.at())?.as_ref()?;
        Some((held, self.scopes[id.at()]))
    }

    /// Every held entry, with its id and scope.
    fn iter(&self) -> impl Iterator<Item = (KeyId, &Held, ScopeId)> {
        let entries = self.held.iter().zip(&self.scopes).enumerate();
        entries.filter_map(|(at, (held, &scope))| Some((KeyId::of(at), held.as_ref()?, scope)))
    }

    /// Holds `held` in `scope` at `id`, a free id or the next one. The vectors grow by an
    /// eighth when full, not by doubling as `Vec::push` would: at most a ninth of their
    /// room is left unused rather than half (28 bytes a key, so about 3 a key held at worst
    /// instead of 28), for more copies while they grow: amortised, each entry is copied
    /// about nine times rather than twice.
    fn put(&mut self, id: Option<KeyId>, held: Held, scope: ScopeId) -> KeyId {
        if let Some(id) = id {
            self.held[id.at()] = Some(held);
            self.scopes[id.at()] = scope;
            return id;
        }
        if self.held.len() == self.held.capacity() {
            let more = self.held.len() / 8 + 16;
            self.held.reserve_exact(more);
            self.scopes.reserve_exact(more);
        }
        self.held.push(Some(held));
        self.scopes.push(scope);
        KeyId::of(self.held.len() - 1)
    }

    /// Frees `id`, returning its entry and scope.
    fn take(&mut self, id: KeyId) -> Option<(Held, ScopeId)> {
        let held = self.held.get_mut(id.at())?.take()?;
        Some((held, self.scopes[id.at()]))
    }

    /// Drops the free ids at the top.
    fn trim(&mut self) {
        while matches!(self.held.last(), Some(None)) {
            self.held.pop();
            self.scopes.pop();
        }
    }

    /// Takes the entry at the highest id, with its id and scope, if that id is held.
    fn pop(&mut self) -> Option<(KeyId, Held, ScopeId)> {
        let from = KeyId::of(self.held.len().checked_sub(1)?);
        // A free top id stays, in both vectors (found in review).
        self.held.last()?.as_ref()?;
        let held = self.held.pop().flatten()?;
        let scope = self.scopes.pop()?;
        Some((from, held, scope))
    }

    fn shrink_to_fit(&mut self) {
        self.held.shrink_to_fit();
        self.scopes.shrink_to_fit();
    }
}

/// Keys and their counters' lanes, found by key or by id.
///
/// The hash table holds ids only (4 bytes and a control byte a bucket), and hashes an id
/// by the key it names, so each key is held once, beside its lanes; and each key's rule
/// and window are held once for all the keys in them ([`Scopes`]).
#[derive(Debug, Clone)]
pub(crate) struct KeyTable {
    // Invariant: the id of every entry that is `Some`, once, at its key's hash.
    ids: HashTable<KeyId>,
    // Invariant: `None` exactly at the ids in `free`.
    entries: Entries,
    free: Vec<KeyId>,
    // Invariant: the scope of every entry that is `Some`, counting each entry once.
    scopes: Scopes,
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

    fn hash_one(&self, value: impl Hash) -> u64 {
        let mut hasher = FoldHasher::with_seed(self.seed, &self.shared);
        value.hash(&mut hasher);
        hasher.finish()
    }

    /// The hash of `key`. Hashed whole, not through a [`KeyRef`] made of it: that read
    /// the map bench's `value_of_100k_keys` 1.6 times as slowly (session 38).
    fn key(&self, key: &Key) -> u64 {
        self.hash_one(key)
    }

    /// The hash of a held key, by its parts: the same as its [`Key`]'s ([`Key`]'s
    /// invariant).
    fn held(&self, key: KeyRef<'_>) -> u64 {
        self.hash_one(key)
    }

    fn scope(&self, rule: &Rule, window: Window) -> u64 {
        self.hash_one((rule, window))
    }
}

impl KeyTable {
    /// An empty table whose hasher is keyed by `seed`.
    pub(crate) fn with_seed(seed: u64) -> KeyTable {
        KeyTable {
            ids: HashTable::new(),
            entries: Entries::default(),
            free: Vec::new(),
            scopes: Scopes::default(),
            hasher: KeyHasher::new(seed),
        }
    }

    /// How many keys are held.
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// The id of `key`, if it is held.
    pub(crate) fn id(&self, key: &Key) -> Option<KeyId> {
        let hash = self.hasher.key(key);
        self.ids.find(hash, |&id| self.holds(id, key)).copied()
    }

    /// The lanes at `id`, if `id` is held. Reads neither the key's strings nor its scope.
    pub(crate) fn cells(&self, id: KeyId) -> Option<&Cells> {
        Some(&self.entries.get(id)?.0.cells)
    }

    /// Whether `id` holds `key`.
    pub(crate) fn holds(&self, id: KeyId, key: &Key) -> bool {
        names(&self.entries, &self.scopes, id, key)
    }

    /// The key and lanes at `id`, if `id` is held.
    pub(crate) fn get(&self, id: KeyId) -> Option<(KeyRef<'_>, &Cells)> {
        let (held, scope) = self.entries.get(id)?;
        Some((key_of(&self.scopes, held, scope), &held.cells))
    }

    /// The id and lanes of `key`, holding it with no lanes (under a free id or a new one)
    /// if it was not held.
    pub(crate) fn entry(&mut self, key: &Key) -> (KeyId, &mut Cells) {
        let hash = self.hasher.key(key);
        let (entries, scopes, hasher) = (&self.entries, &self.scopes, &self.hasher);
        let found = self.ids.entry(
            hash,
            |&id| names(entries, scopes, id, key),
            |&id| hash_at(entries, scopes, hasher, id),
        );
        let id = match found {
            Entry::Occupied(held) => *held.get(),
            Entry::Vacant(free) => {
                let hasher = &self.hasher;
                let scope = (self.scopes).add_key(&key.rule, key.window, |rule, window| {
                    hasher.scope(rule, window)
                });
                let held = Held {
                    subject: key.subject.clone(),
                    cells: Cells::default(),
                };
                let id = self.entries.put(self.free.pop(), held, scope);
                free.insert(id);
                id
            }
        };
        let held = self.entries.held[id.at()].as_mut();
        (id, &mut held.expect("an id found is held").cells)
    }

    /// Stops holding `id`'s key, returning its lanes.
    pub(crate) fn remove(&mut self, id: KeyId) -> Option<Cells> {
        let (held, scope) = self.entries.take(id)?;
        let hash = self.hasher.held(key_of(&self.scopes, &held, scope));
        if let Ok(found) = self.ids.find_entry(hash, |&other| other == id) {
            found.remove();
        }
        let hasher = &self.hasher;
        (self.scopes).remove_key(scope, |rule, window| hasher.scope(rule, window));
        self.free.push(id);
        Some(held.cells)
    }

    /// Every held id with its key and lanes, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (KeyId, KeyRef<'_>, &Cells)> {
        (self.entries.iter())
            .map(|(id, held, scope)| (id, key_of(&self.scopes, held, scope), &held.cells))
    }

    /// Every held id whose key's window `matches`, in no particular order. Reads no key's
    /// strings.
    pub(crate) fn ids_in_windows<'a>(
        &'a self,
        matches: impl Fn(Window) -> bool + 'a,
    ) -> impl Iterator<Item = KeyId> + 'a {
        (self.entries.iter()).filter_map(move |(id, _, scope)| {
            let (_, window) = self.scopes.get(scope);
            matches(window).then_some(id)
        })
    }

    /// Whether fewer than a quarter of the ids given out (up to the highest, free ones
    /// included) are held: a table left that sparse by [`KeyTable::remove`] is worth
    /// compacting.
    pub(crate) fn is_sparse(&self) -> bool {
        self.len() < self.entries.len() / 4
    }

    /// Moves the entries at the highest ids into the free ids below them until no id is
    /// free, and gives the room left over back to the allocator. Calls `moved(from, to,
    /// cells)` for every entry that changed id, so that whatever holds ids can follow.
    pub(crate) fn compact(&mut self, mut moved: impl FnMut(KeyId, KeyId, &Cells)) {
        // Lowest last, so that `pop` takes the lowest free id.
        self.free
            .sort_unstable_by_key(|id| std::cmp::Reverse(id.at()));
        loop {
            self.entries.trim();
            let Some(to) = self.free.pop() else {
                break;
            };
            if to.at() >= self.entries.len() {
                continue;
            }
            let Some((from, held, scope)) = self.entries.pop() else {
                continue;
            };
            let hash = self.hasher.held(key_of(&self.scopes, &held, scope));
            if let Ok(mut found) = self.ids.find_entry(hash, |&id| id == from) {
                *found.get_mut() = to;
            }
            moved(from, to, &held.cells);
            self.entries.put(Some(to), held, scope);
        }
        self.entries.shrink_to_fit();
        self.free.shrink_to_fit();
        // A burst of scopes leaves no room behind (found in review).
        self.hold_scopes_afresh();
        let (entries, scopes, hasher) = (&self.entries, &self.scopes, &self.hasher);
        self.ids
            .shrink_to_fit(|&id| hash_at(entries, scopes, hasher, id));
    }

    /// The table, its hasher keyed by `seed` instead: every id stays.
    pub(crate) fn reseed(&mut self, seed: u64) {
        self.hasher = KeyHasher::new(seed);
        self.hold_scopes_afresh();
        let hasher = &self.hasher;
        let mut ids = HashTable::with_capacity(self.len());
        let (entries, scopes) = (&self.entries, &self.scopes);
        for (id, key, _) in self.iter() {
            ids.insert_unique(hasher.held(key), id, |&id| {
                hash_at(entries, scopes, hasher, id)
            });
        }
        self.ids = ids;
    }

    /// The scopes held anew, under the table's hasher, for the keys held and no others.
    fn hold_scopes_afresh(&mut self) {
        let (old, hasher) = (&self.scopes, &self.hasher);
        let mut scopes = Scopes::default();
        let entries = &mut self.entries;
        for (held, scope) in entries.held.iter().zip(&mut entries.scopes) {
            if held.is_some() {
                let (rule, window) = old.get(*scope);
                *scope = scopes.add_key(rule, window, |rule, window| hasher.scope(rule, window));
            }
        }
        self.scopes = scopes;
    }
}

/// The key `held` holds, in `scope`.
fn key_of<'a>(scopes: &'a Scopes, held: &'a Held, scope: ScopeId) -> KeyRef<'a> {
    let (rule, window) = scopes.get(scope);
    KeyRef::held(rule, &held.subject, window)
}

/// Whether the entry at `id` holds `key`.
fn names(entries: &Entries, scopes: &Scopes, id: KeyId, key: &Key) -> bool {
    // The subject first, read beside the lanes: the scope only for a key that matched it.
    let Some(Some(held)) = entries.held.get(id.at()) else {
        return false;
    };
    if held.subject != key.subject {
        return false;
    }
    let (rule, window) = scopes.get(entries.scopes[id.at()]);
    window == key.window && *rule == key.rule
}

/// The hash of the key at `id`, for the hash table's moves (every id it holds is held).
fn hash_at(entries: &Entries, scopes: &Scopes, hasher: &KeyHasher, id: KeyId) -> u64 {
    match entries.get(id) {
        Some((held, scope)) => hasher.held(key_of(scopes, held, scope)),
        None => 0,
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
        assert_eq!(removed.get(origin), Some((lane, Version(1))));
        assert_eq!(table.id(&key(5)), None);
        assert!(table.get(ids[5]).is_none());
        assert!(table.remove(ids[5]).is_none(), "removed once");
        assert_eq!(table.len(), 99);

        let reused = table.entry(&key(1_000)).0;
        assert_eq!(reused, ids[5]);
        assert_eq!(table.get(reused).unwrap().1.get(origin), None);
        assert_eq!(table.get(reused).unwrap().0.to_key(), key(1_000));
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
        table.compact(|from, to, _| moves.push((from, to)));
        assert!(!table.is_sparse());
        assert_eq!(table.len(), 10);
        assert_eq!(table.entries.len(), 10, "no free id is left");
        assert_eq!(moves.len(), 9, "every key but the first moved down");
        for &(from, to) in &moves {
            assert!(to.at() < from.at());
            let moved = table.get(to).unwrap().0.to_key();
            assert_eq!(table.id(&moved), Some(to));
        }
        for s in (0..100).step_by(10) {
            let id = table.id(&key(s)).unwrap();
            assert_eq!(table.get(id).unwrap().0.to_key(), key(s));
        }
        let fresh = table.entry(&key(1_000)).0;
        assert_eq!(
            fresh,
            KeyId::of(10),
            "the next id follows the compacted ones"
        );
    }

    #[test]
    fn taking_the_top_entry_when_its_id_is_free_leaves_both_vectors_as_they_were() {
        let mut table = KeyTable::with_seed(1);
        table.entry(&key(0));
        let top = table.entry(&key(1)).0;
        table.remove(top).unwrap();
        assert!(table.entries.pop().is_none(), "the top id is free");
        assert_eq!(table.entries.held.len(), 2);
        assert_eq!(table.entries.scopes.len(), 2, "in step with the entries");
        table.entries.trim();
        let (id, held, _) = table.entries.pop().expect("the top id is held now");
        assert_eq!((id, held.subject), (KeyId::of(0), key(0).subject));
        assert_eq!(table.entries.scopes.len(), 0);
    }

    #[test]
    fn a_reseeded_table_finds_every_key_under_its_old_id() {
        let mut table = KeyTable::with_seed(1);
        let ids: Vec<KeyId> = (0..50).map(|s| table.entry(&key(s)).0).collect();
        let hash_before = table.hasher.key(&key(0));
        table.reseed(2);
        assert_ne!(table.hasher.key(&key(0)), hash_before, "hashed anew");
        for (s, id) in ids.iter().enumerate() {
            assert_eq!(table.id(&key(s)), Some(*id));
        }
        assert_eq!(table.entry(&key(0)).0, ids[0]);
        for (s, &id) in ids.iter().enumerate() {
            let held = table.get(id).unwrap().0;
            assert_eq!(table.hasher.held(held), table.hasher.key(&key(s)));
        }
        let added = table.entry(&key(50)).0;
        assert_eq!(table.get(added).unwrap().0.to_key(), key(50));
        assert_eq!(
            table.scopes.slots(),
            1,
            "found in its scope under the new hasher"
        );
    }

    #[test]
    fn compacting_gives_back_the_room_of_the_scopes_no_key_is_in_any_more() {
        let mut table = KeyTable::with_seed(1);
        let rule = Rule::new("a").unwrap();
        let in_window = |index| {
            let window = Window::new(index, 1).unwrap();
            Key::new(rule.clone(), Subject::new("s").unwrap(), window)
        };
        let ids: Vec<KeyId> = (0..1_000)
            .map(|index| table.entry(&in_window(index)).0)
            .collect();
        for &id in &ids[..999] {
            table.remove(id).unwrap();
        }
        assert_eq!(table.scopes.slots(), 1_000, "freed, not given back");
        table.compact(|_, _, _| {});
        assert_eq!(table.scopes.slots(), 1);
        let id = table.id(&in_window(999)).unwrap();
        assert_eq!(table.get(id).unwrap().0.to_key(), in_window(999));
        let next = table.entry(&in_window(1_000)).0;
        assert_eq!(table.get(next).unwrap().0.to_key(), in_window(1_000));
    }

    #[test]
    fn keys_that_differ_only_in_rule_or_window_are_held_apart_each_scope_held_once() {
        let mut table = KeyTable::with_seed(3);
        let (login, api) = (Rule::new("login").unwrap(), Rule::new("api").unwrap());
        let (minute, hour) = (
            Window::containing(600, 60).unwrap(),
            Window::containing(600, 3_600).unwrap(),
        );
        let subject = Subject::new("user-1").unwrap();
        let keys = [
            Key::new(login.clone(), subject.clone(), minute),
            Key::new(login.clone(), subject.clone(), hour),
            Key::new(api.clone(), subject.clone(), minute),
        ];
        let ids: Vec<KeyId> = keys.iter().map(|key| table.entry(key).0).collect();
        assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
        for _ in 0..3 {
            let other = Key::new(login.clone(), Subject::new("user-2").unwrap(), minute);
            table.entry(&other);
        }
        table.remove(ids[0]).unwrap();
        assert_eq!(table.id(&keys[0]), None);
        for (key, id) in keys.iter().zip(&ids).skip(1) {
            assert_eq!(table.id(key), Some(*id));
            assert_eq!(table.get(*id).unwrap().0.to_key(), *key);
        }
        let user_2 = Key::new(login, Subject::new("user-2").unwrap(), minute);
        let id = table
            .id(&user_2)
            .expect("its scope outlived the key removed from it");
        assert_eq!(table.get(id).unwrap().0.to_key(), user_2);
    }
}
