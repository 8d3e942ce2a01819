//! Valid frames of every decoder of untrusted bytes, and a run of every decoder, for the
//! tests that feed them mutated frames (`decoders_fuzz`, `decoders_memory`).
#![allow(dead_code, clippy::unwrap_used)]

use tally_client::wire::{
    self as client_wire, CheckId, Decision, Estimate, Mode, Op, Refusal, Request, Response,
};
use tally_crdt::{
    Delta, Digest, Generation, Key, KeyRef, Lane, LaneUpdate, NodeId, OriginDelta, ReplicaId, Rule,
    Stamp, Subject, Version, Watermark, Window,
};
use tally_gossip::message::{Cover, MemberEntry, Message};
use tally_gossip::wire as gossip_wire;
use tally_node::recent::{Answered, Asked, Remembered};
use tally_node::region::log::{self as region_log, Entry, Record, RequestId};
use tally_node::region::wire::{self as region_wire, ExactAnswer, ExactCheck, Outcome};
use tally_node::{answerlog, lanelog};

/// A gossip frame of every kind of message `replica` sends, with lanes in two scopes, a
/// digest of three origins, and membership rows; named by kind.
pub fn gossip_seeds(replica: ReplicaId) -> Vec<(&'static str, Vec<u8>)> {
    const WALL: u64 = 1_796_000_100_000;
    let window = |len_secs| Window::containing(WALL / 1_000, len_secs).unwrap();
    let update = |rule: &str, subject: &str, len_secs, version: u64| LaneUpdate {
        key: Key::new(
            Rule::new(rule).unwrap(),
            Subject::new(subject).unwrap(),
            window(len_secs),
        ),
        lane: Lane::new(version * 3, version),
        version: Version(version),
    };
    let watermark = |version, stamp| Watermark {
        version: Version(version),
        stamp: Stamp(stamp),
    };
    let other = ReplicaId::new(NodeId(4), Generation(1_795_000_000_000));
    let delta = Delta {
        origins: vec![
            OriginDelta {
                origin: other,
                through: watermark(30, WALL - 70),
                lanes: vec![
                    update("login", "alice", 60, 3),
                    update("api", "bob", 3_600, 9),
                    update("login", "carol", 60, 38),
                ],
            },
            OriginDelta {
                origin: replica,
                through: watermark(7, WALL),
                lanes: Vec::new(),
            },
        ],
    };
    let digest = Digest {
        origins: [
            (replica, watermark(5, WALL - 3)),
            (other, watermark(70_000, WALL + 5)),
            (ReplicaId::new(NodeId(1), Generation(9)), watermark(0, 0)),
        ]
        .into_iter()
        .collect(),
    };
    let members = vec![
        MemberEntry {
            node: NodeId(3),
            generation: replica.generation,
            addr: "127.0.0.1:7000".into(),
            left: false,
        },
        MemberEntry {
            node: NodeId(4),
            generation: other.generation,
            addr: "127.0.0.1:7001".into(),
            left: true,
        },
    ];
    let messages = [
        (
            "gossip",
            Message::Members {
                members: members.clone(),
            },
        ),
        (
            "gossip syn",
            Message::Syn {
                digest: digest.clone(),
                unlisted: Stamp(WALL - 2_000),
                members_hash: 0x5eed,
                covers: Cover::All,
            },
        ),
        (
            "gossip syn part",
            Message::Syn {
                digest: digest.clone(),
                unlisted: Stamp(0),
                members_hash: 1,
                covers: Cover::Part {
                    from: ReplicaId::new(NodeId(1), Generation(0)),
                    until: Some(ReplicaId::new(NodeId(9), Generation(0))),
                },
            },
        ),
        (
            "gossip ack",
            Message::Ack {
                to: other,
                delta: delta.clone(),
                digest,
                members: members.clone(),
                dead: vec![NodeId(4)],
            },
        ),
        (
            "gossip delta",
            Message::Delta {
                to: other,
                delta,
                members,
                dead: Vec::new(),
            },
        ),
        (
            "gossip push",
            Message::Push {
                after: Version(40),
                lanes: OriginDelta {
                    origin: replica,
                    through: watermark(42, WALL + 1),
                    lanes: vec![
                        update("login", "alice", 60, 41),
                        update("api", "dave", 3_600, 42),
                    ],
                },
            },
        ),
    ];
    messages
        .into_iter()
        .map(|(name, message)| (name, gossip_wire::encode(replica, &message)))
        .collect()
}

