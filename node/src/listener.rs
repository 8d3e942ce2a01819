//! The client listener: applications on loopback TCP and on a Unix socket, speaking the
//! `tally_client::wire` protocol (length-prefixed frames, request ids, pipelining).
//!
//! A connection's task reads whatever frames have arrived, answers them in order in one
//! batch (each request sees the writes of the ones before it), writes the batch's lane-log
//! records out, and only then sends the answers. Everything from the first write of a batch
//! to the log flush is synchronous: on the node's one-thread runtime the gossip task cannot
//! run in between, so it never pushes a lane the log lacks.
//!
//! A frame that does not decode closes its connection (a length-prefixed stream cannot be
//! resynchronised) after a `Malformed` answer, and is counted; the node keeps serving.

use crate::clock;
use crate::config::{RuleConfig, RuleMode};
use crate::decide::{self, Context, Rules};
use crate::lanelog::LaneLog;
use crate::metrics::Metrics;
use crate::region::forward::Forwarder;
use crate::store::LaneStore;
use crate::view::View;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tally_client::wire::{self, Op, Refusal, Reply, Request, Response, Status};
use tally_crdt::{Key, ReplicaId};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, Semaphore};

/// The exit status of a node whose lane log failed. The batch's writes are in the lane
/// store but not in the log, and lanes cannot be taken back; exiting before this thread
/// runs the gossip task again means no peer sees them and no client is told they
/// counted. The restart takes a new generation and republishes what the log holds.
pub const EXIT_LOG_FAILED: i32 = 74;

/// The most exact checks one client connection may have waiting for the region.
pub const EXACT_IN_FLIGHT_MAX: usize = 1_024;

/// Everything a request needs; shared by every connection.
pub struct Service {
    /// The lane store.
    pub store: Arc<LaneStore>,
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
    pub forwarder: Option<Forwarder>,
    /// Set when the node is stopping: connections close before answering anything more,
    /// so every write acknowledged is in the lanes the gossip task pushes last.
    pub closing: std::sync::atomic::AtomicBool,
}

/// A request's answer: ready now, or an exact check to forward first.
#[derive(Debug)]
pub enum Answer {
    /// Answered.
    Ready(Response),
    /// An exact check for the region.
    Exact {
        /// The request's id.
        id: u64,
        /// The rule.
        rule: RuleConfig,
        /// The key, with the window fixed now.
        key: Key,
        /// The cost.
        cost: u64,
    },
}

/// What [`Service::handle`] made of one request.
enum Handled {
    /// Answered here.
    Now(Reply),
    /// An exact check, for the region.
    Forward {
        rule: RuleConfig,
        key: Key,
        cost: u64,
    },
}

impl Service {
    /// Answers a batch of requests in order, then writes their lane-log records out.
    /// Exact checks come back as [`Answer::Exact`], for [`Service::exact`].
    pub fn handle_batch(&self, requests: Vec<Request>) -> Vec<Answer> {
        let mut exact = Vec::new();
        let mut answers: Vec<Answer> = self
            .in_context(|context| {
                requests
                    .into_iter()
                    .filter_map(|request| {
                        let result = match self.handle(context, request.op) {
                            Ok(Handled::Forward { rule, key, cost }) => {
                                exact.push(Answer::Exact {
                                    id: request.id,
                                    rule,
                                    key,
                                    cost,
                                });
                                return None;
                            }
                            Ok(Handled::Now(reply)) => Ok(reply),
                            Err(refusal) => Err(refusal),
                        };
                        Some(Response {
                            id: request.id,
                            result,
                        })
                    })
                    .collect()
            })
            .into_iter()
            .map(Answer::Ready)
            .collect();
        answers.extend(exact);
        answers
    }

