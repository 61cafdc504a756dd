//! TCP transport for rdma-rpc: `tcp://host:port`, and TLS over it,
//! `tls://host:port` (see [`tls`]).
//!
//! # Quick start
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! transport_tcp::install();
//! let channel = rpc_core::Channel::connect("tcp://127.0.0.1:50051").await?;
//! # Ok(()) }
//! ```
//!
//! `tls://` carries the same frames, with the same writer, reader and
//! settings, over a rustls session: server TLS, or mutual TLS with the
//! client's certificate name seen by handlers
//! ([`tls::TlsTransport::builder`]).
//!
//! # How frames travel
//! Each frame goes as a 4-byte little-endian length and the frame;
//! `TCP_NODELAY` is set. One writer at a time owns the socket, so frames
//! never interleave:
//!
//! - **Inline when idle.** A sender that finds the socket idle, with the
//!   reader caught up with the peer and nothing sent since (a call answering
//!   the peer's last frame, one call at a time), encodes its frame and writes
//!   it itself with a non-blocking `write`: no hand-over to another task.
//! - **Batched when busy.** Otherwise the frame is encoded into the
//!   connection's queue. A writer task, which yields once first so that the
//!   other tasks made ready together queue theirs too, sends everything
//!   queued with one `write`; frames sent meanwhile wait for the next. It also
//!   finishes a frame the socket had no room for inline, before anything
//!   queued behind it.
//! - **Large payloads by reference.** A frame whose payload is at least
//!   [`GATHER_THRESHOLD`] (32 KiB) is
//!   gathered ([`OutFrame::gather`]) instead of encoded: its head and small
//!   fields are copied, but each large [`bytes::Bytes`] (a `Bytes`
//!   payload, a prost `bytes` field) is held by reference and written from
//!   where it is with vectored writes, in order with the frames around it.
//!   Over TLS the segments go to the session one after the other.
//! - **Large frames in pieces; small ones pass them.** A frame over
//!   [`reader::PIECE_LEN`] (256 KiB) goes in pieces, the writer task
//!   sending one piece after each batch of queued frames, so that a small
//!   call waits behind at most one piece instead of a whole tensor. A
//!   call's own frames keep their order: once a call has a frame in
//!   pieces, its later frames follow it. While small frames go between the
//!   pieces (and for 10 ms after), pieces are 64 KiB and the socket holds
//!   at most 64 KiB unsent (`TCP_NOTSENT_LOWAT`), or the kernel's send
//!   buffer (megabytes) would sit ahead of the small frame anyway; while
//!   only large frames go, both are 1 MiB, which spares each large frame
//!   wake-ups on both ends (a 1 MiB echo one at a time: 0.74 ms against
//!   1.0 ms over loopback).
//!
//! The reader ([`reader::FrameReader`], no I/O in it) reads into one buffer,
//! and the rest of each piece straight into the buffer of the frame it
//! belongs to, and hands each frame up as a [`bytes::Bytes`] slice of it (no copy), or,
//! up to [`reader::COPY_UP_TO`] bytes, as a copy into a small buffer
//! shared by such frames ([`reader::SMALL_FRAMES`]: cheaper for small
//! frames than sharing the read buffer or an allocation each). The buffer grows with the bytes that arrived, never
//! with the length a peer announces; a frame over 64 KiB claims its length
//! from the transport's [read budget](TcpTransport::read_budget) first,
//! and then the buffer makes room for all of it at once, so the rest of
//! it is read in place (no copy each time the buffer would have doubled).
//! For a frame over 32 MiB that room is, when one is free, the buffer of
//! an earlier such frame that the application has dropped
//! ([`kept_buffers`](TcpTransport::kept_buffers)), its pages mapped already.
//! A connection's reader reads at most 256 KiB a poll while no frame
//! completes, then gives its worker back: the tasks that earlier frames
//! woke (a small call's handler) run before the rest of a large frame.
//!
//! # Listening
//! A connection reset by its client before it was accepted is dropped
//! quietly; the listener goes on at once. At the process's file-descriptor
//! limit, new connections are closed as soon as they arrive (with a
//! descriptor kept in reserve for that) instead of waiting in the backlog,
//! and the server is told once per episode.
//!
//! Frames over the connection's limit are dropped as they arrive, never
//! buffered, and reported as [`TransportError::Oversized`].
//!
//! # Dead peers
//! Keepalive probes and `TCP_USER_TIMEOUT` fail a connection whose peer went
//! silent within [`TcpTransport::dead_peer_timeout`] (30 s by default).
//!
//! # Back-pressure
//! Senders wait while more than [`TcpTransport::write_high_water`] bytes are
//! queued and unwritten, so a peer that stops reading holds its senders back
//! instead of growing memory. Frames in pieces count apart from the others,
//! so a small call does not wait for room behind a tensor: a large frame
//! waits while the pieces not yet sent hold the mark, and a call's small
//! frame queued behind its own large one counts against what is queued
//! behind the last large frame.

