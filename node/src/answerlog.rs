//! What a life answered under request ids ([`crate::recent`]), logged as
//! `answers-<generation>.log` in the data directory beside the life's lane log, so that a
//! retry sent to the node's next life gets the first answer and counts nothing more.
//!
//! A file of its own, not records in the lane log: a build that does not know it leaves it
//! alone, and a record that checks but does not decode (one a later build wrote) is skipped,
//! which costs a retry's count at most, never a lane. An answer is written out after the
//! writes it made (`LaneLog::flush` writes the lane records first), so a process crash never
//! leaves an answer remembered for a write the lane log lacks; it may leave a write whose
//! answer is lost, and a retry of it then counts again. The answers written out since the
//! last sync are synced with each collection's sync of the lane log, before it
//! ([`AnswerLog::sync_handle`], `LogSync::sync`), so the answers to the writes a sync makes
//! durable are durable too (since session 45, from review: before, they were synced only
//! once a second, and a machine crash lost the answers of about the last second while it
//! kept their writes, whose retries then counted again). Answers that wrote nothing (a
//! denial) wait for the once-a-second sync (`AnswerLog::sync_in_background`), and the last
//! ones for the sync at a graceful stop. A machine crash between the two syncs may keep an
//! answer whose write it lost (answers go first: a retry then counts once too few, rather
//! than twice).
//!
//! A start keeps the newest answer of each of the newest [`RECENT_IDS_MAX`] ids whose
//! newest answer is in a live window, over every earlier life ([`recover`]): as many ids
//! as the sidecar's memory holds. It rewrites each earlier file with the answers it keeps,
//! or removes it. A life's file is appended to; past `COMPACT_BYTES` (or twice its size
//! after the last compaction) it is rewritten as the newest answer of each of the life's
//! newest [`RECENT_IDS_MAX`] ids, in two steps (`compaction.rs`): the copy is written and
//! synced on a thread of its own while answers go on being appended, so that the node's
//! thread waits only for the answers given meanwhile. A compaction that fails or is given
//! up leaves the file whole, appended to, and is tried again once the file has grown by
//! `COMPACT_BYTES` more. A failed write (a full disk), or a failed rewrite of a file that
//! may lack answers, stops the logging of answers, reported on stderr: the writes go
//! on, and their answers are remembered in memory only, until a rewrite of the file from
//! memory succeeds. One is tried at the next of the node's once-a-second ticks
//! ([`AnswerLog::sync_in_background`]), then after twice as many ticks at each failure, up
//! to `RETRY_MAX_TICKS` (about a minute).

use crate::checksummed;
use crate::compaction::Compaction;
use crate::lanelog::{read_whole, replace_by_copy, sync_dir, LogError};
use crate::recent::{Answered, Asked, Remembered, RECENT_IDS_MAX};
use crate::store::KeyHasher;
use serde::{Deserialize, Serialize};
use std::collections::{HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tally_client::wire::CheckId;
use tally_crdt::{Generation, Window};

/// How many of a life's last answers its log keeps in memory for a compaction: twice the
/// ids the memory holds, so that ids answered again take the place of none of them unless
/// they are more than half.
const ANSWERS_KEPT: usize = 2 * RECENT_IDS_MAX;

/// A life's file past this many bytes (or twice its size after its last compaction) is
/// rewritten as the newest answer of each of its newest ids: about three times what
/// [`RECENT_IDS_MAX`] answers take.
const COMPACT_BYTES: u64 = 16 << 20;

/// The most ticks (one a second) between two tries of the file's rewrite from memory.
const RETRY_MAX_TICKS: u32 = 64;

/// An answer given under a request id.
pub type AnsweredId = (CheckId, Remembered);

/// One logged answer. (`asked` since session 46: a record an earlier build wrote does not
/// decode, and is skipped.)
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    id: CheckId,
    window_index: u64,
    window_secs: u32,
    answered: Answered,
    asked: Asked,
}

/// Answers are held in memory only until the file's rewrite from memory succeeds.
#[derive(Debug)]
struct Stopped {
    // Ticks still to pass before the rewrite is tried.
    ticks_left: u32,
    // The ticks waited before this try, which the next failure doubles.
    backoff: u32,
}

/// This life's file of answers.
#[derive(Debug)]
pub struct AnswerLog {
    path: PathBuf,
    file: File,
    pending: Vec<u8>,
    written: u64,
    compact_at: u64,
    // Whether answers were written out since the last sync began.
    unsynced: bool,
    // Whether the once-a-second sync took the last handle: its sync may not have run.
    taken_by_second: bool,
    // Whether a sync is in flight.
    syncing: Arc<AtomicBool>,
    // Whether a sync failed since the file was last rewritten: the kernel may have dropped
    // pages it could not write, which a later sync would not write either.
    sync_failed: Arc<AtomicBool>,
    // Set while answers are not written out, after a write or a rewrite failed.
    stopped: Option<Stopped>,
    // The life's last ANSWERS_KEPT answers, from which a compaction writes each id's
    // newest: those of its newest RECENT_IDS_MAX ids, unless more than half of them were
    // superseded by a later answer of their id (an id answered again once its window was
    // over). A count of each id's answers made it exact, and cost named increments with a
    // data directory about a quarter of their throughput (session 48, by hand).
    answered: VecDeque<AnsweredId>,
    // A compaction whose copy is being written, if one is.
    compaction: Option<Compaction>,
    // Whether that compaction must replace the file, which may lack answers: it was begun
    // while logging was stopped, or after a sync failed. One begun for the file's size
    // that fails leaves the file whole, and appending goes on.
    must_replace: bool,
}

