//! Byte streams over RDMA: [`RdmaStream`] is a tokio
//! [`AsyncRead`] + [`AsyncWrite`], so code written for a `TcpStream`
//! (tonic, hyper, `tokio::io::copy`, a codec) runs over RDMA by changing
//! how the socket is made.
//!
//! ```no_run
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//! use transport_rdma::{RdmaListener, RdmaStream};
//!
//! # async fn run() -> std::io::Result<()> {
//! let mut listener = RdmaListener::bind("rdma://10.77.0.1:7000").await?;
//! tokio::spawn(async move {
//!     while let Ok((mut stream, _peer)) = listener.accept().await {
//!         tokio::spawn(async move {
//!             let (mut reader, mut writer) = stream.split();
//!             tokio::io::copy(&mut reader, &mut writer).await // an echo server
//!         });
//!     }
//! });
//!
//! let mut stream = RdmaStream::connect("rdma://10.77.0.1:7000").await?;
//! stream.write_all(b"hello").await?;
//! stream.shutdown().await?; // half-close: the server reads EOF, still writes
//! let mut echoed = Vec::new();
//! stream.read_to_end(&mut echoed).await?;
//! assert_eq!(echoed, b"hello");
//! # Ok(()) }
//! ```
//!
//! # How bytes travel
//! A stream is one RDMA connection of the transport ([`RdmaTransport`]
//! settings, the same rings, credits and region): each write becomes one
//! message, encoded straight into registered memory (the one copy an
//! `AsyncWrite` taking `&[u8]` allows). A write up to the peer's slot size
//! goes by SEND into a receive slot; a larger one by RDMA WRITE into the
//! peer's region, at most half the region per write (a longer write is
//! taken in part, as a socket does: `write_all` loops). Vectored writes
//! are gathered into one message (hyper writes that way). Small writes
//! are coalesced only when they could not go at once anyway: while the
//! peer has granted no credit, each one is appended to the message
//! already waiting, up to a slot, so a stream of tiny writes costs a
//! message per slot, not per write, and an idle stream's write leaves at
//! once (no Nagle delay). A write returns `Pending` while the peer has
//! granted no room, so a slow reader holds back a fast writer; nothing is
//! buffered without bound.
//!
//! Reads hand out received messages: [`RdmaStream::recv_bytes`] returns
//! each as [`Bytes`] without copying (pointing into its receive slot, which
//! is reposted when the last reference drops); `AsyncRead` copies into the
//! caller's buffer.
//!
//! # Ends
//! [`shutdown`](tokio::io::AsyncWriteExt::shutdown) half-closes: the peer
//! reads EOF after the last byte, and may still write back; it returns
//! once the peer's device has received everything (it waits while the
//! peer does not read). Dropping a stream closes both directions the same
//! way, in the background: what was written still goes out while the
//! runtime runs and the peer reads (it is given up on after 5 s without
//! progress). A program that drops its runtime right after writing
//! (a `#[tokio::main]` returning) shuts its streams down first: unlike a
//! socket's kernel buffer, nothing sends them once the runtime is gone.
//! [`RdmaStream::reset`] aborts instead (as a TCP reset): the peer's reads
//! and writes fail with `ConnectionReset`.
//!
//! A peer whose process dies, or whose device or port fails, ends reads
//! and writes with `ConnectionReset` naming the cause (the connection
//! manager reports the disconnect); a peer host that vanishes or whose
//! link is cut is noticed by the stream's keepalive
//! ([`RdmaTransport::stream_keepalive`], 10 s by default): the peer's
//! device does not acknowledge its probe.

use std::fmt;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use rpc_core::transport::{cooperatively, FrameLimits, FrameSource, TransportError};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::conn::{self, RdmaSink, RdmaSource};
use crate::{Accepting, RdmaTransport};

/// A byte stream over one RDMA connection (see the [module docs](self)).
pub struct RdmaStream {
    read: RdmaReadHalf,
    write: RdmaWriteHalf,
    identity: Option<&'static str>,
}