mod budget;
mod outgoing;
#[doc(hidden)]
pub mod reader;
pub mod tls;

use std::fs::File;
use std::future::Future;
use std::io::{self, IoSlice};
use std::mem;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use rpc_core::frame::{OutFrame, GATHER_THRESHOLD};
use rpc_core::kept::{KeptBuffers, DEFAULT_KEPT};
use rpc_core::transport::{
    self, BoxFuture, Connection, FrameLimits, FrameSink, FrameSource, Listener, Transport,
    TransportError,
};

use budget::ReadBudget;
use outgoing::{Bulk, Outgoing, Pace, INTERLEAVED};
use reader::{FrameReader, PIECE_LEN};
use tokio::io::AsyncRead;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// Makes `tcp://` addresses work in this process, with default settings.
pub fn install() {
    transport::register(Arc::new(TcpTransport::default()));
}

/// The TCP transport. Install it with [`install`], or register a configured
/// one with [`rpc_core::transport::register`].
#[derive(Debug, Clone)]
pub struct TcpTransport {
    write_high_water: usize,
    dead_peer_timeout: Duration,
    read_budget: Arc<ReadBudget>,
    kept: Arc<KeptBuffers>,
}

/// The default of [`TcpTransport::read_budget`]: 256 MiB.
pub const DEFAULT_READ_BUDGET: usize = 256 << 20;

impl Default for TcpTransport {
    fn default() -> TcpTransport {
        TcpTransport {
            write_high_water: 1024 * 1024,
            dead_peer_timeout: Duration::from_secs(30),
            read_budget: ReadBudget::new(DEFAULT_READ_BUDGET),
            kept: Arc::new(KeptBuffers::new(DEFAULT_KEPT)),
        }
    }
}

impl TcpTransport {
    /// How long a peer may stay silent before its connection fails (default
    /// 30 s), so calls to a host that vanished (power loss, cut cable: no FIN,
    /// no RST) end with `Unavailable` instead of waiting for TCP's defaults,
    /// which take hours. An idle connection is probed with TCP keepalives;
    /// data left unacknowledged this long fails it too (`TCP_USER_TIMEOUT`).
    pub fn dead_peer_timeout(mut self, timeout: Duration) -> TcpTransport {
        self.dead_peer_timeout = timeout.max(Duration::from_secs(1));
        self
    }

    /// `TCP_NODELAY`, keepalive probes and the user timeout, per [`TcpTransport::dead_peer_timeout`].
    fn configure(&self, stream: &TcpStream) -> io::Result<()> {
        stream.set_nodelay(true)?;
        let socket = socket2::SockRef::from(stream);
        // Idle for a third of the timeout, then 4 probes an eighth apart.
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(self.dead_peer_timeout / 3)
            .with_interval(self.dead_peer_timeout / 8)
            .with_retries(4);
        socket.set_tcp_keepalive(&keepalive)?;
        // Unsent bytes the kernel takes at most: a small frame written
        // after a large one's pieces waits behind these too. The writer
        // task raises it while nothing needs to pass ([`outgoing::Pace`]).
        socket.set_tcp_notsent_lowat(INTERLEAVED.unsent_limit)?;
        socket.set_tcp_user_timeout(Some(self.dead_peer_timeout))
    }

    /// Bytes that may wait unwritten in a connection's buffer before senders
    /// wait (default 1 MiB), for small frames and for frames in pieces each.
    /// A single larger frame is still accepted when the buffer is empty.
    pub fn write_high_water(mut self, bytes: usize) -> TcpTransport {
        self.write_high_water = bytes;
        self
    }

    /// Bytes that frames larger than 64 KiB may claim while they arrive,
    /// across all of this transport's connections (default
    /// [`DEFAULT_READ_BUDGET`], 256 MiB: four 64 MiB frames at once).
    ///
    /// A connection claims a large frame's announced length before reading
    /// more than its first 64 KiB, makes room for all of it (so the rest is
    /// read in place, with no copy), and gives the claim back when the
    /// frame is handed up; while the budget is claimed, such frames wait
    /// (their peers' TCP windows fill), and frames up to 64 KiB never wait.
    /// A frame larger than the whole budget still goes when no other claim
    /// is held. Memory for frames being received thus stays under about
    /// `budget + connections × 384 KiB` of address space, whatever lengths
    /// peers announce (the claimed frames' pages are touched only as their
    /// bytes arrive). A peer that announces a
    /// large frame and stops sending holds its claim until the connection
    /// ends (rpc-core's keepalive closes a connection that completes no
    /// frame for its interval + timeout, 40 s by default).
    pub fn read_budget(mut self, bytes: usize) -> TcpTransport {
        self.read_budget = ReadBudget::new(bytes);
        self
    }

