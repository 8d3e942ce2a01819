//! The node's long-lived tasks, watched. Each serves one part of the node (the client
//! listener, the HTTP endpoints, the region's deciding and acknowledging, the exact
//! checks' sessions to the region) and is meant to run as long as the node: one that ends
//! while the node runs, by returning or by a panic, stops the node with an error naming it
//! ([`crate::daemon::DaemonError::TaskEnded`]), instead of leaving a node that gossips on
//! while that part no longer answers. The node's supervisor restarts the node.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Spawns watched tasks; the [`Ended`] it came with hears of each one's end.
#[derive(Debug, Clone)]
pub struct Watch(mpsc::UnboundedSender<&'static str>);

/// Hears of watched tasks' ends, by name.
#[derive(Debug)]
pub struct Ended(mpsc::UnboundedReceiver<&'static str>);

/// A watch and what hears it.
pub fn watch() -> (Watch, Ended) {
    let (sender, receiver) = mpsc::unbounded_channel();
    (Watch(sender), Ended(receiver))
}

impl Watch {
    /// Spawns `task`; `name`'s end is reported however the task ends: it returns, panics,
    /// or is aborted (a node that stops aborts its tasks, and no longer listens by then).
    pub fn spawn<F>(&self, name: &'static str, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let reports = ReportsEnd {
            name,
            to: self.0.clone(),
        };
        tokio::spawn(async move {
            let _reports = reports;
            task.await
        })
    }
}

impl Ended {
    /// The name of the first watched task to end (of those not yet reported): pending
    /// until one ends.
    pub async fn first(&mut self) -> &'static str {
        match self.0.recv().await {
            Some(name) => name,
            None => std::future::pending().await,
        }
    }
}

/// Reports its task's end when dropped: after the task's future returns, or while a
/// panic unwinds out of it, or when the task is aborted.
struct ReportsEnd {
    name: &'static str,
    to: mpsc::UnboundedSender<&'static str>,
}

impl Drop for ReportsEnd {
    fn drop(&mut self) {
        let _ = self.to.send(self.name);
    }
}

/// Ticks every `period`, the first at once, for a task's periodic work (windows' expiry,
/// purges, retries, collections). Each tick acts on the time it finds, so ticks missed
/// while the task did not run (the process was stopped, or the node's one thread was
/// busy) are not made up in a burst: after a pause of a minute, one tick does what sixty
/// would, and the node goes back to its requests at once.
pub fn every(period: std::time::Duration) -> tokio::time::Interval {
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks
}

/// A value dropped on the runtime's blocking pool rather than where the guard is dropped,
/// however its holder ends (an aborted task included): for a value whose drop may wait on
/// a disk, so that the node's one thread goes on. Dropped in place where no runtime runs,
/// or once the runtime's blocking pool has shut down (tokio drops a closure it can no
/// longer run where it is given): so its holder must end while the runtime runs, as the
/// region task does (`daemon::run` awaits it).
#[derive(Debug)]
pub struct DropsOffThread<T: Send + 'static>(Option<T>);

impl<T: Send + 'static> DropsOffThread<T> {
    /// Guards `value`.
    pub fn new(value: T) -> DropsOffThread<T> {
        DropsOffThread(Some(value))
    }
}

impl<T: Send + 'static> Deref for DropsOffThread<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0.as_ref().expect("invariant: taken only when dropped")
    }
}

impl<T: Send + 'static> DerefMut for DropsOffThread<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_mut().expect("invariant: taken only when dropped")
    }
}

impl<T: Send + 'static> Drop for DropsOffThread<T> {
    fn drop(&mut self) {
        let value = self.0.take();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn_blocking(move || drop(value));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Waits in its drop until released, or a second: whether it was released in time.
    struct WaitsInDrop {
        release: std::sync::mpsc::Receiver<()>,
        released: std::sync::mpsc::Sender<bool>,
    }

    impl Drop for WaitsInDrop {
        fn drop(&mut self) {
            let released = self.release.recv_timeout(Duration::from_secs(1)).is_ok();
            let _ = self.released.send(released);
        }
    }

    #[tokio::test]
    async fn a_guarded_value_is_dropped_off_the_runtimes_thread_even_by_an_aborted_task() {
        let (release, waits) = std::sync::mpsc::channel();
        let (done, released) = std::sync::mpsc::channel();
        let guarded = DropsOffThread::new(WaitsInDrop {
            release: waits,
            released: done,
        });
        let task = tokio::spawn(async move {
            let _guarded = guarded;
            std::future::pending::<()>().await
        });
        tokio::task::yield_now().await;
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        // Dropped in place, the value would have waited its second on this thread, before
        // the release below.
        let _ = release.send(());
        let released = tokio::task::spawn_blocking(move || released.recv().unwrap());
        assert!(released.await.unwrap(), "the drop ran on this thread");
    }

    #[tokio::test]
    async fn a_task_that_panics_or_returns_is_reported_by_name_and_one_still_running_is_not() {
        let (watch, mut ended) = watch();
        let running = watch.spawn("running", std::future::pending::<()>());
        let panicked = watch.spawn("panics", async { panic!("a watched task panics") });
        assert!(panicked.await.unwrap_err().is_panic());
        assert_eq!(ended.first().await, "panics");
        watch.spawn("returns", async {}).await.unwrap();
        assert_eq!(ended.first().await, "returns");
        let none = tokio::time::timeout(Duration::from_millis(50), ended.first()).await;
        assert!(none.is_err(), "a task still running was reported: {none:?}");
        running.abort();
        assert_eq!(ended.first().await, "running");
    }

    #[tokio::test(start_paused = true)]
    async fn ticks_missed_during_a_pause_are_not_made_up_in_a_burst() {
        let mut ticks = every(Duration::from_secs(1));
        ticks.tick().await;
        // The task does not run for a minute: a stopped process, or a busy thread.
        tokio::time::advance(Duration::from_secs(60)).await;
        ticks.tick().await;
        let next = tokio::time::timeout(Duration::from_millis(999), ticks.tick()).await;
        assert!(
            next.is_err(),
            "a missed tick was made up at once instead of a second after the last"
        );
        let next = tokio::time::timeout(Duration::from_millis(2), ticks.tick()).await;
        assert!(next.is_ok(), "the next tick comes a second after the last");
    }

    #[tokio::test]
    async fn with_no_watch_left_and_nothing_ended_first_stays_pending() {
        let (watch, mut ended) = watch();
        drop(watch);
        let none = tokio::time::timeout(Duration::from_millis(50), ended.first()).await;
        assert!(none.is_err());
    }
}
