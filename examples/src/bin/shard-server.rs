//! A stand-in for a sharded model, for the fan-out example:
//!
//! ```text
//! shard-server --addr tcp://127.0.0.1:0 --shards 4 --replicas 2 \
//!     --service-time-us 2000 --slow 0:0 --slow-factor 10
//! ```
//!
//! Serves `shards × replicas` servers of `shard.Model` in one process (one
//! per address: with port 0 each gets a port; with port P they take P, P+1,
//! ...; a real deployment runs one per host with `--shards 1 --replicas 1`).
//! Each answers `Infer` after a service time drawn from an exponential
//! distribution with the given mean; `--slow SHARD:REPLICA` makes one
//! replica `--slow-factor` times slower. Prints one line per shard,
//! `shard S: ADDR,ADDR` (its replicas, the `--shard` argument of
//! `fanout-client`), then `ready`; shuts down on Ctrl-C. Each server also
//! serves the standard health service (`grpc.health.v1.Health`), reporting
//! `shard.Model` serving until shutdown begins. With `--metrics-addr
//! HOST:PORT` the servers record `rpc-metrics` (summed over the process's
//! servers), with the transport's (connections, send stalls, on RDMA
//! pinned memory and device events), and serve them at
//! `http://HOST:PORT/metrics`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use examples::shard::model_server::{Model, ModelServer};
use examples::shard::{InferReply, InferRequest};
use rpc_core::{Request, Response, Status};

const USAGE: &str = "usage: shard-server [--addr scheme://host:port] [--shards N] [--replicas R]
                    [--service-time-us MEAN] [--slow SHARD:REPLICA] [--slow-factor F]
                    [--metrics-addr HOST:PORT]";

/// How long calls still running at shutdown may go on before they are cancelled.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

struct Replica {
    shard: u32,
    replica: u32,
    mean: Duration,
    /// State of this replica's random number generator (xorshift).
    rng: AtomicU64,
}

impl Replica {
    /// An exponentially distributed service time with mean `self.mean`.
    fn service_time(&self) -> Duration {
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        // Uniform in (0, 1], then the exponential's inverse CDF.
        let uniform = ((x >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        self.mean.mul_f64(-uniform.ln())
    }
}

impl Model for Replica {
    async fn infer(&self, request: Request<InferRequest>) -> Result<Response<InferReply>, Status> {
        tokio::time::sleep(self.service_time()).await;
        let request = request.into_inner();
        // A stand-in for the shard's scores: one byte per feature.
        let scores = request
            .features
            .iter()
            .map(|f| f.wrapping_mul(31).wrapping_add(self.shard as u8))
            .collect();
        Ok(Response::new(InferReply {
            query: request.query,
            shard: self.shard,
            replica: self.replica,
            scores,
        }))
    }
}

struct Args {
    addr: String,
    shards: u32,
    replicas: u32,
    mean: Duration,
    slow: Option<(u32, u32)>,
    slow_factor: f64,
    metrics_addr: Option<String>,
}

fn parse_args() -> Args {
    let mut args = Args {
        addr: "tcp://127.0.0.1:0".into(),
        shards: 4,
        replicas: 2,
        mean: Duration::from_micros(2000),
        slow: None,
        slow_factor: 10.0,
        metrics_addr: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let Some(value) = it.next() else { usage() };
        match flag.as_str() {
            "--addr" => args.addr = value,
            "--shards" => args.shards = value.parse().unwrap_or_else(|_| usage()),
            "--replicas" => args.replicas = value.parse().unwrap_or_else(|_| usage()),
            "--service-time-us" => {
                args.mean = Duration::from_micros(value.parse().unwrap_or_else(|_| usage()))
            }
            "--slow" => {
                let (s, r) = value.split_once(':').unwrap_or_else(|| usage());
                args.slow = Some((
                    s.parse().unwrap_or_else(|_| usage()),
                    r.parse().unwrap_or_else(|_| usage()),
                ));
            }
            "--slow-factor" => args.slow_factor = value.parse().unwrap_or_else(|_| usage()),
            "--metrics-addr" => args.metrics_addr = Some(value),
            _ => usage(),
        }
    }
    if args.shards == 0 || args.replicas == 0 {
        usage();
    }
    args
}

fn usage() -> ! {
    eprintln!("{USAGE}");
    std::process::exit(2)
}

/// The address of the `index`-th server: port 0 for all, or consecutive ports.
fn address_of(addr: &str, index: u32) -> String {
    match addr.rsplit_once(':') {
        Some((host, port)) => match port.parse::<u32>() {
            Ok(0) | Err(_) => addr.to_string(),
            Ok(port) => format!("{host}:{}", port + index),
        },
        None => addr.to_string(),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    examples::init_logging();
    examples::install_transports();
    let args = parse_args();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let metrics = match &args.metrics_addr {
        Some(address) => {
            let mut registry = prometheus_client::registry::Registry::default();
            let metrics = rpc_metrics::RpcMetrics::register(&mut registry);
            rpc_metrics::TransportMetrics::register(&mut registry);
            let endpoint = rpc_metrics::MetricsServer::bind(address.as_str(), registry).await?;
            println!("metrics: http://{}/metrics", endpoint.local_addr());
            tokio::spawn(endpoint.serve());
            Some(metrics)
        }
        None => None,
    };
    let mut servers = Vec::new();
    let mut reporters = Vec::new();
    for shard in 0..args.shards {
        let mut addresses = Vec::new();
        for replica in 0..args.replicas {
            let slow = args.slow == Some((shard, replica));
            let mean = if slow {
                args.mean.mul_f64(args.slow_factor)
            } else {
                args.mean
            };
            let model = Replica {
                shard,
                replica,
                mean,
                rng: AtomicU64::new(0x9E37_79B9_7F4A_7C15 ^ u64::from(shard << 16 | replica) | 1),
            };
            let index = shard * args.replicas + replica;
            let (health, health_service) = rpc_health::health_service();
            health.set_serving("shard.Model");
            reporters.push(health);
            // Clients watch each replica's health with a stream that never
            // ends by itself: at shutdown, watchers still connected get
            // the NOT_SERVING update and, after the grace, their streams
            // are cancelled.
            let mut builder = rpc_core::Server::builder().shutdown_grace(SHUTDOWN_GRACE);
            if let Some(metrics) = &metrics {
                builder = builder.intercept(metrics.server());
            }
            let server = builder
                .add_service(ModelServer::new(model))
                .add_service(health_service)
                .bind(&address_of(&args.addr, index))
                .await?;
            addresses.push(server.local_addr().to_string());
            let mut stop = stop_rx.clone();
            servers.push(tokio::spawn(server.serve_with_shutdown(async move {
                let _ = stop.wait_for(|stop| *stop).await;
            })));
        }
        println!("shard {shard}: {}", addresses.join(","));
    }
    println!("ready");
    tokio::signal::ctrl_c().await?;
    for health in &reporters {
        health.set_not_serving("shard.Model");
        health.set_not_serving("");
    }
    stop_tx.send(true)?;
    for server in servers {
        server.await??;
    }
    Ok(())
}
