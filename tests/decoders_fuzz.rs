//! Every decoder of untrusted bytes, fed arbitrary bytes and mutations of valid frames
//! (TESTING.md S8, S9, S10): each returns a value or a typed error, and never panics; and
//! names that are not UTF-8 and unknown variant tags are refused (S9).
//! Allocation is bounded by the decoders' limits (bincode's `with_limit`), which the
//! lengths of 2^64 - 1 below run into.

#![allow(
    clippy::unwrap_used,
    reason = "a panic in a test's set-up is the test's failure report"
)]

mod decoders;

use decoders::{checksums_fixed, decode_all, exact_check, gossip_seeds, is_log, record, seeds};
use proptest::collection::vec;
use proptest::prelude::*;
use tally_client::wire::{self as client_wire, CheckId, Estimate, Op, Refusal, Request, Response};
use tally_crdt::{Digest, Generation, KeyRef, NodeId, ReplicaId, Rule, Stamp, Window};
use tally_gossip::message::{Cover, Message};
use tally_gossip::wire as gossip_wire;
use tally_node::answerlog;
use tally_node::lanelog::{self, NotALane};
use tally_node::recent::{Answered, Asked, Remembered};
use tally_node::region::log::{self as region_log, Entry, Record};
use tally_node::region::wire::{self as region_wire, ExactAnswer, ExactCheck, Outcome};

#[test]
fn the_seeds_are_valid_frames() {
    let seeds = seeds();
    let frame = |name: &str| &seeds.iter().find(|(n, _)| *n == name).unwrap().1;
    let replica = ReplicaId::new(NodeId(3), Generation(1_796_000_000_000));
    for (name, message) in gossip_seeds(replica) {
        let decoded = gossip_wire::decode(&message, gossip_wire::FRAME_BYTES_LIMIT);
        assert!(decoded.is_ok(), "{name}: {decoded:?}");
    }
    assert!(client_wire::decode_body::<Request>(frame("request")).is_ok());
    assert!(client_wire::decode_body::<Response>(frame("response")).is_ok());
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
    assert_eq!(
        region_log::replay(&checksums_fixed(frame("log").clone()))
            .0
            .len(),
        2
    );
    for lane_log in [
        frame("lane log").clone(),
        checksums_fixed(frame("lane log").clone()),
    ] {
        let (lanes, damaged) = lanelog::replay(&lane_log).unwrap();
        assert_eq!((lanes.len(), damaged), (2, 0));
    }
    assert_eq!(answerlog::replay(frame("answer log")).len(), 2);
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
        let claim = record(&claiming(&log[8..8 + first_len], b"acct", len));
        assert_eq!(region_log::replay(&log[..8 + first_len]).0.len(), 1);
        assert_eq!(region_log::replay(&claim), (Vec::new(), 0));
        // A lane log's record that checks but does not decode stops the start.
        let lane_log = frame("lane log");
        let first_len = u32::from_le_bytes(lane_log[..4].try_into().unwrap()) as usize;
        let first = &lane_log[..8 + first_len];
        assert_eq!(lanelog::replay(first).unwrap().0.len(), 1);
        let claim = record(&claiming(&first[8..], b"alice", len));
        assert_eq!(lanelog::replay(&claim), Err(NotALane { at: 0 }));
    }
}

/// `frame` with the first `marker` (a name inside it) overwritten in place by as many bytes
/// that are not UTF-8.
fn not_utf8(frame: &[u8], marker: &[u8]) -> Vec<u8> {
    let at = frame
        .windows(marker.len())
        .position(|window| window == marker)
        .unwrap();
    let mut bad = frame.to_vec();
    for (i, byte) in bad[at..at + marker.len()].iter_mut().enumerate() {
        *byte = if i % 2 == 0 { 0xff } else { 0xfe };
    }
    assert!(std::str::from_utf8(&bad[at..at + marker.len()]).is_err());
    bad
}

