//! One connection's client state ([`ClientConn`]): the table of open calls and the reader that fills it.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use slab::Slab;
use tokio::sync::mpsc;

use crate::flow::SendWindow;
use crate::frame::{peek_head, Frame, FrameBody, FrameKind, OutBody, OutFrame};
use crate::keepalive::{Keepalive, KeepaliveTimer, Tick};
use crate::message::Inbound;
use crate::metadata::MetadataMap;
use crate::status::Status;
use crate::transport::stats::ConnectionCounters;
use crate::transport::{Connection, FrameSink, FrameSource, TransportError};

use super::endpoint::ChannelConfig;

/// One connection's client state: the table of open calls and its reader.
pub(crate) struct ClientConn {
    pub(super) sink: Arc<dyn FrameSink>,
    pub(super) peer: String,
    pub(super) max_message_size: usize,
    pub(super) calls: Mutex<CallTable>,
}

pub(super) struct CallTable {
    pub(super) slots: Slab<CallSlot>,
    pub(super) generation: u32,
    pub(super) phase: Phase,
}

pub(super) enum Phase {
    Open,
    /// The server sent GoAway: calls in flight finish, new ones go elsewhere.
    Draining,
    Closed(Status),
}

pub(super) struct CallSlot {
    pub(super) generation: u32,
    pub(super) inbox: Inbox,
    /// The request stream's send window; on calls with a response stream it
    /// also records what the client granted the server (`granted_to_peer`).
    pub(super) window: Option<Arc<SendWindow>>,
    /// Bytes of response-stream messages received, held to the window granted.
    pub(super) received: u64,
}

/// What a call with a single response message (unary, client-streaming)
/// receives: the message and the trailers, or why it failed.
pub(super) type SingleResponse = Result<(Bytes, MetadataMap), Status>;

/// Where the reader delivers what the server sends on one call.
pub(super) enum Inbox {
    /// A response stream: every message and the status, through a channel.
    Stream(mpsc::UnboundedSender<Inbound>),
    /// A single response: the message waits here for the status; the caller
    /// polls the slot ([`ClientConn::poll_single`]) and is woken once, when
    /// the outcome is in (no channel per call to allocate).
    Single {
        message: Option<Bytes>,
        /// The caller's waker, from its latest poll.
        waiter: Option<Waker>,
    },
    /// A single response's outcome, waiting for its caller to take it. The
    /// call is over: nothing more is delivered to it, and it is not
    /// cancelled when its caller goes away.
    Done(SingleResponse),
}

impl Inbox {
    pub(super) fn single() -> Inbox {
        Inbox::Single {
            message: None,
            waiter: None,
        }
    }

    /// Whether the call still takes what the server sends.
    fn is_open(&self) -> bool {
        !matches!(self, Inbox::Done(_))
    }

    /// Delivers a message; returns the waker to wake if that ended the call.
    #[must_use]
    pub(super) fn message(&mut self, payload: Bytes) -> Option<Waker> {
        match self {
            Inbox::Stream(tx) => {
                let _ = tx.send(Inbound::Message(payload));
                None
            }
            Inbox::Single { message, .. } if message.is_none() => {
                *message = Some(payload);
                None
            }
            Inbox::Single { .. } => self.conclude(Err(Status::internal(
                "server sent more than one message on a unary response",
            ))),
            Inbox::Done(_) => None,
        }
    }

    /// Ends the call with `status`; returns the waker to wake (a single
    /// response's caller: wake it once the table is unlocked).
    #[must_use]
    pub(super) fn finish(&mut self, mut status: Status) -> Option<Waker> {
        match self {
            Inbox::Stream(tx) => {
                let _ = tx.send(Inbound::Status(status));
                None
            }
            Inbox::Single { message, .. } => {
                let outcome = match message.take() {
                    _ if !status.is_ok() => Err(status),
                    Some(bytes) => Ok((bytes, std::mem::take(status.metadata_mut()))),
                    None => Err(Status::internal(
                        "server ended the call without a response message",
                    )),
                };
                self.conclude(outcome)
            }
            Inbox::Done(_) => None,
        }
    }

