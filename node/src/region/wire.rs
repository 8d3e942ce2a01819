//! The region protocol's messages and their encoding, in one place so the format can be
//! swapped: a version byte, then bincode 2.0.1 (standard config) decoded with a limit.
//!
//! Frames go by hand both ways, to the same bytes as bincode's, with
//! `tally_client::wire::form` (bincode's varints through serde were a tenth of the region's
//! CPU per check at 50 x 64 exact checks in flight through an edge, session 39's profile,
//! and as much of the edge's). The hand decoders take the forms bincode writes; a body they
//! do not take (an unusual varint form, a bad frame) goes to bincode, which decides it, so
//! an error is always bincode's. The tests hold both to bincode's bytes and answers.
//!
//! An edge keeps one long-lived bidirectional stream, a *session*, to the region. It
//! writes frames of checks ([`encode_checks`]); the region answers each frame with one
//! frame of answers ([`encode_answers`]), in the order its frames arrived, once every
//! check in it is durable. On the stream, each frame is a 4-byte little-endian length and
//! that many bytes (the transport's framing, as for gossip).

use super::log::RequestId;
use crate::recent::Asked;
use serde::{Deserialize, Serialize};
use tally_client::wire::form::{self, Reader};
use tally_client::wire::CheckId;
use tally_crdt::{RULE_BYTES_MAX, SUBJECT_BYTES_MAX};

/// The region protocol version this build speaks: the first byte of every frame's body.
/// Version 4 added the answer [`ExactAnswer::KeysFull`], version 5
/// [`ExactAnswer::IdReused`] and [`ExactAnswer::NoRule`].
pub const REGION_WIRE_VERSION: u8 = 5;

/// The earliest version of a frame of checks the region takes: an edge of an earlier build
/// speaks it during an upgrade. Checks encode alike in all; the region answers each frame
/// in its version, without the answers added after it, which that edge could not decode
/// ([`encode_answers_in`]).
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

    /// What the check asks: its rule, subject and cost, whatever its window.
    pub fn asked(&self) -> Asked {
        Asked::named(&self.rule, &self.subject, self.cost)
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
    /// The check's window is not live by the region's clock (before version 5: or the
    /// region has no such exact rule, now [`ExactAnswer::NoRule`]).
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
    /// The check names an application's id ([`ExactCheck::check_id`]) that the region
    /// decided for another check: another rule, subject or cost. Not decided, nothing
    /// counted: an id names one check.
    IdReused,
    /// The region has no exact rule of the check's name and window length (a
    /// misconfiguration), and no memory of the check: it never decided it, however often
    /// it was sent. Version 5; an earlier edge gets `UnknownRule`.
    NoRule,
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
        ExactAnswer::Storage(storage_why(why).to_owned())
    }
}

/// A `Storage` answer's reason, cut to [`STORAGE_WHY_BYTES_MAX`] at a character boundary:
/// as the region sends it, and as an edge takes it from a frame, whose lengths it does not
/// trust (its client's frames hold at most 64 KiB).
pub fn storage_why(why: &str) -> &str {
    let mut end = why.len().min(STORAGE_WHY_BYTES_MAX);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    &why[..end]
}

// `ExactAnswer`'s variant indexes, in the order it declares them.
const DECIDED: u8 = 0;
const UNKNOWN_RULE: u8 = 1;
const STORAGE: u8 = 2;
const FORGOTTEN: u8 = 3;
const KEYS_FULL: u8 = 4;
const ID_REUSED: u8 = 5;
const NO_RULE: u8 = 6;

