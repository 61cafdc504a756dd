//! Workers of the parameter-server example, pushing gradients to every shard
//! of a parameter server (`ps-server`) and pulling the summed tensors back:
//!
//! ```text
//! ps-worker --addr tcp://127.0.0.1:7100,tcp://127.0.0.1:7101 \
//!     --workers 4 --keys 8 --size 1048576 --rounds 1
//! ```
//!
//! `--addr` lists the shards, shard `i` at the `i`-th address (`tcp://` or
//! `rdma://`); key `k` (named `tensor.k`) lives on shard `k % shards`.
//! Runs `--workers` workers in this process, each with its own channel to
//! every shard. Each round, every worker pushes a gradient of `--size` bytes
//! (little-endian f32s) for every key, its pushes to the different shards
//! running at once; after all workers pushed (a barrier), every worker
//! pulls every key and checks that it equals the sum of every gradient
//! pushed so far, element by element, exactly (gradients are small
//! integers: their f32 sums are exact). Tensors the shards held before the
//! run are read first and counted in. Prints the push and pull GB/s
//! (payload bytes moved over wall time; each worker's gradients for a round
//! are made before the round starts, and pulled tensors are checked once
//! every worker has pulled, so no worker's check runs beside another's
//! pulls) and exits 1 on any mismatch or failed call.
//!
//! `--payload-buffers` writes each gradient into memory taken from the
//! connection it is pushed on ([`Channel::payload_buffer`]): over `rdma://`
//! with the rendezvous on (`RDMA_RPC_RENDEZVOUS`), registered memory from
//! the connection's pool, which the shard's NIC reads with no copy and no
//! registration per push. A round's gradients for one shard must fit the
//! pool (128 MiB per connection by default), as they are all made first.
//!
//! [`Channel::payload_buffer`]: rpc_core::Channel::payload_buffer
//!
//! `--warmup-rounds N` runs (and checks) N more rounds first, left out of
//! the GB/s. `--lines` also prints one machine-readable line per measured
//! round and phase, for `cargo xtask bench --ps`:
//!
//! ```text
//! ps phase=push round=0 workers=4 shards=2 keys=8 size=1048576 bytes=33554432 secs=0.012345 gb_per_s=2.718
//! ```

use std::sync::Arc;
use std::time::Duration;

use examples::ps::parameter_server_client::ParameterServerClient;
use examples::ps::{Key, PullRequest, PushRequest};
use futures::future::try_join_all;
use prost::bytes::Bytes;
use rpc_core::{Code, PayloadBuffer, Request, Status};
use tokio::sync::Barrier;
use tokio::time::Instant;

const USAGE: &str = "usage: ps-worker --addr ADDR[,ADDR...] [--workers W] [--keys K] [--size BYTES]
                 [--rounds R] [--warmup-rounds N] [--timeout-s S] [--lines]
                 [--payload-buffers]";

/// Every call's timeout, unless `--timeout-s` says otherwise.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

struct Args {
    shards: Vec<String>,
    workers: usize,
    keys: u64,
    size: usize,
    rounds: u64,
    /// Rounds run first and checked, but not measured.
    warmup_rounds: u64,
    timeout: Duration,
    /// Print a machine-readable line per measured round and phase.
    lines: bool,
    /// Write gradients into payload buffers of the connections they go on.
    payload_buffers: bool,
}

fn usage() -> ! {
    eprintln!("{USAGE}");
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut args = Args {
        shards: Vec::new(),
        workers: 4,
        keys: 8,
        size: 1 << 20,
        rounds: 1,
        warmup_rounds: 0,
        timeout: DEFAULT_TIMEOUT,
        lines: false,
        payload_buffers: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--lines" {
            args.lines = true;
            continue;
        }
        if flag == "--payload-buffers" {
            args.payload_buffers = true;
            continue;
        }
        let Some(value) = it.next() else { usage() };
        let number = |v: &str| v.parse::<u64>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--addr" => args.shards = value.split(',').map(str::to_owned).collect(),
            "--workers" => args.workers = number(&value) as usize,
            "--keys" => args.keys = number(&value),
            "--size" => args.size = number(&value) as usize,
            "--rounds" => args.rounds = number(&value),
            "--warmup-rounds" => args.warmup_rounds = number(&value),
            "--timeout-s" => args.timeout = Duration::from_secs(number(&value)),
            _ => usage(),
        }
    }
    if args.shards.is_empty() || args.workers == 0 || args.keys == 0 || args.rounds == 0 {
        usage();
    }
    if args.size == 0 || !args.size.is_multiple_of(4) || args.size > 64 << 20 {
        eprintln!("ps-worker: --size must be a positive multiple of 4, at most 64 MiB");
        usage();
    }
    args
}

