//! The verbs glue: one RC connection's queue pair, registered memory and
//! driver task, and the [`FrameSink`] / [`FrameSource`] over them.
//!
//! All protocol decisions are [`crate::proto`]'s; this module owns the
//! memory, posts the work requests the protocol allows, and turns
//! completions and connection-manager events into protocol inputs.
//!
//! Memory of one connection (all registered with its own protection domain):
//! - `recv`: the receive ring, `ring_slots × slot_size`, local write only,
//!   every slot posted unless its message is being handled or held;
//! - `region`: the large-payload region the peer RDMA-writes into
//!   (local + remote write: the only remotely writable memory);
//! - `send`: send slots (the peer's slot size, one per peer ring slot plus
//!   [`CTRL_SLOTS`] for control messages and [`HEAP_SLOTS`] for the chunks
//!   of heap-encoded frames); small frames are encoded into them;
//! - `staging`: the source of RDMA WRITEs, as large as the peer's region and
//!   at the same offsets; region frames are encoded into it.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rpc_core::frame::OutFrame;
use rpc_core::transport::{
    Connection, FrameLimits, FrameSink, FrameSource, TransportError, OVERSIZED_PREFIX_LEN,
};
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::device_events::{self, Placement, Target};
use crate::proto::{
    self, Assembled, CreditWindow, Delivery, Header, Hello, Kind, Reassembly, RecvRing,
    RegionReader, RegionWriter, Route, FIRST, HEADER_LEN, LAST,
};
use crate::verbs::DeviceId;
use crate::verbs::{
    Access, CmId, CompletionChannel, CompletionQueue, EventChannel, MemoryRegion, ProtectionDomain,
    QpCapabilities, QueuePair, RemoteRegion, WorkCompletion,
};
use crate::RdmaTransport;

/// Send slots reserved for control messages (credits, close).
pub(crate) const CTRL_SLOTS: u32 = 4;
/// Send slots reserved for the chunks of a heap-encoded frame (frames queued
/// behind it may hold every data slot).
pub(crate) const HEAP_SLOTS: u32 = 4;

const TAG_RECV: u64 = 1;
const TAG_SEND: u64 = 2;
const TAG_CTRL: u64 = 3;
const TAG_WRITE: u64 = 4;
const TAG_HEAP: u64 = 5;

fn wr_id(tag: u64, index: u32) -> u64 {
    (tag << 32) | u64::from(index)
}

fn io_error(context: impl Into<String>, e: impl std::fmt::Display) -> TransportError {
    TransportError::io(context, io::Error::other(e.to_string()))
}

/// The queue pair and the memory its work requests use, in the one order
/// they may be destroyed: Rust drops fields in declaration order, so the QP
/// (which may have receives posted into `recv`, and whose peer may know
/// `region`'s rkey) is destroyed before any region is deregistered and
/// freed, on every path that drops this value (set-up errors included).
/// Nothing moves the QP or the memory out of it separately.
struct Wired {
    /// Declared first: destroyed first.
    qp: QueuePair,
    recv: MemoryRegion,
    region: MemoryRegion,
}

/// What a connection set-up produced, before its driver starts (all `Send`).
/// Dropped as a whole on an error before the start: the QP goes first
/// ([`Wired`]), then the memory only the local side uses.
pub(crate) struct Established {
    wired: Wired,
    send: MemoryRegion,
    staging: MemoryRegion,
    cq: CompletionQueue,
    cc: CompletionChannel,
    id: CmId,
    own: Hello,
    peer: Hello,
    peer_addr: String,
}

/// The device objects made before the hello exchange.
struct Half {
    wired: Wired,
    cq: CompletionQueue,
    cc: CompletionChannel,
    pd: ProtectionDomain,
    own: Hello,
}

fn make_half(id: &mut CmId, cfg: &RdmaTransport) -> Result<Half, crate::verbs::Error> {
    let pd = ProtectionDomain::new(id)?;
    let cc = CompletionChannel::new(id)?;
    let max_send_wr = 2 * (cfg.max_peer_ring_slots + HEAP_SLOTS) + CTRL_SLOTS + 4;
    let cq = CompletionQueue::with_channel(id, max_send_wr + cfg.ring_slots + 8, &cc)?;
    let qp = QueuePair::new(
        id,
        &pd,
        &cq,
        &cq,
        QpCapabilities {
            max_send_wr,
            max_recv_wr: cfg.ring_slots + 1,
        },
    )?;
    let slot = cfg.slot_size as usize;
    let recv = MemoryRegion::new(&pd, cfg.ring_slots as usize * slot, Access::LOCAL_WRITE)?;
    let region = MemoryRegion::new(
        &pd,
        cfg.region_len as usize,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    )?;
    let remote = region.remote();
    let own = Hello {
        ring_slots: cfg.ring_slots,
        slot_size: cfg.slot_size,
        region_addr: remote.addr,
        region_rkey: remote.rkey,
        region_len: cfg.region_len,
    };
    // Receives are posted only once the QP and the ring are in one `Wired`:
    // if a post fails, dropping `half` destroys the QP before the ring.
    let mut half = Half {
        wired: Wired { qp, recv, region },
        cq,
        cc,
        pd,
        own,
    };
    let wired = &mut half.wired;
    for i in 0..cfg.ring_slots {
        let start = i as usize * slot;
        // SAFETY: `recv` and the QP live in the same `Wired`, whose field
        // order destroys the QP first (then in `Shared`, likewise); slots
        // are read only after their receive completed and reposted only
        // once released.
        unsafe {
            wired
                .qp
                .post_recv(wr_id(TAG_RECV, i), &wired.recv, start..start + slot)?
        };
    }
    Ok(half)
}

