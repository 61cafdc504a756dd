//! Hundreds of connections at once, each with its registered memory:
//! all carry calls (inline and region-sized), the memory pinned for them
//! stays within the documented budget per connection, and closing them
//! returns it.
//!
//! Needs `RDMA_TEST_DEVICE` / `RDMA_TEST_IP`. Uses one device; the
//! two-host suite leaves it out.

mod common;
use rpc_test_support as support;

use bytes::Bytes;
use common::{
    mem_available, open_fds, pinned_bytes, pinned_per_end, proc_kib, raise_fd_limit, within,
    TestEnv, GROWN_PER_END, IDLE_PER_END, PINNED_PER_END, SMALL_FRAMES_PER_END,
};
use futures::future::join_all;
use futures::StreamExt;
use rpc_core::transport::TransportError;
use rpc_core::{BytesCodec, Channel, Client, ConnectError, Request};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::TestServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport_rdma::verbs::{
    completion_channels, completion_queues, memory_registrations, protection_domains, queue_pairs,
    registered_bytes,
};
use transport_rdma::{RdmaStream, RdmaTransport};

/// Connections opened (each has both ends in this process: 2x the ends).
const CONNECTIONS: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn hundreds_of_connection_ends_carry_calls_within_their_memory_budget() {
    let env = TestEnv::from_env();
    transport_rdma::install();
    let server = TestServer::start(&env.local_listen(), |b| b).await;
    let before = pinned_bytes();
    let fds_before = open_fds();
    let registered_before = registered_bytes();
    let snapshot_before = Snapshot::take();

    let mut channels = Vec::with_capacity(CONNECTIONS);
    for i in 0..CONNECTIONS {
        let channel = Channel::connect(&server.address)
            .await
            .unwrap_or_else(|e| panic!("connection {i} of {CONNECTIONS}: {e}"));
        channels.push(channel);
    }
    // Each end holds one descriptor, its completion channel; its
    // connection manager events go to its device's watcher, which holds
    // the few descriptors all ends share (its runtime's, its channel: 5 in
    // the guest), and a server end still being accepted has its set-up's
    // channel. (Before the watcher read them, each end had its own event
    // channel: 4 a connection.)
    // Each end holds a queue pair, a completion queue and its channel;
    // every end on the device shares one protection domain, and the
    // registrations its ring's first slots lie in: chunks of 1, 1, 2, 4,
    // 8 and 16 pieces, then 16 each, 17 for 200 ends (208 pieces).
    assert_eq!(
        verbs_objects(),
        [2 * CONNECTIONS, 2 * CONNECTIONS, 2 * CONNECTIONS, 1, 17],
        "queue pairs, completion queues, completion channels, protection domains and memory \
         registrations held by {CONNECTIONS} connections ({} ends) on one device",
        2 * CONNECTIONS
    );
    assert_eq!(
        registered_bytes() - registered_before,
        208 * IDLE_PER_END,
        "200 ends' first ring slots in pieces of 17 registrations"
    );
    // A closed connection's pieces go to the next one: no registration
    // more (and the calls below check that no two ends share a piece).
    drop(channels.swap_remove(CONNECTIONS / 2));
    let closed = support::eventually(Duration::from_secs(30), || {
        queue_pairs() == 2 * CONNECTIONS - 2
    })
    .await;
    assert!(closed, "one connection closed: {:?}", verbs_objects());
    assert_eq!(
        memory_registrations(),
        17,
        "pieces given back, no chunk emptied"
    );
    channels.push(Channel::connect(&server.address).await.unwrap());
    assert_eq!(
        verbs_objects(),
        [2 * CONNECTIONS, 2 * CONNECTIONS, 2 * CONNECTIONS, 1, 17],
        "a new connection in the closed one's pieces"
    );
    println!(
        "{CONNECTIONS} connections at the default geometry, each while idle: {}",
        Snapshot::take().per_connection(&snapshot_before, CONNECTIONS)
    );
    let fds = open_fds() - fds_before;
    let fds_budget = 2 * CONNECTIONS + 16;
    println!("{CONNECTIONS} connections: {fds} descriptors opened (budget {fds_budget})");
    assert!(
        fds <= fds_budget,
        "{fds} descriptors opened for {CONNECTIONS} connections ({} ends), over {fds_budget}",
        2 * CONNECTIONS
    );
    // One inline and one region-sized call on every connection at once.
    let calls = channels.iter().enumerate().map(|(i, channel)| {
        let client = Client::new(channel.clone());
        async move {
            for size in [100usize, 200 << 10] {
                let payload = Bytes::from(vec![(i % 251) as u8; size]);
                let reply = client
                    .unary::<BytesCodec>("/test.Test/Echo", Request::new(payload.clone()))
                    .await
                    .unwrap_or_else(|s| panic!("connection {i}, {size} B: {s}"));
                assert_eq!(reply.into_inner(), payload, "connection {i}, {size} B");
            }
        }
    });
    within(
        Duration::from_secs(120),
        "every connection's calls",
        join_all(calls),
    )
    .await;

    let pinned = pinned_bytes() - before;
    let budget = 2 * CONNECTIONS as u64 * PINNED_PER_END;
    println!(
        "{CONNECTIONS} connections ({} ends): {} MiB pinned, budget {} MiB",
        2 * CONNECTIONS,
        pinned >> 20,
        budget >> 20
    );
    assert!(
        pinned <= budget,
        "{pinned} bytes pinned for {CONNECTIONS} connections, over the budget of {budget}"
    );
    assert!(
        pinned >= budget / 2,
        "only {pinned} bytes pinned for {CONNECTIONS} connections: is VmPin counting registrations?"
    );

    // Closing every connection returns the memory (each end's driver
    // lingers until its peer's close arrives).
    drop(channels);
    let released = support::eventually(std::time::Duration::from_secs(30), || {
        pinned_bytes() <= before + PINNED_PER_END
    })
    .await;
    assert!(
        released,
        "{} MiB still pinned 30 s after closing every connection",
        (pinned_bytes() - before) >> 20
    );
    let deallocated =
        support::eventually(Duration::from_secs(30), || verbs_objects() == [0; 5]).await;
    assert!(
        deallocated,
        "queue pairs, completion queues, completion channels, protection domains and memory \
         registrations left 30 s after closing every connection: {:?}",
        verbs_objects()
    );
    // And the server still takes new ones.
    let client = Client::new(Channel::connect(&server.address).await.unwrap());
    client
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from_static(b"again")),
        )
        .await
        .unwrap();
    server.stop().await;
}

