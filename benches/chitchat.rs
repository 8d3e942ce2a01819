#![allow(clippy::disallowed_methods)] // measures wall time
//! Gossip convergence of `chitchat` (quickwit's scuttlebutt), measured the way
//! `gossip/examples/converge.rs` measures tally, for the side-by-side in `BENCHMARKS.md`.
//!
//! `cargo bench --bench chitchat` (N = 8 and 64); flags after `--`: `--nodes 8,64`,
//! `--protocol v0` (the uncompressed digest; the default here is v1, the compressed one),
//! `--per-step 20` (the batched steady load). `--nodes 512` did not join within the
//! bench's 180 s on this 2-core machine.
//!
//! N chitchat servers run in one process on a current-thread tokio runtime and talk over
//! chitchat's own in-memory `ChannelTransport` (`with_mtu(65_507)`, as chitchat's tests use
//! it): every message is serialized to its wire bytes and decoded again, and the transport
//! counts the serialized bytes of every message sent. No sockets. Gossip interval 100 ms;
//! chitchat's fanout is the constant `GOSSIP_COUNT = 3` (server.rs), plus now and then a
//! seed node or a dead node. Every node names node 0 as its seed. Times are wall time.
//!
//! 1. The cluster joins: every node counts all N nodes as live. Then 2 s to settle.
//! 2. Idle traffic over 2 s: bytes and messages per node per second.
//! 3. Rounds to converge one key update: for each of 20 updates, at node
//!    `(i * 7919 + 1) % N` (the origins `converge.rs` uses with seed 1), set
//!    `probe-{i}` = `1`, then every 10 ms ask each other node whether it holds it, and
//!    record per node the delay, in units of the gossip interval (p50 / p99 / max).
//! 4. Bytes per update per peer, under the steady load `converge.rs` uses: each of
//!    min(N, 8) writers sets `--per-step` (default 1) fresh keys (`steady-{step}-{k}`, in
//!    its own key space, so no node name in them) every 10 ms for 1 s, then everyone waits
//!    until every node holds every key. All bytes sent from the first update to that
//!    moment (digests, deltas, heartbeats) / (updates x (N - 1)); and the same with the
//!    idle rate of step 2 taken off first ("above idle").
//!
//! On one core the process itself is the limit: every node clones the whole cluster state
//! for its live-nodes watcher each round in which any key changed, so all N nodes' copies
//! of a growing state are cloned on the same core. The messages-per-node-per-second
//! columns show whether the rounds kept to 100 ms (about 90) or fell behind.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use chitchat::transport::ChannelTransport;
use chitchat::{
    spawn_chitchat, ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig,
    ProtocolVersion,
};

const GOSSIP_INTERVAL: Duration = Duration::from_millis(100);
const POLL: Duration = Duration::from_millis(10);
const UPDATES: usize = 20;
const SEED: usize = 1;
const MTU: usize = 65_507;
/// The steady load, as `converge.rs` writes it: up to 8 writers, a step every 10 ms, 1 s.
const WRITERS: usize = 8;
const STEADY_STEPS: usize = 100;
const STEADY_STEP: Duration = Duration::from_millis(10);

struct Args {
    nodes: Vec<usize>,
    protocol: ProtocolVersion,
    /// Fresh keys per writer per 10 ms step of the steady load.
    per_step: usize,
}

fn parse() -> Args {
    let mut args = Args {
        nodes: vec![8, 64],
        protocol: ProtocolVersion::V1,
        per_step: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--nodes" => {
                let value = it.next().unwrap_or_default();
                args.nodes = value
                    .split(',')
                    .map(|n| {
                        n.parse()
                            .unwrap_or_else(|_| panic!("--nodes: {n:?} is not a number"))
                    })
                    .collect();
            }
            "--protocol" => {
                args.protocol = match it.next().as_deref() {
                    Some("v0") => ProtocolVersion::V0,
                    Some("v1") => ProtocolVersion::V1,
                    other => panic!("--protocol: {other:?}; known: v0 v1"),
                }
            }
            "--per-step" => {
                let value = it.next().unwrap_or_default();
                args.per_step = value
                    .parse()
                    .unwrap_or_else(|_| panic!("--per-step: {value:?} is not a number"));
            }
            // `cargo bench` passes `--bench` to every bench target.
            "--bench" => {}
            other => {
                panic!("unknown flag {other}; known: --nodes 8,64 --protocol v0|v1 --per-step 1")
            }
        }
    }
    args
}

