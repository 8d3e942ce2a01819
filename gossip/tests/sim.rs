//! The protocol under faults, in the seeded simulator. Every test checks FINAL after heal,
//! and every test but the long partition's (N8, whose lanes are too many to snapshot each
//! step) checks MONO after every step; a failure prints its seed and the command to
//! replay it.
#![cfg(feature = "sim")]

use std::time::Duration;
use tally_crdt::Counter;
use tally_gossip::membership::State;
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
    // MONO's violations first: a merge that loses updates may also never converge.
    sim.assert_clean(test);
    assert!(
        took.is_some(),
        "no convergence within {limit:?}: {:?}; replay: {}",
        sim.divergence(),
        tally_gossip::sim::replay_hint(test, sim.seed())
    );
    sim.check_final();
    sim.assert_clean(test);
    took.unwrap_or_default()
}

/// How long after node `from` counts one for `subject` every running node of `nodes`
/// holds it, looked at every millisecond up to `limit`; `None` if not by then.
fn visible_everywhere_after(
    sim: &mut Sim,
    nodes: usize,
    from: usize,
    subject: &str,
    limit: Duration,
) -> Option<Duration> {
    let (key, replica) = (sim.key(from, subject), sim.replica(from));
    assert!(sim.incr(from, subject, 1), "node {from} is running");
    let start = sim.time();
    loop {
        let holds = |index: usize| {
            sim.gossip(index).is_none_or(|gossip| {
                let counter = gossip.map().counter(&key);
                counter.is_some_and(|counter| counter.lane(replica).incr >= 1)
            })
        };
        if (0..nodes).all(holds) {
            return Some(sim.time() - start);
        }
        if sim.time() - start >= limit {
            return None;
        }
        sim.run_for(Duration::from_millis(1));
    }
}

#[test]
fn fault_free_cluster_converges_to_the_truth_within_the_staleness_bound() {
    for seed in seeds(1, 5) {
        let mut config = SimConfig::new(8, seed);
        config.staleness_bound =
            Some(config.gossip_interval + config.push_interval * 2 + Duration::from_millis(5));
        // A write reaches every node by eager push: batched for at most a push interval,
        // then one link (docs/protocol.md, W_write), where anti-entropy alone takes rounds.
        // (From a review of the tests, session 46: the staleness bound above is set by the
        // idle heartbeat's round, so it passed with eager push switched off.)
        let write_window =
            config.push_interval + config.faults.delay_max + Duration::from_millis(1);
        let mut sim = Sim::new(config);
        sim.run_for(SECOND);
        write_for(&mut sim, 8, 2 * SECOND);
        for from in 0..8 {
            let took =
                visible_everywhere_after(&mut sim, 8, from, &format!("probe-{from}"), SECOND);
            assert!(
                took.is_some_and(|took| took <= write_window),
                "seed {seed}: a write on node {from} was everywhere after {took:?}, past \
                 W_write = {write_window:?}"
            );
        }
        heal_and_check(
            &mut sim,
            "fault_free_cluster_converges_to_the_truth_within_the_staleness_bound",
            5 * SECOND,
        );
    }
}

#[test]
fn partitioned_nodes_converge_after_heal() {
    for seed in seeds(100, 20) {
        let mut sim = Sim::new(SimConfig::new(4, seed));
        sim.run_for(SECOND);
        sim.network().partition(&[0, 1], &[2, 3]);
        write_for(&mut sim, 4, 3 * SECOND);
        heal_and_check(
            &mut sim,
            "partitioned_nodes_converge_after_heal",
            10 * SECOND,
        );
    }
}

