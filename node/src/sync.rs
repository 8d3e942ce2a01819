//! The atomics and the lock under the lane store: loom's under `cfg(tally_loom)`, std's
//! otherwise.
//!
//! The store's slot protocol is written once against these names, so the loom models in
//! `store.rs` check the code the daemon runs, not a copy of it. Run them with
//! `RUSTFLAGS="--cfg tally_loom" CARGO_TARGET_DIR=target-loom cargo test -p tally-node --release`.
//! The cfg is `tally_loom`, not `loom`, so that dependencies with their own `cfg(loom)`
//! models (crossbeam, papaya) build as usual.

#[cfg(tally_loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(tally_loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(tally_loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(tally_loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};
