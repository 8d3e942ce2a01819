//! The simulated network: per-link cuts, loss, duplication, delay (and so reordering), and
//! replay of old frames, all drawn from one seeded RNG.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// Message-level faults. QUIC hides packet faults from the protocol, but a relay, a
/// reconnect or a bug can still duplicate, reorder or replay whole frames.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    /// Probability that a frame is lost.
    pub loss: f64,
    /// Probability that a frame is delivered twice.
    pub duplicate: f64,
    /// Probability that, alongside a send, an old frame is delivered again.
    pub replay: f64,
    /// How old a replayed frame may be.
    pub replay_age_max: Duration,
    /// Delay of each frame, drawn uniformly in this range; a wide range reorders.
    pub delay_min: Duration,
    /// See `delay_min`.
    pub delay_max: Duration,
}

impl Faults {
    /// No faults, 1 ms delay.
    pub fn none() -> Faults {
        Faults {
            loss: 0.0,
            duplicate: 0.0,
            replay: 0.0,
            replay_age_max: Duration::from_secs(60),
            delay_min: Duration::from_millis(1),
            delay_max: Duration::from_millis(1),
        }
    }
}

/// Frames kept for replay: one for each this much of sent time, drawn evenly from the
/// frames sent in it (every node's rounds fall on the same instants, so the first would
/// always be one node's), and at most [`HISTORY_FRAMES_MAX`], so that the frames kept span
/// 100 s however busy the network is, and a replay can be as old as
/// [`Faults::replay_age_max`] (TESTING.md N7: 60 s).
const HISTORY_EVERY: Duration = Duration::from_millis(10);
const HISTORY_FRAMES_MAX: usize = 10_000;

/// A frame in flight.
#[derive(Debug, Clone)]
pub(super) struct Frame {
    pub from: usize,
    pub to: usize,
    pub bytes: Vec<u8>,
}

/// The network between simulated nodes.
pub struct Network {
    rng: ChaCha8Rng,
    faults: Faults,
    in_flight: BTreeMap<(Duration, u64), Frame>,
    sequence: u64,
    blocked: BTreeSet<(usize, usize)>,
    history: VecDeque<(Duration, Frame)>,
    // How many frames were sent in the history's newest slot, and the draws of which one
    // it keeps: a generator of their own, so that the faults' draws do not depend on it.
    slot_sent: u64,
    history_rng: ChaCha8Rng,
    nodes: usize,
    bytes_sent: u64,
    largest_frame: usize,
    replayed: u64,
    replayed_oldest: Duration,
}

