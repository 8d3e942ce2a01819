//! The requests in flight on one connection, by id, and the coarse clock that times them
//! out.
//!
//! Sans-IO: no sockets, no tasks, no clock reads. The connection keeps one [`InFlight`]
//! under its lock; callers, the reader task and the sweeper task call into it and wake the
//! [`Waker`]s it hands back once the lock is released.
//!
//! Ids are sequential per connection, so the slots are a queue indexed by `id - first_id`
//! rather than a hash map: registering is a push, an answer is an index, and the slots of
//! calls that finished are popped from the front. A call still live at the front (an
//! outcome nobody has collected, or a request the sidecar has not answered) moves off it
//! to a side map once the queue is long, so neither a call that is never polled again nor
//! a request answered late keeps the queue from moving on: the queue is at most
//! `span_max` long, and the side map holds only live calls.

use std::collections::{HashMap, VecDeque};
use std::task::Waker;
use std::time::Duration;

use crate::error::Error;
use crate::wire::{Refusal, Reply};

/// Why a connection closed.
#[derive(Debug, Clone)]
pub(crate) enum Broken {
    /// A read or write failed, the sidecar closed the stream, or the client went away.
    Disconnected,
    /// The sidecar sent a frame that does not decode.
    Protocol(String),
}

impl From<Broken> for Error {
    fn from(broken: Broken) -> Self {
        match broken {
            Broken::Disconnected => Error::Disconnected,
            Broken::Protocol(why) => Error::Protocol(why),
        }
    }
}

/// What a call is told once: the sidecar's answer, or why there will be none.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The sidecar answered.
    Answered(Result<Reply, Refusal>),
    /// No answer came within the timeout.
    TimedOut,
    /// The connection closed first.
    Closed(Broken),
    /// The connection closed while the request was still in the client's outbox, never
    /// handed to the socket: the sidecar cannot have read it.
    Unwritten(Broken),
    /// The sidecar answered under the call's id with a body this client does not decode
    /// (a reply or a refusal newer than this build): why.
    Undecodable(String),
}

impl Outcome {
    /// What the call returns: the reply, or why there is none. `timeout` is the one that
    /// ran out, for [`Outcome::TimedOut`].
    pub(crate) fn into_result(self, timeout: Duration) -> Result<Reply, Error> {
        match self {
            Outcome::Answered(result) => result.map_err(Error::Refused),
            Outcome::TimedOut => Err(Error::Timeout { after: timeout }),
            Outcome::Closed(broken) => Err(broken.into()),
            Outcome::Unwritten(broken) => {
                let why = "the connection closed before the request was written";
                Err(Error::NotSent {
                    why: match broken {
                        Broken::Disconnected => why.to_string(),
                        Broken::Protocol(broken) => format!("{why} ({broken})"),
                    },
                })
            }
            Outcome::Undecodable(why) => Err(Error::Protocol(why)),
        }
    }
}

/// The connection's clock: the sweeper task ticks it every `tick`, and each request
/// remembers the epoch (the number of ticks so far) in which it was sent. One timer per
/// connection instead of one per request, and no clock read per request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadlines {
    /// How long the sweeper sleeps between ticks.
    pub(crate) tick: Duration,
    /// Whole ticks in a timeout, rounded up.
    ticks: u64,
}

/// Ticks per timeout: a request times out between its timeout and about an eighth more
/// (and up to a millisecond a tick more, Tokio's timer rounding each sleep up).
const TICKS_PER_TIMEOUT: u32 = 8;

/// The shortest tick, so that a tiny timeout does not make the sweeper spin. Tokio's timer
/// counts whole milliseconds anyway.
const TICK_MIN: Duration = Duration::from_millis(1);

impl Deadlines {
    /// The clock for requests that wait at most `timeout`.
    pub(crate) fn new(timeout: Duration) -> Deadlines {
        let tick = (timeout / TICKS_PER_TIMEOUT).max(TICK_MIN);
        let ticks = timeout.as_nanos().div_ceil(tick.as_nanos());
        Deadlines {
            tick,
            ticks: u64::try_from(ticks).unwrap_or(u64::MAX),
        }
    }

