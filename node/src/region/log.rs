//! The region's durable log: one entry per decided exact check, appended and synced in
//! groups before any of them is acknowledged, and now and then replaced whole by a
//! compaction: the entries of the state those decisions left.
//!
//! The file is a header, then the entries, then zeros up to its length:
//!
//! ```text
//! [header 20 bytes][entry]...[entry][entry]...[entry][0 0 0 ...... 0]
//!                  <-- compacted --> ^ appended      ^ end          ^ the file's length
//! header = [MAGIC 8 bytes][compacted u64 LE][crc32 of compacted u32 LE]
//! entry  = [len u32 LE][crc32 u32 LE][body: bincode, 1 to RECORD_BYTES_MAX bytes]
//! ```
//!
//! `compacted` is how many bytes of entries the compaction that wrote the file left (0 for
//! a log that was never compacted): those were synced before the file was renamed into
//! place, so no crash can cut them.
//!
//! The zeros are the log's allocation ahead of its end. A group is written over them and
//! synced with `sync_data`, which then has only the group's blocks to write: the file's
//! size and its block map were committed when the zeros were, by a sync of their own: a
//! chunk ([`CHUNK_BYTES`]) for a group that needs the room, or a step of one
//! ([`AHEAD_STEPS`]) ahead of need while the committer is idle. (Syncing an append that
//! grows the file also commits the new size, which costs more: see `client_load
//! --fsync-probe`.) Zeros written, not `fallocate`: the blocks of an `fallocate`d range are
//! "unwritten" extents on ext4, so the first sync after writing into one still commits
//! metadata (their conversion).
//!
//! Recovery reads entries until the first one that is short, over-long, fails its checksum
//! or has a length of 0: a body is never empty, so a zero length is the allocation's zeros,
//! the end of the log (the checksum cannot tell: the crc32 of no bytes is 0). The log's end
//! is where that replay stops, not the file's length. If any byte after the end is not zero
//! (a torn group: part of it, possibly a later part alone, reached the disk), the file is
//! truncated at the end before anything is appended, so that no entry of a group that was
//! never acknowledged can line up again behind new entries and come back at the next
//! recovery. Counts and request ids are exactly those of the entries kept. Nothing after an
//! acknowledged entry can be missing from it, because the committer acknowledges a group
//! only after `sync_data` returned for every byte of it, and a compaction replaces the file
//! only by renaming a synced one over it.
//!
//! So a crash leaves at most one group unacknowledged, at most [`TORN_BYTES_MAX`] bytes.
//! More bytes than that after the end mean an entry was damaged after it was synced (a
//! flipped bit, a bad block), and the entries after it were acknowledged: the log is then
//! refused at start and left as it is, never cut. So is damage within the compacted
//! entries, wherever it is, and a header whose checksum fails. Damage in the groups
//! appended since, within the last group's span of the end, cannot be told from a torn
//! group, and is cut as one.
//!
//! A log from before the allocation ahead (entries up to the file's length) is the same
//! format with no zeros at its end, and opens as it is.

use super::ExactCheck;
use crate::checksummed;
use crate::recent::Asked;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use tally_client::wire::CheckId;

/// Who asked: the edge's replica and its sequence number, unique across edge restarts
/// because each life of an edge has its own generation; or, for a check the application
/// named ([`CheckId`]), node [`CLIENT_NODE`], the application's session and its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId {
    /// The edge's node id, or [`CLIENT_NODE`].
    pub node: u64,
    /// The edge's generation, or the application's session.
    pub generation: u64,
    /// The sequence number for this request; its retries reuse it.
    pub seq: u64,
}

/// The node of a request id the application chose: no node has id 0 (`node_id` must be at
/// least 1), so these never meet an edge's own.
pub const CLIENT_NODE: u64 = 0;

impl RequestId {
    /// The request id of a check the application named `id`.
    pub fn client(id: CheckId) -> RequestId {
        RequestId {
            node: CLIENT_NODE,
            generation: id.session,
            seq: id.seq,
        }
    }
}

/// One decided check, as logged: owned when read back, borrowed from its check
/// (`Record<&str>`, encoded the same) when written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record<S = String> {
    /// The request.
    pub id: RequestId,
    /// The rule's name.
    pub rule: S,
    /// The subject.
    pub subject: S,
    /// The window's index, as the edge fixed it.
    pub window_index: u64,
    /// The window's length.
    pub window_secs: u32,
    /// The check's cost.
    pub cost: u64,
    /// Whether it was admitted (and so counted).
    pub allowed: bool,
}

/// One entry of the region log: a decision, or, from a compaction, the state that many
/// decisions left (a key's count, an edge life's floor, a request id's outcome).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Entry<S = String> {
    /// A decided check.
    Decided(Record<S>),
    /// A key's count.
    Count {
        /// The rule's name.
        rule: S,
        /// The subject.
        subject: S,
        /// The window's index.
        window_index: u64,
        /// The window's length.
        window_secs: u32,
        /// The count.
        count: u64,
    },
    /// An edge life's (or application session's) sequence numbers below `base` are
    /// forgotten: never decided again.
    Floor {
        /// The edge's node id.
        node: u64,
        /// The edge's generation.
        generation: u64,
        /// The lowest sequence number the ledger still answers.
        base: u64,
    },
    /// A request id's outcome, for answering its retries: an edge's own id, which names
    /// one check only, or an application's id in a log compacted before session 47
    /// (format 4), what it asked not known ([`Entry::NamedOutcome`] since).
    Outcome {
        /// The request.
        id: RequestId,
        /// Whether it was admitted.
        allowed: bool,
        /// The count after its decision.
        count: u64,
        /// Its window's index.
        window_index: u64,
        /// Its window's length.
        window_secs: u32,
    },
    /// The floor of an edge life (or application session) is kept until
    /// `until_unix_secs`, with or without outcomes held: a number below it may name a
    /// check whose window is live until then. Written after its `Floor`; logs from before
    /// it have none, and keep a floor only while it holds outcomes.
    FloorKept {
        /// The edge's node id.
        node: u64,
        /// The edge's generation.
        generation: u64,
        /// The first second at which no forgotten number's window is live.
        until_unix_secs: u64,
    },
    /// An application's request id's outcome ([`CLIENT_NODE`]), and what the check
    /// asked, so that the id sent with another check is refused, not given this outcome.
    /// Since session 47 ([`MAGIC`]'s format 5).
    NamedOutcome {
        /// The request.
        id: RequestId,
        /// What it asked: its rule, subject and cost.
        asked: Asked,
        /// Whether it was admitted.
        allowed: bool,
        /// The count after its decision.
        count: u64,
        /// Its window's index.
        window_index: u64,
        /// Its window's length.
        window_secs: u32,
    },
    /// Every window of length `window_secs` up to the one of index `through_index` is
    /// over for good: the ledger forgot its counts and ids, and refuses a check in it
    /// though a wall clock stepped back reads it as live. Since session 47 ([`MAGIC`]'s
    /// format 5; before, it was held in memory only, and a restart with the clock behind
    /// could reopen a window whose records a compaction had dropped).
    WindowsForgotten {
        /// The windows' length.
        window_secs: u32,
        /// The newest window forgotten.
        through_index: u64,
    },
}

