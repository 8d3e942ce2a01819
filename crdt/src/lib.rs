//! tally-crdt: the conflict-free replicated counters under tally.
//!
//! A [`PnCounter`] keeps one grow-only [`Lane`] per [`ReplicaId`]; merging takes the larger
//! total per lane, so merges commute, associate and are idempotent, and the value
//! (`sum(incr) - sum(decr)`, in `i128`) converges once every lane has been delivered.
//! A [`CounterMap`] holds many counters, one per [`Key`] (rule, subject, window), with
//! versioned lanes for scuttlebutt delta sync: a [`Digest`] says what a node holds per
//! origin, [`CounterMap::delta_for`] answers with what the peer lacks in version order and
//! under a byte budget, and [`CounterMap::apply`] merges it idempotently.
//!
//! This crate never does IO, never reads a clock, never spawns, and never fails a merge:
//! time comes in as arguments (`now_unix_secs`, [`Stamp`]). The only errors are for
//! writes and keys that do not fit: a lane that would pass `u64::MAX` ([`Overflow`]) and
//! a key outside its bounds ([`KeyError`]). Lanes never wrap.
//!
//! ```
//! use tally_crdt::*;
//!
//! let key = Key::new(
//!     Rule::new("login").unwrap(),
//!     Subject::new("user-42").unwrap(),
//!     Window::containing(1_700_000_000, 60).unwrap(),
//! );
//! let (a, b) = (ReplicaId::new(NodeId(1), Generation(1)), ReplicaId::new(NodeId(2), Generation(1)));
//! let (mut left, mut right) = (CounterMap::new(), CounterMap::new());
//! left.incr(a, &key, 3, Stamp(0)).unwrap();
//! right.incr(b, &key, 4, Stamp(0)).unwrap();
//!
//! let now = 1_700_000_000;
//! right.apply(&left.delta_for(&right.digest(), 64 * 1024, 0), now);
//! left.apply(&right.delta_for(&left.digest(), 64 * 1024, 0), now);
//! assert_eq!(left.value(&key), 7);
//! assert_eq!(right.value(&key), 7);
//! ```
#![warn(missing_docs)]

mod cells;
mod counter;
mod delta;
mod id;
mod key;
mod key_table;
mod lane;
mod map;
mod scopes;
mod version_index;

pub use cells::CounterRef;
pub use counter::{Counter, PnCounter, Slot};
pub use delta::{
    Delta, Digest, HeldVersions, LaneUpdate, OriginDelta, Settled, Stamp, Version, Watermark,
    DELTA_BYTES_MIN,
};
pub use id::{Generation, NodeId, ReplicaId};
pub use key::{
    Key, KeyError, KeyRef, Rule, Subject, Window, RULE_BYTES_MAX, SUBJECT_BYTES_MAX,
    WINDOW_INDEX_MAX, WINDOW_SECS_MAX,
};
pub use lane::{Lane, Overflow};
pub use map::{lane_within_rate, Applied, AppliedAt, CounterMap, LANE_RATE_SKEW_SECS};