fn finish(
    id: CmId,
    half: Half,
    peer: Hello,
    peer_addr: String,
) -> Result<Established, crate::verbs::Error> {
    let send = MemoryRegion::new(
        &half.pd,
        (peer.ring_slots + CTRL_SLOTS + HEAP_SLOTS) as usize * peer.slot_size as usize,
        Access::LOCAL_WRITE,
    )?;
    let staging = MemoryRegion::new(&half.pd, peer.region_len as usize, Access::LOCAL_WRITE)?;
    Ok(Established {
        wired: half.wired,
        send,
        staging,
        cq: half.cq,
        cc: half.cc,
        id,
        own: half.own,
        peer,
        peer_addr,
    })
}

/// Client side, blocking: resolve, create, connect, exchange hellos.
pub(crate) fn connect_blocking(
    addr: SocketAddr,
    cfg: &RdmaTransport,
) -> Result<Established, TransportError> {
    let ctx = format!("connect to rdma://{addr}");
    let e = |e: crate::verbs::Error| io_error(ctx.clone(), e);
    let channel = EventChannel::new().map_err(e)?;
    let mut id = CmId::new(&channel).map_err(e)?;
    id.resolve(addr, cfg.connect_timeout).map_err(e)?;
    let half = make_half(&mut id, cfg).map_err(e)?;
    let reply = id
        .connect(&half.own.to_bytes(), cfg.connect_timeout)
        .map_err(e)?;
    let peer = Hello::decode(&reply, &cfg.hello_limits()).map_err(|p| {
        let _ = id.disconnect();
        TransportError::Protocol(format!("{ctx}: {p}"))
    })?;
    finish(id, half, peer, format!("rdma://{addr}")).map_err(e)
}

/// Server side, blocking: move the request's id to its own channel,
/// validate the client's hello, create, accept.
pub(crate) fn accept_blocking(
    mut id: CmId,
    private_data: Vec<u8>,
    cfg: &RdmaTransport,
) -> Result<Established, TransportError> {
    let peer_addr = id
        .peer_addr()
        .map_or_else(|| "rdma://?".to_string(), |a| format!("rdma://{a}"));
    let ctx = format!("accept from {peer_addr}");
    let e = |e: crate::verbs::Error| io_error(ctx.clone(), e);
    let channel = EventChannel::new().map_err(e)?;
    id.migrate(&channel).map_err(e)?;
    let peer = match Hello::decode(&private_data, &cfg.hello_limits()) {
        Ok(peer) => peer,
        Err(p) => {
            let _ = id.reject(&[]);
            return Err(TransportError::Protocol(format!("{ctx}: {p}")));
        }
    };
    let half = make_half(&mut id, cfg).map_err(e)?;
    let mut est = finish(id, half, peer, peer_addr).map_err(e)?;
    let own = est.own.to_bytes();
    est.id.accept(&own, cfg.connect_timeout).map_err(e)?;
    Ok(est)
}

/// The completion channel, registered with tokio by its descriptor.
struct CqFd(CompletionChannel);

impl AsRawFd for CqFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.fd()
    }
}

/// The connection's `cm_id`, registered with tokio by its event channel's descriptor.
struct CmFd(CmId);

impl AsRawFd for CmFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.channel().fd()
    }
}

fn register<T: AsRawFd>(inner: T, what: &str) -> Result<AsyncFd<T>, TransportError> {
    // SAFETY: `inner` (a `CqFd` or `CmFd`) owns the object whose open
    // descriptor it returns, always the same one; the AsyncFd owns `inner`,
    // so the descriptor stays open until the AsyncFd is dropped (it
    // deregisters before dropping `inner`).
    unsafe { AsyncFd::register(inner) }
        .map_err(|e| TransportError::io(format!("register the {what}"), e.into_parts().1))
}

/// The connection's registered memory.
struct Buffers {
    recv: MemoryRegion,
    region: MemoryRegion,
    send: MemoryRegion,
    staging: MemoryRegion,
    slot_size: usize,
    peer_slot_size: usize,
    peer_region: RemoteRegion,
}

// SAFETY: `recv`, `send` and `staging` are only accessed through their
// `unsafe` `slice`/`slice_mut`, and each byte range is owned by exactly one
// party at a time, as the protocol state (under the connection's mutex)
// records: the device while posted, the state while being encoded or
// handled, or one `SlotGuard` while the application holds a received frame.
// `region` (remotely writable) is only read, by raw copies under the
// connection's mutex, of chunks the peer's protocol has finished writing (a
// peer that writes anyway changes only the bytes we copy, never memory a
// Rust reference covers). So sharing `&Buffers` between threads races on
// nothing.
unsafe impl Sync for Buffers {}

impl Buffers {
    fn recv_slot(&self, slot: u32) -> Range<usize> {
        let start = slot as usize * self.slot_size;
        start..start + self.slot_size
    }

    fn send_slot(&self, slot: u32) -> Range<usize> {
        let start = slot as usize * self.peer_slot_size;
        start..start + self.peer_slot_size
    }
}

/// One queued outgoing message.
enum Out {
    /// Frame encoded in a send slot after the header space.
    Inline { slot: u32, len: u32 },
    /// Frame encoded in the staging region at `pos`; `slot` carries the header.
    Region { slot: u32, pos: u64, len: u32 },
    /// Frame larger than a chunk, encoded on the heap; sent chunk by chunk.
    Heap { data: Vec<u8>, done: usize },
}

