//! One multiplexed connection to a sidecar.
//!
//! Two tasks drive it. The writer takes requests from a bounded queue and writes every
//! request queued at that moment in one write, which is what makes pipelining cheap. The
//! reader decodes responses and hands each to the request waiting on its id, in whatever
//! order they come. When either side fails, the connection closes: every waiting request
//! is told why, both tasks stop, and the socket is dropped.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};

use crate::endpoint::Endpoint;
use crate::error::Error;
use crate::wire::{self, Refusal, Reply, Request, Response};

/// Requests queued for the writer before callers wait for room.
const QUEUE_REQUESTS_MAX: usize = 1024;

/// The writer stops adding queued requests to one write past this many bytes.
const BATCH_BYTES_MAX: usize = 64 * 1024;

/// The reader's buffer: many small responses come in one read.
const READ_BUFFER_BYTES: usize = 64 * 1024;

/// What a waiting request is told: the sidecar's answer, or why there will be none.
type Answer = Result<Result<Reply, Refusal>, Broken>;

/// Why a connection closed.
#[derive(Debug, Clone)]
enum Broken {
    /// A read or write failed, or the sidecar closed the stream.
    Disconnected,
    /// The sidecar sent a frame that does not decode.
    Protocol(String),
}

impl From<Broken> for Error {
    fn from(broken: Broken) -> Self {
        match broken {
            Broken::Disconnected => Error::Disconnected,
            Broken::Protocol(why) => Error::Protocol(why),
        }
    }
}

/// A handle on one connection's tasks. Dropping the last handle closes the connection once
/// the queued requests are written.
pub(crate) struct Connection {
    requests: mpsc::Sender<Request>,
    shared: Arc<Shared>,
}

impl Connection {
    /// Connects to `endpoint` and spawns the connection's tasks on the current runtime.
    pub(crate) async fn open(endpoint: &Endpoint) -> Result<Connection, Error> {
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
                let (read, write) = stream.into_split();
                Ok(Connection::spawn(read, write))
            }
            #[cfg(unix)]
            Endpoint::Unix(path) => {
                let stream = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(connect_error)?;
                let (read, write) = stream.into_split();
                Ok(Connection::spawn(read, write))
            }
            #[cfg(not(unix))]
            Endpoint::Unix(_) => Err(connect_error(io::Error::new(
                io::ErrorKind::Unsupported,
                "unix sockets are not available on this platform",
            ))),
        }
    }

    fn spawn<R, W>(read: R, write: W) -> Connection
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (requests, queue) = mpsc::channel(QUEUE_REQUESTS_MAX);
        let (shutdown, stopped) = watch::channel(false);
        let shared = Arc::new(Shared {
            pending: Mutex::new(Some(HashMap::new())),
            shutdown,
        });
        tokio::spawn(write_requests(
            write,
            queue,
            Arc::clone(&shared),
            stopped.clone(),
        ));
        tokio::spawn(read_responses(read, Arc::clone(&shared), stopped));
        Connection { requests, shared }
    }

    /// Whether the connection has closed; a closed connection takes no more requests.
    pub(crate) fn is_closed(&self) -> bool {
        self.shared.pending().is_none()
    }

    /// Sends `request` and waits for its answer.
    ///
    /// Dropping the future (a timeout, a cancelled caller) forgets the request, so a late
    /// answer finds no one waiting and is dropped.
    pub(crate) async fn call(&self, request: Request) -> Result<Result<Reply, Refusal>, Error> {
        let (answer, answered) = oneshot::channel();
        let mut waiting = self.shared.wait_for(request.id, answer)?;
        self.requests
            .send(request)
            .await
            .map_err(|_| Error::Disconnected)?;
        let answer = answered.await;
        // Whoever answered (the reader or `close`) took the entry out of the map first, so
        // there is nothing left to forget.
        waiting.answered = true;
        match answer {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(broken)) => Err(broken.into()),
            // The sender is dropped unsent only with `Shared`, which `waiting` keeps alive;
            // were it to happen, the connection would be as good as closed.
            Err(_) => Err(Error::Disconnected),
        }
    }
}

