//! The per-request encoding and decoding of both sides, written out by hand.
//!
//! Going through serde cost `tally-client` about a sixth of its CPU per request (two
//! `String`s per request, a visitor per field and per enum), and the sidecar as much. These
//! functions write and read the same bytes as bincode's standard config does for
//! [`Request`] and [`Response`] (varints: a byte up to 250, else 251, 252 or 253 and a
//! little-endian `u16`, `u32` or `u64`, or 254 and a `u128`; signed integers zigzagged
//! first; enum variants as varint indexes; strings as a varint length and UTF-8). The tests
//! hold them to bincode's output for every op, every counting reply and the varint
//! boundaries, and the decoders to bincode's answer for every one-byte change.
//!
//! Only what a counting op says is written and read here: requests, and the answers that
//! carry no names (`Counted`, `Estimate`, `Decision`). Anything else goes to bincode: an
//! answer to encode that is not one of those, and a body to decode that these decoders do
//! not take (an unusual varint form, a refusal, a status, a bad frame), which bincode then
//! decides, so an error is always bincode's.
//!
//! [`Request`]: super::Request

use super::form::{put_check_id, put_i128, put_str, put_varint, Reader};
use super::{
    decode_body, decode_body_borrowed, encode_frame, Decision, Estimate, FrameError, Mode, OpRef,
    Reply, RequestRef, Response, CLIENT_FRAME_BYTES_MAX, CLIENT_WIRE_VERSION,
};

/// Appends `request` as one frame: the bytes `encode_frame` writes for the [`Request`]
/// with the same fields.
///
/// [`Request`]: super::Request
pub(crate) fn encode_request(request: &RequestRef<'_>, out: &mut Vec<u8>) {
    framed(out, |out| put_request(out, request));
}

/// Decodes one frame body (after the length prefix) holding a [`Request`], as
/// `decode_body::<Request>` does, but with the names borrowed from the body.
///
/// [`Request`]: super::Request
pub fn decode_request(body: &[u8]) -> Result<RequestRef<'_>, FrameError> {
    match reader_within_count(body).and_then(request) {
        Some(request) => Ok(request),
        None => decode_body_borrowed(body),
    }
}

/// Appends `response` as one frame: the bytes `encode_frame` writes for it.
pub fn encode_response(response: &Response, out: &mut Vec<u8>) {
    match &response.result {
        Ok(Reply::Counted(estimate)) => framed(out, |out| {
            put_answer(out, response.id, REPLY_COUNTED);
            put_estimate(out, estimate);
        }),
        Ok(Reply::Estimate(estimate)) => framed(out, |out| {
            put_answer(out, response.id, REPLY_ESTIMATE);
            put_estimate(out, estimate);
        }),
        Ok(Reply::Decision(decision)) => framed(out, |out| {
            put_answer(out, response.id, REPLY_DECISION);
            put_decision(out, decision);
        }),
        Ok(Reply::Status(_)) | Err(_) => encode_frame(response, out),
    }
}

/// Decodes one frame body (after the length prefix) holding a [`Response`], as
/// `decode_body::<Response>` does.
pub(crate) fn decode_response(body: &[u8]) -> Result<Response, FrameError> {
    match reader_within_count(body).and_then(counting_response) {
        Some(response) => Ok(response),
        None => decode_body(body),
    }
}

/// The id a response's body (after the length prefix) starts with, if the body is of this
/// wire version: the call an answer is for, even when the rest does not decode.
pub(crate) fn response_id(body: &[u8]) -> Option<u64> {
    reader(body)?.u64()
}

// Variant indexes, in the order the enums in `wire` declare their variants (bincode
// encodes a variant by its index).
const OP_INCR: u8 = 0;
const OP_DECR: u8 = 1;
const OP_GET: u8 = 2;
const OP_CHECK: u8 = 3;
const OP_STATUS: u8 = 4;
const RESULT_OK: u8 = 0;
const REPLY_COUNTED: u8 = 0;
const REPLY_ESTIMATE: u8 = 1;
const REPLY_DECISION: u8 = 2;
const MODES: [Mode; 4] = [
    Mode::ApproximateConnected,
    Mode::ApproximateIsolated,
    Mode::Exact,
    Mode::RegionFallback,
];