/// A received message not yet handed to the application.
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
    Eof,
}

struct State {
    qp: QueuePair,
    // sending
    credits: CreditWindow,
    writer: RegionWriter,
    queue: VecDeque<Out>,
    free_send: Vec<u32>,
    free_ctrl: Vec<u32>,
    free_heap: Vec<u32>,
    heap_queued: bool,
    send_waiters: Vec<Waker>,
    inline_max: usize,
    in_flight: u32,
    // receiving
    ring: RecvRing,
    reader: RegionReader,
    reassembly: Reassembly,
    arrived: VecDeque<Arrived>,
    recv_waker: Option<Waker>,
    max_frame_len: usize,
    // lifecycle
    failed: Option<String>,
    /// The peer closed in order (sent `Close`), then disconnected.
    disconnected: bool,
    closing: bool,
    close_sent: bool,
    peer_gone: bool,
    handles: u32,
}

struct Shared {
    // Declared before `cq` and `mem`: the QP inside is destroyed first.
    state: Mutex<State>,
    cq: CompletionQueue,
    mem: Buffers,
    released: Mutex<Vec<u32>>,
    wake_task: Notify,
    peer: String,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    fn fail(&mut self, reason: String) {
        if self.failed.is_none() {
            tracing::debug!("RDMA connection failed: {reason}");
            self.failed = Some(reason);
        }
        self.wake_all();
    }

    /// The peer broke the protocol: fail, and drop what it sent (the
    /// region it may still write is not read again).
    fn fail_protocol(&mut self, reason: String) {
        self.arrived.clear();
        self.fail(format!("peer broke the protocol: {reason}"));
    }

    fn wake_all(&mut self) {
        self.wake_senders();
        if let Some(w) = self.recv_waker.take() {
            w.wake();
        }
    }

    fn wake_senders(&mut self) {
        for w in self.send_waiters.drain(..) {
            w.wake();
        }
    }

    fn wait_send(&mut self, cx: &Context<'_>) {
        if !self.send_waiters.iter().any(|w| w.will_wake(cx.waker())) {
            self.send_waiters.push(cx.waker().clone());
        }
    }

    fn error(&self) -> Option<TransportError> {
        self.failed.as_ref().map(|reason| {
            TransportError::io(
                "RDMA connection",
                io::Error::new(io::ErrorKind::ConnectionReset, reason.clone()),
            )
        })
    }

    fn stamp(&mut self, header: &mut Header) {
        header.credits = self.ring.take_credits();
        header.freed_to = self.reader.report();
    }

    fn repost(&mut self, mem: &Buffers, slot: u32) -> Result<(), crate::verbs::Error> {
        // SAFETY: the slot's previous message has been handled and nothing
        // refers to its bytes any more (its guard, if any, was dropped); the
        // memory outlives the QP (see `Shared`).
        unsafe {
            self.qp
                .post_recv(wr_id(TAG_RECV, slot), &mem.recv, mem.recv_slot(slot))
        }
    }

    /// Posts a SEND of `header` (+ `body_len` bytes already in the slot).
    fn post_header(
        &mut self,
        mem: &Buffers,
        tag: u64,
        slot: u32,
        mut header: Header,
        body_len: usize,
    ) -> Result<(), crate::verbs::Error> {
        self.stamp(&mut header);
        let range = mem.send_slot(slot);
        let start = range.start;
        // SAFETY: the slot is owned by this queued message (not posted, no
        // other slice); the header bytes are inside it.
        let dst = unsafe { mem.send.slice_mut(start..start + HEADER_LEN) };
        header.encode(dst.try_into().expect("HEADER_LEN bytes"));
        // SAFETY: the slot stays untouched until its send completion frees
        // it; the memory outlives the QP.
        unsafe {
            self.qp.post_send(
                wr_id(tag, slot),
                &mem.send,
                start..start + HEADER_LEN + body_len,
            )?
        };
        self.in_flight += 1;
        Ok(())
    }

    fn post_write(
        &mut self,
        mem: &Buffers,
        pos: u64,
        len: usize,
    ) -> Result<(), crate::verbs::Error> {
        let off = self.writer.offset(pos);
        // SAFETY: `staging[off..off + len]` holds this chunk, allocated to it
        // until the peer reports it freed (after the WRITE landed); the
        // memory outlives the QP.
        unsafe {
            self.qp.post_write(
                wr_id(TAG_WRITE, 0),
                &mem.staging,
                off..off + len,
                mem.peer_region,
                off as u64,
            )?
        };
        self.in_flight += 1;
        Ok(())
    }

    /// Posts whatever the credits and the peer's free space allow.
    fn pump(&mut self, mem: &Buffers) {
        if self.failed.is_some() {
            return;
        }
        if let Err(e) = self.try_pump(mem) {
            self.fail(format!("posting to the queue pair: {e}"));
        }
    }

