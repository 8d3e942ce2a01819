//! The one place that knows how frames are encoded: a version byte, then bincode 2.0.1
//! (standard config, varint integers) decoded with a hard size limit. Swapping the
//! encoding means changing this file only.
//!
//! A frame is a compact form of a [`Message`], built and read back here:
//! - Keys are not sent whole. Each frame lists the (rule, window) pairs its lanes use
//!   once, as its scopes, and a lane names its scope by index, then its subject.
//! - Every stamp but the frame's newest is sent as its distance below the newest, and a
//!   window as its distance back from the window the newest stamp falls in: one byte
//!   each for an origin heard within the last 250 ms and a live window.
//! - Every generation is sent as its *age*: its distance below the newest stamp,
//!   wrapping. A generation is the wall clock in milliseconds when its life began, so
//!   its age is that replica's uptime: 5 bytes for up to 49.7 days, where the
//!   generation itself takes 9.
//! - Lane versions are implicit. Each lane takes the version after the one before it
//!   (the first, the one after its entry's base), except where a hole says how many
//!   versions to skip: versions of lanes rewritten since, or expired. A push's base is
//!   its `after`; a delta entry's is sent as its distance below `through`.
//! - A digest is in replica order, and each entry names its node by the gap from the one
//!   before.
//! - A push is always of the sender's own lanes, so it does not name their origin; a push
//!   of nothing new, the heartbeat, is just its version.

use crate::message::{Cover, Envelope, MemberEntry, Message, ADDR_BYTES_MAX};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tally_crdt::{
    Delta, Digest, Generation, HeldVersions, Key, Lane, LaneUpdate, NodeId, OriginDelta, ReplicaId,
    Rule, Settled, Stamp, Subject, Version, Watermark, Window,
};

/// The wire format this build speaks.
pub const WIRE_VERSION: u8 = 4;

/// What bincode may count while it decodes one frame's body (`with_limit`). It counts each
/// value at its size in memory, not on the wire: a varint of one byte that decodes a `u64`,
/// or a sequence's or a string's length, counts 8.
pub const DECODE_COUNTED_BYTES_LIMIT: usize = 4 * 1024 * 1024;

/// The most one byte of a frame can count toward [`DECODE_COUNTED_BYTES_LIMIT`]: a frame
/// holds no integer wider than a `u64`.
const COUNTED_PER_BYTE_MAX: usize = 8;

/// The hard ceiling on any frame, encoded or decoded, whatever the configuration says
/// (`frame_bytes_max` is at most this): a frame of it counts within
/// [`DECODE_COUNTED_BYTES_LIMIT`] whatever it holds, so every frame a node may be
/// configured to send decodes. (Until session 44 it was the counted limit itself, 4 MiB:
/// with `frame_bytes_max` above about 1.1 MB, a full frame of lanes was refused, found in
/// review.)
pub const FRAME_BYTES_LIMIT: usize = DECODE_COUNTED_BYTES_LIMIT / COUNTED_PER_BYTE_MAX;

/// Why a frame was refused. Nothing of a refused frame is applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The frame was empty.
    #[error("frame: empty")]
    Empty,
    /// The frame was longer than the limit.
    #[error("frame: {len} bytes, over the {limit}-byte limit")]
    TooLong {
        /// The frame's length.
        len: usize,
        /// The limit in force.
        limit: usize,
    },
    /// The version byte named a format this build does not speak.
    #[error("frame: wire version {0}, this node speaks {WIRE_VERSION}")]
    Version(u8),
    /// The body did not decode (bad tag, bad length, bad UTF-8, a value out of bounds).
    #[error("frame: body does not decode: {0}")]
    Body(String),
    /// The body decoded but left bytes over.
    #[error("frame: {0} trailing bytes")]
    Trailing(usize),
    /// A field decoded but breaks a protocol bound.
    #[error("frame: field {field}: {why}")]
    Field {
        /// The field at fault.
        field: &'static str,
        /// What was wrong with it.
        why: String,
    },
}

const CONFIG: bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<DECODE_COUNTED_BYTES_LIMIT>,
> = bincode::config::standard().with_limit::<DECODE_COUNTED_BYTES_LIMIT>();

/// Encodes a frame from `from` carrying `message`: the version byte, then the frame.
///
/// # Panics
///
/// If `message` breaks an invariant of its types that the frame relies on: a push of
/// another origin's lanes or of lanes at or below its `after`, an origin's lanes not in
/// strictly ascending versions, a `Settled`'s origins not ascending by node, or a `Held`'s
/// versions not ascending strictly from its `from`. [`tally_crdt::CounterMap`] builds no
/// such message.
pub fn encode(from: ReplicaId, message: &Message) -> Vec<u8> {
    let frame = Frame::new(from, message);
    let mut bytes = vec![WIRE_VERSION];
    // bincode checks its limit only when decoding, and encoding plain data into a Vec
    // cannot fail. Deltas are cut to `frame_bytes_max`, and a frame over it is not sent
    // (`frames_oversize`).
    bincode::serde::encode_into_std_write(&frame, &mut bytes, CONFIG)
        .expect("invariant: bincode encodes a frame's plain data into a Vec");
    bytes
}

/// The most bytes one origin of a digest takes in a frame: its node gap, age, version and
/// stamp, each a varint of at most 9 bytes.
pub const DIGEST_ENTRY_BYTES_MAX: usize = 4 * 9;

/// The most bytes one origin of a [`Message::Settled`] takes in a frame: its node gap, age,
/// version, lane count and hash, each a varint of at most 9 bytes.
pub const SETTLED_ENTRY_BYTES_MAX: usize = 5 * 9;

/// The most bytes one version of a [`Message::Held`] takes in a frame: a varint.
pub const HELD_VERSION_BYTES_MAX: usize = 9;

/// The bytes `member` takes in a frame: its node id and generation, its address after its
/// length, and its `left` flag.
pub fn member_bytes(member: &MemberEntry) -> usize {
    let addr_len = member.addr.len() as u64;
    node_bytes(member.node)
        + varint_bytes(member.generation.0)
        + varint_bytes(addr_len)
        + member.addr.len()
        + 1
}

/// The bytes `node` takes in a frame.
pub fn node_bytes(node: NodeId) -> usize {
    varint_bytes(node.0)
}

