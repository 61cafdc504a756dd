//! Asynchronous device events (`ibv_get_async_event`): port state changes,
//! queue pair and completion queue errors, a dead device.
//!
//! librdmacm opens each device once per process, so every `cm_id` on a
//! device shares one `ibv_context` and its one event descriptor
//! (`async_fd`): read it in one place per device.

use std::ffi::{c_int, c_void, CStr};
use std::mem::{align_of, size_of, MaybeUninit};
use std::ptr::NonNull;

use rdma_sys as ffi;
use rdma_sys::ibv_event_type as raw_kind;

use super::{errno_error, last_os_error, CmId, CompletionQueue, Error, Result, SharedCmId};

/// Identifies a device context (librdmacm's one `ibv_context` per device),
/// as [`CmId::device_id`] and [`AsyncEvents::device_id`] give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceId(pub(crate) usize);

/// Identifies a live completion queue, as async events name it
/// ([`CompletionQueue::id`], [`EventElement::Cq`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqId(pub(crate) usize);

macro_rules! event_kinds {
    ($($variant:ident = $raw:ident, $description:literal;)*) => {
        /// An `ibv_event_type`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[non_exhaustive]
        pub enum AsyncEventKind {
            $(
                #[doc = concat!("`", stringify!($raw), "`: ", $description, ".")]
                $variant,
            )*
            /// A value this crate does not know.
            Unknown(u32),
        }

        impl AsyncEventKind {
            /// The kind of the raw `ibv_event_type` value `raw`.
            pub fn from_raw(raw: u32) -> Self {
                $(
                    if raw == raw_kind::$raw as u32 {
                        return Self::$variant;
                    }
                )*
                Self::Unknown(raw)
            }

            /// The C name, e.g. `IBV_EVENT_PORT_ERR`.
            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => stringify!($raw),)*
                    Self::Unknown(_) => "unknown async event",
                }
            }

            /// What happened, in a few words (e.g. `port went down`).
            pub fn description(self) -> &'static str {
                match self {
                    $(Self::$variant => $description,)*
                    Self::Unknown(_) => "an event type this crate does not know",
                }
            }

            /// Every kind this crate knows (all but [`Unknown`](Self::Unknown)).
            pub const KNOWN: &'static [AsyncEventKind] = &[$(Self::$variant,)*];
        }
    };
}

event_kinds! {
    CqErr = IBV_EVENT_CQ_ERR, "completion queue overrun";
    QpFatal = IBV_EVENT_QP_FATAL, "local work queue catastrophic error";
    QpReqErr = IBV_EVENT_QP_REQ_ERR, "invalid request local work queue error";
    QpAccessErr = IBV_EVENT_QP_ACCESS_ERR, "local access violation work queue error";
    CommEst = IBV_EVENT_COMM_EST, "communication established";
    SqDrained = IBV_EVENT_SQ_DRAINED, "send queue drained";
    PathMig = IBV_EVENT_PATH_MIG, "path migrated";
    PathMigErr = IBV_EVENT_PATH_MIG_ERR, "path migration request error";
    DeviceFatal = IBV_EVENT_DEVICE_FATAL, "local catastrophic error: the device is dead";
    PortActive = IBV_EVENT_PORT_ACTIVE, "port active";
    PortErr = IBV_EVENT_PORT_ERR, "port went down";
    LidChange = IBV_EVENT_LID_CHANGE, "LID change";
    PkeyChange = IBV_EVENT_PKEY_CHANGE, "P_Key table change";
    SmChange = IBV_EVENT_SM_CHANGE, "subnet manager change";
    SrqErr = IBV_EVENT_SRQ_ERR, "shared receive queue catastrophic error";
    SrqLimitReached = IBV_EVENT_SRQ_LIMIT_REACHED, "shared receive queue limit reached";
    QpLastWqeReached = IBV_EVENT_QP_LAST_WQE_REACHED, "last work queue element reached";
    ClientReregister = IBV_EVENT_CLIENT_REREGISTER, "client reregistration requested";
    GidChange = IBV_EVENT_GID_CHANGE, "GID table change";
    WqFatal = IBV_EVENT_WQ_FATAL, "work queue catastrophic error";
}

