//! Device async events: which event fails which connections, and the one
//! watcher per device that reads them.
//!
//! A queue pair error, a completion queue overrun, a port going down or a
//! dead device are reported on the device context's async event descriptor,
//! not (or not at once) as failed work requests: with no work posted a
//! connection would not notice them until rpc-core's keepalive gives up.
//!
//! librdmacm opens each device once per process, so all connections on a
//! device share one context and one descriptor. The first connection on a
//! device starts a watcher for it (a thread with a small tokio runtime of
//! its own, so that it outlives the runtime of whoever connected first);
//! every connection holds a [`WatchLease`], and the watcher stops when the
//! last lease on its device is dropped. Events that queued while no watcher
//! ran are read when the next one starts (see [`backlog_target`]).
//!
//! The watcher also reads the connection manager's events of the
//! device's established connections: each moves its `cm_id` to the
//! watcher's event channel ([`WatchLease::cm_channel`]), so a connection
//! holds no descriptor of its own for them, and the watcher ends the one
//! an event ends ([`registry::end_by_cm_event`]). Those events that come
//! while no watcher runs are not needed: the watcher stops only once no
//! connection on the device is left.
//!
//! The policy ([`target`]) is a pure function, tested on any machine; the
//! reading is [`AsyncEvents`]'s, in the verbs layer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rpc_core::transport::TransportError;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use crate::registry::{self, Target};
use crate::verbs::{
    AsyncEvent, AsyncEventKind, AsyncEvents, CmEventRecord, CmId, DeviceId, EventChannel,
    EventElement,
};

/// Which connections `event` fails, if any.
pub(crate) fn target(event: &AsyncEvent) -> Option<Target> {
    use AsyncEventKind as K;
    match (event.kind, event.element) {
        (K::QpFatal | K::QpReqErr | K::QpAccessErr | K::PathMigErr, EventElement::Qp(qp)) => {
            Some(Target::Qp(qp))
        }
        (K::CqErr, EventElement::Cq(cq)) => Some(Target::Cq(cq)),
        (K::PortErr, EventElement::Port(port)) => Some(Target::Port(port)),
        (K::DeviceFatal, _) => Some(Target::Device),
        // Informational (COMM_EST, PORT_ACTIVE, LID/GID/P_Key changes,
        // SQ_DRAINED, LAST_WQE_REACHED, ...), about objects this crate does
        // not make (SRQs, WQs), or naming nothing we can find.
        _ => None,
    }
}

/// As [`target`], for an event that queued while no watcher ran: a port
/// error counts only if the port is still not active (`port_active`), as
/// the connections it would fail were made after it, on a port that came
/// back. QP and CQ events name live objects only: the kernel drops the
/// unread events of a destroyed one.
pub(crate) fn backlog_target(
    event: &AsyncEvent,
    port_active: impl FnOnce(u8) -> bool,
) -> Option<Target> {
    match target(event)? {
        Target::Port(port) if port_active(port) => None,
        target => Some(target),
    }
}

/// Why the connections an event fails fail, naming the event and device,
/// e.g. `rxe0 port 1: IBV_EVENT_PORT_ERR (port went down)`.
pub(crate) fn reason(device: &str, event: &AsyncEvent) -> String {
    let what = format!("{} ({})", event.kind.name(), event.kind.description());
    match event.element {
        EventElement::Port(port) => format!("{device} port {port}: {what}"),
        EventElement::Qp(qp) => format!("{device} QP {qp:#x}: {what}"),
        EventElement::Cq(_) => format!("{device} completion queue: {what}"),
        _ => format!("{device}: {what}"),
    }
}

/// Keeps the watcher of a connection's device running (see the module docs).
pub(crate) struct WatchLease {
    device: DeviceId,
    watcher: u64,
    cm_channel: Arc<EventChannel>,
}

impl WatchLease {
    /// The event channel the watcher reads: move the connection's `cm_id`
    /// to it ([`CmId::migrate`]).
    pub(crate) fn cm_channel(&self) -> &Arc<EventChannel> {
        &self.cm_channel
    }
}

