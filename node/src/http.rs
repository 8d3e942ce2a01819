//! `/metrics` (OpenMetrics text, which Prometheus reads) and `/status` (JSON) over HTTP on
//! loopback.
//!
//! Two read-only GET routes on a loopback port are all this serves, so it speaks the few
//! lines of HTTP/1.1 they need itself (one request per connection, then close) rather than
//! linking an HTTP stack.

use crate::clock;
use crate::exact_room::ExactRoom;
use crate::metrics::{self, Metrics, RegionStats, Sources};
use crate::region::forward::ForwardStats;
use crate::store::LaneStore;
use crate::transport::TransportStats;
use crate::view::View;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tally_crdt::ReplicaId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// The largest request head read before the connection is closed.
const HEAD_BYTES_MAX: usize = 8 * 1024;

/// The most connections served at once; more wait in the listen backlog.
const CONNECTIONS_MAX: usize = 16;

/// How long one connection may take to send its request head: a connection that sends
/// nothing holds one of the `CONNECTIONS_MAX` for no longer, so idle connections cannot
/// keep a scrape out for long.
const HEAD_TIMEOUT: Duration = Duration::from_secs(1);

/// How long one connection may take, from accept to the last byte of the answer.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the HTTP routes read.
pub struct Endpoints {
    /// This node's replica.
    pub replica: ReplicaId,
    /// The live counters.
    pub metrics: Arc<Metrics>,
    /// The gossip view.
    pub view: Arc<View>,
    /// The lane store.
    pub store: Arc<LaneStore>,
    /// The transport's counters.
    pub transport: Arc<TransportStats>,
    /// The exact path's counters.
    pub forward: Arc<ForwardStats>,
    /// The room for exact checks waiting for the region.
    pub exact_room: Arc<ExactRoom>,
    /// The region's counters, on the region node.
    pub region: Option<RegionStats>,
}

/// Serves `/metrics` and `/status` on `listener` until the node stops.
pub async fn serve(endpoints: Arc<Endpoints>, listener: TcpListener) {
    let room = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    loop {
        let Ok(permit) = room.clone().acquire_owned().await else {
            return;
        };
        let Ok((stream, _)) = listener.accept().await else {
            // Out of file descriptors, say: wait for the cause to pass, keep serving.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let endpoints = endpoints.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(EXCHANGE_TIMEOUT, exchange(&endpoints, stream)).await;
            drop(permit);
        });
    }
}

/// Reads one request head from `stream`, within `HEAD_TIMEOUT`, and writes its answer.
async fn exchange(endpoints: &Endpoints, mut stream: TcpStream) {
    let Ok(Some(head)) = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)).await else {
        return;
    };
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or_default();
    let (status, kind, body) = endpoints.answer(&String::from_utf8_lossy(line));
    let allow = if status.starts_with("405") {
        "allow: GET\r\n"
    } else {
        ""
    };
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\n{allow}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// A request head, up to its blank line or `HEAD_BYTES_MAX` bytes; `None` if the client
/// goes first.
async fn read_head(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&chunk[..n]),
        }
        // Only the bytes just read, and the three before them, can complete the head.
        let fresh = &head[head.len().saturating_sub(chunk.len() + 3)..];
        let ended =
            fresh.windows(4).any(|w| w == b"\r\n\r\n") || fresh.windows(2).any(|w| w == b"\n\n");
        if ended || head.len() >= HEAD_BYTES_MAX {
            return Some(head);
        }
    }
}

impl Endpoints {
    fn answer(&self, request_line: &str) -> (&'static str, &'static str, String) {
        let mut parts = request_line.split(' ');
        let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let path = target.split('?').next().unwrap_or_default();
        match (method, path) {
            ("GET", "/metrics") => (
                "200 OK",
                // prometheus-client writes OpenMetrics text (`_total` samples, `# EOF`).
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                metrics::render(&Sources {
                    metrics: &self.metrics,
                    view: &self.view,
                    store: &self.store,
                    transport: &self.transport,
                    forward: &self.forward,
                    exact_room: &self.exact_room,
                    region: self.region.as_ref(),
                    now: clock::wall(),
                }),
            ),
            ("GET", "/status") => ("200 OK", "application/json", self.status()),
            ("GET", _) => (
                "404 Not Found",
                "text/plain",
                "not found: try /metrics or /status\n".into(),
            ),
            _ => (
                "405 Method Not Allowed",
                "text/plain",
                "only GET is served\n".into(),
            ),
        }
    }

