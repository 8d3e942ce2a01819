//! The overshoot experiment (issue 6): one subject's checks spread over L = 1, 2, 4 and 8
//! edges at a fixed total rate, approximate mode; the overshoot measured against the bound
//! the decisions reported, connected, and with the cluster partitioned.
//!
//! `cargo bench --bench overshoot`. Each row starts a fresh cluster of real `tallyd`
//! processes (`tally daemon`) on loopback with the end-to-end tests' harness and rules:
//! `api` has a limit of 2,000 per window, `stale_after_ms = 600`, `slack = 10`. The checks
//! run at 1,600 a second in all for 2.5 s, so the limit is passed after 1.25 s.
//!
//! - Connected: nothing is cut.
//! - Partitioned from the start: the nodes are cut in two halves (nftables drops the QUIC
//!   datagrams between them; all keep running and checking), and every edge decides
//!   isolated on its share `2000 / L + 10`. At L = 1 the other half is a second node that
//!   takes no checks, so the share is `2000 / 2 + 10`.
//! - Partitioned at 1 s: the same cut 1 s into the run, before the limit is reached. Until
//!   the other half is `stale_after_ms` old each half decides connected on a view that
//!   lacks the other's admissions since the cut; then isolated.
//!
//! The partitions need root and `nft` (`apt install nftables`), as the end-to-end tests.
#![allow(
    clippy::unwrap_used,
    reason = "a benchmark that cannot run its cluster has nothing to report"
)]

#[path = "../tests/cluster/mod.rs"]
mod cluster;

use cluster::{paced_checks, turn_isolated, Cluster, Outcome};
use std::time::Duration;

const LIMIT: i128 = 2_000;
const TOTAL_PER_SEC: u64 = 1_600;
const RUN: Duration = Duration::from_millis(2_500);

fn main() {
    if std::env::args().any(|arg| arg == "--list") {
        return;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    println!("| L | mode | admitted | overshoot | largest bound reported | within bound |");
    println!("|---|---|---|---|---|---|");
    for edges in [1u64, 2, 4, 8] {
        let connected = runtime.block_on(connected(edges));
        row(edges, "connected", &connected);
        let cut = runtime.block_on(partitioned(edges, Duration::ZERO));
        row(edges, "partitioned from the start", &cut);
        let cut = runtime.block_on(partitioned(edges, Duration::from_secs(1)));
        row(edges, "partitioned at 1 s", &cut);
    }
}

fn row(edges: u64, mode: &str, outcome: &Outcome) {
    let overshoot = (outcome.allowed - LIMIT).max(0);
    let modes: Vec<&str> = outcome.modes.iter().map(|m| m.as_str()).collect();
    // Each admission under an infinite bound (from a node that had not heard every live
    // member yet, or not for a rate sample's time) may be all overshoot.
    let unbounded = if outcome.unbounded > 0 {
        format!(" + {} unbounded", outcome.unbounded)
    } else {
        String::new()
    };
    println!(
        "| {edges} | {mode} ({}) | {} | {overshoot} | {:.1}{unbounded} | {} |",
        modes.join(", "),
        outcome.allowed,
        outcome.max_bound,
        overshoot as f64 <= outcome.bound()
    );
}

async fn connected(edges: u64) -> Outcome {
    let cluster = Cluster::start_with(10, edges, 60_000, false);
    let nodes: Vec<u64> = (1..=edges).collect();
    paced_checks(&cluster, &nodes, "api", "hot", TOTAL_PER_SEC / edges, RUN).await
}

/// The checks on L edges, with the nodes cut in two halves `after` into the run.
async fn partitioned(edges: u64, after: Duration) -> Outcome {
    let nodes = edges.max(2);
    let cluster = Cluster::start_with(10, nodes, 60_000, false);
    cluster.wait_fresh(Duration::from_millis(300));
    let ids: Vec<u64> = (1..=nodes).collect();
    let (a, b) = ids.split_at(ids.len() / 2);
    let checking: Vec<u64> = (1..=edges).collect();
    let checks = paced_checks(
        &cluster,
        &checking,
        "api",
        "cut",
        TOTAL_PER_SEC / edges,
        RUN,
    );
    let cut = async {
        tokio::time::sleep(after).await;
        cluster.partition(a, b)
    };
    if after.is_zero() {
        let _partition = cut.await;
        // A node that never turns isolated shows in the modes column.
        turn_isolated(&cluster.nodes).await;
        checks.await
    } else {
        let (outcome, _partition) = tokio::join!(checks, cut);
        outcome
    }
}
