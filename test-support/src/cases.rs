//! The runtime's integration cases, each an `async fn(listen_address, &Profile)`:
//! every call kind and every failure a caller can see. Each transport's
//! suite runs them on its own addresses (`rpc-core/tests/calls.rs` for
//! `mem://` and `tcp://`, `transport-rdma/tests/rpc_calls.rs` for `rdma://`),
//! all of them, through [`for_each_case!`](crate::for_each_case).

// Each case's name says what it checks; its body is the check.
#![allow(missing_docs)]

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use rpc_core::fanout::{FanOut, Finished, ShardResult};
use rpc_core::{Balance, BytesCodec, Channel, Client, Code, Endpoint, Request, Response, Status};
use tokio::task::JoinHandle;

use crate::{count_message, count_request, sleep_request, TestServer};

/// What a transport's suite adapts: load and message sizes.
pub struct Profile {
    /// Concurrent unary calls on one channel.
    pub concurrent_calls: u32,
    /// Payloads sent and checked byte for byte: around the transport's thresholds.
    pub payload_sizes: Vec<usize>,
}

impl Profile {
    /// For transports without thresholds of their own (`mem://`, `tcp://`).
    pub fn standard() -> Profile {
        Profile {
            concurrent_calls: 10_000,
            payload_sizes: vec![
                0,
                1,
                4095,
                4096,
                4097,
                65_535,
                65_536,
                65_537,
                1 << 20,
                16 << 20,
                (64 << 20) - 64,
            ],
        }
    }
}

async fn client_for(server: &TestServer) -> Client {
    Client::new(Channel::connect(&server.address).await.expect("connects"))
}

/// `count` calls to `Sleep` for `millis` each, every one in a task of its own.
fn spawn_sleeps(
    client: &Client,
    count: usize,
    millis: u32,
) -> Vec<JoinHandle<Result<Response<Bytes>, Status>>> {
    (0..count)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                client
                    .unary::<BytesCodec>("/test.Test/Sleep", Request::new(sleep_request(millis)))
                    .await
            })
        })
        .collect()
}

/// Waits until `count` of `server`'s handlers sleep; fails after 5 s.
async fn await_sleeping(server: &TestServer, count: usize) {
    let probes = &server.probes;
    assert!(
        probes
            .wait_until(Duration::from_secs(5), || probes
                .sleeping
                .load(Ordering::SeqCst)
                == count)
            .await,
        "{count} calls did not all reach the server's handler"
    );
}

pub async fn unary_round_trips_message_and_metadata(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let mut request = Request::new(Bytes::from_static(b"ping"));
    request.metadata_mut().insert("x-echo", "trace-7");
    let response = client
        .unary::<BytesCodec>("/test.Test/Echo", request)
        .await
        .unwrap();
    assert_eq!(response.metadata().get_str("x-echo"), Some("trace-7"));
    assert_eq!(response.into_inner(), "ping");
    server.stop().await;
}

pub async fn handler_errors_arrive_with_code_message_and_trailers(
    listen: String,
    _profile: &Profile,
) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let status = client
        .unary::<BytesCodec>("/test.Test/Fail", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert_eq!(status.message(), "nothing here");
    assert_eq!(status.metadata().get_str("x-reason"), Some("test"));
    server.stop().await;
}

pub async fn server_streaming_delivers_every_message_in_order(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let response = client
        .server_streaming::<BytesCodec>("/test.Test/Count", Request::new(count_request(500, 100)))
        .await
        .unwrap();
    let mut stream = response.into_inner();
    for i in 0..500 {
        assert_eq!(
            stream.message().await.unwrap(),
            Some(count_message(i, 100)),
            "message {i}"
        );
    }
    assert_eq!(stream.message().await.unwrap(), None);
    assert!(
        stream.trailers().is_some(),
        "a finished stream has the server's trailers"
    );
    server.stop().await;
}

pub async fn client_streaming_sums_every_message(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let messages = futures::stream::iter((0..300u32).map(|i| Bytes::from(vec![1u8; i as usize])));
    let reply = client
        .client_streaming::<BytesCodec, _>("/test.Test/Sum", Request::new(messages))
        .await
        .unwrap();
    let reply = reply.into_inner();
    assert_eq!(u64::from_le_bytes(reply[..8].try_into().unwrap()), 300);
    assert_eq!(
        u64::from_le_bytes(reply[8..].try_into().unwrap()),
        (0..300u64).sum::<u64>()
    );
    server.stop().await;
}

