//! The data directory: the generation file, and per generation a log of this node's own
//! lane writes, so that a restart loses none of what it acknowledged. One process at a time
//! uses it ([`lock`]). (Its `answers-<generation>.log` files are [`crate::answerlog`]'s, its
//! `expiry` file is [`crate::expiry_mark`]'s, and `region.log` the region's.)
//!
//! # Restart semantics
//!
//! Every start takes a new generation, above the last one and every log's in the
//! directory (by more than the versions the last start re-published at), and at least the
//! wall clock in ms, written and synced before the node serves: a replica id is never used
//! by two lives, even when the generation file was lost (one that does not parse stops the
//! start), or the data directory was wiped (the wall clock then keeps it new, unless it
//! stepped back past the previous start). A generation ahead of the wall clock (a start
//! soon after the last) is waited out before it is written, and so before the node serves
//! ([`Recovered::wait_ms`]), so that a later start with the directory wiped does not take
//! it again, and a start killed in the wait leaves nothing of its life.
//!
//! A life's writes are appended to `lanes-<generation>.log` before they are acknowledged
//! and before the gossip task can see them (see `listener`), and the gossip sends them only
//! once the log is synced (see `handoff`), so after a crash, of the process or of the
//! machine, a log holds at least every lane value any peer ever received from that life.
//! (A machine crash loses the writes acknowledged but not yet synced, which no peer
//! received either.) After a restart the node replays the
//! logs of its earlier lives and re-publishes their lanes as those (retired) replicas, at
//! versions above any a peer can hold (`CounterMap::raise_version` to
//! [`Recovered::republish_floor`]), so the merge of the logged totals with the peers'
//! copies is the largest of both: nothing acknowledged is lost, and nothing is counted
//! twice. (A log behind what peers hold, as after a restored disk snapshot, is mended by
//! the gossip where it re-published a lane: `Gossip::with_republished`.) A log is deleted
//! once every window in it is over. A log compacted (rewritten as one record per live key
//! with a non-zero own lane) is written beside itself as `lanes-<generation>.compact` and
//! renamed over itself; a start removes such a file left by a crash.
//!
//! A record is `[len u32][crc32 u32][body]`. Replay reads records until one is short, of
//! length 0, or fails its checksum; if nothing but zeros follows, that is the log's end,
//! and otherwise it reads on past the damage, keeping every whole record after it. A log is
//! allocated ahead with zeros (a MiB at a time), so that the sync each collection waits
//! for (`handoff`) writes the records' blocks alone: one that grows the file also commits
//! its size and blocks (a journal commit on ext4), which costs more and holds up the
//! region log's syncs on the same disk. The zeros end the replay (a record is never
//! empty); anything else after the last whole record is a torn tail.

use crate::answerlog::{self, AnswerLog, AnsweredId, AnswersSync};
use crate::checksummed;
use crate::compaction::Compaction;
use crate::recent::Remembered;
use crate::store::LaneStore;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tally_client::wire::CheckId;
use tally_crdt::{Generation, Key, Lane, NodeId, ReplicaId, Rule, Subject, Version, Window};

/// Why the data directory could not be used. The node refuses to start; or, once serving,
/// refuses a write whose record the log had no room allocated for (a full disk), and every
/// write after a failed flush.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A file operation failed.
    #[error("data dir: {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// Another process holds the data directory: two nodes on one directory would replay,
    /// compact and remove each other's logs.
    #[error(
        "data dir: {dir} is in use by another process (it holds the directory's lock); not \
         started: two nodes on one data directory would overwrite each other's logs"
    )]
    InUse {
        /// The directory.
        dir: PathBuf,
    },
    /// An earlier append failed; the log accepts nothing more.
    #[error("data dir: the lane log failed earlier ({0}); writes are refused until restart")]
    Failed(String),
}

impl LogError {
    /// Turns a failed file operation on `path` into a [`LogError::Io`] naming it.
    pub(crate) fn io_at(path: &Path) -> impl Fn(std::io::Error) -> LogError + '_ {
        move |source| LogError::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// The largest generation a start takes, so that its floor in microseconds
/// ([`Recovered::republish_floor`]) and the versions above it fit a `u64`: the wall clock in
/// ms is about 1.8 * 10^12, this is about 9.2 * 10^15.
const GENERATION_MAX: u64 = u64::MAX / 2_000;

/// A log grown past this many bytes (or twice its size after the last compaction, if that
/// is more) is rewritten as one record per live key; after a failed rewrite, once it has
/// grown by this much more.
const COMPACT_BYTES: u64 = 64 << 20;

/// How far ahead of its records the log is allocated with zeros, at a time: the sync after
/// an allocation commits the new size, the ones until the next only the records.
const ALLOCATE_BYTES: u64 = 1 << 20;

/// One logged write: amounts added to the own lane's two totals.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    rule: String,
    subject: String,
    window_index: u64,
    window_secs: u32,
    incr: u64,
    decr: u64,
}

/// What a start recovered from the data directory.
#[derive(Debug)]
pub struct Recovered {
    /// This life's generation.
    pub generation: Generation,
    /// Earlier lives' own lanes, per retired replica, from their logs (live windows and
    /// non-zero lanes only).
    pub retired: Vec<(ReplicaId, Vec<(Key, Lane)>)>,
    /// The answers earlier lives gave under request ids: the newest answer of each of the
    /// newest [`crate::recent::RECENT_IDS_MAX`] ids whose newest answer is in a live
    /// window, oldest first ([`answerlog`]).
    pub answered: Vec<AnsweredId>,
    /// How many logs had a torn tail, dropped.
    pub torn: usize,
    /// How long the start waited before it took its generation, so that the wall clock
    /// passes it before the node serves: 0 unless the generation runs ahead of it
    /// ([`open`]).
    pub wait_ms: u64,
}

impl Recovered {
    /// The version earlier lives' lanes are re-published above: this generation in
    /// microseconds, above every version a peer can hold of them. A life's own versions
    /// count up from 0, far below; the last start re-published them one version per lane
    /// above its own generation in microseconds, and this generation is past that
    /// ([`open`]), whatever the clock says now.
    pub fn republish_floor(&self) -> Version {
        Version(self.generation.0.saturating_mul(1_000))
    }
}

