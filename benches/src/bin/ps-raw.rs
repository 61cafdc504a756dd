//! The raw TCP floor of the parameter-server benchmark (`cargo xtask bench
//! --ps`): the work of `ps-server` / `ps-worker` (the same bytes between
//! the same tensors, pushes summed into the shard's), with no RPC and no
//! encoding.
//!
//! ```text
//! ps-raw server --addr 127.0.0.1:0
//!     prints `listening on HOST:PORT`, serves until killed
//! ps-raw worker --addr HOST:PORT[,HOST:PORT...] [--workers W] [--keys K]
//!     [--size BYTES] [--rounds R] [--warmup-rounds N]
//! ```
//!
//! A worker process runs `--workers` workers, each with its own connection
//! to every shard (one server per shard). Key `k` goes to shard `k %
//! shards`, and each round is what `ps-worker` does: every worker pushes
//! every key (a shard's keys one after the other, the shards at once), a
//! barrier, then every worker pulls every key the same way. On the wire:
//!
//! - push: `b'P'`, the key and the length (u32s, little-endian), the
//!   payload; the server reads it into a buffer of that key (one per
//!   connection and key), adds it to the key's tensor (the loop `ps-server`
//!   runs) and answers one byte;
//! - pull: `b'G'`, the key and the length wanted; the server answers the
//!   length and that many bytes (the key's tensor, one per key shared by
//!   every connection), which the worker reads into its buffer for that key.
//!
//! Every key has buffers of its own on both sides, as the tensors of a
//! parameter server do: a floor that sent one buffer over and over would
//! work from the CPU's cache, which K distinct tensors do not fit. And the
//! floor sums what is pushed, as the server it stands for must: without
//! either, the ratio would charge the framework for the application's
//! memory traffic and arithmetic (see docs/benchmarks.md).
//!
//! Tuning (what a tuned program would do): `TCP_NODELAY` on every socket;
//! each push and each pull reply is one `write_all` of a buffer holding the
//! 9- or 4-byte header and the payload together (built once, before the
//! timed rounds, so nothing is copied in user space to send; the kernel
//! takes it in as large writes as its buffer allows); payloads are read
//! with `read_exact` straight into their destination, no intermediate
//! buffer. Every process runs a default multi-threaded tokio runtime, like
//! `ps-server` and `ps-worker`. The worker prints the lines `ps-worker
//! --lines` prints (`ps phase=push|pull round=R ... gb_per_s=G`, the GB/s
//! of each measured round: bytes of every worker over the wall time from
//! the first worker's start to the last one's end).

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::try_join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Barrier, Mutex};

const USAGE: &str = "usage: ps-raw server --addr HOST:PORT
       ps-raw worker --addr HOST:PORT[,HOST:PORT...] [--workers W] [--keys K] [--size BYTES]
                     [--rounds R] [--warmup-rounds N]";

const PUSH: u8 = b'P';
const PULL: u8 = b'G';