    fn try_pump(&mut self, mem: &Buffers) -> Result<(), crate::verbs::Error> {
        while let Some(front) = self.queue.front_mut() {
            match front {
                Out::Inline { slot, len } => {
                    let (slot, len) = (*slot, *len);
                    if !self.credits.take_data() {
                        break;
                    }
                    self.queue.pop_front();
                    let mut h = Header::new(Kind::Inline);
                    h.len = len;
                    self.post_header(mem, TAG_SEND, slot, h, len as usize)?;
                }
                Out::Region { slot, pos, len } => {
                    let (slot, pos, len) = (*slot, *pos, *len);
                    if !self.credits.take_data() {
                        break;
                    }
                    self.queue.pop_front();
                    self.post_write(mem, pos, len as usize)?;
                    let mut h = Header::new(Kind::Chunk);
                    h.flags = FIRST | LAST;
                    h.len = len;
                    h.total = len;
                    h.pos = pos;
                    self.post_header(mem, TAG_SEND, slot, h, 0)?;
                }
                Out::Heap { data, done } => {
                    if self.credits.available() < 2 || self.free_heap.is_empty() {
                        break;
                    }
                    let n = (data.len() - *done).min(self.writer.max_chunk() as usize);
                    let Some(pos) = self.writer.alloc(n as u64) else {
                        break;
                    };
                    let slot = self.free_heap.pop().expect("checked above");
                    let took = self.credits.take_data();
                    debug_assert!(took, "checked above");
                    let off = self.writer.offset(pos);
                    // SAFETY: just allocated: no posted WRITE uses these
                    // bytes (the peer freed them, so earlier WRITEs landed),
                    // and no other slice covers them.
                    let dst = unsafe { mem.staging.slice_mut(off..off + n) };
                    dst.copy_from_slice(&data[*done..*done + n]);
                    let mut h = Header::new(Kind::Chunk);
                    h.len = n as u32;
                    h.pos = pos;
                    if *done == 0 {
                        h.flags |= FIRST;
                        h.total = data.len() as u32;
                    }
                    *done += n;
                    let last = *done == data.len();
                    if last {
                        h.flags |= LAST;
                        self.queue.pop_front();
                        self.heap_queued = false;
                        self.wake_senders();
                    }
                    self.post_write(mem, pos, n)?;
                    self.post_header(mem, TAG_HEAP, slot, h, 0)?;
                }
            }
        }
        if let Some(&slot) = self.free_ctrl.last() {
            let kind = if self.closing && self.queue.is_empty() && !self.close_sent {
                Some(Kind::Close)
            } else if self.ring.wants_credit_message() || self.reader.wants_report() {
                Some(Kind::Credit)
            } else {
                None
            };
            if let Some(kind) = kind {
                if self.credits.take_control() {
                    self.free_ctrl.pop();
                    if kind == Kind::Close {
                        self.close_sent = true;
                    }
                    self.post_header(mem, TAG_CTRL, slot, Header::new(kind), 0)?;
                }
            }
        }
        Ok(())
    }

    /// Handles every completion waiting in the CQ, then posts what they
    /// allow; returns how many. Polled under the state lock, so completions
    /// are handled in the device's order whoever polls (the driver, or a
    /// receiver looking for its next frame).
    fn drain_cq(&mut self, cq: &CompletionQueue, mem: &Buffers) -> usize {
        let mut batch = [WorkCompletion::default(); 32];
        let mut total = 0;
        loop {
            let n = match cq.poll_batch(&mut batch) {
                Ok(n) => n,
                Err(e) => {
                    self.fail(format!("polling the completion queue: {e}"));
                    return total;
                }
            };
            total += n;
            for wc in &batch[..n] {
                self.on_completion(mem, wc);
            }
            if n < batch.len() {
                if total > 0 {
                    self.pump(mem);
                }
                return total;
            }
        }
    }

    /// A receive completed in `slot` with `byte_len` bytes.
    fn on_receive(&mut self, mem: &Buffers, slot: u32, byte_len: usize) -> Result<(), String> {
        let range = mem.recv_slot(slot);
        if byte_len > range.len() {
            return Err(format!("receive of {byte_len} bytes in a smaller slot"));
        }
        // SAFETY: the slot's receive completed, so the device no longer
        // writes it, and it is not reposted while this slice lives.
        let msg = unsafe { mem.recv.slice(range.start..range.start + byte_len) };
        let header = Header::decode(msg, byte_len).map_err(|e| e.to_string())?;
        self.ring.on_arrival().map_err(|e| e.to_string())?;
        self.credits
            .grant(header.credits)
            .map_err(|e| e.to_string())?;
        self.writer
            .on_freed(header.freed_to)
            .map_err(|e| e.to_string())?;
        self.wake_senders();
        match header.kind {
            Kind::Inline => {
                self.arrived.push_back(Arrived::Inline {
                    slot,
                    len: header.len,
                });
            }
            Kind::Chunk => {
                let offset = self
                    .reader
                    .accept(header.pos, header.len.into())
                    .map_err(|e| e.to_string())?;
                self.arrived.push_back(Arrived::Chunk {
                    slot,
                    header,
                    offset,
                });
            }
            Kind::Credit | Kind::Close => {
                self.repost(mem, slot).map_err(|e| e.to_string())?;
                self.ring.on_reposted();
                if header.kind == Kind::Close {
                    self.arrived.push_back(Arrived::Eof);
                    self.peer_gone = true;
                }
            }
        }
        if let Some(w) = self.recv_waker.take() {
            w.wake();
        }
        Ok(())
    }