    /// Forwards an exact check to the region and answers it: exact if the region
    /// answered in time, else as the rule's `on_region_unavailable` says.
    pub async fn exact(&self, id: u64, rule: &RuleConfig, key: &Key, cost: u64) -> Response {
        let forwarded = match (&self.forwarder, cost) {
            (_, 0) => Err(Refusal::BadField {
                field: "cost".into(),
                why: "must be at least 1".into(),
            }),
            (Some(forwarder), _) => forwarder.check(rule, key, cost).await,
            (None, _) => Err(Refusal::RegionUnavailable {
                rule: rule.name.clone(),
                why: "this node has no region configured".into(),
            }),
        };
        let mut responses = self.in_context(|context| {
            let result = match forwarded {
                Ok(outcome) => Ok(context.exact(rule, key, outcome)),
                Err(unavailable @ Refusal::RegionUnavailable { .. }) => {
                    context.fallback(rule, key, cost, unavailable)
                }
                Err(other) => Err(other),
            };
            if let Ok(decision) = &result {
                self.metrics.decided(decision.mode, decision.allowed);
            }
            vec![Response {
                id,
                result: result.map(Reply::Decision),
            }]
        });
        responses
            .pop()
            .expect("invariant: one answer per exact check")
    }

    /// Runs `answer` in a request context, then writes the lane log out. A failed write
    /// stops the node: see [`EXIT_LOG_FAILED`].
    fn in_context(&self, answer: impl FnOnce(&mut Context<'_>) -> Vec<Response>) -> Vec<Response> {
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
            log: log.as_deref_mut(),
        };
        let responses = answer(&mut context);
        if let Some(log) = log.as_deref_mut() {
            if let Err(err) = log.flush() {
                eprintln!("tallyd: {err}; stopping: writes cannot be made durable");
                std::process::exit(EXIT_LOG_FAILED);
            }
            if let Err(err) = log.compact_if_large(&self.store) {
                // The log is still whole; only its rewrite failed. The next batch retries.
                eprintln!("tallyd: {err}");
            }
        }
        self.metrics
            .client_requests
            .fetch_add(responses.len() as u64, Ordering::Relaxed);
        responses
    }

    /// Answers one request, or hands back an exact check to forward: its rule is looked
    /// up once, here, for both kinds of check.
    fn handle(&self, context: &mut Context<'_>, op: Op) -> Result<Handled, Refusal> {
        let result = match op {
            Op::Incr {
                rule,
                subject,
                amount,
            } => {
                let key = decide::key(self.rules.get(&rule)?, &subject, context.now)?;
                context.count(&key, amount, true).map(Reply::Counted)
            }
            Op::Decr {
                rule,
                subject,
                amount,
            } => {
                let key = decide::key(self.rules.get(&rule)?, &subject, context.now)?;
                context.count(&key, amount, false).map(Reply::Counted)
            }
            Op::Get { rule, subject } => {
                let key = decide::key(self.rules.get(&rule)?, &subject, context.now)?;
                Ok(Reply::Estimate(context.estimate(&key)))
            }
            Op::Check {
                rule,
                subject,
                cost,
            } => {
                let found = self.rules.get(&rule)?;
                let key = decide::key(found, &subject, context.now)?;
                if found.1.mode == RuleMode::Exact {
                    return Ok(Handled::Forward {
                        rule: found.1.clone(),
                        key,
                        cost,
                    });
                }
                let decision = context.check(&found.1, &key, cost)?;
                self.metrics.decided(decision.mode, decision.allowed);
                Ok(Reply::Decision(decision))
            }
            Op::Status => Ok(Reply::Status(self.status(context))),
        };
        if let Err(Refusal::KeysFull { .. }) = &result {
            self.metrics.keys_refused.fetch_add(1, Ordering::Relaxed);
        }
        result.map(Handled::Now)
    }

    fn status(&self, context: &Context<'_>) -> Status {
        let mut members = std::collections::BTreeMap::<String, u64>::new();
        for (_, _, state) in &context.view.members {
            *members
                .entry(format!("{state:?}").to_lowercase())
                .or_default() += 1;
        }
        Status {
            node: self.replica.node.0,
            generation: self.replica.generation.0,
            members: members.into_iter().collect(),
            keys: self.store.len() as u64,
        }
    }
}