fn addr(node: usize) -> SocketAddr {
    let port = u16::try_from(10_000 + node).expect("at most 55,535 nodes");
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn chitchat_id(node: usize) -> ChitchatId {
    ChitchatId::new(format!("node-{node}"), 0, addr(node))
}

async fn spawn(
    node: usize,
    protocol: ProtocolVersion,
    transport: &ChannelTransport,
) -> ChitchatHandle {
    let config = ChitchatConfig {
        chitchat_id: chitchat_id(node),
        cluster_id: "bench".to_string(),
        gossip_interval: GOSSIP_INTERVAL,
        listen_addr: addr(node),
        seed_nodes: vec![addr(0).to_string()],
        failure_detector_config: FailureDetectorConfig {
            // As chitchat's own perf tests do: expect a heartbeat every gossip interval.
            initial_interval: GOSSIP_INTERVAL,
            ..Default::default()
        },
        marked_for_deletion_grace_period: Duration::from_secs(3_600),
        catchup_callback: None,
        extra_liveness_predicate: None,
        protocol_version: protocol,
    };
    spawn_chitchat(config, Vec::new(), transport)
        .await
        .expect("spawn a chitchat server")
}

/// Does `node` hold `key` = `value` in the state of `origin`?
async fn holds(handle: &ChitchatHandle, origin: &ChitchatId, key: &str, value: &str) -> bool {
    let chitchat = handle.chitchat();
    let guard = chitchat.lock().await;
    guard
        .node_state(origin)
        .and_then(|state| state.get(key))
        .is_some_and(|held| held == value)
}

/// Messages sent per node per second since `since`. Each gossip round a node sends about
/// nine (three SYNs, and the SYN-ACKs and ACKs of the exchanges it takes part in), so a
/// rate well below the idle one means the rounds fell behind their 100 ms.
fn message_rate(transport: &ChannelTransport, n: usize, since: (u64, Instant)) -> f64 {
    let (before, start) = since;
    (transport.statistics().num_messages_total - before) as f64
        / (n as f64 * start.elapsed().as_secs_f64())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at]
}

struct Report {
    nodes: usize,
    join: Duration,
    idle_bytes_per_node_sec: f64,
    idle_msgs_per_node_sec: f64,
    rounds: Vec<f64>,
    probe_msgs_per_node_sec: f64,
    steady_msgs_per_node_sec: f64,
    steady_updates: usize,
    steady_bytes: u64,
    steady_took: Duration,
}