    fn on_completion(&mut self, mem: &Buffers, wc: &WorkCompletion) {
        let tag = wc.wr_id >> 32;
        let index = wc.wr_id as u32;
        if tag != TAG_RECV {
            self.in_flight = self.in_flight.saturating_sub(1);
        }
        if self.failed.is_some() {
            return;
        }
        if !wc.is_ok() {
            if self.failed.is_none() {
                self.fail(format!(
                    "work request failed: {} (status {})",
                    wc.status_name(),
                    wc.status
                ));
            }
            return;
        }
        match tag {
            TAG_RECV => {
                if let Err(e) = self.on_receive(mem, index, wc.byte_len as usize) {
                    self.fail_protocol(e);
                }
            }
            TAG_SEND => {
                self.free_send.push(index);
                self.wake_senders();
            }
            TAG_CTRL => self.free_ctrl.push(index),
            TAG_HEAP => self.free_heap.push(index),
            _ => {}
        }
    }
}

/// Returns a receive slot when the application drops the frame in it.
struct SlotGuard {
    shared: Arc<Shared>,
    slot: u32,
    range: Range<usize>,
}

impl AsRef<[u8]> for SlotGuard {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the slot's receive completed and it is reposted only after
        // this guard drops; nothing writes it meanwhile.
        unsafe { self.shared.mem.recv.slice(self.range.clone()) }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.shared
            .released
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.slot);
        self.shared.wake_task.notify_one();
    }
}

struct RdmaSink {
    shared: Arc<Shared>,
}

/// Gives back the send slot (and the region space) a frame was given if
/// encoding it into registered memory panics (a payload's encoder may);
/// [`encoded`](Self::encoded) disarms it. Held while the connection's lock
/// is: the space is the region writer's newest allocation (see `poll_send`).
struct ReturnOnUnwind<'a> {
    state: &'a mut State,
    slot: u32,
    /// The region writer's head before the frame's allocation, if it has one.
    region_head: Option<u64>,
}

impl ReturnOnUnwind<'_> {
    /// The frame was encoded: it keeps what it was given.
    fn encoded(self) {
        std::mem::forget(self);
    }
}

impl Drop for ReturnOnUnwind<'_> {
    fn drop(&mut self) {
        self.state.free_send.push(self.slot);
        if let Some(head) = self.region_head {
            self.state.writer.roll_back_to(head);
        }
        self.state.wake_senders();
    }
}

/// Gives back the heap frame's place (`heap_queued`) if encoding a frame
/// onto the heap, outside the lock, panics; forgotten once it is encoded.
struct ReleaseHeapOnUnwind<'a>(&'a Shared);

impl Drop for ReleaseHeapOnUnwind<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.heap_queued = false;
        st.wake_senders();
    }
}

impl FrameSink for RdmaSink {
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        frame: &OutFrame<'_>,
    ) -> Poll<Result<(), TransportError>> {
        let shared = &*self.shared;
        let mem = &shared.mem;
        let mut st = shared.lock();
        if let Some(e) = st.error() {
            return Poll::Ready(Err(e));
        }
        if st.closing || st.peer_gone {
            return Poll::Ready(Err(TransportError::Closed));
        }
        let len = frame.len();
        if u32::try_from(len).is_err() {
            return Poll::Ready(Err(TransportError::Protocol(format!(
                "frame of {len} bytes is too long for the RDMA transport"
            ))));
        }
        let max_chunk = st.writer.max_chunk() as usize;
        match proto::route(len, st.inline_max, max_chunk) {
            Route::Inline => {
                let Some(slot) = st.free_send.pop() else {
                    st.wait_send(cx);
                    return Poll::Pending;
                };
                let start = mem.send_slot(slot).start + HEADER_LEN;
                // SAFETY: the slot was free: no posted send and no other
                // slice covers it; it is inside the send region (len fits a
                // slot after the header: len <= inline_max).
                let mut dst = unsafe { mem.send.slice_mut(start..start + len) };
                let encoding = ReturnOnUnwind {
                    state: &mut st,
                    slot,
                    region_head: None,
                };
                frame.encode(&mut dst);
                encoding.encoded();
                st.queue.push_back(Out::Inline {
                    slot,
                    len: len as u32,
                });
            }
            Route::Region => {
                if st.heap_queued {
                    st.wait_send(cx);
                    return Poll::Pending;
                }
                let Some(slot) = st.free_send.pop() else {
                    st.wait_send(cx);
                    return Poll::Pending;
                };
                let head_before = st.writer.head();
                let Some(pos) = st.writer.alloc(len as u64) else {
                    st.free_send.push(slot);
                    st.wait_send(cx);
                    return Poll::Pending;
                };
                let off = st.writer.offset(pos);
                // SAFETY: just allocated in the staging region: no posted
                // WRITE reads it (the peer freed it) and no other slice.
                let mut dst = unsafe { mem.staging.slice_mut(off..off + len) };
                // The lock is held from the allocation to the end of the
                // encoding, so this allocation is still the writer's newest
                // and nothing was announced beyond `head_before`: rolling
                // back to it on a panic is exact.
                let encoding = ReturnOnUnwind {
                    state: &mut st,
                    slot,
                    region_head: Some(head_before),
                };
                frame.encode(&mut dst);
                encoding.encoded();
                st.queue.push_back(Out::Region {
                    slot,
                    pos,
                    len: len as u32,
                });
            }
            Route::Chunked => {
                if st.heap_queued {
                    st.wait_send(cx);
                    return Poll::Pending;
                }
                // Reserve the one heap frame's place, then encode (up to
                // the frame limit, 64 MiB) without the connection's lock:
                // completions, receivers and other senders go on meanwhile.
                st.heap_queued = true;
                drop(st);
                let encoding = ReleaseHeapOnUnwind(shared);
                let mut data = Vec::with_capacity(len);
                frame.encode(&mut data);
                std::mem::forget(encoding);
                let mut st = shared.lock();
                let gone = if let Some(e) = st.error() {
                    Some(e)
                } else if st.closing || st.peer_gone {
                    Some(TransportError::Closed)
                } else {
                    None
                };
                if let Some(e) = gone {
                    st.heap_queued = false;
                    st.wake_senders();
                    return Poll::Ready(Err(e));
                }
                st.queue.push_back(Out::Heap { data, done: 0 });
                st.pump(mem);
                return Poll::Ready(Ok(()));
            }
        }
        st.pump(mem);
        Poll::Ready(Ok(()))
    }

    fn close(&self) {
        let mut st = self.shared.lock();
        if !st.closing {
            st.closing = true;
            // Senders waiting for credits or room fail now, as later ones do.
            st.wake_senders();
            st.pump(&self.shared.mem);
        }
    }
}

