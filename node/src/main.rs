//! `tallyd`: the tally sidecar. `tallyd --config node.toml`, with flags that override the
//! file's values. Stops gracefully (leaving the cluster) on SIGINT or SIGTERM.

use anyhow::Context;
use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use tally_node::config::{Config, SeedConfig};

#[derive(Debug, Parser)]
#[command(name = "tallyd", version, about = "tally's sidecar daemon")]
struct Args {
    /// The node's TOML configuration.
    #[arg(long)]
    config: PathBuf,
    /// Overrides `node_id`.
    #[arg(long)]
    node_id: Option<u64>,
    /// Overrides `listen_gossip`.
    #[arg(long)]
    listen_gossip: Option<SocketAddr>,
    /// Overrides `listen_client`.
    #[arg(long)]
    listen_client: Option<SocketAddr>,
    /// Overrides `listen_http`.
    #[arg(long)]
    listen_http: Option<SocketAddr>,
    /// Overrides `data_dir`.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Adds a seed, as `<node id>@<address>`; repeatable.
    #[arg(long = "seed", value_parser = parse_seed)]
    seeds: Vec<SeedConfig>,
}

fn parse_seed(text: &str) -> Result<SeedConfig, String> {
    let (node, addr) = text
        .split_once('@')
        .ok_or_else(|| format!("seed {text:?}: expected <node id>@<address>"))?;
    Ok(SeedConfig {
        node: node
            .parse()
            .map_err(|err| format!("seed {text:?}: node id: {err}"))?,
        addr: addr
            .parse()
            .map_err(|err| format!("seed {text:?}: address: {err}"))?,
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut config = Config::load(&args.config)?;
    if let Some(node_id) = args.node_id {
        config.node_id = node_id;
    }
    config.listen_gossip = args.listen_gossip.unwrap_or(config.listen_gossip);
    config.listen_client = args.listen_client.unwrap_or(config.listen_client);
    config.listen_http = args.listen_http.unwrap_or(config.listen_http);
    if args.data_dir.is_some() {
        config.data_dir = args.data_dir;
    }
    config.seeds.extend(args.seeds);
    config.check(std::path::Path::new("flags"))?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    runtime.block_on(tally_node::daemon::run(config, shutdown_signal()))?;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut terminate) => {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
