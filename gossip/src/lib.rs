//! tally-gossip: the sans-IO gossip protocol that keeps every node's counters converging.
//!
//! [`Gossip`] is a deterministic state machine in the style of quinn-proto: the driver
//! feeds it [`Input`]s (frames from authenticated peers, timer expiries, this node's own
//! changed lanes) and drains [`Output`]s (frames to send, [`Event`]s, and always last the
//! next deadline) with [`Gossip::poll_output`]. It runs scuttlebutt anti-entropy over the
//! versioned lanes of [`tally_crdt::CounterMap`], pushes fresh own lanes eagerly every
//! `push_interval`, and keeps a membership table with a phi-accrual failure detector whose
//! heartbeats are the origins' own clock stamps.
//!
//! Architecture Invariant: this crate never reads a clock, never draws unseeded
//! randomness, never opens a socket, never spawns, never touches disk. Time arrives in
//! [`Now`]; the RNG is seeded from [`Config::rng_seed`]. The same inputs give the same
//! outputs, which is what lets the simulator (feature `sim`) replay any run from its seed.
//!
//! Frames are encoded only in [`wire`]: a version byte, then bincode 2.0.1 decoded with a
//! limit. Bad frames are counted in [`Stats`] and dropped; `handle_input` never fails.
//!
//! ```
//! use std::time::Duration;
//! use tally_crdt::{Generation, NodeId, ReplicaId, Stamp};
//! use tally_gossip::{Config, Gossip, Input, Now, Output};
//!
//! let mut node = Gossip::new(Config::new(ReplicaId::new(NodeId(1), Generation(1)), "127.0.0.1:7001"));
//! node.handle_input(Input::Timeout { now: Now { mono: Duration::ZERO, wall: Stamp(1_700_000_000_000) } });
//! // Alone and without seeds, it has nothing to send: the drain ends at the next round.
//! assert_eq!(node.poll_output(), Output::Timeout(Duration::from_secs(1)));
//! ```
#![warn(missing_docs)]

mod config;
mod gossip;
pub mod membership;
pub mod message;
mod paced;
#[cfg(feature = "sim")]
pub mod sim;
mod stats;
pub mod wire;

pub use config::{Config, Seed};
pub use gossip::{Event, Gossip, Input, Now, Output};
pub use paced::PacedWall;
pub use stats::{Histogram, MessageBytes, Stats};
