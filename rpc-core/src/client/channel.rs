//! [`Channel`]: calls multiplexed over one connection per server,
//! reconnecting as needed; over several replicas of one service, balanced.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::intercept::Peer;
use crate::status::Status;
use crate::transport::stats::{ConnectionCounters, Side};
use crate::transport::TransportError;

use super::call_table::ClientConn;
use super::endpoint::{frame_limits, AddressError, ChannelConfig, ConnectError, Endpoint};

/// Calls to one service, multiplexed over a connection to one server or
/// balanced over several replicas of it ([`Channel::balance`]).
///
/// Cloning is cheap; all clones share the connections. When a connection
/// fails, its pending calls end with `Unavailable` and the next call
/// reconnects (with backoff after failed attempts; meanwhile calls fail at
/// once, or wait if the endpoint is set to [`wait_for_ready`](Endpoint::wait_for_ready)).
///
/// Each connection's frames are read by a task on the tokio runtime, which
/// hands every response to the task awaiting its call. Make latency-critical
/// calls from a spawned task rather than from `Runtime::block_on`: a caller
/// on the `block_on` thread costs a cross-thread wake-up per call.
#[derive(Clone)]
pub struct Channel {
    pub(super) inner: Arc<Replicas>,
}

/// How a channel over several replicas picks one for each call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Balance {
    /// The replica with the fewest calls in flight on this channel (ties in
    /// turn). The default: a replica that slows down collects outstanding
    /// calls, so new calls move away from it at once, which is what keeps
    /// a fan-out's tail short.
    #[default]
    LeastOutstanding,
    /// Each replica in turn, whatever its load.
    RoundRobin,
}

/// The replicas a channel balances over (one, for a plain channel).
pub(super) struct Replicas {
    replicas: Vec<Arc<Replica>>,
    /// The server as client interceptors see it (the first replica).
    peer: Peer,
    policy: Balance,
    next: AtomicUsize,
    /// Notified when a replica is marked serving again.
    serving_again: tokio::sync::Notify,
}

/// One server: its endpoint, its connection and its reconnect state.
struct Replica {
    endpoint: Endpoint,
    state: Mutex<ConnState>,
    /// Held by the one connection attempt in progress.
    connecting: Arc<tokio::sync::Mutex<()>>,
    /// What its health check last said (true until one says otherwise).
    serving: AtomicBool,
    /// Whether it has had a connection: the next one is a reconnection.
    connected_before: AtomicBool,
    /// Its transport's client-side connection counters.
    counters: &'static ConnectionCounters,
}

enum ConnState {
    Idle,
    Ready(Arc<ClientConn>),
    /// Ejected: the last connection attempt failed; not tried again before `retry_at`.
    Backoff {
        retry_at: Instant,
        delay: Duration,
        error: String,
    },
}

/// The connection a call goes on, and which replica it belongs to.
pub(super) struct Picked {
    pub(super) conn: Arc<ClientConn>,
    pub(super) replica: usize,
}

impl Drop for Replica {
    fn drop(&mut self) {
        if let ConnState::Ready(conn) = &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            conn.sink.close();
        }
    }
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let addresses: Vec<&str> = self
            .inner
            .replicas
            .iter()
            .map(|r| r.endpoint.address.as_str())
            .collect();
        f.debug_struct("Channel")
            .field("addresses", &addresses)
            .field("balance", &self.inner.policy)
            .finish()
    }
}

impl Channel {
    /// Connects to `address` with default settings; see [`Endpoint`] for more.
    pub async fn connect(address: &str) -> Result<Channel, ConnectError> {
        Endpoint::new(address)?.connect().await
    }

    /// A channel over several replicas of one service, each call going to
    /// one of them as `policy` picks. Connects lazily, each replica on its
    /// first call. A replica whose connection attempt fails is ejected
    /// (skipped) for its backoff delay, then tried again; a call fails with
    /// `Unavailable` only when every replica is (or waits, with
    /// [`Endpoint::wait_for_ready`]). The channel's call settings (timeout,
    /// message size, stream window, wait-for-ready) are the first endpoint's;
    /// each replica connects with its own endpoint's connect settings.
    ///
    /// ```no_run
    /// # fn run() -> Result<(), rpc_core::AddressError> {
    /// use rpc_core::{Balance, Channel, Endpoint};
    /// let shard = Channel::balance(
    ///     [Endpoint::new("tcp://10.0.0.1:50051")?, Endpoint::new("tcp://10.0.0.2:50051")?],
    ///     Balance::LeastOutstanding,
    /// )?;
    /// # Ok(()) }
    /// ```
    pub fn balance(
        endpoints: impl IntoIterator<Item = Endpoint>,
        policy: Balance,
    ) -> Result<Channel, AddressError> {
        let replicas: Vec<Arc<Replica>> = endpoints.into_iter().map(Replica::new).collect();
        if replicas.is_empty() {
            return Err(AddressError::NoEndpoints);
        }
        Ok(Channel {
            inner: Arc::new(Replicas {
                peer: Peer::new(replicas[0].endpoint.address.clone()),
                replicas,
                policy,
                next: AtomicUsize::new(0),
                serving_again: tokio::sync::Notify::new(),
            }),
        })
    }

