//! `CounterMap`'s own operations on 100,000 keys: an own write to a held key, a whole map's
//! delta to an empty peer, applying it, and reading every key's value.
//!
//! There is no peer crate with the same operations (a map of PN-counters with per-origin
//! versions); its peer is an older build of this file's subject, measured in the same run
//! from a worktree (see BENCHMARKS.md, "map"). Run with
//! `cargo bench --bench map -- --warm-up-time 1 --measurement-time 3`.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use std::hint::black_box;
use tally_crdt::{
    CounterMap, Digest, Generation, Key, NodeId, ReplicaId, Rule, Stamp, Subject, Window,
};

const KEYS: usize = 100_000;
const NOW_UNIX_SECS: u64 = 1_700_000_000;

fn keys() -> Vec<Key> {
    let rule = Rule::new("login").expect("a valid rule name");
    let window = Window::containing(NOW_UNIX_SECS, 60).expect("a valid window");
    (0..KEYS)
        .map(|i| {
            let subject = Subject::new(format!("user-{i:06}")).expect("a valid subject");
            Key::new(rule.clone(), subject, window)
        })
        .collect()
}

fn replica(node: u64) -> ReplicaId {
    ReplicaId::new(NodeId(node), Generation(1))
}

/// A map with one own lane of replica 1 at every key.
fn written(keys: &[Key]) -> CounterMap {
    let mut map = CounterMap::new();
    for key in keys {
        map.incr(replica(1), key, 1, Stamp(1))
            .expect("one increment cannot overflow");
    }
    map
}

fn bench(c: &mut Criterion) {
    let keys = keys();
    let mut map = written(&keys);
    let mut group = c.benchmark_group("map");

    // xorshift over the held keys, so the writes do not follow the keys' order.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    group.bench_function("incr_held_key", |b| {
        b.iter(|| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let key = &keys[(state % KEYS as u64) as usize];
            black_box(map.incr(replica(1), key, 1, Stamp(2)))
        })
    });

    group.sample_size(10);
    group.bench_function("delta_for_100k_lanes", |b| {
        b.iter(|| black_box(map.delta_for(&Digest::default(), usize::MAX, 0)))
    });
    let delta = map.delta_for(&Digest::default(), usize::MAX, 0);
    group.bench_function("apply_100k_lanes", |b| {
        b.iter_batched(
            CounterMap::new,
            |mut peer| {
                black_box(peer.apply(&delta, NOW_UNIX_SECS));
                peer
            },
            BatchSize::LargeInput,
        )
    });
    group.bench_function("value_of_100k_keys", |b| {
        b.iter(|| keys.iter().map(|key| map.value(key)).sum::<i128>())
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
