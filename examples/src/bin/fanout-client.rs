//! The inference front end of the fan-out example: each query goes to every
//! shard at once under one deadline, to one replica of each (least
//! outstanding calls), with hedged requests to the other replica:
//!
//! ```text
//! fanout-client --shard tcp://h1:5000,tcp://h2:5000 --shard tcp://h3:5000,tcp://h4:5000 \
//!     --queries 2000 --concurrency 8 --deadline-ms 50 --hedge p95
//! ```
//!
//! `--shard` lists one shard's replicas (what `shard-server` prints);
//! `--hedge` is `off`, `MS` (a fixed delay) or `pNN` (that percentile of the
//! shard's recent latencies), with `--hedge-budget` (default 0.1: at most
//! 10 % more calls). Prints the fan-out's p50/p99/p99.9, how many answers
//! were partial (some shard missed the deadline or failed), and how many
//! hedges were sent and won. Each shard's channel follows its replicas'
//! health (`rpc_health::watch_replicas`): a replica reporting `shard.Model`
//! not serving gets no new calls.

use std::sync::Arc;
use std::time::Duration;

use examples::shard::model_client::ModelClient;
use examples::shard::InferRequest;
use rpc_core::fanout::FanOut;
use rpc_core::hedging::Hedging;
use rpc_core::{Balance, Channel, Endpoint};
use tokio::time::Instant;

const USAGE: &str = "usage: fanout-client --shard ADDR[,ADDR...] [--shard ...] [--queries N]
                     [--concurrency C] [--deadline-ms D] [--hedge off|MS|pNN]
                     [--hedge-budget RATIO] [--features BYTES]";

#[derive(Clone, Copy)]
enum HedgeArg {
    Off,
    Fixed(Duration),
    Percentile(f64),
}

struct Args {
    shards: Vec<Vec<String>>,
    queries: usize,
    concurrency: usize,
    deadline: Duration,
    hedge: HedgeArg,
    budget: f64,
    features: usize,
}

fn usage() -> ! {
    eprintln!("{USAGE}");
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut args = Args {
        shards: Vec::new(),
        queries: 2000,
        concurrency: 8,
        deadline: Duration::from_millis(50),
        hedge: HedgeArg::Percentile(95.0),
        budget: 0.1,
        features: 256,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let Some(value) = it.next() else { usage() };
        let number = |v: &str| v.parse::<f64>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--shard" => args
                .shards
                .push(value.split(',').map(str::to_owned).collect()),
            "--queries" => args.queries = number(&value) as usize,
            "--concurrency" => args.concurrency = (number(&value) as usize).max(1),
            "--deadline-ms" => args.deadline = Duration::from_secs_f64(number(&value) / 1e3),
            "--hedge" => {
                args.hedge = match value.as_str() {
                    "off" => HedgeArg::Off,
                    p if p.starts_with('p') => HedgeArg::Percentile(number(&p[1..])),
                    ms => HedgeArg::Fixed(Duration::from_secs_f64(number(ms) / 1e3)),
                }
            }
            "--hedge-budget" => args.budget = number(&value),
            "--features" => args.features = number(&value) as usize,
            _ => usage(),
        }
    }
    if args.shards.is_empty() {
        usage();
    }
    args
}

/// One shard as the front end sees it: its replicas behind one balanced
/// channel, and its own hedging policy (its own latencies).
struct Shard {
    client: ModelClient,
    hedging: Option<Hedging>,
}

/// What the workers measured.
#[derive(Default)]
struct Tally {
    latencies: Vec<Duration>,
    partial: usize,
    shard_calls_failed: usize,
    shard_calls_missed: usize,
}