impl AnswerLog {
    /// Creates this life's file in `dir` (the caller syncs the directory).
    pub fn create(dir: &Path, generation: Generation) -> Result<AnswerLog, LogError> {
        let path = dir.join(format!("answers-{}.log", generation.0));
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .map_err(LogError::io_at(&path))?;
        Ok(AnswerLog {
            path,
            file,
            pending: Vec::new(),
            written: 0,
            compact_at: COMPACT_BYTES,
            unsynced: false,
            taken_by_second: false,
            syncing: Arc::default(),
            sync_failed: Arc::default(),
            stopped: None,
            answered: VecDeque::new(),
            compaction: None,
            must_replace: false,
        })
    }

    /// Buffers an answer, to be written out by the next [`AnswerLog::flush`].
    pub fn append(&mut self, answered: AnsweredId) {
        encode(&answered, &mut self.pending);
        if self.answered.len() == ANSWERS_KEPT {
            self.answered.pop_front();
        }
        self.answered.push_back(answered);
    }

    /// Writes the buffered answers out (to the page cache: a process crash keeps them),
    /// unless logging has stopped, and keeps them for a rewrite under way.
    pub fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        if self.stopped.is_none() {
            match self.file.write_all(&self.pending) {
                Ok(()) => {
                    self.written += self.pending.len() as u64;
                    self.unsynced = true;
                }
                Err(source) => self.stop(&LogError::Io {
                    path: self.path.clone(),
                    source,
                }),
            }
        }
        if let Some(compaction) = &mut self.compaction {
            compaction.keep(&self.pending);
        }
        self.pending.clear();
    }

    /// Syncs the answers written out so far on a blocking thread, unless none were written
    /// since the last sync began or one is in flight. A failure is reported on stderr, and
    /// has the next [`AnswerLog::compact_if_large`] rewrite the file from memory. Called
    /// once a second: while logging is stopped, it counts the ticks to the next try of the
    /// file's rewrite instead.
    pub fn sync_in_background(&mut self) {
        if let Some(stopped) = &mut self.stopped {
            stopped.ticks_left = stopped.ticks_left.saturating_sub(1);
            return;
        }
        if !self.unsynced || self.syncing.swap(true, Ordering::AcqRel) {
            return;
        }
        let syncing = self.syncing.clone();
        match self.take_sync_handle() {
            Some(answers) => {
                self.taken_by_second = true;
                tokio::task::spawn_blocking(move || {
                    answers.sync();
                    syncing.store(false, Ordering::Release);
                });
            }
            None => syncing.store(false, Ordering::Release),
        }
    }

    /// A handle that syncs the answers written out so far, off the node's thread
    /// ([`AnswersSync::sync`]); `None` if none were written since the last handle was
    /// taken and the once-a-second sync that took the last one is not in flight, or while
    /// logging is stopped. That sync is not waited for but repeated, once: it may not have
    /// run yet when a collection's sync makes the writes those answers answered durable
    /// (found in review, session 47: the collection then synced the writes alone). A file
    /// that cannot be handed out (no file descriptor left) stops the logging.
    pub fn sync_handle(&mut self) -> Option<AnswersSync> {
        let in_flight = self.taken_by_second && self.syncing.load(Ordering::Acquire);
        if !self.unsynced && !in_flight {
            return None;
        }
        self.taken_by_second = false;
        self.take_sync_handle()
    }

    /// A handle that syncs the answers written out so far; `None` while logging is stopped.
    fn take_sync_handle(&mut self) -> Option<AnswersSync> {
        if self.stopped.is_some() {
            return None;
        }
        match self.file.try_clone() {
            Ok(file) => {
                self.unsynced = false;
                Some(AnswersSync {
                    path: self.path.clone(),
                    file,
                    failed: self.sync_failed.clone(),
                })
            }
            Err(source) => {
                self.stop(&LogError::Io {
                    path: self.path.clone(),
                    source,
                });
                None
            }
        }
    }

    /// Rewrites the file as the newest answer of each of the life's newest ids once it has
    /// grown past its bound, or
    /// after a sync failed: the kernel may then have dropped pages of it, so the answers
    /// are written again, to a new file, synced; or, while logging is stopped, once its
    /// retry is due, which starts logging again. Call with nothing pending, once a batch.
    ///
    /// The rewrite is in two steps, one call each: the first hands a copy of the answers to
    /// a thread, which writes and syncs them; a later call, once they are synced, adds the
    /// answers written out since, syncs them, renames the copy over the file and syncs the
    /// directory.
    pub fn compact_if_large(&mut self) {
        if !self.pending.is_empty() {
            return;
        }
        if let Some(compaction) = &mut self.compaction {
            if let Some(replaced) = compaction.try_finish(&self.path) {
                self.compaction = None;
                match replaced {
                    Ok(written) => self.reopen(written),
                    // Left as it was: whole, and still the file appended to.
                    Err(err) => self.compaction_failed(&err),
                }
            }
            return;
        }
        let due = match &self.stopped {
            Some(stopped) => stopped.ticks_left == 0,
            None => self.written >= self.compact_at || self.sync_failed.load(Ordering::Acquire),
        };
        if !due {
            return;
        }
        // The rewrite writes every answer a failed sync may have lost. Read and cleared at
        // once: a sync failing in between would be forgotten, and this rewrite, failing,
        // would leave appending to a file that lacks what it dropped.
        let sync_failed = self.sync_failed.swap(false, Ordering::AcqRel);
        self.must_replace = self.stopped.is_some() || sync_failed;
        // Each id's newest answer is picked out on the compaction's thread.
        let answered: Vec<AnsweredId> = self.answered.iter().copied().collect();
        let started = Compaction::start(&self.path, "tally-answers-copy", move || {
            let newest = newest_ids(
                answered.into_iter().rev(),
                RECENT_IDS_MAX,
                &mut seen(),
                |_| true,
            );
            let mut body = Vec::new();
            for answered in &newest {
                encode(answered, &mut body);
            }
            body
        });
        match started {
            Ok(compaction) => self.compaction = Some(compaction),
            Err(err) => self.compaction_failed(&err),
        }
    }

    /// After a rewrite failed with `err`, or was given up, having left the file as it was:
    /// stops the logging if the file may lack answers ([`AnswerLog::stop`]), else goes on
    /// appending to it, and tries again once it has grown by `COMPACT_BYTES` more, as the
    /// lane log does (found in review, session 50: a compaction given up, with the disk
    /// taking every write, stopped the logging, and at the rate that gave it up each
    /// rewrite from memory was given up too, the answers held in memory only).
    fn compaction_failed(&mut self, err: &LogError) {
        if self.must_replace || self.stopped.is_some() {
            self.stop(err);
            return;
        }
        self.compact_at = self.written.saturating_add(COMPACT_BYTES);
        log_line!(
            "tallyd: {err}; {} is left as it was and appended to, and rewritten once it \
             has grown by {} MiB more",
            self.path.display(),
            COMPACT_BYTES >> 20
        );
    }

    /// Appends to the file a compaction replaced the old one with, `written` bytes long,
    /// once the rename is synced, logging again if logging had stopped; or stops logging.
    fn reopen(&mut self, written: u64) {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let reopened = sync_dir(dir).and_then(|()| {
            OpenOptions::new()
                .append(true)
                .open(&self.path)
                .map_err(LogError::io_at(&self.path))
        });
        match reopened {
            Ok(file) => {
                self.file = file;
                self.written = written;
                self.compact_at = COMPACT_BYTES.max(2 * written);
                if self.stopped.take().is_some() {
                    log_line!(
                        "tallyd: {}: rewritten from memory; answers under request ids are \
                         logged again",
                        self.path.display()
                    );
                }
            }
            Err(err) => self.stop(&err),
        }
    }

    /// Stops writing answers out, after `err`, until the file's rewrite from memory is
    /// retried and succeeds.
    fn stop(&mut self, err: &LogError) {
        let backoff = match &self.stopped {
            Some(stopped) => (2 * stopped.backoff).min(RETRY_MAX_TICKS),
            None => 1,
        };
        self.stopped = Some(Stopped {
            ticks_left: backoff,
            backoff,
        });
        log_line!(
            "tallyd: warning: {err}; answers under request ids are remembered in memory \
             only (a retry sent to the next life counts again) until the file is rewritten \
             from memory, tried next in about {backoff} s"
        );
    }
}

