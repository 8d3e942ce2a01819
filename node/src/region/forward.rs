//! The edge's side of the region path: forwards exact checks on one long-lived session to
//! the region, many to a frame when they queue up, and waits, at most each rule's
//! `region_timeout_ms`, for a durable answer. Checks a broken session left unanswered are
//! sent again on the next, with the same request ids (the region answers a repeat with
//! its first outcome). A decision says exact only when the region answered.
//!
//! A check costs no task and no timer: it is handed to the one session task with the
//! channel its answer goes to, and that task keeps every unanswered check by sequence
//! number and by deadline, answering each when the region does or when its deadline
//! passes, whichever comes first.

use super::log::RequestId;
use super::wire::{self, CHECKS_PER_FRAME_MAX, REGION_FRAME_BYTES_MAX};
use super::{ExactAnswer, ExactCheck, Outcome};
use crate::config::RuleConfig;
use crate::transport::{read_frame, FrameRead, Requester, Session};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tally_client::wire::Refusal;
use tally_crdt::{KeyRef, NodeId, ReplicaId};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Bucket bounds of the region latency histogram, in microseconds.
pub const LATENCY_BOUNDS_US: [u64; 12] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
];

/// Counters of the exact path at an edge, for the metrics.
#[derive(Debug, Default)]
pub struct ForwardStats {
    /// Answers by latency bucket (the last one past every bound).
    pub latency: [AtomicU64; LATENCY_BOUNDS_US.len() + 1],
    /// Sum of answered latencies, in microseconds.
    pub latency_sum_us: AtomicU64,
    /// Checks that got no durable answer in time.
    pub unavailable: AtomicU64,
    /// Checks the region refused for its storage.
    pub storage_errors: AtomicU64,
    /// Checks sent again on a new session, after the one they were sent on broke.
    pub retries: AtomicU64,
}

/// Forwards exact checks from one edge life to the region. `T` is the caller's ticket: it
/// comes back with the check's answer.
pub struct Forwarder<T> {
    checks: mpsc::UnboundedSender<Box<Pending<T>>>,
    replica: ReplicaId,
    next_seq: AtomicU64,
    stats: Arc<ForwardStats>,
}

/// A forwarded check's answer, with the ticket it was submitted with.
#[derive(Debug)]
pub struct Forwarded<T> {
    /// The caller's ticket.
    pub ticket: T,
    /// The region's durable outcome; `RegionUnavailable` if none came in time;
    /// `Storage` if the region could not make the decision durable.
    pub result: Result<Outcome, Refusal>,
}

/// Where a forwarded check's answer goes.
pub type Answers<T> = mpsc::UnboundedSender<Forwarded<T>>;

/// A check waiting for its answer, and where the answer goes. Boxed from its submission
/// on, so the queues and maps that hold it move a pointer.
struct Pending<T> {
    check: ExactCheck,
    ticket: T,
    answers: Answers<T>,
    submitted: Instant,
    deadline: Instant,
    timeout_ms: u64,
    // Written on a session already: sending it again is a retry.
    sent: bool,
}

impl<T> Pending<T> {
    /// Whoever waits for the answer is gone: the check need not be sent (again).
    fn abandoned(&self) -> bool {
        self.answers.is_closed()
    }

    fn answer(self, result: Result<Outcome, Refusal>) {
        let _ = self.answers.send(Forwarded {
            ticket: self.ticket,
            result,
        });
    }
}

/// Where the region is.
struct Region {
    requester: Requester,
    node: NodeId,
    addr: String,
}

