//! tally-gossip: the sans-IO anti-entropy protocol and membership (issue 3).
//!
//! Not written yet: this crate holds only its place in the dependency line
//! `crdt <- gossip <- node`. It will never use tokio, quinn, a clock, a socket or disk.
#![warn(missing_docs)]
