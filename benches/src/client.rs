//! Clients of the echo servers in [`crate::server`], one per [`System`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use transport_rdma::RdmaTransport;

use crate::{
    rdma_stream, rpcbench, tcp_authority, tonicbench, Call, Error, System, MAX_MESSAGE_SIZE,
};

/// A connected client of one system's echo server. Cloning shares the
/// connection (rdma-rpc's `Channel`, tonic's `Channel`); the raw system
/// opens a connection per measurement instead.
#[derive(Clone, Debug)]
pub enum Client {
    /// rdma-rpc's generated client on one channel.
    Rpc(rpcbench::bench_client::BenchClient),
    /// tonic's generated client on one HTTP/2 connection (over TCP, or
    /// an `RdmaStream` for [`System::TonicRdma`]).
    Tonic(tonicbench::bench_client::BenchClient<tonic::transport::Channel>),
    /// The server's `host:port`: raw connections are opened as needed.
    Raw(String),
}

/// Connects to `system`'s echo server at `address` (a URL: `tcp://host:port`,
/// or `rdma://IP:PORT` for rdma-rpc and [`System::TonicRdma`], which
/// connects with `transport_rdma`'s default settings: see [`connect_with`]).
pub async fn connect(system: System, address: &str) -> Result<Client, Error> {
    connect_with(system, address, &RdmaTransport::default(), None).await
}

/// [`connect`], with the settings [`System::TonicRdma`]'s stream uses.
pub async fn connect_with(
    system: System,
    address: &str,
    rdma: &RdmaTransport,
    http2_max_frame: Option<u32>,
) -> Result<Client, Error> {
    Ok(match system {
        System::Rpc => {
            let channel = rpc_core::Endpoint::new(address)?
                .max_message_size(MAX_MESSAGE_SIZE)
                .connect()
                .await?;
            Client::Rpc(rpcbench::bench_client::BenchClient::new(channel))
        }
        System::Tonic => {
            let uri = format!("http://{}", tcp_authority(address)?);
            let channel = tonic::transport::Endpoint::from_shared(uri)?
                .tcp_nodelay(true)
                .max_frame_size(http2_max_frame)
                .connect()
                .await?;
            Client::Tonic(
                tonicbench::bench_client::BenchClient::new(channel)
                    .max_decoding_message_size(MAX_MESSAGE_SIZE)
                    .max_encoding_message_size(MAX_MESSAGE_SIZE),
            )
        }
        System::TonicRdma => {
            let channel =
                rdma_stream::tonic_channel(rdma.clone(), address, http2_max_frame).await?;
            Client::Tonic(
                tonicbench::bench_client::BenchClient::new(channel)
                    .max_decoding_message_size(MAX_MESSAGE_SIZE)
                    .max_encoding_message_size(MAX_MESSAGE_SIZE),
            )
        }
        System::Raw => Client::Raw(tcp_authority(address)?.to_string()),
    })
}

impl Client {
    /// Makes one echo call with `payload` and checks the reply's length.
    ///
    /// For [`Client::Raw`] use [`RawConnection`]: a raw call needs a connection of its own.
    pub async fn echo(&mut self, payload: &Bytes) -> Result<(), Error> {
        self.call(Call::Echo, payload).await
    }

    /// Makes one unary call of `call` with `payload` and checks the reply's
    /// length (the payload's for [`Call::Echo`], 0 for [`Call::Sink`]).
    ///
    /// For [`Client::Raw`] use [`RawConnection`]: a raw call needs a connection of its own.
    pub async fn call(&mut self, call: Call, payload: &Bytes) -> Result<(), Error> {
        let got = match (self, call) {
            (Client::Rpc(client), call) => {
                let request = rpcbench::Payload {
                    data: payload.clone(),
                };
                let reply = match call {
                    Call::Echo => client.echo(request).await?,
                    Call::Sink => client.sink(request).await?,
                };
                reply.into_inner().data.len()
            }
            (Client::Tonic(client), call) => {
                let request = tonicbench::Payload {
                    data: payload.clone(),
                };
                let reply = match call {
                    Call::Echo => client.echo(request).await?,
                    Call::Sink => client.sink(request).await?,
                };
                reply.into_inner().data.len()
            }
            (Client::Raw(_), _) => return Err("raw calls go through RawConnection".into()),
        };
        let want = match call {
            Call::Echo => payload.len(),
            Call::Sink => 0,
        };
        check_len(got, want)
    }
}