/// What the client handle and both tasks share.
struct Shared {
    /// The requests waiting for an answer, by id.
    ///
    /// Invariant: `None` once the connection has closed, and never `Some` again; a request
    /// is either in the map when it closes (and told why) or refused before it is sent.
    pending: Mutex<Option<HashMap<u64, oneshot::Sender<Answer>>>>,
    /// Set to `true` once, on close, to stop both tasks.
    shutdown: watch::Sender<bool>,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, Option<HashMap<u64, oneshot::Sender<Answer>>>> {
        // The map is left consistent at every step (no code under the lock panics), so a
        // poisoned lock still holds a usable map.
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a request as waiting for `id`, or refuses it if the connection has closed.
    fn wait_for(
        self: &Arc<Self>,
        id: u64,
        answer: oneshot::Sender<Answer>,
    ) -> Result<Waiting, Error> {
        let mut pending = self.pending();
        let map = pending.as_mut().ok_or(Error::Disconnected)?;
        let earlier = map.insert(id, answer);
        assert!(
            earlier.is_none(),
            "request id {id} is already in flight: ids come from a counter that never repeats"
        );
        Ok(Waiting {
            shared: Arc::clone(self),
            id,
            answered: false,
        })
    }

    /// Hands `response` to the request waiting on its id; drops it if none is (the request
    /// timed out or its caller went away).
    fn deliver(&self, response: Response) {
        let waiting = self
            .pending()
            .as_mut()
            .and_then(|map| map.remove(&response.id));
        if let Some(answer) = waiting {
            // The receiver is gone only if its caller stopped waiting after we took the
            // entry; the answer is then dropped, like any late answer.
            let _ = answer.send(Ok(response.result));
        }
    }

    /// Closes the connection: tells every waiting request why and stops both tasks. Only
    /// the first close counts.
    fn close(&self, broken: Broken) {
        let Some(waiting) = self.pending().take() else {
            return;
        };
        for answer in waiting.into_values() {
            let _ = answer.send(Err(broken.clone()));
        }
        self.shutdown.send_replace(true);
    }
}

/// A request's entry in the pending map, removed when the caller stops waiting.
struct Waiting {
    shared: Arc<Shared>,
    id: u64,
    /// The entry was removed by whoever answered.
    answered: bool,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if !self.answered {
            if let Some(map) = self.shared.pending().as_mut() {
                map.remove(&self.id);
            }
        }
    }
}

/// The writer task: writes queued requests, as many as are queued in one write.
async fn write_requests<W: AsyncWrite + Unpin>(
    mut write: W,
    mut queue: mpsc::Receiver<Request>,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut batch = Vec::with_capacity(BATCH_BYTES_MAX);
    loop {
        let first = tokio::select! {
            biased;
            _ = stopped.wait_for(|stop| *stop) => return,
            request = queue.recv() => request,
        };
        // Every handle is gone: no request can come, so the connection is done.
        let Some(first) = first else {
            shared.close(Broken::Disconnected);
            return;
        };
        batch.clear();
        wire::encode_frame(&first, &mut batch);
        while batch.len() < BATCH_BYTES_MAX {
            let Ok(request) = queue.try_recv() else {
                break;
            };
            wire::encode_frame(&request, &mut batch);
        }
        let written = tokio::select! {
            biased;
            _ = stopped.wait_for(|stop| *stop) => return,
            written = write.write_all(&batch) => written,
        };
        if written.is_err() {
            shared.close(Broken::Disconnected);
            return;
        }
    }
}

/// The reader task: reads responses until the stream fails or the connection closes.
async fn read_responses<R: AsyncRead + Unpin>(
    read: R,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut read = BufReader::with_capacity(READ_BUFFER_BYTES, read);
    let broken = tokio::select! {
        biased;
        _ = stopped.wait_for(|stop| *stop) => return,
        broken = deliver_responses(&mut read, &shared) => broken,
    };
    shared.close(broken);
}

/// Reads and delivers responses; returns why it stopped.
async fn deliver_responses<R: AsyncRead + Unpin>(read: &mut R, shared: &Shared) -> Broken {
    let mut body = Vec::new();
    loop {
        let mut prefix = [0; 4];
        if read.read_exact(&mut prefix).await.is_err() {
            return Broken::Disconnected;
        }
        let len = match wire::frame_len(prefix) {
            Ok(len) => len,
            Err(err) => return Broken::Protocol(err.to_string()),
        };
        body.resize(len, 0);
        if read.read_exact(&mut body).await.is_err() {
            return Broken::Disconnected;
        }
        match wire::decode_body::<Response>(&body) {
            Ok(response) => shared.deliver(response),
            Err(err) => return Broken::Protocol(err.to_string()),
        }
    }
}
