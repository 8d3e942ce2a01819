//! Group commit: one thread owns the region log, takes every record queued while it was
//! busy, makes room for them in the log's allocation ahead (zeros written and synced: a
//! step at a time while it finds nothing queued, a chunk when a group needs it; see
//! [`super::log`]), appends them with one write and makes them durable with one
//! `sync_data`, then acknowledges them all. The more checks arrive during
//! a sync, the more share the next. A compaction is queued like a record and done in its
//! turn: the log is replaced whole by the entries of the state every earlier submission
//! left.
//!
//! After a failed write, sync, allocation (a group's, or the sync of one ahead while none
//! waits) or compaction, every record then queued and every later one is refused: the
//! committer never retries and then acknowledges. A write of zeros ahead that fails is
//! let go: it made nothing durable, and the group that needs the room meets the failure
//! in its own allocation, or, where the room was allocated before, in its own write and
//! sync (found in review, session 52, where this said it refused everything after it). A
//! full disk fails the allocation, before any of the group that needed it is written. The
//! one failure it goes on after is a compaction's that left the log as it was, before its
//! rename, and was no failed write or sync but for want of room
//! ([`ReplaceError::harmless`]): the log still holds every record, and takes appends as
//! before.
//!
//! [`ReplaceError::harmless`]: super::log::ReplaceError::harmless

use super::log::{Storage, GROUP_BYTES_MAX};
use crate::clock::Clock;
use crate::metrics::LatencyHistogram;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use tokio::sync::oneshot;

/// Why a record was not acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("region log: {why}; the region acknowledges nothing more until it restarts")]
pub struct CommitError {
    /// The failure, as the OS reported it (a full disk reads "No space left on device").
    pub why: String,
}

/// Counters of the committer's work, for the metrics.
#[derive(Debug, Default)]
pub struct CommitStats {
    /// Records made durable.
    pub records: AtomicU64,
    /// Syncs done (groups of at least one record).
    pub syncs: AtomicU64,
    /// Groups made durable, by the time their write and sync took (the chunk of zeros
    /// allocated first included, for a group that needed one). Failed groups, steps
    /// allocated ahead and compactions are not in it.
    pub sync_latency: LatencyHistogram,
    /// Records refused after a failure.
    pub refused: AtomicU64,
    /// Bytes appended to the log (compactions not included).
    pub appended: AtomicU64,
    /// Compactions done.
    pub compactions: AtomicU64,
    /// Compactions that failed harmlessly before they replaced the log, which was left as
    /// it was: the copy not made, or no room for it.
    pub compactions_failed: AtomicU64,
}

enum Work {
    Append(Append),
    // The log is replaced by `snapshot` and then `since`.
    Compact { snapshot: Vec<u8>, since: Vec<u8> },
}

struct Append {
    bytes: Vec<u8>,
    records: u64,
    done: oneshot::Sender<Result<(), CommitError>>,
}

/// The handle the region's task submits records through. Dropping it lets the thread
/// finish what was queued and waits for it, so nothing of the committer's still writes to
/// the log once its owner is gone.
pub struct Committer {
    // `None` only while dropping: closing the queue is what ends the thread.
    sender: Option<mpsc::Sender<Work>>,
    thread: Option<std::thread::JoinHandle<()>>,
    stats: Arc<CommitStats>,
}

impl Committer {
    /// Starts the committer thread over `storage`.
    pub fn start(storage: Box<dyn Storage>) -> Committer {
        let (sender, receiver) = mpsc::channel();
        let stats = Arc::new(CommitStats::default());
        let thread_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name("tally-region-commit".into())
            .spawn(move || run(storage, receiver, &thread_stats))
            .expect("invariant: the OS can start one thread at start-up");
        Committer {
            sender: Some(sender),
            thread: Some(thread),
            stats,
        }
    }

    fn queue(&self, work: Work) {
        if let Some(sender) = &self.sender {
            // If the thread is gone, an append's `done` is dropped and its receiver reports
            // it.
            let _ = sender.send(work);
        }
    }

    /// Queues `bytes`, `records` encoded records (zero or more, at most [`GROUP_BYTES_MAX`]
    /// bytes: one frame's records are far fewer); the receiver completes once they are
    /// durable together with everything submitted before them, or refused. Empty `bytes`
    /// completes after everything submitted before it: how a retry waits for its first.
    pub fn submit(
        &self,
        bytes: Vec<u8>,
        records: u64,
    ) -> oneshot::Receiver<Result<(), CommitError>> {
        // Recovery takes more unacknowledged bytes than one group's for a damaged log.
        assert!(
            bytes.len() <= GROUP_BYTES_MAX,
            "a submission of {} bytes is over one group's {GROUP_BYTES_MAX}",
            bytes.len()
        );
        let (done, receiver) = oneshot::channel();
        self.queue(Work::Append(Append {
            bytes,
            records,
            done,
        }));
        receiver
    }

