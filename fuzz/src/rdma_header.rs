//! `transport_rdma::proto::Header::decode` on an arbitrary receive slot.
//!
//! The input's first byte says how many bytes of the slot the completion
//! did not fill (`byte_len = slot.len() - slack`, as a completion never
//! reports more than the slot holds); the rest is the slot.
//!
//! Properties: never panics; an accepted header is consistent with the
//! message length (an inline body is exactly `len` bytes, chunks and
//! control messages have none), and re-encodes to the input's first
//! `HEADER_LEN` bytes exactly (the format is canonical: the reserved field
//! is checked).

use transport_rdma::proto::{Header, Kind, FIRST, HEADER_LEN, LAST};

/// Runs the checks on one input.
pub fn check(data: &[u8]) {
    let Some((&slack, slot)) = data.split_first() else {
        return;
    };
    let byte_len = slot.len().saturating_sub(usize::from(slack));
    let Ok(header) = Header::decode(slot, byte_len) else {
        return;
    };
    assert!(byte_len >= HEADER_LEN);
    let body = byte_len - HEADER_LEN;
    match header.kind {
        Kind::Inline => assert_eq!(header.len as usize, body),
        Kind::Chunk => {
            assert_eq!(body, 0);
            assert!(header.len > 0);
            assert_eq!(header.flags & !(FIRST | LAST), 0);
            if header.flags & FIRST != 0 {
                assert!(header.total >= header.len);
            } else {
                assert_eq!(header.total, 0);
            }
        }
        Kind::Announce => {
            use transport_rdma::proto::{announce_body_len, ANNOUNCE_PREFIX_LEN};
            assert!(body >= announce_body_len(1, ANNOUNCE_PREFIX_LEN));
            assert!(header.len as usize >= transport_rdma::proto::ANNOUNCE_PREFIX_LEN);
        }
        Kind::Done => {
            assert_eq!(body, 0);
            assert_eq!(header.len, 0);
        }
        Kind::RegionGranted => {
            assert_eq!(body, 0);
            assert_eq!((header.len, header.flags), (0, 0));
        }
        Kind::RingShrinks => {
            assert_eq!(body, 0);
            assert_eq!((header.len, header.total, header.flags), (0, 0, 0));
        }
        Kind::Credit | Kind::Close | Kind::RegionWanted | Kind::RegionReturned => {
            assert_eq!(body, 0);
            assert_eq!((header.len, header.total, header.pos), (0, 0, 0));
        }
    }
    assert_eq!(
        header.to_bytes()[..],
        slot[..HEADER_LEN],
        "re-encoded header differs"
    );
    assert_eq!(Header::decode(slot, byte_len), Ok(header));
}
