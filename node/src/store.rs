//! The lane store: this node's own lanes for every key it counts, written by many
//! application threads at once, and per key the sum of the other replicas' lanes as gossip
//! last merged them.
//!
//! Writers never take a lock and never wait for each other: a write is a checked add on the
//! key's slot. Reads ([`LaneStore::own`], [`LaneStore::estimate`]) never take a lock either.
//! The one exception is a key whose remote sum is beyond ±(2^61 - 1), more than a slot
//! holds: that sum sits in a side table behind a lock, which its key's reads, writes and
//! removal take.
//! The gossip task is the other side: [`LaneStore::collect`] hands it every own lane that
//! changed, and [`LaneStore::publish_remote`] takes back what it merged from peers.
//!
//! The store never does IO, never reads a clock, never holds other replicas' lanes (only
//! their sum), and never wraps a lane: a write that would pass `u64::MAX` is refused whole.
//! It never holds more than `keys_max` keys.
//!
//! # Architecture Invariant: no increment is lost between a write and a collection
//!
//! Each key's `Slot` has its two totals and a dirty flag, and the store has one queue of
//! keys whose slot went from clean to dirty.
//!
//! - A write adds to a total, then sets the flag (`Release`); the writer that finds the
//!   flag clear queues the key.
//! - A collection pops a key, clears the flag (`Acquire`), then reads the totals.
//!
//! A write that found the flag already set did so before the collector cleared it (the
//! read-modify-writes of one atomic are totally ordered), so the collector's `Acquire`
//! clear makes that write's add visible to the reads after it. A write that found the flag
//! clear queued the key again, for the next collection.
//!
//! Enforced by: the loom models at the bottom of this file
//! (`two_writers_and_a_collector_lose_no_increment`, with two deliberately broken
//! collectors as negative controls that must lose a write) and the unit test
//! `concurrent_writes_and_collections_lose_nothing`.

mod held;

use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering};
use crossbeam_queue::SegQueue;
use foldhash::fast::{FoldHasher, SeedableRandomState};
use foldhash::SharedSeed;
use held::{HeldKey, Scope, ScopeRef};
use papaya::{Equivalent, Guard};
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hash, RandomState};
// Not from `crate::sync`: the key count is not part of the slot protocol that the loom
// models check, and the store's map and queue are not loom-aware anyway.
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tally_crdt::{Key, KeyRef, Lane, Overflow, ReplicaId};
use tokio::sync::Notify;

/// One replica's own lanes and the remote sums, shared by every thread as `Arc<LaneStore>`.
pub struct LaneStore {
    replica: ReplicaId,
    keys_max: usize,
    // papaya rather than dashmap: reads and writes to existing keys never lock (dashmap
    // takes a shard lock for every read, so a hot key's readers contend on the shard's
    // lock word), and its entries are one exact-size allocation each (40 bytes: a 16-byte
    // `HeldKey` and a 24-byte `Slot`) with a 9-byte table slot, where dashmap's tables
    // double in place and sit half empty after each growth. Looked up by `KeyRef`, so that
    // a write to a held key allocates nothing.
    slots: papaya::HashMap<HeldKey, Slot, KeyHasher>,
    // The scopes (rule and window) of the keys held, each held once; a scope no key holds
    // is dropped by `reclaim`.
    scopes: papaya::HashSet<Arc<Scope>, KeyHasher>,
    // Keys whose slot went from clean to dirty. A key is here at most once: its slot stays
    // dirty from the push until a collection pops it and takes the slot.
    dirty: SegQueue<HeldKey>,
    // Raised after each push to `dirty`, so the collector can sleep while nothing changes.
    queued: Notify,
    // The remote sums too large for their slots.
    outsized: Outsized,
    // Keys held plus keys being inserted. Invariant: never above `keys_max`, because an
    // insert reserves its place here first and gives it back if it does not insert.
    keys: AtomicUsize,
    // The first second at which a held key's window may be over: at most the
    // `live_until_unix_secs` of every key held. An insert lowers it once the key is in the
    // map; `expire` sets it again from the keys it walks, and walks none before it.
    ends_from: std::sync::atomic::AtomicU64,
    // The most keys `reclaim` has seen held: it finishes a growth of the map only past it.
    keys_high: AtomicUsize,
    // When the first write since the last collection was made, in nanoseconds on the
    // writer's monotonic clock, as the writer said ([`LaneStore::note_written`]);
    // `NOT_WRITTEN` if none said so.
    first_written: std::sync::atomic::AtomicU64,
}

/// `LaneStore::first_written` when no write since the last collection was noted.
const NOT_WRITTEN: u64 = u64::MAX;

/// What a write left behind: the key's own lane and its estimate just after the write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    /// The own lane's totals after the write (and any writes that landed alongside it).
    pub own: Lane,
    /// `own`'s value plus the remote sum last published: what [`LaneStore::estimate`]
    /// would have read at that moment.
    pub estimate: i128,
}

/// Why a write or a publish counted nothing. Nothing changed in either case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The write would take the lane past `u64::MAX`. Lanes never wrap.
    #[error(transparent)]
    Overflow(#[from] Overflow),
    /// The key is new and the store already holds `keys_max` keys, counting the keys other
    /// threads are creating at that moment; so a creation racing others near the cap may be
    /// refused a little early.
    #[error("keys: the store holds its maximum of {keys_max} keys; nothing counted")]
    KeysFull {
        /// The configured maximum.
        keys_max: usize,
    },
}

impl LaneStore {
    /// An empty store for `replica`'s lanes, holding at most `keys_max` keys.
    pub fn new(replica: ReplicaId, keys_max: usize) -> LaneStore {
        LaneStore {
            replica,
            keys_max,
            slots: papaya::HashMap::with_hasher(KeyHasher::new()),
            scopes: papaya::HashSet::with_hasher(KeyHasher::new()),
            dirty: SegQueue::new(),
            queued: Notify::new(),
            outsized: Outsized::default(),
            keys: AtomicUsize::new(0),
            ends_from: std::sync::atomic::AtomicU64::new(u64::MAX),
            keys_high: AtomicUsize::new(0),
            first_written: std::sync::atomic::AtomicU64::new(NOT_WRITTEN),
        }
    }

    /// The replica whose lanes these are.
    pub fn replica(&self) -> ReplicaId {
        self.replica
    }

