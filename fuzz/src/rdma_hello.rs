//! `transport_rdma::proto::Hello::decode` on arbitrary connection data.
//!
//! Properties: never panics; an accepted hello respects the limits;
//! encoding it gives back the first `HELLO_LEN` bytes of the input (the
//! flags aside: decode keeps only the ones it knows), which decode to the
//! same hello.

use transport_rdma::proto::{Hello, HelloLimits, FLAG_READS_RENDEZVOUS, HEADER_LEN, HELLO_LEN};

/// The transport's default limits (`RdmaConfig`'s `max_peer_*`).
pub const LIMITS: HelloLimits = HelloLimits {
    max_ring_slots: 256,
    max_slot_size: 64 * 1024,
    max_region_len: 16 << 20,
};

/// Runs the checks on one input.
pub fn check(data: &[u8]) {
    let Ok(hello) = Hello::decode(data, &LIMITS) else {
        return;
    };
    assert!((8..=LIMITS.max_ring_slots).contains(&hello.ring_slots));
    assert!((HEADER_LEN as u32 + 64..=LIMITS.max_slot_size).contains(&hello.slot_size));
    assert!((4096..=LIMITS.max_region_len).contains(&hello.region_len));
    let encoded = hello.to_bytes();
    let mut expected = [0; HELLO_LEN];
    expected.copy_from_slice(&data[..HELLO_LEN]);
    let flags = u16::from_le_bytes([data[6], data[7]]) & FLAG_READS_RENDEZVOUS;
    expected[6..8].copy_from_slice(&flags.to_le_bytes());
    assert_eq!(encoded, expected, "re-encoded hello differs");
    assert_eq!(Hello::decode(&encoded, &LIMITS), Ok(hello));
}
