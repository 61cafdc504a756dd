//! The server side: a [`Server`] accepts connections and runs each call's
//! handler in its own task; generated code implements [`Service`].
//!
//! Layout: this file has the builder and the accept loop; [`connection`]
//! reads one connection and keeps its call table; [`call`] has what a
//! handler sees ([`ServerCall`]) and the adapters generated code calls.

mod call;
mod connection;
mod runner;

pub use call::{client_streaming, server_streaming, streaming, unary, unimplemented, ServerCall};

use std::collections::HashMap;
use std::future::{pending, Future};
use std::hash::{BuildHasherDefault, Hasher};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::client::{
    frame_limits, resolve, AddressError, DEFAULT_MAX_MESSAGE_SIZE, MAX_MESSAGE_SIZE_LIMIT,
};
use crate::flow::{DEFAULT_STREAM_WINDOW, INITIAL_STREAM_WINDOW};
use crate::intercept::{Interceptor, Scoped};
use crate::keepalive::{Keepalive, DEFAULT_KEEPALIVE};
use crate::transport::stats::{ConnectionCounters, Side};
use crate::transport::{BoxFuture, Listener, TransportError};

use connection::serve_connection;

/// A service a [`Server`] routes calls to; implemented by generated `FooServer<T>` types.
pub trait Service: Send + Sync + 'static {
    /// The full protobuf name, `package.Service`.
    fn name(&self) -> &'static str;

    /// Runs one call of `method` (the protobuf method name) to completion,
    /// sending its responses and final status through `call`.
    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()>;
}

