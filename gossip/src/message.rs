//! The messages nodes exchange. Their encoding lives in [`crate::wire`] alone, which
//! sends each in a compact form of its own; only [`MemberEntry`] goes on the wire as is.

use serde::{Deserialize, Serialize};
use tally_crdt::{
    Delta, Digest, Generation, HeldVersions, NodeId, OriginDelta, ReplicaId, Settled, Stamp,
    Version,
};

/// The longest address a member may advertise, in bytes.
pub const ADDR_BYTES_MAX: usize = 256;

/// One frame: who sent it and what it says.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    /// The sending replica. The driver has checked `from.node` against the peer's
    /// certificate before the protocol sees the frame.
    pub from: ReplicaId,
    /// The content.
    pub message: Message,
}

/// The origins a [`Message::Syn`]'s digest speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cover {
    /// Every origin: one the digest does not list is held at `(version 0, unlisted)`.
    All,
    /// Only the origins from `from` on, up to `until` (not included; to the last if
    /// `None`): a digest too large for one frame goes in parts, a part a round, each from
    /// where the last ended. The receiver reads the origins of the part as it reads a whole
    /// digest's, and leaves every other origin out of its answer: it knows nothing of
    /// what the sender holds of them.
    Part {
        /// Where the span starts: where the last part ended (or the least replica id), at
        /// or before the part's first origin.
        from: ReplicaId,
        /// The first origin past it, if any.
        until: Option<ReplicaId>,
    },
}

impl Cover {
    /// Whether the digest speaks for `origin`.
    pub fn contains(self, origin: ReplicaId) -> bool {
        match self {
            Cover::All => true,
            Cover::Part { from, until } => {
                from <= origin && until.is_none_or(|until| origin < until)
            }
        }
    }
}

/// What one frame says.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// Anti-entropy, first leg: what I hold, and a hash of my membership table.
    Syn {
        /// Per origin, the watermark I hold, except origins of which I hold no lanes and a
        /// stamp no older than `unlisted` (see there). Every live member's current replica
        /// that I do not hold is listed, at the default watermark.
        digest: Digest,
        /// Of every origin the digest leaves out, I hold no lanes (version 0, nothing past
        /// a gap) and a stamp at least this new, or that I do not know as a member (then
        /// my stamp may be older). The receiver reads each origin it holds that the digest
        /// does not list as held by me at `(version 0, unlisted)`, and never sends that
        /// reading back as a stamp. With
        /// eager push, this is my clock less two `gossip_interval`s: what the heartbeats
        /// of the last rounds brought is left out, since every node heard it directly. Without,
        /// `Stamp(0)`: nothing is left out but origins I do not hold.
        unlisted: Stamp,
        /// [`crate::membership::Members::hash`] of my table.
        members_hash: u64,
        /// The origins the digest speaks for: all of them, or, when my digest does not fit
        /// in one frame, a part (see [`Cover`]).
        covers: Cover,
    },
    /// Second leg: what you lack, what I hold, and a part of my table if our hashes differ.
    Ack {
        /// The replica whose digest the delta answers. A delta is only complete relative
        /// to that digest: a node that has since lost its state (a new generation) must
        /// not apply it, or it would take the watermark without the lanes below it.
        to: ReplicaId,
        /// Lanes the Syn's sender lacks and that are worth sending now, cut to the frame
        /// budget.
        delta: Delta,
        /// The watermark I hold of each origin where your digest showed lanes I lack, or
        /// a stamp more than a round newer than mine (with eager push; any newer stamp
        /// without), so you can answer with those. Of every other origin I hold at least
        /// what your digest said.
        digest: Digest,
        /// Rows of my membership table, empty when the hashes matched: as many as a
        /// half the frame holds, a later part in each answer.
        members: Vec<MemberEntry>,
        /// The nodes of `members` that I hold as dead. A node that takes one of those rows
        /// as new takes it as dead too, not as alive (see [`crate::membership::Members::merge`]).
        dead: Vec<NodeId>,
    },
    /// Third leg: what the Ack's sender lacks, and a part of my table if the hashes
    /// differed.
    Delta {
        /// The replica whose digest the delta answers (see `Ack::to`).
        to: ReplicaId,
        /// Lanes the Ack's sender lacks.
        delta: Delta,
        /// Rows of my membership table, as in `Ack`.
        members: Vec<MemberEntry>,
        /// The nodes of `members` that I hold as dead, as in `Ack`.
        dead: Vec<NodeId>,
    },
    /// Eager push of the sender's own fresh lanes (versions above `after`), and its
    /// heartbeat: `lanes.through.stamp` is the sender's clock at its freshest state (its
    /// last write or round), or `Stamp(0)` in a frame of a push cut short, but its last.
    Push {
        /// The version the lanes follow: the receiver has no gap if it holds this much.
        after: Version,
        /// The sender's own lanes. `lanes.origin` is the sender's replica: the frame does
        /// not carry it, so a push of another origin's lanes cannot be sent or received.
        lanes: OriginDelta,
    },
    /// A membership announcement: a graceful leave.
    Members {
        /// Entries to merge.
        members: Vec<MemberEntry>,
    },
    /// What I hold of origins that write no more (earlier lives, dead members' lives),
    /// each with a summary of its lanes. A peer that holds one at the same watermark but
    /// other lanes ([`tally_crdt::CounterMap::settled_differs`]), which no digest shows,
    /// answers with a `Held` of that origin.
    Settled {
        /// One per origin, in replica order.
        origins: Vec<Settled>,
    },
    /// The versions I hold of an origin's lanes in a span, in answer to a `Settled`; the
    /// peer answers with a `Delta` of the lanes it holds there that I lack
    /// ([`tally_crdt::CounterMap::lanes_not_held`]).
    Held {
        /// The span and its versions.
        held: HeldVersions,
    },
}

/// One row of the membership table, as gossiped.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MemberEntry {
    /// The member.
    pub node: NodeId,
    /// Its current generation: a higher one replaces a lower one.
    pub generation: Generation,
    /// Where to reach it (opaque to the protocol).
    pub addr: String,
    /// Whether it left gracefully. Within a generation, left beats alive.
    pub left: bool,
}

impl MemberEntry {
    /// The member's current replica.
    pub fn replica(&self) -> ReplicaId {
        ReplicaId::new(self.node, self.generation)
    }
}
