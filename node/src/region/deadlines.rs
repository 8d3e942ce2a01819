//! When the edge's forwarded checks time out: one queue per rule timeout, so that holding
//! a check's deadline is a push and finding the first is a look at a few queue fronts.
//!
//! Checks reach the session task in the order they arrived from their callers, but for
//! callers on different threads racing, and for checks a connection held unread for want
//! of room, whose timeouts count from their arrival. So within one timeout their
//! deadlines arrive in order, or nearly: one that arrives below its queue's last goes to
//! a heap of such early deadlines instead, where it keeps its own. A check answered before
//! its deadline is not taken out of its queue or the heap; it is skipped when it reaches
//! the front. So a queue holds at most the checks of the last timeout's length (fewer
//! while answers come in order), and gives back room after a burst
//! ([`Deadlines::shrink`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

/// Deadlines of held checks (by sequence number): one queue per timeout, each in deadline
/// order, and those that arrived below their queue's last, earliest first.
#[derive(Debug, Default)]
pub(super) struct Deadlines {
    // Few: one per distinct `region_timeout_ms` among the rules.
    queues: Vec<Queue>,
    early: BinaryHeap<Reverse<(Duration, u64)>>,
}

#[derive(Debug)]
struct Queue {
    timeout_ms: u64,
    // Invariant: in deadline order.
    entries: VecDeque<(Duration, u64)>,
}

impl Deadlines {
    /// Holds check `seq`'s `deadline`, which its rule's `timeout_ms` set.
    pub(super) fn push(&mut self, timeout_ms: u64, deadline: Duration, seq: u64) {
        let at = match self.queues.iter().position(|q| q.timeout_ms == timeout_ms) {
            Some(at) => at,
            None => {
                self.queues.push(Queue {
                    timeout_ms,
                    entries: VecDeque::new(),
                });
                self.queues.len() - 1
            }
        };
        let entries = &mut self.queues[at].entries;
        if entries.back().is_some_and(|&(last, _)| deadline < last) {
            self.early.push(Reverse((deadline, seq)));
        } else {
            entries.push_back((deadline, seq));
        }
    }

    /// The first deadline of a check that `is_held` still, dropping the fronts of checks
    /// that are not.
    pub(super) fn first(&mut self, is_held: impl Fn(u64) -> bool) -> Option<Duration> {
        let mut first = None;
        for queue in &mut self.queues {
            while let Some(&(deadline, seq)) = queue.entries.front() {
                if is_held(seq) {
                    first = Some(first.map_or(deadline, |f: Duration| f.min(deadline)));
                    break;
                }
                queue.entries.pop_front();
            }
        }
        while let Some(&Reverse((deadline, seq))) = self.early.peek() {
            if is_held(seq) {
                first = Some(first.map_or(deadline, |f: Duration| f.min(deadline)));
                break;
            }
            self.early.pop();
        }
        first
    }

    /// Takes every check whose deadline is at or before `now` into `due`, in no particular
    /// order across timeouts. Checks no longer held may be among them: the caller skips
    /// those.
    pub(super) fn take_due(&mut self, now: Duration, due: &mut Vec<u64>) {
        for queue in &mut self.queues {
            while let Some(&(deadline, seq)) = queue.entries.front() {
                if deadline > now {
                    break;
                }
                due.push(seq);
                queue.entries.pop_front();
            }
        }
        while let Some(&Reverse((deadline, seq))) = self.early.peek() {
            if deadline > now {
                break;
            }
            due.push(seq);
            self.early.pop();
        }
    }

    /// Gives back the room a burst left in the queues.
    pub(super) fn shrink(&mut self) {
        for queue in &mut self.queues {
            shrink(&mut queue.entries);
        }
        if let Some(room) = room_to_keep(self.early.len(), self.early.capacity()) {
            self.early.shrink_to(room);
        }
    }

    /// How many deadlines are held, of checks answered or not.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.queues.iter().map(|q| q.entries.len()).sum::<usize>() + self.early.len()
    }
}

