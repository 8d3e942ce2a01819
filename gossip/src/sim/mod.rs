//! A seeded simulator: N gossip nodes on a virtual network with faults, and checkers that
//! run after every step.
//!
//! Everything is driven from one seed: message delays, losses, duplicates, replays and
//! each node's peer choices. A failing run reports its seed; [`replay_hint`] prints the
//! command that reruns exactly that run.
//!
//! Checkers:
//! - MONO, after every step: no node's view of any lane goes back (expired windows aside).
//! - FINAL, on demand after heal and quiet: every node holds exactly the ground truth:
//!   for every key and replica, the lane its writer wrote; for a replica that crashed
//!   without its state, what the other nodes held of it at the crash.
//! - Staleness, when a bound is set (fault-free runs): every live origin's newest state
//!   is younger than the bound at every node, after warm-up.

mod network;

pub use network::Faults;

use crate::membership::State;
use crate::{Config, Event, Gossip, Input, MessageBytes, Now, Output, Seed};
use network::Network;
use std::collections::BTreeMap;
use std::time::Duration;
use tally_crdt::{
    Counter, CounterMap, Generation, Key, Lane, NodeId, ReplicaId, Rule, Stamp, Subject, Version,
    Window,
};

/// The wall clock at simulated time zero (2026-01-01T00:00:00Z), in milliseconds.
pub const WALL_START_MS: u64 = 1_767_225_600_000;

/// How long before simulated time zero the nodes started, at most: each node's first
/// generation is the wall clock at a start drawn from the run's seed within this span, as
/// `tallyd` takes its generation from the wall clock (in milliseconds) at start.
pub const STARTS_SPREAD_MS: u64 = 7 * 24 * 3_600 * 1_000;

/// How to build a simulated cluster.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// How many nodes.
    pub nodes: usize,
    /// The run's seed: network faults and every node's RNG derive from it.
    pub seed: u64,
    /// Network faults.
    pub faults: Faults,
    /// Gossip settings shared by every node (replica, addr, seeds and rng seed are set
    /// per node).
    pub gossip_interval: Duration,
    /// See [`Config::push_interval`].
    pub push_interval: Duration,
    /// See [`Config::fanout`].
    pub fanout: usize,
    /// See [`Config::eager_push`].
    pub eager_push: bool,
    /// See [`Config::frame_bytes_max`].
    pub frame_bytes_max: usize,
    /// See [`Config::dead_after`].
    pub dead_after: Duration,
    /// Window length of the keys the workload writes, in seconds.
    pub window_secs: u32,
    /// If set, the staleness checker runs with this bound.
    pub staleness_bound: Option<Duration>,
    /// Whether MONO and the staleness checker run after every step. Off only for
    /// measurement runs at large N, where a full snapshot per step costs more than the run.
    pub check_every_step: bool,
    /// Negative control: a node restarted without its state reuses its old generation
    /// (the bug a new generation prevents). The FINAL checker must catch it.
    pub reuse_generation_on_state_loss: bool,
}

impl SimConfig {
    /// A fault-free cluster of `nodes` with 100 ms rounds, 5 ms pushes, fanout 3.
    pub fn new(nodes: usize, seed: u64) -> SimConfig {
        SimConfig {
            nodes,
            seed,
            faults: Faults::none(),
            gossip_interval: Duration::from_millis(100),
            push_interval: Duration::from_millis(5),
            fanout: 3,
            eager_push: true,
            frame_bytes_max: 64 * 1024,
            dead_after: Duration::from_secs(2),
            window_secs: 3_600,
            staleness_bound: None,
            check_every_step: true,
            reuse_generation_on_state_loss: false,
        }
    }
}

