//! How long a compaction holds the region's deciding task: the time `Ledger::clone` takes
//! to copy a ledger (what the task does since session 5, the copy then encoded on a
//! blocking thread), beside the time `Ledger::snapshot` takes to encode it (what the task
//! did before), for ledgers of 10,000 to 1,000,000 live keys. No check is decided while
//! the copy is made (ARCHITECTURE.md, "A compaction copies the ledger on the deciding
//! task"). Prints a report; it is not a criterion timing.
//!
//! Run with `cargo bench --bench region_snapshot`.
//!
//! Each ledger is built as the region builds it, by deciding checks: one per key, from
//! `EDGES` edge lives in turn, so each life holds the outcomes of its last
//! `RECENT_IDS` requests (or fewer) as a real region would. Each size is encoded
//! `REPEATS` times into a buffer that starts empty, as the region's does, and copied
//! `REPEATS` times; the median and the largest time of each are printed, with the
//! snapshot's size and entries.

#![allow(clippy::disallowed_methods)] // measures wall time

use std::time::{Duration, Instant};
use tally_node::region::{key_of, log::RequestId, Ledger};
use tally_node::region::{ExactCheck, RECENT_IDS};

const SIZES: [u64; 3] = [10_000, 100_000, 1_000_000];
const EDGES: u64 = 4;
const REPEATS: usize = 5;

fn main() {
    println!(
        "region snapshot: {EDGES} edge lives, each holding at most {RECENT_IDS} outcomes; \
         {REPEATS} snapshots per size"
    );
    println!();
    println!(
        "| live keys | outcomes held | entries | snapshot MiB | encode median ms | encode max ms | clone median ms | clone max ms |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for keys in SIZES {
        let ledger = ledger(keys);
        let mut times = Vec::with_capacity(REPEATS);
        let (mut entries, mut bytes) = (0, 0);
        for _ in 0..REPEATS {
            let mut out = Vec::new();
            let started = Instant::now();
            entries = ledger.snapshot(&mut out);
            times.push(started.elapsed());
            bytes = out.len();
        }
        times.sort();
        let mut clones = Vec::with_capacity(REPEATS);
        for _ in 0..REPEATS {
            let started = Instant::now();
            let frozen = ledger.clone();
            clones.push(started.elapsed());
            drop(frozen);
        }
        clones.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let outcomes = keys.min(EDGES * RECENT_IDS as u64);
        println!(
            "| {keys} | {outcomes} | {entries} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            bytes as f64 / (1024.0 * 1024.0),
            ms(times[REPEATS / 2]),
            ms(times[REPEATS - 1]),
            ms(clones[REPEATS / 2]),
            ms(clones[REPEATS - 1]),
        );
    }
}

/// A ledger holding `keys` keys, each with one admitted check, decided in turn for
/// `EDGES` edge lives.
fn ledger(keys: u64) -> Ledger {
    let mut ledger = Ledger::default();
    for i in 0..keys {
        let check = ExactCheck {
            id: RequestId {
                node: 10 + i % EDGES,
                generation: 1,
                seq: i / EDGES,
            },
            check_id: None,
            rule: "quota".into(),
            subject: format!("acct-{i:07}"),
            window_index: 500_000,
            window_secs: 3_600,
            cost: 1,
        };
        let key = key_of(&check.rule, &check.subject, 500_000, 3_600).expect("a valid key");
        ledger.decide(&check, &key, u64::MAX);
    }
    ledger
}
