//! The region protocol's messages and their encoding, in one place so the format can be
//! swapped: a version byte, then bincode 2.0.1 (standard config) decoded with a limit.
//!
//! An edge keeps one long-lived bidirectional stream, a *session*, to the region. It
//! writes frames of checks ([`encode_checks`]); the region answers each frame with one
//! frame of answers ([`encode_answers`]), in the order its frames arrived, once every
//! check in it is durable. On the stream, each frame is a 4-byte little-endian length and
//! that many bytes (the transport's framing, as for gossip).

use super::log::RequestId;
use serde::{Deserialize, Serialize};
use tally_client::wire::CheckId;
use tally_crdt::{RULE_BYTES_MAX, SUBJECT_BYTES_MAX};

/// The region protocol version this build speaks: the first byte of every frame's body.
/// Version 4 added the answer [`ExactAnswer::KeysFull`].
pub const REGION_WIRE_VERSION: u8 = 4;

/// The earliest version of a frame of checks the region takes: an edge of an earlier build
/// speaks it during an upgrade. Checks encode alike in both; the region answers each frame
/// in its version, a version 3 frame without [`ExactAnswer::KeysFull`], which that edge
/// could not decode ([`encode_answers_in`]).
pub const REGION_WIRE_VERSION_MIN: u8 = 3;

/// The most checks an edge puts in one frame.
pub const CHECKS_PER_FRAME_MAX: usize = 512;

/// The longest a `Storage` answer's reason is sent, in bytes.
pub const STORAGE_WHY_BYTES_MAX: usize = 256;

/// The largest region frame either way: [`CHECKS_PER_FRAME_MAX`] checks (or answers) of
/// the largest size, with room to spare.
pub const REGION_FRAME_BYTES_MAX: usize = 256 * 1024;

// A check's largest encoding: three varint ids (9 bytes each), a check id (a tag and two
// varints), two strings of at most their bound with a varint length (3 bytes), window
// index, window length and cost.
const CHECK_BYTES_MAX: usize =
    3 * 9 + (1 + 2 * 9) + (RULE_BYTES_MAX + 3) + (SUBJECT_BYTES_MAX + 3) + 9 + 5 + 9;
// An answer's largest: a sequence number, a tag, and the longest of its variants.
const ANSWER_BYTES_MAX: usize = 9 + 1 + (STORAGE_WHY_BYTES_MAX + 3);
const _: () = assert!(1 + 3 + CHECKS_PER_FRAME_MAX * CHECK_BYTES_MAX <= REGION_FRAME_BYTES_MAX);
const _: () = assert!(1 + 3 + CHECKS_PER_FRAME_MAX * ANSWER_BYTES_MAX <= REGION_FRAME_BYTES_MAX);

const CONFIG: bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<REGION_FRAME_BYTES_MAX>,
> = bincode::config::standard().with_limit::<REGION_FRAME_BYTES_MAX>();

/// An exact check, as an edge forwards it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExactCheck {
    /// Unique per edge life; the edge's retries reuse it. Its sequence number names the
    /// check's answer.
    pub id: RequestId,
    /// The application's name for the check across its own retries, if it gave one: the
    /// region decides and remembers the check under it ([`ExactCheck::dedupe_id`]), so a
    /// retry through another edge, or another life of this one, gets the first outcome.
    pub check_id: Option<CheckId>,
    /// The rule's name (the region holds the same rules).
    pub rule: String,
    /// The subject.
    pub subject: String,
    /// The window's index, fixed by the edge.
    pub window_index: u64,
    /// The window's length.
    pub window_secs: u32,
    /// The check's cost.
    pub cost: u64,
}

/// An exact check as an edge writes it: encodes exactly as the [`ExactCheck`] with the same
/// fields, its strings borrowed from the key the edge holds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CheckRef<'a> {
    /// See [`ExactCheck::id`].
    pub id: RequestId,
    /// See [`ExactCheck::check_id`].
    pub check_id: Option<CheckId>,
    /// See [`ExactCheck::rule`].
    pub rule: &'a str,
    /// See [`ExactCheck::subject`].
    pub subject: &'a str,
    /// See [`ExactCheck::window_index`].
    pub window_index: u64,
    /// See [`ExactCheck::window_secs`].
    pub window_secs: u32,
    /// See [`ExactCheck::cost`].
    pub cost: u64,
}

impl ExactCheck {
    /// The id the region decides and remembers the check under: the application's
    /// ([`RequestId::client`]) if it gave one, else the edge's.
    pub fn dedupe_id(&self) -> RequestId {
        self.check_id.map_or(self.id, RequestId::client)
    }

    /// The check, borrowed for encoding.
    pub fn as_ref(&self) -> CheckRef<'_> {
        CheckRef {
            id: self.id,
            check_id: self.check_id,
            rule: &self.rule,
            subject: &self.subject,
            window_index: self.window_index,
            window_secs: self.window_secs,
            cost: self.cost,
        }
    }
}

