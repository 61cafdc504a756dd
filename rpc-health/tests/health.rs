//! The health service over a real connection (`tcp://`): Check, Watch
//! seeing status changes, and an unknown service.

use std::time::Duration;

use rpc_core::Code;
use rpc_health::pb::health_client::HealthClient;
use rpc_health::pb::HealthCheckRequest;
use rpc_health::{health_service, HealthReporter, ServingStatus};

async fn start() -> (HealthReporter, HealthClient) {
    transport_tcp::install();
    let (reporter, health) = health_service();
    let server = rpc_core::Server::builder()
        .add_service(health)
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap();
    let address = server.local_addr().to_string();
    tokio::spawn(server.serve());
    (reporter, HealthClient::connect(&address).await.unwrap())
}

#[tokio::test]
async fn check_reports_what_was_set() {
    let (reporter, client) = start().await;
    assert_eq!(
        rpc_health::check(&client, "").await.unwrap(),
        ServingStatus::Serving
    );
    let status = rpc_health::check(&client, "shard.Model").await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status}");
    reporter.set_serving("shard.Model");
    assert_eq!(
        rpc_health::check(&client, "shard.Model").await.unwrap(),
        ServingStatus::Serving
    );
    reporter.set_not_serving("shard.Model");
    assert_eq!(
        rpc_health::check(&client, "shard.Model").await.unwrap(),
        ServingStatus::NotServing
    );
    reporter.clear("shard.Model");
    let status = rpc_health::check(&client, "shard.Model").await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status}");
}

#[tokio::test]
async fn watch_sees_each_status_change() {
    let (reporter, client) = start().await;
    let mut updates = client
        .watch(HealthCheckRequest {
            service: "shard.Model".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(next(&mut updates).await, ServingStatus::ServiceUnknown);
    reporter.set_serving("shard.Model");
    assert_eq!(next(&mut updates).await, ServingStatus::Serving);
    reporter.set_not_serving("shard.Model");
    assert_eq!(next(&mut updates).await, ServingStatus::NotServing);
}

async fn next(
    updates: &mut rpc_core::Streaming<rpc_health::pb::HealthCheckResponse>,
) -> ServingStatus {
    let reply = tokio::time::timeout(Duration::from_secs(5), updates.message())
        .await
        .expect("an update within 5 s")
        .unwrap()
        .expect("the watch goes on");
    reply.status()
}

/// A replica: a server with only the health service; it reports
/// `shard.Model` serving and a service named after itself, so a `Check`
/// of that name tells which replica answered.
async fn replica(name: &str) -> (HealthReporter, String) {
    transport_tcp::install();
    let (reporter, health) = health_service();
    reporter.set_serving("shard.Model");
    reporter.set_serving(name);
    let server = rpc_core::Server::builder()
        .add_service(health)
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap();
    let address = server.local_addr().to_string();
    tokio::spawn(server.serve());
    (reporter, address)
}

/// Waits (up to 5 s) until `done` holds.
async fn until(what: &str, done: impl Fn() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("not within 5 s: {what}");
}

/// How many of `calls` checks on `client` landed on replica `name`.
async fn answered_by(client: &HealthClient, name: &str, calls: usize) -> usize {
    let mut landed = 0;
    for _ in 0..calls {
        match rpc_health::check(client, name).await {
            Ok(ServingStatus::Serving) => landed += 1,
            Err(status) if status.code() == Code::NotFound => {}
            other => panic!("unexpected answer {other:?}"),
        }
    }
    landed
}

#[tokio::test]
async fn a_balanced_channel_follows_its_replicas_health() {
    let (a, a_address) = replica("replica-a").await;
    let (_b, b_address) = replica("replica-b").await;
    let endpoints = [&a_address, &b_address].map(|a| rpc_core::Endpoint::new(a.as_str()).unwrap());
    let channel = rpc_core::Channel::balance(endpoints, rpc_core::Balance::RoundRobin).unwrap();
    let client = HealthClient::new(channel.clone());
    let health = rpc_health::watch_replicas(&channel, "shard.Model");
    assert_eq!(answered_by(&client, "replica-a", 10).await, 5);

    a.set_not_serving("shard.Model");
    until("replica a marked not serving", || !channel.is_serving(0)).await;
    assert!(channel.is_serving(1));
    assert_eq!(answered_by(&client, "replica-a", 10).await, 0);

    a.set_serving("shard.Model");
    until("replica a marked serving again", || channel.is_serving(0)).await;
    assert_eq!(answered_by(&client, "replica-a", 10).await, 5);

    // Dropped, it stops watching and leaves no replica marked not serving.
    a.set_not_serving("shard.Model");
    until("replica a marked not serving", || !channel.is_serving(0)).await;
    drop(health);
    assert!(channel.is_serving(0), "a stale status outlived the watch");
    channel.set_serving(0, false);
    a.set_serving("shard.Model");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !channel.is_serving(0),
        "still watched after the watch was dropped"
    );
}

#[tokio::test]
async fn a_replica_without_a_health_service_counts_as_serving() {
    transport_tcp::install();
    let server = rpc_core::Server::builder()
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap();
    let address = server.local_addr().to_string();
    tokio::spawn(server.serve());
    let endpoint = rpc_core::Endpoint::new(address.as_str()).unwrap();
    let channel = rpc_core::Channel::balance([endpoint], rpc_core::Balance::RoundRobin).unwrap();
    channel.set_serving(0, false);
    let _health = rpc_health::watch_replicas(&channel, "shard.Model");
    until("the replica marked serving", || channel.is_serving(0)).await;
}
