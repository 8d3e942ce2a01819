//! The region node's task: decides forwarded exact checks one at a time on the
//! [`Ledger`], hands each record to the [`Committer`], and answers once it is durable.
//!
//! Deciding on one task in arrival order is what makes check-and-increment linearizable:
//! each decision sees every earlier one, durable or about to be. A decision whose group
//! fails to sync is never acknowledged, and neither is anything after it (the committer
//! refuses everything once a sync failed), so no acknowledged decision rests on a lost one.
//! Admissions also go into the region's own lanes once durable, so the edges' approximate
//! estimates include exact traffic.

use super::committer::Committer;
use super::log::{self, FileStorage, Record};
use super::{decode, encode, key_of, Decided, ExactAnswer, ExactCheck, Ledger};
use crate::clock;
use crate::config::RuleMode;
use crate::decide::Rules;
use crate::store::LaneStore;
use crate::transport::PeerRequest;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The region's state and its log.
pub struct RegionService {
    ledger: Ledger,
    committer: Committer,
    rules: Rules,
    store: Arc<LaneStore>,
    /// Forwarded checks that did not decode, or named no exact rule here.
    pub bad_requests: Arc<AtomicU64>,
}

/// Why the region log could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("region log {path}: {source}")]
pub struct OpenError {
    path: PathBuf,
    source: std::io::Error,
}

/// What opening the region log found.
#[derive(Debug, Clone, Copy)]
pub struct Opened {
    /// Records replayed (of live windows).
    pub records: usize,
    /// Bytes of torn tail dropped.
    pub torn: u64,
}

impl RegionService {
    /// Opens `dir/region.log`, replays it (dropping a torn tail, and rewriting the log
    /// without the records of windows that are over), and starts the committer.
    pub fn open(
        dir: &Path,
        rules: Rules,
        store: Arc<LaneStore>,
    ) -> Result<(RegionService, Opened), OpenError> {
        let path = dir.join("region.log");
        let io = |source| OpenError {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let (storage, records, torn) = log::open(&path).map_err(io)?;
        let now_secs = clock::wall().0 / 1_000;
        let live: Vec<Record> = records
            .iter()
            .filter(|r| {
                key_of(&r.rule, &r.subject, r.window_index, r.window_secs)
                    .is_some_and(|key| key.window.is_live(now_secs))
            })
            .cloned()
            .collect();
        let storage = if live.len() < records.len() {
            drop(storage);
            rewrite(&path, &live).map_err(io)?
        } else {
            storage
        };
        let service = RegionService {
            ledger: Ledger::replay(&live),
            committer: Committer::start(Box::new(storage)),
            rules,
            store,
            bad_requests: Arc::new(AtomicU64::new(0)),
        };
        let opened = Opened {
            records: live.len(),
            torn,
        };
        Ok((service, opened))
    }

    /// The committer's counters.
    pub fn commit_stats(&self) -> Arc<super::committer::CommitStats> {
        self.committer.stats().clone()
    }

    /// Serves forwarded checks until the channel closes.
    pub async fn serve(mut self, mut requests: mpsc::Receiver<PeerRequest>) {
        let mut expire = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                request = requests.recv() => {
                    let Some(request) = request else { return };
                    self.handle(request);
                }
                _ = expire.tick() => self.ledger.expire(clock::wall().0 / 1_000),
            }
        }
    }

    fn handle(&mut self, request: PeerRequest) {
        let PeerRequest { from, body, reply } = request;
        let Some(check) = decode::<ExactCheck>(&body) else {
            self.bad_requests.fetch_add(1, Ordering::Relaxed);
            // Dropping `reply` resets the stream: the edge retries or times out.
            return;
        };
        if check.id.node != from.0 {
            // A member may ask only under its own node id: another's ids would let it read
            // or block that edge's answers.
            self.bad_requests.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let rule = match self.rules.get(&check.rule) {
            // The edge fixes the window's index; its length is the rule's, here too.
            Ok((_, rule))
                if rule.mode == RuleMode::Exact && rule.window_secs == check.window_secs =>
            {
                rule
            }
            _ => {
                self.bad_requests.fetch_add(1, Ordering::Relaxed);
                let _ = reply.send(encode(&ExactAnswer::UnknownRule));
                return;
            }
        };
        let Some(decided) = self.ledger.decide(&check, rule) else {
            self.bad_requests.fetch_add(1, Ordering::Relaxed);
            let _ = reply.send(encode(&ExactAnswer::UnknownRule));
            return;
        };
        let (outcome, bytes, admitted) = match decided {
            Decided::New(outcome, record) => {
                let mut bytes = Vec::new();
                log::encode(&record, &mut bytes);
                (outcome, bytes, outcome.allowed)
            }
            // A retry: answered after the sync that made its first decision durable.
            Decided::Repeat(outcome) => (outcome, Vec::new(), false),
            Decided::Forgotten => {
                let _ = reply.send(encode(&ExactAnswer::Forgotten));
                return;
            }
        };
        let durable = self.committer.submit(bytes);
        let store = self.store.clone();
        tokio::spawn(async move {
            let answer = match durable.await {
                Ok(Ok(())) => {
                    if admitted {
                        if let Some(key) = key_of(
                            &check.rule,
                            &check.subject,
                            check.window_index,
                            check.window_secs,
                        ) {
                            // Gossip carries the admission to the edges' estimates. At the
                            // key cap it is counted here only; the decision stands.
                            let _ = store.incr(&key, check.cost);
                        }
                    }
                    ExactAnswer::Decided(outcome)
                }
                Ok(Err(err)) => ExactAnswer::Storage(err.to_string()),
                Err(_) => ExactAnswer::Storage("the region's committer stopped".into()),
            };
            let _ = reply.send(encode(&answer));
        });
    }
}

/// Writes `records` as the whole log at `path` (through a synced temporary file and a
/// rename) and opens it for appending.
fn rewrite(path: &Path, records: &[Record]) -> std::io::Result<FileStorage> {
    let mut bytes = Vec::new();
    for record in records {
        log::encode(record, &mut bytes);
    }
    let tmp = path.with_extension("rewrite");
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    let (storage, _, _) = log::open(path)?;
    Ok(storage)
}
