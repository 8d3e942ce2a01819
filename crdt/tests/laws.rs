//! The CRDT laws, checked by proptest over arbitrary histories.
//!
//! Each test is named after the law it guards. A failing case prints its minimal input;
//! pin it under `crdt/tests/laws.proptest-regressions` (proptest does this itself).

use proptest::collection::vec;
use proptest::prelude::*;
use std::collections::BTreeMap;
use tally_crdt::*;

/// Cases per law: TESTING.md C1 asks for thousands (1,000 until session 44; 5,000 take
/// about 5 s in release on this project's 2-core machine).
const CASES: u32 = 5_000;
const NOW: u64 = 1_000 * 60;

fn replica(index: usize) -> ReplicaId {
    ReplicaId::new(NodeId(index as u64), Generation(7))
}

fn key(index: usize) -> Key {
    key_in(index, 60)
}

/// One counter write: which replica, incr or decr, how much.
#[derive(Debug, Clone)]
struct Write {
    replica: usize,
    key: usize,
    decr: bool,
    amount: u64,
}

fn writes(replicas: usize, keys: usize, len: usize) -> impl Strategy<Value = Vec<Write>> {
    vec(
        (0..replicas, 0..keys, any::<bool>(), 0..1_000u64).prop_map(
            |(replica, key, decr, amount)| Write {
                replica,
                key,
                decr,
                amount,
            },
        ),
        0..len,
    )
}

/// [`writes`], every fourth of them 2^23 times as large: up to about 2^33.
fn wide_writes(replicas: usize, keys: usize, len: usize) -> impl Strategy<Value = Vec<Write>> {
    writes(replicas, keys, len).prop_map(|mut writes| {
        for write in writes.iter_mut().step_by(4) {
            write.amount <<= 23;
        }
        writes
    })
}

fn counter(replicas: usize) -> impl Strategy<Value = PnCounter> {
    vec((0..replicas, any::<bool>(), 0..u64::MAX / 4), 0..16).prop_map(|writes| {
        let mut counter = PnCounter::new();
        for (index, decr, amount) in writes {
            let written = if decr {
                counter.decr(replica(index), amount)
            } else {
                counter.incr(replica(index), amount)
            };
            // An overflowing write is refused whole; the counter stays valid either way.
            let _ = written;
        }
        counter
    })
}