/// A frame of checks, length prefix included.
pub fn encode_checks(checks: &[CheckRef<'_>]) -> Vec<u8> {
    assert!(
        checks.len() <= CHECKS_PER_FRAME_MAX,
        "a frame holds at most {CHECKS_PER_FRAME_MAX} checks"
    );
    framed(REGION_WIRE_VERSION, checks, put_check)
}

/// A frame of answers, length prefix included.
pub fn encode_answers(answers: &[Answered]) -> Vec<u8> {
    framed(REGION_WIRE_VERSION, answers, put_answer)
}

/// A frame of answers in `version`, that of the frame of checks it answers: an answer
/// added after that version goes as `Storage` saying why, which an edge of that version
/// decodes (retryable, and no fallback of a rule answers it instead): before version 4 a
/// `KeysFull`, before version 5 an `IdReused`; and before version 5 a `NoRule` goes as
/// `UnknownRule`, as it did then.
pub fn encode_answers_in(version: u8, answers: &[Answered]) -> Vec<u8> {
    if version >= REGION_WIRE_VERSION {
        return encode_answers(answers);
    }
    let answers: Vec<Answered> = (answers.iter().cloned())
        .map(|(seq, answer)| match answer {
            ExactAnswer::KeysFull { keys_max } if version < 4 => (
                seq,
                ExactAnswer::storage(&format!(
                    "the region holds its maximum of {keys_max} keys; nothing counted"
                )),
            ),
            ExactAnswer::IdReused => (
                seq,
                ExactAnswer::storage(
                    "the check's id named another check (rule, subject or cost) at the \
                     region; nothing counted: a new check needs a new id",
                ),
            ),
            ExactAnswer::NoRule => (seq, ExactAnswer::UnknownRule),
            answer => (seq, answer),
        })
        .collect();
    framed(version, &answers, put_answer)
}

/// Decodes a frame's body (after its length prefix) of checks, of a version from
/// [`REGION_WIRE_VERSION_MIN`] to this build's: the version and the checks. `None` for
/// another version, more than [`CHECKS_PER_FRAME_MAX`] checks, a bad body, or trailing
/// bytes.
pub fn decode_checks(body: &[u8]) -> Option<(u8, Vec<ExactCheck>)> {
    let (&version, _) = body.split_first()?;
    let versions = REGION_WIRE_VERSION_MIN..=REGION_WIRE_VERSION;
    let checks = match reader(body, versions.clone()).and_then(|body| all(body, check)) {
        Some(checks) => Some(checks),
        None => decode_body::<Vec<ExactCheck>>(body, versions),
    };
    checks
        .filter(|checks| checks.len() <= CHECKS_PER_FRAME_MAX)
        .map(|checks| (version, checks))
}

/// Decodes a frame's body of answers, as [`decode_checks`] does, of this build's version
/// only.
pub fn decode_answers(body: &[u8]) -> Option<Vec<Answered>> {
    let versions = REGION_WIRE_VERSION..=REGION_WIRE_VERSION;
    match reader(body, versions.clone()).and_then(|body| all(body, answer)) {
        Some(answers) => Some(answers),
        None => decode_body::<Vec<Answered>>(body, versions),
    }
}

/// A frame of `items`, length prefix included: the version byte, then the items as a
/// bincode sequence, each written by `put`.
fn framed<T>(version: u8, items: &[T], put: fn(&mut Vec<u8>, &T)) -> Vec<u8> {
    let mut frame = vec![0, 0, 0, 0, version];
    form::put_varint(&mut frame, items.len() as u64);
    for item in items {
        put(&mut frame, item);
    }
    let len = u32::try_from(frame.len() - 4).expect("invariant: frames are below 4 GiB");
    frame[..4].copy_from_slice(&len.to_le_bytes());
    frame
}

fn put_check(out: &mut Vec<u8>, check: &CheckRef<'_>) {
    let RequestId {
        node,
        generation,
        seq,
    } = check.id;
    for n in [node, generation, seq] {
        form::put_varint(out, n);
    }
    form::put_check_id(out, check.check_id);
    form::put_str(out, check.rule);
    form::put_str(out, check.subject);
    form::put_varint(out, check.window_index);
    form::put_varint(out, u64::from(check.window_secs));
    form::put_varint(out, check.cost);
}

fn put_answer(out: &mut Vec<u8>, (seq, answer): &Answered) {
    form::put_varint(out, *seq);
    match answer {
        ExactAnswer::Decided(Outcome { allowed, count }) => {
            out.extend_from_slice(&[DECIDED, u8::from(*allowed)]);
            form::put_varint(out, *count);
        }
        ExactAnswer::UnknownRule => out.push(UNKNOWN_RULE),
        ExactAnswer::Storage(why) => {
            out.push(STORAGE);
            form::put_str(out, why);
        }
        ExactAnswer::Forgotten => out.push(FORGOTTEN),
        ExactAnswer::KeysFull { keys_max } => {
            out.push(KEYS_FULL);
            form::put_varint(out, *keys_max);
        }
        ExactAnswer::IdReused => out.push(ID_REUSED),
        ExactAnswer::NoRule => out.push(NO_RULE),
    }
}

/// The most that bincode's limit counts beyond a body's bytes: it counts each value at its
/// size in memory (a `u64` as 8 bytes however short its varint, a variant index as 4), a
/// string at its length. So a check's values but its strings' bytes count at most 77 (an
/// answer's 21), and the sequence's length 8.
const COUNTED_BEYOND_BYTES_MAX: usize = 8 + CHECKS_PER_FRAME_MAX * 77;

/// A reader of a body's bincode, past its version byte; `None` for a body of a version not
/// in `versions`, or too near the limit for bincode's count of it to be under it too: that
/// body goes to bincode, which decides (found in review, session 39: a body of 262,140
/// bytes was taken here and refused by bincode). The largest frames an edge or a region
/// writes are well under it.
fn reader(body: &[u8], versions: std::ops::RangeInclusive<u8>) -> Option<Reader<'_>> {
    let (version, rest) = body.split_first()?;
    let within = body.len() + COUNTED_BEYOND_BYTES_MAX <= REGION_FRAME_BYTES_MAX;
    (versions.contains(version) && within).then(|| Reader::new(rest))
}

