//! The halves the application uses: the sink (encodes frames where the
//! protocol says, guarded against panicking encoders) and the source
//! (hands frames up, zero-copy from receive slots where it may).

use std::ops::Range;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes};
use rpc_core::frame::OutFrame;
use rpc_core::transport::{FrameSink, FrameSource, TransportError};
use rpc_core::PayloadBuffer;

use super::destinations::PoolBuffer;
use super::state::{connection_error, refusal_error, Buffers, Received, Shared, State};
use super::transfer::OutgoingTransfer;
use crate::proto::{Delivered, EncodeInto, Reservation, SendDecision, HEADER_LEN};

/// A rendezvous frame handed up in its destination: the destination goes
/// back to the connection (its bytes returned to the protocol's budget, the
/// memory kept as a spare or deregistered) when the last `Bytes` over it
/// drops.
struct PoolGuard {
    shared: Arc<Shared>,
    dest: Option<PoolBuffer>,
    len: usize,
}

impl AsRef<[u8]> for PoolGuard {
    fn as_ref(&self) -> &[u8] {
        let dest = self.dest.as_ref().expect("held until drop");
        // SAFETY: every READ into the destination completed before the
        // protocol delivered it, and no request uses it again (it left
        // the connection's table); it is local-write only, so the peer
        // cannot write it. Nothing writes it while this guard lives.
        unsafe { dest.mr.slice(0..self.len) }
    }
}

impl Drop for PoolGuard {
    fn drop(&mut self) {
        let dest = self.dest.take().expect("held until drop");
        self.shared.release_destination(self.len, dest);
    }
}

struct SlotGuard {
    pub(super) shared: Arc<Shared>,
    slot: u32,
    /// The frame's bytes in the slot.
    range: Range<usize>,
}

impl AsRef<[u8]> for SlotGuard {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the slot's receive completed and it is reposted only after
        // this guard drops; nothing writes it meanwhile (the ring is local
        // write only: the peer cannot write it).
        unsafe { self.shared.mem.ring.slice(self.slot, self.range.clone()) }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.shared
            .released
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.slot);
        self.shared.wake_task.notify();
    }
}

pub(crate) struct RdmaSink {
    pub(super) shared: Arc<Shared>,
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
    pub(super) shared: &'a Shared,
    reservation: Reservation,
}

impl Drop for CancelHeapOnUnwind<'_> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.proto.cancel_send(self.reservation);
        st.wake();
    }
}

