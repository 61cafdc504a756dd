//! Byte streams over RDMA under benchmark: tonic carried by
//! [`RdmaStream`]s ([`System::TonicRdma`](crate::System::TonicRdma)), and a
//! one-way bulk copy ([`sink`], [`send`]) to hold against `ib_write_bw`.
//!
//! The bulk copy: the sender writes `total` bytes in writes of one size
//! (`write_all`, each write at most half the peer's region as one RDMA
//! message), half-closes, then waits for the sink's count of the bytes it
//! read (8 bytes, little-endian). A count that differs fails the run, so a
//! short transfer cannot pass for a fast one. The time runs from the first
//! write to the count's arrival.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tonic::transport::server::Connected;
use transport_rdma::{RdmaListener, RdmaStream, RdmaTransport};

use crate::Error;

/// An [`RdmaStream`] as tonic takes it: tonic's server asks its
/// connections for [`Connected`], which the stream's crate does not
/// implement. Reads and writes go straight to the stream; writes are
/// counted ([`writes`]).
#[derive(Debug)]
pub struct TonicRdmaStream(pub RdmaStream);

static WRITES: AtomicU64 = AtomicU64::new(0);
static WRITTEN: AtomicU64 = AtomicU64::new(0);

/// Writes (each one RDMA message) and bytes written by every
/// [`TonicRdmaStream`] of this process so far: what hyper's HTTP/2 makes
/// of the calls.
pub fn writes() -> (u64, u64) {
    (
        WRITES.load(Ordering::Relaxed),
        WRITTEN.load(Ordering::Relaxed),
    )
}

fn count(written: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
    let n = ready!(written)?;
    WRITES.fetch_add(1, Ordering::Relaxed);
    WRITTEN.fetch_add(n as u64, Ordering::Relaxed);
    Poll::Ready(Ok(n))
}

impl Connected for TonicRdmaStream {
    type ConnectInfo = ();

    fn connect_info(&self) {}
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
        count(Pin::new(&mut self.get_mut().0).poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        count(Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs))
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

/// The listener's streams as tonic's `serve_with_incoming` takes them.
pub fn incoming(
    listener: RdmaListener,
) -> impl futures::Stream<Item = io::Result<TonicRdmaStream>> {
    listener.map(|accepted| accepted.map(TonicRdmaStream))
}

/// A tonic channel whose one HTTP/2 connection is an [`RdmaStream`] to
/// `address` (`rdma://IP:PORT`), made with `transport`'s settings,
/// accepting HTTP/2 frames up to `max_frame_size` (`None`: 16 KiB).
pub async fn tonic_channel(
    transport: RdmaTransport,
    address: &str,
    max_frame_size: Option<u32>,
) -> Result<tonic::transport::Channel, Error> {
    let address = address.to_string();
    // The URI is only HTTP's `:authority`: the connector decides where to go.
    let channel = tonic::transport::Endpoint::from_static("http://rdma.invalid")
        .max_frame_size(max_frame_size)
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let (transport, address) = (transport.clone(), address.clone());
            async move {
                let stream = transport.connect_stream(&address).await?;
                Ok::<_, io::Error>(TokioIo::new(TonicRdmaStream(stream)))
            }
        }))
        .await?;
    Ok(channel)
}

/// Accepts streams on `listener` until it fails; reads each to its end
/// with [`RdmaStream::recv_bytes`] (no copy), dropping the bytes, then
/// answers with the count read (8 bytes, little-endian) and closes.
pub async fn sink(mut listener: RdmaListener) -> Result<(), Error> {
    loop {
        let (mut stream, _peer) = listener.accept().await?;
        tokio::spawn(async move {
            let mut count = 0u64;
            let answered = async {
                while let Some(bytes) = stream.recv_bytes().await? {
                    count += bytes.len() as u64;
                }
                stream.write_all(&count.to_le_bytes()).await?;
                stream.shutdown().await
            };
            if let Err(e) = answered.await {
                eprintln!("bench-node stream-sink: a stream failed after {count} bytes: {e}");
            }
        });
    }
}

/// One bulk copy's outcome.
#[derive(Clone, Copy, Debug)]
pub struct BulkCopy {
    /// Bytes sent, and confirmed by the sink.
    pub bytes: u64,
    /// From the first write to the sink's count.
    pub elapsed: Duration,
}

impl BulkCopy {
    /// Bytes per second.
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64()
    }
}

/// Connects a stream to the sink at `address` and copies `total` bytes
/// one way in writes of `write_len` bytes (the last one shorter if
/// `total` is not a multiple); fails unless the sink counts them all.
pub async fn send(
    transport: &RdmaTransport,
    address: &str,
    write_len: usize,
    total: u64,
) -> Result<BulkCopy, Error> {
    if write_len == 0 {
        return Err("a bulk copy needs writes of at least one byte".into());
    }
    let mut stream = transport.connect_stream(address).await?;
    let data = crate::measure::payload(write_len);
    let started = Instant::now();
    let mut left = total;
    while left > 0 {
        let n = left.min(write_len as u64) as usize;
        stream.write_all(&data[..n]).await?;
        left -= n as u64;
    }
    stream.shutdown().await?;
    let mut count = [0u8; 8];
    stream.read_exact(&mut count).await?;
    let elapsed = started.elapsed();
    let count = u64::from_le_bytes(count);
    if count != total {
        return Err(format!("the sink read {count} bytes of the {total} sent").into());
    }
    Ok(BulkCopy {
        bytes: total,
        elapsed,
    })
}
