//! The verbs layer: thin, owning wrappers over librdmacm and libibverbs.
//!
//! Every `unsafe` block of the crate's RDMA code lives under this module,
//! each with the condition that makes it sound. The raw bindings are
//! re-exported as [`ffi`] for what the wrappers do not cover yet.
//!
//! # Resource cleanup
//! Each wrapper owns one C object and keeps alive, by reference counting,
//! the objects it was made from: a [`QueuePair`] keeps its [`CmId`],
//! [`ProtectionDomain`] and [`CompletionQueue`]s; a [`MemoryRegion`] its
//! protection domain; everything its [`CmId`], which keeps its
//! [`EventChannel`]. So whatever order values are dropped in, the C objects
//! are destroyed in dependency order (QP, then MR, CQ, PD, then the
//! `cm_id`, then the channel).
//!
//! # Thread safety
//! libibverbs and librdmacm calls are thread-safe, so the handles are
//! `Send` and (except [`MemoryRegion`] and [`QueuePair`]) `Sync`: a
//! connection's objects may move between the threads of an async runtime.
//! A memory region's buffer is shared with the device, so it is only
//! `Send`; posting to a queue pair takes `&mut self`.
//!
//! # Time limits
//! Every wait takes a timeout: connection-manager events through `poll(2)`
//! on the channel's non-blocking file descriptor, completions by polling the
//! completion queue.

mod async_event;
mod cm;
mod cq;
mod device;
mod error;
mod mr;
mod pd;
mod qp;

pub use rdma_sys as ffi;

pub use async_event::{AsyncEvent, AsyncEventKind, AsyncEvents, CqId, DeviceId, EventElement};
pub use cm::{CmEvent, CmId, ConnectRequest, EventChannel};
pub use cq::{CompletionChannel, CompletionQueue, WorkCompletion};
pub use device::{device_names, Context, PortInfo};
pub use error::{Error, Result};
pub use mr::{Access, MemoryRegion, RemoteRegion};
pub use pd::ProtectionDomain;
pub use qp::{QpCapabilities, QueuePair};

use std::io;

/// The `io::Error` for a C call that reported failure through `errno`.
fn last_os_error() -> io::Error {
    io::Error::last_os_error()
}

/// The `io::Error` for a C call that returns the error number itself
/// (`ibv_post_send`, `ibv_query_port`, ...).
fn errno_error(ret: i32) -> io::Error {
    io::Error::from_raw_os_error(ret.abs())
}
