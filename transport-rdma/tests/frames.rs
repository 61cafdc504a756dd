//! The RDMA transport at the frame level, on a real device: frames of every
//! size around every threshold (inline / one region chunk / chunked),
//! credits holding back a sender whose peer does not read, a receiver that
//! keeps every frame, small frames passing a 64 MiB one, a peer process
//! killed mid-stream.
//!
//! Needs `RDMA_TEST_DEVICE` / `RDMA_TEST_IP` (see `verbs_smoke.rs`). In a
//! two-host run `frames_across_the_wire` crosses the wire between the
//! guests; the other tests use one device and the two-host suite leaves
//! them out.

mod common;

use std::future::poll_fn;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{ChildGuard, TestEnv};
use rpc_core::frame::{OutBody, OutFrame, HEAD_LEN};
use std::sync::Arc;

use rpc_core::transport::{Connection, FrameLimits, FrameSink, Transport, TransportError};
use transport_rdma::RdmaTransport;

const DEVICE: &str = "needs an RDMA device: run through cargo xtask rxe";
const LIMITS: FrameLimits = FrameLimits {
    max_frame_len: (64 << 20) + 1024,
};
const STEP: Duration = Duration::from_secs(20);

/// A tiny configuration, so every path is taken with small frames: 8 slots
/// of 512 bytes (inline up to 480), a 8 KiB region (chunks up to 4 KiB).
fn tiny() -> RdmaTransport {
    RdmaTransport::default().ring(8, 512).region_len(8192)
}

async fn pair(env: &TestEnv, cfg: &RdmaTransport) -> (Connection, Connection) {
    env.pair(cfg, LIMITS).await
}

fn payload(seed: usize, len: usize) -> Bytes {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(7)) as u8)
        .collect::<Vec<u8>>()
        .into()
}

async fn send(sink: &Arc<dyn FrameSink>, id: u64, body: &Bytes) -> Result<(), TransportError> {
    let frame = OutFrame::new(id, OutBody::Message, Some(body), false).expect("frame");
    tokio::time::timeout(STEP, sink.send(&frame))
        .await
        .expect("send timed out")
}

async fn recv(conn: &mut Connection) -> Result<Option<Bytes>, TransportError> {
    match tokio::time::timeout(STEP, conn.source.recv()).await {
        Ok(r) => r,
        Err(_) => panic!(
            "receive timed out; state:\n{}",
            transport_rdma::debug_dump()
        ),
    }
}

fn check(frame: &Bytes, id: u64, body: &Bytes) {
    assert_eq!(
        frame.len(),
        HEAD_LEN + body.len(),
        "frame {id}: length differs"
    );
    assert!(
        frame[HEAD_LEN..] == body[..],
        "frame {id} ({} bytes of payload): contents differ",
        body.len()
    );
}

/// The call id of a received frame (bytes 4..12 of rpc-core's frame head).
fn frame_id(frame: &Bytes) -> usize {
    u64::from_le_bytes(frame[4..12].try_into().expect("a frame head")) as usize
}

/// Payload sizes whose frames are one byte below, at and above `limit`.
fn around(limit: usize) -> [usize; 3] {
    let p = limit - HEAD_LEN;
    [p - 1, p, p + 1]
}

/// Sends every size one way and back, pipelined (all sent before any is
/// read). Each frame is a call of its own (its index), so a small frame
/// may arrive before a large one sent earlier (it passes it between
/// chunks): every frame must arrive once, intact, in any order.
async fn round_trip_sizes(cfg: RdmaTransport, sizes: &[usize]) {
    round_trip_sizes_between(&cfg, &cfg, sizes).await
}

