//! Prometheus metrics for rdma-rpc servers and clients: calls started and
//! finished per method and status, latency histograms and calls in flight,
//! recorded by [interceptors](rpc_core::intercept) into a
//! [`prometheus_client`] registry; per transport, connections, reconnects,
//! send stalls and what the transport reports itself (RDMA's pinned memory
//! and device events); and a `/metrics` endpoint to scrape.
//!
//! ```
//! use prometheus_client::registry::Registry;
//! use rpc_metrics::{MetricsServer, RpcMetrics, TransportMetrics};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut registry = Registry::default();
//! let metrics = RpcMetrics::register(&mut registry);
//! TransportMetrics::register(&mut registry); // rpc_transport_*
//! let server = rpc_core::Server::builder().intercept(metrics.server());
//! let shards = rpc_core::Endpoint::new("mem://shard-0")?.intercept(metrics.client());
//!
//! let endpoint = MetricsServer::bind("127.0.0.1:0", registry).await?;
//! println!("scrape http://{}/metrics", endpoint.local_addr());
//! tokio::spawn(endpoint.serve());
//! # drop((server, shards)); Ok(()) }
//! ```
//!
//! # What is exported
//! Names follow `go-grpc-prometheus`, so its dashboards read them; every
//! series has the labels `service` and `method`:
//!
//! | metric | type | what |
//! |---|---|---|
//! | `rpc_server_started_total` | counter | calls a server's interceptors admitted so far |
//! | `rpc_server_handled_total` | counter | calls ended, by `code` (`OK`, `NOT_FOUND`, …) |
//! | `rpc_server_handling_seconds` | histogram | from arrival to the final status |
//! | `rpc_server_in_flight` | gauge | calls started and not yet ended |
//! | `rpc_client_started_total` | counter | calls a client sent |
//! | `rpc_client_handled_total` | counter | calls with a single response ended, by `code` |
//! | `rpc_client_handling_seconds` | histogram | their latency, as the caller saw it |
//!
//! A client's streaming-response calls are counted as started only: the
//! client's interceptors hear the end of calls with a single response.
//! A side keeps series for at most 1,024 methods; calls to further methods
//! (a client calling made-up names, say) are counted under
//! `method="(other)"`, so nothing a peer sends grows the series without end.
//!
//! ## Per transport
//! [`TransportMetrics::register`] adds the `rpc_transport_*` families,
//! labelled by `scheme` (`tcp`, `rdma`, `mem`) and, where both ends count,
//! `side` (`client`, `server`). They count every connection of a
//! `Channel` or a `Server` in the process (rpc-core keeps the counters),
//! whether or not the interceptors are installed:
//!
//! | metric | type | what |
//! |---|---|---|
//! | `rpc_transport_connections_opened_total` | counter | connections established |
//! | `rpc_transport_connections_closed_total` | counter | connections ended (closed, broken, found dead by keepalive) |
//! | `rpc_transport_connections_open` | gauge | connections open now |
//! | `rpc_transport_reconnects_total` | counter | connections a client made to replace one it lost (no `side`) |
//! | `rpc_transport_connect_failures_total` | counter | client connection attempts that failed or timed out (no `side`) |
//! | `rpc_transport_send_stalls_total` | counter | sends that found no room and waited: on RDMA the peer's credits, on TCP the write buffer past its high-water mark (a slow reader) |
//!
//! A transport adds what only it knows
//! ([`Transport::stats`](rpc_core::transport::Transport::stats)); the RDMA
//! transport reports:
//!
//! | metric | type | what |
//! |---|---|---|
//! | `rpc_transport_rdma_pinned_bytes` | gauge | memory registered with the devices now (whole pages) |
//! | `rpc_transport_rdma_verbs_objects` | gauge | verbs objects held now, by `kind`: `queue_pair`, `completion_queue` and `completion_channel` (one per connection end), `protection_domain` (one per device), `memory_registration` (a few per device for idle ends; more while traffic needs them) |
//! | `rpc_transport_rdma_device_events_total` | counter | device async events read, by `device` and `event` (`port_err`, `port_active`, `qp_fatal`, `device_fatal`, …) |
//! | `rpc_transport_rdma_connections_refused_total` | counter | connect requests the process's listeners refused, by `reason` |
//! | `rpc_transport_rdma_rendezvous_sent_bytes_total` | counter | bytes of rendezvous frames sent, by `how`: `in_place` (the peer read them where the application left them), `payload_buffer` (out of a payload buffer) or `copied` (into registered memory first) |
//!
//! These cost nothing per call: the counters are relaxed atomics touched
//! once per connection (opened, closed) and per send that finds no room;
//! a scrape reads them. Being process-wide, they read the same in every
//! registry they are registered in.
//!
//! Not exported: bytes per method. The interceptor hooks see a call's head
//! and its end, not its messages; counting sizes would take a field and an
//! addition per message in rpc-core's call paths, left for when the hooks
//! grow a per-message event.
//!
//! Why `prometheus-client` and not the `metrics` facade: it is the
//! Prometheus project's own Rust client, keeps metrics in a registry the
//! application owns (no process-global recorder a library must not
//! install), and encodes the OpenMetrics text format without an exporter
//! crate. Per call, a method's counters are found among the few each thread
//! used last, by comparing the path; else by one read-locked map lookup on
//! it (its label set is built once per method, not per call).

