//! The daemon's command line, shared by `tallyd` and `tally daemon`: a TOML file, with
//! flags that override its values.

use crate::config::{Config, ConfigError, SeedConfig};
use crate::daemon::{self, DaemonError};
use std::net::SocketAddr;
use std::path::PathBuf;

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
    /// A region's first start: makes its ledger in `data_dir`. Refused where a ledger
    /// already is; without it, a region's start is refused where none is.
    #[arg(long)]
    pub new_ledger: bool,
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
    /// A value of the configuration could not be used at start-up: a TLS file that
    /// cannot be read, a data directory, an address that cannot be bound.
    #[error("config {file}: {key}: {source}")]
    Setting {
        /// The file (or "`file` with flags").
        file: PathBuf,
        /// The key, as a TOML path: `tls.ca`.
        key: &'static str,
        /// What failed.
        source: DaemonError,
    },
    /// The node stopped on its own.
    #[error(transparent)]
    Daemon(#[from] DaemonError),
}

impl DaemonArgs {
    /// The file's configuration with the flags applied, checked once they are: a file
    /// that only the flags make valid (a region's `--data-dir`) is taken, though it must
    /// hold every key without a default, which a flag may then override. A seed added past
    /// the file's own is
    /// `seeds[<their count> + i]` in errors.
    pub fn config(&self) -> Result<Config, ConfigError> {
        Config::load_with_flags(&self.config, |config| self.apply(config))
    }

    /// The configuration's name in errors: its file, or "`file` with flags".
    fn named(&self) -> PathBuf {
        if self.has_flags() {
            PathBuf::from(format!("{} with flags", self.config.display()))
        } else {
            self.config.clone()
        }
    }

    /// Sets the values the flags give; returns whether there were any.
    fn apply(&self, config: &mut Config) -> bool {
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
        config.new_ledger = self.new_ledger;
        self.has_flags()
    }

    fn has_flags(&self) -> bool {
        self.node_id.is_some()
            || self.listen_gossip.is_some()
            || self.listen_client.is_some()
            || self.listen_http.is_some()
            || self.data_dir.is_some()
            || !self.seeds.is_empty()
            || self.new_ledger
    }
}

