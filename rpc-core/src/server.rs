//! The server side: a [`Server`] accepts connections and runs each call's
//! handler in its own task; generated code implements [`Service`].

use std::collections::{HashMap, VecDeque};
use std::future::{pending, Future};
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use futures::{FutureExt, Stream, StreamExt};
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;
use tracing::Instrument;

use crate::client::{
    frame_limits, resolve, AddressError, DEFAULT_MAX_MESSAGE_SIZE, MAX_MESSAGE_SIZE_LIMIT,
};
use crate::codec::{Codec, Encodable};
use crate::flow::{SendWindow, DEFAULT_STREAM_WINDOW, INITIAL_STREAM_WINDOW};
use crate::frame::{peek_head, EncodePayload, Frame, FrameBody, FrameKind, OutBody, OutFrame};
use crate::keepalive::{Keepalive, KeepaliveTimer, Tick, DEFAULT_KEEPALIVE};
use crate::message::{Inbound, RecvWindow, Request, Response, Streaming, StreamingParts};
use crate::metadata::MetadataMap;
use crate::status::Status;
use crate::transport::{BoxFuture, Connection, FrameSink, FrameSource, Listener, TransportError};

/// A service a [`Server`] routes calls to; implemented by generated `FooServer<T>` types.
pub trait Service: Send + Sync + 'static {
    /// The full protobuf name, `package.Service`.
    fn name(&self) -> &'static str;

    /// Runs one call of `method` (the protobuf method name) to completion,
    /// sending its responses and final status through `call`.
    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()>;
}

/// Starting the server failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The address is unusable.
    #[error(transparent)]
    Address(#[from] AddressError),
    /// The transport could not listen there.
    #[error("listening on {address} failed: {source}")]
    Listen {
        /// The address.
        address: String,
        /// Why.
        #[source]
        source: TransportError,
    },
}

/// Entry point: `Server::builder()`.
///
/// ```no_run
/// # async fn run(service: impl rpc_core::codegen::Service) -> Result<(), rpc_core::ServeError> {
/// rpc_core::Server::builder()
///     .add_service(service)
///     .serve_with_shutdown("tcp://0.0.0.0:50051", async { tokio::signal::ctrl_c().await.ok(); })
///     .await
/// # }
/// ```
#[derive(Debug)]
pub struct Server;

impl Server {
    /// A builder to add services to and configure.
    pub fn builder() -> ServerBuilder {
        ServerBuilder {
            services: HashMap::new(),
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            stream_window: DEFAULT_STREAM_WINDOW,
            shutdown_grace: None,
            keepalive: Some(DEFAULT_KEEPALIVE),
            max_concurrent_calls: Some(DEFAULT_MAX_CONCURRENT_CALLS),
        }
    }
}

/// Calls one connection may have open at once unless the builder says otherwise.
///
/// gRPC servers advertise 100 concurrent streams (gRPC-Go's HTTP/2 default);
/// fan-out users of this framework open one call per shard on a shared
/// channel, so the bound is ten times that. What matters is that it is finite:
/// it is what bounds a connection's memory (see [`ServerBuilder`]).
pub const DEFAULT_MAX_CONCURRENT_CALLS: usize = 1024;

/// Configures a server; see [`Server`].
///
/// # What one connection can make the server hold
/// A client cannot make the server hold more than, per connection:
/// - [`max_concurrent_calls`](Self::max_concurrent_calls) open calls (default
///   [`DEFAULT_MAX_CONCURRENT_CALLS`]), each with its handler task and at most
///   one encoded reply waiting for room in the connection (a call counts as
///   open until its final status is handed to the transport, so replies a
///   client does not read hold their calls open, and further calls are
///   refused with `ResourceExhausted`);
/// - the transport's own send buffer (its write high-water mark);
/// - per call with a request stream, what the client sends ahead of the
///   handler: [`stream_window`](Self::stream_window) plus one message;
/// - refusals the connection reader answers itself (over the limit, unknown
///   method, oversized, shutting down) never wait for room: while one is
///   waiting, the reader takes no new frames from that client.
///
/// Measured (`transport-tcp/tests/unread_calls.rs`): 200,000 unary calls sent
/// on one connection by a client that reads no reply grow the server by
/// well under 64 MiB with the defaults.
pub struct ServerBuilder {
    services: HashMap<&'static str, Arc<dyn Service>>,
    max_message_size: usize,
    stream_window: u32,
    shutdown_grace: Option<Duration>,
    keepalive: Option<Keepalive>,
    max_concurrent_calls: Option<usize>,
}

impl std::fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerBuilder")
            .field("services", &self.services.keys())
            .finish_non_exhaustive()
    }
}

