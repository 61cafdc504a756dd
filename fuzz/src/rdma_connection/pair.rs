//! Two honest `proto::Connection`s wired through a simulated RC queue pair.
//!
//! What the simulation allows is what verbs allows on one RC queue pair:
//! each side's work requests execute in posting order (a WRITE is placed
//! before the SEND posted after it is received); a SEND lands in the
//! receive posted longest ago (none posted: receiver-not-ready, which the
//! credits must prevent); a send queue's completions come in posting order,
//! each once its request executed, and a receive queue's in arrival order,
//! but the two queues are polled in any interleaving, at any time. The
//! bytes of a SEND or WRITE are read from the sender's memory when it
//! executes, not when it is posted, as a device does.

use std::collections::VecDeque;

use super::frame_len;
use arbitrary::Arbitrary;
use bytes::Bytes;
use transport_rdma::proto::{
    Completion, Config, Connection, Delivered, EncodeInto, FrameBytes, Header, ReadReceived,
    RendezvousConfig, SendDecision, Transmit, WorkKind, CTRL_SLOTS, HEADER_LEN, HEAP_SLOTS,
};

const SLOTS: u32 = 8;
/// Receive slots posted at first.
const INITIAL_SLOTS: u32 = 4;
const SLOT_SIZE: usize = 96;
const INLINE_MAX: usize = SLOT_SIZE - HEADER_LEN;
const REGION: usize = 256;
const MAX_FRAME: usize = 1000;
const PREFIX: usize = 20;
/// Frames are at most this long: inline, region, chunked and oversized
/// (never past the skip limit, which would fail the connection).
const MAX_LEN: usize = 1199;
const SEND_SLOTS: usize = (SLOTS + CTRL_SLOTS + HEAP_SLOTS) as usize;

/// One input: how many frames each application keeps forever, then events.
#[derive(Debug, Arbitrary)]
pub struct PairInput {
    /// Frames held in place that side `a`, `b` never releases (modulo 4:
    /// fewer than the half of the ring past which frames are copied).
    pub keep: [u8; 2],
    /// What happens, in order.
    pub ops: Vec<PairOp>,
}

/// One event; `b` says which side (`false`: a).
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum PairOp {
    /// The application queues a frame of [`frame_len`]`(len, 1199)` bytes.
    Send {
        /// The side.
        b: bool,
        /// Frame length, before [`frame_len`].
        len: u16,
    },
    /// The application hands its queued frames to the connection, and the
    /// side posts every work request the connection asks for.
    Pump {
        /// The side.
        b: bool,
    },
    /// The next `n % 4 + 1` work requests the side posted execute.
    Wire {
        /// The side that posted them.
        b: bool,
        /// How many, before the modulo.
        n: u8,
    },
    /// The side polls `n % 4 + 1` completions of its send queue.
    PollSend {
        /// The side.
        b: bool,
        /// How many, before the modulo.
        n: u8,
    },
    /// The side polls `n % 4 + 1` completions of its receive queue.
    PollRecv {
        /// The side.
        b: bool,
        /// How many, before the modulo.
        n: u8,
    },
    /// The application takes up to `n % 4 + 1` delivered frames.
    Deliver {
        /// The side.
        b: bool,
        /// How many, before the modulo.
        n: u8,
    },
    /// The application drops one frame it holds in place (any one but
    /// those it keeps forever).
    Release {
        /// The side.
        b: bool,
        /// Which one, modulo those it may drop.
        which: u8,
    },
    /// The application closes its side.
    Close {
        /// The side.
        b: bool,
    },
    /// The driver's tick: the side gives the peer's region back if it is
    /// idle (the peer deregisters it; the next region frame asks again).
    ReturnRegion {
        /// The side.
        b: bool,
    },
}

/// What the application got.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Got {
    Frame(Vec<u8>),
    Oversized { len: usize, prefix: Vec<u8> },
}