const _: () = assert!(
    1 + 3 + CHECKS_PER_FRAME_MAX * CHECK_BYTES_MAX + COUNTED_BEYOND_BYTES_MAX
        <= REGION_FRAME_BYTES_MAX,
    "a full frame of the largest checks is read by hand"
);

/// A whole body's sequence, each item read by `item`: `None` for a sequence longer than a
/// frame holds, or bytes left over.
fn all<T>(mut body: Reader<'_>, item: fn(&mut Reader<'_>) -> Option<T>) -> Option<Vec<T>> {
    let len = usize::try_from(body.u64()?).ok()?;
    if len > CHECKS_PER_FRAME_MAX {
        return None;
    }
    let items = (0..len)
        .map(|_| item(&mut body))
        .collect::<Option<Vec<T>>>()?;
    body.is_empty().then_some(items)
}

fn check(body: &mut Reader<'_>) -> Option<ExactCheck> {
    Some(ExactCheck {
        id: RequestId {
            node: body.u64()?,
            generation: body.u64()?,
            seq: body.u64()?,
        },
        check_id: body.check_id()?,
        rule: body.str()?.to_owned(),
        subject: body.str()?.to_owned(),
        window_index: body.u64()?,
        window_secs: body.u32()?,
        cost: body.u64()?,
    })
}

fn answer(body: &mut Reader<'_>) -> Option<Answered> {
    let seq = body.u64()?;
    let answer = match body.variant()? {
        DECIDED => ExactAnswer::Decided(Outcome {
            allowed: body.bool()?,
            count: body.u64()?,
        }),
        UNKNOWN_RULE => ExactAnswer::UnknownRule,
        STORAGE => ExactAnswer::Storage(body.str()?.to_owned()),
        FORGOTTEN => ExactAnswer::Forgotten,
        KEYS_FULL => ExactAnswer::KeysFull {
            keys_max: body.u64()?,
        },
        ID_REUSED => ExactAnswer::IdReused,
        NO_RULE => ExactAnswer::NoRule,
        _ => return None,
    };
    Some((seq, answer))
}

