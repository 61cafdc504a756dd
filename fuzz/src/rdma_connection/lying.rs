//! One `proto::Connection` against a lying peer and a broken verbs layer.
//!
//! The harness keeps its own model of what was posted, of the credits for
//! the peer's ring and of our ring's occupancy, from the work requests the
//! connection asks for and the messages it is fed (never from the
//! connection's own counters), and checks the connection against it: a lie
//! the model can tell must fail the connection, a genuine completion must
//! be taken, the connection's counters must agree with the model's.

use std::collections::VecDeque;

use arbitrary::Arbitrary;
use bytes::Bytes;
use transport_rdma::proto::{
    Completion, Config, Connection, Delivered, EncodeInto, Header, Kind, ReadReceived,
    RendezvousConfig, SendDecision, Transmit, WorkKind, CTRL_SLOTS, FIRST, HEADER_LEN, HEAP_SLOTS,
    LAST,
};

use super::frame_len;
use crate::alloc_meter::{held_since, live_bytes};

const SLOTS: u32 = 8;
const SLOT_SIZE: usize = 96;
const REGION: usize = 256;
const MAX_FRAME: usize = 1000;
const MAX_SKIP: usize = 4000;
const PREFIX: usize = 20;
/// Send slots: data, then control, then heap chunks.
const SEND_SLOTS: u32 = SLOTS + CTRL_SLOTS + HEAP_SLOTS;
/// Heap bytes the connection may hold beyond a frame being reassembled:
/// its queues and bookkeeping.
const SLACK: usize = 64 << 10;

/// One event.
#[derive(Debug, Arbitrary)]
pub enum Op {
    /// The application sends a frame of [`frame_len`]`(len, 3000)` bytes
    /// (inline, region or chunked, by size); `cancel` gives the reservation
    /// back instead.
    Send {
        /// The frame length, before [`frame_len`].
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
    /// A header with fields a peer chooses (those of its kind) lands in
    /// the receive slot posted longest ago.
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
        /// Credits granted (near: relative to what the peer may return).
        credits: Value,
        /// The peer's report of our region freed (near: relative to the
        /// end of what was written into it).
        freed_to: Value,
    },
    /// A completion with any `wr_id`.
    RawCompletion {
        /// The `wr_id`.
        wr_id: u64,
        /// Whether it failed.
        failed: bool,
    },
    /// The `n`-th oldest SEND or WRITE posted and not completed completes
    /// (a broken verbs layer may report them in any order).
    Complete {
        /// Which one, modulo those in flight.
        n: u8,
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
    /// The driver's tick: the connection gives the peer's region back if
    /// it is idle.
    ReturnRegion,
}

/// A number a peer chooses: any, or a near miss of the honest limit (so
/// that off-by-a-few lies are tried as often as wild ones).
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Value {
    /// This value.
    Any(u16),
    /// The honest limit plus this.
    Near(i8),
}

impl Value {
    fn get(self, limit: u64) -> u64 {
        match self {
            Value::Any(v) => u64::from(v),
            Value::Near(d) => limit.saturating_add_signed(i64::from(d)),
        }
    }
}

/// The simulated registered memory the connection reads received bytes from.
struct Memory {
    slots: Vec<Vec<u8>>,
    region: Vec<u8>,
    /// The region is registered (asked for, and not returned since).
    registered: bool,
}

impl ReadReceived for Memory {
    fn read_slot(&self, slot: u32, offset: usize, dst: &mut [u8]) {
        let slot = &self.slots[slot as usize];
        assert!(offset + dst.len() <= slot.len(), "read past ring slot");
        dst.copy_from_slice(&slot[offset..offset + dst.len()]);
    }
    fn read_region(&self, offset: usize, dst: &mut [u8]) {
        assert!(self.registered, "a chunk read from a region not registered");
        assert!(
            offset + dst.len() <= self.region.len(),
            "read past the region"
        );
        dst.copy_from_slice(&self.region[offset..offset + dst.len()]);
    }
}

/// What the harness knows from outside the connection.
struct Model {
    /// Receive slots posted, in posting order.
    recv_posted: VecDeque<u32>,
    /// Send slots with a SEND posted and not completed.
    send_posted: Vec<bool>,
    /// SENDs and WRITEs posted and not completed, oldest first.
    in_flight: Vec<u64>,
    /// Credits for the peer's ring: all at first, one less per SEND, plus
    /// what the peer granted.
    credits: u32,
    /// Our ring's slots consumed by an arrival and not yet returned to the
    /// peer as credits.
    outstanding: u32,
    /// The peer's region: written up to here (end of the last WRITE), and
    /// reported freed up to here.
    written_to: u64,
    freed_to: u64,
    /// At most this many frames can still be delivered (each data message
    /// taken adds one; a delivered frame takes one).
    deliverable: usize,
    /// Frames held in place by the application.
    held: VecDeque<u32>,
    /// The regions: we asked for the peer's and it granted it; it asked
    /// for ours, we registered it and granted it; it returned ours (its
    /// deregistration is due).
    asked_region: bool,
    peer_granted: bool,
    peer_asked: bool,
    registered: bool,
    own_granted: bool,
    returned: bool,
    failed: bool,
}

impl Model {
    /// Why a completion of `wr_id` is not for a request posted, if it is not.
    fn bogus(&self, wr_id: u64) -> Option<&'static str> {
        let index = wr_id as u32;
        let posted = |i: u32| self.send_posted[i as usize];
        match wr_id >> 32 {
            1 if !self.recv_posted.contains(&index) => Some("a receive not posted"),
            2 if index >= SLOTS || !posted(index) => Some("a data SEND not posted"),
            3 if !(SLOTS..SLOTS + CTRL_SLOTS).contains(&index) || !posted(index) => {
                Some("a control SEND not posted")
            }
            4 if index != 0 || !self.in_flight.contains(&wr_id) => Some("a WRITE not posted"),
            5 if !(SLOTS + CTRL_SLOTS..SEND_SLOTS).contains(&index) || !posted(index) => {
                Some("a heap SEND not posted")
            }
            1..=5 => None,
            _ => Some("an unknown work request kind"),
        }
    }