use std::cell::RefCell;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use rpc_core::intercept::{CallEnd, CallHead, Interceptor};
use rpc_core::Status;
use rustc_hash::FxHashMap;
use tokio::net::{TcpListener, ToSocketAddrs};

mod transport;

pub use transport::TransportMetrics;

/// A method's labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    service: String,
    method: String,
}

/// A method's labels and a status code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandledLabels {
    service: String,
    method: String,
    code: &'static str,
}

type HistogramFamily = Family<MethodLabels, LatencyHistogram>;

/// Upper bound of the first latency bucket, nanoseconds: buckets go from
/// 50 µs to 1.6 s, doubling, then `+Inf`.
const FIRST_BUCKET_NANOS: u64 = 50_000;
/// Latency buckets with an upper bound (the `+Inf` one follows).
const BOUNDED_BUCKETS: usize = 16;

/// A latency histogram recorded with two relaxed atomic additions and no
/// lock: the bucket of a duration is found by arithmetic (the bounds
/// double), not by a search. prometheus-client's own `Histogram` takes a
/// lock and scans its buckets on every observation.
#[derive(Debug, Clone, Default)]
struct LatencyHistogram(Arc<LatencyCounts>);

#[derive(Debug, Default)]
struct LatencyCounts {
    /// Observations per bucket (not cumulative), `+Inf` last.
    buckets: [AtomicU64; BOUNDED_BUCKETS + 1],
    sum_nanos: AtomicU64,
}

impl LatencyHistogram {
    fn observe(&self, elapsed: std::time::Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.0.buckets[bucket_of(nanos)].fetch_add(1, Ordering::Relaxed);
        self.0.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }
}

/// The bucket of a duration: the first whose bound (50 µs × 2^i) it does
/// not exceed; `BOUNDED_BUCKETS` (`+Inf`) past the last.
fn bucket_of(nanos: u64) -> usize {
    let multiples = nanos.saturating_sub(1) / FIRST_BUCKET_NANOS;
    ((u64::BITS - multiples.leading_zeros()) as usize).min(BOUNDED_BUCKETS)
}

