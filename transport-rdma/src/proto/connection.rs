//! One RDMA connection's protocol as a state machine with no I/O: what to
//! post, what to hand up, and when the connection is over.
//!
//! The verbs layer (the crate's `conn` module) owns the queue pair and the
//! registered memory. It feeds this type what happened — work completions
//! ([`handle_completion`](Connection::handle_completion)), the application's
//! sends ([`handle_send`](Connection::handle_send) /
//! [`queue_frame`](Connection::queue_frame)) and released frames
//! ([`handle_released`](Connection::handle_released)), [`close`](Connection::close),
//! the connection manager's disconnect
//! ([`handle_disconnected`](Connection::handle_disconnected)) — and carries
//! out what it decides: the work requests of
//! [`poll_transmit`](Connection::poll_transmit) and the frames of
//! [`poll_delivery`](Connection::poll_delivery). It never reads registered
//! memory: the verbs layer copies a received message's header out of its
//! slot and passes it in, and reads received bytes for it through
//! [`ReadReceived`].
//!
//! Send slots are numbered `0..send_slots` for data messages (one per
//! slot of the peer's ring, or fewer: see [`Config::send_slots`]), then
//! [`CTRL_SLOTS`] for control messages, then [`HEAP_SLOTS`] for the chunks
//! of heap-encoded frames.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::free_slots::FreeSlots;
use super::rendezvous::{InState, Incoming, OutTransfer};
use super::{
    lane, pool_charge, route, Announcement, Assembled, CreditWindow, Delivery, FrameBytes, Header,
    Kind, OwnPool, PoolRoom, ProtocolError, Reassembly, RecvRing, RegionReader, RegionWriter,
    RendezvousConfig, Route, ANNOUNCE_PREFIX_LEN, FIRST, HEADER_LEN, LAST,
};

/// Send slots reserved for control messages (credits, close).
pub const CTRL_SLOTS: u32 = 4;
/// Send slots reserved for the chunks of a heap-encoded frame (frames queued
/// behind it may hold every data slot).
pub const HEAP_SLOTS: u32 = 4;
/// Region frames (a WRITE and a SEND each, where an inline frame is one
/// SEND) in flight at once: the send queue needs a second entry for this
/// many data slots, not for all of them. 16 frames of at least a slot
/// (8 KiB by default) each are more than a link's round trip carries
/// (100 Gb/s × 5 µs is 62 KiB).
pub const REGION_FRAMES: u32 = 16;
/// Largest chunk of a heap-encoded (chunked) frame. Frames of other calls
/// pass a chunked frame between its chunks, but not a chunk already posted:
/// at most [`HEAP_SLOTS`] chunks are in flight, so a small frame queued
/// behind a tensor waits for at most `HEAP_SLOTS * HEAP_CHUNK_MAX` bytes in
/// the send queue (on Soft-RoCE the kernel transmits a posted chunk inside
/// `ibv_post_send`, so this also bounds how long one post takes), and for
/// one chunk while small frames keep passing ([`INTERLEAVED_CHUNKS`]).
/// 64 KiB chunks still fill a link: perftest's bandwidth tests saturate at
/// 64 KiB messages.
const HEAP_CHUNK_MAX: usize = 64 << 10;
/// Once a frame passed a chunked frame, chunks go one at a time (one in
/// flight, not [`HEAP_SLOTS`]) until this many full chunks' worth of bytes
/// (1 MiB) went with none passing: while small calls run beside a tensor,
/// each waits behind at most one chunk in the send queue, the first of
/// them behind at most `HEAP_SLOTS`. The one chunk carries [`PACED_WAIT`]'s
/// worth of the link's rate. Counted in bytes, not chunks, so that small
/// paced chunks do not end the pacing sooner: when the full depth comes
/// back, a small frame waits behind all of it. On Soft-RoCE (16 MiB
/// tensors beside 32 B calls, `hol-bench`) the small calls' p50 fell from
/// 8.5–8.8 to 2.6–2.7 ms with one 64 KiB chunk, and to 1.0 ms with paced
/// ones (the A/Bs in docs/benchmarks.md); a tensor alone keeps all four.
const INTERLEAVED_CHUNKS: u32 = 16;
/// The same for a rendezvous's READs: once a small frame arrived from the
/// peer while we read one of its transfers, our READs go one in flight
/// (not [`RendezvousConfig::read_depth`]) until this many full READs' worth
/// of bytes went with none arriving. The peer's small frames share its
/// link with the READs' responses, which its device sends for all the
/// READs posted.
const INTERLEAVED_READS: u32 = 16;

/// How long a small frame may wait behind the one paced request (a chunk,
/// a READ) in flight ahead of it: while small frames pass, a paced request
/// carries what the link moves in this time ([`LinkRate`]), between
/// [`PACED_MIN`] and the full size. At 5 Gb/s and up that is the full 64
/// KiB; on Soft-RoCE (~55 MB/s) [`PACED_MIN`].
const PACED_WAIT: Duration = Duration::from_micros(100);
/// The smallest paced request: below it a request's own costs (for a chunk
/// a WRITE, a SEND, a credit and a slot of the peer's ring) would take more
/// of the link than the bytes. 16 KiB chunks met issue 10's p99 target on
/// Soft-RoCE for 28 % of the tensor's throughput while small calls ran
/// (the trial in docs/benchmarks.md).
const PACED_MIN: usize = 16 << 10;
/// Bytes a rate measurement spans.
const RATE_WINDOW: u64 = 512 << 10;

/// How fast the link moves one kind of request (chunks, READs): each
/// request's bytes over the time from when the link had it (its post, or
/// the completion before it if that came later) to its completion. A
/// request posted or polled late makes the link look slower, never faster:
/// the paced requests come out smaller.
#[derive(Debug, Default)]
struct LinkRate {
    /// The last completion.
    last: Option<Instant>,
    /// Bytes completed and time taken since the last measurement.
    window_bytes: u64,
    window_time: Duration,
    /// The last measurement, in bytes per second.
    bytes_per_sec: Option<u64>,
}

impl LinkRate {
    /// A request of `len` bytes posted at `posted` completed `at`.
    fn completed(&mut self, len: usize, posted: Instant, at: Instant) {
        let start = self.last.map_or(posted, |last| last.max(posted));
        self.last = Some(at);
        self.window_bytes += len as u64;
        self.window_time += at.saturating_duration_since(start);
        let nanos = self.window_time.as_nanos();
        if self.window_bytes >= RATE_WINDOW && nanos > 0 {
            let rate = u128::from(self.window_bytes) * 1_000_000_000 / nanos;
            self.bytes_per_sec = Some(u64::try_from(rate).unwrap_or(u64::MAX));
            self.window_bytes = 0;
            self.window_time = Duration::ZERO;
        }
    }

    /// Bytes the link moves in `wait`, once measured.
    fn bytes_in(&self, wait: Duration) -> Option<usize> {
        let bytes = u128::from(self.bytes_per_sec?) * wait.as_nanos() / 1_000_000_000;
        Some(usize::try_from(bytes).unwrap_or(usize::MAX))
    }
}

/// How many requests of one kind (chunks, READs) go in flight at once, and
/// how large: the full depth and size, or one of [`PACED_WAIT`]'s worth of
/// bytes for a while after small frames went beside them
/// ([`INTERLEAVED_CHUNKS`], [`INTERLEAVED_READS`]).
#[derive(Debug, Default)]
struct Pace {
    /// Bytes still to go one request at a time.
    single_bytes: usize,
    /// The requests in flight, oldest first (one send queue completes them
    /// in posting order): length and, once the verbs layer said, when they
    /// were posted.
    in_flight: VecDeque<(usize, Option<Instant>)>,
    rate: LinkRate,
}

impl Pace {
    /// Small frames went beside: the next `n` full requests' worth of
    /// bytes (of `full` each) go one request at a time.
    fn interleave(&mut self, n: u32, full: usize) {
        self.single_bytes = n as usize * full;
    }

    /// Whether another request may go now, with `full` the depth.
    fn has_room(&self, full: usize) -> bool {
        let depth = if self.single_bytes > 0 { 1 } else { full };
        self.in_flight.len() < depth
    }

    /// The length of the next request, with `full` the largest.
    fn len(&self, full: usize) -> usize {
        match self.rate.bytes_in(PACED_WAIT) {
            Some(paced) if self.single_bytes > 0 => paced.max(PACED_MIN).min(full),
            _ => full,
        }
    }

    /// A request of `len` bytes went.
    fn posted(&mut self, len: usize) {
        self.single_bytes = self.single_bytes.saturating_sub(len);
        self.in_flight.push_back((len, None));
    }

    /// The requests not yet stamped were posted `at`.
    fn stamp(&mut self, at: Instant) {
        for (_, posted) in self.in_flight.iter_mut().rev() {
            if posted.is_some() {
                break;
            }
            *posted = Some(at);
        }
    }

    /// The oldest request in flight completed, `at` then if the verbs
    /// layer tells (it does for [`WorkKind::is_paced`] kinds).
    fn completed(&mut self, at: Option<Instant>) {
        if let (Some((len, Some(posted))), Some(at)) = (self.in_flight.pop_front(), at) {
            self.rate.completed(len, posted, at);
        }
    }
}

/// What a work request was for (its kind is encoded in its `wr_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkKind {
    /// A receive into ring slot `index`.
    Recv,
    /// A data message's SEND from send slot `index`.
    Send,
    /// A control message's SEND from send slot `index`.
    Control,
    /// An RDMA WRITE into the peer's region.
    Write,
    /// A heap frame chunk's SEND from send slot `index`.
    Heap,
    /// An RDMA READ of a rendezvous transfer; `index` is the READ's
    /// sequence number (the low 32 bits), checked on completion.
    Read,
    /// A memory window bound over one of our transfer's segments, posted
    /// by the verbs layer ahead of the announcement, **unsignaled** (index
    /// 0): the announcement's SEND completes after it, so its completion
    /// comes only if it failed.
    Bind,
}

impl WorkKind {
    /// The `wr_id` of a request of this kind on slot `index`.
    pub fn wr_id(self, index: u32) -> u64 {
        let tag: u64 = match self {
            WorkKind::Recv => 1,
            WorkKind::Send => 2,
            WorkKind::Control => 3,
            WorkKind::Write => 4,
            WorkKind::Heap => 5,
            WorkKind::Read => 6,
            WorkKind::Bind => 7,
        };
        (tag << 32) | u64::from(index)
    }

    /// Whether the protocol paces requests of this kind by the link's rate
    /// (it wants [`Completion::at`] for them).
    pub fn is_paced(self) -> bool {
        matches!(self, WorkKind::Heap | WorkKind::Read)
    }

    /// The kind and index a `wr_id` of [`wr_id`](Self::wr_id) encodes.
    pub fn from_wr_id(wr_id: u64) -> Option<(WorkKind, u32)> {
        let kind = match wr_id >> 32 {
            1 => WorkKind::Recv,
            2 => WorkKind::Send,
            3 => WorkKind::Control,
            4 => WorkKind::Write,
            5 => WorkKind::Heap,
            6 => WorkKind::Read,
            7 => WorkKind::Bind,
            _ => return None,
        };
        Some((kind, wr_id as u32))
    }
}

/// A work completion, as the verbs layer reports it.
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// `None` for success, else the failure (status name and number).
    pub failure: Option<&'a str>,
    /// Bytes received (receives only).
    pub byte_len: usize,
    /// For a receive: the message's first bytes (up to
    /// [`PEEK_LEN`](super::PEEK_LEN): the header, and an announcement's
    /// body), copied out of the slot by the verbs layer.
    pub header: &'a [u8],
    /// When it was polled, for [`WorkKind::is_paced`] kinds (`None`: no
    /// rate measured from it).
    pub at: Option<Instant>,
}

/// A work request to post, in order.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transmit {
    /// Post a receive into ring slot `slot` (`WorkKind::Recv`).
    Recv {
        /// The ring slot.
        slot: u32,
    },
    /// Copy `data` (if any) into the staging region at `offset`, then RDMA
    /// WRITE `staging[offset..offset + len]` to the peer's region at the same
    /// offset (`WorkKind::Write`, index 0), **unsignaled**: the `Chunk`
    /// SEND that always comes next completes after it, so its own
    /// completion would say nothing (a completion comes only if it fails).
    Write {
        /// Offset in staging and in the peer's region.
        offset: usize,
        /// Bytes to write.
        len: usize,
        /// The region stream position (`offset` is `pos % region_len`).
        pos: u64,
        /// A chunked frame's chunk to copy in first; `None` when the frame
        /// was encoded in place.
        data: Option<FrameBytes>,
    },
    /// Write `header` at the start of send slot `slot`, then SEND the
    /// header and the `body_len` bytes after it.
    Send {
        /// `Send`, `Control` or `Heap`.
        kind: WorkKind,
        /// The send slot.
        slot: u32,
        /// The header, credits and region report stamped.
        header: Header,
        /// Bytes of frame after the header in the slot.
        body_len: usize,
    },
    /// Take a destination of `len` bytes from the pool for the peer's
    /// transfer `transfer` (registered for local write only): its READs
    /// follow.
    Alloc {
        /// The peer's transfer id.
        transfer: u64,
        /// The frame's length.
        len: usize,
        /// The receive slot holding the announcement: its bytes
        /// `head_at..head_at + head_len` are the frame's first bytes, to
        /// copy to the destination's start (the READs fill the rest).
        slot: u32,
        /// Where the frame's head starts in the slot.
        head_at: usize,
        /// The head's length.
        head_len: usize,
    },
    /// RDMA READ `len` bytes at `addr` (rkey `rkey`) of the peer's memory
    /// into transfer `transfer`'s destination at `offset`
    /// (`WorkKind::Read`, index `seq`).
    Read {
        /// The peer's transfer id.
        transfer: u64,
        /// Offset in the destination (and in the frame).
        offset: usize,
        /// Bytes to read.
        len: usize,
        /// The peer's address of those bytes (announced address + offset).
        addr: u64,
        /// The announced rkey.
        rkey: u32,
        /// The READ's sequence number (its `wr_id` index).
        seq: u32,
    },
    /// Our transfer `transfer` was read by the peer (or given up on):
    /// deregister and free its memory.
    Release {
        /// Our transfer id.
        transfer: u64,
    },
    /// The peer asked for our region (its first frame too large for a
    /// slot): register it, remotely writable, and report it with
    /// [`Connection::region_registered`]; the grant goes then.
    RegisterRegion,
    /// The peer returned our region (`RegionReturned`: it went idle, every
    /// chunk it wrote was consumed): deregister it. A later
    /// [`RegisterRegion`](Self::RegisterRegion) registers a new one.
    DeregisterRegion,
    /// The peer keeps half our ring's slots in use consumed: register
    /// slots `from..to` (as many again as are in use, up to the whole ring)
    /// and report it with [`Connection::ring_registered`] (their receives
    /// are posted then, and go to the peer as credits), or
    /// [`Connection::ring_not_registered`] (the ring stays as it is).
    RegisterRing {
        /// The first new slot: the slots in use so far.
        from: u32,
        /// The ring's slots in use once registered.
        to: u32,
    },
    /// The ring shrank back to its first slots: deregister slots `from..`
    /// (no receive is posted in them, no frame refers to them). A later
    /// [`RegisterRing`](Self::RegisterRing) registers them again.
    DeregisterRing {
        /// The first slot let go: the slots the ring keeps.
        from: u32,
    },
}

impl Transmit {
    /// Whether it is a request of a [`WorkKind::is_paced`] kind (the
    /// protocol wants to know when it was posted:
    /// [`handle_posted`](Connection::handle_posted)).
    pub fn is_paced(&self) -> bool {
        match self {
            Transmit::Send { kind, .. } => kind.is_paced(),
            Transmit::Read { .. } => true,
            _ => false,
        }
    }
}

/// The `Done` that tells the peer we read its transfer.
fn done_header(transfer: u64) -> Header {
    let mut h = Header::new(Kind::Done);
    h.pos = transfer;
    h
}

/// Our receive ring, as it grows with the peer's traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RingGrowth {
    /// Slots are left to take into use.
    Growable,
    /// More are being registered ([`Transmit::RegisterRing`]).
    Registering,
    /// Every slot is in use, or a registration failed (the ring stays as
    /// it is, and is not registered again).
    Done,
}

/// The peer's region, as its writer (we) knows it. It exists only once
/// asked for: a connection whose frames all fit a slot never has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerRegion {
    /// No frame needed it yet.
    Unasked,
    /// A frame needs it: `RegionWanted` goes with the next control slot.
    ToAsk,
    /// `RegionWanted` went; frames for it wait for the grant.
    Asked,
    /// Granted: the address remote requests name its start by, its rkey.
    Granted { addr: u64, rkey: u32 },
    /// Granted and idle: `RegionReturned` goes with the next control slot,
    /// unless a frame needs the region before then (it stays granted).
    Returning { addr: u64, rkey: u32 },
}

/// Our region, as the peer asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnRegion {
    /// Not asked for: not registered, nothing of ours is remotely writable.
    Unasked,
    /// Asked for: being registered ([`Transmit::RegisterRegion`]).
    Registering,
    /// Registered: `RegionGranted` goes with the next control slot.
    ToGrant { addr: u64, rkey: u32 },
    /// Granted: the peer may write it.
    Granted,
}

/// Where [`handle_send`](Connection::handle_send) lets a frame be encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncodeInto {
    /// Send slot `slot`, after the header.
    SendSlot {
        /// The send slot.
        slot: u32,
    },
    /// The staging region at `offset` (the frame's region allocation).
    Staging {
        /// Offset in staging.
        offset: usize,
    },
    /// Bytes of the caller's own (the frame is chunked): gather or encode
    /// it without holding what guards this connection, then
    /// [`queue_frame`](Connection::queue_frame) it with them.
    Heap,
    /// A rendezvous: register memory for this transfer (remote read
    /// access), encode the frame into it without holding what guards this
    /// connection, write its [`Announcement`] into send slot `slot` after
    /// the header, then [`queue_frame`](Connection::queue_frame) it (no
    /// bytes). The memory stays registered until [`Transmit::Release`]
    /// for `transfer` (or the connection failed).
    Rendezvous {
        /// The send slot of the announcement.
        slot: u32,
        /// Our transfer id.
        transfer: u64,
    },
}

/// A frame's place, reserved by [`handle_send`](Connection::handle_send):
/// either [`queue_frame`](Connection::queue_frame)d once encoded, or given
/// back with [`cancel_send`](Connection::cancel_send).
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    len: u32,
    place: Place,
    /// The frame's call ([`lane`]), if the sender says it has one: an
    /// inline frame with a call passes a chunked frame of another call
    /// still being sent.
    lane: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Inline {
        slot: u32,
    },
    Region {
        slot: u32,
        pos: u64,
        head_before: u64,
    },
    Heap,
    Rendezvous {
        slot: u32,
        transfer: u64,
        /// Length of its announcement's body.
        body_len: u32,
    },
}

