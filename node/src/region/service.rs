//! The region node's task: decides forwarded exact checks one at a time on the
//! [`Ledger`], hands each frame's records to the [`Committer`] as one append, and answers
//! the frame once they are durable.
//!
//! Deciding on one task in arrival order is what makes check-and-increment linearizable:
//! each decision sees every earlier one, durable or about to be. A decision whose group
//! fails to sync is never acknowledged, and neither is anything after it (the committer
//! refuses everything once a sync failed), so no acknowledged decision rests on a lost one.
//! Admissions also go into the region's own lanes once durable, through the lane log, so
//! the edges' approximate estimates include exact traffic, across region restarts too.

use super::committer::{CommitError, Committer};
use super::log::{self, Entry, Record, Storage};
use super::own_lanes::OwnLanes;
use super::wire::{self, Answered};
use super::{key_in, Decided, ExactAnswer, ExactCheck, Ledger};
use crate::clock::{self, ExpiryClock};
use crate::config::RuleMode;
use crate::decide::Rules;
use crate::lanelog::LaneLog;
use crate::store::LaneStore;
use crate::tasks::{DropsOffThread, Watch};
use crate::transport::{Reply, SessionFrame};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tally_crdt::{Key, Lane, ReplicaId};
use tokio::sync::{mpsc, oneshot, watch};

/// The region's state and its log.
pub struct RegionService {
    ledger: Ledger,
    committer: Committer,
    // The committer's `appended` at the last compaction, and the compacted log's size:
    // the next compaction is due once as much again, and at least COMPACT_AFTER_BYTES, has
    // been appended since.
    compacted_at: u64,
    compacted_bytes: u64,
    // The least the log grows by before it is compacted: COMPACT_AFTER_BYTES but in tests.
    compact_after_bytes: u64,
    // While a compaction's snapshot is encoded off this task: the records decided since the
    // ledger was copied for it, which follow the snapshot in the new log.
    since_snapshot: Option<Vec<u8>>,
    rules: Rules,
    // The region's own lanes of its admissions; taken by `serve`'s acknowledging task.
    own: Option<OwnLanes>,
    // The costs admitted that `own` lacks for want of room in the lane log.
    owed: Arc<AtomicU64>,
    // The costs admitted that `own`'s lane store refused for its key cap.
    lanes_refused: Arc<AtomicU64>,
    // What the ledger's windows end by.
    expiry: ExpiryClock,
    /// Forwarded checks that named no exact rule here or no live window, and frames that
    /// did not decode or asked under another node's ids.
    pub bad_requests: Arc<AtomicU64>,
    // The most keys the ledger holds.
    keys_max: usize,
    /// Checks not decided because they would have added a key past `keys_max`.
    pub keys_refused: Arc<AtomicU64>,
    // The most application sessions whose check ids the ledger holds.
    sessions_max: usize,
    /// Checks not decided because they would have added an application session past
    /// `sessions_max`.
    pub sessions_refused: Arc<AtomicU64>,
}

/// What the region's ledger holds at most.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// Keys (the node's `keys_max`): an admission of one more is not decided.
    pub keys: usize,
    /// Application sessions whose check ids it holds (`check_id_sessions_max`): a check
    /// under one more is not decided. Each costs some 590 bytes with its first check and 80 a check more,
    /// until its windows are over, so a stream of processes that each name a few checks
    /// would otherwise grow the ledger (and every snapshot of it) without bound.
    pub sessions: usize,
}

/// The region's log in its data dir: the ledger.
pub const LOG_FILE: &str = "region.log";

/// Why a region's start was refused before its data dir was touched: the ledger a start
/// needs is not there, or one is where a new one was asked for.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// A start without `--new-ledger` found no ledger.
    #[error(
        "region log {path}: not found, so this region has no ledger; not started. A region's \
         first start takes --new-ledger. If this region had a ledger, its data_dir is \
         mistyped or was lost: a new ledger would admit every exact limit again in the \
         current window, and count again the checks edges retry"
    )]
    Missing {
        /// Where the ledger would be.
        path: PathBuf,
    },
    /// A start with `--new-ledger` found one.
    #[error(
        "--new-ledger: {path} is already there, a region log; not started (a new ledger is \
         for a region's first start: start without --new-ledger to keep this one)"
    )]
    Exists {
        /// The ledger found.
        path: PathBuf,
    },
    /// Whether the ledger is there could not be read.
    #[error("region log {path}: {source}")]
    Io {
        /// Where the ledger would be.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
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
    /// Entries replayed.
    pub entries: usize,
    /// Bytes of torn tail dropped.
    pub torn: u64,
    /// Admissions the region's own lanes lacked after a crash, counted in again.
    pub repaired: u64,
    /// Of those, the ones the lane log had no room for yet: counted in once it has.
    pub owed: u64,
}

