//! Many counters with versioned lanes: the state that gossip keeps in sync.

use crate::cells::{Cells, CounterRef, OriginIndex, Replicas};
use crate::delta::size;
use crate::key_table::{KeyId, KeyTable};
use crate::version_index::VersionIndex;
use crate::{
    Counter, Delta, Digest, Generation, HeldVersions, Key, KeyRef, Lane, LaneUpdate, NodeId,
    OriginDelta, Overflow, ReplicaId, Settled, Stamp, Version, Watermark, Window, DELTA_BYTES_MIN,
};
use std::collections::BTreeMap;

/// Every counter a node holds, with the per-origin bookkeeping that delta sync needs.
///
/// Architecture Invariant: for every origin, the watermark covers exactly the lanes held:
/// a node whose watermark for an origin is `v` holds every lane of that origin whose
/// current version at the origin is at most `v`. Deltas are cut in version order so a
/// partial send keeps this true, and so is what [`CounterMap::apply`] leaves out at its
/// key cap ([`CounterMap::with_keys_max`]) or past its lane rate
/// ([`CounterMap::with_lane_rate_max`]).
#[derive(Debug, Clone)]
pub struct CounterMap {
    keys: KeyTable,
    origins: BTreeMap<ReplicaId, Origin>,
    // Invariant: every origin in `origins` at its index, and no other.
    replicas: Replicas,
    // Lanes from peers may add keys only while fewer than this are held.
    keys_max: usize,
    // A lane from a peer may hold at most this much per second of its window's age.
    lane_rate_max: u64,
    // Invariant: rises on every change to a lane or a counter's presence.
    changes: u64,
}

/// The clock skew between nodes the lane rate allows for: a lane from a peer is held to the
/// rate over the seconds its window has run by this node's clock plus this many, so a
/// writer whose clock runs up to this far ahead, holding its own writes to the rate by its
/// own clock ([`lane_within_rate`]), has its lanes taken. 90 s, the skew tally is tested
/// under (TESTING.md T1).
pub const LANE_RATE_SKEW_SECS: u64 = 90;

impl Default for CounterMap {
    fn default() -> CounterMap {
        CounterMap {
            keys: KeyTable::with_seed(0),
            origins: BTreeMap::new(),
            replicas: Replicas::default(),
            keys_max: usize::MAX,
            lane_rate_max: u64::MAX,
            changes: 0,
        }
    }
}

/// What the map holds of one origin.
#[derive(Debug, Clone)]
struct Origin {
    // What its lanes name it by.
    index: OriginIndex,
    watermark: Watermark,
    // Invariant: one entry per lane of this origin held in `keys`, at its version, naming
    // its key's id.
    by_version: VersionIndex,
    // Pushes merged whole past a gap, if any, above the watermark.
    ahead: Option<Run>,
}

/// Pushes of one origin merged whole past a gap, one after another: every lane of the
/// origin whose version was in `(after, through.version]` when it was pushed is held. The
/// watermark takes `through` once it reaches `after` ([`CounterMap::apply_since`]), so a
/// holder that missed one push catches up as soon as the gap below the pushes is filled,
/// by whichever peer fills it, rather than only when an answer covers its newest push too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    after: Version,
    through: Watermark,
}

impl Run {
    /// `run` with a push of `(after, through]` merged whole: the two joined where they meet
    /// or overlap; otherwise the newer of them (a push missed between them starts a new
    /// run).
    fn with(run: Option<Run>, after: Version, through: Watermark) -> Run {
        let push = Run { after, through };
        match run {
            Some(run) if after <= run.through.version && run.after <= through.version => Run {
                after: run.after.min(after),
                through: Watermark {
                    version: run.through.version.max(through.version),
                    stamp: run.through.stamp.max(through.stamp),
                },
            },
            Some(run) if run.through.version > through.version => run,
            _ => push,
        }
    }
}

/// What applying a delta changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// Keys whose value may have changed, in no particular order, without repeats.
    pub keys: Vec<Key>,
    /// Lane updates that raised a lane.
    pub lanes_raised: usize,
    /// Lane updates skipped because their window had already expired here.
    pub lanes_expired: usize,
    /// Lane updates left out because they would have added a key to a map holding its
    /// `keys_max`: the first such of an origin's entry and every later one of that entry.
    pub lanes_refused: usize,
    /// Lane updates left out because their totals passed `lane_rate_max` for each second
    /// of their window so far: the first such of an origin's entry and every later one.
    pub lanes_throttled: usize,
    /// Lane updates left out because their version already names another key of their
    /// origin here: the origin wrote two lanes under one version, as a replica id reused
    /// by a life that lost its state does (or a member forging lanes). The first such of
    /// an origin's entry and every later one.
    pub lanes_clashing: usize,
}

impl CounterMap {
    /// An empty map.
    pub fn new() -> CounterMap {
        CounterMap::default()
    }

    /// The map, taking lanes from peers ([`CounterMap::apply`]) that add a key only while
    /// it holds fewer than `keys_max` keys. Its own writes ([`CounterMap::write`]) are never
    /// refused, so it holds at most `keys_max` keys plus those its own writes add past it.
    pub fn with_keys_max(mut self, keys_max: usize) -> CounterMap {
        self.keys_max = keys_max;
        self
    }

    /// The map, taking a lane from peers ([`CounterMap::apply`]) only while its two totals
    /// add up to at most `per_sec` for each second its window has run (counting the first
    /// second, so a lane is never held to less than one second's worth), and
    /// [`LANE_RATE_SKEW_SECS`] more for the writer's clock. `u64::MAX`, the default, holds
    /// lanes to nothing. Peers are trusted to relay other origins' lanes, and a merge keeps
    /// the larger total: this bounds what a relayed lane can claim, with no state and
    /// whenever it arrives. A lane over it waits, with every later lane of its origin,
    /// until its window is old enough to cover it.
    pub fn with_lane_rate_max(mut self, per_sec: u64) -> CounterMap {
        self.lane_rate_max = per_sec;
        self
    }

    /// The map, its keys hashed under `seed` (foldhash, both of its seeds drawn from this
    /// one). A map that takes keys from clients or peers needs a seed they cannot learn (a
    /// node draws one at start), so that they cannot choose keys that collide in its hash
    /// table; the default, 0, suits a map whose keys are trusted, as in tests and the
    /// simulator. foldhash does not claim to resist an attacker who studies a long-running
    /// process to recover its seed; the map never shows its hash order (it iterates by id).
    pub fn with_hash_seed(mut self, seed: u64) -> CounterMap {
        self.keys.reseed(seed);
        self
    }

