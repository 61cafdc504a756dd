//! The TCP sink's write path: frames written inline by their sender when the
//! socket is idle, queued and batched when it is busy. Whatever path a frame
//! takes, it reaches the peer whole and in order, back-pressure holds, a
//! broken connection fails its senders, and close sends everything first.

use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use rpc_core::frame::{Frame, FrameBody, OutBody, OutFrame};
use rpc_core::transport::{Connection, FrameLimits, FrameSink, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use transport_tcp::reader::FrameReader;
use transport_tcp::TcpTransport;

const LIMITS: FrameLimits = FrameLimits {
    max_frame_len: 64 << 20,
};

/// A sink connected to a plain socket the test reads from.
async fn connect(transport: TcpTransport) -> (Connection, Peer) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let authority = listener.local_addr().unwrap().to_string();
    let (connection, accepted) = tokio::join!(transport.connect(&authority, LIMITS), async {
        listener.accept().await.unwrap().0
    });
    let peer = Peer {
        socket: accepted,
        reader: FrameReader::new(LIMITS),
        slow: false,
    };
    (connection.unwrap(), peer)
}

/// A payload naming its sender and sequence number, `len` bytes long (at least 8).
fn payload(sender: u32, seq: u32, len: usize) -> Bytes {
    let mut bytes = BytesMut::with_capacity(len);
    bytes.put_u32_le(sender);
    bytes.put_u32_le(seq);
    bytes.put_bytes((seq % 251) as u8, len - 8);
    bytes.freeze()
}

/// Sends one message frame for call `sender` carrying `payload`.
async fn send(sink: &dyn FrameSink, sender: u32, payload: &Bytes) -> Result<(), String> {
    let frame = OutFrame::control(u64::from(sender), OutBody::Message, false).with_payload(payload);
    sink.send(&frame).await.map_err(|e| e.to_string())
}