pub async fn bidi_streaming_answers_each_message(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    let outgoing =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut replies = client
        .streaming::<BytesCodec, _>("/test.Test/Chat", Request::new(outgoing))
        .await
        .unwrap()
        .into_inner();
    for i in 0..50 {
        // Lock-step: each reply arrives before the next message is sent.
        tx.send(Bytes::from(format!("m{i}"))).unwrap();
        assert_eq!(replies.message().await.unwrap().unwrap(), format!("m{i}!"));
    }
    drop(tx);
    assert_eq!(replies.message().await.unwrap(), None);
    server.stop().await;
}

pub async fn thousands_of_concurrent_calls_on_one_channel_none_mixed_up(
    listen: String,
    profile: &Profile,
) {
    // More calls at once than the server's default per-connection limit:
    // this case is about the call table, not admission.
    let server = TestServer::start(&listen, |b| b.max_concurrent_calls(usize::MAX)).await;
    let client = client_for(&server).await;
    let calls = (0..profile.concurrent_calls).map(|i| {
        let client = client.clone();
        tokio::spawn(async move {
            let body = Bytes::from(format!("call-{i}-{}", "x".repeat((i % 97) as usize)));
            let reply = client
                .unary::<BytesCodec>("/test.Test/Echo", Request::new(body.clone()))
                .await
                .unwrap();
            assert_eq!(
                reply.into_inner(),
                body,
                "call {i} got another call's reply"
            );
        })
    });
    let results = futures::future::join_all(calls).await;
    assert_eq!(
        results.into_iter().filter(Result::is_ok).count(),
        profile.concurrent_calls as usize
    );
    server.stop().await;
}

pub async fn deadline_fails_the_call_and_cancels_the_handler(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let mut request = Request::new(sleep_request(10_000));
    request.set_timeout(Duration::from_millis(200));
    let started = Instant::now();
    let status = client
        .unary::<BytesCodec>("/test.Test/Sleep", request)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    let probes = &server.probes;
    assert!(
        probes
            .wait_until(Duration::from_secs(5), || probes
                .cancelled
                .load(Ordering::SeqCst)
                == 1)
            .await,
        "the handler was not cancelled"
    );
    // The connection is still good.
    client
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from_static(b"after")),
        )
        .await
        .unwrap();
    server.stop().await;
}

pub async fn zero_timeout_fails_at_once_without_sending(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let mut request = Request::new(sleep_request(10_000));
    request.set_timeout(Duration::ZERO);
    let status = client
        .unary::<BytesCodec>("/test.Test/Sleep", request)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status}");
    assert!(
        status.message().contains("before the request was sent"),
        "the client sent the request: {status}"
    );
    // An endpoint timeout of zero applies to calls that set none.
    let zero = Client::new(
        Endpoint::new(&server.address)
            .unwrap()
            .timeout(Duration::ZERO)
            .connect()
            .await
            .unwrap(),
    );
    let status = zero
        .unary::<BytesCodec>("/test.Test/Sleep", Request::new(sleep_request(10_000)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status}");
    // Frames on a connection are handled in order: had the Sleep requests
    // gone out, their handlers would have been started before this echo's.
    client
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from_static(b"after")),
        )
        .await
        .unwrap();
    zero.unary::<BytesCodec>("/test.Test/Echo", {
        let mut request = Request::new(Bytes::from_static(b"after"));
        request.set_timeout(Duration::from_secs(5));
        request
    })
    .await
    .unwrap();
    assert_eq!(server.probes.sleeping.load(Ordering::SeqCst), 0);
    server.stop().await;
}

pub async fn a_client_that_half_closes_after_its_request_still_gets_the_reply(
    listen: String,
    _profile: &Profile,
) {
    use rpc_core::frame::{Frame, FrameBody, OutBody, OutFrame};
    use rpc_core::transport::{self, FrameLimits};
    let server = TestServer::start(&listen, |b| b).await;
    // A connection of the transport itself, below rpc-core's client: it
    // sends one request and closes its sending side at once.
    let (scheme, authority) = transport::split_address(&server.address).expect("an address");
    let mut conn = transport::lookup(scheme)
        .expect("the suite registered its transport")
        .connect(
            authority,
            FrameLimits {
                max_frame_len: 1 << 20,
            },
        )
        .await
        .expect("connects");
    let metadata = rpc_core::MetadataMap::new();
    let request = sleep_request(200);
    let body = OutBody::Request {
        method: "/test.Test/Sleep",
        timeout: None,
        metadata: &metadata,
    };
    let frame = OutFrame::new(1, body, Some(&request), true).expect("a frame");
    conn.sink.send(&frame).await.expect("sends");
    conn.sink.close();
    // The handler is still running when the server reads the end of the
    // client's side: it must run to its end and its answer arrive.
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let frame = conn
                .source
                .recv()
                .await
                .expect("reads")
                .expect("the answer before the server closes");
            let frame = Frame::decode(frame).expect("a valid frame");
            if let (FrameBody::Status(status), 1) = (frame.body, frame.call_id) {
                return (status, frame.payload);
            }
        }
    })
    .await
    .expect("the server answered");
    assert_eq!(answer.0.code(), Code::Ok, "{}", answer.0);
    assert_eq!(answer.1.as_deref(), Some(&b"slept"[..]));
    assert_eq!(server.probes.cancelled.load(Ordering::SeqCst), 0);
    // Then the server ends the connection, its calls all answered.
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        while let Ok(Some(_)) = conn.source.recv().await {}
    })
    .await;
    assert!(
        ended.is_ok(),
        "the server kept the half-closed connection open"
    );
    server.stop().await;
}

