//! The seam between the RPC runtime and the wire: message-oriented transports.
//!
//! A [`Transport`] connects to and listens on addresses of one URL scheme
//! (`tcp`, `rdma`, `mem`). A [`Connection`] carries whole frames both ways:
//!
//! - [`FrameSink::poll_send`] hands the transport an [`OutFrame`] that knows
//!   its length; the transport gives it a buffer of its own to encode into
//!   (registered memory for RDMA, the socket's write buffer for TCP), so a
//!   message is encoded exactly once and never copied by the runtime.
//! - [`FrameSource::poll_recv`] yields each received frame as [`Bytes`] that
//!   may point into the transport's receive buffer; the transport gets the
//!   space back when the last reference drops.
//!
//! Transports are found by scheme in a process-wide registry: a program calls
//! e.g. `transport_tcp::install()` once, and every `tcp://` address works.
//!
//! What the runtime counts about connections (per scheme), and what
//! transports report about themselves, is in [`stats`], for metrics.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, OnceLock, RwLock};
use std::task::{Context, Poll};

use bytes::Bytes;

use crate::frame::OutFrame;

pub mod mem;
mod refusal_log;
pub mod stats;

pub use refusal_log::RefusalLog;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A way to reach peers: connect to and listen on addresses of one scheme.
pub trait Transport: Send + Sync + 'static {
    /// The URL scheme this transport serves, e.g. `"tcp"`.
    fn scheme(&self) -> &'static str;

    /// Connects to `authority` (the address without `scheme://`, e.g. `10.0.0.5:7000`).
    fn connect<'a>(
        &'a self,
        authority: &'a str,
        limits: FrameLimits,
    ) -> BoxFuture<'a, Result<Connection, TransportError>>;

    /// Starts listening on `authority`.
    fn listen<'a>(
        &'a self,
        authority: &'a str,
        limits: FrameLimits,
    ) -> BoxFuture<'a, Result<Box<dyn Listener>, TransportError>>;

    /// What this transport reports about itself for metrics, read at each
    /// scrape (not on any call's path): e.g. RDMA's pinned memory and
    /// device events. None by default. The runtime counts what every
    /// transport has (connections, reconnects, send stalls) itself: see
    /// [`stats`].
    fn stats(&self) -> Vec<stats::TransportStat> {
        Vec::new()
    }
}

/// Limits a connection's frames must respect, set by the runtime from its configuration.
///
/// An incoming frame longer than `max_frame_len` is not buffered: the source
/// skips it and returns [`TransportError::Oversized`] with the frame's first
/// [`OVERSIZED_PREFIX_LEN`] bytes, so the runtime fails that one call with
/// `ResourceExhausted` and the connection goes on. A frame longer than
/// [`FrameLimits::max_skip_len`] is taken as a broken peer:
/// [`TransportError::FrameTooLarge`], and the connection closes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// The longest frame delivered, head and header fields included.
    pub max_frame_len: usize,
}

impl FrameLimits {
    /// The longest frame skipped rather than treated as a protocol error: 4 × `max_frame_len`.
    pub fn max_skip_len(&self) -> usize {
        self.max_frame_len.saturating_mul(4)
    }
}

/// How many leading bytes of a skipped frame [`TransportError::Oversized`]
/// carries: the frame's fixed head, which names its call.
pub const OVERSIZED_PREFIX_LEN: usize = crate::frame::HEAD_LEN;

/// Accepts connections on a listening address.
pub trait Listener: Send + 'static {
    /// Waits for the next connection.
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Connection, TransportError>>;

    /// The address actually bound, as a full URL (`tcp://127.0.0.1:40123`):
    /// with port 0, this tells the port the system chose.
    fn local_addr(&self) -> String;
}

/// One established connection, split into its sending and receiving halves.
pub struct Connection {
    /// Sends frames; shared by every task that sends on this connection.
    pub sink: Arc<dyn FrameSink>,
    /// Receives frames: the connection's reader task polls it, and a
    /// client's caller waiting alone reads its own answer with it.
    pub source: Box<dyn FrameSource>,
    /// The peer, for logs and errors (`tcp://10.0.0.5:7000`).
    pub peer: String,
    /// Who the peer proved to be, where the transport authenticates peers
    /// (a TLS client certificate's name, an RDMA peer that proved the shared
    /// secret); `None` where it does not.
    pub identity: Option<String>,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.peer)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// The sending half of a connection.
