//! The client side: an [`Endpoint`] configures, a [`Channel`] multiplexes calls
//! over one connection (reconnecting as needed), a [`Client`] makes typed calls.

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::Context;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use slab::Slab;
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::Instrument;

use crate::codec::{Codec, Encodable};
use crate::flow::{SendWindow, DEFAULT_STREAM_WINDOW, INITIAL_STREAM_WINDOW};
use crate::frame::{
    peek_head, EncodePayload, Frame, FrameBody, FrameKind, OutBody, OutFrame, HEAD_LEN,
    MAX_HEADER_LEN,
};
use crate::keepalive::{Keepalive, KeepaliveTimer, Tick, DEFAULT_KEEPALIVE};
use crate::message::{Inbound, RecvWindow, Request, Response, Streaming, StreamingParts};
use crate::metadata::MetadataMap;
use crate::status::Status;
use crate::transport::{
    self, Connection, FrameLimits, FrameSink, FrameSource, Transport, TransportError,
};

/// Default largest message, either way: parameter-server tensors are large.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 64 * 1024 * 1024;

/// The largest message size the wire format can carry.
pub const MAX_MESSAGE_SIZE_LIMIT: usize = u32::MAX as usize;

pub(crate) fn frame_limits(max_message_size: usize) -> FrameLimits {
    FrameLimits {
        max_frame_len: max_message_size.saturating_add(HEAD_LEN + MAX_HEADER_LEN),
    }
}

/// An address that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddressError {
    /// Not of the form `scheme://authority`.
    #[error("invalid address {0:?}: expected scheme://host:port, e.g. tcp://127.0.0.1:50051")]
    Invalid(String),
    /// No transport serves the scheme in this process.
    #[error("no transport is installed for {scheme}:// (installed: {installed}); call transport_{scheme}::install() at start-up")]
    UnknownScheme {
        /// The scheme asked for.
        scheme: String,
        /// The schemes that are installed.
        installed: String,
    },
}

/// Finds the transport for `address` and splits off its authority.
pub(crate) fn resolve(address: &str) -> Result<(Arc<dyn Transport>, String), AddressError> {
    let (scheme, authority) =
        transport::split_address(address).ok_or_else(|| AddressError::Invalid(address.into()))?;
    let transport = transport::lookup(scheme).ok_or_else(|| AddressError::UnknownScheme {
        scheme: scheme.into(),
        installed: transport::registered_schemes().join(", "),
    })?;
    Ok((transport, authority.to_string()))
}

/// Connecting a channel failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The address is unusable.
    #[error(transparent)]
    Address(#[from] AddressError),
    /// The transport could not connect.
    #[error("connecting to {address} failed: {source}")]
    Transport {
        /// The address.
        address: String,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// No connection within the connect timeout.
    #[error("connecting to {address} timed out after {timeout:?}")]
    Timeout {
        /// The address.
        address: String,
        /// The connect timeout.
        timeout: Duration,
    },
}

#[derive(Debug, Clone)]
struct ChannelConfig {
    connect_timeout: Duration,
    timeout: Option<Duration>,
    max_message_size: usize,
    stream_window: u32,
    backoff_initial: Duration,
    backoff_max: Duration,
    keepalive: Option<Keepalive>,
}

/// Where and how to connect; builds a [`Channel`].
///
/// ```no_run
/// # async fn run() -> Result<(), rpc_core::ConnectError> {
/// use std::time::Duration;
/// let channel = rpc_core::Endpoint::new("tcp://127.0.0.1:50051")?
///     .timeout(Duration::from_secs(2))
///     .max_message_size(256 << 20)
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Endpoint {
    address: String,
    authority: String,
    transport: Arc<dyn Transport>,
    config: ChannelConfig,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("address", &self.address)
            .field("config", &self.config)
            .finish()
    }
}