    /// Why a message with `header` is a lie, if the model can tell.
    fn lie(&self, header: &Header) -> Option<String> {
        if self.outstanding >= SLOTS {
            return Some("a message into a full ring".into());
        }
        if self.credits + u32::from(header.credits) > SLOTS {
            return Some(format!(
                "{} credits granted while {} of {SLOTS} are held",
                header.credits, self.credits
            ));
        }
        if header.freed_to > self.written_to {
            return Some(format!(
                "region freed to {} beyond the {} bytes written",
                header.freed_to, self.written_to
            ));
        }
        if header.freed_to < self.freed_to {
            return Some(format!(
                "region freed to {}, back from {}",
                header.freed_to, self.freed_to
            ));
        }
        match header.kind {
            Kind::Chunk if !self.own_granted => Some("a chunk before we granted our region".into()),
            Kind::RegionWanted if self.peer_asked => Some("our region asked for twice".into()),
            Kind::RegionGranted if !self.asked_region || self.peer_granted => {
                Some("a region grant unasked".into())
            }
            Kind::RegionReturned if !self.own_granted => {
                Some("a region returned we did not grant".into())
            }
            Kind::RingShrinks if header.pos > u64::from(SLOTS) => {
                Some("more messages asked for than the peer's ring has slots".into())
            }
            _ => None,
        }
    }
}

