//! The node's metrics: live counters kept here, the rest read from the gossip view, the
//! lane store and the transport at scrape time, and encoded in the Prometheus text format
//! by `prometheus-client`.

use crate::exact_room::ExactRoom;
use crate::region::committer::CommitStats;
use crate::region::forward::ForwardStats;
use crate::store::LaneStore;
use crate::transport::TransportStats;
use crate::view::View;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tally_client::wire::{Decision, Mode};
use tally_crdt::{ReplicaId, Stamp};
use tally_gossip::membership::State;
use tally_gossip::Histogram;

/// Counters the request path updates as it goes.
#[derive(Debug, Default)]
pub struct Metrics {
    // By mode (in `MODES` order), then denied and allowed.
    decisions: [[AtomicU64; 2]; MODES.len()],
    // Approximate decisions' bounds over their rules' limits.
    bound_ratios: RatioHistogram,
    // Approximate decisions whose bound was infinite (a member not heard from yet).
    decisions_unbounded: AtomicU64,
    /// Writes and gossiped keys refused because the store held `keys_max` keys (local or
    /// remote keys).
    pub keys_refused: AtomicU64,
    /// Client frames that did not decode; their connections were closed.
    pub client_frames_bad: AtomicU64,
    /// Client connections refused at `client_connections_max`.
    pub client_connections_refused: AtomicU64,
    /// Requests answered, refusals included.
    pub client_requests: AtomicU64,
    /// Requests sent again under a check id and answered from this sidecar's memory.
    pub client_ids_answered_again: AtomicU64,
    /// Syncs of the lane log that made collected own lanes durable before their gossip.
    pub lane_log_syncs: AtomicU64,
    /// Writes refused because the lane log refused their record (no room, or it failed).
    pub lane_log_refused: AtomicU64,
    /// Fallbacks' counts taken back because the region admitted their checks after all.
    pub fallbacks_taken_back: AtomicU64,
    /// When this node's own certificate stops being valid, in unix seconds: its open
    /// connections are closed then, and peers refuse its handshakes after.
    pub certificate_expires_unix_secs: AtomicI64,
}

/// Bucket bounds of the latency histograms, in microseconds.
pub const LATENCY_BOUNDS_US: [u64; 12] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
];

/// Durations counted by bucket of [`LATENCY_BOUNDS_US`] (the last one past every bound),
/// with their sum: one Prometheus histogram, in seconds.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    counts: [AtomicU64; LATENCY_BOUNDS_US.len() + 1],
    sum_us: AtomicU64,
}

impl LatencyHistogram {
    /// Counts one duration.
    pub fn record(&self, elapsed: Duration) {
        let micros = elapsed.as_micros() as u64;
        let bucket = LATENCY_BOUNDS_US
            .iter()
            .position(|bound| micros <= *bound)
            .unwrap_or(LATENCY_BOUNDS_US.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(micros, Ordering::Relaxed);
    }

    /// How many durations were counted.
    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.counts.iter().map(load).sum()
    }
}

/// Bucket bounds of `tally_decision_bound_ratio`: an approximate decision's bound (the
/// overshoot it may be part of) over its rule's limit.
pub const BOUND_RATIO_BOUNDS: [f64; 8] = [0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0];

/// Ratios counted by bucket of [`BOUND_RATIO_BOUNDS`] (the last one past every bound),
/// with their sum in millionths: one Prometheus histogram.
#[derive(Debug, Default)]
struct RatioHistogram {
    counts: [AtomicU64; BOUND_RATIO_BOUNDS.len() + 1],
    sum_millionths: AtomicU64,
}