    /// The counter at `key`, if any lane of it is held.
    pub fn counter(&self, key: &Key) -> Option<CounterRef<'_>> {
        let cells = self.keys.cells(self.keys.id(key)?)?;
        Some(CounterRef::new(cells, &self.replicas))
    }

    /// Every key holding a lane of `node`, in any of its lives, with its counter: a key
    /// with lanes of several lives comes once for each.
    pub fn keys_of(&self, node: NodeId) -> impl Iterator<Item = (KeyRef<'_>, CounterRef<'_>)> {
        let lives =
            ReplicaId::new(node, Generation(0))..=ReplicaId::new(node, Generation(u64::MAX));
        self.origins
            .range(lives)
            .flat_map(|(_, origin)| origin.by_version.ids())
            .filter_map(|id| {
                let (key, cells) = self.keys.get(id)?;
                Some((key, CounterRef::new(cells, &self.replicas)))
            })
    }

    /// The value at `key`: zero if nothing is held.
    pub fn value(&self, key: &Key) -> i128 {
        self.counter(key).map_or(0, |counter| counter.value())
    }

    /// Every key and its counter, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (KeyRef<'_>, CounterRef<'_>)> {
        (self.keys.iter()).map(|(_, key, cells)| (key, CounterRef::new(cells, &self.replicas)))
    }

    /// A number that rises whenever a lane rises or a counter is dropped, so a caller can
    /// tell cheaply whether anything changed since it last looked.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// How many counters are held.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no counter is held.
    pub fn is_empty(&self) -> bool {
        self.keys.len() == 0
    }

    /// How many lanes are held, over all counters.
    pub fn lanes(&self) -> usize {
        self.origins.values().map(|o| o.by_version.len()).sum()
    }

    /// The watermark held for `origin`.
    pub fn watermark(&self, origin: ReplicaId) -> Watermark {
        self.origins
            .get(&origin)
            .map(|o| o.watermark)
            .unwrap_or_default()
    }

    /// The highest version of `origin` held: its watermark's, or a lane's held past a gap
    /// (merged from a push that followed versions not held yet).
    pub fn top(&self, origin: ReplicaId) -> Version {
        self.origins.get(&origin).map_or(Version::ZERO, |origin| {
            let last = origin.by_version.last().unwrap_or_default();
            origin.watermark.version.max(last)
        })
    }

    /// Every origin of which this map holds a watermark or lanes, in order.
    pub fn origins(&self) -> impl Iterator<Item = ReplicaId> + '_ {
        self.origins.keys().copied()
    }

    /// What this map holds, per origin.
    pub fn digest(&self) -> Digest {
        Digest {
            origins: self
                .origins
                .iter()
                .map(|(replica, origin)| (*replica, origin.watermark))
                .collect(),
        }
    }

    /// What this map holds of `origin`, to compare with a peer's
    /// ([`CounterMap::settled_differs`]), if it holds anything of it.
    pub fn settled(&self, origin: ReplicaId) -> Option<Settled> {
        let held = self.origins.get(&origin)?;
        Some(Settled {
            origin,
            version: held.watermark.version,
            lanes: held.by_version.len() as u64,
            versions_hash: held.by_version.versions_hash(),
        })
    }

    /// Whether this map's holdings of an origin differ from a peer's `theirs` at the same
    /// watermark: then one of them has lanes of it the other lacks, which no digest shows.
    pub fn settled_differs(&self, theirs: &Settled) -> bool {
        self.settled(theirs.origin).is_some_and(|mine| {
            mine.version == theirs.version
                && (mine.lanes, mine.versions_hash) != (theirs.lanes, theirs.versions_hash)
        })
    }

    /// The versions of `origin`'s lanes held, at most `most` (at least 1) of them, from the
    /// `start`-th (counted round from the first), for a peer to answer with what this map
    /// lacks in their span ([`CounterMap::lanes_not_held`]). The span runs from just past
    /// the version before the first listed (from 0 for the first), to the last listed (to
    /// `u64::MAX` for the last), so the spans of lists from consecutive starts meet, and a
    /// list of every lane covers every version. `None` if nothing of `origin` is held.
    pub fn held_versions(
        &self,
        origin: ReplicaId,
        start: usize,
        most: usize,
    ) -> Option<HeldVersions> {
        let held = self.origins.get(&origin)?;
        let count = held.by_version.len();
        let start = start.checked_rem(count).unwrap_or(0);
        let mut all = (held.by_version.range_from(Version::ZERO)).map(|(version, _)| version);
        let before = start.checked_sub(1).and_then(|before| all.nth(before));
        let versions: Vec<Version> = all.take(most.max(1)).collect();
        let from = before.map_or(Version::ZERO, Version::next);
        let through = if start + versions.len() >= count {
            Version(u64::MAX)
        } else {
            versions.last().copied().unwrap_or_default()
        };
        Some(HeldVersions {
            origin,
            version: held.watermark.version,
            from,
            through,
            versions,
        })
    }

    /// The lanes of `theirs.origin` held here in the span of `theirs` whose versions it
    /// does not list, if this map holds the origin at the same watermark: as many as fit in
    /// `bytes_max` (raised to [`DELTA_BYTES_MIN`]), from a place `rotate` picks among them,
    /// going round from there, sent in version order. The entry's `through` is the common
    /// watermark with no stamp, so it raises nothing.
    ///
    /// A lane unlisted there may be an earlier copy of a key the peer holds under a newer
    /// version, which its merge takes nothing from; the list does not say. Taken always
    /// from the lowest version, such copies could fill every answer and hold back the lanes
    /// the peer lacks for good (found in review); from a place picked anew each time, every
    /// unlisted lane is sent as often as any other.
    pub fn lanes_not_held(&self, theirs: &HeldVersions, bytes_max: usize, rotate: usize) -> Delta {
        let mut delta = Delta::default();
        let Some(origin) = (self.origins.get(&theirs.origin))
            .filter(|origin| origin.watermark.version == theirs.version)
        else {
            return delta;
        };
        let unlisted: Vec<(Version, KeyId)> = (origin.by_version.range_from(theirs.from))
            .take_while(|&(version, _)| version <= theirs.through)
            .filter(|(version, _)| theirs.versions.binary_search(version).is_err())
            .collect();
        let mut budget = bytes_max.max(DELTA_BYTES_MIN) - size::DELTA_HEADER - size::ORIGIN_HEADER;
        let start = rotate.checked_rem(unlisted.len()).unwrap_or(0);
        let mut taken = Vec::new();
        for &(version, id) in unlisted[start..].iter().chain(&unlisted[..start]) {
            let cost = size::lane(self.key_held(theirs.origin, id).0);
            if cost > budget {
                break;
            }
            budget -= cost;
            taken.push((version, id));
        }
        taken.sort_unstable_by_key(|&(version, _)| version);
        if !taken.is_empty() {
            delta.origins.push(OriginDelta {
                origin: theirs.origin,
                through: Watermark {
                    version: theirs.version,
                    stamp: Stamp::default(),
                },
                lanes: (taken.into_iter())
                    .map(|(version, id)| self.lane_update(origin, version, id))
                    .collect(),
            });
        }
        delta
    }

    /// The key and lanes at `id`, which `origin`'s version index names. Panics if it is not
    /// held: the index and the key table disagree.
    fn key_held(&self, origin: ReplicaId, id: KeyId) -> (KeyRef<'_>, &Cells) {
        let Some(held) = self.keys.get(id) else {
            panic!("{origin}'s version index names key id {id:?}, which is not held");
        };
        held
    }

    /// `origin`'s lane of the key at `id`, sent under `version`.
    fn lane_update(&self, origin: &Origin, version: Version, id: KeyId) -> LaneUpdate {
        let (key, cells) = self.key_held(self.replicas.replica(origin.index), id);
        LaneUpdate {
            key: key.to_key(),
            lane: cells
                .get(origin.index)
                .map(|(lane, _)| lane)
                .unwrap_or_default(),
            version,
        }
    }

    /// Adds `amount` to `replica`'s lane at `key`, as a write by that replica at clock
    /// reading `stamp`. On overflow nothing changes.
    pub fn incr(
        &mut self,
        replica: ReplicaId,
        key: &Key,
        amount: u64,
        stamp: Stamp,
    ) -> Result<Version, Overflow> {
        let mut lane = self.lane(key, replica);
        lane.incr(amount)?;
        Ok(self.write(replica, key, lane, stamp))
    }

    /// Adds `amount` to `replica`'s decrements at `key`. On overflow nothing changes.
    pub fn decr(
        &mut self,
        replica: ReplicaId,
        key: &Key,
        amount: u64,
        stamp: Stamp,
    ) -> Result<Version, Overflow> {
        let mut lane = self.lane(key, replica);
        lane.decr(amount)?;
        Ok(self.write(replica, key, lane, stamp))
    }

    /// Records `replica`'s own lane at `key` as `totals` (merged with what is held, so a
    /// stale snapshot never lowers it). If the lane rose, the write takes the replica's
    /// next version. Returns the lane's version after the write.
    ///
    /// Only the replica itself may call this for its lanes: versions are its own count.
    pub fn write(&mut self, replica: ReplicaId, key: &Key, totals: Lane, stamp: Stamp) -> Version {
        self.write_lane(replica, key, totals, stamp, false)
    }

    /// Gives `replica`'s lane at `key` the replica's next version, its totals unchanged, so
    /// that every holder of an older version takes them. `None` if no such lane is held, or
    /// if the replica's versions are used up (`u64::MAX` held, as only a lane a member
    /// forged can make it): the next version would name two lanes.
    ///
    /// For a node that re-published an earlier life's lanes from its log and finds a peer
    /// holding larger totals for one of them under a version both hold (the log was behind
    /// what peers had): a version then names two states, and no digest shows the
    /// difference. Only the replica's own node may call this: versions are its own count.
    pub fn restamp(&mut self, replica: ReplicaId, key: &Key, stamp: Stamp) -> Option<Version> {
        let lane = self.counter(key)?.slot(replica)?.lane;
        if self.top(replica) == Version(u64::MAX) {
            return None;
        }
        Some(self.write_lane(replica, key, lane, stamp, true))
    }

    /// [`CounterMap::write`], taking the next version even if the lane does not rise when
    /// `fresh`.
    fn write_lane(
        &mut self,
        replica: ReplicaId,
        key: &Key,
        totals: Lane,
        stamp: Stamp,
        fresh: bool,
    ) -> Version {
        let origin = origin_entry(&mut self.origins, &mut self.replicas, replica);
        let (id, cells) = self.keys.entry(key);
        let held = cells.get(origin.index);
        origin.watermark.stamp = origin.watermark.stamp.max(stamp);
        let mut lane = held.map(|(lane, _)| lane).unwrap_or_default();
        lane.merge(totals);
        if let Some((held_lane, held_version)) = held {
            if lane == held_lane && !fresh {
                return held_version;
            }
        }
        // Above every version held of it, lanes taken past a gap included, so that the
        // new version names this lane alone.
        let last = origin.by_version.last().unwrap_or_default();
        let version = origin.watermark.version.max(last).next();
        origin.watermark.version = version;
        if let Some((_, old)) = held {
            origin.by_version.remove(old);
        }
        origin.by_version.insert(version, id);
        self.changes += 1;
        cells.merge(&self.replicas, origin.index, lane, version);
        version
    }

    /// Moves `origin`'s version up to at least `floor` without a write, so that every later
    /// write of that origin's lanes is newer than any copy a peer may hold.
    ///
    /// For a node that re-publishes a retired replica of its own from its durable log after
    /// a restart: the peers may hold that replica's lanes at versions this map never saw,
    /// and a lane written at a lower version would be ignored by them.
    pub fn raise_version(&mut self, origin: ReplicaId, floor: Version) {
        let origin = origin_entry(&mut self.origins, &mut self.replicas, origin);
        origin.watermark.version = origin.watermark.version.max(floor);
    }

    /// Moves `origin`'s clock reading forward without a write: the origin says it has
    /// nothing newer than its watermark as of `stamp`.
    pub fn touch(&mut self, origin: ReplicaId, stamp: Stamp) {
        let origin = origin_entry(&mut self.origins, &mut self.replicas, origin);
        origin.watermark.stamp = origin.watermark.stamp.max(stamp);
    }

    /// `replica`'s lane at `key`, or an empty lane.
    pub fn lane(&self, key: &Key, replica: ReplicaId) -> Lane {
        let lane = || {
            let index = self.origins.get(&replica)?.index;
            let (lane, _) = self.keys.cells(self.keys.id(key)?)?.get(index)?;
            Some(lane)
        };
        lane().unwrap_or_default()
    }

    /// The lanes a peer with digest `peer` lacks, per origin in version order, cut so the
    /// encoded delta stays within `bytes_max`. The origins the peer lacks anything of are
    /// visited starting at the `rotate`-th of them (modulo their number), so that repeated
    /// budget-cut sends serve each in turn: counted over all origins, the one after a
    /// large backlog came first once in as many sends as there are origins, and waited
    /// behind the backlog in the rest. A `bytes_max` below [`DELTA_BYTES_MIN`] is raised to it, so that a
    /// lane of the longest key fits in a delta with nothing else; one that an origin's
    /// stamp-only entry came first in may carry no lane, and a later send, starting at
    /// another origin, carries it. An origin whose lanes the peer holds but whose stamp is
    /// older gets an entry with no lanes, carrying the newer stamp.
    ///
    /// Lanes held past a gap (above this map's watermark for their origin, merged from a
    /// push that followed versions not held yet) show in no digest, so they go to every
    /// peer whose watermark is below them. Otherwise they could be stranded: once the
    /// origin has lost its state, nothing ever raises the watermarks past them.
    pub fn delta_for(&self, peer: &Digest, bytes_max: usize, rotate: usize) -> Delta {
        self.delta_for_origins(peer, bytes_max, rotate, |_, _| true)
    }

    /// [`CounterMap::delta_for`], for only the origins that `pick` accepts, given each
    /// with the peer's watermark for it. The others are left out whole.
    pub fn delta_for_origins(
        &self,
        peer: &Digest,
        bytes_max: usize,
        rotate: usize,
        pick: impl Fn(ReplicaId, Watermark) -> bool,
    ) -> Delta {
        let mut delta = Delta::default();
        let mut budget = bytes_max.max(DELTA_BYTES_MIN) - size::DELTA_HEADER;
        let lacked: Vec<_> = (self.origins.iter())
            .filter_map(|(replica, origin)| {
                let theirs = peer.origins.get(replica).copied().unwrap_or_default();
                let lacks_lanes = origin.watermark.version > theirs.version
                    || origin.by_version.last() > Some(theirs.version);
                let lacks_stamp = origin.watermark.stamp > theirs.stamp;
                let lacks = lacks_lanes || lacks_stamp;
                (lacks && pick(*replica, theirs)).then_some((replica, origin, theirs))
            })
            .collect();
        let start = rotate.checked_rem(lacked.len()).unwrap_or(0);
        let ordered = lacked[start..].iter().chain(&lacked[..start]);
        for &(replica, origin, theirs) in ordered {
            if budget < size::ORIGIN_HEADER {
                break;
            }
            budget -= size::ORIGIN_HEADER;
            let (entry, cut) = self.origin_delta(*replica, origin, theirs, &mut budget);
            if !entry.lanes.is_empty() || !cut {
                delta.origins.push(entry);
            }
            if cut {
                break;
            }
        }
        delta
    }

    /// `origin`'s lanes with versions above `after`, in version order, cut so the entry
    /// stays within `bytes_max` (raised to [`DELTA_BYTES_MIN`]). Used to push fresh own
    /// lanes eagerly; the receiver applies it with [`CounterMap::apply_since`]. `None` if
    /// nothing of `origin` is held.
    pub fn lanes_since(
        &self,
        origin: ReplicaId,
        after: Version,
        bytes_max: usize,
    ) -> Option<OriginDelta> {
        let held = self.origins.get(&origin)?;
        let mut budget = bytes_max.max(DELTA_BYTES_MIN) - size::DELTA_HEADER - size::ORIGIN_HEADER;
        let theirs = Watermark {
            version: after,
            stamp: Stamp::default(),
        };
        Some(self.origin_delta(origin, held, theirs, &mut budget).0)
    }

    /// Applies lanes that a sender says follow its version `after` of their origin. If this
    /// map holds the origin only below `after`, there is a gap: the lanes are merged, but
    /// the watermark and stamp stay where they are, since versions in the gap are missing.
    /// Pushes merged whole past the gap are remembered as a run (joined while each follows
    /// the last), and the watermark takes the run's `through` once anything (a push, an
    /// answer) brings it up to the run's start.
    pub fn apply_since(
        &mut self,
        after: Version,
        entry: &OriginDelta,
        at: impl Into<AppliedAt>,
    ) -> Applied {
        let held = self.watermark(entry.origin);
        if held.version >= after {
            return self.apply(
                &Delta {
                    origins: vec![entry.clone()],
                },
                at,
            );
        }
        let mut gapped = entry.clone();
        gapped.through = held;
        let applied = self.apply(
            &Delta {
                origins: vec![gapped],
            },
            at,
        );
        let whole = applied.lanes_refused + applied.lanes_throttled + applied.lanes_clashing == 0;
        let origin = origin_entry(&mut self.origins, &mut self.replicas, entry.origin);
        origin.ahead = whole.then(|| Run::with(origin.ahead, after, entry.through));
        applied
    }

    /// The lanes of `origin` a holder at `theirs` lacks, and whether `budget` cut them.
    fn origin_delta(
        &self,
        replica: ReplicaId,
        origin: &Origin,
        theirs: Watermark,
        budget: &mut usize,
    ) -> (OriginDelta, bool) {
        let mut entry = OriginDelta {
            origin: replica,
            through: origin.watermark,
            lanes: Vec::new(),
        };
        let after = Version(theirs.version.0.saturating_add(1));
        for (version, id) in origin.by_version.range_from(after) {
            let cost = size::lane(self.key_held(replica, id).0);
            if cost > *budget {
                // The receiver will hold everything up to the last lane sent (never past
                // what this map itself holds completely), and nothing shows that it has
                // the origin's newest stamp: the entry carries none, so the receiver keeps
                // its own. (`theirs.stamp` may be only what this map supposes the receiver
                // holds: a digest's unlisted origins are read at its sender's `unlisted`
                // clock, too new for a receiver that has never heard the origin.)
                let last = entry.lanes.last().map_or(theirs.version, |l| l.version);
                entry.through = Watermark {
                    version: last.min(origin.watermark.version),
                    stamp: Stamp::default(),
                };
                return (entry, true);
            }
            *budget -= cost;
            entry.lanes.push(self.lane_update(origin, version, id));
        }
        (entry, false)
    }

    /// Merges a delta. Lanes of windows no longer live at `at.live_at_unix_secs` are
    /// skipped (they were collected here and must not come back). Idempotent, and total: a
    /// delta never makes a lane or a watermark go back.
    ///
    /// An origin's entry is taken only up to its first lane of a key not held while the map
    /// is at its key cap ([`Applied::lanes_refused`]), whose totals pass the lane rate
    /// ([`Applied::lanes_throttled`]), or whose version names another key of its origin
    /// ([`Applied::lanes_clashing`]): that lane and the rest are left out, and the
    /// origin's watermark rises only to the version below it, its stamp not at all. So the
    /// map never claims what it left out: peers send it again while it is behind, and its
    /// staleness for the origin rises until expiry makes room or the window grows old
    /// enough.
    pub fn apply(&mut self, delta: &Delta, at: impl Into<AppliedAt>) -> Applied {
        let AppliedAt {
            live_at_unix_secs,
            now_unix_secs,
        } = at.into();
        let mut applied = Applied::default();
        let writer_now = now_unix_secs.saturating_add(LANE_RATE_SKEW_SECS);
        for entry in &delta.origins {
            let origin = origin_entry(&mut self.origins, &mut self.replicas, entry.origin);
            let mut refused_at = None;
            for (index, update) in entry.lanes.iter().enumerate() {
                if !update.key.window.is_live(live_at_unix_secs) {
                    applied.lanes_expired += 1;
                    continue;
                }
                let left_out = &entry.lanes[index..];
                // An honest sender's lanes run in version order; the lowest left out
                // holds the watermark down even if they do not.
                let lowest = || left_out.iter().map(|update| update.version).min();
                let (lane, window) = (update.lane, update.key.window);
                if !lane_within_rate(lane, window, self.lane_rate_max, writer_now) {
                    applied.lanes_throttled += left_out.len();
                    refused_at = lowest();
                    break;
                }
                let named = origin.by_version.get(update.version);
                if named.is_some_and(|id| !self.keys.holds(id, &update.key)) {
                    applied.lanes_clashing += left_out.len();
                    refused_at = lowest();
                    break;
                }
                let full = self.keys.len() >= self.keys_max;
                if full && self.keys.id(&update.key).is_none() {
                    applied.lanes_refused += left_out.len();
                    refused_at = lowest();
                    break;
                }
                let (id, cells) = self.keys.entry(&update.key);
                let old_version = cells.get(origin.index).map(|(_, version)| version);
                let raised = cells.merge(&self.replicas, origin.index, update.lane, update.version);
                if !raised {
                    continue;
                }
                applied.lanes_raised += 1;
                self.changes += 1;
                applied.keys.push(update.key.clone());
                let new_version = cells.get(origin.index).map(|(_, version)| version);
                if old_version != new_version {
                    if let Some(old) = old_version {
                        origin.by_version.remove(old);
                    }
                    if let Some(new) = new_version {
                        origin.by_version.insert(new, id);
                    }
                }
            }
            match refused_at {
                None => {
                    origin.watermark.version = origin.watermark.version.max(entry.through.version);
                    origin.watermark.stamp = origin.watermark.stamp.max(entry.through.stamp);
                }
                Some(refused) => {
                    // The entry's lanes run from the holder's watermark, so everything
                    // below the lowest left out is held.
                    let below = Version(refused.0.saturating_sub(1)).min(entry.through.version);
                    origin.watermark.version = origin.watermark.version.max(below);
                }
            }
            if let Some(run) = origin.ahead {
                if origin.watermark.version >= run.after {
                    origin.watermark.version = origin.watermark.version.max(run.through.version);
                    origin.watermark.stamp = origin.watermark.stamp.max(run.through.stamp);
                    origin.ahead = None;
                }
            }
        }
        applied.keys.sort_unstable();
        applied.keys.dedup();
        applied
    }

    /// Drops every counter whose window is no longer live at `now_unix_secs`, then every
    /// origin left with no lanes for which `keep_origin` is false (a retired generation,
    /// a dead node). Returns how many counters were dropped.
    pub fn expire(&mut self, now_unix_secs: u64, keep_origin: impl Fn(ReplicaId) -> bool) -> usize {
        let expired: Vec<KeyId> = (self.keys)
            .ids_in_windows(|window| !window.is_live(now_unix_secs))
            .collect();
        for &id in &expired {
            self.changes += 1;
            if let Some(cells) = self.keys.remove(id) {
                for (index, version) in cells.versions() {
                    let replica = self.replicas.replica(index);
                    if let Some(origin) = self.origins.get_mut(&replica) {
                        origin.by_version.remove(version);
                    }
                }
            }
        }
        if self.keys.is_sparse() {
            let (origins, replicas) = (&mut self.origins, &self.replicas);
            self.keys.compact(|from, to, cells| {
                for (index, version) in cells.versions() {
                    if let Some(origin) = origins.get_mut(&replicas.replica(index)) {
                        origin.by_version.rename(version, from, to);
                    }
                }
            });
        }
        let replicas = &mut self.replicas;
        self.origins.retain(|replica, origin| {
            let keep = !origin.by_version.is_empty() || keep_origin(*replica);
            if !keep {
                replicas.remove(origin.index);
            }
            keep
        });
        expired.len()
    }
}