/// A sync of the answers written out when it was taken ([`AnswerLog::sync_handle`]).
#[derive(Debug)]
pub struct AnswersSync {
    path: PathBuf,
    file: File,
    // The log's flag that a sync failed, which has its next batch rewrite it from memory.
    failed: Arc<AtomicBool>,
}

impl AnswersSync {
    /// Syncs the answers. A failure is reported on stderr (once until the rewrite) and has
    /// the log's next [`AnswerLog::compact_if_large`] rewrite the file from memory: the
    /// kernel may have dropped pages it could not write.
    pub fn sync(self) {
        if let Err(err) = self.file.sync_data() {
            if !self.failed.swap(true, Ordering::AcqRel) {
                log_line!(
                    "tallyd: warning: {}: {err}; the file's rewrite from memory begins at \
                     the next batch",
                    self.path.display()
                );
            }
        }
    }
}

/// The newest answer of each of the newest [`RECENT_IDS_MAX`] ids whose newest answer is
/// in a window live at `now_unix_secs`, over the earlier lives' files in `dir`, oldest
/// first; and the newest generation of a file kept (0 if none), which the next life's
/// generation must pass. Once every file is read, each is rewritten with the answers it
/// keeps, or removed if it keeps none, oldest first; a rewrite cut off by a crash is
/// removed first (its file is whole).
pub fn recover(dir: &Path, now_unix_secs: u64) -> Result<(Vec<AnsweredId>, u64), LogError> {
    let io = LogError::io_at;
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        paths.push(entry.map_err(io(dir))?.path());
    }
    // Before anything is changed: a log left out would have its answers counted again.
    if let Some(path) = paths.iter().find(|path| is_misnamed_log(path)) {
        let why = "an answer log's name, but its generation is not written as a node \
                   writes one (answers-5.log, not answers-05.log): rename it, or move it \
                   away; not started, so as not to count its answers' retries again";
        let source = std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        return Err(io(path)(source));
    }
    let mut lives = Vec::new();
    for path in paths {
        match file_generation(&path) {
            Some((generation, "log")) => lives.push((generation, path)),
            // A rewrite's copy (a start's, or a running life's) cut off by a crash.
            Some((_, "compact" | "copy.compact")) => {
                std::fs::remove_file(&path).map_err(io(&path))?;
            }
            _ => {}
        }
    }
    lives.sort_unstable_by_key(|(generation, _)| std::cmp::Reverse(*generation));
    let mut room = RECENT_IDS_MAX;
    // Ids kept from newer answers: an older answer of one is superseded.
    let mut seen = seen();
    let mut keeps = Vec::new();
    for (generation, path) in lives {
        // Each id's newest answer only, kept if its window is live: an older answer of an
        // id whose newest one's window is over is superseded, as in the memory.
        let newest_first = replay(&read_whole(&path)?).into_iter().rev();
        let keep = newest_ids(newest_first, room, &mut seen, |remembered| {
            remembered.window.is_live(now_unix_secs)
        });
        room -= keep.len();
        keeps.push((generation, path, keep));
    }
    // Every file read before any is changed, and the oldest changed first: a start stopped
    // part way (a file it cannot read, a crash) leaves each newer file whole, with the
    // answers whose windows are over that supersede older ones. A newer file rewritten
    // first drops them, and the next start took up the older answers again.
    let (mut kept, mut newest_kept) = (Vec::new(), 0);
    for (generation, path, keep) in keeps.into_iter().rev() {
        if keep.is_empty() {
            std::fs::remove_file(&path).map_err(io(&path))?;
        } else {
            rewrite(&path, &keep)?;
            kept.push(keep);
            newest_kept = newest_kept.max(generation);
        }
    }
    Ok((kept.into_iter().flatten().collect(), newest_kept))
}

