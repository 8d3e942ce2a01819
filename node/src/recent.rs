//! What this sidecar answered under a [`CheckId`], remembered so that a retry (after a
//! timeout or a broken connection) gets the first answer and counts nothing more
//! (TESTING.md C3): its approximate checks, its increments and its decrements, and the
//! exact checks it answered with the region's decision or with a fallback that counted.
//! The region remembers the exact checks it decided as well, across restarts.
//!
//! The memory is bounded: the most recent [`RECENT_IDS_MAX`] ids, each while its window
//! is live. An id pushed out by newer ones is forgotten, and a retry of it is decided, and
//! counted, again: at 10,000 named requests a second an id is remembered for more than 6
//! seconds, well past a client's timeout. Each sidecar remembers only its own: a retry sent
//! to another sidecar is counted again. With a data directory, every answer remembered is
//! also logged there, written out after the writes it made ([`crate::answerlog`]), and the
//! next life starts remembering the newest 65,536 ids over its earlier lives whose windows
//! are live ([`RecentIds::remembering`]); without one, a retry sent to the next life is
//! counted again.

use crate::decide::reset_after_ms;
use crate::store::KeyHasher;
use serde::{Deserialize, Serialize};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use tally_client::wire::{CheckId, Decision, Estimate};
use tally_crdt::{KeyRef, Window};

/// How many ids a sidecar remembers: about 18 MB when full (a 112-byte entry in a table of
/// 131,072, and the order, with as many places again left by ids answered again).
pub const RECENT_IDS_MAX: usize = 65_536;

/// What the sidecar answered under an id.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Answered {
    /// A check's decision.
    Decided(Decision),
    /// An increment's count after it.
    Incremented(Estimate),
    /// A decrement's count after it.
    Decremented(Estimate),
}

impl Answered {
    /// What was answered, for a refusal that names it: "a check", say.
    pub fn kind(&self) -> &'static str {
        match self {
            Answered::Decided(_) => "a check",
            Answered::Incremented(_) => "an increment",
            Answered::Decremented(_) => "a decrement",
        }
    }
}

/// What a request under an id asked for: a CRC-32 of its rule, subject and amount (a
/// check's cost, an increment's or decrement's amount), so that a send of the id with
/// another request is told from a retry, which repeats its request (since session 46:
/// before, it got the first request's answer, and counted nothing). A CRC, not the
/// store's hasher, whose seeds are secret and new each process: earlier lives' answers
/// hold it, and so does the region's log, for the exact checks it decides under an
/// application's id (since session 47). Two requests share one by chance once in 2^32;
/// the second then gets the first's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Asked(u32);

impl Asked {
    /// What a request of `amount` on `key` asks, whatever its window.
    pub fn of(key: KeyRef<'_>, amount: u64) -> Asked {
        Asked::named(key.rule().as_str(), key.subject(), amount)
    }

    /// What a request of `amount` on the subject `subject` of the rule named `rule` asks.
    pub fn named(rule: &str, subject: &str, amount: u64) -> Asked {
        let mut crc = crc32fast::Hasher::new();
        for name in [rule, subject] {
            crc.update(&(name.len() as u32).to_le_bytes());
            crc.update(name.as_bytes());
        }
        crc.update(&amount.to_le_bytes());
        Asked(crc.finalize())
    }
}

/// An answer given under an id: what it answered, what it was asked, and the window it
/// was given in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Remembered {
    /// The answer.
    pub answered: Answered,
    /// What it answered.
    pub asked: Asked,
    /// The window it was given in: remembered while that is live.
    pub window: Window,
}

/// The recent answers given under an id.
#[derive(Debug)]
pub struct RecentIds {
    // Each id's remembered answer, and the number of its insertion. Ids come from clients:
    // hashed as the store hashes subjects (foldhash under secret seeds), a few nanoseconds
    // where SipHash took tens, three times per named request.
    answered: HashMap<CheckId, (Remembered, u64), KeyHasher>,
    // Each insertion's id and number, oldest first. Invariant: every id of `answered` is
    // here under its number; an entry whose number is not its id's held one is a place
    // left by an id answered again, skipped when it comes to the front, and dropped once
    // there are as many such places as ids held (so at most twice `max` entries).
    order: VecDeque<(CheckId, u64)>,
    inserted: u64,
    max: usize,
}