impl RegionService {
    /// Checks that `dir` holds a ledger, or, for a start with `new_ledger`, that it holds
    /// none (a missing `dir` holds none). Reads nothing else and changes nothing.
    pub fn check_ledger(dir: &Path, new_ledger: bool) -> Result<(), LedgerError> {
        let path = dir.join(LOG_FILE);
        match path.try_exists() {
            Ok(true) if new_ledger => Err(LedgerError::Exists { path }),
            Ok(false) if !new_ledger => Err(LedgerError::Missing { path }),
            Ok(_) => Ok(()),
            Err(source) => Err(LedgerError::Io { path, source }),
        }
    }

    /// Opens `dir/region.log` ([`LOG_FILE`]), replays it (dropping a torn tail), compacts it (without the
    /// windows that are over by `expiry`, which the service goes on expiring by), and
    /// starts the committer.
    ///
    /// Then it repairs the region's own lanes: an admission is counted in a lane only after
    /// it is durable, so a crash in between leaves the ledger above what this node's earlier
    /// lives (`retired`, from their lane logs) hold for that key; the difference goes into
    /// this life's lane, so the edges' estimates of exact keys match the ledger again.
    ///
    /// The ledger holds at most `caps` once replayed (`Ledger::hold_at_most`,
    /// `Ledger::hold_sessions_at_most`).
    pub fn open(
        dir: &Path,
        caps: Caps,
        rules: Rules,
        store: Arc<LaneStore>,
        lanes: Option<Arc<Mutex<LaneLog>>>,
        retired: &[(ReplicaId, Vec<(Key, Lane)>)],
        mut expiry: ExpiryClock,
    ) -> Result<(RegionService, Opened), OpenError> {
        let path = dir.join(LOG_FILE);
        let io = |source| OpenError {
            path: path.clone(),
            source,
        };
        crate::lanelog::create_dir_durably(dir).map_err(io)?;
        let (mut storage, entries, torn) = log::open(&path).map_err(io)?;
        let mut ledger = Ledger::replay(&entries);
        ledger.hold_at_most(caps.keys);
        ledger.hold_sessions_at_most(caps.sessions);
        ledger.expire(expiry.now_secs());
        ledger.forget_lives_of(store.replica().node.0);
        // Start from a compacted log: the state the entries left, without finished windows.
        let mut compacted = Vec::new();
        ledger.snapshot(&mut compacted);
        storage
            .replace(&compacted)
            .map_err(|failed| io(failed.err))?;
        let mut own = OwnLanes::new(store, lanes, expiry);
        let owed = own.owed_total();
        let lanes_refused = own.refused_total();
        let mut held: HashMap<&Key, u64> = HashMap::new();
        for (_, retired_lanes) in retired {
            for (key, lane) in retired_lanes {
                let sum = held.entry(key).or_default();
                *sum = sum.saturating_add(lane.incr);
            }
        }
        let missing: Vec<(Key, u64)> = ledger
            .counts()
            .map(|(key, count)| {
                let held = held.get(key).copied().unwrap_or(0);
                (key.clone(), count.saturating_sub(held))
            })
            .filter(|(_, missing)| *missing > 0)
            .collect();
        own.count(&missing);
        let opened = Opened {
            entries: entries.len(),
            torn,
            // Saturating: a limit may be as high as `u64::MAX / 91`, and so each key's count.
            repaired: (missing.iter()).fold(0, |sum, (_, missing)| sum.saturating_add(*missing)),
            owed: owed.load(Ordering::Relaxed),
        };
        let service = RegionService {
            ledger,
            committer: Committer::start(Box::new(storage)),
            compacted_at: 0,
            compacted_bytes: compacted.len() as u64,
            compact_after_bytes: COMPACT_AFTER_BYTES,
            since_snapshot: None,
            rules,
            own: Some(own),
            owed,
            lanes_refused,
            expiry,
            bad_requests: Arc::new(AtomicU64::new(0)),
            keys_max: caps.keys,
            keys_refused: Arc::new(AtomicU64::new(0)),
            sessions_max: caps.sessions,
            sessions_refused: Arc::new(AtomicU64::new(0)),
        };
        Ok((service, opened))
    }