impl RdmaSink {
    /// Sends one frame of `len` bytes, which `encode` writes (exactly
    /// `len` of them) straight into registered memory where the protocol
    /// places it; `Pending` while there is no room. See
    /// [`FrameSink::poll_send`].
    ///
    /// `call`: the rpc-core call the frame belongs to; a small frame may
    /// pass a large frame of another call still being sent. `None` for a
    /// byte stream's bytes: those that would wait for the peer's credits
    /// anyway are appended to the frame already waiting, if it has room
    /// ([`proto::Connection::append_inline`]), and nothing passes anything.
    ///
    /// `frame`: the frame `encode` writes, if it is an rpc-core frame; a
    /// frame sent by rendezvous is then gathered from it instead, its
    /// large `Bytes` read by the peer where they lie (no copy).
    ///
    /// [`proto::Connection::append_inline`]: crate::proto::Connection::append_inline
    pub(crate) fn poll_send_with(
        &self,
        cx: &mut Context<'_>,
        len: usize,
        call: Option<u64>,
        frame: Option<&OutFrame<'_>>,
        encode: impl FnOnce(&mut dyn BufMut),
    ) -> Poll<Result<(), TransportError>> {
        let shared = &*self.shared;
        let mem = &shared.mem;
        let mut st = shared.lock();
        let stream = call.is_none();
        if let Some((slot, at)) = stream.then(|| st.proto.append_inline(len)).flatten() {
            let start = HEADER_LEN + at;
            // SAFETY: the slot holds a frame queued and not posted (the
            // protocol appends only to such a one), so no work request
            // reads it and nothing else writes it while we hold the lock;
            // `at + len` fits the slot after the header (at most inline_max).
            let mut dst = unsafe { mem.send_slice_mut(slot, start..start + len) };
            // A panic here would send the slot's stale bytes: only the
            // stream's plain copies use this path, and they do not panic.
            encode(&mut dst);
            return Poll::Ready(Ok(()));
        }
        let reservation = match st.proto.handle_send(len) {
            SendDecision::Encode(reservation) => reservation,
            SendDecision::Wait => {
                // Posts what the wait needs (the first frame for the
                // peer's region asks for it).
                st.flush(mem);
                st.wait_send(cx);
                return Poll::Pending;
            }
            SendDecision::Refused(refusal) => return Poll::Ready(Err(refusal_error(refusal))),
        };
        // Keeps staging registered while a frame is encoded into it.
        let staging;
        let in_place = match st.proto.encode_into(&reservation) {
            EncodeInto::SendSlot { slot } => {
                // SAFETY: the slot was free: no posted send and no other
                // slice covers it; len fits a slot after the header
                // (len <= inline_max).
                Some(unsafe { mem.send_slice_mut(slot, HEADER_LEN..HEADER_LEN + len) })
            }
            EncodeInto::Staging { offset } => match st.staging(mem) {
                Ok(registered) => {
                    staging = registered;
                    // SAFETY: just allocated in the staging region: no
                    // posted WRITE reads it (the peer freed it) and no
                    // other slice.
                    Some(unsafe { staging.slice_mut(offset..offset + len) })
                }
                Err(e) => {
                    st.proto.cancel_send(reservation);
                    st.wake();
                    return Poll::Ready(Err(super::io_error("register the staging region", e)));
                }
            },
            EncodeInto::Heap | EncodeInto::Rendezvous { .. } => None,
        };
        if let Some(mut dst) = in_place {
            let encoding = CancelOnUnwind {
                state: &mut st,
                reservation,
            };
            encode(&mut dst);
            encoding.encoded();
            st.proto
                .queue_frame(reservation.in_lane(call), None)
                .expect("a frame encoded in place under the lock is always queued");
        } else if let EncodeInto::Rendezvous { slot, transfer } = st.proto.encode_into(&reservation)
        {
            // Registered for this transfer (gathered, or encoded without
            // the connection's lock, like a chunked frame).
            let room = st.proto.announce_room();
            drop(st);
            let encoding = CancelHeapOnUnwind {
                shared,
                reservation,
            };
            let registered = match frame {
                Some(frame) => {
                    let pool = shared.payloads.as_ref().map(|(pool, _)| pool);
                    OutgoingTransfer::gathered(&mem.pd, pool, frame, room)
                }
                None => OutgoingTransfer::encoded(&mem.pd, len, encode),
            };
            let mut out = match registered {
                Ok(out) => out,
                Err(e) => {
                    drop(encoding);
                    return Poll::Ready(Err(super::io_error("register a rendezvous frame", e)));
                }
            };
            std::mem::forget(encoding);
            let body_len = out.announcement().encoded_len();
            let reservation = reservation.announcing(body_len);
            st = shared.lock();
            if let Err(refusal) = st.proto.queue_frame(reservation, None) {
                st.wake();
                return Poll::Ready(Err(refusal_error(refusal)));
            }
            let pool = shared.payloads.as_ref().map(|(pool, _)| pool);
            if let Err(e) = out.bind_windows(pool, &mut st.qp) {
                // The announcement is queued: the connection cannot go on
                // without it.
                let reason = format!("binding a memory window for a rendezvous frame: {e}");
                st.fail(reason.clone());
                return Poll::Ready(Err(connection_error(&reason)));
            }
            // SAFETY: the announcement's send slot is this reservation's
            // until its SEND completes, and it is posted only by the
            // flush below; the body fits the slot (at most `room` bytes,
            // what the peer's slot holds after the header).
            let body = unsafe { mem.send_slice_mut(slot, HEADER_LEN..HEADER_LEN + body_len) };
            out.encode_announcement(body);
            st.out_transfers.insert(transfer, out);
        } else {
            // A chunked frame (up to the frame limit, 64 MiB) is gathered
            // (its large `Bytes` by reference: each chunk is copied into
            // staging from where the application left it) or encoded,
            // without the connection's lock: completions, receivers and
            // other senders go on meanwhile; its place is reserved. So is
            // staging's registration, if it has none.
            let register_staging = st.staging.is_none();
            drop(st);
            let encoding = CancelHeapOnUnwind {
                shared,
                reservation,
            };
            let registered = match register_staging.then(|| mem.register_staging()).transpose() {
                Ok(registered) => registered,
                Err(e) => {
                    drop(encoding);
                    return Poll::Ready(Err(super::io_error("register the staging region", e)));
                }
            };
            let data = match frame {
                Some(frame) => super::transfer::pieces(frame),
                None => {
                    let mut data = Vec::with_capacity(len);
                    encode(&mut data);
                    Bytes::from(data).into()
                }
            };
            std::mem::forget(encoding);
            st = shared.lock();
            st.use_staging(registered);
            let reservation = reservation.in_lane(call);
            if let Err(refusal) = st.proto.queue_frame(reservation, Some(data)) {
                st.wake();
                return Poll::Ready(Err(refusal_error(refusal)));
            }
        }
        st.flush(mem);
        Poll::Ready(Ok(()))
    }