/// Serves applications on `tcp` and, if given, `unix`, at most `connections_max` at once.
pub async fn serve(
    service: Arc<Service>,
    tcp: TcpListener,
    unix: Option<UnixListener>,
    connections_max: usize,
) {
    let permits = Arc::new(Semaphore::new(connections_max));
    if let Some(unix) = unix {
        let (service, permits) = (service.clone(), permits.clone());
        tokio::spawn(async move {
            loop {
                match unix.accept().await {
                    Ok((stream, _)) => spawn_connection(&service, &permits, stream),
                    Err(_) => accept_failed(&service).await,
                }
            }
        });
    }
    loop {
        match tcp.accept().await {
            Ok((stream, _)) => {
                // Requests are small and pipelined; Nagle's delay would only hold answers.
                let _ = stream.set_nodelay(true);
                spawn_connection(&service, &permits, stream);
            }
            Err(_) => accept_failed(&service).await,
        }
    }
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
/// checks are answered when the region is, in between.
async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin>(
    service: &Arc<Service>,
    mut stream: S,
) {
    let mut input = Vec::with_capacity(16 * 1024);
    let mut output = Vec::with_capacity(16 * 1024);
    let mut chunk = vec![0u8; 64 * 1024];
    // Answers of exact checks, as the region gives them; bounded by the permits.
    let (late, mut lates) = mpsc::unbounded_channel::<Response>();
    let exact_permits = Arc::new(Semaphore::new(EXACT_IN_FLIGHT_MAX));
    loop {
        output.clear();
        let read = tokio::select! {
            read = stream.read(&mut chunk) => read,
            Some(response) = lates.recv() => {
                wire::encode_frame(&response, &mut output);
                while let Ok(response) = lates.try_recv() {
                    wire::encode_frame(&response, &mut output);
                }
                if stream.write_all(&output).await.is_err() {
                    return;
                }
                continue;
            }
        };
        let read = match read {
            Ok(0) | Err(_) => {
                if !input.is_empty() {
                    // The client went in the middle of a frame: a truncated frame.
                    service
                        .metrics
                        .client_frames_bad
                        .fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
            Ok(read) => read,
        };
        if service.closing.load(Ordering::Relaxed) {
            // Nothing read now is answered: the client sees the connection close.
            return;
        }
        input.extend_from_slice(&chunk[..read]);
        let (requests, consumed, bad) = split_frames(&input);
        input.drain(..consumed);
        if !requests.is_empty() {
            for answer in service.handle_batch(requests) {
                match answer {
                    Answer::Ready(response) => wire::encode_frame(&response, &mut output),
                    Answer::Exact {
                        id,
                        rule,
                        key,
                        cost,
                    } => {
                        // At most EXACT_IN_FLIGHT_MAX per connection: past it, this
                        // connection waits (and stops reading) until one is answered.
                        let Ok(permit) = exact_permits.clone().acquire_owned().await else {
                            return;
                        };
                        let (service, late) = (service.clone(), late.clone());
                        tokio::spawn(async move {
                            let _ = late.send(service.exact(id, &rule, &key, cost).await);
                            drop(permit);
                        });
                    }
                }
            }
        }
        if let Some(why) = &bad {
            service
                .metrics
                .client_frames_bad
                .fetch_add(1, Ordering::Relaxed);
            let response = Response {
                id: 0,
                result: Err(Refusal::Malformed { why: why.clone() }),
            };
            wire::encode_frame(&response, &mut output);
        }
        if !output.is_empty() && stream.write_all(&output).await.is_err() {
            return;
        }
        if bad.is_some() {
            let _ = stream.shutdown().await;
            return;
        }
    }
}

/// The whole requests at the front of `input`, how many bytes they took, and the error of
/// a bad frame after them, if any.
fn split_frames(input: &[u8]) -> (Vec<Request>, usize, Option<String>) {
    let mut requests = Vec::new();
    let mut at = 0;
    while let Some(prefix) = input.get(at..at + 4) {
        let prefix: [u8; 4] = prefix.try_into().expect("invariant: a 4-byte slice");
        let len = match wire::frame_len(prefix) {
            Ok(len) => len,
            Err(err) => return (requests, at, Some(err.to_string())),
        };
        let Some(body) = input.get(at + 4..at + 4 + len) else {
            break;
        };
        match wire::decode_body::<Request>(body) {
            Ok(request) => requests.push(request),
            Err(err) => return (requests, at, Some(err.to_string())),
        }
        at += 4 + len;
    }
    (requests, at, None)
}

// The lane store runs on loom's atomics under `tally_loom`, which work only inside a model.
#[cfg(test)]
#[cfg(not(tally_loom))]
mod tests {
    use super::*;

    fn service(keys_max: usize) -> Service {
        let rule = RuleConfig {
            window_secs: 60,
            ..RuleConfig::for_test("count", 100, RuleMode::Approximate)
        };
        let replica = ReplicaId::new(tally_crdt::NodeId(1), tally_crdt::Generation(1));
        Service {
            store: Arc::new(LaneStore::new(replica, keys_max)),
            view: Arc::new(View::default()),
            rules: Rules::new(&[rule]).unwrap(),
            log: None,
            metrics: Arc::new(Metrics::default()),
            replica,
            forwarder: None,
            closing: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn ready(answers: Vec<Answer>) -> Vec<Response> {
        answers
            .into_iter()
            .map(|answer| match answer {
                Answer::Ready(response) => response,
                Answer::Exact { .. } => panic!("no exact rule here"),
            })
            .collect()
    }

    fn incr(id: u64, subject: &str) -> Request {
        Request {
            id,
            op: Op::Incr {
                rule: "count".into(),
                subject: subject.into(),
                amount: 1,
            },
        }
    }

    #[test]
    fn at_the_key_cap_new_keys_are_refused_with_a_typed_error_and_counted() {
        let service = service(2);
        let batch = vec![incr(1, "a"), incr(2, "b"), incr(3, "c"), incr(4, "a")];
        let responses = ready(service.handle_batch(batch));
        let results: Vec<_> = responses.iter().map(|r| (r.id, r.result.is_ok())).collect();
        assert_eq!(results, [(1, true), (2, true), (3, false), (4, true)]);
        assert_eq!(
            responses[2].result,
            Err(Refusal::KeysFull { keys_max: 2 }),
            "a new key past the cap names the cap"
        );
        assert_eq!(service.metrics.keys_refused.load(Ordering::Relaxed), 1);
        assert_eq!(service.store.len(), 2);
    }

    #[test]
    fn a_batch_is_answered_in_order_each_request_seeing_the_ones_before() {
        let service = service(10);
        let responses = ready(service.handle_batch(vec![incr(7, "a"), incr(8, "a"), incr(9, "a")]));
        let estimates: Vec<_> = responses
            .iter()
            .map(|r| match &r.result {
                Ok(Reply::Counted(estimate)) => (r.id, estimate.estimate),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(estimates, [(7, 1), (8, 2), (9, 3)]);
    }

    #[test]
    fn frames_split_whole_requests_and_keep_a_partial_tail() {
        let mut input = Vec::new();
        wire::encode_frame(
            &Request {
                id: 1,
                op: Op::Status,
            },
            &mut input,
        );
        wire::encode_frame(
            &Request {
                id: 2,
                op: Op::Status,
            },
            &mut input,
        );
        let whole = input.len();
        wire::encode_frame(
            &Request {
                id: 3,
                op: Op::Status,
            },
            &mut input,
        );
        let (requests, consumed, bad) = split_frames(&input[..input.len() - 1]);
        assert_eq!(requests.iter().map(|r| r.id).collect::<Vec<_>>(), [1, 2]);
        assert_eq!((consumed, bad), (whole, None));
    }

    #[test]
    fn an_oversized_or_garbage_frame_stops_the_split_with_an_error() {
        let mut input = Vec::new();
        wire::encode_frame(
            &Request {
                id: 1,
                op: Op::Status,
            },
            &mut input,
        );
        let good = input.len();
        input.extend_from_slice(&u32::MAX.to_le_bytes());
        let (requests, consumed, bad) = split_frames(&input);
        assert_eq!((requests.len(), consumed), (1, good));
        assert!(bad.unwrap().contains("limit"));
        let garbage = [3, 0, 0, 0, 1, 0xff, 0xff];
        let (requests, _, bad) = split_frames(&garbage);
        assert!(requests.is_empty() && bad.is_some());
    }
}