/// The reading half of an [`RdmaStream`] ([`RdmaStream::into_split`]).
pub struct RdmaReadHalf {
    source: RdmaSource,
    /// What is left of the last message, after a partial read.
    unread: Bytes,
    eof: bool,
    /// The error that ended the stream, returned by every later read.
    failed: Option<(io::ErrorKind, String)>,
}

/// The writing half of an [`RdmaStream`] ([`RdmaStream::into_split`]).
/// Dropping it half-closes the stream.
pub struct RdmaWriteHalf {
    sink: RdmaSink,
    /// The longest write sent as one message in place.
    max_write: usize,
    shut_down: bool,
}

impl RdmaStream {
    /// Connects to `addr` (`rdma://IP:PORT` or `IP:PORT`) with the default
    /// [`RdmaTransport`] settings.
    pub async fn connect(addr: &str) -> io::Result<RdmaStream> {
        RdmaTransport::default().connect_stream(addr).await
    }

    fn start(est: conn::Established, cfg: &RdmaTransport) -> Result<RdmaStream, TransportError> {
        // The peer sends no message longer than half our region (or one
        // slot): a longer one is a broken peer, and fails the stream.
        let limits = FrameLimits {
            max_frame_len: cfg.region_len.max(cfg.slot_size) as usize,
        };
        let identity = est.peer_identity();
        let (sink, source) = conn::start_halves(est, limits, cfg, cfg.stream_keepalive)?;
        Ok(RdmaStream {
            identity,
            read: RdmaReadHalf {
                source,
                unread: Bytes::new(),
                eof: false,
                failed: None,
            },
            write: RdmaWriteHalf {
                max_write: sink.max_unchunked(),
                sink,
                shut_down: false,
            },
        })
    }

    /// The peer's address, `rdma://IP:PORT`.
    pub fn peer_addr(&self) -> &str {
        self.write.peer_addr()
    }

    /// Who the peer proved to be: `Some("rdma-secret")` when this side has
    /// a shared secret ([`RdmaTransport::auth_secret`]) and the peer proved
    /// it; `None` otherwise.
    pub fn peer_identity(&self) -> Option<&str> {
        self.identity
    }

    /// The next bytes received, as they arrived, without copying them;
    /// `None` at EOF. Mixes freely with `AsyncRead` (what a partial read
    /// left comes first).
    pub async fn recv_bytes(&mut self) -> io::Result<Option<Bytes>> {
        self.read.recv_bytes().await
    }

    /// Aborts the stream (as a TCP reset): what was written and not yet
    /// sent is dropped, and the peer's reads and writes fail with
    /// `ConnectionReset` instead of reading EOF.
    pub fn reset(self) {
        self.write.sink.reset("the peer reset the stream");
    }

    /// Borrowed halves, to read and write from one task at once (as
    /// `TcpStream::split`).
    pub fn split(&mut self) -> (&mut RdmaReadHalf, &mut RdmaWriteHalf) {
        (&mut self.read, &mut self.write)
    }

    /// Owned halves, to read and write from separate tasks.
    pub fn into_split(self) -> (RdmaReadHalf, RdmaWriteHalf) {
        (self.read, self.write)
    }
}

impl RdmaReadHalf {
    /// See [`RdmaStream::recv_bytes`].
    pub async fn recv_bytes(&mut self) -> io::Result<Option<Bytes>> {
        std::future::poll_fn(|cx| self.poll_recv_bytes(cx)).await
    }

