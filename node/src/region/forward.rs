//! The edge's side of the region path (and the region node's, for its own clients, on a
//! session within the node): forwards exact checks on one long-lived session to the
//! region, many to a frame when they queue up, and waits, at most each rule's
//! `region_timeout_ms`, for a durable answer. Checks a broken session left unanswered are
//! sent again on the next, with the same request ids (the region answers a repeat with
//! its first outcome). A decision says exact only when the region answered.
//!
//! A check costs no task and no timer: it is handed to the one session task with the
//! channel its answer goes to, and that task keeps every unanswered check by sequence
//! number and by deadline, answering each once: when the region does, when its deadline
//! passes, or, if the task ends, with "the forwarder has stopped". A check is encoded into
//! a frame only when the session's writer has room for one, so most checks whose deadlines
//! pass while the region does not read are answered here and never sent; but those in the
//! frames already handed to the writer (up to `FRAMES_QUEUED` waiting, one held by QUIC's
//! flow control, and what the stream's window took) are sent behind their answers, and
//! the region may count them (ARCHITECTURE.md's gaps).

use super::deadlines::{self, Deadlines};
use super::log::RequestId;
use super::wire::CheckRef;
use super::wire::{self, CHECKS_PER_FRAME_MAX, REGION_FRAME_BYTES_MAX};
use super::{ExactAnswer, Outcome};
use crate::clock::Clock;
use crate::metrics::LatencyHistogram;
use crate::transport::{FrameRead, Requester, Session, SessionReceive, SessionSend, Sessions};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tally_client::wire::{CheckId, Refusal};
use tally_crdt::{Key, NodeId, ReplicaId};
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};

/// Counters of the exact path at this node (an edge, or the region for its own clients),
/// for the metrics.
#[derive(Debug, Default)]
pub struct ForwardStats {
    /// Checks the region decided, by their time from reading to the durable answer.
    pub latency: LatencyHistogram,
    /// Checks answered `RegionUnavailable` or by their fallback: no durable answer in time,
    /// the forwarder stopped before writing them, or the region held no live window for
    /// them on their first send.
    pub unavailable: AtomicU64,
    /// Checks the region refused for its storage.
    pub storage_errors: AtomicU64,
    /// Checks sent again on a new session, after the one they were sent on broke.
    pub retries: AtomicU64,
    /// Frames of answers from the region that did not decode, or whose length was zero or
    /// over the limit: each broke its session.
    pub answers_bad: AtomicU64,
}

/// Forwards exact checks from one life of this node to the region. `T` is the caller's ticket: it
/// comes back with the check's answer.
pub struct Forwarder<T> {
    checks: mpsc::UnboundedSender<Vec<Box<Pending<T>>>>,
    replica: ReplicaId,
    clock: Clock,
    stats: Arc<ForwardStats>,
}

/// A forwarded check's answer, with the ticket it was submitted with.
#[derive(Debug)]
pub struct Forwarded<T> {
    /// The caller's ticket.
    pub ticket: T,
    /// For a check written to the region and then answered `RegionUnavailable` (its
    /// deadline passed): its sequence number among this edge life's requests, under which
    /// an admission the region answers late is reported ([`LateAdmissions`]). `None`
    /// otherwise: the region answered in time, or never got the check.
    pub late_seq: Option<u64>,
    /// The region's durable outcome; else `RegionUnavailable` (no answer in time, no live
    /// window at the region, a stopped forwarder), `Forgotten` (a retry of an id the region no
    /// longer remembers: decided once, never again), `Storage` (the region could not
    /// make the decision durable), `KeysFull` (the region's ledger holds its maximum of
    /// keys and the check would add one: not decided), `BadField` on the id (the
    /// region decided the check's [`CheckId`] for another check: not decided), or
    /// `BadField` on the rule (the region has no such exact rule: never decided).
    pub result: Result<Outcome, Refusal>,
}

/// Where forwarded checks' answers go: in runs, those of one caller that the region
/// answered together arrive as one message.
pub type Answers<T> = mpsc::UnboundedSender<Vec<Forwarded<T>>>;

/// Where the sequence numbers of checks go that the region admitted after their callers
/// were answered `RegionUnavailable`: a fallback counted for one counts it a second time.
pub type LateAdmissions = mpsc::UnboundedSender<Vec<u64>>;

/// How many written checks past their deadline a forwarder remembers, the last to time
/// out, of each kind: those answered `RegionUnavailable` (to report if the region admits them
/// after all) and those whose caller left (to time a decision that comes later).
const TIMED_OUT_HELD: usize = 4_096;

/// A check to forward.
#[derive(Debug)]
pub struct Check<T> {
    /// What it counts; the key names the rule.
    pub key: Key,
    /// The check's cost.
    pub cost: u64,
    /// The rule's `region_timeout_ms`: how long the check waits for the region.
    pub timeout_ms: u64,
    /// The application's name for the check across its retries, if it gave one: the region
    /// then deduplicates under it instead of this edge life's request id.
    pub check_id: Option<CheckId>,
    /// The caller's ticket, handed back with the answer.
    pub ticket: T,
}

/// A check waiting for its answer, and where the answer goes. Boxed from its submission
/// on, so the channel and the ring that hold it move a pointer.
struct Pending<T> {
    id: RequestId,
    // The check's rule is the key's.
    key: Key,
    cost: u64,
    check_id: Option<CheckId>,
    ticket: T,
    answers: Answers<T>,
    // When it arrived from its caller, on the node's monotonic clock (`Clock::mono`).
    arrived: Duration,
    timeout_ms: u64,
    // How many sessions it was written on: writing it again is a retry, and the region
    // may have decided it on an earlier one.
    writes: u32,
}

impl<T> Pending<T> {
    /// The check as it is written to the region.
    fn check(&self) -> CheckRef<'_> {
        CheckRef {
            id: self.id,
            check_id: self.check_id,
            rule: self.key.rule.as_str(),
            subject: self.key.subject.as_str(),
            window_index: self.key.window.index(),
            window_secs: self.key.window.len_secs(),
            cost: self.cost,
        }
    }

    fn rule(&self) -> String {
        self.key.rule.as_str().to_owned()
    }

    /// Whoever waits for the answer is gone: the check need not be sent (again). One
    /// written already is still held until it is answered or its deadline passes, since
    /// the region may yet decide it: its ticket (at an edge, the count of its id's sends
    /// waiting) keeps a retry of its id elsewhere from falling back and counting
    /// meanwhile.
    fn abandoned(&self) -> bool {
        self.answers.is_closed()
    }

    fn answer(self, result: Result<Outcome, Refusal>, late_seq: Option<u64>) {
        let _ = self.answers.send(vec![Forwarded {
            ticket: self.ticket,
            late_seq,
            result,
        }]);
    }

    /// Answers that the forwarder stopped before the region answered: `RegionUnavailable`
    /// for a check never written, which the region cannot have decided; `Forgotten` for one
    /// written, which it may have, so that no fallback counts it as well (no late
    /// admission can be taken back once the forwarder is gone).
    fn stopped(self, stats: &ForwardStats) {
        let rule = self.rule();
        if self.writes > 0 {
            self.answer(Err(Refusal::Forgotten { rule }), None);
            return;
        }
        stats.unavailable.fetch_add(1, Ordering::Relaxed);
        self.answer(
            Err(unavailable(rule, "the forwarder has stopped".into())),
            None,
        );
    }
}

fn unavailable(rule: String, why: String) -> Refusal {
    Refusal::RegionUnavailable { rule, why }
}

/// Where the region is.
enum Region {
    /// Another node, over QUIC.
    Remote {
        requester: Requester,
        node: NodeId,
        addr: String,
    },
    /// This node: its own region task, through its sessions' channel.
    Local { sessions: Sessions, node: NodeId },
}

impl Region {
    async fn open_session(&self) -> Result<Session, String> {
        match self {
            Region::Remote {
                requester,
                node,
                addr,
            } => requester.open_session(*node, addr).await,
            Region::Local { sessions, node } => Ok(sessions.open_local(*node)),
        }
    }

