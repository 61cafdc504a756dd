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
    self, Completion, Delivered, EncodeInto, Hello, ReadReceived, Refusal, Reservation,
    SendDecision, Transmit, WorkKind, CTRL_SLOTS, HEADER_LEN, HEAP_SLOTS,
};
use crate::verbs::DeviceId;
use crate::verbs::{
    Access, CmId, CompletionChannel, CompletionQueue, EventChannel, MemoryRegion, ProtectionDomain,
    QpCapabilities, QueuePair, RemoteRegion, WorkCompletion,
};
use crate::RdmaTransport;

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
                .post_recv(WorkKind::Recv.wr_id(i), &wired.recv, start..start + slot)?
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
    ring_slots: u32,
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

/// The connection's state, under its mutex: the queue pair (posting needs
/// `&mut`) and the protocol that decides what is posted.
struct State {
    qp: QueuePair,
    proto: proto::Connection,
    send_waiters: Vec<Waker>,
    recv_waker: Option<Waker>,
    max_frame_len: usize,
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

/// The verbs layer reads received bytes for the protocol by raw copies.
impl ReadReceived for Buffers {
    fn read_slot(&self, slot: u32, offset: usize, dst: &mut [u8]) {
        self.recv
            .read_into(self.recv_slot(slot).start + offset, dst);
    }

    fn read_region(&self, offset: usize, dst: &mut [u8]) {
        self.region.read_into(offset, dst);
    }
}

fn connection_error(reason: &str) -> TransportError {
    TransportError::io(
        "RDMA connection",
        io::Error::new(io::ErrorKind::ConnectionReset, reason.to_string()),
    )
}

fn refusal_error(refusal: Refusal) -> TransportError {
    match refusal {
        Refusal::Failed(reason) => connection_error(&reason),
        Refusal::Closed => TransportError::Closed,
        Refusal::TooLong(len) => TransportError::Protocol(format!(
            "frame of {len} bytes is too long for the RDMA transport"
        )),
    }
}

impl State {
    /// Wakes whom the protocol's last decisions concern.
    fn wake(&mut self) {
        let wake = self.proto.take_wakeups();
        if wake.senders {
            for w in self.send_waiters.drain(..) {
                w.wake();
            }
        }
        if wake.receiver {
            if let Some(w) = self.recv_waker.take() {
                w.wake();
            }
        }
    }

    fn fail(&mut self, reason: String) {
        self.proto.fail(reason);
        self.wake();
    }

    fn wait_send(&mut self, cx: &Context<'_>) {
        if !self.send_waiters.iter().any(|w| w.will_wake(cx.waker())) {
            self.send_waiters.push(cx.waker().clone());
        }
    }

    /// Posts every work request the protocol decided, in order; then wakes.
    fn flush(&mut self, mem: &Buffers) {
        while let Some(transmit) = self.proto.poll_transmit() {
            if let Err(e) = self.post(mem, transmit) {
                self.proto.fail(format!("posting to the queue pair: {e}"));
                break;
            }
        }
        self.wake();
    }