pub async fn dropping_the_call_cancels_the_handler(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let call = client.unary::<BytesCodec>("/test.Test/Sleep", Request::new(sleep_request(10_000)));
    let probes = &server.probes;
    tokio::select! {
        _ = call => panic!("a 10 s call finished"),
        _ = probes.wait_until(Duration::from_secs(5), || probes.sleeping.load(Ordering::SeqCst) == 1) => {}
    }
    // The call future is dropped here.
    assert!(
        probes
            .wait_until(Duration::from_secs(5), || probes
                .cancelled
                .load(Ordering::SeqCst)
                == 1)
            .await,
        "the handler kept running after the caller went away"
    );
    server.stop().await;
}

/// The only call open reads its connection itself while it waits; when
/// its caller gives up, the reader task must read again: a response
/// stream (which only the reader task reads) still gets every message,
/// and a server that dies is still noticed.
pub async fn a_caller_that_read_for_itself_and_gave_up_hands_reading_back(
    listen: String,
    _profile: &Profile,
) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    for round in 0..3 {
        let call =
            client.unary::<BytesCodec>("/test.Test/Sleep", Request::new(sleep_request(10_000)));
        let probes = &server.probes;
        tokio::select! {
            _ = call => panic!("a 10 s call finished"),
            _ = probes.wait_until(Duration::from_secs(5), || probes.sleeping.load(Ordering::SeqCst) == round + 1) => {}
        }
        // The waiting call is dropped here; then a stream, read by the reader task alone.
        let mut stream = client
            .server_streaming::<BytesCodec>("/test.Test/Count", Request::new(count_request(3, 10)))
            .await
            .unwrap()
            .into_inner();
        for i in 0..3 {
            let message = tokio::time::timeout(Duration::from_secs(5), stream.message())
                .await
                .expect("no one read the connection after the caller gave up");
            assert_eq!(message.unwrap(), Some(count_message(i, 10)), "message {i}");
        }
    }
    // One more gives up waiting; then the server dies: the connection's end
    // is read, and the next call fails at once.
    let call = client.unary::<BytesCodec>("/test.Test/Sleep", Request::new(sleep_request(10_000)));
    assert!(tokio::time::timeout(Duration::from_millis(200), call)
        .await
        .is_err());
    server.kill().await;
    let status = tokio::time::timeout(
        Duration::from_secs(5),
        client.unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::new())),
    )
    .await
    .expect("the dead server was not noticed")
    .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status}");
}

/// Calls one at a time, then many at once, again and again: the lone
/// call's caller reads the connection itself while the reader task
/// waits, and the burst after it is read by the reader task: every burst
/// call must get its answer, none waits for the keepalive. (The pattern
/// that stalled `bench-node` over RDMA for 20 s: a lone caller's read
/// dropped the reader task's waker. The transport's own test of that,
/// without timing luck: `frames.rs`, `a_poll_that_finds_frames_wakes_the_task_that_waited`.
/// Over `tcp://` the same, 1 to 7 runs in 400 under load against a server
/// on a current-thread runtime, until rpc-core took a caller's poll that
/// found its answer, not only one that found nothing, as leaving the
/// caller's waker with the socket: `call_table.rs`,
/// `a_caller_that_read_before_the_reader_was_woken_leaves_it_waiting_again`.)
pub async fn bursts_after_a_lone_call_are_read(listen: String, _profile: &Profile) {
    const ROUNDS: usize = 40;
    const BURST: usize = 16;
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let echo = |client: Client, body: Bytes| async move {
        let mut request = Request::new(body.clone());
        request.set_timeout(Duration::from_secs(10));
        let reply = client.unary::<BytesCodec>("/test.Test/Echo", request).await;
        (body, reply)
    };
    for round in 0..ROUNDS {
        for lone in 0..3 {
            let (body, reply) =
                echo(client.clone(), Bytes::from(format!("{round}/lone-{lone}"))).await;
            let reply = reply.unwrap_or_else(|s| panic!("round {round}, lone call {lone}: {s}"));
            assert_eq!(reply.into_inner(), body);
        }
        // Spawned, so that they run on both workers, finishing one by one
        // down to a lone call again.
        let burst: Vec<_> = (0..BURST)
            .map(|i| {
                tokio::spawn(echo(
                    client.clone(),
                    Bytes::from(format!("{round}/burst-{i}")),
                ))
            })
            .collect();
        for (i, call) in burst.into_iter().enumerate() {
            let (body, reply) = call.await.expect("the call's task");
            let reply = reply.unwrap_or_else(|s| {
                panic!("round {round}, burst call {i} (a stall would fail it with DeadlineExceeded): {s}")
            });
            assert_eq!(reply.into_inner(), body, "round {round}, burst call {i}");
        }
    }
    server.stop().await;
}