/// One simulated node.
struct SimNode {
    // `None` while crashed.
    gossip: Option<Gossip>,
    // A crashed node's durable snapshot, if it crashed with its state.
    saved: Option<CounterMap>,
    paused: bool,
    skew_ms: i64,
    // The wall clock in milliseconds at the start of this life, as `tallyd` takes it.
    generation: u64,
    // The node's own lane totals, as its lane store would hold them.
    own: BTreeMap<Key, Lane>,
    wake_at: Duration,
    // MONO: the lanes this node held after its last step, and the map's change count then.
    seen: BTreeMap<(Key, ReplicaId), Lane>,
    seen_changes: Option<u64>,
}

/// The simulated cluster.
pub struct Sim {
    config: SimConfig,
    network: Network,
    nodes: Vec<SimNode>,
    time: Duration,
    // Ground truth: every lane as its writer wrote it (or as it survived a state loss).
    truth: BTreeMap<(Key, ReplicaId), Lane>,
    violations: Vec<String>,
    steps: u64,
}

impl Sim {
    /// A cluster of `config.nodes` nodes; node 0 and 1 are everyone's seeds.
    pub fn new(config: SimConfig) -> Sim {
        let nodes = (0..config.nodes)
            .map(|index| SimNode {
                gossip: None,
                saved: None,
                paused: false,
                skew_ms: 0,
                generation: first_generation(config.seed, index),
                own: BTreeMap::new(),
                wake_at: Duration::ZERO,
                seen: BTreeMap::new(),
                seen_changes: None,
            })
            .collect();
        let mut sim = Sim {
            network: Network::new(config.seed, config.faults.clone(), config.nodes),
            config,
            nodes,
            time: Duration::ZERO,
            truth: BTreeMap::new(),
            violations: Vec::new(),
            steps: 0,
        };
        for index in 0..sim.nodes.len() {
            sim.boot(index, None);
        }
        sim
    }

    /// The simulated monotonic time.
    pub fn time(&self) -> Duration {
        self.time
    }

    /// The node's replica id in its current life.
    pub fn replica(&self, index: usize) -> ReplicaId {
        ReplicaId::new(
            NodeId(index as u64),
            Generation(self.nodes[index].generation),
        )
    }

    /// The node's gossip state, if it is running.
    pub fn gossip(&self, index: usize) -> Option<&Gossip> {
        self.nodes[index].gossip.as_ref()
    }

    /// The network, to cut and restore links or change faults.
    pub fn network(&mut self) -> &mut Network {
        &mut self.network
    }

    /// The wall clock as node `index` reads it.
    pub fn wall(&self, index: usize) -> Stamp {
        let base = WALL_START_MS + self.time.as_millis() as u64;
        Stamp(base.saturating_add_signed(self.nodes[index].skew_ms))
    }

    /// Sets node `index`'s clock offset.
    pub fn set_skew(&mut self, index: usize, skew_ms: i64) {
        self.nodes[index].skew_ms = skew_ms;
    }

    /// The key the workload uses for `subject`, in the window node `index`'s clock is in.
    pub fn key(&self, index: usize, subject: &str) -> Key {
        let window = Window::containing(self.wall(index).0 / 1_000, self.config.window_secs)
            .expect("invariant: SimConfig::window_secs is a valid window length");
        Key::new(
            Rule::new("sim").expect("invariant: a valid rule name"),
            Subject::new(subject).expect("invariant: workload subjects are short"),
            window,
        )
    }

    /// Node `index` counts `amount` for `subject`. Returns false (and counts nothing) if
    /// the node is crashed or paused.
    pub fn incr(&mut self, index: usize, subject: &str, amount: u64) -> bool {
        if self.nodes[index].gossip.is_none() || self.nodes[index].paused {
            return false;
        }
        let key = self.key(index, subject);
        let replica = self.replica(index);
        let node = &mut self.nodes[index];
        let lane = node.own.entry(key.clone()).or_default();
        lane.incr(amount)
            .expect("invariant: workload amounts never overflow a lane");
        let lane = *lane;
        // The truth adds what was counted; it never takes a maximum, so a lane that was
        // reused after a state loss shows up as counts missing from FINAL.
        let truth = self.truth.entry((key.clone(), replica)).or_default();
        truth
            .incr(amount)
            .expect("invariant: workload amounts never overflow a lane");
        let now = self.now(index);
        self.input(
            index,
            Input::LocalLanes {
                now,
                lanes: vec![(key, lane)],
            },
        );
        true
    }

