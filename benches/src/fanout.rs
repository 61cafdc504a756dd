//! The fan-out benchmark behind `cargo xtask bench --fanout`: one query to
//! every shard of a sharded service at once, its latency being the slowest
//! shard's, through rdma-rpc ([`rpc_core::fanout::FanOut`] over balanced
//! channels, optionally hedged) and through tonic (`join_all` over one
//! channel per replica, the replicas taken in turn by hand).
//!
//! The shards answer the `Echo` method of the benchmark protos after a
//! **service time**: exponentially distributed with a configured mean,
//! drawn per call from each replica's own generator; one replica may be
//! made `slow_factor` times slower. The service time is waited out on a
//! [`PreciseTimer`] (a thread with a deadline heap, ~0.1 ms accurate)
//! rather than `tokio::time::sleep`, whose 1 ms ticks would round every
//! service time up to the next millisecond.
//!
//! Server and client are separate processes (`fanout-bench server`,
//! `fanout-bench client`), both default multi-threaded tokio runtimes, as
//! in the rest of `cargo xtask bench`.

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use rpc_core::fanout::FanOut;
use rpc_core::hedging::{HedgeStats, Hedging};
use rpc_core::{Balance, Endpoint};
use tokio::sync::oneshot;

use crate::measure::latency_histogram;
use crate::{rpcbench, tcp_authority, tonicbench, Error, System};

/// The deadline each rdma-rpc fan-out runs under: long enough that every
/// shard answers (the latency measured is the whole fan-out's).
pub const FANOUT_DEADLINE: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------------
// Precise timer

/// Wakes futures at deadlines with sub-millisecond accuracy: one thread
/// sleeping on a condition variable until the earliest deadline.
pub struct PreciseTimer {
    state: Mutex<BinaryHeap<Due>>,
    wake: Condvar,
    seq: AtomicU64,
}

struct Due {
    at: Instant,
    seq: u64,
    fire: oneshot::Sender<()>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Due) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Due) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    /// Reversed: the heap's top is the earliest deadline.
    fn cmp(&self, other: &Due) -> CmpOrdering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

