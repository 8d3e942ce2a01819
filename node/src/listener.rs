//! The client listener: applications on loopback TCP and on a Unix socket, speaking the
//! `tally_client::wire` protocol (length-prefixed frames, request ids, pipelining).
//!
//! A connection's task reads whatever frames have arrived, answers them in order in one
//! batch (each request sees the writes of the ones before it), writes the batch's lane-log
//! records out, and only then sends the answers. Everything from the first write of a batch
//! to the log flush is synchronous: on the node's one-thread runtime the gossip task cannot
//! run in between, so it never pushes a lane the log lacks.
//!
//! A batch costs no allocation per request once its connection's buffers have grown: each
//! request is decoded in place (its names borrowed from the frame), its key looked up by
//! those names, and its answer encoded straight into the connection's output buffer.
//!
//! A frame that does not decode closes its connection (a length-prefixed stream cannot be
//! resynchronised) after a `Malformed` answer, and is counted; the node keeps serving.

use crate::clock;
use crate::config::{OnRegionUnavailable, RuleConfig, RuleMode};
use crate::decide::{self, Context, Rules};
use crate::exact_room::{ExactRoom, ExactSlot};
use crate::lanelog::LaneLog;
use crate::late::LateFallbacks;
use crate::metrics::Metrics;
use crate::recent::{Answered, Asked, RecentIds, Remembered, Waiting, WaitingSend};
use crate::refused_sums::RefusedSums;
use crate::region::forward::{Answers, Check, Forwarded, Forwarder};
use crate::region::wire::Outcome;
use crate::store::LaneStore;
use crate::view::View;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tally_client::wire::{
    self, CheckId, Decision, FrameError, OpRef, Refusal, Reply, Response, Status,
};
use tally_crdt::{Key, KeyRef, ReplicaId, Rule};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, Semaphore};
use tokio::time::Instant;

/// The exit status of a node whose lane log failed. The batch's writes are in the lane
/// store but not in the log, and lanes cannot be taken back; exiting before this thread
/// runs the gossip task again means no peer sees them and no client is told they
/// counted. The restart takes a new generation and republishes what the log holds.
pub const EXIT_LOG_FAILED: i32 = 74;

/// How many exact checks one client connection may have waiting for the region. At that
/// many, its next exact check and the frames after it are left in its input, unread, until
/// one is answered, and nothing more is read from it meanwhile.
pub const EXACT_IN_FLIGHT_MAX: usize = 1_024;

/// The room a connection's input buffer keeps for one read, past any partial frame, and
/// the most one read takes.
const READ_BYTES: usize = 64 * 1024;

/// The answers a batch gives before the rest of its frames wait for them to be written,
/// and the most room a connection's output buffer keeps between batches. A batch's answers
/// can be about 8 times its requests' bytes (a refusal names what was wrong): a batch is
/// cut at this much (and one answer past it), so a client that does not read holds no
/// more, and what a larger one took is given back once written (found in review, session
/// 46: each connection kept its largest batch's answers, up to 2 MB, 2 GB over 1,024
/// connections).
const OUTPUT_KEPT_BYTES: usize = 64 * 1024;

/// Everything a request needs; shared by every connection.
pub struct Service {
    /// The lane store.
    pub store: Arc<LaneStore>,
    /// The remote sums the store refused at its key cap, kept by the gossip task.
    pub refused_sums: Arc<RefusedSums>,
    /// The gossip's view.
    pub view: Arc<View>,
    /// The rules.
    pub rules: Rules,
    /// The lane log, if the node has a data dir.
    pub log: Option<Arc<Mutex<LaneLog>>>,
    /// The live counters.
    pub metrics: Arc<Metrics>,
    /// This node's replica.
    pub replica: ReplicaId,
    /// Where exact checks go, if this node has a region.
    pub forwarder: Option<Forwarder<Exact>>,
    /// `lane_rate_max_per_sec`: the most a lane may hold per second of its window.
    pub lane_rate_max: u64,
    /// How many exact checks one client connection may have waiting for the region:
    /// [`EXACT_IN_FLIGHT_MAX`], but fewer in tests.
    pub exact_in_flight_max: usize,
    /// The room for exact checks waiting for the region, over all connections.
    pub exact_room: Arc<ExactRoom>,
    /// Set when the node is stopping: connections close before answering anything more,
    /// so every write acknowledged is in the lanes the gossip task pushes last.
    pub closing: std::sync::atomic::AtomicBool,
    /// What was answered here under a check id (approximate checks, increments,
    /// decrements, the region's decisions and counted fallbacks), for their retries.
    pub recent: Mutex<RecentIds>,
    /// The sends of each check id waiting for the region.
    pub waiting: Arc<Waiting>,
    /// Fallbacks counted for forwarded checks, to take back if the region admitted them
    /// after all.
    pub late: Mutex<LateFallbacks>,
    /// The clock windows end by, for what is remembered of them here.
    pub expiry: Mutex<clock::ExpiryClock>,
    /// The node's clocks, the gossip task's own: its monotonic reading times writes.
    pub clock: clock::Clock,
}

/// An exact check taken out of its batch, to forward to the region; the forwarder hands it
/// back with the region's answer.
#[derive(Debug)]
pub struct Exact {
    /// The request's id.
    pub id: u64,
    /// The rule.
    pub rule: Arc<RuleConfig>,
    /// The key, with the window fixed now.
    pub key: Key,
    /// The cost.
    pub cost: u64,
    /// The application's name for the check across its retries, if it gave one.
    pub check_id: Option<CheckId>,
    /// This send's place among the sends of its check id waiting for the region, if it
    /// has an id: given up when the check is answered or dropped.
    pub waiting: Option<WaitingSend>,
    /// Its place in the node's room for exact checks, given up with it; `None` for one
    /// answered without being forwarded, held for want of room past its rule's timeout.
    pub slot: Option<ExactSlot>,
}

/// What [`Service::handle_frames`] made of a batch's bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct Handled {
    /// How many bytes of the input the whole frames took.
    pub consumed: usize,
    /// Why the frame after them is bad, if it is: the connection must close.
    pub bad: Option<String>,
    /// If it stopped at an exact check with no room for it (the connection's or the
    /// node's), left unread with the frames after it, that check's rule's
    /// `region_timeout_ms`: they are to be handled once there is room, or once the check
    /// has been held that long, before anything more is read.
    pub held: Option<u64>,
    /// Whether it stopped with whole frames left because the answers passed 64 KiB
    /// (`OUTPUT_KEPT_BYTES`): those are to be handled once the answers are written, before
    /// anything more is read.
    pub full: bool,
}

/// What [`Service::handle`] made of one request.
enum Handling {
    /// Answered here.
    Now(Reply),
    /// An exact check, for the region. Nothing is done for it yet.
    Forward {
        rule: Arc<RuleConfig>,
        key: Key,
        cost: u64,
        check_id: Option<CheckId>,
    },
}

impl Service {
    /// Answers the whole request frames at the front of `input` in order, appending each
    /// answer's frame to `output`, then writes their lane-log records out. Exact checks go
    /// to `exact` instead, for [`Service::forward`], each with a place in the node's room
    /// (`kept`, if the connection kept one, else a free one). Stops at a bad frame, after
    /// answering the ones before it, and at an exact check with no room for it: past
    /// `exact_room` checks in `exact`, or with no place free in the node's room. But an
    /// exact check with no room whose rule's `region_timeout_ms` is at most `held_past_ms`
    /// (how long the frames have been held) is answered as one the region did not answer in
    /// time, never having been forwarded.
    pub fn handle_frames(
        &self,
        input: &[u8],
        output: &mut Vec<u8>,
        exact: &mut Vec<Exact>,
        exact_room: usize,
        kept: &mut Option<ExactSlot>,
        held_past_ms: u64,
    ) -> Handled {
        let mut consumed = 0;
        let mut answered = 0;
        let (mut held, mut full) = (None, false);
        let bad = self.in_context(|context| loop {
            let (body, len) = match next_frame(&input[consumed..]) {
                Ok(Some(frame)) => frame,
                Ok(None) => return None,
                Err(err) => return Some(err.to_string()),
            };
            if output.len() >= OUTPUT_KEPT_BYTES {
                // The rest waits until these answers are written: a client that does not
                // read holds no more than this of them (found in review, session 46).
                full = true;
                return None;
            }
            let request = match wire::decode_request(body) {
                Ok(request) => request,
                Err(err) => return Some(err.to_string()),
            };
            let result = match self.handle(context, request.op) {
                Ok(Handling::Forward {
                    rule,
                    key,
                    cost,
                    check_id,
                }) => {
                    // Nothing is done for a check until it leaves the batch: held, it is
                    // handled again from its frame.
                    let slot = if exact.len() < exact_room {
                        kept.take().or_else(|| self.exact_room.try_take())
                    } else {
                        None
                    };
                    if slot.is_none() && rule.region_timeout_ms > held_past_ms {
                        held = Some(rule.region_timeout_ms);
                        return None;
                    }
                    let check = Exact {
                        id: request.id,
                        rule,
                        key,
                        cost,
                        check_id,
                        waiting: check_id.map(|id| self.waiting.add(id)),
                        slot,
                    };
                    consumed += len;
                    if check.slot.is_some() {
                        exact.push(check);
                    } else {
                        self.answer_held_past_timeout(context, check, output);
                        answered += 1;
                    }
                    continue;
                }
                Ok(Handling::Now(reply)) => Ok(reply),
                Err(refusal) => Err(refusal),
            };
            let response = Response {
                id: request.id,
                result,
            };
            wire::encode_response(&response, output);
            answered += 1;
            consumed += len;
        });
        self.counted_requests(answered);
        Handled {
            consumed,
            bad,
            held,
            full,
        }
    }

    /// Hands a batch's exact checks, read at `read_at`, to the region, emptying `exact`:
    /// their answers come back on `answers`, for [`Service::answer_exact`], within their
    /// rules' timeouts of `read_at`.
    pub fn forward(&self, exact: &mut Vec<Exact>, read_at: Instant, answers: &Answers<Exact>) {
        let forwarder = self
            .forwarder
            .as_ref()
            .expect("only a node with a region forwards");
        let checks = exact.drain(..).map(|exact| Check {
            key: exact.key.clone(),
            cost: exact.cost,
            timeout_ms: exact.rule.region_timeout_ms,
            check_id: exact.check_id,
            ticket: exact,
        });
        forwarder.submit(checks, read_at, answers);
    }

    /// Answers forwarded exact checks, appending each answer's frame to `output`: exact
    /// where the region answered in time, else as the rule's `on_region_unavailable`
    /// says.
    pub fn answer_exact(&self, forwarded: &mut Vec<Forwarded<Exact>>, output: &mut Vec<u8>) {
        let answered = forwarded.len() as u64;
        self.in_context(|context| {
            for forwarded in forwarded.drain(..) {
                self.answer_forwarded(context, forwarded, output);
            }
        });
        self.counted_requests(answered);
    }

    /// Answers an exact check held for want of room past its rule's timeout as the region's
    /// silence for that long would be: `RegionUnavailable`, or the rule's fallback. Nothing
    /// was sent, so the region cannot decide it later.
    fn answer_held_past_timeout(
        &self,
        context: &mut Context<'_>,
        check: Exact,
        output: &mut Vec<u8>,
    ) {
        if let Some(forwarder) = &self.forwarder {
            forwarder
                .stats()
                .unavailable
                .fetch_add(1, Ordering::Relaxed);
        }
        let why = format!(
            "no room to forward it within {} ms",
            check.rule.region_timeout_ms
        );
        let result = Err(Refusal::RegionUnavailable {
            rule: check.rule.name.clone(),
            why,
        });
        let forwarded = Forwarded {
            ticket: check,
            late_seq: None,
            result,
        };
        self.answer_forwarded(context, forwarded, output);
    }

    /// Answers one exact check, appending its answer's frame to `output`.
    fn answer_forwarded(
        &self,
        context: &mut Context<'_>,
        forwarded: Forwarded<Exact>,
        output: &mut Vec<u8>,
    ) {
        let Forwarded {
            ticket,
            late_seq,
            result,
        } = forwarded;
        let Exact {
            id,
            rule,
            key,
            cost,
            check_id,
            waiting,
            slot: _,
        } = ticket;
        let key = KeyRef::from(&key);
        let result = match result {
            Ok(outcome) => self.exact_once(context, &rule, key, cost, check_id, outcome),
            // No fallback where another send of the id may yet be decided at the
            // region (it would count twice; a later retry gets the answer that send
            // gets), nor on a stopping node (its last push may have gone).
            Err(unavailable @ Refusal::RegionUnavailable { .. })
                if waiting.as_ref().is_some_and(WaitingSend::has_company)
                    || self.closing.load(Ordering::Relaxed) =>
            {
                // Written, this send may yet be admitted at the region; the send of its id
                // that falls back later is to be taken back then, or the check counts
                // twice (found in review, session 52).
                if let (Some(waiting), Some(seq)) = (&waiting, late_seq) {
                    waiting.pass_on(seq);
                }
                Err(unavailable)
            }
            Err(unavailable @ Refusal::RegionUnavailable { .. }) => {
                let mut late_seqs = (waiting.as_ref())
                    .map(WaitingSend::take_passed_on)
                    .unwrap_or_default();
                late_seqs.extend(late_seq);
                let result =
                    self.fallback(context, &rule, key, cost, check_id, unavailable, &late_seqs);
                // A fallback that counted nothing has nothing to take back: the sends it
                // took go on to the next of the id that falls back, as if it got none
                // (found in review, session 55: dropped, that one stayed counted when the
                // region admitted one of them late).
                let counted = result.as_ref().is_ok_and(|decision| decision.allowed);
                if let (Some(waiting), false) = (&waiting, counted) {
                    late_seqs.into_iter().for_each(|seq| waiting.pass_on(seq));
                }
                result
            }
            Err(other) => Err(other),
        };
        drop(waiting);
        if let Ok(decision) = &result {
            self.metrics.decided(decision);
        }
        let response = Response {
            id,
            result: result.map(Reply::Decision),
        };
        wire::encode_response(&response, output);
    }

