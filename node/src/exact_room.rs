//! The node's room for exact checks waiting for the region, over all client connections.
//!
//! Each connection holds at most `listener::EXACT_IN_FLIGHT_MAX` checks waiting; this caps
//! their sum, so that `client_connections_max` connections cannot hold a million. A
//! connection whose next frame is an exact check with no room for it holds that frame (and
//! the frames after it) unread until it gets a place ([`ExactRoom::take`]); connections
//! waiting get the places given back in the order they asked, one each. The client's
//! requests wait in its socket; a held check whose rule's timeout passes, timed from the
//! read that brought it, is answered as the region's silence would be (`listener`).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How many exact checks the node holds waiting for the region, over all connections.
pub const EXACT_WAITING_MAX: usize = 16_384;

/// The node's room for exact checks waiting for the region.
#[derive(Debug)]
pub struct ExactRoom {
    max: usize,
    places: Arc<Semaphore>,
    /// Times a connection held an exact check because the room was full.
    full: AtomicU64,
}

impl ExactRoom {
    /// Room for `max` checks.
    pub fn new(max: usize) -> ExactRoom {
        ExactRoom {
            max,
            places: Arc::new(Semaphore::new(max)),
            full: AtomicU64::new(0),
        }
    }

    /// How many places are taken now: by checks waiting, and at most one per connection
    /// kept for the check it holds.
    pub fn taken(&self) -> usize {
        self.max - self.places.available_permits()
    }

    /// A place for one check, until the returned slot is dropped; `None` if the room is
    /// full, or its places given back are promised to connections waiting.
    pub fn try_take(&self) -> Option<ExactSlot> {
        let place = Arc::clone(&self.places).try_acquire_owned().ok()?;
        Some(ExactSlot { _place: place })
    }

    /// A place for one check, once there is one: places given back go to those waiting in
    /// the order they asked. The turn is the returned future's, from its first poll (it
    /// asks nothing before): kept while the future is kept, polled again or not, and lost
    /// when it is dropped, so a waiter keeps it across its waits.
    pub fn take(&self) -> impl Future<Output = ExactSlot> + Send + 'static {
        let places = Arc::clone(&self.places);
        async move {
            let place = places.acquire_owned().await;
            let place = place.expect("invariant: the room's semaphore is never closed");
            ExactSlot { _place: place }
        }
    }

    /// Counts a connection that held an exact check because the room was full.
    pub fn count_full(&self) {
        self.full.fetch_add(1, Ordering::Relaxed);
    }

    /// Times a connection held an exact check because the room was full.
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
pub struct ExactSlot {
    _place: OwnedSemaphorePermit,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_take_room_and_give_it_back_when_dropped() {
        let room = ExactRoom::new(2);
        let first = room.try_take().unwrap();
        let second = room.try_take().unwrap();
        assert!(room.try_take().is_none(), "the room is full");
        assert_eq!(room.taken(), 2);
        drop(first);
        assert_eq!(room.taken(), 1);
        drop(second);
        assert_eq!(room.taken(), 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_place_given_back_goes_to_the_first_who_waits_for_one() {
        let room = ExactRoom::new(1);
        let slot = room.try_take().unwrap();
        let first = room.take();
        let second = room.take();
        tokio::pin!(first, second);
        // Both wait, in this order.
        assert!(futures_poll(first.as_mut()).is_none());
        assert!(futures_poll(second.as_mut()).is_none());
        drop(slot);
        assert!(room.try_take().is_none(), "promised to the first who waits");
        let first = tokio::time::timeout(std::time::Duration::from_secs(5), first)
            .await
            .expect("the first waiting gets the place");
        assert!(futures_poll(second.as_mut()).is_none());
        drop(first);
        tokio::time::timeout(std::time::Duration::from_secs(5), second)
            .await
            .expect("then the second");
    }

    /// Polls `future` once.
    fn futures_poll<F: std::future::Future>(future: std::pin::Pin<&mut F>) -> Option<F::Output> {
        let waker = std::task::Waker::noop();
        match future.poll(&mut std::task::Context::from_waker(waker)) {
            std::task::Poll::Ready(output) => Some(output),
            std::task::Poll::Pending => None,
        }
    }
}
