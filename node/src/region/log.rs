//! The region's durable log: one entry per decided exact check, appended and synced in
//! groups before any of them is acknowledged, and now and then replaced whole by a
//! compaction: the entries of the state those decisions left.
//!
//! An entry is `[len u32][crc32 u32][body]`. Recovery reads entries until the first one
//! that is short, over-long or fails its checksum (a torn tail), truncates the file there,
//! and replays the prefix: counts and request ids are exactly those of the entries kept.
//! Nothing after an acknowledged entry can be missing from it, because the committer
//! acknowledges a group only after `sync_data` returned for every byte of it, and a
//! compaction replaces the file only by renaming a synced one over it.

use super::ExactCheck;
use crate::checksummed;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Who asked: the edge's replica and its sequence number. Unique across edge restarts,
/// because each life of an edge has its own generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId {
    /// The edge's node id.
    pub node: u64,
    /// The edge's generation.
    pub generation: u64,
    /// The edge's sequence number for this request; its retries reuse it.
    pub seq: u64,
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
    /// An edge life's sequence numbers below `base` are forgotten: never decided again.
    Floor {
        /// The edge's node id.
        node: u64,
        /// The edge's generation.
        generation: u64,
        /// The lowest sequence number the ledger still answers.
        base: u64,
    },
    /// A request id's outcome, for answering its retries.
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
}

/// Where the log's bytes go: a file, or in tests a wrapper that fails on cue.
pub trait Storage: Send {
    /// Appends `bytes`.
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()>;
    /// Makes every appended byte durable.
    fn sync(&mut self) -> std::io::Result<()>;
    /// Replaces the whole log's entries with `bytes`, durably and atomically: whatever
    /// happens, the log is either what it was or `bytes`; once this returns `Ok`, it is
    /// `bytes`.
    fn replace(&mut self, bytes: &[u8]) -> std::io::Result<()>;
}

/// The log file.
pub struct FileStorage {
    file: File,
    path: PathBuf,
}

impl Storage for FileStorage {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.file.write_all(bytes)
    }

    fn sync(&mut self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    fn replace(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let tmp = self.path.with_extension("compact");
        {
            let mut file = File::create(&tmp)?;
            file.write_all(MAGIC)?;
            file.write_all(bytes)?;
            file.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        sync_dir(&self.path)?;
        self.file = OpenOptions::new().append(true).open(&self.path)?;
        Ok(())
    }
}

/// The first bytes of a region log: they name its format, so that a log of another format
/// is refused at start rather than read as a torn tail and truncated.
pub const MAGIC: &[u8; 8] = b"tallyRL\x02";

/// Opens (or creates) the log at `path`: returns its storage for appending and the
/// entries it holds, after truncating a torn tail, and how many bytes that dropped. A
/// compaction's file that was never renamed over the log is removed. A file that does not
/// start with [`MAGIC`] is refused with `InvalidData`, and left as it is.
pub fn open(path: &Path) -> std::io::Result<(FileStorage, Vec<Entry>, u64)> {
    match std::fs::remove_file(path.with_extension("compact")) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => return Err(err),
        _ => {}
    }
    let mut file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    let (entries, torn) = if bytes.len() < MAGIC.len() && MAGIC.starts_with(&bytes) {
        // New, or cut off while its first bytes were written.
        file.set_len(0)?;
        file.write_all(MAGIC)?;
        file.sync_all()?;
        (Vec::new(), bytes.len() as u64)
    } else if let Some(body) = bytes.strip_prefix(MAGIC.as_slice()) {
        let (entries, valid) = replay(body);
        let torn = (body.len() - valid) as u64;
        if torn > 0 {
            file.set_len((MAGIC.len() + valid) as u64)?;
            file.sync_all()?;
        }
        (entries, torn)
    } else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a region log of this version of tally (its first bytes are not the \
             format's); it is left as it is: move it away to start with an empty log",
        ));
    };
    file.seek(SeekFrom::End(0))?;
    sync_dir(path)?;
    let storage = FileStorage {
        file,
        path: path.to_owned(),
    };
    Ok((storage, entries, torn))
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

impl<'a> Record<&'a str> {
    /// The record of `check`'s decision, borrowing its strings.
    pub fn decided(check: &'a ExactCheck, allowed: bool) -> Record<&'a str> {
        Record {
            id: check.id,
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

/// The whole, checksummed entries at the front of `bytes`, and how many bytes they take.
pub fn replay(bytes: &[u8]) -> (Vec<Entry>, usize) {
    checksummed::read_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries of every kind, in turn.
    fn entry(seq: u64) -> Entry {
        let id = RequestId {
            node: 2,
            generation: 1,
            seq,
        };
        match seq % 4 {
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
            _ => Entry::Outcome {
                id,
                allowed: true,
                count: seq,
                window_index: 500_000,
                window_secs: 3_600,
            },
        }
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tally-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_log_cut_at_every_offset_reopens_as_its_whole_entries_and_appends_after_them() {
        let entries: Vec<Entry> = (0..8).map(entry).collect();
        let mut whole = Vec::new();
        let mut ends = vec![0];
        for entry in &entries {
            encode(entry, &mut whole);
            ends.push(whole.len());
        }
        let dir = temp_dir("region-log");
        let path = dir.join("region.log");
        let file = [MAGIC.as_slice(), &whole].concat();
        for cut in 0..=file.len() {
            std::fs::write(&path, &file[..cut]).unwrap();
            let (mut storage, recovered, torn) = open(&path).unwrap();
            let body = cut.saturating_sub(MAGIC.len());
            let kept = ends.iter().filter(|&&end| end <= body).count() - 1;
            assert_eq!(recovered, entries[..kept], "cut at {cut}");
            let expected_torn = if cut < MAGIC.len() {
                cut
            } else {
                body - ends[kept]
            };
            assert_eq!(torn as usize, expected_torn, "cut at {cut}");
            // The torn tail is gone from the file: a new entry follows the whole ones.
            let mut next = Vec::new();
            encode(&entry(9), &mut next);
            storage.append(&next).unwrap();
            storage.sync().unwrap();
            drop(storage);
            let (_, reopened, torn) = open(&path).unwrap();
            assert_eq!(torn, 0, "cut at {cut}");
            assert_eq!(reopened.len(), kept + 1, "cut at {cut}");
            assert_eq!(reopened[kept], entry(9));
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_replaced_log_reopens_as_the_replacement_and_a_stray_compaction_file_is_removed() {
        let dir = temp_dir("region-replace");
        let path = dir.join("region.log");
        let bytes = |range: std::ops::Range<u64>| {
            let mut out = Vec::new();
            for seq in range {
                encode(&entry(seq), &mut out);
            }
            out
        };
        let (mut storage, _, _) = open(&path).unwrap();
        storage.append(&bytes(0..6)).unwrap();
        storage.replace(&bytes(10..12)).unwrap();
        storage.append(&bytes(12..13)).unwrap();
        storage.sync().unwrap();
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
    fn a_record_borrowed_from_its_check_encodes_as_the_owned_one() {
        let check = ExactCheck {
            id: RequestId {
                node: 2,
                generation: 1,
                seq: 7,
            },
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
