//! A load generator for one `tallyd`'s client port, shaped like `redis-benchmark -t incr`,
//! for the side-by-side with Redis in `BENCHMARKS.md` (run by `benches/client_vs_redis.sh`).
//!
//! ```text
//! cargo bench --bench client_load -- --endpoint 127.0.0.1:7100 --connections 50 \
//!     --pipeline 16 --requests 2000000
//! ```
//!
//! It opens `--connections` C connections (one [`Client`] each) and keeps `--pipeline` P
//! requests in flight on each: P tasks per connection, each looping `incr(rule, subject, 1)`
//! and waiting for its answer before sending the next, so a connection carries at most P
//! requests at a time, pipelined by the client's writer. `redis-benchmark -t incr` sends
//! `INCR counter:__rand_int__`, which without `-r` is one key for every request; the
//! default here is the same, one subject (`counter`) under the rule `bench`. `--keys K`
//! spreads the requests over the subjects `key-0`..`key-<K-1>` instead.
//!
//! First a warm-up of `--requests / 10` requests, not recorded; then `--requests` N
//! requests, each timed from just before `incr` is called to just after its answer is
//! back, so a request's latency includes its wait in the client's queue and for the
//! runtime to poll its task. (redis-benchmark times a pipelined batch from the start of
//! its write to the first bytes of its first reply, and records that for all P replies: at
//! P = 1 the same round trip, at P > 1 shorter than the last reply's wait.) Throughput is
//! N over the wall time of the measured phase, from spawning its tasks to the last answer.
//! The generator's own work per request is kept small, since it shares the cores with the
//! server: each of the C x P tasks makes its own share of the requests (no counter shared
//! between them), records into a vector sized for its share (made, and each of its pages
//! written, before the clock starts: see `Recording`), and reads the clock once per
//! request, the moment an answer is back being the start of that task's next request (so a
//! latency also holds the few instructions in between). One line goes to stdout:
//!
//! ```text
//! tally connections=C pipeline=P requests=N ops_per_sec=X p50_us=Y p99_us=Z
//! ```
//!
//! Everything runs on one current-thread tokio runtime (as redis-benchmark is one thread),
//! in its own process; the server is another process on the same machine.
//!
//! `--raw` leaves `tally-client` out, to tell the sidecar's cost from the client's: one
//! thread, blocking sockets, and requests encoded once up front with `tally_client::wire`.
//! Each round writes P request frames to every connection, then reads and decodes the P
//! answers from each (any refusal fails the run); a request's latency runs from the start
//! of its round's writes to the moment its answer is decoded. The line then ends in
//! `client=raw`. Like redis-benchmark, it formats its commands once and makes no objects
//! per request; unlike it, it works in rounds on blocking sockets, not in an event loop.
//!
//! `--raw --poll` polls its sockets instead of blocking on them, so that its CPU never
//! idles while it waits for an answer: on a virtual machine, where a vCPU woken from idle
//! takes tens of microseconds, one connection's round trip then leaves out the load
//! generator's wake-up and holds the server's alone. It burns a core while it runs. The
//! line then ends in `client=raw-poll`.
//!
//! `--raw --redis` drives a `redis-server` the same way, with `INCR <subject>` in RESP and
//! its replies checked to be integers (any other reply fails the run): the same load generator, the
//! same rounds and the same clock on both servers, where redis-benchmark's own p50 is the
//! top of an 8 us bucket of its histogram at these latencies. The line then starts with
//! `redis`.
//!
//! `--batch` drives `tally-client` in redis-benchmark's shape: one task per connection,
//! which sends its P requests as one [`Pipeline`] (`Client::send`) and waits for all P
//! answers before the next round. Every request of a round records the round's time, from
//! the call to the last answer (redis-benchmark records the time to the first reply for
//! each). The line then ends in `client=batch`; `--op check` works with it too.
//!
//! Exact checks (`benches/exact_vs_redis.sh`, issue 5):
//!
//! ```text
//! # through an edge: check(rule, subject, 1) instead of incr, on an exact rule
//! cargo bench --bench client_load -- --endpoint 127.0.0.1:18102 --op check --rule quota \
//!     --connections 50 --pipeline 16 --requests 200000
//! # at the region directly, as an edge speaks to it
//! cargo bench --bench client_load -- --region 127.0.0.1:18001 --certs DIR --node 3 \
//!     --rule quota --connections 50 --pipeline 16 --requests 200000
//! # the disk's sync latency: write(8 bytes) + fdatasync, appending and preallocated
//! cargo bench --bench client_load -- --fsync-probe target/bench-exact/probe --requests 5000
//! ```
//!
//! `--op check` calls `check(rule, subject, 1)` where the default calls `incr`; a denied
//! check fails the run (a throughput run wants every check counted, so give the rule a
//! limit above the requests). The line ends in `op=check`. `--op incr-id` calls
//! `incr_with_id` under a new `CheckId` each time: what the sidecar's memory of ids costs
//! (and with a data directory its answer log, `node/src/answerlog.rs`). The line ends in
//! `op=incr-id`.
//!
//! `--region ADDR` leaves the edge's client side out: it runs the edge's own forwarder
//! (`tally_node::region::forward::Forwarder`) on a QUIC endpoint of its own, with the
//! certificate of node `--node` from `--certs DIR` (`node-<N>.pem`, `.key`, `ca.pem`; use a
//! node id no running edge has, since the region keeps the newest connection per node id
//! for its own sends), to the region node at ADDR whose certificate names node
//! `--region-node` (1). One task keeps C x P checks in flight on the forwarder's one
//! session (`Forwarder::submit`, as many new ones as each run of answers brings), as an
//! edge forwards every check of its clients. Request ids carry node `--node`, a
//! generation from the wall clock, and the forwarder's sequence numbers; the window is the one holding the wall-clock time at
//! the start of each phase, `--window-secs` long (3600), and the region's timeout 10 s. A
//! request's latency runs from the call to the outcome; an answer other than an admitted
//! decision, or a check sent twice, fails the run. The line ends in `op=check
//! path=region`.
//!
//! `--fsync-probe FILE` measures the disk instead, two ways one after the other, each
//! `--requests` N times (after N / 10 not recorded), timing each write and its `sync_data`:
//! `mode=append` appends to FILE (each sync also commits the file's new size, as Redis's
//! AOF does); `mode=preallocated` writes through the region's own log
//! (`tally_node::region::log::FileStorage`, on FILE with its extension `probe.log`) into its
//! allocation ahead of zeros already synced, waiting for a chunk's zeros once per chunk.
//! Both ways run with 8 bytes per sync (`bytes=8`, the disk's sync) and then with 16 KiB
//! (`bytes=16384`, a region group under load). It removes the files and prints one line
//! per way and size, each starting with `fsync mode=`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tally_client::wire::{self, Op, Request, Response};
use tally_client::{CheckId, Client, Decision, Endpoint, Error, Options, Pipeline, Reply};
use tally_crdt::{Generation, Key, NodeId, ReplicaId, Rule, Subject, Window};
use tally_node::config::{OnRegionUnavailable, RuleConfig, RuleMode};
use tally_node::region::forward::{Check, ForwardStats, Forwarded, Forwarder};
use tally_node::region::Outcome;
use tally_node::transport::{Transport, TransportStats};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