    /// Adds `amount` to the key's own increments and returns its own lane after the write
    /// (with any writes that landed alongside) and the estimate that follows from it, from
    /// the same lookup. Creates the key if it is new. On error nothing changed.
    pub fn incr<'k>(&self, key: impl Into<KeyRef<'k>>, amount: u64) -> Result<Counted, StoreError> {
        self.write(key.into(), amount, Slot::incr)
    }

    /// Adds `amount` to the key's own decrements and returns its own lane and estimate after
    /// the write. Creates the key if it is new. On error nothing changed.
    pub fn decr<'k>(&self, key: impl Into<KeyRef<'k>>, amount: u64) -> Result<Counted, StoreError> {
        self.write(key.into(), amount, Slot::decr)
    }

    /// The key's own lane: zero if the store does not hold the key.
    ///
    /// The two totals are read one after the other, so a write landing in between may be
    /// seen in one and not the other; each is a total the lane really had, which is all a
    /// merge (the larger of each total) needs. The decrements are read first, so a value
    /// read across writes errs high (an increment seen without a later decrement), never
    /// low: a check never reads room that was not there.
    pub fn own<'k>(&self, key: impl Into<KeyRef<'k>>) -> Lane {
        let guard = self.slots.guard();
        self.slots
            .get(&key.into(), &guard)
            .map(Slot::own)
            .unwrap_or_default()
    }

    /// The key's estimate: its own lane's value plus the remote sum last published, exact in
    /// `i128`. Zero if the store does not hold the key.
    pub fn estimate<'k>(&self, key: impl Into<KeyRef<'k>>) -> i128 {
        let key = key.into();
        let guard = self.slots.guard();
        loop {
            let Some(slot) = self.slots.get(&key, &guard) else {
                return 0;
            };
            let own = slot.own();
            if let Some(remote) = self.outsized.remote(slot) {
                return own.value() + remote;
            }
            // Retired with an outsized sum, and maybe still in the map: finish its removal,
            // so this never waits on the remover, then read the key's next slot, if any.
            self.unlink(&key, |current| std::ptr::eq(current, slot), &guard);
        }
    }

    /// Sets the key's remote sum: the sum of every other replica's lane as gossip last merged
    /// them. Creates the key if it is new; the only error is
    /// [`StoreError::KeysFull`], and then nothing changed.
    ///
    /// Meant for one gossip task: concurrent publishes to one key are safe, and the sum is
    /// the last one's. A publish racing the removal of its key may leave with the removed
    /// key.
    pub fn publish_remote(&self, key: &Key, remote: i128) -> Result<(), StoreError> {
        let guard = self.slots.guard();
        let (_, slot) = self.slot_or_insert(key.into(), &guard)?;
        self.outsized.publish(slot, remote);
        Ok(())
    }

    /// Appends to `out` every own lane that changed since it was last collected, with its
    /// totals. Each key appears at most once per call.
    ///
    /// A write racing the collection is never lost: it is either in the totals collected
    /// now or its key is queued for the next collection. Only the keys queued when the call
    /// starts are taken, so writers that keep writing cannot keep it from returning.
    pub fn collect(&self, out: &mut Vec<(Key, Lane)>) {
        let guard = self.slots.guard();
        // Cleared before the keys are counted: a write queued after the count stays for
        // the next collection, and its note, made after its key was queued, with it.
        self.first_written.store(NOT_WRITTEN, Ordering::Relaxed);
        for _ in 0..self.dirty.len() {
            let Some(key) = self.dirty.pop() else {
                // Another collection took the rest.
                break;
            };
            let Some(slot) = self.slots.get(&key, &guard) else {
                unreachable!(
                    "queued key {} has no slot: a queued key's slot stays dirty until \
                     collected, and only a clean slot is removed",
                    key.to_key()
                );
            };
            out.push((key.into_key(), slot.take()));
        }
    }

    /// Removes the key if it has nothing left to collect; returns whether it was removed.
    /// A key absent, or with writes not yet collected, stays (collect, then remove again).
    ///
    /// Removal is for windows that are over. A key written again after its removal starts
    /// a new lane from zero, which peers holding the old totals ignore until it passes them
    /// (a merge keeps the larger total). The node writes only in the window of its wall
    /// clock, which windows are expired behind, so that happens only once the wall clock
    /// steps back past a window's life (a gap, ARCHITECTURE.md). A write racing the removal
    /// lands before it (and the key stays), in the key's new slot, or in both: a collection
    /// between its add and its flag takes the add with the old totals, and the write, then
    /// finding the slot retired, counts in the new slot too (found in review, session 40).
    /// The new slot is a new lane from zero, so with writers on several threads a write to
    /// a window that is over can be acknowledged and then ignored by peers holding the old
    /// totals, or held in both the old totals and the new lane. `tallyd` runs writes and
    /// removals on one thread, where no write races a removal.
    pub fn remove(&self, key: &Key) -> bool {
        let guard = self.slots.guard();
        self.unlink(key, Slot::retire, &guard)
    }

    /// Removes every key whose window is no longer live at `now_unix_secs` (see
    /// [`tally_crdt::Window::is_live`]) and has nothing left to collect; returns how many
    /// were removed. Keys with writes not yet collected stay for the next call. Walks the
    /// keys only once some window may have ended since the last walk: a call every second
    /// costs nothing while none does.
    pub fn expire(&self, now_unix_secs: u64) -> usize {
        if now_unix_secs < self.ends_from.load(Ordering::Relaxed) {
            return 0;
        }
        // Reset before the walk. Both this and an insert's lowering are read-modify-writes
        // of the one atomic, so one comes first: an insert whose lowering came before is
        // seen by the walk (it acquires what the insert released), and one after lowers
        // the bound it sets.
        self.ends_from.swap(u64::MAX, Ordering::AcqRel);
        let guard = self.slots.guard();
        let mut removed = 0;
        for (key, _) in self.slots.iter(&guard) {
            let until = key.window().live_until_unix_secs();
            if now_unix_secs >= until && self.unlink(key, Slot::retire, &guard) {
                removed += 1;
            } else {
                self.ends_from.fetch_min(until, Ordering::Relaxed);
            }
        }
        removed
    }

    /// Finishes a growth of the map that inserts left half done, if the store holds more
    /// keys than it ever did at an earlier call, then frees the memory this thread
    /// retired: removed keys' slots, and the map's old tables.
    ///
    /// papaya copies its old table into a new one a chunk at a time, and only on inserts
    /// that run past its probe limit, so once inserts stop a copy can stay half done, both
    /// tables resident (about 10 bytes a key more than the new table alone). Past its
    /// highest key count, where papaya doubles its table, this finishes the copy on the
    /// calling thread: what is left of it, about as long as a walk of that many keys (see
    /// BENCHMARKS.md, memory, session 41); the thread that finishes a copy retires the old
    /// table. Below it, it leaves papaya's inserts to finish a copy 64 entries at a time:
    /// keys that expire and others that come in their place make papaya copy its table
    /// into one of the same size every few minutes, and finishing each here held the
    /// calling thread for 45 to 238 ms at 350,000 to 1.2M keys (found in review). A
    /// doubling at a key count already seen (with many keys removed and as many added
    /// since) is left to the inserts too.
    ///
    /// papaya hands old tables to its reclamation scheme, which frees retired memory a
    /// batch at a time, per thread, once the batch fills; removals are rare between
    /// resizes, so without the flush here the old tables would stay, as much again as the
    /// live one. They sit in the batch of the thread that finished the resize. In tallyd
    /// writes, merges and expiry all run on the runtime's one thread, whose gossip task
    /// calls this once a second; writer threads of their own keep theirs until their batch
    /// fills. A flush is a system call (`membarrier`) even when there is nothing to free.
    ///
    /// Then drops the scopes that no key holds any more, the removed keys freed: a key
    /// being made in one now keeps it (its count is past one) or, made from it just
    /// before, keeps a copy the table no longer names. Keys compare by value, so that is
    /// only a second copy.
    pub fn reclaim(&self) {
        let keys = self.len();
        if keys > self.keys_high.load(Ordering::Relaxed) {
            self.keys_high.store(keys, Ordering::Relaxed);
            let guard = self.slots.guard();
            // An iterator needs the whole table in one place: making one finishes a copy
            // left half done.
            let _ = self.slots.iter(&guard);
        }
        self.slots.guard().flush();
        self.scopes
            .pin()
            .retain(|scope| Arc::strong_count(scope) > 1);
    }

    /// Calls `f` with every key held and its own lane, as read at that moment.
    pub fn for_each_own(&self, mut f: impl FnMut(&Key, Lane)) {
        let guard = self.slots.guard();
        for (key, slot) in self.slots.iter(&guard) {
            f(&key.to_key(), slot.own());
        }
    }

    /// Completes once a key has been queued for collection since this last completed (at
    /// once if one was). A key queued after it completes makes the next call complete; so a
    /// collector that waits on this, then calls [`LaneStore::collect`], leaves no key
    /// behind, and sleeps while nothing is written. It may complete for keys a collection
    /// already took. Meant for one collector: a second would take the other's wake-ups.
    pub async fn queued(&self) {
        self.queued.notified().await;
    }

    /// Notes that a write was made at `at` (monotonic, on the clock of whoever collects),
    /// after it counted. Only the first since the last collection is kept, so a writer
    /// calls this after every write for the cost of one load: then
    /// [`LaneStore::first_written`] says how long the writes not yet collected have
    /// waited, which the gossip must not vouch for before it holds them
    /// (`Driver::pending_since`). Exact with one writing thread, as in `tallyd`. With
    /// several, a writer that notes after another may find that note kept though its own
    /// write was made first (later than its write by as long as the two were apart), or a
    /// note may outlive the write a collection took (earlier than needed).
    pub fn note_written(&self, at: Duration) {
        let at = u64::try_from(at.as_nanos()).unwrap_or(NOT_WRITTEN - 1);
        if self.first_written.load(Ordering::Relaxed) == NOT_WRITTEN {
            self.first_written.fetch_min(at, Ordering::Relaxed);
        }
    }

    /// When the first write noted since the last collection was made, if one was
    /// ([`LaneStore::note_written`]). A writer that notes nothing queues keys all the same.
    pub fn first_written(&self) -> Option<Duration> {
        let at = self.first_written.load(Ordering::Relaxed);
        (at != NOT_WRITTEN).then(|| Duration::from_nanos(at))
    }

    /// Whether a key is queued for collection now: [`LaneStore::queued`] may complete for
    /// keys a collection already took.
    pub fn has_queued(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// How many keys the store holds, counting keys being created at this moment.
    pub fn len(&self) -> usize {
        self.keys.load(Ordering::Relaxed)
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn write(
        &self,
        key: KeyRef<'_>,
        amount: u64,
        add: fn(&Slot, u64) -> Result<Written, Overflow>,
    ) -> Result<Counted, StoreError> {
        let guard = self.slots.guard();
        loop {
            let (held, slot) = self.slot_or_insert(key, &guard)?;
            match add(slot, amount)? {
                Written::Counted {
                    lane,
                    remote,
                    queue,
                } => {
                    if queue {
                        self.dirty.push(held.clone());
                        self.queued.notify_one();
                    }
                    // The remote sum as the write found it, so the estimate includes this
                    // write and every remote merge published before it. A slot removed
                    // since, with an outsized sum, leaves the key's current estimate.
                    let estimate = match remote {
                        Remote::Inline(remote) => lane.value() + i128::from(remote),
                        Remote::Outsized => self.estimate_outsized(key, slot, lane),
                    };
                    return Ok(Counted {
                        own: lane,
                        estimate,
                    });
                }
                Written::Retired => {
                    // `remove` retired this slot after our lookup and is taking it out of
                    // the map. Finish that for it, so this write never waits on the
                    // remover, then count in the key's next slot.
                    self.unlink(&key, |current| std::ptr::eq(current, slot), &guard);
                }
            }
        }
    }

    /// A write's estimate when the remote sum it found is in the `Outsized` table: `lane`
    /// plus that sum, or, if the slot was removed since, the key's estimate now.
    #[cold]
    fn estimate_outsized(&self, key: KeyRef<'_>, slot: &Slot, lane: Lane) -> i128 {
        match self.outsized.sum(slot, Remote::Outsized) {
            Some(remote) => lane.value() + remote,
            None => self.estimate(key),
        }
    }

    /// The key as the map holds it, and its slot. A new key is built and inserted first, if
    /// there is room: the only allocation of a write.
    fn slot_or_insert<'g>(
        &self,
        key: KeyRef<'_>,
        guard: &'g impl Guard,
    ) -> Result<(&'g HeldKey, &'g Slot), StoreError> {
        loop {
            if let Some(held) = self.slots.get_key_value(&key, guard) {
                return Ok(held);
            }
            let keys_max = self.keys_max;
            let reserved = self
                .keys
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |keys| {
                    (keys < keys_max).then_some(keys + 1)
                });
            if reserved.is_err() {
                // Another thread may have created the key since our lookup: then it is not new.
                return self
                    .slots
                    .get_key_value(&key, guard)
                    .ok_or(StoreError::KeysFull { keys_max });
            }
            let held = HeldKey::new(&key, self.scope(&key));
            if self.slots.try_insert(held, Slot::new(), guard).is_err() {
                // Another thread created it meanwhile.
                self.keys.fetch_sub(1, Ordering::Relaxed);
            } else {
                // Once it is in the map: an `expire` walking it now sees it or its bound.
                let until = key.window().live_until_unix_secs();
                self.ends_from.fetch_min(until, Ordering::AcqRel);
            }
            // Held now, unless a `remove` took it again meanwhile: then the next turn
            // creates it anew.
        }
    }

    /// The scope `key` is in, as held: the one the table holds, or a new one, added.
    fn scope(&self, key: &KeyRef<'_>) -> Arc<Scope> {
        let scopes = self.scopes.pin();
        let wanted = ScopeRef::of(key);
        if let Some(scope) = scopes.get(&wanted) {
            return Arc::clone(scope);
        }
        let scope = wanted.to_scope();
        scopes.insert(Arc::clone(&scope));
        scope
    }

    /// Removes the key's slot if `which` says so, and gives its place back to `keys`.
    fn unlink<Q>(&self, key: &Q, mut which: impl FnMut(&Slot) -> bool, guard: &impl Guard) -> bool
    where
        Q: Hash + Equivalent<HeldKey> + ?Sized,
    {
        let Ok(Some((_, slot))) = self.slots.remove_if(key, |_, slot| which(slot), guard) else {
            return false;
        };
        self.outsized.forget(slot);
        self.keys.fetch_sub(1, Ordering::Relaxed);
        true
    }
}