impl Endpoint {
    /// An endpoint for `address` (`tcp://host:port`, `rdma://host:port`, `mem://name`),
    /// using the transport installed for its scheme.
    pub fn new(address: impl Into<String>) -> Result<Endpoint, AddressError> {
        let address = address.into();
        let (transport, authority) = resolve(&address)?;
        Ok(Endpoint {
            address,
            authority,
            transport,
            config: ChannelConfig {
                connect_timeout: Duration::from_secs(20),
                timeout: None,
                max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
                stream_window: DEFAULT_STREAM_WINDOW,
                backoff_initial: Duration::from_millis(100),
                backoff_max: Duration::from_secs(10),
                keepalive: Some(DEFAULT_KEEPALIVE),
            },
        })
    }

    /// How long one connection attempt may take (default 20 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Endpoint {
        self.config.connect_timeout = timeout;
        self
    }

    /// Timeout for calls whose request sets none (default: none).
    pub fn timeout(mut self, timeout: Duration) -> Endpoint {
        self.config.timeout = Some(timeout);
        self
    }

    /// Largest message sent or received (default [`DEFAULT_MAX_MESSAGE_SIZE`]).
    /// Larger ones fail with `ResourceExhausted`; the connection stays up.
    /// At most 4 GiB - 1 (the frame's length field).
    pub fn max_message_size(mut self, bytes: usize) -> Endpoint {
        self.config.max_message_size = bytes.min(MAX_MESSAGE_SIZE_LIMIT);
        self
    }

    /// Bytes a server may send on one response stream ahead of the reader
    /// (default [`DEFAULT_STREAM_WINDOW`]); at least 64 KiB.
    pub fn stream_window(mut self, bytes: u32) -> Endpoint {
        self.config.stream_window = bytes.max(INITIAL_STREAM_WINDOW);
        self
    }

    /// Delay before reconnecting after a failed attempt: starts at `initial`,
    /// doubles per failure up to `max` (defaults 100 ms and 10 s). Calls made
    /// while waiting fail at once with `Unavailable`, naming the last error.
    pub fn reconnect_backoff(mut self, initial: Duration, max: Duration) -> Endpoint {
        self.config.backoff_initial = initial;
        self.config.backoff_max = max.max(initial);
        self
    }

    /// After `interval` without a frame from the server, ping it; if nothing
    /// arrives within `timeout` more, fail the connection and its calls with
    /// `Unavailable` (defaults 20 s and 20 s). Catches a server host that
    /// died while calls waited for answers, on any transport.
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> Endpoint {
        self.config.keepalive = Some(Keepalive { interval, timeout });
        self
    }

    /// No keepalive pings: calls without a deadline may then wait forever on a dead server.
    pub fn no_keepalive(mut self) -> Endpoint {
        self.config.keepalive = None;
        self
    }

    /// Connects now; fails if the first connection cannot be made.
    pub async fn connect(self) -> Result<Channel, ConnectError> {
        let channel = self.connect_lazy();
        let conn = channel.dial().await?;
        *channel
            .shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = ConnState::Ready(conn);
        Ok(channel)
    }

    /// A channel that connects on its first call.
    pub fn connect_lazy(self) -> Channel {
        Channel {
            shared: Arc::new(ChannelShared {
                endpoint: self,
                state: Mutex::new(ConnState::Idle),
                connecting: tokio::sync::Mutex::new(()),
            }),
        }
    }
}

/// A connection to one server, shared by every call and every clone.
///
/// Cloning is cheap; all clones multiplex their calls over one connection.
/// When the connection fails, its pending calls end with `Unavailable` and the
/// next call reconnects (with backoff after failed attempts).
///
/// Each connection's frames are read by a task on the tokio runtime, which
/// hands every response to the task awaiting its call. Make latency-critical
/// calls from a spawned task rather than from `Runtime::block_on`: a caller
/// on the `block_on` thread costs a cross-thread wake-up per call.
#[derive(Clone)]
pub struct Channel {
    shared: Arc<ChannelShared>,
}

struct ChannelShared {
    endpoint: Endpoint,
    state: Mutex<ConnState>,
    connecting: tokio::sync::Mutex<()>,
}

