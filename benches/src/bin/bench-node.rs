//! One side of the end-to-end benchmark; `cargo xtask bench` runs both.
//!
//! ```text
//! bench-node server --system rpc|tonic|tonic-rdma|raw --addr tcp://127.0.0.1:0 [--rdma-busy-poll-us N]
//!     prints `listening on ADDR`, then serves until killed (rdma-rpc also
//!     serves `rdma://IP:PORT` addresses; tonic-rdma only those)
//! bench-node client --system rpc|tonic|tonic-rdma|raw --addr ADDR [options]
//!     prints one line per measurement (`latency ...`, `throughput ...`;
//!     tonic-rdma also `writes ...`: the stream writes, each one RDMA
//!     message, and bytes of its latency run, warm-up included)
//! bench-node stream-sink --addr rdma://IP:0 [--rdma-busy-poll-us N]
//!     prints `listening on ADDR`, then reads `RdmaStream`s to their end
//!     until killed, answering each with the count of bytes it read
//! bench-node stream-send --addr ADDR [--sizes N,N..] [--total-mib N] [--rdma-busy-poll-us N]
//!     per size, one stream copying N MiB one way in writes of that size;
//!     prints `stream size=... bytes=... secs=... bytes_per_s=...`
//! ```
//!
//! Client options, with their defaults:
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `--sizes` | `32,1024,65536,1048576,16777216` | payload sizes, bytes |
//! | `--concurrency` | `1,16,64,256` | calls in flight for throughput |
//! | `--warmup-ms` | `500` | warm-up before each measurement |
//! | `--latency-ms` | `3000` | length of a latency measurement |
//! | `--latency-calls` | `100000` | a latency measurement stops after this many calls |
//! | `--throughput-ms` | `3000` | length of a throughput measurement |
//! | `--max-inflight-bytes` | `536870912` | skip throughput runs with more payload in flight |
//! | `--throughput-call` | `echo` | `echo` (the payload comes back) or `sink` (an empty reply: one-way streaming, rdma-rpc and tonic only) |
//! | `--total-mib` | `256` | `stream-send`: MiB copied per write size |
//!
//! Every mode takes `--rdma-region-kib N`: the region each `RdmaStream`
//! connection (stream modes and tonic-rdma; not rdma-rpc's `rdma://`)
//! registers for messages over a slot, a message being at most half of
//! the peer's (default: the transport's, 1 MiB).
//!
//! The tonic systems' server and client take `--http2-max-frame-kib N`:
//! the largest HTTP/2 frame each accepts, so the largest its peer sends
//! (default: h2's, 16 KiB; at most 16383 KiB).
//!
//! Every mode takes `--rdma-busy-poll-us N`: `rdma://` connections poll the
//! completion queue for N µs after each completion before sleeping on the
//! completion channel (default: not at all, event-driven).

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use benches::{client, rdma_stream, server, Call, Error, Measure, System};
use transport_rdma::RdmaTransport;

const USAGE: &str =
    "usage: bench-node server --system rpc|tonic|tonic-rdma|raw --addr URL [--rdma-busy-poll-us N]
                         [--thread-per-core N]
       bench-node client --system rpc|tonic|tonic-rdma|raw --addr URL [--sizes N,N..]
                         [--concurrency N,N..] [--warmup-ms N] [--latency-ms N]
                         [--latency-calls N] [--throughput-ms N] [--max-inflight-bytes N]
                         [--throughput-call echo|sink] [--rdma-busy-poll-us N]
       bench-node stream-sink --addr rdma://IP:PORT [--rdma-busy-poll-us N]
       bench-node stream-send --addr rdma://IP:PORT [--sizes N,N..] [--total-mib N]
                              [--rdma-busy-poll-us N]
       (every mode also takes --rdma-region-kib N; server and client of the
       tonic systems --http2-max-frame-kib N)";

/// What `bench-node` was asked to do.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Server,
    Client,
    StreamSink,
    StreamSend,
}