/// Connections on a device share one protection domain, their peers
/// reaching their memory through windows bound to each connection's queue
/// pair (the region, rendezvous frames), or, when told not to share, hold
/// one each; either way inline, region and rendezvous frames all arrive
/// intact on every connection at once, and closing them deallocates every
/// domain. (That another connection's peer cannot use a window is
/// `bad_peer.rs`'s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn connections_share_one_protection_domain_per_device_unless_told_not_to() {
    const OPEN: usize = 4;
    let env = TestEnv::from_env();
    for shared in [false, true] {
        rpc_core::transport::register(Arc::new(
            RdmaTransport::default()
                .rendezvous_threshold(Some(64 << 10))
                .shared_protection_domain(shared),
        ));
        let server = TestServer::start(&env.local_listen(), |b| b).await;
        let mut channels = Vec::new();
        for i in 0..OPEN {
            channels.push(connect_retrying(&server.address, i).await.0);
        }
        let expected = if shared { 1 } else { 2 * OPEN };
        assert_eq!(
            protection_domains(),
            expected,
            "protection domains of {OPEN} connections (both ends here), shared: {shared}"
        );
        // Inline, through the region (8 KiB slots, rendezvous from 64 KiB),
        // by rendezvous: on every connection at once.
        let calls = channels.iter().enumerate().map(|(i, channel)| {
            let client = Client::new(channel.clone());
            async move {
                for size in [100, 32 << 10, 1 << 20] {
                    echo(&client, i, size).await;
                }
            }
        });
        let sent_before = transport_rdma::rendezvous_bytes_sent();
        within(
            Duration::from_secs(120),
            "every connection's calls",
            join_all(calls),
        )
        .await;
        let sent = transport_rdma::rendezvous_bytes_sent();
        let by_rendezvous = sent.0 + sent.1 - sent_before.0 - sent_before.1;
        assert!(
            by_rendezvous >= 2 * OPEN as u64 * (1 << 20),
            "only {by_rendezvous} bytes went by rendezvous (shared: {shared})"
        );
        drop(channels);
        server.stop().await;
        let deallocated =
            support::eventually(Duration::from_secs(30), || protection_domains() == 0).await;
        assert!(
            deallocated,
            "{} protection domains left 30 s after closing every connection (shared: {shared}); {} bytes registered; {}",
            protection_domains(),
            registered_bytes(),
            transport_rdma::debug_dump()
        );
    }
}

