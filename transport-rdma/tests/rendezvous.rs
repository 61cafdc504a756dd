//! The rendezvous of large frames on the device: frames at and around the
//! threshold up to 256 MiB arrive byte-exact, in place in the receiver's
//! pool (no copy), their large payloads read by the NIC out of the sender's
//! own `Bytes` (no copy either), while small frames of other calls keep flowing; a full
//! pool makes transfers wait, then complete; the memory comes back.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{within, ChildGuard, Role, TestEnv};
use rpc_core::frame::{OutBody, OutFrame, HEAD_LEN};
use rpc_core::transport::{Connection, FrameLimits, FrameSink, Transport, TransportError};
use transport_rdma::RdmaTransport;

/// Longer than any one frame takes here (256 MiB: seconds), shorter than
/// the suite's limit of a test: a stalled transfer fails with the state of
/// every connection.
const STEP: Duration = Duration::from_secs(120);

fn payload(seed: usize, len: usize) -> Bytes {
    (0..len)
        .map(|i| (i.wrapping_mul(7) ^ seed.wrapping_mul(131) ^ (i >> 12)) as u8)
        .collect::<Vec<u8>>()
        .into()
}

async fn send(sink: &Arc<dyn FrameSink>, id: u64, body: &Bytes) -> Result<(), TransportError> {
    let frame = OutFrame::new(id, OutBody::Message, Some(body), false).expect("frame");
    within(STEP, "sending a frame", sink.send(&frame)).await
}

async fn recv(conn: &mut Connection) -> Bytes {
    within(STEP, "receiving a frame", conn.source.recv())
        .await
        .expect("no error")
        .expect("not the end")
}

