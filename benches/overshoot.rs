//! The overshoot experiment (issue 6): one subject's checks spread over L = 1, 2, 4 and 8
//! edges at a fixed total rate, approximate mode; the overshoot measured against the bound
//! the decisions reported, connected and isolated.
//!
//! `cargo bench --bench overshoot`. Each row starts a fresh cluster of real `tallyd`
//! processes (`tally daemon`) on loopback with the end-to-end tests' harness and rules:
//! `api` has a limit of 2,000 per window, `stale_after_ms = 600`, `slack = 10`.
//! Connected: the checks run at 1,600 a second in all for 2.5 s, so the limit is passed
//! after 1.25 s. Isolated: one more node is paused (SIGSTOP) before the checks, so every
//! edge decides on its share `2000 / (L + 1) + 10`.
#![allow(
    clippy::unwrap_used,
    reason = "a benchmark that cannot run its cluster has nothing to report"
)]

#[path = "../tests/cluster/mod.rs"]
mod cluster;

use cluster::{paced_checks, Cluster, Outcome};
use std::time::Duration;
use tally_client::Mode;

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
        let isolated = runtime.block_on(isolated(edges));
        row(edges, "isolated", &isolated);
    }
}

fn row(edges: u64, mode: &str, outcome: &Outcome) {
    let overshoot = (outcome.allowed - LIMIT).max(0);
    let modes: Vec<&str> = outcome.modes.iter().map(|m| m.as_str()).collect();
    println!(
        "| {edges} | {mode} ({}) | {} | {overshoot} | {:.1} | {} |",
        modes.join(", "),
        outcome.allowed,
        outcome.max_bound,
        overshoot as f64 <= outcome.max_bound
    );
}

async fn connected(edges: u64) -> Outcome {
    let cluster = Cluster::start_with(10, edges, 60_000, false);
    let nodes: Vec<u64> = (1..=edges).collect();
    paced_checks(&cluster, &nodes, "api", "hot", TOTAL_PER_SEC / edges, RUN).await
}

async fn isolated(edges: u64) -> Outcome {
    let cluster = Cluster::start_with(10, edges + 1, 60_000, false);
    cluster.nodes[edges as usize].signal("STOP");
    let probe = cluster.nodes[0].client().await;
    for _ in 0..200 {
        if probe.check("api", "probe", 1).await.unwrap().mode == Mode::ApproximateIsolated {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let nodes: Vec<u64> = (1..=edges).collect();
    let outcome = paced_checks(
        &cluster,
        &nodes,
        "api",
        "cut-off",
        TOTAL_PER_SEC / edges,
        RUN,
    )
    .await;
    cluster.nodes[edges as usize].signal("CONT");
    outcome
}
