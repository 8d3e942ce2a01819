//! Making check ids: one random session per process, numbered checks within it.

use crate::wire::CheckId;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// This process's session: drawn once, on the first id made.
static SESSION: OnceLock<u64> = OnceLock::new();

/// The next id's sequence number in this process's session.
static NEXT_SEQ: AtomicU64 = AtomicU64::new(0);

impl CheckId {
    /// A new id, never made before by this process; a check sent under it and sent again
    /// under it is counted once ([`crate::Client::check_with_id`]): by the region for an
    /// exact rule, by the sidecar that decided it for an approximate one. So is an
    /// increment or a decrement ([`crate::Client::incr_with_id`]), by its sidecar.
    ///
    /// The session is 64 bits from std's `RandomState` (seeded by the OS), so two
    /// processes share one with a chance of about `n² / 2^65` among `n` processes that
    /// make ids. Make an id just before its check's first send: numbers are given out
    /// here, and the region remembers a session's most recent 16,384 decided ones, so an
    /// id first sent after that many later ids of its process were decided is refused
    /// [`crate::Refusal::Forgotten`] though never decided. Once sent, keep it with the work
    /// it names (a queued job, say) to retry the check from another process, or after a
    /// restart, within the first check's window.
    #[allow(clippy::new_without_default)] // each call is different: not a default
    pub fn new() -> CheckId {
        let session = *SESSION.get_or_init(|| RandomState::new().hash_one(std::process::id()));
        CheckId {
            session,
            seq: NEXT_SEQ.fetch_add(1, Ordering::Relaxed),
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
}