#[test]
fn one_way_partition_neither_wedges_nor_loses_counts() {
    for seed in seeds(200, 10) {
        let mut sim = Sim::new(SimConfig::new(4, seed));
        sim.run_for(SECOND);
        sim.network().cut(0, 1);
        sim.network().cut(0, 2);
        write_for(&mut sim, 4, 3 * SECOND);
        // Still cut: nodes 1 and 2 hear node 0 only through node 3. Neither takes it for
        // dead, and both hold its lanes as node 3 does, once relaying has caught up.
        sim.run_for(2 * SECOND);
        let origin = sim.replica(0);
        let hot = sim.key(0, "hot");
        let direct = sim.gossip(3).unwrap().map().lane(&hot, origin);
        assert!(direct.incr > 0, "seed {seed}: node 3 holds node 0's writes");
        for cut_off in [1, 2] {
            let gossip = sim.gossip(cut_off).unwrap();
            assert_eq!(
                gossip.members().state(origin.node),
                Some(State::Alive),
                "seed {seed}: node {cut_off} evicted node 0"
            );
            assert_eq!(
                gossip.map().lane(&hot, origin),
                direct,
                "seed {seed}: node {cut_off} holds node 0's lane as relayed"
            );
        }
        heal_and_check(
            &mut sim,
            "one_way_partition_neither_wedges_nor_loses_counts",
            10 * SECOND,
        );
    }
}

#[test]
fn a_long_partition_with_a_hundred_thousand_keys_per_side_heals_in_frames_under_the_limit() {
    // TESTING.md N8: two nodes a side, each side changing 10^5 keys while cut off, healed
    // within 60 s (44 s in this seed's run, 175 s when a frame held only the lanes its
    // byte budget priced at their largest encoding).
    let mut config = SimConfig::new(4, 700);
    // A snapshot of every lane per step would cost more than the run; FINAL still holds.
    config.check_every_step = false;
    // Rounds as long as `tallyd`'s default: a round's frames limit how fast it heals.
    config.gossip_interval = SECOND;
    let frame_bytes_max = config.frame_bytes_max;
    let mut sim = Sim::new(config);
    sim.run_for(SECOND);
    sim.network().partition(&[0, 1], &[2, 3]);
    for node in 0..4 {
        for key in 0..50_000 {
            sim.incr(node, &format!("n{node}-k{key}"), 1 + key % 5);
        }
        sim.run_for(Duration::from_millis(100));
    }
    sim.run_for(5 * SECOND);
    sim.heal();
    let mut took = None;
    for seconds in 1..=60 {
        sim.run_for(SECOND);
        if sim.converged() {
            took = Some(seconds);
            break;
        }
    }
    let test =
        "a_long_partition_with_a_hundred_thousand_keys_per_side_heals_in_frames_under_the_limit";
    assert!(
        took.is_some(),
        "not converged 60 s after heal: {:?}; replay: {}",
        sim.divergence(),
        tally_gossip::sim::replay_hint(test, sim.seed())
    );
    sim.check_final();
    sim.assert_clean(test);
    // Catch-up frames were filled past half the limit, and none was over it.
    let largest = sim.network().largest_frame();
    assert!(
        largest > frame_bytes_max / 2 && largest <= frame_bytes_max,
        "the largest frame was {largest} bytes, the limit {frame_bytes_max}"
    );
    for node in 0..4 {
        let oversize = sim
            .gossip(node)
            .map(|gossip| gossip.stats().frames_oversize);
        assert_eq!(oversize, Some(0), "node {node}");
    }
}

#[test]
fn random_link_cuts_restored_in_random_order_converge() {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    for seed in seeds(300, 20) {
        let nodes = 6;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut sim = Sim::new(SimConfig::new(nodes, seed));
        sim.run_for(SECOND);
        let mut links: Vec<(usize, usize)> = (0..nodes)
            .flat_map(|a| (0..nodes).filter(move |&b| b != a).map(move |b| (a, b)))
            .collect();
        links.shuffle(&mut rng);
        for (step, &(a, b)) in links.iter().enumerate() {
            sim.network().cut(a, b);
            workload(&mut sim, nodes, step as u64);
            sim.run_for(Duration::from_millis(50));
        }
        links.shuffle(&mut rng);
        for (step, &(a, b)) in links.iter().enumerate() {
            sim.network().restore(a, b);
            workload(&mut sim, nodes, step as u64);
            sim.run_for(Duration::from_millis(50));
        }
        heal_and_check(
            &mut sim,
            "random_link_cuts_restored_in_random_order_converge",
            10 * SECOND,
        );
    }
}

