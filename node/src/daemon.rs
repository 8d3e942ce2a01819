//! Starting a node: what can refuse the start (TLS, the rules, a region's ledger), the
//! data directory's lock and the listening sockets, the data directory and generation,
//! QUIC, the gossip task, the client listener and the HTTP endpoints, in that order; and
//! stopping it.

use crate::clock::{self, Clock, ExpiryClock};
use crate::config::{Config, Role};
use crate::decide::Rules;
use crate::driver::{Collecting, Driver, DriverError};
use crate::ended::EndedLives;
use crate::exact_room::ExactRoom;
use crate::expiry_mark::{self, ExpiryMark};
use crate::handoff::Handoff;
use crate::http::{self, Endpoints};
use crate::lanelog::{self, LogError};
use crate::listener::{self, Service};
use crate::metrics::{Metrics, RegionStats};
use crate::recent::RecentIds;
use crate::refused_sums::RefusedSums;
use crate::region::forward::{ForwardStats, Forwarder};
use crate::region::service::{Caps, LedgerError, OpenError, RegionService};
use crate::region::wire::REGION_FRAME_BYTES_MAX;
use crate::store::LaneStore;
use crate::tasks;
use crate::tls::{self, TlsError};
use crate::transport::{Sessions, Transport, TransportStats};
use crate::view::{seed_nodes, unheard_seeds, View};
use std::future::Future;
use std::sync::{Arc, Mutex};
use tally_crdt::{CounterMap, Generation, KeyError, NodeId, ReplicaId};
use tally_gossip::Gossip;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;

/// A node whose certificate ends within this many days says so at start.
const CERT_WARN_DAYS: i64 = 30;

/// How long a stopping region waits for the decisions it made to be durable and counted
/// in its lanes before its last push goes without them (its next start repairs them).
const REGION_DRAIN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(1);