impl RatioHistogram {
    /// Counts one finite ratio, at least 0.
    fn record(&self, ratio: f64) {
        let bucket = BOUND_RATIO_BOUNDS
            .iter()
            .position(|bound| ratio <= *bound)
            .unwrap_or(BOUND_RATIO_BOUNDS.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        // A float-to-integer `as` saturates: a ratio past 1.8e13 adds its most. The sum
        // saturates too, so that it never falls, which a scraper reads as a reset (found in
        // review, session 47: at a rule's limit of 1 a few hundred isolated decisions
        // wrapped it).
        let millionths = (ratio * 1e6).round() as u64;
        let _ = (self.sum_millionths).fetch_update(Ordering::Relaxed, Ordering::Relaxed, |sum| {
            Some(sum.saturating_add(millionths))
        });
    }
}

impl Metrics {
    /// Counts one decision, and an approximate one's bound over its rule's limit: what
    /// operators watch the accuracy by (BRIEF.md, "staleness and accuracy").
    pub fn decided(&self, decision: &Decision) {
        self.decisions[mode_index(decision.mode)][usize::from(decision.allowed)]
            .fetch_add(1, Ordering::Relaxed);
        if !decision.mode.is_approximate() {
            return;
        }
        if decision.bound.is_finite() {
            // A limit is at least 1 (`config.rs`).
            self.bound_ratios
                .record(decision.bound.max(0.0) / decision.limit.max(1) as f64);
        } else {
            self.decisions_unbounded.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Where `Metrics` counts a mode's decisions: its place in `MODES`.
///
/// # Panics
///
/// For a mode missing from `MODES`: `Mode` is `#[non_exhaustive]`, so a mode added to the
/// client protocol is not a compile error here, and this node decides only those it
/// lists (`decisions_are_counted_by_mode_and_outcome_and_only_those_seen_are_shown`).
fn mode_index(mode: Mode) -> usize {
    MODES
        .iter()
        .position(|listed| *listed == mode)
        .expect("invariant: MODES lists every mode this node decides")
}

/// Every decision mode, in the order `Metrics` counts them.
const MODES: [Mode; 4] = [
    Mode::ApproximateConnected,
    Mode::ApproximateIsolated,
    Mode::Exact,
    Mode::RegionFallback,
];

/// What a scrape reads.
pub struct Sources<'a> {
    /// The live counters.
    pub metrics: &'a Metrics,
    /// The gossip view.
    pub view: &'a View,
    /// The lane store.
    pub store: &'a LaneStore,
    /// The transport's counters.
    pub transport: &'a TransportStats,
    /// The exact path's counters at this edge.
    pub forward: &'a ForwardStats,
    /// The room for exact checks waiting for the region.
    pub exact_room: &'a ExactRoom,
    /// The region log's counters, on the region node.
    pub region: Option<&'a RegionStats>,
    /// The wall clock now.
    pub now: Stamp,
}

/// The region node's counters.
#[derive(Debug, Default)]
pub struct RegionStats {
    /// The committer's.
    pub commit: Arc<CommitStats>,
    /// Forwarded checks refused as malformed or for no exact rule.
    pub bad_requests: Arc<AtomicU64>,
    /// Forwarded checks not decided because the ledger holds its maximum of keys.
    pub keys_refused: Arc<AtomicU64>,
    /// Forwarded checks not decided because the ledger holds its maximum of application
    /// sessions.
    pub sessions_refused: Arc<AtomicU64>,
    /// Admitted costs the region's own lanes lack for want of room in the lane log.
    pub lanes_owed: Arc<AtomicU64>,
    /// Admitted costs the region's own lanes never count: the lane store's key cap refused
    /// them.
    pub lanes_refused: Arc<AtomicU64>,
}

/// Renders every metric in the Prometheus text format.
pub fn render(sources: &Sources<'_>) -> String {
    let mut registry = Registry::with_prefix("tally");
    let view = sources.view.lock().reported();

    let staleness = Family::<Vec<(String, String)>, Gauge<f64, AtomicU64>>::default();
    for (node, replica, state) in view.members() {
        if *state == State::Left {
            // A member that left says nothing more; a series for each would grow forever.
            continue;
        }
        let age = view.staleness_of(*replica, sources.now).as_secs_f64();
        staleness
            .get_or_create(&origin_labels(node.0, *replica, &format!("{state:?}")))
            .set(age);
    }
    // A seed with no row, while decisions count it (as a live member with no state held,
    // or past `dead_after_ms` as one declared dead), is as stale as a member never heard:
    // the seconds since the epoch. It has no generation known yet: 0.
    let seed_state = match view.unheard_seeds {
        seeds if seeds.live > 0 => Some("unheard_seed"),
        seeds if seeds.dead > 0 => Some("dead_seed"),
        _ => None,
    };
    if let Some(state) = seed_state {
        let never = Duration::from_millis(sources.now.0).as_secs_f64();
        let rowless = (view.seeds.iter())
            .filter(|seed| !view.members().iter().any(|(node, _, _)| node == *seed));
        for seed in rowless {
            let unknown = ReplicaId::new(*seed, tally_crdt::Generation(0));
            staleness
                .get_or_create(&origin_labels(seed.0, unknown, state))
                .set(never);
        }
    }
    registry.register(
        "origin_staleness_seconds",
        "How old the newest state held from each member's current replica is (the epoch \
         for one never heard, and for a seed counted with no row: unheard_seed, dead_seed)",
        staleness,
    );
    registry.register(
        "propagation_delay_seconds",
        "Delay from an origin's write to its arrival here",
        Buckets(view.gossip.propagation.clone()),
    );
    let members = Family::<Vec<(String, String)>, Gauge>::default();
    for (state, count) in view.members_by_state() {
        let state = format!("{state:?}").to_lowercase();
        members
            .get_or_create(&vec![("state".to_owned(), state)])
            .set(count as i64);
    }
    let seeds = view.unheard_seeds;
    for (state, count) in [("unheard_seed", seeds.live), ("dead_seed", seeds.dead)] {
        members
            .get_or_create(&vec![("state".to_owned(), state.to_owned())])
            .set(count as i64);
    }
    registry.register("members", "Other members by state", members);
    let ended = Gauge::<i64>::default();
    ended.set(view.lives_ended_unheard() as i64);
    registry.register(
        "lives_ended_unheard",
        "Lives of members a later life replaced while unheard, counted in every bound of \
         the windows they may have admitted in",
        ended,
    );

    let gossip = &view.gossip;
    let pairs = [
        (
            "gossip_frames_in",
            "Gossip frames received",
            gossip.frames_in,
        ),
        ("gossip_frames_out", "Gossip frames sent", gossip.frames_out),
        ("gossip_bytes_in", "Gossip bytes received", gossip.bytes_in),
        ("gossip_bytes_out", "Gossip bytes sent", gossip.bytes_out),
        (
            "gossip_decode_errors",
            "Gossip frames that did not decode, dropped",
            gossip.decode_errors,
        ),
        (
            "gossip_forged_frames",
            "Gossip frames claiming another origin than their certificate, dropped",
            gossip.forged,
        ),
        ("gossip_lanes_in", "Lanes received", gossip.lanes_in),
        (
            "gossip_lanes_throttled",
            "Lanes received and left out: they held more than lane_rate_max_per_sec per \
             second of their window, with 90 s for the writer's clock",
            gossip.lanes_throttled,
        ),
        (
            "gossip_lanes_clashing",
            "Lanes received and left out: their version named another key of their origin \
             here, two lanes written under one replica id and version (a reused generation)",
            gossip.lanes_clashing,
        ),
        (
            "gossip_lanes_refused",
            "Lanes received and left out: they would have added a key past keys_max",
            gossip.lanes_refused,
        ),
        (
            "gossip_lanes_restamped",
            "Lanes of this node's earlier lives, re-published at its start, given a new \
             version: a peer's copy raised them",
            gossip.lanes_restamped,
        ),
        (
            "gossip_lanes_corrected",
            "Lanes of another node's earlier life sent back to it: its re-published copy, \
             under a newer version, lacked totals held here",
            gossip.lanes_corrected,
        ),
        ("gossip_lanes_out", "Lanes sent", gossip.lanes_out),
        (
            "gossip_frames_oversize",
            "Gossip messages not sent: their frame would have passed frame_bytes_max",
            gossip.frames_oversize,
        ),
    ];
    for (name, help, value) in pairs {
        counter(&mut registry, name, help, value);
    }
    let transport = sources.transport;
    let metrics = sources.metrics;
    let pairs = [
        (
            "quic_frames_dropped",
            "Frames dropped: a peer's queue was full or it was unreachable",
            load(&transport.frames_dropped),
        ),
        (
            "quic_frames_oversized",
            "QUIC frames with a length of zero or over the limit; a gossip frame's connection closed, \
             a region session frame's stream reset",
            load(&transport.frames_oversized),
        ),
        (
            "quic_frames_truncated",
            "QUIC frames cut off by the end of their stream, dropped",
            load(&transport.frames_truncated),
        ),
        (
            "quic_handshakes_refused",
            "Peers refused at the handshake (no or foreign certificate) or past its deadline",
            load(&transport.handshakes_refused),
        ),
        (
            "quic_handshakes_shed",
            "Incoming connections refused before their handshake: too many in progress",
            load(&transport.handshakes_shed),
        ),
        (
            "quic_connections_forged",
            "Connections closed for a frame claiming another origin",
            load(&transport.connections_forged),
        ),
        (
            "quic_connections",
            "QUIC connections established",
            load(&transport.connections),
        ),
        (
            "quic_connections_over_cap",
            "Connections closed because their member opened more than 4 here: its oldest",
            load(&transport.connections_over_cap),
        ),
        (
            "quic_connections_expired",
            "Connections closed because their peer's certificate expired while open",
            load(&transport.connections_expired),
        ),
        (
            "quic_inbound_waits",
            "Gossip and session frames whose reader waited for earlier frames to be handled",
            load(&transport.inbound_waits),
        ),
        (
            "keys_refused",
            "Writes and gossiped keys refused because the store held its maximum of keys",
            load(&metrics.keys_refused),
        ),
        (
            "client_frames_bad",
            "Client frames that did not decode; their connection closed",
            load(&metrics.client_frames_bad),
        ),
        (
            "client_connections_refused",
            "Client connections refused at the connection limit, or that failed to be \
             accepted (out of file descriptors, say)",
            load(&metrics.client_connections_refused),
        ),
        (
            "client_requests",
            "Client requests answered",
            load(&metrics.client_requests),
        ),
        (
            "client_ids_answered_again",
            "Client requests sent again under a check id, answered with the first answer",
            load(&metrics.client_ids_answered_again),
        ),
        (
            "lane_log_syncs",
            "Syncs of the lane log that made own lanes durable before their gossip",
            load(&metrics.lane_log_syncs),
        ),
        (
            "lane_log_refused",
            "Writes refused because the lane log refused their record (no room, or the log failed)",
            load(&metrics.lane_log_refused),
        ),
        (
            "fallbacks_taken_back",
            "Fallbacks' counts taken back because the region admitted their exact checks late",
            load(&metrics.fallbacks_taken_back),
        ),
    ];
    for (name, help, value) in pairs {
        counter(&mut registry, name, help, value);
    }

    let forward = sources.forward;
    registry.register(
        "region_latency_seconds",
        "Exact checks: time from reading the check to the region's durable answer",
        HistogramRead::latency(&forward.latency),
    );
    let pairs = [
        (
            "region_unavailable",
            "Exact checks that got no durable answer: the rule's timeout passed, the forwarder stopped before writing them, or the region held no live window for them on their first send",
            load(&forward.unavailable),
        ),
        (
            "region_storage_errors",
            "Exact checks the region answered Storage: its log failed, or it held the most application sessions",
            load(&forward.storage_errors),
        ),
        (
            "region_retries",
            "Exact checks sent again after a broken stream or connection",
            load(&forward.retries),
        ),
        (
            "region_answers_bad",
            "Frames of answers from the region that did not decode or had a length of zero or over the limit: each broke its session, whose checks were sent again",
            load(&forward.answers_bad),
        ),
        (
            "exact_room_full",
            "Times a client connection held an exact check because the node held its maximum of exact checks waiting for the region",
            sources.exact_room.full(),
        ),
    ];
    for (name, help, value) in pairs {
        counter(&mut registry, name, help, value);
    }
    gauge(
        &mut registry,
        "exact_checks_waiting",
        "Places taken in the node's room for exact checks: checks forwarded and not yet answered to their connection, and places kept for held checks",
        sources.exact_room.taken(),
    );
    if let Some(region) = sources.region {
        let commit = &region.commit;
        let pairs = [
            (
                "region_log_records",
                "Exact decisions made durable in the region log",
                load(&commit.records),
            ),
            (
                "region_log_syncs",
                "Syncs of the region log (each makes one group of decisions durable)",
                load(&commit.syncs),
            ),
            (
                "region_log_refused",
                "Exact decisions refused because the region log failed",
                load(&commit.refused),
            ),
            (
                "region_log_compactions",
                "Times the region log was replaced by a snapshot of its state",
                load(&commit.compactions),
            ),
            (
                "region_log_compactions_failed",
                "Compactions of the region log that could not make their copy or found no room for it, leaving the log as it was",
                load(&commit.compactions_failed),
            ),
            (
                "region_bad_requests",
                "Forwarded checks naming no exact rule or live window here, and frames of checks refused whole",
                load(&region.bad_requests),
            ),
            (
                "region_lanes_refused",
                "Admitted costs the region's own lanes never count, refused by the lane store's key cap",
                load(&region.lanes_refused),
            ),
            (
                "region_keys_refused",
                "Forwarded checks not decided because the region's ledger holds its maximum of keys",
                load(&region.keys_refused),
            ),
            (
                "region_sessions_refused",
                "Forwarded checks not decided because the region's ledger holds the check ids of its maximum of application sessions",
                load(&region.sessions_refused),
            ),
        ];
        for (name, help, value) in pairs {
            counter(&mut registry, name, help, value);
        }
        registry.register(
            "region_log_sync_seconds",
            "Groups of exact decisions made durable, by the time their write and sync of the region log took",
            HistogramRead::latency(&commit.sync_latency),
        );
        gauge(
            &mut registry,
            "region_lanes_owed",
            "Admitted costs the region's own lanes (and so the edges' estimates) lack because \
             its lane log refused their records (no room, or the log failed)",
            load(&region.lanes_owed) as usize,
        );
    }

    let decisions = Family::<Vec<(String, String)>, Counter>::default();
    for (mode, by_outcome) in MODES.iter().zip(&metrics.decisions) {
        for (outcome, count) in ["denied", "allowed"].iter().zip(by_outcome) {
            let count = count.load(Ordering::Relaxed);
            if count == 0 {
                continue;
            }
            decisions
                .get_or_create(&vec![
                    ("mode".to_owned(), mode.as_str().to_owned()),
                    ("outcome".to_owned(), (*outcome).to_owned()),
                ])
                .inc_by(count);
        }
    }
    registry.register("decisions", "Decisions by mode and outcome", decisions);
    registry.register(
        "decision_bound_ratio",
        "Approximate decisions by their bound (the overshoot they may be part of) over their rule's limit",
        HistogramRead::ratio(&metrics.bound_ratios),
    );
    counter(
        &mut registry,
        "decisions_unbounded",
        "Approximate decisions whose bound was infinite: a member not heard from yet",
        load(&metrics.decisions_unbounded),
    );

    gauge(
        &mut registry,
        "keys",
        "Keys in the lane store",
        sources.store.len(),
    );
    gauge(
        &mut registry,
        "gossip_keys",
        "Keys in the gossip map",
        view.keys,
    );
    gauge(
        &mut registry,
        "lanes",
        "Lanes in the gossip map, all origins",
        view.lanes,
    );
    let expires = Gauge::<i64>::default();
    expires.set(
        sources
            .metrics
            .certificate_expires_unix_secs
            .load(Ordering::Relaxed),
    );
    registry.register(
        "certificate_expiry_timestamp_seconds",
        "When this node's certificate stops being valid (unix seconds): renew it before, \
         as every node's handshakes are refused after",
        expires,
    );
    gauge(
        &mut registry,
        "resident_memory_bytes",
        "Resident memory of the process",
        resident_bytes(),
    );

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)
        .expect("invariant: writing to a String cannot fail");
    text
}

fn origin_labels(node: u64, replica: ReplicaId, state: &str) -> Vec<(String, String)> {
    vec![
        ("node".to_owned(), node.to_string()),
        ("generation".to_owned(), replica.generation.0.to_string()),
        ("state".to_owned(), state.to_lowercase()),
    ]
}

fn load(value: &AtomicU64) -> u64 {
    value.load(Ordering::Relaxed)
}

fn counter(registry: &mut Registry, name: &str, help: &str, value: u64) {
    let counter = Counter::<u64>::default();
    counter.inc_by(value);
    registry.register(name, help, counter);
}

fn gauge(registry: &mut Registry, name: &str, help: &str, value: usize) {
    let gauge = Gauge::<i64>::default();
    gauge.set(value as i64);
    registry.register(name, help, gauge);
}

/// Resident memory, `VmRSS` in `/proc/self/status` (in kB whatever the page size; 0
/// where there is none).
fn resident_bytes() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<usize>().ok()
        })
        .map_or(0, |kb| kb * 1_024)
}

