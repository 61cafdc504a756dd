//! `RdmaStream` on a real device: random bytes both ways at once with
//! random write and read sizes (1 B to 16 MiB), half-close, a peer process
//! killed mid-transfer, a hundred streams at once within their memory.
//!
//! In a two-host run the random exchange (`…_across_the_wire`) crosses the
//! wire between the guests (the server role serves, the client role
//! connects); the other tests use one device and the two-host suite leaves
//! them out.
//!
//! The test binary re-runs itself as the child of the peer-death test (the
//! `child_*` test, which does nothing unless its parent set its variable).

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{pinned_bytes, ChildGuard, Role, TestEnv, PINNED_PER_END};
use futures::future::join_all;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use transport_rdma::{RdmaListener, RdmaStream};

/// Bytes each way in the random exchange.
const EXCHANGED: u64 = 32 << 20;
/// The largest single write and read of the random exchange.
const MAX_IO: u64 = 16 << 20;
/// Port of the random exchange's server in a two-host run.
const WIRE_PORT: u16 = 7483;
/// A test step that takes longer than this has hung.
const STEP: Duration = Duration::from_secs(120);

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Log-uniform in `1..=max`: as many tiny sizes as huge ones.
    fn size(&mut self, max: u64) -> usize {
        let bits = 64 - max.leading_zeros() as u64;
        let top = 1u64 << (self.next() % bits);
        (1 + self.next() % top).min(max) as usize
    }
}

/// The `n`-th byte of the stream seeded `seed` (cheap to check anywhere).
fn byte_at(seed: u64, n: u64) -> u8 {
    let x = (n ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8
}

/// Writes `total` bytes of stream `seed` in random sizes, then half-closes.
async fn write_random(mut w: impl AsyncWrite + Unpin, seed: u64, total: u64) {
    let mut rng = XorShift(seed | 1);
    let mut at = 0;
    let mut buf = Vec::new();
    while at < total {
        let n = rng.size(MAX_IO).min((total - at) as usize);
        buf.clear();
        buf.extend((at..at + n as u64).map(|i| byte_at(seed, i)));
        w.write_all(&buf)
            .await
            .unwrap_or_else(|e| panic!("writing {n} bytes at {at}: {e}"));
        at += n as u64;
    }
    w.shutdown().await.expect("half-close");
}

/// Reads stream `seed` to EOF in random sizes, checking every byte;
/// returns how many arrived.
async fn read_random(mut r: impl AsyncRead + Unpin, seed: u64) -> u64 {
    let mut rng = XorShift(seed.rotate_left(17) | 1);
    let mut buf = vec![0; MAX_IO as usize];
    let mut at = 0u64;
    loop {
        let want = rng.size(MAX_IO);
        let n = r
            .read(&mut buf[..want])
            .await
            .unwrap_or_else(|e| panic!("reading at {at}: {e}"));
        if n == 0 {
            return at;
        }
        for (i, &b) in buf[..n].iter().enumerate() {
            let pos = at + i as u64;
            assert_eq!(b, byte_at(seed, pos), "byte {pos} of stream {seed:#x}");
        }
        at += n as u64;
    }
}

/// One end of the random exchange: sends stream `mine`, checks `theirs`.
async fn exchange(stream: RdmaStream, mine: u64, theirs: u64) {
    let (r, w) = stream.into_split();
    let started = Instant::now();
    let (_, got) = common::within(
        STEP,
        "the exchange",
        futures::future::join(
            tokio::spawn(write_random(w, mine, EXCHANGED)),
            tokio::spawn(read_random(r, theirs)),
        ),
    )
    .await;
    assert_eq!(got.expect("reader"), EXCHANGED, "bytes received");
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "{} MiB each way in {secs:.1} s ({:.0} MiB/s each way)",
        EXCHANGED >> 20,
        (EXCHANGED >> 20) as f64 / secs
    );
}