enum ConnState {
    Idle,
    Ready(Arc<ClientConn>),
    Backoff {
        retry_at: Instant,
        delay: Duration,
        error: String,
    },
}

impl Drop for ChannelShared {
    fn drop(&mut self) {
        if let ConnState::Ready(conn) = &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            conn.sink.close();
        }
    }
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel")
            .field("address", &self.shared.endpoint.address)
            .finish()
    }
}

impl Channel {
    /// Connects to `address` with default settings; see [`Endpoint`] for more.
    pub async fn connect(address: &str) -> Result<Channel, ConnectError> {
        Endpoint::new(address)?.connect().await
    }

    /// The address this channel connects to.
    pub fn address(&self) -> &str {
        &self.shared.endpoint.address
    }

    fn config(&self) -> &ChannelConfig {
        &self.shared.endpoint.config
    }

    async fn dial(&self) -> Result<Arc<ClientConn>, ConnectError> {
        let endpoint = &self.shared.endpoint;
        let limits = frame_limits(endpoint.config.max_message_size);
        let connecting = endpoint.transport.connect(&endpoint.authority, limits);
        match tokio::time::timeout(endpoint.config.connect_timeout, connecting).await {
            Ok(Ok(connection)) => Ok(ClientConn::start(connection, &endpoint.config)),
            Ok(Err(source)) => Err(ConnectError::Transport {
                address: endpoint.address.clone(),
                source,
            }),
            Err(_) => Err(ConnectError::Timeout {
                address: endpoint.address.clone(),
                timeout: endpoint.config.connect_timeout,
            }),
        }
    }

    fn ready_connection(&self) -> Option<Arc<ClientConn>> {
        match &*self.shared.state.lock().unwrap_or_else(|e| e.into_inner()) {
            ConnState::Ready(conn) if conn.accepts_calls() => Some(Arc::clone(conn)),
            _ => None,
        }
    }

    /// The live connection, connecting (once, for all waiting callers) if needed.
    async fn connection(&self) -> Result<Arc<ClientConn>, Status> {
        if let Some(conn) = self.ready_connection() {
            return Ok(conn);
        }
        let _one_dialer = self.shared.connecting.lock().await;
        if let Some(conn) = self.ready_connection() {
            return Ok(conn);
        }
        let previous_delay = {
            let state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            match &*state {
                ConnState::Backoff {
                    retry_at,
                    delay,
                    error,
                } => {
                    let now = Instant::now();
                    if now < *retry_at {
                        return Err(Status::unavailable(format!(
                            "{} is unreachable: {error}; next reconnect attempt in {:?}",
                            self.address(),
                            *retry_at - now
                        )));
                    }
                    Some(*delay)
                }
                _ => None,
            }
        };
        match self.dial().await {
            Ok(conn) => {
                *self.shared.state.lock().unwrap_or_else(|e| e.into_inner()) =
                    ConnState::Ready(Arc::clone(&conn));
                Ok(conn)
            }
            Err(error) => {
                let config = self.config();
                let delay = previous_delay
                    .map_or(config.backoff_initial, |d| (d * 2).min(config.backoff_max));
                let message = error.to_string();
                *self.shared.state.lock().unwrap_or_else(|e| e.into_inner()) = ConnState::Backoff {
                    retry_at: Instant::now() + delay,
                    delay,
                    error: message.clone(),
                };
                Err(Status::unavailable(message))
            }
        }
    }
}

/// One connection's client state: the table of open calls and its reader.
pub(crate) struct ClientConn {
    sink: Arc<dyn FrameSink>,
    peer: String,
    max_message_size: usize,
    calls: Mutex<CallTable>,
}

struct CallTable {
    slots: Slab<CallSlot>,
    generation: u32,
    phase: Phase,
}

enum Phase {
    Open,
    /// The server sent GoAway: calls in flight finish, new ones go elsewhere.
    Draining,
    Closed(Status),
}

