//! The one place in tally that reads clocks and draws entropy (clippy's
//! `disallowed-methods` bars them everywhere else). Everything else takes time as an
//! argument, so the protocol and the decisions can be tested on any time they like.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tally_crdt::Stamp;
use tally_gossip::{Now, PacedWall};

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

    /// The reading [`Clock::mono`] would have given at `at` (zero before the clock's start).
    pub fn mono_at(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.start)
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

/// Fills `bytes` from the OS's randomness: the nonces of the transport's connection ids,
/// which must not be guessed.
pub fn fill_random(bytes: &mut [u8]) {
    use ring::rand::SecureRandom;
    ring::rand::SystemRandom::new()
        .fill(bytes)
        .expect("invariant: the OS gives randomness");
}

/// This boot of the machine, as Linux's /proc tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Boot {
    /// The boot's random id (`/proc/sys/kernel/random/boot_id`).
    pub id: String,
    /// Milliseconds since the boot (`/proc/uptime`), across process restarts.
    pub uptime_ms: u64,
}

/// This boot of the machine now; `None` where /proc does not tell (not Linux).
pub fn boot() -> Option<Boot> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    let secs: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    Some(Boot {
        id: id.trim().to_owned(),
        uptime_ms: (secs * 1_000.0) as u64,
    })
}

/// [`PacedWall`] on this node's clocks: the wall clock that windows are expired by.
#[derive(Debug, Clone, Copy)]
pub struct ExpiryClock {
    clock: Clock,
    paced: PacedWall,
}

impl ExpiryClock {
    /// Starts at the wall clock now.
    pub fn start() -> ExpiryClock {
        ExpiryClock::resume(Clock::start(), None)
    }

    /// Starts on `clock` at `mark`, an earlier life's reading ([`PacedWall::resume`]), or
    /// at the wall clock now if there is none.
    pub fn resume(clock: Clock, mark: Option<Stamp>) -> ExpiryClock {
        let now = clock.now();
        let paced = match mark {
            Some(mark) => PacedWall::resume(now, mark),
            None => PacedWall::new(now),
        };
        ExpiryClock { clock, paced }
    }

    /// The paced wall time now.
    pub fn now(&mut self) -> Stamp {
        self.paced.at(self.clock.now())
    }

    /// The paced wall time now, in seconds since the unix epoch.
    pub fn now_secs(&mut self) -> u64 {
        self.now().0 / 1_000
    }

    /// The paced clock as it stands, for the gossip (which reads the same [`Clock`]).
    pub fn paced(&self) -> PacedWall {
        self.paced
    }
}