impl ServerBuilder {
    /// Routes calls for `service.name()` to `service`.
    ///
    /// # Panics
    /// If a service of the same name was added already.
    pub fn add_service<S: Service>(mut self, service: S) -> ServerBuilder {
        let name = service.name();
        assert!(
            self.services.insert(name, Arc::new(service)).is_none(),
            "service {name} added twice"
        );
        self
    }

    /// Largest message received or sent (default 64 MiB, at most 4 GiB - 1).
    /// A larger request fails with `ResourceExhausted`; the connection stays up.
    pub fn max_message_size(mut self, bytes: usize) -> ServerBuilder {
        self.max_message_size = bytes.min(MAX_MESSAGE_SIZE_LIMIT);
        self
    }

    /// Bytes a client may send on one request stream ahead of the handler (default 8 MiB).
    /// Enforced: a message the client starts beyond the window granted so far
    /// fails that call with `ResourceExhausted` (the connection goes on, as
    /// HTTP/2 treats a stream's flow-control error), so a call's queue of
    /// unread request messages holds at most this plus one message.
    pub fn stream_window(mut self, bytes: u32) -> ServerBuilder {
        self.stream_window = bytes.max(INITIAL_STREAM_WINDOW);
        self
    }

    /// On shutdown, how long in-flight calls may run before they are cancelled
    /// (default: as long as they take).
    pub fn shutdown_grace(mut self, grace: Duration) -> ServerBuilder {
        self.shutdown_grace = Some(grace);
        self
    }

    /// After `interval` without a frame from a client, ping it; if nothing
    /// arrives within `timeout` more, close the connection and cancel its
    /// handlers (defaults 20 s and 20 s).
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> ServerBuilder {
        self.keepalive = Some(Keepalive { interval, timeout });
        self
    }

    /// At most `calls` calls open at once on one connection (default
    /// [`DEFAULT_MAX_CONCURRENT_CALLS`]; `usize::MAX` lifts the limit, and
    /// with it the bound on a connection's memory). Calls over the limit fail
    /// at once with `ResourceExhausted`; the client may retry. (Reading is
    /// not paused instead: open streaming calls need their next messages to
    /// finish.)
    pub fn max_concurrent_calls(mut self, calls: usize) -> ServerBuilder {
        self.max_concurrent_calls = (calls != usize::MAX).then_some(calls);
        self
    }

    /// No keepalive pings: handlers of a client whose host died run on until they finish.
    pub fn no_keepalive(mut self) -> ServerBuilder {
        self.keepalive = None;
        self
    }

    /// Listens on `address`; [`BoundServer::local_addr`] tells the port chosen for port 0.
    pub async fn bind(self, address: &str) -> Result<BoundServer, ServeError> {
        let (transport, authority) = resolve(address)?;
        let listener = transport
            .listen(&authority, frame_limits(self.max_message_size))
            .await
            .map_err(|source| ServeError::Listen {
                address: address.into(),
                source,
            })?;
        Ok(BoundServer {
            local_addr: listener.local_addr(),
            listener,
            routes: Arc::new(Routes {
                services: self.services,
                max_message_size: self.max_message_size,
                stream_window: self.stream_window,
                keepalive: self.keepalive,
                max_concurrent_calls: self.max_concurrent_calls,
            }),
            shutdown_grace: self.shutdown_grace,
        })
    }

    /// Listens on `address` and serves until the process ends.
    pub async fn serve(self, address: &str) -> Result<(), ServeError> {
        self.bind(address).await?.serve().await
    }

    /// Listens on `address` and serves until `signal` completes, then shuts down gracefully.
    pub async fn serve_with_shutdown(
        self,
        address: &str,
        signal: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        self.bind(address).await?.serve_with_shutdown(signal).await
    }
}

struct Routes {
    services: HashMap<&'static str, Arc<dyn Service>>,
    max_message_size: usize,
    stream_window: u32,
    keepalive: Option<Keepalive>,
    max_concurrent_calls: Option<usize>,
}

/// A server listening on an address, not yet serving.
pub struct BoundServer {
    listener: Box<dyn Listener>,
    local_addr: String,
    routes: Arc<Routes>,
    shutdown_grace: Option<Duration>,
}