    /// Whether a session on `connection` is on the connection held for the region: a
    /// newer one may have been adopted.
    fn is_current(&self, connection: Option<usize>) -> bool {
        match self {
            Region::Remote {
                requester, node, ..
            } => requester.held(*node) == connection,
            Region::Local { .. } => true,
        }
    }
}

impl<T: Send + 'static> Forwarder<T> {
    /// A forwarder to the region `region` at `addr`, for `replica`'s requests. Starts the
    /// task that keeps its session to the region.
    pub fn new(
        requester: Requester,
        region: NodeId,
        addr: String,
        replica: ReplicaId,
        clock: Clock,
        stats: Arc<ForwardStats>,
        late: LateAdmissions,
    ) -> Forwarder<T> {
        let region = Region::Remote {
            requester,
            node: region,
            addr,
        };
        Forwarder::start(region, replica, clock, stats, late)
    }

    /// A forwarder on the region node itself, for its own clients' checks: they go to its
    /// region task through `sessions`, as a peer's frames do, and are decided and made
    /// durable the same way.
    pub fn local(
        sessions: Sessions,
        replica: ReplicaId,
        clock: Clock,
        stats: Arc<ForwardStats>,
        late: LateAdmissions,
    ) -> Forwarder<T> {
        let region = Region::Local {
            sessions,
            node: replica.node,
        };
        Forwarder::start(region, replica, clock, stats, late)
    }

    fn start(
        region: Region,
        replica: ReplicaId,
        clock: Clock,
        stats: Arc<ForwardStats>,
        late: LateAdmissions,
    ) -> Forwarder<T> {
        let (checks, incoming) = mpsc::unbounded_channel();
        tokio::spawn(keep_sessions(
            region,
            Held::new(incoming, clock, stats.clone(), late),
        ));
        Forwarder {
            checks,
            replica,
            clock,
            stats,
        }
    }

    /// The exact path's counters at this node.
    pub fn stats(&self) -> &ForwardStats {
        &self.stats
    }

    /// Forwards `checks`, which arrived (were read from their callers) at `arrived`. Each
    /// one's answer goes to `answers` with its ticket: the region's durable outcome, or
    /// `RegionUnavailable` once its rule's timeout has passed since `arrived` without one,
    /// so a check that waited before it was handed over (held for want of room) waits
    /// that much less for the region. The checks are handed over together, and held in
    /// their order.
    pub fn submit(
        &self,
        checks: impl IntoIterator<Item = Check<T>>,
        arrived: Instant,
        answers: &Answers<T>,
    ) {
        let arrived = self.clock.mono_at(arrived.into_std());
        let id = RequestId {
            node: self.replica.node.0,
            generation: self.replica.generation.0,
            // The session task gives each its sequence number.
            seq: 0,
        };
        let batch: Vec<Box<Pending<T>>> = (checks.into_iter())
            .map(|check| {
                Box::new(Pending {
                    id,
                    key: check.key,
                    cost: check.cost,
                    check_id: check.check_id,
                    ticket: check.ticket,
                    answers: answers.clone(),
                    arrived,
                    timeout_ms: check.timeout_ms,
                    writes: 0,
                })
            })
            .collect();
        if batch.is_empty() {
            return;
        }
        if let Err(mpsc::error::SendError(batch)) = self.checks.send(batch) {
            for pending in batch {
                pending.stopped(&self.stats);
            }
        }
    }
}

/// The session task's checks: those coming in, and every one held, sent or not, until it
/// is answered, its deadline passes or its caller stops waiting. Dropped (the task ended,
/// or panicked), it answers every check it has that the forwarder stopped.
struct Held<T> {
    incoming: mpsc::UnboundedReceiver<Vec<Box<Pending<T>>>>,
    // Every check from sequence number `base` on: `None` once it is answered, expired or
    // dropped. Invariant: the front is `Some` (or the ring is empty), and
    // `base + checks.len() == next_seq`.
    checks: VecDeque<Option<Box<Pending<T>>>>,
    base: u64,
    // Checks from this sequence number on are still to be written on the current session.
    // Invariant: `base <= unwritten <= next_seq`.
    unwritten: u64,
    // How many slots of `checks` are `Some`.
    live: usize,
    deadlines: Deadlines,
    // This edge life's next request sequence number: given out here, so that checks are
    // held in sequence order whatever threads submitted them.
    next_seq: u64,
    clock: Clock,
    stats: Arc<ForwardStats>,
    // The written checks past their deadline, with when each arrived, the last
    // `TIMED_OUT_HELD` to time out of each kind: those answered `RegionUnavailable`, whose admission
    // decided later is reported to `late`, and those whose caller left, held only to be
    // timed (apart, so that these never push out one whose late admission is to be
    // reported: found in review, session 48).
    timed_out_answered: TimedOut,
    timed_out_left: TimedOut,
    late: LateAdmissions,
}

impl<T> Held<T> {
    fn new(
        incoming: mpsc::UnboundedReceiver<Vec<Box<Pending<T>>>>,
        clock: Clock,
        stats: Arc<ForwardStats>,
        late: LateAdmissions,
    ) -> Held<T> {
        Held {
            incoming,
            checks: VecDeque::new(),
            base: 0,
            unwritten: 0,
            live: 0,
            deadlines: Deadlines::default(),
            next_seq: 0,
            clock,
            stats,
            timed_out_answered: TimedOut::default(),
            timed_out_left: TimedOut::default(),
            late,
        }
    }

    fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Holds a batch of new checks, in order.
    fn insert_all(&mut self, batch: Vec<Box<Pending<T>>>) {
        for pending in batch {
            self.insert(pending);
        }
    }

    /// Holds a new check, with the next sequence number, to be written on the session.
    fn insert(&mut self, mut pending: Box<Pending<T>>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        pending.id.seq = seq;
        let deadline = pending.arrived + Duration::from_millis(pending.timeout_ms);
        self.deadlines.push(pending.timeout_ms, deadline, seq);
        assert_eq!(
            self.base + self.checks.len() as u64,
            seq,
            "a check is held at its sequence number"
        );
        self.checks.push_back(Some(pending));
        self.live += 1;
    }

    /// Holds every check that came in, without waiting.
    fn take_incoming(&mut self) {
        while let Ok(batch) = self.incoming.try_recv() {
            self.insert_all(batch);
        }
    }

    fn slot(&mut self, seq: u64) -> Option<&mut Option<Box<Pending<T>>>> {
        let at = index(self.base, seq)?;
        self.checks.get_mut(at)
    }

    fn get(&self, seq: u64) -> Option<&Pending<T>> {
        held_at(&self.checks, self.base, seq)
    }

    fn remove(&mut self, seq: u64) -> Option<Box<Pending<T>>> {
        let pending = self.slot(seq)?.take()?;
        self.live -= 1;
        while let Some(None) = self.checks.front() {
            self.checks.pop_front();
            self.base += 1;
        }
        self.unwritten = self.unwritten.max(self.base);
        Some(pending)
    }

    /// A new session: every check held is written on it, in sequence order.
    fn resend_all(&mut self) {
        self.unwritten = self.base;
    }

    fn has_unsent(&self) -> bool {
        self.unwritten < self.next_seq
    }

    /// The next frame to write at monotonic time `now`: up to [`CHECKS_PER_FRAME_MAX`] of
    /// the checks to send, in order, leaving out those whose caller is gone. Checks whose
    /// deadline has passed are answered first, so none is sent after its caller was
    /// answered `RegionUnavailable`. `None` if none is left.
    fn next_frame(&mut self, now: Duration) -> Option<Vec<u8>> {
        self.expire(now);
        let (mut batch, mut retries) = (Vec::new(), 0);
        while batch.len() < CHECKS_PER_FRAME_MAX && self.unwritten < self.next_seq {
            let seq = self.unwritten;
            self.unwritten += 1;
            let Some(pending) = self.slot(seq).and_then(Option::as_mut) else {
                continue;
            };
            if pending.abandoned() {
                if pending.writes == 0 {
                    self.remove(seq);
                }
                continue;
            }
            retries += u64::from(pending.writes > 0);
            pending.writes = pending.writes.saturating_add(1);
            batch.push(seq);
        }
        self.stats.retries.fetch_add(retries, Ordering::Relaxed);
        if batch.is_empty() {
            return None;
        }
        let checks: Vec<CheckRef<'_>> = batch
            .iter()
            .filter_map(|&seq| self.get(seq))
            .map(Pending::check)
            .collect();
        Some(wire::encode_checks(&checks))
    }

