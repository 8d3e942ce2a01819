//! The client handle and its options.

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use crate::connection::Connection;
use crate::endpoint::Endpoint;
use crate::error::Error;
use crate::pipeline::Pipeline;
use crate::wire::{
    CheckId, Decision, Estimate, OpRef, Refusal, Reply, Status, CLIENT_FRAME_BYTES_MAX,
};

/// How long a client waits.
///
/// Build it from [`Options::default`] and the `with_` methods:
///
/// ```
/// use std::time::Duration;
/// use tally_client::Options;
///
/// let options = Options::default().with_timeout(Duration::from_millis(50));
/// assert_eq!(options.connect_timeout, Duration::from_secs(1));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// How long one request waits for its answer once a connection is up. Default 1 s.
    ///
    /// A request without an answer fails with [`Error::Timeout`] no sooner than this, and
    /// later by about an eighth of it, plus up to a millisecond for each of the nine or so
    /// ticks it waits (Tokio's timer rounds a sleep up to a whole millisecond): rather
    /// than one timer per request, one timer per connection looks at the requests in
    /// flight every eighth of `timeout`. With a 50 ms timeout a request fails after 50 to
    /// about 70 ms (65 to 71 ms measured over 30 calls on a loaded 2-core machine, whose
    /// timers ran late).
    ///
    /// That timer, and the reader of answers, run on the runtime the client connected on:
    /// a call made from another runtime while that one is alive but not running (a
    /// current-thread runtime outside its `block_on`) may be sent and then get neither its
    /// answer nor `Timeout` until that runtime runs again. Connect on the runtime that
    /// keeps running (found in review, session 46).
    pub timeout: Duration,
    /// How long connecting (or reconnecting) may take. Default 1 s.
    pub connect_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
        }
    }
}

impl Options {
    /// These options with a per-request timeout of `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with a connect timeout of `connect_timeout`.
    pub fn with_connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }
}

/// A handle on one connection to a sidecar. Cloning is cheap; clones share the connection.
///
/// Requests from every clone are pipelined on the one connection: many may be in flight,
/// and answers are matched to requests by id in whatever order they come. The connection's
/// tasks run on the Tokio runtime that called [`Client::connect`] (a current-thread runtime
/// works, while something drives it), after a reconnect too, whichever runtime the call
/// that reconnects runs on; calls may come from any runtime. When the connection breaks,
/// the requests in flight fail with [`Error::Disconnected`] (or [`Error::Protocol`] after
/// a frame either way that does not decode as far as its request id; an answer that
/// decodes only that far fails its own call alone; one still in the client's outbox, never
/// written, with [`Error::NotSent`]) and the next request reconnects; once
/// the connecting runtime is shut down, every call fails with [`Error::RuntimeStopped`].
///
/// Dropping a call's future (a `select!` that takes another branch, a cancelled task)
/// stops the wait, not the request: one already queued is still sent, and may count. Its
/// answer is dropped.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    endpoint: Endpoint,
    options: Options,
    /// The connection requests go to; it opens a new socket when the last has closed.
    connection: Connection,
    /// Held while reconnecting, so that callers who find the connection closed at the same
    /// moment make one new connection, not one each, when it succeeds; after a failed
    /// attempt, each caller waiting makes its own in turn, within its own connect timeout.
    reconnecting: tokio::sync::Mutex<()>,
}