impl std::fmt::Debug for BoundServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundServer")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl BoundServer {
    /// The address bound, as a URL clients can connect to (`tcp://127.0.0.1:40123`).
    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    /// Serves until the process ends.
    pub async fn serve(self) -> Result<(), ServeError> {
        self.serve_with_shutdown(pending()).await
    }

    /// Serves until `signal` completes, then shuts down gracefully: stops
    /// accepting, tells every client to send no new calls (GoAway), lets calls
    /// in flight finish (within the shutdown grace, if set) and closes.
    pub async fn serve_with_shutdown(
        mut self,
        signal: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let mut connections = JoinSet::new();
        let mut signal = pin!(signal);
        let mut accept_errors = ErrorReportInterval::default();
        tracing::info!(address = %self.local_addr, "serving");
        loop {
            tokio::select! {
                accepted = std::future::poll_fn(|cx| self.listener.poll_accept(cx)) => match accepted {
                    Ok(connection) => {
                        connections.spawn(serve_connection(Arc::clone(&self.routes), connection, shutdown_rx.clone()));
                    }
                    Err(TransportError::Closed) => break,
                    Err(error) => {
                        // The listener already skips errors that concern one
                        // client (a reset before accept); what reaches here is
                        // the listener's own trouble (out of file descriptors,
                        // memory): retry after a short pause, report once a second.
                        if let Some(suppressed) = accept_errors.report(Instant::now()) {
                            tracing::warn!(
                                address = %self.local_addr,
                                "accepting connections failed: {error}; retrying every {ACCEPT_RETRY:?} \
                                 ({suppressed} more failures since the last report)"
                            );
                        }
                        tokio::time::sleep(ACCEPT_RETRY).await;
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                () = &mut signal => break,
            }
        }
        drop(self.listener);
        tracing::info!(address = %self.local_addr, "shutting down: draining {} connections", connections.len());
        let _ = shutdown_tx.send(true);
        let drain = async { while connections.join_next().await.is_some() {} };
        match self.shutdown_grace {
            None => drain.await,
            Some(grace) => {
                if tokio::time::timeout(grace, drain).await.is_err() {
                    tracing::warn!(
                        "shutdown grace of {grace:?} passed: cancelling the calls still running"
                    );
                    connections.shutdown().await;
                }
            }
        }
        Ok(())
    }
}

/// Pause after the listener fails before accepting again.
const ACCEPT_RETRY: Duration = Duration::from_millis(20);

/// Reports a repeating error at most once per second, with a count of the
/// ones not reported.
#[derive(Debug, Default)]
struct ErrorReportInterval {
    last_report: Option<Instant>,
    suppressed: u64,
}

impl ErrorReportInterval {
    const INTERVAL: Duration = Duration::from_secs(1);

    /// An error happened at `now`: `Some(errors suppressed since the last
    /// report)` if this one is to be reported.
    fn report(&mut self, now: Instant) -> Option<u64> {
        match self.last_report {
            Some(last) if now.saturating_duration_since(last) < Self::INTERVAL => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last_report = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// One connection's server state: the calls open on it.
struct ServerConn {
    sink: Arc<dyn FrameSink>,
    peer: String,
    routes: Arc<Routes>,
    calls: Mutex<HashMap<u64, CallSlot>>,
    /// Handlers' final statuses waiting for room in the sink (their slots are gone).
    finishing: AtomicUsize,
    /// Notified when the last open call ends (graceful shutdown waits for it).
    idle: Notify,
}

/// A handler's final status on its way into the sink: counted as an open call.
struct FinalInFlight<'a>(&'a ServerConn);

impl Drop for FinalInFlight<'_> {
    fn drop(&mut self) {
        let calls = self.0.calls();
        if self.0.finishing.fetch_sub(1, Ordering::AcqRel) == 1 && calls.is_empty() {
            self.0.idle.notify_one();
        }
    }
}

struct CallSlot {
    /// Where the reader delivers the client's stream; `None` once it ended.
    /// Unbounded, but what it holds is bounded by the window the server
    /// granted (checked against `received`) plus one message.
    inbound: Option<mpsc::UnboundedSender<Inbound>>,
    /// Bytes of request-stream messages received, held to the window granted.
    received: u64,
    window: Arc<SendWindow>,
    task: Option<AbortHandle>,
}

impl ServerConn {
    fn calls(&self) -> std::sync::MutexGuard<'_, HashMap<u64, CallSlot>> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Removes call `id`; returns whether it was open (so exactly one final status is sent).
    fn end_call(&self, id: u64) -> Option<CallSlot> {
        let mut calls = self.calls();
        let slot = calls.remove(&id)?;
        slot.window.close();
        if self.open_calls(&calls) == 0 {
            self.idle.notify_one();
        }
        Some(slot)
    }

    /// Sends the final status of call `id` (with a last message), if the call
    /// is still open. The call stays open (counted against the limit) until
    /// the frame is in the sink, so replies a client does not read hold
    /// their calls, not an unbounded queue of waiting replies.
    async fn finish(&self, id: u64, status: &Status, payload: Option<&dyn EncodePayload>) {
        // The slot goes now (the client may reuse the id once it has the
        // status), but the call counts against the limit until the frame is
        // in the sink.
        let Some(_finishing) = self.end_call_for_final(id) else {
            return; // cancelled, or already finished
        };
        let fallback;
        let frame = match OutFrame::new(id, OutBody::Status(status), payload, false) {
            Ok(frame) => frame,
            Err(error) => {
                fallback = Status::internal(format!("status could not be encoded: {error}"));
                OutFrame::control(id, OutBody::Status(&fallback), false)
            }
        };
        if let Err(error) = self.sink.send(&frame).await {
            tracing::debug!(peer = %self.peer, "final status not sent: {error}");
        }
    }

    /// Calls open, final statuses waiting for room included: what the limit counts.
    fn open_calls(&self, calls: &HashMap<u64, CallSlot>) -> usize {
        calls.len() + self.finishing.load(Ordering::Acquire)
    }

    /// Ends call `id` for its handler's final status: the returned guard
    /// counts it as open until the status is in the sink (or given up on).
    fn end_call_for_final(&self, id: u64) -> Option<FinalInFlight<'_>> {
        let mut calls = self.calls();
        let slot = calls.remove(&id)?;
        slot.window.close();
        self.finishing.fetch_add(1, Ordering::AcqRel);
        Some(FinalInFlight(self))
    }

    fn abort_all(&self) {
        for (_, slot) in self.calls().drain() {
            slot.window.close();
            if let Some(task) = slot.task {
                task.abort();
            }
        }
    }

    fn dispatch(
        self: &Arc<Self>,
        frame: Frame,
        draining: bool,
        backlog: &mut RefusalBacklog,
    ) -> Result<(), String> {
        let id = frame.call_id;
        match frame.body {
            FrameBody::Request {
                method,
                timeout,
                metadata,
            } => {
                let open = {
                    let calls = self.calls();
                    if calls.contains_key(&id) {
                        return Err(format!("call id {id:#x} reused while its call is open"));
                    }
                    self.open_calls(&calls)
                };
                if let Some(limit) = self.routes.max_concurrent_calls.filter(|&l| open >= l) {
                    let status = Status::resource_exhausted(format!(
                        "{open} calls already open on this connection, the server's limit is {limit}"
                    ));
                    backlog.refuse(&*self.sink, id, status);
                    return Ok(());
                }
                if draining {
                    backlog.refuse(
                        &*self.sink,
                        id,
                        Status::unavailable("server is shutting down"),
                    );
                    return Ok(());
                }
                if timeout == Some(Duration::ZERO) {
                    // As in gRPC: no time left means the handler is not run.
                    let status =
                        Status::deadline_exceeded("the request arrived with a timeout of zero");
                    backlog.refuse(&*self.sink, id, status);
                    return Ok(());
                }
                if let Some(len) = frame
                    .payload
                    .as_ref()
                    .map(Bytes::len)
                    .filter(|&l| l > self.routes.max_message_size)
                {
                    return self.refuse_oversized(
                        id,
                        FrameKind::Request,
                        Oversize::Message(len),
                        backlog,
                    );
                }
                self.open_call(
                    id,
                    method,
                    timeout,
                    metadata,
                    frame.payload,
                    frame.end_stream,
                    backlog,
                );
            }
            FrameBody::Message => {
                if let Some(len) = frame
                    .payload
                    .as_ref()
                    .map(Bytes::len)
                    .filter(|&l| l > self.routes.max_message_size)
                {
                    return self.refuse_oversized(
                        id,
                        FrameKind::Message,
                        Oversize::Message(len),
                        backlog,
                    );
                }
                let mut calls = self.calls();
                let Some(slot) = calls.get_mut(&id) else {
                    return Ok(()); // the call already ended: its late messages are dropped
                };
                if slot.inbound.is_none() {
                    return Err(format!(
                        "message after the end of call {id:#x}'s request stream"
                    ));
                }
                // The client may start a message while its window is
                // positive: one that starts beyond what was granted ignores
                // flow control, and would make this queue grow without bound.
                // (A frame that only ends the stream carries no message.)
                let granted = slot.window.granted_to_peer();
                if frame.payload.is_some() && slot.received >= granted {
                    let received = slot.received;
                    drop(calls);
                    if let Some(slot) = self.end_call(id) {
                        if let Some(task) = slot.task {
                            task.abort();
                        }
                    }
                    let status = Status::resource_exhausted(format!(
                        "the client sent {received} bytes on the request stream and more, \
                         beyond the {granted}-byte window the server granted (flow control ignored)"
                    ));
                    backlog.refuse(&*self.sink, id, status);
                    return Ok(());
                }
                slot.received += frame.payload.as_ref().map_or(0, |p| p.len() as u64);
                let Some(inbound) = &slot.inbound else {
                    unreachable!("checked above");
                };
                if let Some(payload) = frame.payload {
                    let _ = inbound.send(Inbound::Message(payload));
                }
                if frame.end_stream {
                    let _ = inbound.send(Inbound::End);
                    slot.inbound = None;
                }
            }
            FrameBody::Cancel => {
                if let Some(slot) = self.end_call(id) {
                    tracing::debug!(peer = %self.peer, call_id = id, "cancelled by the client");
                    if let Some(task) = slot.task {
                        task.abort();
                    }
                }
            }
            FrameBody::WindowUpdate(bytes) => {
                if let Some(slot) = self.calls().get(&id) {
                    slot.window.grant(bytes);
                }
            }
            FrameBody::GoAway(_) => {} // the client leaves; its open calls still finish
            FrameBody::Ping => {
                // Not sent when the sink is full: the frames filling it
                // prove this side alive just as well.
                let _ = self
                    .sink
                    .try_send(&OutFrame::control(0, OutBody::Pong, false));
            }
            FrameBody::Pong => {}
            FrameBody::Status(_) => return Err("a client does not send Status frames".into()),
        }
        Ok(())
    }

    /// Handles what the reader received: `Ok(true)` to read on, `Ok(false)`
    /// when the connection ended, `Err` when the client broke the protocol.
    fn handle(
        self: &Arc<Self>,
        received: Result<Option<Bytes>, TransportError>,
        draining: bool,
        backlog: &mut RefusalBacklog,
    ) -> Result<Reading, String> {
        match received {
            Ok(Some(bytes)) => {
                let frame = Frame::decode(bytes).map_err(|e| format!("malformed frame: {e}"))?;
                self.dispatch(frame, draining, backlog)?;
            }
            Ok(None) => return Ok(Reading::HalfClosed),
            Err(TransportError::Oversized { len, max, prefix }) => {
                let (id, kind) = peek_head(&prefix).map_err(|e| format!("malformed frame: {e}"))?;
                self.refuse_oversized(id, kind, Oversize::Frame { len, max }, backlog)?;
            }
            // A client that went away in the middle of sending a frame broke
            // nothing: it disconnected. (Older transports report it as a
            // protocol error with this wording; newer ones as `UnexpectedEof`.)
            Err(TransportError::Protocol(reason))
                if reason.starts_with("peer closed the connection inside a frame") =>
            {
                tracing::debug!(peer = %self.peer, "client disconnected in the middle of a frame: {reason}");
                return Ok(Reading::Ended);
            }
            Err(TransportError::Protocol(reason)) => return Err(reason),
            Err(error @ TransportError::FrameTooLarge { .. }) => return Err(error.to_string()),
            Err(TransportError::Io { source, context })
                if source.kind() == std::io::ErrorKind::UnexpectedEof =>
            {
                tracing::debug!(peer = %self.peer, "client disconnected in the middle of a frame: {context}: {source}");
                return Ok(Reading::Ended);
            }
            Err(error) => {
                tracing::debug!(peer = %self.peer, "connection failed: {error}");
                return Ok(Reading::Ended);
            }
        }
        Ok(Reading::On)
    }

    /// The client sends no more (it shut down its sending side): calls still
    /// waiting for request messages get none, so their streams fail.
    fn end_request_streams(&self) {
        for slot in self.calls().values_mut() {
            if let Some(inbound) = slot.inbound.take() {
                let _ = inbound.send(Inbound::Status(Status::cancelled(
                    "the client closed its sending side before ending the request stream",
                )));
            }
        }
    }

    /// Fails the call a too-large request message belongs to; the connection goes on.
    fn refuse_oversized(
        &self,
        id: u64,
        kind: FrameKind,
        size: Oversize,
        backlog: &mut RefusalBacklog,
    ) -> Result<(), String> {
        let max_message_size = self.routes.max_message_size;
        let status = Status::resource_exhausted(match size {
            Oversize::Message(len) => format!(
                "request message of {len} bytes is larger than the server's maximum message size of {max_message_size} bytes"
            ),
            Oversize::Frame { len, max } => format!(
                "request frame of {len} bytes is longer than the server's frame limit of {max} bytes \
                 (its maximum message size of {max_message_size} bytes plus headers)"
            ),
        });
        match kind {
            FrameKind::Request => backlog.refuse(&*self.sink, id, status),
            FrameKind::Message => {
                if let Some(slot) = self.end_call(id) {
                    if let Some(task) = slot.task {
                        task.abort();
                    }
                    backlog.refuse(&*self.sink, id, status);
                }
            }
            other => return Err(format!("{other:?} frame over the size limit: {size:?}")),
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn open_call(
        self: &Arc<Self>,
        id: u64,
        path: String,
        timeout: Option<Duration>,
        metadata: MetadataMap,
        first: Option<Bytes>,
        end_stream: bool,
        backlog: &mut RefusalBacklog,
    ) {
        let Some((service, method)) = route(&self.routes, &path) else {
            let status = Status::unimplemented(format!("no service for method {path}"));
            return backlog.refuse(&*self.sink, id, status);
        };
        let window = Arc::new(SendWindow::new(INITIAL_STREAM_WINDOW));
        let (inbound_tx, inbound_rx) = if end_stream {
            (None, None)
        } else {
            let (tx, rx) = mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        };
        self.calls().insert(
            id,
            CallSlot {
                inbound: inbound_tx,
                received: 0,
                window: Arc::clone(&window),
                task: None,
            },
        );
        let deadline = timeout.map(|t| Instant::now() + t);
        let call = ServerCall {
            conn: Arc::clone(self),
            id,
            metadata,
            timeout,
            first,
            inbound: inbound_rx,
            window,
        };
        let span = tracing::debug_span!("rpc.server", method = %path, peer = %self.peer);
        let run = run_call(Arc::clone(self), id, service, method, path, deadline, call);
        let task = if span.is_disabled() {
            tokio::spawn(run)
        } else {
            tokio::spawn(run.instrument(span))
        };
        if let Some(slot) = self.calls().get_mut(&id) {
            slot.task = Some(task.abort_handle());
        }
    }
}

/// What the connection reader does after a frame.
enum Reading {
    /// Reads on.
    On,
    /// The client shut down its sending side: stop reading, finish the open calls.
    HalfClosed,
    /// The connection is gone: abort everything.
    Ended,
}

/// How a request was too large.
#[derive(Debug, Clone, Copy)]
enum Oversize {
    /// A received message of this many bytes, over the maximum message size.
    Message(usize),
    /// A frame the transport skipped: its length and the frame limit.
    Frame { len: usize, max: usize },
}

/// Final statuses the connection reader answers itself (refusals), waiting
/// for room in the sink. The reader never waits for the sink: while this is
/// not empty it takes no new frames from the client (whose unread replies
/// filled the sink), but keeps running keepalive and shutdown.
#[derive(Default)]
struct RefusalBacklog(VecDeque<(u64, Status)>);

impl RefusalBacklog {
    /// Sends call `id`'s final status now if there is room, else queues it.
    fn refuse(&mut self, sink: &dyn FrameSink, id: u64, status: Status) {
        if self.0.is_empty() {
            match sink.try_send(&OutFrame::control(id, OutBody::Status(&status), false)) {
                Ok(true) | Err(_) => return, // sent, or the connection is gone
                Ok(false) => {}
            }
        }
        self.0.push_back((id, status));
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Sends what is queued as room appears; ready when nothing is left.
    async fn flush(&mut self, sink: &dyn FrameSink) {
        std::future::poll_fn(|cx| {
            while let Some((id, status)) = self.0.front() {
                let frame = OutFrame::control(*id, OutBody::Status(status), false);
                match sink.poll_send(cx, &frame) {
                    Poll::Ready(Ok(())) => {
                        self.0.pop_front();
                    }
                    Poll::Ready(Err(_)) => self.0.clear(), // the connection is gone
                    Poll::Pending => return Poll::Pending,
                }
            }
            Poll::Ready(())
        })
        .await
    }
}

/// Splits `/package.Service/Method` and finds the service.
fn route(routes: &Routes, path: &str) -> Option<(Arc<dyn Service>, String)> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    let service = routes.services.get(service)?;
    Some((Arc::clone(service), method.to_string()))
}

/// Runs a handler under its deadline, turning a panic or an expired deadline into a status.
async fn run_call(
    conn: Arc<ServerConn>,
    id: u64,
    service: Arc<dyn Service>,
    method: String,
    path: String,
    deadline: Option<Instant>,
    call: ServerCall,
) {
    let handler = AssertUnwindSafe(service.call(&method, call)).catch_unwind();
    let outcome = match deadline {
        None => Ok(handler.await),
        Some(deadline) => tokio::time::timeout_at(deadline, handler).await,
    };
    let status = match outcome {
        Ok(Ok(())) => return, // the handler sent its own final status
        Ok(Err(panic)) => {
            let what = panic
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("(non-string panic payload)");
            tracing::error!("handler for {path} panicked: {what}");
            Status::internal(format!("handler for {path} panicked"))
        }
        Err(_) => Status::deadline_exceeded(format!("deadline exceeded while {path} ran")),
    };
    conn.finish(id, &status, None).await;
}

/// Aborts a connection's handlers and closes it when its task ends, however it ends.
struct ConnGuard(Arc<ServerConn>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.abort_all();
        self.0.sink.close();
    }
}

async fn serve_connection(
    routes: Arc<Routes>,
    connection: Connection,
    mut shutdown: watch::Receiver<bool>,
) {
    let conn = Arc::new(ServerConn {
        sink: connection.sink,
        peer: connection.peer,
        routes,
        calls: Mutex::new(HashMap::new()),
        finishing: AtomicUsize::new(0),
        idle: Notify::new(),
    });
    let _guard = ConnGuard(Arc::clone(&conn));
    let mut source: Box<dyn FrameSource> = connection.source;
    let mut draining = *shutdown.borrow();
    tracing::debug!(peer = %conn.peer, "connection accepted");
    let mut timer = KeepaliveTimer::new(conn.routes.keepalive);
    let mut received = 0u64;
    let mut backlog = RefusalBacklog::default();
    // The client shut down its write side (`Ok(None)`): it sends nothing
    // more, but the calls it opened still run and their replies go out.
    let mut half_closed = false;
    let violation = loop {
        if (draining || half_closed) && backlog.is_empty() && conn.open_calls(&conn.calls()) == 0 {
            break None;
        }
        tokio::select! {
            result = source.recv(), if backlog.is_empty() && !half_closed => {
                received += 1;
                match conn.handle(result, draining, &mut backlog) {
                    Ok(Reading::On) => {}
                    Ok(Reading::HalfClosed) => {
                        tracing::debug!(peer = %conn.peer, "client closed its sending side: finishing its open calls");
                        half_closed = true;
                        conn.end_request_streams();
                    }
                    Ok(Reading::Ended) => break None,
                    Err(violation) => break Some(violation),
                }
            }
            () = backlog.flush(&*conn.sink), if !backlog.is_empty() => {}
            // A half-closed client can send no pongs: its calls run under their own deadlines.
            tick = timer.tick(received), if timer.enabled() && !half_closed => match tick {
                Tick::Ping => {
                    // Never waits: with no room (a dead peer grants none),
                    // the silence goes on and the next tick declares it dead.
                    let _ = conn.sink.try_send(&OutFrame::control(0, OutBody::Ping, false));
                }
                Tick::Dead(silent) => {
                    tracing::info!(peer = %conn.peer, "no complete frame from the client for {silent:?}, and no answer to a ping: closing");
                    break None;
                }
            },
            _ = shutdown.changed(), if !draining => {
                draining = true;
                let bye = Status::ok("server shutting down");
                if let Ok(false) = conn.sink.try_send(&OutFrame::control(0, OutBody::GoAway(&bye), false)) {
                    // The sink is full: send it when there is room, reading on meanwhile.
                    let sink = Arc::clone(&conn.sink);
                    tokio::spawn(async move {
                        let _ = sink.send(&OutFrame::control(0, OutBody::GoAway(&bye), false)).await;
                    });
                }
            }
            () = conn.idle.notified(), if draining || half_closed => {}
        }
    };
    if let Some(violation) = violation {
        tracing::warn!(peer = %conn.peer, "closing connection: {violation}");
        let status = Status::internal(format!("protocol error: {violation}"));
        // Best effort: a peer that broke the protocol is not waited for.
        let _ = conn
            .sink
            .try_send(&OutFrame::control(0, OutBody::GoAway(&status), false));
    }
    tracing::debug!(peer = %conn.peer, "connection closed");
}

/// One call as a handler helper sees it: the request side, and where the
/// responses and final status go. Generated code passes it to [`unary`] and friends.
pub struct ServerCall {
    conn: Arc<ServerConn>,
    id: u64,
    metadata: MetadataMap,
    timeout: Option<Duration>,
    first: Option<Bytes>,
    inbound: Option<mpsc::UnboundedReceiver<Inbound>>,
    window: Arc<SendWindow>,
}

impl std::fmt::Debug for ServerCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerCall")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl ServerCall {
    /// The single request message of a unary or server-streaming call.
    fn single_request<C: Codec>(&mut self) -> Result<Request<C::Decode>, Status> {
        if self.inbound.is_some() {
            return Err(Status::internal(
                "client sent a stream to a method that takes one message",
            ));
        }
        let bytes = self
            .first
            .take()
            .ok_or_else(|| Status::internal("request carried no message"))?;
        Ok(Request::from_parts(
            C::decode(bytes)?,
            std::mem::take(&mut self.metadata),
            self.timeout,
        ))
    }

    /// The request stream of a client-streaming or bidi call.
    fn request_stream<C: Codec>(&mut self) -> Request<Streaming<C::Decode>> {
        let routes = &self.conn.routes;
        let window = self.inbound.is_some().then(|| {
            RecvWindow::new(
                Arc::clone(&self.conn.sink),
                self.id,
                routes.stream_window,
                Some(Arc::clone(&self.window)),
            )
        });
        let stream = Streaming::new(
            StreamingParts {
                first: self.first.take(),
                rx: self.inbound.take(),
                max_message_size: routes.max_message_size,
                window,
                deadline: None, // the whole handler runs under the deadline
                guard: None,
            },
            C::decode,
        );
        Request::from_parts(stream, std::mem::take(&mut self.metadata), self.timeout)
    }

    async fn finish_with_status(&self, status: Status) {
        self.conn.finish(self.id, &status, None).await;
    }

    async fn finish_with_message<C: Codec>(&self, response: Response<C::Encode>) {
        let (message, metadata) = response.into_parts();
        match Encodable::<C>::new(&message, self.conn.routes.max_message_size) {
            Ok(payload) => {
                let status = Status::ok("").with_metadata(metadata);
                self.conn.finish(self.id, &status, Some(&payload)).await;
            }
            Err(status) => self.finish_with_status(status).await,
        }
    }

    async fn send_stream<C, S>(&self, response: Response<S>)
    where
        C: Codec,
        S: Stream<Item = Result<C::Encode, Status>> + Send + 'static,
    {
        let (stream, metadata) = response.into_parts();
        let mut stream = pin!(stream);
        while let Some(item) = stream.next().await {
            let message = match item {
                Ok(message) => message,
                Err(status) => return self.finish_with_status(status).await,
            };
            let payload = match Encodable::<C>::new(&message, self.conn.routes.max_message_size) {
                Ok(payload) => payload,
                Err(status) => return self.finish_with_status(status).await,
            };
            if self.window.reserve(payload.payload_len()).await.is_err() {
                return; // cancelled
            }
            let frame = OutFrame::control(self.id, OutBody::Message, false).with_payload(&payload);
            if self.conn.sink.send(&frame).await.is_err() {
                return; // the connection is gone; its reader cleans up
            }
        }
        self.finish_with_status(Status::ok("").with_metadata(metadata))
            .await;
    }
}

/// Runs a unary handler.
pub fn unary<C, F, Fut>(mut call: ServerCall, handler: F) -> BoxFuture<'static, ()>
where
    C: Codec,
    F: FnOnce(Request<C::Decode>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Response<C::Encode>, Status>> + Send + 'static,
{
    Box::pin(async move {
        let request = match call.single_request::<C>() {
            Ok(request) => request,
            Err(status) => return call.finish_with_status(status).await,
        };
        match handler(request).await {
            Ok(response) => call.finish_with_message::<C>(response).await,
            Err(status) => call.finish_with_status(status).await,
        }
    })
}

/// Runs a server-streaming handler.
pub fn server_streaming<C, F, Fut, S>(mut call: ServerCall, handler: F) -> BoxFuture<'static, ()>
where
    C: Codec,
    F: FnOnce(Request<C::Decode>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
    S: Stream<Item = Result<C::Encode, Status>> + Send + 'static,
{
    Box::pin(async move {
        let request = match call.single_request::<C>() {
            Ok(request) => request,
            Err(status) => return call.finish_with_status(status).await,
        };
        match handler(request).await {
            Ok(response) => call.send_stream::<C, S>(response).await,
            Err(status) => call.finish_with_status(status).await,
        }
    })
}

/// Runs a client-streaming handler.
pub fn client_streaming<C, F, Fut>(mut call: ServerCall, handler: F) -> BoxFuture<'static, ()>
where
    C: Codec,
    F: FnOnce(Request<Streaming<C::Decode>>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Response<C::Encode>, Status>> + Send + 'static,
{
    Box::pin(async move {
        let request = call.request_stream::<C>();
        match handler(request).await {
            Ok(response) => call.finish_with_message::<C>(response).await,
            Err(status) => call.finish_with_status(status).await,
        }
    })
}

/// Runs a bidirectional-streaming handler.
pub fn streaming<C, F, Fut, S>(mut call: ServerCall, handler: F) -> BoxFuture<'static, ()>
where
    C: Codec,
    F: FnOnce(Request<Streaming<C::Decode>>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
    S: Stream<Item = Result<C::Encode, Status>> + Send + 'static,
{
    Box::pin(async move {
        let request = call.request_stream::<C>();
        match handler(request).await {
            Ok(response) => call.send_stream::<C, S>(response).await,
            Err(status) => call.finish_with_status(status).await,
        }
    })
}

/// Answers a method the service does not have.
pub fn unimplemented(call: ServerCall) -> BoxFuture<'static, ()> {
    Box::pin(async move {
        let status = Status::unimplemented("method not implemented by this service");
        call.finish_with_status(status).await;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_errors_are_reported_once_a_second_with_a_count() {
        let mut interval = ErrorReportInterval::default();
        let start = Instant::now();
        assert_eq!(interval.report(start), Some(0));
        for ms in [1, 20, 999] {
            assert_eq!(interval.report(start + Duration::from_millis(ms)), None);
        }
        assert_eq!(
            interval.report(start + Duration::from_millis(1000)),
            Some(3)
        );
        assert_eq!(interval.report(start + Duration::from_millis(1500)), None);
        assert_eq!(
            interval.report(start + Duration::from_millis(2500)),
            Some(1)
        );
    }
}
