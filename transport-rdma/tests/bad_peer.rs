//! Peers that break the transport's protocol, written with the raw verbs
//! layer: the server refuses or disconnects them, fails their connection
//! promptly, and keeps accepting good clients.

mod common;

use std::future::poll_fn;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::TestEnv;
use rpc_core::frame::{OutBody, OutFrame};
use rpc_core::transport::{Connection, FrameLimits, Listener, Transport, TransportError};
use transport_rdma::proto::{
    Announcement, Header, Hello, Kind, Segment, ANNOUNCE_PREFIX_LEN, FIRST, LAST,
};
use transport_rdma::verbs::{
    Access, CmId, CompletionQueue, EventChannel, MemoryRegion, ProtectionDomain, QpCapabilities,
    QueuePair, RemoteRegion,
};
use transport_rdma::RdmaTransport;

const LIMITS: FrameLimits = FrameLimits {
    max_frame_len: 1 << 20,
};
const STEP: Duration = Duration::from_secs(20);

/// What a raw client keeps alive while the server reacts (the memory of
/// its receives, and of its message if it sent one).
type Raw = (
    CmId,
    CompletionQueue,
    QueuePair,
    MemoryRegion,
    Option<MemoryRegion>,
);

/// Connects with `private_data` as the hello, then SENDs `message` (if any).
fn raw_client(
    server: SocketAddr,
    private_data: Option<Vec<u8>>,
    message: Option<Vec<u8>>,
) -> Result<Raw, String> {
    raw_client_posting(server, 8, private_data, message)
}