/// The bytes bincode's varint encoding gives `value`.
fn varint_bytes(value: u64) -> usize {
    match value {
        0..=250 => 1,
        251..=0xFFFF => 3,
        0x1_0000..=0xFFFF_FFFF => 5,
        _ => 9,
    }
}

/// Decodes a frame of at most `limit` bytes (itself capped at [`FRAME_BYTES_LIMIT`]).
pub fn decode(frame: &[u8], limit: usize) -> Result<Envelope, DecodeError> {
    let limit = limit.min(FRAME_BYTES_LIMIT);
    let (&version, body) = frame.split_first().ok_or(DecodeError::Empty)?;
    if frame.len() > limit {
        return Err(DecodeError::TooLong {
            len: frame.len(),
            limit,
        });
    }
    if version != WIRE_VERSION {
        return Err(DecodeError::Version(version));
    }
    let (decoded, read): (Frame, usize) = bincode::serde::decode_from_slice(body, CONFIG)
        .map_err(|err| DecodeError::Body(err.to_string()))?;
    if read != body.len() {
        return Err(DecodeError::Trailing(body.len() - read));
    }
    let envelope = decoded.into_envelope()?;
    check(&envelope)?;
    Ok(envelope)
}

/// Bounds that serde cannot express.
fn check(envelope: &Envelope) -> Result<(), DecodeError> {
    let members = match &envelope.message {
        Message::Ack { members, .. }
        | Message::Delta { members, .. }
        | Message::Members { members } => members.as_slice(),
        Message::Syn { .. }
        | Message::Push { .. }
        | Message::Settled { .. }
        | Message::Held { .. } => &[],
    };
    if let Some(member) = members.iter().find(|m| m.addr.len() > ADDR_BYTES_MAX) {
        return Err(field(
            "members.addr",
            format!("{} bytes, over {ADDR_BYTES_MAX}", member.addr.len()),
        ));
    }
    let dead = match &envelope.message {
        Message::Ack { dead, .. } | Message::Delta { dead, .. } => dead.as_slice(),
        _ => &[],
    };
    if dead.len() > members.len() {
        return Err(field(
            "dead",
            format!(
                "{} nodes, more than the {} rows sent",
                dead.len(),
                members.len()
            ),
        ));
    }
    Ok(())
}

/// What follows the version byte.
#[derive(Debug, Serialize, Deserialize)]
struct Frame {
    from: Replica,
    /// The newest stamp the message carries; the others are sent below it.
    newest: Stamp,
    body: Body,
}

/// A [`Message`], compacted.
#[derive(Debug, Serialize, Deserialize)]
enum Body {
    Syn {
        digest: Vec<DigestEntry>,
        /// The `unlisted` stamp, below the frame's newest.
        unlisted_back: u64,
        members_hash: u64,
    },
    Ack {
        to: Replica,
        delta: DeltaBody,
        digest: Vec<DigestEntry>,
        members: Vec<MemberEntry>,
        dead: Vec<NodeId>,
    },
    Delta {
        to: Replica,
        delta: DeltaBody,
        members: Vec<MemberEntry>,
        dead: Vec<NodeId>,
    },
    /// The sender's own lanes; their stamp is the frame's newest.
    Push {
        after: u64,
        /// `through - after`, wrapping: the version the lanes end at, from `after`.
        fresh: u64,
        scopes: Vec<Scope>,
        lanes: Lanes,
    },
    /// A push with no lanes whose `through` is its `after`; its stamp is the frame's
    /// newest.
    Heartbeat {
        version: u64,
    },
    Members {
        members: Vec<MemberEntry>,
    },
    /// A Syn whose digest covers a part of the origins ([`Cover::Part`]). A variant of its
    /// own, last, so a whole Syn encodes as before: a node of an earlier build of this wire
    /// version refuses only these, which it could not have sent at all.
    SynPart {
        digest: Vec<DigestEntry>,
        unlisted_back: u64,
        members_hash: u64,
        from: Replica,
        until: Option<Replica>,
    },
    /// A variant of its own, last, as `SynPart`: a node of an earlier build of this wire
    /// version refuses only these.
    Settled {
        origins: Vec<SettledEntry>,
    },
    /// After `Settled`, last, for the same reason.
    Held {
        origin: Replica,
        version: u64,
        from: u64,
        through: u64,
        /// Each version as its distance past the one before it, less one (the first past
        /// `from`, not less one), so that the versions ascend strictly whatever is sent.
        gaps: Vec<u64>,
    },
}

/// One origin of a [`Message::Settled`].
#[derive(Debug, Serialize, Deserialize)]
struct SettledEntry {
    /// The node, as the gap from the previous entry's (from 0 for the first).
    node_gap: u64,
    /// The generation's age (see [`Replica`]).
    age: u64,
    version: u64,
    lanes: u64,
    versions_hash: u64,
}

/// One origin of a digest.
#[derive(Debug, Serialize, Deserialize)]
struct DigestEntry {
    /// The node, as the gap from the previous entry's (from 0 for the first).
    node_gap: u64,
    /// The generation's age (see [`Replica`]).
    age: u64,
    version: u64,
    /// The stamp, below the frame's newest.
    stamp_back: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct DeltaBody {
    scopes: Vec<Scope>,
    origins: Vec<OriginBody>,
}

#[derive(Debug, Serialize, Deserialize)]
struct OriginBody {
    origin: Replica,
    through: u64,
    /// The `through` stamp, below the frame's newest.
    stamp_back: u64,
    /// `through - base`, wrapping: the lanes' versions count up from the base.
    base_back: u64,
    lanes: Lanes,
}

/// A replica id, its generation sent as its age: its distance below the frame's newest
/// stamp, wrapping, so any generation is exact.
#[derive(Debug, Serialize, Deserialize)]
struct Replica {
    node: u64,
    age: u64,
}

impl Replica {
    fn new(replica: ReplicaId, newest: Stamp) -> Replica {
        Replica {
            node: replica.node.0,
            age: age(replica.generation, newest),
        }
    }

