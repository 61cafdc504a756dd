//! What a handler sees of its call ([`ServerCall`]), and the adapters
//! generated code runs each kind of handler with.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::codec::{Codec, Encodable};
use crate::flow::SendWindow;
use crate::frame::{EncodePayload, OutBody, OutFrame};
use crate::intercept::Extensions;
use crate::message::{Inbound, Received, RecvWindow, Request, Response, Streaming, StreamingParts};
use crate::metadata::MetadataMap;
use crate::status::{Code, Status};
use crate::transport::BoxFuture;

use super::connection::ServerConn;

/// One call as a handler helper sees it: the request side, and where the
/// responses and final status go. Generated code passes it to [`unary`] and friends.
pub struct ServerCall {
    pub(super) conn: Arc<ServerConn>,
    pub(super) id: u64,
    pub(super) metadata: MetadataMap,
    pub(super) timeout: Option<Duration>,
    /// When the client's time runs out: arrival plus `timeout`.
    pub(super) deadline: Option<Instant>,
    /// What interceptors handed the handler.
    pub(super) extensions: Extensions,
    pub(super) first: Option<Bytes>,
    pub(super) inbound: Option<mpsc::UnboundedReceiver<Inbound>>,
    /// The call's window when the client sends a request stream; made on
    /// the first response of a stream otherwise (see `ServerConn::response_window`).
    pub(super) window: Option<Arc<SendWindow>>,
}

impl std::fmt::Debug for ServerCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerCall")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl ServerCall {
    /// The peer, extensions and time of the call, for its `Request`.
    fn received_options(&mut self) -> Received {
        Received {
            timeout: self.timeout,
            deadline: self.deadline,
            peer: Arc::clone(self.conn.peer_info()),
            extensions: std::mem::take(&mut self.extensions),
            connection: crate::message::CallConnection(Arc::clone(&self.conn.sink)),
        }
    }

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
        Ok(Request::received(
            C::decode(bytes)?,
            std::mem::take(&mut self.metadata),
            self.received_options(),
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
                self.window.clone(),
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
        Request::received(
            stream,
            std::mem::take(&mut self.metadata),
            self.received_options(),
        )
    }

    async fn finish_with_status(&self, status: Status) {
        self.conn.finish(self.id, &status, None).await;
    }

    async fn finish_with_message<C: Codec>(&self, response: Response<C::Encode>) {
        let (message, metadata) = response.into_parts();
        match Encodable::<C>::new(&message, self.conn.routes.max_message_size) {
            Ok(payload) => {
                let status = Status::from_parts(Code::Ok, String::new(), metadata);
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
        let mut window = self.window.clone();
        while let Some(item) = stream.next().await {
            let message = match item {
                Ok(message) => message,
                Err(status) => return self.finish_with_status(status).await,
            };
            let payload = match Encodable::<C>::new(&message, self.conn.routes.max_message_size) {
                Ok(payload) => payload,
                Err(status) => return self.finish_with_status(status).await,
            };
            if window.is_none() {
                window = self.conn.response_window(self.id);
            }
            let Some(window) = &window else {
                return; // cancelled: the call is over
            };
            if window.reserve(payload.payload_len()).await.is_err() {
                return; // cancelled
            }
            let frame = OutFrame::control(self.id, OutBody::Message, false).with_payload(&payload);
            if self.conn.sink.send(&frame).await.is_err() {
                return; // the connection is gone; its reader cleans up
            }
        }
        self.finish_with_status(Status::from_parts(Code::Ok, String::new(), metadata))
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