/// Opens `dir` for `node`: checks that the directory is `node`'s (its `node` file), replays
/// earlier logs, deletes the ones whose windows are all over, picks the new generation,
/// `wait`s out how far it is ahead of the wall clock `wall_ms` (if it is), then syncs it
/// and opens this life's log.
pub fn open(
    dir: &Path,
    node: NodeId,
    wall_ms: u64,
    now_unix_secs: u64,
    wait: impl FnOnce(Duration),
) -> Result<(LaneLog, Recovered), LogError> {
    let io = LogError::io_at;
    create_dir_durably(dir).map_err(io(dir))?;
    claim(dir, node)?;
    let generation_file = dir.join("generation");
    let last = match std::fs::read_to_string(&generation_file) {
        Ok(text) => text.trim().parse::<u64>().map_err(|_| {
            let why = format!(
                "holds {text:?}, not a generation; not started, so that no generation is \
                 used twice (remove the file if the directory's logs are to be kept \
                 and the clock is right)"
            );
            let source = std::io::Error::new(std::io::ErrorKind::InvalidData, why);
            io(&generation_file)(source)
        })?,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => 0,
        Err(source) => return Err(io(&generation_file)(source)),
    };

    let mut retired = Vec::new();
    let (mut torn, mut log_generation_max, mut lanes_max) = (0, 0, 0);
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        paths.push(entry.map_err(io(dir))?.path());
    }
    // Before anything is changed: a log left out would lose its lanes.
    if let Some(path) = paths.iter().find(|path| is_misnamed_log(path)) {
        let why = "a lane log's name, but its generation is not written as a node writes \
                   one (lanes-5.log, not lanes-05.log): rename it, or move it away; not \
                   started, so as not to leave its lanes out";
        let source = std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        return Err(io(path)(source));
    }
    // First, since a log's rewrite below writes a file of that name.
    for path in paths.iter().filter(|path| is_compaction_left_over(path)) {
        // A crash inside a running life's compaction (its copy's thread, or its finish) or
        // a start's `rewrite` left it before its rename: its log was never replaced, and
        // still holds every record (the rename is synced before anything else is written).
        std::fs::remove_file(path).map_err(io(path))?;
    }
    // Each earlier life's log and its live lanes, read now and rewritten after the wait
    // below: a start killed in it leaves the logs as the last served start did, whose
    // lanes the next start skips past (found in review, session 47: rewritten first, they
    // lost the expired lanes the last start had re-published, and the next start took a
    // generation too low to skip past them).
    let mut logs = Vec::new();
    for path in paths {
        let Some(old) = log_generation(&path) else {
            continue;
        };
        log_generation_max = log_generation_max.max(old);
        let (lanes, dropped) = replay_file(&path)?;
        torn += dropped;
        // Counted with the expired ones: the last start re-published the log as it was.
        lanes_max = lanes_max.max(lanes.len() as u64);
        // A zero lane says nothing (an earlier build's compaction wrote one for every key
        // the store held, remote ones too): re-published, it would only add a slot to
        // every key at every peer.
        let live: Vec<(Key, Lane)> = lanes
            .into_iter()
            .filter(|(key, lane)| key.window.is_live(now_unix_secs) && *lane != Lane::default())
            .collect();
        logs.push((path, old, live));
    }
    let (answered, answers_generation_max) = answerlog::recover(dir, now_unix_secs)?;
    // The last start re-published each earlier life's lanes from its generation times
    // 1000 up, one version per lane (`Recovered::republish_floor`): skip past them, a
    // millisecond per thousand lanes or part of one, and two more, so that at least 2,000
    // versions are left above them for that life's restamps, whatever the clock says now.
    // Its generation is the newest log's (of lanes or answers), or the file's if that was
    // lost.
    let previous = last.max(log_generation_max).max(answers_generation_max);
    let generation = previous
        .saturating_add(2 + lanes_max.div_ceil(1_000))
        .max(wall_ms);
    if generation > GENERATION_MAX {
        let why = format!(
            "the next generation, {generation}, is past {GENERATION_MAX}: the file, or a \
             lanes-<generation>.log or answers-<generation>.log name, is not one this node \
             wrote"
        );
        let source = std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        return Err(io(&generation_file)(source));
    }
    // A start soon after the last takes a generation ahead of the wall clock (past the
    // versions the last start re-published), which it waits out before it serves: a later
    // start with this directory wiped takes the wall clock's, and must not take this one
    // (found in review, session 46). A clock stepped back past the last start is not waited
    // out: that could take hours, and a wiped start is not kept new then anyway. The wait
    // comes before anything of this life is written and before the earlier logs are
    // rewritten, so that a start killed in it leaves the generation and the lane logs as
    // the last served start did, and the next start is not ahead of a generation no life
    // served (found in review, session 47: it read that one as a clock stepped back,
    // waited nothing, and served under a generation the wall clock had not passed).
    let wait_ms = if previous < wall_ms {
        (generation + 1).saturating_sub(wall_ms)
    } else {
        0
    };
    wait(Duration::from_millis(wait_ms));
    for (path, old, live) in logs {
        if live.is_empty() {
            std::fs::remove_file(&path).map_err(io(&path))?;
        } else {
            rewrite(&path, &live)?;
            retired.push((ReplicaId::new(node, Generation(old)), live));
        }
    }
    let generation = Generation(generation);
    replace_synced(dir, "generation", generation.0.to_string().as_bytes())?;
    let recovered = Recovered {
        generation,
        retired,
        answered,
        torn,
        wait_ms,
    };
    let path = dir.join(format!("lanes-{}.log", generation.0));
    // Written at offsets, over the zeros allocated ahead: not in append mode, where Linux
    // writes at the end whatever the offset. New: the generation is above every log's.
    let file = OpenOptions::new()
        .create_new(true)
        .write(true)
        .open(&path)
        .map_err(io(&path))?;
    let answers = AnswerLog::create(dir, generation)?;
    sync_dir(dir)?;
    let log = LaneLog {
        path,
        file,
        pending: Vec::new(),
        written: 0,
        allocated: 0,
        compact_at: COMPACT_BYTES,
        compaction: None,
        failed: None,
        answers,
    };
    Ok((log, recovered))
}

/// Creates `dir` if it is missing and takes an exclusive lock on it (an `flock` of the
/// directory itself, so that no file in it can be removed to defeat it), or refuses with
/// [`LogError::InUse`] if another process holds it. The lock lasts while the returned
/// handle is open: the OS lets go of it when the process ends, however it ends.
///
/// Taken before anything in the directory is read or changed, and held by `tallyd` until
/// it exits: a second node started on the directory (by mistake, or while the first is
/// still stopping) would otherwise take the running one's lane log for an earlier life's,
/// and compact the region log under a region still appending to it, whose later
/// acknowledged checks would go to a file no longer there.
pub fn lock(dir: &Path) -> Result<File, LogError> {
    let io = LogError::io_at(dir);
    create_dir_durably(dir).map_err(&io)?;
    let handle = File::open(dir).map_err(&io)?;
    match handle.try_lock() {
        Ok(()) => Ok(handle),
        Err(std::fs::TryLockError::WouldBlock) => Err(LogError::InUse {
            dir: dir.to_owned(),
        }),
        Err(std::fs::TryLockError::Error(source)) => Err(io(source)),
    }
}

/// This life's log of own lane writes. Appends are buffered; [`LaneLog::flush`] writes them
/// out, and a write is acknowledged only after its flush returned.
#[derive(Debug)]
pub struct LaneLog {
    path: PathBuf,
    file: File,
    pending: Vec<u8>,
    // The end of the records: where the next are written.
    written: u64,
    // The file's length: zeros from `written` on.
    allocated: u64,
    // The size past which the log is compacted next.
    compact_at: u64,
    // A compaction whose copy is being written, if one is.
    compaction: Option<Compaction>,
    failed: Option<String>,
    // What this life answered under request ids, written out after the lane records.
    answers: AnswerLog,
}

impl LaneLog {
    /// Buffers a write of `incr` and `decr` to `key`'s own lane; returns a mark that
    /// [`LaneLog::undo`] takes back to. Refused once a flush has failed, and refused
    /// (with nothing buffered) when the file has no room allocated for it and allocating
    /// more fails, as on a full disk: the write is then refused with the OS's error, and a
    /// later one is tried again, so the log takes writes again once there is room.
    pub fn append(&mut self, key: &Key, incr: u64, decr: u64) -> Result<usize, LogError> {
        if let Some(why) = &self.failed {
            return Err(LogError::Failed(why.clone()));
        }
        let mark = self.pending.len();
        encode(key, incr, decr, &mut self.pending);
        let end = self.written + self.pending.len() as u64;
        if let Err(source) = self.allocate_for(end) {
            // Zeros alone were written, after the records: nothing to undo but the record.
            self.pending.truncate(mark);
            return Err(LogError::Io {
                path: self.path.clone(),
                source,
            });
        }
        Ok(mark)
    }

    /// Buffers the answer given under `id`, for the node's next life
    /// ([`Recovered::answered`]). Call after the answer's own writes were appended: it is
    /// written out after them.
    pub fn append_answered(&mut self, id: CheckId, remembered: Remembered) {
        self.answers.append((id, remembered));
    }

    /// Syncs the answers written out so far, on a blocking thread, off the gossip's path
    /// ([`AnswerLog::sync_in_background`]).
    pub fn sync_answers(&mut self) {
        self.answers.sync_in_background();
    }

    /// Writes zeros after the allocation until it reaches `end`, and on to the next MiB
    /// while the disk has room; nothing if `end` is allocated already. It fails only if
    /// `end` is not reached; the zeros written before a failure are kept (64 KiB pieces),
    /// so a refused write costs one piece's try and the next write takes the room a
    /// partial allocation left.
    fn allocate_for(&mut self, end: u64) -> std::io::Result<()> {
        if end <= self.allocated {
            return Ok(());
        }
        let target = end.next_multiple_of(ALLOCATE_BYTES);
        match checksummed::write_zeros(&self.file, &mut self.allocated, target) {
            Err(err) if end > self.allocated => Err(err),
            _ => Ok(()),
        }
    }

    /// Drops the records buffered since `mark`: their write was refused.
    pub fn undo(&mut self, mark: usize) {
        self.pending.truncate(mark);
    }

    /// Writes the buffered records to the file (the OS's page cache: a process crash keeps
    /// them; a machine crash loses the ones no sync has covered yet, which no peer holds,
    /// see `handoff`), over zeros [`LaneLog::append`] allocated for them, so a full disk
    /// cannot fail it. After an error, every later append is refused.
    pub fn flush(&mut self) -> Result<(), LogError> {
        if self.pending.is_empty() {
            // Answers that wrote nothing (a denial, a region's decision) go out alone.
            self.answers.flush();
            return Ok(());
        }
        if let Some(why) = &self.failed {
            return Err(LogError::Failed(why.clone()));
        }
        let end = self.written + self.pending.len() as u64;
        assert!(end <= self.allocated, "records are written over zeros");
        if let Err(source) = self.file.write_all_at(&self.pending, self.written) {
            self.failed = Some(source.to_string());
            return Err(LogError::Io {
                path: self.path.clone(),
                source,
            });
        }
        self.written = end;
        if let Some(compaction) = &mut self.compaction {
            compaction.keep(&self.pending);
        }
        self.pending.clear();
        self.answers.flush();
        Ok(())
    }

    /// A handle for syncing what has been written to the log so far, and the answers
    /// written out with it, to run off the node's thread ([`LogSync::sync`]).
    pub fn sync_handle(&mut self) -> Result<LogSync, LogError> {
        if let Some(why) = &self.failed {
            return Err(LogError::Failed(why.clone()));
        }
        let file = self.file.try_clone().map_err(|source| LogError::Io {
            path: self.path.clone(),
            source,
        })?;
        Ok(LogSync {
            path: self.path.clone(),
            file,
            answers: self.answers.sync_handle(),
        })
    }