    fn post(&mut self, mem: &Buffers, transmit: Transmit) -> Result<(), crate::verbs::Error> {
        match transmit {
            Transmit::Recv { slot } => {
                // SAFETY: the protocol reposts a slot only once its message
                // was handled and nothing refers to its bytes any more (its
                // guard, if any, was dropped); the memory outlives the QP
                // (see `Shared`).
                unsafe {
                    self.qp
                        .post_recv(WorkKind::Recv.wr_id(slot), &mem.recv, mem.recv_slot(slot))
                }
            }
            Transmit::Write {
                offset, len, data, ..
            } => {
                if let Some(data) = data {
                    // The chunk's staging bytes were just allocated to it:
                    // no posted WRITE reads them (the peer freed them, so
                    // earlier WRITEs landed) and no slice covers them.
                    mem.staging.write_at(offset, &data);
                }
                // SAFETY: `staging[offset..offset + len]` holds this chunk,
                // allocated to it until the peer reports it freed (after the
                // WRITE landed); the memory outlives the QP.
                unsafe {
                    self.qp.post_write(
                        WorkKind::Write.wr_id(0),
                        &mem.staging,
                        offset..offset + len,
                        mem.peer_region,
                        offset as u64,
                    )
                }
            }
            Transmit::Send {
                kind,
                slot,
                header,
                body_len,
            } => {
                let start = mem.send_slot(slot).start;
                // SAFETY: the slot is owned by this message (the protocol
                // gave it out and takes it back at the send's completion):
                // not posted, no other slice; the header is inside it.
                let dst = unsafe { mem.send.slice_mut(start..start + HEADER_LEN) };
                header.encode(dst.try_into().expect("HEADER_LEN bytes"));
                // SAFETY: the slot stays untouched until its send completion
                // frees it; the memory outlives the QP.
                unsafe {
                    self.qp.post_send(
                        kind.wr_id(slot),
                        &mem.send,
                        start..start + HEADER_LEN + body_len,
                    )
                }
            }
        }
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
                    self.flush(mem);
                }
                return total;
            }
        }
    }

    /// Feeds one completion to the protocol, with a receive's header copied
    /// out of its slot.
    fn on_completion(&mut self, mem: &Buffers, wc: &WorkCompletion) {
        let failure = (!wc.is_ok()).then(|| format!("{} (status {})", wc.status_name(), wc.status));
        let mut header = [0; HEADER_LEN];
        let mut header_len = 0;
        if let Some((WorkKind::Recv, slot)) = WorkKind::from_wr_id(wc.wr_id) {
            if failure.is_none() && slot < mem.ring_slots {
                header_len = (wc.byte_len as usize).min(HEADER_LEN);
                // A raw copy out of the slot whose receive completed: the
                // device no longer writes it.
                mem.read_slot(slot, 0, &mut header[..header_len]);
            }
        }
        self.proto.handle_completion(Completion {
            wr_id: wc.wr_id,
            failure: failure.as_deref(),
            byte_len: wc.byte_len as usize,
            header: &header[..header_len],
        });
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
        // this guard drops; nothing writes it meanwhile (the ring is local
        // write only: the peer cannot write it).
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

/// Gives back what a frame was given in registered memory (its send slot,
/// its region space) if encoding it there panics (a payload's encoder may);
/// [`encoded`](Self::encoded) disarms it. Held while the connection's lock
/// is, so a region allocation is still the writer's newest: rolling it back
/// is exact.
struct CancelOnUnwind<'a> {
    state: &'a mut State,
    reservation: Reservation,
}

impl CancelOnUnwind<'_> {
    /// The frame was encoded: it keeps what it was given.
    fn encoded(self) {
        std::mem::forget(self);
    }
}

impl Drop for CancelOnUnwind<'_> {
    fn drop(&mut self) {
        self.state.proto.cancel_send(self.reservation);
        self.state.wake();
    }
}

/// Gives back the heap frame's place if encoding a frame onto the heap,
/// outside the lock, panics; forgotten once it is encoded.
struct CancelHeapOnUnwind<'a> {
    shared: &'a Shared,
    reservation: Reservation,
}

