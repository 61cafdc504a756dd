//! What handlers and clients hold: [`Request`], [`Response`] and [`Streaming`].

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};

use crate::flow::{SendWindow, INITIAL_STREAM_WINDOW};
use crate::frame::{OutBody, OutFrame};
use crate::intercept::{Extensions, Peer};
use crate::metadata::MetadataMap;
use crate::status::Status;
use crate::transport::FrameSink;

/// A request: a message (or a stream of them) with metadata, a timeout or
/// deadline, and whether it is safe to send twice.
#[derive(Debug, Clone, Default)]
pub struct Request<T> {
    message: T,
    metadata: MetadataMap,
    options: CallOptions,
    /// The client, in a handler.
    peer: Option<Arc<Peer>>,
    extensions: Extensions,
    /// The connection the call came on, in a handler.
    connection: Option<CallConnection>,
}

/// The connection a server's call came on (for its payload buffers).
#[derive(Clone)]
pub(crate) struct CallConnection(pub(crate) Arc<dyn crate::transport::FrameSink>);

impl std::fmt::Debug for CallConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallConnection")
    }
}

/// What a server knows of a request besides its message and metadata.
pub(crate) struct Received {
    pub(crate) timeout: Option<Duration>,
    pub(crate) deadline: Option<Instant>,
    pub(crate) peer: Arc<Peer>,
    pub(crate) extensions: Extensions,
    pub(crate) connection: CallConnection,
}

/// When a call must be done by, and whether it may be sent again: what a
/// [`Request`] carries besides its message and metadata.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CallOptions {
    pub(crate) timeout: Option<Duration>,
    pub(crate) deadline: Option<Instant>,
    pub(crate) idempotent: bool,
}

impl<T> Request<T> {
    /// A request carrying `message`, with no metadata and the channel's default timeout.
    pub fn new(message: T) -> Request<T> {
        Request {
            message,
            metadata: MetadataMap::new(),
            options: CallOptions::default(),
            peer: None,
            extensions: Extensions::new(),
            connection: None,
        }
    }

    /// The message.
    pub fn get_ref(&self) -> &T {
        &self.message
    }

    /// The message, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.message
    }

    /// The message, consuming the request.
    pub fn into_inner(self) -> T {
        self.message
    }

    /// Request metadata.
    pub fn metadata(&self) -> &MetadataMap {
        &self.metadata
    }

    /// Request metadata, to add to.
    pub fn metadata_mut(&mut self) -> &mut MetadataMap {
        &mut self.metadata
    }

    /// Sets how long the call may take, start to finish. The server sees the
    /// remaining time and the call fails with `DeadlineExceeded` on both sides
    /// when it runs out.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.options.timeout = Some(timeout);
    }

    /// The timeout: on a client, as set; in a handler, the time that was left
    /// when the request arrived.
    pub fn timeout(&self) -> Option<Duration> {
        self.options.timeout
    }

    /// Sets the instant by which the call must be done: one deadline shared
    /// by several calls (a fan-out, a call made on behalf of another) without
    /// each recomputing a timeout. If a timeout is set too, the earlier wins;
    /// either replaces the channel's default timeout. A `std::time::Instant`
    /// converts with `.into()`.
    pub fn set_deadline(&mut self, deadline: Instant) {
        self.options.deadline = Some(deadline);
    }

    /// The deadline: on a client, as set; in a handler, when the client's
    /// time runs out (arrival plus the timeout it sent), to pass on to the
    /// calls the handler makes.
    pub fn deadline(&self) -> Option<Instant> {
        self.options.deadline
    }

    /// Marks the call as safe to run twice. On a channel over several
    /// replicas, an idempotent unary call whose connection fails after it
    /// was sent is retried once on another replica; other calls are retried
    /// only if they were never sent. (Default: not idempotent.)
    pub fn set_idempotent(&mut self, idempotent: bool) {
        self.options.idempotent = idempotent;
    }

    /// Whether the call is marked safe to run twice.
    pub fn is_idempotent(&self) -> bool {
        self.options.idempotent
    }

    /// In a handler, the client that made the call; `None` on a client.
    pub fn peer(&self) -> Option<&Peer> {
        self.peer.as_deref()
    }

    /// In a handler, `len` bytes to write a response's large payload
    /// into and send with no copy (see [`PayloadBuffer`](crate::PayloadBuffer)):
    /// memory of the connection the call came on (over `rdma://`, from its
    /// pool of registered memory, waiting while that is full). On a
    /// client's request, heap memory: use
    /// [`Channel::payload_buffer`](crate::Channel::payload_buffer) there.
    pub async fn payload_buffer(&self, len: usize) -> Result<crate::PayloadBuffer, Status> {
        let Some(CallConnection(sink)) = &self.connection else {
            return Ok(crate::PayloadBuffer::heap(len));
        };
        sink.payload_buffer(len)
            .await
            .map_err(|e| Status::unavailable(format!("a payload buffer: {e}")))
    }

    /// Values interceptors set for the handler (see [`crate::intercept`]).
    pub fn extensions(&self) -> &Extensions {
        &self.extensions
    }

    /// The values, to add to.
    pub fn extensions_mut(&mut self) -> &mut Extensions {
        &mut self.extensions
    }

    /// A request received by a server: the timeout the client sent, the
    /// deadline it makes from the call's arrival, the client, the extensions.
    pub(crate) fn received(message: T, metadata: MetadataMap, received: Received) -> Request<T> {
        Request {
            message,
            metadata,
            options: CallOptions {
                timeout: received.timeout,
                deadline: received.deadline,
                idempotent: false,
            },
            peer: Some(received.peer),
            extensions: received.extensions,
            connection: Some(received.connection),
        }
    }

    pub(crate) fn into_parts(self) -> (T, MetadataMap, CallOptions) {
        (self.message, self.metadata, self.options)
    }
}

