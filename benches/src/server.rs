//! The echo servers, one per [`System`]: each binds, reports its address and serves.

use std::future::Future;
use std::pin::Pin;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use transport_rdma::RdmaTransport;

use crate::{rdma_stream, rpcbench, tcp_authority, tonicbench, Error, System, MAX_MESSAGE_SIZE};

/// A server's serve loop, to spawn or await; it runs until the process ends.
pub type Serving = Pin<Box<dyn Future<Output = Result<(), Error>> + Send>>;

/// Binds `system`'s echo server on `address` (`tcp://127.0.0.1:0` picks a
/// port) and returns the address it got, as a URL, and its serve loop.
/// [`System::TonicRdma`] listens with `transport_rdma`'s default settings
/// (see [`start_with`]).
pub async fn start(system: System, address: &str) -> Result<(String, Serving), Error> {
    start_with(system, address, &RdmaTransport::default(), None, None).await
}

/// [`start`], with the settings [`System::TonicRdma`]'s listener uses
/// (completion polling: [`RdmaTransport::busy_poll`]) and, for both tonic
/// systems, the largest HTTP/2 frame to accept (`None`: h2's default,
/// 16 KiB), and for [`System::Rpc`] the threads to serve connections on
/// (`ServerBuilder::thread_per_core`; `None`: the runtime's).
pub async fn start_with(
    system: System,
    address: &str,
    rdma: &RdmaTransport,
    http2_max_frame: Option<u32>,
    thread_per_core: Option<usize>,
) -> Result<(String, Serving), Error> {
    match system {
        System::Rpc => {
            let mut builder = rpc_core::Server::builder()
                .max_message_size(MAX_MESSAGE_SIZE)
                .add_service(rpcbench::bench_server::BenchServer::new(RpcEcho));
            if let Some(threads) = thread_per_core {
                builder = builder.thread_per_core(threads);
            }
            let server = builder.bind(address).await?;
            let local = server.local_addr().to_string();
            Ok((local, Box::pin(async move { Ok(server.serve().await?) })))
        }
        System::Tonic => {
            let listener = TcpListener::bind(tcp_authority(address)?).await?;
            let local = format!("tcp://{}", listener.local_addr()?);
            let service = tonicbench::bench_server::BenchServer::new(TonicEcho)
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE);
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            let serving = tonic::transport::Server::builder()
                .max_frame_size(http2_max_frame)
                .add_service(service)
                .serve_with_incoming(incoming);
            Ok((local, Box::pin(async move { Ok(serving.await?) })))
        }
        System::TonicRdma => {
            let listener = rdma.bind_stream(address).await?;
            let local = listener.local_addr().to_string();
            // Tuned as the TCP system is: the same message limits (there is
            // no Nagle to turn off: an idle stream's write leaves at once).
            let service = tonicbench::bench_server::BenchServer::new(TonicEcho)
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE);
            let serving = tonic::transport::Server::builder()
                .max_frame_size(http2_max_frame)
                .add_service(service)
                .serve_with_incoming(rdma_stream::incoming(listener));
            Ok((local, Box::pin(async move { Ok(serving.await?) })))
        }
        System::Raw => {
            let listener = TcpListener::bind(tcp_authority(address)?).await?;
            let local = format!("tcp://{}", listener.local_addr()?);
            Ok((local, Box::pin(raw_serve(listener))))
        }
    }
}

/// rdma-rpc's echo: the reply is the request's payload (`Bytes`, no copy);
/// `Sink` replies with an empty payload.
#[derive(Debug, Clone, Copy)]
pub struct RpcEcho;

impl rpcbench::bench_server::Bench for RpcEcho {
    async fn echo(
        &self,
        request: rpc_core::Request<rpcbench::Payload>,
    ) -> Result<rpc_core::Response<rpcbench::Payload>, rpc_core::Status> {
        Ok(rpc_core::Response::new(request.into_inner()))
    }

    async fn sink(
        &self,
        _request: rpc_core::Request<rpcbench::Payload>,
    ) -> Result<rpc_core::Response<rpcbench::Payload>, rpc_core::Status> {
        Ok(rpc_core::Response::new(rpcbench::Payload::default()))
    }
}

/// tonic's echo: the reply is the request's payload (`Bytes`, no copy);
/// `Sink` replies with an empty payload.
#[derive(Debug, Clone, Copy)]
pub struct TonicEcho;

#[tonic::async_trait]
impl tonicbench::bench_server::Bench for TonicEcho {
    async fn echo(
        &self,
        request: tonic::Request<tonicbench::Payload>,
    ) -> Result<tonic::Response<tonicbench::Payload>, tonic::Status> {
        Ok(tonic::Response::new(request.into_inner()))
    }

    async fn sink(
        &self,
        _request: tonic::Request<tonicbench::Payload>,
    ) -> Result<tonic::Response<tonicbench::Payload>, tonic::Status> {
        Ok(tonic::Response::new(tonicbench::Payload::default()))
    }
}

async fn raw_serve(listener: TcpListener) -> Result<(), Error> {
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            // A client that goes away simply ends its connection.
            let _ = raw_echo(stream).await;
        });
    }
}

/// Reads length-prefixed frames (4-byte little-endian length) and writes
/// each one back whole, in arrival order: the replies to every complete
/// frame already read go out in one `write_all`, made when no complete
/// frame is left in the read buffer (one call at a time: a write per reply;
/// pipelined: a write per batch, as a tuned server does).
async fn raw_echo(stream: TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::with_capacity(64 * 1024, read);
    let mut replies = BytesMut::new();
    loop {
        let len = match read.read_u32_le().await {
            Ok(len) => len as usize,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        replies.extend_from_slice(&(len as u32).to_le_bytes());
        crate::read_body(&mut read, len, &mut replies).await?;
        if !holds_a_frame(read.buffer()) {
            write.write_all(&replies).await?;
            replies.clear();
        }
    }
}

/// Whether `buffered` starts with a whole length-prefixed frame.
fn holds_a_frame(buffered: &[u8]) -> bool {
    match buffered.first_chunk::<4>() {
        Some(prefix) => buffered.len() >= 4 + u32::from_le_bytes(*prefix) as usize,
        None => false,
    }
}