    fn id(&self, newest: Stamp) -> ReplicaId {
        ReplicaId::new(NodeId(self.node), generation_from(self.age, newest))
    }
}

/// A (rule, window) pair that lanes of the frame name by index.
#[derive(Debug, Serialize, Deserialize)]
struct Scope {
    rule: Rule,
    len_secs: u32,
    /// The window's index, as its distance back from the index of the window holding the
    /// frame's newest stamp (wrapping, so any index is exact; negative for a window ahead).
    back: i64,
}

/// One origin's lanes, in version order, with their versions implied by a base (see the
/// module doc).
#[derive(Debug, Serialize, Deserialize)]
struct Lanes {
    lanes: Vec<LaneBody>,
    /// In ascending lane order, at most one per lane.
    holes: Vec<Hole>,
}

#[derive(Debug, Serialize, Deserialize)]
struct LaneBody {
    /// An index into the frame's scopes.
    scope: u64,
    subject: Subject,
    incr: u64,
    decr: u64,
}

/// Lane `lane` takes the version `skip` above the one it would otherwise take.
#[derive(Debug, Serialize, Deserialize)]
struct Hole {
    lane: u64,
    skip: u64,
}

impl Frame {
    fn new(from: ReplicaId, message: &Message) -> Frame {
        let newest = newest_stamp(message);
        let body = match message {
            Message::Syn {
                digest,
                unlisted,
                members_hash,
                covers: Cover::All,
            } => Body::Syn {
                digest: digest_entries(digest, newest),
                unlisted_back: newest.0 - unlisted.0,
                members_hash: *members_hash,
            },
            Message::Syn {
                digest,
                unlisted,
                members_hash,
                covers: Cover::Part { from, until },
            } => Body::SynPart {
                digest: digest_entries(digest, newest),
                unlisted_back: newest.0 - unlisted.0,
                members_hash: *members_hash,
                from: Replica::new(*from, newest),
                until: until.map(|until| Replica::new(until, newest)),
            },
            Message::Ack {
                to,
                delta,
                digest,
                members,
                dead,
            } => Body::Ack {
                to: Replica::new(*to, newest),
                delta: DeltaBody::new(delta, newest),
                digest: digest_entries(digest, newest),
                members: members.clone(),
                dead: dead.clone(),
            },
            Message::Delta {
                to,
                delta,
                members,
                dead,
            } => Body::Delta {
                to: Replica::new(*to, newest),
                delta: DeltaBody::new(delta, newest),
                members: members.clone(),
                dead: dead.clone(),
            },
            Message::Push { after, lanes } => {
                assert_eq!(
                    lanes.origin, from,
                    "a push carries the sender's own lanes, not another origin's"
                );
                if lanes.lanes.is_empty() && lanes.through.version == *after {
                    Body::Heartbeat { version: after.0 }
                } else {
                    let mut scopes = ScopeTable::new(newest);
                    let body = Lanes::new(&lanes.lanes, after.0, &mut scopes);
                    Body::Push {
                        after: after.0,
                        fresh: lanes.through.version.0.wrapping_sub(after.0),
                        scopes: scopes.scopes,
                        lanes: body,
                    }
                }
            }
            Message::Members { members } => Body::Members {
                members: members.clone(),
            },
            Message::Settled { origins } => Body::Settled {
                origins: settled_entries(origins, newest),
            },
            Message::Held { held } => held_body(held, newest),
        };
        Frame {
            from: Replica::new(from, newest),
            newest,
            body,
        }
    }

    fn into_envelope(self) -> Result<Envelope, DecodeError> {
        let Frame { from, newest, body } = self;
        let from = from.id(newest);
        let message = match body {
            Body::Syn {
                digest,
                unlisted_back,
                members_hash,
            } => Message::Syn {
                digest: digest_from(digest, newest)?,
                unlisted: stamp_from(newest, unlisted_back)?,
                members_hash,
                covers: Cover::All,
            },
            Body::SynPart {
                digest,
                unlisted_back,
                members_hash,
                from,
                until,
            } => {
                let (from, until) = (from.id(newest), until.map(|until| until.id(newest)));
                let digest = digest_from(digest, newest)?;
                let covers = Cover::Part { from, until };
                if until.is_some_and(|until| until <= from)
                    || digest
                        .origins
                        .keys()
                        .any(|&origin| !covers.contains(origin))
                {
                    return Err(field(
                        "digest",
                        format!("a part from {from} until {until:?} lists origins outside it"),
                    ));
                }
                Message::Syn {
                    digest,
                    unlisted: stamp_from(newest, unlisted_back)?,
                    members_hash,
                    covers,
                }
            }
            Body::Ack {
                to,
                delta,
                digest,
                members,
                dead,
            } => Message::Ack {
                to: to.id(newest),
                delta: delta.into_delta(newest)?,
                digest: digest_from(digest, newest)?,
                members,
                dead,
            },
            Body::Delta {
                to,
                delta,
                members,
                dead,
            } => Message::Delta {
                to: to.id(newest),
                delta: delta.into_delta(newest)?,
                members,
                dead,
            },
            Body::Push {
                after,
                fresh,
                scopes,
                lanes,
            } => {
                let scopes = scopes_from(scopes, newest)?;
                let through = Version(after.wrapping_add(fresh));
                Message::Push {
                    after: Version(after),
                    lanes: OriginDelta {
                        origin: from,
                        through: Watermark {
                            version: through,
                            stamp: newest,
                        },
                        lanes: lanes.into_updates(&scopes, after)?,
                    },
                }
            }
            Body::Heartbeat { version } => Message::Push {
                after: Version(version),
                lanes: OriginDelta {
                    origin: from,
                    through: Watermark {
                        version: Version(version),
                        stamp: newest,
                    },
                    lanes: Vec::new(),
                },
            },
            Body::Members { members } => Message::Members { members },
            Body::Settled { origins } => Message::Settled {
                origins: settled_from(origins, newest)?,
            },
            Body::Held {
                origin,
                version,
                from,
                through,
                gaps,
            } => Message::Held {
                held: held_from(origin.id(newest), version, (from, through), gaps)?,
            },
        };
        Ok(Envelope { from, message })
    }
}

impl DeltaBody {
    fn new(delta: &Delta, newest: Stamp) -> DeltaBody {
        let mut scopes = ScopeTable::new(newest);
        let origins = delta
            .origins
            .iter()
            .map(|entry| {
                let through = entry.through.version.0;
                let base = entry
                    .lanes
                    .first()
                    .map_or(through, |lane| lane.version.0 - 1);
                OriginBody {
                    origin: Replica::new(entry.origin, newest),
                    through,
                    stamp_back: newest.0 - entry.through.stamp.0,
                    base_back: through.wrapping_sub(base),
                    lanes: Lanes::new(&entry.lanes, base, &mut scopes),
                }
            })
            .collect();
        DeltaBody {
            scopes: scopes.scopes,
            origins,
        }
    }

