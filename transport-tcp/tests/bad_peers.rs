//! Peers that break the protocol, at the byte level: the offending
//! connection is closed with a reason, everything else keeps working.

use rpc_test_support as support;

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use rpc_core::frame::{Frame, FrameBody, OutBody, OutFrame};
use rpc_core::{BytesCodec, Channel, Client, Code, Endpoint, MetadataMap, Request};
use support::TestServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn start() -> (TestServer, Client, String) {
    transport_tcp::install();
    let server = TestServer::start("tcp://127.0.0.1:0", |b| b.max_message_size(1 << 20)).await;
    let client = Client::new(Channel::connect(&server.address).await.unwrap());
    let authority = server.address.strip_prefix("tcp://").unwrap().to_string();
    (server, client, authority)
}

async fn echo_works(client: &Client) {
    let reply = client
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from_static(b"alive")),
        )
        .await;
    assert_eq!(
        reply
            .expect("a well-behaved client is unaffected")
            .into_inner(),
        "alive"
    );
}

async fn read_frame(socket: &mut TcpStream) -> Option<Frame> {
    let mut len = [0u8; 4];
    socket.read_exact(&mut len).await.ok()?;
    let mut frame = vec![0u8; u32::from_le_bytes(len) as usize];
    socket.read_exact(&mut frame).await.ok()?;
    Some(Frame::decode(frame.into()).expect("the server sends valid frames"))
}

/// Reads frames until the server closes; returns the GoAway status it sent, if any.
async fn read_until_closed(socket: &mut TcpStream) -> Option<rpc_core::Status> {
    let mut goaway = None;
    let read = async {
        while let Some(frame) = read_frame(socket).await {
            if let FrameBody::GoAway(status) = frame.body {
                goaway = Some(status);
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("the server closed the connection");
    goaway
}

fn with_prefix(frame: &[u8]) -> Vec<u8> {
    let mut bytes = (frame.len() as u32).to_le_bytes().to_vec();
    bytes.extend_from_slice(frame);
    bytes
}

#[tokio::test]
async fn malformed_frame_closes_only_that_connection() {
    let (server, client, authority) = start().await;
    let mut raw = TcpStream::connect(&authority).await.unwrap();
    raw.write_all(&with_prefix(b"not a frame at all, just bytes"))
        .await
        .unwrap();
    let status = read_until_closed(&mut raw)
        .await
        .expect("a GoAway says why");
    assert_eq!(status.code(), Code::Internal);
    assert!(status.message().contains("malformed frame"), "{status}");
    echo_works(&client).await;
    server.stop().await;
}

#[tokio::test]
async fn unknown_protocol_version_is_refused_by_name() {
    let (server, client, authority) = start().await;
    let metadata = MetadataMap::new();
    let body = OutBody::Request {
        method: "/test.Test/Echo",
        timeout: None,
        metadata: &metadata,
    };
    let mut frame = OutFrame::new(1, body, None, true)
        .unwrap()
        .to_bytes()
        .to_vec();
    frame[0] = 9;
    let mut raw = TcpStream::connect(&authority).await.unwrap();
    raw.write_all(&with_prefix(&frame)).await.unwrap();
    let status = read_until_closed(&mut raw)
        .await
        .expect("a GoAway says why");
    assert!(status.message().contains("version 9"), "{status}");
    echo_works(&client).await;
    server.stop().await;
}

#[tokio::test]
async fn frame_far_over_the_limit_closes_the_connection() {
    let (server, client, authority) = start().await;
    let mut raw = TcpStream::connect(&authority).await.unwrap();
    // 100 MiB announced against a 1 MiB limit: not skipped, refused.
    raw.write_all(&(100u32 << 20).to_le_bytes()).await.unwrap();
    let status = read_until_closed(&mut raw)
        .await
        .expect("a GoAway says why");
    assert!(status.message().contains("over the limit"), "{status}");
    echo_works(&client).await;
    server.stop().await;
}

#[tokio::test]
async fn oversized_request_is_skipped_and_the_same_connection_goes_on() {
    let (server, _client, authority) = start().await;
    let mut raw = TcpStream::connect(&authority).await.unwrap();
    let metadata = MetadataMap::new();
    let big = Bytes::from(vec![1u8; 2 << 20]);
    let small = Bytes::from_static(b"small");
    for (id, payload) in [(1u64, &big), (2, &small)] {
        let body = OutBody::Request {
            method: "/test.Test/Echo",
            timeout: None,
            metadata: &metadata,
        };
        let frame = OutFrame::new(id, body, Some(payload), true)
            .unwrap()
            .to_bytes();
        raw.write_all(&with_prefix(&frame)).await.unwrap();
    }
    let mut replies = [
        read_frame(&mut raw).await.unwrap(),
        read_frame(&mut raw).await.unwrap(),
    ];
    replies.sort_by_key(|f| f.call_id);
    let FrameBody::Status(first) = &replies[0].body else {
        panic!("{:?}", replies[0])
    };
    assert_eq!(first.code(), Code::ResourceExhausted);
    let FrameBody::Status(second) = &replies[1].body else {
        panic!("{:?}", replies[1])
    };
    assert!(second.is_ok(), "{second}");
    assert_eq!(replies[1].payload.as_deref(), Some(&b"small"[..]));
    server.stop().await;
}

/// A fake server that reads one request, answers with `reply` bytes, then hangs up.
async fn fake_server(reply: Vec<u8>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut len = [0u8; 4];
        socket.read_exact(&mut len).await.unwrap();
        let mut request = vec![0u8; u32::from_le_bytes(len) as usize];
        socket.read_exact(&mut request).await.unwrap();
        socket.write_all(&reply).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    address
}

#[tokio::test]
async fn server_sending_garbage_fails_the_call_promptly() {
    transport_tcp::install();
    let address = fake_server(with_prefix(b"garbage garbage garbage!")).await;
    let client = Client::new(Channel::connect(&address).await.unwrap());
    let call =
        client.unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"hi")));
    let status = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("no hang")
        .unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status}");
    assert!(status.message().contains("malformed frame"), "{status}");
}