#[test]
fn duplicated_reordered_and_replayed_frames_merge_idempotently() {
    for seed in seeds(400, 20) {
        let mut config = SimConfig::new(5, seed);
        config.faults = Faults {
            loss: 0.05,
            duplicate: 0.2,
            replay: 0.1,
            replay_age_max: Duration::from_secs(60),
            delay_min: Duration::from_millis(1),
            delay_max: Duration::from_millis(80),
        };
        let mut sim = Sim::new(config);
        write_for(&mut sim, 5, 3 * SECOND);
        sim.run_for(60 * SECOND);
        write_for(&mut sim, 5, SECOND);
        // Replays up to a minute old have been delivered meanwhile (TESTING.md N7).
        let (replayed, oldest) = sim.network().replays();
        assert!(
            replayed > 100 && oldest >= 55 * SECOND,
            "seed {seed}: {replayed} replays, the oldest {oldest:?} old"
        );
        heal_and_check(
            &mut sim,
            "duplicated_reordered_and_replayed_frames_merge_idempotently",
            10 * SECOND,
        );
    }
}

#[test]
fn restart_with_state_loss_takes_a_new_generation_and_loses_nothing_others_held() {
    for seed in seeds(500, 10) {
        let mut sim = Sim::new(SimConfig::new(4, seed));
        sim.run_for(SECOND);
        write_for(&mut sim, 4, SECOND);
        let before = sim.replica(2);
        sim.crash(2, false);
        write_for(&mut sim, 4, SECOND);
        sim.restart(2);
        assert_ne!(sim.replica(2), before);
        write_for(&mut sim, 4, SECOND);
        heal_and_check(
            &mut sim,
            "restart_with_state_loss_takes_a_new_generation_and_loses_nothing_others_held",
            10 * SECOND,
        );
    }
}

#[test]
fn a_restart_that_reuses_its_lost_lane_is_caught_by_final() {
    let mut config = SimConfig::new(4, 600);
    config.reuse_generation_on_state_loss = true;
    let mut sim = Sim::new(config);
    sim.run_for(SECOND);
    write_for(&mut sim, 4, SECOND);
    sim.crash(2, false);
    sim.run_for(SECOND);
    sim.restart(2);
    write_for(&mut sim, 4, SECOND);
    sim.heal();
    sim.run_until_converged(10 * SECOND);
    sim.check_final();
    assert!(
        sim.violations().iter().any(|v| v.starts_with("FINAL")),
        "the checker must see increments swallowed by a reused lane"
    );
    assert!(
        sim.violations().iter().any(|v| v.starts_with("GENERATION")),
        "the restarted node must find its replica id used before"
    );
}

#[test]
fn restart_with_state_keeps_its_generation() {
    for seed in seeds(700, 10) {
        let mut sim = Sim::new(SimConfig::new(4, seed));
        write_for(&mut sim, 4, SECOND);
        let before = sim.replica(1);
        sim.crash(1, true);
        write_for(&mut sim, 4, SECOND);
        sim.restart(1);
        assert_eq!(sim.replica(1), before);
        write_for(&mut sim, 4, SECOND);
        heal_and_check(
            &mut sim,
            "restart_with_state_keeps_its_generation",
            10 * SECOND,
        );
    }
}