impl Drop for RdmaSink {
    fn drop(&mut self) {
        self.close();
        self.shared.lock().handles -= 1;
        self.shared.wake_task.notify_one();
    }
}

struct RdmaSource {
    shared: Arc<Shared>,
    spin: BusyPoll,
}

impl FrameSource for RdmaSource {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, TransportError>> {
        let shared = &self.shared;
        let mem = &shared.mem;
        let mut st = shared.lock();
        let result = loop {
            // Frames that arrived before a failure are still delivered (a
            // protocol violation drops them); then the error.
            let Some(arrived) = st.arrived.pop_front() else {
                if let Some(e) = st.error() {
                    break Err(e);
                }
                // Look in the CQ before waiting for the driver: a frame
                // that is already there is not delayed by a wake-up (and
                // this task does not wake itself for it).
                st.recv_waker = None;
                if st.drain_cq(&shared.cq, mem) > 0 {
                    continue;
                }
                st.recv_waker = Some(cx.waker().clone());
                // Return what the chunks handled above freed.
                st.pump(mem);
                drop(st);
                if self.spin.keep_polling() {
                    cx.waker().wake_by_ref();
                }
                return Poll::Pending;
            };
            match arrived {
                Arrived::Eof => {
                    st.arrived.push_front(Arrived::Eof);
                    break Ok(None);
                }
                Arrived::Inline { slot, len } => {
                    if st.reassembly.in_frame() {
                        st.fail_protocol("inline frame inside a chunked one".into());
                        continue;
                    }
                    let start = mem.recv_slot(slot).start + HEADER_LEN;
                    let range = start..start + len as usize;
                    // SAFETY: the slot's receive completed; it is reposted
                    // only below, after this slice's last use, or when its
                    // guard drops.
                    let data = unsafe { mem.recv.slice(range.clone()) };
                    if let Some(verdict) = st.reassembly.check_len(len as usize, data) {
                        let error = oversized(verdict, st.max_frame_len);
                        if let TransportError::FrameTooLarge { .. } = error {
                            st.fail(error.to_string());
                        }
                        if let Err(e) = st.repost(mem, slot) {
                            st.fail(format!("reposting a receive: {e}"));
                        }
                        st.ring.on_reposted();
                        break Err(error);
                    }
                    let bytes = match st.ring.deliver() {
                        Delivery::ZeroCopy => Bytes::from_owner(SlotGuard {
                            shared: Arc::clone(shared),
                            slot,
                            range,
                        }),
                        Delivery::Copy => {
                            let bytes = Bytes::copy_from_slice(data);
                            if let Err(e) = st.repost(mem, slot) {
                                st.fail(format!("reposting a receive: {e}"));
                            }
                            st.ring.on_reposted();
                            bytes
                        }
                    };
                    break Ok(Some(bytes));
                }
                Arrived::Chunk {
                    slot,
                    header,
                    offset,
                } => {
                    // The region is remotely writable: its bytes are read
                    // by raw copies, never borrowed as a slice. The peer's
                    // WRITE landed before its SEND, and it writes there
                    // again only after we report the space freed (below,
                    // after the copy).
                    let region = &mem.region;
                    let out = st.reassembly.chunk_from(
                        header.flags,
                        header.total,
                        header.len as usize,
                        |from, dst| region.read_into(offset + from, dst),
                    );
                    st.reader.free_through(header.pos + u64::from(header.len));
                    if let Err(e) = st.repost(mem, slot) {
                        st.fail(format!("reposting a receive: {e}"));
                    }
                    st.ring.on_reposted();
                    match out {
                        Err(e) => st.fail_protocol(e.to_string()),
                        Ok(None) => {}
                        Ok(Some(Assembled::Frame(v))) => break Ok(Some(Bytes::from(v))),
                        Ok(Some(verdict @ Assembled::TooLarge { .. })) => {
                            let error = oversized(verdict, st.max_frame_len);
                            st.fail(error.to_string());
                            break Err(error);
                        }
                        Ok(Some(verdict)) => break Err(oversized(verdict, st.max_frame_len)),
                    }
                }
            }
        };
        st.pump(mem);
        drop(st);
        self.spin.reset();
        Poll::Ready(result)
    }
}

/// The receiver's busy-poll window ([`RdmaTransport::busy_poll`]): after
/// the last frame, for `window`, a receiver that finds nothing asks to be
/// polled again at once (letting the runtime's other tasks run in between)
/// instead of waiting for the completion channel's event.
struct BusyPoll {
    window: Option<Duration>,
    idle_since: Option<Instant>,
    polls: u32,
}