/// How many of the whole frames in `frames` (as [`encode_request`] appends them) its
/// first `bytes` bytes begin.
pub(crate) fn frames_begun(frames: &[u8], bytes: usize) -> u64 {
    let (mut at, mut begun) = (0, 0);
    while at < bytes {
        let prefix: [u8; 4] = frames[at..at + 4]
            .try_into()
            .expect("invariant: a 4-byte slice");
        at += 4 + u32::from_le_bytes(prefix) as usize;
        begun += 1;
    }
    begun
}

/// Appends one frame: the length prefix, the version byte, and what `body` writes.
fn framed(out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.push(CLIENT_WIRE_VERSION);
    body(out);
    let len = out.len() - start - 4;
    let len = u32::try_from(len).expect("invariant: messages are checked to fit in one frame");
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

fn put_request(out: &mut Vec<u8>, request: &RequestRef<'_>) {
    put_varint(out, request.id);
    match request.op {
        OpRef::Incr {
            rule,
            subject,
            amount,
            id,
        } => {
            out.push(OP_INCR);
            put_str(out, rule);
            put_str(out, subject);
            put_varint(out, amount);
            put_check_id(out, id);
        }
        OpRef::Decr {
            rule,
            subject,
            amount,
            id,
        } => {
            out.push(OP_DECR);
            put_str(out, rule);
            put_str(out, subject);
            put_varint(out, amount);
            put_check_id(out, id);
        }
        OpRef::Get { rule, subject } => {
            out.push(OP_GET);
            put_str(out, rule);
            put_str(out, subject);
        }
        OpRef::Check {
            rule,
            subject,
            cost,
            id,
        } => {
            out.push(OP_CHECK);
            put_str(out, rule);
            put_str(out, subject);
            put_varint(out, cost);
            put_check_id(out, id);
        }
        OpRef::Status => out.push(OP_STATUS),
    }
}

/// An `Ok` answer's id and reply variant.
fn put_answer(out: &mut Vec<u8>, id: u64, reply: u8) {
    put_varint(out, id);
    out.push(RESULT_OK);
    out.push(reply);
}

fn put_estimate(out: &mut Vec<u8>, estimate: &Estimate) {
    put_i128(out, estimate.estimate);
    put_varint(out, estimate.window);
    put_varint(out, estimate.staleness_ms);
}

fn put_decision(out: &mut Vec<u8>, decision: &Decision) {
    out.push(u8::from(decision.allowed));
    put_i128(out, decision.estimate);
    put_varint(out, decision.limit);
    put_varint(out, decision.remaining);
    put_varint(out, decision.reset_after_ms);
    let mode = MODES
        .iter()
        .position(|&mode| mode == decision.mode)
        .expect("invariant: MODES lists every mode");
    out.push(mode as u8);
    put_varint(out, decision.staleness_ms);
    out.extend_from_slice(&decision.bound.to_le_bytes());
}

/// A reader of the body's bincode, past its version byte; `None` if the body is over the
/// limit or in another version.
fn reader(body: &[u8]) -> Option<Reader<'_>> {
    if body.len() > CLIENT_FRAME_BYTES_MAX {
        return None;
    }
    match body.split_first()? {
        (&CLIENT_WIRE_VERSION, rest) => Some(Reader::new(rest)),
        _ => None,
    }
}

/// The most that bincode's limit counts beyond a body's bytes for a request or a counting
/// answer (77, a decision's): it counts each value at its size in memory (a `u64` as 8 bytes
/// however short its varint, a variant index as 4), a string at its length.
const COUNTED_BEYOND_BYTES_MAX: usize = 128;

/// [`reader`], for a body far enough under the limit that bincode's count of it is too: a
/// body closer to the limit goes to bincode, which decides whether it is over (found in
/// review, session 39: a request of 65,530 bytes was taken here and refused by bincode).
fn reader_within_count(body: &[u8]) -> Option<Reader<'_>> {
    (body.len() + COUNTED_BEYOND_BYTES_MAX <= CLIENT_FRAME_BYTES_MAX)
        .then(|| reader(body))
        .flatten()
}

