//! Making check ids: one random session per process, numbered checks within it.

use crate::wire::CheckId;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// This process's session, with the id of the process that drew it: drawn on the first id
/// made, and again in a child made by `fork`, which would otherwise share its parent's.
static SESSION: Mutex<Option<Drawn>> = Mutex::new(None);

#[derive(Debug, Clone, Copy)]
struct Drawn {
    process: u32,
    session: u64,
}

/// The next id's sequence number in this process's session.
static NEXT_SEQ: AtomicU64 = AtomicU64::new(0);

impl CheckId {
    /// A new id, never made before by this process; a check sent under it and sent again
    /// under it is counted once ([`crate::Client::check_with_id`]): by the region for an
    /// exact rule, by the sidecar that decided it for an approximate one. So is an
    /// increment or a decrement ([`crate::Client::incr_with_id`]), by its sidecar.
    ///
    /// The session is 64 bits from the OS's random source (`getrandom`), so two
    /// processes share one with a chance of about `n² / 2^65` among `n` processes that
    /// make ids. A process forked from one that made ids draws its own, told by its
    /// process id: a grandchild given the process id of the one that made ids (gone, and
    /// the process ids wrapped round) would take that one's session and numbers. Make an
    /// id just before its check's first send: numbers are given out here, and the region remembers
    /// a session's most recent 16,384 decided ones, so an id first sent after more than that
    /// many later ids of its process were decided is refused [`crate::Refusal::Forgotten`]
    /// though never decided. Once sent, keep it with the work it names (a queued job, say)
    /// to retry the check from another process, or after a restart, within the first
    /// check's window.
    #[allow(clippy::new_without_default)] // each call is different: not a default
    pub fn new() -> CheckId {
        CheckId {
            session: session_of(&SESSION, std::process::id()),
            seq: NEXT_SEQ.fetch_add(1, Ordering::Relaxed),
        }
    }
}

/// The session held in `held` if `process` drew it, else a new one drawn for `process`.
fn session_of(held: &Mutex<Option<Drawn>>, process: u32) -> u64 {
    let mut held = held.lock().unwrap_or_else(PoisonError::into_inner);
    match *held {
        Some(drawn) if drawn.process == process => drawn.session,
        _ => {
            // From the OS, not from std's `RandomState`, whose keys a forked child copies
            // from its parent: two children given the same process id in turn would draw
            // the same session.
            let session = getrandom::u64().unwrap_or_else(|_| RandomState::new().hash_one(process));
            *held = Some(Drawn { process, session });
            session
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_share_the_process_session_and_never_repeat() {
        let ids: Vec<CheckId> = (0..1_000).map(|_| CheckId::new()).collect();
        assert!(ids.iter().all(|id| id.session == ids[0].session));
        let mut seqs: Vec<u64> = ids.iter().map(|id| id.seq).collect();
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(seqs.len(), ids.len());
    }

    #[test]
    fn a_forked_process_draws_its_own_session() {
        let held = Mutex::new(None);
        let parent = session_of(&held, 100);
        assert_eq!(session_of(&held, 100), parent);
        let child = session_of(&held, 101);
        assert_ne!(child, parent);
        assert_eq!(session_of(&held, 101), child);
    }
}
