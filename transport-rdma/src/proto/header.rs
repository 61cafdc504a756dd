//! The fixed header at the start of every SEND.

use super::ProtocolError;

/// Length of an encoded [`Header`].
pub const HEADER_LEN: usize = 32;

/// `Chunk` flag: the first chunk of a frame (`total` is the frame's length).
pub const FIRST: u8 = 1;
/// `Chunk` flag: the last chunk of a frame.
pub const LAST: u8 = 2;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A whole frame follows the header.
    Inline = 1,
    /// A chunk of a frame was written into the receiver's region.
    Chunk = 2,
    /// Only returns credits and region space.
    Credit = 3,
    /// Orderly end of stream.
    Close = 4,
    /// A rendezvous: the sender announces a frame of `len` bytes, transfer
    /// id `pos`, in its registered memory; the body is an
    /// [`Announcement`](super::Announcement) (segment and the frame's first
    /// bytes). The receiver RDMA READs it, then answers `Done`.
    Announce = 5,
    /// The receiver has read rendezvous transfer `pos`: the sender releases it.
    Done = 6,
    /// The sender has a frame for the receiver's region: the receiver
    /// registers it (it exists only once asked for) and answers
    /// `RegionGranted`. Sent again only after `RegionReturned`.
    RegionWanted = 7,
    /// The answer to `RegionWanted`: the region may be written from now on;
    /// `pos` is the address remote requests name its start by, `total` its
    /// rkey (its length is the hello's).
    RegionGranted = 8,
    /// The sender will not write the receiver's region any more (it went
    /// idle with all of it freed): the receiver deregisters it. The next
    /// frame that needs one asks again (`RegionWanted`).
    RegionReturned = 9,
    /// The sender's receive ring shrinks back to its first slots: the
    /// receiver sends `pos` `Credit` messages (one receive each, so every
    /// receive the sender has posted is consumed and the slots it retires
    /// come back) as its credits allow.
    RingShrinks = 10,
}

/// The header of one message.
///
/// Layout (little-endian): `kind: u8, flags: u8, credits: u16, len: u32,
/// total: u32, reserved: u32 (0), pos: u64, freed_to: u64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the message is.
    pub kind: Kind,
    /// [`FIRST`] / [`LAST`] for chunks, 0 otherwise.
    pub flags: u8,
    /// Receive slots of the sender's ring freed since its last message.
    pub credits: u16,
    /// Bytes after the header (`Inline`) or written into the region (`Chunk`).
    pub len: u32,
    /// The whole frame's length (`Chunk` with [`FIRST`]), the region's
    /// rkey (`RegionGranted`), else 0.
    pub total: u32,
    /// Region stream position of the chunk (`Chunk`), the transfer id
    /// (`Announce`, `Done`), the region's address (`RegionGranted`), else 0.
    pub pos: u64,
    /// The sender's region is freed up to this stream position.
    pub freed_to: u64,
}

impl Header {
    /// A header of `kind` with everything else zero.
    pub fn new(kind: Kind) -> Header {
        Header {
            kind,
            flags: 0,
            credits: 0,
            len: 0,
            total: 0,
            pos: 0,
            freed_to: 0,
        }
    }

    /// Encodes into `out`.
    pub fn encode(&self, out: &mut [u8; HEADER_LEN]) {
        out[0] = self.kind as u8;
        out[1] = self.flags;
        out[2..4].copy_from_slice(&self.credits.to_le_bytes());
        out[4..8].copy_from_slice(&self.len.to_le_bytes());
        out[8..12].copy_from_slice(&self.total.to_le_bytes());
        out[12..16].copy_from_slice(&0u32.to_le_bytes());
        out[16..24].copy_from_slice(&self.pos.to_le_bytes());
        out[24..32].copy_from_slice(&self.freed_to.to_le_bytes());
    }