    /// Ready once every frame accepted so far is posted to the device
    /// (`closed`: and our `Close` after them, every request completed:
    /// the peer's device has it all). Fails if the connection failed, or
    /// went down with frames unsent.
    pub(crate) fn poll_sent(
        &self,
        cx: &mut Context<'_>,
        closed: bool,
    ) -> Poll<Result<(), TransportError>> {
        let mut st = self.shared.lock();
        if let Some(reason) = st.proto.failure() {
            return Poll::Ready(Err(connection_error(reason)));
        }
        let done = if closed {
            st.proto.is_drained()
        } else {
            st.proto.queued() == 0
        };
        if done {
            return Poll::Ready(Ok(()));
        }
        if st.proto.is_disconnected() {
            return Poll::Ready(if st.proto.queued() == 0 {
                Ok(())
            } else {
                Err(TransportError::Closed)
            });
        }
        st.wait_send(cx);
        Poll::Pending
    }

    /// Ends the connection at once, without `Close`: nothing queued is
    /// sent, and the driver disconnects, so the peer's reads and writes
    /// fail (`ConnectionReset`) rather than end.
    pub(crate) fn reset(&self, why: &str) {
        self.shared.lock().fail(why.to_string());
        self.shared.wake_task.notify();
    }

    /// The peer's address, `rdma://IP:PORT`.
    pub(crate) fn peer(&self) -> &str {
        &self.shared.peer
    }

    /// The longest frame that travels in one piece (one SEND, or one RDMA
    /// WRITE encoded in place): a longer one is encoded on the heap first.
    pub(crate) fn max_unchunked(&self) -> usize {
        self.shared.lock().proto.max_unchunked()
    }
}

