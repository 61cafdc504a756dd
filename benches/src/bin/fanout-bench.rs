//! The fan-out benchmark's two sides; `cargo xtask bench --fanout` runs both.
//!
//! ```text
//! fanout-bench server --system rpc|tonic [--addr tcp://127.0.0.1:0] [--shards N]
//!     [--replicas R] [--mean-us US] [--slow SHARD:REPLICA] [--slow-factor F]
//!     serves N × R replicas of the echo service in this process, each
//!     answering after an exponentially distributed service time (mean US;
//!     the slow replica's F times longer); prints `shard S: ADDR,ADDR` per
//!     shard, then `ready`, and serves until killed
//! fanout-bench client --system rpc|tonic (--shard ADDR,ADDR ... | --shards-from FILE)
//!     [--concurrency C] [--warmup-ms MS] [--measure-ms MS] [--max-queries Q]
//!     [--hedge off|pNN|MS] [--hedge-budget RATIO] [--payload BYTES]
//!     measures whole fan-outs to every shard and prints one `fanout ...` line
//! ```
//!
//! `--shards-from FILE` reads the `shard S: ...` lines a server printed.
//! Both sides take `--rdma-busy-poll-us N` (as `bench-node`).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use benches::fanout::{self, FanOutPlan, Hedge, ShardPlan};
use benches::{Error, System};
use transport_rdma::RdmaTransport;

const USAGE: &str =
    "usage: fanout-bench server --system rpc|tonic [--addr URL] [--shards N] [--replicas R]
                          [--mean-us US] [--slow SHARD:REPLICA] [--slow-factor F]
       fanout-bench client --system rpc|tonic (--shard ADDR,ADDR.. | --shards-from FILE)
                          [--concurrency C] [--warmup-ms MS] [--measure-ms MS] [--max-queries Q]
                          [--hedge off|pNN|MS] [--hedge-budget RATIO] [--payload BYTES]
       (both: [--rdma-busy-poll-us N])";

enum Mode {
    Server(ShardPlan),
    Client(FanOutPlan),
}

fn parse_args() -> Result<(Mode, Option<Duration>), String> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().ok_or("missing mode")?;
    let mut server = ShardPlan {
        system: System::Rpc,
        addr: "tcp://127.0.0.1:0".into(),
        shards: 4,
        replicas: 2,
        mean: Duration::from_millis(1),
        slow: None,
        slow_factor: 10.0,
    };
    let mut client = FanOutPlan {
        system: System::Rpc,
        shards: Vec::new(),
        concurrency: 1,
        warmup: Duration::from_millis(1000),
        measure: Duration::from_millis(5000),
        max_queries: 1_000_000,
        hedge: Hedge::Off,
        budget: 0.1,
        payload: 64,
    };
    let mut busy_poll = None;
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<f64>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        let ms = || number().map(|n| Duration::from_secs_f64(n / 1e3));
        match flag.as_str() {
            "--system" => {
                let system: System = value.parse()?;
                server.system = system;
                client.system = system;
            }
            "--addr" => server.addr = value.clone(),
            "--shards" => server.shards = number()? as usize,
            "--replicas" => server.replicas = number()? as usize,
            "--mean-us" => server.mean = Duration::from_secs_f64(number()? / 1e6),
            "--slow" => {
                let (s, r) = value.split_once(':').ok_or("--slow takes SHARD:REPLICA")?;
                let parse = |v: &str| v.parse::<usize>().map_err(|e| format!("--slow: {e}"));
                server.slow = Some((parse(s)?, parse(r)?));
            }
            "--slow-factor" => server.slow_factor = number()?,
            "--shard" => client
                .shards
                .push(value.split(',').map(str::to_owned).collect()),
            "--shards-from" => {
                let text =
                    std::fs::read_to_string(&value).map_err(|e| format!("reading {value}: {e}"))?;
                client.shards.extend(fanout::parse_shard_lines(&text));
            }
            "--concurrency" => client.concurrency = (number()? as usize).max(1),
            "--warmup-ms" => client.warmup = ms()?,
            "--measure-ms" => client.measure = ms()?,
            "--max-queries" => client.max_queries = number()? as u64,
            "--hedge" => client.hedge = value.parse()?,
            "--hedge-budget" => client.budget = number()?,
            "--payload" => client.payload = number()? as usize,
            "--rdma-busy-poll-us" => busy_poll = Some(Duration::from_secs_f64(number()? / 1e6)),
            _ => return Err(format!("unknown option {flag:?}")),
        }
    }
    match mode.as_str() {
        "server" if server.shards > 0 && server.replicas > 0 => {
            Ok((Mode::Server(server), busy_poll))
        }
        "server" => Err("--shards and --replicas must be at least 1".into()),
        "client" if !client.shards.is_empty() => Ok((Mode::Client(client), busy_poll)),
        "client" => Err("the client needs --shard or --shards-from".into()),
        other => Err(format!("unknown mode {other:?}")),
    }
}

fn main() -> ExitCode {
    let (mode, busy_poll) = match parse_args() {
        Ok(parsed) => parsed,
        Err(message) => {
            eprintln!("fanout-bench: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    // Everything runs in spawned tasks, on the runtime's workers (as bench-node).
    let result = runtime.block_on(async move {
        benches::install_transports();
        if let Some(window) = busy_poll {
            rpc_core::transport::register(Arc::new(
                RdmaTransport::default().busy_poll(Some(window)),
            ));
        }
        let task = tokio::spawn(async move {
            match mode {
                Mode::Server(plan) => serve(plan).await,
                Mode::Client(plan) => {
                    let outcome = fanout::measure(&plan).await?;
                    println!("{}", outcome.line(&plan));
                    Ok(())
                }
            }
        });
        task.await.map_err(Error::from).and_then(|r| r)
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("fanout-bench: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(plan: ShardPlan) -> Result<(), Error> {
    use std::io::Write;
    let shards = fanout::start_shards(&plan).await?;
    let mut out = std::io::stdout();
    for (shard, replicas) in shards.iter().enumerate() {
        writeln!(out, "shard {shard}: {}", replicas.join(","))?;
    }
    writeln!(out, "ready")?;
    out.flush()?;
    std::future::pending::<()>().await;
    Ok(())
}