// mimalloc, as `tally` and `tallyd` use: redis-benchmark, the peer this load generator is
// measured beside, allocates with jemalloc (Debian's build links it).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// What the command line asks for.
#[derive(Debug, Clone)]
struct Args {
    endpoint: Endpoint,
    connections: usize,
    pipeline: usize,
    requests: u64,
    rule: String,
    /// 1: every request counts the one subject `counter`; more: `key-<i % keys>`.
    keys: u64,
    /// Drive the sidecar with pre-encoded frames on blocking sockets, not `tally-client`.
    raw: bool,
    /// `--raw`: drive a `redis-server` with `INCR <subject>` instead of a sidecar.
    redis: bool,
    /// `--raw`: poll the sockets rather than block on them.
    poll: bool,
    /// Send each connection's P requests as one [`Pipeline`], not from P tasks.
    batch: bool,
    /// What each request does.
    op: LoadOp,
    /// Speak the region protocol to the region node at this QUIC address, not to a sidecar.
    region: Option<SocketAddr>,
    /// `--region`: the directory of `ca.pem` and `node-<node>.pem`/`.key`.
    certs: Option<PathBuf>,
    /// `--region`: the node id this generator speaks as (its certificate's).
    node: u64,
    /// `--region`: the node id the region's certificate names.
    region_node: u64,
    /// `--region`: the rule's window length.
    window_secs: u32,
    /// Measure write + fdatasync on this file instead of any server.
    fsync_probe: Option<PathBuf>,
}

/// What a request to the sidecar does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LoadOp {
    /// `incr(rule, subject, 1)`.
    Incr,
    /// `incr_with_id(CheckId::new(), rule, subject, 1)`: a named increment, which the
    /// sidecar remembers (and, with a data directory, logs) under its id.
    IncrWithId,
    /// `check(rule, subject, 1)`, which must be allowed.
    Check,
}