impl BusyPoll {
    fn new(window: Option<Duration>) -> Self {
        Self {
            window,
            idle_since: None,
            polls: 0,
        }
    }

    /// Whether to poll again rather than wait for an event.
    fn keep_polling(&mut self) -> bool {
        let Some(window) = self.window else {
            return false;
        };
        // Reading the clock can be a system call (it is in an emulated
        // guest): look at it every few polls only.
        self.polls = self.polls.wrapping_add(1);
        let since = *self.idle_since.get_or_insert_with(Instant::now);
        self.polls % 16 != 0 || since.elapsed() < window
    }

    fn reset(&mut self) {
        self.idle_since = None;
        self.polls = 0;
    }
}

fn oversized(verdict: Assembled, max: usize) -> TransportError {
    match verdict {
        Assembled::Oversized { len, prefix } => TransportError::Oversized {
            len,
            max,
            prefix: Bytes::from(prefix),
        },
        Assembled::TooLarge { len } => TransportError::FrameTooLarge { len, max },
        Assembled::Frame(_) => unreachable!("not a verdict"),
    }
}

impl Drop for RdmaSource {
    fn drop(&mut self) {
        self.shared.lock().handles -= 1;
        self.shared.wake_task.notify_one();
    }
}

/// Every connection started, with where it sits on its device (for
/// [`fail_on_device`]); dead entries are swept at each start.
static LIVE: Mutex<Vec<(std::sync::Weak<Shared>, Placement)>> = Mutex::new(Vec::new());

/// Fails the live connections on `device` that `target` names (an async
/// event's, see [`crate::device_events`]); returns how many were not failed
/// yet.
pub(crate) fn fail_on_device(device: DeviceId, target: Target, reason: &str) -> usize {
    let hit: Vec<Arc<Shared>> = LIVE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(_, placement)| placement.is_hit(device, target))
        .filter_map(|(shared, _)| shared.upgrade())
        .collect();
    let mut failed = 0;
    for shared in &hit {
        let mut st = shared.lock();
        if st.failed.is_none() {
            failed += 1;
            st.fail(reason.to_string());
        }
        drop(st);
        // The driver disconnects and ends.
        shared.wake_task.notify_one();
    }
    failed
}

/// A summary of every live connection's protocol state, for debugging stalls.
pub(crate) fn debug_dump() -> String {
    let live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = String::new();
    for shared in live.iter().filter_map(|(shared, _)| shared.upgrade()) {
        let st = shared.lock();
        out += &format!(
            "{}: credits {} queue {} (front {}) free_send {} free_ctrl {} free_heap {} heap_queued {} \
             in_flight {} writer_in_use {} | ring held {} outstanding {} pending {} arrived {} \
             reader_wants_report {} | failed {:?} closing {} close_sent {} peer_gone {} handles {} released {}\n",
            shared.peer,
            st.credits.available(),
            st.queue.len(),
            match st.queue.front() {
                None => "-",
                Some(Out::Inline { .. }) => "inline",
                Some(Out::Region { .. }) => "region",
                Some(Out::Heap { .. }) => "heap",
            },
            st.free_send.len(),
            st.free_ctrl.len(),
            st.free_heap.len(),
            st.heap_queued,
            st.in_flight,
            st.writer.in_use(),
            st.ring.held(),
            st.ring.outstanding(),
            st.ring.pending(),
            st.arrived.len(),
            st.reader.wants_report(),
            st.failed,
            st.closing,
            st.close_sent,
            st.peer_gone,
            st.handles,
            shared.released.lock().map(|r| r.len()).unwrap_or(0),
        );
    }
    out
}

impl Established {
    /// Moves the connection's objects into its shared state (the QP into
    /// the state, the memory after it: see [`Shared`]); returns what the
    /// driver registers with tokio. Infallible, so nothing is dropped
    /// half-moved.
    fn into_shared(
        self,
        limits: FrameLimits,
        cfg: &RdmaTransport,
    ) -> (Arc<Shared>, CmId, CompletionChannel) {
        let Established {
            wired: Wired { qp, recv, region },
            send,
            staging,
            cq,
            cc,
            id,
            own,
            peer,
            peer_addr,
        } = self;
        let inline_max = cfg
            .inline_threshold
            .min(peer.slot_size as usize - HEADER_LEN);
        let reassembly = Reassembly::new(
            limits.max_frame_len,
            limits.max_skip_len(),
            OVERSIZED_PREFIX_LEN,
        );
        let state = State {
            qp,
            credits: CreditWindow::new(peer.ring_slots),
            writer: RegionWriter::new(peer.region_len.into()),
            queue: VecDeque::new(),
            free_send: (0..peer.ring_slots).rev().collect(),
            free_ctrl: (peer.ring_slots..peer.ring_slots + CTRL_SLOTS).collect(),
            free_heap: (peer.ring_slots + CTRL_SLOTS..peer.ring_slots + CTRL_SLOTS + HEAP_SLOTS)
                .collect(),
            heap_queued: false,
            send_waiters: Vec::new(),
            inline_max,
            in_flight: 0,
            ring: RecvRing::new(own.ring_slots),
            reader: RegionReader::new(own.region_len.into()),
            reassembly,
            arrived: VecDeque::new(),
            recv_waker: None,
            max_frame_len: limits.max_frame_len,
            failed: None,
            disconnected: false,
            closing: false,
            close_sent: false,
            peer_gone: false,
            handles: 2,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            mem: Buffers {
                recv,
                region,
                send,
                staging,
                slot_size: own.slot_size as usize,
                peer_slot_size: peer.slot_size as usize,
                peer_region: RemoteRegion {
                    addr: peer.region_addr,
                    rkey: peer.region_rkey,
                    len: peer.region_len.into(),
                },
            },
            cq,
            released: Mutex::new(Vec::new()),
            wake_task: Notify::new(),
            peer: peer_addr,
        });
        (shared, id, cc)
    }
}

