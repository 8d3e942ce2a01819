//! The node's room for exact checks waiting for the region, over all client connections.
//!
//! Each connection holds at most `listener::EXACT_IN_FLIGHT_MAX` checks waiting; this caps
//! their sum, so that `client_connections_max` connections cannot hold a million. A
//! connection that finds the room full stops reading, as it does at its own cap, until a
//! check anywhere on the node is answered or dropped ([`ExactRoom::freed`]). Nothing is
//! refused for it: the client's requests wait in its socket, and its own timeouts apply.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::futures::Notified;
use tokio::sync::Notify;

/// How many exact checks the node holds waiting for the region, over all connections.
pub const EXACT_WAITING_MAX: usize = 16_384;

/// The node's room for exact checks waiting for the region.
#[derive(Debug)]
pub struct ExactRoom {
    max: usize,
    taken: AtomicUsize,
    freed: Notify,
    /// Times a connection stopped reading because the room was full.
    full: AtomicU64,
}

impl ExactRoom {
    /// Room for `max` checks.
    pub fn new(max: usize) -> ExactRoom {
        ExactRoom {
            max,
            taken: AtomicUsize::new(0),
            freed: Notify::new(),
            full: AtomicU64::new(0),
        }
    }

    /// How many more checks there is room for now.
    pub fn left(&self) -> usize {
        self.max.saturating_sub(self.taken.load(Ordering::Relaxed))
    }

    /// How many checks wait now.
    pub fn taken(&self) -> usize {
        self.taken.load(Ordering::Relaxed)
    }

    /// Takes a place for one check until the returned slot is dropped. It does not look at
    /// [`ExactRoom::left`]: the caller has.
    pub fn take(self: &Arc<ExactRoom>) -> ExactSlot {
        self.taken.fetch_add(1, Ordering::Relaxed);
        ExactSlot(Arc::clone(self))
    }

    /// Completes once a slot is given back after this call, whether or not it is polled
    /// before: get it before reading [`ExactRoom::left`], so that no slot given back in
    /// between is missed.
    pub fn freed(&self) -> Notified<'_> {
        self.freed.notified()
    }

    /// Counts a connection that stopped reading because the room was full.
    pub fn count_full(&self) {
        self.full.fetch_add(1, Ordering::Relaxed);
    }

    /// Times a connection stopped reading because the room was full.
    pub fn full(&self) -> u64 {
        self.full.load(Ordering::Relaxed)
    }
}

impl Default for ExactRoom {
    fn default() -> ExactRoom {
        ExactRoom::new(EXACT_WAITING_MAX)
    }
}

/// One check's place in the [`ExactRoom`], given back when dropped: answered, or abandoned
/// with its connection.
#[derive(Debug)]
pub struct ExactSlot(Arc<ExactRoom>);

impl Drop for ExactSlot {
    fn drop(&mut self) {
        let room = &self.0;
        if room.taken.fetch_sub(1, Ordering::Relaxed) >= room.max {
            room.freed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_take_room_and_give_it_back_when_dropped() {
        let room = Arc::new(ExactRoom::new(2));
        let first = room.take();
        let second = room.take();
        assert_eq!((room.left(), room.taken()), (0, 2));
        drop(first);
        assert_eq!((room.left(), room.taken()), (1, 1));
        drop(second);
        assert_eq!(room.left(), 2);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_slot_given_back_from_a_full_room_wakes_whoever_asked_before() {
        let room = Arc::new(ExactRoom::new(1));
        let slot = room.take();
        // Asked for before the slot is given back, and polled only after.
        let freed = room.freed();
        drop(slot);
        tokio::time::timeout(std::time::Duration::from_secs(5), freed)
            .await
            .expect("the slot given back from a full room is seen");
    }
}
