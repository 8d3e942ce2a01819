//! The region's durable log: one record per decided exact check, appended and synced in
//! groups before any of them is acknowledged.
//!
//! A record is `[len u32][crc32 u32][body]`. Recovery reads records until the first one
//! that is short, over-long or fails its checksum (a torn tail), truncates the file there,
//! and replays the prefix: counts and request ids are exactly those of the records kept.
//! Nothing after an acknowledged record can be missing from it, because the committer
//! acknowledges a group only after `sync_data` returned for every byte of it.

use super::ExactCheck;
use crate::checksummed;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

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

/// Where the log's bytes go: a file, or in tests a wrapper that fails on cue.
pub trait Storage: Send {
    /// Appends `bytes`.
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()>;
    /// Makes every appended byte durable.
    fn sync(&mut self) -> std::io::Result<()>;
}

/// The log file.
pub struct FileStorage {
    file: File,
}

impl Storage for FileStorage {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.file.write_all(bytes)
    }

    fn sync(&mut self) -> std::io::Result<()> {
        self.file.sync_data()
    }
}

/// Opens (or creates) the log at `path`: returns its storage for appending and the
/// records it holds, after truncating a torn tail, and how many bytes that dropped.
pub fn open(path: &Path) -> std::io::Result<(FileStorage, Vec<Record>, u64)> {
    let mut file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    let (records, valid) = replay(&bytes);
    let torn = bytes.len() as u64 - valid as u64;
    if torn > 0 {
        file.set_len(valid as u64)?;
        file.sync_all()?;
    }
    file.seek(SeekFrom::End(0))?;
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok((FileStorage { file }, records, torn))
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

/// Appends `record`'s encoding to `out`.
pub fn encode<S: Serialize>(record: &Record<S>, out: &mut Vec<u8>) {
    checksummed::append(record, out);
}

/// The whole, checksummed records at the front of `bytes`, and how many bytes they take.
pub fn replay(bytes: &[u8]) -> (Vec<Record>, usize) {
    checksummed::read_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64) -> Record {
        Record {
            id: RequestId {
                node: 2,
                generation: 1,
                seq,
            },
            rule: "quota".into(),
            subject: format!("acct-{seq}"),
            window_index: 500_000,
            window_secs: 3_600,
            cost: seq + 1,
            allowed: !seq.is_multiple_of(3),
        }
    }

    #[test]
    fn a_log_cut_at_every_offset_reopens_as_its_whole_records_and_appends_after_them() {
        let records: Vec<Record> = (0..5).map(record).collect();
        let mut whole = Vec::new();
        let mut ends = vec![0];
        for record in &records {
            encode(record, &mut whole);
            ends.push(whole.len());
        }
        let dir = std::env::temp_dir().join(format!("tally-region-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("region.log");
        for cut in 0..=whole.len() {
            std::fs::write(&path, &whole[..cut]).unwrap();
            let (mut storage, recovered, torn) = open(&path).unwrap();
            let kept = ends.iter().filter(|&&end| end <= cut).count() - 1;
            assert_eq!(recovered, records[..kept], "cut at {cut}");
            assert_eq!(torn as usize, cut - ends[kept], "cut at {cut}");
            // The torn tail is gone from the file: a new record follows the whole ones.
            let mut next = Vec::new();
            encode(&record(9), &mut next);
            storage.append(&next).unwrap();
            storage.sync().unwrap();
            drop(storage);
            let (_, reopened, torn) = open(&path).unwrap();
            assert_eq!(torn, 0, "cut at {cut}");
            assert_eq!(reopened.len(), kept + 1, "cut at {cut}");
            assert_eq!(reopened[kept], record(9));
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}