/// `a` with the first byte where it differs from `b` (two encodings of one type that differ
/// only in a variant: the byte is that variant's tag) set past every variant's tag.
fn with_an_unknown_tag(a: &[u8], b: &[u8]) -> Vec<u8> {
    let at = a.iter().zip(b).position(|(x, y)| x != y).unwrap();
    assert!(
        a[at] < 16 && b[at] < 16,
        "a tag at {at}: {} and {}",
        a[at],
        b[at]
    );
    let mut unknown = a.to_vec();
    unknown[at] = 250;
    unknown
}

/// TESTING.md S9: a name that is not UTF-8, and a variant tag past every variant, are
/// refused by every decoder with an error (not only survived), as are trailing bytes
/// (`gossip::wire` and `client::wire` test those).
#[test]
fn names_not_utf8_and_unknown_tags_are_refused_by_every_decoder() {
    let seeds = seeds();
    let frame = |name: &str| seeds.iter().find(|(n, _)| *n == name).unwrap().1.clone();
    let gossip = |bytes: &[u8]| gossip_wire::decode(bytes, gossip_wire::FRAME_BYTES_LIMIT);

    // Names that are not UTF-8.
    for (name, marker) in [
        ("gossip", &b"127.0.0.1:7000"[..]),
        ("gossip push", b"alice"),
        ("gossip delta", b"carol"),
    ] {
        let bad = not_utf8(&frame(name), marker);
        assert!(gossip(&bad).is_err(), "{name}: {:?}", gossip(&bad));
    }
    let request = not_utf8(&frame("request"), b"user-1");
    assert!(client_wire::decode_body::<Request>(&request).is_err());
    assert!(client_wire::decode_request(&request).is_err());
    let response = not_utf8(&frame("response"), b"quota");
    assert!(client_wire::decode_body::<Response>(&response).is_err());
    assert!(region_wire::decode_checks(&not_utf8(&frame("checks"), b"acct")).is_none());
    let storage = region_wire::encode_answers(&[(1, ExactAnswer::Storage("disk full".into()))]);
    assert!(region_wire::decode_answers(&not_utf8(&storage[4..], b"disk full")).is_none());
    let log = checksums_fixed(not_utf8(&frame("log"), b"acct"));
    assert_eq!(
        region_log::replay(&log).0.len(),
        0,
        "a record whose key is not UTF-8 ends the replay"
    );
    let lane_log = checksums_fixed(not_utf8(&frame("lane log"), b"bob"));
    let second = frame("lane log")
        .windows(3)
        .position(|w| w == b"api")
        .unwrap()
        - 9;
    assert_eq!(
        lanelog::replay(&lane_log),
        Err(NotALane { at: second }),
        "a lane log's record whose key is not UTF-8 stops the start"
    );

    // Unknown variant tags.
    // Two messages with no stamps, so that their frames differ first at the body's tag.
    let replica = ReplicaId::new(NodeId(3), Generation(1_796_000_000_000));
    let members = gossip_wire::encode(
        replica,
        &Message::Members {
            members: Vec::new(),
        },
    );
    let syn = gossip_wire::encode(
        replica,
        &Message::Syn {
            digest: Digest::default(),
            unlisted: Stamp(0),
            members_hash: 0,
            covers: Cover::All,
        },
    );
    assert!(gossip(&members).is_ok() && gossip(&syn).is_ok());
    let unknown = with_an_unknown_tag(&members, &syn);
    assert!(gossip(&unknown).is_err(), "{:?}", gossip(&unknown));
    let body = |request: Request| {
        let mut frame = Vec::new();
        client_wire::encode_frame(&request, &mut frame);
        frame[4..].to_vec()
    };
    let status = body(Request {
        id: 7,
        op: Op::Status,
    });
    let get = body(Request {
        id: 7,
        op: Op::Get {
            rule: "api".into(),
            subject: "user-1".into(),
        },
    });
    let unknown = with_an_unknown_tag(&status, &get);
    assert!(client_wire::decode_body::<Request>(&unknown).is_err());
    assert!(client_wire::decode_request(&unknown).is_err());
    let refused = |result: Refusal| {
        let mut frame = Vec::new();
        client_wire::encode_frame(
            &Response {
                id: 9,
                result: Err(result),
            },
            &mut frame,
        );
        frame[4..].to_vec()
    };
    let unknown = with_an_unknown_tag(
        &refused(Refusal::Overflow),
        &refused(Refusal::UnknownRule { rule: "api".into() }),
    );
    assert!(client_wire::decode_body::<Response>(&unknown).is_err());
    let checks = |check: &ExactCheck| region_wire::encode_checks(&[check.as_ref()])[4..].to_vec();
    let check = exact_check();
    let named = ExactCheck {
        check_id: Some(CheckId { session: 1, seq: 3 }),
        ..check.clone()
    };
    let unknown = with_an_unknown_tag(&checks(&check), &checks(&named));
    assert!(region_wire::decode_checks(&unknown).is_none());
    // A log record whose entry names no kind of entry, its checksum made to match: the
    // replay ends at it.
    let entry_log = |entry: &Entry<&str>| {
        let mut log = Vec::new();
        region_log::encode(entry, &mut log);
        log
    };
    let decided = entry_log(&Entry::Decided(Record::decided(&check, true)));
    let floor = entry_log(&Entry::Floor {
        node: 2,
        generation: 9,
        base: 4,
    });
    assert_eq!(region_log::replay(&decided).0.len(), 1);
    let unknown = with_an_unknown_tag(&decided[8..], &floor[8..]);
    let unknown = checksums_fixed([&decided[..8], &unknown[..]].concat());
    assert_eq!(region_log::replay(&unknown).0.len(), 0);
    let answered = |answer| region_wire::encode_answers(&[(1, answer)])[4..].to_vec();
    let unknown = with_an_unknown_tag(
        &answered(ExactAnswer::Forgotten),
        &answered(ExactAnswer::Decided(Outcome {
            allowed: true,
            count: 4,
        })),
    );
    assert!(region_wire::decode_answers(&unknown).is_none());
    // An answer log's record whose answer names no kind of answer, its checksum made to
    // match: skipped, and the answers around it kept.
    let answer_log = |answered| {
        let window = Window::new(29_933_335, 60).unwrap();
        let rule = Rule::new("api").unwrap();
        let remembered = Remembered {
            answered,
            asked: Asked::of(KeyRef::new(&rule, "bob", window).unwrap(), 4),
            window,
        };
        let mut log = Vec::new();
        answerlog::encode(&(CheckId { session: 1, seq: 3 }, remembered), &mut log);
        log
    };
    let estimate = Estimate {
        estimate: 4,
        window: 29_933_335,
        staleness_ms: 0,
    };
    let incremented = answer_log(Answered::Incremented(estimate));
    let decremented = answer_log(Answered::Decremented(estimate));
    assert_eq!(answerlog::replay(&incremented).len(), 1);
    let unknown = with_an_unknown_tag(&incremented[8..], &decremented[8..]);
    let unknown = checksums_fixed([&incremented[..8], &unknown[..]].concat());
    let around = [&incremented[..], &unknown, &decremented].concat();
    let kept = answerlog::replay(&around);
    assert_eq!(
        kept.iter()
            .map(|(_, remembered)| remembered.answered)
            .collect::<Vec<_>>(),
        [
            Answered::Incremented(estimate),
            Answered::Decremented(estimate)
        ]
    );
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
        which in any::<prop::sample::Index>(),
        flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
        tail in vec(any::<u8>(), 0..8),
    ) {
        let seeds = seeds();
        let (name, seed) = &seeds[which.index(seeds.len())];
        let mut bytes = seed.clone();
        for (at, value) in flips {
            let at = at.index(bytes.len());
            bytes[at] = value;
        }
        if is_log(name) {
            // Past the checksums, to the entries' decoder.
            decode_all(&checksums_fixed(bytes.clone()));
        }
        decode_all(&bytes);
        bytes.truncate(cut.index(bytes.len() + 1));
        decode_all(&bytes);
        bytes.extend_from_slice(&tail);
        decode_all(&bytes);
    }
}