pub async fn unknown_service_and_method_are_unimplemented(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let paths = [
        "/test.Nope/Echo",
        "/test.Test/Nope",
        "no-slashes",
        "/",
        "//Echo",
        "/test.Test/",
        "/test.Test/Echo/",
        "/test.Test/Echo/Echo",
        "test.Test/Echo",
    ];
    for path in paths {
        let status = client
            .unary::<BytesCodec>(path, Request::new(Bytes::new()))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unimplemented, "{path}: {status}");
    }
    server.stop().await;
}

pub async fn panicking_handler_fails_only_its_call(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let status = client
        .unary::<BytesCodec>("/test.Test/Panic", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Internal);
    assert!(status.message().contains("panicked"), "{status}");
    let reply = client
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from_static(b"still here")),
        )
        .await;
    assert_eq!(reply.unwrap().into_inner(), "still here");
    server.stop().await;
}

pub async fn oversized_messages_fail_with_resource_exhausted_and_the_connection_survives(
    listen: String,
    _profile: &Profile,
) {
    let server = TestServer::start(&listen, |b| b.max_message_size(1 << 20)).await;
    let channel = Endpoint::new(&server.address)
        .unwrap()
        .max_message_size(4 << 20)
        .connect()
        .await
        .unwrap();
    let client = Client::new(channel);
    // Over the client's own limit: refused before sending.
    let status = client
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from(vec![0u8; 5 << 20])),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
    // Within the client's limit, over the server's: refused by the server.
    let status = client
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from(vec![0u8; 2 << 20])),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
    // The refusal quotes the limit that applied, and calls a length the
    // message's only if it is (a transport that skipped the frame knows the frame's).
    let reason = status.message();
    assert!(
        reason.contains("maximum message size of 1048576 bytes"),
        "{status}"
    );
    assert!(
        !reason.contains("request message of")
            || reason.contains(&format!("request message of {} bytes", 2 << 20)),
        "a frame's length reported as the message's: {status}"
    );
    // A response over the client's limit.
    let small = Client::new(
        Endpoint::new(&server.address)
            .unwrap()
            .max_message_size(1000)
            .connect()
            .await
            .unwrap(),
    );
    let mut stream = small
        .server_streaming::<BytesCodec>("/test.Test/Count", Request::new(count_request(1, 2000)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        stream.message().await.unwrap_err().code(),
        Code::ResourceExhausted
    );
    // Both connections still carry calls.
    for client in [&client, &small] {
        let reply = client
            .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"ok")))
            .await;
        assert_eq!(reply.unwrap().into_inner(), "ok");
    }
    server.stop().await;
}

/// A tensor message as a parameter server sends one, encoded as protobuf:
/// `name` (field 1), `shape` (field 2, packed) and `data` (field 3, `bytes`)
/// holding `data_len` bytes.
fn encoded_tensor(name: &str, shape: &[u64], data_len: usize) -> Bytes {
    fn varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push(value as u8 | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }
    let mut shape_field = Vec::new();
    for &dim in shape {
        varint(&mut shape_field, dim);
    }
    let mut message = Vec::with_capacity(data_len + 64 + name.len() + shape_field.len());
    message.push(1 << 3 | 2);
    varint(&mut message, name.len() as u64);
    message.extend_from_slice(name.as_bytes());
    message.push(2 << 3 | 2);
    varint(&mut message, shape_field.len() as u64);
    message.extend_from_slice(&shape_field);
    message.push(3 << 3 | 2);
    varint(&mut message, data_len as u64);
    message.extend((0..data_len).map(|i| (i % 251) as u8));
    Bytes::from(message)
}