impl<T: Send + 'static> Forwarder<T> {
    /// A forwarder to the region `region` at `addr`, for `replica`'s requests. Starts the
    /// task that keeps its session to the region.
    pub fn new(
        requester: Requester,
        region: NodeId,
        addr: String,
        replica: ReplicaId,
        stats: Arc<ForwardStats>,
    ) -> Forwarder<T> {
        let (checks, pending) = mpsc::unbounded_channel();
        let region = Region {
            requester,
            node: region,
            addr,
        };
        tokio::spawn(keep_sessions(region, pending, Waiting::new(stats.clone())));
        Forwarder {
            checks,
            replica,
            next_seq: AtomicU64::new(0),
            stats,
        }
    }

    /// Forwards a check of `cost` on `key` under `rule`. Its answer goes to `answers`
    /// with `ticket`: the region's durable outcome, or `RegionUnavailable` once the
    /// rule's timeout has passed without one.
    pub fn submit(
        &self,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        cost: u64,
        ticket: T,
        answers: &Answers<T>,
    ) {
        let submitted = Instant::now();
        let pending = Box::new(Pending {
            check: ExactCheck {
                id: RequestId {
                    node: self.replica.node.0,
                    generation: self.replica.generation.0,
                    seq: self.next_seq.fetch_add(1, Ordering::Relaxed),
                },
                rule: rule.name.clone(),
                subject: key.subject().to_owned(),
                window_index: key.window().index(),
                window_secs: key.window().len_secs(),
                cost,
            },
            ticket,
            answers: answers.clone(),
            submitted,
            deadline: submitted + Duration::from_millis(rule.region_timeout_ms),
            timeout_ms: rule.region_timeout_ms,
            sent: false,
        });
        if let Err(mpsc::error::SendError(pending)) = self.checks.send(pending) {
            self.stats.unavailable.fetch_add(1, Ordering::Relaxed);
            let rule = pending.check.rule.clone();
            pending.answer(Err(unavailable(rule, "the forwarder has stopped".into())));
        }
    }
}

fn unavailable(rule: String, why: String) -> Refusal {
    Refusal::RegionUnavailable { rule, why }
}

/// Every check the session task holds, sent or not, until it is answered, its deadline
/// passes, or its caller stops waiting.
struct Waiting<T> {
    by_seq: BTreeMap<u64, Box<Pending<T>>>,
    // Invariant: one entry per check in `by_seq`, at its deadline.
    by_deadline: BTreeSet<(Instant, u64)>,
    stats: Arc<ForwardStats>,
}

impl<T> Waiting<T> {
    fn new(stats: Arc<ForwardStats>) -> Waiting<T> {
        Waiting {
            by_seq: BTreeMap::new(),
            by_deadline: BTreeSet::new(),
            stats,
        }
    }

    fn is_empty(&self) -> bool {
        self.by_seq.is_empty()
    }

    fn insert(&mut self, pending: Box<Pending<T>>) {
        let seq = pending.check.id.seq;
        self.by_deadline.insert((pending.deadline, seq));
        self.by_seq.insert(seq, pending);
    }

    fn remove(&mut self, seq: u64) -> Option<Box<Pending<T>>> {
        let pending = self.by_seq.remove(&seq)?;
        self.by_deadline.remove(&(pending.deadline, seq));
        Some(pending)
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.by_deadline.first().map(|(deadline, _)| *deadline)
    }

    /// Answers the check `seq` with the region's `answer`, if it still waits.
    fn answer(&mut self, seq: u64, answer: ExactAnswer) {
        let Some(pending) = self.remove(seq) else {
            return;
        };
        let rule = || pending.check.rule.clone();
        let result = match answer {
            ExactAnswer::Decided(outcome) => {
                self.stats.record_latency(pending.submitted.elapsed());
                Ok(outcome)
            }
            ExactAnswer::UnknownRule => Err(self.unavailable(
                rule(),
                format!(
                    "the region has no exact rule {:?} for this window",
                    pending.check.rule
                ),
            )),
            ExactAnswer::Forgotten => Err(self.unavailable(
                rule(),
                "the region no longer remembers this request id".into(),
            )),
            ExactAnswer::Storage(why) => {
                self.stats.storage_errors.fetch_add(1, Ordering::Relaxed);
                Err(Refusal::Storage {
                    why: format!("region: {why}"),
                })
            }
        };
        pending.answer(result);
    }