/// [`round_trip_sizes`] between a client made with `client` and a server
/// made with `server`.
async fn round_trip_sizes_between(client: &RdmaTransport, server: &RdmaTransport, sizes: &[usize]) {
    let env = TestEnv::from_env();
    let (client, mut server) = env.pair_between(client, server, LIMITS).await;
    let bodies: Vec<Bytes> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| payload(i, n))
        .collect();
    let sender = {
        let bodies = bodies.clone();
        let sink = std::sync::Arc::clone(&client.sink);
        tokio::spawn(async move {
            for (i, body) in bodies.iter().enumerate() {
                let frame = OutFrame::new(i as u64, OutBody::Message, Some(body), false).unwrap();
                sink.send(&frame).await.expect("client sends");
            }
        })
    };
    // The server echoes each frame's payload back as it arrives.
    let echo = tokio::spawn(async move {
        for _ in 0..bodies.len() {
            let frame = recv(&mut server)
                .await
                .expect("server receives")
                .expect("a frame");
            let id = frame_id(&frame);
            check(&frame, id as u64, &bodies[id]);
            let back = frame.slice(HEAD_LEN..);
            send(&server.sink, id as u64, &back)
                .await
                .expect("server sends");
        }
        server
    });
    let mut client = client;
    let mut seen = vec![false; sizes.len()];
    for _ in 0..sizes.len() {
        let frame = recv(&mut client)
            .await
            .expect("client receives")
            .expect("a frame");
        let id = frame_id(&frame);
        check(&frame, id as u64, &payload(id, sizes[id]));
        assert!(!std::mem::replace(&mut seen[id], true), "frame {id} twice");
    }
    sender.await.unwrap();
    let server = echo.await.unwrap();
    // Orderly close: the peer sees end-of-stream.
    client.sink.close();
    let mut server = server;
    assert!(recv(&mut server).await.expect("clean end").is_none());
}

/// A poll that finds frames in the completion queue wakes the task that
/// waited before it: that task's waker stays registered. rpc-core's
/// callers read for themselves while its reader task waits, and a caller
/// stops after its own response; once, the caller's poll dropped the
/// reader's waker, and the frames behind it waited for the keepalive
/// (20 s).
///
/// On a current-thread runtime the connection's driver runs only when the
/// test yields: the frames wait in the completion queue for the second
/// poll, as they did for the caller that raced the driver.
#[test]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
fn a_poll_that_finds_frames_wakes_the_task_that_waited() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll, Wake, Waker};

    #[derive(Default)]
    struct Counted(AtomicUsize);
    impl Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let env = TestEnv::from_env();
        let (client, mut server) = pair(&env, &RdmaTransport::default()).await;
        let reader = Arc::new(Counted::default());
        let reader_waker = Waker::from(Arc::clone(&reader));
        assert!(
            server
                .source
                .poll_recv(&mut Context::from_waker(&reader_waker))
                .is_pending(),
            "nothing was sent yet"
        );
        let bodies = [payload(0, 100), payload(1, 100)];
        for (id, body) in bodies.iter().enumerate() {
            let frame = OutFrame::new(id as u64, OutBody::Message, Some(body), false).unwrap();
            let mut cx = Context::from_waker(Waker::noop());
            assert!(
                matches!(client.sink.poll_send(&mut cx, &frame), Poll::Ready(Ok(()))),
                "a small frame is posted at once"
            );
        }
        // Blocks the runtime: no driver drains the completion queue.
        std::thread::sleep(Duration::from_millis(500));
        let first = match server
            .source
            .poll_recv(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(frame) => frame.expect("receives").expect("a frame"),
            Poll::Pending => panic!("the frames had not arrived 500 ms after they were posted"),
        };
        check(&first, 0, &bodies[0]);
        assert_eq!(
            reader.0.load(Ordering::SeqCst),
            1,
            "the task that waited first was not woken for the frame left behind"
        );
        let second = recv(&mut server).await.expect("receives").expect("a frame");
        check(&second, 1, &bodies[1]);
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn tiny_ring_every_threshold_both_ways() {
    let _ = DEVICE;
    let mut sizes = vec![0, 1, 2, 100];
    // inline max = 512 - 32; one chunk = 4096; region = 8192.
    for limit in [480, 4096, 8192, 3 * 4096] {
        sizes.extend(around(limit));
    }
    sizes.extend([100_000, 1 << 20]);
    // Many small ones: far more than the 8 slots.
    sizes.extend((0..300).map(|i| i % 700));
    round_trip_sizes(tiny(), &sizes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn default_config_every_threshold_up_to_64_mib() {
    // inline max = 8192 - 32; one region WRITE up to 512 KiB (half the
    // 1 MiB region); larger frames in chunks of 64 KiB.
    let mut sizes = vec![0, 1];
    for limit in [8160, 512 << 10, 1 << 20, 4 << 20] {
        sizes.extend(around(limit));
    }
    sizes.extend([(16 << 20) + 7, 64 << 20]);
    round_trip_sizes(RdmaTransport::default(), &sizes).await;
}

/// A small frame of another call sent after a 64 MiB frame on the same
/// connection arrives before it (it passes the frame between its chunks,
/// or while its rendezvous is read); one of the large frame's own call
/// arrives after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn small_frames_of_other_calls_pass_a_64_mib_frame() {
    let env = TestEnv::from_env();
    let large = payload(1, 64 << 20);
    let small = payload(2, 32);
    for (path, cfg) in [
        ("chunks", RdmaTransport::default()),
        (
            "rendezvous",
            RdmaTransport::default().rendezvous_threshold(Some(64 << 10)),
        ),
    ] {
        let (client, mut server) = pair(&env, &cfg).await;
        // Each send returns once its frame is queued, long before 64 MiB
        // are across.
        send(&client.sink, 1, &large)
            .await
            .expect("sends the large frame");
        send(&client.sink, 2, &small)
            .await
            .expect("sends a small frame");
        send(&client.sink, 1, &small)
            .await
            .expect("sends a small frame");
        let mut arrived = Vec::new();
        for _ in 0..3 {
            let frame = recv(&mut server).await.expect("receives").expect("a frame");
            let id = frame_id(&frame);
            check(
                &frame,
                id as u64,
                if frame.len() > 1024 { &large } else { &small },
            );
            arrived.push((id, frame.len() - HEAD_LEN));
        }
        assert_eq!(
            arrived,
            [(2, 32), (1, 64 << 20), (1, 32)],
            "{path}: (call, payload length) in order of arrival"
        );
    }
}

/// Thousands of small frames each way, pipelined, on the default ring:
/// many more SENDs than the send queue holds, sent inline (up to 256 bytes
/// with the header) and not. A completion lost or misapplied would leak
/// send slots and stall the sender, or hand out a slot still being sent
/// from and corrupt a frame; a post past the queue's depth would fail
/// (`ENOMEM`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn thousands_of_small_frames_around_the_inline_size_both_ways() {
    let sizes: Vec<usize> = [0, 8, 200, 223, 224, 225, 300, 1000, 3000]
        .into_iter()
        .cycle()
        .take(5000)
        .collect();
    round_trip_sizes(RdmaTransport::default(), &sizes).await;
}

