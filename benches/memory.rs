//! Memory per key: live heap bytes that the lane store, the counter map and the decision
//! view's remote rates hold per key, and per extra remote lane. Prints a report; it is not
//! a criterion timing.
//!
//! Run with `cargo bench --bench memory`; `TALLY_MEMORY_KEYS=n` measures `n` keys instead of
//! 100,000.
//!
//! Live bytes are counted by `stats_alloc`'s instrumented system allocator (the workspace
//! forbids `unsafe_code`, so this file cannot implement `GlobalAlloc` itself): the sum of
//! the sizes requested from the allocator minus the sizes given back. That is what the
//! structures ask for; the allocator's own per-allocation overhead (8 to 16 bytes per
//! block with glibc malloc) comes on top, so the live allocation count per key is printed
//! too. The growth of the process's resident set per key is printed as a rough
//! cross-check: it includes the allocator's overhead, but it reads low wherever the work
//! reuses memory that an earlier measurement freed.
//!
//! The keys are made first and measured on their own ("key strings"): a `Key` shares its
//! rule and subject strings (`ArcStr`, a thin pointer), so a structure that holds a key
//! holds a pointer to strings the caller already has. "structure" is what the store or map adds on top;
//! a store that outlives the caller's keys also owns the key strings.

use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;
use std::collections::HashMap;
use std::mem::size_of;
use tally_crdt::{
    CounterMap, Delta, Generation, Key, Lane, LaneUpdate, NodeId, OriginDelta, PnCounter,
    ReplicaId, Rule, Slot, Stamp, Subject, Version, Watermark, Window,
};
use tally_node::store::LaneStore;
use tally_node::view::Rate;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// How many keys: 100,000, or `TALLY_MEMORY_KEYS`. A hash table's bytes per key depend
/// on where the count falls between its doublings, so a figure at one count is not the
/// figure at every count.
fn keys_n() -> usize {
    std::env::var("TALLY_MEMORY_KEYS")
        .ok()
        .map(|n| n.parse().expect("TALLY_MEMORY_KEYS: a number of keys"))
        .unwrap_or(100_000)
}
const REMOTE_REPLICAS: [u64; 3] = [1, 4, 16];
const NOW_UNIX_SECS: u64 = 1_700_000_000;
const WINDOW_SECS: u32 = 60;

fn main() {
    println!(
        "memory per key, {} keys, subjects `user-000001`..",
        keys_n()
    );
    println!();
    print_sizes();

    let mut keys = Vec::with_capacity(keys_n());
    let ((), key_bytes) = measure(|| make_keys(&mut keys));
    println!(
        "key strings: {:.1} bytes/key in {:.2} allocations/key (the subject's ArcStr; \
         the rule's is shared by every key)",
        key_bytes.per(keys_n()),
        key_bytes.allocs_per(keys_n()),
    );
    println!();

    lane_store(&keys);
    let one_lane = counter_map(&keys);
    counter_map_parts(&keys, one_lane);
    view_rates(&keys);
}

/// Live heap bytes and allocations added by some work, and the resident set's growth.
#[derive(Debug, Clone, Copy)]
struct Live {
    bytes: isize,
    allocs: isize,
    rss_bytes: Option<isize>,
}

impl Live {
    fn per(&self, n: usize) -> f64 {
        self.bytes as f64 / n as f64
    }

    fn allocs_per(&self, n: usize) -> f64 {
        self.allocs as f64 / n as f64
    }

    fn rss_per(&self, n: usize) -> String {
        self.rss_bytes
            .map_or("n/a".to_owned(), |b| format!("{:.1}", b as f64 / n as f64))
    }
}

/// Runs `work` and returns what it made with the live heap it added.
fn measure<T>(work: impl FnOnce() -> T) -> (T, Live) {
    let rss_before = rss_bytes();
    let region = Region::new(GLOBAL);
    let made = work();
    let change = region.change();
    let live = Live {
        bytes: change.bytes_allocated as isize - change.bytes_deallocated as isize,
        allocs: change.allocations as isize - change.deallocations as isize,
        rss_bytes: rss_bytes().zip(rss_before).map(|(a, b)| a - b),
    };
    (made, live)
}

/// The resident set size from /proc/self/statm, if this is Linux.
fn rss_bytes() -> Option<isize> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: isize = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Fills `keys` (made with room for them all, so the vector itself is not counted).
fn make_keys(keys: &mut Vec<Key>) {
    let rule = Rule::new("login").expect("a valid rule name");
    let window = Window::containing(NOW_UNIX_SECS, WINDOW_SECS).expect("a valid window");
    keys.extend((1..=keys_n()).map(|i| {
        let subject = Subject::new(format!("user-{i:06}")).expect("a valid subject");
        Key::new(rule.clone(), subject, window)
    }));
}

/// A lane as `CounterMap` holds it when it has no decrements and its increments and version
/// fit 32 bits, as every own lane here (`crdt/src/cells.rs`): three 32-bit words, an index
/// into the map's table of origins (with the lane's width), the increments and the
/// version. A lane with decrements that fit 32 bits takes a fourth word; lanes past 32
/// bits six or seven.
type MapLane = [u32; 3];