/// Spawns `senders` tasks, sender `s` sending its messages `0..each`, of
/// `size(s, seq)` bytes, in order on `sink` (yielding now and then, so that
/// the senders interleave).
fn spawn_senders(
    sink: &Arc<dyn FrameSink>,
    senders: u32,
    each: u32,
    size: fn(u32, u32) -> usize,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..senders)
        .map(|sender| {
            let sink = Arc::clone(sink);
            tokio::spawn(async move {
                for seq in 0..each {
                    let message = payload(sender, seq, size(sender, seq));
                    send(&*sink, sender, &message).await.unwrap();
                    if seq % 7 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect()
}

/// The test's end of the connection: its socket, read through the
/// transport's own frame reader (frames and the pieces of large ones).
struct Peer {
    socket: TcpStream,
    reader: FrameReader,
    /// Reads of at most 8 KiB, with a pause now and then, so that the
    /// sender's socket stays full.
    slow: bool,
}

impl Peer {
    /// The next frame; `None` at end-of-stream.
    async fn frame(&mut self) -> Option<Frame> {
        let mut reads = 0u32;
        loop {
            if let Some(frame) = self.reader.next_frame().expect("frames arrive whole") {
                return Some(Frame::decode(frame).expect("frames arrive whole, never interleaved"));
            }
            if self.reader.large_partial_frame().is_some() {
                self.reader.reserve_frame();
            }
            let (buf, limit) = self.reader.read_target();
            let limit = if self.slow { limit.min(8 << 10) } else { limit };
            let read = self.socket.read_buf(&mut buf.limit(limit)).await.unwrap();
            self.reader.received(read);
            if read == 0 {
                assert!(
                    self.reader.end_of_stream().is_ok(),
                    "a frame is never cut short"
                );
                return None;
            }
            reads += 1;
            if self.slow && reads % 32 == 31 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
}

/// Checks that `frame` is message `seq` of `sender`, intact.
fn check(frame: &Frame, sender: u32, seq: u32, len: usize) {
    assert!(matches!(frame.body, FrameBody::Message), "{frame:?}");
    assert_eq!(frame.call_id, u64::from(sender));
    let got = frame.payload.as_ref().expect("a payload");
    assert_eq!(got.len(), len, "sender {sender} message {seq}");
    assert_eq!(
        got[..],
        payload(sender, seq, len)[..],
        "sender {sender} message {seq}"
    );
}

fn size_of(seq: u32) -> usize {
    // Mostly small, now and then large enough to fill the socket mid-frame.
    if seq % 97 == 0 {
        300_000
    } else {
        8 + (seq as usize * 37) % 3000
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_senders_frames_arrive_whole_and_in_order() {
    const SENDERS: u32 = 8;
    const EACH: u32 = 400;
    let (connection, mut peer) = connect(TcpTransport::default().write_high_water(16 << 10)).await;
    let senders = spawn_senders(&connection.sink, SENDERS, EACH, |_, seq| size_of(seq));
    let mut next = [0u32; SENDERS as usize];
    for _ in 0..SENDERS * EACH {
        let frame = tokio::time::timeout(Duration::from_secs(20), peer.frame())
            .await
            .expect("no stall")
            .expect("no early end-of-stream");
        let sender = frame.call_id as u32;
        let seq = next[sender as usize];
        check(&frame, sender, seq, size_of(seq));
        next[sender as usize] += 1;
    }
    for sender in senders {
        sender.await.unwrap();
    }
}

/// Mostly large frames (their payloads written by reference, vectored)
/// between small ones.
fn mixed_size_of(sender: u32, seq: u32) -> usize {
    match (seq + sender) % 3 {
        0 => (1 << 20) + (seq as usize * 4099) % (1 << 20),
        1 => 8 + (seq as usize * 37) % 3000,
        _ => 32 * 1024 + seq as usize,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_frames_between_small_ones_arrive_whole_and_in_order_to_a_slow_peer() {
    const SENDERS: u32 = 4;
    const EACH: u32 = 12;
    let (connection, mut peer) = connect(TcpTransport::default().write_high_water(64 << 10)).await;
    peer.slow = true;
    let sink = Arc::clone(&connection.sink);
    let senders = spawn_senders(&sink, SENDERS, EACH, mixed_size_of);
    let mut next = [0u32; SENDERS as usize];
    for _ in 0..SENDERS * EACH {
        let frame = tokio::time::timeout(Duration::from_secs(30), peer.frame())
            .await
            .expect("no stall")
            .expect("no early end-of-stream");
        let sender = frame.call_id as u32;
        let seq = next[sender as usize];
        check(&frame, sender, seq, mixed_size_of(sender, seq));
        next[sender as usize] += 1;
    }
    for sender in senders {
        sender.await.unwrap();
    }
    // Every frame accepted before close is sent, then end-of-stream.
    let last = payload(0, EACH, 3 << 20);
    send(&*sink, 0, &last).await.unwrap();
    connection.sink.close();
    check(&peer.frame().await.unwrap(), 0, EACH, 3 << 20);
    assert!(peer.frame().await.is_none());
}

#[tokio::test]
async fn frame_the_socket_cut_short_is_finished_before_queued_frames() {
    let (connection, mut peer) = connect(TcpTransport::default()).await;
    let sink = Arc::clone(&connection.sink);
    // The peer reads nothing yet: this frame is far more than the socket
    // takes, so its sender writes part of it and the writer task the rest.
    let big = 48 << 20;
    send(&*sink, 1, &payload(1, 0, big)).await.unwrap();
    // These queue behind the unfinished frame.
    for seq in 1..=20 {
        send(&*sink, 1, &payload(1, seq, 100)).await.unwrap();
    }
    let frame = peer.frame().await.unwrap();
    check(&frame, 1, 0, big);
    for seq in 1..=20 {
        check(&peer.frame().await.unwrap(), 1, seq, 100);
    }
}

#[tokio::test]
async fn back_pressure_holds_senders_until_the_peer_reads() {
    let (connection, mut peer) = connect(TcpTransport::default().write_high_water(64 << 10)).await;
    let sink = Arc::clone(&connection.sink);
    // The peer reads nothing: sends are accepted until the socket and the
    // 64 KiB of queue are full, then they wait.
    let mut sent = 0u32;
    loop {
        let message = payload(1, sent, 1024);
        let sending = send(&*sink, 1, &message);
        match tokio::time::timeout(Duration::from_millis(200), sending).await {
            Ok(result) => result.unwrap(),
            Err(_) => break, // this frame was not accepted
        }
        sent += 1;
        assert!(sent < 200_000, "200 MB accepted without the peer reading");
    }
    // Once the peer reads, the sender goes on.
    let sender = {
        let sink = Arc::clone(&sink);
        tokio::spawn(async move {
            for seq in sent..sent + 100 {
                send(&*sink, 1, &payload(1, seq, 1024)).await.unwrap();
            }
        })
    };
    for seq in 0..sent + 100 {
        check(&peer.frame().await.unwrap(), 1, seq, 1024);
    }
    sender.await.unwrap();
}

#[tokio::test]
async fn peer_reset_fails_the_waiting_sender_and_later_ones() {
    let (connection, peer) = connect(TcpTransport::default().write_high_water(64 << 10)).await;
    let sink = Arc::clone(&connection.sink);
    let waiting = {
        let sink = Arc::clone(&sink);
        tokio::spawn(async move {
            let mut seq = 0;
            loop {
                if let Err(error) = send(&*sink, 1, &payload(1, seq, 1024)).await {
                    return (seq, error);
                }
                seq += 1;
            }
        })
    };
    // Let the sender fill everything and wait for room, then reset.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "the sender waits while the peer does not read"
    );
    socket2::SockRef::from(&peer.socket)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(peer);
    let (sent, error) = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiting sender is woken")
        .unwrap();
    assert!(sent > 0);
    assert!(error.contains("write to peer"), "{error}");
    let later = send(&*sink, 1, &payload(1, 0, 64)).await.unwrap_err();
    assert!(later.contains("write to peer"), "{later}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_sends_every_accepted_frame_then_end_of_stream() {
    let (connection, mut peer) = connect(TcpTransport::default()).await;
    let sink = Arc::clone(&connection.sink);
    let reader = tokio::spawn(async move {
        let mut next = [0u32; 4];
        while let Some(frame) = peer.frame().await {
            let sender = frame.call_id as u32;
            let seq = next[sender as usize];
            check(&frame, sender, seq, size_of(seq));
            next[sender as usize] += 1;
        }
        next
    });
    let senders = spawn_senders(&sink, 4, 200, |_, seq| size_of(seq));
    for sender in senders {
        sender.await.unwrap();
    }
    sink.close();
    let refused = send(&*sink, 9, &payload(9, 0, 64)).await.unwrap_err();
    assert!(refused.contains("closed"), "{refused}");
    assert_eq!(
        reader.await.unwrap(),
        [200; 4],
        "every accepted frame arrived before end-of-stream"
    );
}

#[tokio::test]
async fn sink_still_sends_after_the_source_sees_end_of_stream() {
    // A peer that shut down its write side (half-close) still gets replies:
    // end-of-stream on the read half closes nothing on the write half.
    let (mut connection, mut peer) = connect(TcpTransport::default()).await;
    peer.socket.shutdown().await.unwrap();
    let received = std::future::poll_fn(|cx| connection.source.poll_recv(cx)).await;
    assert!(
        matches!(received, Ok(None)),
        "end-of-stream, cleanly: {received:?}"
    );
    drop(connection.source);
    send(&*connection.sink, 1, &payload(1, 0, 100))
        .await
        .unwrap();
    let frame = peer.frame().await.expect("the reply arrives");
    check(&frame, 1, 0, 100);
    connection.sink.close();
    assert!(peer.frame().await.is_none(), "then end-of-stream");
}

#[tokio::test]
async fn small_frames_of_other_calls_pass_a_large_frame_sent_in_pieces() {
    let (connection, mut peer) = connect(TcpTransport::default()).await;
    let sink = Arc::clone(&connection.sink);
    let large = (64 << 20) - 64; // with its head, under the test's limit
                                 // Each send returns once its frame is queued; the peer reads nothing
                                 // yet, so the large frame is far from out when the others are sent.
    send(&*sink, 1, &payload(1, 0, large)).await.unwrap();
    send(&*sink, 2, &payload(2, 0, 32)).await.unwrap();
    send(&*sink, 1, &payload(1, 1, 32)).await.unwrap();
    send(&*sink, 0, &payload(0, 0, 32)).await.unwrap();
    let mut arrived = Vec::new();
    for _ in 0..4 {
        let frame = peer.frame().await.unwrap();
        let sender = frame.call_id as u32;
        let len = frame.payload.as_ref().unwrap().len();
        let seq = u32::from(sender == 1 && len == 32);
        check(&frame, sender, seq, len);
        arrived.push((sender, len));
    }
    // Call 1's small frame stays behind its large one.
    assert_eq!(arrived, [(2, 32), (0, 32), (1, large), (1, 32)]);
}
