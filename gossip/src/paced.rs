//! The wall clock that windows are expired by.

use crate::Now;
use tally_crdt::Stamp;

/// The wall clock as windows are expired by: it follows the wall clock, but never runs
/// ahead of its last reading by more than the monotonic time since, and a tenth more (room
/// for NTP's slewing, and for a clock that was behind to catch up, gradually), and it is
/// never ahead of the wall clock, nor behind it by more than [`PacedWall::LAG_MAX`]. So a
/// wall clock stepped forward (a bad NTP step) and set back ends no live window early: a
/// window's counts, and what else is forgotten with it, would be gone when the clock is
/// set back and the window is live again. A step of `J` up to ten minutes is taken in over
/// about `10 J` of monotonic time; of a longer one, all but ten minutes at once, so that
/// what expiry holds back (windows kept past their end, and the keys in them) stays
/// bounded after a clock that was behind is set right.
///
/// It runs from an anchor (a reading and its monotonic time), moved only when the wall
/// clock holds it back or drags it on: read however often, it gains the full tenth while it
/// lags, with no rounding lost between readings.
#[derive(Debug, Clone, Copy)]
pub struct PacedWall {
    anchor: Stamp,
    anchor_mono: std::time::Duration,
}

impl PacedWall {
    /// The most the paced clock lags the wall clock, in milliseconds.
    pub const LAG_MAX: u64 = 10 * 60 * 1_000;

    /// Starts at `now`'s wall clock.
    pub fn new(now: Now) -> PacedWall {
        PacedWall {
            anchor: now.wall,
            anchor_mono: now.mono,
        }
    }

    /// Resumes from `mark`, an earlier life's reading (kept in the node's data directory):
    /// it starts at `mark`, brought within [`PacedWall::LAG_MAX`] behind `now`'s wall
    /// clock and never ahead of it. So a node restarted with its wall clock stepped ahead
    /// ends no window early at start either, as one whose clock steps while it runs.
    pub fn resume(now: Now, mark: Stamp) -> PacedWall {
        let lag_floor = now.wall.0.saturating_sub(PacedWall::LAG_MAX);
        PacedWall {
            anchor: Stamp(mark.0.max(lag_floor).min(now.wall.0)),
            anchor_mono: now.mono,
        }
    }

    /// The paced wall time at `now`.
    pub fn at(&mut self, now: Now) -> Stamp {
        let elapsed_us = now.mono.saturating_sub(self.anchor_mono).as_micros();
        let gained_ms = u64::try_from(elapsed_us * 11 / 10_000).unwrap_or(u64::MAX);
        let paced = self.anchor.0.saturating_add(gained_ms);
        let lag_floor = now.wall.0.saturating_sub(PacedWall::LAG_MAX);
        let held = paced.min(now.wall.0).max(lag_floor);
        if held != paced {
            self.anchor = Stamp(held);
            self.anchor_mono = now.mono;
        }
        Stamp(held)
    }
}

/// The stamps a node gives its own states: the wall clock, but never behind the stamp it
/// last gave plus the monotonic time since. Stamps never go back (an origin's is the
/// largest it has given), so without this a wall clock stepped back by `D` would repeat
/// the last stamp for `D`: its peers would read the node as stale, and decide isolated,
/// for as long as the step, and a peer that hears it only by relay would find it dead.
/// Carried on, its stamps keep the pace of real time until the wall clock catches up.
#[derive(Debug, Clone, Copy, Default)]
pub struct OwnStamps {
    anchor: Stamp,
    anchor_mono: std::time::Duration,
}