/// The region's answer to one check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExactAnswer {
    /// Decided and durable.
    Decided(Outcome),
    /// The region has no such exact rule, or the check's window is not live by its clock.
    UnknownRule,
    /// The region could not make the decision durable; nothing was acknowledged. The
    /// region's log error, cut to [`STORAGE_WHY_BYTES_MAX`].
    Storage(String),
    /// A retry of a request id older than the region remembers for its edge life
    /// ([`super::RECENT_IDS`]) or application session ([`super::RECENT_CLIENT_IDS`]); it
    /// was decided once (or its number skipped, never to be decided) and is not decided
    /// again.
    Forgotten,
    /// The check would add a key to the region's ledger, which holds its maximum of keys
    /// (the region's `keys_max`): not decided, nothing counted. Sent again once windows
    /// have ended and made room, it is decided then.
    KeysFull {
        /// The region's maximum.
        keys_max: u64,
    },
}

/// A decision on the authoritative count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// Whether the check was admitted (and counted).
    pub allowed: bool,
    /// The authoritative count after the decision.
    pub count: u64,
}

/// One check's answer in a frame of answers: the check's sequence number (its edge life is
/// the session's), and the answer.
pub type Answered = (u64, ExactAnswer);

impl ExactAnswer {
    /// A `Storage` answer, its reason cut to what a frame carries.
    pub fn storage(why: &str) -> ExactAnswer {
        let mut end = why.len().min(STORAGE_WHY_BYTES_MAX);
        while !why.is_char_boundary(end) {
            end -= 1;
        }
        ExactAnswer::Storage(why[..end].to_owned())
    }
}

