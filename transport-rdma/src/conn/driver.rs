//! The connection's driver task: completions, connection-manager events
//! and released slots in; it ends when the connection failed or both
//! halves are dropped and everything was sent.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use rpc_core::transport::{Connection, FrameLimits, TransportError};
use tokio::io::unix::AsyncFd;

use super::destinations::PoolBuffer;
use super::io::{BusyPoll, RdmaSink, RdmaSource};
use super::io_error;
use super::setup::Established;
use super::state::Shared;
use crate::device_events;
use crate::registry;
use crate::teardown;
use crate::verbs::{CmId, CompletionChannel};
use crate::RdmaTransport;

struct CqFd(CompletionChannel);

impl AsRawFd for CqFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.fd()
    }
}

fn register(inner: CqFd) -> Result<AsyncFd<CqFd>, TransportError> {
    // SAFETY: `inner` owns the channel whose open descriptor it returns,
    // always the same one; the AsyncFd owns `inner`, so the descriptor
    // stays open until the AsyncFd is dropped (it deregisters before
    // dropping `inner`).
    unsafe { AsyncFd::register(inner) }
        .map_err(|e| TransportError::io("register the completion channel", e.into_parts().1))
}

/// Starts an established connection's driver task; returns its frame
/// halves.
pub(crate) fn start(
    est: Established,
    limits: FrameLimits,
    cfg: &RdmaTransport,
) -> Result<Connection, TransportError> {
    // rpc-core pings its connections itself.
    let identity = est.peer_identity().map(str::to_string);
    let (sink, source) = start_halves(est, limits, cfg, None)?;
    let peer = sink.shared.peer.clone();
    Ok(Connection {
        sink: Arc::new(sink),
        source: Box::new(source),
        peer,
        identity,
    })
}

/// [`start`], with the halves as they are (for the byte stream), and a
/// keepalive: after `keepalive` with no completion the peer is sent a
/// control message ([`proto::Connection::probe`]), so a vanished peer
/// fails the connection when its retries run out.
///
/// [`proto::Connection::probe`]: crate::proto::Connection::probe
pub(crate) fn start_halves(
    est: Established,
    limits: FrameLimits,
    cfg: &RdmaTransport,
    keepalive: Option<Duration>,
) -> Result<(RdmaSink, RdmaSource), TransportError> {
    let placement = est
        .placement()
        .map_err(|e| io_error("find the connection's device objects", e))?;
    // From here on the QP and the memory live in `Shared` (QP first), so
    // an error below drops them in that order.
    let (shared, mut id, cc) = est.into_shared(limits, cfg);
    let cq_fd = register(CqFd(cc))?;
    let live: Arc<dyn registry::LiveConnection> = Arc::clone(&shared) as _;
    registry::add(Arc::downgrade(&live), placement);
    // After the connection is in the registry: a starting watcher acts on the
    // events that queued before it, this connection's included, and the
    // connection manager's events for the id (those not read yet come
    // along) go to the watcher from here on.
    let device_watch = device_events::watch(&id)?;
    id.migrate(device_watch.cm_channel())
        .map_err(|e| io_error("move the connection's events to its device's watcher", e))?;
    shared
        .cq
        .arm()
        .map_err(|e| io_error("arm the completion queue", e))?;
    tokio::spawn(drive(
        Arc::clone(&shared),
        Driver {
            cq_fd,
            id,
            keepalive,
            release_idle_memory: cfg.release_idle_memory,
            _device_watch: device_watch,
        },
    ));
    Ok((
        RdmaSink {
            shared: Arc::clone(&shared),
        },
        RdmaSource {
            shared,
            spin: BusyPoll::new(cfg.busy_poll),
        },
    ))
}

struct Driver {
    cq_fd: AsyncFd<CqFd>,
    /// The connection's `cm_id`; its events are read by the device's
    /// watcher, which sets [`Shared::ended_by_cm`].
    id: CmId,
    keepalive: Option<Duration>,
    /// Staging, the peer's region and registered send slots unused this
    /// long are let go ([`State::release_idle_regions`],
    /// [`State::release_idle_send_slots`]).
    ///
    /// [`State::release_idle_regions`]: super::state::State::release_idle_regions
    /// [`State::release_idle_send_slots`]: super::state::State::release_idle_send_slots
    release_idle_memory: Option<Duration>,
    /// Keeps the device's async-event watcher running while the driver does.
    _device_watch: device_events::WatchLease,
}