impl OwnStamps {
    /// The stamp for this node's state at `now`.
    ///
    /// A `now` before the last reading (lanes collected, then handed in once the lane
    /// log's sync returned, after a round) is stamped as of then: its wall clock, carried
    /// back from the last reading at the monotonic pace if that is later (the wall clock
    /// was stepped back), and never past the last reading. Carried forward from the last
    /// reading, it would vouch for the writes made between then and now that it lacks.
    pub fn at(&mut self, now: Now) -> Stamp {
        if now.mono < self.anchor_mono {
            let back = (self.anchor_mono - now.mono).as_millis();
            let back = u64::try_from(back).unwrap_or(u64::MAX);
            let carried = (self.anchor.0).saturating_sub(back);
            return Stamp(now.wall.0.max(carried).min(self.anchor.0));
        }
        let since = now.mono.saturating_sub(self.anchor_mono).as_millis();
        let carried = (self.anchor.0).saturating_add(u64::try_from(since).unwrap_or(u64::MAX));
        if now.wall.0 >= carried {
            self.anchor = now.wall;
            self.anchor_mono = now.mono;
            return now.wall;
        }
        Stamp(carried)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn own_stamps_follow_the_wall_and_keep_the_monotonic_pace_while_it_is_stepped_back() {
        let now = |wall, mono_ms| Now {
            mono: Duration::from_millis(mono_ms),
            wall: Stamp(wall),
        };
        let mut stamps = OwnStamps::default();
        assert_eq!(stamps.at(now(1_000_000, 10_000)), Stamp(1_000_000));
        assert_eq!(
            stamps.at(now(1_000_500, 10_500)),
            Stamp(1_000_500),
            "in step"
        );
        // Stepped back a minute: the stamps go on at the monotonic pace, read often or not.
        assert_eq!(stamps.at(now(940_600, 10_600)), Stamp(1_000_600));
        for mono in 10_601..11_600 {
            stamps.at(now(940_000 + mono - 10_000, mono));
        }
        assert_eq!(stamps.at(now(941_600, 11_600)), Stamp(1_001_600));
        // Once the wall clock has caught up, they follow it again.
        assert_eq!(stamps.at(now(1_070_000, 70_000)), Stamp(1_070_000));
    }

    #[test]
    fn own_stamps_of_an_earlier_moment_are_no_later_than_it() {
        let now = |wall, mono_ms| Now {
            mono: Duration::from_millis(mono_ms),
            wall: Stamp(wall),
        };
        let mut stamps = OwnStamps::default();
        assert_eq!(stamps.at(now(1_000_500, 10_500)), Stamp(1_000_500));
        assert_eq!(
            stamps.at(now(1_000_200, 10_200)),
            Stamp(1_000_200),
            "read after a later moment, in step"
        );
        assert_eq!(stamps.at(now(1_000_600, 10_600)), Stamp(1_000_600));
        // Stepped back a minute: carried on, and carried back at the same pace.
        assert_eq!(stamps.at(now(940_900, 10_900)), Stamp(1_000_900));
        assert_eq!(stamps.at(now(940_700, 10_700)), Stamp(1_000_700));
        assert_eq!(stamps.at(now(941_000, 11_000)), Stamp(1_001_000));
    }

    #[test]
    fn a_paced_wall_follows_the_wall_takes_a_forward_step_slowly_and_a_backward_one_at_once() {
        let now = |wall, mono_secs| Now {
            mono: Duration::from_secs(mono_secs),
            wall: Stamp(wall),
        };
        let mut paced = PacedWall::new(now(1_000_000, 10));
        assert_eq!(paced.at(now(1_001_000, 11)), Stamp(1_001_000), "in step");
        // The wall clock jumps five minutes ahead: a second later the paced one is 1.1 s on.
        assert_eq!(paced.at(now(1_302_000, 12)), Stamp(1_002_100));
        assert_eq!(paced.at(now(1_312_000, 22)), Stamp(1_013_100));
        // Set back: the paced one is never ahead of the wall.
        assert_eq!(paced.at(now(1_013_000, 23)), Stamp(1_013_000));
        assert_eq!(paced.at(now(1_014_000, 24)), Stamp(1_014_000));
        // An hour ahead: all but the ten minutes at once.
        assert_eq!(paced.at(now(4_615_000, 25)), Stamp(4_015_000));
    }

    #[test]
    fn a_paced_wall_read_every_millisecond_gains_its_full_tenth_while_it_lags() {
        let mut paced = PacedWall::resume(
            Now {
                mono: Duration::ZERO,
                wall: Stamp(10_000_000),
            },
            Stamp(9_700_000),
        );
        let mut last = Stamp(0);
        for ms in 1..=10_000 {
            last = paced.at(Now {
                mono: Duration::from_micros(ms * 1_000 - 300),
                wall: Stamp(10_000_000 + ms),
            });
        }
        // 10 s less 0.3 ms of monotonic time, times 1.1, from the mark.
        assert_eq!(last, Stamp(9_700_000 + 10_999));
    }

    #[test]
    fn a_resumed_paced_wall_starts_at_its_mark_within_the_lag_and_never_ahead_of_the_wall() {
        let now = |wall| Now {
            mono: Duration::from_secs(3),
            wall: Stamp(wall),
        };
        let lag = PacedWall::LAG_MAX;
        // Started five minutes ahead of the last life's reading: at that reading, then
        // paced on from it.
        let mut paced = PacedWall::resume(now(1_300_000), Stamp(1_000_000));
        assert_eq!(paced.at(now(1_300_000)), Stamp(1_000_000));
        let later = Now {
            mono: Duration::from_secs(13),
            wall: Stamp(1_310_000),
        };
        assert_eq!(paced.at(later), Stamp(1_011_000));
        // A mark older than the lag allows, or one ahead of the wall clock.
        let mut paced = PacedWall::resume(now(lag + 5_000_000), Stamp(1_000));
        assert_eq!(paced.at(now(lag + 5_000_000)), Stamp(5_000_000));
        let mut paced = PacedWall::resume(now(5_000_000), Stamp(9_000_000));
        assert_eq!(paced.at(now(5_000_000)), Stamp(5_000_000));
    }
}