/// A posted SEND or WRITE, not yet executed.
#[derive(Debug)]
enum Wr {
    Write {
        offset: usize,
        len: usize,
        pos: u64,
    },
    Send {
        kind: WorkKind,
        slot: u32,
        header: Header,
        body_len: usize,
    },
}

/// One endpoint: the shipped `Connection`, and the memory, queue pair and
/// application around it, simulated.
struct Side {
    conn: Connection,
    /// The receive ring, and the receives posted in posting order.
    slots: Vec<Vec<u8>>,
    posted: VecDeque<u32>,
    /// Our region (the peer writes it); which bytes hold chunks the peer
    /// wrote and we have not reported freed; those writes (pos, offset, len).
    region: Vec<u8>,
    /// The region is registered (the peer asked for it), and how many
    /// times the peer returned it (and it was deregistered).
    region_registered: bool,
    regions_returned: usize,
    occupied: Vec<bool>,
    writes: VecDeque<(u64, usize, usize)>,
    /// Send slots and staging, as the application and the verbs layer
    /// write them; send slots with a SEND posted and not completed; staging
    /// bytes a posted WRITE has not read yet.
    send: Vec<Vec<u8>>,
    staging: Vec<u8>,
    sending: Vec<bool>,
    staged: Vec<bool>,
    /// Work requests posted, not yet executed (they go to the peer).
    wire: VecDeque<Wr>,
    /// Completions not yet polled: send queue (`wr_id`), receive queue
    /// (`wr_id`, bytes received, the header's bytes).
    sq: VecDeque<u64>,
    rq: VecDeque<(u64, usize, Vec<u8>)>,
    /// Frames queued by the application, not yet taken by the connection.
    app_queue: VecDeque<Vec<u8>>,
    /// Frames the connection took, in order: what the peer must get.
    sent: Vec<Got>,
    got: Vec<Got>,
    /// Frames held in place: slot and the bytes handed up.
    held: Vec<(u32, Vec<u8>)>,
    keep: usize,
    eof: bool,
}

impl Side {
    /// A side that keeps at most `send_slots` data frames in flight (a
    /// client sizes its send queue by its own ring, before it learns its
    /// peer's).
    fn new(keep: u8, send_slots: u32) -> Side {
        Side {
            conn: Connection::new(Config {
                ring_slots: SLOTS,
                // Half the ring at first: it grows once the peer keeps
                // half of that consumed.
                initial_ring_slots: INITIAL_SLOTS,
                slot_size: SLOT_SIZE,
                region_len: REGION as u64,
                peer_ring_slots: SLOTS,
                peer_initial_ring_slots: INITIAL_SLOTS,
                send_slots,
                peer_region_len: REGION as u64,
                inline_max: INLINE_MAX,
                max_frame_len: MAX_FRAME,
                max_skip_len: 4 * MAX_FRAME,
                prefix_len: PREFIX,
                // Off here (the crate's own simulation drives it).
                rendezvous: RendezvousConfig::OFF,
            }),
            slots: vec![vec![0; SLOT_SIZE]; SLOTS as usize],
            posted: (0..INITIAL_SLOTS).collect(),
            region: vec![0; REGION],
            region_registered: false,
            regions_returned: 0,
            occupied: vec![false; REGION],
            writes: VecDeque::new(),
            send: vec![vec![0; SLOT_SIZE]; SEND_SLOTS],
            staging: vec![0; REGION],
            sending: vec![false; SEND_SLOTS],
            staged: vec![false; REGION],
            wire: VecDeque::new(),
            sq: VecDeque::new(),
            rq: VecDeque::new(),
            app_queue: VecDeque::new(),
            sent: Vec::new(),
            got: Vec::new(),
            held: Vec::new(),
            keep: usize::from(keep % 4),
            eof: false,
        }
    }

    fn assert_ok(&self, name: &str) {
        assert_eq!(self.conn.failure(), None, "{name} failed");
    }
}

/// What the connection reads received bytes from: a side's ring and region.
struct Memory<'a> {
    slots: &'a [Vec<u8>],
    region: &'a [u8],
    occupied: &'a [bool],
}