#[tokio::test]
async fn server_dying_inside_a_frame_fails_the_call_with_unavailable() {
    transport_tcp::install();
    let mut half = 1000u32.to_le_bytes().to_vec();
    half.extend_from_slice(&[1, 3, 0, 0]);
    let address = fake_server(half).await;
    let client = Client::new(Channel::connect(&address).await.unwrap());
    let call =
        client.unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"hi")));
    let status = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("no hang")
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status}");
}

#[tokio::test]
async fn server_that_stops_answering_fails_calls_through_keepalive() {
    transport_tcp::install();
    // Accepts and reads everything, answers nothing: TCP alone sees a healthy peer.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut sink = vec![0u8; 65536];
        while socket.read(&mut sink).await.is_ok_and(|n| n > 0) {}
    });
    let fast = Duration::from_millis(100);
    let channel = Endpoint::new(&address)
        .unwrap()
        .keepalive(fast, fast)
        .connect()
        .await
        .unwrap();
    let client = Client::new(channel);
    let started = std::time::Instant::now();
    let call = client.unary::<BytesCodec>(
        "/test.Test/Echo",
        Request::new(Bytes::from_static(b"hello?")),
    );
    let status = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("no hang")
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    assert!(status.message().contains("presumed dead"), "{status}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn server_that_stops_reading_fails_calls_through_keepalive() {
    transport_tcp::install();
    // Accepts, then neither reads nor answers: the client's socket and
    // sink fill up, so its keepalive ping cannot be sent either.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("tcp://{}", listener.local_addr().unwrap());
    let stuck = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        std::future::pending::<()>().await;
        drop(socket);
    });
    let fast = Duration::from_millis(100);
    let channel = Endpoint::new(&address)
        .unwrap()
        .keepalive(fast, fast)
        .connect()
        .await
        .unwrap();
    let client = Client::new(channel);
    let started = std::time::Instant::now();
    let calls = (0..64).map(|_| {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .unary::<BytesCodec>(
                    "/test.Test/Echo",
                    Request::new(Bytes::from(vec![1u8; 1 << 20])),
                )
                .await
        })
    });
    let results = tokio::time::timeout(Duration::from_secs(10), futures::future::join_all(calls))
        .await
        .expect("calls behind a full sink hang instead of failing through keepalive");
    for result in results {
        let status = result.unwrap().unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    stuck.abort();
}

#[tokio::test]
async fn client_that_goes_silent_has_its_handlers_cancelled() {
    transport_tcp::install();
    let fast = Duration::from_millis(100);
    let server = TestServer::start("tcp://127.0.0.1:0", |b| b.keepalive(fast, fast)).await;
    let mut raw = TcpStream::connect(server.address.strip_prefix("tcp://").unwrap())
        .await
        .unwrap();
    let metadata = MetadataMap::new();
    let ten_seconds = Bytes::from(10_000u32.to_le_bytes().to_vec());
    let body = OutBody::Request {
        method: "/test.Test/Sleep",
        timeout: None,
        metadata: &metadata,
    };
    let frame = OutFrame::new(1, body, Some(&ten_seconds), true)
        .unwrap()
        .to_bytes();
    raw.write_all(&with_prefix(&frame)).await.unwrap();
    // The raw client never answers pings.
    let probes = std::sync::Arc::clone(&server.probes);
    let cancelled = probes.wait_until(Duration::from_secs(5), || {
        probes.cancelled.load(std::sync::atomic::Ordering::SeqCst) == 1
    });
    assert!(
        cancelled.await,
        "the handler of a silent client kept running"
    );
    drop(raw);
    server.stop().await;
}

