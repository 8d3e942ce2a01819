//! The client protocol: what an application and its sidecar say to each other, and the
//! one place that knows how it is encoded.
//!
//! A frame on the stream is a 4-byte little-endian length, then that many bytes: a version
//! byte, then a bincode 2.0.1 body (standard config) decoded with a hard limit. A client
//! sends [`Request`]s and may pipeline them; the sidecar answers each with a [`Response`]
//! carrying the same request id, in any order.
//!
//! The counting ops go by hand both ways (`wire/hot_path.rs`), to the same bytes, held to
//! bincode's by its tests: `tally-client` encodes its requests and decodes the answers to
//! them, and the sidecar decodes requests in place ([`decode_request`], names borrowed
//! from the frame) and encodes the answers to them ([`encode_response`]). Serde's
//! per-field machinery was a sixth of the client's CPU per request, and decoding into
//! owned names a sixth of the sidecar's.

use serde::{Deserialize, Serialize};

pub mod form;
mod hot_path;

pub use hot_path::{decode_request, encode_response};
pub(crate) use hot_path::{decode_response, encode_request, frames_begun, response_id};

/// The client protocol version this build speaks.
pub const CLIENT_WIRE_VERSION: u8 = 3;

/// The largest frame body either side accepts (after the length prefix).
pub const CLIENT_FRAME_BYTES_MAX: usize = 64 * 1024;

/// One request from an application.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Chosen by the client; echoed in the response. Unique per connection among requests
    /// in flight.
    pub id: u64,
    /// What to do.
    pub op: Op,
}

/// A [`Request`] that borrows its names, with the same encoding: what the client encodes,
/// so that a call copies the rule and the subject straight into the outgoing frame, and
/// what the sidecar decodes ([`decode_request`]), so that it reads them in place, instead
/// of through two `String`s each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct RequestRef<'a> {
    /// As [`Request::id`].
    pub id: u64,
    /// As [`Request::op`].
    #[serde(borrow)]
    pub op: OpRef<'a>,
}

/// An [`Op`] that borrows its names; its variants and fields are [`Op`]'s, in its order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[allow(missing_docs)] // the fields are `Op`'s
pub enum OpRef<'a> {
    /// As [`Op::Incr`].
    Incr {
        rule: &'a str,
        subject: &'a str,
        amount: u64,
        id: Option<CheckId>,
    },
    /// As [`Op::Decr`].
    Decr {
        rule: &'a str,
        subject: &'a str,
        amount: u64,
        id: Option<CheckId>,
    },
    /// As [`Op::Get`].
    Get { rule: &'a str, subject: &'a str },
    /// As [`Op::Check`].
    Check {
        rule: &'a str,
        subject: &'a str,
        cost: u64,
        id: Option<CheckId>,
    },
    /// As [`Op::Status`].
    Status,
}

impl RequestRef<'_> {
    /// The owned request.
    pub fn to_request(&self) -> Request {
        let names = |rule: &str, subject: &str| (rule.to_owned(), subject.to_owned());
        let op = match self.op {
            OpRef::Incr {
                rule,
                subject,
                amount,
                id,
            } => {
                let (rule, subject) = names(rule, subject);
                Op::Incr {
                    rule,
                    subject,
                    amount,
                    id,
                }
            }
            OpRef::Decr {
                rule,
                subject,
                amount,
                id,
            } => {
                let (rule, subject) = names(rule, subject);
                Op::Decr {
                    rule,
                    subject,
                    amount,
                    id,
                }
            }
            OpRef::Get { rule, subject } => {
                let (rule, subject) = names(rule, subject);
                Op::Get { rule, subject }
            }
            OpRef::Check {
                rule,
                subject,
                cost,
                id,
            } => {
                let (rule, subject) = names(rule, subject);
                Op::Check {
                    rule,
                    subject,
                    cost,
                    id,
                }
            }
            OpRef::Status => Op::Status,
        };
        Request { id: self.id, op }
    }
}

