//! The daemon's command line, shared by `tallyd` and `tally daemon`: a TOML file, with
//! flags that override its values.

use crate::config::{Config, ConfigError, SeedConfig};
use crate::daemon::{self, DaemonError};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// `tallyd`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct DaemonArgs {
    /// The node's TOML configuration.
    #[arg(long)]
    pub config: PathBuf,
    /// Overrides `node_id`.
    #[arg(long)]
    pub node_id: Option<u64>,
    /// Overrides `listen_gossip`.
    #[arg(long)]
    pub listen_gossip: Option<SocketAddr>,
    /// Overrides `listen_client`.
    #[arg(long)]
    pub listen_client: Option<SocketAddr>,
    /// Overrides `listen_http`.
    #[arg(long)]
    pub listen_http: Option<SocketAddr>,
    /// Overrides `data_dir`.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Adds a seed, as `<node id>@<address>`; repeatable.
    #[arg(long = "seed", value_parser = parse_seed)]
    pub seeds: Vec<SeedConfig>,
}

/// Why the daemon did not run to a graceful stop.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration was refused.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The runtime could not start.
    #[error("tokio runtime: {0}")]
    Runtime(std::io::Error),
    /// The node failed to start or stopped on its own.
    #[error(transparent)]
    Daemon(#[from] DaemonError),
}

impl DaemonArgs {
    /// The file's configuration with the flags applied, checked.
    pub fn config(&self) -> Result<Config, ConfigError> {
        let mut config = Config::load(&self.config)?;
        if let Some(node_id) = self.node_id {
            config.node_id = node_id;
        }
        config.listen_gossip = self.listen_gossip.unwrap_or(config.listen_gossip);
        config.listen_client = self.listen_client.unwrap_or(config.listen_client);
        config.listen_http = self.listen_http.unwrap_or(config.listen_http);
        if self.data_dir.is_some() {
            config.data_dir = self.data_dir.clone();
        }
        config.seeds.extend(self.seeds.iter().cloned());
        config.check(Path::new("flags"))?;
        Ok(config)
    }
}

/// Runs the daemon on a current-thread runtime until SIGINT or SIGTERM.
pub fn run(args: &DaemonArgs) -> Result<(), StartError> {
    let config = args.config()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    runtime.block_on(daemon::run(config, shutdown_signal()))?;
    Ok(())
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
