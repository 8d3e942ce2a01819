//! Who wrote a lane: node ids, generations and replica ids.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The identity of one running `tallyd`, fixed by configuration and by its certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub u64);

/// One life of a node's lanes. A node takes a new generation on every start that did not
/// restore its own lanes from its own durable snapshot, so it never writes into a lane
/// whose earlier values it may have lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Generation(pub u64);

/// The writer of a lane: a node in one generation. Only this replica ever writes its lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ReplicaId {
    /// The node that owns the lanes.
    pub node: NodeId,
    /// The node's generation when it wrote them.
    pub generation: Generation,
}

impl ReplicaId {
    /// The replica of `node` in `generation`.
    pub fn new(node: NodeId, generation: Generation) -> ReplicaId {
        ReplicaId { node, generation }
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node-{}", self.0)
    }
}

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/g{}", self.node, self.generation.0)
    }
}
