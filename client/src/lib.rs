//! tally-client: the async client for a local `tallyd` sidecar, and the client wire
//! protocol it speaks.
//!
//! An application asks its sidecar to count (`incr`, `decr`), to read a count (`get`), to
//! decide whether a use is allowed and count it if so (`check`), and for the sidecar's
//! state (`status`). A [`Client`] is a cheap, cloneable handle over one connection, over
//! TCP or a Unix socket ([`Endpoint`]). Requests from all clones are pipelined on it and
//! matched to their answers by id, so a busy application needs one client, not a pool.
//!
//! Architecture Invariant: this crate never links the server. It depends on no other tally
//! crate; the sidecar (`tally-node`) depends on it for [`wire`], the one place the client
//! protocol is defined.
//!
//! Architecture Invariant: a [`Client`] holds at most one connection. When it breaks, the
//! requests in flight fail with [`Error::Disconnected`] (or [`Error::Protocol`], after a
//! frame that does not decode as far as its request id, or one the sidecar refused; those
//! still in the client's outbox, never written, with [`Error::NotSent`]) and
//! the next request makes one
//! attempt to reconnect; nothing reconnects in the background and nothing retries.
//!
//! Main types:
//!
//! - [`Client`]: the handle; [`Client::connect`], then `incr`, `decr`, `get`, `check`,
//!   `status`.
//! - [`Pipeline`]: requests sent together and answered together ([`Client::send`]).
//! - [`CheckId`]: names a check, an increment or a decrement across its retries, so that
//!   it counts once ([`Client::check_with_id`], [`Client::incr_with_id`],
//!   [`Client::decr_with_id`]).
//! - [`Endpoint`]: where the sidecar listens, parsed from `127.0.0.1:7100` or
//!   `unix:/path/to.sock`.
//! - [`Options`]: the request and connect timeouts.
//! - [`Error`]: why a call failed, whether anything may have been counted, and
//!   [`Error::is_retryable`].
//! - [`Estimate`], [`Decision`], [`Mode`], [`Status`], [`Refusal`], [`Reply`]: what the sidecar
//!   answers, from [`wire`].
//!
//! # Example
//!
//! ```no_run
//! use tally_client::{Client, Endpoint, Options};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let endpoint: Endpoint = "127.0.0.1:7100".parse()?;
//! let client = Client::connect(endpoint, Options::default()).await?;
//!
//! let decision = client.check("login", "user-42", 1).await?;
//! if decision.allowed {
//!     println!("allowed, {} left in this window", decision.remaining);
//! } else {
//!     println!("over the limit; try again in {} ms", decision.reset_after_ms);
//! }
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

mod check_id;
mod client;
mod connection;
mod endpoint;
mod error;
mod in_flight;
mod pipeline;
pub mod wire;

pub use client::{Client, Options};
pub use endpoint::{Endpoint, ParseEndpointError};
pub use error::Error;
pub use pipeline::Pipeline;
pub use wire::{CheckId, Decision, Estimate, Mode, Refusal, Reply, Status};

// Compiles README.md's Rust example as a doctest (run by `cargo test`, never built
// otherwise), so the README cannot drift from this crate's API. The README's other code
// blocks are marked `sh`, `toml` or `text`, which rustdoc does not compile.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