    /// The committer's counters.
    pub fn commit_stats(&self) -> Arc<super::committer::CommitStats> {
        self.committer.stats().clone()
    }

    /// The costs admitted that the region's own lanes lack for want of room in the lane
    /// log, to be counted in once it has.
    pub fn lanes_owed(&self) -> Arc<AtomicU64> {
        self.owed.clone()
    }

    /// The costs admitted that the region's own lanes never count, refused by the lane
    /// store's key cap.
    pub fn lanes_refused(&self) -> Arc<AtomicU64> {
        self.lanes_refused.clone()
    }

    /// Serves frames of forwarded checks until the channel closes or `stop` turns true.
    /// Then it decides nothing more, and returns once every frame it decided is answered
    /// and its admissions are counted in the region's own lanes (or refused), so that a
    /// stopping node's last push carries them: all but those its lanes still owe for want
    /// of room in the lane log, which the next start's repair counts in.
    ///
    /// The task that answers frames once durable is spawned on `watcher`: should it end
    /// first, the node stops.
    ///
    /// The service is dropped on a blocking thread however this ends, aborted too: that
    /// joins the committer's thread, which may still be in a sync on a slow or failing
    /// disk, and the node's one thread goes on meanwhile, to its last push or its exit.
    pub async fn serve(
        self,
        frames: mpsc::Receiver<SessionFrame>,
        stop: watch::Receiver<bool>,
        watcher: Watch,
    ) {
        DropsOffThread::new(self).run(frames, stop, watcher).await;
    }

    async fn run(
        &mut self,
        mut frames: mpsc::Receiver<SessionFrame>,
        mut stop: watch::Receiver<bool>,
        watcher: Watch,
    ) {
        let (batches, decided) = mpsc::unbounded_channel();
        let own = self
            .own
            .take()
            .expect("invariant: a service is served once");
        let acknowledging = watcher.spawn("region acknowledgements", acknowledge(decided, own));
        let mut expire = crate::tasks::every(Duration::from_secs(1));
        // A compaction's snapshot, being encoded.
        let mut snapshot: Option<oneshot::Receiver<Vec<u8>>> = None;
        loop {
            tokio::select! {
                frame = frames.recv() => {
                    let Some(frame) = frame else { break };
                    self.handle(frame, &batches);
                }
                _ = stop.wait_for(|stop| *stop) => break,
                _ = expire.tick() => {
                    self.ledger.expire(self.expiry.now_secs());
                    if snapshot.is_none() {
                        snapshot = self.start_compaction_if_due();
                    }
                }
                encoded = async { snapshot.as_mut().expect("guarded").await }, if snapshot.is_some() => {
                    snapshot = None;
                    self.finish_compaction(encoded.ok());
                }
            }
        }
        // The acknowledging task ends once it has answered every batch sent before this;
        // the committer (in `self`) lives until then, to make them durable.
        drop(batches);
        let _ = acknowledging.await;
    }

    /// Starts a compaction of the log once it has grown by as much as it held after the
    /// last one, and by at least [`COMPACT_AFTER_BYTES`]: the log stays within about twice
    /// the larger of the two, however long windows are. The ledger is copied here and its
    /// snapshot encoded on a blocking thread, so deciding stops only for the copy; the
    /// receiver gets the snapshot.
    fn start_compaction_if_due(&mut self) -> Option<oneshot::Receiver<Vec<u8>>> {
        let appended = self.committer.stats().appended.load(Ordering::Relaxed);
        if appended - self.compacted_at < self.compact_after_bytes.max(self.compacted_bytes) {
            return None;
        }
        self.compacted_at = appended;
        let frozen = self.ledger.clone();
        self.since_snapshot = Some(Vec::new());
        let (encoded, snapshot) = oneshot::channel();
        tokio::task::spawn_blocking(move || {
            let mut entries = Vec::new();
            frozen.snapshot(&mut entries);
            let _ = encoded.send(entries);
        });
        Some(snapshot)
    }