    /// Bytes of buffers that frames over 32 MiB were received into,
    /// kept for the next such frames while the application still holds
    /// their own, across all of this transport's connections (default
    /// [`DEFAULT_KEPT`], 256 MiB; 0 keeps none).
    ///
    /// A new buffer's pages are faulted in and zeroed by the kernel as
    /// bytes arrive (glibc unmaps chunks over 32 MiB on free, so each such
    /// frame would get fresh pages). A connection reads its next large
    /// frame into the buffer of its last one if the application dropped
    /// that frame before the next bytes arrived (a server that sums a
    /// pushed gradient and returns); if it holds it still (a worker
    /// keeping several pulled tensors), that buffer is kept here, and a
    /// later large frame on any connection is read into it once every
    /// view of its frame is dropped: a worker pulling two 64 MiB tensors
    /// from each of two shards a round over loopback pulled 1.47× faster.
    /// Smaller frames' buffers are left to the allocator, which recycles
    /// them ([`KEPT_ABOVE`](rpc_core::kept::KEPT_ABOVE)). A kept buffer is
    /// reused for a frame of half its size up to its size; past the limit
    /// the oldest are forgotten.
    /// So up to this much memory stays mapped after a burst of large
    /// frames, on top of the frames the application holds.
    pub fn kept_buffers(mut self, bytes: usize) -> TcpTransport {
        self.kept = Arc::new(KeptBuffers::new(bytes));
        self
    }

    fn wrap(&self, stream: TcpStream, limits: FrameLimits) -> Result<Connection, TransportError> {
        self.configure(&stream)
            .map_err(|e| TransportError::io("configure the TCP socket", e))?;
        let peer = stream
            .peer_addr()
            .map(|a| format!("tcp://{a}"))
            .map_err(|e| TransportError::io("read peer address", e))?;
        let (read, write) = stream.into_split();
        Ok(self.connection(read, write, peer, None, limits))
    }

    /// A connection over a byte stream's two halves (a TCP socket's, or a
    /// TLS session's over one), with this transport's settings. Generic, so
    /// the plain TCP path pays nothing for the TLS one.
    fn connection<R, W>(
        &self,
        read: R,
        write: W,
        peer: String,
        identity: Option<String>,
        limits: FrameLimits,
    ) -> Connection
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: WriteHalf,
    {
        let received = Arc::new(AtomicBool::new(true));
        let shared = Arc::new(SinkShared {
            state: Mutex::new(SinkState {
                queued: Outgoing::default(),
                bulk: Bulk::default(),
                unfinished: Outgoing::default(),
                spare: BytesMut::new(),
                writer: Writer::Idle,
                closed: false,
                failed: None,
                waiters: Vec::new(),
                writer_done: false,
                close_waiters: Vec::new(),
            }),
            socket: write,
            wake_writer: Notify::new(),
            high_water: self.write_high_water,
            received: Arc::clone(&received),
        });
        tokio::spawn(write_loop(Arc::clone(&shared)));
        Connection {
            sink: Arc::new(TcpSink { shared }),
            source: Box::new(TcpSource {
                socket: read,
                reader: FrameReader::new(limits).keeping_buffers_in(Arc::clone(&self.kept)),
                budget: Arc::clone(&self.read_budget),
                claimed: 0,
                received,
            }),
            peer,
            identity,
        }
    }
}

impl Transport for TcpTransport {
    fn scheme(&self) -> &'static str {
        "tcp"
    }

    fn connect<'a>(
        &'a self,
        authority: &'a str,
        limits: FrameLimits,
    ) -> BoxFuture<'a, Result<Connection, TransportError>> {
        Box::pin(async move {
            let stream = TcpStream::connect(authority)
                .await
                .map_err(|e| TransportError::io(format!("connect to tcp://{authority}"), e))?;
            self.wrap(stream, limits)
        })
    }

    fn listen<'a>(
        &'a self,
        authority: &'a str,
        limits: FrameLimits,
    ) -> BoxFuture<'a, Result<Box<dyn Listener>, TransportError>> {
        Box::pin(async move {
            Ok(Box::new(TcpFrameListener {
                accept: AcceptLoop::bind("tcp", authority).await?,
                transport: self.clone(),
                limits,
            }) as Box<dyn Listener>)
        })
    }
}

/// Accepts TCP connections, for `tcp://` and `tls://` listeners alike.
/// Errors that concern one connection only (it was reset or aborted before
/// it was accepted) drop that connection and go on at once: they never
/// reach the server's accept loop. At the process's file-descriptor limit,
/// new connections are refused at once rather than left waiting in the
/// backlog, using a descriptor kept in reserve for that (see
/// [`AcceptLoop::poll_next`]).
struct AcceptLoop {
    listener: TcpListener,
    local: String,
    /// A descriptor held in reserve: closed to accept (and at once close)
    /// a connection when the process is out of descriptors.
    spare_fd: Option<File>,
    /// Connections refused since descriptors ran out (0: they have not).
    refused: u64,
}