    /// See [`RdmaStream::recv_bytes`].
    pub fn poll_recv_bytes(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Bytes>>> {
        if !self.unread.is_empty() {
            return Poll::Ready(Ok(Some(std::mem::take(&mut self.unread))));
        }
        if self.eof {
            return Poll::Ready(Ok(None));
        }
        if let Some((kind, message)) = &self.failed {
            return Poll::Ready(Err(io::Error::new(*kind, message.clone())));
        }
        // Each message counts against the task's tokio budget, as a
        // socket read does: a reader of a peer as fast as itself still
        // lets its worker's other tasks run.
        cooperatively(cx, |cx| self.poll_source(cx))
    }

    /// The next non-empty message from the connection, or its end.
    fn poll_source(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Bytes>>> {
        loop {
            match ready!(self.source.poll_recv(cx)) {
                Ok(Some(bytes)) if bytes.is_empty() => continue,
                Ok(Some(bytes)) => return Poll::Ready(Ok(Some(bytes))),
                Ok(None) => {
                    self.eof = true;
                    return Poll::Ready(Ok(None));
                }
                Err(e) => {
                    // Not even a skipped oversized message is skipped: the
                    // bytes after it would not follow the bytes before.
                    let e = to_io_error(e);
                    self.failed = Some((e.kind(), e.to_string()));
                    return Poll::Ready(Err(e));
                }
            }
        }
    }
}

impl AsyncRead for RdmaReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let Some(mut bytes) = ready!(this.poll_recv_bytes(cx))? else {
            return Poll::Ready(Ok(()));
        };
        let n = bytes.len().min(buf.remaining());
        buf.put_slice(&bytes[..n]);
        this.unread = bytes.split_off(n);
        Poll::Ready(Ok(()))
    }
}

impl RdmaWriteHalf {
    /// The peer's address, `rdma://IP:PORT`.
    pub fn peer_addr(&self) -> &str {
        self.sink.peer()
    }

    /// Sends what `bufs` hold, up to one message's worth, as one message.
    fn poll_send<B: std::ops::Deref<Target = [u8]>>(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[B],
    ) -> Poll<io::Result<usize>> {
        if self.shut_down {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write on an RDMA stream after shutdown",
            )));
        }
        let len = bufs
            .iter()
            .map(|b| b.len())
            .sum::<usize>()
            .min(self.max_write);
        if len == 0 {
            return Poll::Ready(Ok(0));
        }
        // As a socket write does (see `poll_recv_bytes`).
        let sent = cooperatively(cx, |cx| {
            self.sink.poll_send_with(cx, len, None, None, |dst| {
                let mut left = len;
                for b in bufs {
                    let n = b.len().min(left);
                    dst.put_slice(&b[..n]);
                    left -= n;
                    if left == 0 {
                        break;
                    }
                }
            })
        });
        Poll::Ready(ready!(sent).map(|()| len).map_err(to_io_error))
    }
}

impl AsyncWrite for RdmaWriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_send(cx, &[buf])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_send(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Ready once every write is posted to the device (a write waiting
    /// for the peer's credits is not yet).
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.sink.poll_sent(cx, false).map_err(to_io_error)
    }

    /// Half-closes: the peer reads EOF after what was written. Ready once
    /// the peer's device has received every byte and the end, so a
    /// program may exit (or drop its runtime) right after.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.shut_down {
            use rpc_core::transport::FrameSink;
            this.sink.close();
            this.shut_down = true;
        }
        this.sink.poll_sent(cx, true).map_err(to_io_error)
    }
}

impl AsyncRead for RdmaStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().read).poll_read(cx, buf)
    }
}

impl AsyncWrite for RdmaStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().write).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().write).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().write).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().write).poll_shutdown(cx)
    }
}

impl fmt::Debug for RdmaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaStream")
            .field("peer", &self.peer_addr())
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RdmaReadHalf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaReadHalf")
            .field("eof", &self.eof)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RdmaWriteHalf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaWriteHalf")
            .field("peer", &self.peer_addr())
            .finish_non_exhaustive()
    }
}

/// Accepts [`RdmaStream`]s on an `rdma://` address.
pub struct RdmaListener {
    accepting: Accepting<RdmaStream>,
}