impl ReadReceived for Memory<'_> {
    fn read_slot(&self, slot: u32, offset: usize, dst: &mut [u8]) {
        dst.copy_from_slice(&self.slots[slot as usize][offset..offset + dst.len()]);
    }
    fn read_region(&self, offset: usize, dst: &mut [u8]) {
        assert!(
            self.occupied[offset..offset + dst.len()].iter().all(|&o| o),
            "reading region bytes {offset}..{} nobody wrote",
            offset + dst.len()
        );
        dst.copy_from_slice(&self.region[offset..offset + dst.len()]);
    }
}

/// The frame numbered `i`, `len` bytes: no two frames alike.
fn frame(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (i.wrapping_mul(31) ^ k.wrapping_mul(7) ^ (k >> 8)) as u8)
        .collect()
}

/// What the peer must get for `frame`.
fn expected(frame: &[u8]) -> Got {
    if frame.len() > MAX_FRAME {
        Got::Oversized {
            len: frame.len(),
            prefix: frame[..PREFIX].to_vec(),
        }
    } else {
        Got::Frame(frame.to_vec())
    }
}

/// The application hands its queued frames to the connection, encoding
/// each where it says; a closed connection refuses them (dropped: not sent).
fn send_frames(me: &mut Side) -> usize {
    let mut moved = 0;
    while let Some(frame) = me.app_queue.front() {
        let r = match me.conn.handle_send(frame.len()) {
            SendDecision::Encode(r) => r,
            SendDecision::Wait => break,
            SendDecision::Refused(refusal) => {
                assert_eq!(refusal, transport_rdma::proto::Refusal::Closed);
                me.app_queue.clear();
                return moved + 1;
            }
        };
        let frame = me.app_queue.pop_front().expect("front");
        let heap = match me.conn.encode_into(&r) {
            EncodeInto::SendSlot { slot } => {
                let s = slot as usize;
                assert!(s < SLOTS as usize, "inline frame in send slot {slot}");
                assert!(!me.sending[s], "encoding into send slot {slot} in flight");
                me.send[s][HEADER_LEN..HEADER_LEN + frame.len()].copy_from_slice(&frame);
                None
            }
            EncodeInto::Staging { offset } => {
                let range = offset..offset + frame.len();
                assert!(
                    !me.staged[range.clone()].iter().any(|&s| s),
                    "encoding into staging {range:?} a WRITE has not read"
                );
                me.staging[range].copy_from_slice(&frame);
                None
            }
            // In two pieces, as a frame gathered around a payload is.
            EncodeInto::Heap => {
                let frame = Bytes::from(frame.clone());
                let half = frame.len() / 2;
                Some(FrameBytes::new(vec![
                    frame.slice(..half),
                    frame.slice(half..),
                ]))
            }
            EncodeInto::Rendezvous { .. } => unreachable!("the rendezvous is off"),
        };
        me.conn.queue_frame(r, heap).expect("queued");
        me.sent.push(expected(&frame));
        moved += 1;
    }
    moved
}

