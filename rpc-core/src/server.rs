//! The server side: a [`Server`] accepts connections and runs each call's
//! handler in its own task; generated code implements [`Service`].

use std::collections::HashMap;
use std::future::{pending, Future};
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{FutureExt, Stream, StreamExt};
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;
use tracing::Instrument;

use crate::client::{
    frame_limits, resolve, AddressError, DEFAULT_MAX_MESSAGE_SIZE, DEFAULT_STREAM_WINDOW,
    INITIAL_STREAM_WINDOW, MAX_MESSAGE_SIZE_LIMIT,
};
use crate::codec::{Codec, Encodable};
use crate::flow::SendWindow;
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
            max_concurrent_calls: None,
        }
    }
}

/// Configures a server; see [`Server`].
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

    /// At most `calls` calls open at once on one connection (default: no limit).
    /// Calls over the limit fail at once with `ResourceExhausted`; the client
    /// may retry. (Reading is never paused instead: open streaming calls need
    /// their next messages to finish.)
    pub fn max_concurrent_calls(mut self, calls: usize) -> ServerBuilder {
        self.max_concurrent_calls = Some(calls);
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
        tracing::info!(address = %self.local_addr, "serving");
        loop {
            tokio::select! {
                accepted = std::future::poll_fn(|cx| self.listener.poll_accept(cx)) => match accepted {
                    Ok(connection) => {
                        connections.spawn(serve_connection(Arc::clone(&self.routes), connection, shutdown_rx.clone()));
                    }
                    Err(TransportError::Closed) => break,
                    Err(error) => {
                        tracing::warn!(address = %self.local_addr, "accept failed: {error}");
                        tokio::time::sleep(Duration::from_millis(20)).await;
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

/// One connection's server state: the calls open on it.
struct ServerConn {
    sink: Arc<dyn FrameSink>,
    peer: String,
    routes: Arc<Routes>,
    calls: Mutex<HashMap<u64, CallSlot>>,
    /// Notified when the last open call ends (graceful shutdown waits for it).
    idle: Notify,
}

struct CallSlot {
    /// Where the reader delivers the client's stream; `None` once it ended.
    inbound: Option<mpsc::UnboundedSender<Inbound>>,
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
        if calls.is_empty() {
            self.idle.notify_one();
        }
        Some(slot)
    }

    /// Sends the final status of call `id` (with a last message), if the call is still open.
    async fn finish(&self, id: u64, status: &Status, payload: Option<&dyn EncodePayload>) {
        if self.end_call(id).is_none() {
            return; // cancelled, or already finished
        }
        let frame = match OutFrame::new(id, OutBody::Status(status), payload, false) {
            Ok(frame) => frame,
            Err(error) => {
                let fallback = Status::internal(format!("status could not be encoded: {error}"));
                return self.send_final(id, &fallback).await;
            }
        };
        if let Err(error) = self.sink.send(&frame).await {
            tracing::debug!(peer = %self.peer, "final status not sent: {error}");
        }
    }

    /// Sends a final status for a call the reader refused without opening it.
    async fn send_final(&self, id: u64, status: &Status) {
        let frame = OutFrame::control(id, OutBody::Status(status), false);
        let _ = self.sink.send(&frame).await;
    }

    fn abort_all(&self) {
        for (_, slot) in self.calls().drain() {
            slot.window.close();
            if let Some(task) = slot.task {
                task.abort();
            }
        }
    }

    async fn dispatch(self: &Arc<Self>, frame: Frame, draining: bool) -> Result<(), String> {
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
                    calls.len()
                };
                if let Some(limit) = self.routes.max_concurrent_calls.filter(|&l| open >= l) {
                    let status = Status::resource_exhausted(format!(
                        "{open} calls already open on this connection, the server's limit is {limit}"
                    ));
                    self.send_final(id, &status).await;
                    return Ok(());
                }
                if draining {
                    self.send_final(id, &Status::unavailable("server is shutting down"))
                        .await;
                    return Ok(());
                }
                if let Some(len) = frame
                    .payload
                    .as_ref()
                    .map(Bytes::len)
                    .filter(|&l| l > self.routes.max_message_size)
                {
                    return self.refuse_oversized(id, FrameKind::Request, len).await;
                }
                self.open_call(
                    id,
                    method,
                    timeout,
                    metadata,
                    frame.payload,
                    frame.end_stream,
                )
                .await;
            }
            FrameBody::Message => {
                if let Some(len) = frame
                    .payload
                    .as_ref()
                    .map(Bytes::len)
                    .filter(|&l| l > self.routes.max_message_size)
                {
                    return self.refuse_oversized(id, FrameKind::Message, len).await;
                }
                let mut calls = self.calls();
                let Some(slot) = calls.get_mut(&id) else {
                    return Ok(()); // the call already ended: its late messages are dropped
                };
                let Some(inbound) = &slot.inbound else {
                    return Err(format!(
                        "message after the end of call {id:#x}'s request stream"
                    ));
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
    async fn handle(
        self: &Arc<Self>,
        received: Result<Option<Bytes>, TransportError>,
        draining: bool,
    ) -> Result<bool, String> {
        match received {
            Ok(Some(bytes)) => {
                let frame = Frame::decode(bytes).map_err(|e| format!("malformed frame: {e}"))?;
                self.dispatch(frame, draining).await?;
            }
            Ok(None) => return Ok(false),
            Err(TransportError::Oversized { len, prefix, .. }) => {
                let (id, kind) = peek_head(&prefix).map_err(|e| format!("malformed frame: {e}"))?;
                self.refuse_oversized(id, kind, len).await?;
            }
            Err(error @ (TransportError::FrameTooLarge { .. } | TransportError::Protocol(_))) => {
                return Err(error.to_string())
            }
            Err(error) => {
                tracing::debug!(peer = %self.peer, "connection failed: {error}");
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Fails the call a too-large request message belongs to; the connection goes on.
    async fn refuse_oversized(&self, id: u64, kind: FrameKind, len: usize) -> Result<(), String> {
        let status = Status::resource_exhausted(format!(
            "request message of {len} bytes is larger than the server's maximum message size of {} bytes",
            self.routes.max_message_size
        ));
        match kind {
            FrameKind::Request => self.send_final(id, &status).await,
            FrameKind::Message => {
                if let Some(slot) = self.end_call(id) {
                    if let Some(task) = slot.task {
                        task.abort();
                    }
                    self.send_final(id, &status).await;
                }
            }
            other => return Err(format!("{other:?} frame of {len} bytes")),
        }
        Ok(())
    }

    async fn open_call(
        self: &Arc<Self>,
        id: u64,
        path: String,
        timeout: Option<Duration>,
        metadata: MetadataMap,
        first: Option<Bytes>,
        end_stream: bool,
    ) {
        let Some((service, method)) = route(&self.routes, &path) else {
            let status = Status::unimplemented(format!("no service for method {path}"));
            return self.send_final(id, &status).await;
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
        idle: Notify::new(),
    });
    let _guard = ConnGuard(Arc::clone(&conn));
    let mut source: Box<dyn FrameSource> = connection.source;
    let mut draining = *shutdown.borrow();
    tracing::debug!(peer = %conn.peer, "connection accepted");
    let mut timer = KeepaliveTimer::new(conn.routes.keepalive);
    let mut received = 0u64;
    let violation = loop {
        if draining && conn.calls().is_empty() {
            break None;
        }
        tokio::select! {
            result = source.recv() => {
                received += 1;
                match conn.handle(result, draining).await {
                    Ok(true) => {}
                    Ok(false) => break None,
                    Err(violation) => break Some(violation),
                }
            }
            tick = timer.tick(received), if timer.enabled() => match tick {
                Tick::Ping => {
                    // Never waits: with no room (a dead peer grants none),
                    // the silence goes on and the next tick declares it dead.
                    let _ = conn.sink.try_send(&OutFrame::control(0, OutBody::Ping, false));
                }
                Tick::Dead(silent) => {
                    tracing::info!(peer = %conn.peer, "client sent nothing for {silent:?}, not even a pong: closing");
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
            () = conn.idle.notified(), if draining => {}
        }
    };
    if let Some(violation) = violation {
        tracing::warn!(peer = %conn.peer, "closing connection: protocol error: {violation}");
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
        let window = self
            .inbound
            .is_some()
            .then(|| RecvWindow::new(Arc::clone(&self.conn.sink), self.id, routes.stream_window));
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