struct CallSlot {
    generation: u32,
    inbox: Inbox,
    window: Option<Arc<SendWindow>>,
}

/// What a call with a single response message (unary, client-streaming)
/// receives: the message and the trailers, or why it failed.
type SingleResponse = Result<(Bytes, MetadataMap), Status>;

/// Where the reader delivers what the server sends on one call.
enum Inbox {
    /// A response stream: every message and the status, through a channel.
    Stream(mpsc::UnboundedSender<Inbound>),
    /// A single response: the message waits here for the status, and the
    /// outcome goes to the caller once (no channel per call to allocate).
    Single {
        message: Option<Bytes>,
        /// `None` once the outcome is sent.
        tx: Option<oneshot::Sender<SingleResponse>>,
    },
}

impl Inbox {
    fn single(tx: oneshot::Sender<SingleResponse>) -> Inbox {
        Inbox::Single {
            message: None,
            tx: Some(tx),
        }
    }

    fn message(&mut self, payload: Bytes) {
        match self {
            Inbox::Stream(tx) => {
                let _ = tx.send(Inbound::Message(payload));
            }
            Inbox::Single { message, tx } => {
                if message.is_none() {
                    *message = Some(payload);
                } else if let Some(tx) = tx.take() {
                    let _ = tx.send(Err(Status::internal(
                        "server sent more than one message on a unary response",
                    )));
                }
            }
        }
    }

    fn finish(self, status: Status) {
        match self {
            Inbox::Stream(tx) => {
                let _ = tx.send(Inbound::Status(status));
            }
            Inbox::Single {
                message,
                tx: Some(tx),
            } => {
                let outcome = match message {
                    _ if !status.is_ok() => Err(status),
                    Some(bytes) => Ok((bytes, status.metadata().clone())),
                    None => Err(Status::internal(
                        "server ended the call without a response message",
                    )),
                };
                let _ = tx.send(outcome);
            }
            Inbox::Single { tx: None, .. } => {}
        }
    }
}

fn split_id(id: u64) -> (usize, u32) {
    ((id & 0xFFFF_FFFF) as usize, (id >> 32) as u32)
}

impl ClientConn {
    fn start(connection: Connection, config: &ChannelConfig) -> Arc<ClientConn> {
        let conn = Arc::new(ClientConn {
            sink: connection.sink,
            peer: connection.peer,
            max_message_size: config.max_message_size,
            calls: Mutex::new(CallTable {
                slots: Slab::new(),
                generation: 0,
                phase: Phase::Open,
            }),
        });
        tokio::spawn(Arc::clone(&conn).read_loop(connection.source, config.keepalive));
        conn
    }