impl fmt::Debug for LaneStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaneStore")
            .field("replica", &self.replica)
            .field("keys", &self.len())
            .field("keys_max", &self.keys_max)
            .field("queued", &self.dirty.len())
            .finish()
    }
}

/// The hasher of the store's map and of the node's rule table: foldhash, keyed from the
/// OS's randomness.
///
/// Subjects come from clients, so the hasher must resist chosen collisions: its seeds are
/// secret and differ between processes (the shared seed) and between maps (the per-map
/// seed), both drawn through std's `RandomState`, whose keys come from the OS. foldhash
/// costs a few nanoseconds per key where SipHash cost tens; its resistance is weaker
/// (it does not claim to hold against an attacker who studies a long-running process to
/// recover its seeds), and the map never holds more than `keys_max` keys either way.
#[derive(Clone, Debug)]
pub struct KeyHasher(SeedableRandomState);

impl KeyHasher {
    /// A hasher with fresh per-map seeds, under this process's shared seeds.
    pub fn new() -> KeyHasher {
        static SHARED: OnceLock<SharedSeed> = OnceLock::new();
        let os = RandomState::new();
        let shared = SHARED.get_or_init(|| SharedSeed::from_u64(os.hash_one("shared")));
        KeyHasher(SeedableRandomState::with_seed(os.hash_one("map"), shared))
    }
}

impl Default for KeyHasher {
    fn default() -> KeyHasher {
        KeyHasher::new()
    }
}

impl BuildHasher for KeyHasher {
    type Hasher = FoldHasher<'static>;

    fn build_hasher(&self) -> FoldHasher<'static> {
        self.0.build_hasher()
    }
}

/// One key's own lane, remote sum and collection state: the part of the store that the
/// loom models check, so every atomic the protocol relies on lives here (with
/// [`Outsized`], for remote sums too large for the slot).
///
/// 24 bytes with std's atomics, one exact allocation of 40 together with its key (a
/// 16-byte `HeldKey`) in the map: the memory budget is 64 bytes per key, papaya's table
/// included.
#[derive(Debug)]
struct Slot {
    // Invariant: the totals only grow, by checked adds, so a lane never wraps. The one
    // exception is a write taken back from a retired slot, whose totals nobody collects.
    incr: AtomicU64,
    decr: AtomicU64,
    // The collection state in the low two bits and the remote sum in the other 62, one
    // word, so that a read of either is one load and a slot fits the budget. The sum is
    // two's complement, or `OUTSIZED`: beyond what 62 bits hold, and kept in the store's
    // `Outsized` table. DIRTY: written since last taken; the key is queued, or about to be
    // by the writer that set it, or being collected. RETIRED: removed from the map, never
    // cleared. Invariant: a slot is retired only while clean; a write that lands after
    // sets DIRTY beside RETIRED and takes its add back, and nothing collects it.
    word: AtomicU64,
}

const DIRTY: u64 = 1;
const RETIRED: u64 = 2;
const STATE: u64 = DIRTY | RETIRED;
/// The remote-sum bits that say the sum is in the [`Outsized`] table: the one 62-bit value
/// an inline sum never takes, -2^61.
const OUTSIZED: u64 = 1 << 63;

// The memory budget per key is tight and the map holds a slot per key; a new field
// should be a decision, not an accident. Loom's atomics are larger, so only std's count.
#[cfg(not(tally_loom))]
const _: () = assert!(std::mem::size_of::<Slot>() == 24, "Slot grew past 24 bytes");

/// A remote sum as a slot's word holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Remote {
    /// The sum itself, within [`Remote::INLINE_MAX`] of zero.
    Inline(i64),
    /// Farther from zero: the sum is in the store's [`Outsized`] table.
    Outsized,
}

impl Remote {
    /// The largest sum, either side of zero, that a slot holds itself.
    const INLINE_MAX: i64 = (1 << 61) - 1;

    fn of(sum: i128) -> Remote {
        match i64::try_from(sum) {
            Ok(sum) if (-Remote::INLINE_MAX..=Remote::INLINE_MAX).contains(&sum) => {
                Remote::Inline(sum)
            }
            _ => Remote::Outsized,
        }
    }

    /// The word's bits for this sum, its state bits clear.
    fn bits(self) -> u64 {
        match self {
            // Within ±(2^61 - 1): the shift keeps the sign, and never gives `OUTSIZED`.
            Remote::Inline(sum) => (sum << 2) as u64,
            Remote::Outsized => OUTSIZED,
        }
    }

    fn in_word(word: u64) -> Remote {
        match word & !STATE {
            OUTSIZED => Remote::Outsized,
            bits => Remote::Inline((bits as i64) >> 2),
        }
    }
}

/// What a write did to a slot.
#[derive(Debug)]
enum Written {
    /// The write counted; `lane` is the own lane just after it, `remote` the remote sum
    /// at that moment. `queue`: the slot was clean, so this writer must queue the key.
    Counted {
        lane: Lane,
        remote: Remote,
        queue: bool,
    },
    /// The slot was retired before the write landed. The write was taken back; count it
    /// in the key's next slot.
    Retired,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            incr: AtomicU64::new(0),
            decr: AtomicU64::new(0),
            word: AtomicU64::new(0),
        }
    }

    fn incr(&self, amount: u64) -> Result<Written, Overflow> {
        self.add(&self.incr, "incr", amount)
    }

    fn decr(&self, amount: u64) -> Result<Written, Overflow> {
        self.add(&self.decr, "decr", amount)
    }

    fn add(
        &self,
        total: &AtomicU64,
        field: &'static str,
        amount: u64,
    ) -> Result<Written, Overflow> {
        // Release: a reader that sees this add in the decrements (read first, `Acquire`)
        // sees every earlier add in the increments too (`Slot::own`). The `Release` on
        // `word` just below is what hands this add to the collector.
        total
            .fetch_update(Ordering::Release, Ordering::Relaxed, |total| {
                total.checked_add(amount)
            })
            .map_err(|total| Overflow {
                field,
                total,
                amount,
            })?;
        // After the add, never before: a collector that clears the flag after this sets it
        // must see the add (see the module doc). The word it returns holds the remote sum
        // as of this write.
        let word = self.word.fetch_or(DIRTY, Ordering::Release);
        if word & RETIRED != 0 {
            total.fetch_sub(amount, Ordering::Relaxed);
            return Ok(Written::Retired);
        }
        Ok(Written::Counted {
            lane: self.own(),
            remote: Remote::in_word(word),
            queue: word & DIRTY == 0,
        })
    }

    fn own(&self) -> Lane {
        // Decrements first: see `LaneStore::own`.
        let decr = self.decr.load(Ordering::Acquire);
        Lane::new(self.incr.load(Ordering::Relaxed), decr)
    }

    /// Clears the dirty flag, then reads the totals: the collector's half of the protocol.
    /// Called only by the collector that popped the slot's key.
    fn take(&self) -> Lane {
        // Acquire: every write whose `Release` set the flag before this clear is visible to
        // the reads below. Writes after it find the flag clear and queue the key again.
        self.word.fetch_and(!DIRTY, Ordering::Acquire);
        self.own()
    }

    /// Marks the slot removed if it is clean; returns whether it is retired now. Stays true
    /// once true, because the map may ask again while it completes the removal.
    fn retire(&self) -> bool {
        // Relaxed: the decision reads only the state; a write that lands after this finds
        // RETIRED in its own read-modify-write of the word and takes itself back.
        let retired = self
            .word
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                (word & STATE == 0).then_some(word | RETIRED)
            });
        match retired {
            Ok(_) => true,
            Err(word) => word & RETIRED != 0,
        }
    }

    /// Sets the remote sum's bits, keeping the state; returns the word before.
    fn publish(&self, remote: Remote) -> u64 {
        // Release, paired with `remote`'s Acquire. A reader that sees `OUTSIZED` finds the
        // entry because it takes the table's lock after the publisher let go of it.
        self.word
            .fetch_update(Ordering::Release, Ordering::Relaxed, |word| {
                Some(remote.bits() | (word & STATE))
            })
            .unwrap_or_else(|word| word)
    }

    fn remote(&self) -> Remote {
        // Acquire, as `publish`'s Release: not what makes an `Outsized` entry visible (its
        // lock does), but a reader then sees what the publisher did before publishing.
        Remote::in_word(self.word.load(Ordering::Acquire))
    }
}