fn replica(node: u64) -> ReplicaId {
    ReplicaId::new(NodeId(node), Generation(1))
}

fn print_sizes() {
    println!("size_of (inline bytes, heap not included):");
    for (name, size) in [
        ("Key (Rule + Subject + Window)", size_of::<Key>()),
        ("Rule (ArcStr)", size_of::<Rule>()),
        ("Subject (ArcStr)", size_of::<Subject>()),
        ("Window", size_of::<Window>()),
        ("ReplicaId", size_of::<ReplicaId>()),
        ("Lane", size_of::<Lane>()),
        ("Version", size_of::<Version>()),
        ("Slot (ReplicaId + Lane + Version)", size_of::<Slot>()),
        ("PnCounter (Box<[Slot]>)", size_of::<PnCounter>()),
        (
            "Option<(Subject, Box<[u32]>)> key table entry",
            size_of::<Option<(Subject, Box<[u32]>)>>(),
        ),
        (
            "a CounterMap lane, no decrements (origin, incr, version)",
            size_of::<MapLane>(),
        ),
    ] {
        println!("  {name:<50} {size:>4}");
    }
    println!();
}

fn lane_store(keys: &[Key]) {
    let (store, made) = measure(|| LaneStore::new(replica(0), keys_n()));
    let ((), inserted) = measure(|| {
        for key in keys {
            store
                .incr(key, 1)
                .expect("the store has room for every key");
        }
    });
    assert_eq!(store.len(), keys_n());
    let mut collected = Vec::with_capacity(keys_n());
    let ((), drained) = measure(|| {
        store.collect(&mut collected);
        store.reclaim();
    });
    assert_eq!(collected.len(), keys_n());
    drop(collected);
    let ((), published) = measure(|| {
        for key in keys {
            store
                .publish_remote(key, 5)
                .expect("every key is already in the store");
        }
    });
    println!("LaneStore (keys_max {}), one own lane per key:", keys_n());
    println!(
        "  LaneStore::new: {} bytes ({:.1} bytes/key of keys_max)",
        made.bytes,
        made.per(keys_n())
    );
    println!(
        "  after {} increments, own lanes not yet collected: {:.1} bytes/key in {:.2} \
         allocations/key (resident-set growth: {})",
        keys_n(),
        inserted.per(keys_n()),
        inserted.allocs_per(keys_n()),
        inserted.rss_per(keys_n()),
    );
    let settled = inserted.bytes + drained.bytes;
    println!(
        "  after collect and reclaim (the dirty queue drained, a growth the inserts left \
         half done finished, and the old tables freed, as tallyd's gossip task does each \
         second): \
         {:.1} bytes/key; with LaneStore::new: {:.1} bytes/key",
        settled as f64 / keys_n() as f64,
        (made.bytes + settled) as f64 / keys_n() as f64,
    );
    println!(
        "  publishing a remote sum for every key adds {:.1} bytes/key (remote lanes are \
         one i128 sum per key here; their lanes live in the CounterMap)",
        published.per(keys_n())
    );
    println!();
}

/// Returns the map's live bytes with one own lane per key.
fn counter_map(keys: &[Key]) -> Live {
    let (_, own_lanes) = measure(|| own_lanes_map(keys));
    println!("CounterMap, one own lane per key:");
    println!(
        "  structure: {:.1} bytes/key in {:.2} allocations/key (resident-set growth: {})",
        own_lanes.per(keys_n()),
        own_lanes.allocs_per(keys_n()),
        own_lanes.rss_per(keys_n()),
    );
    // A lane takes more bytes once it has decrements (`crdt/src/cells.rs`): a rate limit's
    // lanes have none; a quota that gives back what it took has them.
    for (kind, lane) in [
        ("increments only", Lane::new(2, 0)),
        ("with decrements", Lane::new(2, 1)),
    ] {
        println!("  remote lanes, {kind}:");
        remote_lanes(keys, own_lanes_map(keys), own_lanes, lane);
    }
    println!();
    own_lanes
}

/// A map with one own lane for each of `keys`.
fn own_lanes_map(keys: &[Key]) -> CounterMap {
    let mut map = CounterMap::new();
    for key in keys {
        map.incr(replica(0), key, 1, Stamp(1))
            .expect("one increment cannot overflow");
    }
    assert_eq!(map.len(), keys_n());
    map
}

