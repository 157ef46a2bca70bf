//! torch's TCPStore wire format (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, as torch
//! 2.13 speaks it): a one-byte query type, then little-endian fields; strings and byte vectors
//! are a `u64` length and the bytes. Shared by oxrl's client and its own server.

use std::io::{self, Read, Write};

/// Sent once after connecting; a server closes connections that do not send it.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// The queries, numbered as torch numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Query {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    Append = 9,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
}

impl Query {
    pub fn from_byte(byte: u8) -> Option<Query> {
        use Query::*;
        [
            Validate, Set, CompareSet, Get, Add, Check, Wait, GetNumKeys, DeleteKey, Append,
            MultiGet, MultiSet, CancelWait, Ping,
        ]
        .into_iter()
        .find(|q| *q as u8 == byte)
    }
}

/// CHECK's answer.
pub const CHECK_READY: u8 = 0;
pub const CHECK_NOT_READY: u8 = 1;
/// WAIT's answers.
pub const STOP_WAITING: u8 = 0;
pub const WAIT_CANCELED: u8 = 1;

/// Values larger than this are refused rather than allocated: a store holds ids and addresses,
/// and a corrupt length must not exhaust memory.
pub const MAX_VALUE_BYTES: u64 = 1 << 30;

/// One query or reply, built in memory and written with one `write_all`.
pub struct Message(Vec<u8>);

impl Message {
    /// A query: its type byte, then its fields.
    pub fn new(query: Query) -> Self {
        Message(vec![query as u8])
    }
    /// A server's reply: fields only.
    pub fn reply() -> Self {
        Message(Vec::new())
    }
    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(self, b: &[u8]) -> Self {
        let mut m = self.u64(b.len() as u64);
        m.0.extend_from_slice(b);
        m
    }
    pub fn send(&self, to: &mut impl Write) -> io::Result<()> {
        to.write_all(&self.0)?;
        to.flush()
    }
}

pub fn read_u8(from: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    from.read_exact(&mut b)?;
    Ok(b[0])
}

pub fn read_u32(from: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    from.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

pub fn read_u64(from: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    from.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

pub fn read_i64(from: &mut impl Read) -> io::Result<i64> {
    let mut b = [0u8; 8];
    from.read_exact(&mut b)?;
    Ok(i64::from_le_bytes(b))
}

pub fn read_bytes(from: &mut impl Read) -> io::Result<Vec<u8>> {
    let len = read_u64(from)?;
    if len > MAX_VALUE_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a value of {len} bytes (the limit is {MAX_VALUE_BYTES})"),
        ));
    }
    let mut b = vec![0u8; len as usize];
    from.read_exact(&mut b)?;
    Ok(b)
}

pub fn read_string(from: &mut impl Read) -> io::Result<String> {
    String::from_utf8(read_bytes(from)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a key that is not UTF-8"))
}