/// The remote sums too large for their slots, by slot. Rare: a sum past ±(2^61 - 1) takes
/// that many counts in one window. Behind one lock, taken only for those sums (and by the
/// removal of a slot that holds one).
///
/// Keyed by the slot's address: papaya frees a removed slot only once no guard can reach
/// it, and its entry is gone before then ([`Outsized::forget`]), so an address names one
/// slot for as long as an entry can be found under it.
///
/// Invariant, under the lock: a slot whose word says `OUTSIZED` has an entry, unless the
/// slot is retired. A word is made `OUTSIZED` only under the lock, after its entry is
/// written; an entry is removed only under the lock, while its slot's word does not say
/// `OUTSIZED`, or once its slot is retired.
#[derive(Debug, Default)]
struct Outsized {
    sums: Mutex<HashMap<usize, i128>>,
}

impl Outsized {
    /// Sets `slot`'s remote sum. Concurrent publishes to one slot are safe: the sum is the
    /// last one's.
    fn publish(&self, slot: &Slot, sum: i128) {
        match Remote::of(sum) {
            inline @ Remote::Inline(_) => {
                // Without the lock: most sums are small. A sum that was outsized leaves an
                // entry to remove, unless another publish made it outsized again meanwhile.
                if Remote::in_word(slot.publish(inline)) == Remote::Outsized {
                    let mut sums = self.lock();
                    if slot.remote() != Remote::Outsized {
                        sums.remove(&address(slot));
                    }
                }
            }
            Remote::Outsized => {
                let mut sums = self.lock();
                sums.insert(address(slot), sum);
                if slot.publish(Remote::Outsized) & RETIRED != 0 {
                    // Removed from the map meanwhile: `forget` may have come and gone.
                    sums.remove(&address(slot));
                }
            }
        }
    }

    /// `slot`'s remote sum, or `None` if the slot is retired and its sum in this table was
    /// dropped (finish its removal, and look the key up again).
    fn remote(&self, slot: &Slot) -> Option<i128> {
        self.sum(slot, slot.remote())
    }

    /// The sum that `remote`, read from `slot`'s word, stands for; `None` as for
    /// [`Outsized::remote`].
    fn sum(&self, slot: &Slot, remote: Remote) -> Option<i128> {
        if let Remote::Inline(sum) = remote {
            return Some(i128::from(sum));
        }
        let sums = self.lock();
        if let Some(sum) = sums.get(&address(slot)) {
            return Some(*sum);
        }
        // No entry: under the lock that means the word says `OUTSIZED` no more, or the slot
        // is retired.
        match slot.remote() {
            Remote::Inline(sum) => Some(i128::from(sum)),
            Remote::Outsized => None,
        }
    }