    /// Queues a compaction: once everything submitted before it is durable, the log is
    /// replaced (atomically, see [`Storage::replace`]) by `snapshot` followed by `since`,
    /// which together must be the entries of the state that everything submitted before it
    /// left. The two are joined on the committer's thread: a snapshot can be large, and
    /// copying it would hold up the caller. Its outcome is counted in the stats: a
    /// compaction that failed harmlessly, leaving the log as it was, is no failure of the
    /// committer's.
    pub fn compact(&self, snapshot: Vec<u8>, since: Vec<u8>) {
        self.queue(Work::Compact { snapshot, since });
    }

    /// The committer's counters.
    pub fn stats(&self) -> &Arc<CommitStats> {
        &self.stats
    }
}

impl Drop for Committer {
    fn drop(&mut self) {
        self.sender = None;
        if let Some(thread) = self.thread.take() {
            // A panic on the thread was reported there; nothing more to do with it here.
            let _ = thread.join();
        }
    }
}

fn run(mut storage: Box<dyn Storage>, receiver: mpsc::Receiver<Work>, stats: &CommitStats) {
    let mut failed: Option<CommitError> = None;
    let mut bytes = Vec::new();
    // A compaction taken off the queue while a group was being gathered, or a submission
    // that would have taken the group past GROUP_BYTES_MAX: it goes next.
    let mut next: Option<Work> = None;
    loop {
        let first = match next.take() {
            Some(work) => work,
            None => match next_work(&receiver, &mut *storage, &mut failed) {
                Some(work) => work,
                None => return,
            },
        };
        let first = match first {
            Work::Append(append) => append,
            Work::Compact {
                mut snapshot,
                since,
            } => {
                if failed.is_none() {
                    snapshot.extend_from_slice(&since);
                    compact(&mut *storage, &snapshot, stats, &mut failed);
                }
                continue;
            }
        };
        bytes.clear();
        bytes.extend_from_slice(&first.bytes);
        let mut group = vec![first];
        loop {
            match receiver.try_recv() {
                Ok(Work::Append(append)) if bytes.len() + append.bytes.len() <= GROUP_BYTES_MAX => {
                    bytes.extend_from_slice(&append.bytes);
                    group.push(append);
                }
                Ok(work) => {
                    next = Some(work);
                    break;
                }
                Err(_) => break,
            }
        }
        if failed.is_none() && !bytes.is_empty() {
            let started = Clock::start();
            let written = storage
                .reserve(bytes.len())
                .and_then(|()| storage.append(&bytes))
                .and_then(|()| storage.sync());
            match written {
                Ok(()) => {
                    stats.sync_latency.record(started.mono());
                    stats.syncs.fetch_add(1, Ordering::Relaxed);
                    stats
                        .appended
                        .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    let records = group.iter().map(|work| work.records).sum();
                    stats.records.fetch_add(records, Ordering::Relaxed);
                }
                Err(err) => failed = Some(CommitError::from(err)),
            }
        }
        for work in group {
            let result = match &failed {
                None => Ok(()),
                Some(err) => {
                    stats.refused.fetch_add(work.records, Ordering::Relaxed);
                    Err(err.clone())
                }
            };
            let _ = work.done.send(result);
        }
    }
}