/// `replica`'s entry in `origins`, added with a new index in `replicas` if not held.
fn origin_entry<'a>(
    origins: &'a mut BTreeMap<ReplicaId, Origin>,
    replicas: &mut Replicas,
    replica: ReplicaId,
) -> &'a mut Origin {
    origins.entry(replica).or_insert_with(|| Origin {
        index: replicas.add(replica),
        watermark: Watermark::default(),
        by_version: VersionIndex::default(),
        ahead: None,
    })
}

/// The times a delta is applied at: the one windows end by (`tallyd` paces its wall clock
/// for it, so that a clock stepped forward ends no live window early) and the wall clock
/// the lane rate is checked against. A single time stands for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppliedAt {
    /// Lanes of windows no longer live at this time are skipped.
    pub live_at_unix_secs: u64,
    /// A lane past the rate by this time (and [`LANE_RATE_SKEW_SECS`]) is throttled.
    pub now_unix_secs: u64,
}

impl From<u64> for AppliedAt {
    fn from(now_unix_secs: u64) -> AppliedAt {
        AppliedAt {
            live_at_unix_secs: now_unix_secs,
            now_unix_secs,
        }
    }
}

/// Whether `window` has started by `now_unix_secs` and `lane`'s totals add up to at most
/// `per_sec` for each second it has run, the first included (always, at `per_sec`
/// `u64::MAX`): the rule a node holds its own writes to, so that its peers take them, and
/// that [`CounterMap::with_lane_rate_max`] holds peers' lanes to, allowing for skew. A
/// window that has not started holds nothing, however small: no writer's clock is in it,
/// and held, a lane of a window far ahead would never expire.
pub fn lane_within_rate(lane: Lane, window: Window, per_sec: u64, now_unix_secs: u64) -> bool {
    let start = window.start_unix_secs();
    let secs = (now_unix_secs.saturating_sub(start)).saturating_add(1);
    let claimed = u128::from(lane.incr) + u128::from(lane.decr);
    per_sec == u64::MAX
        || (start <= now_unix_secs && claimed <= u128::from(per_sec) * u128::from(secs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Generation, NodeId, Rule, Subject, Window};

    const NOW: u64 = 600;

    fn replica(node: u64) -> ReplicaId {
        ReplicaId::new(NodeId(node), Generation(1))
    }

    fn key(subject: usize, len_secs: u32) -> Key {
        Key::new(
            Rule::new("r").unwrap(),
            Subject::new(format!("subject-{subject}")).unwrap(),
            Window::containing(NOW, len_secs).unwrap(),
        )
    }

    #[test]
    fn budget_cut_sends_serve_the_origins_a_peer_lacks_in_turn() {
        let mut map = CounterMap::new();
        for node in 1..=50 {
            map.incr(replica(node), &key(node as usize, 60), 1, Stamp(1))
                .unwrap();
        }
        let peer = map.digest();
        // Origin 10 has a backlog larger than a send, and origin 11, next in order, a lane.
        for subject in 0..2_000 {
            map.incr(replica(10), &key(1_000 + subject, 60), 1, Stamp(2))
                .unwrap();
        }
        map.incr(replica(11), &key(5_000, 60), 1, Stamp(2)).unwrap();
        let served = (0..50)
            .filter(|&rotate| {
                let delta = map.delta_for(&peer, 4 * 1024, rotate);
                delta
                    .origins
                    .iter()
                    .any(|entry| entry.origin == replica(11))
            })
            .count();
        assert_eq!(served, 25, "origin 11 served in {served} of 50 sends");
    }

    /// Keys whose subjects are as long as a subject may be, so that the smallest budget
    /// holds one lane.
    fn long_key(subject: usize) -> Key {
        let subject = format!("{subject:0width$}", width = crate::SUBJECT_BYTES_MAX);
        Key::new(
            Rule::new("r").unwrap(),
            Subject::new(subject).unwrap(),
            Window::containing(600, 60).unwrap(),
        )
    }

    /// Found in review (session 37). An origin writes k1 (v1) and k2 (v2); `y` takes both.
    /// The origin rewrites k1 (v3) and writes k3 (v4); `n` takes all of it, and `x` takes
    /// a send from `n` cut after k2, so `x` holds the origin through v2 without k1, whose
    /// current version is above that. The origin and `n` then lose their state: `y`'s k1
    /// at v1 is all that is left of k1, and `x` and `y` hold the origin at one watermark,
    /// so no digest shows that `x` lacks it.
    #[test]
    fn an_earlier_copy_only_one_holder_has_of_an_origin_that_writes_no_more_reaches_the_other() {
        let o = replica(1);
        let (k1, k2, k3) = (long_key(1), long_key(2), long_key(3));
        let mut origin = CounterMap::new();
        origin.incr(o, &k1, 1, Stamp(1)).unwrap();
        origin.incr(o, &k2, 1, Stamp(2)).unwrap();
        let mut y = CounterMap::new();
        y.apply(&origin.delta_for(&y.digest(), 1 << 16, 0), 600);
        origin.incr(o, &k1, 1, Stamp(3)).unwrap();
        origin.incr(o, &k3, 1, Stamp(4)).unwrap();
        let mut n = CounterMap::new();
        n.apply(&origin.delta_for(&n.digest(), 1 << 16, 0), 600);
        let mut x = CounterMap::new();
        let cut = n.delta_for(&x.digest(), 0, 0);
        assert_eq!(cut.lanes(), 1, "the smallest budget carries one lane");
        x.apply(&cut, 600);
        assert_eq!(x.watermark(o).version, y.watermark(o).version);
        assert_eq!((x.value(&k1), y.value(&k1)), (0, 1));
        assert_eq!(x.delta_for(&y.digest(), 1 << 16, 0).lanes(), 0);
        assert_eq!(
            y.delta_for(&x.digest(), 1 << 16, 0).lanes(),
            0,
            "no digest shows it"
        );

        let (x_held, y_held) = (x.settled(o).unwrap(), y.settled(o).unwrap());
        assert!(x.settled_differs(&y_held) && y.settled_differs(&x_held));
        // Each lists the versions it holds; the other answers with what the list lacks.
        let to_x = y.lanes_not_held(&x.held_versions(o, 0, 100).unwrap(), 1 << 16, 0);
        let to_y = x.lanes_not_held(&y.held_versions(o, 0, 100).unwrap(), 1 << 16, 0);
        assert_eq!((to_x.lanes(), to_y.lanes()), (1, 0), "only x lacks a lane");
        assert_eq!(to_x.origins[0].lanes[0].key, k1);
        x.apply(&to_x, 600);
        assert_eq!((x.value(&k1), x.value(&k2)), (1, 1));
        assert_eq!(x.settled(o), y.settled(o), "they hold the same lanes");
        assert!(!x.settled_differs(&y.settled(o).unwrap()));
        assert_eq!(x.watermark(o).version, Version(2), "and no watermark moved");
        // A holder at another watermark is answered nothing: anti-entropy serves it.
        let behind = CounterMap::new().held_versions(o, 0, 100);
        assert_eq!(behind, None);
        let mut ahead = y.clone();
        ahead.incr(o, &k3, 1, Stamp(5)).unwrap();
        assert!(x
            .lanes_not_held(&ahead.held_versions(o, 0, 100).unwrap(), 1 << 16, 0)
            .is_empty());
    }

    /// The bytes of an entry of `lanes` lanes of [`long_key`]s.
    fn long_keys_bytes(lanes: usize) -> usize {
        size::DELTA_HEADER + size::ORIGIN_HEADER + lanes * size::lane(KeyRef::from(&long_key(0)))
    }

    /// `o` writes `long_key(1..=n)`, and `y` takes them all; `o` rewrites `lacked` of them,
    /// and `r` takes, from a node that took everything, a send of the lanes not rewritten
    /// only: `r` and `y` hold `o` at one watermark, and only `y` has the earlier copies of
    /// the keys in `lacked`.
    fn earlier_copies_at_one_holder(
        o: ReplicaId,
        n: usize,
        lacked: &[usize],
    ) -> (CounterMap, CounterMap) {
        let mut origin = CounterMap::new();
        for k in 1..=n {
            origin.incr(o, &long_key(k), 1, Stamp(1)).unwrap();
        }
        let mut y = CounterMap::new();
        y.apply(&origin.delta_for(&y.digest(), 1 << 20, 0), NOW);
        for &k in lacked {
            origin.incr(o, &long_key(k), 1, Stamp(2)).unwrap();
        }
        let mut all = CounterMap::new();
        all.apply(&origin.delta_for(&all.digest(), 1 << 20, 0), NOW);
        let mut r = CounterMap::new();
        r.apply(
            &all.delta_for(&r.digest(), long_keys_bytes(n - lacked.len()), 0),
            NOW,
        );
        assert_eq!(r.watermark(o).version, y.watermark(o).version);
        for &k in lacked {
            assert_eq!(r.lane(&long_key(k), o), Lane::default());
        }
        (y, r)
    }

    /// A list cut short covers a span, and the spans of lists from consecutive starts meet,
    /// so a holder that lists its versions a part at a time, one part after another, is
    /// sent every lane it lacks, whether it lacks the first lane or others after it.
    #[test]
    fn versions_listed_a_part_at_a_time_get_every_lane_the_holder_lacks() {
        let o = replica(1);
        let n = 40;
        let lacked = [1, 17, 39];
        let (y, mut r) = earlier_copies_at_one_holder(o, n, &lacked);
        let held = r.settled(o).unwrap().lanes as usize;
        assert_eq!(held, n - lacked.len());
        let (most, mut sent) = (8, Vec::new());
        let mut start = 0;
        while start < held {
            let part = r.held_versions(o, start, most).unwrap();
            assert_eq!(part.versions.len(), most.min(held - start));
            let repair = y.lanes_not_held(&part, 1 << 16, 0);
            sent.extend(
                repair
                    .origins
                    .iter()
                    .flat_map(|e| &e.lanes)
                    .map(|l| l.key.clone()),
            );
            start += most;
        }
        let expected: Vec<Key> = lacked.iter().map(|&k| long_key(k)).collect();
        assert_eq!(sent, expected, "each lacked lane once, in version order");
        for key in &sent {
            r.apply(
                &Delta {
                    origins: vec![OriginDelta {
                        origin: o,
                        through: Watermark::default(),
                        lanes: vec![LaneUpdate {
                            key: key.clone(),
                            lane: y.lane(key, o),
                            version: y.counter(key).unwrap().slot(o).unwrap().version,
                        }],
                    }],
                },
                NOW,
            );
        }
        assert_eq!(r.settled(o), y.settled(o));
        // An answer cut to the budget takes the lacked lanes from the span's start.
        let whole = r.clone();
        let (_, r) = earlier_copies_at_one_holder(o, n, &lacked);
        let cut = y.lanes_not_held(&r.held_versions(o, 0, n).unwrap(), long_keys_bytes(2), 0);
        let keys: Vec<&Key> = cut.origins[0].lanes.iter().map(|l| &l.key).collect();
        assert_eq!(keys, [&long_key(1), &long_key(17)]);
        assert_eq!(whole.settled(o), y.settled(o));
    }

    /// A place picked for the `i`th list or answer in a test: spread over the integers, as
    /// the gossip's random ones are.
    fn place(i: usize) -> usize {
        (i as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29) as usize
    }

    /// Two holders of `o` at one watermark exchange lists and answers, each holder's list
    /// at most `most` versions from the place `list_start` gives for the round, and each
    /// answer at most `fit` lanes from a place picked as the gossip picks it, for `rounds`
    /// rounds, both ways in turn. Returns the answers sent and the lanes they raised.
    fn exchange(
        x: &mut CounterMap,
        y: &mut CounterMap,
        (most, fit): (usize, usize),
        list_start: impl Fn(usize) -> usize,
        rounds: usize,
    ) -> (usize, usize) {
        let o = replica(1);
        let (mut answers, mut raised) = (0, 0);
        for round in 0..rounds {
            let (holder, other) = if round % 2 == 0 {
                (&mut *x, &*y)
            } else {
                (&mut *y, &*x)
            };
            if !holder.settled_differs(&other.settled(o).unwrap()) {
                continue;
            }
            let held = holder.held_versions(o, list_start(round), most).unwrap();
            let delta = other.lanes_not_held(&held, long_keys_bytes(fit), place(2 * round + 1));
            answers += usize::from(!delta.is_empty());
            raised += holder.apply(&delta, NOW).lanes_raised;
        }
        (answers, raised)
    }

    /// Found in review: each holder keeps earlier copies of keys the other holds under
    /// newer versions. Those copies are unlisted at the other, but its merge takes nothing
    /// from them; taken from the lowest version, they filled every answer, and while a
    /// holder's lane count divided its list's length every list started at the first lane:
    /// 2,000 answers in 1,000 rounds raised no lane. The origin wrote key `i` at `i`, key
    /// `m + i` at `m + i`, key `i` again at `2m + i`, key `m + i` again at `3m + i`, then
    /// `c`, `d` and `e`; `x` holds the first copies of the first keys and the second of the
    /// others, with `c` and `e`, and `y` the reverse, with `d` and `e`.
    #[test]
    fn earlier_copies_of_keys_held_newer_do_not_hold_back_the_lanes_a_holder_lacks() {
        let o = replica(1);
        let (most, fit, m) = (140, 6, 9);
        let lane = |k: usize, incr: u64, v: usize| LaneUpdate {
            key: long_key(k),
            lane: Lane::new(incr, 0),
            version: Version(v as u64),
        };
        let holder = |mut lanes: Vec<LaneUpdate>| {
            lanes.sort_by_key(|lane| lane.version);
            let mut map = CounterMap::new();
            let through = Watermark {
                version: Version(4 * m as u64 + 3),
                stamp: Stamp(9),
            };
            map.apply(
                &Delta {
                    origins: vec![OriginDelta {
                        origin: o,
                        through,
                        lanes,
                    }],
                },
                NOW,
            );
            map
        };
        let (c, d, e) = (1_000, 1_001, 1_002);
        let mut xs: Vec<LaneUpdate> = (1..=m).map(|i| lane(i, 1, i)).collect();
        xs.extend((1..=m).map(|i| lane(m + i, 2, 3 * m + i)));
        xs.extend([lane(c, 1, 4 * m + 1), lane(e, 1, 4 * m + 3)]);
        let mut ys: Vec<LaneUpdate> = (1..=m).map(|i| lane(m + i, 1, m + i)).collect();
        ys.extend((1..=m).map(|i| lane(i, 2, 2 * m + i)));
        ys.extend([lane(d, 1, 4 * m + 2), lane(e, 1, 4 * m + 3)]);
        let (mut x, mut y) = (holder(xs), holder(ys));
        assert_eq!(
            most % (2 * m + 2),
            0,
            "the case that held every list at the first lane"
        );
        assert!(x.settled_differs(&y.settled(o).unwrap()));
        // Every list from the first lane, as when a holder's lane count divided the
        // length of its lists.
        let (answers, raised) = exchange(&mut x, &mut y, (most, fit), |_| 0, 200);
        assert_eq!(
            x.settled(o),
            y.settled(o),
            "{answers} answers raised {raised} lanes"
        );
        assert_eq!((x.value(&long_key(d)), y.value(&long_key(c))), (1, 1));
        assert_eq!(raised, 2 * m + 2, "each newer copy and `c` and `d`, once");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

        /// Two holders of an origin at one watermark, each with any honest mix of its lanes
        /// (none, an earlier copy, a later copy of each key, lanes past the watermark),
        /// lists and answers of a few lanes: the exchange leaves both with the same lanes
        /// and raises no watermark (from a reviewer's property test).
        #[test]
        fn holders_that_exchange_lists_and_answers_end_with_the_same_lanes(
            writes in proptest::collection::vec(0usize..12, 1..40),
            watermark in 0u64..45,
            xs in proptest::collection::vec(proptest::option::of(0usize..5), 12),
            ys in proptest::collection::vec(proptest::option::of(0usize..5), 12),
            most in 1usize..6,
            fit in 1usize..4,
        ) {
            let o = replica(1);
            // Each key's copy: one of the versions the origin wrote it at, if any.
            let holder = |picks: &[Option<usize>]| {
                let mut lanes: Vec<LaneUpdate> = (picks.iter().enumerate())
                    .filter_map(|(k, pick)| {
                        let versions: Vec<u64> = (writes.iter().enumerate())
                            .filter(|&(_, &key)| key == k)
                            .map(|(i, _)| i as u64 + 1)
                            .collect();
                        let at = (*pick)? % versions.len().max(1);
                        Some(LaneUpdate {
                            key: long_key(k),
                            lane: Lane::new(at as u64 + 1, 0),
                            version: Version(*versions.get(at)?),
                        })
                    })
                    .collect();
                lanes.sort_by_key(|lane| lane.version);
                let through = Watermark { version: Version(watermark), stamp: Stamp(7) };
                let mut map = CounterMap::new();
                map.apply(&Delta { origins: vec![OriginDelta { origin: o, through, lanes }] }, NOW);
                map
            };
            let (mut x, mut y) = (holder(&xs), holder(&ys));
            let held = (x.watermark(o), y.watermark(o));
            exchange(&mut x, &mut y, (most, fit), |round| place(2 * round), 1_000);
            proptest::prop_assert_eq!((x.watermark(o), y.watermark(o)), held);
            proptest::prop_assert_eq!(x.settled(o), y.settled(o));
            let lanes = |map: &CounterMap| -> BTreeMap<Key, (Lane, Version)> {
                (map.iter())
                    .filter_map(|(key, counter)| {
                        let slot = counter.slots().find(|slot| slot.replica == o)?;
                        Some((key.to_key(), (slot.lane, slot.version)))
                    })
                    .collect()
            };
            proptest::prop_assert_eq!(lanes(&x), lanes(&y));
        }
    }

    #[test]
    fn lanes_republished_above_a_raised_version_reach_a_peer_that_held_newer_copies() {
        // A peer holds replica 1's lane at version 3 with totals 5; the replica's life
        // restarts, its log says 7, and it re-publishes the lane from a fresh map.
        let mut peer = CounterMap::new();
        for _ in 0..5 {
            peer.incr(replica(1), &key(0, 60), 1, Stamp(1)).unwrap();
        }
        let mut restarted = CounterMap::new();
        restarted.raise_version(replica(1), Version(1_000));
        let version = restarted.write(replica(1), &key(0, 60), Lane::new(7, 0), Stamp(2));
        assert_eq!(version, Version(1_001));
        let delta = restarted.delta_for(&peer.digest(), 1 << 16, 0);
        peer.apply(&delta, NOW);
        assert_eq!(peer.value(&key(0, 60)), 7);
        assert_eq!(peer.watermark(replica(1)).version, Version(1_001));
    }

    /// Syncs `a` and `b` both ways until neither lacks anything by its digest.
    fn sync(a: &mut CounterMap, b: &mut CounterMap) {
        for _ in 0..4 {
            let to_b = a.delta_for(&b.digest(), 1 << 16, 0);
            b.apply(&to_b, NOW);
            let to_a = b.delta_for(&a.digest(), 1 << 16, 0);
            a.apply(&to_a, NOW);
        }
    }

    #[test]
    fn lanes_republished_below_a_peers_copy_disagree_until_restamped_with_the_larger_totals() {
        // A peer holds replica 1's lane at 10 (version 10); the replica's next life
        // re-publishes 6 from a log behind that, at a version above the peer's.
        let mut peer = CounterMap::new();
        for _ in 0..10 {
            peer.incr(replica(1), &key(0, 60), 1, Stamp(1)).unwrap();
        }
        let mut restarted = CounterMap::new();
        restarted.raise_version(replica(1), Version(1_000));
        restarted.write(replica(1), &key(0, 60), Lane::new(6, 0), Stamp(2));
        sync(&mut restarted, &mut peer);
        // One version now names two states, and the digests agree.
        assert_eq!(peer.lane(&key(0, 60), replica(1)), Lane::new(10, 0));
        assert_eq!(restarted.lane(&key(0, 60), replica(1)), Lane::new(6, 0));
        assert_eq!(restarted.digest(), peer.digest());
        // The peer hands its lane to the replica's node, which merges it and restamps it.
        let correction = Delta {
            origins: vec![OriginDelta {
                origin: replica(1),
                through: Watermark::default(),
                lanes: vec![LaneUpdate {
                    key: key(0, 60),
                    lane: peer.lane(&key(0, 60), replica(1)),
                    version: Version(1_001),
                }],
            }],
        };
        restarted.apply(&correction, NOW);
        let version = restarted.restamp(replica(1), &key(0, 60), Stamp(3));
        assert_eq!(version, Some(Version(1_002)));
        let mut third = CounterMap::new();
        sync(&mut restarted, &mut peer);
        sync(&mut restarted, &mut third);
        for map in [&restarted, &peer, &third] {
            assert_eq!(map.lane(&key(0, 60), replica(1)), Lane::new(10, 0));
            assert_eq!(map.watermark(replica(1)).version, Version(1_002));
        }
        assert_eq!(restarted.restamp(replica(1), &key(1, 60), Stamp(3)), None);
    }

    #[test]
    fn a_cut_send_advances_the_watermark_to_the_last_lane_sent() {
        let mut origin = CounterMap::new();
        for subject in 0..100 {
            origin
                .incr(replica(1), &key(subject, 60), 1, Stamp(5))
                .unwrap();
        }
        let mut peer = CounterMap::new();
        let delta = origin.delta_for(&peer.digest(), DELTA_BYTES_MIN, 0);
        let sent = delta.lanes();
        assert!(
            sent > 0 && sent < 100,
            "expected a cut send, got {sent} lanes"
        );
        peer.apply(&delta, NOW);
        let watermark = peer.watermark(replica(1));
        assert_eq!(watermark.version, Version(sent as u64));
        assert_eq!(
            watermark.stamp,
            Stamp(0),
            "a cut send must not claim the newest stamp"
        );
        let mut sends = 1;
        loop {
            let delta = origin.delta_for(&peer.digest(), DELTA_BYTES_MIN, 0);
            if delta.is_empty() {
                break;
            }
            peer.apply(&delta, NOW);
            sends += 1;
        }
        assert!(sends > 1);
        assert_eq!(peer.watermark(replica(1)), origin.watermark(replica(1)));
        assert_eq!(peer.len(), 100);
    }

    #[test]
    fn a_cut_send_carries_no_stamp_whatever_the_peer_is_supposed_to_hold() {
        let mut origin = CounterMap::new();
        for subject in 0..100 {
            origin
                .incr(replica(1), &key(subject, 60), 1, Stamp(5))
                .unwrap();
        }
        // A digest whose sender is read as holding the origin at version 0 and a recent
        // stamp (an unlisted origin, read at the Syn's `unlisted`), which it never heard.
        let mut supposed = Digest::default();
        let fresh = Watermark {
            version: Version::ZERO,
            stamp: Stamp(4),
        };
        supposed.origins.insert(replica(1), fresh);
        let delta = origin.delta_for(&supposed, DELTA_BYTES_MIN, 0);
        assert!(delta.lanes() < 100, "a cut send");
        assert_eq!(delta.origins[0].through.stamp, Stamp(0));
        let mut peer = CounterMap::new();
        peer.apply(&delta, NOW);
        assert_eq!(
            peer.watermark(replica(1)).stamp,
            Stamp(0),
            "the peer never heard the origin: it gets no stamp from a cut"
        );
    }

    #[test]
    fn an_idle_origin_sends_its_newer_stamp_without_lanes() {
        let mut origin = CounterMap::new();
        origin.incr(replica(1), &key(0, 60), 1, Stamp(5)).unwrap();
        let mut peer = CounterMap::new();
        peer.apply(&origin.delta_for(&peer.digest(), 0, 0), NOW);
        origin.touch(replica(1), Stamp(9));
        let delta = origin.delta_for(&peer.digest(), 0, 0);
        assert_eq!(delta.lanes(), 0);
        assert_eq!(delta.origins.len(), 1);
        peer.apply(&delta, NOW);
        assert_eq!(peer.watermark(replica(1)).stamp, Stamp(9));
        assert!(origin.delta_for(&peer.digest(), 0, 0).is_empty());
    }

    /// Every origin's index stands for it, every version-index entry names a held key whose
    /// lane of that origin is at that version, and every held lane has one.
    fn assert_index_names_each_lane(map: &CounterMap) {
        for (replica, origin) in &map.origins {
            assert_eq!(map.replicas.replica(origin.index), *replica);
            for (version, id) in origin.by_version.range_from(Version::ZERO) {
                let held = map.keys.get(id).expect("the index names a held key");
                let slot = CounterRef::new(held.1, &map.replicas)
                    .slot(*replica)
                    .expect("the key has the origin's lane");
                assert_eq!(slot.version, version, "{replica} at {}", held.0.to_key());
            }
        }
        let lanes: usize = map.iter().map(|(_, counter)| counter.lanes()).sum();
        assert_eq!(map.lanes(), lanes);
    }

    #[test]
    fn the_keys_of_a_node_are_those_with_a_lane_of_any_of_its_lives() {
        let mut map = CounterMap::new();
        let life = |node, generation| ReplicaId::new(NodeId(node), Generation(generation));
        map.incr(life(2, 1), &key(1, 60), 1, Stamp(1)).unwrap();
        map.incr(life(2, 2), &key(2, 60), 1, Stamp(1)).unwrap();
        map.incr(life(3, 1), &key(3, 60), 1, Stamp(1)).unwrap();
        map.incr(life(1, 1), &key(4, 60), 1, Stamp(1)).unwrap();
        let mut keys: Vec<Key> = map
            .keys_of(NodeId(2))
            .map(|(key, _)| key.to_key())
            .collect();
        keys.sort();
        assert_eq!(keys, [key(1, 60), key(2, 60)]);
        assert_eq!(map.keys_of(NodeId(9)).count(), 0);
    }

    #[test]
    fn an_expiry_that_compacts_the_keys_keeps_every_lane_at_its_version() {
        let mut map = CounterMap::new().with_hash_seed(11);
        // 100 keys over two origins; one in ten in an hour-long window, the rest in 10 s.
        let len = |subject: usize| {
            if subject.is_multiple_of(10) {
                3_600
            } else {
                10
            }
        };
        for subject in 0..100 {
            for node in [1, 2] {
                map.incr(replica(node), &key(subject, len(subject)), 1, Stamp(1))
                    .unwrap();
            }
        }
        let kept: Vec<Key> = (0..100).step_by(10).map(|s| key(s, 3_600)).collect();
        let later = key(1, 10).window.live_until_unix_secs();
        assert_eq!(map.expire(later, |_| true), 90);
        assert!(!map.keys.is_sparse(), "the expiry compacted the keys");
        assert_index_names_each_lane(&map);
        let delta = map.delta_for(&Digest::default(), usize::MAX, 0);
        assert_eq!(delta.origins.len(), 2, "both origins' lanes are sent");
        for origin in &delta.origins {
            let sent: Vec<&Key> = origin.lanes.iter().map(|lane| &lane.key).collect();
            assert_eq!(sent.len(), kept.len());
            for lane in &origin.lanes {
                assert!(kept.contains(&lane.key));
                assert_eq!(
                    map.counter(&lane.key)
                        .unwrap()
                        .slot(origin.origin)
                        .unwrap()
                        .version,
                    lane.version
                );
            }
        }
        // Writes after the compaction land on the moved keys and on new ones.
        for subject in [10, 90, 500] {
            map.incr(replica(1), &key(subject, 3_600), 5, Stamp(2))
                .unwrap();
        }
        assert_index_names_each_lane(&map);
        assert_eq!(map.value(&key(90, 3_600)), 2 + 5);
        assert_eq!(map.value(&key(500, 3_600)), 5);
    }

    #[test]
    fn an_origin_dropped_at_expiry_frees_its_index_for_the_next_and_no_lane_names_it() {
        let mut map = CounterMap::new();
        let life = |node, generation| ReplicaId::new(NodeId(node), Generation(generation));
        let (short, long) = (key(1, 10), key(2, 3_600));
        // Node 3 writes in both windows (its index the first), node 5's first life only in
        // the short one (the second).
        map.incr(life(3, 1), &short, 2, Stamp(1)).unwrap();
        map.incr(life(3, 1), &long, 7, Stamp(1)).unwrap();
        map.incr(life(5, 1), &short, 4, Stamp(1)).unwrap();
        let freed = map.origins[&life(5, 1)].index;
        let later = short.window.live_until_unix_secs();
        map.expire(later, |replica| replica != life(5, 1));
        assert!(
            !map.origins.contains_key(&life(5, 1)),
            "retired with no lanes"
        );

        // The next origin takes the freed index, above node 3's; its lane sorts by replica,
        // before node 3's.
        map.incr(life(1, 1), &long, 9, Stamp(2)).unwrap();
        assert_eq!(map.origins[&life(1, 1)].index, freed);
        let counter = map.counter(&long).unwrap();
        let replicas: Vec<ReplicaId> = counter.slots().map(|slot| slot.replica).collect();
        assert_eq!(replicas, [life(1, 1), life(3, 1)]);
        assert_eq!(map.value(&long), 7 + 9);
        assert_eq!(map.lane(&long, life(5, 1)), Lane::default());
        assert_index_names_each_lane(&map);
    }

    #[test]
    fn a_restamp_past_the_last_version_is_refused_rather_than_reuse_it() {
        // A member relays lane 0 of replica 1 at version u64::MAX: a restamp of another
        // lane would get u64::MAX again, two lanes under one version.
        let entry = |subject, version| Delta {
            origins: vec![OriginDelta {
                origin: replica(1),
                through: Watermark {
                    version: Version(version),
                    stamp: Stamp(1),
                },
                lanes: vec![LaneUpdate {
                    key: key(subject, 60),
                    lane: Lane::new(1, 0),
                    version: Version(version),
                }],
            }],
        };
        let mut map = CounterMap::new();
        map.apply(&entry(1, 1), NOW);
        assert_eq!(
            map.restamp(replica(1), &key(1, 60), Stamp(2)),
            Some(Version(2))
        );
        map.apply(&entry(0, u64::MAX), NOW);
        assert_eq!(map.value(&key(0, 60)), 1);
        assert_eq!(map.restamp(replica(1), &key(1, 60), Stamp(3)), None);
        assert_eq!(map.restamp(replica(1), &key(0, 60), Stamp(3)), None);
        assert_index_names_each_lane(&map);
        assert_eq!(map.delta_for(&Digest::default(), usize::MAX, 0).lanes(), 2);
    }

    #[test]
    fn a_lane_whose_version_names_another_key_of_its_origin_is_left_out() {
        // Replica 1's first life wrote key 0 at versions 1 and 2; a life that lost its state
        // wrote key 1 at version 2 under the same replica id. A map holding the first
        // life's lanes takes the second's entry only below the clash.
        let mut first = CounterMap::new();
        first.incr(replica(1), &key(0, 60), 1, Stamp(1)).unwrap();
        first.incr(replica(1), &key(0, 60), 1, Stamp(2)).unwrap();
        let mut map = CounterMap::new();
        map.apply(&first.delta_for(&Digest::default(), usize::MAX, 0), NOW);
        let mut reused = CounterMap::new();
        reused.incr(replica(1), &key(2, 60), 7, Stamp(3)).unwrap();
        reused.incr(replica(1), &key(1, 60), 5, Stamp(3)).unwrap();
        reused.incr(replica(1), &key(3, 60), 9, Stamp(3)).unwrap();
        let applied = map.apply(&reused.delta_for(&Digest::default(), usize::MAX, 0), NOW);
        assert_eq!(applied.lanes_clashing, 2, "the clash and the lane after it");
        assert_eq!(map.value(&key(0, 60)), 2, "the lane named first is kept");
        assert_eq!(map.value(&key(1, 60)), 0);
        assert_eq!(
            map.value(&key(2, 60)),
            7,
            "the lane below the clash is taken"
        );
        assert_eq!(map.watermark(replica(1)).version, Version(2));
        assert_index_names_each_lane(&map);
        // Expiring and compacting around it keeps every index entry on its own key.
        let later = key(0, 60).window.live_until_unix_secs();
        assert_eq!(map.expire(later, |_| true), 2);
        assert_index_names_each_lane(&map);
    }

    #[test]
    fn an_own_write_after_a_lane_taken_past_a_gap_takes_a_version_above_it() {
        // Replica 1's lane of key 0 arrives at version 10, past a gap (its watermark here
        // stays at 0); a write of that replica here must not take version 1, which would
        // leave the lane's slot at 10 and two index entries naming it.
        let mut writer = CounterMap::new();
        for _ in 0..10 {
            writer.incr(replica(1), &key(0, 60), 1, Stamp(1)).unwrap();
        }
        let entry = writer.delta_for(&Digest::default(), usize::MAX, 0).origins[0].clone();
        let mut map = CounterMap::new();
        map.apply_since(Version(9), &entry, NOW);
        assert_eq!(map.watermark(replica(1)).version, Version::ZERO);
        assert_eq!(map.top(replica(1)), Version(10));
        let version = map.incr(replica(1), &key(0, 60), 1, Stamp(2)).unwrap();
        assert_eq!(version, Version(11));
        map.incr(replica(1), &key(1, 60), 1, Stamp(2)).unwrap();
        assert_index_names_each_lane(&map);
        assert_eq!(map.lanes(), 2);
    }

    #[test]
    fn rewriting_a_lane_replaces_its_version() {
        let mut map = CounterMap::new();
        map.incr(replica(1), &key(0, 60), 1, Stamp(1)).unwrap();
        map.incr(replica(1), &key(1, 60), 1, Stamp(1)).unwrap();
        let v = map.incr(replica(1), &key(0, 60), 1, Stamp(2)).unwrap();
        assert_eq!(v, Version(3));
        assert_eq!(map.lanes(), 2);
        let unchanged = map.write(replica(1), &key(0, 60), Lane::new(1, 0), Stamp(3));
        assert_eq!(
            unchanged,
            Version(3),
            "a write that raises nothing keeps its version"
        );
    }

    #[test]
    fn expired_windows_are_collected_with_retired_origins_and_do_not_come_back() {
        let mut map = CounterMap::new();
        let (short, long) = (key(0, 10), key(1, 3600));
        map.incr(replica(1), &short, 1, Stamp(1)).unwrap();
        map.incr(replica(2), &short, 1, Stamp(1)).unwrap();
        map.incr(replica(2), &long, 1, Stamp(1)).unwrap();
        let stale = map.delta_for(&Digest::default(), 0, 0);

        let later = short.window.end_unix_secs() + 10;
        assert_eq!(map.expire(later, |_| false), 1);
        assert_eq!(map.len(), 1);
        assert_eq!(
            map.digest().origins.len(),
            1,
            "retired origin 1 is collected"
        );
        assert_eq!(map.watermark(replica(2)).version, Version(2));

        let applied = map.apply(&stale, later);
        assert_eq!(applied.lanes_expired, 2);
        assert!(map.counter(&short).is_none());
        assert_eq!(map.value(&long), 1);
    }

    #[test]
    fn lanes_held_past_a_gap_count_once_another_peer_fills_the_gap() {
        // Replica 1 writes two lanes. `gapped` got only the second, by a push past a gap;
        // `third` got only the first. An answer from `third` fills the gap, and `gapped`
        // then holds both, at the origin's watermark, and passes that on.
        let mut origin = CounterMap::new();
        origin.incr(replica(1), &key(0, 60), 1, Stamp(1)).unwrap();
        let first = origin.lanes_since(replica(1), Version(0), 0).unwrap();
        origin.incr(replica(1), &key(1, 60), 1, Stamp(2)).unwrap();
        let second = origin.lanes_since(replica(1), Version(1), 0).unwrap();
        let (mut gapped, mut third, mut peer) =
            (CounterMap::new(), CounterMap::new(), CounterMap::new());
        gapped.apply_since(Version(1), &second, NOW);
        assert_eq!(gapped.watermark(replica(1)), Watermark::default());
        third.apply_since(Version(0), &first, NOW);
        gapped.apply(&third.delta_for(&gapped.digest(), usize::MAX, 0), NOW);
        assert_eq!(gapped.watermark(replica(1)), origin.watermark(replica(1)));

        peer.apply_since(Version(0), &first, NOW);
        peer.apply(&gapped.delta_for(&peer.digest(), 0, 0), NOW);
        assert_eq!(peer.value(&key(1, 60)), 1, "the lane past the gap arrived");
        assert_eq!(peer.watermark(replica(1)), origin.watermark(replica(1)));
        assert_eq!(peer.delta_for(&gapped.digest(), 0, 0).lanes(), 0);
    }

    #[test]
    fn pushes_merged_past_a_gap_raise_the_watermark_once_the_gap_is_filled() {
        // Pushes A (0 to 1), B (1 to 2), C (2 to 3) and D (3 to 4) arrive A, C, B, D: C
        // past a gap, which B fills; every push after lifts the watermark as it comes.
        let mut origin = CounterMap::new();
        let mut pushes = Vec::new();
        for subject in 0..4 {
            let after = origin.watermark(replica(1)).version;
            let stamp = Stamp(10 + subject as u64);
            origin
                .incr(replica(1), &key(subject, 60), 1, stamp)
                .unwrap();
            let mut push = origin.lanes_since(replica(1), after, usize::MAX).unwrap();
            push.through.stamp = stamp;
            pushes.push((after, push));
        }
        let mut peer = CounterMap::new();
        for at in [0, 2, 1, 3] {
            let (after, push) = &pushes[at];
            peer.apply_since(*after, push, NOW);
            let expected = match at {
                2 => pushes[0].1.through,
                1 => pushes[2].1.through,
                _ => push.through,
            };
            assert_eq!(peer.watermark(replica(1)), expected, "after push {at}");
        }
        assert_eq!(peer.watermark(replica(1)).version, Version(4));
        assert_eq!(peer.watermark(replica(1)).stamp, Stamp(13));
    }

    #[test]
    fn a_push_past_a_gap_with_a_lane_left_out_lifts_the_watermark_only_through_the_gap() {
        // At its key cap the peer leaves out the lane past the gap: filling the gap then
        // lifts its watermark through the gap only, not past the lane it lacks.
        let mut origin = CounterMap::new();
        origin.incr(replica(1), &key(0, 60), 1, Stamp(1)).unwrap();
        let first = origin
            .lanes_since(replica(1), Version(0), usize::MAX)
            .unwrap();
        origin.incr(replica(1), &key(1, 60), 1, Stamp(2)).unwrap();
        let second = origin
            .lanes_since(replica(1), Version(1), usize::MAX)
            .unwrap();
        // The peer holds key 0 already (another replica's lane), and has room for no more.
        let mut capped = CounterMap::new().with_keys_max(1);
        capped.incr(replica(2), &key(0, 60), 1, Stamp(1)).unwrap();
        let applied = capped.apply_since(Version(1), &second, NOW);
        assert_eq!(applied.lanes_refused, 1);
        capped.apply_since(Version(0), &first, NOW);
        assert_eq!(
            capped.value(&key(0, 60)),
            2,
            "the gap's lane, of a key held"
        );
        assert_eq!(capped.watermark(replica(1)).version, Version(1));
    }

    #[test]
    fn a_push_after_a_gap_merges_lanes_without_raising_the_watermark() {
        let mut origin = CounterMap::new();
        let mut peer = CounterMap::new();
        origin.incr(replica(1), &key(0, 60), 1, Stamp(1)).unwrap();
        let first = origin.lanes_since(replica(1), Version(0), 0).unwrap();
        origin.incr(replica(1), &key(1, 60), 1, Stamp(2)).unwrap();
        let second = origin.lanes_since(replica(1), Version(1), 0).unwrap();
        assert_eq!(second.lanes.len(), 1);

        peer.apply_since(Version(1), &second, NOW);
        assert_eq!(peer.value(&key(1, 60)), 1, "the lanes are merged");
        assert_eq!(
            peer.watermark(replica(1)),
            Watermark::default(),
            "but the gap keeps the watermark"
        );
        // The push that fills the gap lifts the watermark past the lanes merged already.
        peer.apply_since(Version(0), &first, NOW);
        assert_eq!(peer.watermark(replica(1)), origin.watermark(replica(1)));
        peer.apply_since(Version(1), &second, NOW);
        assert_eq!(peer.watermark(replica(1)), origin.watermark(replica(1)));
    }

    #[test]
    fn at_its_key_cap_a_map_takes_an_entry_up_to_its_first_new_key_and_claims_no_more() {
        let mut origin = CounterMap::new();
        // Versions 1 to 4: keys 0, 1, 2, then key 0 again (its lane moves to version 4).
        for subject in [0, 1, 2, 0] {
            origin
                .incr(replica(1), &key(subject, 60), 1, Stamp(9))
                .unwrap();
        }
        let mut capped = CounterMap::new().with_keys_max(1);
        let applied = capped.apply(&origin.delta_for(&capped.digest(), usize::MAX, 0), NOW);
        // The delta runs key 1 (version 2), key 2 (3), key 0 (4). Key 2 would be a second
        // key: it and everything after it are left out.
        assert_eq!(applied.lanes_refused, 2);
        assert_eq!(capped.len(), 1);
        assert_eq!(capped.value(&key(1, 60)), 1);
        assert_eq!(
            capped.watermark(replica(1)),
            Watermark {
                version: Version(2),
                stamp: Stamp::default(),
            },
            "the watermark stops below the refused lane, and the stamp does not move"
        );
        // The cap holds against every later send, and the map stays behind, not wrong.
        let again = capped.apply(&origin.delta_for(&capped.digest(), usize::MAX, 0), NOW);
        assert_eq!((again.lanes_refused, capped.len()), (2, 1));
        // Its own writes are never refused.
        capped.incr(replica(2), &key(5, 60), 1, Stamp(9)).unwrap();
        assert_eq!(capped.len(), 2);
        // With room again, the same exchange completes it.
        let mut roomy = capped.with_keys_max(usize::MAX);
        roomy.apply(&origin.delta_for(&roomy.digest(), usize::MAX, 0), NOW);
        assert_eq!(roomy.watermark(replica(1)), origin.watermark(replica(1)));
        for subject in 0..3 {
            assert_eq!(
                roomy.value(&key(subject, 60)),
                origin.value(&key(subject, 60))
            );
        }
    }

    #[test]
    fn a_lane_past_the_rate_over_its_windows_age_waits_and_is_taken_once_the_window_covers_it() {
        let mut origin = CounterMap::new();
        // Versions 1 to 3: 100 on key 0, 150 on key 1, 1 on key 2.
        for (subject, amount) in [(0, 100), (1, 150), (2, 1)] {
            origin
                .incr(replica(1), &key(subject, 60), amount, Stamp(9))
                .unwrap();
        }
        // The peer's clock reads the window's start less the skew allowed for: a writer
        // may be in the window's first second, where 100 is the most a lane may hold. Key
        // 1's 150 waits, and key 2's lane after it.
        let behind = key(0, 60).window.start_unix_secs() - LANE_RATE_SKEW_SECS;
        let mut peer = CounterMap::new().with_lane_rate_max(100);
        let applied = peer.apply(&origin.delta_for(&peer.digest(), usize::MAX, 0), behind);
        assert_eq!((applied.lanes_throttled, applied.lanes_refused), (2, 0));
        assert_eq!(peer.value(&key(0, 60)), 100);
        assert_eq!(peer.watermark(replica(1)).version, Version(1));
        assert_eq!(peer.watermark(replica(1)).stamp, Stamp::default());
        // A second later the window covers 200: the rest is taken.
        let applied = peer.apply(&origin.delta_for(&peer.digest(), usize::MAX, 0), behind + 1);
        assert_eq!(applied.lanes_throttled, 0);
        assert_eq!(peer.watermark(replica(1)), origin.watermark(replica(1)));
        assert_eq!(peer.value(&key(1, 60)), 150);
    }

    #[test]
    fn a_delta_keeps_lanes_live_at_its_live_time_and_checks_the_rate_at_its_wall_time() {
        let mut origin = CounterMap::new();
        origin.incr(replica(1), &key(0, 60), 100, Stamp(9)).unwrap();
        let start = key(0, 60).window.start_unix_secs();
        let behind = start - LANE_RATE_SKEW_SECS;
        let delta = || origin.delta_for(&CounterMap::new().digest(), usize::MAX, 0);
        // Over by the wall clock (two windows on), live by the paced one: taken.
        let mut peer = CounterMap::new().with_lane_rate_max(100);
        let over = AppliedAt {
            live_at_unix_secs: start,
            now_unix_secs: start + 180,
        };
        assert_eq!(peer.apply(&delta(), over).lanes_raised, 1);
        // Within the rate by the wall clock though not by the paced one: taken.
        let mut peer = CounterMap::new().with_lane_rate_max(1);
        let caught_up = AppliedAt {
            live_at_unix_secs: behind,
            now_unix_secs: start + 100,
        };
        assert_eq!(peer.apply(&delta(), caught_up).lanes_throttled, 0);
        // One time for both: the paced one throttles it.
        let mut peer = CounterMap::new().with_lane_rate_max(1);
        assert_eq!(peer.apply(&delta(), behind).lanes_throttled, 1);
    }

    #[test]
    fn a_writer_ahead_by_the_skew_allowed_has_its_lanes_at_the_rate_taken() {
        let key = key(0, 60);
        let start = key.window.start_unix_secs();
        // The writer's clock is LANE_RATE_SKEW_SECS ahead of the peer's, which reads the
        // window's start: by its own clock it may hold the rate for 1 + that many seconds.
        let writer_now = start + LANE_RATE_SKEW_SECS;
        let most = 100 * (LANE_RATE_SKEW_SECS + 1);
        assert!(lane_within_rate(
            Lane::new(most, 0),
            key.window,
            100,
            writer_now
        ));
        for (amount, taken) in [(most, true), (most + 1, false)] {
            let mut origin = CounterMap::new();
            origin.incr(replica(1), &key, amount, Stamp(9)).unwrap();
            let mut peer = CounterMap::new().with_lane_rate_max(100);
            let applied = peer.apply(&origin.delta_for(&peer.digest(), usize::MAX, 0), start);
            assert_eq!(applied.lanes_throttled, usize::from(!taken), "{amount}");
            assert_eq!(peer.value(&key) != 0, taken, "{amount}");
        }
    }

    #[test]
    fn a_lane_of_a_window_that_starts_past_the_skew_allowed_waits_however_small() {
        let key = key(0, 60);
        let start = key.window.start_unix_secs();
        let mut origin = CounterMap::new();
        origin.incr(replica(1), &key, 1, Stamp(9)).unwrap();
        let delta = origin.delta_for(&Digest::default(), usize::MAX, 0);
        for (behind, taken) in [
            (LANE_RATE_SKEW_SECS + 1, false),
            (LANE_RATE_SKEW_SECS, true),
        ] {
            let mut peer = CounterMap::new().with_lane_rate_max(100);
            let applied = peer.apply(&delta, start - behind);
            assert_eq!(
                applied.lanes_throttled,
                usize::from(!taken),
                "{behind} s behind"
            );
            assert_eq!(peer.value(&key), i128::from(taken), "{behind} s behind");
            assert_eq!(
                peer.watermark(replica(1)).version,
                Version(u64::from(taken))
            );
        }
    }

    #[test]
    fn the_default_map_holds_no_lane_to_a_rate() {
        let key = key(0, 60);
        let start = key.window.start_unix_secs();
        // A writer in its window's first second, where u64::MAX a second would not do.
        let past_one_second = Lane::new(u64::MAX, 1);
        assert!(lane_within_rate(
            past_one_second,
            key.window,
            u64::MAX,
            start
        ));
        let mut origin = CounterMap::new();
        origin.incr(replica(1), &key, u64::MAX, Stamp(9)).unwrap();
        origin.decr(replica(1), &key, u64::MAX, Stamp(9)).unwrap();
        let mut peer = CounterMap::new();
        let applied = peer.apply(&origin.delta_for(&peer.digest(), usize::MAX, 0), start);
        assert_eq!(applied.lanes_throttled, 0);
        assert_eq!(peer.watermark(replica(1)), origin.watermark(replica(1)));
    }

    #[test]
    fn a_cut_holds_the_watermark_below_the_lowest_lane_left_out_whatever_their_order() {
        let mut origin = CounterMap::new();
        for subject in 0..3 {
            origin
                .incr(replica(1), &key(subject, 60), 1, Stamp(9))
                .unwrap();
        }
        let mut delta = origin.delta_for(&Digest::default(), usize::MAX, 0);
        // Versions 1, 3, 2, with version 3's lane past the rate: version 2 was never taken.
        let lanes = &mut delta.origins[0].lanes;
        lanes.swap(1, 2);
        lanes[1].lane = Lane::new(1_000, 0);
        let mut peer = CounterMap::new().with_lane_rate_max(10);
        let behind = key(0, 60).window.start_unix_secs() - LANE_RATE_SKEW_SECS;
        let applied = peer.apply(&delta, behind);
        assert_eq!(applied.lanes_throttled, 2);
        assert_eq!(peer.watermark(replica(1)).version, Version(1));
    }

    #[test]
    fn random_histories_of_merges_writes_and_expiries_read_back_as_a_model() {
        use proptest::prelude::RngExt;
        use proptest::test_runner::{RngAlgorithm, TestRng};
        // Seeded by the history's number, so a failing one replays.
        type Model = BTreeMap<(Key, ReplicaId), (Lane, Version)>;
        for seed in 0..30u64 {
            let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed as u8; 32]);
            let keys_max = [usize::MAX, 5, 40, 200][seed as usize % 4];
            let mut map = CounterMap::new()
                .with_keys_max(keys_max)
                .with_hash_seed(seed);
            let own = replica(0);
            let mut model = Model::new();
            // Each remote origin's next version, rising by small steps and big jumps.
            let mut next_version: BTreeMap<ReplicaId, u64> = BTreeMap::new();
            // What each origin has sent of each key: its history of (lane, version).
            let mut sent: BTreeMap<(Key, ReplicaId), Vec<(Lane, Version)>> = BTreeMap::new();
            let mut now = 100_000;
            let key_at = |rng: &mut TestRng, now: u64| {
                let len = [5, 10, 30, 5, 10, 30, 60, 3_600][rng.random_range(0..8) as usize];
                Key::new(
                    Rule::new(["r", "q"][rng.random_range(0..2) as usize]).unwrap(),
                    Subject::new(format!("s{}", rng.random_range(0..300))).unwrap(),
                    Window::containing(now - rng.random_range(0..u64::from(len) / 2 + 1), len)
                        .unwrap(),
                )
            };
            let amount = |rng: &mut TestRng| match rng.random_range(0..5) {
                0 => u64::MAX - rng.random_range(0..3),
                1 => u64::from(u32::MAX) + rng.random_range(0..3),
                _ => rng.random_range(0..100),
            };
            for step in 0..600 {
                match rng.random_range(0..10) {
                    0..=4 => {
                        // A remote lane: a new write of its origin, or an earlier copy.
                        let origin = ReplicaId::new(
                            NodeId(1 + rng.random_range(0..12)),
                            Generation(1 + rng.random_range(0..2)),
                        );
                        let key = key_at(&mut rng, now);
                        let history = sent.entry((key.clone(), origin)).or_default();
                        let update = if !history.is_empty() && rng.random_range(0..3) == 0 {
                            history[rng.random_range(0..history.len() as u64) as usize]
                        } else {
                            let next = next_version.entry(origin).or_insert(1);
                            let version = Version(*next);
                            *next += match rng.random_range(0..6) {
                                0 => 1 << 16,
                                1 => (1 << 32) + rng.random_range(0..70_000),
                                _ => 1 + rng.random_range(0..3),
                            };
                            let mut lane = history.last().map_or(Lane::default(), |l| l.0);
                            let _ = lane.incr(amount(&mut rng));
                            if rng.random_range(0..2) == 0 {
                                let _ = lane.decr(amount(&mut rng));
                            }
                            history.push((lane, version));
                            (lane, version)
                        };
                        let delta = Delta {
                            origins: vec![OriginDelta {
                                origin,
                                through: Watermark::default(),
                                lanes: vec![LaneUpdate {
                                    key: key.clone(),
                                    lane: update.0,
                                    version: update.1,
                                }],
                            }],
                        };
                        let held_keys: std::collections::BTreeSet<&Key> =
                            model.keys().map(|(k, _)| k).collect();
                        let new_key = !held_keys.contains(&key);
                        let full = held_keys.len() >= keys_max;
                        let live = key.window.is_live(now);
                        let applied = map.apply(&delta, now);
                        if !live {
                            assert_eq!(applied.lanes_expired, 1, "seed {seed} step {step}");
                        } else if full && new_key {
                            assert_eq!(applied.lanes_refused, 1, "seed {seed} step {step}");
                        } else {
                            assert_eq!(applied.lanes_refused, 0, "seed {seed} step {step}");
                            let held = model.entry((key, origin)).or_insert(update);
                            held.0.merge(update.0);
                            held.1 = held.1.max(update.1);
                        }
                    }
                    5..=6 => {
                        // An own write, never refused at the cap.
                        let key = key_at(&mut rng, now);
                        if !key.window.is_live(now) {
                            continue;
                        }
                        let by = amount(&mut rng);
                        let decr = rng.random_range(0..3) == 0;
                        let result = if decr {
                            map.decr(own, &key, by, Stamp(step))
                        } else {
                            map.incr(own, &key, by, Stamp(step))
                        };
                        let held = model.get(&(key.clone(), own)).map(|l| l.0);
                        let mut lane = held.unwrap_or_default();
                        let expected = if decr { lane.decr(by) } else { lane.incr(by) };
                        match (result, expected) {
                            (Ok(version), Ok(())) => {
                                if held != Some(lane) {
                                    model.insert((key, own), (lane, version));
                                }
                            }
                            (Err(_), Err(_)) => {}
                            (result, expected) => {
                                panic!("seed {seed} step {step}: {result:?}, model {expected:?}")
                            }
                        }
                    }
                    7 => {
                        // Time passes, and ended windows go.
                        now += if rng.random_range(0..4) == 0 {
                            rng.random_range(0..70)
                        } else {
                            rng.random_range(0..5)
                        };
                        let keep = rng.random_range(0..2) == 0;
                        map.expire(now, |replica| keep || replica == own);
                        model.retain(|(key, _), _| key.window.is_live(now));
                    }
                    _ => {
                        // A read-only step: a full delta, checked below.
                    }
                }
                // Every read agrees with the model.
                let keys: std::collections::BTreeSet<&Key> = model.keys().map(|(k, _)| k).collect();
                assert_eq!(map.len(), keys.len(), "seed {seed} step {step}: keys");
                assert_eq!(map.lanes(), model.len(), "seed {seed} step {step}: lanes");
                for ((key, replica), (lane, version)) in &model {
                    let slot = map.counter(key).and_then(|c| c.slot(*replica));
                    assert_eq!(
                        slot.map(|s| (s.lane, s.version)),
                        Some((*lane, *version)),
                        "seed {seed} step {step}: {key} {replica}"
                    );
                }
                for key in keys {
                    let value: i128 = (model
                        .range((key.clone(), ReplicaId::new(NodeId(0), Generation(0)))..))
                    .take_while(|((k, _), _)| k == key)
                    .map(|(_, (lane, _))| lane.value())
                    .sum();
                    assert_eq!(map.value(key), value, "seed {seed} step {step}: {key}");
                }
                assert_index_names_each_lane(&map);
                let mut sent_lanes = Model::new();
                for entry in map.delta_for(&Digest::default(), usize::MAX, 0).origins {
                    for update in entry.lanes {
                        let fresh = sent_lanes
                            .insert((update.key, entry.origin), (update.lane, update.version));
                        assert!(
                            fresh.is_none(),
                            "seed {seed} step {step}: a lane sent twice"
                        );
                    }
                }
                assert_eq!(sent_lanes, model, "seed {seed} step {step}: full delta");
            }
        }
    }
}
