//! The protocol under faults, in the seeded simulator. Every test checks MONO after every
//! step and FINAL after heal; a failure prints its seed and the command to replay it.
#![cfg(feature = "sim")]

use std::time::Duration;
use tally_gossip::sim::{seeds, Faults, Sim, SimConfig};

const SECOND: Duration = Duration::from_secs(1);

/// Each node counts for a few subjects, one hot subject shared by all.
fn workload(sim: &mut Sim, nodes: usize, step: u64) {
    for node in 0..nodes {
        sim.incr(node, "hot", 1);
        sim.incr(
            node,
            &format!("user-{}", (step as usize * 7 + node) % 13),
            1 + step % 3,
        );
    }
}

/// Writes for `span`, one workload step every 10 ms.
fn write_for(sim: &mut Sim, nodes: usize, span: Duration) {
    let steps = span.as_millis() as u64 / 10;
    for step in 0..steps {
        workload(sim, nodes, step);
        sim.run_for(Duration::from_millis(10));
    }
}

fn heal_and_check(sim: &mut Sim, test: &str, limit: Duration) -> Duration {
    sim.heal();
    let took = sim.run_until_converged(limit);
    assert!(
        took.is_some(),
        "no convergence within {limit:?}; replay: {}",
        tally_gossip::sim::replay_hint(test, 0)
    );
    sim.check_final();
    sim.assert_clean(test);
    took.unwrap_or_default()
}

#[test]
fn fault_free_cluster_converges_to_the_truth_within_the_staleness_bound() {
    for seed in seeds(1, 5) {
        let mut config = SimConfig::new(8, seed);
        config.staleness_bound =
            Some(config.gossip_interval + config.push_interval * 2 + Duration::from_millis(5));
        let mut sim = Sim::new(config);
        sim.run_for(SECOND);
        write_for(&mut sim, 8, 2 * SECOND);
        heal_and_check(
            &mut sim,
            "fault_free_cluster_converges_to_the_truth_within_the_staleness_bound",
            5 * SECOND,
        );
    }
}