/// The side posts what its connection asks for.
fn pump(me: &mut Side) -> usize {
    let mut moved = send_frames(me);
    while let Some(t) = me.conn.poll_transmit() {
        moved += 1;
        match t {
            Transmit::Alloc { .. } | Transmit::Read { .. } | Transmit::Release { .. } => {
                panic!("rendezvous work with the rendezvous off: {t:?}")
            }
            Transmit::RegisterRing { .. } => me.conn.ring_registered(),
            Transmit::DeregisterRing { from } => {
                assert_eq!(
                    from,
                    me.conn.ring_slots_in_use(),
                    "shrunk to the slots in use"
                );
                assert!(
                    me.posted.iter().all(|&slot| slot < from),
                    "ring slots from {from} deregistered with a receive posted in them"
                );
            }
            Transmit::RegisterRegion => {
                assert!(!me.region_registered, "the region registered twice");
                me.region_registered = true;
                me.conn.region_registered(0, 0);
            }
            Transmit::DeregisterRegion => {
                assert!(me.region_registered, "a region deregistered twice");
                assert!(
                    !me.occupied.contains(&true),
                    "the region deregistered with a chunk in it"
                );
                me.region_registered = false;
                me.regions_returned += 1;
            }
            Transmit::Recv { slot } => {
                assert!(!me.posted.contains(&slot), "slot {slot} posted twice");
                assert!(
                    !me.held.iter().any(|&(s, _)| s == slot),
                    "slot {slot} posted while the application holds its frame"
                );
                me.posted.push_back(slot);
            }
            Transmit::Write {
                offset,
                len,
                pos,
                data,
            } => {
                let range = offset..offset + len;
                if let Some(data) = data {
                    assert!(
                        !me.staged[range.clone()].iter().any(|&s| s),
                        "copying into staging {range:?} a WRITE has not read"
                    );
                    data.copy_to(&mut me.staging[range.clone()]);
                }
                for s in &mut me.staged[range] {
                    *s = true;
                }
                me.wire.push_back(Wr::Write { offset, len, pos });
            }
            Transmit::Send {
                kind,
                slot,
                header,
                body_len,
            } => {
                let s = slot as usize;
                assert!(
                    !me.sending[s],
                    "send slot {slot} reused before its completion"
                );
                me.sending[s] = true;
                header.encode((&mut me.send[s][..HEADER_LEN]).try_into().expect("header"));
                // The peer's writes below what this reports freed may be
                // overwritten from now on.
                while let Some(&(pos, offset, len)) = me.writes.front() {
                    if pos + len as u64 > header.freed_to {
                        break;
                    }
                    for o in &mut me.occupied[offset..offset + len] {
                        *o = false;
                    }
                    me.writes.pop_front();
                }
                me.wire.push_back(Wr::Send {
                    kind,
                    slot,
                    header,
                    body_len,
                });
            }
        }
    }
    moved
}

/// The oldest work request `me` posted executes at `peer`.
fn execute(me: &mut Side, peer: &mut Side) -> bool {
    let Some(wr) = me.wire.pop_front() else {
        return false;
    };
    match wr {
        Wr::Write { offset, len, pos } => {
            assert!(
                peer.region_registered,
                "WRITE at {pos} into a region not registered"
            );
            for o in &mut peer.occupied[offset..offset + len] {
                assert!(
                    !*o,
                    "WRITE at {pos} into region space the peer has not freed"
                );
                *o = true;
            }
            peer.region[offset..offset + len].copy_from_slice(&me.staging[offset..offset + len]);
            for s in &mut me.staged[offset..offset + len] {
                *s = false;
            }
            peer.writes.push_back((pos, offset, len));
            // Unsignaled: no completion (the `Chunk` SEND after it has one).
        }
        Wr::Send {
            kind,
            slot,
            header,
            body_len,
        } => {
            let bytes = &me.send[slot as usize][..HEADER_LEN + body_len];
            assert_eq!(
                Header::decode(bytes, bytes.len()).ok(),
                Some(header),
                "send slot {slot} changed while its SEND was in flight"
            );
            let into = peer
                .posted
                .pop_front()
                .expect("a SEND with no receive posted: the receive ring overrun");
            peer.slots[into as usize][..bytes.len()].copy_from_slice(bytes);
            peer.rq.push_back((
                WorkKind::Recv.wr_id(into),
                bytes.len(),
                bytes[..HEADER_LEN].to_vec(),
            ));
            me.sq.push_back(kind.wr_id(slot));
        }
    }
    true
}

fn poll_send(me: &mut Side) -> bool {
    let Some(wr_id) = me.sq.pop_front() else {
        return false;
    };
    if let Some((WorkKind::Send | WorkKind::Control | WorkKind::Heap, slot)) =
        WorkKind::from_wr_id(wr_id)
    {
        me.sending[slot as usize] = false;
    }
    me.conn.handle_completion(Completion {
        wr_id,
        failure: None,
        byte_len: 0,
        header: &[],
        at: None,
    });
    true
}