impl FrameSink for RdmaSink {
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        frame: &OutFrame<'_>,
    ) -> Poll<Result<(), TransportError>> {
        self.poll_send_with(cx, frame.len(), Some(frame.call_id()), Some(frame), |dst| {
            frame.encode(dst)
        })
    }

    fn close(&self) {
        let mut st = self.shared.lock();
        st.proto.close();
        st.flush(&self.shared.mem);
    }

    fn poll_payload_buffer(
        &self,
        cx: &mut Context<'_>,
        len: usize,
    ) -> Poll<Result<PayloadBuffer, TransportError>> {
        match &self.shared.payloads {
            Some((pool, threshold)) if len >= *threshold => pool.poll_buffer(cx, len),
            // Sent inline or through the region: copied either way.
            _ => Poll::Ready(Ok(PayloadBuffer::heap(len))),
        }
    }

    fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut st = self.shared.lock();
        if st.is_closed() {
            return Poll::Ready(());
        }
        if !st.close_waiters.iter().any(|w| w.will_wake(cx.waker())) {
            st.close_waiters.push(cx.waker().clone());
        }
        drop(st);
        // The driver looks at every turn of its loop: one now, for what
        // completed before this waiter came.
        self.shared.wake_task.notify();
        Poll::Pending
    }
}

impl Drop for RdmaSink {
    fn drop(&mut self) {
        self.close();
        self.shared.lock().handles -= 1;
        self.shared.wake_task.notify();
    }
}

pub(crate) struct RdmaSource {
    pub(super) shared: Arc<Shared>,
    pub(super) spin: BusyPoll,
}