/// Where the log's bytes go: a file, or in tests a wrapper that fails on cue.
pub trait Storage: Send {
    /// Makes room for `bytes` more after the log's end: if they would not fit inside the
    /// file's allocation, extends it with zeros to the next chunk boundary past them and
    /// syncs them, so that the sync after the append commits no change of the file's size.
    fn reserve(&mut self, bytes: usize) -> std::io::Result<()>;
    /// Allocates one step (a sixteenth of a chunk: [`AHEAD_STEPS`]) more now if less than a
    /// chunk is allocated after the log's end; whether it did, so that the caller may ask
    /// for another. The committer calls it while it finds no group waiting, so that a group
    /// seldom needs a chunk of its own, and one that arrives meanwhile waits for a step's
    /// zeros at most, not a chunk's. Storage that allocates nothing ahead does nothing. An
    /// error means the sync failed: a write that fails (a full disk) is no error here, since
    /// it made nothing durable, and the next group's own reserve meets it again.
    fn reserve_ahead(&mut self) -> std::io::Result<bool> {
        Ok(false)
    }
    /// Writes `bytes` at the log's end.
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()>;
    /// Makes every appended byte durable.
    fn sync(&mut self) -> std::io::Result<()>;
    /// Replaces the whole log's entries with `bytes`, durably and atomically: whatever
    /// happens, the log is either what it was or `bytes`; once this returns `Ok`, it is
    /// `bytes`, with at least a chunk allocated after them.
    fn replace(&mut self, bytes: &[u8]) -> Result<(), ReplaceError>;
}

/// A compaction that did not replace the log.
#[derive(Debug, thiserror::Error)]
#[error("{err}")]
pub struct ReplaceError {
    /// What failed, as the OS reported it.
    pub err: std::io::Error,
    /// Where.
    pub step: ReplaceStep,
}

/// Where a replacement of the log failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplaceStep {
    /// Making the copy's file (out of file descriptors, say): nothing was written, and the
    /// log is as it was.
    Create,
    /// Writing the copy: the log is as it was, but unless for want of room the disk
    /// failed a write.
    Copy,
    /// Syncing the copy: the log is as it was, but the disk failed a sync, whatever it
    /// reported (a sync's "no room" is a writeback error, on thin-provisioned or network
    /// storage, not a refused allocation).
    SyncCopy,
    /// From the rename on: whether the log was replaced, and whether this storage still
    /// writes to it, is not known.
    Rename,
}

impl ReplaceError {
    /// A failure whose effect on the log is not known.
    pub fn unknown(err: std::io::Error) -> ReplaceError {
        ReplaceError {
            err,
            step: ReplaceStep::Rename,
        }
    }

    /// Whether the log is certainly as it was, and takes appends as before: the
    /// replacement failed before its rename.
    pub fn log_whole(&self) -> bool {
        self.step != ReplaceStep::Rename
    }

    /// Whether acknowledging may go on: the log is as it was, no write failed but for want
    /// of room, and no sync failed (a disk that failed a sync, of the copy or of the log,
    /// may have dropped pages, and nothing after it is acknowledged; found in review,
    /// session 46: a sync of the copy that reported no room was taken for a refused write).
    pub fn harmless(&self) -> bool {
        match self.step {
            ReplaceStep::Create => true,
            ReplaceStep::Copy => is_no_room(&self.err),
            ReplaceStep::SyncCopy | ReplaceStep::Rename => false,
        }
    }
}

/// Whether `err` says the file system, or the user's quota on it, is full.
pub fn is_no_room(err: &std::io::Error) -> bool {
    matches!(
        err.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    )
}

/// The file is allocated ahead of the log's end in chunks of this many bytes when a group
/// needs the room (the file then ends on a chunk boundary), and in steps of a sixteenth of
/// one while the committer is idle ([`AHEAD_STEPS`]). Every byte of log is written twice,
/// as a zero and then as itself, whatever the chunk size; the size decides how often, and
/// for how long, a group waits for a chunk's zeros to be written and synced (about 1 ms
/// per MiB on this project's virtual disk when it was chosen; 2.6 ms for 4 MiB by hand in
/// session 43). The region's groups hold 16 to 25 KiB under load (BENCHMARKS.md, issue 5),
/// so with 4 MiB fewer than 1 in 160 groups wait, and the wait (about 4 ms) stays out of
/// the p99 of a group's commit. Measured on that disk, a committer over this file
/// committing 16 KiB groups one at a time: p99 380 to 480 us with 4 MiB, within a growing
/// file's 270 to 700 us, against 1.0 to 1.2 ms with 1 MiB and 590 to 690 us with 256 KiB;
/// p99.9 5.0 ms with 4 MiB. (`client_load --fsync-probe` times 16 KiB writes both ways,
/// the waits included; those figures are from before the steps ahead.) A chunk also holds
/// a largest group ([`GROUP_BYTES_MAX`]).
pub const CHUNK_BYTES: u64 = 4 * 1024 * 1024;