/// Starting the server failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The address is unusable.
    #[error(transparent)]
    Address(#[from] AddressError),
    /// The transport could not listen there.
    #[error("listening on {address} failed: {source}")]
    Listen {
        /// The address.
        address: String,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// A thread for [`ServerBuilder::thread_per_core`] could not start.
    #[error("starting server thread {index}: {source}")]
    Thread {
        /// Which of the threads.
        index: usize,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Entry point: `Server::builder()`.
///
/// ```no_run
/// # async fn run(service: impl rpc_core::codegen::Service) -> Result<(), rpc_core::ServeError> {
/// rpc_core::Server::builder()
///     .add_service(service)
///     .serve_with_shutdown("tcp://0.0.0.0:50051", async { tokio::signal::ctrl_c().await.ok(); })
///     .await
/// # }
/// ```
#[derive(Debug)]
pub struct Server;

impl Server {
    /// A builder to add services to and configure.
    pub fn builder() -> ServerBuilder {
        ServerBuilder {
            services: HashMap::new(),
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            stream_window: DEFAULT_STREAM_WINDOW,
            shutdown_grace: None,
            keepalive: Some(DEFAULT_KEEPALIVE),
            max_concurrent_calls: Some(DEFAULT_MAX_CONCURRENT_CALLS),
            interceptors: Vec::new(),
            inline_handlers: false,
            thread_per_core: None,
        }
    }
}

/// Calls one connection may have open at once unless the builder says otherwise.
///
/// gRPC servers advertise 100 concurrent streams (gRPC-Go's HTTP/2 default);
/// fan-out users of this framework open one call per shard on a shared
/// channel, so the bound is ten times that. What matters is that it is finite:
/// it is what bounds a connection's memory (see [`ServerBuilder`]).
pub const DEFAULT_MAX_CONCURRENT_CALLS: usize = 1024;

/// Configures a server; see [`Server`].
///
/// # What one connection can make the server hold
/// A client cannot make the server hold more than, per connection:
/// - [`max_concurrent_calls`](Self::max_concurrent_calls) open calls (default
///   [`DEFAULT_MAX_CONCURRENT_CALLS`]), each with its handler task and at most
///   one encoded reply waiting for room in the connection (a call counts as
///   open until its final status is handed to the transport, so replies a
///   client does not read hold their calls open, and further calls are
///   refused with `ResourceExhausted`);
/// - the transport's own send buffer (its write high-water mark);
/// - per call with a request stream, what the client sends ahead of the
///   handler: [`stream_window`](Self::stream_window) plus one message;
/// - refusals the connection reader answers itself (over the limit, unknown
///   method, oversized, shutting down) never wait for room: while one is
///   waiting, the reader takes no new frames from that client.
///
/// Measured (`transport-tcp/tests/unread_calls.rs`): 200,000 unary calls sent
/// on one connection by a client that reads no reply grow the server by
/// well under 64 MiB with the defaults.
pub struct ServerBuilder {
    services: HashMap<&'static str, Arc<dyn Service>>,
    max_message_size: usize,
    stream_window: u32,
    shutdown_grace: Option<Duration>,
    keepalive: Option<Keepalive>,
    max_concurrent_calls: Option<usize>,
    interceptors: Vec<Scoped>,
    inline_handlers: bool,
    thread_per_core: Option<usize>,
}

impl std::fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerBuilder")
            .field("services", &self.services.keys())
            .finish_non_exhaustive()
    }
}

impl ServerBuilder {
    /// Routes calls for `service.name()` to `service`.
    ///
    /// # Panics
    /// If a service of the same name was added already.
    pub fn add_service<S: Service>(mut self, service: S) -> ServerBuilder {
        let name = service.name();
        assert!(
            self.services.insert(name, Arc::new(service)).is_none(),
            "service {name} added twice"
        );
        self
    }

    /// Largest message received or sent (default [`DEFAULT_MAX_MESSAGE_SIZE`],
    /// 64 MiB + 64 KiB: a 64 MiB tensor field and room for the rest; at most 4 GiB - 1).
    /// A larger request fails with `ResourceExhausted`; the connection stays up.
    pub fn max_message_size(mut self, bytes: usize) -> ServerBuilder {
        self.max_message_size = bytes.min(MAX_MESSAGE_SIZE_LIMIT);
        self
    }

    /// Bytes a client may send on one request stream ahead of the handler (default 8 MiB).
    /// Enforced: a message the client starts beyond the window granted so far
    /// fails that call with `ResourceExhausted` (the connection goes on, as
    /// HTTP/2 treats a stream's flow-control error), so a call's queue of
    /// unread request messages holds at most this plus one message.
    pub fn stream_window(mut self, bytes: u32) -> ServerBuilder {
        self.stream_window = bytes.max(INITIAL_STREAM_WINDOW);
        self
    }

    /// On shutdown, how long in-flight calls may run before they are cancelled
    /// (default: as long as they take).
    pub fn shutdown_grace(mut self, grace: Duration) -> ServerBuilder {
        self.shutdown_grace = Some(grace);
        self
    }

    /// After `interval` without a frame from a client, ping it; if nothing
    /// arrives within `timeout` more, close the connection and cancel its
    /// handlers (defaults 20 s and 20 s). A client that shut down its
    /// sending side (or exited: its socket's close reads the same) is pinged
    /// every `interval` instead, and its handlers are cancelled once a ping
    /// cannot be written: within a few intervals of its leaving.
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> ServerBuilder {
        self.keepalive = Some(Keepalive { interval, timeout });
        self
    }

    /// At most `calls` calls open at once on one connection (default
    /// [`DEFAULT_MAX_CONCURRENT_CALLS`]; `usize::MAX` lifts the limit, and
    /// with it the bound on a connection's memory). Calls over the limit fail
    /// at once with `ResourceExhausted`; the client may retry. (Reading is
    /// not paused instead: open streaming calls need their next messages to
    /// finish.)
    pub fn max_concurrent_calls(mut self, calls: usize) -> ServerBuilder {
        self.max_concurrent_calls = (calls != usize::MAX).then_some(calls);
        self
    }

    /// Runs `interceptor` around every call to every service, after those
    /// added before it; see [`intercept`](crate::intercept).
    pub fn intercept(mut self, interceptor: impl Interceptor) -> ServerBuilder {
        self.interceptors.push((None, Arc::new(interceptor)));
        self
    }

    /// Runs `interceptor` around the calls to one service (`package.Service`).
    pub fn intercept_service(
        mut self,
        service: impl Into<String>,
        interceptor: impl Interceptor,
    ) -> ServerBuilder {
        self.interceptors
            .push((Some(service.into()), Arc::new(interceptor)));
        self
    }

    /// Runs-to-completion on the connection's reader (default off): a call
    /// with a single request message (unary, server-streaming) first runs
    /// its handler on the task reading the connection, and only a handler
    /// that has to wait (for I/O, a lock, a timer, room to send its reply)
    /// moves on to a task of its own, as every handler does by default.
    ///
    /// A handler that answers at once thus costs no hand-over to another
    /// task (handler tasks are kept from call to call on a connection), no
    /// extra wake-up and no task switch: −950 instructions of 15,400 per
    /// 32-byte unary echo call over `tcp://` (`cargo xtask bench
    /// --instructions`, client and server in one process). The
    /// price: while such a handler runs, the connection reads nothing, and
    /// on a multi-threaded runtime one connection's quick handlers run one
    /// after another rather than on several workers. Turn it on for
    /// services whose unary handlers are short and do not block the thread
    /// (a lookup, an in-memory update); a handler that does long work
    /// without awaiting delays every other call on its connection.
    /// Deadlines, cancellation, interceptors and tracing behave the same.
    pub fn inline_handlers(mut self, inline: bool) -> ServerBuilder {
        self.inline_handlers = inline;
        self
    }

    /// Serves each connection wholly on one of `threads` threads of its
    /// own, each running a current-thread tokio runtime (thread per core:
    /// `std::thread::available_parallelism()` threads is the usual choice),
    /// instead of on the runtime that calls `serve`.
    ///
    /// ```no_run
    /// # async fn run(service: impl rpc_core::codegen::Service) -> Result<(), rpc_core::ServeError> {
    /// let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    /// rpc_core::Server::builder()
    ///     .add_service(service)
    ///     .thread_per_core(cores)
    ///     .serve("tcp://0.0.0.0:50051")
    ///     .await
    /// # }
    /// ```
    ///
    /// The threads take turns accepting, so connections spread over them;
    /// a connection's reader, writer and handlers then never leave its
    /// thread: no wake-up crosses threads and no task is stolen. Over
    /// `tcp://` with 64 calls in flight on one connection, one thread
    /// served 10 % more 32 B echo calls a second than the default
    /// multi-threaded runtime and 5 % more 1 KiB ones; two threads (one of
    /// them idle) 4 % and 0 % (`bench-node server --thread-per-core N`,
    /// client and server processes on two cores, medians of 4 runs; see
    /// `docs/benchmarks.md`). The price: a handler that blocks its thread holds up
    /// every connection on it (spawn blocking work with
    /// `tokio::task::spawn_blocking`), and one busy connection cannot use
    /// more than its thread. `tokio::spawn` in a handler spawns on the
    /// handler's thread. The runtime that calls `serve` keeps the listener
    /// (it must keep running); an RDMA connection's driver task stays on
    /// it too (the transport starts it where it listens). Shutdown works
    /// as without threads: every thread stops accepting, tells its
    /// clients, and drains within the shutdown grace.
    ///
    /// # Panics
    /// If `threads` is 0.
    pub fn thread_per_core(mut self, threads: usize) -> ServerBuilder {
        assert!(threads > 0, "thread_per_core needs at least one thread");
        self.thread_per_core = Some(threads);
        self
    }

    /// No keepalive pings: handlers of a client whose host died run on until they finish.
    pub fn no_keepalive(mut self) -> ServerBuilder {
        self.keepalive = None;
        self
    }

    /// Listens on `address`; [`BoundServer::local_addr`] tells the port chosen for port 0.
    pub async fn bind(self, address: &str) -> Result<BoundServer, ServeError> {
        let (transport, authority) = resolve(address)?;
        let listener = transport
            .listen(&authority, frame_limits(self.max_message_size))
            .await
            .map_err(|source| ServeError::Listen {
                address: address.into(),
                source,
            })?;
        Ok(BoundServer {
            local_addr: listener.local_addr(),
            listener,
            routes: Arc::new(Routes {
                services: self.services.into_iter().collect(),
                max_message_size: self.max_message_size,
                stream_window: self.stream_window,
                keepalive: self.keepalive,
                max_concurrent_calls: self.max_concurrent_calls,
                interceptors: self.interceptors,
                inline_handlers: self.inline_handlers,
                counters: ConnectionCounters::of(transport.scheme(), Side::Server),
            }),
            shutdown_grace: self.shutdown_grace,
            thread_per_core: self.thread_per_core,
        })
    }

    /// Listens on `address` and serves until the process ends.
    pub async fn serve(self, address: &str) -> Result<(), ServeError> {
        self.bind(address).await?.serve().await
    }

    /// Listens on `address` and serves until `signal` completes, then shuts down gracefully.
    pub async fn serve_with_shutdown(
        self,
        address: &str,
        signal: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        self.bind(address).await?.serve_with_shutdown(signal).await
    }
}

struct Routes {
    /// Looked up by every call: hashed with FNV-1a (~50 instructions for a
    /// service name, SipHash ~150); the keys are the server's own, so no
    /// peer can choose keys that collide.
    services: HashMap<&'static str, Arc<dyn Service>, BuildHasherDefault<ServiceNameHasher>>,
    max_message_size: usize,
    stream_window: u32,
    keepalive: Option<Keepalive>,
    max_concurrent_calls: Option<usize>,
    interceptors: Vec<Scoped>,
    /// Whether a call with one request message first runs on the reader.
    inline_handlers: bool,
    /// Its transport's server-side connection counters.
    counters: &'static ConnectionCounters,
}

/// FNV-1a, for the table of service names (see [`Routes::services`]).
#[derive(Default)]
struct ServiceNameHasher(u64);

impl Hasher for ServiceNameHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut hash = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for &byte in bytes {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.0 = hash;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A server listening on an address, not yet serving.
pub struct BoundServer {
    listener: Box<dyn Listener>,
    local_addr: String,
    routes: Arc<Routes>,
    shutdown_grace: Option<Duration>,
    thread_per_core: Option<usize>,
}

impl std::fmt::Debug for BoundServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundServer")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl BoundServer {
    /// The address bound, as a URL clients can connect to (`tcp://127.0.0.1:40123`).
    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    /// Serves until the process ends.
    pub async fn serve(self) -> Result<(), ServeError> {
        self.serve_with_shutdown(pending()).await
    }

    /// Serves until `signal` completes, then shuts down gracefully: stops
    /// accepting, tells every client to send no new calls (GoAway), lets calls
    /// in flight finish (within the shutdown grace, if set) and closes.
    pub async fn serve_with_shutdown(
        self,
        signal: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        tracing::info!(address = %self.local_addr, "serving");
        let BoundServer {
            listener,
            local_addr,
            routes,
            shutdown_grace,
            thread_per_core,
        } = self;
        if let Some(threads) = thread_per_core {
            return Self::serve_on_threads(
                listener,
                local_addr,
                routes,
                shutdown_grace,
                threads,
                signal,
            )
            .await;
        }
        let listener = tokio::sync::Mutex::new(listener);
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let connections = accept_until(&listener, &routes, &local_addr, &shutdown_rx, signal).await;
        drop(listener);
        tracing::info!(address = %local_addr, "shutting down: draining {} connections", connections.len());
        let _ = shutdown_tx.send(true);
        drain(connections, shutdown_grace).await;
        Ok(())
    }

    /// [`serve_with_shutdown`](Self::serve_with_shutdown) with each
    /// connection on one of `threads` threads, each a current-thread
    /// runtime taking its turn at the listener
    /// ([`ServerBuilder::thread_per_core`]).
    async fn serve_on_threads(
        listener: Box<dyn Listener>,
        local_addr: String,
        routes: Arc<Routes>,
        shutdown_grace: Option<Duration>,
        threads: usize,
        signal: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        // A connection accepted on a thread has its I/O registered with
        // that thread's runtime (tokio registers with the current one); the
        // listener's own readiness stays with this runtime.
        let listener = Arc::new(tokio::sync::Mutex::new(listener));
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let mut threads_started = ServerThreads {
            shutdown: Some(shutdown_tx),
            handles: Vec::with_capacity(threads),
        };
        // Each thread holds a sender until it has drained its connections.
        let (running, mut stopped) = tokio::sync::mpsc::channel::<()>(1);
        for index in 0..threads {
            let (listener, routes, local_addr) = (
                Arc::clone(&listener),
                Arc::clone(&routes),
                local_addr.clone(),
            );
            let shutdown_rx = shutdown_rx.clone();
            let running = running.clone();
            let serve = move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        tracing::error!(address = %local_addr, "server thread {index}: no runtime: {e}");
                        return;
                    }
                };
                runtime.block_on(async {
                    let mut stop_rx = shutdown_rx.clone();
                    let stop = async {
                        let _ = stop_rx.wait_for(|stop| *stop).await;
                    };
                    let connections =
                        accept_until(&listener, &routes, &local_addr, &shutdown_rx, stop).await;
                    if *shutdown_rx.borrow() {
                        // Each connection's task ends once its last frames
                        // are out: then this runtime may go.
                        drain(connections, shutdown_grace).await;
                    }
                    // Else the serving future was dropped: its connections
                    // go with it (dropping the set aborts them), as they
                    // do without threads.
                });
                drop(running);
            };
            match std::thread::Builder::new()
                .name(format!("rpc-server-{index}"))
                .spawn(serve)
            {
                Ok(handle) => threads_started.handles.push(handle),
                Err(source) => {
                    // The threads already running stop and drain.
                    threads_started.shut_down();
                    return Err(ServeError::Thread { index, source });
                }
            }
        }
        drop(running);
        // Until the signal, or until every thread stopped (the listener
        // closed): `recv` gives `None` once every sender is gone.
        tokio::select! {
            () = signal => {}
            _ = stopped.recv() => {}
        }
        tracing::info!(address = %local_addr, "shutting down: {threads} threads draining their connections");
        threads_started.shut_down();
        while stopped.recv().await.is_some() {}
        Ok(())
    }
}