impl Reservation {
    /// The reservation of a frame of call `lane` (rpc-core's call id,
    /// [`lane`] of its first bytes; `None` for bytes of no call, such as a
    /// byte stream's, which never pass anything).
    pub fn in_lane(self, lane: Option<u64>) -> Reservation {
        Reservation { lane, ..self }
    }

    /// The reservation of a rendezvous frame whose announcement's body
    /// is `body_len` bytes long (at most
    /// [`announce_room`](Connection::announce_room): `queue_frame` panics
    /// otherwise; panics if the frame does not go by rendezvous).
    pub fn announcing(self, body_len: usize) -> Reservation {
        let Place::Rendezvous { slot, transfer, .. } = self.place else {
            panic!("an announcement of a frame not sent by rendezvous: {self:?}");
        };
        Reservation {
            place: Place::Rendezvous {
                slot,
                transfer,
                body_len: u32::try_from(body_len).expect("an announcement fits a slot"),
            },
            ..self
        }
    }

    fn encode_into(&self, writer_offset: impl Fn(u64) -> usize) -> EncodeInto {
        match self.place {
            Place::Inline { slot } => EncodeInto::SendSlot { slot },
            Place::Region { pos, .. } => EncodeInto::Staging {
                offset: writer_offset(pos),
            },
            Place::Heap => EncodeInto::Heap,
            Place::Rendezvous { slot, transfer, .. } => EncodeInto::Rendezvous { slot, transfer },
        }
    }

    /// The frame's length.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True for an empty frame (never: every frame has a head).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Why a frame cannot be sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The connection failed.
    Failed(String),
    /// It was closed (by us or by the peer).
    Closed,
    /// Longer than the wire format's 32-bit lengths.
    TooLong(usize),
}

/// What [`handle_send`](Connection::handle_send) decided.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendDecision {
    /// Encode the frame there, then queue or cancel the reservation.
    Encode(Reservation),
    /// No room now: wait until a wake-up for senders, then try again.
    Wait,
    /// It will never go.
    Refused(Refusal),
}

/// The next thing for the receiving application.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivered {
    /// A frame of `len` bytes after the header in ring slot `slot`, to hand
    /// up in place; [`handle_released`](Connection::handle_released) once
    /// the application dropped it.
    InSlot {
        /// The ring slot.
        slot: u32,
        /// Frame length.
        len: usize,
    },
    /// A frame of `len` bytes after the header in ring slot `slot`, to copy
    /// out now; then [`handle_copied`](Connection::handle_copied).
    CopyOut {
        /// The ring slot.
        slot: u32,
        /// Frame length.
        len: usize,
    },
    /// A frame put back together from region chunks.
    Frame(Bytes),
    /// A rendezvous frame of `len` bytes, read into transfer `transfer`'s
    /// destination: hand it up in place;
    /// [`handle_pool_released`](Connection::handle_pool_released) once the
    /// application dropped it.
    Pooled {
        /// The peer's transfer id.
        transfer: u64,
        /// Frame length.
        len: usize,
    },
    /// A frame over the frame limit, skipped; the connection goes on.
    Oversized {
        /// Its length.
        len: usize,
        /// Its first bytes.
        prefix: Vec<u8>,
    },
    /// A frame too long even to skip; the connection failed.
    TooLarge {
        /// Its length.
        len: usize,
    },
    /// The peer closed its side in order: no more frames.
    Eof,
    /// The connection failed; every later call says so too.
    Failed(String),
}

/// Reads received bytes for [`poll_delivery`](Connection::poll_delivery):
/// the verbs layer's raw copies out of its registered memory.
pub trait ReadReceived {
    /// Copies `dst.len()` bytes of ring slot `slot` from byte `offset` (of
    /// the message, header included) into `dst`.
    fn read_slot(&self, slot: u32, offset: usize, dst: &mut [u8]);
    /// Copies `dst.len()` bytes of the region at `offset` into `dst`.
    fn read_region(&self, offset: usize, dst: &mut [u8]);
}

/// Whom to wake after a call (see [`take_wakeups`](Connection::take_wakeups)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Wakeups {
    /// Senders waiting for room (or to see a failure or a close).
    pub senders: bool,
    /// The receiver (a frame, the end, or a failure to see).
    pub receiver: bool,
}

/// How far our own close went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnClose {
    /// Not asked for.
    No,
    /// Asked for: `Close` goes once everything queued before it went.
    Requested,
    /// Our `Close` was posted.
    Sent,
}

/// A connection's lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lifecycle {
    /// Both sides open.
    Open,
    /// The peer is open; our side is closing or closed (we still receive).
    Closing(OwnClose),
    /// The peer sent `Close` (what came before it is still delivered);
    /// `OwnClose` is our side, which may still send until it closes.
    PeerClosed(OwnClose),
    /// The peer closed in order, then the connection went down: what
    /// arrived is still delivered, nothing more is sent.
    Disconnected,
    /// Failed (a protocol violation, a failed work request, a device event,
    /// an unexpected disconnect): the reason.
    Failed(String),
}

/// The geometry and limits of one connection.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Our receive ring's slots.
    pub ring_slots: u32,
    /// Of those, posted at first (4..=`ring_slots`; doubled each time the
    /// peer's traffic fills half of them).
    pub initial_ring_slots: u32,
    /// Our receive slots' size.
    pub slot_size: usize,
    /// Our region's length.
    pub region_len: u64,
    /// The peer's ring slots.
    pub peer_ring_slots: u32,
    /// Of those, posted at first: our first credits.
    pub peer_initial_ring_slots: u32,
    /// Our data send slots (1..=`peer_ring_slots`): the most data messages
    /// in flight, whatever credits the peer grants. Fewer than the peer's
    /// ring when our send queue was sized before we learned it (a client
    /// sizes for its own ring).
    pub send_slots: u32,
    /// The peer's region's length.
    pub peer_region_len: u64,
    /// Largest frame sent inline (at most the peer's slot minus the header).
    pub inline_max: usize,
    /// Largest frame delivered.
    pub max_frame_len: usize,
    /// Largest frame skipped (longer ones fail the connection).
    pub max_skip_len: usize,
    /// Bytes of an oversized frame reported with it.
    pub prefix_len: usize,
    /// The rendezvous of large frames.
    pub rendezvous: RendezvousConfig,
}

/// The call ([`lane`]) of the inline frame of `len` bytes received in
/// `slot`; `None` for a frame too short to name one.
fn inline_lane(mem: &impl ReadReceived, slot: u32, len: u32) -> Option<u64> {
    let mut call = [0; 12];
    if (len as usize) < call.len() {
        return None;
    }
    mem.read_slot(slot, HEADER_LEN, &mut call);
    lane(&call)
}

/// One queued outgoing message.
#[derive(Debug)]
enum Out {
    /// Frame encoded in a send slot after the header space; of call
    /// `lane`, if it has one.
    Inline {
        slot: u32,
        len: u32,
        lane: Option<u64>,
    },
    /// Frame encoded in the staging region at `pos`; `slot` carries the header.
    Region { slot: u32, pos: u64, len: u32 },
    /// Frame larger than a chunk, in the caller's bytes; sent chunk by
    /// chunk. Inline frames of other calls pass it between chunks.
    Heap {
        data: FrameBytes,
        done: usize,
        lane: Option<u64>,
    },
    /// A rendezvous frame; `slot` holds its announcement, of `body_len`
    /// bytes after the header.
    Rendezvous {
        slot: u32,
        transfer: u64,
        len: u32,
        body_len: u32,
    },
}

/// A received message not yet handed to the application.
#[derive(Debug)]
enum Arrived {
    Inline {
        slot: u32,
        len: u32,
    },
    Chunk {
        slot: u32,
        header: Header,
        offset: usize,
    },
    /// An announcement, held in `slot` until its frame is delivered.
    Rendezvous {
        slot: u32,
        transfer: u64,
    },
    Eof,
}

/// One connection's protocol state (see the module docs).
#[derive(Debug)]
pub struct Connection {
    // sending
    credits: CreditWindow,
    writer: RegionWriter,
    queue: VecDeque<Out>,
    free_send: FreeSlots,
    free_ctrl: Vec<u32>,
    free_heap: Vec<u32>,
    /// Chunks of chunked frames in flight at once ([`INTERLEAVED_CHUNKS`]).
    chunk_pace: Pace,
    heap_queued: bool,
    inline_max: usize,
    /// Signaled send-queue requests posted and not completed.
    in_flight: u32,
    /// Send slots for data messages (the peer's ring slots, or fewer);
    /// control and heap slots follow.
    data_slots: u32,
    /// Which data slots hold a region frame, reserved or in flight: at
    /// most [`REGION_FRAMES`].
    region_frame_in: Vec<bool>,
    region_frames: u32,
    /// The peer's region is written up to here (stream position): it may
    /// not report space beyond it freed.
    region_sent_to: u64,
    peer_region: PeerRegion,
    /// Which receive slots (first `ring_slots`) and send slots (the rest)
    /// have a work request posted and not completed: a completion for one
    /// that has none is a broken verbs layer, not something to act on.
    posted: Vec<bool>,
    // receiving
    ring_slots: u32,
    slot_size: usize,
    ring: RecvRing,
    ring_growth: RingGrowth,
    own_region: OwnRegion,
    reader: RegionReader,
    reassembly: Reassembly,
    /// The call ([`lane`]) of the chunked frame being reassembled: inline
    /// frames of other calls may arrive between its chunks.
    chunked_lane: Option<u64>,
    prefix_len: usize,
    arrived: VecDeque<Arrived>,
    /// A control message is wanted even with nothing to report (a
    /// keepalive: see [`probe`](Self::probe)).
    probe: bool,
    // rendezvous
    rdv: RendezvousConfig,
    /// Our transfers not yet `Done`, by id.
    outgoing: BTreeMap<u64, OutTransfer>,
    next_transfer: u64,
    /// The peer's transfers not yet delivered, in arrival order.
    incoming: VecDeque<Incoming>,
    /// Pool bytes charged to this connection's destinations (reading, or
    /// delivered and not yet released).
    pool_in_use: u64,
    /// Where they are charged.
    pool: Box<dyn PoolRoom>,
    /// READs posted and not completed, in posting order: (seq, transfer, len).
    reads: VecDeque<(u32, u64, usize)>,
    /// READs in flight at once ([`INTERLEAVED_READS`]).
    read_pace: Pace,
    read_seq: u32,
    reads_completed: u64,
    /// Control messages to send, each from a control slot with a data
    /// credit, each header as many times as its count: `Done`s, our
    /// `RingShrinks`, and the `Credit` messages a peer's `RingShrinks`
    /// asked for (one entry, at most the peer's ring in all).
    control_out: VecDeque<(Header, u32)>,
    // both
    lifecycle: Lifecycle,
    transmit: VecDeque<Transmit>,
    /// No input since the last [`pump`](Self::pump): another would queue
    /// nothing, so [`poll_transmit`](Self::poll_transmit) skips it (a
    /// side flushes after every lock, most often with nothing new). Every
    /// public `&mut self` method but `poll_transmit` and `take_wakeups`
    /// clears it before it changes anything; debug builds check that a
    /// skipped pump had nothing to do.
    settled: bool,
    wake: Wakeups,
}

impl Connection {
    /// A connection whose ring's first slots are posted (the verbs layer
    /// posted them before connecting) and whose peer's are all free.
    pub fn new(cfg: Config) -> Connection {
        debug_assert!((1..=cfg.peer_ring_slots).contains(&cfg.send_slots));
        let send = cfg.send_slots;
        // Any frame the limit admits fits the pool on its own.
        let pool_bytes = if cfg.rendezvous.pool_bytes == 0 {
            0
        } else {
            cfg.rendezvous
                .pool_bytes
                .max(pool_charge(cfg.max_frame_len))
        };
        Connection {
            credits: CreditWindow::new(cfg.peer_initial_ring_slots, cfg.peer_ring_slots),
            writer: RegionWriter::new(cfg.peer_region_len),
            queue: VecDeque::new(),
            free_send: FreeSlots::all(send),
            free_ctrl: (send..send + CTRL_SLOTS).collect(),
            free_heap: (send + CTRL_SLOTS..send + CTRL_SLOTS + HEAP_SLOTS).collect(),
            chunk_pace: Pace::default(),
            heap_queued: false,
            inline_max: cfg.inline_max,
            in_flight: 0,
            data_slots: send,
            region_frame_in: vec![false; send as usize],
            region_frames: 0,
            region_sent_to: 0,
            peer_region: PeerRegion::Unasked,
            // The first receive slots are posted before connecting.
            posted: (0..cfg.ring_slots + send + CTRL_SLOTS + HEAP_SLOTS)
                .map(|i| i < cfg.initial_ring_slots)
                .collect(),
            ring_slots: cfg.ring_slots,
            slot_size: cfg.slot_size,
            ring: RecvRing::new(cfg.initial_ring_slots, cfg.ring_slots),
            ring_growth: if cfg.initial_ring_slots < cfg.ring_slots {
                RingGrowth::Growable
            } else {
                RingGrowth::Done
            },
            own_region: OwnRegion::Unasked,
            reader: RegionReader::new(cfg.region_len),
            reassembly: Reassembly::new(cfg.max_frame_len, cfg.max_skip_len, cfg.prefix_len),
            chunked_lane: None,
            prefix_len: cfg.prefix_len,
            arrived: VecDeque::new(),
            probe: false,
            rdv: RendezvousConfig {
                pool_bytes,
                read_chunk: cfg.rendezvous.read_chunk.max(1),
                read_depth: cfg.rendezvous.read_depth.max(1),
                max_outgoing: cfg.rendezvous.max_outgoing.max(1),
                announce_room: cfg
                    .rendezvous
                    .announce_room
                    .max(super::announce_body_len(1, ANNOUNCE_PREFIX_LEN)),
                threshold: cfg.rendezvous.threshold,
            },
            outgoing: BTreeMap::new(),
            next_transfer: 0,
            incoming: VecDeque::new(),
            pool_in_use: 0,
            pool: Box::new(OwnPool::new(pool_bytes)),
            reads: VecDeque::new(),
            read_pace: Pace::default(),
            read_seq: 0,
            reads_completed: 0,
            control_out: VecDeque::new(),
            lifecycle: Lifecycle::Open,
            transmit: VecDeque::new(),
            settled: false,
            wake: Wakeups::default(),
        }
    }

    /// Puts frames over 32 MiB back together in buffers `kept`
    /// holds when one is free, and gives it their buffers once handed up
    /// ([`Reassembly::keep_buffers_in`]).
    pub fn keep_buffers_in(&mut self, kept: std::sync::Arc<rpc_core::kept::KeptBuffers>) {
        self.settled = false;
        self.reassembly.keep_buffers_in(kept);
    }

    /// Charges the destinations of the peer's transfers to `pool` (a
    /// pool shared with other connections) instead of a budget of the
    /// connection's own. Before any transfer arrives.
    pub fn charge_pool_to(&mut self, pool: Box<dyn PoolRoom>) {
        debug_assert_eq!(self.pool_in_use, 0, "the pool changes before any transfer");
        self.settled = false;
        self.pool = pool;
    }

    /// Room may have come in the shared pool ([`charge_pool_to`]): the
    /// oldest transfer waiting for it tries again.
    ///
    /// [`charge_pool_to`]: Self::charge_pool_to
    pub fn handle_pool_room(&mut self) {
        self.settled = false;
        self.pool.room_freed();
    }

    /// The lifecycle state.
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// The failure, if the connection failed.
    pub fn failure(&self) -> Option<&str> {
        match &self.lifecycle {
            Lifecycle::Failed(reason) => Some(reason),
            _ => None,
        }
    }

    fn own_close(&self) -> OwnClose {
        match self.lifecycle {
            Lifecycle::Open => OwnClose::No,
            Lifecycle::Closing(own) | Lifecycle::PeerClosed(own) => own,
            Lifecycle::Disconnected | Lifecycle::Failed(_) => OwnClose::Sent,
        }
    }

    fn set_own_close(&mut self, own: OwnClose) {
        match self.lifecycle {
            Lifecycle::Open | Lifecycle::Closing(_) => self.lifecycle = Lifecycle::Closing(own),
            Lifecycle::PeerClosed(_) => self.lifecycle = Lifecycle::PeerClosed(own),
            Lifecycle::Disconnected | Lifecycle::Failed(_) => {}
        }
    }

    /// Whom to wake since the last call; resets.
    pub fn take_wakeups(&mut self) -> Wakeups {
        std::mem::take(&mut self.wake)
    }

    /// Fails the connection (the first reason sticks); wakes everyone.
    pub fn fail(&mut self, reason: impl Into<String>) {
        self.settled = false;
        if !matches!(self.lifecycle, Lifecycle::Failed(_)) {
            let reason = reason.into();
            tracing::debug!("RDMA connection failed: {reason}");
            self.lifecycle = Lifecycle::Failed(reason);
            self.transmit.clear();
        }
        self.wake = Wakeups {
            senders: true,
            receiver: true,
        };
    }

    /// The peer broke the protocol: fail, and drop what it sent (the
    /// region it may still write is not read again).
    fn fail_protocol(&mut self, e: impl std::fmt::Display) {
        self.arrived.clear();
        self.fail(format!("peer broke the protocol: {e}"));
    }

    /// Whether our side may still send: it has not asked to close. The
    /// peer's `Close` ends only its direction (a half-close): what we send
    /// afterwards is still delivered, until the connection goes down.
    fn may_send(&self) -> bool {
        matches!(
            self.lifecycle,
            Lifecycle::Open | Lifecycle::PeerClosed(OwnClose::No)
        )
    }

    /// Asks to close our side: later sends are refused, `Close` goes after
    /// what is queued.
    pub fn close(&mut self) {
        self.settled = false;
        if self.own_close() == OwnClose::No {
            self.set_own_close(OwnClose::Requested);
            // Senders waiting for credits or room fail now, as later ones do.
            self.wake.senders = true;
        }
    }

    /// The connection manager reported the connection down (`event`, e.g.
    /// `DISCONNECTED`). After the peer's `Close` that is the orderly end;
    /// before it, a failure. Take what is in the completion queue first.
    pub fn handle_disconnected(&mut self, event: &str) {
        self.settled = false;
        let unfinished = !self.outgoing.is_empty()
            || self
                .incoming
                .iter()
                .any(|t| matches!(t.state, InState::WaitPool | InState::Reading));
        match self.lifecycle {
            Lifecycle::PeerClosed(_) if unfinished => {
                self.fail(format!("{event} with rendezvous transfers unfinished"));
            }
            Lifecycle::PeerClosed(_) => {
                self.lifecycle = Lifecycle::Disconnected;
                self.transmit.clear();
                self.wake = Wakeups {
                    senders: true,
                    receiver: true,
                };
            }
            Lifecycle::Disconnected | Lifecycle::Failed(_) => {}
            Lifecycle::Open | Lifecycle::Closing(_) => self.fail(event),
        }
    }

    /// Sends the peer a `Credit` message at the next chance, even with
    /// nothing to return: a keepalive for an idle connection, whose peer
    /// may have vanished without a word (host down, link cut). A live
    /// peer's device acknowledges it (its SEND completes) whatever its
    /// application does; the verbs layer fails the connection when none
    /// comes (the device's own retries may never end: a queue pair's ACK
    /// timeout can be infinite).
    pub fn probe(&mut self) {
        self.settled = false;
        self.probe = true;
    }

