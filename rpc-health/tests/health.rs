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
