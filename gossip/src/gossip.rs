//! The gossip state machine: anti-entropy, eager push, membership, staleness.

use crate::membership::{ForgetError, Members, State, Transition};
use crate::message::{Cover, MemberEntry, Message};
use crate::paced::OwnStamps;
use crate::stats::Stats;
use crate::wire;
use crate::{Config, PacedWall};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;
use tally_crdt::{
    AppliedAt, Counter, CounterMap, Delta, Digest, Generation, Key, Lane, LaneUpdate, NodeId,
    OriginDelta, ReplicaId, Settled, Slot, Stamp, Version, Watermark, DELTA_BYTES_MIN,
};

/// The least replica id: where a digest sent in parts starts, and starts again.
const FIRST_ORIGIN: ReplicaId = ReplicaId {
    node: NodeId(0),
    generation: Generation(0),
};

/// An `Ack` or `Delta` gives at most this fraction (one over it) of the room its frame has
/// left past the smallest delta to rows of the membership table, and the rest to lanes:
/// about 32 KiB of an otherwise empty 64 KiB frame, about 1,100 rows with 9-byte
/// generations and 15-byte addresses.
const MEMBERS_SHARE_OF_ROOM: usize = 2;

/// Where the next part of the membership table sent to a peer starts (see
/// `Gossip::fill_members`).
#[derive(Debug, Clone, Copy, Default)]
struct TableCursor {
    /// Among the live rows, other than the sender's own.
    live: usize,
    /// Among the other rows.
    others: usize,
    /// Whether the other rows go before the live ones in the next part.
    others_first: bool,
}

/// The time, as given by the driver: its monotonic clock (for timers) and its wall clock
/// (for stamps and windows). The protocol never reads either itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Monotonic time since any fixed origin.
    pub mono: Duration,
    /// Wall-clock milliseconds since the unix epoch.
    pub wall: Stamp,
}

/// What the driver hands in.
#[derive(Debug, Clone)]
pub enum Input {
    /// A frame arrived from `from`, whose identity the transport has authenticated.
    Receive {
        /// When.
        now: Now,
        /// The authenticated sender.
        from: NodeId,
        /// The raw frame.
        frame: Vec<u8>,
    },
    /// A deadline given by [`Output::Timeout`] has passed (or the driver just woke up).
    Timeout {
        /// When.
        now: Now,
    },
    /// This node's own lanes that changed, as absolute totals (from the lane store).
    LocalLanes {
        /// When they were collected.
        now: Now,
        /// Key and the own lane's totals.
        lanes: Vec<(Key, Lane)>,
    },
    /// Leave the cluster gracefully: tell every member, then go quiet.
    Leave,
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Send `frame` to `to`, reachable at `addr`.
    Send {
        /// The peer.
        to: NodeId,
        /// Its address (opaque to the protocol).
        addr: String,
        /// The encoded frame.
        frame: Vec<u8>,
    },
    /// Something the driver may act on.
    Event(Event),
    /// Nothing more to do until this monotonic deadline, or until the next input.
    Timeout(Duration),
}

/// Things that happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Remote lanes of these keys rose: their estimates changed.
    Changed {
        /// The keys, without repeats.
        keys: Vec<Key>,
    },
    /// A member changed state.
    Member(Transition),
    /// A peer holds a lane of this node's own replica that this life never wrote: at a
    /// version above its writes, or with totals above its own. This replica id was used
    /// before by a life that lost its state. The node must take a new generation, and
    /// feed this state machine nothing more: its own versions may now be used up (a peer's
    /// lane at `u64::MAX`), and own writes after that would share one version (found in
    /// review, session 53; `tallyd` stops at once).
    GenerationReused {
        /// The version of the lane a peer holds.
        seen: Version,
        /// The version this node has written.
        written: Version,
    },
    /// A peer's table holds this node's own life as gone though it has not left: an
    /// operator forgot it ([`Gossip::forget`]), and the cluster no longer counts what it
    /// admits. The node must leave (its acknowledged writes handed over, as at any stop)
    /// and start again, which takes a new generation and makes it a member again.
    Forgotten {
        /// The peer whose table said so.
        by: NodeId,
    },
}

/// One node's gossip: a deterministic state machine. The same config, seed and inputs
/// give the same outputs.
#[derive(Debug)]
pub struct Gossip {
    config: Config,
    map: CounterMap,
    members: Members,
    rng: ChaCha8Rng,
    outbox: VecDeque<Output>,
    stats: Stats,
    // Deadlines on the monotonic clock; `None` until the first input sets them.
    next_round: Option<Duration>,
    next_push: Option<Duration>,
    // Invariant: every own lane with a version at most this has been pushed to the peers
    // alive at the time.
    pushed_through: Version,
    // What this node held when its last round began, its own lanes only as far as earlier
    // pushes sent them. With eager push, anti-entropy offers no more than this: what came
    // since is on its way to every live peer by push and heartbeat already.
    settled: Digest,
    rounds: u64,
    // Whether a peer's Syn has carried the hash of this node's table since it started.
    table_matched: bool,
    // Per member, where the next part of the membership table sent to it starts.
    members_next: BTreeMap<NodeId, TableCursor>,
    // Where the next Syn's digest starts, while the digest is too large for one frame
    // and goes in parts.
    syn_from: ReplicaId,
    // Where the next Ack's digest starts, while what this node lacks of a Syn's digest is
    // more than half a frame holds: after the last origin the Ack before it listed.
    ack_from: ReplicaId,
    // The wall clock that windows end by; `None` until the first input with a time, unless
    // resumed (`with_expiry`).
    expiry: Option<PacedWall>,
    // The stamps this node gives its own states: the wall clock, carried on by the
    // monotonic clock while the wall clock is stepped back.
    own_stamps: OwnStamps,
    // When (monotonic) the oldest write of this node that has not reached the gossip yet
    // was made, if any ([`Gossip::hold_stamps_from`]).
    pending_since: Option<Duration>,
    // The latest wall clock of any input: what a peer's lane is held to the rate by, so
    // that a clock stepped back does not hold back every lane of the windows it stepped
    // back over (each would look as if it had not started).
    wall_latest: Stamp,
    // This node's earlier lives whose lanes it started with (re-published from its lane
    // log above every version it takes a peer to hold): only their lanes may it give new
    // versions (`restamp_raised`). Of another earlier life it does not know the
    // versions peers hold, and a version it gave could name another lane there.
    republished: BTreeSet<ReplicaId>,
    // Lanes of other nodes' earlier lives to send back to them once the frame that showed
    // them is handled (`correct_owner`).
    corrections: Vec<(NodeId, Message)>,
    // Per seed this node holds no row for (or a row of a life that left), knocked on while
    // it has live peers: when to knock next (monotonic) and the wait after that one.
    seed_knocks: BTreeMap<NodeId, (Duration, Duration)>,
}

/// The longest wait between knocks on a seed this node holds no row for (or a row of a life
/// that left) while it has live peers: a seed listed under a wrong id, not running yet, or
/// gone for good, costs its address a handshake from each node this often.
pub const SEED_KNOCK_EVERY_MAX: Duration = Duration::from_secs(30);

impl Gossip {
    /// A node with no state, joining through `config.seeds`.
    pub fn new(config: Config) -> Gossip {
        Gossip::with_state(config, CounterMap::new())
    }

    /// A node that restored `map` from its own durable snapshot (same generation).
    pub fn with_state(config: Config, map: CounterMap) -> Gossip {
        assert!(
            config.frame_bytes_max >= Config::FRAME_BYTES_MIN,
            "frame_bytes_max {} is below the minimum {}",
            config.frame_bytes_max,
            Config::FRAME_BYTES_MIN
        );
        assert!(config.fanout > 0, "fanout must be at least 1");
        let me = MemberEntry {
            node: config.node(),
            generation: config.replica.generation,
            addr: config.addr.clone(),
            left: false,
        };
        let pushed_through = map.watermark(config.replica).version;
        Gossip {
            members: Members::new(me, config.gossip_interval),
            rng: ChaCha8Rng::seed_from_u64(config.rng_seed),
            map,
            outbox: VecDeque::new(),
            stats: Stats::default(),
            next_round: None,
            next_push: None,
            pushed_through,
            settled: Digest::default(),
            rounds: 0,
            members_next: BTreeMap::new(),
            syn_from: FIRST_ORIGIN,
            ack_from: FIRST_ORIGIN,
            expiry: None,
            own_stamps: OwnStamps::default(),
            pending_since: None,
            wall_latest: Stamp::default(),
            table_matched: false,
            republished: BTreeSet::new(),
            corrections: Vec::new(),
            seed_knocks: BTreeMap::new(),
            config,
        }
    }

    /// The node, holding in its map the lanes of its earlier lives `lives`, re-published
    /// from its durable log above every version a peer is taken to hold of them
    /// ([`CounterMap::raise_version`]). Where a peer's copy of one of those lanes raises the
    /// map's (the log was behind what the peer had), the node gives the lane a new version,
    /// so that every holder ends on the larger totals (`restamp_raised`).
    pub fn with_republished(mut self, lives: impl IntoIterator<Item = ReplicaId>) -> Gossip {
        let me = self.config.replica;
        self.republished = (lives.into_iter())
            .filter(|life| life.node == me.node && life.generation < me.generation)
            .collect();
        self
    }

    /// Tells the gossip that this node's writes made from `since` (monotonic, as the
    /// inputs' `now`) on may not have reached it yet: collected and waiting for a sync of
    /// the node's log, or not collected yet; `None` once every write has. A heartbeat then
    /// stamps this node's state no later than `since`: a peer reads a stamp as the time up
    /// to which it holds every write of this node, and bounds what it has not seen by the
    /// time since (found in session 51 by the BOUND simulator: a heartbeat stamped while
    /// writes waited for their collection read fresh without them, and the cluster passed
    /// the limit by more than the bound).
    pub fn hold_stamps_from(&mut self, since: Option<Duration>) {
        self.pending_since = since;
    }

    /// The node, its windows ending by `expiry` (resumed from an earlier life's reading:
    /// [`PacedWall::resume`]) rather than by a paced clock that starts at the first input's
    /// wall clock. `expiry` must read the same monotonic clock as the inputs' `now`.
    pub fn with_expiry(mut self, expiry: PacedWall) -> Gossip {
        self.expiry = Some(expiry);
        self
    }

    /// Feeds one input. Never fails: bad frames are counted in [`Gossip::stats`] and
    /// dropped.
    pub fn handle_input(&mut self, input: Input) {
        match input {
            Input::Receive { now, from, frame } => self.handle_frame(now, from, &frame),
            Input::Timeout { now } => self.handle_timeout(now),
            Input::LocalLanes { now, lanes } => self.handle_local_lanes(now, lanes),
            Input::Leave => self.handle_leave(),
        }
    }

    /// The next thing to do. Drain until it returns [`Output::Timeout`].
    pub fn poll_output(&mut self) -> Output {
        if let Some(output) = self.outbox.pop_front() {
            return output;
        }
        if self.has_left() {
            // A node that left has nothing more to wait for.
            return Output::Timeout(Duration::MAX);
        }
        let deadline = match (self.next_round, self.next_push) {
            (Some(round), Some(push)) => round.min(push),
            (Some(round), None) => round,
            // Before the first input: ask to be woken at once.
            (None, _) => Duration::ZERO,
        };
        Output::Timeout(deadline)
    }

    /// Whether a push of own lanes is scheduled: lanes handed in ([`Input::LocalLanes`])
    /// before its deadline go out in it. None is scheduled while no own lane waits for a
    /// push.
    pub fn push_pending(&self) -> bool {
        self.next_push.is_some()
    }

    /// The counters as held here.
    pub fn map(&self) -> &CounterMap {
        &self.map
    }

    /// This node's replica.
    pub fn replica(&self) -> ReplicaId {
        self.config.replica
    }

    /// The settings it was started with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Counters of frames, bytes, errors and propagation delays.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The seeds a round knocks on. With no live peer, every seed, each round, until one
    /// answers. With live peers, every seed this node holds no row for, or a row of a life
    /// that left, at waits that double from a gossip interval to [`SEED_KNOCK_EVERY_MAX`]:
    /// a node that found a peer before its seeds (a knock lost, a seed started late)
    /// gossips only with the part of the cluster it found, and two such parts, one seed in
    /// each, would stay apart for good, each deciding connected on its own part's counts.
    /// Nothing else sends to a member that left, so a seed stopped and started again
    /// (whose own seeds, if any, all left too) would never be heard again.
    fn seeds_to_knock(&mut self, no_live_peer: bool, now: Duration) -> Vec<NodeId> {
        let me = self.config.node();
        let members = &self.members;
        let unheard = (self.config.seeds.iter())
            .map(|seed| seed.node)
            .filter(|&seed| seed != me);
        if no_live_peer {
            // Peers found again start the waits over.
            self.seed_knocks.clear();
            return unheard.collect();
        }
        let unheard: Vec<NodeId> = unheard
            .filter(|&seed| members.state(seed).is_none_or(|state| state == State::Left))
            .collect();
        self.seed_knocks.retain(|seed, _| unheard.contains(seed));
        let first_wait = self.config.gossip_interval;
        let mut knock = Vec::new();
        for seed in unheard {
            let (next, wait) = self.seed_knocks.entry(seed).or_insert((now, first_wait));
            if now >= *next {
                knock.push(seed);
                *next = now + *wait;
                *wait = (*wait * 2).min(SEED_KNOCK_EVERY_MAX);
            }
        }
        knock
    }

    /// Forgets `node`, a member this node holds dead, for good ([`Members::forget`]): no
    /// node then counts what it may admit unseen. The mark spreads with the table.
    pub fn forget(&mut self, node: NodeId) -> Result<ReplicaId, ForgetError> {
        let forgotten = self.members.forget(node);
        self.emit_transitions();
        forgotten
    }

    /// The membership table.
    pub fn members(&self) -> &Members {
        &self.members
    }

    /// Whether a peer's table has been the same as this node's at some point since it
    /// started, with a row for every seed. Until then, the table may be one received only
    /// in part: live members may be missing from it. A table without a seed is no
    /// cluster's whole table: two nodes that start cut off from the rest, each the other's
    /// seed, hold the same table of the two of them.
    pub fn table_matched(&self) -> bool {
        self.table_matched
    }