/// Memory is registered as a connection's frames need it: an end whose
/// frames all went inline (up to 256 bytes with their header), one call at
/// a time, pins its receive ring's first 8 slots alone; the first frame too
/// long to go inline registers the sender's send slots; the first too large
/// for a slot makes the sender register staging and the receiver its
/// region; many calls at once make the receiver register the rest of its
/// ring. Each once. Counted exactly, by the transport's count of
/// registered bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn memory_is_registered_as_the_frames_need_it() {
    let env = TestEnv::from_env();
    transport_rdma::install();
    nothing_registered_by_earlier_tests().await;
    let server = TestServer::start(&env.local_listen(), |b| b).await;
    let client = Client::new(Channel::connect(&server.address).await.unwrap());
    // Of an end, what only many frames at once register: the growth of
    // its ring and of its send slots.
    let fully_grown = GROWN_PER_END[GROWN_PER_END.len() - 1];
    let many_at_once = 2 * fully_grown;
    let region = PINNED_PER_END - many_at_once - SMALL_FRAMES_PER_END;

    echo(&client, 0, 100).await;
    assert_eq!(
        registered_bytes(),
        2 * IDLE_PER_END,
        "both ends of a connection whose frames all went inline"
    );
    echo(&client, 1, 4000).await;
    assert_eq!(
        registered_bytes(),
        2 * SMALL_FRAMES_PER_END,
        "both ends of a connection whose frames all fit a slot"
    );
    // A 200 KiB echo: each end registers staging for its frame and its
    // region for the peer's.
    let first = Instant::now();
    echo(&client, 2, 200 << 10).await;
    let first = first.elapsed();
    let one_at_a_time = 2 * (PINNED_PER_END - many_at_once);
    assert_eq!(
        registered_bytes(),
        one_at_a_time,
        "both ends, once a region frame went each way: region and staging \
         are {region} bytes an end"
    );
    let second = Instant::now();
    echo(&client, 3, 200 << 10).await;
    let second = second.elapsed();
    echo(&client, 4, 300 << 10).await;
    echo(&client, 5, 100).await;
    assert_eq!(
        registered_bytes(),
        one_at_a_time,
        "region and staging are registered once"
    );
    // Calls 32 at a time (inline): the server receives requests faster
    // than it answers them, and registers the rest of its ring (the client
    // may, with the answers). A burst may be answered as it comes: a few
    // tries.
    let mut bursts = 0;
    while registered_bytes() == one_at_a_time && bursts < 10 {
        join_all((0..32).map(|i| echo(&client, 6 + bursts * 32 + i, 100))).await;
        bursts += 1;
    }
    // What growing `parts` rings or send slots by steps (each end's
    // own) can have registered.
    let grown_by = |parts: u32| {
        let mut sums = vec![0];
        for _ in 0..parts {
            sums = sums
                .iter()
                .flat_map(|s| GROWN_PER_END.iter().map(move |g| s + g))
                .collect();
        }
        sums
    };
    let grown = registered_bytes();
    assert!(
        grown > one_at_a_time && grown_by(2).contains(&(grown - one_at_a_time)),
        "{grown} bytes registered after {bursts} bursts of 32 inline calls: expected one \
         or both ends' rings grown by steps of {GROWN_PER_END:?} bytes"
    );
    // Calls 64 at a time too long to go inline: send slots beyond the
    // first 8 are registered too, on one end or both; every part of both
    // ends at most once, whatever more comes.
    for round in 0..3 {
        join_all((0..64).map(|i| echo(&client, 1000 + round * 64 + i, 4000))).await;
        let now = registered_bytes();
        assert!(
            now >= grown && grown_by(4).contains(&(now - one_at_a_time)),
            "{now} bytes registered after 64 calls at once (round {round}): expected rings \
             and send slots grown by steps of {GROWN_PER_END:?}, each part once"
        );
    }
    // Not a check: what the first large frame each way pays (a round trip
    // and two registrations per direction).
    println!(
        "registered an end: {} KiB while frames went inline, {} KiB while they fit a slot; \
         a 200 KiB echo took {first:.1?} first (registering the regions), {second:.1?} next; \
         {} KiB more for both ends' rings and send slots after many calls at once",
        IDLE_PER_END >> 10,
        SMALL_FRAMES_PER_END >> 10,
        (registered_bytes() - one_at_a_time) >> 10
    );
    server.stop().await;
}