    /// Drops `slot`'s entry: call once it is retired and out of the map.
    fn forget(&self, slot: &Slot) {
        // A word that is not `OUTSIZED` leaves no entry to this: the publish that made it
        // so drops the entry under the lock, and one that makes it `OUTSIZED` from now on
        // sees RETIRED and drops its own. So most removals take no lock.
        if slot.remote() == Remote::Outsized {
            self.lock().remove(&address(slot));
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<usize, i128>> {
        // Every critical section leaves the table whole: a panic in one loses nothing.
        self.sums
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A slot's identity while it is reachable: see [`Outsized`].
fn address(slot: &Slot) -> usize {
    std::ptr::from_ref(slot) as usize
}

#[cfg(test)]
#[cfg(not(tally_loom))]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::future::Future;
    use std::sync::Arc;
    use tally_crdt::{Generation, NodeId, Rule, Subject, Window};

    fn store(keys_max: usize) -> LaneStore {
        LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), keys_max)
    }

    fn key(subject: &str) -> Key {
        key_in(subject, Window::new(1, 60).unwrap())
    }

    fn key_in(subject: &str, window: Window) -> Key {
        Key::new(
            Rule::new("login").unwrap(),
            Subject::new(subject).unwrap(),
            window,
        )
    }

    fn collected(store: &LaneStore) -> Vec<(Key, Lane)> {
        let mut out = Vec::new();
        store.collect(&mut out);
        out
    }

    /// Whether a fresh `queued()` completes at its first poll.
    fn wakes(store: &LaneStore) -> bool {
        let queued = std::pin::pin!(store.queued());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        queued.poll(&mut cx).is_ready()
    }

    #[test]
    fn a_key_queued_wakes_the_collector_once_and_a_write_to_a_queued_key_does_not() {
        let store = store(8);
        let (a, b, c) = (key("a"), key("b"), key("c"));
        assert!(!wakes(&store), "nothing written, nothing to wake for");

        store.incr(&a, 1).unwrap();
        assert!(wakes(&store), "the write queued `a`");
        assert!(!wakes(&store), "one wake-up per queued key, taken");
        store.incr(&a, 1).unwrap();
        assert!(
            !wakes(&store),
            "`a` was queued already: nothing new to collect"
        );

        assert_eq!(collected(&store), vec![(a.clone(), Lane::new(2, 0))]);
        store.decr(&a, 1).unwrap();
        assert!(
            wakes(&store),
            "collected, `a` is queued again by its next write"
        );

        store.incr(&b, 1).unwrap();
        store.incr(&c, 1).unwrap();
        assert!(
            wakes(&store),
            "two keys queued while no collector waited: one wake-up"
        );
        assert!(!wakes(&store));
        assert_eq!(
            collected(&store).len(),
            3,
            "the wake-up's collection takes all three"
        );
    }

    #[test]
    fn the_first_write_noted_since_a_collection_is_the_one_kept() {
        let store = store(8);
        let ms = Duration::from_millis;
        assert_eq!(store.first_written(), None);
        store.incr(&key("a"), 1).unwrap();
        store.note_written(ms(5));
        store.incr(&key("b"), 1).unwrap();
        store.note_written(ms(9));
        assert_eq!(
            store.first_written(),
            Some(ms(5)),
            "the first write has waited longest"
        );
        assert_eq!(collected(&store).len(), 2);
        assert_eq!(
            store.first_written(),
            None,
            "the collection took the writes, and their note"
        );
        store.incr(&key("a"), 1).unwrap();
        store.note_written(ms(12));
        assert_eq!(store.first_written(), Some(ms(12)));
    }

    #[test]
    fn a_collector_waiting_for_a_key_is_woken_by_the_write_that_queues_it() {
        struct Count(AtomicUsize);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let store = store(8);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = std::task::Waker::from(count.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        let mut queued = std::pin::pin!(store.queued());
        assert!(queued.as_mut().poll(&mut cx).is_pending());

        store.incr(&key("a"), 1).unwrap();
        assert_eq!(
            count.0.load(Ordering::Relaxed),
            1,
            "the waiting collector was woken"
        );
        assert!(queued.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn a_collector_woken_only_by_queued_keys_misses_no_write() {
        let (store, writers) = spawn_writers(3, 20_000, 10);
        // The collector never collects but when woken: a lost wake-up leaves a write behind
        // with nothing to wake it, and the wait below times out.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let lanes = runtime.block_on(async {
            let mut lanes: HashMap<Key, Lane> = HashMap::new();
            while lanes.len() < writers.keys || lanes.values().any(|lane| *lane != writers.lane) {
                tokio::time::timeout(std::time::Duration::from_secs(10), store.queued())
                    .await
                    .expect("writes are left uncollected and no wake-up came for them");
                lanes.extend(collected(&store));
            }
            lanes
        });
        writers.join();
        assert_eq!(lanes.len(), 10);
        // A write racing the last collection may have queued its key again, already
        // collected: what is left is at most those keys, at the same totals.
        for (key, lane) in collected(&store) {
            assert_eq!(lane, lanes[&key], "{key} was collected whole");
        }
    }

    #[test]
    fn the_store_is_shared_across_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<LaneStore>();
    }

    #[test]
    fn overflowing_increment_is_refused_and_counts_nothing() {
        let store = store(8);
        let a = key("a");
        assert_eq!(
            store.incr(&a, u64::MAX - 1).map(|c| c.own),
            Ok(Lane::new(u64::MAX - 1, 0))
        );
        let err = store.incr(&a, 2).unwrap_err();
        assert_eq!(
            err,
            StoreError::Overflow(Overflow {
                field: "incr",
                total: u64::MAX - 1,
                amount: 2
            })
        );
        assert!(err
            .to_string()
            .contains("incr total 18446744073709551614 cannot take 2"));
        assert_eq!(
            store.decr(&a, u64::MAX),
            Ok(Counted {
                own: Lane::new(u64::MAX - 1, u64::MAX),
                estimate: -1
            })
        );
        assert!(matches!(
            store.decr(&a, 1),
            Err(StoreError::Overflow(Overflow { field: "decr", .. }))
        ));
        assert_eq!(store.own(&a), Lane::new(u64::MAX - 1, u64::MAX));
        assert_eq!(
            collected(&store),
            vec![(a, Lane::new(u64::MAX - 1, u64::MAX))]
        );
    }

    #[test]
    fn a_key_written_by_its_borrowed_parts_is_the_key_held() {
        let store = store(8);
        let a = key("a");
        let rule = Rule::new("login").unwrap();
        let borrowed = KeyRef::new(&rule, "a", a.window).unwrap();
        store.incr(borrowed, 2).unwrap();
        store.incr(&a, 3).unwrap();
        store.decr(borrowed, 1).unwrap();
        assert_eq!(store.len(), 1, "one key, whichever way it is named");
        assert_eq!(store.own(borrowed), Lane::new(5, 1));
        assert_eq!(store.estimate(&a), 4);
        assert_eq!(collected(&store), vec![(a, Lane::new(5, 1))]);
    }

    #[test]
    fn keys_past_the_cap_are_refused() {
        let store = store(2);
        let (a, b, c) = (key("a"), key("b"), key("c"));
        store.incr(&a, 1).unwrap();
        store.publish_remote(&b, 5).unwrap();
        let full = StoreError::KeysFull { keys_max: 2 };
        assert_eq!(store.incr(&c, 1), Err(full));
        assert_eq!(store.decr(&c, 1), Err(full));
        assert_eq!(store.publish_remote(&c, 1), Err(full));
        assert_eq!(
            full.to_string(),
            "keys: the store holds its maximum of 2 keys; nothing counted"
        );
        assert_eq!(
            (store.len(), store.own(&c), store.estimate(&c)),
            (2, Lane::default(), 0)
        );
        assert_eq!(
            store.incr(&a, 1).map(|c| c.own),
            Ok(Lane::new(2, 0)),
            "a held key still counts at the cap"
        );

        collected(&store);
        assert!(store.remove(&a));
        assert_eq!(
            store.incr(&c, 1).map(|c| c.own),
            Ok(Lane::new(1, 0)),
            "a removal frees a place"
        );
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn collect_returns_each_changed_lane_once() {
        let store = store(8);
        let (a, b, c) = (key("a"), key("b"), key("c"));
        store.incr(&a, 1).unwrap();
        store.incr(&b, 2).unwrap();
        store.decr(&a, 3).unwrap();
        store.incr(&a, 4).unwrap();
        store.publish_remote(&c, 9).unwrap();
        assert_eq!(
            collected(&store),
            vec![(a.clone(), Lane::new(5, 3)), (b, Lane::new(2, 0))],
            "in the order the keys first changed; a remote sum is not an own lane"
        );
        assert_eq!(collected(&store), vec![]);
        store.decr(&a, 1).unwrap();
        assert_eq!(collected(&store), vec![(a, Lane::new(5, 4))]);
    }

    #[test]
    fn estimate_is_own_plus_published_remote() {
        let store = store(8);
        let a = key("a");
        assert_eq!(store.estimate(&a), 0);
        store.incr(&a, 5).unwrap();
        store.decr(&a, 2).unwrap();
        assert_eq!(store.estimate(&a), 3);
        store.publish_remote(&a, -10).unwrap();
        assert_eq!(store.estimate(&a), -7);
        assert_eq!(
            store.incr(&a, 1).map(|c| c.estimate),
            Ok(-6),
            "a write returns the estimate it leaves"
        );
        store.decr(&a, 1).unwrap();
        let beyond_u64 = 3 * i128::from(u64::MAX);
        store.publish_remote(&a, beyond_u64).unwrap();
        assert_eq!(
            store.estimate(&a),
            beyond_u64 + 3,
            "the remote sum is exact in i128"
        );

        let b = key("b");
        store.publish_remote(&b, 7).unwrap();
        assert_eq!(
            (store.estimate(&b), store.own(&b), store.len()),
            (7, Lane::default(), 2)
        );
    }

    #[test]
    fn remote_sums_round_trip_through_the_word_or_go_to_the_table() {
        let max = Remote::INLINE_MAX;
        for sum in [0, 1, -1, 5, -5, max, -max] {
            let remote = Remote::of(i128::from(sum));
            assert_eq!(remote, Remote::Inline(sum));
            for state in [0, DIRTY, RETIRED, STATE] {
                assert_eq!(Remote::in_word(remote.bits() | state), remote, "{sum}");
                assert_eq!(remote.bits() & STATE, 0);
            }
        }
        let max = i128::from(max);
        for sum in [
            max + 1,
            -max - 1,
            i128::from(u64::MAX),
            i128::MIN,
            i128::MAX,
        ] {
            assert_eq!(Remote::of(sum), Remote::Outsized, "{sum}");
        }
        assert_eq!(Remote::in_word(OUTSIZED | DIRTY), Remote::Outsized);
    }

    #[test]
    fn outsized_remote_sums_are_exact_and_leave_no_entry_behind() {
        let store = store(8);
        let (a, b) = (key("a"), key("b"));
        let entries = |store: &LaneStore| store.outsized.lock().len();
        let huge = i128::from(u64::MAX) * 5;
        store.incr(&a, 2).unwrap();
        store.publish_remote(&a, huge).unwrap();
        store.publish_remote(&b, -huge).unwrap();
        assert_eq!(entries(&store), 2);
        assert_eq!(store.estimate(&a), huge + 2);
        assert_eq!(store.estimate(&b), -huge);
        assert_eq!(
            store.incr(&a, 1).map(|c| c.estimate),
            Ok(huge + 3),
            "a write's estimate"
        );
        store.publish_remote(&a, huge + 1).unwrap();
        assert_eq!(store.estimate(&a), huge + 4);
        assert_eq!(entries(&store), 2, "a new outsized sum replaces the entry");

        // Back within a slot: the entry goes.
        store.publish_remote(&a, 7).unwrap();
        assert_eq!(store.estimate(&a), 10);
        assert_eq!(entries(&store), 1);
        // Removed with an outsized sum: the entry goes with the slot.
        assert!(store.remove(&b));
        assert_eq!(entries(&store), 0);
        assert_eq!(store.estimate(&b), 0);
    }

    #[test]
    fn a_key_with_uncollected_writes_is_not_removed() {
        let store = store(8);
        let a = key("a");
        assert!(!store.remove(&a), "absent");
        store.incr(&a, 1).unwrap();
        assert!(!store.remove(&a), "written and not yet collected");
        assert_eq!(collected(&store), vec![(a.clone(), Lane::new(1, 0))]);
        assert!(store.remove(&a));
        assert_eq!((store.len(), store.own(&a)), (0, Lane::default()));
        assert!(store.is_empty());
    }

    #[test]
    fn expire_drops_finished_windows_once_collected() {
        let store = store(8);
        let old = key_in("a", Window::new(0, 60).unwrap());
        let current = key_in("a", Window::new(1, 60).unwrap());
        store.incr(&old, 1).unwrap();
        store.incr(&current, 1).unwrap();
        // Window 0 is live until 120 s: one length past its end, for sliding windows.
        assert_eq!(store.expire(119), 0);
        assert_eq!(
            store.expire(120),
            0,
            "the old window's write is not collected yet"
        );
        assert_eq!(store.scopes.len(), 2, "one scope a window");
        collected(&store);
        assert_eq!(store.expire(120), 1);
        assert_eq!(
            (store.len(), store.own(&old), store.own(&current)),
            (1, Lane::default(), Lane::new(1, 0))
        );
        store.reclaim();
        let held: Vec<_> = store.scopes.pin().iter().map(Arc::clone).collect();
        let current_scope = ScopeRef::of(&KeyRef::from(&current)).to_scope();
        assert_eq!(
            held,
            [current_scope],
            "the old window's scope is dropped once its key is freed"
        );
    }

    #[test]
    fn keys_of_one_scope_share_it() {
        let store = store(8);
        for subject in ["a", "b", "c"] {
            store.incr(&key(subject), 1).unwrap();
        }
        assert_eq!(store.scopes.len(), 1);
        collected(&store);
        let scopes = store.scopes.pin();
        let scope = scopes.iter().next().unwrap();
        assert_eq!(Arc::strong_count(scope), 4, "the table and the three keys");
    }

    #[test]
    fn expire_misses_no_window_that_ends_before_those_it_walked_last() {
        let store = store(8);
        let later = key_in("a", Window::new(5, 60).unwrap());
        store.incr(&later, 1).unwrap();
        collected(&store);
        // Walked at 200: nothing over; the next window to end is `later`'s, at 420.
        assert_eq!(store.expire(200), 0);
        // A key inserted since ends before that, at 240 (say the clock stepped back).
        let earlier = key_in("b", Window::new(2, 60).unwrap());
        store.incr(&earlier, 1).unwrap();
        collected(&store);
        assert_eq!(store.expire(239), 0);
        assert_eq!(store.expire(240), 1);
        assert_eq!(store.own(&earlier), Lane::default());
        // One written again at its end stays until collected, and the next call takes it.
        store.incr(&later, 1).unwrap();
        assert_eq!(store.expire(420), 0);
        collected(&store);
        assert_eq!(store.expire(421), 1);
        assert!(store.is_empty());
    }

    #[test]
    fn random_histories_of_writes_publishes_collections_and_expiries_read_back_as_a_model() {
        use proptest::prelude::RngExt;
        use proptest::test_runner::{RngAlgorithm, TestRng};
        // Seeded by the history's number, so a failing one replays.
        // Per key: own lane, remote sum, written since last collected.
        type Model = std::collections::BTreeMap<Key, (Lane, i128, bool)>;
        for seed in 0..60u64 {
            let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed as u8; 32]);
            let keys_max = [usize::MAX, 3, 30, 150][seed as usize % 4];
            let store = store(keys_max);
            let mut model = Model::new();
            let mut now = 1_000u64;
            let key_at = |rng: &mut TestRng, now: u64| {
                let len = [5u32, 10, 60][rng.random_range(0..3) as usize];
                let start = now.saturating_sub(rng.random_range(0..u64::from(len) * 3));
                key_in(
                    &format!("s{}", rng.random_range(0..200)),
                    Window::containing(start, len).unwrap(),
                )
            };
            for step in 0..800 {
                let context = format!("seed {seed} step {step}");
                match rng.random_range(0..12) {
                    0..=4 => {
                        let key = key_at(&mut rng, now);
                        let amount = match rng.random_range(0..6) {
                            0 => u64::MAX - rng.random_range(0..3),
                            1 => 1 << 62,
                            _ => rng.random_range(0..100),
                        };
                        let decr = rng.random_range(0..3) == 0;
                        let result = if decr {
                            store.decr(&key, amount)
                        } else {
                            store.incr(&key, amount)
                        };
                        let held = model.get(&key).copied();
                        if held.is_none() && model.len() >= keys_max {
                            assert_eq!(result, Err(StoreError::KeysFull { keys_max }), "{context}");
                            continue;
                        }
                        let (mut lane, remote, dirty) = held.unwrap_or_default();
                        let added = if decr {
                            lane.decr(amount)
                        } else {
                            lane.incr(amount)
                        };
                        match added {
                            Ok(()) => {
                                let counted = result.expect(&context);
                                assert_eq!(counted.own, lane, "{context}");
                                assert_eq!(counted.estimate, lane.value() + remote, "{context}");
                                model.insert(key, (lane, remote, true));
                            }
                            Err(_) => {
                                assert!(
                                    matches!(result, Err(StoreError::Overflow(_))),
                                    "{context}: {result:?}"
                                );
                                model.insert(key, (lane, remote, dirty));
                            }
                        }
                    }
                    5..=6 => {
                        let key = key_at(&mut rng, now);
                        let remote = match rng.random_range(0..5) {
                            0 => i128::from(i64::MAX) * i128::from(rng.random_range(0..3)) + 5,
                            1 => -(1i128 << 61) + i128::from(rng.random_range(0..3)),
                            2 => (1i128 << 61) - i128::from(rng.random_range(0..3)),
                            _ => i128::from(rng.random_range(0..1_000)) - 500,
                        };
                        let result = store.publish_remote(&key, remote);
                        if !model.contains_key(&key) && model.len() >= keys_max {
                            assert_eq!(result, Err(StoreError::KeysFull { keys_max }), "{context}");
                            continue;
                        }
                        result.expect(&context);
                        model.entry(key).or_default().1 = remote;
                    }
                    7 => {
                        let mut out = collected(&store);
                        out.sort_by(|a, b| a.0.cmp(&b.0));
                        let expected: Vec<(Key, Lane)> = (model.iter_mut())
                            .filter(|(_, held)| held.2)
                            .map(|(key, held)| {
                                held.2 = false;
                                (key.clone(), held.0)
                            })
                            .collect();
                        assert_eq!(out, expected, "{context}: collected");
                    }
                    8 => {
                        let key = key_at(&mut rng, now);
                        let removable = model.get(&key).is_some_and(|held| !held.2);
                        assert_eq!(store.remove(&key), removable, "{context}: remove");
                        if removable {
                            model.remove(&key);
                        }
                    }
                    9 => {
                        now += rng.random_range(0..15);
                        let before = model.len();
                        model.retain(|key, held| held.2 || key.window.is_live(now));
                        assert_eq!(store.expire(now), before - model.len(), "{context}: expire");
                    }
                    10 => store.reclaim(),
                    _ => {}
                }
                assert_eq!(store.len(), model.len(), "{context}: len");
                for (key, (lane, remote, _)) in &model {
                    assert_eq!(store.own(key), *lane, "{context}: {key}");
                    assert_eq!(
                        store.estimate(key),
                        lane.value() + remote,
                        "{context}: {key}"
                    );
                }
                let mut held = Vec::new();
                store.for_each_own(|key, lane| held.push((key.clone(), lane)));
                held.sort_by(|a, b| a.0.cmp(&b.0));
                let expected: Vec<(Key, Lane)> = model
                    .iter()
                    .map(|(key, held)| (key.clone(), held.0))
                    .collect();
                assert_eq!(held, expected, "{context}: for_each_own");
            }
        }
    }

