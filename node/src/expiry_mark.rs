//! The paced wall clock's last reading ([`crate::clock::ExpiryClock`]), kept in the data
//! directory as the file `expiry`, so that a node started with its wall clock stepped ahead
//! ends no window early: the start resumes the paced clock from the reading (within
//! [`tally_gossip::PacedWall::LAG_MAX`] behind the wall clock) before it replays its logs,
//! and every expiry of the life counts from there. Without it, a start with the clock ten
//! minutes ahead would delete the lane logs and the region's ledger entries of windows that
//! only look over, and with them acknowledged writes and admissions.
//!
//! The reading is kept with the machine's boot id and its time since boot
//! ([`crate::clock::boot`]). A start on the same boot (a process restart) moves the reading
//! on by the time since boot that has passed since, which no wall-clock step touches: it
//! resumes where the last life's paced clock would be now, with no lag to catch up. After
//! a reboot it resumes at the reading itself, behind by the time the machine was down (at
//! most `LAG_MAX`, taken in over about ten times that), so the windows that ended meanwhile
//! are held that much longer.
//!
//! The driver writes the reading every [`MARK_EVERY`], on a blocking thread. The file is
//! written beside itself, synced and renamed over itself, so a crash leaves the old reading
//! or the new one. The directory is not synced: a rename that a machine crash loses leaves
//! the older reading, and an older reading only makes expiry later, or no reading if the
//! rename lost was the directory's first. A start with no reading (the directory's first,
//! the first after an upgrade to a build that keeps one, or after that first rename was
//! lost) takes the wall clock as it is, unprotected.

use crate::clock::{self, Boot};
use crate::lanelog::{write_synced, LogError};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tally_crdt::Stamp;

const FILE: &str = "expiry";

/// How often the driver keeps the paced clock's reading.
pub const MARK_EVERY: Duration = Duration::from_secs(10);

/// A kept reading, and the boot it was taken on, if known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    /// The paced wall clock's reading.
    pub paced: Stamp,
    /// The machine's boot then.
    pub boot: Option<Boot>,
}

impl Mark {
    /// The reading to resume from on `boot` now: moved on by the time since boot that has
    /// passed if it is the same boot, else the reading as kept.
    pub fn resumed(&self, boot: Option<&Boot>) -> Stamp {
        match (&self.boot, boot) {
            (Some(then), Some(now)) if then.id == now.id && now.uptime_ms >= then.uptime_ms => {
                Stamp(self.paced.0.saturating_add(now.uptime_ms - then.uptime_ms))
            }
            _ => self.paced,
        }
    }

    fn text(&self) -> String {
        match &self.boot {
            Some(boot) => format!("{} {} {}", self.paced.0, boot.id, boot.uptime_ms),
            None => self.paced.0.to_string(),
        }
    }

    fn parse(text: &str) -> Option<Mark> {
        let mut fields = text.split_whitespace();
        let paced = Stamp(fields.next()?.parse().ok()?);
        let boot = match (fields.next(), fields.next()) {
            (Some(id), Some(uptime)) => Some(Boot {
                id: id.to_owned(),
                uptime_ms: uptime.parse().ok()?,
            }),
            (None, None) => None,
            _ => return None,
        };
        fields.next().is_none().then_some(Mark { paced, boot })
    }
}

/// The reading kept in `dir`, if any. One that does not parse stops the start: it is
/// refused, naming the file, rather than taken as none.
pub fn read(dir: &Path) -> Result<Option<Mark>, LogError> {
    let path = dir.join(FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => match Mark::parse(&text) {
            Some(mark) => Ok(Some(mark)),
            None => {
                let why = format!(
                    "holds {text:?}, not a time in ms (with a boot id and a time since \
                     boot); not started, so that no window is ended early (remove the file \
                     if the wall clock is right)"
                );
                let source = std::io::Error::new(std::io::ErrorKind::InvalidData, why);
                Err(LogError::Io { path, source })
            }
        },
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(LogError::Io { path, source }),
    }
}

/// Puts `mark` in `dir`'s file: written beside it, synced, and renamed over it.
pub fn write(dir: &Path, mark: &Mark) -> Result<(), LogError> {
    let (tmp, path) = (dir.join(format!("{FILE}.tmp")), dir.join(FILE));
    write_synced(&tmp, mark.text().as_bytes())?;
    std::fs::rename(&tmp, &path).map_err(|source| LogError::Io { path, source })
}

/// Writes readings to a data directory, one at a time, from the runtime's blocking threads.
#[derive(Debug)]
pub struct ExpiryMark {
    dir: PathBuf,
    // Whether a write is in flight: a reading that comes meanwhile is skipped.
    writing: Arc<AtomicBool>,
    // Whether the last write failed: a failure is reported once, not at every write.
    failing: Arc<AtomicBool>,
    // The monotonic time of the last reading written, if any.
    last: Option<Duration>,
}

