//! The verbs layer's one error type.

use std::io;

/// `Result` with the verbs layer's [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What failed in the verbs layer. The variants named after a C function
/// carry the `io::Error` it reported.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `rdma_create_event_channel` failed.
    #[error("rdma_create_event_channel failed: {0}")]
    CreateEventChannel(#[source] io::Error),
    /// `rdma_create_id` failed.
    #[error("rdma_create_id failed: {0}")]
    CreateId(#[source] io::Error),
    /// `rdma_bind_addr` failed (is the address on an RDMA device?).
    #[error("rdma_bind_addr({addr}) failed: {source}")]
    BindAddr {
        /// The address.
        addr: std::net::SocketAddr,
        /// What the call reported.
        source: io::Error,
    },
    /// `rdma_listen` failed.
    #[error("rdma_listen failed: {0}")]
    Listen(#[source] io::Error),
    /// `rdma_resolve_addr` failed.
    #[error("rdma_resolve_addr({addr}) failed: {source}")]
    ResolveAddr {
        /// The destination.
        addr: std::net::SocketAddr,
        /// What the call reported.
        source: io::Error,
    },
    /// `rdma_resolve_route` failed.
    #[error("rdma_resolve_route failed: {0}")]
    ResolveRoute(#[source] io::Error),
    /// `rdma_connect` failed.
    #[error("rdma_connect failed: {0}")]
    Connect(#[source] io::Error),
    /// `rdma_accept` failed.
    #[error("rdma_accept failed: {0}")]
    Accept(#[source] io::Error),
    /// `rdma_disconnect` failed.
    #[error("rdma_disconnect failed: {0}")]
    Disconnect(#[source] io::Error),
    /// `rdma_get_cm_event` (or the wait for it: `poll(2)`, or registering
    /// the channel with tokio) failed.
    #[error("rdma_get_cm_event failed: {0}")]
    GetCmEvent(#[source] io::Error),
    /// `rdma_create_qp` failed.
    #[error("rdma_create_qp failed: {0}")]
    CreateQp(#[source] io::Error),
    /// `ibv_get_device_list` failed.
    #[error("ibv_get_device_list failed: {0}")]
    GetDeviceList(#[source] io::Error),
    /// `ibv_open_device` failed.
    #[error("ibv_open_device({name}) failed: {source}")]
    OpenDevice {
        /// The device.
        name: String,
        /// What the call reported.
        source: io::Error,
    },
    /// `ibv_query_port` failed.
    #[error("ibv_query_port failed: {0}")]
    QueryPort(#[source] io::Error),
    /// `ibv_alloc_pd` failed.
    #[error("ibv_alloc_pd failed: {0}")]
    AllocPd(#[source] io::Error),
    /// `ibv_alloc_mw` failed (EOPNOTSUPP: the device has no memory windows).
    #[error("ibv_alloc_mw failed: {0}")]
    AllocMw(#[source] io::Error),
    /// `ibv_create_cq` failed.
    #[error("ibv_create_cq failed: {0}")]
    CreateCq(#[source] io::Error),
    /// `ibv_dereg_mr` failed (the region stays registered).
    #[error("ibv_dereg_mr of {len} bytes failed: {source}")]
    DeregMr {
        /// The region's length.
        len: usize,
        /// What the call reported.
        source: io::Error,
    },
    /// `ibv_reg_mr` failed (often: `ulimit -l` too small).
    #[error("ibv_reg_mr of {len} bytes failed: {source}")]
    RegMr {
        /// The region's length.
        len: usize,
        /// What the call reported.
        source: io::Error,
    },
    /// `ibv_post_send` failed (ENOMEM: the send queue is full).
    #[error("ibv_post_send failed: {0}")]
    PostSend(#[source] io::Error),
    /// `ibv_post_recv` failed (ENOMEM: the receive queue is full).
    #[error("ibv_post_recv failed: {0}")]
    PostRecv(#[source] io::Error),
    /// `ibv_poll_cq` failed.
    #[error("ibv_poll_cq failed: {0}")]
    PollCq(#[source] io::Error),
    /// The connection manager reported another event than the one awaited
    /// (e.g. `RDMA_CM_EVENT_REJECTED`: nobody listens there).
    #[error("expected {expected}, got {got} (status {status})")]
    UnexpectedCmEvent {
        /// The awaited event.
        expected: &'static str,
        /// The event that came, as `rdma_event_str` names it.
        got: String,
        /// The event's status (a negative errno or a reject reason).
        status: i32,
    },
    /// The connect request was rejected (`RDMA_CM_EVENT_REJECTED`): by
    /// the server's application (its reason in `private_data`), or by the
    /// connection manager (nobody listens there: status 8 on RoCE).
    #[error("connection rejected (status {status})")]
    Rejected {
        /// The event's status (the reject reason).
        status: i32,
        /// What the server sent with its rejection (zero-padded).
        private_data: Vec<u8>,
    },
    /// `rdma_set_option` failed.
    #[error("rdma_set_option({option}) failed: {source}")]
    SetOption {
        /// The option.
        option: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_qp` failed.
    #[error("ibv_query_qp failed: {0}")]
    QueryQp(#[source] io::Error),
    /// A work request completed with an error status.
    #[error("work request {wr_id} completed with {status_name} (status {status}, vendor error {vendor_err:#x})")]
    WorkCompletion {
        /// The request's id.
        wr_id: u64,
        /// `ibv_wc_status`.
        status: u32,
        /// As `ibv_wc_status_str` names it.
        status_name: String,
        /// The provider's code.
        vendor_err: u32,
    },
    /// Nothing came within the time limit.
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// The limit.
        timeout: std::time::Duration,
    },
    /// No RDMA device has this name.
    #[error("no RDMA device named {name:?} (devices: {available:?})")]
    DeviceNotFound {
        /// The name asked for.
        name: String,
        /// The devices there are.
        available: Vec<String>,
    },
    /// The `cm_id` is not bound to a device yet (bind or resolve first).
    #[error("the cm_id has no device yet: bind it or resolve an address first")]
    NoDevice,
    /// A range lies outside its memory region.
    #[error("range {start}..{end} is outside a region of {len} bytes")]
    OutOfBounds {
        /// Start of the range.
        start: u64,
        /// End of the range.
        end: u64,
        /// The region's length.
        len: u64,
    },
    /// A work request needs the lkey of memory not registered yet (only
    /// inline sends may come from such memory).
    #[error("a {len}-byte work request from memory not registered (register it first)")]
    NotRegistered {
        /// The request's length.
        len: u32,
    },
    /// The memory region belongs to another protection domain than the QP.
    #[error("the memory region belongs to another protection domain than the queue pair")]
    ForeignMemoryRegion,
    /// `rdma_migrate_id` failed.
    #[error("rdma_migrate_id failed: {0}")]
    MigrateId(#[source] io::Error),
    /// `rdma_reject` failed.
    #[error("rdma_reject failed: {0}")]
    Reject(#[source] io::Error),
    /// `ibv_create_comp_channel` failed.
    #[error("ibv_create_comp_channel failed: {0}")]
    CreateCompChannel(#[source] io::Error),
    /// `ibv_req_notify_cq` failed.
    #[error("ibv_req_notify_cq failed: {0}")]
    ReqNotifyCq(#[source] io::Error),
    /// `ibv_get_cq_event` failed.
    #[error("ibv_get_cq_event failed: {0}")]
    GetCqEvent(#[source] io::Error),
    /// `ibv_get_async_event` failed.
    #[error("ibv_get_async_event failed: {0}")]
    GetAsyncEvent(#[source] io::Error),
    /// Making a device context's async event descriptor non-blocking failed.
    #[error("making the async event descriptor non-blocking failed: {0}")]
    AsyncEventFd(#[source] io::Error),
    /// Connection private data is longer than the connection manager carries.
    #[error("private data of {0} bytes is too long (at most {max})", max = u8::MAX)]
    PrivateDataTooLong(usize),
}