/// Starts the driver task of an established connection and returns its halves.
pub(crate) fn start(
    est: Established,
    limits: FrameLimits,
    cfg: &RdmaTransport,
) -> Result<Connection, TransportError> {
    let placement = Placement::of(&est.id, &est.wired.qp, &est.cq)
        .map_err(|e| io_error("find the connection's device objects", e))?;
    // From here on the QP and the memory live in `Shared` (QP first), so
    // an error below drops them in that order.
    let (shared, id, cc) = est.into_shared(limits, cfg);
    let cq_fd = register(CqFd(cc), "completion channel")?;
    let cm_fd = register(CmFd(id), "connection manager channel")?;
    let peer_addr = shared.peer.clone();
    {
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|(w, _)| w.strong_count() > 0);
        live.push((Arc::downgrade(&shared), placement));
    }
    // After the connection is in `LIVE`: a starting watcher acts on the
    // events that queued before it, this connection's included.
    let device_watch = device_events::watch(&cm_fd.get_ref().0)?;
    shared
        .cq
        .arm()
        .map_err(|e| io_error("arm the completion queue", e))?;
    tokio::spawn(drive(
        Arc::clone(&shared),
        Driver {
            cq_fd,
            cm_fd,
            _device_watch: device_watch,
        },
    ));
    Ok(Connection {
        sink: Arc::new(RdmaSink {
            shared: Arc::clone(&shared),
        }),
        source: Box::new(RdmaSource {
            shared,
            spin: BusyPoll::new(cfg.busy_poll),
        }),
        peer: peer_addr,
    })
}

struct Driver {
    cq_fd: AsyncFd<CqFd>,
    cm_fd: AsyncFd<CmFd>,
    /// Keeps the device's async-event watcher running while the driver does.
    _device_watch: device_events::WatchLease,
}

/// Handles every completion waiting in the CQ; returns how many.
fn drain_cq(shared: &Shared) -> usize {
    shared.lock().drain_cq(&shared.cq, &shared.mem)
}

/// Reposts the slots the application released.
fn repost_released(shared: &Shared) {
    let released = std::mem::take(&mut *shared.released.lock().unwrap_or_else(|e| e.into_inner()));
    if released.is_empty() {
        return;
    }
    let mut st = shared.lock();
    for slot in released {
        if st.failed.is_some() {
            break;
        }
        if let Err(e) = st.repost(&shared.mem, slot) {
            st.fail(format!("reposting a receive: {e}"));
            break;
        }
        st.ring.on_released();
    }
    st.pump(&shared.mem);
}

/// The connection's driver: completions, connection-manager events,
/// released slots; ends when the connection failed or both halves are
/// dropped and everything was sent.
async fn drive(shared: Arc<Shared>, mut d: Driver) {
    let mut linger_since: Option<Instant> = None;
    loop {
        drain_cq(&shared);
        repost_released(&shared);
        {
            let st = shared.lock();
            if st.failed.is_some() || (st.disconnected && st.handles == 0) {
                break;
            }
            if st.handles == 0 {
                let done =
                    (st.close_sent || st.peer_gone) && st.queue.is_empty() && st.in_flight == 0;
                let since = *linger_since.get_or_insert_with(Instant::now);
                if done || since.elapsed() > Duration::from_secs(5) {
                    break;
                }
            }
        }
        let linger = async {
            if linger_since.is_some() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            ready = d.cq_fd.readable() => {
                match ready {
                    Ok(mut guard) => guard.clear_ready(),
                    Err(e) => { shared.lock().fail(format!("waiting for completions: {e}")); continue; }
                }
                loop {
                    match d.cq_fd.get_ref().0.try_take_event() {
                        Ok(true) => {}
                        Ok(false) => break,
                        Err(e) => { shared.lock().fail(format!("reading the completion channel: {e}")); break; }
                    }
                }
                if let Err(e) = shared.cq.arm() {
                    shared.lock().fail(format!("arming the completion queue: {e}"));
                }
            }
            ready = d.cm_fd.readable() => {
                match ready {
                    Ok(mut guard) => guard.clear_ready(),
                    Err(e) => { shared.lock().fail(format!("waiting for CM events: {e}")); continue; }
                }
                loop {
                    match d.cm_fd.get_ref().0.channel().try_event() {
                        Ok(Some(event)) if event.ends_connection() => {
                            // What the peer sent before it went is in the CQ:
                            // take it first (its `Close`, its last frames).
                            drain_cq(&shared);
                            let mut st = shared.lock();
                            if st.peer_gone {
                                // Orderly: the peer said Close first; what
                                // arrived before it is still delivered.
                                st.disconnected = true;
                                st.wake_all();
                            } else {
                                st.fail(format!("{}: {}", shared.peer, event.name()));
                            }
                        }
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(e) => { shared.lock().fail(format!("reading CM events: {e}")); break; }
                    }
                }
            }
            () = shared.wake_task.notified() => {}
            () = linger => {}
        }
    }
    let _ = d.cm_fd.get_mut().0.disconnect();
    // Wake whoever waits: they see the failure (or the end).
    shared.lock().wake_all();
}
