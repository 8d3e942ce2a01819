//! Every decoder of untrusted bytes, fed arbitrary bytes and mutations of valid frames
//! (TESTING.md S8, S9, S10): each returns a value or a typed error, and never panics.
//! Allocation is bounded by the decoders' limits (bincode's `with_limit`), which the
//! lengths of 2^64 - 1 below run into.

#![allow(
    clippy::unwrap_used,
    reason = "a panic in a test's set-up is the test's failure report"
)]

use proptest::collection::vec;
use proptest::prelude::*;
use tally_client::wire::{self as client_wire, CheckId, Op, Request, Response};
use tally_crdt::{Generation, NodeId, ReplicaId};
use tally_gossip::message::{MemberEntry, Message};
use tally_gossip::wire as gossip_wire;
use tally_node::region::log::{self as region_log, Entry, Record, RequestId};
use tally_node::region::wire::{self as region_wire, ExactAnswer, ExactCheck, Outcome};

/// Valid frames of every decoder, to mutate.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let replica = ReplicaId::new(NodeId(3), Generation(1_796_000_000_000));
    let gossip = gossip_wire::encode(
        replica,
        &Message::Members {
            members: vec![MemberEntry {
                node: NodeId(3),
                generation: Generation(1_796_000_000_000),
                addr: "127.0.0.1:7000".into(),
                left: false,
            }],
        },
    );
    let mut request = Vec::new();
    client_wire::encode_frame(
        &Request {
            id: 7,
            op: Op::Check {
                rule: "api".into(),
                subject: "user-1".into(),
                cost: 1,
                id: Some(CheckId {
                    session: 1 << 40,
                    seq: 70_000,
                }),
            },
        },
        &mut request,
    );
    let check = ExactCheck {
        id: RequestId {
            node: 2,
            generation: 9,
            seq: 300,
        },
        check_id: None,
        rule: "quota".into(),
        subject: "acct".into(),
        window_index: 500_000,
        window_secs: 3_600,
        cost: 2,
    };
    let named = ExactCheck {
        check_id: Some(CheckId {
            session: u64::MAX,
            seq: 3,
        }),
        ..check.clone()
    };
    let checks = region_wire::encode_checks(&[check.as_ref(), named.as_ref()]);
    let answers = region_wire::encode_answers(&[
        (
            1,
            ExactAnswer::Decided(Outcome {
                allowed: true,
                count: 4,
            }),
        ),
        (2, ExactAnswer::Forgotten),
    ]);
    let mut log = Vec::new();
    region_log::encode(&Entry::Decided(Record::decided(&check, true)), &mut log);
    region_log::encode(
        &Entry::<&str>::Floor {
            node: 2,
            generation: 9,
            base: 4,
        },
        &mut log,
    );
    vec![
        ("gossip", gossip),
        // The client's and the region's frames without their 4-byte length prefix: the
        // decoders take the body, once the prefix was checked against the limit.
        ("request", request[4..].to_vec()),
        ("checks", checks[4..].to_vec()),
        ("answers", answers[4..].to_vec()),
        ("log", log),
    ]
}

/// Runs every decoder on `bytes`: a panic fails the test.
fn decode_all(bytes: &[u8]) {
    let _ = gossip_wire::decode(bytes, gossip_wire::FRAME_BYTES_LIMIT);
    let _ = client_wire::decode_body::<Request>(bytes);
    let _ = client_wire::decode_body::<Response>(bytes);
    let _ = client_wire::decode_request(bytes);
    let _ = region_wire::decode_checks(bytes);
    let _ = region_wire::decode_answers(bytes);
    let _ = region_log::replay(bytes);
}

#[test]
fn the_seeds_are_valid_frames() {
    let seeds = seeds();
    let frame = |name: &str| &seeds.iter().find(|(n, _)| *n == name).unwrap().1;
    assert!(gossip_wire::decode(frame("gossip"), gossip_wire::FRAME_BYTES_LIMIT).is_ok());
    assert!(client_wire::decode_body::<Request>(frame("request")).is_ok());
    assert!(client_wire::decode_request(frame("request")).is_ok());
    assert_eq!(
        region_wire::decode_checks(frame("checks")).unwrap().1.len(),
        2
    );
    assert_eq!(
        region_wire::decode_answers(frame("answers")).unwrap().len(),
        2
    );
    assert_eq!(region_log::replay(frame("log")).0.len(), 2);
}