/// While the committer is idle, the allocation ahead grows a sixteenth of a chunk at a time
/// (256 KiB), until a chunk or more is allocated after the log's end. A group that arrives
/// during a step waits for it. By hand on this project's virtual disk, zeros written past
/// the file's end and synced took 305 us at p50 for 256 KiB (p90 336), 435 us for 512 KiB
/// and 3.1 ms for 1 MiB, against 133 to 140 us for a sync of 64 bytes to 16 KiB written
/// over zeros; 4 MiB past the end took 2.6 ms that way, and the committer's whole chunks
/// 3.5 to 4.5 ms, with every check in flight queued behind them (BENCHMARKS.md, session
/// 43). So a wait moves from a few groups in a thousand, for milliseconds, to about one
/// group in sixteen of 16 KiB (one in thousands of a single check), for a step: into the
/// p95 of a group's commit and up, out of its p99.9 (not measured).
pub const AHEAD_STEPS: u64 = 16;

/// The most bytes one group of records takes: the committer writes at most this much with
/// one append.
pub const GROUP_BYTES_MAX: usize = 4 * 1024 * 1024;

/// The most bytes of entries never acknowledged a crash can leave after the log's end: one
/// group, as builds before session 17 gathered it (up to one frame's records, at most
/// 512 KiB, past [`GROUP_BYTES_MAX`]), so that a log they left torn is not refused.
pub const TORN_BYTES_MAX: usize = GROUP_BYTES_MAX + 1024 * 1024;

/// The log file.
pub struct FileStorage {
    file: File,
    path: PathBuf,
    // Where the next entry goes. Invariant: every byte of the file from here on is zero
    // (unless a write failed: the committer then writes nothing more).
    end: u64,
    // The file's length once the zeros written ahead of `end` are synced; at least `end`.
    allocated: u64,
    // CHUNK_BYTES, but smaller in tests, so that a small log crosses chunks.
    chunk_bytes: u64,
}

impl Storage for FileStorage {
    fn reserve(&mut self, bytes: usize) -> std::io::Result<()> {
        let needed = self.end + bytes as u64;
        if needed <= self.allocated {
            return Ok(());
        }
        self.allocate_to(needed.next_multiple_of(self.chunk_bytes))
    }

    fn reserve_ahead(&mut self) -> std::io::Result<bool> {
        if self.allocated - self.end >= self.chunk_bytes {
            return Ok(false);
        }
        let step = (self.chunk_bytes / AHEAD_STEPS).max(1);
        let allocated = (self.allocated + 1).next_multiple_of(step);
        if checksummed::write_zeros(&self.file, &mut self.allocated.clone(), allocated).is_err() {
            return Ok(false);
        }
        self.file.sync_data()?;
        self.allocated = allocated;
        Ok(true)
    }

    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.file.write_all_at(bytes, self.end)?;
        self.end += bytes.len() as u64;
        self.allocated = self.allocated.max(self.end);
        Ok(())
    }

    fn sync(&mut self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    fn replace(&mut self, bytes: &[u8]) -> Result<(), ReplaceError> {
        let tmp = self.path.with_extension("compact");
        let end = (HEADER_BYTES + bytes.len()) as u64;
        let allocated = (end + self.chunk_bytes).next_multiple_of(self.chunk_bytes);
        let mut file = File::create(&tmp).map_err(|err| ReplaceError {
            err,
            step: ReplaceStep::Create,
        })?;
        let written = file
            .write_all(&header(bytes.len() as u64))
            .and_then(|()| file.write_all(bytes))
            .and_then(|()| checksummed::write_zeros(&file, &mut end.clone(), allocated))
            .map_err(|err| (err, ReplaceStep::Copy))
            .and_then(|()| file.sync_all().map_err(|err| (err, ReplaceStep::SyncCopy)));
        drop(file);
        if let Err((err, step)) = written {
            // A compaction that failed (a full disk, say) leaves no file taking room, and
            // the log as it was: nothing of it was touched.
            let _ = std::fs::remove_file(&tmp);
            return Err(ReplaceError { err, step });
        }
        // From the rename on, a failure may leave the log replaced, or replaced but not
        // durably, while `self.file` still writes to the file it replaced.
        std::fs::rename(&tmp, &self.path).map_err(ReplaceError::unknown)?;
        sync_dir(&self.path).map_err(ReplaceError::unknown)?;
        self.file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .map_err(ReplaceError::unknown)?;
        self.end = end;
        self.allocated = allocated;
        Ok(())
    }
}

impl FileStorage {
    /// Writes zeros from the allocation's end up to `allocated` and syncs them.
    fn allocate_to(&mut self, allocated: u64) -> std::io::Result<()> {
        // `self.allocated` moves only once the zeros are synced.
        checksummed::write_zeros(&self.file, &mut self.allocated.clone(), allocated)?;
        self.file.sync_data()?;
        self.allocated = allocated;
        Ok(())
    }
}

/// The first bytes of a region log: they name its format, so that a log of another format
/// is refused at start rather than read as a torn tail and truncated. A new kind of entry
/// takes a new one: a build that cannot decode an entry reads it as the log's end.
pub const MAGIC: &[u8; 8] = b"tallyRL\x05";

/// The formats with this header before [`MAGIC`]: the one before
/// [`Entry::NamedOutcome`] and [`Entry::WindowsForgotten`]. Still read (their entries are a subset of this format's); a
/// compaction writes [`MAGIC`].
const MAGICS_WITH_HEADER_BEFORE: [&[u8; 8]; 1] = [b"tallyRL\x04"];

/// The header's length: [`MAGIC`], the compacted entries' length and its crc32.
pub const HEADER_BYTES: usize = 20;

/// The formats before the header, whose entries follow their 8 bytes at once: the one
/// before the compacted length, and the one before [`Entry::FloorKept`]. Both are still
/// read, with nothing known to be compacted; the region compacts its log at start, which
/// writes [`MAGIC`], so an older build refuses the log from then on rather than reading
/// what it cannot decode as a torn tail.
const MAGICS_BEFORE_HEADER: [&[u8; 8]; 2] = [b"tallyRL\x03", b"tallyRL\x02"];

