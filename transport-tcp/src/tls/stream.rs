//! A TLS session over a TCP socket, split into the halves a connection's
//! source and sink use.
//!
//! Both halves share the session behind a mutex (rustls keeps one state for
//! both directions), held only while a read or a write runs, never across
//! a wait. The socket itself is shared too ([`SharedTcp`]): the reader
//! waits for data through the session's `poll_read`, and the sink's writer
//! waits for room on the socket directly ([`TcpStream::writable`]), so
//! neither can take the other's wake-up (tokio keeps one waker per
//! direction for `poll_*` readiness; `writable()` queues its own).

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll, Waker};

use std::future::Future;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsStream;

use super::explain::{read_error, Side};
use crate::WriteHalf;

/// A TCP socket shared by a TLS session and the sink's writer.
#[derive(Debug, Clone)]
pub(crate) struct SharedTcp(pub(crate) Arc<TcpStream>);

impl AsyncRead for SharedTcp {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.0.poll_read_ready(cx))?;
            // rustls reads into initialised memory: nothing to zero here.
            match self.0.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for SharedTcp {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.poll_write_ready(cx))?;
            match self.0.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                result => return Poll::Ready(result),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.poll_write_ready(cx))?;
            match self.0.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                result => return Poll::Ready(result),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(socket2::SockRef::from(&*self.0).shutdown(std::net::Shutdown::Write))
    }
}

type Session = TlsStream<SharedTcp>;

fn lock(session: &Mutex<Session>) -> MutexGuard<'_, Session> {
    session.lock().unwrap_or_else(|e| e.into_inner())
}

/// Splits an established session into its reading and writing halves.
pub(crate) fn split(session: Session, side: Side) -> (TlsReadHalf, TlsWriteHalf) {
    let tcp = Arc::clone(&session.get_ref().0 .0);
    let session = Arc::new(Mutex::new(session));
    (
        TlsReadHalf {
            session: Arc::clone(&session),
            side,
        },
        TlsWriteHalf { session, tcp },
    )
}

/// What a connection's source reads: the session's plaintext.
pub(crate) struct TlsReadHalf {
    session: Arc<Mutex<Session>>,
    side: Side,
}

impl AsyncRead for TlsReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut session = lock(&self.session);
        Pin::new(&mut *session)
            .poll_read(cx, buf)
            .map_err(|e| read_error(self.side, e))
    }
}

/// What a connection's sink writes: plaintext in, records out. Called with
/// a waker that does nothing: waiting for room is [`WriteHalf::writable`]'s
/// job, on the socket.
pub(crate) struct TlsWriteHalf {
    session: Arc<Mutex<Session>>,
    tcp: Arc<TcpStream>,
}

impl WriteHalf for TlsWriteHalf {
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(&mut *lock(&self.session)).poll_write(&mut cx, bytes) {
            Poll::Ready(result) => result,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn try_flush(&self) -> io::Result<bool> {
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(&mut *lock(&self.session)).poll_flush(&mut cx) {
            Poll::Ready(result) => result.map(|()| true),
            Poll::Pending => Ok(false),
        }
    }

    fn writable(&self) -> impl Future<Output = io::Result<()>> + Send + '_ {
        self.tcp.writable()
    }

    fn start_close(&self) {
        lock(&self.session).get_mut().1.send_close_notify();
    }

    fn shutdown_write(&self) {
        let _ = socket2::SockRef::from(&*self.tcp).shutdown(std::net::Shutdown::Write);
    }

    fn set_unsent_limit(&self, bytes: u32) {
        let _ = socket2::SockRef::from(&*self.tcp).set_tcp_notsent_lowat(bytes);
    }
}