fn poll_recv(me: &mut Side) -> bool {
    let Some((wr_id, byte_len, header)) = me.rq.pop_front() else {
        return false;
    };
    me.conn.handle_completion(Completion {
        wr_id,
        failure: None,
        byte_len,
        header: &header,
        at: None,
    });
    true
}

/// The application takes one delivered frame, if there is one.
fn deliver(me: &mut Side) -> bool {
    let memory = Memory {
        slots: &me.slots,
        region: &me.region,
        occupied: &me.occupied,
    };
    let Some(d) = me.conn.poll_delivery(&memory) else {
        return false;
    };
    if me.eof {
        // The end stays the end.
        assert_eq!(d, Delivered::Eof, "delivered after the end");
        return false;
    }
    match d {
        Delivered::InSlot { slot, len } => {
            let bytes = me.slots[slot as usize][HEADER_LEN..HEADER_LEN + len].to_vec();
            me.got.push(Got::Frame(bytes.clone()));
            me.held.push((slot, bytes));
        }
        Delivered::CopyOut { slot, len } => {
            let bytes = me.slots[slot as usize][HEADER_LEN..HEADER_LEN + len].to_vec();
            me.got.push(Got::Frame(bytes));
            me.conn.handle_copied(slot);
        }
        Delivered::Frame(f) => me.got.push(Got::Frame(f.to_vec())),
        Delivered::Oversized { len, prefix } => me.got.push(Got::Oversized { len, prefix }),
        Delivered::Eof => me.eof = true,
        other => panic!("{other:?} between honest peers"),
    }
    true
}

/// The application drops the `i`-th frame it may drop.
fn release(me: &mut Side, i: usize) -> bool {
    if me.held.len() <= me.keep {
        return false;
    }
    let i = me.keep + i % (me.held.len() - me.keep);
    let (slot, bytes) = me.held.remove(i);
    assert_eq!(
        me.slots[slot as usize][HEADER_LEN..HEADER_LEN + bytes.len()],
        bytes[..],
        "a frame held in slot {slot} was overwritten"
    );
    me.conn.handle_released(slot);
    true
}

/// Credit conservation each way, and: the receives posted cover every
/// credit held and every message on the way (no receive-ring overrun).
fn check_credits(a: &Side, b: &Side) {
    let sends = |s: &Side| {
        s.wire
            .iter()
            .filter(|w| matches!(w, Wr::Send { .. }))
            .count() as u32
    };
    let carried = |s: &Side| {
        s.wire
            .iter()
            .map(|w| match w {
                Wr::Send { header, .. } => u32::from(header.credits),
                Wr::Write { .. } => 0,
            })
            .sum::<u32>()
    };
    let unpolled = |s: &Side| s.rq.len() as u32;
    let ungranted = |s: &Side| {
        s.rq.iter()
            .map(|(_, n, h)| u32::from(Header::decode(h, *n).expect("header").credits))
            .sum::<u32>()
    };
    for (me, peer, name) in [(a, b, "a"), (b, a, "b")] {
        let credits = me.conn.credits_available();
        assert_eq!(
            credits
                + sends(me)
                + unpolled(peer)
                + peer.conn.ring_outstanding()
                + carried(peer)
                + ungranted(me)
                + peer.conn.ring_slots_unreported(),
            peer.conn.ring_slots_in_use(),
            "credits towards {name}'s peer not conserved"
        );
        assert!(
            peer.posted.len() as u32 >= credits + sends(me),
            "{name} holds {credits} credits, {} messages on the way, {} receives posted",
            sends(me),
            peer.posted.len()
        );
    }
}