    fn knows_every_seed(&self) -> bool {
        (self.config.seeds.iter()).all(|seed| self.members.state(seed.node).is_some())
    }

    /// Per origin held, how old its newest state is at wall time `wall`: the origin's
    /// stamp against `wall`. Own replica excluded. Zero when the origin's clock is ahead.
    pub fn staleness(&self, wall: Stamp) -> BTreeMap<ReplicaId, Duration> {
        self.map
            .digest()
            .origins
            .into_iter()
            .filter(|(replica, _)| *replica != self.config.replica)
            .map(|(replica, watermark)| {
                (
                    replica,
                    Duration::from_millis(wall.0.saturating_sub(watermark.stamp.0)),
                )
            })
            .collect()
    }

    fn handle_timeout(&mut self, now: Now) {
        if self.has_left() {
            return;
        }
        let round_due = self.next_round.is_none_or(|at| now.mono >= at);
        if self.next_push.is_some_and(|at| now.mono >= at) {
            self.push();
        }
        if round_due {
            self.round(now);
        }
    }

    fn handle_local_lanes(&mut self, now: Now, lanes: Vec<(Key, Lane)>) {
        let me = self.config.replica;
        let stamp = self.own_stamps.at(now);
        for (key, lane) in lanes {
            self.map.write(me, &key, lane, stamp);
        }
        if self.config.eager_push
            && self.next_push.is_none()
            && self.map.watermark(me).version > self.pushed_through
        {
            self.next_push = Some(now.mono + self.config.push_interval);
        }
    }

    fn handle_leave(&mut self) {
        // Own lanes still waiting for their push batch go first: a node that leaves
        // gracefully hands every write it acknowledged to its peers.
        if self.map.watermark(self.config.replica).version > self.pushed_through {
            self.push();
        }
        self.members.leave();
        let announce = Message::Members {
            members: vec![self.members.me()],
        };
        let peers = self.members.others_in(&[State::Alive, State::Suspect]);
        self.send_to(&peers, &announce);
        self.next_push = None;
    }

    /// One anti-entropy round: heartbeat and fresh lanes to every live peer (with eager
    /// push), a digest to
    /// `fanout` of them (to every seed if none is live, and to the seeds it holds no row
    /// for or a row of a life that left, [`Gossip::seeds_to_knock`]), a probe of one dead
    /// member, failure detection,
    /// expiry.
    fn round(&mut self, now: Now) {
        self.rounds += 1;
        self.next_round = Some(now.mono + self.config.gossip_interval);
        let stamp = self.own_stamps.at(now);
        let held_back =
            (self.pending_since).map_or(Duration::ZERO, |since| now.mono.saturating_sub(since));
        let held_back = u64::try_from(held_back.as_millis()).unwrap_or(u64::MAX);
        let stamp = Stamp(stamp.0.saturating_sub(held_back));
        self.map.touch(self.config.replica, stamp);
        let digest = self.map.digest();
        // Own lanes count as settled once an earlier push sent them: the ones this round's
        // push sends are as fresh as any other origin's lanes arriving now.
        self.settled = digest.clone();
        self.settled.origins.insert(
            self.config.replica,
            Watermark {
                version: self.pushed_through,
                stamp,
            },
        );
        if self.config.eager_push {
            // Fresh lanes and the heartbeat go straight to every live peer. Without eager
            // push (a measurement mode) both travel by anti-entropy alone.
            self.push();
        }

        let (digest, unlisted) = self.syn_digest(digest, now);
        let syn = self.syn_in_parts(digest, unlisted);
        let mut live = self.members.others_in(&[State::Alive, State::Suspect]);
        live.shuffle(&mut self.rng);
        let mut targets: Vec<NodeId> = live.into_iter().take(self.config.fanout).collect();
        for seed in self.seeds_to_knock(targets.is_empty(), now.mono) {
            if !targets.contains(&seed) {
                targets.push(seed);
            }
        }
        let dead = self.members.others_in(&[State::Dead]);
        if let Some(probe) = dead.choose(&mut self.rng) {
            if !targets.contains(probe) {
                targets.push(*probe);
            }
        }
        let members = &self.members;
        self.members_next
            .retain(|&node, _| members.state(node).is_some());
        self.send_to(&targets, &syn);
        if let Some(&peer) = targets.first() {
            let origins = self.settled_origins();
            if !origins.is_empty() {
                self.send(peer, &Message::Settled { origins });
            }
        }

        self.members
            .check(now.mono, self.config.suspect_phi, self.config.dead_after);
        self.emit_transitions();
        // A dead member's watermark goes with its last lanes: its row keeps the stamp, so
        // that a peer handing the stamp back does not bring it back to life, whether or not
        // this node ever heard it while it had the row (`Members::heard_stamped`).
        for origin in self.map.origins() {
            self.members
                .keep_stamp(origin, self.map.watermark(origin).stamp);
        }
        let live_at = self.expiry_secs(now);
        let members = &self.members;
        self.map
            .expire(live_at, |replica| members.is_live_replica(replica));
    }

    /// What this node holds of the origins that write no more ([`Gossip::writes_no_more`]),
    /// for a [`Message::Settled`]: as many as half a frame holds, from a place that moves on
    /// each round.
    fn settled_origins(&self) -> Vec<Settled> {
        let settled: Vec<Settled> = (self.map.origins())
            .filter(|&origin| self.writes_no_more(origin))
            .filter_map(|origin| self.map.settled(origin))
            .collect();
        let most = self.config.frame_bytes_max / 2 / wire::SETTLED_ENTRY_BYTES_MAX;
        if settled.len() <= most {
            return settled;
        }
        let start = (self.rounds as usize) % settled.len();
        let mut part: Vec<Settled> = (settled.iter().cycle().skip(start).take(most))
            .copied()
            .collect();
        part.sort_unstable_by_key(|settled| settled.origin);
        part
    }

    /// Whether `origin` is no live member's current life (nor this node's): an earlier
    /// life, or a life of a member held dead or gone.
    fn writes_no_more(&self, origin: ReplicaId) -> bool {
        origin != self.config.replica && !self.members.is_live_replica(origin)
    }

    /// The time, in unix seconds, that windows end by here: the wall clock paced
    /// ([`PacedWall`]), so that a clock stepped forward and back drops no live window's
    /// lanes, from the map or from a delta, whose versions are then below the watermark
    /// and never sent again.
    fn expiry_secs(&mut self, now: Now) -> u64 {
        let expiry = self.expiry.get_or_insert_with(|| PacedWall::new(now));
        expiry.at(now).0 / 1_000
    }

    /// Pushes own lanes above `pushed_through` to every live peer, in as many frames as the
    /// budget needs. The last frame carries the stamp of this node's freshest state (its
    /// last write or round); a frame cut short carries none (`Stamp(0)`), and a receiver
    /// takes no freshness from it.
    fn push(&mut self) {
        self.next_push = None;
        let me = self.config.replica;
        let peers = self.members.others_in(&[State::Alive, State::Suspect]);
        let budget = self.config.frame_bytes_max - 256;
        let mut after = self.pushed_through;
        loop {
            let Some(lanes) = self.map.lanes_since(me, after, budget) else {
                return;
            };
            let through = lanes.through.version;
            self.send_to(&peers, &Message::Push { after, lanes });
            after = through;
            if through >= self.map.watermark(me).version {
                break;
            }
        }
        self.pushed_through = after;
    }

    fn handle_frame(&mut self, now: Now, from: NodeId, frame: &[u8]) {
        self.stats.frames_in += 1;
        self.stats.bytes_in += frame.len() as u64;
        let envelope = match wire::decode(frame, self.config.frame_bytes_max) {
            Ok(envelope) => envelope,
            Err(_) => {
                self.stats.decode_errors += 1;
                return;
            }
        };
        if envelope.from.node != from {
            // The transport authenticated `from`; a frame claiming another node is forged.
            self.stats.forged += 1;
            return;
        }
        if self.has_left() {
            return;
        }
        self.members.heard(envelope.from, now.mono);
        match envelope.message {
            Message::Syn {
                digest,
                unlisted,
                members_hash,
                covers,
            } => {
                let digest = self.digest_with_unlisted(digest, unlisted, covers);
                self.table_matched |=
                    members_hash == self.members.hash() && self.knows_every_seed();
                let mut reply = Message::Ack {
                    to: envelope.from,
                    delta: Delta::default(),
                    digest: self.wanted_from(&digest),
                    members: Vec::new(),
                    dead: Vec::new(),
                };
                if members_hash != self.members.hash() {
                    self.fill_members(&mut reply, from);
                }
                self.fill_delta(&mut reply, &digest, |origin| covers.contains(origin));
                self.send(from, &reply);
            }
            Message::Ack { to, .. } | Message::Delta { to, .. } if to != self.config.replica => {
                // An answer to a digest of another life of this node: stale.
                self.stats.stale += 1;
            }
            Message::Ack {
                delta,
                digest,
                members,
                dead,
                ..
            } => {
                // The rows first: a newer life of a member that the sender holds as dead,
                // relayed in the same frame as its lanes, is taken in as dead, not as alive
                // by its stamp.
                self.members.merge(&members, &dead);
                self.merge(now, (envelope.from, &members), delta, None);
                let differed = !members.is_empty();
                let mut reply = Message::Delta {
                    to: envelope.from,
                    delta: Delta::default(),
                    members: Vec::new(),
                    dead: Vec::new(),
                };
                if differed {
                    self.fill_members(&mut reply, from);
                }
                // The Ack's digest lists only the origins its sender lacks something of (or
                // a part of them, `wanted_from`); none other is sent.
                let listed = |origin| digest.origins.contains_key(&origin);
                self.fill_delta(&mut reply, &digest, listed);
                let nothing = matches!(&reply, Message::Delta { delta, .. } if delta.is_empty());
                if differed || !nothing {
                    self.send(from, &reply);
                }
            }
            Message::Delta {
                delta,
                members,
                dead,
                ..
            } => {
                self.members.merge(&members, &dead);
                self.merge(now, (envelope.from, &members), delta, None);
            }
            Message::Push { after, lanes } => self.merge(
                now,
                (envelope.from, &[]),
                Delta {
                    origins: vec![lanes],
                },
                Some(after),
            ),
            Message::Members { members } => self.members.merge(&members, &[]),
            Message::Settled { origins } => {
                // Only origins that write no more here either: a sender missing rows of its
                // table takes live ones for settled, whose next versions mend them anyway.
                let differing: Vec<ReplicaId> = (origins.iter())
                    .filter(|theirs| self.writes_no_more(theirs.origin))
                    .filter(|theirs| self.map.settled_differs(theirs))
                    .map(|theirs| theirs.origin)
                    .collect();
                if let Some(&origin) = differing.choose(&mut self.rng) {
                    // From a place picked anew each time, so that lists cut to a frame go
                    // over every lane held, whatever their count.
                    let most = self.config.frame_bytes_max / 2 / wire::HELD_VERSION_BYTES_MAX;
                    let start = self.rng.gen();
                    if let Some(held) = self.map.held_versions(origin, start, most) {
                        self.send(from, &Message::Held { held });
                    }
                }
            }
            Message::Held { held } => {
                if self.writes_no_more(held.origin) {
                    let budget = self.config.frame_bytes_max - 256;
                    let delta = self.map.lanes_not_held(&held, budget, self.rng.gen());
                    if !delta.is_empty() {
                        let repair = Message::Delta {
                            to: envelope.from,
                            delta,
                            members: Vec::new(),
                            dead: Vec::new(),
                        };
                        self.send(from, &repair);
                    }
                }
            }
        }
        // After the frame's rows are taken in, which may hold the address of a node that
        // re-published.
        for (to, correction) in std::mem::take(&mut self.corrections) {
            self.send(to, &correction);
        }
        self.emit_transitions();
        if self.members.take_forgotten() {
            self.outbox
                .push_back(Output::Event(Event::Forgotten { by: from }));
        }
    }

    /// Merges a delta (or a push following version `after` of its one origin) from a sender,
    /// with the member rows its frame carries, tells the failure detector who was heard,
    /// records propagation delays, reports changed keys.
    fn merge(
        &mut self,
        now: Now,
        from: (ReplicaId, &[MemberEntry]),
        delta: Delta,
        after: Option<Version>,
    ) {
        let me = self.config.replica;
        self.stats.lanes_in += delta.lanes() as u64;
        let before: Vec<Stamp> = delta
            .origins
            .iter()
            .map(|entry| self.map.watermark(entry.origin).stamp)
            .collect();
        let own_before = self.map.top(me);
        let earlier_lives = self.earlier_lives_in(from, &delta);
        self.wall_latest = self.wall_latest.max(now.wall);
        let at = AppliedAt {
            live_at_unix_secs: self.expiry_secs(now),
            now_unix_secs: self.wall_latest.0 / 1_000,
        };
        // No peer can hold a lane of this replica above what this life wrote: a lane that
        // would raise one is a lane an earlier life wrote under this replica id. (A lane of
        // a window expired here is not held to compare, and is not taken: a peer may
        // hand back this node's own lane after its window ended here.)
        let inflated = (delta.origins.iter())
            .filter(|entry| entry.origin == me)
            .flat_map(|entry| &entry.lanes)
            .filter(|update| update.key.window.is_live(at.live_at_unix_secs))
            .find(|update| !self.map.lane(&update.key, me).covers(update.lane))
            .map(|update| update.version);
        let applied = match (after, delta.origins.first()) {
            (Some(after), Some(entry)) => self.map.apply_since(after, entry, at),
            _ => self.map.apply(&delta, at),
        };
        let own_after = self.map.top(me);
        if let Some(seen) = inflated.or((own_after > own_before).then_some(own_after)) {
            self.outbox
                .push_back(Output::Event(Event::GenerationReused {
                    seen,
                    written: own_before,
                }));
        }
        for earlier in earlier_lives {
            let entry = &delta.origins[earlier.entry];
            if earlier.owner == me {
                self.restamp_raised(now, entry, &earlier.held);
            } else {
                self.correct_owner(entry, &earlier);
            }
        }
        self.stats.lanes_refused += applied.lanes_refused as u64;
        self.stats.lanes_clashing += applied.lanes_clashing as u64;
        self.stats.lanes_throttled += applied.lanes_throttled as u64;
        for (entry, before) in delta.origins.iter().zip(before) {
            let held = self.map.watermark(entry.origin).stamp;
            if entry.origin != me && held > before {
                self.members.heard_stamped(entry.origin, held, now.mono);
                // Sampled only for the current life of a member alive or suspect (after
                // this hearing). An earlier life's lanes, or a dead or left member's, still
                // in a live window, arrive as old as that life's end, which is no delay
                // (found in review, sessions 47 and 48: a restart, and a death, half an hour
                // ago were sampled as delays of half an hour). With no row here for its
                // node, an origin is its node's current life only if it sent the frame (a
                // push from a node that just joined); a relay may carry an earlier life
                // without its node's row.
                let current = match self.members.replica(entry.origin.node) {
                    Some(_) => self.members.is_live_replica(entry.origin),
                    None => entry.origin == from.0,
                };
                if entry.origin.node != me.node && current {
                    self.stats
                        .propagation
                        .record(Duration::from_millis(now.wall.0.saturating_sub(held.0)));
                }
            }
        }
        if !applied.keys.is_empty() {
            self.outbox
                .push_back(Output::Event(Event::Changed { keys: applied.keys }));
        }
    }