impl AcceptLoop {
    /// Listens on `authority`; `local` is `scheme://` and the address bound.
    async fn bind(scheme: &str, authority: &str) -> Result<AcceptLoop, TransportError> {
        let listener = TcpListener::bind(authority)
            .await
            .map_err(|e| TransportError::io(format!("bind {scheme}://{authority}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| TransportError::io("read bound address", e))?;
        Ok(AcceptLoop {
            listener,
            local: format!("{scheme}://{local}"),
            spare_fd: File::open("/dev/null").ok(),
            refused: 0,
        })
    }

    /// Out of descriptors: closes the spare one, accepts the waiting
    /// connection with it and closes that at once (its client sees the
    /// connection end instead of waiting in the backlog), then takes the
    /// spare back. `None` when there was no spare descriptor to use.
    fn refuse_one(&mut self, cx: &mut Context<'_>) -> Option<Poll<()>> {
        drop(self.spare_fd.take()?);
        // The accepted connection (if any) is closed here, before the spare
        // is taken back: it uses the same descriptor.
        let refused = self.listener.poll_accept(cx).map(drop);
        self.spare_fd = File::open("/dev/null").ok();
        Some(refused)
    }
}

/// Errors of `accept(2)` that concern the connection being accepted, not
/// the listener: Linux passes pending network errors of the new socket
/// through `accept`, to be treated like `EAGAIN`.
fn concerns_one_connection(error: &io::Error) -> bool {
    use libc::*;
    matches!(
        error.raw_os_error(),
        Some(
            ECONNABORTED
                | ECONNRESET
                | EPROTO
                | EPERM
                | EINTR
                | ENETDOWN
                | ENOPROTOOPT
                | EHOSTDOWN
                | ENONET
                | EHOSTUNREACH
                | EOPNOTSUPP
                | ENETUNREACH
                | ETIMEDOUT
        )
    ) || error.kind() == io::ErrorKind::Interrupted
}

fn out_of_descriptors(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

impl AcceptLoop {
    /// The next TCP connection. Returns an error only for what concerns the
    /// listener: once when the process runs out of file descriptors
    /// (connections are then refused at once until one is accepted again),
    /// and for errors such as `ENOBUFS` or `ENOMEM`, after which the server
    /// backs off briefly.
    fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(TcpStream, SocketAddr), TransportError>> {
        loop {
            match ready!(self.listener.poll_accept(cx)) {
                Ok((stream, from)) => {
                    if self.refused > 0 {
                        tracing::info!(
                            address = %self.local,
                            "accepting again after refusing {} connections for lack of file descriptors",
                            self.refused
                        );
                        self.refused = 0;
                    }
                    if self.spare_fd.is_none() {
                        self.spare_fd = File::open("/dev/null").ok();
                    }
                    return Poll::Ready(Ok((stream, from)));
                }
                Err(error) if concerns_one_connection(&error) => {
                    tracing::debug!(address = %self.local, "a connection failed before it was accepted: {error}");
                }
                Err(error) if out_of_descriptors(&error) => {
                    match self.refuse_one(cx) {
                        None => return Poll::Ready(Err(TransportError::io("accept", error))),
                        Some(Poll::Pending) => return Poll::Pending,
                        Some(Poll::Ready(())) => self.refused += 1,
                    }
                    if self.refused == 1 {
                        let limit = nofile_limit();
                        return Poll::Ready(Err(TransportError::io(
                            "accept",
                            io::Error::new(
                                error.kind(),
                                format!(
                                    "{error}: the process is at its limit of {limit} open files \
                                     (RLIMIT_NOFILE); refusing new connections until some close"
                                ),
                            ),
                        )));
                    }
                }
                Err(error) => return Poll::Ready(Err(TransportError::io("accept", error))),
            }
        }
    }
}

/// A `tcp://` listener: each TCP connection accepted becomes a [`Connection`].
struct TcpFrameListener {
    accept: AcceptLoop,
    transport: TcpTransport,
    limits: FrameLimits,
}

impl Listener for TcpFrameListener {
    /// The next connection; errors as [`AcceptLoop::poll_next`]'s. A
    /// connection reset before it could be set up is dropped quietly.
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Connection, TransportError>> {
        loop {
            let (stream, from) = ready!(self.accept.poll_next(cx))?;
            match self.transport.wrap(stream, self.limits) {
                Ok(connection) => return Poll::Ready(Ok(connection)),
                // Reset by its client before it could be set up.
                Err(error) => tracing::debug!(%from, "dropped a new connection: {error}"),
            }
        }
    }

    fn local_addr(&self) -> String {
        self.accept.local.clone()
    }
}

/// The process's soft limit of open files, for messages.
fn nofile_limit() -> String {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes one `rlimit` into the valid, exclusively
    // borrowed struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        limit.rlim_cur.to_string()
    } else {
        "?".into()
    }
}

/// The sending half of a byte stream as a connection's sink writes it: a
/// TCP socket's ([`OwnedWriteHalf`]), or a TLS session's over one. Only
/// the writer [`SinkState::writer`] names calls it, so one at a time.
pub(crate) trait WriteHalf: Send + Sync + 'static {
    /// Writes what the stream takes now, without waiting: how many bytes it
    /// took, or `WouldBlock` when it takes none.
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize>;

    /// As [`WriteHalf::try_write`], from several buffers in order. By
    /// default it writes the first non-empty one.
    fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match bufs.iter().find(|b| !b.is_empty()) {
            Some(buf) => self.try_write(buf),
            None => Ok(0),
        }
    }

    /// Sends, without waiting, what was taken but is still held back (TLS
    /// records the socket had no room for); true when nothing is left.
    /// Plain TCP holds nothing back: always true.
    fn try_flush(&self) -> io::Result<bool>;

    /// Waits until the socket has room again.
    fn writable(&self) -> impl Future<Output = io::Result<()>> + Send + '_;

    /// Starts an orderly end (TLS queues its `close_notify`), sent by the
    /// next flush. Plain TCP has nothing to send.
    fn start_close(&self) {}

    /// Shuts the socket's sending side: the peer reads end-of-stream.
    fn shutdown_write(&self);

    /// Sets how many bytes the socket holds unsent at most
    /// (`TCP_NOTSENT_LOWAT`); best effort.
    fn set_unsent_limit(&self, bytes: u32);
}

impl WriteHalf for OwnedWriteHalf {
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        OwnedWriteHalf::try_write(self, bytes)
    }

    fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        OwnedWriteHalf::try_write_vectored(self, bufs)
    }

    fn try_flush(&self) -> io::Result<bool> {
        Ok(true)
    }

    fn writable(&self) -> impl Future<Output = io::Result<()>> + Send + '_ {
        OwnedWriteHalf::writable(self)
    }

    fn shutdown_write(&self) {
        let _ = socket2::SockRef::from(self.as_ref()).shutdown(std::net::Shutdown::Write);
    }

    fn set_unsent_limit(&self, bytes: u32) {
        let _ = socket2::SockRef::from(self.as_ref()).set_tcp_notsent_lowat(bytes);
    }
}

struct SinkShared<W> {
    state: Mutex<SinkState>,
    /// Written by whoever [`SinkState::writer`] says owns it.
    socket: W,
    wake_writer: Notify,
    high_water: usize,
    /// Set by the reader whenever it hands up a frame, cleared by each send;
    /// see [`TcpSink::poll_send`].
    received: Arc<AtomicBool>,
}

/// Who may write to the socket right now. Exactly one writer at a time, so
/// frames never interleave; bytes leave in the order they were accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writer {
    /// Nobody: nothing is queued or unfinished, and the next sender writes its
    /// frame itself, straight from `poll_send`.
    Idle,
    /// A sender is writing its own frame from `poll_send`; frames sent
    /// meanwhile queue.
    Inline,
    /// The writer task owns the socket until it finds nothing left to write.
    Task,
}

struct SinkState {
    /// Length-prefixed frames accepted and not yet taken by a writer.
    queued: Outgoing,
    /// Large frames (and the frames of their calls after them), taken a
    /// piece at a time, after what is `queued` at each write.
    bulk: Bulk,
    /// The rest of a frame an inline write could not finish (the socket was
    /// full): the writer task sends it before anything in `queued`.
    unfinished: Outgoing,
    /// A cleared buffer that keeps its capacity, for the next inline write.
    spare: BytesMut,
    writer: Writer,
    /// `close` was called: write what is queued, then shut down.
    closed: bool,
    /// A write failed; every later send fails with this.
    failed: Option<(io::ErrorKind, String)>,
    /// Senders waiting for room.
    waiters: Vec<Waker>,
    /// The writer task ended: after a close, everything is out and the
    /// socket shut down; or a write failed (or its runtime went away).
    writer_done: bool,
    /// Waiting for the writer task to end ([`TcpSink::poll_closed`]).
    close_waiters: Vec<Waker>,
}

impl SinkState {
    fn failed_error(&self) -> Option<TransportError> {
        let (kind, message) = self.failed.as_ref()?;
        Some(TransportError::io(
            "write to peer",
            io::Error::new(*kind, message.clone()),
        ))
    }

    /// Records a write error: every waiting and later sender fails with it.
    fn fail(&mut self, error: &io::Error) {
        self.failed = Some((error.kind(), error.to_string()));
        self.queued = Outgoing::default();
        self.bulk.clear();
        self.unfinished = Outgoing::default();
        for waiter in self.waiters.drain(..) {
            waiter.wake();
        }
    }

    /// No frame waits for a writer.
    fn nothing_queued(&self) -> bool {
        self.queued.is_empty() && self.bulk.is_empty()
    }

    /// Gives the socket to the writer task, which sends what is left.
    fn hand_to_task(&mut self, wake_writer: &Notify) {
        self.writer = Writer::Task;
        wake_writer.notify_one();
    }
}

impl<W: WriteHalf> SinkShared<W> {
    fn lock(&self) -> std::sync::MutexGuard<'_, SinkState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Buffers larger than this are dropped after use rather than kept.
    fn max_kept_capacity(&self) -> usize {
        4 * self.high_water
    }

