//! The atomics under the lane store: loom's under `cfg(tally_loom)`, std's otherwise.
//!
//! The store's slot protocol is written once against these names, so the loom models in
//! `store.rs` check the code the daemon runs, not a copy of it. Run them with
//! `RUSTFLAGS="--cfg tally_loom" CARGO_TARGET_DIR=target-loom cargo test -p tally-node --release`.
//! The cfg is `tally_loom`, not `loom`, so that dependencies with their own `cfg(loom)`
//! models (crossbeam, papaya) build as usual.

#[cfg(tally_loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
#[cfg(not(tally_loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

/// Waits a moment inside a retry loop, until another thread finishes what it started.
///
/// Under loom this yields to the model's scheduler, which loom needs in every spin loop to
/// explore the thread that is being waited for. Otherwise it yields to the OS: the store
/// only retries while another thread is between two stores, and on a machine with few cores
/// spinning would take the CPU that thread needs to finish.
pub(crate) fn wait_a_moment() {
    #[cfg(tally_loom)]
    loom::thread::yield_now();
    #[cfg(not(tally_loom))]
    std::thread::yield_now();
}