    /// The entries of `delta` of an earlier life of a live node, one this node re-published
    /// or another node's, with what this node held of each of their lanes before merging
    /// them. A node's live life is the latest of its row's here, the sender's if it is that
    /// node, and its row's in the frame (`from`: the sender and its frame's rows, taken in
    /// just before the delta, or none for a push): a node that starts sends its earlier lives' lanes before
    /// its row is everywhere, and a peer relays them with its row.
    fn earlier_lives_in(
        &self,
        (sender, rows): (ReplicaId, &[MemberEntry]),
        delta: &Delta,
    ) -> Vec<EarlierLife> {
        let me = self.config.replica;
        let newer_life = |origin: ReplicaId| {
            if origin == sender {
                // Its own live life (a push, the hot path).
                return None;
            }
            let in_frame = (rows.iter())
                .filter(|row| row.node == origin.node)
                .map(MemberEntry::replica)
                .max();
            let live = (sender.node == origin.node)
                .then_some(sender)
                .max(self.members.replica(origin.node))
                .max(in_frame)?;
            (live.generation > origin.generation).then_some(live)
        };
        (delta.origins.iter().enumerate())
            .filter_map(|(entry, origin_delta)| {
                let origin = origin_delta.origin;
                let owner = if origin.node == me.node {
                    self.republished.contains(&origin).then_some(me)
                } else {
                    newer_life(origin)
                }?;
                let held = (origin_delta.lanes.iter())
                    .map(|update| self.map.counter(&update.key)?.slot(origin))
                    .collect();
                Some(EarlierLife { entry, owner, held })
            })
            .collect()
    }

    /// Mends, once `entry` of a life this node re-published ([`Gossip::with_republished`])
    /// is merged, a lane the entry raised (`held`: each lane's slot before): its log was
    /// behind what the peer had, and every holder of its smaller totals under the
    /// re-published version keeps them, which no digest shows. The lane gets the next
    /// version, so that every holder takes the larger totals.
    fn restamp_raised(&mut self, now: Now, entry: &OriginDelta, held: &[Option<Slot>]) {
        for (update, held) in entry.lanes.iter().zip(held) {
            let before = held.map(|slot| slot.lane);
            let raised = Some(self.map.lane(&update.key, entry.origin)) != before;
            if raised
                && self
                    .map
                    .restamp(entry.origin, &update.key, self.own_stamps.at(now))
                    .is_some()
            {
                self.stats.lanes_restamped += 1;
            }
        }
    }

    /// Queues for another node, once `entry` of its earlier life is merged, each lane whose
    /// copy in the entry claims a newer version than held here but lacks some of its
    /// totals (the node re-published it from a log behind this copy): merged, to be given
    /// the next version there ([`Gossip::restamp_raised`]). Sent once the frame is handled
    /// (`handle_frame`), a frame's worth at a time, each lane counted at its largest.
    fn correct_owner(&mut self, entry: &OriginDelta, earlier: &EarlierLife) {
        let origin = entry.origin;
        let mut lanes: Vec<LaneUpdate> = (entry.lanes.iter().zip(&earlier.held))
            .filter_map(|(update, held)| {
                let held = held.as_ref()?;
                if update.version <= held.version || update.lane.covers(held.lane) {
                    return None;
                }
                let slot = self.map.counter(&update.key)?.slot(origin)?;
                Some(LaneUpdate {
                    key: update.key.clone(),
                    lane: slot.lane,
                    version: slot.version,
                })
            })
            .collect();
        if lanes.is_empty() {
            return;
        }
        lanes.sort_unstable_by_key(|update| update.version);
        lanes.dedup_by_key(|update| update.version);
        self.stats.lanes_corrected += lanes.len() as u64;
        let per_frame = (self.config.frame_bytes_max / 2 / DELTA_BYTES_MIN).max(1);
        for lanes in lanes.chunks(per_frame) {
            let correction = Message::Delta {
                to: earlier.owner,
                delta: Delta {
                    origins: vec![OriginDelta {
                        origin,
                        through: Watermark::default(),
                        lanes: lanes.to_vec(),
                    }],
                },
                members: Vec::new(),
                dead: Vec::new(),
            };
            self.corrections.push((earlier.owner.node, correction));
        }
    }

    /// What a peer holding `theirs` lacks and is worth sending now, of the origins
    /// `listed` accepts, cut to `budget`.
    ///
    /// With eager push that is an origin's lanes only if the peer lacks some this node
    /// held at its last round, and its stamp only if the peer's is more than a round older
    /// than the one held then: fresher lanes and stamps are already on their way to every
    /// live peer by push and heartbeat, and anti-entropy repairs what those miss a round
    /// later. Without eager push, everything the peer lacks. Either way, lanes held here
    /// past a gap, which no digest shows, go to a peer whose watermark is below them.
    fn delta_answering(
        &self,
        theirs: &Digest,
        listed: impl Fn(ReplicaId) -> bool,
        budget: usize,
    ) -> Delta {
        let worth = |origin, held: Watermark| {
            let mine = self.map.watermark(origin);
            let offer = if self.config.eager_push {
                self.settled
                    .origins
                    .get(&origin)
                    .copied()
                    .unwrap_or_default()
            } else {
                mine
            };
            let past_gap = self.map.top(origin) > mine.version.max(held.version);
            listed(origin) && (lacks(held, offer, self.stamp_slack()) || past_gap)
        };
        self.map
            .delta_for_origins(theirs, budget, self.rounds as usize, worth)
    }

    /// The digest a Syn carries, and its `unlisted` stamp, from everything this node holds
    /// at the start of a round.
    ///
    /// With eager push, every origin of which this node holds no lanes and a stamp at most
    /// two rounds old is left out: that stamp came by the origin's own heartbeat, which
    /// went to every live peer too (a healthy origin's stamp is at most a round and one
    /// delay old anywhere; two rounds leave room for any delay under a round), so a peer
    /// lacks it only if its link from the origin failed, and then its own Syn shows the
    /// stale stamp and the Ack relays it. At N = 512 with eight writers that is all but a
    /// few dozen of 512 entries. Every live member's current replica not held at all is
    /// listed (at the default watermark), so a peer does not read it as held fresh and
    /// relays its stamp. Without eager push, stamps travel by anti-entropy alone, and
    /// nothing held is left out.
    fn syn_digest(&self, mut digest: Digest, now: Now) -> (Digest, Stamp) {
        if !self.config.eager_push {
            return (digest, Stamp(0));
        }
        let rounds_ms =
            u64::try_from(self.config.gossip_interval.as_millis() * 2).unwrap_or(u64::MAX);
        let unlisted = Stamp(now.wall.0.saturating_sub(rounds_ms));
        let me = self.config.replica;
        digest.origins.retain(|&origin, held| {
            origin == me
                || held.version > Version::ZERO
                || self.map.top(origin) > Version::ZERO
                || held.stamp < unlisted
        });
        for node in self.members.others_in(&[State::Alive, State::Suspect]) {
            if let Some(replica) = self.members.replica(node) {
                if self.map.watermark(replica) == Watermark::default() {
                    digest.origins.entry(replica).or_default();
                }
            }
        }
        (digest, unlisted)
    }

    /// The round's Syn of `digest`: whole if it fits in a frame. Else a part of it a
    /// round, each from where the last ended (wrapping to the first origin after the
    /// last), of as many origins as half a frame holds, which leaves room for the other
    /// half in an Ack (its digest is cut to half a frame too: `wanted_from`). Unsent, a
    /// digest too large would stop anti-entropy and the exchange of tables (past about
    /// 3,800 origins at the default 64 KiB).
    fn syn_in_parts(&mut self, digest: Digest, unlisted: Stamp) -> Message {
        let me = self.config.replica;
        let members_hash = self.members.hash();
        let syn = |digest, covers| Message::Syn {
            digest,
            unlisted,
            members_hash,
            covers,
        };
        let count = digest.origins.len();
        let whole = syn(digest, Cover::All);
        let whole_bytes = wire::encode(me, &whole).len();
        let digest = match whole {
            Message::Syn { digest, .. } if whole_bytes > self.config.frame_bytes_max => digest,
            whole => return whole,
        };
        let part_bytes_max = self.config.frame_bytes_max / 2;
        let mut take = (part_bytes_max * count / whole_bytes).max(1);
        let from = if digest.origins.range(self.syn_from..).next().is_some() {
            self.syn_from
        } else {
            FIRST_ORIGIN
        };
        loop {
            let until = digest
                .origins
                .range(from..)
                .nth(take)
                .map(|(&origin, _)| origin);
            let origins = digest
                .origins
                .range(from..)
                .take(take)
                .map(|(&origin, &held)| (origin, held))
                .collect();
            let part = syn(Digest { origins }, Cover::Part { from, until });
            if take == 1 || wire::encode(me, &part).len() <= part_bytes_max {
                self.syn_from = until.unwrap_or(FIRST_ORIGIN);
                return part;
            }
            take /= 2;
        }
    }

    /// A Syn's digest as its sender holds things: every origin held here, of those it
    /// `covers`, that it does not list, the sender holds at version 0 with a stamp of at
    /// least `unlisted`.
    fn digest_with_unlisted(&self, mut digest: Digest, unlisted: Stamp, covers: Cover) -> Digest {
        let floor = Watermark {
            version: Version::ZERO,
            stamp: unlisted,
        };
        for origin in self.map.origins().filter(|&origin| covers.contains(origin)) {
            digest.origins.entry(origin).or_insert(floor);
        }
        digest
    }

    /// The digest an Ack carries: my watermark for each origin of which a Syn's digest
    /// `theirs` shows something I lack, which is all its sender needs to answer; at most
    /// as many as half a frame holds (either side of a node that starts can lack
    /// thousands: the node every origin its peer holds, and the peer the stamps its small
    /// Syn implies), in replica order from after the last origin the Ack before listed,
    /// or from a random place if that is outside what this Syn shows lacking (the Ack
    /// before answered another part). The Syn's sender answers only the origins listed, so
    /// one left out keeps its watermark here until a later Ack lists it; the place moves
    /// on whether or not the origins listed are answered, so origins never answered (a
    /// stamp the sender only implies) do not hold back the ones after them.
    fn wanted_from(&mut self, theirs: &Digest) -> Digest {
        let wanted: Vec<(ReplicaId, Watermark)> = theirs
            .origins
            .iter()
            .map(|(&origin, &offer)| (origin, offer, self.map.watermark(origin)))
            .filter(|&(_, offer, mine)| lacks(mine, offer, self.stamp_slack()))
            .map(|(origin, _, mine)| (origin, mine))
            .collect();
        let most = self.config.frame_bytes_max / 2 / wire::DIGEST_ENTRY_BYTES_MAX;
        if wanted.len() <= most {
            return Digest {
                origins: wanted.into_iter().collect(),
            };
        }
        let (first, last) = (wanted[0].0, wanted[wanted.len() - 1].0);
        let start = if (first..=last).contains(&self.ack_from) {
            wanted.partition_point(|&(origin, _)| origin < self.ack_from)
        } else {
            self.rng.gen_range(0..wanted.len())
        };
        let listed = (wanted.iter().cycle().skip(start)).take(most);
        let origins = listed.copied().collect();
        self.ack_from = wanted[(start + most) % wanted.len()].0;
        Digest { origins }
    }

    /// How much older than another node's an origin's stamp may be here before that node
    /// relays it: a round with eager push, whose heartbeat reaches every peer each round.
    fn stamp_slack(&self) -> Duration {
        if self.config.eager_push {
            self.config.gossip_interval
        } else {
            Duration::ZERO
        }
    }

    /// Puts in `message` (an `Ack` or `Delta` with an empty delta) what a peer holding
    /// `theirs` lacks of the origins `listed` accepts ([`Gossip::delta_answering`]), as
    /// much as its frame holds.
    ///
    /// The map budgets a lane at its largest possible encoding, several times what it
    /// usually takes (a frame names a lane's rule and window once, and its totals are
    /// varints), so a frame cut to the byte budget alone is mostly empty, and a long
    /// partition heals a round at a time in such frames. Budgets 4 and 2 times larger are
    /// tried first, then the plain budget, each kept only if its frame fits. The plain
    /// budget leaves room for the rest of the message as encoded without the delta, but a
    /// delta's newer stamp can lengthen every stamp the rest encodes relative to it; if
    /// even that frame does not fit, the delta is left empty.
    fn fill_delta(
        &self,
        message: &mut Message,
        theirs: &Digest,
        listed: impl Fn(ReplicaId) -> bool + Copy,
    ) {
        let without = wire::encode(self.config.replica, message).len();
        let budget = self.config.frame_bytes_max.saturating_sub(without + 16);
        for scale in [4, 2, 1, 0] {
            let delta = match scale {
                0 => Delta::default(),
                _ => self.delta_answering(theirs, listed, budget.saturating_mul(scale)),
            };
            let (Message::Ack { delta: slot, .. } | Message::Delta { delta: slot, .. }) = message
            else {
                return;
            };
            *slot = delta;
            let fits =
                || wire::encode(self.config.replica, message).len() <= self.config.frame_bytes_max;
            if scale == 0 || fits() {
                return;
            }
        }
    }

