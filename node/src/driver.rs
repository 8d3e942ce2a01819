//! The gossip task: the one owner of the [`Gossip`] state machine. It turns QUIC frames,
//! timers and the lane store's changed lanes into inputs, and the outputs into QUIC writes,
//! remote sums published to the store, and a refreshed [`View`].

use crate::clock::{Clock, ExpiryClock};
use crate::expiry_mark::ExpiryMark;
use crate::handoff::{Collected, Handoff};
use crate::lanelog::LogError;
use crate::listener::EXIT_LOG_FAILED;
use crate::metrics::Metrics;
use crate::refused_sums::RefusedSums;
use crate::store::LaneStore;
use crate::transport::{Inbound, Transport};
use crate::view::{unheard_seeds, View};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tally_crdt::{Counter, Key, Lane, NodeId, ReplicaId, Stamp, Version};
use tally_gossip::membership::{ForgetError, State};
use tally_gossip::{Event, Gossip, Input, Output};
use tokio::sync::{mpsc, oneshot, watch};

/// How long a stopping node gives its peers' writers to deliver their last frames (the
/// last push and the goodbye) before it closes its connections.
const LAST_FRAMES_DEADLINE: Duration = Duration::from_secs(1);

/// How long a lane-log sync may run (or a gossip interval, if longer) before the node
/// stops its protocol until it returns and decides as stale as the writes it holds back:
/// far past a sync on a slow disk (milliseconds), below the default `stale_after_ms` (3 s).
const SYNC_OVERDUE: Duration = Duration::from_secs(1);

/// When the gossip task collects the lanes written since its last collection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collecting {
    /// Just before the push that will carry them, or at once if none is scheduled (which
    /// schedules one): a write waits for one push batch and is in it, however late in the
    /// batch it came, and a node under steady writes collects once a push interval, not
    /// once a millisecond. Without a data directory.
    AtPush,
    /// On each tick of this interval while writes wait (at once after a quiet spell): with
    /// a data directory, whose lane log is synced after each collection and before its
    /// lanes reach the gossip, so they must be collected ahead of the push.
    Every(Duration),
}

