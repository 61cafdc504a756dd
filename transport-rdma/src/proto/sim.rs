//! Two of the shipped [`Connection`]s driven against each other in memory,
//! with simulated registered memory and queue pairs, by a seeded PRNG:
//! random frame sizes around every threshold, random delivery and release
//! order, an application that keeps some frames forever. Checked at every
//! step: no send without a credit, no receive without a posted slot, no
//! region write into space not yet freed, credit conservation; at the end:
//! every frame delivered intact and in order, all region space returned,
//! and an orderly close seen at both ends.
//!
//! With the rendezvous on (every other seed), frames from a threshold up
//! are read by simulated RDMA READs out of the sender's segments into
//! destinations from a small pool (two frames' worth: back pressure),
//! a few READs at a time; checked too: every READ inside a segment still
//! registered and inside its destination, the pool never over its
//! budget, every segment released and every destination returned at the
//! end, and delivery order kept between frames of one call (a frame may
//! pass only frames of other calls).

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;

use super::*;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

const SLOTS: u32 = 16;
const SLOT_SIZE: usize = 96;
const INLINE_MAX: usize = SLOT_SIZE - HEADER_LEN;
const REGION: usize = 256;
const MAX_FRAME: usize = 1000;
const SEND_SLOTS: usize = (SLOTS + CTRL_SLOTS + HEAP_SLOTS) as usize;

/// A message on the wire: the bytes its SEND carried.
struct Msg {
    bytes: Vec<u8>,
}

impl Msg {
    fn header(&self) -> Header {
        Header::decode(&self.bytes, self.bytes.len()).expect("a valid header on the wire")
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Got {
    Frame(Vec<u8>),
    /// Its length and call ([`lane`]).
    Oversized(usize, Option<u64>),
}

impl Got {
    fn lane(&self) -> Option<u64> {
        match self {
            Got::Frame(f) => lane(f),
            Got::Oversized(_, lane) => *lane,
        }
    }
}

/// Checks `got` against `expect` (in sending order): the same frames, and
/// two frames of one call (or where either has none) in sending order.
fn check_order(got: &[Got], expect: &[Got], what: &str) {
    assert_eq!(got.len(), expect.len(), "{what}: frame count");
    let mut used = vec![false; expect.len()];
    let mut at = Vec::with_capacity(got.len());
    for g in got {
        let i = (0..expect.len())
            .find(|&i| !used[i] && expect[i] == *g)
            .unwrap_or_else(|| panic!("{what}: a frame that was not sent: {g:?}"));
        used[i] = true;
        at.push(i);
    }
    for (k, &i) in at.iter().enumerate() {
        for &j in &at[k + 1..] {
            if j < i {
                let (early, late) = (&expect[j], &expect[i]);
                assert!(
                    early.lane().is_some() && late.lane().is_some() && early.lane() != late.lane(),
                    "{what}: frame {j} delivered after frame {i} of the same call"
                );
            }
        }
    }
}

/// One endpoint: the shipped [`Connection`] and the memory and queue pair
/// it would have on a device, simulated.
struct Side {
    conn: Connection,
    /// Receive slots (the ring), and the ones posted, in posting order (an
    /// RC receive queue consumes them in that order).
    slots: Vec<Vec<u8>>,
    posted: VecDeque<u32>,
    /// Our region (the peer writes it), which bytes hold unread chunks, and
    /// the writes into it not yet freed (pos, offset, len).
    region: Vec<u8>,
    /// The region was registered (the peer asked for it): writable.
    region_registered: bool,
    /// The rest of the ring registers when the protocol asks (else the
    /// registration fails, and the ring stays at its first slots).
    ring_registers: bool,
    /// The ring's slots registered: `0..ring_registered`.
    ring_registered: u32,
    occupied: Vec<bool>,
    writes: VecDeque<(u64, usize, usize)>,
    /// Send slots and staging, as the sender encodes into them.
    send: Vec<Vec<u8>>,
    staging: Vec<u8>,
    /// Send slots whose SEND is posted and not completed, and completions
    /// the device has for us, not yet polled.
    sending: Vec<bool>,
    completions: VecDeque<(u64, usize, Vec<u8>)>,
    /// Frames queued by the application, not yet accepted by `handle_send`.
    app_queue: VecDeque<Vec<u8>>,
    held: Vec<u32>,
    kept_forever: usize,
    got: Vec<Got>,
    /// The peer's `Close` was delivered.
    eof: bool,
    /// Our rendezvous segments (registered, by rkey), the rkeys of each
    /// of our transfers, and the destinations of the peer's transfers.
    segments: HashMap<u32, Vec<u8>>,
    transfers: HashMap<u64, Vec<u32>>,
    destinations: HashMap<u64, Vec<u8>>,
    /// Rendezvous frames the application holds (their lengths).
    pooled_held: Vec<usize>,
    /// A chunked frame placed and still being encoded (the verbs layer
    /// encodes it without the connection's lock), queued by the second
    /// `send_frames` after: the connection is pumped, and anything else
    /// may happen to it, meanwhile. Every other chunked frame waits so.
    encoding: Option<(Reservation, FrameBytes, bool)>,
    chunked_frames: u64,
}

const POOL: u64 = 2 * POOL_GRANULE;

impl Side {
    fn new() -> Side {
        Side::with(None, SLOTS, SLOTS)
    }

    /// A side whose ring posts `initial` slots at first, the peer's
    /// `peer_initial`.
    fn with(threshold: Option<usize>, initial: u32, peer_initial: u32) -> Side {
        Side {
            conn: Connection::new(Config {
                ring_slots: SLOTS,
                initial_ring_slots: initial,
                slot_size: SLOT_SIZE,
                region_len: REGION as u64,
                peer_ring_slots: SLOTS,
                peer_initial_ring_slots: peer_initial,
                send_slots: SLOTS,
                peer_region_len: REGION as u64,
                inline_max: INLINE_MAX,
                max_frame_len: MAX_FRAME,
                max_skip_len: 4 * MAX_FRAME,
                prefix_len: 20,
                rendezvous: match threshold {
                    None => RendezvousConfig::OFF,
                    Some(t) => RendezvousConfig {
                        threshold: Some(t),
                        pool_bytes: POOL,
                        read_chunk: 50,
                        read_depth: 3,
                        max_outgoing: 3,
                        announce_room: SLOT_SIZE - HEADER_LEN,
                    },
                },
            }),
            slots: vec![vec![0; SLOT_SIZE]; SLOTS as usize],
            posted: (0..initial).collect(),
            region: vec![0; REGION],
            region_registered: false,
            ring_registers: true,
            ring_registered: initial,
            occupied: vec![false; REGION],
            writes: VecDeque::new(),
            send: vec![vec![0; SLOT_SIZE]; SEND_SLOTS],
            staging: vec![0; REGION],
            sending: vec![false; SEND_SLOTS],
            completions: VecDeque::new(),
            app_queue: VecDeque::new(),
            held: Vec::new(),
            kept_forever: 0,
            got: Vec::new(),
            eof: false,
            segments: HashMap::new(),
            transfers: HashMap::new(),
            destinations: HashMap::new(),
            pooled_held: Vec::new(),
            encoding: None,
            chunked_frames: 0,
        }
    }
}

/// The simulated device's reads for `poll_delivery`.
struct SimMemory<'a> {
    slots: &'a [Vec<u8>],
    /// The region, while registered.
    region: Option<&'a [u8]>,
}

impl ReadReceived for SimMemory<'_> {
    fn read_slot(&self, slot: u32, offset: usize, dst: &mut [u8]) {
        dst.copy_from_slice(&self.slots[slot as usize][offset..offset + dst.len()]);
    }
    fn read_region(&self, offset: usize, dst: &mut [u8]) {
        let region = self
            .region
            .expect("a chunk read from a region not registered");
        dst.copy_from_slice(&region[offset..offset + dst.len()]);
    }
}

