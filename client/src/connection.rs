//! The client's one multiplexed connection to its sidecar.
//!
//! A call encodes its request straight into the connection's outbox, under the one lock
//! that also holds the calls in flight ([`InFlight`]), and waits there for its outcome.
//! Three tasks drive each socket the connection opens (each *link*):
//!
//! - the writer writes everything in the outbox in one write. A call wakes it only when the
//!   outbox goes from empty to non-empty, so the calls made while a write is under way, or
//!   before the writer runs, share the next write: that is what makes pipelining cheap.
//!   A call that is alone in flight, with nothing to share a write with, writes its request
//!   itself if the socket takes it at once, and wakes no writer (only the sweeper, if the
//!   connection was idle and it was parked).
//! - the reader decodes every response that one read brought, hands each to the call
//!   waiting on its id under one lock, in whatever order they come, and wakes those calls.
//! - the sweeper ticks the connection's coarse clock and times out the calls that have
//!   waited their timeout: one timer per connection, not one per call. It parks while the
//!   connection is idle.
//!
//! When a read or a write fails, the link closes: every waiting call is told why, its
//! tasks stop, and its socket is dropped. After the writer's failed write it closes once
//! the reader has delivered the answers already received (at the stream's end), or a tick
//! later (at most 100 ms); after a call's own failed write, at once (it was alone in
//! flight), its requests never written. The client then opens the next link on the same
//! [`Connection`], so that a call reaches the connection through a plain reference, not
//! through a lock and a reference count.

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::slice;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{tcp, TcpStream};
use tokio::sync::Notify;

use crate::endpoint::Endpoint;
use crate::error::Error;
use crate::in_flight::{Broken, Deadlines, InFlight, Outcome};
use crate::wire::{self, OpRef, Refusal, Reply, RequestRef, Response, CLIENT_FRAME_BYTES_MAX};

/// Calls wait for room past this many bytes of requests not yet written: a sidecar that
/// stops reading must not make the client buffer without end.
const QUEUED_BYTES_MAX: usize = 1024 * 1024;

/// Calls wait for room past this many calls in flight: sent or queued, and answered but not
/// yet collected.
const IN_FLIGHT_MAX: usize = 1 << 16;

/// The reader's buffer: many small responses come in one read, and it holds the largest
/// frame whole.
const READ_BUFFER_BYTES: usize = 2 * CLIENT_FRAME_BYTES_MAX;

/// The handle on the connection. Dropping it closes the open link once the queued requests
/// are written, or once the calls' timeout has passed, if they are not written by then.
pub(crate) struct Connection {
    shared: Arc<Shared>,
}

impl Connection {
    /// Connects to `endpoint` and spawns the first link's tasks on the current runtime, as
    /// every later link's. Calls wait at most `timeout` for their answers.
    pub(crate) async fn open(endpoint: &Endpoint, timeout: Duration) -> Result<Connection, Error> {
        let socket = Socket::connect(endpoint).await?;
        let connection = Connection {
            shared: Arc::new(Shared::new(timeout, tokio::runtime::Handle::current())),
        };
        connection.start(socket);
        Ok(connection)
    }

    /// Opens the next link, once the last one has closed. Called on the connection's
    /// runtime ([`Connection::on_its_runtime`]): a socket is served by the runtime it was
    /// made on, and the caller's may never run again.
    ///
    /// Callers take turns: a link starts only while none is open.
    pub(crate) async fn reopen(&self, endpoint: &Endpoint) -> Result<(), Error> {
        let socket = Socket::connect(endpoint).await?;
        self.start(socket);
        Ok(())
    }

    /// Runs `task` on the runtime the connection's tasks run on, and waits for it from any
    /// runtime; [`Error::RuntimeStopped`] once that runtime has shut down.
    pub(crate) async fn on_its_runtime<T: Send + 'static>(
        &self,
        task: impl Future<Output = Result<T, Error>> + Send + 'static,
    ) -> Result<T, Error> {
        match self.shared.runtime.spawn(task).await {
            Ok(done) => done,
            Err(gone) if gone.is_cancelled() => Err(Error::RuntimeStopped),
            Err(panicked) => std::panic::resume_unwind(panicked.into_panic()),
        }
    }

    /// Whether the open link has closed (and no other has opened); calls then fail until
    /// [`Connection::reopen`].
    pub(crate) fn is_closed(&self) -> bool {
        self.shared.open_link.load(Ordering::Acquire) == NO_LINK
    }

    /// Sends `op` and waits for its outcome, at most the connection's timeout.
    ///
    /// Dropping the future (a cancelled caller) forgets the request, so a late answer finds
    /// no one waiting and is dropped.
    pub(crate) fn call<'a>(&'a self, op: OpRef<'a>) -> Call<'a> {
        Call {
            shared: &self.shared,
            stage: Stage::Unsent {
                op,
                wait: Wait::default(),
            },
        }
    }

    /// Sends every op of `ops` (at least one) together and waits for each outcome, at most
    /// the connection's timeout.
    ///
    /// Dropping the future forgets the requests still waiting, as [`Connection::call`] does.
    pub(crate) fn pipeline<'a>(&'a self, ops: &'a [OpRef<'a>]) -> PipelineCall<'a> {
        PipelineCall {
            shared: &self.shared,
            ops,
            wait: Wait::default(),
            first_id: None,
            results: Vec::new(),
            collected: 0,
            finished: false,
        }
    }

    fn start(&self, socket: Socket) {
        match socket {
            Socket::Tcp(stream) => {
                let (read, write) = stream.into_split();
                spawn_link(&self.shared, read, WriteHalf::Tcp(write));
            }
            #[cfg(unix)]
            Socket::Unix(stream) => {
                let (read, write) = stream.into_split();
                spawn_link(&self.shared, read, WriteHalf::Unix(write));
            }
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // The writer closes the link once it has written what is queued.
        let (writer, busy_link) = {
            let mut state = self.shared.lock();
            state.handles_gone = true;
            let busy = state.closed.is_none() && state.writer.is_none();
            (state.writer.take(), busy.then_some(state.link))
        };
        if let Some(writer) = writer {
            writer.wake();
        }
        // A writer that is not parked may be waiting on a socket the sidecar no longer
        // reads, and would keep the link, its tasks and its socket forever: it has the
        // calls' timeout to write what is queued, then the link closes (found in review,
        // session 53). No call waits on it: calls borrow the handle. The timer holds the
        // shared state weakly: a link that closes sooner lets it go at once, not after the
        // timeout (found in review, session 53), and then there is nothing left to close.
        if let Some(link) = busy_link {
            let shared = Arc::downgrade(&self.shared);
            let timeout = self.shared.timeout;
            self.shared.runtime.spawn(async move {
                tokio::time::sleep(timeout).await;
                if let Some(shared) = shared.upgrade() {
                    shared.close(link, Broken::Disconnected);
                }
            });
        }
    }
}

/// A connected socket, before it is split between a link's reader and writer.
enum Socket {
    Tcp(TcpStream),
    #[cfg(unix)]
    Unix(tokio::net::UnixStream),
}

