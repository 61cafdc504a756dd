//! What the runtime counts about its connections, per scheme and side, and
//! the values a transport reports about itself; read by metrics exporters
//! (`rpc-metrics` turns them into `rpc_transport_*` series).
//!
//! Every connection of a [`Channel`](crate::Channel) or a
//! [`Server`](crate::Server) passes through rpc-core, whatever its
//! transport, so the transport-neutral counters are kept here:
//! connections opened and closed, a client's reconnections and failed
//! connection attempts, and sends that found the transport without room
//! ([`FrameSink::poll_send`] returning `Pending`: the peer's credits or the
//! socket's buffer exhausted). [`connection_stats`] reads them.
//!
//! What only a transport knows (RDMA's pinned memory, device events) it
//! reports through [`Transport::stats`](super::Transport::stats) as
//! [`TransportStat`]s.
//!
//! # Cost
//! The counters are process-wide relaxed atomics, one set per scheme and
//! side, found once per connection (a short lock then, never per call).
//! A call touches none of them, unless a send finds no room: that send
//! adds one to a counter before it waits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use super::{FrameSink, TransportError};
use crate::frame::OutFrame;

/// Which end of a connection the counters are about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// A [`Channel`](crate::Channel)'s connection to a server.
    Client,
    /// A connection a [`Server`](crate::Server) accepted.
    Server,
}

impl Side {
    /// `"client"` or `"server"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Client => "client",
            Side::Server => "server",
        }
    }
}

/// The connection counters of one scheme and side, as read by [`connection_stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionStats {
    /// The transport's scheme (`"tcp"`, `"rdma"`, `"mem"`).
    pub scheme: &'static str,
    /// Client or server connections.
    pub side: Side,
    /// Connections established so far.
    pub opened: u64,
    /// Connections ended so far (their reader stopped: closed by either
    /// side, broken, or declared dead by keepalive).
    pub closed: u64,
    /// Client only: connections a channel made to replace one it had
    /// before (after the server went away, the connection broke, or the
    /// server sent GoAway).
    pub reconnects: u64,
    /// Client only: connection attempts that failed or timed out.
    pub connect_failures: u64,
    /// Sends that found the transport without room and had to wait (or,
    /// for control frames, were put off): each `Pending` from
    /// [`FrameSink::poll_send`]. On RDMA, mostly waits for the peer's
    /// credits; on TCP, a full socket buffer (a peer reading slowly).
    pub send_stalls: u64,
}

impl ConnectionStats {
    /// Connections open now: opened less closed.
    pub fn open(&self) -> u64 {
        self.opened.saturating_sub(self.closed)
    }
}

/// The counters of every scheme and side that has had a connection (or a
/// connection attempt) in this process, sorted by scheme, then side.
pub fn connection_stats() -> Vec<ConnectionStats> {
    let mut all: Vec<ConnectionStats> = schemes()
        .iter()
        .map(|&(scheme, side, counters)| counters.snapshot(scheme, side))
        .collect();
    all.sort_by_key(|s| (s.scheme, s.side == Side::Server));
    all
}

/// Whether a [`TransportStat`] only grows or goes up and down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StatKind {
    /// Only grows (events since the process started).
    Counter,
    /// A current value (bytes pinned now).
    Gauge,
}

/// One value a transport reports about itself, from
/// [`Transport::stats`](super::Transport::stats): e.g. RDMA's pinned bytes.
///
/// Exporters name it `rpc_transport_<name>` (`_total` added to counters)
/// and add the transport's scheme as a label. Values of the same `name`
/// form one family and must agree on `help`, `kind` and the labels' keys.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportStat {
    /// In `snake_case`, unit last, without `_total` (e.g. `rdma_pinned_bytes`,
    /// `rdma_device_events`).
    pub name: &'static str,
    /// One line on what it counts.
    pub help: &'static str,
    /// Counter or gauge.
    pub kind: StatKind,
    /// Labels beyond the scheme, e.g. `[("device", "rxe0"), ("event", "port_err")]`.
    pub labels: Vec<(&'static str, String)>,
    /// The value now.
    pub value: u64,
}

