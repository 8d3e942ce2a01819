//! tally-node: `tallyd`, the sidecar daemon that runs beside each edge service.
//!
//! At its heart is the [`store::LaneStore`]: this node's own lanes, written without a
//! lock, and the remote sums that gossip merges in. Around it: the gossip task
//! ([`driver`]) over QUIC ([`transport`], [`tls`]), the client listener ([`listener`],
//! [`decide`]), the region path for exact rules ([`region`]), the lane log
//! ([`lanelog`]) and the sync own lanes wait for before gossip sends them ([`handoff`]), and `/metrics` and `/status` ([`http`], [`metrics`]). [`daemon::run`]
//! starts them all on one current-thread runtime.
//!
//! Architecture Invariant: the store never does IO, never reads a clock and never wraps a
//! lane; the only threads it knows of are its callers. Its lock-free protocol is checked by
//! loom models (see [`store`]), built with `--cfg tally_loom` through the small shim in
//! `sync`.
//!
//! ```
//! # if tally_node::LOOM_BUILD { return; }
//! use tally_crdt::{Generation, Key, Lane, NodeId, ReplicaId, Rule, Subject, Window};
//! use tally_node::store::LaneStore;
//!
//! let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), 100_000);
//! let key = Key::new(
//!     Rule::new("login").unwrap(),
//!     Subject::new("user-42").unwrap(),
//!     Window::containing(1_700_000_000, 60).unwrap(),
//! );
//! store.incr(&key, 3).unwrap();
//! store.publish_remote(&key, 4).unwrap(); // the other replicas' lanes, as gossip merged them
//! assert_eq!(store.estimate(&key), 7);
//!
//! let mut changed = Vec::new();
//! store.collect(&mut changed); // what gossip sends next
//! assert_eq!(changed, vec![(key, Lane::new(3, 0))]);
//! ```

/// Writes one line to stderr, the node's log, as `eprintln!` does, except that a stderr
/// that cannot be written (a pipe whose reader went away: a log shipper restarted) does not
/// panic: the node keeps serving and the line is lost (found in review, session 49: the
/// node exited with status 101 at its first line).
macro_rules! log_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

pub mod answerlog;
pub mod certs;
mod checksummed;
pub mod cli;
pub mod clock;
pub(crate) mod compaction;
pub mod config;
pub mod daemon;
pub mod decide;
pub mod driver;
pub mod ended;
pub mod exact_room;
pub mod expiry_mark;
pub mod handoff;
pub mod http;
pub mod lanelog;
pub mod late;
pub mod listener;
pub mod metrics;
pub mod recent;
pub mod refused_sums;
pub mod region;
pub mod store;
mod sync;
pub mod tasks;
pub mod tls;
pub mod transport;
pub mod view;

/// Whether this build runs on loom's atomics (`--cfg tally_loom`), which panic outside a
/// loom model. Rustdoc does not pass `RUSTFLAGS` on to doctests, so they cannot see the cfg
/// and check this instead, returning early in a loom build.
#[doc(hidden)]
pub const LOOM_BUILD: bool = cfg!(tally_loom);