    /// What [`spawn_writers`] started.
    struct Writers {
        threads: Vec<std::thread::JoinHandle<()>>,
        /// How many keys they write.
        keys: usize,
        /// Every key's own lane once they are done.
        lane: Lane,
    }

    impl Writers {
        fn finished(&self) -> bool {
            self.threads
                .iter()
                .all(std::thread::JoinHandle::is_finished)
        }

        fn join(self) {
            self.threads
                .into_iter()
                .for_each(|writer| writer.join().unwrap());
        }
    }

    /// `threads` threads each making `writes` writes over `keys` keys of a new store, every
    /// key as often; the last thread decrements, the others increment.
    fn spawn_writers(threads: u64, writes: u64, keys: u64) -> (Arc<LaneStore>, Writers) {
        // Room for every key plus one creation in flight per thread, so that no creation is
        // refused for racing another near the cap.
        let store = Arc::new(store((keys + threads) as usize));
        let names: Arc<Vec<Key>> = Arc::new((0..keys).map(|k| key(&format!("user-{k}"))).collect());
        let handles = (0..threads)
            .map(|thread| {
                let (store, names) = (store.clone(), names.clone());
                std::thread::spawn(move || {
                    for write in 0..writes {
                        let key = &names[((write + thread * 7) % keys) as usize];
                        if thread == threads - 1 {
                            store.decr(key, 1).unwrap();
                        } else {
                            store.incr(key, 1).unwrap();
                        }
                    }
                })
            })
            .collect();
        let per_key = writes / keys;
        let writers = Writers {
            threads: handles,
            keys: keys as usize,
            lane: Lane::new((threads - 1) * per_key, per_key),
        };
        (store, writers)
    }

    #[test]
    fn concurrent_creations_across_growth_with_reclaims_lose_nothing() {
        let threads = 4u64;
        let keys = 30_000u64;
        let store = Arc::new(store(usize::MAX));
        let names: Arc<Vec<Key>> = Arc::new((0..keys).map(|k| key(&format!("user-{k}"))).collect());
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reclaimer = {
            let (store, done) = (store.clone(), done.clone());
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    store.reclaim();
                    std::thread::yield_now();
                }
            })
        };
        let handles: Vec<_> = (0..threads)
            .map(|thread| {
                let (store, names) = (store.clone(), names.clone());
                std::thread::spawn(move || {
                    for round in 0..3u64 {
                        for k in 0..keys {
                            let at = (k * 7 + thread * 1_013 + round * 17) % keys;
                            store.incr(&names[at as usize], 1).unwrap();
                        }
                    }
                })
            })
            .collect();
        let mut lanes: HashMap<Key, Lane> = HashMap::new();
        while !handles.iter().all(|h| h.is_finished()) {
            for (key, lane) in collected(&store) {
                lanes.insert(key, lane);
            }
            store.reclaim();
        }
        for handle in handles {
            handle.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        reclaimer.join().unwrap();
        for (key, lane) in collected(&store) {
            lanes.insert(key, lane);
        }
        assert_eq!(store.len(), keys as usize);
        assert_eq!(lanes.len(), keys as usize);
        for key in names.iter() {
            assert_eq!(store.own(key), Lane::new(threads * 3, 0), "{key}");
            assert_eq!(lanes[key], Lane::new(threads * 3, 0), "{key}");
        }
    }

    #[test]
    fn concurrent_writes_and_collections_lose_nothing() {
        // Both totals race collections: the last thread decrements.
        let (store, writers) = spawn_writers(4, 100_000, 100);

        let mut lanes: HashMap<Key, Lane> = HashMap::new();
        let mut record = |batch: Vec<(Key, Lane)>| {
            for (key, lane) in batch {
                let before = lanes.entry(key).or_default();
                assert!(
                    lane.covers(*before),
                    "collected lanes never go back: {lane:?} after {before:?}"
                );
                *before = lane;
            }
        };
        while !writers.finished() {
            record(collected(&store));
        }
        let (keys, expected) = (writers.keys, writers.lane);
        writers.join();
        record(collected(&store));

        assert_eq!(lanes.len(), keys);
        for (key, lane) in &lanes {
            assert_eq!(*lane, expected, "collected totals of {key}");
            assert_eq!(store.own(key), expected);
        }
        assert_eq!(collected(&store), vec![], "nothing is left queued");
    }
}

