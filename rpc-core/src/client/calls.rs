//! [`Client`]: typed calls (unary, streaming) over a [`Channel`], under their deadlines.

use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::Instrument;

use crate::codec::{Codec, Encodable};
use crate::flow::{SendWindow, INITIAL_STREAM_WINDOW};
use crate::frame::{EncodePayload, OutBody, OutFrame};
use crate::intercept::{self, CallEnd, CallHead, Extensions};
use crate::message::{
    CallOptions, Inbound, RecvWindow, Request, Response, Streaming, StreamingParts,
};
use crate::metadata::MetadataMap;
use crate::status::{Code, Status};
use crate::timeout::{DeadlinePassed, LazyTimeout};

use super::call_table::{ClientConn, Inbox, DEADLINE_PASSED};
use super::channel::{Channel, Picked};

/// Makes typed calls on a [`Channel`]; what generated clients wrap.
#[derive(Clone, Debug)]
pub struct Client {
    pub(super) channel: Channel,
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

    /// When the call must be done: the earlier of the request's deadline
    /// and its timeout from now; the channel's default timeout if it set neither.
    pub(super) fn deadline(&self, options: &CallOptions) -> Option<Instant> {
        let timeout = match options.deadline {
            Some(_) => options.timeout,
            None => options.timeout.or(self.channel.config().timeout),
        };
        let from_timeout = timeout.map(|t| Instant::now() + t);
        match (options.deadline, from_timeout) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs the channel's interceptors on a call about to be sent; returns
    /// when the call started if they are to hear of its end.
    fn intercept(
        &self,
        path: &str,
        metadata: &mut MetadataMap,
        deadline: Option<Instant>,
    ) -> Result<Option<Instant>, Status> {
        let interceptors = &self.channel.config().interceptors;
        if interceptors.is_empty() {
            return Ok(None);
        }
        let started = Instant::now();
        let mut head = CallHead {
            path,
            metadata,
            peer: self.channel.peer(),
            extensions: &mut Extensions::new(),
            timeout: deadline.map(|d| d.saturating_duration_since(started)),
        };
        intercept::run_on_call(interceptors, &mut head)?;
        Ok(Some(started))
    }

    /// Tells the interceptors how an intercepted call ended.
    fn intercepted_end<T>(
        &self,
        path: &str,
        started: Option<Instant>,
        outcome: &Result<T, Status>,
    ) {
        let Some(started) = started else { return };
        static OK: Status = Status::OK;
        let end = CallEnd {
            path,
            peer: self.channel.peer(),
            status: outcome.as_ref().err().unwrap_or(&OK),
            elapsed: started.elapsed(),
        };
        intercept::run_on_end(&self.channel.config().interceptors, &end);
    }

    /// Opens a call: registers it and sends its `Request` frame, carrying
    /// `first`, the single request message, or none if a request stream follows.
    pub(super) async fn open(
        &self,
        path: &str,
        metadata: &MetadataMap,
        deadline: Option<Instant>,
        first: Option<&dyn EncodePayload>,
        mut inbox: Inbox,
        mut avoid_replica: Option<usize>,
    ) -> Result<(ActiveCall, Option<Arc<SendWindow>>), Status> {
        let sends_stream = first.is_none();
        // A response stream's window records the client's grants, for the reader's check.
        let receives_stream = matches!(inbox, Inbox::Stream(_));
        let window = (sends_stream || receives_stream)
            .then(|| Arc::new(SendWindow::new(INITIAL_STREAM_WINDOW)));
        // A connection found draining (or just closed) took nothing: on a
        // channel over several replicas the call goes to another, once.
        let mut tries = self.channel.replica_count().min(2);
        let (conn, replica, id) = loop {
            let Picked { conn, replica } = self.channel.pick(avoid_replica).await?;
            match conn.open_call(window.clone(), inbox, deadline) {
                Ok(id) => break (conn, replica, id),
                Err((status, _)) if tries <= 1 => return Err(status),
                Err((_, returned)) => {
                    inbox = returned;
                    avoid_replica = Some(replica);
                    tries -= 1;
                }
            }
        };
        let call = ActiveCall {
            conn,
            id,
            replica,
            sender: None,
            outcome_taken: false,
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

    pub(super) fn streaming_response<T>(
        &self,
        call: ActiveCall,
        window: Option<Arc<SendWindow>>,
        rx: mpsc::UnboundedReceiver<Inbound>,
        deadline: Option<Instant>,
        decode: fn(Bytes) -> Result<T, Status>,
    ) -> Streaming<T> {
        let config = self.channel.config();
        let window = RecvWindow::new(
            Arc::clone(&call.conn.sink),
            call.id,
            config.stream_window,
            window,
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
    ///
    /// On a channel over several replicas, a call marked
    /// [idempotent](Request::set_idempotent) that fails with `Unavailable`
    /// (its connection broke) is sent once more, to another replica.
    pub async fn unary<C: Codec>(
        &self,
        path: &str,
        request: Request<C::Encode>,
    ) -> Result<Response<C::Decode>, Status> {
        let (message, mut metadata, options) = request.into_parts();
        let deadline = self.deadline(&options);
        let intercepted = self.intercept(path, &mut metadata, deadline)?;
        let retry = options.idempotent && self.channel.replica_count() > 1;
        let waiting = AtomicBool::new(false);
        let call = async {
            let payload = Encodable::<C>::new(&message, self.channel.config().max_message_size)?;
            let mut avoid = None;
            loop {
                waiting.store(false, Ordering::Relaxed);
                let (mut call, _) = self
                    .open(
                        path,
                        &metadata,
                        deadline,
                        Some(&payload),
                        Inbox::single(),
                        avoid,
                    )
                    .await?;
                match receive_one::<C>(&mut call, &waiting).await {
                    Err(status)
                        if retry && avoid.is_none() && status.code() == Code::Unavailable =>
                    {
                        tracing::debug!(peer = %call.conn.peer, "retrying an idempotent call on another replica: {status}");
                        avoid = Some(call.replica);
                    }
                    outcome => return outcome,
                }
            }
        };
        let span = tracing::debug_span!("rpc.client", method = path);
        let outcome = if deadline.is_none() && span.is_disabled() {
            // Nothing to wrap it in: awaited in place, not moved into wrappers.
            call.await
        } else {
            // Pinned here, once: the wrappers take a pointer to it. Moved
            // into them by value, the call future was copied at each level
            // (8 copies a call with a deadline, ~950 instructions, callgrind).
            under_deadline(span, deadline, &waiting, pin!(call)).await
        };
        self.intercepted_end(path, intercepted, &outcome);
        outcome
    }

    /// A server-streaming call: one request, a stream of responses.
    pub async fn server_streaming<C: Codec>(
        &self,
        path: &str,
        request: Request<C::Encode>,
    ) -> Result<Response<Streaming<C::Decode>>, Status> {
        let (message, mut metadata, options) = request.into_parts();
        let deadline = self.deadline(&options);
        self.intercept(path, &mut metadata, deadline)?;
        let call = async {
            let payload = Encodable::<C>::new(&message, self.channel.config().max_message_size)?;
            let (tx, rx) = mpsc::unbounded_channel();
            let (call, window) = self
                .open(
                    path,
                    &metadata,
                    deadline,
                    Some(&payload),
                    Inbox::Stream(tx),
                    None,
                )
                .await?;
            Ok(Response::new(self.streaming_response(
                call,
                window,
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
        let (stream, mut metadata, options) = request.into_parts();
        let deadline = self.deadline(&options);
        let intercepted = self.intercept(path, &mut metadata, deadline)?;
        let waiting = AtomicBool::new(false);
        let call = async {
            let (mut call, _) = self
                .open_sending::<C, S>(path, &metadata, deadline, stream, Inbox::single())
                .await?;
            receive_one::<C>(&mut call, &waiting).await
        };
        let span = tracing::debug_span!("rpc.client", method = path);
        let outcome = under_deadline(span, deadline, &waiting, pin!(call)).await;
        self.intercepted_end(path, intercepted, &outcome);
        outcome
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
        let (stream, mut metadata, options) = request.into_parts();
        let deadline = self.deadline(&options);
        self.intercept(path, &mut metadata, deadline)?;
        let call = async {
            let (tx, rx) = mpsc::unbounded_channel();
            let (call, window) = self
                .open_sending::<C, S>(path, &metadata, deadline, stream, Inbox::Stream(tx))
                .await?;
            Ok(Response::new(self.streaming_response(
                call,
                Some(window),
                rx,
                deadline,
                C::decode,
            )))
        };
        traced(path, deadline, call).await
    }

    /// Opens a call whose requests are `stream`, and starts sending them.
    pub(super) async fn open_sending<C, S>(
        &self,
        path: &str,
        metadata: &MetadataMap,
        deadline: Option<Instant>,
        stream: S,
        inbox: Inbox,
    ) -> Result<(ActiveCall, Arc<SendWindow>), Status>
    where
        C: Codec,
        S: Stream<Item = C::Encode> + Send + 'static,
    {
        let (mut call, window) = self
            .open(path, metadata, deadline, None, inbox, None)
            .await?;
        let window = window.expect("streaming calls have a send window");
        call.sender = Some(self.spawn_sender::<C, S>(&call, Arc::clone(&window), stream));
        Ok((call, window))
    }

    /// Sends the request stream's messages as the server's window allows, then the end of stream.
    pub(super) fn spawn_sender<C, S>(
        &self,
        call: &ActiveCall,
        window: Arc<SendWindow>,
        stream: S,
    ) -> AbortHandle
    where
        C: Codec,
        S: Stream<Item = C::Encode> + Send + 'static,
    {
        let conn = Arc::clone(&call.conn);
        let id = call.id;
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

/// Receives a single response: one message, then an OK status. Sets
/// `waiting` while it waits: the connection then ends the call at its
/// deadline (see [`under_deadline`]).
pub(super) async fn receive_one<C: Codec>(
    call: &mut ActiveCall,
    waiting: &AtomicBool,
) -> Result<Response<C::Decode>, Status> {
    waiting.store(true, Ordering::Relaxed);
    let outcome = std::future::poll_fn(|cx| call.conn.poll_single(call.id, cx)).await;
    // The call's slot went with its outcome: nothing is left to cancel.
    call.outcome_taken = true;
    let (bytes, trailers) = outcome?;
    Ok(Response::from_parts(C::decode(bytes)?, trailers))
}

/// Runs a call under its deadline, in its tracing span.
pub(super) async fn traced<T>(
    path: &str,
    deadline: Option<Instant>,
    call: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    let span = tracing::debug_span!("rpc.client", method = path);
    let not_waiting = AtomicBool::new(false);
    under_deadline(span, deadline, &not_waiting, pin!(call)).await
}

/// Runs a call under its deadline, in `span`. While `waiting` is set (by
/// [`receive_one`]), the call waits for its single response on a
/// connection that ends it at its deadline (`ClientConn::open_call`): it
/// needs a timer of its own only while it waits for anything else
/// (connecting, room to send), and makes one then ([`LazyTimeout`]).
async fn under_deadline<T>(
    span: tracing::Span,
    deadline: Option<Instant>,
    waiting: &AtomicBool,
    call: Pin<&mut impl Future<Output = Result<T, Status>>>,
) -> Result<T, Status> {
    let deadline = match deadline {
        None => return in_span(span, call).await,
        // A timeout of zero (or a deadline already past) fails at once, as
        // in gRPC, without connecting or sending anything: a timer is only
        // looked at after a first poll of the call, which may send the
        // request.
        Some(deadline) if deadline <= Instant::now() => {
            return Err(Status::deadline_exceeded(
                "deadline exceeded before the request was sent (timeout of zero)",
            ))
        }
        Some(deadline) => deadline,
    };
    let call = LazyTimeout::new(call, deadline).covered_by(waiting);
    in_span(span, call)
        .await
        .unwrap_or_else(|DeadlinePassed| Err(Status::deadline_exceeded(DEADLINE_PASSED)))
}

/// Runs `call` in `span`; with no subscriber wanting it, without the
/// span's enter and exit on every poll.
async fn in_span<F: Future>(span: tracing::Span, call: F) -> F::Output {
    if span.is_disabled() {
        call.await
    } else {
        call.instrument(span).await
    }
}

/// A call in progress on the client. Dropping it before the server's status
/// arrived cancels the call (a `Cancel` frame stops the server's handler).
pub(super) struct ActiveCall {
    pub(super) conn: Arc<ClientConn>,
    pub(super) id: u64,
    /// Which of the channel's replicas the call went to.
    pub(super) replica: usize,
    pub(super) sender: Option<AbortHandle>,
    /// Its single response's outcome was taken (and its slot with it).
    pub(super) outcome_taken: bool,
    /// Keeps the channel (and its connection) open while a stream outlives the client.
    pub(super) _channel: Channel,
}

impl Drop for ActiveCall {
    fn drop(&mut self) {
        if let Some(sender) = self.sender.take() {
            sender.abort();
        }
        if !self.outcome_taken {
            self.conn.cancel(self.id);
        }
    }
}