/// An idle connection keeps only its receive rings registered: its send
/// slots (registered for the first frame too long to go inline), staging
/// and the peer's region (for the first too large for a slot) are let go
/// once no such frame was sent for a while and none is in flight, and
/// registered again by the next ones; with the setting off, all are kept
/// while the connection lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn an_idle_connection_keeps_only_its_rings_registered() {
    const IDLE: Duration = Duration::from_millis(300);
    // Fits a slot (8 KiB), too long to go inline (256 B): each way.
    const SLOT_FRAME: usize = 4000;
    /// Both ends' receive rings doubled once (8 more slots of 8 KiB each).
    const RING_GROWTH: u64 = 2 * 8 * 8192;
    // Too large for a slot: the client's staging, the server's region.
    const REGION_FRAME: usize = 200 << 10;
    let env = TestEnv::from_env();
    nothing_registered_by_earlier_tests().await;
    for release in [None, Some(IDLE)] {
        let cfg = RdmaTransport::default().release_idle_memory(release);
        let mut listener = cfg.bind_stream(&env.local_listen()).await.unwrap();
        let addr = listener.local_addr().to_string();
        // Takes two rounds, answering each with a frame that fits a slot.
        let serving = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accepts");
            let mut pushed = vec![0; SLOT_FRAME + REGION_FRAME];
            for _ in 0..2 {
                stream.read_exact(&mut pushed).await.expect("reads a push");
                stream.write_all(&[9; SLOT_FRAME]).await.expect("answers");
            }
            let _ = stream.read(&mut [0; 1]).await;
        });
        let mut client = cfg.connect_stream(&addr).await.expect("connects");
        let round = async |client: &mut RdmaStream| {
            client.write_all(&[7; SLOT_FRAME]).await.expect("pushes");
            client
                .write_all(&vec![8; REGION_FRAME])
                .await
                .expect("pushes");
            let mut answer = vec![0; SLOT_FRAME];
            tokio::time::timeout(Duration::from_secs(30), client.read_exact(&mut answer))
                .await
                .expect("the answer hung")
                .expect("reads the answer");
            assert!(answer.iter().all(|&b| b == 9), "the answer's bytes");
        };
        let rings_only = registered_bytes();
        round(&mut client).await;
        let busy = registered_bytes();
        println!(
            "release {release:?}: {} KiB registered for both ends' rings, {} KiB more once \
             frames that fit a slot went each way and a region frame one way",
            rings_only >> 10,
            (busy - rings_only) >> 10
        );
        assert!(
            busy >= rings_only + (2 << 20),
            "{busy} bytes registered after a round, {rings_only} before it: expected at least \
             the client's staging and the server's region (1 MiB each) more"
        );
        tokio::time::sleep(4 * IDLE).await;
        match release {
            None => assert_eq!(
                registered_bytes(),
                busy,
                "memory deregistered with the setting off"
            ),
            Some(after) => {
                let released = support::eventually(Duration::from_secs(10), || {
                    registered_bytes() == rings_only
                })
                .await;
                assert!(
                    released,
                    "{} bytes registered {:?} after a round, {busy} right after it, \
                     {rings_only} before it: expected all but the rings deregistered \
                     after {after:?}",
                    registered_bytes(),
                    4 * IDLE + Duration::from_secs(10),
                );
            }
        }
        round(&mut client).await;
        // The same again (or kept); a receive ring may have grown meanwhile
        // (it doubles, 8 to 16 slots of 8 KiB, when its peer finds half of
        // it consumed: how fast each end reads decides, seen once in a
        // two-guest run).
        let again = registered_bytes();
        assert!(
            (busy..=busy + RING_GROWTH).contains(&again),
            "the second round registered {again} bytes, the first {busy}: expected the same \
             again, or a ring's growth ({RING_GROWTH} bytes) more"
        );
        drop(client);
        serving.await.expect("the server's end");
        let closed = support::eventually(Duration::from_secs(60), || registered_bytes() == 0).await;
        assert!(
            closed,
            "{} bytes registered after the close",
            registered_bytes()
        );
    }
}

/// A receive ring grown by many calls at once shrinks back to its first
/// slots once its peer keeps few calls in flight: after a pause with no
/// call at all (the peer's `Credit` messages consume the receives posted
/// in the slots let go), and again while calls go one at a time. The
/// rings grow again with the next burst, and every call is answered. And
/// after region frames and many calls too long to go inline at once, all
/// but the first ring slots is let go (the memory table's last row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_ring_grown_by_many_calls_at_once_shrinks_back_once_they_stop() {
    const IDLE: Duration = Duration::from_millis(300);
    let env = TestEnv::from_env();
    nothing_registered_by_earlier_tests().await;
    rpc_core::transport::register(Arc::new(
        RdmaTransport::default().release_idle_memory(Some(IDLE)),
    ));
    let server = TestServer::start(&env.local_listen(), |b| b).await;
    let client = Client::new(Channel::connect(&server.address).await.unwrap());
    // Frames of 100 B go inline: nothing but the rings is registered.
    echo(&client, 0, 100).await;
    let first_slots = registered_bytes();
    assert_eq!(first_slots, 2 * IDLE_PER_END, "both ends' first ring slots");
    let mut call = 1;
    for quiet_calls in [false, true] {
        // Bursts of 64 calls until a ring grows (a burst may be answered
        // as fast as it comes).
        let mut bursts = 0;
        while registered_bytes() == first_slots && bursts < 10 {
            join_all((0..64).map(|i| echo(&client, call + i, 100))).await;
            call += 64;
            bursts += 1;
        }
        let grown = registered_bytes();
        assert!(
            grown > first_slots,
            "no ring grew in {bursts} bursts of 64 calls ({grown} bytes registered)"
        );
        let since = Instant::now();
        let shrunk = support::eventually(Duration::from_secs(10), || {
            if quiet_calls {
                // One call at a time, on a task of its own.
                let client = client.clone();
                tokio::spawn(async move { echo(&client, 0, 100).await });
            }
            registered_bytes() == first_slots
        })
        .await;
        assert!(
            shrunk,
            "{} bytes registered 10 s after the bursts ({}), {grown} right after them, \
             {first_slots} for the first slots: expected the grown rings deregistered after {IDLE:?}",
            registered_bytes(),
            if quiet_calls { "calls one at a time meanwhile" } else { "no call meanwhile" }
        );
        // Not a check: how long it took.
        println!(
            "{} KiB of grown rings deregistered {:.1?} after the bursts ({})",
            (grown - first_slots) >> 10,
            since.elapsed(),
            if quiet_calls {
                "calls one at a time meanwhile"
            } else {
                "no call meanwhile"
            }
        );
        echo(&client, call, 100).await;
        call += 1;
    }
    // The last row of docs/benchmarks.md's memory table: region frames
    // both ways, then many calls at once too long to go inline. Staging,
    // the regions, the send slots and the grown rings all go once idle,
    // down to both ends' first ring slots.
    echo(&client, call, 200 << 10).await;
    call += 1;
    for _ in 0..3 {
        join_all((0..64).map(|i| echo(&client, call + i, 4000))).await;
        call += 64;
    }
    let busy = registered_bytes();
    let since = Instant::now();
    let released = support::eventually(Duration::from_secs(10), || {
        registered_bytes() == first_slots
    })
    .await;
    assert!(
        released,
        "{} bytes registered 10 s after region frames and 64 calls of 4,000 B at once \
         ({busy} right after): expected only both ends' first ring slots ({first_slots})",
        registered_bytes()
    );
    // Not a check: how much, and how long it took.
    println!(
        "{} KiB registered after region frames and 64 calls of 4,000 B at once: all but the \
         first ring slots ({} KiB) let go {:.1?} after",
        busy >> 10,
        first_slots >> 10,
        since.elapsed()
    );
    echo(&client, call, 4000).await;
    server.stop().await;
}

