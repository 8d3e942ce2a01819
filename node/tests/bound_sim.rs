//! TESTING.md K5's BOUND in the seeded simulator: approximate decisions made by the node's
//! own decision code (`decide::Context::check`, on a `LaneStore` and a `ViewState`) on
//! every node of a simulated cluster (`tally_gossip::sim`), with message loss, duplication,
//! delay, replays, partitions, pauses, a node killed with its state lost and started
//! again as a new life, and a node's clock up to half a second behind or five seconds
//! ahead, drawn from each seed (a partition's heal ends every fault but the
//! delay, as `Network::heal` does). Each node checks one subject
//! at a steady rate of its own; over the run, the cluster's admissions beyond the limit
//! (the overshoot) must stay within the largest finite bound reported by an admission that
//! left the cluster past the limit, plus one for each admission whose decision reported an
//! infinite bound (a new
//! life that has not heard every live member yet, or its peers until they hear it; none
//! may in a seed without a restart), as
//! the end-to-end tests and the overshoot bench check it on real processes
//! (`tests/e2e_cluster.rs`, `benches/overshoot.rs`). And each isolated admission must leave
//! the overshoot within the bound that decision reported.
//!
//! What stands in for `tallyd`'s gossip task (`driver.rs`): after every millisecond of
//! simulated time, each running node publishes the remote sum of every counter that
//! changed to its store and takes the counter into its view (`Driver::publish`), and sets
//! its view's members and stamps (`Driver::refresh_view`). An admission is handed to the
//! node's gossip 3 ms after it is made, and goes out in the next push (5 ms after the
//! first lane a push waits for); until then the node's heartbeats are stamped no later
//! than when it was made, as the driver has its gossip stamp them: `tallyd` with a data dir collects its store every half
//! push interval (2.5 ms by default), and without one just before the push that carries
//! the admission, which then reaches peers no later than here. A lane-log sync that
//! holds writes back is not modelled.
//!
//! Rates are steady, and the limit is reached no sooner than three seconds into the run:
//! the connected bound is a rate times a staleness, and a rate that has not been measured
//! yet (a burst) is not in it (ARCHITECTURE.md).
//!
//! A failure prints the seed; `TALLY_SIM_SEED=<seed> cargo test -p tally-node --release
//! --test bound_sim` replays it.

// Built against loom's atomics (the loom step), the lane store works only inside a loom
// model.
#![cfg(not(tally_loom))]
#![allow(
    clippy::unwrap_used,
    reason = "a panic in the simulation is the test's failure report"
)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::time::Duration;
use tally_client::Mode;
use tally_crdt::{Counter, Key, PnCounter, ReplicaId};
use tally_gossip::membership::State;
use tally_gossip::sim::{seeds, Faults, Sim, SimConfig};
use tally_gossip::Now;
use tally_node::config::RuleConfig;
use tally_node::decide::{self, Context, Rules};
use tally_node::store::LaneStore;
use tally_node::view::{unheard_seeds, ViewState};

/// How long each seed's cluster runs, in simulated milliseconds.
const RUN_MS: u64 = 12_000;
/// How long an admission waits in the store before the gossip collects it: `tallyd`
/// collects every half push interval with a data dir, and without one just before the
/// push that carries it, at most a push interval after the admission and sent at once
/// (`daemon::collecting`; the simulator pushes every 5 ms).
const COLLECT_EVERY_MS: u64 = 3;
/// The one subject every node checks.
const SUBJECT: &str = "s";

/// A seed's draw: the cluster, its load and its faults.
#[derive(Debug)]
struct Scenario {
    nodes: usize,
    /// Per node, milliseconds between its checks.
    every_ms: Vec<u64>,
    limit: u64,
    slack: u64,
    stale_after_ms: u64,
    faults: Faults,
    /// Nodes cut off from the others, from and to (ms).
    partition: Option<(Vec<usize>, u64, u64)>,
    /// A node paused, from and to (ms).
    pause: Option<(usize, u64, u64)>,
    /// A node killed with its state lost, and started again as a new life, at (ms).
    crash: Option<(usize, u64, u64)>,
    /// A node whose wall clock is off by this many milliseconds from the start.
    skew: Option<(usize, i64)>,
}