/// What an async event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventElement {
    /// A queue pair, by number.
    Qp(u32),
    /// A completion queue.
    Cq(CqId),
    /// A shared receive queue (this crate makes none).
    Srq,
    /// A work queue (this crate makes none).
    Wq,
    /// A port (counted from 1).
    Port(u8),
    /// The whole device.
    Device,
    /// Nothing this crate can name (e.g. a NULL object pointer).
    Unknown,
}

/// One async event, copied out (and already acknowledged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// The event type.
    pub kind: AsyncEventKind,
    /// What it is about.
    pub element: EventElement,
}

/// `struct ibv_async_event` with the type as a plain integer: rdma-sys
/// declares it as a Rust enum, which a value unknown to it would make
/// undefined behaviour to read.
#[repr(C)]
struct RawAsyncEvent {
    element: RawElement,
    event_type: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
union RawElement {
    cq: *mut ffi::ibv_cq,
    qp: *mut ffi::ibv_qp,
    other: *mut c_void,
    port_num: c_int,
}

const _: () = assert!(
    size_of::<RawAsyncEvent>() == size_of::<ffi::ibv_async_event>()
        && align_of::<RawAsyncEvent>() == align_of::<ffi::ibv_async_event>()
);

/// The async events of one device context, read from its `async_fd`
/// (made non-blocking: register [`fd`](Self::fd) with an event loop).
///
/// Holds a [`CmId`] on the device: librdmacm keeps a device's context
/// open while an id uses it, so the context (and its descriptor) stays
/// valid as long as this value.
pub struct AsyncEvents {
    ctx: NonNull<ffi::ibv_context>,
    _anchor: SharedCmId,
}

// SAFETY: libibverbs calls on a context are thread-safe; the value only
// holds the pointer (kept valid by the `SharedCmId`) and a Send + Sync `SharedCmId`.
unsafe impl Send for AsyncEvents {}
// SAFETY: as for Send.
unsafe impl Sync for AsyncEvents {}

impl AsyncEvents {
    /// The async events of the device `id` is bound to. Makes the
    /// context's `async_fd` non-blocking, for every user of the context.
    pub fn new(id: &CmId) -> Result<Self> {
        let ctx = id.verbs()?;
        let events = Self {
            ctx,
            _anchor: id.share(),
        };
        // From now on its events are counted (zero until one is read).
        events_read(&events.device_name(), |_| ());
        let fd = events.fd();
        // SAFETY: `fd` is the context's open descriptor; F_GETFL/F_SETFL
        // only change its status flags.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(Error::AsyncEventFd(last_os_error()));
        }
        Ok(events)
    }

    /// The context's event descriptor (non-blocking), readable when an
    /// event is waiting.
    pub fn fd(&self) -> libc::c_int {
        // SAFETY: the context is live (see the type's docs).
        unsafe { self.ctx.as_ref().async_fd }
    }

    /// Which device context this is.
    pub fn device_id(&self) -> DeviceId {
        DeviceId(self.ctx.as_ptr() as usize)
    }

    /// The device's name, e.g. `rxe0`.
    pub fn device_name(&self) -> String {
        // SAFETY: the context is live, so is its `device`;
        // ibv_get_device_name returns a NUL-terminated string it owns.
        unsafe { CStr::from_ptr(ffi::ibv_get_device_name(self.ctx.as_ref().device)) }
            .to_string_lossy()
            .into_owned()
    }