/// Connections of the scale test (issue 14's target).
const SCALE_CONNECTIONS: usize = 2000;
/// Its geometry, the smallest that still takes both paths: a ring of 8
/// slots of 512 B (frames up to 480 B go inline) and a 4 KiB region
/// (larger frames are RDMA-written into it, those over 2 KiB in chunks).
const SCALE_RING_SLOTS: u32 = 8;
const SCALE_SLOT_SIZE: u32 = 512;
const SCALE_REGION_LEN: u32 = 4096;
/// Payloads each connection echoes: inline, through the region in one
/// write, and region-sized (in chunks).
const SCALE_PAYLOADS: [usize; 3] = [100, 1500, SCALE_REGION_LEN as usize];
/// Connections making their calls at once. Not all 2,000: the server
/// answers calls in the order they come, so a call made while 2,000 wait
/// waits behind them (10 s and more in the guest, where a debug build
/// answered 130-400 calls a second), and the probe's bound would test the
/// host's load; with 256, its slowest answer took 2-3 s.
const SCALE_CONCURRENT_CALLERS: usize = 256;
/// How long closing all connections at once may take to give back their
/// memory and descriptors. Closing costs the kernel milliseconds of CPU
/// per end in the guest (destroying the QP, its queues and the cm_id,
/// deregistering), on the transport's teardown thread: 5-9 s for 4,000
/// ends in one guest, 30-66 s in each of two guests sharing the host's
/// cores. (When those drops ran on the runtime's workers, the two-guest
/// server answered nothing for over 20 s while they did.)
const SCALE_CLOSE_SECS: u64 = 180;
/// Connection set-ups in flight at once (the listener runs at most 64;
/// a refused one is retried anyway).
const SCALE_CONCURRENT_SETUPS: usize = 32;