impl Scenario {
    fn draw(seed: u64) -> Scenario {
        let mut draw = ChaCha8Rng::seed_from_u64(seed);
        let nodes: usize = draw.gen_range(3..=6);
        let every_ms: Vec<u64> = (0..nodes).map(|_| draw.gen_range(2..=20)).collect();
        let per_sec: u64 = every_ms.iter().map(|ms| 1_000 / ms).sum();
        // Reached 3 to 8 seconds in, at the cluster's whole rate.
        let limit = per_sec * draw.gen_range(3..=8);
        let faults = Faults {
            loss: if draw.gen_bool(0.5) { 0.1 } else { 0.0 },
            duplicate: if draw.gen_bool(0.5) { 0.05 } else { 0.0 },
            replay: if draw.gen_bool(0.3) { 0.01 } else { 0.0 },
            replay_age_max: Duration::from_secs(5),
            delay_min: Duration::from_millis(draw.gen_range(0..=2)),
            delay_max: Duration::from_millis(draw.gen_range(2..=30)),
        };
        let partition = draw.gen_bool(0.5).then(|| {
            let cut: Vec<usize> = (0..nodes).filter(|_| draw.gen_bool(0.5)).collect();
            let cut = if cut.is_empty() || cut.len() == nodes {
                vec![0]
            } else {
                cut
            };
            let from = draw.gen_range(500..=6_000);
            (cut, from, from + draw.gen_range(1_000..=5_000))
        });
        let pause = draw.gen_bool(0.3).then(|| {
            let from = draw.gen_range(500..=8_000);
            (
                draw.gen_range(0..nodes),
                from,
                from + draw.gen_range(200..=3_000),
            )
        });
        let crash = draw.gen_bool(0.3).then(|| {
            let from = draw.gen_range(500..=8_000);
            (
                draw.gen_range(0..nodes),
                from,
                from + draw.gen_range(100..=2_000),
            )
        });
        // Up to half a second behind (the load starts at least a second into the run's
        // window, so every node counts into one window) and five seconds ahead.
        let skew = draw
            .gen_bool(0.3)
            .then(|| (draw.gen_range(0..nodes), draw.gen_range(-500..=5_000_i64)));
        Scenario {
            nodes,
            every_ms,
            limit,
            slack: draw.gen_range(0..=20),
            stale_after_ms: draw.gen_range(200..=1_000),
            faults,
            partition,
            pause,
            crash,
            skew,
        }
    }

    fn rule(&self) -> RuleConfig {
        let rule = format!(
            "name = \"sim\"\nlimit = {}\nwindow_secs = 3600\nslack = {}\nstale_after_ms = {}\n",
            self.limit, self.slack, self.stale_after_ms
        );
        toml::from_str(&rule).unwrap()
    }
}

/// What a node's gossip task would have shown its decisions.
struct Deciding {
    replica: ReplicaId,
    /// When this life began serving (simulated monotonic time).
    serving_since: Duration,
    store: LaneStore,
    view: ViewState,
    /// The counters last published, to publish only what changed, as the driver does.
    published: BTreeMap<Key, PnCounter>,
}

impl Deciding {
    /// Node `index`'s current life, as it starts: an empty store, and a view that counts
    /// its seeds as unheard (`daemon::run` sets it so before the gossip task's first
    /// refresh), refreshed once.
    fn new(sim: &Sim, index: usize) -> Deciding {
        let mut view = ViewState::default();
        let gossip = sim.gossip(index).unwrap().config();
        view.unheard_seeds = unheard_seeds(
            &gossip.seeds,
            false,
            Duration::ZERO,
            gossip.dead_after,
            |_| false,
        );
        let mut node = Deciding {
            replica: sim.replica(index),
            serving_since: sim.time(),
            store: LaneStore::new(sim.replica(index), 1_000),
            view,
            published: BTreeMap::new(),
        };
        refresh(sim, index, &mut node);
        node
    }
}

