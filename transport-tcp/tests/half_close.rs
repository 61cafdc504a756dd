//! A raw client's requests, frame by frame: a client that shuts down its
//! sending side right after its request still gets the reply, a request
//! with a timeout of zero is answered `DeadlineExceeded` without running, and
//! a request stream that ignores the server's window is cut off.

use rpc_test_support as support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rpc_core::frame::{Frame, FrameBody, OutBody, OutFrame};
use rpc_core::{Code, MetadataMap, Status};
use support::TestServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn start() -> (TestServer, TcpStream) {
    start_with(|b| b).await
}

async fn start_with(
    configure: impl FnOnce(rpc_core::ServerBuilder) -> rpc_core::ServerBuilder,
) -> (TestServer, TcpStream) {
    transport_tcp::install();
    let server = TestServer::start("tcp://127.0.0.1:0", configure).await;
    let authority = server.address.strip_prefix("tcp://").unwrap();
    let raw = TcpStream::connect(authority).await.unwrap();
    (server, raw)
}

async fn write_frame(raw: &mut TcpStream, frame: &OutFrame<'_>) {
    let frame = frame.to_bytes();
    let mut bytes = (frame.len() as u32).to_le_bytes().to_vec();
    bytes.extend_from_slice(&frame);
    raw.write_all(&bytes).await.unwrap();
}

/// Writes one complete request (`end_stream`) for `method`, as the TCP transport frames it.
async fn send_request(
    raw: &mut TcpStream,
    id: u64,
    method: &str,
    timeout: Option<Duration>,
    payload: Bytes,
) {
    let metadata = MetadataMap::new();
    let body = OutBody::Request {
        method,
        timeout,
        metadata: &metadata,
    };
    let frame = OutFrame::new(id, body, Some(&payload), true)
        .unwrap()
        .to_bytes();
    let mut bytes = (frame.len() as u32).to_le_bytes().to_vec();
    bytes.extend_from_slice(&frame);
    raw.write_all(&bytes).await.unwrap();
}

async fn read_frame(raw: &mut TcpStream) -> Option<Frame> {
    let mut len = [0u8; 4];
    raw.read_exact(&mut len).await.ok()?;
    let mut frame = vec![0u8; u32::from_le_bytes(len) as usize];
    raw.read_exact(&mut frame).await.ok()?;
    Some(Frame::decode(frame.into()).expect("the server sends valid frames"))
}

