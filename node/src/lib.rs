//! tally-node: `tallyd`, the sidecar daemon.