const USAGE: &str = "usage: client_load [--endpoint 127.0.0.1:7100] [--connections 1] \
                     [--pipeline 1] [--requests 100000] [--rule bench] [--keys 1] [--raw [--redis] [--poll]] \
                     [--batch] [--op incr|incr-id|check] \
                     [--region ADDR --certs DIR [--node 2] [--region-node 1] [--window-secs 3600]] \
                     [--fsync-probe FILE]";

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(why) => {
            eprintln!("client_load: {why}\n{USAGE}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(file) = &args.fsync_probe {
        return match run_fsync_probe(file, args.requests) {
            Ok(reports) => {
                for (mode, bytes, report) in reports {
                    println!(
                        "fsync mode={mode} bytes={bytes} requests={} ops_per_sec={:.0} \
                         p50_us={:.1} p99_us={:.1} file={}",
                        report.requests,
                        report.ops_per_sec,
                        report.p50_us,
                        report.p99_us,
                        file.display()
                    );
                }
                ExitCode::SUCCESS
            }
            Err(why) => {
                eprintln!("client_load: {why}");
                ExitCode::FAILURE
            }
        };
    }
    let report = if args.raw {
        run_raw(&args)
    } else {
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => match args.region {
                Some(region) => runtime.block_on(run_region(&args, region)),
                None => runtime.block_on(run(&args)),
            },
            Err(err) => Err(format!("tokio runtime: {err}")),
        }
    };
    match report {
        Ok(report) => {
            let op = match args.op {
                LoadOp::Incr if args.region.is_none() => "",
                LoadOp::IncrWithId => " op=incr-id",
                LoadOp::Incr | LoadOp::Check => " op=check",
            };
            println!(
                "{} connections={} pipeline={} requests={} ops_per_sec={:.0} p50_us={:.1} \
                 p99_us={:.1}{}{}{}",
                if args.redis { "redis" } else { "tally" },
                args.connections,
                args.pipeline,
                report.requests,
                report.ops_per_sec,
                report.p50_us,
                report.p99_us,
                if args.raw && args.poll {
                    " client=raw-poll"
                } else if args.raw {
                    " client=raw"
                } else if args.batch {
                    " client=batch"
                } else {
                    ""
                },
                op,
                if args.region.is_some() {
                    " path=region"
                } else {
                    ""
                }
            );
            ExitCode::SUCCESS
        }
        Err(why) => {
            eprintln!("client_load: {why}");
            ExitCode::FAILURE
        }
    }
}

/// What one measured run found.
struct Report {
    requests: u64,
    ops_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
}

/// Connects, warms up, then runs and times the measured requests.
async fn run(args: &Args) -> Result<Report, String> {
    // A failed request fails the run; 10 s rather than the default 1 s, so that a stall of
    // the shared 2-core machine is measured as latency, not reported as an error.
    let options = Options::default().with_timeout(Duration::from_secs(10));
    let mut clients = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let client = Client::connect(args.endpoint.clone(), options)
            .await
            .map_err(|err| format!("connect to {}: {err}", args.endpoint))?;
        clients.push(client);
    }
    let subjects: Arc<[String]> = subjects(args.keys).into();

    let (clients, subjects) = (&clients, &subjects);
    let run_phase = |requests, recording| async move {
        if args.batch {
            batched_phase(clients, args, subjects, requests, recording).await
        } else {
            phase(clients, args, subjects, requests, recording).await
        }
    };
    let warm_up = (args.requests / 10).max(1);
    run_phase(warm_up, None).await?;

    let tasks = args.connections * if args.batch { 1 } else { args.pipeline };
    let recording = Recording::new(args.requests, tasks as u64);
    let started = now();
    let latencies_ns = run_phase(args.requests, Some(recording)).await?;
    let elapsed = now().duration_since(started);

    assert_eq!(
        latencies_ns.len() as u64,
        args.requests,
        "every measured request records one latency"
    );
    Ok(report(latencies_ns, elapsed))
}

/// The subjects requests cycle through: `counter` alone, as redis-benchmark's one key, or
/// `key-0`..`key-<keys-1>`.
fn subjects(keys: u64) -> Vec<String> {
    if keys == 1 {
        vec!["counter".to_string()]
    } else {
        (0..keys).map(|i| format!("key-{i}")).collect()
    }
}

fn report(mut latencies_ns: Vec<u64>, elapsed: Duration) -> Report {
    latencies_ns.sort_unstable();
    Report {
        requests: latencies_ns.len() as u64,
        ops_per_sec: latencies_ns.len() as f64 / elapsed.as_secs_f64(),
        p50_us: percentile(&latencies_ns, 0.50) as f64 / 1e3,
        p99_us: percentile(&latencies_ns, 0.99) as f64 / 1e3,
    }
}

/// Runs `requests` increments with P tasks on each connection, each making its share, and
/// returns their latencies in nanoseconds into `recording`, if given.
async fn phase(
    clients: &[Client],
    args: &Args,
    subjects: &Arc<[String]>,
    requests: u64,
    recording: Option<Recording>,
) -> Result<Vec<u64>, String> {
    let workers = (clients.len() * args.pipeline) as u64;
    let record = recording.is_some();
    let (mut buffers, all) = Recording::split(recording);
    let mut tasks = JoinSet::new();
    for worker in 0..workers {
        // P workers per connection.
        let client = clients[worker as usize / args.pipeline].clone();
        let subjects = Arc::clone(subjects);
        let rule = args.rule.clone();
        let op = args.op;
        // Worker w makes the requests w, w + workers, w + 2 x workers, ... below `requests`.
        let share = share(requests, workers, worker);
        let mut latencies_ns = buffers.next().unwrap_or_default();
        tasks.spawn(async move {
            let mut sent = now();
            for ticket in (0..share).map(|turn| worker + turn * workers) {
                let subject = &subjects[(ticket % subjects.len() as u64) as usize];
                match op {
                    LoadOp::Incr => {
                        client
                            .incr(&rule, subject, 1)
                            .await
                            .map_err(|err| format!("incr {rule}/{subject}: {err}"))?;
                    }
                    LoadOp::IncrWithId => {
                        client
                            .incr_with_id(CheckId::new(), &rule, subject, 1)
                            .await
                            .map_err(|err| format!("incr {rule}/{subject}: {err}"))?;
                    }
                    LoadOp::Check => {
                        let decision = client.check(&rule, subject, 1).await;
                        expect_allowed(&rule, subject, decision)?;
                    }
                }
                let answered = now();
                if record {
                    latencies_ns.push(answered.duration_since(sent).as_nanos() as u64);
                }
                sent = answered;
            }
            Ok(latencies_ns)
        });
    }
    gather(tasks, all).await
}