    /// Points `alarm` at the first deadline held; `false` if none is.
    fn arm(&mut self, alarm: Pin<&mut Sleep>) -> bool {
        let (checks, base) = (&self.checks, self.base);
        let is_held = |seq| held_at(checks, base, seq).is_some();
        let Some(deadline) = self.deadlines.first(is_held) else {
            return false;
        };
        let at = self.clock.instant(deadline).into();
        if alarm.deadline() != at {
            alarm.reset(at);
        }
        true
    }

    /// Answers each check of a frame of the region's answers that still waits. The answers
    /// of a run of checks from one caller go to it as one message. The admissions of checks
    /// already answered `RegionUnavailable` go to `late`.
    fn answer_frame(&mut self, frame: Vec<wire::Answered>) {
        // One clock reading times the whole frame: its answers arrived together.
        let now = self.clock.mono();
        let mut run: Option<(Answers<T>, Vec<Forwarded<T>>)> = None;
        let mut late = Vec::new();
        for (seq, answer) in frame {
            let Some(pending) = self.remove(seq) else {
                let (arrived, answered) = match self.timed_out_answered.remove(seq) {
                    Some(arrived) => (arrived, true),
                    None => match self.timed_out_left.remove(seq) {
                        Some(arrived) => (arrived, false),
                        None => continue,
                    },
                };
                if let ExactAnswer::Decided(Outcome { allowed, .. }) = answer {
                    // Decided after its timeout: its latency too (found in review, session
                    // 47: the histogram stopped at the rules' timeouts).
                    self.stats.latency.record(now.saturating_sub(arrived));
                    if allowed && answered {
                        late.push(seq);
                    }
                }
                continue;
            };
            let result = self.result(&pending, answer, now);
            let Pending {
                ticket, answers, ..
            } = *pending;
            let forwarded = Forwarded {
                ticket,
                late_seq: None,
                result,
            };
            match &mut run {
                Some((to, answered)) if to.same_channel(&answers) => answered.push(forwarded),
                _ => {
                    if let Some((to, answered)) = run.replace((answers, vec![forwarded])) {
                        let _ = to.send(answered);
                    }
                }
            }
        }
        if let Some((to, answered)) = run {
            let _ = to.send(answered);
        }
        if !late.is_empty() {
            let _ = self.late.send(late);
        }
    }

    /// What the caller of `pending` is answered, given the region's `answer` at `now`.
    fn result(
        &self,
        pending: &Pending<T>,
        answer: ExactAnswer,
        now: Duration,
    ) -> Result<Outcome, Refusal> {
        match answer {
            ExactAnswer::Decided(outcome) => {
                let elapsed = now.saturating_sub(pending.arrived);
                self.stats.latency.record(elapsed);
                Ok(outcome)
            }
            // The region answers so a check whose window is over by its clock, whose ids
            // it no longer holds. Sent again, the check may have been decided on an
            // earlier session (its window ended meanwhile, a window shorter than the
            // rule's timeout): `Forgotten`, which no fallback answers instead, so that it
            // is not counted a second time. (Sent once, it was not decided.)
            ExactAnswer::UnknownRule if pending.writes > 1 => Err(Refusal::Forgotten {
                rule: pending.rule(),
            }),
            ExactAnswer::UnknownRule => Err(self.unavailable(
                pending.rule(),
                format!(
                    "the region has no live window of the exact rule {:?} for this check",
                    pending.key.rule.as_str()
                ),
            )),
            // A reachable region that lacks the rule (its rules and this sidecar's
            // disagree) never decides the check, however often sent: a typed error naming
            // the rule, which no retry changes, and never the rule's fallback, which is for
            // a region that does not answer (BRIEF), as for the region's other refusals.
            ExactAnswer::NoRule => Err(Refusal::BadField {
                field: "rule".into(),
                why: format!(
                    "the region has no exact rule {:?} of {} s windows: its rules and this \
                     sidecar's disagree; nothing counted",
                    pending.key.rule.as_str(),
                    pending.key.window.len_secs()
                ),
            }),
            ExactAnswer::Forgotten => Err(Refusal::Forgotten {
                rule: pending.rule(),
            }),
            ExactAnswer::KeysFull { keys_max } => Err(Refusal::KeysFull { keys_max }),
            ExactAnswer::IdReused => Err(Refusal::BadField {
                field: "id".into(),
                why: "this id named a check with another rule, subject or cost at the region, \
                      not this one; a retry must repeat its request, and a new request needs \
                      a new id"
                    .into(),
            }),
            ExactAnswer::Storage(why) => {
                self.stats.storage_errors.fetch_add(1, Ordering::Relaxed);
                // Cut as the region cuts it: a garbled or hostile frame's longer reason
                // would go to the client past its frame limit, failing its connection.
                Err(Refusal::Storage {
                    why: format!("region: {}", wire::storage_why(&why)),
                })
            }
        }
    }

    /// Answers every check whose deadline is at or before `now` (on the monotonic clock)
    /// with `RegionUnavailable`; one whose caller is gone is answered nothing and, if it was
    /// written, held to time a decision that comes later.
    fn expire(&mut self, now: Duration) {
        let mut due = Vec::new();
        self.deadlines.take_due(now, &mut due);
        for seq in due {
            let Some(pending) = self.remove(seq) else {
                continue;
            };
            if pending.abandoned() {
                // Its caller was answered nothing, so no fallback is to be taken back; if
                // written, the region may still decide it, and its latency counts.
                if pending.writes > 0 {
                    self.timed_out_left.hold(seq, pending.arrived);
                }
                continue;
            }
            let why = format!("no answer within {} ms", pending.timeout_ms);
            let refusal = self.unavailable(pending.rule(), why);
            // Only a check written to the region can be decided there after all.
            let late_seq = (pending.writes > 0).then_some(seq);
            let arrived = pending.arrived;
            pending.answer(Err(refusal), late_seq);
            if late_seq.is_some() {
                self.timed_out_answered.hold(seq, arrived);
            }
        }
    }

    /// Drops the checks whose callers stopped waiting before they were written (they are
    /// never sent), and gives back the room a burst left. One written already is held
    /// until its answer or its deadline ([`Pending::abandoned`]).
    fn purge(&mut self) {
        let abandoned: Vec<u64> = self
            .checks
            .iter()
            .flatten()
            .filter(|pending| pending.abandoned() && pending.writes == 0)
            .map(|pending| pending.id.seq)
            .collect();
        for seq in abandoned {
            self.remove(seq);
        }
        deadlines::shrink(&mut self.checks);
        self.deadlines.shrink();
    }

    fn unavailable(&self, rule: String, why: String) -> Refusal {
        self.stats.unavailable.fetch_add(1, Ordering::Relaxed);
        unavailable(rule, why)
    }
}

/// Where check `seq` sits in a ring of checks that starts at `base`, if it is not before it.
fn index(base: u64, seq: u64) -> Option<usize> {
    usize::try_from(seq.checked_sub(base)?).ok()
}

/// Check `seq` in a ring of checks that starts at `base`, if it is still held.
fn held_at<T>(
    checks: &VecDeque<Option<Box<Pending<T>>>>,
    base: u64,
    seq: u64,
) -> Option<&Pending<T>> {
    checks.get(index(base, seq)?)?.as_deref()
}

impl<T> Drop for Held<T> {
    fn drop(&mut self) {
        self.incoming.close();
        let incoming = std::iter::from_fn(|| self.incoming.try_recv().ok()).flatten();
        let held = std::mem::take(&mut self.checks).into_iter().flatten();
        for pending in held.chain(incoming.collect::<Vec<_>>()) {
            pending.stopped(&self.stats);
        }
    }
}