/// Handles every completion waiting in the CQ; returns how many. Large
/// posts it decides are left to the driver's post step ([`drive`]).
fn drain_cq(shared: &Shared) -> usize {
    shared.lock().drain_cq(&shared.cq, &shared.mem)
}

/// Reposts the slots the application released, and gives the pool back
/// the rendezvous frames it dropped. `slots` and `pooled` are the driver's
/// own lists, empty: swapped with the shared ones, so that neither is
/// allocated anew for every slot released (it was: 2 allocations a call).
fn repost_released(shared: &Shared, slots: &mut Vec<u32>, pooled: &mut Vec<(usize, PoolBuffer)>) {
    std::mem::swap(
        &mut *shared.released.lock().unwrap_or_else(|e| e.into_inner()),
        slots,
    );
    std::mem::swap(
        &mut *shared
            .pool_released
            .lock()
            .unwrap_or_else(|e| e.into_inner()),
        pooled,
    );
    if slots.is_empty() && pooled.is_empty() {
        return;
    }
    let mut st = shared.lock();
    for slot in slots.drain(..) {
        st.proto.handle_released(slot);
    }
    for (len, destination) in pooled.drain(..) {
        st.release_destination(len, destination);
    }
    st.flush(&shared.mem);
}

/// Ticks every `period`, the first a period from now; a late tick
/// delays the next ones.
fn ticks_every(period: Duration) -> tokio::time::Interval {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks
}