impl TypedMetric for LatencyHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for LatencyHistogram {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut buckets = [(0.0, 0); BOUNDED_BUCKETS + 1];
        let mut count = 0;
        for (i, (bound, n)) in buckets.iter_mut().enumerate() {
            *bound = if i < BOUNDED_BUCKETS {
                (FIRST_BUCKET_NANOS << i) as f64 / 1e9
            } else {
                f64::INFINITY // written as +Inf
            };
            *n = self.0.buckets[i].load(Ordering::Relaxed);
            count += *n;
        }
        let sum = self.0.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The most methods a side keeps series for; see [`Side::method`].
const MAX_METHODS: usize = 1024;

/// The method label of calls past [`MAX_METHODS`] (its service label is empty).
const OTHER_METHOD: &str = "(other)";

/// The number of gRPC status codes.
const CODES: usize = 17;

/// One side's (server's or client's) metric families, and each method's
/// handles into them.
#[derive(Debug)]
struct Side {
    /// Tells this side's methods apart from other sides' in
    /// [`RECENT_METHODS`] (an address could be reused once a side is
    /// dropped; an id is not).
    id: u64,
    started: Family<MethodLabels, Counter>,
    handled: Family<HandledLabels, Counter>,
    seconds: HistogramFamily,
    in_flight: Family<MethodLabels, Gauge>,
    by_path: RwLock<FxHashMap<String, Arc<PerMethod>>>,
}

/// A method's series, looked up once and kept.
#[derive(Debug)]
struct PerMethod {
    /// The path its calls name (`OTHER_METHOD` for the shared series).
    path: Box<str>,
    labels: MethodLabels,
    started: Counter,
    seconds: LatencyHistogram,
    in_flight: Gauge,
    handled: [OnceLock<Counter>; CODES],
}

/// The next [`Side::id`].
static NEXT_SIDE_ID: AtomicU64 = AtomicU64::new(0);

/// How many methods [`RECENT_METHODS`] keeps per thread.
const RECENT: usize = 8;

/// A method this thread looked up lately: its side's id and its series.
type RecentMethod = Option<(u64, Arc<PerMethod>)>;

thread_local! {
    /// The methods this thread looked up lately, newest first. A call's
    /// start and end each find their method here with a comparison of the
    /// path, not by hashing it and probing the side's map under its lock,
    /// whose reader count every thread recording a call would otherwise
    /// write to.
    static RECENT_METHODS: RefCell<[RecentMethod; RECENT]> =
        const { RefCell::new([const { None }; RECENT]) };
}

impl Side {
    fn register(registry: &mut Registry, side: &str, in_flight: bool) -> Side {
        let this = Side {
            id: NEXT_SIDE_ID.fetch_add(1, Ordering::Relaxed),
            started: Family::default(),
            handled: Family::default(),
            seconds: Family::default(),
            in_flight: Family::default(),
            by_path: RwLock::new(FxHashMap::default()),
        };
        registry.register(
            format!("rpc_{side}_started"),
            format!("Calls started by the {side}"),
            this.started.clone(),
        );
        registry.register(
            format!("rpc_{side}_handled"),
            format!("Calls ended at the {side}, by status code"),
            this.handled.clone(),
        );
        registry.register(
            format!("rpc_{side}_handling_seconds"),
            format!("Call latency at the {side}, seconds"),
            this.seconds.clone(),
        );
        if in_flight {
            registry.register(
                format!("rpc_{side}_in_flight"),
                format!("Calls started and not yet ended at the {side}"),
                this.in_flight.clone(),
            );
        }
        this
    }