impl Socket {
    async fn connect(endpoint: &Endpoint) -> Result<Socket, Error> {
        let connect_error = |source: io::Error| Error::Connect {
            endpoint: endpoint.to_string(),
            source,
        };
        match endpoint {
            Endpoint::Tcp(addr) => {
                let stream = TcpStream::connect(addr).await.map_err(connect_error)?;
                // Requests are small and pipelined: Nagle's algorithm would hold each batch
                // until the previous one is acknowledged.
                stream.set_nodelay(true).map_err(connect_error)?;
                Ok(Socket::Tcp(stream))
            }
            #[cfg(unix)]
            Endpoint::Unix(path) => {
                let stream = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(connect_error)?;
                Ok(Socket::Unix(stream))
            }
            #[cfg(not(unix))]
            Endpoint::Unix(_) => Err(connect_error(io::Error::new(
                io::ErrorKind::Unsupported,
                "unix sockets are not available on this platform",
            ))),
        }
    }
}

/// The writing half of a link's socket. Concrete, not an `AsyncWrite`, for `try_write`: a
/// call writes to it directly, under the connection's lock.
enum WriteHalf {
    Tcp(tcp::OwnedWriteHalf),
    #[cfg(unix)]
    Unix(tokio::net::unix::OwnedWriteHalf),
}

impl WriteHalf {
    /// Writes what the socket takes now, without waiting and without registering a waker.
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        match self {
            WriteHalf::Tcp(write) => write.try_write(bytes),
            #[cfg(unix)]
            WriteHalf::Unix(write) => write.try_write(bytes),
        }
    }

    fn poll_write(&mut self, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<io::Result<usize>> {
        match self {
            WriteHalf::Tcp(write) => Pin::new(write).poll_write(cx, bytes),
            #[cfg(unix)]
            WriteHalf::Unix(write) => Pin::new(write).poll_write(cx, bytes),
        }
    }
}

/// Starts a link on `read` and `write`: its writer, reader and sweeper tasks, on the
/// runtime the connection was opened on (whichever caller reconnects).
fn spawn_link<R>(shared: &Arc<Shared>, read: R, write: WriteHalf)
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let (link, wake_sweeper) = shared.begin_link(write);
    spawn_closing(shared, link, write_requests(Arc::clone(shared), link));
    spawn_closing(shared, link, read_responses(read, Arc::clone(shared), link));
    spawn_closing(shared, link, sweep(Arc::clone(shared), link, wake_sweeper));
}

/// Spawns one of `link`'s tasks on the connection's runtime, holding a [`CloseOnDrop`].
fn spawn_closing<F>(shared: &Arc<Shared>, link: u64, task: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let guard = CloseOnDrop {
        shared: Arc::clone(shared),
        link,
    };
    shared.runtime.spawn(async move {
        task.await;
        drop(guard);
    });
}

/// Closes its link when dropped. Each of a link's tasks holds one, so a task that ends
/// any way (a panic, its runtime shut down, or never run because the runtime was already
/// gone) fails the link's calls with `Disconnected` instead of leaving them waiting, and
/// the next call reconnects. Closing a link already closed does nothing.
struct CloseOnDrop {
    shared: Arc<Shared>,
    link: u64,
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.shared.close(self.link, Broken::Disconnected);
    }
}

/// One request's round trip: encoded into the outbox on its first poll, then waiting for
/// its outcome.
pub(crate) struct Call<'a> {
    shared: &'a Shared,
    stage: Stage<'a>,
}

/// A call's wait to be sent.
#[derive(Default)]
struct Wait {
    /// The epoch of the first try, from which the call's timeout counts.
    since: Option<u64>,
    /// The round of [`State::room`] that holds this call's task, and the waker it holds.
    listed: Option<(u64, Waker)>,
}

enum Stage<'a> {
    /// Not in the outbox yet: not polled, or waiting for room.
    Unsent { op: OpRef<'a>, wait: Wait },
    /// In flight under `id`.
    Sent { id: u64 },
    /// The outcome was returned.
    Finished,
}

impl Future for Call<'_> {
    type Output = Result<Reply, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let call = self.get_mut();
        let shared = call.shared;
        match &mut call.stage {
            Stage::Unsent { op, wait } => {
                match shared.send(slice::from_ref(op), wait, cx.waker()) {
                    Sent::InFlight(id) => {
                        // The slot holds this poll's waker already, so there is nothing to look
                        // at until it is woken.
                        call.stage = Stage::Sent { id };
                        Poll::Pending
                    }
                    Sent::NoRoom => Poll::Pending,
                    Sent::Failed(err) => {
                        call.stage = Stage::Finished;
                        Poll::Ready(Err(err))
                    }
                }
            }
            Stage::Sent { id } => {
                let Some(outcome) = shared.collect(*id, cx.waker()) else {
                    return Poll::Pending;
                };
                call.stage = Stage::Finished;
                Poll::Ready(outcome.into_result(shared.timeout))
            }
            Stage::Finished => panic!("invariant: a call is not polled after it returned"),
        }
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        if let Stage::Sent { id } = self.stage {
            self.shared.abandon(id);
        }
    }
}

/// A pipeline's round trip: all its requests encoded into the outbox together on its first
/// poll, then waiting until each has its outcome. Its requests share one waker, so the
/// reader wakes its task once per read however many of its answers the read brought, and
/// each wake collects every answer in under one lock.
pub(crate) struct PipelineCall<'a> {
    shared: &'a Shared,
    ops: &'a [OpRef<'a>],
    /// Its wait to be sent.
    wait: Wait,
    /// The id of the first request, once they are in flight; the others follow in order.
    first_id: Option<u64>,
    /// Each request's result, by its place in `ops`, as it comes in.
    results: Vec<Option<Result<Reply, Error>>>,
    /// How many of `results`, from the first, are all in: the next collection looks only
    /// past them.
    collected: usize,
    /// The outcome was returned.
    finished: bool,
}

impl Future for PipelineCall<'_> {
    /// `Err` when nothing was sent; otherwise every request's result, in order.
    type Output = Result<Vec<Result<Reply, Error>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let call = self.get_mut();
        assert!(
            !call.finished,
            "invariant: a pipeline is not polled after it returned"
        );
        let shared = call.shared;
        let first_id = match call.first_id {
            Some(first_id) => first_id,
            None => match shared.send(call.ops, &mut call.wait, cx.waker()) {
                Sent::InFlight(first_id) => {
                    call.first_id = Some(first_id);
                    call.results = call.ops.iter().map(|_| None).collect();
                    return Poll::Pending;
                }
                Sent::NoRoom => return Poll::Pending,
                Sent::Failed(err) => {
                    call.finished = true;
                    return Poll::Ready(Err(err));
                }
            },
        };
        let from = call.collected;
        shared.collect_all(
            first_id + from as u64,
            &mut call.results[from..],
            cx.waker(),
        );
        call.collected += call.results[from..]
            .iter()
            .take_while(|result| result.is_some())
            .count();
        if call.collected < call.results.len() {
            return Poll::Pending;
        }
        call.finished = true;
        let results = std::mem::take(&mut call.results);
        Poll::Ready(Ok(results
            .into_iter()
            .map(|result| result.expect("invariant: every result is in"))
            .collect()))
    }
}

