//! The region path: exact rules, decided on one authoritative, durable count.
//!
//! An edge forwards exact checks to the region node over its QUIC connection, in frames on
//! one long-lived bidirectional stream (a session, see [`forward`] and [`wire`]). The
//! region decides each on its [`Ledger`] (linearizable: one task decides, in arrival
//! order, on the state every earlier decision left), appends a record, and answers only
//! after the [`committer`] has synced that record's group to disk. Request ids make
//! retries idempotent: a repeated id gets the first answer, after the same sync, and
//! counts nothing more.
//!
//! After a failed write or sync the committer refuses everything, forever (until
//! restart): it never retries and then acknowledges, because a failed `fsync` may have
//! dropped dirty pages the kernel will not write again.

pub mod committer;
mod deadlines;
pub mod forward;
pub mod log;
mod own_lanes;
pub mod service;
pub mod wire;

use crate::recent::Asked;
use crate::store::KeyHasher;
use log::{Entry, RequestId};
use std::collections::{BTreeMap, HashMap, VecDeque};
use tally_crdt::{Key, Rule, Subject, Window};
pub use wire::{ExactAnswer, ExactCheck, Outcome};

/// The authoritative counts of exact rules, and the outcomes of each edge life's and
/// application session's most recent request ids. Pure state: the committer makes it
/// durable.
#[derive(Debug, Clone)]
pub struct Ledger {
    // Invariant: a count never decreases within its window.
    counts: HashMap<Key, u64, KeyHasher>,
    // Per edge life (node, generation), the outcomes of its last `RECENT_IDS` requests; per
    // application session (`CLIENT_NODE`, session), of its last `RECENT_CLIENT_IDS`.
    seen: HashMap<(u64, u64), Recent, KeyHasher>,
    // Per edge node, the generations of its lives decided for since this ledger was
    // built, in the order they first were: at most `LIVES_PER_NODE`.
    lives: HashMap<u64, VecDeque<u64>, KeyHasher>,
    // The most keys `counts` holds: a check that would add one past it is not decided.
    keys_max: usize,
    // Invariant: how many entries of `seen` are application sessions'.
    sessions: usize,
    // The most application sessions `seen` holds: a check of a new one past it is not
    // decided.
    sessions_max: usize,
    // The windows whose counts and ids `expire` forgot, over for good.
    forgotten: Forgotten,
}

impl Default for Ledger {
    /// An empty ledger that holds any number of keys.
    fn default() -> Ledger {
        Ledger {
            counts: HashMap::default(),
            seen: HashMap::default(),
            lives: HashMap::default(),
            keys_max: usize::MAX,
            sessions: 0,
            sessions_max: usize::MAX,
            forgotten: Forgotten::default(),
        }
    }
}

/// Two ledgers are equal when they hold alike: the same counts, the same outcomes and the
/// same windows forgotten. (`lives` is rebuilt by a replay, in the order the lives came
/// in, which the outcomes held already show; the caps are configuration, set after a
/// replay.)
impl PartialEq for Ledger {
    fn eq(&self, other: &Ledger) -> bool {
        self.counts == other.counts && self.seen == other.seen && self.forgotten == other.forgotten
    }
}

impl Eq for Ledger {}

/// The most lives of one edge node whose outcomes the ledger holds at once, counting those
/// decided for since it was built: a newer one makes it forget the outcomes of the first,
/// keeping only its floor (its numbers are then `Forgotten`, never decided again). A
/// node runs one life at a time, so the lives before its last few are gone and retry
/// nothing. Each may hold a ring of up to `RECENT_IDS` outcomes (about 1.5 MiB), so an
/// edge that names ever new generations would otherwise make the region hold a ring
/// for each.
pub const LIVES_PER_NODE: usize = 4;

/// Per window length, the newest window whose counts a ledger has forgotten, and every
/// one before it: over for good, whatever the wall clock says once it steps back. A
/// compaction logs it (`Entry::WindowsForgotten`, since session 47), so it holds across
/// restarts too.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Forgotten {
    // By window length, the newest window index forgotten.
    through: BTreeMap<u32, u64>,
}

impl Forgotten {
    fn add(&mut self, window: Window) {
        let through = self.through.entry(window.len_secs()).or_default();
        *through = (*through).max(window.index());
    }

    /// Whether `window`, or a later one of its length, has had its counts forgotten.
    pub fn covers(&self, window: Window) -> bool {
        (self.through.get(&window.len_secs())).is_some_and(|&through| window.index() <= through)
    }
}

/// How many request ids of one edge life the ledger answers retries of: the last this
/// many sequence numbers. An edge retries only within its rule's timeout, and numbers its
/// requests in order, so its retries are of recent ids; this bounds the memory of a window
/// to this many per edge life instead of one entry per decision.
pub const RECENT_IDS: usize = 65_536;

// A session holds no more checks decided and not yet answered than the ledger remembers of
// an edge life. This does not bound how far apart their sequence numbers are (an edge
// skips the numbers of checks answered or given up on, and answers lost in a broken
// session let the region read on), so a check sent again can still be refused
// `Forgotten`: never counted twice, but its outcome unknown.
const _: () =
    assert!(crate::transport::SESSION_FRAMES_IN_FLIGHT * wire::CHECKS_PER_FRAME_MAX <= RECENT_IDS);

/// How many check ids of one application session ([`log::CLIENT_NODE`]) the ledger answers
/// retries of: its most recent this many decided. The session's sequence numbers count
/// every id its process made, exact rule or not, so they are held sparsely: one entry per
/// decision, never a slot per number skipped.
pub const RECENT_CLIENT_IDS: usize = 16_384;

/// One edge life's or application session's recent outcomes, from `base` on.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Recent {
    // Invariant: every sequence number below `base` was decided and then forgotten, or
    // skipped past and never to be decided.
    base: u64,
    // A number below `base` may name a check whose window is live until this second
    // (exclusive): until then the floor is kept, even with no outcome held, so that a
    // retry of a forgotten number is never read as unseen and counted again.
    floor_until: u64,
    outcomes: Outcomes,
}

/// The outcomes held, by sequence number from `base` on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcomes {
    /// An edge life's, numbered densely: `[i]` is `base + i`, `None` until decided. At
    /// most [`RECENT_IDS`] numbers.
    Dense(VecDeque<Option<(Outcome, Window)>>),
    /// An application session's, numbered sparsely: at most [`RECENT_CLIENT_IDS`].
    Sparse(BTreeMap<u64, Named>),
}

/// An application's id's outcome, its window, and what its check asked: `None` for one
/// read from a log compacted before session 47, which did not hold it (any check under
/// the id then gets the outcome, as every check did before). An edge's own numbers each
/// name one check, and hold no more than their outcome and window.
type Named = (Outcome, Window, Option<Asked>);

/// What the ledger holds of one sequence number: its outcome, and for an application's id
/// what its check asked.
enum Held {
    Unseen,
    Decided(Outcome, Option<Asked>),
    Forgotten,
}

impl Recent {
    /// Nothing held yet of the edge life or application session whose node is `node`.
    fn new(node: u64) -> Recent {
        let outcomes = if node == log::CLIENT_NODE {
            Outcomes::Sparse(BTreeMap::new())
        } else {
            Outcomes::Dense(VecDeque::new())
        };
        Recent {
            base: 0,
            floor_until: 0,
            outcomes,
        }
    }

    fn get(&self, seq: u64) -> Held {
        if self.base == u64::MAX {
            // Forgotten whole (`forget_all`): every number, `u64::MAX` included.
            return Held::Forgotten;
        }
        let Some(offset) = seq.checked_sub(self.base) else {
            return Held::Forgotten;
        };
        let held = match &self.outcomes {
            Outcomes::Dense(outcomes) => usize::try_from(offset)
                .ok()
                .and_then(|offset| outcomes.get(offset))
                .and_then(Option::as_ref)
                .map(|(outcome, _)| (*outcome, None)),
            Outcomes::Sparse(outcomes) => {
                (outcomes.get(&seq)).map(|(outcome, _, asked)| (*outcome, *asked))
            }
        };
        match held {
            Some((outcome, asked)) => Held::Decided(outcome, asked),
            None => Held::Unseen,
        }
    }