    /// The address this channel connects to (the first replica's, for a balanced channel).
    pub fn address(&self) -> &str {
        &self.inner.replicas[0].endpoint.address
    }

    /// The server as client interceptors see it.
    pub(super) fn peer(&self) -> &Peer {
        &self.inner.peer
    }

    /// How many replicas the channel balances over (1 for a plain channel).
    pub fn replica_count(&self) -> usize {
        self.inner.replicas.len()
    }

    /// The replicas' addresses, in the order they were given.
    pub fn replica_addresses(&self) -> impl Iterator<Item = &str> {
        self.inner
            .replicas
            .iter()
            .map(|r| r.endpoint.address.as_str())
    }

    /// Marks replica `replica` (an index into
    /// [`replica_addresses`](Self::replica_addresses)) serving or not, as its
    /// health check reports (`rpc_health::watch_replicas` does this from the
    /// standard health service). New calls avoid a replica that is not
    /// serving, as they avoid an ejected one; with none serving they fail
    /// with `Unavailable`, or wait (with [`Endpoint::wait_for_ready`]) until
    /// one is marked serving again. Calls already sent are left alone.
    /// Replicas start serving. An index past the last replica is ignored.
    pub fn set_serving(&self, replica: usize, serving: bool) {
        if let Some(r) = self.inner.replicas.get(replica) {
            let was = r.serving.swap(serving, Ordering::AcqRel);
            if serving && !was {
                self.inner.serving_again.notify_waiters();
            }
        }
    }

    /// `len` bytes to fill with a large payload and send with no
    /// copy (see [`PayloadBuffer`](crate::PayloadBuffer)): memory of the
    /// connection the next call would take (connecting first if none is
    /// up). Over `rdma://` it comes from that connection's bounded pool of
    /// registered memory, and waits while the pool is full; sent on another
    /// connection (a reconnection, another replica) it still goes with no
    /// copy, registered where it lies as any `Bytes` is.
    pub async fn payload_buffer(&self, len: usize) -> Result<crate::PayloadBuffer, Status> {
        let picked = self.pick(None).await?;
        picked.conn.sink.payload_buffer(len).await.map_err(|e| {
            Status::unavailable(format!("a payload buffer from {}: {e}", picked.conn.peer))
        })
    }

    /// Whether replica `replica` is marked serving (see [`set_serving`](Self::set_serving)).
    pub fn is_serving(&self, replica: usize) -> bool {
        self.inner
            .replicas
            .get(replica)
            .is_some_and(|r| r.serving.load(Ordering::Acquire))
    }

    pub(super) fn config(&self) -> &ChannelConfig {
        &self.inner.replicas[0].endpoint.config
    }

    /// The connection for a new call: a live one, or one made now (once,
    /// for all waiting callers). `avoid` is a replica not to use if another
    /// can be (a call's retry goes elsewhere).
    pub(super) async fn pick(&self, avoid: Option<usize>) -> Result<Picked, Status> {
        if let [only] = self.inner.replicas.as_slice() {
            if let Some(conn) = only.ready_connection().filter(|_| only.is_serving()) {
                return Ok(Picked { conn, replica: 0 });
            }
        }
        // Boxed: every call's future would otherwise carry (and move) the
        // state of connecting, which only the first call and reconnections need.
        Box::pin(self.pick_or_connect(avoid)).await
    }