/// Far past what a call moving the largest message here takes (seconds,
/// 64 MiB each way over Soft-RoCE): one that stalls fails
/// `DeadlineExceeded` instead of hanging the suite.
const LARGE_CALL_LIMIT: Duration = Duration::from_secs(120);

/// A request for a call that moves a large message, with
/// [`LARGE_CALL_LIMIT`] as its deadline.
fn large_request(body: Bytes) -> Request<Bytes> {
    let mut request = Request::new(body);
    request.set_timeout(LARGE_CALL_LIMIT);
    request
}

pub async fn a_64_mib_tensor_fits_the_default_limit_and_a_larger_message_does_not(
    listen: String,
    _profile: &Profile,
) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    // A 64 MiB tensor field with its name and shape, both ways, with every default.
    let tensor = encoded_tensor("layer.17.attention.weight", &[4096, 4096], 64 << 20);
    assert!(tensor.len() > 64 << 20 && tensor.len() <= rpc_core::DEFAULT_MAX_MESSAGE_SIZE);
    let reply = client
        .unary::<BytesCodec>("/test.Test/Echo", large_request(tensor.clone()))
        .await
        .expect("a 64 MiB tensor field fits the default maximum message size");
    assert!(reply.into_inner() == tensor, "the tensor came back changed");
    drop(tensor);
    // A few KiB over the default: refused by the client before sending...
    let over = Bytes::from(vec![0u8; rpc_core::DEFAULT_MAX_MESSAGE_SIZE + (4 << 10)]);
    let status = client
        .unary::<BytesCodec>("/test.Test/Echo", Request::new(over.clone()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
    // ...and by a server with the default, from a client that allows more.
    let lenient = Client::new(
        Endpoint::new(&server.address)
            .unwrap()
            .max_message_size(rpc_core::DEFAULT_MAX_MESSAGE_SIZE + (1 << 20))
            .connect()
            .await
            .unwrap(),
    );
    let status = lenient
        .unary::<BytesCodec>("/test.Test/Echo", Request::new(over))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
    assert!(
        status.message().contains(&format!(
            "maximum message size of {} bytes",
            rpc_core::DEFAULT_MAX_MESSAGE_SIZE
        )),
        "{status}"
    );
    // Both connections carry on.
    for client in [&client, &lenient] {
        let reply = client
            .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"ok")))
            .await;
        assert_eq!(reply.unwrap().into_inner(), "ok");
    }
    server.stop().await;
}

pub async fn slow_reader_holds_back_a_streaming_server(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let channel = Endpoint::new(&server.address)
        .unwrap()
        .stream_window(1 << 20)
        .connect()
        .await
        .unwrap();
    let client = Client::new(channel);
    let size = 64 * 1024;
    let mut stream = client
        .server_streaming::<BytesCodec>("/test.Test/Count", Request::new(count_request(1000, size)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        stream.message().await.unwrap(),
        Some(count_message(0, size))
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    // 1 MiB of window at 64 KiB a message, plus the message being sent: far fewer than 1000.
    let produced = server.probes.produced.load(Ordering::SeqCst);
    assert!(
        produced <= 20,
        "the server ran {produced} messages ahead of a stalled reader"
    );
    let mut received = 1;
    while let Some(message) = stream.message().await.unwrap() {
        assert_eq!(message, count_message(received, size));
        received += 1;
    }
    assert_eq!(received, 1000);
    server.stop().await;
}

pub async fn slow_handler_holds_back_a_streaming_client(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b.stream_window(1 << 20)).await;
    let client = client_for(&server).await;
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&sent);
    let messages = futures::stream::iter(0..200).map(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
        Bytes::from(vec![7u8; 64 * 1024])
    });
    let call = tokio::spawn(async move {
        client
            .client_streaming::<BytesCodec, _>("/test.Test/Hold", Request::new(messages))
            .await
    });
    // The handler sleeps 400 ms before reading; meanwhile the client may only fill the window.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let ahead = sent.load(Ordering::SeqCst);
    assert!(
        ahead <= 20,
        "the client sent {ahead} messages into a handler that reads none"
    );
    let reply = call.await.unwrap().unwrap().into_inner();
    assert_eq!(u64::from_le_bytes(reply[..8].try_into().unwrap()), 200);
    server.stop().await;
}