impl Drop for CancelHeapOnUnwind<'_> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.proto.cancel_send(self.reservation);
        st.wake();
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
        let len = frame.len();
        let reservation = match st.proto.handle_send(len) {
            SendDecision::Encode(reservation) => reservation,
            SendDecision::Wait => {
                st.wait_send(cx);
                return Poll::Pending;
            }
            SendDecision::Refused(refusal) => return Poll::Ready(Err(refusal_error(refusal))),
        };
        let in_place = match st.proto.encode_into(&reservation) {
            EncodeInto::SendSlot { slot } => {
                let start = mem.send_slot(slot).start + HEADER_LEN;
                // SAFETY: the slot was free: no posted send and no other
                // slice covers it; it is inside the send region (len fits a
                // slot after the header: len <= inline_max).
                Some(unsafe { mem.send.slice_mut(start..start + len) })
            }
            EncodeInto::Staging { offset } => {
                // SAFETY: just allocated in the staging region: no posted
                // WRITE reads it (the peer freed it) and no other slice.
                Some(unsafe { mem.staging.slice_mut(offset..offset + len) })
            }
            EncodeInto::Heap => None,
        };
        if let Some(mut dst) = in_place {
            let encoding = CancelOnUnwind {
                state: &mut st,
                reservation,
            };
            frame.encode(&mut dst);
            encoding.encoded();
            st.proto
                .queue_frame(reservation, None)
                .expect("a frame encoded in place under the lock is always queued");
        } else {
            // A chunked frame (up to the frame limit, 64 MiB) is encoded
            // without the connection's lock: completions, receivers and
            // other senders go on meanwhile; its place is reserved.
            drop(st);
            let encoding = CancelHeapOnUnwind {
                shared,
                reservation,
            };
            let mut data = Vec::with_capacity(len);
            frame.encode(&mut data);
            std::mem::forget(encoding);
            st = shared.lock();
            if let Err(refusal) = st.proto.queue_frame(reservation, Some(Bytes::from(data))) {
                st.wake();
                return Poll::Ready(Err(refusal_error(refusal)));
            }
        }
        st.flush(mem);
        Poll::Ready(Ok(()))
    }

    fn close(&self) {
        let mut st = self.shared.lock();
        st.proto.close();
        st.flush(&self.shared.mem);
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
            let Some(delivered) = st.proto.poll_delivery(mem) else {
                // Look in the CQ before waiting for the driver: a frame
                // that is already there is not delayed by a wake-up (and
                // this task does not wake itself for it).
                st.recv_waker = None;
                if st.drain_cq(&shared.cq, mem) > 0 {
                    continue;
                }
                // Return what the chunks handled above freed.
                st.flush(mem);
                st.recv_waker = Some(cx.waker().clone());
                drop(st);
                if self.spin.keep_polling() {
                    cx.waker().wake_by_ref();
                }
                return Poll::Pending;
            };
            match delivered {
                Delivered::Eof => break Ok(None),
                Delivered::Failed(reason) => break Err(connection_error(&reason)),
                Delivered::InSlot { slot, len } => {
                    let start = mem.recv_slot(slot).start + HEADER_LEN;
                    break Ok(Some(Bytes::from_owner(SlotGuard {
                        shared: Arc::clone(shared),
                        slot,
                        range: start..start + len,
                    })));
                }
                Delivered::CopyOut { slot, len } => {
                    let start = mem.recv_slot(slot).start + HEADER_LEN;
                    // SAFETY: the slot's receive completed; it is reposted
                    // only below, after this slice's last use.
                    let data = unsafe { mem.recv.slice(start..start + len) };
                    let bytes = Bytes::copy_from_slice(data);
                    st.proto.handle_copied(slot);
                    break Ok(Some(bytes));
                }
                Delivered::Frame(frame) => break Ok(Some(Bytes::from(frame))),
                Delivered::Oversized { len, prefix } => {
                    break Err(TransportError::Oversized {
                        len,
                        max: st.max_frame_len,
                        prefix: Bytes::from(prefix),
                    })
                }
                Delivered::TooLarge { len } => {
                    break Err(TransportError::FrameTooLarge {
                        len,
                        max: st.max_frame_len,
                    })
                }
            }
        };
        st.flush(mem);
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
        if st.proto.failure().is_none() {
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
            "{}: {} | handles {} released {}\n",
            shared.peer,
            st.proto.summary(),
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
        let state = State {
            qp,
            proto: proto::Connection::new(proto::Config {
                ring_slots: own.ring_slots,
                slot_size: own.slot_size as usize,
                region_len: own.region_len.into(),
                peer_ring_slots: peer.ring_slots,
                peer_region_len: peer.region_len.into(),
                inline_max,
                max_frame_len: limits.max_frame_len,
                max_skip_len: limits.max_skip_len(),
                prefix_len: OVERSIZED_PREFIX_LEN,
            }),
            send_waiters: Vec::new(),
            recv_waker: None,
            max_frame_len: limits.max_frame_len,
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
                ring_slots: own.ring_slots,
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
        st.proto.handle_released(slot);
    }
    st.flush(&shared.mem);
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
            if st.proto.failure().is_some() || (st.proto.is_disconnected() && st.handles == 0) {
                break;
            }
            if st.handles == 0 {
                let done = st.proto.is_drained();
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
                            // Orderly if the peer said Close first (what
                            // arrived before it is still delivered); else a
                            // failure.
                            let mut st = shared.lock();
                            st.proto.handle_disconnected(&format!("{}: {}", shared.peer, event.name()));
                            st.wake();
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
    let mut st = shared.lock();
    for w in st.send_waiters.drain(..) {
        w.wake();
    }
    if let Some(w) = st.recv_waker.take() {
        w.wake();
    }
}
