//! What replicas exchange: digests (what I hold) and deltas (what you lack).

use crate::{Key, Lane, ReplicaId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A replica's count of its own lane writes. Each write of one of its lanes takes the next
/// version, so versions order one replica's writes and no two writes share one.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Version(pub u64);

impl Version {
    /// Before any write.
    pub const ZERO: Version = Version(0);

    /// The version after this one; `u64::MAX` stays (no life writes 2^64 times, and a
    /// peer claiming that version of a node's own replica stops it first).
    pub fn next(self) -> Version {
        Version(self.0.saturating_add(1))
    }
}

/// An origin's own wall-clock reading (milliseconds since the unix epoch) when it produced
/// a state. Carried with that state so every holder can tell how stale it is. Opaque to
/// this crate, which never reads a clock.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Stamp(pub u64);

/// What a holder knows of one origin: every lane of it whose version is at most `version`
/// at the origin, and the origin's clock reading for its freshest state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watermark {
    /// The highest version held.
    pub version: Version,
    /// The origin's clock when it produced that state, or last said it had nothing newer.
    pub stamp: Stamp,
}

/// Per origin, what a node holds. Sent so a peer can answer with only what is missing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Digest {
    /// Origin to watermark, in origin order.
    pub origins: BTreeMap<ReplicaId, Watermark>,
}

/// What a holder has of one origin, to compare with another holder's when neither expects
/// more of it (the origin is a retired life or a dead member's): equal watermarks say that
/// both hold every lane whose version at the origin is current and at most that, but not
/// that they hold the same earlier copies of lanes rewritten above it. Once every holder of
/// a lane's current version has lost its state too, an earlier copy is all that is left of
/// the lane, and one holder may have it where another does not (found in review, session
/// 37).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settled {
    /// The origin.
    pub origin: ReplicaId,
    /// The holder's watermark version for it.
    pub version: Version,
    /// How many of its lanes the holder has.
    pub lanes: u64,
    /// A hash of the versions of those lanes: equal for equal sets, but by a collision.
    pub versions_hash: u64,
}

/// The versions of an origin's lanes a holder has in a span, for a peer whose [`Settled`]
/// summary of the origin differs at the same watermark to answer with the lanes the
/// holder lacks there ([`crate::CounterMap::lanes_not_held`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldVersions {
    /// The origin.
    pub origin: ReplicaId,
    /// The holder's watermark version for it.
    pub version: Version,
    /// The span's first version.
    pub from: Version,
    /// The span's last version.
    pub through: Version,
    /// Every version of the origin's lanes the holder has in `[from, through]`.
    // Invariant: ascending strictly, within the span.
    pub versions: Vec<Version>,
}

/// One lane write, as sent: the key, the totals, and the origin's version for them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneUpdate {
    /// The counter.
    pub key: Key,
    /// The origin's totals for it.
    pub lane: Lane,
    /// The origin's version of those totals.
    pub version: Version,
}

/// The lanes of one origin that a peer lacks, in version order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OriginDelta {
    /// Whose lanes these are.
    pub origin: ReplicaId,
    /// After applying `lanes`, the receiver holds everything of `origin` up to here.
    /// Equal to the sender's watermark when the send is complete; when the budget cut it
    /// short, the last lane's version (the receiver's own if no lane was sent), or the
    /// sender's watermark if lower (the last lane sent was held past a gap).
    pub through: Watermark,
    /// Lanes with versions above the receiver's watermark.
    // Invariant: versions ascend strictly, from 1. They may lie above `through` (lanes the
    // sender holds past a gap). The wire encoding relies on the order to leave versions
    // implicit.
    pub lanes: Vec<LaneUpdate>,
}

/// Everything one send carries: per origin, lanes in version order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    /// One entry per origin with anything to send.
    pub origins: Vec<OriginDelta>,
}

/// The smallest byte budget a delta is ever cut to: room for one origin and its largest
/// possible lane, so every send makes progress. Smaller budgets are raised to this.
pub const DELTA_BYTES_MIN: usize = size::DELTA_HEADER + size::ORIGIN_HEADER + size::LANE_MAX;

impl Delta {
    /// How many lane updates the delta carries.
    pub fn lanes(&self) -> usize {
        self.origins.iter().map(|origin| origin.lanes.len()).sum()
    }

    /// Whether the delta carries nothing at all.
    pub fn is_empty(&self) -> bool {
        self.origins.is_empty()
    }
}

/// Upper bounds on encoded sizes, used to cut deltas under a frame budget. Integers are
/// counted at their widest variable-length encoding (9 bytes for a `u64`, 5 for a `u32`).
/// The encoding they bound is `tally-gossip`'s wire format: a lane names a (rule, window)
/// scope listed once per frame, and its version is implied unless a hole is needed.
pub(crate) mod size {
    use crate::{Key, KeyRef, RULE_BYTES_MAX, SUBJECT_BYTES_MAX};

    /// An origin header: replica id (node and generation), `through` version and stamp,
    /// the base its lanes' versions count up from, and the count prefixes of its lanes and
    /// holes.
    pub const ORIGIN_HEADER: usize = 9 + 9 + 9 + 9 + 9 + 9 + 9;
    /// The delta's own header: the count prefixes of its scopes and origins.
    pub const DELTA_HEADER: usize = 9 + 9;

    /// One lane update: its key (counted whole, as if its scope were new to the frame)
    /// and its scope index, two totals and a hole.
    pub fn lane(key: KeyRef<'_>) -> usize {
        key.encoded_len_max() + LANE_FIELDS
    }

    const LANE_FIELDS: usize = 9 + 9 + 9 + 9 + 9;

    /// The largest lane update any key can make.
    pub const LANE_MAX: usize =
        RULE_BYTES_MAX + SUBJECT_BYTES_MAX + Key::ENCODED_FIXED_MAX + LANE_FIELDS;
}