impl Drop for PipelineCall<'_> {
    fn drop(&mut self) {
        if let Some(first_id) = self.first_id {
            self.shared.abandon_all(first_id, &self.results);
        }
    }
}

/// What became of a call's try to send.
enum Sent {
    /// Queued, the first request under this id and the others under the ids after it.
    InFlight(u64),
    /// The outbox is full: the call waits for room.
    NoRoom,
    /// The connection closed, or the call timed out waiting for room.
    Failed(Error),
}

/// `Shared::open_link` when no link is open. Links count from 1.
const NO_LINK: u64 = 0;

/// What the handle, the calls and the tasks share.
struct Shared {
    state: Mutex<State>,
    /// The open link's number, or `NO_LINK`: `State::link` while `State::closed` is `None`,
    /// for checks that take no lock.
    open_link: AtomicU64,
    /// How long a call waits for its answer.
    timeout: Duration,
    deadlines: Deadlines,
    /// The runtime the connection was opened on, where every link's tasks run.
    runtime: tokio::runtime::Handle,
}

/// Everything under the connection's one lock. Nothing under it waits (the most is one
/// non-blocking write, by a call alone in flight) or panics (but for invariant checks),
/// and wakers are woken only once it is released.
struct State {
    /// Calls in flight, over every link: ids never repeat on the connection, so an answer
    /// on a new link cannot reach a call made on an old one.
    in_flight: InFlight,
    /// The number of the last link started. A task serves only its own link, and stops
    /// once that is no longer the open one.
    link: u64,
    /// Why the last link closed; `None` while it is open.
    closed: Option<Broken>,
    /// Requests encoded and not yet handed to the writer, in id order.
    queued: Vec<u8>,
    /// The first id whose request no byte of has been handed to the socket or the writer:
    /// it and every later one are wholly in `queued`, so if the link closes now the
    /// sidecar cannot have read them.
    unwritten: u64,
    /// The open link's socket, while no write is under way: the writer task takes it out
    /// for each batch, and a call alone in flight writes to it in place.
    write_half: Option<WriteHalf>,
    /// The writer task, when it is parked for want of requests.
    writer: Option<Waker>,
    /// The writer and the reader tasks as they last waited on the socket, for `close` to
    /// wake. Only `close` takes them.
    socket_writer: Option<Waker>,
    socket_reader: Option<Waker>,
    /// Calls waiting for room in the outbox, each task once a round; woken together when
    /// there is room, and at each tick to check their timeout.
    room: Vec<Waker>,
    /// Rises each time `room` is taken: a call listed in an earlier round is listed again.
    room_round: u64,
    /// The clock: sweeper ticks so far.
    epoch: u64,
    /// The next id when the last tick came: a tick that finds it unchanged and nothing in
    /// flight parks the sweeper.
    next_id_at_tick: u64,
    /// The sweeper is parked, and the next call must wake it.
    sweeper_parked: bool,
    /// Wakes the open link's sweeper when a call arrives while it is parked, or when its
    /// link closes. Each link has its own: a sweeper of a closed link that waits on it late
    /// cannot take a wake-up meant for the next link's.
    wake_sweeper: Arc<Notify>,
    /// The handle was dropped: no call will come.
    handles_gone: bool,
}

impl State {
    /// Whether `link` is the open link.
    fn is_open(&self, link: u64) -> bool {
        self.link == link && self.closed.is_none()
    }

    /// Writes what the socket takes of the outbox now, if no write is under way. What it
    /// does not take is left to the writer. False if the write failed: the socket took no
    /// byte of it, and the caller closes the link, so that its calls are told `NotSent`
    /// (handed to the writer, which would meet the error again, they would be told
    /// `Disconnected`, outcome unknown: found in review, session 53).
    fn write_directly(&mut self) -> bool {
        let Some(write) = &self.write_half else {
            return true;
        };
        match write.try_write(&self.queued) {
            Ok(wrote) => {
                // The outbox was empty before this call's requests, so it begins at the
                // `unwritten` one: each request begun on the socket may be read.
                self.unwritten += wire::frames_begun(&self.queued, wrote);
                self.queued.drain(..wrote);
                true
            }
            Err(err) => matches!(
                err.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ),
        }
    }

    fn has_room(&self) -> bool {
        self.queued.len() < QUEUED_BYTES_MAX && self.in_flight.live() < IN_FLIGHT_MAX
    }

    /// The calls waiting for room, if there is room now.
    fn take_room_waiters(&mut self) -> Vec<Waker> {
        if self.room.is_empty() || !self.has_room() {
            return Vec::new();
        }
        self.take_room()
    }

    /// Every call waiting for room, starting the next round.
    fn take_room(&mut self) -> Vec<Waker> {
        self.room_round += 1;
        std::mem::take(&mut self.room)
    }

    /// Lists `waker`'s task as waiting for room, if `wait` is not listed in this round
    /// already: a task polled again and again before room comes, by turns with other
    /// tasks (a `select!` loop), or polling many calls (as a join does), is listed once.
    fn wait_for_room(&mut self, wait: &mut Wait, waker: &Waker) {
        let round = self.room_round;
        let listed = |(at, listed): &(u64, Waker)| *at == round && listed.will_wake(waker);
        if wait.listed.as_ref().is_some_and(listed) {
            return;
        }
        if !self.room.last().is_some_and(|last| last.will_wake(waker)) {
            self.room.push(waker.clone());
        }
        wait.listed = Some((round, waker.clone()));
    }
}

