//! Numbers on the device, for reading next to perftest run in the same
//! guest boot (`ib_send_lat`, `ib_send_lat -e`, `ib_write_bw`): small-frame
//! and small-call round trips, and 4 MiB throughput one way, each with
//! event-driven completions (the default) and with a busy-poll window.
//! Asserts only that everything arrives; the numbers are for reading
//! (`--nocapture`). Run it in release:
//!
//! ```text
//! cargo test -p transport-rdma --release --test perf --no-run
//! cargo xtask rxe --env PERF=target/release/deps/perf-<hash> -- sh -c '
//!   ib_send_lat -d rxe0 -s 2 -n 2000 >/dev/null 2>&1 & sleep 1
//!   ib_send_lat -d rxe0 -s 2 -n 2000 $RDMA_TEST_IP; wait
//!   ib_send_lat -d rxe0 -s 2 -n 1000 -e >/dev/null 2>&1 & sleep 1
//!   ib_send_lat -d rxe0 -s 2 -n 1000 -e $RDMA_TEST_IP; wait
//!   ib_write_bw -d rxe0 -s 4194304 -n 50 >/dev/null 2>&1 & sleep 1
//!   ib_write_bw -d rxe0 -s 4194304 -n 50 $RDMA_TEST_IP; wait
//!   $PERF --ignored --nocapture'
//! ```
//!
//! (perftest reports half a round trip, and MB/sec in 2^20 bytes.)

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{within, TestEnv};
use rpc_core::frame::{OutBody, OutFrame};
use rpc_core::transport::FrameLimits;
use rpc_core::{BytesCodec, Channel, Client, Request};
use transport_rdma::RdmaTransport;

use rpc_test_support as support;

const LIMITS: FrameLimits = FrameLimits {
    max_frame_len: 64 << 20,
};
const BIG: usize = 4 << 20;
/// Longer than any part takes here (seconds): a stalled transfer fails with
/// the state of every connection instead of hanging.
const LIMIT: Duration = Duration::from_secs(120);
const BIG_COUNT: usize = 16;
/// Longer than any round trip measured here (tens to hundreds of microseconds
/// on Soft-RoCE under emulation): a reply that comes after the window
/// waits for the completion event after all.
const BUSY_POLL: Duration = Duration::from_millis(1);