    /// A handle for syncing the answers written out so far, if any since the last: at a
    /// graceful stop, for those that wrote nothing (a collection's sync takes the others).
    pub fn answers_sync_handle(&mut self) -> Option<AnswersSync> {
        self.answers.sync_handle()
    }

    /// The bytes of records written out (the file holds zeros after them).
    #[cfg(all(test, not(tally_loom)))]
    pub(crate) fn records_bytes(&self) -> u64 {
        self.written
    }

    /// Makes the log refuse everything from now on, as after a failed flush.
    #[cfg(test)]
    pub(crate) fn fail(&mut self, why: &str) {
        self.failed = Some(why.to_owned());
    }

    /// As on a full disk (`full`), every write needs an allocation and every allocation
    /// fails; or the disk has room again. Call with nothing buffered.
    #[cfg(all(test, not(tally_loom)))]
    pub(crate) fn full_disk(&mut self, full: bool) -> std::io::Result<()> {
        assert!(self.pending.is_empty(), "nothing buffered");
        self.allocated = self.written;
        self.file = OpenOptions::new()
            .read(true)
            .write(!full)
            .open(&self.path)?;
        Ok(())
    }

    /// Makes the next batch's end compact the log, whatever its size.
    #[cfg(all(test, not(tally_loom)))]
    pub(crate) fn compact_next(&mut self) {
        self.compact_at = 0;
    }

    /// Whether a compaction is under way (its copy not yet in place).
    #[cfg(all(test, not(tally_loom)))]
    pub(crate) fn is_compacting(&self) -> bool {
        self.compaction.is_some()
    }

    /// Whether a failed write, sync or reopen has made the log refuse every append.
    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Rewrites the log as one record per key of `store` with a non-zero own lane (a key
    /// held only for its remote sum has a zero one) once it has grown past its bound, so a
    /// long life's log stays proportional to its live keys. Call between batches (nothing
    /// pending), with `store` holding every write flushed so far; the store must not
    /// change during the call.
    ///
    /// The rewrite is in two steps, one call each. The first reads the own lanes and hands
    /// them to a thread, which encodes them into a copy of the log and syncs it; the log
    /// meanwhile takes records as before, and keeps those written out since. A later call,
    /// once the copy is synced, writes those records after the copy's, syncs it, renames it
    /// over the log and syncs the directory: so the runtime's thread waits for syncs of the
    /// records written during the copy, not of the whole copy. A rewrite that fails before
    /// it replaces the log leaves the log as it was, and is tried again only once the log
    /// has grown by `COMPACT_BYTES` (64 MiB) more, not on every batch.
    pub fn compact_if_large(&mut self, store: &LaneStore) -> Result<(), LogError> {
        self.answers.compact_if_large();
        if !self.pending.is_empty() || self.failed.is_some() {
            return Ok(());
        }
        if self.compaction.is_some() {
            return self.finish_compaction();
        }
        if self.written < self.compact_at {
            return Ok(());
        }
        let mut lanes = Vec::new();
        store.for_each_own(|key, lane| {
            if lane != Lane::default() {
                lanes.push((key.clone(), lane));
            }
        });
        let started = Compaction::start(&self.path, "tally-lanelog-copy", move || {
            let mut body = Vec::new();
            for (key, lane) in &lanes {
                encode(key, lane.incr, lane.decr, &mut body);
            }
            body
        });
        match started {
            Ok(compaction) => self.compaction = Some(compaction),
            Err(err) => {
                self.compact_at = self.written.saturating_add(COMPACT_BYTES);
                return Err(err);
            }
        }
        Ok(())
    }

    /// The second step of a compaction (see [`LaneLog::compact_if_large`]), once its copy
    /// is synced; nothing before.
    fn finish_compaction(&mut self) -> Result<(), LogError> {
        let compaction = self.compaction.as_mut().expect("a compaction is under way");
        let Some(replaced) = compaction.try_finish(&self.path) else {
            return Ok(());
        };
        self.compaction = None;
        let written = match replaced {
            Ok(written) => written,
            Err(err) => {
                self.compact_at = self.written.saturating_add(COMPACT_BYTES);
                return Err(err);
            }
        };
        // From here the old file is unlinked: appending to it would acknowledge writes no
        // restart can read, so a failed reopen fails the log. The rename is synced before
        // anything is appended to the new file, so that a machine crash cannot undo it
        // under later writes: a `.compact` file found at start is one never renamed, whose
        // log still holds every record, and `open` removes it.
        let reopened = sync_dir(self.path.parent().unwrap_or(Path::new("."))).and_then(|()| {
            OpenOptions::new()
                .write(true)
                .open(&self.path)
                .map_err(LogError::io_at(&self.path))
        });
        self.file = match reopened {
            Ok(file) => file,
            Err(err) => {
                self.failed = Some(err.to_string());
                return Err(err);
            }
        };
        self.written = written;
        self.allocated = self.written;
        // Compacted, the log holds one record per live key; the next compaction waits until
        // it has doubled, so a node with many keys does not rewrite it every batch.
        self.compact_at = COMPACT_BYTES.max(2 * self.written);
        Ok(())
    }
}

/// The lane log's file, to sync (see [`LaneLog::sync_handle`]).
#[derive(Debug)]
pub struct LogSync {
    path: PathBuf,
    file: File,
    // The answers written out since the last sync of them, if any.
    answers: Option<AnswersSync>,
}

impl LogSync {
    /// Makes every record written to the log before this handle was taken durable, and
    /// first the answers written out with them: a write kept without its answer would be
    /// counted again by a retry of its id (`answerlog`). A failed sync of the answers has
    /// the answer log rewritten, and fails nothing here.
    pub fn sync(self) -> Result<(), LogError> {
        if let Some(answers) = self.answers {
            answers.sync();
        }
        self.file.sync_data().map_err(|source| LogError::Io {
            path: self.path,
            source,
        })
    }
}

/// Appends the record of a write of `incr` and `decr` to `key`'s lane to `out`.
pub fn encode(key: &Key, incr: u64, decr: u64, out: &mut Vec<u8>) {
    let record = Record {
        rule: key.rule.as_str().to_owned(),
        subject: key.subject.as_str().to_owned(),
        window_index: key.window.index(),
        window_secs: key.window.len_secs(),
        incr,
        decr,
    };
    checksummed::append(&record, out);
}

/// The own lanes a log adds up to, and whether it had damage (1) or not (0).
///
/// A record that is short or fails its checksum is damage: a torn tail, as a crash leaves
/// it, if only zeros (the allocation ahead) follow; otherwise a fault in the middle, or a
/// tail whose later blocks reached the disk before its earlier ones. Replay reads on past
/// it a byte at a time, and keeps every whole record it finds there that is followed as a
/// record is (by another, by zeros or by the end): the start rewrites the log from what
/// replay kept, so a record left behind here would be gone for good. A match in damaged
/// bytes needs a checksum that matches (one in 2^32, by chance), a body that decodes to
/// a lane of a valid key, and a match after it; it would add to this node's count, the
/// safe side for a limit. (A client chooses subjects, so it can write a record inside
/// one, and damage that starts the scan inside that subject would count it.)
///
/// A record before any damage that checks but does not decode, or names a key this build
/// refuses, was written whole (by another build, or a fault past a crash): dropped, or read
/// as the end, its totals and the records after it would be re-published below what peers
/// hold, and nothing would lift them again. So it stops the start ([`NotALane`]).
pub fn replay(bytes: &[u8]) -> Result<(Vec<(Key, Lane)>, usize), NotALane> {
    let mut lanes: std::collections::HashMap<Key, Lane> = std::collections::HashMap::new();
    // `scanning`: past damage, until a record is found again.
    let (mut at, mut damaged, mut scanning) = (0, false, false);
    while at < bytes.len() {
        let found = checksummed::read_body(bytes, at)
            .filter(|&(_, next)| !scanning || followed_well(bytes, next));
        let Some((body, next)) = found else {
            // Zeros after the records are the allocation ahead.
            if !damaged && bytes[at..].iter().all(|&byte| byte == 0) {
                break;
            }
            (damaged, scanning) = (true, true);
            at += 1;
            continue;
        };
        let whole =
            checksummed::decode::<Record>(body).and_then(|record| Some((key_of(&record)?, record)));
        let Some((key, record)) = whole else {
            if scanning {
                at += 1;
                continue;
            }
            return Err(NotALane { at });
        };
        (at, scanning) = (next, false);
        let lane = lanes.entry(key).or_default();
        // A lane that would pass u64::MAX was refused when written, so sums fit; saturate
        // rather than trust a file.
        *lane = Lane::new(
            lane.incr.saturating_add(record.incr),
            lane.decr.saturating_add(record.decr),
        );
    }
    Ok((lanes.into_iter().collect(), usize::from(damaged)))
}

/// A record of a lane log, before any damage, that checks but is not a lane of a valid key.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the record at byte {at} checks but is not a lane of a valid key: a log of another \
     build, or damaged after it was written; not started, so as not to re-publish this \
     life's lanes below what peers hold. Move the data directory away to start afresh (a \
     new generation: peers keep what they hold)"
)]
pub struct NotALane {
    /// Where the record starts in the file.
    pub at: usize,
}