async fn connect_retrying(addr: &str) -> RdmaStream {
    let failing = format!("connecting to {addr}");
    common::retrying(common::PEER_PATIENCE, &failing, || {
        RdmaStream::connect(addr)
    })
    .await
}

async fn accept(listener: &mut RdmaListener) -> RdmaStream {
    let (stream, _) = tokio::time::timeout(STEP, listener.accept())
        .await
        .expect("no client came")
        .expect("accepts");
    stream
}

/// A connected pair over this host's device: (client, server).
async fn pair(env: &TestEnv) -> (RdmaStream, RdmaStream) {
    let mut listener = RdmaListener::bind(&env.local_listen())
        .await
        .expect("listens");
    let addr = listener.local_addr().to_string();
    let (client, server) = tokio::join!(RdmaStream::connect(&addr), accept(&mut listener));
    (client.expect("connects"), server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn random_bytes_both_ways_at_once_arrive_exact_across_the_wire() {
    let env = TestEnv::from_env();
    let (server_seed, client_seed) = (0x5e7e_7001, 0xc11e_7002);
    match env.role {
        Role::Both => {
            let (client, server) = pair(&env).await;
            assert!(client.peer_addr().starts_with("rdma://"));
            tokio::join!(
                exchange(client, client_seed, server_seed),
                exchange(server, server_seed, client_seed)
            );
        }
        Role::Server => {
            let mut listener = RdmaListener::bind(&format!("rdma://{}:{WIRE_PORT}", env.ip))
                .await
                .expect("listens");
            let stream = accept(&mut listener).await;
            exchange(stream, server_seed, client_seed).await;
        }
        Role::Client => {
            let peer = env.peer.expect("checked");
            let stream = connect_retrying(&format!("rdma://{peer}:{WIRE_PORT}")).await;
            exchange(stream, client_seed, server_seed).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_half_closed_stream_reads_eof_and_still_carries_the_reply() {
    let env = TestEnv::from_env();
    let (mut client, mut server) = pair(&env).await;
    let request = vec![7u8; 3 << 20];
    // More than the peer's region holds: the client's writes wait for the
    // server's reads.
    let server = tokio::spawn(async move {
        // The server reads everything, then EOF (and EOF again).
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        assert_eq!(server.read(&mut [0; 8]).await.unwrap(), 0, "EOF stays");
        assert_eq!(server.recv_bytes().await.unwrap(), None);
        // It still writes back, then closes.
        for part in [&b"re"[..], &b"ply"[..], &[1u8; 200 << 10][..]] {
            server.write_all(part).await.unwrap();
        }
        got
    });
    tokio::time::timeout(STEP, client.write_all(&request))
        .await
        .expect("writing the request hung")
        .unwrap();
    client.shutdown().await.unwrap();
    let err = client
        .write_all(b"late")
        .await
        .expect_err("a write after shutdown");
    assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe, "{err}");
    let got = tokio::time::timeout(STEP, server)
        .await
        .expect("the server hung")
        .unwrap();
    assert!(got == request, "request bytes differ");
    // The client reads the reply, then EOF.
    let mut reply = Vec::new();
    tokio::time::timeout(STEP, client.read_to_end(&mut reply))
        .await
        .expect("reading the reply hung")
        .unwrap();
    assert_eq!(&reply[..5], b"reply");
    assert_eq!(reply.len(), 5 + (200 << 10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn received_bytes_are_handed_out_as_they_arrived() {
    let env = TestEnv::from_env();
    tokio::time::timeout(STEP, handed_out_as_they_arrived(&env))
        .await
        .expect("hung");
}

async fn handed_out_as_they_arrived(env: &TestEnv) {
    let (mut client, mut server) = pair(env).await;
    // Small, slot-sized and region-sized writes, vectored and not.
    let a = vec![1u8; 100];
    let b = vec![2u8; 8000];
    let c = vec![3u8; 300 << 10];
    client.write_all(&a).await.unwrap();
    let written = client
        .write_vectored(&[std::io::IoSlice::new(&b), std::io::IoSlice::new(&c)])
        .await
        .unwrap();
    assert_eq!(written, b.len() + c.len(), "one gathered message");
    client.shutdown().await.unwrap();
    let first = server.recv_bytes().await.unwrap().expect("a message");
    assert_eq!(first, a);
    let second = server.recv_bytes().await.unwrap().expect("a message");
    assert_eq!(second.len(), b.len() + c.len());
    assert!(second[..b.len()] == b[..] && second[b.len()..] == c[..]);
    assert_eq!(server.recv_bytes().await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn tiny_writes_to_a_reader_that_lags_are_coalesced() {
    const WRITES: usize = 50_000;
    let env = TestEnv::from_env();
    let (client, mut server) = pair(&env).await;
    let (written, go) = tokio::sync::oneshot::channel();
    let writer = tokio::spawn(async move {
        let (_r, mut w) = client.into_split();
        for i in 0..WRITES {
            w.write_all(&(i as u32).to_le_bytes()).await.unwrap();
        }
        // 200 KB: all taken (queued in send slots) before the reader starts.
        written.send(()).unwrap();
        w.shutdown().await.unwrap();
    });
    tokio::time::timeout(STEP, go)
        .await
        .expect("the writer waited for the reader: not coalesced")
        .unwrap();
    let mut bytes = Vec::new();
    let mut messages = 0;
    while let Some(message) = tokio::time::timeout(STEP, server.recv_bytes())
        .await
        .expect("read hung")
        .unwrap()
    {
        messages += 1;
        bytes.extend_from_slice(&message);
    }
    writer.await.unwrap();
    assert_eq!(bytes.len(), 4 * WRITES);
    for (i, word) in bytes.chunks(4).enumerate() {
        assert_eq!(word, (i as u32).to_le_bytes(), "write {i}");
    }
    eprintln!("{WRITES} writes of 4 bytes arrived in {messages} messages");
    assert!(
        messages < WRITES / 100,
        "{messages} messages for {WRITES} writes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_reset_stream_fails_the_peers_reads_instead_of_ending_them() {
    let env = TestEnv::from_env();
    let (mut client, mut server) = pair(&env).await;
    client.write_all(b"before").await.unwrap();
    let mut got = [0; 6];
    server.read_exact(&mut got).await.unwrap();
    client.reset();
    let err = tokio::time::timeout(STEP, server.read(&mut [0; 8]))
        .await
        .expect("the reset peer's read hung")
        .expect_err("a reset read as data or EOF");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    let err = server
        .write_all(b"after")
        .await
        .expect_err("a write to a reset peer");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
}

/// Child: connects to `RDMA_STREAM_CHILD` and writes until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn child_stream_writer() {
    let addr = std::env::var("RDMA_STREAM_CHILD")
        .expect("child_stream_writer is the child half of a test: its parent runs it");
    let mut stream = connect_retrying(&addr).await;
    let chunk = vec![9u8; 256 << 10];
    loop {
        stream.write_all(&chunk).await.expect("child writes");
    }
}

/// A child process, killed when dropped (also when the test fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_peer_killed_mid_transfer_ends_reads_and_writes_with_an_error() {
    let env = TestEnv::from_env();
    let mut listener = RdmaListener::bind(&env.local_listen())
        .await
        .expect("listens");
    let child = ChildGuard(
        Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "child_stream_writer", "--nocapture"])
            .env("RDMA_STREAM_CHILD", listener.local_addr())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the child"),
    );
    let mut stream = accept(&mut listener).await;
    // Mid-transfer: the child's bytes are flowing.
    let mut buf = vec![0; 1 << 20];
    let mut got = 0;
    while got < 8 << 20 {
        let n = tokio::time::timeout(STEP, stream.read(&mut buf))
            .await
            .expect("the child's bytes stopped")
            .expect("reads from the live child");
        assert!(n > 0, "EOF from a live child");
        got += n;
    }
    drop(child);
    let killed = Instant::now();
    let err = tokio::time::timeout(STEP, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => panic!("a killed peer read as a clean EOF"),
                Ok(_) => {}
                Err(e) => return e,
            }
        }
    })
    .await
    .expect("reading from the killed peer hung");
    eprintln!("read failed {:?} after the kill: {err}", killed.elapsed());
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    let err = stream
        .write_all(b"anyone?")
        .await
        .expect_err("a write to a killed peer");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    // The listener still accepts.
    let addr = listener.local_addr().to_string();
    let (client, server) = tokio::join!(RdmaStream::connect(&addr), accept(&mut listener));
    let (mut client, mut server) = (client.expect("connects again"), server);
    client.write_all(b"still here").await.unwrap();
    let mut back = [0; 10];
    server.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"still here");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_hundred_streams_at_once_within_their_memory_budget() {
    const STREAMS: usize = 100;
    let env = TestEnv::from_env();
    let mut listener = RdmaListener::bind(&env.local_listen())
        .await
        .expect("listens");
    let addr = listener.local_addr().to_string();
    let before = pinned_bytes();
    let server = tokio::spawn(async move {
        let mut echoes = Vec::new();
        for _ in 0..STREAMS {
            let mut stream = accept(&mut listener).await;
            echoes.push(tokio::spawn(async move {
                let (mut r, mut w) = stream.split();
                tokio::io::copy(&mut r, &mut w).await.expect("echo");
            }));
        }
        listener
    });
    let mut clients = Vec::with_capacity(STREAMS);
    for i in 0..STREAMS {
        let stream = RdmaStream::connect(&addr)
            .await
            .unwrap_or_else(|e| panic!("stream {i} of {STREAMS}: {e}"));
        clients.push(stream);
    }
    let pinned = pinned_bytes().saturating_sub(before);
    let budget = 2 * STREAMS as u64 * PINNED_PER_END;
    eprintln!(
        "{STREAMS} streams (both ends here): {} MiB pinned, budget {} MiB",
        pinned >> 20,
        budget >> 20
    );
    assert!(pinned <= budget, "{pinned} bytes pinned, over {budget}");
    // Every stream echoes its own bytes at once.
    let runs = clients
        .into_iter()
        .enumerate()
        .map(|(i, stream)| async move {
            let (mut r, w) = stream.into_split();
            let seed = 0x1000 + i as u64;
            let writer = tokio::spawn(write_random_fixed(w, seed, 256 << 10));
            let mut got = Vec::new();
            r.read_to_end(&mut got).await.expect("reads the echo");
            writer.await.unwrap();
            assert_eq!(got.len(), 256 << 10, "stream {i}");
            assert!(
                got.iter()
                    .enumerate()
                    .all(|(n, &b)| b == byte_at(seed, n as u64)),
                "stream {i}: echoed bytes differ"
            );
        });
    tokio::time::timeout(Duration::from_secs(300), join_all(runs))
        .await
        .expect("the hundred streams hung");
    let listener = server.await.unwrap();
    drop(listener);
    // Closed: the memory goes back (the drivers end once their Close went).
    let started = Instant::now();
    while pinned_bytes() > before + PINNED_PER_END && started.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let left = pinned_bytes().saturating_sub(before);
    assert!(
        left <= PINNED_PER_END,
        "{left} bytes still pinned after closing"
    );
}

/// Writes `total` bytes of stream `seed` in 16 KiB writes, then half-closes.
async fn write_random_fixed(mut w: impl AsyncWrite + Unpin, seed: u64, total: usize) {
    let data: Vec<u8> = (0..total as u64).map(|n| byte_at(seed, n)).collect();
    for chunk in data.chunks(16 << 10) {
        w.write_all(chunk).await.expect("writes");
    }
    w.shutdown().await.expect("half-close");
}