impl Default for RecentIds {
    fn default() -> RecentIds {
        RecentIds::with_max(RECENT_IDS_MAX)
    }
}

impl RecentIds {
    /// Remembers at most `max` ids.
    pub fn with_max(max: usize) -> RecentIds {
        RecentIds {
            answered: HashMap::default(),
            order: VecDeque::new(),
            inserted: 0,
            max: max.max(1),
        }
    }

    /// Remembers `answered`, oldest first, as [`RecentIds::insert`] would have, at
    /// `live_at_secs`: what earlier lives answered ([`crate::lanelog::Recovered::answered`]).
    pub fn remembering(
        answered: impl IntoIterator<Item = (CheckId, Remembered)>,
        live_at_secs: u64,
    ) -> RecentIds {
        let mut recent = RecentIds::default();
        for (id, remembered) in answered {
            recent.insert(id, remembered, live_at_secs);
        }
        recent
    }

    /// `id`'s answer, and what it was asked, if it is held and its window is live at
    /// `live_at_secs` (the paced wall clock windows end by); `None`: answer it now. A
    /// decision comes back as it was given but for its `reset_after_ms`, which counts from
    /// wall-clock `now_ms`.
    pub fn get(&self, id: CheckId, now_ms: u64, live_at_secs: u64) -> Option<(Answered, Asked)> {
        let &(
            Remembered {
                answered,
                asked,
                window,
            },
            _,
        ) = self.answered.get(&id)?;
        if !window.is_live(live_at_secs) {
            return None;
        }
        let answered = match answered {
            Answered::Decided(decision) => Answered::Decided(Decision {
                reset_after_ms: reset_after_ms(window, now_ms),
                ..decision
            }),
            counted @ (Answered::Incremented(_) | Answered::Decremented(_)) => counted,
        };
        Some((answered, asked))
    }