    /// Writes `frame` from the sender's own task: the socket was idle, so
    /// this is the lowest-latency path (no hand-over to another task).
    #[inline(always)]
    fn send_inline(
        &self,
        mut state: std::sync::MutexGuard<'_, SinkState>,
        frame: &OutFrame<'_>,
        prefix: u32,
    ) -> Result<(), TransportError> {
        state.writer = Writer::Inline;
        let mut out = mem::take(&mut state.spare);
        drop(state);
        let encoding = ReleaseOnUnwind(self);
        // A small frame is encoded into `out` and written with one `write`;
        // a large one is gathered, its large fields by reference.
        let mut gathered = None;
        if frame.payload_len() < GATHER_THRESHOLD {
            out.reserve(4 + frame.len());
            out.put_u32_le(prefix);
            frame.encode(&mut out);
        } else {
            let mut large = Outgoing::with_tail(mem::take(&mut out));
            large.push_frame(frame, prefix);
            gathered = Some(large);
        }
        mem::forget(encoding);
        let written = match &mut gathered {
            None => try_write_all(&self.socket, &out).and_then(|n| {
                if n == out.len() {
                    out.clear(); // keeps the buffer's whole capacity
                    self.socket.try_flush()
                } else {
                    out.advance(n);
                    Ok(false)
                }
            }),
            Some(large) => large
                .try_write(&self.socket)
                .and_then(|()| Ok(large.is_empty() && self.socket.try_flush()?)),
        };
        let all_out = matches!(written, Ok(true));
        let mut state = self.lock();
        match written {
            Ok(true) => {
                if let Some(large) = gathered {
                    out = large.into_tail();
                }
                if out.capacity() <= self.max_kept_capacity() {
                    state.spare = out;
                }
            }
            Ok(false) => {
                // The socket is full: the writer task finishes this frame
                // (before anything queued meanwhile) once it has room; over
                // TLS, the rest may be records held back (`unfinished` is
                // then empty and the task flushes them).
                state.unfinished = gathered.unwrap_or_else(|| Outgoing::with_tail(out));
            }
            Err(error) => {
                state.fail(&error);
                self.wake_writer.notify_one(); // it sees `failed` and ends
                return Err(TransportError::io("write to peer", error));
            }
        }
        if all_out && state.nothing_queued() && !state.closed {
            state.writer = Writer::Idle;
        } else {
            state.hand_to_task(&self.wake_writer);
        }
        Ok(())
    }
}

/// Writes as much of `bytes` as the socket takes without waiting.
fn try_write_all<W: WriteHalf>(socket: &W, bytes: &[u8]) -> io::Result<usize> {
    let mut written = 0;
    while written < bytes.len() {
        match socket.try_write(&bytes[written..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

/// Gives the socket up if encoding an inline frame panics (a payload's
/// `encode_payload` is user code), before any of it was written.
struct ReleaseOnUnwind<'a, W: WriteHalf>(&'a SinkShared<W>);

impl<W: WriteHalf> Drop for ReleaseOnUnwind<'_, W> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        if state.nothing_queued() && !state.closed {
            state.writer = Writer::Idle;
        } else {
            state.hand_to_task(&self.0.wake_writer);
        }
    }
}

struct TcpSink<W: WriteHalf> {
    shared: Arc<SinkShared<W>>,
}

impl<W: WriteHalf> FrameSink for TcpSink<W> {
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        frame: &OutFrame<'_>,
    ) -> Poll<Result<(), TransportError>> {
        let mut state = self.shared.lock();
        if let Some(error) = state.failed_error() {
            return Poll::Ready(Err(error));
        }
        if state.closed {
            return Poll::Ready(Err(TransportError::Closed));
        }
        let bulk = state.bulk.takes(frame);
        let queued = if bulk {
            state.bulk.queued_for(frame)
        } else {
            state.queued.len()
        };
        if queued >= self.shared.high_water {
            if !state.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                state.waiters.push(cx.waker().clone());
            }
            return Poll::Pending;
        }
        let len = frame.len();
        let Ok(prefix) = u32::try_from(len) else {
            return Poll::Ready(Err(TransportError::Protocol(format!(
                "frame of {len} bytes does not fit a u32 length"
            ))));
        };
        if bulk {
            // In pieces, which the writer task sends between the other
            // frames.
            if state.writer == Writer::Idle {
                state.hand_to_task(&self.shared.wake_writer);
            }
            state.bulk.push_frame(frame, prefix);
            return Poll::Ready(Ok(()));
        }
        let answers_peer = self.shared.received.swap(false, Ordering::Relaxed);
        if state.writer == Writer::Idle {
            if answers_peer {
                return Poll::Ready(self.shared.send_inline(state, frame, prefix));
            }
            // Sent since the last frame received: likely one of several
            // senders made ready together. Let the writer task send this
            // frame, after those others queued theirs.
            state.hand_to_task(&self.shared.wake_writer);
        }
        // Someone is writing: queue, and the next write takes this frame
        // along with every other queued by then.
        state.queued.push_frame(frame, prefix);
        Poll::Ready(Ok(()))
    }

    fn close(&self) {
        let mut state = self.shared.lock();
        state.closed = true;
        // Senders waiting for room fail now, as later ones do.
        for waiter in state.waiters.drain(..) {
            waiter.wake();
        }
        match state.writer {
            // An inline writer hands over to the task when it finishes.
            Writer::Inline => {}
            Writer::Idle | Writer::Task => state.hand_to_task(&self.shared.wake_writer),
        }
    }

    fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.shared.lock();
        if state.writer_done {
            return Poll::Ready(());
        }
        if !state.close_waiters.iter().any(|w| w.will_wake(cx.waker())) {
            state.close_waiters.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl<W: WriteHalf> Drop for TcpSink<W> {
    fn drop(&mut self) {
        self.close();
    }
}

/// Writes what inline senders could not: frames queued while the socket was
/// busy, the rest of a frame the socket had no room for, and the shutdown on
/// close. Before each batch it yields once, so that the tasks made ready
/// with the sender that woke it queue their frames first and leave in the
/// same `write`.
async fn write_loop<W: WriteHalf>(shared: Arc<SinkShared<W>>) {
    let _done = WriterDone(Arc::clone(&shared));
    write_until_closed(shared).await;
}

/// Tells those waiting for a close that the writer task ended, however it
/// ended (also when its runtime drops it).
struct WriterDone<W: WriteHalf>(Arc<SinkShared<W>>);

impl<W: WriteHalf> Drop for WriterDone<W> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.writer_done = true;
        for waiter in state.close_waiters.drain(..) {
            waiter.wake();
        }
    }
}