/// A Syn leaves out origins its sender holds no lanes of and heard from within two rounds
/// (their heartbeats reach every peer directly). A node whose link from such an origin is
/// cut must still hear it, by relay, before and after the origin restarts as a new
/// generation it never heard directly.
#[test]
fn a_node_cut_off_from_an_idle_origin_hears_it_by_relay() {
    use tally_crdt::NodeId;
    use tally_gossip::membership::State;
    const CUT_OFF: usize = 2;
    const IDLE: usize = 5;
    for seed in seeds(1_100, 10) {
        let mut sim = Sim::new(SimConfig::new(8, seed));
        sim.run_for(SECOND);
        sim.network().cut(IDLE, CUT_OFF);
        for life in 0..2 {
            if life == 1 {
                sim.crash(IDLE, false);
                sim.run_for(Duration::from_millis(300));
                sim.restart(IDLE);
            }
            sim.run_for(SECOND);
            let mut worst = Duration::ZERO;
            for _ in 0..300 {
                sim.run_for(Duration::from_millis(10));
                let wall = sim.wall(CUT_OFF);
                let gossip = sim.gossip(CUT_OFF).expect("never crashed");
                let replica = sim.replica(IDLE);
                let staleness = gossip.staleness(wall).get(&replica).copied();
                let staleness = staleness.unwrap_or_else(|| {
                    panic!("seed {seed}, life {life}: node {CUT_OFF} does not hold {replica}")
                });
                worst = worst.max(staleness);
                assert_eq!(
                    gossip.members().state(NodeId(IDLE as u64)),
                    Some(State::Alive),
                    "seed {seed}, life {life}"
                );
            }
            // Two rounds before a Syn lists the stamp, one more before a relay is worth
            // it, and up to two more before the next exchange with a node that holds it.
            assert!(
                worst <= Duration::from_millis(500),
                "seed {seed}, life {life}: {worst:?} old at worst; replay: {}",
                tally_gossip::sim::replay_hint(
                    "a_node_cut_off_from_an_idle_origin_hears_it_by_relay",
                    seed
                )
            );
        }
        heal_and_check(
            &mut sim,
            "a_node_cut_off_from_an_idle_origin_hears_it_by_relay",
            30 * SECOND,
        );
    }
}

#[test]
fn pause_past_the_failure_detector_and_resume_counts_nothing_twice() {
    use tally_crdt::NodeId;
    use tally_gossip::membership::State;
    for seed in seeds(800, 10) {
        let mut sim = Sim::new(SimConfig::new(4, seed));
        write_for(&mut sim, 4, SECOND);
        sim.pause(3);
        write_for(&mut sim, 3, 2 * SECOND);
        sim.run_for(5 * SECOND);
        let seen = sim.gossip(0).and_then(|g| g.members().state(NodeId(3)));
        assert_eq!(
            seen,
            Some(State::Dead),
            "seed {seed}: the paused node must be declared dead"
        );
        sim.resume(3);
        write_for(&mut sim, 4, SECOND);
        let seen = sim.gossip(0).and_then(|g| g.members().state(NodeId(3)));
        assert_eq!(
            seen,
            Some(State::Alive),
            "seed {seed}: the resumed node must be alive again"
        );
        heal_and_check(
            &mut sim,
            "pause_past_the_failure_detector_and_resume_counts_nothing_twice",
            10 * SECOND,
        );
    }
}

/// TESTING.md L4. Every restart takes a new generation, as `tallyd`'s does: half keep
/// their state (`restart_as_tallyd`: the earlier lives' own lanes re-published in the new
/// life), half lose it.
#[test]
fn thousands_of_restarts_keep_lanes_per_key_bounded() {
    let mut config = SimConfig::new(4, 900);
    config.window_secs = 10;
    let mut sim = Sim::new(config);
    let first = sim.replica(3);
    for cycle in 0..2_000u64 {
        sim.incr(3, "hot", 1);
        sim.incr(0, "hot", 1);
        sim.run_for(Duration::from_millis(20));
        let keep_state = cycle % 2 == 0;
        sim.crash(3, keep_state);
        sim.run_for(Duration::from_millis(5));
        sim.restart_as_tallyd(3);
    }
    assert!(
        sim.replica(3).generation.0 >= first.generation.0 + 2_000,
        "every restart took a new generation"
    );
    // Past two window lengths every retired generation's lanes have expired.
    sim.run_for(25 * SECOND);
    write_for(&mut sim, 4, SECOND);
    heal_and_check(
        &mut sim,
        "thousands_of_restarts_keep_lanes_per_key_bounded",
        10 * SECOND,
    );
    let lanes = sim.lanes_per_key_max();
    assert!(lanes <= 4 + 16, "{lanes} lanes on one key after expiry");
    let origins = sim.origins_max();
    assert!(origins <= 4 + 16, "{origins} origins held after expiry");
}