/// The header of a log whose first `compacted` bytes of entries a compaction wrote.
fn header(compacted: u64) -> [u8; HEADER_BYTES] {
    let length = compacted.to_le_bytes();
    let mut header = [0; HEADER_BYTES];
    header[..8].copy_from_slice(MAGIC);
    header[8..16].copy_from_slice(&length);
    header[16..].copy_from_slice(&crc32fast::hash(&length).to_le_bytes());
    header
}

/// Where a log's entries start and how many bytes of them a compaction wrote; `None` for a
/// file that is not a region log of a format this build reads.
fn read_header(bytes: &[u8]) -> Option<std::io::Result<(usize, usize)>> {
    let damaged = || {
        Some(Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the region log's header is damaged (cut short, its checksum fails, or its \
             format's byte is not this header's); the log is left as it is: restore it \
             from a copy, or move it away and start with --new-ledger for an empty log",
        )))
    };
    // Whether the 12 bytes after the first 8 are a compacted length and its checksum.
    let checked =
        |length: &[u8], crc: &[u8]| crc.len() == 4 && crc32fast::hash(length).to_le_bytes() == crc;
    let length = bytes.get(8..16).unwrap_or_default();
    let crc = bytes.get(16..HEADER_BYTES).unwrap_or_default();
    if MAGICS_BEFORE_HEADER
        .iter()
        .any(|magic| bytes.starts_with(magic.as_slice()))
    {
        // This header with its format's byte damaged into an older one's would be read as
        // entries from byte 8, a torn tail at once, and cut; a first entry whose length
        // and checksum happen to pass as a header's is about one chance in 2^32.
        return if checked(length, crc) {
            damaged()
        } else {
            Some(Ok((MAGIC.len(), 0)))
        };
    }
    let headed = |magic: &[u8; 8]| bytes.starts_with(magic);
    if !headed(MAGIC) && !MAGICS_WITH_HEADER_BEFORE.iter().copied().any(headed) {
        return None;
    }
    if !checked(length, crc) {
        return damaged();
    }
    let compacted = u64::from_le_bytes(length.try_into().expect("8 bytes"));
    Some(Ok((
        HEADER_BYTES,
        usize::try_from(compacted).unwrap_or(usize::MAX),
    )))
}

/// Opens (or creates) the log at `path`: returns its storage for appending and the
/// entries it holds, and how many bytes of torn tail it dropped (from the log's end to the
/// last byte that was not zero; the file is truncated at the end if there were any). A
/// compaction's file that was never renamed over the log is removed. A file that is empty,
/// a prefix of a new log's header or at most its length of zeros is a new log. A file
/// that does not start with [`MAGIC`] (or a format before it), whose header is damaged,
/// whose compacted entries are damaged, or that holds more than [`TORN_BYTES_MAX`] bytes
/// after a damaged entry, is refused with `InvalidData`, and left as it is.
pub fn open(path: &Path) -> std::io::Result<(FileStorage, Vec<Entry>, u64)> {
    match std::fs::remove_file(path.with_extension("compact")) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => return Err(err),
        _ => {}
    }
    let mut file = OpenOptions::new()
        .create(true)
        .read(true)
        .write(true)
        .truncate(false)
        .open(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    let new = header(0);
    let cut_off = bytes.len() < HEADER_BYTES && new.starts_with(&bytes);
    let never_synced = bytes.len() <= HEADER_BYTES && bytes.iter().all(|&byte| byte == 0);
    let (entries, end, torn) = if cut_off || never_synced {
        // New, or cut off while its first bytes were written, or a crash kept the new
        // file's size but not its bytes (nothing is appended before the header is synced).
        file.set_len(0)?;
        file.write_all_at(&new, 0)?;
        file.sync_all()?;
        (Vec::new(), HEADER_BYTES, bytes.len())
    } else if let Some(header) = read_header(&bytes) {
        let (start, compacted) = header?;
        let (entries, valid) = replay(&bytes[start..]);
        let end = start + valid;
        if valid < compacted {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the region log's entries stop at byte {end}, a damaged entry, inside the \
                     {compacted} bytes its last compaction wrote and synced before it \
                     replaced the log, which no crash can cut; the log is left as it is: \
                     restore it from a copy, or move it away and start with --new-ledger \
                     for an empty log"
                ),
            ));
        }
        let torn = bytes[end..]
            .iter()
            .rposition(|&byte| byte != 0)
            .map_or(0, |last| last + 1);
        if torn > TORN_BYTES_MAX {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the region log's entries stop at byte {end}, a damaged entry, but {torn} \
                     bytes after it are not zeros: more than a crash can leave of one group \
                     ({TORN_BYTES_MAX} bytes), so entries after it were acknowledged; the \
                     log is left as it is: restore it from a copy, or move it away and start \
                     with --new-ledger for an empty log"
                ),
            ));
        }
        if torn > 0 {
            file.set_len(end as u64)?;
            file.sync_all()?;
        }
        (entries, end, torn)
    } else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a region log of this version of tally (its first bytes are not the \
             format's); it is left as it is: move it away and start with --new-ledger for an \
             empty log",
        ));
    };
    sync_dir(path)?;
    let allocated = file.metadata()?.len();
    let storage = FileStorage {
        file,
        path: path.to_owned(),
        end: end as u64,
        allocated,
        chunk_bytes: CHUNK_BYTES,
    };
    Ok((storage, entries, torn as u64))
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