    /// Holds `seq`'s outcome, forgetting the oldest beyond the bound, and for an
    /// application session what its check `asked` ([`Named`]). A number below `base` is
    /// not held (it was forgotten).
    fn insert(&mut self, seq: u64, outcome: Outcome, window: Window, asked: Option<Asked>) {
        if seq < self.base {
            return;
        }
        match &mut self.outcomes {
            Outcomes::Dense(slots) => {
                let floor = seq.saturating_add(1).saturating_sub(RECENT_IDS as u64);
                forget_dense_below(&mut self.base, &mut self.floor_until, slots, floor);
                // Below RECENT_IDS, as `base` is at most RECENT_IDS - 1 below `seq`.
                let offset = (seq - self.base) as usize;
                if slots.len() <= offset {
                    slots.resize(offset + 1, None);
                }
                slots[offset] = Some((outcome, window));
            }
            Outcomes::Sparse(held) => {
                held.insert(seq, (outcome, window, asked));
                if held.len() > RECENT_CLIENT_IDS {
                    let (oldest, (_, window, _)) = held.pop_first().expect("invariant: not empty");
                    self.base = oldest + 1;
                    self.floor_until = self.floor_until.max(window.live_until_unix_secs());
                }
            }
        }
    }

    /// Forgets every sequence number below `floor`.
    fn forget_below(&mut self, floor: u64) {
        match &mut self.outcomes {
            Outcomes::Dense(slots) => {
                forget_dense_below(&mut self.base, &mut self.floor_until, slots, floor);
            }
            Outcomes::Sparse(held) if floor > self.base => {
                let kept = held.split_off(&floor);
                for (_, window, _) in std::mem::replace(held, kept).values() {
                    self.floor_until = self.floor_until.max(window.live_until_unix_secs());
                }
                self.base = floor;
            }
            Outcomes::Sparse(_) => {}
        }
    }

    /// Forgets every outcome, and frees their room: every number is `Forgotten` from now
    /// on, while the floor is kept (until the last outcome's window ends).
    fn forget_all(&mut self) {
        self.forget_below(u64::MAX);
        if let Outcomes::Dense(slots) = &mut self.outcomes {
            // Number `u64::MAX`'s, which `forget_below` keeps.
            for (_, window) in slots.drain(..).flatten() {
                self.floor_until = self.floor_until.max(window.live_until_unix_secs());
            }
            *slots = VecDeque::new();
        }
    }

    /// Forgets outcomes of windows that are over; false once no outcome is held and no
    /// forgotten one's window is live. `base` stays while this is true: a number of a
    /// window that is over reads as unseen. For an edge's id that is
    /// safe, because the edge fixed the window when it first sent it, and the region
    /// refuses a check of a window that is over whose id the ledger does not hold before it
    /// decides it (over by the wall clock, or [`Forgotten`], so that a clock stepped back
    /// does not make it live again, across restarts too: a compaction logs it). An application's
    /// retry is given its window afresh by the edge it goes through, so one sent after the
    /// first check's window is over (and forgotten, one window length after its end) is a
    /// new check in its own window.
    ///
    /// Adds the windows of the outcomes it forgets to `forgotten`: a window whose checks
    /// were all denied holds no count to record it.
    fn expire(&mut self, now_unix_secs: u64, forgotten: &mut Forgotten) -> bool {
        let mut live = |window: &Window| {
            let live = window.is_live(now_unix_secs);
            if !live {
                forgotten.add(*window);
            }
            live
        };
        let floor_live = now_unix_secs < self.floor_until;
        let held_any = match &mut self.outcomes {
            Outcomes::Dense(outcomes) => {
                let mut held_any = false;
                for held in outcomes.iter_mut() {
                    if held.as_ref().is_some_and(|(_, window)| !live(window)) {
                        *held = None;
                    }
                    held_any |= held.is_some();
                }
                if !held_any {
                    // Kept only for its floor: free the ring, which a snapshot would not
                    // bring back either.
                    *outcomes = VecDeque::new();
                }
                held_any
            }
            Outcomes::Sparse(outcomes) => {
                outcomes.retain(|_, (_, window, _)| live(window));
                !outcomes.is_empty()
            }
        };
        held_any || floor_live
    }

    /// The outcomes held, by sequence number, in order, each with its window and what
    /// its check asked ([`Named`]).
    fn held(&self) -> Box<dyn Iterator<Item = (u64, Named)> + '_> {
        match &self.outcomes {
            // `base + i` is a sequence number held, so it does not overflow.
            Outcomes::Dense(outcomes) => {
                Box::new((outcomes.iter().enumerate()).filter_map(|(i, held)| {
                    let (outcome, window) = held.as_ref()?;
                    Some((self.base + i as u64, (*outcome, *window, None)))
                }))
            }
            Outcomes::Sparse(outcomes) => {
                Box::new(outcomes.iter().map(|(seq, held)| (*seq, *held)))
            }
        }
    }

    /// How many outcomes are held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.held().count()
    }
}

/// Forgets the dense slots below `floor`, moving `base` up to it and `floor_until` past
/// the windows of the outcomes forgotten.
fn forget_dense_below(
    base: &mut u64,
    floor_until: &mut u64,
    slots: &mut VecDeque<Option<(Outcome, Window)>>,
    floor: u64,
) {
    let Some(forget) = floor.checked_sub(*base) else {
        return;
    };
    // At most the number of slots held, so it fits a usize.
    let forget = forget.min(slots.len() as u64) as usize;
    for (_, window) in slots.drain(..forget).flatten() {
        *floor_until = (*floor_until).max(window.live_until_unix_secs());
    }
    *base = floor;
}

/// What [`Ledger::decide`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decided {
    /// A new decision, to be logged ([`log::Record::decided`]) before it is acknowledged.
    New(Outcome),
    /// A retry of a decided request: its first outcome, nothing new to log.
    Repeat(Outcome),
    /// A check under an application's id that named another check here (another rule,
    /// subject or cost): not decided, nothing to log. An id names one check; the region
    /// tells them apart by [`Asked`] since session 47 (before, this one got the first
    /// check's outcome and was never counted).
    IdReused,
    /// A retry of a request older than the last [`RECENT_IDS`] of its edge life (or
    /// [`RECENT_CLIENT_IDS`] of its application session): its
    /// outcome is forgotten, and it is not decided again (that could count it twice).
    Forgotten,
    /// A check that would admit a key the ledger does not hold while it holds its maximum
    /// of keys: not decided, nothing to log (a retry once there is room is decided then).
    KeysFull,
    /// A check under an application session the ledger does not hold while it holds its
    /// maximum of sessions: not decided, nothing to log (a retry once there is room is
    /// decided then).
    SessionsFull,
}

impl Ledger {
    /// The ledger the log's entries add up to. Entries out of bounds are skipped (the
    /// region never logs one).
    pub fn replay(entries: &[Entry]) -> Ledger {
        let mut ledger = Ledger::default();
        // Each life's first entry: the order the lives came in (a snapshot writes each
        // node's in that order, `Ledger::snapshot`).
        let mut first_entry: HashMap<(u64, u64), usize, KeyHasher> = HashMap::default();
        for (at, entry) in entries.iter().enumerate() {
            if let Some(life) = life_of(entry) {
                first_entry.entry(life).or_insert(at);
            }
            ledger.replay_one(entry);
        }
        ledger.note_lives_held(&first_entry);
        ledger.sessions = ledger
            .seen
            .keys()
            .filter(|&&(node, _)| node == log::CLIENT_NODE)
            .count();
        ledger
    }

    /// Notes every edge life whose outcomes are held, per node in the order the lives
    /// came in (by `first_entry`: a generation says nothing of it, since a node without
    /// a data directory takes its wall clock's, which may have stepped back), and forgets
    /// all but each node's last `LIVES_PER_NODE`, as deciding does: the cap holds across
    /// the region's restarts.
    fn note_lives_held(&mut self, first_entry: &HashMap<(u64, u64), usize, KeyHasher>) {
        let mut by_node: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for (&(node, generation), recent) in &self.seen {
            if node != log::CLIENT_NODE && recent.base != u64::MAX {
                by_node.entry(node).or_default().push(generation);
            }
        }
        self.lives.clear();
        for (node, mut generations) in by_node {
            generations.sort_unstable_by_key(|&generation| {
                (first_entry.get(&(node, generation)).copied(), generation)
            });
            let first_kept = generations.len().saturating_sub(LIVES_PER_NODE);
            for generation in &generations[..first_kept] {
                if let Some(recent) = self.seen.get_mut(&(node, *generation)) {
                    recent.forget_all();
                }
            }
            self.lives
                .insert(node, generations[first_kept..].iter().copied().collect());
        }
    }