/// `--batch`: runs `requests` requests with one task per connection, each sending rounds of
/// P requests as one [`Pipeline`] and waiting for all P answers; every request of a round
/// records the round's time, from the send to the last answer. Returns the latencies in
/// nanoseconds, in `recording` if given.
async fn batched_phase(
    clients: &[Client],
    args: &Args,
    subjects: &Arc<[String]>,
    requests: u64,
    recording: Option<Recording>,
) -> Result<Vec<u64>, String> {
    let connections = clients.len() as u64;
    let record = recording.is_some();
    let (mut buffers, all) = Recording::split(recording);
    let mut tasks = JoinSet::new();
    for (connection, client) in (0..connections).zip(clients) {
        let client = client.clone();
        let subjects = Arc::clone(subjects);
        let rule = args.rule.clone();
        let (op, pipeline_len) = (args.op, args.pipeline as u64);
        // Connection c makes the requests c, c + C, c + 2 x C, ... below `requests`.
        let share = share(requests, connections, connection);
        let mut latencies_ns = buffers.next().unwrap_or_default();
        tasks.spawn(async move {
            let mut pipeline = Pipeline::new();
            let mut made = 0;
            while made < share {
                let round = pipeline_len.min(share - made);
                let tickets = (made..made + round).map(|turn| connection + turn * connections);
                let round_subjects: Vec<&str> = tickets
                    .map(|ticket| subjects[(ticket % subjects.len() as u64) as usize].as_str())
                    .collect();
                pipeline.clear();
                for subject in &round_subjects {
                    match op {
                        LoadOp::Incr => pipeline.incr(&rule, subject, 1),
                        LoadOp::IncrWithId => {
                            pipeline.incr_with_id(CheckId::new(), &rule, subject, 1)
                        }
                        LoadOp::Check => pipeline.check(&rule, subject, 1),
                    };
                }
                let sent = now();
                let results = client
                    .send(&pipeline)
                    .await
                    .map_err(|err| format!("pipeline of {round}: {err}"))?;
                let answered = now();
                for (subject, result) in round_subjects.iter().zip(results) {
                    match op {
                        LoadOp::Incr | LoadOp::IncrWithId => {
                            result.map_err(|err| format!("incr {rule}/{subject}: {err}"))?;
                        }
                        LoadOp::Check => {
                            let decision = result.map(|reply| match reply {
                                Reply::Decision(decision) => decision,
                                other => unreachable!("`send` checked the kind: {other:?}"),
                            });
                            expect_allowed(&rule, subject, decision)?;
                        }
                    }
                }
                if record {
                    let latency = answered.duration_since(sent).as_nanos() as u64;
                    latencies_ns.extend((0..round).map(|_| latency));
                }
                made += round;
            }
            Ok(latencies_ns)
        });
    }
    gather(tasks, all).await
}

/// A check's decision, which must be allowed: a throughput run wants every check counted.
fn expect_allowed(
    rule: &str,
    subject: &str,
    decision: Result<Decision, Error>,
) -> Result<(), String> {
    let decision = decision.map_err(|err| format!("check {rule}/{subject}: {err}"))?;
    if decision.allowed {
        return Ok(());
    }
    Err(format!(
        "check {rule}/{subject} denied at {} of {}: raise the limit",
        decision.estimate, decision.limit
    ))
}

/// Where a measured phase's tasks record their latencies, one vector each, and where they
/// are gathered: made, and every page of them written, before the phase's clock starts. A
/// page first written during the phase costs a page fault there, which redis-benchmark,
/// keeping a histogram, does not pay: a tenth of the load generator's CPU samples at (b)
/// were the kernel zeroing fresh pages (`perf`, session 41).
#[derive(Default)]
struct Recording {
    per_task: Vec<Vec<u64>>,
    all: Vec<u64>,
}

impl Recording {
    /// Room for `requests` latencies over `tasks` tasks, each its [`share`].
    fn new(requests: u64, tasks: u64) -> Recording {
        Recording {
            per_task: (0..tasks)
                .map(|task| touched(share(requests, tasks, task)))
                .collect(),
            all: touched(requests),
        }
    }