/// Gives back a queue's room past twice what it holds, once that is more than a burst's
/// worth of slack.
pub(super) fn shrink<T>(queue: &mut VecDeque<T>) {
    if let Some(room) = room_to_keep(queue.len(), queue.capacity()) {
        queue.shrink_to(room);
    }
}

/// The room to shrink to, holding `len` in `capacity`, if the room past twice `len` is
/// more than a burst's worth of slack.
fn room_to_keep(len: usize, capacity: usize) -> Option<usize> {
    const SLACK: usize = 1024;
    (capacity > 4 * len + SLACK).then_some(2 * len + SLACK)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn the_first_deadline_is_the_earliest_over_every_timeout() {
        let mut deadlines = Deadlines::default();
        deadlines.push(300, ms(300), 0);
        deadlines.push(100, ms(110), 1);
        deadlines.push(200, ms(220), 2);
        deadlines.push(100, ms(130), 3);
        assert_eq!(deadlines.first(|_| true), Some(ms(110)));
        // Check 1 was answered: its deadline no longer counts, and is dropped.
        assert_eq!(deadlines.first(|seq| seq != 1), Some(ms(130)));
        assert_eq!(deadlines.len(), 3);
        assert_eq!(deadlines.first(|_| false), None);
        assert_eq!(deadlines.len(), 0);
    }

    #[test]
    fn due_checks_are_taken_up_to_now_and_not_past_it() {
        let mut deadlines = Deadlines::default();
        for (timeout_ms, deadline, seq) in [(100, 100, 0), (300, 300, 1), (100, 150, 2)] {
            deadlines.push(timeout_ms, ms(deadline), seq);
        }
        let mut due = Vec::new();
        deadlines.take_due(ms(149), &mut due);
        assert_eq!(due, [0]);
        deadlines.take_due(ms(300), &mut due);
        due.sort_unstable();
        assert_eq!(due, [0, 1, 2]);
        assert_eq!(deadlines.len(), 0);
    }

    #[test]
    fn a_bursts_room_is_given_back_once_it_is_answered() {
        let mut deadlines = Deadlines::default();
        for seq in 0..100_000 {
            deadlines.push(100, ms(100), seq);
        }
        assert_eq!(deadlines.first(|seq| seq >= 99_990), Some(ms(100)));
        deadlines.shrink();
        let room: usize = deadlines.queues.iter().map(|q| q.entries.capacity()).sum();
        assert!(
            room < 2 * 10 + 1024 + 16,
            "{room} slots kept for 10 deadlines"
        );
    }

    #[test]
    fn a_deadline_out_of_order_within_its_timeout_keeps_its_own() {
        // A check held unread for 60 ms came after one that arrived later, under one rule.
        let mut deadlines = Deadlines::default();
        deadlines.push(100, ms(150), 0);
        deadlines.push(100, ms(100), 1);
        deadlines.push(100, ms(160), 2);
        assert_eq!(deadlines.first(|_| true), Some(ms(100)));
        let mut due = Vec::new();
        deadlines.take_due(ms(99), &mut due);
        assert!(due.is_empty(), "nothing expires before its own deadline");
        deadlines.take_due(ms(100), &mut due);
        assert_eq!(due, [1], "nor after it");
        assert_eq!(deadlines.first(|_| true), Some(ms(150)));
        deadlines.take_due(ms(160), &mut due);
        assert_eq!(due, [1, 0, 2]);
        assert_eq!(deadlines.len(), 0);
    }

    #[test]
    fn an_early_deadline_of_a_check_answered_is_skipped() {
        let mut deadlines = Deadlines::default();
        deadlines.push(100, ms(150), 0);
        deadlines.push(100, ms(100), 1);
        assert_eq!(deadlines.first(|seq| seq != 1), Some(ms(150)));
        assert_eq!(
            deadlines.len(),
            1,
            "the answered check's deadline is dropped"
        );
    }
}
