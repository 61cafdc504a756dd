//! The connection's memory and queue pair under its mutex, carrying out
//! what the protocol ([`proto::Connection`]) decides: posting its work
//! requests, feeding it completions, waking the halves.

use std::collections::HashMap;
use std::io;
use std::ops::Range;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Waker};
use std::time::Instant;

use rpc_core::transport::TransportError;

use super::destinations::{PoolBuffer, RendezvousPool};
use super::slots::SlotMemory;
use crate::proto::{
    self, Completion, ReadReceived, Refusal, Transmit, WorkKind, CTRL_SLOTS, HEADER_LEN,
    HEAP_SLOTS, PEEK_LEN,
};
use crate::registry::LiveConnection;
use crate::teardown::DropLater;
use crate::verbs::{
    Access, CompletionBatch, CompletionQueue, MemoryRegion, MemoryWindow, ProtectionDomain,
    QueuePair, RemoteRegion, SendBatch, WorkCompletion,
};

pub(super) struct Buffers {
    pub(super) ring: SlotMemory,
    /// The length of the region ([`State::region`]) and of staging
    /// ([`State::staging`]), which mirrors the peer's region: the smaller
    /// of the two sides' settings ([`proto::Hello::region_with`]).
    region_len: usize,
    /// Send slots, in memory order: data slots `0..FIRST_DATA_SLOTS`, the
    /// control and chunk slots, then the other data slots, in doublings
    /// ([`send_slot`](Self::send_slot)).
    send: SlotMemory,
    /// Data send slots: the peer's ring's within our own ([`SendSlots`](super::setup::SendSlots)).
    data_slots: u32,
    /// Rendezvous memory (transfers' segments, destinations), the region
    /// and staging are registered on it.
    pub(super) pd: ProtectionDomain,
}

/// The staging region, shared by the connection's state and a sender
/// encoding a frame into it (which keeps it registered meanwhile).
pub(super) struct Staging(MemoryRegion);

// SAFETY: staging's bytes are written only with the connection's mutex
// held (a frame encoded in place, a chunk copied in before its WRITE is
// queued), each range by the one chunk the protocol allocated it to, and
// read only by the device; its registration is made before it is shared
// and never changed (staging is let go whole, only once no chunk holds
// any of it: `State::release_idle_regions`), so sharing the `Arc` between
// threads only reads it and keeps it alive.
unsafe impl Sync for Staging {}

impl Deref for Staging {
    type Target = MemoryRegion;

    fn deref(&self) -> &MemoryRegion {
        &self.0
    }
}

/// Data send slots in the first part of the send slots, with the control
/// and chunk slots: what a few frames at a time use (the peer's first
/// credits are 8, one of them kept for control).
pub(super) const FIRST_DATA_SLOTS: u32 = 8;

// SAFETY: the bytes of `ring` and `send` are only accessed through their
// `unsafe` `slice`/`slice_mut` or raw copies, and each byte range is owned
// by exactly one party at a time, as the protocol state (under the
// connection's mutex) records: the device while posted, the state while
// being encoded or handled, or one `SlotGuard` while the application holds
// a received frame. Their parts are published once each (the `OnceLock`s).
// A ring part is registered before it is published and its registration
// only read after; the send parts' registrations are read (for SGEs) and
// changed (registered by a SEND too long to go inline, deregistered once
// idle) only under the connection's mutex (`State::post`,
// `State::release_idle_send_slots`). So sharing `&Buffers` between threads
// races on nothing.
unsafe impl Sync for Buffers {}

impl Buffers {
    /// The connection's memory: the receive ring's first slots and the
    /// send slots now; the ring's later parts, the region and staging
    /// (mirroring the peer's region's offsets), both
    /// [`region_with`](proto::Hello::region_with) long, once needed.
    pub(super) fn new(
        ring: SlotMemory,
        send: SlotMemory,
        data_slots: u32,
        pd: ProtectionDomain,
        own: proto::Hello,
        peer: proto::Hello,
    ) -> Buffers {
        Buffers {
            ring,
            region_len: own.region_with(&peer) as usize,
            send,
            data_slots,
            pd,
        }
    }

