//! `tallyd`: the tally sidecar. `tallyd --config node.toml`, with flags that override the
//! file's values. Stops gracefully (leaving the cluster) on SIGINT, SIGTERM or SIGHUP.

use clap::Parser;
use tally_node::cli::{self, DaemonArgs};

// mimalloc, not the system allocator: the region's CPU per exact check fell by 10-15% in
// an A/B run (BENCHMARKS.md), malloc and free having been a fifth of its profile.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(name = "tallyd", version, about = "tally's sidecar daemon")]
struct Args {
    #[command(flatten)]
    daemon: DaemonArgs,
}

fn main() -> anyhow::Result<()> {
    cli::run(&Args::parse().daemon)?;
    Ok(())
}