/// The connection's driver: completions, connection-manager events,
/// released slots; ends when the connection failed or both halves are
/// dropped and everything was sent.
async fn drive(shared: Arc<Shared>, mut d: Driver) {
    // Once both halves are dropped, what was sent still goes out (and our
    // `Close` after it) while the peer takes it; a peer that takes nothing
    // for `LINGER` is given up on.
    const LINGER: Duration = Duration::from_secs(5);
    let mut linger_since: Option<Instant> = None;
    let mut unsent = (0, 0);
    let mut keepalive = d.keepalive.map(ticks_every);
    // Ticks while this side holds staging, the peer's region, registered
    // send slots or a grown receive ring (a connection whose frames all go
    // inline, a few at a time, has no timer for it).
    let mut idle_checks: Option<tokio::time::Interval> = None;
    let mut seen_at_tick = 0;
    // A probe was posted at the last tick and nothing completed since.
    let mut probe_unanswered = false;
    let mut cm_end_taken = false;
    let (mut released, mut pooled) = (Vec::new(), Vec::new());
    loop {
        let ended = (!cm_end_taken).then(|| shared.ended_by_cm.get()).flatten();
        let drained = drain_cq(&shared);
        repost_released(&shared, &mut released, &mut pooled);
        if shared.pool_wait.as_ref().is_some_and(|w| w.room_came()) {
            // Another connection's frame gave the pool room back.
            let mut st = shared.lock();
            st.proto.handle_pool_room();
            st.flush(&shared.mem);
        }
        if let Some(event) = ended {
            cm_end_taken = true;
            // What the peer sent before it went was in the CQ, taken just
            // now (its `Close`, its last frames). Orderly if the peer said
            // Close first (what arrived before it is still delivered); else
            // a failure.
            let mut st = shared.lock();
            st.proto
                .handle_disconnected(&format!("{}: {event}", shared.peer));
            st.wake();
        }
        if drained > 0 {
            // The tasks just woken (a receiver whose frame arrived, senders
            // given room) wait in this worker's LIFO slot, which no other
            // worker steals, until this task yields: let them run before
            // the large posts below (on Soft-RoCE the kernel transmits a
            // posted chunk inside `ibv_post_send`), and before the next
            // completions, which keep coming while a tensor moves. Without
            // this a small call's answer, arrived, waited ~1 s behind a
            // 64 MiB frame on the same connection (`hol-bench`).
            tokio::task::yield_now().await;
        }
        {
            // Letting it go posts what was left to the driver.
            let mut st = shared.lock_driver();
            st.wake_if_closed();
            if st.proto.failure().is_some() || (st.proto.is_disconnected() && st.handles == 0) {
                break;
            }
            if let Some(period) = d.release_idle_memory {
                let holds = st.holds_idle_memory();
                if holds != idle_checks.is_some() {
                    idle_checks = holds.then(|| ticks_every(period));
                }
            }
            if st.handles == 0 {
                let done = st.proto.is_drained();
                let now = (st.proto.queued(), st.proto.in_flight());
                if std::mem::replace(&mut unsent, now) != now {
                    linger_since = None;
                }
                let since = *linger_since.get_or_insert_with(Instant::now);
                if done || since.elapsed() > LINGER {
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
        let mut completions_came = false;
        tokio::select! {
            // Polled rather than awaited through `readable()`, whose future
            // joins the descriptor's list of waiters and leaves it again at
            // every round of this loop (~1,000 instructions a call).
            ready = std::future::poll_fn(|cx| d.cq_fd.poll_read_ready(cx)) => {
                completions_came = true;
                match ready {
                    Ok(mut guard) => guard.clear_ready(),
                    Err(e) => { shared.lock().fail(format!("waiting for completions: {e}")); continue; }
                }
                // At most one event waits: an armed CQ raises one and is
                // armed again only below, after it was taken. Reading on
                // until the channel is empty cost a `read` that found
                // nothing, every time.
                if let Err(e) = d.cq_fd.get_ref().0.try_take_event() {
                    shared.lock().fail(format!("reading the completion channel: {e}"));
                }
                if let Err(e) = shared.cq.arm() {
                    shared.lock().fail(format!("arming the completion queue: {e}"));
                }
            }
            () = std::future::poll_fn(|cx| shared.wake_task.poll_notified(cx)) => {}
            () = linger => {}
            _ = async { idle_checks.as_mut().expect("checked").tick().await }, if idle_checks.is_some() => {
                let mut st = shared.lock();
                let staging = st.release_idle_regions();
                let send_slots = st.release_idle_send_slots(&shared.mem);
                let ring = st.proto.shrink_idle_ring();
                st.flush(&shared.mem);
                drop(st);
                if ring {
                    tracing::debug!("{}: the peer kept few messages in flight for a while: the receive ring shrinks back to its first slots", shared.peer);
                }
                if staging.is_some() {
                    tracing::debug!("{}: no large frame for a while: staging and the peer's region let go", shared.peer);
                }
                if send_slots > 0 {
                    tracing::debug!("{}: no frame too long to go inline for a while: {send_slots} bytes of send slots deregistered", shared.peer);
                }
                // Deregistered here, without the lock.
                drop(staging);
            }
            _ = async { keepalive.as_mut().expect("checked").tick().await }, if keepalive.is_some() => {
                let period = keepalive.as_ref().expect("checked").period();
                let mut st = shared.lock();
                if std::mem::replace(&mut seen_at_tick, st.completions) != st.completions {
                    probe_unanswered = false;
                } else if probe_unanswered {
                    // A live peer's device acknowledges at once.
                    st.fail(format!(
                        "{}: the peer's device did not acknowledge a keepalive probe within {period:?} (peer host down or link cut?)",
                        shared.peer
                    ));
                } else {
                    // Nothing completed for a whole period: ask the peer's
                    // device. (Not if the probe must wait for a credit: a
                    // peer that grants none is alive, only slow to read.)
                    tracing::debug!("{}: nothing completed for {period:?}: keepalive probe", shared.peer);
                    st.proto.probe();
                    st.flush(&shared.mem);
                    probe_unanswered = !st.proto.probe_pending();
                }
            }
        }
        shared.wake_task.stop_waiting();
        if !completions_came {
            // Another branch woke the driver: the channel's waker, left
            // with tokio, would wake it again for an event that comes while
            // it works, which it sees at its next wait anyway. A waker that
            // does nothing takes its place, as `readable()`'s future left
            // the list of waiters when dropped. (Without this line, 32 B
            // calls one at a time made 0.89-0.94x the calls/s in a
            // same-boot A/B; with it, no change beyond noise.)
            let _ = d
                .cq_fd
                .poll_read_ready(&mut Context::from_waker(Waker::noop()));
        }
    }
    let _ = d.id.disconnect();
    if let Some(wait) = &shared.pool_wait {
        wait.leave();
    }
    // Wake whoever waits: they see the failure (or the end).
    let mut st = shared.lock();
    for w in st.send_waiters.drain(..) {
        w.wake();
    }
    for w in st.close_waiters.drain(..) {
        w.wake();
    }
    if let Some(w) = st.recv_waker.take() {
        w.wake();
    }
    drop(st);
    // The cm_id and the completion channel, out of tokio's reactor here,
    // go to the teardown thread too (destroyed there once the connection's
    // other objects, which hold them, are).
    let Driver { cq_fd, id, .. } = d;
    teardown::drop_later((shared, id, cq_fd.into_inner()));
}
