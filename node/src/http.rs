//! `/metrics` (Prometheus text) and `/status` (JSON) over HTTP on loopback.
//!
//! Two read-only GET routes on a loopback port are all this serves, so it speaks the few
//! lines of HTTP/1.1 they need itself (one request per connection, then close) rather than
//! linking an HTTP stack.

use crate::clock;
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
use tokio::net::TcpListener;

/// The largest request head read before the connection is closed.
const HEAD_BYTES_MAX: usize = 8 * 1024;

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
    /// The region's counters, on the region node.
    pub region: Option<RegionStats>,
}

/// Serves `/metrics` and `/status` on `listener` until the node stops.
pub async fn serve(endpoints: Arc<Endpoints>, listener: TcpListener) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            // Out of file descriptors, say: wait for the cause to pass, keep serving.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let endpoints = endpoints.clone();
        tokio::spawn(async move {
            let mut head = Vec::new();
            let mut chunk = [0u8; 1024];
            let read_head = async {
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < HEAD_BYTES_MAX {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => head.extend_from_slice(&chunk[..n]),
                    }
                }
                true
            };
            if !matches!(
                tokio::time::timeout(Duration::from_secs(5), read_head).await,
                Ok(true)
            ) {
                return;
            }
            let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
            let (status, kind, body) = endpoints.answer(&String::from_utf8_lossy(line));
            let response = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}

impl Endpoints {
    fn answer(&self, request_line: &str) -> (&'static str, &'static str, String) {
        let mut parts = request_line.split(' ');
        let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        match (method, path) {
            ("GET", "/metrics") => (
                "200 OK",
                "text/plain; version=0.0.4; charset=utf-8",
                metrics::render(&Sources {
                    metrics: &self.metrics,
                    view: &self.view,
                    store: &self.store,
                    transport: &self.transport,
                    forward: &self.forward,
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
        let view = self.view.lock().clone();
        let members: Vec<_> = view
            .members
            .iter()
            .map(|(node, replica, state)| {
                let stamp = view.stamps.get(replica).map_or(0, |s| s.0);
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
            "unheard_seeds": view.unheard_seeds,
            "staleness_ms": freshness.staleness.as_millis() as u64,
            "keys": self.store.len(),
            "lanes": view.lanes,
        })
        .to_string()
    }
}