    /// Queues the compaction whose snapshot was encoded: the log is replaced by the
    /// snapshot and then every record decided since the copy it was made from, which is
    /// the state everything submitted before the compaction left. `None` if the encoding
    /// failed (it panicked): no compaction, and the next is due only once the log has grown
    /// by as much again, since every try stops deciding for the ledger's copy.
    fn finish_compaction(&mut self, snapshot: Option<Vec<u8>>) {
        let since = self.since_snapshot.take().unwrap_or_default();
        let Some(snapshot) = snapshot else {
            log_line!(
                "tallyd: region: the compaction's snapshot could not be encoded; the log is \
                 left as it is, and the next compaction is due once it has grown as much again"
            );
            return;
        };
        // The records since the copy are counted in `appended` past `compacted_at` already;
        // counted here too, they would bring the next compaction forward.
        self.compacted_bytes = snapshot.len() as u64;
        // A compaction that fails after touching the log fails the committer, which then
        // refuses every later record; one that fails before leaves the log as it was.
        self.committer.compact(snapshot, since);
    }

    /// Decides every check of one frame, in order, and submits their records as one append;
    /// the frame is answered once they are durable. A frame that does not decode, or that
    /// asks under another node's ids, is refused whole: nothing of it is decided.
    fn handle(&mut self, frame: SessionFrame, batches: &mpsc::UnboundedSender<Batch>) {
        let SessionFrame {
            from, body, reply, ..
        } = frame;
        let Some((version, checks)) = wire::decode_checks(&body) else {
            self.bad_requests.fetch_add(1, Ordering::Relaxed);
            reply.refuse();
            return;
        };
        // A member may ask only under its own node id: another's ids would let it read or
        // block that edge's answers.
        if checks.iter().any(|check| check.id.node != from.0) {
            self.bad_requests.fetch_add(1, Ordering::Relaxed);
            reply.refuse();
            return;
        }
        let (answers, admitted, records) = self.decide_frame(&checks);
        let _ = batches.send(Batch {
            durable: self.submit(records),
            version,
            answers,
            admitted,
            reply,
        });
    }

    /// Decides a frame's checks in order: their answers, the admissions (key and cost) to
    /// count in the region's lanes once durable, and the new decisions' records.
    fn decide_frame(&mut self, checks: &[ExactCheck]) -> (Vec<Answered>, Vec<(Key, u64)>, Records) {
        let now_secs = clock::wall().0 / 1_000;
        let mut answers = Vec::with_capacity(checks.len());
        let mut admitted = Vec::new();
        let mut records = Records::default();
        for check in checks {
            let answer = self.decide(check, now_secs, &mut records, &mut admitted);
            answers.push((check.id.seq, answer));
        }
        (answers, admitted, records)
    }

    /// Submits a frame's records to the committer (and keeps a copy if a compaction's
    /// snapshot is being encoded): the receiver completes once they are durable.
    fn submit(&mut self, records: Records) -> oneshot::Receiver<Result<(), CommitError>> {
        if let Some(since) = &mut self.since_snapshot {
            since.extend_from_slice(&records.bytes);
        }
        self.committer.submit(records.bytes, records.count)
    }