/// The own lanes the log at `path` adds up to ([`replay`]).
fn replay_file(path: &Path) -> Result<(Vec<(Key, Lane)>, usize), LogError> {
    replay(&read_whole(path)?).map_err(|not_a_lane| {
        let source = std::io::Error::new(std::io::ErrorKind::InvalidData, not_a_lane);
        LogError::io_at(path)(source)
    })
}

/// Whether what follows a record found past damage, at `next`, is what follows a record:
/// another that checks, a length of 0 (the zeros allocated ahead), or the file's end. The
/// zeros may run to the end in fewer than 4 bytes: a log's last record can end that close
/// to the end of its allocation.
fn followed_well(bytes: &[u8], next: usize) -> bool {
    bytes[next..].iter().take(4).all(|&byte| byte == 0)
        || checksummed::read_body(bytes, next).is_some()
}

fn key_of(record: &Record) -> Option<Key> {
    Some(Key::new(
        Rule::new(record.rule.as_str()).ok()?,
        Subject::new(record.subject.as_str()).ok()?,
        Window::new(record.window_index, record.window_secs).ok()?,
    ))
}

fn log_generation(path: &Path) -> Option<u64> {
    generation_named(
        path.file_name()?
            .to_str()?
            .strip_prefix("lanes-")?
            .strip_suffix(".log")?,
    )
}

/// Whether `path` is named as a lane log but for its generation, not written as a node
/// writes one.
fn is_misnamed_log(path: &Path) -> bool {
    let name = path.file_name().and_then(|name| name.to_str());
    name.is_some_and(|name| name.starts_with("lanes-") && name.ends_with(".log"))
        && log_generation(path).is_none()
}

/// The generation `text` names, written as this node writes one: `5`, not `05` or `+5`.
/// Two names of one generation (left by a copy or a restore) would be replayed as one
/// replica, and a merge would take the larger of their totals, not their sum.
pub(crate) fn generation_named(text: &str) -> Option<u64> {
    let generation: u64 = text.parse().ok()?;
    (generation.to_string() == text).then_some(generation)
}

/// Whether `path` is a `lanes-<generation>.compact` file: a compaction's copy of a log,
/// written before it is renamed over the log.
fn is_compaction_left_over(path: &Path) -> bool {
    path.file_name()
        .and_then(|name| name.to_str())
        .and_then(|name| name.strip_prefix("lanes-"))
        .and_then(|name| name.strip_suffix(".compact"))
        .map(|name| name.strip_suffix(".copy").unwrap_or(name))
        .is_some_and(|generation| generation.parse::<u64>().is_ok())
}

/// Replaces the log at `path` with one record per lane of `lanes`, synced (the rename is
/// synced with the directory before `open` returns). What a restart re-publishes must be
/// on the disk: after a process crash part of the log may be in the page cache alone, and
/// after a failed sync the kernel may keep pages it marked clean though they never reached
/// the disk (so syncing the file again would not write them); a machine crash would take
/// either from under lanes the peers then hold (see `handoff`). Written from what was read,
/// it is on the disk whatever the page cache held. A crash before the rename leaves a
/// `.compact` file, which the next start removes, replaying the log whole.
fn rewrite(path: &Path, lanes: &[(Key, Lane)]) -> Result<(), LogError> {
    let mut body = Vec::new();
    for (key, lane) in lanes {
        encode(key, lane.incr, lane.decr, &mut body);
    }
    replace_by_copy(path, &body)
}

/// Replaces the file at `path` with `body`: written and synced beside it as
/// `<name>.compact`, then renamed over it (the directory is not synced: the caller syncs
/// it before anything depends on the rename). A copy cut off by a failure is removed; one
/// cut off by a crash is left for the next start to remove, the file still whole.
pub(crate) fn replace_by_copy(path: &Path, body: &[u8]) -> Result<(), LogError> {
    let tmp = path.with_extension("compact");
    let replaced = write_synced(&tmp, body).and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|source| LogError::Io {
            path: path.to_owned(),
            source,
        })
    });
    if replaced.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    replaced
}

/// The whole file at `path`.
pub(crate) fn read_whole(path: &Path) -> Result<Vec<u8>, LogError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut file| file.read_to_end(&mut bytes))
        .map_err(|source| LogError::Io {
            path: path.to_owned(),
            source,
        })?;
    Ok(bytes)
}

/// Checks that `dir` belongs to `node`, by the id in its `node` file, or writes that file
/// (synced) on the directory's first start. A directory started under another node id is
/// refused: its lane logs would be re-published as that node's lanes, counting the first
/// node's writes twice, and a region would take them for its own admissions. A directory
/// from a build before the file is taken as `node`'s.
fn claim(dir: &Path, node: NodeId) -> Result<(), LogError> {
    let file = dir.join("node");
    let refused = |why: String| LogError::Io {
        path: file.clone(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, why),
    };
    match std::fs::read_to_string(&file) {
        Ok(text) if text.trim() == node.0.to_string() => Ok(()),
        Ok(text) => Err(refused(format!(
            "names node {:?}, and this is node {}: a data directory holds the logs of \
             the node that first started on it; not started (give this node a directory \
             of its own)",
            text.trim(),
            node.0
        ))),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            replace_synced(dir, "node", node.0.to_string().as_bytes())
        }
        Err(source) => Err(LogError::Io {
            path: file.clone(),
            source,
        }),
    }
}

/// Puts `bytes` in `dir/name` whole or not at all, durably: written and synced as
/// `name.tmp`, renamed over `name`, and the directory synced.
fn replace_synced(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), LogError> {
    let (tmp, path) = (dir.join(format!("{name}.tmp")), dir.join(name));
    write_synced(&tmp, bytes)?;
    std::fs::rename(&tmp, &path).map_err(|source| LogError::Io { path, source })?;
    sync_dir(dir)
}

/// Writes `bytes` to a new file at `path` and syncs it.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), LogError> {
    let io = LogError::io_at(path);
    let mut file = File::create(path).map_err(&io)?;
    file.write_all(bytes).map_err(&io)?;
    file.sync_all().map_err(io)
}