    /// Runs `answer` in a request context, then writes the lane log out. A failed write
    /// stops the node: see [`EXIT_LOG_FAILED`].
    fn in_context<T>(&self, answer: impl FnOnce(&mut Context<'_>) -> T) -> T {
        let now = clock::wall();
        // Held for the batch: synchronous code on the node's one thread, so the gossip task
        // cannot be waiting for it meanwhile.
        let view = self.view.lock();
        let mut log = self
            .log
            .as_ref()
            .map(|log| log.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        let mut context = Context {
            store: &self.store,
            view: &view,
            now,
            written_at: self.clock.mono(),
            log: log.as_deref_mut(),
            lane_rate_max: self.lane_rate_max,
            lane_log_refused: &self.metrics.lane_log_refused,
            keys_refused: &self.metrics.keys_refused,
            refused: &self.refused_sums,
        };
        let answered = answer(&mut context);
        if let Some(log) = log.as_deref_mut() {
            write_out(log, &self.store);
        }
        answered
    }

    /// The paced wall clock, in unix seconds, that what is remembered here of a window is
    /// forgotten by (`clock::ExpiryClock`). Read only where it is needed: not on a
    /// request's path unless the request names an id.
    fn live_at_secs(&self) -> u64 {
        let mut expiry = self.expiry.lock().unwrap_or_else(PoisonError::into_inner);
        expiry.now_secs()
    }

    fn counted_requests(&self, answered: u64) {
        self.metrics
            .client_requests
            .fetch_add(answered, Ordering::Relaxed);
    }

    /// Answers one request, or hands back an exact check to forward: its rule is looked
    /// up once, here, for both kinds of check.
    fn handle(&self, context: &mut Context<'_>, op: OpRef<'_>) -> Result<Handling, Refusal> {
        let result = match op {
            OpRef::Incr {
                rule,
                subject,
                amount,
                id,
            } => {
                let key = decide::key(self.countable(rule)?, subject, context.now)?;
                self.count(context, key, amount, true, id)
                    .map(Reply::Counted)
            }
            OpRef::Decr {
                rule,
                subject,
                amount,
                id,
            } => {
                let key = decide::key(self.countable(rule)?, subject, context.now)?;
                self.count(context, key, amount, false, id)
                    .map(Reply::Counted)
            }
            OpRef::Get { rule, subject } => {
                let key = decide::key(self.rules.get(rule)?, subject, context.now)?;
                Ok(Reply::Estimate(context.estimate(key)))
            }
            OpRef::Check {
                rule,
                subject,
                cost,
                id: check_id,
            } => {
                let found = self.rules.get(rule)?;
                let key = decide::key(found, subject, context.now)?;
                decide::check_cost(cost)?;
                let decision = match found.1.mode {
                    RuleMode::Approximate => match check_id {
                        None => context.check(&found.1, key, cost)?,
                        Some(id) => self.check_once(context, &found.1, key, cost, id)?,
                    },
                    RuleMode::Exact => {
                        let recalled = match check_id {
                            Some(id) => self.recalled(context, &found.1, key, cost, id)?,
                            None => None,
                        };
                        match (recalled, &self.forwarder) {
                            (Some(decision), _) => decision,
                            (None, Some(_)) => {
                                return Ok(Handling::Forward {
                                    rule: found.1.clone(),
                                    key: key.to_key(),
                                    cost,
                                    check_id,
                                })
                            }
                            (None, None) => {
                                let unavailable = Refusal::RegionUnavailable {
                                    rule: found.1.name.clone(),
                                    why: "this node has no region configured".into(),
                                };
                                self.fallback(
                                    context,
                                    &found.1,
                                    key,
                                    cost,
                                    check_id,
                                    unavailable,
                                    &[],
                                )?
                            }
                        }
                    }
                };
                self.metrics.decided(&decision);
                Ok(Reply::Decision(decision))
            }
            OpRef::Status => Ok(Reply::Status(self.status(context))),
        };
        result.map(Handling::Now)
    }

    /// The rule named `name`, if an increment or decrement may count in it here: an exact
    /// rule's count is the region's, and only its checks change it.
    fn countable(&self, name: &str) -> Result<&(Rule, Arc<RuleConfig>), Refusal> {
        let found = self.rules.get(name)?;
        match found.1.mode {
            RuleMode::Approximate => Ok(found),
            RuleMode::Exact => Err(Refusal::BadField {
                field: "rule".into(),
                why: format!(
                    "{name:?} is exact: its count is the region's, changed only by checks"
                ),
            }),
        }
    }

    /// Decides an approximate check under its id once: a retry of an id still remembered
    /// gets the first decision ([`RecentIds::get`]), and counts nothing more.
    fn check_once(
        &self,
        context: &mut Context<'_>,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        cost: u64,
        id: CheckId,
    ) -> Result<Decision, Refusal> {
        let answered = self.once(context, key, cost, id, "a check", |context| {
            context.check(rule, key, cost).map(Answered::Decided)
        })?;
        decided(answered)
    }

    /// Adds `amount` (or subtracts it), once under `id` if one is given: a retry of an id
    /// still remembered gets the first count, as it was given, and counts nothing more.
    fn count(
        &self,
        context: &mut Context<'_>,
        key: KeyRef<'_>,
        amount: u64,
        incr: bool,
        id: Option<CheckId>,
    ) -> Result<wire::Estimate, Refusal> {
        let Some(id) = id else {
            return context.count(key, amount, incr);
        };
        let (counted, this): (fn(_) -> _, _) = if incr {
            (Answered::Incremented, "an increment")
        } else {
            (Answered::Decremented, "a decrement")
        };
        let answered = self.once(context, key, amount, id, this, |context| {
            context.count(key, amount, incr).map(counted)
        })?;
        match answered {
            Answered::Incremented(estimate) if incr => Ok(estimate),
            Answered::Decremented(estimate) if !incr => Ok(estimate),
            other => Err(id_reused(other.kind(), this)),
        }
    }

    /// `answer`'s answer under `id` to a request of the kind `this` ("a check", say) of
    /// `amount` on `key`, once: the remembered one while `id` is, else what `answer`
    /// gives, remembered if it gave one. An id remembered for another request is refused.
    fn once(
        &self,
        context: &mut Context<'_>,
        key: KeyRef<'_>,
        amount: u64,
        id: CheckId,
        this: &'static str,
        answer: impl FnOnce(&mut Context<'_>) -> Result<Answered, Refusal>,
    ) -> Result<Answered, Refusal> {
        self.once_if(context, key, amount, id, this, answer, |_| true)
    }

    /// [`Service::once`], remembering only an answer that `keep` accepts.
    #[allow(clippy::too_many_arguments)]
    fn once_if(
        &self,
        context: &mut Context<'_>,
        key: KeyRef<'_>,
        amount: u64,
        id: CheckId,
        this: &'static str,
        answer: impl FnOnce(&mut Context<'_>) -> Result<Answered, Refusal>,
        keep: impl FnOnce(&Answered) -> bool,
    ) -> Result<Answered, Refusal> {
        let (now_ms, live_at) = (context.now.0, self.live_at_secs());
        let asked = Asked::of(key, amount);
        let mut recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((answered, first)) = recent.get(id, now_ms, live_at) {
            if answered.kind() != this {
                return Err(id_reused(answered.kind(), this));
            }
            if first != asked {
                return Err(id_reused_for_another(this));
            }
            self.answered_again();
            return Ok(answered);
        }
        let answered = answer(context)?;
        if keep(&answered) {
            let remembered = Remembered {
                answered,
                asked,
                window: key.window(),
            };
            recent.insert(id, remembered, live_at);
            // Logged after what the answer wrote, for this node's next life.
            if let Some(log) = context.log.as_deref_mut() {
                log.append_answered(id, remembered);
            }
        }
        Ok(answered)
    }

    /// The decision given here under `id` to a check of the exact rule `rule` (by the
    /// region, or by a fallback that counted), if it is remembered. An approximate
    /// decision under `id` is refused unless the rule falls back to one: it was given to
    /// a check of an approximate rule (an application that reused the id, or two sessions'
    /// ids that collide), and an exact rule never gets a silent approximate answer
    /// (found in review, session 45: before, it got that decision, and the check was
    /// never forwarded).
    fn recalled(
        &self,
        context: &Context<'_>,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        cost: u64,
        id: CheckId,
    ) -> Result<Option<Decision>, Refusal> {
        let recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        let Some((answered, first)) = recent.get(id, context.now.0, self.live_at_secs()) else {
            return Ok(None);
        };
        let decision = decided(answered)?;
        if decision.mode.is_approximate()
            && rule.on_region_unavailable != OnRegionUnavailable::Approximate
        {
            let this = format!("a check of the exact rule `{}`", rule.name);
            return Err(id_reused("a check of an approximate rule", &this));
        }
        if first != Asked::of(key, cost) {
            return Err(id_reused_for_another("a check"));
        }
        self.answered_again();
        Ok(Some(decision))
    }

    /// The decision the region's `outcome` makes, remembered under `id`, if given, so a
    /// retry through this sidecar gets it without asking the region, which would answer
    /// the same. A send of an id this sidecar has already answered (a fallback answered an
    /// earlier send of it while this one waited for the region) gets that first answer,
    /// though the region has counted this one too.
    fn exact_once(
        &self,
        context: &mut Context<'_>,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        cost: u64,
        id: Option<CheckId>,
        outcome: Outcome,
    ) -> Result<Decision, Refusal> {
        let Some(id) = id else {
            return Ok(context.exact(rule, key, outcome));
        };
        let answered = self.once(context, key, cost, id, "a check", |context| {
            Ok(Answered::Decided(context.exact(rule, key, outcome)))
        })?;
        decided(answered)
    }

    /// An exact check's decision without the region, as the rule's `on_region_unavailable`
    /// says, once under `id`: a retry of an id remembered here gets the decision given
    /// under it. One that counted is remembered, so a retry counts nothing more
    /// ([`Service::recalled`]); one that counted nothing is not, so a retry may yet reach
    /// the region.
    /// `late_seqs` are the sequence numbers of the forwarded sends of the check the region
    /// may still decide (see [`Forwarded::late_seq`]): this one's, and those of its id that
    /// timed out with no fallback while it waited ([`WaitingSend::pass_on`]). An admitted
    /// fallback (which counted its cost) is remembered under them, and taken back once if
    /// the region admitted any of them after all ([`Service::late_admissions`]).
    /// A check whose window is over here by now (its rule's timeout is longer than what
    /// is left of its window and the one after) and whose fallback would count (`allow`,
    /// `approximate`) gets `unavailable` and counts nothing: its key may be gone from the
    /// store, and the fallback would count in a lane begun again from zero, decided on an
    /// estimate of zero.
    #[allow(clippy::too_many_arguments)]
    fn fallback(
        &self,
        context: &mut Context<'_>,
        rule: &RuleConfig,
        key: KeyRef<'_>,
        cost: u64,
        id: Option<CheckId>,
        unavailable: Refusal,
        late_seqs: &[u64],
    ) -> Result<Decision, Refusal> {
        let counts = matches!(
            rule.on_region_unavailable,
            OnRegionUnavailable::Allow | OnRegionUnavailable::Approximate
        );
        if counts && !key.window().is_live(self.live_at_secs()) {
            return Err(unavailable);
        }
        let count = |context: &mut Context<'_>| {
            let decision = context.fallback(rule, key, cost, unavailable)?;
            if decision.allowed && !late_seqs.is_empty() {
                let admitted = self.late_lock().counted(late_seqs, key.to_key(), cost);
                if admitted {
                    self.take_back(context, key, cost);
                }
            }
            Ok(decision)
        };
        let Some(id) = id else {
            return count(context);
        };
        let answered = self.once_if(
            context,
            key,
            cost,
            id,
            "a check",
            |context| count(context).map(Answered::Decided),
            |answered| matches!(answered, Answered::Decided(decision) if decision.allowed),
        )?;
        decided(answered)
    }

    /// Takes back the fallbacks counted for the forwarded checks `seqs`, which the region
    /// admitted after they were answered `RegionUnavailable`.
    pub fn late_admissions(&self, seqs: &[u64]) {
        self.in_context(|context| {
            for &seq in seqs {
                let counted = self.late_lock().admitted(seq);
                if let Some((key, cost)) = counted {
                    self.take_back(context, KeyRef::from(&key), cost);
                }
            }
        });
    }

    /// A decrement of `cost` in this node's own lane of `key`: a fallback's count taken
    /// back. One the lane log or the lane's rate refuses is left counted, and one whose
    /// window is over is not taken (its lanes are being dropped everywhere).
    fn take_back(&self, context: &mut Context<'_>, key: KeyRef<'_>, cost: u64) {
        if !key.window().is_live(self.live_at_secs()) {
            return;
        }
        if context.take_back(key, cost).is_ok() {
            self.metrics
                .fallbacks_taken_back
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    fn late_lock(&self) -> std::sync::MutexGuard<'_, LateFallbacks> {
        self.late.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a request answered from memory ([`RecentIds`]).
    fn answered_again(&self) {
        self.metrics
            .client_ids_answered_again
            .fetch_add(1, Ordering::Relaxed);
    }

    fn status(&self, context: &Context<'_>) -> Status {
        let members = (context.view.members_by_state().into_iter())
            .filter(|&(_, count)| count > 0)
            .map(|(state, count)| (format!("{state:?}").to_lowercase(), count));
        Status {
            node: self.replica.node.0,
            generation: self.replica.generation.0,
            members: members.collect(),
            keys: self.store.len() as u64,
        }
    }
}

/// Ends a batch of writes to `store`: writes the lane log's records out, then compacts the
/// log if it is due. A failed write stops the node: see [`EXIT_LOG_FAILED`].
pub fn write_out(log: &mut LaneLog, store: &LaneStore) {
    if let Err(err) = log.flush() {
        log_line!("tallyd: {err}; stopping: writes cannot be made durable");
        std::process::exit(EXIT_LOG_FAILED);
    }
    if let Err(err) = log.compact_if_large(store) {
        if log.has_failed() {
            // Renamed over the log but not reopened: nothing can be appended now.
            log_line!("tallyd: {err}; stopping: writes cannot be made durable");
            std::process::exit(EXIT_LOG_FAILED);
        }
        // The log is still whole; only its rewrite failed, to be tried again later.
        log_line!("tallyd: {err}");
    }
}

/// A remembered answer, as a check's decision.
fn decided(answered: Answered) -> Result<Decision, Refusal> {
    match answered {
        Answered::Decided(decision) => Ok(decision),
        other => Err(id_reused(other.kind(), "a check")),
    }
}

/// The refusal of `this` kind of request under an id that named one of its kind with
/// another rule, subject or amount here.
fn id_reused_for_another(this: &str) -> Refusal {
    id_reused(
        &format!("{this} with another rule, subject or amount"),
        "this one",
    )
}

/// The refusal of `this` request under an id that `named` another kind here.
fn id_reused(named: &str, this: &str) -> Refusal {
    Refusal::BadField {
        field: "id".into(),
        why: format!(
            "this id named {named} here, not {this}; a retry must repeat its request, and a \
             new request needs a new id"
        ),
    }
}

/// Serves applications on `tcp` and, if given, `unix`, at most `connections_max` at once.
/// Both accept loops run in this one future, so whoever aborts it stops both.
pub async fn serve(
    service: Arc<Service>,
    tcp: TcpListener,
    unix: Option<UnixListener>,
    connections_max: usize,
) {
    let permits = Arc::new(Semaphore::new(connections_max));
    let on_tcp = async {
        loop {
            match tcp.accept().await {
                Ok((stream, _)) => {
                    // Requests are small and pipelined; Nagle's delay would only hold
                    // answers.
                    let _ = stream.set_nodelay(true);
                    spawn_connection(&service, &permits, stream);
                }
                Err(_) => accept_failed(&service).await,
            }
        }
    };
    let Some(unix) = unix else {
        return on_tcp.await;
    };
    let on_unix = async {
        loop {
            match unix.accept().await {
                Ok((stream, _)) => spawn_connection(&service, &permits, stream),
                Err(_) => accept_failed(&service).await,
            }
        }
    };
    tokio::join!(on_tcp, on_unix);
}

/// An accept failed (out of file descriptors, say): count it and wait a moment, so the
/// listener keeps going once the cause passes instead of spinning or stopping.
async fn accept_failed(service: &Service) {
    service
        .metrics
        .client_connections_refused
        .fetch_add(1, Ordering::Relaxed);
    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
}

fn spawn_connection<S>(service: &Arc<Service>, permits: &Arc<Semaphore>, stream: S)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let Ok(permit) = permits.clone().try_acquire_owned() else {
        service
            .metrics
            .client_connections_refused
            .fetch_add(1, Ordering::Relaxed);
        return;
    };
    let service = service.clone();
    tokio::spawn(async move {
        serve_connection(&service, stream).await;
        drop(permit);
    });
}

/// Reads, answers and writes batches until the client goes or sends a bad frame. Exact
/// checks are answered when the region is, in between; a client that has finished sending
/// (closed its half of the connection), sent a bad frame, or gone in the middle of a frame
/// still gets the answers of those waiting, and only then is the connection closed. A
/// closed connection is not told from a half-closed one: a client that has gone has its
/// exact checks still answered (within their rule's timeout), and a fallback counted, as
/// every request read from it is, until a write to it fails (a reset). Then the task ends,
/// and its exact checks are answered to no one: those not yet written to the region are
/// dropped, and those written still count as sends of their ids waiting until their
/// deadlines, since the region may decide them. Nothing more is read while answers wait to
/// be written, but exact checks are decided as the region answers them even then: a
/// client that stops reading holds neither their ids nor the node's room for exact checks.
async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin>(
    service: &Arc<Service>,
    mut stream: S,
) {
    let mut input = Vec::with_capacity(READ_BYTES);
    let mut output = Vec::with_capacity(16 * 1024);
    // How much of `output` the client has been sent.
    let mut written = 0;
    let mut exact = Vec::new();
    // Exact checks' answers, as the region gives them.
    let (answers, mut answered) = mpsc::unbounded_channel::<Vec<Forwarded<Exact>>>();
    let mut forwarded = Vec::new();
    // Exact checks waiting for the region; at most `exact_in_flight_max`, each with a
    // place in the node's room.
    let room_max = service.exact_in_flight_max;
    let mut in_flight = 0;
    // A place in the node's room, kept for the exact check held, and the request for one
    // while it waits: kept across turns of the loop, so the connection keeps its turn.
    let mut kept = None;
    let mut asking = None;
    // Whether the client may still send, and whether it sent a bad frame.
    let mut sending = true;
    let mut bad_frame = false;
    // Whether whole frames wait in `input` for the answers before them to be written.
    let mut full = false;
    // If `input` starts with an exact check left unread for want of room: since when
    // frames have been held, and that check's rule's timeout, past which it is answered
    // without the region.
    let mut held: Option<Held> = None;
    // When the last read ended: the frames in `input` arrived then or before, and every
    // exact check's timeout counts from then, held or not.
    let mut read_at = Instant::now();
    loop {
        if written < output.len() {
            // Tried first: while the client reads, each batch's answers go out at once.
            tokio::select! {
                biased;
                sent = stream.write(&output[written..]) => match sent {
                    Ok(sent) if sent > 0 => written += sent,
                    _ => return,
                },
                Some(first) = answered.recv() => {
                    in_flight -= answer_queued(service, first, &mut answered, &mut forwarded, &mut output);
                }
                // The client takes no answer now: the connection gives back its place in the
                // node's room and its turn for one, which it asks for again once its answers
                // are written (found in review, session 47: a request left unpolled here was
                // given a place all the same, held for as long as the client did not read).
                () = std::future::ready(()), if kept.is_some() || asking.is_some() => {
                    (kept, asking) = (None, None);
                }
            }
            continue;
        }
        output.clear();
        output.shrink_to(OUTPUT_KEPT_BYTES);
        written = 0;
        if !sending && in_flight == 0 && held.is_none() && !full {
            if bad_frame {
                let _ = stream.shutdown().await;
                drain_until_closed(&mut stream).await;
            }
            return;
        }
        let mut held_past_ms = 0;
        if let Some(hold) = held {
            // A held check goes first, once the connection has room for it and a place in
            // the node's room, or once its rule's timeout has passed since its read;
            // until then nothing more is read.
            if !(in_flight < room_max && kept.is_some()) {
                let due = hold.since + Duration::from_millis(hold.timeout_ms);
                tokio::select! {
                    slot = asking.get_or_insert_with(|| Box::pin(service.exact_room.take())),
                        if in_flight < room_max && kept.is_none() =>
                    {
                        asking = None;
                        kept = Some(slot);
                    }
                    () = tokio::time::sleep_until(due) => held_past_ms = hold.timeout_ms,
                    Some(first) = answered.recv() => {
                        in_flight -= answer_queued(service, first, &mut answered, &mut forwarded, &mut output);
                        continue;
                    }
                }
            }
        } else if !full {
            // Room for a read of READ_BYTES past a partial frame; a no-op while there is.
            // The read takes no more, though `reserve` may have made more room.
            input.reserve(READ_BYTES);
            let mut one_read = (&mut stream).take(READ_BYTES as u64);
            let read = tokio::select! {
                read = one_read.read_buf(&mut input), if sending => read,
                Some(first) = answered.recv() => {
                    in_flight -= answer_queued(service, first, &mut answered, &mut forwarded, &mut output);
                    continue;
                }
            };
            read_at = Instant::now();
            if let Ok(0) | Err(_) = read {
                if !input.is_empty() {
                    // The client went in the middle of a frame: a truncated frame.
                    service
                        .metrics
                        .client_frames_bad
                        .fetch_add(1, Ordering::Relaxed);
                }
                sending = false;
                continue;
            }
        }
        if service.closing.load(Ordering::Relaxed) {
            // Nothing read now is answered: the client sees the connection close.
            return;
        }
        let room = room_max - in_flight;
        let handled = service.handle_frames(
            &input,
            &mut output,
            &mut exact,
            room,
            &mut kept,
            held_past_ms,
        );
        full = handled.full;
        held = handled.held.map(|timeout_ms| Held {
            since: held.map_or(read_at, |hold| hold.since),
            timeout_ms,
        });
        if held.is_none() {
            // No check held: a place kept for one that was answered without it (a retry
            // answered from memory, say), and a request for one, are given back, not kept
            // while the connection idles (found in review, session 47).
            (kept, asking) = (None, None);
        }
        if held.is_some() && in_flight + exact.len() < room_max {
            service.exact_room.count_full();
        }
        input.drain(..handled.consumed);
        in_flight += exact.len();
        if !exact.is_empty() {
            service.forward(&mut exact, read_at, &answers);
        }
        if let Some(why) = &handled.bad {
            service
                .metrics
                .client_frames_bad
                .fetch_add(1, Ordering::Relaxed);
            let response = Response {
                id: 0,
                result: Err(Refusal::Malformed { why: why.clone() }),
            };
            wire::encode_response(&response, &mut output);
            // Nothing after the bad frame is read; the exact checks before it are answered.
            (sending, bad_frame) = (false, true);
        }
    }
}

/// How long a connection closed for a bad frame goes on reading, and dropping, what its
/// client sent after it, for the client to see the close.
const LINGER: Duration = Duration::from_secs(1);

/// Reads and drops what the client sends until it closes, or for at most [`LINGER`]:
/// called once the answers are written and the connection shut down for writing. A socket
/// closed with bytes unread resets the connection, and the answers still queued to be
/// sent (a client that pipelined past a bad frame, reading slowly) are dropped with them
/// (found in review, session 49: 255 of 2,001 answers came, then a reset,
/// `the_answers_before_a_bad_frame_reach_a_client_that_sent_more_after_it`).
async fn drain_until_closed<S: AsyncRead + Unpin>(stream: &mut S) {
    let mut dropped = [0; 8 * 1024];
    let drained = async { while let Ok(1..) = stream.read(&mut dropped).await {} };
    let _ = tokio::time::timeout(LINGER, drained).await;
}

/// Frames held unread at an exact check with no room for it.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// Since when frames have been held: the end of the read that brought the held check.
    since: Instant,
    /// The held check's rule's `region_timeout_ms`.
    timeout_ms: u64,
}

/// Answers the exact checks the region answered, `first` and every run queued behind it,
/// appending their answers to `output`; returns how many.
fn answer_queued(
    service: &Service,
    first: Vec<Forwarded<Exact>>,
    answered: &mut mpsc::UnboundedReceiver<Vec<Forwarded<Exact>>>,
    forwarded: &mut Vec<Forwarded<Exact>>,
    output: &mut Vec<u8>,
) -> usize {
    forwarded.extend(first);
    while let Ok(next) = answered.try_recv() {
        forwarded.extend(next);
    }
    let answers = forwarded.len();
    service.answer_exact(forwarded, output);
    answers
}

/// The first frame in `input`, if it is whole: its body and how many bytes the frame takes.
fn next_frame(input: &[u8]) -> Result<Option<(&[u8], usize)>, FrameError> {
    let Some(&prefix) = input.first_chunk::<4>() else {
        return Ok(None);
    };
    let len = wire::frame_len(prefix)?;
    Ok(input.get(4..4 + len).map(|body| (body, 4 + len)))
}

// The lane store runs on loom's atomics under `tally_loom`, which work only inside a model.
#[cfg(test)]
#[cfg(not(tally_loom))]
mod tests {
    use super::*;
    use crate::exact_room::EXACT_WAITING_MAX;
    use tally_client::wire::{Op, Request};

    fn service(keys_max: usize) -> Service {
        let rule = RuleConfig {
            window_secs: 60,
            ..RuleConfig::for_test("count", 100, RuleMode::Approximate)
        };
        let quota = RuleConfig::for_test("quota", 100, RuleMode::Exact);
        let replica = ReplicaId::new(tally_crdt::NodeId(1), tally_crdt::Generation(1));
        Service {
            store: Arc::new(LaneStore::new(replica, keys_max)),
            refused_sums: Arc::default(),
            view: Arc::new(View::default()),
            rules: Rules::new(&[rule, quota]).unwrap(),
            log: None,
            metrics: Arc::new(Metrics::default()),
            replica,
            forwarder: None,
            lane_rate_max: u64::MAX,
            exact_in_flight_max: EXACT_IN_FLIGHT_MAX,
            exact_room: Arc::default(),
            closing: std::sync::atomic::AtomicBool::new(false),
            recent: Mutex::default(),
            expiry: Mutex::new(clock::ExpiryClock::start()),
            clock: clock::Clock::start(),
            waiting: Arc::default(),
            late: Mutex::default(),
        }
    }

    fn frames(requests: &[Request]) -> Vec<u8> {
        let mut input = Vec::new();
        for request in requests {
            wire::encode_frame(request, &mut input);
        }
        input
    }

    /// The answers in `output`'s frames.
    fn responses(mut output: &[u8]) -> Vec<Response> {
        let mut responses = Vec::new();
        while let Some((body, len)) = next_frame(output).unwrap() {
            responses.push(wire::decode_body(body).unwrap());
            output = &output[len..];
        }
        assert!(output.is_empty(), "a partial answer");
        responses
    }

    /// Answers `input` into `output` with room for every exact check, which go to `exact`.
    fn handle(
        service: &Service,
        input: &[u8],
        output: &mut Vec<u8>,
        exact: &mut Vec<Exact>,
    ) -> Handled {
        service.handle_frames(input, output, exact, EXACT_IN_FLIGHT_MAX, &mut None, 0)
    }

    /// Answers a batch with no exact check in it, whole.
    fn answer(service: &Service, requests: &[Request]) -> Vec<Response> {
        let input = frames(requests);
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        let handled = handle(service, &input, &mut output, &mut exact);
        assert_eq!((handled.consumed, handled.bad), (input.len(), None));
        assert!(exact.is_empty(), "no exact rule here");
        let responses = responses(&output);
        let answered: Vec<u64> = responses.iter().map(|response| response.id).collect();
        let asked: Vec<u64> = requests.iter().map(|request| request.id).collect();
        assert_eq!(answered, asked, "one answer per request, in order");
        responses
    }

    fn incr(id: u64, subject: &str) -> Request {
        Request {
            id,
            op: Op::Incr {
                rule: "count".into(),
                subject: subject.into(),
                amount: 1,
                id: None,
            },
        }
    }

    fn status(id: u64) -> Request {
        Request { id, op: Op::Status }
    }

    #[test]
    fn at_the_key_cap_new_keys_are_refused_with_a_typed_error_and_counted() {
        let service = service(2);
        let batch = [incr(1, "a"), incr(2, "b"), incr(3, "c"), incr(4, "a")];
        let responses = answer(&service, &batch);
        let results: Vec<_> = responses.iter().map(|r| (r.id, r.result.is_ok())).collect();
        assert_eq!(results, [(1, true), (2, true), (3, false), (4, true)]);
        assert_eq!(
            responses[2].result,
            Err(Refusal::KeysFull { keys_max: 2 }),
            "a new key past the cap names the cap"
        );
        assert_eq!(service.metrics.keys_refused.load(Ordering::Relaxed), 1);
        // A check the rule admits is refused the same way, and counted: it would write.
        let mut new_subject = check(5, None);
        if let Op::Check { subject, .. } = &mut new_subject.op {
            *subject = "c".into();
        }
        let responses = answer(&service, &[new_subject]);
        assert_eq!(responses[0].result, Err(Refusal::KeysFull { keys_max: 2 }));
        assert_eq!(service.metrics.keys_refused.load(Ordering::Relaxed), 2);
        assert_eq!(service.store.len(), 2);
    }

    /// TESTING.md C2 at the client's door: an increment that would take a lane past
    /// `u64::MAX` gets `Overflow` and counts nothing, and the lane stays as it was.
    #[test]
    fn an_increment_that_would_wrap_its_lane_is_refused_overflow_and_counts_nothing() {
        let service = service(10);
        let amount = |id, amount| Request {
            id,
            op: Op::Incr {
                rule: "count".into(),
                subject: "a".into(),
                amount,
                id: None,
            },
        };
        let responses = answer(
            &service,
            &[amount(1, u64::MAX - 1), amount(2, 2), amount(3, 1)],
        );
        assert_eq!(counts(&responses[..1]), [i128::from(u64::MAX - 1)]);
        assert_eq!(responses[1].result, Err(Refusal::Overflow));
        assert_eq!(counts(&responses[2..]), [i128::from(u64::MAX)]);
        assert_eq!(estimate(&service, "count"), i128::from(u64::MAX));
    }

    #[test]
    fn an_increment_or_decrement_of_an_exact_rule_is_refused_naming_the_rule() {
        let service = service(10);
        let mut batch = [incr(1, "a"), incr(2, "a")];
        if let Op::Incr { rule, .. } = &mut batch[0].op {
            *rule = "quota".into();
        }
        batch[1].op = Op::Decr {
            rule: "quota".into(),
            subject: "a".into(),
            amount: 1,
            id: None,
        };
        let responses = answer(&service, &batch);
        assert_eq!(responses.len(), 2, "{responses:?}");
        for response in responses {
            assert!(
                matches!(&response.result, Err(Refusal::BadField { field, why })
                    if field == "rule" && why.contains("\"quota\" is exact")),
                "{response:?}"
            );
        }
        assert_eq!(service.store.len(), 0, "nothing counted");
    }

    #[test]
    fn a_batch_is_answered_in_order_each_request_seeing_the_ones_before() {
        let service = service(10);
        let responses = answer(&service, &[incr(7, "a"), incr(8, "a"), incr(9, "a")]);
        let estimates: Vec<_> = responses
            .iter()
            .map(|r| match &r.result {
                Ok(Reply::Counted(estimate)) => (r.id, estimate.estimate),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(estimates, [(7, 1), (8, 2), (9, 3)]);
        assert_eq!(service.metrics.client_requests.load(Ordering::Relaxed), 3);
    }

    fn check(id: u64, check_id: Option<CheckId>) -> Request {
        Request {
            id,
            op: Op::Check {
                rule: "count".into(),
                subject: "a".into(),
                cost: 5,
                id: check_id,
            },
        }
    }

    fn decisions(responses: &[Response]) -> Vec<Decision> {
        (responses.iter())
            .map(|response| match &response.result {
                Ok(Reply::Decision(decision)) => *decision,
                other => panic!("expected a decision, got {other:?}"),
            })
            .collect()
    }

    #[test]
    fn an_approximate_check_sent_again_under_its_id_counts_once_and_gets_its_first_decision() {
        let service = service(10);
        let named = CheckId { session: 9, seq: 1 };
        let other = CheckId { session: 9, seq: 2 };
        let batch = [
            check(1, Some(named)),
            check(2, Some(named)),
            check(3, None),
            check(4, None),
            check(5, Some(other)),
        ];
        let first = decisions(&answer(&service, &batch));
        let estimates: Vec<i128> = first.iter().map(|decision| decision.estimate).collect();
        assert_eq!(
            estimates,
            [5, 5, 10, 15, 20],
            "an id is counted once, no id every time"
        );
        assert_eq!(first[1], first[0]);
        // A later batch, as a retry after a timeout: the first decision again, but for the
        // time to its window's end, counted from now.
        let retried = decisions(&answer(
            &service,
            &[check(6, Some(named)), check(7, Some(other))],
        ));
        for (retried, first) in retried.into_iter().zip([first[0], first[4]]) {
            assert_same_but_for_reset(retried, first);
        }
        assert_eq!(estimate(&service, "count"), 20);
    }

    #[test]
    fn an_approximate_checks_id_sent_with_a_check_of_an_exact_rule_is_refused() {
        let service = service(10);
        let named = CheckId { session: 9, seq: 1 };
        let first = decisions(&answer(&service, &[check(1, Some(named))]));
        assert_eq!(first[0].mode, wire::Mode::ApproximateConnected);
        let exact = Request {
            id: 2,
            op: Op::Check {
                rule: "quota".into(),
                subject: "a".into(),
                cost: 5,
                id: Some(named),
            },
        };
        match &answer(&service, &[exact])[0].result {
            Err(Refusal::BadField { field, why }) => {
                assert_eq!(field, "id");
                assert!(why.contains("the exact rule `quota`"), "{why}");
            }
            other => panic!("an exact rule's check got {other:?}"),
        }
        assert_eq!(
            service
                .metrics
                .client_ids_answered_again
                .load(Ordering::Relaxed),
            0,
            "nothing was answered again"
        );
    }

    /// `retried` is `first` given again, its time to the window's end counted later.
    fn assert_same_but_for_reset(retried: Decision, first: Decision) {
        assert!(retried.reset_after_ms <= first.reset_after_ms);
        let reset_after_ms = first.reset_after_ms;
        assert_eq!(
            Decision {
                reset_after_ms,
                ..retried
            },
            first
        );
    }

    /// `rule`/`a`'s estimate, by a `get`.
    fn estimate(service: &Service, rule: &str) -> i128 {
        let get = Request {
            id: 0,
            op: Op::Get {
                rule: rule.into(),
                subject: "a".into(),
            },
        };
        match &answer(service, &[get])[0].result {
            Ok(Reply::Estimate(estimate)) => estimate.estimate,
            other => panic!("expected an estimate, got {other:?}"),
        }
    }

    /// An increment of 3 or a decrement of 2 of `count`/`a`, under `check_id` if given.
    fn count(id: u64, incr: bool, check_id: Option<CheckId>) -> Request {
        let (rule, subject) = ("count".to_owned(), "a".to_owned());
        let op = if incr {
            Op::Incr {
                rule,
                subject,
                amount: 3,
                id: check_id,
            }
        } else {
            Op::Decr {
                rule,
                subject,
                amount: 2,
                id: check_id,
            }
        };
        Request { id, op }
    }

    fn counts(responses: &[Response]) -> Vec<i128> {
        (responses.iter())
            .map(|response| match &response.result {
                Ok(Reply::Counted(estimate)) => estimate.estimate,
                other => panic!("expected a count, got {other:?}"),
            })
            .collect()
    }

    #[test]
    fn an_increment_or_decrement_sent_again_under_its_id_counts_once_and_gets_its_first_count() {
        let service = service(10);
        let up = CheckId { session: 9, seq: 1 };
        let down = CheckId { session: 9, seq: 2 };
        let batch = [
            count(1, true, Some(up)),
            count(2, true, Some(up)),
            count(3, true, None),
            count(4, false, Some(down)),
            count(5, false, Some(down)),
            count(6, false, None),
        ];
        assert_eq!(
            counts(&answer(&service, &batch)),
            [3, 3, 6, 4, 4, 2],
            "an id is counted once, no id every time"
        );
        // A later batch, as retries after a timeout: the first counts again.
        let retried = [count(7, false, Some(down)), count(8, true, Some(up))];
        assert_eq!(counts(&answer(&service, &retried)), [4, 3]);
        assert_eq!(estimate(&service, "count"), 2);
        let again = &service.metrics.client_ids_answered_again;
        assert_eq!(
            again.load(Ordering::Relaxed),
            4,
            "two in the batch, two retried"
        );
    }

    #[test]
    fn an_id_sent_with_another_kind_of_request_than_it_named_is_refused_counts_nothing_and_is_not_answered_again(
    ) {
        let service = service(10);
        let checked = CheckId { session: 9, seq: 1 };
        let incremented = CheckId { session: 9, seq: 2 };
        let responses = answer(
            &service,
            &[
                check(1, Some(checked)),
                count(2, true, Some(incremented)),
                count(3, true, Some(checked)),
                count(4, false, Some(checked)),
                check(5, Some(incremented)),
                count(6, false, Some(incremented)),
            ],
        );
        assert_eq!(decisions(&responses[..1])[0].estimate, 5);
        assert_eq!(counts(&responses[1..2]), [8]);
        for response in &responses[2..] {
            assert!(
                matches!(
                    &response.result,
                    Err(Refusal::BadField { field, why }) if field == "id" && why.contains("retry")
                ),
                "{response:?}"
            );
        }
        let Err(Refusal::BadField { why, .. }) = &responses[5].result else {
            unreachable!("checked above");
        };
        assert!(
            why.contains("named an increment here, not a decrement"),
            "an increment's id does not take a decrement: {why}"
        );
        assert_eq!(
            estimate(&service, "count"),
            8,
            "the refused requests counted nothing"
        );
        let again = &service.metrics.client_ids_answered_again;
        assert_eq!(
            again.load(Ordering::Relaxed),
            0,
            "a refused request was not answered again"
        );
    }

    #[test]
    fn an_id_sent_with_another_subject_amount_or_cost_than_it_named_is_refused_and_counts_nothing()
    {
        let service = service(10);
        let checked = CheckId { session: 9, seq: 1 };
        let incremented = CheckId { session: 9, seq: 2 };
        let first = answer(
            &service,
            &[check(1, Some(checked)), count(2, true, Some(incremented))],
        );
        let with = |request: Request, change: &dyn Fn(&mut Op)| {
            let mut request = request;
            change(&mut request.op);
            request
        };
        let reused = [
            with(check(3, Some(checked)), &|op| {
                if let Op::Check { subject, .. } = op {
                    *subject = "b".into();
                }
            }),
            with(check(4, Some(checked)), &|op| {
                if let Op::Check { cost, .. } = op {
                    *cost = 6;
                }
            }),
            with(count(5, true, Some(incremented)), &|op| {
                if let Op::Incr { amount, .. } = op {
                    *amount = 4;
                }
            }),
            with(count(6, true, Some(incremented)), &|op| {
                if let Op::Incr { subject, .. } = op {
                    *subject = "b".into();
                }
            }),
        ];
        for response in answer(&service, &reused) {
            match &response.result {
                Err(Refusal::BadField { field, why }) => {
                    assert_eq!(field, "id");
                    assert!(why.contains("another rule, subject or amount"), "{why}");
                }
                other => panic!("request {} got {other:?}", response.id),
            }
        }
        assert_eq!(estimate(&service, "count"), 8, "5 checked and 3 counted");
        let b = Request {
            id: 7,
            op: Op::Get {
                rule: "count".into(),
                subject: "b".into(),
            },
        };
        assert!(
            matches!(&answer(&service, &[b])[0].result, Ok(Reply::Estimate(e)) if e.estimate == 0),
            "nothing counted on the other subject"
        );
        // The retries, as sent the first time, still get the first answers.
        let retried = answer(
            &service,
            &[check(8, Some(checked)), count(9, true, Some(incremented))],
        );
        assert_same_but_for_reset(decisions(&retried[..1])[0], decisions(&first[..1])[0]);
        assert_eq!(counts(&retried[1..]), counts(&first[1..]));
    }

    #[test]
    fn bad_requests_get_refusals_naming_the_field_and_count_nothing() {
        let service = service(10);
        let unknown = Request {
            id: 1,
            op: Op::Get {
                rule: "nope".into(),
                subject: "a".into(),
            },
        };
        let empty_subject = incr(2, "");
        let responses = answer(&service, &[unknown, empty_subject]);
        assert_eq!(
            responses[0].result,
            Err(Refusal::UnknownRule {
                rule: "nope".into()
            })
        );
        assert!(matches!(
            &responses[1].result,
            Err(Refusal::BadField { field, .. }) if field == "subject"
        ));
        assert!(service.store.is_empty());
    }

    /// A forwarder to a region at an address where nothing listens.
    fn forwarder_to_nowhere() -> Forwarder<Exact> {
        // A directory per call: tests run at once, and a file being written reads as bad.
        static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let call = CALLS.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("tally-listener-{}-{call}", std::process::id()));
        let files = crate::certs::write_cluster(&dir, &[tally_crdt::NodeId(1)]).unwrap();
        let identity = crate::tls::identity(&files[0].tls_config(), tally_crdt::NodeId(1)).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let stats = Arc::new(crate::transport::TransportStats::default());
        let local = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let (transport, _inbound) =
            crate::transport::Transport::bind(local, identity, 64 * 1024, stats, None).unwrap();
        Forwarder::new(
            transport.requester(),
            tally_crdt::NodeId(9),
            // Port 9, discard: nothing answers QUIC there.
            "127.0.0.1:9".into(),
            ReplicaId::new(tally_crdt::NodeId(1), tally_crdt::Generation(1)),
            crate::clock::Clock::start(),
            Arc::default(),
            tokio::sync::mpsc::unbounded_channel().0,
        )
    }

    fn quota_check(id: u64, cost: u64) -> Request {
        Request {
            id,
            op: Op::Check {
                rule: "quota".into(),
                subject: "a".into(),
                cost,
                id: Some(CheckId {
                    session: 9,
                    seq: id,
                }),
            },
        }
    }

    #[test]
    fn without_a_region_an_exact_check_is_answered_in_its_batch_as_its_rule_says() {
        let service = service(10);
        let input = frames(&[incr(4, "a"), quota_check(5, 2), quota_check(6, 0)]);
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        handle(&service, &input, &mut output, &mut exact);
        assert!(exact.is_empty());
        let responses = responses(&output);
        let ids: Vec<_> = responses.iter().map(|r| r.id).collect();
        assert_eq!(ids, [4, 5, 6]);
        assert!(matches!(
            &responses[1].result,
            Err(Refusal::RegionUnavailable { rule, why }) if rule == "quota" && why.contains("no region")
        ));
        assert!(matches!(
            &responses[2].result,
            Err(Refusal::BadField { field, .. }) if field == "cost"
        ));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_exact_check_leaves_its_batch_and_gets_region_unavailable_at_its_timeout() {
        let mut service = service(10);
        service.rules = Rules::new(&[RuleConfig {
            region_timeout_ms: 50,
            ..RuleConfig::for_test("quota", 100, RuleMode::Exact)
        }])
        .unwrap();
        service.forwarder = Some(forwarder_to_nowhere());
        let input = frames(&[quota_check(5, 2), status(6)]);
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        handle(&service, &input, &mut output, &mut exact);
        let ids: Vec<_> = responses(&output).iter().map(|r| r.id).collect();
        assert_eq!(ids, [6]);
        let [Exact {
            id,
            rule,
            key,
            cost,
            check_id,
            waiting,
            slot: _,
        }] = exact.as_slice()
        else {
            panic!("one exact check: {exact:?}");
        };
        assert_eq!((*id, rule.name.as_str(), *cost), (5, "quota", 2));
        assert_eq!(*check_id, Some(CheckId { session: 9, seq: 5 }));
        assert!(waiting.as_ref().is_some_and(|send| !send.has_company()));
        assert_eq!((key.rule.as_str(), key.subject.as_str()), ("quota", "a"));
        assert_eq!(service.exact_room.taken(), 1, "the check holds its place");

        let (answers, mut answered) = mpsc::unbounded_channel();
        let clock = crate::clock::Clock::start();
        service.forward(&mut exact, Instant::now(), &answers);
        let mut forwarded = answered.recv().await.unwrap();
        let waited = clock.mono();
        assert!(
            waited >= std::time::Duration::from_millis(50),
            "answered after {waited:?}, before the rule's timeout"
        );
        output.clear();
        service.answer_exact(&mut forwarded, &mut output);
        let responses = responses(&output);
        assert_eq!(responses.len(), 1);
        assert_eq!(responses[0].id, 5);
        assert!(matches!(
            &responses[0].result,
            Err(Refusal::RegionUnavailable { rule, why }) if rule == "quota" && why == "no answer within 50 ms"
        ));
        assert!(forwarded.is_empty());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_exact_check_decided_here_is_answered_again_under_its_id_and_not_forwarded() {
        let mut service = service(10);
        service.rules = Rules::new(&[RuleConfig {
            region_timeout_ms: 50,
            on_region_unavailable: crate::config::OnRegionUnavailable::Allow,
            ..RuleConfig::for_test("quota", 100, RuleMode::Exact)
        }])
        .unwrap();
        service.forwarder = Some(forwarder_to_nowhere());
        // Sent again before the region's timeout (by a client that gave up sooner): both
        // sends are forwarded and time out; the first, while the second still waits, gets
        // the error (the second may yet be decided at the region), and the second falls
        // back and counts.
        let (answers, mut answered) = mpsc::unbounded_channel();
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        let twice = frames(&[quota_check(5, 2), quota_check(5, 2)]);
        handle(&service, &twice, &mut output, &mut exact);
        assert_eq!(exact.len(), 2, "forwarded");
        service.forward(&mut exact, Instant::now(), &answers);
        let mut forwarded = Vec::new();
        while forwarded.len() < 2 {
            forwarded.extend(answered.recv().await.unwrap());
        }
        service.answer_exact(&mut forwarded, &mut output);
        let both = responses(&output);
        assert!(
            matches!(&both[0].result, Err(Refusal::RegionUnavailable { .. })),
            "{both:?}"
        );
        let first = decisions(&both[1..])[0];
        assert_eq!(
            (first.mode, first.allowed, first.estimate),
            (wire::Mode::RegionFallback, true, 2),
            "the fallback counted it once"
        );

        // A later retry: the fallback's decision, here, not the region's, and nothing more
        // counted.
        output.clear();
        handle(
            &service,
            &frames(&[quota_check(5, 2)]),
            &mut output,
            &mut exact,
        );
        assert!(
            exact.is_empty(),
            "a retry of a counted fallback is not forwarded"
        );
        assert_same_but_for_reset(decisions(&responses(&output))[0], first);
        assert_eq!(estimate(&service, "quota"), 2);
        // The id sent with another cost: refused, not forwarded, and nothing counted.
        output.clear();
        handle(
            &service,
            &frames(&[quota_check(5, 3)]),
            &mut output,
            &mut exact,
        );
        assert!(exact.is_empty(), "not forwarded");
        assert!(
            matches!(
                &responses(&output)[0].result,
                Err(Refusal::BadField { field, why })
                    if field == "id" && why.contains("another rule, subject or amount")
            ),
            "{:?}",
            responses(&output)
        );
        assert_eq!(estimate(&service, "quota"), 2);

        // The region's decision of a send that was forwarded while the fallback answered
        // another: the first answer stands.
        let found = service.rules.get("quota").unwrap();
        let key = decide::key(found, "a", clock::wall()).unwrap().to_key();
        let region_decided = |seq| Forwarded {
            ticket: Exact {
                id: seq,
                rule: found.1.clone(),
                key: key.clone(),
                cost: 2,
                check_id: Some(CheckId { session: 9, seq }),
                waiting: None,
                slot: service.exact_room.try_take(),
            },
            late_seq: None,
            result: Ok(Outcome {
                allowed: true,
                count: 40,
            }),
        };
        output.clear();
        service.answer_exact(&mut vec![region_decided(5)], &mut output);
        assert_same_but_for_reset(decisions(&responses(&output))[0], first);

        // The region's decision is remembered too: a retry gets it here.
        output.clear();
        service.answer_exact(&mut vec![region_decided(6)], &mut output);
        let exact_first = decisions(&responses(&output))[0];
        assert_eq!(
            (exact_first.mode, exact_first.estimate),
            (wire::Mode::Exact, 40)
        );
        output.clear();
        handle(
            &service,
            &frames(&[quota_check(6, 2)]),
            &mut output,
            &mut exact,
        );
        assert!(
            exact.is_empty(),
            "a retry of the region's decision is not forwarded"
        );
        assert_same_but_for_reset(decisions(&responses(&output))[0], exact_first);
        // Another id is forwarded as before.
        handle(
            &service,
            &frames(&[quota_check(7, 2)]),
            &mut output,
            &mut exact,
        );
        assert_eq!(exact.len(), 1);
        let again = &service.metrics.client_ids_answered_again;
        assert_eq!(
            again.load(Ordering::Relaxed),
            3,
            "two retries, one late answer"
        );
    }

    /// Answers two sends of one check id, the first timed out while the second waited, and
    /// returns both responses: the first gets no fallback.
    fn answer_two_sends(
        service: &Service,
        answers: &mut Vec<Forwarded<Exact>>,
        output: &mut Vec<u8>,
    ) -> Vec<Response> {
        service.answer_exact(answers, output);
        let both = responses(output);
        assert!(
            matches!(&both[0].result, Err(Refusal::RegionUnavailable { .. })),
            "no fallback while another send waits: {both:?}"
        );
        both
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_send_that_times_out_while_another_of_its_id_waits_gets_no_fallback() {
        let (mut service, _, _) = allowing_service();
        service.forwarder = Some(forwarder_to_nowhere());
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        let twice = frames(&[quota_check(8, 2), quota_check(8, 2)]);
        handle(&service, &twice, &mut output, &mut exact);
        assert_eq!(exact.len(), 2);
        let unavailable = no_answer();
        // The first send's deadline passes; the second is then decided at the region.
        let outcome = Outcome {
            allowed: true,
            count: 30,
        };
        let mut answers: Vec<Forwarded<Exact>> = exact
            .drain(..)
            .zip([Err(unavailable), Ok(outcome)])
            .enumerate()
            .map(|(seq, (ticket, result))| Forwarded {
                ticket,
                // As the forwarder does: a sequence number for a timed-out check alone.
                late_seq: result.is_err().then_some(seq as u64),
                result,
            })
            .collect();
        let both = answer_two_sends(&service, &mut answers, &mut output);
        let decided = decisions(&both[1..])[0];
        assert_eq!((decided.mode, decided.estimate), (wire::Mode::Exact, 30));
        assert_eq!(estimate(&service, "quota"), 0, "nothing counted here");
        let again = service.waiting.add(CheckId { session: 9, seq: 8 });
        assert!(!again.has_company(), "both sends let go of their places");
    }

    /// A send that timed out while another of its id waited got no fallback, but it was
    /// written, and the region may admit it after all: the fallback the other send counted
    /// is then taken back, whichever comes first, as for the send that fell back itself.
    #[tokio::test(flavor = "current_thread")]
    async fn a_fallback_is_taken_back_when_a_send_of_its_id_that_got_none_is_admitted_late() {
        let (mut service, _, _) = allowing_service();
        service.forwarder = Some(forwarder_to_nowhere());
        let unavailable = no_answer();
        // Check id 8's first send was written (sequence number 1) and its deadline passed
        // while the second waited; the second was never written, and its deadline passes
        // too. Then check id 9's the same way (sequence number 2), but the region's late
        // admission of its first send is reported before the two time out: its fallback
        // is taken back as it counts.
        service.late_admissions(&[2]);
        for (check, seq, counted) in [(8, 1, 2), (9, 2, 2)] {
            let (mut output, mut exact) = (Vec::new(), Vec::new());
            let twice = frames(&[quota_check(check, 2), quota_check(check, 2)]);
            handle(&service, &twice, &mut output, &mut exact);
            assert_eq!(exact.len(), 2);
            let mut answers: Vec<Forwarded<Exact>> = (exact.drain(..))
                .zip([Some(seq), None])
                .map(|(ticket, late_seq)| Forwarded {
                    ticket,
                    late_seq,
                    result: Err(unavailable.clone()),
                })
                .collect();
            let both = answer_two_sends(&service, &mut answers, &mut output);
            assert!(decisions(&both[1..])[0].allowed, "the last send falls back");
            assert_eq!(estimate(&service, "quota"), counted);
        }
        // The region admits check id 8's first send after all: it counts the check.
        service.late_admissions(&[1]);
        assert_eq!(
            estimate(&service, "quota"),
            0,
            "each check counted once, at the region"
        );
        service.late_admissions(&[1, 2]);
        assert_eq!(estimate(&service, "quota"), 0, "taken back once");
    }

    /// A send that timed out with no fallback while another of its id waited passed its
    /// sequence number on to that one, whose connection then went: it is let go unanswered.
    /// The next send of the id that falls back takes the number, so the region's late
    /// admission of the first send takes that fallback back.
    #[tokio::test(flavor = "current_thread")]
    async fn a_number_passed_on_to_a_send_let_go_unanswered_goes_to_the_next_that_falls_back() {
        let (mut service, _, _) = allowing_service();
        service.forwarder = Some(forwarder_to_nowhere());
        let unavailable = no_answer();
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        let twice = frames(&[quota_check(8, 2), quota_check(8, 2)]);
        handle(&service, &twice, &mut output, &mut exact);
        let (first, second) = (exact.remove(0), exact.remove(0));
        // The first send was written (sequence number 1) and times out while the second
        // waits: no fallback.
        let timed_out = |ticket, late_seq| Forwarded {
            ticket,
            late_seq,
            result: Err(unavailable.clone()),
        };
        let both = answer_two_sends(&service, &mut vec![timed_out(first, Some(1))], &mut output);
        assert_eq!(both.len(), 1);
        // The second's connection goes: the forwarder lets it go unanswered.
        drop(second);
        // A retry of the id, never written, times out alone and falls back.
        output.clear();
        handle(
            &service,
            &frames(&[quota_check(8, 2)]),
            &mut output,
            &mut exact,
        );
        assert_eq!(exact.len(), 1, "nothing remembered: the retry is forwarded");
        service.answer_exact(&mut vec![timed_out(exact.remove(0), None)], &mut output);
        assert!(decisions(&responses(&output))[0].allowed, "it falls back");
        assert_eq!(estimate(&service, "quota"), 2);
        // The region admits the first send after all: it counts the check.
        service.late_admissions(&[1]);
        assert_eq!(
            estimate(&service, "quota"),
            0,
            "counted once, at the region"
        );
    }

    /// A send that falls back but counts nothing (the key cap refuses its count) leaves the
    /// numbers passed on to it, and its own, to the next send of its id that falls back:
    /// the region may still admit any of those sends, which counts the check.
    #[tokio::test(flavor = "current_thread")]
    async fn a_fallback_that_counted_nothing_leaves_its_numbers_to_the_next_that_falls_back() {
        for admitted_late in [1, 2] {
            let (mut service, _, _) = allowing_service();
            service.forwarder = Some(forwarder_to_nowhere());
            let found = service.rules.get("quota").unwrap();
            let others: Vec<Key> = (0..10)
                .map(|n| {
                    let subject = format!("o{n}");
                    decide::key(found, &subject, clock::wall())
                        .unwrap()
                        .to_key()
                })
                .collect();
            for other in &others {
                service.store.incr(other, 1).unwrap();
            }
            let timed_out = |ticket, late_seq| Forwarded {
                ticket,
                late_seq,
                result: Err(no_answer()),
            };
            let (mut output, mut exact) = (Vec::new(), Vec::new());
            let twice = frames(&[quota_check(8, 2), quota_check(8, 2)]);
            handle(&service, &twice, &mut output, &mut exact);
            let (first, second) = (exact.remove(0), exact.remove(0));
            // The first send was written (sequence number 1) and times out while the second
            // waits: no fallback. The second (2) times out alone, at the key cap.
            answer_two_sends(&service, &mut vec![timed_out(first, Some(1))], &mut output);
            output.clear();
            service.answer_exact(&mut vec![timed_out(second, Some(2))], &mut output);
            assert!(
                matches!(
                    &responses(&output)[0].result,
                    Err(Refusal::RegionUnavailable { .. })
                ),
                "its fallback could not count"
            );
            // A key's window ends. A retry of the id, never written, times out alone and
            // falls back.
            service.store.collect(&mut Vec::new());
            assert!(service.store.remove(&others[0]));
            output.clear();
            handle(
                &service,
                &frames(&[quota_check(8, 2)]),
                &mut output,
                &mut exact,
            );
            service.answer_exact(&mut vec![timed_out(exact.remove(0), None)], &mut output);
            assert!(decisions(&responses(&output))[0].allowed, "it falls back");
            assert_eq!(estimate(&service, "quota"), 2);
            // The region admits one of the first two sends after all: it counts the check.
            service.late_admissions(&[admitted_late]);
            assert_eq!(
                estimate(&service, "quota"),
                0,
                "counted once, at the region, when it admits send {admitted_late}"
            );
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_client_that_has_finished_sending_still_gets_the_answers_of_its_exact_checks() {
        let mut service = service(10);
        service.rules = Rules::new(&[RuleConfig {
            region_timeout_ms: 50,
            ..RuleConfig::for_test("quota", 100, RuleMode::Exact)
        }])
        .unwrap();
        service.forwarder = Some(forwarder_to_nowhere());
        let service = Arc::new(service);
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let serving = tokio::spawn({
            let service = Arc::clone(&service);
            async move { serve_connection(&service, server).await }
        });
        let sent = frames(&[quota_check(5, 2), status(6)]);
        client.write_all(&sent).await.unwrap();
        // A half-close, as `nc -N` makes at the end of its input.
        client.shutdown().await.unwrap();
        let mut output = Vec::new();
        client.read_to_end(&mut output).await.unwrap();
        serving.await.unwrap();
        let responses = responses(&output);
        let ids: Vec<_> = responses.iter().map(|r| r.id).collect();
        assert_eq!(
            ids,
            [6, 5],
            "the exact check's answer comes before the close"
        );
        assert!(matches!(
            &responses[1].result,
            Err(Refusal::RegionUnavailable { rule, .. }) if rule == "quota"
        ));
    }

    /// Over half a megabyte of requests in one write, each answered with a refusal several
    /// times its size, read a frame at a time: all answered, in order (reads are capped at
    /// `READ_BYTES`, and the output gives back its room between batches).
    #[tokio::test(flavor = "current_thread")]
    async fn requests_far_past_one_read_are_all_answered_in_order() {
        let service = Arc::new(service(10));
        let (client, server) = tokio::io::duplex(64 * 1024);
        let serving = tokio::spawn({
            let service = Arc::clone(&service);
            async move { serve_connection(&service, server).await }
        });
        let unknown = |id| Request {
            id,
            op: Op::Get {
                rule: "nope".into(),
                subject: "a".into(),
            },
        };
        let requests: Vec<Request> = (1..=40_000).map(unknown).collect();
        let sent = frames(&requests);
        assert!(sent.len() > 8 * READ_BYTES, "{} bytes", sent.len());
        // Written and read at once: a client that reads nothing until it has written
        // everything waits on the sidecar, which waits for it to read (docs/protocol.md).
        let (mut reading, mut writing) = tokio::io::split(client);
        let written = tokio::spawn(async move {
            writing.write_all(&sent).await.unwrap();
            writing.shutdown().await.unwrap();
        });
        let mut output = Vec::new();
        reading.read_to_end(&mut output).await.unwrap();
        written.await.unwrap();
        serving.await.unwrap();
        let responses = responses(&output);
        let ids: Vec<u64> = responses.iter().map(|response| response.id).collect();
        assert_eq!(ids, (1..=40_000).collect::<Vec<u64>>());
        assert!(responses.iter().all(|response| matches!(
            &response.result,
            Err(Refusal::UnknownRule { rule }) if rule == "nope"
        )));
    }

    /// A service whose exact rule `quota` waits `region_timeout_ms` for a region that never
    /// answers.
    fn service_to_nowhere(region_timeout_ms: u64) -> Service {
        let mut service = service(10);
        service.rules = Rules::new(&[RuleConfig {
            region_timeout_ms,
            ..RuleConfig::for_test("quota", 100, RuleMode::Exact)
        }])
        .unwrap();
        service.forwarder = Some(forwarder_to_nowhere());
        service
    }

    /// [`service_to_nowhere`] with room for `per_connection` exact checks a connection and
    /// `per_node` over all.
    fn rooms_to_nowhere(
        region_timeout_ms: u64,
        per_connection: usize,
        per_node: usize,
    ) -> Arc<Service> {
        let mut service = service_to_nowhere(region_timeout_ms);
        service.exact_in_flight_max = per_connection;
        service.exact_room = Arc::new(ExactRoom::new(per_node));
        Arc::new(service)
    }

    /// `count()` once it has stopped changing: the same over 100 turns of the runtime.
    async fn once_still(count: impl Fn() -> usize) -> usize {
        let (mut last, mut still) = (count(), 0);
        while still < 100 {
            tokio::task::yield_now().await;
            let now = count();
            (last, still) = (now, if now == last { still + 1 } else { 0 });
        }
        last
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_batch_holds_at_the_first_exact_check_without_room_and_answers_the_frames_before() {
        let mut service = service_to_nowhere(60_000);
        service.exact_room = Arc::new(ExactRoom::new(3));
        let input = frames(&[
            quota_check(1, 1),
            incr(2, "a"),
            quota_check(3, 1),
            quota_check(4, 1),
            status(5),
            quota_check(6, 1),
            status(7),
        ]);
        let ids = |exact: &[Exact]| exact.iter().map(|exact| exact.id).collect::<Vec<_>>();
        let answered = |output: &[u8]| responses(output).iter().map(|r| r.id).collect::<Vec<_>>();
        // The connection's room for two.
        let (mut output, mut first) = (Vec::new(), Vec::new());
        let handled = service.handle_frames(&input, &mut output, &mut first, 2, &mut None, 0);
        assert_eq!((ids(&first), answered(&output)), (vec![1, 3], vec![2]));
        assert!(handled.held.is_some() && handled.bad.is_none());
        let rest = &input[handled.consumed..];
        assert_eq!(
            rest,
            frames(&[quota_check(4, 1), status(5), quota_check(6, 1), status(7)])
        );
        // The connection has room, the node one place: the check takes it, the status
        // after it is answered, and the next check is held for want of a place.
        output.clear();
        let mut second = Vec::new();
        let handled = service.handle_frames(rest, &mut output, &mut second, 10, &mut None, 0);
        assert_eq!((ids(&second), answered(&output)), (vec![4], vec![5]));
        assert!(handled.held.is_some());
        let rest = &rest[handled.consumed..];
        assert_eq!(rest, frames(&[quota_check(6, 1), status(7)]));
        assert_eq!(service.exact_room.taken(), 3);
        // A place kept for the held check, once checks answered gave places back, is its.
        drop(first);
        let mut kept = service.exact_room.try_take();
        output.clear();
        let mut third = Vec::new();
        let handled = service.handle_frames(rest, &mut output, &mut third, 10, &mut kept, 0);
        assert_eq!((ids(&third), answered(&output)), (vec![6], vec![7]));
        assert!(kept.is_none(), "the kept place is taken");
        assert_eq!((handled.consumed, handled.held), (rest.len(), None));
        assert_eq!(service.exact_room.taken(), 2);
    }

    /// Serves one connection of `service` on an in-memory stream, which the client half
    /// writes `requests` to and then closes; returns the client's reading half, and the
    /// serving and writing tasks.
    fn connection_sending(
        service: &Arc<Service>,
        requests: &[Request],
    ) -> (
        tokio::io::ReadHalf<tokio::io::DuplexStream>,
        tokio::task::JoinHandle<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let serving = tokio::spawn({
            let service = Arc::clone(service);
            async move { serve_connection(&service, server).await }
        });
        let sent = frames(requests);
        let (reading, mut writing) = tokio::io::split(client);
        let writing = tokio::spawn(async move {
            writing.write_all(&sent).await.unwrap();
            writing.shutdown().await.unwrap();
        });
        (reading, serving, writing)
    }

    /// Exact checks 1 to `checks`, then a status request: less than one read.
    fn checks_then_status(checks: u64) -> Vec<Request> {
        let mut requests: Vec<Request> = (1..=checks).map(|id| quota_check(id, 1)).collect();
        requests.push(status(checks + 1));
        assert!(frames(&requests).len() < READ_BYTES);
        requests
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_connection_takes_exact_checks_up_to_its_room_and_no_more_from_one_read() {
        // The region's timeout is far off: nothing is answered during the test.
        let service = rooms_to_nowhere(600_000, 4, EXACT_WAITING_MAX);
        let (_reading, serving, _writing) = connection_sending(&service, &checks_then_status(10));
        // Until the connection has taken all it will before an answer.
        let waiting = once_still(|| service.waiting.sends()).await;
        assert_eq!(waiting, 4, "the room is taken, and no more");
        serving.abort();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_connection_answers_every_check_held_at_its_room_once_there_is_room() {
        let service = rooms_to_nowhere(50, 4, EXACT_WAITING_MAX);
        let checks = 10;
        let (mut reading, serving, writing) =
            connection_sending(&service, &checks_then_status(checks));
        let mut output = Vec::new();
        let mut chunk = vec![0; 64 * 1024];
        loop {
            let read = reading.read(&mut chunk).await.unwrap();
            assert!(service.waiting.sends() <= 4);
            if read == 0 {
                break;
            }
            output.extend_from_slice(&chunk[..read]);
        }
        writing.await.unwrap();
        serving.await.unwrap();
        let responses = responses(&output);
        let mut ids: Vec<_> = responses.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        assert_eq!(
            ids,
            (1..=checks + 1).collect::<Vec<_>>(),
            "each answered once"
        );
        assert_eq!(service.waiting.sends(), 0);
    }

    /// Reads what a connection answers until it closes, checking the node's room each time.
    async fn read_to_close(
        mut reading: tokio::io::ReadHalf<tokio::io::DuplexStream>,
        service: &Service,
        room_max: usize,
    ) -> Vec<u64> {
        let mut output = Vec::new();
        let mut chunk = vec![0; 64 * 1024];
        loop {
            let read = reading.read(&mut chunk).await.unwrap();
            assert!(service.exact_room.taken() <= room_max);
            if read == 0 {
                break;
            }
            output.extend_from_slice(&chunk[..read]);
        }
        let mut ids: Vec<_> = responses(&output).iter().map(|r| r.id).collect();
        ids.sort_unstable();
        ids
    }

    #[tokio::test(flavor = "current_thread")]
    async fn connections_together_take_no_more_exact_checks_than_the_nodes_room() {
        // The region's timeout is far off: nothing is answered during the test.
        let service = rooms_to_nowhere(600_000, 4, 6);
        let first = connection_sending(&service, &checks_then_status(10));
        let second = connection_sending(&service, &checks_then_status(10));
        let taken = once_still(|| service.exact_room.taken()).await;
        assert_eq!(taken, 6, "the node's room is taken, and no more");
        assert_eq!(service.waiting.sends(), 6);
        assert!(service.exact_room.full() >= 1, "the full room is counted");
        first.1.abort();
        second.1.abort();
        // Their checks are dropped with their connections, and give the room back.
        while service.exact_room.taken() > 0 {
            tokio::task::yield_now().await;
        }
    }

    /// Reads answers from `reading` until it has `count` of them; their ids, in order.
    async fn read_answers(
        reading: &mut tokio::io::ReadHalf<tokio::io::DuplexStream>,
        count: usize,
    ) -> Vec<u64> {
        let answers = read_responses(reading, count).await;
        answers.iter().map(|answer| answer.id).collect()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_full_node_room_holds_only_exact_checks_and_the_frames_after_them() {
        // The region's timeout is far off: nothing is answered by the region.
        let service = rooms_to_nowhere(600_000, EXACT_IN_FLIGHT_MAX, 4);
        let (_filling_reading, filling, _filling_writing) =
            connection_sending(&service, &checks_then_status(4));
        while service.exact_room.taken() < 4 {
            tokio::task::yield_now().await;
        }
        // Another connection's requests are answered up to its exact check, which waits
        // for a place with the frames after it.
        let requests = [status(1), incr(2, "a"), quota_check(3, 1), status(4)];
        let (mut reading, serving, _writing) = connection_sending(&service, &requests);
        assert_eq!(read_answers(&mut reading, 2).await, [1, 2]);
        assert_eq!(service.exact_room.taken(), 4);
        // Places given back (the first connection gone, its checks dropped): the check
        // takes one, and the status after it is answered.
        filling.abort();
        assert_eq!(read_answers(&mut reading, 1).await, [4]);
        assert_eq!(service.exact_room.taken(), 1);
        assert!(service.exact_room.full() >= 1, "the hold is counted");
        serving.abort();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_connection_held_at_the_nodes_room_answers_every_check_once_room_is_freed() {
        let service = rooms_to_nowhere(50, 4, 4);
        let checks = 10;
        let (first, first_serving, first_writing) =
            connection_sending(&service, &checks_then_status(checks));
        let (second, second_serving, second_writing) =
            connection_sending(&service, &checks_then_status(checks));
        let both = async {
            tokio::join!(
                read_to_close(first, &service, 4),
                read_to_close(second, &service, 4)
            )
        };
        let (first, second) = tokio::time::timeout(std::time::Duration::from_secs(30), both)
            .await
            .expect("both connections are answered and close");
        for task in [first_writing, first_serving, second_writing, second_serving] {
            task.await.unwrap();
        }
        let all: Vec<u64> = (1..=checks + 1).collect();
        assert_eq!((first, second), (all.clone(), all), "each answered once");
        assert_eq!(service.exact_room.taken(), 0);
        assert!(service.exact_room.full() >= 1);
    }

    /// [`rooms_to_nowhere`] with a second exact rule, `fast`, whose timeout is 100 ms, where
    /// `quota`'s is far off.
    fn slow_and_fast_to_nowhere(per_connection: usize, per_node: usize) -> Arc<Service> {
        let mut service = service_to_nowhere(600_000);
        service.rules = Rules::new(&[
            RuleConfig {
                region_timeout_ms: 600_000,
                ..RuleConfig::for_test("quota", 100, RuleMode::Exact)
            },
            RuleConfig {
                region_timeout_ms: 100,
                ..RuleConfig::for_test("fast", 100, RuleMode::Exact)
            },
        ])
        .unwrap();
        service.exact_in_flight_max = per_connection;
        service.exact_room = Arc::new(ExactRoom::new(per_node));
        Arc::new(service)
    }

    fn fast_check(id: u64) -> Request {
        Request {
            id,
            op: Op::Check {
                rule: "fast".into(),
                subject: "a".into(),
                cost: 1,
                id: None,
            },
        }
    }

    fn unavailable(service: &Service) -> u64 {
        let forwarder = service.forwarder.as_ref().unwrap();
        forwarder.stats().unavailable.load(Ordering::Relaxed)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_check_held_for_the_nodes_room_gets_its_own_rules_timeout() {
        let service = slow_and_fast_to_nowhere(EXACT_IN_FLIGHT_MAX, 1);
        let (_slow_reading, slow, _slow_writing) =
            connection_sending(&service, &[quota_check(1, 1)]);
        while service.exact_room.taken() < 1 {
            tokio::task::yield_now().await;
        }
        // Held for want of the node's one place, which `quota`'s check holds for 600 s: the
        // check is answered at its own rule's 100 ms, never forwarded, and the frame after
        // it read.
        let (mut reading, serving, _writing) =
            connection_sending(&service, &[fast_check(2), status(3)]);
        assert_eq!(read_answers(&mut reading, 2).await, [2, 3]);
        assert_eq!(unavailable(&service), 1);
        assert_eq!(service.exact_room.taken(), 1, "the slow check still waits");
        slow.abort();
        serving.abort();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_check_held_for_its_connections_room_gets_its_own_rules_timeout() {
        let service = slow_and_fast_to_nowhere(1, EXACT_WAITING_MAX);
        let requests = [quota_check(1, 1), fast_check(2), status(3), fast_check(4)];
        let (mut reading, serving, _writing) = connection_sending(&service, &requests);
        // Each fast check, held behind the slow one, at its own 100 ms from when the hold
        // began.
        assert_eq!(read_answers(&mut reading, 3).await, [2, 3, 4]);
        assert_eq!(unavailable(&service), 2);
        assert_eq!(service.waiting.sends(), 1, "the slow check still waits");
        serving.abort();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_check_held_for_room_waits_its_rules_timeout_from_its_read_not_from_the_room() {
        let mut service = service_to_nowhere(1_000);
        service.rules = Rules::new(&[
            RuleConfig {
                region_timeout_ms: 1_000,
                ..RuleConfig::for_test("quota", 100, RuleMode::Exact)
            },
            RuleConfig {
                region_timeout_ms: 1_200,
                ..RuleConfig::for_test("fast", 100, RuleMode::Exact)
            },
        ])
        .unwrap();
        service.exact_room = Arc::new(ExactRoom::new(1));
        let service = Arc::new(service);
        let (_first_reading, first, _first_writing) =
            connection_sending(&service, &[quota_check(1, 1)]);
        while service.exact_room.taken() < 1 {
            tokio::task::yield_now().await;
        }
        // Held for the node's one place until `quota`'s check gives it back at its 1 s, then
        // forwarded with what is left of its own 1.2 s: answered at 1.2 s from its read,
        // where counting its timeout from the place (as before) answered it at 2.2 s.
        let sent = Instant::now();
        let (mut reading, serving, _writing) = connection_sending(&service, &[fast_check(2)]);
        let mut output = Vec::new();
        let mut chunk = vec![0; 64 * 1024];
        while responses(&output).is_empty() {
            let read = reading.read(&mut chunk).await.unwrap();
            assert!(read > 0, "the connection closed");
            output.extend_from_slice(&chunk[..read]);
        }
        let waited = sent.elapsed();
        let response = &responses(&output)[0];
        assert_eq!(response.id, 2);
        assert!(matches!(
            &response.result,
            Err(Refusal::RegionUnavailable { rule, .. }) if rule == "fast"
        ));
        assert!(
            waited >= Duration::from_millis(1_200) && waited < Duration::from_millis(2_000),
            "answered {waited:?} after it was sent"
        );
        assert_eq!(unavailable(&service), 2, "both checks timed out");
        first.abort();
        serving.abort();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_client_that_stops_reading_holds_neither_its_check_ids_nor_the_nodes_room() {
        let service = Arc::new(service_to_nowhere(50));
        // A pipe too small for the answers: the client reads nothing until the end.
        let (client, server) = tokio::io::duplex(256);
        let serving = tokio::spawn({
            let service = Arc::clone(&service);
            async move { serve_connection(&service, server).await }
        });
        let mut requests: Vec<Request> = (1..=4).map(|id| quota_check(id, 1)).collect();
        requests.extend((5..=40).map(|id| incr(id, "a")));
        let sent = frames(&requests);
        let (mut reading, mut writing) = tokio::io::split(client);
        let writing = tokio::spawn(async move {
            writing.write_all(&sent).await.unwrap();
            writing.shutdown().await.unwrap();
        });
        while service.exact_room.taken() < 4 {
            tokio::task::yield_now().await;
        }
        // The checks time out unanswered at the region and are decided here, though their
        // answers cannot be written yet.
        let decided = async {
            while service.waiting.sends() > 0 || service.exact_room.taken() > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), decided)
            .await
            .expect("the checks' ids and room are given back while the client does not read");
        let mut output = Vec::new();
        reading.read_to_end(&mut output).await.unwrap();
        writing.await.unwrap();
        serving.await.unwrap();
        let mut ids: Vec<_> = responses(&output).iter().map(|r| r.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, (1..=40).collect::<Vec<_>>(), "each answered once");
    }

    /// Serves one connection of `service` on an in-memory stream, which the client half
    /// writes `requests` to and keeps open (an idle client); returns the client's halves
    /// and the serving task.
    fn connection_open(
        service: &Arc<Service>,
        requests: &[Request],
    ) -> (
        tokio::io::ReadHalf<tokio::io::DuplexStream>,
        tokio::io::WriteHalf<tokio::io::DuplexStream>,
        tokio::task::JoinHandle<()>,
    ) {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let serving = tokio::spawn({
            let service = Arc::clone(service);
            async move { serve_connection(&service, server).await }
        });
        let (reading, mut writing) = tokio::io::split(client);
        let sent = frames(requests);
        // The pipe holds it all: written at once, without a task.
        assert!(sent.len() < 64 * 1024);
        let mut written = std::pin::pin!(writing.write_all(&sent));
        let waker = std::task::Waker::noop();
        let ready =
            std::future::Future::poll(written.as_mut(), &mut std::task::Context::from_waker(waker));
        assert!(ready.is_ready());
        (reading, writing, serving)
    }

    /// Reads `count` answers from `reading`.
    async fn read_responses(
        reading: &mut tokio::io::ReadHalf<tokio::io::DuplexStream>,
        count: usize,
    ) -> Vec<Response> {
        let (mut output, mut chunk) = (Vec::new(), vec![0; 64 * 1024]);
        let read = async {
            while responses(&output).len() < count {
                let read = reading.read(&mut chunk).await.unwrap();
                assert!(read > 0, "the connection closed");
                output.extend_from_slice(&chunk[..read]);
            }
        };
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("the answers come");
        responses(&output)
    }

    /// An exact check of `rule` without a check id.
    fn check_of(rule: &str, id: u64) -> Request {
        Request {
            id,
            op: Op::Check {
                rule: rule.into(),
                subject: "a".into(),
                cost: 1,
                id: None,
            },
        }
    }

    /// Why `response` is `RegionUnavailable`.
    fn unavailable_why(response: &Response) -> &str {
        match &response.result {
            Err(Refusal::RegionUnavailable { why, .. }) => why,
            other => panic!("not unavailable: {other:?}"),
        }
    }

    /// A check held for room, given a place, then answered from memory
    /// (a retry of an id this sidecar decided) must not keep that place while its
    /// connection idles.
    #[tokio::test(flavor = "current_thread")]
    async fn a_held_check_answered_from_memory_gives_back_the_place_it_was_given() {
        let mut service = service_to_nowhere(50);
        service.rules = Rules::new(&[
            RuleConfig {
                region_timeout_ms: 50,
                on_region_unavailable: OnRegionUnavailable::Allow,
                ..RuleConfig::for_test("quota", 100, RuleMode::Exact)
            },
            RuleConfig {
                region_timeout_ms: 50,
                ..RuleConfig::for_test("plain", 100, RuleMode::Exact)
            },
        ])
        .unwrap();
        // Room for one check a connection, and one in the node.
        service.exact_in_flight_max = 1;
        service.exact_room = Arc::new(ExactRoom::new(1));
        let service = Arc::new(service);
        // A check, and 20 ms later its retry under its id on the same connection: the
        // retry is held for the connection's room. The first times out and falls back
        // (admitted, counted, remembered); the retry, given the place the first gave back,
        // is answered from memory, never forwarded.
        let (mut reading, mut writing, serving) = connection_open(&service, &[quota_check(5, 2)]);
        while service.waiting.sends() < 1 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        writing
            .write_all(&frames(&[quota_check(5, 2)]))
            .await
            .unwrap();
        let both = read_responses(&mut reading, 2).await;
        let decided = decisions(&both);
        assert_eq!(decided.len(), 2, "{both:?}");
        assert_eq!(
            (decided[0].mode, decided[0].allowed),
            (wire::Mode::RegionFallback, true)
        );
        assert_eq!(
            service
                .metrics
                .client_ids_answered_again
                .load(Ordering::Relaxed),
            1,
            "the retry answered from memory"
        );
        // The connection idles with no check waiting: it holds no place.
        let taken = once_still(|| service.exact_room.taken()).await;
        assert_eq!(service.waiting.sends(), 0, "no check waits");
        assert_eq!(
            taken, 0,
            "a place kept by an idle connection, with no check held"
        );
        // So another connection's check is forwarded (and times out at the region), not
        // held for want of a place and answered without having been sent.
        let (mut other, _other_writing, other_serving) =
            connection_open(&service, &[check_of("plain", 7)]);
        let answer = read_responses(&mut other, 1).await;
        assert_eq!(unavailable_why(&answer[0]), "no answer within 50 ms");
        serving.abort();
        other_serving.abort();
    }

    /// A connection kept open: its client's halves, and its serving task, aborted when
    /// dropped.
    struct Open {
        _reading: tokio::io::ReadHalf<tokio::io::DuplexStream>,
        _writing: tokio::io::WriteHalf<tokio::io::DuplexStream>,
        serving: tokio::task::JoinHandle<()>,
    }

    impl Drop for Open {
        fn drop(&mut self) {
            self.serving.abort();
        }
    }

    /// A service whose node's room holds two exact checks, one of them taken for 600 s by
    /// another connection (returned: it holds its place while kept), with the exact rules
    /// `quota` (600 s), `fast` (100 ms) and `other`, of the timeout in ms given.
    async fn a_room_of_two_one_taken(other: (&str, u64)) -> (Arc<Service>, Open) {
        let mut service = service_to_nowhere(600_000);
        let rule = |name, region_timeout_ms| RuleConfig {
            region_timeout_ms,
            ..RuleConfig::for_test(name, 100, RuleMode::Exact)
        };
        let rules = [
            rule("quota", 600_000),
            rule("fast", 100),
            rule(other.0, other.1),
        ];
        service.rules = Rules::new(&rules).unwrap();
        service.exact_room = Arc::new(ExactRoom::new(2));
        let service = Arc::new(service);
        let (reading, writing, filling) = connection_open(&service, &[check_of("quota", 1)]);
        while service.exact_room.taken() < 1 {
            tokio::task::yield_now().await;
        }
        let filling = Open {
            _reading: reading,
            _writing: writing,
            serving: filling,
        };
        (service, filling)
    }

    /// Places given back go to the connections waiting in the order they
    /// asked, whatever else a waiting connection does meanwhile (here: its own forwarded
    /// check answered).
    #[tokio::test(flavor = "current_thread")]
    async fn a_connection_waiting_for_a_place_keeps_its_turn_while_its_checks_are_answered() {
        let (service, _filling) = a_room_of_two_one_taken(("medium", 400)).await;
        // A takes the other place with a 100 ms check, and waits for one for the next:
        // A asks first.
        let (_a_reading, _a_writing, a) =
            connection_open(&service, &[check_of("fast", 2), quota_check(3, 1)]);
        while service.exact_room.full() < 1 {
            tokio::task::yield_now().await;
        }
        once_still(|| 0).await;
        // B waits for a place too, after A.
        let (mut b_reading, _b_writing, b) = connection_open(&service, &[check_of("medium", 4)]);
        while service.exact_room.full() < 2 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            service.waiting.sends(),
            0,
            "no check with an id forwarded yet"
        );
        // At 100 ms A's fast check times out and gives its place back: it is A's, which
        // asked first. So B's check, still held at its 400 ms, is answered unsent.
        let answer = read_responses(&mut b_reading, 1).await;
        assert_eq!(
            unavailable_why(&answer[0]),
            "no room to forward it within 400 ms",
            "B's check took the place A asked for first"
        );
        for task in [a, b] {
            task.abort();
        }
    }

    /// A connection whose client has stopped reading keeps no place of the node's room.
    /// Its request for a place (`asking`) is kept across turns, but while the connection
    /// waits to write an answer it is not polled: a place given back was granted to it all
    /// the same and held, unused, for as long as the client did not read, and another
    /// connection's check was answered without ever being sent (found in review, session
    /// 47).
    #[tokio::test(flavor = "current_thread")]
    async fn a_client_that_stops_reading_keeps_no_place_granted_to_its_request() {
        let (service, _filling) = a_room_of_two_one_taken(("plain", 300)).await;
        // C: a pipe of 16 bytes each way. Its client sends a status, a 100 ms check (which
        // takes the last place) and a 600 s one (held for a place); it reads the status's
        // answer, then stops reading.
        let (client, server) = tokio::io::duplex(16);
        let c = tokio::spawn({
            let service = Arc::clone(&service);
            async move { serve_connection(&service, server).await }
        });
        let (mut c_reading, mut c_writing) = tokio::io::split(client);
        let sent = frames(&[status(2), check_of("fast", 3), check_of("quota", 4)]);
        let c_writer = tokio::spawn(async move {
            c_writing.write_all(&sent).await.unwrap();
            c_writing
        });
        let status_answer = read_responses(&mut c_reading, 1).await;
        assert_eq!(status_answer[0].id, 2);
        while service.exact_room.full() < 1 {
            tokio::task::yield_now().await;
        }
        // The 100 ms check times out; its answer does not fit in the pipe C's client does
        // not read. Its place is given back.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let taken = once_still(|| service.exact_room.taken()).await;
        eprintln!("places taken with one check waiting at the region: {taken}");
        // D's check, asked after that: a place is free (no check but F's uses one), so it
        // is forwarded, and times out at the region; not held and answered unsent.
        let (mut d_reading, _d_writing, d) = connection_open(&service, &[check_of("plain", 5)]);
        let answer = read_responses(&mut d_reading, 1).await;
        assert_eq!(
            unavailable_why(&answer[0]),
            "no answer within 300 ms",
            "D's check was never sent: the free place is held by C, whose client does not \
             read (places taken: {taken}, checks waiting at the region: 1)"
        );
        for task in [c, d] {
            task.abort();
        }
        drop(c_writer);
    }

    #[tokio::test]
    async fn both_listeners_serve_and_both_stop_with_the_serving_task() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let tcp_addr = tcp.local_addr().unwrap();
        let path = std::env::temp_dir().join(format!(
            "tally-listener-{}-{}.sock",
            std::process::id(),
            clock::wall_micros()
        ));
        let unix = UnixListener::bind(&path).unwrap();
        let serving = tokio::spawn(serve(Arc::new(service(10)), tcp, Some(unix), 4));
        let endpoints = [
            tally_client::Endpoint::Tcp(tcp_addr),
            tally_client::Endpoint::Unix(path.clone()),
        ];
        for (i, endpoint) in endpoints.into_iter().enumerate() {
            let client = tally_client::Client::connect(endpoint, Default::default())
                .await
                .unwrap();
            let counted = client.incr("count", "both", 1).await.unwrap();
            assert_eq!(counted.estimate, i as i128 + 1);
        }
        serving.abort();
        assert!(serving.await.unwrap_err().is_cancelled());
        // Neither accept loop outlives the task: an accept loop in a task of its own would
        // go on accepting.
        assert!(tokio::net::UnixStream::connect(&path).await.is_err());
        assert!(tokio::net::TcpStream::connect(tcp_addr).await.is_err());
        let _ = std::fs::remove_file(&path);
    }

    /// A client that pipelines past a bad frame (frames it sent after it, which the
    /// sidecar never reads) still gets every answer before it and the `Malformed` one,
    /// then the close: a socket closed with bytes unread resets the connection, and the
    /// answers still queued to be sent are dropped with it.
    #[tokio::test(flavor = "current_thread")]
    async fn the_answers_before_a_bad_frame_reach_a_client_that_sent_more_after_it() {
        let service = Arc::new(service(10));
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let serving = tokio::spawn(serve(Arc::clone(&service), tcp, None, 4));
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        // A client's receive buffer smaller than the answers: some wait in the sidecar's.
        socket.set_recv_buffer_size(4096).unwrap();
        let stream = socket.connect(addr).await.unwrap();
        let requests: Vec<Request> = (1..=2_000).map(|id| incr(id, "a")).collect();
        let mut sent = frames(&requests);
        sent.extend_from_slice(&u32::MAX.to_le_bytes());
        // More after the bad frame than one read takes: never read by the sidecar.
        sent.extend(std::iter::repeat_n(0, 2 * READ_BYTES));
        let (mut reading, mut writing) = stream.into_split();
        // The client closes its side once it has sent everything: the sidecar's drain then
        // ends at that close, not at its time limit.
        let writer = tokio::spawn(async move {
            let _ = writing.write_all(&sent).await;
        });
        while estimate(&service, "count") < 2_000 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut output = Vec::new();
        let mut chunk = vec![0; 64 * 1024];
        let ended = loop {
            match reading.read(&mut chunk).await {
                Ok(0) => break Ok(()),
                Ok(read) => output.extend_from_slice(&chunk[..read]),
                Err(err) => break Err(err),
            }
        };
        let mut answers = Vec::new();
        let mut rest = &output[..];
        while let Ok(Some((body, len))) = next_frame(rest) {
            answers.push(wire::decode_body::<Response>(body).unwrap());
            rest = &rest[len..];
        }
        let ids: Vec<u64> = answers.iter().map(|response| response.id).collect();
        let expected: Vec<u64> = (1..=2_000).chain([0]).collect();
        assert!(
            ids == expected && ended.is_ok(),
            "{} of the 2,001 answers came ({} bytes, the last id {:?}), and then {:?}",
            ids.len(),
            output.len(),
            ids.last(),
            ended
        );
        writer.await.unwrap();
        serving.abort();
    }

    #[test]
    fn a_partial_frame_is_left_for_the_next_read() {
        let service = service(10);
        let input = frames(&[status(1), status(2), status(3)]);
        let whole = frames(&[status(1), status(2)]).len();
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        let handled = handle(&service, &input[..input.len() - 1], &mut output, &mut exact);
        assert_eq!(
            handled,
            Handled {
                consumed: whole,
                bad: None,
                held: None,
                full: false,
            }
        );
        let ids: Vec<_> = responses(&output).iter().map(|r| r.id).collect();
        assert_eq!(ids, [1, 2]);
    }

    /// A batch stops once its answers pass `OUTPUT_KEPT_BYTES`, its other frames left for
    /// after they are written; none is lost or answered twice (from review, session 46).
    #[test]
    fn a_batch_stops_once_its_answers_pass_the_room_kept_and_the_rest_waits() {
        let service = service(10);
        let unknown = |id| Request {
            id,
            op: Op::Get {
                rule: "nope".into(),
                subject: "a".into(),
            },
        };
        let input = frames(&(1..=20_000).map(unknown).collect::<Vec<_>>());
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        let mut rest = &input[..];
        let mut ids = Vec::new();
        let mut batches = 0;
        while !rest.is_empty() {
            output.clear();
            let handled = handle(&service, rest, &mut output, &mut exact);
            assert_eq!((handled.bad, handled.held), (None, None));
            assert!(handled.consumed > 0, "each batch answers something");
            let answers = responses(&output);
            let one = output.len() / answers.len();
            assert!(
                output.len() < OUTPUT_KEPT_BYTES + one,
                "{} bytes",
                output.len()
            );
            rest = &rest[handled.consumed..];
            assert_eq!(handled.full, !rest.is_empty());
            ids.extend(answers.iter().map(|response| response.id));
            batches += 1;
        }
        assert_eq!(ids, (1..=20_000).collect::<Vec<u64>>());
        assert!(batches > 1, "the answers passed the room kept: {batches}");
    }

    #[test]
    fn an_oversized_or_garbage_frame_stops_the_batch_with_an_error_after_the_good_ones() {
        let service = service(10);
        let mut input = frames(&[status(1)]);
        let good = input.len();
        input.extend_from_slice(&u32::MAX.to_le_bytes());
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        let handled = handle(&service, &input, &mut output, &mut exact);
        assert_eq!(handled.consumed, good);
        assert!(handled.bad.unwrap().contains("limit"));
        assert_eq!(responses(&output).len(), 1, "the good frame is answered");

        let garbage = [3, 0, 0, 0, 1, 0xff, 0xff];
        output.clear();
        let handled = handle(&service, &garbage, &mut output, &mut exact);
        assert_eq!(handled.consumed, 0);
        assert!(handled.bad.is_some() && output.is_empty());
    }

    /// A service whose one rule, `quota`, is exact and falls back to `allow`; the rule, and
    /// its key for subject `a`.
    /// Gives `service` a forwarder to a region on this node, whose side of the sessions is
    /// returned: it gets each frame of checks written, and answers through the frame's
    /// reply. Admissions the region answers late are reported to `late`.
    fn forward_to_a_local_region(
        service: &mut Service,
        late: crate::region::forward::LateAdmissions,
    ) -> mpsc::Receiver<crate::transport::SessionFrame> {
        let (frames, to_region) = mpsc::channel(8);
        let sessions = crate::transport::Sessions {
            frames,
            frame_bytes_max: crate::region::wire::REGION_FRAME_BYTES_MAX,
        };
        service.forwarder = Some(Forwarder::local(
            sessions,
            service.replica,
            crate::clock::Clock::start(),
            Arc::default(),
            late,
        ));
        to_region
    }

    /// What the forwarder answers a check of rule `quota` the region did not answer in time.
    fn no_answer() -> Refusal {
        Refusal::RegionUnavailable {
            rule: "quota".into(),
            why: "no answer".into(),
        }
    }

    /// The forwarder's `result` for a check of `key` under `rule`, cost 1, sent under check
    /// id (1, 2) and never written.
    fn sent_under_an_id(
        service: &Service,
        rule: &Arc<RuleConfig>,
        key: &Key,
        result: Result<Outcome, Refusal>,
    ) -> Forwarded<Exact> {
        Forwarded {
            ticket: Exact {
                id: 7,
                rule: rule.clone(),
                key: key.clone(),
                cost: 1,
                check_id: Some(CheckId { session: 1, seq: 2 }),
                waiting: None,
                slot: service.exact_room.try_take(),
            },
            late_seq: None,
            result,
        }
    }

    fn allowing_service() -> (Service, Arc<RuleConfig>, Key) {
        falling_back_to(crate::config::OnRegionUnavailable::Allow)
    }

    /// A service whose exact rule `quota` falls back to `fallback`, the rule, and the key
    /// of subject `a` in its window now.
    fn falling_back_to(
        fallback: crate::config::OnRegionUnavailable,
    ) -> (Service, Arc<RuleConfig>, Key) {
        let mut service = service(10);
        let rule = RuleConfig {
            on_region_unavailable: fallback,
            ..RuleConfig::for_test("quota", 100, RuleMode::Exact)
        };
        service.rules = Rules::new(&[rule]).unwrap();
        let found = service.rules.get("quota").unwrap();
        let rule = found.1.clone();
        let key = decide::key(found, "a", clock::wall()).unwrap().to_key();
        (service, rule, key)
    }

    #[test]
    fn a_fallback_for_a_check_whose_window_is_over_counts_nothing_and_is_unavailable() {
        let (service, rule, live) = allowing_service();
        let found = service.rules.get("quota").unwrap();
        let a_day_ago = tally_crdt::Stamp(clock::wall().0 - 86_400_000);
        let ended = decide::key(found, "a", a_day_ago).unwrap().to_key();
        let unavailable = no_answer();
        let mut output = Vec::new();
        for key in [&ended, &live] {
            let mut answers = vec![Forwarded {
                ticket: Exact {
                    id: 7,
                    rule: rule.clone(),
                    key: key.clone(),
                    cost: 3,
                    check_id: None,
                    waiting: None,
                    slot: service.exact_room.try_take(),
                },
                late_seq: None,
                result: Err(unavailable.clone()),
            }];
            service.answer_exact(&mut answers, &mut output);
        }
        let responses = responses(&output);
        assert_eq!(
            responses[0].result,
            Err(unavailable),
            "the window that is over"
        );
        assert_eq!(
            service.store.own(&ended),
            tally_crdt::Lane::default(),
            "nothing counted in it"
        );
        let decided = decisions(&responses[1..])[0];
        assert!(decided.allowed, "the live window's fallback admits");
        assert_eq!(service.store.own(&live), tally_crdt::Lane::new(3, 0));
    }

    #[test]
    fn a_forgotten_check_id_is_refused_whatever_the_rule_falls_back_to() {
        let (service, rule, key) = allowing_service();
        let answer = |result| sent_under_an_id(&service, &rule, &key, result);
        let unavailable = no_answer();
        let forgotten = Refusal::Forgotten {
            rule: "quota".into(),
        };
        let mut forwarded = vec![answer(Err(unavailable)), answer(Err(forgotten.clone()))];
        let mut output = Vec::new();
        service.answer_exact(&mut forwarded, &mut output);
        let responses = responses(&output);
        // A region that did not answer: the rule's fallback decides (and counts) it.
        assert!(matches!(
            &responses[0].result,
            Ok(Reply::Decision(decision)) if decision.mode == wire::Mode::RegionFallback
        ));
        // A region that decided it once already: refused, never decided here again.
        assert_eq!(responses[1].result, Err(forgotten));
    }

    /// A fallback that counted nothing (a `deny` rule's) is not remembered under its id, so
    /// a send again may reach the region (README.md, docs/protocol.md "Check ids"): it gets
    /// the region's decision, not the first send's denial.
    #[test]
    fn a_fallback_that_counted_nothing_is_not_remembered_and_a_send_again_gets_the_regions_decision(
    ) {
        let (service, rule, key) = falling_back_to(crate::config::OnRegionUnavailable::Deny);
        let send = |result| sent_under_an_id(&service, &rule, &key, result);
        let unavailable = no_answer();
        let admitted = Outcome {
            allowed: true,
            count: 1,
        };
        let mut output = Vec::new();
        service.answer_exact(&mut vec![send(Err(unavailable))], &mut output);
        service.answer_exact(&mut vec![send(Ok(admitted))], &mut output);
        let decided: Vec<_> = (decisions(&responses(&output)).iter())
            .map(|decision| (decision.mode, decision.allowed))
            .collect();
        assert_eq!(
            decided,
            [
                (wire::Mode::RegionFallback, false),
                (wire::Mode::Exact, true)
            ],
            "the denial, then the region's admission"
        );
    }

    #[test]
    fn a_stopping_node_counts_no_fallback_and_answers_the_region_unavailable() {
        let (service, rule, key) = allowing_service();
        let unavailable = no_answer();
        let answer = |id| Forwarded {
            ticket: Exact {
                id,
                rule: rule.clone(),
                key: key.clone(),
                cost: 3,
                check_id: None,
                waiting: None,
                slot: service.exact_room.try_take(),
            },
            late_seq: Some(id),
            result: Err(unavailable.clone()),
        };
        let mut output = Vec::new();
        service.answer_exact(&mut vec![answer(1)], &mut output);
        assert!(matches!(
            &responses(&output)[0].result,
            Ok(Reply::Decision(decision)) if decision.allowed
        ));
        assert_eq!(service.store.estimate(&key), 3, "the fallback counted");

        service.closing.store(true, Ordering::Relaxed);
        output.clear();
        service.answer_exact(&mut vec![answer(2)], &mut output);
        assert_eq!(responses(&output)[0].result, Err(unavailable.clone()));
        assert_eq!(service.store.estimate(&key), 3, "nothing more counted");
    }

    #[test]
    fn a_fallback_counted_for_a_check_the_region_admitted_late_is_taken_back_once() {
        let (service, rule, key) = allowing_service();
        let unavailable = |seq| Forwarded {
            ticket: Exact {
                id: seq,
                rule: rule.clone(),
                key: key.clone(),
                cost: 3,
                check_id: None,
                waiting: None,
                slot: service.exact_room.try_take(),
            },
            late_seq: Some(seq),
            result: Err(no_answer()),
        };
        let allowed = |output: &[u8]| {
            matches!(
                &responses(output)[..],
                [Response { result: Ok(Reply::Decision(decision)), .. }] if decision.allowed
            )
        };
        let mut output = Vec::new();
        service.answer_exact(&mut vec![unavailable(1)], &mut output);
        assert!(allowed(&output));
        assert_eq!(service.store.estimate(&key), 3, "the fallback counted");
        service.late_admissions(&[1]);
        assert_eq!(
            service.store.estimate(&key),
            0,
            "taken back: the region counts it"
        );
        service.late_admissions(&[1]);
        assert_eq!(service.store.estimate(&key), 0, "taken back once");

        // The region's late admission reported before the fallback counts.
        service.late_admissions(&[2]);
        output.clear();
        service.answer_exact(&mut vec![unavailable(2)], &mut output);
        assert!(
            allowed(&output),
            "the caller still gets the fallback's answer"
        );
        assert_eq!(service.store.estimate(&key), 0, "counted and taken back");
        assert_eq!(
            service.metrics.fallbacks_taken_back.load(Ordering::Relaxed),
            2
        );

        // A check whose fallback counted, and no late admission: it stays counted.
        output.clear();
        service.answer_exact(&mut vec![unavailable(3)], &mut output);
        service.late_admissions(&[4]);
        assert_eq!(service.store.estimate(&key), 3);
    }

    /// A fallback counted while its window was live, whose window is over by the time the
    /// region's late admission is reported: its lanes are being dropped everywhere, so
    /// nothing is taken back (a decrement would begin the key again in this node's lane).
    #[test]
    fn a_fallback_whose_window_is_over_is_not_taken_back_when_the_region_admits_it_late() {
        let (service, _, _) = allowing_service();
        let found = service.rules.get("quota").unwrap();
        let a_day_ago = tally_crdt::Stamp(clock::wall().0 - 86_400_000);
        let ended = decide::key(found, "a", a_day_ago).unwrap().to_key();
        // As the fallback left it, counted in the window then live.
        service.store.incr(&ended, 3).unwrap();
        assert!(!service.late_lock().counted(&[1], ended.clone(), 3));
        service.late_admissions(&[1]);
        assert_eq!(
            service.store.own(&ended),
            tally_crdt::Lane::new(3, 0),
            "nothing taken back"
        );
        assert_eq!(
            service.metrics.fallbacks_taken_back.load(Ordering::Relaxed),
            0
        );
    }

    /// A written send of a check id whose connection went (its client reset it) may still
    /// be decided at the region: until its deadline it counts as waiting, so a retry of the
    /// id that gets no answer in time falls back to nothing (found in review, session 44:
    /// the forwarder dropped it, and the retry's fallback counted beside the region's late
    /// admission, which nothing reported).
    #[tokio::test(flavor = "current_thread")]
    async fn a_written_send_whose_connection_went_still_keeps_a_retry_of_its_id_from_falling_back()
    {
        use crate::region::wire::{self as region_wire, ExactAnswer};
        let mut service = service(10);
        service.rules = Rules::new(&[RuleConfig {
            region_timeout_ms: 200,
            on_region_unavailable: crate::config::OnRegionUnavailable::Allow,
            ..RuleConfig::for_test("quota", 100, RuleMode::Exact)
        }])
        .unwrap();
        let (late, mut late_reported) = mpsc::unbounded_channel();
        let mut to_region = forward_to_a_local_region(&mut service, late);
        // Connection 1 sends check id (9, 5); it is written to the region.
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        handle(
            &service,
            &frames(&[quota_check(5, 2)]),
            &mut output,
            &mut exact,
        );
        let (answers1, answered1) = mpsc::unbounded_channel();
        service.forward(&mut exact, Instant::now(), &answers1);
        drop(answers1);
        let frame1 = to_region.recv().await.unwrap();
        let (_, checks) = region_wire::decode_checks(&frame1.body).unwrap();
        let seq1 = checks[0].id.seq;
        // Connection 1 ends (its client reset it: `serve_connection` returns on a failed
        // write), before the region answered.
        drop(answered1);
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        assert_eq!(service.waiting.sends(), 1, "the written send still waits");
        // The client retries the id on connection 2; held for want of room past its
        // rule's timeout, it is answered as the region's silence would be.
        output.clear();
        let retry = Request {
            id: 7,
            op: Op::Check {
                rule: "quota".into(),
                subject: "a".into(),
                cost: 2,
                id: Some(CheckId { session: 9, seq: 5 }),
            },
        };
        service.handle_frames(
            &frames(&[retry]),
            &mut output,
            &mut exact,
            0,
            &mut None,
            200,
        );
        let answer = responses(&output).pop().unwrap();
        // Now the region decides the first send after all.
        frame1.reply.send(region_wire::encode_answers(&[(
            seq1,
            ExactAnswer::Decided(Outcome {
                allowed: true,
                count: 2,
            }),
        )]));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            late_reported.try_recv().is_err(),
            "no fallback to take back"
        );
        assert_eq!(
            estimate(&service, "quota"),
            0,
            "nothing counted at the edge"
        );
        assert!(
            matches!(answer.result, Err(Refusal::RegionUnavailable { .. })),
            "a retry falls back while its first send may still be decided at the region: {:?}",
            answer.result
        );
    }

    /// A region without the rule of an exact check (its rules and this sidecar's disagree:
    /// a misconfiguration) answers `NoRule`: it is reachable, and never decides the check
    /// however often it is sent. That is no unreachable region, for which alone a rule's
    /// `on_region_unavailable` answers instead (BRIEF: "Region unreachable: a
    /// `RegionUnavailable` error ..., unless the rule opts into" a fallback): the client
    /// gets a typed error naming the rule, which no retry changes, and nothing is counted,
    /// as for the region's other refusals (`Storage`, `KeysFull`).
    #[tokio::test(flavor = "current_thread")]
    async fn a_check_the_region_has_no_rule_for_is_refused_naming_the_rule_and_not_a_fallback() {
        use crate::region::wire::{self as region_wire, ExactAnswer};
        let (mut service, _, key) = allowing_service();
        let mut to_region = forward_to_a_local_region(&mut service, mpsc::unbounded_channel().0);
        let (mut output, mut exact) = (Vec::new(), Vec::new());
        handle(
            &service,
            &frames(&[quota_check(5, 2)]),
            &mut output,
            &mut exact,
        );
        let (answers, mut answered) = mpsc::unbounded_channel();
        service.forward(&mut exact, Instant::now(), &answers);
        let frame = to_region.recv().await.unwrap();
        let (_, checks) = region_wire::decode_checks(&frame.body).unwrap();
        frame.reply.send(region_wire::encode_answers(&[(
            checks[0].id.seq,
            ExactAnswer::NoRule,
        )]));
        let mut forwarded = answered.recv().await.unwrap();
        service.answer_exact(&mut forwarded, &mut output);
        let response = responses(&output).pop().unwrap();
        assert!(
            matches!(&response.result, Err(Refusal::BadField { field, why })
                if field == "rule" && why.contains("\"quota\"") && why.contains("region")),
            "{:?}",
            response.result
        );
        assert_eq!(service.store.estimate(&key), 0, "nothing counted");
    }
}