impl PreciseTimer {
    /// The process's timer (its thread starts on first use).
    pub fn global() -> &'static PreciseTimer {
        static TIMER: OnceLock<&'static PreciseTimer> = OnceLock::new();
        TIMER.get_or_init(|| {
            let timer: &'static PreciseTimer = Box::leak(Box::new(PreciseTimer {
                state: Mutex::new(BinaryHeap::new()),
                wake: Condvar::new(),
                seq: AtomicU64::new(0),
            }));
            std::thread::Builder::new()
                .name("precise-timer".into())
                .spawn(move || timer.run())
                .expect("spawning the timer thread");
            timer
        })
    }

    /// Completes `duration` from now (a dropped future just never fires).
    pub async fn sleep(&self, duration: Duration) {
        let (fire, fired) = oneshot::channel();
        let due = Due {
            at: Instant::now() + duration,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            fire,
        };
        let earliest = {
            let mut heap = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let earliest = heap.peek().is_none_or(|top| due.at < top.at);
            heap.push(due);
            earliest
        };
        if earliest {
            self.wake.notify_one();
        }
        let _ = fired.await;
    }

    fn run(&self) {
        let mut heap = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let now = Instant::now();
            match heap.peek().map(|top| top.at) {
                None => heap = self.wake.wait(heap).unwrap_or_else(|e| e.into_inner()),
                Some(at) if at <= now => {
                    let due = heap.pop().expect("peeked");
                    let _ = due.fire.send(());
                }
                Some(at) => {
                    heap = self
                        .wake
                        .wait_timeout(heap, at - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Servers

/// How long one replica takes to answer.
#[derive(Debug)]
pub struct ServiceTime {
    mean: Duration,
    /// xorshift64 state.
    rng: AtomicU64,
}

impl ServiceTime {
    /// Exponentially distributed service times with mean `mean`, from a
    /// generator seeded with `seed`.
    pub fn exponential(mean: Duration, seed: u64) -> ServiceTime {
        let seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        ServiceTime {
            mean,
            rng: AtomicU64::new(seed),
        }
    }

    /// The next service time.
    pub fn draw(&self) -> Duration {
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        // Uniform in (0, 1], then the exponential's inverse CDF.
        let uniform = ((x >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        self.mean.mul_f64(-uniform.ln())
    }

    /// Waits out the next service time.
    pub async fn serve(&self) {
        let time = self.draw();
        if !time.is_zero() {
            PreciseTimer::global().sleep(time).await;
        }
    }
}

/// One replica of a shard, as rdma-rpc serves it.
#[derive(Debug)]
pub struct RpcReplica(pub ServiceTime);

impl rpcbench::bench_server::Bench for RpcReplica {
    async fn echo(
        &self,
        request: rpc_core::Request<rpcbench::Payload>,
    ) -> Result<rpc_core::Response<rpcbench::Payload>, rpc_core::Status> {
        self.0.serve().await;
        Ok(rpc_core::Response::new(request.into_inner()))
    }

    async fn sink(
        &self,
        _request: rpc_core::Request<rpcbench::Payload>,
    ) -> Result<rpc_core::Response<rpcbench::Payload>, rpc_core::Status> {
        self.0.serve().await;
        Ok(rpc_core::Response::new(rpcbench::Payload::default()))
    }
}

/// One replica of a shard, as tonic serves it.
#[derive(Debug)]
pub struct TonicReplica(pub ServiceTime);

#[tonic::async_trait]
impl tonicbench::bench_server::Bench for TonicReplica {
    async fn echo(
        &self,
        request: tonic::Request<tonicbench::Payload>,
    ) -> Result<tonic::Response<tonicbench::Payload>, tonic::Status> {
        self.0.serve().await;
        Ok(tonic::Response::new(request.into_inner()))
    }

    async fn sink(
        &self,
        _request: tonic::Request<tonicbench::Payload>,
    ) -> Result<tonic::Response<tonicbench::Payload>, tonic::Status> {
        self.0.serve().await;
        Ok(tonic::Response::new(tonicbench::Payload::default()))
    }
}

/// What the shard servers of one process look like.
#[derive(Debug, Clone)]
pub struct ShardPlan {
    /// Which framework serves them.
    pub system: System,
    /// Where: `scheme://host:0` (a port each) or `scheme://host:P` (P, P+1, ...).
    pub addr: String,
    /// Shards.
    pub shards: usize,
    /// Replicas per shard.
    pub replicas: usize,
    /// Mean service time.
    pub mean: Duration,
    /// The one slow replica (shard, replica), if any.
    pub slow: Option<(usize, usize)>,
    /// How much slower it is (its mean is `mean × slow_factor`).
    pub slow_factor: f64,
}

/// Starts every replica of every shard in this process; returns each
/// shard's replica addresses (URLs). The servers run on spawned tasks until
/// the process ends.
pub async fn start_shards(plan: &ShardPlan) -> Result<Vec<Vec<String>>, Error> {
    let mut shards = Vec::with_capacity(plan.shards);
    for shard in 0..plan.shards {
        let mut addresses = Vec::with_capacity(plan.replicas);
        for replica in 0..plan.replicas {
            let mean = if plan.slow == Some((shard, replica)) {
                plan.mean.mul_f64(plan.slow_factor)
            } else {
                plan.mean
            };
            let seed = (shard as u64) << 16 | replica as u64;
            let time = ServiceTime::exponential(mean, seed + 1);
            let index = shard * plan.replicas + replica;
            let listen = address_of(&plan.addr, index);
            let address = match plan.system {
                System::Rpc => {
                    let server = rpc_core::Server::builder()
                        .add_service(rpcbench::bench_server::BenchServer::new(RpcReplica(time)))
                        .bind(&listen)
                        .await?;
                    let local = server.local_addr().to_string();
                    tokio::spawn(server.serve());
                    local
                }
                System::Tonic => {
                    let listener = tokio::net::TcpListener::bind(tcp_authority(&listen)?).await?;
                    let local = format!("tcp://{}", listener.local_addr()?);
                    let incoming = tonic::transport::server::TcpIncoming::from(listener)
                        .with_nodelay(Some(true));
                    let serving = tonic::transport::Server::builder()
                        .add_service(tonicbench::bench_server::BenchServer::new(TonicReplica(
                            time,
                        )))
                        .serve_with_incoming(incoming);
                    tokio::spawn(serving);
                    local
                }
                System::Raw | System::TonicRdma => {
                    return Err(
                        format!("the fan-out benchmark has no {} system", plan.system).into(),
                    )
                }
            };
            addresses.push(address);
        }
        shards.push(addresses);
    }
    Ok(shards)
}

/// The address of the `index`-th server: port 0 for all, or consecutive ports.
fn address_of(addr: &str, index: usize) -> String {
    match addr.rsplit_once(':') {
        Some((host, port)) => match port.parse::<usize>() {
            Ok(0) | Err(_) => addr.to_string(),
            Ok(port) => format!("{host}:{}", port + index),
        },
        None => addr.to_string(),
    }
}

/// Reads the shards a server printed (`shard S: ADDR,ADDR` lines).
pub fn parse_shard_lines(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .filter_map(|line| line.strip_prefix("shard "))
        .filter_map(|rest| rest.split_once(": "))
        .map(|(_, replicas)| replicas.trim().split(',').map(str::to_owned).collect())
        .collect()
}

// ---------------------------------------------------------------------------
// Clients

/// When hedging sends its backup request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Hedge {
    /// No hedging.
    Off,
    /// After a fixed delay.
    Fixed(Duration),
    /// After this percentile of the recent shard calls' latencies.
    Percentile(f64),
}

impl std::str::FromStr for Hedge {
    type Err = String;

    fn from_str(s: &str) -> Result<Hedge, String> {
        let number = |v: &str| {
            v.parse::<f64>()
                .map_err(|e| format!("hedge {s:?}: {e} (expected off, pNN or MS)"))
        };
        Ok(match s {
            "off" => Hedge::Off,
            p if p.starts_with('p') => Hedge::Percentile(number(&p[1..])?),
            ms => Hedge::Fixed(Duration::from_secs_f64(number(ms)? / 1e3)),
        })
    }
}

/// How one client measures.
#[derive(Debug, Clone)]
pub struct FanOutPlan {
    /// Which framework calls.
    pub system: System,
    /// Each shard's replica addresses.
    pub shards: Vec<Vec<String>>,
    /// Fan-outs in flight at once (closed loop: each worker starts its next
    /// query when the last one finished).
    pub concurrency: usize,
    /// Queries made and thrown away first.
    pub warmup: Duration,
    /// How long the measurement runs.
    pub measure: Duration,
    /// It stops earlier after this many measured queries.
    pub max_queries: u64,
    /// Hedging (rdma-rpc only).
    pub hedge: Hedge,
    /// The hedging budget (extra calls per call).
    pub budget: f64,
    /// Payload bytes per shard request.
    pub payload: usize,
}

/// What a client measured.
#[derive(Debug)]
pub struct FanOutOutcome {
    /// Whole fan-out latencies, ns.
    pub latency: Histogram<u64>,
    /// Queries measured.
    pub queries: u64,
    /// Fan-outs where some shard did not answer or failed.
    pub partial: u64,
    /// Hedging's counters over the measured window (zero without hedging).
    pub hedging: HedgeStats,
    /// Measured queries per second.
    pub queries_per_sec: f64,
}

impl FanOutOutcome {
    /// The result line `fanout-bench client` prints.
    pub fn line(&self, plan: &FanOutPlan) -> String {
        let q = |p| self.latency.value_at_quantile(p);
        format!(
            "fanout system={} shards={} concurrency={} queries={} qps={:.1} p50_ns={} p99_ns={} \
             p999_ns={} max_ns={} partial={} shard_calls={} hedges={} hedges_won={} over_budget={}",
            plan.system,
            plan.shards.len(),
            plan.concurrency,
            self.queries,
            self.queries_per_sec,
            q(0.5),
            q(0.99),
            q(0.999),
            self.latency.max(),
            self.partial,
            self.hedging.calls,
            self.hedging.hedges,
            self.hedging.hedges_won,
            self.hedging.over_budget,
        )
    }
}

/// rdma-rpc's side: per shard, one generated client on a channel balanced
/// over its replicas (least outstanding calls); one hedging policy for all
/// shard calls of this client.
struct RpcFan {
    shards: Vec<rpcbench::bench_client::BenchClient>,
    hedging: Option<Hedging>,
}

/// tonic's side: per shard, one client (one HTTP/2 connection) per replica,
/// taken in turn.
struct TonicFan {
    shards: Vec<(
        Vec<tonicbench::bench_client::BenchClient<tonic::transport::Channel>>,
        AtomicUsize,
    )>,
}

enum Fan {
    Rpc(RpcFan),
    Tonic(TonicFan),
}

impl Fan {
    async fn connect(plan: &FanOutPlan) -> Result<Fan, Error> {
        Ok(match plan.system {
            System::Rpc => {
                let mut shards = Vec::with_capacity(plan.shards.len());
                for replicas in &plan.shards {
                    let endpoints = replicas
                        .iter()
                        .map(|a| Endpoint::new(a.as_str()))
                        .collect::<Result<Vec<_>, _>>()?;
                    let channel = rpc_core::Channel::balance(endpoints, Balance::LeastOutstanding)?;
                    shards.push(rpcbench::bench_client::BenchClient::new(channel));
                }
                let hedging = match plan.hedge {
                    Hedge::Off => None,
                    Hedge::Fixed(delay) => Some(Hedging::after(delay).budget(plan.budget)),
                    // Until 20 calls have finished: 3 ms.
                    Hedge::Percentile(p) => Some(
                        Hedging::at_percentile(p, Duration::from_millis(3)).budget(plan.budget),
                    ),
                };
                Fan::Rpc(RpcFan { shards, hedging })
            }
            System::Tonic => {
                if plan.hedge != Hedge::Off {
                    return Err("the tonic comparator does not hedge".into());
                }
                let mut shards = Vec::with_capacity(plan.shards.len());
                for replicas in &plan.shards {
                    let mut clients = Vec::with_capacity(replicas.len());
                    for address in replicas {
                        let uri = format!("http://{}", tcp_authority(address)?);
                        let channel = tonic::transport::Endpoint::from_shared(uri)?
                            .tcp_nodelay(true)
                            .connect()
                            .await?;
                        clients.push(tonicbench::bench_client::BenchClient::new(channel));
                    }
                    shards.push((clients, AtomicUsize::new(0)));
                }
                Fan::Tonic(TonicFan { shards })
            }
            System::Raw | System::TonicRdma => {
                return Err(format!("the fan-out benchmark has no {} system", plan.system).into())
            }
        })
    }

    /// One whole fan-out; `Ok(true)` if every shard answered.
    async fn query(&self, payload: &Bytes) -> Result<bool, Error> {
        match self {
            Fan::Rpc(fan) => {
                let out = FanOut::within(FANOUT_DEADLINE);
                let results = out
                    .run(fan.shards.iter().map(|client| {
                        let request = || {
                            let mut request = out.request(rpcbench::Payload {
                                data: payload.clone(),
                            });
                            request.set_idempotent(true); // safe to send twice
                            request
                        };
                        let hedging = fan.hedging.as_ref();
                        async move {
                            match hedging {
                                Some(h) => h.call(|| client.echo(request())).await,
                                None => client.echo(request()).await,
                            }
                        }
                    }))
                    .await;
                Ok(!results.is_partial())
            }
            Fan::Tonic(fan) => {
                let calls = fan.shards.iter().map(|(replicas, next)| {
                    let turn = next.fetch_add(1, Ordering::Relaxed) % replicas.len();
                    let mut client = replicas[turn].clone();
                    let request = tonicbench::Payload {
                        data: payload.clone(),
                    };
                    async move { client.echo(request).await }
                });
                let results = futures::future::join_all(calls).await;
                Ok(results.iter().all(Result::is_ok))
            }
        }
    }

    fn hedge_stats(&self) -> HedgeStats {
        match self {
            Fan::Rpc(RpcFan {
                hedging: Some(h), ..
            }) => h.stats(),
            _ => HedgeStats::default(),
        }
    }
}

/// Connects, warms up (every replica connected first), and measures whole
/// fan-outs with `plan.concurrency` workers.
pub async fn measure(plan: &FanOutPlan) -> Result<FanOutOutcome, Error> {
    let fan = Arc::new(Fan::connect(plan).await?);
    let payload = crate::measure::payload(plan.payload);
    // Connect every replica (an idle balanced channel takes its replicas in turn).
    let max_replicas = plan.shards.iter().map(Vec::len).max().unwrap_or(1);
    for _ in 0..2 * max_replicas {
        fan.query(&payload).await?;
    }
    let start = Instant::now();
    let measure_from = start + plan.warmup;
    let until = measure_from + plan.measure;
    let measured = Arc::new(AtomicU64::new(0));
    // The hedging counters at the start of the measured window.
    let at_start: Arc<Mutex<Option<HedgeStats>>> = Arc::new(Mutex::new(None));
    let mut workers = Vec::with_capacity(plan.concurrency);
    for _ in 0..plan.concurrency.max(1) {
        let (fan, payload, measured, at_start) = (
            Arc::clone(&fan),
            payload.clone(),
            Arc::clone(&measured),
            Arc::clone(&at_start),
        );
        let max_queries = plan.max_queries;
        workers.push(tokio::spawn(async move {
            let mut histogram = latency_histogram();
            let mut partial = 0u64;
            loop {
                let began = Instant::now();
                if began >= until || measured.load(Ordering::Relaxed) >= max_queries {
                    break;
                }
                if began >= measure_from {
                    let mut first = at_start.lock().unwrap_or_else(|e| e.into_inner());
                    if first.is_none() {
                        *first = Some(fan.hedge_stats());
                    }
                }
                let complete = fan.query(&payload).await?;
                if began >= measure_from {
                    let ns = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    histogram.record(ns.max(1))?;
                    measured.fetch_add(1, Ordering::Relaxed);
                    partial += u64::from(!complete);
                }
            }
            Ok::<_, Error>((histogram, partial))
        }));
    }
    let mut latency = latency_histogram();
    let mut partial = 0;
    for worker in workers {
        let (histogram, p) = worker.await??;
        latency.add(&histogram)?;
        partial += p;
    }
    let elapsed = start.elapsed().saturating_sub(plan.warmup);
    let end = fan.hedge_stats();
    let begin = at_start
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or_default();
    let queries = latency.len();
    let shard_calls = queries * plan.shards.len() as u64;
    let hedging = HedgeStats {
        // Shard calls of the measured queries (the hedging policy's own
        // count also has the calls of queries still running at the edges).
        calls: shard_calls,
        hedges: end.hedges - begin.hedges,
        hedges_won: end.hedges_won - begin.hedges_won,
        over_budget: end.over_budget - begin.over_budget,
    };
    Ok(FanOutOutcome {
        latency,
        queries,
        partial,
        hedging,
        queries_per_sec: queries as f64 / elapsed.as_secs_f64().max(1e-9),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_times_are_exponential_around_the_mean() {
        let time = ServiceTime::exponential(Duration::from_millis(1), 7);
        let n = 100_000;
        let total: Duration = (0..n).map(|_| time.draw()).sum();
        let mean = total.as_secs_f64() / n as f64;
        assert!((mean - 1e-3).abs() < 0.05e-3, "mean {mean}");
    }

    #[test]
    fn hedge_arguments_parse() {
        assert_eq!("off".parse::<Hedge>(), Ok(Hedge::Off));
        assert_eq!("p95".parse::<Hedge>(), Ok(Hedge::Percentile(95.0)));
        assert_eq!(
            "2.5".parse::<Hedge>(),
            Ok(Hedge::Fixed(Duration::from_micros(2500)))
        );
        assert!("fast".parse::<Hedge>().is_err());
    }

    #[test]
    fn shard_lines_parse() {
        let text = "shard 0: tcp://a:1,tcp://a:2\nshard 1: tcp://a:3,tcp://a:4\nready\n";
        let shards = parse_shard_lines(text);
        assert_eq!(shards.len(), 2);
        assert_eq!(shards[1], vec!["tcp://a:3", "tcp://a:4"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_precise_timer_is_precise() {
        let timer = PreciseTimer::global();
        let began = Instant::now();
        timer.sleep(Duration::from_micros(300)).await;
        let took = began.elapsed();
        assert!(took >= Duration::from_micros(300), "{took:?}");
        assert!(took < Duration::from_millis(20), "{took:?}");
    }
}
