//! The verbs layer: thin, owning wrappers over librdmacm and libibverbs.
//!
//! Every `unsafe` block of the crate's RDMA code lives under this module,
//! each with the condition that makes it sound. The raw bindings are
//! re-exported as [`ffi`] for what the wrappers do not cover yet.
//!
//! # Resource cleanup
//! Each wrapper owns one C object and keeps alive, by reference counting,
//! the objects it was made from: a [`QueuePair`] keeps its `cm_id`,
//! [`ProtectionDomain`] and [`CompletionQueue`]s; a [`MemoryRegion`] its
//! protection domain; a completion queue its [`CompletionChannel`];
//! everything its `cm_id`, which keeps its [`EventChannel`]. So a C object
//! is never destroyed before one made from it: the PD, CQs, `cm_id` and
//! channels go last, whatever order the values are dropped in.
//!
//! Reference counting does **not** order a queue pair against the memory
//! its work requests use: a posted receive, send or RDMA WRITE names a
//! [`MemoryRegion`] by address and key only, and a peer that knows a
//! region's rkey can write it while the QP lives. That is why posting is
//! `unsafe`: the caller keeps each region registered (and its buffer
//! allocated) until the request completed or the QP is destroyed, which in
//! practice means the owner of both drops the QP first (the transport's
//! connection types declare the QP before the memory, see `conn/setup.rs`). A
//! region whose deregistration fails is leaked, never freed.
//!
//! # Thread safety
//! libibverbs calls are thread-safe, so the handles are `Send`, and those
//! without interior state `Sync`. A memory region's buffer is shared with
//! the device, so [`MemoryRegion`] is only `Send`; posting to a
//! [`QueuePair`] takes `&mut self`; a [`CmId`] has one owner (not
//! `Clone`) and its state-changing calls (bind, resolve, connect, accept,
//! reject, disconnect, creating its QP) take `&mut self`, since librdmacm
//! updates the `rdma_cm_id` structure in them.
//!
//! # Time limits
//! Every wait takes a timeout: connection-manager events through `poll(2)`
//! on the channel's non-blocking file descriptor, completions by polling the
//! completion queue. These waits block the calling thread; the transport
//! itself uses only the `start_*` calls ([`CmId::start_connect`], ...) and
//! reads the channel when tokio reports its descriptor readable.

mod async_event;
mod cm;
mod cq;
mod device;
mod error;
mod mr;
mod mw;
mod pd;
mod qp;

pub use rdma_sys as ffi;

pub use async_event::{
    async_events_read, AsyncEvent, AsyncEventKind, AsyncEvents, CqId, DeviceEventCounts, DeviceId,
    EventElement,
};
pub use cm::{CmEvent, CmId, ConnectRequest, EventChannel};
pub(crate) use cm::{Event as CmEventRecord, SharedCmId};
pub use cq::{
    completion_channels, completion_queues, CompletionBatch, CompletionChannel, CompletionQueue,
    WorkCompletion,
};
pub use device::{device_names, Context, PortInfo};
pub use error::{Error, Result};
pub(crate) use mr::PAGE;
pub use mr::{
    memory_registrations, registered_bytes, Access, MemoryRegion, RegisteredBytes, RemoteRegion,
};
pub use mw::MemoryWindow;
pub use pd::{protection_domains, ProtectionDomain};
pub use qp::{queue_pairs, QpCapabilities, QueuePair, SendBatch, SendPoster};

use std::io;

/// RDMA READs a queue pair keeps in flight as initiator, and serves as
/// responder (the connection manager's `initiator_depth` and
/// `responder_resources`; rxe allows 128, most NICs 16).
pub const READ_DEPTH: u32 = 16;

/// Times a queue pair resends a SEND the peer answered "receiver not ready"
/// (the connection manager's `rnr_retry_count`): none. Credits keep a
/// receive posted for every SEND, so an RNR is a broken peer or a bug; it
/// fails the connection at once instead of retrying (7 retries forever).
pub const RNR_RETRY: u8 = 0;

/// The `io::Error` for a C call that reported failure through `errno`.
fn last_os_error() -> io::Error {
    io::Error::last_os_error()
}

/// The `io::Error` for a C call that returns the error number itself
/// (`ibv_post_send`, `ibv_query_port`, ...).
fn errno_error(ret: i32) -> io::Error {
    io::Error::from_raw_os_error(ret.abs())
}

/// How many objects of one kind (protection domains, queue pairs, ...) the
/// process holds: counted where they are created and destroyed, read by
/// tests and metrics. One relaxed atomic.
struct LiveCount(std::sync::atomic::AtomicUsize);

impl LiveCount {
    const fn new() -> LiveCount {
        LiveCount(std::sync::atomic::AtomicUsize::new(0))
    }

    fn created(&self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn destroyed(&self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn get(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}