/// A running watcher: how many leases hold it, its connection-manager
/// channel, and its stop signal (it stops when this is dropped).
struct Watcher {
    device: DeviceId,
    id: u64,
    leases: usize,
    cm_channel: Arc<EventChannel>,
    _stop: oneshot::Sender<()>,
}

static WATCHERS: Mutex<Vec<Watcher>> = Mutex::new(Vec::new());
static NEXT_WATCHER: AtomicU64 = AtomicU64::new(0);

fn watchers() -> std::sync::MutexGuard<'static, Vec<Watcher>> {
    WATCHERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Makes sure the device of `id` (an established connection's, already
/// findable by [`crate::registry::fail_on_device`]) has a watcher; the lease
/// keeps it running.
pub(crate) fn watch(id: &CmId) -> Result<WatchLease, TransportError> {
    let context = "watch the device's async events";
    let verbs_error =
        |e: crate::verbs::Error| TransportError::io(context, std::io::Error::other(e));
    let device = id.device_id().map_err(verbs_error)?;
    let mut registry = watchers();
    if let Some(w) = registry.iter_mut().find(|w| w.device == device) {
        w.leases += 1;
        return Ok(WatchLease {
            device,
            watcher: w.id,
            cm_channel: Arc::clone(&w.cm_channel),
        });
    }
    let cm_channel = EventChannel::new().map_err(verbs_error)?;
    let events = AsyncEvents::new(id).map_err(verbs_error)?;
    let name = events.device_name();
    take_backlog(&events, &name);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|e| TransportError::io(context, e))?;
    let (fd, cm_fd) = {
        let _in_runtime = runtime.enter();
        // SAFETY: `EventsFd` owns the `AsyncEvents`, which keeps the device
        // context open (see its docs): the descriptor it returns is always
        // the same and stays open until the AsyncFd (which owns it) drops.
        let fd = unsafe { AsyncFd::register(EventsFd(events)) }
            .map_err(|e| TransportError::io(context, e.into_parts().1))?;
        // SAFETY: likewise, the `Arc` keeps the channel and its descriptor.
        let cm_fd = unsafe { AsyncFd::register(Arc::clone(&cm_channel)) }
            .map_err(|e| TransportError::io(context, e.into_parts().1))?;
        (fd, cm_fd)
    };
    let (stop, stopped) = oneshot::channel();
    let watcher = NEXT_WATCHER.fetch_add(1, Ordering::Relaxed);
    std::thread::Builder::new()
        .name(format!("rdma-events-{name}"))
        .spawn(move || {
            runtime.block_on(run(fd, cm_fd, name, stopped));
            // A watcher that stopped on its own (a read error) leaves the
            // registry, so that the next connection starts a new one.
            watchers().retain(|w| w.id != watcher);
        })
        .map_err(|e| TransportError::io(context, e))?;
    registry.push(Watcher {
        device,
        id: watcher,
        leases: 1,
        cm_channel: Arc::clone(&cm_channel),
        _stop: stop,
    });
    Ok(WatchLease {
        device,
        watcher,
        cm_channel,
    })
}

impl Drop for WatchLease {
    fn drop(&mut self) {
        let mut watchers = watchers();
        if let Some(i) = watchers
            .iter()
            .position(|w| w.device == self.device && w.id == self.watcher)
        {
            watchers[i].leases -= 1;
            if watchers[i].leases == 0 {
                // Dropping its stop signal ends the watcher.
                watchers.swap_remove(i);
            }
        }
    }
}

/// The context's event descriptor, registered with tokio.
struct EventsFd(AsyncEvents);

impl std::os::fd::AsRawFd for EventsFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.fd()
    }
}

/// Acts on the events that queued while no watcher ran.
fn take_backlog(events: &AsyncEvents, name: &str) {
    loop {
        match events.try_next() {
            Ok(Some(event)) => {
                let target =
                    backlog_target(&event, |port| events.port_is_active(port).unwrap_or(false));
                act(events.device_id(), name, &event, target, "queued ");
            }
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("{name}: reading queued async events: {e}");
                return;
            }
        }
    }
}