pub async fn killed_server_fails_pending_calls_and_the_channel_reconnects(
    listen: String,
    _profile: &Profile,
) {
    let server = TestServer::start(&listen, |b| b).await;
    let address = server.address.clone();
    let channel = Endpoint::new(&address)
        .unwrap()
        .reconnect_backoff(Duration::from_millis(10), Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    let client = Client::new(channel);
    let pending = spawn_sleeps(&client, 20, 30_000);
    await_sleeping(&server, 20).await;
    let killed = Instant::now();
    server.kill().await;
    for call in pending {
        let status = call.await.unwrap().unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status}");
    }
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "pending calls took {:?} to fail",
        killed.elapsed()
    );
    // While nothing listens, calls fail fast with Unavailable.
    let status = client
        .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    // A new server on the same address: the same channel reconnects.
    let again = TestServer::start(&address, |b| b).await;
    let mut reply = None;
    for _ in 0..100 {
        match client
            .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"back")))
            .await
        {
            Ok(r) => {
                reply = Some(r.into_inner());
                break;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{status}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    assert_eq!(reply.as_deref(), Some(&b"back"[..]));
    again.stop().await;
}

pub async fn graceful_shutdown_lets_calls_in_flight_finish(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let in_flight = spawn_sleeps(&client, 1, 300);
    await_sleeping(&server, 1).await;
    server.stop().await; // returns once drained
    for call in in_flight {
        assert_eq!(call.await.unwrap().unwrap().into_inner(), "slept");
    }
    let status = client
        .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status}");
}

/// A server whose runtime ends as soon as `serve_with_shutdown` returns
/// (a `main` that returns after serving) has sent the answers of the
/// calls it let finish: serving waits until each connection's frames are
/// out, not only handed to the transport's writer.
pub async fn a_server_whose_runtime_ends_with_serve_sent_every_answer(
    listen: String,
    _profile: &Profile,
) {
    const CALLS: usize = 4;
    let server = TestServer::start_on_own_runtime(&listen, |b| b).await;
    let client = client_for(&server).await;
    let in_flight = spawn_sleeps(&client, CALLS, 300);
    await_sleeping(&server, CALLS).await;
    server.stop().await; // its runtime is gone once this returns
    for (i, call) in in_flight.into_iter().enumerate() {
        let reply = call.await.expect("the call's task");
        let reply = reply.unwrap_or_else(|s| panic!("call {i}: {s}"));
        assert_eq!(reply.into_inner(), "slept", "call {i}");
    }
}

pub async fn empty_and_large_messages_arrive_intact(listen: String, profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    for &size in &profile.payload_sizes {
        let body: Bytes = (0..size)
            .map(|i| (i * 31 % 251) as u8)
            .collect::<Vec<u8>>()
            .into();
        let reply = client
            .unary::<BytesCodec>("/test.Test/Echo", large_request(body.clone()))
            .await
            .unwrap_or_else(|e| panic!("{size} bytes: {e}"));
        assert!(
            reply.get_ref() == &body,
            "{size}-byte message changed in transit"
        );
    }
    server.stop().await;
}

pub async fn keepalive_pings_do_not_disturb_a_slow_call(listen: String, _profile: &Profile) {
    // A ping after 50 ms without a frame, the connection given up 500 ms
    // after a ping that nothing answered: long enough for a pong between
    // two emulated Soft-RoCE guests under load (a 30 ms wait for it failed
    // once there), well inside the call's 2 s, which without pongs would
    // fail after ~550 ms.
    let (interval, timeout) = (Duration::from_millis(50), Duration::from_millis(500));
    let server = TestServer::start(&listen, |b| b.keepalive(interval, timeout)).await;
    let channel = Endpoint::new(&server.address)
        .unwrap()
        .keepalive(interval, timeout)
        .connect()
        .await
        .unwrap();
    let client = Client::new(channel);
    // Forty keepalive intervals with no call traffic: pings and pongs keep both sides up.
    let request = Request::new(sleep_request(2_000));
    let reply = client
        .unary::<BytesCodec>("/test.Test/Sleep", request)
        .await
        .unwrap();
    assert_eq!(reply.into_inner(), "slept");
    assert_eq!(server.probes.cancelled.load(Ordering::SeqCst), 0);
    server.stop().await;
}

pub async fn dropping_a_response_stream_stops_the_server_stream(
    listen: String,
    _profile: &Profile,
) {
    let server = TestServer::start(&listen, |b| b).await;
    let channel = Endpoint::new(&server.address)
        .unwrap()
        .stream_window(1 << 20)
        .connect()
        .await
        .unwrap();
    let client = Client::new(channel);
    let size = 64 * 1024;
    let mut stream = client
        .server_streaming::<BytesCodec>(
            "/test.Test/Count",
            Request::new(count_request(100_000, size)),
        )
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        stream.message().await.unwrap(),
        Some(count_message(0, size))
    );
    drop(stream); // cancels the call
                  // The cancel takes a transport-dependent time to arrive: wait until the
                  // server has stopped producing, then make sure it stays stopped.
    let mut last = usize::MAX;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = server.probes.produced.load(Ordering::SeqCst);
        if now == last {
            break;
        }
        last = now;
    }
    let produced = server.probes.produced.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        server.probes.produced.load(Ordering::SeqCst),
        produced,
        "the server kept streaming after the client left"
    );
    assert!(
        produced < 100,
        "{produced} messages produced for a reader that took one"
    );
    // The channel is still good, and the server has no call left open: it drains at once.
    client
        .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"x")))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), server.stop())
        .await
        .expect("no call left behind");
}