    /// Whether a request sent in epoch `since` has waited its timeout by epoch `now`.
    ///
    /// It was sent after the tick that began `since`, and the tick that begins epoch
    /// `since + 1` comes after the send, one full tick after the previous one or (when the
    /// sweeper was parked) after the send woke it. So by the tick that begins
    /// `since + ticks + 1`, at least `ticks` whole ticks, the timeout, have passed since the
    /// send: a request never times out early. The tick that begins `since + 1` comes at
    /// most a tick after the send, so it times out at most about a tick late.
    pub(crate) fn expired(&self, since: u64, now: u64) -> bool {
        now.saturating_sub(since) > self.ticks
    }
}

/// One request's place in the queue.
#[derive(Debug)]
enum Slot {
    /// Sent or queued to send; no outcome yet. `since` is the epoch the call began in.
    Waiting { waker: Waker, since: u64 },
    /// The outcome is in; the call has not collected it yet.
    Done(Outcome),
    /// Nobody waits: the call collected its outcome or gave up. A late answer is dropped.
    Vacant,
}

/// The calls waiting on one connection, by request id.
#[derive(Debug)]
pub(crate) struct InFlight {
    /// The id of `slots[0]`. Every id below it is vacant or in `parked`.
    first_id: u64,
    /// Invariant: the front slot, if any, is not `Vacant`: vacant slots are popped from the
    /// front as soon as they are there, so the queue spans only from the oldest live call.
    slots: VecDeque<Slot>,
    /// Live slots below `first_id` (waiting, or done and not collected): moved off the
    /// front when the queue reached `span_max`. Never `Vacant`: a slot is removed when its
    /// call collects its outcome or gives up.
    parked: HashMap<u64, Slot>,
    /// The longest the queue grows before the live call at its front is parked.
    span_max: usize,
    /// Calls that will still collect an outcome: slots that are not vacant, and `parked`.
    live: usize,
}

impl InFlight {
    /// No calls; the first request takes id `first_id`. Past `span_max` slots, the live call
    /// at the front is parked aside.
    pub(crate) fn new(first_id: u64, span_max: usize) -> InFlight {
        InFlight {
            first_id,
            slots: VecDeque::new(),
            parked: HashMap::new(),
            span_max,
            live: 0,
        }
    }

    /// The id the next request takes.
    pub(crate) fn next_id(&self) -> u64 {
        self.first_id + self.slots.len() as u64
    }

    /// How many slots the queue holds, from the oldest live call to the newest.
    #[cfg(test)]
    pub(crate) fn span(&self) -> usize {
        self.slots.len()
    }

    /// How many calls will still collect an outcome.
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    /// Registers a call that `waker` waits on, begun in epoch `since`; returns its id.
    pub(crate) fn push(&mut self, waker: Waker, since: u64) -> u64 {
        while self.slots.len() >= self.span_max {
            let Some(front) = self.slots.pop_front() else {
                break;
            };
            self.parked.insert(self.first_id, front);
            self.first_id += 1;
            self.pop_vacant();
        }
        let id = self.next_id();
        self.slots.push_back(Slot::Waiting { waker, since });
        self.live += 1;
        id
    }

    /// Hands `result` to the call waiting on `id` and returns its waker, to be woken once
    /// the lock is released. An answer nobody waits for (late, repeated or unknown) is
    /// dropped.
    pub(crate) fn answer(&mut self, id: u64, result: Result<Reply, Refusal>) -> Option<Waker> {
        self.settle(id, Outcome::Answered(result))
    }

    /// As [`InFlight::answer`], for an answer whose body did not decode: `why`.
    pub(crate) fn undecodable(&mut self, id: u64, why: String) -> Option<Waker> {
        self.settle(id, Outcome::Undecodable(why))
    }

    fn settle(&mut self, id: u64, outcome: Outcome) -> Option<Waker> {
        let slot = self.slot_mut(id)?;
        if !matches!(slot, Slot::Waiting { .. }) {
            return None;
        }
        match std::mem::replace(slot, Slot::Done(outcome)) {
            Slot::Waiting { waker, .. } => Some(waker),
            Slot::Done(_) | Slot::Vacant => None,
        }
    }