/// The watcher: reads the device's async events and its connections'
/// connection-manager events until stopped (or reading fails).
async fn run(
    fd: AsyncFd<EventsFd>,
    cm_fd: AsyncFd<Arc<EventChannel>>,
    name: String,
    mut stop: oneshot::Receiver<()>,
) {
    let events = &fd.get_ref().0;
    let device = events.device_id();
    loop {
        tokio::select! {
            ready = fd.readable() => {
                match ready {
                    Ok(mut guard) => guard.clear_ready(),
                    Err(e) => {
                        give_up(device, &name, &format!("waiting for async events: {e}"));
                        return;
                    }
                }
                loop {
                    match events.try_next() {
                        Ok(Some(event)) => act(device, &name, &event, target(&event), ""),
                        Ok(None) => break,
                        Err(e) => {
                            give_up(device, &name, &format!("reading async events: {e}"));
                            return;
                        }
                    }
                }
            }
            ready = cm_fd.readable() => {
                match ready {
                    Ok(mut guard) => guard.clear_ready(),
                    Err(e) => {
                        give_up(device, &name, &format!("waiting for connection manager events: {e}"));
                        return;
                    }
                }
                loop {
                    match cm_fd.get_ref().try_next() {
                        Ok(Some(event)) => end_connection(&event),
                        Ok(None) => break,
                        Err(e) => {
                            give_up(device, &name, &format!("reading connection manager events: {e}"));
                            return;
                        }
                    }
                }
            }
            _ = &mut stop => return,
        }
    }
}

/// Ends the connection a connection-manager event ends (a disconnect, an
/// address change, the device's removal); the others (`TIMEWAIT_EXIT`)
/// need nothing.
fn end_connection(event: &CmEventRecord) {
    let kind = event.event();
    if !kind.ends_connection() {
        tracing::debug!("connection manager event {}: nothing to do", kind.name());
        return;
    }
    if !registry::end_by_cm_event(event.id_addr(), &kind.name()) {
        tracing::debug!(
            "connection manager event {} for a connection gone already",
            kind.name()
        );
    }
}

fn act(device: DeviceId, name: &str, event: &AsyncEvent, target: Option<Target>, queued: &str) {
    let reason = reason(name, event);
    match target {
        Some(target) => {
            let failed = registry::fail_on_device(device, target, &reason);
            tracing::warn!("{queued}async event {reason}: failed {failed} connection(s)");
        }
        None => tracing::debug!("{queued}async event {reason}: nothing to do"),
    }
}