/// The next work (a submission or a compaction), once one is queued; `None` once the
/// queue is closed and empty. While none is, the log is allocated ahead rather than in a
/// group's path, a step at a time, looking for work between steps. A failed sync there
/// fails closed like any other: its error is reported once, so the next group's sync may
/// well succeed. (A failed write, a full disk, is met again by the next group's own
/// reserve.)
fn next_work(
    receiver: &mpsc::Receiver<Work>,
    storage: &mut dyn Storage,
    failed: &mut Option<CommitError>,
) -> Option<Work> {
    loop {
        match receiver.try_recv() {
            Ok(work) => return Some(work),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        if failed.is_none() {
            match storage.reserve_ahead() {
                Ok(true) => continue,
                Ok(false) => {}
                Err(err) => *failed = Some(CommitError::from(err)),
            }
        }
        return receiver.recv().ok();
    }
}

/// Replaces the log with `entries`. A failure that left the log as it was and is no
/// failed write or sync ([`ReplaceError::harmless`]: the copy not made, or no room for it)
/// is counted and reported, and appends go on; any other fails the committer: one past the
/// rename leaves the log unknown, and a copy whose write or sync failed (`EIO`) is a disk
/// that failed a sync, after which nothing is acknowledged.
///
/// [`ReplaceError::harmless`]: super::log::ReplaceError::harmless
fn compact(
    storage: &mut dyn Storage,
    entries: &[u8],
    stats: &CommitStats,
    failed: &mut Option<CommitError>,
) {
    match storage.replace(entries) {
        Ok(()) => {
            stats.compactions.fetch_add(1, Ordering::Relaxed);
        }
        Err(failure) if failure.harmless() => {
            stats.compactions_failed.fetch_add(1, Ordering::Relaxed);
            log_line!(
                "tallyd: region log: a compaction failed before it replaced the log ({}); \
                 the log is as it was and takes appends, and the next compaction is due once \
                 it has grown as much again",
                failure.err
            );
        }
        Err(failure) => *failed = Some(CommitError::from(failure.err)),
    }
}

impl From<std::io::Error> for CommitError {
    fn from(err: std::io::Error) -> CommitError {
        CommitError {
            why: err.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::log::{self, Entry, Record, ReplaceError, ReplaceStep, RequestId};
    use super::super::{Decided, ExactCheck, Ledger};
    use super::*;
    use std::sync::Mutex;

    /// A disk in memory that fails every I/O from the `fail_at`-th on (counting from 0),
    /// like a machine that crashed there. `file` is the file as the process sees it, the
    /// log's entries up to `end` and zeros after; `durable` what the last sync left; and
    /// `pending` the writes since, in order.
    #[derive(Debug, Default)]
    struct Disk {
        file: Vec<u8>,
        end: usize,
        durable: Vec<u8>,
        pending: Vec<(usize, Vec<u8>)>,
        ios: usize,
        fail_at: Option<usize>,
        // Allocations ahead: each writes zeros and syncs them (two I/Os).
        allocations: usize,
        // A disk whose sync returns without making anything durable: the negative control
        // for acknowledging before the data is on the disk.
        sync_lies: bool,
    }

    /// The simulated log's chunk: small, so that 60 checks cross many.
    const SIM_CHUNK_BYTES: usize = 64;

    impl Disk {
        fn write(&mut self, at: usize, bytes: &[u8]) {
            write_at(&mut self.file, at, bytes);
            self.pending.push((at, bytes.to_vec()));
        }

        /// What a crash can leave: the durable bytes with the writes since, in order, each
        /// whole, or only its first half, or only its second half (a page written back
        /// before an earlier one).
        fn crash_states(&self) -> Vec<Vec<u8>> {
            let mut states = vec![self.durable.clone()];
            let mut file = self.durable.clone();
            for (at, bytes) in &self.pending {
                let half = bytes.len() / 2;
                let mut first = file.clone();
                write_at(&mut first, *at, &bytes[..half]);
                let mut second = file.clone();
                write_at(&mut second, at + half, &bytes[half..]);
                write_at(&mut file, *at, bytes);
                states.extend([first, second, file.clone()]);
            }
            states
        }
    }

    fn write_at(file: &mut Vec<u8>, at: usize, bytes: &[u8]) {
        if file.len() < at + bytes.len() {
            file.resize(at + bytes.len(), 0);
        }
        file[at..at + bytes.len()].copy_from_slice(bytes);
    }

    struct SimStorage(Arc<Mutex<Disk>>);

    impl SimStorage {
        fn io(&self) -> std::io::Result<std::sync::MutexGuard<'_, Disk>> {
            let mut disk = self.0.lock().unwrap();
            disk.ios += 1;
            if disk.fail_at.is_some_and(|at| disk.ios > at) {
                return Err(std::io::Error::other("injected I/O error"));
            }
            Ok(disk)
        }
    }

    // As `FileStorage`: zeros to a chunk boundary for a group, in steps ahead of need, each
    // allocation synced on its own. A write that fails here fails the committer, where the
    // file's would be met again by the next group's reserve: the safer of the two.
    impl Storage for SimStorage {
        fn reserve(&mut self, bytes: usize) -> std::io::Result<()> {
            let (needed, allocated) = {
                let disk = self.0.lock().unwrap();
                (disk.end + bytes, disk.file.len())
            };
            if needed <= allocated {
                return Ok(());
            }
            let zeros = vec![0; needed.next_multiple_of(SIM_CHUNK_BYTES) - allocated];
            {
                let mut disk = self.io()?;
                disk.write(allocated, &zeros);
                disk.allocations += 1;
            }
            self.sync()
        }

        fn reserve_ahead(&mut self) -> std::io::Result<bool> {
            let (end, allocated) = {
                let disk = self.0.lock().unwrap();
                (disk.end, disk.file.len())
            };
            if allocated - end >= SIM_CHUNK_BYTES {
                return Ok(false);
            }
            let step = SIM_CHUNK_BYTES / log::AHEAD_STEPS as usize;
            let zeros = vec![0; (allocated + 1).next_multiple_of(step) - allocated];
            {
                let mut disk = self.io()?;
                disk.write(allocated, &zeros);
                disk.allocations += 1;
            }
            self.sync().map(|()| true)
        }

        fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
            let mut disk = self.io()?;
            let end = disk.end;
            disk.write(end, bytes);
            disk.end += bytes.len();
            Ok(())
        }

        fn sync(&mut self) -> std::io::Result<()> {
            let mut disk = self.io()?;
            if !disk.sync_lies {
                disk.durable = disk.file.clone();
                disk.pending.clear();
            }
            Ok(())
        }

        // One I/O, atomic: a crash before it leaves the log as it was, after it as `bytes`
        // and a chunk of zeros or more. A failure's effect is not known, as a rename's.
        fn replace(&mut self, bytes: &[u8]) -> Result<(), ReplaceError> {
            let mut disk = self.io().map_err(ReplaceError::unknown)?;
            let mut file = bytes.to_vec();
            file.resize(
                (bytes.len() + SIM_CHUNK_BYTES).next_multiple_of(SIM_CHUNK_BYTES),
                0,
            );
            disk.durable = file.clone();
            disk.file = file;
            disk.pending.clear();
            disk.end = bytes.len();
            Ok(())
        }
    }

    /// The rule's limit.
    const LIMIT: u64 = 40;

    fn check(seq: u64) -> ExactCheck {
        ExactCheck {
            id: RequestId {
                node: 1 + seq % 3,
                generation: 1,
                seq: seq / 3,
            },
            check_id: None,
            rule: "quota".into(),
            subject: format!("acct-{}", seq % 2),
            window_index: 500_000,
            window_secs: 3_600,
            cost: 1 + seq % 4,
        }
    }

    /// Runs 60 checks (with retries of earlier ids mixed in) in groups of up to 7 through
    /// a committer on `disk`, with a compaction after the 30th; returns the ledgers after
    /// each new decision (the reference model: `models[k]` has the first k) and the ids
    /// acknowledged.
    fn run_checks(disk: &Arc<Mutex<Disk>>) -> (Vec<Ledger>, Vec<RequestId>) {
        let committer = Committer::start(Box::new(SimStorage(disk.clone())));
        let mut ledger = Ledger::default();
        let mut decided = Vec::new();
        let mut models = vec![Ledger::default()];
        let mut acked = Vec::new();
        let mut seq = 0;
        while seq < 60 {
            let mut pending = Vec::new();
            for _ in 0..(1 + seq % 7) {
                let retry = seq % 5 == 4;
                let this = if retry { check(seq - 3) } else { check(seq) };
                let key = super::super::key_of(&this.rule, &this.subject, 500_000, 3_600).unwrap();
                let (bytes, count) = match ledger.decide(&this, &key, LIMIT) {
                    Decided::New(outcome) => {
                        let record = Record::decided(&this, outcome.allowed);
                        let mut bytes = Vec::new();
                        log::encode(&Entry::Decided(record.clone()), &mut bytes);
                        decided.push(Entry::Decided(record.into_owned()));
                        models.push(Ledger::replay(&decided));
                        (bytes, 1)
                    }
                    Decided::Repeat(_) => (Vec::new(), 0),
                    Decided::Forgotten => panic!("60 checks stay within RECENT_IDS"),
                    Decided::IdReused => panic!("a retry repeats its check"),
                    Decided::KeysFull | Decided::SessionsFull => {
                        panic!("a ledger holds any number of keys and sessions by default")
                    }
                };
                pending.push((this.id, committer.submit(bytes, count)));
                seq += 1;
                if seq == 30 {
                    let mut entries = Vec::new();
                    ledger.snapshot(&mut entries);
                    // Handed over in two parts, as a compaction hands its snapshot and the
                    // records since: the committer joins them.
                    let since = entries.split_off(entries.len() / 2);
                    committer.compact(entries, since);
                }
            }
            for (id, done) in pending {
                if done.blocking_recv().unwrap().is_ok() {
                    acked.push(id);
                }
            }
        }
        (models, acked)
    }

    #[test]
    fn a_crash_at_every_io_recovers_every_acknowledged_record_and_nothing_else() {
        let clean = Arc::new(Mutex::new(Disk::default()));
        let (all_models, acked_clean) = run_checks(&clean);
        assert!(
            acked_clean.len() >= 60,
            "every check acknowledged on a good disk"
        );
        let (total_ios, allocations) = {
            let clean = clean.lock().unwrap();
            (clean.ios, clean.allocations)
        };
        assert!(total_ios > 10, "groups formed: {total_ios} I/Os");
        assert!(
            allocations > 5,
            "groups crossed chunks: {allocations} allocations"
        );
        let mut compacted_and_recovered = false;
        for fail_at in 0..=total_ios {
            let disk = Arc::new(Mutex::new(Disk {
                fail_at: Some(fail_at),
                ..Disk::default()
            }));
            let (models, acked) = run_checks(&disk);
            assert_eq!(models, all_models, "decisions do not depend on the disk");
            let disk = disk.lock().unwrap();
            for survived in disk.crash_states() {
                match recovery_fault(&survived, &models, &acked) {
                    Ok(compacted) => compacted_and_recovered |= compacted,
                    Err(fault) => panic!("fail at I/O {fail_at}: {fault}"),
                }
            }
        }
        assert!(
            compacted_and_recovered,
            "some runs recovered from a compacted log"
        );
    }

    /// What is wrong with what recovery makes of the crash state `survived`: it must be the
    /// ledger of a prefix of the decisions (`models`) that holds every acknowledged check
    /// (`acked`) and never admits past the limit. Else whether the log had been compacted.
    fn recovery_fault(
        survived: &[u8],
        models: &[Ledger],
        acked: &[RequestId],
    ) -> Result<bool, String> {
        let (recovered, _) = log::replay(survived);
        let compacted = (recovered.iter()).any(|entry| matches!(entry, Entry::Count { .. }));
        let mut ledger = Ledger::replay(&recovered);
        if !models.contains(&ledger) {
            return Err("recovery is not the state of a prefix of the decisions".into());
        }
        for id in acked {
            let retry = ExactCheck {
                id: *id,
                ..check(0)
            };
            let key = super::super::key_of("quota", "acct-0", 500_000, 3_600).unwrap();
            if !matches!(ledger.decide(&retry, &key, LIMIT), Decided::Repeat(_)) {
                return Err(format!("acknowledged {id:?} lost"));
            }
        }
        for subject in ["acct-0", "acct-1"] {
            let key = super::super::key_of("quota", subject, 500_000, 3_600).unwrap();
            if ledger.count(&key) > LIMIT {
                return Err(format!("{subject} admitted past the limit"));
            }
        }
        Ok(compacted)
    }

    #[test]
    fn a_disk_whose_sync_persists_nothing_is_caught_losing_acknowledged_checks() {
        // The negative control of the test above (TESTING.md): acknowledging what is not
        // on the disk must be seen.
        let disk = Arc::new(Mutex::new(Disk {
            sync_lies: true,
            ..Disk::default()
        }));
        let (models, acked) = run_checks(&disk);
        assert!(!acked.is_empty());
        let disk = disk.lock().unwrap();
        let faults: Vec<String> = (disk.crash_states().iter())
            .filter_map(|survived| recovery_fault(survived, &models, &acked).err())
            .collect();
        assert!(
            faults.iter().any(|fault| fault.contains("lost")),
            "a crash state lost an acknowledged check: {faults:?}"
        );
    }

    /// Which of its I/Os a [`GatedStorage`] holds until the test lets it finish.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Gate {
        Sync,
        Ahead,
    }

    /// A disk that holds each I/O of one kind until the test lets it finish, telling the
    /// test when one begins, and records its steps ahead, appends (by size) and syncs, in
    /// order. Gating steps ahead, it always wants another; else none. A held I/O whose
    /// release the test dropped ends at once: a step that allocated nothing, a failed sync.
    struct GatedStorage {
        gate: Gate,
        events: Arc<Mutex<Vec<String>>>,
        began: std::sync::mpsc::Sender<()>,
        release: std::sync::mpsc::Receiver<()>,
    }

    impl GatedStorage {
        /// Holds an I/O of `kind` if that is the gated kind: whether it may go on.
        fn hold(&self, kind: Gate) -> bool {
            if kind != self.gate {
                return true;
            }
            let _ = self.began.send(());
            self.release.recv().is_ok()
        }
    }

    impl Storage for GatedStorage {
        fn reserve(&mut self, _bytes: usize) -> std::io::Result<()> {
            Ok(())
        }

        fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
            self.events
                .lock()
                .unwrap()
                .push(format!("append {}", bytes.len()));
            Ok(())
        }

        fn reserve_ahead(&mut self) -> std::io::Result<bool> {
            self.events.lock().unwrap().push("ahead".into());
            Ok(self.gate == Gate::Ahead && self.hold(Gate::Ahead))
        }

        fn sync(&mut self) -> std::io::Result<()> {
            self.events.lock().unwrap().push("sync".into());
            if self.hold(Gate::Sync) {
                Ok(())
            } else {
                Err(std::io::Error::other("the test let go of the sync"))
            }
        }

        fn replace(&mut self, _bytes: &[u8]) -> Result<(), ReplaceError> {
            unreachable!("these tests do not compact")
        }
    }

    /// A committer over a [`GatedStorage`], with what the test drives it by. Fields drop
    /// in order: `let_go` first, so that a failing assertion ends the I/O held and the
    /// committer's drop does not wait for it forever.
    struct Gated {
        /// Lets the I/O held finish.
        let_go: std::sync::mpsc::Sender<()>,
        committer: Committer,
        /// The disk's events, in order.
        events: Arc<Mutex<Vec<String>>>,
        began: std::sync::mpsc::Receiver<()>,
    }

    impl Gated {
        fn new(gate: Gate) -> Gated {
            let events = Arc::new(Mutex::new(Vec::new()));
            let (tell, began) = std::sync::mpsc::channel();
            let (let_go, release) = std::sync::mpsc::channel();
            let committer = Committer::start(Box::new(GatedStorage {
                gate,
                events: events.clone(),
                began: tell,
                release,
            }));
            Gated {
                let_go,
                committer,
                events,
                began,
            }
        }

        /// Waits, at most 10 s, for the next held I/O to begin.
        fn began(&self) {
            self.began
                .recv_timeout(std::time::Duration::from_secs(10))
                .expect("a held I/O begins");
        }
    }

    /// The answer to a submission, waited for at most 10 s.
    fn answer(
        mut done: oneshot::Receiver<Result<(), CommitError>>,
    ) -> Option<Result<(), CommitError>> {
        (0..10_000).find_map(|_| match done.try_recv() {
            Err(oneshot::error::TryRecvError::Empty) => {
                std::thread::sleep(std::time::Duration::from_millis(1));
                None
            }
            answer => answer.ok(),
        })
    }

    #[test]
    fn an_idle_committer_allocates_ahead_step_by_step_and_takes_a_group_between_two_steps() {
        let gated = Gated::new(Gate::Ahead);
        // Idle, it takes a step, and another once that one is done.
        gated.began();
        gated.let_go.send(()).unwrap();
        gated.began();
        // A group arrives during the second: it is written once that step is done, before
        // any more.
        let done = gated.committer.submit(vec![1; 8], 1);
        gated.let_go.send(()).unwrap();
        assert_eq!(answer(done), Some(Ok(())), "the group is made durable");
        // Idle again, it goes on with the steps.
        gated.began();
        assert_eq!(
            gated.events.lock().unwrap()[..],
            ["ahead", "ahead", "append 8", "sync", "ahead"]
        );
    }

    #[test]
    fn nothing_is_acknowledged_before_its_sync_and_one_sync_holds_a_whole_group() {
        use tokio::sync::oneshot::error::TryRecvError;
        let gated = Gated::new(Gate::Sync);
        let committer = &gated.committer;

        let mut first = committer.submit(vec![1; 8], 1);
        gated.began();
        // Three more arrive while the first is being synced.
        let mut group: Vec<_> = (2..5)
            .map(|byte| committer.submit(vec![byte; 8], 1))
            .collect();
        assert_eq!(
            first.try_recv(),
            Err(TryRecvError::Empty),
            "acknowledged before its sync"
        );
        gated.let_go.send(()).unwrap();
        assert_eq!(answer(first), Some(Ok(())));

        // The three are written together and wait for one sync.
        gated.began();
        for done in &mut group {
            assert_eq!(
                done.try_recv(),
                Err(TryRecvError::Empty),
                "acknowledged before its sync"
            );
        }
        // Allocating ahead waits for an idle moment: perhaps before the first submission
        // arrived or after the last acknowledgement, never between a group's arrival and
        // its sync.
        {
            let events = gated.events.lock().unwrap();
            let busy = |event: &String| event != "ahead";
            let first = events.iter().position(busy).unwrap();
            let last = events.iter().rposition(busy).unwrap();
            assert_eq!(
                events[first..=last],
                ["append 8", "sync", "append 24", "sync"]
            );
        }
        gated.let_go.send(()).unwrap();
        for done in group {
            assert_eq!(answer(done), Some(Ok(())));
        }
        let stats = committer.stats();
        assert_eq!(stats.syncs.load(Ordering::Relaxed), 2);
        assert_eq!(stats.sync_latency.count(), 2, "each sync timed");
        assert_eq!(stats.records.load(Ordering::Relaxed), 4);
    }

    /// A disk with room for `room` bytes, allocated in chunks of 4: an allocation past it
    /// fails like a full file system, and an append inside the allocation cannot. A
    /// replacement needs room for its copy beside the log, and fails writing it without
    /// it; or, with `replace_fails`, it fails at that step with that OS error whatever the
    /// room.
    struct FullStorage {
        written: Arc<Mutex<Vec<u8>>>,
        allocated: usize,
        room: usize,
        replace_fails: Option<(ReplaceStep, i32)>,
    }

    impl Storage for FullStorage {
        fn reserve(&mut self, bytes: usize) -> std::io::Result<()> {
            let needed = self.written.lock().unwrap().len() + bytes;
            if needed > self.allocated {
                let allocated = needed.next_multiple_of(4);
                if allocated > self.room {
                    return Err(std::io::Error::from_raw_os_error(28));
                }
                self.allocated = allocated;
            }
            Ok(())
        }

        fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
            let mut written = self.written.lock().unwrap();
            assert!(
                written.len() + bytes.len() <= self.allocated,
                "appended inside the allocation"
            );
            written.extend_from_slice(bytes);
            Ok(())
        }

        fn sync(&mut self) -> std::io::Result<()> {
            Ok(())
        }

        fn replace(&mut self, bytes: &[u8]) -> Result<(), ReplaceError> {
            if let Some((step, errno)) = self.replace_fails {
                return Err(ReplaceError {
                    err: std::io::Error::from_raw_os_error(errno),
                    step,
                });
            }
            if self.allocated + bytes.len() > self.room {
                return Err(ReplaceError {
                    err: std::io::Error::from_raw_os_error(28),
                    step: ReplaceStep::Copy,
                });
            }
            *self.written.lock().unwrap() = bytes.to_vec();
            self.allocated = bytes.len().next_multiple_of(4);
            Ok(())
        }
    }

    #[test]
    fn a_full_disk_refuses_with_a_clear_error_and_acknowledges_nothing_after() {
        let written = Arc::new(Mutex::new(Vec::new()));
        let committer = Committer::start(Box::new(FullStorage {
            written: written.clone(),
            allocated: 0,
            room: 10,
            replace_fails: None,
        }));
        assert!(committer
            .submit(vec![1; 6], 1)
            .blocking_recv()
            .unwrap()
            .is_ok());
        // 6 more need 12 bytes allocated: the allocation fails, before the group is written.
        for (bytes, records) in [(vec![2; 6], 1), (vec![3; 1], 1), (Vec::new(), 0)] {
            let err = committer
                .submit(bytes, records)
                .blocking_recv()
                .unwrap()
                .unwrap_err();
            assert!(err.why.contains("No space left on device"), "{err}");
        }
        assert_eq!(
            *written.lock().unwrap(),
            vec![1; 6],
            "nothing after the failure"
        );
    }

    /// A disk whose one allocation ahead fails in its sync (a writeback error, reported
    /// once, as Linux does), and whose every other I/O works.
    struct AheadFailsOnce {
        written: Arc<Mutex<Vec<u8>>>,
        failed: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Storage for AheadFailsOnce {
        fn reserve(&mut self, _bytes: usize) -> std::io::Result<()> {
            Ok(())
        }

        fn reserve_ahead(&mut self) -> std::io::Result<bool> {
            if self.failed.swap(true, Ordering::SeqCst) {
                return Ok(false);
            }
            Err(std::io::Error::from_raw_os_error(5))
        }

        fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
            self.written.lock().unwrap().extend_from_slice(bytes);
            Ok(())
        }

        fn sync(&mut self) -> std::io::Result<()> {
            Ok(())
        }

        fn replace(&mut self, bytes: &[u8]) -> Result<(), ReplaceError> {
            *self.written.lock().unwrap() = bytes.to_vec();
            Ok(())
        }
    }

    #[test]
    fn a_compaction_with_no_room_for_its_copy_leaves_the_log_taking_appends() {
        let written = Arc::new(Mutex::new(Vec::new()));
        let committer = Committer::start(Box::new(FullStorage {
            written: written.clone(),
            allocated: 0,
            room: 16,
            replace_fails: None,
        }));
        let appended = |bytes: Vec<u8>| committer.submit(bytes, 1).blocking_recv().unwrap();
        assert_eq!(appended(vec![1; 6]), Ok(()));
        // The copy, 12 bytes beside the log's 8 allocated, does not fit in 16.
        committer.compact(vec![9; 6], vec![9; 6]);
        assert_eq!(appended(vec![2; 2]), Ok(()), "appended after the failure");
        let stats = committer.stats();
        assert_eq!(stats.compactions_failed.load(Ordering::Relaxed), 1);
        assert_eq!(stats.compactions.load(Ordering::Relaxed), 0);
        assert_eq!(*written.lock().unwrap(), [1, 1, 1, 1, 1, 1, 2, 2]);
        // A copy that fits replaces the log.
        committer.compact(vec![7; 4], Vec::new());
        assert_eq!(appended(vec![3; 1]), Ok(()));
        assert_eq!(stats.compactions.load(Ordering::Relaxed), 1);
        assert_eq!(*written.lock().unwrap(), [7, 7, 7, 7, 3]);
    }

    /// A copy that could not be made (`EMFILE`: out of file descriptors) wrote nothing and
    /// failed no sync: the log takes appends as before.
    #[test]
    fn a_compaction_whose_copy_cannot_be_made_leaves_the_log_taking_appends() {
        let written = Arc::new(Mutex::new(Vec::new()));
        let committer = Committer::start(Box::new(FullStorage {
            written: written.clone(),
            allocated: 0,
            room: 64,
            replace_fails: Some((ReplaceStep::Create, 24)),
        }));
        let appended = |bytes: Vec<u8>| committer.submit(bytes, 1).blocking_recv().unwrap();
        assert_eq!(appended(vec![1; 6]), Ok(()));
        committer.compact(vec![9; 6], Vec::new());
        assert_eq!(appended(vec![2; 2]), Ok(()), "appended after the failure");
        let stats = committer.stats();
        assert_eq!(stats.compactions_failed.load(Ordering::Relaxed), 1);
        assert_eq!(*written.lock().unwrap(), [1, 1, 1, 1, 1, 1, 2, 2]);
    }

    #[test]
    fn a_compaction_that_fails_at_its_rename_fails_closed() {
        a_compaction_failed_by_the_disk_fails_closed(ReplaceStep::Rename, 5);
    }

    /// TESTING.md D5: a failed write or sync of the copy, and nothing is acknowledged
    /// after it, though the log itself was not touched and would still sync.
    #[test]
    fn a_compaction_whose_copy_fails_its_write_or_its_sync_fails_closed() {
        a_compaction_failed_by_the_disk_fails_closed(ReplaceStep::Copy, 5);
        a_compaction_failed_by_the_disk_fails_closed(ReplaceStep::SyncCopy, 5);
    }

    /// A sync of the copy that reports no room (ENOSPC) is a writeback error, as on
    /// thin-provisioned storage, not a refused allocation: it fails closed too (found in
    /// review, session 46).
    #[test]
    fn a_compaction_whose_copys_sync_reports_no_room_fails_closed() {
        a_compaction_failed_by_the_disk_fails_closed(ReplaceStep::SyncCopy, 28);
    }

    /// A compaction whose replacement fails at `step` with `errno`: the committer refuses
    /// the next submission, with the OS's error, and writes nothing more.
    fn a_compaction_failed_by_the_disk_fails_closed(step: ReplaceStep, errno: i32) {
        let written = Arc::new(Mutex::new(Vec::new()));
        let storage = FullStorage {
            written: written.clone(),
            allocated: 0,
            room: 64,
            replace_fails: Some((step, errno)),
        };
        let committer = Committer::start(Box::new(storage));
        assert!(committer
            .submit(vec![1; 6], 1)
            .blocking_recv()
            .unwrap()
            .is_ok());
        committer.compact(vec![9; 6], Vec::new());
        let err = committer
            .submit(vec![2; 2], 1)
            .blocking_recv()
            .unwrap()
            .unwrap_err();
        let reported = std::io::Error::from_raw_os_error(errno).to_string();
        assert!(err.why.contains(&reported), "{err}");
        assert_eq!(
            *written.lock().unwrap(),
            [1; 6],
            "nothing after the failure"
        );
        let stats = committer.stats();
        assert_eq!(stats.compactions_failed.load(Ordering::Relaxed), 0);
        assert_eq!(stats.refused.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_failed_allocation_ahead_fails_closed_though_the_next_sync_would_succeed() {
        let written = Arc::new(Mutex::new(Vec::new()));
        let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Nothing is queued at start, so the committer allocates ahead first, and fails.
        let committer = Committer::start(Box::new(AheadFailsOnce {
            written: written.clone(),
            failed: failed.clone(),
        }));
        while !failed.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        for _ in 0..2 {
            let err = committer
                .submit(vec![1; 6], 1)
                .blocking_recv()
                .unwrap()
                .unwrap_err();
            assert!(err.why.contains("Input/output error"), "{err}");
        }
        assert!(written.lock().unwrap().is_empty(), "nothing written after");
    }

    #[test]
    fn after_a_failed_sync_nothing_is_acknowledged_ever_again() {
        // Two chunks allocated, so that the committer allocates nothing ahead, whenever it
        // finds the queue empty: the group's append works, and every I/O from the second
        // (the group's sync) fails.
        let disk = Arc::new(Mutex::new(Disk {
            file: vec![0; 2 * SIM_CHUNK_BYTES],
            durable: vec![0; 2 * SIM_CHUNK_BYTES],
            fail_at: Some(1),
            ..Disk::default()
        }));
        let committer = Committer::start(Box::new(SimStorage(disk.clone())));
        let first = committer.submit(vec![1, 2, 3], 1).blocking_recv().unwrap();
        assert!(first.is_err());
        // The disk would work again; the committer must not believe it.
        disk.lock().unwrap().fail_at = None;
        for _ in 0..3 {
            let err = committer
                .submit(vec![4], 1)
                .blocking_recv()
                .unwrap()
                .unwrap_err();
            assert!(err.to_string().contains("injected I/O error"), "{err}");
        }
        let disk = disk.lock().unwrap();
        assert_eq!(disk.ios, 2, "no I/O after the failure");
        assert_eq!(
            disk.file[..disk.end],
            [1, 2, 3],
            "nothing appended after the failure"
        );
        assert_eq!(committer.stats().refused.load(Ordering::Relaxed), 4);
    }
}