    fn into_delta(self, newest: Stamp) -> Result<Delta, DecodeError> {
        let scopes = scopes_from(self.scopes, newest)?;
        let origins = self
            .origins
            .into_iter()
            .map(|entry| {
                let base = entry.through.wrapping_sub(entry.base_back);
                Ok(OriginDelta {
                    origin: entry.origin.id(newest),
                    through: Watermark {
                        version: Version(entry.through),
                        stamp: stamp_from(newest, entry.stamp_back)?,
                    },
                    lanes: entry.lanes.into_updates(&scopes, base)?,
                })
            })
            .collect::<Result<_, DecodeError>>()?;
        Ok(Delta { origins })
    }
}

impl Lanes {
    /// `updates` must ascend strictly, all above `base`.
    fn new(updates: &[LaneUpdate], base: u64, scopes: &mut ScopeTable) -> Lanes {
        let mut holes = Vec::new();
        // The version the lane being looked at takes unless a hole says otherwise.
        let mut expected = base.checked_add(1);
        for (index, update) in updates.iter().enumerate() {
            let version = update.version.0;
            let skip = expected.and_then(|expected| version.checked_sub(expected));
            let skip = skip.unwrap_or_else(|| {
                panic!(
                    "lane versions ascend strictly above base {base}: lane {index} has {version}, expected at least {expected:?}"
                )
            });
            if skip > 0 {
                holes.push(Hole {
                    lane: index as u64,
                    skip,
                });
            }
            expected = version.checked_add(1);
        }
        let lanes = updates
            .iter()
            .map(|update| LaneBody {
                scope: scopes.index(&update.key),
                subject: update.key.subject.clone(),
                incr: update.lane.incr,
                decr: update.lane.decr,
            })
            .collect();
        Lanes { lanes, holes }
    }

    fn into_updates(
        self,
        scopes: &[(Rule, Window)],
        base: u64,
    ) -> Result<Vec<LaneUpdate>, DecodeError> {
        let count = self.lanes.len() as u64;
        let ordered = self
            .holes
            .windows(2)
            .all(|pair| pair[0].lane < pair[1].lane);
        if !ordered || self.holes.last().is_some_and(|hole| hole.lane >= count) {
            return Err(field(
                "lanes.holes",
                format!("holes must name lanes 0 to {count} in ascending order, once each"),
            ));
        }
        let mut holes = self.holes.iter().peekable();
        let mut previous = base;
        let mut updates = Vec::with_capacity(self.lanes.len());
        for (index, lane) in self.lanes.into_iter().enumerate() {
            let index = index as u64;
            let skip = match holes.next_if(|hole| hole.lane == index) {
                Some(Hole { skip: 0, .. }) => {
                    return Err(field("lanes.holes", format!("lane {index} skips 0")));
                }
                Some(hole) => hole.skip,
                None => 0,
            };
            let version = previous
                .checked_add(1)
                .and_then(|version| version.checked_add(skip))
                .ok_or_else(|| {
                    field(
                        "lanes.holes",
                        format!("lane {index} passes the largest version, from base {base}"),
                    )
                })?;
            previous = version;
            let (rule, window) = usize::try_from(lane.scope)
                .ok()
                .and_then(|scope| scopes.get(scope))
                .ok_or_else(|| {
                    field(
                        "lanes.scope",
                        format!(
                            "lane {index} names scope {}, the frame has {}",
                            lane.scope,
                            scopes.len()
                        ),
                    )
                })?;
            updates.push(LaneUpdate {
                key: Key::new(rule.clone(), lane.subject, *window),
                lane: Lane::new(lane.incr, lane.decr),
                version: Version(version),
            });
        }
        Ok(updates)
    }
}

/// The scopes of one frame, in the order its lanes first use them.
struct ScopeTable {
    newest: Stamp,
    scopes: Vec<Scope>,
    indexes: BTreeMap<(Rule, Window), u64>,
}

impl ScopeTable {
    fn new(newest: Stamp) -> ScopeTable {
        ScopeTable {
            newest,
            scopes: Vec::new(),
            indexes: BTreeMap::new(),
        }
    }

    /// The index of `key`'s scope, added if new.
    fn index(&mut self, key: &Key) -> u64 {
        let next = self.scopes.len() as u64;
        let index = *self
            .indexes
            .entry((key.rule.clone(), key.window))
            .or_insert(next);
        if index == next {
            let base = window_index_at(self.newest, key.window.len_secs());
            self.scopes.push(Scope {
                rule: key.rule.clone(),
                len_secs: key.window.len_secs(),
                back: base.wrapping_sub(key.window.index()) as i64,
            });
        }
        index
    }
}

fn scopes_from(scopes: Vec<Scope>, newest: Stamp) -> Result<Vec<(Rule, Window)>, DecodeError> {
    scopes
        .into_iter()
        .map(|scope| {
            let base = window_index_at(newest, scope.len_secs);
            let window = Window::new(base.wrapping_sub(scope.back as u64), scope.len_secs)
                .map_err(|err| field("scopes.window", err.to_string()))?;
            Ok((scope.rule, window))
        })
        .collect()
}

/// The index of the window of length `len_secs` holding `stamp` (0 for a length of 0,
/// which no valid window has).
fn window_index_at(stamp: Stamp, len_secs: u32) -> u64 {
    (stamp.0 / 1_000)
        .checked_div(u64::from(len_secs))
        .unwrap_or_default()
}

/// The newest stamp anywhere in `message`: every other stamp is sent below it.
fn newest_stamp(message: &Message) -> Stamp {
    let newest = match message {
        Message::Syn {
            digest, unlisted, ..
        } => digest_stamps(digest).chain([*unlisted]).max(),
        Message::Ack { delta, digest, .. } => {
            delta_stamps(delta).chain(digest_stamps(digest)).max()
        }
        Message::Delta { delta, .. } => delta_stamps(delta).max(),
        Message::Push { lanes, .. } => Some(lanes.through.stamp),
        Message::Members { .. } | Message::Settled { .. } | Message::Held { .. } => None,
    };
    newest.unwrap_or_default()
}

fn delta_stamps(delta: &Delta) -> impl Iterator<Item = Stamp> + '_ {
    delta.origins.iter().map(|entry| entry.through.stamp)
}

