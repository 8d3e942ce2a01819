//! tally-client: the async client for a local `tallyd` (issue 4).
//!
//! Not written yet: this crate holds only its place in the workspace.
#![warn(missing_docs)]