/// [`raw_client`] with `posted` of the 8 receive slots its hello announces
/// posted.
fn raw_client_posting(
    server: SocketAddr,
    posted: u32,
    private_data: Option<Vec<u8>>,
    message: Option<Vec<u8>>,
) -> Result<Raw, String> {
    let channel = EventChannel::new().map_err(|e| e.to_string())?;
    let mut id = CmId::new(&channel).map_err(|e| e.to_string())?;
    id.resolve(server, STEP).map_err(|e| e.to_string())?;
    let pd = ProtectionDomain::new(&id).map_err(|e| e.to_string())?;
    let cq = CompletionQueue::new(&id, 64).map_err(|e| e.to_string())?;
    let mut qp = QueuePair::new(&mut id, &pd, &cq, &cq, QpCapabilities::default())
        .map_err(|e| e.to_string())?;
    let recv = MemoryRegion::new(&pd, 8 * 128, Access::LOCAL_WRITE).map_err(|e| e.to_string())?;
    for i in 0..posted {
        // SAFETY: `recv` is returned with the QP and outlives it in the
        // caller; nothing reads the slots.
        unsafe { qp.post_recv(i.into(), &recv, i as usize * 128..(i as usize + 1) * 128) }
            .map_err(|e| e.to_string())?;
    }
    let hello = private_data.unwrap_or_else(|| {
        Hello {
            ring_slots: 8,
            initial_slots: 8,
            slot_size: 128,
            region_len: 4096,
            reads_rendezvous: false,
        }
        .to_bytes()
        .to_vec()
    });
    id.connect(&hello, STEP).map_err(|e| e.to_string())?;
    if let Some(message) = message {
        let send = MemoryRegion::new(&pd, 256, Access::LOCAL_WRITE).map_err(|e| e.to_string())?;
        send.write_at(0, &message);
        // SAFETY: `send` lives until the completion is polled below.
        unsafe { qp.post_send(99, &send, 0..message.len()) }.map_err(|e| e.to_string())?;
        let wc = cq.wait(STEP).map_err(|e| e.to_string())?;
        assert_eq!(wc.wr_id, 99);
        return Ok((id, cq, qp, recv, Some(send)));
    }
    Ok((id, cq, qp, recv, None))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn protocol_breakers_are_refused_or_disconnected_and_the_listener_goes_on() {
    let env = TestEnv::from_env();
    let cfg = RdmaTransport::default();
    let (mut listener, target) = env.listen_here(&cfg, LIMITS).await;
    let addr: SocketAddr = target.parse().unwrap();

    // Not an rdma-rpc hello: refused at connect.
    for bad_hello in [b"GET / HTTP/1.1".to_vec(), {
        let mut h = Hello {
            ring_slots: 8,
            initial_slots: 8,
            slot_size: 128,
            region_len: 4096,
            reads_rendezvous: false,
        }
        .to_bytes();
        h[4] = 9; // protocol version 9
        h.to_vec()
    }] {
        let result = tokio::task::spawn_blocking(move || raw_client(addr, Some(bad_hello), None))
            .await
            .unwrap();
        assert!(result.is_err(), "a bad hello was accepted");
    }

    // A valid hello, then a message that breaks the protocol: the server's
    // connection fails at once.
    let mut garbage = vec![0xffu8; 32];
    garbage[12..16].fill(0);
    let mut bad_chunk = Header::new(Kind::Chunk);
    bad_chunk.flags = FIRST | LAST;
    bad_chunk.len = 100;
    bad_chunk.total = 100;
    let mut unasked_grant = Header::new(Kind::RegionGranted);
    unasked_grant.pos = 4096;
    unasked_grant.total = 1;
    let mut too_many_credits = Header::new(Kind::Credit);
    too_many_credits.credits = 1000;
    let mut freed_ahead = Header::new(Kind::Credit);
    freed_ahead.freed_to = 1 << 40;
    for (what, message) in [
        ("unknown kind", garbage),
        (
            "a chunk before the region was granted",
            bad_chunk.to_bytes().to_vec(),
        ),
        ("a region grant unasked", unasked_grant.to_bytes().to_vec()),
        (
            "credits beyond the ring",
            too_many_credits.to_bytes().to_vec(),
        ),
        (
            "region freed beyond what was written",
            freed_ahead.to_bytes().to_vec(),
        ),
        ("truncated header", vec![1, 0, 0]),
    ] {
        let (conn, _) = fails_the_connection(&mut listener, addr, what, message).await;
        let body = Bytes::from_static(b"x");
        let frame = OutFrame::new(1, OutBody::Message, Some(&body), false).unwrap();
        assert!(
            conn.sink.send(&frame).await.is_err(),
            "{what}: sends still succeed"
        );
    }

    // A good client still gets through.
    let (client, server) = tokio::join!(
        cfg.connect(&target, LIMITS),
        poll_fn(|cx| listener.poll_accept(cx))
    );
    let (client, mut server) = (client.unwrap(), server.unwrap());
    let body = Bytes::from_static(b"still accepting");
    let frame = OutFrame::new(7, OutBody::Message, Some(&body), false).unwrap();
    client.sink.send(&frame).await.unwrap();
    let got: Result<Option<Bytes>, TransportError> = server.source.recv().await;
    assert!(got.unwrap().unwrap().ends_with(b"still accepting"));
}

/// Connects a raw client to `listener` that sends `message`; returns the
/// server's end of the connection once `message` failed it, and why.
async fn fails_the_connection(
    listener: &mut Box<dyn Listener>,
    addr: SocketAddr,
    what: &str,
    message: Vec<u8>,
) -> (Connection, String) {
    let client = tokio::task::spawn_blocking(move || raw_client(addr, None, Some(message)));
    let mut conn = tokio::time::timeout(STEP, poll_fn(|cx| listener.poll_accept(cx)))
        .await
        .expect("accepts in time")
        .expect("accepts");
    let _raw = client.await.unwrap().expect("the raw client connects");
    let error = tokio::time::timeout(STEP, conn.source.recv())
        .await
        .unwrap_or_else(|_| panic!("{what}: the connection did not fail"));
    match error {
        Err(e) => {
            eprintln!("{what}: {e}");
            (conn, e.to_string())
        }
        Ok(frame) => panic!("{what}: got {frame:?}"),
    }
}

/// An `Announce` message: transfer `id`, a frame of `len` bytes whose
/// first 32 it carries, the rest at `addr`/`rkey`.
fn announce(id: u64, len: u32, addr: u64, rkey: u32) -> Vec<u8> {
    let rest = len - ANNOUNCE_PREFIX_LEN as u32;
    announce_segments(
        id,
        len,
        &[Segment {
            addr,
            rkey,
            len: rest,
        }],
    )
}

/// An `Announce` message: transfer `id`, a frame of `len` bytes whose
/// first 32 it carries, the rest said to lie in `segments`.
fn announce_segments(id: u64, len: u32, segments: &[Segment]) -> Vec<u8> {
    let mut h = Header::new(Kind::Announce);
    h.len = len;
    h.pos = id;
    let mut msg = h.to_bytes().to_vec();
    let announcement = Announcement::new(ANNOUNCE_PREFIX_LEN, [0; ANNOUNCE_PREFIX_LEN], segments);
    let mut body = vec![0; announcement.encoded_len()];
    announcement.encode(&mut body);
    msg.extend_from_slice(&body);
    msg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn peers_lying_about_rendezvous_transfers_fail_their_connection() {
    let env = TestEnv::from_env();
    let before = transport_rdma::verbs::registered_bytes();

    // A server that does not read rendezvous transfers (the default) takes
    // no announcement: a peer cannot make it register memory.
    let (mut listener, target) = env.listen_here(&RdmaTransport::default(), LIMITS).await;
    let addr: SocketAddr = target.parse().unwrap();
    let (conn, error) = fails_the_connection(
        &mut listener,
        addr,
        "an announcement to a side that reads none",
        announce(1, 100_000, 0, 0),
    )
    .await;
    assert!(
        error.contains("this side takes none"),
        "failed for another reason: {error}"
    );
    drop((conn, listener));

    let cfg = RdmaTransport::default()
        .rendezvous_threshold(Some(transport_rdma::MEASURED_RENDEZVOUS_THRESHOLD));
    let (mut listener, target) = env.listen_here(&cfg, LIMITS).await;
    let addr: SocketAddr = target.parse().unwrap();
    let mut done = Header::new(Kind::Done);
    done.pos = 77;
    for (what, message) in [
        // The raw client registered nothing for remote read: the device
        // refuses the READs (the responder checks the rkey's registration).
        ("a segment it does not own", announce(1, 100_000, 0, 0)),
        (
            "a wild address under a made-up rkey",
            announce(2, 100_000, 0x7fff_0000_0000, 0xdead_beef),
        ),
        ("a frame past the skip limit", announce(3, 5 << 20, 0, 0)),
        (
            "Done for a transfer never announced",
            done.to_bytes().to_vec(),
        ),
    ] {
        fails_the_connection(&mut listener, addr, what, message).await;
    }
    let two_segments = [
        Segment {
            addr: 0,
            rkey: 1,
            len: 4096,
        },
        Segment {
            addr: 0,
            rkey: 2,
            len: 100_000,
        },
    ];
    let (_, error) = fails_the_connection(
        &mut listener,
        addr,
        "segments of more bytes than the frame",
        announce_segments(4, 100_000, &two_segments),
    )
    .await;
    assert!(
        error.contains("announced head and segments of 104128 bytes for a frame of 100000"),
        "failed for another reason: {error}"
    );
    // Every destination taken for them is freed with their connections.
    let deadline = tokio::time::Instant::now() + STEP;
    while transport_rdma::verbs::registered_bytes() > before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} bytes still registered",
            transport_rdma::verbs::registered_bytes() - before
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A peer that announces receive slots but posts none: the server's first
/// SEND meets "receiver not ready". Credits rule that out between correct
/// peers, so the server does not retry (forever, as RC allows): its
/// connection fails at once, naming the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_peer_with_no_receive_posted_fails_the_connection_naming_the_rnr() {
    let env = TestEnv::from_env();
    let cfg = RdmaTransport::default();
    let (mut listener, target) = env.listen_here(&cfg, LIMITS).await;
    let addr: SocketAddr = target.parse().unwrap();
    let client = tokio::task::spawn_blocking(move || raw_client_posting(addr, 0, None, None));
    let mut conn = tokio::time::timeout(STEP, poll_fn(|cx| listener.poll_accept(cx)))
        .await
        .expect("accepts in time")
        .expect("accepts");
    let _raw = client.await.unwrap().expect("the raw client connects");
    let body = Bytes::from_static(b"into no receive");
    let frame = OutFrame::new(1, OutBody::Message, Some(&body), false).unwrap();
    let _ = conn.sink.send(&frame).await;
    let started = std::time::Instant::now();
    let error = tokio::time::timeout(STEP, conn.source.recv())
        .await
        .expect("the connection fails instead of retrying")
        .expect_err("nothing can arrive");
    eprintln!("failed after {:?}: {error}", started.elapsed());
    assert!(
        error.to_string().contains("RNR retry counter exceeded"),
        "failed for another reason: {error}"
    );
}

/// A raw client that reads rendezvous transfers: hello, 8 posted receives
/// of 1 KiB (room for an announcement), a 1 MiB buffer to READ into.
struct RawReader {
    _id: CmId,
    cq: CompletionQueue,
    qp: QueuePair,
    recv: MemoryRegion,
    read_into: MemoryRegion,
    send: MemoryRegion,
}

const RAW_SLOT: usize = 1024;

fn raw_reader(server: SocketAddr) -> Result<RawReader, String> {
    let e = |e: transport_rdma::verbs::Error| e.to_string();
    let channel = EventChannel::new().map_err(e)?;
    let mut id = CmId::new(&channel).map_err(e)?;
    id.resolve(server, STEP).map_err(e)?;
    let pd = ProtectionDomain::new(&id).map_err(e)?;
    let cq = CompletionQueue::new(&id, 64).map_err(e)?;
    let mut qp = QueuePair::new(&mut id, &pd, &cq, &cq, QpCapabilities::default()).map_err(e)?;
    let recv = MemoryRegion::new(&pd, 8 * RAW_SLOT, Access::LOCAL_WRITE).map_err(e)?;
    for i in 0..8 {
        // SAFETY: `recv` is returned with the QP and outlives it; nothing
        // reads a slot before its completion.
        unsafe { qp.post_recv(i, &recv, i as usize * RAW_SLOT..(i as usize + 1) * RAW_SLOT) }
            .map_err(e)?;
    }
    let hello = Hello {
        ring_slots: 8,
        initial_slots: 8,
        slot_size: RAW_SLOT as u32,
        region_len: 4096,
        reads_rendezvous: true,
    };
    id.connect(&hello.to_bytes(), STEP).map_err(e)?;
    Ok(RawReader {
        _id: id,
        cq,
        qp,
        recv,
        read_into: MemoryRegion::new(&pd, 1 << 20, Access::LOCAL_WRITE).map_err(e)?,
        send: MemoryRegion::new(&pd, 256, Access::LOCAL_WRITE).map_err(e)?,
    })
}

/// Connects a [`raw_reader`] to `listener` (at `addr`) and accepts it.
async fn accept_raw_reader(
    listener: &mut dyn Listener,
    addr: SocketAddr,
) -> (Connection, RawReader) {
    let client = tokio::task::spawn_blocking(move || raw_reader(addr));
    let conn = tokio::time::timeout(STEP, poll_fn(|cx| listener.poll_accept(cx)))
        .await
        .expect("accepts in time")
        .expect("accepts");
    (
        conn,
        client.await.unwrap().expect("the raw client connects"),
    )
}

impl RawReader {
    /// Waits for the next message; returns its header and body.
    fn receive(&mut self) -> Result<(Header, Vec<u8>), String> {
        let wc = self.cq.wait(STEP).map_err(|e| e.to_string())?;
        let slot = wc.wr_id as usize;
        let msg = self.recv.read_at(slot * RAW_SLOT, wc.byte_len as usize);
        let header = Header::decode(&msg, msg.len()).map_err(|e| e.to_string())?;
        Ok((header, msg[transport_rdma::proto::HEADER_LEN..].to_vec()))
    }

    /// RDMA READs `len` bytes at `addr` under `rkey`; the bytes, or the
    /// completion's error.
    fn read(&mut self, addr: u64, rkey: u32, len: usize) -> Result<Vec<u8>, String> {
        // SAFETY: `read_into` lives with the QP; nothing reads it before the
        // completion is polled just below.
        unsafe { self.qp.queue_read(500, &self.read_into, 0..len, addr, rkey) }
            .map_err(|e| e.to_string())?;
        self.qp.post_queued().map_err(|e| e.to_string())?;
        self.completion_of(500)?;
        Ok(self.read_into.read_at(0, len))
    }

    /// SENDs `message`, waits for its completion.
    fn send(&mut self, message: &[u8]) -> Result<(), String> {
        self.send.write_at(0, message);
        // SAFETY: `send` lives with the QP; the completion is awaited.
        unsafe { self.qp.post_send(600, &self.send, 0..message.len()) }
            .map_err(|e| e.to_string())?;
        self.completion_of(600)
    }

    /// RDMA WRITEs `bytes` at `addr` under `rkey`; the completion's error,
    /// if any.
    fn write(&mut self, addr: u64, rkey: u32, bytes: &[u8]) -> Result<(), String> {
        self.send.write_at(0, bytes);
        let len = bytes.len() as u64;
        let remote = RemoteRegion { addr, rkey, len };
        // SAFETY: `send` lives with the QP; the completion is awaited.
        unsafe {
            self.qp
                .queue_write(700, &self.send, 0..bytes.len(), remote, 0, true)
        }
        .map_err(|e| e.to_string())?;
        self.qp.post_queued().map_err(|e| e.to_string())?;
        self.completion_of(700)
    }

    /// Asks for the server's region (`RegionWanted`); returns its address
    /// and rkey from the grant.
    fn region(&mut self) -> Result<(u64, u32), String> {
        let wanted = Header::new(Kind::RegionWanted).to_bytes();
        self.send.write_at(0, &wanted);
        // SAFETY: `send` lives with the QP; the completion is awaited below.
        unsafe { self.qp.post_send(600, &self.send, 0..wanted.len()) }
            .map_err(|e| e.to_string())?;
        let (mut sent, mut grant) = (false, None);
        while !sent || grant.is_none() {
            let wc = self.cq.wait(STEP).map_err(|e| e.to_string())?;
            if wc.wr_id == 600 {
                sent = true;
                continue;
            }
            let slot = wc.wr_id as usize;
            let msg = self.recv.read_at(slot * RAW_SLOT, wc.byte_len as usize);
            let header = Header::decode(&msg, msg.len()).map_err(|e| e.to_string())?;
            if header.kind == Kind::RegionGranted {
                grant = Some((header.pos, header.total));
            }
        }
        Ok(grant.expect("granted"))
    }

    /// Waits for request `wr_id`'s completion, past the server's messages
    /// (received into the slots, not looked at).
    fn completion_of(&mut self, wr_id: u64) -> Result<(), String> {
        loop {
            let wc = self.cq.wait(STEP).map_err(|e| e.to_string())?;
            if wc.wr_id == wr_id {
                return Ok(());
            }
        }
    }
}

/// A frame sent out of a payload buffer is readable, through the window
/// its announcement names, only while its transfer runs and only within
/// its buffer: a peer that READs again after its `Done`, or across the
/// buffer's end, is refused by the device (`REM_ACCESS_ERR`). (Within the
/// buffer, past the frame's end, Soft-RoCE lets the READ through: it
/// checks a window's reads against the region the window is bound to, one
/// buffer, not against the window itself (`check_rkey` in `rxe_resp.c`);
/// devices that implement windows as the specification says limit them to
/// the window.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_payload_buffers_window_ends_with_its_transfer_and_its_bytes() {
    let env = TestEnv::from_env();
    let cfg = RdmaTransport::default().rendezvous_threshold(Some(64 << 10));
    let (mut listener, target) = env.listen_here(&cfg, LIMITS).await;
    let addr: SocketAddr = target.parse().unwrap();
    for read_past_the_end in [false, true] {
        let (conn, mut raw) = accept_raw_reader(&mut *listener, addr).await;
        let mut buffer = conn
            .sink
            .payload_buffer(256 << 10)
            .await
            .expect("a payload buffer");
        for (i, b) in buffer.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        // Half the buffer: its other half stays registered, unannounced.
        let body = buffer.freeze().slice(..128 << 10);
        let frame = OutFrame::new(1, OutBody::Message, Some(&body), false).unwrap();
        conn.sink.send(&frame).await.expect("announced");
        let (error, raw) = tokio::task::spawn_blocking(move || {
            let (header, announced) = raw.receive().expect("the announcement");
            assert_eq!(header.kind, Kind::Announce);
            let announcement = Announcement::decode(&announced, announced.len())
                .expect("a well-formed announcement");
            let [segment] = announcement.segments() else {
                panic!("one segment: {announcement:?}")
            };
            let len = segment.len as usize;
            let read = raw
                .read(segment.addr, segment.rkey, len)
                .expect("the announced segment is readable");
            assert!(
                read[..] == body[body.len() - len..],
                "the segment holds the frame's last bytes"
            );
            let denied = if read_past_the_end {
                // From the frame's last page over the buffer's end.
                let buffer_end = segment.addr + len as u64 + (128 << 10);
                raw.read(buffer_end - 4096, segment.rkey, 8192)
            } else {
                let mut done = Header::new(Kind::Done);
                done.pos = header.pos;
                raw.send(&done.to_bytes()).expect("Done sent");
                // The server ends the transfer when it handles the `Done`.
                let deadline = std::time::Instant::now() + STEP;
                while !transport_rdma::debug_dump().contains("rendezvous out 0 ") {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the transfer never ended"
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
                raw.read(segment.addr, segment.rkey, len)
            };
            let error = match denied {
                Err(error) => error,
                Ok(_) => {
                    panic!("the device let the READ through (past the end: {read_past_the_end})")
                }
            };
            (error, raw)
        })
        .await
        .unwrap();
        eprintln!("read_past_the_end {read_past_the_end}: {error}");
        assert!(
            error.contains("REM_ACCESS_ERR") || error.contains("remote access error"),
            "{error}"
        );
        drop((raw, conn));
    }
}

/// On a protection domain shared by its connections, a connection's peer
/// reaches the server's memory only through windows bound to that
/// connection's queue pair: another client of the same server (its own
/// connection, the same protection domain on the server's side) that
/// uses the rkey of a rendezvous frame announced to the first, or of the
/// region granted to it, is refused by the device (`REM_ACCESS_ERR`),
/// while the first reads the frame and writes the region. (With a
/// registration's rkey, as before the domain was shared, both would have
/// gone through.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn another_connections_peer_cannot_use_its_windows() {
    let env = TestEnv::from_env();
    let cfg = RdmaTransport::default().rendezvous_threshold(Some(64 << 10));
    let (mut listener, target) = env.listen_here(&cfg, LIMITS).await;
    let addr: SocketAddr = target.parse().unwrap();
    // The first client, and two others: one to read, one to write (a
    // queue pair fails with its refused request).
    let mut accepted = Vec::new();
    let mut raw = Vec::new();
    for _ in 0..3 {
        let (conn, client) = accept_raw_reader(&mut *listener, addr).await;
        accepted.push(conn);
        raw.push(client);
    }
    assert_eq!(
        transport_rdma::verbs::protection_domains(),
        1 + 3,
        "the server's connections share one domain; each raw client has its own"
    );
    // Registered where it lies (in place), read through a window.
    let body = Bytes::from((0..128 << 10).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let frame = OutFrame::new(1, OutBody::Message, Some(&body), false).unwrap();
    accepted[0].sink.send(&frame).await.expect("announced");
    let (mut first, mut reader, mut writer) = (raw.remove(0), raw.remove(0), raw.remove(0));
    tokio::task::spawn_blocking(move || {
        let (header, announced) = first.receive().expect("the announcement");
        assert_eq!(header.kind, Kind::Announce);
        let announcement =
            Announcement::decode(&announced, announced.len()).expect("a well-formed announcement");
        let [segment] = announcement.segments() else {
            panic!("one segment: {announcement:?}")
        };
        let len = segment.len as usize;
        let stolen = reader.read(segment.addr, segment.rkey, len);
        let error = stolen.expect_err("another connection's peer read the frame");
        eprintln!("the other peer's READ: {error}");
        assert!(error.contains("remote access error"), "{error}");
        let read = first
            .read(segment.addr, segment.rkey, len)
            .expect("its own peer reads it");
        assert!(
            read[..] == body[body.len() - len..],
            "the frame's last bytes"
        );

        // The region, asked for by the first client.
        let (region, rkey) = first.region().expect("a region granted");
        let error = writer
            .write(region, rkey, b"not yours")
            .expect_err("another connection's peer wrote the region");
        eprintln!("the other peer's WRITE: {error}");
        assert!(error.contains("remote access error"), "{error}");
        first
            .write(region, rkey, b"granted")
            .expect("its own peer writes its region");
    })
    .await
    .unwrap();
    drop((accepted, listener));
}