/// TESTING.md T1: one node's clock 90 s ahead (even seeds) or behind (odd ones), as far
/// as the lane-rate check allows a writer's clock (`LANE_RATE_SKEW_SECS`).
#[test]
fn one_node_clock_skew_keeps_windows_fixed_by_the_key() {
    for seed in seeds(1_000, 10) {
        let mut config = SimConfig::new(4, seed);
        config.window_secs = 60;
        let mut sim = Sim::new(config);
        let skew = if seed % 2 == 0 { 90_000 } else { -90_000 };
        sim.set_skew(2, skew);
        write_for(&mut sim, 4, 3 * SECOND);
        heal_and_check(
            &mut sim,
            "one_node_clock_skew_keeps_windows_fixed_by_the_key",
            10 * SECOND,
        );
        // Each node wrote in the window its own clock was in: node 2 in one 90 s from the
        // others' (so another window of 60 s). A node behind holds both, the one in its
        // future included, and FINAL checked each at the truth. (Ahead of it, the window
        // of a clock 90 s behind has ended.)
        let behind = if skew > 0 { 0 } else { 2 };
        let held = sim.gossip(behind).unwrap().map();
        let windows: std::collections::BTreeSet<u64> = held
            .iter()
            .map(|(key, _)| key.window().start_unix_secs())
            .collect();
        assert_eq!(
            windows.len(),
            2,
            "seed {seed}, skew {skew} ms, node {behind}: {windows:?}"
        );
    }
}

#[test]
fn a_clock_stepping_back_an_hour_and_forward_again_loses_nothing_and_never_panics() {
    // TESTING.md T2: timers run on the monotonic clock; stamps and windows on the wall.
    for seed in seeds(1_100, 10) {
        let mut sim = Sim::new(SimConfig::new(4, seed));
        write_for(&mut sim, 4, SECOND);
        sim.set_skew(1, -3_600_000);
        write_for(&mut sim, 4, 2 * SECOND);
        sim.set_skew(1, 0);
        write_for(&mut sim, 4, SECOND);
        heal_and_check(
            &mut sim,
            "a_clock_stepping_back_an_hour_and_forward_again_loses_nothing_and_never_panics",
            10 * SECOND,
        );
    }
}

#[test]
fn a_node_whose_clock_steps_back_stays_fresh_and_alive_at_its_peers() {
    // Its stamps, which never go back, would otherwise repeat its last one for as long as
    // the step: every peer would read it stale (isolated decisions), and one that hears it
    // only by relay would declare it dead.
    for seed in seeds(1_300, 5) {
        let mut sim = Sim::new(SimConfig::new(4, seed));
        write_for(&mut sim, 4, SECOND);
        sim.network().cut(1, 2);
        sim.set_skew(1, -30_000);
        write_for(&mut sim, 4, 10 * SECOND);
        let node = sim.replica(1);
        for peer in [0, 2, 3] {
            let gossip = sim.gossip(peer).unwrap();
            let staleness = gossip.staleness(sim.wall(peer))[&node];
            assert!(
                staleness < Duration::from_secs(1),
                "seed {seed}: peer {peer} reads node 1 {staleness:?} stale"
            );
            assert_eq!(
                gossip.members().state(node.node),
                Some(State::Alive),
                "seed {seed}: peer {peer}"
            );
        }
        sim.network().heal();
        sim.set_skew(1, 0);
        heal_and_check(
            &mut sim,
            "a_node_whose_clock_steps_back_stays_fresh_and_alive_at_its_peers",
            10 * SECOND,
        );
    }
}