    fn table(&self) -> std::sync::MutexGuard<'_, CallTable> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn accepts_calls(&self) -> bool {
        matches!(self.table().phase, Phase::Open)
    }

    fn open_call(&self, window: Option<Arc<SendWindow>>, inbox: Inbox) -> Result<u64, Status> {
        let mut table = self.table();
        match &table.phase {
            Phase::Open => {}
            Phase::Draining => {
                return Err(Status::unavailable(format!(
                    "{} is shutting down",
                    self.peer
                )))
            }
            Phase::Closed(status) => return Err(status.clone()),
        }
        table.generation = table.generation.wrapping_add(1);
        let generation = table.generation;
        let key = table.slots.insert(CallSlot {
            generation,
            inbox,
            window,
        });
        Ok((generation as u64) << 32 | key as u64)
    }

    fn take_call(&self, id: u64) -> Option<CallSlot> {
        let (key, generation) = split_id(id);
        let mut table = self.table();
        match table.slots.get(key) {
            Some(slot) if slot.generation == generation => Some(table.slots.remove(key)),
            _ => None,
        }
    }

    /// Ends call `id` locally with `status` and tells the server, if it was still open.
    fn fail_call(&self, id: u64, status: Status) {
        if let Some(slot) = self.take_call(id) {
            if let Some(window) = &slot.window {
                window.close();
            }
            slot.inbox.finish(status);
            self.send_cancel(id);
        }
    }

    /// Forgets call `id` and tells the server, if it was still open.
    fn cancel(&self, id: u64) {
        if let Some(slot) = self.take_call(id) {
            if let Some(window) = &slot.window {
                window.close();
            }
            self.send_cancel(id);
        }
    }

    fn send_cancel(&self, id: u64) {
        let frame = OutFrame::control(id, OutBody::Cancel, false);
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        if self.sink.poll_send(&mut cx, &frame).is_pending() {
            // No room right now: send it from a task rather than lose it.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let sink = Arc::clone(&self.sink);
                runtime.spawn(async move {
                    sink.send(&OutFrame::control(id, OutBody::Cancel, false))
                        .await
                });
            }
        }
    }

    /// Ends every open call with `status`; no new calls are accepted.
    fn fail_all(&self, status: Status) {
        let slots = {
            let mut table = self.table();
            table.phase = Phase::Closed(status.clone());
            std::mem::take(&mut table.slots)
        };
        for (_, slot) in slots {
            if let Some(window) = &slot.window {
                window.close();
            }
            slot.inbox.finish(status.clone());
        }
    }

    async fn read_loop(
        self: Arc<Self>,
        mut source: Box<dyn FrameSource>,
        keepalive: Option<Keepalive>,
    ) {
        let mut timer = KeepaliveTimer::new(keepalive);
        let mut received = 0u64;
        let reason = loop {
            tokio::select! {
                result = source.recv() => {
                    received += 1;
                    if let Some(reason) = self.handle(result).await {
                        break reason;
                    }
                }
                tick = timer.tick(received), if timer.enabled() => match tick {
                    Tick::Ping => {
                        // Never waits: with no room (a dead peer grants
                        // none), the silence goes on and the next tick
                        // declares it dead.
                        let _ = self.sink.try_send(&OutFrame::control(0, OutBody::Ping, false));
                    }
                    Tick::Dead(silent) => {
                        break Status::unavailable(format!(
                            "{} sent nothing for {silent:?}, not even an answer to a ping: connection presumed dead",
                            self.peer
                        ));
                    }
                },
            }
        };
        if reason.code() == crate::Code::Internal {
            tracing::warn!(peer = %self.peer, "closing connection: {}", reason.message());
        } else {
            tracing::debug!(peer = %self.peer, "connection ended: {}", reason.message());
        }
        self.fail_all(reason);
        self.sink.close();
    }

    /// Handles what the reader received; returns why the connection must end, if it must.
    async fn handle(&self, received: Result<Option<Bytes>, TransportError>) -> Option<Status> {
        let peer = &self.peer;
        match received {
            Ok(Some(bytes)) => match Frame::decode(bytes) {
                Ok(Frame {
                    body: FrameBody::Ping,
                    ..
                }) => {
                    // Not sent when the sink is full: the frames filling it
                    // prove this side alive just as well.
                    let _ = self
                        .sink
                        .try_send(&OutFrame::control(0, OutBody::Pong, false));
                    None
                }
                Ok(frame) => {
                    let violation = self.dispatch(frame).err()?;
                    Some(Status::internal(format!(
                        "{peer} broke the protocol: {violation}"
                    )))
                }
                Err(error) => Some(Status::internal(format!(
                    "{peer} sent a malformed frame: {error}"
                ))),
            },
            Ok(None) => Some(Status::unavailable(format!(
                "connection to {peer} closed by the server"
            ))),
            Err(TransportError::Oversized { len, prefix, .. }) => match peek_head(&prefix) {
                Ok((id, FrameKind::Message | FrameKind::Status)) => {
                    self.refuse_oversized(id, len);
                    None
                }
                Ok((_, kind)) => Some(Status::internal(format!(
                    "{peer} sent a {kind:?} frame of {len} bytes"
                ))),
                Err(error) => Some(Status::internal(format!(
                    "{peer} sent a malformed frame: {error}"
                ))),
            },
            Err(error) => Some(Status::unavailable(format!(
                "connection to {peer} failed: {error}"
            ))),
        }
    }

    fn dispatch(&self, frame: Frame) -> Result<(), String> {
        let id = frame.call_id;
        match frame.body {
            FrameBody::Message => {
                if let Some(payload) = frame.payload {
                    self.deliver(id, payload);
                }
            }
            FrameBody::Status(_)
                if frame
                    .payload
                    .as_ref()
                    .is_some_and(|p| p.len() > self.max_message_size) =>
            {
                self.refuse_oversized(id, frame.payload.map_or(0, |p| p.len()));
            }
            FrameBody::Status(status) => {
                if let Some(mut slot) = self.take_call(id) {
                    if let Some(window) = &slot.window {
                        window.close();
                    }
                    if let Some(payload) = frame.payload {
                        slot.inbox.message(payload);
                    }
                    slot.inbox.finish(status);
                }
            }
            FrameBody::WindowUpdate(bytes) => {
                let (key, generation) = split_id(id);
                if let Some(slot) = self
                    .table()
                    .slots
                    .get(key)
                    .filter(|s| s.generation == generation)
                {
                    if let Some(window) = &slot.window {
                        window.grant(bytes);
                    }
                }
            }
            FrameBody::GoAway(status) if status.is_ok() => {
                let mut table = self.table();
                if matches!(table.phase, Phase::Open) {
                    table.phase = Phase::Draining;
                }
            }
            FrameBody::GoAway(status) => {
                return Err(format!("server closed the connection: {status}"))
            }
            FrameBody::Pong => {}
            FrameBody::Request { .. } | FrameBody::Cancel | FrameBody::Ping => {
                return Err(format!(
                    "a server does not send {:?} frames",
                    frame.body.kind()
                ));
            }
        }
        Ok(())
    }

    /// Fails the call a too-large response message belongs to; the connection goes on.
    fn refuse_oversized(&self, id: u64, len: usize) {
        let status = Status::resource_exhausted(format!(
            "response message of {len} bytes is larger than the maximum message size of {} bytes",
            self.max_message_size
        ));
        self.fail_call(id, status);
    }

    fn deliver(&self, id: u64, payload: Bytes) {
        if payload.len() > self.max_message_size {
            return self.refuse_oversized(id, payload.len());
        }
        let (key, generation) = split_id(id);
        if let Some(slot) = self
            .table()
            .slots
            .get_mut(key)
            .filter(|s| s.generation == generation)
        {
            slot.inbox.message(payload);
        }
    }
}