    /// The encoded header.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0; HEADER_LEN];
        self.encode(&mut out);
        out
    }

    /// Decodes and validates the header of a received message of
    /// `byte_len` bytes (as the receive completion reports it).
    pub fn decode(msg: &[u8], byte_len: usize) -> Result<Header, ProtocolError> {
        if byte_len < HEADER_LEN || msg.len() < HEADER_LEN {
            return Err(ProtocolError::new(format!(
                "message of {byte_len} bytes is shorter than the {HEADER_LEN}-byte header"
            )));
        }
        let u32_at = |at: usize| u32::from_le_bytes(msg[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(msg[at..at + 8].try_into().expect("8 bytes"));
        let kind = match msg[0] {
            1 => Kind::Inline,
            2 => Kind::Chunk,
            3 => Kind::Credit,
            4 => Kind::Close,
            5 => Kind::Announce,
            6 => Kind::Done,
            7 => Kind::RegionWanted,
            8 => Kind::RegionGranted,
            9 => Kind::RegionReturned,
            10 => Kind::RingShrinks,
            other => return Err(ProtocolError::new(format!("unknown message kind {other}"))),
        };
        let header = Header {
            kind,
            flags: msg[1],
            credits: u16::from_le_bytes([msg[2], msg[3]]),
            len: u32_at(4),
            total: u32_at(8),
            pos: u64_at(16),
            freed_to: u64_at(24),
        };
        if u32_at(12) != 0 {
            return Err(ProtocolError::new("reserved header field is not zero"));
        }
        let body = byte_len - HEADER_LEN;
        match kind {
            Kind::Inline => {
                if header.len as usize != body {
                    return Err(ProtocolError::new(format!(
                        "inline message announces {} bytes but carries {body}",
                        header.len
                    )));
                }
                if header.flags != 0 || header.total != 0 || header.pos != 0 {
                    return Err(ProtocolError::new("inline message with chunk fields set"));
                }
            }
            Kind::Chunk => {
                if body != 0 {
                    return Err(ProtocolError::new("chunk message with a body"));
                }
                if header.flags & !(FIRST | LAST) != 0 {
                    return Err(ProtocolError::new(format!(
                        "unknown chunk flags {:#x}",
                        header.flags
                    )));
                }
                if header.len == 0 {
                    return Err(ProtocolError::new("empty chunk"));
                }
                if header.flags & FIRST == 0 && header.total != 0 {
                    return Err(ProtocolError::new("total length on a non-first chunk"));
                }
                if header.flags & FIRST != 0 && header.total < header.len {
                    return Err(ProtocolError::new(format!(
                        "first chunk of {} bytes is longer than its frame of {}",
                        header.len, header.total
                    )));
                }
            }
            Kind::Announce => {
                // Its counts say the rest (`Announcement::decode`).
                let least = super::announce_body_len(1, super::ANNOUNCE_PREFIX_LEN);
                if body < least {
                    return Err(ProtocolError::new(format!(
                        "announcement with a body of {body} bytes, shorter than {least}"
                    )));
                }
                if header.flags != 0 || header.total != 0 {
                    return Err(ProtocolError::new("announcement with chunk fields set"));
                }
                if (header.len as usize) < super::ANNOUNCE_PREFIX_LEN {
                    return Err(ProtocolError::new(format!(
                        "rendezvous frame of {} bytes, shorter than its announced prefix",
                        header.len
                    )));
                }
            }
            Kind::Done => {
                if body != 0 || header.flags != 0 || header.len != 0 || header.total != 0 {
                    return Err(ProtocolError::new("malformed Done message"));
                }
            }
            Kind::RegionGranted => {
                if body != 0 || header.flags != 0 || header.len != 0 {
                    return Err(ProtocolError::new("malformed RegionGranted message"));
                }
            }
            Kind::RingShrinks => {
                if body != 0 || header.flags != 0 || header.len != 0 || header.total != 0 {
                    return Err(ProtocolError::new("malformed RingShrinks message"));
                }
            }
            Kind::Credit | Kind::Close | Kind::RegionWanted | Kind::RegionReturned => {
                if body != 0
                    || header.flags != 0
                    || header.len != 0
                    || header.total != 0
                    || header.pos != 0
                {
                    return Err(ProtocolError::new(format!("malformed {kind:?} message")));
                }
            }
        }
        Ok(header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(h: Header) -> Vec<u8> {
        h.to_bytes().to_vec()
    }

    #[test]
    fn round_trip() {
        let h = Header {
            kind: Kind::Chunk,
            flags: FIRST | LAST,
            credits: 7,
            len: 5000,
            total: 5000,
            pos: 1 << 40,
            freed_to: 99,
        };
        assert_eq!(Header::decode(&full(h), HEADER_LEN), Ok(h));
        let mut inline = Header::new(Kind::Inline);
        inline.len = 10;
        let mut msg = full(inline);
        msg.extend_from_slice(&[0; 10]);
        assert_eq!(Header::decode(&msg, HEADER_LEN + 10), Ok(inline));
    }

    #[test]
    fn rejects_malformed() {
        assert!(Header::decode(&[0; 8], 8).is_err());
        let mut bad = full(Header::new(Kind::Credit));
        bad[0] = 11;
        assert!(Header::decode(&bad, HEADER_LEN).is_err());
        let mut inline = Header::new(Kind::Inline);
        inline.len = 10;
        assert!(Header::decode(&full(inline), HEADER_LEN).is_err());
        let mut chunk = Header::new(Kind::Chunk);
        assert!(
            Header::decode(&full(chunk), HEADER_LEN).is_err(),
            "empty chunk"
        );
        chunk.len = 10;
        chunk.total = 5;
        chunk.flags = FIRST;
        assert!(
            Header::decode(&full(chunk), HEADER_LEN).is_err(),
            "total < len"
        );
        chunk.flags = 0x80;
        assert!(Header::decode(&full(chunk), HEADER_LEN).is_err());
        let mut credit = Header::new(Kind::Credit);
        credit.len = 1;
        assert!(Header::decode(&full(credit), HEADER_LEN).is_err());
        let mut announce = Header::new(Kind::Announce);
        announce.len = 4096;
        announce.pos = 3;
        let mut msg = full(announce);
        let least = crate::proto::announce_body_len(1, crate::proto::ANNOUNCE_PREFIX_LEN);
        msg.extend_from_slice(&[0; 200]);
        assert_eq!(Header::decode(&msg, HEADER_LEN + least), Ok(announce));
        assert_eq!(Header::decode(&msg, HEADER_LEN + 200), Ok(announce));
        assert!(Header::decode(&msg, HEADER_LEN + least - 1).is_err());
        assert!(Header::decode(&msg, HEADER_LEN).is_err(), "no body");
        announce.len = 8;
        assert!(
            Header::decode(&full(announce), HEADER_LEN + least).is_err(),
            "shorter than its prefix"
        );
        let mut done = Header::new(Kind::Done);
        done.pos = 3;
        assert_eq!(Header::decode(&full(done), HEADER_LEN), Ok(done));
        done.len = 1;
        assert!(Header::decode(&full(done), HEADER_LEN).is_err());
        let mut shrink = Header::new(Kind::RingShrinks);
        shrink.pos = 60;
        assert_eq!(Header::decode(&full(shrink), HEADER_LEN), Ok(shrink));
        shrink.total = 1;
        assert!(Header::decode(&full(shrink), HEADER_LEN).is_err());
        let mut reserved = full(Header::new(Kind::Close));
        reserved[12] = 1;
        assert!(Header::decode(&reserved, HEADER_LEN).is_err());
    }
}
