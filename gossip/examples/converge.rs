//! How fast does a change reach every node, and what does it cost on the wire?
//!
//! `cargo run -p tally-gossip --release --features sim --example converge -- --nodes 64 --seed 1`
//!
//! In the seeded simulator (1 ms one-way delay, no faults): the cluster joins, then
//! 1. with eager push: single writes at random nodes, and for each write and each other
//!    node, the delay until that node holds it (p50, p99, max);
//! 2. anti-entropy alone (no push): the rounds until every node holds a write (p50, p99);
//! 3. a steady workload of fresh lanes at up to 8 writers, light (one lane per writer per
//!    10 ms) and batched (20): bytes on the wire per changed lane per peer, in all and by
//!    kind of message.

use std::time::Duration;
use tally_gossip::sim::{Sim, SimConfig};

struct Args {
    nodes: usize,
    seed: u64,
    writes: usize,
}

fn parse() -> Args {
    let mut args = Args {
        nodes: 8,
        seed: 1,
        writes: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        let number: u64 = value
            .parse()
            .unwrap_or_else(|_| panic!("{flag}: {value:?} is not a number"));
        match flag.as_str() {
            "--nodes" => args.nodes = number as usize,
            "--seed" => args.seed = number,
            "--writes" => args.writes = number as usize,
            other => panic!("unknown flag {other}; known: --nodes --seed --writes"),
        }
    }
    args
}

fn joined(args: &Args, eager_push: bool) -> Sim {
    let mut config = SimConfig::new(args.nodes, args.seed);
    config.eager_push = eager_push;
    // A measurement, not a fault test: the per-step checkers would dominate at large N.
    config.check_every_step = false;
    let round = config.gossip_interval;
    let mut sim = Sim::new(config);
    while !sim.joined() {
        assert!(
            sim.time() < Duration::from_secs(120),
            "the cluster did not join"
        );
        sim.run_for(round);
    }
    println!("joined in {:?} of simulated time", sim.time());
    sim
}

/// Writes `lanes_per_step` fresh lanes at each of up to 8 nodes every 10 ms for one second;
/// returns the changed lanes, and the bytes sent per changed lane per peer, all traffic
/// included, then by kind of message.
fn bytes_per_lane(
    sim: &mut Sim,
    args: &Args,
    lanes_per_step: usize,
) -> (u64, f64, Vec<(&'static str, f64)>) {
    let writers = args.nodes.min(8);
    let before = sim.bytes_sent();
    let before_by_message = sim.bytes_sent_by_message().by_kind();
    let mut lanes = 0u64;
    for step in 0..100 {
        for node in 0..writers {
            for lane in 0..lanes_per_step {
                sim.incr(
                    node,
                    &format!("steady-{lanes_per_step}-{node}-{step}-{lane}"),
                    1,
                );
                lanes += 1;
            }
        }
        sim.run_for(Duration::from_millis(10));
    }
    sim.run_for(Duration::from_millis(20));
    let bytes = sim.bytes_sent() - before;
    let per_lane_peer = |bytes: u64| bytes as f64 / (lanes * (args.nodes - 1) as u64) as f64;
    let by_message = sim
        .bytes_sent_by_message()
        .by_kind()
        .into_iter()
        .zip(before_by_message)
        .map(|((kind, after), (_, before))| (kind, per_lane_peer(after - before)))
        .collect();
    (lanes, per_lane_peer(bytes), by_message)
}

/// Per write and per other node, the simulated time until that node holds the write.
fn visibility(sim: &mut Sim, args: &Args, step: Duration, limit: Duration) -> Vec<Duration> {
    let mut delays = Vec::new();
    for write in 0..args.writes {
        let origin = (write * 7919 + args.seed as usize) % args.nodes;
        let subject = format!("probe-{write}");
        let key = sim.key(origin, &subject);
        sim.incr(origin, &subject, 1);
        let replica = sim.replica(origin);
        let start = sim.time();
        let mut pending: Vec<usize> = (0..args.nodes).filter(|&n| n != origin).collect();
        while !pending.is_empty() && sim.time() - start <= limit {
            sim.run_for(step);
            pending.retain(|&n| {
                let held = sim.gossip(n).map(|g| g.map().lane(&key, replica).incr);
                if held == Some(1) {
                    delays.push(sim.time() - start);
                    false
                } else {
                    true
                }
            });
        }
        assert!(
            pending.is_empty(),
            "write {write} did not reach {} nodes",
            pending.len()
        );
        sim.run_for(Duration::from_millis(50));
    }
    delays.sort();
    delays
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at]
}

fn main() {
    let args = parse();
    println!(
        "nodes {} seed {} writes {}",
        args.nodes, args.seed, args.writes
    );

    let mut sim = joined(&args, true);
    let config = SimConfig::new(args.nodes, args.seed);
    let delays = visibility(
        &mut sim,
        &args,
        Duration::from_millis(1),
        Duration::from_secs(30),
    );
    println!(
        "eager push: staleness of a write at the other nodes p50 {:?} p99 {:?} max {:?} (push interval {:?}, one-way delay 1 ms)",
        percentile(&delays, 0.5),
        percentile(&delays, 0.99),
        delays[delays.len() - 1],
        config.push_interval,
    );

    for lanes_per_step in [1, 20] {
        let (lanes, per_lane, by_message) = bytes_per_lane(&mut sim, &args, lanes_per_step);
        println!(
            "steady load, {lanes_per_step} fresh lane(s) per writer per 10 ms: {lanes} changed lanes, {per_lane:.1} bytes per changed lane per peer (all traffic: pushes, heartbeats, digests)"
        );
        let by_message: Vec<String> = by_message
            .iter()
            .map(|(kind, bytes)| format!("{kind} {bytes:.1}"))
            .collect();
        println!("  by message: {}", by_message.join(", "));
    }

    let mut sim = joined(&args, false);
    let round = config.gossip_interval;
    let delays = visibility(&mut sim, &args, round / 10, Duration::from_secs(60));
    let rounds: Vec<f64> = delays
        .iter()
        .map(|d| d.as_secs_f64() / round.as_secs_f64())
        .collect();
    let at = |p: f64| rounds[((rounds.len() as f64 - 1.0) * p).round() as usize];
    println!(
        "anti-entropy alone (fanout {}, round {:?}): rounds to reach a node p50 {:.1} p99 {:.1} max {:.1}; log3(N) + 3 = {:.1}",
        config.fanout,
        round,
        at(0.5),
        at(0.99),
        rounds[rounds.len() - 1],
        (args.nodes as f64).ln() / 3f64.ln() + 3.0
    );
}