    /// Whether a [`probe`](Self::probe) waits to be sent (for a control
    /// credit).
    pub fn probe_pending(&self) -> bool {
        self.probe
    }

    /// Whether the peer closed in order and the connection then went down.
    pub fn is_disconnected(&self) -> bool {
        self.lifecycle == Lifecycle::Disconnected
    }

    /// Whether everything is sent, our `Close` last, and no work request
    /// is in flight: once the application let go, the driver may stop (and
    /// disconnect: a peer that has not received our `Close` by then reads
    /// the disconnect as a failure, so it must have been posted, whether
    /// or not the peer closed first).
    pub fn is_drained(&self) -> bool {
        self.own_close() == OwnClose::Sent
            && self.queue.is_empty()
            && self.in_flight == 0
            // The peer may still read our transfers until it says `Done`;
            // it waits for our `Done` of its own. (A ring's shrink needs
            // nothing more once the connection ends.)
            && self.outgoing.is_empty()
            && !self.control_out.iter().any(|(h, _)| h.kind == Kind::Done)
            && self
                .incoming
                .iter()
                .all(|t| matches!(t.state, InState::Read | InState::Skipped))
    }

    // ---- sending ----

    /// The application wants to send a frame of `len` bytes.
    pub fn handle_send(&mut self, len: usize) -> SendDecision {
        self.settled = false;
        if let Lifecycle::Failed(reason) = &self.lifecycle {
            return SendDecision::Refused(Refusal::Failed(reason.clone()));
        }
        if !self.may_send() {
            return SendDecision::Refused(Refusal::Closed);
        }
        let Ok(len32) = u32::try_from(len) else {
            return SendDecision::Refused(Refusal::TooLong(len));
        };
        if self.goes_by_rendezvous(len) {
            if self.outgoing.len() >= self.rdv.max_outgoing as usize {
                return SendDecision::Wait;
            }
            let Some(slot) = self.free_send.take() else {
                return SendDecision::Wait;
            };
            let transfer = self.next_transfer;
            self.next_transfer += 1;
            self.outgoing.insert(transfer, OutTransfer::Encoding);
            return SendDecision::Encode(Reservation {
                len: len32,
                place: Place::Rendezvous {
                    slot,
                    transfer,
                    body_len: super::announce_body_len(1, ANNOUNCE_PREFIX_LEN) as u32,
                },
                lane: None,
            });
        }
        let max_chunk = self.writer.max_chunk() as usize;
        let route = route(len, self.inline_max, max_chunk);
        if let (PeerRegion::Returning { addr, rkey }, Route::Region | Route::Chunked) =
            (self.peer_region, route)
        {
            // Needed again before it went back: kept.
            self.peer_region = PeerRegion::Granted { addr, rkey };
        }
        if route != Route::Inline && !matches!(self.peer_region, PeerRegion::Granted { .. }) {
            // The first frame for the peer's region asks for it, and it
            // and the ones after it wait for the grant.
            if self.peer_region == PeerRegion::Unasked {
                self.peer_region = PeerRegion::ToAsk;
            }
            return SendDecision::Wait;
        }
        let place = match route {
            Route::Inline => {
                let Some(slot) = self.free_send.take() else {
                    return SendDecision::Wait;
                };
                Place::Inline { slot }
            }
            Route::Region => {
                if self.heap_queued || self.region_frames == REGION_FRAMES {
                    return SendDecision::Wait;
                }
                let Some(slot) = self.free_send.take() else {
                    return SendDecision::Wait;
                };
                let head_before = self.writer.head();
                let Some(pos) = self.writer.alloc(len as u64) else {
                    self.free_send.put(slot);
                    return SendDecision::Wait;
                };
                self.region_frames += 1;
                self.region_frame_in[slot as usize] = true;
                Place::Region {
                    slot,
                    pos,
                    head_before,
                }
            }
            Route::Chunked => {
                if self.heap_queued {
                    return SendDecision::Wait;
                }
                self.heap_queued = true;
                Place::Heap
            }
        };
        SendDecision::Encode(Reservation {
            len: len32,
            place,
            lane: None,
        })
    }

    /// Bytes of body an announcement of ours may take
    /// ([`RendezvousConfig::announce_room`]).
    pub fn announce_room(&self) -> usize {
        self.rdv.announce_room
    }

    /// Whether a frame of `len` bytes goes by rendezvous.
    pub fn goes_by_rendezvous(&self, len: usize) -> bool {
        self.rdv
            .threshold
            .is_some_and(|t| len >= t && len > self.inline_max && len > ANNOUNCE_PREFIX_LEN)
    }

    /// The longest frame sent in one piece (inline, or one region chunk
    /// encoded in place); longer ones are chunked from the heap.
    pub fn max_unchunked(&self) -> usize {
        self.inline_max.max(self.writer.max_chunk() as usize)
    }

    /// For a byte stream, whose message boundaries mean nothing: appends
    /// `len` bytes to the newest queued frame if it waits unsent (for the
    /// peer's credits) in a send slot with room for them. Returns the slot
    /// and the offset after the header where the bytes go; the caller
    /// writes them before it lets go of this connection. `None`: send
    /// them as a frame of their own.
    pub fn append_inline(&mut self, len: usize) -> Option<(u32, usize)> {
        self.settled = false;
        if !self.may_send() {
            return None;
        }
        match self.queue.back_mut() {
            Some(Out::Inline {
                slot,
                len: queued,
                lane: None,
            }) if *queued as usize + len <= self.inline_max => {
                let at = *queued as usize;
                *queued += len as u32;
                Some((*slot, at))
            }
            _ => None,
        }
    }

    /// The offset in staging (and in the peer's region) of stream position `pos`.
    pub fn staging_offset(&self, pos: u64) -> usize {
        self.writer.offset(pos)
    }

    /// Where to encode the frame `r` reserved.
    pub fn encode_into(&self, r: &Reservation) -> EncodeInto {
        r.encode_into(|pos| self.writer.offset(pos))
    }

    /// Queues a frame encoded where its reservation said (`heap` carries a
    /// chunked frame's bytes). A chunked frame, encoded without this
    /// connection's guard, is refused if the connection failed or closed
    /// meanwhile (its place is given back).
    pub fn queue_frame(&mut self, r: Reservation, heap: Option<FrameBytes>) -> Result<(), Refusal> {
        self.settled = false;
        let out = match r.place {
            Place::Inline { slot } => Out::Inline {
                slot,
                len: r.len,
                lane: r.lane,
            },
            Place::Region { slot, pos, .. } => Out::Region {
                slot,
                pos,
                len: r.len,
            },
            Place::Heap => {
                let refused = match &self.lifecycle {
                    Lifecycle::Failed(reason) => Some(Refusal::Failed(reason.clone())),
                    _ if self.may_send() => None,
                    _ => Some(Refusal::Closed),
                };
                if let Some(refused) = refused {
                    self.cancel_send(r);
                    return Err(refused);
                }
                let data = heap.expect("a chunked frame is queued with its bytes");
                assert_eq!(data.len(), r.len as usize, "heap frame length");
                Out::Heap {
                    data,
                    done: 0,
                    lane: r.lane,
                }
            }
            Place::Rendezvous {
                slot,
                transfer,
                body_len,
            } => {
                assert!(
                    body_len as usize <= self.rdv.announce_room,
                    "an announcement of {body_len} bytes, over the {} the peer's slot holds",
                    self.rdv.announce_room
                );
                let refused = match &self.lifecycle {
                    Lifecycle::Failed(reason) => Some(Refusal::Failed(reason.clone())),
                    _ if self.may_send() => None,
                    _ => Some(Refusal::Closed),
                };
                if let Some(refused) = refused {
                    self.cancel_send(r);
                    return Err(refused);
                }
                self.outgoing.insert(transfer, OutTransfer::Queued);
                Out::Rendezvous {
                    slot,
                    transfer,
                    len: r.len,
                    body_len,
                }
            }
        };
        self.queue.push_back(out);
        Ok(())
    }

    /// Gives back what `r` reserved (the frame's encoding panicked). For
    /// a region frame this must be the region's newest allocation: no
    /// other frame was reserved since (the caller held its guard).
    pub fn cancel_send(&mut self, r: Reservation) {
        self.settled = false;
        match r.place {
            Place::Inline { slot } => self.free_send.put(slot),
            Place::Region {
                slot, head_before, ..
            } => {
                self.free_data_slot(slot);
                self.writer.roll_back_to(head_before);
            }
            Place::Heap => self.heap_queued = false,
            Place::Rendezvous { slot, transfer, .. } => {
                self.free_send.put(slot);
                self.outgoing.remove(&transfer);
            }
        }
        self.wake.senders = true;
    }

    /// The requests of [`WorkKind::is_paced`] kinds taken from
    /// [`poll_transmit`](Self::poll_transmit) so far went to the device
    /// `at`: the link's rate is measured from their post to their
    /// completion ([`Completion::at`]).
    pub fn handle_posted(&mut self, at: Instant) {
        self.settled = false;
        self.chunk_pace.stamp(at);
        self.read_pace.stamp(at);
    }

