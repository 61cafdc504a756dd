//! One connection's reader and call table: frames in, handler tasks
//! started, refusals answered without waiting for the sink.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;
use tracing::Instrument;

use crate::flow::{SendWindow, INITIAL_STREAM_WINDOW};
use crate::frame::{
    peek_head, EncodePayload, Frame, FrameBody, FrameKind, MethodPath, OutBody, OutFrame,
};
use crate::gate::WakeGate;
use crate::intercept::{self, CallEnd, CallHead, Extensions, Peer};
use crate::keepalive::{KeepaliveTimer, Tick, DEFAULT_KEEPALIVE};
use crate::message::Inbound;
use crate::metadata::MetadataMap;
use crate::status::Status;
use crate::timeout::LazyTimeout;
use crate::trace::TraceContext;
use crate::transport::{BoxFuture, Connection, FrameSink, FrameSource, TransportError};

use super::call::ServerCall;
use super::runner::{CallTask, Job, Runners};
use super::{Routes, Service};

/// One connection's server state: the calls open on it.
pub(super) struct ServerConn {
    pub(super) sink: Arc<dyn FrameSink>,
    pub(super) peer: String,
    /// The client as handlers and interceptors see it.
    peer_info: Arc<Peer>,
    pub(super) routes: Arc<Routes>,
    calls: Mutex<HashMap<u64, CallSlot, CallIdKeys>>,
    /// Handlers' final statuses waiting for room in the sink (their slots are gone).
    finishing: AtomicUsize,
    /// Notified when the last open call ends (graceful shutdown waits for it).
    idle: Notify,
    /// Handler tasks kept for the next call.
    runners: Arc<Runners>,
}

/// How a connection's call table hashes call ids: one multiplication,
/// keyed per connection. The ids are the client's choice, so the keys are
/// random (from std's `RandomState`): a client cannot pick ids that collide,
/// and the full 128-bit product folded to 64 bits makes every bit of an id
/// count in the bucket bits. (SipHash, std's default, cost ~600 instructions
/// of a unary call's four table operations.)
#[derive(Clone)]
struct CallIdKeys {
    mix: u64,
    multiplier: u64,
}

impl CallIdKeys {
    fn new() -> CallIdKeys {
        let random = std::collections::hash_map::RandomState::new();
        CallIdKeys {
            mix: random.hash_one(0x243f_6a88_85a3_08d3_u64),
            multiplier: random.hash_one(0x1319_8a2e_0370_7344_u64) | 1,
        }
    }
}

impl BuildHasher for CallIdKeys {
    type Hasher = CallIdHasher;

    fn build_hasher(&self) -> CallIdHasher {
        CallIdHasher {
            keys: self.clone(),
            hash: 0,
        }
    }
}

/// Hashes one call id; see [`CallIdKeys`].
struct CallIdHasher {
    keys: CallIdKeys,
    hash: u64,
}

impl Hasher for CallIdHasher {
    fn write_u64(&mut self, id: u64) {
        let product = u128::from(id ^ self.keys.mix ^ self.hash) * u128::from(self.keys.multiplier);
        self.hash = (product as u64) ^ ((product >> 64) as u64);
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 ids are hashed; any other bytes go in eight at a time.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn finish(&self) -> u64 {
        self.hash
    }
}

/// A handler's final status on its way into the sink: counted as an open call.
struct FinalInFlight<'a>(&'a ServerConn);

