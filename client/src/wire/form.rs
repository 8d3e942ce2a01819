//! Plain values in the form bincode 2.0.1's standard config gives them, written and read by
//! hand: the hot paths of the client protocol (`wire/hot_path.rs`) and of tallyd's region
//! protocol build on these, and their tests hold each to bincode's own bytes.
//!
//! Varints: a byte up to 250, else 251, 252 or 253 and a little-endian `u16`, `u32` or
//! `u64`, or 254 and a `u128`; signed integers zigzagged first; enum variants and `Option`
//! tags as varint indexes; strings as a varint length and UTF-8.
//!
//! Every function is `#[inline]`: tallyd's region protocol calls them from another crate.

use super::CheckId;

// Varint forms.
const SINGLE_BYTE_MAX: u8 = 250;
const U16_BYTE: u8 = 251;
const U32_BYTE: u8 = 252;
const U64_BYTE: u8 = 253;
const U128_BYTE: u8 = 254;

const OPTION_NONE: u8 = 0;
const OPTION_SOME: u8 = 1;

/// Appends a `u64` (or any unsigned integer, a length, a variant index).
#[inline]
pub fn put_varint(out: &mut Vec<u8>, n: u64) {
    if let Ok(byte @ 0..=SINGLE_BYTE_MAX) = u8::try_from(n) {
        out.push(byte);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(U16_BYTE);
        out.extend_from_slice(&n.to_le_bytes());
    } else if let Ok(n) = u32::try_from(n) {
        out.push(U32_BYTE);
        out.extend_from_slice(&n.to_le_bytes());
    } else {
        out.push(U64_BYTE);
        out.extend_from_slice(&n.to_le_bytes());
    }
}

/// Appends a `u128`.
#[inline]
pub fn put_u128(out: &mut Vec<u8>, n: u128) {
    match u64::try_from(n) {
        Ok(n) => put_varint(out, n),
        Err(_) => {
            out.push(U128_BYTE);
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
}

/// Appends an `i128`, zigzagged: 0, -1, 1, -2, 2, ... as 0, 1, 2, 3, 4, ...
#[inline]
pub fn put_i128(out: &mut Vec<u8>, n: i128) {
    put_u128(out, ((n << 1) ^ (n >> 127)) as u128);
}

/// Appends a string.
#[inline]
pub fn put_str(out: &mut Vec<u8>, text: &str) {
    put_varint(out, text.len() as u64);
    out.extend_from_slice(text.as_bytes());
}

/// Appends an `Option<CheckId>`.
#[inline]
pub fn put_check_id(out: &mut Vec<u8>, id: Option<CheckId>) {
    match id {
        None => out.push(OPTION_NONE),
        Some(CheckId { session, seq }) => {
            out.push(OPTION_SOME);
            put_varint(out, session);
            put_varint(out, seq);
        }
    }
}

/// Reads values off the front of a body; each read is `None` for what it does not take:
/// too few bytes, or a form bincode would refuse, which a caller then leaves to bincode so
/// that an error is always bincode's.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader of `bytes`, from their first.
    #[inline]
    pub fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { rest: bytes }
    }

    /// Whether every byte has been read.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }

    #[inline]
    fn bytes<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (bytes, rest) = self.rest.split_first_chunk::<N>()?;
        self.rest = rest;
        Some(*bytes)
    }

    /// One byte, as it is.
    #[inline]
    pub fn byte(&mut self) -> Option<u8> {
        self.bytes::<1>().map(|[byte]| byte)
    }

    /// A variant index in its one-byte form.
    #[inline]
    pub fn variant(&mut self) -> Option<u8> {
        self.byte().filter(|&index| index <= SINGLE_BYTE_MAX)
    }

    /// A `u128`.
    #[inline]
    pub fn u128(&mut self) -> Option<u128> {
        Some(match self.byte()? {
            byte @ 0..=SINGLE_BYTE_MAX => byte.into(),
            U16_BYTE => u16::from_le_bytes(self.bytes()?).into(),
            U32_BYTE => u32::from_le_bytes(self.bytes()?).into(),
            U64_BYTE => u64::from_le_bytes(self.bytes()?).into(),
            U128_BYTE => u128::from_le_bytes(self.bytes()?),
            _ => return None,
        })
    }

    /// A `u64`.
    #[inline]
    pub fn u64(&mut self) -> Option<u64> {
        // bincode refuses the 128-bit form for a u64 (a length included), whatever its
        // value: so does this, for the fallback to refuse.
        if self.rest.first() == Some(&U128_BYTE) {
            return None;
        }
        u64::try_from(self.u128()?).ok()
    }

    /// A `u32`.
    #[inline]
    pub fn u32(&mut self) -> Option<u32> {
        // As for a u64: bincode refuses a u32 in the 64-bit form, whatever its value.
        if self.rest.first() == Some(&U64_BYTE) {
            return None;
        }
        u32::try_from(self.u64()?).ok()
    }

    /// An `i128`.
    #[inline]
    pub fn i128(&mut self) -> Option<i128> {
        let zigzag = self.u128()?;
        let magnitude = (zigzag >> 1) as i128;
        Some(if zigzag & 1 == 0 {
            magnitude
        } else {
            !magnitude
        })
    }

    /// A `bool`.
    #[inline]
    pub fn bool(&mut self) -> Option<bool> {
        match self.byte()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }

    /// An `Option<CheckId>`: `None` (the outer `Option`) for a tag other than 0 or 1.
    #[inline]
    pub fn check_id(&mut self) -> Option<Option<CheckId>> {
        match self.byte()? {
            OPTION_NONE => Some(None),
            OPTION_SOME => Some(Some(CheckId {
                session: self.u64()?,
                seq: self.u64()?,
            })),
            _ => None,
        }
    }

    /// An `f64`.
    #[inline]
    pub fn f64(&mut self) -> Option<f64> {
        self.bytes().map(f64::from_le_bytes)
    }

    /// A string borrowed from the body.
    #[inline]
    pub fn str(&mut self) -> Option<&'a str> {
        let len = usize::try_from(self.u64()?).ok()?;
        let (text, rest) = self.rest.split_at_checked(len)?;
        self.rest = rest;
        std::str::from_utf8(text).ok()
    }
}