/// What the cluster admitted over a run.
#[derive(Debug, Default)]
struct Admitted {
    total: u64,
    /// The largest finite bound reported by an admission that left the cluster past the
    /// limit: one of those the overshoot is made of. (Until session 46 the largest of any
    /// admission, and isolated ones far below the limit report bounds of thousands, so an
    /// overshoot of hundreds from connected decisions that reported bounds near 0 passed:
    /// found in a review of the tests.)
    max_bound: f64,
    /// Admissions whose decision reported an infinite bound: a node that had not heard every
    /// live member yet (a new life, or its peers until they hear it), or not for a rate
    /// sample's time. Each may be all overshoot.
    unbounded: u64,
    by_mode: BTreeMap<String, u64>,
    /// The first isolated admission after which the overshoot was past the bound that
    /// admission reported: at what millisecond, by which node, the overshoot and the bound.
    isolated_breach: Option<(u64, usize, i128, f64)>,
}

fn run(seed: u64) -> (Scenario, Admitted) {
    let scenario = Scenario::draw(seed);
    let mut config = SimConfig::new(scenario.nodes, seed);
    config.faults = scenario.faults.clone();
    let mut sim = Sim::new(config);
    if let Some((node, skew_ms)) = scenario.skew {
        sim.set_skew(node, skew_ms);
    }
    let rules = Rules::new(&[scenario.rule()]).unwrap();
    let rule = rules.get("sim").unwrap();
    let mut nodes: Vec<Deciding> = (0..scenario.nodes)
        .map(|index| Deciding::new(&sim, index))
        .collect();
    // Joined and fresh before the load starts, as a cluster in service is.
    while !sim.joined() {
        assert!(
            sim.time() < Duration::from_secs(30),
            "seed {seed}: never joined"
        );
        advance(&mut sim, &mut nodes, 100);
    }
    advance(&mut sim, &mut nodes, 1_000);
    let (refused_log, refused_keys) = (AtomicU64::new(0), AtomicU64::new(0));
    let refused_sums = tally_node::refused_sums::RefusedSums::default();
    let mut admitted = Admitted::default();
    // Admissions not yet collected, each with when it will be, by which node, and when
    // it was made (the simulator's time).
    let mut collecting: Vec<(u64, usize, Duration)> = Vec::new();
    for ms in 0..RUN_MS {
        if let Some((cut, from, to)) = &scenario.partition {
            let rest: Vec<usize> = (0..scenario.nodes).filter(|i| !cut.contains(i)).collect();
            if ms == *from {
                sim.network().partition(cut, &rest);
            }
            if ms == *to {
                sim.network().heal();
            }
        }
        if let Some((node, from, to)) = scenario.pause {
            if ms == from {
                sim.pause(node);
            }
            if ms == to {
                sim.resume(node);
            }
        }
        if let Some((node, from, to)) = scenario.crash {
            if ms == from {
                sim.crash(node, false);
            }
            if ms == to {
                sim.restart(node);
                nodes[node] = Deciding::new(&sim, node);
            }
        }
        let down = |index: usize, fault: Option<(usize, u64, u64)>| {
            fault.is_some_and(|(node, from, to)| node == index && (from..to).contains(&ms))
        };
        for (index, node) in nodes.iter_mut().enumerate() {
            if down(index, scenario.pause) || down(index, scenario.crash) {
                continue;
            }
            if ms % scenario.every_ms[index] != 0 {
                continue;
            }
            let now = sim.wall(index);
            let key = decide::key(rule, SUBJECT, now).unwrap();
            let mut context = Context {
                store: &node.store,
                view: &node.view,
                now,
                written_at: sim.time(),
                log: None,
                lane_rate_max: u64::MAX,
                lane_log_refused: &refused_log,
                keys_refused: &refused_keys,
                refused: &refused_sums,
            };
            let decision = context.check(&rule.1, key, 1).unwrap();
            if decision.allowed {
                collecting.push((ms + COLLECT_EVERY_MS, index, sim.time()));
                admitted.total += 1;
                // An isolated decision's bound covers the overshoot as it stands, whoever
                // made it: `locations x slack` and what the locations held beyond their
                // shares. (A connected one's is a rate times a staleness: ARCHITECTURE.md,
                // BOUND, says where it falls short per decision.)
                let overshoot = admitted.total as i128 - i128::from(scenario.limit);
                if decision.mode == Mode::ApproximateIsolated
                    && overshoot as f64 > decision.bound
                    && admitted.isolated_breach.is_none()
                {
                    admitted.isolated_breach = Some((ms, index, overshoot, decision.bound));
                }
                if !decision.bound.is_finite() {
                    admitted.unbounded += 1;
                } else if overshoot > 0 {
                    admitted.max_bound = admitted.max_bound.max(decision.bound);
                }
                let mode = match decision.mode {
                    Mode::ApproximateConnected => "connected",
                    Mode::ApproximateIsolated => "isolated",
                    _ => "other",
                };
                *admitted.by_mode.entry(mode.to_owned()).or_default() += 1;
            }
        }
        // Collected: handed to the gossip, a paused node's once it resumes. An admission
        // of a node killed with its state lost before its collection is lost with it (a
        // `tallyd` without a data dir, or one whose disk is lost), and still counts as
        // admitted.
        // A collection takes every admission its node made so far, as `LaneStore::collect`
        // takes every key queued: a hand-off stamped now leaves none made before it behind.
        let collected: Vec<usize> = (collecting.iter())
            .filter(|&&(due, index, _)| due <= ms && !down(index, scenario.pause))
            .map(|&(_, index, _)| index)
            .collect();
        collecting.retain(|&(_, index, _)| {
            if !collected.contains(&index) {
                return true;
            }
            let counted = sim.incr(index, SUBJECT, 1);
            assert!(
                counted || down(index, scenario.crash),
                "node {index} is running"
            );
            false
        });
        // A heartbeat vouches for no write the gossip does not hold yet, as `tallyd`'s
        // driver tells its gossip (`Gossip::hold_stamps_from`).
        for index in 0..scenario.nodes {
            let pending = (collecting.iter())
                .filter(|(_, node, _)| *node == index)
                .map(|&(_, _, made)| made)
                .min();
            sim.hold_stamps_from(index, pending);
        }
        advance(&mut sim, &mut nodes, 1);
    }
    sim.assert_clean("bound_sim");
    (scenario, admitted)
}