async fn measure(n: usize, protocol: ProtocolVersion, per_step: usize) -> Report {
    let transport = ChannelTransport::with_mtu(MTU);
    let mut handles = Vec::with_capacity(n);
    for node in 0..n {
        handles.push(spawn(node, protocol, &transport).await);
    }
    let ids: Vec<ChitchatId> = (0..n).map(chitchat_id).collect();

    // 1. Join: every node sees every node as live.
    let start = Instant::now();
    loop {
        let mut joined = true;
        for handle in &handles {
            let chitchat = handle.chitchat();
            let guard = chitchat.lock().await;
            if guard.live_nodes().count() < n {
                joined = false;
                break;
            }
        }
        if joined {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "{n} nodes did not join in 180 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let join = start.elapsed();
    eprintln!("N = {n}: joined in {join:.1?}");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // 2. Idle traffic.
    let idle = Duration::from_secs(2);
    let before = transport.statistics();
    tokio::time::sleep(idle).await;
    let after = transport.statistics();
    let per_node_sec = |x: u64| x as f64 / (n as f64 * idle.as_secs_f64());
    let idle_bytes_per_node_sec = per_node_sec(after.num_bytes_total - before.num_bytes_total);
    let idle_msgs_per_node_sec = per_node_sec(after.num_messages_total - before.num_messages_total);

    eprintln!("N = {n}: idle {idle_bytes_per_node_sec:.0} bytes and {idle_msgs_per_node_sec:.1} messages per node per second");

    // 3. Rounds to converge one update.
    let since = (transport.statistics().num_messages_total, Instant::now());
    let mut rounds = Vec::with_capacity(UPDATES * (n - 1));
    for update in 0..UPDATES {
        let origin = (update * 7919 + SEED) % n;
        let key = format!("probe-{update}");
        {
            let chitchat = handles[origin].chitchat();
            let mut guard = chitchat.lock().await;
            guard.self_node_state().set(&key, "1");
        }
        let start = Instant::now();
        let mut pending: Vec<usize> = (0..n).filter(|&node| node != origin).collect();
        while !pending.is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "update {update} did not reach {} of {} nodes in 60 s",
                pending.len(),
                n - 1
            );
            tokio::time::sleep(POLL).await;
            let mut still = Vec::with_capacity(pending.len());
            for node in pending {
                if holds(&handles[node], &ids[origin], &key, "1").await {
                    rounds.push(start.elapsed().as_secs_f64() / GOSSIP_INTERVAL.as_secs_f64());
                } else {
                    still.push(node);
                }
            }
            pending = still;
        }
        // Land the next update at another point of the round.
        tokio::time::sleep(Duration::from_millis(50 + (update as u64 * 37) % 100)).await;
    }
    rounds.sort_by(f64::total_cmp);
    let probe_msgs_per_node_sec = message_rate(&transport, n, since);
    eprintln!(
        "N = {n}: {UPDATES} updates measured; {probe_msgs_per_node_sec:.1} messages per node per second meanwhile"
    );

    // 4. Steady load: bytes per update per peer.
    let writers = n.min(WRITERS);
    let before = transport.statistics();
    let since = (before.num_messages_total, Instant::now());
    let start = Instant::now();
    for step in 0..STEADY_STEPS {
        for handle in &handles[..writers] {
            let chitchat = handle.chitchat();
            let mut guard = chitchat.lock().await;
            for key in 0..per_step {
                guard
                    .self_node_state()
                    .set(format!("steady-{step}-{key}"), "1");
            }
        }
        tokio::time::sleep(STEADY_STEP).await;
    }
    // A node's keys travel in version order, so holding its last key means holding all.
    let last = format!("steady-{}-{}", STEADY_STEPS - 1, per_step - 1);
    loop {
        let mut done = true;
        'nodes: for handle in &handles {
            let chitchat = handle.chitchat();
            let guard = chitchat.lock().await;
            for origin in &ids[..writers] {
                let held = guard
                    .node_state(origin)
                    .and_then(|state| state.get(&last))
                    .is_some();
                if !held {
                    done = false;
                    break 'nodes;
                }
            }
        }
        if done {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "the steady load did not converge in 180 s"
        );
        tokio::time::sleep(POLL).await;
    }
    let steady_took = start.elapsed();
    let steady_msgs_per_node_sec = message_rate(&transport, n, since);
    eprintln!("N = {n}: steady load converged after {steady_took:.2?}; {steady_msgs_per_node_sec:.1} messages per node per second meanwhile");
    let after = transport.statistics();
    let steady_bytes = after.num_bytes_total - before.num_bytes_total;

    for handle in handles {
        let _ = handle.shutdown().await;
    }
    Report {
        nodes: n,
        join,
        idle_bytes_per_node_sec,
        idle_msgs_per_node_sec,
        rounds,
        probe_msgs_per_node_sec,
        steady_msgs_per_node_sec,
        steady_updates: STEADY_STEPS * writers * per_step,
        steady_bytes,
        steady_took,
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = parse();
    let protocol = match args.protocol {
        ProtocolVersion::V0 => "v0 (plain digest)",
        ProtocolVersion::V1 => "v1 (zstd digest)",
    };
    println!(
        "chitchat 0.13, ChannelTransport (in-process, mtu {MTU}), gossip interval {GOSSIP_INTERVAL:?}, fanout 3, protocol {protocol}"
    );
    println!(
        "{UPDATES} single updates polled every {POLL:?}; steady load: {} fresh key(s) per writer (up to {WRITERS}) every {STEADY_STEP:?} for 1 s",
        args.per_step
    );
    println!("msgs/node/s: messages sent per node per second in that phase (about 9 per round: ~90 if the rounds kept to 100 ms)");
    println!();
    println!(
        "| N | join | idle bytes/node/s | idle msgs/node/s | rounds p50 / p99 / max | msgs/node/s meanwhile | steady: updates, converged after, msgs/node/s | bytes per update per peer: all traffic / above idle |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for &n in &args.nodes {
        assert!(n >= 2, "--nodes: at least 2");
        let r = measure(n, args.protocol, args.per_step).await;
        let peers = (r.nodes - 1) as f64;
        println!(
            "| {} | {:.1} s | {:.0} | {:.1} | {:.1} / {:.1} / {:.1} | {:.1} | {}, {:.2} s, {:.1} | {:.1} / {:.1} |",
            r.nodes,
            r.join.as_secs_f64(),
            r.idle_bytes_per_node_sec,
            r.idle_msgs_per_node_sec,
            percentile(&r.rounds, 0.5),
            percentile(&r.rounds, 0.99),
            r.rounds[r.rounds.len() - 1],
            r.probe_msgs_per_node_sec,
            r.steady_updates,
            r.steady_took.as_secs_f64(),
            r.steady_msgs_per_node_sec,
            r.steady_bytes as f64 / (r.steady_updates as f64 * peers),
            (r.steady_bytes as f64
                - r.idle_bytes_per_node_sec * n as f64 * r.steady_took.as_secs_f64())
                / (r.steady_updates as f64 * peers),
        );
    }
}