/// The threads of [`ServerBuilder::thread_per_core`]. Dropped without
/// [`shut_down`](Self::shut_down) (the serving future was dropped), it
/// tells them so: they drop their connections and end, and the drop waits
/// for that, as dropping the serving future without threads drops its
/// connections then and there.
struct ServerThreads {
    /// `true` asks for a graceful shutdown; dropped without it, the threads end at once.
    shutdown: Option<watch::Sender<bool>>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl ServerThreads {
    /// Asks every thread to stop accepting and drain its connections.
    fn shut_down(&self) {
        if let Some(shutdown) = &self.shutdown {
            let _ = shutdown.send(true);
        }
    }
}

impl Drop for ServerThreads {
    fn drop(&mut self) {
        drop(self.shutdown.take());
        for handle in self.handles.drain(..) {
            // A thread that panicked has nothing left to wait for.
            let _ = handle.join();
        }
    }
}

/// Accepts connections and serves each on a task of this runtime until
/// `stop` completes or the listener closes; returns the connections' tasks.
/// Whoever holds `listener` waits for the next connection; other threads
/// serving the same listener queue for it, in turn.
async fn accept_until(
    listener: &tokio::sync::Mutex<Box<dyn Listener>>,
    routes: &Arc<Routes>,
    local_addr: &str,
    shutdown_rx: &watch::Receiver<bool>,
    stop: impl Future<Output = ()>,
) -> JoinSet<()> {
    let mut connections = JoinSet::new();
    let mut stop = pin!(stop);
    let mut accept_errors = ErrorReportInterval::default();
    loop {
        tokio::select! {
            accepted = async {
                let mut listener = listener.lock().await;
                std::future::poll_fn(|cx| listener.poll_accept(cx)).await
            } => match accepted {
                Ok(connection) => {
                    connections.spawn(serve_connection(Arc::clone(routes), connection, shutdown_rx.clone()));
                }
                Err(TransportError::Closed) => break,
                Err(error) => {
                    // The listener already skips errors that concern one
                    // client (a reset before accept); what reaches here is
                    // the listener's own trouble (out of file descriptors,
                    // memory): retry after a short pause, report once a second.
                    if let Some(suppressed) = accept_errors.report(Instant::now()) {
                        tracing::warn!(
                            address = %local_addr,
                            "accepting connections failed: {error}; retrying every {ACCEPT_RETRY:?} \
                             ({suppressed} more failures since the last report)"
                        );
                    }
                    tokio::time::sleep(ACCEPT_RETRY).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = &mut stop => break,
        }
    }
    connections
}

/// Waits for the connections' tasks (told to shut down) to end, cancelling
/// those still running once `grace` passed.
async fn drain(mut connections: JoinSet<()>, grace: Option<Duration>) {
    let all = async { while connections.join_next().await.is_some() {} };
    match grace {
        None => all.await,
        Some(grace) => {
            if tokio::time::timeout(grace, all).await.is_err() {
                tracing::warn!(
                    "shutdown grace of {grace:?} passed: cancelling the calls still running"
                );
                connections.shutdown().await;
            }
        }
    }
}

/// Pause after the listener fails before accepting again.
const ACCEPT_RETRY: Duration = Duration::from_millis(20);

/// Reports a repeating error at most once per second, with a count of the
/// ones not reported.
#[derive(Debug, Default)]
struct ErrorReportInterval {
    last_report: Option<Instant>,
    suppressed: u64,
}

impl ErrorReportInterval {
    const INTERVAL: Duration = Duration::from_secs(1);

    /// An error happened at `now`: `Some(errors suppressed since the last
    /// report)` if this one is to be reported.
    fn report(&mut self, now: Instant) -> Option<u64> {
        match self.last_report {
            Some(last) if now.saturating_duration_since(last) < Self::INTERVAL => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last_report = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_errors_are_reported_once_a_second_with_a_count() {
        let mut interval = ErrorReportInterval::default();
        let start = Instant::now();
        assert_eq!(interval.report(start), Some(0));
        for ms in [1, 20, 999] {
            assert_eq!(interval.report(start + Duration::from_millis(ms)), None);
        }
        assert_eq!(
            interval.report(start + Duration::from_millis(1000)),
            Some(3)
        );
        assert_eq!(interval.report(start + Duration::from_millis(1500)), None);
        assert_eq!(
            interval.report(start + Duration::from_millis(2500)),
            Some(1)
        );
    }
}
