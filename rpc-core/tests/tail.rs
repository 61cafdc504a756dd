//! Fan-out, replicas and hedging: deterministic, over `mem://` on tokio's
//! paused clock (timers fire in order, instantly, at exact times). The
//! same behaviours run over TCP and RDMA in the shared cases
//! (`rpc-test-support`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
use rpc_core::fanout::{FanOut, Finished, ShardResult};
use rpc_core::hedging::Hedging;
use rpc_core::{
    Balance, BytesCodec, Channel, Client, Code, Endpoint, Request, Response, Server, Status,
};
use rpc_test_support::mem_address;
use tokio::time::Instant;

/// A stand-in model shard: answers `Infer` after `delay`, or fails.
#[derive(Default)]
struct Shard {
    delay: Duration,
    fails: bool,
    started: AtomicUsize,
    /// The timeout the last request arrived with.
    timeout_seen: std::sync::Mutex<Option<Duration>>,
    /// Handlers dropped before they finished: cancelled by their client.
    cancelled: AtomicUsize,
}

struct Cancelled(Arc<Shard>, bool);

impl Drop for Cancelled {
    fn drop(&mut self) {
        if !self.1 {
            self.0.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

struct ShardService(Arc<Shard>);

impl Service for ShardService {
    fn name(&self) -> &'static str {
        "tail.Shard"
    }

    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
        let shard = Arc::clone(&self.0);
        match method {
            "Infer" => codegen::unary::<BytesCodec, _, _>(
                call,
                move |request: Request<Bytes>| async move {
                    shard.started.fetch_add(1, Ordering::SeqCst);
                    *shard.timeout_seen.lock().unwrap() = request.timeout();
                    let mut guard = Cancelled(Arc::clone(&shard), false);
                    tokio::time::sleep(shard.delay).await;
                    guard.1 = true;
                    if shard.fails {
                        return Err(Status::internal("the shard failed"));
                    }
                    Ok(Response::new(request.into_inner()))
                },
            ),
            _ => codegen::unimplemented(call),
        }
    }
}

/// A running shard server.
struct Running {
    address: String,
    shard: Arc<Shard>,
    task: tokio::task::JoinHandle<Result<(), rpc_core::ServeError>>,
}

impl Running {
    async fn kill(&self) {
        self.task.abort();
        while !self.task.is_finished() {
            tokio::task::yield_now().await;
        }
    }

    fn started(&self) -> usize {
        self.shard.started.load(Ordering::SeqCst)
    }