/// The two completion modes measured.
fn modes() -> [(&'static str, RdmaTransport); 2] {
    [
        ("events", RdmaTransport::default()),
        (
            "busy-poll 1ms",
            RdmaTransport::default().busy_poll(Some(BUSY_POLL)),
        ),
    ]
}

fn summary(mut rtts: Vec<Duration>) -> String {
    rtts.sort();
    let at = |p: f64| rtts[((rtts.len() as f64 * p) as usize).min(rtts.len() - 1)];
    format!(
        "min {:.1} us, median {:.1} us, p99 {:.1} us ({} round trips)",
        at(0.0).as_secs_f64() * 1e6,
        at(0.5).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
        rtts.len()
    )
}

fn rate(bytes: usize, took: Duration) -> String {
    format!(
        "{:.1} MB/s ({} x 4 MiB in {:.2} s)",
        bytes as f64 / took.as_secs_f64() / 1e6,
        bytes / BIG,
        took.as_secs_f64()
    )
}

/// Frames straight through the transport: a peer that answers every frame
/// with a 2-byte one.
async fn frames(env: &TestEnv, mode: &str, cfg: &RdmaTransport) {
    let (mut client, mut server) = env.pair(cfg, LIMITS).await;
    let small = Bytes::from_static(b"hi");
    let answer = tokio::spawn(async move {
        while let Ok(Some(_frame)) = server.source.recv().await {
            let out = OutFrame::new(0, OutBody::Message, Some(&small), false).unwrap();
            if server.sink.send(&out).await.is_err() {
                break;
            }
        }
    });
    let measure = tokio::spawn(async move {
        let small = Bytes::from_static(b"hi");
        let mut rtts = Vec::new();
        for i in 0..1100 {
            let started = Instant::now();
            let out = OutFrame::new(i, OutBody::Message, Some(&small), false).unwrap();
            client.sink.send(&out).await.unwrap();
            client.source.recv().await.unwrap().unwrap();
            if i >= 100 {
                rtts.push(started.elapsed());
            }
        }
        // 4 MiB frames one way, back to back; each answered by 2 bytes.
        let big = Bytes::from(vec![7u8; BIG]);
        let started = Instant::now();
        let send = async {
            for i in 0..BIG_COUNT {
                let out = OutFrame::new(i as u64, OutBody::Message, Some(&big), false).unwrap();
                client.sink.send(&out).await.unwrap();
            }
        };
        let acks = async {
            let mut source = client.source;
            for _ in 0..BIG_COUNT {
                source.recv().await.unwrap().unwrap();
            }
        };
        tokio::join!(send, acks);
        let took = started.elapsed();
        client.sink.close();
        (rtts, took)
    });
    let (rtts, took) = within(LIMIT, "frame round trips, then 4 MiB frames", measure)
        .await
        .unwrap();
    println!("perf: frames, {mode}: 2-byte payload: {}", summary(rtts));
    println!(
        "perf: frames, {mode}: 4 MiB one way: {}",
        rate(BIG * BIG_COUNT, took)
    );
    within(LIMIT, "the answering side's end", answer)
        .await
        .unwrap();
}

/// Where the inline threshold should sit: frame round trips by size, sent
/// inline (SEND into a ring slot) and through the region (RDMA WRITE, then
/// a SEND), busy-polling so that completion wake-ups do not drown the
/// difference.
async fn threshold(env: &TestEnv) {
    for size in [256usize, 1024, 2048, 4096, 8000] {
        let mut medians = Vec::new();
        for cfg in [
            RdmaTransport::default(),
            RdmaTransport::default().inline_threshold(0),
        ] {
            let cfg = cfg.busy_poll(Some(BUSY_POLL));
            let (mut client, mut server) = env.pair(&cfg, LIMITS).await;
            let echo = tokio::spawn(async move {
                while let Ok(Some(frame)) = server.source.recv().await {
                    let body = frame.slice(rpc_core::frame::HEAD_LEN..);
                    let out = OutFrame::new(0, OutBody::Message, Some(&body), false).unwrap();
                    if server.sink.send(&out).await.is_err() {
                        break;
                    }
                }
            });
            let payload = Bytes::from(vec![3u8; size]);
            let measure = tokio::spawn(async move {
                let mut rtts = Vec::new();
                for i in 0..400 {
                    let started = Instant::now();
                    let out = OutFrame::new(i, OutBody::Message, Some(&payload), false).unwrap();
                    client.sink.send(&out).await.unwrap();
                    let back = client.source.recv().await.unwrap().unwrap();
                    assert_eq!(back.len(), out.len());
                    if i >= 100 {
                        rtts.push(started.elapsed());
                    }
                }
                client.sink.close();
                rtts.sort();
                rtts[rtts.len() / 2]
            });
            medians.push(within(LIMIT, "echoes", measure).await.unwrap());
            within(LIMIT, "the echoing side's end", echo).await.unwrap();
        }
        println!(
            "perf: threshold, {size} B payload echo, busy-poll: inline median {:.1} us, region median {:.1} us",
            medians[0].as_secs_f64() * 1e6,
            medians[1].as_secs_f64() * 1e6
        );
    }
}

/// Calls through rpc-core: unary `Echo` of 2 bytes, and a client stream of
/// 4 MiB messages (`Sum`, one small reply).
async fn calls(env: &TestEnv, mode: &str, cfg: RdmaTransport) {
    rpc_core::transport::register(Arc::new(cfg));
    let server = support::TestServer::start(&env.local_listen(), |b| b).await;
    let client = Client::new(Channel::connect(&server.address).await.unwrap());
    let measure = tokio::spawn(async move {
        let mut rtts = Vec::new();
        for i in 0..1100 {
            let started = Instant::now();
            client
                .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"hi")))
                .await
                .unwrap();
            if i >= 100 {
                rtts.push(started.elapsed());
            }
        }
        let big = Bytes::from(vec![7u8; BIG]);
        let stream = futures::stream::iter(vec![big; BIG_COUNT]);
        let started = Instant::now();
        let reply = client
            .client_streaming::<BytesCodec, _>("/test.Test/Sum", Request::new(stream))
            .await
            .unwrap()
            .into_inner();
        let took = started.elapsed();
        let messages = u64::from_le_bytes(reply[..8].try_into().unwrap());
        assert_eq!(messages, BIG_COUNT as u64);
        (rtts, took)
    });
    let (rtts, took) = within(
        LIMIT,
        "calls, then a client stream of 4 MiB messages",
        measure,
    )
    .await
    .unwrap();
    println!("perf: rpc, {mode}: unary Echo 2 bytes: {}", summary(rtts));
    println!(
        "perf: rpc, {mode}: client stream of 4 MiB messages: {}",
        rate(BIG * BIG_COUNT, took)
    );
    within(LIMIT, "stopping the server", server.stop()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn round_trip_and_throughput() {
    let env = TestEnv::from_env();
    for (mode, cfg) in modes() {
        frames(&env, mode, &cfg).await;
    }
    threshold(&env).await;
    for (mode, cfg) in modes() {
        calls(&env, mode, cfg).await;
    }
}