    /// A single response's outcome is in: kept for the caller, who is woken.
    fn conclude(&mut self, outcome: SingleResponse) -> Option<Waker> {
        match std::mem::replace(self, Inbox::Done(outcome)) {
            Inbox::Single { waiter, .. } => waiter,
            _ => None,
        }
    }
}

pub(super) fn split_id(id: u64) -> (usize, u32) {
    ((id & 0xFFFF_FFFF) as usize, (id >> 32) as u32)
}

impl ClientConn {
    pub(super) fn start(
        connection: Connection,
        config: &ChannelConfig,
        counters: &'static ConnectionCounters,
    ) -> Arc<ClientConn> {
        // Counted open while its reader runs: the connection ends with it.
        let open = counters.opened();
        let conn = Arc::new(ClientConn {
            sink: counters.count_stalls(connection.sink),
            peer: connection.peer,
            max_message_size: config.max_message_size,
            calls: Mutex::new(CallTable {
                slots: Slab::new(),
                generation: 0,
                phase: Phase::Open,
            }),
        });
        let reader = Arc::clone(&conn).read_loop(connection.source, config.keepalive);
        tokio::spawn(async move {
            let _open = open;
            reader.await;
        });
        conn
    }

    pub(super) fn table(&self) -> std::sync::MutexGuard<'_, CallTable> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Calls open on this connection (what least-outstanding balancing compares).
    pub(super) fn open_calls(&self) -> usize {
        self.table().slots.len()
    }

    pub(super) fn accepts_calls(&self) -> bool {
        matches!(self.table().phase, Phase::Open)
    }

    /// Registers a call; a connection that takes no more calls (draining or
    /// closed) hands the inbox back with the reason, for the call to go elsewhere.
    pub(super) fn open_call(
        &self,
        window: Option<Arc<SendWindow>>,
        inbox: Inbox,
    ) -> Result<u64, (Status, Inbox)> {
        let mut table = self.table();
        match &table.phase {
            Phase::Open => {}
            Phase::Draining => {
                let status = Status::unavailable(format!("{} is shutting down", self.peer));
                return Err((status, inbox));
            }
            Phase::Closed(status) => return Err((status.clone(), inbox)),
        }
        table.generation = table.generation.wrapping_add(1);
        let generation = table.generation;
        let key = table.slots.insert(CallSlot {
            generation,
            inbox,
            window,
            received: 0,
        });
        Ok((generation as u64) << 32 | key as u64)
    }

    /// Ends call `id` with `status` (after `message`, the last response
    /// message, if any), if it was still open: a stream's slot goes, a single
    /// response's outcome stays for its caller. Returns whether it was open.
    fn end_call(&self, id: u64, message: Option<Bytes>, status: Status) -> bool {
        let (key, generation) = split_id(id);
        let mut table = self.table();
        let Some(slot) = table
            .slots
            .get_mut(key)
            .filter(|s| s.generation == generation && s.inbox.is_open())
        else {
            return false;
        };
        if let Some(window) = &slot.window {
            window.close();
        }
        if let Inbox::Stream(_) = slot.inbox {
            let mut slot = table.slots.remove(key);
            drop(table);
            if let Some(payload) = message {
                let _ = slot.inbox.message(payload);
            }
            let _ = slot.inbox.finish(status);
            return true;
        }
        let mut waker = message.and_then(|payload| slot.inbox.message(payload));
        waker = waker.or(slot.inbox.finish(status));
        drop(table);
        if let Some(waker) = waker {
            waker.wake();
        }
        true
    }