fn usage() -> ExitCode {
    eprintln!("{USAGE}");
    ExitCode::from(2)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((mode, rest)) = args.split_first() else {
        return usage();
    };
    let mut flags = std::collections::BTreeMap::new();
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let Some(value) = it.next() else {
            return usage();
        };
        flags.insert(flag.as_str(), value.as_str());
    }
    let number = |flag: &str, default: u64| -> Result<u64, String> {
        flags.get(flag).map_or(Ok(default), |v| {
            v.parse()
                .map_err(|_| format!("{flag} wants a number, not {v:?}"))
        })
    };
    let outcome = match (mode.as_str(), flags.get("--addr")) {
        ("server", Some(addr)) => serve(addr).await,
        ("worker", Some(addr)) => {
            let plan = (|| {
                Ok::<_, String>(Plan {
                    shards: addr.split(',').map(str::to_owned).collect(),
                    workers: number("--workers", 1)? as usize,
                    keys: number("--keys", 2)?,
                    size: number("--size", 1 << 20)? as usize,
                    rounds: number("--rounds", 1)?,
                    warmup_rounds: number("--warmup-rounds", 0)?,
                })
            })();
            match plan {
                Ok(plan) if plan.workers > 0 && plan.keys > 0 && plan.rounds > 0 => {
                    work(Arc::new(plan)).await
                }
                Ok(_) => return usage(),
                Err(e) => Err(e),
            }
        }
        _ => return usage(),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ps-raw: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(addr: &str) -> Result<(), String> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("binding {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    println!("listening on {local}");
    let tensors = Arc::new(Tensors::default());
    loop {
        let (stream, _) = listener
            .accept()
            .await
            .map_err(|e| format!("accepting: {e}"))?;
        let tensors = Arc::clone(&tensors);
        tokio::spawn(async move {
            // A worker that goes away simply ends its connection.
            let _ = shard_connection(stream, &tensors).await;
        });
    }
}

/// A tensor with its length prefix in front, as a pull reply sends it. A
/// pull holds a reference while it writes; a push sums in place when none
/// does, else into a copy (as `ps-server`).
type Tensor = Arc<Vec<u8>>;

/// A shard's tensors by key, each behind a lock of its own: pushes to other
/// keys go on while one is summed.
#[derive(Default)]
struct Tensors(std::sync::Mutex<HashMap<u32, Arc<std::sync::Mutex<Tensor>>>>);

impl Tensors {
    /// The tensor of `key`, `len` bytes (zeros if it had none or another length).
    fn get(&self, key: u32, len: usize) -> Arc<std::sync::Mutex<Tensor>> {
        let tensor = Arc::clone(self.0.lock().expect("tensors").entry(key).or_default());
        let mut held = tensor.lock().expect("tensor");
        if held.len() != 4 + len {
            let mut zeros = vec![0; 4 + len];
            zeros[..4].copy_from_slice(&(len as u32).to_le_bytes());
            *held = Arc::new(zeros);
        }
        drop(held);
        tensor
    }

    /// Adds `gradient` (little-endian f32s) to the tensor of `key`.
    fn sum_into(&self, key: u32, gradient: &[u8]) {
        let tensor = self.get(key, gradient.len());
        let mut tensor = tensor.lock().expect("tensor");
        let values = &mut Arc::make_mut(&mut tensor)[4..];
        for (value, add) in values.chunks_exact_mut(4).zip(gradient.chunks_exact(4)) {
            let sum = f32::from_le_bytes(value.try_into().expect("4 bytes"))
                + f32::from_le_bytes(add.try_into().expect("4 bytes"));
            value.copy_from_slice(&sum.to_le_bytes());
        }
    }
}

/// One worker's connection to this shard: a push is read into this
/// connection's buffer for its key and summed into the key's tensor, a
/// pull answered from the key's tensor.
async fn shard_connection(mut stream: TcpStream, tensors: &Tensors) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut pushed: HashMap<u32, Vec<u8>> = HashMap::new();
    loop {
        let mut head = [0u8; 9];
        match stream.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let key = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(head[5..].try_into().expect("4 bytes")) as usize;
        match head[0] {
            PUSH => {
                let gradient = pushed.entry(key).or_default();
                gradient.resize(len, 0);
                stream.read_exact(gradient).await?;
                tensors.sum_into(key, gradient);
                stream.write_all(&[1]).await?;
            }
            PULL => {
                let tensor = Arc::clone(&tensors.get(key, len).lock().expect("tensor"));
                stream.write_all(&tensor).await?;
            }
            other => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("unknown operation {other}"),
                ))
            }
        }
    }
}

struct Plan {
    shards: Vec<String>,
    workers: usize,
    keys: u64,
    size: usize,
    rounds: u64,
    warmup_rounds: u64,
}

impl Plan {
    /// The keys shard `shard` holds: key `k` goes to shard `k % shards`.
    fn keys_of(&self, shard: usize) -> impl Iterator<Item = u64> + Clone + '_ {
        let shards = self.shards.len() as u64;
        (0..self.keys).filter(move |k| k % shards == shard as u64)
    }
}

/// When one worker began and ended one phase of one round.
type Span = (Instant, Instant);

/// One worker's connection to one shard and its buffers, per key of the
/// shard: a push frame (header and payload) and a pull destination.
struct ShardLink {
    stream: TcpStream,
    push_frames: HashMap<u64, Vec<u8>>,
    pulled: HashMap<u64, Vec<u8>>,
}

impl ShardLink {
    async fn push(&mut self, key: u64) -> std::io::Result<()> {
        self.stream.write_all(&self.push_frames[&key]).await?;
        let mut ack = [0u8; 1];
        self.stream.read_exact(&mut ack).await?;
        Ok(())
    }

    async fn pull(&mut self, key: u64, size: usize) -> std::io::Result<()> {
        self.stream.write_all(&head(PULL, key, size)).await?;
        let len = self.stream.read_u32_le().await? as usize;
        if len != size {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("pulled {len} bytes, asked for {size}"),
            ));
        }
        let destination = self.pulled.get_mut(&key).expect("a buffer per key");
        self.stream.read_exact(destination).await?;
        Ok(())
    }
}