/// Creates `dir` and the parents it lacks, and syncs each new directory's parent, so that
/// a machine crash after a log's first sync cannot take the directory, and the log in it,
/// away.
pub fn create_dir_durably(dir: &Path) -> std::io::Result<()> {
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|path| !path.as_os_str().is_empty() && !path.exists())
        .collect();
    std::fs::create_dir_all(dir)?;
    for created in missing {
        let parent = match created.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        File::open(parent)?.sync_all()?;
    }
    Ok(())
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), LogError> {
    File::open(dir)
        .and_then(|file| file.sync_all())
        .map_err(|source| LogError::Io {
            path: dir.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(tally_loom))]
    use crate::compaction::copy_path;
    use crate::recent::{Answered, Asked};
    use tally_crdt::KeyRef;

    const NOW: u64 = 1_767_225_600;

    /// [`super::open`] with no wait: these tests' wall clocks are made up.
    fn open(
        dir: &Path,
        node: NodeId,
        wall_ms: u64,
        now_unix_secs: u64,
    ) -> Result<(LaneLog, Recovered), LogError> {
        super::open(dir, node, wall_ms, now_unix_secs, |_| {})
    }

    fn key(subject: &str) -> Key {
        Key::new(
            Rule::new("r").unwrap(),
            Subject::new(subject).unwrap(),
            Window::containing(NOW, 60).unwrap(),
        )
    }

    /// An increment of `amount` on `key("a")`, answered with the count `amount`.
    fn incremented(amount: u64) -> Remembered {
        let key = key("a");
        Remembered {
            answered: Answered::Incremented(tally_client::wire::Estimate {
                estimate: i128::from(amount),
                window: key.window.index(),
                staleness_ms: 0,
            }),
            asked: Asked::of(KeyRef::from(&key), amount),
            window: key.window,
        }
    }

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tally-log-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_collections_sync_takes_the_answers_written_out_before_it_once() {
        let dir = dir("answers-synced");
        let (mut log, _) = open(&dir, NodeId(1), 5, NOW).unwrap();
        let counted = incremented(2);
        log.append(&key("a"), 2, 0).unwrap();
        log.append_answered(CheckId { session: 3, seq: 1 }, counted);
        log.flush().unwrap();
        let sync = log.sync_handle().unwrap();
        assert!(
            sync.answers.is_some(),
            "the answer written out goes with the lanes"
        );
        sync.sync().unwrap();
        log.append(&key("a"), 1, 0).unwrap();
        log.flush().unwrap();
        let sync = log.sync_handle().unwrap();
        assert!(sync.answers.is_none(), "no answer written out since");
        sync.sync().unwrap();
        // One that wrote nothing is left to the stop's sync, or the next second's.
        log.append_answered(CheckId { session: 3, seq: 2 }, counted);
        log.flush().unwrap();
        assert!(log.answers_sync_handle().is_some());
        assert!(log.answers_sync_handle().is_none(), "taken once");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Runs `collections` on a log whose write of `a`, and its answer, were written out
    /// and taken by the once-a-second sync of the answers, which has not run: the runtime's
    /// one blocking thread is held busy (as by another sync under way) until they return.
    fn with_the_seconds_sync_held<T>(name: &str, collections: impl FnOnce(&mut LaneLog) -> T) -> T {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(1)
            .build()
            .unwrap();
        let _entered = runtime.enter();
        let (release, busy) = std::sync::mpsc::channel::<()>();
        let (started, is_busy) = std::sync::mpsc::channel::<()>();
        let occupied = tokio::task::spawn_blocking(move || {
            started.send(()).unwrap();
            let _ = busy.recv();
        });
        is_busy.recv().unwrap();
        let dir = dir(name);
        let (mut log, _) = open(&dir, NodeId(1), 5, NOW).unwrap();
        log.append(&key("a"), 2, 0).unwrap();
        log.append_answered(CheckId { session: 3, seq: 1 }, incremented(2));
        log.flush().unwrap();
        // The node's tick: the answers' sync is handed to the blocking thread.
        log.sync_answers();
        let result = collections(&mut log);
        release.send(()).unwrap();
        runtime.block_on(occupied).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        result
    }

    /// The answers written out since the last sync are synced with each collection's sync
    /// of the lane log, so the answers to the writes a sync makes durable are durable too:
    /// also when the once-a-second sync of the answers has taken them and not yet synced
    /// them. Found in review, session 47: the collection's sync then synced the write alone.
    #[test]
    fn a_collections_sync_covers_an_answer_the_seconds_sync_took_but_has_not_synced() {
        let covers_answer = with_the_seconds_sync_held("answers-second-sync", |log| {
            let sync = log.sync_handle().unwrap();
            let covers_answer = sync.answers.is_some();
            sync.sync().unwrap();
            covers_answer
        });
        assert!(
            covers_answer,
            "the lane sync returned with the write durable and its answer not synced: a \
             machine crash now keeps the write and loses the answer, and a retry counts twice"
        );
    }

    /// Once a collection's sync has synced the answers the second's sync took, a later
    /// collection with no answer written since has none to sync (found in review, session
    /// 47: every lane sync while the second's sync was in flight fsynced the answer file
    /// again for nothing).
    #[test]
    fn a_later_collection_does_not_sync_answers_an_earlier_one_covered() {
        let resyncs = with_the_seconds_sync_held("answers-covered", |log| {
            // Collection 1: syncs the answer with the write (needed), and returns.
            let first = log.sync_handle().unwrap();
            assert!(first.answers.is_some());
            first.sync().unwrap();
            // A write with no answer (no request id), and its collection.
            log.append(&key("b"), 1, 0).unwrap();
            log.flush().unwrap();
            let second = log.sync_handle().unwrap();
            let resyncs = second.answers.is_some();
            second.sync().unwrap();
            resyncs
        });
        assert!(
            !resyncs,
            "collection 2 fsyncs the answer file again though collection 1 synced every \
             answer written and none was written since"
        );
    }

    #[test]
    fn an_answer_flushed_after_its_write_reaches_the_next_life() {
        let dir = dir("answered");
        let (mut log, first) = open(&dir, NodeId(1), 5, NOW).unwrap();
        assert!(first.answered.is_empty());
        let id = CheckId { session: 3, seq: 1 };
        let counted = incremented(2);
        log.append(&key("a"), 2, 0).unwrap();
        log.append_answered(id, counted);
        log.flush().unwrap();
        // One that wrote nothing (a denial, say) goes out alone.
        let denied = CheckId { session: 3, seq: 2 };
        log.append_answered(denied, counted);
        log.flush().unwrap();
        drop(log);
        let (_, second) = open(&dir, NodeId(1), 6, NOW).unwrap();
        assert_eq!(second.answered, [(id, counted), (denied, counted)]);
        assert_eq!(second.retired[0].1, [(key("a"), Lane::new(2, 0))]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_directory_in_use_is_refused_until_its_holder_lets_go() {
        let dir = dir("in-use");
        let held = lock(&dir).unwrap();
        let refused = lock(&dir).unwrap_err();
        assert!(
            matches!(&refused, LogError::InUse { dir: in_use } if *in_use == dir),
            "{refused:?}"
        );
        assert!(
            refused.to_string().contains("in use by another process"),
            "{refused}"
        );
        // The lock is the directory's own, not a file in it that could be removed.
        assert!(
            std::fs::read_dir(&dir).unwrap().next().is_none(),
            "no lock file"
        );

        drop(held);
        let _again = lock(&dir).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_directory_started_under_another_node_id_is_refused_and_left_as_it_is() {
        let dir = dir("owner");
        let (log, _) = open(&dir, NodeId(1), 5, NOW).unwrap();
        drop(log);
        let files = || {
            let mut names: Vec<_> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|entry| entry.unwrap().file_name())
                .collect();
            names.sort();
            names
        };
        let before = files();
        let err = open(&dir, NodeId(2), 10, NOW).err().unwrap().to_string();
        assert!(
            err.contains("names node \"1\"") && err.contains("this is node 2"),
            "{err}"
        );
        assert_eq!(files(), before, "nothing taken or changed");
        assert!(open(&dir, NodeId(1), 10, NOW).is_ok());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_restart_takes_a_new_generation_and_recovers_the_old_lives_lanes() {
        let dir = dir("restart");
        let (mut log, first) = open(&dir, NodeId(1), 5, NOW).unwrap();
        assert_eq!(first.generation, Generation(5));
        log.append(&key("a"), 3, 0).unwrap();
        log.append(&key("a"), 2, 1).unwrap();
        log.append(&key("b"), 1, 0).unwrap();
        log.flush().unwrap();
        drop(log);
        // The wall clock stepped back: the generation still rises, past the versions the
        // last start could have re-published at (`republish_floor`).
        let (_, second) = open(&dir, NodeId(1), 2, NOW).unwrap();
        assert_eq!(second.generation, Generation(8));
        assert_eq!(second.retired.len(), 1);
        let (replica, mut lanes) = second.retired.into_iter().next().unwrap();
        assert_eq!(replica, ReplicaId::new(NodeId(1), Generation(5)));
        lanes.sort_by(|a, b| a.0.subject.as_str().cmp(b.0.subject.as_str()));
        assert_eq!(
            lanes,
            vec![(key("a"), Lane::new(5, 1)), (key("b"), Lane::new(1, 0))]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_log_is_allocated_ahead_with_zeros_that_end_its_replay_and_are_no_torn_tail() {
        let dir = dir("allocated");
        let (mut log, first) = open(&dir, NodeId(1), 5, NOW).unwrap();
        log.append(&key("a"), 3, 0).unwrap();
        log.flush().unwrap();
        log.append(&key("a"), 2, 0).unwrap();
        log.flush().unwrap();
        let path = log.path.clone();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), ALLOCATE_BYTES);
        let written = log.written as usize;
        drop(log);
        let (lanes, torn) = replay_file(&path).unwrap();
        assert_eq!((lanes, torn), (vec![(key("a"), Lane::new(5, 0))], 0));

        // Half a record over the zeros, as a crash mid-write leaves it: a torn tail.
        let mut bytes = std::fs::read(&path).unwrap();
        let mut record = Vec::new();
        encode(&key("b"), 1, 0, &mut record);
        bytes[written..written + record.len() / 2].copy_from_slice(&record[..record.len() / 2]);
        std::fs::write(&path, &bytes).unwrap();
        let (_, second) = open(&dir, NodeId(1), 6, NOW).unwrap();
        assert_eq!(second.torn, 1);
        assert_eq!(
            second.retired,
            vec![(
                ReplicaId::new(NodeId(1), first.generation),
                vec![(key("a"), Lane::new(5, 0))]
            )]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_write_with_no_room_allocated_for_it_is_refused_whole_and_taken_once_there_is_room() {
        let dir = dir("no-room");
        let (mut log, first) = open(&dir, NodeId(1), 5, NOW).unwrap();
        let mut record = Vec::new();
        encode(&key("a"), 1, 0, &mut record);
        let mut appended = 0;
        while log.written + (log.pending.len() + record.len()) as u64 <= ALLOCATE_BYTES {
            log.append(&key("a"), 1, 0).unwrap();
            appended += 1;
        }
        let pending = log.pending.len();
        // A file the log cannot write to: its allocation of the next MiB fails, as on a
        // full disk.
        let writable = std::mem::replace(&mut log.file, File::open(&log.path).unwrap());
        let err = log.append(&key("a"), 1, 0).unwrap_err();
        assert!(matches!(err, LogError::Io { .. }), "{err}");
        assert_eq!(
            log.pending.len(),
            pending,
            "nothing of the refused write is kept"
        );
        assert_eq!(log.allocated, ALLOCATE_BYTES);
        log.file = writable;
        log.flush().unwrap();
        log.append(&key("b"), 2, 0).unwrap();
        log.flush().unwrap();
        assert_eq!(log.allocated, 2 * ALLOCATE_BYTES);
        drop(log);
        let (_, second) = open(&dir, NodeId(1), 6, NOW).unwrap();
        let (replica, mut lanes) = second.retired.into_iter().next().unwrap();
        assert_eq!(replica, ReplicaId::new(NodeId(1), first.generation));
        lanes.sort_by(|a, b| a.0.subject.as_str().cmp(b.0.subject.as_str()));
        assert_eq!(
            lanes,
            vec![
                (key("a"), Lane::new(appended, 0)),
                (key("b"), Lane::new(2, 0))
            ]
        );
        assert_eq!(second.torn, 0);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_torn_tail_is_dropped_at_every_offset_keeping_the_whole_records() {
        let mut whole = Vec::new();
        for i in 0..4 {
            encode(&key("a"), 1 << i, 0, &mut whole);
        }
        let ends: Vec<usize> = {
            let (mut at, mut ends) = (0, vec![0]);
            while let Some((_, next)) = checksummed::read::<Record>(&whole, at) {
                ends.push(next);
                at = next;
            }
            ends
        };
        let dir = dir("torn");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lanes-1.log");
        for cut in 0..=whole.len() {
            std::fs::write(&path, &whole[..cut]).unwrap();
            let (lanes, torn) = replay_file(&path).unwrap();
            let kept = ends.iter().filter(|&&end| end <= cut).count() - 1;
            let expected: u64 = (0..kept).map(|i| 1u64 << i).sum();
            assert_eq!(
                lanes.iter().map(|(_, l)| l.incr).sum::<u64>(),
                expected,
                "cut {cut}"
            );
            assert_eq!(torn, usize::from(!ends.contains(&cut)), "cut {cut}");
        }
        // A flipped bit in a whole record is caught by its checksum, and the records after
        // it are kept: 1 + 4 + 8, the second lost.
        let mut flipped = whole.clone();
        flipped[ends[1] + 10] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        let (lanes, torn) = replay_file(&path).unwrap();
        assert_eq!((lanes[0].1.incr, torn), (13, 1));
        // So is a record after a run of zeros in the middle, as a tail whose later blocks
        // reached the disk first leaves it, and after a run of garbage. A record found past
        // damage must be followed as a record is: one followed by garbage is not kept.
        for damage in [[0u8; 40], [0x5a; 40]] {
            let mut gapped = whole[..ends[2]].to_vec();
            gapped.extend_from_slice(&damage);
            gapped.extend_from_slice(&whole[ends[2]..]);
            gapped.extend_from_slice(&[0; 64]);
            std::fs::write(&path, &gapped).unwrap();
            let (lanes, torn) = replay_file(&path).unwrap();
            assert_eq!((lanes[0].1.incr, torn), (15, 1), "{:?}", damage[0]);
        }
        let mut stray = whole[..ends[1]].to_vec();
        stray.extend_from_slice(&[0x5a; 40]);
        stray.extend_from_slice(&whole[ends[2]..ends[3]]);
        stray.extend_from_slice(&[0x5a; 40]);
        std::fs::write(&path, &stray).unwrap();
        let (lanes, torn) = replay_file(&path).unwrap();
        assert_eq!((lanes[0].1.incr, torn), (1, 1));
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A record found past damage is kept when zeros follow it up to the file's end,
    /// however few: a log's last record can end 1 to 3 bytes before the end of its
    /// allocation, as it can end at the file's end or 4 or more bytes before it.
    #[test]
    fn a_record_past_damage_followed_by_fewer_than_four_zeros_to_the_end_is_kept() {
        let mut first = Vec::new();
        encode(&key("a"), 1, 0, &mut first);
        let mut last = Vec::new();
        encode(&key("a"), 2, 0, &mut last);
        for zeros in 0..=5 {
            let mut bytes = first.clone();
            bytes.extend_from_slice(&[0x5a; 40]);
            bytes.extend_from_slice(&last);
            bytes.extend(std::iter::repeat_n(0, zeros));
            let (lanes, torn) = replay(&bytes).unwrap();
            assert_eq!(
                (lanes, torn),
                (vec![(key("a"), Lane::new(3, 0))], 1),
                "{zeros} zeros after the last record"
            );
        }
    }

    #[test]
    fn a_record_that_checks_but_is_no_lane_of_a_valid_key_stops_the_start() {
        let dir = dir("alien");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lanes-1.log");
        let mut good = Vec::new();
        encode(&key("a"), 1, 0, &mut good);
        let invalid_key = Record {
            rule: String::new(),
            subject: "s".into(),
            window_index: 1,
            window_secs: 60,
            incr: 1,
            decr: 0,
        };
        let mut bad_key = Vec::new();
        checksummed::append(&invalid_key, &mut bad_key);
        let mut other_kind = Vec::new();
        checksummed::append(&(7u8, "not a record"), &mut other_kind);
        for alien in [bad_key, other_kind] {
            let mut bytes = good.clone();
            bytes.extend(&alien);
            encode(&key("a"), 2, 0, &mut bytes);
            std::fs::write(&path, &bytes).unwrap();
            let err = replay_file(&path).unwrap_err().to_string();
            assert!(err.contains("lanes-1.log"), "{err}");
            assert!(err.contains(&format!("at byte {}", good.len())), "{err}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn re_published_lanes_go_above_the_last_starts_whatever_the_clock() {
        let dir = dir("republish");
        let (mut log, _) = open(&dir, NodeId(1), 1_000, NOW).unwrap();
        for subject in 0..2_500 {
            log.append(&key(&format!("s{subject}")), 1, 0).unwrap();
        }
        log.flush().unwrap();
        drop(log);
        // The next start re-publishes the 2,500 lanes, one version each above its floor,
        // and its restamps may use up to 2,000 more; then the clock steps back an hour,
        // and the generation file is lost, before the start after.
        let (_, next) = open(&dir, NodeId(1), 3_600_000, NOW).unwrap();
        let highest = next.republish_floor().0 + 2_500 + 2_000;
        std::fs::remove_file(dir.join("generation")).unwrap();
        let (_, after) = open(&dir, NodeId(1), 5, NOW).unwrap();
        assert!(
            after.republish_floor().0 >= highest,
            "{:?} is below {highest}",
            after.republish_floor()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_generation_file_that_does_not_parse_or_is_out_of_range_stops_the_start() {
        let dir = dir("generation-bad");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("generation"), "not a number").unwrap();
        let err = open(&dir, NodeId(1), 5, NOW).unwrap_err().to_string();
        assert!(
            err.contains("generation") && err.contains("not a number"),
            "{err}"
        );
        // Nor one whose floor in microseconds would not fit.
        std::fs::write(dir.join("generation"), (u64::MAX - 7).to_string()).unwrap();
        let err = open(&dir, NodeId(1), 5, NOW).unwrap_err().to_string();
        assert!(err.contains("generation") && err.contains("past"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// An answer log whose name is past the generations a node gives (a stray file, not
    /// one this node wrote) stops the start with an error that points at it: before, the
    /// error named the `generation` file and lane logs only, neither of which was wrong.
    #[test]
    fn an_answer_log_named_past_the_generations_stops_the_start_naming_answer_logs() {
        let dir = dir("answers-generation-past");
        std::fs::create_dir_all(&dir).unwrap();
        let mut bytes = Vec::new();
        answerlog::encode(
            &(CheckId { session: 3, seq: 1 }, incremented(2)),
            &mut bytes,
        );
        let name = format!("answers-{}.log", GENERATION_MAX + 1);
        std::fs::write(dir.join(&name), bytes).unwrap();
        let err = open(&dir, NodeId(1), 5, NOW).unwrap_err().to_string();
        assert!(
            err.contains("past") && err.contains("answers-<generation>.log"),
            "the error does not point at {name}: {err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_lost_generation_file_never_brings_back_a_logs_generation() {
        let dir = dir("generation-lost");
        let (mut log, first) = open(&dir, NodeId(1), 5, NOW).unwrap();
        log.append(&key("a"), 3, 0).unwrap();
        log.flush().unwrap();
        drop(log);
        std::fs::remove_file(dir.join("generation")).unwrap();
        // With the clock behind the old life's start, only its log remembers it.
        let (_, second) = open(&dir, NodeId(1), 2, NOW).unwrap();
        assert!(
            second.generation > first.generation,
            "{:?}",
            second.generation
        );
        assert_eq!(second.retired[0].0.generation, first.generation);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_replayed_log_is_rewritten_as_its_live_lanes_one_record_each() {
        let dir = dir("rewritten");
        let (mut log, _) = open(&dir, NodeId(1), 1, NOW).unwrap();
        log.append(&key("a"), 3, 0).unwrap();
        log.append(&key("a"), 2, 1).unwrap();
        let over = Key::new(
            Rule::new("r").unwrap(),
            Subject::new("over").unwrap(),
            Window::containing(NOW - 120, 60).unwrap(),
        );
        log.append(&over, 7, 0).unwrap();
        log.flush().unwrap();
        drop(log);
        let (_, second) = open(&dir, NodeId(1), 2, NOW).unwrap();
        assert_eq!(second.retired[0].1, vec![(key("a"), Lane::new(5, 1))]);
        let mut one = Vec::new();
        encode(&key("a"), 5, 1, &mut one);
        let old = second.retired[0].0.generation.0;
        assert_eq!(
            std::fs::read(dir.join(format!("lanes-{old}.log"))).unwrap(),
            one
        );
        assert!(!dir.join(format!("lanes-{old}.compact")).exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn only_a_generation_written_as_a_node_writes_it_names_a_log() {
        assert_eq!(log_generation(Path::new("/d/lanes-5.log")), Some(5));
        for name in ["lanes-05.log", "lanes-+5.log", "lanes-.log", "lanes-5.copy"] {
            assert_eq!(log_generation(&Path::new("/d").join(name)), None, "{name}");
        }
    }

    #[test]
    fn a_log_named_with_its_generation_written_otherwise_stops_the_start() {
        let dir = dir("misnamed");
        let (mut log, _) = open(&dir, NodeId(1), 5, NOW).unwrap();
        log.append(&key("a"), 1, 0).unwrap();
        log.flush().unwrap();
        drop(log);
        std::fs::copy(dir.join("lanes-5.log"), dir.join("lanes-05.log")).unwrap();
        let before = std::fs::read(dir.join("lanes-5.log")).unwrap();
        let err = open(&dir, NodeId(1), 6, NOW).unwrap_err().to_string();
        assert!(
            err.contains("lanes-05.log") && err.contains("rename"),
            "{err}"
        );
        let after = std::fs::read(dir.join("lanes-5.log")).unwrap();
        assert!(before == after, "the start changed a log before it stopped");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_log_whose_windows_are_over_is_deleted() {
        let dir = dir("expired");
        let (mut log, _) = open(&dir, NodeId(1), 1, NOW).unwrap();
        log.append(&key("a"), 1, 0).unwrap();
        log.flush().unwrap();
        drop(log);
        let (_, later) = open(&dir, NodeId(1), 2, NOW + 3_600).unwrap();
        assert!(later.retired.is_empty());
        assert!(!dir.join("lanes-1.log").exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_compaction_cut_off_by_a_crash_is_removed_and_its_log_replayed_whole() {
        let dir = dir("compaction-left-over");
        let (mut log, first) = open(&dir, NodeId(1), 5, NOW).unwrap();
        log.append(&key("a"), 3, 0).unwrap();
        log.append(&key("b"), 1, 0).unwrap();
        log.flush().unwrap();
        drop(log);
        // The crash came while the copy was written: it holds `a` alone, and half of it.
        let mut copy = Vec::new();
        encode(&key("a"), 3, 0, &mut copy);
        copy.truncate(copy.len() / 2);
        let left_over = dir.join(format!("lanes-{}.compact", first.generation.0));
        std::fs::write(&left_over, &copy).unwrap();
        // And a running life's copy, cut off as well.
        let copy_left_over = dir.join(format!("lanes-{}.copy.compact", first.generation.0));
        std::fs::write(&copy_left_over, &copy).unwrap();
        // Not a compaction's name: not the log's to remove.
        let other = dir.join("lanes-notes.compact");
        std::fs::write(&other, b"kept").unwrap();

        let (_, second) = open(&dir, NodeId(1), 6, NOW).unwrap();
        assert!(!left_over.exists(), "the cut-off copy is removed");
        assert!(!copy_left_over.exists(), "so is a running life's");
        assert!(other.exists());
        let (replica, mut lanes) = second.retired.into_iter().next().unwrap();
        assert_eq!(replica.generation, first.generation);
        lanes.sort_by(|a, b| a.0.subject.as_str().cmp(b.0.subject.as_str()));
        assert_eq!(
            lanes,
            vec![(key("a"), Lane::new(3, 0)), (key("b"), Lane::new(1, 0))]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    // The lane store runs on loom's atomics under `tally_loom`, which work only inside a
    // model.
    #[cfg(not(tally_loom))]
    #[test]
    fn a_compaction_writes_no_zero_lane_and_a_restart_republishes_none() {
        let dir = dir("compaction-zero-lanes");
        let (mut log, first) = open(&dir, NodeId(1), 5, NOW).unwrap();
        let store = LaneStore::new(ReplicaId::new(NodeId(1), first.generation), 100);
        log.append(&key("a"), 3, 1).unwrap();
        store.incr(&key("a"), 3).unwrap();
        store.decr(&key("a"), 1).unwrap();
        // A key the store holds only for its remote sum: its own lane is zero.
        store.publish_remote(&key("b"), 7).unwrap();
        log.flush().unwrap();
        compact_now(&mut log, &store).unwrap();
        let mut one = Vec::new();
        encode(&key("a"), 3, 1, &mut one);
        assert_eq!(std::fs::read(&log.path).unwrap(), one, "one record: a's");
        // A zero record, as an earlier build's compaction wrote for every remote key.
        log.append(&key("c"), 0, 0).unwrap();
        log.flush().unwrap();
        drop(log);

        let (_, second) = open(&dir, NodeId(1), 6, NOW).unwrap();
        let [(replica, lanes)] = second.retired.as_slice() else {
            panic!("one earlier life: {:?}", second.retired);
        };
        assert_eq!(replica.generation, first.generation);
        assert_eq!(lanes, &[(key("a"), Lane::new(3, 1))]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A life's log and store in a new directory `name`, holding `a`'s 3, written out.
    #[cfg(not(tally_loom))]
    fn a_life_holding_a(name: &str) -> (PathBuf, LaneLog, LaneStore) {
        let dir = dir(name);
        let (mut log, first) = open(&dir, NodeId(1), 5, NOW).unwrap();
        let store = LaneStore::new(ReplicaId::new(NodeId(1), first.generation), 100);
        log.append(&key("a"), 3, 0).unwrap();
        store.incr(&key("a"), 3).unwrap();
        log.flush().unwrap();
        (dir, log, store)
    }

    /// The lanes the next start in `dir` recovers of its one earlier life, by subject.
    #[cfg(not(tally_loom))]
    fn earlier_lanes(dir: &Path) -> Vec<(Key, Lane)> {
        let (_, next) = open(dir, NodeId(1), 6, NOW).unwrap();
        let [(_, lanes)] = next.retired.as_slice() else {
            panic!("one earlier life: {:?}", next.retired);
        };
        let mut lanes = lanes.clone();
        lanes.sort_by(|x, y| x.0.subject.as_str().cmp(y.0.subject.as_str()));
        lanes
    }

    /// Compacts `log` now, whatever its size: both steps, waiting for the copy between.
    #[cfg(not(tally_loom))]
    fn compact_now(log: &mut LaneLog, store: &LaneStore) -> Result<(), LogError> {
        log.compact_at = 0;
        log.compact_if_large(store)?;
        loop {
            let finished = log.compact_if_large(store);
            if !log.is_compacting() {
                return finished;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    #[cfg(not(tally_loom))]
    #[test]
    fn records_written_while_the_copy_is_made_are_in_the_log_it_replaces() {
        let (dir, mut log, store) = a_life_holding_a("compaction-during");
        log.compact_at = 0;
        log.compact_if_large(&store).unwrap();
        assert!(log.is_compacting(), "the copy is made on its own thread");
        // Batches while it is: to the key it copied, and to a new one.
        log.append(&key("a"), 2, 0).unwrap();
        log.append(&key("b"), 5, 1).unwrap();
        log.flush().unwrap();
        log.append(&key("b"), 1, 0).unwrap();
        log.flush().unwrap();
        while log.is_compacting() {
            std::thread::sleep(std::time::Duration::from_millis(1));
            log.compact_if_large(&store).unwrap();
        }
        assert!(!copy_path(&log.path).exists());
        let mut copied = Vec::new();
        encode(&key("a"), 3, 0, &mut copied);
        assert!(
            std::fs::read(&log.path).unwrap().starts_with(&copied),
            "the copy first"
        );
        // And after it, appended as before.
        log.append(&key("a"), 1, 0).unwrap();
        log.flush().unwrap();
        drop(log);
        assert_eq!(
            earlier_lanes(&dir),
            vec![(key("a"), Lane::new(6, 0)), (key("b"), Lane::new(6, 1))]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[cfg(not(tally_loom))]
    #[test]
    fn a_compaction_given_up_leaves_the_log_whole_and_serving() {
        let (dir, mut log, store) = a_life_holding_a("compaction-given-up");
        log.compact_at = 0;
        log.compact_if_large(&store).unwrap();
        // As past SINCE_BYTES_MAX of records written while the copy is made.
        log.compaction.as_mut().unwrap().give_up();
        log.append(&key("b"), 2, 0).unwrap();
        log.flush().unwrap();
        let before = std::fs::read(&log.path).unwrap();
        let err = (0..10_000)
            .find_map(|_| {
                std::thread::sleep(std::time::Duration::from_millis(1));
                log.compact_if_large(&store).err()
            })
            .expect("the copy's thread reports within 10 s");
        assert!(err.to_string().contains("given up"), "{err}");
        assert!(!log.is_compacting());
        assert_eq!(
            std::fs::read(&log.path).unwrap(),
            before,
            "the log as it was"
        );
        assert!(!copy_path(&log.path).exists(), "the copy removed");
        assert_eq!(log.compact_at, log.written + COMPACT_BYTES);
        log.append(&key("a"), 1, 0).unwrap();
        log.flush().unwrap();
        drop(log);
        assert_eq!(
            earlier_lanes(&dir),
            vec![(key("a"), Lane::new(4, 0)), (key("b"), Lane::new(2, 0))]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[cfg(not(tally_loom))]
    #[test]
    fn a_failed_compaction_leaves_the_log_whole_and_waits_for_the_log_to_grow_again() {
        let (dir, mut log, store) = a_life_holding_a("compaction-failed");
        let before = std::fs::read(&log.path).unwrap();
        // A directory where the copy goes: writing the copy fails.
        std::fs::create_dir(copy_path(&log.path)).unwrap();
        assert!(compact_now(&mut log, &store).is_err());
        assert_eq!(
            std::fs::read(&log.path).unwrap(),
            before,
            "the log as it was"
        );
        assert_eq!(log.compact_at, log.written + COMPACT_BYTES);
        // Not tried again on the next batch (it would fail again).
        assert!(log.compact_if_large(&store).is_ok());
        assert!(!log.is_compacting());
        // Still serving: later writes append.
        log.append(&key("a"), 1, 0).unwrap();
        log.flush().unwrap();
        let copy = copy_path(&log.path);
        drop(log);
        std::fs::remove_dir(copy).unwrap();
        assert_eq!(earlier_lanes(&dir), vec![(key("a"), Lane::new(4, 0))]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A start soon after the last takes a generation ahead of the wall clock, and waits it
    /// out, so that a later start with the directory wiped (TESTING.md L1), which takes the
    /// wall clock's, cannot take it again (found in review, session 46: with no wait it
    /// took the same one).
    #[test]
    fn a_generation_ahead_of_the_wall_clock_is_waited_out_so_a_wiped_start_takes_a_newer_one() {
        let dir = dir("generation-ahead");
        let (mut log, first) = open(&dir, NodeId(1), 1_000_000, NOW).unwrap();
        assert_eq!(first.generation, Generation(1_000_000));
        assert_eq!(first.wait_ms, 1, "its own millisecond");
        for subject in 0..5_000 {
            log.append(&key(&format!("s{subject}")), 1, 0).unwrap();
        }
        log.flush().unwrap();
        drop(log);
        // A crash loop: 1 ms later, past the 5,000 lanes the first life's start would have
        // re-published, and two more.
        let (_, second) = open(&dir, NodeId(1), 1_000_001, NOW).unwrap();
        assert_eq!(second.generation, Generation(1_000_007));
        assert_eq!(second.wait_ms, 7);
        std::fs::remove_dir_all(&dir).unwrap();
        let waited_out = 1_000_001 + second.wait_ms;
        let (_, wiped) = open(&dir, NodeId(1), waited_out, NOW).unwrap();
        assert!(wiped.generation > second.generation, "{wiped:?}");
        drop(wiped);
        // A clock stepped back past the last start is not waited out.
        let (_, stepped_back) = open(&dir, NodeId(1), 500_000, NOW).unwrap();
        assert_eq!(stepped_back.wait_ms, 0);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// The message of the panic that ended a start run in `catch_unwind`: a start that
    /// returned, or panicked with a formatted message (a failed assertion's), names that.
    fn killed_by<T: std::fmt::Debug>(ran: std::thread::Result<T>) -> &'static str {
        match ran {
            Ok(started) => panic!("the start was not killed: {started:?}"),
            Err(payload) => match payload.downcast::<&'static str>() {
                Ok(message) => *message,
                Err(payload) => panic!(
                    "the start panicked otherwise: {:?}",
                    payload.downcast_ref::<String>()
                ),
            },
        }
    }

    /// A start killed while it waits out its generation writes nothing of its life, so
    /// the next start is not ahead of a generation no life served: it waits out its own,
    /// and a later start with the directory wiped takes a newer one (found in review,
    /// session 47: the killed start had written its generation, the next read it as a
    /// clock stepped back, waited nothing and served under a generation the wall clock
    /// had not passed, which the wiped start then took again).
    #[test]
    fn a_start_killed_in_its_wait_leaves_the_next_one_waiting_out_its_own_generation() {
        let dir = dir("killed-in-wait");
        let (mut log, _) = open(&dir, NodeId(1), 1_000_000, NOW).unwrap();
        for subject in 0..5_000 {
            log.append(&key(&format!("s{subject}")), 1, 0).unwrap();
        }
        log.flush().unwrap();
        drop(log);
        // 1 ms later it must wait 7 ms (past the 5,000 lanes the last start re-published,
        // and two more), and is killed in that wait. The wait is read after the unwind:
        // an assertion inside it would panic into the same `catch_unwind` and pass.
        let waited = std::sync::Mutex::new(None);
        let killed = std::panic::catch_unwind(|| {
            super::open(&dir, NodeId(1), 1_000_001, NOW, |wait| {
                *waited.lock().unwrap() = Some(wait);
                panic!("killed in its wait");
            })
        });
        assert_eq!(killed_by(killed), "killed in its wait");
        assert_eq!(
            waited.into_inner().unwrap(),
            Some(Duration::from_millis(7)),
            "the start waits out its generation"
        );
        let generation = std::fs::read_to_string(dir.join("generation")).unwrap();
        assert_eq!(
            generation, "1000000",
            "the killed start's generation is not written"
        );
        for name in ["lanes-1000007.log", "answers-1000007.log"] {
            assert!(!dir.join(name).exists(), "{name}");
        }
        let (_, next) = open(&dir, NodeId(1), 1_000_003, NOW).unwrap();
        assert_eq!((next.generation, next.wait_ms), (Generation(1_000_007), 5));
        let serves_at = 1_000_003 + next.wait_ms;
        assert!(serves_at > next.generation.0);
        // It serves 11 ms; then the directory is wiped and the node starts again.
        std::fs::remove_dir_all(&dir).unwrap();
        let (_, wiped) = open(&dir, NodeId(1), serves_at + 11, NOW).unwrap();
        assert!(wiped.generation > next.generation, "{wiped:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A start killed in its wait leaves the earlier logs as the last served start left
    /// them, so the next start still skips past every lane that start re-published, the
    /// expired ones too (found in review, session 47: the killed start had rewritten them
    /// without the lanes whose windows had ended since, and the next start's generation
    /// fell below the versions the last one re-published).
    #[test]
    fn a_start_killed_in_its_wait_keeps_the_next_floor_above_the_last_republish() {
        let dir = dir("killed-in-wait-rewrite");
        let in_window = |subject: &str, len_secs| {
            let window = Window::containing(NOW, len_secs).unwrap();
            Key::new(
                Rule::new("r").unwrap(),
                Subject::new(subject).unwrap(),
                window,
            )
        };
        let (mut log, _) = open(&dir, NodeId(1), 1_000_000, NOW).unwrap();
        for subject in 0..2_400 {
            log.append(&in_window(&format!("s{subject}"), 60), 1, 0)
                .unwrap();
        }
        for subject in 0..100 {
            log.append(&in_window(&format!("l{subject}"), 86_400), 1, 0)
                .unwrap();
        }
        log.flush().unwrap();
        drop(log);
        let (_, served) = open(&dir, NodeId(1), 1_000_001, NOW).unwrap();
        assert_eq!(served.retired[0].1.len(), 2_500);
        // The versions the served start re-published, and the restamps above them.
        let highest = served.republish_floor().0 + 2_500 + 2_000;
        // 200 s later, the minute windows over, a start is killed in its wait.
        let killed = std::panic::catch_unwind(|| {
            super::open(&dir, NodeId(1), 1_000_006, NOW + 200, |_| panic!("killed"))
        });
        assert_eq!(
            killed_by(killed),
            "killed",
            "killed in its wait, not before it"
        );
        let (_, next) = open(&dir, NodeId(1), 1_000_007, NOW + 200).unwrap();
        assert!(
            next.republish_floor().0 >= highest,
            "{:?}",
            next.republish_floor()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A crash after a running life's compaction renamed its copy over the log, before
    /// the directory's sync and the reopen: the next start finds every record (from
    /// review, session 46).
    #[cfg(not(tally_loom))]
    #[test]
    fn a_crash_between_a_compactions_rename_and_its_reopen_loses_nothing() {
        let (dir, mut log, store) = a_life_holding_a("rename-crash");
        log.compact_at = 0;
        log.compact_if_large(&store).unwrap();
        log.append(&key("a"), 2, 0).unwrap();
        store.incr(&key("a"), 2).unwrap();
        log.append(&key("b"), 4, 1).unwrap();
        store.incr(&key("b"), 4).unwrap();
        store.decr(&key("b"), 1).unwrap();
        log.flush().unwrap();
        let mut compaction = log.compaction.take().unwrap();
        let path = log.path.clone();
        let replaced = loop {
            if let Some(replaced) = compaction.try_finish(&path) {
                break replaced;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        replaced.unwrap();
        drop(log);
        assert_eq!(
            earlier_lanes(&dir),
            vec![(key("a"), Lane::new(5, 0)), (key("b"), Lane::new(4, 1))]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
