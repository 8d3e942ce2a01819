//! The record format of the durable logs (the lane log, the region log, and the answers
//! log): `[len u32 LE][crc32 u32 LE][bincode body]`, decoded with a limit.
//!
//! A record that is short, of length 0, longer than [`RECORD_BYTES_MAX`], or fails its
//! checksum is where a reader of [`read_all`] stops, taking it for a torn tail: what comes
//! before is whole. (The lane log and the answer log read on past damage, record by
//! record, each in its own replay.) No record is empty, so a length of 0 is the end: the lane log
//! and the region log are allocated ahead with zeros ([`write_zeros`]), and
//! `[len 0][crc 0]` would check (the crc32 of no bytes is 0).

use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// The largest record body written or read.
pub const RECORD_BYTES_MAX: usize = 1024;

const CONFIG: bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<RECORD_BYTES_MAX>,
> = bincode::config::standard().with_limit::<RECORD_BYTES_MAX>();

/// Appends `record`, framed, to `out`.
pub fn append<T: Serialize>(record: &T, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; 8]);
    bincode::serde::encode_into_std_write(record, out, CONFIG)
        .expect("invariant: bincode encodes a record's plain data into a Vec");
    let body = &out[start + 8..];
    // bincode checks its limit only when decoding, and a reader takes a longer record for
    // a torn tail, dropping it and every record after it: stop rather than write one.
    // Records hold a key (rule and subject within tally_crdt's bounds) and numbers.
    assert!(
        body.len() <= RECORD_BYTES_MAX,
        "invariant: a record of a valid key is far below RECORD_BYTES_MAX: {} bytes",
        body.len()
    );
    let len = (body.len() as u32).to_le_bytes();
    let crc = crc32fast::hash(body).to_le_bytes();
    out[start..start + 4].copy_from_slice(&len);
    out[start + 4..start + 8].copy_from_slice(&crc);
}

/// The record at `at` and where the next one starts, if it is whole and checks.
pub fn read<T: DeserializeOwned>(bytes: &[u8], at: usize) -> Option<(T, usize)> {
    let (body, next) = read_body(bytes, at)?;
    Some((decode(body)?, next))
}

/// The body of the record at `at` and where the next one starts, if it is whole and
/// checks: for a log of more than one kind of record, told apart by their bodies.
pub fn read_body(bytes: &[u8], at: usize) -> Option<(&[u8], usize)> {
    let header = bytes.get(at..at.checked_add(8)?)?;
    let len = u32::from_le_bytes(header[..4].try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(header[4..].try_into().ok()?);
    if len == 0 || len > RECORD_BYTES_MAX {
        return None;
    }
    let body = bytes.get(at + 8..at + 8 + len)?;
    (crc32fast::hash(body) == crc).then_some((body, at + 8 + len))
}

/// A record's body decoded, if it decodes whole.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Option<T> {
    let (record, read) = bincode::serde::decode_from_slice(body, CONFIG).ok()?;
    (read == body.len()).then_some(record)
}

/// Every whole record at the front of `bytes`, and how many bytes they take.
pub fn read_all<T: DeserializeOwned>(bytes: &[u8]) -> (Vec<T>, usize) {
    let mut records = Vec::new();
    let mut at = 0;
    while let Some((record, next)) = read(bytes, at) {
        records.push(record);
        at = next;
    }
    (records, at)
}

/// Writes zeros over `*at..to` of `file`, 64 KiB at a time, moving `*at` past each piece
/// written: a log's allocation ahead of its records. After an error, `*at` is where the
/// whole pieces written end.
pub fn write_zeros(file: &File, at: &mut u64, to: u64) -> std::io::Result<()> {
    static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];
    while *at < to {
        let len = (to - *at).min(ZEROS.len() as u64) as usize;
        file.write_all_at(&ZEROS[..len], *at)?;
        *at += len as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    type Record = (u64, String);

    /// TESTING.md S9 for the durable logs: a record whose body holds bytes past what
    /// decodes (one of a newer or another shape) is not read as the record it starts
    /// with, though its length and checksum hold.
    #[test]
    fn a_body_with_trailing_bytes_is_not_read_though_its_checksum_holds() {
        let record: Record = (7, "key".to_owned());
        let mut whole = Vec::new();
        append(&record, &mut whole);
        assert_eq!(
            read::<Record>(&whole, 0),
            Some((record.clone(), whole.len()))
        );
        // The same body and one byte more, framed with its own length and checksum.
        let mut body = whole[8..].to_vec();
        body.push(0);
        let mut longer = (body.len() as u32).to_le_bytes().to_vec();
        longer.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        longer.extend_from_slice(&body);
        assert!(
            read_body(&longer, 0).is_some(),
            "whole, and its checksum holds"
        );
        assert_eq!(decode::<Record>(&body), None);
        assert_eq!(read::<Record>(&longer, 0), None);
        let (records, end) = read_all::<Record>(&[whole.clone(), longer].concat());
        assert_eq!((records, end), (vec![record], whole.len()));
    }
}