#[test]
fn a_clock_stepping_forward_past_the_windows_and_back_loses_nothing() {
    // A wall clock stepped forward by four windows for two seconds, then set back: its
    // node must not drop the windows' lanes, nor skip them in what it merges meanwhile,
    // since their versions stay below its watermarks and no one sends them again.
    for seed in seeds(1_200, 10) {
        let mut config = SimConfig::new(4, seed);
        config.window_secs = 10;
        let mut sim = Sim::new(config);
        write_for(&mut sim, 4, SECOND);
        sim.set_skew(1, 40_000);
        sim.run_for(2 * SECOND);
        sim.set_skew(1, 0);
        heal_and_check(
            &mut sim,
            "a_clock_stepping_forward_past_the_windows_and_back_loses_nothing",
            10 * SECOND,
        );
    }
}

/// Loss, duplication and replays up to 60 s old at random rates, and delays up to a
/// random bound.
fn random_faults(rng: &mut impl rand::Rng) -> Faults {
    Faults {
        loss: rng.gen_range(0.0..0.2),
        duplicate: rng.gen_range(0.0..0.2),
        replay: rng.gen_range(0.0..0.05),
        replay_age_max: Duration::from_secs(60),
        delay_min: Duration::from_millis(1),
        delay_max: Duration::from_millis(rng.gen_range(1..100)),
    }
}

/// One of `kinds` draws for a random node: a crash (keeping its state or not), a
/// restart, a pause, a resume, a link cut or restored, a clock skew, and with
/// `tallyd_restarts` a restart as `tallyd` makes it; the other draws do nothing.
fn random_fault(
    sim: &mut Sim,
    rng: &mut impl rand::Rng,
    nodes: usize,
    (kinds, tallyd_restarts): (u32, bool),
) {
    let node = rng.gen_range(0..nodes);
    match rng.gen_range(0..kinds) {
        0 => sim.crash(node, rng.gen_bool(0.5)),
        1 => sim.restart(node),
        2 => sim.pause(node),
        3 => sim.resume(node),
        4 => sim.network().cut(node, rng.gen_range(0..nodes)),
        5 => sim.network().restore(node, rng.gen_range(0..nodes)),
        6 => sim.set_skew(node, rng.gen_range(-5_000..5_000)),
        7 if tallyd_restarts => sim.restart_as_tallyd(node),
        _ => {}
    }
}

#[test]
fn mixed_faults_over_many_seeds_keep_final_and_mono() {
    use rand::{Rng, SeedableRng};
    for seed in seeds(10_000, 200) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let nodes = rng.gen_range(3..=7);
        let mut config = SimConfig::new(nodes, seed);
        config.faults = random_faults(&mut rng);
        let mut sim = Sim::new(config);
        for step in 0..40u64 {
            workload(&mut sim, nodes, step);
            random_fault(&mut sim, &mut rng, nodes, (10, false));
            sim.run_for(Duration::from_millis(rng.gen_range(10..300)));
        }
        heal_and_check(
            &mut sim,
            "mixed_faults_over_many_seeds_keep_final_and_mono",
            20 * SECOND,
        );
    }
}

/// Found in review (session 37), at seed 2 of 5: with the smallest frames, many long
/// subjects a step, and restarts as `tallyd` makes them (a new generation, no state), nodes
/// catch up an origin through cut sends, which take a holder's watermark past a lane whose
/// current version is above it. Once the origin and every holder of that version lost their
/// state, the lane's earlier copy lived on at some nodes only, at watermarks equal to the
/// others', and FINAL failed for good ("node 0 holds Some(Lane { incr: 2, .. }) at ..
/// Version(266) .., node 1 holds None at .. Version(266)"). `Message::Settled` repairs it.
#[test]
fn mixed_faults_with_small_frames_and_new_lives_keep_final() {
    use rand::{Rng, SeedableRng};
    for seed in seeds(1, 5) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let nodes = rng.gen_range(3..=6);
        let mut config = SimConfig::new(nodes, seed);
        config.frame_bytes_max = tally_gossip::Config::FRAME_BYTES_MIN;
        config.eager_push = rng.gen_bool(0.7);
        config.faults = random_faults(&mut rng);
        let mut sim = Sim::new(config);
        for step in 0..60u64 {
            for node in 0..nodes {
                for k in 0..rng.gen_range(0..40) {
                    let subject = format!("subject-{k}-{}", "x".repeat(rng.gen_range(1..200)));
                    sim.incr(node, &subject, 1 + step % 3);
                }
                sim.incr(node, "hot", 1);
            }
            random_fault(&mut sim, &mut rng, nodes, (12, true));
            sim.run_for(Duration::from_millis(rng.gen_range(10..400)));
        }
        heal_and_check(
            &mut sim,
            "mixed_faults_with_small_frames_and_new_lives_keep_final",
            60 * SECOND,
        );
    }
}