/// The gossip's propagation histogram, encoded as a Prometheus histogram in seconds.
#[derive(Debug)]
struct Buckets(Histogram);

impl EncodeMetric for Buckets {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let mut buckets: Vec<(f64, u64)> = Histogram::BOUNDS_MS
            .iter()
            .zip(self.0.counts.iter())
            .map(|(bound, count)| (*bound as f64 / 1_000.0, *count))
            .collect();
        buckets.push((f64::INFINITY, self.0.counts[Histogram::BOUNDS_MS.len()]));
        let count = self.0.counts.iter().sum();
        encoder.encode_histogram::<NoLabelSet>(
            self.0.sum_ms as f64 / 1_000.0,
            count,
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// A histogram as read at a scrape, encoded as a Prometheus histogram: its counts by
/// bucket of `bounds` (the last one past every bound) and their sum, in the units shown.
#[derive(Debug)]
struct HistogramRead {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
}

impl HistogramRead {
    /// A [`LatencyHistogram`], in seconds.
    fn latency(histogram: &LatencyHistogram) -> HistogramRead {
        HistogramRead {
            bounds: LATENCY_BOUNDS_US
                .iter()
                .map(|bound| *bound as f64 / 1e6)
                .collect(),
            counts: histogram.counts.iter().map(load).collect(),
            sum: load(&histogram.sum_us) as f64 / 1e6,
        }
    }

    /// A [`RatioHistogram`].
    fn ratio(histogram: &RatioHistogram) -> HistogramRead {
        HistogramRead {
            bounds: BOUND_RATIO_BOUNDS.to_vec(),
            counts: histogram.counts.iter().map(load).collect(),
            sum: load(&histogram.sum_millionths) as f64 / 1e6,
        }
    }
}

impl EncodeMetric for HistogramRead {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let bounds = self.bounds.iter().copied().chain([f64::INFINITY]);
        let buckets: Vec<(f64, u64)> = bounds.zip(self.counts.iter().copied()).collect();
        let count = self.counts.iter().sum();
        encoder.encode_histogram::<NoLabelSet>(self.sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

// The lane store runs on loom's atomics under `tally_loom`, which work only inside a model.
#[cfg(test)]
#[cfg(not(tally_loom))]
mod tests {
    use super::*;
    use tally_crdt::{Generation, NodeId};

    #[test]
    fn decisions_are_counted_by_mode_and_outcome_and_only_those_seen_are_shown() {
        assert!(MODES
            .iter()
            .enumerate()
            .all(|(at, mode)| mode_index(*mode) == at));
        let metrics = Metrics::default();
        for (mode, allowed) in [
            (Mode::Exact, true),
            (Mode::Exact, true),
            (Mode::Exact, false),
            (Mode::RegionFallback, false),
        ] {
            metrics.decided(&decision(mode, allowed, 0.0));
        }
        let text = rendered(&metrics);
        let mut decisions: Vec<&str> = (text.lines())
            .filter(|line| line.starts_with("tally_decisions_total{"))
            .collect();
        decisions.sort_unstable();
        assert_eq!(
            decisions,
            [
                r#"tally_decisions_total{mode="exact",outcome="allowed"} 2"#,
                r#"tally_decisions_total{mode="exact",outcome="denied"} 1"#,
                r#"tally_decisions_total{mode="region-fallback",outcome="denied"} 1"#,
            ]
        );
    }

    fn decision(mode: Mode, allowed: bool, bound: f64) -> Decision {
        Decision {
            allowed,
            estimate: 0,
            limit: 200,
            remaining: 0,
            reset_after_ms: 0,
            mode,
            staleness_ms: 0,
            bound,
        }
    }

    /// The metrics of an edge node (no region) with `metrics`, `view` and `exact_room`.
    fn rendered_with(metrics: &Metrics, view: &View, exact_room: &ExactRoom) -> String {
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 8);
        render(&Sources {
            metrics,
            view,
            store: &store,
            transport: &TransportStats::default(),
            forward: &ForwardStats::default(),
            exact_room,
            region: None,
            now: Stamp(0),
        })
    }

    fn rendered(metrics: &Metrics) -> String {
        rendered_with(metrics, &View::default(), &ExactRoom::default())
    }

    #[test]
    fn approximate_decisions_bounds_over_their_limits_are_a_histogram_and_infinite_ones_counted() {
        let metrics = Metrics::default();
        for (mode, bound) in [
            (Mode::ApproximateConnected, 0.0),
            (Mode::ApproximateConnected, 1.5),
            (Mode::ApproximateIsolated, 40.0),
            (Mode::ApproximateIsolated, 1_000.0),
            (Mode::ApproximateConnected, f64::INFINITY),
            // Not approximate: counted in the decisions alone.
            (Mode::Exact, 0.0),
            (Mode::RegionFallback, f64::INFINITY),
        ] {
            metrics.decided(&decision(mode, true, bound));
        }
        let text = rendered(&metrics);
        let lines: Vec<&str> = (text.lines())
            .filter(|line| {
                line.starts_with("tally_decision_bound_ratio")
                    || line.starts_with("tally_decisions_unbounded")
            })
            .collect();
        // Ratios 0, 0.0075, 0.2 and 5 of the limit of 200.
        for expected in [
            "tally_decision_bound_ratio_sum 5.2075",
            "tally_decision_bound_ratio_count 4",
            "tally_decision_bound_ratio_bucket{le=\"0.0\"} 1",
            "tally_decision_bound_ratio_bucket{le=\"0.001\"} 1",
            "tally_decision_bound_ratio_bucket{le=\"0.01\"} 2",
            "tally_decision_bound_ratio_bucket{le=\"0.25\"} 3",
            "tally_decision_bound_ratio_bucket{le=\"1.0\"} 3",
            "tally_decision_bound_ratio_bucket{le=\"+Inf\"} 4",
            "tally_decisions_unbounded_total 1",
        ] {
            assert!(lines.contains(&expected), "{expected} not in {lines:#?}");
        }
    }

    /// A histogram's `_sum` never falls, which a scraper reads as a reset: an isolated
    /// decision's bound can be many times its limit (increments are not held to it), and
    /// the sum saturates (found in review, session 47: it wrapped).
    #[test]
    fn the_bound_ratios_sum_saturates_and_never_falls() {
        let metrics = Metrics::default();
        let sum = |metrics: &Metrics| -> f64 {
            let text = rendered(metrics);
            let line = (text.lines())
                .find(|line| line.starts_with("tally_decision_bound_ratio_sum "))
                .expect("the sum");
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        let huge = decision(Mode::ApproximateIsolated, false, 200.0 * 1e13);
        metrics.decided(&huge);
        let first = sum(&metrics);
        metrics.decided(&huge);
        assert!(
            sum(&metrics) >= first,
            "it fell from {first} to {}",
            sum(&metrics)
        );
    }

    #[test]
    fn the_exact_checks_waiting_and_the_times_their_room_was_full_are_shown() {
        let room = ExactRoom::new(4);
        let _slots = [room.try_take(), room.try_take()];
        room.count_full();
        let text = rendered_with(&Metrics::default(), &View::default(), &room);
        assert!(text.contains("\ntally_exact_checks_waiting 2\n"), "{text}");
        assert!(text.contains("\ntally_exact_room_full_total 1\n"), "{text}");
    }

    #[test]
    fn the_region_latency_and_the_region_logs_syncs_are_histograms_in_seconds() {
        let forward = ForwardStats::default();
        forward.latency.record(Duration::from_micros(100));
        forward.latency.record(Duration::from_millis(3));
        let region = RegionStats::default();
        for micros in [40, 180, 4_500_000] {
            region
                .commit
                .sync_latency
                .record(Duration::from_micros(micros));
        }
        let metrics = Metrics::default();
        let view = View::default();
        let transport = TransportStats::default();
        let exact_room = ExactRoom::default();
        let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 8);
        let sources = Sources {
            metrics: &metrics,
            view: &view,
            store: &store,
            transport: &transport,
            forward: &forward,
            exact_room: &exact_room,
            region: Some(&region),
            now: Stamp(0),
        };
        let text = render(&sources);
        for line in [
            // A bound holds what equals it; buckets are cumulative.
            "tally_region_latency_seconds_bucket{le=\"0.0001\"} 1",
            "tally_region_latency_seconds_bucket{le=\"0.0025\"} 1",
            "tally_region_latency_seconds_bucket{le=\"0.005\"} 2",
            "tally_region_latency_seconds_count 2",
            "tally_region_latency_seconds_sum 0.0031",
            "tally_region_log_sync_seconds_bucket{le=\"0.0001\"} 1",
            "tally_region_log_sync_seconds_bucket{le=\"0.00025\"} 2",
            "tally_region_log_sync_seconds_bucket{le=\"1.0\"} 2",
            "tally_region_log_sync_seconds_bucket{le=\"+Inf\"} 3",
            "tally_region_log_sync_seconds_count 3",
            "tally_region_log_sync_seconds_sum 4.50022",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        // Only the region node logs syncs.
        let text = render(&Sources {
            region: None,
            ..sources
        });
        assert!(text.contains("# TYPE tally_region_latency_seconds histogram"));
        assert!(!text.contains("tally_region_log_sync_seconds"), "{text}");
    }

    /// A seed not yet heard, with no row among the members, is counted by decisions as a
    /// live member as old as the epoch (isolated), and past `dead_after_ms` as a member
    /// declared dead: its staleness is shown as a member's never heard is, not left out
    /// (found in review, session 53: a node started cut off from its seeds showed no
    /// staleness series at all while it decided isolated).
    #[test]
    fn a_seed_never_heard_has_a_staleness_series_as_old_as_the_epoch() {
        let view = View::default();
        let replica = |node| ReplicaId::new(NodeId(node), Generation(1));
        {
            let mut state = view.lock();
            state.seeds = vec![NodeId(2), NodeId(3)];
            state.set_members(
                vec![(NodeId(2), replica(2), State::Alive)],
                [(replica(2), Stamp(1_000))].into_iter().collect(),
                tally_gossip::Now {
                    mono: Duration::ZERO,
                    wall: Stamp(2_000),
                },
            );
        }
        let series = |seeds: crate::view::UnheardSeeds| -> Vec<String> {
            view.lock().unheard_seeds = seeds;
            let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 8);
            let text = render(&Sources {
                metrics: &Metrics::default(),
                view: &view,
                store: &store,
                transport: &TransportStats::default(),
                forward: &ForwardStats::default(),
                exact_room: &ExactRoom::default(),
                region: None,
                now: Stamp(3_000),
            });
            let mut series: Vec<String> = (text.lines())
                .filter(|line| line.starts_with("tally_origin_staleness_seconds{"))
                .map(str::to_owned)
                .collect();
            series.sort_unstable();
            series
        };
        let alive = r#"tally_origin_staleness_seconds{node="2",generation="1",state="alive"} 2.0"#;
        use crate::view::UnheardSeeds;
        assert_eq!(
            series(UnheardSeeds { live: 2, dead: 0 }),
            [
                alive,
                r#"tally_origin_staleness_seconds{node="3",generation="0",state="unheard_seed"} 3.0"#,
            ]
        );
        assert_eq!(
            series(UnheardSeeds { live: 0, dead: 1 }),
            [
                alive,
                r#"tally_origin_staleness_seconds{node="3",generation="0",state="dead_seed"} 3.0"#,
            ]
        );
        // Once the table matched a peer's, a seed with no row is no member.
        assert_eq!(series(UnheardSeeds::default()), [alive]);
    }

    #[test]
    fn resident_memory_is_read_and_a_member_that_left_has_no_staleness_series() {
        assert!(
            resident_bytes() > 1 << 20,
            "a test process holds over a MiB"
        );
        let view = View::default();
        let replica = |node| ReplicaId::new(NodeId(node), Generation(1));
        view.lock().set_members(
            vec![
                (NodeId(2), replica(2), State::Alive),
                (NodeId(3), replica(3), State::Left),
            ],
            std::collections::BTreeMap::new(),
            tally_gossip::Now {
                mono: std::time::Duration::ZERO,
                wall: Stamp(0),
            },
        );
        let text = rendered_with(&Metrics::default(), &view, &ExactRoom::default());
        let series: Vec<&str> = (text.lines())
            .filter(|line| line.starts_with("tally_origin_staleness_seconds{"))
            .collect();
        assert_eq!(series.len(), 1, "{series:?}");
        assert!(series[0].contains(r#"node="2""#), "{series:?}");
        assert!(text.contains(r#"tally_members{state="left"} 1"#), "{text}");
        assert!(text.contains("tally_lives_ended_unheard 0\n"), "{text}");

        // Node 2 comes back as a newer life, none of its first life's state held.
        let next = ReplicaId::new(NodeId(2), Generation(5));
        view.lock().set_members(
            vec![(NodeId(2), next, State::Alive)],
            std::collections::BTreeMap::new(),
            tally_gossip::Now {
                mono: std::time::Duration::ZERO,
                wall: Stamp(0),
            },
        );
        let text = rendered_with(&Metrics::default(), &view, &ExactRoom::default());
        assert!(text.contains("tally_lives_ended_unheard 1\n"), "{text}");
    }
}