/// A client sizes its send queue for its own ring, before it learns the
/// server's: into a server's larger ring it keeps at most its own ring's
/// worth of frames in flight. Were it to spend every credit the server
/// grants, a post past its queue's depth would fail (`ENOMEM`) and the
/// connection with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_client_with_a_smaller_ring_than_the_servers_sends_within_its_send_queue() {
    // Past 480 bytes a frame goes by WRITE and SEND: two requests each.
    let sizes: Vec<usize> = [0, 8, 200, 1000, 3000]
        .into_iter()
        .cycle()
        .take(3000)
        .collect();
    let client = RdmaTransport::default().ring(8, 512);
    let server = RdmaTransport::default().ring(256, 512);
    round_trip_sizes_between(&client, &server, &sizes).await;
}

/// Frames too large for a slot go by WRITE and SEND, two requests each,
/// but the send queue has room for a WRITE for only 16 data slots of 64
/// (`proto::REGION_FRAMES`): pipelined, more than that many wait for one
/// to complete, while frames that fit a slot pass them. A post past the
/// queue's depth would fail the connection (`ENOMEM`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn pipelined_region_frames_stay_within_the_send_queue() {
    let sizes: Vec<usize> = [9000, 20_000, 100, 12_000]
        .into_iter()
        .cycle()
        .take(2000)
        .collect();
    round_trip_sizes(RdmaTransport::default(), &sizes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn lowered_inline_threshold_sends_small_frames_by_write() {
    let cfg = tiny().inline_threshold(64);
    let mut sizes = vec![0, 1];
    sizes.extend(around(64));
    sizes.extend((0..100).map(|i| i * 13));
    round_trip_sizes(cfg, &sizes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_peer_that_does_not_read_holds_the_sender_back() {
    let env = TestEnv::from_env();
    let (client, mut server) = pair(&env, &tiny()).await;
    let body = payload(1, 100);
    // Send until a send blocks for a while: credits and send slots bound it.
    let mut sent = 0u64;
    loop {
        let frame = OutFrame::new(sent, OutBody::Message, Some(&body), false).unwrap();
        match tokio::time::timeout(Duration::from_millis(500), client.sink.send(&frame)).await {
            Ok(r) => {
                r.expect("send");
                sent += 1;
                assert!(
                    sent < 100,
                    "{sent} frames accepted while the peer reads nothing"
                );
            }
            Err(_) => break,
        }
    }
    assert!(sent >= 7, "only {sent} frames went before blocking");
    // Now read: the blocked sender goes on; everything arrives in order.
    let more = 200u64;
    let sink = std::sync::Arc::clone(&client.sink);
    let body2 = body.clone();
    let sender = tokio::spawn(async move {
        for i in sent..sent + more {
            let frame = OutFrame::new(i, OutBody::Message, Some(&body2), false).unwrap();
            sink.send(&frame).await.expect("send");
        }
    });
    for i in 0..sent + more {
        let frame = recv(&mut server).await.unwrap().unwrap();
        check(&frame, i, &body);
    }
    sender.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_receiver_keeping_every_frame_does_not_stall() {
    let env = TestEnv::from_env();
    let (client, mut server) = pair(&env, &tiny()).await;
    let n = 1000u64;
    let sink = std::sync::Arc::clone(&client.sink);
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let body = payload(i as usize, (i as usize * 7) % 470);
            let frame = OutFrame::new(i, OutBody::Message, Some(&body), false).unwrap();
            sink.send(&frame).await.expect("send");
        }
    });
    let mut kept = Vec::new();
    for i in 0..n {
        let frame = recv(&mut server).await.unwrap().unwrap();
        check(&frame, i, &payload(i as usize, (i as usize * 7) % 470));
        kept.push(frame);
    }
    sender.await.unwrap();
    // Still intact after all that traffic (zero-copy slots were not reused).
    for (i, frame) in kept.iter().enumerate() {
        check(frame, i as u64, &payload(i, (i * 7) % 470));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn dropping_a_connection_ends_the_peers_stream_and_fails_its_sends() {
    let env = TestEnv::from_env();
    let (client, mut server) = pair(&env, &RdmaTransport::default()).await;
    send(&client.sink, 1, &payload(0, 10)).await.unwrap();
    drop(client);
    let frame = recv(&mut server).await.unwrap().unwrap();
    check(&frame, 1, &payload(0, 10));
    assert!(recv(&mut server).await.unwrap().is_none());
    let started = Instant::now();
    loop {
        match send(&server.sink, 2, &payload(0, 10)).await {
            Err(_) => break,
            Ok(()) => {
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "sends keep succeeding"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// The child process of `a_killed_peer_process_fails_the_connection_promptly`:
/// connects to `FRAMES_CHILD_CONNECT`, sends frames forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn child_sender() {
    let target = std::env::var("FRAMES_CHILD_CONNECT")
        .expect("child_sender is the child half of a test: its parent runs it");
    let conn = RdmaTransport::default()
        .connect(&target, LIMITS)
        .await
        .expect("child connects");
    println!("child connected");
    let body = payload(3, 1000);
    for i in 0.. {
        let frame = OutFrame::new(i, OutBody::Message, Some(&body), false).unwrap();
        conn.sink.send(&frame).await.expect("child sends");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_killed_peer_process_fails_the_connection_promptly() {
    let env = TestEnv::from_env();
    let cfg = RdmaTransport::default();
    let (mut listener, target) = env.listen_here(&cfg, LIMITS).await;
    for round in 0..2 {
        let mut child = ChildGuard(
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--ignored", "--exact", "child_sender", "--nocapture"])
                .env("FRAMES_CHILD_CONNECT", &target)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("spawn the child"),
        );
        let mut conn = tokio::time::timeout(STEP, poll_fn(|cx| listener.poll_accept(cx)))
            .await
            .expect("the child connects in time")
            .expect("accepts the child");
        for _ in 0..50 {
            recv(&mut conn)
                .await
                .unwrap()
                .expect("a frame from the child");
        }
        let killed = Instant::now();
        child.kill();
        // Keep reading: what was sent may still arrive, then an error.
        let error = loop {
            match recv(&mut conn).await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("round {round}: a killed peer looked like an orderly close"),
                Err(e) => break e,
            }
        };
        eprintln!(
            "round {round}: failed {:?} after the kill: {error}",
            killed.elapsed()
        );
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "round {round}: the connection failed only {:?} after the kill",
            killed.elapsed()
        );
        assert!(
            send(&conn.sink, 1, &payload(0, 5)).await.is_err(),
            "sends must fail too"
        );
        // The listener still accepts: the next round connects again.
    }
}

/// Region frames each way with pauses long enough for both sides to give
/// the peer's region back and deregister their staging: every pause lets
/// go of exactly the two regions and the two stagings (8 KiB each here),
/// every round registers them again, and the frames arrive intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn regions_given_back_while_idle_are_asked_for_again() {
    const IDLE: Duration = Duration::from_millis(50);
    const REGIONS_AND_STAGINGS: u64 = 4 * 8192;
    let env = TestEnv::from_env();
    let cfg = tiny().release_idle_memory(Some(IDLE));
    let (mut client, mut server) = pair(&env, &cfg).await;
    let registered = transport_rdma::verbs::registered_bytes;
    for round in 0..6u64 {
        // One region chunk, then a chunked frame, each way.
        for (k, len) in [3000, 20_000].into_iter().enumerate() {
            let id = round * 2 + k as u64;
            let body = payload(id as usize, len);
            send(&client.sink, id, &body).await.expect("client sends");
            let frame = recv(&mut server)
                .await
                .expect("server receives")
                .expect("a frame");
            check(&frame, id, &body);
            send(&server.sink, id, &frame.slice(HEAD_LEN..))
                .await
                .expect("server echoes");
            let frame = recv(&mut client)
                .await
                .expect("client receives")
                .expect("an echo");
            check(&frame, id, &body);
        }
        let busy = registered();
        let released = rpc_test_support::eventually(Duration::from_secs(10), || {
            registered() == busy - REGIONS_AND_STAGINGS
        })
        .await;
        assert!(
            released,
            "round {round}: {} bytes registered after the pause, {busy} while busy: \
             expected both regions and both stagings ({REGIONS_AND_STAGINGS} bytes) let go",
            registered()
        );
    }
}

/// Bursts of frames that fit a slot but are too long to go inline, with a
/// release period of 1 ms: the client's send slots are let go in every
/// pause (and within a burst whenever the sender falls 1–2 ms behind) and
/// registered again by the next frame, while the driver's checks keep
/// coming with SENDs in flight. A release that deregistered memory a
/// posted SEND names would fail that SEND (a local protection error) and
/// the connection with it; every frame must arrive intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn send_slots_let_go_between_bursts_never_under_a_send_in_flight() {
    const BURSTS: u64 = 40;
    const FRAMES: u64 = 32;
    let env = TestEnv::from_env();
    let cfg = RdmaTransport::default().release_idle_memory(Some(Duration::from_millis(1)));
    let (client, mut server) = pair(&env, &cfg).await;
    let registered = transport_rdma::verbs::registered_bytes;
    for burst in 0..BURSTS {
        let bodies: Vec<(u64, Bytes)> = (0..FRAMES)
            .map(|i| {
                let id = burst * FRAMES + i;
                (id, payload(id as usize, 4000 + i as usize))
            })
            .collect();
        // The most registered right after a frame was posted: its send
        // slot's part, at least. Not only after the last one: a guest that
        // stalls for a period or two (two TCG guests on two host cores do)
        // may have let the slots go before that single look.
        let sending = async {
            let mut most = 0;
            for (id, body) in &bodies {
                send(&client.sink, *id, body)
                    .await
                    .unwrap_or_else(|e| panic!("burst {burst}: frame {id}: {e}"));
                most = most.max(registered());
            }
            most
        };
        let receiving = async {
            for (id, body) in &bodies {
                let frame = recv(&mut server)
                    .await
                    .unwrap_or_else(|e| panic!("burst {burst}: frame {id}: {e}"))
                    .expect("a frame");
                check(&frame, *id, body);
            }
        };
        let (busy, ()) = tokio::join!(sending, receiving);
        // The first burst grows the server's ring (kept), maybe after the
        // last frame was posted; from the second on only the client's
        // send slots come and go.
        if burst == 0 {
            continue;
        }
        let released =
            rpc_test_support::eventually(Duration::from_secs(5), || registered() < busy).await;
        assert!(
            released,
            "burst {burst}: {busy} bytes registered after its frames were posted (the most), \
             {} 5 s later: expected the client's send slots let go\n{}",
            registered(),
            transport_rdma::debug_dump()
        );
    }
}

/// Port of `frames_across_the_wire`'s server in a two-host run.
const WIRE_PORT: u16 = 7481;

/// In a two-host run, frames of every size cross the wire between the two
/// guests (server echoes, client checks), the client pausing now and then
/// long enough for both sides to give the regions back (asked for again
/// by the next large frame); with one host, over the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn frames_across_the_wire() {
    const IDLE: Duration = Duration::from_millis(100);
    let env = TestEnv::from_env();
    let cfg = RdmaTransport::default().release_idle_memory(Some(IDLE));
    let mut sizes = vec![0, 1, 100];
    for limit in [8160, 512 << 10, 1 << 20] {
        sizes.extend(around(limit));
    }
    sizes.push(3 << 20);
    match env.role {
        common::Role::Both => round_trip_sizes(cfg, &sizes).await,
        common::Role::Server => {
            let mut listener = cfg
                .listen(&format!("{}:{WIRE_PORT}", env.ip), LIMITS)
                .await
                .expect("listens");
            let mut conn = tokio::time::timeout(
                Duration::from_secs(120),
                poll_fn(|cx| listener.poll_accept(cx)),
            )
            .await
            .expect("the client came")
            .expect("accepts");
            let mut echoed = 0;
            while let Some(frame) = recv(&mut conn).await.expect("server receives") {
                send(&conn.sink, echoed, &frame.slice(HEAD_LEN..))
                    .await
                    .expect("server echoes");
                echoed += 1;
            }
            assert_eq!(echoed as usize, sizes.len(), "frames the server echoed");
        }
        common::Role::Client => {
            let mut conn = env.connect_to_peer(&cfg, WIRE_PORT, LIMITS).await;
            for (i, &n) in sizes.iter().enumerate() {
                send(&conn.sink, i as u64, &payload(i, n))
                    .await
                    .expect("client sends");
                let frame = recv(&mut conn)
                    .await
                    .expect("client receives")
                    .expect("an echo");
                check(&frame, i as u64, &payload(i, n));
                if i % 3 == 2 {
                    tokio::time::sleep(4 * IDLE).await;
                }
            }
            conn.sink.close();
            assert!(recv(&mut conn).await.is_ok(), "the server ends cleanly");
        }
    }
}

/// A payload whose encoder writes half of it, then panics (as a user's
/// `EncodePayload` may).
struct PanickingPayload(usize);

impl rpc_core::frame::EncodePayload for PanickingPayload {
    fn payload_len(&self) -> usize {
        self.0
    }
    fn encode_payload(&self, dst: &mut dyn bytes::BufMut) {
        dst.put_bytes(0xee, self.0 / 2);
        panic!("the payload's encoder panics (on purpose)");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_panicking_encoder_gives_back_its_slot_and_region_space() {
    let env = TestEnv::from_env();
    let (client, mut server) = pair(&env, &tiny()).await;
    // The first frame too large for a slot asks for the server's region
    // and waits for the grant: one goes first, so that every attempt below
    // finds the region there and runs its encoder at once.
    let first = payload(9, 2000);
    send(&client.sink, 9, &first).await.expect("sends");
    let frame = recv(&mut server).await.expect("receives").expect("a frame");
    check(&frame, 9, &first);
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    // Inline (8 send slots), one region chunk (8 KiB region), chunked (the
    // one heap frame's place): each 20 times, more than each has room for
    // if a panic kept what it was given.
    for payload_len in [100, 2000, 20_000] {
        let payload = PanickingPayload(payload_len);
        let frame = OutFrame::new(1, OutBody::Message, None, false)
            .expect("frame")
            .with_payload(&payload);
        for attempt in 0..20 {
            let sent = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                client.sink.poll_send(&mut cx, &frame)
            }));
            match sent {
                Err(_) => {}
                Ok(poll) => panic!(
                    "{payload_len}-byte payload, attempt {attempt}: the encoder did not run \
                     ({poll:?}): an earlier panic kept what it was given; state:\n{}",
                    transport_rdma::debug_dump()
                ),
            }
        }
    }
    // Every route still sends, and the peer gets exactly these frames.
    let bodies: Vec<Bytes> = [100, 2000, 20_000]
        .iter()
        .enumerate()
        .map(|(i, &n)| payload(i, n))
        .collect();
    for (i, body) in bodies.iter().enumerate() {
        send(&client.sink, i as u64, body)
            .await
            .expect("sends after the panics");
    }
    for (i, body) in bodies.iter().enumerate() {
        let frame = recv(&mut server).await.expect("receives").expect("a frame");
        check(&frame, i as u64, body);
    }
}