///
/// Ordering: frames of one call (the same call id, bytes 4..12 of the
/// frame) arrive in the order sent, and so do frames of one `poll_send`
/// caller with no call id of their own (id 0: pings, `GoAway`); frames
/// interleave whole, never byte-wise. A transport may deliver a frame
/// before an earlier frame of *another* call, so that small calls do not
/// wait behind a large transfer (the RDMA transport does: a small frame
/// passes a large one it sends in chunks or by rendezvous; tcp:// and
/// mem:// keep every frame in order). rpc-core relies on
/// nothing more: a call's frames, and a connection's closing after
/// everything sent, keep their order.
pub trait FrameSink: Send + Sync + 'static {
    /// Sends `frame`, or returns `Pending` (and wakes `cx` later) while the
    /// transport has no room: its buffer is full, or the peer has granted no
    /// credit. When this returns `Ready(Ok(()))` the frame has been encoded
    /// into the transport's memory and will be sent without further calls.
    ///
    /// Fails once the connection is closed or broken; the error is the cause.
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        frame: &OutFrame<'_>,
    ) -> Poll<Result<(), TransportError>>;

    /// Starts an orderly close: frames already accepted are still sent, then
    /// the peer sees end-of-stream. Later sends, and sends waiting for room,
    /// fail with [`TransportError::Closed`].
    fn close(&self);

    /// After [`close`](Self::close): `Ready` once every frame accepted is
    /// out and the peer was told the end (or the connection failed and
    /// nothing more can go). A server's graceful shutdown waits for this
    /// before `serve` returns, so that a process that exits then has lost
    /// no answer: a transport that sends from a task of its own must say
    /// when that task is done. The default, `Ready` at once, is right for a
    /// transport whose accepted frames are already with the peer or the
    /// kernel.
    fn poll_closed(&self, _cx: &mut Context<'_>) -> Poll<()> {
        Poll::Ready(())
    }

    /// `len` bytes of memory this connection sends from with no
    /// copy (see [`PayloadBuffer`](crate::PayloadBuffer)), or `Pending`
    /// while the transport's pool for them is full (it wakes `cx` when
    /// one is given back). The default hands out heap memory at once.
    fn poll_payload_buffer(
        &self,
        _cx: &mut Context<'_>,
        len: usize,
    ) -> Poll<Result<crate::PayloadBuffer, TransportError>> {
        Poll::Ready(Ok(crate::PayloadBuffer::heap(len)))
    }
}

/// The receiving half of a connection.
pub trait FrameSource: Send + 'static {
    /// The next whole frame; `Ok(None)` when the peer closed the connection in order.
    ///
    /// Several tasks may poll one source in turn (a client's callers read
    /// their own answers while its reader task waits). As for any future,
    /// the waker to wake for what arrives next is that of the latest poll,
    /// whatever the poll returned: the one reading knows it replaced the
    /// one waiting, and hands the waiting back by polling with its waker.
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, TransportError>>;
}

/// Polls `op` as one unit of the task's tokio budget: once the task has
/// used its budget, `Pending` (the task is woken at once and runs again
/// after the worker's other tasks) instead of `op`.
///
/// tokio's own sockets and channels do this; a transport's halves are not
/// tokio resources, so `send` and `recv` do it for them, and a transport's
/// own byte-stream or frame API should call it the same way. Without it a
/// handler streaming from an always-ready source to a reader as fast as
/// itself never returned `Pending`, and its worker ran nothing else: a
/// connection's driver task parked on that worker stalled the connection
/// for good (`link_down`, two Soft-RoCE guests).
pub fn cooperatively<T>(
    cx: &mut Context<'_>,
    op: impl FnOnce(&mut Context<'_>) -> Poll<T>,
) -> Poll<T> {
    let budget = std::task::ready!(tokio::task::coop::poll_proceed(cx));
    let result = std::task::ready!(op(cx));
    budget.made_progress();
    Poll::Ready(result)
}

impl dyn FrameSink {
    /// Sends `frame`, waiting while the transport has no room. Each frame
    /// counts against the task's tokio budget, as a socket write does.
    pub async fn send(&self, frame: &OutFrame<'_>) -> Result<(), TransportError> {
        std::future::poll_fn(|cx| cooperatively(cx, |cx| self.poll_send(cx, frame))).await
    }

    /// `len` bytes of memory this connection sends from with no copy
    /// ([`poll_payload_buffer`](FrameSink::poll_payload_buffer)), waiting
    /// while the transport's pool for them is full.
    pub async fn payload_buffer(&self, len: usize) -> Result<crate::PayloadBuffer, TransportError> {
        std::future::poll_fn(|cx| self.poll_payload_buffer(cx, len)).await
    }

    /// Sends `frame` only if the transport takes it at once; `Ok(false)`
    /// when it has no room. For the control frames a connection's reader
    /// sends (pings, pongs, goaways): a reader that waited for room could
    /// wait forever on a dead peer, and would stop reading meanwhile.
    pub fn try_send(&self, frame: &OutFrame<'_>) -> Result<bool, TransportError> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match self.poll_send(&mut cx, frame) {
            Poll::Ready(Ok(())) => Ok(true),
            Poll::Ready(Err(e)) => Err(e),
            Poll::Pending => Ok(false),
        }
    }
}