    /// Whether port `port` is active now (`ibv_query_port`).
    pub fn port_is_active(&self, port: u8) -> Result<bool> {
        let mut attr = MaybeUninit::<ffi::ibv_port_attr>::zeroed();
        // SAFETY: the context is live; `attr` is writable and as large as
        // the provider is told.
        let ret = unsafe { ffi::___ibv_query_port(self.ctx.as_ptr(), port, attr.as_mut_ptr()) };
        if ret != 0 {
            return Err(Error::QueryPort(errno_error(ret)));
        }
        // SAFETY: filled by the successful query (and zeroed is valid too).
        let attr = unsafe { attr.assume_init() };
        Ok(attr.state == ffi::ibv_port_state::IBV_PORT_ACTIVE)
    }

    /// Takes the next event without waiting, if there is one
    /// (`ibv_get_async_event`), copies it and acknowledges it
    /// (`ibv_ack_async_event`).
    pub fn try_next(&self) -> Result<Option<AsyncEvent>> {
        let mut raw = MaybeUninit::<RawAsyncEvent>::zeroed();
        // SAFETY: the context is live; `raw` has the layout of
        // `ibv_async_event` (checked above) and is writable; the descriptor
        // is non-blocking, so this returns at once.
        let ret = unsafe { ffi::ibv_get_async_event(self.ctx.as_ptr(), raw.as_mut_ptr().cast()) };
        if ret != 0 {
            let err = last_os_error();
            return if err.kind() == std::io::ErrorKind::WouldBlock {
                Ok(None)
            } else {
                Err(Error::GetAsyncEvent(err))
            };
        }
        // SAFETY: filled by the successful call (and zeroed is valid too:
        // integers and pointers).
        let mut raw = unsafe { raw.assume_init() };
        let kind = AsyncEventKind::from_raw(raw.event_type);
        // SAFETY: libibverbs sets the union member that matches the event
        // type (as listed in `element_of`); the QP or CQ it points to is
        // not destroyed before the event is acknowledged (below), because
        // ibv_destroy_qp/cq wait for that.
        let element = unsafe { element_of(kind, raw.element) };
        // SAFETY: `raw` is the event just returned, acknowledged once;
        // nothing refers to its objects afterwards.
        unsafe { ffi::ibv_ack_async_event(std::ptr::addr_of_mut!(raw).cast()) };
        events_read(&self.device_name(), |counts| counts.add(kind));
        Ok(Some(AsyncEvent { kind, element }))
    }
}

/// How many async events of each kind this process read from one device
/// ([`AsyncEvents::try_next`]), as [`async_events_read`] reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceEventCounts {
    /// The device's name, e.g. `rxe0`.
    pub device: String,
    /// Events of each of [`AsyncEventKind::KNOWN`], in that order.
    pub known: Vec<u64>,
    /// Events of kinds this crate does not know.
    pub unknown: u64,
}

impl DeviceEventCounts {
    fn new(device: &str) -> DeviceEventCounts {
        DeviceEventCounts {
            device: device.to_string(),
            known: vec![0; AsyncEventKind::KNOWN.len()],
            unknown: 0,
        }
    }

    fn add(&mut self, kind: AsyncEventKind) {
        match AsyncEventKind::KNOWN.iter().position(|&k| k == kind) {
            Some(i) => self.known[i] += 1,
            None => self.unknown += 1,
        }
    }

    /// Each known kind with its count.
    pub fn by_kind(&self) -> impl Iterator<Item = (AsyncEventKind, u64)> + '_ {
        AsyncEventKind::KNOWN
            .iter()
            .copied()
            .zip(self.known.iter().copied())
    }
}

/// The events read so far, per device. Events are rare: a lock per event
/// (and per scrape) costs nothing that matters.
static EVENTS_READ: std::sync::Mutex<Vec<DeviceEventCounts>> = std::sync::Mutex::new(Vec::new());