    /// Remembers the answer given under `id`; pushes out the oldest ids past the bound,
    /// and those whose windows are no longer live at `live_at_secs`. The bound counts ids
    /// held, not the places ids answered again left behind a live one (found in review,
    /// session 47: with those counted, an id was pushed out with half the bound held).
    pub fn insert(&mut self, id: CheckId, remembered: Remembered, live_at_secs: u64) {
        self.inserted += 1;
        self.answered.insert(id, (remembered, self.inserted));
        self.order.push_back((id, self.inserted));
        while let Some(&(oldest, number)) = self.order.front() {
            let full = self.answered.len() > self.max;
            // One look-up: the place is the id's own (not one it left by being answered
            // again), or nothing to drop.
            match self.answered.entry(oldest) {
                Entry::Occupied(held) if held.get().1 == number => {
                    if !full && held.get().0.window.is_live(live_at_secs) {
                        break;
                    }
                    held.remove();
                }
                _ => {}
            }
            self.order.pop_front();
        }
        if self.order.len() >= 2 * self.max {
            let answered = &self.answered;
            (self.order)
                .retain(|(id, number)| answered.get(id).is_some_and(|held| held.1 == *number));
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.answered.len()
    }
}

/// The sends of each check id forwarded from this sidecar and not yet answered: a send
/// whose deadline passes while another send of its id still waits for the region is not
/// given its rule's fallback (the other may yet be decided there, and both would count).
#[derive(Debug, Default)]
pub struct Waiting {
    sends: Mutex<Ids>,
}

/// How many times check ids whose every send is gone were kept, with the sequence numbers
/// passed on to them ([`WaitingSend::pass_on`]), are remembered, the most recent: as many
/// as the forwarder remembers checks answered `RegionUnavailable` to report late
/// admissions of. An id kept again takes another of these places, its earlier one left
/// empty, so at most this many ids are kept, and fewer when ids are kept again.
const PASSED_ON_IDS_HELD: usize = 4_096;

/// The sends of each check id, and the ids whose sends are all gone that keep numbers
/// passed on, oldest first.
#[derive(Debug, Default)]
struct Ids {
    sends: HashMap<CheckId, Sends>,
    // Invariant: every id of `sends` with no send waiting is here, with the number of its
    // last keeping (`Sends::kept`); an entry of an id kept again since, or no longer in
    // `sends`, is skipped when it comes to the front.
    parked: VecDeque<(CheckId, u64)>,
    // How many times an id was kept.
    keepings: u64,
}

/// The sends of one check id waiting for the region.
#[derive(Debug, Default)]
struct Sends {
    /// How many.
    waiting: usize,
    /// The sequence numbers of sends of the id that were written to the region and timed
    /// out while these waited, so got no fallback: the region may yet admit one of them,
    /// and the fallback one of these counts is then to be taken back.
    passed_on: Vec<u64>,
    /// The number of the id's last keeping in `Ids::parked`.
    kept: u64,
}

impl Waiting {
    /// Records a send of `id` going to the region; it waits until the returned guard is
    /// dropped (answered, or abandoned with its connection).
    pub fn add(self: &Arc<Waiting>, id: CheckId) -> WaitingSend {
        self.lock().sends.entry(id).or_default().waiting += 1;
        WaitingSend {
            id,
            waiting: Arc::clone(self),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ids> {
        self.sends.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many sends wait, of every id.
    #[cfg(test)]
    pub fn sends(&self) -> usize {
        self.lock().sends.values().map(|sends| sends.waiting).sum()
    }
}

/// One send of a check id waiting for the region ([`Waiting::add`]).
#[derive(Debug)]
pub struct WaitingSend {
    id: CheckId,
    waiting: Arc<Waiting>,
}

impl WaitingSend {
    /// Whether another send of this id waits for the region too.
    pub fn has_company(&self) -> bool {
        self.waiting
            .lock()
            .sends
            .get(&self.id)
            .is_some_and(|sends| sends.waiting > 1)
    }

    /// This send, written to the region as sequence number `seq`, timed out with no
    /// fallback while others of its id wait, or with one that counted nothing (then with
    /// the numbers it took): the one of them that falls back takes `seq`
    /// ([`WaitingSend::take_passed_on`]), so that the region's late admission of this
    /// send takes that fallback's count back. If none of them falls back (each answered
    /// by the region, or let go unanswered when its connection went), the next send of
    /// the id takes it, while the id's keeping is among the last `PASSED_ON_IDS_HELD`.
    pub fn pass_on(&self, seq: u64) {
        if let Some(sends) = self.waiting.lock().sends.get_mut(&self.id) {
            sends.passed_on.push(seq);
        }
    }

    /// The sequence numbers passed on by sends of this id that timed out with no fallback
    /// while this one waited ([`WaitingSend::pass_on`]).
    pub fn take_passed_on(&self) -> Vec<u64> {
        (self.waiting.lock().sends.get_mut(&self.id))
            .map(|sends| std::mem::take(&mut sends.passed_on))
            .unwrap_or_default()
    }
}

impl Drop for WaitingSend {
    fn drop(&mut self) {
        let mut guard = self.waiting.lock();
        let Ids {
            sends: all,
            parked,
            keepings,
        } = &mut *guard;
        let Some(sends) = all.get_mut(&self.id) else {
            return;
        };
        sends.waiting -= 1;
        if sends.waiting > 0 {
            return;
        }
        if sends.passed_on.is_empty() {
            all.remove(&self.id);
            return;
        }
        // Numbers passed on to sends that all went without a fallback (found in review,
        // session 54: dropped here, a later retry's fallback stayed counted when the
        // region admitted the send that passed its number on).
        *keepings += 1;
        sends.kept = *keepings;
        parked.push_back((self.id, *keepings));
        while parked.len() > PASSED_ON_IDS_HELD {
            let (oldest, keeping) = parked.pop_front().expect("invariant: not empty");
            if (all.get(&oldest)).is_some_and(|sends| sends.waiting == 0 && sends.kept == keeping) {
                all.remove(&oldest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_client::wire::Mode;

    fn id(session: u64, seq: u64) -> CheckId {
        CheckId { session, seq }
    }

    fn decision(estimate: i128) -> Answered {
        Answered::Decided(Decision {
            allowed: true,
            estimate,
            limit: 100,
            remaining: 100 - estimate as u64,
            reset_after_ms: 1_000,
            mode: Mode::ApproximateConnected,
            staleness_ms: 0,
            bound: 0.0,
        })
    }

    /// `answered`, given in `window` to one request.
    fn remember(answered: Answered, window: Window) -> Remembered {
        Remembered {
            answered,
            asked: Asked(7),
            window,
        }
    }

    /// The window of `len_secs` from the epoch: it ends at `len_secs` and is live until
    /// twice that.
    fn window(len_secs: u32) -> Window {
        Window::containing(0, len_secs).unwrap()
    }

    /// The estimate of `id`'s answer, if it is held at `now_ms`.
    fn held(recent: &RecentIds, id: CheckId, now_ms: u64) -> Option<i128> {
        recent
            .get(id, now_ms, now_ms / 1_000)
            .map(|(answered, _)| match answered {
                Answered::Decided(decision) => decision.estimate,
                Answered::Incremented(estimate) | Answered::Decremented(estimate) => {
                    estimate.estimate
                }
            })
    }

    #[test]
    fn an_answer_is_given_again_while_its_window_is_live_its_reset_counted_from_now() {
        let mut recent = RecentIds::default();
        assert_eq!(recent.get(id(1, 1), 10_000, 10), None);
        recent.insert(id(1, 1), remember(decision(5), window(30)), 10);
        let reset_at = |now_ms: u64| match recent.get(id(1, 1), now_ms, now_ms / 1_000) {
            Some((Answered::Decided(decision), _)) => {
                Some((decision.estimate, decision.reset_after_ms))
            }
            other => other.map(|_| panic!("a decision was remembered")),
        };
        assert_eq!(reset_at(10_000), Some((5, 20_000)));
        assert_eq!(
            reset_at(25_500),
            Some((5, 4_500)),
            "not the 20 s it was given with"
        );
        assert_eq!(
            reset_at(59_999),
            Some((5, 0)),
            "the window is over, still live"
        );
        // Once its window is no longer live, a retry is a new check in its own window.
        assert_eq!(reset_at(60_000), None);
        assert_eq!(recent.get(id(1, 2), 10_000, 10), None);
        assert_eq!(recent.get(id(2, 1), 10_000, 10), None);

        let count = Estimate {
            estimate: 7,
            window: 0,
            staleness_ms: 3,
        };
        recent.insert(
            id(1, 3),
            remember(Answered::Incremented(count), window(30)),
            10,
        );
        assert_eq!(
            recent.get(id(1, 3), 40_000, 40),
            Some((Answered::Incremented(count), Asked(7))),
            "a count is given again as it was, with what it was asked"
        );
    }

    #[test]
    fn an_answer_stays_while_its_window_is_live_by_the_paced_clock_whatever_the_wall_says() {
        let mut recent = RecentIds::default();
        recent.insert(id(1, 1), remember(decision(5), window(30)), 10);
        // The wall clock stepped an hour ahead; the paced one is a second on.
        assert_eq!(held(&recent, id(1, 1), 10_000), Some(5));
        assert!(recent.get(id(1, 1), 3_611_000, 11).is_some());
        recent.insert(id(1, 2), remember(decision(6), window(30)), 11);
        assert!(
            recent.get(id(1, 1), 3_611_000, 11).is_some(),
            "not pushed out"
        );
        assert!(
            recent.get(id(1, 1), 3_611_000, 60).is_none(),
            "over by the paced clock"
        );
    }

    /// The most recent `RECENT_IDS_MAX` ids are held: an id answered again (its first
    /// window over) leaves its old place in the order, which counted against the bound as
    /// an id would, so ids still live were pushed out with half the bound held (found in
    /// review, session 47).
    #[test]
    fn ids_answered_again_do_not_push_out_a_live_id_held_within_the_bound() {
        let mut recent = RecentIds::default();
        // An hour-long window's id, live until 7,200 s.
        let hourly = id(1, 0);
        recent.insert(hourly, remember(decision(1), window(3_600)), 10);
        // Half the bound's ids, in one-second windows (live until 2 s), each sent again at
        // 10 s, when its window is over: a new check in its own window, answered again.
        let half = RECENT_IDS_MAX as u64 / 2;
        for seq in 1..=half {
            recent.insert(id(2, seq), remember(decision(2), window(1)), 0);
        }
        let later = Window::containing(10, 1).unwrap();
        for seq in 1..=half {
            assert_eq!(
                held(&recent, id(2, seq), 10_000),
                None,
                "its window is over"
            );
            recent.insert(id(2, seq), remember(decision(3), later), 10);
        }
        let distinct = recent.len();
        assert!(
            distinct as u64 <= half + 1 && distinct < RECENT_IDS_MAX,
            "{distinct} ids held"
        );
        assert_eq!(
            held(&recent, hourly, 10_000),
            Some(1),
            "one of the {} most recent ids, its window live: a retry of it counts again",
            half + 1
        );
    }

    /// The places ids answered again leave behind a live id are bounded too: at most as
    /// many as the ids held.
    #[test]
    fn the_places_left_by_ids_answered_again_are_bounded() {
        let mut recent = RecentIds::with_max(4);
        recent.insert(id(1, 0), remember(decision(1), window(3_600)), 0);
        for second in 0..100 {
            for seq in 1..=3 {
                let this_second = Window::containing(second, 1).unwrap();
                recent.insert(id(2, seq), remember(decision(2), this_second), second);
            }
        }
        assert!(recent.order.len() <= 2 * 4, "{} places", recent.order.len());
        assert_eq!(recent.len(), 4);
        assert_eq!(held(&recent, id(1, 0), 99_000), Some(1));
    }

    /// (Found in review, session 47.) the order holds at most twice the bound's places, as the memory bound
    /// (about 18 MB) is reckoned with; its allocation should be no larger.
    #[test]
    fn the_orders_allocation_is_within_the_memory_bound() {
        let mut recent = RecentIds::default();
        let max = RECENT_IDS_MAX as u64;
        // The oldest id is live and stays at the front; the others are answered again
        // (each after its first window ended): each leaves a place behind it.
        recent.insert(id(9, 0), remember(decision(1), window(3_600)), 0);
        for seq in 1..max {
            recent.insert(id(1, seq), remember(decision(1), window(3_600)), 0);
        }
        for seq in 1..max {
            recent.insert(id(1, seq), remember(decision(2), window(3_600)), 0);
        }
        recent.insert(id(1, 1), remember(decision(3), window(3_600)), 0);
        recent.insert(id(1, 2), remember(decision(3), window(3_600)), 0);
        assert_eq!(recent.len(), RECENT_IDS_MAX);
        assert!(recent.order.len() <= 2 * RECENT_IDS_MAX);
        let entry = size_of::<(CheckId, u64)>();
        let order_bytes = recent.order.capacity() * entry;
        let table_bytes = 131_072 * size_of::<(CheckId, (Remembered, u64))>();
        assert!(
            recent.order.capacity() <= 2 * RECENT_IDS_MAX,
            "the order's allocation holds {} places ({} bytes, {:.1} MB with the table), \
             not the bound's {} (about 18 MB)",
            recent.order.capacity(),
            order_bytes,
            (order_bytes + table_bytes) as f64 / 1e6,
            2 * RECENT_IDS_MAX
        );
    }

    #[test]
    fn an_entry_is_the_size_the_memory_bound_is_reckoned_with() {
        assert_eq!(size_of::<(CheckId, (Remembered, u64))>(), 112);
    }

    #[test]
    fn the_oldest_ids_are_pushed_out_past_the_bound() {
        let mut recent = RecentIds::with_max(3);
        for seq in 1..=5 {
            recent.insert(id(7, seq), remember(decision(seq as i128), window(30)), 10);
        }
        assert_eq!(recent.len(), 3);
        assert_eq!(
            held(&recent, id(7, 2), 10_000),
            None,
            "pushed out: decided again"
        );
        assert_eq!(held(&recent, id(7, 3), 10_000), Some(3));
        assert_eq!(held(&recent, id(7, 5), 10_000), Some(5));
    }

    #[test]
    fn ids_whose_windows_are_over_are_let_go_and_one_decided_again_is_held_once() {
        let mut recent = RecentIds::with_max(10);
        recent.insert(id(1, 1), remember(decision(1), window(10)), 10);
        recent.insert(id(1, 2), remember(decision(2), window(30)), 10);
        recent.insert(id(1, 3), remember(decision(3), window(30)), 30);
        assert_eq!(
            recent.len(),
            2,
            "the first window stopped being live at 20 s"
        );
        // An id decided again in a later window takes a new place in the order: its old
        // place, at the front, does not push out the new decision.
        let mut again = RecentIds::with_max(2);
        again.insert(id(1, 1), remember(decision(1), window(10)), 10);
        again.insert(id(1, 2), remember(decision(2), window(50)), 10);
        again.insert(id(1, 1), remember(decision(7), window(40)), 15);
        again.insert(id(1, 3), remember(decision(3), window(50)), 15);
        assert_eq!(held(&again, id(1, 1), 15_000), Some(7));
        assert_eq!(
            held(&again, id(1, 2), 15_000),
            None,
            "the oldest held is pushed out"
        );
        assert_eq!(held(&again, id(1, 3), 15_000), Some(3));
        assert_eq!(again.len(), 2);
    }

    /// Two sends of `id`: the first passes `seq` on to the second, and both go.
    fn pass_on_and_go(waiting: &Arc<Waiting>, id: CheckId, seq: u64) {
        let (first, second) = (waiting.add(id), waiting.add(id));
        first.pass_on(seq);
        drop((first, second));
    }

    #[test]
    fn numbers_passed_on_outlive_the_ids_last_send_for_the_last_ids_kept_so() {
        let waiting = Arc::new(Waiting::default());
        pass_on_and_go(&waiting, id(1, 0), 7);
        let next = waiting.add(id(1, 0));
        assert!(!next.has_company(), "no send of it waits");
        assert_eq!(next.take_passed_on(), [7], "the next send takes the number");
        drop(next);
        assert!(waiting.lock().sends.is_empty(), "taken, then let go");
        for seq in 0..=PASSED_ON_IDS_HELD as u64 {
            pass_on_and_go(&waiting, id(2, seq), seq);
        }
        assert_eq!(waiting.lock().sends.len(), PASSED_ON_IDS_HELD);
        assert!(
            waiting.add(id(2, 0)).take_passed_on().is_empty(),
            "the oldest went"
        );
        assert_eq!(waiting.sends(), 0);
    }

    /// An id whose keeping falls out of the last `PASSED_ON_IDS_HELD` while a send of it
    /// waits again stays: the send still counts as waiting, so a retry beside it gets no
    /// fallback (both would count), and the number passed on stays for the send to take.
    #[test]
    fn an_id_whose_keeping_falls_out_while_a_send_of_it_waits_is_kept() {
        let waiting = Arc::new(Waiting::default());
        pass_on_and_go(&waiting, id(1, 0), 7);
        let next = waiting.add(id(1, 0));
        for seq in 0..PASSED_ON_IDS_HELD as u64 {
            pass_on_and_go(&waiting, id(2, seq), seq);
        }
        let retry = waiting.add(id(1, 0));
        assert!(retry.has_company(), "the send before it still waits");
        assert_eq!(
            next.take_passed_on(),
            [7],
            "the number is still there to take"
        );
    }

    #[test]
    fn an_id_kept_again_counts_from_its_last_keeping() {
        let waiting = Arc::new(Waiting::default());
        pass_on_and_go(&waiting, id(1, 0), 7);
        // A send of it that takes nothing (answered by the region), then goes: kept again.
        drop(waiting.add(id(1, 0)));
        for seq in 1..PASSED_ON_IDS_HELD as u64 {
            pass_on_and_go(&waiting, id(2, seq), seq);
        }
        assert_eq!(
            waiting.add(id(1, 0)).take_passed_on(),
            [7],
            "kept {} ids ago, the newest of those held",
            PASSED_ON_IDS_HELD - 1
        );
    }
}
