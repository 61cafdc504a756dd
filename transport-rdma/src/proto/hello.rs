//! What the peers exchange in the connection manager's private data.

use super::{ProtocolError, HEADER_LEN};

/// First bytes of every [`Hello`]: `"RRPC"`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"RRPC");
/// The protocol version this crate speaks (8: each side's region is the
/// smaller of the two announced, [`Hello::region_with`]).
pub const VERSION: u16 = 8;
/// Encoded length of a [`Hello`] (fits the 56 bytes `rdma_connect` carries).
pub const HELLO_LEN: usize = 32;
/// Set in a hello's flags when its side reads rendezvous transfers
/// ([`Hello::reads_rendezvous`]).
pub const FLAG_READS_RENDEZVOUS: u16 = 2;

/// One side's receive geometry: how many receive slots of what size it
/// has, how many of them it posts at first (the peer's first credits; it
/// doubles them as the peer's traffic needs), and how large a region the
/// peer may RDMA WRITE into once it asked for it (`RegionWanted`; the region's
/// address and key come in the answer, so none is registered, and none
/// goes on the wire, for a connection that never needs one).
///
/// Layout (little-endian): `magic: u32, version: u16, flags: u16
/// ([`FLAG_READS_RENDEZVOUS`], and [`auth::FLAG_PROOF`](super::auth::FLAG_PROOF)
/// when a proof follows),
/// ring_slots: u32, slot_size: u32, initial_slots: u32, reserved: [u8; 8]
/// (zero), region_len: u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Receive slots, at most: the ring grows to this many.
    pub ring_slots: u32,
    /// Receive slots posted at first (4..=`ring_slots`): the peer starts
    /// with this many credits. More come, as credits the peer never had,
    /// each time it keeps half of the slots in use consumed.
    pub initial_slots: u32,
    /// Bytes per receive slot, header included.
    pub slot_size: u32,
    /// The length in bytes of the large-payload region it grants when
    /// asked, at most: the connection's regions are the smaller of the two
    /// sides' ([`region_with`](Self::region_with)).
    pub region_len: u32,
    /// This side takes rendezvous transfers: it RDMA READs announced frames
    /// into its pool. A side sends by rendezvous only to a peer that does,
    /// and refuses announcements when it does not (so a peer cannot make
    /// it register memory it did not budget for).
    pub reads_rendezvous: bool,
}

/// Bounds a [`Hello`] must respect to be accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloLimits {
    /// Most receive slots accepted (each costs a send slot here).
    pub max_ring_slots: u32,
    /// Largest slot accepted.
    pub max_slot_size: u32,
    /// Largest region accepted.
    pub max_region_len: u32,
}

impl Hello {
    /// The length of both regions of a connection between this side and
    /// `peer`: the smaller of the two announced. Each side registers a
    /// region that long for the other to write, and stages what it writes
    /// in as much (staging mirrors the offsets it writes at), so neither
    /// side pins more for the other's writes, or for its own, than its own
    /// setting, whatever the other announces.
    pub fn region_with(&self, peer: &Hello) -> u32 {
        self.region_len.min(peer.region_len)
    }