/// Both sides do everything they can until nothing moves; the
/// application releases all but what it keeps forever.
fn drain(a: &mut Side, b: &mut Side) {
    for _ in 0..10_000 {
        // Completions and deliveries first, then what they let the
        // connections post: a round that moves nothing is the end (taking
        // chunks of a frame not yet whole delivers nothing, but frees what
        // the next pump reports).
        let mut moved = 0;
        for side in [&mut *a, &mut *b] {
            while poll_send(side) || poll_recv(side) || deliver(side) {
                moved += 1;
            }
            while side.held.len() > side.keep {
                release(side, 0);
                moved += 1;
            }
        }
        moved += pump(a) + pump(b);
        while execute(a, b) {
            moved += 1;
        }
        while execute(b, a) {
            moved += 1;
        }
        check_credits(a, b);
        a.assert_ok("a");
        b.assert_ok("b");
        if moved == 0 {
            return;
        }
    }
    panic!(
        "no quiescence after 10,000 rounds:\n a: {}\n b: {}",
        a.conn.summary(),
        b.conn.summary()
    );
}

/// What a run moved, to check a scenario is not vacuous.
#[derive(Debug, Default)]
pub struct Moved {
    /// Frames delivered (each way together).
    pub frames: usize,
    /// Of those, longer than a slot holds inline, and longer than a region chunk.
    pub region: usize,
    /// Longer than one region chunk.
    pub chunked: usize,
    /// Over the frame limit.
    pub oversized: usize,
    /// Regions returned by their writer and deregistered (each way together).
    pub regions_returned: usize,
}