    /// Runs `record` on the method's series: found among this thread's
    /// [`RECENT_METHODS`] (no lock taken, no reference count touched), else
    /// in the side's map (and kept among them), or made on the method's
    /// first call. A miss costs the map's lookup, as every call did before
    /// the cache, and two reference counts (the method's, the one it
    /// evicts): a thread that records more methods in turn than it keeps
    /// loses little.
    fn with_method(&self, path: &str, record: impl FnOnce(&PerMethod)) {
        let mut record = Some(record);
        let _ = RECENT_METHODS.try_with(|recent| {
            // Busy only if `record` called back into a side (it does not);
            // that inner call would look its method up below, uncached.
            let Ok(mut recent) = recent.try_borrow_mut() else {
                return;
            };
            let hit = recent
                .iter()
                .flatten()
                .find(|(side, method)| *side == self.id && *method.path == *path);
            if let Some((_, method)) = hit {
                if let Some(record) = record.take() {
                    record(method);
                }
                return;
            }
            let method = self.find_or_make(path);
            if let Some(record) = record.take() {
                record(&method);
            }
            // Past the cap a call counts under `OTHER_METHOD`'s series,
            // which a lookup by the call's own path would never find here.
            if *method.path == *path {
                recent.rotate_right(1);
                recent[0] = Some((self.id, method));
            }
        });
        // Not recorded above: the thread is exiting (its locals are gone),
        // or `record` called back.
        if let Some(record) = record.take() {
            record(&self.find_or_make(path));
        }
    }

    /// The method's series from the side's map, made on its first call.
    fn find_or_make(&self, path: &str) -> Arc<PerMethod> {
        // Not a `match` on the lookup: its read guard would live through
        // `method`, which takes the write lock.
        let found = read(&self.by_path).get(path).map(Arc::clone);
        found.unwrap_or_else(|| self.method(path))
    }

    /// The method's series, created on its first call. Past
    /// [`MAX_METHODS`] methods, new ones share the series of method
    /// `OTHER_METHOD`: a client that calls made-up method names cannot
    /// make the server's series (and its memory) grow without end.
    fn method(&self, path: &str) -> Arc<PerMethod> {
        let full = read(&self.by_path).len() >= MAX_METHODS;
        let (path, labels) = if full {
            let labels = MethodLabels {
                service: String::new(),
                method: OTHER_METHOD.to_string(),
            };
            (OTHER_METHOD, labels)
        } else {
            let labels = MethodLabels {
                service: service_of(path).to_string(),
                method: path.rsplit_once('/').map_or("", |(_, m)| m).to_string(),
            };
            (path, labels)
        };
        let created = Arc::new(PerMethod {
            path: path.into(),
            started: self.started.get_or_create_owned(&labels),
            seconds: self.seconds.get_or_create_owned(&labels),
            in_flight: self.in_flight.get_or_create_owned(&labels),
            handled: Default::default(),
            labels,
        });
        let mut by_path = self.by_path.write().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = by_path.get(path) {
            return Arc::clone(found); // made meanwhile, or the shared "(other)"
        }
        if by_path.len() >= MAX_METHODS && path != OTHER_METHOD {
            // Filled up meanwhile: count it with the others.
            drop(by_path);
            return self.method(OTHER_METHOD);
        }
        Arc::clone(by_path.entry(path.to_string()).or_insert(created))
    }

    fn started(&self, path: &str, in_flight: bool) {
        self.with_method(path, |method| {
            method.started.inc();
            if in_flight {
                method.in_flight.inc();
            }
        });
    }

    fn ended(&self, end: &CallEnd<'_>, in_flight: bool) {
        self.with_method(end.path(), |method| {
            if in_flight {
                method.in_flight.dec();
            }
            method.seconds.observe(end.elapsed());
            let code = end.status().code();
            // Codes are numbered 0..CODES; any other counts as UNKNOWN (2).
            let index = Some(code as usize).filter(|&i| i < CODES).unwrap_or(2);
            method.handled[index]
                .get_or_init(|| {
                    self.handled.get_or_create_owned(&HandledLabels {
                        service: method.labels.service.clone(),
                        method: method.labels.method.clone(),
                        code: code.as_str(),
                    })
                })
                .inc();
        });
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|e| e.into_inner())
}

fn service_of(path: &str) -> &str {
    path.strip_prefix('/')
        .and_then(|p| p.split_once('/'))
        .map_or("", |(service, _)| service)
}

/// The metrics of a process's servers and clients, registered in one
/// registry; hand [`server`](Self::server) and [`client`](Self::client) to
/// `ServerBuilder::intercept` and `Endpoint::intercept`. Clones share the
/// same series.
#[derive(Debug, Clone)]
pub struct RpcMetrics {
    server: Arc<Side>,
    client: Arc<Side>,
}

impl RpcMetrics {
    /// Registers the metric families (see the [crate docs](crate)) in `registry`.
    pub fn register(registry: &mut Registry) -> RpcMetrics {
        RpcMetrics {
            server: Arc::new(Side::register(registry, "server", true)),
            client: Arc::new(Side::register(registry, "client", false)),
        }
    }

