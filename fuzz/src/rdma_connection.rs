//! One `proto::Connection` (the RDMA transport's whole protocol state
//! machine, as it ships) fed what a lying peer and a broken verbs layer can
//! make it see: headers well-formed or not in any receive slot, completions
//! with any `wr_id`, failed completions, disconnection; interleaved with
//! the application's sends of every size, transmits, deliveries, releases
//! and a close.
//!
//! Properties: nothing panics; every work request it asks for names a slot
//! of its kind's range, a SEND never carries more than a slot holds, and an
//! RDMA WRITE stays inside the peer's region; a delivered frame lies inside
//! its slot or is at most the frame limit, an oversized one within the skip
//! limit with at most the prefix length; what the connection holds on the
//! heap stays within a fixed bound, whatever the peer announced; once it
//! failed it posts no SEND or WRITE, refuses sends, and ends with `Failed`.

use arbitrary::Arbitrary;
use bytes::Bytes;
use transport_rdma::proto::{
    Completion, Config, Connection, Delivered, EncodeInto, Header, Kind, ReadReceived,
    SendDecision, Transmit, WorkKind, CTRL_SLOTS, FIRST, HEADER_LEN, HEAP_SLOTS, LAST,
};

use crate::alloc_meter::live_bytes;

const SLOTS: u32 = 8;
const SLOT_SIZE: usize = 96;
const REGION: usize = 256;
const MAX_FRAME: usize = 1000;
const MAX_SKIP: usize = 4000;
const PREFIX: usize = 20;
/// Heap bytes the connection may hold beyond a frame being reassembled:
/// its queues and bookkeeping.
const SLACK: usize = 64 << 10;

/// One input: what happens, in order.
#[derive(Debug, Arbitrary)]
pub struct ConnectionInput {
    /// The events.
    pub ops: Vec<Op>,
}

/// One event.
#[derive(Debug, Arbitrary)]
pub enum Op {
    /// The application sends a frame of `len % 3000` bytes (inline, region
    /// or chunked, by size); `cancel` gives the reservation back instead.
    Send {
        /// The frame length, before the modulo.
        len: u16,
        /// Whether the encoding "panicked" and the reservation is cancelled.
        cancel: bool,
    },
    /// Everything the connection wants posted is taken.
    Transmit,
    /// A message lands in receive slot `slot`: `bytes` as they are.
    RawReceive {
        /// The slot (any value).
        slot: u32,
        /// The message (its first bytes are the header).
        bytes: Vec<u8>,
    },
    /// A well-formed header with fields a peer chooses lands in the
    /// receive slot posted longest ago.
    Receive {
        /// The kind, taken modulo the kinds there are.
        kind: u8,
        /// Chunk flags.
        flags: u8,
        /// Length after the header (inline) or of the chunk.
        len: u16,
        /// A first chunk's frame length.
        total: u32,
        /// A chunk's region position.
        pos: u16,
        /// Credits granted.
        credits: u16,
        /// The peer's report of our region freed.
        freed_to: u16,
    },
    /// A completion with any `wr_id`.
    RawCompletion {
        /// The `wr_id`.
        wr_id: u64,
        /// Whether it failed.
        failed: bool,
    },
    /// The oldest SEND or WRITE posted completes.
    Complete {
        /// Whether it failed.
        failed: bool,
    },
    /// The application takes what was delivered, if anything.
    Deliver,
    /// The application drops the oldest frame it holds in place.
    Release,
    /// The application closes its side.
    Close,
    /// The connection goes down.
    Disconnect,
}

/// The simulated registered memory the connection reads received bytes from.
struct Memory {
    slots: Vec<Vec<u8>>,
    region: Vec<u8>,
}

impl ReadReceived for Memory {
    fn read_slot(&self, slot: u32, offset: usize, dst: &mut [u8]) {
        let slot = &self.slots[slot as usize];
        assert!(offset + dst.len() <= slot.len(), "read past ring slot");
        dst.copy_from_slice(&slot[offset..offset + dst.len()]);
    }
    fn read_region(&self, offset: usize, dst: &mut [u8]) {
        assert!(
            offset + dst.len() <= self.region.len(),
            "read past the region"
        );
        dst.copy_from_slice(&self.region[offset..offset + dst.len()]);
    }
}