    /// Registers a staging region (a millisecond or so for the default
    /// 1 MiB). Fails only if the device or the locked-memory limit refuses
    /// the registration.
    pub(super) fn register_staging(&self) -> Result<MemoryRegion, crate::verbs::Error> {
        MemoryRegion::new(&self.pd, self.region_len, Access::LOCAL_WRITE)
    }

    /// Registers a region for the peer of `qp` to write, and what the
    /// peer writes it by. On a shared protection domain through a window
    /// bound to `qp` (posted ahead of the grant that names it), else
    /// through the registration itself.
    fn register_region(&self, qp: &mut QueuePair) -> Result<PeerRegion, crate::verbs::Error> {
        if !self.pd.is_shared() {
            let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
            let mr = MemoryRegion::new(&self.pd, self.region_len, access)?;
            let remote = mr.remote();
            return Ok(PeerRegion {
                _window: None,
                mr,
                remote,
            });
        }
        let mr = MemoryRegion::writable_through_windows(&self.pd, self.region_len)?;
        let window = MemoryWindow::new(&self.pd)?;
        // SAFETY: the region is only read by raw copies (never sliced: it
        // is made writable through windows), and stays registered while
        // the window, dropped first (`PeerRegion`), is bound to it.
        let remote = unsafe {
            qp.post_bind(
                WorkKind::Bind.wr_id(0),
                &window,
                &mr,
                0..self.region_len,
                Access::REMOTE_WRITE,
            )?
        };
        Ok(PeerRegion {
            _window: Some(window),
            mr,
            remote,
        })
    }

    /// The memory of send slot `slot` (the protocol's numbering: data
    /// slots, then control and chunk slots) and its bytes in it.
    pub(super) fn send_slot(&self, slot: u32) -> (&MemoryRegion, Range<usize>) {
        self.send.slot(send_position(slot, self.data_slots))
    }

    /// Bytes `within` of send slot `slot`, mutably borrowed.
    ///
    /// # Safety
    /// As [`MemoryRegion::slice_mut`]: nothing else reads or writes them
    /// while the slice lives (the slot is not posted).
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn send_slice_mut(&self, slot: u32, within: Range<usize>) -> &mut [u8] {
        // SAFETY: as the caller guarantees.
        unsafe {
            self.send
                .slice_mut(send_position(slot, self.data_slots), within)
        }
    }
}

/// Where send slot `slot` (the protocol's numbering: `data_slots` data
/// slots, then the control and chunk slots) lies in memory: the first
/// data slots, the control and chunk slots after them, the other data
/// slots last.
fn send_position(slot: u32, data_slots: u32) -> u32 {
    let first_data = FIRST_DATA_SLOTS.min(data_slots);
    if slot < first_data {
        slot
    } else if slot >= data_slots {
        first_data + (slot - data_slots)
    } else {
        first_data + CTRL_SLOTS + HEAP_SLOTS + (slot - first_data)
    }
}