impl dyn FrameSource {
    /// Receives the next frame. Each frame counts against the task's tokio
    /// budget, as a socket read does.
    pub async fn recv(&mut self) -> Result<Option<Bytes>, TransportError> {
        std::future::poll_fn(|cx| cooperatively(cx, |cx| self.poll_recv(cx))).await
    }
}

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// An operating-system or device call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done (`connect to 10.0.0.5:7000`).
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The address is not one this transport understands.
    #[error("invalid address {address:?}: {reason}")]
    InvalidAddress {
        /// The address as given.
        address: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Not fatal: the peer sent a frame longer than the limit; it was skipped.
    #[error("peer sent a frame of {len} bytes, over the limit of {max}; it was skipped")]
    Oversized {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
        /// The frame's first [`OVERSIZED_PREFIX_LEN`] bytes (fewer if the frame is shorter).
        prefix: Bytes,
    },
    /// The peer sent a frame too long to skip (over [`FrameLimits::max_skip_len`]).
    #[error("peer sent a frame of {len} bytes, over the limit of {max}")]
    FrameTooLarge {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The peer broke the transport's own protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The connection was closed (by this side, or the peer went away).
    #[error("connection closed")]
    Closed,
}

impl TransportError {
    /// An [`TransportError::Io`] with what was being done.
    pub fn io(context: impl Into<String>, source: io::Error) -> TransportError {
        TransportError::Io {
            context: context.into(),
            source,
        }
    }
}

fn registry() -> &'static RwLock<HashMap<&'static str, Arc<dyn Transport>>> {
    static REGISTRY: OnceLock<RwLock<HashMap<&'static str, Arc<dyn Transport>>>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut transports: HashMap<&'static str, Arc<dyn Transport>> = HashMap::new();
        transports.insert("mem", Arc::new(mem::MemTransport));
        RwLock::new(transports)
    })
}

/// Makes `transport` serve its scheme in this process (replacing any earlier one).
///
/// Transport crates wrap this in an `install()` function with default settings.
pub fn register(transport: Arc<dyn Transport>) {
    registry()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(transport.scheme(), transport);
}

/// The transport registered for `scheme`.
pub fn lookup(scheme: &str) -> Option<Arc<dyn Transport>> {
    registry()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(scheme)
        .cloned()
}

/// The schemes that have a transport, sorted (for error messages).
pub fn registered_schemes() -> Vec<&'static str> {
    let mut schemes: Vec<_> = registry()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .keys()
        .copied()
        .collect();
    schemes.sort_unstable();
    schemes
}

/// Splits `scheme://authority`.
pub fn split_address(address: &str) -> Option<(&str, &str)> {
    let (scheme, authority) = address.split_once("://")?;
    (!scheme.is_empty() && !authority.is_empty()).then_some((scheme, authority))
}

/// A sink with room for every frame, at once, that sends them nowhere:
/// for unit tests.
#[cfg(test)]
pub(crate) struct AlwaysRoom;

#[cfg(test)]
impl FrameSink for AlwaysRoom {
    fn poll_send(&self, _: &mut Context<'_>, _: &OutFrame<'_>) -> Poll<Result<(), TransportError>> {
        Poll::Ready(Ok(()))
    }

    fn close(&self) {}
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::frame::OutBody;

    /// A task sending frame after frame to a transport that always has room
    /// still lets the other tasks of its thread run: `send` yields once the
    /// task's budget is spent, as a socket write would.
    #[tokio::test(flavor = "current_thread")]
    async fn a_sender_that_never_waits_for_room_still_yields() {
        let other_ran = Arc::new(AtomicBool::new(false));
        let other = tokio::spawn({
            let other_ran = Arc::clone(&other_ran);
            async move { other_ran.store(true, Ordering::SeqCst) }
        });
        let sink: Arc<dyn FrameSink> = Arc::new(AlwaysRoom);
        let frame = OutFrame::control(1, OutBody::Message, false);
        // tokio's budget is 128 units a poll: ten times that.
        for _ in 0..1280 {
            sink.send(&frame).await.unwrap();
            if other_ran.load(Ordering::SeqCst) {
                break;
            }
        }
        assert!(
            other_ran.load(Ordering::SeqCst),
            "1,280 sends in a row never yielded to the thread's other task"
        );
        other.await.unwrap();
    }
}
