//! Criterion micro-benchmarks of `transport-rdma`'s ring/credit accounting:
//! the sans-I/O protocol core (`transport_rdma::proto`) that runs for every
//! message on the RDMA path, with no device:
//!
//! - `rdma_header/encode`, `rdma_header/decode`: the 32-byte header at the
//!   start of every SEND (decode validates every field);
//! - `rdma_credit/message`: one inline message's credit accounting at both
//!   ends: the sender takes a credit, the receiver's ring counts the
//!   arrival, hands the slot up zero-copy, gets it back and returns the
//!   credit piggybacked on its next header, the sender is granted it;
//! - `rdma_credit/burst`: a window's worth of messages one way, then the
//!   receiver's `Credit` message returning all the slots at once (both
//!   peers' windows and rings kept, as on a connection);
//! - `rdma_region/chunk`: one large-payload chunk through the region
//!   allocator: the writer allocates, the reader checks the announced
//!   position, frees it and reports, the writer is told (at 4 KiB to
//!   512 KiB, half of the default 1 MiB region);
//! - `rdma_reassembly/fresh`, `rdma_reassembly/kept`: a 64 MiB frame put
//!   back together from 512 KiB region chunks (the copy out of the region)
//!   and dropped, in a buffer that grows from nothing (fresh pages each
//!   time: glibc unmaps chunks over 32 MiB on free) or in the buffer of
//!   the frame before ([`rpc_core::kept::KeptBuffers`]).
//!
//! Run with `cargo bench -p benches --bench rdma_proto`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::sync::Arc;

use rpc_core::kept::KeptBuffers;
use transport_rdma::proto::{
    Assembled, CreditWindow, Delivery, Header, Kind, Reassembly, RecvRing, RegionReader,
    RegionWriter, FIRST, HEADER_LEN, LAST,
};

/// The default ring: 64 slots.
const SLOTS: u32 = 64;
/// The default region: 1 MiB.
const REGION: u64 = 1 << 20;

fn chunk_header() -> Header {
    Header {
        kind: Kind::Chunk,
        flags: FIRST | LAST,
        credits: 7,
        len: 64 << 10,
        total: 64 << 10,
        pos: 3 << 20,
        freed_to: (3 << 20) - (64 << 10),
    }
}

fn headers(c: &mut Criterion) {
    let mut group = c.benchmark_group("rdma_header");
    group.throughput(Throughput::Elements(1));
    let header = chunk_header();
    group.bench_function("encode", |b| {
        let mut out = [0u8; HEADER_LEN];
        b.iter(|| {
            black_box(&header).encode(&mut out);
            black_box(out[0])
        });
    });
    let mut inline = Header::new(Kind::Inline);
    inline.credits = 3;
    inline.len = 1024;
    let mut message = inline.to_bytes().to_vec();
    message.resize(HEADER_LEN + 1024, 0xab);
    for (name, bytes) in [
        ("chunk", header.to_bytes().to_vec()),
        ("inline_1KiB", message),
    ] {
        group.bench_with_input(BenchmarkId::new("decode", name), &bytes, |b, bytes| {
            b.iter(|| Header::decode(black_box(bytes), black_box(bytes.len())).expect("valid"));
        });
    }
    group.finish();
}

fn credits(c: &mut Criterion) {
    let mut group = c.benchmark_group("rdma_credit");
    group.throughput(Throughput::Elements(1));
    group.bench_function("message", |b| {
        let mut window = CreditWindow::new(SLOTS, SLOTS);
        let mut ring = RecvRing::new(SLOTS, SLOTS);
        b.iter(|| {
            assert!(window.take_data());
            ring.on_arrival().expect("a credit was taken");
            if ring.deliver() == Delivery::ZeroCopy {
                ring.on_released();
            } else {
                ring.on_reposted();
            }
            let returned = ring.take_credits();
            window.grant(black_box(returned)).expect("within the ring");
            black_box(window.available())
        });
    });
    // A sends everything its window allows (the last credit is kept for
    // control messages), piggybacking what it owes B on each header; B
    // answers with one `Credit` message returning every slot, on the credit
    // it keeps for that; A gets the slot of that message back to B on the
    // next burst's first header.
    let burst = SLOTS - 1;
    group.throughput(Throughput::Elements(u64::from(burst)));
    group.bench_with_input(BenchmarkId::new("burst", burst), &burst, |b, &burst| {
        let (mut a_window, mut a_ring) =
            (CreditWindow::new(SLOTS, SLOTS), RecvRing::new(SLOTS, SLOTS));
        let (mut b_window, mut b_ring) =
            (CreditWindow::new(SLOTS, SLOTS), RecvRing::new(SLOTS, SLOTS));
        b.iter(|| {
            for _ in 0..burst {
                assert!(a_window.take_data());
                let piggybacked = a_ring.take_credits();
                b_ring.on_arrival().expect("a credit was taken");
                b_window.grant(piggybacked).expect("within A's ring");
                b_ring.on_reposted();
            }
            assert!(!a_window.take_data(), "the window is spent");
            assert!(b_ring.wants_credit_message());
            assert!(b_window.take_control());
            let returned = b_ring.take_credits();
            a_ring.on_arrival().expect("B took a credit");
            a_window
                .grant(black_box(returned))
                .expect("within B's ring");
            a_ring.on_reposted();
            black_box(a_window.available())
        });
    });
    group.finish();
}

fn region(c: &mut Criterion) {
    let mut group = c.benchmark_group("rdma_region");
    for chunk in [4u64 << 10, 64 << 10, 512 << 10] {
        group.throughput(Throughput::Elements(1));
        group.bench_with_input(BenchmarkId::new("chunk", chunk), &chunk, |b, &chunk| {
            let mut writer = RegionWriter::new(REGION);
            let mut reader = RegionReader::new(REGION);
            b.iter(|| {
                let pos = writer.alloc(black_box(chunk)).expect("all freed");
                let offset = reader.accept(pos, chunk).expect("where the rule puts it");
                reader.free_through(pos + chunk);
                if reader.wants_report() {
                    writer.on_freed(reader.report()).expect("in order");
                }
                black_box(offset + writer.offset(pos))
            });
        });
    }
    group.finish();
}

fn reassembly(c: &mut Criterion) {
    let mut group = c.benchmark_group("rdma_reassembly");
    group.sample_size(10);
    let chunk = vec![7u8; 512 << 10];
    for total in [64usize << 20] {
        group.throughput(Throughput::Bytes(total as u64));
        for kept in [false, true] {
            let mut r = Reassembly::new(128 << 20, 256 << 20, 64);
            if kept {
                r.keep_buffers_in(Arc::new(KeptBuffers::new(256 << 20)));
            }
            let name = if kept { "kept" } else { "fresh" };
            group.bench_function(BenchmarkId::new(name, total >> 20), |b| {
                b.iter(|| {
                    let chunks = total / chunk.len();
                    let mut out = None;
                    for i in 0..chunks {
                        let first = if i == 0 { FIRST } else { 0 };
                        let last = if i == chunks - 1 { LAST } else { 0 };
                        out = r.chunk(first | last, total as u32, &chunk).expect("valid");
                    }
                    match out {
                        Some(Assembled::Frame(frame)) => black_box(frame.len()),
                        other => panic!("no frame: {other:?}"),
                    }
                });
            });
        }
    }
    group.finish();
}

criterion_group!(rdma_proto, headers, credits, region, reassembly);
criterion_main!(rdma_proto);
