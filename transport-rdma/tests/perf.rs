//! Rough numbers on the device, printed for comparison with perftest in the
//! same guest (`cargo xtask rxe-baseline`): small-call round trip and 4 MiB
//! throughput, raw frames and RPC calls. Asserts only that everything
//! arrives; the numbers are for reading (`--nocapture`).

mod common;

use std::future::poll_fn;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::TestEnv;
use rpc_core::frame::{OutBody, OutFrame};
use rpc_core::transport::{FrameLimits, Transport};
use rpc_core::{BytesCodec, Channel, Client, Request};
use transport_rdma::RdmaTransport;

#[path = "../../rpc-core/tests/support/mod.rs"]
mod support;

const LIMITS: FrameLimits = FrameLimits {
    max_frame_len: 64 << 20,
};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn round_trip_and_throughput() {
    let env = TestEnv::from_env();
    for busy in [None, Some(Duration::from_micros(50))] {
        let cfg = RdmaTransport::default().busy_poll(busy);
        let (mut listener, target) = env.listen_here(&cfg, LIMITS).await;
        let (client, server) = tokio::join!(
            cfg.connect(&target, LIMITS),
            poll_fn(|cx| listener.poll_accept(cx))
        );
        let (mut client, mut server) = (client.unwrap(), server.unwrap());
        let echo = tokio::spawn(async move {
            while let Ok(Some(frame)) = server.source.recv().await {
                let body = frame.slice(rpc_core::frame::HEAD_LEN..);
                let out = OutFrame::new(0, OutBody::Message, Some(&body), false).unwrap();
                if server.sink.send(&out).await.is_err() {
                    break;
                }
            }
        });
        // Round trips of a 2-byte payload (a 22-byte frame).
        let small = Bytes::from_static(b"hi");
        let mut rtts = Vec::new();
        for i in 0..600 {
            let started = Instant::now();
            let out = OutFrame::new(i, OutBody::Message, Some(&small), false).unwrap();
            client.sink.send(&out).await.unwrap();
            client.source.recv().await.unwrap().unwrap();
            if i >= 100 {
                rtts.push(started.elapsed());
            }
        }
        rtts.sort();
        println!(
            "frames, busy_poll {busy:?}: 2-byte payload round trip: min {:?} median {:?} p99 {:?}",
            rtts[0],
            percentile(&rtts, 0.5),
            percentile(&rtts, 0.99)
        );
        // 4 MiB frames one way, echoed back: bytes moved / time, both ways.
        let big = Bytes::from(vec![7u8; 4 << 20]);
        let n = 8;
        let started = Instant::now();
        for i in 0..n {
            let out = OutFrame::new(i, OutBody::Message, Some(&big), false).unwrap();
            client.sink.send(&out).await.unwrap();
            let back = client.source.recv().await.unwrap().unwrap();
            assert_eq!(back.len(), out.len());
        }
        let secs = started.elapsed().as_secs_f64();
        println!(
            "frames, busy_poll {busy:?}: 4 MiB echo: {:.1} MB/s each way ({n} round trips in {secs:.2} s)",
            (n as f64 * (4 << 20) as f64) / secs / 1e6
        );
        client.sink.close();
        drop(client);
        let _ = echo.await;
    }
    // The same through rpc-core: unary Echo calls.
    transport_rdma::install();
    let server = support::TestServer::start(&env.local_listen(), |b| b).await;
    let client = Client::new(Channel::connect(&server.address).await.unwrap());
    let mut rtts = Vec::new();
    for i in 0..400 {
        let started = Instant::now();
        client
            .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"hi")))
            .await
            .unwrap();
        if i >= 100 {
            rtts.push(started.elapsed());
        }
    }
    rtts.sort();
    println!(
        "rpc: unary Echo 2 bytes: min {:?} median {:?} p99 {:?}",
        rtts[0],
        percentile(&rtts, 0.5),
        percentile(&rtts, 0.99)
    );
    let big = Bytes::from(vec![7u8; 4 << 20]);
    let n = 8;
    let started = Instant::now();
    for _ in 0..n {
        let reply = client
            .unary::<BytesCodec>("/test.Test/Echo", Request::new(big.clone()))
            .await
            .unwrap();
        assert_eq!(reply.get_ref().len(), big.len());
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "rpc: unary Echo 4 MiB: {:.1} MB/s each way ({n} calls in {secs:.2} s)",
        (n as f64 * (4 << 20) as f64) / secs / 1e6
    );
    server.stop().await;
}