/// A call in progress on the client. Dropping it before the server's status
/// arrived cancels the call (a `Cancel` frame stops the server's handler).
struct ActiveCall {
    conn: Arc<ClientConn>,
    id: u64,
    sender: Option<AbortHandle>,
    /// Keeps the channel (and its connection) open while a stream outlives the client.
    _channel: Channel,
}

impl Drop for ActiveCall {
    fn drop(&mut self) {
        if let Some(sender) = self.sender.take() {
            sender.abort();
        }
        self.conn.cancel(self.id);
    }
}

/// Makes typed calls on a [`Channel`]; what generated clients wrap.
#[derive(Clone, Debug)]
pub struct Client {
    channel: Channel,
}

impl Client {
    /// A client sending on `channel`.
    pub fn new(channel: Channel) -> Client {
        Client { channel }
    }

    /// The channel.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    fn deadline(&self, timeout: Option<Duration>) -> Option<Instant> {
        timeout
            .or(self.channel.config().timeout)
            .map(|t| Instant::now() + t)
    }

    /// Opens a call: registers it and sends its `Request` frame.
    async fn open(
        &self,
        path: &str,
        metadata: &MetadataMap,
        deadline: Option<Instant>,
        first: Option<&dyn EncodePayload>,
        sends_stream: bool,
        inbox: Inbox,
    ) -> Result<(ActiveCall, Option<Arc<SendWindow>>), Status> {
        let conn = self.channel.connection().await?;
        let window = sends_stream.then(|| Arc::new(SendWindow::new(INITIAL_STREAM_WINDOW)));
        let id = conn.open_call(window.clone(), inbox)?;
        let call = ActiveCall {
            conn,
            id,
            sender: None,
            _channel: self.channel.clone(),
        };
        let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let frame = OutFrame::new(
            id,
            OutBody::Request {
                method: path,
                timeout,
                metadata,
            },
            first,
            !sends_stream,
        )
        .map_err(|e| Status::invalid_argument(format!("request headers: {e}")))?;
        call.conn
            .sink
            .send(&frame)
            .await
            .map_err(|e| Status::unavailable(format!("sending to {}: {e}", call.conn.peer)))?;
        Ok((call, window))
    }

    fn streaming_response<T>(
        &self,
        call: ActiveCall,
        rx: mpsc::UnboundedReceiver<Inbound>,
        deadline: Option<Instant>,
        decode: fn(Bytes) -> Result<T, Status>,
    ) -> Streaming<T> {
        let config = self.channel.config();
        let window = RecvWindow::new(
            Arc::clone(&call.conn.sink),
            call.id,
            config.stream_window,
            None,
        );
        Streaming::new(
            StreamingParts {
                first: None,
                rx: Some(rx),
                max_message_size: config.max_message_size,
                window: Some(window),
                deadline,
                guard: Some(Box::new(call)),
            },
            decode,
        )
    }

    /// A unary call: one request, one response.
    pub async fn unary<C: Codec>(
        &self,
        path: &str,
        request: Request<C::Encode>,
    ) -> Result<Response<C::Decode>, Status> {
        let (message, metadata, timeout) = request.into_parts();
        let deadline = self.deadline(timeout);
        let call = async {
            let payload = Encodable::<C>::new(&message, self.channel.config().max_message_size)?;
            let (tx, rx) = oneshot::channel();
            let (_call, _) = self
                .open(
                    path,
                    &metadata,
                    deadline,
                    Some(&payload),
                    false,
                    Inbox::single(tx),
                )
                .await?;
            receive_one::<C>(rx).await
        };
        traced(path, deadline, call).await
    }

    /// A server-streaming call: one request, a stream of responses.
    pub async fn server_streaming<C: Codec>(
        &self,
        path: &str,
        request: Request<C::Encode>,
    ) -> Result<Response<Streaming<C::Decode>>, Status> {
        let (message, metadata, timeout) = request.into_parts();
        let deadline = self.deadline(timeout);
        let call = async {
            let payload = Encodable::<C>::new(&message, self.channel.config().max_message_size)?;
            let (tx, rx) = mpsc::unbounded_channel();
            let (call, _) = self
                .open(
                    path,
                    &metadata,
                    deadline,
                    Some(&payload),
                    false,
                    Inbox::Stream(tx),
                )
                .await?;
            Ok(Response::new(self.streaming_response(
                call,
                rx,
                deadline,
                C::decode,
            )))
        };
        traced(path, deadline, call).await
    }

    /// A client-streaming call: a stream of requests, one response.
    pub async fn client_streaming<C, S>(
        &self,
        path: &str,
        request: Request<S>,
    ) -> Result<Response<C::Decode>, Status>
    where
        C: Codec,
        S: Stream<Item = C::Encode> + Send + 'static,
    {
        let (stream, metadata, timeout) = request.into_parts();
        let deadline = self.deadline(timeout);
        let call = async {
            let (tx, rx) = oneshot::channel();
            let _call = self
                .open_sending::<C, S>(path, &metadata, deadline, stream, Inbox::single(tx))
                .await?;
            receive_one::<C>(rx).await
        };
        traced(path, deadline, call).await
    }

    /// A bidirectional-streaming call: a stream each way.
    pub async fn streaming<C, S>(
        &self,
        path: &str,
        request: Request<S>,
    ) -> Result<Response<Streaming<C::Decode>>, Status>
    where
        C: Codec,
        S: Stream<Item = C::Encode> + Send + 'static,
    {
        let (stream, metadata, timeout) = request.into_parts();
        let deadline = self.deadline(timeout);
        let call = async {
            let (tx, rx) = mpsc::unbounded_channel();
            let call = self
                .open_sending::<C, S>(path, &metadata, deadline, stream, Inbox::Stream(tx))
                .await?;
            Ok(Response::new(self.streaming_response(
                call,
                rx,
                deadline,
                C::decode,
            )))
        };
        traced(path, deadline, call).await
    }

    /// Opens a call whose requests are `stream`, and starts sending them.
    async fn open_sending<C, S>(
        &self,
        path: &str,
        metadata: &MetadataMap,
        deadline: Option<Instant>,
        stream: S,
        inbox: Inbox,
    ) -> Result<ActiveCall, Status>
    where
        C: Codec,
        S: Stream<Item = C::Encode> + Send + 'static,
    {
        let (mut call, window) = self
            .open(path, metadata, deadline, None, true, inbox)
            .await?;
        call.sender = Some(self.spawn_sender::<C, S>(&call, window, stream));
        Ok(call)
    }

    /// Sends the request stream's messages as the server's window allows, then the end of stream.
    fn spawn_sender<C, S>(
        &self,
        call: &ActiveCall,
        window: Option<Arc<SendWindow>>,
        stream: S,
    ) -> AbortHandle
    where
        C: Codec,
        S: Stream<Item = C::Encode> + Send + 'static,
    {
        let conn = Arc::clone(&call.conn);
        let id = call.id;
        let window = window.expect("streaming calls have a send window");
        let max = self.channel.config().max_message_size;
        let task = async move {
            let mut stream = pin!(stream);
            while let Some(item) = stream.next().await {
                let payload = match Encodable::<C>::new(&item, max) {
                    Ok(payload) => payload,
                    Err(status) => return conn.fail_call(id, status),
                };
                if window.reserve(payload.payload_len()).await.is_err() {
                    return; // the call is over
                }
                let frame = OutFrame::control(id, OutBody::Message, false).with_payload(&payload);
                if conn.sink.send(&frame).await.is_err() {
                    return; // the reader reports the broken connection
                }
            }
            let _ = conn
                .sink
                .send(&OutFrame::control(id, OutBody::Message, true))
                .await;
        };
        tokio::spawn(task.in_current_span()).abort_handle()
    }
}