    /// The call on `id` asks for its outcome: `Some` once, freeing the slot; `None` while it
    /// waits, and `waker` is the one to wake.
    pub(crate) fn poll(&mut self, id: u64, waker: &Waker) -> Option<Outcome> {
        let slot = self.slot_mut(id);
        let slot = slot.expect("invariant: a call polls only its own registered, uncollected id");
        match slot {
            Slot::Waiting { waker: waiting, .. } => {
                if !waiting.will_wake(waker) {
                    waiting.clone_from(waker);
                }
                None
            }
            Slot::Done(_) => {
                let Slot::Done(outcome) = std::mem::replace(slot, Slot::Vacant) else {
                    unreachable!("the slot was just matched as done");
                };
                self.free(id);
                Some(outcome)
            }
            Slot::Vacant => panic!("invariant: request {id} polled after it was collected"),
        }
    }

    /// The call on `id` gives up (its future was dropped); a late answer will be dropped.
    pub(crate) fn abandon(&mut self, id: u64) {
        let Some(slot) = self.slot_mut(id) else {
            return;
        };
        if matches!(slot, Slot::Vacant) {
            return;
        }
        *slot = Slot::Vacant;
        self.free(id);
    }

    /// Frees the slot of `id`, just made vacant: its call will collect nothing more.
    fn free(&mut self, id: u64) {
        self.live -= 1;
        if id < self.first_id {
            self.parked.remove(&id);
        } else {
            self.pop_vacant();
        }
    }

    /// Times out every call that has waited its timeout by epoch `now`, pushing their
    /// wakers to `wakers`.
    pub(crate) fn expire(&mut self, deadlines: &Deadlines, now: u64, wakers: &mut Vec<Waker>) {
        // Every slot is looked at, not only up to the first unexpired one: a call that
        // waited for room in the outbox was sent after younger ones, so `since` is not
        // sorted by id. The queue spans the calls in flight, and this runs once a tick.
        for slot in self.slots.iter_mut().chain(self.parked.values_mut()) {
            if matches!(slot, Slot::Waiting { since, .. } if deadlines.expired(*since, now)) {
                if let Slot::Waiting { waker, .. } =
                    std::mem::replace(slot, Slot::Done(Outcome::TimedOut))
                {
                    wakers.push(waker);
                }
            }
        }
    }

    /// Fails every waiting call with `broken`, pushing their wakers to `wakers`: those from
    /// id `unwritten` on were never written ([`Outcome::Unwritten`]).
    pub(crate) fn close(&mut self, broken: &Broken, unwritten: u64, wakers: &mut Vec<Waker>) {
        let ids = self.first_id..;
        let slots = ids.zip(self.slots.iter_mut());
        let parked = self.parked.iter_mut().map(|(&id, slot)| (id, slot));
        for (id, slot) in slots.chain(parked) {
            if matches!(slot, Slot::Waiting { .. }) {
                let outcome = if id >= unwritten {
                    Outcome::Unwritten(broken.clone())
                } else {
                    Outcome::Closed(broken.clone())
                };
                if let Slot::Waiting { waker, .. } = std::mem::replace(slot, Slot::Done(outcome)) {
                    wakers.push(waker);
                }
            }
        }
    }

    fn slot_mut(&mut self, id: u64) -> Option<&mut Slot> {
        let Some(index) = id.checked_sub(self.first_id) else {
            return self.parked.get_mut(&id);
        };
        self.slots.get_mut(usize::try_from(index).ok()?)
    }