impl<'a> OpRef<'a> {
    /// The rule and the subject, if the op names them.
    pub(crate) fn names(&self) -> Option<(&'a str, &'a str)> {
        match *self {
            OpRef::Incr { rule, subject, .. }
            | OpRef::Decr { rule, subject, .. }
            | OpRef::Get { rule, subject }
            | OpRef::Check { rule, subject, .. } => Some((rule, subject)),
            OpRef::Status => None,
        }
    }
}

/// The operations a sidecar serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// Add `amount` to the subject's count under `rule`, in the rule's current window.
    Incr {
        /// The rule's name, as configured on the sidecar.
        rule: String,
        /// Who is counted: a user, an IP, an API key.
        subject: String,
        /// How much to add.
        amount: u64,
        /// Names the increment across its retries, as [`Op::Check::id`] does a check: one
        /// sent again under the same id counts once, and is answered with the first count,
        /// while the sidecar remembers the id. `None`: every send counts.
        id: Option<CheckId>,
    },
    /// Subtract `amount` (a release: a finished request under a concurrency limit).
    Decr {
        /// The rule's name.
        rule: String,
        /// Who is counted.
        subject: String,
        /// How much to subtract.
        amount: u64,
        /// Names the decrement across its retries, as for [`Op::Incr::id`].
        id: Option<CheckId>,
    },
    /// The subject's estimate in the rule's current window, with its staleness.
    Get {
        /// The rule's name.
        rule: String,
        /// Who is counted.
        subject: String,
    },
    /// Decide whether `cost` more is allowed under the rule, and count it if so.
    Check {
        /// The rule's name.
        rule: String,
        /// Who is counted.
        subject: String,
        /// How much this use costs (1 for one request).
        cost: u64,
        /// Names the check across its retries: a check sent again under the same id counts
        /// once, and is answered with the first outcome, while the region (exact rules) or
        /// the sidecar (approximate ones) remembers the id. `None`: every send is a new
        /// check.
        id: Option<CheckId>,
    },
    /// The sidecar's state: its replica, its members, its keys.
    Status,
}

/// One check's name across its retries ([`Op::Check::id`]), or one increment's or
/// decrement's ([`Op::Incr::id`], [`Op::Decr::id`]): `seq` is its number in the `session`
/// of the process that made it (see `CheckId::new`).
///
/// The region remembers the ids of each session's most recent exact checks, so a retry is
/// counted once however many edges or restarts (edge or region) lie between its sends.
/// A sidecar remembers its own most recent ids of what it answered (approximate checks,
/// increments, decrements, and exact checks with the region's decision or a fallback's
/// that counted) while their windows are live, in memory, and with a data directory there
/// too, so that its next life remembers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CheckId {
    /// Drawn at random once per process (again in a forked child).
    pub session: u64,
    /// Rises by one for every id the process makes.
    pub seq: u64,
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// The request's id.
    pub id: u64,
    /// The outcome.
    pub result: Result<Reply, Refusal>,
}

/// What a request that succeeded returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Reply {
    /// For `Incr` and `Decr`: the count after the write.
    Counted(Estimate),
    /// For `Get`.
    Estimate(Estimate),
    /// For `Check`.
    Decision(Decision),
    /// For `Status`.
    Status(Status),
}

/// A subject's count as this sidecar sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Estimate {
    /// This node's own lanes (exact) plus the other nodes' lanes as last merged, in
    /// `window` alone: under a sliding rule the previous window's weighted part, which a
    /// check adds ([`Decision::estimate`]), is not in it.
    pub estimate: i128,
    /// The window the count is in: `floor(unix_secs / window_secs)`.
    pub window: u64,
    /// How old the stalest live peer's state is here, in milliseconds (0 when alone).
    pub staleness_ms: u64,
}

