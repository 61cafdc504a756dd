//! Head-of-line blocking: do small calls wait behind a large one on the
//! same channel? Server and client in this process, on two tokio workers
//! (the measuring in a task of its own, as `bench-node`'s):
//!
//! ```text
//! hol-bench [--addr tcp://127.0.0.1:0 | rdma://IP:0] [--large-mib 64]
//!           [--small-calls 300] [--small-bytes 32] [--rendezvous-kib N]
//!           [--large-channel same|own]
//! ```
//!
//! Makes `--small-calls` `Echo` calls of `--small-bytes`, one at a time, on
//! an idle channel; then as many again (and more, until three large calls
//! have ended) on the same channel while a task keeps one `Sink` call of
//! `--large-mib` MiB in flight on it, back to back (a worker pushing a
//! tensor while it also asks small things). Prints one
//! line per phase (`phase=idle|loaded calls= p50_us= p99_us= max_us=`) and
//! `ratio p50= p99=` (loaded over idle); issue 10's target is a p99 ratio
//! ≤ 3. `--rendezvous-kib N` turns on `rdma://`'s rendezvous for frames of
//! N KiB and more (`RdmaTransport::rendezvous_threshold`), both sides.
//! `--large-channel own` puts the large calls on a channel (connection) of
//! their own: what is left of the stalls then is the process's (CPU,
//! memory), not the connection's.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use benches::client::{self, Client};
use benches::{server, Call, Error, System};
use bytes::Bytes;
use hdrhistogram::Histogram;
use transport_rdma::RdmaTransport;

/// The loaded phase lasts until this many large calls have ended.
const LARGE_CALLS: u64 = 3;

const USAGE: &str = "usage: hol-bench [--addr URL] [--large-mib N] [--small-calls N] \
                     [--small-bytes N] [--rendezvous-kib N] [--large-channel same|own]";

struct Args {
    addr: String,
    large: usize,
    small_calls: usize,
    small_bytes: usize,
    rendezvous: Option<usize>,
    separate: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut parsed = Args {
        addr: "tcp://127.0.0.1:0".into(),
        large: 64 << 20,
        small_calls: 300,
        small_bytes: 32,
        rendezvous: None,
        separate: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<usize>()
                .map_err(|_| format!("{flag}: not a number: {value}"))
        };
        match flag.as_str() {
            "--addr" => parsed.addr = value.clone(),
            "--large-mib" => parsed.large = number()? << 20,
            "--small-calls" => parsed.small_calls = number()?,
            "--small-bytes" => parsed.small_bytes = number()?,
            "--rendezvous-kib" => parsed.rendezvous = Some(number()? << 10),
            "--large-channel" => {
                parsed.separate = match value.as_str() {
                    "same" => false,
                    "own" => true,
                    _ => return Err(format!("--large-channel: same or own, not {value}")),
                }
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(parsed)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("hol-bench: {message}\n{USAGE}");
            return std::process::ExitCode::from(2);
        }
    };
    // The measuring runs in a task, as `bench-node`'s does: a caller under
    // `block_on` is a third thread beside the two workers, and waits for a
    // core of its own at each answer while the workers copy large frames.
    let measured = match tokio::spawn(run(args)).await {
        Ok(measured) => measured,
        Err(panicked) => Err(format!("the measuring task failed: {panicked}").into()),
    };
    match measured {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hol-bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Error> {
    benches::install_transports();
    if let Some(threshold) = args.rendezvous {
        rpc_core::transport::register(Arc::new(
            RdmaTransport::default().rendezvous_threshold(Some(threshold)),
        ));
    }
    let (addr, serving) = server::start(System::Rpc, &args.addr).await?;
    tokio::spawn(serving);
    let mut small = client::connect(System::Rpc, &addr).await?;
    let payload = Bytes::from(vec![7u8; args.small_bytes]);
    // Warm the channel (connection, buffers) before measuring.
    for _ in 0..20 {
        small.echo(&payload).await?;
    }

    let mut idle = Histogram::<u64>::new(3)?;
    smalls(&mut small, &payload, args.small_calls, &mut idle).await?;
    print_phase("idle", &idle);

    // The same channel (a clone shares its connection) carries the large
    // calls, one in flight at a time, back to back, until told to stop;
    // or, to tell the channel's part from the process's, a channel of
    // their own.
    let mut large_client = if args.separate {
        client::connect(System::Rpc, &addr).await?
    } else {
        small.clone()
    };
    let large = Bytes::from(vec![1u8; args.large]);
    let stop = Arc::new(AtomicBool::new(false));
    let pushed = Arc::new(AtomicU64::new(0));
    let push_started = Instant::now();
    let pushing = tokio::spawn({
        let (stop, pushed) = (Arc::clone(&stop), Arc::clone(&pushed));
        async move {
            while !stop.load(Ordering::Relaxed) {
                large_client.call(Call::Sink, &large).await?;
                pushed.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, Error>(())
        }
    });
    // Small calls start once a large one is on its way, and go on until
    // at least `LARGE_CALLS` large calls have ended: the phase covers the
    // starts and ends of large calls, not only their middles.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut loaded = Histogram::<u64>::new(3)?;
    while loaded.len() < args.small_calls as u64 || pushed.load(Ordering::Relaxed) < LARGE_CALLS {
        smalls(&mut small, &payload, 1, &mut loaded).await?;
    }
    stop.store(true, Ordering::Relaxed);
    pushing.await??;
    let push_took = push_started.elapsed();
    print_phase("loaded", &loaded);
    let pushed = pushed.load(Ordering::Relaxed);
    println!(
        "large size={} calls={pushed} gb_per_s={:.3}",
        args.large,
        (pushed as f64 * args.large as f64) / push_took.as_secs_f64() / 1e9
    );
    let at = |h: &Histogram<u64>, q| h.value_at_quantile(q) as f64;
    println!(
        "ratio p50={:.2} p99={:.2}",
        at(&loaded, 0.5) / at(&idle, 0.5),
        at(&loaded, 0.99) / at(&idle, 0.99)
    );
    Ok(())
}

/// `n` echo calls of `payload`, one at a time; their latencies (ns) go
/// into `latencies`.
async fn smalls(
    client: &mut Client,
    payload: &Bytes,
    n: usize,
    latencies: &mut Histogram<u64>,
) -> Result<(), Error> {
    for _ in 0..n {
        let started = Instant::now();
        client.echo(payload).await?;
        latencies.record(started.elapsed().as_nanos() as u64)?;
    }
    Ok(())
}

fn print_phase(phase: &str, h: &Histogram<u64>) {
    let us = |q| h.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "phase={phase} calls={} p50_us={:.1} p99_us={:.1} max_us={:.1}",
        h.len(),
        us(0.5),
        us(0.99),
        h.max() as f64 / 1000.0
    );
}