/// Adds lanes like `lane` of 1, then 4, then 16 remote replicas to every key of `map` (which
/// holds `own_lanes`), printing the bytes each remote lane added.
fn remote_lanes(keys: &[Key], mut map: CounterMap, own_lanes: Live, lane: Lane) {
    let mut remotes_held = 0;
    let mut total = Live {
        bytes: 0,
        allocs: 0,
        rss_bytes: Some(0),
    };
    for remotes in REMOTE_REPLICAS {
        for node in remotes_held + 1..=remotes {
            let delta = remote_delta(replica(node), keys, lane);
            let ((), added) = measure(|| {
                let applied = map.apply(&delta, NOW_UNIX_SECS);
                assert_eq!(applied.lanes_raised, keys_n());
                drop(applied);
            });
            total = Live {
                bytes: total.bytes + added.bytes,
                allocs: total.allocs + added.allocs,
                rss_bytes: total.rss_bytes.zip(added.rss_bytes).map(|(a, b)| a + b),
            };
        }
        remotes_held = remotes;
        let lanes = keys_n() * remotes as usize;
        assert_eq!(map.lanes(), keys_n() + lanes);
        println!(
            "  + {remotes:>2} remote lane(s) per key: {:.1} bytes/remote lane in {:.2} \
             allocations/remote lane (resident-set growth: {}); \
             {:.1} bytes/key in all",
            total.per(lanes),
            total.allocs_per(lanes),
            total.rss_per(lanes),
            own_lanes.per(keys_n()) + total.per(keys_n()),
        );
    }
}

/// A delta from `origin` carrying `lane` for every key, in version order.
fn remote_delta(origin: ReplicaId, keys: &[Key], lane: Lane) -> Delta {
    let lanes: Vec<LaneUpdate> = keys
        .iter()
        .zip(1..)
        .map(|(key, version)| LaneUpdate {
            key: key.clone(),
            lane,
            version: Version(version),
        })
        .collect();
    Delta {
        origins: vec![OriginDelta {
            origin,
            through: Watermark {
                version: Version(keys.len() as u64),
                stamp: Stamp(1),
            },
            lanes,
        }],
    }
}

/// The counter map's parts, each built alone for the same keys and grown one key at a time
/// as the map grows them, to show where its bytes go: its key table's entries (a vector of
/// subjects and counters indexed by key id, and beside it one of scope ids), one counter's
/// lanes, and the
/// per-origin version index that delta sync walks. The rest of `one_lane` is the key
/// table's hash table of ids (and its one scope: the keys' rule and window).
fn counter_map_parts(keys: &[Key], one_lane: Live) {
    println!("CounterMap's parts, each alone, per key:");
    let (entries, entries_live) = measure(|| {
        let (mut entries, mut scopes) = (Vec::new(), Vec::new());
        for key in keys {
            // Grown by an eighth when full, as the key table grows them.
            if entries.len() == entries.capacity() {
                entries.reserve_exact(entries.len() / 8 + 16);
                scopes.reserve_exact(scopes.len() / 8 + 16);
            }
            entries.push(Some((key.subject.clone(), Box::<[u32]>::default())));
            scopes.push(0u32);
        }
        (entries, scopes)
    });
    drop(entries);
    let (lanes, lanes_live) = measure(|| {
        (keys.iter())
            .map(|_| Box::from([1u32; 3]))
            .collect::<Vec<Box<[u32]>>>()
    });
    drop(lanes);
    let (index, index_live) = measure(|| {
        // An origin's version index: a vector of 6-byte entries (a version's low 16 bits
        // and a 32-bit key id), grown by an eighth when full, as the map grows it.
        let mut index: Vec<[u16; 3]> = Vec::new();
        for (id, version) in (0..keys.len()).zip(1u64..) {
            if index.len() == index.capacity() {
                index.reserve_exact(index.len() / 8 + 16);
            }
            index.push([version as u16, id as u16, (id >> 16) as u16]);
        }
        index
    });
    drop(index);
    let vector = (keys_n() * size_of::<Box<[u32]>>()) as isize;
    let lane_heap = lanes_live.bytes - vector;
    let ids = one_lane.bytes - entries_live.bytes - lane_heap - index_live.bytes;
    for (part, live) in [
        (
            "key table entries, Vec<Option<(Subject, Box<..>)>> + Vec<u32>",
            entries_live.bytes,
        ),
        ("one lane's Box<[u32]> heap", lane_heap),
        (
            "one origin's version index, 6 bytes an entry",
            index_live.bytes,
        ),
        ("key table's hash table of ids (the rest)", ids),
    ] {
        println!("  {part:<50} {:>6.1}", live as f64 / keys_n() as f64);
    }
    println!();
}

/// What the node's decision view adds per key once gossip has merged a remote lane of it:
/// the smoothed rate of the other replicas' increments (`ViewState::remote_rates`).
fn view_rates(keys: &[Key]) {
    let (rates, live) = measure(|| {
        let mut rates = HashMap::new();
        for key in keys {
            rates.insert(key.clone(), Rate::start(0, 0, 0.0));
        }
        rates
    });
    assert_eq!(rates.len(), keys_n());
    drop(rates);
    println!("decision view (tallyd's ViewState), per key with a remote lane:");
    println!(
        "  remote_rates, HashMap<Key, Rate> ({} bytes an entry): {:.1} bytes/key",
        size_of::<(Key, Rate)>(),
        live.per(keys_n())
    );
    println!();
}