    /// The interceptor for servers (`ServerBuilder::intercept`). Added
    /// first, it also counts calls later interceptors reject.
    pub fn server(&self) -> ServerMetrics {
        ServerMetrics(Arc::clone(&self.server))
    }

    /// The interceptor for clients (`Endpoint::intercept`).
    pub fn client(&self) -> ClientMetrics {
        ClientMetrics(Arc::clone(&self.client))
    }
}

/// Records a server's calls; from [`RpcMetrics::server`].
#[derive(Debug, Clone)]
pub struct ServerMetrics(Arc<Side>);

impl Interceptor for ServerMetrics {
    fn on_call(&self, call: &mut CallHead<'_>) -> Result<(), Status> {
        self.0.started(call.path(), true);
        Ok(())
    }

    fn on_end(&self, call: &CallEnd<'_>) {
        self.0.ended(call, true);
    }
}

/// Records a client's calls; from [`RpcMetrics::client`].
#[derive(Debug, Clone)]
pub struct ClientMetrics(Arc<Side>);

impl Interceptor for ClientMetrics {
    fn on_call(&self, call: &mut CallHead<'_>) -> Result<(), Status> {
        self.0.started(call.path(), false);
        Ok(())
    }

    fn on_end(&self, call: &CallEnd<'_>) {
        self.0.ended(call, false);
    }
}

/// How long a scrape's request head may take to arrive.
const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The OpenMetrics content type Prometheus asks for.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// An HTTP endpoint that serves a registry at `GET /metrics` (404 for any
/// other path) in the OpenMetrics text format, for Prometheus to scrape.
#[derive(Debug)]
pub struct MetricsServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    registry: Arc<Registry>,
}

impl MetricsServer {
    /// Listens on `address` (port 0 picks one: see [`local_addr`](Self::local_addr)).
    pub async fn bind(
        address: impl ToSocketAddrs,
        registry: Registry,
    ) -> io::Result<MetricsServer> {
        let listener = TcpListener::bind(address).await?;
        Ok(MetricsServer {
            local_addr: listener.local_addr()?,
            listener,
            registry: Arc::new(registry),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves scrapes until dropped (its connections with it); each
    /// connection on a task of its own, closed if a request's head does not
    /// arrive within 10 s.
    pub async fn serve(self) {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            // Reap the connections that ended.
            while connections.try_join_next().is_some() {}
            let stream = match self.listener.accept().await {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of descriptors, say: the next accept may work.
                    tracing::warn!("metrics endpoint: accept failed: {error}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let registry = Arc::clone(&self.registry);
            connections.spawn(async move {
                let scrape = service_fn(move |request| {
                    let response = respond(&registry, &request);
                    async move { Ok::<_, Infallible>(response) }
                });
                if let Err(error) = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_READ_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), scrape)
                    .await
                {
                    tracing::debug!("metrics endpoint: connection ended: {error}");
                }
            });
        }
    }
}

fn respond(
    registry: &Registry,
    request: &hyper::Request<Incoming>,
) -> hyper::Response<Full<Bytes>> {
    let (status, content_type, body) = match (request.method(), request.uri().path()) {
        (&Method::GET, "/metrics") => {
            let mut text = String::new();
            match prometheus_client::encoding::text::encode(&mut text, registry) {
                Ok(()) => (StatusCode::OK, OPENMETRICS, text),
                Err(error) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    format!("encoding the metrics failed: {error}\n"),
                ),
            }
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "metrics are at GET /metrics\n".to_string(),
        ),
    };
    let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn latencies_fall_in_the_first_bucket_whose_bound_they_do_not_exceed() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(50_000), 0);
        assert_eq!(bucket_of(50_001), 1);
        assert_eq!(bucket_of(100_000), 1);
        assert_eq!(bucket_of(100_001), 2);
        assert_eq!(bucket_of(50_000 << 15), 15, "1.6384 s, the last bound");
        assert_eq!(bucket_of((50_000 << 15) + 1), BOUNDED_BUCKETS, "+Inf");
        assert_eq!(bucket_of(u64::MAX), BOUNDED_BUCKETS);