/// The next tick of `ticks`; never, without them.
async fn tick(ticks: &mut Option<tokio::time::Interval>) {
    match ticks {
        Some(ticks) => {
            ticks.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Why the gossip task stopped on its own.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// A peer holds a lane of this replica that this life never wrote (above its versions
    /// or its totals): this replica id was used by an earlier life that lost its state.
    /// Restarting takes a new generation.
    #[error("generation reused: a peer holds a lane of this replica at version {seen:?} that this life, through version {written:?}, never wrote; restart to take a new generation")]
    GenerationReused {
        /// The version of the lane the peer holds.
        seen: Version,
        /// What this life wrote.
        written: Version,
    },
}

/// An operator's request to forget a member this node holds dead ([`Gossip::forget`]),
/// with where its answer goes: the life forgotten, or why not.
#[derive(Debug)]
pub struct Forget {
    /// The member.
    pub node: NodeId,
    /// The answer.
    pub answer: oneshot::Sender<Result<ReplicaId, ForgetError>>,
}

/// The gossip task's parts.
pub struct Driver {
    /// The state machine.
    pub gossip: Gossip,
    /// The QUIC side.
    pub transport: Transport,
    /// Frames from peers.
    pub inbound: mpsc::Receiver<Inbound>,
    /// The lane store the client path writes.
    pub store: Arc<LaneStore>,
    /// Remote sums the store refused at its key cap, published again every second, and
    /// read by decisions.
    pub refused_sums: Arc<RefusedSums>,
    /// What the rest of the node reads.
    pub view: Arc<View>,
    /// The live counters.
    pub metrics: Arc<Metrics>,
    /// The node's clocks.
    pub clock: Clock,
    /// The paced wall clock windows end by, read from `clock`.
    pub expiry: ExpiryClock,
    /// Where its readings are kept, if the node has a data directory.
    pub expiry_mark: Option<ExpiryMark>,
    /// When written lanes are collected.
    pub collecting: Collecting,
    /// Collected lanes on their way to the gossip, once the lane log is synced.
    pub handoff: Handoff,
    /// Turns true when the node should leave.
    pub shutdown: watch::Receiver<bool>,
    /// Operators' requests to forget members.
    pub forget: mpsc::Receiver<Forget>,
    /// Told which peer said so, once a peer's table holds this life as forgotten: the
    /// node must stop, as when asked to, and start again under a new generation.
    pub forgotten: Option<oneshot::Sender<NodeId>>,
}

impl Driver {
    /// Runs until shutdown (then leaves the cluster gracefully) or a fatal event.
    ///
    /// It sleeps until something happens: a frame, the protocol's deadline, a write to
    /// the lane store, or the second's expiry. Written lanes are collected as `collecting`
    /// says; a collection's timer is only waited for while a write is waiting, so an idle
    /// sidecar does not wake. With a data directory, collected lanes reach the gossip once
    /// the lane log is synced, and none are collected while a sync runs ([`Handoff`]). The
    /// protocol's timer is reset only when its deadline moves: registering a timer earlier
    /// than the runtime's next wake-up costs a system call.
    pub async fn run(mut self) -> Result<(), DriverError> {
        let me = self.gossip.replica();
        let serving_since = self.clock.mono();
        let protocol = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(protocol);
        // The collection's ticks, with `Collecting::Every`.
        let mut collect = match self.collecting {
            Collecting::Every(every) => Some(crate::tasks::every(every)),
            Collecting::AtPush => None,
        };
        let at_push = self.collecting == Collecting::AtPush;
        // Whether a key was queued since the last collection began, and when the first was
        // (monotonic).
        let mut collect_due = false;
        let mut queued_at = Duration::ZERO;
        let mut expire = crate::tasks::every(Duration::from_secs(1));
        let mut lanes = Vec::new();
        loop {
            let next = self.drain(me)?;
            let deadline = self.clock.instant(next).into();
            if protocol.deadline() != deadline {
                protocol.as_mut().reset(deadline);
            }
            // A lane-log sync that does not return holds this node's writes back; past
            // `SYNC_OVERDUE` (or a gossip interval, if longer) its protocol waits with them
            // (no rounds, so no heartbeats), so that peers see it go stale rather than fresh
            // without its writes.
            let held = self.held_for();
            self.refresh_view(me, serving_since, held);
            tokio::select! {
                inbound = self.inbound.recv() => {
                    let Some(inbound) = inbound else { return Ok(()) };
                    let forged = self.gossip.stats().forged;
                    self.gossip.handle_input(Input::Receive {
                        now: self.clock.now(),
                        from: inbound.from,
                        frame: inbound.frame,
                    });
                    if self.gossip.stats().forged > forged {
                        self.transport.refuse(inbound.from, &inbound.connection);
                    }
                }
                // Checked again: the sync may have become overdue while the loop slept.
                () = &mut protocol, if held.is_none() => {
                    if self.held_for().is_none() {
                        // Keys queued since the last wake-up was handled go too.
                        if at_push && (collect_due || self.store.has_queued()) {
                            // `queued_at` is of an earlier wake-up unless `collect_due`.
                            let noticed = collect_due.then_some(queued_at);
                            collect_due = false;
                            self.collect(&mut lanes, noticed);
                        }
                        let pending = self.pending_since(collect_due, queued_at);
                        self.gossip.hold_stamps_from(pending);
                        self.gossip.handle_input(Input::Timeout { now: self.clock.now() });
                    }
                }
                // A wake-up for keys the last collection took is no write to time.
                () = self.store.queued(), if !collect_due => {
                    if self.store.has_queued() {
                        queued_at = self.clock.mono();
                        if at_push && !self.gossip.push_pending() {
                            // Their lanes schedule the push that the next writes wait for.
                            self.collect(&mut lanes, Some(queued_at));
                        } else {
                            collect_due = true;
                        }
                    }
                }
                // Keys written while a sync runs stay queued until it returns.
                () = tick(&mut collect), if collect_due && !self.handoff.is_syncing() => {
                    collect_due = false;
                    self.collect(&mut lanes, Some(queued_at));
                }
                synced = self.handoff.synced(), if self.handoff.is_syncing() => {
                    self.synced(synced);
                }
                Some(Forget { node, answer }) = self.forget.recv() => {
                    let _ = answer.send(self.gossip.forget(node));
                }
                // Windows end by the paced wall clock: a clock stepped forward ends none
                // early, nor does the next start's (its reading is kept).
                _ = expire.tick() => {
                    let paced = self.expiry.now();
                    if let Some(mark) = &mut self.expiry_mark {
                        mark.record(paced, self.clock.mono());
                    }
                    self.handoff.each_second(&self.store);
                    let now_secs = paced.0 / 1_000;
                    self.store.expire(now_secs);
                    self.store.reclaim();
                    let map = self.gossip.map();
                    self.refused_sums.retry(&self.store, now_secs, |key| {
                        Some(map.counter(key)?.value_without(me))
                    });
                    self.view.lock().forget_ended_windows(now_secs);
                }
                _ = self.shutdown.changed() => {
                    self.last_lanes(&mut lanes).await;
                    self.gossip.hold_stamps_from(None);
                    // Push what is left, then say goodbye.
                    self.gossip.handle_input(Input::Timeout { now: self.clock.now() });
                    self.gossip.handle_input(Input::Leave);
                    self.drain(me)?;
                    self.transport.close(LAST_FRAMES_DEADLINE).await;
                    return Ok(());
                }
            }
        }
    }

    /// When (monotonic) the oldest write the gossip does not hold yet was made: the oldest
    /// the lane log's sync in flight holds back, or the first written since the last
    /// collection. That one is the time its writer noted in the store, else when this task
    /// saw it queued (`queued_at`, while `collect_due`), else, for a write queued since
    /// this task last woke by a writer that noted nothing, now. `None` if the gossip holds
    /// every write.
    fn pending_since(&self, collect_due: bool, queued_at: Duration) -> Option<Duration> {
        let unseen = self
            .store
            .has_queued()
            .then(|| self.store.first_written().unwrap_or(self.clock.mono()));
        let queued = collect_due.then_some(queued_at);
        [self.handoff.oldest_held(), queued, unseen]
            .into_iter()
            .flatten()
            .min()
    }

    /// If the lane log's sync is overdue, how long ago the oldest write it holds back was
    /// queued.
    fn held_for(&self) -> Option<Duration> {
        let limit = SYNC_OVERDUE.max(self.gossip.config().gossip_interval);
        self.handoff.overdue(self.clock.mono(), limit)
    }

    /// Collects the lanes written since the last collection and hands them to the gossip
    /// at once or once synced. The first of them was written when its writer noted
    /// ([`LaneStore::note_written`]), else seen queued at `noticed` (monotonic), else
    /// now: a write no wake-up of this task has seen was queued since its last one.
    /// (Until session 52 that last case took the wake-up before's moment, which could be
    /// long past: the sync then read as overdue from its start, and the node decided
    /// isolated while it ran.)
    fn collect(&mut self, lanes: &mut Vec<(Key, Lane)>, noticed: Option<Duration>) {
        let written = self.store.first_written();
        self.store.collect(lanes);
        if lanes.is_empty() {
            return;
        }
        let now = self.clock.now();
        let collected = (now, std::mem::take(lanes));
        let oldest = [written, noticed]
            .into_iter()
            .flatten()
            .min()
            .map_or(now.mono, |oldest| oldest.min(now.mono));
        if let Some(durable) = self.handoff.collected(collected, oldest) {
            self.local_lanes(durable);
        }
    }

    /// Hands lanes the lane log's sync made durable to the gossip. A failed sync stops the
    /// node before they are sent, as a failed write of the log does: see
    /// [`EXIT_LOG_FAILED`].
    fn synced(&mut self, synced: Result<Collected, LogError>) {
        match synced {
            Ok(durable) => {
                self.metrics.lane_log_syncs.fetch_add(1, Ordering::Relaxed);
                self.local_lanes(durable);
            }
            Err(err) => {
                log_line!("tallyd: {err}; stopping: own lanes are sent only once durable");
                std::process::exit(EXIT_LOG_FAILED);
            }
        }
    }

    /// On shutdown: every lane written, collected and made durable for the last push, and
    /// the answers under request ids written out. Lanes whose sync has not returned within
    /// [`LAST_FRAMES_DEADLINE`] stay unsent (the log holds them, and a restart re-publishes
    /// them).
    async fn last_lanes(&mut self, lanes: &mut Vec<(Key, Lane)>) {
        let collected = tokio::time::timeout(LAST_FRAMES_DEADLINE, async {
            loop {
                if self.handoff.is_syncing() {
                    let synced = self.handoff.synced().await;
                    self.synced(synced);
                }
                // Nothing waits on the sync's age at shutdown (`LAST_FRAMES_DEADLINE` does).
                self.collect(lanes, None);
                if !self.handoff.is_syncing() {
                    break;
                }
            }
            // Answers that wrote nothing (a denial) had no collection's sync to go with.
            if let Some(answers) = self.handoff.answers_sync() {
                let _ = tokio::task::spawn_blocking(move || answers.sync()).await;
            }
        });
        if collected.await.is_err() {
            log_line!("tallyd: the lane log's sync did not return; leaving without its lanes");
        }
    }

    /// Hands own lanes, collected and durable, to the gossip.
    fn local_lanes(&mut self, (now, lanes): Collected) {
        self.gossip.handle_input(Input::LocalLanes { now, lanes });
    }

    /// Carries out every output until the next deadline, which it returns.
    fn drain(&mut self, me: ReplicaId) -> Result<Duration, DriverError> {
        loop {
            match self.gossip.poll_output() {
                Output::Send { to, addr, frame } => self.transport.send(to, &addr, frame),
                Output::Event(Event::Changed { keys }) => self.publish(me, &keys),
                Output::Event(Event::Member(transition)) => {
                    log_line!(
                        "tallyd: member node {} generation {} at {} is now {:?}",
                        transition.node.0,
                        transition.replica.generation.0,
                        transition.addr,
                        transition.state
                    );
                }
                Output::Event(Event::GenerationReused { seen, written }) => {
                    return Err(DriverError::GenerationReused { seen, written });
                }
                Output::Event(Event::Forgotten { by }) => {
                    if let Some(forgotten) = self.forgotten.take() {
                        let _ = forgotten.send(by);
                    }
                }
                Output::Timeout(deadline) => return Ok(deadline),
            }
        }
    }

    /// Publishes every key's remote sum to the store and the view: at start, before the
    /// client listener answers anything, for the lanes restored from the logs (the node's
    /// earlier lives), so that no answer misses them.
    pub fn publish_restored(&mut self) {
        let me = self.gossip.replica();
        let keys: Vec<Key> = self
            .gossip
            .map()
            .iter()
            .map(|(key, _)| key.to_key())
            .collect();
        self.publish(me, &keys);
    }

    /// Publishes the remote sums of `keys` to the store, and takes their counters into the
    /// view.
    fn publish(&mut self, me: ReplicaId, keys: &[Key]) {
        // Rates are timed on the monotonic clock: by a wall clock stepped back an hour, no
        // sample would be far enough from the last for an hour, and the rates would stand.
        let now_ms = self.clock.mono().as_millis() as u64;
        let mut view = self.view.lock();
        for key in keys {
            let Some(counter) = self.gossip.map().counter(key) else {
                continue;
            };
            // At the key cap a remote key is not held in the store: kept, and published
            // again after each second's expiry until the store takes it. Counted like a
            // local refusal.
            if self
                .refused_sums
                .publish(&self.store, key, counter.value_without(me))
            {
                self.metrics
                    .keys_refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let previous = || {
                let window = key.window.previous()?;
                let key = Key {
                    window,
                    ..key.clone()
                };
                self.gossip.map().counter(&key)
            };
            view.take_in(key, &counter, previous, me, now_ms);
        }
    }

    /// `serving_since`: when the node began serving, on the monotonic clock; `held_for`:
    /// how long ago the oldest write an overdue lane-log sync holds back was queued.
    fn refresh_view(&mut self, me: ReplicaId, serving_since: Duration, held_for: Option<Duration>) {
        let map = self.gossip.map();
        let members = self.gossip.members();
        let all = [State::Alive, State::Suspect, State::Dead, State::Left];
        let rows: Vec<_> = members
            .others_in(&all)
            .into_iter()
            .filter_map(|node| Some((node, members.replica(node)?, members.state(node)?)))
            .collect();
        let stamps = rows
            .iter()
            .map(|(_, replica, _)| {
                // A dead or gone member's watermark goes with its last lanes; its row keeps
                // the stamp, so its staleness stays the age of its last state.
                let held = map.watermark(*replica).stamp;
                let kept = || members.stamp(*replica).unwrap_or_default();
                (*replica, if held == Stamp(0) { kept() } else { held })
            })
            .filter(|(replica, _)| *replica != me)
            .collect();
        let mut view = self.view.lock();
        let config = self.gossip.config();
        view.unheard_seeds = unheard_seeds(
            &config.seeds,
            self.gossip.table_matched(),
            self.clock.mono().saturating_sub(serving_since),
            config.dead_after,
            |seed| rows.iter().any(|(node, _, _)| *node == seed),
        );
        view.dead_after = Some(config.dead_after);
        let relocated = view.set_members(rows, stamps, self.clock.now());
        view.take_relocated(&relocated, map, me);
        view.take_ended(map, me);
        view.own_held_for = held_for;
        view.gossip = self.gossip.stats().clone();
        view.lanes = map.lanes();
        view.keys = map.len();
    }
}