fn digest_stamps(digest: &Digest) -> impl Iterator<Item = Stamp> + '_ {
    digest.origins.values().map(|watermark| watermark.stamp)
}

fn digest_entries(digest: &Digest, newest: Stamp) -> Vec<DigestEntry> {
    let mut previous = 0;
    digest
        .origins
        .iter()
        .map(|(replica, watermark)| {
            let node_gap = replica.node.0 - previous;
            previous = replica.node.0;
            DigestEntry {
                node_gap,
                age: age(replica.generation, newest),
                version: watermark.version.0,
                stamp_back: newest.0 - watermark.stamp.0,
            }
        })
        .collect()
}

/// Replicas listed in ascending order, each sent as its node's gap from the one before's
/// (from 0 for the first) and its generation's age: read back one at a time, each refused
/// unless it follows the one before. `list` and `gap` name the list and its gaps in errors.
struct AscendingReplicas {
    list: &'static str,
    gap: &'static str,
    node: u64,
    previous: Option<ReplicaId>,
}

impl AscendingReplicas {
    fn new(list: &'static str, gap: &'static str) -> AscendingReplicas {
        AscendingReplicas {
            list,
            gap,
            node: 0,
            previous: None,
        }
    }

    fn next(&mut self, node_gap: u64, age: u64, newest: Stamp) -> Result<ReplicaId, DecodeError> {
        let node = self.node;
        self.node = (node.checked_add(node_gap))
            .ok_or_else(|| field(self.gap, format!("node {node} + {node_gap}")))?;
        let replica = ReplicaId::new(NodeId(self.node), generation_from(age, newest));
        if let Some(previous) = self.previous.filter(|&previous| previous >= replica) {
            return Err(field(
                self.list,
                format!("{replica} follows {previous}: replicas must ascend, once each"),
            ));
        }
        self.previous = Some(replica);
        Ok(replica)
    }
}

fn digest_from(entries: Vec<DigestEntry>, newest: Stamp) -> Result<Digest, DecodeError> {
    let mut digest = Digest::default();
    let mut replicas = AscendingReplicas::new("digest", "digest.node_gap");
    for entry in entries {
        let replica = replicas.next(entry.node_gap, entry.age, newest)?;
        let watermark = Watermark {
            version: Version(entry.version),
            stamp: stamp_from(newest, entry.stamp_back)?,
        };
        digest.origins.insert(replica, watermark);
    }
    Ok(digest)
}

fn settled_entries(origins: &[Settled], newest: Stamp) -> Vec<SettledEntry> {
    let mut previous = 0;
    (origins.iter())
        .map(|settled| {
            let node_gap = (settled.origin.node.0.checked_sub(previous))
                .expect("invariant: a Settled's origins ascend");
            previous = settled.origin.node.0;
            SettledEntry {
                node_gap,
                age: age(settled.origin.generation, newest),
                version: settled.version.0,
                lanes: settled.lanes,
                versions_hash: settled.versions_hash,
            }
        })
        .collect()
}

fn settled_from(entries: Vec<SettledEntry>, newest: Stamp) -> Result<Vec<Settled>, DecodeError> {
    let mut replicas = AscendingReplicas::new("settled", "settled.node_gap");
    (entries.into_iter())
        .map(|entry| {
            Ok(Settled {
                origin: replicas.next(entry.node_gap, entry.age, newest)?,
                version: Version(entry.version),
                lanes: entry.lanes,
                versions_hash: entry.versions_hash,
            })
        })
        .collect()
}

/// `held`'s body: its versions as gaps (see [`Body::Held`]).
///
/// # Panics
///
/// If its versions do not ascend strictly within its span.
fn held_body(held: &HeldVersions, newest: Stamp) -> Body {
    let mut previous: Option<Version> = None;
    let gaps = (held.versions.iter())
        .map(|&version| {
            let gap = match previous {
                None => version.0.checked_sub(held.from.0),
                Some(previous) => version.0.checked_sub(previous.0 + 1),
            };
            previous = Some(version);
            gap.expect("invariant: a Held's versions ascend strictly from its `from`")
        })
        .collect();
    Body::Held {
        origin: Replica::new(held.origin, newest),
        version: held.version.0,
        from: held.from.0,
        through: held.through.0,
        gaps,
    }
}

fn held_from(
    origin: ReplicaId,
    version: u64,
    (from, through): (u64, u64),
    gaps: Vec<u64>,
) -> Result<HeldVersions, DecodeError> {
    let mut versions = Vec::with_capacity(gaps.len());
    let mut next = Some(from);
    for gap in gaps {
        let version = next
            .and_then(|next| next.checked_add(gap))
            .filter(|&version| version <= through)
            .ok_or_else(|| field("held.gaps", format!("a version past {through}")))?;
        versions.push(Version(version));
        next = version.checked_add(1);
    }
    Ok(HeldVersions {
        origin,
        version: Version(version),
        from: Version(from),
        through: Version(through),
        versions,
    })
}

/// A generation's age: its distance below `newest`, wrapping (see [`Replica`]).
fn age(generation: Generation, newest: Stamp) -> u64 {
    newest.0.wrapping_sub(generation.0)
}

fn generation_from(age: u64, newest: Stamp) -> Generation {
    Generation(newest.0.wrapping_sub(age))
}

fn stamp_from(newest: Stamp, back: u64) -> Result<Stamp, DecodeError> {
    newest.0.checked_sub(back).map(Stamp).ok_or_else(|| {
        field(
            "stamp_back",
            format!("{back} below the newest stamp {}", newest.0),
        )
    })
}