async fn run_queries(
    shards: Arc<Vec<Shard>>,
    args: Arc<Args>,
    next: Arc<std::sync::atomic::AtomicUsize>,
) -> Tally {
    let mut tally = Tally::default();
    let features = prost::bytes::Bytes::from(vec![7u8; args.features]);
    loop {
        let query = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if query >= args.queries {
            return tally;
        }
        let started = Instant::now();
        let fan = FanOut::within(args.deadline);
        let results = fan
            .run(shards.iter().map(|shard| {
                let message = InferRequest {
                    query: query as u64,
                    features: features.clone(),
                };
                let fan = &fan;
                let request = move || {
                    let mut request = fan.request(message.clone());
                    request.set_idempotent(true); // a read: safe to send twice
                    request
                };
                async move {
                    match &shard.hedging {
                        Some(hedging) => hedging.call(|| shard.client.infer(request())).await,
                        None => shard.client.infer(request()).await,
                    }
                }
            }))
            .await;
        tally.latencies.push(started.elapsed());
        if results.is_partial() {
            tally.partial += 1;
        }
        tally.shard_calls_failed += results.failed();
        tally.shard_calls_missed += results.not_answered();
        if let Some(reply) = results.shards.into_iter().find_map(|s| s.ok()) {
            assert_eq!(
                reply.get_ref().query,
                query as u64,
                "an answer to another query"
            );
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank]
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    examples::init_logging();
    examples::install_transports();
    let args = Arc::new(parse_args());
    let mut shards = Vec::new();
    // Each replica's health (`shard.Model`, which shard-server reports):
    // new calls go only to replicas serving. Kept until the end.
    let mut health = Vec::new();
    for replicas in &args.shards {
        let endpoints = replicas
            .iter()
            .map(|address| Endpoint::new(address.as_str()))
            .collect::<Result<Vec<_>, _>>()?;
        let channel = Channel::balance(endpoints, Balance::LeastOutstanding)?;
        health.push(rpc_health::watch_replicas(&channel, "shard.Model"));
        let hedging = match args.hedge {
            HedgeArg::Off => None,
            HedgeArg::Fixed(delay) => Some(Hedging::after(delay).budget(args.budget)),
            HedgeArg::Percentile(p) => {
                Some(Hedging::at_percentile(p, args.deadline / 4).budget(args.budget))
            }
        };
        shards.push(Shard {
            client: ModelClient::new(channel),
            hedging,
        });
    }
    // Warm up, unmeasured and without a deadline: connects every replica
    // (an idle balanced channel takes its replicas in turn).
    for query in 0..2 * args.shards.iter().map(Vec::len).max().unwrap_or(1) {
        let request = InferRequest {
            query: query as u64,
            features: Default::default(),
        };
        for shard in &shards {
            shard.client.infer(request.clone()).await?;
        }
    }
    let shards = Arc::new(shards);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..args.concurrency)
        .map(|_| {
            tokio::spawn(run_queries(
                Arc::clone(&shards),
                Arc::clone(&args),
                Arc::clone(&next),
            ))
        })
        .collect();
    let mut tally = Tally::default();
    for worker in workers {
        let part = worker.await?;
        tally.latencies.extend(part.latencies);
        tally.partial += part.partial;
        tally.shard_calls_failed += part.shard_calls_failed;
        tally.shard_calls_missed += part.shard_calls_missed;
    }
    let elapsed = started.elapsed();
    tally.latencies.sort_unstable();
    let (mut calls, mut hedges, mut won) = (0, 0, 0);
    for shard in shards.iter() {
        if let Some(stats) = shard.hedging.as_ref().map(Hedging::stats) {
            calls += stats.calls;
            hedges += stats.hedges;
            won += stats.hedges_won;
        }
    }
    let queries = tally.latencies.len();
    let shard_calls = queries * shards.len();
    let replicas: usize = args.shards.iter().map(Vec::len).sum();
    println!(
        "{queries} queries to {} shards ({replicas} replicas), {} at a time, deadline {:?}, {:.0} queries/s",
        shards.len(),
        args.concurrency,
        args.deadline,
        queries as f64 / elapsed.as_secs_f64()
    );
    println!(
        "fan-out latency: p50 {:?}  p99 {:?}  p99.9 {:?}  max {:?}",
        percentile(&tally.latencies, 50.0),
        percentile(&tally.latencies, 99.0),
        percentile(&tally.latencies, 99.9),
        tally.latencies[queries - 1],
    );
    println!(
        "partial answers: {} of {queries} ({} shard calls missed the deadline, {} failed)",
        tally.partial, tally.shard_calls_missed, tally.shard_calls_failed
    );
    match args.hedge {
        HedgeArg::Off => println!("hedging: off"),
        _ => println!(
            "hedges sent: {hedges} ({:.1} % more calls than the {shard_calls} shard calls), won: {won}",
            100.0 * hedges as f64 / calls.max(1) as f64
        ),
    }
    Ok(())
}