/// An operation's 9-byte header: the operation, the key, the length.
fn head(operation: u8, key: u64, len: usize) -> [u8; 9] {
    let mut head = [operation, 0, 0, 0, 0, 0, 0, 0, 0];
    head[1..5].copy_from_slice(&(key as u32).to_le_bytes());
    head[5..].copy_from_slice(&(len as u32).to_le_bytes());
    head
}

async fn work(plan: Arc<Plan>) -> Result<(), String> {
    if plan.size > u32::MAX as usize || plan.keys > u32::MAX as u64 {
        return Err("--size and --keys must fit in 32 bits".into());
    }
    let mut workers = Vec::new();
    for _ in 0..plan.workers {
        let mut links = Vec::new();
        for (shard, addr) in plan.shards.iter().enumerate() {
            let stream = TcpStream::connect(addr)
                .await
                .map_err(|e| format!("connecting to {addr}: {e}"))?;
            stream.set_nodelay(true).map_err(|e| e.to_string())?;
            let keys = plan.keys_of(shard);
            let push_frames = keys
                .clone()
                .map(|k| {
                    let mut frame = head(PUSH, k, plan.size).to_vec();
                    frame.resize(9 + plan.size, 0);
                    (k, frame)
                })
                .collect();
            let pulled = keys.map(|k| (k, vec![0; plan.size])).collect();
            links.push(Mutex::new(ShardLink {
                stream,
                push_frames,
                pulled,
            }));
        }
        workers.push(links);
    }
    let barrier = Arc::new(Barrier::new(plan.workers));
    let mut tasks = tokio::task::JoinSet::new();
    for links in workers {
        let (plan, barrier) = (Arc::clone(&plan), Arc::clone(&barrier));
        tasks.spawn(async move { run_worker(&plan, &barrier, &links).await });
    }
    let all_rounds = (plan.warmup_rounds + plan.rounds) as usize;
    let mut pushes = vec![Vec::new(); all_rounds];
    let mut pulls = vec![Vec::new(); all_rounds];
    while let Some(outcome) = tasks.join_next().await {
        match outcome {
            Ok(Ok(spans)) => {
                for (r, (push, pull)) in spans.into_iter().enumerate() {
                    pushes[r].push(push);
                    pulls[r].push(pull);
                }
            }
            Ok(Err(e)) => {
                tasks.abort_all();
                return Err(e);
            }
            Err(e) if e.is_cancelled() => {}
            Err(e) => return Err(format!("a worker panicked: {e}")),
        }
    }
    let bytes = plan.workers as u64 * plan.keys * plan.size as u64;
    let warmup = plan.warmup_rounds as usize;
    for (phase, rounds) in [("push", &pushes[warmup..]), ("pull", &pulls[warmup..])] {
        for (r, spans) in rounds.iter().enumerate() {
            let start = spans.iter().map(|s| s.0).min().expect("a worker");
            let end = spans.iter().map(|s| s.1).max().expect("a worker");
            let wall: Duration = end - start;
            println!(
                "ps phase={phase} round={r} workers={} shards={} keys={} size={} bytes={bytes} secs={:.6} gb_per_s={:.4}",
                plan.workers,
                plan.shards.len(),
                plan.keys,
                plan.size,
                wall.as_secs_f64(),
                bytes as f64 / wall.as_secs_f64() / 1e9
            );
        }
    }
    Ok(())
}

/// Every round of one worker: push every key (between barriers), then pull
/// every key; each shard's keys one after the other, the shards at once.
async fn run_worker(
    plan: &Plan,
    barrier: &Barrier,
    links: &[Mutex<ShardLink>],
) -> Result<Vec<(Span, Span)>, String> {
    let mut spans = Vec::new();
    for _ in 0..plan.warmup_rounds + plan.rounds {
        barrier.wait().await;
        let push_started = Instant::now();
        let pushed = try_join_all(links.iter().enumerate().map(|(shard, link)| async move {
            let mut link = link.lock().await;
            for k in plan.keys_of(shard) {
                link.push(k).await?;
            }
            Ok::<_, std::io::Error>(())
        }))
        .await;
        let push_ended = Instant::now();
        // Waited on even after a failure, so the other workers do not hang.
        barrier.wait().await;
        pushed.map_err(|e| format!("push: {e}"))?;
        let pull_started = Instant::now();
        try_join_all(links.iter().enumerate().map(|(shard, link)| async move {
            let mut link = link.lock().await;
            for k in plan.keys_of(shard) {
                link.pull(k, plan.size).await?;
            }
            Ok::<_, std::io::Error>(())
        }))
        .await
        .map_err(|e| format!("pull: {e}"))?;
        let pull_ended = Instant::now();
        spans.push(((push_started, push_ended), (pull_started, pull_ended)));
    }
    Ok(spans)
}