/// Why a node could not start, or stopped on its own.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The data directory could not be used.
    #[error(transparent)]
    Log(#[from] LogError),
    /// The certificates could not be used.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A rule name does not make a key.
    #[error("config: rules: {0}")]
    Rule(#[from] KeyError),
    /// A listening address could not be bound.
    #[error("bind {what} {addr}: {source}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: String,
        /// What failed.
        source: std::io::Error,
    },
    /// A region's ledger is missing, or is there for a start that asked for a new one.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The region log could not be opened.
    #[error(transparent)]
    Region(#[from] OpenError),
    /// The gossip task stopped on a fatal event.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// An operator forgot this life elsewhere (`DELETE /members/<node>` at a node that
    /// held it dead), so the cluster no longer counted what it admitted: it stopped as
    /// when asked to, handing its acknowledged writes to its peers.
    #[error("node {me} generation {generation} was forgotten by the cluster (node {by}'s table holds it gone); it stopped: start it again to rejoin as a member under a new generation")]
    Forgotten {
        /// This node.
        me: u64,
        /// The life forgotten.
        generation: u64,
        /// The peer whose table said so.
        by: u64,
    },
    /// One of the node's long-lived tasks ended while the node ran ([`tasks`]); the node
    /// stopped, as it does when asked to.
    #[error("the {0} task ended while the node ran (a panic, if it was one, is printed above); the node stopped")]
    TaskEnded(&'static str),
}

impl DaemonError {
    /// The config key whose value this failure to start is about, if one is: a TLS
    /// file that cannot be used, a data directory, an address or a socket that cannot be
    /// bound, a rule's name. `None` for a node that stopped on its own.
    pub fn key(&self) -> Option<&'static str> {
        match self {
            DaemonError::Tls(TlsError::File { key, .. }) => Some(key),
            DaemonError::Tls(TlsError::WrongNode { .. } | TlsError::NotValidNow { .. }) => {
                Some("tls.cert")
            }
            DaemonError::Tls(TlsError::NotFromCa { .. } | TlsError::Config(_)) => Some("tls"),
            DaemonError::Log(_) | DaemonError::Ledger(_) | DaemonError::Region(_) => {
                Some("data_dir")
            }
            DaemonError::Rule(_) => Some("rules"),
            DaemonError::Bind { what, .. } => Some(match *what {
                "client" => "listen_client",
                "client socket" => "client_socket",
                "http" => "listen_http",
                _ => "listen_gossip",
            }),
            DaemonError::Driver(_) | DaemonError::Forgotten { .. } | DaemonError::TaskEnded(_) => {
                None
            }
        }
    }
}

/// When the gossip task collects written lanes. Without a data dir, just before the push
/// that carries them ([`Collecting::AtPush`]): a write waits for one push batch, and a
/// node under steady writes collects once a push interval, where a collection tick fired
/// a thousand times a second. With one, each collection is followed
/// by a sync of the lane log (`handoff`) before its lanes reach the gossip, so they are
/// collected ahead of the push, twice per push interval: a sync per millisecond cost a
/// fifth of the sidecar's pipelined throughput (BENCHMARKS.md, runs 33 to 36), and a write
/// may wait up to half a push interval more.
fn collecting(data_dir: bool, push_interval: std::time::Duration) -> Collecting {
    if data_dir {
        Collecting::Every(std::time::Duration::from_millis(1).max(push_interval / 2))
    } else {
        Collecting::AtPush
    }
}

/// How many operators' requests to forget members may wait for the gossip task at once;
/// more are answered busy.
const FORGET_REQUESTS_MAX: usize = 8;

/// Runs a node until `shutdown` completes, then leaves the cluster gracefully.
///
/// Must run on a current-thread runtime: the client listener relies on the gossip task
/// not running between a write and its log flush (see `listener`).
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), DaemonError> {
    assert_eq!(
        tokio::runtime::Handle::current().runtime_flavor(),
        tokio::runtime::RuntimeFlavor::CurrentThread,
        "tallyd runs on a current-thread runtime"
    );
    let clock = Clock::start();
    let now = clock.now();
    let node = config.node();
    // What can refuse the start comes before the data dir is claimed, so that a refused
    // start (another node's certificate, a bad rule, an address in use) leaves the dir as
    // it was, not named for this node id nor given a new life, nor a region's new ledger
    // made. Its lock comes before the binds, so that a second process on the same config
    // is told the directory is in use. The gossip socket is bound here too; its endpoint,
    // which needs the region's sessions and so the dir, is made on it after (until
    // session 44 the bind came after, and a region's first start refused on its gossip
    // address left a ledger that refused `--new-ledger` again: found in review).
    let identity = tls::identity(&config.tls, node)?;
    let certificate_expires = identity.expires_unix_secs;
    let days_left = (certificate_expires - (now.wall.0 / 1_000) as i64) / 86_400;
    if days_left < CERT_WARN_DAYS {
        log_line!(
            "tallyd: warning: {} expires in {days_left} days; issue a new one with `tally certs` \
             (peers refuse an expired certificate)",
            config.tls.cert.display()
        );
    }
    let rules = Rules::new(&config.rules)?;
    if let (Role::Region, Some(dir)) = (config.role, &config.data_dir) {
        RegionService::check_ledger(dir, config.new_ledger)?;
    }
    let dir_lock = config.data_dir.as_deref().map(lanelog::lock).transpose()?;
    let bind =
        |what: &'static str, addr: String| move |source| DaemonError::Bind { what, addr, source };
    let tcp = TcpListener::bind(config.listen_client)
        .await
        .map_err(bind("client", config.listen_client.to_string()))?;
    let unix = match &config.client_socket {
        Some(path) => {
            // A socket file left by an earlier life would make the bind fail. Anything
            // else at the path (a file, or a socket another process serves) is left, and
            // the bind fails naming it.
            if is_stale_socket(path) {
                let _ = std::fs::remove_file(path);
            }
            Some(
                UnixListener::bind(path)
                    .map_err(bind("client socket", path.display().to_string()))?,
            )
        }
        None => None,
    };
    let http_listener = TcpListener::bind(config.listen_http)
        .await
        .map_err(bind("http", config.listen_http.to_string()))?;
    let gossip_socket = std::net::UdpSocket::bind(config.listen_gossip)
        .map_err(bind("gossip", config.listen_gossip.to_string()))?;
    // Where they were bound: a configured port 0 takes one the system picks.
    let bound = |listener: &TcpListener, configured| listener.local_addr().unwrap_or(configured);
    let (client_addr, http_addr) = (
        bound(&tcp, config.listen_client),
        bound(&http_listener, config.listen_http),
    );

    // Windows end by the paced wall clock, resumed from the last life's reading: a start
    // with the clock stepped ahead ends no window early (`expiry_mark`).
    let mut expiry = ExpiryClock::resume(clock, None);
    let (log, recovered) = match &config.data_dir {
        Some(dir) => {
            let mark = expiry_mark::read(dir)?;
            let resumed = mark.map(|mark| mark.resumed(clock::boot().as_ref()));
            expiry = ExpiryClock::resume(clock, resumed);
            // Waits, blocking, before the generation is written, until the wall clock
            // passes it (`Recovered::wait_ms`: at most about a second, at a million
            // lanes, and nothing is served meanwhile).
            let wait = std::thread::sleep;
            let (log, recovered) = lanelog::open(dir, node, now.wall.0, expiry.now_secs(), wait)?;
            // Held until the process exits, not dropped with the node at shutdown, so that
            // no second process takes the directory while this one still runs at all.
            std::mem::forget(dir_lock);
            (Some(Arc::new(Mutex::new(log))), recovered)
        }
        None => (
            None,
            lanelog::Recovered {
                generation: Generation(now.wall.0),
                retired: Vec::new(),
                answered: Vec::new(),
                torn: 0,
                wait_ms: 0,
            },
        ),
    };
    let replica = ReplicaId::new(node, recovered.generation);
    log_line!(
        "tallyd: node {} generation {} starting; {} earlier lives recovered, {} torn log tails, \
         {} ms waited for the wall clock to pass the generation",
        node.0,
        replica.generation.0,
        recovered.retired.len(),
        recovered.torn,
        recovered.wait_ms
    );

    // Earlier lives' logged lanes, re-published above any version a peer may hold.
    // Peers' lanes may add keys only up to the same cap as the lane store's, and claim no
    // more than the configured rate over their window. Keys come from clients and peers,
    // so the map's hash table is keyed by a seed they cannot learn.
    let mut map = CounterMap::new()
        .with_hash_seed(clock::entropy_seed())
        .with_keys_max(config.keys_max)
        .with_lane_rate_max(config.lane_rate_max_per_sec);
    // Re-published above this generation in microseconds: a peer that holds a retired
    // life's state that high holds all it admitted, and no longer counts it as a life that
    // ended unheard (`ViewState::take_ended`). Stamped after this life's generation too
    // (`lanelog::open` waited for the wall clock to pass it, unless it was stepped back).
    let republished_at = clock.now().wall;
    for (retired, lanes) in &recovered.retired {
        map.raise_version(*retired, recovered.republish_floor());
        for (key, lane) in lanes {
            map.write(*retired, key, *lane, republished_at);
        }
    }

    let transport_stats = Arc::new(TransportStats::default());
    let store = Arc::new(LaneStore::new(replica, config.keys_max));
    let refused_sums = Arc::new(RefusedSums::default());
    // The region decides forwarded exact checks on its durable ledger.
    let (region, sessions) = match (config.role, &config.data_dir) {
        (Role::Region, Some(dir)) => {
            let caps = Caps {
                keys: config.keys_max,
                sessions: config.check_id_sessions_max(),
            };
            let (service, opened) = RegionService::open(
                dir,
                caps,
                rules.clone(),
                store.clone(),
                log.clone(),
                &recovered.retired,
                expiry,
            )?;
            log_line!(
                "tallyd: region log: {} entries replayed, {} torn bytes dropped, compacted \
                 to its live windows; {} admissions repaired into the region's lanes; {} \
                 owed until its lane log has room",
                opened.entries,
                opened.torn,
                opened.repaired,
                opened.owed
            );
            let (frames, receiver) = tokio::sync::mpsc::channel(1_024);
            let sessions = Sessions {
                frames,
                frame_bytes_max: REGION_FRAME_BYTES_MAX,
            };
            (Some((service, receiver)), Some(sessions))
        }
        _ => (None, None),
    };
    let region_stats = region.as_ref().map(|(service, _)| RegionStats {
        commit: service.commit_stats(),
        bad_requests: service.bad_requests.clone(),
        keys_refused: service.keys_refused.clone(),
        sessions_refused: service.sessions_refused.clone(),
        lanes_owed: service.lanes_owed(),
        lanes_refused: service.lanes_refused(),
    });
    // The region node's own exact checks go to its region task as the edges' do.
    let own_sessions = sessions.clone();
    let (transport, inbound) = Transport::on_socket(
        gossip_socket,
        identity,
        config.frame_bytes_max,
        transport_stats.clone(),
        sessions,
    )
    .map_err(bind("gossip", config.listen_gossip.to_string()))?;
    let gossip_addr = transport
        .local_addr()
        .map_err(bind("gossip", config.listen_gossip.to_string()))?;

    let mut gossip_config = tally_gossip::Config::new(replica, gossip_addr.to_string());
    gossip_config.seeds = config.gossip_seeds();
    gossip_config.gossip_interval = config.gossip_interval();
    gossip_config.push_interval = config.push_interval();
    gossip_config.fanout = config.fanout;
    gossip_config.frame_bytes_max = config.frame_bytes_max;
    gossip_config.dead_after = std::time::Duration::from_millis(config.dead_after_ms);
    gossip_config.rng_seed = clock::entropy_seed();

    // The node's long-lived tasks: the first to end stops the node.
    let (watcher, mut ended) = tasks::watch();
    let forward_stats = Arc::new(ForwardStats::default());
    let (late, mut late_admitted) = tokio::sync::mpsc::unbounded_channel();
    let forwarder = match (own_sessions, &config.region) {
        (Some(sessions), _) => Some(Forwarder::local(
            sessions,
            replica,
            clock,
            forward_stats.clone(),
            late,
        )),
        (None, Some(region)) => Some(Forwarder::new(
            transport.requester(),
            NodeId(region.node),
            region.addr.to_string(),
            replica,
            clock,
            forward_stats.clone(),
            late,
        )),
        (None, None) => None,
    };
    let view = Arc::new(View::default());
    // A life that ended unheard may have admitted in a window as long as the longest
    // rule's, weighed again in the window after by a sliding rule.
    let longest_window = (config.rules.iter()).map(|rule| rule.window_secs).max();
    view.lock().ended = EndedLives::kept_for(std::time::Duration::from_secs(
        2 * u64::from(longest_window.unwrap_or(0)),
    ));
    view.lock().seeds = seed_nodes(&gossip_config.seeds);
    // Before the gossip task's first refresh: no check is decided alone meanwhile.
    view.lock().unheard_seeds = unheard_seeds(
        &gossip_config.seeds,
        false,
        std::time::Duration::ZERO,
        gossip_config.dead_after,
        |_| false,
    );
    let metrics = Arc::new(Metrics::default());
    metrics
        .certificate_expires_unix_secs
        .store(certificate_expires, std::sync::atomic::Ordering::Relaxed);
    let (stop, stopped) = watch::channel(false);
    let (forget, forget_requests) = tokio::sync::mpsc::channel(FORGET_REQUESTS_MAX);
    let (forgotten, mut forgotten_by) = tokio::sync::oneshot::channel();
    let mut driver = Driver {
        gossip: Gossip::with_state(gossip_config, map)
            .with_republished(recovered.retired.iter().map(|(life, _)| *life))
            .with_expiry(expiry.paced()),
        transport,
        inbound,
        store: store.clone(),
        refused_sums: refused_sums.clone(),
        view: view.clone(),
        metrics: metrics.clone(),
        clock,
        expiry,
        expiry_mark: config.data_dir.clone().map(ExpiryMark::new),
        collecting: collecting(log.is_some(), config.push_interval()),
        handoff: Handoff::new(log.clone()),
        shutdown: stopped,
        forget: forget_requests,
        forgotten: Some(forgotten),
    };

    let exact_room = Arc::new(ExactRoom::default());
    let service = Arc::new(Service {
        store: store.clone(),
        refused_sums,
        view: view.clone(),
        rules,
        log,
        metrics: metrics.clone(),
        replica,
        forwarder,
        lane_rate_max: config.lane_rate_max_per_sec,
        exact_in_flight_max: crate::listener::EXACT_IN_FLIGHT_MAX,
        exact_room: exact_room.clone(),
        closing: std::sync::atomic::AtomicBool::new(false),
        // A retry sent to this life of an id an earlier one answered gets that answer.
        recent: std::sync::Mutex::new(RecentIds::remembering(
            recovered.answered,
            expiry.now_secs(),
        )),
        waiting: Arc::default(),
        late: std::sync::Mutex::default(),
        expiry: std::sync::Mutex::new(expiry),
        clock,
    });
    let endpoints = Arc::new(Endpoints {
        replica,
        metrics,
        view,
        store,
        transport: transport_stats,
        forward: forward_stats,
        exact_room,
        region: region_stats,
        forget,
    });
    driver.publish_restored();
    let client_task = watcher.spawn(
        "client listener",
        listener::serve(service.clone(), tcp, unix, config.client_connections_max),
    );
    let http_task = watcher.spawn("http", http::serve(endpoints, http_listener));
    // The fallbacks counted for exact checks the region admitted after all, taken back.
    // The forwarder's session task holds the only sender, so this task ends when that one
    // does, which it so watches too; a node without a forwarder has neither.
    let late_task = service.forwarder.is_some().then(|| {
        let service = service.clone();
        watcher.spawn("region forwarder", async move {
            while let Some(seqs) = late_admitted.recv().await {
                service.late_admissions(&seqs);
            }
        })
    });
    let (region_stop, region_stopped) = watch::channel(false);
    let mut region_task = region.map(|(service, requests)| {
        let serving = service.serve(requests, region_stopped, watcher.clone());
        watcher.spawn("region", serving)
    });
    log_line!(
        "tallyd: node {} serving: gossip {gossip_addr}, client {client_addr}, http {http_addr}",
        node.0
    );

    let mut driver_task = tokio::spawn(driver.run());
    tokio::pin!(shutdown);
    // The node stops when its gossip task ends, when it is asked to, when it was
    // forgotten, or when another of its tasks ends.
    let mut task_ended = None;
    let mut forgotten = None;
    let driver_ended = tokio::select! {
        result = &mut driver_task => Some(result),
        () = &mut shutdown => None,
        Ok(by) = &mut forgotten_by => {
            log_line!("tallyd: node {}'s table holds this life as forgotten; stopping", by.0);
            forgotten = Some(by);
            None
        }
        task = ended.first() => {
            log_line!("tallyd: the {task} task ended while the node ran; stopping");
            task_ended = Some(task);
            None
        }
    };
    let result = match driver_ended {
        Some(result) => result,
        None => {
            // Stop answering first, and on the region stop deciding and count what it
            // decided in its lanes, so the driver's last push carries every acknowledged
            // write and admission; then leave.
            service
                .closing
                .store(true, std::sync::atomic::Ordering::Relaxed);
            client_task.abort();
            if let Some(task) = region_task.as_mut() {
                let _ = region_stop.send(true);
                if tokio::time::timeout(REGION_DRAIN_DEADLINE, task)
                    .await
                    .is_ok()
                {
                    // Done, and its output taken: not to be awaited again below.
                    region_task = None;
                }
            }
            let _ = stop.send(true);
            driver_task.await
        }
    };
    client_task.abort();
    http_task.abort();
    if let Some(late_task) = late_task {
        late_task.abort();
    }
    if let Some(region_task) = region_task {
        // Dropped here, while the runtime runs, so that the service goes to a blocking
        // thread (`RegionService::serve`) rather than be dropped with the runtime.
        region_task.abort();
        let _ = region_task.await;
    }
    match (result, forgotten) {
        (Ok(Err(driver)), _) => Err(DaemonError::from(driver)),
        (Ok(Ok(())), Some(by)) => Err(DaemonError::Forgotten {
            me: replica.node.0,
            generation: replica.generation.0,
            by: by.0,
        }),
        (Ok(Ok(())), None) => task_ended.map_or(Ok(()), |task| Err(DaemonError::TaskEnded(task))),
        (Err(join), _) => std::panic::resume_unwind(join.into_panic()),
    }
}