impl Drop for FinalInFlight<'_> {
    fn drop(&mut self) {
        // Only the drop that takes `finishing` to zero looks at the table:
        // a call still in it ends later, by `end_call_for_final` (finishing
        // again, so its own drop is such a last one) or by `end_call`
        // (which notifies itself).
        if self.0.finishing.fetch_sub(1, Ordering::AcqRel) == 1 && self.0.calls().is_empty() {
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
    /// The call's flow-control window. Made at once when the client sends a
    /// request stream (its messages are checked against it), else when the
    /// handler starts a response stream ([`ServerConn::response_window`]):
    /// a unary call needs none.
    window: Option<Arc<SendWindow>>,
    /// Bytes the client granted before the window was made.
    early_grants: u64,
    task: Option<CallTask>,
    /// The call's method, `/package.Service/Method`.
    path: MethodPath,
    /// When interceptors admitted the call, for their `on_end`; `None`
    /// when the server has none.
    started: Option<Instant>,
}

impl CallSlot {
    /// Wakes a sender waiting for window: the call is over.
    fn close_window(&self) {
        if let Some(window) = &self.window {
            window.close();
        }
    }
}

impl ServerConn {
    fn calls(&self) -> std::sync::MutexGuard<'_, HashMap<u64, CallSlot, CallIdKeys>> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The client as handlers see it.
    pub(super) fn peer_info(&self) -> &Arc<Peer> {
        &self.peer_info
    }

    /// Tells the interceptors a call they admitted ended with `status`.
    fn observe_end(&self, path: &str, started: Option<Instant>, status: &Status) {
        if let Some(started) = started {
            let end = CallEnd {
                path,
                peer: &self.peer_info,
                status,
                elapsed: started.elapsed(),
            };
            intercept::run_on_end(&self.routes.interceptors, &end);
        }
    }

    /// Removes call `id`; returns whether it was open (so exactly one final status is sent).
    fn end_call(&self, id: u64) -> Option<CallSlot> {
        let mut calls = self.calls();
        let slot = calls.remove(&id)?;
        slot.close_window();
        if self.open_calls(&calls) == 0 {
            self.idle.notify_one();
        }
        Some(slot)
    }

    /// Sends the final status of call `id` (with a last message), if the call
    /// is still open. The call stays open (counted against the limit) until
    /// the frame is in the sink, so replies a client does not read hold
    /// their calls, not an unbounded queue of waiting replies.
    pub(super) async fn finish(
        &self,
        id: u64,
        status: &Status,
        payload: Option<&dyn EncodePayload>,
    ) {
        // The slot goes now (the client may reuse the id once it has the
        // status), but the call counts against the limit until the frame is
        // in the sink.
        let Some((_finishing, observed)) = self.end_call_for_final(id) else {
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
        // The call's last frame: not charged to the task's budget as
        // `send` is (a kept handler task charges it between calls), which
        // saves ~70 instructions a unary call.
        let sent = std::future::poll_fn(|cx| self.sink.poll_send(cx, &frame)).await;
        if let Err(error) = sent {
            tracing::debug!(peer = %self.peer, "final status not sent: {error}");
        }
        if let Some((path, started)) = observed {
            self.observe_end(&path, Some(started), status);
        }
    }

    /// Calls open, final statuses waiting for room included: what the limit counts.
    fn open_calls(&self, calls: &HashMap<u64, CallSlot, CallIdKeys>) -> usize {
        calls.len() + self.finishing.load(Ordering::Acquire)
    }

    /// Ends call `id` for its handler's final status: the returned guard
    /// counts it as open until the status is in the sink (or given up on).
    fn end_call_for_final(
        &self,
        id: u64,
    ) -> Option<(FinalInFlight<'_>, Option<(MethodPath, Instant)>)> {
        let mut calls = self.calls();
        let slot = calls.remove(&id)?;
        slot.close_window();
        self.finishing.fetch_add(1, Ordering::AcqRel);
        Some((FinalInFlight(self), slot.started.map(|t| (slot.path, t))))
    }

    fn abort_all(&self) {
        let slots: Vec<CallSlot> = self.calls().drain().map(|(_, slot)| slot).collect();
        for slot in slots {
            slot.close_window();
            if let Some(task) = slot.task {
                task.abort();
            }
            let closed = Status::cancelled("the connection closed before the call finished");
            self.observe_end(&slot.path, slot.started, &closed);
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
                if let Some(len) = self.oversized(frame.payload.as_ref()) {
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
                if let Some(len) = self.oversized(frame.payload.as_ref()) {
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
                // (A call with a request stream has its window from the start.)
                let granted = slot
                    .window
                    .as_ref()
                    .map_or(INITIAL_STREAM_WINDOW.into(), |w| w.granted_to_peer());
                if frame.payload.is_some() && slot.received >= granted {
                    let received = slot.received;
                    drop(calls);
                    let status = Status::resource_exhausted(format!(
                        "the client sent {received} bytes on the request stream and more, \
                         beyond the {granted}-byte window the server granted (flow control ignored)"
                    ));
                    if let Some(slot) = self.end_call(id) {
                        if let Some(task) = slot.task {
                            task.abort();
                        }
                        self.observe_end(&slot.path, slot.started, &status);
                    }
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
                    self.observe_end(
                        &slot.path,
                        slot.started,
                        &Status::cancelled("cancelled by the client"),
                    );
                }
            }
            FrameBody::WindowUpdate(bytes) => {
                if let Some(slot) = self.calls().get_mut(&id) {
                    match &slot.window {
                        Some(window) => window.grant(bytes),
                        None => slot.early_grants = slot.early_grants.saturating_add(bytes.into()),
                    }
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

    /// The length of `payload` when it is over the server's maximum message size.
    fn oversized(&self, payload: Option<&Bytes>) -> Option<usize> {
        payload
            .map(Bytes::len)
            .filter(|&len| len > self.routes.max_message_size)
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
                    self.observe_end(&slot.path, slot.started, &status);
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
        path: MethodPath,
        timeout: Option<Duration>,
        mut metadata: MetadataMap,
        first: Option<Bytes>,
        end_stream: bool,
        backlog: &mut RefusalBacklog,
    ) {
        let Some((service, method_at)) = route(&self.routes, &path) else {
            let status = Status::unimplemented(format!("no service for method {path}"));
            return backlog.refuse(&*self.sink, id, status);
        };
        let mut extensions = Extensions::new();
        let started = if self.routes.interceptors.is_empty() {
            None
        } else {
            let started = Instant::now();
            let mut head = CallHead {
                path: &path,
                metadata: &mut metadata,
                peer: &self.peer_info,
                extensions: &mut extensions,
                timeout,
            };
            if let Err(status) = intercept::run_on_call(&self.routes.interceptors, &mut head) {
                return backlog.refuse(&*self.sink, id, status);
            }
            Some(started)
        };
        // Only an interceptor (`trace::TracePropagation`) puts a trace
        // context in the extensions.
        let trace = if started.is_some() {
            extensions.get::<TraceContext>().copied()
        } else {
            None
        };
        let window = (!end_stream).then(|| Arc::new(SendWindow::new(INITIAL_STREAM_WINDOW)));
        let (inbound_tx, inbound_rx) = if end_stream {
            (None, None)
        } else {
            let (tx, rx) = mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        };
        let deadline = timeout.map(|t| Instant::now() + t);
        let call = ServerCall {
            conn: Arc::clone(self),
            id,
            metadata,
            timeout,
            deadline,
            extensions,
            first,
            inbound: inbound_rx,
            window: window.clone(),
        };
        // Builds the handler's future; none of the handler's code runs yet.
        let mut handler = service.call(&path[method_at..], call);
        let span = tracing::debug_span!(
            "rpc.server",
            method = %path,
            peer = %self.peer,
            trace_id = tracing::field::Empty
        );
        if let Some(context) = trace {
            span.record(
                "trace_id",
                tracing::field::display(format_args!("{:032x}", context.trace_id())),
            );
        }
        let slot = CallSlot {
            inbound: inbound_tx,
            received: 0,
            window,
            early_grants: 0,
            task: None,
            path,
            started,
        };
        // Registered before the handler first runs: it ends the call by its
        // id. Its task is noted after the handler is handed to one, with the
        // table unlocked meanwhile: handing it over wakes a task, which can
        // take a system call (a parked worker woken), and the handlers of
        // other calls lock the table to end theirs. A handler that ended
        // first took its slot away, and the task is not noted. Nothing
        // aborts the task in between: only this reader and its connection's
        // end do, and both run on this task.
        self.calls().insert(id, slot);
        let inline = self.routes.inline_handlers && end_stream;
        if inline {
            match poll_inline(&span, trace, &mut handler) {
                Inline::Finished => return,
                Inline::Waiting => {}
                Inline::Panicked(what) => {
                    let status = panicked(&self.call_path(id), &what);
                    let conn = Arc::clone(self);
                    tokio::spawn(async move { conn.finish(id, &status, None).await });
                    return;
                }
            }
        }
        let task = if !inline && span.is_disabled() && trace.is_none() {
            let conn = Arc::clone(self);
            self.runners.start(Job {
                conn,
                id,
                handler,
                deadline,
            })
        } else {
            let run = run_call(Arc::clone(self), id, handler, deadline);
            let task = match trace {
                None => spawn_in(span, run),
                Some(context) => spawn_in(span, context.scope(run)),
            };
            CallTask::Spawned(task.abort_handle())
        };
        if let Some(slot) = self.calls().get_mut(&id) {
            slot.task = Some(task);
        }
    }

    /// Call `id`'s window for its response stream, made now if it has none
    /// yet (with what the client granted so far); `None` once the call is
    /// over (a sender waiting for window then stops, as on a closed one).
    pub(super) fn response_window(&self, id: u64) -> Option<Arc<SendWindow>> {
        let mut calls = self.calls();
        let slot = calls.get_mut(&id)?;
        let early_grants = slot.early_grants;
        let window = slot.window.get_or_insert_with(|| {
            Arc::new(SendWindow::with_grants(INITIAL_STREAM_WINDOW, early_grants))
        });
        Some(Arc::clone(window))
    }

    /// Call `id`'s method, for the messages of its rare endings (a panic, a
    /// deadline); "the handler" once the call is over.
    fn call_path(&self, id: u64) -> String {
        self.calls()
            .get(&id)
            .map_or_else(|| "the handler".to_owned(), |slot| slot.path.to_string())
    }
}

/// How a handler's first poll on the connection's reader went.
enum Inline {
    /// It sent its final status: the call is over, no task was needed.
    Finished,
    /// It waits for something: it goes on in a task of its own.
    Waiting,
    /// It panicked, saying this.
    Panicked(String),
}

/// Polls `handler` once on the reader's task, in its span and trace
/// context, for [`ServerBuilder::inline_handlers`](super::ServerBuilder::inline_handlers).
///
/// With a waker that does nothing: a handler that returns `Pending` is
/// polled again at once by the task it moves to, which registers that
/// task's waker (a future answers to the waker of its latest poll).
fn poll_inline(
    span: &tracing::Span,
    trace: Option<TraceContext>,
    handler: &mut BoxFuture<'static, ()>,
) -> Inline {
    let mut cx = Context::from_waker(Waker::noop());
    let mut poll = || std::panic::catch_unwind(AssertUnwindSafe(|| handler.as_mut().poll(&mut cx)));
    let polled = match (span.is_disabled(), trace) {
        (true, None) => poll(),
        (false, None) => span.in_scope(poll),
        (_, Some(context)) => span.in_scope(|| context.sync_scope(poll)),
    };
    match polled {
        Ok(Poll::Ready(())) => Inline::Finished,
        Ok(Poll::Pending) => Inline::Waiting,
        Err(panic) => Inline::Panicked(panic_message(&*panic).to_owned()),
    }
}

/// Spawns a call's task, in its span when the span is enabled.
fn spawn_in<F>(span: tracing::Span, run: F) -> tokio::task::JoinHandle<()>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    if span.is_disabled() {
        tokio::spawn(run)
    } else {
        tokio::spawn(run.instrument(span))
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

/// The service a call's path (`/package.Service/Method`) names, and where
/// in the path its method starts.
fn route<'a>(routes: &'a Routes, path: &str) -> Option<(&'a dyn Service, usize)> {
    let rest = path.strip_prefix('/')?;
    // A byte loop from the end: a method's name is short, and neither it
    // nor its service's holds a '/' (a path that does names no service);
    // `split_once` went through `memchr`, ~100 instructions a call.
    let slash = rest.bytes().rposition(|b| b == b'/')?;
    let service = routes.services.get(&rest[..slash])?;
    Some((&**service, 1 + slash + 1))
}

/// Runs a handler under its deadline, turning a panic or an expired deadline into a status.
pub(super) async fn run_call(
    conn: Arc<ServerConn>,
    id: u64,
    handler: BoxFuture<'static, ()>,
    deadline: Option<Instant>,
) {
    let handler = AssertUnwindSafe(handler).catch_unwind();
    // The timer (made only if the handler waits) and the rare ending's
    // frame are boxed: held inline they would make every call's task
    // larger, and tokio copies a task's future several times as it
    // spawns, runs and retires it.
    let outcome = match deadline {
        None => Ok(handler.await),
        Some(deadline) => LazyTimeout::new(handler, deadline).await,
    };
    let status = match outcome {
        Ok(Ok(())) => return, // the handler sent its own final status
        Ok(Err(panic)) => panicked(&conn.call_path(id), panic_message(&*panic)),
        Err(_) => {
            let path = conn.call_path(id);
            Status::deadline_exceeded(format!("deadline exceeded while {path} ran"))
        }
    };
    Box::pin(conn.finish(id, &status, None)).await;
}

/// What a panic said, when it said it with a string.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(non-string panic payload)")
}

/// Logs a handler's panic; the status its call ends with.
fn panicked(path: &str, what: &str) -> Status {
    tracing::error!("handler for {path} panicked: {what}");
    Status::internal(format!("handler for {path} panicked"))
}

/// Aborts a connection's handlers and closes it when its task ends, however it ends.
struct ConnGuard(Arc<ServerConn>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.abort_all();
        self.0.runners.close();
        self.0.sink.close();
    }
}

pub(super) async fn serve_connection(
    routes: Arc<Routes>,
    connection: Connection,
    mut shutdown: watch::Receiver<bool>,
) {
    // Counted open until this future ends or is dropped (a shutdown's
    // grace ran out), the connection with it.
    let _open = routes.counters.opened();
    let conn = Arc::new(ServerConn {
        sink: routes.counters.count_stalls(connection.sink),
        peer_info: Arc::new(Peer::with_identity(
            connection.peer.clone(),
            connection.identity,
        )),
        peer: connection.peer,
        routes,
        calls: Mutex::new(HashMap::with_hasher(CallIdKeys::new())),
        finishing: AtomicUsize::new(0),
        idle: Notify::new(),
        runners: Arc::default(),
    });
    let guard = ConnGuard(Arc::clone(&conn));
    let mut source: Box<dyn FrameSource> = connection.source;
    let mut draining = *shutdown.borrow();
    // One future for the whole connection: re-created at every wait, it
    // would join and leave the watch's list of waiters each time.
    let shutdown_changed = shutdown.changed();
    tokio::pin!(shutdown_changed);
    // Polled only when the watch woke it, not at every frame.
    let shutdown_gate = WakeGate::new();
    tracing::debug!(peer = %conn.peer, "connection accepted");
    let mut timer = KeepaliveTimer::new(conn.routes.keepalive);
    let received = AtomicU64::new(0);
    let mut backlog = RefusalBacklog::default();
    // The client shut down its write side (`Ok(None)`): it sends nothing
    // more, but the calls it opened still run and their replies go out.
    let mut half_closed = false;
    // The client was taken for dead: nothing more will reach it.
    let mut client_dead = false;
    let violation = loop {
        if (draining || half_closed) && backlog.is_empty() && conn.open_calls(&conn.calls()) == 0 {
            break None;
        }
        tokio::select! {
            // In this order: frames first, no random draw per wait.
            biased;
            result = source.recv(), if backlog.is_empty() && !half_closed => {
                received.fetch_add(1, Ordering::Relaxed);
                match conn.handle(result, draining, &mut backlog) {
                    Ok(Reading::On) => {}
                    Ok(Reading::HalfClosed) => {
                        tracing::debug!(peer = %conn.peer, "client closed its sending side: finishing its open calls");
                        half_closed = true;
                        conn.end_request_streams();
                        timer.probe_only();
                    }
                    Ok(Reading::Ended) => break None,
                    Err(violation) => break Some(violation),
                }
            }
            () = backlog.flush(&*conn.sink), if !backlog.is_empty() => {}
            tick = timer.tick(&received), if timer.enabled() => match tick {
                // A half-closed client sends no pongs, and may have left
                // altogether (a process that exits half-closes its socket
                // as well): pings probe it, and once one fails to go out,
                // its calls end, or a call that never ends (a watch
                // stream) would hold the connection and the server's drain
                // forever.
                Tick::Ping if half_closed => {
                    if let Err(error) = conn.sink.try_send(&OutFrame::control(0, OutBody::Ping, false)) {
                        tracing::debug!(peer = %conn.peer, "the half-closed client is gone ({error}): ending its calls");
                        client_dead = true;
                        break None;
                    }
                }
                Tick::Ping => {
                    // Never waits: with no room (a dead peer grants none),
                    // the silence goes on and the next tick declares it dead.
                    let _ = conn.sink.try_send(&OutFrame::control(0, OutBody::Ping, false));
                }
                Tick::Dead(silent) => {
                    tracing::info!(peer = %conn.peer, "no complete frame from the client for {silent:?}, and no answer to a ping: closing");
                    client_dead = true;
                    break None;
                }
            },
            _ = std::future::poll_fn(|cx| shutdown_gate.poll(cx, shutdown_changed.as_mut())), if !draining => {
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
    let orderly = violation.is_none() && !client_dead;
    if let Some(violation) = violation {
        tracing::warn!(peer = %conn.peer, "closing connection: {violation}");
        let status = Status::internal(format!("protocol error: {violation}"));
        // Best effort: a peer that broke the protocol is not waited for.
        let _ = conn
            .sink
            .try_send(&OutFrame::control(0, OutBody::GoAway(&status), false));
    }
    // Closes the sink, then waits until what it accepted is out: once
    // `serve` returns, the process may exit (its runtime, and a transport's
    // writer task on it, with it) and no answer may be lost. Not for a
    // client that broke the protocol or was found dead, and no longer than
    // keepalive would wait for a silent client (the default keepalive's
    // patience when it is off: a client that takes nothing, say one that
    // grants RDMA no credits, must not hold the connection forever).
    drop(guard);
    if orderly {
        let flushed = std::future::poll_fn(|cx| conn.sink.poll_closed(cx));
        let keepalive = conn.routes.keepalive.unwrap_or(DEFAULT_KEEPALIVE);
        let patience = keepalive.interval + keepalive.timeout;
        if tokio::time::timeout(patience, flushed).await.is_err() {
            tracing::info!(peer = %conn.peer, "the client took none of the last frames for {patience:?}: closing without them");
        }
    }
    tracing::debug!(peer = %conn.peer, "connection closed");
}

#[cfg(test)]
mod tests {
    use std::task::Context;

    use super::*;
    use crate::keepalive::Keepalive;
    use crate::transport::stats::{ConnectionCounters, Side};

    /// A client that reads nothing: its connection never has room, and
    /// what was sent never leaves.
    struct FullSink;

    impl FrameSink for FullSink {
        fn poll_send(
            &self,
            _cx: &mut Context<'_>,
            _frame: &OutFrame<'_>,
        ) -> Poll<Result<(), TransportError>> {
            Poll::Pending
        }

        fn close(&self) {}

        fn poll_closed(&self, _cx: &mut Context<'_>) -> Poll<()> {
            Poll::Pending
        }
    }

    /// Delivers its frames, counting those taken, then nothing (silent, not closed).
    struct QueuedFrames(VecDeque<Bytes>, Arc<AtomicUsize>);

    impl FrameSource for QueuedFrames {
        fn poll_recv(
            &mut self,
            _cx: &mut Context<'_>,
        ) -> Poll<Result<Option<Bytes>, TransportError>> {
            match self.0.pop_front() {
                Some(frame) => {
                    self.1.fetch_add(1, Ordering::SeqCst);
                    Poll::Ready(Ok(Some(frame)))
                }
                None => Poll::Pending,
            }
        }
    }

    /// A server's settings with no service, as the tests here need them.
    fn routes_without_services(
        name: &'static str,
        keepalive: Option<Keepalive>,
        max_concurrent_calls: Option<usize>,
    ) -> Arc<Routes> {
        Arc::new(Routes {
            services: Default::default(),
            max_message_size: 1 << 20,
            stream_window: INITIAL_STREAM_WINDOW,
            keepalive,
            max_concurrent_calls,
            interceptors: Vec::new(),
            inline_handlers: false,
            counters: ConnectionCounters::of(name, Side::Server),
        })
    }

    /// A client that closed its side: nothing more arrives.
    struct Ended;

    impl FrameSource for Ended {
        fn poll_recv(
            &mut self,
            _cx: &mut Context<'_>,
        ) -> Poll<Result<Option<Bytes>, TransportError>> {
            Poll::Ready(Ok(None))
        }
    }

    /// With keepalive off, a client that takes none of the last frames
    /// holds its connection no longer than the default keepalive's
    /// patience.
    #[tokio::test(start_paused = true)]
    async fn without_keepalive_the_wait_for_the_last_frames_is_still_bounded() {
        let connection = Connection {
            sink: Arc::new(FullSink),
            source: Box::new(Ended),
            peer: "test".into(),
            identity: None,
        };
        let routes = routes_without_services("ended-test", None, None);
        let (_shutdown_tx, shutdown) = watch::channel(false);
        let started = tokio::time::Instant::now();
        tokio::time::timeout(
            Duration::from_secs(600),
            serve_connection(routes, connection, shutdown),
        )
        .await
        .expect("the connection waited for its last frames with no bound");
        let patience = DEFAULT_KEEPALIVE.interval + DEFAULT_KEEPALIVE.timeout;
        assert_eq!(
            started.elapsed(),
            patience,
            "the connection did not wait the default keepalive's patience for its last frames"
        );
    }

    /// Call ids hash apart under one connection's keys, and to other
    /// values under another connection's.
    #[test]
    fn call_ids_hash_by_every_bit_under_per_connection_keys() {
        let (a, b) = (CallIdKeys::new(), CallIdKeys::new());
        let ids = [0u64, 1, 2, 1 << 32, 1 << 63, u64::MAX, 0xdead_beef];
        let hashes: std::collections::HashSet<u64> = ids.iter().map(|&id| a.hash_one(id)).collect();
        assert_eq!(hashes.len(), ids.len());
        // Ids that differ only in their high bits land in different buckets.
        let low_bits = |id: u64| a.hash_one(id) & 0xffff;
        assert!((1..64u64).any(|i| low_bits(i << 48) != low_bits(0)));
        assert!(ids.iter().any(|&id| a.hash_one(id) != b.hash_one(id)));
    }

    /// The reader never waits for the sink: a refusal with no room waits in
    /// the backlog, the reader takes no more frames meanwhile, and keepalive
    /// still declares the silent client dead.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_reads_nothing_is_not_read_from_and_keepalive_still_closes_it() {
        let metadata = MetadataMap::new();
        let request = |id| {
            let body = OutBody::Request {
                method: "/no.Such/Method", // refused by the reader itself
                timeout: None,
                metadata: &metadata,
            };
            OutFrame::new(id, body, None, true).unwrap().to_bytes()
        };
        let taken = Arc::new(AtomicUsize::new(0));
        let connection = Connection {
            sink: Arc::new(FullSink),
            source: Box::new(QueuedFrames(
                (1..=10).map(request).collect(),
                Arc::clone(&taken),
            )),
            peer: "test".into(),
            identity: None,
        };
        let keepalive = Keepalive {
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
        };
        let routes = routes_without_services("full-sink-test", Some(keepalive), Some(1));
        let (_shutdown_tx, shutdown) = watch::channel(false);
        let started = tokio::time::Instant::now();
        tokio::time::timeout(
            Duration::from_secs(60),
            serve_connection(routes, connection, shutdown),
        )
        .await
        .expect("keepalive closed the connection while a refusal waited for room");
        // Found dead 3 s in (1 s of silence, a ping, no answer for 1 s, at
        // the timer's ticks): then the connection ends without waiting for
        // its frames to leave, which they never will (waiting for them,
        // bounded by the keepalive's 2 s, it ended 5 s in).
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "the connection ended {:?} after it started: it waited for a dead client to take its frames",
            started.elapsed()
        );
        assert_eq!(
            taken.load(Ordering::SeqCst),
            1,
            "the reader took more frames while its refusal waited for room"
        );
    }
}