/// Which of the rule's ways answered a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Mode {
    /// Decided here: every live peer was fresher than the rule's `stale_after`.
    ApproximateConnected,
    /// Decided here on this node's share of the limit: some live peer was stale.
    ApproximateIsolated,
    /// Decided by the region node, on the authoritative count.
    Exact,
    /// The region could not answer an exact rule in time, and the rule's
    /// `on_region_unavailable` (allow or deny) answered instead.
    RegionFallback,
}

impl Mode {
    /// The name used in metrics and output: `approximate-connected` and so on.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::ApproximateConnected => "approximate-connected",
            Mode::ApproximateIsolated => "approximate-isolated",
            Mode::Exact => "exact",
            Mode::RegionFallback => "region-fallback",
        }
    }

    /// Whether the sidecar decided on its own estimate, connected or isolated.
    pub fn is_approximate(self) -> bool {
        matches!(self, Mode::ApproximateConnected | Mode::ApproximateIsolated)
    }
}

/// A rule's answer to one check (BRIEF.md, "Rules and the three ways to answer").
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Whether the use is allowed. If so, its cost was counted.
    pub allowed: bool,
    /// The estimate of every location's count (under a sliding rule, with the previous
    /// window's weighted part), after this use if it was allowed: the count a connected
    /// decision is made on. An isolated decision is made on this node's own count against
    /// its share ([`Decision::remaining`]), and still reports this estimate.
    pub estimate: i128,
    /// The rule's limit per window.
    pub limit: u64,
    /// How much more the rule that decided admits, as this node sees it (0 when over):
    /// the limit less the estimate, or in isolated mode this node's share less its own
    /// count; for a `RegionFallback`, `u64::MAX` from an `allow` and 0 from a `deny`.
    pub remaining: u64,
    /// Milliseconds until the window ends and its count starts again. Under a sliding rule
    /// the window that ended still weighs, less and less, through the next one: a check
    /// refused now may be refused again then.
    pub reset_after_ms: u64,
    /// Which way answered.
    pub mode: Mode,
    /// How old the stalest live peer's state was, in milliseconds.
    pub staleness_ms: u64,
    /// The overshoot this answer may be part of, beyond the limit: in connected mode the
    /// admissions other nodes may have made unseen (their rate x their staleness); in
    /// isolated mode `locations x slack` plus what the locations held beyond their shares
    /// when it turned isolated (this node's own excess, and the others' count, with their
    /// rate x `stale_after_ms` unseen, less one share); in both, for each member declared
    /// dead or whose state is `dead_after` old (alive, it may be beyond a partition), the
    /// larger of the limit and a share,
    /// less the share isolated mode takes it to admit; 0 for exact and for a
    /// `deny` fallback; infinite for an `allow` fallback, which admits whatever the count,
    /// and for an approximate decision while a seed or a live member's current life is
    /// unheard at this node (it just started, or that member did: what it admitted is
    /// unknown), and for 100 ms after the node first heard every live member (its rates
    /// not yet sampled).
    pub bound: f64,
}

/// A sidecar's view of itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The node id (from its certificate).
    pub node: u64,
    /// This life's generation.
    pub generation: u64,
    /// The members this node knows, by state name, with counts.
    pub members: Vec<(String, u64)>,
    /// Keys held in the lane store.
    pub keys: u64,
}