fn merged(a: &PnCounter, b: &PnCounter) -> PnCounter {
    let mut out = a.clone();
    out.merge(b);
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn merge_is_commutative(a in counter(6), b in counter(6)) {
        prop_assert_eq!(merged(&a, &b), merged(&b, &a));
    }

    #[test]
    fn merge_is_associative(a in counter(6), b in counter(6), c in counter(6)) {
        prop_assert_eq!(merged(&merged(&a, &b), &c), merged(&a, &merged(&b, &c)));
    }

    #[test]
    fn merge_is_idempotent(a in counter(6), b in counter(6)) {
        let once = merged(&a, &b);
        prop_assert_eq!(merged(&once, &b), once.clone());
        prop_assert_eq!(merged(&a, &a), a);
    }

    #[test]
    fn lanes_never_decrease_under_merge(a in counter(6), b in counter(6)) {
        let after = merged(&a, &b);
        for slot in a.slots().chain(b.slots()) {
            prop_assert!(after.lane(slot.replica).covers(slot.lane));
        }
    }

    #[test]
    fn overflowing_writes_never_wrap_a_lane(start in (u64::MAX - 1_000)..=u64::MAX, amount in 0..2_000u64) {
        let mut lane = Lane::new(start, start);
        let before = lane;
        match lane.incr(amount) {
            Ok(()) => prop_assert_eq!(u128::from(lane.incr), u128::from(start) + u128::from(amount)),
            Err(err) => {
                prop_assert_eq!(lane, before);
                prop_assert!(u128::from(start) + u128::from(amount) > u128::from(u64::MAX));
                prop_assert_eq!(err.amount, amount);
            }
        }
    }

    #[test]
    fn value_is_increments_minus_decrements_once_all_is_delivered(
        (replicas, history) in (2..=12usize).prop_flat_map(|n| (Just(n), writes(n, 4, 200)))
    ) {
        let mut maps = vec![CounterMap::new(); replicas];
        let mut truth: BTreeMap<usize, i128> = BTreeMap::new();
        for write in &history {
            apply_write(&mut maps[write.replica], write);
            let sign = if write.decr { -1 } else { 1 };
            *truth.entry(write.key).or_default() += sign * i128::from(write.amount);
        }
        sync_until_quiet(&mut maps, usize::MAX);
        for map in &maps {
            for k in 0..4 {
                prop_assert_eq!(map.value(&key(k)), truth.get(&k).copied().unwrap_or(0));
            }
        }
    }

    /// Deltas computed against stale digests, cut short by small budgets, delivered in any
    /// order and more than once, reach exactly the state of a full merge. Some replicas'
    /// versions start just below 2^32 and every fourth write is past 2^32 itself, so lanes
    /// and versions cross the width a map holds them in.
    #[test]
    fn deltas_in_any_order_with_duplicates_and_cuts_reach_the_full_merge(
        (replicas, starts, history, schedule, budgets) in (2..=12usize).prop_flat_map(|n| (
            Just(n),
            vec(prop_oneof![Just(0), (u64::from(u32::MAX) - 40)..=u64::from(u32::MAX)], n),
            wide_writes(n, 24, 150),
            vec((0..n, 0..n, 0..64usize, any::<prop::sample::Index>()), 1..120),
            vec(0..(4 * DELTA_BYTES_MIN), 1..8),
        ))
    ) {
        let mut maps = vec![CounterMap::new(); replicas];
        for (index, (map, start)) in maps.iter_mut().zip(starts).enumerate() {
            // Only a replica that writes: one raised with no lanes is an origin its peers
            // never hear of.
            if start > 0 && history.iter().any(|write| write.replica == index) {
                map.raise_version(replica(index), Version(start));
            }
        }
        let mut snapshots: Vec<(usize, Digest)> = Vec::new();
        let mut pool: Vec<(usize, Delta)> = Vec::new();
        let mut writes = history.iter();
        for (step, (from, to, rotate, pick)) in schedule.iter().enumerate() {
            if let Some(write) = writes.next() {
                apply_write(&mut maps[write.replica], write);
            }
            snapshots.push((*to, maps[*to].digest()));
            // A digest from any earlier moment of `to`: stale digests make old replays.
            let seen_by_to: Vec<&Digest> = snapshots.iter().filter(|(r, _)| r == to).map(|(_, d)| d).collect();
            let digest = *pick.get(&seen_by_to);
            let budget = budgets[step % budgets.len()];
            pool.push((*to, maps[*from].delta_for(digest, budget, *rotate)));
            if step % 3 == 0 {
                let (target, delta) = pool[pick.index(pool.len())].clone();
                let before = snapshot_lanes(&maps[target]);
                maps[target].apply(&delta, NOW);
                assert_monotone(&before, &maps[target])?;
            }
        }
        for write in writes {
            apply_write(&mut maps[write.replica], write);
        }
        // Replay the whole pool, reversed and then again: duplicates and reordering.
        for (target, delta) in pool.iter().rev().chain(pool.iter()) {
            let before = snapshot_lanes(&maps[*target]);
            maps[*target].apply(delta, NOW);
            assert_monotone(&before, &maps[target.to_owned()])?;
        }
        sync_until_quiet(&mut maps, budgets[0]);
        for map in &maps {
            assert_indexed(map)?;
        }

        let mut full: BTreeMap<Key, PnCounter> = BTreeMap::new();
        for map in &maps {
            for (k, c) in map.iter() {
                full.entry(k.to_key()).or_default().merge(&PnCounter::copy_of(&c));
            }
        }
        for map in &maps {
            let held: BTreeMap<Key, PnCounter> = map.iter().map(|(k, c)| (k.to_key(), PnCounter::copy_of(&c))).collect();
            prop_assert_eq!(&held, &full);
            prop_assert_eq!(map.digest(), maps[0].digest());
        }
        // And that full merge is the history: each replica's lane of a key holds exactly
        // what it wrote there, and no lane holds anything else (a delta applied twice or
        // out of order added nothing).
        let mut truth: BTreeMap<(Key, ReplicaId), Lane> = BTreeMap::new();
        for write in &history {
            let lane = truth.entry((key(write.key), replica(write.replica))).or_default();
            if write.decr { lane.decr += write.amount } else { lane.incr += write.amount }
        }
        for ((k, r), lane) in &truth {
            prop_assert_eq!(full.get(k).map(|c| c.lane(*r)).unwrap_or_default(), *lane);
        }
        for (k, counter) in &full {
            for slot in counter.slots() {
                let written = truth.get(&(k.clone(), slot.replica)).copied().unwrap_or_default();
                prop_assert_eq!(slot.lane, written, "{} lane {:?}", k, slot.replica);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// A map at its key cap holds no key past it from peers, a map with a lane rate holds
    /// no lane past it, and their watermarks never claim a lane they left out: with room
    /// again, plain anti-entropy completes them.
    #[test]
    fn a_capped_map_never_claims_what_it_left_out(
        (replicas, history, keys_max, rate, budget) in (2..=8usize).prop_flat_map(|n| (
            Just(n),
            writes(n, 24, 150),
            0..24usize,
            0..20_000u64,
            0..(4 * DELTA_BYTES_MIN),
        ))
    ) {
        let mut maps = vec![CounterMap::new(); replicas];
        // Replica 0 is capped and writes nothing itself: every key it holds came from peers.
        // NOW is its windows' first second, and replica 0's clock is the most skew allowed
        // behind it, so a lane may hold at most `rate` there.
        maps[0] = CounterMap::new().with_keys_max(keys_max).with_lane_rate_max(rate);
        let behind = NOW - LANE_RATE_SKEW_SECS;
        for (step, write) in history.iter().enumerate() {
            if write.replica != 0 {
                apply_write(&mut maps[write.replica], write);
            }
            let from = 1 + step % (replicas - 1);
            let delta = maps[from].delta_for(&maps[0].digest(), budget, step);
            maps[0].apply(&delta, behind);
            let to = 1 + (step + 1) % (replicas - 1);
            let delta = maps[0].delta_for(&maps[to].digest(), budget, step);
            maps[to].apply(&delta, NOW);
            prop_assert!(maps[0].len() <= keys_max);
            assert_indexed(&maps[0])?;
            for (_, counter) in maps[0].iter() {
                for slot in counter.slots() {
                    prop_assert!(u128::from(slot.lane.incr) + u128::from(slot.lane.decr) <= u128::from(rate));
                }
            }
            // Every lane of an origin at or below the capped map's watermark for it is held.
            assert_claims_only_held(&maps[0], maps.iter().enumerate().skip(1))?;
        }
        maps[0] = std::mem::take(&mut maps[0])
            .with_keys_max(usize::MAX)
            .with_lane_rate_max(u64::MAX);
        sync_until_quiet(&mut maps, budget);
        for map in &maps[1..] {
            let held: BTreeMap<Key, PnCounter> = map.iter().map(|(k, c)| (k.to_key(), PnCounter::copy_of(&c))).collect();
            let capped: BTreeMap<Key, PnCounter> = maps[0].iter().map(|(k, c)| (k.to_key(), PnCounter::copy_of(&c))).collect();
            prop_assert_eq!(capped, held);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Each origin pushes its fresh lanes now and then, in frames cut by a budget as
    /// `Gossip::push` cuts them (only the last carries the origin's stamp). A receiver at
    /// a key cap gets some frames in any order, loses the others, and now and then an
    /// answer from a peer that got every frame: its watermark never claims a lane it
    /// lacks, nor its stamp a version it lacks. Then, its cap lifted, the peer brings it up
    /// to date, and the next frames all arrive, newest first: once the oldest is in, the
    /// receiver is at each origin's version, with a stamp at least that of the write that
    /// made it, with no answer at all.
    #[test]
    fn pushes_in_any_order_never_claim_a_lane_not_held_and_catch_up_once_the_gap_fills(
        (origins, history, later, pushes, deliveries, budget, keys_max) in (1..=4usize).prop_flat_map(|n| (
            Just(n),
            writes(n, 16, 60),
            writes(n, 16, 30),
            vec(any::<bool>(), 90),
            vec((any::<prop::sample::Index>(), 0..4u8), 0..90),
            0..(3 * DELTA_BYTES_MIN),
            4..=16usize,
        ))
    ) {
        let mut origin = Origins::new(origins, budget);
        let mut receiver = CounterMap::new().with_keys_max(keys_max);
        let mut peer = CounterMap::new();
        let mut pool: Vec<(Version, OriginDelta)> = Vec::new();
        let mut deliveries = deliveries.iter();
        for (step, write) in history.iter().enumerate() {
            origin.write(write);
            if pushes[step] {
                origin.push(write.replica, &mut peer, &mut pool);
            }
            let Some((pick, action)) = deliveries.next() else { continue };
            if pool.is_empty() && *action != 1 {
                continue;
            }
            match action {
                // Lost.
                0 => { pool.swap_remove(pick.index(pool.len())); }
                1 => { receiver.apply(&peer.delta_for(&receiver.digest(), budget, step), NOW); }
                _ => {
                    let (after, entry) = pool.swap_remove(pick.index(pool.len()));
                    receiver.apply_since(after, &entry, NOW);
                }
            };
            origin.assert_claims_only_held(&receiver)?;
        }
        let mut pair = [std::mem::take(&mut receiver).with_keys_max(usize::MAX), peer];
        sync_until_quiet(&mut pair, budget);
        let [mut receiver, mut peer] = pair;
        pool.clear();
        for (step, write) in later.iter().enumerate() {
            origin.write(write);
            if pushes[step] {
                origin.push(write.replica, &mut peer, &mut pool);
            }
        }
        for index in 0..origins {
            origin.push(index, &mut peer, &mut pool);
        }
        for (after, entry) in pool.iter().rev() {
            receiver.apply_since(*after, entry, NOW);
            origin.assert_claims_only_held(&receiver)?;
        }
        for (index, writer) in origin.writers.iter().enumerate() {
            let (held, written) = (receiver.watermark(replica(index)), writer.watermark(replica(index)));
            prop_assert_eq!(held.version, written.version, "origin {}", index);
            // A write that changed nothing moves the writer's stamp but makes no push.
            let pushed_at = origin.versions[index].iter().find(|(_, version)| *version == written.version);
            prop_assert!(pushed_at.is_none_or(|(stamp, _)| held.stamp >= *stamp), "origin {}", index);
        }
    }
}

/// Writers, one per origin (`replica(index)`), each write at a later stamp, and what each
/// has pushed.
struct Origins {
    writers: Vec<CounterMap>,
    pushed: Vec<Version>,
    // Per writer, its version after each of its writes, and that write's stamp.
    versions: Vec<Vec<(Stamp, Version)>>,
    stamp: u64,
    budget: usize,
}

impl Origins {
    fn new(count: usize, budget: usize) -> Origins {
        Origins {
            writers: vec![CounterMap::new(); count],
            pushed: vec![Version::ZERO; count],
            versions: vec![Vec::new(); count],
            stamp: 0,
            budget,
        }
    }

    fn write(&mut self, write: &Write) {
        self.stamp += 1;
        let (writer, at) = (&mut self.writers[write.replica], Stamp(self.stamp));
        let (origin, key) = (replica(write.replica), key(write.key));
        let written = if write.decr {
            writer.decr(origin, &key, write.amount, at)
        } else {
            writer.incr(origin, &key, write.amount, at)
        };
        written.expect("small amounts never overflow");
        let version = writer.watermark(origin).version;
        self.versions[write.replica].push((at, version));
    }

    /// Pushes what `index` has not pushed yet, as `Gossip::push` does: frames of at most
    /// the budget, each following the last. The peer takes every frame in order; the
    /// receiver's come from `pool`.
    fn push(
        &mut self,
        index: usize,
        peer: &mut CounterMap,
        pool: &mut Vec<(Version, OriginDelta)>,
    ) {
        let writer = &self.writers[index];
        let top = writer.watermark(replica(index)).version;
        let mut after = self.pushed[index];
        while after < top {
            let entry = writer
                .lanes_since(replica(index), after, self.budget)
                .expect("the writer holds its own lanes");
            peer.apply_since(after, &entry, NOW);
            let through = entry.through.version;
            pool.push((after, entry));
            after = through;
        }
        self.pushed[index] = after;
    }

    /// `receiver`'s watermark for each origin covers only lanes it holds (every lane the
    /// writer holds now at or below it is covered), and its stamp claims no version past
    /// its watermark: the writer's version as of that stamp is at most the watermark's.
    fn assert_claims_only_held(&self, receiver: &CounterMap) -> Result<(), TestCaseError> {
        assert_claims_only_held(receiver, self.writers.iter().enumerate())?;
        for (index, versions) in self.versions.iter().enumerate() {
            let held = receiver.watermark(replica(index));
            let at_stamp = versions
                .iter()
                .take_while(|(stamp, _)| *stamp <= held.stamp)
                .last()
                .map_or(Version::ZERO, |(_, version)| *version);
            prop_assert!(
                at_stamp <= held.version,
                "origin {} claims its stamp {:?} at {:?}, when it had written {:?}",
                index,
                held.stamp,
                held.version,
                at_stamp
            );
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]
    #[test]
    fn expiry_drops_exactly_the_ended_windows_and_the_rest_still_converges_to_its_writes(
        (replicas, before, after, long_every, later, budget, seed) in (2..=6usize).prop_flat_map(|n| (
            Just(n),
            writes(n, 40, 200),
            writes(n, 20, 60),
            2..=6usize,
            NOW + 20..NOW + 30,
            0..(4 * DELTA_BYTES_MIN),
            any::<u64>(),
        ))
    ) {
        // Keys 0..40 before the expiry, one in `long_every` of them in an hour-long window
        // and the rest in 10-second windows, which end before `later`: so an expiry leaves
        // a half to a sixth of the keys, and the sparser maps compact. Keys 40..60 after it,
        // new to every map, in hour-long windows, take the ids the expiry freed where it
        // did not compact, and follow the compacted ones where it did.
        let spread = |index: usize| if index.is_multiple_of(long_every) { 3_600 } else { 10 };
        let mut maps = vec![CounterMap::new().with_hash_seed(seed); replicas];
        let mut written = BTreeMap::<Key, i128>::new();
        for (step, write) in before.iter().enumerate() {
            let at = key_in(write.key, spread(write.key));
            apply_write_at(&mut maps[write.replica], write, &at);
            *written.entry(at).or_default() += signed(write);
            let (from, to) = (step % replicas, (step + 1) % replicas);
            let delta = maps[from].delta_for(&maps[to].digest(), budget, step);
            maps[to].apply(&delta, NOW);
        }
        for map in &mut maps {
            let held = snapshot_lanes(map);
            map.expire(later, |_| true);
            let kept: Lanes = held
                .into_iter()
                .filter(|((k, _), _)| k.window.is_live(later))
                .collect();
            prop_assert_eq!(map.lanes(), kept.len(), "one version-index entry per lane");
            prop_assert_eq!(snapshot_lanes(map), kept);
            assert_indexed(map)?;
        }
        written.retain(|k, _| k.window.is_live(later));
        for (step, write) in after.iter().enumerate() {
            let at = key_in(40 + write.key, 3_600);
            apply_write_at(&mut maps[write.replica], write, &at);
            *written.entry(at).or_default() += signed(write);
            let (from, to) = (step % replicas, (step + 1) % replicas);
            let delta = maps[from].delta_for(&maps[to].digest(), budget, step);
            maps[to].apply(&delta, later);
        }
        sync_until_quiet_at(&mut maps, budget, later);
        for map in &maps {
            assert_indexed(map)?;
            let values: BTreeMap<Key, i128> = map
                .iter()
                .map(|(k, c)| (k.to_key(), c.value()))
                .filter(|&(_, value)| value != 0)
                .collect();
            let expected: BTreeMap<Key, i128> =
                written.iter().filter(|&(_, &v)| v != 0).map(|(k, v)| (k.clone(), *v)).collect();
            prop_assert_eq!(values, expected);
        }
    }
}

fn key_in(index: usize, len_secs: u32) -> Key {
    Key::new(
        Rule::new("r").expect("valid rule"),
        Subject::new(format!("s{index}")).expect("valid subject"),
        Window::containing(NOW, len_secs).expect("valid window"),
    )
}

fn signed(write: &Write) -> i128 {
    let amount = i128::from(write.amount);
    if write.decr {
        -amount
    } else {
        amount
    }
}

fn apply_write_at(map: &mut CounterMap, write: &Write, at: &Key) {
    let replica = replica(write.replica);
    let result = if write.decr {
        map.decr(replica, at, write.amount, Stamp(0))
    } else {
        map.incr(replica, at, write.amount, Stamp(0))
    };
    result.expect("small amounts never overflow");
}

fn apply_write(map: &mut CounterMap, write: &Write) {
    apply_write_at(map, write, &key(write.key));
}

/// Anti-entropy between every ordered pair, in budget-cut chunks, until no delta is left.
fn sync_until_quiet(maps: &mut [CounterMap], bytes_max: usize) {
    sync_until_quiet_at(maps, bytes_max, NOW);
}

/// [`sync_until_quiet`], applying at `now_unix_secs`.
fn sync_until_quiet_at(maps: &mut [CounterMap], bytes_max: usize, now_unix_secs: u64) {
    for round in 0.. {
        assert!(
            round < 10_000,
            "sync did not converge: a cut send made no progress"
        );
        let mut sent = false;
        for from in 0..maps.len() {
            for to in 0..maps.len() {
                if from == to {
                    continue;
                }
                let delta = maps[from].delta_for(&maps[to].digest(), bytes_max, round);
                if !delta.is_empty() {
                    sent = true;
                    maps[to].apply(&delta, now_unix_secs);
                }
            }
        }
        if !sent {
            return;
        }
    }
}

type Lanes = BTreeMap<(Key, ReplicaId), Lane>;

fn snapshot_lanes(map: &CounterMap) -> Lanes {
    map.iter()
        .flat_map(|(k, c)| c.slots().map(move |s| ((k.to_key(), s.replica), s.lane)))
        .collect()
}

/// Every lane `map` holds is indexed under its origin at its own version, once: a full
/// delta (which reads the origins' version indexes) names each lane held, at the version
/// its slot holds, and nothing else. (`delta_for` panics on an index entry naming a key
/// not held.)
fn assert_indexed(map: &CounterMap) -> Result<(), TestCaseError> {
    let mut indexed = Lanes::new();
    for entry in map.delta_for(&Digest::default(), usize::MAX, 0).origins {
        for update in entry.lanes {
            let slot = map.counter(&update.key).and_then(|c| c.slot(entry.origin));
            prop_assert_eq!(
                slot.map(|s| s.version),
                Some(update.version),
                "{} {:?}",
                update.key,
                entry.origin
            );
            prop_assert!(indexed
                .insert((update.key, entry.origin), update.lane)
                .is_none());
        }
    }
    prop_assert_eq!(indexed, snapshot_lanes(map));
    Ok(())
}

/// `receiver`'s watermark for each writer's origin (`replica(index)`) covers only lanes it
/// holds: every lane the writer holds now at or below it is covered.
fn assert_claims_only_held<'a>(
    receiver: &CounterMap,
    writers: impl IntoIterator<Item = (usize, &'a CounterMap)>,
) -> Result<(), TestCaseError> {
    for (origin, writer) in writers {
        let watermark = receiver.watermark(replica(origin)).version;
        for (k, counter) in writer.iter() {
            let k = k.to_key();
            if let Some(slot) = counter.slot(replica(origin)) {
                if slot.version <= watermark {
                    prop_assert!(
                        receiver.lane(&k, replica(origin)).covers(slot.lane),
                        "watermark {:?} of {} claims {} at {:?}",
                        watermark,
                        origin,
                        k,
                        slot.version
                    );
                }
            }
        }
    }
    Ok(())
}

fn assert_monotone(before: &Lanes, after: &CounterMap) -> Result<(), TestCaseError> {
    for ((k, replica), lane) in before {
        prop_assert!(
            after.lane(k, *replica).covers(*lane),
            "lane {k} {replica} went back"
        );
    }
    Ok(())
}