pub async fn calls_over_the_concurrency_limit_are_refused(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b.max_concurrent_calls(2)).await;
    let client = client_for(&server).await;
    let sleepers: Vec<_> = (0..2)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                let request = Request::new(sleep_request(300));
                client
                    .unary::<BytesCodec>("/test.Test/Sleep", request)
                    .await
            })
        })
        .collect();
    let probes = std::sync::Arc::clone(&server.probes);
    assert!(
        probes
            .wait_until(Duration::from_secs(5), || probes
                .sleeping
                .load(Ordering::SeqCst)
                == 2)
            .await
    );
    let status = client
        .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
    for sleeper in sleepers {
        assert_eq!(sleeper.await.unwrap().unwrap().into_inner(), "slept");
    }
    let reply = client
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from_static(b"room again")),
        )
        .await;
    assert_eq!(reply.unwrap().into_inner(), "room again");
    server.stop().await;
}

/// The `i`-th of several servers' listen addresses: a port-0 address serves
/// for all, a `mem://` name is made unique.
fn nth_listen(listen: &str, i: usize) -> String {
    if listen.starts_with("mem://") {
        format!("{listen}-{i}")
    } else {
        listen.to_string()
    }
}

pub async fn fan_out_under_a_deadline_returns_partial_results_and_cancels_stragglers(
    listen: String,
    _profile: &Profile,
) {
    let mut servers = Vec::new();
    for i in 0..3 {
        servers.push(TestServer::start(&nth_listen(&listen, i), |b| b).await);
    }
    let mut clients = Vec::new();
    for server in &servers {
        clients.push(client_for(server).await);
    }
    // Shards 0 and 1 answer at once, shard 2 would take 30 s.
    let work = [0, 0, 30_000];
    let fan = FanOut::within(Duration::from_secs(2));
    let started = Instant::now();
    let results = fan
        .run(clients.iter().zip(work).map(|(client, millis)| {
            client.unary::<BytesCodec>("/test.Test/Sleep", fan.request(sleep_request(millis)))
        }))
        .await;
    assert_eq!(results.finished, Finished::Deadline, "{results:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(
        results.shards[0].is_ok() && results.shards[1].is_ok(),
        "{results:?}"
    );
    assert!(
        matches!(results.shards[2], ShardResult::NotAnswered),
        "{results:?}"
    );
    // The straggler's handler is cancelled on its server.
    let probes = &servers[2].probes;
    assert!(
        probes
            .wait_until(Duration::from_secs(5), || probes
                .cancelled
                .load(Ordering::SeqCst)
                == 1)
            .await,
        "the straggler's handler was not cancelled"
    );
    for server in servers {
        server.stop().await;
    }
}

pub async fn a_balanced_channel_moves_on_from_a_dead_replica(listen: String, _profile: &Profile) {
    let dying = TestServer::start(&nth_listen(&listen, 0), |b| b).await;
    let other = TestServer::start(&nth_listen(&listen, 1), |b| b).await;
    let endpoints = [&dying, &other].map(|s| {
        Endpoint::new(&s.address)
            .unwrap()
            .reconnect_backoff(Duration::from_secs(5), Duration::from_secs(5))
    });
    let client = Client::new(Channel::balance(endpoints, Balance::RoundRobin).unwrap());
    // An idempotent call in flight on the replica that dies is answered by the other.
    let mut request = Request::new(sleep_request(30_000));
    request.set_idempotent(true);
    let call = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .unary::<BytesCodec>("/test.Test/Sleep", request)
                .await
        }
    });
    let probes = std::sync::Arc::clone(&dying.probes);
    assert!(
        probes
            .wait_until(Duration::from_secs(5), || probes
                .sleeping
                .load(Ordering::SeqCst)
                == 1)
            .await
    );
    dying.kill().await;
    // The retry sleeps 30 s on the other replica: cut it short by seeing it start.
    let others = std::sync::Arc::clone(&other.probes);
    assert!(
        others
            .wait_until(Duration::from_secs(10), || others
                .sleeping
                .load(Ordering::SeqCst)
                == 1)
            .await,
        "the idempotent call was not retried on the other replica"
    );
    call.abort();
    // New calls all go to the live replica: the dead one is ejected.
    for i in 0..10 {
        let body = Bytes::from(format!("after-{i}"));
        let reply = client
            .unary::<BytesCodec>("/test.Test/Echo", Request::new(body.clone()))
            .await
            .unwrap_or_else(|status| panic!("call {i} failed: {status}"));
        assert_eq!(reply.into_inner(), body);
    }
    other.stop().await;
}

