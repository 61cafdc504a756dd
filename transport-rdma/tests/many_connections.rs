//! Hundreds of connections at once, each with its registered memory:
//! all carry calls (inline and region-sized), the memory pinned for them
//! stays within the documented budget per connection, and closing them
//! returns it.
//!
//! Needs `RDMA_TEST_DEVICE` / `RDMA_TEST_IP`; in a two-host run each side
//! runs it over its own device.

mod common;
use rpc_test_support as support;

use bytes::Bytes;
use common::{pinned_bytes, TestEnv, PINNED_PER_END};
use futures::future::join_all;
use rpc_core::{BytesCodec, Channel, Client, Request};
use support::TestServer;

/// Connections opened (each has both ends in this process: 2x the ends).
const CONNECTIONS: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn hundreds_of_connection_ends_carry_calls_within_their_memory_budget() {
    let env = TestEnv::from_env();
    transport_rdma::install();
    let server = TestServer::start(&env.local_listen(), |b| b).await;
    let before = pinned_bytes();

    let mut channels = Vec::with_capacity(CONNECTIONS);
    for i in 0..CONNECTIONS {
        let channel = Channel::connect(&server.address)
            .await
            .unwrap_or_else(|e| panic!("connection {i} of {CONNECTIONS}: {e}"));
        channels.push(channel);
    }
    // One inline and one region-sized call on every connection at once.
    let calls = channels.iter().enumerate().map(|(i, channel)| {
        let client = Client::new(channel.clone());
        async move {
            for size in [100usize, 200 << 10] {
                let payload = Bytes::from(vec![(i % 251) as u8; size]);
                let reply = client
                    .unary::<BytesCodec>("/test.Test/Echo", Request::new(payload.clone()))
                    .await
                    .unwrap_or_else(|s| panic!("connection {i}, {size} B: {s}"));
                assert_eq!(reply.into_inner(), payload, "connection {i}, {size} B");
            }
        }
    });
    join_all(calls).await;

    let pinned = pinned_bytes() - before;
    let budget = 2 * CONNECTIONS as u64 * PINNED_PER_END;
    println!(
        "{CONNECTIONS} connections ({} ends): {} MiB pinned, budget {} MiB",
        2 * CONNECTIONS,
        pinned >> 20,
        budget >> 20
    );
    assert!(
        pinned <= budget,
        "{pinned} bytes pinned for {CONNECTIONS} connections, over the budget of {budget}"
    );
    assert!(
        pinned >= budget / 2,
        "only {pinned} bytes pinned for {CONNECTIONS} connections: is VmPin counting registrations?"
    );

    // Closing every connection returns the memory (each end's driver
    // lingers until its peer's close arrives).
    drop(channels);
    let released = support::eventually(std::time::Duration::from_secs(30), || {
        pinned_bytes() <= before + PINNED_PER_END
    })
    .await;
    assert!(
        released,
        "{} MiB still pinned 30 s after closing every connection",
        (pinned_bytes() - before) >> 20
    );
    // And the server still takes new ones.
    let client = Client::new(Channel::connect(&server.address).await.unwrap());
    client
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from_static(b"again")),
        )
        .await
        .unwrap();
    server.stop().await;
}