/// Reads until the final status of call `id` (skipping pings and the like).
async fn final_status(raw: &mut TcpStream, id: u64) -> (Status, Option<Bytes>) {
    let read = async {
        loop {
            let frame = read_frame(raw)
                .await
                .expect("a status before the server closes");
            if let (FrameBody::Status(status), true) = (frame.body, frame.call_id == id) {
                return (status, frame.payload);
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the server answered")
}

#[tokio::test]
async fn a_client_that_half_closes_after_its_request_gets_the_reply() {
    let (server, mut raw) = start().await;
    // A handler that is still running when the server reads the end of the
    // client's stream: without half-close support it would be aborted.
    send_request(
        &mut raw,
        1,
        "/test.Test/Sleep",
        None,
        Bytes::from(100u32.to_le_bytes().to_vec()),
    )
    .await;
    raw.shutdown().await.unwrap(); // shutdown(Write): the client sends nothing more
    let (status, payload) = final_status(&mut raw, 1).await;
    assert_eq!(status.code(), Code::Ok, "{status}");
    assert_eq!(payload.as_deref(), Some(&b"slept"[..]));
    // Then the server closes its side, its calls all answered.
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        while read_frame(&mut raw).await.is_some() {}
    })
    .await;
    assert!(
        closed.is_ok(),
        "the server kept the half-closed connection open"
    );
    server.stop().await;
}

/// Pings every 50 ms, a dead peer declared after 50 ms more.
fn fast_keepalive(b: rpc_core::ServerBuilder) -> rpc_core::ServerBuilder {
    b.keepalive(Duration::from_millis(50), Duration::from_millis(50))
}

#[tokio::test]
async fn a_half_closed_client_still_reading_gets_its_reply_through_the_pings() {
    // The keepalive goes on after the half-close, as probes (the client can
    // send no pongs): a client that reads stays served, for longer than
    // the interval and timeout together.
    let (server, mut raw) = start_with(fast_keepalive).await;
    send_request(
        &mut raw,
        1,
        "/test.Test/Sleep",
        None,
        Bytes::from(600u32.to_le_bytes().to_vec()),
    )
    .await;
    raw.shutdown().await.unwrap();
    let (status, payload) = final_status(&mut raw, 1).await;
    assert_eq!(status.code(), Code::Ok, "{status}");
    assert_eq!(payload.as_deref(), Some(&b"slept"[..]));
    assert_eq!(server.probes.cancelled.load(Ordering::SeqCst), 0);
    drop(raw);
    server.stop().await;
}

#[tokio::test]
async fn a_client_that_left_with_a_call_open_has_it_cancelled_and_the_server_drains() {
    // A client process that exits closes its socket: the server reads a
    // half-close. Its open call (a 60 s sleep here; a health watch stream
    // in the shard-server demo) must not hold the connection, and a
    // shutdown with no grace, for as long as it runs.
    let (server, mut raw) = start_with(fast_keepalive).await;
    send_request(
        &mut raw,
        1,
        "/test.Test/Sleep",
        None,
        Bytes::from(60_000u32.to_le_bytes().to_vec()),
    )
    .await;
    let probes = &server.probes;
    let started = probes
        .wait_until(Duration::from_secs(10), || {
            probes.sleeping.load(Ordering::SeqCst) == 1
        })
        .await;
    assert!(started, "the handler never started");
    drop(raw);
    let left = Instant::now();
    let cancelled = probes
        .wait_until(Duration::from_secs(10), || {
            probes.cancelled.load(Ordering::SeqCst) == 1
        })
        .await;
    assert!(
        cancelled,
        "the departed client's call still runs 10 s after it left"
    );
    println!("cancelled {:?} after the client left", left.elapsed());
    tokio::time::timeout(Duration::from_secs(10), server.stop())
        .await
        .expect("the server drained");
}

#[tokio::test]
async fn a_request_with_a_timeout_of_zero_is_answered_without_running() {
    let (server, mut raw) = start().await;
    send_request(
        &mut raw,
        1,
        "/test.Test/Sleep",
        Some(Duration::ZERO),
        Bytes::from(10_000u32.to_le_bytes().to_vec()),
    )
    .await;
    let (status, _) = final_status(&mut raw, 1).await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status}");
    assert_eq!(
        server.probes.sleeping.load(Ordering::SeqCst),
        0,
        "the handler ran"
    );
    drop(raw);
    server.stop().await;
}

#[tokio::test]
async fn a_request_stream_beyond_the_granted_window_fails_its_call() {
    const WINDOW: u32 = 64 * 1024; // the protocol's initial window: no grant until the handler reads
    let (server, mut raw) = start_with(|b| b.stream_window(WINDOW)).await;
    let metadata = MetadataMap::new();
    let body = OutBody::Request {
        method: "/test.Test/Hold", // reads nothing for 400 ms
        timeout: None,
        metadata: &metadata,
    };
    write_frame(&mut raw, &OutFrame::new(1, body, None, false).unwrap()).await;
    let message = Bytes::from(vec![1u8; 16 * 1024]);
    for _ in 0..64 {
        // 1 MiB in all, sixteen times the window, without waiting for grants.
        write_frame(
            &mut raw,
            &OutFrame::control(1, OutBody::Message, false).with_payload(&message),
        )
        .await;
    }
    write_frame(&mut raw, &OutFrame::control(1, OutBody::Message, true)).await;
    let (status, _) = final_status(&mut raw, 1).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
    assert!(
        status.message().contains(&format!("{WINDOW}-byte window")),
        "{status}"
    );
    drop(raw);
    server.stop().await;
}

#[tokio::test]
async fn half_closing_inside_a_request_stream_fails_that_call_with_a_reason() {
    let (server, mut raw) = start().await;
    let metadata = MetadataMap::new();
    let body = OutBody::Request {
        method: "/test.Test/Sum", // reads its stream to the end
        timeout: None,
        metadata: &metadata,
    };
    let first = Bytes::from_static(b"one message, no end of stream");
    write_frame(
        &mut raw,
        &OutFrame::new(1, body, Some(&first), false).unwrap(),
    )
    .await;
    raw.shutdown().await.unwrap();
    // The stream can never end now: the handler is told so rather than left waiting.
    let (status, _) = final_status(&mut raw, 1).await;
    assert_eq!(status.code(), Code::Cancelled, "{status}");
    assert!(
        status.message().contains("closed its sending side"),
        "{status}"
    );
    server.stop().await;
}