impl ExpiryMark {
    /// Writes to `dir`.
    pub fn new(dir: PathBuf) -> ExpiryMark {
        ExpiryMark {
            dir,
            writing: Arc::default(),
            failing: Arc::default(),
            last: None,
        }
    }

    /// Writes `at`, read at monotonic time `mono`, on a blocking thread, if the last was
    /// written [`MARK_EVERY`] before or none was, and no write is in flight. A failure is
    /// reported on stderr and stops nothing: the reading only protects a later start from
    /// a clock stepped ahead.
    pub fn record(&mut self, at: Stamp, mono: Duration) {
        if self.last.is_some_and(|last| mono < last + MARK_EVERY)
            || self.writing.swap(true, Ordering::AcqRel)
        {
            return;
        }
        self.last = Some(mono);
        let mark = Mark {
            paced: at,
            boot: clock::boot(),
        };
        let (dir, writing, failing) =
            (self.dir.clone(), self.writing.clone(), self.failing.clone());
        tokio::task::spawn_blocking(move || {
            match write(&dir, &mark) {
                Ok(()) => failing.store(false, Ordering::Relaxed),
                Err(err) if !failing.swap(true, Ordering::Relaxed) => log_line!(
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

    fn boot(id: &str, uptime_ms: u64) -> Boot {
        Boot {
            id: id.to_owned(),
            uptime_ms,
        }
    }

    #[test]
    fn a_reading_written_is_read_back_and_none_is_none() {
        let dir = dir("round-trip");
        assert_eq!(read(&dir).unwrap(), None);
        let marks = [
            Mark {
                paced: Stamp(1_700_000_123_456),
                boot: Some(boot("07c2357c-c6ef-435e-a748-97627cc7805c", 52_224_470)),
            },
            Mark {
                paced: Stamp(1_700_000_124_456),
                boot: None,
            },
        ];
        for mark in marks {
            write(&dir, &mark).unwrap();
            assert_eq!(read(&dir).unwrap(), Some(mark));
        }
        assert!(!dir.join("expiry.tmp").exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_reading_that_does_not_parse_is_refused_naming_the_file() {
        let dir = dir("garbled");
        for garbled in ["17000001x", "1700000 boot", "1700000 boot 12 more", ""] {
            std::fs::write(dir.join("expiry"), garbled).unwrap();
            let err = read(&dir).unwrap_err().to_string();
            assert!(
                err.contains(&dir.join("expiry").display().to_string())
                    && err.contains("not a time in ms"),
                "{garbled:?}: {err}"
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_reading_resumes_moved_on_by_the_time_since_boot_on_the_same_boot_only() {
        let mark = Mark {
            paced: Stamp(1_000_000),
            boot: Some(boot("a", 50_000)),
        };
        // A process restart 7 s later, whatever the wall clock says now.
        assert_eq!(mark.resumed(Some(&boot("a", 57_000))), Stamp(1_007_000));
        // Another boot, a time since boot that went back, no boot known: as kept.
        assert_eq!(mark.resumed(Some(&boot("b", 57_000))), Stamp(1_000_000));
        assert_eq!(mark.resumed(Some(&boot("a", 40_000))), Stamp(1_000_000));
        assert_eq!(mark.resumed(None), Stamp(1_000_000));
        let unbooted = Mark {
            paced: Stamp(1_000_000),
            boot: None,
        };
        assert_eq!(unbooted.resumed(Some(&boot("a", 57_000))), Stamp(1_000_000));
    }

    /// The reading in `dir` once `mark`'s write in flight, if any, is done.
    async fn written(mark: &ExpiryMark, dir: &Path) -> Option<Stamp> {
        for _ in 0..200 {
            if !mark.writing.load(Ordering::Acquire) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        read(dir).unwrap().map(|kept| kept.paced)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_mark_writes_its_reading_from_a_blocking_thread_at_most_every_mark_every() {
        let dir = dir("recorded");
        let mut mark = ExpiryMark::new(dir.clone());
        mark.record(Stamp(42_000), Duration::from_secs(1));
        assert_eq!(written(&mark, &dir).await, Some(Stamp(42_000)));
        mark.record(Stamp(43_000), Duration::from_secs(2));
        assert_eq!(written(&mark, &dir).await, Some(Stamp(42_000)), "too soon");
        mark.record(Stamp(51_000), Duration::from_secs(11));
        assert_eq!(written(&mark, &dir).await, Some(Stamp(51_000)));
        assert_eq!(
            read(&dir).unwrap().unwrap().boot.is_some(),
            clock::boot().is_some()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
