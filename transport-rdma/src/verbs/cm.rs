//! The connection manager (librdmacm): event channel and `cm_id`.

use std::ffi::CStr;
use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdma_sys as ffi;
use rdma_sys::rdma_cm_event_type as event;

use super::{last_os_error, Error, Result};

/// An `rdma_event_channel`: where the connection manager reports events for
/// the `cm_id`s created on (or migrated to) it. Its file descriptor is
/// non-blocking: the transport registers it with tokio and takes events
/// when it is readable; the blocking waits of [`CmId`] use `poll(2)` with
/// a timeout.
pub struct EventChannel {
    raw: NonNull<ffi::rdma_event_channel>,
}

// SAFETY: librdmacm calls on a channel are thread-safe; the value only
// holds the pointer, freed once in Drop.
unsafe impl Send for EventChannel {}
// SAFETY: as for Send: every method goes through thread-safe librdmacm calls.
unsafe impl Sync for EventChannel {}

/// A connection manager event's kind and status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmEvent {
    /// `rdma_cm_event_type` (e.g. `RDMA_CM_EVENT_DISCONNECTED`).
    pub kind: u32,
    /// The event's status.
    pub status: i32,
}

impl CmEvent {
    /// True for the events that end a connection (disconnected, device
    /// removal, connection error, unreachable, rejected, timewait exit).
    pub fn ends_connection(&self) -> bool {
        matches!(
            self.kind,
            event::RDMA_CM_EVENT_DISCONNECTED
                | event::RDMA_CM_EVENT_DEVICE_REMOVAL
                | event::RDMA_CM_EVENT_CONNECT_ERROR
                | event::RDMA_CM_EVENT_UNREACHABLE
                | event::RDMA_CM_EVENT_REJECTED
                | event::RDMA_CM_EVENT_ADDR_CHANGE
        )
    }

    /// The event's name, as `rdma_event_str` gives it.
    pub fn name(&self) -> String {
        event_str(self.kind)
    }
}

impl EventChannel {
    /// Creates a channel (`rdma_create_event_channel`).
    pub fn new() -> Result<Arc<Self>> {
        // SAFETY: no arguments; the result is checked for NULL.
        let raw = unsafe { ffi::rdma_create_event_channel() };
        let raw = NonNull::new(raw).ok_or_else(|| Error::CreateEventChannel(last_os_error()))?;
        let channel = Self { raw };
        let fd = channel.fd();
        // SAFETY: `fd` is the channel's open descriptor; F_GETFL/F_SETFL
        // only change its status flags.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(Error::CreateEventChannel(last_os_error()));
        }
        Ok(Arc::new(channel))
    }

    /// The channel's (non-blocking) file descriptor, readable when an
    /// event is waiting: register it with an event loop.
    pub fn fd(&self) -> libc::c_int {
        // SAFETY: `raw` points to the live channel this value owns.
        unsafe { self.raw.as_ref().fd }
    }

    /// Takes the next event without waiting, if there is one, with what
    /// the set-up needs of it (its private data), acknowledged already.
    pub(crate) fn try_next(&self) -> Result<Option<Event>> {
        let mut raw: *mut ffi::rdma_cm_event = ptr::null_mut();
        // SAFETY: the channel is live; `raw` is a valid out-pointer. The
        // descriptor is non-blocking, so this returns at once.
        let ret = unsafe { ffi::rdma_get_cm_event(self.raw.as_ptr(), &mut raw) };
        if ret == 0 {
            // SAFETY: on success `raw` points to an event that stays valid
            // until it is acknowledged below.
            let event = unsafe { Event::copy_from(&*raw) };
            // SAFETY: `raw` came from rdma_get_cm_event and is acknowledged
            // once; nothing refers to it afterwards.
            unsafe { ffi::rdma_ack_cm_event(raw) };
            return Ok(Some(event));
        }
        let err = last_os_error();
        if err.kind() == std::io::ErrorKind::WouldBlock {
            Ok(None)
        } else {
            Err(Error::GetCmEvent(err))
        }
    }

    /// Waits up to `timeout` for the next event, copies what the callers
    /// need out of it and acknowledges it (blocking the thread).
    fn next_event(&self, timeout: Duration) -> Result<Event> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(event) = self.try_next()? {
                return Ok(event);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: "a connection manager event",
                    timeout,
                });
            }
            let mut pfd = libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
            // SAFETY: `pfd` is one valid pollfd for the duration of the call.
            if unsafe { libc::poll(&mut pfd, 1, ms) } < 0 {
                let err = last_os_error();
                if err.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::GetCmEvent(err));
                }
            }
        }
    }

    /// The next event, which must be `expected`.
    fn expect(&self, expected: event::Type, timeout: Duration) -> Result<Event> {
        self.next_event(timeout)?.expect(expected)
    }
}