pub async fn handlers_see_the_clients_address(listen: String, _profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let client = client_for(&server).await;
    let peer = client
        .unary::<BytesCodec>("/test.Test/Peer", Request::new(Bytes::new()))
        .await
        .unwrap()
        .into_inner();
    let peer = String::from_utf8(peer.to_vec()).unwrap();
    // Client and server share a host here: the client's address has the
    // server's host, and a port of its own.
    let host = server
        .address
        .split_once("://")
        .and_then(|(_, authority)| authority.rsplit_once(':'))
        .map_or("mem", |(host, _)| host);
    assert!(
        peer.contains(host),
        "the handler saw {peer:?} (server at {})",
        server.address
    );
    if let Some((_, port)) = peer
        .rsplit_once(':')
        .filter(|_| !listen.starts_with("mem://"))
    {
        let port: u16 = port.parse().unwrap_or_else(|_| panic!("{peer:?}"));
        assert!(
            !server.address.ends_with(&format!(":{port}")),
            "{peer:?} is the server's own address"
        );
    }
    server.stop().await;
}

/// A request written into a payload buffer of the client's channel, echoed
/// from one the handler takes of its call's connection: byte-exact, at
/// every size the profile lists (over `rdma://` with the rendezvous off,
/// the default, both are heap memory; `transport-rdma/tests/rendezvous.rs`
/// runs it with registered memory).
pub async fn payload_buffers_carry_requests_and_responses(listen: String, profile: &Profile) {
    let server = TestServer::start(&listen, |b| b).await;
    let channel = Channel::connect(&server.address).await.expect("connects");
    let client = Client::new(channel.clone());
    for &len in &profile.payload_sizes {
        let want: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let mut buffer = channel.payload_buffer(len).await.expect("a payload buffer");
        buffer.copy_from_slice(&want);
        let echoed = client
            .unary::<BytesCodec>(
                "/test.Test/EchoInPayloadBuffer",
                large_request(buffer.freeze()),
            )
            .await
            .unwrap_or_else(|e| panic!("{len} bytes: {e}"))
            .into_inner();
        assert!(echoed == want, "{len} bytes came back different");
    }
    server.stop().await;
}

/// Calls `$runner!(case, case, ...)` with the name of every case in this
/// module: the one list of shared cases. A suite's runner macro turns each
/// name into a test over its transport (see the crate docs).
#[macro_export]
macro_rules! for_each_case {
    ($runner:ident) => {
        $runner!(
            unary_round_trips_message_and_metadata,
            handler_errors_arrive_with_code_message_and_trailers,
            server_streaming_delivers_every_message_in_order,
            client_streaming_sums_every_message,
            bidi_streaming_answers_each_message,
            thousands_of_concurrent_calls_on_one_channel_none_mixed_up,
            deadline_fails_the_call_and_cancels_the_handler,
            zero_timeout_fails_at_once_without_sending,
            a_client_that_half_closes_after_its_request_still_gets_the_reply,
            dropping_the_call_cancels_the_handler,
            a_caller_that_read_for_itself_and_gave_up_hands_reading_back,
            bursts_after_a_lone_call_are_read,
            unknown_service_and_method_are_unimplemented,
            panicking_handler_fails_only_its_call,
            oversized_messages_fail_with_resource_exhausted_and_the_connection_survives,
            a_64_mib_tensor_fits_the_default_limit_and_a_larger_message_does_not,
            slow_reader_holds_back_a_streaming_server,
            slow_handler_holds_back_a_streaming_client,
            killed_server_fails_pending_calls_and_the_channel_reconnects,
            graceful_shutdown_lets_calls_in_flight_finish,
            a_server_whose_runtime_ends_with_serve_sent_every_answer,
            empty_and_large_messages_arrive_intact,
            keepalive_pings_do_not_disturb_a_slow_call,
            dropping_a_response_stream_stops_the_server_stream,
            calls_over_the_concurrency_limit_are_refused,
            fan_out_under_a_deadline_returns_partial_results_and_cancels_stragglers,
            a_balanced_channel_moves_on_from_a_dead_replica,
            handlers_see_the_clients_address,
            payload_buffers_carry_requests_and_responses,
        );
    };
}
