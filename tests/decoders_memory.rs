//! TESTING.md S8, in every field: each valid frame of every decoder, with a length of 2^32,
//! 2^40 or 2^64 - 1 put in place of each of its bytes that could be a length (bincode's
//! varint takes a length under 251 in one byte; it becomes the 9-byte varint of the claim),
//! is decoded by every decoder without a panic and with less than 8 MiB allocated in all.
//! A log record is built again around the claim, its length and checksum made to match, so
//! that the claim reaches the record's decoder.
//!
//! Its negative control (TESTING.md: a decoder without a limit) is the client's request
//! decoder with bincode's limit left out, which the same check must catch.
//!
//! A test binary of its own, with one test: the allocator's counts are the process's, so
//! no other test may run beside it.

#![allow(
    clippy::unwrap_used,
    reason = "a panic in a test's set-up is the test's failure report"
)]

mod decoders;

use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;
use tally_client::wire::Request;

#[global_allocator]
static ALLOCATOR: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const CLAIMS: [u64; 3] = [1 << 32, 1 << 40, u64::MAX];
const ALLOCATED_MAX: usize = 8 << 20;

/// `frame` with its byte at `at` replaced by bincode's 9-byte varint of `len`.
fn claiming_at(frame: &[u8], at: usize, len: u64) -> Vec<u8> {
    let mut claiming = frame[..at].to_vec();
    claiming.push(0xfd);
    claiming.extend_from_slice(&len.to_le_bytes());
    claiming.extend_from_slice(&frame[at + 1..]);
    claiming
}

/// The bodies of the records of a log.
fn record_bodies(log: &[u8]) -> Vec<&[u8]> {
    let mut bodies = Vec::new();
    let mut at = 0;
    while let Some(header) = log.get(at..at + 8) {
        let len = u32::from_le_bytes(header[..4].try_into().unwrap()) as usize;
        bodies.push(&log[at + 8..at + 8 + len]);
        at += 8 + len;
    }
    bodies
}

/// The bytes `decode` allocated in all.
fn allocated(decode: impl FnOnce()) -> usize {
    let region = Region::new(ALLOCATOR);
    decode();
    region.change().bytes_allocated
}

/// Every decoder run on `bytes`, and the bytes they allocated in all.
fn allocated_decoding(bytes: &[u8]) -> usize {
    allocated(|| decoders::decode_all(bytes))
}

/// Where `frame` has a byte that could be a length: bincode's varint takes one under 251
/// in a byte.
fn length_bytes(frame: &[u8]) -> impl Iterator<Item = usize> + '_ {
    (0..frame.len()).filter(|&at| frame[at] < 251)
}

/// A valid frame: its name, the bytes that may hold a claim, and the frame around them.
struct Frame {
    name: String,
    bytes: Vec<u8>,
    framed: fn(&[u8]) -> Vec<u8>,
}

#[test]
fn lengths_of_2_to_the_32_40_and_64_in_every_field_allocate_under_8_mib() {
    let mut frames = Vec::new();
    for (name, frame) in decoders::seeds() {
        if decoders::is_log(name) {
            for (i, body) in record_bodies(&frame).into_iter().enumerate() {
                frames.push(Frame {
                    name: format!("{name} record {i}"),
                    bytes: body.to_vec(),
                    framed: decoders::record,
                });
            }
        } else {
            frames.push(Frame {
                name: name.to_owned(),
                bytes: frame,
                framed: <[u8]>::to_vec,
            });
        }
    }
    let (mut tried, mut most) = (0, (0, String::new()));
    for Frame {
        name,
        bytes: frame,
        framed,
    } in &frames
    {
        assert!(
            allocated_decoding(&framed(frame)) < ALLOCATED_MAX,
            "{name} as built"
        );
        for at in length_bytes(frame) {
            for len in CLAIMS {
                let claiming = framed(&claiming_at(frame, at, len));
                let allocated = allocated_decoding(&claiming);
                assert!(
                    allocated < ALLOCATED_MAX,
                    "{name}: a length of {len} at byte {at}: {allocated} bytes allocated"
                );
                if allocated > most.0 {
                    most = (allocated, format!("{name}, byte {at}, {len}"));
                }
                tried += 1;
            }
        }
    }
    assert!(tried > 2_000, "{tried} claims tried");
    // The negative control: the client's request decoder, its version byte skipped, with
    // bincode's limit left out, allocates what a claim asks before it finds the bytes
    // missing. A claim of 64 MiB only: one of 2^40 would abort the process. The zeroed
    // 64 MiB is never touched and is freed before the next claim, so it takes no memory
    // but under strict overcommit (`vm.overcommit_memory = 2`) or a tight address limit.
    let unlimited = |body: &[u8]| {
        let config = bincode::config::standard();
        allocated(|| {
            let _ = bincode::serde::decode_from_slice::<Request, _>(&body[1..], config);
        })
    };
    let request = &frames.iter().find(|frame| frame.name == "request").unwrap();
    let caught = length_bytes(&request.bytes)
        .skip_while(|&at| at == 0)
        .map(|at| unlimited(&claiming_at(&request.bytes, at, 1 << 26)))
        .max()
        .unwrap();
    assert!(
        caught >= ALLOCATED_MAX,
        "without a limit the request decoder allocated at most {caught} bytes for a claim \
         of 64 MiB: the check could not see a decoder without a limit"
    );
    eprintln!(
        "{tried} claims over {} frames: at most {} bytes allocated ({})",
        frames.len(),
        most.0,
        most.1
    );
}
