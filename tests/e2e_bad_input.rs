//! End to end: what a node does with peers it must not trust and frames it must not
//! believe (TESTING.md S1, S8, S9). Each test talks to a real `tallyd` with a hand-built
//! QUIC or TCP client, then checks the node's metrics and that it still serves.

#![allow(
    clippy::unwrap_used,
    reason = "a panic in a helper is the test's failure report"
)]

mod cluster;

use cluster::{certs_for, eventually, quic_client, Cluster};
use std::io::{Read, Write};
use std::time::Duration;
use tally_crdt::{
    Delta, Generation, Key, Lane, LaneUpdate, NodeId, OriginDelta, ReplicaId, Rule, Subject,
    Version, Watermark, Window,
};
use tally_gossip::message::Message;

/// This file's loopback network: 127.2.x.y.
const NET: u8 = 2;

/// Tries to get a frame to node 1 with `endpoint`: a handshake, a stream, a frame carrying
/// a lane of `count`/`node-9`. Returns why the connection ended; fails if node 1 kept it
/// for 10 s.
async fn refusal(endpoint: &quinn::Endpoint, cluster: &Cluster) -> quinn::ConnectionError {
    let node = &cluster.nodes[0];
    let connecting = endpoint
        .connect(node.gossip_addr(), "node-1.tally")
        .unwrap();
    let handshake = tokio::time::timeout(Duration::from_secs(10), connecting).await;
    let connection = match handshake.expect("the handshake ends") {
        Ok(connection) => connection,
        Err(refused) => return refused,
    };
    let nine = ReplicaId::new(NodeId(9), Generation(1));
    let key = Key::new(
        Rule::new("count").unwrap(),
        Subject::new("node-9").unwrap(),
        Window::containing(tally_node::clock::wall().0 / 1_000, 60).unwrap(),
    );
    // A push of its own lane: no receiver's life named, so one accepted would be merged.
    let push = Message::Push {
        after: Version(0),
        lanes: OriginDelta {
            origin: nine,
            through: Watermark {
                version: Version(1),
                stamp: tally_node::clock::wall(),
            },
            lanes: vec![LaneUpdate {
                key,
                lane: Lane::new(5, 0),
                version: Version(1),
            }],
        },
    };
    let frame = tally_gossip::wire::encode(nine, &push);
    // The writes may fail: the node may have closed the connection already.
    if let Ok(mut stream) = connection.open_uni().await {
        let _ = stream.write_all(&(frame.len() as u32).to_le_bytes()).await;
        let _ = stream.write_all(&frame).await;
    }
    tokio::time::timeout(Duration::from_secs(10), connection.closed())
        .await
        .expect("node 1 closes the connection")
}

/// Whether `ended` is node 1's refusal of the handshake: a TLS alert (a QUIC crypto error).
fn refused_at_the_handshake(ended: &quinn::ConnectionError) -> bool {
    matches!(
        ended,
        quinn::ConnectionError::ConnectionClosed(close)
            if (0x100..0x200).contains(&u64::from(close.error_code))
    )
}

