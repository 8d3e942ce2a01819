//! The one place that knows how frames are encoded: a version byte, then bincode 2.0.1
//! (standard config, varint integers) decoded with a hard size limit. Swapping the
//! encoding means changing this file only.

use crate::message::{Envelope, Message, ADDR_BYTES_MAX};
use tally_crdt::ReplicaId;

/// The wire format this build speaks.
pub const WIRE_VERSION: u8 = 1;

/// The hard ceiling on any frame, encoded or decoded, whatever the configuration says.
pub const FRAME_BYTES_LIMIT: usize = 4 * 1024 * 1024;

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
    bincode::config::Limit<FRAME_BYTES_LIMIT>,
> = bincode::config::standard().with_limit::<FRAME_BYTES_LIMIT>();

/// Encodes a frame from `from` carrying `message`: the version byte, then the envelope.
pub fn encode(from: ReplicaId, message: &Message) -> Vec<u8> {
    let envelope = Envelope { from, message };
    let mut frame = vec![WIRE_VERSION];
    // Encoding into a Vec only fails past the configured limit, which no frame this
    // node builds can reach: deltas are cut to `frame_bytes_max`, itself far below it.
    bincode::serde::encode_into_std_write(&envelope, &mut frame, CONFIG)
        .expect("invariant: frames are built under FRAME_BYTES_LIMIT");
    frame
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
    let (envelope, read): (Envelope, usize) = bincode::serde::decode_from_slice(body, CONFIG)
        .map_err(|err| DecodeError::Body(err.to_string()))?;
    if read != body.len() {
        return Err(DecodeError::Trailing(body.len() - read));
    }
    check(&envelope)?;
    Ok(envelope)
}

/// Bounds that serde cannot express.
fn check(envelope: &Envelope) -> Result<(), DecodeError> {
    let members = match &envelope.message {
        Message::Ack { members, .. }
        | Message::Delta { members, .. }
        | Message::Members { members } => members.as_slice(),
        Message::Syn { .. } | Message::Push { .. } => &[],
    };
    if let Some(member) = members.iter().find(|m| m.addr.len() > ADDR_BYTES_MAX) {
        return Err(DecodeError::Field {
            field: "members.addr",
            why: format!("{} bytes, over {ADDR_BYTES_MAX}", member.addr.len()),
        });
    }
    if let Message::Push { lanes, .. } = &envelope.message {
        if lanes.origin != envelope.from {
            return Err(DecodeError::Field {
                field: "push.lanes.origin",
                why: format!("{} pushed lanes of {}", envelope.from, lanes.origin),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_crdt::{Digest, Generation, NodeId};

    fn syn() -> Envelope {
        Envelope {
            from: ReplicaId::new(NodeId(3), Generation(9)),
            message: Message::Syn {
                digest: Digest::default(),
                members_hash: 42,
            },
        }
    }

    fn encode_syn() -> Vec<u8> {
        let envelope = syn();
        encode(envelope.from, &envelope.message)
    }

    #[test]
    fn a_frame_round_trips() {
        let frame = encode_syn();
        assert_eq!(frame[0], WIRE_VERSION);
        assert_eq!(decode(&frame, 1024), Ok(syn()));
    }

    #[test]
    fn trailing_bytes_unknown_versions_and_oversize_are_refused() {
        let mut frame = encode_syn();
        frame.push(0);
        assert_eq!(decode(&frame, 1024), Err(DecodeError::Trailing(1)));
        let mut frame = encode_syn();
        frame[0] = 2;
        assert_eq!(decode(&frame, 1024), Err(DecodeError::Version(2)));
        assert!(matches!(
            decode(&encode_syn(), 3),
            Err(DecodeError::TooLong { .. })
        ));
        assert_eq!(decode(&[], 1024), Err(DecodeError::Empty));
    }

    #[test]
    fn huge_length_prefixes_are_refused_without_allocating() {
        // An Ack whose delta claims u64::MAX origins: varint 0xFF then eight 0xFF bytes.
        let mut frame = vec![WIRE_VERSION, 3, 9, 1, 1];
        frame.extend_from_slice(&[0xFF; 9]);
        assert!(matches!(decode(&frame, 1 << 20), Err(DecodeError::Body(_))));
    }
}