/// Why a request was refused. Nothing was applied here; only the region may have counted a
/// check refused with `RegionUnavailable`, `Storage` or `Forgotten` (see each), or an
/// exact check refused `BadField { field: "id" }` because another request took its
/// `CheckId` at the sidecar while the region decided it (docs/protocol.md, check ids).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The rule is not configured on this sidecar.
    #[error("rule: no rule named {rule:?} is configured")]
    UnknownRule {
        /// The name asked for.
        rule: String,
    },
    /// A field of the request is out of bounds.
    #[error("{field}: {why}")]
    BadField {
        /// The field at fault: `subject`, `amount`, `cost`.
        field: String,
        /// What was wrong with it.
        why: String,
    },
    /// The write would take a lane past `u64::MAX`; lanes never wrap.
    #[error("amount: the lane would overflow u64; nothing counted")]
    Overflow,
    /// The sidecar holds its configured maximum of live keys; or, for an exact rule, the
    /// region holds its maximum in its ledger and the check would add one.
    #[error(
        "keys: the sidecar (or, for an exact rule, the region) holds its maximum of \
         {keys_max} keys; nothing counted"
    )]
    KeysFull {
        /// The configured maximum (the sidecar's, or the region's).
        keys_max: u64,
    },
    /// The rule is exact and the region did not answer in time. It may still decide and
    /// count the check: one sent again under its [`CheckId`] gets that decision and counts
    /// nothing more.
    #[error("region: unavailable for exact rule {rule:?}: {why}")]
    RegionUnavailable {
        /// The rule.
        rule: String,
        /// What went wrong.
        why: String,
    },
    /// The sidecar, or the region for an exact check, could not make the write durable;
    /// nothing was acknowledged. A region's record may still reach its disk and count
    /// after its restart; except when `why` names the region's `check_id_sessions_max`:
    /// it held the check ids of its most application sessions and decided nothing, and
    /// the check is decided when sent again once windows have ended.
    #[error("storage: {why}")]
    Storage {
        /// What failed.
        why: String,
    },
    /// The request frame did not decode.
    #[error("frame: {why}")]
    Malformed {
        /// What was wrong.
        why: String,
    },
    /// The rule is exact, and the region no longer remembers this check: it decided the
    /// check once, or the id's number is below one the region let go of to keep the session's
    /// most recent 16,384 decided ones, though it was never sent before (an id made long before its first send), or the
    /// sidecar sent the check again after its window ended at the region, which may have
    /// decided it before; and it will not decide it again. Whether it was admitted is not
    /// known.
    #[error(
        "region: exact rule {rule:?}: the region no longer remembers this check (decided \
         long ago, made long before it was sent, or sent again after its window ended); it \
         is not decided again"
    )]
    Forgotten {
        /// The rule.
        rule: String,
    },
}

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The frame was empty.
    #[error("frame: empty")]
    Empty,
    /// The length prefix or frame was longer than [`CLIENT_FRAME_BYTES_MAX`].
    #[error("frame: {len} bytes, over the {limit}-byte limit")]
    TooLong {
        /// The claimed or actual length.
        len: u64,
        /// The limit.
        limit: usize,
    },
    /// The version byte named a protocol this build does not speak.
    #[error("frame: client wire version {0}, this build speaks {CLIENT_WIRE_VERSION}")]
    Version(u8),
    /// The body did not decode.
    #[error("frame: body does not decode: {0}")]
    Body(String),
    /// The body decoded with bytes left over.
    #[error("frame: {0} trailing bytes")]
    Trailing(usize),
}

const CONFIG: bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<CLIENT_FRAME_BYTES_MAX>,
> = bincode::config::standard().with_limit::<CLIENT_FRAME_BYTES_MAX>();

/// Appends `message` as one frame (length prefix, version byte, body) to `out`.
pub fn encode_frame<T: Serialize>(message: &T, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.push(CLIENT_WIRE_VERSION);
    // Every request and response is built from bounded fields (rule and subject names are
    // checked before use, errors are short), far below the encoding limit.
    bincode::serde::encode_into_std_write(message, out, CONFIG)
        .expect("invariant: bincode encodes a message's plain data into a Vec");
    let len = out.len() - start - 4;
    out[start..start + 4].copy_from_slice(&(len as u32).to_le_bytes());
}

/// Reads a length prefix: the body length that follows, if within the limit.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > CLIENT_FRAME_BYTES_MAX {
        return Err(FrameError::TooLong {
            len: len as u64,
            limit: CLIENT_FRAME_BYTES_MAX,
        });
    }
    Ok(len)
}

