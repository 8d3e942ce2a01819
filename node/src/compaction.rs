//! A log's rewrite in two steps, so that the node's one thread never waits for the copy:
//! the lane log's ([`crate::lanelog`]) and the answer log's ([`crate::answerlog`]).
//!
//! [`Compaction::start`] hands the copy's body to a thread, which encodes it, writes it as
//! `<log>.copy.compact` and syncs it; the log meanwhile takes records as before, and its
//! owner passes each batch written out to [`Compaction::keep`]. [`Compaction::try_finish`],
//! once the copy is synced, writes those records after the copy's, syncs it and renames it
//! over the log: so the runtime's thread waits for syncs of the records written during the
//! copy, not of the whole copy. The owner then syncs the directory before it appends to the
//! renamed file.

use crate::lanelog::{write_synced, LogError};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, TryRecvError};

/// The most bytes of records a compaction keeps for its copy while the copy is written:
/// past that (a disk that has stopped), it is given up rather than hold more in memory.
pub(crate) const SINCE_BYTES_MAX: usize = 64 * 1024 * 1024;

/// A compaction under way: its copy is encoded, written and synced on a thread of its own.
#[derive(Debug)]
pub(crate) struct Compaction {
    copy: PathBuf,
    // The copy's length once it is written and synced, or why it was not.
    copied: Receiver<Result<u64, LogError>>,
    // The records written out since the copy's body was read, to go after it in the copy
    // before it replaces the log. `None` once they passed `SINCE_BYTES_MAX`: the copy is
    // then dropped when its thread is done.
    since: Option<Vec<u8>>,
}

impl Compaction {
    /// Starts a copy of the log at `log` on a thread named `thread`, with the body `body`
    /// encodes there.
    pub(crate) fn start(
        log: &Path,
        thread: &str,
        body: impl FnOnce() -> Vec<u8> + Send + 'static,
    ) -> Result<Compaction, LogError> {
        let copy = copy_path(log);
        let (done, copied) = mpsc::channel();
        let to = copy.clone();
        std::thread::Builder::new()
            .name(thread.into())
            .spawn(move || {
                let body = body();
                let _ = done.send(write_synced(&to, &body).map(|()| body.len() as u64));
            })
            .map_err(LogError::io_at(&copy))?;
        Ok(Compaction {
            copy,
            copied,
            since: Some(Vec::new()),
        })
    }

    /// Keeps `records`, just written out to the log, for the copy; past
    /// [`SINCE_BYTES_MAX`] gives the copy up.
    pub(crate) fn keep(&mut self, records: &[u8]) {
        match &mut self.since {
            Some(since) if since.len() + records.len() <= SINCE_BYTES_MAX => {
                since.extend_from_slice(records);
            }
            _ => self.since = None,
        }
    }

    /// Gives the copy up, as past [`SINCE_BYTES_MAX`] of records kept.
    #[cfg(all(test, not(tally_loom)))]
    pub(crate) fn give_up(&mut self) {
        self.since = None;
    }

    /// `None` while the copy's thread writes. Then the copy, with the records kept since
    /// after its own, synced and renamed over `log`: the log's new length. A copy that
    /// failed, or was given up, is removed and the log left as it was.
    pub(crate) fn try_finish(&mut self, log: &Path) -> Option<Result<u64, LogError>> {
        let copied = match self.copied.try_recv() {
            Err(TryRecvError::Empty) => return None,
            Ok(copied) => copied,
            Err(TryRecvError::Disconnected) => Err(LogError::Io {
                path: self.copy.clone(),
                source: std::io::Error::other("the copy's thread ended without a result"),
            }),
        };
        let replaced = copied.and_then(|len| {
            let since = self.since.as_ref().ok_or_else(|| LogError::Io {
                path: self.copy.clone(),
                source: std::io::Error::other(format!(
                    "given up: more than {SINCE_BYTES_MAX} bytes of records were written \
                     while the copy was"
                )),
            })?;
            let io = LogError::io_at(&self.copy);
            let file = OpenOptions::new()
                .write(true)
                .open(&self.copy)
                .map_err(&io)?;
            file.write_all_at(since, len).map_err(&io)?;
            file.sync_data().map_err(&io)?;
            std::fs::rename(&self.copy, log).map_err(LogError::io_at(log))?;
            Ok(len + since.len() as u64)
        });
        if replaced.is_err() {
            let _ = std::fs::remove_file(&self.copy);
        }
        Some(replaced)
    }
}

/// Where a running life's compaction writes its copy of `log`: `<name>.copy.compact`, a name
/// no start's rewrite uses, so that a copy still being written by a thread whose log was
/// dropped (in a test that opens the directory again) cannot mix with one.
pub(crate) fn copy_path(log: &Path) -> PathBuf {
    log.with_extension("copy.compact")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compaction_gives_up_its_copy_past_the_records_it_may_keep() {
        let (_, copied) = mpsc::channel();
        let mut compaction = Compaction {
            copy: PathBuf::from("unused.copy.compact"),
            copied,
            since: Some(vec![0; SINCE_BYTES_MAX - 1]),
        };
        compaction.keep(&[1]);
        assert_eq!(
            compaction.since.as_ref().map(Vec::len),
            Some(SINCE_BYTES_MAX)
        );
        compaction.keep(&[2]);
        assert!(compaction.since.is_none());
        compaction.keep(&[3]);
        assert!(compaction.since.is_none(), "given up for good");
    }
}