/// Issue 14: 2,000 connections (4,000 ends in one process) with a small geometry, every
/// one echoing an inline and two region frames (256 connections calling at
/// once), then all closed at once. Asserts: registered memory while open within the budget of
/// 20 KiB per end (8 x 512 B ring, 16 x 512 B send slots, 4 KiB region,
/// 4 KiB staging: [`pinned_per_end`]); registered memory and open file
/// descriptors back to their baselines after close, and one descriptor per
/// end while open; the server answering a
/// probe connection throughout. Prints fds per connection and the
/// machine's memory taken per connection (queue pairs, completion queues
/// and connection-manager state in the kernel: not registered memory).
///
/// The transport's peer limits (`max_peer`) are the same small geometry.
///
/// Measured in the 2 GiB Soft-RoCE guest (debug build): 2 fds and
/// 215-235 KiB of the machine's memory per connection (both ends: 40 KiB
/// registered, ~150 KiB of kernel slab and vmalloc for the QPs, CQs and
/// cm_ids, the rest this process's heap), so 2,000 take ~450 MiB; 38 s in
/// all on a quiet host, up to 183 s with the host's cores busy (the
/// kernel's set-up and teardown work grows with the host's load).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn two_thousand_connections_carry_calls_and_give_back_memory_and_fds() {
    let started = Instant::now();
    let env = TestEnv::from_env();
    // What every connection pins once its calls went is measured after
    // all of them called: the calls take 90 s in two guests, so the first
    // connections' regions would be let go meanwhile (after 30 s idle) and
    // the figure would read low. Kept while open here; the release has a
    // test of its own.
    rpc_core::transport::register(Arc::new(
        RdmaTransport::default()
            .ring(SCALE_RING_SLOTS, SCALE_SLOT_SIZE)
            .region_len(SCALE_REGION_LEN)
            .max_peer(SCALE_RING_SLOTS, SCALE_SLOT_SIZE, SCALE_REGION_LEN)
            .release_idle_memory(None),
    ));
    // Each connection holds a few descriptors per end (event channels,
    // completion channels): make room for 8 per connection.
    // One per end open, and one more per set-up under way.
    let want_fds = 1024 + 4 * SCALE_CONNECTIONS as u64;
    let fd_limit = raise_fd_limit(want_fds);
    assert!(
        fd_limit >= want_fds,
        "open-file limit {fd_limit}, {want_fds} needed for {SCALE_CONNECTIONS} connections: raise it (ulimit -n)"
    );

    let server = TestServer::start(&env.local_listen(), |b| b).await;
    // The probe: one connection calling all along, from before the
    // baselines are taken to after every other connection closed.
    let probe = Client::new(connect_retrying(&server.address, usize::MAX).await.0);
    echo(&probe, usize::MAX, 100).await;
    let probe = Probe::start(probe);
    let before = Snapshot::take();

    // Open them, at most SCALE_CONCURRENT_SETUPS set-ups at once.
    let setup = Instant::now();
    let retries = Arc::new(AtomicUsize::new(0));
    let channels: Vec<Channel> = futures::stream::iter(0..SCALE_CONNECTIONS)
        .map(|i| {
            let (address, retries) = (&server.address, retries.clone());
            async move {
                let (channel, tries) = connect_retrying(address, i).await;
                retries.fetch_add(tries, Ordering::Relaxed);
                channel
            }
        })
        .buffer_unordered(SCALE_CONCURRENT_SETUPS)
        .collect()
        .await;
    let setup_time = setup.elapsed();
    let open = Snapshot::take();
    // Each end's first ring slots are a piece of a registration its
    // device's ends share (chunks of up to 16 pieces).
    let (ends_here, registrations) = (queue_pairs(), memory_registrations());
    println!("{ends_here} connection ends here, in {registrations} memory registrations");
    assert!(
        registrations * 8 <= ends_here,
        "{registrations} memory registrations for {ends_here} connection ends here: the first ring \
         slots are not shared"
    );

    // Every connection calls at once: inline, region, region in chunks.
    probe.next_phase();
    let calling = Instant::now();
    let clients: Vec<Client> = channels.iter().map(|c| Client::new(c.clone())).collect();
    // Two guests take ~90 s; the suite's limit of a test is 300 s.
    within(
        Duration::from_secs(240),
        "every connection's calls",
        futures::stream::iter(clients.iter().enumerate()).for_each_concurrent(
            SCALE_CONCURRENT_CALLERS,
            |(i, client)| async move {
                for size in SCALE_PAYLOADS {
                    echo(client, i, size).await;
                }
            },
        ),
    )
    .await;
    let calls_time = calling.elapsed();
    let called = Snapshot::take();

    let per_end = pinned_per_end(
        SCALE_RING_SLOTS.into(),
        SCALE_SLOT_SIZE.into(),
        SCALE_REGION_LEN.into(),
    );
    let budget = 2 * SCALE_CONNECTIONS as u64 * per_end;
    let pinned = open.registered.max(called.registered) - before.registered;
    println!(
        "{SCALE_CONNECTIONS} connections ({} ends, ring {SCALE_RING_SLOTS} x {SCALE_SLOT_SIZE} B, \
         region {SCALE_REGION_LEN} B): set up in {setup_time:.1?} ({} refusals retried), \
         {} calls in {calls_time:.1?}; registered {:.1} MiB (budget {:.1} MiB, {} KiB per end)",
        2 * SCALE_CONNECTIONS,
        retries.load(Ordering::Relaxed),
        SCALE_CONNECTIONS * SCALE_PAYLOADS.len(),
        pinned as f64 / (1 << 20) as f64,
        budget as f64 / (1 << 20) as f64,
        per_end >> 10,
    );
    println!(
        "per connection while open: {}",
        open.per_connection(&before, SCALE_CONNECTIONS)
    );
    println!(
        "set-up: {}; calls: {}",
        open.times(&before),
        called.times(&open)
    );
    assert!(
        pinned <= budget,
        "{pinned} bytes registered for {SCALE_CONNECTIONS} connections, over the budget of {budget}"
    );
    assert!(
        pinned >= budget / 2,
        "only {pinned} bytes registered for {SCALE_CONNECTIONS} connections: are they all open?"
    );
    // One descriptor per end, its completion channel (see
    // `hundreds_of_connection_ends_carry_calls_within_their_memory_budget`).
    let fds = open.fds - before.fds;
    assert!(
        fds <= 2 * SCALE_CONNECTIONS + 16,
        "{fds} descriptors open for {SCALE_CONNECTIONS} connections, over one per end"
    );

    // Close them all at once: memory and descriptors come back
    // (asynchronously: each end's driver lingers until its peer's close
    // arrives, then the teardown thread destroys its objects), while the
    // server keeps answering the probe.
    probe.next_phase();
    let closing = Instant::now();
    drop(clients);
    drop(channels);
    let released = support::eventually(Duration::from_secs(SCALE_CLOSE_SECS), || {
        registered_bytes() <= before.registered && open_fds() <= before.fds
    })
    .await;
    let close_time = closing.elapsed();
    let closed = Snapshot::take();
    println!("close: {}", closed.times(&called));
    // What the process keeps after close is the allocator's (and idle
    // blocking threads'): in three cycles of 1,000 connections it stayed
    // at ~28 MiB, not growing.
    // SAFETY: malloc_trim only returns free heap memory to the system.
    unsafe { libc::malloc_trim(0) };
    let trimmed = Snapshot::take();
    println!(
        "after malloc_trim, over the baseline: {}",
        trimmed.per_connection(&before, SCALE_CONNECTIONS)
    );
    // The kernel's share (QPs, CQs, cm_ids, their queues) comes back too:
    // 150 KiB per connection while open, ~5 KiB (slab caches) after.
    let kernel_open = open.kernel.saturating_sub(before.kernel);
    let kernel_left = trimmed.kernel.saturating_sub(before.kernel);
    assert!(
        kernel_left <= kernel_open / 4,
        "kernel slab + vmalloc {} KiB over the baseline after close, {} KiB while open",
        kernel_left >> 10,
        kernel_open >> 10
    );
    assert!(
        released,
        "60 s after closing every connection: {} bytes still registered over the baseline, \
         {} fds open (baseline {})",
        closed.registered.saturating_sub(before.registered),
        closed.fds,
        before.fds,
    );
    let probe = probe.stop().await;
    println!(
        "closed in {close_time:.1?}; left over the baseline: {}; probe: {probe}; total {:.1?}",
        closed.per_connection(&before, SCALE_CONNECTIONS),
        started.elapsed(),
    );
    // And the server still takes new connections.
    let again = Client::new(connect_retrying(&server.address, usize::MAX).await.0);
    echo(&again, usize::MAX, SCALE_REGION_LEN as usize).await;
    drop(again);
    server.stop().await;
}

