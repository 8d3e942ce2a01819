//! What a gossip node is told at start.

use std::time::Duration;
use tally_crdt::{NodeId, ReplicaId, DELTA_BYTES_MIN};

/// A node the gossip contacts first to join the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    /// The seed's node id (named in its certificate).
    pub node: NodeId,
    /// Where the driver reaches it; opaque to the protocol.
    pub addr: String,
}

/// Gossip settings. Every duration is on the node's monotonic clock.
#[derive(Debug, Clone)]
pub struct Config {
    /// This node's replica: its node id and the generation of this life.
    pub replica: ReplicaId,
    /// Where peers reach this node; opaque to the protocol, carried in membership.
    pub addr: String,
    /// Nodes to contact first.
    pub seeds: Vec<Seed>,
    /// Anti-entropy period: one digest exchange with `fanout` peers, and a heartbeat to all.
    pub gossip_interval: Duration,
    /// How long fresh own lanes wait to be pushed, batched, to every live peer.
    pub push_interval: Duration,
    /// Peers per anti-entropy round.
    pub fanout: usize,
    /// The largest frame this node sends. At least [`Config::FRAME_BYTES_MIN`].
    pub frame_bytes_max: usize,
    /// The phi-accrual level past which a silent member is suspected.
    pub suspect_phi: f64,
    /// How long a member stays suspected before it is declared dead.
    pub dead_after: Duration,
    /// Seed of the protocol's RNG (peer selection), so runs replay.
    pub rng_seed: u64,
    /// Whether to push fresh lanes, and the heartbeat, eagerly to every live peer. Off
    /// only to measure anti-entropy alone.
    pub eager_push: bool,
}

impl Config {
    /// The smallest frame budget: one lane of the largest key, with room for headers and
    /// for a part of the membership table of two rows at the longest address.
    pub const FRAME_BYTES_MIN: usize = DELTA_BYTES_MIN + 2048;

    /// Defaults for a node: 1 s rounds, 5 ms pushes, fanout 3, 64 KiB frames.
    pub fn new(replica: ReplicaId, addr: impl Into<String>) -> Config {
        Config {
            replica,
            addr: addr.into(),
            seeds: Vec::new(),
            gossip_interval: Duration::from_millis(1_000),
            push_interval: Duration::from_millis(5),
            fanout: 3,
            frame_bytes_max: 64 * 1024,
            suspect_phi: 8.0,
            dead_after: Duration::from_secs(10),
            rng_seed: replica.node.0 ^ replica.generation.0,
            eager_push: true,
        }
    }

    /// This node's id.
    pub fn node(&self) -> NodeId {
        self.replica.node
    }
}