/// `frame` with the length before the first `marker` (a string of fewer than 251 bytes, so
/// that its length takes one byte) replaced by bincode's 9-byte varint of `len`.
fn claiming(frame: &[u8], marker: &[u8], len: u64) -> Vec<u8> {
    let at = frame
        .windows(marker.len())
        .position(|window| window == marker)
        .unwrap();
    assert_eq!(
        usize::from(frame[at - 1]),
        marker.len(),
        "the marker's length"
    );
    let mut claiming = frame[..at - 1].to_vec();
    claiming.push(0xfd);
    claiming.extend_from_slice(&len.to_le_bytes());
    claiming.extend_from_slice(&frame[at..]);
    claiming
}

/// Whether a decoder's error text is bincode's limit refusal.
fn over_the_limit(why: &str) -> bool {
    why.contains("LimitExceeded")
}

#[test]
fn lengths_of_a_tebibyte_and_of_two_to_the_64_are_refused_by_the_decoders_limits() {
    // Each frame is valid as built, and is refused once one of its lengths claims 2^40
    // bytes (over every limit, where a decoder without one would read on to the frame's
    // end) or 2^64 - 1: by bincode's limit, where the decoder's error shows why.
    let seeds = seeds();
    let frame = |name: &str| seeds.iter().find(|(n, _)| *n == name).unwrap().1.clone();
    for len in [1 << 40, u64::MAX] {
        let gossip = claiming(&frame("gossip"), b"127.0.0.1:7000", len);
        match gossip_wire::decode(&gossip, gossip_wire::FRAME_BYTES_LIMIT) {
            Err(gossip_wire::DecodeError::Body(why)) => assert!(over_the_limit(&why), "{why}"),
            other => panic!("a member address of {len} bytes: {other:?}"),
        }

        let request = claiming(&frame("request"), b"user-1", len);
        match client_wire::decode_body::<Request>(&request) {
            Err(client_wire::FrameError::Body(why)) => assert!(over_the_limit(&why), "{why}"),
            other => panic!("a subject of {len} bytes: {other:?}"),
        }
        assert!(client_wire::decode_request(&request).is_err());

        // The region's decoders say only whether a frame decoded.
        let checks = claiming(&frame("checks"), b"acct", len);
        assert!(region_wire::decode_checks(&checks).is_none());
        let mut checks = frame("checks");
        assert_eq!(checks[1], 2, "the count of checks follows the version byte");
        checks.splice(1..2, [0xfd].into_iter().chain(len.to_le_bytes()));
        assert!(region_wire::decode_checks(&checks).is_none());
        let storage = region_wire::encode_answers(&[(1, ExactAnswer::Storage("disk full".into()))]);
        assert_eq!(region_wire::decode_answers(&storage[4..]).unwrap().len(), 1);
        let storage = claiming(&storage[4..], b"disk full", len);
        assert!(region_wire::decode_answers(&storage).is_none());

        // A log record whose checksum covers the claim: refused by the record's decoder.
        let log = frame("log");
        let first_len = u32::from_le_bytes(log[..4].try_into().unwrap()) as usize;
        let body = claiming(&log[8..8 + first_len], b"acct", len);
        let mut record = (body.len() as u32).to_le_bytes().to_vec();
        record.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        record.extend_from_slice(&body);
        assert_eq!(region_log::replay(&log[..8 + first_len]).0.len(), 1);
        assert_eq!(region_log::replay(&record), (Vec::new(), 0));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn arbitrary_bytes_never_panic_a_decoder(bytes in vec(any::<u8>(), 0..512)) {
        decode_all(&bytes);
    }

    #[test]
    fn arbitrary_bodies_after_a_decoders_version_never_panic_a_decoder(
        version in prop::sample::select(vec![
            gossip_wire::WIRE_VERSION,
            client_wire::CLIENT_WIRE_VERSION,
            region_wire::REGION_WIRE_VERSION,
            region_wire::REGION_WIRE_VERSION_MIN,
        ]),
        body in vec(any::<u8>(), 0..512),
    ) {
        let mut bytes = vec![version];
        bytes.extend_from_slice(&body);
        decode_all(&bytes);
    }

    #[test]
    fn mutated_frames_never_panic_a_decoder(
        which in 0..5usize,
        flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
        tail in vec(any::<u8>(), 0..8),
    ) {
        let seeds = seeds();
        let mut bytes = seeds[which].1.clone();
        for (at, value) in flips {
            let at = at.index(bytes.len());
            bytes[at] = value;
        }
        decode_all(&bytes);
        bytes.truncate(cut.index(bytes.len() + 1));
        decode_all(&bytes);
        bytes.extend_from_slice(&tail);
        decode_all(&bytes);
    }
}
