//! The lane store's memory per key at rest, against issue 2's budget of 64 bytes a key
//! with one own lane, papaya's table included. "At rest" is after the keys are written,
//! their lanes collected and `LaneStore::reclaim` run, as tallyd's gossip task does once a
//! second: past the most keys it has seen held, it finishes a table growth the inserts
//! left half done, and it frees what is retired.
//!
//! At 60,000, 120,000 and 125,000 keys papaya's table has just grown, and the inserts
//! mostly leave that copy half done (at 125,000 every time, in session 41's review), both
//! tables resident: about 69 bytes a key without the finish, 59 to 60 with it
//! (`cargo bench --bench memory`).
//!
//! Only what the store allocates is counted: the keys' strings are the caller's, as in
//! the memory bench.
//!
//! A test binary of its own, with one test: the allocator's counts are the process's, so
//! no other test may run beside it.

use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;
use tally_crdt::{Generation, Key, Lane, NodeId, ReplicaId, Rule, Subject, Window};
use tally_node::store::LaneStore;

#[global_allocator]
static ALLOCATOR: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const BYTES_PER_KEY_MAX: f64 = 64.0;

fn keys(n: usize) -> Vec<Key> {
    let rule = Rule::new("login").expect("a valid rule name");
    let window = Window::containing(1_700_000_000, 60).expect("a valid window");
    (1..=n)
        .map(|i| {
            let subject = Subject::new(format!("user-{i:06}")).expect("a valid subject");
            Key::new(rule.clone(), subject, window)
        })
        .collect()
}

/// The store's live bytes per key once `keys` are written, collected and reclaimed;
/// checks that it still holds every key's lane.
fn bytes_per_key_at_rest(keys: &[Key]) -> f64 {
    let mut collected = Vec::with_capacity(keys.len());
    let region = Region::new(ALLOCATOR);
    let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), keys.len());
    for key in keys {
        store
            .incr(key, 1)
            .expect("the store has room for every key");
    }
    store.collect(&mut collected);
    store.reclaim();
    let change = region.change();
    let live = change.bytes_allocated as f64 - change.bytes_deallocated as f64;

    assert_eq!(
        collected.len(),
        keys.len(),
        "every written key is collected once"
    );
    assert_eq!(store.len(), keys.len());
    for key in keys {
        assert_eq!(store.own(key), Lane::new(1, 0), "{key:?} kept its lane");
    }
    live / keys.len() as f64
}

#[test]
fn a_store_at_rest_holds_at_most_64_bytes_a_key_just_after_its_table_grew() {
    for n in [60_000, 120_000, 125_000] {
        let keys = keys(n);
        let per_key = bytes_per_key_at_rest(&keys);
        assert!(
            per_key <= BYTES_PER_KEY_MAX,
            "{n} keys: {per_key:.1} bytes a key at rest, over {BYTES_PER_KEY_MAX}"
        );
    }
}
