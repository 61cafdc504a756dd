//! An in-process transport for tests and benchmarks: `mem://NAME`.
//!
//! Frames travel as [`Bytes`] over in-memory queues; nothing touches a socket
//! or a device. Queues are unbounded: the runtime's own flow control is what
//! keeps memory in check, which is exactly what tests of it need to see.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::sync::mpsc;

use super::{
    BoxFuture, Connection, FrameLimits, FrameSink, FrameSource, Listener, Transport,
    TransportError, OVERSIZED_PREFIX_LEN,
};
use crate::frame::OutFrame;

/// The `mem://` transport; registered in every process by default.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemTransport;

type Listeners = Mutex<HashMap<String, mpsc::UnboundedSender<Connection>>>;

fn listeners() -> &'static Listeners {
    static LISTENERS: OnceLock<Listeners> = OnceLock::new();
    LISTENERS.get_or_init(Default::default)
}

fn refused(what: &str, name: &str, kind: std::io::ErrorKind) -> TransportError {
    TransportError::io(format!("{what} mem://{name}"), kind.into())
}

impl Transport for MemTransport {
    fn scheme(&self) -> &'static str {
        "mem"
    }

    fn connect<'a>(
        &'a self,
        name: &'a str,
        limits: FrameLimits,
    ) -> BoxFuture<'a, Result<Connection, TransportError>> {
        Box::pin(async move {
            let listeners = listeners().lock().unwrap_or_else(|e| e.into_inner());
            let accept = listeners.get(name).ok_or_else(|| {
                refused("connect to", name, std::io::ErrorKind::ConnectionRefused)
            })?;
            let (to_server, from_client) = mpsc::unbounded_channel();
            let (to_client, from_server) = mpsc::unbounded_channel();
            let server_side = Connection {
                sink: Arc::new(MemSink::new(to_client)),
                source: Box::new(MemSource {
                    rx: from_client,
                    limits,
                }),
                peer: "mem://client".into(),
                identity: None,
            };
            accept
                .send(server_side)
                .map_err(|_| refused("connect to", name, std::io::ErrorKind::ConnectionRefused))?;
            Ok(Connection {
                sink: Arc::new(MemSink::new(to_server)),
                source: Box::new(MemSource {
                    rx: from_server,
                    limits,
                }),
                peer: format!("mem://{name}"),
                identity: None,
            })
        })
    }

    fn listen<'a>(
        &'a self,
        name: &'a str,
        _limits: FrameLimits,
    ) -> BoxFuture<'a, Result<Box<dyn Listener>, TransportError>> {
        Box::pin(async move {
            let mut listeners = listeners().lock().unwrap_or_else(|e| e.into_inner());
            if listeners.get(name).is_some_and(|tx| !tx.is_closed()) {
                return Err(refused("listen on", name, std::io::ErrorKind::AddrInUse));
            }
            let (tx, rx) = mpsc::unbounded_channel();
            listeners.insert(name.to_string(), tx);
            Ok(Box::new(MemListener {
                name: name.to_string(),
                rx,
            }) as Box<dyn Listener>)
        })
    }
}

struct MemListener {
    name: String,
    rx: mpsc::UnboundedReceiver<Connection>,
}

impl Listener for MemListener {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Connection, TransportError>> {
        self.rx
            .poll_recv(cx)
            .map(|c| c.ok_or(TransportError::Closed))
    }

    fn local_addr(&self) -> String {
        format!("mem://{}", self.name)
    }
}

impl Drop for MemListener {
    fn drop(&mut self) {
        self.rx.close();
        let mut listeners = listeners().lock().unwrap_or_else(|e| e.into_inner());
        // Only our own (now closed) entry: a new listener may have taken the name.
        if listeners.get(&self.name).is_some_and(|tx| tx.is_closed()) {
            listeners.remove(&self.name);
        }
    }
}

struct MemSink {
    tx: Mutex<Option<mpsc::UnboundedSender<Bytes>>>,
}

impl MemSink {
    fn new(tx: mpsc::UnboundedSender<Bytes>) -> MemSink {
        MemSink {
            tx: Mutex::new(Some(tx)),
        }
    }
}

impl FrameSink for MemSink {
    fn poll_send(
        &self,
        _cx: &mut Context<'_>,
        frame: &OutFrame<'_>,
    ) -> Poll<Result<(), TransportError>> {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = tx.as_ref() else {
            return Poll::Ready(Err(TransportError::Closed));
        };
        Poll::Ready(
            tx.send(frame.to_bytes())
                .map_err(|_| TransportError::Closed),
        )
    }

    fn close(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

struct MemSource {
    rx: mpsc::UnboundedReceiver<Bytes>,
    limits: FrameLimits,
}

impl FrameSource for MemSource {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, TransportError>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(frame)) if frame.len() > self.limits.max_skip_len() => {
                Poll::Ready(Err(TransportError::FrameTooLarge {
                    len: frame.len(),
                    max: self.limits.max_frame_len,
                }))
            }
            Poll::Ready(Some(frame)) if frame.len() > self.limits.max_frame_len => {
                Poll::Ready(Err(TransportError::Oversized {
                    len: frame.len(),
                    max: self.limits.max_frame_len,
                    prefix: frame.slice(..OVERSIZED_PREFIX_LEN.min(frame.len())),
                }))
            }
            Poll::Ready(frame) => Poll::Ready(Ok(frame)),
            Poll::Pending => Poll::Pending,
        }
    }
}