    fn pop_vacant(&mut self) {
        while let Some(Slot::Vacant) = self.slots.front() {
            self.slots.pop_front();
            self.first_id += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Estimate;

    fn counted(estimate: i128) -> Result<Reply, Refusal> {
        Ok(Reply::Counted(Estimate {
            estimate,
            window: 1,
            staleness_ms: 0,
        }))
    }

    fn waker() -> Waker {
        Waker::noop().clone()
    }

    #[test]
    fn answers_in_any_order_reach_their_own_ids() {
        let mut in_flight = InFlight::new(1, 1 << 16);
        let ids: Vec<u64> = (0..3).map(|_| in_flight.push(waker(), 0)).collect();
        assert_eq!(ids, [1, 2, 3]);
        for &id in ids.iter().rev() {
            assert!(in_flight.answer(id, counted(id.into())).is_some());
        }
        for &id in &ids {
            let outcome = in_flight.poll(id, &waker());
            assert!(
                matches!(&outcome, Some(Outcome::Answered(result)) if *result == counted(id.into())),
                "{outcome:?}"
            );
        }
        assert_eq!((in_flight.span(), in_flight.live()), (0, 0));
        assert_eq!(in_flight.next_id(), 4);
    }

    #[test]
    fn an_outcome_never_collected_is_parked_and_the_queue_moves_on() {
        let mut in_flight = InFlight::new(1, 4);
        let forgotten = in_flight.push(waker(), 0);
        in_flight.answer(forgotten, counted(1));
        for n in 2..100 {
            let id = in_flight.push(waker(), 0);
            in_flight.answer(id, counted(n));
            assert!(in_flight.poll(id, &waker()).is_some());
            assert!(
                in_flight.span() <= 4,
                "the queue grew to {}",
                in_flight.span()
            );
        }
        assert_eq!(
            in_flight.live(),
            1,
            "the forgotten call is still owed its outcome"
        );
        let outcome = in_flight.poll(forgotten, &waker());
        assert!(
            matches!(&outcome, Some(Outcome::Answered(result)) if *result == counted(1)),
            "{outcome:?}"
        );
        assert_eq!(in_flight.live(), 0);
        // A parked call that gives up frees its outcome too.
        let given_up = in_flight.push(waker(), 0);
        in_flight.answer(given_up, counted(7));
        for _ in 0..4 {
            let id = in_flight.push(waker(), 0);
            in_flight.abandon(id);
        }
        in_flight.abandon(given_up);
        assert_eq!((in_flight.live(), in_flight.span()), (0, 0));
    }

    #[test]
    fn a_call_waiting_at_the_front_is_parked_and_still_answered_timed_out_or_closed() {
        let deadlines = Deadlines::new(Duration::from_millis(80));
        let mut in_flight = InFlight::new(1, 4);
        let (answered, timed_out, closed) = (
            in_flight.push(waker(), 0),
            in_flight.push(waker(), 0),
            in_flight.push(waker(), 100),
        );
        // The sidecar answers every later request but not these three.
        for n in 0..10_000 {
            let id = in_flight.push(waker(), 100);
            in_flight.answer(id, counted(n));
            assert!(in_flight.poll(id, &waker()).is_some());
        }
        assert!(
            in_flight.span() <= 4,
            "the queue grew to {}",
            in_flight.span()
        );
        assert_eq!(in_flight.live(), 3);
        assert!(
            in_flight.poll(answered, &waker()).is_none(),
            "still waiting"
        );
        assert!(in_flight.answer(answered, counted(1)).is_some());
        assert!(matches!(
            in_flight.poll(answered, &waker()),
            Some(Outcome::Answered(result)) if result == counted(1)
        ));
        let mut wakers = Vec::new();
        in_flight.expire(&deadlines, 100, &mut wakers);
        assert_eq!(
            wakers.len(),
            1,
            "the call begun at epoch 0 times out, alone"
        );
        assert!(matches!(
            in_flight.poll(timed_out, &waker()),
            Some(Outcome::TimedOut)
        ));
        in_flight.close(&Broken::Disconnected, u64::MAX, &mut wakers);
        assert!(matches!(
            in_flight.poll(closed, &waker()),
            Some(Outcome::Closed(Broken::Disconnected))
        ));
        assert_eq!(in_flight.live(), 0);
    }

    #[test]
    fn a_waiting_call_polls_none_until_answered() {
        let mut in_flight = InFlight::new(7, 1 << 16);
        let id = in_flight.push(waker(), 0);
        assert!(in_flight.poll(id, &waker()).is_none());
        in_flight.answer(id, counted(1));
        assert!(in_flight.poll(id, &waker()).is_some());
    }

    #[test]
    fn late_repeated_and_unknown_answers_are_dropped() {
        let mut in_flight = InFlight::new(1, 1 << 16);
        let first = in_flight.push(waker(), 0);
        let second = in_flight.push(waker(), 0);
        in_flight.abandon(first);
        // The abandoned front slot is popped; its answer finds nobody.
        assert_eq!(in_flight.span(), 1);
        assert!(in_flight.answer(first, counted(1)).is_none());
        assert!(in_flight.answer(second + 1, counted(1)).is_none());
        assert!(in_flight.answer(u64::MAX, counted(1)).is_none());
        assert!(in_flight.answer(second, counted(2)).is_some());
        assert!(in_flight.answer(second, counted(3)).is_none());
        let outcome = in_flight.poll(second, &waker());
        assert!(
            matches!(&outcome, Some(Outcome::Answered(result)) if *result == counted(2)),
            "{outcome:?}"
        );
    }

    #[test]
    fn vacant_slots_behind_a_live_one_are_popped_when_it_finishes() {
        let mut in_flight = InFlight::new(1, 1 << 16);
        let ids: Vec<u64> = (0..4).map(|_| in_flight.push(waker(), 0)).collect();
        in_flight.abandon(ids[1]);
        in_flight.abandon(ids[2]);
        assert_eq!((in_flight.span(), in_flight.live()), (4, 2));
        in_flight.abandon(ids[0]);
        assert_eq!((in_flight.span(), in_flight.live()), (1, 1));
        // Abandoning twice, or an id long gone, changes nothing.
        in_flight.abandon(ids[0]);
        assert_eq!((in_flight.span(), in_flight.live()), (1, 1));
    }

    #[test]
    fn calls_time_out_after_their_whole_timeout_of_ticks_and_not_before() {
        let deadlines = Deadlines::new(Duration::from_millis(800));
        assert_eq!(deadlines.tick, Duration::from_millis(100));
        let mut in_flight = InFlight::new(1, 1 << 16);
        let early = in_flight.push(waker(), 3);
        let late = in_flight.push(waker(), 5);
        let mut wakers = Vec::new();
        // Sent in epoch 3: 8 whole ticks have passed only once epoch 12 begins.
        in_flight.expire(&deadlines, 11, &mut wakers);
        assert!(wakers.is_empty());
        in_flight.expire(&deadlines, 12, &mut wakers);
        assert_eq!(wakers.len(), 1);
        assert!(matches!(
            in_flight.poll(early, &waker()),
            Some(Outcome::TimedOut)
        ));
        assert!(in_flight.poll(late, &waker()).is_none());
        // A timed-out call's late answer is dropped.
        assert!(in_flight.answer(early, counted(1)).is_none());
    }

    #[test]
    fn deadlines_round_the_timeout_up_to_whole_ticks_of_at_least_a_millisecond() {
        let tiny = Deadlines::new(Duration::from_micros(2500));
        assert_eq!(tiny.tick, TICK_MIN);
        assert!(!tiny.expired(0, 3));
        assert!(tiny.expired(0, 4));
        let zero = Deadlines::new(Duration::ZERO);
        assert!(!zero.expired(5, 5));
        assert!(zero.expired(5, 6));
    }

    #[test]
    fn closing_fails_the_waiting_calls_and_keeps_the_answered_ones() {
        let mut in_flight = InFlight::new(1, 1 << 16);
        let answered = in_flight.push(waker(), 0);
        let waiting = in_flight.push(waker(), 0);
        in_flight.answer(answered, counted(1));
        let mut wakers = Vec::new();
        in_flight.close(&Broken::Protocol("bad frame".into()), u64::MAX, &mut wakers);
        assert_eq!(wakers.len(), 1);
        assert!(matches!(
            in_flight.poll(answered, &waker()),
            Some(Outcome::Answered(_))
        ));
        assert!(matches!(
            in_flight.poll(waiting, &waker()),
            Some(Outcome::Closed(Broken::Protocol(why))) if why == "bad frame"
        ));
    }
}