/// A whole body's request.
fn request<'a>(mut body: Reader<'a>) -> Option<RequestRef<'a>> {
    let id = body.u64()?;
    let op = match body.variant()? {
        OP_INCR => OpRef::Incr {
            rule: body.str()?,
            subject: body.str()?,
            amount: body.u64()?,
            id: body.check_id()?,
        },
        OP_DECR => OpRef::Decr {
            rule: body.str()?,
            subject: body.str()?,
            amount: body.u64()?,
            id: body.check_id()?,
        },
        OP_GET => OpRef::Get {
            rule: body.str()?,
            subject: body.str()?,
        },
        OP_CHECK => OpRef::Check {
            rule: body.str()?,
            subject: body.str()?,
            cost: body.u64()?,
            id: body.check_id()?,
        },
        OP_STATUS => OpRef::Status,
        _ => return None,
    };
    body.is_empty().then_some(RequestRef { id, op })
}

/// A whole body's `Ok` answer to a counting op.
fn counting_response(mut body: Reader<'_>) -> Option<Response> {
    let id = body.u64()?;
    if body.variant()? != RESULT_OK {
        return None;
    }
    let reply = match body.variant()? {
        REPLY_COUNTED => Reply::Counted(estimate(&mut body)?),
        REPLY_ESTIMATE => Reply::Estimate(estimate(&mut body)?),
        REPLY_DECISION => Reply::Decision(decision(&mut body)?),
        _ => return None,
    };
    body.is_empty().then_some(Response {
        id,
        result: Ok(reply),
    })
}

fn estimate(body: &mut Reader<'_>) -> Option<Estimate> {
    Some(Estimate {
        estimate: body.i128()?,
        window: body.u64()?,
        staleness_ms: body.u64()?,
    })
}

fn decision(body: &mut Reader<'_>) -> Option<Decision> {
    Some(Decision {
        allowed: body.bool()?,
        estimate: body.i128()?,
        limit: body.u64()?,
        remaining: body.u64()?,
        reset_after_ms: body.u64()?,
        mode: *MODES.get(usize::from(body.variant()?))?,
        staleness_ms: body.u64()?,
        bound: body.f64()?,
    })
}

#[cfg(test)]
mod tests {
    use super::super::{encode_frame, CheckId, Op, Refusal, Request, Status};
    use super::*;

    // Varint forms (`form.rs`).
    const U16_BYTE: u8 = 251;
    const U128_BYTE: u8 = 254;

    const U64S: [u64; 10] = [
        0,
        1,
        250,
        251,
        u16::MAX as u64,
        u16::MAX as u64 + 1,
        u32::MAX as u64,
        u32::MAX as u64 + 1,
        u64::MAX - 1,
        u64::MAX,
    ];

    const I128S: [i128; 12] = [
        0,
        1,
        -1,
        125,
        -125,
        126,
        -126,
        i64::MAX as i128,
        i64::MIN as i128,
        1 << 70,
        i128::MAX,
        i128::MIN,
    ];

    fn bincode_frame<T: serde::Serialize>(message: &T) -> Vec<u8> {
        let mut frame = Vec::new();
        encode_frame(message, &mut frame);
        frame
    }

    /// What the hand decoder makes of a body holding an answer.
    fn counting(body: &[u8]) -> Option<Response> {
        reader(body).and_then(counting_response)
    }

