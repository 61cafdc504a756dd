//! Setting up connections on a real device: a listener's admission
//! control (past its connection limit, over its pinned-memory budget, or
//! given a hello beyond its limits, a client is refused before anything is
//! allocated for it and told why; the listener keeps serving the others,
//! and a closed connection gives its share back), set-ups that hold no
//! thread while a client stalls, and the deployment options (ACK timeout,
//! type of service, source address).
//!
//! They use one device; the two-host suite leaves them out.

mod common;

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{send_queue_depth, TestEnv, IDLE_PER_END, PINNED_PER_END};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport_rdma::proto::Hello;
use transport_rdma::verbs::{
    CmId, CompletionQueue, EventChannel, ProtectionDomain, QpCapabilities, QueuePair,
};
use transport_rdma::{RdmaListener, RdmaStream, RdmaTransport};

/// Accepts streams and echoes them, until dropped.
fn echo_server(mut listener: RdmaListener) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = stream.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    })
}

/// Binds `server` on the test device and echoes what its clients send;
/// returns the listener's address and the serving task.
async fn serve_echo(
    server: &RdmaTransport,
    env: &TestEnv,
) -> (String, tokio::task::JoinHandle<()>) {
    let listener = server.bind_stream(&env.local_listen()).await.unwrap();
    let addr = listener.local_addr().to_string();
    (addr, echo_server(listener))
}

async fn echoes(stream: &mut RdmaStream) {
    stream.write_all(b"ping").await.expect("writes");
    let mut back = [0; 4];
    tokio::time::timeout(Duration::from_secs(30), stream.read_exact(&mut back))
        .await
        .expect("the echo hung")
        .expect("reads the echo");
    assert_eq!(&back, b"ping");
}

/// Writes `len` bytes on `stream` while reading them back from the echo
/// server, and checks them; returns the stream.
async fn echoes_bytes(stream: RdmaStream, len: u32) -> RdmaStream {
    let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let (mut reading, mut writing) = tokio::io::split(stream);
    let sent = bytes.clone();
    let writer = tokio::spawn(async move {
        writing.write_all(&sent).await.expect("writes");
        writing
    });
    let mut back = vec![0; bytes.len()];
    tokio::time::timeout(Duration::from_secs(60), reading.read_exact(&mut back))
        .await
        .expect("the echo hung")
        .expect("reads the echo");
    assert!(back == bytes, "the {len}-byte echo came back changed");
    reading.unsplit(writer.await.unwrap())
}

