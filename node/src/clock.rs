//! The one place in tally that reads clocks and draws entropy (clippy's
//! `disallowed-methods` bars them everywhere else). Everything else takes time as an
//! argument, so the protocol and the decisions can be tested on any time they like.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tally_crdt::Stamp;
use tally_gossip::Now;

/// The node's clocks: a monotonic one for timers, the wall clock for stamps and windows.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
}

impl Clock {
    /// A clock whose monotonic readings count from now.
    #[allow(clippy::disallowed_methods)]
    pub fn start() -> Clock {
        Clock {
            start: Instant::now(),
        }
    }

    /// Both readings at once, as the gossip protocol takes them.
    pub fn now(&self) -> Now {
        Now {
            mono: self.mono(),
            wall: wall(),
        }
    }

    /// Time since [`Clock::start`], on the monotonic clock.
    pub fn mono(&self) -> Duration {
        self.start.elapsed()
    }

    /// The monotonic instant `at` (as returned by [`Clock::mono`]) for tokio's timers.
    pub fn instant(&self, at: Duration) -> Instant {
        self.start
            .checked_add(at)
            .unwrap_or(self.start + Duration::from_secs(1 << 32))
    }
}

/// The wall clock in milliseconds since the unix epoch (0 if the clock is before it).
#[allow(clippy::disallowed_methods)]
pub fn wall() -> Stamp {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    Stamp(since.as_millis() as u64)
}

/// Wall-clock microseconds since the unix epoch.
#[allow(clippy::disallowed_methods)]
pub fn wall_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros() as u64
}

/// A seed for the gossip's peer selection and the counter map's hasher: drawn from the
/// OS's randomness (std's `RandomState`), so it differs between processes and starts.
#[allow(clippy::disallowed_methods)]
pub fn entropy_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(wall_micros() as u128);
    hasher.write_u32(std::process::id());
    hasher.finish()
}

/// The wall clock that windows are expired by: it follows [`wall`], but never runs ahead
/// of its last reading by more than the monotonic time since, and a tenth more (room for
/// NTP's slewing, and for a clock that was behind to catch up, gradually). So a wall clock
/// stepped forward (a bad NTP step, a VM resumed with a stale clock) ends no live window
/// early: the window's count and request ids, forgotten once it ends, would be gone when
/// the clock is set back and the window is live again. It is never ahead of [`wall`].
#[derive(Debug, Clone, Copy)]
pub struct PacedWall {
    clock: Clock,
    last_ms: u64,
    last_mono: Duration,
}

impl PacedWall {
    /// Starts at the wall clock now.
    pub fn start() -> PacedWall {
        let clock = Clock::start();
        PacedWall {
            clock,
            last_ms: wall().0,
            last_mono: clock.mono(),
        }
    }

    /// The paced wall time now, in milliseconds since the unix epoch.
    pub fn now_ms(&mut self) -> u64 {
        self.at(wall().0, self.clock.mono())
    }

    /// The paced wall time given a wall reading `wall_ms` and a monotonic one `mono`.
    fn at(&mut self, wall_ms: u64, mono: Duration) -> u64 {
        let elapsed = mono.saturating_sub(self.last_mono).as_millis() as u64;
        let paced = self.last_ms.saturating_add(elapsed + elapsed / 10);
        self.last_ms = wall_ms.min(paced);
        self.last_mono = mono;
        self.last_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_paced_wall_follows_the_wall_takes_a_forward_step_slowly_and_a_backward_one_at_once() {
        let secs = Duration::from_secs;
        let mut paced = PacedWall {
            clock: Clock::start(),
            last_ms: 1_000_000,
            last_mono: secs(10),
        };
        assert_eq!(paced.at(1_001_000, secs(11)), 1_001_000, "in step");
        // The wall clock jumps an hour ahead: a second later the paced one is 1.1 s on.
        assert_eq!(paced.at(4_602_000, secs(12)), 1_002_100);
        assert_eq!(paced.at(4_612_000, secs(22)), 1_013_100);
        // Set back: the paced one is never ahead of the wall.
        assert_eq!(paced.at(1_013_000, secs(23)), 1_013_000);
        assert_eq!(paced.at(1_014_000, secs(24)), 1_014_000);
    }
}