/// Waits (up to 30 s) until no more bytes are registered than `before`;
/// fails the test, saying `after` what, if some stay.
async fn registered_back_to(before: u64, after: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while transport_rdma::verbs::registered_bytes() > before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} bytes still registered {after}",
            transport_rdma::verbs::registered_bytes() - before
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The call id of a received frame.
fn call(frame: &Bytes) -> u64 {
    u64::from_le_bytes(frame[4..12].try_into().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn frames_around_the_threshold_up_to_256_mib_arrive_exact_and_in_place() {
    let env = TestEnv::from_env();
    let threshold = 64 << 10;
    let cfg = RdmaTransport::default().rendezvous_threshold(Some(threshold));
    let limits = FrameLimits {
        max_frame_len: (256 << 20) + 4096,
    };
    let before = transport_rdma::verbs::registered_bytes();
    {
        let (client, mut server) = env.pair(&cfg, limits).await;
        let mut sizes = vec![
            threshold - HEAD_LEN - 1,
            threshold - HEAD_LEN,
            threshold - HEAD_LEN + 1,
            threshold,
            1 << 20,
            (16 << 20) + 3,
        ];
        if std::env::var_os("RDV_SKIP_HUGE").is_none() {
            sizes.push(256 << 20);
        }
        for (i, &len) in sizes.iter().enumerate() {
            let body = payload(i, len);
            let sink = Arc::clone(&client.sink);
            let sent = body.clone();
            let (in_place_before, copied_before) = transport_rdma::rendezvous_bytes_sent();
            let task = tokio::spawn(async move { send(&sink, i as u64 + 1, &sent).await });
            let got = recv(&mut server).await;
            task.await.unwrap().expect("sent");
            // The sender copied the frame's head only (into the
            // announcement): the NIC read the payload out of `body` itself.
            let (in_place, copied) = transport_rdma::rendezvous_bytes_sent();
            let sent_as = (in_place - in_place_before, copied - copied_before);
            let expected = if HEAD_LEN + len < threshold {
                (0, 0)
            } else if len >= transport_rdma::REGISTER_IN_PLACE_MIN {
                // The announcement carries the frame's head, at least 32 bytes.
                let head = HEAD_LEN.max(transport_rdma::proto::ANNOUNCE_PREFIX_LEN);
                ((HEAD_LEN + len - head) as u64, head as u64)
            } else {
                (0, (HEAD_LEN + len) as u64)
            };
            assert_eq!(
                sent_as, expected,
                "frame {i} of {len} bytes: (in place, copied)"
            );
            assert_eq!(got.len(), HEAD_LEN + len, "frame {i} length");
            assert!(
                got[HEAD_LEN..] == body[..],
                "frame {i} of {len} bytes differs"
            );
            let in_pool = transport_rdma::rendezvous_pool_contains(got.as_ptr());
            assert_eq!(
                in_pool,
                got.len() >= threshold,
                "frame {i} of {} bytes: in the pool {in_pool}",
                got.len()
            );
            eprintln!(
                "frame of {} bytes: exact, in the pool: {in_pool}",
                got.len()
            );
        }
    }
    // Both ends dropped: every segment and destination is deregistered.
    registered_back_to(before, "after the connection closed").await;
}

/// A destination the application released is kept registered and reused
/// for the next frame of its size: the frame arrives in the same memory,
/// and the receiving side registers nothing new for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_released_destination_is_reused_for_the_next_frame_of_its_size() {
    let env = TestEnv::from_env();
    let cfg = RdmaTransport::default().rendezvous_threshold(Some(64 << 10));
    let limits = FrameLimits {
        max_frame_len: (4 << 20) + 4096,
    };
    let (client, mut server) = env.pair(&cfg, limits).await;
    let mut previous: Option<usize> = None;
    // Three frames of one pool charge (whole pages), the first the shortest.
    for (i, len) in [(1 << 20) - 10, 1 << 20, (1 << 20) - 5]
        .into_iter()
        .enumerate()
    {
        let body = payload(i, len);
        send(&client.sink, i as u64 + 1, &body).await.expect("sent");
        let got = recv(&mut server).await;
        assert!(got[HEAD_LEN..] == body[..], "frame {i} differs");
        assert!(transport_rdma::rendezvous_pool_contains(got.as_ptr()));
        let at = got.as_ptr() as usize;
        if let Some(previous) = previous {
            assert_eq!(
                at, previous,
                "frame {i} did not reuse the released destination"
            );
        }
        previous = Some(at);
        drop(got);
        // The driver takes the released destination back.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A side with the rendezvous on talks to one with it off: large frames go
/// through the region both ways (the side that is off says in its hello
/// that it reads none, so the other announces nothing to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_side_without_the_rendezvous_gets_large_frames_through_the_region() {
    let env = TestEnv::from_env();
    let limits = FrameLimits {
        max_frame_len: (4 << 20) + 4096,
    };
    let off = RdmaTransport::default();
    let on = RdmaTransport::default().rendezvous_threshold(Some(64 << 10));
    let (mut listener, target) = env.listen_here(&off, limits).await;
    let accepting =
        tokio::spawn(async move { std::future::poll_fn(|cx| listener.poll_accept(cx)).await });
    let mut client = on.connect(&target, limits).await.expect("connects");
    let mut server = accepting.await.unwrap().expect("accepts");
    for i in 0..2 {
        let (sink, to) = match i {
            0 => (Arc::clone(&client.sink), &mut server),
            _ => (Arc::clone(&server.sink), &mut client),
        };
        let body = payload(i, 1 << 20);
        let sent = body.clone();
        let task = tokio::spawn(async move { send(&sink, 1, &sent).await });
        let got = recv(to).await;
        task.await.unwrap().expect("sent");
        assert!(got[HEAD_LEN..] == body[..], "frame {i} differs");
        assert!(
            !transport_rdma::rendezvous_pool_contains(got.as_ptr()),
            "frame {i} came by rendezvous to or from a side that reads none"
        );
    }
}

/// Port of `rendezvous_across_the_wire`'s server in a two-host run.
const WIRE_PORT: u16 = 7491;

/// Frames around the default threshold up to 64 MiB go by rendezvous from
/// the client to the server: byte-exact, in the receiver's pool. In a
/// two-host run they cross the wire from one guest to the other; with one
/// host both ends run in this process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn rendezvous_across_the_wire() {
    let env = TestEnv::from_env();
    let t = transport_rdma::MEASURED_RENDEZVOUS_THRESHOLD;
    let cfg = RdmaTransport::default().rendezvous_threshold(Some(t));
    let mut sizes = vec![t - HEAD_LEN - 1, t - HEAD_LEN, t, 1 << 20, 16 << 20];
    if std::env::var_os("RDV_SKIP_HUGE").is_none() {
        sizes.push(64 << 20);
    }
    let limits = FrameLimits {
        max_frame_len: (64 << 20) + 4096,
    };
    // The server checks each frame, then acknowledges it.
    let serve = |mut conn: Connection| {
        let sizes = sizes.clone();
        async move {
            for (i, &len) in sizes.iter().enumerate() {
                let got = recv(&mut conn).await;
                assert_eq!(got.len(), HEAD_LEN + len, "frame {i} length");
                assert!(got[HEAD_LEN..] == payload(i, len)[..], "frame {i} differs");
                assert_eq!(
                    transport_rdma::rendezvous_pool_contains(got.as_ptr()),
                    got.len() >= t,
                    "frame {i} of {} bytes",
                    got.len()
                );
                send(&conn.sink, i as u64, &Bytes::from_static(b"ok"))
                    .await
                    .expect("acknowledged");
            }
        }
    };
    // The client sends each frame and waits for its acknowledgement.
    let drive = |mut conn: Connection| {
        let sizes = sizes.clone();
        async move {
            for (i, &len) in sizes.iter().enumerate() {
                send(&conn.sink, i as u64, &payload(i, len))
                    .await
                    .expect("sent");
                let ack = recv(&mut conn).await;
                assert!(ack.ends_with(b"ok"), "frame {i} acknowledged");
            }
        }
    };
    match env.role {
        Role::Both => {
            let (client, server) = env.pair(&cfg, limits).await;
            tokio::join!(serve(server), drive(client));
        }
        Role::Server => {
            let mut listener = cfg
                .listen(&format!("{}:{WIRE_PORT}", env.ip), limits)
                .await
                .expect("listens");
            let conn = within(
                STEP,
                "waiting for the client guest",
                std::future::poll_fn(|cx| listener.poll_accept(cx)),
            )
            .await
            .expect("accepts");
            serve(conn).await;
        }
        Role::Client => drive(env.connect_to_peer(&cfg, WIRE_PORT, limits).await).await,
    }
}

/// A transport's connections share one rendezvous pool: with room for one
/// frame, a second connection's transfer waits while the first's frame is
/// held, then arrives once that is dropped, in the very destination it
/// left (kept as a spare, on the protection domain the device's
/// connections share). The memory comes back once both are closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn connections_share_one_pool_and_take_turns() {
    let env = TestEnv::from_env();
    const LEN: usize = 2 << 20;
    // Any frame fits the pool on its own: raised to the frame limit,
    // which charges as much as one frame of `LEN` and its head.
    let limits = FrameLimits {
        max_frame_len: LEN + 4096,
    };
    let cfg = RdmaTransport::default()
        .rendezvous_threshold(Some(64 << 10))
        .rendezvous_pool(4096);
    let before = transport_rdma::verbs::registered_bytes();
    {
        let (a_client, mut a_server) = env.pair(&cfg, limits).await;
        let (b_client, mut b_server) = env.pair(&cfg, limits).await;
        send(&a_client.sink, 1, &payload(1, LEN))
            .await
            .expect("A sent");
        let held = recv(&mut a_server).await;
        assert!(transport_rdma::rendezvous_pool_contains(held.as_ptr()));
        let b_sink = Arc::clone(&b_client.sink);
        let b_sending = tokio::spawn(async move { send(&b_sink, 2, &payload(2, LEN)).await });
        // B's frame waits for the room A's holds.
        assert!(
            tokio::time::timeout(Duration::from_secs(2), b_server.source.recv())
                .await
                .is_err(),
            "B's frame arrived while A's held the whole pool"
        );
        let at = held.as_ptr();
        assert!(held[HEAD_LEN..] == payload(1, LEN)[..]);
        drop(held);
        let got = recv(&mut b_server).await;
        b_sending.await.unwrap().expect("B sent");
        assert_eq!(call(&got), 2);
        assert!(got[HEAD_LEN..] == payload(2, LEN)[..]);
        assert_eq!(
            got.as_ptr(),
            at,
            "B's frame is in the destination A's left (a spare of the shared pool)"
        );
    }
    registered_back_to(before, "after both connections closed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn small_calls_flow_while_large_transfers_are_read_and_a_full_pool_waits() {
    let env = TestEnv::from_env();
    // A pool of four 2 MiB frames (each charged in whole pages, its head
    // included): four transfers at a time.
    let cfg = RdmaTransport::default()
        .rendezvous_threshold(Some(64 << 10))
        .rendezvous_pool(4 * ((2 << 20) + 4096));
    let limits = FrameLimits {
        max_frame_len: 8 << 20,
    };
    let before = transport_rdma::verbs::registered_bytes();
    {
        let (client, mut server) = env.pair(&cfg, limits).await;
        const LARGE: usize = 12;
        const SMALL: usize = 200;
        let sink = Arc::clone(&client.sink);
        let large = tokio::spawn(async move {
            for i in 0..LARGE {
                // Call ids 1000.. for the large frames.
                send(&sink, 1000 + i as u64, &payload(i, 2 << 20))
                    .await
                    .expect("large sent");
            }
        });
        let sink = Arc::clone(&client.sink);
        let small = tokio::spawn(async move {
            for i in 0..SMALL {
                send(&sink, 1 + i as u64, &payload(i, 32))
                    .await
                    .expect("small sent");
            }
        });
        // Hold every large frame: the pool fills (four frames), the rest
        // wait; small frames still arrive meanwhile.
        let mut held = Vec::new();
        let mut smalls = 0;
        let mut small_before_last_large = 0;
        while held.len() < 4 || smalls < SMALL {
            let got = recv(&mut server).await;
            if call(&got) >= 1000 {
                held.push(got);
            } else {
                smalls += 1;
                if held.len() < LARGE {
                    small_before_last_large += 1;
                }
            }
        }
        assert_eq!(held.len(), 4, "more large frames than the pool holds");
        // Nothing more arrives while the pool is full.
        assert!(
            tokio::time::timeout(Duration::from_secs(2), server.source.recv())
                .await
                .is_err(),
            "a frame arrived with the pool full"
        );
        // Releasing makes room: the rest arrive, exact and in order.
        let mut next = 4;
        for (i, frame) in held.drain(..).enumerate() {
            assert_eq!(call(&frame), 1000 + i as u64);
            assert!(frame[HEAD_LEN..] == payload(i, 2 << 20)[..]);
        }
        while next < LARGE {
            let got = recv(&mut server).await;
            assert_eq!(call(&got), 1000 + next as u64, "large frames in order");
            assert!(got[HEAD_LEN..] == payload(next, 2 << 20)[..]);
            assert!(transport_rdma::rendezvous_pool_contains(got.as_ptr()));
            next += 1;
        }
        large.await.unwrap();
        small.await.unwrap();
        eprintln!(
            "{small_before_last_large} of {SMALL} small frames arrived before the last large one"
        );
        assert_eq!(
            small_before_last_large, SMALL,
            "small frames waited for the pool"
        );
    }
    registered_back_to(before, "after the connection closed").await;
}

const HUGE: usize = 64 << 20;

/// Child: connects to `RDV_CHILD_CONNECT` and sends one 64 MiB frame by
/// rendezvous, then waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn child_sender() {
    let target = std::env::var("RDV_CHILD_CONNECT")
        .expect("child_sender is the child half of a test: its parent runs it");
    let cfg = RdmaTransport::default().rendezvous_threshold(Some(64 << 10));
    let limits = FrameLimits {
        max_frame_len: HUGE + 4096,
    };
    let conn = cfg.connect(&target, limits).await.expect("child connects");
    send(&conn.sink, 1, &payload(1, HUGE)).await.expect("sent");
    tokio::time::sleep(Duration::from_secs(600)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_sender_killed_mid_read_fails_the_connection_and_the_pool_comes_back() {
    let env = TestEnv::from_env();
    // Reads rendezvous transfers, as the child's side does.
    let cfg = RdmaTransport::default().rendezvous_threshold(Some(64 << 10));
    let limits = FrameLimits {
        max_frame_len: HUGE + 4096,
    };
    let (mut listener, target) = env.listen_here(&cfg, limits).await;
    let before = transport_rdma::verbs::registered_bytes();
    // The child's output, shown if it ends before it is killed.
    let log_path = std::env::temp_dir().join(format!("rdv-child-{}.log", std::process::id()));
    let log = std::fs::File::create(&log_path).expect("the child's log");
    let mut child = ChildGuard(
        Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "child_sender", "--nocapture"])
            .env("RDV_CHILD_CONNECT", &target)
            .stdout(log.try_clone().expect("the child's log"))
            .stderr(log)
            .spawn()
            .expect("spawn the child"),
    );
    let child_ended = |child: &mut ChildGuard| {
        child
            .0
            .try_wait()
            .expect("the child's status")
            .map(|status| {
                format!(
                    "the child sender ended ({status}) before it was killed:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                )
            })
    };
    let mut conn = within(
        STEP,
        "accepting the child's connection",
        std::future::poll_fn(|cx| listener.poll_accept(cx)),
    )
    .await
    .expect("accepts");
    // The READs run once the announcement is in and the destination is
    // taken (registered). (The whole test takes ~20 s when it passes.)
    // Seen in the connection's READs in flight: the registered bytes would
    // say it too, but an earlier test's connections may still be letting
    // their memory go meanwhile (on the teardown thread).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let reading = |dump: &str| {
        dump.split(" reads ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .is_some_and(|reads| reads != "0")
    };
    loop {
        if reading(&transport_rdma::debug_dump()) {
            break;
        }
        if let Some(ended) = child_ended(&mut child) {
            panic!("{ended}");
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no transfer started; the connection: {}",
            transport_rdma::debug_dump()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if let Some(ended) = child_ended(&mut child) {
        panic!("{ended}");
    }
    child.kill();
    let _ = std::fs::remove_file(&log_path);
    let started = tokio::time::Instant::now();
    match tokio::time::timeout(Duration::from_secs(120), conn.source.recv()).await {
        Ok(Err(e)) => eprintln!("after {:?}: {e}", started.elapsed()),
        Ok(Ok(frame)) => panic!(
            "got {:?} from a killed sender (killed too late?)",
            frame.map(|f| f.len())
        ),
        Err(_) => panic!("the connection did not fail within 120 s"),
    }
    drop(conn);
    drop(listener);
    registered_back_to(before, "after the connection failed").await;
}

/// Not a check: one-way push throughput by frame size through the region
/// (rendezvous off) and by rendezvous, printed for choosing the default
/// threshold (run by hand in the same guest boot as `ib_read_bw`, for
/// ratios; the device suite leaves `measure_*` out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn measure_push_throughput() {
    let (env, limits, sizes) =
        measuring(&[64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]);
    for (name, threshold) in [("region", None), ("rendezvous", Some(4096))] {
        let cfg = RdmaTransport::default().rendezvous_threshold(threshold);
        let (client, mut server) = env.pair(&cfg, limits).await;
        for &size in &sizes {
            let count = ((64 << 20) / size).clamp(4, 256);
            let body = payload(size, size);
            // Warm-up: one frame.
            send(&client.sink, 1, &body).await.unwrap();
            drop(recv(&mut server).await);
            let sink = Arc::clone(&client.sink);
            let started = std::time::Instant::now();
            let sender = tokio::spawn(async move {
                for i in 0..count {
                    send(&sink, 2 + i as u64, &body).await.unwrap();
                }
            });
            for _ in 0..count {
                drop(recv(&mut server).await);
            }
            let took = started.elapsed();
            sender.await.unwrap();
            let mbps = (count * size) as f64 / took.as_secs_f64() / 1e6;
            println!("@@push {name} {size} {count} {mbps:.1} MB/s");
        }
    }
}

/// For a measurement: the test's environment, limits admitting 64 MiB
/// frames, and the sizes to measure (`RDV_SIZES`, comma-separated, or
/// `default`).
fn measuring(default: &[usize]) -> (TestEnv, FrameLimits, Vec<usize>) {
    let env = TestEnv::from_env();
    let limits = FrameLimits {
        max_frame_len: (64 << 20) + 4096,
    };
    let sizes = match std::env::var("RDV_SIZES") {
        Ok(list) => list.split(',').map(|s| s.parse().unwrap()).collect(),
        Err(_) => default.to_vec(),
    };
    (env, limits, sizes)
}

/// What payload buffers save a sender: one-way pushes by rendezvous where
/// each frame's payload is written (copied from a prepared tensor, as an
/// application produces its gradient) into a fresh heap `Vec` (registered
/// where it lies for the transfer), against into a payload buffer from the
/// connection's pool (reused, read through a memory window). Run by hand
/// (prints `@@fill` lines; `RDV_SIZES` as above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn measure_push_from_payload_buffers() {
    let (env, limits, sizes) = measuring(&[256 << 10, 1 << 20, 4 << 20, 16 << 20]);
    let cfg = RdmaTransport::default().rendezvous_threshold(Some(64 << 10));
    let (client, mut server) = env.pair(&cfg, limits).await;
    for &size in &sizes {
        let count = ((64 << 20) / size).clamp(8, 256);
        let tensor = payload(size, size);
        for pooled in [false, true, false, true] {
            let sink = Arc::clone(&client.sink);
            let tensor = tensor.clone();
            let cpu_before = process_cpu();
            let started = std::time::Instant::now();
            let sender = tokio::spawn(async move {
                for i in 0..count {
                    let body = if pooled {
                        let mut buffer = payload_buffer(&sink, size).await;
                        buffer.copy_from_slice(&tensor);
                        buffer.freeze()
                    } else {
                        Bytes::from(tensor.to_vec())
                    };
                    send(&sink, 1 + i as u64, &body).await.unwrap();
                }
            });
            for _ in 0..count {
                drop(recv(&mut server).await);
            }
            let took = started.elapsed();
            sender.await.unwrap();
            let cpu = process_cpu() - cpu_before;
            let mbps = (count * size) as f64 / took.as_secs_f64() / 1e6;
            let cpu_per_mb = cpu.as_secs_f64() * 1e6 / ((count * size) as f64 / 1e6);
            let from = if pooled { "payload_buffer" } else { "heap_vec" };
            println!(
                "@@fill {from} {size} {count} {mbps:.1} MB/s, process CPU {cpu_per_mb:.0} us/MB"
            );
        }
    }
}

/// What a rendezvous sender pays per frame, by payload size: registering
/// the application's `Bytes` where they lie (and deregistering), against
/// copying them into a fresh registration (what it did before), and a
/// plain copy. Run by hand (prints `@@register` lines).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn measure_register_in_place_against_copy() {
    use transport_rdma::verbs::{Access, CmId, EventChannel, MemoryRegion, ProtectionDomain};
    let env = TestEnv::from_env();
    let channel = EventChannel::new().expect("event channel");
    let mut id = CmId::new(&channel).expect("cm id");
    id.bind(std::net::SocketAddr::new(env.ip, 0))
        .expect("binds to the device's address");
    let pd = ProtectionDomain::new(&id).expect("protection domain");
    for size in [
        32 << 10,
        64 << 10,
        128 << 10,
        256 << 10,
        1 << 20,
        4 << 20,
        16 << 20,
        64 << 20,
    ] {
        let body = payload(size, size);
        let rounds = ((256 << 20) / size).clamp(4, 256);
        let per = |f: &mut dyn FnMut()| {
            f(); // warm-up
            let started = std::time::Instant::now();
            for _ in 0..rounds {
                f();
            }
            started.elapsed().as_secs_f64() * 1e6 / rounds as f64
        };
        let in_place = per(&mut || {
            drop(transport_rdma::verbs::RegisteredBytes::new(&pd, body.clone()).expect("registers"))
        });
        let copied = per(&mut || {
            let mr = MemoryRegion::new(&pd, size, Access::LOCAL_WRITE | Access::REMOTE_READ)
                .expect("registers");
            mr.write_at(0, &body);
        });
        // The frame's head, copied into a registration of its own beside
        // a payload registered in place.
        let head = per(&mut || {
            let mr = MemoryRegion::new(&pd, 64, Access::LOCAL_WRITE | Access::REMOTE_READ)
                .expect("registers");
            mr.write_at(0, &body[..64]);
        });
        let mut plain = vec![0u8; size];
        let memcpy = per(&mut || {
            plain.copy_from_slice(&body);
            std::hint::black_box(&plain);
        });
        println!(
            "@@register {size} in_place_us {in_place:.1} head_registration_us {head:.1} copy_into_new_registration_us {copied:.1} memcpy_us {memcpy:.1}"
        );
    }
}