/// A response: a message (or a stream of them) with metadata.
///
/// On the client, metadata is what the server sent with its final status.
#[derive(Debug, Clone, Default)]
pub struct Response<T> {
    message: T,
    metadata: MetadataMap,
}

impl<T> Response<T> {
    /// A response carrying `message`.
    pub fn new(message: T) -> Response<T> {
        Response {
            message,
            metadata: MetadataMap::new(),
        }
    }

    /// The message.
    pub fn get_ref(&self) -> &T {
        &self.message
    }

    /// The message, mutably.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.message
    }

    /// The message, consuming the response.
    pub fn into_inner(self) -> T {
        self.message
    }

    /// Response metadata.
    pub fn metadata(&self) -> &MetadataMap {
        &self.metadata
    }

    /// Response metadata, to add to.
    pub fn metadata_mut(&mut self) -> &mut MetadataMap {
        &mut self.metadata
    }

    pub(crate) fn from_parts(message: T, metadata: MetadataMap) -> Response<T> {
        Response { message, metadata }
    }

    pub(crate) fn into_parts(self) -> (T, MetadataMap) {
        (self.message, self.metadata)
    }
}

/// Anything a unary or server-streaming stub accepts: a message or a [`Request`].
pub trait IntoRequest<T> {
    /// Wraps the message, or passes the request through.
    fn into_request(self) -> Request<T>;
}

impl<T> IntoRequest<T> for T {
    fn into_request(self) -> Request<T> {
        Request::new(self)
    }
}

impl<T> IntoRequest<T> for Request<T> {
    fn into_request(self) -> Request<T> {
        self
    }
}

/// Anything a client- or bidi-streaming stub accepts: a stream of messages or a [`Request`] of one.
pub trait IntoStreamingRequest {
    /// The stream.
    type Stream: Stream<Item = Self::Message> + Send + 'static;
    /// The messages it yields.
    type Message;
    /// Wraps the stream, or passes the request through.
    fn into_streaming_request(self) -> Request<Self::Stream>;
}

impl<S> IntoStreamingRequest for S
where
    S: Stream + Send + 'static,
{
    type Stream = S;
    type Message = S::Item;
    fn into_streaming_request(self) -> Request<S> {
        Request::new(self)
    }
}

impl<S> IntoStreamingRequest for Request<S>
where
    S: Stream + Send + 'static,
{
    type Stream = S;
    type Message = S::Item;
    fn into_streaming_request(self) -> Request<S> {
        self
    }
}

/// What the connection reader delivers to one call.
#[derive(Debug)]
pub(crate) enum Inbound {
    /// One encoded message.
    Message(Bytes),
    /// The peer will send no more messages (client → server).
    End,
    /// The call's final status (server → client), or why it failed locally.
    Status(Status),
}

/// Grants the peer more send window as messages are consumed.
pub(crate) struct RecvWindow {
    pub(crate) sink: Arc<dyn FrameSink>,
    pub(crate) call_id: u64,
    /// Bytes consumed since the last grant.
    consumed: u32,
    /// Grant once this many bytes are consumed (half the window).
    threshold: u32,
    /// A grant to send before reading on (the sink had no room).
    pending_grant: u32,
    /// Where grants are recorded for the reader's check of the peer (server side).
    record: Option<Arc<SendWindow>>,
}

impl RecvWindow {
    /// A window of `window` bytes: every stream starts at the protocol's
    /// initial window, so the first read grants the difference.
    pub(crate) fn new(
        sink: Arc<dyn FrameSink>,
        call_id: u64,
        window: u32,
        record: Option<Arc<SendWindow>>,
    ) -> RecvWindow {
        let pending_grant = window.saturating_sub(INITIAL_STREAM_WINDOW);
        if let Some(record) = &record {
            record.record_grant_to_peer(pending_grant);
        }
        RecvWindow {
            sink,
            call_id,
            consumed: 0,
            threshold: (window / 2).max(1),
            pending_grant,
            record,
        }
    }