impl Network {
    pub(super) fn new(seed: u64, faults: Faults, nodes: usize) -> Network {
        Network {
            rng: ChaCha8Rng::seed_from_u64(seed),
            faults,
            in_flight: BTreeMap::new(),
            sequence: 0,
            blocked: BTreeSet::new(),
            history: VecDeque::new(),
            slot_sent: 0,
            history_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x4849_5354_4f52_5921),
            nodes,
            bytes_sent: 0,
            largest_frame: 0,
            replayed: 0,
            replayed_oldest: Duration::ZERO,
        }
    }

    /// Drops every frame from `from` to `to` from now on (one way).
    pub fn cut(&mut self, from: usize, to: usize) {
        self.blocked.insert((from, to));
    }

    /// Delivers frames from `from` to `to` again.
    pub fn restore(&mut self, from: usize, to: usize) {
        self.blocked.remove(&(from, to));
    }

    /// Cuts every link between `left` and `right`, both ways.
    pub fn partition(&mut self, left: &[usize], right: &[usize]) {
        for &a in left {
            for &b in right {
                self.cut(a, b);
                self.cut(b, a);
            }
        }
    }

    /// Restores every link and removes every fault but the delay.
    pub fn heal(&mut self) {
        self.blocked.clear();
        self.faults = Faults {
            delay_min: self.faults.delay_min,
            delay_max: self.faults.delay_max,
            ..Faults::none()
        };
    }

    /// Bytes handed to the network so far.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// Old frames sent again so far, and the age of the oldest of them when it was.
    pub fn replays(&self) -> (u64, Duration) {
        (self.replayed, self.replayed_oldest)
    }

    /// The largest frame handed to the network so far, in bytes.
    pub fn largest_frame(&self) -> usize {
        self.largest_frame
    }

    pub(super) fn send(&mut self, from: usize, to: usize, bytes: Vec<u8>, now: Duration) {
        self.bytes_sent += bytes.len() as u64;
        self.largest_frame = self.largest_frame.max(bytes.len());
        if to >= self.nodes || self.blocked.contains(&(from, to)) {
            return;
        }
        let frame = Frame { from, to, bytes };
        if self.faults.replay > 0.0 && self.rng.gen_bool(self.faults.replay) {
            let oldest = now.saturating_sub(self.faults.replay_age_max);
            while self.history.front().is_some_and(|(at, _)| *at < oldest) {
                self.history.pop_front();
            }
            if !self.history.is_empty() {
                let pick = self.rng.gen_range(0..self.history.len());
                let (sent_at, old) = self.history[pick].clone();
                if !self.blocked.contains(&(old.from, old.to)) {
                    self.replayed += 1;
                    self.replayed_oldest = self.replayed_oldest.max(now - sent_at);
                    self.schedule(old, now);
                }
            }
        }
        if self.faults.replay > 0.0 {
            self.keep_for_replay(&frame, now);
        }
        if self.faults.loss > 0.0 && self.rng.gen_bool(self.faults.loss) {
            return;
        }
        if self.faults.duplicate > 0.0 && self.rng.gen_bool(self.faults.duplicate) {
            self.schedule(frame.clone(), now);
        }
        self.schedule(frame, now);
    }

    /// Keeps `frame`, sent at `now`, for replay: as its slot's first, or in place of the
    /// slot's kept one with a chance of one in the frames sent in the slot so far, so that
    /// each frame of a slot is kept alike.
    fn keep_for_replay(&mut self, frame: &Frame, now: Duration) {
        let slot_start = self.history.back().map(|(at, _)| *at);
        if slot_start.is_none_or(|at| now >= at + HISTORY_EVERY) {
            self.history.push_back((now, frame.clone()));
            self.slot_sent = 1;
            if self.history.len() > HISTORY_FRAMES_MAX {
                self.history.pop_front();
            }
            return;
        }
        self.slot_sent += 1;
        if self.history_rng.gen_range(0..self.slot_sent) == 0 {
            if let Some((_, kept)) = self.history.back_mut() {
                *kept = frame.clone();
            }
        }
    }

    /// When the next deliverable frame is due.
    pub(super) fn next_due(&self, deliverable: impl Fn(usize) -> bool) -> Option<Duration> {
        self.in_flight
            .iter()
            .find(|(_, frame)| deliverable(frame.to))
            .map(|((at, _), _)| *at)
    }

    /// Takes the next deliverable frame due by `now`.
    pub(super) fn pop_due(
        &mut self,
        now: Duration,
        deliverable: impl Fn(usize) -> bool,
    ) -> Option<Frame> {
        let key = self
            .in_flight
            .iter()
            .take_while(|((at, _), _)| *at <= now)
            .find(|(_, frame)| deliverable(frame.to))
            .map(|(key, _)| *key)?;
        self.in_flight.remove(&key)
    }

    /// Drops every frame in flight from `from`, and its old frames kept for replay: a
    /// crashed process's unsent data dies with it.
    pub(super) fn drop_from(&mut self, from: usize) {
        self.in_flight.retain(|_, frame| frame.from != from);
        self.history.retain(|(_, frame)| frame.from != from);
    }

    fn schedule(&mut self, frame: Frame, now: Duration) {
        let (min, max) = (
            self.faults.delay_min,
            self.faults.delay_max.max(self.faults.delay_min),
        );
        let delay = if max > min {
            Duration::from_nanos(
                self.rng
                    .gen_range(min.as_nanos() as u64..=max.as_nanos() as u64),
            )
        } else {
            min
        };
        self.sequence += 1;
        self.in_flight.insert((now + delay, self.sequence), frame);
    }
}