#[cfg(test)]
#[cfg(tally_loom)]
mod loom_models {
    //! Loom models of the slot protocol. They drive the real [`Slot`]; only the dirty queue
    //! is a stand-in (`SegQueue` is not loom-aware), used as `LaneStore` uses its queue.

    use super::*;
    use loom::sync::{Arc, Mutex};
    use loom::thread;
    use std::collections::VecDeque;

    /// One key as the store holds it: its slot, and a loom-aware queue for its key.
    struct OneKey {
        slot: Slot,
        queue: Mutex<VecDeque<()>>,
    }

    impl OneKey {
        fn new() -> OneKey {
            OneKey {
                slot: Slot::new(),
                queue: Mutex::new(VecDeque::new()),
            }
        }

        /// What `LaneStore::write` does with a slot's answer.
        fn write(&self, written: Result<Written, Overflow>) {
            match written.expect("the models' amounts never overflow") {
                Written::Counted { queue: true, .. } => self.queue.lock().unwrap().push_back(()),
                Written::Counted { queue: false, .. } => {}
                Written::Retired => panic!("no model retires this slot"),
            }
        }

        /// What `LaneStore::collect` does, with `take` as the collector under test.
        fn collect(&self, take: fn(&Slot) -> Lane, out: &mut Vec<Lane>) {
            loop {
                // Popped in its own statement, so the lock is not held across `take`.
                let popped = self.queue.lock().unwrap().pop_front();
                if popped.is_none() {
                    return;
                }
                out.push(take(&self.slot));
            }
        }
    }

    /// A model explored up to 5 preemptions per run: about 3 seconds for the two-writer
    /// model, where the unbounded search takes about 2.5 minutes on a 2-core machine. The
    /// negative controls' failures need 2. `LOOM_MAX_PREEMPTIONS` overrides the bound.
    fn bounded() -> loom::model::Builder {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound.get_or_insert(5);
        builder
    }

    /// How a writer adds `amount` to a slot's increments (`true`) or decrements: as built,
    /// or a negative control's broken writer.
    type Add = fn(&Slot, bool, u64) -> Result<Written, Overflow>;

    fn add_as_built(slot: &Slot, incr: bool, amount: u64) -> Result<Written, Overflow> {
        if incr {
            slot.incr(amount)
        } else {
            slot.decr(amount)
        }
    }

    /// Two writers (one writes twice) race a collection; a last collection runs after they
    /// join. Every collected lane covers the one before it, and the last one holds every
    /// write.
    fn check_no_write_is_lost(take: fn(&Slot) -> Lane) {
        check_no_write_is_lost_by(add_as_built, take);
    }

    /// [`check_no_write_is_lost`], the writers adding with `add`.
    fn check_no_write_is_lost_by(add: Add, take: fn(&Slot) -> Lane) {
        bounded().check(move || {
            let key = Arc::new(OneKey::new());
            let incrementer = {
                let key = key.clone();
                thread::spawn(move || {
                    key.write(add(&key.slot, true, 1));
                    key.write(add(&key.slot, true, 2));
                })
            };
            let decrementer = {
                let key = key.clone();
                thread::spawn(move || key.write(add(&key.slot, false, 4)))
            };
            let mut lanes = Vec::new();
            key.collect(take, &mut lanes);
            incrementer.join().unwrap();
            decrementer.join().unwrap();
            key.collect(take, &mut lanes);

            for pair in lanes.windows(2) {
                assert!(
                    pair[1].covers(pair[0]),
                    "collected lanes went back: {lanes:?}"
                );
            }
            assert_eq!(
                lanes.last(),
                Some(&Lane::new(3, 4)),
                "lost an increment: collected {lanes:?}"
            );
        });
    }

    #[test]
    fn two_writers_and_a_collector_lose_no_increment() {
        check_no_write_is_lost(Slot::take);
    }

    /// Negative control: reads the totals before clearing the flag. A write landing in
    /// between finds the flag still set, so it does not queue the key, and the clear then
    /// hides it from every later collection.
    #[test]
    #[should_panic(expected = "lost an increment")]
    fn a_collector_that_reads_before_clearing_loses_an_increment() {
        check_no_write_is_lost(|slot| {
            let lane = slot.own();
            slot.word.fetch_and(!DIRTY, Ordering::Acquire);
            lane
        });
    }

    /// Negative control: clears the flag with `Relaxed` instead of `Acquire`. A write that
    /// set the flag before the clear no longer happens-before the reads, which may then
    /// return the totals from before it.
    #[test]
    #[should_panic(expected = "lost an increment")]
    fn a_collector_that_clears_with_relaxed_loses_an_increment() {
        check_no_write_is_lost(|slot| {
            slot.word.fetch_and(!DIRTY, Ordering::Relaxed);
            slot.own()
        });
    }

    /// A writer's answer after it set the flag and got back `word`.
    fn counted(slot: &Slot, word: u64) -> Result<Written, Overflow> {
        Ok(Written::Counted {
            lane: slot.own(),
            remote: Remote::in_word(word),
            queue: word & DIRTY == 0,
        })
    }

    /// Negative control: a writer that sets the flag before it adds. A collector that
    /// clears the flag and reads the totals in between misses the add, and the writer,
    /// having found the flag set, does not queue the key again.
    #[test]
    #[should_panic(expected = "lost an increment")]
    fn a_writer_that_flags_before_it_adds_loses_an_increment() {
        check_no_write_is_lost_by(
            |slot, incr, amount| {
                let word = slot.word.fetch_or(DIRTY, Ordering::Release);
                let total = if incr { &slot.incr } else { &slot.decr };
                total.fetch_add(amount, Ordering::Relaxed);
                counted(slot, word)
            },
            Slot::take,
        );
    }

    /// Negative control: a writer that sets the flag with `Relaxed` instead of `Release`.
    /// A collector that clears the flag after it no longer sees the add before it, so it
    /// may read the totals from before the add, and the key is not queued again.
    #[test]
    #[should_panic(expected = "lost an increment")]
    fn a_writer_that_flags_with_relaxed_loses_an_increment() {
        check_no_write_is_lost_by(
            |slot, incr, amount| {
                let total = if incr { &slot.incr } else { &slot.decr };
                total.fetch_add(amount, Ordering::Relaxed);
                let word = slot.word.fetch_or(DIRTY, Ordering::Relaxed);
                counted(slot, word)
            },
            Slot::take,
        );
    }

    /// A sum too large for a slot, and one that fits: the publisher in
    /// `check_reads_follow_the_publishes` publishes the first, then the second.
    const BIG: i128 = (1 << 64) | 1;
    const SMALL: i128 = -5;

    /// How `Outsized::publish` is done, for the negative control's broken one.
    type Publish = fn(&Outsized, &Slot, i128);

    /// A writer and a publisher (of `BIG`, then `SMALL`) race a reader that reads twice:
    /// each read of the remote sum is one the publisher published, never missing while
    /// the slot is live; the second read is never of an earlier publish than the first;
    /// the own lane never goes back; and the table is empty once the sum fits again.
    fn check_reads_follow_the_publishes(publish: Publish) {
        bounded().check(move || {
            let slot = Arc::new(Slot::new());
            let outsized = Arc::new(Outsized::default());
            let writer = {
                let slot = slot.clone();
                thread::spawn(move || slot.incr(1).map(|_| ()))
            };
            let publisher = {
                let (slot, outsized) = (slot.clone(), outsized.clone());
                thread::spawn(move || {
                    publish(&outsized, &slot, BIG);
                    publish(&outsized, &slot, SMALL);
                })
            };
            let order = [0, BIG, SMALL];
            let read = || {
                let remote = outsized.remote(&slot).expect("a live slot's remote sum");
                let at = order.iter().position(|sum| *sum == remote);
                (
                    slot.own(),
                    at.unwrap_or_else(|| panic!("remote sum {remote} never published")),
                )
            };
            let (first, second) = (read(), read());
            assert!(
                second.0.covers(first.0),
                "own lane went back: {first:?} then {second:?}"
            );
            assert!(
                second.1 >= first.1,
                "remote sum went back: {first:?} then {second:?}"
            );
            writer.join().unwrap().unwrap();
            publisher.join().unwrap();
            assert_eq!(outsized.remote(&slot), Some(SMALL));
            assert!(outsized.lock().is_empty(), "an entry left behind");
            assert!(
                slot.word.load(Ordering::Relaxed) & DIRTY != 0,
                "a publish cleared the write's dirty flag"
            );
        });
    }