/// Whether `path` is named as an answer log but for its generation, not written as a node
/// writes one.
fn is_misnamed_log(path: &Path) -> bool {
    let name = path.file_name().and_then(|name| name.to_str());
    name.is_some_and(|name| name.starts_with("answers-") && name.ends_with(".log"))
        && file_generation(path).is_none()
}

/// The generation and the extension of an `answers-<generation>.<extension>` file.
fn file_generation(path: &Path) -> Option<(u64, &str)> {
    let name = path.file_name()?.to_str()?.strip_prefix("answers-")?;
    let (generation, extension) = name.split_once('.')?;
    Some((crate::lanelog::generation_named(generation)?, extension))
}

/// The answers in a file's `bytes`, in order, skipping a record that checks but does not
/// decode. Past a record that does not check (a torn tail, or damage after it was written),
/// the next one is looked for at each byte after it: the answers behind damage are kept,
/// where stopping there would drop them for good at the rewrite. A false record needs a
/// checksum that matches by chance (one in 2^32) and a body that decodes; it would remember
/// an answer under an id no one is likely to send.
pub fn replay(bytes: &[u8]) -> Vec<AnsweredId> {
    let mut answers = VecDeque::new();
    let mut at = 0;
    while at < bytes.len() {
        let Some((body, next)) = checksummed::read_body(bytes, at) else {
            at += 1;
            continue;
        };
        at = next;
        let Some(record) = checksummed::decode::<Record>(body) else {
            continue;
        };
        let Ok(window) = Window::new(record.window_index, record.window_secs) else {
            continue;
        };
        let remembered = Remembered {
            answered: record.answered,
            asked: record.asked,
            window,
        };
        answers.push_back((record.id, remembered));
    }
    answers.into()
}