/// The device's events can no longer be read: its connections are not
/// watched any more, so fail them (a device that stops reporting events is
/// most likely gone).
fn give_up(device: DeviceId, name: &str, what: &str) {
    let reason = format!("{name}: {what}");
    let failed = registry::fail_on_device(device, Target::Device, &reason);
    tracing::warn!("{reason}: failed {failed} connection(s)");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Placement;
    use crate::verbs::CqId;
    use AsyncEventKind as K;

    fn event(kind: AsyncEventKind, element: EventElement) -> AsyncEvent {
        AsyncEvent { kind, element }
    }

    const RXE: DeviceId = DeviceId(0x1000);
    const OTHER: DeviceId = DeviceId(0x2000);
    const CONN: Placement = Placement {
        device: RXE,
        port: 1,
        qp_num: 0x11,
        cq: CqId(0xc0),
        cm_id: 0x5000,
    };

    #[test]
    fn queue_pair_errors_fail_the_owner_of_the_queue_pair() {
        for kind in [K::QpFatal, K::QpReqErr, K::QpAccessErr, K::PathMigErr] {
            let t = target(&event(kind, EventElement::Qp(0x11)));
            assert_eq!(t, Some(Target::Qp(0x11)), "{kind:?}");
            assert!(CONN.is_hit(RXE, t.unwrap()));
            assert!(!CONN.is_hit(RXE, Target::Qp(0x12)));
            assert!(
                !CONN.is_hit(OTHER, t.unwrap()),
                "same QP number, other device"
            );
        }
    }

    #[test]
    fn a_completion_queue_error_fails_the_owner_of_the_queue() {
        let t = target(&event(K::CqErr, EventElement::Cq(CqId(0xc0)))).unwrap();
        assert_eq!(t, Target::Cq(CqId(0xc0)));
        assert!(CONN.is_hit(RXE, t));
        assert!(!CONN.is_hit(RXE, Target::Cq(CqId(0xc8))));
    }

    #[test]
    fn a_port_error_fails_every_connection_on_the_port() {
        let t = target(&event(K::PortErr, EventElement::Port(1))).unwrap();
        assert_eq!(t, Target::Port(1));
        assert!(CONN.is_hit(RXE, t));
        assert!(!CONN.is_hit(RXE, Target::Port(2)));
        assert!(!CONN.is_hit(OTHER, t));
    }

    #[test]
    fn a_dead_device_fails_every_connection_on_it() {
        let t = target(&event(K::DeviceFatal, EventElement::Device)).unwrap();
        assert_eq!(t, Target::Device);
        assert!(CONN.is_hit(RXE, t));
        assert!(!CONN.is_hit(OTHER, t));
    }

    #[test]
    fn informational_events_fail_nothing() {
        for e in [
            event(K::CommEst, EventElement::Qp(0x11)),
            event(K::SqDrained, EventElement::Qp(0x11)),
            event(K::QpLastWqeReached, EventElement::Qp(0x11)),
            event(K::PathMig, EventElement::Qp(0x11)),
            event(K::PortActive, EventElement::Port(1)),
            event(K::LidChange, EventElement::Port(1)),
            event(K::GidChange, EventElement::Port(1)),
            event(K::PkeyChange, EventElement::Port(1)),
            event(K::SmChange, EventElement::Port(1)),
            event(K::ClientReregister, EventElement::Port(1)),
            event(K::SrqErr, EventElement::Srq),
            event(K::SrqLimitReached, EventElement::Srq),
            event(K::WqFatal, EventElement::Wq),
            event(K::Unknown(99), EventElement::Port(1)),
            // An error naming no object we can find.
            event(K::QpFatal, EventElement::Unknown),
        ] {
            assert_eq!(target(&e), None, "{e:?}");
        }
    }

    #[test]
    fn a_queued_port_error_counts_only_while_the_port_is_down() {
        let down = event(K::PortErr, EventElement::Port(1));
        assert_eq!(backlog_target(&down, |_| true), None);
        assert_eq!(backlog_target(&down, |_| false), Some(Target::Port(1)));
        let fatal = event(K::QpFatal, EventElement::Qp(7));
        assert_eq!(backlog_target(&fatal, |_| true), Some(Target::Qp(7)));
        let dead = event(K::DeviceFatal, EventElement::Device);
        assert_eq!(backlog_target(&dead, |_| true), Some(Target::Device));
    }

    #[test]
    fn reasons_name_the_event_and_the_device() {
        assert_eq!(
            reason("rxe0", &event(K::PortErr, EventElement::Port(1))),
            "rxe0 port 1: IBV_EVENT_PORT_ERR (port went down)"
        );
        assert_eq!(
            reason("mlx5_0", &event(K::QpFatal, EventElement::Qp(0x11))),
            "mlx5_0 QP 0x11: IBV_EVENT_QP_FATAL (local work queue catastrophic error)"
        );
        assert_eq!(
            reason("rxe0", &event(K::DeviceFatal, EventElement::Device)),
            "rxe0: IBV_EVENT_DEVICE_FATAL (local catastrophic error: the device is dead)"
        );
        assert!(reason("rxe0", &event(K::CqErr, EventElement::Cq(CqId(1))))
            .starts_with("rxe0 completion queue: IBV_EVENT_CQ_ERR"));
    }

    #[test]
    fn raw_event_types_map_to_their_kinds() {
        use rdma_sys::ibv_event_type as raw;
        assert_eq!(
            AsyncEventKind::from_raw(raw::IBV_EVENT_PORT_ERR as u32),
            K::PortErr
        );
        assert_eq!(
            AsyncEventKind::from_raw(raw::IBV_EVENT_WQ_FATAL as u32),
            K::WqFatal
        );
        assert_eq!(AsyncEventKind::from_raw(1000), K::Unknown(1000));
        assert_eq!(K::QpAccessErr.name(), "IBV_EVENT_QP_ACCESS_ERR");
    }
}