    /// Node `index`'s writes made from `since` (the simulator's time) on have not reached
    /// its gossip yet, or none (`None`): [`Gossip::hold_stamps_from`]. Nothing if the node
    /// is crashed.
    pub fn hold_stamps_from(&mut self, index: usize, since: Option<Duration>) {
        if let Some(gossip) = &mut self.nodes[index].gossip {
            gossip.hold_stamps_from(since);
        }
    }

    /// Crashes node `index`. With `keep_state` its counters survive as a snapshot taken
    /// at the crash; without, they are gone and it restarts as a new generation.
    pub fn crash(&mut self, index: usize, keep_state: bool) {
        let Some(gossip) = self.nodes[index].gossip.take() else {
            return;
        };
        self.network.drop_from(index);
        if keep_state {
            self.nodes[index].saved = Some(gossip.map().clone());
            return;
        }
        drop(gossip);
        self.truth_of_gone_writers();
        self.nodes[index].own.clear();
        self.nodes[index].seen.clear();
        self.nodes[index].seen_changes = None;
    }

    /// Takes as the truth of each lane whose writer is gone (a life that lost its state,
    /// or an earlier life of a node) what the nodes hold of it now, running or in a
    /// snapshot: that is all that survives of it.
    fn truth_of_gone_writers(&mut self) {
        let writers: Vec<ReplicaId> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].gossip.is_some() || self.nodes[i].saved.is_some())
            .map(|i| self.replica(i))
            .collect();
        let holders: Vec<&CounterMap> = (self.nodes.iter())
            .filter_map(|node| {
                node.gossip
                    .as_ref()
                    .map(Gossip::map)
                    .or(node.saved.as_ref())
            })
            .collect();
        for ((key, replica), lane) in self.truth.iter_mut() {
            if writers.contains(replica) {
                continue;
            }
            let mut survived = Lane::default();
            for map in &holders {
                survived.merge(map.lane(key, *replica));
            }
            *lane = survived;
        }
    }

    /// Restarts a crashed node: from its snapshot in the same generation if it kept its
    /// state, otherwise empty in a new generation.
    pub fn restart(&mut self, index: usize) {
        if self.nodes[index].gossip.is_some() {
            return;
        }
        let saved = self.nodes[index].saved.take();
        if saved.is_none() && !self.config.reuse_generation_on_state_loss {
            // The wall clock now, as `tallyd` takes it; a later one than the last life's
            // even if two restarts fall in one millisecond or the clock went back.
            let wall = self.wall(index).0;
            let node = &mut self.nodes[index];
            node.generation = wall.max(node.generation + 1);
        }
        self.boot(index, saved);
    }

    /// Restarts a crashed node as `tallyd` starts on its data dir: in a new generation,
    /// holding only its earlier lives' own lanes of the snapshot its crash kept (what its
    /// lane logs hold), re-published above every version a peer may hold of them
    /// (`lanelog::Recovered::republish_floor`: the new generation in microseconds). A node
    /// whose crash kept nothing restarts as [`Sim::restart`] restarts it.
    pub fn restart_as_tallyd(&mut self, index: usize) {
        if self.nodes[index].gossip.is_some() {
            return;
        }
        let Some(saved) = self.nodes[index].saved.take() else {
            self.restart(index);
            return;
        };
        let wall = self.wall(index);
        let node = &mut self.nodes[index];
        node.generation = wall.0.max(node.generation + 1);
        // It holds no other node's lanes until it learns them again: MONO starts over for
        // it as an observer, as for a node that lost its state.
        node.seen.clear();
        node.seen_changes = None;
        let replica = self.replica(index);
        let floor = Version(replica.generation.0.saturating_mul(1_000));
        let mut map = new_map();
        let mut lives = Vec::new();
        for (key, counter) in saved.iter() {
            let key = key.to_key();
            for slot in counter.slots() {
                if slot.replica.node != replica.node {
                    continue;
                }
                if !lives.contains(&slot.replica) {
                    lives.push(slot.replica);
                    map.raise_version(slot.replica, floor);
                }
                map.write(slot.replica, &key, slot.lane, wall);
            }
        }
        self.boot(index, Some(map));
        let node = &mut self.nodes[index];
        node.gossip = (node.gossip.take()).map(|gossip| gossip.with_republished(lives));
        // Its snapshot's copies of other nodes' lanes are gone, as a lane log holds only
        // its own: a copy of a gone writer's lane that only it held is lost.
        self.truth_of_gone_writers();
    }

    /// Stops delivering to node `index` and stops its timers, as `kill -STOP` would.
    pub fn pause(&mut self, index: usize) {
        self.nodes[index].paused = true;
    }

    /// Resumes a paused node; frames that arrived meanwhile are delivered now.
    pub fn resume(&mut self, index: usize) {
        self.nodes[index].paused = false;
    }

    /// Removes every fault: links restored, loss and duplication off, paused nodes
    /// resumed, crashed nodes restarted.
    pub fn heal(&mut self) {
        self.network.heal();
        for index in 0..self.nodes.len() {
            self.resume(index);
            self.restart(index);
        }
    }

    /// Runs the cluster for `span` of simulated time.
    pub fn run_for(&mut self, span: Duration) {
        let end = self.time + span;
        loop {
            let next_wake = self
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| n.gossip.is_some() && !n.paused)
                .map(|(i, n)| (n.wake_at, i))
                .min();
            let next_frame = self.network.next_due(|to| !self.nodes[to].paused);
            let step_at = match (next_wake, next_frame) {
                (Some((w, _)), Some(f)) => w.min(f),
                (Some((w, _)), None) => w,
                (None, Some(f)) => f,
                // Every node is down or paused and nothing is in flight: time just passes.
                (None, None) => {
                    self.time = end;
                    return;
                }
            };
            if step_at > end {
                self.time = end;
                return;
            }
            self.time = self.time.max(step_at);
            if next_frame.is_some_and(|f| f <= step_at) {
                if let Some(frame) = self.network.pop_due(self.time, |to| !self.nodes[to].paused) {
                    if self.nodes[frame.to].gossip.is_some() {
                        let now = self.now(frame.to);
                        let from = NodeId(frame.from as u64);
                        self.input(
                            frame.to,
                            Input::Receive {
                                now,
                                from,
                                frame: frame.bytes,
                            },
                        );
                    }
                }
            } else if let Some((_, index)) = next_wake {
                let now = self.now(index);
                self.input(index, Input::Timeout { now });
            }
        }
    }

    /// Runs until every running node holds the same counters (checked every round), or
    /// `limit` passes. Returns the simulated time it took, or `None` if it never did.
    pub fn run_until_converged(&mut self, limit: Duration) -> Option<Duration> {
        let start = self.time;
        while self.time - start <= limit {
            if self.converged() {
                return Some(self.time - start);
            }
            self.run_for(self.config.gossip_interval / 4);
        }
        None
    }

    /// Whether every running node holds the same lanes, for keys whose window is still
    /// live on every running node's clock (a skewed clock expires windows early).
    pub fn converged(&self) -> bool {
        let now_secs = self.latest_clock_secs();
        let live = |map: &CounterMap| {
            let mut lanes = lanes_of(map);
            lanes.retain(|(key, _), _| key.window.is_live(now_secs));
            lanes
        };
        let mut maps = self
            .nodes
            .iter()
            .filter_map(|n| n.gossip.as_ref())
            .map(Gossip::map);
        let Some(first) = maps.next() else {
            return true;
        };
        let first = live(first);
        maps.all(|map| live(map) == first)
    }

    /// Whether every running node sees every other node alive.
    pub fn joined(&self) -> bool {
        let nodes = self.nodes.len();
        self.nodes
            .iter()
            .filter_map(|n| n.gossip.as_ref())
            .all(|g| g.members().others_in(&[State::Alive]).len() == nodes - 1)
    }

    /// The first lane on which two running nodes differ, described, if any.
    pub fn divergence(&self) -> Option<String> {
        let now_secs = self.latest_clock_secs();
        let running: Vec<(usize, &Gossip)> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.gossip.as_ref().map(|g| (i, g)))
            .collect();
        let (first, reference) = running.first()?;
        let (reference_map, reference_members) = (reference.map(), reference.members());
        let reference = lanes_of(reference.map());
        for (index, gossip) in &running[1..] {
            let lanes = lanes_of(gossip.map());
            for key in reference.keys().chain(lanes.keys()) {
                if !key.0.window.is_live(now_secs) {
                    continue;
                }
                let (a, b) = (reference.get(key), lanes.get(key));
                if a != b {
                    let (wa, wb) = (
                        reference_map.watermark(key.1),
                        gossip.map().watermark(key.1),
                    );
                    return Some(format!(
                        "{} lane {}: node {first} holds {a:?} at {wa:?}, node {index} holds {b:?} at {wb:?}; members at {first}: {:?}, at {index}: {:?}",
                        key.0, key.1, reference_members.counts(), gossip.members().counts()
                    ));
                }
            }
        }
        None
    }

    /// The run's seed.
    pub fn seed(&self) -> u64 {
        self.config.seed
    }

    /// The most advanced wall clock of any running node, in unix seconds.
    fn latest_clock_secs(&self) -> u64 {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].gossip.is_some())
            .map(|i| self.wall(i).0 / 1_000)
            .max()
            .unwrap_or(WALL_START_MS / 1_000)
    }

    /// FINAL: every running node holds exactly the ground truth, for every key still live
    /// on its own clock (a node whose clock is behind still holds windows that a node
    /// ahead has let go). Records a violation per difference.
    pub fn check_final(&mut self) {
        let mut found = Vec::new();
        for (index, node) in self.nodes.iter().enumerate() {
            let Some(gossip) = &node.gossip else {
                continue;
            };
            let now_secs = self.wall(index).0 / 1_000;
            let mut expected: BTreeMap<&Key, i128> = BTreeMap::new();
            for ((key, replica), lane) in &self.truth {
                if !key.window.is_live(now_secs) {
                    continue;
                }
                *expected.entry(key).or_default() += lane.value();
                let held = gossip.map().lane(key, *replica);
                if held != *lane {
                    found.push(format!(
                        "FINAL: node {index} holds {held:?} for {key} lane {replica}, truth is {lane:?}"
                    ));
                }
            }
            for (key, value) in expected {
                let held = gossip.map().value(key);
                if held != value {
                    found.push(format!(
                        "FINAL: node {index} reads {held} for {key}, truth is {value}"
                    ));
                }
            }
        }
        self.violations.extend(found);
    }

    /// Every violation found so far.
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// Panics with the violations, the seed and the replay command, if any were found.
    pub fn assert_clean(&self, test: &str) {
        if self.violations.is_empty() {
            return;
        }
        let shown: Vec<&str> = self
            .violations
            .iter()
            .take(10)
            .map(String::as_str)
            .collect();
        panic!(
            "{} violations in seed {} after {} steps; first ones:\n{}\nreplay: {}",
            self.violations.len(),
            self.config.seed,
            self.steps,
            shown.join("\n"),
            replay_hint(test, self.config.seed)
        );
    }

    /// Lanes per key, at most, over every running node.
    pub fn lanes_per_key_max(&self) -> usize {
        self.nodes
            .iter()
            .filter_map(|n| n.gossip.as_ref())
            .flat_map(|g| g.map().iter().map(|(_, c)| c.lanes()))
            .max()
            .unwrap_or(0)
    }

    /// Origins held, at most, over every running node.
    pub fn origins_max(&self) -> usize {
        self.nodes
            .iter()
            .filter_map(|n| n.gossip.as_ref())
            .map(|g| g.map().digest().origins.len())
            .max()
            .unwrap_or(0)
    }

    /// How many steps (inputs) the run has taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Bytes sent over the network so far (before loss).
    pub fn bytes_sent(&self) -> u64 {
        self.network.bytes_sent()
    }

    /// Bytes the running nodes have sent, by kind of message (a crashed node's are gone).
    pub fn bytes_sent_by_message(&self) -> MessageBytes {
        let mut total = MessageBytes::default();
        for gossip in self.nodes.iter().filter_map(|n| n.gossip.as_ref()) {
            total += gossip.stats().bytes_out_by_message;
        }
        total
    }

    fn boot(&mut self, index: usize, saved: Option<CounterMap>) {
        let replica = self.replica(index);
        let mut config = Config::new(replica, format!("sim:{index}"));
        config.seeds = (0..self.nodes.len().min(2))
            .filter(|&seed| seed != index)
            .map(|seed| Seed {
                node: NodeId(seed as u64),
                addr: format!("sim:{seed}"),
            })
            .collect();
        config.gossip_interval = self.config.gossip_interval;
        config.push_interval = self.config.push_interval;
        config.fanout = self.config.fanout;
        config.eager_push = self.config.eager_push;
        config.frame_bytes_max = self.config.frame_bytes_max;
        config.dead_after = self.config.dead_after;
        config.rng_seed = self.config.seed
            ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ replica.generation.0;
        let node = &mut self.nodes[index];
        node.own = match &saved {
            Some(map) => map
                .iter()
                .map(|(key, counter)| (key.to_key(), counter.lane(replica)))
                .filter(|(_, lane)| *lane != Lane::default())
                .collect(),
            None => BTreeMap::new(),
        };
        node.gossip = Some(Gossip::with_state(config, saved.unwrap_or_else(new_map)));
        node.wake_at = self.time;
    }

    fn now(&self, index: usize) -> Now {
        Now {
            mono: self.time,
            wall: self.wall(index),
        }
    }

    /// Feeds one input to node `index`, routes its outputs, and runs the checkers.
    fn input(&mut self, index: usize, input: Input) {
        self.steps += 1;
        let Some(gossip) = self.nodes[index].gossip.as_mut() else {
            return;
        };
        gossip.handle_input(input);
        loop {
            match gossip.poll_output() {
                Output::Send { to, frame, .. } => {
                    self.network.send(index, to.0 as usize, frame, self.time);
                }
                // A live node reports this only when its replica id was used by a life
                // that lost its state; a real node stops on it.
                Output::Event(Event::GenerationReused { seen, written }) => {
                    self.violations.push(format!(
                        "GENERATION: node {index} found a lane of its own it never wrote \
                         ({seen:?}, wrote through {written:?}) at {:?}",
                        self.time
                    ));
                }
                Output::Event(_) => {}
                Output::Timeout(at) => {
                    self.nodes[index].wake_at = at.max(self.time + Duration::from_micros(1));
                    break;
                }
            }
        }
        if self.config.check_every_step {
            self.check_mono(index);
            self.check_staleness(index);
        }
    }

    fn check_mono(&mut self, index: usize) {
        let now_secs = self.wall(index).0 / 1_000;
        let node = &mut self.nodes[index];
        let Some(gossip) = &node.gossip else {
            return;
        };
        if node.seen_changes == Some(gossip.map().changes()) {
            return;
        }
        for (key, replica) in node.seen.keys() {
            if !key.window.is_live(now_secs) {
                continue;
            }
            let before = node.seen[&(key.clone(), *replica)];
            let after = gossip.map().lane(key, *replica);
            if !after.covers(before) {
                self.violations.push(format!(
                    "MONO: node {index} lane {key} {replica} went from {before:?} to {after:?} at {:?}",
                    self.time
                ));
            }
        }
        node.seen = lanes_of(gossip.map());
        node.seen_changes = Some(gossip.map().changes());
    }

    fn check_staleness(&mut self, index: usize) {
        let Some(bound) = self.config.staleness_bound else {
            return;
        };
        // Warm-up: joining takes a few rounds.
        if self.time < self.config.gossip_interval * 5 {
            return;
        }
        let wall = self.wall(index);
        let Some(gossip) = &self.nodes[index].gossip else {
            return;
        };
        for (origin, staleness) in gossip.staleness(wall) {
            let alive = gossip.members().state(origin.node) == Some(State::Alive)
                && gossip.members().replica(origin.node) == Some(origin);
            if alive && staleness > bound {
                self.violations.push(format!(
                    "STALENESS: node {index} holds {origin} {staleness:?} old, bound {bound:?}, at {:?}",
                    self.time
                ));
            }
        }
    }
}