/// A fake server that answers the first call it reads with the frames `reply` builds for its id.
async fn fake_unary_server(reply: fn(u64) -> Vec<Bytes>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let request = read_frame(&mut socket).await.unwrap();
        for frame in reply(request.call_id) {
            socket.write_all(&with_prefix(&frame)).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    });
    address
}

async fn unary_against(address: &str) -> Result<Bytes, rpc_core::Status> {
    transport_tcp::install();
    let client = Client::new(Channel::connect(address).await.unwrap());
    let call =
        client.unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"hi")));
    tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("no hang")
        .map(|response| response.into_inner())
}

fn message(id: u64, payload: &'static [u8]) -> Bytes {
    let payload = Bytes::from_static(payload);
    OutFrame::control(id, OutBody::Message, false)
        .with_payload(&payload)
        .to_bytes()
}

fn status(id: u64, status: &rpc_core::Status, payload: Option<&'static [u8]>) -> Bytes {
    let payload = payload.map(Bytes::from_static);
    OutFrame::new(
        id,
        OutBody::Status(status),
        payload.as_ref().map(|p| p as _),
        false,
    )
    .unwrap()
    .to_bytes()
}

#[tokio::test]
async fn unary_answer_in_a_message_frame_then_an_ok_status_is_accepted() {
    let address = fake_unary_server(|id| {
        vec![
            message(id, b"reply"),
            status(id, &rpc_core::Status::ok(""), None),
        ]
    })
    .await;
    assert_eq!(unary_against(&address).await.unwrap(), "reply");
}

#[tokio::test]
async fn unary_answer_with_two_messages_fails_the_call() {
    let address = fake_unary_server(|id| {
        vec![
            message(id, b"one"),
            status(id, &rpc_core::Status::ok(""), Some(b"two")),
        ]
    })
    .await;
    let status = unary_against(&address).await.unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status}");
    assert!(
        status.message().contains("more than one message"),
        "{status}"
    );
}

#[tokio::test]
async fn unary_answer_without_a_message_fails_the_call() {
    let address = fake_unary_server(|id| vec![status(id, &rpc_core::Status::ok(""), None)]).await;
    let status = unary_against(&address).await.unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status}");
    assert!(
        status.message().contains("without a response message"),
        "{status}"
    );
}

#[tokio::test]
async fn unary_error_status_reaches_the_caller_even_after_a_message() {
    let address = fake_unary_server(|id| {
        vec![
            message(id, b"partial"),
            status(id, &rpc_core::Status::not_found("no such thing"), None),
        ]
    })
    .await;
    let status = unary_against(&address).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status}");
    assert_eq!(status.message(), "no such thing");
}

/// A server that ignores the window the client grants on a response stream:
/// the client fails that call with `ResourceExhausted` once the server starts
/// a message beyond the window (what the client buffers stays bounded), tells
/// the server (a `Cancel` frame), and the connection goes on.
#[tokio::test]
async fn server_ignoring_the_response_window_fails_that_call_only() {
    transport_tcp::install();
    const MESSAGE: usize = 1024;
    const SENT: usize = 200; // 200 KiB against the protocol's 64 KiB initial window
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("tcp://{}", listener.local_addr().unwrap());
    let (cancelled_tx, cancelled_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let request = read_frame(&mut socket).await.unwrap();
        let payload = Bytes::from(vec![7u8; MESSAGE]);
        for _ in 0..SENT {
            let frame = OutFrame::control(request.call_id, OutBody::Message, false)
                .with_payload(&payload)
                .to_bytes();
            socket.write_all(&with_prefix(&frame)).await.unwrap();
        }
        // The client's answer to the flood: a Cancel for that call.
        while let Some(frame) = read_frame(&mut socket).await {
            if frame.call_id == request.call_id && matches!(frame.body, FrameBody::Cancel) {
                let _ = cancelled_tx.send(());
                break;
            }
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    });

    // The smallest window the client grants: the protocol's initial 64 KiB.
    let channel = Endpoint::new(&address)
        .unwrap()
        .stream_window(0)
        .connect()
        .await
        .unwrap();
    let client = Client::new(channel);
    let mut stream = client
        .server_streaming::<BytesCodec>("/test.Test/Count", Request::new(Bytes::new()))
        .await
        .unwrap()
        .into_inner();
    // Nothing is read until the server has sent its flood and been refused.
    tokio::time::timeout(Duration::from_secs(5), cancelled_rx)
        .await
        .expect("the client cancelled the call that broke flow control")
        .unwrap();
    let mut received = 0;
    let status = loop {
        match stream.next().await {
            Some(Ok(message)) => received += message.len(),
            Some(Err(status)) => break status,
            None => panic!("the stream ended with success after {received} bytes"),
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
    assert!(
        status.message().contains("flow control ignored"),
        "{status}"
    );
    assert!(
        (64 * 1024..=64 * 1024 + MESSAGE).contains(&received),
        "the client delivered {received} bytes: the window plus at most one message"
    );
}