impl Shared {
    /// No link open yet.
    fn new(timeout: Duration, runtime: tokio::runtime::Handle) -> Shared {
        Shared {
            state: Mutex::new(State {
                in_flight: InFlight::new(1, IN_FLIGHT_MAX),
                link: NO_LINK,
                closed: Some(Broken::Disconnected),
                queued: Vec::new(),
                unwritten: 1,
                write_half: None,
                writer: None,
                socket_writer: None,
                socket_reader: None,
                room: Vec::new(),
                room_round: 0,
                epoch: 0,
                next_id_at_tick: 1,
                sweeper_parked: false,
                wake_sweeper: Arc::new(Notify::new()),
                handles_gone: false,
            }),
            open_link: AtomicU64::new(NO_LINK),
            timeout,
            deadlines: Deadlines::new(timeout),
            runtime,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing under the lock panics but an invariant check, and state is consistent
        // before each of those, so a poisoned lock still holds usable state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens the next link, writing to `write`, and returns its number and what wakes its
    /// sweeper.
    fn begin_link(&self, write: WriteHalf) -> (u64, Arc<Notify>) {
        let mut state = self.lock();
        assert!(
            state.closed.is_some(),
            "invariant: link {} is open; the next starts only once it has closed",
            state.link
        );
        state.link += 1;
        state.closed = None;
        state.write_half = Some(write);
        state.next_id_at_tick = state.in_flight.next_id();
        state.unwritten = state.in_flight.next_id();
        state.wake_sweeper = Arc::new(Notify::new());
        self.open_link.store(state.link, Ordering::Release);
        (state.link, Arc::clone(&state.wake_sweeper))
    }

    /// Encodes `ops` (at least one) into the outbox under consecutive ids and registers
    /// `waker` to wait for their answers.
    fn send(&self, ops: &[OpRef<'_>], wait: &mut Wait, waker: &Waker) -> Sent {
        assert!(
            !ops.is_empty(),
            "invariant: a call sends at least one request"
        );
        let mut state = self.lock();
        if state.closed.is_some() {
            return Sent::Failed(Error::NotSent {
                why: "the connection closed before the request was queued".into(),
            });
        }
        let waited = wait.since.is_some();
        let since = *wait.since.get_or_insert(state.epoch);
        // A call waits for its timeout (or for room) only while the sweeper ticks.
        let sweeper =
            std::mem::take(&mut state.sweeper_parked).then(|| Arc::clone(&state.wake_sweeper));
        // The link, if this call's own write found its socket broken.
        let mut broken = None;
        // A call that waited for room past its timeout is not sent, even if room has come:
        // `NotSent` says that nothing was counted, where a send could only end `Timeout`.
        let (sent, writer) = if waited && self.deadlines.expired(since, state.epoch) {
            let after = self.timeout;
            let why = format!("no room in the client's outbox within {after:?}");
            (Sent::Failed(Error::NotSent { why }), None)
        } else if state.has_room() {
            let first_id = state.in_flight.next_id();
            let was_empty = state.queued.is_empty();
            if was_empty {
                state.unwritten = first_id;
            }
            for &op in ops {
                let id = state.in_flight.push(waker.clone(), since);
                wire::encode_request(&RequestRef { id, op }, &mut state.queued);
            }
            if was_empty
                && state.in_flight.live() == ops.len()
                // Alone in flight: no other request is coming soon to share a write with,
                // so waking the writer would only add a task switch to the round trip.
                && !state.write_directly()
            {
                // Nothing else waits for an answer on the link (alone in flight), so it
                // closes at once: no answer already received is lost.
                broken = Some(state.link);
            }
            // A writer that is not parked will look at the outbox again before it parks.
            let writer = if was_empty && !state.queued.is_empty() && broken.is_none() {
                state.writer.take()
            } else {
                None
            };
            (Sent::InFlight(first_id), writer)
        } else {
            state.wait_for_room(wait, waker);
            (Sent::NoRoom, None)
        };
        drop(state);
        if let Some(link) = broken {
            self.close(link, Broken::Disconnected);
        }
        if let Some(writer) = writer {
            writer.wake();
        }
        if let Some(sweeper) = sweeper {
            sweeper.notify_one();
        }
        sent
    }

    /// The outcome of the call on `id`, once it is in.
    fn collect(&self, id: u64, waker: &Waker) -> Option<Outcome> {
        let mut state = self.lock();
        let outcome = state.in_flight.poll(id, waker)?;
        let room = state.take_room_waiters();
        drop(state);
        room.into_iter().for_each(Waker::wake);
        Some(outcome)
    }

    /// Takes the results that are in of the requests sent from `first_id` on into the
    /// empty places of `results` (by place: `first_id` first), and registers `waker` for
    /// the rest.
    fn collect_all(
        &self,
        first_id: u64,
        results: &mut [Option<Result<Reply, Error>>],
        waker: &Waker,
    ) {
        let mut state = self.lock();
        for (id, result) in (first_id..).zip(results.iter_mut()) {
            if result.is_none() {
                let outcome = state.in_flight.poll(id, waker);
                *result = outcome.map(|outcome| outcome.into_result(self.timeout));
            }
        }
        let room = state.take_room_waiters();
        drop(state);
        room.into_iter().for_each(Waker::wake);
    }

    /// A pipeline sent from `first_id` on gives up on the requests whose places in
    /// `results` are still empty.
    fn abandon_all(&self, first_id: u64, results: &[Option<Result<Reply, Error>>]) {
        let mut state = self.lock();
        for (id, result) in (first_id..).zip(results) {
            if result.is_none() {
                state.in_flight.abandon(id);
            }
        }
        let room = state.take_room_waiters();
        drop(state);
        room.into_iter().for_each(Waker::wake);
    }

    fn abandon(&self, id: u64) {
        let mut state = self.lock();
        state.in_flight.abandon(id);
        let room = state.take_room_waiters();
        drop(state);
        room.into_iter().for_each(Waker::wake);
    }

    /// Decodes the whole frames at the start of `input`, read on `link`, and hands each
    /// response to its call as it is decoded; wakes them once the lock is released.
    /// Returns how many bytes the frames took and why the stream is broken if a frame
    /// does not decode, or `None` if the link has closed.
    ///
    /// Decoding under the lock hands each answer straight to its slot: no list of
    /// responses between the decoder and the calls, through which each answer (about a
    /// hundred bytes) was moved twice more. The price is a longer hold: about 200
    /// instructions more per answer, which callers on other threads of a multi-threaded
    /// runtime may wait out; nothing under it waits on IO.
    fn deliver(
        &self,
        link: u64,
        input: &[u8],
        wakers: &mut Vec<Waker>,
    ) -> Option<(usize, Option<Broken>)> {
        let mut state = self.lock();
        if !state.is_open(link) {
            return None;
        }
        let decoded = decode_responses(input, |decoded| {
            let waker = match decoded {
                Decoded::Response(response) => state.in_flight.answer(response.id, response.result),
                Decoded::Undecodable { id, why } => state.in_flight.undecodable(id, why),
            };
            if let Some(waker) = waker {
                // A pipeline's requests share one waker: one wake per read is enough.
                if !wakers.last().is_some_and(|last| last.will_wake(&waker)) {
                    wakers.push(waker);
                }
            }
        });
        drop(state);
        wakers.drain(..).for_each(Waker::wake);
        Some(decoded)
    }

    /// Moves the queued requests into the writer's empty `batch` and hands it the socket
    /// to write them to, or parks the writer until there are some. `Ready(None)` when the
    /// writer of `link` should stop.
    fn poll_batch(
        &self,
        link: u64,
        cx: &mut Context<'_>,
        batch: &mut Vec<u8>,
    ) -> Poll<Option<WriteHalf>> {
        let mut state = self.lock();
        if !state.is_open(link) {
            return Poll::Ready(None);
        }
        if !state.queued.is_empty() {
            let write = state.write_half.take().expect(
                "invariant: the open link's socket is in the state while its writer is idle",
            );
            // A swap, so that both buffers keep their capacity: no allocation per batch.
            std::mem::swap(&mut state.queued, batch);
            state.unwritten = state.in_flight.next_id();
            // Busy: calls need not wake it until it parks again.
            state.writer = None;
            let room = state.take_room_waiters();
            drop(state);
            room.into_iter().for_each(Waker::wake);
            return Poll::Ready(Some(write));
        }
        if state.handles_gone {
            drop(state);
            self.close(link, Broken::Disconnected);
            return Poll::Ready(None);
        }
        state.writer = Some(cx.waker().clone());
        Poll::Pending
    }

    /// The writer of `link` is done with a batch: the socket goes back to the state, or is
    /// dropped if the link has closed meanwhile.
    fn end_batch(&self, link: u64, write: WriteHalf) {
        let mut state = self.lock();
        if state.is_open(link) {
            state.write_half = Some(write);
            return;
        }
        drop(state);
        drop(write);
    }

    /// Registers the writer or the reader of `link` to be woken when the link closes, as it
    /// waits on its socket. False if it has closed already.
    fn park_on_socket(&self, link: u64, task: Task, waker: &Waker) -> bool {
        let mut state = self.lock();
        if !state.is_open(link) {
            return false;
        }
        let parked = match task {
            Task::Writer => &mut state.socket_writer,
            Task::Reader => &mut state.socket_reader,
        };
        *parked = Some(waker.clone());
        true
    }

    /// One tick of `link`'s sweeper: advances the clock, times out the calls that have
    /// waited their timeout, and wakes the calls waiting for room to check theirs. Returns
    /// whether the connection is idle, in which case the sweeper is marked parked.
    fn tick(&self, link: u64, wakers: &mut Vec<Waker>) -> bool {
        let mut state = self.lock();
        if !state.is_open(link) {
            return false;
        }
        let next_id = state.in_flight.next_id();
        let idle = state.in_flight.live() == 0
            && state.room.is_empty()
            && next_id == state.next_id_at_tick;
        state.next_id_at_tick = next_id;
        state.epoch += 1;
        let epoch = state.epoch;
        state.in_flight.expire(&self.deadlines, epoch, wakers);
        wakers.append(&mut state.take_room());
        state.sweeper_parked = idle;
        drop(state);
        wakers.drain(..).for_each(Waker::wake);
        idle
    }

    /// Closes `link`: tells every waiting call why and stops the link's tasks. Only the
    /// first close of the open link counts.
    fn close(&self, link: u64, broken: Broken) {
        let mut wakers = Vec::new();
        // Dropped once the lock is released: dropping a socket is a system call.
        let (_write_half, wake_sweeper) = {
            let mut state = self.lock();
            if !state.is_open(link) {
                return;
            }
            let unwritten = state.unwritten;
            state.in_flight.close(&broken, unwritten, &mut wakers);
            state.closed = Some(broken);
            self.open_link.store(NO_LINK, Ordering::Release);
            // The queued requests were for this link's socket, and their calls have just
            // been failed; the next link starts with an empty outbox and parks nothing.
            state.queued.clear();
            state.sweeper_parked = false;
            wakers.append(&mut state.take_room());
            wakers.extend(state.writer.take());
            wakers.extend(state.socket_writer.take());
            wakers.extend(state.socket_reader.take());
            (state.write_half.take(), Arc::clone(&state.wake_sweeper))
        };
        wakers.into_iter().for_each(Waker::wake);
        wake_sweeper.notify_one();
    }

    /// Whether `link` is the open link, without the lock.
    fn is_open(&self, link: u64) -> bool {
        self.open_link.load(Ordering::Acquire) == link
    }
}

#[derive(Debug, Clone, Copy)]
enum Task {
    Writer,
    Reader,
}

/// A task's registration to be woken by `close` while it waits on its socket, kept so that
/// it takes the lock only when its waker changes, not each time it waits.
struct SocketWait {
    link: u64,
    task: Task,
    /// The waker last registered. `close` clears `Shared::open_link` before it takes the
    /// registered waker (and wakes it), so while the link is open the registration stands.
    registered: Option<Waker>,
}

impl SocketWait {
    fn new(link: u64, task: Task) -> SocketWait {
        SocketWait {
            link,
            task,
            registered: None,
        }
    }

    /// Whether the task may wait on its socket with `waker`: false if its link has closed.
    fn park(&mut self, shared: &Shared, waker: &Waker) -> bool {
        if !shared.is_open(self.link) {
            return false;
        }
        if self
            .registered
            .as_ref()
            .is_some_and(|registered| registered.will_wake(waker))
        {
            return true;
        }
        if !shared.park_on_socket(self.link, self.task, waker) {
            return false;
        }
        self.registered = Some(waker.clone());
        true
    }
}

/// The longest a link whose write failed stays open for its reader to deliver the answers
/// already received. Those are in the socket already, so the reader needs only to be run;
/// the bound keeps a long timeout's tick from holding new calls that long before they fail.
const DRAIN_AFTER_FAILED_WRITE_MAX: Duration = Duration::from_millis(100);

/// The writer task of `link`: writes everything queued, one batch at a time.
async fn write_requests(shared: Arc<Shared>, link: u64) {
    let mut batch = Vec::new();
    let mut wait = SocketWait::new(link, Task::Writer);
    loop {
        batch.clear();
        let Some(mut write) = poll_fn(|cx| shared.poll_batch(link, cx, &mut batch)).await else {
            return;
        };
        let written = write_all(&mut write, &batch, &shared, &mut wait).await;
        if let Err(Stopped::Failed) = written {
            // The socket is not handed back, so no call writes to it again: requests queued
            // from now on stay whole in the outbox and fail `NotSent` when the link closes.
            drop(write);
            // A write fails once the sidecar has reset the connection, but the answers it sent
            // before may still wait in the socket, unread. Closing the link here at once
            // would tell their calls `Disconnected`, outcome unknown, though their answers
            // came. The reader delivers them and closes the link at the stream's end; if the
            // stream does not end (a peer that no longer reads but stays), this closes it a
            // tick later, and at most `DRAIN_AFTER_FAILED_WRITE_MAX` later.
            let closed = poll_fn(|cx| {
                if wait.park(&shared, cx.waker()) {
                    Poll::Pending
                } else {
                    Poll::Ready(())
                }
            });
            let drain = shared.deadlines.tick.min(DRAIN_AFTER_FAILED_WRITE_MAX);
            if tokio::time::timeout(drain, closed).await.is_err() {
                shared.close(link, Broken::Disconnected);
            }
            return;
        }
        shared.end_batch(link, write);
        if written.is_err() {
            return;
        }
    }
}

/// Why a task stopped waiting on its socket.
enum Stopped {
    /// The link closed meanwhile.
    Closed,
    /// The socket failed or reached its end.
    Failed,
}

/// Writes all of `batch`, or stops when the link closes while the socket is full.
async fn write_all(
    write: &mut WriteHalf,
    batch: &[u8],
    shared: &Shared,
    wait: &mut SocketWait,
) -> Result<(), Stopped> {
    let mut written = 0;
    while written < batch.len() {
        let wrote = poll_fn(|cx| match write.poll_write(cx, &batch[written..]) {
            Poll::Ready(wrote) => Poll::Ready(Ok(wrote)),
            Poll::Pending if wait.park(shared, cx.waker()) => Poll::Pending,
            Poll::Pending => Poll::Ready(Err(Stopped::Closed)),
        })
        .await?;
        match wrote {
            Ok(0) | Err(_) => return Err(Stopped::Failed),
            Ok(wrote) => written += wrote,
        }
    }
    Ok(())
}

/// The reader task of `link`: reads and delivers responses until the stream fails or the
/// link closes.
async fn read_responses<R: AsyncRead + Unpin>(mut read: R, shared: Arc<Shared>, link: u64) {
    if let Some(broken) = deliver_responses(&mut read, &shared, link).await {
        shared.close(link, broken);
    }
}

/// Reads and delivers responses; returns why the stream broke, or `None` if the link
/// closed for another reason.
async fn deliver_responses<R: AsyncRead + Unpin>(
    read: &mut R,
    shared: &Shared,
    link: u64,
) -> Option<Broken> {
    let mut buffer = vec![0; READ_BUFFER_BYTES];
    // Invariant: `buffer[..filled]` holds less than one whole frame after each pass, so
    // there is always room to read into.
    let mut filled = 0;
    let mut wakers = Vec::new();
    let mut wait = SocketWait::new(link, Task::Reader);
    loop {
        let read = poll_fn(|cx| {
            let mut unfilled = ReadBuf::new(&mut buffer[filled..]);
            match Pin::new(&mut *read).poll_read(cx, &mut unfilled) {
                Poll::Ready(Ok(())) => Poll::Ready(Ok(unfilled.filled().len())),
                Poll::Ready(Err(_)) => Poll::Ready(Err(Stopped::Failed)),
                Poll::Pending if wait.park(shared, cx.waker()) => Poll::Pending,
                Poll::Pending => Poll::Ready(Err(Stopped::Closed)),
            }
        })
        .await;
        match read {
            Ok(0) | Err(Stopped::Failed) => return Some(Broken::Disconnected),
            Err(Stopped::Closed) => return None,
            Ok(read) => filled += read,
        }
        // Answers that came before a bad frame are still delivered.
        let (decoded, broken) = shared.deliver(link, &buffer[..filled], &mut wakers)?;
        if broken.is_some() {
            return broken;
        }
        buffer.copy_within(decoded..filled, 0);
        filled -= decoded;
    }
}

/// One frame of answers as read.
#[derive(Debug, PartialEq)]
enum Decoded {
    Response(Response),
    /// A frame of this wire version whose id reads but whose answer does not decode: a
    /// reply or a refusal newer than this build. Its call alone fails; the stream stays
    /// whole, since the frame's length is known.
    Undecodable {
        id: u64,
        why: String,
    },
}

/// The most bytes of a sidecar's reason for refusing a frame that are kept: the reason is
/// copied to every call still waiting (up to [`IN_FLIGHT_MAX`] and a pipeline), so
/// one frame of up to 64 KiB must not become gigabytes (found in review, session 44).
/// tallyd's reasons are a line long.
const REASON_BYTES_MAX: usize = 512;

/// `why`, cut to at most [`REASON_BYTES_MAX`] bytes at a character's boundary.
fn clipped(why: &str) -> &str {
    let mut end = why.len().min(REASON_BYTES_MAX);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    &why[..end]
}

/// Decodes the whole frames at the start of `input`, handing each to `handle` in order;
/// returns how many bytes they took, and why the stream is broken if a frame's length is
/// refused or a frame does not decode as far as its id.
fn decode_responses(input: &[u8], mut handle: impl FnMut(Decoded)) -> (usize, Option<Broken>) {
    let mut at = 0;
    while let Some(prefix) = input.get(at..at + 4) {
        let prefix: [u8; 4] = prefix.try_into().expect("invariant: a 4-byte slice");
        let len = match wire::frame_len(prefix) {
            Ok(len) => len,
            Err(err) => return (at, Some(Broken::Protocol(err.to_string()))),
        };
        let Some(body) = input.get(at + 4..at + 4 + len) else {
            break;
        };
        match wire::decode_response(body) {
            // No request has id 0: the sidecar refused a frame of this connection (one it
            // cannot decode, an operation newer than its build, say) and closes it. What
            // it says is why every call still waiting fails, and no retry on this build
            // will do better. (A sidecar of another wire version answers in its own, which
            // `decode_response` refuses first.)
            Ok(Response {
                id: 0,
                result: Err(Refusal::Malformed { why }),
            }) => {
                let why = format!("the sidecar refused this client's frame: {}", clipped(&why));
                return (at + 4 + len, Some(Broken::Protocol(why)));
            }
            Ok(response) => handle(Decoded::Response(response)),
            Err(err) => match wire::response_id(body).filter(|&id| id != 0) {
                Some(id) => handle(Decoded::Undecodable {
                    id,
                    why: format!("the sidecar's answer does not decode: {err}"),
                }),
                None => return (at, Some(Broken::Protocol(err.to_string()))),
            },
        }
        at += 4 + len;
    }
    (at, None)
}

/// The sweeper task of `link`: ticks the connection's clock while calls are in flight, and
/// parks while the connection is idle.
async fn sweep(shared: Arc<Shared>, link: u64, wake: Arc<Notify>) {
    let mut wakers = Vec::new();
    while shared.is_open(link) {
        tokio::select! {
            () = tokio::time::sleep(shared.deadlines.tick) => {}
            // Only `close` notifies a sweeper that is not parked. Back to the top, where a
            // stray wake-up restarts the tick rather than end it early.
            () = wake.notified() => continue,
        }
        if shared.tick(link, &mut wakers) {
            // Woken by the next call, or by `close`.
            wake.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Estimate;

    fn frame(response: &Response) -> Vec<u8> {
        let mut frame = Vec::new();
        wire::encode_frame(response, &mut frame);
        frame
    }

    fn response(id: u64) -> Response {
        Response {
            id,
            result: Ok(Reply::Estimate(Estimate {
                estimate: 1,
                window: 2,
                staleness_ms: 3,
            })),
        }
    }

    #[test]
    fn whole_frames_are_decoded_and_a_partial_one_is_left() {
        let mut input = frame(&response(1));
        input.extend(frame(&response(2)));
        let whole = input.len();
        input.extend(&frame(&response(3))[..5]);
        let mut responses = Vec::new();
        let (decoded, broken) = decode_responses(&input, |decoded| responses.push(decoded));
        assert!(broken.is_none());
        assert_eq!(decoded, whole);
        assert_eq!(
            responses,
            [
                Decoded::Response(response(1)),
                Decoded::Response(response(2))
            ]
        );
    }

    /// A closed link's sweeper can come to wait on its wake-up only after `close` sent it,
    /// when it was preempted between parking and waiting. The next link's calls must still
    /// wake the next link's sweeper, or none of them would time out.
    #[tokio::test]
    async fn a_closed_links_sweeper_waiting_late_takes_no_wake_up_meant_for_the_next_link() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = Endpoint::Tcp(listener.local_addr().unwrap());
        let timeout = Duration::from_millis(100);
        let connection = Connection::open(&endpoint, timeout).await.unwrap();
        let (first, _) = listener.accept().await.unwrap();
        let first_links_wake_up = Arc::clone(&connection.shared.lock().wake_sweeper);
        drop(first);
        while !connection.is_closed() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        connection.reopen(&endpoint).await.unwrap();
        // Accepted and never answered.
        let (_second, _) = listener.accept().await.unwrap();
        let late_sweeper = tokio::spawn(async move { first_links_wake_up.notified().await });
        while !connection.shared.lock().sweeper_parked {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let call = connection.call(OpRef::Get {
            rule: "login",
            subject: "user-42",
        });
        let outcome = tokio::time::timeout(Duration::from_secs(5), call).await;
        assert!(
            matches!(outcome, Ok(Err(Error::Timeout { after })) if after == timeout),
            "{outcome:?}"
        );
        late_sweeper.abort();
    }

    /// A connection (answers waited for up to a minute) to a sidecar that accepted it and
    /// never reads: the socket's buffers fill, then the outbox.
    async fn a_sidecar_that_never_reads(
        timeout: Duration,
    ) -> (Arc<Connection>, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = Endpoint::Tcp(listener.local_addr().unwrap());
        let connection = Connection::open(&endpoint, timeout).await.unwrap();
        let (sidecar, _) = listener.accept().await.unwrap();
        (Arc::new(connection), sidecar)
    }

    /// A task that sends an increment of a subject as long as a frame allows, its outcome
    /// dropped: a few hundred fill a socket nobody reads.
    fn spawn_a_large_incr(connection: &Arc<Connection>) -> tokio::task::JoinHandle<()> {
        let connection = Arc::clone(connection);
        tokio::spawn(async move {
            let subject = "s".repeat(CLIENT_FRAME_BYTES_MAX - 100);
            let _ = (connection.call(OpRef::Incr {
                rule: "r",
                subject: &subject,
                amount: 1,
                id: None,
            }))
            .await;
        })
    }

    /// Two tasks whose calls wait for room, each polled again and again by turns (a
    /// `select!` loop with another busy branch): each is listed once, not once a poll
    /// (found in review: only the last listed waker was compared, so the list grew by one
    /// a poll until the next tick).
    #[tokio::test]
    async fn tasks_polled_by_turns_while_they_wait_for_room_are_listed_once_each() {
        let (connection, _sidecar) = a_sidecar_that_never_reads(Duration::from_secs(60)).await;
        for _ in 0..200 {
            spawn_a_large_incr(&connection);
            tokio::task::yield_now().await;
        }
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
        assert!(!connection.shared.lock().has_room(), "the outbox is full");
        let round = connection.shared.lock().room_round;
        let pollers: Vec<_> = (0..2)
            .map(|_| {
                let connection = Arc::clone(&connection);
                tokio::spawn(async move {
                    let call = connection.call(OpRef::Get {
                        rule: "r",
                        subject: "s",
                    });
                    tokio::pin!(call);
                    for _ in 0..1_000 {
                        tokio::select! {
                            biased;
                            _ = &mut call => panic!("answered with the outbox full"),
                            () = tokio::task::yield_now() => {}
                        }
                    }
                })
            })
            .collect();
        for poller in pollers {
            poller.await.unwrap();
        }
        let state = connection.shared.lock();
        assert_eq!(state.room_round, round, "no tick or room came between");
        // The 200 filling calls that found no room, and the two tasks.
        assert!(
            state.room.len() <= 202,
            "{} wakers listed for 202 tasks",
            state.room.len()
        );
    }

    /// Requests still in the client's outbox when the link closes were never handed to the
    /// socket: the sidecar cannot have read them, so their calls are told `NotSent` (nothing
    /// was counted, safe to send again), not `Disconnected` ("may have been applied").
    #[tokio::test]
    async fn requests_still_in_the_outbox_when_the_link_closes_fail_not_sent() {
        const CALLS: usize = 200;
        let (connection, sidecar) = a_sidecar_that_never_reads(Duration::from_secs(60)).await;
        let subject = "s".repeat(CLIENT_FRAME_BYTES_MAX - 100);
        let calls: Vec<_> = (0..CALLS)
            .map(|_| {
                let connection = Arc::clone(&connection);
                let subject = subject.clone();
                tokio::spawn(async move {
                    connection
                        .call(OpRef::Incr {
                            rule: "r",
                            subject: &subject,
                            amount: 1,
                            id: None,
                        })
                        .await
                })
            })
            .collect();
        for _ in 0..200 {
            tokio::task::yield_now().await;
        }
        // Wait for the writer to be stuck on a full socket, with requests behind it.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (in_outbox, sent_or_queued) = {
            let state = connection.shared.lock();
            let frames = wire::frames_begun(&state.queued, state.queued.len());
            (frames as usize, state.in_flight.live())
        };
        assert!(in_outbox > 0, "the outbox holds requests never written");
        drop(sidecar);
        let mut not_sent = 0;
        for call in calls {
            match call.await.unwrap() {
                Err(Error::NotSent { .. }) => not_sent += 1,
                Err(Error::Disconnected) => {}
                other => panic!("{other:?}"),
            }
        }
        // Those that waited for room, and those whose requests were still in the outbox.
        let never_sent = CALLS - sent_or_queued + in_outbox;
        // Exactly those: a request handed to the socket may have been read.
        assert_eq!(
            not_sent, never_sent,
            "calls told NotSent, and calls never written ({in_outbox} in the outbox)"
        );
    }

    /// Dropping the handle while the writer waits on a socket the sidecar does not read
    /// (no call can be waiting then: calls borrow the handle) closes the link within the
    /// calls' timeout: its tasks end and its socket is dropped. Found in review, session 53:
    /// the writer, busy, was not told, and waited for room forever, with the reader, the
    /// sweeper and the socket.
    #[tokio::test]
    async fn dropping_the_handle_while_the_writer_waits_on_a_full_socket_closes_the_link() {
        let (connection, _sidecar) = a_sidecar_that_never_reads(Duration::from_millis(200)).await;
        let calls: Vec<_> = (0..200).map(|_| spawn_a_large_incr(&connection)).collect();
        for call in calls {
            call.await.unwrap();
        }
        let shared = Arc::clone(&connection.shared);
        {
            let state = shared.lock();
            assert!(state.closed.is_none(), "the link is open");
            assert!(
                state.write_half.is_none() && state.writer.is_none(),
                "the writer waits on the full socket"
            );
        }
        drop(connection);
        let gone = tokio::time::timeout(Duration::from_secs(5), async {
            while Arc::strong_count(&shared) > 1 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            gone.is_ok(),
            "the link's tasks outlived the handle (link open: {})",
            shared.lock().closed.is_none()
        );
        assert!(shared.lock().closed.is_some(), "the link is closed");
    }

    /// Dropping the handle while the writer is busy on a sidecar that does read: the writer
    /// writes what is queued and closes the link, and nothing keeps the connection's shared
    /// state after that, though the calls' timeout (a minute) has not passed. Found in
    /// review, session 53: the task that closes a link still busy after the timeout held it
    /// for the whole timeout, whether or not the link had closed long before.
    #[tokio::test]
    async fn dropping_the_handle_while_the_writer_is_busy_keeps_nothing_once_the_link_closes() {
        use tokio::io::AsyncReadExt;
        let (connection, mut sidecar) = a_sidecar_that_never_reads(Duration::from_secs(60)).await;
        let calls: Vec<_> = (0..200).map(|_| spawn_a_large_incr(&connection)).collect();
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
        // The calls go (their requests stay queued or in the writer's batch).
        for call in calls {
            call.abort();
            let _ = call.await;
        }
        let shared = Arc::clone(&connection.shared);
        {
            let state = shared.lock();
            assert!(state.closed.is_none(), "the link is open");
            assert!(state.writer.is_none(), "the writer is busy");
        }
        drop(connection);
        // The sidecar reads everything now, until the link closes.
        let reader = tokio::spawn(async move {
            let mut sink = vec![0; 1 << 16];
            while sidecar.read(&mut sink).await.is_ok_and(|read| read > 0) {}
        });
        let gone = tokio::time::timeout(Duration::from_secs(5), async {
            while Arc::strong_count(&shared) > 1 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(shared.lock().closed.is_some(), "the link is closed");
        assert!(
            gone.is_ok(),
            "the shared state is held {} times more, with the link closed",
            Arc::strong_count(&shared) - 1
        );
        reader.await.unwrap();
    }

    /// A call alone in flight writes its request itself. When that write fails, no byte of
    /// the request reached the socket (a write that fails writes nothing), so the sidecar
    /// cannot have read it: the call is told `NotSent`, not `Disconnected`. Found in review,
    /// session 53: the request was left to the writer, whose batch counts as written.
    #[cfg(unix)]
    #[tokio::test]
    async fn a_request_whose_direct_write_fails_is_not_sent() {
        let path = std::env::temp_dir().join(format!(
            "tally-client-direct-write-{}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let endpoint = Endpoint::Unix(path.clone());
        let connection = Connection::open(&endpoint, Duration::from_secs(60))
            .await
            .unwrap();
        let (sidecar, _) = listener.accept().await.unwrap();
        // The link's tasks are parked on the socket.
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The sidecar goes away; the reader has not run since, so the link is still open,
        // and the call's write is what finds the socket broken.
        drop(sidecar);
        let call = connection.call(OpRef::Incr {
            rule: "login",
            subject: "user-42",
            amount: 1,
            id: None,
        });
        tokio::pin!(call);
        assert!(
            poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx).is_pending())).await,
            "sent, and waiting for its answer"
        );
        assert_eq!(
            connection.shared.lock().unwritten,
            1,
            "the socket took no byte of the request"
        );
        let outcome = tokio::time::timeout(Duration::from_secs(5), call).await;
        let _ = std::fs::remove_file(&path);
        assert!(
            matches!(outcome, Ok(Err(Error::NotSent { .. }))),
            "{outcome:?}"
        );
    }

    #[tokio::test]
    async fn a_call_that_waited_for_room_past_its_timeout_is_not_sent_once_room_comes() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = Endpoint::Tcp(listener.local_addr().unwrap());
        let connection = Connection::open(&endpoint, Duration::from_millis(100))
            .await
            .unwrap();
        let (_sidecar, _) = listener.accept().await.unwrap();
        let ops = [OpRef::Get {
            rule: "login",
            subject: "user-42",
        }];
        // A call that began to wait for room at this epoch, and ticks enough to time it out
        // since, as if the outbox had been full all along. There is room now.
        let shared = &connection.shared;
        let since = shared.lock().epoch;
        while !shared.deadlines.expired(since, shared.lock().epoch) {
            shared.lock().epoch += 1;
        }
        assert!(shared.lock().has_room());
        let mut wait = Wait {
            since: Some(since),
            listed: None,
        };
        let sent = shared.send(&ops, &mut wait, Waker::noop());
        assert!(
            matches!(sent, Sent::Failed(Error::NotSent { .. })),
            "sent, to end in a Timeout that says it may have counted"
        );
        assert!(shared.lock().queued.is_empty());
    }

    #[test]
    fn an_answer_whose_id_reads_but_whose_body_does_not_fails_its_call_alone() {
        // Version, id 7, `Ok`, then a reply variant this build does not know.
        let body = [wire::CLIENT_WIRE_VERSION, 7, 0, 9];
        let mut input = (body.len() as u32).to_le_bytes().to_vec();
        input.extend(body);
        input.extend(frame(&response(8)));
        let mut decoded = Vec::new();
        let (taken, broken) = decode_responses(&input, |frame| decoded.push(frame));
        assert!(broken.is_none(), "{broken:?}");
        assert_eq!(taken, input.len());
        assert!(
            matches!(&decoded[..], [Decoded::Undecodable { id: 7, why }, Decoded::Response(eight)]
                if why.contains("does not decode") && *eight == response(8)),
            "{decoded:?}"
        );
        // Of another version, or with id 0, no call can be told: the stream is broken.
        for body in [[2, 7, 0, 9], [wire::CLIENT_WIRE_VERSION, 0, 0, 9]] {
            let mut input = (body.len() as u32).to_le_bytes().to_vec();
            input.extend(body);
            let (taken, broken) = decode_responses(&input, |_| {});
            assert_eq!(taken, 0);
            assert!(matches!(broken, Some(Broken::Protocol(_))), "{broken:?}");
        }
    }

    #[test]
    fn a_sidecars_long_reason_for_refusing_a_frame_is_cut_before_every_call_gets_a_copy() {
        let refused = |why: String| Response {
            id: 0,
            result: Err(Refusal::Malformed { why }),
        };
        let long = "\u{e9}".repeat(30_000);
        let (taken, broken) = decode_responses(&frame(&refused(long)), |_| {});
        assert!(taken > 60_000);
        let Some(Broken::Protocol(why)) = broken else {
            panic!("{broken:?}");
        };
        assert!(why.starts_with("the sidecar refused this client's frame: \u{e9}"));
        assert!(why.len() <= 100 + REASON_BYTES_MAX, "{} bytes", why.len());
        let (_, broken) = decode_responses(&frame(&refused("unknown op 9".into())), |_| {});
        assert!(
            matches!(&broken, Some(Broken::Protocol(why)) if why.ends_with(": unknown op 9")),
            "{broken:?}"
        );
    }

    #[test]
    fn frames_before_a_bad_one_are_decoded_and_the_bad_one_breaks_the_stream() {
        let mut input = frame(&response(1));
        let good = input.len();
        input.extend([0xff, 0xff, 0xff, 0xff]);
        let mut responses = Vec::new();
        let (decoded, broken) = decode_responses(&input, |decoded| responses.push(decoded));
        assert_eq!(decoded, good);
        assert_eq!(responses, [Decoded::Response(response(1))]);
        assert!(matches!(broken, Some(Broken::Protocol(why)) if why.contains("over the")));
    }
}
