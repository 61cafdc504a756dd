//! A tonic service over RDMA: tonic's own server, client and generated
//! code, carried by [`RdmaStream`]s instead of TCP sockets (the
//! `tonic-rdma` program; `tests/tonic_over_rdma.rs` runs it on a device).
//!
//! Nothing of the service changes: the [`Greetings`] below is plain tonic
//! code, and [`helloworld`] is what `tonic-prost-build` generates from
//! `proto/helloworld.proto`. What changes is how connections are made:
//!
//! - the server ([`serve`]): `Server::builder().add_service(..)` then
//!   `.serve_with_incoming_shutdown(..)` on an [`RdmaListener`]'s
//!   connections ([`incoming`], each a [`TonicRdmaStream`]) instead of
//!   `.serve(addr)`;
//! - the client: `Endpoint::connect_with_connector` with a connector that
//!   opens an [`RdmaStream`] ([`connect`]) instead of `Endpoint::connect`.
//!
//! tonic runs HTTP/2 over the stream as it would over TCP: each write
//! hyper makes becomes one RDMA message (a SEND, or an RDMA WRITE into the
//! peer's region when large), and reads copy out of the registered receive
//! buffers.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status, Streaming};
use transport_rdma::{RdmaListener, RdmaStream};

use helloworld::greeter_client::GreeterClient;
use helloworld::greeter_server::{Greeter, GreeterServer};
use helloworld::{HelloReply, HelloRequest};

/// The greeter as tonic generates it, from the same `proto/helloworld.proto`
/// as [`crate::helloworld`].
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod helloworld {
    include!(concat!(env!("OUT_DIR"), "/tonic/helloworld.rs"));
}

/// The most replies one `LotsOfReplies` call may ask for.
pub const MAX_REPLIES: u32 = 1000;

/// The greeter service, written for tonic as it would be for TCP.
#[derive(Debug, Default)]
pub struct Greetings;

fn greet(name: &str) -> HelloReply {
    HelloReply {
        message: format!("Hello, {name}!"),
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<HelloReply, Status>> + Send>>;

#[tonic::async_trait]
impl Greeter for Greetings {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        Ok(Response::new(greet(&request.get_ref().name)))
    }

    type LotsOfRepliesStream = ReplyStream;

    async fn lots_of_replies(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<ReplyStream>, Status> {
        let HelloRequest { name, count } = request.into_inner();
        if count > MAX_REPLIES {
            return Err(Status::invalid_argument(format!(
                "count {count} is over {MAX_REPLIES}"
            )));
        }
        let replies = futures::stream::iter(1..=count).map(move |i| {
            Ok(HelloReply {
                message: format!("Hello #{i}, {name}!"),
            })
        });
        Ok(Response::new(Box::pin(replies)))
    }

    async fn greet_everyone(
        &self,
        request: Request<Streaming<HelloRequest>>,
    ) -> Result<Response<HelloReply>, Status> {
        let mut names = Vec::new();
        let mut requests = request.into_inner();
        while let Some(request) = requests.message().await? {
            names.push(request.name);
        }
        Ok(Response::new(greet(&names.join(", "))))
    }

    type ChatStream = ReplyStream;

    async fn chat(
        &self,
        request: Request<Streaming<HelloRequest>>,
    ) -> Result<Response<ReplyStream>, Status> {
        let replies = request
            .into_inner()
            .map(|request| request.map(|r| greet(&r.name)));
        Ok(Response::new(Box::pin(replies)))
    }
}

/// An [`RdmaStream`] as tonic's server takes it: tonic asks its connections
/// for [`Connected`], a tonic trait the stream's crate does not implement.
/// Reads and writes go straight to the stream.
#[derive(Debug)]
pub struct TonicRdmaStream(pub RdmaStream);

/// What a handler learns of its connection, from its request's extensions
/// (`request.extensions().get::<RdmaConnectInfo>()`). tonic's
/// `Request::remote_addr` looks for TCP's and gives `None` here.
#[derive(Debug, Clone)]
pub struct RdmaConnectInfo {
    /// The client's address, `rdma://IP:PORT`.
    pub peer_addr: String,
    /// Who the client proved to be (`"rdma-secret"` when the listener has a
    /// shared secret: `RdmaTransport::auth_secret`), else `None`.
    pub identity: Option<String>,
}

impl Connected for TonicRdmaStream {
    type ConnectInfo = RdmaConnectInfo;

    fn connect_info(&self) -> RdmaConnectInfo {
        RdmaConnectInfo {
            peer_addr: self.0.peer_addr().to_string(),
            identity: self.0.peer_identity().map(str::to_string),
        }
    }
}

impl AsyncRead for TonicRdmaStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TonicRdmaStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// The listener's connections as tonic's `serve_with_incoming` takes them.
///
/// An error from the listener is final (it is the listener failing: a
/// client whose set-up fails is skipped, not returned), and tonic goes on
/// polling past errors, so the stream ends after it instead; the error is
/// kept in `failure` for the caller to report.
pub fn incoming(
    listener: RdmaListener,
    failure: Arc<Mutex<Option<io::Error>>>,
) -> impl Stream<Item = io::Result<TonicRdmaStream>> {
    futures::stream::unfold(Some(listener), move |listener| {
        let failure = Arc::clone(&failure);
        async move {
            let mut listener = listener?;
            match listener.accept().await {
                Ok((stream, peer)) => {
                    tracing::debug!("tonic-rdma: accepted {peer}");
                    Some((Ok(TonicRdmaStream(stream)), Some(listener)))
                }
                Err(e) => {
                    tracing::error!("tonic-rdma: the listener failed: {e}");
                    let copy = io::Error::new(e.kind(), e.to_string());
                    *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    Some((Err(copy), None))
                }
            }
        }
    })
}

/// Why [`serve`] stopped early.
pub type ServeError = Box<dyn std::error::Error + Send + Sync>;

/// Serves [`Greetings`] with tonic on `listener`'s connections until
/// `shutdown` completes, then drains the calls in flight. Fails if the
/// listener fails.
pub async fn serve(
    listener: RdmaListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let failure = Arc::new(Mutex::new(None));
    Server::builder()
        .add_service(GreeterServer::new(Greetings))
        .serve_with_incoming_shutdown(incoming(listener, Arc::clone(&failure)), shutdown)
        .await?;
    let failed = failure.lock().unwrap_or_else(|p| p.into_inner()).take();
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// A tonic client of the greeter at `addr` (`rdma://IP:PORT`), over one
/// HTTP/2 connection on an [`RdmaStream`] (made again if it breaks).
pub async fn connect(addr: &str) -> Result<GreeterClient<Channel>, tonic::transport::Error> {
    let addr = addr.to_string();
    // The URI is only HTTP's `:authority`: the connector decides where to go.
    let channel = Endpoint::from_static("http://rdma.invalid")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let addr = addr.clone();
            async move { Ok::<_, io::Error>(TokioIo::new(RdmaStream::connect(&addr).await?)) }
        }))
        .await?;
    Ok(GreeterClient::new(channel))
}