async fn write_until_closed<W: WriteHalf>(shared: Arc<SinkShared<W>>) {
    let mut batch = Outgoing::default();
    let mut pace = Pace::default();
    let mut step = INTERLEAVED;
    // What the socket was set to hold unsent (`TcpTransport::configure`).
    let mut unsent_limit = INTERLEAVED.unsent_limit;
    loop {
        // Wait until an inline sender or `close` hands the socket over.
        loop {
            let notified = shared.wake_writer.notified();
            {
                let state = shared.lock();
                if state.failed.is_some() {
                    return;
                }
                if state.writer == Writer::Task {
                    break;
                }
            }
            notified.await;
        }
        loop {
            tokio::task::yield_now().await;
            let (closed, flushed) = {
                let mut state = shared.lock();
                if state.failed.is_some() {
                    return;
                }
                if !state.unfinished.is_empty() {
                    mem::swap(&mut state.unfinished, &mut batch);
                } else {
                    if !state.bulk.is_empty() {
                        let interleaved = !state.queued.is_empty();
                        step = pace.step(interleaved, Instant::now());
                    }
                    mem::swap(&mut state.queued, &mut batch);
                    // Then one piece of the bulk stream: a frame queued
                    // meanwhile waits for at most this piece (and what the
                    // socket holds unsent).
                    state.bulk.take_piece(&mut batch, step.piece);
                    if !batch.is_empty() {
                        for waiter in state.waiters.drain(..) {
                            waiter.wake();
                        }
                    }
                }
                // Idle only once every byte taken is out (over TLS, an
                // inline write may have left records held back).
                let mut flushed = true;
                if batch.is_empty() && !state.closed {
                    match shared.socket.try_flush() {
                        Ok(true) => state.writer = Writer::Idle,
                        Ok(false) => flushed = false,
                        Err(error) => {
                            state.fail(&error);
                            return;
                        }
                    }
                }
                (state.closed, flushed)
            };
            if batch.is_empty() {
                if closed {
                    // Every accepted frame is out: the peer sees end-of-stream.
                    shared.socket.start_close();
                    if write_all(&shared.socket, &mut batch).await.is_ok() {
                        shared.socket.shutdown_write();
                    }
                    return;
                }
                if flushed {
                    break;
                }
            }
            if step.unsent_limit != unsent_limit {
                unsent_limit = step.unsent_limit;
                shared.socket.set_unsent_limit(unsent_limit);
            }
            if let Err(error) = write_all(&shared.socket, &mut batch).await {
                shared.lock().fail(&error);
                return;
            }
            batch.clear();
            if batch.capacity() > shared.max_kept_capacity() {
                batch = Outgoing::default(); // after a huge frame, do not keep its buffer forever
            }
        }
    }
}

/// Writes all of `out` and flushes what the stream held back, waiting
/// for room in the socket as needed.
async fn write_all<W: WriteHalf>(socket: &W, out: &mut Outgoing) -> io::Result<()> {
    loop {
        out.try_write(socket)?;
        if out.is_empty() && socket.try_flush()? {
            return Ok(());
        }
        socket.writable().await?;
    }
}

/// The receiving half: a [`FrameReader`] over the socket, claiming the
/// transport's [`read budget`](TcpTransport::read_budget) for large frames.
struct TcpSource<R> {
    socket: R,
    reader: FrameReader,
    budget: Arc<ReadBudget>,
    /// The budget claimed for the large frame being received (0: none).
    claimed: usize,
    /// Shared with the sink: set for every frame handed up.
    received: Arc<AtomicBool>,
}