/// Runs the checks on one input.
pub fn check(input: &PairInput) -> Moved {
    let mut a = Side::new(input.keep[0], SLOTS);
    let mut b = Side::new(input.keep[1], 3);
    let mut next = 0;
    for op in &input.ops {
        match *op {
            PairOp::Send { b: on_b, len } => {
                let f = frame(next, frame_len(len, MAX_LEN));
                next += 1;
                let me = if on_b { &mut b } else { &mut a };
                me.app_queue.push_back(f);
            }
            PairOp::Pump { b: on_b } => {
                pump(if on_b { &mut b } else { &mut a });
            }
            PairOp::Wire { b: on_b, n } => {
                for _ in 0..n % 4 + 1 {
                    if on_b {
                        execute(&mut b, &mut a);
                    } else {
                        execute(&mut a, &mut b);
                    }
                }
            }
            PairOp::PollSend { b: on_b, n } => {
                let me = if on_b { &mut b } else { &mut a };
                for _ in 0..n % 4 + 1 {
                    poll_send(me);
                }
            }
            PairOp::PollRecv { b: on_b, n } => {
                let me = if on_b { &mut b } else { &mut a };
                for _ in 0..n % 4 + 1 {
                    poll_recv(me);
                }
            }
            PairOp::Deliver { b: on_b, n } => {
                let me = if on_b { &mut b } else { &mut a };
                for _ in 0..n % 4 + 1 {
                    deliver(me);
                }
            }
            PairOp::Release { b: on_b, which } => {
                release(if on_b { &mut b } else { &mut a }, usize::from(which));
            }
            PairOp::Close { b: on_b } => (if on_b { &mut b } else { &mut a }).conn.close(),
            PairOp::ReturnRegion { b: on_b } => {
                // The driver's idle check: the region back, the ring shrunk.
                let me = if on_b { &mut b } else { &mut a };
                me.conn.return_idle_region();
                me.conn.shrink_idle_ring();
            }
        }
        a.assert_ok("a");
        b.assert_ok("b");
        check_credits(&a, &b);
    }
    // Both keep draining: everything completes.
    drain(&mut a, &mut b);
    for (me, name) in [(&a, "a"), (&b, "b")] {
        assert!(
            me.app_queue.is_empty() && me.conn.queued() == 0 && me.conn.in_flight() == 0,
            "{name} stuck:\n a: {}\n b: {}",
            a.conn.summary(),
            b.conn.summary()
        );
        assert_eq!(
            me.conn.region_in_use(),
            0,
            "{name}: region space not returned"
        );
    }
    for (me, peer, name) in [(&a, &b, "a"), (&b, &a, "b")] {
        assert_eq!(
            me.got.len(),
            peer.sent.len(),
            "{name}: frames lost or doubled"
        );
        for (i, (got, sent)) in me.got.iter().zip(&peer.sent).enumerate() {
            assert!(got == sent, "{name}: frame {i} differs (or out of order)");
        }
    }
    // An orderly close each way: both see the end.
    a.conn.close();
    b.conn.close();
    drain(&mut a, &mut b);
    for (me, name) in [(&a, "a"), (&b, "b")] {
        assert!(me.eof, "{name} did not see the end");
        assert!(me.conn.is_drained(), "{name}: {}", me.conn.summary());
    }
    let mut moved = Moved {
        regions_returned: a.regions_returned + b.regions_returned,
        ..Moved::default()
    };
    for got in a.got.iter().chain(&b.got) {
        moved.frames += 1;
        match got {
            Got::Frame(f) if f.len() > REGION / 2 => moved.chunked += 1,
            Got::Frame(f) if f.len() > INLINE_MAX => moved.region += 1,
            Got::Frame(_) => {}
            Got::Oversized { .. } => moved.oversized += 1,
        }
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size class goes both ways, with reads, releases and
    /// completions at odd times; everything arrives (so the checks above
    /// are not vacuous).
    #[test]
    fn every_route_both_ways() {
        let mut ops = Vec::new();
        for (i, len) in [0, 5, 64, 65, 100, 128, 129, 300, 999, 1000, 1001, 1199]
            .into_iter()
            .enumerate()
        {
            // The fuzzed value giving `len` (the last route: any length).
            let len = (len << 2 | 3) as u16;
            assert_eq!(frame_len(len, MAX_LEN), usize::from(len >> 2));
            let b = i % 3 == 0;
            ops.push(PairOp::Send { b, len });
            ops.push(PairOp::Pump { b });
            ops.push(PairOp::Wire { b, n: i as u8 });
            ops.push(PairOp::PollRecv { b: !b, n: 1 });
            ops.push(PairOp::Deliver { b: !b, n: 0 });
            ops.push(PairOp::PollSend { b, n: 3 });
            ops.push(PairOp::Pump { b: !b });
            ops.push(PairOp::Release { b: !b, which: 7 });
        }
        let moved = check(&PairInput { keep: [1, 2], ops });
        assert_eq!(moved.frames, 12, "{moved:?}");
        assert_eq!(moved.region, 3, "{moved:?}");
        assert_eq!(moved.chunked, 4, "{moved:?}");
        assert_eq!(moved.oversized, 2, "{moved:?}");
    }

    /// A writer gone idle gives the peer's region back, and asks for it
    /// again with its next region frame: twice each way.
    #[test]
    fn an_idle_writer_returns_the_region_and_asks_again() {
        // Everything both sides can do, a few times over: quiescent after.
        let settle = |ops: &mut Vec<PairOp>| {
            for _ in 0..8 {
                for b in [false, true] {
                    ops.push(PairOp::Pump { b });
                    ops.push(PairOp::Wire { b, n: 3 });
                    ops.push(PairOp::PollSend { b, n: 3 });
                    ops.push(PairOp::PollRecv { b, n: 3 });
                    ops.push(PairOp::Deliver { b, n: 3 });
                    ops.push(PairOp::Release { b, which: 0 });
                }
            }
        };
        let mut ops = Vec::new();
        for i in 0..4 {
            let b = i % 2 == 1;
            // A region frame (the last route: any length).
            ops.push(PairOp::Send {
                b,
                len: (100 << 2 | 3) as u16,
            });
            settle(&mut ops);
            ops.push(PairOp::ReturnRegion { b });
            settle(&mut ops);
        }
        let moved = check(&PairInput { keep: [0, 0], ops });
        assert_eq!((moved.frames, moved.region), (4, 4), "{moved:?}");
        assert_eq!(moved.regions_returned, 4, "{moved:?}");
    }
}