    /// Answers every check whose deadline is at or before `now` with `RegionUnavailable`.
    fn expire(&mut self, now: Instant) {
        while let Some(&(deadline, seq)) = self.by_deadline.first() {
            if deadline > now {
                return;
            }
            let pending = self.remove(seq).expect("a deadline's check is held");
            let why = format!("no answer within {} ms", pending.timeout_ms);
            let refusal = self.unavailable(pending.check.rule.clone(), why);
            pending.answer(Err(refusal));
        }
    }

    /// Drops the checks whose callers stopped waiting: they are never sent again.
    fn drop_abandoned(&mut self) {
        let abandoned: Vec<u64> = self
            .by_seq
            .values()
            .filter(|pending| pending.abandoned())
            .map(|pending| pending.check.id.seq)
            .collect();
        for seq in abandoned {
            self.remove(seq);
        }
    }

    fn unavailable(&self, rule: String, why: String) -> Refusal {
        self.stats.unavailable.fetch_add(1, Ordering::Relaxed);
        unavailable(rule, why)
    }
}

impl ForwardStats {
    fn record_latency(&self, elapsed: Duration) {
        let micros = elapsed.as_micros() as u64;
        let bucket = LATENCY_BOUNDS_US
            .iter()
            .position(|bound| micros <= *bound)
            .unwrap_or(LATENCY_BOUNDS_US.len());
        self.latency[bucket].fetch_add(1, Ordering::Relaxed);
        self.latency_sum_us.fetch_add(micros, Ordering::Relaxed);
    }
}

/// How long the session task waits after failing to open a session, at first and at most.
const BACKOFF_MIN: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_millis(200);

/// How often a session drops the checks whose callers stopped waiting.
const PURGE_EVERY: Duration = Duration::from_millis(100);