/// A frame of checks, length prefix included.
pub fn encode_checks(checks: &[CheckRef<'_>]) -> Vec<u8> {
    assert!(
        checks.len() <= CHECKS_PER_FRAME_MAX,
        "a frame holds at most {CHECKS_PER_FRAME_MAX} checks"
    );
    encode_frame(REGION_WIRE_VERSION, &checks)
}

/// A frame of answers, length prefix included.
pub fn encode_answers(answers: &[Answered]) -> Vec<u8> {
    encode_frame(REGION_WIRE_VERSION, &answers)
}

/// A frame of answers in `version`, that of the frame of checks it answers: in version 3 a
/// `KeysFull` answer goes as `Storage` naming the cap, which an edge of that version
/// decodes (retryable, and no fallback of a rule answers it instead).
pub fn encode_answers_in(version: u8, answers: &[Answered]) -> Vec<u8> {
    if version >= 4 {
        return encode_answers(answers);
    }
    let answers: Vec<Answered> = (answers.iter().cloned())
        .map(|(seq, answer)| match answer {
            ExactAnswer::KeysFull { keys_max } => (
                seq,
                ExactAnswer::storage(&format!(
                    "the region holds its maximum of {keys_max} keys; nothing counted"
                )),
            ),
            answer => (seq, answer),
        })
        .collect();
    encode_frame(version, &answers)
}

/// Decodes a frame's body (after its length prefix) of checks, of a version from
/// [`REGION_WIRE_VERSION_MIN`] to this build's: the version and the checks. `None` for
/// another version, more than [`CHECKS_PER_FRAME_MAX`] checks, a bad body, or trailing
/// bytes.
pub fn decode_checks(body: &[u8]) -> Option<(u8, Vec<ExactCheck>)> {
    let (&version, _) = body.split_first()?;
    let versions = REGION_WIRE_VERSION_MIN..=REGION_WIRE_VERSION;
    decode_body::<Vec<ExactCheck>>(body, versions)
        .filter(|checks| checks.len() <= CHECKS_PER_FRAME_MAX)
        .map(|checks| (version, checks))
}

/// Decodes a frame's body of answers, as [`decode_checks`] does, of this build's version
/// only.
pub fn decode_answers(body: &[u8]) -> Option<Vec<Answered>> {
    decode_body::<Vec<Answered>>(body, REGION_WIRE_VERSION..=REGION_WIRE_VERSION)
}

fn encode_frame<T: Serialize>(version: u8, message: &T) -> Vec<u8> {
    let mut frame = vec![0, 0, 0, 0, version];
    bincode::serde::encode_into_std_write(message, &mut frame, CONFIG)
        .expect("invariant: bincode encodes plain checks or answers into a Vec");
    let len = u32::try_from(frame.len() - 4).expect("invariant: frames are below 4 GiB");
    frame[..4].copy_from_slice(&len.to_le_bytes());
    frame
}

fn decode_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    versions: std::ops::RangeInclusive<u8>,
) -> Option<T> {
    let (&version, rest) = body.split_first()?;
    if !versions.contains(&version) || body.len() > REGION_FRAME_BYTES_MAX {
        return None;
    }
    let (message, read) = bincode::serde::decode_from_slice(rest, CONFIG).ok()?;
    (read == rest.len()).then_some(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(seq: u64, subject: &str) -> ExactCheck {
        ExactCheck {
            id: RequestId {
                node: u64::MAX,
                generation: u64::MAX,
                seq,
            },
            check_id: Some(CheckId {
                session: u64::MAX,
                seq: u64::MAX,
            }),
            rule: "r".repeat(RULE_BYTES_MAX),
            subject: subject.to_owned(),
            window_index: u64::MAX,
            window_secs: u32::MAX,
            cost: u64::MAX,
        }
    }

    fn body(frame: &[u8]) -> &[u8] {
        let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4, "the prefix is the body's length");
        &frame[4..]
    }

    #[test]
    fn a_full_frame_of_the_largest_checks_round_trips_under_the_limit() {
        let checks: Vec<ExactCheck> = (0..CHECKS_PER_FRAME_MAX as u64)
            .map(|seq| check(u64::MAX - seq, &"s".repeat(SUBJECT_BYTES_MAX)))
            .collect();
        let frame = encode_checks(&checks.iter().map(ExactCheck::as_ref).collect::<Vec<_>>());
        assert!(frame.len() <= REGION_FRAME_BYTES_MAX);
        assert_eq!(
            decode_checks(body(&frame)),
            Some((REGION_WIRE_VERSION, checks))
        );
    }

    #[test]
    fn a_full_frame_of_the_largest_answers_round_trips_under_the_limit() {
        let why = "é".repeat(STORAGE_WHY_BYTES_MAX);
        let answers: Vec<Answered> = (0..CHECKS_PER_FRAME_MAX as u64)
            .map(|seq| (u64::MAX - seq, ExactAnswer::storage(&why)))
            .collect();
        let ExactAnswer::Storage(cut) = &answers[0].1 else {
            panic!()
        };
        assert!(cut.len() <= STORAGE_WHY_BYTES_MAX && why.starts_with(cut.as_str()));
        let frame = encode_answers(&answers);
        assert!(frame.len() <= REGION_FRAME_BYTES_MAX);
        assert_eq!(decode_answers(body(&frame)), Some(answers));
    }

    #[test]
    fn an_edge_of_version_3_is_answered_in_version_3_its_keys_full_as_storage() {
        let frame = encode_checks(&[check(1, "a").as_ref()]);
        let mut earlier = body(&frame).to_vec();
        earlier[0] = 3;
        assert_eq!(decode_checks(&earlier), Some((3, vec![check(1, "a")])));
        let answers = [
            (1, ExactAnswer::KeysFull { keys_max: 9 }),
            (2, ExactAnswer::Forgotten),
        ];
        let in_3 = encode_answers_in(3, &answers);
        assert_eq!(body(&in_3)[0], 3);
        assert_eq!(
            decode_answers(body(&in_3)),
            None,
            "not this build's version"
        );
        let mut as_4 = body(&in_3).to_vec();
        as_4[0] = REGION_WIRE_VERSION;
        assert_eq!(
            decode_answers(&as_4),
            Some(vec![
                (
                    1,
                    ExactAnswer::Storage(
                        "the region holds its maximum of 9 keys; nothing counted".into()
                    )
                ),
                (2, ExactAnswer::Forgotten),
            ]),
            "version 3's variants encode alike in 4"
        );
        let in_4 = encode_answers_in(REGION_WIRE_VERSION, &answers);
        assert_eq!(decode_answers(body(&in_4)), Some(answers.to_vec()));
    }

    #[test]
    fn bad_frames_are_refused() {
        let frame = encode_checks(&[check(1, "a").as_ref()]);
        let good = body(&frame);
        assert!(decode_checks(good).is_some());
        for version in [REGION_WIRE_VERSION_MIN - 1, REGION_WIRE_VERSION + 1] {
            let mut other_version = good.to_vec();
            other_version[0] = version;
            assert_eq!(decode_checks(&other_version), None, "version {version}");
        }
        let mut trailing = good.to_vec();
        trailing.push(0);
        assert_eq!(decode_checks(&trailing), None, "trailing bytes");
        for cut in 0..good.len() {
            assert_eq!(decode_checks(&good[..cut]), None, "cut at {cut}");
        }
        let too_many = vec![check(1, "a"); CHECKS_PER_FRAME_MAX + 1];
        let mut frame = vec![REGION_WIRE_VERSION];
        bincode::serde::encode_into_std_write(&too_many, &mut frame, CONFIG).unwrap();
        assert_eq!(
            decode_checks(&frame),
            None,
            "more checks than a frame may hold"
        );
        let huge_len = [
            REGION_WIRE_VERSION,
            0xfd,
            0xff,
            0xff,
            0xff,
            0xff,
            0xff,
            0xff,
            0xff,
            0xff,
        ];
        assert_eq!(
            decode_checks(&huge_len),
            None,
            "a length prefix of 2^64 - 1"
        );
    }
}
