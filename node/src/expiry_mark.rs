//! The paced wall clock's last reading ([`crate::clock::ExpiryClock`]), kept in the data
//! directory as the file `expiry`, so that a node started with its wall clock stepped ahead
//! ends no window early: the start resumes the paced clock from the reading (within
//! [`tally_gossip::PacedWall::LAG_MAX`] behind the wall clock) before it replays its logs,
//! and every expiry of the life counts from there. Without it, a start with the clock ten
//! minutes ahead would delete the lane logs and the region's ledger entries of windows that
//! only look over, and with them acknowledged writes and admissions.
//!
//! The driver writes the reading once a second, on a blocking thread. The file is written
//! beside itself, synced and renamed over itself, so a crash leaves the old reading or the
//! new one. The directory is not synced: a rename that a machine crash loses leaves the
//! older reading, and an older reading only makes expiry later.

use crate::lanelog::{write_synced, LogError};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tally_crdt::Stamp;

const FILE: &str = "expiry";

/// The reading kept in `dir`, if any. One that does not parse stops the start: it is
/// refused, naming the file, rather than taken as none.
pub fn read(dir: &Path) -> Result<Option<Stamp>, LogError> {
    let path = dir.join(FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => match text.trim().parse() {
            Ok(ms) => Ok(Some(Stamp(ms))),
            Err(_) => {
                let why = format!(
                    "holds {text:?}, not a time in ms; not started, so that no window is \
                     ended early (remove the file if the wall clock is right)"
                );
                let source = std::io::Error::new(std::io::ErrorKind::InvalidData, why);
                Err(LogError::Io { path, source })
            }
        },
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(LogError::Io { path, source }),
    }
}

/// Puts `at` in `dir`'s file: written beside it, synced, and renamed over it.
pub fn write(dir: &Path, at: Stamp) -> Result<(), LogError> {
    let (tmp, path) = (dir.join(format!("{FILE}.tmp")), dir.join(FILE));
    write_synced(&tmp, at.0.to_string().as_bytes())?;
    std::fs::rename(&tmp, &path).map_err(|source| LogError::Io { path, source })
}

/// Writes readings to a data directory, one at a time, from the runtime's blocking threads.
#[derive(Debug)]
pub struct ExpiryMark {
    dir: PathBuf,
    // Whether a write is in flight: a reading that comes meanwhile is skipped.
    writing: Arc<AtomicBool>,
    // Whether the last write failed: a failure is reported once, not once a second.
    failing: Arc<AtomicBool>,
}

impl ExpiryMark {
    /// Writes to `dir`.
    pub fn new(dir: PathBuf) -> ExpiryMark {
        ExpiryMark {
            dir,
            writing: Arc::default(),
            failing: Arc::default(),
        }
    }

    /// Writes `at` on a blocking thread, unless a write is in flight. A failure is reported
    /// on stderr and stops nothing: the reading only protects a later start from a clock
    /// stepped ahead.
    pub fn record(&self, at: Stamp) {
        if self.writing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (dir, writing, failing) =
            (self.dir.clone(), self.writing.clone(), self.failing.clone());
        tokio::task::spawn_blocking(move || {
            match write(&dir, at) {
                Ok(()) => failing.store(false, Ordering::Relaxed),
                Err(err) if !failing.swap(true, Ordering::Relaxed) => eprintln!(
                    "tallyd: warning: {err}: the paced clock's reading is not kept, so a \
                     start with the wall clock ahead may end live windows early"
                ),
                Err(_) => {}
            }
            writing.store(false, Ordering::Release);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tally-mark-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_reading_written_is_read_back_and_none_is_none() {
        let dir = dir("round-trip");
        assert_eq!(read(&dir).unwrap(), None);
        write(&dir, Stamp(1_700_000_123_456)).unwrap();
        write(&dir, Stamp(1_700_000_124_456)).unwrap();
        assert_eq!(read(&dir).unwrap(), Some(Stamp(1_700_000_124_456)));
        assert!(!dir.join("expiry.tmp").exists());
    }

    #[test]
    fn a_reading_that_does_not_parse_is_refused_naming_the_file() {
        let dir = dir("garbled");
        std::fs::write(dir.join("expiry"), "17000001x").unwrap();
        let err = read(&dir).unwrap_err().to_string();
        assert!(
            err.contains(&dir.join("expiry").display().to_string())
                && err.contains("not a time in ms"),
            "{err}"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_mark_writes_its_reading_from_a_blocking_thread() {
        let dir = dir("recorded");
        let mark = ExpiryMark::new(dir.clone());
        mark.record(Stamp(42_000));
        for _ in 0..200 {
            if !mark.writing.load(Ordering::Acquire) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(read(&dir).unwrap(), Some(Stamp(42_000)));
    }
}