/// Keeps a session open to the region while there are checks to carry, and carries them
/// over it, until the forwarder is dropped. Checks sent and not yet answered are sent
/// again on the next session if this one breaks; the region answers a repeat with its
/// first outcome. Checks whose caller stopped waiting are dropped, never sent again.
async fn keep_sessions<T>(
    region: Region,
    mut checks: mpsc::UnboundedReceiver<Box<Pending<T>>>,
    mut waiting: Waiting<T>,
) {
    let mut backoff = BACKOFF_MIN;
    loop {
        waiting.drop_abandoned();
        if waiting.is_empty() {
            // A session is opened only for a check waiting: one opened at start-up would
            // dial a region that may not listen yet, and checks would queue behind that
            // handshake instead of using the connection the gossip has made by then.
            match checks.recv().await {
                Some(pending) => waiting.insert(pending),
                None => return,
            }
        }
        let open = region.requester.open_session(region.node, &region.addr);
        let Some(opened) = meanwhile(open, &mut checks, &mut waiting).await else {
            return;
        };
        let carried = match opened {
            Ok(session) => carry(&region, session, &mut checks, &mut waiting).await,
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
                if meanwhile(wait, &mut checks, &mut waiting).await.is_none() {
                    return;
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
            Carried::Dropped => return,
        }
    }
}

/// Runs `work` to its end while taking new checks into `waiting` and answering those
/// whose deadline passes. `None` if the forwarder was dropped meanwhile.
async fn meanwhile<T, F: Future>(
    work: F,
    checks: &mut mpsc::UnboundedReceiver<Box<Pending<T>>>,
    waiting: &mut Waiting<T>,
) -> Option<F::Output> {
    tokio::pin!(work);
    loop {
        let deadline = waiting.next_deadline();
        tokio::select! {
            output = &mut work => return Some(output),
            pending = checks.recv() => waiting.insert(pending?),
            () = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                waiting.expire(Instant::now());
            }
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

/// Carries checks over one session: first those waiting (sent on an earlier session, or
/// waiting for one), then new ones, many to a frame when they queue up. Frames are
/// written and answers read by two tasks of the session's, so that this one never waits
/// on the region and answers every deadline on time.
async fn carry<T>(
    region: &Region,
    session: Session,
    checks: &mut mpsc::UnboundedReceiver<Box<Pending<T>>>,
    waiting: &mut Waiting<T>,
) -> Carried {
    let Session {
        send,
        receive,
        connection,
    } = session;
    let (answers, mut answered) = mpsc::unbounded_channel();
    let reader = tokio::spawn(read_answers(receive, answers));
    let (frames, to_write) = mpsc::unbounded_channel();
    let writer = tokio::spawn(write_frames(send, to_write));
    let carried = async {
        let mut answered_any = false;
        let retries = waiting
            .by_seq
            .values()
            .filter(|pending| pending.sent)
            .count();
        waiting
            .stats
            .retries
            .fetch_add(retries as u64, Ordering::Relaxed);
        let held: Vec<&ExactCheck> = waiting
            .by_seq
            .values()
            .map(|pending| &pending.check)
            .collect();
        for frame in held.chunks(CHECKS_PER_FRAME_MAX) {
            if frames.send(wire::encode_checks(frame)).is_err() {
                return broken(answered_any);
            }
        }
        for pending in waiting.by_seq.values_mut() {
            pending.sent = true;
        }
        let mut purge = tokio::time::interval(PURGE_EVERY);
        let expiry = tokio::time::sleep_until(Instant::now());
        tokio::pin!(expiry);
        let mut batch = Vec::with_capacity(CHECKS_PER_FRAME_MAX);
        loop {
            let deadline = waiting.next_deadline();
            if let Some(deadline) = deadline.filter(|at| *at != expiry.deadline()) {
                expiry.as_mut().reset(deadline);
            }
            tokio::select! {
                pending = checks.recv() => {
                    let Some(first) = pending else { return Carried::Dropped };
                    batch.push(first);
                    while batch.len() < CHECKS_PER_FRAME_MAX {
                        match checks.try_recv() {
                            Ok(pending) => batch.push(pending),
                            Err(_) => break,
                        }
                    }
                    batch.retain(|pending| !pending.abandoned());
                    if batch.is_empty() {
                        continue;
                    }
                    if region.requester.held(region.node) != Some(connection) {
                        // A newer connection to the region was adopted: move to it, with
                        // these checks unsent.
                        for pending in batch.drain(..) {
                            waiting.insert(pending);
                        }
                        return broken(answered_any);
                    }
                    let refs: Vec<&ExactCheck> = batch.iter().map(|pending| &pending.check).collect();
                    let frame = wire::encode_checks(&refs);
                    for mut pending in batch.drain(..) {
                        pending.sent = true;
                        waiting.insert(pending);
                    }
                    if frames.send(frame).is_err() {
                        return broken(answered_any);
                    }
                }
                frame = answered.recv() => {
                    let Some(frame) = frame else { return broken(answered_any) };
                    answered_any = true;
                    for (seq, answer) in frame {
                        waiting.answer(seq, answer);
                    }
                }
                () = &mut expiry, if deadline.is_some() => waiting.expire(Instant::now()),
                () = frames.closed() => return broken(answered_any),
                _ = purge.tick() => waiting.drop_abandoned(),
            }
        }
    };
    let carried = carried.await;
    reader.abort();
    writer.abort();
    carried
}

fn broken(answered: bool) -> Carried {
    Carried::Broken { answered }
}

/// Writes frames of checks to a session until one fails to write or the session is done.
async fn write_frames(mut send: quinn::SendStream, mut frames: mpsc::UnboundedReceiver<Vec<u8>>) {
    while let Some(frame) = frames.recv().await {
        if send.write_all(&frame).await.is_err() {
            return;
        }
    }
}

/// Reads frames of answers from a session until it ends or sends one that does not decode.
async fn read_answers(
    mut receive: quinn::RecvStream,
    answers: mpsc::UnboundedSender<Vec<wire::Answered>>,
) {
    while let FrameRead::Frame(body) = read_frame(&mut receive, REGION_FRAME_BYTES_MAX).await {
        let Some(frame) = wire::decode_answers(&body) else {
            return;
        };
        if answers.send(frame).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(
        seq: u64,
        timeout_ms: u64,
        answers: &Answers<u64>,
        at: Instant,
    ) -> Box<Pending<u64>> {
        Box::new(Pending {
            check: ExactCheck {
                id: RequestId {
                    node: 2,
                    generation: 1,
                    seq,
                },
                rule: "quota".into(),
                subject: "a".into(),
                window_index: 0,
                window_secs: 60,
                cost: 1,
            },
            ticket: seq,
            answers: answers.clone(),
            submitted: at,
            deadline: at + Duration::from_millis(timeout_ms),
            timeout_ms,
            sent: false,
        })
    }

    fn drain(answered: &mut mpsc::UnboundedReceiver<Forwarded<u64>>) -> Vec<Forwarded<u64>> {
        std::iter::from_fn(|| answered.try_recv().ok()).collect()
    }

    #[test]
    fn checks_expire_by_deadline_not_by_order_and_an_answered_one_never_expires() {
        let (answers, mut answered) = mpsc::unbounded_channel();
        let stats = Arc::new(ForwardStats::default());
        let mut waiting = Waiting::new(stats.clone());
        let t0 = Instant::now();
        // Sequence numbers in submission order, deadlines not: rules' timeouts differ.
        waiting.insert(pending(0, 300, &answers, t0));
        waiting.insert(pending(1, 100, &answers, t0));
        waiting.insert(pending(2, 200, &answers, t0));
        waiting.insert(pending(3, 100, &answers, t0));
        assert_eq!(
            waiting.next_deadline(),
            Some(t0 + Duration::from_millis(100))
        );

        let outcome = Outcome {
            allowed: true,
            count: 1,
        };
        waiting.answer(3, ExactAnswer::Decided(outcome));
        waiting.expire(t0 + Duration::from_millis(99));
        let first = drain(&mut answered);
        assert_eq!(first.len(), 1);
        assert_eq!((first[0].ticket, &first[0].result), (3, &Ok(outcome)));

        waiting.expire(t0 + Duration::from_millis(200));
        let expired: Vec<u64> = drain(&mut answered).iter().map(|f| f.ticket).collect();
        assert_eq!(expired, [1, 2]);
        assert_eq!(
            waiting.next_deadline(),
            Some(t0 + Duration::from_millis(300))
        );
        assert_eq!(stats.unavailable.load(Ordering::Relaxed), 2);

        // An answer after the deadline finds nothing: the caller was answered once.
        waiting.answer(1, ExactAnswer::Decided(outcome));
        assert!(drain(&mut answered).is_empty());
        waiting.expire(t0 + Duration::from_millis(300));
        let last = drain(&mut answered);
        assert!(matches!(
            &last[..],
            [Forwarded { ticket: 0, result: Err(Refusal::RegionUnavailable { why, .. }) }]
                if why == "no answer within 300 ms"
        ));
        assert!(waiting.is_empty() && waiting.by_deadline.is_empty());
    }

    #[test]
    fn checks_whose_caller_went_are_dropped_with_their_deadlines() {
        let (gone, gone_answers) = mpsc::unbounded_channel();
        let (staying, _staying_answers) = mpsc::unbounded_channel();
        let mut waiting = Waiting::new(Arc::default());
        let t0 = Instant::now();
        waiting.insert(pending(0, 100, &gone, t0));
        waiting.insert(pending(1, 200, &staying, t0));
        drop(gone_answers);
        waiting.drop_abandoned();
        assert_eq!(waiting.by_seq.keys().copied().collect::<Vec<_>>(), [1]);
        assert_eq!(
            waiting.next_deadline(),
            Some(t0 + Duration::from_millis(200))
        );
    }
}