/// Receives a single response: one message, then an OK status.
async fn receive_one<C: Codec>(
    rx: oneshot::Receiver<SingleResponse>,
) -> Result<Response<C::Decode>, Status> {
    match rx.await {
        Ok(Ok((bytes, trailers))) => Ok(Response::from_parts(C::decode(bytes)?, trailers)),
        Ok(Err(status)) => Err(status),
        Err(_) => Err(Status::internal("call ended without a status")),
    }
}

/// Runs a call under its deadline, in its tracing span.
async fn traced<T>(
    path: &str,
    deadline: Option<Instant>,
    call: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    let span = tracing::debug_span!("rpc.client", method = path);
    if span.is_disabled() {
        // No subscriber wants it: skip the span's enter and exit on every poll.
        return with_deadline(deadline, call).await;
    }
    with_deadline(deadline, call).instrument(span).await
}

async fn with_deadline<T>(
    deadline: Option<Instant>,
    call: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    match deadline {
        None => call.await,
        // A timeout of zero (or a deadline already past) fails at once, as
        // in gRPC, without connecting or sending anything: `timeout_at` would
        // poll the call once first, and that poll may send the request.
        Some(deadline) if deadline <= Instant::now() => Err(Status::deadline_exceeded(
            "deadline exceeded before the request was sent (timeout of zero)",
        )),
        Some(deadline) => tokio::time::timeout_at(deadline, call)
            .await
            .unwrap_or_else(|_| {
                Err(Status::deadline_exceeded(
                    "deadline exceeded before the server answered",
                ))
            }),
    }
}