/// Whether `path` is a Unix socket that no process serves: one an earlier life left. Only
/// a refused connection says so; any other error (no permission, another kind of socket)
/// leaves the path alone.
fn is_stale_socket(path: &std::path::Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|meta| meta.file_type().is_socket());
    is_socket
        && std::os::unix::net::UnixStream::connect(path)
            .is_err_and(|err| err.kind() == std::io::ErrorKind::ConnectionRefused)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(tally_loom))]
    use crate::region::service::LOG_FILE;

    /// A node's config in `dir` (which holds node 3's certificates), on ports the system
    /// picks but for `client`, its data dir `dir/data`; `extra` comes first.
    #[cfg(not(tally_loom))]
    fn config_in(dir: &std::path::Path, extra: &str, node: u64, client: &str) -> Config {
        let text = format!(
            "{extra}node_id = {node}\n\
             listen_gossip = \"127.0.0.1:0\"\n\
             listen_client = \"{client}\"\n\
             listen_http = \"127.0.0.1:0\"\n\
             data_dir = {data:?}\n\
             tls = {{ ca = {ca:?}, cert = {cert:?}, key = {key:?} }}\n",
            data = dir.join("data"),
            ca = dir.join("ca.pem"),
            cert = dir.join("node-3.pem"),
            key = dir.join("node-3.key"),
        );
        Config::parse(&text, &dir.join("node.toml")).unwrap()
    }

    /// Runs a node until it has started and stopped again, or was refused.
    // A start builds the lane store, whose atomics are loom's under `tally_loom`.
    #[cfg(not(tally_loom))]
    fn start(config: Config) -> Result<(), DaemonError> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(run(config, std::future::ready(())))
    }

    /// A start refused for another node's certificate, or for a client address in use,
    /// leaves its data dir unclaimed: the same dir then starts as the node it is given to.
    #[test]
    #[cfg(not(tally_loom))]
    fn a_refused_start_leaves_its_data_dir_unclaimed() {
        let dir = std::env::temp_dir().join(format!("tally-refused-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        crate::certs::write_cluster(&dir, &[NodeId(3)]).unwrap();
        let data = dir.join("data");
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let config = |node: u64, client: &str| config_in(&dir, "", node, client);
        let refused = start(config(4, "127.0.0.1:0"));
        assert!(matches!(refused, Err(DaemonError::Tls(_))), "{refused:?}");
        let key = |refused: &Result<(), DaemonError>| refused.as_ref().unwrap_err().key();
        assert_eq!(key(&refused), Some("tls.cert"));
        assert!(!data.join("node").exists(), "claimed for node 4");
        let in_use = taken.local_addr().unwrap().to_string();
        let refused = start(config(3, &in_use));
        assert!(
            matches!(refused, Err(DaemonError::Bind { what: "client", .. })),
            "{refused:?}"
        );
        assert_eq!(key(&refused), Some("listen_client"));
        assert!(
            !data.join("node").exists(),
            "claimed by a start that failed to bind"
        );
        let started = start(config(3, "127.0.0.1:0"));
        assert!(started.is_ok(), "{started:?}");
        assert_eq!(
            std::fs::read_to_string(data.join("node")).unwrap().trim(),
            "3"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A certificate file given under two keys (the CA's as the node's, a copy-paste slip)
    /// is refused naming the key whose use of it failed, not the first key that names the
    /// file (found in a walk through README, session 49: it said `tls.ca`).
    #[test]
    #[cfg(not(tally_loom))]
    fn a_ca_certificate_given_as_the_nodes_is_refused_naming_tls_cert() {
        let dir = std::env::temp_dir().join(format!("tally-cert-is-ca-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        crate::certs::write_cluster(&dir, &[NodeId(3)]).unwrap();
        let mut config = config_in(&dir, "", 3, "127.0.0.1:0");
        config.tls.cert = config.tls.ca.clone();
        let refused = start(config);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(refused, Err(DaemonError::Tls(_))), "{refused:?}");
        assert_eq!(refused.unwrap_err().key(), Some("tls.cert"));
    }

    /// A region starts only on the ledger an earlier start made, and `--new-ledger` only
    /// where none is; a refused start leaves its data dir as it was.
    #[test]
    #[cfg(not(tally_loom))]
    fn a_region_starts_on_its_ledger_and_a_new_ledger_only_where_none_is() {
        let dir = std::env::temp_dir().join(format!("tally-ledger-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        crate::certs::write_cluster(&dir, &[NodeId(3)]).unwrap();
        let (data, ledger) = (dir.join("data"), dir.join("data").join(LOG_FILE));
        let region = |new_ledger: bool| Config {
            new_ledger,
            ..config_in(&dir, "role = \"region\"\n", 3, "127.0.0.1:0")
        };

        let refused = start(region(false));
        assert!(
            matches!(&refused, Err(DaemonError::Ledger(LedgerError::Missing { path })) if *path == ledger),
            "{refused:?}"
        );
        let key = refused.as_ref().unwrap_err().key();
        assert_eq!(key, Some("data_dir"));
        assert!(!data.exists(), "a refused start made its data dir");
        let message = refused.unwrap_err().to_string();
        assert!(message.contains("--new-ledger"), "{message}");

        // A first start refused on its gossip address makes no ledger: it can be run again.
        let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let refused = start(Config {
            listen_gossip: taken.local_addr().unwrap(),
            ..region(true)
        });
        assert!(
            matches!(refused, Err(DaemonError::Bind { what: "gossip", .. })),
            "{refused:?}"
        );
        assert!(
            !ledger.exists(),
            "a start refused on its gossip address made its ledger"
        );
        start(region(true)).unwrap();
        let made = std::fs::read(&ledger).expect("the first start made its ledger");
        let refused = start(region(true));
        assert!(
            matches!(&refused, Err(DaemonError::Ledger(LedgerError::Exists { path })) if *path == ledger),
            "{refused:?}"
        );
        assert_eq!(
            std::fs::read(&ledger).unwrap(),
            made,
            "a refused start changed it"
        );
        // A second start in this process would find the dir locked (its lock is held until
        // the process exits); the e2e region tests restart a region on its ledger.
        RegionService::check_ledger(&data, false).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_a_socket_no_process_serves_is_taken_for_an_earlier_lifes() {
        let dir = std::env::temp_dir().join(format!("tally-socket-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("node");
        std::fs::write(&file, "1").unwrap();
        assert!(!is_stale_socket(&file), "a file is not a socket");
        assert!(!is_stale_socket(&dir.join("none")));
        let path = dir.join("client.sock");
        let served = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert!(!is_stale_socket(&path), "another process serves it");
        drop(served);
        assert!(is_stale_socket(&path), "left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