fn refused(result: std::io::Result<RdmaStream>, says: &str) {
    let err = result.expect_err("connected past a limit");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    let text = err.to_string();
    assert!(text.contains(says), "{text:?} does not say {says:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn past_its_connection_limit_a_listener_refuses_and_says_why() {
    let env = TestEnv::from_env();
    let server = RdmaTransport::default().max_connections(2);
    let (addr, _serving) = serve_echo(&server, &env).await;
    let mut first = RdmaStream::connect(&addr).await.expect("first connects");
    let mut second = RdmaStream::connect(&addr).await.expect("second connects");
    refused(
        RdmaStream::connect(&addr).await,
        "the server has its maximum of 2 connections",
    );
    echoes(&mut first).await;
    echoes(&mut second).await;
    // A closed connection gives its place back (once the server's end is
    // gone: its echo sees EOF and drops it).
    first.shutdown().await.unwrap();
    drop(first);
    let started = Instant::now();
    let mut third = loop {
        match RdmaStream::connect(&addr).await {
            Ok(stream) => break stream,
            Err(e) if started.elapsed() < Duration::from_secs(20) => {
                assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the closed connection's place never came back: {e}"),
        }
    };
    echoes(&mut third).await;
    echoes(&mut second).await;
}

/// A listener's budget counts each connection at what the listener's own
/// settings let it pin, whatever the client announces: a client
/// announcing a 16 MiB region (16 times the listener's) and the largest
/// ring costs it no more than a default one, as the connection's regions
/// and staging are the smaller of the two sides' and its send slots no
/// more nor larger than its own ring's. Past the budget, a client is
/// refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_listener_counts_a_greedy_client_at_its_own_settings_and_refuses_past_its_budget() {
    let env = TestEnv::from_env();
    // Room for one default connection, not two.
    let budget = PINNED_PER_END + (1 << 20);
    let server = RdmaTransport::default().max_pinned_bytes(budget);
    let (addr, _serving) = serve_echo(&server, &env).await;
    let mut greedy = RdmaTransport::default()
        .ring(256, 64 << 10)
        .region_len(16 << 20)
        .connect_stream(&addr)
        .await
        .expect("a greedy client costs what a default one does");
    echoes(&mut greedy).await;
    // A frame larger than half the connection's 1 MiB regions goes in
    // chunks, from either side.
    let _greedy = echoes_bytes(greedy, 3_000_000).await;
    // The budget is taken now: a default client does not fit.
    refused(
        RdmaStream::connect(&addr).await,
        &format!("the server's budget of {budget} bytes"),
    );
}

/// A server sends from at most its own ring's slots, of at most its own
/// slot size, however large a ring the client announces: a client with
/// the largest ring the server accepts (256 slots of 64 KiB) costs it 72
/// send slots of 8 KiB with the control and chunk slots (576 KiB), not
/// 264 of 64 KiB (16.5 MiB), and fits a budget that mirroring its ring
/// would not. Frames between the two slot sizes go from the server by its
/// region.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_client_announcing_a_larger_ring_costs_the_server_no_more_send_slots_than_its_own() {
    let env = TestEnv::from_env();
    // The server's ring (512 KiB) and region (1 MiB), staging for the
    // client's region (1 MiB) and its send slots (576 KiB): 3.1 MiB;
    // with send slots as many and as large as the client's ring, 19 MiB.
    let budget = 4 << 20;
    let server = RdmaTransport::default().max_pinned_bytes(budget);
    let (addr, _serving) = serve_echo(&server, &env).await;
    let mut largest = RdmaTransport::default()
        .ring(256, 64 << 10)
        .connect_stream(&addr)
        .await
        .expect("a client with a 256-slot ring of 64 KiB slots fits the server's budget");
    echoes(&mut largest).await;
    // Larger than the server's slots, smaller than the client's.
    let _largest = echoes_bytes(largest, 40_000).await;
    let dump = transport_rdma::debug_dump();
    assert!(
        (114..306).contains(&send_queue_depth(&dump, &addr, false)),
        "{dump}"
    );
    assert!(send_queue_depth(&dump, &addr, true) >= 306, "{dump}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_hello_beyond_the_servers_limits_or_no_listener_is_refused_with_a_reason() {
    let env = TestEnv::from_env();
    let server = RdmaTransport::default().max_peer(64, 8192, 1 << 20);
    let (addr, _serving) = serve_echo(&server, &env).await;
    let big_region = RdmaTransport::default().region_len(2 << 20);
    refused(
        big_region.connect_stream(&addr).await,
        "did not accept this side's hello",
    );
    let mut fine = RdmaStream::connect(&addr).await.expect("connects");
    echoes(&mut fine).await;
    // Nobody listens on port 1.
    refused(
        RdmaStream::connect(&format!("rdma://{}:1", env.ip)).await,
        "nothing listens there",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn connections_with_an_ack_timeout_and_a_type_of_service_carry_data() {
    let env = TestEnv::from_env();
    // Each option is set where the connection manager takes it (ToS before
    // the route and the listen, the ACK timeout before connect and accept):
    // set elsewhere, rdma_set_option fails and so does the set-up.
    let cfg = RdmaTransport::default()
        .ack_timeout(Some(14))
        .type_of_service(Some(32));
    let (addr, _serving) = serve_echo(&cfg, &env).await;
    let mut stream = cfg.connect_stream(&addr).await.expect("connects");
    echoes(&mut stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn connections_from_a_chosen_source_address() {
    let env = TestEnv::from_env();
    let listener = RdmaListener::bind(&env.local_listen()).await.unwrap();
    let addr = listener.local_addr().to_string();
    let _serving = echo_server(listener);
    // From the device's own address: connects, and the server sees it.
    let mut stream = RdmaTransport::default()
        .source_address(Some(env.ip))
        .connect_stream(&addr)
        .await
        .expect("connects from the device's address");
    echoes(&mut stream).await;
    // From an address on no interface here: refused at once, saying so.
    let err = RdmaTransport::default()
        .source_address(Some("192.0.2.1".parse().unwrap()))
        .connect_stream(&addr)
        .await
        .expect_err("connected from an address this host does not have");
    assert!(err.to_string().contains("rdma_resolve_addr"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_storm_of_connect_requests_stays_within_the_budget_and_the_server_goes_on() {
    const STORM: usize = 100;
    const FIT: u64 = 10;
    let env = TestEnv::from_env();
    let server = RdmaTransport::default()
        .max_handshakes(8)
        .max_pinned_bytes(FIT * PINNED_PER_END);
    let (addr, _serving) = serve_echo(&server, &env).await;
    let attempts = (0..STORM).map(|_| {
        let addr = addr.clone();
        tokio::spawn(async move { RdmaStream::connect(&addr).await })
    });
    let results = tokio::time::timeout(
        Duration::from_secs(120),
        futures::future::join_all(attempts),
    )
    .await
    .expect("connect attempts hung");
    let mut connected = Vec::new();
    let mut reasons = std::collections::BTreeMap::<String, usize>::new();
    for result in results {
        match result.unwrap() {
            Ok(stream) => connected.push(stream),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
                let text = e.to_string();
                let reason = if text.contains("budget") {
                    "pinned budget"
                } else if text.contains("setting up its maximum") {
                    "handshakes"
                } else {
                    panic!("refused without a reason: {text}")
                };
                *reasons.entry(reason.to_string()).or_default() += 1;
            }
        }
    }
    eprintln!(
        "{STORM} connects at once: {} connected, refused: {reasons:?}",
        connected.len()
    );
    assert!(
        !connected.is_empty() && connected.len() as u64 <= FIT,
        "{} connected with room for {FIT}",
        connected.len()
    );
    // Every admitted connection works.
    for stream in &mut connected {
        echoes(stream).await;
    }
}

/// A listener that reads rendezvous transfers counts the rendezvous pool
/// its connections share once in its budget (a peer can fill it with
/// announcements), whatever their number; one that does not, counts none
/// and takes no announcement (`bad_peer.rs`). A pool larger than the
/// whole budget is refused when listening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_listener_reading_rendezvous_counts_its_shared_pool_once() {
    use rpc_core::transport::{FrameLimits, Transport};
    let env = TestEnv::from_env();
    let limits = FrameLimits {
        max_frame_len: 1 << 20,
    };
    let pool = 64 << 20;
    let reading = |budget| {
        RdmaTransport::default()
            .max_pinned_bytes(budget)
            .rendezvous_threshold(Some(transport_rdma::MEASURED_RENDEZVOUS_THRESHOLD))
            .rendezvous_pool(pool)
    };
    // One default connection and the pool, less a byte: a plain listener
    // admits the connection, a reading one does not.
    let budget = PINNED_PER_END + pool - 1;
    let plain = RdmaTransport::default().max_pinned_bytes(budget);
    for (server, fits) in [(plain, true), (reading(budget), false)] {
        let (mut listener, target) = env.listen_here(&server, limits).await;
        let accepting =
            tokio::spawn(async move { std::future::poll_fn(|cx| listener.poll_accept(cx)).await });
        let connected = server.connect(&target, limits).await;
        match (connected, fits) {
            (Ok(_), true) => {
                accepting.await.unwrap().expect("the server's end");
            }
            (Err(e), false) => {
                let text = e.to_string();
                assert!(
                    text.contains(&format!("budget of {budget} bytes")),
                    "{text}"
                );
                accepting.abort();
            }
            (Ok(_), false) => panic!("admitted past the budget its pool takes"),
            (Err(e), true) => panic!("refused though it fits without a pool: {e}"),
        }
    }

    // The pool and three connections: three reading connections fit (a
    // pool each would have fitted one), the fourth is refused.
    let budget = pool + 3 * PINNED_PER_END;
    let server = reading(budget);
    let (mut listener, target) = env.listen_here(&server, limits).await;
    let accepting = tokio::spawn(async move {
        let mut ends = Vec::new();
        for _ in 0..3 {
            ends.push(
                std::future::poll_fn(|cx| listener.poll_accept(cx))
                    .await
                    .expect("the server's end"),
            );
        }
        (listener, ends)
    });
    let mut clients = Vec::new();
    for i in 0..3 {
        let client = server.connect(&target, limits).await;
        clients.push(client.unwrap_or_else(|e| panic!("connection {i} refused: {e}")));
    }
    let (_listener, _ends) = accepting.await.unwrap();
    let Err(refused) = server.connect(&target, limits).await else {
        panic!("a fourth connection admitted over the budget");
    };
    assert!(
        refused
            .to_string()
            .contains(&format!("budget of {budget} bytes")),
        "{refused}"
    );

    // A pool larger than the budget: the listener says so at once.
    let too_small = reading(pool - 1);
    let authority = env.local_listen().replace("rdma://", "");
    let Err(err) = too_small.listen(&authority, limits).await else {
        panic!("listening with a pool over the budget");
    };
    assert!(
        err.to_string().contains("RdmaTransport::max_pinned_bytes"),
        "{err}"
    );
}

/// Over IPv6: a listener on `[addr]:0` (the guest gives the device's
/// netdev `fd77::N` next to `10.77.0.N`), a stream that carries data, and
/// both ends naming each other by their IPv6 addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn connections_over_ipv6() {
    let _env = TestEnv::from_env();
    let ip6: std::net::Ipv6Addr = std::env::var("RDMA_TEST_IP6")
        .expect(
            "RDMA_TEST_IP6 is not set: the device's netdev needs an IPv6 address \
             (cargo xtask rxe adds fd77::N; see xtask/src/rxe/job.sh)",
        )
        .parse()
        .expect("RDMA_TEST_IP6 is an IPv6 address");
    let mut listener = RdmaListener::bind(&format!("rdma://[{ip6}]:0"))
        .await
        .expect("listens on IPv6");
    let addr = listener.local_addr().to_string();
    assert!(addr.starts_with(&format!("rdma://[{ip6}]:")), "{addr}");
    let serving = tokio::spawn(async move {
        let (mut stream, peer) = listener.accept().await.expect("accepts");
        let (mut r, mut w) = stream.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
        peer
    });
    let mut stream = RdmaStream::connect(&addr)
        .await
        .expect("connects over IPv6");
    assert_eq!(stream.peer_addr(), addr);
    echoes(&mut stream).await;
    stream.shutdown().await.unwrap();
    let peer = serving.await.unwrap();
    assert!(
        peer.to_string().contains(&format!("[{ip6}]:")),
        "the server sees {peer}"
    );
}

/// A client that stalls its set-up: it sends a connect request with a
/// valid hello and never reads its channel's events. librdmacm confirms
/// the server's answer only when the client reads it (it moves the queue
/// pair and sends the confirmation then), so the server's set-up waits for
/// a confirmation that never comes. Blocking (run it on a thread of its
/// own); what it returns keeps the client alive. (Each has a queue pair of
/// its own: connect requests from one host naming the same queue pair
/// number would be rejected as stale connections.)
fn stalled_client(server: SocketAddr) -> Stalled {
    const STEP: Duration = Duration::from_secs(20);
    let channel = EventChannel::new().expect("event channel");
    let mut id = CmId::new(&channel).expect("cm id");
    id.resolve(server, STEP).expect("resolves the server");
    let pd = ProtectionDomain::new(&id).expect("protection domain");
    let cq = CompletionQueue::new(&id, 16).expect("completion queue");
    let qp = QueuePair::new(&mut id, &pd, &cq, &cq, QpCapabilities::default()).expect("queue pair");
    let hello = Hello {
        ring_slots: 64,
        initial_slots: 8,
        slot_size: 8192,
        region_len: 1 << 20,
        reads_rendezvous: false,
    };
    id.start_connect(&hello.to_bytes()).expect("rdma_connect");
    (qp, cq, pd, id)
}

/// A stalled client's objects, the queue pair first (dropped first).
type Stalled = (QueuePair, CompletionQueue, ProtectionDomain, CmId);

/// `n` stalled clients of `server`, once the server answered each: it
/// made their connections and waits for their confirmations.
async fn stall_set_ups(server: SocketAddr, n: usize) -> Vec<Stalled> {
    let stalling: Vec<_> = (0..n)
        .map(|_| std::thread::spawn(move || stalled_client(server)))
        .collect();
    let stalled: Vec<Stalled> = stalling
        .into_iter()
        .map(|t| t.join().expect("a stalling client"))
        .collect();
    for (_, _, _, id) in &stalled {
        // SAFETY: `ChannelFd` holds the channel, so its descriptor is
        // always the same and stays open while the AsyncFd lives.
        let fd = unsafe { tokio::io::unix::AsyncFd::register(ChannelFd(id.channel().clone())) }
            .map_err(|e| e.into_parts().1)
            .unwrap();
        let _answered = tokio::time::timeout(Duration::from_secs(20), fd.readable())
            .await
            .expect("the server never answered a stalling client")
            .unwrap();
    }
    stalled
}

/// A stalled client's event channel, to wait until it is readable (the
/// server answered) without reading it.
struct ChannelFd(std::sync::Arc<EventChannel>);

impl std::os::fd::AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.fd()
    }
}

/// What a burst of concurrent connects gave: the connected streams, and
/// how many were refused because the server's set-ups were all taken.
async fn burst(addr: &str, clients: usize) -> (Vec<RdmaStream>, usize) {
    let attempts = (0..clients).map(|_| {
        let addr = addr.to_string();
        tokio::spawn(async move { RdmaStream::connect(&addr).await })
    });
    let mut connected = Vec::new();
    let mut refused = 0;
    for result in futures::future::join_all(attempts).await {
        match result.expect("connect task") {
            Ok(stream) => connected.push(stream),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
                assert!(
                    e.to_string().contains("setting up its maximum"),
                    "refused for another reason: {e}"
                );
                refused += 1;
            }
        }
    }
    (connected, refused)
}

/// The process's registered bytes once unchanged for a second (at most 60 s).
async fn settled_registered_bytes() -> u64 {
    let mut last = transport_rdma::verbs::registered_bytes();
    let mut since = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(60);
    while since.elapsed() < Duration::from_secs(1) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = transport_rdma::verbs::registered_bytes();
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    last
}

/// The point of async set-ups: none holds a thread while it waits for the
/// peer. The runtime's one blocking thread is taken for the whole test,
/// and clients that never confirm the server's answer sit in their
/// set-ups for the server's (long) time limit; meanwhile a burst of good
/// clients (each set-up waiting for the connection manager, client and
/// server side) is served or refused for the set-up limit, promptly, and
/// the refused ones get in when they try again. Once the stalled set-ups
/// time out, they have freed their memory and given their set-up places
/// back.
#[test]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
fn set_ups_hold_no_thread_so_stalled_clients_do_not_hold_up_good_ones() {
    const STALLED: usize = 3;
    const ROOM: usize = 3;
    const GOOD: usize = 12;
    const STALL: Duration = Duration::from_secs(25);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let env = TestEnv::from_env();
    runtime.block_on(async {
        // The one blocking thread is busy until the end: a set-up that
        // needed one would wait for it.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let blocker = tokio::task::spawn_blocking(move || held.recv());
        let server = RdmaTransport::default()
            .max_handshakes(STALLED + ROOM)
            .connect_timeout(STALL);
        let (addr, _serving) = serve_echo(&server, &env).await;
        let server_addr: SocketAddr = addr.strip_prefix("rdma://").unwrap().parse().unwrap();

        // Memory the earlier tests of this process have not freed yet is
        // freed on the transport's teardown thread meanwhile: wait until
        // it stops going down (unchanged for a second), so that what the
        // stalled set-ups add is not hidden by it.
        let registered_before = settled_registered_bytes().await;
        let stalled = stall_set_ups(server_addr, STALLED).await;
        let stalled_at = Instant::now();
        let waiting = transport_rdma::verbs::registered_bytes().saturating_sub(registered_before);
        assert!(
            waiting >= STALLED as u64 * IDLE_PER_END,
            "the server holds {waiting} bytes for {STALLED} stalled set-ups"
        );

        // The server's other set-up places serve a burst, promptly.
        let (mut connected, refused) = tokio::time::timeout(
            Duration::from_secs(60),
            burst(&addr, GOOD),
        )
        .await
        .expect("the burst hung");
        let burst_took = stalled_at.elapsed();
        eprintln!(
            "{GOOD} connects beside {STALLED} stalled set-ups: {} connected, {refused} refused, in {burst_took:?}",
            connected.len()
        );
        // A refusal means all of the other places were in use, by set-ups
        // that then connected.
        assert!(connected.len() >= ROOM, "only {} connected", connected.len());
        for stream in &mut connected {
            echoes(stream).await;
        }
        // The refused ones get in on their own.
        for _ in 0..refused {
            let mut stream = tokio::time::timeout(Duration::from_secs(30), RdmaStream::connect(&addr))
                .await
                .expect("a connect hung")
                .expect("a refused client connects on its own");
            echoes(&mut stream).await;
            connected.push(stream);
        }
        assert!(
            stalled_at.elapsed() < STALL,
            "the good clients took {:?}, as long as the stalled set-ups' limit",
            stalled_at.elapsed()
        );

        // The stalled set-ups time out and free everything: with every
        // good connection closed, nothing of this test stays registered.
        for mut stream in connected {
            stream.shutdown().await.unwrap();
        }
        let deadline = stalled_at + STALL + Duration::from_secs(30);
        while transport_rdma::verbs::registered_bytes() > registered_before {
            assert!(
                Instant::now() < deadline,
                "{} bytes still registered after the stalled set-ups' time limit",
                transport_rdma::verbs::registered_bytes()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(stalled);
        // Their set-up places are back: as many clients as places, at
        // once, all connect.
        let (mut again, refused) = burst(&addr, STALLED + ROOM).await;
        assert_eq!(refused, 0, "set-up places were not given back");
        for stream in &mut again {
            echoes(stream).await;
        }
        release.send(()).unwrap();
        blocker.await.unwrap().unwrap();
    });
}

/// A listener dropped while clients sit in their set-ups ends those
/// set-ups at once: their memory is freed well before their time limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn dropping_the_listener_ends_its_set_ups_in_progress() {
    const STALLED: usize = 2;
    const STALL: Duration = Duration::from_secs(120);
    let env = TestEnv::from_env();
    let server = RdmaTransport::default().connect_timeout(STALL);
    let listener = server.bind_stream(&env.local_listen()).await.unwrap();
    let addr: SocketAddr = listener.local_addr().to_string()["rdma://".len()..]
        .parse()
        .unwrap();
    let registered_before = settled_registered_bytes().await;
    let stalled = stall_set_ups(addr, STALLED).await;
    let waiting = transport_rdma::verbs::registered_bytes().saturating_sub(registered_before);
    assert!(
        waiting >= STALLED as u64 * IDLE_PER_END,
        "the server holds {waiting} bytes for {STALLED} stalled set-ups"
    );

    let dropped_at = Instant::now();
    drop(listener);
    while transport_rdma::verbs::registered_bytes() > registered_before {
        assert!(
            dropped_at.elapsed() < Duration::from_secs(20),
            "{} bytes still registered {:?} after the listener was dropped (set-ups' limit {STALL:?})",
            transport_rdma::verbs::registered_bytes() - registered_before,
            dropped_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "set-ups freed {:?} after the listener was dropped",
        dropped_at.elapsed()
    );
    drop(stalled);
}