    /// A single response's outcome, once it is in; the slot goes with it.
    pub(super) fn poll_single(&self, id: u64, cx: &mut Context<'_>) -> Poll<SingleResponse> {
        let (key, generation) = split_id(id);
        let mut table = self.table();
        let Some(slot) = table
            .slots
            .get_mut(key)
            .filter(|s| s.generation == generation)
        else {
            return Poll::Ready(Err(Status::internal("call ended without a status")));
        };
        match &mut slot.inbox {
            Inbox::Single { waiter, .. } => {
                if !waiter.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *waiter = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            Inbox::Done(_) => match table.slots.remove(key).inbox {
                Inbox::Done(outcome) => Poll::Ready(outcome),
                _ => unreachable!("matched Done above"),
            },
            Inbox::Stream(_) => Poll::Ready(Err(Status::internal(
                "a streaming call has no single response",
            ))),
        }
    }

    /// Ends call `id` locally with `status` and tells the server, if it was still open.
    pub(super) fn fail_call(&self, id: u64, status: Status) {
        if self.end_call(id, None, status) {
            self.send_cancel(id);
        }
    }

    /// Forgets call `id` (its caller went away) and tells the server, if it was still open.
    pub(super) fn cancel(&self, id: u64) {
        let (key, generation) = split_id(id);
        let slot = {
            let mut table = self.table();
            match table.slots.get(key) {
                Some(slot) if slot.generation == generation => table.slots.remove(key),
                _ => return,
            }
        };
        if let Some(window) = &slot.window {
            window.close();
        }
        if slot.inbox.is_open() {
            self.send_cancel(id);
        }
    }

    pub(super) fn send_cancel(&self, id: u64) {
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
    /// (Single responses' outcomes stay for their callers to take.)
    pub(super) fn fail_all(&self, status: Status) {
        let mut streams = Vec::new();
        let mut wakers = Vec::new();
        {
            let mut table = self.table();
            table.phase = Phase::Closed(status.clone());
            table.slots.retain(|_, slot| {
                if let Some(window) = &slot.window {
                    window.close();
                }
                match &mut slot.inbox {
                    Inbox::Stream(tx) => {
                        streams.push(tx.clone());
                        false
                    }
                    inbox => {
                        wakers.extend(inbox.finish(status.clone()));
                        true
                    }
                }
            });
        }
        for tx in streams {
            let _ = tx.send(Inbound::Status(status.clone()));
        }
        for waker in wakers {
            waker.wake();
        }
    }

    pub(super) async fn read_loop(
        self: Arc<Self>,
        mut source: Box<dyn FrameSource>,
        keepalive: Option<Keepalive>,
    ) {
        let mut timer = KeepaliveTimer::new(keepalive);
        let mut received = 0u64;
        let reason = loop {
            tokio::select! {
                // In this order: frames first, no random draw per wait.
                biased;
                result = source.recv() => {
                    received += 1;
                    if let Some(reason) = self.handle(result) {
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
    pub(super) fn handle(&self, received: Result<Option<Bytes>, TransportError>) -> Option<Status> {
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

    pub(super) fn dispatch(&self, frame: Frame) -> Result<(), String> {
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
                self.end_call(id, frame.payload, status);
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
    pub(super) fn refuse_oversized(&self, id: u64, len: usize) {
        let status = Status::resource_exhausted(format!(
            "response message of {len} bytes is larger than the maximum message size of {} bytes",
            self.max_message_size
        ));
        self.fail_call(id, status);
    }

    pub(super) fn deliver(&self, id: u64, payload: Bytes) {
        if payload.len() > self.max_message_size {
            return self.refuse_oversized(id, payload.len());
        }
        let (key, generation) = split_id(id);
        let mut table = self.table();
        let Some(slot) = table
            .slots
            .get_mut(key)
            .filter(|s| s.generation == generation)
        else {
            return; // the call already ended: its late messages are dropped
        };
        // As on the server: the server may start a message while the window
        // the client granted is positive; one that starts beyond it ignores
        // flow control and would make the call's queue grow without bound.
        if let (Inbox::Stream(_), Some(window)) = (&slot.inbox, &slot.window) {
            let granted = window.granted_to_peer();
            if slot.received >= granted {
                let received = slot.received;
                drop(table);
                let status = Status::resource_exhausted(format!(
                    "{} sent {received} bytes on the response stream and more, beyond the \
                     {granted}-byte window the client granted (flow control ignored)",
                    self.peer
                ));
                return self.fail_call(id, status);
            }
            slot.received += payload.len() as u64;
        }
        if let Some(waker) = slot.inbox.message(payload) {
            drop(table);
            waker.wake();
        }
    }
}