    #[test]
    fn a_reader_sees_each_remote_sum_as_published_and_in_order() {
        check_reads_follow_the_publishes(|outsized, slot, sum| outsized.publish(slot, sum));
    }

    /// Negative control: marks the word `OUTSIZED` before the table holds the sum. A
    /// reader in between finds neither.
    #[test]
    #[should_panic(expected = "a live slot's remote sum")]
    fn a_publish_that_marks_the_word_before_the_table_loses_a_read() {
        check_reads_follow_the_publishes(|outsized, slot, sum| match Remote::of(sum) {
            Remote::Outsized => {
                slot.publish(Remote::Outsized);
                outsized.lock().insert(address(slot), sum);
            }
            inline => {
                slot.publish(inline);
                outsized.lock().remove(&address(slot));
            }
        });
    }

    /// A write, a publisher and a collection race, and a last collection runs after: the
    /// publisher changes the word only by read-modify-writes, which keep the write's dirty
    /// flag and continue the release sequence the collection's clear synchronizes with, so
    /// no increment is lost.
    fn check_publish_racing_a_write(publish: Publish) {
        bounded().check(move || {
            let key = Arc::new(OneKey::new());
            let outsized = Arc::new(Outsized::default());
            let writer = {
                let key = key.clone();
                thread::spawn(move || {
                    key.write(key.slot.incr(1));
                    key.write(key.slot.incr(2));
                })
            };
            let publisher = {
                let (key, outsized) = (key.clone(), outsized.clone());
                thread::spawn(move || {
                    publish(&outsized, &key.slot, BIG);
                    publish(&outsized, &key.slot, SMALL);
                })
            };
            let mut lanes = Vec::new();
            key.collect(Slot::take, &mut lanes);
            writer.join().unwrap();
            publisher.join().unwrap();
            key.collect(Slot::take, &mut lanes);
            assert_eq!(
                lanes.last(),
                Some(&Lane::new(3, 0)),
                "lost an increment: collected {lanes:?}"
            );
        });
    }

    #[test]
    fn a_publish_racing_a_write_and_its_collection_loses_no_increment() {
        check_publish_racing_a_write(|outsized, slot, sum| outsized.publish(slot, sum));
    }

    /// Negative control: a publish that loads the word and stores it back with the new sum
    /// can put back a dirty flag the collection cleared in between; the next write then
    /// finds it set and does not queue its key.
    #[test]
    #[should_panic(expected = "lost an increment")]
    fn a_publish_by_a_load_and_a_store_loses_an_increment() {
        check_publish_racing_a_write(|_, slot, sum| {
            let word = slot.word.load(Ordering::Acquire);
            (slot.word).store(Remote::of(sum).bits() | (word & STATE), Ordering::Release);
        });
    }

    /// Two publishers of one slot, as `LaneStore::publish_remote` allows: the sum is the
    /// last one's, and the word and the table agree on it.
    fn check_concurrent_publishes(publish: Publish) {
        bounded().check(move || {
            let slot = Arc::new(Slot::new());
            let outsized = Arc::new(Outsized::default());
            let shrinking = {
                let (slot, outsized) = (slot.clone(), outsized.clone());
                thread::spawn(move || {
                    publish(&outsized, &slot, BIG);
                    publish(&outsized, &slot, SMALL);
                })
            };
            publish(&outsized, &slot, BIG + 1);
            shrinking.join().unwrap();
            let entries: Vec<i128> = outsized.lock().values().copied().collect();
            match outsized.remote(&slot) {
                Some(SMALL) => assert_eq!(entries, [], "an entry left behind"),
                Some(sum) => {
                    assert_eq!(sum, BIG + 1, "remote sum {sum}");
                    assert_eq!(entries, [BIG + 1]);
                }
                None => panic!("a live slot's remote sum was lost"),
            }
        });
    }

    #[test]
    fn concurrent_publishes_leave_the_last_sum_whole() {
        check_concurrent_publishes(|outsized, slot, sum| outsized.publish(slot, sum));
    }

    /// Negative control: a publish that makes the word inline drops the entry without
    /// looking again under the lock, and so drops the entry of a publish that made the word
    /// outsized again meanwhile.
    #[test]
    #[should_panic(expected = "a live slot's remote sum was lost")]
    fn a_publish_that_drops_the_entry_without_looking_again_loses_a_sum() {
        check_concurrent_publishes(|outsized, slot, sum| match Remote::of(sum) {
            inline @ Remote::Inline(_) => {
                if Remote::in_word(slot.publish(inline)) == Remote::Outsized {
                    outsized.lock().remove(&address(slot));
                }
            }
            Remote::Outsized => outsized.publish(slot, sum),
        });
    }

    /// An outsized publish racing the slot's removal (retire, then forget, as
    /// `LaneStore::unlink` does) leaves no entry behind; a reader meanwhile gets the sum,
    /// or `None` only once the slot is retired.
    fn check_publish_racing_a_removal(publish: Publish) {
        bounded().check(move || {
            let slot = Arc::new(Slot::new());
            let outsized = Arc::new(Outsized::default());
            let publisher = {
                let (slot, outsized) = (slot.clone(), outsized.clone());
                thread::spawn(move || publish(&outsized, &slot, BIG))
            };
            let remover = {
                let (slot, outsized) = (slot.clone(), outsized.clone());
                thread::spawn(move || {
                    assert!(slot.retire(), "a clean slot is retired");
                    outsized.forget(&slot);
                })
            };
            match outsized.remote(&slot) {
                Some(sum) => assert!(sum == 0 || sum == BIG, "remote sum {sum}"),
                None => assert!(
                    slot.word.load(Ordering::Relaxed) & RETIRED != 0,
                    "a live slot's sum was missing"
                ),
            }
            publisher.join().unwrap();
            remover.join().unwrap();
            assert!(outsized.lock().is_empty(), "an entry left behind");
        });
    }

    #[test]
    fn an_outsized_publish_racing_a_removal_leaves_no_entry() {
        check_publish_racing_a_removal(|outsized, slot, sum| outsized.publish(slot, sum));
    }

    /// Negative control: an outsized publish that does not drop its entry when it finds the
    /// slot retired leaves it behind if `forget` came first.
    #[test]
    #[should_panic(expected = "an entry left behind")]
    fn an_outsized_publish_that_ignores_a_retired_slot_leaves_an_entry() {
        check_publish_racing_a_removal(|outsized, slot, sum| {
            let mut sums = outsized.lock();
            sums.insert(address(slot), sum);
            slot.publish(Remote::of(sum));
        });
    }

    /// A writer that adds to the increments and then takes as much back: a reader never
    /// reads the lane below zero, whatever it sees of the two writes.
    #[test]
    fn a_lane_read_across_an_increment_and_a_decrement_never_reads_low() {
        check_never_reads_low(Slot::own);
    }

    /// Negative control: increments read first can read a decrement without the increment
    /// before it.
    #[test]
    #[should_panic(expected = "read below zero")]
    fn a_lane_read_increments_first_can_read_low() {
        check_never_reads_low(|slot| {
            let incr = slot.incr.load(Ordering::Relaxed);
            Lane::new(incr, slot.decr.load(Ordering::Acquire))
        });
    }

    /// Negative control: decrements read first, but without `Acquire`, can be read with
    /// increments older than them.
    #[test]
    #[should_panic(expected = "read below zero")]
    fn a_lane_read_decrements_first_without_acquire_can_read_low() {
        check_never_reads_low(|slot| {
            let decr = slot.decr.load(Ordering::Relaxed);
            Lane::new(slot.incr.load(Ordering::Relaxed), decr)
        });
    }

    /// The reader runs in a thread of its own: read from the model's main thread, loom
    /// explored one execution of this model only.
    fn check_never_reads_low(read: fn(&Slot) -> Lane) {
        loom::model(move || {
            let slot = Arc::new(Slot::new());
            let writer = {
                let slot = slot.clone();
                thread::spawn(move || {
                    slot.incr(1).unwrap();
                    slot.decr(1).unwrap();
                })
            };
            let reader = {
                let slot = slot.clone();
                thread::spawn(move || assert!(read(&slot).value() >= 0, "read below zero"))
            };
            writer.join().unwrap();
            reader.join().unwrap();
        });
    }

    /// A write racing a removal either lands first, and the slot is not retired, or finds
    /// the slot retired and takes itself back, leaving nothing behind in it.
    #[test]
    fn a_write_racing_a_removal_lands_or_is_taken_back() {
        loom::model(|| {
            let slot = Arc::new(Slot::new());
            let writer = {
                let slot = slot.clone();
                thread::spawn(move || slot.incr(1))
            };
            let retired = slot.retire();
            match writer.join().unwrap().unwrap() {
                Written::Counted { queue, .. } => {
                    assert!(!retired, "a slot with an uncollected write was retired");
                    assert!(queue, "the first write to a clean slot queues its key");
                }
                Written::Retired => {
                    assert!(retired);
                    assert_eq!(
                        slot.own(),
                        Lane::default(),
                        "the refused write was taken back"
                    );
                }
            }
        });
    }
}