    fn consumed(&mut self, len: usize) {
        self.consumed = self
            .consumed
            .saturating_add(len.min(u32::MAX as usize) as u32);
        if self.consumed >= self.threshold {
            self.pending_grant = self.pending_grant.saturating_add(self.consumed);
            if let Some(record) = &self.record {
                record.record_grant_to_peer(self.consumed);
            }
            self.consumed = 0;
        }
    }

    /// Sends any pending grant; a closed sink is not this call's concern here
    /// (the reader reports the failure through the inbound queue).
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.pending_grant == 0 {
            return Poll::Ready(());
        }
        let frame = OutFrame::control(
            self.call_id,
            OutBody::WindowUpdate(self.pending_grant),
            false,
        );
        ready!(self.sink.poll_send(cx, &frame)).ok();
        self.pending_grant = 0;
        Poll::Ready(())
    }
}

/// A stream of received messages: responses on a client, requests in a handler.
///
/// Yields `Ok(message)` for each message, then ends (`None`) when the peer
/// ends the stream with success, or yields one `Err(status)` and ends. Each
/// message read gives the sender more window, so a slow reader holds a fast
/// sender back instead of buffering without bound.
pub struct Streaming<T> {
    first: Option<Bytes>,
    rx: Option<mpsc::UnboundedReceiver<Inbound>>,
    decode: fn(Bytes) -> Result<T, Status>,
    max_message_size: usize,
    window: Option<RecvWindow>,
    deadline: Option<Pin<Box<Sleep>>>,
    trailers: Option<MetadataMap>,
    done: bool,
    /// Keeps the call open while the stream lives (client: dropping cancels).
    _guard: Option<Box<dyn Send + Sync>>,
}

impl<T> std::fmt::Debug for Streaming<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streaming")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

pub(crate) struct StreamingParts {
    pub(crate) first: Option<Bytes>,
    pub(crate) rx: Option<mpsc::UnboundedReceiver<Inbound>>,
    pub(crate) max_message_size: usize,
    pub(crate) window: Option<RecvWindow>,
    pub(crate) deadline: Option<Instant>,
    pub(crate) guard: Option<Box<dyn Send + Sync>>,
}

impl<T> Streaming<T> {
    pub(crate) fn new(
        parts: StreamingParts,
        decode: fn(Bytes) -> Result<T, Status>,
    ) -> Streaming<T> {
        Streaming {
            first: parts.first,
            rx: parts.rx,
            decode,
            max_message_size: parts.max_message_size,
            window: parts.window,
            deadline: parts
                .deadline
                .map(|d| Box::pin(tokio::time::sleep_until(d))),
            trailers: None,
            done: false,
            _guard: parts.guard,
        }
    }

    /// The next message; `Ok(None)` at a successful end of stream.
    pub async fn message(&mut self) -> Result<Option<T>, Status> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx))
            .await
            .transpose()
    }

    /// Metadata the server sent with its final status, once the stream ended.
    pub fn trailers(&self) -> Option<&MetadataMap> {
        self.trailers.as_ref()
    }

    fn finish(&mut self, result: Option<Result<T, Status>>) -> Poll<Option<Result<T, Status>>> {
        self.done = true;
        self.rx = None;
        self.deadline = None;
        Poll::Ready(result)
    }

    fn message_ready(&mut self, bytes: Bytes) -> Poll<Option<Result<T, Status>>> {
        if bytes.len() > self.max_message_size {
            let status = Status::resource_exhausted(format!(
                "received message of {} bytes is larger than the maximum message size of {} bytes",
                bytes.len(),
                self.max_message_size
            ));
            return self.finish(Some(Err(status)));
        }
        if let Some(window) = &mut self.window {
            window.consumed(bytes.len());
        }
        match (self.decode)(bytes) {
            Ok(message) => Poll::Ready(Some(Ok(message))),
            Err(status) => self.finish(Some(Err(status))),
        }
    }
}

impl<T> Stream for Streaming<T> {
    type Item = Result<T, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        // Streaming holds no self-references: every field is Unpin or boxed.
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(window) = &mut this.window {
            ready!(window.poll_flush(cx));
        }
        if let Some(first) = this.first.take() {
            return this.message_ready(first);
        }
        if let Some(deadline) = &mut this.deadline {
            if deadline.as_mut().poll(cx).is_ready() {
                return this.finish(Some(Err(Status::deadline_exceeded(
                    "deadline passed while streaming",
                ))));
            }
        }
        let Some(rx) = &mut this.rx else {
            return this.finish(None);
        };
        match ready!(rx.poll_recv(cx)) {
            Some(Inbound::Message(bytes)) => this.message_ready(bytes),
            Some(Inbound::End) => this.finish(None),
            Some(Inbound::Status(status)) if status.is_ok() => {
                this.trailers = Some(status.metadata().clone());
                this.finish(None)
            }
            Some(Inbound::Status(status)) => {
                this.trailers = Some(status.metadata().clone());
                this.finish(Some(Err(status)))
            }
            None => this.finish(Some(Err(Status::cancelled("call ended without a status")))),
        }
    }
}

use std::future::Future as _;