    /// Decides one check: a new decision's record goes to `records`, and its key and cost
    /// to `admitted` if it was admitted.
    fn decide(
        &mut self,
        check: &ExactCheck,
        now_secs: u64,
        records: &mut Records,
        admitted: &mut Vec<(Key, u64)>,
    ) -> ExactAnswer {
        // A retry gets its first outcome whatever window it names now: a check sent again
        // under its `CheckId` through another edge, whose clock puts it in a window not
        // live here, is the check decided, not one to refuse (which that edge, sending
        // it for the first time, would answer with its rule's fallback, counting it again).
        match self.ledger.recall(check) {
            // Answered after the sync that made its first decision durable (the committer
            // completes in order).
            Some(Decided::Repeat(outcome)) => return ExactAnswer::Decided(outcome),
            Some(Decided::Forgotten) => return ExactAnswer::Forgotten,
            Some(Decided::IdReused) => return ExactAnswer::IdReused,
            _ => {}
        }
        let (name, rule) = match self.rules.get(&check.rule) {
            // The edge fixes the window's index; its length is the rule's, here too.
            Ok((name, rule))
                if rule.mode == RuleMode::Exact && rule.window_secs == check.window_secs =>
            {
                (name, rule)
            }
            // Not decided on any session (the ledger recalls nothing of it), and never
            // will be: `NoRule`, not `UnknownRule`, so that an edge that sent it again does
            // not take it for one decided in a window since forgotten (found in review,
            // session 47). The edge answers it a typed error naming the rule, never the
            // rule's fallback (since session 53).
            _ => {
                self.bad_requests.fetch_add(1, Ordering::Relaxed);
                return ExactAnswer::NoRule;
            }
        };
        // The edge fixes the window, but only one that is live by this node's clock (with
        // the skew allowed ahead, as for a lane): a window far off would never expire here,
        // and an edge whose clock is within that skew has its window taken. Nor one the
        // ledger may have forgotten already, its counts and ids: live again by a wall clock
        // stepped back, it would admit its limit twice and count retries again.
        let key = key_in(
            name.clone(),
            &check.subject,
            check.window_index,
            check.window_secs,
        )
        .filter(|key| {
            key.window.is_live(now_secs)
                && key.window.start_unix_secs() <= now_secs + tally_crdt::LANE_RATE_SKEW_SECS
                && !self.ledger.forgotten().covers(key.window)
        });
        let Some(key) = key else {
            self.bad_requests.fetch_add(1, Ordering::Relaxed);
            return ExactAnswer::UnknownRule;
        };
        match self.ledger.decide(check, &key, rule.limit) {
            Decided::New(outcome) => {
                let record = Record::decided(check, outcome.allowed);
                log::encode(&Entry::Decided(record), &mut records.bytes);
                records.count += 1;
                if outcome.allowed {
                    admit(admitted, key, check.cost);
                }
                ExactAnswer::Decided(outcome)
            }
            // A retry: answered after the sync that made its first decision durable (the
            // committer completes in order).
            Decided::Repeat(outcome) => ExactAnswer::Decided(outcome),
            Decided::Forgotten => ExactAnswer::Forgotten,
            Decided::IdReused => ExactAnswer::IdReused,
            Decided::KeysFull => {
                self.keys_refused.fetch_add(1, Ordering::Relaxed);
                ExactAnswer::KeysFull {
                    keys_max: self.keys_max as u64,
                }
            }
            // No answer of its own in the region protocol: `Storage`, as for a key cap in
            // version 3, retryable, and answered by no fallback.
            Decided::SessionsFull => {
                self.sessions_refused.fetch_add(1, Ordering::Relaxed);
                ExactAnswer::storage(&format!(
                    "the region holds the check ids of {} application sessions, its \
                     check_id_sessions_max: nothing was decided; a check under a new \
                     session is decided once windows end and make room",
                    self.sessions_max
                ))
            }
        }
    }
}

/// Adds an admission to a frame's, summed into the one before if it is of the same key: a
/// burst on one key is then counted in the region's lanes once.
fn admit(admitted: &mut Vec<(Key, u64)>, key: Key, cost: u64) {
    match admitted.last_mut() {
        // Both costs were admitted under the limit, so their sum fits in a u64.
        Some((last, sum)) if *last == key => *sum += cost,
        _ => admitted.push((key, cost)),
    }
}

/// The least a log grows by before it is compacted.
pub const COMPACT_AFTER_BYTES: u64 = 64 * 1024 * 1024;

/// How often admissions the region's own lanes owe are tried again, while no frame comes.
const OWED_RETRY: Duration = Duration::from_secs(1);

/// One frame's new records, encoded one after the other.
#[derive(Default)]
struct Records {
    bytes: Vec<u8>,
    count: u64,
}

/// One frame's decisions, waiting for their records to be durable.
struct Batch {
    durable: oneshot::Receiver<Result<(), CommitError>>,
    // The version of the frame of checks, which its answers go in.
    version: u8,
    answers: Vec<Answered>,
    admitted: Vec<(Key, u64)>,
    reply: Reply,
}

/// Answers frames as their records become durable, in the order they were decided (the
/// committer completes in that order too). Once durable, a frame's admissions are counted
/// in the region's own lanes; if its records were refused, its decisions are answered
/// with the storage error instead, and nothing of it is counted. While the lanes owe
/// admissions, it tries to count them in every second too, since no admission may come
/// (after a full disk, the region log refuses until a restart).
async fn acknowledge(mut batches: mpsc::UnboundedReceiver<Batch>, mut own: OwnLanes) {
    let mut retry = crate::tasks::every(OWED_RETRY);
    loop {
        let mut batch = tokio::select! {
            batch = batches.recv() => match batch {
                Some(batch) => batch,
                None => return,
            },
            _ = retry.tick(), if own.is_owing() => {
                own.retry();
                continue;
            }
        };
        let refused = match (&mut batch.durable).await {
            Ok(Ok(())) => None,
            Ok(Err(err)) => Some(err.to_string()),
            Err(_) => Some("the region's committer stopped".to_owned()),
        };
        match refused {
            None => own.count(&batch.admitted),
            Some(why) => {
                for (_, answer) in &mut batch.answers {
                    if matches!(answer, ExactAnswer::Decided(_)) {
                        *answer = ExactAnswer::storage(&why);
                    }
                }
            }
        }
        batch
            .reply
            .send(wire::encode_answers_in(batch.version, &batch.answers));
    }
}