/// The connection's state, under its mutex: the queue pair (posting needs
/// `&mut`) and the protocol that decides what is posted.
pub(super) struct State {
    pub(super) qp: QueuePair,
    pub(super) proto: proto::Connection,
    pub(super) send_waiters: Vec<Waker>,
    /// Waiting for a close to have sent everything ([`State::is_closed`]);
    /// woken by the driver.
    pub(super) close_waiters: Vec<Waker>,
    pub(super) recv_waker: Option<Waker>,
    pub(super) max_frame_len: usize,
    pub(super) handles: u32,
    /// Completions handled so far (whoever polled): the keepalive's sign
    /// of life.
    pub(super) completions: u64,
    /// Our rendezvous transfers' segments (remote read), by transfer id,
    /// until the peer's `Done` (or a failure): dropping one ends the
    /// peer's access to it.
    pub(super) out_transfers: HashMap<u64, super::transfer::OutgoingTransfer>,
    /// The peer's transfers' destinations, by its transfer id, while
    /// their READs run and until delivered. Declared after `qp`: one with
    /// a READ in flight is freed only after the QP is destroyed.
    pub(super) destinations: HashMap<u64, PoolBuffer>,
    /// Where destinations come from, and released ones go.
    pub(super) rendezvous_pool: Arc<RendezvousPool>,
    /// A thread is posting the send queue's requests, outside the lock
    /// ([`Locked`]); it posts whatever is queued meanwhile too.
    pub(super) posting: bool,
    /// The posting thread's batch, kept for its allocation.
    pub(super) batch: SendBatch,
    /// Room for polled completions, kept for its allocation (and zeroing).
    pub(super) completed: CompletionBatch,
    /// The source of our RDMA WRITEs into the peer's region, as large as
    /// it: registered when a frame needs it ([`staging`](Self::staging)),
    /// so a connection that never sends a region-sized frame pins none,
    /// and let go once unused for a while ([`release_idle_regions`]).
    /// Declared after `qp`: freed after the QP is destroyed.
    ///
    /// [`release_idle_regions`]: Self::release_idle_regions
    pub(super) staging: Option<Arc<Staging>>,
    /// The large-payload region the peer RDMA-writes into (local and
    /// remote write): registered when the peer asks for it
    /// ([`Transmit::RegisterRegion`](proto::Transmit::RegisterRegion)),
    /// so a connection whose peer sends small frames only has no remotely
    /// writable memory at all, and deregistered when the peer gives it
    /// back ([`Transmit::DeregisterRegion`](proto::Transmit::DeregisterRegion)).
    /// Only read, by raw copies under the connection's mutex, of chunks
    /// the peer's protocol has finished writing (a peer that writes anyway
    /// changes only the bytes we copy, never memory a Rust reference
    /// covers). Dropped before the QP (`Drop for State`).
    pub(super) region: Option<PeerRegion>,
    /// Staging was used since the last [`release_idle_regions`].
    ///
    /// [`release_idle_regions`]: Self::release_idle_regions
    pub(super) staging_used: bool,
    /// A part of the send slots is registered (a SEND too long to go
    /// inline was posted since the last [`release_idle_send_slots`]).
    ///
    /// [`release_idle_send_slots`]: Self::release_idle_send_slots
    pub(super) send_slots_registered: bool,
    /// A SEND too long to go inline was posted since the last
    /// [`release_idle_send_slots`].
    ///
    /// [`release_idle_send_slots`]: Self::release_idle_send_slots
    pub(super) send_slots_used: bool,
}

/// What the connection's halves, its driver and the frames it handed up
/// share. Its verbs objects are destroyed on the teardown thread
/// ([`DropLater`]), in the order of the fields, whoever drops it last.
pub(super) struct Shared {
    // Declared before `cq` and `mem`: the QP inside is destroyed first.
    pub(super) state: DropLater<Mutex<State>>,
    pub(super) cq: DropLater<CompletionQueue>,
    pub(super) mem: DropLater<Buffers>,
    /// Ring slots whose frames the application dropped, for the driver to
    /// repost.
    pub(super) released: Mutex<Vec<u32>>,
    /// Rendezvous frames the application dropped while the state was
    /// busy: their lengths and destinations, for the driver.
    pub(super) pool_released: Mutex<Vec<(usize, PoolBuffer)>>,
    pub(super) wake_task: Arc<super::wake::DriverWake>,
    /// The driver's end of the rendezvous pool's queue, if this side reads
    /// the peer's transfers.
    pub(super) pool_wait: Option<super::destinations::PoolWait>,
    /// Payload buffers for frames going by rendezvous (frames at least
    /// this long), if they go so to this peer.
    pub(super) payloads: Option<(super::payloads::PayloadPool, usize)>,
    /// The connection manager's event that ended the connection (set by
    /// the device's watcher, acted on by the driver).
    pub(super) ended_by_cm: OnceLock<String>,
    pub(super) peer: String,
    /// A server's connection gives its admission back once its memory
    /// (above) is freed.
    pub(super) _lease: DropLater<Option<crate::admission::Lease>>,
}