    /// Puts in `message` (an `Ack` or `Delta` with no rows) a part of my table for `peer`,
    /// and the nodes of its rows I hold as dead. A part holds as many rows as half the room
    /// the frame has left past the smallest delta: my own row, then live rows (alive or
    /// suspect) and the other rows, the live ones first in every other part to `peer` and
    /// the others first in the rest, each kind taken on from where the last part to `peer`
    /// left off, wrapping around. So a table too large for one frame reaches a peer over
    /// several exchanges, with my own row in every part, live rows in the first, and
    /// neither kind held back for good by the other. The rest of the frame is left to the
    /// delta. A merge takes any subset of rows, so the parts need no order.
    fn fill_members(&mut self, message: &mut Message, peer: NodeId) {
        let without = wire::encode(self.config.replica, message).len();
        let room = self
            .config
            .frame_bytes_max
            .saturating_sub(without + DELTA_BYTES_MIN);
        let mut budget = room / MEMBERS_SHARE_OF_ROOM;
        let me = self.members.me();
        let Some(left) = budget.checked_sub(wire::member_bytes(&me)) else {
            return;
        };
        budget = left;
        let (live, mut others): (Vec<MemberEntry>, Vec<MemberEntry>) = self
            .members
            .entries()
            .into_iter()
            .filter(|row| row.node != me.node)
            .partition(|row| {
                let state = self.members.state(row.node);
                matches!(state, Some(State::Alive | State::Suspect))
            });
        let (mut rows, mut dead) = (vec![me], Vec::new());
        // A peer held as gone gets its own row next: if it still runs (forgotten while cut
        // off), that row is how it learns so, however many parts the table takes.
        if let Some(at) = others.iter().position(|row| row.node == peer && row.left) {
            let row = others.remove(at);
            if let Some(left) = budget.checked_sub(wire::member_bytes(&row)) {
                budget = left;
                rows.push(row);
            }
        }
        let mut cursor = self.members_next.get(&peer).copied().unwrap_or_default();
        let (budget, rows_out, dead_out) = (&mut budget, &mut rows, &mut dead);
        if cursor.others_first {
            cursor.others += self.take_rows(&others, cursor.others, budget, rows_out, dead_out);
            cursor.live += self.take_rows(&live, cursor.live, budget, rows_out, dead_out);
        } else {
            cursor.live += self.take_rows(&live, cursor.live, budget, rows_out, dead_out);
            cursor.others += self.take_rows(&others, cursor.others, budget, rows_out, dead_out);
        }
        cursor.others_first = !cursor.others_first;
        self.members_next.insert(peer, cursor);
        if let Message::Ack {
            members,
            dead: listed,
            ..
        }
        | Message::Delta {
            members,
            dead: listed,
            ..
        } = message
        {
            (*members, *listed) = (rows, dead);
        }
    }

    /// Moves from `from` into `rows`, starting at `start` (modulo their number) and
    /// wrapping around, as many as `budget` holds, listing in `dead` those I hold as dead.
    /// Returns how many it took.
    fn take_rows(
        &self,
        from: &[MemberEntry],
        start: usize,
        budget: &mut usize,
        rows: &mut Vec<MemberEntry>,
        dead: &mut Vec<NodeId>,
    ) -> usize {
        let Some(start) = start.checked_rem(from.len()) else {
            return 0;
        };
        let mut taken = 0;
        for row in from.iter().cycle().skip(start).take(from.len()) {
            let is_dead = self.members.state(row.node) == Some(State::Dead);
            let mut cost = wire::member_bytes(row);
            if is_dead {
                cost += wire::node_bytes(row.node);
            }
            if cost > *budget {
                break;
            }
            *budget -= cost;
            if is_dead {
                dead.push(row.node);
            }
            rows.push(row.clone());
            taken += 1;
        }
        taken
    }

    fn has_left(&self) -> bool {
        self.members.state(self.config.node()) == Some(State::Left)
    }

    fn emit_transitions(&mut self) {
        for transition in self.members.take_transitions() {
            self.outbox
                .push_back(Output::Event(Event::Member(transition)));
        }
    }

    fn send(&mut self, to: NodeId, message: &Message) {
        self.send_to(&[to], message);
    }

    /// Sends one message to several peers, encoding it once.
    fn send_to(&mut self, peers: &[NodeId], message: &Message) {
        if peers.is_empty() {
            return;
        }
        let frame = wire::encode(self.config.replica, message);
        if frame.len() > self.config.frame_bytes_max {
            // Deltas, pushes, digests and parts of the table are cut to fit, so no path to
            // this is known: a guard. A peer would refuse the frame; it is not sent.
            self.stats.frames_oversize += 1;
            return;
        }
        let by_message = &mut self.stats.bytes_out_by_message;
        let (lanes, kind_bytes) = match message {
            Message::Syn { .. } => (0, &mut by_message.syn),
            Message::Ack { delta, .. } => (delta.lanes(), &mut by_message.ack),
            Message::Delta { delta, .. } => (delta.lanes(), &mut by_message.delta),
            Message::Push { lanes, .. } if lanes.lanes.is_empty() => (0, &mut by_message.heartbeat),
            Message::Push { lanes, .. } => (lanes.lanes.len(), &mut by_message.push),
            Message::Members { .. } => (0, &mut by_message.members),
            Message::Settled { .. } | Message::Held { .. } => (0, &mut by_message.settled),
        };
        *kind_bytes += (frame.len() * peers.len()) as u64;
        for &to in peers {
            self.stats.frames_out += 1;
            self.stats.bytes_out += frame.len() as u64;
            self.stats.lanes_out += lanes as u64;
            let addr = self.addr_of(to);
            self.outbox.push_back(Output::Send {
                to,
                addr,
                frame: frame.clone(),
            });
        }
    }

    /// Where `node` is sent to: the address its row gives, else its seed's. A seed whose
    /// life left is knocked on at its seed's address: it may start again elsewhere, at the
    /// address it is configured by (a fixed name in front of a new host).
    fn addr_of(&self, node: NodeId) -> String {
        let seed = || {
            let seed = self.config.seeds.iter().find(|seed| seed.node == node);
            seed.map(|seed| seed.addr.clone())
        };
        if self.members.state(node) == Some(State::Left) {
            if let Some(addr) = seed() {
                return addr;
            }
        }
        if let Some(addr) = self.members.addr(node).filter(|addr| !addr.is_empty()) {
            return addr.to_owned();
        }
        seed().unwrap_or_default()
    }
}

/// An entry of a delta of an earlier life of a live node (`Gossip::earlier_lives_in`).
struct EarlierLife {
    /// Its index in the delta.
    entry: usize,
    /// The node's live replica, which alone gives that life's lanes new versions.
    owner: ReplicaId,
    /// Per lane of the entry, the slot held before the merge.
    held: Vec<Option<Slot>>,
}

