//! `tallyd`: the tally sidecar. `tallyd --config node.toml`, with flags that override the
//! file's values. Stops gracefully (leaving the cluster) on SIGINT or SIGTERM.

use clap::Parser;
use tally_node::cli::{self, DaemonArgs};

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