impl Shared {
    /// The state, under its mutex; send-queue requests queued under it are
    /// posted when it is let go ([`Locked`]).
    pub(super) fn lock(&self) -> Locked<'_> {
        Locked {
            shared: self,
            guard: Some(self.lock_only()),
            driver: false,
        }
    }

    /// [`lock`](Self::lock), for the connection's driver task: what is
    /// queued is posted when it is let go, however large.
    pub(super) fn lock_driver(&self) -> Locked<'_> {
        Locked {
            shared: self,
            guard: Some(self.lock_only()),
            driver: true,
        }
    }

    fn lock_only(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes back the destination of a rendezvous frame of `len` bytes
    /// the application dropped: at once if the state is free (so the next
    /// transfer of its size finds it), else through the driver (which
    /// also posts what the freed pool lets through).
    pub(super) fn release_destination(&self, len: usize, destination: PoolBuffer) {
        match self.state.try_lock() {
            Ok(mut st) => st.release_destination(len, destination),
            Err(std::sync::TryLockError::Poisoned(st)) => {
                st.into_inner().release_destination(len, destination)
            }
            Err(std::sync::TryLockError::WouldBlock) => self
                .pool_released
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((len, destination)),
        }
        self.wake_task.notify();
    }
}

impl State {
    /// The staging region, registered if it is not (once per connection,
    /// and again after [`release_idle_regions`]). Fails only if the device
    /// or the locked-memory limit refuses the registration; the frame that
    /// needed it fails then, and the next one tries again.
    ///
    /// [`release_idle_regions`]: Self::release_idle_regions
    pub(super) fn staging(&mut self, mem: &Buffers) -> Result<Arc<Staging>, crate::verbs::Error> {
        let registered = self.staging.is_none().then(|| mem.register_staging());
        self.use_staging(registered.transpose()?);
        Ok(Arc::clone(self.staging.as_ref().expect("kept")))
    }

    /// Marks staging used, keeping `registered` (from
    /// [`Buffers::register_staging`], perhaps made without the lock) as
    /// staging unless one is registered already.
    pub(super) fn use_staging(&mut self, registered: Option<MemoryRegion>) {
        self.staging_used = true;
        if self.staging.is_none() {
            self.staging = registered.map(|r| Arc::new(Staging(r)));
        }
    }

    /// Whether this side holds memory it lets go once idle: staging, the
    /// peer's region granted, registered send slots, a receive ring grown
    /// past its first slots.
    pub(super) fn holds_idle_memory(&self) -> bool {
        self.staging.is_some()
            || self.proto.peer_region().is_some()
            || self.send_slots_registered
            || self.proto.ring_grown()
    }

    /// If no frame used staging since the last call and no chunk holds
    /// any of it (every WRITE from it landed and the peer freed its bytes,
    /// so no posted or queued request refers to it): gives the peer's
    /// region back (the peer deregisters it; see
    /// [`proto::Connection::return_idle_region`]) and lets staging go,
    /// returning it for the caller to deregister without the lock.
    pub(super) fn release_idle_regions(&mut self) -> Option<Arc<Staging>> {
        let used = std::mem::take(&mut self.staging_used);
        if used || self.proto.region_in_use() > 0 || self.proto.failure().is_some() {
            return None;
        }
        self.proto.return_idle_region();
        self.staging.take()
    }

    /// If no SEND used the send slots' registered memory since the last
    /// call and none is posted or queued: deregisters the send slots (the
    /// bytes stay; the next SEND too long to go inline registers its part
    /// again). Returns the bytes let go.
    pub(super) fn release_idle_send_slots(&mut self, mem: &Buffers) -> usize {
        let used = std::mem::take(&mut self.send_slots_used);
        // `in_flight` counts every SEND posted and not completed (all are
        // signaled), from the moment the protocol hands it out: also those
        // queued in the QP or in a poster's batch outside the lock.
        if used
            || !self.send_slots_registered
            || self.proto.in_flight() > 0
            || self.posting
            || self.qp.has_queued()
        {
            return 0;
        }
        self.send_slots_registered = false;
        // SAFETY: no work request posted or queued names the send slots'
        // keys (just checked), and their registration is only read or
        // changed under the connection's mutex, which `&mut self` holds
        // (`post` registers them and builds SGEs from them there).
        match unsafe { mem.send.deregister() } {
            Ok(released) => released,
            Err(e) => {
                // Still registered (and counted): tried again next time.
                self.send_slots_registered = true;
                tracing::warn!("deregistering idle send slots: {e}");
                0
            }
        }
    }

    /// The pool gets a dropped frame's charge back; its destination is
    /// kept as a spare while the budget allows.
    pub(super) fn release_destination(&mut self, len: usize, destination: PoolBuffer) {
        self.rendezvous_pool.keep(destination);
        self.proto.handle_pool_released(len);
    }
}