impl<R> TcpSource<R> {
    fn release_claim(&mut self) {
        self.budget.release(mem::take(&mut self.claimed));
    }
}

/// Bytes a connection's reader takes from its socket in one poll while no
/// frame completes; then it lets its worker run the rest. Without a share,
/// a large frame arriving back to back held the worker for all of it
/// (tokio's budget counts reads, 128 of them, not bytes), and the tasks
/// that the frames before it woke, queued on that worker, waited for it:
/// the handler of a small call behind a 64 MiB one, and every socket whose
/// readiness that worker's I/O driver would have seen.
const READ_PER_POLL: usize = PIECE_LEN;

impl<R: AsyncRead + Unpin + Send + 'static> FrameSource for TcpSource<R> {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, TransportError>> {
        let mut read_here = 0;
        loop {
            match self.reader.next_frame() {
                Ok(Some(frame)) => {
                    if !self.reader.holds_reservation() {
                        self.release_claim();
                    }
                    // More bytes already here mean more frames, so more
                    // senders to come: only a reader that has caught up with
                    // the peer lets the next send go inline.
                    self.received
                        .store(self.reader.is_caught_up(), Ordering::Relaxed);
                    return Poll::Ready(Ok(Some(frame)));
                }
                Ok(None) => {}
                Err(error) => {
                    self.release_claim();
                    return Poll::Ready(Err(error));
                }
            }
            if self.claimed == 0 {
                if let Some(len) = self.reader.large_partial_frame() {
                    ready!(self.budget.poll_claim(cx, len));
                    self.claimed = len;
                    self.reader.reserve_frame();
                }
            }
            if read_here >= READ_PER_POLL {
                // Deferred, as `yield_now` does: the worker polls its I/O
                // driver and runs what is ready before this reader again
                // (after a plain wake it polls the driver only every 61
                // turns, so sockets made ready meanwhile would wait).
                let _ = pin!(tokio::task::yield_now()).poll(cx);
                return Poll::Pending;
            }
            let (buf, limit) = self.reader.read_target();
            let limit = limit.min(READ_PER_POLL - read_here);
            let read = match ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut self.socket),
                cx,
                &mut buf.limit(limit)
            )) {
                Ok(read) => read,
                // TLS: the peer's socket closed without a `close_notify`
                // (it died, or was killed): an end like TCP's, an orderly
                // one only at a frame boundary. Plain TCP never reads this.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => 0,
                Err(e) => return Poll::Ready(Err(TransportError::io("read from peer", e))),
            };
            self.reader.received(read);
            read_here += read;
            if read == 0 {
                return Poll::Ready(self.reader.end_of_stream());
            }
        }
    }
}

impl<R> Drop for TcpSource<R> {
    fn drop(&mut self) {
        self.release_claim();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sockets_get_nodelay_keepalive_and_user_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let transport = TcpTransport::default().dead_peer_timeout(Duration::from_secs(16));
        transport.configure(&stream).unwrap();
        let socket = socket2::SockRef::from(&stream);
        assert!(stream.nodelay().unwrap());
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), Duration::from_secs(5));
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(2)
        );
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), 4);
        assert_eq!(
            socket.tcp_user_timeout().unwrap(),
            Some(Duration::from_secs(16))
        );
    }

    /// Counts its wakes.
    struct Wakes(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_large_frame_all_there_is_read_a_share_per_poll_and_the_reader_asks_to_go_on() {
        let body: Vec<u8> = (0..2 << 20).map(|i| (i % 251) as u8).collect();
        let mut wire = (body.len() as u32).to_le_bytes().to_vec();
        wire.extend_from_slice(&body);
        let mut source = TcpSource {
            socket: std::io::Cursor::new(wire),
            reader: FrameReader::new(FrameLimits {
                max_frame_len: 4 << 20,
            }),
            budget: ReadBudget::new(DEFAULT_READ_BUDGET),
            claimed: 0,
            received: Arc::new(AtomicBool::new(false)),
        };
        let wakes = Arc::new(Wakes(Default::default()));
        let waker = Waker::from(Arc::clone(&wakes));
        let mut cx = Context::from_waker(&waker);
        let mut pending = 0;
        let frame = loop {
            match source.poll_recv(&mut cx) {
                Poll::Ready(frame) => break frame.unwrap().unwrap(),
                Poll::Pending => {
                    pending += 1;
                    // Outside a runtime the deferred wake is at once.
                    assert_eq!(
                        wakes.0.load(Ordering::Relaxed),
                        pending,
                        "a Pending with no wake stalls"
                    );
                }
            }
        };
        assert_eq!(frame, body);
        // Every byte was there: only the share per poll made it give way.
        assert!(
            pending >= body.len() / READ_PER_POLL - 1,
            "{pending} polls gave way for a {} byte frame",
            body.len()
        );
    }
}