/// Runs the daemon on a current-thread runtime until SIGINT, SIGTERM or SIGHUP.
pub fn run(args: &DaemonArgs) -> Result<(), StartError> {
    let config = args.config()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(daemon::run(config, shutdown_signal()))
    }));
    // A blocking thread still in a sync of a failing disk (the region's committer, the
    // lane log's) holds nothing acknowledged: the process leaves without it, after a
    // panic too.
    runtime.shutdown_timeout(STOP_BLOCKING_WAIT);
    match ran {
        Ok(ran) => ran.map_err(|err| match err.key() {
            Some(key) => StartError::Setting {
                file: args.named(),
                key,
                source: err,
            },
            None => StartError::Daemon(err),
        }),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// How long a stopping node waits for its blocking threads once its tasks are done.
const STOP_BLOCKING_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

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

/// Returns at the first Ctrl-C (SIGINT), SIGTERM or SIGHUP: when a node, or the demo,
/// should stop. SIGHUP is a closed terminal, where the README starts nodes: left to its
/// default it killed the node without the graceful leave (exit 129; peers then count a
/// whole limit for it until it is back or forgotten: found in review, session 44).
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(mut terminate), Ok(mut hangup)) => {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = hangup.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `config` with no flag.
    fn no_flags(config: PathBuf) -> DaemonArgs {
        DaemonArgs {
            config,
            node_id: None,
            listen_gossip: None,
            listen_client: None,
            listen_http: None,
            data_dir: None,
            seeds: Vec::new(),
            new_ledger: false,
        }
    }

    #[test]
    fn a_value_the_flags_make_wrong_is_refused_naming_the_file_with_the_flags() {
        let dir = std::env::temp_dir().join(format!("tally-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("node-1.toml");
        std::fs::write(
            &file,
            "node_id = 1\n\
             listen_gossip = \"127.0.0.1:7001\"\n\
             listen_client = \"127.0.0.1:7101\"\n\
             listen_http = \"127.0.0.1:7201\"\n\
             seeds = [{ node = 2, addr = \"127.0.0.1:7002\" }]\n\
             tls = { ca = \"ca.pem\", cert = \"node-1.pem\", key = \"node-1.key\" }\n",
        )
        .unwrap();
        let args = DaemonArgs {
            node_id: Some(2),
            ..no_flags(file)
        };
        let err = args.config().unwrap_err().to_string();
        assert!(
            err.contains("node-1.toml with flags") && err.contains("seeds[0].node"),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A path the file gives that the node cannot use is a bad value like any other: the
    /// refusal names the key and the file (found in review, session 46: it named the path
    /// alone).
    #[test]
    fn a_certificate_path_that_cannot_be_read_is_refused_naming_the_key_and_the_file() {
        let dir = std::env::temp_dir().join(format!("tally-cli-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("node-1.toml");
        std::fs::write(
            &file,
            "node_id = 1\n\
             listen_gossip = \"127.0.0.1:0\"\n\
             listen_client = \"127.0.0.1:0\"\n\
             listen_http = \"127.0.0.1:0\"\n\
             tls = { ca = \"no-such-ca.pem\", cert = \"node-1.pem\", key = \"node-1.key\" }\n",
        )
        .unwrap();
        let refused = run(&no_flags(file.clone()));
        assert!(
            matches!(&refused, Err(StartError::Setting { key: "tls.ca", .. })),
            "{refused:?}"
        );
        let err = refused.unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("config {}: tls.ca: ", file.display()))
                && err.contains("no-such-ca.pem"),
            "{err}"
        );
        let with_flags = DaemonArgs {
            listen_client: Some("127.0.0.1:0".parse().unwrap()),
            ..no_flags(file)
        };
        let err = run(&with_flags).unwrap_err().to_string();
        assert!(err.contains("node-1.toml with flags: tls.ca: "), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// `--new-ledger` is a flag, for a region: an edge given it is refused, and the file
    /// cannot say it (a key left in a file would start a new ledger on a lost disk).
    #[test]
    fn new_ledger_is_a_regions_flag_and_no_key_of_the_file() {
        let dir = std::env::temp_dir().join(format!("tally-cli-ledger-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("node-2.toml");
        let edge = "node_id = 2\n\
                    listen_gossip = \"127.0.0.1:7002\"\n\
                    listen_client = \"127.0.0.1:7102\"\n\
                    listen_http = \"127.0.0.1:7202\"\n\
                    tls = { ca = \"ca.pem\", cert = \"node-2.pem\", key = \"node-2.key\" }\n";
        std::fs::write(&file, edge).unwrap();
        let args = DaemonArgs {
            new_ledger: true,
            ..no_flags(file.clone())
        };
        let err = args.config().unwrap_err().to_string();
        assert!(
            err.contains("node-2.toml with flags: --new-ledger: only a region"),
            "{err}"
        );
        std::fs::write(&file, format!("new_ledger = true\n{edge}")).unwrap();
        let err = no_flags(file).config().unwrap_err().to_string();
        assert!(
            err.contains("node-2.toml") && err.contains("unknown field `new_ledger`"),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_file_the_flags_complete_is_taken_and_without_them_refused_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("tally-cli-flags-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("node-3.toml");
        std::fs::write(
            &file,
            "node_id = 3\n\
             role = \"region\"\n\
             listen_gossip = \"127.0.0.1:7003\"\n\
             listen_client = \"127.0.0.1:7103\"\n\
             listen_http = \"127.0.0.1:7203\"\n\
             tls = { ca = \"ca.pem\", cert = \"node-3.pem\", key = \"node-3.key\" }\n",
        )
        .unwrap();
        let mut args = no_flags(file);
        let err = args.config().unwrap_err().to_string();
        assert!(
            err.contains("node-3.toml:") && err.contains("data_dir"),
            "no flags, the file alone: {err}"
        );
        args.data_dir = Some(dir.join("data"));
        args.new_ledger = true;
        let config = args.config().unwrap();
        assert_eq!(config.data_dir, Some(dir.join("data")));
        assert!(config.new_ledger);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