/// The application hands `me` the frames it queued, encoding each where
/// the connection says; returns how many were accepted.
fn send_frames(me: &mut Side) -> usize {
    let mut accepted = 0;
    match me.encoding.take() {
        Some((reservation, heap, false)) => {
            me.encoding = Some((reservation, heap, true));
            return 0;
        }
        Some((reservation, heap, true)) => {
            me.conn
                .queue_frame(reservation, Some(heap))
                .expect("queued");
            accepted += 1;
        }
        None => {}
    }
    while let Some(frame) = me.app_queue.front() {
        let r = match me.conn.handle_send(frame.len()) {
            SendDecision::Encode(r) => r,
            SendDecision::Wait => break,
            SendDecision::Refused(refusal) => panic!("refused: {refusal:?}"),
        };
        let frame = me.app_queue.pop_front().expect("front");
        let mut reservation = r;
        let frame_lane = frame[..frame.len().min(12)].to_vec();
        let heap = match me.conn.encode_into(&r) {
            EncodeInto::SendSlot { slot } => {
                assert!(
                    !me.sending[slot as usize],
                    "encoding into a send slot in flight"
                );
                me.send[slot as usize][HEADER_LEN..HEADER_LEN + frame.len()]
                    .copy_from_slice(&frame);
                None
            }
            EncodeInto::Staging { offset } => {
                me.staging[offset..offset + frame.len()].copy_from_slice(&frame);
                None
            }
            // In three pieces, as a frame gathered around a payload is.
            EncodeInto::Heap => {
                let frame = Bytes::from(frame);
                let (a, b) = (frame.len() / 3, frame.len() * 2 / 3);
                let heap =
                    FrameBytes::new(vec![frame.slice(..a), frame.slice(a..b), frame.slice(b..)]);
                me.chunked_frames += 1;
                if me.chunked_frames % 2 == 0 {
                    let reservation = reservation.in_lane(lane(&frame_lane));
                    me.encoding = Some((reservation, heap, false));
                    return accepted;
                }
                Some(heap)
            }
            EncodeInto::Rendezvous { slot, transfer } => {
                assert!(
                    !me.sending[slot as usize],
                    "announcing from a slot in flight"
                );
                // A head in the announcement (the prefix, or 8 more bytes
                // every third frame), the rest in one segment, or in two
                // (each its own registration) every other frame, as a
                // payload registered in place is.
                let head = if transfer % 3 == 0 {
                    ANNOUNCE_PREFIX_LEN + 8
                } else {
                    ANNOUNCE_PREFIX_LEN
                };
                let rest = frame.len() - head;
                let mut cut = vec![head, frame.len()];
                if transfer % 2 == 1
                    && rest >= 2
                    && announce_body_len(2, head) <= me.conn.announce_room()
                {
                    cut.insert(1, head + rest / 3);
                }
                let mut segments = Vec::new();
                let mut rkeys = Vec::new();
                for (i, piece) in cut.windows(2).enumerate() {
                    let rkey = (transfer * 8 + i as u64) as u32;
                    segments.push(Segment {
                        addr: 0,
                        rkey,
                        len: (piece[1] - piece[0]) as u32,
                    });
                    let bytes = frame[piece[0]..piece[1]].to_vec();
                    assert!(me.segments.insert(rkey, bytes).is_none(), "rkey reused");
                    rkeys.push(rkey);
                }
                let prefix = frame[..ANNOUNCE_PREFIX_LEN].try_into().expect("prefix");
                let ann = Announcement::new(head, prefix, &segments);
                let body = &mut me.send[slot as usize][HEADER_LEN..];
                ann.encode(body);
                let at = ann.head_offset();
                body[at..at + head].copy_from_slice(&frame[..head]);
                assert!(me.transfers.insert(transfer, rkeys).is_none(), "id reused");
                reservation = r.announcing(ann.encoded_len());
                None
            }
        };
        // rpc-core's frames: each of the call its bytes 4..12 name.
        me.conn
            .queue_frame(reservation.in_lane(lane(&frame_lane)), heap)
            .expect("queued");
        accepted += 1;
    }
    accepted
}

