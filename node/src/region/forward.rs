//! The edge's side of the region path: forwards exact checks on one long-lived session to
//! the region, many to a frame when they queue up, and waits, at most each rule's
//! `region_timeout_ms`, for a durable answer. Checks a broken session left unanswered are
//! sent again on the next, with the same request ids (the region answers a repeat with
//! its first outcome). A decision says exact only when the region answered.

use super::log::RequestId;
use super::wire::{self, CHECKS_PER_FRAME_MAX, REGION_FRAME_BYTES_MAX};
use super::{ExactAnswer, ExactCheck, Outcome};
use crate::clock::Clock;
use crate::config::RuleConfig;
use crate::transport::{read_frame, FrameRead, Requester, Session};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tally_client::wire::Refusal;
use tally_crdt::{Key, NodeId, ReplicaId};
use tokio::sync::{mpsc, oneshot};

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

/// Forwards exact checks from one edge life to the region.
pub struct Forwarder {
    checks: mpsc::UnboundedSender<Pending>,
    replica: ReplicaId,
    next_seq: AtomicU64,
    clock: Clock,
    stats: Arc<ForwardStats>,
}

/// A check handed to the session task, and where its answer goes.
struct Pending {
    check: ExactCheck,
    answer: oneshot::Sender<ExactAnswer>,
    // Written on a session already: sending it again is a retry.
    sent: bool,
}

/// Where the region is.
struct Region {
    requester: Requester,
    node: NodeId,
    addr: String,
}

impl Forwarder {
    /// A forwarder to the region `region` at `addr`, for `replica`'s requests. Starts the
    /// task that keeps its session to the region.
    pub fn new(
        requester: Requester,
        region: NodeId,
        addr: String,
        replica: ReplicaId,
        clock: Clock,
        stats: Arc<ForwardStats>,
    ) -> Forwarder {
        let (checks, pending) = mpsc::unbounded_channel();
        let region = Region {
            requester,
            node: region,
            addr,
        };
        tokio::spawn(keep_sessions(region, pending, stats.clone()));
        Forwarder {
            checks,
            replica,
            next_seq: AtomicU64::new(0),
            clock,
            stats,
        }
    }

    /// Forwards a check of `cost` on `key` under `rule`, and returns the region's durable
    /// outcome, or `RegionUnavailable` when none came within the rule's timeout.
    pub async fn check(&self, rule: &RuleConfig, key: &Key, cost: u64) -> Result<Outcome, Refusal> {
        let check = ExactCheck {
            id: RequestId {
                node: self.replica.node.0,
                generation: self.replica.generation.0,
                seq: self.next_seq.fetch_add(1, Ordering::Relaxed),
            },
            rule: rule.name.clone(),
            subject: key.subject.as_str().to_owned(),
            window_index: key.window.index(),
            window_secs: key.window.len_secs(),
            cost,
        };
        let unavailable = |why: String| {
            self.stats.unavailable.fetch_add(1, Ordering::Relaxed);
            Refusal::RegionUnavailable {
                rule: rule.name.clone(),
                why,
            }
        };
        let started = self.clock.mono();
        let (answer, answered) = oneshot::channel();
        let pending = Pending {
            check,
            answer,
            sent: false,
        };
        if self.checks.send(pending).is_err() {
            return Err(unavailable("the forwarder has stopped".into()));
        }
        let timeout = Duration::from_millis(rule.region_timeout_ms);
        let answer = tokio::time::timeout(timeout, answered)
            .await
            .map_err(|_| unavailable(format!("no answer within {} ms", rule.region_timeout_ms)))?
            .map_err(|_| unavailable("the forwarder has stopped".into()))?;
        let elapsed = self.clock.mono().saturating_sub(started);
        match answer {
            ExactAnswer::Decided(outcome) => {
                self.record_latency(elapsed);
                Ok(outcome)
            }
            ExactAnswer::UnknownRule => Err(unavailable(format!(
                "the region has no exact rule {:?} for this window",
                rule.name
            ))),
            ExactAnswer::Forgotten => Err(unavailable(
                "the region no longer remembers this request id".into(),
            )),
            ExactAnswer::Storage(why) => {
                self.stats.storage_errors.fetch_add(1, Ordering::Relaxed);
                Err(Refusal::Storage {
                    why: format!("region: {why}"),
                })
            }
        }
    }

    fn record_latency(&self, elapsed: Duration) {
        let micros = elapsed.as_micros() as u64;
        let bucket = LATENCY_BOUNDS_US
            .iter()
            .position(|bound| micros <= *bound)
            .unwrap_or(LATENCY_BOUNDS_US.len());
        self.stats.latency[bucket].fetch_add(1, Ordering::Relaxed);
        self.stats
            .latency_sum_us
            .fetch_add(micros, Ordering::Relaxed);
    }
}