/// The newest answer of each of the newest `max` ids of `newest_first` not in `seen` whose
/// newest answer is `kept_if`, oldest first; every id met is added to `seen` (its older
/// answers are superseded, kept or not).
fn newest_ids(
    newest_first: impl Iterator<Item = AnsweredId>,
    max: usize,
    seen: &mut HashSet<CheckId, KeyHasher>,
    kept_if: impl Fn(&Remembered) -> bool,
) -> Vec<AnsweredId> {
    let mut kept = Vec::new();
    for answered in newest_first {
        if kept.len() == max {
            break;
        }
        if seen.insert(answered.0) && kept_if(&answered.1) {
            kept.push(answered);
        }
    }
    kept.reverse();
    kept
}

/// An empty set of ids, for [`newest_ids`].
fn seen() -> HashSet<CheckId, KeyHasher> {
    HashSet::with_hasher(KeyHasher::new())
}

/// Replaces the file at `path` with `answers`, synced (`lanelog::open` syncs the directory
/// before it returns).
fn rewrite(path: &Path, answers: &[AnsweredId]) -> Result<(), LogError> {
    let mut body = Vec::new();
    for answered in answers {
        encode(answered, &mut body);
    }
    replace_by_copy(path, &body)
}

/// Appends the record of `answered` to `out`.
pub fn encode((id, remembered): &AnsweredId, out: &mut Vec<u8>) {
    let record = Record {
        id: *id,
        window_index: remembered.window.index(),
        window_secs: remembered.window.len_secs(),
        answered: remembered.answered,
        asked: remembered.asked,
    };
    checksummed::append(&record, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_client::wire::{Decision, Mode};
    use tally_crdt::{KeyRef, Rule};

    const NOW: u64 = 1_700_000_000;

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tally-answers-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn answer(seq: u64, window: Window) -> AnsweredId {
        let decision = Decision {
            allowed: true,
            estimate: i128::from(seq),
            limit: 1_000_000,
            remaining: 1,
            reset_after_ms: 1_000,
            mode: Mode::ApproximateConnected,
            staleness_ms: 0,
            bound: 0.0,
        };
        let remembered = Remembered {
            answered: Answered::Decided(decision),
            asked: Asked::of(
                KeyRef::new(&Rule::new("api").unwrap(), "s", window).unwrap(),
                seq,
            ),
            window,
        };
        (CheckId { session: 9, seq }, remembered)
    }

    fn live() -> Window {
        Window::containing(NOW, 60).unwrap()
    }

    fn seqs(answers: &[AnsweredId]) -> Vec<u64> {
        answers.iter().map(|(id, _)| id.seq).collect()
    }

    /// Writes `answers` as life `generation`'s file.
    fn life(dir: &Path, generation: u64, answers: impl IntoIterator<Item = AnsweredId>) {
        let mut log = AnswerLog::create(dir, Generation(generation)).unwrap();
        for answered in answers {
            log.append(answered);
        }
        log.flush();
    }

    #[test]
    fn a_start_keeps_the_newest_live_answers_over_every_life_and_removes_the_rest() {
        let dir = dir("lives");
        let over = Window::containing(NOW - 600, 60).unwrap();
        let max = RECENT_IDS_MAX as u64;
        // The oldest life's answers are all pushed out by the newer lives' ones.
        life(&dir, 1, (0..10).map(|seq| answer(seq, live())));
        life(&dir, 2, (10..20).map(|seq| answer(seq, live())));
        life(&dir, 3, [answer(20, over)]);
        life(&dir, 4, (21..21 + max - 5).map(|seq| answer(seq, live())));
        let (recovered, newest) = recover(&dir, NOW).unwrap();
        let expected: Vec<u64> = (15..20).chain(21..21 + max - 5).collect();
        assert_eq!((seqs(&recovered), newest), (expected.clone(), 4));
        let files = |generation: u64| dir.join(format!("answers-{generation}.log")).exists();
        assert_eq!(
            [1, 2, 3, 4].map(files),
            [false, true, false, true],
            "a life that keeps nothing is removed"
        );
        // Rewritten with what each kept: the next start finds the same.
        assert_eq!(seqs(&recover(&dir, NOW).unwrap().0), expected);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_log_named_with_its_generation_written_otherwise_stops_the_start() {
        let dir = dir("misnamed");
        life(&dir, 5, [answer(1, live())]);
        std::fs::copy(dir.join("answers-5.log"), dir.join("answers-05.log")).unwrap();
        let before = std::fs::read(dir.join("answers-5.log")).unwrap();
        let err = recover(&dir, NOW).unwrap_err().to_string();
        assert!(
            err.contains("answers-05.log") && err.contains("rename"),
            "{err}"
        );
        let after = std::fs::read(dir.join("answers-5.log")).unwrap();
        assert!(before == after, "the start changed a log before it stopped");
        std::fs::remove_file(dir.join("answers-05.log")).unwrap();
        assert_eq!(seqs(&recover(&dir, NOW).unwrap().0), [1]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_record_that_checks_but_does_not_decode_is_skipped_and_a_torn_tail_dropped() {
        let dir = dir("skipped");
        let mut bytes = Vec::new();
        encode(&answer(1, live()), &mut bytes);
        // As a later build might write: a whole record of another shape.
        checksummed::append(&("a record of another shape", 7u8), &mut bytes);
        encode(&answer(2, live()), &mut bytes);
        let whole = bytes.len();
        encode(&answer(3, live()), &mut bytes);
        let path = dir.join("answers-5.log");
        std::fs::write(&path, &bytes[..whole + 9]).unwrap();
        assert_eq!(seqs(&recover(&dir, NOW).unwrap().0), [1, 2]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_answers_after_a_damaged_record_are_kept() {
        let dir = dir("damaged");
        let mut bytes = Vec::new();
        for seq in 1..=4 {
            encode(&answer(seq, live()), &mut bytes);
        }
        let one = bytes.len() / 4;
        // A flipped bit in the second record's body, and the third's length cut short.
        bytes[one + 10] ^= 0x01;
        bytes[2 * one] = 3;
        std::fs::write(dir.join("answers-5.log"), &bytes).unwrap();
        assert_eq!(seqs(&recover(&dir, NOW).unwrap().0), [1, 4]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Calls [`AnswerLog::compact_if_large`] until the compaction under way is finished.
    fn finish_compaction(log: &mut AnswerLog) {
        for _ in 0..10_000 {
            if log.compaction.is_none() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
            log.compact_if_large();
        }
        panic!("the copy's thread reports within 10 s");
    }

    #[test]
    fn a_copy_cut_off_by_a_crash_is_removed_at_the_next_start() {
        let dir = dir("copy-left-over");
        life(&dir, 7, [answer(1, live())]);
        let copy = dir.join("answers-7.copy.compact");
        std::fs::write(&copy, b"half a copy").unwrap();
        assert_eq!(seqs(&recover(&dir, NOW).unwrap().0), [1]);
        assert!(!copy.exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_compaction_writes_the_lifes_last_answers_and_appending_goes_on() {
        let dir = dir("compaction");
        let mut log = AnswerLog::create(&dir, Generation(7)).unwrap();
        let max = RECENT_IDS_MAX as u64;
        for seq in 0..max + 3 {
            log.append(answer(seq, live()));
        }
        log.flush();
        log.compact_at = 0;
        log.compact_if_large();
        assert!(log.compaction.is_some(), "the copy is being written");
        // Given while the copy is written: appended, and kept for the copy.
        log.append(answer(max + 3, live()));
        log.flush();
        finish_compaction(&mut log);
        log.append(answer(max + 4, live()));
        log.flush();
        assert!(!crate::compaction::copy_path(&log.path).exists());
        let bytes = std::fs::read(&log.path).unwrap();
        let mut records = 0;
        let mut at = 0;
        while let Some((_, next)) = checksummed::read_body(&bytes, at) {
            (records, at) = (records + 1, next);
        }
        assert_eq!(
            (records, at),
            (max + 2, bytes.len()),
            "the last answers, the one given during the copy, and one more"
        );
        assert_eq!(
            seqs(&replay(&read_whole(&log.path).unwrap())),
            (3..max + 5).collect::<Vec<_>>()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// An hour's id, then half the bound's ids in one-second windows, each answered again
    /// 10 s later, once its first window is over, as a life gives them: logged to `log`,
    /// and remembered in a sidecar's memory ([`crate::recent::RecentIds`]), which holds
    /// the hour's id (half the bound's ids and one). Returns the hour's id.
    fn a_live_id_behind_ids_answered_again(log: &mut AnswerLog) -> CheckId {
        let mut memory = crate::recent::RecentIds::default();
        let half = RECENT_IDS_MAX as u64 / 2;
        let hour = Window::containing(NOW, 3_600).unwrap();
        let hourly = (CheckId { session: 1, seq: 0 }, answer(0, hour).1);
        let mut given = vec![(hourly, NOW - 10)];
        let first = Window::containing(NOW - 10, 1).unwrap();
        let again = Window::containing(NOW, 1).unwrap();
        given.extend((1..=half).map(|seq| (answer(seq, first), NOW - 10)));
        given.extend((1..=half).map(|seq| (answer(seq, again), NOW)));
        for (answered, live_at) in given {
            memory.insert(answered.0, answered.1, live_at);
            log.append(answered);
        }
        log.flush();
        assert!(
            memory.get(hourly.0, NOW * 1_000, NOW).is_some(),
            "the memory holds it"
        );
        hourly.0
    }

    /// A start remembers the live ids the last life's memory held: an id answered again
    /// (its first window over) adds an answer to the log but no id to the memory, which
    /// counts ids held since session 47. Counted as answers, the hour's id was dropped by
    /// the replay (its file's last RECENT_IDS_MAX records), with half the bound's live
    /// ids kept, and a retry of it sent to the next life counted again.
    #[test]
    fn a_start_keeps_a_live_id_the_memory_held_behind_ids_answered_again() {
        let dir = dir("start-answered-again");
        let mut log = AnswerLog::create(&dir, Generation(7)).unwrap();
        let hourly = a_live_id_behind_ids_answered_again(&mut log);
        drop(log);
        let (recovered, _) = recover(&dir, NOW).unwrap();
        assert!(
            recovered.iter().any(|(id, _)| *id == hourly),
            "the next life forgot a live id the last life's memory held \
             ({} live answers kept): a retry of it counts again",
            recovered.len()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// The same for a life's compaction: it rewrote the file as its last RECENT_IDS_MAX
    /// answers, not the answers of its last RECENT_IDS_MAX ids.
    #[test]
    fn a_compaction_keeps_a_live_id_the_memory_holds_behind_ids_answered_again() {
        let dir = dir("compaction-answered-again");
        let mut log = AnswerLog::create(&dir, Generation(7)).unwrap();
        let hourly = a_live_id_behind_ids_answered_again(&mut log);
        log.compact_at = 0;
        log.compact_if_large();
        finish_compaction(&mut log);
        let kept = replay(&read_whole(&log.path).unwrap());
        assert!(
            kept.iter().any(|(id, _)| *id == hourly),
            "the compaction dropped a live id the memory holds ({} answers kept)",
            kept.len()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A compaction writes the newest answer of each of the life's newest RECENT_IDS_MAX
    /// ids, oldest first, while ids answered again are no more than half of the last
    /// `ANSWERS_KEPT` answers: here the newest id answered again RECENT_IDS_MAX times
    /// behind the others. The copy in memory holds at most `ANSWERS_KEPT` answers.
    #[test]
    fn a_compaction_writes_the_newest_answer_of_the_newest_ids_within_the_bound() {
        let dir = dir("copy-bound");
        let mut log = AnswerLog::create(&dir, Generation(7)).unwrap();
        let max = RECENT_IDS_MAX as u64;
        let id = |seq| CheckId { session: 4, seq };
        for seq in 0..max + 100 {
            log.append((id(seq), answer(seq, live()).1));
        }
        for again in 0..max {
            log.append((id(max + 99), answer(again, live()).1));
        }
        assert_eq!(log.answered.len(), ANSWERS_KEPT, "the copy's bound");
        log.flush();
        log.compact_at = 0;
        log.compact_if_large();
        finish_compaction(&mut log);
        let written = replay(&read_whole(&log.path).unwrap());
        let ids: Vec<CheckId> = written.iter().map(|(id, _)| *id).collect();
        assert_eq!(
            ids,
            (100..max + 100).map(id).collect::<Vec<_>>(),
            "the newest ids, each once, oldest first"
        );
        assert_eq!(
            written.last().unwrap().1,
            answer(max - 1, live()).1,
            "the id answered again: its newest answer"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// (Review of dfc8d90.) An id whose newest answer's window is over is not held by the
    /// memory (`RecentIds` keeps one answer an id, its newest, and answers a retry afresh
    /// once that window is over), nor by a compaction (which keeps that newest answer). A
    /// start filtered the dead answers out before it looked for each id's newest, so it
    /// took up the id's older, superseded answer, still in a longer live window (the rule's
    /// window shortened across a restart, or the wall clock stepped back): the next life
    /// gave a retry that old answer (or refused it `BadField`) where the last one decided
    /// it afresh, and whether it did depended on whether a compaction had run.
    #[test]
    fn a_start_does_not_take_up_an_answer_superseded_by_one_whose_window_is_over() {
        let dir = dir("superseded-dead");
        let id = CheckId { session: 9, seq: 1 };
        let hour = Window::containing(NOW - 20, 3_600).unwrap();
        let second = Window::containing(NOW - 10, 1).unwrap();
        let first = (id, answer(1, hour).1);
        let again = (id, answer(1, second).1);
        life(&dir, 7, [first]);
        life(&dir, 8, [again, answer(2, live())]);
        // The memory of life 8, given both answers in order.
        let mut memory = crate::recent::RecentIds::remembering([first], NOW - 20);
        memory.insert(again.0, again.1, NOW - 10);
        assert!(
            memory.get(id, NOW * 1_000, NOW).is_none(),
            "answered afresh"
        );
        let (recovered, _) = recover(&dir, NOW).unwrap();
        let next = crate::recent::RecentIds::remembering(recovered.iter().copied(), NOW);
        assert!(
            next.get(id, NOW * 1_000, NOW).is_none(),
            "the next life remembers a superseded answer the last life's memory no longer \
             gave: {recovered:?}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A start stopped part way (here by a file it cannot read; a crash, or a removal
    /// that fails, likewise) leaves the next start the same answers to keep: it changed
    /// no file yet. Before, it had rewritten the newer life's file without the answer
    /// whose window was over, and the next start took up the older answer that answer
    /// superseded.
    #[test]
    fn a_start_stopped_part_way_leaves_no_superseded_answer_to_take_up() {
        let dir = dir("stopped-part-way");
        let id = CheckId { session: 9, seq: 1 };
        let hour = Window::containing(NOW - 20, 3_600).unwrap();
        let second = Window::containing(NOW - 10, 1).unwrap();
        let first = (id, answer(1, hour).1);
        life(&dir, 8, [(id, answer(1, second).1), answer(2, live())]);
        let older = dir.join("answers-7.log");
        std::fs::create_dir(&older).unwrap();
        recover(&dir, NOW).expect_err("a life's file that cannot be read stops the start");
        std::fs::remove_dir(&older).unwrap();
        life(&dir, 7, [first]);
        let (recovered, _) = recover(&dir, NOW).unwrap();
        let next = crate::recent::RecentIds::remembering(recovered.iter().copied(), NOW);
        assert!(
            next.get(id, NOW * 1_000, NOW).is_none(),
            "the next life remembers a superseded answer: {recovered:?}"
        );
        assert_eq!(seqs(&recovered), [2]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_failed_write_stops_the_logging_until_a_rewrite_from_memory_succeeds() {
        let dir = dir("stopped");
        let mut log = AnswerLog::create(&dir, Generation(7)).unwrap();
        log.append(answer(0, live()));
        log.flush();
        // A file that refuses writes, as on a full disk.
        log.file = File::open(&log.path).unwrap();
        log.append(answer(1, live()));
        log.flush();
        log.append(answer(2, live()));
        log.flush();
        log.compact_if_large();
        assert!(log.compaction.is_none(), "not tried before the next tick");
        // A rewrite that fails too: the copy's path taken by a directory.
        let copy = crate::compaction::copy_path(&log.path);
        std::fs::create_dir(&copy).unwrap();
        log.sync_in_background();
        log.compact_if_large();
        assert!(log.compaction.is_some(), "tried at the tick");
        finish_compaction(&mut log);
        assert!(log.stopped.is_some(), "still stopped");
        std::fs::remove_dir(&copy).unwrap();
        log.sync_in_background();
        log.compact_if_large();
        assert!(
            log.compaction.is_none(),
            "tried again after twice as many ticks"
        );
        log.sync_in_background();
        log.compact_if_large();
        assert!(log.compaction.is_some(), "the rewrite is under way");
        // Given while the copy is written: kept for it.
        log.append(answer(3, live()));
        log.flush();
        finish_compaction(&mut log);
        assert!(log.stopped.is_none(), "logging again");
        log.append(answer(4, live()));
        log.flush();
        assert_eq!(
            seqs(&replay(&read_whole(&log.path).unwrap())),
            [0, 1, 2, 3, 4]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A compaction given up (more answers written while its copy was than it may keep,
    /// `compaction::SINCE_BYTES_MAX`) leaves the file as it was, whole, and answers go on
    /// being written to it. Before, it stopped the logging as a failed write does: the
    /// answers given until a rewrite from memory succeeded (at the rate that gave the copy
    /// up, each rewrite is given up too) were held in memory only, though the disk took
    /// every write, and a retry after a process crash counted them again.
    #[test]
    #[cfg(not(tally_loom))]
    fn a_compaction_given_up_leaves_the_file_whole_and_answers_logged() {
        let dir = dir("given-up");
        let mut log = AnswerLog::create(&dir, Generation(7)).unwrap();
        log.append(answer(0, live()));
        log.flush();
        log.compact_at = 0;
        log.compact_if_large();
        log.compaction
            .as_mut()
            .expect("the copy is being written")
            .give_up();
        log.append(answer(1, live()));
        log.flush();
        finish_compaction(&mut log);
        log.compact_if_large();
        assert!(
            log.compaction.is_none(),
            "tried again once the file has grown"
        );
        // Acknowledged once flushed: a process crash now keeps what the file holds.
        log.append(answer(2, live()));
        log.flush();
        assert_eq!(
            seqs(&replay(&read_whole(&log.path).unwrap())),
            [0, 1, 2],
            "an answer given after a compaction was given up is not in the file: a retry \
             after a process crash counts again"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn after_a_failed_sync_the_file_is_rewritten_from_memory() {
        let dir = dir("sync-failed");
        let mut log = AnswerLog::create(&dir, Generation(7)).unwrap();
        for seq in 0..5 {
            log.append(answer(seq, live()));
        }
        log.flush();
        // Pages the kernel dropped when their writeback failed: the file lacks them.
        std::fs::write(&log.path, b"").unwrap();
        log.compact_if_large();
        assert!(log.compaction.is_none(), "not due without a failure");
        log.sync_failed.store(true, Ordering::Release);
        log.compact_if_large();
        finish_compaction(&mut log);
        assert_eq!(
            seqs(&replay(&read_whole(&log.path).unwrap())),
            [0, 1, 2, 3, 4]
        );
        assert!(!log.sync_failed.load(Ordering::Acquire), "rewritten once");
        log.append(answer(5, live()));
        log.flush();
        assert_eq!(
            seqs(&replay(&read_whole(&log.path).unwrap())),
            [0, 1, 2, 3, 4, 5]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