// The lane store runs on loom's atomics under `tally_loom`, which work only inside a model.
#[cfg(test)]
#[cfg(not(tally_loom))]
mod tests {
    use super::super::log::RequestId;
    use super::*;
    use crate::config::{RuleConfig, RuleMode};
    use tally_client::wire::CheckId;
    use tally_crdt::{Generation, NodeId, Window};

    fn open(dir: &Path) -> RegionService {
        let rules = Rules::new(&[RuleConfig::for_test("quota", 1_000, RuleMode::Exact)]).unwrap();
        let replica = ReplicaId::new(NodeId(1), Generation(1));
        let store = Arc::new(LaneStore::new(replica, 1_024));
        RegionService::open(
            dir,
            Caps {
                keys: usize::MAX,
                sessions: usize::MAX,
            },
            rules,
            store,
            None,
            &[],
            ExpiryClock::start(),
        )
        .unwrap()
        .0
    }

    /// Decides a frame of checks from node 2 with sequence numbers `seqs`, on seven
    /// accounts, and submits its records; the receiver says when they are durable.
    fn frame(
        service: &mut RegionService,
        seqs: std::ops::Range<u64>,
    ) -> oneshot::Receiver<Result<(), CommitError>> {
        let (_, _, records) = service.decide_frame(&checks(seqs));
        service.submit(records)
    }

    /// Checks from node 2 with sequence numbers `seqs`, on seven accounts, in this hour's
    /// window by the wall clock.
    fn checks(seqs: std::ops::Range<u64>) -> Vec<ExactCheck> {
        let window = Window::containing(clock::wall().0 / 1_000, 3_600).unwrap();
        seqs.map(|seq| ExactCheck {
            subject: format!("acct-{}", seq % 7),
            window_index: window.index(),
            window_secs: window.len_secs(),
            ..super::super::tests::check(seq, 1 + seq % 3)
        })
        .collect()
    }