    async fn pick_or_connect(&self, avoid: Option<usize>) -> Result<Picked, Status> {
        let replicas = &self.inner.replicas;
        let wait = self.config().wait_for_ready;
        if let [only] = replicas.as_slice() {
            if only.is_serving() {
                let conn = only.connection(wait).await?;
                // Marked not serving while it waited: the loop below waits on.
                if only.is_serving() {
                    return Ok(Picked { conn, replica: 0 });
                }
            }
        }
        // Replicas whose attempt failed during this pick (allocates only then).
        let mut failed: Vec<usize> = Vec::new();
        loop {
            // Registered before the replicas are looked at, so a replica
            // marked serving meanwhile is not missed.
            let serving_again = self.inner.serving_again.notified();
            tokio::pin!(serving_again);
            serving_again.as_mut().enable();
            let now = Instant::now();
            let usable = |i: usize| !failed.contains(&i) && replicas[i].load(now).is_some();
            let choice = self
                .inner
                .choose(now, |i| usable(i) && Some(i) != avoid)
                .or_else(|| self.inner.choose(now, usable));
            if let Some(i) = choice {
                match replicas[i].connection(false).await {
                    Ok(conn) => return Ok(Picked { conn, replica: i }),
                    Err(_) => {
                        failed.push(i);
                        continue;
                    }
                }
            }
            // Every replica is ejected or not serving.
            if wait {
                // Until a replica's backoff ends or one is marked serving.
                let serving_retry = replicas
                    .iter()
                    .filter(|r| r.is_serving())
                    .filter_map(|r| r.retry_at())
                    .min();
                match serving_retry {
                    Some(retry_at) => {
                        tokio::select! {
                            () = tokio::time::sleep_until(retry_at) => {}
                            () = serving_again => {}
                        }
                    }
                    None if failed.is_empty() => serving_again.await,
                    // Failed just now with no backoff recorded: try again.
                    None => tokio::task::yield_now().await,
                }
                failed.clear();
                continue;
            }
            let reasons: Vec<String> = replicas
                .iter()
                .map(|r| {
                    let why = if r.is_serving() {
                        r.last_error().unwrap_or_else(|| "unavailable".into())
                    } else {
                        "not serving (its health check says so)".into()
                    };
                    format!("{}: {why}", r.endpoint.address)
                })
                .collect();
            return Err(Status::unavailable(format!(
                "all {} replicas are unavailable ({})",
                replicas.len(),
                reasons.join("; ")
            )));
        }
    }
}

impl Replicas {
    /// The replica `policy` picks among those `usable` allows.
    fn choose(&self, now: Instant, usable: impl Fn(usize) -> bool) -> Option<usize> {
        let n = self.replicas.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let in_turn = (0..n).map(|k| (start + k) % n).filter(|&i| usable(i));
        match self.policy {
            Balance::RoundRobin => in_turn.into_iter().next(),
            Balance::LeastOutstanding => in_turn
                .filter_map(|i| Some((self.replicas[i].load(now)?, i)))
                // `min_by_key` keeps the first of equals: ties go in turn.
                .min_by_key(|&(load, _)| load)
                .map(|(_, i)| i),
        }
    }
}

impl Replica {
    fn new(endpoint: Endpoint) -> Arc<Replica> {
        Arc::new(Replica {
            state: Mutex::new(ConnState::Idle),
            connecting: Arc::new(tokio::sync::Mutex::new(())),
            serving: AtomicBool::new(true),
            connected_before: AtomicBool::new(false),
            counters: ConnectionCounters::of(endpoint.transport.scheme(), Side::Client),
            endpoint,
        })
    }

    fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Acquire)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Calls in flight on this replica's connection; `None` while it is
    /// ejected or not serving.
    fn load(&self, now: Instant) -> Option<usize> {
        if !self.is_serving() {
            return None;
        }
        match &*self.state() {
            ConnState::Ready(conn) => Some(conn.open_calls()),
            ConnState::Backoff { retry_at, .. } if now < *retry_at => None,
            _ => Some(0),
        }
    }

    fn retry_at(&self) -> Option<Instant> {
        match &*self.state() {
            ConnState::Backoff { retry_at, .. } => Some(*retry_at),
            _ => None,
        }
    }

    fn last_error(&self) -> Option<String> {
        match &*self.state() {
            ConnState::Backoff { error, .. } => Some(error.clone()),
            _ => None,
        }
    }

    async fn dial(&self) -> Result<Arc<ClientConn>, ConnectError> {
        let endpoint = &self.endpoint;
        let limits = frame_limits(endpoint.config.max_message_size);
        let connecting = endpoint.transport.connect(&endpoint.authority, limits);
        let dialed = match tokio::time::timeout(endpoint.config.connect_timeout, connecting).await {
            Ok(Ok(connection)) => {
                if self.connected_before.swap(true, Ordering::Relaxed) {
                    self.counters.reconnected();
                }
                return Ok(ClientConn::start(
                    connection,
                    &endpoint.config,
                    self.counters,
                ));
            }
            Ok(Err(source)) => ConnectError::Transport {
                address: endpoint.address.clone(),
                source,
            },
            Err(_) => ConnectError::Timeout {
                address: endpoint.address.clone(),
                timeout: endpoint.config.connect_timeout,
            },
        };
        self.counters.connect_failed();
        Err(dialed)
    }

    fn ready_connection(&self) -> Option<Arc<ClientConn>> {
        match &*self.state() {
            ConnState::Ready(conn) if conn.accepts_calls() => Some(Arc::clone(conn)),
            _ => None,
        }
    }

    /// The live connection, connecting (once, for all waiting callers) if
    /// needed. While the replica backs off, fails at once with
    /// `Unavailable`, or with `wait_for_ready` waits for the next attempt
    /// (the call's deadline bounds the wait).
    async fn connection(self: &Arc<Self>, wait_for_ready: bool) -> Result<Arc<ClientConn>, Status> {
        loop {
            if let Some(conn) = self.ready_connection() {
                return Ok(conn);
            }
            let one_dialer = Arc::clone(&self.connecting).lock_owned().await;
            if let Some(conn) = self.ready_connection() {
                return Ok(conn);
            }
            let backoff = match &*self.state() {
                ConnState::Backoff {
                    retry_at,
                    delay,
                    error,
                } => Some((*retry_at, *delay, error.clone())),
                _ => None,
            };
            let previous_delay = match backoff {
                Some((retry_at, _, error)) if Instant::now() < retry_at => {
                    if wait_for_ready {
                        drop(one_dialer);
                        tokio::time::sleep_until(retry_at).await;
                        continue;
                    }
                    return Err(Status::unavailable(format!(
                        "{} is unreachable: {error}; next reconnect attempt in {:?}",
                        self.endpoint.address,
                        retry_at - Instant::now()
                    )));
                }
                Some((_, delay, _)) => Some(delay),
                None => None,
            };
            // The attempt runs in a task of its own: a caller whose deadline
            // passes abandons its wait, not the attempt (on a device where
            // connecting takes longer than calls' deadlines, abandoned
            // attempts would never connect at all).
            let replica = Arc::clone(self);
            let attempt = tokio::spawn(async move {
                let _one_dialer = one_dialer;
                let outcome = replica.dial().await;
                replica.record_attempt(outcome, previous_delay)
            });
            let outcome = match attempt.await {
                Ok(outcome) => outcome,
                // The transport's connect panicked: back off as after any
                // failure, so that waiting callers do not retry in a loop.
                Err(e) => self.record_attempt(
                    Err(ConnectError::Transport {
                        address: self.endpoint.address.clone(),
                        source: TransportError::Protocol(format!("connecting panicked: {e}")),
                    }),
                    previous_delay,
                ),
            };
            match outcome {
                Ok(conn) => return Ok(conn),
                Err(_) if wait_for_ready => continue,
                Err(status) => return Err(status),
            }
        }
    }

    /// Records how a connection attempt went: the connection, or a backoff
    /// (doubling `previous_delay`) before the next attempt.
    fn record_attempt(
        &self,
        outcome: Result<Arc<ClientConn>, ConnectError>,
        previous_delay: Option<Duration>,
    ) -> Result<Arc<ClientConn>, Status> {
        match outcome {
            Ok(conn) => {
                *self.state() = ConnState::Ready(Arc::clone(&conn));
                Ok(conn)
            }
            Err(error) => {
                let config = &self.endpoint.config;
                let delay = previous_delay
                    .map_or(config.backoff_initial, |d| (d * 2).min(config.backoff_max));
                let message = error.to_string();
                *self.state() = ConnState::Backoff {
                    retry_at: Instant::now() + delay,
                    delay,
                    error: message.clone(),
                };
                Err(Status::unavailable(message))
            }
        }
    }
}

/// Connecting: how an [`Endpoint`] becomes a [`Channel`].
impl Endpoint {
    /// Connects now; fails if the first connection cannot be made.
    pub async fn connect(self) -> Result<Channel, ConnectError> {
        let replica = Replica::new(self);
        let conn = replica.dial().await?;
        *replica.state() = ConnState::Ready(conn);
        Ok(Channel::over(replica))
    }

    /// A channel that connects on its first call.
    pub fn connect_lazy(self) -> Channel {
        Channel::over(Replica::new(self))
    }
}

impl Channel {
    fn over(replica: Arc<Replica>) -> Channel {
        Channel {
            inner: Arc::new(Replicas {
                peer: Peer::new(replica.endpoint.address.clone()),
                replicas: vec![replica],
                policy: Balance::default(),
                next: AtomicUsize::new(0),
                serving_again: tokio::sync::Notify::new(),
            }),
        }
    }
}