    /// Encodes the hello.
    pub fn to_bytes(&self) -> [u8; HELLO_LEN] {
        let mut b = [0; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        let flags = if self.reads_rendezvous {
            FLAG_READS_RENDEZVOUS
        } else {
            0
        };
        b[6..8].copy_from_slice(&flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.ring_slots.to_le_bytes());
        b[12..16].copy_from_slice(&self.slot_size.to_le_bytes());
        b[16..20].copy_from_slice(&self.initial_slots.to_le_bytes());
        b[28..32].copy_from_slice(&self.region_len.to_le_bytes());
        b
    }

    /// Decodes and validates a peer's hello (trailing bytes, e.g. the
    /// connection manager's zero padding, are ignored).
    pub fn decode(b: &[u8], limits: &HelloLimits) -> Result<Hello, ProtocolError> {
        let b = b.get(..HELLO_LEN).ok_or_else(|| {
            ProtocolError::new(format!(
                "peer's connection data is {} bytes, expected at least {HELLO_LEN} \
                 (is the peer an rdma-rpc endpoint?)",
                b.len()
            ))
        })?;
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        if u32_at(0) != MAGIC {
            return Err(ProtocolError::new(
                "peer's connection data lacks the rdma-rpc magic (not an rdma-rpc endpoint)",
            ));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(ProtocolError::new(format!(
                "peer speaks protocol version {version}, this side {VERSION}"
            )));
        }
        if b[20..28].iter().any(|&byte| byte != 0) {
            return Err(ProtocolError::new("peer's hello has reserved bytes set"));
        }
        let hello = Hello {
            ring_slots: u32_at(8),
            slot_size: u32_at(12),
            initial_slots: u32_at(16),
            region_len: u32_at(28),
            reads_rendezvous: u16::from_le_bytes([b[6], b[7]]) & FLAG_READS_RENDEZVOUS != 0,
        };
        if !(8..=limits.max_ring_slots).contains(&hello.ring_slots) {
            return Err(ProtocolError::new(format!(
                "peer announces {} receive slots (accepted: 8..={})",
                hello.ring_slots, limits.max_ring_slots
            )));
        }
        if !(4..=hello.ring_slots).contains(&hello.initial_slots) {
            return Err(ProtocolError::new(format!(
                "peer posts {} of its {} receive slots at first (accepted: 4..={})",
                hello.initial_slots, hello.ring_slots, hello.ring_slots
            )));
        }
        if !(HEADER_LEN as u32 + 64..=limits.max_slot_size).contains(&hello.slot_size) {
            return Err(ProtocolError::new(format!(
                "peer announces {}-byte slots (accepted: {}..={})",
                hello.slot_size,
                HEADER_LEN + 64,
                limits.max_slot_size
            )));
        }
        if !(4096..=limits.max_region_len).contains(&hello.region_len) {
            return Err(ProtocolError::new(format!(
                "peer announces a {}-byte region (accepted: 4096..={})",
                hello.region_len, limits.max_region_len
            )));
        }
        Ok(hello)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: HelloLimits = HelloLimits {
        max_ring_slots: 1024,
        max_slot_size: 65536,
        max_region_len: 1 << 26,
    };

    fn hello() -> Hello {
        Hello {
            ring_slots: 64,
            slot_size: 8192,
            initial_slots: 8,
            region_len: 1 << 20,
            reads_rendezvous: false,
        }
    }

    #[test]
    fn round_trip_with_padding() {
        for reads_rendezvous in [false, true] {
            let hello = Hello {
                reads_rendezvous,
                ..hello()
            };
            let mut b = hello.to_bytes().to_vec();
            b.extend_from_slice(&[0; 24]);
            assert_eq!(Hello::decode(&b, &LIMITS), Ok(hello));
        }
    }

    #[test]
    fn the_rendezvous_flag_survives_the_proof_flag() {
        let mut b = Hello {
            reads_rendezvous: true,
            ..hello()
        }
        .to_bytes();
        super::super::auth::set_flag(&mut b, super::super::auth::FLAG_PROOF);
        assert!(Hello::decode(&b, &LIMITS).unwrap().reads_rendezvous);
    }

    #[test]
    fn rejects_bad_hellos() {
        assert!(Hello::decode(&[], &LIMITS).is_err());
        let mut b = hello().to_bytes();
        b[0] ^= 1;
        assert!(Hello::decode(&b, &LIMITS).is_err());
        let mut b = hello().to_bytes();
        b[4] = 4; // version 4 (the whole ring posted at first)
        assert!(Hello::decode(&b, &LIMITS).is_err());
        for bad in [
            Hello {
                ring_slots: 4,
                ..hello()
            },
            Hello {
                ring_slots: 5000,
                ..hello()
            },
            Hello {
                initial_slots: 3,
                ..hello()
            },
            Hello {
                initial_slots: 65,
                ..hello()
            },
            Hello {
                slot_size: 16,
                ..hello()
            },
            Hello {
                slot_size: 1 << 20,
                ..hello()
            },
            Hello {
                region_len: 100,
                ..hello()
            },
            Hello {
                region_len: 1 << 30,
                ..hello()
            },
        ] {
            assert!(Hello::decode(&bad.to_bytes(), &LIMITS).is_err(), "{bad:?}");
        }
        let mut b = hello().to_bytes();
        b[24] = 1; // reserved
        assert!(Hello::decode(&b, &LIMITS).is_err());
    }
}
