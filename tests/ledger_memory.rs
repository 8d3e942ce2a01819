//! The region ledger's memory for the check ids applications name (`CheckId`), against
//! what README.md and ARCHITECTURE.md say it costs: about 80 bytes a check more in a
//! session, and about 590 bytes a session of one check (its entry in the ledger's map of
//! sessions, which grows in steps, and one B-tree leaf), so about 150 MiB at the default
//! `check_id_sessions_max` of 262,144 sessions of one check each.
//!
//! A session's ids come in order (`CheckId::new` counts up), so its B-tree's leaves split
//! full and stay about half full: a check costs about twice its 40-byte entry (found in
//! review, session 47: the docs said 40, then 32 before `Asked`).
//!
//! A test binary of its own, with one test: the allocator's counts are the process's, so
//! no other test may run beside it.

use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;
use tally_client::wire::CheckId;
use tally_node::region::log::RequestId;
use tally_node::region::{key_of, Decided, ExactCheck, Ledger, RECENT_CLIENT_IDS};

#[global_allocator]
static ALLOCATOR: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The documented bytes a named check adds to its session, and a session of one check
/// costs, with a tenth more for the allocator's and the tables' steps.
const CHECK_BYTES_MAX: f64 = 80.0 * 1.1;
const SESSION_BYTES_MAX: f64 = 590.0 * 1.1;

/// The default `check_id_sessions_max`.
const SESSIONS: u64 = 262_144;

/// A check of cost 1 the application named `seq` in `session`.
fn named(session: u64, seq: u64) -> ExactCheck {
    ExactCheck {
        id: RequestId {
            node: 2,
            generation: 1,
            seq,
        },
        check_id: Some(CheckId { session, seq }),
        rule: "quota".into(),
        subject: "acct-1".into(),
        window_index: 500_000,
        window_secs: 3_600,
        cost: 1,
    }
}

/// The bytes `ledger` holds more once it has decided `checks`, each a new one.
fn grown_by(ledger: &mut Ledger, checks: impl Iterator<Item = ExactCheck>) -> isize {
    let key = key_of("quota", "acct-1", 500_000, 3_600).expect("a valid key");
    let mut grown = 0;
    for check in checks {
        let region = Region::new(ALLOCATOR);
        let decided = ledger.decide(&check, &key, u64::MAX);
        let change = region.change();
        grown += change.bytes_allocated as isize - change.bytes_deallocated as isize;
        assert!(matches!(decided, Decided::New(_)), "{decided:?}");
    }
    grown
}

#[test]
fn a_named_check_and_a_session_cost_the_region_ledger_what_the_docs_say() {
    let mut ledger = Ledger::default();
    grown_by(&mut ledger, std::iter::once(named(7, 0)));
    let more = (1..RECENT_CLIENT_IDS as u64).map(|seq| named(7, seq));
    let per_check = grown_by(&mut ledger, more) as f64 / (RECENT_CLIENT_IDS - 1) as f64;

    let mut ledger = Ledger::default();
    let sessions = (0..SESSIONS).map(|session| named(session, 0));
    let all = grown_by(&mut ledger, sessions) as f64;
    let per_session = all / SESSIONS as f64;
    eprintln!(
        "each check more in a session: {per_check:.1} bytes; {SESSIONS} sessions of one \
         check: {:.1} MiB, {per_session:.1} bytes each",
        all / f64::from(1 << 20)
    );
    assert!(
        per_check <= CHECK_BYTES_MAX,
        "documented: about 80 bytes a check more; measured {per_check:.1}"
    );
    assert!(
        per_session <= SESSION_BYTES_MAX,
        "documented: about 590 bytes a session of one check; measured {per_session:.1}"
    );
}