    fn status(&self) -> String {
        let now = clock::wall();
        let view = self.view.lock().reported();
        let members: Vec<_> = view
            .members()
            .iter()
            .map(|(node, replica, state)| {
                let stamp = view.stamps().get(replica).map_or(0, |s| s.0);
                json!({
                    "node": node.0,
                    "generation": replica.generation.0,
                    "state": format!("{state:?}").to_lowercase(),
                    "staleness_ms": now.0.saturating_sub(stamp),
                })
            })
            .collect();
        let freshness = view.freshness(now);
        json!({
            "node": self.replica.node.0,
            "generation": self.replica.generation.0,
            "members": members,
            "unheard_seeds": view.unheard_seeds.live,
            "dead_seeds": view.unheard_seeds.dead,
            "staleness_ms": freshness.staleness.as_millis() as u64,
            "keys": self.store.len(),
            "lanes": view.lanes,
        })
        .to_string()
    }
}

// The lane store runs on loom's atomics under `tally_loom`, which work only inside a model.
#[cfg(test)]
#[cfg(not(tally_loom))]
mod tests {
    use super::*;
    use tally_crdt::{Generation, NodeId};

    async fn start() -> std::net::SocketAddr {
        let replica = ReplicaId::new(NodeId(1), Generation(1));
        let endpoints = Arc::new(Endpoints {
            replica,
            metrics: Arc::default(),
            view: Arc::default(),
            store: Arc::new(LaneStore::new(replica, 16)),
            transport: Arc::default(),
            forward: Arc::default(),
            exact_room: Arc::default(),
            region: None,
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(endpoints, listener));
        addr
    }

    async fn ask(addr: std::net::SocketAddr, request: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer
    }

    #[tokio::test(flavor = "current_thread")]
    async fn metrics_are_openmetrics_text_whatever_the_query_or_line_ends() {
        let addr = start().await;
        for request in [
            "GET /metrics HTTP/1.1\r\n\r\n",
            "GET /metrics?name=x HTTP/1.1\r\nhost: a\r\n\r\n",
            "GET /metrics HTTP/1.1\nhost: a\n\n",
        ] {
            let answer = ask(addr, request).await;
            assert!(
                answer.starts_with("HTTP/1.1 200 OK\r\n"),
                "{request:?}: {answer}"
            );
            assert!(
                answer.contains("content-type: application/openmetrics-text; version=1.0.0"),
                "{answer}"
            );
            assert!(answer.trim_end().ends_with("# EOF"), "{answer}");
        }
        let answer = ask(addr, "POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
        assert!(answer.contains("\r\nallow: GET\r\n"), "{answer}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn past_sixteen_connections_the_next_waits_for_one_to_close() {
        let addr = start().await;
        let mut idle = Vec::new();
        for _ in 0..CONNECTIONS_MAX {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream.write_all(b"GET /status HTTP/1.1\r\n").await.unwrap();
            idle.push(stream);
        }
        let waiting = tokio::spawn(ask(addr, "GET /status HTTP/1.1\r\n\r\n"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "served past the limit");
        idle.pop();
        let answer = tokio::time::timeout(Duration::from_secs(4), waiting)
            .await
            .expect("served once a connection closed")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_connection_that_sends_no_request_head_is_closed_once_its_time_for_one_is_up() {
        let addr = start().await;
        let started = tokio::time::Instant::now();
        let mut idle = TcpStream::connect(addr).await.unwrap();
        let mut byte = [0u8; 1];
        assert_eq!(idle.read(&mut byte).await.unwrap(), 0, "closed, unanswered");
        let waited = started.elapsed();
        assert!(
            waited >= HEAD_TIMEOUT && waited < EXCHANGE_TIMEOUT,
            "closed after {waited:?}"
        );
    }
}