impl TransportStat {
    /// A counter.
    pub fn counter(name: &'static str, help: &'static str, value: u64) -> TransportStat {
        TransportStat {
            name,
            help,
            kind: StatKind::Counter,
            labels: Vec::new(),
            value,
        }
    }

    /// A gauge.
    pub fn gauge(name: &'static str, help: &'static str, value: u64) -> TransportStat {
        TransportStat {
            kind: StatKind::Gauge,
            ..TransportStat::counter(name, help, value)
        }
    }

    /// With the label `key="value"` too.
    pub fn with_label(mut self, key: &'static str, value: impl Into<String>) -> TransportStat {
        self.labels.push((key, value.into()));
        self
    }
}

/// One scheme's and side's counters.
#[derive(Debug, Default)]
pub(crate) struct ConnectionCounters {
    opened: AtomicU64,
    closed: AtomicU64,
    reconnects: AtomicU64,
    connect_failures: AtomicU64,
    send_stalls: AtomicU64,
}

type SchemeList = Vec<(&'static str, Side, &'static ConnectionCounters)>;

fn schemes() -> std::sync::MutexGuard<'static, SchemeList> {
    static SCHEMES: Mutex<SchemeList> = Mutex::new(Vec::new());
    SCHEMES.lock().unwrap_or_else(|e| e.into_inner())
}