    /// Each task's vector in turn, and the one they are gathered in; empty without one.
    fn split(recording: Option<Recording>) -> (std::vec::IntoIter<Vec<u64>>, Vec<u64>) {
        let Recording { per_task, all } = recording.unwrap_or_default();
        (per_task.into_iter(), all)
    }
}

/// How many of `requests` task `task` of `tasks` makes: the requests `task`, `task +
/// tasks`, `task + 2 x tasks`, ... below `requests`.
fn share(requests: u64, tasks: u64, task: u64) -> u64 {
    requests / tasks + u64::from(task < requests % tasks)
}

/// An empty vector with room for `len` latencies, each of its pages written once.
fn touched(len: u64) -> Vec<u64> {
    let mut latencies = vec![u64::MAX; len as usize];
    std::hint::black_box(latencies.as_mut_slice());
    latencies.clear();
    latencies
}

/// Waits for every load task and returns their latencies together, in `all`, or the first
/// error.
async fn gather(
    mut tasks: JoinSet<Result<Vec<u64>, String>>,
    mut all: Vec<u64>,
) -> Result<Vec<u64>, String> {
    while let Some(joined) = tasks.join_next().await {
        all.extend(joined.map_err(|err| format!("load task: {err}"))??);
    }
    Ok(all)
}

/// `--region`: the edge's own [`Forwarder`] as node `args.node`, on a QUIC endpoint of its
/// own; warms up, then runs and times the measured checks.
async fn run_region(args: &Args, region: SocketAddr) -> Result<Report, String> {
    let certs = args
        .certs
        .as_ref()
        .ok_or("--region needs --certs DIR, the cluster's certificates")?;
    let files = tally_node::config::TlsConfig {
        ca: certs.join("ca.pem"),
        cert: certs.join(format!("node-{}.pem", args.node)),
        key: certs.join(format!("node-{}.key", args.node)),
    };
    let identity =
        tally_node::tls::identity(&files, NodeId(args.node)).map_err(|err| err.to_string())?;
    let local: SocketAddr = if region.is_ipv4() {
        ([127, 0, 0, 1], 0).into()
    } else {
        (std::net::Ipv6Addr::LOCALHOST, 0).into()
    };
    let (mut transport, _inbound) = Transport::bind(
        local,
        identity,
        // Gossip frames' limit: none come, as no member gossips with this node.
        64 * 1024,
        Arc::new(TransportStats::default()),
        None,
    )
    .map_err(|err| format!("bind {local}: {err}"))?;
    let stats = Arc::new(ForwardStats::default());
    let forwarder = Forwarder::new(
        transport.requester(),
        NodeId(args.region_node),
        region.to_string(),
        // A new generation per run, so that no request id repeats one of an earlier run.
        ReplicaId::new(
            NodeId(args.node),
            Generation(tally_node::clock::wall_micros()),
        ),
        tally_node::clock::Clock::start(),
        stats.clone(),
        // No check times out here (a timeout fails the run), so none is admitted late.
        tokio::sync::mpsc::unbounded_channel().0,
    );
    let target = RegionTarget {
        forwarder: Arc::new(forwarder),
        rule: Arc::new(RuleConfig {
            name: args.rule.clone(),
            limit: u64::MAX,
            window_secs: args.window_secs,
            mode: RuleMode::Exact,
            slack: 0,
            stale_after_ms: 1_000,
            locations: None,
            sliding: false,
            on_region_unavailable: OnRegionUnavailable::Error,
            // As `run`'s client timeout: a stall of the machine is latency, not an error.
            region_timeout_ms: 10_000,
        }),
        subjects: subjects(args.keys).into(),
    };
    let workers = args.connections * args.pipeline;

    let warm_up = (args.requests / 10).max(1);
    region_phase(&target, workers, warm_up, None).await?;

    let recording = touched(args.requests);
    let started = now();
    let latencies_ns = region_phase(&target, workers, args.requests, Some(recording)).await?;
    let elapsed = now().duration_since(started);

    transport.close(Duration::ZERO).await;
    assert_eq!(
        latencies_ns.len() as u64,
        args.requests,
        "every measured request records one latency"
    );
    assert_eq!(
        stats.retries.load(Ordering::Relaxed),
        0,
        "no check was sent twice"
    );
    Ok(report(latencies_ns, elapsed))
}

/// What `--region` checks go through, and what they carry.
#[derive(Clone)]
struct RegionTarget {
    forwarder: Arc<Forwarder<(Instant, u64)>>,
    rule: Arc<RuleConfig>,
    subjects: Arc<[String]>,
}