#[test]
fn a_member_that_crashed_while_a_node_was_cut_off_is_found_dead_there_soon_after_the_heal() {
    // Node 0 is cut off for 30 s; meanwhile node 4 writes and, at 15 s, crashes for good.
    // At the heal node 0 hears node 4's newer stamps from the others and takes it as alive
    // again: the 30 s it could not hear it are not its interval, so node 0 must find it
    // dead again within a few of the detector's spans, not after minutes (deciding
    // isolated all that while, on a live member that never sends).
    for seed in seeds(1_300, 5) {
        let mut sim = Sim::new(SimConfig::new(5, seed));
        sim.run_for(SECOND);
        sim.network().partition(&[0], &[1, 2, 3, 4]);
        write_for(&mut sim, 5, 15 * SECOND);
        sim.crash(4, false);
        sim.run_for(15 * SECOND);
        sim.network().heal();
        let gone = sim.replica(4).node;
        // The last tenth of a second of the minute after the heal that node 0 held node 4
        // as anything but dead.
        let mut last_not_dead = 0;
        for tenth in 1..=600 {
            sim.run_for(SECOND / 10);
            if sim.gossip(0).unwrap().members().state(gone) != Some(State::Dead) {
                last_not_dead = tenth;
            }
        }
        assert!(
            last_not_dead > 0,
            "seed {seed}: node 0 never took node 4 back at the heal: the case is not met"
        );
        // The simulator's detector: suspected past phi 8 at 100 ms rounds (about 2 s of
        // silence), dead 2 s later. Without the reset it stayed alive past the minute.
        assert!(
            last_not_dead <= 100,
            "seed {seed}: node 4 not dead at node 0 until {last_not_dead} tenths after the heal"
        );
        heal_and_check(
            &mut sim,
            "a_member_that_crashed_while_a_node_was_cut_off_is_found_dead_there_soon_after_the_heal",
            30 * SECOND,
        );
    }
}

#[test]
fn two_seeds_that_each_found_another_node_first_join_once_they_can() {
    // Nodes 0 and 1 are the seeds. With the links 0-1, 0-2 and 1-3 cut while the nodes
    // start, node 3 finds only node 0 and node 2 only node 1: two pairs, each holding one
    // seed. Once the links are back the pairs must join. A node that knocked on its seeds
    // only while it had no live peer never did: each pair gossiped on its own for good,
    // each holding half the members and half the counts, with no fault left to see.
    use tally_crdt::NodeId;
    for seed in seeds(1, 5) {
        let mut sim = Sim::new(SimConfig::new(4, seed));
        for (a, b) in [(0, 1), (0, 2), (1, 3)] {
            sim.network().cut(a, b);
            sim.network().cut(b, a);
        }
        write_for(&mut sim, 4, SECOND);
        let alive = |sim: &Sim, node: usize| {
            sim.gossip(node)
                .unwrap()
                .members()
                .others_in(&[State::Alive])
        };
        assert_eq!(
            (alive(&sim, 0), alive(&sim, 1)),
            (vec![NodeId(3)], vec![NodeId(2)]),
            "seed {seed}: the pairs formed"
        );
        let test = "two_seeds_that_each_found_another_node_first_join_once_they_can";
        heal_and_check(&mut sim, test, 5 * SECOND);
        assert!(sim.joined(), "seed {seed}: {test}");
    }
}