    fn replay_one(&mut self, entry: &Entry) {
        match entry {
            Entry::Decided(record) => {
                let key = key_of(
                    &record.rule,
                    &record.subject,
                    record.window_index,
                    record.window_secs,
                );
                if let Some(key) = key {
                    let asked = (record.id.node == log::CLIENT_NODE)
                        .then(|| Asked::named(&record.rule, &record.subject, record.cost));
                    self.apply(record.id, &key, record.cost, record.allowed, asked);
                }
            }
            Entry::Count {
                rule,
                subject,
                window_index,
                window_secs,
                count,
            } => {
                if let Some(key) = key_of(rule, subject, *window_index, *window_secs) {
                    self.counts.insert(key, *count);
                }
            }
            Entry::Floor {
                node,
                generation,
                base,
            } => {
                self.seen
                    .entry((*node, *generation))
                    .or_insert_with(|| Recent::new(*node))
                    .forget_below(*base);
            }
            Entry::FloorKept {
                node,
                generation,
                until_unix_secs,
            } => {
                let recent =
                    (self.seen.entry((*node, *generation))).or_insert_with(|| Recent::new(*node));
                recent.floor_until = recent.floor_until.max(*until_unix_secs);
            }
            Entry::Outcome {
                id,
                allowed,
                count,
                window_index,
                window_secs,
            } => self.replay_outcome(*id, *allowed, *count, (*window_index, *window_secs), None),
            Entry::NamedOutcome {
                id,
                asked,
                allowed,
                count,
                window_index,
                window_secs,
            } => self.replay_outcome(
                *id,
                *allowed,
                *count,
                (*window_index, *window_secs),
                Some(*asked),
            ),
            Entry::WindowsForgotten {
                window_secs,
                through_index,
            } => {
                if let Ok(window) = Window::new(*through_index, *window_secs) {
                    self.forgotten.add(window);
                }
            }
        }
    }

    /// Holds a compacted outcome of `id`, in the window of `(index, length)` if it is
    /// within bounds.
    fn replay_outcome(
        &mut self,
        id: RequestId,
        allowed: bool,
        count: u64,
        (index, len_secs): (u64, u32),
        asked: Option<Asked>,
    ) {
        if let Ok(window) = Window::new(index, len_secs) {
            self.seen
                .entry((id.node, id.generation))
                .or_insert_with(|| Recent::new(id.node))
                .insert(id.seq, Outcome { allowed, count }, window, asked);
        }
    }

    /// Forgets the request ids of every life of `node`: the region's own earlier lives,
    /// whose forwarders (for the region's own clients) are gone and never retry. A life
    /// given a generation an earlier one had (its generation file lost with the clock
    /// behind) then never gets that life's outcomes for its own numbers. `node` is never
    /// [`log::CLIENT_NODE`]: the applications' check ids stay.
    pub fn forget_lives_of(&mut self, node: u64) {
        assert_ne!(
            node,
            log::CLIENT_NODE,
            "the applications' check ids are never forgotten"
        );
        self.seen.retain(|&(seen, _), _| seen != node);
        self.lives.remove(&node);
    }

    /// Appends to `out` the entries of this ledger's state: every key's count, and per edge
    /// life its floor and the outcomes it holds. [`Ledger::replay`] of them gives back this
    /// ledger. Returns how many entries it wrote.
    pub fn snapshot(&self, out: &mut Vec<u8>) -> u64 {
        let mut entries = 0;
        let mut put = |entry: Entry<&str>| {
            log::encode(&entry, out);
            entries += 1;
        };
        for (&window_secs, &through_index) in &self.forgotten.through {
            put(Entry::WindowsForgotten {
                window_secs,
                through_index,
            });
        }
        for (key, count) in &self.counts {
            put(Entry::Count {
                rule: key.rule.as_str(),
                subject: key.subject.as_str(),
                window_index: key.window.index(),
                window_secs: key.window.len_secs(),
                count: *count,
            });
        }
        // Each node's lives in the order they came in, so a replay forgets the same ones
        // as deciding goes on to (`Ledger::replay`).
        let came_in = |node: u64, generation: u64| {
            (self.lives.get(&node))
                .and_then(|lives| lives.iter().position(|&g| g == generation))
                .map_or(0, |at| at + 1)
        };
        let mut lives: Vec<(u64, u64)> = self.seen.keys().copied().collect();
        lives.sort_unstable_by_key(|&(node, generation)| (node, came_in(node, generation)));
        for (node, generation) in lives {
            let recent = &self.seen[&(node, generation)];
            put(Entry::Floor {
                node,
                generation,
                base: recent.base,
            });
            if recent.floor_until > 0 {
                put(Entry::FloorKept {
                    node,
                    generation,
                    until_unix_secs: recent.floor_until,
                });
            }
            for (seq, (outcome, window, asked)) in recent.held() {
                let id = RequestId {
                    node,
                    generation,
                    seq,
                };
                let (allowed, count) = (outcome.allowed, outcome.count);
                let (window_index, window_secs) = (window.index(), window.len_secs());
                put(match asked {
                    Some(asked) => Entry::NamedOutcome {
                        id,
                        asked,
                        allowed,
                        count,
                        window_index,
                        window_secs,
                    },
                    None => Entry::Outcome {
                        id,
                        allowed,
                        count,
                        window_index,
                        window_secs,
                    },
                });
            }
        }
        entries
    }

    /// Decides `check` on `key` (its key) under `limit`: admits iff the count plus the cost
    /// stays within the limit. A request id seen before gets its first outcome. An
    /// admission of a key not held, while the ledger holds its maximum of keys
    /// ([`Ledger::hold_at_most`]), is not decided (a denial holds no key, so it is decided
    /// as ever).
    pub fn decide(&mut self, check: &ExactCheck, key: &Key, limit: u64) -> Decided {
        if let Some(held) = self.recall(check) {
            return held;
        }
        let id = check.dedupe_id();
        let life = (id.node, id.generation);
        if id.node == log::CLIENT_NODE
            && self.sessions >= self.sessions_max
            && !self.seen.contains_key(&life)
        {
            return Decided::SessionsFull;
        }
        let held = self.counts.get(key).copied();
        let allowed = (held.unwrap_or(0))
            .checked_add(check.cost)
            .is_some_and(|after| after <= limit);
        if allowed && held.is_none() && self.counts.len() >= self.keys_max {
            return Decided::KeysFull;
        }
        let asked = (id.node == log::CLIENT_NODE).then(|| check.asked());
        Decided::New(self.apply(id, key, check.cost, allowed, asked))
    }

    /// What the ledger holds of `check`'s request id, whatever its window: its first
    /// outcome ([`Decided::Repeat`]), that it named another check ([`Decided::IdReused`]),
    /// or that it was forgotten ([`Decided::Forgotten`]); `None` if it was never decided.
    pub fn recall(&self, check: &ExactCheck) -> Option<Decided> {
        let id = check.dedupe_id();
        match self.seen.get(&(id.node, id.generation))?.get(id.seq) {
            Held::Unseen => None,
            Held::Decided(_, Some(asked)) if asked != check.asked() => Some(Decided::IdReused),
            Held::Decided(outcome, _) => Some(Decided::Repeat(outcome)),
            Held::Forgotten => Some(Decided::Forgotten),
        }
    }

    /// Holds at most `keys_max` keys from now on: an admission that would add one past it
    /// is not decided ([`Decided::KeysFull`]). Keys already held stay (a replayed log's
    /// are durable decisions, whatever the cap was when they were made).
    pub fn hold_at_most(&mut self, keys_max: usize) {
        self.keys_max = keys_max;
    }

    /// Holds the check ids of at most `sessions_max` application sessions from now on: a
    /// check under one more is not decided ([`Decided::SessionsFull`]). Sessions already
    /// held stay, as keys do.
    pub fn hold_sessions_at_most(&mut self, sessions_max: usize) {
        self.sessions_max = sessions_max;
    }

    /// The count of `key`.
    pub fn count(&self, key: &Key) -> u64 {
        self.counts.get(key).copied().unwrap_or(0)
    }