/// Runs `requests` exact checks through the one forwarder, `in_flight` at a time (as many
/// new ones submitted together as each run of answers brings, as an edge's connections
/// submit a batch), and returns their latencies in nanoseconds, in `recording` if given.
async fn region_phase(
    target: &RegionTarget,
    in_flight: usize,
    requests: u64,
    recording: Option<Vec<u64>>,
) -> Result<Vec<u64>, String> {
    let unix_secs = tally_node::clock::wall().0 / 1_000;
    let window = Window::containing(unix_secs, target.rule.window_secs)
        .map_err(|err| format!("--window-secs: {err}"))?;
    let rule = Rule::new(&target.rule.name).map_err(|err| format!("--rule: {err}"))?;
    let keys = target
        .subjects
        .iter()
        .map(|subject| {
            Subject::new(subject)
                .map(|subject| Key::new(rule.clone(), subject, window))
                .map_err(|err| format!("subject {subject}: {err}"))
        })
        .collect::<Result<Vec<Key>, String>>()?;
    // Check `n` counts on the keys in turn.
    let key = |n: u64| &keys[(n % keys.len() as u64) as usize];
    let (answers, mut answered) = mpsc::unbounded_channel();
    // Submits checks `from..to` together, as an edge's connection forwards a batch.
    let submit = |from: u64, to: u64| {
        let sent = now();
        let checks = (from..to).map(|n| Check {
            key: key(n).clone(),
            cost: 1,
            timeout_ms: target.rule.region_timeout_ms,
            check_id: None,
            ticket: (sent, n),
        });
        target
            .forwarder
            .submit(checks, tokio::time::Instant::now(), &answers);
    };
    let mut submitted = requests.min(in_flight as u64);
    submit(0, submitted);
    let record = recording.is_some();
    let mut latencies_ns = recording.unwrap_or_default();
    let mut done = 0;
    while done < requests {
        let run: Vec<Forwarded<_>> = answered.recv().await.expect("the sender is held here");
        let received = now();
        for Forwarded {
            ticket: (sent, n),
            result,
            ..
        } in &run
        {
            match result {
                Ok(Outcome { allowed: true, .. }) => {}
                other => {
                    let subject = key(*n).subject.as_str();
                    return Err(format!(
                        "check {}/{subject} at the region: {other:?} (raise the limit if denied)",
                        target.rule.name
                    ));
                }
            }
            if record {
                latencies_ns.push(received.duration_since(*sent).as_nanos() as u64);
            }
        }
        done += run.len() as u64;
        let more = (requests - submitted).min(run.len() as u64);
        submit(submitted, submitted + more);
        submitted += more;
    }
    Ok(latencies_ns)
}

/// What `--fsync-probe` writes before each sync: 8 bytes (the disk's sync alone, as Redis's
/// AOF does one INCR), and 16 KiB (a group of about 420 records, as the region commits
/// under load: BENCHMARKS.md, issue 5).
const FSYNC_PROBE_BYTES: [usize; 2] = [8, 16 * 1024];

/// `--fsync-probe`: each way, for each of [`FSYNC_PROBE_BYTES`], one after the other.
fn run_fsync_probe(
    file: &std::path::Path,
    requests: u64,
) -> Result<Vec<(&'static str, usize, Report)>, String> {
    let mut reports = Vec::new();
    for bytes in FSYNC_PROBE_BYTES {
        reports.push(("append", bytes, run_fsync(file, requests, bytes)?));
        let preallocated = run_fsync_preallocated(file, requests, bytes)?;
        reports.push(("preallocated", bytes, preallocated));
    }
    Ok(reports)
}

/// `--fsync-probe`: appends `bytes` to `file` and syncs it, one pair at a time; a warm-up
/// of a tenth, then `requests` timed. Removes the file. Every sync also commits the file's
/// new size.
fn run_fsync(file: &std::path::Path, requests: u64, bytes: usize) -> Result<Report, String> {
    let failed = |what: &str, err: std::io::Error| format!("{}: {what}: {err}", file.display());
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .map_err(|err| failed("open", err))?;
    let data = vec![0xa5; bytes];
    let report = time_each(requests, || {
        out.write_all(&data).map_err(|err| failed("write", err))?;
        out.sync_data().map_err(|err| failed("fdatasync", err))
    })?;
    drop(out);
    std::fs::remove_file(file).map_err(|err| failed("remove", err))?;
    Ok(report)
}

/// `--fsync-probe`, the region log's way: `bytes` at a time through the region's own
/// `log::FileStorage` on a new log, `file` with the extension `probe.log` (room, write,
/// `sync_data`, as the committer does a group), so each lands in the log's allocation
/// ahead, zeros already synced, and its sync commits no change of size. Once per chunk
/// of log (`log::CHUNK_BYTES`) a write first waits for the next chunk's zeros, and that
/// wait is timed with it. Removes the log.
fn run_fsync_preallocated(
    file: &std::path::Path,
    requests: u64,
    bytes: usize,
) -> Result<Report, String> {
    use tally_node::region::log::{self, Storage};
    let path = file.with_extension("probe.log");
    let failed = |what: &str, err: std::io::Error| format!("{}: {what}: {err}", path.display());
    let (mut storage, _, _) = log::open(&path).map_err(|err| failed("open", err))?;
    let data = vec![0xa5; bytes];
    let report = time_each(requests, || {
        storage
            .reserve(bytes)
            .and_then(|()| storage.append(&data))
            .and_then(|()| storage.sync())
            .map_err(|err| failed("reserve, write or fdatasync", err))
    })?;
    drop(storage);
    std::fs::remove_file(&path).map_err(|err| failed("remove", err))?;
    Ok(report)
}