struct Args {
    mode: Mode,
    system: System,
    addr: String,
    sizes: Vec<usize>,
    concurrency: Vec<usize>,
    measure: Measure,
    max_inflight_bytes: usize,
    throughput_call: Call,
    /// `rdma://` busy-poll window; `None`: event-driven completions.
    rdma_busy_poll: Option<Duration>,
    /// `stream-send`: bytes copied per write size.
    stream_total: u64,
    /// `RdmaStream`s' region, bytes; `None`: the transport's default.
    rdma_region: Option<u32>,
    /// tonic systems: the largest HTTP/2 frame to accept; `None`: 16 KiB.
    http2_max_frame: Option<u32>,
    /// rdma-rpc's server: serve connections on this many threads of its
    /// own (`ServerBuilder::thread_per_core`); `None`: on the runtime.
    thread_per_core: Option<usize>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let mode = match args.next().ok_or("missing mode")?.as_str() {
        "server" => Mode::Server,
        "client" => Mode::Client,
        "stream-sink" => Mode::StreamSink,
        "stream-send" => Mode::StreamSend,
        other => return Err(format!("unknown mode {other:?}")),
    };
    let mut parsed = Args {
        mode,
        system: System::Rpc,
        addr: "tcp://127.0.0.1:0".into(),
        sizes: vec![32, 1024, 64 << 10, 1 << 20, 16 << 20],
        concurrency: vec![1, 16, 64, 256],
        measure: Measure {
            warmup: Duration::from_millis(500),
            latency_time: Duration::from_secs(3),
            max_latency_calls: 100_000,
            throughput_time: Duration::from_secs(3),
        },
        max_inflight_bytes: 512 << 20,
        throughput_call: Call::Echo,
        rdma_busy_poll: None,
        stream_total: 256 << 20,
        rdma_region: None,
        http2_max_frame: None,
        thread_per_core: None,
    };
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        let list = || -> Result<Vec<usize>, String> {
            value
                .split(',')
                .map(|n| n.parse().map_err(|e| format!("{flag} {value}: {e}")))
                .collect()
        };
        match flag.as_str() {
            "--system" => parsed.system = value.parse()?,
            "--addr" => parsed.addr = value.clone(),
            "--sizes" => parsed.sizes = list()?,
            "--concurrency" => parsed.concurrency = list()?,
            "--warmup-ms" => parsed.measure.warmup = Duration::from_millis(number()?),
            "--latency-ms" => parsed.measure.latency_time = Duration::from_millis(number()?),
            "--latency-calls" => parsed.measure.max_latency_calls = number()?,
            "--throughput-ms" => parsed.measure.throughput_time = Duration::from_millis(number()?),
            "--max-inflight-bytes" => parsed.max_inflight_bytes = number()? as usize,
            "--throughput-call" => parsed.throughput_call = value.parse()?,
            "--total-mib" => parsed.stream_total = number()? << 20,
            "--http2-max-frame-kib" => {
                let bytes = number()?.saturating_mul(1024);
                let bytes = u32::try_from(bytes)
                    .ok()
                    .filter(|b| (16 << 10..1 << 24).contains(b))
                    .ok_or_else(|| format!("{flag} {value}: 16 to 16383 KiB"))?;
                parsed.http2_max_frame = Some(bytes);
            }
            "--rdma-region-kib" => {
                let bytes = number()?.saturating_mul(1024);
                let bytes = u32::try_from(bytes)
                    .ok()
                    .filter(|b| (4096..=1 << 30).contains(b))
                    .ok_or_else(|| format!("{flag} {value}: 4 to 1048576 KiB"))?;
                parsed.rdma_region = Some(bytes);
            }
            "--rdma-busy-poll-us" => {
                parsed.rdma_busy_poll = Some(Duration::from_micros(number()?));
            }
            "--thread-per-core" => {
                parsed.thread_per_core = Some(number()?.max(1) as usize);
            }
            _ => return Err(format!("unknown option {flag:?}")),
        }
    }
    Ok(parsed)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("bench-node: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let mode = match args.mode {
        Mode::Server => "server",
        Mode::Client => "client",
        Mode::StreamSink => "stream-sink",
        Mode::StreamSend => "stream-send",
    };
    let system = args.system;
    // Everything runs in a spawned task, on the runtime's workers: under
    // `block_on` the measuring loop would sit on the main thread, and every
    // reply would cost a cross-thread wake-up that is the harness's, not the
    // system's.
    let result = runtime.block_on(async move {
        benches::install_transports();
        if let Some(window) = args.rdma_busy_poll {
            rpc_core::transport::register(Arc::new(
                RdmaTransport::default().busy_poll(Some(window)),
            ));
        }
        let mut rdma = RdmaTransport::default().busy_poll(args.rdma_busy_poll);
        if let Some(bytes) = args.rdma_region {
            rdma = rdma.region_len(bytes);
        }
        let task = tokio::spawn(async move {
            match args.mode {
                Mode::Server => serve(&args, &rdma).await,
                Mode::Client => measure(&args, &rdma).await,
                Mode::StreamSink => stream_sink(&args, &rdma).await,
                Mode::StreamSend => stream_send(&args, &rdma).await,
            }
        });
        task.await.map_err(Error::from).and_then(|r| r)
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench-node {mode} {system}: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: &Args, rdma: &RdmaTransport) -> Result<(), Error> {
    let (addr, serving) = server::start_with(
        args.system,
        &args.addr,
        rdma,
        args.http2_max_frame,
        args.thread_per_core,
    )
    .await?;
    println!("listening on {addr}");
    std::io::stdout().flush()?;
    serving.await
}

async fn stream_sink(args: &Args, rdma: &RdmaTransport) -> Result<(), Error> {
    let listener = rdma.bind_stream(&args.addr).await?;
    println!("listening on {}", listener.local_addr());
    std::io::stdout().flush()?;
    rdma_stream::sink(listener).await
}

async fn stream_send(args: &Args, rdma: &RdmaTransport) -> Result<(), Error> {
    let mut out = std::io::stdout();
    for &size in &args.sizes {
        let copy = rdma_stream::send(rdma, &args.addr, size, args.stream_total).await?;
        writeln!(
            out,
            "stream size={size} bytes={} secs={:.3} bytes_per_s={:.0}",
            copy.bytes,
            copy.elapsed.as_secs_f64(),
            copy.bytes_per_sec(),
        )?;
        out.flush()?;
    }
    Ok(())
}

async fn measure(args: &Args, rdma: &RdmaTransport) -> Result<(), Error> {
    let system = args.system;
    let client = client::connect_with(system, &args.addr, rdma, args.http2_max_frame).await?;
    let mut out = std::io::stdout();
    for &size in &args.sizes {
        let before = rdma_stream::writes();
        let latency = args.measure.latency(&client, size).await?;
        writeln!(
            out,
            "latency system={system} size={size} calls={} p50_ns={} p99_ns={} p999_ns={} max_ns={}",
            latency.len(),
            latency.value_at_quantile(0.5),
            latency.value_at_quantile(0.99),
            latency.value_at_quantile(0.999),
            latency.max(),
        )?;
        if system == System::TonicRdma {
            // What HTTP/2 made of the calls (warm-up included): one RDMA
            // message per write.
            let after = rdma_stream::writes();
            writeln!(
                out,
                "writes system={system} size={size} writes={} bytes={}",
                after.0 - before.0,
                after.1 - before.1,
            )?;
        }
        out.flush()?;
        for &concurrency in &args.concurrency {
            if size.saturating_mul(concurrency) > args.max_inflight_bytes {
                writeln!(
                    out,
                    "skipped system={system} size={size} concurrency={concurrency} reason=over-max-inflight-bytes"
                )?;
                out.flush()?;
                continue;
            }
            let call = args.throughput_call;
            let throughput = args
                .measure
                .throughput(&client, size, concurrency, call)
                .await?;
            writeln!(
                out,
                "throughput system={system} call={call} size={size} concurrency={concurrency} calls={} secs={:.3} calls_per_s={:.1} gb_per_s={:.4}",
                throughput.calls,
                throughput.elapsed.as_secs_f64(),
                throughput.calls_per_sec(),
                throughput.gb_per_sec(size),
            )?;
            out.flush()?;
        }
    }
    Ok(())
}