/// Whether a holder at `held` lacks something of `offer`: lanes, or a stamp newer by more
/// than `slack`.
fn lacks(held: Watermark, offer: Watermark, slack: Duration) -> bool {
    let slack_ms = u64::try_from(slack.as_millis()).unwrap_or(u64::MAX);
    offer.version > held.version || offer.stamp.0 > held.stamp.0.saturating_add(slack_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_crdt::{Generation, OriginDelta, Rule, Subject, Window};

    const WALL: u64 = 1_767_225_600_000;

    fn now(ms: u64) -> Now {
        Now {
            mono: Duration::from_millis(ms),
            wall: Stamp(WALL + ms),
        }
    }

    fn node(id: u64) -> Gossip {
        Gossip::new(Config::new(
            ReplicaId::new(NodeId(id), Generation(1)),
            format!("n{id}"),
        ))
    }

    fn push_frame(from: ReplicaId) -> Vec<u8> {
        let key = Key::new(
            Rule::new("r").unwrap(),
            Subject::new("s").unwrap(),
            Window::containing(WALL / 1_000, 60).unwrap(),
        );
        let lane = tally_crdt::LaneUpdate {
            key,
            lane: Lane::new(1_000, 0),
            version: Version(1),
        };
        push_of(from, Version(1), Stamp(WALL), vec![lane])
    }

    /// A push of `lanes` from `from`, through `version` at `stamp`.
    fn push_of(
        from: ReplicaId,
        version: Version,
        stamp: Stamp,
        lanes: Vec<tally_crdt::LaneUpdate>,
    ) -> Vec<u8> {
        let through = Watermark { version, stamp };
        let lanes = OriginDelta {
            origin: from,
            through,
            lanes,
        };
        wire::encode(
            from,
            &Message::Push {
                after: Version::ZERO,
                lanes,
            },
        )
    }

    #[test]
    fn a_heartbeat_vouches_for_no_write_the_gossip_does_not_hold_yet() {
        let mut gossip = node(1);
        let me = gossip.replica();
        let stamp_after = |gossip: &mut Gossip, ms: u64| {
            gossip.handle_input(Input::Timeout { now: now(ms) });
            gossip.map().watermark(me).stamp
        };
        let first = gossip.config().gossip_interval.as_millis() as u64;
        assert_eq!(stamp_after(&mut gossip, first), Stamp(WALL + first));
        // A write made 300 ms before the next round waits for its collection or a sync.
        let next = 2 * first;
        gossip.hold_stamps_from(Some(Duration::from_millis(next - 300)));
        assert_eq!(
            stamp_after(&mut gossip, next),
            Stamp(WALL + next - 300),
            "the heartbeat is stamped no later than the write the gossip lacks"
        );
        gossip.hold_stamps_from(None);
        assert_eq!(stamp_after(&mut gossip, 3 * first), Stamp(WALL + 3 * first));
    }

    #[test]
    fn lanes_handed_after_a_round_keep_the_stamp_of_their_collection() {
        // With a data_dir, lanes collected at `collected` reach the gossip once the lane
        // log's sync returns; a round may run meanwhile, its stamp held back to the oldest
        // write the gossip lacks. The lanes must not vouch for the round's time: a write
        // queued after their collection is still missing.
        let mut gossip = node(1);
        let me = gossip.replica();
        let first = gossip.config().gossip_interval.as_millis() as u64;
        gossip.handle_input(Input::Timeout { now: now(first) });
        let round = 2 * first;
        let collected = round - 300;
        let queued_after = round - 200;
        // At the round, the collected lanes wait for their sync (their oldest write a
        // little before their collection).
        gossip.hold_stamps_from(Some(Duration::from_millis(collected - 10)));
        gossip.handle_input(Input::Timeout { now: now(round) });
        assert_eq!(
            gossip.map().watermark(me).stamp,
            Stamp(WALL + collected - 10)
        );
        // The sync returns; a write queued at `queued_after` is still not collected.
        let key = Key::new(
            Rule::new("r").unwrap(),
            Subject::new("s").unwrap(),
            Window::containing(WALL / 1_000, 60).unwrap(),
        );
        gossip.handle_input(Input::LocalLanes {
            now: now(collected),
            lanes: vec![(key, Lane::new(1, 0))],
        });
        let stamp = gossip.map().watermark(me).stamp;
        assert!(
            stamp < Stamp(WALL + queued_after),
            "lanes collected at {collected} ms are stamped {} ms: they vouch for the write \
             queued at {queued_after} ms that the gossip lacks",
            stamp.0 - WALL
        );
        assert_eq!(stamp, Stamp(WALL + collected));
    }

    /// Node 2 announces itself to `gossip`, and becomes its live peer.
    fn announce_node_2(gossip: &mut Gossip) {
        let announce = Message::Members {
            members: vec![MemberEntry {
                node: NodeId(2),
                generation: Generation(1),
                addr: "n2".into(),
                left: false,
            }],
        };
        receive_from_node_2(gossip, wire::encode(node(2).replica(), &announce));
    }

    fn receive_from_node_2(gossip: &mut Gossip, frame: Vec<u8>) {
        gossip.handle_input(Input::Receive {
            now: now(1),
            from: NodeId(2),
            frame,
        });
    }

    /// Node 1, having written `mine` once (a lane of 3 at version 1), is sent by node 2
    /// `lane` of its own replica at `version`, through version 0, in the window of
    /// `ago_secs` before now: the events it reports.
    fn reuse_events(
        lane: Lane,
        version: Version,
        subject: &str,
        ago_secs: u64,
    ) -> Vec<(Version, Version)> {
        let mut gossip = node(1);
        let key = |subject: &str, ago_secs| {
            Key::new(
                Rule::new("r").unwrap(),
                Subject::new(subject).unwrap(),
                Window::containing(WALL / 1_000 - ago_secs, 60).unwrap(),
            )
        };
        gossip.handle_input(Input::LocalLanes {
            now: now(1),
            lanes: vec![(key("mine", 0), Lane::new(3, 0))],
        });
        handed_back(&mut gossip, now(1), key(subject, ago_secs), lane, version)
    }

    /// The events `gossip` reports once node 2 sends it, at `now`, `lane` of its own
    /// replica at `version`, through version 0.
    fn handed_back(
        gossip: &mut Gossip,
        now: Now,
        key: Key,
        lane: Lane,
        version: Version,
    ) -> Vec<(Version, Version)> {
        let delta = Message::Delta {
            to: gossip.replica(),
            delta: Delta {
                origins: vec![OriginDelta {
                    origin: gossip.replica(),
                    through: Watermark::default(),
                    lanes: vec![tally_crdt::LaneUpdate { key, lane, version }],
                }],
            },
            members: Vec::new(),
            dead: Vec::new(),
        };
        gossip.handle_input(Input::Receive {
            now,
            from: NodeId(2),
            frame: wire::encode(node(2).replica(), &delta),
        });
        let mut events = Vec::new();
        loop {
            match gossip.poll_output() {
                Output::Event(Event::GenerationReused { seen, written }) => {
                    events.push((seen, written));
                }
                Output::Timeout(_) => return events,
                _ => {}
            }
        }
    }

    /// Node 3's first life's lanes, last stamped half an hour ago (node 3 has restarted
    /// since), relayed by node 2 to node 1 by anti-entropy with `rows`; the samples past
    /// 60 s node 1's propagation delay took (none, as that life's age is no delay).
    fn samples_past_a_minute_of_an_earlier_life_relayed_with(rows: Vec<MemberEntry>) -> u64 {
        samples_past_a_minute_of_node_3_gen_1_relayed_with(rows, Vec::new())
    }

    /// Node 3's generation-1 lanes, last stamped half an hour ago, relayed by node 2 to a
    /// node 1 that has just started, by anti-entropy with `rows` and `dead`: the samples
    /// past 60 s node 1's propagation delay took.
    fn samples_past_a_minute_of_node_3_gen_1_relayed_with(
        rows: Vec<MemberEntry>,
        dead: Vec<NodeId>,
    ) -> u64 {
        let mut gossip = node(1);
        announce_node_2(&mut gossip);
        let old_life = ReplicaId::new(NodeId(3), Generation(1));
        let key = Key::new(
            Rule::new("r").unwrap(),
            Subject::new("s").unwrap(),
            Window::containing(WALL / 1_000, 3_600).unwrap(),
        );
        let stamp = Stamp(WALL - 1_800_000);
        let delta = Message::Delta {
            to: gossip.replica(),
            delta: Delta {
                origins: vec![OriginDelta {
                    origin: old_life,
                    through: Watermark {
                        version: Version(1),
                        stamp,
                    },
                    lanes: vec![tally_crdt::LaneUpdate {
                        key,
                        lane: Lane::new(5, 0),
                        version: Version(1),
                    }],
                }],
            },
            members: rows,
            dead,
        };
        receive_from_node_2(&mut gossip, wire::encode(node(2).replica(), &delta));
        assert_eq!(gossip.map.watermark(old_life).stamp, stamp, "taken");
        let propagation = &gossip.stats().propagation;
        propagation.counts[crate::Histogram::BOUNDS_MS.len()]
    }

    /// The propagation delay is sampled from members' current replicas alone (found in
    /// review, session 47): an earlier life's lanes, still in a live window, reaching node 1
    /// with node 3's row of its next life are no delay of half an hour.
    #[test]
    fn an_earlier_lifes_old_state_arriving_is_no_propagation_delay_sample() {
        let row = MemberEntry {
            node: NodeId(3),
            generation: Generation(2),
            addr: "n3".into(),
            left: false,
        };
        assert_eq!(
            samples_past_a_minute_of_an_earlier_life_relayed_with(vec![row]),
            0
        );
    }

    /// Nor relayed without any row of node 3, which node 1 does not hold yet (found in
    /// review, session 47).
    #[test]
    fn a_relayed_earlier_life_of_a_node_with_no_row_is_no_sample() {
        assert_eq!(
            samples_past_a_minute_of_an_earlier_life_relayed_with(Vec::new()),
            0
        );
    }

    /// (Review of f06843f/1f27df4.) Node 3 crashed half an hour ago and was declared dead;
    /// its one life's lanes are still in a live window. Node 1 starts (or restarts under a
    /// new generation) and node 2 sends it, by anti-entropy, node 3's row (listed dead) with
    /// those lanes. They arrive as old as that life's end, no delay of anything; node 3's row
    /// is of that very generation, so before session 48 the sample of half an hour was
    /// taken.
    #[test]
    fn a_dead_members_old_state_relayed_to_a_new_node_is_no_sample() {
        let row = MemberEntry {
            node: NodeId(3),
            generation: Generation(1),
            addr: "n3".into(),
            left: false,
        };
        assert_eq!(
            samples_past_a_minute_of_node_3_gen_1_relayed_with(vec![row], vec![NodeId(3)]),
            0,
            "a dead member's half-hour-old state was sampled as a propagation delay"
        );
    }

    /// (Review of f06843f/1f27df4.) The same for a member that left half an hour ago: its
    /// lanes stay counted until their window ends, and reach a node that starts meanwhile.
    #[test]
    fn a_left_members_old_state_relayed_to_a_new_node_is_no_sample() {
        let row = MemberEntry {
            node: NodeId(3),
            generation: Generation(1),
            addr: "n3".into(),
            left: true,
        };
        assert_eq!(
            samples_past_a_minute_of_node_3_gen_1_relayed_with(vec![row], Vec::new()),
            0,
            "a left member's half-hour-old state was sampled as a propagation delay"
        );
    }

    /// (Found in review, session 47.) A node that joins pushes its writes to every member it learned from its
    /// seed, some of which have not yet learned its row (they do at a later anti-entropy
    /// round): a push is its sender's current life (`earlier_lives_in`: "its own live
    /// life"), and its delay is a sample.
    #[test]
    fn a_push_from_a_member_whose_row_has_not_arrived_is_a_sample() {
        let mut gossip = node(1);
        announce_node_2(&mut gossip);
        let three = ReplicaId::new(NodeId(3), Generation(1));
        gossip.handle_input(Input::Receive {
            now: now(5),
            from: NodeId(3),
            frame: push_frame(three),
        });
        assert_eq!(
            gossip.map.watermark(three).stamp,
            Stamp(WALL),
            "its lanes are taken"
        );
        let propagation = &gossip.stats().propagation;
        assert_eq!(
            propagation.counts.iter().sum::<u64>(),
            1,
            "node 3's push, 5 ms old, was not sampled: {:?}",
            propagation.counts
        );
    }

    #[test]
    fn a_clock_stepped_back_an_hour_still_takes_peers_lanes_of_the_current_window() {
        let config = Config::new(ReplicaId::new(NodeId(1), Generation(1)), "n1".to_owned());
        let mut gossip = Gossip::with_state(config, CounterMap::new().with_lane_rate_max(1_000));
        let peer = node(2).replica();
        let key = Key::new(
            Rule::new("r").unwrap(),
            Subject::new("s").unwrap(),
            Window::containing(WALL / 1_000, 60).unwrap(),
        );
        let push = |version: u64, incr: u64| {
            let lane = tally_crdt::LaneUpdate {
                key: key.clone(),
                lane: Lane::new(incr, 0),
                version: Version(version),
            };
            push_of(peer, Version(version), Stamp(WALL), vec![lane])
        };
        receive_from_node_2(&mut gossip, push(1, 5));
        assert_eq!(gossip.map().value(&key), 5);
        // The wall clock steps back an hour: the window the peer writes in now looks an
        // hour ahead, and a lane of it is still its peer's, taken.
        let stepped_back = Now {
            mono: Duration::from_millis(2),
            wall: Stamp(WALL - 3_600_000),
        };
        gossip.handle_input(Input::Receive {
            now: stepped_back,
            from: NodeId(2),
            frame: push(2, 9),
        });
        assert_eq!(gossip.map().value(&key), 9);
        assert_eq!(gossip.stats().lanes_throttled, 0);
    }

    #[test]
    fn a_lane_it_never_wrote_of_a_window_written_after_its_clock_stepped_back_is_a_reuse() {
        // Node 1 writes a lane of a 60 s window, and three minutes on collects it.
        let mut gossip = node(1);
        let key = |subject: &str, at_ms: u64| {
            Key::new(
                Rule::new("r").unwrap(),
                Subject::new(subject).unwrap(),
                Window::containing((WALL + at_ms) / 1_000, 60).unwrap(),
            )
        };
        gossip.handle_input(Input::LocalLanes {
            now: now(1),
            lanes: vec![(key("before", 1), Lane::new(3, 0))],
        });
        gossip.handle_input(Input::Timeout { now: now(180_000) });
        // Its wall clock steps back two minutes, and it writes a lane (version 2) of the
        // window it is in now: a window it never wrote before, which ended before the
        // round's collection, and which it holds.
        let stepped = Now {
            mono: Duration::from_millis(181_000),
            wall: Stamp(WALL + 61_000),
        };
        let mine = key("after", 61_000);
        gossip.handle_input(Input::LocalLanes {
            now: stepped,
            lanes: vec![(mine.clone(), Lane::new(1, 0))],
        });
        while !matches!(gossip.poll_output(), Output::Timeout(_)) {}
        // A peer hands back that lane at that version, with totals this life never wrote:
        // another life under the same replica id wrote it.
        let later = Now {
            mono: Duration::from_millis(182_000),
            wall: Stamp(WALL + 62_000),
        };
        assert_eq!(
            handed_back(&mut gossip, later, mine, Lane::new(100, 0), Version(2)),
            [(Version(2), Version(2))],
            "a lane above the one it holds, at a version it wrote"
        );
    }

    #[test]
    fn a_lane_of_its_own_replica_that_this_life_never_wrote_reports_the_generation_reused() {
        // Past a gap: a version above this life's, the watermark not raised by it.
        assert_eq!(
            reuse_events(Lane::new(1, 0), Version(5), "other", 0),
            [(Version(5), Version(1))]
        );
        // At a version it wrote, with totals above its own.
        assert_eq!(
            reuse_events(Lane::new(100, 0), Version(1), "mine", 0),
            [(Version(1), Version(1))]
        );
        // Its own lane handed back as it wrote it: nothing to report.
        assert_eq!(reuse_events(Lane::new(3, 0), Version(1), "mine", 0), []);
        // Nor a lane of a window over here (its own, handed back late): not held to
        // compare, and not taken.
        assert_eq!(reuse_events(Lane::new(3, 0), Version(1), "old", 3_600), []);
    }

    #[test]
    fn leaving_pushes_the_lanes_still_waiting_for_their_batch() {
        let mut gossip = node(1);
        announce_node_2(&mut gossip);
        let key = Key::new(
            Rule::new("r").unwrap(),
            Subject::new("mine").unwrap(),
            Window::containing(WALL / 1_000, 60).unwrap(),
        );
        gossip.handle_input(Input::LocalLanes {
            now: now(2),
            lanes: vec![(key, Lane::new(7, 0))],
        });
        gossip.handle_input(Input::Leave);
        let mut pushed = 0;
        loop {
            match gossip.poll_output() {
                Output::Send { frame, .. } => {
                    if let Message::Push { lanes, .. } =
                        wire::decode(&frame, 1 << 20).unwrap().message
                    {
                        pushed += lanes.lanes.len();
                    }
                }
                Output::Event(_) => {}
                Output::Timeout(_) => break,
            }
        }
        assert_eq!(pushed, 1, "the unpushed lane went out before the goodbye");
    }

    /// The contract `tallyd`'s driver collects by (`Collecting::AtPush`): lanes handed in
    /// while a push is pending, up to its deadline, go out in that push, and no push is
    /// pending after it.
    #[test]
    fn lanes_handed_in_while_a_push_is_pending_go_out_in_it() {
        let mut gossip = node(1);
        announce_node_2(&mut gossip);
        let key = |subject: &str| {
            Key::new(
                Rule::new("r").unwrap(),
                Subject::new(subject).unwrap(),
                Window::containing(WALL / 1_000, 60).unwrap(),
            )
        };
        let drain = |gossip: &mut Gossip| {
            let mut pushed = Vec::new();
            loop {
                match gossip.poll_output() {
                    Output::Send { frame, .. } => {
                        if let Message::Push { lanes, .. } =
                            wire::decode(&frame, 1 << 20).unwrap().message
                        {
                            pushed.extend(lanes.lanes.into_iter().map(|lane| lane.key));
                        }
                    }
                    Output::Event(_) => {}
                    Output::Timeout(deadline) => return (pushed, deadline),
                }
            }
        };
        // The first round, which schedules the next a gossip interval on.
        gossip.handle_input(Input::Timeout { now: now(1) });
        drain(&mut gossip);
        assert!(!gossip.push_pending(), "no own lane waits");

        gossip.handle_input(Input::LocalLanes {
            now: now(2),
            lanes: vec![(key("first"), Lane::new(1, 0))],
        });
        assert!(gossip.push_pending());
        let (pushed, deadline) = drain(&mut gossip);
        assert!(pushed.is_empty(), "the push waits for its interval");
        let push_interval = gossip.config().push_interval;
        assert_eq!(deadline, Duration::from_millis(2) + push_interval);

        // Handed in just before the deadline: it does not move, and the lane joins.
        let last_ms = deadline.as_millis() as u64 - 1;
        gossip.handle_input(Input::LocalLanes {
            now: now(last_ms),
            lanes: vec![(key("last"), Lane::new(1, 0))],
        });
        assert_eq!(drain(&mut gossip).1, deadline);
        gossip.handle_input(Input::Timeout {
            now: now(deadline.as_millis() as u64),
        });
        let (pushed, _) = drain(&mut gossip);
        assert_eq!(pushed, [key("first"), key("last")]);
        assert!(!gossip.push_pending(), "every own lane went out");
    }

    /// Feeds `gossip` a Syn from node 1 carrying `digest` and returns its Ack.
    fn ack_to_syn(gossip: &mut Gossip, digest: Digest, at_ms: u64) -> Message {
        ack_to_part(gossip, digest, Cover::All, at_ms)
    }

    /// [`ack_to_syn`] for a Syn whose digest `covers` the origins given.
    fn ack_to_part(gossip: &mut Gossip, digest: Digest, covers: Cover, at_ms: u64) -> Message {
        let syn = Message::Syn {
            digest,
            unlisted: Stamp(0),
            members_hash: 0,
            covers,
        };
        gossip.handle_input(Input::Receive {
            now: now(at_ms),
            from: NodeId(1),
            frame: wire::encode(node(1).replica(), &syn),
        });
        loop {
            match gossip.poll_output() {
                Output::Send {
                    to: NodeId(1),
                    frame,
                    ..
                } => {
                    return wire::decode(&frame, 1 << 20).unwrap().message;
                }
                Output::Timeout(_) => panic!("no answer to the syn"),
                _ => {}
            }
        }
    }

    fn lanes_of(message: &Message, origin: ReplicaId) -> usize {
        let Message::Ack { delta, .. } = message else {
            panic!("not an ack: {message:?}");
        };
        let entry = delta.origins.iter().find(|entry| entry.origin == origin);
        entry.map_or(0, |entry| entry.lanes.len())
    }

    #[test]
    fn lanes_that_arrived_since_the_last_round_are_left_to_the_pushes() {
        let mut gossip = node(2);
        gossip.handle_input(Input::Timeout { now: now(0) });
        gossip.handle_input(Input::Receive {
            now: now(1),
            from: NodeId(3),
            frame: push_frame(node(3).replica()),
        });
        let ack = ack_to_syn(&mut gossip, Digest::default(), 2);
        assert_eq!(lanes_of(&ack, node(3).replica()), 0, "in flight by push");

        gossip.handle_input(Input::Timeout { now: now(1_000) });
        let ack = ack_to_syn(&mut gossip, Digest::default(), 1_001);
        assert_eq!(
            lanes_of(&ack, node(3).replica()),
            1,
            "repaired a round later"
        );
    }

    #[test]
    fn an_ack_lists_only_what_its_sender_lacks_and_relays_only_stamps_a_round_old() {
        let mut gossip = node(2);
        gossip.handle_input(Input::Receive {
            now: now(1),
            from: NodeId(3),
            frame: push_frame(node(3).replica()),
        });
        gossip.handle_input(Input::Timeout { now: now(2) });
        let held = gossip.map().watermark(node(3).replica());
        let syn_digest = |origin_3_stamp: u64| Digest {
            origins: [
                (
                    node(3).replica(),
                    Watermark {
                        version: held.version,
                        stamp: Stamp(origin_3_stamp),
                    },
                ),
                (
                    node(4).replica(),
                    Watermark {
                        version: Version(5),
                        stamp: Stamp(WALL),
                    },
                ),
            ]
            .into_iter()
            .collect(),
        };

        let ack = ack_to_syn(&mut gossip, syn_digest(held.stamp.0 - 50), 3);
        let Message::Ack { delta, digest, .. } = &ack else {
            panic!("not an ack: {ack:?}");
        };
        let wanted: Vec<ReplicaId> = digest.origins.keys().copied().collect();
        assert_eq!(
            wanted,
            [node(4).replica()],
            "node 4's lanes are all it lacks"
        );
        assert!(
            delta
                .origins
                .iter()
                .all(|entry| entry.origin != node(3).replica()),
            "a stamp 50 ms older is left to the heartbeat"
        );

        let ack = ack_to_syn(&mut gossip, syn_digest(held.stamp.0 - 2_000), 4);
        let Message::Ack { delta, .. } = &ack else {
            panic!("not an ack: {ack:?}");
        };
        let relayed = delta
            .origins
            .iter()
            .find(|entry| entry.origin == node(3).replica());
        assert_eq!(
            relayed.map(|entry| entry.through),
            Some(held),
            "a stamp 2 s older is relayed"
        );
    }

    #[test]
    fn an_ack_lacking_more_origins_than_a_frame_holds_asks_for_half_a_frames_worth() {
        // A member's Syn lists 14,000 made-up origins, about 4 bytes each; an Ack asking
        // for all of them would take more bytes each (its stamps are far from its newest)
        // and not fit. Each Ack asks for as many as half a frame holds, from after the last
        // one the Ack before asked for, so the Syn sent again gets every one asked for in
        // turn.
        let mut gossip = node(2);
        let origins: BTreeMap<ReplicaId, Watermark> = (10..14_010)
            .map(|id| {
                let origin = ReplicaId::new(NodeId(id), Generation(WALL));
                let offer = Watermark {
                    version: Version(1),
                    stamp: Stamp(WALL),
                };
                (origin, offer)
            })
            .collect();
        let most = gossip.config.frame_bytes_max / 2 / wire::DIGEST_ENTRY_BYTES_MAX;
        let mut asked = BTreeSet::new();
        let mut acks = 0;
        // The first from a random place, so one more than the parts it takes.
        while asked.len() < 14_000 && acks <= 14_000_usize.div_ceil(most) {
            let digest = Digest {
                origins: origins.clone(),
            };
            let Message::Ack { digest, .. } = ack_to_syn(&mut gossip, digest, 1) else {
                panic!("not an Ack");
            };
            assert_eq!(digest.origins.len(), most);
            asked.extend(digest.origins.into_keys());
            acks += 1;
        }
        assert_eq!(
            asked.len(),
            14_000,
            "every origin asked for, in {acks} Acks"
        );
        // Every Ack was sent: none passed the frame.
        assert_eq!(gossip.stats().frames_oversize, 0);
    }

    #[test]
    fn acks_to_a_syn_in_two_parts_ask_for_more_of_each_part_than_its_first_half_frame() {
        // Each part shows more lacking than an Ack lists. Answering the other part moves
        // the place past this one, so an Ack to it starts from a random place, not always
        // from its first origin: origins never answered there (a stamp its sender only
        // implies) would otherwise hold back the rest of the part for good.
        let mut gossip = node(2);
        let offer = Watermark {
            version: Version(1),
            stamp: Stamp(WALL),
        };
        let part = |ids: std::ops::Range<u64>| Digest {
            origins: ids
                .map(|id| (ReplicaId::new(NodeId(id), Generation(WALL)), offer))
                .collect(),
        };
        let replica = |id| ReplicaId::new(NodeId(id), Generation(0));
        let first = Cover::Part {
            from: replica(0),
            until: Some(replica(5_000)),
        };
        let second = Cover::Part {
            from: replica(5_000),
            until: None,
        };
        let mut asked_in_first = BTreeSet::new();
        for round in 0..8 {
            let Message::Ack { digest, .. } =
                ack_to_part(&mut gossip, part(10..5_000), first, round)
            else {
                panic!("not an Ack");
            };
            asked_in_first.extend(digest.origins.into_keys());
            ack_to_part(&mut gossip, part(5_000..10_000), second, round);
        }
        let most = gossip.config.frame_bytes_max / 2 / wire::DIGEST_ENTRY_BYTES_MAX;
        assert!(
            asked_in_first.len() > 2 * most,
            "{} origins of the first part asked for",
            asked_in_first.len()
        );
    }

    #[test]
    fn a_syn_leaves_out_origins_held_without_lanes_and_heard_within_two_rounds() {
        let mut config = Config::new(node(1).replica(), "n1");
        config.gossip_interval = Duration::from_millis(100);
        config.seeds = vec![crate::Seed {
            node: NodeId(2),
            addr: "n2".into(),
        }];
        let mut gossip = Gossip::new(config);
        gossip.handle_input(Input::Timeout { now: now(0) });
        let heartbeat = |origin: u64, stamp: u64| {
            push_of(
                node(origin).replica(),
                Version::ZERO,
                Stamp(WALL + stamp),
                Vec::new(),
            )
        };
        // Node 3 pushed a lane long ago, node 4 was heard 50 ms before the round, node 5
        // 250 ms before it.
        gossip.handle_input(Input::Receive {
            now: now(1),
            from: NodeId(3),
            frame: push_frame(node(3).replica()),
        });
        for (origin, stamp) in [(4, 950), (5, 750)] {
            gossip.handle_input(Input::Receive {
                now: now(stamp),
                from: NodeId(origin),
                frame: heartbeat(origin, stamp),
            });
        }
        while !matches!(gossip.poll_output(), Output::Timeout(_)) {}
        gossip.handle_input(Input::Timeout { now: now(1_000) });
        let syn = loop {
            match gossip.poll_output() {
                Output::Send { frame, .. } => {
                    let message = wire::decode(&frame, 1 << 20).unwrap().message;
                    if let Message::Syn {
                        digest, unlisted, ..
                    } = message
                    {
                        break (digest, unlisted);
                    }
                }
                Output::Timeout(_) => panic!("no syn"),
                Output::Event(_) => {}
            }
        };
        let listed: Vec<u64> = syn.0.origins.keys().map(|r| r.node.0).collect();
        assert_eq!(listed, [1, 3, 5], "itself, lanes, a stamp two rounds old");
        assert_eq!(syn.1, Stamp(WALL + 800));
    }

    #[test]
    fn garbage_truncated_and_oversized_frames_are_dropped_and_counted() {
        let mut gossip = node(1);
        let good = push_frame(node(2).replica());
        let frames = [
            vec![0xFF; 64],
            good[..good.len() / 2].to_vec(),
            vec![wire::WIRE_VERSION; 128 * 1024],
        ];
        for frame in frames {
            receive_from_node_2(&mut gossip, frame);
        }
        assert_eq!(gossip.stats().decode_errors, 3);
        assert!(gossip.map().is_empty());
    }

    #[test]
    fn a_frame_claiming_another_sender_is_dropped_and_counted() {
        let mut gossip = node(1);
        let frame = push_frame(node(3).replica());
        receive_from_node_2(&mut gossip, frame);
        assert_eq!(gossip.stats().forged, 1);
        assert!(gossip.map().is_empty());
    }

    #[test]
    fn a_push_of_own_lanes_is_merged_and_reported() {
        let mut gossip = node(1);
        let frame = push_frame(node(2).replica());
        receive_from_node_2(&mut gossip, frame);
        assert_eq!(gossip.map().lanes(), 1);
        assert!(
            matches!(gossip.poll_output(), Output::Event(Event::Changed { keys }) if keys.len() == 1)
        );
    }

    #[test]
    fn a_leaving_node_tells_its_peers_then_goes_quiet() {
        let mut gossip = node(1);
        let joined = wire::encode(
            node(2).replica(),
            &Message::Members {
                members: vec![MemberEntry {
                    node: NodeId(2),
                    generation: Generation(1),
                    addr: "n2".into(),
                    left: false,
                }],
            },
        );
        receive_from_node_2(&mut gossip, joined);
        while !matches!(gossip.poll_output(), Output::Timeout(_)) {}
        gossip.handle_input(Input::Leave);
        let Output::Send {
            to: NodeId(2),
            frame,
            ..
        } = gossip.poll_output()
        else {
            panic!("no goodbye to node 2");
        };
        let goodbye = MemberEntry {
            left: true,
            ..gossip.members.me()
        };
        assert_eq!(
            wire::decode(&frame, 1 << 20).unwrap().message,
            Message::Members {
                members: vec![goodbye]
            },
            "the goodbye carries the leaving node's own row alone"
        );
        assert_eq!(gossip.poll_output(), Output::Timeout(Duration::MAX));
        gossip.handle_input(Input::Timeout { now: now(5_000) });
        assert_eq!(gossip.poll_output(), Output::Timeout(Duration::MAX));
    }

    /// Drains `from`'s outputs, handing `to` what is sent to it; the rest is dropped.
    /// Returns whether anything was handed over.
    fn deliver(from: &mut Gossip, to: &mut Gossip, at: Now) -> bool {
        let mut delivered = false;
        loop {
            match from.poll_output() {
                Output::Send {
                    to: node, frame, ..
                } if node == to.config.node() => {
                    to.handle_input(Input::Receive {
                        now: at,
                        from: from.config.node(),
                        frame,
                    });
                    delivered = true;
                }
                Output::Timeout(_) => return delivered,
                _ => {}
            }
        }
    }

    /// A `Delta` to `to` relaying node 9's life `generation`: version 1 of a lane of 5 on
    /// `r`/`s` in the window of `window_secs` holding `WALL`, and its row, held as dead.
    fn relayed_as_dead(to: ReplicaId, generation: u64, window_secs: u32) -> Message {
        let lane = tally_crdt::LaneUpdate {
            key: Key::new(
                Rule::new("r").unwrap(),
                Subject::new("s").unwrap(),
                Window::containing(WALL / 1_000, window_secs).unwrap(),
            ),
            lane: Lane::new(5, 0),
            version: Version(1),
        };
        Message::Delta {
            to,
            delta: Delta {
                origins: vec![OriginDelta {
                    origin: ReplicaId::new(NodeId(9), Generation(generation)),
                    through: Watermark {
                        version: Version(1),
                        stamp: Stamp(WALL),
                    },
                    lanes: vec![lane],
                }],
            },
            members: vec![MemberEntry {
                node: NodeId(9),
                generation: Generation(generation),
                addr: "n9".into(),
                left: false,
            }],
            dead: vec![NodeId(9)],
        }
    }

    #[test]
    fn a_member_taken_in_as_dead_is_not_brought_back_by_its_stamp_handed_back() {
        // Node 2 relays origin 9's lane and, in the same message, its row as dead: node 1
        // takes the row in as dead, and the lane's stamp does not bring it back.
        let nine = ReplicaId::new(NodeId(9), Generation(1));
        let mut gossip = node(1);
        let relay = |at_ms: u64, gossip: &mut Gossip| {
            let delta = relayed_as_dead(gossip.replica(), 1, 1);
            gossip.handle_input(Input::Receive {
                now: now(at_ms),
                from: NodeId(2),
                frame: wire::encode(node(2).replica(), &delta),
            });
        };
        relay(0, &mut gossip);
        assert_eq!(gossip.members.state(NodeId(9)), Some(State::Dead));
        assert_eq!(gossip.map().watermark(nine).version, Version(1));
        // The lane's window ends; the map lets the dead origin go, watermark and all.
        gossip.handle_input(Input::Timeout { now: now(10_000) });
        assert_eq!(gossip.map().watermark(nine), Watermark::default());
        // A peer that still holds 9's watermark hands it back: no news of node 9.
        relay(11_000, &mut gossip);
        assert_eq!(gossip.members.state(NodeId(9)), Some(State::Dead));
    }

    #[test]
    fn a_newer_life_relayed_with_its_row_as_dead_is_taken_in_dead_over_an_older_alive_row() {
        let row = |generation: u64| MemberEntry {
            node: NodeId(9),
            generation: Generation(generation),
            addr: "n9".into(),
            left: false,
        };
        let mut gossip = node(1);
        let from_two = |gossip: &mut Gossip, message: &Message| {
            gossip.handle_input(Input::Receive {
                now: now(0),
                from: NodeId(2),
                frame: wire::encode(node(2).replica(), message),
            });
        };
        from_two(
            &mut gossip,
            &Message::Members {
                members: vec![row(1)],
            },
        );
        assert_eq!(gossip.members.state(NodeId(9)), Some(State::Alive));
        // Node 9 restarted as generation 2 and died while node 1 was cut off; node 2 relays
        // the new life's lane with its row, dead.
        let nine = ReplicaId::new(NodeId(9), Generation(2));
        let delta = relayed_as_dead(gossip.replica(), 2, 60);
        from_two(&mut gossip, &delta);
        assert_eq!(gossip.members.replica(NodeId(9)), Some(nine));
        assert_eq!(gossip.members.state(NodeId(9)), Some(State::Dead));
        assert_eq!(
            gossip.map().watermark(nine).version,
            Version(1),
            "its lane is kept"
        );
    }

    #[test]
    fn a_member_taken_in_as_dead_stays_dead_on_its_old_state_relayed_later_until_news_of_it() {
        // Node 2's table says node 9 is dead; 9's lanes come later, in another message (a
        // cut Ack, or another peer's): old state of a dead member, not news of it.
        let nine = ReplicaId::new(NodeId(9), Generation(1));
        let key = Key::new(
            Rule::new("r").unwrap(),
            Subject::new("s").unwrap(),
            Window::containing(WALL / 1_000, 60).unwrap(),
        );
        let mut gossip = node(1);
        let receive = |at_ms: u64, delta: Delta, members: Vec<MemberEntry>, gossip: &mut Gossip| {
            let dead = members.iter().map(|member| member.node).collect();
            let message = Message::Delta {
                to: gossip.replica(),
                delta,
                members,
                dead,
            };
            gossip.handle_input(Input::Receive {
                now: now(at_ms),
                from: NodeId(2),
                frame: wire::encode(node(2).replica(), &message),
            });
        };
        let state_of_nine = |version: u64, stamp: u64| Delta {
            origins: vec![OriginDelta {
                origin: nine,
                through: Watermark {
                    version: Version(version),
                    stamp: Stamp(stamp),
                },
                lanes: vec![tally_crdt::LaneUpdate {
                    key: key.clone(),
                    lane: Lane::new(version, 0),
                    version: Version(version),
                }],
            }],
        };
        let row = MemberEntry {
            node: NodeId(9),
            generation: Generation(1),
            addr: "n9".into(),
            left: false,
        };
        receive(0, Delta::default(), vec![row], &mut gossip);
        assert_eq!(gossip.members.state(NodeId(9)), Some(State::Dead));
        receive(
            100,
            state_of_nine(1, WALL - 60_000),
            Vec::new(),
            &mut gossip,
        );
        assert_eq!(
            gossip.map().watermark(nine).version,
            Version(1),
            "its lanes are taken"
        );
        assert_eq!(gossip.members.state(NodeId(9)), Some(State::Dead));
        // State newer than any held of it is news: node 9 is back.
        receive(200, state_of_nine(2, WALL), Vec::new(), &mut gossip);
        assert_eq!(gossip.members.state(NodeId(9)), Some(State::Alive));
    }

    #[test]
    fn a_dead_member_heard_in_an_ack_that_needs_no_answer_is_reported_alive_at_once() {
        let mut gossip = node(1);
        let two = node(2).replica();
        let receive = |at_ms: u64, message: Message, gossip: &mut Gossip| {
            gossip.handle_input(Input::Receive {
                now: now(at_ms),
                from: NodeId(2),
                frame: wire::encode(two, &message),
            });
        };
        let row = MemberEntry {
            node: NodeId(2),
            generation: two.generation,
            addr: "n2".into(),
            left: false,
        };
        receive(
            0,
            Message::Members {
                members: vec![row.clone()],
            },
            &mut gossip,
        );
        for at_ms in [0, 30_000, 45_000, 60_000] {
            gossip.handle_input(Input::Timeout { now: now(at_ms) });
        }
        assert_eq!(gossip.members.state(NodeId(2)), Some(State::Dead));
        while !matches!(gossip.poll_output(), Output::Timeout(_)) {}
        // Node 2 answers a Syn with nothing to send, and nothing to ask for.
        receive(
            61_000,
            Message::Ack {
                to: gossip.replica(),
                delta: Delta::default(),
                digest: Digest::default(),
                members: Vec::new(),
                dead: Vec::new(),
            },
            &mut gossip,
        );
        assert_eq!(gossip.members.state(NodeId(2)), Some(State::Alive));
        let mut alive = false;
        loop {
            match gossip.poll_output() {
                Output::Timeout(_) => break,
                Output::Event(Event::Member(transition)) => {
                    alive |= transition.node == NodeId(2) && transition.state == State::Alive;
                }
                _ => {}
            }
        }
        assert!(
            alive,
            "the transition is reported with the frame that made it"
        );
    }

    /// Runs `rounds` rounds of `nodes`, each seeded with all the others, handing every
    /// frame to the node it is sent to until none is left.
    fn rounds(nodes: &mut [Gossip], rounds: u64) {
        for round in 0..rounds {
            let at = now(round * 1_000);
            for node in nodes.iter_mut() {
                node.handle_input(Input::Timeout { now: at });
            }
            loop {
                let mut frames = Vec::new();
                for node in nodes.iter_mut() {
                    let from = node.config.node();
                    loop {
                        match node.poll_output() {
                            Output::Send { to, frame, .. } => frames.push((from, to, frame)),
                            Output::Event(_) => {}
                            Output::Timeout(_) => break,
                        }
                    }
                }
                if frames.is_empty() {
                    break;
                }
                for (from, to, frame) in frames {
                    if let Some(node) = nodes.iter_mut().find(|node| node.config.node() == to) {
                        node.handle_input(Input::Receive {
                            now: at,
                            from,
                            frame,
                        });
                    }
                }
            }
        }
    }

    /// Node `id` of generation `generation`, seeded with nodes 1 to 3 but itself, holding
    /// `lanes` of node 1's first life, written from `floor` up.
    fn restart_node(id: u64, generation: u64, floor: u64, lanes: &[(&str, Lane)]) -> Gossip {
        let replica = ReplicaId::new(NodeId(id), Generation(generation));
        let mut config = Config::new(replica, format!("n{id}"));
        config.seeds = (1..=3)
            .filter(|&other| other != id)
            .map(|other| crate::Seed {
                node: NodeId(other),
                addr: format!("n{other}"),
            })
            .collect();
        let first_life = ReplicaId::new(NodeId(1), Generation(1));
        let mut map = CounterMap::new();
        map.raise_version(first_life, Version(floor));
        for (subject, lane) in lanes {
            map.write(first_life, &restart_key(subject), *lane, Stamp(WALL));
        }
        Gossip::with_state(config, map).with_republished([first_life])
    }

    fn restart_key(subject: &str) -> Key {
        Key::new(
            Rule::new("r").unwrap(),
            Subject::new(subject).unwrap(),
            Window::containing(WALL / 1_000, 3_600).unwrap(),
        )
    }

    #[test]
    fn lanes_republished_from_a_log_behind_a_peers_copy_end_at_the_peers_totals_everywhere() {
        // Node 1's first life got `a` to 10 at node 2, but its log kept 6 (restored from a
        // snapshot, say); its second life re-publishes that above every version held.
        // Node 3 has no copy. Without mending, node 2 keeps 10 under the re-published
        // version while nodes 1 and 3 keep 6 under the same version, for good.
        let ten = Lane::new(10, 0);
        let mut nodes = [
            restart_node(
                1,
                2,
                1_000,
                &[("a", Lane::new(6, 0)), ("b", Lane::new(4, 0))],
            ),
            restart_node(2, 1, 0, &[("a", ten), ("b", Lane::new(4, 0))]),
            restart_node(3, 1, 0, &[]),
        ];
        rounds(&mut nodes, 6);
        let first_life = ReplicaId::new(NodeId(1), Generation(1));
        for node in &nodes {
            let id = node.config.node();
            assert_eq!(node.map().lane(&restart_key("a"), first_life), ten, "{id}");
            assert_eq!(
                node.map().lane(&restart_key("b"), first_life),
                Lane::new(4, 0),
                "{id}"
            );
            assert_eq!(node.map().digest(), nodes[0].map().digest(), "{id}");
        }
        assert_eq!(nodes[1].stats().lanes_corrected, 1, "a alone went back");
        assert_eq!(nodes[0].stats().lanes_restamped, 1);
    }

    #[test]
    fn lanes_republished_from_a_whole_log_are_taken_as_they_are_with_no_correction() {
        // The ordinary restart: the log holds every total a peer got (node 2 has `a` at 6
        // of the log's 9, and `b` as the log has it).
        let mut nodes = [
            restart_node(
                1,
                2,
                1_000,
                &[("a", Lane::new(9, 0)), ("b", Lane::new(4, 1))],
            ),
            restart_node(2, 1, 0, &[("a", Lane::new(6, 0)), ("b", Lane::new(4, 1))]),
            restart_node(3, 1, 0, &[]),
        ];
        rounds(&mut nodes, 6);
        let first_life = ReplicaId::new(NodeId(1), Generation(1));
        for node in &nodes {
            let id = node.config.node();
            let lane = |subject| node.map().lane(&restart_key(subject), first_life);
            assert_eq!(lane("a"), Lane::new(9, 0), "{id}");
            assert_eq!(lane("b"), Lane::new(4, 1), "{id}");
            assert_eq!(node.stats().lanes_corrected, 0, "{id}");
            assert_eq!(node.stats().lanes_restamped, 0, "{id}");
        }
    }

    #[test]
    fn a_lane_republished_below_a_peers_copy_and_relayed_to_it_with_the_nodes_row_is_mended() {
        // As above, but node 2 first gets the re-published lane from node 3, in a frame that
        // also carries node 1's row of its second life, which node 2 takes in after the
        // frame's lanes.
        let ten = Lane::new(10, 0);
        let (mut one, mut two, mut three) = (
            restart_node(1, 2, 1_000, &[("a", Lane::new(6, 0))]),
            restart_node(2, 1, 0, &[("a", ten)]),
            restart_node(3, 1, 0, &[]),
        );
        let at = now(0);
        let first_life = ReplicaId::new(NodeId(1), Generation(1));
        three.map.apply(
            &one.map().delta_for(&three.map().digest(), 1 << 16, 0),
            WALL / 1_000,
        );
        three.members.merge(&one.members.entries(), &[]);
        let relay = Message::Delta {
            to: two.replica(),
            delta: three.map().delta_for(&two.map().digest(), 1 << 16, 0),
            members: three.members.entries(),
            dead: Vec::new(),
        };
        two.handle_input(Input::Receive {
            now: at,
            from: NodeId(3),
            frame: wire::encode(three.replica(), &relay),
        });
        assert_eq!(two.stats().lanes_corrected, 1);
        deliver(&mut two, &mut one, at);
        assert_eq!(one.stats().lanes_restamped, 1);
        let mut nodes = [one, two, three];
        rounds(&mut nodes, 6);
        for node in &nodes {
            let id = node.config.node();
            assert_eq!(node.map().lane(&restart_key("a"), first_life), ten, "{id}");
        }
    }

    #[test]
    fn two_nodes_cut_off_from_their_other_seeds_do_not_take_their_table_as_matched() {
        // Nodes 1 and 2 start cut off from node 3: each is the other's seed, and node 3 is
        // both's. They come to hold the same table, of the two of them.
        let seeds = |ids: &[u64]| -> Vec<crate::Seed> {
            (ids.iter())
                .map(|&id| crate::Seed {
                    node: NodeId(id),
                    addr: format!("n{id}"),
                })
                .collect()
        };
        let start = |id: u64, others: &[u64]| {
            let mut config = Config::new(node(id).replica(), format!("n{id}"));
            config.seeds = seeds(others);
            Gossip::new(config)
        };
        let (mut one, mut two) = (start(1, &[2, 3]), start(2, &[1, 3]));
        for round in 0..10 {
            let at = now(round * 1_000);
            one.handle_input(Input::Timeout { now: at });
            two.handle_input(Input::Timeout { now: at });
            while deliver(&mut one, &mut two, at) | deliver(&mut two, &mut one, at) {}
        }
        assert_eq!(one.members.hash(), two.members.hash(), "the same table");
        assert!(!one.table_matched() && !two.table_matched());
        // Node 3's row arrives (node 3 itself is still cut off): the table then holds
        // every seed, and the next exchange matches it.
        let three = node(3).members.entries();
        for gossip in [&mut one, &mut two] {
            gossip.members.merge(&three, &[]);
        }
        let at = now(10_000);
        one.handle_input(Input::Timeout { now: at });
        two.handle_input(Input::Timeout { now: at });
        while deliver(&mut one, &mut two, at) | deliver(&mut two, &mut one, at) {}
        assert!(one.table_matched() || two.table_matched());
    }

    #[test]
    fn a_table_larger_than_a_frame_reaches_a_peer_in_parts_its_dead_taken_as_dead() {
        // Node 8,000's table holds 5,000 node ids that have left over the fleet's life,
        // more than one frame, and 100 it holds as dead; its map, 2,000 lanes. Node 9,000
        // joins through it. Both ids sort after every other row.
        let mut config = Config::new(node(9_000).replica(), "n9000");
        config.seeds = vec![crate::Seed {
            node: NodeId(8_000),
            addr: "n8000".into(),
        }];
        let (mut old, mut new) = (node(8_000), Gossip::new(config));
        let row = |id: u64, left| MemberEntry {
            node: NodeId(id),
            generation: Generation(1),
            addr: format!("10.{}.{}.{}:7000", id / 65_536, id / 256 % 256, id % 256),
            left,
        };
        let gone: Vec<MemberEntry> = (1..5_001).map(|id| row(id, true)).collect();
        old.members.merge(&gone, &[]);
        let silent: Vec<MemberEntry> = (6_000..6_100).map(|id| row(id, false)).collect();
        let dead: Vec<NodeId> = silent.iter().map(|row| row.node).collect();
        old.members.merge(&silent, &dead);
        let whole = Message::Members {
            members: old.members.entries(),
        };
        assert!(wire::encode(old.replica(), &whole).len() > old.config.frame_bytes_max);
        let lanes = (0..2_000)
            .map(|i| {
                let key = Key::new(
                    Rule::new("r").unwrap(),
                    Subject::new(format!("subject-{i}")).unwrap(),
                    Window::containing(WALL / 1_000, 3_600).unwrap(),
                );
                (key, Lane::new(i + 1, 0))
            })
            .collect();
        old.handle_input(Input::LocalLanes { now: now(0), lanes });

        let mut rounds = 0;
        let synced = |old: &Gossip, new: &Gossip| {
            let origin = old.replica();
            new.members.hash() == old.members.hash()
                && new.map().watermark(origin) == old.map().watermark(origin)
        };
        while !synced(&old, &new) && rounds < 100 {
            let at = now(rounds * 1_000);
            old.handle_input(Input::Timeout { now: at });
            new.handle_input(Input::Timeout { now: at });
            while deliver(&mut old, &mut new, at) | deliver(&mut new, &mut old, at) {}
            if rounds == 0 {
                assert_eq!(new.members.state(NodeId(8_000)), Some(State::Alive));
                assert_eq!(old.members.state(NodeId(9_000)), Some(State::Alive));
                assert!(!new.table_matched(), "a part is not the table");
            }
            rounds += 1;
        }
        // The next Syn carries the hash of the same table.
        let at = now(rounds * 1_000);
        old.handle_input(Input::Timeout { now: at });
        while deliver(&mut old, &mut new, at) | deliver(&mut new, &mut old, at) {}
        assert!(new.table_matched());
        let counts = BTreeMap::from([(State::Alive, 2), (State::Dead, 100), (State::Left, 5_000)]);
        assert_eq!(
            new.members.counts(),
            counts,
            "the dead are not taken as alive"
        );
        assert!(
            new.members.entries() == old.members.entries(),
            "the tables are the same after {rounds} rounds"
        );
        assert_eq!(new.map().lanes(), 2_000);
        assert_eq!(old.stats().frames_oversize + new.stats().frames_oversize, 0);
        assert!(rounds > 2, "in parts: {rounds} rounds");
    }

    /// `from` sends `to` a Syn of its state, and the two answer each other until quiet.
    fn syn_exchange(from: &mut Gossip, to: &mut Gossip, at: Now) {
        let syn = Message::Syn {
            digest: from.map().digest(),
            unlisted: Stamp(0),
            members_hash: from.members.hash(),
            covers: Cover::All,
        };
        to.handle_input(Input::Receive {
            now: at,
            from: from.config.node(),
            frame: wire::encode(from.replica(), &syn),
        });
        while deliver(to, from, at) | deliver(from, to, at) {}
    }

    /// Two members at the smallest frame, where a digest holds about 150 origins.
    fn two_small_members() -> (Gossip, Gossip) {
        let small = |id: u64| {
            let mut config = Config::new(node(id).replica(), format!("n{id}"));
            config.frame_bytes_max = Config::FRAME_BYTES_MIN;
            Gossip::new(config)
        };
        let (mut a, mut b) = (small(1), small(2));
        a.members.merge(&[b.members.me()], &[]);
        b.members.merge(&[a.members.me()], &[]);
        (a, b)
    }

    /// The replica of made-up origin `id`.
    fn made_up(id: u64) -> ReplicaId {
        ReplicaId::new(NodeId(id), Generation(WALL - 1_000))
    }

    /// One lane at `version` of each made-up origin of `ids`, through that version, at
    /// `stamp`.
    fn made_up_lanes(ids: impl Iterator<Item = u64>, version: u64, stamp: Stamp) -> Delta {
        Delta {
            origins: ids
                .map(|id| OriginDelta {
                    origin: made_up(id),
                    through: Watermark {
                        version: Version(version),
                        stamp,
                    },
                    lanes: vec![tally_crdt::LaneUpdate {
                        key: Key::new(
                            Rule::new("r").unwrap(),
                            Subject::new("s").unwrap(),
                            Window::containing(WALL / 1_000, 3_600).unwrap(),
                        ),
                        lane: Lane::new(version, 0),
                        version: Version(version),
                    }],
                })
                .collect(),
        }
    }

    /// Rounds of both members until `b` holds every made-up origin of 10..1_010 as `a`
    /// does (at most 60): how many it took.
    fn rounds_until_b_holds_what_a_does(a: &mut Gossip, b: &mut Gossip) -> u64 {
        let behind = |a: &Gossip, b: &Gossip| {
            (10..1_010)
                .filter(|&id| b.map.watermark(made_up(id)) != a.map.watermark(made_up(id)))
                .count()
        };
        let mut rounds = 0;
        while behind(a, b) > 0 && rounds < 60 {
            let at = now(rounds * 1_000);
            a.handle_input(Input::Timeout { now: at });
            b.handle_input(Input::Timeout { now: at });
            while deliver(a, b, at) | deliver(b, a, at) {}
            rounds += 1;
        }
        assert_eq!(behind(a, b), 0, "after {rounds} rounds");
        assert_eq!(a.stats().frames_oversize + b.stats().frames_oversize, 0);
        rounds
    }

    #[test]
    fn a_digest_too_large_for_a_frame_goes_in_parts_and_anti_entropy_still_repairs_every_origin() {
        // Both hold the same 1,000 origins: whole, neither Syn fits. Node 1 then takes
        // newer lanes of every 50th origin, which no push brings node 2.
        let (mut a, mut b) = two_small_members();
        for node in [&mut a, &mut b] {
            node.map
                .apply(&made_up_lanes(10..1_010, 1, Stamp(WALL)), WALL / 1_000);
        }
        a.map.apply(
            &made_up_lanes((10..1_010).step_by(50), 2, Stamp(WALL)),
            WALL / 1_000,
        );
        let syn = a.syn_in_parts(a.map.digest(), Stamp(0));
        assert!(matches!(
            syn,
            Message::Syn {
                covers: Cover::Part { .. },
                ..
            }
        ));
        a.syn_from = FIRST_ORIGIN;
        let rounds = rounds_until_b_holds_what_a_does(&mut a, &mut b);
        assert!(rounds > 2, "in parts: {rounds} rounds");
    }

    #[test]
    fn a_peer_lacking_the_stamps_a_starting_nodes_syn_implies_asks_for_them_a_part_at_a_time() {
        // Node 2 holds nothing, so its Syn is small and whole, and implies it holds each
        // origin it does not list at a stamp of two rounds ago. Node 1's stamps of its
        // 1,000 origins are older (retired lives', say): it lacks each, and its Ack asks
        // for as many as half a frame holds (all of them would not fit), a part a round.
        let (mut a, mut b) = two_small_members();
        a.map.apply(
            &made_up_lanes(10..1_010, 1, Stamp(WALL - 10_000)),
            WALL / 1_000,
        );
        let rounds = rounds_until_b_holds_what_a_does(&mut a, &mut b);
        assert!(rounds > 1, "{rounds} rounds");
    }

    #[test]
    fn live_rows_that_fill_parts_hold_back_no_other_row_for_good() {
        // 2,000 live rows with long addresses, several parts' worth, and 500 that left.
        let (mut old, mut new) = (node(8_000), node(9_000));
        let row = |id: u64, left| MemberEntry {
            node: NodeId(id),
            generation: Generation(1),
            addr: format!("edge-{id:05}.eu-west-3.internal.example.com:7000"),
            left,
        };
        let live: Vec<MemberEntry> = (1..2_001).map(|id| row(id, false)).collect();
        let gone: Vec<MemberEntry> = (3_000..3_500).map(|id| row(id, true)).collect();
        old.members.merge(&live, &[]);
        old.members.merge(&gone, &[]);
        new.members.merge(&[old.members.me()], &[]);

        let mut exchanges = 0;
        while new.members.hash() != old.members.hash() && exchanges < 50 {
            syn_exchange(&mut new, &mut old, now(exchanges));
            exchanges += 1;
        }
        let counts = BTreeMap::from([(State::Alive, 2_002), (State::Left, 500)]);
        assert_eq!(new.members.counts(), counts, "after {exchanges} exchanges");
        assert!(exchanges > 2, "in parts: {exchanges} exchanges");
        assert_eq!(old.stats().frames_oversize + new.stats().frames_oversize, 0);
    }

    #[test]
    fn a_node_with_no_live_peer_knocks_on_its_seeds_while_it_probes_the_dead() {
        let mut config = Config::new(node(1).replica(), "n1");
        config.seeds = [2, 3, 3, 1]
            .map(|n| crate::Seed {
                node: NodeId(n),
                addr: format!("n{n}"),
            })
            .to_vec();
        let mut gossip = Gossip::new(config);
        let dead = MemberEntry {
            left: false,
            ..node(4).members.me()
        };
        gossip.members.merge(&[dead], &[NodeId(4)]);
        gossip.handle_input(Input::Timeout { now: now(0) });
        let mut syns = Vec::new();
        loop {
            match gossip.poll_output() {
                Output::Send { to, frame, .. } => {
                    let message = wire::decode(&frame, 1 << 20).unwrap().message;
                    if matches!(message, Message::Syn { .. }) {
                        syns.push(to.0);
                    }
                }
                Output::Timeout(_) => break,
                Output::Event(_) => {}
            }
        }
        syns.sort_unstable();
        assert_eq!(
            syns,
            [2, 3, 4],
            "each seed once, not itself, and the dead probe"
        );
    }

    #[test]
    fn a_node_with_live_peers_knocks_on_a_seed_it_holds_no_row_for_ever_less_often() {
        let mut config = Config::new(node(1).replica(), "n1");
        config.seeds = [2, 3]
            .map(|n| crate::Seed {
                node: NodeId(n),
                addr: format!("n{n}"),
            })
            .to_vec();
        let every = config.gossip_interval;
        let mut gossip = Gossip::new(config);
        gossip.members.merge(&[node(2).members.me()], &[]);
        let at = |round: u32| every * round;
        let knocked: Vec<u32> = (0..100)
            .filter(|&round| !gossip.seeds_to_knock(false, at(round)).is_empty())
            .collect();
        // Waits of 1, 2, 4, 8 and 16 rounds, then at most SEED_KNOCK_EVERY_MAX (30 rounds).
        assert_eq!(knocked, [0, 1, 3, 7, 15, 31, 61, 91]);
        assert_eq!(gossip.seeds_to_knock(false, at(91)), [] as [NodeId; 0]);
        assert_eq!(
            gossip.seeds_to_knock(true, at(92)),
            [NodeId(2), NodeId(3)],
            "with no live peer, every seed each round"
        );
        assert_eq!(
            gossip.seeds_to_knock(false, at(93)),
            [NodeId(3)],
            "live peers again: the waits start over"
        );
        assert_eq!(gossip.seeds_to_knock(false, at(94)), [NodeId(3)]);
        gossip.members.merge(&[node(3).members.me()], &[]);
        assert_eq!(gossip.seeds_to_knock(false, at(200)), [] as [NodeId; 0]);
        assert!(
            gossip.seed_knocks.is_empty(),
            "a seed with a row is forgotten"
        );
    }

    #[test]
    fn a_life_forgotten_while_it_runs_hears_so_from_the_first_table_a_peer_answers_with() {
        // Node 1's table also holds 5,000 lives that left, more than a frame's part, which
        // sort before node 20,000: its row would come in a later part of the table.
        let (mut one, mut gone) = (node(1), node(20_000));
        let left: Vec<MemberEntry> = (10_000..15_000)
            .map(|id| MemberEntry {
                left: true,
                ..node(id).members.me()
            })
            .collect();
        one.members.merge(&left, &[]);
        // Node 1 holds node 20,000 dead (a partition, say), and its operator forgets it.
        one.members.merge(&[gone.members.me()], &[NodeId(20_000)]);
        assert_eq!(one.members.state(NodeId(20_000)), Some(State::Dead));
        assert_eq!(one.forget(NodeId(20_000)), Ok(gone.replica()));
        assert!(
            std::iter::from_fn(|| match one.poll_output() {
                Output::Timeout(_) => None,
                output => Some(output),
            })
            .any(|output| matches!(
                output,
                Output::Event(Event::Member(Transition {
                    node: NodeId(20_000),
                    state: State::Left,
                    ..
                }))
            )),
            "the forgetting is reported as the member leaving"
        );
        // Node 20,000 runs on and knows node 1: its round's digest reaches node 1, whose
        // answer carries the first part of the table, with node 20,000's life as gone.
        gone.members.merge(&[one.members.me()], &[]);
        gone.handle_input(Input::Timeout { now: now(0) });
        assert!(deliver(&mut gone, &mut one, now(1)));
        assert!(deliver(&mut one, &mut gone, now(2)));
        let outputs: Vec<Output> = std::iter::from_fn(|| match gone.poll_output() {
            Output::Timeout(_) => None,
            output => Some(output),
        })
        .collect();
        let forgotten = Output::Event(Event::Forgotten { by: NodeId(1) });
        assert!(outputs.contains(&forgotten), "{outputs:?}");
        // Its answer, with its own row, does not bring it back.
        for output in outputs {
            if let Output::Send { to, frame, .. } = output {
                assert_eq!(to, NodeId(1));
                one.handle_input(Input::Receive {
                    now: now(3),
                    from: NodeId(20_000),
                    frame,
                });
            }
        }
        assert_eq!(one.members.state(NodeId(20_000)), Some(State::Left));
    }

    #[test]
    fn a_node_with_live_peers_knocks_on_a_seed_whose_life_left() {
        let mut config = Config::new(node(1).replica(), "n1");
        config.seeds = vec![crate::Seed {
            node: NodeId(3),
            addr: "seed-3".into(),
        }];
        let every = config.gossip_interval;
        let mut gossip = Gossip::new(config);
        gossip.members.merge(&[node(2).members.me()], &[]);
        let left = MemberEntry {
            left: true,
            ..node(3).members.me()
        };
        gossip.members.merge(&[left], &[]);
        assert_eq!(gossip.members.state(NodeId(3)), Some(State::Left));
        // Stopped and started again, with no seeds of its own (the first node of a
        // cluster): only a knock tells it of the others, at its configured address.
        assert_eq!(gossip.seeds_to_knock(false, every), [NodeId(3)]);
        assert_eq!(gossip.addr_of(NodeId(3)), "seed-3");
        // Its new life answers: a row of it, and no more knocks.
        let again = Gossip::new(Config::new(
            ReplicaId::new(NodeId(3), Generation(2)),
            "n3".to_owned(),
        ));
        gossip.members.merge(&[again.members.me()], &[]);
        assert_eq!(gossip.members.state(NodeId(3)), Some(State::Alive));
        assert_eq!(gossip.seeds_to_knock(false, every * 100), [] as [NodeId; 0]);
    }

    #[test]
    fn the_same_inputs_give_the_same_outputs() {
        let run = || {
            let mut config = Config::new(ReplicaId::new(NodeId(1), Generation(1)), "n1");
            config.seeds = (2..6)
                .map(|n| crate::Seed {
                    node: NodeId(n),
                    addr: format!("n{n}"),
                })
                .collect();
            let mut gossip = Gossip::new(config);
            let mut outputs = Vec::new();
            for ms in [0, 1_000, 2_000] {
                gossip.handle_input(Input::Timeout { now: now(ms) });
                loop {
                    let output = gossip.poll_output();
                    let done = matches!(output, Output::Timeout(_));
                    outputs.push(output);
                    if done {
                        break;
                    }
                }
            }
            outputs
        };
        let first = run();
        assert!(first.iter().any(|o| matches!(o, Output::Send { .. })));
        assert_eq!(first, run());
    }
}