/// The figures of one moment of the scale test.
struct Snapshot {
    /// `verbs::registered_bytes`.
    registered: u64,
    /// `VmPin`, bytes.
    vmpin: u64,
    fds: usize,
    /// `MemAvailable`, bytes: what the machine has left.
    available: u64,
    /// `VmRSS` of this process, bytes: its own memory (heap, tasks).
    rss: u64,
    /// `Slab` + `VmallocUsed` of the machine, bytes: kernel objects and
    /// the queues Soft-RoCE allocates.
    kernel: u64,
    /// CPU time of this process so far: user, system (clock ticks).
    cpu: (u64, u64),
    when: Instant,
}

impl Snapshot {
    fn take() -> Snapshot {
        Snapshot {
            registered: registered_bytes(),
            vmpin: pinned_bytes(),
            fds: open_fds(),
            available: mem_available(),
            rss: proc_kib("/proc/self/status", "VmRSS:") * 1024,
            kernel: (proc_kib("/proc/meminfo", "Slab:")
                + proc_kib("/proc/meminfo", "VmallocUsed:"))
                * 1024,
            cpu: cpu_ticks(),
            when: Instant::now(),
        }
    }

    /// Wall and CPU time from `base` to this one, as a line.
    fn times(&self, base: &Snapshot) -> String {
        let hz = 100.0; // USER_HZ
        format!(
            "{:.1?} wall, {:.1} s user + {:.1} s system CPU",
            self.when - base.when,
            (self.cpu.0 - base.cpu.0) as f64 / hz,
            (self.cpu.1 - base.cpu.1) as f64 / hz,
        )
    }

    /// What each of the connections adds to `base`, as a line.
    /// What `connections` connections took since `base`, each.
    fn per_connection(&self, base: &Snapshot, connections: usize) -> String {
        let n = connections as f64;
        let kib = |now: u64, then: u64| (now as f64 - then as f64) / n / 1024.0;
        format!(
            "{:.2} fds, {:.1} KiB registered ({:.1} KiB VmPin), {:.1} KiB of the machine's memory \
             ({:.1} KiB this process's RSS, {:.1} KiB slab + vmalloc)",
            (self.fds as f64 - base.fds as f64) / n,
            kib(self.registered, base.registered),
            kib(self.vmpin, base.vmpin),
            kib(base.available, self.available),
            kib(self.rss, base.rss),
            kib(self.kernel, base.kernel),
        )
    }
}