fn events_read(device: &str, update: impl FnOnce(&mut DeviceEventCounts)) {
    let mut all = EVENTS_READ.lock().unwrap_or_else(|e| e.into_inner());
    let i = match all.iter().position(|c| c.device == device) {
        Some(i) => i,
        None => {
            all.push(DeviceEventCounts::new(device));
            all.len() - 1
        }
    };
    update(&mut all[i]);
}

/// The async events this process has read, per device whose events it
/// has watched ([`AsyncEvents::new`]), since it started: for metrics.
pub fn async_events_read() -> Vec<DeviceEventCounts> {
    EVENTS_READ
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// The element of an event of `kind`, as libibverbs fills it.
///
/// # Safety
/// `element` must come from an unacknowledged event of type `kind`.
unsafe fn element_of(kind: AsyncEventKind, element: RawElement) -> EventElement {
    use AsyncEventKind as K;
    match kind {
        K::CqErr => {
            // SAFETY: CQ events carry the CQ.
            let cq = unsafe { element.cq };
            if cq.is_null() {
                EventElement::Unknown
            } else {
                EventElement::Cq(CqId(cq as usize))
            }
        }
        K::QpFatal
        | K::QpReqErr
        | K::QpAccessErr
        | K::CommEst
        | K::SqDrained
        | K::PathMig
        | K::PathMigErr
        | K::QpLastWqeReached => {
            // SAFETY: QP events carry the QP, live until the event is
            // acknowledged (the caller has not yet).
            match unsafe { element.qp.as_ref() } {
                Some(qp) => EventElement::Qp(qp.qp_num),
                None => EventElement::Unknown,
            }
        }
        K::SrqErr | K::SrqLimitReached => EventElement::Srq,
        K::WqFatal => EventElement::Wq,
        K::DeviceFatal => EventElement::Device,
        _ => {
            // SAFETY: the other events (port events and unknown ones) carry
            // a port number.
            let port = unsafe { element.port_num };
            u8::try_from(port).map_or(EventElement::Unknown, EventElement::Port)
        }
    }
}

impl CmId {
    /// Which device context the id is bound to (after bind or resolve).
    pub fn device_id(&self) -> Result<DeviceId> {
        Ok(DeviceId(self.verbs()?.as_ptr() as usize))
    }

    /// The device port the id is bound to (counted from 1; 0 before bind
    /// or resolve).
    pub fn port_num(&self) -> u8 {
        // SAFETY: the id is live; librdmacm sets `port_num` when it binds
        // the id to a device.
        unsafe { (*self.as_ptr()).port_num }
    }
}

impl CompletionQueue {
    /// How async events name this CQ ([`EventElement::Cq`]).
    pub fn id(&self) -> CqId {
        CqId(self.inner.raw.as_ptr() as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use AsyncEventKind as K;

    fn counts_of(device: &str) -> DeviceEventCounts {
        async_events_read()
            .into_iter()
            .find(|c| c.device == device)
            .expect("the device is counted")
    }

    #[test]
    fn events_are_counted_per_device_and_kind() {
        events_read("count-test0", |_| ());
        let watched = counts_of("count-test0");
        assert!(watched.by_kind().all(|(_, n)| n == 0));
        assert_eq!(watched.by_kind().count(), K::KNOWN.len());
        for kind in [K::PortErr, K::PortActive, K::PortErr, K::Unknown(99)] {
            events_read("count-test0", |c| c.add(kind));
        }
        events_read("count-test1", |c| c.add(K::DeviceFatal));
        let counts = counts_of("count-test0");
        let of = |kind| counts.by_kind().find(|&(k, _)| k == kind).unwrap().1;
        assert_eq!(
            (of(K::PortErr), of(K::PortActive), of(K::DeviceFatal)),
            (2, 1, 0)
        );
        assert_eq!(counts.unknown, 1);
        assert_eq!(counts.by_kind().map(|(_, n)| n).sum::<u64>(), 3);
        let other = counts_of("count-test1");
        assert_eq!(other.by_kind().map(|(_, n)| n).sum::<u64>(), 1);
    }
}