/// Carries out what `me` decided to post towards `peer`; returns how many
/// work requests.
fn pump(me: &mut Side, peer: &mut Side, wire: &mut VecDeque<Msg>) -> usize {
    send_frames(me);
    let mut posted = 0;
    // An unsignaled WRITE was posted: the next send-queue request must be
    // a signaled SEND (it completes after it and reclaims its entry).
    let mut after_write = false;
    while let Some(t) = me.conn.poll_transmit() {
        posted += 1;
        if after_write && !matches!(t, Transmit::Recv { .. }) {
            assert!(
                matches!(t, Transmit::Send { .. }),
                "an unsignaled WRITE followed by {t:?}, not a SEND"
            );
            after_write = false;
        }
        match t {
            Transmit::Recv { slot } => {
                assert!(!me.posted.contains(&slot), "slot {slot} posted twice");
                assert!(
                    slot < me.ring_registered,
                    "slot {slot} posted, not registered"
                );
                me.posted.push_back(slot);
            }
            Transmit::Write {
                offset,
                len,
                pos,
                data,
            } => {
                assert!(
                    peer.region_registered && me.conn.peer_region().is_some(),
                    "a WRITE into a region the peer has not granted"
                );
                if let Some(data) = data {
                    data.copy_to(&mut me.staging[offset..offset + len]);
                }
                // The RDMA WRITE: lands in the peer's region before the SEND.
                for o in &mut peer.occupied[offset..offset + len] {
                    assert!(!*o, "region write into space not freed");
                    *o = true;
                }
                peer.region[offset..offset + len]
                    .copy_from_slice(&me.staging[offset..offset + len]);
                peer.writes.push_back((pos, offset, len));
                // Unsignaled: no completion.
                after_write = true;
            }
            Transmit::Alloc {
                transfer,
                len,
                slot,
                head_at,
                head_len,
            } => {
                // The head, from the announcement still in its slot.
                let mut destination = vec![0; len];
                destination[..head_len]
                    .copy_from_slice(&me.slots[slot as usize][head_at..head_at + head_len]);
                assert!(
                    me.destinations.insert(transfer, destination).is_none(),
                    "a second destination for transfer {transfer}"
                );
                assert!(me.conn.pool_in_use() <= POOL, "pool over budget");
            }
            Transmit::Read {
                transfer,
                offset,
                len,
                addr,
                rkey,
                seq,
            } => {
                let segment = peer
                    .segments
                    .get(&rkey)
                    .expect("READ of a segment not registered");
                let from = addr as usize;
                let dest = me
                    .destinations
                    .get_mut(&transfer)
                    .expect("READ into no destination");
                dest[offset..offset + len].copy_from_slice(&segment[from..from + len]);
                me.completions
                    .push_back((WorkKind::Read.wr_id(seq), 0, Vec::new()));
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
                // What a read of it now would see.
                me.region.fill(0xEE);
                REGIONS_RETURNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Transmit::RegisterRing { from, to } => {
                assert_eq!(
                    from,
                    me.conn.ring_slots_in_use(),
                    "growth from the slots in use"
                );
                assert!(from < to && to <= SLOTS, "growth to {to} of {SLOTS} slots");
                if me.ring_registers {
                    RINGS_GROWN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    me.ring_registered = to;
                    me.conn.ring_registered();
                } else {
                    me.conn.ring_not_registered();
                }
            }
            Transmit::DeregisterRing { from } => {
                assert_eq!(
                    from,
                    me.conn.ring_slots_in_use(),
                    "shrunk to the slots in use"
                );
                assert!(from < me.ring_registered, "nothing to deregister");
                let unpolled =
                    me.completions
                        .iter()
                        .filter_map(|c| match WorkKind::from_wr_id(c.0) {
                            Some((WorkKind::Recv, slot)) => Some(slot),
                            _ => None,
                        });
                for slot in me.posted.iter().chain(&me.held).copied().chain(unpolled) {
                    assert!(slot < from, "slot {slot} deregistered while in use");
                }
                me.ring_registered = from;
                // What a read of them now would see.
                for slot in &mut me.slots[from as usize..] {
                    slot.fill(0xEE);
                }
                RINGS_SHRUNK.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Transmit::Release { transfer } => {
                let rkeys = me
                    .transfers
                    .remove(&transfer)
                    .expect("release of a transfer not registered");
                for rkey in rkeys {
                    assert!(
                        me.segments.remove(&rkey).is_some(),
                        "segment not registered"
                    );
                }
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
                let bytes = me.send[s][..HEADER_LEN + body_len].to_vec();
                // What the header reports freed in our region: the peer's
                // writes below it may be overwritten from now on.
                while let Some(&(pos, off, len)) = me.writes.front() {
                    if pos + len as u64 > header.freed_to {
                        break;
                    }
                    for o in &mut me.occupied[off..off + len] {
                        *o = false;
                    }
                    me.writes.pop_front();
                }
                wire.push_back(Msg { bytes });
                me.completions.push_back((kind.wr_id(slot), 0, Vec::new()));
            }
        }
    }
    assert!(
        !after_write,
        "an unsignaled WRITE posted with no SEND after it"
    );
    posted
}

/// `me`'s device takes the next message off the wire into a posted slot.
fn arrive(me: &mut Side, msg: Msg) {
    let slot = me
        .posted
        .pop_front()
        .expect("message arrived with no receive posted (RNR)");
    let _ = msg.header();
    let n = msg.bytes.len();
    me.slots[slot as usize][..n].copy_from_slice(&msg.bytes);
    me.completions.push_back((
        WorkKind::Recv.wr_id(slot),
        n,
        msg.bytes[..PEEK_LEN.min(n)].to_vec(),
    ));
}

/// `me` polls its completions and hands up what arrived.
fn poll(me: &mut Side) -> usize {
    let mut n = 0;
    while let Some((wr_id, byte_len, header)) = me.completions.pop_front() {
        if let Some((WorkKind::Send | WorkKind::Control | WorkKind::Heap, slot)) =
            WorkKind::from_wr_id(wr_id)
        {
            me.sending[slot as usize] = false;
        }
        me.conn.handle_completion(Completion {
            wr_id,
            failure: None,
            byte_len,
            header: &header,
            at: None,
        });
        n += 1;
    }
    let mem = SimMemory {
        slots: &me.slots,
        region: me.region_registered.then_some(&me.region[..]),
    };
    while let Some(d) = me.conn.poll_delivery(&mem) {
        if d == Delivered::Eof {
            // The end stays delivered: count it once.
            n += usize::from(!me.eof);
            me.eof = true;
            break;
        }
        n += 1;
        match d {
            Delivered::InSlot { slot, len } => {
                me.got.push(Got::Frame(
                    me.slots[slot as usize][HEADER_LEN..HEADER_LEN + len].to_vec(),
                ));
                me.held.push(slot);
            }
            Delivered::CopyOut { slot, len } => {
                me.got.push(Got::Frame(
                    me.slots[slot as usize][HEADER_LEN..HEADER_LEN + len].to_vec(),
                ));
                me.conn.handle_copied(slot);
            }
            Delivered::Frame(f) => me.got.push(Got::Frame(f.to_vec())),
            Delivered::Pooled { transfer, len } => {
                let dest = me
                    .destinations
                    .remove(&transfer)
                    .expect("delivered with no destination");
                me.got.push(Got::Frame(dest[..len].to_vec()));
                me.pooled_held.push(len);
            }
            Delivered::Oversized { len, prefix } => me.got.push(Got::Oversized(len, lane(&prefix))),
            other => panic!("unexpected delivery {other:?}"),
        }
    }
    assert_eq!(me.conn.failure(), None, "the connection failed");
    n
}

/// The application drops one held frame (not one it keeps forever).
fn release_one(me: &mut Side, rng: &mut XorShift) -> bool {
    if let Some(len) = me.pooled_held.pop() {
        me.conn.handle_pool_released(len);
        return true;
    }
    let keep = me.kept_forever;
    if me.held.len() > keep {
        let i = keep + rng.below((me.held.len() - keep) as u64) as usize;
        let slot = me.held.remove(i);
        me.conn.handle_released(slot);
        true
    } else {
        false
    }
}

fn frame(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| (i * 31 + k * 7) as u8).collect()
}

fn pick_len(rng: &mut XorShift) -> usize {
    let thresholds = [0, INLINE_MAX, REGION / 2, REGION, MAX_FRAME, 2 * REGION];
    if rng.below(2) == 0 {
        let t = thresholds[rng.below(thresholds.len() as u64) as usize];
        (t + rng.below(3) as usize).saturating_sub(1)
    } else {
        rng.below(3 * REGION as u64 + 100) as usize
    }
}

/// Credit conservation (credits returned travel on the other direction's
/// wire; new slots of a grown ring count once reported), and: posted
/// slots cover every credit and message in flight.
fn check(a: &Side, b: &Side, to_b: &VecDeque<Msg>, to_a: &VecDeque<Msg>) {
    // What lets a connection deregister its staging: no chunk holds any
    // of it. The peer's region holding one of our chunks means its bytes
    // came from our staging and are not yet freed.
    for (me, peer) in [(a, b), (b, a)] {
        assert!(
            me.conn.region_in_use() > 0 || !peer.occupied.contains(&true),
            "region space counted free while the peer's region holds a chunk: {}",
            me.conn.summary()
        );
    }
    let carried = |w: &VecDeque<Msg>| w.iter().map(|m| u32::from(m.header().credits)).sum::<u32>();
    // Receives completed but not yet polled hold a slot, and the credits
    // they carry are not granted yet.
    let recvs = |s: &Side| {
        s.completions
            .iter()
            .filter(|c| matches!(WorkKind::from_wr_id(c.0), Some((WorkKind::Recv, _))))
            .map(|c| Header::decode(&c.2, c.1).expect("header"))
            .collect::<Vec<_>>()
    };
    let unpolled = |s: &Side| recvs(s).len() as u32;
    let ungranted = |s: &Side| recvs(s).iter().map(|h| u32::from(h.credits)).sum::<u32>();
    assert_eq!(
        a.conn.credits_available()
            + to_b.len() as u32
            + unpolled(b)
            + b.conn.ring_outstanding()
            + carried(to_a)
            + ungranted(a)
            + b.conn.ring_slots_unreported(),
        b.conn.ring_slots_in_use()
    );
    assert_eq!(
        b.conn.credits_available()
            + to_a.len() as u32
            + unpolled(a)
            + a.conn.ring_outstanding()
            + carried(to_b)
            + ungranted(b)
            + a.conn.ring_slots_unreported(),
        a.conn.ring_slots_in_use()
    );
    assert!(b.posted.len() as u32 >= a.conn.credits_available() + to_b.len() as u32);
    assert!(a.posted.len() as u32 >= b.conn.credits_available() + to_a.len() as u32);
}

fn run(seed: u64, steps: usize) {
    let mut rng = XorShift(seed | 1);
    let rendezvous = match rng.below(3) {
        0 => None,
        1 => Some(INLINE_MAX + 1),
        _ => Some(REGION / 2 + 10),
    };
    // Rings that start with a few of their slots (and double them, or fail
    // to) or with all of them.
    let initial_a = [4, 5, SLOTS][rng.below(3) as usize];
    let initial_b = [4, 5, SLOTS][rng.below(3) as usize];
    let mut a = Side::with(rendezvous, initial_a, initial_b);
    let mut b = Side::with(rendezvous, initial_b, initial_a);
    a.ring_registers = rng.below(4) != 0;
    b.ring_registers = rng.below(4) != 0;
    // Messages on the wire towards b and towards a.
    let mut to_b: VecDeque<Msg> = VecDeque::new();
    let mut to_a: VecDeque<Msg> = VecDeque::new();
    let mut expect_b = Vec::new();
    let mut expect_a = Vec::new();
    let mut next = 0;
    b.kept_forever = rng.below(4) as usize;
    for _ in 0..steps {
        match rng.below(12) {
            0 | 1 => {
                let len = pick_len(&mut rng);
                let f = frame(next, len);
                next += 1;
                let want = if len > MAX_FRAME {
                    Got::Oversized(len, lane(&f))
                } else {
                    Got::Frame(f.clone())
                };
                if rng.below(3) == 0 {
                    b.app_queue.push_back(f);
                    expect_a.push(want);
                } else {
                    a.app_queue.push_back(f);
                    expect_b.push(want);
                }
            }
            2 => {
                pump(&mut a, &mut b, &mut to_b);
            }
            3 => {
                pump(&mut b, &mut a, &mut to_a);
            }
            4 | 5 => {
                if let Some(m) = to_b.pop_front() {
                    arrive(&mut b, m);
                }
            }
            6 | 7 => {
                if let Some(m) = to_a.pop_front() {
                    arrive(&mut a, m);
                }
            }
            8 => {
                poll(&mut a);
                // Now and then, a side that finds itself idle gives the
                // peer's region back and shrinks its ring (the driver's
                // tick).
                if rng.below(8) == 0 {
                    a.conn.return_idle_region();
                }
                if rng.below(3) == 0 {
                    a.conn.shrink_idle_ring();
                }
            }
            9 => {
                poll(&mut b);
                if rng.below(8) == 0 {
                    b.conn.return_idle_region();
                }
                if rng.below(3) == 0 {
                    b.conn.shrink_idle_ring();
                }
            }
            _ => {
                release_one(&mut a, &mut rng);
                release_one(&mut b, &mut rng);
            }
        }
        check(&a, &b, &to_b, &to_a);
    }
    // Drain: the application releases what it does not keep forever; the
    // peers pump until nothing moves.
    for _ in 0..100_000 {
        let mut moved = pump(&mut a, &mut b, &mut to_b) + pump(&mut b, &mut a, &mut to_a);
        while let Some(m) = to_b.pop_front() {
            arrive(&mut b, m);
            moved += 1;
        }
        while let Some(m) = to_a.pop_front() {
            arrive(&mut a, m);
            moved += 1;
        }
        moved += poll(&mut a) + poll(&mut b);
        for side in [&mut a, &mut b] {
            while let Some(len) = side.pooled_held.pop() {
                side.conn.handle_pool_released(len);
                moved += 1;
            }
            while side.held.len() > side.kept_forever {
                let slot = side.held.pop().expect("held");
                side.conn.handle_released(slot);
                moved += 1;
            }
        }
        check(&a, &b, &to_b, &to_a);
        if moved == 0 {
            break;
        }
    }
    RENDEZVOUS_READS.fetch_add(
        a.conn.reads_completed() + b.conn.reads_completed(),
        std::sync::atomic::Ordering::Relaxed,
    );
    for (side, initial, name) in [(&a, initial_a, "a"), (&b, initial_b, "b")] {
        assert!(
            side.app_queue.is_empty() && side.conn.queued() == 0,
            "seed {seed}: {name} stalled: {}",
            side.conn.summary()
        );
        // A shrink ends once every slot to retire came back: all but
        // those of frames the application keeps.
        assert!(
            side.conn.ring_retiring() == 0 || side.held.iter().any(|&s| s >= initial),
            "seed {seed}: {name}'s ring did not finish shrinking: {}",
            side.conn.summary()
        );
    }
    for (side, expect, name) in [(&a, expect_a, "a"), (&b, expect_b, "b")] {
        check_order(&side.got, &expect, &format!("seed {seed}: {name}"));
        if rendezvous.is_none() && side.got != expect {
            PASSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        assert!(
            side.segments.is_empty()
                && side.destinations.is_empty()
                && side.conn.pool_in_use() == 0
                && side.conn.transfers_out() == 0
                && side.conn.transfers_in() == 0,
            "seed {seed}: {name}: rendezvous memory not returned: {}",
            side.conn.summary()
        );
        assert_eq!(
            side.conn.region_in_use(),
            0,
            "seed {seed}: region space not returned"
        );
    }
    // An orderly close each way: each side sees the end of the stream.
    a.conn.close();
    b.conn.close();
    for _ in 0..100 {
        pump(&mut a, &mut b, &mut to_b);
        pump(&mut b, &mut a, &mut to_a);
        while let Some(m) = to_b.pop_front() {
            arrive(&mut b, m);
        }
        while let Some(m) = to_a.pop_front() {
            arrive(&mut a, m);
        }
        for side in [&mut a, &mut b] {
            while let Some((wr_id, byte_len, header)) = side.completions.pop_front() {
                // A credit may still go after a close: its send slot is
                // free again once completed.
                if let Some((WorkKind::Send | WorkKind::Control | WorkKind::Heap, slot)) =
                    WorkKind::from_wr_id(wr_id)
                {
                    side.sending[slot as usize] = false;
                }
                side.conn.handle_completion(Completion {
                    wr_id,
                    failure: None,
                    byte_len,
                    header: &header,
                    at: None,
                });
            }
        }
    }
    for (side, name) in [(&mut a, "a"), (&mut b, "b")] {
        let mem = SimMemory {
            slots: &side.slots,
            region: side.region_registered.then_some(&side.region[..]),
        };
        assert_eq!(
            side.conn.poll_delivery(&mem),
            Some(Delivered::Eof),
            "seed {seed}: {name} did not see the end"
        );
        assert!(
            side.conn.is_drained(),
            "seed {seed}: {name}: {}",
            side.conn.summary()
        );
    }
}

static RENDEZVOUS_READS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Regions given back by their writer (and deregistered by their owner).
static REGIONS_RETURNED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Rings that shrank back to their first slots (and deregistered the
/// others).
static RINGS_SHRUNK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Rings that grew while traffic ran.
static RINGS_GROWN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Runs without the rendezvous where a frame was delivered before one
/// sent earlier (a small frame passing a chunked one).
static PASSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[test]
fn randomized_two_endpoints() {
    for seed in 1..=300u64 {
        run(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), 2000);
    }
    // The rendezvous runs were not vacuous, rings grew, and small frames
    // passed chunked ones in the others.
    assert!(RENDEZVOUS_READS.load(std::sync::atomic::Ordering::Relaxed) > 1000);
    assert!(RINGS_GROWN.load(std::sync::atomic::Ordering::Relaxed) > 50);
    eprintln!(
        "rings grown {}, shrunk {}",
        RINGS_GROWN.load(std::sync::atomic::Ordering::Relaxed),
        RINGS_SHRUNK.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(RINGS_SHRUNK.load(std::sync::atomic::Ordering::Relaxed) > 50);
    assert!(PASSED.load(std::sync::atomic::Ordering::Relaxed) > 10);
    // Regions were given back and asked for again.
    assert!(REGIONS_RETURNED.load(std::sync::atomic::Ordering::Relaxed) > 100);
}

/// Small frames of other calls queued behind a chunked frame go between
/// its chunks and arrive before it; a small frame of its own call waits
/// for it.
#[test]
fn small_frames_of_other_calls_pass_a_chunked_one() {
    let mut a = Side::new();
    let mut b = Side::new();
    let (mut to_b, mut to_a) = (VecDeque::new(), VecDeque::new());
    // `frame(i, _)`'s call (bytes 4..12) follows from `i`.
    let large = frame(1, 3 * REGION);
    let others: Vec<_> = (2..6).map(|i| frame(i, INLINE_MAX)).collect();
    let same_call = frame(1, INLINE_MAX);
    a.app_queue.push_back(large.clone());
    a.app_queue.extend(others.iter().cloned());
    a.app_queue.push_back(same_call.clone());
    settle(&mut a, &mut b, &mut to_b, &mut to_a);
    let at = |f: &Vec<u8>| {
        b.got
            .iter()
            .position(|g| *g == Got::Frame(f.clone()))
            .expect("every frame delivered")
    };
    for other in &others {
        assert!(at(other) < at(&large), "{:?}", b.got.len());
    }
    assert!(
        at(&same_call) > at(&large),
        "a frame passed one of its own call"
    );
}

#[test]
fn one_way_bulk_with_stingy_app() {
    let mut a = Side::new();
    let mut b = Side::new();
    b.kept_forever = (SLOTS / 2) as usize;
    let mut to_b = VecDeque::new();
    let mut to_a = VecDeque::new();
    let frames: Vec<_> = (0..500)
        .map(|i| frame(i, (i * 37) % (3 * REGION)))
        .collect();
    a.app_queue.extend(frames.iter().cloned());
    for _ in 0..100_000 {
        let mut moved = pump(&mut a, &mut b, &mut to_b) + pump(&mut b, &mut a, &mut to_a);
        while let Some(m) = to_b.pop_front() {
            arrive(&mut b, m);
            moved += 1;
        }
        while let Some(m) = to_a.pop_front() {
            arrive(&mut a, m);
            moved += 1;
        }
        moved += poll(&mut a) + poll(&mut b);
        if moved == 0 {
            break;
        }
    }
    assert!(
        a.app_queue.is_empty() && a.conn.queued() == 0,
        "the sender stalled: {}",
        a.conn.summary()
    );
    let want: Vec<_> = frames.into_iter().map(Got::Frame).collect();
    check_order(&b.got, &want, "one way");
}

/// Pumps both ways until nothing moves; the application releases every
/// frame it holds.
fn settle(a: &mut Side, b: &mut Side, to_b: &mut VecDeque<Msg>, to_a: &mut VecDeque<Msg>) {
    for _ in 0..100_000 {
        let mut moved = pump(a, b, to_b) + pump(b, a, to_a);
        while let Some(m) = to_b.pop_front() {
            arrive(b, m);
            moved += 1;
        }
        while let Some(m) = to_a.pop_front() {
            arrive(a, m);
            moved += 1;
        }
        moved += poll(a) + poll(b);
        for side in [&mut *a, &mut *b] {
            while let Some(slot) = side.held.pop() {
                side.conn.handle_released(slot);
                moved += 1;
            }
        }
        check(a, b, to_b, to_a);
        if moved == 0 {
            return;
        }
    }
    panic!("still moving after 100,000 rounds");
}

/// A ring grown by many frames in flight shrinks back to its first slots
/// once its peer is quiet, though no frame comes: the peer's `Credit`
/// messages consume every receive posted, and the ring grows again when
/// traffic needs it.
#[test]
fn an_idle_ring_shrinks_back_to_its_first_slots_and_grows_again() {
    let mut a = Side::with(None, 4, 4);
    let mut b = Side::with(None, 4, 4);
    let (mut to_b, mut to_a) = (VecDeque::new(), VecDeque::new());
    let burst = |b: &mut Side, from: usize| {
        let frames: Vec<_> = (from..from + 60).map(|i| frame(i, INLINE_MAX)).collect();
        b.app_queue.extend(frames.iter().cloned());
        frames.into_iter().map(Got::Frame).collect::<Vec<_>>()
    };
    let mut want = burst(&mut b, 0);
    settle(&mut a, &mut b, &mut to_b, &mut to_a);
    let grown = a.conn.ring_slots_in_use();
    assert!(
        grown > 4 && a.ring_registered == grown,
        "a's ring did not grow: {grown}"
    );
    // The first idle check sees the burst's peak; the next one a quiet peer.
    assert!(
        !a.conn.shrink_idle_ring(),
        "shrunk with the burst just past"
    );
    assert!(a.conn.shrink_idle_ring());
    assert!(
        !a.conn.shrink_idle_ring(),
        "a second shrink while shrinking"
    );
    let shrunk = RINGS_SHRUNK.load(std::sync::atomic::Ordering::Relaxed);
    settle(&mut a, &mut b, &mut to_b, &mut to_a);
    assert_eq!(
        (
            a.conn.ring_slots_in_use(),
            a.ring_registered,
            a.conn.ring_retiring()
        ),
        (4, 4, 0),
        "a's ring did not shrink back: {}",
        a.conn.summary()
    );
    assert!(RINGS_SHRUNK.load(std::sync::atomic::Ordering::Relaxed) > shrunk);
    assert_eq!(
        b.conn.credits_available(),
        4,
        "b's window is a's first slots"
    );
    // Traffic grows it again, into the same slots.
    want.extend(burst(&mut b, 60));
    settle(&mut a, &mut b, &mut to_b, &mut to_a);
    assert_eq!(a.conn.ring_slots_in_use(), grown);
    assert_eq!(a.ring_registered, grown);
    check_order(&a.got, &want, "a");
    assert!(b.app_queue.is_empty() && b.conn.queued() == 0);
}

#[test]
fn a_half_closed_connection_carries_the_other_direction_to_the_end() {
    let mut a = Side::new();
    let mut b = Side::new();
    let (mut to_b, mut to_a) = (VecDeque::new(), VecDeque::new());
    // `a` closes its side first, with nothing queued: `b` reads the end.
    a.conn.close();
    settle(&mut a, &mut b, &mut to_b, &mut to_a);
    assert!(b.eof, "b did not see a's close");
    assert!(!a.eof);
    assert!(matches!(
        a.conn.handle_send(8),
        SendDecision::Refused(Refusal::Closed)
    ));
    // `b` still sends, frames of every route, more than the ring and the
    // region hold at once: `a` (closed) keeps returning credits and space.
    let frames: Vec<_> = (0..300)
        .map(|i| frame(i, (i * 37) % (3 * REGION)))
        .collect();
    b.app_queue.extend(frames.iter().cloned());
    settle(&mut a, &mut b, &mut to_b, &mut to_a);
    assert!(
        b.app_queue.is_empty() && b.conn.queued() == 0,
        "b stalled: {}",
        b.conn.summary()
    );
    let want: Vec<_> = frames.into_iter().map(Got::Frame).collect();
    check_order(&a.got, &want, "b to a");
    assert!(!a.eof);
    // Then `b` closes: both ends have seen the end and are drained.
    b.conn.close();
    settle(&mut a, &mut b, &mut to_b, &mut to_a);
    assert!(a.eof, "a did not see b's close");
    for side in [&a, &b] {
        assert!(side.conn.is_drained(), "{}", side.conn.summary());
        assert_eq!(side.conn.region_in_use(), 0);
    }
}