impl ConnectionCounters {
    /// The counters of `scheme` and `side`, made on first use. Each is
    /// allocated once and never freed: there are as many as schemes
    /// installed, times two.
    pub(crate) fn of(scheme: &'static str, side: Side) -> &'static ConnectionCounters {
        let mut schemes = schemes();
        if let Some(&(_, _, found)) = schemes.iter().find(|e| e.0 == scheme && e.1 == side) {
            return found;
        }
        let made: &'static ConnectionCounters = Box::leak(Box::default());
        schemes.push((scheme, side, made));
        made
    }

    fn snapshot(&self, scheme: &'static str, side: Side) -> ConnectionStats {
        // Closed before opened: a connection counted closed was counted
        // opened before, so `open()` never reads one closed but not opened.
        let closed = self.closed.load(Ordering::Relaxed);
        ConnectionStats {
            scheme,
            side,
            opened: self.opened.load(Ordering::Relaxed),
            closed,
            reconnects: self.reconnects.load(Ordering::Relaxed),
            connect_failures: self.connect_failures.load(Ordering::Relaxed),
            send_stalls: self.send_stalls.load(Ordering::Relaxed),
        }
    }

    /// A connection was established: counted open until the guard drops.
    pub(crate) fn opened(&'static self) -> OpenConnection {
        self.opened.fetch_add(1, Ordering::Relaxed);
        OpenConnection(self)
    }

    pub(crate) fn reconnected(&self) {
        self.reconnects.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn connect_failed(&self) {
        self.connect_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// `sink`, counting its sends that find no room here.
    pub(crate) fn count_stalls(&'static self, sink: Arc<dyn FrameSink>) -> Arc<dyn FrameSink> {
        Arc::new(StallCountingSink {
            inner: sink,
            counters: self,
        })
    }
}

/// Counts a connection open while it lives.
#[derive(Debug)]
pub(crate) struct OpenConnection(&'static ConnectionCounters);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.closed.fetch_add(1, Ordering::Relaxed);
    }
}

/// A connection's sink, counting each `Pending` (a send that found no room).
struct StallCountingSink {
    inner: Arc<dyn FrameSink>,
    counters: &'static ConnectionCounters,
}

impl FrameSink for StallCountingSink {
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        frame: &OutFrame<'_>,
    ) -> Poll<Result<(), TransportError>> {
        let sent = self.inner.poll_send(cx, frame);
        if sent.is_pending() {
            self.counters.send_stalls.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    fn close(&self) {
        self.inner.close();
    }

    fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.inner.poll_closed(cx)
    }

    fn poll_payload_buffer(
        &self,
        cx: &mut Context<'_>,
        len: usize,
    ) -> Poll<Result<crate::PayloadBuffer, TransportError>> {
        self.inner.poll_payload_buffer(cx, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::OutBody;

    /// Has room for `room` frames, then none.
    struct Room(std::sync::atomic::AtomicUsize);

    impl FrameSink for Room {
        fn poll_send(
            &self,
            _cx: &mut Context<'_>,
            _frame: &OutFrame<'_>,
        ) -> Poll<Result<(), TransportError>> {
            let had_room = self
                .0
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok();
            if had_room {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        }

        fn close(&self) {}

        /// Memory of its own: bytes of 0xab.
        fn poll_payload_buffer(
            &self,
            _cx: &mut Context<'_>,
            len: usize,
        ) -> Poll<Result<crate::PayloadBuffer, TransportError>> {
            let mut buffer = crate::PayloadBuffer::heap(len);
            buffer.fill(0xab);
            Poll::Ready(Ok(buffer))
        }
    }

    fn stats(scheme: &str, side: Side) -> ConnectionStats {
        connection_stats()
            .into_iter()
            .find(|s| s.scheme == scheme && s.side == side)
            .expect("the scheme's counters exist")
    }

    #[test]
    fn a_send_that_finds_no_room_is_a_stall() {
        let counters = ConnectionCounters::of("stall-test", Side::Server);
        let sink = counters.count_stalls(Arc::new(Room(2.into())));
        let frame = OutFrame::control(0, OutBody::Ping, false);
        assert!(sink.try_send(&frame).unwrap());
        assert!(sink.try_send(&frame).unwrap());
        assert_eq!(stats("stall-test", Side::Server).send_stalls, 0);
        assert!(!sink.try_send(&frame).unwrap());
        assert!(!sink.try_send(&frame).unwrap());
        assert_eq!(stats("stall-test", Side::Server).send_stalls, 2);
        assert!(
            !connection_stats()
                .iter()
                .any(|s| s.scheme == "stall-test" && s.side == Side::Client),
            "a side with no connection has no counters"
        );
    }

    #[test]
    fn payload_buffers_come_from_the_counted_sink() {
        let counters = ConnectionCounters::of("buffer-test", Side::Client);
        let sink = counters.count_stalls(Arc::new(Room(0.into())));
        let waker = std::task::Waker::noop();
        let Poll::Ready(Ok(buffer)) = sink.poll_payload_buffer(&mut Context::from_waker(waker), 3)
        else {
            panic!("a buffer at once")
        };
        assert_eq!(
            &buffer[..],
            &[0xab; 3],
            "the transport's memory, not the default"
        );
    }

    #[test]
    fn connections_count_open_until_their_guard_drops() {
        let counters = ConnectionCounters::of("open-test", Side::Client);
        assert!(std::ptr::eq(
            counters,
            ConnectionCounters::of("open-test", Side::Client)
        ));
        let first = counters.opened();
        let second = counters.opened();
        let now = stats("open-test", Side::Client);
        assert_eq!((now.opened, now.closed, now.open()), (2, 0, 2));
        drop(first);
        let now = stats("open-test", Side::Client);
        assert_eq!((now.opened, now.closed, now.open()), (2, 1, 1));
        drop(second);
        counters.reconnected();
        counters.connect_failed();
        let now = stats("open-test", Side::Client);
        assert_eq!(now.open(), 0);
        assert_eq!((now.reconnects, now.connect_failures), (1, 1));
    }

    #[test]
    fn transport_stats_build_with_a_label() {
        let stat = TransportStat::gauge("x_bytes", "bytes", 7)
            .with_label("device", "rxe0")
            .with_label("port", "1");
        assert_eq!(stat.kind, StatKind::Gauge);
        assert_eq!(
            stat.labels,
            [("device", "rxe0".to_string()), ("port", "1".to_string())]
        );
        assert_eq!(TransportStat::counter("y", "h", 1).kind, StatKind::Counter);
    }
}