    fn cancelled(&self) -> usize {
        self.shard.cancelled.load(Ordering::SeqCst)
    }
}

async fn serve_at(address: String, delay: Duration, fails: bool) -> Running {
    let shard = Arc::new(Shard {
        delay,
        fails,
        ..Shard::default()
    });
    let server = Server::builder()
        .add_service(ShardService(Arc::clone(&shard)))
        .bind(&address)
        .await
        .unwrap();
    let task = tokio::spawn(server.serve());
    Running {
        address,
        shard,
        task,
    }
}

async fn serve(delay: Duration) -> Running {
    serve_at(mem_address(), delay, false).await
}

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

fn client(address: &str) -> Client {
    Client::new(Endpoint::new(address).unwrap().connect_lazy())
}

fn balanced(replicas: &[&Running], policy: Balance) -> Client {
    let endpoints = replicas.iter().map(|r| {
        Endpoint::new(&r.address)
            .unwrap()
            .reconnect_backoff(ms(100), ms(100))
    });
    Client::new(Channel::balance(endpoints, policy).unwrap())
}

async fn infer(client: &Client, request: Request<Bytes>) -> Result<Bytes, Status> {
    client
        .unary::<BytesCodec>("/tail.Shard/Infer", request)
        .await
        .map(Response::into_inner)
}

/// Lets every task run that can, without moving the paused clock.
async fn settle() {
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_deadline_mid_fan_out_gives_partial_results_and_cancels_the_stragglers() {
    let shards = [
        serve(ms(10)).await,
        serve(ms(20)).await,
        serve(ms(10_000)).await,
        serve(ms(10_000)).await,
    ];
    let clients: Vec<Client> = shards.iter().map(|s| client(&s.address)).collect();
    let started = Instant::now();
    let fan = FanOut::within(ms(100));
    let results = fan
        .run(
            clients
                .iter()
                .map(|c| infer(c, fan.request(Bytes::from_static(b"q")))),
        )
        .await;
    assert_eq!(results.finished, Finished::Deadline);
    assert_eq!(started.elapsed(), ms(100), "it finished at the deadline");
    assert!(matches!(&results.shards[0], ShardResult::Ok(b) if b == "q"));
    assert!(results.shards[1].is_ok());
    assert!(matches!(results.shards[2], ShardResult::NotAnswered));
    assert!(matches!(results.shards[3], ShardResult::NotAnswered));
    assert_eq!((results.answered(), results.not_answered()), (2, 2));
    assert!(results.is_partial());
    settle().await;
    // The stragglers' handlers were cancelled on their servers.
    assert_eq!(shards[2].cancelled(), 1);
    assert_eq!(shards[3].cancelled(), 1);
    assert_eq!(shards[0].cancelled(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_reaches_each_shards_server() {
    // The fan-out's requests carry its deadline: a shard slower than the
    // deadline sees `DeadlineExceeded` on its own, even if the fan-out's
    // caller were to wait longer.
    let slow = serve(ms(10_000)).await;
    let fan = FanOut::within(ms(50));
    let status = infer(&client(&slow.address), fan.request(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status}");
    assert_eq!(*slow.shard.timeout_seen.lock().unwrap(), Some(ms(50)));
    settle().await;
    assert_eq!(slow.cancelled(), 1, "the server's handler ran out of time");
}

#[tokio::test(start_paused = true)]
async fn a_quorum_finishes_the_fan_out_early() {
    let shards = [
        serve(ms(10)).await,
        serve(ms(30)).await,
        serve(ms(20)).await,
        serve(ms(5_000)).await,
    ];
    let clients: Vec<Client> = shards.iter().map(|s| client(&s.address)).collect();
    let started = Instant::now();
    let fan = FanOut::within(ms(1_000)).quorum(3);
    let results = fan
        .run(clients.iter().map(|c| infer(c, fan.request(Bytes::new()))))
        .await;
    assert_eq!(results.finished, Finished::Quorum);
    assert_eq!(
        started.elapsed(),
        ms(30),
        "it finished with the third answer"
    );
    assert_eq!(results.answered(), 3);
    assert!(matches!(results.shards[3], ShardResult::NotAnswered));
    settle().await;
    assert_eq!(shards[3].cancelled(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_fail_limit_finishes_the_fan_out_early() {
    let shards = [
        serve_at(mem_address(), ms(10), true).await,
        serve_at(mem_address(), ms(20), true).await,
        serve(ms(5_000)).await,
        serve(ms(5_000)).await,
    ];
    let clients: Vec<Client> = shards.iter().map(|s| client(&s.address)).collect();
    let started = Instant::now();
    let fan = FanOut::new().fail_limit(1);
    let results = fan
        .run(clients.iter().map(|c| infer(c, Request::new(Bytes::new()))))
        .await;
    assert_eq!(results.finished, Finished::TooManyFailed);
    assert_eq!(
        started.elapsed(),
        ms(20),
        "it finished with the second failure"
    );
    match &results.shards[0] {
        ShardResult::Failed(status) => {
            assert_eq!(status.code(), Code::Internal);
            assert_eq!(status.message(), "the shard failed");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(results.failed(), 2);
    assert_eq!(results.not_answered(), 2);
    settle().await;
    assert_eq!(shards[2].cancelled() + shards[3].cancelled(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_quorum_out_of_reach_finishes_the_fan_out() {
    let shards = [
        serve_at(mem_address(), ms(10), true).await,
        serve_at(mem_address(), ms(10), true).await,
        serve(ms(5_000)).await,
    ];
    let clients: Vec<Client> = shards.iter().map(|s| client(&s.address)).collect();
    let fan = FanOut::new().quorum(2);
    let results = fan
        .run(clients.iter().map(|c| infer(c, Request::new(Bytes::new()))))
        .await;
    assert_eq!(results.finished, Finished::TooManyFailed);
    assert_eq!(results.failed(), 2);
}

#[tokio::test(start_paused = true)]
async fn least_outstanding_sends_new_calls_away_from_a_slow_replica() {
    let slow = serve(ms(1_000)).await;
    let fast = serve(ms(1)).await;
    let client = balanced(&[&slow, &fast], Balance::LeastOutstanding);
    // One call at a time, 100 times: each call to the slow replica stays
    // outstanding, so every later call goes to the fast one.
    let mut in_flight = Vec::new();
    for _ in 0..100 {
        let client = client.clone();
        in_flight.push(tokio::spawn(async move {
            infer(&client, Request::new(Bytes::new())).await
        }));
        tokio::time::sleep(ms(5)).await;
    }
    for call in in_flight {
        call.await.unwrap().unwrap();
    }
    assert_eq!(
        slow.started(),
        1,
        "only the first call went to the slow replica"
    );
    assert_eq!(fast.started(), 99);
}

#[tokio::test(start_paused = true)]
async fn round_robin_takes_replicas_in_turn() {
    let a = serve(ms(1)).await;
    let b = serve(ms(1)).await;
    let c = serve(ms(1)).await;
    let client = balanced(&[&a, &b, &c], Balance::RoundRobin);
    for _ in 0..30 {
        infer(&client, Request::new(Bytes::new())).await.unwrap();
    }
    assert_eq!((a.started(), b.started(), c.started()), (10, 10, 10));
}

#[tokio::test(start_paused = true)]
async fn a_dead_replica_is_ejected_and_readmitted_after_its_backoff() {
    let a = serve(ms(1)).await;
    let b = serve(ms(1)).await;
    let client = balanced(&[&a, &b], Balance::RoundRobin);
    for _ in 0..4 {
        infer(&client, Request::new(Bytes::new())).await.unwrap();
    }
    assert_eq!((a.started(), b.started()), (2, 2));
    a.kill().await;
    settle().await;
    // Every call succeeds: the one that finds `a` dead goes on to `b`, and
    // `a` is skipped for its backoff (100 ms) from then on.
    for _ in 0..10 {
        infer(&client, Request::new(Bytes::new())).await.unwrap();
    }
    assert_eq!(b.started(), 12);
    // `a` comes back on the same address; after its backoff it gets calls again.
    let a = serve_at(a.address.clone(), ms(1), false).await;
    tokio::time::sleep(ms(150)).await;
    for _ in 0..10 {
        infer(&client, Request::new(Bytes::new())).await.unwrap();
    }
    assert_eq!(a.started(), 5, "re-admitted: half the calls again");
}

#[tokio::test(start_paused = true)]
async fn an_idempotent_call_cut_off_by_a_dying_replica_is_retried_on_another() {
    let dying = serve(ms(10_000)).await;
    let other = serve(ms(1)).await;
    let client = balanced(&[&dying, &other], Balance::RoundRobin);
    let mut request = Request::new(Bytes::from_static(b"again"));
    request.set_idempotent(true);
    let call = tokio::spawn({
        let client = client.clone();
        async move { infer(&client, request).await }
    });
    while dying.started() == 0 {
        tokio::task::yield_now().await;
    }
    dying.kill().await;
    assert_eq!(call.await.unwrap().unwrap(), "again");
    assert_eq!(other.started(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_call_not_marked_idempotent_is_not_sent_twice() {
    let dying = serve(ms(10_000)).await;
    let other = serve(ms(1)).await;
    let client = balanced(&[&dying, &other], Balance::RoundRobin);
    let call = tokio::spawn({
        let client = client.clone();
        async move { infer(&client, Request::new(Bytes::new())).await }
    });
    while dying.started() == 0 {
        tokio::task::yield_now().await;
    }
    dying.kill().await;
    let status = call.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    assert_eq!(other.started(), 0, "it may have run on the dying replica");
}

#[tokio::test(start_paused = true)]
async fn all_replicas_down_fails_with_unavailable_naming_each() {
    let (first, second) = (mem_address(), mem_address());
    let endpoints = [&first, &second].map(|a| Endpoint::new(a.as_str()).unwrap());
    let client = Client::new(Channel::balance(endpoints, Balance::default()).unwrap());
    let status = infer(&client, Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    assert!(
        status.message().contains("all 2 replicas are unavailable"),
        "{status}"
    );
    assert!(status.message().contains(&first), "{status}");
    assert!(status.message().contains(&second), "{status}");
    // While they back off, calls fail at once, still naming each.
    let again = infer(&client, Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert!(again.message().contains(&second), "{again}");
}

#[tokio::test]
async fn a_balanced_channel_needs_an_endpoint() {
    let error = Channel::balance([], Balance::RoundRobin).unwrap_err();
    assert_eq!(error, rpc_core::AddressError::NoEndpoints);
}

#[tokio::test(start_paused = true)]
async fn wait_for_ready_waits_for_a_server_that_comes_up() {
    let address = mem_address();
    let endpoint = Endpoint::new(&address)
        .unwrap()
        .reconnect_backoff(ms(20), ms(20));
    let failing_fast = Client::new(endpoint.clone().connect_lazy());
    let waiting = Client::new(endpoint.wait_for_ready(true).connect_lazy());
    let status = infer(&failing_fast, Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);

    let mut request = Request::new(Bytes::from_static(b"ready"));
    request.set_timeout(ms(1_000));
    let started = Instant::now();
    let call = tokio::spawn(async move { infer(&waiting, request).await });
    tokio::time::sleep(ms(100)).await;
    let _server = serve_at(address.clone(), ms(1), false).await;
    assert_eq!(call.await.unwrap().unwrap(), "ready");
    assert!(started.elapsed() < ms(150), "{:?}", started.elapsed());

    // The deadline bounds the wait.
    let nowhere = Endpoint::new(mem_address())
        .unwrap()
        .reconnect_backoff(ms(20), ms(20))
        .wait_for_ready(true);
    let mut request = Request::new(Bytes::new());
    request.set_timeout(ms(300));
    let started = Instant::now();
    let status = infer(&Client::new(nowhere.connect_lazy()), request)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status}");
    assert_eq!(started.elapsed(), ms(300));
}

#[tokio::test(start_paused = true)]
async fn a_deadline_and_a_timeout_the_earlier_wins() {
    let slow = serve(ms(10_000)).await;
    let client = client(&slow.address);
    for (deadline, timeout) in [(ms(100), ms(300)), (ms(300), ms(100))] {
        let mut request = Request::new(Bytes::new());
        request.set_deadline(Instant::now() + deadline);
        request.set_timeout(timeout);
        let started = Instant::now();
        let status = infer(&client, request).await.unwrap_err();
        assert_eq!(status.code(), Code::DeadlineExceeded);
        assert_eq!(started.elapsed(), ms(100));
    }
}

#[tokio::test(start_paused = true)]
async fn a_hedge_goes_to_the_other_replica_and_wins() {
    let slow = serve(ms(1_000)).await;
    let fast = serve(ms(5)).await;
    // Round-robin would also move on; least-outstanding must avoid the busy one.
    let client = balanced(&[&slow, &fast], Balance::LeastOutstanding);
    let hedging = Hedging::after(ms(20)).budget(1.0);
    let started = Instant::now();
    let answer = hedging
        .call(|| infer(&client, Request::new(Bytes::from_static(b"h"))))
        .await
        .unwrap();
    assert_eq!(answer, "h");
    assert_eq!(
        started.elapsed(),
        ms(25),
        "the hedge's answer, at 20 + 5 ms"
    );
    let stats = hedging.stats();
    assert_eq!((stats.calls, stats.hedges, stats.hedges_won), (1, 1, 1));
    settle().await;
    assert_eq!(slow.cancelled(), 1, "the slow first attempt was cancelled");
}

#[tokio::test(start_paused = true)]
async fn hedges_stay_within_the_budget() {
    // Every first attempt is slow: without a budget every call would hedge.
    let hedging = Hedging::after(ms(10)); // default budget: 10 %
    let attempts = AtomicUsize::new(0);
    for _ in 0..100 {
        hedging
            .call(|| {
                attempts.fetch_add(1, Ordering::SeqCst);
                async {
                    tokio::time::sleep(ms(50)).await;
                    Ok::<_, Status>(())
                }
            })
            .await
            .unwrap();
    }
    let stats = hedging.stats();
    assert_eq!(stats.calls, 100);
    assert_eq!(stats.hedges, 10, "{stats:?}");
    assert_eq!(stats.over_budget, 90);
    assert_eq!(attempts.load(Ordering::SeqCst), 110);
}

#[tokio::test(start_paused = true)]
async fn a_failure_before_the_hedge_delay_is_returned_as_is() {
    let hedging = Hedging::after(ms(10)).budget(1.0);
    let attempts = AtomicUsize::new(0);
    let status = hedging
        .call(|| {
            attempts.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>(Status::invalid_argument("bad query")) }
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(attempts.load(Ordering::SeqCst), 1);
    assert_eq!(hedging.stats().hedges, 0);
}

#[tokio::test(start_paused = true)]
async fn when_the_hedge_fails_the_first_attempt_still_answers() {
    let hedging = Hedging::after(ms(10)).budget(1.0);
    let attempts = AtomicUsize::new(0);
    let answer = hedging
        .call(|| {
            let n = attempts.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    tokio::time::sleep(ms(40)).await;
                    Ok(n)
                } else {
                    Err(Status::unavailable("replica down"))
                }
            }
        })
        .await
        .unwrap();
    assert_eq!(answer, 0);
    assert_eq!(hedging.stats().hedges_won, 0);
}

#[tokio::test(start_paused = true)]
async fn the_percentile_delay_follows_recent_latencies() {
    let hedging = Hedging::at_percentile(95.0, ms(7)).budget(0.0);
    assert_eq!(hedging.current_delay(), ms(7), "the initial delay");
    // 120 calls taking 1, 2, ..., 120 ms (no hedges: the budget is zero).
    for i in 1..=120u64 {
        hedging
            .call(|| async move {
                tokio::time::sleep(ms(i)).await;
                Ok::<_, Status>(())
            })
            .await
            .unwrap();
    }
    // The 95th percentile of 1..=120 ms (nearest rank of 120 samples).
    assert_eq!(hedging.current_delay(), ms(114));
}

/// `slowmem://NAME`: `mem://NAME`, but connecting takes 200 ms (as an
/// RDMA connection set-up does on an emulated device).
struct SlowConnect;

impl rpc_core::transport::Transport for SlowConnect {
    fn scheme(&self) -> &'static str {
        "slowmem"
    }

    fn connect<'a>(
        &'a self,
        authority: &'a str,
        limits: rpc_core::transport::FrameLimits,
    ) -> BoxFuture<'a, Result<rpc_core::transport::Connection, rpc_core::transport::TransportError>>
    {
        Box::pin(async move {
            tokio::time::sleep(ms(200)).await;
            let mem = rpc_core::transport::lookup("mem").expect("mem:// is built in");
            mem.connect(authority, limits).await
        })
    }

    fn listen<'a>(
        &'a self,
        authority: &'a str,
        limits: rpc_core::transport::FrameLimits,
    ) -> BoxFuture<
        'a,
        Result<Box<dyn rpc_core::transport::Listener>, rpc_core::transport::TransportError>,
    > {
        let mem = rpc_core::transport::lookup("mem").expect("mem:// is built in");
        Box::pin(async move { mem.listen(authority, limits).await })
    }
}

#[tokio::test(start_paused = true)]
async fn a_connection_slower_than_the_calls_deadlines_still_gets_made() {
    rpc_core::transport::register(Arc::new(SlowConnect));
    let shard = serve(ms(1)).await;
    let address = shard.address.replace("mem://", "slowmem://");
    let client = client(&address);
    // Every call gives up after 50 ms, while connecting takes 200: the
    // attempt goes on without them, and a later call finds the connection.
    let mut answered = None;
    for attempt in 0..10 {
        let mut request = Request::new(Bytes::from_static(b"late"));
        request.set_timeout(ms(50));
        match infer(&client, request).await {
            Ok(reply) => {
                answered = Some((attempt, reply));
                break;
            }
            Err(status) => assert_eq!(status.code(), Code::DeadlineExceeded, "{status}"),
        }
    }
    let (attempt, reply) = answered.expect("no call ever got a connection");
    assert_eq!(reply, "late");
    assert_eq!(
        attempt, 4,
        "the fifth call, at 200 ms, finds the connection made"
    );
}

#[tokio::test(start_paused = true)]
async fn replicas_marked_not_serving_get_no_new_calls() {
    let a = serve(ms(1)).await;
    let b = serve(ms(1)).await;
    let endpoints = [&a, &b].map(|r| Endpoint::new(&r.address).unwrap());
    let channel = Channel::balance(endpoints, Balance::RoundRobin).unwrap();
    let client = Client::new(channel.clone());
    assert_eq!(
        channel.replica_addresses().collect::<Vec<_>>(),
        [a.address.as_str(), b.address.as_str()]
    );
    channel.set_serving(0, false);
    assert!(!channel.is_serving(0) && channel.is_serving(1));
    for _ in 0..6 {
        infer(&client, Request::new(Bytes::new())).await.unwrap();
    }
    assert_eq!((a.started(), b.started()), (0, 6));

    // None serving: fails at once, saying why for each.
    channel.set_serving(1, false);
    let status = infer(&client, Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    assert_eq!(
        status.message().matches("not serving").count(),
        2,
        "{status}"
    );

    // Serving again: calls go to both in turn.
    channel.set_serving(0, true);
    channel.set_serving(1, true);
    for _ in 0..4 {
        infer(&client, Request::new(Bytes::new())).await.unwrap();
    }
    assert_eq!((a.started(), b.started()), (2, 8));
}

#[tokio::test(start_paused = true)]
async fn wait_for_ready_waits_for_a_replica_marked_serving() {
    let a = serve(ms(1)).await;
    let endpoint = Endpoint::new(&a.address).unwrap().wait_for_ready(true);
    let channel = Channel::balance([endpoint], Balance::RoundRobin).unwrap();
    channel.set_serving(0, false);
    let client = Client::new(channel.clone());
    let call = tokio::spawn(async move { infer(&client, Request::new(Bytes::from("x"))).await });
    tokio::time::sleep(ms(1_000)).await;
    assert!(!call.is_finished(), "a call went to a replica not serving");
    assert_eq!(a.started(), 0);
    channel.set_serving(0, true);
    let answer = tokio::time::timeout(ms(100), call)
        .await
        .expect("the waiting call missed the replica's return");
    assert_eq!(answer.unwrap().unwrap(), "x");
    assert_eq!(a.started(), 1);
}

#[tokio::test(start_paused = true)]
async fn wait_for_ready_on_replicas_wakes_when_one_is_marked_serving() {
    let a = serve(ms(1)).await;
    let b = serve(ms(1)).await;
    let endpoints = [&a, &b].map(|r| Endpoint::new(&r.address).unwrap().wait_for_ready(true));
    let channel = Channel::balance(endpoints, Balance::RoundRobin).unwrap();
    channel.set_serving(0, false);
    channel.set_serving(1, false);
    let client = Client::new(channel.clone());
    let call = tokio::spawn(async move { infer(&client, Request::new(Bytes::from("y"))).await });
    tokio::time::sleep(ms(1_000)).await;
    assert!(!call.is_finished(), "a call went to a replica not serving");
    channel.set_serving(1, true);
    let answer = tokio::time::timeout(ms(100), call)
        .await
        .expect("the waiting call missed the replica's return");
    assert_eq!(answer.unwrap().unwrap(), "y");
    assert_eq!((a.started(), b.started()), (0, 1));
}
