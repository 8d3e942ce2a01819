//! Merge: tally's `PnCounter::merge` against the `crdts` crate's `PNCounter` merge.
//!
//! Each side holds two counters that both carry a lane for every one of N replicas, with
//! different totals, so the merge visits every lane and takes the larger total from each
//! side about half the time. The timed routine merges an owned copy of the incoming
//! counter into a copy of the local one and frees the incoming copy, because `crdts`'s
//! `CvRDT::merge` takes the incoming counter by value and frees it inside the merge; the
//! copies are made outside the timing by `iter_batched`, the same way for both sides.
//! `tally/borrowed` is the same merge with the incoming counter borrowed and freed outside
//! the timing, which is how tally's API is meant to be used.
//!
//! Both sides use tally's `ReplicaId` as the actor type. Run with
//! `cargo bench --bench merge -- --warm-up-time 1 --measurement-time 3`.

use crdts::{CmRDT, CvRDT, PNCounter};
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use std::hint::black_box;
use tally_crdt::{Counter, Generation, NodeId, PnCounter, ReplicaId};

const REPLICAS: [u64; 3] = [8, 64, 256];

fn replica(node: u64) -> ReplicaId {
    ReplicaId::new(NodeId(node), Generation(1))
}

/// The totals `(incr, decr)` of replica `i`'s lane in the local (`side == 0`) or incoming
/// (`side == 1`) counter: the incoming side is ahead on even replicas' increments and on
/// odd replicas' decrements, so neither counter covers the other.
fn totals(i: u64, side: u64) -> (u64, u64) {
    let ahead = (i + side).is_multiple_of(2);
    let incr = 1_000 + 7 * i + if ahead { 13 } else { 0 };
    let decr = 1 + 3 * i + if ahead { 0 } else { 5 };
    (incr, decr)
}

fn tally_counter(n: u64, side: u64) -> PnCounter {
    let mut counter = PnCounter::new();
    for i in 0..n {
        let (incr, decr) = totals(i, side);
        counter
            .incr(replica(i), incr)
            .expect("bench totals are far below u64::MAX");
        counter
            .decr(replica(i), decr)
            .expect("bench totals are far below u64::MAX");
    }
    counter
}

fn crdts_counter(n: u64, side: u64) -> PNCounter<ReplicaId> {
    let mut counter = PNCounter::new();
    for i in 0..n {
        let (incr, decr) = totals(i, side);
        let op = counter.inc_many(replica(i), incr);
        counter.apply(op);
        let op = counter.dec_many(replica(i), decr);
        counter.apply(op);
    }
    counter
}

fn merge(c: &mut Criterion) {
    let mut group = c.benchmark_group("merge");
    for n in REPLICAS {
        let (ours_local, ours_incoming) = (tally_counter(n, 0), tally_counter(n, 1));
        let (theirs_local, theirs_incoming) = (crdts_counter(n, 0), crdts_counter(n, 1));

        // Both sides must compute the same thing before their times mean anything.
        let mut ours = ours_local.clone();
        ours.merge(&ours_incoming);
        let mut theirs = theirs_local.clone();
        theirs.merge(theirs_incoming.clone());
        assert_eq!(ours.lanes(), n as usize);
        assert_eq!(
            ours.value().to_string(),
            theirs.read().to_string(),
            "tally and crdts disagree on the merged value at {n} replicas"
        );

        group.bench_with_input(BenchmarkId::new("tally", n), &n, |b, _| {
            b.iter_batched(
                || (ours_local.clone(), ours_incoming.clone()),
                |(mut local, incoming)| {
                    local.merge(black_box(&incoming));
                    drop(incoming);
                    local
                },
                BatchSize::SmallInput,
            )
        });
        group.bench_with_input(BenchmarkId::new("crdts", n), &n, |b, _| {
            b.iter_batched(
                || (theirs_local.clone(), theirs_incoming.clone()),
                |(mut local, incoming)| {
                    local.merge(black_box(incoming));
                    local
                },
                BatchSize::SmallInput,
            )
        });
        group.bench_with_input(BenchmarkId::new("tally/borrowed", n), &n, |b, _| {
            b.iter_batched_ref(
                || ours_local.clone(),
                |local| local.merge(black_box(&ours_incoming)),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, merge);
criterion_main!(benches);