/// An exact check forwarded to the region, with no application check id.
pub fn exact_check() -> ExactCheck {
    ExactCheck {
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
    }
}

/// Valid frames of every decoder, to mutate.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let replica = ReplicaId::new(NodeId(3), Generation(1_796_000_000_000));
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
    let check = exact_check();
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
    let window = Window::new(29_933_335, 60).unwrap();
    let mut lane_log = Vec::new();
    let key = |rule, subject| {
        Key::new(
            Rule::new(rule).unwrap(),
            Subject::new(subject).unwrap(),
            window,
        )
    };
    lanelog::encode(&key("login", "alice"), 3, 0, &mut lane_log);
    lanelog::encode(&key("api", "bob"), 1 << 40, 7, &mut lane_log);
    let mut answer_log = Vec::new();
    let id = |seq| CheckId {
        session: 1 << 40,
        seq,
    };
    let decision = Decision {
        allowed: true,
        estimate: -3,
        limit: 100,
        remaining: 97,
        reset_after_ms: 41_000,
        mode: Mode::ApproximateIsolated,
        staleness_ms: 250,
        bound: 12.5,
    };
    let remembered = |answered, key: &Key, amount| Remembered {
        answered,
        asked: Asked::of(KeyRef::from(key), amount),
        window,
    };
    let check = remembered(Answered::Decided(decision), &key("login", "alice"), 1);
    answerlog::encode(&(id(1), check), &mut answer_log);
    let estimate = Estimate {
        estimate: 1 << 70,
        window: window.index(),
        staleness_ms: 0,
    };
    let count = remembered(Answered::Incremented(estimate), &key("api", "bob"), 1 << 40);
    answerlog::encode(&(id(2), count), &mut answer_log);
    let mut response = Vec::new();
    client_wire::encode_frame(
        &Response {
            id: 9,
            result: Err(Refusal::RegionUnavailable {
                rule: "quota".into(),
                why: "no answer within 200 ms".into(),
            }),
        },
        &mut response,
    );
    let mut seeds = gossip_seeds(replica);
    seeds.extend([
        // The client's and the region's frames without their 4-byte length prefix: the
        // decoders take the body, once the prefix was checked against the limit.
        ("request", request[4..].to_vec()),
        ("response", response[4..].to_vec()),
        ("checks", checks[4..].to_vec()),
        ("answers", answers[4..].to_vec()),
        ("log", log),
        ("lane log", lane_log),
        ("answer log", answer_log),
    ]);
    seeds
}

/// A log record around `body`: its length, its checksum, then `body` (the format of every
/// log: the region log, the lane log, the answer log).
pub fn record(body: &[u8]) -> Vec<u8> {
    let mut record = (body.len() as u32).to_le_bytes().to_vec();
    record.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
    record.extend_from_slice(body);
    record
}

/// Whether the seed `name` is a log of checksummed records.
pub fn is_log(name: &str) -> bool {
    name.ends_with("log")
}

/// `log`'s records with each checksum made to match its body again: a mutated body then
/// reaches the entry's decoder rather than stopping at its checksum.
pub fn checksums_fixed(mut log: Vec<u8>) -> Vec<u8> {
    let mut at = 0;
    while let Some(header) = log.get(at..at + 8) {
        let len = u32::from_le_bytes(header[..4].try_into().unwrap()) as usize;
        let Some(body) = log.get(at + 8..at + 8 + len) else {
            break;
        };
        let crc = crc32fast::hash(body).to_le_bytes();
        log[at + 4..at + 8].copy_from_slice(&crc);
        at += 8 + len;
    }
    log
}

/// Runs every decoder on `bytes`: a panic fails the test.
pub fn decode_all(bytes: &[u8]) {
    let _ = gossip_wire::decode(bytes, gossip_wire::FRAME_BYTES_LIMIT);
    let _ = client_wire::decode_body::<Request>(bytes);
    let _ = client_wire::decode_body::<Response>(bytes);
    let _ = client_wire::decode_request(bytes);
    let _ = region_wire::decode_checks(bytes);
    let _ = region_wire::decode_answers(bytes);
    let _ = region_log::replay(bytes);
    let _ = lanelog::replay(bytes);
    let _ = answerlog::replay(bytes);
}