fn check_len(got: usize, want: usize) -> Result<(), Error> {
    if got == want {
        Ok(())
    } else {
        Err(format!("reply of {got} bytes to a request of {want}").into())
    }
}

/// One raw TCP connection to the raw echo server: length-prefixed frames
/// built once; one `write_all` per call at a time, one per batch pipelined.
#[derive(Debug)]
pub struct RawConnection {
    read: BufReader<OwnedReadHalf>,
    write: OwnedWriteHalf,
    /// The whole frame to send: 4-byte little-endian length, then the payload.
    frame: Bytes,
    reply: BytesMut,
}

impl RawConnection {
    /// Connects to the raw echo server at `authority` (`host:port`), to send
    /// `payload_len`-byte payloads.
    pub async fn connect(authority: &str, payload_len: usize) -> Result<RawConnection, Error> {
        let stream = TcpStream::connect(authority).await?;
        stream.set_nodelay(true)?;
        let (read, write) = stream.into_split();
        Ok(RawConnection {
            read: BufReader::with_capacity(64 * 1024, read),
            write,
            frame: raw_frame(payload_len)?,
            reply: BytesMut::new(),
        })
    }

    /// One round trip: sends the frame, waits for it to come back whole.
    pub async fn ping(&mut self) -> Result<(), Error> {
        self.write.write_all(&self.frame).await?;
        let len = read_raw_frame(&mut self.read, &mut self.reply).await?;
        check_len(len + 4, self.frame.len())
    }

    /// Keeps up to `concurrency` frames in flight (a writer and a reader,
    /// no per-call bookkeeping) until `count_until`, then drains what is in
    /// flight. Returns the number of echoes that arrived at or after
    /// `count_from` and before `count_until`.
    pub async fn pipeline(
        self,
        concurrency: usize,
        count_from: Instant,
        count_until: Instant,
    ) -> Result<u64, Error> {
        let RawConnection {
            mut read,
            mut write,
            frame,
            mut reply,
        } = self;
        let window = Arc::new(Semaphore::new(concurrency));
        // How many frames the writer sends in all: known before it sends the
        // last one, so the reader can never miss it.
        let total = Arc::new(AtomicU64::new(u64::MAX));
        // The writer batches: every frame the window allows now goes out
        // in one `write_all` (a write per frame would make this no floor).
        let writer = {
            let (window, total) = (window.clone(), total.clone());
            tokio::spawn(async move {
                let mut sent = 0u64;
                let mut batch = BytesMut::new();
                loop {
                    window.acquire().await?.forget();
                    let mut room = 1;
                    while let Ok(permit) = window.try_acquire() {
                        permit.forget();
                        room += 1;
                    }
                    batch.clear();
                    let mut last = false;
                    for _ in 0..room {
                        sent += 1;
                        batch.extend_from_slice(&frame);
                        if Instant::now() >= count_until {
                            last = true;
                            total.store(sent, Ordering::Release);
                            break;
                        }
                    }
                    write.write_all(&batch).await?;
                    if last {
                        return Ok::<_, Error>(());
                    }
                }
            })
        };
        let mut received = 0u64;
        let mut counted = 0u64;
        while received != total.load(Ordering::Acquire) {
            read_raw_frame(&mut read, &mut reply).await?;
            received += 1;
            window.add_permits(1);
            let now = Instant::now();
            if now >= count_from && now < count_until {
                counted += 1;
            }
        }
        writer.await??;
        Ok(counted)
    }
}

/// A raw frame: the 4-byte little-endian length of a `payload_len`-byte payload, then it.
pub fn raw_frame(payload_len: usize) -> Result<Bytes, Error> {
    let prefix = u32::try_from(payload_len)?.to_le_bytes();
    let mut frame = BytesMut::with_capacity(4 + payload_len);
    frame.extend_from_slice(&prefix);
    frame.resize(4 + payload_len, 0xab);
    Ok(frame.freeze())
}

/// Reads one length-prefixed frame into `buf`; returns the payload's length.
async fn read_raw_frame(
    read: &mut BufReader<OwnedReadHalf>,
    buf: &mut BytesMut,
) -> Result<usize, Error> {
    let len = read.read_u32_le().await? as usize;
    buf.clear();
    crate::read_body(read, len, buf).await?;
    Ok(len)
}