/// How long the session task waits after failing to open a session, at first and at most.
const BACKOFF_MIN: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_millis(200);

/// How often a session drops the checks whose callers stopped waiting.
const PURGE_EVERY: Duration = Duration::from_millis(100);

/// Keeps a session open to the region while there are checks to carry, and carries them
/// over it, until the forwarder is dropped. Checks sent and not yet answered are kept, by sequence number, and sent again
/// on the next session if this one breaks; the region answers a repeat with its first
/// outcome. Checks whose caller stopped waiting are dropped, never sent again.
async fn keep_sessions(
    region: Region,
    mut checks: mpsc::UnboundedReceiver<Pending>,
    stats: Arc<ForwardStats>,
) {
    let mut unanswered: BTreeMap<u64, Pending> = BTreeMap::new();
    let mut backoff = BACKOFF_MIN;
    loop {
        unanswered.retain(|_, pending| !pending.answer.is_closed());
        if unanswered.is_empty() {
            // A session is opened only for a check waiting: one opened at start-up would
            // dial a region that may not listen yet, and checks would queue behind that
            // handshake instead of using the connection the gossip has made by then.
            match checks.recv().await {
                Some(pending) => {
                    unanswered.insert(pending.check.id.seq, pending);
                }
                None => return,
            }
        }
        let session = match region
            .requester
            .open_session(region.node, &region.addr)
            .await
        {
            Ok(session) => session,
            Err(_) => {
                // Checks that arrive meanwhile wait for the next session.
                let wait = tokio::time::sleep(backoff);
                tokio::pin!(wait);
                loop {
                    tokio::select! {
                        () = &mut wait => break,
                        pending = checks.recv() => match pending {
                            Some(pending) => {
                                unanswered.insert(pending.check.id.seq, pending);
                            }
                            None => return,
                        },
                    }
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        match carry(&region, session, &mut checks, &mut unanswered, &stats).await {
            // A session that carried answers was working: the next opens at once.
            Carried::Broken { answered: true } => backoff = BACKOFF_MIN,
            // One that broke before any answer (a region that resets every session, say)
            // is not reopened in a tight loop.
            Carried::Broken { answered: false } => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
            Carried::Dropped => return,
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

/// Carries checks over one session: first those `unanswered` (sent on an earlier session,
/// or waiting for one), then new ones, many to a frame when they queue up while a frame is
/// being written.
async fn carry(
    region: &Region,
    session: Session,
    checks: &mut mpsc::UnboundedReceiver<Pending>,
    unanswered: &mut BTreeMap<u64, Pending>,
    stats: &ForwardStats,
) -> Carried {
    let Session {
        mut send,
        receive,
        connection,
    } = session;
    let (answers, mut answered) = mpsc::unbounded_channel();
    let reader = tokio::spawn(read_answers(receive, answers));
    let carried = async {
        let mut answered_any = false;
        let retries = unanswered.values().filter(|pending| pending.sent).count();
        stats.retries.fetch_add(retries as u64, Ordering::Relaxed);
        let waiting: Vec<&ExactCheck> = unanswered.values().map(|pending| &pending.check).collect();
        for frame in waiting.chunks(CHECKS_PER_FRAME_MAX) {
            if send.write_all(&wire::encode_checks(frame)).await.is_err() {
                return broken(answered_any);
            }
        }
        for pending in unanswered.values_mut() {
            pending.sent = true;
        }
        let mut purge = tokio::time::interval(PURGE_EVERY);
        let mut batch = Vec::with_capacity(CHECKS_PER_FRAME_MAX);
        loop {
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
                    batch.retain(|pending| !pending.answer.is_closed());
                    let frame = (!batch.is_empty()).then(|| {
                        let refs: Vec<&ExactCheck> = batch.iter().map(|p| &p.check).collect();
                        wire::encode_checks(&refs)
                    });
                    for mut pending in batch.drain(..) {
                        pending.sent = true;
                        unanswered.insert(pending.check.id.seq, pending);
                    }
                    let Some(frame) = frame else { continue };
                    if region.requester.held(region.node) != Some(connection) {
                        // A newer connection to the region was adopted: move to it.
                        return broken(answered_any);
                    }
                    if send.write_all(&frame).await.is_err() {
                        return broken(answered_any);
                    }
                }
                frame = answered.recv() => {
                    let Some(frame) = frame else { return broken(answered_any) };
                    answered_any = true;
                    for (seq, answer) in frame {
                        if let Some(pending) = unanswered.remove(&seq) {
                            let _ = pending.answer.send(answer);
                        }
                    }
                }
                _ = purge.tick() => unanswered.retain(|_, pending| !pending.answer.is_closed()),
            }
        }
    };
    let carried = carried.await;
    reader.abort();
    carried
}

fn broken(answered: bool) -> Carried {
    Carried::Broken { answered }
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