/// How long the session task waits after failing to open a session, at first and at most.
/// A failure may have cost the region a whole handshake (a certificate it refuses, say, or
/// one that ended), about 20 ms of its CPU: at most one a second, as the gossip's writer.
const BACKOFF_MIN: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How often a session drops the checks whose callers stopped waiting.
const PURGE_EVERY: Duration = Duration::from_millis(100);

/// How many frames of checks wait for a session's writer. Checks are encoded only when
/// there is room, so that few whose deadlines pass while the region does not read are
/// sent behind their answers: at most these frames and the one the writer holds.
const FRAMES_QUEUED: usize = 2;

/// Keeps a session open to the region while there are checks to carry, and carries them
/// over it, until the forwarder is dropped. Checks sent and not yet answered are sent
/// again on the next session if this one breaks; the region answers a repeat with its
/// first outcome. Checks whose caller stopped waiting are dropped, never sent again.
async fn keep_sessions<T>(region: Region, mut held: Held<T>) {
    let mut backoff = BACKOFF_MIN;
    loop {
        held.purge();
        if held.is_empty() {
            // A session is opened only for a check waiting: one opened at start-up would
            // dial a region that may not listen yet, and checks would queue behind that
            // handshake instead of using the connection the gossip has made by then.
            match held.incoming.recv().await {
                Some(batch) => held.insert_all(batch),
                None => return,
            }
        }
        let Some(opened) = meanwhile(region.open_session(), &mut held).await else {
            return;
        };
        let carried = match opened {
            Ok(session) => carry(&region, session, &mut held).await,
            // Checks that arrive meanwhile wait for the next session.
            Err(_) => Carried::Broken { answered: false },
        };
        match carried {
            // A session that carried answers was working: the next opens at once.
            Carried::Broken { answered: true } => backoff = BACKOFF_MIN,
            // One that failed to open, or broke before any answer (a region that resets
            // every session, say), is not retried in a tight loop.
            Carried::Broken { answered: false } => {
                let wait = tokio::time::sleep(backoff);
                if meanwhile(wait, &mut held).await.is_none() {
                    return;
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
            Carried::Dropped => return,
        }
    }
}

/// What woke [`meanwhile`].
enum Meanwhile<O, T> {
    Done(O),
    Checks(Option<Vec<Box<Pending<T>>>>),
    Deadline,
}

/// Runs `work` to its end while holding new checks and answering those whose deadline
/// passes. `None` if the forwarder was dropped meanwhile.
async fn meanwhile<T, F: Future>(work: F, held: &mut Held<T>) -> Option<F::Output> {
    tokio::pin!(work);
    let alarm = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(alarm);
    loop {
        let armed = held.arm(alarm.as_mut());
        let woke = tokio::select! {
            output = &mut work => Meanwhile::Done(output),
            batch = held.incoming.recv() => Meanwhile::Checks(batch),
            () = &mut alarm, if armed => Meanwhile::Deadline,
        };
        match woke {
            Meanwhile::Done(output) => return Some(output),
            Meanwhile::Checks(batch) => held.insert_all(batch?),
            Meanwhile::Deadline => held.expire(held.clock.mono()),
        }
    }
}

/// Why [`carry`] returned.
enum Carried {
    /// The session broke, or its connection was replaced: open another. `answered` if it
    /// carried at least one frame of answers.
    Broken { answered: bool },
    /// The forwarder was dropped.
    Dropped,
}

/// What woke [`carry`].
enum Carrying<'a, T> {
    Checks(Option<Vec<Box<Pending<T>>>>),
    Writable(Option<mpsc::Permit<'a, Vec<u8>>>),
    Answers(Option<Vec<wire::Answered>>),
    Deadline,
    Purge,
}

/// Carries checks over one session: first those held (sent on an earlier session, or
/// waiting for one), then new ones, as many to a frame as are waiting when the session's
/// writer has room for one. Frames are written and answers read by two tasks of the
/// session's, so that this one never waits on the region and answers every deadline on
/// time.
async fn carry<T>(region: &Region, session: Session, held: &mut Held<T>) -> Carried {
    let Session {
        send,
        receive,
        connection,
    } = session;
    let (answers, mut answered) = mpsc::unbounded_channel();
    let reader = tokio::spawn(read_answers(receive, answers, held.stats.clone()));
    let (frames, to_write) = mpsc::channel(FRAMES_QUEUED);
    tokio::spawn(write_frames(send, to_write));
    held.resend_all();
    let mut answered_any = false;
    let mut purge = crate::tasks::every(PURGE_EVERY);
    let alarm = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(alarm);
    let carried = loop {
        let armed = held.arm(alarm.as_mut());
        let unsent = held.has_unsent();
        let woke = tokio::select! {
            batch = held.incoming.recv() => Carrying::Checks(batch),
            permit = frames.reserve(), if unsent => Carrying::Writable(permit.ok()),
            frame = answered.recv() => Carrying::Answers(frame),
            () = &mut alarm, if armed => Carrying::Deadline,
            _ = purge.tick() => Carrying::Purge,
        };
        match woke {
            Carrying::Checks(None) => break Carried::Dropped,
            Carrying::Checks(Some(batch)) => {
                held.insert_all(batch);
                held.take_incoming();
            }
            // The writer failed: the session is broken.
            Carrying::Writable(None) => break broken(answered_any),
            Carrying::Writable(Some(permit)) => {
                if !region.is_current(connection) {
                    // A newer connection to the region was adopted: move to it.
                    break broken(answered_any);
                }
                // `next_frame` gives up on the checks past their deadline first: answers
                // already in are taken before, as at a deadline.
                answered_any |= take_answers(&mut answered, held);
                if let Some(frame) = held.next_frame(held.clock.mono()) {
                    permit.send(frame);
                }
            }
            Carrying::Answers(None) => break broken(answered_any),
            Carrying::Answers(Some(frame)) => {
                answered_any = true;
                held.answer_frame(frame);
            }
            Carrying::Deadline => {
                answered_any |= take_answers(&mut answered, held);
                held.expire(held.clock.mono());
            }
            Carrying::Purge => held.purge(),
        }
    };
    // Answers that came before the session broke are answers all the same.
    take_answers(&mut answered, held);
    reader.abort();
    // The writer writes what it was given and then finishes the stream, so the region
    // never reads a frame cut in half.
    drop(frames);
    carried
}

/// Answers every check whose answer is in. `select!` polls its branches in random order, so
/// answers that came in with a deadline are taken with this before checks are given up on
/// as unavailable. Whether any frame of answers was in.
fn take_answers<T>(
    answered: &mut mpsc::UnboundedReceiver<Vec<wire::Answered>>,
    held: &mut Held<T>,
) -> bool {
    let mut any = false;
    while let Ok(frame) = answered.try_recv() {
        any = true;
        held.answer_frame(frame);
    }
    any
}

fn broken(answered: bool) -> Carried {
    Carried::Broken { answered }
}

/// Writes frames of checks to a session until one fails to write or the session is done.
async fn write_frames(mut send: SessionSend, mut frames: mpsc::Receiver<Vec<u8>>) {
    while let Some(frame) = frames.recv().await {
        if send.write(frame).await.is_err() {
            return;
        }
    }
}

/// Reads frames of answers from a session until it ends or sends one that does not decode
/// or whose length is out of bounds, which `stats` counts: BRIEF.md's malformed frame from
/// a peer, dropped and counted.
async fn read_answers(
    mut receive: SessionReceive,
    answers: mpsc::UnboundedSender<Vec<wire::Answered>>,
    stats: Arc<ForwardStats>,
) {
    loop {
        let frame = match receive.read(REGION_FRAME_BYTES_MAX).await {
            FrameRead::Frame(body) => wire::decode_answers(&body),
            FrameRead::OutOfBounds => None,
            FrameRead::End | FrameRead::Truncated => return,
        };
        let Some(frame) = frame else {
            stats.answers_bad.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if answers.send(frame).is_err() {
            return;
        }
    }
}

/// Written checks past their deadline, with when each arrived: the last `TIMED_OUT_HELD`
/// to time out. Pushed out in the order they timed out, not by sequence number: rules'
/// timeouts differ, so a check sent first may time out after thousands sent later, and
/// pushed out by those it was forgotten as it timed out (found in review, session 55: its
/// late admission went unreported, and its fallback counted twice).
#[derive(Debug, Default)]
struct TimedOut {
    // Each check's arrival, and the number of its timing out.
    arrived: HashMap<u64, (Duration, u64)>,
    // The checks held, by the number of their timing out.
    order: BTreeMap<u64, u64>,
    timed_out: u64,
}

impl TimedOut {
    /// Holds check `seq`, which arrived at `arrived`, pushing out the one that timed out
    /// first past `TIMED_OUT_HELD`.
    fn hold(&mut self, seq: u64, arrived: Duration) {
        self.timed_out += 1;
        self.arrived.insert(seq, (arrived, self.timed_out));
        self.order.insert(self.timed_out, seq);
        if self.order.len() > TIMED_OUT_HELD {
            if let Some((_, first)) = self.order.pop_first() {
                self.arrived.remove(&first);
            }
        }
    }

    /// When check `seq` arrived, if it is held; it is held no more.
    fn remove(&mut self, seq: u64) -> Option<Duration> {
        let (arrived, number) = self.arrived.remove(&seq)?;
        self.order.remove(&number);
        Some(arrived)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tally_crdt::{Generation, Rule, Subject, Window};

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    /// The session task wakes with a check's answer in, its deadline passed and the next
    /// check waiting to be written: whichever of the three `select!` takes first, the
    /// region's answer is the check's, not `RegionUnavailable`. (Before, when writing came
    /// first, the check was given up on: for a rule whose fallback allows, a denial at the
    /// region became an admission.) The branches are taken in random order, so rounds.
    #[tokio::test]
    async fn an_answer_in_when_its_deadline_passes_is_the_checks_whichever_branch_wakes_first() {
        let check = quota_check;
        let mut checked = 0;
        for round in 0..16 {
            let (forwarder, mut to_region) = local_forwarder(Arc::default());
            let (answers, mut answered) = mpsc::unbounded_channel();
            // Long enough that the answer is sent before it passes on a slow machine (200 ms
            // was not, once, in CI's loom step, which runs the loom models beside it).
            let submitted = Instant::now();
            forwarder.submit([check(0, 600)], submitted, &answers);
            let frame = to_region.recv().await.unwrap();
            let (_, checks) = wire::decode_checks(&frame.body).unwrap();
            // The session task takes what else it has ready (its first purge) and waits.
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
            if submitted.elapsed() >= ms(550) {
                // A machine too busy to send the answer before the deadline: this round
                // could not show which branch wins (seen once in CI, round 4).
                continue;
            }
            let denied = ExactAnswer::Decided(Outcome {
                allowed: false,
                count: 9,
            });
            frame
                .reply
                .send(wire::encode_answers(&[(checks[0].id.seq, denied)]));
            // The answer is read in before the deadline passes: other tasks run first (CI
            // failed once, round 8, with the answer sent but not yet read in).
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
            if submitted.elapsed() >= ms(580) {
                continue;
            }
            checked += 1;
            // The runtime's one thread is held past the deadline: the session task runs
            // next with everything ready at once.
            std::thread::sleep(ms(650));
            forwarder.submit([check(1, 10_000)], Instant::now(), &answers);
            let first = answered.recv().await.unwrap();
            assert!(
                matches!(
                    first[..],
                    [Forwarded {
                        ticket: 0,
                        late_seq: None,
                        result: Ok(Outcome { allowed: false, .. }),
                    }]
                ),
                "round {round}: {:?}",
                first.iter().map(|f| &f.result).collect::<Vec<_>>()
            );
        }
        assert!(checked >= 8, "only {checked} of 16 rounds answered in time");
    }

    /// BRIEF.md's bad input: a malformed frame from a peer is dropped and counted in a
    /// metric. A frame of answers from the region that does not decode (a bug, or a region
    /// of another build) breaks its session and its checks go again on a new one; the edge
    /// counted it nowhere (found in review, session 49), so nothing but the retries showed
    /// why exact checks went unanswered.
    // It renders the metrics of a lane store, whose atomics are loom's under `tally_loom`.
    #[tokio::test]
    #[cfg(not(tally_loom))]
    async fn a_frame_of_answers_that_does_not_decode_is_counted_in_the_metrics() {
        let stats = Arc::new(ForwardStats::default());
        let (forwarder, mut to_region) = local_forwarder(stats.clone());
        let (answers, _answered) = mpsc::unbounded_channel();
        forwarder.submit([quota_check(0, 10_000)], Instant::now(), &answers);
        let frame = to_region.recv().await.unwrap();
        // A length prefix, then bytes that are no frame of answers.
        let garbage = vec![3, 0, 0, 0, 0xff, 0xff, 0xff];
        assert!(wire::decode_answers(&garbage[4..]).is_none());
        frame.reply.send(garbage);
        // The check goes again, on a new session: the first was dropped.
        let again = tokio::time::timeout(Duration::from_secs(5), to_region.recv())
            .await
            .expect("the check sent again")
            .unwrap();
        assert!(wire::decode_checks(&again.body).is_some());
        let store = crate::store::LaneStore::new(ReplicaId::new(NodeId(2), Generation(1)), 8);
        let text = crate::metrics::render(&crate::metrics::Sources {
            metrics: &crate::metrics::Metrics::default(),
            view: &crate::view::View::default(),
            store: &store,
            transport: &crate::transport::TransportStats::default(),
            forward: &stats,
            exact_room: &crate::exact_room::ExactRoom::default(),
            region: None,
            now: tally_crdt::Stamp(0),
        });
        assert!(
            text.lines()
                .any(|line| line == "tally_region_answers_bad_total 1"),
            "{}",
            (text.lines())
                .filter(|line| line.starts_with("tally_region_"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    fn pending(seq: u64, timeout_ms: u64, answers: &Answers<u64>) -> Box<Pending<u64>> {
        Box::new(Pending {
            id: RequestId {
                node: 2,
                generation: 1,
                seq,
            },
            key: Key::new(
                Rule::new("quota").unwrap(),
                Subject::new("a").unwrap(),
                Window::new(0, 60).unwrap(),
            ),
            cost: 1,
            check_id: None,
            ticket: seq,
            answers: answers.clone(),
            arrived: Duration::ZERO,
            timeout_ms,
            writes: 0,
        })
    }

    /// A check of `quota` on subject `a`, cost 1, in the window from 0 to 60.
    pub(crate) fn quota_check(ticket: u64, timeout_ms: u64) -> Check<u64> {
        Check {
            key: Key::new(
                Rule::new("quota").unwrap(),
                Subject::new("a").unwrap(),
                Window::new(0, 60).unwrap(),
            ),
            cost: 1,
            timeout_ms,
            check_id: None,
            ticket,
        }
    }

    /// A forwarder of node 2's first life to a region task within the node, whose frames
    /// come out of the receiver.
    fn local_forwarder(
        stats: Arc<ForwardStats>,
    ) -> (
        Forwarder<u64>,
        mpsc::Receiver<crate::transport::SessionFrame>,
    ) {
        let (frames, to_region) = mpsc::channel(8);
        let sessions = Sessions {
            frames,
            frame_bytes_max: REGION_FRAME_BYTES_MAX,
        };
        let replica = ReplicaId::new(NodeId(2), Generation(1));
        let (late, _reported) = mpsc::unbounded_channel();
        let forwarder = Forwarder::local(sessions, replica, Clock::start(), stats, late);
        (forwarder, to_region)
    }

    /// Where a test hands `Held` the checks it takes in.
    type Incoming = mpsc::UnboundedSender<Vec<Box<Pending<u64>>>>;

    /// Held checks with no forwarder in front: its incoming channel's sender, and the
    /// stats they count in.
    fn held() -> (Held<u64>, Incoming, Arc<ForwardStats>) {
        let (held, checks, stats, _) = held_reporting_late();
        (held, checks, stats)
    }

    /// [`held`], with the receiver of the late admissions it reports.
    fn held_reporting_late() -> (
        Held<u64>,
        Incoming,
        Arc<ForwardStats>,
        mpsc::UnboundedReceiver<Vec<u64>>,
    ) {
        let (checks, incoming) = mpsc::unbounded_channel();
        let stats = Arc::new(ForwardStats::default());
        let (late, reported) = mpsc::unbounded_channel();
        (
            Held::new(incoming, Clock::start(), stats.clone(), late),
            checks,
            stats,
            reported,
        )
    }

    fn drain(answered: &mut mpsc::UnboundedReceiver<Vec<Forwarded<u64>>>) -> Vec<Forwarded<u64>> {
        std::iter::from_fn(|| answered.try_recv().ok())
            .flatten()
            .collect()
    }

    /// The sequence numbers of every check held, sent or not, in order.
    fn held_seqs(held: &Held<u64>) -> Vec<u64> {
        let seqs: Vec<u64> = (held.checks.iter().flatten())
            .map(|pending| pending.id.seq)
            .collect();
        assert_eq!(seqs.len(), held.live);
        seqs
    }

    fn first_deadline(held: &mut Held<u64>) -> Option<Duration> {
        let held_seqs = held_seqs(held);
        held.deadlines.first(|seq| held_seqs.contains(&seq))
    }

    /// The region answers `UnknownRule` for a check whose window is over by its clock. A
    /// check sent again on a later session may have been decided on the first (a window
    /// shorter than the rule's timeout): it is answered `Forgotten`, which no fallback
    /// counts a second time. One sent once was not decided, and its rule's fallback applies.
    #[test]
    fn a_check_sent_again_and_refused_for_its_window_is_forgotten_and_one_sent_once_unavailable() {
        let (answers, mut answered) = mpsc::unbounded_channel();
        let (mut held, _checks, _stats) = held();
        held.insert(pending(0, 10_000, &answers));
        assert!(held.next_frame(ms(0)).is_some());
        // The session breaks; on the next, check 0 is written again and check 1 first.
        held.resend_all();
        held.insert(pending(1, 10_000, &answers));
        assert!(held.next_frame(ms(1)).is_some());
        held.answer_frame(vec![
            (0, ExactAnswer::UnknownRule),
            (1, ExactAnswer::UnknownRule),
        ]);
        assert_check_0_forgotten_and_1_unavailable(&mut answered);
    }

    /// A region without the check's exact rule (misconfigured) answers
    /// `NoRule` (region/service.rs, `decide`: the rule looked up after the ledger's
    /// recall; `UnknownRule`, as for a window not live, until session 47), however often
    /// the check is sent: it never decided it. Sent once or again after a broken session,
    /// the check gets a typed error naming the rule: not `Forgotten`, and not
    /// `RegionUnavailable`, which a rule's fallback would answer instead (a reachable
    /// region that refuses is no unreachable one).
    #[test]
    fn a_check_sent_to_a_region_without_its_rule_is_refused_naming_the_rule_sent_once_or_again() {
        let (answers, mut answered) = mpsc::unbounded_channel();
        let (mut held, _checks, _stats) = held();
        held.insert(pending(0, 10_000, &answers));
        assert!(held.next_frame(ms(0)).is_some());
        held.resend_all();
        held.insert(pending(1, 10_000, &answers));
        assert!(held.next_frame(ms(1)).is_some());
        held.answer_frame(vec![
            (0, REGION_WITHOUT_THE_RULE),
            (1, REGION_WITHOUT_THE_RULE),
        ]);
        let results: Vec<_> = (drain(&mut answered).into_iter())
            .map(|forwarded| forwarded.result)
            .collect();
        let named = |result: &Result<Outcome, Refusal>| {
            matches!(result, Err(Refusal::BadField { field, why })
                if field == "rule" && why.contains("no exact rule \"quota\" of 60 s windows"))
        };
        assert!(
            results.len() == 2 && results.iter().all(named),
            "{results:?}"
        );
    }

    /// What a region without a check's exact rule answers it.
    const REGION_WITHOUT_THE_RULE: ExactAnswer = ExactAnswer::NoRule;

    #[test]
    fn an_id_the_region_decided_for_another_check_is_refused_as_a_bad_id() {
        let (answers, mut answered) = mpsc::unbounded_channel();
        let (mut held, _checks, _stats) = held();
        held.insert(pending(0, 10_000, &answers));
        assert!(held.next_frame(ms(0)).is_some());
        held.answer_frame(vec![(0, ExactAnswer::IdReused)]);
        let results: Vec<_> = (drain(&mut answered).into_iter())
            .map(|forwarded| forwarded.result)
            .collect();
        assert!(
            matches!(&results[..], [Err(Refusal::BadField { field, why })]
                if field == "id" && why.contains("another rule, subject or cost at the region")),
            "{results:?}"
        );
    }

    /// A region frame whose `Storage` reason is far past the 256 bytes a region sends
    /// (`STORAGE_WHY_BYTES_MAX`) decodes, and its reason went to the client as it was: in
    /// an answer frame past the client protocol's 64 KiB, which the client refuses,
    /// failing its connection and every request pipelined on it. A region frame's lengths
    /// are not trusted (BRIEF: "no other trust in lengths"): the reason is cut.
    #[test]
    fn a_storage_reason_past_its_bound_from_the_region_is_cut_to_fit_a_clients_frame() {
        let (answers, mut answered) = mpsc::unbounded_channel();
        let (mut held, _checks, _stats) = held();
        held.insert(pending(0, 10_000, &answers));
        assert!(held.next_frame(ms(0)).is_some(), "written to the region");
        let garbled = wire::encode_answers(&[(0, ExactAnswer::Storage("x".repeat(100_000)))]);
        let frame = wire::decode_answers(&garbled[4..]).expect("a frame of answers");
        held.answer_frame(frame);
        let [forwarded] = &drain(&mut answered)[..] else {
            panic!("one answer")
        };
        let Err(refusal @ Refusal::Storage { why }) = &forwarded.result else {
            panic!("{:?}", forwarded.result)
        };
        // As the listener answers its client.
        let response = tally_client::wire::Response {
            id: 1,
            result: Err(refusal.clone()),
        };
        let mut out = Vec::new();
        tally_client::wire::encode_response(&response, &mut out);
        assert!(
            out.len() - 4 <= tally_client::wire::CLIENT_FRAME_BYTES_MAX,
            "an answer frame of {} bytes to the client, past its {}",
            out.len() - 4,
            tally_client::wire::CLIENT_FRAME_BYTES_MAX,
        );
        assert!(why.len() <= "region: ".len() + wire::STORAGE_WHY_BYTES_MAX);
    }

    /// The forwarder stops with two checks held, one written to the region and one not:
    /// the written one may be decided there, so no fallback may count it too.
    #[test]
    fn a_stopped_forwarder_answers_a_written_check_forgotten_and_an_unwritten_one_unavailable() {
        let (answers, mut answered) = mpsc::unbounded_channel();
        let (mut held, _checks, _stats) = held();
        held.insert(pending(0, 10_000, &answers));
        assert!(held.next_frame(ms(0)).is_some());
        held.insert(pending(1, 10_000, &answers));
        drop(held);
        assert_check_0_forgotten_and_1_unavailable(&mut answered);
    }

    /// The answers given: check 0's `Forgotten`, check 1's `RegionUnavailable`, in either
    /// order.
    fn assert_check_0_forgotten_and_1_unavailable(
        answered: &mut mpsc::UnboundedReceiver<Vec<Forwarded<u64>>>,
    ) {
        let mut results: Vec<(u64, Result<Outcome, Refusal>)> = (drain(answered).into_iter())
            .map(|forwarded| (forwarded.ticket, forwarded.result))
            .collect();
        results.sort_by_key(|(ticket, _)| *ticket);
        assert!(
            matches!(
                &results[..],
                [
                    (0, Err(Refusal::Forgotten { .. })),
                    (1, Err(Refusal::RegionUnavailable { .. }))
                ]
            ),
            "{results:?}"
        );
    }

    /// `tally_region_latency_seconds` counts every check the region decided, one decided
    /// after its rule's timeout too, so a region slower than a timeout shows how much
    /// slower (found in review, session 47: the histogram stopped at the timeouts).
    #[test]
    fn a_check_the_region_decided_after_its_timeout_is_in_the_latency_histogram() {
        let (answers, _answered) = mpsc::unbounded_channel();
        let (mut held, _checks, stats) = held();
        held.insert(pending(0, 100, &answers));
        assert!(held.next_frame(ms(0)).is_some(), "written to the region");
        held.expire(ms(100));
        assert_eq!(stats.unavailable.load(Ordering::Relaxed), 1);
        let denied = ExactAnswer::Decided(Outcome {
            allowed: false,
            count: 1,
        });
        held.answer_frame(vec![(0, denied)]);
        assert_eq!(stats.latency.count(), 1);
    }

    /// README: `tally_region_latency_seconds` counts "every check the region decided,
    /// after its rule's `region_timeout_ms` too", a written check whose caller went away as
    /// well (found in review, session 48: `expire` skipped abandoned checks before they
    /// reached `timed_out`, and one decided after its deadline was not counted).
    #[test]
    fn a_check_whose_caller_left_decided_after_its_timeout_is_in_the_latency_histogram() {
        let denied = ExactAnswer::Decided(Outcome {
            allowed: false,
            count: 1,
        });
        // In time: counted.
        let (answers, answered) = mpsc::unbounded_channel();
        let (mut checks_held, _checks, stats) = held();
        checks_held.insert(pending(0, 100, &answers));
        assert!(
            checks_held.next_frame(ms(0)).is_some(),
            "written to the region"
        );
        drop(answered);
        checks_held.answer_frame(vec![(0, denied)]);
        assert_eq!(stats.latency.count(), 1, "decided in time, caller gone");
        // After its deadline: counted too, and an admission is no late one (its caller was
        // answered nothing, no fallback to take back).
        let (answers, answered) = mpsc::unbounded_channel();
        let (_checks, incoming) = mpsc::unbounded_channel();
        let (late, mut reported) = mpsc::unbounded_channel();
        let stats = Arc::new(ForwardStats::default());
        let mut checks_held = Held::new(incoming, Clock::start(), stats.clone(), late);
        checks_held.insert(pending(0, 100, &answers));
        assert!(
            checks_held.next_frame(ms(0)).is_some(),
            "written to the region"
        );
        drop(answered);
        checks_held.expire(ms(100));
        let admitted = ExactAnswer::Decided(Outcome {
            allowed: true,
            count: 1,
        });
        checks_held.answer_frame(vec![(0, admitted)]);
        assert_eq!(
            stats.latency.count(),
            1,
            "decided after its timeout, caller gone"
        );
        assert!(reported.try_recv().is_err(), "no late admission reported");
    }

    /// (Review of 20467eb.) Checks whose callers left, held since that commit among the
    /// `TIMED_OUT_HELD` most recent timed-out checks only to time a late decision, pushed
    /// out a check whose caller was answered `RegionUnavailable` (and may have counted its
    /// rule's fallback): the region's admission of it, decided later, was then not
    /// reported late, and the fallback's count stayed on top of the region's.
    #[test]
    fn checks_whose_callers_left_do_not_push_out_a_late_admission_to_report() {
        let (answers, _answered) = mpsc::unbounded_channel();
        let (gone, answered_gone) = mpsc::unbounded_channel();
        let (mut held, _checks, _, mut reported) = held_reporting_late();
        held.insert(pending(0, 100, &answers));
        let left = TIMED_OUT_HELD as u64;
        for seq in 1..=left {
            held.insert(pending(seq, 100, &gone));
        }
        while held.next_frame(ms(0)).is_some() {}
        // Every one written; then the callers of all but the first go away (their client
        // timed out first, or its connection broke).
        drop(answered_gone);
        held.expire(ms(100));
        let admitted = ExactAnswer::Decided(Outcome {
            allowed: true,
            count: 1,
        });
        held.answer_frame(vec![(0, admitted)]);
        assert_eq!(
            reported.try_recv().ok(),
            Some(vec![0]),
            "the admission of a check answered RegionUnavailable went unreported, pushed \
             out by {left} checks whose callers left"
        );
    }

    /// The last `TIMED_OUT_HELD` written checks answered `RegionUnavailable` are held, as
    /// ARCHITECTURE.md says: the region's admission of the oldest of them is reported late,
    /// and of one before them is not.
    #[test]
    fn the_last_timed_out_held_checks_answered_unavailable_are_reported_if_admitted_late() {
        let (answers, _answered) = mpsc::unbounded_channel();
        let (mut held, _checks, _, mut reported) = held_reporting_late();
        for seq in 0..=TIMED_OUT_HELD as u64 {
            held.insert(pending(seq, 100, &answers));
        }
        while held.next_frame(ms(0)).is_some() {}
        held.expire(ms(100));
        let admitted = || {
            ExactAnswer::Decided(Outcome {
                allowed: true,
                count: 1,
            })
        };
        held.answer_frame(vec![(0, admitted()), (1, admitted())]);
        assert_eq!(
            reported.try_recv().ok(),
            Some(vec![1]),
            "check 0 pushed out; the {TIMED_OUT_HELD} after it held"
        );
    }

    /// The checks held are the last to time out, not the last sent: rules' timeouts
    /// differ, so a check sent first may time out after thousands sent later.
    #[test]
    fn a_check_that_times_out_after_later_ones_is_reported_if_admitted_late() {
        let (answers, _answered) = mpsc::unbounded_channel();
        let (mut held, _checks, _, mut reported) = held_reporting_late();
        held.insert(pending(0, 300, &answers));
        for seq in 1..=TIMED_OUT_HELD as u64 {
            held.insert(pending(seq, 100, &answers));
        }
        while held.next_frame(ms(0)).is_some() {}
        held.expire(ms(100));
        held.expire(ms(300));
        let admitted = ExactAnswer::Decided(Outcome {
            allowed: true,
            count: 1,
        });
        held.answer_frame(vec![(0, admitted)]);
        assert_eq!(
            reported.try_recv().ok(),
            Some(vec![0]),
            "the check last to time out was pushed out by {TIMED_OUT_HELD} sent after it"
        );
    }

    #[test]
    fn an_admission_answered_after_its_check_timed_out_is_reported_late() {
        let (answers, mut answered) = mpsc::unbounded_channel();
        let (mut held, checks, _, mut reported) = held_reporting_late();
        for seq in 0..4 {
            held.insert(pending(seq, 100, &answers));
        }
        assert!(
            held.next_frame(ms(0)).is_some(),
            "the four are written to the region"
        );
        held.insert(pending(4, 100, &answers));
        held.expire(ms(100));
        let late_seqs: Vec<Option<u64>> = drain(&mut answered).iter().map(|f| f.late_seq).collect();
        assert_eq!(
            late_seqs,
            [Some(0), Some(1), Some(2), Some(3), None],
            "all five timed out; the one never written cannot be decided late"
        );
        let decided = |allowed| ExactAnswer::Decided(Outcome { allowed, count: 1 });
        held.answer_frame(vec![
            (0, decided(true)),
            (1, decided(false)),
            (2, ExactAnswer::Forgotten),
            (3, decided(true)),
            (3, decided(true)),
            (4, decided(true)),
            (9, decided(true)),
        ]);
        assert!(
            drain(&mut answered).is_empty(),
            "their callers were answered once"
        );
        assert_eq!(
            reported.try_recv().unwrap(),
            [0, 3],
            "admissions only, each once, of checks that timed out"
        );
        assert!(reported.try_recv().is_err());
        drop(checks);
    }

    #[test]
    fn checks_expire_by_deadline_not_by_order_and_an_answered_one_never_expires() {
        let (answers, mut answered) = mpsc::unbounded_channel();
        let (mut held, _checks, stats) = held();
        // Sequence numbers in submission order, deadlines not: rules' timeouts differ.
        for (seq, timeout_ms) in [(0, 300), (1, 100), (2, 200), (3, 100)] {
            held.insert(pending(seq, timeout_ms, &answers));
        }
        assert_eq!(first_deadline(&mut held), Some(ms(100)));

        let outcome = Outcome {
            allowed: true,
            count: 1,
        };
        held.answer_frame(vec![(3, ExactAnswer::Decided(outcome))]);
        held.expire(ms(99));
        let first = drain(&mut answered);
        assert_eq!(first.len(), 1);
        assert_eq!((first[0].ticket, &first[0].result), (3, &Ok(outcome)));

        held.expire(ms(200));
        let expired: Vec<u64> = drain(&mut answered).iter().map(|f| f.ticket).collect();
        assert_eq!(expired, [1, 2]);
        assert_eq!(first_deadline(&mut held), Some(ms(300)));
        assert_eq!(stats.unavailable.load(Ordering::Relaxed), 2);

        // An answer after the deadline finds nothing: the caller was answered once.
        held.answer_frame(vec![(1, ExactAnswer::Decided(outcome))]);
        assert!(drain(&mut answered).is_empty());
        held.expire(ms(300));
        let last = drain(&mut answered);
        assert!(matches!(
            &last[..],
            [Forwarded { ticket: 0, late_seq: None, result: Err(Refusal::RegionUnavailable { why, .. }) }]
                if why == "no answer within 300 ms"
        ));
        assert!(held.is_empty() && first_deadline(&mut held).is_none());
    }

    #[test]
    fn a_frame_holds_the_unsent_checks_in_order_and_never_an_expired_or_abandoned_one() {
        let (answers, _answered) = mpsc::unbounded_channel();
        let (gone, gone_answers) = mpsc::unbounded_channel();
        let (mut held, _checks, stats) = held();
        held.insert(pending(0, 100, &answers));
        held.insert(pending(1, 300, &answers));
        held.insert(pending(2, 300, &gone));
        held.insert(pending(3, 300, &answers));
        drop(gone_answers);
        // The first's deadline passes as the frame is made: it is answered, not sent.
        let frame = held.next_frame(ms(100)).expect("two checks to send");
        assert_eq!(frame_seqs(&frame), [1, 3]);
        assert_eq!(stats.unavailable.load(Ordering::Relaxed), 1);
        assert!(!held.has_unsent() && held.next_frame(ms(100)).is_none());
        assert_eq!(held_seqs(&held), [1, 3]);
        assert_eq!(stats.retries.load(Ordering::Relaxed), 0);

        // A new session writes them again, as retries.
        held.resend_all();
        assert!(held.next_frame(ms(0)).is_some());
        assert_eq!(stats.retries.load(Ordering::Relaxed), 2);
    }

    fn frame_seqs(frame: &[u8]) -> Vec<u64> {
        wire::decode_checks(&frame[4..])
            .expect("a frame of checks")
            .1
            .iter()
            .map(|check| check.id.seq)
            .collect()
    }

    #[test]
    fn after_answers_out_of_order_a_new_session_writes_exactly_the_unanswered_in_order() {
        let (answers, mut answered) = mpsc::unbounded_channel();
        let (mut held, _checks, stats) = held();
        for seq in 0..6 {
            held.insert(pending(seq, 100, &answers));
        }
        let written = held.next_frame(ms(0)).expect("six checks to send");
        assert_eq!(frame_seqs(&written), [0, 1, 2, 3, 4, 5]);
        let outcome = ExactAnswer::Decided(Outcome {
            allowed: true,
            count: 1,
        });
        held.answer_frame([1, 0, 4].map(|seq| (seq, outcome.clone())).into());
        assert_eq!(drain(&mut answered).len(), 3);
        assert_eq!(held_seqs(&held), [2, 3, 5]);

        held.resend_all();
        let again = held.next_frame(ms(0)).expect("three checks to send again");
        assert_eq!(frame_seqs(&again), [2, 3, 5]);
        assert!(!held.has_unsent());
        assert_eq!(stats.retries.load(Ordering::Relaxed), 3);

        held.answer_frame([5, 3, 2].map(|seq| (seq, outcome.clone())).into());
        assert_eq!(drain(&mut answered).len(), 3);
        assert!(held.is_empty());
        held.insert(pending(6, 100, &answers));
        let next = held.next_frame(ms(0)).expect("the new check");
        assert_eq!(frame_seqs(&next), [6]);
        assert_eq!(stats.retries.load(Ordering::Relaxed), 3, "a first write");
        held.expire(ms(100));
        assert_eq!(
            drain(&mut answered).len(),
            1,
            "only check 6 was left to expire"
        );
    }

    #[test]
    fn a_callers_run_of_answers_in_one_frame_reaches_it_as_one_message_in_order() {
        let (to_a, mut a) = mpsc::unbounded_channel();
        let (to_b, mut b) = mpsc::unbounded_channel();
        let (mut held, _checks, _stats) = held();
        for (seq, answers) in [(0, &to_a), (1, &to_a), (2, &to_b), (3, &to_a)] {
            held.insert(pending(seq, 100, answers));
        }
        let outcome = ExactAnswer::Decided(Outcome {
            allowed: true,
            count: 1,
        });
        held.answer_frame((0..4).map(|seq| (seq, outcome.clone())).collect());
        let messages = |answered: &mut mpsc::UnboundedReceiver<Vec<Forwarded<u64>>>| {
            std::iter::from_fn(|| answered.try_recv().ok())
                .map(|run| run.iter().map(|f| f.ticket).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        };
        assert_eq!(messages(&mut a), [vec![0, 1], vec![3]]);
        assert_eq!(messages(&mut b), [vec![2]]);
    }

    #[test]
    fn checks_whose_caller_went_are_dropped_with_their_deadlines() {
        let (gone, gone_answers) = mpsc::unbounded_channel();
        let (staying, _staying_answers) = mpsc::unbounded_channel();
        let (mut held, _checks, _stats) = held();
        held.insert(pending(0, 100, &gone));
        held.insert(pending(1, 200, &staying));
        drop(gone_answers);
        held.purge();
        assert_eq!(held_seqs(&held), [1]);
        assert_eq!(first_deadline(&mut held), Some(ms(200)));
    }

    #[test]
    fn a_written_check_whose_caller_went_is_held_to_its_deadline_and_not_written_again() {
        let (gone, gone_answers) = mpsc::unbounded_channel();
        let (staying, _staying_answers) = mpsc::unbounded_channel();
        let (mut held, _checks, stats) = held();
        held.insert(pending(0, 300, &gone));
        held.insert(pending(1, 200, &staying));
        assert_eq!(frame_seqs(&held.next_frame(ms(0)).unwrap()), [0, 1]);
        drop(gone_answers);
        // The region may still decide check 0: it stays, with its ticket.
        held.purge();
        assert_eq!(held_seqs(&held), [0, 1]);
        held.resend_all();
        assert_eq!(frame_seqs(&held.next_frame(ms(0)).unwrap()), [1]);
        assert_eq!(held_seqs(&held), [0, 1]);
        held.expire(ms(300));
        assert!(held.is_empty(), "{:?}", held_seqs(&held));
        assert_eq!(
            stats.unavailable.load(Ordering::Relaxed),
            1,
            "check 1 alone answered"
        );
    }

    #[test]
    fn a_session_task_that_ends_answers_every_check_it_held_or_had_coming() {
        let (answers, mut answered) = mpsc::unbounded_channel();
        let (mut held, checks, stats) = held();
        held.insert(pending(0, 100, &answers));
        checks.send(vec![pending(1, 100, &answers)]).ok().unwrap();
        drop(held);
        let mut tickets: Vec<u64> = drain(&mut answered)
            .into_iter()
            .map(|forwarded| {
                assert!(matches!(
                    &forwarded.result,
                    Err(Refusal::RegionUnavailable { why, .. }) if why == "the forwarder has stopped"
                ));
                forwarded.ticket
            })
            .collect();
        tickets.sort();
        assert_eq!(tickets, [0, 1]);
        assert_eq!(stats.unavailable.load(Ordering::Relaxed), 2);
        assert!(checks.send(vec![pending(2, 100, &answers)]).is_err());
    }
}