    /// Every key counted, with its count.
    pub fn counts(&self) -> impl Iterator<Item = (&Key, u64)> {
        self.counts.iter().map(|(key, count)| (key, *count))
    }

    /// The windows whose counts or ids this ledger has forgotten: a check in one is never
    /// decided, whatever the wall clock says.
    pub fn forgotten(&self) -> &Forgotten {
        &self.forgotten
    }

    /// Forgets windows that are over at `now_unix_secs`, and their request ids, noting
    /// per window length the newest window whose counts or ids it forgot
    /// ([`Ledger::forgotten`]).
    pub fn expire(&mut self, now_unix_secs: u64) {
        let forgotten = &mut self.forgotten;
        self.counts.retain(|key, _| {
            let live = key.window.is_live(now_unix_secs);
            if !live {
                forgotten.add(key.window);
            }
            live
        });
        self.seen
            .retain(|_, recent| recent.expire(now_unix_secs, forgotten));
        self.sessions = self
            .seen
            .keys()
            .filter(|&&(node, _)| node == log::CLIENT_NODE)
            .count();
        let seen = &self.seen;
        self.lives.retain(|&node, lives| {
            lives.retain(|&generation| seen.contains_key(&(node, generation)));
            !lives.is_empty()
        });
    }

    /// Decides `id` on `key` as `allowed`, counting `cost` if so, and holds its outcome
    /// (with what it `asked`: given for an application's id, [`Named`]).
    fn apply(
        &mut self,
        id: RequestId,
        key: &Key,
        cost: u64,
        allowed: bool,
        asked: Option<Asked>,
    ) -> Outcome {
        // A denied check holds no key: its count is what it was, 0 if none.
        let count = match (allowed, self.counts.get_mut(key)) {
            (true, Some(count)) => {
                *count = count.saturating_add(cost);
                *count
            }
            (true, None) => *self.counts.entry(key.clone()).or_insert(cost),
            (false, held) => held.map_or(0, |count| *count),
        };
        let outcome = Outcome { allowed, count };
        let life = (id.node, id.generation);
        match self.seen.get_mut(&life) {
            Some(recent) => recent.insert(id.seq, outcome, key.window, asked),
            None => {
                self.begin_life(id.node, id.generation);
                self.sessions += usize::from(id.node == log::CLIENT_NODE);
                let mut recent = Recent::new(id.node);
                recent.insert(id.seq, outcome, key.window, asked);
                self.seen.insert(life, recent);
            }
        }
        outcome
    }

    /// Notes a new life of `node`, forgetting the outcomes of its first noted life past
    /// `LIVES_PER_NODE`. Application sessions are not lives: each holds its own bounded
    /// outcomes.
    fn begin_life(&mut self, node: u64, generation: u64) {
        if node == log::CLIENT_NODE {
            return;
        }
        let lives = self.lives.entry(node).or_default();
        lives.push_back(generation);
        if lives.len() > LIVES_PER_NODE {
            let first = lives.pop_front();
            if let Some(recent) = first.and_then(|first| self.seen.get_mut(&(node, first))) {
                recent.forget_all();
            }
        }
    }
}

/// The life (node, generation) a log entry is of, if it is of one.
fn life_of(entry: &Entry) -> Option<(u64, u64)> {
    match entry {
        Entry::Decided(record) => Some((record.id.node, record.id.generation)),
        Entry::Floor {
            node, generation, ..
        }
        | Entry::FloorKept {
            node, generation, ..
        } => Some((*node, *generation)),
        Entry::Outcome { id, .. } | Entry::NamedOutcome { id, .. } => {
            Some((id.node, id.generation))
        }
        Entry::Count { .. } | Entry::WindowsForgotten { .. } => None,
    }
}

/// The key a log entry names, if its fields are within bounds. Its rule name is a copy of
/// its own; a decided check's key shares the configured rule's instead ([`key_in`]).
pub fn key_of(rule: &str, subject: &str, window_index: u64, window_secs: u32) -> Option<Key> {
    key_in(Rule::new(rule).ok()?, subject, window_index, window_secs)
}