/// CPU time (user and system) this process has used.
fn process_cpu() -> Duration {
    // SAFETY: plain C struct, for which all-zero bytes are valid; the
    // pointer is valid for the call.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) }, 0);
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

async fn payload_buffer(sink: &Arc<dyn FrameSink>, len: usize) -> rpc_core::PayloadBuffer {
    within(STEP, "taking a payload buffer", sink.payload_buffer(len))
        .await
        .expect("a payload buffer")
}

/// Buffers from the connection's payload pool are read by the peer through
/// a memory window bound for the transfer: no copy, no registration per
/// call (the counter of bytes sent from the pool says so), for a whole
/// buffer and for a slice of one; a given-back buffer is handed out again
/// (the same memory); a full pool makes the next buffer wait until one is
/// given back; one larger than the pool is refused; below the threshold
/// buffers are heap memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn payload_buffers_are_read_through_a_window_with_no_copy() {
    let env = TestEnv::from_env();
    let threshold = 64 << 10;
    let cfg = RdmaTransport::default()
        .rendezvous_threshold(Some(threshold))
        .payload_pool(3 << 20);
    let limits = FrameLimits {
        max_frame_len: (4 << 20) + 4096,
    };
    let (client, mut server) = env.pair(&cfg, limits).await;
    let head = HEAD_LEN.max(transport_rdma::proto::ANNOUNCE_PREFIX_LEN);
    let mut previous = None;
    for (i, len) in [1 << 20, 1 << 20, (2 << 20) + 5].into_iter().enumerate() {
        let mut buffer = payload_buffer(&client.sink, len).await;
        let want = payload(i, len);
        buffer.copy_from_slice(&want);
        let at = buffer.as_ptr() as usize;
        if i == 1 {
            assert_eq!(
                previous,
                Some(at),
                "the given-back buffer is handed out again"
            );
        }
        previous = Some(at);
        let body = buffer.freeze();
        // The last one goes as a slice of its buffer.
        let body = if i == 2 { body.slice(5..) } else { body };
        let from_pool_before = transport_rdma::rendezvous_bytes_sent_from_pool();
        let (in_place_before, copied_before) = transport_rdma::rendezvous_bytes_sent();
        send(&client.sink, i as u64 + 1, &body).await.expect("sent");
        let got = recv(&mut server).await;
        assert!(got[HEAD_LEN..] == body[..], "frame {i} differs");
        assert!(transport_rdma::rendezvous_pool_contains(got.as_ptr()));
        assert_eq!(
            transport_rdma::rendezvous_bytes_sent_from_pool() - from_pool_before,
            (HEAD_LEN + body.len() - head) as u64,
            "frame {i}: all but the head read out of the payload buffer"
        );
        let (in_place, copied) = transport_rdma::rendezvous_bytes_sent();
        assert_eq!(
            (in_place - in_place_before, copied - copied_before),
            (0, head as u64),
            "frame {i}: nothing registered for the call, the head copied"
        );
        drop((got, body));
        // The peer's `Done` ends the transfer; then the buffer comes back.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The pool (3 MiB) holds a 2 MiB buffer and a 1 MiB one, not a third.
    let big = payload_buffer(&client.sink, 2 << 20).await;
    let small = payload_buffer(&client.sink, 1 << 20).await;
    let sink = Arc::clone(&client.sink);
    let waiting = tokio::spawn(async move { payload_buffer(&sink, 1 << 20).await.len() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "a buffer past the pool's budget waits"
    );
    drop(big);
    let got = within(STEP, "the waiting buffer, once one was given back", waiting)
        .await
        .unwrap();
    assert_eq!(got, 1 << 20);
    drop(small);

    let refused = client.sink.payload_buffer(4 << 20).await;
    let error = refused.expect_err("a buffer larger than the pool is refused");
    assert!(error.to_string().contains("payload_pool"), "{error}");

    // Below the threshold: heap memory, copied as any small frame is.
    let small = payload_buffer(&client.sink, 1000).await;
    let from_pool_before = transport_rdma::rendezvous_bytes_sent_from_pool();
    let body = small.freeze();
    send(&client.sink, 9, &body).await.expect("sent");
    let got = recv(&mut server).await;
    assert!(got[HEAD_LEN..] == body[..]);
    assert_eq!(
        transport_rdma::rendezvous_bytes_sent_from_pool(),
        from_pool_before
    );
}

/// Payload buffers through the RPC layer: a client's request written into
/// one from its `Channel`, echoed by a handler from one of the call's
/// connection (`Request::payload_buffer`): both go by rendezvous out of
/// the pools, byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn calls_send_payload_buffers_both_ways() {
    use rpc_core::{BytesCodec, Client, Request};
    let env = TestEnv::from_env();
    rpc_core::transport::register(Arc::new(
        RdmaTransport::default().rendezvous_threshold(Some(64 << 10)),
    ));
    let server = rpc_test_support::TestServer::start(&env.local_listen(), |b| b).await;
    let channel = rpc_core::Channel::connect(&server.address)
        .await
        .expect("connects");
    let client = Client::new(channel.clone());
    for len in [100, 1 << 20, (4 << 20) + 3] {
        let want = payload(len, len);
        let mut buffer = channel.payload_buffer(len).await.expect("a buffer");
        buffer.copy_from_slice(&want);
        let from_pool_before = transport_rdma::rendezvous_bytes_sent_from_pool();
        let echoed = client
            .unary::<BytesCodec>(
                "/test.Test/EchoInPayloadBuffer",
                Request::new(buffer.freeze()),
            )
            .await
            .expect("echoed")
            .into_inner();
        assert!(echoed == want, "{len} bytes echoed differ");
        let from_pool = transport_rdma::rendezvous_bytes_sent_from_pool() - from_pool_before;
        if len >= 64 << 10 {
            // Each way all but the frame's head (at most 32 bytes).
            assert!(
                from_pool >= 2 * (len as u64 - 32),
                "{len} bytes: {from_pool} sent from payload buffers, not both ways"
            );
        } else {
            assert_eq!(from_pool, 0, "{len} bytes: heap memory below the threshold");
        }
    }
    server.stop().await;
}
