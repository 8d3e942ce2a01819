//! `tally`: the command-line tool. Makes cluster certificates, talks to a sidecar
//! (`get`, `incr`, `decr`, `check`, `status`, and `forget` on its HTTP port), runs the
//! daemon (`tally daemon`, the same as `tallyd`), and runs the demo (`tally demo`).

mod demo;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;
use tally_client::{Client, Endpoint, Options};
use tally_crdt::NodeId;
use tally_node::certs::NodeFiles;
use tally_node::cli::DaemonArgs;

// mimalloc, not the system allocator: the region's CPU per exact check fell by 10-15% in
// an A/B run (BENCHMARKS.md), malloc and free having been a fifth of its profile.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "tally",
    version,
    about = "tally: approximate counters at the edge"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Make a cluster CA (or reuse the one in DIR) and a certificate for each node.
    Certs {
        /// Where to write `ca.pem`, `ca.key` and `node-<id>.pem`/`.key` (and `certs.lock`,
        /// held while a run writes, so that runs there go one at a time).
        #[arg(long)]
        out: PathBuf,
        /// Node ids, comma-separated: `1,2,3`.
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<u64>,
    },
    /// Add to a subject's count.
    Incr(Count),
    /// Subtract from a subject's count.
    Decr(Count),
    /// A subject's estimate and its staleness.
    Get(Subject),
    /// Decide whether COST more is allowed, counting it if so.
    Check {
        #[command(flatten)]
        subject: Subject,
        /// What this use costs.
        #[arg(long, default_value_t = 1)]
        cost: u64,
    },
    /// The sidecar's replica, members and keys.
    Status {
        #[command(flatten)]
        sidecar: Sidecar,
    },
    /// Forget a member the sidecar holds dead, for good, so that no node counts what it
    /// may admit unseen any longer: for a node that crashed and will not come back. A life
    /// of it started later is a member again.
    Forget {
        /// The member's node id.
        node: u64,
        /// The sidecar's HTTP address (its `listen_http`).
        #[arg(long)]
        http: std::net::SocketAddr,
    },
    /// Run a node (the same as `tallyd`).
    Daemon(DaemonArgs),
    /// Start a region and edge nodes on loopback, drive a workload, and check the promises.
    Demo(demo::DemoArgs),
}

#[derive(Debug, clap::Args)]
struct Sidecar {
    /// The sidecar: `127.0.0.1:7100` or `unix:/path/to.sock`.
    #[arg(long, default_value = "127.0.0.1:7100")]
    endpoint: Endpoint,
    /// How long to wait for an answer, in milliseconds (at least 1: with none, every
    /// request would time out, perhaps counted).
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    timeout_ms: u64,
}

#[derive(Debug, clap::Args)]
struct Subject {
    /// The rule's name.
    rule: String,
    /// Who is counted.
    subject: String,
    #[command(flatten)]
    sidecar: Sidecar,
}

#[derive(Debug, clap::Args)]
struct Count {
    #[command(flatten)]
    subject: Subject,
    /// How much.
    #[arg(default_value_t = 1)]
    amount: u64,
}

fn main() -> anyhow::Result<()> {
    match Args::parse().command {
        Command::Certs { out, nodes } => {
            let nodes: Vec<NodeId> = nodes.into_iter().map(NodeId).collect();
            let ca_was = if out.join("ca.pem").exists() {
                "kept"
            } else {
                "new"
            };
            // A node's files already there are replaced: say so, as its node goes on with
            // the old ones until it restarts.
            let were: Vec<bool> = (nodes.iter())
                .map(|&node| NodeFiles::in_dir(&out, node).cert.exists())
                .collect();
            let (ca, files) = tally_node::certs::issue_cluster(&out, &nodes)?;
            for (file, was) in files.iter().zip(were) {
                let what = if was {
                    "replaced: its node takes them at its next start"
                } else {
                    "new"
                };
                println!("{} {} ({what})", file.cert.display(), file.key.display());
            }
            println!("{} ({ca_was})", out.join("ca.pem").display());
            if let Some(ends) = ca.ends_early() {
                eprintln!(
                    "tally certs: warning: the CA ({}) ends at {ends}, before the two years a \
                     node certificate is issued for: these end with it, and then every node \
                     refuses its peers. Before then, make a new CA (move ca.pem and ca.key \
                     away), issue every node's certificates under it, and restart the nodes \
                     together: a node trusts only the CAs in its ca.pem, so nodes under \
                     different CAs refuse each other (while they move, a ca.pem may hold both \
                     CA certificates)",
                    out.join("ca.pem").display()
                );
            }
            Ok(())
        }
        Command::Daemon(args) => Ok(tally_node::cli::run(&args)?),
        Command::Demo(args) => demo::run(&args),
        Command::Forget { node, http } => forget(node, http),
        command => client_command(command),
    }
}

/// Asks the sidecar at `http` to forget `node` (`DELETE /members/<node>`), and prints what
/// it answered: the life forgotten, or why not (an error).
fn forget(node: u64, http: std::net::SocketAddr) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let timeout = Duration::from_secs(5);
    let mut stream = std::net::TcpStream::connect_timeout(&http, timeout)
        .with_context(|| format!("connect to the sidecar's HTTP port {http}"))?;
    stream.set_read_timeout(Some(timeout))?;
    // One write: `write!` on a socket writes each piece of the format apart.
    let request = format!("DELETE /members/{node} HTTP/1.1\r\nhost: {http}\r\n\r\n");
    stream.write_all(request.as_bytes())?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .with_context(|| format!("read the answer from {http}"))?;
    anyhow::ensure!(
        !answer.is_empty(),
        "{http} closed the connection without answering"
    );
    // Another port (the client port, say) answers with bytes that are no HTTP: not
    // printed, as they may hold control bytes.
    anyhow::ensure!(
        answer.starts_with(b"HTTP/"),
        "{http} answered with something other than HTTP: is it the node's `listen_http` port?"
    );
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.lines().next().unwrap_or_default();
    anyhow::ensure!(
        status.starts_with("HTTP/1.1 200"),
        "{http} answered {status}: {}",
        body.trim_end()
    );
    println!("{body}");
    Ok(())
}

fn client_command(command: Command) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    runtime.block_on(async {
        let sidecar = match &command {
            Command::Incr(count) | Command::Decr(count) => &count.subject.sidecar,
            Command::Get(subject) | Command::Check { subject, .. } => &subject.sidecar,
            Command::Status { sidecar } => sidecar,
            Command::Certs { .. }
            | Command::Forget { .. }
            | Command::Daemon(_)
            | Command::Demo(_) => unreachable!("handled in main"),
        };
        let options = Options::default().with_timeout(Duration::from_millis(sidecar.timeout_ms));
        let client = Client::connect(sidecar.endpoint.clone(), options).await?;
        match command {
            Command::Incr(count) => {
                let s = &count.subject;
                println!(
                    "{:?}",
                    client.incr(&s.rule, &s.subject, count.amount).await?
                );
            }
            Command::Decr(count) => {
                let s = &count.subject;
                println!(
                    "{:?}",
                    client.decr(&s.rule, &s.subject, count.amount).await?
                );
            }
            Command::Get(s) => println!("{:?}", client.get(&s.rule, &s.subject).await?),
            Command::Check { subject: s, cost } => {
                println!("{:?}", client.check(&s.rule, &s.subject, cost).await?);
            }
            Command::Status { .. } => println!("{:?}", client.status().await?),
            Command::Certs { .. }
            | Command::Forget { .. }
            | Command::Daemon(_)
            | Command::Demo(_) => unreachable!("handled in main"),
        }
        anyhow::Ok(())
    })
}