fn field(field: &'static str, why: String) -> DecodeError {
    DecodeError::Field { field, why }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WALL: u64 = 1_767_225_600_000;

    /// A replica whose life began three days before `WALL`, as `tallyd`'s generations are
    /// its wall clock at start.
    fn replica(node: u64) -> ReplicaId {
        ReplicaId::new(NodeId(node), Generation(WALL - 3 * 86_400_000))
    }

    fn key(rule: &str, subject: &str, window: Window) -> Key {
        Key::new(
            Rule::new(rule).unwrap(),
            Subject::new(subject).unwrap(),
            window,
        )
    }

    fn now_window(len_secs: u32) -> Window {
        Window::containing(WALL / 1_000, len_secs).unwrap()
    }

    fn update(key: Key, version: u64) -> LaneUpdate {
        LaneUpdate {
            key,
            lane: Lane::new(version * 3, version),
            version: Version(version),
        }
    }

    /// Three origins over three scopes (two rules, two windows of one rule), with holes,
    /// and lanes above `through` (held past a gap), which the wire must carry too.
    fn delta() -> Delta {
        let minute = now_window(60);
        Delta {
            origins: vec![
                OriginDelta {
                    origin: replica(4),
                    through: Watermark {
                        version: Version(30),
                        stamp: Stamp(WALL - 70),
                    },
                    lanes: vec![
                        update(key("login", "alice", minute), 3),
                        update(key("login", "bob", minute.previous().unwrap()), 4),
                        update(key("api", "alice", now_window(3_600)), 9),
                        update(key("login", "carol", minute), 38),
                    ],
                },
                OriginDelta {
                    origin: replica(2),
                    through: Watermark {
                        version: Version(7),
                        stamp: Stamp(WALL),
                    },
                    lanes: Vec::new(),
                },
                OriginDelta {
                    origin: replica(6),
                    through: Watermark {
                        version: Version(7),
                        stamp: Stamp(0),
                    },
                    lanes: vec![update(key("login", "dave", minute), 12)],
                },
            ],
        }
    }

    fn digest() -> Digest {
        Digest {
            origins: [
                (replica(1), Version(5), WALL - 3),
                (ReplicaId::new(NodeId(1), Generation(9)), Version(0), 0),
                (replica(300), Version(70_000), WALL + 5),
            ]
            .into_iter()
            .map(|(replica, version, stamp)| {
                let stamp = Stamp(stamp);
                (replica, Watermark { version, stamp })
            })
            .collect(),
        }
    }

    fn member(node: u64) -> MemberEntry {
        MemberEntry {
            node: NodeId(node),
            generation: Generation(2),
            addr: format!("10.0.0.{node}:7000"),
            left: false,
        }
    }

    fn push(after: u64, lanes: Vec<LaneUpdate>, through: u64) -> Message {
        Message::Push {
            after: Version(after),
            lanes: OriginDelta {
                origin: replica(3),
                through: Watermark {
                    version: Version(through),
                    stamp: Stamp(WALL + 1),
                },
                lanes,
            },
        }
    }

    fn every_message() -> Vec<Message> {
        let minute = now_window(60);
        vec![
            Message::Syn {
                digest: digest(),
                unlisted: Stamp(WALL - 100),
                members_hash: u64::MAX,
                covers: Cover::All,
            },
            Message::Syn {
                digest: Digest::default(),
                unlisted: Stamp(0),
                members_hash: 42,
                covers: Cover::All,
            },
            Message::Syn {
                digest: Digest::default(),
                unlisted: Stamp(WALL),
                members_hash: 42,
                covers: Cover::All,
            },
            Message::Syn {
                digest: digest(),
                unlisted: Stamp(WALL - 100),
                members_hash: 7,
                covers: Cover::Part {
                    from: ReplicaId::new(NodeId(0), Generation(0)),
                    until: Some(replica(301)),
                },
            },
            Message::Syn {
                digest: Digest::default(),
                unlisted: Stamp(0),
                members_hash: 7,
                covers: Cover::Part {
                    from: replica(12),
                    until: None,
                },
            },
            Message::Ack {
                to: replica(5),
                delta: delta(),
                digest: digest(),
                members: vec![member(1), member(2)],
                dead: vec![NodeId(2)],
            },
            Message::Delta {
                to: replica(5),
                delta: delta(),
                members: Vec::new(),
                dead: Vec::new(),
            },
            Message::Delta {
                to: replica(5),
                delta: Delta::default(),
                members: vec![member(7)],
                dead: Vec::new(),
            },
            push(10, vec![update(key("login", "a", minute), 11)], 11),
            push(
                10,
                vec![
                    update(key("login", "a", minute), 12),
                    update(key("login", "b", minute), 13),
                    update(key("login", "c", minute), 15),
                ],
                16,
            ),
            push(10, Vec::new(), 10),
            push(10, Vec::new(), 12),
            Message::Members {
                members: vec![member(3)],
            },
            Message::Settled {
                origins: vec![settled(1, 0), settled(2, WALL - 1), settled(2, u64::MAX)],
            },
            Message::Held {
                held: HeldVersions {
                    origin: replica(4),
                    version: Version(900),
                    from: Version(10),
                    through: Version(u64::MAX),
                    versions: [10, 11, 300, 901, u64::MAX].map(Version).to_vec(),
                },
            },
        ]
    }

    fn settled(node: u64, generation: u64) -> Settled {
        Settled {
            origin: ReplicaId::new(NodeId(node), Generation(generation)),
            version: Version(node * 1_000),
            lanes: node * 10,
            versions_hash: u64::MAX - node,
        }
    }

    #[test]
    fn a_held_version_takes_at_most_its_bound_and_none_lies_past_the_span() {
        let held = |versions: &[u64], through: u64| Message::Held {
            held: HeldVersions {
                origin: replica(4),
                version: Version(5),
                from: Version(0),
                through: Version(through),
                versions: versions.iter().copied().map(Version).collect(),
            },
        };
        let empty = encode(replica(3), &held(&[], u64::MAX)).len();
        let one = encode(replica(3), &held(&[u64::MAX], u64::MAX)).len();
        assert!(one - empty <= HELD_VERSION_BYTES_MAX);
        // Encoded with a span that holds them, then the span's end lowered on the wire.
        let mut frame = encode(replica(3), &held(&[3, 7], 250));
        let at = frame.len() - 4;
        assert_eq!(frame[at], 250, "`through`, then two gaps: 3 and 3");
        frame[at] = 5;
        let refused = decode(&frame, FRAME_BYTES_LIMIT);
        assert!(
            matches!(&refused, Err(DecodeError::Field { field, .. }) if *field == "held.gaps"),
            "{refused:?}"
        );
    }

    #[test]
    fn a_settled_entry_takes_at_most_its_bound_and_origins_must_ascend() {
        let extreme = Settled {
            origin: ReplicaId::new(NodeId(u64::MAX), Generation(1)),
            version: Version(u64::MAX),
            lanes: u64::MAX,
            versions_hash: u64::MAX,
        };
        let one = |origins: Vec<Settled>| encode(replica(3), &Message::Settled { origins });
        let empty = one(Vec::new()).len();
        assert!(one(vec![extreme]).len() - empty <= SETTLED_ENTRY_BYTES_MAX);
        for origins in [
            vec![settled(2, 5), settled(2, 1)],
            vec![settled(2, 1), settled(2, 1)],
        ] {
            let refused = decode(&one(origins), FRAME_BYTES_LIMIT);
            assert!(
                matches!(&refused, Err(DecodeError::Field { field, .. }) if *field == "settled"),
                "{refused:?}"
            );
        }
    }

    #[test]
    fn a_frame_of_the_largest_size_a_node_may_send_decodes_however_many_lanes_it_holds() {
        // Lanes of one scope, short subjects and one-byte totals: seven to nine bytes each
        // on the wire, counted at 35 to 37 by bincode; and a `Held` of one-byte gaps, each
        // counted at 8.
        let window = now_window(60);
        let subjects: Vec<String> = (0..FRAME_BYTES_LIMIT).map(|n| format!("{n:x}")).collect();
        let lanes = |count: usize| {
            let lanes = (subjects.iter().take(count).enumerate())
                .map(|(at, subject)| LaneUpdate {
                    key: key("r", subject, window),
                    lane: Lane::new(1, 0),
                    version: Version(at as u64 + 1),
                })
                .collect();
            push(0, lanes, count as u64)
        };
        let held = |count: usize| Message::Held {
            held: HeldVersions {
                origin: replica(4),
                version: Version(1),
                from: Version(0),
                through: Version(2 * count as u64 + 1),
                versions: (1..=count as u64).map(|n| Version(2 * n)).collect(),
            },
        };
        let shapes: [&dyn Fn(usize) -> Message; 2] = [&lanes, &held];
        for message in shapes {
            // The most items whose frame fits the limit, by halving the step.
            let (mut count, mut step) = (0, FRAME_BYTES_LIMIT);
            while step > 0 {
                if encode(replica(3), &message(count + step)).len() <= FRAME_BYTES_LIMIT {
                    count += step;
                }
                step /= 2;
            }
            let frame = encode(replica(3), &message(count));
            assert!(
                frame.len() > FRAME_BYTES_LIMIT - 64,
                "{} bytes",
                frame.len()
            );
            let decoded = decode(&frame, FRAME_BYTES_LIMIT);
            assert!(decoded.is_ok(), "{} bytes: {decoded:?}", frame.len());
        }
    }

    fn round_trip(message: &Message) -> Result<Envelope, DecodeError> {
        decode(&encode(replica(3), message), FRAME_BYTES_LIMIT)
    }

    #[test]
    fn a_members_size_is_the_size_of_its_encoding() {
        let edges = [0, 250, 251, 65_535, 65_536, u64::from(u32::MAX), u64::MAX];
        for (i, &node) in edges.iter().enumerate() {
            for (j, &generation) in edges.iter().enumerate() {
                let member = MemberEntry {
                    node: NodeId(node),
                    generation: Generation(generation),
                    addr: "a".repeat([0, 15, 250, 251, ADDR_BYTES_MAX][(i + j) % 5]),
                    left: i % 2 == 0,
                };
                let encoded = bincode::serde::encode_to_vec(&member, CONFIG).unwrap();
                assert_eq!(member_bytes(&member), encoded.len(), "{member:?}");
                let encoded = bincode::serde::encode_to_vec(member.node, CONFIG).unwrap();
                assert_eq!(node_bytes(member.node), encoded.len(), "{node}");
            }
        }
    }

    #[test]
    fn every_message_shape_round_trips() {
        for message in every_message() {
            let envelope = round_trip(&message);
            assert_eq!(
                envelope,
                Ok(Envelope {
                    from: replica(3),
                    message: message.clone()
                }),
                "{message:?}"
            );
        }
    }

    #[test]
    fn a_heartbeat_is_a_version_and_a_stamp() {
        let frame = encode(replica(3), &push(10, Vec::new(), 10));
        // Version byte, replica (node 1, a three-day age 5), newest stamp (9), tag,
        // version.
        assert_eq!(frame.len(), 1 + 1 + 5 + 9 + 1 + 1);
    }

    #[test]
    fn generations_ahead_of_or_far_below_the_newest_stamp_round_trip_exactly() {
        for generation in [0, 1, WALL, WALL + 2, WALL + 60_000, u64::MAX] {
            let from = ReplicaId::new(NodeId(3), Generation(generation));
            let Message::Push { after, lanes } = push(10, Vec::new(), 10) else {
                unreachable!("push builds a push");
            };
            let message = Message::Push {
                after,
                lanes: OriginDelta {
                    origin: from,
                    ..lanes
                },
            };
            let envelope = decode(&encode(from, &message), FRAME_BYTES_LIMIT);
            assert_eq!(envelope, Ok(Envelope { from, message }), "{generation}");
        }
    }

    #[test]
    fn a_lane_names_its_scope_and_carries_no_version() {
        let lanes = |count: u64| {
            (0..count)
                .map(|i| {
                    update(
                        key("login", &format!("user-{i:04}"), now_window(60)),
                        11 + i,
                    )
                })
                .collect::<Vec<_>>()
        };
        let one = encode(replica(3), &push(10, lanes(1), 11)).len();
        let hundred = encode(replica(3), &push(10, lanes(100), 110)).len();
        // Per further lane: the scope's index (1 byte), the subject with its length (10),
        // and the two totals as varints (1 byte each up to 250, 3 past it); nothing else,
        // so a version per lane, even of one byte, would show.
        let varint = |value: u64| if value <= 250 { 1 } else { 3 };
        let expected: usize = (1..100u64)
            .map(|i| {
                let lane = update(key("login", "user-0000", now_window(60)), 11 + i).lane;
                1 + 10 + varint(lane.incr) + varint(lane.decr)
            })
            .sum();
        assert_eq!(hundred - one, expected, "bytes of 99 further lanes");
    }

    #[test]
    fn a_push_names_no_origin_and_decodes_as_the_senders() {
        let message = push(10, Vec::new(), 12);
        let envelope = decode(&encode(replica(3), &message), 1024).unwrap();
        let Message::Push { lanes, .. } = envelope.message else {
            panic!("decoded {:?}", envelope.message);
        };
        assert_eq!(lanes.origin, replica(3));
    }

    /// A push of `lanes` whose body bincode encodes with one field changed: the tag, the
    /// replica and newest stamp are kept, and `edit` rewrites the body.
    fn edited_push(edit: impl FnOnce(&mut Body)) -> Vec<u8> {
        let lanes = vec![
            update(key("login", "a", now_window(60)), 11),
            update(key("login", "b", now_window(60)), 13),
        ];
        let mut frame = Frame::new(replica(3), &push(10, lanes, 13));
        edit(&mut frame.body);
        let mut bytes = vec![WIRE_VERSION];
        bincode::serde::encode_into_std_write(&frame, &mut bytes, CONFIG).unwrap();
        bytes
    }

    fn push_lanes(body: &mut Body) -> &mut Lanes {
        match body {
            Body::Push { lanes, .. } => lanes,
            other => panic!("not a push: {other:?}"),
        }
    }

    fn refused_field(frame: &[u8]) -> &'static str {
        match decode(frame, FRAME_BYTES_LIMIT) {
            Err(DecodeError::Field { field, .. }) => field,
            other => panic!("expected a field error, got {other:?}"),
        }
    }

    #[test]
    fn a_lane_naming_a_scope_the_frame_lacks_is_a_field_error() {
        let frame = edited_push(|body| push_lanes(body).lanes[1].scope = 1);
        assert_eq!(refused_field(&frame), "lanes.scope");
        let frame = edited_push(|body| push_lanes(body).lanes[0].scope = u64::MAX);
        assert_eq!(refused_field(&frame), "lanes.scope");
    }

    #[test]
    fn a_syn_part_listing_an_origin_outside_it_or_ending_where_it_starts_is_a_field_error() {
        // `digest()` lists replicas of nodes 1 and 300.
        let parts = [
            (replica(2), None),
            (ReplicaId::new(NodeId(0), Generation(0)), Some(replica(300))),
            (replica(1), Some(replica(1))),
        ];
        for (from, until) in parts {
            let syn = Message::Syn {
                digest: digest(),
                unlisted: Stamp(0),
                members_hash: 0,
                covers: Cover::Part { from, until },
            };
            assert_eq!(refused_field(&encode(replica(3), &syn)), "digest");
        }
    }

    #[test]
    fn more_dead_nodes_than_rows_sent_is_a_field_error() {
        let delta = Message::Delta {
            to: replica(5),
            delta: Delta::default(),
            members: vec![member(7)],
            dead: vec![NodeId(7), NodeId(8)],
        };
        assert_eq!(refused_field(&encode(replica(3), &delta)), "dead");
    }

    #[test]
    fn holes_out_of_order_out_of_range_or_past_the_largest_version_are_field_errors() {
        let cases: [fn(&mut Lanes); 4] = [
            |lanes| lanes.holes.push(Hole { lane: 2, skip: 1 }),
            |lanes| lanes.holes.insert(0, Hole { lane: 1, skip: 1 }),
            |lanes| lanes.holes[0].skip = 0,
            |lanes| lanes.holes[0].skip = u64::MAX - 5,
        ];
        for edit in cases {
            let frame = edited_push(|body| edit(push_lanes(body)));
            assert_eq!(refused_field(&frame), "lanes.holes");
        }
    }

    #[test]
    fn a_stamp_below_zero_a_bad_window_or_a_digest_out_of_order_is_a_field_error() {
        let mut frame = Frame::new(replica(3), &every_message()[0]);
        let Body::Syn { digest, .. } = &mut frame.body else {
            panic!("not a syn");
        };
        digest[0].stamp_back = u64::MAX;
        let mut bytes = vec![WIRE_VERSION];
        bincode::serde::encode_into_std_write(&frame, &mut bytes, CONFIG).unwrap();
        assert_eq!(refused_field(&bytes), "stamp_back");

        let Body::Syn { digest, .. } = &mut frame.body else {
            panic!("not a syn");
        };
        digest[0].stamp_back = 0;
        // The second entry names the first's replica again.
        digest[1].age = digest[0].age;
        let mut bytes = vec![WIRE_VERSION];
        bincode::serde::encode_into_std_write(&frame, &mut bytes, CONFIG).unwrap();
        assert_eq!(refused_field(&bytes), "digest");

        let frame = edited_push(|body| match body {
            Body::Push { scopes, .. } => scopes[0].len_secs = 0,
            other => panic!("not a push: {other:?}"),
        });
        assert_eq!(refused_field(&frame), "scopes.window");
    }

    #[test]
    fn trailing_bytes_unknown_versions_and_oversize_are_refused() {
        let syn = encode(replica(3), &every_message()[1]);
        let mut frame = syn.clone();
        frame.push(0);
        assert_eq!(decode(&frame, 1024), Err(DecodeError::Trailing(1)));
        let mut frame = syn.clone();
        frame[0] = 1;
        assert_eq!(decode(&frame, 1024), Err(DecodeError::Version(1)));
        assert!(matches!(decode(&syn, 3), Err(DecodeError::TooLong { .. })));
        assert_eq!(decode(&[], 1024), Err(DecodeError::Empty));
    }

    #[test]
    fn huge_length_prefixes_are_refused_without_allocating() {
        // An Ack (tag 1) from replica 3/9, newest stamp 0, to replica 1/1, whose delta
        // claims u64::MAX scopes: varint 0xFF then eight 0xFF bytes.
        let mut frame = vec![WIRE_VERSION, 3, 9, 0, 1, 1, 1];
        frame.extend_from_slice(&[0xFF; 9]);
        assert!(matches!(decode(&frame, 1 << 20), Err(DecodeError::Body(_))));
    }
}
