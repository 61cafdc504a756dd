//! What the transport reports for metrics (`Transport::stats`) and what
//! rpc-core counts for `rdma://`, on a real device: pinned bytes rise by
//! a connection's two ends while it is open and fall back once it closes;
//! the device's events are counted from its first connection; connections
//! count open on both sides, then closed.
//!
//! Needs `RDMA_TEST_DEVICE` / `RDMA_TEST_IP`. Uses one device; the
//! two-host suite leaves it out.

mod common;
use rpc_test_support as support;

use std::time::Duration;

use bytes::Bytes;
use common::{send_queue_depth, TestEnv, IDLE_PER_END};
use rpc_core::transport::stats::{connection_stats, ConnectionStats, Side, TransportStat};
use rpc_core::{BytesCodec, Channel, Client, Request};
use support::TestServer;

fn rdma_stats() -> Vec<TransportStat> {
    rpc_core::transport::lookup("rdma")
        .expect("rdma:// is installed")
        .stats()
}

fn pinned() -> u64 {
    rdma_stats()
        .iter()
        .find(|s| s.name == "rdma_pinned_bytes")
        .expect("RdmaTransport reports rdma_pinned_bytes (is `fn stats` in its Transport impl?)")
        .value
}

/// `rdma_verbs_objects` by kind: queue pairs, completion queues,
/// completion channels, protection domains, memory registrations.
fn verbs_objects() -> [u64; 5] {
    let stats = rdma_stats();
    [
        "queue_pair",
        "completion_queue",
        "completion_channel",
        "protection_domain",
        "memory_registration",
    ]
    .map(|kind| {
        stats
            .iter()
            .find(|s| s.name == "rdma_verbs_objects" && s.labels == [("kind", kind.to_string())])
            .unwrap_or_else(|| panic!("RdmaTransport reports rdma_verbs_objects of kind {kind}"))
            .value
    })
}

fn connections(side: Side) -> ConnectionStats {
    connection_stats()
        .into_iter()
        .find(|s| s.scheme == "rdma" && s.side == side)
        .expect("rdma:// connections are counted")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn pinned_bytes_and_connections_follow_a_connection() {
    let env = TestEnv::from_env();
    transport_rdma::install();
    let server = TestServer::start(&env.local_listen(), |b| b).await;
    let before = pinned();

    let channel = Channel::connect(&server.address).await.unwrap();
    let client = Client::new(channel.clone());
    client
        .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"hi")))
        .await
        .unwrap();

    // Both ends are in this process: twice one end's memory (whole pages,
    // as the regions are; no staging, as no frame needed it).
    let open = pinned() - before;
    assert!(
        (2 * IDLE_PER_END..=2 * IDLE_PER_END + (64 << 10)).contains(&open),
        "{open} bytes pinned for one connection, expected about {}",
        2 * IDLE_PER_END
    );
    assert_eq!(connections(Side::Client).open(), 1);
    // A queue pair, a completion queue and its channel per end; the
    // device's protection domain shared; each end's first ring slots in a
    // registration (the first two pieces of the device's first slots are
    // a chunk each), and nothing else registered after inline frames.
    assert_eq!(verbs_objects(), [2, 2, 2, 1, 2]);
    // The debugging dump names each end's queue pair state, as the device
    // reports it.
    let dump = transport_rdma::debug_dump();
    assert_eq!(dump.matches("| QP RTS, ack timeout ").count(), 2, "{dump}");
    // Each end's send queue is as deep as 64 data slots need: a SEND
    // each, a WRITE for at most 16 region frames among them, 4 chunk
    // slots (a WRITE and a SEND each), 4 control slots, 16 reads, 2 binds
    // and 4 more: 114. The server's for the client's ring (64 slots by
    // default), the client's for its own (it creates its queue pair
    // before it learns the server's ring, and then keeps at most that
    // many frames in flight), not for the largest ring a peer may
    // announce (256 slots, 546 when every data slot counted a WRITE).
    // The device may round them up (Soft-RoCE: 127).
    let client_end = send_queue_depth(&dump, &server.address, true);
    let server_end = send_queue_depth(&dump, &server.address, false);
    assert!((114..162).contains(&client_end), "{dump}");
    assert_eq!(client_end, server_end, "{dump}");
    let server_side = support::eventually(Duration::from_secs(10), || {
        connections(Side::Server).open() == 1
    })
    .await;
    assert!(server_side, "{:?}", connections(Side::Server));

    // The device's watcher runs: its events are reported, zero or more,
    // port errors among them from the start.
    let port_err = rdma_stats().into_iter().find(|s| {
        s.name == "rdma_device_events"
            && s.labels.contains(&("device", env.device.clone()))
            && s.labels.contains(&("event", "port_err".to_string()))
    });
    assert!(port_err.is_some(), "{:?}", rdma_stats());

    drop(client);
    drop(channel);
    let released = support::eventually(Duration::from_secs(30), || pinned() <= before).await;
    assert!(
        released,
        "{} bytes still pinned 30 s after closing",
        pinned() - before
    );
    assert_eq!(pinned(), before);
    let let_go = support::eventually(Duration::from_secs(30), || verbs_objects() == [0; 5]).await;
    assert!(
        let_go,
        "verbs objects held 30 s after closing: {:?}",
        verbs_objects()
    );
    let closed = support::eventually(Duration::from_secs(10), || {
        connections(Side::Client).open() == 0 && connections(Side::Server).open() == 0
    })
    .await;
    assert!(
        closed,
        "{:?} {:?}",
        connections(Side::Client),
        connections(Side::Server)
    );
    assert_eq!(connections(Side::Client).opened, 1);
    server.stop().await;
}