/// Runs the cluster for `ms` milliseconds, each node's view refreshed after each.
fn advance(sim: &mut Sim, nodes: &mut [Deciding], ms: u64) {
    for _ in 0..ms {
        sim.run_for(Duration::from_millis(1));
        for (index, node) in nodes.iter_mut().enumerate() {
            refresh(sim, index, node);
        }
    }
}

/// The driver's `publish` and `refresh_view`, for node `index`.
fn refresh(sim: &Sim, index: usize, node: &mut Deciding) {
    let Some(gossip) = sim.gossip(index) else {
        return;
    };
    let now = Now {
        mono: sim.time(),
        wall: sim.wall(index),
    };
    let (me, map) = (node.replica, gossip.map());
    let now_ms = now.mono.as_millis() as u64;
    for (key, counter) in map.iter() {
        let (key, counter) = (key.to_key(), PnCounter::copy_of(&counter));
        if node.published.get(&key) == Some(&counter) {
            continue;
        }
        node.store
            .publish_remote(&key, counter.value_without(me))
            .unwrap();
        let previous = || {
            let window = key.window.previous()?;
            map.counter(&Key {
                window,
                ..key.clone()
            })
        };
        node.view.take_in(&key, &counter, previous, me, now_ms);
        node.published.insert(key, counter);
    }
    let members = gossip.members();
    let all = [State::Alive, State::Suspect, State::Dead, State::Left];
    let rows: Vec<_> = (members.others_in(&all).into_iter())
        .filter_map(|other| Some((other, members.replica(other)?, members.state(other)?)))
        .collect();
    let stamps = (rows.iter())
        .map(|(_, replica, _)| (*replica, map.watermark(*replica).stamp))
        .collect();
    let config = gossip.config();
    node.view.unheard_seeds = unheard_seeds(
        &config.seeds,
        gossip.table_matched(),
        now.mono.saturating_sub(node.serving_since),
        config.dead_after,
        |seed| rows.iter().any(|(node, _, _)| *node == seed),
    );
    node.view.dead_after = Some(config.dead_after);
    let relocated = node.view.set_members(rows, stamps, now);
    node.view.take_relocated(&relocated, map, me);
    node.view.take_ended(map, me);
}