fn decode_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    versions: std::ops::RangeInclusive<u8>,
) -> Option<T> {
    #[cfg(test)]
    tests::BINCODE_READS.with(|reads| reads.set(reads.get() + 1));
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
    use proptest::prelude::*;
    use std::cell::Cell;

    thread_local! {
        /// How many bodies this thread has handed to bincode ([`decode_body`]).
        pub(super) static BINCODE_READS: Cell<usize> = const { Cell::new(0) };
    }

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
    fn an_edge_of_an_earlier_version_is_answered_in_it_the_answers_added_since_as_storage() {
        let answers = [
            (1, ExactAnswer::KeysFull { keys_max: 9 }),
            (2, ExactAnswer::Forgotten),
            (3, ExactAnswer::IdReused),
            (4, ExactAnswer::NoRule),
        ];
        let keys_full =
            ExactAnswer::Storage("the region holds its maximum of 9 keys; nothing counted".into());
        let id_reused = ExactAnswer::Storage(
            "the check's id named another check (rule, subject or cost) at the region; \
             nothing counted: a new check needs a new id"
                .into(),
        );
        let expected = [
            (
                3,
                [
                    keys_full,
                    ExactAnswer::Forgotten,
                    id_reused.clone(),
                    ExactAnswer::UnknownRule,
                ],
            ),
            (
                4,
                [
                    answers[0].1.clone(),
                    ExactAnswer::Forgotten,
                    id_reused,
                    ExactAnswer::UnknownRule,
                ],
            ),
        ];
        for (version, expected) in expected {
            let frame = encode_checks(&[check(1, "a").as_ref()]);
            let mut earlier = body(&frame).to_vec();
            earlier[0] = version;
            assert_eq!(
                decode_checks(&earlier),
                Some((version, vec![check(1, "a")]))
            );
            let answered = encode_answers_in(version, &answers);
            assert_eq!(body(&answered)[0], version);
            assert_eq!(
                decode_answers(body(&answered)),
                None,
                "not this build's version"
            );
            let mut as_this = body(&answered).to_vec();
            as_this[0] = REGION_WIRE_VERSION;
            let expected: Vec<Answered> = (1..).zip(expected).collect();
            assert_eq!(
                decode_answers(&as_this),
                Some(expected),
                "version {version}'s variants encode alike in this one"
            );
        }
        let in_this = encode_answers_in(REGION_WIRE_VERSION, &answers);
        assert_eq!(decode_answers(body(&in_this)), Some(answers.to_vec()));
    }

    /// The frame bincode writes for `message`, as the region wrote every frame until
    /// session 39.
    fn bincode_frame<T: Serialize>(version: u8, message: &T) -> Vec<u8> {
        let mut frame = vec![0, 0, 0, 0, version];
        bincode::serde::encode_into_std_write(message, &mut frame, CONFIG).unwrap();
        let len = u32::try_from(frame.len() - 4).unwrap();
        frame[..4].copy_from_slice(&len.to_le_bytes());
        frame
    }

    /// bincode's answer for a body of checks, as `decode_checks` gave it until session 39.
    fn bincode_checks(body: &[u8]) -> Option<(u8, Vec<ExactCheck>)> {
        let versions = REGION_WIRE_VERSION_MIN..=REGION_WIRE_VERSION;
        let checks = decode_body::<Vec<ExactCheck>>(body, versions)?;
        (checks.len() <= CHECKS_PER_FRAME_MAX).then(|| (body[0], checks))
    }

    fn bincode_answers(body: &[u8]) -> Option<Vec<Answered>> {
        decode_body::<Vec<Answered>>(body, REGION_WIRE_VERSION..=REGION_WIRE_VERSION)
    }

    /// Values at each of bincode's varint forms' bounds.
    fn varint() -> impl Strategy<Value = u64> {
        prop_oneof![
            prop::sample::select(vec![
                0,
                250,
                251,
                u64::from(u16::MAX),
                1 << 16,
                u64::from(u32::MAX),
                1 << 32,
                u64::MAX,
            ]),
            any::<u64>(),
        ]
    }

    fn any_check() -> impl Strategy<Value = ExactCheck> {
        let ids = (varint(), varint(), varint());
        let check_id = prop::option::of((varint(), varint()));
        let names = ("[a-z]{1,64}", ".{0,300}");
        let rest = (varint(), any::<u32>(), varint());
        (ids, check_id, names, rest).prop_map(
            |(
                (node, generation, seq),
                check_id,
                (rule, subject),
                (window_index, window_secs, cost),
            )| {
                ExactCheck {
                    id: RequestId {
                        node,
                        generation,
                        seq,
                    },
                    check_id: check_id.map(|(session, seq)| CheckId { session, seq }),
                    rule,
                    subject,
                    window_index,
                    window_secs,
                    cost,
                }
            },
        )
    }

    fn any_answer() -> impl Strategy<Value = Answered> {
        let answer = prop_oneof![
            (any::<bool>(), varint())
                .prop_map(|(allowed, count)| ExactAnswer::Decided(Outcome { allowed, count })),
            Just(ExactAnswer::UnknownRule),
            ".{0,300}".prop_map(ExactAnswer::Storage),
            Just(ExactAnswer::Forgotten),
            varint().prop_map(|keys_max| ExactAnswer::KeysFull { keys_max }),
            Just(ExactAnswer::IdReused),
            Just(ExactAnswer::NoRule),
        ];
        (varint(), answer)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1_000))]

        #[test]
        fn frames_are_written_and_read_as_bincode_writes_and_reads_them(
            checks in prop::collection::vec(any_check(), 0..6),
            answers in prop::collection::vec(any_answer(), 0..6),
            version in REGION_WIRE_VERSION_MIN..=REGION_WIRE_VERSION,
        ) {
            let borrowed: Vec<CheckRef<'_>> = checks.iter().map(ExactCheck::as_ref).collect();
            let frame = encode_checks(&borrowed);
            prop_assert_eq!(&frame, &bincode_frame(REGION_WIRE_VERSION, &checks));
            prop_assert_eq!(
                decode_checks(body(&frame)),
                Some((REGION_WIRE_VERSION, checks))
            );
            let frame = encode_answers(&answers);
            prop_assert_eq!(&frame, &bincode_frame(REGION_WIRE_VERSION, &answers));
            prop_assert_eq!(decode_answers(body(&frame)), Some(answers.clone()));
            let in_version = encode_answers_in(version, &answers);
            prop_assert_eq!(body(&in_version)[0], version);
        }

        #[test]
        fn every_one_byte_change_of_a_frame_decodes_as_bincode_decodes_it(
            checks in prop::collection::vec(any_check(), 1..3),
            answers in prop::collection::vec(any_answer(), 1..4),
            at in any::<prop::sample::Index>(),
            to in any::<u8>(),
        ) {
            let frame = encode_checks(&checks.iter().map(ExactCheck::as_ref).collect::<Vec<_>>());
            let mut changed = body(&frame).to_vec();
            let at_checks = at.index(changed.len());
            changed[at_checks] = to;
            prop_assert_eq!(decode_checks(&changed), bincode_checks(&changed));
            let frame = encode_answers(&answers);
            let mut changed = body(&frame).to_vec();
            let at_answers = at.index(changed.len());
            changed[at_answers] = to;
            prop_assert_eq!(decode_answers(&changed), bincode_answers(&changed));
        }
    }

    #[test]
    fn every_one_byte_change_of_a_small_frame_to_every_value_decodes_as_bincode_decodes_it() {
        let named = ExactCheck {
            check_id: Some(CheckId {
                session: 300,
                seq: 70_000,
            }),
            ..check(251, "s")
        };
        let frames = [
            encode_checks(&[named.as_ref(), check(7, "").as_ref()]),
            encode_answers(&[
                (
                    1,
                    ExactAnswer::Decided(Outcome {
                        allowed: true,
                        count: 300,
                    }),
                ),
                (2, ExactAnswer::UnknownRule),
                (3, ExactAnswer::Storage("disk".into())),
                (4, ExactAnswer::Forgotten),
                (5, ExactAnswer::KeysFull { keys_max: 70_000 }),
            ]),
        ];
        let mut hand_taken = 0;
        for frame in &frames {
            for at in 0..body(frame).len() {
                for to in 0..=u8::MAX {
                    let mut changed = body(frame).to_vec();
                    changed[at] = to;
                    assert_eq!(
                        decode_checks(&changed),
                        bincode_checks(&changed),
                        "{at}: {to}"
                    );
                    assert_eq!(
                        decode_answers(&changed),
                        bincode_answers(&changed),
                        "{at}: {to}"
                    );
                    let versions = REGION_WIRE_VERSION..=REGION_WIRE_VERSION;
                    let hand = reader(&changed, versions).and_then(|body| all(body, answer));
                    hand_taken += usize::from(hand.is_some());
                }
            }
        }
        assert!(
            hand_taken > 1_000,
            "the hand decoder took {hand_taken} bodies"
        );
    }

    /// Ordinary frames, of checks of every version and of answers, are read by hand, never
    /// by bincode, which reads only what the hand decoder declines (bincode through serde
    /// was a tenth of the region's and the edge's CPU per check).
    #[test]
    fn ordinary_frames_are_read_by_hand_not_by_bincode() {
        let checks = vec![
            check(1, "a"),
            ExactCheck {
                check_id: None,
                ..check(2, "")
            },
        ];
        let answers = vec![
            (
                1,
                ExactAnswer::Decided(Outcome {
                    allowed: true,
                    count: 300,
                }),
            ),
            (2, ExactAnswer::Storage("disk".into())),
            (3, ExactAnswer::NoRule),
        ];
        let frame = encode_checks(&checks.iter().map(ExactCheck::as_ref).collect::<Vec<_>>());
        let answered = encode_answers(&answers);
        let reads = BINCODE_READS.get();
        for version in REGION_WIRE_VERSION_MIN..=REGION_WIRE_VERSION {
            let mut in_version = body(&frame).to_vec();
            in_version[0] = version;
            assert_eq!(decode_checks(&in_version), Some((version, checks.clone())));
        }
        assert_eq!(decode_answers(body(&answered)), Some(answers));
        assert_eq!(BINCODE_READS.get(), reads, "none read by bincode");

        // A body the hand decoder declines (more answers than a frame of checks holds).
        let declined = encode_answers(&vec![(7, ExactAnswer::Forgotten); CHECKS_PER_FRAME_MAX + 1]);
        assert!(decode_answers(body(&declined)).is_some());
        assert_eq!(BINCODE_READS.get(), reads + 1, "read by bincode");
    }

    #[test]
    fn a_body_the_hand_decoder_does_not_take_is_read_by_bincode() {
        // More answers than a frame of checks holds: the hand decoder leaves them to bincode.
        let answers = vec![(7, ExactAnswer::Forgotten); CHECKS_PER_FRAME_MAX + 1];
        let frame = encode_answers(&answers);
        let versions = REGION_WIRE_VERSION..=REGION_WIRE_VERSION;
        let hand = reader(body(&frame), versions).and_then(|body| all(body, answer));
        assert_eq!(hand, None);
        assert_eq!(decode_answers(body(&frame)), Some(answers));
    }

    #[test]
    fn a_window_length_in_the_64_bit_form_is_refused_as_bincode_refuses_it() {
        let v = REGION_WIRE_VERSION;
        // One check: ids 1, 2, 3, no check id, rule "r", subject "s", window 5, then its
        // length and cost 1.
        let head = [v, 1, 1, 2, 3, 0, 1, b'r', 1, b's', 5];
        let plain = [&head[..], &[60, 1]].concat();
        assert!(decode_checks(&plain).is_some());
        assert_eq!(decode_checks(&plain), bincode_checks(&plain));
        let long = [&head[..], &[253, 60, 0, 0, 0, 0, 0, 0, 0, 1]].concat();
        assert_eq!(bincode_checks(&long), None);
        assert_eq!(decode_checks(&long), None);
    }

    #[test]
    fn bodies_near_the_limit_decode_as_bincode_decodes_them_though_bincode_counts_more() {
        // bincode counts a value at its size in memory, not its bytes: found in review.
        let why = "x".repeat(REGION_FRAME_BYTES_MAX - 13);
        let answers = bincode_frame(REGION_WIRE_VERSION, &vec![(1, ExactAnswer::Storage(why))]);
        let checks: Vec<ExactCheck> = (0..CHECKS_PER_FRAME_MAX as u64)
            .map(|seq| ExactCheck {
                id: RequestId {
                    node: 1,
                    generation: 1,
                    seq,
                },
                check_id: None,
                rule: "r".into(),
                subject: "s".repeat(480),
                window_index: 1,
                window_secs: 60,
                cost: 1,
            })
            .collect();
        let checks = bincode_frame(REGION_WIRE_VERSION, &checks);
        for frame in [&answers, &checks] {
            assert!(body(frame).len() <= REGION_FRAME_BYTES_MAX);
        }
        // `is_none`, not a printout of half a megabyte if they differ.
        assert!(
            bincode_answers(body(&answers)).is_none(),
            "bincode counts it over"
        );
        assert!(decode_answers(body(&answers)).is_none());
        assert!(
            bincode_checks(body(&checks)).is_none(),
            "bincode counts it over"
        );
        assert!(decode_checks(body(&checks)).is_none());
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
