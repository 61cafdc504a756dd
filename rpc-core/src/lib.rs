//! The runtime of rdma-rpc: typed RPC over pluggable, message-oriented transports.
//!
//! Generated code (from `rpc-codegen`) sits on top of this crate; a transport
//! (`transport-tcp`, `transport-rdma`, or the built-in `mem://`) sits below.
//! The same client and server code runs over any of them: the address picks.
//!
//! # Quick start
//!
//! Most programs use generated stubs (see `rpc-codegen`). Underneath, a
//! service is a [`codegen::Service`] and a call is a [`Client`] method; this
//! echo service runs over the in-process `mem://` transport:
//!
//! ```
//! use bytes::Bytes;
//! use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
//! use rpc_core::{BytesCodec, Channel, Client, Request, Response, Server};
//!
//! struct Echo;
//!
//! impl Service for Echo {
//!     fn name(&self) -> &'static str { "demo.Echo" }
//!     fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
//!         match method {
//!             "Say" => codegen::unary::<BytesCodec, _, _>(call, |request: Request<Bytes>| async move {
//!                 Ok(Response::new(request.into_inner()))
//!             }),
//!             _ => codegen::unimplemented(call),
//!         }
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = Server::builder().add_service(Echo).bind("mem://quick-start").await?;
//! tokio::spawn(server.serve());
//!
//! let client = Client::new(Channel::connect("mem://quick-start").await?);
//! let reply = client.unary::<BytesCodec>("/demo.Echo/Say", Request::new(Bytes::from("hi"))).await?;
//! assert_eq!(reply.into_inner(), "hi");
//! # Ok(()) }
//! ```
//!
//! # Features
//! - Unary, server-streaming, client-streaming and bidirectional calls, many
//!   at once over one connection ([`Channel`] is cheap to clone and share).
//! - Deadlines carried to the server and enforced on both sides; dropping a
//!   call's future cancels its handler; per-call [`MetadataMap`]; gRPC's
//!   [`Code`]s.
//! - Per-stream flow control: a slow reader holds back a fast writer.
//! - A maximum message size ([`DEFAULT_MAX_MESSAGE_SIZE`], 64 MiB + 64 KiB by
//!   default: a 64 MiB tensor field fits): larger messages fail with
//!   `ResourceExhausted` and the connection stays usable.
//! - Reconnection with backoff; graceful server shutdown that drains calls.
//! - For fan-out to many servers: [`Channel::balance`] over replicas
//!   (least outstanding calls, ejection of failed replicas, replicas marked
//!   not serving by a health check skipped: [`Channel::set_serving`]),
//!   [`fanout::FanOut`] (one deadline, partial results, quorum, fail limit),
//!   [`hedging::Hedging`] (backup requests under a budget),
//!   [`Request::set_deadline`] and [`Endpoint::wait_for_ready`].
//! - Keepalive pings on quiet connections: a peer that went silent (its host
//!   died, a link was cut) fails its connection's calls with `Unavailable`
//!   within 40 s by default, on every transport.
//! - A `tracing` span per call (`rpc.client`, `rpc.server`); W3C trace
//!   context (`traceparent`) carried across calls with
//!   [`trace::TracePropagation`], so a fan-out's calls share a trace.
//!
//! # Failures
//! A broken connection ends every call on it with `Unavailable`; a handler
//! that panics ends its call with `Internal`; a peer that sends a malformed
//! frame is disconnected (logged as a protocol error), other connections are
//! untouched.
//!
//! # Thread safety
//! [`Channel`], [`Client`] and transports are `Send + Sync`; handlers run on
//! the tokio runtime, each call in a task of its own (a connection keeps a
//! few handler tasks for its next calls rather than spawning one a call).
//!
//! # Resource cleanup
//! Dropping the last clone of a [`Channel`] closes its connection once the
//! calls still running on it end. Dropping a server's `serve` future stops it
//! at once; `serve_with_shutdown` stops it gracefully.

pub mod codec;
pub mod codegen;
pub mod fanout;
pub mod frame;
pub mod hedging;
pub mod intercept;
pub mod kept;
pub mod metadata;
pub mod trace;
pub mod transport;

mod client;
mod flow;
mod gate;
mod keepalive;
mod message;
mod payload;
mod server;
mod status;
mod timeout;

pub use client::{
    AddressError, Balance, Channel, Client, ConnectError, Endpoint, DEFAULT_MAX_MESSAGE_SIZE,
    MAX_MESSAGE_SIZE_LIMIT,
};
pub use codec::{BytesCodec, Codec, ProstCodec};
pub use flow::DEFAULT_STREAM_WINDOW;
pub use message::{IntoRequest, IntoStreamingRequest, Request, Response, Streaming};
pub use metadata::MetadataMap;
pub use payload::{PayloadBuffer, PayloadMemory};
pub use server::{BoundServer, ServeError, Server, ServerBuilder, DEFAULT_MAX_CONCURRENT_CALLS};
pub use status::{Code, Status};

/// Includes the code `rpc-codegen` generated for a protobuf package.
///
/// ```ignore
/// pub mod helloworld {
///     rpc_core::include_proto!("helloworld");
/// }
/// ```
#[macro_export]
macro_rules! include_proto {
    ($package:tt) => {
        include!(concat!(env!("OUT_DIR"), "/", $package, ".rs"));
    };
}