/// Runs the checks on one input.
pub fn check(input: &ConnectionInput) {
    let before = live_bytes();
    let mut conn = Connection::new(Config {
        ring_slots: SLOTS,
        slot_size: SLOT_SIZE,
        region_len: REGION as u64,
        peer_ring_slots: SLOTS,
        peer_region_len: REGION as u64,
        inline_max: SLOT_SIZE - HEADER_LEN,
        max_frame_len: MAX_FRAME,
        max_skip_len: MAX_SKIP,
        prefix_len: PREFIX,
    });
    let mut memory = Memory {
        slots: vec![vec![0x5a; SLOT_SIZE]; SLOTS as usize],
        region: vec![0xa5; REGION],
    };
    // Receive slots posted (all, at first), in order; SENDs and WRITEs
    // posted and not completed, by `wr_id`; frames held in place.
    let mut posted: std::collections::VecDeque<u32> = (0..SLOTS).collect();
    let mut in_flight: std::collections::VecDeque<u64> = Default::default();
    let mut held: Vec<u32> = Vec::new();
    let mut failed = false;
    for op in &input.ops {
        match op {
            Op::Send { len, cancel } => send(&mut conn, usize::from(*len) % 3000, *cancel, failed),
            Op::Transmit => {
                while let Some(t) = conn.poll_transmit() {
                    check_transmit(&t, failed);
                    match t {
                        Transmit::Recv { slot } => posted.push_back(slot),
                        Transmit::Write { .. } => in_flight.push_back(WorkKind::Write.wr_id(0)),
                        Transmit::Send { kind, slot, .. } => in_flight.push_back(kind.wr_id(slot)),
                    }
                }
            }
            Op::RawReceive { slot, bytes } => {
                let slot = *slot;
                if let Some(s) = memory.slots.get_mut(slot as usize) {
                    let n = bytes.len().min(SLOT_SIZE);
                    s[..n].copy_from_slice(&bytes[..n]);
                }
                conn.handle_completion(Completion {
                    wr_id: WorkKind::Recv.wr_id(slot),
                    failure: None,
                    byte_len: bytes.len(),
                    header: &bytes[..bytes.len().min(HEADER_LEN)],
                });
            }
            Op::Receive {
                kind,
                flags,
                len,
                total,
                pos,
                credits,
                freed_to,
            } => {
                let Some(slot) = posted.pop_front() else {
                    continue;
                };
                let kinds = [Kind::Inline, Kind::Chunk, Kind::Credit, Kind::Close];
                let mut header = Header::new(kinds[usize::from(*kind) % kinds.len()]);
                header.flags = flags & (FIRST | LAST);
                header.len = u32::from(*len);
                header.total = *total;
                header.pos = u64::from(*pos);
                header.credits = *credits;
                header.freed_to = u64::from(*freed_to);
                let mut bytes = [0; HEADER_LEN];
                header.encode(&mut bytes);
                let byte_len = match header.kind {
                    Kind::Inline => HEADER_LEN + header.len as usize,
                    _ => HEADER_LEN,
                };
                memory.slots[slot as usize][..HEADER_LEN].copy_from_slice(&bytes);
                conn.handle_completion(Completion {
                    wr_id: WorkKind::Recv.wr_id(slot),
                    failure: None,
                    byte_len,
                    header: &bytes,
                });
            }
            Op::RawCompletion { wr_id, failed: f } => {
                conn.handle_completion(Completion {
                    wr_id: *wr_id,
                    failure: f.then_some("IBV_WC_GENERAL_ERR (21)"),
                    byte_len: 0,
                    header: &[],
                });
            }
            Op::Complete { failed: f } => {
                let Some(wr_id) = in_flight.pop_front() else {
                    continue;
                };
                conn.handle_completion(Completion {
                    wr_id,
                    failure: f.then_some("IBV_WC_RETRY_EXC_ERR (12)"),
                    byte_len: 0,
                    header: &[],
                });
            }
            Op::Deliver => {
                if let Some(delivered) = conn.poll_delivery(&memory) {
                    match delivered {
                        Delivered::InSlot { slot, len } => {
                            assert!(
                                slot < SLOTS && HEADER_LEN + len <= SLOT_SIZE,
                                "{slot} {len}"
                            );
                            held.push(slot);
                        }
                        Delivered::CopyOut { slot, len } => {
                            assert!(
                                slot < SLOTS && HEADER_LEN + len <= SLOT_SIZE,
                                "{slot} {len}"
                            );
                            conn.handle_copied(slot);
                        }
                        Delivered::Frame(frame) => assert!(frame.len() <= MAX_FRAME),
                        Delivered::Oversized { len, prefix } => {
                            assert!(len > MAX_FRAME && len <= MAX_SKIP, "oversized {len}");
                            assert!(prefix.len() <= PREFIX);
                        }
                        Delivered::TooLarge { len } => {
                            assert!(len > MAX_SKIP);
                            assert!(conn.failure().is_some(), "too large, not failed");
                        }
                        Delivered::Eof | Delivered::Failed(_) => {}
                    }
                }
            }
            Op::Release => {
                if !held.is_empty() {
                    conn.handle_released(held.remove(0));
                }
            }
            Op::Close => conn.close(),
            Op::Disconnect => conn.handle_disconnected("RDMA_CM_EVENT_DISCONNECTED"),
        }
        failed |= conn.failure().is_some();
        let held_bytes = live_bytes().saturating_sub(before);
        assert!(
            held_bytes <= MAX_FRAME + SLACK + 2 * (SLOTS as usize * SLOT_SIZE + REGION),
            "{held_bytes} bytes live after {op:?}"
        );
    }
    if failed {
        // What arrived before the failure may still come out; then the
        // failure (or the peer's orderly end, if that came first).
        let mut ended = false;
        for _ in 0..4 * SLOTS + 8 {
            match conn.poll_delivery(&memory) {
                Some(Delivered::Failed(_) | Delivered::Eof) => {
                    ended = true;
                    break;
                }
                Some(_) => {}
                None => break,
            }
        }
        assert!(ended, "a failed connection never said so");
        assert!(matches!(conn.handle_send(10), SendDecision::Refused(_)));
    }
}

