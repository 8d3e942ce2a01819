//! The edge's side of the region path: forwards an exact check and waits, at most the
//! rule's `region_timeout_ms`, for a durable answer. A check whose connection breaks is
//! sent again with the same request id (the region answers a repeat with the first
//! outcome), until the deadline. A decision says exact only when the region answered.

use super::log::RequestId;
use super::{decode, encode, ExactAnswer, ExactCheck, Outcome};
use crate::clock::Clock;
use crate::config::RuleConfig;
use crate::transport::Requester;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tally_client::wire::Refusal;
use tally_crdt::{Key, NodeId, ReplicaId};

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
    /// Sends retried after a broken stream or connection.
    pub retries: AtomicU64,
}

/// Forwards exact checks from one edge life to the region.
pub struct Forwarder {
    requester: Requester,
    region: NodeId,
    addr: String,
    replica: ReplicaId,
    next_seq: AtomicU64,
    clock: Clock,
    stats: std::sync::Arc<ForwardStats>,
}

impl Forwarder {
    /// A forwarder to the region `region` at `addr`, for `replica`'s requests.
    pub fn new(
        requester: Requester,
        region: NodeId,
        addr: String,
        replica: ReplicaId,
        clock: Clock,
        stats: std::sync::Arc<ForwardStats>,
    ) -> Forwarder {
        Forwarder {
            requester,
            region,
            addr,
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
        let body = encode(&check);
        let started = self.clock.mono();
        let timeout = Duration::from_millis(rule.region_timeout_ms);
        let attempts = async {
            loop {
                match self.requester.request(self.region, &self.addr, &body).await {
                    Ok(answer) => return decode::<ExactAnswer>(&answer),
                    Err(_) => {
                        self.stats.retries.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        };
        let unavailable = |why: String| {
            self.stats.unavailable.fetch_add(1, Ordering::Relaxed);
            Refusal::RegionUnavailable {
                rule: rule.name.clone(),
                why,
            }
        };
        let answer = tokio::time::timeout(timeout, attempts)
            .await
            .map_err(|_| unavailable(format!("no answer within {} ms", rule.region_timeout_ms)))?;
        let elapsed = self.clock.mono().saturating_sub(started);
        match answer {
            Some(ExactAnswer::Decided(outcome)) => {
                self.record_latency(elapsed);
                Ok(outcome)
            }
            Some(ExactAnswer::UnknownRule) => Err(unavailable(format!(
                "the region has no exact rule {:?}",
                rule.name
            ))),
            Some(ExactAnswer::Forgotten) => Err(unavailable(
                "the region no longer remembers this request id".into(),
            )),
            Some(ExactAnswer::Storage(why)) => {
                self.stats.storage_errors.fetch_add(1, Ordering::Relaxed);
                Err(Refusal::Storage {
                    why: format!("region: {why}"),
                })
            }
            None => Err(unavailable("the region's answer did not decode".into())),
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