    /// Each op with these fields, borrowed and owned; the counting ops with and without an
    /// id.
    fn ops<'a>(rule: &'a str, subject: &'a str, amount: u64) -> Vec<(OpRef<'a>, Op)> {
        let named = CheckId {
            session: amount,
            seq: amount.rotate_left(32),
        };
        let owned = || (rule.to_owned(), subject.to_owned());
        let mut ops = Vec::new();
        for id in [None, Some(named)] {
            let (owned_rule, owned_subject) = owned();
            ops.push((
                OpRef::Incr {
                    rule,
                    subject,
                    amount,
                    id,
                },
                Op::Incr {
                    rule: owned_rule,
                    subject: owned_subject,
                    amount,
                    id,
                },
            ));
            let (owned_rule, owned_subject) = owned();
            ops.push((
                OpRef::Decr {
                    rule,
                    subject,
                    amount,
                    id,
                },
                Op::Decr {
                    rule: owned_rule,
                    subject: owned_subject,
                    amount,
                    id,
                },
            ));
            let (owned_rule, owned_subject) = owned();
            ops.push((
                OpRef::Check {
                    rule,
                    subject,
                    cost: amount,
                    id,
                },
                Op::Check {
                    rule: owned_rule,
                    subject: owned_subject,
                    cost: amount,
                    id,
                },
            ));
        }
        let (owned_rule, owned_subject) = owned();
        ops.push((
            OpRef::Get { rule, subject },
            Op::Get {
                rule: owned_rule,
                subject: owned_subject,
            },
        ));
        ops.push((OpRef::Status, Op::Status));
        ops
    }

    #[test]
    fn requests_are_encoded_and_decoded_as_bincode_does() {
        let long = "s".repeat(300);
        for id in U64S {
            for amount in U64S {
                for (rule, subject) in [("login", "user-42"), ("", ""), ("r", long.as_str())] {
                    for (borrowed, owned) in ops(rule, subject, amount) {
                        let request = RequestRef { id, op: borrowed };
                        let mut frame = Vec::new();
                        encode_request(&request, &mut frame);
                        let expected = bincode_frame(&Request { id, op: owned });
                        assert_eq!(frame, expected, "id {id}, {borrowed:?}");
                        let body = &frame[4..];
                        assert_eq!(
                            reader(body).and_then(super::request),
                            Some(request),
                            "decoded by hand"
                        );
                        assert_eq!(decode_request(body), Ok(request));
                    }
                }
            }
        }
    }

    #[test]
    fn every_one_byte_change_of_every_request_decodes_as_bincode_decodes_it() {
        // A differential check of the sidecar's decoder on hostile input, through both of
        // its paths (by hand, and bincode's borrowed decoding): whatever one byte is changed
        // to, anywhere, or wherever the body is cut, it must agree with bincode's owned
        // decoding (and never panic).
        for (borrowed, _) in ops("login", "user-42", 300) {
            let body = {
                let mut frame = Vec::new();
                encode_request(
                    &RequestRef {
                        id: 70_000,
                        op: borrowed,
                    },
                    &mut frame,
                );
                frame[4..].to_vec()
            };
            let mut bodies: Vec<Vec<u8>> =
                (0..body.len()).map(|len| body[..len].to_vec()).collect();
            bodies.push([body.as_slice(), &[0]].concat());
            for at in 0..body.len() {
                for byte in [
                    0u8, 1, 2, 5, 7, 127, 128, 0xc3, 250, 251, 252, 253, 254, 255,
                ] {
                    let mut changed = body.clone();
                    changed[at] = byte;
                    bodies.push(changed);
                }
            }
            for changed in bodies {
                let expected = decode_body::<Request>(&changed);
                let decoded = decode_request(&changed).map(|request| request.to_request());
                assert_eq!(decoded, expected, "{changed:?}");
            }
        }
    }

    #[test]
    fn a_request_in_a_form_the_hand_decoder_does_not_take_is_read_by_bincode() {
        let request = RequestRef {
            id: 5,
            op: OpRef::Incr {
                rule: "login",
                subject: "user-42",
                amount: 1,
                id: None,
            },
        };
        let mut frame = Vec::new();
        encode_request(&request, &mut frame);
        // The op's variant index (0) in the 3-byte form: bincode reads it, this decoder not.
        let (head, tail) = frame[4..].split_at(2);
        let body = [head, &[U16_BYTE, 0, 0], &tail[1..]].concat();
        assert_eq!(reader(&body).and_then(super::request), None);
        assert_eq!(decode_request(&body), Ok(request));
        assert_eq!(decode_body::<Request>(&body), Ok(request.to_request()));
    }

    #[test]
    fn a_request_near_the_limit_decodes_as_bincode_decodes_it_though_bincode_counts_more() {
        // bincode counts a value at its size in memory, not its bytes: found in review.
        for len in [CLIENT_FRAME_BYTES_MAX - 200, CLIENT_FRAME_BYTES_MAX - 14] {
            let subject = "s".repeat(len);
            let request = RequestRef {
                id: 5,
                op: OpRef::Get {
                    rule: "r",
                    subject: &subject,
                },
            };
            let mut frame = Vec::new();
            encode_request(&request, &mut frame);
            let body = &frame[4..];
            assert!(body.len() <= CLIENT_FRAME_BYTES_MAX);
            // The ids only, not a printout of the subject if they differ.
            let by_bincode = decode_body_borrowed::<RequestRef<'_>>(body).map(|r| r.id);
            let by_hand = decode_request(body).map(|r| r.id);
            assert_eq!(by_hand, by_bincode, "a body of {} bytes", body.len());
        }
    }

    /// A `Counted` answer to request 5.
    fn counted_response() -> Response {
        Response {
            id: 5,
            result: Ok(Reply::Counted(Estimate {
                estimate: 1,
                window: 2,
                staleness_ms: 3,
            })),
        }
    }

    /// [`counted_response`]'s body, as bincode encodes it.
    fn counted_body() -> Vec<u8> {
        bincode_frame(&counted_response())[4..].to_vec()
    }

    #[test]
    fn a_u64_in_the_128_bit_form_is_refused_as_bincode_refuses_it() {
        let long = |value: u8| [&[U128_BYTE, value][..], &[0; 15]].concat();
        // Status with id 1; an increment with id 5, amount 1, rule "r", subject "s".
        let status = [&[CLIENT_WIRE_VERSION][..], &long(1), &[4]].concat();
        let incr = |id: &[u8], amount: &[u8], rule_len: &[u8]| {
            [
                &[CLIENT_WIRE_VERSION][..],
                id,
                &[0],
                rule_len,
                b"r",
                &[1],
                b"s",
                amount,
                &[0],
            ]
            .concat()
        };
        let bodies = [
            status,
            incr(&long(5), &[1], &[1]),
            incr(&[5], &long(1), &[1]),
            incr(&[5], &[1], &long(1)),
        ];
        assert!(
            decode_request(&incr(&[5], &[1], &[1])).is_ok(),
            "the short forms"
        );
        for body in bodies {
            let expected = decode_body::<Request>(&body);
            assert!(expected.is_err(), "bincode takes {body:?}: {expected:?}");
            assert_eq!(reader(&body).and_then(request), None);
            assert_eq!(
                decode_request(&body).map(|request| request.to_request()),
                expected
            );
        }
        // The same form of a response's id.
        let body = counted_body();
        let long_id = [&body[..1], &long(5), &body[2..]].concat();
        assert!(decode_body::<Response>(&long_id).is_err());
        assert_eq!(decode_response(&long_id), decode_body::<Response>(&long_id));
    }

    #[test]
    fn counting_answers_are_encoded_as_bincode_encodes_them() {
        let others = [
            Err(Refusal::UnknownRule {
                rule: "login".into(),
            }),
            Ok(Reply::Status(Status {
                node: 1,
                generation: 2,
                members: vec![("alive".into(), 3)],
                keys: 4,
            })),
        ];
        let results = counting_replies().into_iter().map(Ok).chain(others);
        for result in results {
            for id in U64S {
                let response = Response {
                    id,
                    result: result.clone(),
                };
                let mut frame = Vec::new();
                encode_response(&response, &mut frame);
                assert_eq!(frame, bincode_frame(&response), "{response:?}");
            }
        }
    }

    fn counting_replies() -> Vec<Reply> {
        let mut replies = Vec::new();
        for (i, estimate) in I128S.into_iter().enumerate() {
            let n = U64S[i % U64S.len()];
            let m = U64S[(i + 3) % U64S.len()];
            let counted = Estimate {
                estimate,
                window: n,
                staleness_ms: m,
            };
            replies.push(Reply::Counted(counted));
            replies.push(Reply::Estimate(counted));
            for (mode, allowed) in [
                (Mode::ApproximateConnected, true),
                (Mode::ApproximateIsolated, false),
                (Mode::Exact, true),
                (Mode::RegionFallback, false),
            ] {
                replies.push(Reply::Decision(Decision {
                    allowed,
                    estimate,
                    limit: m,
                    remaining: n,
                    reset_after_ms: n / 3,
                    mode,
                    staleness_ms: m / 7,
                    bound: estimate as f64 / 3.0,
                }));
            }
        }
        replies
    }

    #[test]
    fn counting_answers_decode_as_bincode_decodes_them() {
        for id in U64S {
            for reply in counting_replies() {
                let response = Response {
                    id,
                    result: Ok(reply),
                };
                let frame = bincode_frame(&response);
                let body = &frame[4..];
                assert!(counting(body).is_some(), "{response:?}");
                assert_eq!(decode_response(body), Ok(response));
            }
        }
    }

    #[test]
    fn other_answers_go_to_bincode() {
        let others = [
            Err(Refusal::UnknownRule {
                rule: "login".into(),
            }),
            Err(Refusal::Overflow),
            Ok(Reply::Status(Status {
                node: 1,
                generation: 2,
                members: vec![("alive".into(), 3)],
                keys: 4,
            })),
        ];
        for result in others {
            let response = Response { id: 9, result };
            let frame = bincode_frame(&response);
            assert!(counting(&frame[4..]).is_none());
            assert_eq!(decode_response(&frame[4..]), Ok(response));
        }
    }

    #[test]
    fn unusual_forms_and_bad_bodies_get_bincode_s_answer() {
        let response = counted_response();
        let body = counted_body();
        // The id 5 in the 3-byte form: bincode reads it, and so does this decoder.
        let mut long_id = vec![body[0], U16_BYTE, 5, 0];
        long_id.extend(&body[2..]);
        assert_eq!(decode_response(&long_id), Ok(response.clone()));
        // Truncated at every length, and with a trailing byte.
        let mut bodies: Vec<Vec<u8>> = (0..body.len()).map(|len| body[..len].to_vec()).collect();
        bodies.push([body.as_slice(), &[0]].concat());
        let decision = Response {
            id: 5,
            result: Ok(Reply::Decision(Decision {
                allowed: true,
                estimate: 1,
                limit: 2,
                remaining: 1,
                reset_after_ms: 4,
                mode: Mode::Exact,
                staleness_ms: 0,
                bound: 0.0,
            })),
        };
        let decision = bincode_frame(&decision)[4..].to_vec();
        let with_byte = |body: &[u8], at: usize, byte: u8| {
            let mut body = body.to_vec();
            body[at] = byte;
            body
        };
        bodies.extend([
            with_byte(&body, 0, 9),     // a version this build does not speak
            with_byte(&body, 3, 7),     // an unknown reply
            with_byte(&decision, 4, 2), // a boolean that is neither 0 nor 1
            with_byte(&decision, 9, 4), // an unknown mode
        ]);
        for bad in bodies {
            let expected = decode_body::<Response>(&bad);
            assert!(expected.is_err(), "{bad:?} decodes: {expected:?}");
            assert_eq!(decode_response(&bad), expected, "{bad:?}");
        }
    }

    #[test]
    fn every_one_byte_change_of_every_counting_answer_decodes_as_bincode_decodes_it() {
        // A differential check of the hand decoder on hostile input: whatever one byte is
        // changed to, anywhere, it must agree with bincode (and never panic).
        for reply in counting_replies() {
            let response = Response {
                id: 300,
                result: Ok(reply),
            };
            let body = bincode_frame(&response)[4..].to_vec();
            for at in 0..body.len() {
                for byte in [0u8, 1, 2, 7, 127, 128, 250, 251, 252, 253, 254, 255] {
                    let mut changed = body.clone();
                    changed[at] = byte;
                    let expected = decode_body::<Response>(&changed);
                    assert_eq!(decode_response(&changed), expected, "{changed:?}");
                }
            }
        }
    }
}