/// Element `i` of worker `w`'s gradient for key `k` in round `r`: a small
/// integer, so any sum of a few million of them is exact in f32. It depends
/// on `(k, r, i)` only through [`phase`], which lets [`round_sums`] add up
/// every worker's gradients once per round.
fn gradient_value(w: usize, k: u64, r: u64, i: usize) -> f32 {
    value_at(w, phase(k, r, i))
}

fn phase(k: u64, r: u64, i: usize) -> usize {
    (k.wrapping_mul(17).wrapping_add(r.wrapping_mul(7)) as usize).wrapping_add(i) % 64
}

fn value_at(w: usize, phase: usize) -> f32 {
    (w.wrapping_mul(31).wrapping_add(phase) % 64) as f32 - 32.0
}

/// For each phase, the sum of the first `workers` workers' gradient values.
fn round_sums(workers: usize) -> [f32; 64] {
    std::array::from_fn(|phase| (0..workers).map(|w| value_at(w, phase)).sum())
}

/// Fills `dst` with worker `w`'s gradient for key `k` in round `r`.
fn gradient(w: usize, k: u64, r: u64, dst: &mut [u8]) {
    periodic(dst, |i| gradient_value(w, k, r, i))
}

/// Fills `dst` with little-endian f32s whose element `i` is `value(i % 64)`:
/// one period encoded, then copied (cheap even in a debug build).
fn periodic(dst: &mut [u8], value: impl Fn(usize) -> f32) {
    let period: Vec<u8> = (0..64).flat_map(|i| value(i).to_le_bytes()).collect();
    for chunk in dst.chunks_mut(period.len()) {
        chunk.copy_from_slice(&period[..chunk.len()]);
    }
}

fn key(k: u64) -> Key {
    Key {
        index: k,
        name: format!("tensor.{k}"),
    }
}

fn decode(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect()
}

/// What one worker measured in one phase of one round: when it began and ended.
type Span = (Instant, Instant);

/// A call's failure, naming the call and the shard.
fn failed(what: &str, k: u64, shard: &str, status: Status) -> String {
    format!("{what} of key {k} to {shard} failed: {status}")
}

struct Worker {
    id: usize,
    /// One client per shard, on this worker's own channel.
    shards: Vec<ParameterServerClient>,
}

impl Worker {
    fn shard_of(&self, k: u64) -> usize {
        (k % self.shards.len() as u64) as usize
    }

    fn request<T>(&self, message: T, timeout: Duration) -> Request<T> {
        let mut request = Request::new(message);
        request.set_timeout(timeout);
        request
    }

    /// Pushes `gradients[k]` for every key: each shard's keys one after the
    /// other, the shards at once.
    async fn push_all(&self, args: &Args, gradients: &[Bytes]) -> Result<(), String> {
        try_join_all((0..self.shards.len()).map(|shard| async move {
            for k in (0..args.keys).filter(|&k| self.shard_of(k) == shard) {
                let message = PushRequest {
                    key: Some(key(k)),
                    gradient: gradients[k as usize].clone(),
                };
                self.shards[shard]
                    .push(self.request(message, args.timeout))
                    .await
                    .map_err(|s| failed("push", k, &args.shards[shard], s))?;
            }
            Ok::<_, String>(())
        }))
        .await?;
        Ok(())
    }

    /// Pulls every key (the shards at once); `None` for a key never pushed.
    async fn pull_all(&self, args: &Args) -> Result<Vec<Option<Bytes>>, String> {
        let per_shard = try_join_all((0..self.shards.len()).map(|shard| async move {
            let mut tensors = Vec::new();
            for k in (0..args.keys).filter(|&k| self.shard_of(k) == shard) {
                let message = PullRequest { key: Some(key(k)) };
                match self.shards[shard]
                    .pull(self.request(message, args.timeout))
                    .await
                {
                    Ok(tensor) => tensors.push((k, Some(tensor.into_inner().data))),
                    Err(status) if status.code() == Code::NotFound => tensors.push((k, None)),
                    Err(status) => return Err(failed("pull", k, &args.shards[shard], status)),
                }
            }
            Ok(tensors)
        }))
        .await?;
        let mut tensors = vec![None; args.keys as usize];
        for (k, tensor) in per_shard.into_iter().flatten() {
            tensors[k as usize] = tensor;
        }
        Ok(tensors)
    }

