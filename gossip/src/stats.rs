//! Counters a node keeps about its gossip, for metrics and for the simulator.

use std::time::Duration;

/// Frames, bytes, errors and propagation delays since start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Frames received, valid or not.
    pub frames_in: u64,
    /// Frames sent.
    pub frames_out: u64,
    /// Bytes received.
    pub bytes_in: u64,
    /// Bytes sent.
    pub bytes_out: u64,
    /// Bytes sent, by kind of message.
    pub bytes_out_by_message: MessageBytes,
    /// Frames dropped because they did not decode.
    pub decode_errors: u64,
    /// Frames dropped because they claimed a sender other than the authenticated peer.
    pub forged: u64,
    /// Answers dropped because they answered a digest of another generation of this node.
    pub stale: u64,
    /// Lane updates received.
    pub lanes_in: u64,
    /// Lane updates left out because they would have added a key to a map at its key cap
    /// (`CounterMap::with_keys_max`).
    pub lanes_refused: u64,
    /// Lane updates left out because their totals passed the map's rate over their
    /// window's age (`CounterMap::with_lane_rate_max`).
    pub lanes_throttled: u64,
    /// Lane updates left out because their version named another key of their origin
    /// here (`Applied::lanes_clashing`).
    pub lanes_clashing: u64,
    /// Lanes of this node's earlier lives, re-published at its start, given a new version
    /// because a peer's copy raised them (the log was behind what peers had).
    pub lanes_restamped: u64,
    /// Lanes of another node's earlier life sent back to that node because a newer version
    /// of them, re-published by it, lacked totals held here.
    pub lanes_corrected: u64,
    /// Lane updates sent.
    pub lanes_out: u64,
    /// Messages not sent because their frame would have passed `frame_bytes_max`.
    pub frames_oversize: u64,
    /// How old an origin's newest state was when it arrived here (origin stamp against
    /// the local wall clock).
    pub propagation: Histogram,
}

/// Bytes, per kind of message.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MessageBytes {
    /// Digests that open an anti-entropy exchange.
    pub syn: u64,
    /// Answers to a `Syn`.
    pub ack: u64,
    /// Answers to an `Ack`.
    pub delta: u64,
    /// Pushes of fresh own lanes.
    pub push: u64,
    /// Pushes with no lanes: the heartbeat alone.
    pub heartbeat: u64,
    /// Membership announcements.
    pub members: u64,
    /// Summaries of origins that write no more, and the versions held of one.
    pub settled: u64,
}

impl MessageBytes {
    /// Every kind with its bytes, in a fixed order, for printing.
    pub fn by_kind(&self) -> [(&'static str, u64); 7] {
        [
            ("push", self.push),
            ("heartbeat", self.heartbeat),
            ("syn", self.syn),
            ("ack", self.ack),
            ("delta", self.delta),
            ("members", self.members),
            ("settled", self.settled),
        ]
    }
}

impl std::ops::AddAssign for MessageBytes {
    fn add_assign(&mut self, other: MessageBytes) {
        self.syn += other.syn;
        self.ack += other.ack;
        self.delta += other.delta;
        self.push += other.push;
        self.heartbeat += other.heartbeat;
        self.members += other.members;
        self.settled += other.settled;
    }
}

/// A fixed-bucket histogram of durations, Prometheus style (cumulative on export).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Histogram {
    /// Count per bucket: `counts[i]` holds samples at most `BOUNDS_MS[i]`; the last holds
    /// the rest.
    pub counts: [u64; Histogram::BOUNDS_MS.len() + 1],
    /// The sum of every sample, in milliseconds.
    pub sum_ms: u64,
}

impl Histogram {
    /// Bucket upper bounds in milliseconds.
    pub const BOUNDS_MS: [u64; 14] = [
        1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 60_000,
    ];

    /// Adds one sample.
    pub fn record(&mut self, sample: Duration) {
        let ms = u64::try_from(sample.as_millis()).unwrap_or(u64::MAX);
        let bucket = Histogram::BOUNDS_MS
            .iter()
            .position(|&bound| ms <= bound)
            .unwrap_or(Histogram::BOUNDS_MS.len());
        self.counts[bucket] += 1;
        self.sum_ms = self.sum_ms.saturating_add(ms);
    }
}

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram {
            counts: [0; Histogram::BOUNDS_MS.len() + 1],
            sum_ms: 0,
        }
    }
}