/// Runs `once` a tenth of `requests` times unrecorded, then `requests` times timed, one
/// call after the other.
fn time_each(
    requests: u64,
    mut once: impl FnMut() -> Result<(), String>,
) -> Result<Report, String> {
    let warm_up = (requests / 10).max(1);
    let mut latencies_ns = Vec::with_capacity(requests as usize);
    let mut started = now();
    for i in 0..warm_up + requests {
        if i == warm_up {
            started = now();
        }
        let sent = now();
        once()?;
        if i >= warm_up {
            latencies_ns.push(now().duration_since(sent).as_nanos() as u64);
        }
    }
    Ok(report(latencies_ns, now().duration_since(started)))
}

/// `--raw`: rounds of P pre-encoded requests on each of C connections (blocking, or polled
/// with `--poll`); a warm-up of a tenth of the rounds, then N / (C x P) rounds (at least
/// one) timed.
fn run_raw(args: &Args) -> Result<Report, String> {
    let Endpoint::Tcp(addr) = &args.endpoint else {
        return Err(format!("--raw: {} is not a TCP endpoint", args.endpoint));
    };
    let subjects = subjects(args.keys);
    let mut connections = Vec::with_capacity(args.connections);
    for c in 0..args.connections {
        let stream = TcpStream::connect(addr).map_err(|err| format!("connect to {addr}: {err}"))?;
        stream
            .set_nodelay(true)
            .map_err(|err| format!("set_nodelay: {err}"))?;
        stream
            .set_nonblocking(args.poll)
            .map_err(|err| format!("set_nonblocking: {err}"))?;
        // Each connection sends the same P requests every round (tally's with ids 1..=P:
        // unique among the requests in flight on it), with its own subjects when there are
        // several.
        let mut frames = Vec::new();
        for i in 0..args.pipeline {
            let ticket = (c * args.pipeline + i) as u64;
            let subject = &subjects[(ticket % subjects.len() as u64) as usize];
            if args.redis {
                let resp = format!("*2\r\n$4\r\nINCR\r\n${}\r\n{subject}\r\n", subject.len());
                frames.extend_from_slice(resp.as_bytes());
            } else {
                let op = Op::Incr {
                    rule: args.rule.clone(),
                    subject: subject.clone(),
                    amount: 1,
                    id: None,
                };
                let id = i as u64 + 1;
                wire::encode_frame(&Request { id, op }, &mut frames);
            }
        }
        connections.push((stream, frames));
    }
    let per_round = (args.connections * args.pipeline) as u64;
    let rounds = (args.requests / per_round).max(1);
    let warm_up = (rounds / 10).max(1);
    let mut input = Vec::with_capacity(64 * 1024);
    let mut chunk = vec![0u8; 64 * 1024];
    let mut latencies_ns = touched(rounds * per_round);
    let mut started = now();
    for round in 0..warm_up + rounds {
        if round == warm_up {
            started = now();
        }
        let sent = now();
        for (stream, frames) in &mut connections {
            write_or_poll(stream, frames)?;
        }
        for (stream, _) in &mut connections {
            let mut answered = 0;
            input.clear();
            while answered < args.pipeline {
                let read = read_or_poll(stream, &mut chunk)?;
                if read == 0 {
                    return Err("the server closed the connection".to_string());
                }
                input.extend_from_slice(&chunk[..read]);
                let mut at = 0;
                while let Some(len) = next_answer(args.redis, &input[at..])? {
                    if round >= warm_up {
                        latencies_ns.push(now().duration_since(sent).as_nanos() as u64);
                    }
                    answered += 1;
                    at += len;
                }
                input.drain(..at);
            }
        }
    }
    let elapsed = now().duration_since(started);
    Ok(report(latencies_ns, elapsed))
}

/// Writes all of `bytes` to `stream`, blocking, or with `--poll` (a non-blocking socket)
/// polling while its buffer is full.
fn write_or_poll(stream: &mut TcpStream, mut bytes: &[u8]) -> Result<(), String> {
    while !bytes.is_empty() {
        match stream.write(bytes) {
            Ok(0) => return Err("write: the connection took nothing".to_string()),
            Ok(written) => bytes = &bytes[written..],
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err) => return Err(format!("write: {err}")),
        }
    }
    Ok(())
}

/// A read from `stream`, blocking, or with `--poll` (a non-blocking socket) polled until
/// something arrives.
fn read_or_poll(stream: &mut TcpStream, chunk: &mut [u8]) -> Result<usize, String> {
    loop {
        match stream.read(chunk) {
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            read => return read.map_err(|err| format!("read: {err}")),
        }
    }
}