/// The longest the probe may wait for an answer before the server counts
/// as not serving: a bound on liveness, not a latency target (the slowest
/// answer is printed). Seen: up to 4.8 s, and once over 20 s while two
/// guests sharing the host's 2 cores closed their 2,000 connections.
const PROBE_BOUND: Duration = Duration::from_secs(60);

/// User and system CPU time of this process (`/proc/self/stat`), ticks.
fn cpu_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
    // Fields after the command's closing parenthesis; utime and stime are
    // the 14th and 15th of the whole line.
    let rest = &stat[stat.rfind(')').expect("a command in parentheses") + 2..];
    let field = |n: usize| -> u64 {
        rest.split_whitespace()
            .nth(n - 3)
            .and_then(|v| v.parse().ok())
            .expect("a number")
    };
    (field(14), field(15))
}

/// One connection calling the server all along the test (set-up, calls,
/// close), recording the slowest answer of each phase.
struct Probe {
    running: Arc<AtomicBool>,
    phase: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
    slowest_us: Arc<[AtomicU64; 3]>,
    task: tokio::task::JoinHandle<()>,
}

impl Probe {
    fn start(client: Client) -> Probe {
        let running = Arc::new(AtomicBool::new(true));
        let phase = Arc::new(AtomicUsize::new(0));
        let calls = Arc::new(AtomicUsize::new(0));
        let slowest_us: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
        let task = tokio::spawn({
            let (running, phase, calls, slowest_us) = (
                running.clone(),
                phase.clone(),
                calls.clone(),
                slowest_us.clone(),
            );
            async move {
                while running.load(Ordering::Relaxed) {
                    let (t, in_phase) = (Instant::now(), phase.load(Ordering::Relaxed));
                    tokio::time::timeout(PROBE_BOUND, echo(&client, usize::MAX, 100))
                        .await
                        .unwrap_or_else(|_| {
                            panic!("the server did not answer the probe within {PROBE_BOUND:?}, in phase {in_phase} (set-up, calls, close)")
                        });
                    slowest_us[in_phase]
                        .fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                    calls.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        });
        Probe {
            running,
            phase,
            calls,
            slowest_us,
            task,
        }
    }

    /// Set-up, then calls, then close.
    fn next_phase(&self) {
        self.phase.fetch_add(1, Ordering::Relaxed);
    }

    /// Stops it (failing the test if a call failed); returns its figures.
    async fn stop(self) -> String {
        self.running.store(false, Ordering::Relaxed);
        self.task.await.expect("the probe's calls all succeeded");
        let ms = |i: usize| self.slowest_us[i].load(Ordering::Relaxed) / 1000;
        format!(
            "{} calls answered, slowest {} ms during set-up, {} ms during calls, {} ms during close",
            self.calls.load(Ordering::Relaxed),
            ms(0),
            ms(1),
            ms(2)
        )
    }
}

/// Waits for earlier tests' connections, which may still be closing on
/// the teardown thread, to deregister their memory (at most 60 s).
async fn nothing_registered_by_earlier_tests() {
    let quiet = support::eventually(Duration::from_secs(60), || registered_bytes() == 0).await;
    assert!(
        quiet,
        "{} bytes still registered by earlier tests after 60 s",
        registered_bytes()
    );
}

/// Queue pairs, completion queues, completion channels, protection
/// domains and memory registrations this process holds.
fn verbs_objects() -> [usize; 5] {
    [
        queue_pairs(),
        completion_queues(),
        completion_channels(),
        protection_domains(),
        memory_registrations(),
    ]
}

/// Echoes `size` bytes on `client` (connection `i`) and checks the reply.
async fn echo(client: &Client, i: usize, size: usize) {
    let payload = bytes::Bytes::from(vec![(i % 251) as u8; size]);
    let reply = client
        .unary::<BytesCodec>("/test.Test/Echo", Request::new(payload.clone()))
        .await
        .unwrap_or_else(|s| panic!("connection {i}, {size} B: {s}"));
    assert_eq!(reply.into_inner(), payload, "connection {i}, {size} B");
}

/// Connects to `address`, retrying while the listener refuses because it
/// is setting up its maximum of connections at once (`ConnectionRefused`,
/// "try again"), for up to a minute; returns the channel and the retries.
async fn connect_retrying(address: &str, i: usize) -> (Channel, usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut retries = 0;
    loop {
        match Channel::connect(address).await {
            Ok(channel) => return (channel, retries),
            Err(e) if busy(&e) && Instant::now() < deadline => {
                retries += 1;
                tokio::time::sleep(Duration::from_millis(10 * retries.min(10) as u64)).await;
            }
            Err(e) => panic!("connection {i}: {e} (after {retries} retries)"),
        }
    }
}

/// Whether a connect failed only because the listener had too many
/// set-ups in flight.
fn busy(e: &ConnectError) -> bool {
    matches!(
        e,
        ConnectError::Transport {
            source: TransportError::Io { source, .. },
            ..
        } if source.kind() == std::io::ErrorKind::ConnectionRefused
            && source.to_string().contains("try again")
    )
}