impl RdmaListener {
    /// Listens on `addr` (`rdma://IP:PORT` or `IP:PORT`, `[IPv6]:PORT` for
    /// IPv6; an address of the RDMA device's interface; port 0 picks one)
    /// with the default
    /// [`RdmaTransport`] settings. Needs a tokio runtime.
    pub async fn bind(addr: &str) -> io::Result<RdmaListener> {
        RdmaTransport::default().bind_stream(addr).await
    }

    /// The next stream and its peer's address. A client whose set-up fails
    /// is logged and skipped, not returned.
    pub async fn accept(&mut self) -> io::Result<(RdmaStream, String)> {
        let stream = std::future::poll_fn(|cx| self.poll_accept(cx)).await?;
        let peer = stream.peer_addr().to_string();
        Ok((stream, peer))
    }

    /// Polls for the next stream.
    pub fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<RdmaStream>> {
        self.accepting.poll_accept(cx).map_err(to_io_error)
    }

    /// The address bound, `rdma://IP:PORT` (with the port chosen for port 0).
    pub fn local_addr(&self) -> &str {
        &self.accepting.local
    }
}

/// The listener as a stream of accepted connections (for
/// `tonic::transport::Server::serve_with_incoming` and the like). A
/// listener that fails yields its error once, then ends (a consumer that
/// polls past errors, as tonic does, stops rather than spins).
impl futures_core::Stream for RdmaListener {
    type Item = io::Result<RdmaStream>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match ready!(self.get_mut().accepting.poll_accept(cx)) {
            Ok(stream) => Poll::Ready(Some(Ok(stream))),
            // The accept loop ended (after its error, if it had one).
            Err(TransportError::Closed) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(to_io_error(e)))),
        }
    }
}

impl fmt::Debug for RdmaListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaListener")
            .field("local", &self.accepting.local)
            .finish_non_exhaustive()
    }
}

impl RdmaTransport {
    /// Keepalive of byte streams (default: 10 s): after this long with
    /// nothing received or completed, the stream sends the peer a small
    /// control message; if the peer is gone (host down, link cut: nothing
    /// else would tell), its retries run out and reads and writes fail
    /// with `ConnectionReset`. `None`: an idle stream to a vanished peer
    /// waits forever, like a socket without keepalive. (RPC connections
    /// have rpc-core's own keepalive instead.)
    pub fn stream_keepalive(mut self, period: Option<Duration>) -> RdmaTransport {
        self.stream_keepalive = period;
        self
    }

    /// Connects a byte stream to `addr` (`rdma://IP:PORT` or `IP:PORT`)
    /// with these settings.
    pub async fn connect_stream(&self, addr: &str) -> io::Result<RdmaStream> {
        let addr = crate::resolve(authority(addr)).await.map_err(to_io_error)?;
        let cfg = self.without_rendezvous();
        let est = cfg.establish(addr).await.map_err(to_io_error)?;
        RdmaStream::start(est, &cfg).map_err(to_io_error)
    }

    /// Listens for byte streams on `addr` with these settings (see
    /// [`RdmaListener::bind`]).
    pub async fn bind_stream(&self, addr: &str) -> io::Result<RdmaListener> {
        let addr = crate::resolve(authority(addr)).await.map_err(to_io_error)?;
        let accepting = self
            .without_rendezvous()
            .accept_with(addr, RdmaStream::start)
            .map_err(to_io_error)?;
        Ok(RdmaListener { accepting })
    }
}

fn authority(addr: &str) -> &str {
    addr.strip_prefix("rdma://").unwrap_or(addr)
}

/// A transport error as the `io::Error` a socket would give.
fn to_io_error(e: TransportError) -> io::Error {
    match e {
        TransportError::Io { context, source } => {
            io::Error::new(source.kind(), format!("{context}: {source}"))
        }
        TransportError::Closed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "the RDMA stream is closed")
        }
        TransportError::InvalidAddress { .. } => {
            io::Error::new(io::ErrorKind::InvalidInput, e.to_string())
        }
        other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
    }
}