    /// The next work request to post, if any (everything the credits and
    /// the peer's free space allow, in order). `None` once failed.
    #[inline]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        if self.transmit.is_empty() {
            // Most flushes end here, in the caller, with nothing new.
            if self.settled && !cfg!(debug_assertions) {
                return None;
            }
            self.decide();
        }
        self.transmit.pop_front()
    }

    /// [`poll_transmit`](Self::poll_transmit) with nothing queued: runs
    /// the decision pass if anything came in since the last one.
    #[inline(never)]
    fn decide(&mut self) {
        if !self.settled {
            // Again while a pass ends with a control message: it sends one
            // of `Close`, `RegionGranted` and `Credit`, and the next may
            // send another. Nothing else a pass sends lets an earlier part
            // of it send more (debug builds check it, below).
            while self.pump() {}
            self.settled = true;
        } else {
            self.pump();
            debug_assert!(
                self.transmit.is_empty(),
                "the protocol queued {:?} with no input since it last had nothing to send: an input did not clear `settled`",
                self.transmit.front()
            );
        }
    }

    /// Frees data slot `slot` (and a place for a region frame, if it held one).
    fn free_data_slot(&mut self, slot: u32) {
        if std::mem::take(&mut self.region_frame_in[slot as usize]) {
            self.region_frames -= 1;
        }
        self.free_send.put(slot);
    }

    fn stamp(&mut self, header: &mut Header) {
        header.credits = self.ring.take_credits();
        header.freed_to = self.reader.report();
    }

    fn push_send(&mut self, kind: WorkKind, slot: u32, mut header: Header, body_len: usize) {
        self.stamp(&mut header);
        self.posted[(self.ring_slots + slot) as usize] = true;
        self.transmit.push_back(Transmit::Send {
            kind,
            slot,
            header,
            body_len,
        });
        self.in_flight += 1;
    }

    fn push_write(&mut self, pos: u64, len: usize, data: Option<FrameBytes>) {
        self.region_sent_to = self.region_sent_to.max(pos + len as u64);
        self.transmit.push_back(Transmit::Write {
            offset: self.writer.offset(pos),
            len,
            pos,
            data,
        });
    }

    /// Sends what the front of the queue allows, for as long as it allows
    /// it, but at most one chunk of a chunked frame; returns whether
    /// anything went.
    fn pump_front(&mut self) -> bool {
        let mut sent = false;
        while let Some(front) = self.queue.front_mut() {
            match front {
                Out::Inline { slot, len, .. } => {
                    let (slot, len) = (*slot, *len);
                    if !self.credits.take_data() {
                        break;
                    }
                    self.queue.pop_front();
                    let mut h = Header::new(Kind::Inline);
                    h.len = len;
                    self.push_send(WorkKind::Send, slot, h, len as usize);
                }
                Out::Region { slot, pos, len } => {
                    let (slot, pos, len) = (*slot, *pos, *len);
                    if !self.credits.take_data() {
                        break;
                    }
                    self.queue.pop_front();
                    self.push_write(pos, len as usize, None);
                    let mut h = Header::new(Kind::Chunk);
                    h.flags = FIRST | LAST;
                    h.len = len;
                    h.total = len;
                    h.pos = pos;
                    self.push_send(WorkKind::Send, slot, h, 0);
                }
                Out::Rendezvous {
                    slot,
                    transfer,
                    len,
                    body_len,
                } => {
                    let (slot, transfer, len) = (*slot, *transfer, *len);
                    let body_len = *body_len as usize;
                    if !self.credits.take_data() {
                        break;
                    }
                    self.queue.pop_front();
                    self.outgoing.insert(transfer, OutTransfer::Announced);
                    let mut h = Header::new(Kind::Announce);
                    h.len = len;
                    h.pos = transfer;
                    self.push_send(WorkKind::Send, slot, h, body_len);
                }
                Out::Heap { data, done, .. } => {
                    if self.credits.available() < 2
                        || !self.chunk_pace.has_room(HEAP_SLOTS as usize)
                    {
                        break;
                    }
                    let n = (data.len() - *done)
                        .min(self.writer.max_chunk() as usize)
                        .min(self.chunk_pace.len(HEAP_CHUNK_MAX));
                    let Some(pos) = self.writer.alloc(n as u64) else {
                        break;
                    };
                    let slot = self.free_heap.pop().expect("checked above");
                    let took = self.credits.take_data();
                    debug_assert!(took, "checked above");
                    let chunk = data.slice(*done..*done + n);
                    let mut h = Header::new(Kind::Chunk);
                    h.len = n as u32;
                    h.pos = pos;
                    if *done == 0 {
                        h.flags |= FIRST;
                        h.total = data.len() as u32;
                    }
                    *done += n;
                    if *done == data.len() {
                        h.flags |= LAST;
                        self.queue.pop_front();
                        self.heap_queued = false;
                        self.wake.senders = true;
                    }
                    self.push_write(pos, n, Some(chunk));
                    self.push_send(WorkKind::Heap, slot, h, 0);
                    self.chunk_pace.posted(n);
                    // One chunk at a time: what may pass it goes next.
                    return true;
                }
            }
            sent = true;
        }
        sent
    }

    /// Sends the inline frames queued behind a chunked frame still being
    /// sent, of calls other than its own and than those of the frames they
    /// would pass; stops at a frame of no known call (nothing passes it)
    /// and at any other kind of frame. Returns whether any went.
    fn pass_chunked_frame(&mut self) -> bool {
        let Some(&Out::Heap {
            lane: Some(lane), ..
        }) = self.queue.front()
        else {
            return false;
        };
        let mut passed = vec![lane];
        let mut sent = false;
        let mut i = 1;
        while let Some(out) = self.queue.get(i) {
            match *out {
                Out::Inline {
                    slot,
                    len,
                    lane: Some(lane),
                } if !passed.contains(&lane) => {
                    if !self.credits.take_data() {
                        break;
                    }
                    self.queue.remove(i);
                    let mut h = Header::new(Kind::Inline);
                    h.len = len;
                    self.push_send(WorkKind::Send, slot, h, len as usize);
                    self.chunk_pace
                        .interleave(INTERLEAVED_CHUNKS, HEAP_CHUNK_MAX);
                    sent = true;
                }
                // It waits, and so does whatever of its call is behind it.
                Out::Inline {
                    lane: Some(lane), ..
                } => {
                    passed.push(lane);
                    i += 1;
                }
                _ => break,
            }
        }
        sent
    }

    /// Decides whatever the credits and the peer's free space allow;
    /// returns whether it ended with one of the control messages only one
    /// of which goes per pass (`Close`, `RegionGranted`, `Credit`).
    fn pump(&mut self) -> bool {
        if matches!(
            self.lifecycle,
            Lifecycle::Failed(_) | Lifecycle::Disconnected
        ) {
            return false;
        }
        // A chunk of a chunked frame at the front, then the inline frames
        // of other calls queued behind it, and again: small calls do not
        // wait for the whole of a large frame.
        while self.pump_front() | self.pass_chunked_frame() {}
        self.schedule_reads();
        // `Done`s and a ring's shrink go from control slots, each taking
        // a data credit (the reserved one stays for `Credit` and `Close`).
        while let Some((header, count)) = self.control_out.front_mut() {
            if self.free_ctrl.is_empty() || !self.credits.take_data() {
                break;
            }
            let header = *header;
            *count -= 1;
            if *count == 0 {
                self.control_out.pop_front();
            }
            let slot = self.free_ctrl.pop().expect("checked");
            // Any control message answers a probe.
            self.probe = false;
            self.push_send(WorkKind::Control, slot, header, 0);
        }
        // Asking for the peer's region likewise: a data message's credit,
        // as the frames that wait for it need.
        if self.peer_region == PeerRegion::ToAsk
            && !self.free_ctrl.is_empty()
            && self.credits.take_data()
        {
            let slot = self.free_ctrl.pop().expect("checked");
            self.peer_region = PeerRegion::Asked;
            self.probe = false;
            self.push_send(WorkKind::Control, slot, Header::new(Kind::RegionWanted), 0);
        }
        // Giving the peer's region back likewise (see `return_idle_region`).
        if let PeerRegion::Returning { addr, rkey } = self.peer_region {
            if !self.region_idle() {
                self.peer_region = PeerRegion::Granted { addr, rkey };
            } else if !self.free_ctrl.is_empty() && self.credits.take_data() {
                let slot = self.free_ctrl.pop().expect("checked");
                self.peer_region = PeerRegion::Unasked;
                self.probe = false;
                self.push_send(
                    WorkKind::Control,
                    slot,
                    Header::new(Kind::RegionReturned),
                    0,
                );
            }
        }
        // The grant may take the last credit, as a `Credit` message does
        // (it returns credits as one does): the peer's frames wait for it,
        // and the peer may be waiting for them before it reads ours.
        if let Some(&slot) = self.free_ctrl.last() {
            let kind = if self.own_close() == OwnClose::Requested && self.queue.is_empty() {
                Some(Kind::Close)
            } else if matches!(self.own_region, OwnRegion::ToGrant { .. }) {
                Some(Kind::RegionGranted)
            } else if self.ring.wants_credit_message() || self.reader.wants_report() || self.probe {
                Some(Kind::Credit)
            } else {
                None
            };
            if let Some(kind) = kind {
                if self.credits.take_control() {
                    self.free_ctrl.pop();
                    let mut header = Header::new(kind);
                    match (kind, self.own_region) {
                        (Kind::Close, _) => self.set_own_close(OwnClose::Sent),
                        (Kind::RegionGranted, OwnRegion::ToGrant { addr, rkey }) => {
                            header.pos = addr;
                            header.total = rkey;
                            self.own_region = OwnRegion::Granted;
                        }
                        _ => {}
                    }
                    // Any control message answers a probe.
                    self.probe = false;
                    self.push_send(WorkKind::Control, slot, header, 0);
                    return true;
                }
            }
        }
        false
    }

    /// Gives the pool to the peer's transfers in arrival order (one that
    /// does not fit yet holds up the later ones: no starvation), and posts
    /// READs, oldest transfer first, up to the read depth.
    fn schedule_reads(&mut self) {
        for t in self.incoming.iter_mut() {
            if t.state != InState::WaitPool {
                continue;
            }
            let charge = pool_charge(t.len);
            if !self.pool.try_take(charge) {
                break;
            }
            self.pool_in_use += charge;
            t.state = InState::Reading;
            self.transmit.push_back(Transmit::Alloc {
                transfer: t.id,
                len: t.len,
                slot: t.slot,
                head_at: HEADER_LEN + t.ann.head_offset(),
                head_len: t.ann.head_len as usize,
            });
        }
        for t in self.incoming.iter_mut() {
            let depth = self.rdv.read_depth as usize;
            if !self.read_pace.has_room(depth) {
                break;
            }
            if t.state != InState::Reading {
                continue;
            }
            while t.next < t.len && self.read_pace.has_room(depth) {
                // A READ stays within one segment (one registration).
                let (addr, rkey, in_segment) = t
                    .ann
                    .locate(t.next)
                    .expect("the segments add up to the frame (checked on arrival)");
                let n = in_segment.min(self.read_pace.len(self.rdv.read_chunk));
                let seq = self.read_seq;
                self.read_seq = self.read_seq.wrapping_add(1);
                self.transmit.push_back(Transmit::Read {
                    transfer: t.id,
                    offset: t.next,
                    len: n,
                    addr,
                    rkey,
                    seq,
                });
                self.reads.push_back((seq, t.id, n));
                self.read_pace.posted(n);
                t.next += n;
                self.in_flight += 1;
            }
        }
    }

    // ---- completions ----

    /// One work completion.
    pub fn handle_completion(&mut self, wc: Completion<'_>) {
        self.settled = false;
        let Some((kind, index)) = WorkKind::from_wr_id(wc.wr_id) else {
            self.fail(format!(
                "completion of an unknown work request {:#x}",
                wc.wr_id
            ));
            return;
        };
        if !self.slot_in_range(kind, index) {
            // Only a broken verbs layer reports one: taking it would put a
            // slot that does not exist (or another kind's) back in use.
            self.fail(format!(
                "completion of a {kind:?} work request on slot {index}, out of range ({:#x})",
                wc.wr_id
            ));
            return;
        }
        let mut read = None;
        let was_posted = if matches!(kind, WorkKind::Write | WorkKind::Bind) {
            // Unsignaled: a WRITE or bind completes only if it failed.
            wc.failure.is_some()
        } else if kind == WorkKind::Read {
            // An RC send queue completes in posting order.
            match self.reads.front() {
                Some(&(seq, transfer, len)) if seq == index => {
                    self.reads.pop_front();
                    read = Some((transfer, len));
                    true
                }
                _ => false,
            }
        } else {
            // In range (checked above): the flag exists.
            self.posted_flag(kind, index)
                .is_some_and(|posted| std::mem::replace(posted, false))
        };
        if !was_posted {
            // A second completion of one request (or of one never posted):
            // taking it would hand out a slot still in use, or count a
            // request still in flight as done.
            self.fail(format!(
                "completion of a {kind:?} work request on slot {index} that was not posted ({:#x})",
                wc.wr_id
            ));
            return;
        }
        if !matches!(kind, WorkKind::Recv | WorkKind::Write | WorkKind::Bind) {
            self.in_flight = self.in_flight.saturating_sub(1);
            // Whoever waits for everything to be sent sees it.
            self.wake.senders |= self.in_flight == 0;
        }
        if matches!(self.lifecycle, Lifecycle::Failed(_)) {
            return;
        }
        if let Some(failure) = wc.failure {
            self.fail(format!("work request failed: {failure}"));
            return;
        }
        match kind {
            WorkKind::Recv => {
                if let Err(e) = self.on_receive(index, wc.byte_len, wc.header) {
                    self.fail_protocol(e);
                }
            }
            WorkKind::Send => {
                self.free_data_slot(index);
                self.wake.senders = true;
            }
            WorkKind::Control => self.free_ctrl.push(index),
            WorkKind::Heap => {
                self.free_heap.push(index);
                self.chunk_pace.completed(wc.at);
            }
            WorkKind::Write | WorkKind::Bind => {}
            WorkKind::Read => {
                let (transfer, len) = read.expect("a posted READ");
                self.reads_completed += 1;
                self.read_pace.completed(wc.at);
                if let Some(t) = self.incoming.iter_mut().find(|t| t.id == transfer) {
                    t.read += len;
                    if t.read == t.len {
                        t.state = InState::Read;
                        self.control_out.push_back((done_header(transfer), 1));
                        self.wake.receiver = true;
                    }
                }
            }
        }
    }

    /// Whether `index` is a slot of `kind`'s range (see the module docs).
    fn slot_in_range(&self, kind: WorkKind, index: u32) -> bool {
        let ctrl = self.data_slots..self.data_slots + CTRL_SLOTS;
        let heap = ctrl.end..ctrl.end + HEAP_SLOTS;
        match kind {
            WorkKind::Recv => index < self.ring_slots,
            WorkKind::Send => index < self.data_slots,
            WorkKind::Control => ctrl.contains(&index),
            WorkKind::Heap => heap.contains(&index),
            // Posted with index 0 (`push_write`'s request, a bind).
            WorkKind::Write | WorkKind::Bind => index == 0,
            // Any sequence number; checked against the READs posted.
            WorkKind::Read => true,
        }
    }

    /// Whether slot `index` of `kind` has a request posted (`None` for
    /// WRITEs, which have no slot).
    fn posted_flag(&mut self, kind: WorkKind, index: u32) -> Option<&mut bool> {
        let at = match kind {
            WorkKind::Recv => index,
            WorkKind::Send | WorkKind::Control | WorkKind::Heap => self.ring_slots + index,
            WorkKind::Write | WorkKind::Read | WorkKind::Bind => return None,
        };
        self.posted.get_mut(at as usize)
    }

    fn repost(&mut self, slot: u32) {
        if self.ring.retires(slot) {
            self.retire(slot, false);
            return;
        }
        if let Some(posted) = self.posted.get_mut(slot as usize) {
            *posted = true;
        }
        self.transmit.push_back(Transmit::Recv { slot });
        self.ring.on_reposted();
    }

    /// `slot`, past the ring's first slots, was handled (or its frame,
    /// with `released`, dropped) while the ring shrinks: it is not
    /// reposted, and once it is the last, the slots past the first ones
    /// are deregistered.
    fn retire(&mut self, slot: u32, released: bool) {
        if self.ring.on_retired(released) {
            let from = self.ring.slots();
            debug_assert!(
                !self.posted[from as usize..self.ring_slots as usize].contains(&true),
                "slot {slot} retired last with receives still posted past {from}"
            );
            self.transmit.push_back(Transmit::DeregisterRing { from });
            // Whole again or not before (a registration that failed), it
            // may grow into its parts again.
            self.ring_growth = RingGrowth::Growable;
        }
    }

    /// A receive completed in `slot` with `byte_len` bytes.
    fn on_receive(&mut self, slot: u32, byte_len: usize, peek: &[u8]) -> Result<(), ProtocolError> {
        if byte_len > self.slot_size {
            return Err(ProtocolError::new(format!(
                "receive of {byte_len} bytes in a smaller slot"
            )));
        }
        let header = Header::decode(peek, byte_len)?;
        self.ring.on_arrival()?;
        if self.ring_growth == RingGrowth::Growable && self.ring.wants_growth() {
            self.ring_growth = RingGrowth::Registering;
            let next = self.ring.next_growth();
            self.transmit.push_back(Transmit::RegisterRing {
                from: next.start,
                to: next.end,
            });
        }
        self.credits.grant(header.credits)?;
        if header.freed_to > self.region_sent_to {
            return Err(ProtocolError::new(format!(
                "peer freed its region to {}, beyond the {} bytes written into it",
                header.freed_to, self.region_sent_to
            )));
        }
        self.writer.on_freed(header.freed_to)?;
        self.wake.senders = true;
        match header.kind {
            Kind::Inline => {
                if !self.reads.is_empty() {
                    self.read_pace
                        .interleave(INTERLEAVED_READS, self.rdv.read_chunk);
                }
                self.arrived.push_back(Arrived::Inline {
                    slot,
                    len: header.len,
                });
            }
            Kind::Chunk => {
                if self.own_region != OwnRegion::Granted {
                    return Err(ProtocolError::new(
                        "a chunk in our region before we granted it",
                    ));
                }
                let offset = self.reader.accept(header.pos, header.len.into())?;
                self.arrived.push_back(Arrived::Chunk {
                    slot,
                    header,
                    offset,
                });
            }
            Kind::Credit => self.repost(slot),
            Kind::Announce => {
                let body = peek.get(HEADER_LEN..).unwrap_or_default();
                self.on_announce(slot, &header, body, byte_len - HEADER_LEN)?
            }
            Kind::Done => {
                self.repost(slot);
                match self.outgoing.get(&header.pos) {
                    Some(OutTransfer::Announced) => {
                        self.outgoing.remove(&header.pos);
                        self.transmit.push_back(Transmit::Release {
                            transfer: header.pos,
                        });
                    }
                    _ => {
                        return Err(ProtocolError::new(format!(
                            "Done for transfer {}, which is not announced",
                            header.pos
                        )))
                    }
                }
            }
            Kind::RingShrinks => {
                self.repost(slot);
                // At most a message for each of its slots: more would be
                // no use to it, and are not ours to spend.
                let limit = self.credits.limit();
                if header.pos > u64::from(limit) {
                    return Err(ProtocolError::new(format!(
                        "the peer asked for {} messages to shrink a ring of {limit} slots",
                        header.pos
                    )));
                }
                let credit = Header::new(Kind::Credit);
                match self.control_out.iter_mut().find(|(h, _)| *h == credit) {
                    Some((_, owed)) => *owed = (*owed + header.pos as u32).min(limit),
                    None if header.pos > 0 => {
                        self.control_out.push_back((credit, header.pos as u32))
                    }
                    None => {}
                }
            }
            Kind::RegionWanted => {
                self.repost(slot);
                if self.own_region != OwnRegion::Unasked {
                    return Err(ProtocolError::new("the peer asked for our region twice"));
                }
                self.own_region = OwnRegion::Registering;
                self.transmit.push_back(Transmit::RegisterRegion);
            }
            Kind::RegionReturned => {
                self.repost(slot);
                if self.own_region != OwnRegion::Granted {
                    return Err(ProtocolError::new(format!(
                        "the peer returned a region we did not grant ({:?})",
                        self.own_region
                    )));
                }
                if !self.reader.all_freed() {
                    return Err(ProtocolError::new(
                        "the peer returned our region with chunks in it not yet consumed",
                    ));
                }
                self.own_region = OwnRegion::Unasked;
                self.transmit.push_back(Transmit::DeregisterRegion);
            }
            Kind::RegionGranted => {
                self.repost(slot);
                if self.peer_region != PeerRegion::Asked {
                    return Err(ProtocolError::new(format!(
                        "the peer granted its region unasked ({:?})",
                        self.peer_region
                    )));
                }
                self.peer_region = PeerRegion::Granted {
                    addr: header.pos,
                    rkey: header.total,
                };
            }
            Kind::Close => {
                self.repost(slot);
                self.arrived.push_back(Arrived::Eof);
                match self.lifecycle {
                    Lifecycle::Open => self.lifecycle = Lifecycle::PeerClosed(OwnClose::No),
                    Lifecycle::Closing(own) => self.lifecycle = Lifecycle::PeerClosed(own),
                    _ => {}
                }
            }
        }
        self.wake.receiver = true;
        Ok(())
    }

    /// The peer announced a rendezvous transfer in `slot` (held until
    /// the frame is delivered).
    fn on_announce(
        &mut self,
        slot: u32,
        header: &Header,
        body: &[u8],
        body_len: usize,
    ) -> Result<(), ProtocolError> {
        if self.rdv.pool_bytes == 0 {
            return Err(ProtocolError::new(
                "rendezvous announced, but this side takes none",
            ));
        }
        let ann = Announcement::decode(body, body_len)?;
        if ann.frame_len() != u64::from(header.len) {
            return Err(ProtocolError::new(format!(
                "announced head and segments of {} bytes for a frame of {}",
                ann.frame_len(),
                header.len
            )));
        }
        let transfer = header.pos;
        if self.incoming.iter().any(|t| t.id == transfer) {
            return Err(ProtocolError::new(format!(
                "transfer {transfer} announced while it is in flight"
            )));
        }
        let len = header.len as usize;
        let over = len > self.reassembly.max_frame_len();
        if over {
            // Skipped unread (or failing the connection at delivery):
            // the sender may release it at once.
            self.control_out.push_back((done_header(transfer), 1));
        }
        // The head came with the announcement: the READs fetch the rest.
        let head = ann.head_len as usize;
        self.incoming.push_back(Incoming {
            id: transfer,
            slot,
            len,
            lane: lane(&ann.prefix),
            ann,
            state: if over {
                InState::Skipped
            } else {
                InState::WaitPool
            },
            next: head,
            read: head,
        });
        self.arrived
            .push_back(Arrived::Rendezvous { slot, transfer });
        Ok(())
    }

    /// The application dropped a rendezvous frame of `len` bytes
    /// ([`Delivered::Pooled`]): its destination goes back to the pool.
    pub fn handle_pool_released(&mut self, len: usize) {
        self.settled = false;
        let charge = pool_charge(len).min(self.pool_in_use);
        self.pool_in_use -= charge;
        self.pool.give_back(charge);
    }

    /// Pool bytes charged to destinations now (being read, or delivered
    /// and not yet released).
    pub fn pool_in_use(&self) -> u64 {
        self.pool_in_use
    }

    /// Bytes the pool may charge to destinations at once.
    pub fn pool_budget(&self) -> u64 {
        self.pool.budget()
    }

    /// RDMA READs completed so far.
    pub fn reads_completed(&self) -> u64 {
        self.reads_completed
    }

    /// Our rendezvous transfers not yet `Done`.
    pub fn transfers_out(&self) -> usize {
        self.outgoing.len()
    }

    /// The peer's rendezvous transfers not yet delivered.
    pub fn transfers_in(&self) -> usize {
        self.incoming.len()
    }

    /// Which arrived message to deliver next, if any may go now: the
    /// first, or one behind rendezvous frames still being read whose
    /// call ([`lane`]) differs from theirs and from every message it
    /// passes (only inline and rendezvous frames overtake; region
    /// chunks and the end of the stream never do).
    fn next_deliverable(&self, mem: &impl ReadReceived) -> Option<usize> {
        let mut blocked: Vec<u64> = Vec::new();
        for (i, arrived) in self.arrived.iter().enumerate() {
            if i > 0 && self.reassembly.in_frame() {
                return None;
            }
            let (ready, lane) = match *arrived {
                Arrived::Rendezvous { transfer, .. } => {
                    let t = self.incoming.iter().find(|t| t.id == transfer)?;
                    (matches!(t.state, InState::Read | InState::Skipped), t.lane)
                }
                Arrived::Inline { slot, len } => {
                    if i == 0 {
                        return Some(0);
                    }
                    (true, inline_lane(mem, slot, len))
                }
                Arrived::Chunk { .. } | Arrived::Eof => return (i == 0).then_some(0),
            };
            if ready && (i == 0 || lane.is_some_and(|l| !blocked.contains(&l))) {
                return Some(i);
            }
            // It waits, and so does whatever of its call comes behind it.
            blocked.push(lane?);
        }
        None
    }

    // ---- delivering ----

    /// What the application gets next, if anything is there; `mem` reads
    /// the received bytes. Frames that arrived before a failure are still
    /// delivered (a protocol violation drops them), then the failure.
    pub fn poll_delivery(&mut self, mem: &impl ReadReceived) -> Option<Delivered> {
        loop {
            let Some(arrived) = self
                .next_deliverable(mem)
                .and_then(|i| self.arrived.remove(i))
            else {
                return self.failure().map(|r| Delivered::Failed(r.to_string()));
            };
            // Nothing changed until here: a poll that finds nothing to
            // deliver (most) leaves the protocol settled.
            self.settled = false;
            match arrived {
                Arrived::Rendezvous { slot, transfer } => {
                    if self.reassembly.in_frame() {
                        self.fail_protocol("rendezvous frame inside a chunked one");
                        continue;
                    }
                    let at = self
                        .incoming
                        .iter()
                        .position(|t| t.id == transfer)
                        .expect("a deliverable transfer");
                    let t = self.incoming.remove(at).expect("found");
                    self.repost(slot);
                    if t.state == InState::Skipped {
                        let verdict = self
                            .reassembly
                            .check_len(t.len, &t.ann.prefix)
                            .expect("skipped frames are over the limit");
                        return Some(self.verdict(verdict));
                    }
                    return Some(Delivered::Pooled {
                        transfer,
                        len: t.len,
                    });
                }
                Arrived::Eof => {
                    self.arrived.push_front(Arrived::Eof);
                    return Some(Delivered::Eof);
                }
                Arrived::Inline { slot, len } => {
                    if self.reassembly.in_frame() {
                        // Only a frame of another call passes a chunked one.
                        let own = inline_lane(mem, slot, len);
                        if own.is_none() || self.chunked_lane.is_none() || own == self.chunked_lane
                        {
                            self.fail_protocol(
                                "inline frame of the same call inside a chunked one",
                            );
                            continue;
                        }
                    }
                    let len = len as usize;
                    if len > self.reassembly.max_frame_len() {
                        // Over the limit: only its first bytes are read.
                        let mut prefix = vec![0; len.min(self.prefix_len)];
                        mem.read_slot(slot, HEADER_LEN, &mut prefix);
                        if let Some(verdict) = self.reassembly.check_len(len, &prefix) {
                            self.repost(slot);
                            return Some(self.verdict(verdict));
                        }
                    }
                    return Some(match self.ring.deliver() {
                        Delivery::ZeroCopy => Delivered::InSlot { slot, len },
                        Delivery::Copy => Delivered::CopyOut { slot, len },
                    });
                }
                Arrived::Chunk {
                    slot,
                    header,
                    offset,
                } => {
                    if header.flags & FIRST != 0 {
                        let mut call = [0; 12];
                        let n = (header.len as usize).min(call.len());
                        mem.read_region(offset, &mut call[..n]);
                        self.chunked_lane = lane(&call[..n]);
                    }
                    let out = self.reassembly.chunk_from(
                        header.flags,
                        header.total,
                        header.len as usize,
                        |from, dst| mem.read_region(offset + from, dst),
                    );
                    self.reader.free_through(header.pos + u64::from(header.len));
                    self.repost(slot);
                    match out {
                        Err(e) => self.fail_protocol(e),
                        Ok(None) => {}
                        Ok(Some(Assembled::Frame(v))) => return Some(Delivered::Frame(v)),
                        Ok(Some(verdict)) => return Some(self.verdict(verdict)),
                    }
                }
            }
        }
    }

    fn verdict(&mut self, verdict: Assembled) -> Delivered {
        match verdict {
            Assembled::Oversized { len, prefix } => Delivered::Oversized { len, prefix },
            Assembled::TooLarge { len } => {
                let max = self.reassembly.max_frame_len();
                self.fail(format!("frame of {len} bytes is over the limit of {max}"));
                Delivered::TooLarge { len }
            }
            Assembled::Frame(_) => unreachable!("not a verdict"),
        }
    }

    /// The application dropped the frame it was handed in `slot`
    /// ([`Delivered::InSlot`]): the slot is reposted.
    pub fn handle_released(&mut self, slot: u32) {
        self.settled = false;
        if matches!(self.lifecycle, Lifecycle::Failed(_)) {
            return;
        }
        if self.ring.retires(slot) {
            self.retire(slot, true);
            return;
        }
        if let Some(posted) = self.posted.get_mut(slot as usize) {
            *posted = true;
        }
        self.transmit.push_back(Transmit::Recv { slot });
        self.ring.on_released();
    }

    /// The frame of [`Delivered::CopyOut`] was copied out of `slot`: the
    /// slot is reposted.
    pub fn handle_copied(&mut self, slot: u32) {
        self.settled = false;
        self.repost(slot);
    }

    // ---- accounting, for checks and debugging ----

    /// Credits for the peer's ring held now.
    pub fn credits_available(&self) -> u32 {
        self.credits.available()
    }

    /// Our ring's slots consumed and not yet returned to the peer.
    pub fn ring_outstanding(&self) -> u32 {
        self.ring.outstanding()
    }

    /// Decides to give the peer's region back if it is granted and idle
    /// (nothing of it allocated: every chunk written was consumed; nothing
    /// queued) and the connection open: `RegionReturned` goes with the
    /// next control slot and data credit, unless a frame needs the region
    /// before then (it stays granted). From then on a frame that needs
    /// the region asks for it again. Returns whether it decided so.
    pub fn return_idle_region(&mut self) -> bool {
        self.settled = false;
        let PeerRegion::Granted { addr, rkey } = self.peer_region else {
            return false;
        };
        if !self.region_idle() || self.lifecycle != Lifecycle::Open || self.failure().is_some() {
            return false;
        }
        self.peer_region = PeerRegion::Returning { addr, rkey };
        true
    }

    /// Decides, at an idle check, to shrink a grown receive ring back to
    /// its first slots if the peer's traffic since the last check would
    /// not have grown them (it never kept half of them consumed) and the
    /// connection is open. Each slot past the first ones is retired when
    /// its message is handled: not reposted, not returned as a credit.
    /// Receives complete in the order they were posted, so the peer is
    /// asked (`RingShrinks`) for as many messages as receives are posted
    /// now, and answers with that many `Credit` messages (or real frames
    /// consume them first); once the last slot is retired they are
    /// deregistered ([`Transmit::DeregisterRing`]), and the ring grows
    /// again as any ring does. Returns whether it decided so.
    pub fn shrink_idle_ring(&mut self) -> bool {
        self.settled = false;
        // No growth while it shrinks (`RecvRing::wants_growth`).
        let due = self.ring.shrink_due();
        if !due
            || self.ring_growth == RingGrowth::Registering
            || self.lifecycle != Lifecycle::Open
            || self.failure().is_some()
        {
            return false;
        }
        let mut request = Header::new(Kind::RingShrinks);
        request.pos = self.ring.shrink().into();
        self.control_out.push_back((request, 1));
        true
    }

    /// Nothing of the peer's region allocated (every chunk written was
    /// consumed) and no frame queued, or being encoded, that may need it.
    fn region_idle(&self) -> bool {
        // `heap_queued`: a chunked frame is being encoded (not queued
        // yet) or queued; its chunks take region space only as they go.
        self.writer.in_use() == 0 && self.queue.is_empty() && !self.heap_queued
    }

    /// Bytes of the peer's region, and of our staging at the same
    /// offsets, allocated and not yet freed: a chunk holds its bytes from
    /// its allocation until the peer frees them, after its WRITE landed.
    pub fn region_in_use(&self) -> u64 {
        self.writer.in_use()
    }

    /// Frames queued and not yet fully posted.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Signaled work requests posted and not yet completed (receives and
    /// the unsignaled WRITEs excepted: each completes before the SEND
    /// after it).
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Where the peer's region is (the address remote requests name its
    /// start by, and its rkey), once it granted it: what every
    /// [`Transmit::Write`] writes into.
    pub fn peer_region(&self) -> Option<(u64, u32)> {
        match self.peer_region {
            PeerRegion::Granted { addr, rkey } | PeerRegion::Returning { addr, rkey } => {
                Some((addr, rkey))
            }
            _ => None,
        }
    }

    /// Our region is registered ([`Transmit::RegisterRegion`]): grant it
    /// to the peer.
    pub fn region_registered(&mut self, addr: u64, rkey: u32) {
        self.settled = false;
        assert_eq!(
            self.own_region,
            OwnRegion::Registering,
            "a region registered that the protocol did not ask for"
        );
        self.own_region = OwnRegion::ToGrant { addr, rkey };
    }

    /// The slots of [`Transmit::RegisterRing`] are registered: their
    /// receives are posted, and go to the peer as credits.
    pub fn ring_registered(&mut self) {
        self.settled = false;
        assert_eq!(
            self.ring_growth,
            RingGrowth::Registering,
            "a ring registered that the protocol did not ask for"
        );
        for slot in self.ring.grow() {
            self.posted[slot as usize] = true;
            self.transmit.push_back(Transmit::Recv { slot });
        }
        self.ring_growth = if self.ring.slots() < self.ring_slots {
            RingGrowth::Growable
        } else {
            RingGrowth::Done
        };
    }

    /// The slots of [`Transmit::RegisterRing`] could not be registered (the
    /// locked-memory limit, say): the connection goes on with the slots it
    /// has.
    pub fn ring_not_registered(&mut self) {
        self.settled = false;
        self.ring_growth = RingGrowth::Done;
    }

    /// Receive slots in use (posted or consumed): the first ones until the
    /// peer's traffic needed the whole ring.
    pub fn ring_slots_in_use(&self) -> u32 {
        self.ring.slots()
    }

    /// Whether the receive ring has more slots in use than its first ones
    /// (grown, and not yet shrunk back).
    pub fn ring_grown(&self) -> bool {
        self.ring.grown()
    }

    /// Receive slots still to retire while the ring shrinks (0 otherwise).
    pub fn ring_retiring(&self) -> u32 {
        self.ring.retiring()
    }

    /// Receive slots added by growth that the peer has not been told of.
    pub fn ring_slots_unreported(&self) -> u32 {
        self.ring.fresh()
    }

    /// Both regions granted from the start, for tests of what follows.
    #[cfg(test)]
    pub(crate) fn regions_granted(mut self) -> Connection {
        self.peer_region = PeerRegion::Granted { addr: 0, rkey: 0 };
        self.own_region = OwnRegion::Granted;
        self
    }

    /// A one-line summary of the state, for debugging stalls.
    pub fn summary(&self) -> String {
        format!(
            "credits {} queue {} (front {}) free_send {} free_ctrl {} free_heap {} chunks_single_bytes {} \
             chunk_rate {:?} read_rate {:?} heap_queued {} in_flight {} writer_in_use {} | ring slots {} of {} held {} outstanding {} pending {} \
             fresh {} arrived {} reader_wants_report {} | regions peer {:?} own {:?} | rendezvous out {} in {} reads {} \
             pool {} control_out {} | {:?}",
            self.credits.available(),
            self.queue.len(),
            match self.queue.front() {
                None => "-",
                Some(Out::Inline { .. }) => "inline",
                Some(Out::Region { .. }) => "region",
                Some(Out::Heap { .. }) => "heap",
                Some(Out::Rendezvous { .. }) => "rendezvous",
            },
            self.free_send.len(),
            self.free_ctrl.len(),
            self.free_heap.len(),
            self.chunk_pace.single_bytes,
            self.chunk_pace.rate.bytes_per_sec,
            self.read_pace.rate.bytes_per_sec,
            self.heap_queued,
            self.in_flight,
            self.writer.in_use(),
            self.ring.slots(),
            self.ring_slots,
            self.ring.held(),
            self.ring.outstanding(),
            self.ring.pending() - self.ring.fresh(),
            self.ring.fresh(),
            self.arrived.len(),
            self.reader.wants_report(),
            self.peer_region,
            self.own_region,
            self.outgoing.len(),
            self.incoming.len(),
            self.reads.len(),
            self.pool_in_use,
            self.control_out.len(),
            self.lifecycle,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Segment;

    /// The peer's ring, so our data send slots; our own ring has more, so
    /// that mixing the two up shows.
    const SLOTS: u32 = 8;
    const RING_SLOTS: u32 = 12;

    /// A connection of [`connection_config`] whose peer granted its
    /// region, and that granted its own (see
    /// `the_first_region_frame_asks_for_the_region_and_waits_for_the_grant`).
    fn connection() -> Connection {
        Connection::new(connection_config()).regions_granted()
    }

    /// A control message from the peer: no credits, `freed_to` as given.
    fn credit_message(freed_to: u64) -> [u8; HEADER_LEN] {
        control_message(0, freed_to)
    }

    /// A control message from the peer returning `n` credits.
    fn credits_returned(n: u16) -> [u8; HEADER_LEN] {
        control_message(n, 0)
    }

    fn control_message(credits: u16, freed_to: u64) -> [u8; HEADER_LEN] {
        let mut header = Header::new(Kind::Credit);
        header.credits = credits;
        header.freed_to = freed_to;
        let mut bytes = [0; HEADER_LEN];
        header.encode(&mut bytes);
        bytes
    }

    /// A connection with 4 MiB regions granted both ways, for chunked
    /// frames.
    fn chunking_connection() -> Connection {
        let region = 4 << 20;
        Connection::new(Config {
            region_len: region,
            peer_region_len: region,
            max_frame_len: 8 << 20,
            ..connection_config()
        })
        .regions_granted()
    }

    /// Queues a frame of `len` bytes of call `call` (chunked if it does not
    /// go whole).
    fn queue_call(conn: &mut Connection, len: usize, call: u64) {
        let SendDecision::Encode(reservation) = conn.handle_send(len) else {
            panic!("no room for a frame of {len} bytes")
        };
        let mut frame = vec![0; len];
        frame[4..12].copy_from_slice(&call.to_le_bytes());
        let heap = (len > conn.max_unchunked()).then(|| bytes::Bytes::from(frame).into());
        conn.queue_frame(reservation.in_lane(Some(call)), heap)
            .unwrap();
    }

    fn complete(conn: &mut Connection, wr_id: u64, header: &[u8]) {
        conn.handle_completion(Completion {
            wr_id,
            failure: None,
            byte_len: header.len(),
            header,
            at: None,
        });
    }

    #[test]
    fn a_completion_for_a_slot_out_of_range_fails_the_connection() {
        let cases = [
            (WorkKind::Recv, RING_SLOTS),
            (WorkKind::Send, SLOTS),
            (WorkKind::Send, u32::MAX),
            (WorkKind::Control, SLOTS - 1),
            (WorkKind::Control, SLOTS + CTRL_SLOTS),
            (WorkKind::Heap, SLOTS + CTRL_SLOTS - 1),
            (WorkKind::Heap, SLOTS + CTRL_SLOTS + HEAP_SLOTS),
        ];
        for (kind, index) in cases {
            let mut conn = connection();
            complete(&mut conn, kind.wr_id(index), &credit_message(0));
            let failure = conn
                .failure()
                .unwrap_or_else(|| panic!("{kind:?} {index} accepted"));
            assert!(
                failure.contains("out of range"),
                "{kind:?} {index}: {failure}"
            );
            // Nothing goes out on a slot that is not one.
            assert!(matches!(conn.handle_send(8), SendDecision::Refused(_)));
        }
        // In range, the same completions are taken.
        let mut conn = connection();
        complete(
            &mut conn,
            WorkKind::Recv.wr_id(RING_SLOTS - 1),
            &credit_message(0),
        );
        assert_eq!(conn.failure(), None);
        // In range but with nothing posted there: not taken either.
        for (kind, index) in [
            (WorkKind::Send, SLOTS - 1),
            (WorkKind::Control, SLOTS),
            (WorkKind::Heap, SLOTS + CTRL_SLOTS + HEAP_SLOTS - 1),
        ] {
            let mut conn = connection();
            complete(&mut conn, kind.wr_id(index), &[]);
            let failure = conn.failure().unwrap_or_default().to_string();
            assert!(
                failure.contains("not posted"),
                "{kind:?} {index}: {failure:?}"
            );
        }
    }

    #[test]
    fn send_slots_are_reused_lowest_first() {
        // The verbs layer registers send slots in parts, lowest first: a
        // sender with n frames in flight must use slots below n whatever
        // order their completions came in.
        let mut conn = connection();
        let send = |conn: &mut Connection| {
            let SendDecision::Encode(reservation) = conn.handle_send(8) else {
                panic!("no room for an inline frame")
            };
            conn.queue_frame(reservation, None).unwrap();
            let Some(Transmit::Send { kind, slot, .. }) = conn.poll_transmit() else {
                panic!("the frame was not sent")
            };
            assert_eq!(kind, WorkKind::Send);
            slot
        };
        let first: Vec<u32> = (0..4).map(|_| send(&mut conn)).collect();
        assert_eq!(first, [0, 1, 2, 3]);
        for slot in [3, 0, 2] {
            complete(&mut conn, WorkKind::Send.wr_id(slot), &[]);
        }
        let next: Vec<u32> = (0..3).map(|_| send(&mut conn)).collect();
        assert_eq!(next, [0, 2, 3], "a stack would give 2, 0, 3");
        assert_eq!(conn.failure(), None);
    }

    #[test]
    fn fewer_send_slots_than_the_peers_ring_bound_what_is_in_flight() {
        // A client sizes its send queue before it learns the server's ring:
        // it uses 3 of the peer's 8 slots, though it holds credits for more.
        let mut conn = Connection::new(Config {
            send_slots: 3,
            ..connection_config()
        })
        .regions_granted();
        let credits = conn.credits_available();
        let mut sent = Vec::new();
        while let SendDecision::Encode(reservation) = conn.handle_send(8) {
            conn.queue_frame(reservation, None).unwrap();
            while let Some(t) = conn.poll_transmit() {
                if let Transmit::Send { kind, slot, .. } = t {
                    assert_eq!(kind, WorkKind::Send);
                    sent.push(slot);
                }
            }
        }
        assert_eq!(sent, [0, 1, 2], "one frame per send slot");
        assert_eq!(conn.credits_available(), credits - 3, "credits left over");
        // A completed send frees its slot for the next frame.
        complete(&mut conn, WorkKind::Send.wr_id(1), &[]);
        let SendDecision::Encode(reservation) = conn.handle_send(8) else {
            panic!("a freed send slot was not reused")
        };
        assert_eq!(reservation.place, Place::Inline { slot: 1 });
        // The peer may still return credits up to its whole ring.
        complete(&mut conn, WorkKind::Recv.wr_id(0), &credits_returned(3));
        assert_eq!(conn.credits_available(), credits);
        assert_eq!(credits, SLOTS);
        assert_eq!(conn.failure(), None);
        // The control and chunk slots follow the data slots we have.
        for (kind, index) in [(WorkKind::Send, 3), (WorkKind::Control, SLOTS)] {
            let mut conn = Connection::new(Config {
                send_slots: 3,
                ..connection_config()
            });
            complete(&mut conn, kind.wr_id(index), &[]);
            let failure = conn.failure().expect("a slot past ours taken");
            assert!(
                failure.contains("out of range"),
                "{kind:?} {index}: {failure}"
            );
        }
    }

    #[test]
    fn region_frames_in_flight_are_bounded_and_inline_frames_pass_them() {
        // The send queue holds a WRITE for REGION_FRAMES data slots only.
        let slots = 2 * REGION_FRAMES;
        let mut conn = Connection::new(Config {
            peer_ring_slots: slots,
            peer_initial_ring_slots: slots,
            send_slots: slots,
            peer_region_len: 1 << 20,
            ..connection_config()
        })
        .regions_granted();
        let region_frame = 1000;
        let mut slots_held = Vec::new();
        while let SendDecision::Encode(reservation) = conn.handle_send(region_frame) {
            let Place::Region { slot, .. } = reservation.place else {
                panic!("{region_frame} bytes not by the region: {reservation:?}")
            };
            slots_held.push(slot);
            conn.queue_frame(reservation, None).unwrap();
        }
        assert_eq!(slots_held.len(), REGION_FRAMES as usize);
        let writes = std::iter::from_fn(|| conn.poll_transmit())
            .filter(|t| matches!(t, Transmit::Write { .. }))
            .count();
        assert_eq!(writes, REGION_FRAMES as usize);
        // Inline frames still go, from the data slots left.
        let SendDecision::Encode(inline) = conn.handle_send(8) else {
            panic!("an inline frame waited behind the region frames")
        };
        assert!(matches!(inline.place, Place::Inline { .. }));
        conn.queue_frame(inline, None).unwrap();
        let Some(Transmit::Send { kind, slot, .. }) = conn.poll_transmit() else {
            panic!("the inline frame was not sent")
        };
        // Its completion frees no region frame's place.
        complete(&mut conn, kind.wr_id(slot), &[]);
        assert_eq!(conn.handle_send(region_frame), SendDecision::Wait);
        // A region frame's SEND completion does.
        complete(&mut conn, WorkKind::Send.wr_id(slots_held[3]), &[]);
        let SendDecision::Encode(reservation) = conn.handle_send(region_frame) else {
            panic!("a completed region frame's place was not freed")
        };
        let Place::Region { slot, .. } = reservation.place else {
            panic!("not by the region: {reservation:?}")
        };
        assert_eq!(slot, slots_held[3], "the lowest free data slot");
        // As does a cancelled one.
        conn.cancel_send(reservation);
        let SendDecision::Encode(_) = conn.handle_send(region_frame) else {
            panic!("a cancelled region frame's place was not freed")
        };
        assert_eq!(conn.failure(), None);
    }

    #[test]
    fn a_second_completion_of_one_request_fails_the_connection() {
        // A SEND completed twice would free its slot twice.
        let mut conn = connection();
        let SendDecision::Encode(reservation) = conn.handle_send(8) else {
            panic!("no room for an inline frame")
        };
        conn.queue_frame(reservation, None).unwrap();
        let Some(Transmit::Send { kind, slot, .. }) = conn.poll_transmit() else {
            panic!("the frame was not sent")
        };
        complete(&mut conn, kind.wr_id(slot), &[]);
        assert_eq!(conn.failure(), None);
        complete(&mut conn, kind.wr_id(slot), &[]);
        let failure = conn.failure().expect("a second SEND completion was taken");
        assert!(failure.contains("not posted"), "{failure}");

        // A receive slot holding an undelivered frame has no receive posted.
        let mut conn = connection();
        let mut header = Header::new(Kind::Inline);
        header.len = 4;
        let mut bytes = [0; HEADER_LEN];
        header.encode(&mut bytes);
        let arrival = |conn: &mut Connection| {
            conn.handle_completion(Completion {
                wr_id: WorkKind::Recv.wr_id(3),
                failure: None,
                byte_len: HEADER_LEN + 4,
                header: &bytes,
                at: None,
            })
        };
        arrival(&mut conn);
        assert_eq!(conn.failure(), None);
        arrival(&mut conn);
        let failure = conn
            .failure()
            .expect("a receive into a slot not posted was taken");
        assert!(failure.contains("not posted"), "{failure}");
    }

    /// A connection that sent one 100-byte frame through the region, and
    /// the requests it posted for it.
    fn region_frame_posted() -> (Connection, Vec<Transmit>) {
        let mut conn = connection();
        let SendDecision::Encode(reservation) = conn.handle_send(100) else {
            panic!("no room for a region frame")
        };
        conn.queue_frame(reservation, None).unwrap();
        let posted = std::iter::from_fn(|| conn.poll_transmit()).collect();
        (conn, posted)
    }

    #[test]
    fn a_write_completion_fails_the_connection_with_its_reason_or_as_unexpected() {
        // WRITEs go unsignaled: a successful completion for one is a
        // broken verbs layer. Taken, it would count the SEND still in
        // flight as done: the connection would look drained (and its
        // driver stop) too early.
        let (mut conn, posted) = region_frame_posted();
        assert!(
            matches!(posted[..], [Transmit::Write { .. }, Transmit::Send { .. }]),
            "a WRITE, then the SEND that completes after it: {posted:?}"
        );
        assert_eq!(conn.in_flight(), 1, "only the SEND is signaled");
        complete(&mut conn, WorkKind::Write.wr_id(0), &[]);
        let failure = conn
            .failure()
            .expect("a successful WRITE completion was taken");
        assert!(failure.contains("not posted"), "{failure}");

        // A failed one reports why.
        let (mut conn, _) = region_frame_posted();
        conn.handle_completion(Completion {
            wr_id: WorkKind::Write.wr_id(0),
            failure: Some("IBV_WC_REM_ACCESS_ERR (status 10)"),
            byte_len: 0,
            header: &[],
            at: None,
        });
        let failure = conn.failure().expect("a failed WRITE was taken");
        assert!(failure.contains("REM_ACCESS_ERR"), "{failure}");

        // A WRITE's wr_id has index 0; another one is out of range.
        let mut conn = connection();
        complete(&mut conn, WorkKind::Write.wr_id(7), &[]);
        let failure = conn
            .failure()
            .expect("a WRITE completion of index 7 was taken");
        assert!(failure.contains("out of range"), "{failure}");
    }

    #[test]
    fn a_bind_completion_fails_the_connection_with_its_reason_or_as_unexpected() {
        // Binds go unsignaled too, before an announcement's SEND.
        let mut conn = connection();
        complete(&mut conn, WorkKind::Bind.wr_id(0), &[]);
        let failure = conn
            .failure()
            .expect("a successful bind completion was taken");
        assert!(
            failure.contains("Bind") && failure.contains("not posted"),
            "{failure}"
        );

        let mut conn = connection();
        conn.handle_completion(Completion {
            wr_id: WorkKind::Bind.wr_id(0),
            failure: Some("IBV_WC_MW_BIND_ERR (status 6)"),
            byte_len: 0,
            header: &[],
            at: None,
        });
        let failure = conn.failure().expect("a failed bind was taken");
        assert!(failure.contains("MW_BIND_ERR"), "{failure}");
        assert_eq!(conn.in_flight(), 0, "a bind is never counted in flight");
    }

    #[test]
    fn after_the_peers_close_our_own_close_must_go_before_the_connection_is_drained() {
        let mut conn = connection();
        let mut close = [0; HEADER_LEN];
        Header::new(Kind::Close).encode(&mut close);
        complete(&mut conn, WorkKind::Recv.wr_id(0), &close);
        assert_eq!(conn.lifecycle(), &Lifecycle::PeerClosed(OwnClose::No));
        // Half-closed by the peer, we still send, then close.
        let SendDecision::Encode(reservation) = conn.handle_send(8) else {
            panic!("a half-closed peer refused a frame")
        };
        conn.queue_frame(reservation, None).unwrap();
        conn.close();
        assert!(
            !conn.is_drained(),
            "drained with a frame and our Close not yet posted"
        );
        let mut posted = Vec::new();
        while let Some(t) = conn.poll_transmit() {
            posted.push(t);
        }
        assert!(!conn.is_drained(), "drained with sends in flight");
        let mut kinds = Vec::new();
        for t in posted {
            if let Transmit::Send {
                kind, slot, header, ..
            } = t
            {
                kinds.push(header.kind);
                complete(&mut conn, kind.wr_id(slot), &[]);
            }
        }
        assert_eq!(kinds, [Kind::Inline, Kind::Close]);
        assert_eq!(conn.failure(), None);
        assert!(conn.is_drained(), "{}", conn.summary());
    }

    #[test]
    fn bytes_appended_while_credits_are_out_go_in_one_message() {
        /// Sends 4-byte frames until one has to wait for a credit (one is
        /// kept for control messages); returns how many went.
        fn use_up_credits(conn: &mut Connection) -> usize {
            let mut sent = 0;
            while conn.queued() == 0 {
                let SendDecision::Encode(r) = conn.handle_send(4) else {
                    panic!("no room for an inline frame")
                };
                conn.queue_frame(r, None).unwrap();
                while let Some(t) = conn.poll_transmit() {
                    sent += usize::from(matches!(t, Transmit::Send { .. }));
                }
            }
            sent
        }
        let mut conn = connection();
        // Nothing queued: nothing to append to.
        assert_eq!(conn.append_inline(4), None);
        let sent = use_up_credits(&mut conn);
        assert_eq!(conn.queued(), 1, "one frame waits for a credit");
        // Appends fill it up to a slot, then stop.
        let mut total = 4;
        while let Some((_, at)) = conn.append_inline(10) {
            assert_eq!(at, total, "appended after what is there");
            total += 10;
        }
        assert!(total <= 96 - HEADER_LEN && total + 10 > 96 - HEADER_LEN);
        assert_eq!(conn.queued(), 1);
        // A credit comes back: one SEND carries it all.
        complete(&mut conn, WorkKind::Recv.wr_id(0), &credits_returned(1));
        let lens: Vec<_> = std::iter::from_fn(|| conn.poll_transmit())
            .filter_map(|t| match t {
                Transmit::Send { header, .. } if header.kind == Kind::Inline => Some(header.len),
                _ => None,
            })
            .collect();
        assert_eq!(lens, [total as u32], "after {sent} single sends");
        // A posted frame takes no appends.
        assert_eq!(conn.append_inline(1), None);
        // Nor does a side that closed (its Close follows what is queued).
        let mut closed = connection();
        use_up_credits(&mut closed);
        closed.close();
        assert_eq!(closed.append_inline(1), None);
    }

    #[test]
    fn a_probe_sends_one_control_message() {
        let mut conn = connection();
        assert!(
            conn.poll_transmit().is_none(),
            "an idle connection sends nothing"
        );
        conn.probe();
        let Some(Transmit::Send { kind, header, .. }) = conn.poll_transmit() else {
            panic!("the probe sent nothing")
        };
        assert_eq!((kind, header.kind), (WorkKind::Control, Kind::Credit));
        assert!(conn.poll_transmit().is_none(), "one message per probe");
    }

    #[test]
    fn a_peer_freeing_region_space_not_yet_written_breaks_the_protocol() {
        let mut conn = connection();
        // A frame too long to go inline takes region space; queued, not yet sent.
        let SendDecision::Encode(reservation) = conn.handle_send(100) else {
            panic!("no room for a region frame")
        };
        assert!(matches!(
            conn.encode_into(&reservation),
            EncodeInto::Staging { .. }
        ));
        conn.queue_frame(reservation, None).unwrap();
        complete(&mut conn, WorkKind::Recv.wr_id(0), &credit_message(100));
        let failure = conn
            .failure()
            .expect("a free of unwritten space was accepted");
        assert!(failure.contains("beyond"), "{failure}");

        // Once written, freeing it is what an honest peer does.
        let mut conn = connection();
        let SendDecision::Encode(reservation) = conn.handle_send(100) else {
            panic!("no room for a region frame")
        };
        conn.queue_frame(reservation, None).unwrap();
        while conn.poll_transmit().is_some() {}
        complete(&mut conn, WorkKind::Recv.wr_id(0), &credit_message(100));
        assert_eq!(conn.failure(), None);
    }

    /// A header-only message of `kind` from the peer, with `pos` and
    /// `total` as given.
    fn message(kind: Kind, pos: u64, total: u32) -> [u8; HEADER_LEN] {
        let mut header = Header::new(kind);
        header.pos = pos;
        header.total = total;
        header.to_bytes()
    }

    /// The control messages in `posted`.
    fn control_kinds(posted: &[Transmit]) -> Vec<Kind> {
        posted
            .iter()
            .filter_map(|t| match t {
                Transmit::Send {
                    kind: WorkKind::Control,
                    header,
                    ..
                } => Some(header.kind),
                _ => None,
            })
            .collect()
    }

    /// A ring posts its first slots only, and doubles them (up to the whole
    /// ring) each time the peer keeps half of those consumed: registered
    /// first, then posted, then returned to the peer as credits at once (it
    /// may be waiting for them).
    #[test]
    fn the_ring_doubles_when_the_peer_fills_half_its_slots() {
        let grown = |posted: &[Transmit]| -> Vec<(u32, u32)> {
            posted
                .iter()
                .filter_map(|t| match *t {
                    Transmit::RegisterRing { from, to } => Some((from, to)),
                    _ => None,
                })
                .collect()
        };
        let mut conn = Connection::new(Config {
            initial_ring_slots: 4,
            ..connection_config()
        });
        assert_eq!(conn.ring_slots_in_use(), 4);
        // Only the first four are posted: a completion in the fifth is
        // a broken verbs layer.
        let mut other = Connection::new(Config {
            initial_ring_slots: 4,
            ..connection_config()
        });
        complete(&mut other, WorkKind::Recv.wr_id(4), &credit_message(0));
        assert!(other.failure().unwrap().contains("not posted"));

        let inline = |call: u8| {
            let mut h = Header::new(Kind::Inline);
            h.len = 12;
            let mut m = vec![0; HEADER_LEN + 12];
            h.encode((&mut m[..HEADER_LEN]).try_into().unwrap());
            m[HEADER_LEN + 4] = call;
            m
        };
        complete(&mut conn, WorkKind::Recv.wr_id(0), &inline(1));
        let posted: Vec<_> = std::iter::from_fn(|| conn.poll_transmit()).collect();
        assert_eq!(grown(&posted), [], "one of four unanswered");
        complete(&mut conn, WorkKind::Recv.wr_id(1), &inline(2));
        let posted: Vec<_> = std::iter::from_fn(|| conn.poll_transmit()).collect();
        assert_eq!(grown(&posted), [(4, 8)], "{posted:?}");
        assert!(!posted.iter().any(|t| matches!(t, Transmit::Recv { .. })));
        conn.ring_registered();
        let posted: Vec<_> = std::iter::from_fn(|| conn.poll_transmit()).collect();
        let reposted: Vec<_> = posted
            .iter()
            .filter_map(|t| match t {
                Transmit::Recv { slot } => Some(*slot),
                _ => None,
            })
            .collect();
        assert_eq!(reposted, [4, 5, 6, 7]);
        let credits: Vec<_> = posted
            .iter()
            .filter_map(|t| match t {
                Transmit::Send {
                    kind: WorkKind::Control,
                    header,
                    ..
                } if header.kind == Kind::Credit => Some(header.credits),
                _ => None,
            })
            .collect();
        assert_eq!(credits, [4], "the new slots, at once");
        assert_eq!(conn.ring_slots_in_use(), 8);
        // Messages in new slots are taken as any other; four of eight
        // unanswered grow the ring again, to its 12 slots, and no further.
        for slot in 2..4 {
            complete(&mut conn, WorkKind::Recv.wr_id(slot), &inline(3));
        }
        let posted: Vec<_> = std::iter::from_fn(|| conn.poll_transmit()).collect();
        assert_eq!(grown(&posted), [(8, RING_SLOTS)], "{posted:?}");
        conn.ring_registered();
        assert_eq!(conn.ring_slots_in_use(), RING_SLOTS);
        for slot in 4..RING_SLOTS {
            complete(&mut conn, WorkKind::Recv.wr_id(slot), &inline(4));
        }
        let posted: Vec<_> = std::iter::from_fn(|| conn.poll_transmit()).collect();
        assert_eq!(grown(&posted), [], "the whole ring is in use");
        assert_eq!(conn.failure(), None);

        // A ring that could not grow goes on with its first slots, and
        // does not ask again.
        let mut conn = Connection::new(Config {
            initial_ring_slots: 4,
            ..connection_config()
        });
        complete(&mut conn, WorkKind::Recv.wr_id(0), &inline(1));
        complete(&mut conn, WorkKind::Recv.wr_id(1), &inline(2));
        let posted: Vec<_> = std::iter::from_fn(|| conn.poll_transmit()).collect();
        assert_eq!(grown(&posted), [(4, 8)]);
        conn.ring_not_registered();
        complete(&mut conn, WorkKind::Recv.wr_id(2), &inline(3));
        let posted: Vec<_> = std::iter::from_fn(|| conn.poll_transmit()).collect();
        assert_eq!(grown(&posted), [], "{posted:?}");
        assert_eq!(conn.ring_slots_in_use(), 4);
        assert_eq!(conn.failure(), None);
    }

    /// No region exists until a frame needs it: the first frame too large
    /// for a slot asks for the peer's (once, however many wait), the peer
    /// registers its region only then and grants it, and the frames go.
    #[test]
    fn the_first_region_frame_asks_for_the_region_and_waits_for_the_grant() {
        let mut writer = Connection::new(connection_config());
        let mut owner = Connection::new(connection_config());
        assert_eq!(writer.handle_send(100), SendDecision::Wait);
        assert_eq!(writer.handle_send(200), SendDecision::Wait);
        let posted: Vec<_> = std::iter::from_fn(|| writer.poll_transmit()).collect();
        assert_eq!(control_kinds(&posted), [Kind::RegionWanted], "{posted:?}");
        assert_eq!(writer.peer_region(), None);
        // Inline frames do not wait for it.
        assert!(matches!(writer.handle_send(20), SendDecision::Encode(_)));

        // The owner registers its region only when asked.
        assert!(std::iter::from_fn(|| owner.poll_transmit()).all(|t| t != Transmit::RegisterRegion));
        complete(
            &mut owner,
            WorkKind::Recv.wr_id(0),
            &message(Kind::RegionWanted, 0, 0),
        );
        let posted: Vec<_> = std::iter::from_fn(|| owner.poll_transmit()).collect();
        assert!(posted.contains(&Transmit::RegisterRegion), "{posted:?}");
        assert_eq!(control_kinds(&posted), [], "no grant before registration");
        owner.region_registered(0x1000, 77);
        let posted: Vec<_> = std::iter::from_fn(|| owner.poll_transmit()).collect();
        let grant = posted.iter().find_map(|t| match t {
            Transmit::Send { header, .. } if header.kind == Kind::RegionGranted => Some(*header),
            _ => None,
        });
        let grant = grant.unwrap_or_else(|| panic!("no grant in {posted:?}"));
        assert_eq!((grant.pos, grant.total), (0x1000, 77));

        complete(
            &mut writer,
            WorkKind::Recv.wr_id(0),
            &message(Kind::RegionGranted, 0x1000, 77),
        );
        assert_eq!(writer.failure(), None);
        assert_eq!(writer.peer_region(), Some((0x1000, 77)));
        sends_region_frame(&mut writer);
    }

    /// Sends a 100-byte frame through the granted region: it goes at once
    /// (a WRITE is posted); returns what was posted.
    fn sends_region_frame(writer: &mut Connection) -> Vec<Transmit> {
        let SendDecision::Encode(reservation) = writer.handle_send(100) else {
            panic!("the region is granted, yet the region frame waits")
        };
        writer.queue_frame(reservation, None).unwrap();
        let posted: Vec<_> = std::iter::from_fn(|| writer.poll_transmit()).collect();
        assert!(
            posted.iter().any(|t| matches!(t, Transmit::Write { .. })),
            "{posted:?}"
        );
        posted
    }

    /// A writer whose region frames were all consumed gives the region
    /// back when told it is idle (not while a chunk holds any of it, and
    /// not if a region frame comes first); the owner deregisters it; the
    /// next region frame asks for a new one.
    #[test]
    fn an_idle_writer_returns_the_region_and_asks_again_when_needed() {
        let mut writer = Connection::new(connection_config());
        let mut owner = Connection::new(connection_config());
        // The owner here never sees the chunks: `freed_to` is what it
        // would have freed.
        let grant = |writer: &mut Connection, owner: &mut Connection, freed_to: u64| {
            let posted: Vec<_> = std::iter::from_fn(|| writer.poll_transmit()).collect();
            assert_eq!(control_kinds(&posted), [Kind::RegionWanted], "{posted:?}");
            complete(
                owner,
                WorkKind::Recv.wr_id(0),
                &message(Kind::RegionWanted, 0, 0),
            );
            let posted: Vec<_> = std::iter::from_fn(|| owner.poll_transmit()).collect();
            assert!(posted.contains(&Transmit::RegisterRegion), "{posted:?}");
            owner.region_registered(0x1000, 77);
            let posted: Vec<_> = std::iter::from_fn(|| owner.poll_transmit()).collect();
            assert_eq!(control_kinds(&posted), [Kind::RegionGranted], "{posted:?}");
            let mut granted = Header::new(Kind::RegionGranted);
            (granted.pos, granted.total, granted.freed_to) = (0x1000, 77, freed_to);
            complete(writer, WorkKind::Recv.wr_id(0), &granted.to_bytes());
        };
        assert_eq!(writer.handle_send(100), SendDecision::Wait);
        grant(&mut writer, &mut owner, 0);
        sends_region_frame(&mut writer);
        assert!(
            !writer.return_idle_region(),
            "returned with a chunk in the region"
        );

        // The owner consumed the chunk and says so.
        let mut freed = Header::new(Kind::Credit);
        freed.freed_to = 100;
        complete(&mut writer, WorkKind::Recv.wr_id(1), &freed.to_bytes());
        assert_eq!(writer.failure(), None);
        assert_eq!(writer.region_in_use(), 0);
        // A region frame right after the decision keeps the region.
        assert!(writer.return_idle_region());
        let posted = sends_region_frame(&mut writer);
        assert_eq!(control_kinds(&posted), [], "{posted:?}");
        freed.freed_to = 200;
        complete(&mut writer, WorkKind::Recv.wr_id(2), &freed.to_bytes());

        // Idle now: it goes back, and the next region frame asks again.
        assert!(writer.return_idle_region());
        let posted: Vec<_> = std::iter::from_fn(|| writer.poll_transmit()).collect();
        assert_eq!(control_kinds(&posted), [Kind::RegionReturned], "{posted:?}");
        assert_eq!(writer.peer_region(), None);
        complete(
            &mut owner,
            WorkKind::Recv.wr_id(1),
            &message(Kind::RegionReturned, 0, 0),
        );
        let posted: Vec<_> = std::iter::from_fn(|| owner.poll_transmit()).collect();
        assert!(posted.contains(&Transmit::DeregisterRegion), "{posted:?}");
        assert_eq!(writer.handle_send(100), SendDecision::Wait);
        grant(&mut writer, &mut owner, 200);
        assert_eq!((writer.failure(), owner.failure()), (None, None));
        assert_eq!(writer.peer_region(), Some((0x1000, 77)));
    }

    /// A chunked frame being encoded (its place taken, the frame not yet
    /// queued: it is encoded without the connection's lock) keeps the
    /// region: given back then, the frame's WRITEs would have no region
    /// to go to (a device test met it: the verbs layer found no granted
    /// region for a WRITE, and the peer a chunk in a region it had taken
    /// back).
    #[test]
    fn a_chunked_frame_being_encoded_keeps_the_region() {
        let mut writer = Connection::new(connection_config()).regions_granted();
        let len = writer.max_unchunked() + 1;
        let SendDecision::Encode(reservation) = writer.handle_send(len) else {
            panic!("a chunked frame waits with the region granted");
        };
        assert!(
            !writer.return_idle_region(),
            "returned while a chunked frame is encoded"
        );
        let posted: Vec<_> = std::iter::from_fn(|| writer.poll_transmit()).collect();
        assert_eq!(control_kinds(&posted), [], "{posted:?}");
        writer
            .queue_frame(reservation, Some(Bytes::from(vec![7u8; len]).into()))
            .unwrap();
        let posted: Vec<_> = std::iter::from_fn(|| writer.poll_transmit()).collect();
        assert!(
            posted.iter().any(|t| matches!(t, Transmit::Write { .. })),
            "{posted:?}"
        );
        assert_eq!(writer.peer_region(), Some((0, 0)));
    }

    /// A peer's `RingShrinks` is answered with that many `Credit`
    /// messages as credits allow; asking for more than our credits could
    /// ever carry (its whole ring) fails the connection.
    #[test]
    fn a_ring_shrink_is_answered_with_credit_messages_within_the_peers_ring() {
        let cfg = connection_config();
        let mut c = Connection::new(cfg);
        complete(
            &mut c,
            WorkKind::Recv.wr_id(0),
            &message(Kind::RingShrinks, 3, 0),
        );
        assert_eq!(c.failure(), None);
        let posted: Vec<_> = std::iter::from_fn(|| c.poll_transmit()).collect();
        let credits = posted
            .iter()
            .filter(|t| matches!(t, Transmit::Send { header, .. } if header.kind == Kind::Credit))
            .count();
        assert_eq!(credits, 3, "{posted:?}");

        // Those it has no credit for do not hold up the end: once our
        // `Close` went and every send completed, the connection is drained.
        let mut c = Connection::new(cfg);
        complete(
            &mut c,
            WorkKind::Recv.wr_id(0),
            &message(Kind::RingShrinks, cfg.peer_ring_slots.into(), 0),
        );
        c.close();
        let mut closed = false;
        while let Some(t) = c.poll_transmit() {
            if let Transmit::Send {
                kind, slot, header, ..
            } = t
            {
                closed |= header.kind == Kind::Close;
                complete(&mut c, kind.wr_id(slot), &[]);
            }
        }
        assert!(closed && c.credits_available() == 0, "{}", c.summary());
        assert!(c.is_drained(), "{}", c.summary());

        let mut c = Connection::new(cfg);
        let too_many = u64::from(cfg.peer_ring_slots) + 1;
        complete(
            &mut c,
            WorkKind::Recv.wr_id(0),
            &message(Kind::RingShrinks, too_many, 0),
        );
        let failure = c.failure().expect("more messages than the peer's ring");
        assert!(failure.contains("to shrink a ring"), "{failure}");
    }

    /// A region returned that was never granted, or with a chunk in it
    /// not yet consumed, fails the connection: nothing is deregistered
    /// under a chunk still to be read.
    #[test]
    fn a_region_returned_out_of_turn_fails_the_connection() {
        let mut owner = Connection::new(connection_config());
        complete(
            &mut owner,
            WorkKind::Recv.wr_id(0),
            &message(Kind::RegionReturned, 0, 0),
        );
        let failure = owner.failure().expect("an ungranted region returned");
        assert!(failure.contains("did not grant"), "{failure}");

        let mut owner = Connection::new(connection_config());
        complete(
            &mut owner,
            WorkKind::Recv.wr_id(0),
            &message(Kind::RegionWanted, 0, 0),
        );
        while owner.poll_transmit().is_some() {}
        owner.region_registered(0x1000, 77);
        while owner.poll_transmit().is_some() {}
        let mut chunk = Header::new(Kind::Chunk);
        chunk.flags = FIRST | LAST;
        chunk.len = 50;
        chunk.total = 50;
        complete(&mut owner, WorkKind::Recv.wr_id(1), &chunk.to_bytes());
        assert_eq!(owner.failure(), None);
        complete(
            &mut owner,
            WorkKind::Recv.wr_id(2),
            &message(Kind::RegionReturned, 0, 0),
        );
        let failure = owner
            .failure()
            .expect("a region returned with a chunk unread");
        assert!(failure.contains("not yet consumed"), "{failure}");
        let posted: Vec<_> = std::iter::from_fn(|| owner.poll_transmit()).collect();
        assert!(!posted.contains(&Transmit::DeregisterRegion), "{posted:?}");
    }

    /// The grant goes even when the owner's data credits are spent (its
    /// peer may be waiting for the grant before it reads, and so returns
    /// credits): it takes the last credit, as a `Credit` message does.
    #[test]
    fn the_grant_takes_the_last_credit() {
        let mut owner = Connection::new(connection_config());
        while let SendDecision::Encode(reservation) = owner.handle_send(20) {
            owner.queue_frame(reservation, None).unwrap();
            while owner.poll_transmit().is_some() {}
        }
        assert_eq!(owner.credits_available(), 1, "only the last credit left");
        complete(
            &mut owner,
            WorkKind::Recv.wr_id(0),
            &message(Kind::RegionWanted, 0, 0),
        );
        while owner.poll_transmit().is_some() {}
        owner.region_registered(0x1000, 77);
        let posted: Vec<_> = std::iter::from_fn(|| owner.poll_transmit()).collect();
        assert_eq!(control_kinds(&posted), [Kind::RegionGranted], "{posted:?}");
        assert_eq!(owner.credits_available(), 0);
    }

    /// Region messages out of turn fail the connection, saying which.
    #[test]
    fn region_messages_out_of_turn_break_the_protocol() {
        let mut chunk = Header::new(Kind::Chunk);
        chunk.flags = FIRST | LAST;
        chunk.len = 100;
        chunk.total = 100;
        let asked_twice = [
            message(Kind::RegionWanted, 0, 0),
            message(Kind::RegionWanted, 0, 0),
        ];
        for (what, messages, expected) in [
            (
                "a chunk before the grant",
                vec![chunk.to_bytes()],
                "before we granted",
            ),
            ("asked twice", asked_twice.to_vec(), "twice"),
            (
                "a grant unasked",
                vec![message(Kind::RegionGranted, 0x1000, 77)],
                "unasked",
            ),
        ] {
            let mut conn = Connection::new(connection_config());
            for (slot, bytes) in messages.iter().enumerate() {
                complete(&mut conn, WorkKind::Recv.wr_id(slot as u32), bytes);
                while conn.poll_transmit().is_some() {}
                if conn.own_region == OwnRegion::Registering {
                    conn.region_registered(0, 1);
                }
            }
            let failure = conn.failure().unwrap_or_else(|| panic!("{what}: accepted"));
            assert!(failure.contains(expected), "{what}: {failure}");
        }
    }

    /// A chunked frame goes in chunks of at most `HEAP_CHUNK_MAX` (not half
    /// the region), at most `HEAP_SLOTS` of them before a completion, and a
    /// small frame of another call queued behind it goes after its first
    /// chunk: it waits for that much of the tensor in the send queue, not
    /// for all of it. Then the chunks go one at a time for
    /// `INTERLEAVED_CHUNKS`, and `HEAP_SLOTS` at a time again after.
    #[test]
    fn a_chunked_frame_goes_in_small_chunks_that_small_frames_pass() {
        let mut conn = chunking_connection();
        let frame_len = 3 << 20;
        queue_call(&mut conn, frame_len, 1);
        queue_call(&mut conn, 40, 2);
        let mut writes = Vec::new();
        let mut small_after = None;
        let mut posted = Vec::new();
        while let Some(t) = conn.poll_transmit() {
            match t {
                Transmit::Write { len, .. } => writes.push(len),
                Transmit::Send {
                    kind: WorkKind::Send,
                    ..
                } => small_after = Some(writes.len()),
                Transmit::Send {
                    kind: WorkKind::Heap,
                    slot,
                    ..
                } => posted.push(slot),
                _ => {}
            }
        }
        assert_eq!(small_after, Some(1), "the small frame did not pass");
        // Before the small frame, up to `HEAP_SLOTS` chunks could go; once
        // it passed, one at a time.
        assert_eq!(writes, vec![HEAP_CHUNK_MAX]);

        // Each round: the chunks in flight complete and the peer returns
        // their credits; count the chunks that go before the next round.
        let mut per_round = Vec::new();
        let mut ring_slot = 0;
        let mut sent = HEAP_CHUNK_MAX;
        while sent < frame_len {
            let done = posted.len();
            for slot in posted.drain(..) {
                complete(&mut conn, WorkKind::Heap.wr_id(slot), &[]);
            }
            let credits = credits_returned(done as u16);
            complete(&mut conn, WorkKind::Recv.wr_id(ring_slot), &credits);
            ring_slot = (ring_slot + 1) % RING_SLOTS;
            assert_eq!(conn.failure(), None);
            let mut chunks = 0;
            while let Some(t) = conn.poll_transmit() {
                match t {
                    Transmit::Write { len, .. } => sent += len,
                    Transmit::Send {
                        kind: WorkKind::Heap,
                        slot,
                        ..
                    } => {
                        posted.push(slot);
                        chunks += 1;
                    }
                    _ => {}
                }
            }
            per_round.push(chunks);
        }
        // After the small frame, chunks go alone; the last of the
        // `INTERLEAVED_CHUNKS` goes with the next ones.
        let single = INTERLEAVED_CHUNKS as usize - 1;
        assert_eq!(per_round[..single], vec![1; single]);
        let rest = (frame_len / HEAP_CHUNK_MAX - 1 - single) as u32;
        let mut quiet = vec![HEAP_SLOTS; (rest / HEAP_SLOTS) as usize];
        if rest % HEAP_SLOTS > 0 {
            quiet.push(rest % HEAP_SLOTS);
        }
        assert_eq!(per_round[single..], quiet);
    }

    /// Once small frames pass, a chunk carries what the link moved in
    /// `PACED_WAIT`, measured from the chunks before: 64 KiB every 200 µs
    /// is 32 KiB in 100 µs.
    #[test]
    fn paced_chunks_carry_what_the_link_moves_in_the_wait() {
        let mut conn = chunking_connection();
        // The chunks' lengths and slots posted since the last call.
        let chunks = |conn: &mut Connection, posted: &mut VecDeque<u32>| {
            let mut lens = Vec::new();
            while let Some(t) = conn.poll_transmit() {
                match t {
                    Transmit::Write { len, .. } => lens.push(len),
                    Transmit::Send {
                        kind: WorkKind::Heap,
                        slot,
                        ..
                    } => posted.push_back(slot),
                    _ => {}
                }
            }
            lens
        };
        let mut ring_slot = 0;
        let mut complete_oldest = |conn: &mut Connection, posted: &mut VecDeque<u32>, at| {
            let slot = posted.pop_front().expect("a chunk in flight");
            conn.handle_completion(Completion {
                wr_id: WorkKind::Heap.wr_id(slot),
                failure: None,
                byte_len: 0,
                header: &[],
                at: Some(at),
            });
            complete(conn, WorkKind::Recv.wr_id(ring_slot), &credits_returned(1));
            ring_slot = (ring_slot + 1) % RING_SLOTS;
            assert_eq!(conn.failure(), None);
        };

        queue_call(&mut conn, 3 << 20, 1);
        let mut posted = VecDeque::new();
        assert_eq!(chunks(&mut conn, &mut posted), vec![HEAP_CHUNK_MAX; 4]);
        let mut at = Instant::now();
        conn.handle_posted(at);
        // Alone, the chunks go full size whatever the rate: one completes
        // every 200 µs and the next is posted in its place.
        for _ in 0..12 {
            at += Duration::from_micros(200);
            complete_oldest(&mut conn, &mut posted, at);
            assert_eq!(chunks(&mut conn, &mut posted), vec![HEAP_CHUNK_MAX]);
            conn.handle_posted(at);
        }
        queue_call(&mut conn, 40, 2);
        assert_eq!(
            chunks(&mut conn, &mut posted),
            vec![],
            "the small frame passed"
        );
        // The four in flight complete; then one at a time, of 32 KiB (100
        // µs each on the link), until 16 full chunks' worth (1 MiB) went
        // with no frame passing: 32 of them, the last with three full ones.
        for _ in 0..3 {
            at += Duration::from_micros(200);
            complete_oldest(&mut conn, &mut posted, at);
            assert_eq!(chunks(&mut conn, &mut posted), vec![]);
        }
        for i in 0..31 {
            at += Duration::from_micros(if i == 0 { 200 } else { 100 });
            complete_oldest(&mut conn, &mut posted, at);
            assert_eq!(
                chunks(&mut conn, &mut posted),
                vec![32 << 10],
                "paced chunk {i}"
            );
            conn.handle_posted(at);
        }
        at += Duration::from_micros(100);
        complete_oldest(&mut conn, &mut posted, at);
        let full = HEAP_CHUNK_MAX;
        assert_eq!(
            chunks(&mut conn, &mut posted),
            vec![32 << 10, full, full, full]
        );
    }

    /// A request's time on the link runs from its post, or from the
    /// completion before it if that came later, to its completion: requests
    /// pipelined are not counted twice, and the link idle between two
    /// requests is not counted at all.
    #[test]
    fn a_link_rate_counts_the_time_the_link_had_work() {
        let mut rate = LinkRate::default();
        let start = Instant::now();
        let ms = |n: u64| start + Duration::from_millis(n);
        let chunk = 64 << 10;
        // Four posted together, completed in two polls: 2 ms.
        for done in [1, 1, 2, 2] {
            rate.completed(chunk, ms(0), ms(done));
        }
        assert_eq!(
            rate.bytes_in(Duration::from_secs(1)),
            None,
            "not a window yet"
        );
        // A second idle; one posted and completed in 1 ms, three posted on
        // its completion and completed in two more.
        rate.completed(chunk, ms(1000), ms(1001));
        for done in [1002, 1002, 1003] {
            rate.completed(chunk, ms(1001), ms(done));
        }
        // 512 KiB in 5 ms.
        assert_eq!(
            rate.bytes_in(Duration::from_millis(5)),
            Some(512 << 10),
            "{rate:?}"
        );
        // 100 MiB/s moves 10 KiB in `PACED_WAIT`: while small frames pass
        // a request is of `PACED_MIN`, otherwise of the full size.
        let mut pace = Pace {
            rate,
            ..Pace::default()
        };
        assert_eq!(pace.len(HEAP_CHUNK_MAX), HEAP_CHUNK_MAX);
        pace.interleave(1, HEAP_CHUNK_MAX);
        assert_eq!(pace.len(HEAP_CHUNK_MAX), PACED_MIN);
        assert_eq!(pace.len(1000), 1000, "never past the full size");
    }

    // ---- rendezvous ----

    /// A connection taking rendezvous transfers: frames up to 1000 bytes,
    /// a pool of two of them, READs of 300 bytes, two at a time.
    fn rendezvous_connection() -> Connection {
        Connection::new(rendezvous_connection_config())
    }

    fn rendezvous_connection_config() -> Config {
        Config {
            rendezvous: RendezvousConfig {
                threshold: Some(200),
                pool_bytes: 2 * crate::proto::POOL_GRANULE,
                read_chunk: 300,
                read_depth: 2,
                max_outgoing: 2,
                announce_room: 96 - HEADER_LEN,
            },
            ..connection_config()
        }
    }

    fn connection_config() -> Config {
        Config {
            ring_slots: RING_SLOTS,
            initial_ring_slots: RING_SLOTS,
            slot_size: 96,
            region_len: 256,
            peer_ring_slots: SLOTS,
            peer_initial_ring_slots: SLOTS,
            send_slots: SLOTS,
            peer_region_len: 256,
            inline_max: 96 - HEADER_LEN,
            max_frame_len: 1000,
            max_skip_len: 4000,
            prefix_len: 20,
            rendezvous: RendezvousConfig::OFF,
        }
    }

    /// The first bytes of a frame of call `call`.
    fn frame_head(call: u64) -> [u8; crate::proto::ANNOUNCE_PREFIX_LEN] {
        let mut prefix = [0; crate::proto::ANNOUNCE_PREFIX_LEN];
        prefix[4..12].copy_from_slice(&call.to_le_bytes());
        prefix
    }

    /// The peer announces transfer `id` of `len` bytes of call `call` in
    /// receive slot `slot`.
    /// (Its first 32 bytes come with it, the rest lies at 0x1000.)
    fn announce(conn: &mut Connection, slot: u32, id: u64, len: u32, call: u64) {
        let segment = Segment {
            addr: 0x1000,
            rkey: 7,
            len: len - HEAD,
        };
        announce_segments(conn, slot, id, len, call, &[segment]);
    }

    /// The head an announcement carries in these tests.
    const HEAD: u32 = crate::proto::ANNOUNCE_PREFIX_LEN as u32;

    /// The peer announces transfer `id`, a frame of `len` bytes of call
    /// `call`: its first `HEAD` bytes in the announcement, the rest in
    /// `segments`.
    fn announce_segments(
        conn: &mut Connection,
        slot: u32,
        id: u64,
        len: u32,
        call: u64,
        segments: &[Segment],
    ) {
        let mut h = Header::new(Kind::Announce);
        h.len = len;
        h.pos = id;
        let ann = Announcement::new(HEAD as usize, frame_head(call), segments);
        let mut msg = vec![0; HEADER_LEN + ann.encoded_len()];
        h.encode((&mut msg[..HEADER_LEN]).try_into().unwrap());
        ann.encode(&mut msg[HEADER_LEN..]);
        let head_at = HEADER_LEN + ann.head_offset();
        msg[head_at..head_at + HEAD as usize].copy_from_slice(&frame_head(call));
        complete(conn, WorkKind::Recv.wr_id(slot), &msg);
    }

    /// Receive slots holding inline frames, for `poll_delivery`.
    struct Slots(Vec<Vec<u8>>);

    impl ReadReceived for Slots {
        fn read_slot(&self, slot: u32, offset: usize, dst: &mut [u8]) {
            dst.copy_from_slice(&self.0[slot as usize][offset..offset + dst.len()]);
        }
        fn read_region(&self, _: usize, _: &mut [u8]) {
            unreachable!("no region frames here")
        }
    }

    fn transmits(conn: &mut Connection) -> Vec<Transmit> {
        std::iter::from_fn(|| conn.poll_transmit()).collect()
    }

    #[test]
    fn the_decision_pass_runs_again_only_after_an_input() {
        let mut conn = connection();
        let slots = Slots(vec![vec![0; 256]; RING_SLOTS as usize]);
        transmits(&mut conn);
        assert!(conn.settled);
        // A poll with nothing to deliver changes nothing.
        assert_eq!(conn.poll_delivery(&slots), None);
        assert!(
            conn.settled,
            "a poll that delivered nothing unsettled the protocol"
        );
        assert_eq!(conn.poll_transmit(), None);
        // A frame queued is an input: it goes at the next flush.
        let SendDecision::Encode(reservation) = conn.handle_send(8) else {
            panic!("no room for an inline frame")
        };
        conn.queue_frame(reservation, None).unwrap();
        assert!(!conn.settled);
        assert!(matches!(
            transmits(&mut conn)[..],
            [Transmit::Send {
                kind: WorkKind::Send,
                ..
            }]
        ));
        // So is a frame arriving, and the poll that delivers it.
        let mut header = Header::new(Kind::Inline);
        header.len = 8;
        let mut msg = vec![0; HEADER_LEN + 8];
        header.encode((&mut msg[..HEADER_LEN]).try_into().unwrap());
        complete(&mut conn, WorkKind::Recv.wr_id(0), &msg);
        assert!(!conn.settled);
        transmits(&mut conn);
        assert!(matches!(
            conn.poll_delivery(&slots),
            Some(Delivered::InSlot { slot: 0, len: 8 } | Delivered::CopyOut { slot: 0, len: 8 })
        ));
        assert!(!conn.settled);
        assert_eq!(conn.failure(), None);
    }

    #[test]
    fn an_announcement_the_side_cannot_take_fails_the_connection() {
        // Rendezvous off here.
        let mut conn = connection();
        announce(&mut conn, 0, 1, 500, 1);
        assert!(conn.failure().unwrap().contains("takes none"));
        // The same id twice while in flight.
        let mut conn = rendezvous_connection();
        announce(&mut conn, 0, 1, 500, 1);
        assert_eq!(conn.failure(), None);
        announce(&mut conn, 1, 1, 500, 1);
        assert!(conn.failure().unwrap().contains("in flight"));
        // Segments that do not add up to the frame.
        let mut conn = rendezvous_connection();
        let short = Segment {
            addr: 0,
            rkey: 7,
            len: 500 - HEAD - 1,
        };
        announce_segments(&mut conn, 0, 1, 500, 1, &[short]);
        assert!(conn
            .failure()
            .unwrap()
            .contains("head and segments of 499 bytes for a frame of 500"));
        let mut conn = Connection::new(Config {
            slot_size: 256,
            ..rendezvous_connection_config()
        });
        let wraps = Segment {
            addr: 0,
            rkey: 7,
            len: u32::MAX,
        };
        announce_segments(&mut conn, 0, 1, 500, 1, &[wraps, short]);
        assert!(conn.failure().unwrap().contains("for a frame of 500"));
        // Counts that do not fit the message, a segment of nothing.
        let body = |head_len: u32, count: u32, segment_len: u32| {
            let mut h = Header::new(Kind::Announce);
            h.len = 500;
            let mut msg = vec![0; HEADER_LEN + crate::proto::announce_body_len(1, HEAD as usize)];
            h.encode((&mut msg[..HEADER_LEN]).try_into().unwrap());
            msg[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&head_len.to_le_bytes());
            msg[HEADER_LEN + 4..HEADER_LEN + 8].copy_from_slice(&count.to_le_bytes());
            msg[HEADER_LEN + 20..HEADER_LEN + 24].copy_from_slice(&segment_len.to_le_bytes());
            msg
        };
        for (msg, why) in [
            (body(HEAD, 1, 0), "segment of 0 bytes"),
            (body(HEAD, 0, 468), "0 segments"),
            (body(HEAD, 2, 468), "not 2 segments and a head of 32"),
            (body(HEAD + 1, 1, 467), "not 1 segments and a head of 33"),
        ] {
            let mut conn = rendezvous_connection();
            complete(&mut conn, WorkKind::Recv.wr_id(0), &msg);
            let failure = conn.failure().expect("failed");
            assert!(failure.contains(why), "{why}: {failure}");
        }
        let mut conn = rendezvous_connection();
        complete(&mut conn, WorkKind::Recv.wr_id(0), &body(HEAD, 1, 468));
        assert_eq!(conn.failure(), None, "the same, well formed");
    }

    #[test]
    fn reads_of_a_frame_in_segments_stay_within_each_segment() {
        let mut conn = Connection::new(Config {
            slot_size: 256,
            ..rendezvous_connection_config()
        });
        // The head in the announcement (32 bytes), a payload in place
        // (908), small fields after it in a registration of their own (60).
        let segments = [
            Segment {
                addr: 0,
                rkey: 2,
                len: 908,
            },
            Segment {
                addr: 0,
                rkey: 1,
                len: 60,
            },
        ];
        announce_segments(&mut conn, 0, 0, 1000, 1, &segments);
        let mut reads = Vec::new();
        loop {
            for t in transmits(&mut conn) {
                if let Transmit::Read {
                    offset,
                    len,
                    addr,
                    rkey,
                    ..
                } = t
                {
                    reads.push((offset, len, addr, rkey));
                }
            }
            assert!(conn.reads.len() <= 2, "over the read depth");
            let Some(&(s, _, _)) = conn.reads.front() else {
                break;
            };
            complete(&mut conn, WorkKind::Read.wr_id(s), &[]);
        }
        assert_eq!(conn.failure(), None);
        assert_eq!(
            reads,
            [
                (32, 300, 0, 2),
                (332, 300, 300, 2),
                (632, 300, 600, 2),
                (932, 8, 900, 2),
                (940, 60, 0, 1),
            ]
        );
        let slots = Slots(vec![vec![0; 256]; RING_SLOTS as usize]);
        assert_eq!(
            conn.poll_delivery(&slots),
            Some(Delivered::Pooled {
                transfer: 0,
                len: 1000
            })
        );
    }

    #[test]
    fn a_done_for_a_transfer_not_announced_fails_the_connection() {
        let mut conn = rendezvous_connection();
        let mut done = Header::new(Kind::Done);
        done.pos = 5;
        complete(&mut conn, WorkKind::Recv.wr_id(0), &done.to_bytes());
        assert!(conn.failure().unwrap().contains("not announced"));

        // Our own transfer, encoded but not yet announced: not either.
        let mut conn = rendezvous_connection();
        let SendDecision::Encode(r) = conn.handle_send(500) else {
            panic!("no rendezvous")
        };
        let EncodeInto::Rendezvous { transfer, .. } = conn.encode_into(&r) else {
            panic!("not a rendezvous: {:?}", conn.encode_into(&r))
        };
        let mut done = Header::new(Kind::Done);
        done.pos = transfer;
        complete(&mut conn, WorkKind::Recv.wr_id(0), &done.to_bytes());
        assert!(conn.failure().unwrap().contains("not announced"));

        // Announced: its Done releases it, once.
        let mut conn = rendezvous_connection();
        let SendDecision::Encode(r) = conn.handle_send(500) else {
            panic!("no rendezvous")
        };
        let EncodeInto::Rendezvous { transfer, .. } = conn.encode_into(&r) else {
            panic!("not a rendezvous")
        };
        conn.queue_frame(r, None).unwrap();
        let sent = transmits(&mut conn);
        assert!(matches!(
            sent[..],
            [Transmit::Send { header: Header { kind: Kind::Announce, len: 500, pos, .. }, body_len, .. }]
                if pos == transfer && body_len == crate::proto::announce_body_len(1, HEAD as usize)
        ));
        assert!(!conn.is_drained());
        let mut done = Header::new(Kind::Done);
        done.pos = transfer;
        complete(&mut conn, WorkKind::Recv.wr_id(0), &done.to_bytes());
        assert_eq!(conn.failure(), None);
        assert!(transmits(&mut conn).contains(&Transmit::Release { transfer }));
        assert_eq!(conn.transfers_out(), 0);
        complete(&mut conn, WorkKind::Recv.wr_id(1), &done.to_bytes());
        assert!(conn.failure().unwrap().contains("not announced"));
    }

    #[test]
    fn transfers_wait_for_the_pool_and_reads_stay_within_their_depth() {
        let mut conn = rendezvous_connection();
        for id in 0..3 {
            announce(&mut conn, id as u32, id, 1000, 100 + id);
        }
        // Two frames' worth of pool: two destinations, two READs.
        let t = transmits(&mut conn);
        let allocs: Vec<_> = t
            .iter()
            .filter_map(|t| match t {
                Transmit::Alloc { transfer, len, .. } => Some((*transfer, *len)),
                _ => None,
            })
            .collect();
        assert_eq!(allocs, [(0, 1000), (1, 1000)]);
        let reads: Vec<_> = t
            .iter()
            .filter_map(|t| match *t {
                Transmit::Read {
                    transfer,
                    offset,
                    len,
                    addr,
                    rkey,
                    seq,
                } => Some((transfer, offset, len, addr, rkey, seq)),
                _ => None,
            })
            .collect();
        assert_eq!(
            reads,
            [
                (0, 32, 300, 0x1000, 7, 0),
                (0, 332, 300, 0x1000 + 300, 7, 1)
            ]
        );
        // A READ completing out of order is a broken verbs layer.
        let mut broken = rendezvous_connection();
        announce(&mut broken, 0, 0, 1000, 1);
        let _ = transmits(&mut broken);
        complete(&mut broken, WorkKind::Read.wr_id(1), &[]);
        assert!(broken.failure().unwrap().contains("not posted"));
        // Complete every READ: transfers 0 and 1 are read, 2 waits.
        let slots = Slots(vec![vec![0; 96]; RING_SLOTS as usize]);
        // READs 0 and 1 were issued above.
        let mut seq = 2;
        let mut delivered = Vec::new();
        loop {
            // Every READ issued so far completes (in order).
            while let Some(&(s, _, _)) = conn.reads.front() {
                complete(&mut conn, WorkKind::Read.wr_id(s), &[]);
            }
            while let Some(d) = conn.poll_delivery(&slots) {
                delivered.push(d);
            }
            assert_eq!(conn.failure(), None);
            for t in transmits(&mut conn) {
                if let Transmit::Read { seq: s, .. } = t {
                    assert_eq!(s, seq, "READs numbered in order");
                    seq += 1;
                }
            }
            assert!(conn.reads.len() <= 2, "over the read depth");
            if conn.reads.is_empty() {
                break;
            }
        }
        assert_eq!(
            delivered,
            [
                Delivered::Pooled {
                    transfer: 0,
                    len: 1000
                },
                Delivered::Pooled {
                    transfer: 1,
                    len: 1000
                },
            ]
        );
        assert_eq!(conn.transfers_in(), 1, "the third waits for the pool");
        // Dones went for both (each with a data credit, from control slots).
        // The application drops one frame: the third is read.
        conn.handle_pool_released(1000);
        let t = transmits(&mut conn);
        assert!(t.iter().any(|t| matches!(
            t,
            Transmit::Alloc {
                transfer: 2,
                len: 1000,
                ..
            }
        )));
    }

    /// While small frames arrive from the peer, our READs of its transfer
    /// go one in flight, for `INTERLEAVED_READS` more; then the depth again.
    #[test]
    fn reads_go_one_at_a_time_while_small_frames_arrive() {
        let len = 1000 + INTERLEAVED_READS as usize * 300;
        let mut conn = Connection::new(Config {
            max_frame_len: 2 * len,
            rendezvous: RendezvousConfig {
                pool_bytes: 2 * crate::proto::pool_charge(len),
                ..rendezvous_connection_config().rendezvous
            },
            ..rendezvous_connection_config()
        });
        announce(&mut conn, 0, 0, len as u32, 1);
        let reads_posted = |conn: &mut Connection| {
            transmits(conn)
                .iter()
                .filter(|t| matches!(t, Transmit::Read { .. }))
                .count()
        };
        assert_eq!(
            reads_posted(&mut conn),
            2,
            "the depth, before any small frame"
        );
        let mut h = Header::new(Kind::Inline);
        h.len = 20;
        let mut msg = vec![0; HEADER_LEN + 20];
        h.encode((&mut msg[..HEADER_LEN]).try_into().unwrap());
        msg[HEADER_LEN..HEADER_LEN + 12].copy_from_slice(&frame_head(2)[..12]);
        complete(&mut conn, WorkKind::Recv.wr_id(1), &msg);
        // Each round, the READs in flight complete; count the next ones.
        let mut per_round = Vec::new();
        while !conn.reads.is_empty() {
            while let Some(&(s, _, _)) = conn.reads.front() {
                complete(&mut conn, WorkKind::Read.wr_id(s), &[]);
            }
            assert_eq!(conn.failure(), None);
            per_round.push(reads_posted(&mut conn));
        }
        // The last of the `INTERLEAVED_READS` goes with the next one.
        let single = INTERLEAVED_READS as usize - 1;
        assert_eq!(per_round[..single], vec![1; single]);
        // 2 before the small frame and 15 alone: the rest two at a time,
        // then none.
        let reads = (len - HEAD as usize).div_ceil(300);
        let rest = reads - 2 - single;
        let mut depth = vec![2; rest / 2];
        if rest % 2 > 0 {
            depth.push(1);
        }
        depth.push(0);
        assert_eq!(per_round[single..], depth);
    }

    /// Once small frames arrive, a READ carries what the link moved in
    /// `PACED_WAIT`, measured from the READs before: 64 KiB every 200 µs
    /// is 32 KiB in 100 µs.
    #[test]
    fn paced_reads_carry_what_the_link_moves_in_the_wait() {
        let len = 2 << 20;
        let mut conn = Connection::new(Config {
            max_frame_len: 2 * len,
            rendezvous: RendezvousConfig {
                pool_bytes: 2 * crate::proto::pool_charge(len),
                read_chunk: 64 << 10,
                ..rendezvous_connection_config().rendezvous
            },
            ..rendezvous_connection_config()
        });
        announce(&mut conn, 0, 0, len as u32, 1);
        let read_lens = |conn: &mut Connection| -> Vec<usize> {
            let transmits = transmits(conn);
            transmits
                .iter()
                .filter_map(|t| match t {
                    Transmit::Read { len, .. } => Some(*len),
                    _ => None,
                })
                .collect()
        };
        let complete_oldest = |conn: &mut Connection, at| {
            let (seq, _, _) = *conn.reads.front().expect("a READ in flight");
            conn.handle_completion(Completion {
                wr_id: WorkKind::Read.wr_id(seq),
                failure: None,
                byte_len: 0,
                header: &[],
                at: Some(at),
            });
            assert_eq!(conn.failure(), None);
        };
        assert_eq!(read_lens(&mut conn), vec![64 << 10; 2]);
        let mut at = Instant::now();
        conn.handle_posted(at);
        for _ in 0..8 {
            at += Duration::from_micros(200);
            complete_oldest(&mut conn, at);
            assert_eq!(read_lens(&mut conn), vec![64 << 10]);
            conn.handle_posted(at);
        }
        let mut h = Header::new(Kind::Inline);
        h.len = 20;
        let mut msg = vec![0; HEADER_LEN + 20];
        h.encode((&mut msg[..HEADER_LEN]).try_into().unwrap());
        msg[HEADER_LEN..HEADER_LEN + 12].copy_from_slice(&frame_head(2)[..12]);
        complete(&mut conn, WorkKind::Recv.wr_id(1), &msg);
        // The two in flight complete; then one at a time, of 32 KiB.
        at += Duration::from_micros(200);
        complete_oldest(&mut conn, at);
        assert_eq!(read_lens(&mut conn), vec![]);
        for _ in 0..4 {
            at += Duration::from_micros(200);
            complete_oldest(&mut conn, at);
            assert_eq!(read_lens(&mut conn), vec![32 << 10]);
            conn.handle_posted(at);
        }
    }

    #[test]
    fn frames_of_other_calls_pass_a_transfer_being_read_and_those_of_its_call_wait() {
        let mut conn = rendezvous_connection();
        announce(&mut conn, 0, 9, 1000, 1);
        let _ = transmits(&mut conn);
        let mut slots = Slots(vec![vec![0; 96]; RING_SLOTS as usize]);
        // Inline frames of call 2, then call 1, then call 3.
        for (slot, call) in [(1u32, 2u64), (2, 1), (3, 3)] {
            let mut h = Header::new(Kind::Inline);
            h.len = 20;
            let mut msg = vec![0; HEADER_LEN + 20];
            h.encode((&mut msg[..HEADER_LEN]).try_into().unwrap());
            msg[HEADER_LEN..HEADER_LEN + 12].copy_from_slice(&frame_head(call)[..12]);
            slots.0[slot as usize][..msg.len()].copy_from_slice(&msg);
            conn.handle_completion(Completion {
                wr_id: WorkKind::Recv.wr_id(slot),
                failure: None,
                byte_len: msg.len(),
                header: &msg[..HEADER_LEN],
                at: None,
            });
        }
        let first: Vec<_> = std::iter::from_fn(|| conn.poll_delivery(&slots)).collect();
        assert_eq!(
            first,
            [
                Delivered::InSlot { slot: 1, len: 20 },
                Delivered::InSlot { slot: 3, len: 20 },
            ],
            "calls 2 and 3 pass; call 1's frame waits behind its transfer"
        );
        while let Some(&(s, _, _)) = conn.reads.front() {
            complete(&mut conn, WorkKind::Read.wr_id(s), &[]);
            let _ = transmits(&mut conn);
        }
        let rest: Vec<_> = std::iter::from_fn(|| conn.poll_delivery(&slots)).collect();
        assert_eq!(
            rest,
            [
                Delivered::Pooled {
                    transfer: 9,
                    len: 1000
                },
                Delivered::InSlot { slot: 2, len: 20 },
            ]
        );
    }

    #[test]
    fn an_oversized_transfer_is_skipped_unread_and_released_at_once() {
        let mut conn = rendezvous_connection();
        announce(&mut conn, 0, 4, 3000, 1);
        let t = transmits(&mut conn);
        assert!(t
            .iter()
            .all(|t| !matches!(t, Transmit::Alloc { .. } | Transmit::Read { .. })));
        assert!(
            t.iter().any(|t| matches!(
                t,
                Transmit::Send {
                    header: Header {
                        kind: Kind::Done,
                        pos: 4,
                        ..
                    },
                    ..
                }
            )),
            "{t:?}"
        );
        let slots = Slots(vec![vec![0; 96]; RING_SLOTS as usize]);
        assert!(matches!(
            conn.poll_delivery(&slots),
            Some(Delivered::Oversized { len: 3000, .. })
        ));
        // Past the skip limit: the connection fails.
        let mut conn = rendezvous_connection();
        announce(&mut conn, 0, 4, 5000, 1);
        assert_eq!(
            conn.poll_delivery(&slots),
            Some(Delivered::TooLarge { len: 5000 })
        );
        assert!(conn.failure().is_some());
    }
}