/// Sends `frame` (a gossip frame, without its length) on a stream of its own.
async fn send_frame(connection: &quinn::Connection, frame: &[u8]) {
    let mut stream = connection.open_uni().await.unwrap();
    stream
        .write_all(&(frame.len() as u32).to_le_bytes())
        .await
        .unwrap();
    stream.write_all(frame).await.unwrap();
    stream.finish().unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn peers_without_a_cluster_certificate_are_refused_at_the_handshake() {
    let cluster = Cluster::start(NET, 2);

    // A certificate for node 9 from another CA.
    let other = cluster.dir.join("other-ca");
    certs_for(&other, 9);
    let foreign = quic_client(
        &cluster.certs().join("ca.pem"),
        Some((&other.join("node-9.pem"), &other.join("node-9.key"))),
    );
    let ended = refusal(&foreign, &cluster).await;
    assert!(
        refused_at_the_handshake(&ended),
        "a peer with another CA's certificate: {ended:?}"
    );

    // No certificate at all.
    let anonymous = quic_client(&cluster.certs().join("ca.pem"), None);
    let ended = refusal(&anonymous, &cluster).await;
    assert!(
        refused_at_the_handshake(&ended),
        "a peer without a certificate: {ended:?}"
    );

    let refused = cluster.nodes[0]
        .metric("tally_quic_handshakes_refused_total", &[])
        .unwrap();
    assert!(refused >= 2.0, "handshakes refused: {refused}");
    // Only the cluster's own gossip arrived: the node-9 frames never reached the protocol.
    let decode_errors = cluster.nodes[0]
        .metric("tally_gossip_decode_errors_total", &[])
        .unwrap();
    let forged = cluster.nodes[0]
        .metric("tally_gossip_forged_frames_total", &[])
        .unwrap();
    assert_eq!((decode_errors, forged), (0.0, 0.0));
    let members = cluster.nodes[0].http("/status").unwrap();
    assert!(
        !members.contains("\"node\":9"),
        "node 9 became a member: {members}"
    );
    // Nor did its lane: node 1 holds nothing of `node-9`.
    let client = cluster.nodes[0].client().await;
    assert_eq!(client.get("count", "node-9").await.unwrap().estimate, 0);

    // The cluster's certificates name one node each: a dialer expecting node 2 (here a
    // rustls client with the node's name check, the check the node's own dialer makes
    // through `certs::server_name`) refuses node 1's. The node's dialer itself is driven
    // to a wrong peer in `transport`'s unit test
    // `a_peer_dialed_whose_certificate_names_another_node_as_well_is_refused`.
    let cluster_client = cluster.member_client(1);
    let connecting = cluster_client
        .connect(cluster.nodes[0].gossip_addr(), "node-2.tally")
        .unwrap();
    // Refused by the dialer's own name check (a TLS bad_certificate alert, 0x2a), not by
    // node 1 for another reason.
    let dialed = connecting.await;
    assert!(
        matches!(
            &dialed,
            Err(quinn::ConnectionError::TransportError(error))
                if error.code == quinn::TransportErrorCode::crypto(0x2a)
                    && error.reason.contains("not valid for name \"node-2.tally\"")
        ),
        "node 1's certificate taken as node 2's, or refused otherwise: {dialed:?}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_member_claiming_another_node_id_than_its_certificate_is_refused() {
    let cluster = Cluster::start(NET, 2);
    // A valid cluster certificate for node 9, whose frames claim to come from node 2.
    let endpoint = cluster.member_client(9);
    let connection = endpoint
        .connect(cluster.nodes[0].gossip_addr(), "node-1.tally")
        .unwrap()
        .await
        .unwrap();
    let frame = tally_gossip::wire::encode(
        ReplicaId::new(NodeId(2), Generation(1)),
        &Message::Members { members: vec![] },
    );
    send_frame(&connection, &frame).await;
    let closed = tokio::time::timeout(Duration::from_secs(2), connection.closed())
        .await
        .expect("the node closes the connection of a forging peer");
    assert!(
        matches!(closed, quinn::ConnectionError::ApplicationClosed(ref close) if close.error_code == tally_node::transport::CLOSE_PROTOCOL.into()),
        "{closed:?}"
    );
    let node = &cluster.nodes[0];
    assert_eq!(
        node.metric("tally_gossip_forged_frames_total", &[]),
        Some(1.0)
    );
    assert_eq!(
        node.metric("tally_quic_connections_forged_total", &[]),
        Some(1.0)
    );
    // Node 2 is still alive and trusted.
    assert_eq!(
        node.metric("tally_members", &[("state", "alive")]),
        Some(1.0)
    );
}

#[tokio::test(flavor = "current_thread")]
async fn garbage_truncated_and_oversized_peer_frames_are_counted_and_dropped() {
    let cluster = Cluster::start(NET, 2);
    let endpoint = cluster.member_client(9);
    let node = &cluster.nodes[0];
    let connect = || async {
        endpoint
            .connect(node.gossip_addr(), "node-1.tally")
            .unwrap()
            .await
            .unwrap()
    };

    // Garbage with a good length: a decode error; the connection stays.
    let connection = connect().await;
    let mut stream = connection.open_uni().await.unwrap();
    for garbage in [
        &[0xffu8; 7][..],
        &[1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f][..],
    ] {
        stream
            .write_all(&(garbage.len() as u32).to_le_bytes())
            .await
            .unwrap();
        stream.write_all(garbage).await.unwrap();
    }
    stream.finish().unwrap();
    eventually(Duration::from_secs(5), "decode errors counted", || {
        node.metric("tally_gossip_decode_errors_total", &[]) == Some(2.0)
    })
    .await;

    // A frame cut off by the end of its stream.
    let mut stream = connection.open_uni().await.unwrap();
    stream.write_all(&100u32.to_le_bytes()).await.unwrap();
    stream.write_all(&[1; 10]).await.unwrap();
    stream.finish().unwrap();
    // And one cut off inside its length prefix.
    let mut stream = connection.open_uni().await.unwrap();
    stream.write_all(&[9, 0]).await.unwrap();
    stream.finish().unwrap();
    eventually(
        Duration::from_secs(5),
        "two truncated frames counted",
        || node.metric("tally_quic_frames_truncated_total", &[]) == Some(2.0),
    )
    .await;

    // Length prefixes of 2^32 - 1 and 0: refused before reading, the connection closed.
    for prefix in [u32::MAX, 0] {
        let connection = connect().await;
        let mut stream = connection.open_uni().await.unwrap();
        stream.write_all(&prefix.to_le_bytes()).await.unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(2), connection.closed()).await;
        assert!(
            matches!(
                &closed,
                Ok(quinn::ConnectionError::ApplicationClosed(close))
                    if close.error_code == tally_node::transport::CLOSE_PROTOCOL.into()
            ),
            "length {prefix}: the node closes the connection for the frame: {closed:?}"
        );
    }
    assert_eq!(
        node.metric("tally_quic_frames_oversized_total", &[]),
        Some(2.0)
    );

    // The node still serves its clients and its cluster.
    let client = node.client().await;
    client.incr("count", "after", 2).await.unwrap();
    let peer = cluster.nodes[1].client().await;
    let mut seen = 0;
    for _ in 0..100 {
        seen = peer.get("count", "after").await.unwrap().estimate;
        if seen == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(seen, 2, "gossip kept flowing after the bad frames");
}

#[tokio::test(flavor = "current_thread")]
async fn garbage_truncated_and_oversized_client_frames_are_counted_and_dropped() {
    let cluster = Cluster::start(NET, 1);
    let node = &cluster.nodes[0];
    let send = |bytes: &[u8], then_close: bool| -> Vec<u8> {
        let mut stream = std::net::TcpStream::connect(node.client_addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        stream.write_all(bytes).unwrap();
        if then_close {
            stream.shutdown(std::net::Shutdown::Write).unwrap();
        }
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        answer
    };
    // A good length and a body that does not decode: a Malformed answer, then close.
    let answer = send(&[4, 0, 0, 0, 1, 0xff, 0xff, 0xff], false);
    let body = &answer[4..];
    let response: tally_client::wire::Response = tally_client::wire::decode_body(body).unwrap();
    assert!(
        matches!(
            response.result,
            Err(tally_client::Refusal::Malformed { .. })
        ),
        "{response:?}"
    );
    // Length prefixes over the limit: refused before reading.
    for prefix in [u32::MAX, 1 << 20] {
        let answer = send(&prefix.to_le_bytes(), false);
        assert!(answer.len() > 4, "no answer to a {prefix}-byte prefix");
        let response: tally_client::wire::Response =
            tally_client::wire::decode_body(&answer[4..]).unwrap();
        assert!(
            matches!(
                &response.result,
                Err(tally_client::Refusal::Malformed { why }) if why.contains("limit")
            ),
            "{prefix}: {response:?}"
        );
    }
    // A frame cut off by the client's close.
    send(&[100, 0, 0, 0, 1, 2, 3], true);
    eventually(Duration::from_secs(5), "bad client frames counted", || {
        node.metric("tally_client_frames_bad_total", &[]) == Some(4.0)
    })
    .await;
    // A well-behaved client is served as before.
    let client = node.client().await;
    assert_eq!(client.incr("count", "fine", 3).await.unwrap().estimate, 3);
    // Bad fields get typed errors naming the field; nothing is counted.
    let err = client.incr("count", "fine", 0).await.unwrap_err();
    assert!(err.to_string().contains("amount"), "{err}");
    let err = client.check("no-such-rule", "fine", 1).await.unwrap_err();
    assert!(err.to_string().contains("no-such-rule"), "{err}");
    assert_eq!(client.get("count", "fine").await.unwrap().estimate, 3);
}

#[tokio::test(flavor = "current_thread")]
async fn a_node_at_its_key_cap_takes_no_more_keys_from_peers_and_shows_itself_behind() {
    let mut cluster = Cluster::start(NET, 2);
    // Node 2 again, with room for four keys.
    cluster.node(2).kill9();
    let config = std::fs::read_to_string(&cluster.nodes[1].config).unwrap();
    std::fs::write(&cluster.nodes[1].config, format!("keys_max = 4\n{config}")).unwrap();
    cluster.node(2).restart(false);
    cluster.wait_members_alive();

    let writer = cluster.nodes[0].client().await;
    for user in 0..20 {
        writer
            .incr("api", &format!("user-{user}"), 1)
            .await
            .unwrap();
    }
    let capped = &cluster.nodes[1];
    eventually(
        Duration::from_secs(10),
        "node 2 to refuse lanes past its cap",
        || {
            capped
                .metric("tally_gossip_lanes_refused_total", &[])
                .is_some_and(|refused| refused > 0.0)
        },
    )
    .await;
    let keys = |name| capped.metric(name, &[]).unwrap();
    assert!(
        keys("tally_gossip_keys") <= 4.0,
        "{}",
        keys("tally_gossip_keys")
    );
    assert!(keys("tally_keys") <= 4.0, "{}", keys("tally_keys"));
    // Its watermark for node 1 stops below what it left out, so node 1's state here
    // stops getting newer: node 2 decides `api` on its own share, as when cut off.
    let staleness = || {
        capped
            .metric("tally_origin_staleness_seconds", &[("node", "1")])
            .unwrap()
    };
    eventually(
        Duration::from_secs(10),
        "node 1 to go stale at node 2",
        || staleness() > 1.0,
    )
    .await;
    let local = capped.client().await;
    let decision = local.check("api", "user-0", 1).await.unwrap();
    assert_eq!(decision.mode, tally_client::Mode::ApproximateIsolated);
    // Node 1 has room: it holds all twenty.
    assert!(cluster.nodes[0].metric("tally_gossip_keys", &[]).unwrap() >= 20.0);
}

#[tokio::test(flavor = "current_thread")]
async fn a_member_relaying_an_inflated_lane_of_another_origin_is_held_to_the_lane_rate() {
    let cluster = Cluster::start(NET, 2);
    let node_1 = cluster.nodes[0].client().await;
    let node_2 = cluster.nodes[1].client().await;
    node_2.incr("count", "victim", 5).await.unwrap();
    let estimate_at_1 = || async { node_1.get("count", "victim").await.unwrap().estimate };
    for _ in 0..100 {
        if estimate_at_1().await == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(estimate_at_1().await, 5);

    // Node 9, a member, relays node 2's lane with 10^18 increments: far past what a lane may
    // hold in a week's window (10^9 a second by default, about 6 * 10^14 at the window's
    // end).
    let (status_1, status_2) = (
        node_1.status().await.unwrap(),
        node_2.status().await.unwrap(),
    );
    let window = node_1.get("count", "victim").await.unwrap().window;
    let origin = ReplicaId::new(NodeId(2), Generation(status_2.generation));
    let inflated = OriginDelta {
        origin,
        through: Watermark::default(),
        lanes: vec![LaneUpdate {
            key: Key::new(
                Rule::new("count").unwrap(),
                Subject::new("victim").unwrap(),
                Window::new(window, cluster::WINDOW_SECS).unwrap(),
            ),
            lane: Lane::new(1_000_000_000_000_000, 0),
            version: Version(1),
        }],
    };
    let frame = tally_gossip::wire::encode(
        ReplicaId::new(NodeId(9), Generation(1)),
        &Message::Delta {
            to: ReplicaId::new(NodeId(1), Generation(status_1.generation)),
            delta: Delta {
                origins: vec![inflated],
            },
            members: vec![],
            dead: vec![],
        },
    );
    let connection = cluster
        .member_client(9)
        .connect(cluster.nodes[0].gossip_addr(), "node-1.tally")
        .unwrap()
        .await
        .unwrap();
    send_frame(&connection, &frame).await;
    let node = &cluster.nodes[0];
    eventually(
        Duration::from_secs(5),
        "node 1 to throttle the relayed lane",
        || node.metric("tally_gossip_lanes_throttled_total", &[]) == Some(1.0),
    )
    .await;
    assert_eq!(estimate_at_1().await, 5, "the inflated lane is not held");
    // Node 2's own writes still reach node 1.
    node_2.incr("count", "victim", 1).await.unwrap();
    for _ in 0..100 {
        if estimate_at_1().await == 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(estimate_at_1().await, 6);
}
