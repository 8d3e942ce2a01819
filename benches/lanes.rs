//! The hot path: an own-lane increment plus an estimate read in tally's `LaneStore`,
//! against one keyed check in the `governor` crate's rate limiter.
//!
//! Both sides hold the same 100,000 pre-created keys (tally's `Key`, which both accept:
//! governor keys by any `Hash + Eq + Clone` type), walk the same pre-generated random
//! sequence of key indices, and run on the same number of threads. One operation is, for
//! tally, `incr(&key, 1)`, which hands back the estimate it leaves (one lookup); for governor, `check_key(&key)` with a
//! quota so large that it never refuses. Each thread times its own run after a barrier
//! and the slowest thread's time is reported, so thread start-up is not counted; the
//! throughput is operations over all threads per second of that wall time.
//!
//! Run with `cargo bench --bench lanes -- --warm-up-time 1 --measurement-time 3`.
#![allow(clippy::disallowed_methods)] // benches measure wall time

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use governor::{Quota, RateLimiter};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::time::{Duration, Instant};
use tally_crdt::{Generation, Key, NodeId, ReplicaId, Rule, Subject, Window};
use tally_node::store::LaneStore;

const KEYS: usize = 100_000;
/// Length of the pre-generated access sequence: a power of two, larger than the key count
/// so that a run does not replay a short pattern the caches could learn.
const SEQUENCE_LEN: usize = 1 << 20;
const THREADS: [usize; 2] = [1, 2];
const NOW_UNIX_SECS: u64 = 1_700_000_000;

fn keys() -> Vec<Key> {
    let rule = Rule::new("login").expect("a valid rule name");
    let window = Window::containing(NOW_UNIX_SECS, 60).expect("a valid window");
    (1..=KEYS)
        .map(|i| {
            let subject = Subject::new(format!("user-{i:06}")).expect("a valid subject");
            Key::new(rule.clone(), subject, window)
        })
        .collect()
}

/// Key indices drawn uniformly by splitmix64 from a fixed seed: the same on every run and
/// for both sides.
fn sequence() -> Vec<u32> {
    let mut state: u64 = 0x7a11_7a11_7a11_7a11;
    (0..SEQUENCE_LEN)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z % KEYS as u64) as u32
        })
        .collect()
}

/// Runs `op` `iters` times on each of `threads` threads, each thread starting at its own
/// offset in `sequence`, and returns the slowest thread's time.
fn run_threads(
    threads: usize,
    iters: u64,
    sequence: &[u32],
    op: impl Fn(usize) + Sync,
) -> Duration {
    let barrier = Barrier::new(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, op) = (&barrier, &op);
                scope.spawn(move || {
                    let mut at = t * SEQUENCE_LEN / threads;
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..iters {
                        op(sequence[at] as usize);
                        at = (at + 1) & (SEQUENCE_LEN - 1);
                    }
                    start.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a bench thread panicked"))
            .max()
            .unwrap_or_default()
    })
}

fn lanes(c: &mut Criterion) {
    let keys = keys();
    let sequence = sequence();

    let store = LaneStore::new(ReplicaId::new(NodeId(1), Generation(1)), KEYS);
    for key in &keys {
        store
            .incr(key, 1)
            .expect("the store has room for every key");
        store.publish_remote(key, 5).expect("the key exists");
    }
    assert_eq!(store.len(), KEYS);
    assert_eq!(store.estimate(&keys[0]), 6);

    let quota = Quota::per_second(NonZeroU32::MAX);
    let limiter = RateLimiter::keyed(quota);
    for key in &keys {
        assert!(limiter.check_key(key).is_ok(), "the quota never refuses");
    }
    assert_eq!(limiter.len(), KEYS);

    let mut group = c.benchmark_group("incr_and_read");
    for threads in THREADS {
        group.throughput(Throughput::Elements(threads as u64));
        group.bench_with_input(BenchmarkId::new("tally", threads), &threads, |b, &t| {
            b.iter_custom(|iters| {
                run_threads(t, iters, &sequence, |i| {
                    // One lookup: the write hands back the estimate it leaves.
                    let counted = store
                        .incr(&keys[i], 1)
                        .expect("the key exists and cannot overflow");
                    black_box(counted.estimate);
                })
            })
        });
        group.bench_with_input(BenchmarkId::new("governor", threads), &threads, |b, &t| {
            b.iter_custom(|iters| {
                run_threads(t, iters, &sequence, |i| {
                    black_box(limiter.check_key(&keys[i]).is_ok());
                })
            })
        });
    }
    group.finish();
}

criterion_group!(benches, lanes);
criterion_main!(benches);