    /// Every round: push (between barriers), pull (up to a barrier), then
    /// check the pulls against `expected` (which each round adds every
    /// worker's gradients to).
    async fn run(
        self,
        args: Arc<Args>,
        barrier: Arc<Barrier>,
        baseline: Arc<Vec<Option<Vec<f32>>>>,
    ) -> Result<Vec<(Span, Span)>, String> {
        // Per key, the sum of every gradient pushed so far: periodic in the
        // element's index (see `phase`), so one period of 64 f32s.
        let mut pushed_sums = vec![[0f32; 64]; args.keys as usize];
        let mut spans = Vec::new();
        for r in 0..args.warmup_rounds + args.rounds {
            let mut gradients = Vec::with_capacity(args.keys as usize);
            for k in 0..args.keys {
                let mut buffer = if args.payload_buffers {
                    let shard = self.shard_of(k);
                    self.shards[shard]
                        .channel()
                        .payload_buffer(args.size)
                        .await
                        .map_err(|s| failed("a payload buffer", k, &args.shards[shard], s))?
                } else {
                    PayloadBuffer::heap(args.size)
                };
                gradient(self.id, k, r, &mut buffer);
                gradients.push(buffer.freeze());
            }
            barrier.wait().await;
            let push_started = Instant::now();
            let pushed = self.push_all(&args, &gradients).await;
            let push_ended = Instant::now();
            drop(gradients);
            // Waited on even after a failure, so the other workers do not hang.
            barrier.wait().await;
            pushed?;
            let pull_started = Instant::now();
            let pulled = self.pull_all(&args).await;
            let pull_ended = Instant::now();
            // Checked once every worker has pulled: a worker that checks
            // (hundreds of MiB of f32s at the largest sizes) while others
            // still pull would take their CPU and count in their phase.
            // Waited on even after a failure, so the other workers do not hang.
            barrier.wait().await;
            let pulled = pulled?;
            spans.push(((push_started, push_ended), (pull_started, pull_ended)));
            let sums = round_sums(args.workers);
            for (k, pushed_sum) in pushed_sums.iter_mut().enumerate() {
                for (i, value) in pushed_sum.iter_mut().enumerate() {
                    *value += sums[phase(k as u64, r, i)];
                }
                let Some(tensor) = &pulled[k] else {
                    return Err(format!(
                        "worker {}, round {r}: key {k} was not found after every worker pushed it",
                        self.id
                    ));
                };
                // Integers all: the order of the additions does not matter.
                let expected = match &baseline[k] {
                    None => {
                        let mut expected = vec![0; args.size];
                        periodic(&mut expected, |i| pushed_sum[i]);
                        expected
                    }
                    Some(held) => held
                        .iter()
                        .enumerate()
                        .flat_map(|(i, v)| (v + pushed_sum[i % 64]).to_le_bytes())
                        .collect(),
                };
                if tensor[..] != expected[..] {
                    return Err(mismatch(self.id, r, k, tensor, &expected));
                }
            }
        }
        Ok(spans)
    }
}

/// Says how a pulled tensor differs from the expected one.
fn mismatch(worker: usize, r: u64, k: usize, got: &[u8], expected: &[u8]) -> String {
    let (got, expected) = (decode(got), decode(expected));
    if got.len() != expected.len() {
        return format!(
            "worker {worker}, round {r}: key {k} has {} f32s, expected {}",
            got.len(),
            expected.len()
        );
    }
    let wrong: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != expected[i].to_bits())
        .collect();
    let i = wrong[0];
    format!(
        "worker {worker}, round {r}: key {k} differs from the expected sum in {} of {} elements, first at {i}: {} (expected {})",
        wrong.len(),
        got.len(),
        got[i],
        expected[i]
    )
}