impl FrameSource for RdmaSource {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, TransportError>> {
        let shared = &self.shared;
        let mem: &Buffers = &shared.mem;
        let mut st = shared.lock();
        // With a busy-poll window: until when this poll spins on the CQ.
        let mut spin: Option<Spin> = None;
        let result = loop {
            let state = &mut *st;
            let received = Received {
                ring: &mem.ring,
                region: state.region.as_ref().map(|region| &region.mr),
            };
            let Some(delivered) = state.proto.poll_delivery(&received) else {
                // Look in the CQ before waiting for the driver: a frame
                // that is already there is not delayed by a wake-up, and
                // this task does not wake itself for it. Another task's
                // waker stays, and is woken for what the CQ held: more
                // than `FrameSource::poll_recv` asks (rpc-core hands the
                // source back itself now), kept since rpc-core once relied
                // on it (without it, calls stalled until the keepalive).
                st.recv_waker = st.recv_waker.take().filter(|w| !w.will_wake(cx.waker()));
                if st.drain_cq(&shared.cq, mem) > 0 {
                    continue;
                }
                // Return what the chunks handled above freed.
                st.flush(mem);
                let spinning = match &mut spin {
                    Some(spin) => spin.go_on(),
                    None => {
                        spin = self.spin.slice().map(Spin::new);
                        spin.is_some()
                    }
                };
                if spinning {
                    // Without the lock: senders and the driver go on.
                    drop(st);
                    std::hint::spin_loop();
                    st = shared.lock();
                    continue;
                }
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
                    break Ok(Some(Bytes::from_owner(SlotGuard {
                        shared: Arc::clone(shared),
                        slot,
                        range: HEADER_LEN..HEADER_LEN + len,
                    })));
                }
                Delivered::CopyOut { slot, len } => {
                    // SAFETY: the slot's receive completed; it is reposted
                    // only below, after this slice's last use.
                    let data = unsafe { mem.ring.slice(slot, HEADER_LEN..HEADER_LEN + len) };
                    let bytes = Bytes::copy_from_slice(data);
                    st.proto.handle_copied(slot);
                    break Ok(Some(bytes));
                }
                Delivered::Frame(frame) => break Ok(Some(frame)),
                Delivered::Pooled { transfer, len } => {
                    let dest = st
                        .destinations
                        .remove(&transfer)
                        .expect("a delivered transfer's destination");
                    break Ok(Some(Bytes::from_owner(PoolGuard {
                        shared: Arc::clone(shared),
                        dest: Some(dest),
                        len,
                    })));
                }
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

/// Longest a receiver spins on the CQ inside one poll before it yields to
/// the runtime's other tasks (see [`BusyPoll`]).
const SPIN_SLICE: Duration = Duration::from_micros(50);

/// The receiver's busy-poll window ([`RdmaTransport::busy_poll`](crate::RdmaTransport::busy_poll)): after
/// the last frame, for `window`, a receiver that finds nothing polls again
/// instead of waiting for the completion channel's event. It alternates:
/// it yields (asks to be polled again at once, so that the tasks it woke,
/// a handler it spawned, run first), then spins on the CQ inside its next
/// poll for up to [`SPIN_SLICE`], then yields again.
///
/// Yielding alone at every poll cost more than it saved on a
/// multi-threaded runtime: each yield of the spinning task made tokio wake
/// an idle worker to steal it, so every worker of both processes ran, and
/// in a 2-vCPU guest busy polling was no faster than events (p50 330-750
/// µs, p99 ~3 ms at 32 B, where one worker per process gave 150-220 µs).
pub(super) struct BusyPoll {
    window: Option<Duration>,
    idle_since: Option<Instant>,
    polls: u32,
    /// The last poll that found nothing yielded (the next one may spin).
    yielded: bool,
}

impl BusyPoll {
    pub(super) fn new(window: Option<Duration>) -> Self {
        Self {
            window,
            idle_since: None,
            polls: 0,
            yielded: false,
        }
    }

    /// How long this poll may spin on the CQ: after a yield, within the
    /// window.
    fn slice(&mut self) -> Option<Duration> {
        let window = self.window?;
        if !std::mem::take(&mut self.yielded) {
            return None;
        }
        let since = *self.idle_since.get_or_insert_with(Instant::now);
        let left = window.checked_sub(since.elapsed())?;
        Some(left.min(SPIN_SLICE))
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
        self.yielded = self.polls % 16 != 0 || since.elapsed() < window;
        self.yielded
    }

    fn reset(&mut self) {
        self.idle_since = None;
        self.polls = 0;
        self.yielded = false;
    }
}

/// One poll's spin on the CQ: until `until`, the clock read every few
/// rounds (a system call in an emulated guest).
struct Spin {
    until: Instant,
    rounds: u32,
}

impl Spin {
    fn new(slice: Duration) -> Spin {
        Spin {
            until: Instant::now() + slice,
            rounds: 0,
        }
    }

    /// Whether to look at the CQ once more.
    fn go_on(&mut self) -> bool {
        self.rounds = self.rounds.wrapping_add(1);
        self.rounds % 32 != 0 || Instant::now() < self.until
    }
}

impl Drop for RdmaSource {
    fn drop(&mut self) {
        self.shared.lock().handles -= 1;
        self.shared.wake_task.notify();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_polling_yields_then_spins_a_slice_then_yields_again() {
        let mut poll = BusyPoll::new(Some(Duration::from_secs(60)));
        // Right after a frame: yield first (what it woke runs first).
        assert_eq!(poll.slice(), None);
        assert!(poll.keep_polling());
        // After a yield: one slice of spinning, then a yield again.
        assert_eq!(poll.slice(), Some(SPIN_SLICE));
        assert_eq!(poll.slice(), None);
        assert!(poll.keep_polling());
        assert_eq!(poll.slice(), Some(SPIN_SLICE));
        // A frame starts over.
        poll.reset();
        assert_eq!(poll.slice(), None);
    }

    #[test]
    fn past_the_window_or_without_one_nothing_spins() {
        let mut off = BusyPoll::new(None);
        assert!(!off.keep_polling());
        assert_eq!(off.slice(), None);
        let mut poll = BusyPoll::new(Some(Duration::from_millis(1)));
        assert!(poll.keep_polling());
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(poll.slice(), None, "the window has passed");
        // The clock is read every 16th poll: within 16 polls it sleeps.
        assert!((0..16).any(|_| !poll.keep_polling()));
    }

    #[test]
    fn a_spin_reads_the_clock_every_32_rounds() {
        let mut spin = Spin::new(Duration::ZERO);
        assert!((0..31).all(|_| spin.go_on()));
        assert!(!spin.go_on(), "the slice has passed");
    }
}