impl<'a> Record<&'a str> {
    /// The record of `check`'s decision, under the id it is remembered by, borrowing its
    /// strings.
    pub fn decided(check: &'a ExactCheck, allowed: bool) -> Record<&'a str> {
        Record {
            id: check.dedupe_id(),
            rule: &check.rule,
            subject: &check.subject,
            window_index: check.window_index,
            window_secs: check.window_secs,
            cost: check.cost,
            allowed,
        }
    }

    /// The same record, owning its strings.
    pub fn into_owned(self) -> Record {
        Record {
            id: self.id,
            rule: self.rule.to_owned(),
            subject: self.subject.to_owned(),
            window_index: self.window_index,
            window_secs: self.window_secs,
            cost: self.cost,
            allowed: self.allowed,
        }
    }
}

/// Appends `entry`'s encoding to `out`.
pub fn encode<S: Serialize>(entry: &Entry<S>, out: &mut Vec<u8>) {
    checksummed::append(entry, out);
}

/// The whole, checksummed entries at the front of `bytes`, and how many bytes they take:
/// up to the first entry that is not whole, or the first length of 0 (the end of the log).
pub fn replay(bytes: &[u8]) -> (Vec<Entry>, usize) {
    checksummed::read_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_entries_of_the_longest_names_read_back() {
        let rule = "r".repeat(tally_crdt::RULE_BYTES_MAX);
        let subject = "s".repeat(tally_crdt::SUBJECT_BYTES_MAX);
        let id = RequestId {
            node: u64::MAX,
            generation: u64::MAX,
            seq: u64::MAX,
        };
        let largest = [
            Entry::Decided(Record {
                id,
                rule: rule.clone(),
                subject: subject.clone(),
                window_index: u64::MAX,
                window_secs: u32::MAX,
                cost: u64::MAX,
                allowed: true,
            }),
            Entry::Count {
                rule,
                subject,
                window_index: u64::MAX,
                window_secs: u32::MAX,
                count: u64::MAX,
            },
        ];
        let mut bytes = Vec::new();
        for entry in &largest {
            encode(entry, &mut bytes);
        }
        assert_eq!(replay(&bytes), (largest.to_vec(), bytes.len()));
    }

    /// Entries of every kind, in turn.
    fn entry(seq: u64) -> Entry {
        let id = RequestId {
            node: 2,
            generation: 1,
            seq,
        };
        match seq % 6 {
            0 => Entry::Decided(Record {
                id,
                rule: "quota".into(),
                subject: format!("acct-{seq}"),
                window_index: 500_000,
                window_secs: 3_600,
                cost: seq + 1,
                allowed: !seq.is_multiple_of(3),
            }),
            1 => Entry::Count {
                rule: "quota".into(),
                subject: format!("acct-{seq}"),
                window_index: 500_000,
                window_secs: 3_600,
                count: seq * 7,
            },
            2 => Entry::Floor {
                node: 2,
                generation: 1,
                base: seq,
            },
            3 => Entry::FloorKept {
                node: 2,
                generation: 1,
                until_unix_secs: seq * 11,
            },
            4 => Entry::Outcome {
                id,
                allowed: true,
                count: seq,
                window_index: 500_000,
                window_secs: 3_600,
            },
            _ => Entry::NamedOutcome {
                id: RequestId::client(CheckId { session: 9, seq }),
                asked: Asked::named("quota", &format!("acct-{seq}"), seq),
                allowed: false,
                count: seq * 3,
                window_index: 500_000,
                window_secs: 3_600,
            },
        }
    }

    #[test]
    fn the_protocol_doc_lists_the_entries_by_their_encoded_index() {
        // docs/protocol.md gives each entry as "its variant's index, then its fields": its
        // table's order is the index a reader decodes.
        let doc = include_str!("../../../docs/protocol.md");
        let table = doc
            .split_once("its fields), one of:")
            .expect("the entry table in docs/protocol.md")
            .1;
        let documented: Vec<&str> = (table.lines())
            .skip_while(|line| !line.starts_with("| `"))
            .take_while(|line| line.starts_with('|'))
            .filter_map(|line| line.strip_prefix("| `")?.split(['`', '(']).next())
            .collect();
        let windows_forgotten = Entry::WindowsForgotten {
            window_secs: 3_600,
            through_index: 500_000,
        };
        let kinds = [
            ("Decided", entry(0)),
            ("Count", entry(1)),
            ("Floor", entry(2)),
            ("FloorKept", entry(3)),
            ("Outcome", entry(4)),
            ("NamedOutcome", entry(5)),
            ("WindowsForgotten", windows_forgotten),
        ];
        // A body starts with its variant's index, a one-byte varint.
        let mut by_index: Vec<(u8, &str)> = (kinds.into_iter())
            .map(|(name, entry)| (encoded(&[entry])[8], name))
            .collect();
        by_index.sort();
        let encoded: Vec<&str> = by_index.into_iter().map(|(_, name)| name).collect();
        assert_eq!(documented, encoded);
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tally-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The bytes of `entries`, each encoded.
    fn encoded(entries: &[Entry]) -> Vec<u8> {
        let mut out = Vec::new();
        for entry in entries {
            encode(entry, &mut out);
        }
        out
    }

    /// Opens `path` as `open` does, with chunks of `chunk_bytes`.
    fn open_small(path: &Path, chunk_bytes: u64) -> (FileStorage, Vec<Entry>, u64) {
        let (mut storage, entries, torn) = open(path).unwrap();
        storage.chunk_bytes = chunk_bytes;
        (storage, entries, torn)
    }

    /// Appends `bytes` as the committer does: room, write, sync.
    fn commit(storage: &mut FileStorage, bytes: &[u8]) {
        storage.reserve(bytes.len()).unwrap();
        storage.append(bytes).unwrap();
        storage.sync().unwrap();
    }

    /// The recovered end of `file`'s log is zeros up to the file's length, or past it.
    fn assert_zeros_after_end(path: &Path, end: usize, what: &str) {
        let file = std::fs::read(path).unwrap();
        assert!(file.len() >= end, "{what}: the file ends before the log");
        assert!(
            file[end..].iter().all(|&byte| byte == 0),
            "{what}: a byte after the log's end is not zero"
        );
    }

    #[test]
    fn a_log_cut_or_torn_at_every_offset_reopens_as_its_whole_entries_and_appends_after_them() {
        // A log written as the region writes it, in chunks of 64 bytes, so that its groups
        // cross chunks: its zeros ahead and their syncs are I/Os a crash can cut too.
        let entries: Vec<Entry> = (0..8).map(entry).collect();
        let dir = temp_dir("region-log");
        let path = dir.join("region.log");
        let (mut storage, _, _) = open_small(&path, 64);
        let mut ends = vec![HEADER_BYTES];
        for group in entries.chunks(3) {
            let bytes = encoded(group);
            storage.reserve(bytes.len()).unwrap();
            let allocated = std::fs::metadata(&path).unwrap().len();
            assert!(allocated.is_multiple_of(64), "whole chunks");
            storage.append(&bytes).unwrap();
            storage.sync().unwrap();
            let len = std::fs::metadata(&path).unwrap().len();
            assert_eq!(
                len, allocated,
                "an append inside the allocation keeps the size"
            );
            for entry in group {
                ends.push(ends.last().unwrap() + encoded(std::slice::from_ref(entry)).len());
            }
        }
        drop(storage);
        let file = std::fs::read(&path).unwrap();
        let log_end = *ends.last().unwrap();
        assert!(file.len() > log_end, "zeros ahead of the end");
        for cut in 0..=file.len() {
            // What a crash can leave: the file cut off (a log grown by appends, or a chunk's
            // zeros not all written), the part after the cut not yet written (zeros ahead),
            // or a hole: 16 bytes not written while later ones were.
            let mut cases = vec![("cut", file[..cut].to_vec())];
            if cut >= HEADER_BYTES {
                let mut zeros = file.clone();
                zeros[cut..].fill(0);
                cases.push(("zeros after", zeros));
                let mut hole = file.clone();
                hole[cut..(cut + 16).min(file.len())].fill(0);
                cases.push(("hole", hole));
            }
            for (case, bytes) in cases {
                let what = format!("{case} at {cut}");
                std::fs::write(&path, &bytes).unwrap();
                // The first byte that differs from the whole file, or is missing.
                let damaged = (0..file.len())
                    .find(|&at| bytes.get(at) != Some(&file[at]))
                    .unwrap_or(file.len());
                let kept = ends
                    .iter()
                    .filter(|&&end| end <= damaged)
                    .count()
                    .saturating_sub(1);
                let end = ends[kept];
                let expected_torn = if bytes.len() < HEADER_BYTES {
                    bytes.len()
                } else {
                    bytes[end..]
                        .iter()
                        .rposition(|&byte| byte != 0)
                        .map_or(0, |last| last + 1)
                };
                let (mut storage, recovered, torn) = open_small(&path, 64);
                assert_eq!(recovered, entries[..kept], "{what}");
                assert_eq!(torn as usize, expected_torn, "{what}");
                assert_zeros_after_end(&path, end.max(HEADER_BYTES), &what);
                // A new entry follows the whole ones, and nothing else comes back.
                commit(&mut storage, &encoded(&[entry(9)]));
                drop(storage);
                let (_, reopened, torn) = open(&path).unwrap();
                assert_eq!(torn, 0, "{what}");
                assert_eq!(reopened.len(), kept + 1, "{what}");
                assert_eq!(reopened[..kept], entries[..kept], "{what}");
                assert_eq!(reopened[kept], entry(9), "{what}");
            }
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_torn_groups_later_entry_is_never_resurrected_behind_new_entries() {
        // A group C, D whose C was torn while D reached the disk, then a new entry E of C's
        // length: if the bytes after the recovered end were left, E would end where D
        // starts, and the next recovery would read D, never acknowledged, as decided.
        let (c, d, e) = (entry(4), entry(5), entry(10));
        assert_eq!(
            encoded(std::slice::from_ref(&c)).len(),
            encoded(std::slice::from_ref(&e)).len()
        );
        let dir = temp_dir("region-resurrect");
        let path = dir.join("region.log");
        let mut torn_c = encoded(&[c]);
        let last = torn_c.len() - 1;
        torn_c[last] ^= 0xff;
        let file = [
            header(0).as_slice(),
            &encoded(&[entry(0), entry(1)]),
            &torn_c,
            &encoded(&[d]),
            &[0; 100],
        ]
        .concat();
        std::fs::write(&path, &file).unwrap();
        let (mut storage, recovered, torn) = open(&path).unwrap();
        assert_eq!(recovered, [entry(0), entry(1)]);
        assert!(torn > 0);
        commit(&mut storage, &encoded(std::slice::from_ref(&e)));
        drop(storage);
        let (_, reopened, _) = open(&path).unwrap();
        assert_eq!(reopened, [entry(0), entry(1), e], "D came back");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_damaged_entry_followed_by_more_than_a_group_is_refused_and_the_log_left_whole() {
        // A flipped bit in an entry synced long ago: the entries after it, more bytes than
        // one group, were acknowledged, and cutting them would lose them.
        let dir = temp_dir("region-damaged");
        let path = dir.join("region.log");
        let (mut storage, _, _) = open(&path).unwrap();
        let after = TORN_BYTES_MAX / 14;
        commit(&mut storage, &encoded(&[entry(0)]));
        for chunk in (1..=after as u64).collect::<Vec<_>>().chunks(10_000) {
            let entries: Vec<Entry> = chunk.iter().map(|&i| entry(i)).collect();
            commit(&mut storage, &encoded(&entries));
        }
        drop(storage);
        let mut file = std::fs::read(&path).unwrap();
        let first = encoded(&[entry(0)]).len();
        let logged = file.iter().rposition(|&byte| byte != 0).unwrap() + 1;
        assert!(
            logged - HEADER_BYTES - first > TORN_BYTES_MAX,
            "more than a group after"
        );
        file[HEADER_BYTES + 12] ^= 0x01;
        std::fs::write(&path, &file).unwrap();
        let err = open(&path).err().expect("a damaged log is refused");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("damaged entry"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), file, "left as it is");
        // The same damage in the last entry, within a group's span of the end, is a torn
        // tail: cut as before.
        file[HEADER_BYTES + 12] ^= 0x01;
        let end = file.iter().rposition(|&byte| byte != 0).unwrap() + 1;
        let last = encoded(&[entry(after as u64)]).len();
        file[end - last + 12] ^= 0x01;
        std::fs::write(&path, &file).unwrap();
        let (_, recovered, torn) = open(&path).unwrap();
        assert_eq!(
            recovered.len(),
            after,
            "every entry but the damaged last one"
        );
        assert!(torn > 0 && torn as usize <= last, "{torn} bytes torn");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_length_of_zero_ends_the_log_even_where_an_empty_body_would_check() {
        // The allocation's zeros read as `[len 0][crc 0]`: crc32 of no bytes is 0, so the
        // checksum holds, and a type that decodes from no bytes would be read on forever.
        assert_eq!(crc32fast::hash(&[]), 0);
        assert!(checksummed::read::<()>(&[0; 8], 0).is_none());
        assert_eq!(checksummed::read_all::<()>(&[0; 64]), (Vec::new(), 0));
        let mut bytes = encoded(&[entry(0)]);
        let end = bytes.len();
        bytes.extend_from_slice(&[0; 8]);
        bytes.extend_from_slice(&encoded(&[entry(1)]));
        assert_eq!(replay(&bytes), (vec![entry(0)], end));
    }

    #[test]
    fn a_replaced_log_reopens_as_the_replacement_and_a_stray_compaction_file_is_removed() {
        let dir = temp_dir("region-replace");
        let path = dir.join("region.log");
        let bytes = |range: std::ops::Range<u64>| encoded(&range.map(entry).collect::<Vec<_>>());
        let (mut storage, _, _) = open_small(&path, 64);
        commit(&mut storage, &bytes(0..6));
        storage.replace(&bytes(10..12)).unwrap();
        // The replacement has its allocation ahead: at least a chunk of zeros.
        let end = HEADER_BYTES + bytes(10..12).len();
        let len = std::fs::metadata(&path).unwrap().len();
        assert!(len.is_multiple_of(64) && len >= end as u64 + 64, "{len}");
        assert_zeros_after_end(&path, end, "replaced");
        commit(&mut storage, &bytes(12..13));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len);
        drop(storage);
        // A crash during a later compaction leaves its file beside the log.
        std::fs::write(path.with_extension("compact"), bytes(20..30)).unwrap();
        let (_, reopened, torn) = open(&path).unwrap();
        assert_eq!(torn, 0);
        assert_eq!(reopened, (10..13).map(entry).collect::<Vec<_>>());
        assert!(!path.with_extension("compact").exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn allocating_ahead_adds_one_step_at_a_time_until_a_chunk_is_allocated_after_the_end() {
        let dir = temp_dir("region-ahead");
        let path = dir.join("region.log");
        // Chunks of 64 bytes: steps of 4.
        let (mut storage, _, _) = open_small(&path, 64);
        let file_len = || std::fs::metadata(&path).unwrap().len();
        // The header's 20 bytes and 10 more: 34 of the first chunk's 64 left, under a chunk
        // ahead. Each call adds one step and no more.
        commit(&mut storage, &[1; 10]);
        assert_eq!((storage.end, storage.allocated, file_len()), (30, 64, 64));
        assert!(storage.reserve_ahead().unwrap());
        assert_eq!((storage.allocated, file_len()), (68, 68));
        for _ in 0..7 {
            assert!(storage.reserve_ahead().unwrap());
        }
        // 66 bytes after the end: a chunk or more, so nothing is added.
        assert_eq!((storage.allocated, file_len()), (96, 96));
        assert!(!storage.reserve_ahead().unwrap());
        assert_eq!((storage.allocated, file_len()), (96, 96));
        assert_zeros_after_end(&path, 30, "after allocating ahead");
        // The next group fits without an allocation of its own.
        commit(&mut storage, &[3; 60]);
        assert_eq!((storage.end, storage.allocated, file_len()), (90, 96, 96));
        // One that does not fit allocates whole chunks, as without the steps ahead.
        commit(&mut storage, &[4; 10]);
        assert_eq!(
            (storage.end, storage.allocated, file_len()),
            (100, 128, 128)
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_new_log_whose_size_outlived_a_crash_but_not_its_bytes_starts_anew() {
        let dir = temp_dir("region-zeros");
        let path = dir.join("region.log");
        for len in [3, MAGIC.len(), HEADER_BYTES] {
            std::fs::write(&path, vec![0; len]).unwrap();
            let (_, entries, _) = open(&path).unwrap();
            assert!(entries.is_empty());
            assert_eq!(std::fs::read(&path).unwrap(), header(0), "{len} zeros");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_log_of_another_format_is_refused_and_left_as_it_is() {
        let dir = temp_dir("region-format");
        let path = dir.join("region.log");
        // A log of the format before MAGIC: bare records.
        let mut old = Vec::new();
        checksummed::append(&(1u64, "quota", 5u64), &mut old);
        std::fs::write(&path, &old).unwrap();
        let err = open(&path).err().expect("refused");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("not a region log"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), old, "left as it was");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn logs_of_the_formats_before_the_header_are_read_and_compacted_to_this_one() {
        for (i, magic) in MAGICS_BEFORE_HEADER.iter().enumerate() {
            let dir = temp_dir(&format!("region-format-before-{i}"));
            let path = dir.join("region.log");
            let decided = entry(0);
            let old = [magic.as_slice(), &encoded(std::slice::from_ref(&decided))].concat();
            std::fs::write(&path, &old).unwrap();
            assert_format_appends_then_compacts_to_this_one(&path, magic, decided);
            std::fs::remove_dir_all(dir).unwrap();
        }
    }

    #[test]
    fn logs_of_the_formats_with_this_header_before_are_read_and_compacted_to_this_one() {
        for (i, magic) in MAGICS_WITH_HEADER_BEFORE.iter().enumerate() {
            let dir = temp_dir(&format!("region-format-headed-{i}"));
            let path = dir.join("region.log");
            let decided = entry(0);
            let mut old = header(0).to_vec();
            old[..8].copy_from_slice(*magic);
            old.extend_from_slice(&encoded(std::slice::from_ref(&decided)));
            std::fs::write(&path, &old).unwrap();
            assert_format_appends_then_compacts_to_this_one(&path, magic, decided);
            std::fs::remove_dir_all(dir).unwrap();
        }
    }

    /// Opens the log at `path`, of the format `magic` holding only `decided`; appends to it
    /// in that format, then compacts it to this one.
    fn assert_format_appends_then_compacts_to_this_one(
        path: &Path,
        magic: &[u8; 8],
        decided: Entry,
    ) {
        let (mut storage, entries, torn) = open(path).unwrap();
        assert_eq!((entries, torn), (vec![decided.clone()], 0));
        commit(&mut storage, &encoded(&[entry(6)]));
        let bytes = std::fs::read(path).unwrap();
        assert!(
            bytes.starts_with(magic),
            "appends, decisions alone, keep the format"
        );
        drop(storage);
        let (mut storage, entries, _) = open(path).unwrap();
        assert_eq!(entries, [decided, entry(6)]);
        storage.replace(&encoded(&[entry(3), entry(5)])).unwrap();
        let bytes = std::fs::read(path).unwrap();
        assert!(
            bytes.starts_with(MAGIC),
            "a compaction, which may hold FloorKept and NamedOutcome, writes this one"
        );
        drop(storage);
        assert_eq!(open(path).unwrap().1, [entry(3), entry(5)]);
    }

    #[test]
    fn a_flipped_bit_in_the_header_or_the_compacted_entries_is_refused_and_after_them_cut() {
        // Damage a crash cannot leave: the header and the compacted entries were synced
        // before the file was renamed into place. Only the groups appended since can be
        // torn, and damage there, within a group's span of the end, is cut as a torn tail.
        let dir = temp_dir("region-compacted-damage");
        let path = dir.join("region.log");
        let (mut storage, _, _) = open_small(&path, 64);
        commit(&mut storage, &encoded(&[entry(0)]));
        let compacted: Vec<Entry> = (10..13).map(entry).collect();
        storage.replace(&encoded(&compacted)).unwrap();
        let appended: Vec<Entry> = (20..23).map(entry).collect();
        commit(&mut storage, &encoded(&appended[..2]));
        commit(&mut storage, &encoded(&appended[2..]));
        drop(storage);
        let file = std::fs::read(&path).unwrap();
        let compacted_end = HEADER_BYTES + encoded(&compacted).len();
        let mut ends = vec![compacted_end];
        for entry in &appended {
            ends.push(ends.last().unwrap() + encoded(std::slice::from_ref(entry)).len());
        }
        let whole: Vec<Entry> = compacted.iter().chain(&appended).cloned().collect();
        assert_eq!(open(&path).unwrap().1, whole);
        for at in 0..*ends.last().unwrap() {
            let mut damaged = file.clone();
            damaged[at] ^= 0x01;
            std::fs::write(&path, &damaged).unwrap();
            match open(&path) {
                Err(err) => {
                    assert!(at < compacted_end, "byte {at}, after the compacted: {err}");
                    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "byte {at}");
                    let why = if at < MAGIC.len() {
                        "not a region log"
                    } else if at < HEADER_BYTES {
                        "header is damaged"
                    } else {
                        "its last compaction wrote"
                    };
                    assert!(err.to_string().contains(why), "byte {at}: {err}");
                    assert_eq!(std::fs::read(&path).unwrap(), damaged, "byte {at}: left");
                }
                // The format's byte flipped to the format before, whose entries this one's
                // are but for `NamedOutcome`, which it reads as well.
                Ok((_, recovered, torn))
                    if MAGICS_WITH_HEADER_BEFORE
                        .iter()
                        .any(|magic| damaged.starts_with(*magic)) =>
                {
                    assert_eq!((recovered, torn), (whole.clone(), 0), "byte {at}");
                }
                Ok((_, recovered, torn)) => {
                    assert!(at >= compacted_end, "byte {at}, compacted, was cut");
                    let kept = ends.iter().filter(|&&end| end <= at).count() - 1;
                    assert_eq!(recovered, whole[..compacted.len() + kept], "byte {at}");
                    assert!(torn > 0, "byte {at}");
                }
            }
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_header_whose_format_byte_reads_as_an_older_format_is_refused_not_cut() {
        let dir = temp_dir("region-format-byte");
        let path = dir.join("region.log");
        let (mut storage, _, _) = open(&path).unwrap();
        storage.replace(&encoded(&[entry(1), entry(2)])).unwrap();
        drop(storage);
        let file = std::fs::read(&path).unwrap();
        for older in MAGICS_BEFORE_HEADER {
            let mut damaged = file.clone();
            damaged[7] = older[7];
            std::fs::write(&path, &damaged).unwrap();
            let err = open(&path).err().expect("refused");
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
            assert!(err.to_string().contains("header is damaged"), "{err}");
            assert_eq!(std::fs::read(&path).unwrap(), damaged, "left as it is");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_replacement_that_fails_before_its_rename_leaves_the_log_whole_and_taking_appends() {
        let dir = temp_dir("region-replace-fails");
        let path = dir.join("region.log");
        let (mut storage, _, _) = open_small(&path, 64);
        commit(&mut storage, &encoded(&[entry(0), entry(1)]));
        let before = std::fs::read(&path).unwrap();
        // The copy cannot be created: a directory stands where it goes.
        std::fs::create_dir(path.with_extension("compact")).unwrap();
        let err = storage.replace(&encoded(&[entry(7)])).unwrap_err();
        assert!(err.log_whole() && err.harmless(), "{err}");
        assert_eq!(err.step, ReplaceStep::Create);
        assert_eq!(std::fs::read(&path).unwrap(), before, "the log untouched");
        commit(&mut storage, &encoded(&[entry(2)]));
        drop(storage);
        std::fs::remove_dir(path.with_extension("compact")).unwrap();
        let (_, entries, torn) = open(&path).unwrap();
        assert_eq!((entries, torn), ((0..3).map(entry).collect(), 0));
        // A rename that fails (a directory now stands where the log was) is a failure of
        // unknown effect.
        let (mut storage, _, _) = open_small(&path, 64);
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("in the way"), b"").unwrap();
        let err = storage.replace(&encoded(&[entry(7)])).unwrap_err();
        assert!(!err.log_whole() && !err.harmless(), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_record_borrowed_from_its_check_encodes_as_the_owned_one() {
        let check = ExactCheck {
            id: RequestId {
                node: 2,
                generation: 1,
                seq: 7,
            },
            check_id: None,
            rule: "quota".into(),
            subject: "acct".into(),
            window_index: 500_000,
            window_secs: 3_600,
            cost: 3,
        };
        let borrowed = Record::decided(&check, true);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        encode(&Entry::Decided(borrowed.clone()), &mut a);
        encode(&Entry::Decided(borrowed.into_owned()), &mut b);
        assert_eq!(a, b);
    }
}