/// Decodes one frame body (the bytes after the length prefix).
pub fn decode_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    let rest = versioned(body)?;
    let (message, read) = bincode::serde::decode_from_slice(rest, CONFIG)
        .map_err(|err| FrameError::Body(err.to_string()))?;
    finished(message, read, rest)
}

/// As [`decode_body`], for a message that borrows from the body.
fn decode_body_borrowed<'de, T: Deserialize<'de>>(body: &'de [u8]) -> Result<T, FrameError> {
    let rest = versioned(body)?;
    let (message, read) = bincode::serde::borrow_decode_from_slice(rest, CONFIG)
        .map_err(|err| FrameError::Body(err.to_string()))?;
    finished(message, read, rest)
}

/// The bincode body after a body's version byte, if the body is within the limit and in
/// this build's version.
fn versioned(body: &[u8]) -> Result<&[u8], FrameError> {
    let (&version, rest) = body.split_first().ok_or(FrameError::Empty)?;
    if body.len() > CLIENT_FRAME_BYTES_MAX {
        return Err(FrameError::TooLong {
            len: body.len() as u64,
            limit: CLIENT_FRAME_BYTES_MAX,
        });
    }
    if version != CLIENT_WIRE_VERSION {
        return Err(FrameError::Version(version));
    }
    Ok(rest)
}

/// `message`, if its decoding took all of `rest`.
fn finished<T>(message: T, read: usize, rest: &[u8]) -> Result<T, FrameError> {
    if read != rest.len() {
        return Err(FrameError::Trailing(rest.len() - read));
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip<T: Serialize + serde::de::DeserializeOwned>(message: &T) -> T {
        let mut frame = Vec::new();
        encode_frame(message, &mut frame);
        let len = frame_len(frame[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, frame.len() - 4);
        decode_body(&frame[4..]).unwrap()
    }

    #[test]
    fn requests_and_responses_roundtrip() {
        let request = Request {
            id: 7,
            op: Op::Check {
                rule: "login".into(),
                subject: "user-42".into(),
                cost: 1,
                id: Some(CheckId {
                    session: u64::MAX,
                    seq: 7,
                }),
            },
        };
        assert_eq!(roundtrip(&request), request);
        let response = Response {
            id: 7,
            result: Ok(Reply::Estimate(Estimate {
                estimate: -(1i128 << 70),
                window: 9,
                staleness_ms: 3,
            })),
        };
        assert_eq!(roundtrip(&response), response);
    }

    #[test]
    fn oversized_length_prefix_is_refused_before_reading() {
        for len in [u32::MAX, CLIENT_FRAME_BYTES_MAX as u32 + 1] {
            assert!(matches!(
                frame_len(len.to_le_bytes()),
                Err(FrameError::TooLong { .. })
            ));
        }
        assert_eq!(frame_len([0; 4]), Err(FrameError::Empty));
    }

    #[test]
    fn garbage_trailing_bytes_and_wrong_versions_are_refused() {
        let mut frame = Vec::new();
        encode_frame(
            &Request {
                id: 1,
                op: Op::Status,
            },
            &mut frame,
        );
        let mut body = frame[4..].to_vec();
        body.push(0);
        assert_eq!(decode_body::<Request>(&body), Err(FrameError::Trailing(1)));
        body[0] = 9;
        assert_eq!(decode_body::<Request>(&body), Err(FrameError::Version(9)));
        assert!(matches!(
            decode_body::<Request>(&[CLIENT_WIRE_VERSION, 0xff, 0xff, 0xff]),
            Err(FrameError::Body(_))
        ));
        // A string claiming 2^40 bytes is refused by the limit, not allocated.
        let huge = [CLIENT_WIRE_VERSION, 1, 0, 0xfd, 0, 0, 0, 0, 0, 1, 0, 0];
        assert!(decode_body::<Request>(&huge).is_err());
    }
}
