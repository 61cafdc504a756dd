//! Criterion micro-benchmarks of rdma-rpc's hot paths:
//!
//! - `frame/encode`, `frame/decode`: a message frame to and from bytes;
//! - `unary_mem`: one generated unary call over the in-process `mem://`
//!   transport, the framework's own cost per call with no network.
//!
//! Ring/credit accounting (`transport-rdma`'s protocol core) is in
//! `rdma_proto.rs`.
//!
//! Run with `cargo bench -p benches --bench micro`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use benches::measure::payload;
use benches::rpcbench::bench_client::BenchClient;
use benches::rpcbench::bench_server::BenchServer;
use benches::rpcbench::Payload;
use benches::server::RpcEcho;
use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rpc_core::frame::{Frame, OutBody, OutFrame};
use rpc_core::metadata::MetadataMap;

const SIZES: [usize; 4] = [32, 1024, 64 << 10, 1 << 20];

fn frame_bytes(call_id: u64, payload: &Bytes) -> Bytes {
    OutFrame::control(call_id, OutBody::Message, true)
        .with_payload(payload)
        .to_bytes()
}

fn frames(c: &mut Criterion) {
    let mut group = c.benchmark_group("frame");
    for size in SIZES {
        let payload = payload(size);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("encode", size), &payload, |b, payload| {
            let mut buf = BytesMut::with_capacity(size + 64);
            b.iter(|| {
                buf.clear();
                OutFrame::control(black_box(7), OutBody::Message, true)
                    .with_payload(payload)
                    .encode(&mut buf);
                black_box(buf.len())
            });
        });
        let metadata = MetadataMap::new();
        group.bench_with_input(
            BenchmarkId::new("encode_request", size),
            &payload,
            |b, payload| {
                let mut buf = BytesMut::with_capacity(size + 128);
                b.iter(|| {
                    buf.clear();
                    let body = OutBody::Request {
                        method: "/rpcbench.Bench/Echo",
                        timeout: Some(Duration::from_secs(5)),
                        metadata: &metadata,
                    };
                    OutFrame::new(black_box(7), body, Some(payload), false)
                        .expect("small header")
                        .encode(&mut buf);
                    black_box(buf.len())
                });
            },
        );
        let encoded = frame_bytes(7, &payload);
        group.bench_with_input(BenchmarkId::new("decode", size), &encoded, |b, encoded| {
            b.iter(|| Frame::decode(black_box(encoded.clone())).expect("valid frame"));
        });
    }
    group.finish();
}

fn unary_mem(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let client = runtime.block_on(async {
        let server = rpc_core::Server::builder()
            .add_service(BenchServer::new(RpcEcho))
            .bind("mem://micro-unary")
            .await
            .expect("bind mem://");
        tokio::spawn(server.serve());
        BenchClient::connect("mem://micro-unary")
            .await
            .expect("connect mem://")
    });
    let mut group = c.benchmark_group("unary_mem");
    for size in [32, 1024, 64 << 10] {
        let payload = payload(size);
        group.throughput(Throughput::Elements(1));
        group.bench_with_input(BenchmarkId::from_parameter(size), &payload, |b, payload| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let started = Instant::now();
                    for _ in 0..iters {
                        let reply = client
                            .echo(Payload {
                                data: payload.clone(),
                            })
                            .await
                            .expect("echo over mem://");
                        black_box(reply);
                    }
                    started.elapsed()
                })
            });
        });
    }
    group.finish();
}

criterion_group!(micro, frames, unary_mem);
criterion_main!(micro);