impl std::os::fd::AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd()
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every `cm_id` on this channel holds an `Arc` to it, so none
        // is left; the channel is destroyed once.
        unsafe { ffi::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

/// What we keep of an `rdma_cm_event` (acknowledged once copied).
#[derive(Debug)]
pub(crate) struct Event {
    kind: event::Type,
    status: i32,
    id: *mut ffi::rdma_cm_id,
    private_data: Vec<u8>,
}

impl Event {
    /// Its kind and status.
    pub(crate) fn event(&self) -> CmEvent {
        CmEvent {
            kind: self.kind,
            status: self.status,
        }
    }

    /// The address of the `rdma_cm_id` it is about: which connection's
    /// (compare with [`CmId::addr`]).
    pub(crate) fn id_addr(&self) -> usize {
        self.id as usize
    }

    /// This event, if it is `expected`; otherwise the error naming both.
    pub(crate) fn expect(self, expected: event::Type) -> Result<Self> {
        if self.kind == expected {
            Ok(self)
        } else {
            Err(Error::UnexpectedCmEvent {
                expected: event_name(expected),
                got: event_str(self.kind),
                status: self.status,
            })
        }
    }

    /// The answer to a connect request: the server's private data when
    /// established (may be zero-padded), [`Error::Rejected`] with its
    /// private data when refused.
    pub(crate) fn connect_reply(self) -> Result<Vec<u8>> {
        match self.kind {
            event::RDMA_CM_EVENT_ESTABLISHED => Ok(self.private_data),
            event::RDMA_CM_EVENT_REJECTED => Err(Error::Rejected {
                status: self.status,
                private_data: self.private_data,
            }),
            other => Err(Error::UnexpectedCmEvent {
                expected: event_name(event::RDMA_CM_EVENT_ESTABLISHED),
                got: event_str(other),
                status: self.status,
            }),
        }
    }

    /// # Safety
    /// `raw` must be an event from `rdma_get_cm_event` not yet acknowledged.
    unsafe fn copy_from(raw: &ffi::rdma_cm_event) -> Self {
        let has_conn_param = matches!(
            raw.event,
            event::RDMA_CM_EVENT_CONNECT_REQUEST
                | event::RDMA_CM_EVENT_ESTABLISHED
                | event::RDMA_CM_EVENT_REJECTED
        );
        let private_data = if has_conn_param {
            // SAFETY: for these events `param.conn` is the active member
            // (librdmacm fills it for connected port spaces).
            let conn = unsafe { raw.param.conn };
            if conn.private_data.is_null() {
                Vec::new()
            } else {
                // SAFETY: librdmacm guarantees `private_data_len` readable
                // bytes at `private_data` until the event is acknowledged.
                unsafe {
                    std::slice::from_raw_parts(
                        conn.private_data.cast::<u8>(),
                        conn.private_data_len.into(),
                    )
                }
                .to_vec()
            }
        } else {
            Vec::new()
        };
        Self {
            kind: raw.event,
            status: raw.status,
            id: raw.id,
            private_data,
        }
    }
}

/// An `rdma_cm_id` in the TCP port space (reliable connected QPs): the
/// connection manager's handle for one listener or one connection.
/// It has one owner (not `Clone`): librdmacm updates the `rdma_cm_id`
/// structure in the calls that move it through its states (bind, resolve,
/// connect, accept, reject, disconnect, creating its QP), so those take
/// `&mut self`, and `&self` methods only read fields those calls set
/// earlier. The objects made from it hold a shared handle that keeps it
/// alive; it is destroyed when the owner and all of those are dropped.
///
/// The waiting methods take the channel's next event and fail if it is not
/// the one they wait for: the channel is a sequence of steps, so keep one
/// connection set-up at a time per channel (a listener's channel also
/// carries its accepted connections' events).
pub struct CmId {
    inner: Arc<CmIdInner>,
}

/// What the objects made from a [`CmId`] (its QP, PD, CQs, channels) hold:
/// keeps the `cm_id` alive and gives its pointer, for the object's own
/// calls (the QP's `rdma_destroy_qp`, which changes only the id's `qp`
/// field, which only that QP reads). Not a way to change the id's state.
#[derive(Clone)]
pub(crate) struct SharedCmId(Arc<CmIdInner>);

impl SharedCmId {
    pub(crate) fn as_ptr(&self) -> *mut ffi::rdma_cm_id {
        self.0.raw.as_ptr()
    }
}

struct CmIdInner {
    raw: NonNull<ffi::rdma_cm_id>,
    /// The channel it reports on (changed only by [`CmId::migrate`], which
    /// takes the owner's `&mut`); destroyed after the id.
    channel: Mutex<Arc<EventChannel>>,
}

// SAFETY: librdmacm calls on an id are thread-safe; the value only holds
// the pointer (destroyed once in Drop) and an `Arc` of a Send + Sync channel.
// Sync: through `&CmId` and `SharedCmId` only fields set before are read
// (and the QP's own `qp` field written by its owner); every call that
// changes the id's state needs `&mut CmId`, the one owner.
unsafe impl Send for CmIdInner {}
// SAFETY: as for Send.
unsafe impl Sync for CmIdInner {}

impl Drop for CmIdInner {
    fn drop(&mut self) {
        // SAFETY: the QP, PD, CQs and MRs made from this id hold a
        // `SharedCmId`, so all are gone; events are acknowledged as soon as they
        // are read, so rdma_destroy_id does not wait for any.
        unsafe { ffi::rdma_destroy_id(self.raw.as_ptr()) };
    }
}

/// An incoming connection: the new `cm_id` and the client's private data.
pub struct ConnectRequest {
    /// The connection's own `cm_id` (create its QP, then accept).
    pub id: CmId,
    /// What the client passed to `rdma_connect` (may be zero-padded).
    pub private_data: Vec<u8>,
}

// `rdma_set_option` levels and names (an unnamed enum in <rdma/rdma_cma.h>,
// which the bindings do not carry).
const RDMA_OPTION_ID: libc::c_int = 0;
const RDMA_OPTION_ID_TOS: libc::c_int = 0;
const RDMA_OPTION_ID_ACK_TIMEOUT: libc::c_int = 3;

impl CmId {
    /// Creates a `cm_id` on `channel` (`rdma_create_id`, `RDMA_PS_TCP`).
    pub fn new(channel: &Arc<EventChannel>) -> Result<Self> {
        let mut raw = ptr::null_mut();
        // SAFETY: the channel is live; `raw` is a valid out-pointer; the
        // context pointer is unused (NULL).
        let ret = unsafe {
            ffi::rdma_create_id(
                channel.raw.as_ptr(),
                &mut raw,
                ptr::null_mut(),
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        };
        let raw = NonNull::new(raw)
            .filter(|_| ret == 0)
            .ok_or_else(|| Error::CreateId(last_os_error()))?;
        Ok(Self {
            inner: Arc::new(CmIdInner {
                raw,
                channel: Mutex::new(Arc::clone(channel)),
            }),
        })
    }

    /// Adopts a `cm_id` librdmacm created for a connect request on a
    /// listener of `channel`.
    fn adopt(raw: *mut ffi::rdma_cm_id, channel: &Arc<EventChannel>) -> Result<Self> {
        let raw = NonNull::new(raw).ok_or(Error::NoDevice)?;
        Ok(Self {
            inner: Arc::new(CmIdInner {
                raw,
                channel: Mutex::new(Arc::clone(channel)),
            }),
        })
    }

    /// The event channel this id reports on.
    pub fn channel(&self) -> Arc<EventChannel> {
        Arc::clone(&self.inner.channel.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Moves this id's events, those not read yet included, to `channel`
    /// (`rdma_migrate_id`): an accepted connection's away from its
    /// listener's channel, an established connection's to the channel its
    /// device's watcher reads. The old channel sees none of its events
    /// after this; whoever waits on it for this id waits in vain.
    pub fn migrate(&mut self, channel: &Arc<EventChannel>) -> Result<()> {
        // SAFETY: the id and both channels are live; no event of the id is
        // held unacknowledged (events are acknowledged as soon as read), so
        // this does not block. It changes the id's `channel` field, which
        // the objects made from it (their `SharedCmId`) never read; `&mut
        // self` excludes every other call that does.
        if unsafe { ffi::rdma_migrate_id(self.as_ptr(), channel.raw.as_ptr()) } != 0 {
            return Err(Error::MigrateId(last_os_error()));
        }
        *self.inner.channel.lock().unwrap_or_else(|e| e.into_inner()) = Arc::clone(channel);
        Ok(())
    }

    /// The peer's address, when connected (`None` before, or for an
    /// address family other than IPv4 and IPv6).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the id is live; its route's destination address is a
        // `sockaddr_storage` (large enough for any family), read as the
        // family it says it is.
        unsafe {
            let sa: *const libc::sockaddr = ffi::rdma_get_peer_addr(self.inner.raw.as_ref());
            match i32::from((*sa).sa_family) {
                libc::AF_INET => {
                    let sin = &*sa.cast::<libc::sockaddr_in>();
                    Some(SocketAddr::V4(SocketAddrV4::new(
                        u32::from_be(sin.sin_addr.s_addr).into(),
                        u16::from_be(sin.sin_port),
                    )))
                }
                libc::AF_INET6 => {
                    let sin6 = &*sa.cast::<libc::sockaddr_in6>();
                    Some(SocketAddr::V6(SocketAddrV6::new(
                        sin6.sin6_addr.s6_addr.into(),
                        u16::from_be(sin6.sin6_port),
                        u32::from_be(sin6.sin6_flowinfo),
                        sin6.sin6_scope_id,
                    )))
                }
                _ => None,
            }
        }
    }

    /// The local port (after bind: the one chosen for port 0).
    pub fn local_port(&self) -> u16 {
        // SAFETY: the id is live; rdma_get_src_port reads its address.
        u16::from_be(unsafe { ffi::rdma_get_src_port(self.as_ptr()) })
    }

    /// Takes a waiting connect request on this listener without blocking;
    /// other events on the listener's channel are skipped.
    pub fn try_get_request(&self) -> Result<Option<ConnectRequest>> {
        while let Some(e) = self.channel().try_next()? {
            if e.kind == event::RDMA_CM_EVENT_CONNECT_REQUEST {
                return Ok(Some(ConnectRequest {
                    id: Self::adopt(e.id, &self.channel())?,
                    private_data: e.private_data,
                }));
            }
        }
        Ok(None)
    }

    /// Refuses this connect request (`rdma_reject`), with `private_data`
    /// for the client.
    pub fn reject(&mut self, private_data: &[u8]) -> Result<()> {
        let len = u8::try_from(private_data.len())
            .map_err(|_| Error::PrivateDataTooLong(private_data.len()))?;
        // SAFETY: the id is live (from a connect request); the private data
        // is valid for the call, which copies it.
        if unsafe { ffi::rdma_reject(self.as_ptr(), private_data.as_ptr().cast(), len) } == 0 {
            Ok(())
        } else {
            Err(Error::Reject(last_os_error()))
        }
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::rdma_cm_id {
        self.inner.raw.as_ptr()
    }

    /// The address of the `rdma_cm_id`: what names it in the events of a
    /// channel that many ids share ([`Event::id_addr`]).
    pub(crate) fn addr(&self) -> usize {
        self.as_ptr() as usize
    }

    /// A hold on the id for an object made from it.
    pub(crate) fn share(&self) -> SharedCmId {
        SharedCmId(Arc::clone(&self.inner))
    }

    /// The verbs context of the device the id is bound to.
    pub(crate) fn verbs(&self) -> Result<NonNull<ffi::ibv_context>> {
        // SAFETY: `raw` points to the live cm_id this value shares.
        NonNull::new(unsafe { self.inner.raw.as_ref().verbs }).ok_or(Error::NoDevice)
    }

    /// The name of the RDMA device the id is bound to (after bind or
    /// resolve), e.g. `rxe0`.
    pub fn device_name(&self) -> Result<String> {
        let verbs = self.verbs()?;
        // SAFETY: a bound id's `verbs` is a live context whose `device` is
        // valid while the context is; ibv_get_device_name returns a NUL-
        // terminated string owned by the device.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(verbs.as_ref().device)) };
        Ok(name.to_string_lossy().into_owned())
    }

    /// Binds to a local address (`rdma_bind_addr`); port 0 picks one.
    pub fn bind(&mut self, addr: SocketAddr) -> Result<()> {
        let mut sa = sockaddr(addr);
        // SAFETY: the id is live; `sa` holds a valid sockaddr of its
        // family, which librdmacm reads (and copies) during the call.
        let ret = unsafe { ffi::rdma_bind_addr(self.as_ptr(), ptr::addr_of_mut!(sa).cast()) };
        if ret == 0 {
            Ok(())
        } else {
            Err(Error::BindAddr {
                addr,
                source: last_os_error(),
            })
        }
    }

    /// Starts listening for connect requests (`rdma_listen`).
    pub fn listen(&mut self, backlog: i32) -> Result<()> {
        // SAFETY: the id is live and bound.
        if unsafe { ffi::rdma_listen(self.as_ptr(), backlog) } == 0 {
            Ok(())
        } else {
            Err(Error::Listen(last_os_error()))
        }
    }

    /// Waits for the next connect request on this listener.
    pub fn get_request(&self, timeout: Duration) -> Result<ConnectRequest> {
        let e = self
            .channel()
            .expect(event::RDMA_CM_EVENT_CONNECT_REQUEST, timeout)?;
        Ok(ConnectRequest {
            id: Self::adopt(e.id, &self.channel())?,
            private_data: e.private_data,
        })
    }

    /// Resolves `addr` to a device and a route (`rdma_resolve_addr`, then
    /// `rdma_resolve_route`), waiting for each.
    pub fn resolve(&mut self, addr: SocketAddr, timeout: Duration) -> Result<()> {
        self.resolve_from(None, addr, timeout)
    }

    /// [`resolve`](Self::resolve) from the local address `source` (which
    /// picks the device and port: a rail), or one the system picks.
    pub fn resolve_from(
        &mut self,
        source: Option<std::net::IpAddr>,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        self.start_resolve_addr(source, addr, timeout)?;
        self.channel()
            .expect(event::RDMA_CM_EVENT_ADDR_RESOLVED, timeout)?;
        self.start_resolve_route(timeout)?;
        self.channel()
            .expect(event::RDMA_CM_EVENT_ROUTE_RESOLVED, timeout)?;
        Ok(())
    }

    /// Starts resolving `addr` (from `source`, or an address the system
    /// picks) to a device (`rdma_resolve_addr`) without waiting: the
    /// channel reports `RDMA_CM_EVENT_ADDR_RESOLVED` (or an error event),
    /// within `timeout`.
    pub fn start_resolve_addr(
        &mut self,
        source: Option<std::net::IpAddr>,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let mut src = source.map(|ip| sockaddr(SocketAddr::new(ip, 0)));
        let src_ptr: *mut libc::sockaddr = match &mut src {
            Some(src) => ptr::addr_of_mut!(*src).cast(),
            None => ptr::null_mut(),
        };
        let mut sin = sockaddr(addr);
        // SAFETY: the id is live; `sin` (and `src`, when given) holds a
        // valid sockaddr of its family, read during the call; a NULL source
        // lets librdmacm pick one.
        let ret = unsafe {
            ffi::rdma_resolve_addr(
                self.as_ptr(),
                src_ptr,
                ptr::addr_of_mut!(sin).cast(),
                timeout_ms(timeout),
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(Error::ResolveAddr {
                addr,
                source: last_os_error(),
            })
        }
    }

    /// Starts resolving the route of an id whose address is resolved
    /// (`rdma_resolve_route`) without waiting: the channel reports
    /// `RDMA_CM_EVENT_ROUTE_RESOLVED` (or an error event).
    pub fn start_resolve_route(&mut self, timeout: Duration) -> Result<()> {
        // SAFETY: the id is live; librdmacm checks its address is resolved.
        if unsafe { ffi::rdma_resolve_route(self.as_ptr(), timeout_ms(timeout)) } == 0 {
            Ok(())
        } else {
            Err(Error::ResolveRoute(last_os_error()))
        }
    }

    /// Sets the type of service (IP ToS / traffic class) of the
    /// connection's packets (`rdma_set_option`, `RDMA_OPTION_ID_TOS`).
    /// Before [`resolve`](Self::resolve) (a listener's: before
    /// [`listen`](Self::listen)).
    pub fn set_type_of_service(&mut self, tos: u8) -> Result<()> {
        self.set_option(RDMA_OPTION_ID_TOS, tos, "RDMA_OPTION_ID_TOS")
    }

    /// Sets the queue pair's ACK timeout, 4.096 µs × 2^`exponent` per
    /// retry (`rdma_set_option`, `RDMA_OPTION_ID_ACK_TIMEOUT`; 0 waits
    /// forever). Before connecting or accepting.
    pub fn set_ack_timeout(&mut self, exponent: u8) -> Result<()> {
        self.set_option(
            RDMA_OPTION_ID_ACK_TIMEOUT,
            exponent,
            "RDMA_OPTION_ID_ACK_TIMEOUT",
        )
    }

    fn set_option(&mut self, name: libc::c_int, mut value: u8, what: &'static str) -> Result<()> {
        // SAFETY: the id is live; `value` is a valid u8 for the call, whose
        // length is passed (both options take a uint8_t).
        let ret = unsafe {
            ffi::rdma_set_option(
                self.as_ptr(),
                RDMA_OPTION_ID,
                name,
                ptr::addr_of_mut!(value).cast(),
                std::mem::size_of::<u8>(),
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(Error::SetOption {
                option: what,
                source: last_os_error(),
            })
        }
    }

    /// Connects (`rdma_connect`) and waits until the connection is
    /// established; returns the server's private data (may be zero-padded).
    /// Create the id's [`QueuePair`](super::QueuePair) first.
    pub fn connect(&mut self, private_data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        self.start_connect(private_data)?;
        self.channel().next_event(timeout)?.connect_reply()
    }

    /// Sends the connect request (`rdma_connect`) without waiting: the
    /// channel reports `RDMA_CM_EVENT_ESTABLISHED` or
    /// `RDMA_CM_EVENT_REJECTED`. The connection completes only when that
    /// event is read (librdmacm answers the server's reply then), so an id
    /// whose events nobody reads leaves the server waiting.
    pub fn start_connect(&mut self, private_data: &[u8]) -> Result<()> {
        self.connect_with(conn_param(private_data)?)
    }

    /// [`start_connect`](Self::start_connect) for an id with no queue pair
    /// (a request meant to be refused, e.g. to fetch a challenge), naming
    /// `qp_num` as its queue pair. The connection manager takes a request
    /// from a host naming the queue pair of a live one as a stale
    /// connection (rejects it, and may disconnect the live one), and a
    /// request with no queue pair names 0 unless told otherwise: name one
    /// this process owns and uses for nothing else until the request is
    /// answered.
    pub fn start_connect_naming_qp(&mut self, private_data: &[u8], qp_num: u32) -> Result<()> {
        let mut param = conn_param(private_data)?;
        param.qp_num = qp_num;
        self.connect_with(param)
    }

    /// `rdma_connect` with `param`, whose private data the caller keeps
    /// alive until this returns.
    fn connect_with(&mut self, mut param: ffi::rdma_conn_param) -> Result<()> {
        // SAFETY: the id is live with a resolved route; `param` and the
        // private data it points to outlive the call, which copies them
        // (librdmacm uses `param.qp_num` only if the id has no queue pair).
        if unsafe { ffi::rdma_connect(self.as_ptr(), &mut param) } == 0 {
            Ok(())
        } else {
            Err(Error::Connect(last_os_error()))
        }
    }

    /// Accepts this connect request (`rdma_accept`) and waits until the
    /// connection is established. Create the id's
    /// [`QueuePair`](super::QueuePair) (and post receives) first.
    pub fn accept(&mut self, private_data: &[u8], timeout: Duration) -> Result<()> {
        self.start_accept(private_data)?;
        self.channel()
            .expect(event::RDMA_CM_EVENT_ESTABLISHED, timeout)?;
        Ok(())
    }

    /// Accepts this connect request (`rdma_accept`) without waiting: the
    /// id's channel reports `RDMA_CM_EVENT_ESTABLISHED` (or an error
    /// event). Create the id's [`QueuePair`](super::QueuePair) (and post
    /// receives) first.
    pub fn start_accept(&mut self, private_data: &[u8]) -> Result<()> {
        let mut param = conn_param(private_data)?;
        // SAFETY: the id is live (from a connect request); `param` and its
        // private data outlive the call, which copies them.
        if unsafe { ffi::rdma_accept(self.as_ptr(), &mut param) } == 0 {
            Ok(())
        } else {
            Err(Error::Accept(last_os_error()))
        }
    }

    /// Starts tearing the connection down (`rdma_disconnect`).
    pub fn disconnect(&mut self) -> Result<()> {
        // SAFETY: the id is live.
        if unsafe { ffi::rdma_disconnect(self.as_ptr()) } == 0 {
            Ok(())
        } else {
            Err(Error::Disconnect(last_os_error()))
        }
    }

    /// Waits for the peer's (or our own) disconnect to be reported.
    pub fn wait_disconnected(&self, timeout: Duration) -> Result<()> {
        self.channel()
            .expect(event::RDMA_CM_EVENT_DISCONNECTED, timeout)
            .map(drop)
    }
}

/// A librdmacm timeout argument: milliseconds, at least 1.
fn timeout_ms(timeout: Duration) -> i32 {
    i32::try_from(timeout.as_millis())
        .unwrap_or(i32::MAX)
        .max(1)
}

fn conn_param(private_data: &[u8]) -> Result<ffi::rdma_conn_param> {
    let len = u8::try_from(private_data.len())
        .map_err(|_| Error::PrivateDataTooLong(private_data.len()))?;
    Ok(ffi::rdma_conn_param {
        private_data: if private_data.is_empty() {
            ptr::null()
        } else {
            private_data.as_ptr().cast()
        },
        private_data_len: len,
        responder_resources: super::READ_DEPTH as u8,
        initiator_depth: super::READ_DEPTH as u8,
        flow_control: 0,
        retry_count: 7,
        // Finite: the transport's credits mean a peer never sends into a
        // ring with no receive posted, so a receiver-not-ready NAK is a bug
        // (ours or a peer's) and fails the connection at once, naming it,
        // instead of retrying forever (7 = infinite) and hanging.
        rnr_retry_count: super::RNR_RETRY,
        srq: 0,
        qp_num: 0,
    })
}

/// `addr` as the C socket address of its family (`sockaddr_in` or
/// `sockaddr_in6`), in storage large enough for either.
fn sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: all-zero bytes are a valid sockaddr_storage (plain integers).
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let at = ptr::addr_of_mut!(storage);
    match addr {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than, and aligned for,
            // every sockaddr type.
            unsafe { at.cast::<libc::sockaddr_in>().write(sin) };
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above.
            unsafe { at.cast::<libc::sockaddr_in6>().write(sin6) };
        }
    }
    storage
}

fn event_str(kind: event::Type) -> String {
    // SAFETY: rdma_event_str returns a static NUL-terminated string for any
    // value (a generic one for unknown values).
    unsafe { CStr::from_ptr(ffi::rdma_event_str(kind)) }
        .to_string_lossy()
        .into_owned()
}

fn event_name(kind: event::Type) -> &'static str {
    match kind {
        event::RDMA_CM_EVENT_ADDR_RESOLVED => "RDMA_CM_EVENT_ADDR_RESOLVED",
        event::RDMA_CM_EVENT_ROUTE_RESOLVED => "RDMA_CM_EVENT_ROUTE_RESOLVED",
        event::RDMA_CM_EVENT_CONNECT_REQUEST => "RDMA_CM_EVENT_CONNECT_REQUEST",
        event::RDMA_CM_EVENT_ESTABLISHED => "RDMA_CM_EVENT_ESTABLISHED",
        event::RDMA_CM_EVENT_DISCONNECTED => "RDMA_CM_EVENT_DISCONNECTED",
        _ => "another connection manager event",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: event::Type, status: i32, private_data: &[u8]) -> Event {
        Event {
            kind,
            status,
            id: ptr::null_mut(),
            private_data: private_data.to_vec(),
        }
    }

    #[test]
    fn a_connect_reply_is_the_servers_data_its_refusal_or_an_unexpected_event() {
        let reply = event(event::RDMA_CM_EVENT_ESTABLISHED, 0, b"hello").connect_reply();
        assert_eq!(reply.unwrap(), b"hello");
        match event(event::RDMA_CM_EVENT_REJECTED, 28, b"why").connect_reply() {
            Err(Error::Rejected {
                status,
                private_data,
            }) => assert_eq!((status, &private_data[..]), (28, &b"why"[..])),
            other => panic!("{other:?}"),
        }
        match event(event::RDMA_CM_EVENT_CONNECT_RESPONSE, 0, b"").connect_reply() {
            Err(Error::UnexpectedCmEvent { expected, got, .. }) => {
                assert_eq!(expected, "RDMA_CM_EVENT_ESTABLISHED");
                assert_eq!(got, "RDMA_CM_EVENT_CONNECT_RESPONSE");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_expected_event_passes_and_another_names_both() {
        let e = event(event::RDMA_CM_EVENT_ADDR_RESOLVED, 0, b"");
        assert!(e.expect(event::RDMA_CM_EVENT_ADDR_RESOLVED).is_ok());
        let e = event(event::RDMA_CM_EVENT_ADDR_ERROR, -110, b"");
        match e.expect(event::RDMA_CM_EVENT_ADDR_RESOLVED) {
            Err(Error::UnexpectedCmEvent {
                expected,
                got,
                status,
            }) => {
                assert_eq!(expected, "RDMA_CM_EVENT_ADDR_RESOLVED");
                assert_eq!(got, "RDMA_CM_EVENT_ADDR_ERROR");
                assert_eq!(status, -110);
            }
            other => panic!("{other:?}"),
        }
    }
}
