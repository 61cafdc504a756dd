//! A client that opens calls and reads no reply cannot make the server hold
//! unbounded memory: the bound documented on `rpc_core::ServerBuilder`.
//!
//! One test in this binary: it measures the process's resident memory, which
//! another test running alongside would disturb.

use rpc_test_support as support;

use std::time::Duration;

use bytes::Bytes;
use rpc_core::frame::{Frame, FrameBody, OutBody, OutFrame};
use rpc_core::{Code, MetadataMap, DEFAULT_MAX_CONCURRENT_CALLS};
use support::TestServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::watch;

const CALLS: u64 = 200_000;
/// What the server may grow by while the calls sit unread.
const RSS_BOUND: u64 = 64 << 20;

/// The process's resident memory, from `/proc/self/status`.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// `CALLS` unary Echo requests with a 64-byte message, ids 1..=CALLS, as the TCP transport frames them.
fn requests(first: u64, count: u64) -> Vec<u8> {
    let metadata = MetadataMap::new();
    let payload = Bytes::from(vec![7u8; 64]);
    let mut bytes = Vec::new();
    for id in first..first + count {
        let body = OutBody::Request {
            method: "/test.Test/Echo",
            timeout: None,
            metadata: &metadata,
        };
        let frame = OutFrame::new(id, body, Some(&payload), true)
            .unwrap()
            .to_bytes();
        bytes.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&frame);
    }
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_whose_replies_are_never_read_leave_the_server_within_its_bound() {
    transport_tcp::install();
    let server = TestServer::start("tcp://127.0.0.1:0", |b| b).await;
    let authority = server.address.strip_prefix("tcp://").unwrap();
    let (read, mut write) = TcpStream::connect(authority).await.unwrap().into_split();
    let before = rss_bytes();

    // Send every call, reading nothing, for as long as the server takes them.
    let (progress, mut written) = watch::channel(0u64);
    let writer = tokio::spawn(async move {
        const BATCH: u64 = 500;
        for first in (1..=CALLS).step_by(BATCH as usize) {
            write.write_all(&requests(first, BATCH)).await.unwrap();
            progress.send_replace(first + BATCH - 1);
        }
        write // kept open: the calls stay unread, not half-closed
    });
    // Until all are sent, or the server has stopped taking more (no progress for 2 s).
    while let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(2), written.changed()).await {}
    let sent_unread = *written.borrow();
    let grown = rss_bytes().saturating_sub(before);
    eprintln!(
        "{sent_unread} calls sent, none read: the process grew by {} KiB",
        grown / 1024
    );
    assert!(
        grown < RSS_BOUND,
        "{sent_unread} unread calls grew the server by {} MiB, over the bound of {} MiB",
        grown >> 20,
        RSS_BOUND >> 20
    );

    // Now read: every call gets its answer, the reply or a refusal over the limit.
    let mut read = BufReader::with_capacity(1 << 16, read);
    let (mut replied, mut refused) = (0u64, 0u64);
    let mut peak = grown;
    while replied + refused < CALLS {
        let mut len = [0u8; 4];
        read.read_exact(&mut len).await.unwrap();
        let mut frame = vec![0u8; u32::from_le_bytes(len) as usize];
        read.read_exact(&mut frame).await.unwrap();
        let frame = Frame::decode(frame.into()).unwrap();
        let FrameBody::Status(status) = frame.body else {
            continue; // a ping
        };
        match status.code() {
            Code::Ok => replied += 1,
            Code::ResourceExhausted => {
                let limit = format!(
                    "{DEFAULT_MAX_CONCURRENT_CALLS} calls already open on this connection, \
                     the server's limit is {DEFAULT_MAX_CONCURRENT_CALLS}"
                );
                assert_eq!(status.message(), limit, "more calls open than the limit");
                refused += 1;
            }
            _ => panic!("call {} failed: {status}", frame.call_id),
        }
        if (replied + refused) % 10_000 == 0 {
            peak = peak.max(rss_bytes().saturating_sub(before));
        }
    }
    eprintln!(
        "{replied} calls answered, {refused} refused as over the limit; peak growth {} KiB",
        peak / 1024
    );
    assert!(peak < RSS_BOUND, "peak growth {} MiB", peak >> 20);
    assert!(
        replied >= DEFAULT_MAX_CONCURRENT_CALLS as u64,
        "{replied} replies"
    );
    drop(writer.await.unwrap());
    server.stop().await;
}