    #[tokio::test]
    async fn a_window_whose_counts_were_forgotten_stays_over_though_the_wall_clock_steps_back() {
        let dir = std::env::temp_dir().join(format!("tally-stepped-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut service = open(&dir);
        frame(&mut service, 0..20).await.unwrap().unwrap();
        // Expired by a wall clock two hours ahead, since stepped back: this hour's window
        // was over then, and its counts and ids are gone.
        let ahead = clock::wall().0 / 1_000 + 2 * 3_600;
        service.ledger.expire(ahead);
        assert!(service.ledger.counts.is_empty());
        // A new check and a retry of a decided one: neither is decided afresh.
        let refused = |service: &mut RegionService| {
            let (answers, admitted, _) = service.decide_frame(&checks(20..21));
            assert_eq!(answers, [(20, ExactAnswer::UnknownRule)]);
            let (answers, _, _) = service.decide_frame(&checks(3..4));
            assert_eq!(answers, [(3, ExactAnswer::UnknownRule)]);
            assert!(admitted.is_empty());
        };
        refused(&mut service);
        // Nor after a restart, once a compaction has dropped the window's records (it was
        // held in memory only until session 47).
        service.compact_after_bytes = 0;
        let snapshot = service.start_compaction_if_due().expect("due at once");
        service.finish_compaction(snapshot.await.ok());
        frame(&mut service, 30..31).await.unwrap().unwrap();
        assert_eq!(
            service.commit_stats().compactions.load(Ordering::Relaxed),
            1
        );
        drop(service);
        let mut reopened = open(&dir);
        assert!(reopened.ledger.counts.is_empty());
        refused(&mut reopened);
        drop(reopened);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The edge must tell a check the region never decided (no such
    /// exact rule here: misconfigured) from one whose window is not live here (which it
    /// may have decided on an earlier session): the first falls back, the second must not.
    #[tokio::test]
    async fn a_region_without_a_checks_rule_answers_otherwise_than_for_a_window_not_live() {
        let dir = std::env::temp_dir().join(format!("tally-no-rule-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut service = open(&dir);
        let live = checks(0..1).remove(0);
        let no_rule = ExactCheck {
            rule: "nope".into(),
            ..live.clone()
        };
        let (answers, _, _) = service.decide_frame(&[no_rule]);
        let [(0, no_rule)] = &answers[..] else {
            panic!("{answers:?}");
        };
        let over = ExactCheck {
            window_index: live.window_index - 2,
            ..live
        };
        let (answers, _, _) = service.decide_frame(&[over]);
        let [(0, over)] = &answers[..] else {
            panic!("{answers:?}");
        };
        assert_eq!(*over, ExactAnswer::UnknownRule);
        assert_ne!(no_rule, over, "the edge cannot tell them apart");
        assert_eq!(*no_rule, ExactAnswer::NoRule);
        drop(service);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_retry_under_a_check_id_in_a_window_not_live_here_gets_its_first_outcome() {
        let dir = std::env::temp_dir().join(format!("tally-retry-skew-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut service = open(&dir);
        let named = |window_index: u64| ExactCheck {
            id: RequestId {
                node: 3,
                generation: 1,
                seq: 0,
            },
            check_id: Some(CheckId {
                session: 0xfeed,
                seq: 7,
            }),
            window_index,
            ..checks(0..1).remove(0)
        };
        let first = named(checks(0..1)[0].window_index);
        let (answers, _, records) = service.decide_frame(std::slice::from_ref(&first));
        service.submit(records).await.unwrap().unwrap();
        let [(0, ExactAnswer::Decided(outcome))] = answers[..] else {
            panic!("decided: {answers:?}");
        };
        // Sent again through an edge whose clock is two hours behind: its window is not
        // live here, but the check was decided.
        let retry = named(first.window_index - 2);
        let (answers, admitted, records) = service.decide_frame(&[retry]);
        assert_eq!(answers, [(0, ExactAnswer::Decided(outcome))]);
        assert!(
            admitted.is_empty() && records.count == 0,
            "nothing decided again"
        );
        // A new check in that window is still refused.
        let new = ExactCheck {
            check_id: Some(CheckId {
                session: 0xfeed,
                seq: 8,
            }),
            ..named(first.window_index - 2)
        };
        let (answers, _, _) = service.decide_frame(&[new]);
        assert_eq!(answers, [(0, ExactAnswer::UnknownRule)]);
        drop(service);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_compaction_under_way_keeps_every_decision_made_meanwhile_across_a_restart() {
        let dir = std::env::temp_dir().join(format!("tally-compact-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut service = open(&dir);
        service.compact_after_bytes = 0;
        let mut durable = Vec::new();
        durable.push(frame(&mut service, 0..50));
        let snapshot = service.start_compaction_if_due().expect("due at once");
        // While the snapshot is encoded: new ids, retries of ids the copy holds (no
        // records), and retries of ids decided after the copy, with new ones.
        durable.push(frame(&mut service, 50..120));
        durable.push(frame(&mut service, 0..10));
        durable.push(frame(&mut service, 100..130));
        service.finish_compaction(snapshot.await.ok());
        durable.push(frame(&mut service, 130..150));
        for done in durable {
            done.await.unwrap().unwrap();
        }
        assert_eq!(
            service.commit_stats().compactions.load(Ordering::Relaxed),
            1
        );
        let live = service.ledger.clone();
        drop(service);

        let reopened = open(&dir);
        assert_eq!(reopened.ledger, live);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_failed_snapshot_is_retried_after_as_much_growth_and_a_compaction_counts_only_its_snapshot(
    ) {
        let dir = std::env::temp_dir().join(format!("tally-recompact-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut service = open(&dir);
        frame(&mut service, 0..50).await.unwrap().unwrap();
        // Due exactly now: the log has grown by the threshold.
        service.compact_after_bytes = service.commit_stats().appended.load(Ordering::Relaxed);
        let failed = service.start_compaction_if_due().expect("due");
        drop(failed);
        service.finish_compaction(None);
        assert!(
            service.start_compaction_if_due().is_none(),
            "a failed snapshot is not tried again until the log has grown as much again"
        );

        frame(&mut service, 50..110).await.unwrap().unwrap();
        let snapshot = service.start_compaction_if_due().expect("due again");
        let since = frame(&mut service, 110..150);
        let snapshot = snapshot.await.unwrap();
        let snapshot_bytes = snapshot.len() as u64;
        service.finish_compaction(Some(snapshot));
        since.await.unwrap().unwrap();
        // The records since the copy count toward the next compaction once, as appended.
        assert_eq!(service.compacted_bytes, snapshot_bytes);
        drop(service);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_run_of_admissions_on_one_key_is_summed_and_other_keys_keep_their_order() {
        let key = |subject: &str| super::super::key_of("quota", subject, 500_000, 3_600).unwrap();
        let mut admitted = Vec::new();
        for (subject, cost) in [("a", 1), ("a", 2), ("b", 4), ("a", 8)] {
            admit(&mut admitted, key(subject), cost);
        }
        assert_eq!(admitted, [(key("a"), 3), (key("b"), 4), (key("a"), 8)]);
    }

    /// Storage whose every sync fails, as a disk's `EIO` does.
    struct SyncFails;

    impl Storage for SyncFails {
        fn reserve(&mut self, _bytes: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn append(&mut self, _bytes: &[u8]) -> std::io::Result<()> {
            Ok(())
        }
        fn sync(&mut self) -> std::io::Result<()> {
            Err(std::io::Error::other("injected sync failure"))
        }
        fn replace(&mut self, _bytes: &[u8]) -> Result<(), log::ReplaceError> {
            Ok(())
        }
    }

    /// Serves `service` to a session within the node that names itself node `from`, sends
    /// each of `frames` on it in turn, and returns each one's answers (`None` for a frame
    /// refused: the session ends).
    async fn served(
        service: RegionService,
        from: u64,
        frames: &[Vec<ExactCheck>],
    ) -> Vec<Option<Vec<Answered>>> {
        use crate::transport::{FrameRead, Sessions};
        let (to_region, frames_in) = mpsc::channel(8);
        let sessions = Sessions {
            frames: to_region,
            frame_bytes_max: wire::REGION_FRAME_BYTES_MAX,
        };
        let mut session = sessions.open_local(NodeId(from));
        let (stop, stopped) = watch::channel(false);
        let (watcher, _ended) = crate::tasks::watch();
        let serving = tokio::spawn(service.serve(frames_in, stopped, watcher));
        let mut answered = Vec::new();
        for checks in frames {
            let checks: Vec<_> = checks.iter().map(ExactCheck::as_ref).collect();
            session
                .send
                .write(wire::encode_checks(&checks))
                .await
                .unwrap();
            let read = session.receive.read(wire::REGION_FRAME_BYTES_MAX).await;
            answered.push(match read {
                FrameRead::Frame(body) => Some(wire::decode_answers(&body).unwrap()),
                _ => None,
            });
        }
        stop.send(true).unwrap();
        serving.await.unwrap();
        answered
    }

    /// TESTING.md D5 at the service: a frame whose records fail their sync is answered
    /// with the storage error, never with its decisions; and so is every frame after it,
    /// a retry of a check decided before the failure too (its first decision's sync
    /// failed with it).
    #[tokio::test]
    async fn decisions_whose_sync_failed_are_answered_with_the_storage_error_never_acked() {
        let dir = std::env::temp_dir().join(format!("tally-sync-fails-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut service = open(&dir);
        service.committer = Committer::start(Box::new(SyncFails));
        // The first frame, a frame of retries of its checks alone, and new checks.
        let frames = [checks(0..5), checks(3..5), checks(5..8)];
        let answered = served(service, 2, &frames).await;
        assert_eq!(answered.len(), frames.len());
        for (frame, answers) in answered.into_iter().enumerate() {
            let answers = answers.unwrap_or_else(|| panic!("frame {frame} was refused"));
            assert_eq!(answers.len(), frames[frame].len(), "frame {frame}");
            for (seq, answer) in answers {
                assert!(
                    matches!(&answer, ExactAnswer::Storage(why) if why.contains("injected sync failure")),
                    "frame {frame}, check {seq}: {answer:?}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A frame from a member asking under another node's request ids is refused whole:
    /// nothing of it is decided (its ids would let that member read or block the other
    /// edge's answers).
    #[tokio::test]
    async fn a_frame_under_another_nodes_ids_is_refused_and_decides_nothing() {
        let dir = std::env::temp_dir().join(format!("tally-other-ids-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // The checks name node 2; the session is node 3's.
        let answered = served(open(&dir), 3, &[checks(0..5)]).await;
        assert_eq!(answered, vec![None]);
        let reopened = open(&dir);
        assert_eq!(reopened.ledger.counts().count(), 0, "nothing was decided");
        // Node 2's own frame is decided.
        let answered = served(reopened, 2, &[checks(0..5)]).await;
        let answers = answered[0].as_ref().expect("decided");
        assert!(answers
            .iter()
            .all(|(_, answer)| matches!(answer, ExactAnswer::Decided(outcome) if outcome.allowed)));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