/// The key of `subject` in `rule`'s window `window_index`, if they are within bounds.
pub fn key_in(rule: Rule, subject: &str, window_index: u64, window_secs: u32) -> Option<Key> {
    Some(Key::new(
        rule,
        Subject::new(subject).ok()?,
        Window::new(window_index, window_secs).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_client::wire::CheckId;

    /// A check of `cost` on `acct-1` from node 2's life 1, numbered `seq`.
    pub(super) fn check(seq: u64, cost: u64) -> ExactCheck {
        ExactCheck {
            id: RequestId {
                node: 2,
                generation: 1,
                seq,
            },
            check_id: None,
            rule: "quota".into(),
            subject: "acct-1".into(),
            window_index: 500_000,
            window_secs: 3_600,
            cost,
        }
    }

    fn key() -> Key {
        key_of("quota", "acct-1", 500_000, 3_600).unwrap()
    }

    /// A check of cost 1 on `acct-1` from node 2's life `generation`, numbered `seq`.
    fn in_life(generation: u64, seq: u64) -> ExactCheck {
        ExactCheck {
            id: RequestId {
                node: 2,
                generation,
                seq,
            },
            ..check(seq, 1)
        }
    }

    /// A check of cost 1 the application named `app_seq` in `session`.
    fn named(session: u64, app_seq: u64) -> ExactCheck {
        ExactCheck {
            check_id: Some(CheckId {
                session,
                seq: app_seq,
            }),
            ..check(app_seq, 1)
        }
    }

    fn decide(ledger: &mut Ledger, seq: u64, cost: u64, limit: u64) -> Decided {
        ledger.decide(&check(seq, cost), &key(), limit)
    }

    #[test]
    fn a_denied_check_of_a_new_key_holds_no_key() {
        let mut ledger = Ledger::default();
        let over = decide(&mut ledger, 1, 11, 10);
        assert!(matches!(
            over,
            Decided::New(Outcome {
                allowed: false,
                count: 0
            })
        ));
        assert_eq!(ledger.counts().count(), 0, "a denied check adds no key");
        assert!(matches!(
            decide(&mut ledger, 2, 4, 10),
            Decided::New(Outcome {
                allowed: true,
                count: 4
            })
        ));
        assert!(matches!(
            decide(&mut ledger, 3, 7, 10),
            Decided::New(Outcome {
                allowed: false,
                count: 4
            })
        ));
        assert_eq!(ledger.counts().collect::<Vec<_>>(), vec![(&key(), 4)]);
    }

    #[test]
    fn at_its_key_cap_the_ledger_decides_no_admission_of_a_new_key_until_a_window_ends() {
        let mut ledger = Ledger::default();
        ledger.hold_at_most(2);
        let on = |seq: u64, subject: &str, window_index: u64, cost: u64| {
            let check = ExactCheck {
                subject: subject.into(),
                window_index,
                ..check(seq, cost)
            };
            let key = key_of("quota", subject, window_index, 3_600).unwrap();
            (check, key)
        };
        let mut decide_on = |seq, subject, window_index, cost| {
            let (check, key) = on(seq, subject, window_index, cost);
            ledger.decide(&check, &key, 10)
        };
        let admitted = |count| {
            Decided::New(Outcome {
                allowed: true,
                count,
            })
        };
        assert_eq!(decide_on(0, "acct-1", 500_000, 1), admitted(1));
        assert_eq!(decide_on(1, "acct-2", 500_000, 1), admitted(1));
        assert_eq!(decide_on(2, "acct-3", 500_000, 1), Decided::KeysFull);
        // A key held is decided as ever, and so is a retry, and a denial of a new key,
        // which holds none.
        assert_eq!(decide_on(3, "acct-1", 500_000, 1), admitted(2));
        assert_eq!(
            decide_on(0, "acct-1", 500_000, 1),
            Decided::Repeat(Outcome {
                allowed: true,
                count: 1
            })
        );
        assert_eq!(
            decide_on(4, "acct-3", 500_000, 11),
            Decided::New(Outcome {
                allowed: false,
                count: 0
            })
        );
        // The refused check was not decided: sent again, it is refused again, not
        // `Forgotten` nor a repeat.
        assert_eq!(decide_on(2, "acct-3", 500_000, 1), Decided::KeysFull);
        assert_eq!(ledger.counts().count(), 2);
        // Once their window is over, its keys make room.
        ledger.expire((500_000 + 2) * 3_600);
        let (check, key) = on(5, "acct-3", 500_002, 1);
        assert_eq!(ledger.decide(&check, &key, 10), admitted(1));
    }

    #[test]
    fn a_check_of_a_new_application_session_past_the_cap_is_not_decided() {
        let mut ledger = Ledger::default();
        ledger.hold_sessions_at_most(2);
        let in_window = |check: ExactCheck, window_index: u64| {
            let key = key_of("quota", "acct-1", window_index, 3_600).unwrap();
            (
                ExactCheck {
                    window_index,
                    ..check
                },
                key,
            )
        };
        let decide_in = |ledger: &mut Ledger, check: ExactCheck, window_index| {
            let (check, key) = in_window(check, window_index);
            ledger.decide(&check, &key, 10)
        };
        let admitted = |count| {
            Decided::New(Outcome {
                allowed: true,
                count,
            })
        };
        assert_eq!(decide_in(&mut ledger, named(1, 1), 500_000), admitted(1));
        assert_eq!(decide_in(&mut ledger, named(2, 1), 500_000), admitted(2));
        assert_eq!(
            decide_in(&mut ledger, named(3, 1), 500_000),
            Decided::SessionsFull
        );
        // Nor a denial, which would hold the session's outcome all the same.
        assert_eq!(
            decide_in(
                &mut ledger,
                ExactCheck {
                    cost: 11,
                    ..named(3, 2)
                },
                500_000
            ),
            Decided::SessionsFull
        );
        // A session held is decided as ever, and so are an edge life's checks.
        assert_eq!(decide_in(&mut ledger, named(1, 2), 500_000), admitted(3));
        assert_eq!(decide_in(&mut ledger, check(7, 1), 500_000), admitted(4));
        // The refused check was not decided: sent again, it is refused again.
        assert_eq!(
            decide_in(&mut ledger, named(3, 1), 500_000),
            Decided::SessionsFull
        );
        // A replay holds the same sessions, and the cap holds across it.
        let mut out = Vec::new();
        ledger.snapshot(&mut out);
        let mut replayed = Ledger::replay(&log::replay(&out).0);
        replayed.hold_sessions_at_most(2);
        let (check, key) = in_window(named(3, 1), 500_000);
        assert_eq!(replayed.decide(&check, &key, 10), Decided::SessionsFull);
        // Once their window is over, the sessions make room.
        ledger.expire((500_000 + 2) * 3_600);
        assert_eq!(decide_in(&mut ledger, named(3, 1), 500_002), admitted(1));
    }

    #[test]
    fn a_window_whose_checks_were_all_denied_is_forgotten_when_it_ends() {
        let mut ledger = Ledger::default();
        let over = decide(&mut ledger, 1, 11, 10);
        assert!(matches!(over, Decided::New(Outcome { allowed: false, .. })));
        ledger.expire((500_000 + 10) * 3_600);
        assert!(
            ledger.forgotten().covers(key().window),
            "no count recorded it, its outcome does"
        );
    }

    #[test]
    fn an_edge_node_holds_its_last_lives_outcomes_and_forgets_its_first_ones_numbers() {
        let mut ledger = Ledger::default();
        // Ten lives of node 2, each deciding its number 65,535: a ring of 65,536 each.
        for generation in 1..=10 {
            let decided = ledger.decide(&in_life(generation, 65_535), &key(), u64::MAX);
            assert!(matches!(decided, Decided::New(_)), "{decided:?}");
        }
        let ring_slots = |ledger: &Ledger| -> usize {
            (ledger.seen.values())
                .map(|recent| match &recent.outcomes {
                    Outcomes::Dense(slots) => slots.len(),
                    Outcomes::Sparse(held) => held.len(),
                })
                .sum()
        };
        assert_eq!(ring_slots(&ledger), LIVES_PER_NODE * 65_536);
        // The first lives' numbers are forgotten, never decided again; the last ones'
        // outcomes are kept.
        for (generation, seq) in [(1, 65_535), (1, 7), (6, 0)] {
            let decided = ledger.decide(&in_life(generation, seq), &key(), u64::MAX);
            assert_eq!(
                decided,
                Decided::Forgotten,
                "life {generation}, number {seq}"
            );
        }
        let again = ledger.decide(&in_life(10, 65_535), &key(), u64::MAX);
        assert!(matches!(again, Decided::Repeat(_)), "{again:?}");
        assert_eq!(ledger.count(&key()), 10, "each counted once");
        // A snapshot keeps the first lives' floors.
        let mut entries = Vec::new();
        ledger.snapshot(&mut entries);
        let mut replayed = Ledger::replay(&log::replay(&entries).0);
        assert_eq!(replayed, ledger);
        let decided = replayed.decide(&in_life(2, 3), &key(), u64::MAX);
        assert_eq!(decided, Decided::Forgotten);
        // A forgotten life's every number, the last one too.
        let decided = replayed.decide(&in_life(1, u64::MAX), &key(), u64::MAX);
        assert_eq!(decided, Decided::Forgotten);
        // Lives restored from a snapshot count too: of six, the first two are forgotten.
        let outcome = |generation| Entry::Outcome {
            id: RequestId {
                node: 3,
                generation,
                seq: 0,
            },
            allowed: true,
            count: 1,
            window_index: 500_000,
            window_secs: 3_600,
        };
        let restored = Ledger::replay(&(1..=6).map(outcome).collect::<Vec<_>>());
        let held = |generation| restored.seen[&(3, generation)].get(0);
        for generation in 1..=6 {
            let forgotten = matches!(held(generation), Held::Forgotten);
            assert_eq!(forgotten, generation <= 2, "life {generation}");
        }
        // Application sessions are not lives: each keeps its own.
        for session in 1..=10 {
            let decided = ledger.decide(&named(session, 1), &key(), u64::MAX);
            assert!(matches!(decided, Decided::New(_)), "{decided:?}");
        }
        for session in 1..=10 {
            let again = ledger.decide(&named(session, 1), &key(), u64::MAX);
            assert!(matches!(again, Decided::Repeat(_)), "{again:?}");
        }
    }

    #[test]
    fn checks_admit_up_to_the_limit_and_never_past_it() {
        let mut ledger = Ledger::default();
        let allowed: Vec<bool> = (0..6)
            .map(|seq| match decide(&mut ledger, seq, 2, 7) {
                Decided::New(outcome) => outcome.allowed,
                other => panic!("a new id is decided anew: {other:?}"),
            })
            .collect();
        assert_eq!(allowed, [true, true, true, false, false, false]);
        // A cost that fits still goes in after larger ones were refused.
        assert_eq!(
            decide(&mut ledger, 9, 1, 7),
            Decided::New(Outcome {
                allowed: true,
                count: 7
            })
        );
    }

    /// TESTING.md C2 at the region: a cost that would take a count past `u64::MAX` is
    /// denied, however high the limit; the count never wraps to admit it.
    #[test]
    fn a_cost_that_would_take_the_count_past_u64_max_is_denied_not_wrapped() {
        let mut ledger = Ledger::default();
        let admitted = Outcome {
            allowed: true,
            count: 5,
        };
        assert_eq!(decide(&mut ledger, 1, 5, u64::MAX), Decided::New(admitted));
        assert_eq!(
            decide(&mut ledger, 2, u64::MAX, u64::MAX),
            Decided::New(Outcome {
                allowed: false,
                count: 5
            })
        );
        assert_eq!(ledger.count(&key()), 5);
        assert_eq!(
            decide(&mut ledger, 3, u64::MAX - 5, u64::MAX),
            Decided::New(Outcome {
                allowed: true,
                count: u64::MAX
            }),
            "up to u64::MAX exactly"
        );
        // Under a small limit too: 5 + (u64::MAX - 1) wrapped would be 3, within 10.
        let mut ledger = Ledger::default();
        assert_eq!(decide(&mut ledger, 1, 5, 10), Decided::New(admitted));
        assert_eq!(
            decide(&mut ledger, 2, u64::MAX - 1, 10),
            Decided::New(Outcome {
                allowed: false,
                count: 5
            })
        );
    }

    #[test]
    fn a_retried_request_id_gets_its_first_outcome_and_counts_nothing_more() {
        let mut ledger = Ledger::default();
        let Decided::New(outcome) = decide(&mut ledger, 1, 3, 10) else {
            panic!()
        };
        for _ in 0..3 {
            assert_eq!(decide(&mut ledger, 1, 3, 10), Decided::Repeat(outcome));
        }
        assert_eq!(ledger.count(&key()), 3);
    }

    #[test]
    fn forgetting_a_nodes_lives_keeps_every_other_nodes_ids_and_the_applications() {
        let mut ledger = Ledger::default();
        let Decided::New(edge) = decide(&mut ledger, 1, 3, 100) else {
            panic!()
        };
        let own = |seq| ExactCheck {
            id: RequestId {
                node: 1,
                generation: 1,
                seq,
            },
            ..check(seq, 3)
        };
        assert!(matches!(
            ledger.decide(&own(1), &key(), 100),
            Decided::New(_)
        ));
        let Decided::New(app) = ledger.decide(&named(0xfeed, 4), &key(), 100) else {
            panic!()
        };
        ledger.forget_lives_of(1);
        // Node 1's numbers are new again; node 2's and the application's are remembered.
        assert!(matches!(
            ledger.decide(&own(1), &key(), 100),
            Decided::New(_)
        ));
        assert_eq!(decide(&mut ledger, 1, 3, 100), Decided::Repeat(edge));
        let retried = ledger.decide(&named(0xfeed, 4), &key(), 100);
        assert_eq!(retried, Decided::Repeat(app));
        assert_eq!(ledger.count(&key()), 10);
    }

    #[test]
    fn an_application_named_check_counts_once_through_any_edge_life_and_after_replay() {
        let named = |node, generation, seq, app_seq| ExactCheck {
            id: RequestId {
                node,
                generation,
                seq,
            },
            check_id: Some(CheckId {
                session: 0xfeed,
                seq: app_seq,
            }),
            ..check(0, 4)
        };
        let mut ledger = Ledger::default();
        let mut records = Vec::new();
        let first = named(2, 1, 10, 7);
        let Decided::New(outcome) = ledger.decide(&first, &key(), 10) else {
            panic!("a new name is decided anew");
        };
        records.push(Entry::Decided(
            log::Record::decided(&first, outcome.allowed).into_owned(),
        ));
        // Its retries: the same edge life, the next life of that edge, another edge.
        for retry in [named(2, 1, 11, 7), named(2, 2, 0, 7), named(3, 5, 40, 7)] {
            assert_eq!(ledger.decide(&retry, &key(), 10), Decided::Repeat(outcome));
        }
        assert_eq!(ledger.count(&key()), 4, "counted once");
        // Another name from the same session is another check.
        assert!(matches!(
            ledger.decide(&named(2, 1, 12, 8), &key(), 10),
            Decided::New(_)
        ));
        // After a region restart, from the log and from a snapshot.
        let mut snapshot = Vec::new();
        Ledger::replay(&records).snapshot(&mut snapshot);
        let from_snapshot = Ledger::replay(&log::replay(&snapshot).0);
        for mut recovered in [Ledger::replay(&records), from_snapshot] {
            let retry = named(4, 1, 0, 7);
            assert_eq!(
                recovered.decide(&retry, &key(), 10),
                Decided::Repeat(outcome)
            );
            assert_eq!(recovered.count(&key()), 4);
        }
    }

    #[test]
    fn an_application_id_sent_with_another_check_is_refused_and_counts_nothing_after_replay_too() {
        let mut ledger = Ledger::default();
        let first = named(0xfeed, 7);
        let Decided::New(outcome) = ledger.decide(&first, &key(), 10) else {
            panic!("a new name is decided anew");
        };
        let records = [Entry::Decided(
            log::Record::decided(&first, outcome.allowed).into_owned(),
        )];
        let mut snapshot = Vec::new();
        Ledger::replay(&records).snapshot(&mut snapshot);
        let (compacted, _) = log::replay(&snapshot);
        assert!(
            compacted
                .iter()
                .any(|entry| matches!(entry, Entry::NamedOutcome { .. })),
            "{compacted:?}"
        );
        let others = [
            ExactCheck {
                subject: "acct-2".into(),
                ..first.clone()
            },
            ExactCheck {
                cost: 2,
                ..first.clone()
            },
            ExactCheck {
                rule: "quota-2".into(),
                ..first.clone()
            },
        ];
        // Sent again through an edge whose window has turned, it is the same check.
        let later = ExactCheck {
            window_index: first.window_index + 1,
            ..first.clone()
        };
        for mut ledger in [ledger, Ledger::replay(&records), Ledger::replay(&compacted)] {
            for other in &others {
                let key = key_of(&other.rule, &other.subject, 500_000, 3_600).unwrap();
                assert_eq!(
                    ledger.decide(other, &key, 10),
                    Decided::IdReused,
                    "{other:?}"
                );
            }
            assert_eq!(ledger.decide(&later, &key(), 10), Decided::Repeat(outcome));
            let counts: Vec<(Key, u64)> = (ledger.counts())
                .map(|(key, count)| (key.clone(), count))
                .collect();
            assert_eq!(counts, [(key(), 1)], "the first check alone is counted");
        }
    }

    #[test]
    fn an_application_ids_outcome_compacted_before_session_47_answers_any_check_under_it() {
        let id = RequestId::client(CheckId {
            session: 0xfeed,
            seq: 7,
        });
        let compacted = Entry::Outcome {
            id,
            allowed: true,
            count: 1,
            window_index: 500_000,
            window_secs: 3_600,
        };
        let mut ledger = Ledger::replay(std::slice::from_ref(&compacted));
        let mut snapshot = Vec::new();
        ledger.snapshot(&mut snapshot);
        assert_eq!(
            log::replay(&snapshot).0.last(),
            Some(&compacted),
            "what it asked stays unknown"
        );
        let other = ExactCheck {
            subject: "acct-2".into(),
            ..named(0xfeed, 7)
        };
        let key = key_of("quota", "acct-2", 500_000, 3_600).unwrap();
        assert_eq!(
            ledger.decide(&other, &key, 10),
            Decided::Repeat(Outcome {
                allowed: true,
                count: 1
            }),
            "the first check's outcome, as before: never counted twice"
        );
    }

    #[test]
    fn an_application_session_s_oldest_names_are_forgotten_never_decided_twice() {
        let mut ledger = Ledger::default();
        let named = |app_seq| named(1, app_seq);
        let total = RECENT_CLIENT_IDS as u64 + 1;
        for app_seq in 0..total {
            assert!(matches!(
                ledger.decide(&named(app_seq), &key(), u64::MAX),
                Decided::New(_)
            ));
        }
        assert_eq!(
            ledger.decide(&named(0), &key(), u64::MAX),
            Decided::Forgotten
        );
        assert!(matches!(
            ledger.decide(&named(1), &key(), u64::MAX),
            Decided::Repeat(_)
        ));
        assert_eq!(ledger.count(&key()), total, "nothing counted twice");
        // The floor survives a snapshot: replayed, the forgotten number stays forgotten.
        let mut entries = Vec::new();
        ledger.snapshot(&mut entries);
        let mut replayed = Ledger::replay(&log::replay(&entries).0);
        assert_eq!(replayed, ledger);
        assert_eq!(
            replayed.decide(&named(0), &key(), u64::MAX),
            Decided::Forgotten
        );
    }

    #[test]
    fn an_application_number_below_the_held_ones_is_forgotten_only_below_the_last_let_go() {
        // Numbers 1,000 on, 16,384 of them decided: none let go yet, so number 5, made
        // before them and never sent, is decided (and let go at once, the oldest held).
        let mut ledger = Ledger::default();
        let held = 1_000..1_000 + RECENT_CLIENT_IDS as u64;
        for app_seq in held.clone() {
            ledger.decide(&named(1, app_seq), &key(), u64::MAX);
        }
        assert!(matches!(
            ledger.decide(&named(1, 5), &key(), u64::MAX),
            Decided::New(_)
        ));
        assert_eq!(
            ledger.decide(&named(1, 5), &key(), u64::MAX),
            Decided::Forgotten
        );
        // One more decided lets number 1,000 go: number 7, below it, is forgotten, but 1,001
        // is still held.
        ledger.decide(&named(1, held.end), &key(), u64::MAX);
        assert_eq!(
            ledger.decide(&named(1, 7), &key(), u64::MAX),
            Decided::Forgotten
        );
        assert!(matches!(
            ledger.decide(&named(1, 1_001), &key(), u64::MAX),
            Decided::Repeat(_)
        ));
    }

    #[test]
    fn a_forgotten_name_stays_forgotten_while_its_window_lives_though_nothing_else_is_held() {
        // A session's first check is of an hour's window; the checks that push it out of
        // the session's most recent are of one-second windows, over long before it.
        let (long, start) = (key(), key().window.start_unix_secs());
        let short = key_of("quota", "acct-1", start, 1).unwrap();
        let mut ledger = Ledger::default();
        let first = ledger.decide(&named(1, 0), &long, u64::MAX);
        assert!(matches!(first, Decided::New(_)));
        for app_seq in 1..=RECENT_CLIENT_IDS as u64 {
            ledger.decide(&named(1, app_seq), &short, u64::MAX);
        }
        let after_short = short.window.live_until_unix_secs();
        ledger.expire(after_short);
        assert_eq!(ledger.count(&short), 0, "the short window is collected");
        let mut entries = Vec::new();
        ledger.snapshot(&mut entries);
        let mut replayed = Ledger::replay(&log::replay(&entries).0);
        replayed.expire(after_short);
        for ledger in [&mut ledger, &mut replayed] {
            assert_eq!(
                ledger.decide(&named(1, 0), &long, u64::MAX),
                Decided::Forgotten,
                "a retry of the first check is never decided again while its window lives"
            );
            assert_eq!(ledger.count(&long), 1);
            ledger.expire(long.window.live_until_unix_secs());
            assert!(ledger.seen.is_empty(), "then the session is let go");
        }
    }

    #[test]
    fn an_application_session_holds_one_entry_per_decision_however_far_apart_its_numbers() {
        let mut ledger = Ledger::default();
        let named = |app_seq| named(9, app_seq);
        for app_seq in [1 << 40, 3, u64::MAX, 7] {
            assert!(matches!(
                ledger.decide(&named(app_seq), &key(), 100),
                Decided::New(_)
            ));
        }
        assert_eq!(ledger.seen[&(log::CLIENT_NODE, 9)].len(), 4);
        // Numbers between them are still unseen, not forgotten.
        assert!(matches!(
            ledger.decide(&named(5), &key(), 100),
            Decided::New(_)
        ));
        assert!(matches!(
            ledger.decide(&named(1 << 40), &key(), 100),
            Decided::Repeat(_)
        ));
        let mut entries = Vec::new();
        ledger.snapshot(&mut entries);
        assert_eq!(Ledger::replay(&log::replay(&entries).0), ledger);
    }

    #[test]
    fn an_edge_lifes_oldest_ids_are_forgotten_never_decided_twice() {
        let mut ledger = Ledger::default();
        let total = RECENT_IDS as u64 + 10;
        for seq in 0..total {
            assert!(matches!(
                decide(&mut ledger, seq, 1, u64::MAX),
                Decided::New(..)
            ));
        }
        for seq in 0..10 {
            assert_eq!(decide(&mut ledger, seq, 1, u64::MAX), Decided::Forgotten);
        }
        assert!(matches!(
            decide(&mut ledger, 10, 1, u64::MAX),
            Decided::Repeat(_)
        ));
        assert_eq!(ledger.count(&key()), total, "nothing counted twice");
    }

    #[test]
    fn a_jump_in_sequence_numbers_forgets_what_it_skips_and_holds_no_more() {
        let mut ledger = Ledger::default();
        assert!(matches!(decide(&mut ledger, 5, 1, 100), Decided::New(_)));
        let far = u64::MAX - 1;
        assert!(matches!(decide(&mut ledger, far, 1, 100), Decided::New(_)));
        let recent = &ledger.seen[&(2, 1)];
        assert!(recent.len() <= RECENT_IDS);
        // Skipped numbers far below are forgotten, never decided; those within reach are
        // new, and the jump's own is a repeat.
        assert_eq!(decide(&mut ledger, 5, 1, 100), Decided::Forgotten);
        assert_eq!(decide(&mut ledger, 6, 1, 100), Decided::Forgotten);
        assert!(matches!(
            decide(&mut ledger, far - 1, 1, 100),
            Decided::New(_)
        ));
        assert!(matches!(
            decide(&mut ledger, far, 1, 100),
            Decided::Repeat(_)
        ));
        assert_eq!(ledger.count(&key()), 3);
    }

    #[test]
    fn expiry_forgets_windows_that_are_over_and_their_ids() {
        let mut ledger = Ledger::default();
        for seq in 0..3 {
            decide(&mut ledger, seq, 1, 100);
        }
        assert!(matches!(decide(&mut ledger, 5, 1, 100), Decided::New(_)));
        let end = key().window.start_unix_secs() + 3_600;
        ledger.expire(end - 1);
        assert_eq!(ledger.count(&key()), 4, "a live window is kept");
        assert!(matches!(decide(&mut ledger, 1, 1, 100), Decided::Repeat(_)));
        // A number skipped below a decided one is still new after an expiry.
        assert!(matches!(decide(&mut ledger, 4, 1, 100), Decided::New(_)));
        // One window length after it ends, nothing of it is held, and it stays over, in
        // a snapshot too.
        ledger.expire(end + 3_600);
        assert_eq!(ledger.count(&key()), 0);
        assert!(ledger.seen.is_empty());
        let mut snapshot = Vec::new();
        ledger.snapshot(&mut snapshot);
        let (entries, _) = log::replay(&snapshot);
        let replayed = Ledger::replay(&entries);
        assert_eq!(replayed, ledger);
        let window = key().window;
        for forgotten in [ledger.forgotten(), replayed.forgotten()] {
            assert!(forgotten.covers(window));
            assert!(forgotten.covers(Window::new(window.index() - 1, 3_600).unwrap()));
            assert!(!forgotten.covers(Window::new(window.index() + 1, 3_600).unwrap()));
            assert!(!forgotten.covers(Window::new(window.index(), 60).unwrap()));
        }
    }

    #[test]
    fn replaying_the_records_rebuilds_counts_and_request_ids() {
        let mut ledger = Ledger::default();
        let mut records = Vec::new();
        for seq in 0..5 {
            let check = check(seq, 3);
            if let Decided::New(outcome) = ledger.decide(&check, &key(), 10) {
                let record = log::Record::decided(&check, outcome.allowed).into_owned();
                records.push(Entry::Decided(record));
            }
        }
        let mut replayed = Ledger::replay(&records);
        assert_eq!(replayed.count(&key()), 9);
        assert!(matches!(
            decide(&mut replayed, 2, 3, 10),
            Decided::Repeat(_)
        ));
    }

    #[test]
    fn a_replay_forgets_the_lives_that_came_in_first_whatever_their_generations() {
        // Node 2 takes its wall clock's reading as its generation (no data directory),
        // and its clock steps back before each restart: lives 400, 300, 200 and 100 come
        // in, in that order, then a snapshot, then life 50. Deciding forgets life 400, the
        // first to come in; a replay of the snapshot and the record after it forgets the
        // same one, not life 50, the lowest generation and the one still running.
        let mut ledger = Ledger::default();
        for generation in [400, 300, 200, 100] {
            let decided = ledger.decide(&in_life(generation, 0), &key(), u64::MAX);
            assert!(matches!(decided, Decided::New(_)), "{decided:?}");
        }
        let mut log = Vec::new();
        ledger.snapshot(&mut log);
        let floors: Vec<u64> = (log::replay(&log).0.iter())
            .filter_map(|entry| match entry {
                Entry::Floor {
                    node: 2,
                    generation,
                    ..
                } => Some(*generation),
                _ => None,
            })
            .collect();
        assert_eq!(floors, [400, 300, 200, 100], "the snapshot's order");
        let last = in_life(50, 0);
        let Decided::New(outcome) = ledger.decide(&last, &key(), u64::MAX) else {
            panic!("life 50's first check is new");
        };
        log::encode(
            &Entry::Decided(log::Record::decided(&last, outcome.allowed)),
            &mut log,
        );
        let mut replayed = Ledger::replay(&log::replay(&log).0);
        assert_eq!(replayed, ledger);
        for ledger in [&mut ledger, &mut replayed] {
            let running = ledger.decide(&in_life(50, 1), &key(), u64::MAX);
            assert!(matches!(running, Decided::New(_)), "{running:?}");
            let first = ledger.decide(&in_life(400, 1), &key(), u64::MAX);
            assert_eq!(first, Decided::Forgotten);
        }
    }

    #[test]
    fn a_copys_snapshot_then_the_records_decided_since_the_copy_replay_to_the_live_ledger() {
        // What a compaction writes while the region goes on deciding (service.rs).
        let decide_logged = |ledger: &mut Ledger, seq: u64, log: &mut Vec<u8>| {
            let mut check = check(seq, 1 + seq % 3);
            check.subject = format!("acct-{}", seq % 5);
            let key = key_of("quota", &check.subject, 500_000, 3_600).unwrap();
            if let Decided::New(outcome) = ledger.decide(&check, &key, 40) {
                log::encode(
                    &Entry::Decided(log::Record::decided(&check, outcome.allowed)),
                    log,
                );
            }
        };
        let mut live = Ledger::default();
        let mut unused = Vec::new();
        for seq in 0..20 {
            decide_logged(&mut live, seq, &mut unused);
        }
        let copy = live.clone();
        let mut since = Vec::new();
        // New ids, a retry of one the copy holds, and checks past the limit.
        for seq in (20..60).chain([3, 25]) {
            decide_logged(&mut live, seq, &mut since);
        }
        let mut compacted = Vec::new();
        copy.snapshot(&mut compacted);
        compacted.extend_from_slice(&since);
        let (entries, read) = log::replay(&compacted);
        assert_eq!(read, compacted.len());
        assert_eq!(Ledger::replay(&entries), live);
        assert_ne!(copy, live, "the records since the copy changed the ledger");
    }

    #[test]
    fn a_snapshot_replays_to_the_same_ledger_and_decides_alike_after() {
        let mut ledger = Ledger::default();
        // Three edge lives, two subjects, repeats, a gap and a jump past RECENT_IDS.
        for (node, generation, seqs) in [
            (2, 1, vec![0, 1, 2, 2, 5, 9]),
            (3, 7, vec![0, 1, 70_000, 69_999]),
            (4, 1, vec![3]),
        ] {
            for seq in seqs {
                let mut check = check(seq, 1 + seq % 3);
                check.id.node = node;
                check.id.generation = generation;
                check.subject = format!("acct-{}", seq % 2);
                let key = key_of("quota", &check.subject, 500_000, 3_600).unwrap();
                ledger.decide(&check, &key, 10);
            }
        }
        let mut entries = Vec::new();
        let written = ledger.snapshot(&mut entries);
        let (replayed, read) = log::replay(&entries);
        assert_eq!((replayed.len() as u64, read), (written, entries.len()));
        let mut copy = Ledger::replay(&replayed);
        assert_eq!(copy, ledger);
        // And it goes on the same: new ids, repeats, forgotten ones.
        for (node, generation, seq) in [(2, 1, 3), (2, 1, 9), (3, 7, 1), (3, 7, 70_001), (5, 1, 0)]
        {
            let mut check = check(seq, 2);
            check.id.node = node;
            check.id.generation = generation;
            let key = key();
            assert_eq!(
                copy.decide(&check, &key, 10),
                ledger.decide(&check, &key, 10),
                "{node}/{generation}/{seq}"
            );
        }
        assert_eq!(copy, ledger);
    }

    #[test]
    fn a_random_stream_of_checks_expiries_and_compactions_replays_to_the_live_ledger() {
        // A live ledger and its log (compacted now and then, the service's way: a copy's
        // snapshot, then the records decided since), replayed after every step, must hold
        // and decide alike: named and edge ids, ids reused with another check, windows
        // expired (from a review, session 47).
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        for round in 0..100 {
            let mut live = Ledger::default();
            let mut log_bytes = Vec::new();
            let mut copy: Option<(Ledger, Vec<u8>)> = None;
            let mut now = 500_000 * 60;
            for step in 0..300 {
                match next(10) {
                    0 => {
                        now += next(90);
                        live.expire(now);
                    }
                    1 if copy.is_none() => copy = Some((live.clone(), Vec::new())),
                    2 => {
                        if let Some((frozen, since)) = copy.take() {
                            let mut compacted = Vec::new();
                            frozen.snapshot(&mut compacted);
                            compacted.extend_from_slice(&since);
                            log_bytes = compacted;
                        }
                    }
                    _ => {
                        let named_id = next(3) != 0;
                        let seq = next(12);
                        let index = now / 60 + next(2) - next(2).min(now / 60);
                        let mut check = ExactCheck {
                            id: RequestId {
                                node: 2,
                                generation: 1,
                                seq: step,
                            },
                            check_id: named_id.then_some(CheckId {
                                session: next(3),
                                seq,
                            }),
                            rule: "quota".into(),
                            subject: format!("acct-{}", next(3)),
                            window_index: index,
                            window_secs: 60,
                            cost: 1 + next(3),
                        };
                        if !named_id {
                            check.id.seq = seq;
                        }
                        let key = key_of("quota", &check.subject, index, 60).unwrap();
                        if !key.window.is_live(now) || live.forgotten().covers(key.window) {
                            continue;
                        }
                        if let Decided::New(outcome) = live.decide(&check, &key, 6) {
                            let mut record = Vec::new();
                            log::encode(
                                &Entry::Decided(log::Record::decided(&check, outcome.allowed)),
                                &mut record,
                            );
                            log_bytes.extend_from_slice(&record);
                            if let Some((_, since)) = &mut copy {
                                since.extend_from_slice(&record);
                            }
                        }
                    }
                }
                // A restart now: the log replayed, then expired at the same time.
                let (entries, read) = log::replay(&log_bytes);
                assert_eq!(read, log_bytes.len());
                let mut replayed = Ledger::replay(&entries);
                replayed.expire(now);
                let mut live_expired = live.clone();
                live_expired.expire(now);
                assert_eq!(
                    replayed.counts, live_expired.counts,
                    "round {round} step {step}: counts"
                );
                let ids = |ledger: &Ledger| {
                    let mut ids: Vec<_> = (ledger.seen.iter())
                        .map(|(life, recent)| {
                            let held: Vec<_> = recent.held().collect();
                            (*life, recent.base, recent.floor_until, held)
                        })
                        .collect();
                    ids.sort_by_key(|(life, ..)| *life);
                    ids
                };
                assert_eq!(
                    ids(&replayed),
                    ids(&live_expired),
                    "round {round} step {step}: ids"
                );
                // Decided alike from here, as the service decides (a window live and not
                // forgotten).
                for probe in 0..4u64 {
                    let check = ExactCheck {
                        id: RequestId {
                            node: 2,
                            generation: 1,
                            seq: probe * 3,
                        },
                        check_id: (probe % 2 == 0).then_some(CheckId {
                            session: probe % 3,
                            seq: probe * 2,
                        }),
                        rule: "quota".into(),
                        subject: format!("acct-{}", probe % 3),
                        window_index: now / 60 - probe % 2,
                        window_secs: 60,
                        cost: 1 + probe % 3,
                    };
                    let key = key_of("quota", &check.subject, check.window_index, 60).unwrap();
                    let decide = |ledger: &Ledger| {
                        let mut ledger = ledger.clone();
                        match ledger.recall(&check) {
                            Some(held) => Some(held),
                            None if !key.window.is_live(now)
                                || ledger.forgotten().covers(key.window) =>
                            {
                                None
                            }
                            None => Some(ledger.decide(&check, &key, 6)),
                        }
                    };
                    assert_eq!(
                        decide(&replayed),
                        decide(&live_expired),
                        "round {round} step {step}: {check:?}"
                    );
                }
                // Replayed with a clock stepped back (no expiry): a window the live ledger
                // forgot is over, or its records are back.
                let replayed = Ledger::replay(&entries);
                for (len, through) in &live_expired.forgotten.through {
                    let window = Window::new(*through, *len).unwrap();
                    assert!(
                        replayed.forgotten.covers(window)
                            || replayed.counts.keys().any(|key| key.window == window)
                            || replayed.seen.values().any(|recent| recent
                                .held()
                                .any(|(_, (_, held, _))| held == window)),
                        "round {round} step {step}: window {window:?} reopened"
                    );
                }
            }
        }
    }
}