/// The state under its mutex. Dropping it posts the send-queue requests
/// queued meanwhile, with the mutex let go: on Soft-RoCE `ibv_post_send`
/// is a system call in which the kernel transmits what was posted (up to
/// hundreds of milliseconds for a region chunk in an emulated guest), and
/// the connection's receiver, completions and other senders must not wait
/// for it. One thread posts at a time (`State::posting`), in the order the
/// requests were queued; one that queues while another posts leaves its
/// requests to that one. Requests moving more than [`POST_HERE_UP_TO`]
/// bytes are left to the driver task: a small call whose send made room
/// for a large frame's next chunk does not carry that chunk itself.
pub(super) struct Locked<'a> {
    shared: &'a Shared,
    guard: Option<MutexGuard<'a, State>>,
    driver: bool,
}

/// Bytes of queued requests a task other than the driver posts itself.
const POST_HERE_UP_TO: u64 = 64 * 1024;

impl Deref for Locked<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let Some(mut st) = self.guard.take() else {
            return;
        };
        if st.posting || !st.qp.has_queued() {
            return;
        }
        if !self.driver && st.qp.queued_bytes() > POST_HERE_UP_TO {
            drop(st);
            self.shared.wake_task.notify();
            return;
        }
        st.posting = true;
        let poster = st.qp.poster();
        let mut batch = std::mem::take(&mut st.batch);
        loop {
            st.qp.take_queued(&mut batch);
            if batch.is_empty() {
                break;
            }
            drop(st);
            // SAFETY: the queue pair lives in the state, which `Shared`
            // owns and frees only when dropped: not while `self.shared`
            // is borrowed. `posting` makes this the only poster.
            let posted = unsafe { poster.post(&mut batch) };
            st = self.shared.lock_only();
            if let Err(e) = posted {
                st.proto.fail(format!("posting to the queue pair: {e}"));
                st.release_on_failure();
                st.wake();
            }
        }
        st.posting = false;
        st.batch = batch;
    }
}

/// Memory only the peer accesses (our transfers' segments, the region:
/// no request of ours names it) goes before the queue pair: their memory
/// windows must be deallocated first, as a window bound to a queue pair
/// holds it (Soft-RoCE's `ibv_destroy_qp` waited 50 s for the window, and
/// warned). Dropping them ends the peer's access, which a destroyed queue
/// pair could not have used anyway.
impl Drop for State {
    fn drop(&mut self) {
        self.out_transfers.clear();
        self.region = None;
    }
}

/// The region the peer writes, and the window it writes it through on a
/// shared protection domain.
pub(super) struct PeerRegion {
    /// Dropped first: deallocating it ends the peer's access (and a region
    /// with a window bound to it cannot be deregistered).
    _window: Option<MemoryWindow>,
    pub(super) mr: MemoryRegion,
    /// What the peer writes it by.
    remote: RemoteRegion,
}

/// Where received bytes lie: the ring, and the region if registered.
pub(super) struct Received<'a> {
    pub(super) ring: &'a SlotMemory,
    pub(super) region: Option<&'a MemoryRegion>,
}

/// The verbs layer reads received bytes for the protocol by raw copies.
impl ReadReceived for Received<'_> {
    fn read_slot(&self, slot: u32, offset: usize, dst: &mut [u8]) {
        self.ring.read_into(slot, offset, dst);
    }

    fn read_region(&self, offset: usize, dst: &mut [u8]) {
        self.region
            .expect("chunks arrive only in a region we granted, kept until they are consumed")
            .read_into(offset, dst);
    }
}

pub(super) fn connection_error(reason: &str) -> TransportError {
    TransportError::io(
        "RDMA connection",
        io::Error::new(io::ErrorKind::ConnectionReset, reason.to_string()),
    )
}