/// Node `index`'s first generation: the wall clock at a start within [`STARTS_SPREAD_MS`]
/// before simulated time zero, drawn from the run's seed (splitmix64), so every node's
/// differs and each takes as many bytes on the wire as a node up for days does.
fn first_generation(seed: u64, index: usize) -> u64 {
    let mut z = seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    WALL_START_MS - 1 - z % STARTS_SPREAD_MS
}

/// The command that replays a failing seed of a simulator test.
pub fn replay_hint(test: &str, seed: u64) -> String {
    format!("TALLY_SIM_SEED={seed} cargo test -p tally-gossip --features sim --release --test sim {test}")
}

/// The rate a node's map holds peers' lanes to, and with it the check that a lane's
/// window has begun: `tallyd`'s default `lane_rate_max_per_sec`, which it always sets
/// (before session 45 the simulated maps had none: found in review).
const LANE_RATE_MAX_PER_SEC: u64 = 1_000_000_000;

/// A node's empty map, held to [`LANE_RATE_MAX_PER_SEC`] as `tallyd`'s is.
fn new_map() -> CounterMap {
    CounterMap::new().with_lane_rate_max(LANE_RATE_MAX_PER_SEC)
}

/// The seeds a test runs: `TALLY_SIM_SEED` alone if set, else `count` seeds from `first`,
/// or as many as `TALLY_SIM_SEEDS` says from `TALLY_SIM_FIRST` if set (for a long run by
/// hand: TESTING.md asks 10^4 of some; a test stops at its first failing seed, and the
/// run goes on past it). Each is printed as its run begins, so that a test that panics outside the
/// checkers (in the gossip itself, say) still shows its seed: the test harness prints a
/// failed test's output.
pub fn seeds(first: u64, count: u64) -> impl Iterator<Item = u64> {
    let var = |name| std::env::var(name).ok().and_then(|s| s.parse().ok());
    let seeds = match var("TALLY_SIM_SEED") {
        Some(seed) => seed..seed + 1,
        None => {
            let first = var("TALLY_SIM_FIRST").unwrap_or(first);
            first..first + var("TALLY_SIM_SEEDS").unwrap_or(count)
        }
    };
    seeds.inspect(|seed| eprintln!("seed {seed}"))
}

fn lanes_of(map: &CounterMap) -> BTreeMap<(Key, ReplicaId), Lane> {
    map.iter()
        .flat_map(|(key, counter)| {
            counter
                .slots()
                .map(move |slot| ((key.to_key(), slot.replica), slot.lane))
        })
        .collect()
}