#[test]
fn approximate_overshoot_stays_within_the_reported_bound_over_many_seeds_with_faults() {
    let (mut isolated, mut over, mut runs) = (0, 0, 0);
    for seed in seeds(1, 100) {
        let (scenario, admitted) = run(seed);
        let overshoot = admitted.total as i128 - i128::from(scenario.limit);
        assert!(
            overshoot as f64 <= admitted.max_bound + admitted.unbounded as f64,
            "BOUND: seed {seed} admitted {} against the limit {}, past the largest finite \
             bound reported, {:.1}, and the {} admissions under an infinite one ({:?}; \
             {scenario:?}); replay with TALLY_SIM_SEED={seed} \
             cargo test -p tally-node --release --test bound_sim",
            admitted.total,
            scenario.limit,
            admitted.max_bound,
            admitted.unbounded,
            admitted.by_mode,
        );
        // Only a new life, and its peers until its state reaches them, decide on an unknown
        // bound once the cluster has joined: without a crash none may, or a bound stuck
        // infinite would pass every check above.
        assert!(
            scenario.crash.is_some() || admitted.unbounded == 0,
            "seed {seed}: {} admissions under an infinite bound with no node restarted \
             ({scenario:?})",
            admitted.unbounded
        );
        if let Some((ms, node, overshoot, bound)) = admitted.isolated_breach {
            panic!(
                "BOUND: seed {seed}: node {node}'s isolated admission at {ms} ms left the \
                 overshoot at {overshoot}, past the bound it reported, {bound:.1} \
                 ({scenario:?}); replay with TALLY_SIM_SEED={seed} \
                 cargo test -p tally-node --release --test bound_sim"
            );
        }
        runs += 1;
        isolated += usize::from(admitted.by_mode.contains_key("isolated"));
        over += usize::from(overshoot > 0);
        eprintln!(
            "seed {seed}: {} nodes, limit {}, overshoot {overshoot}, bound {:.1}, \
             unbounded {}, {:?}",
            scenario.nodes,
            scenario.limit,
            admitted.max_bound,
            admitted.unbounded,
            admitted.by_mode
        );
    }
    eprintln!("{over} of {runs} seeds overshot; {isolated} decided isolated at some point");
    // Most seeds' load passes the limit, so the check has something to bound. Not all: a
    // node whose clock is ahead reads its peers as stale and admits only its share.
    assert!(
        over * 10 >= runs * 8,
        "{over} of {runs} seeds passed the limit"
    );
    // And most decide isolated at some point (87 of the 100 in CI), so the isolated
    // admissions' bound is checked too.
    assert!(
        isolated * 2 >= runs,
        "{isolated} of {runs} seeds decided isolated"
    );
}