/// The length of the first answer in `input`, once all of it has arrived: a tally answer
/// frame, or with `redis` a RESP integer reply. Any other answer fails the run.
fn next_answer(redis: bool, input: &[u8]) -> Result<Option<usize>, String> {
    if redis {
        let Some(end) = input.windows(2).position(|pair| pair == b"\r\n") else {
            return Ok(None);
        };
        let digits = input[..end]
            .strip_prefix(b":")
            .map(|number| number.strip_prefix(b"-").unwrap_or(number));
        if !digits.is_some_and(|d| !d.is_empty() && d.iter().all(u8::is_ascii_digit)) {
            let reply = String::from_utf8_lossy(&input[..end]);
            return Err(format!("INCR answered {reply:?}, not an integer"));
        }
        return Ok(Some(end + 2));
    }
    let Some(prefix) = input.get(..4) else {
        return Ok(None);
    };
    let prefix: [u8; 4] = prefix.try_into().expect("invariant: a 4-byte slice");
    let len = wire::frame_len(prefix).map_err(|err| format!("answer: {err}"))?;
    let Some(body) = input.get(4..4 + len) else {
        return Ok(None);
    };
    let response: Response = wire::decode_body(body).map_err(|err| format!("answer: {err}"))?;
    if let Err(refusal) = response.result {
        return Err(format!("incr refused: {refusal:?}"));
    }
    Ok(Some(4 + len))
}

/// The wall clock. The workspace reads time only in `node/src/clock.rs`, so that the core
/// and the gossip stay deterministic; a benchmark that times a live server must read it.
#[allow(clippy::disallowed_methods)]
fn now() -> Instant {
    Instant::now()
}

/// The value at fraction `q` of the sorted `values` (nearest rank).
fn percentile(sorted: &[u64], q: f64) -> u64 {
    assert!(!sorted.is_empty(), "a percentile of no values");
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Parses the flags; `--bench`, which `cargo bench` passes, is ignored.
fn parse_args(mut argv: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut args = Args {
        endpoint: Endpoint::Tcp(([127, 0, 0, 1], 7100).into()),
        connections: 1,
        pipeline: 1,
        requests: 100_000,
        rule: "bench".to_string(),
        keys: 1,
        raw: false,
        redis: false,
        poll: false,
        batch: false,
        op: LoadOp::Incr,
        region: None,
        certs: None,
        node: 2,
        region_node: 1,
        window_secs: 3_600,
        fsync_probe: None,
    };
    while let Some(flag) = argv.next() {
        if flag == "--bench" {
            continue;
        }
        let mut value = || argv.next().ok_or(format!("{flag}: a value is missing"));
        match flag.as_str() {
            "--endpoint" => {
                args.endpoint = value()?.parse().map_err(|err| format!("{err}"))?;
            }
            "--connections" => args.connections = positive(&flag, &value()?)? as usize,
            "--pipeline" => args.pipeline = positive(&flag, &value()?)? as usize,
            "--requests" => args.requests = positive(&flag, &value()?)?,
            "--rule" => args.rule = value()?,
            "--keys" => args.keys = positive(&flag, &value()?)?,
            "--raw" => args.raw = true,
            "--redis" => args.redis = true,
            "--poll" => args.poll = true,
            "--batch" => args.batch = true,
            "--op" => {
                args.op = match value()?.as_str() {
                    "incr" => LoadOp::Incr,
                    "incr-id" => LoadOp::IncrWithId,
                    "check" => LoadOp::Check,
                    other => {
                        return Err(format!("--op: {other:?} is none of incr, incr-id, check"))
                    }
                }
            }
            "--region" => {
                let text = value()?;
                args.region = Some(
                    text.parse()
                        .map_err(|err| format!("--region: {text:?}: {err}"))?,
                );
            }
            "--certs" => args.certs = Some(value()?.into()),
            "--node" => args.node = positive(&flag, &value()?)?,
            "--region-node" => args.region_node = positive(&flag, &value()?)?,
            "--window-secs" => {
                let text = value()?;
                args.window_secs = u32::try_from(positive(&flag, &text)?)
                    .map_err(|_| format!("{flag}: {text:?} is too large"))?;
            }
            "--fsync-probe" => args.fsync_probe = Some(value()?.into()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if args.redis && !args.raw {
        return Err("--redis goes with --raw".into());
    }
    if args.poll && !args.raw {
        return Err("--poll goes with --raw".into());
    }
    if args.raw && args.op != LoadOp::Incr {
        return Err("--raw sends incr only; --op check and incr-id need tally-client".into());
    }
    if args.region.is_some() && args.op == LoadOp::IncrWithId {
        return Err("--region sends exact checks; --op incr-id goes to a sidecar".into());
    }
    if args.batch && (args.raw || args.region.is_some()) {
        return Err("--batch drives tally-client; --raw and --region do not use it".into());
    }
    if args.region.is_some() && args.raw {
        return Err("--region and --raw do not go together".into());
    }
    if args.region.is_some() && args.node == args.region_node {
        return Err(format!(
            "--node {} is the region's own id (--region-node)",
            args.node
        ));
    }
    Ok(args)
}

fn positive(flag: &str, text: &str) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{flag}: {text:?} is not a positive whole number")),
    }
}