pub(super) fn refusal_error(refusal: Refusal) -> TransportError {
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
    pub(super) fn wake(&mut self) {
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

    pub(super) fn fail(&mut self, reason: String) {
        self.proto.fail(reason);
        self.release_on_failure();
        self.wake();
    }

    /// A failed connection ends the peer's access to our transfers at
    /// once. (Destinations stay until the QP is destroyed: a READ may
    /// still be writing one.)
    fn release_on_failure(&mut self) {
        if self.proto.failure().is_some() {
            self.out_transfers.clear();
        }
    }

    /// Whether nothing more will be sent: our `Close` and everything
    /// before it went out and completed, or the connection is down.
    pub(super) fn is_closed(&self) -> bool {
        self.proto.is_drained() || self.proto.failure().is_some() || self.proto.is_disconnected()
    }

    /// Wakes those waiting for the close, if it is done.
    pub(super) fn wake_if_closed(&mut self) {
        if !self.close_waiters.is_empty() && self.is_closed() {
            for w in self.close_waiters.drain(..) {
                w.wake();
            }
        }
    }

    pub(super) fn wait_send(&mut self, cx: &Context<'_>) {
        if !self.send_waiters.iter().any(|w| w.will_wake(cx.waker())) {
            self.send_waiters.push(cx.waker().clone());
        }
    }

    /// Carries out every work request the protocol decided, in order:
    /// receives are posted at once, send-queue requests queued and posted
    /// (linked, in as few `ibv_post_send` as can be) once the lock is let
    /// go ([`Locked`]); then wakes.
    pub(super) fn flush(&mut self, mem: &Buffers) {
        let mut paced = false;
        while let Some(transmit) = self.proto.poll_transmit() {
            paced |= transmit.is_paced();
            if let Err(e) = self.post(mem, transmit) {
                // What was queued before is posted too, as the protocol
                // counts it posted.
                self.proto.fail(format!("posting to the queue pair: {e}"));
                break;
            }
        }
        if paced {
            self.proto.handle_posted(Instant::now());
        }
        self.release_on_failure();
        self.wake();
    }

    fn post(&mut self, mem: &Buffers, transmit: Transmit) -> Result<(), crate::verbs::Error> {
        match transmit {
            Transmit::Recv { slot } => {
                let (mr, range) = mem.ring.slot(slot);
                // SAFETY: the protocol reposts a slot only once its message
                // was handled and nothing refers to its bytes any more (its
                // guard, if any, was dropped); the memory outlives the QP
                // (see `Shared`).
                unsafe { self.qp.post_recv(WorkKind::Recv.wr_id(slot), mr, range) }
            }
            Transmit::Write {
                offset, len, data, ..
            } => {
                // Registered by the sink before it queued the frame, or
                // again here if it was let go while the frame waited.
                let staging = self.staging(mem)?;
                if let Some(data) = data {
                    // The chunk's staging bytes were just allocated to it:
                    // no posted WRITE reads them (the peer freed them, so
                    // earlier WRITEs landed) and no slice covers them.
                    let mut at = offset;
                    for piece in data.pieces() {
                        staging.write_at(at, piece);
                        at += piece.len();
                    }
                }
                let (addr, rkey) = self
                    .proto
                    .peer_region()
                    .expect("the protocol writes only into a granted region");
                let peer_region = RemoteRegion {
                    addr,
                    rkey,
                    len: mem.region_len as u64,
                };
                // SAFETY: `staging[offset..offset + len]` holds this chunk,
                // allocated to it until the peer reports it freed (after the
                // WRITE landed); the memory outlives the QP. Unsignaled: the
                // protocol queues the chunk's signaled SEND right after it.
                unsafe {
                    self.qp.queue_write(
                        WorkKind::Write.wr_id(0),
                        &staging,
                        offset..offset + len,
                        peer_region,
                        offset as u64,
                        false,
                    )
                }
            }
            Transmit::Alloc {
                transfer,
                len,
                slot,
                head_at,
                head_len,
            } => {
                // The protocol charged this transfer to the pool already.
                let dest = self.rendezvous_pool.destination(&mem.pd, len)?;
                // The frame's head came in the announcement.
                // SAFETY: the announcement's receive completed and its slot
                // is reposted only once the frame is delivered; the ring is
                // local write only, so nothing writes it meanwhile. The
                // head lies inside the message (the protocol checked it
                // against the message's length, at most a slot).
                let head = unsafe { mem.ring.slice(slot, head_at..head_at + head_len) };
                // Not yet read into: no request uses the destination.
                dest.mr.write_at(0, head);
                self.destinations.insert(transfer, dest);
                Ok(())
            }
            Transmit::Read {
                transfer,
                offset,
                len,
                addr,
                rkey,
                seq,
            } => {
                let dest = self
                    .destinations
                    .get(&transfer)
                    .expect("a READ's destination was allocated before it");
                // SAFETY: the destination stays in `destinations` (not
                // read, not handed up) until every READ into it completed
                // (the protocol delivers it only then); if the connection
                // fails first, it is freed only after the QP is destroyed
                // (`State` declares `qp` first). The range is checked
                // against it (`sge`); the peer's device checks the remote
                // side against `rkey`'s registration.
                unsafe {
                    self.qp.queue_read(
                        WorkKind::Read.wr_id(seq),
                        &dest.mr,
                        offset..offset + len,
                        addr,
                        rkey,
                    )
                }
            }
            Transmit::Release { transfer } => {
                // The peer read it (its `Done`): deregistering ends its
                // access; no request of ours uses it.
                self.out_transfers.remove(&transfer);
                Ok(())
            }
            Transmit::RegisterRing { from, to } => {
                // The peer keeps more messages in flight: as many slots
                // again (64 KiB, 128 KiB, 256 KiB by default, each once
                // per connection) are registered under the lock, as the
                // region is.
                match mem.ring.register(&mem.pd, from, to) {
                    Ok(()) => self.proto.ring_registered(),
                    Err(e) => {
                        tracing::warn!(
                            "an RDMA connection's receive ring stays at {from} slots: \
                             registering {} more failed: {e}",
                            to - from
                        );
                        self.proto.ring_not_registered();
                    }
                }
                Ok(())
            }
            Transmit::DeregisterRing { from } => {
                // SAFETY: the protocol retired every slot from `from` on
                // (handled, not reposted: no receive posted in them), and
                // the ring's registrations are read (`post_recv`'s lkey)
                // and changed only under the connection's mutex, which
                // `&mut self` holds.
                match unsafe { mem.ring.deregister_from(from) } {
                    Ok(released) => tracing::debug!(
                        "an RDMA connection's receive ring is back to {from} slots: {released} bytes deregistered"
                    ),
                    // Still registered: registering it again is a no-op.
                    Err(e) => tracing::warn!("deregistering a shrunk receive ring's slots: {e}"),
                }
                Ok(())
            }
            Transmit::RegisterRegion => {
                // Registering pins the region's pages: a millisecond or so
                // for the default 1 MiB, once per connection, under the
                // lock (the peer's frames wait for it anyway).
                match mem.register_region(&mut self.qp) {
                    Ok(region) => {
                        let remote = region.remote;
                        self.region = Some(region);
                        self.proto.region_registered(remote.addr, remote.rkey);
                    }
                    Err(e) => self
                        .proto
                        .fail(format!("registering the region the peer asked for: {e}")),
                }
                Ok(())
            }
            Transmit::DeregisterRegion => {
                // The peer will not write it again (it said so after its
                // last WRITE), and every chunk in it was consumed.
                self.region = None;
                Ok(())
            }
            Transmit::Send {
                kind,
                slot,
                header,
                body_len,
            } => {
                // SAFETY: the slot is owned by this message (the protocol
                // gave it out and takes it back at the send's completion):
                // not posted, no other slice; the header is inside it.
                let dst = unsafe { mem.send_slice_mut(slot, 0..HEADER_LEN) };
                header.encode(dst.try_into().expect("HEADER_LEN bytes"));
                let (mr, range) = mem.send_slot(slot);
                if HEADER_LEN + body_len > self.qp.max_inline_data() as usize {
                    // Send slots are registered with the first SEND from
                    // their part too long to go inline: a connection of
                    // small frames pins none.
                    mr.register()?;
                    self.send_slots_registered = true;
                    self.send_slots_used = true;
                }
                // SAFETY: the slot stays untouched until its send completion
                // frees it; the memory outlives the QP.
                unsafe {
                    self.qp.queue_send(
                        kind.wr_id(slot),
                        mr,
                        range.start..range.start + HEADER_LEN + body_len,
                    )
                }
            }
        }
    }

    /// Handles every completion waiting in the CQ, then posts what they
    /// allow; returns how many. Polled under the state lock, so completions
    /// are handled in the device's order whoever polls (the driver, or a
    /// receiver looking for its next frame).
    pub(super) fn drain_cq(&mut self, cq: &CompletionQueue, mem: &Buffers) -> usize {
        let mut total = 0;
        // Read once per drain, and only for completions the protocol paces
        // by (`WorkKind::is_paced`): small calls pay no clock read.
        let mut polled_at = None;
        loop {
            let n = match cq.poll_batch(&mut self.completed) {
                Ok(n) => n,
                Err(e) => {
                    self.fail(format!("polling the completion queue: {e}"));
                    return total;
                }
            };
            total += n;
            self.completions += n as u64;
            for i in 0..n {
                let wc = self.completed.get(i);
                self.on_completion(mem, &wc, &mut polled_at);
            }
            if !self.completed.is_full() {
                if total > 0 {
                    self.flush(mem);
                }
                return total;
            }
        }
    }

    /// Feeds one completion to the protocol, with a receive's header copied
    /// out of its slot, and the batch's time if its kind is paced.
    fn on_completion(
        &mut self,
        mem: &Buffers,
        wc: &WorkCompletion,
        polled_at: &mut Option<Instant>,
    ) {
        let failure = (!wc.is_ok()).then(|| format!("{} (status {})", wc.status_name(), wc.status));
        let mut header = [0; PEEK_LEN];
        let mut header_len = 0;
        let kind = WorkKind::from_wr_id(wc.wr_id);
        let at = match kind {
            Some((kind, _)) if kind.is_paced() => Some(*polled_at.get_or_insert_with(Instant::now)),
            _ => None,
        };
        if let Some((WorkKind::Recv, slot)) = kind {
            // A slot with no memory yet was never posted: the protocol
            // fails the connection for it, with nothing read.
            if failure.is_none() && mem.ring.has(slot) {
                header_len = (wc.byte_len as usize)
                    .min(PEEK_LEN)
                    .min(mem.ring.slot_size());
                // A raw copy out of the slot whose receive completed: the
                // device no longer writes it.
                mem.ring.read_into(slot, 0, &mut header[..header_len]);
            }
        }
        self.proto.handle_completion(Completion {
            wr_id: wc.wr_id,
            failure: failure.as_deref(),
            byte_len: wc.byte_len as usize,
            header: &header[..header_len],
            at,
        });
    }
}

impl LiveConnection for Shared {
    fn fail_from_device(&self, reason: &str) -> bool {
        let mut st = self.lock();
        let newly = st.proto.failure().is_none();
        if newly {
            st.fail(reason.to_string());
        }
        drop(st);
        // The driver disconnects and ends.
        self.wake_task.notify();
        newly
    }

    fn end_from_cm_event(&self, event: &str) {
        // The first such event counts; the driver acts on it.
        let _ = self.ended_by_cm.set(event.to_string());
        self.wake_task.notify();
    }

    fn summary(&self) -> String {
        let st = self.lock();
        format!(
            "{}: {} | handles {} released {} receiver {} | QP {}",
            self.peer,
            st.proto.summary(),
            st.handles,
            self.released.lock().map(|r| r.len()).unwrap_or(0),
            if st.recv_waker.is_some() {
                "waits"
            } else {
                "not waiting"
            },
            st.qp.describe(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every send slot has a place of its own, the first part holding the
    /// first data slots and every control and chunk slot.
    #[test]
    fn send_slots_lie_first_data_then_control_then_the_other_data() {
        for data_slots in [8, 9, 64, 256] {
            let all = data_slots + CTRL_SLOTS + HEAP_SLOTS;
            let mut places: Vec<u32> = (0..all).map(|s| send_position(s, data_slots)).collect();
            let first = FIRST_DATA_SLOTS + CTRL_SLOTS + HEAP_SLOTS;
            for slot in (0..FIRST_DATA_SLOTS).chain(data_slots..all) {
                assert!(places[slot as usize] < first, "slot {slot} of {data_slots}");
            }
            for slot in FIRST_DATA_SLOTS..data_slots {
                assert!(
                    places[slot as usize] >= first,
                    "slot {slot} of {data_slots}"
                );
            }
            places.sort_unstable();
            assert_eq!(
                places,
                (0..all).collect::<Vec<_>>(),
                "{data_slots} data slots"
            );
        }
    }
}