        let mut registry = Registry::default();
        let histogram = LatencyHistogram::default();
        registry.register("latency", "test", histogram.clone());
        for micros in [10, 50, 70, 3_000, 5_000_000] {
            histogram.observe(Duration::from_micros(micros));
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "latency_bucket{le=\"0.00005\"} 2",
            "latency_bucket{le=\"0.0001\"} 3",
            "latency_bucket{le=\"0.0032\"} 4",
            "latency_bucket{le=\"1.6384\"} 4",
            "latency_bucket{le=\"+Inf\"} 5",
            "latency_count 5",
            "latency_sum 5.00313",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
    }

    #[test]
    fn sides_sharing_a_thread_count_their_own_calls() {
        // Two registries' server sides, and more methods than a thread
        // keeps among its recent ones: hits and misses, interleaved.
        let (mut first, mut second) = (Registry::default(), Registry::default());
        let sides = [
            Side::register(&mut first, "server", true),
            Side::register(&mut second, "server", true),
        ];
        let methods = RECENT + 2;
        for _ in 0..3 {
            for m in 0..methods {
                for (s, side) in sides.iter().enumerate() {
                    // Side s records method m (s + 1) times a round.
                    for _ in 0..=s {
                        side.started(&format!("/demo.Demo/M{m}"), false);
                    }
                }
            }
        }
        for (s, registry) in [first, second].iter().enumerate() {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
            for m in 0..methods {
                let line = format!(
                    "rpc_server_started_total{{service=\"demo.Demo\",method=\"M{m}\"}} {}\n",
                    3 * (s + 1)
                );
                assert!(text.contains(&line), "{line:?} missing from:\n{text}");
            }
        }
    }

    #[test]
    fn a_side_records_without_the_threads_cache() {
        // As on a thread whose locals are gone: the map alone, for a
        // method's first call (which takes the map's write lock) and later.
        let mut registry = Registry::default();
        let side = Arc::new(Side::register(&mut registry, "server", true));
        let (done, finished) = std::sync::mpsc::channel();
        let recording = Arc::clone(&side);
        std::thread::spawn(move || {
            RECENT_METHODS.with_borrow_mut(|_| {
                recording.started("/demo.Demo/Uncached", false);
                recording.started("/demo.Demo/Uncached", false);
            });
            let _ = done.send(());
        });
        finished
            .recv_timeout(Duration::from_secs(10))
            .expect("recording without the cache deadlocked");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(
                "rpc_server_started_total{service=\"demo.Demo\",method=\"Uncached\"} 2\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn methods_past_the_cap_share_one_series() {
        let mut registry = Registry::default();
        let side = Side::register(&mut registry, "server", true);
        for i in 0..MAX_METHODS + 6 {
            side.started(&format!("/demo.Demo/Made{i}"), false);
        }
        side.started("/demo.Demo/Made0", false);
        assert_eq!(read(&side.by_path).len(), MAX_METHODS + 1);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("rpc_server_started_total{service=\"\",method=\"(other)\"} 6\n"),
            "{text}"
        );
        assert!(
            text.contains("rpc_server_started_total{service=\"demo.Demo\",method=\"Made0\"} 2\n"),
            "{text}"
        );
    }
}
