//! TCP transport for rdma-rpc: `tcp://host:port`.
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
//! # How frames travel
//! Each frame goes as a 4-byte little-endian length and the frame. Senders
//! encode straight into the connection's write buffer; one writer task sends
//! whatever has accumulated with a single `write`, so frames from many
//! concurrent calls leave in few syscalls. `TCP_NODELAY` is set. The reader
//! reads into one buffer and hands each frame up as a [`bytes::Bytes`] slice of
//! it: no allocation or copy per frame.
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
//! instead of growing memory.

use std::io;
use std::mem;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use rpc_core::frame::OutFrame;
use rpc_core::transport::{
    self, BoxFuture, Connection, FrameLimits, FrameSink, FrameSource, Listener, Transport,
    TransportError, OVERSIZED_PREFIX_LEN,
};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
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
}

impl Default for TcpTransport {
    fn default() -> TcpTransport {
        TcpTransport {
            write_high_water: 1024 * 1024,
            dead_peer_timeout: Duration::from_secs(30),
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
        socket.set_tcp_user_timeout(Some(self.dead_peer_timeout))
    }

    /// Bytes that may wait unwritten in a connection's buffer before senders
    /// wait (default 1 MiB). A single larger frame is still accepted when the
    /// buffer is empty.
    pub fn write_high_water(mut self, bytes: usize) -> TcpTransport {
        self.write_high_water = bytes;
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
        let shared = Arc::new(SinkShared {
            state: Mutex::new(SinkState {
                buf: BytesMut::new(),
                closed: false,
                failed: None,
                waiters: Vec::new(),
            }),
            wake_writer: Notify::new(),
            high_water: self.write_high_water,
        });
        tokio::spawn(write_loop(Arc::clone(&shared), write));
        Ok(Connection {
            sink: Arc::new(TcpSink { shared }),
            source: Box::new(TcpSource {
                socket: read,
                buf: BytesMut::new(),
                limits,
                skip: 0,
            }),
            peer,
        })
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
            let listener = TcpListener::bind(authority)
                .await
                .map_err(|e| TransportError::io(format!("bind tcp://{authority}"), e))?;
            let local = listener
                .local_addr()
                .map_err(|e| TransportError::io("read bound address", e))?;
            Ok(Box::new(TcpFrameListener {
                listener,
                local: format!("tcp://{local}"),
                transport: self.clone(),
                limits,
            }) as Box<dyn Listener>)
        })
    }
}

struct TcpFrameListener {
    listener: TcpListener,
    local: String,
    transport: TcpTransport,
    limits: FrameLimits,
}

impl Listener for TcpFrameListener {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Connection, TransportError>> {
        let (stream, _) =
            ready!(self.listener.poll_accept(cx)).map_err(|e| TransportError::io("accept", e))?;
        Poll::Ready(self.transport.wrap(stream, self.limits))
    }

    fn local_addr(&self) -> String {
        self.local.clone()
    }
}

struct SinkShared {
    state: Mutex<SinkState>,
    wake_writer: Notify,
    high_water: usize,
}

struct SinkState {
    /// Length-prefixed frames not yet handed to the socket.
    buf: BytesMut,
    /// `close` was called: write what is queued, then shut down.
    closed: bool,
    /// The writer failed; every later send fails with this.
    failed: Option<(io::ErrorKind, String)>,
    /// Senders waiting for room.
    waiters: Vec<Waker>,
}

impl SinkShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, SinkState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct TcpSink {
    shared: Arc<SinkShared>,
}

impl FrameSink for TcpSink {
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        frame: &OutFrame<'_>,
    ) -> Poll<Result<(), TransportError>> {
        let mut state = self.shared.lock();
        if let Some((kind, message)) = &state.failed {
            return Poll::Ready(Err(TransportError::io(
                "write to peer",
                io::Error::new(*kind, message.clone()),
            )));
        }
        if state.closed {
            return Poll::Ready(Err(TransportError::Closed));
        }
        if state.buf.len() >= self.shared.high_water {
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
        let was_empty = state.buf.is_empty();
        state.buf.reserve(4 + len);
        state.buf.put_u32_le(prefix);
        frame.encode(&mut state.buf);
        drop(state);
        if was_empty {
            self.shared.wake_writer.notify_one();
        }
        Poll::Ready(Ok(()))
    }

    fn close(&self) {
        self.shared.lock().closed = true;
        self.shared.wake_writer.notify_one();
    }
}

impl Drop for TcpSink {
    fn drop(&mut self) {
        self.close();
    }
}

/// Hands whatever frames have accumulated to the socket, one `write` per batch.
async fn write_loop(shared: Arc<SinkShared>, mut socket: OwnedWriteHalf) {
    let mut batch = BytesMut::new();
    loop {
        let closed = {
            let mut state = shared.lock();
            mem::swap(&mut state.buf, &mut batch);
            for waiter in state.waiters.drain(..) {
                waiter.wake();
            }
            state.closed
        };
        if batch.is_empty() {
            if closed {
                let _ = socket.shutdown().await;
                return;
            }
            shared.wake_writer.notified().await;
            continue;
        }
        if let Err(error) = socket.write_all(&batch).await {
            let mut state = shared.lock();
            state.failed = Some((error.kind(), error.to_string()));
            for waiter in state.waiters.drain(..) {
                waiter.wake();
            }
            return;
        }
        batch.clear();
        if batch.capacity() > 4 * shared.high_water {
            batch = BytesMut::new(); // after a huge frame, do not keep its buffer forever
        }
    }
}

const READ_CHUNK: usize = 64 * 1024;

struct TcpSource {
    socket: OwnedReadHalf,
    buf: BytesMut,
    limits: FrameLimits,
    /// Bytes of an oversized frame still to drop.
    skip: usize,
}

impl FrameSource for TcpSource {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, TransportError>> {
        loop {
            if self.skip > 0 {
                // The rest of an oversized frame: drop it as it arrives.
                let dropped = self.skip.min(self.buf.len());
                self.buf.advance(dropped);
                self.skip -= dropped;
            }
            let mut want = READ_CHUNK;
            if self.skip == 0 && self.buf.len() >= 4 {
                let len = u32::from_le_bytes(self.buf[..4].try_into().expect("4 bytes")) as usize;
                let max = self.limits.max_frame_len;
                if len > self.limits.max_skip_len() {
                    return Poll::Ready(Err(TransportError::FrameTooLarge { len, max }));
                }
                let prefix_len = OVERSIZED_PREFIX_LEN.min(len);
                if len > max && self.buf.len() >= 4 + prefix_len {
                    let prefix = Bytes::copy_from_slice(&self.buf[4..4 + prefix_len]);
                    self.skip = 4 + len;
                    return Poll::Ready(Err(TransportError::Oversized { len, max, prefix }));
                }
                if len <= max && self.buf.len() >= 4 + len {
                    self.buf.advance(4);
                    return Poll::Ready(Ok(Some(self.buf.split_to(len).freeze())));
                }
                if len <= max {
                    want = want.max(4 + len - self.buf.len());
                }
            }
            self.buf.reserve(want);
            let read = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut self.socket),
                cx,
                &mut self.buf
            ))
            .map_err(|e| TransportError::io("read from peer", e))?;
            if read == 0 {
                return Poll::Ready(if self.buf.is_empty() && self.skip == 0 {
                    Ok(None)
                } else {
                    Err(TransportError::Protocol(format!(
                        "peer closed the connection inside a frame ({} bytes of it received)",
                        self.buf.len()
                    )))
                });
            }
        }
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
}
