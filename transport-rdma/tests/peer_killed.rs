//! RPC peers killed mid-call (a real process, `SIGKILL`): the other side's
//! calls fail with `Unavailable` within a bounded time, handlers are
//! cancelled, the server keeps accepting and the client reconnects.
//!
//! The test binary re-runs itself as the child (the `child_*` tests, which
//! do nothing unless the parent set their environment variable).

mod common;
use rpc_test_support as support;

use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{ChildGuard, TestEnv};
use rpc_core::{BytesCodec, Channel, Client, Code, Endpoint, Request};
use support::TestServer;

fn spawn_child(test: &str, var: &str, value: &str) -> ChildGuard {
    ChildGuard(
        Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", test, "--nocapture"])
            .env(var, value)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the child"),
    )
}

fn sleep_request(ms: u32) -> Request<Bytes> {
    Request::new(rpc_test_support::sleep_request(ms))
}

/// Child: a server on `RPC_CHILD_SERVE` until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn child_server() {
    let address = std::env::var("RPC_CHILD_SERVE")
        .expect("child_server is the child half of a test: its parent runs it");
    transport_rdma::install();
    let _server = TestServer::start(&address, |b| b).await;
    tokio::time::sleep(Duration::from_secs(600)).await;
}

/// Child: 20 long calls to `RPC_CHILD_CALL`, until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn child_client() {
    let address = std::env::var("RPC_CHILD_CALL")
        .expect("child_client is the child half of a test: its parent runs it");
    transport_rdma::install();
    let client = Client::new(Channel::connect(&address).await.expect("child connects"));
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                client
                    .unary::<BytesCodec>("/test.Test/Sleep", sleep_request(60_000))
                    .await
            })
        })
        .collect();
    for call in calls {
        let _ = call.await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn killed_server_process_fails_calls_and_the_client_reconnects() {
    let env = TestEnv::from_env();
    transport_rdma::install();
    let address = format!("rdma://{}:7491", env.ip);
    let mut child = spawn_child("child_server", "RPC_CHILD_SERVE", &address);
    // Until the child listens, connecting fails.
    let started = Instant::now();
    let channel = loop {
        match Endpoint::new(&address)
            .unwrap()
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(200))
            .connect()
            .await
        {
            Ok(channel) => break channel,
            Err(e) => {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "the child never listened: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let client = Client::new(channel);
    // Until the child listens, calls fail with Unavailable.
    let started = Instant::now();
    while let Err(status) = client
        .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"up?")))
        .await
    {
        assert_eq!(status.code(), Code::Unavailable, "{status}");
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the child server never came up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pending: Vec<_> = (0..20)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                client
                    .unary::<BytesCodec>("/test.Test/Sleep", sleep_request(60_000))
                    .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    child.kill();
    let killed = Instant::now();
    for call in pending {
        let status = call.await.unwrap().unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status}");
    }
    eprintln!("pending calls failed {:?} after the kill", killed.elapsed());
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "pending calls took {:?} to fail",
        killed.elapsed()
    );
    // A new server process on the same address: the channel reconnects.
    let mut again = spawn_child("child_server", "RPC_CHILD_SERVE", &address);
    let started = Instant::now();
    let reply = loop {
        match client
            .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"back")))
            .await
        {
            Ok(reply) => break reply.into_inner(),
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{status}");
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "never reconnected"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(reply, "back");
    again.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn killed_client_process_cancels_its_handlers_and_the_server_goes_on() {
    let env = TestEnv::from_env();
    transport_rdma::install();
    let server = TestServer::start(&env.local_listen(), |b| b).await;
    for round in 0..2 {
        let before = server.probes.cancelled.load(Ordering::SeqCst);
        let sleeping = server.probes.sleeping.load(Ordering::SeqCst);
        let mut child = spawn_child("child_client", "RPC_CHILD_CALL", &server.address);
        let probes = std::sync::Arc::clone(&server.probes);
        assert!(
            probes
                .wait_until(Duration::from_secs(60), || probes
                    .sleeping
                    .load(Ordering::SeqCst)
                    == sleeping + 20)
                .await,
            "round {round}: the child's calls never reached the server"
        );
        child.kill();
        let killed = Instant::now();
        assert!(
            probes
                .wait_until(Duration::from_secs(5), || probes
                    .cancelled
                    .load(Ordering::SeqCst)
                    == before + 20)
                .await,
            "round {round}: the dead client's handlers kept running"
        );
        eprintln!(
            "round {round}: handlers cancelled {:?} after the kill",
            killed.elapsed()
        );
        // The server still serves new clients.
        let client = Client::new(Channel::connect(&server.address).await.unwrap());
        let reply = client
            .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"ok")))
            .await
            .unwrap();
        assert_eq!(reply.into_inner(), "ok");
    }
    server.stop().await;
}