/// The application's send of a `len`-byte frame.
fn send(conn: &mut Connection, len: usize, cancel: bool, failed: bool) {
    let SendDecision::Encode(reservation) = conn.handle_send(len) else {
        return;
    };
    assert!(!failed, "a failed connection took a frame");
    if cancel {
        conn.cancel_send(reservation);
        return;
    }
    let heap = match conn.encode_into(&reservation) {
        EncodeInto::SendSlot { slot } => {
            assert!(slot < SLOTS, "inline frame in send slot {slot}");
            None
        }
        EncodeInto::Staging { offset } => {
            assert!(
                offset + len <= REGION,
                "frame at {offset} past the staging region"
            );
            None
        }
        EncodeInto::Heap => Some(Bytes::from(vec![0x42; len])),
    };
    let _ = conn.queue_frame(reservation, heap);
}

/// A work request the connection asks for must fit what exists.
fn check_transmit(t: &Transmit, failed: bool) {
    match t {
        Transmit::Recv { slot } => assert!(*slot < SLOTS, "receive posted in slot {slot}"),
        Transmit::Write { offset, len, .. } => {
            assert!(!failed, "a WRITE after the connection failed");
            assert!(
                offset + len <= REGION,
                "WRITE of {len} at {offset} past the peer's region"
            );
        }
        Transmit::Send {
            kind,
            slot,
            body_len,
            ..
        } => {
            assert!(!failed, "a SEND after the connection failed");
            let range = match kind {
                WorkKind::Send => 0..SLOTS,
                WorkKind::Control => SLOTS..SLOTS + CTRL_SLOTS,
                WorkKind::Heap => SLOTS + CTRL_SLOTS..SLOTS + CTRL_SLOTS + HEAP_SLOTS,
                other => panic!("a SEND of kind {other:?}"),
            };
            assert!(range.contains(slot), "{kind:?} SEND from slot {slot}");
            assert!(
                HEADER_LEN + body_len <= SLOT_SIZE,
                "SEND of {body_len} bytes"
            );
        }
    }
}