impl Client {
    /// Connects to the sidecar at `endpoint`, within `options.connect_timeout`.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime, or on one built without its timers (`enable_time`, or
    /// `enable_all`): the connect's and the requests' timeouts need them.
    pub async fn connect(endpoint: Endpoint, options: Options) -> Result<Client, Error> {
        let connection = open(&endpoint, options).await?;
        Ok(Client {
            inner: Arc::new(Inner {
                endpoint,
                options,
                connection,
                reconnecting: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// The endpoint this client connects to.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    /// The options this client was made with.
    pub fn options(&self) -> Options {
        self.inner.options
    }

    /// Adds `amount` to `subject`'s count under `rule` and returns the count after it.
    ///
    /// After an error the count is unchanged only for [`Error::Refused`], [`Error::Connect`],
    /// [`Error::NotSent`] and [`Error::RuntimeStopped`]. After [`Error::Timeout`] or
    /// [`Error::Disconnected`] the outcome is unknown: the increment may have been applied,
    /// and retrying it may count twice; for an increment that must be retried, see
    /// [`Client::incr_with_id`].
    pub async fn incr(&self, rule: &str, subject: &str, amount: u64) -> Result<Estimate, Error> {
        self.count(true, rule, subject, amount, None).await
    }

    /// [`Client::incr`] under `id`, so that it may be retried: the sidecar counts every
    /// send of one id once, and answers each with the count after the first, while it
    /// remembers the id (its most recent 65,536 ids, each until one window length after
    /// its window ends). An id it no longer remembers is counted again, and so is one sent
    /// to another sidecar, or after this one restarted without a data directory (with one,
    /// it logs what it answered under ids there, after the writes, and its next life
    /// remembers them). An id that named another request there (a check, a decrement, or
    /// an increment of another rule, subject or amount) is refused: make one id per
    /// increment ([`CheckId::new`]) and send it again only with the same arguments.
    pub async fn incr_with_id(
        &self,
        id: CheckId,
        rule: &str,
        subject: &str,
        amount: u64,
    ) -> Result<Estimate, Error> {
        self.count(true, rule, subject, amount, Some(id)).await
    }

    /// Subtracts `amount` from `subject`'s count under `rule` (a release, as when a request
    /// under a concurrency limit finishes) and returns the count after it.
    ///
    /// As with [`Client::incr`], after [`Error::Timeout`] or [`Error::Disconnected`] the
    /// decrement may have been applied, and retrying it may subtract twice; see
    /// [`Client::decr_with_id`].
    pub async fn decr(&self, rule: &str, subject: &str, amount: u64) -> Result<Estimate, Error> {
        self.count(false, rule, subject, amount, None).await
    }

    /// [`Client::decr`] under `id`, counted once across its retries as
    /// [`Client::incr_with_id`] is.
    pub async fn decr_with_id(
        &self,
        id: CheckId,
        rule: &str,
        subject: &str,
        amount: u64,
    ) -> Result<Estimate, Error> {
        self.count(false, rule, subject, amount, Some(id)).await
    }

    async fn count(
        &self,
        incr: bool,
        rule: &str,
        subject: &str,
        amount: u64,
        id: Option<CheckId>,
    ) -> Result<Estimate, Error> {
        let (op, name) = if incr {
            let op = OpRef::Incr {
                rule,
                subject,
                amount,
                id,
            };
            (op, "incr")
        } else {
            let op = OpRef::Decr {
                rule,
                subject,
                amount,
                id,
            };
            (op, "decr")
        };
        match self.call(op).await? {
            Reply::Counted(estimate) => Ok(estimate),
            other => Err(wrong_reply(name, "Counted", &other)),
        }
    }

    /// `subject`'s count under `rule` in the rule's current window, with its staleness.
    /// Changes nothing.
    pub async fn get(&self, rule: &str, subject: &str) -> Result<Estimate, Error> {
        let op = OpRef::Get { rule, subject };
        match self.call(op).await? {
            Reply::Estimate(estimate) => Ok(estimate),
            other => Err(wrong_reply("get", "Estimate", &other)),
        }
    }

    /// Decides whether `cost` more is allowed for `subject` under `rule`, and counts it if
    /// so ([`Decision::allowed`]).
    ///
    /// As with [`Client::incr`], after [`Error::Timeout`] or [`Error::Disconnected`] the
    /// cost may have been counted, and retrying may count it twice; for a check that must
    /// be retried, see [`Client::check_with_id`].
    pub async fn check(&self, rule: &str, subject: &str, cost: u64) -> Result<Decision, Error> {
        self.decide(rule, subject, cost, None).await
    }

    /// [`Client::check`] under `id`, so that it may be retried: a rule that is exact
    /// counts every send of one id once, and answers each with the first outcome, across
    /// edges and edge and region restarts, while the region remembers the id: until one
    /// window length after the first check's window ends, and among the session's most
    /// recent ids. An id older than those is refused with [`Refusal::Forgotten`], never
    /// decided again; a send after the first check's window is over and forgotten is a new
    /// check in its own window.
    ///
    /// Make the id once per check ([`CheckId::new`]) and pass the same one, with the same
    /// rule, subject and cost, to every retry, after an error that
    /// [`Error::is_retryable`]: a sidecar that remembers the id refuses it with other
    /// arguments ([`Refusal::BadField`], `id`). An approximate rule is decided at the
    /// sidecar, which counts one id once in the same way while it remembers it (its most
    /// recent 65,536 ids; an older one is decided again), across its own restarts if it
    /// has a data directory, but not through another sidecar. The sidecar also remembers
    /// an exact check's
    /// decision, the region's or one its rule's `on_region_unavailable` fallback counted,
    /// and answers a retry with it without asking the region: a retry of a fallback's
    /// decision gets that decision ([`Mode::RegionFallback`](crate::Mode::RegionFallback)) again, even once the region
    /// is back, and counts nothing more.
    pub async fn check_with_id(
        &self,
        id: CheckId,
        rule: &str,
        subject: &str,
        cost: u64,
    ) -> Result<Decision, Error> {
        self.decide(rule, subject, cost, Some(id)).await
    }

    async fn decide(
        &self,
        rule: &str,
        subject: &str,
        cost: u64,
        id: Option<CheckId>,
    ) -> Result<Decision, Error> {
        let op = OpRef::Check {
            rule,
            subject,
            cost,
            id,
        };
        match self.call(op).await? {
            Reply::Decision(decision) => Ok(decision),
            other => Err(wrong_reply("check", "Decision", &other)),
        }
    }

    /// The sidecar's view of itself: its node id, generation, members and keys.
    pub async fn status(&self) -> Result<Status, Error> {
        match self.call(OpRef::Status).await? {
            Reply::Status(status) => Ok(status),
            other => Err(wrong_reply("status", "Status", &other)),
        }
    }

    /// Sends every request of `pipeline` together and returns each one's result, in order.
    ///
    /// Each result is what the request's own call would return: `Reply::Counted` for an
    /// `incr` or a `decr`, `Reply::Estimate` for a `get`, `Reply::Decision` for a `check`,
    /// or its error (each request is timed out on its own). The outer `Err` means nothing
    /// was sent: no connection ([`Error::Connect`]), a connection that closed before the
    /// pipeline was queued or no room in the outbox within the timeout
    /// ([`Error::NotSent`]), or a request, or the whole pipeline, too large to send
    /// ([`Refusal::BadField`] naming `rule`, `subject` or `pipeline`). An empty pipeline
    /// sends nothing and returns no results.
    pub async fn send(&self, pipeline: &Pipeline<'_>) -> Result<Vec<Result<Reply, Error>>, Error> {
        let ops = pipeline.ops();
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        check_pipeline_size(ops)?;
        self.reconnect_if_closed().await?;
        let mut results = self.inner.connection.pipeline(ops).await?;
        for (op, result) in ops.iter().zip(&mut results) {
            if let Ok(reply) = result {
                if let Some(wrong) = wrong_kind(op, reply) {
                    *result = Err(wrong);
                }
            }
        }
        Ok(results)
    }

    /// Sends one request (reconnecting first if the connection has closed) and waits at
    /// most `options.timeout` for the answer.
    async fn call(&self, op: OpRef<'_>) -> Result<Reply, Error> {
        check_frame_size(&op)?;
        self.reconnect_if_closed().await?;
        // The connection times the call out (`Options::timeout`, given when it opened).
        self.inner.connection.call(op).await
    }

    async fn reconnect_if_closed(&self) -> Result<(), Error> {
        if self.inner.connection.is_closed() {
            // Boxed: reconnecting (its timer, its turn and the connect) takes several times
            // the room of the call itself, and every caller's future would carry that room,
            // touched or not, on every call.
            Box::pin(self.reconnect()).await?;
        }
        Ok(())
    }

    /// Reopens the closed connection: one attempt, within `options.connect_timeout`
    /// including the wait for another caller's attempt. The attempt and its timer run on
    /// the connection's runtime: the caller's may have no timer, or not be Tokio's.
    async fn reconnect(&self) -> Result<(), Error> {
        let inner = Arc::clone(&self.inner);
        let reconnect = async move {
            let connect_timeout = inner.options.connect_timeout;
            let attempt = async {
                let _turn = inner.reconnecting.lock().await;
                // Another caller may have reconnected while this one waited its turn.
                if !inner.connection.is_closed() {
                    return Ok(());
                }
                inner.connection.reopen(&inner.endpoint).await
            };
            match tokio::time::timeout(connect_timeout, attempt).await {
                Ok(reconnected) => reconnected,
                Err(_elapsed) => Err(connect_timed_out(&inner.endpoint, connect_timeout)),
            }
        };
        self.inner.connection.on_its_runtime(reconnect).await
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("endpoint", &self.inner.endpoint)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

/// The most bytes a request's body takes beside its rule and subject: the version byte and
/// the op's tag (one each), the varints of the id, the two name lengths and the amount (at
/// most 9 bytes each), and a check id's tag and two varints: 57, rounded up.
const REQUEST_OVERHEAD_BYTES_MAX: usize = 64;

/// Refuses a request whose frame would be over the limit the sidecar accepts, before it is
/// sent: the sidecar could only drop the connection, failing every request in flight on it.
fn check_frame_size(op: &OpRef<'_>) -> Result<(), Error> {
    let Some((rule, subject)) = op.names() else {
        return Ok(());
    };
    let names_bytes_max = CLIENT_FRAME_BYTES_MAX - REQUEST_OVERHEAD_BYTES_MAX;
    let names_bytes = rule.len() + subject.len();
    if names_bytes <= names_bytes_max {
        return Ok(());
    }
    let field = if rule.len() > subject.len() {
        "rule"
    } else {
        "subject"
    };
    Err(Error::Refused(Refusal::BadField {
        field: field.to_string(),
        why: format!(
            "rule and subject take {names_bytes} bytes, over the {names_bytes_max} bytes \
             one request may carry; nothing was sent"
        ),
    }))
}

/// The most bytes of requests one pipeline may carry, counting each request as its rule,
/// its subject and [`REQUEST_OVERHEAD_BYTES_MAX`]: what the connection queues before calls
/// wait for room. A pipeline is queued whole once there is room, so the outbox holds at
/// most about twice that.
const PIPELINE_BYTES_MAX: usize = 1024 * 1024;

/// Refuses a pipeline with a request too large for a frame, or too large as a whole, before
/// anything is sent.
fn check_pipeline_size(ops: &[OpRef<'_>]) -> Result<(), Error> {
    ops.iter().try_for_each(check_frame_size)?;
    let bytes: usize = ops
        .iter()
        .map(|op| {
            let names = op
                .names()
                .map_or(0, |(rule, subject)| rule.len() + subject.len());
            names + REQUEST_OVERHEAD_BYTES_MAX
        })
        .sum();
    if bytes <= PIPELINE_BYTES_MAX {
        return Ok(());
    }
    Err(Error::Refused(Refusal::BadField {
        field: "pipeline".to_string(),
        why: format!(
            "{} requests take up to {bytes} bytes, over the {PIPELINE_BYTES_MAX} bytes one \
             pipeline may carry; nothing was sent",
            ops.len()
        ),
    }))
}

/// A protocol error if `reply` is not the kind `op` is answered with.
fn wrong_kind(op: &OpRef<'_>, reply: &Reply) -> Option<Error> {
    let (name, expected) = match (op, reply) {
        (OpRef::Incr { .. } | OpRef::Decr { .. }, Reply::Counted(_))
        | (OpRef::Get { .. }, Reply::Estimate(_))
        | (OpRef::Check { .. }, Reply::Decision(_))
        | (OpRef::Status, Reply::Status(_)) => return None,
        (OpRef::Incr { .. }, _) => ("incr", "Counted"),
        (OpRef::Decr { .. }, _) => ("decr", "Counted"),
        (OpRef::Get { .. }, _) => ("get", "Estimate"),
        (OpRef::Check { .. }, _) => ("check", "Decision"),
        (OpRef::Status, _) => ("status", "Status"),
    };
    Some(wrong_reply(name, expected, reply))
}

/// Opens a connection within `options.connect_timeout`.
async fn open(endpoint: &Endpoint, options: Options) -> Result<Connection, Error> {
    let connect_timeout = options.connect_timeout;
    match tokio::time::timeout(connect_timeout, Connection::open(endpoint, options.timeout)).await {
        Ok(connection) => connection,
        Err(_elapsed) => Err(connect_timed_out(endpoint, connect_timeout)),
    }
}

fn connect_timed_out(endpoint: &Endpoint, connect_timeout: Duration) -> Error {
    Error::Connect {
        endpoint: endpoint.to_string(),
        source: io::Error::new(
            io::ErrorKind::TimedOut,
            format!("connect_timeout: no connection within {connect_timeout:?}"),
        ),
    }
}

fn reply_kind(reply: &Reply) -> &'static str {
    match reply {
        Reply::Counted(_) => "Counted",
        Reply::Estimate(_) => "Estimate",
        Reply::Decision(_) => "Decision",
        Reply::Status(_) => "Status",
    }
}

fn wrong_reply(op: &str, expected: &str, reply: &Reply) -> Error {
    let got = reply_kind(reply);
    Error::Protocol(format!(
        "reply: {op} expects a {expected} reply, the sidecar sent {got}"
    ))
}