/// Runs the checks on one input.
pub fn check(ops: &[Op]) {
    let mark = live_bytes();
    let mut conn = Connection::new(Config {
        ring_slots: SLOTS,
        // The whole ring at once (the crate's own simulation grows it).
        initial_ring_slots: SLOTS,
        slot_size: SLOT_SIZE,
        region_len: REGION as u64,
        peer_ring_slots: SLOTS,
        peer_initial_ring_slots: SLOTS,
        send_slots: SLOTS,
        peer_region_len: REGION as u64,
        inline_max: SLOT_SIZE - HEADER_LEN,
        max_frame_len: MAX_FRAME,
        max_skip_len: MAX_SKIP,
        prefix_len: PREFIX,
        // Off: an announcement is a lie this side must refuse.
        rendezvous: RendezvousConfig::OFF,
    });
    let mut memory = Memory {
        slots: vec![vec![0x5a; SLOT_SIZE]; SLOTS as usize],
        region: vec![0xa5; REGION],
        registered: false,
    };
    let mut m = Model {
        recv_posted: (0..SLOTS).collect(),
        send_posted: vec![false; SEND_SLOTS as usize],
        in_flight: Vec::new(),
        credits: SLOTS,
        outstanding: 0,
        written_to: 0,
        freed_to: 0,
        deliverable: 0,
        held: VecDeque::new(),
        asked_region: false,
        peer_granted: false,
        peer_asked: false,
        registered: false,
        own_granted: false,
        returned: false,
        failed: false,
    };
    for op in ops {
        // Set when the model can tell this event is a lie (the connection
        // must fail), or that it is a genuine completion (it must not).
        let mut must_fail: Option<String> = None;
        let mut must_take = false;
        match op {
            Op::Send { len, cancel } => send(&mut conn, frame_len(*len, 3000), *cancel, &m),
            Op::Transmit => {
                while let Some(t) = conn.poll_transmit() {
                    transmitted(&t, &mut m);
                    if t == Transmit::RegisterRegion {
                        memory.registered = true;
                        conn.region_registered(0x1000, 1);
                    }
                    if t == Transmit::DeregisterRegion {
                        memory.registered = false;
                    }
                }
            }
            Op::RawReceive { slot, bytes } => {
                let slot = *slot;
                if let Some(s) = memory.slots.get_mut(slot as usize) {
                    let n = bytes.len().min(SLOT_SIZE);
                    s[..n].copy_from_slice(&bytes[..n]);
                }
                let header = &bytes[..bytes.len().min(HEADER_LEN)];
                must_fail = match m.bogus(WorkKind::Recv.wr_id(slot)) {
                    Some(why) => Some(why.into()),
                    None if bytes.len() > SLOT_SIZE => Some("a message longer than a slot".into()),
                    // What the header check refuses is a lie too (whether
                    // it refuses right is `rdma_header`'s business).
                    None => match Header::decode(header, bytes.len()) {
                        Err(e) => Some(e.to_string()),
                        Ok(h) => m.lie(&h),
                    },
                };
                arrive(&mut m, slot, header, bytes.len());
                conn.handle_completion(Completion {
                    wr_id: WorkKind::Recv.wr_id(slot),
                    failure: None,
                    byte_len: bytes.len(),
                    header,
                    at: None,
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
                let Some(&slot) = m.recv_posted.front() else {
                    continue;
                };
                let kinds = [
                    Kind::Inline,
                    Kind::Chunk,
                    Kind::Credit,
                    Kind::Close,
                    Kind::RegionWanted,
                    Kind::RegionGranted,
                    Kind::RegionReturned,
                    Kind::RingShrinks,
                ];
                let mut header = Header::new(kinds[usize::from(*kind) % kinds.len()]);
                // Only the fields its kind carries (a header malformed
                // otherwise is `RawReceive`'s business).
                match header.kind {
                    Kind::Inline => header.len = u32::from(*len),
                    Kind::Chunk => {
                        header.flags = flags & (FIRST | LAST);
                        header.len = u32::from(*len);
                        header.total = *total;
                        header.pos = u64::from(*pos);
                    }
                    Kind::RegionGranted => {
                        header.total = *total;
                        header.pos = u64::from(*pos);
                    }
                    Kind::RingShrinks => header.pos = u64::from(*pos),
                    Kind::Credit
                    | Kind::Close
                    | Kind::Announce
                    | Kind::Done
                    | Kind::RegionWanted
                    | Kind::RegionReturned => {}
                }
                let returnable = u64::from(SLOTS - m.credits.min(SLOTS));
                header.credits = credits.get(returnable).min(u16::MAX.into()) as u16;
                header.freed_to = freed_to.get(m.written_to);
                let bytes = header.to_bytes();
                let byte_len = match header.kind {
                    Kind::Inline => HEADER_LEN + header.len as usize,
                    _ => HEADER_LEN,
                };
                must_fail = m.lie(&header);
                arrive(&mut m, slot, &bytes, byte_len);
                memory.slots[slot as usize][..HEADER_LEN].copy_from_slice(&bytes);
                conn.handle_completion(Completion {
                    wr_id: WorkKind::Recv.wr_id(slot),
                    failure: None,
                    byte_len,
                    header: &bytes,
                    at: None,
                });
            }
            Op::RawCompletion { wr_id, failed } => {
                must_fail = match m.bogus(*wr_id) {
                    Some(why) => Some(why.into()),
                    None if *failed => Some("a failed completion".into()),
                    // WRITEs go unsignaled: one completes only if it failed.
                    None if *wr_id >> 32 == 4 => Some("a WRITE completed".into()),
                    // A receive completion with no bytes: not a message.
                    None if *wr_id >> 32 == 1 => Some("an empty receive".into()),
                    None => None,
                };
                must_take = must_fail.is_none();
                completed(&mut m, *wr_id);
                conn.handle_completion(Completion {
                    wr_id: *wr_id,
                    failure: failed.then_some("IBV_WC_GENERAL_ERR (21)"),
                    byte_len: 0,
                    header: &[],
                    at: None,
                });
            }
            Op::Complete { n, failed } => {
                if m.in_flight.is_empty() {
                    continue;
                }
                let wr_id = m.in_flight[usize::from(*n) % m.in_flight.len()];
                must_fail = if *failed {
                    Some("a failed completion".into())
                } else if wr_id >> 32 == 4 {
                    // WRITEs go unsignaled: one completes only if it failed.
                    Some("a WRITE completed".into())
                } else {
                    None
                };
                must_take = must_fail.is_none();
                completed(&mut m, wr_id);
                conn.handle_completion(Completion {
                    wr_id,
                    failure: failed.then_some("IBV_WC_RETRY_EXC_ERR (12)"),
                    byte_len: 0,
                    header: &[],
                    at: None,
                });
            }
            Op::Deliver => {
                if let Some(delivered) = conn.poll_delivery(&memory) {
                    deliver(&mut conn, &mut m, delivered);
                }
            }
            Op::Release => {
                if let Some(slot) = m.held.pop_front() {
                    conn.handle_released(slot);
                }
            }
            Op::Close => conn.close(),
            Op::Disconnect => conn.handle_disconnected("RDMA_CM_EVENT_DISCONNECTED"),
            Op::ReturnRegion => {
                if conn.return_idle_region() {
                    assert!(
                        !m.failed && m.peer_granted && m.freed_to == m.written_to,
                        "the peer's region returned ungranted or with chunks in it"
                    );
                }
            }
        }
        if !m.failed {
            if let Some(why) = must_fail {
                assert!(conn.failure().is_some(), "{why} was taken: {op:?}");
            } else if must_take {
                assert_eq!(conn.failure(), None, "a genuine completion failed: {op:?}");
            }
        }
        if let Some(reason) = conn.failure() {
            if !m.failed && reason.starts_with("peer broke the protocol") {
                // What the peer sent before is dropped with it.
                m.deliverable = 0;
            }
            m.failed = true;
        } else {
            // The connection's counters agree with what it was seen to do.
            assert_eq!(conn.credits_available(), m.credits, "credits, after {op:?}");
            assert_eq!(conn.ring_outstanding(), m.outstanding, "ring, after {op:?}");
        }
        let held = held_since(mark);
        assert!(
            held <= MAX_FRAME + SLACK + 2 * (SLOTS as usize * SLOT_SIZE + REGION),
            "{held} bytes live after {op:?}"
        );
    }
    if m.failed {
        // What arrived before the failure may still come out (bounded by
        // `deliverable`, checked in `deliver`); then the failure, or the
        // peer's orderly end if that came first.
        let mut ended = false;
        for _ in 0..4 * SLOTS + 8 {
            match conn.poll_delivery(&memory) {
                Some(Delivered::Failed(_) | Delivered::Eof) => {
                    ended = true;
                    break;
                }
                Some(delivered) => deliver(&mut conn, &mut m, delivered),
                None => break,
            }
        }
        assert!(ended, "a failed connection never said so");
        assert!(matches!(conn.handle_send(10), SendDecision::Refused(_)));
        while let Some(t) = conn.poll_transmit() {
            transmitted(&t, &mut m);
        }
    }
}

/// A message landed in `slot` (the connection is about to be told).
fn arrive(m: &mut Model, slot: u32, header: &[u8], byte_len: usize) {
    if let Some(i) = m.recv_posted.iter().position(|&s| s == slot) {
        m.recv_posted.remove(i);
    }
    if m.failed {
        return;
    }
    // If the connection takes it (it is checked to refuse every lie the
    // model can tell), this is what it did.
    let Ok(h) = Header::decode(header, byte_len) else {
        return;
    };
    m.outstanding += 1;
    m.credits += u32::from(h.credits);
    m.freed_to = h.freed_to;
    match h.kind {
        Kind::Inline | Kind::Chunk => m.deliverable += 1,
        // Reposted at once: the harness sees it in the next transmit (a
        // `RingShrinks` is answered with `Credit` messages, which the
        // checks of every SEND cover).
        Kind::Credit | Kind::Close | Kind::RingShrinks => {}
        Kind::RegionWanted => m.peer_asked = true,
        Kind::RegionGranted => m.peer_granted = true,
        // Ours may be asked for again once deregistered.
        Kind::RegionReturned => {
            m.returned = true;
            m.own_granted = false;
            m.peer_asked = false;
        }
        // With the rendezvous off, either fails the connection (the
        // checks after a failure apply).
        Kind::Announce | Kind::Done => {}
    }
}

/// A completion of `wr_id` is about to be reported.
fn completed(m: &mut Model, wr_id: u64) {
    let index = wr_id as u32;
    match wr_id >> 32 {
        1 => {
            if let Some(i) = m.recv_posted.iter().position(|&s| s == index) {
                m.recv_posted.remove(i);
            }
        }
        2 | 3 | 5 => {
            if let Some(p) = m.send_posted.get_mut(index as usize) {
                *p = false;
            }
        }
        _ => {}
    }
    if let Some(i) = m.in_flight.iter().position(|&w| w == wr_id) {
        m.in_flight.remove(i);
    }
}

/// A frame (or the end) handed to the application.
fn deliver(conn: &mut Connection, m: &mut Model, delivered: Delivered) {
    let frame = !matches!(delivered, Delivered::Eof | Delivered::Failed(_));
    if frame {
        assert!(
            m.deliverable > 0,
            "{delivered:?} delivered, more than the messages taken (failed: {:?})",
            conn.failure()
        );
        m.deliverable -= 1;
    }
    match delivered {
        Delivered::InSlot { slot, len } => {
            assert!(
                slot < SLOTS && HEADER_LEN + len <= SLOT_SIZE,
                "{slot} {len}"
            );
            assert!(!m.held.contains(&slot), "slot {slot} handed up twice");
            m.held.push_back(slot);
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
        Delivered::Failed(_) => assert!(conn.failure().is_some(), "failed, says who"),
        Delivered::Eof => {}
        Delivered::Pooled { .. } => panic!("a rendezvous frame with the rendezvous off"),
    }
}

/// The application's send of a `len`-byte frame.
fn send(conn: &mut Connection, len: usize, cancel: bool, m: &Model) {
    let SendDecision::Encode(reservation) = conn.handle_send(len) else {
        return;
    };
    assert!(!m.failed, "a failed connection took a frame");
    if cancel {
        conn.cancel_send(reservation);
        return;
    }
    let heap = match conn.encode_into(&reservation) {
        EncodeInto::SendSlot { slot } => {
            assert!(slot < SLOTS, "inline frame in send slot {slot}");
            assert!(!m.send_posted[slot as usize], "send slot {slot} in flight");
            None
        }
        EncodeInto::Staging { offset } => {
            assert!(
                offset + len <= REGION,
                "frame at {offset} past the staging region"
            );
            None
        }
        EncodeInto::Heap => Some(Bytes::from(vec![0x42; len]).into()),
        EncodeInto::Rendezvous { .. } => unreachable!("the rendezvous is off"),
    };
    let _ = conn.queue_frame(reservation, heap);
}

/// A work request the connection asks for must fit what exists, and is
/// now posted.
fn transmitted(t: &Transmit, m: &mut Model) {
    match *t {
        Transmit::Alloc { .. } | Transmit::Read { .. } | Transmit::Release { .. } => {
            panic!("rendezvous work with the rendezvous off: {t:?}")
        }
        Transmit::RegisterRing { .. } => panic!("the ring grew, though whole from the start"),
        Transmit::DeregisterRing { .. } => panic!("the ring shrank, though never grown"),
        Transmit::RegisterRegion => {
            assert!(
                m.peer_asked && !m.registered,
                "our region registered unasked or twice"
            );
            m.registered = true;
        }
        Transmit::DeregisterRegion => {
            assert!(
                m.returned && m.registered,
                "our region deregistered unreturned or twice"
            );
            m.returned = false;
            m.registered = false;
        }
        Transmit::Recv { slot } => {
            assert!(slot < SLOTS, "receive posted in slot {slot}");
            if m.failed {
                // The model no longer follows the ring (a lie broke it).
                return;
            }
            assert!(!m.recv_posted.contains(&slot), "slot {slot} posted twice");
            assert!(!m.held.contains(&slot), "slot {slot} posted while held");
            m.recv_posted.push_back(slot);
        }
        Transmit::Write {
            offset, len, pos, ..
        } => {
            assert!(!m.failed, "a WRITE after the connection failed");
            assert!(m.peer_granted, "a WRITE before the peer granted its region");
            assert!(
                offset + len <= REGION,
                "WRITE of {len} at {offset} past the peer's region"
            );
            assert!(
                pos + len as u64 <= m.freed_to + REGION as u64,
                "WRITE of {len} at {pos} into space the peer has not freed (to {})",
                m.freed_to
            );
            m.written_to = m.written_to.max(pos + len as u64);
            m.in_flight.push(WorkKind::Write.wr_id(0));
        }
        Transmit::Send {
            kind,
            slot,
            header,
            body_len,
        } => {
            assert!(!m.failed, "a SEND after the connection failed");
            let range = match kind {
                WorkKind::Send => 0..SLOTS,
                WorkKind::Control => SLOTS..SLOTS + CTRL_SLOTS,
                WorkKind::Heap => SLOTS + CTRL_SLOTS..SEND_SLOTS,
                other => panic!("a SEND of kind {other:?}"),
            };
            assert!(range.contains(&slot), "{kind:?} SEND from slot {slot}");
            match header.kind {
                Kind::RegionWanted => {
                    assert!(!m.asked_region, "the peer's region asked for twice");
                    m.asked_region = true;
                }
                Kind::RegionGranted => {
                    assert!(
                        m.registered && !m.own_granted,
                        "our region granted before it was registered, or twice"
                    );
                    m.own_granted = true;
                }
                Kind::RegionReturned => {
                    assert!(
                        m.peer_granted && m.freed_to == m.written_to,
                        "the peer's region returned ungranted or with chunks in it"
                    );
                    m.asked_region = false;
                    m.peer_granted = false;
                }
                _ => {}
            }
            assert!(
                !m.send_posted[slot as usize],
                "send slot {slot} reused before its completion"
            );
            assert!(
                HEADER_LEN + body_len <= SLOT_SIZE,
                "SEND of {body_len} bytes"
            );
            // A data message keeps the last credit for a control one.
            let needed = if kind == WorkKind::Control { 1 } else { 2 };
            assert!(
                m.credits >= needed,
                "{kind:?} SEND with {} credits",
                m.credits
            );
            m.credits -= 1;
            assert!(
                u32::from(header.credits) <= m.outstanding,
                "{} credits returned, {} slots outstanding",
                header.credits,
                m.outstanding
            );
            m.outstanding -= u32::from(header.credits);
            m.send_posted[slot as usize] = true;
            m.in_flight.push(kind.wr_id(slot));
        }
    }
}