/// Payload GB/s of a phase: bytes moved in each round over the round's wall
/// time (first start to last end over the workers), summed over the rounds.
fn gigabytes_per_second(bytes_per_round: u64, rounds: &[Vec<Span>]) -> (f64, Duration) {
    let mut wall = Duration::ZERO;
    for spans in rounds {
        let start = spans.iter().map(|s| s.0).min().expect("a worker");
        let end = spans.iter().map(|s| s.1).max().expect("a worker");
        wall += end - start;
    }
    let bytes = bytes_per_round * rounds.len() as u64;
    (bytes as f64 / wall.as_secs_f64() / 1e9, wall)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    examples::init_logging();
    examples::install_transports();
    let args = Arc::new(parse_args());
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("ps-worker: {message}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Arc<Args>) -> Result<(), String> {
    let mut workers = Vec::new();
    for id in 0..args.workers {
        let mut shards = Vec::new();
        for address in &args.shards {
            let client =
                tokio::time::timeout(args.timeout, ParameterServerClient::connect(address))
                    .await
                    .map_err(|_| format!("connecting to {address} took over {:?}", args.timeout))?
                    .map_err(|e| format!("connecting to {address}: {e}"))?;
            shards.push(client);
        }
        workers.push(Worker { id, shards });
    }
    // What the shards held before this run (`None`: never pushed).
    let baseline = workers[0]
        .pull_all(&args)
        .await?
        .into_iter()
        .enumerate()
        .map(|(k, tensor)| match tensor {
            None => Ok(None),
            Some(data) if data.len() == args.size => Ok(Some(decode(&data))),
            Some(data) => Err(format!(
                "key {k} already holds {} bytes on its shard, not --size {}: restart the servers",
                data.len(),
                args.size
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let baseline = Arc::new(baseline);
    let barrier = Arc::new(Barrier::new(args.workers));
    let mut tasks = tokio::task::JoinSet::new();
    for worker in workers {
        tasks.spawn(worker.run(
            Arc::clone(&args),
            Arc::clone(&barrier),
            Arc::clone(&baseline),
        ));
    }
    let all_rounds = (args.warmup_rounds + args.rounds) as usize;
    let mut pushes = vec![Vec::new(); all_rounds];
    let mut pulls = vec![Vec::new(); all_rounds];
    let mut errors = Vec::new();
    while let Some(outcome) = tasks.join_next().await {
        match outcome {
            Ok(Ok(spans)) => {
                for (r, (push, pull)) in spans.into_iter().enumerate() {
                    pushes[r].push(push);
                    pulls[r].push(pull);
                }
            }
            Ok(Err(message)) => {
                errors.push(message);
                // The others may be waiting at a barrier for this one.
                tasks.abort_all();
            }
            Err(e) if e.is_cancelled() => {}
            Err(e) => {
                errors.push(format!("a worker panicked: {e}"));
                tasks.abort_all();
            }
        }
    }
    if !errors.is_empty() {
        return Err(errors.join("\n"));
    }
    let bytes_per_round = args.workers as u64 * args.keys * args.size as u64;
    let warmup = args.warmup_rounds as usize;
    let (pushes, pulls) = (&pushes[warmup..], &pulls[warmup..]);
    if args.lines {
        for (phase, rounds) in [("push", pushes), ("pull", pulls)] {
            for (r, spans) in rounds.iter().enumerate() {
                let (rate, wall) =
                    gigabytes_per_second(bytes_per_round, std::slice::from_ref(spans));
                println!(
                    "ps phase={phase} round={r} workers={} shards={} keys={} size={} bytes={bytes_per_round} secs={:.6} gb_per_s={rate:.4}",
                    args.workers,
                    args.shards.len(),
                    args.keys,
                    args.size,
                    wall.as_secs_f64()
                );
            }
        }
    }
    let (push_rate, push_wall) = gigabytes_per_second(bytes_per_round, pushes);
    let (pull_rate, pull_wall) = gigabytes_per_second(bytes_per_round, pulls);
    println!(
        "{} workers x {} keys of {} bytes on {} shards, {} round(s) ({} more to warm up): every pulled tensor equals the sum of the gradients pushed",
        args.workers,
        args.keys,
        args.size,
        args.shards.len(),
        args.rounds,
        args.warmup_rounds
    );
    println!(
        "push: {:.3} GB/s ({} MB in {push_wall:.2?})",
        push_rate,
        bytes_per_round * args.rounds / 1_000_000
    );
    println!(
        "pull: {:.3} GB/s ({} MB in {pull_wall:.2?})",
        pull_rate,
        bytes_per_round * args.rounds / 1_000_000
    );
    Ok(())
}
