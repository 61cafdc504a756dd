//! Verbs smoke test on a real RDMA device: open it, connect two RC queue
//! pairs through librdmacm, SEND/RECV (inline, from memory not registered
//! yet), an unsignaled RDMA WRITE (refused until the memory is registered)
//! and a SEND linked in one post, and check the bytes.
//!
//! These tests need a device, named by environment variables:
//! - `RDMA_TEST_DEVICE`: the device, e.g. `rxe0` or `mlx5_0`;
//! - `RDMA_TEST_IP`: an IPv4 address on it (this side's);
//! - `RDMA_TEST_ROLE`: `both` (default: server and client in this process,
//!   over the one device), `server` or `client` (two hosts);
//! - `RDMA_TEST_PEER_IP`: the server's address, for the client.
//!
//! `cargo xtask rxe` sets them in its Soft-RoCE guest. They are `#[ignore]`d
//! so a plain `cargo test` on a machine without a device does not run them;
//! when run (`--ignored`) without the variables, or with a device that does
//! not work, they fail: never a silent pass.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{Role, TestEnv};

use transport_rdma::verbs::{
    Access, CmId, CompletionQueue, Context, Error, EventChannel, MemoryRegion, ProtectionDomain,
    QpCapabilities, QueuePair, RemoteRegion,
};

/// Port of the smoke test's listener.
const PORT: u16 = 7471;
/// Each wait's limit (the two-hosts guests are slow, and boot unevenly).
const STEP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the client keeps retrying until the server listens.
const CONNECT_PATIENCE: Duration = Duration::from_secs(90);

const SEND_MESSAGE: &[u8] = b"hello over RDMA SEND";
const DONE_MESSAGE: &[u8] = b"write done";
/// Inline data the client's queue pair asks for: its first SEND fits.
const INLINE_BYTES: u32 = 64;
const WRITE_LEN: usize = 3000;
const WRITE_OFFSET: u64 = 100;
/// Receive slots in the server's receive region.
const SLOT: usize = 1024;

#[test]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
fn device_opens_and_port_is_active() {
    let env = TestEnv::from_env();
    let ctx = Context::open(&env.device)
        .unwrap_or_else(|e| panic!("opening RDMA_TEST_DEVICE={}: {e}", env.device));
    let port = ctx
        .port(1)
        .unwrap_or_else(|e| panic!("querying port 1 of {}: {e}", env.device));
    assert!(
        port.is_active(),
        "port 1 of {} is {} (not active)",
        env.device,
        port.state_name
    );
    assert!(port.active_mtu >= 256, "odd active MTU {}", port.active_mtu);
}

#[test]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
fn send_recv_and_rdma_write_over_rc_across_the_wire() {
    let env = TestEnv::from_env();
    let listen = SocketAddr::new(env.ip, PORT);
    match env.role {
        Role::Both => {
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            let device = env.device.clone();
            let server = std::thread::spawn(move || serve(listen, &device, Some(ready_tx)));
            // Wait for the listener (or for the server to fail first).
            if ready_rx.recv_timeout(STEP_TIMEOUT).is_err() {
                server
                    .join()
                    .expect("server thread panicked")
                    .expect("server failed before listening");
                panic!("the server never started listening");
            }
            let client = connect_and_write(listen, &env.device);
            let server = server.join().expect("server thread panicked");
            client.expect("client side failed");
            server.expect("server side failed");
        }
        Role::Server => serve(listen, &env.device, None).expect("server side failed"),
        Role::Client => {
            let peer = SocketAddr::new(env.peer.expect("checked in from_env"), PORT);
            connect_and_write(peer, &env.device).expect("client side failed");
        }
    }
}

/// The server: listen, accept one connection with two receives posted and
/// a remote-writable region advertised, then check what arrived.
fn serve(
    addr: SocketAddr,
    device: &str,
    ready: Option<std::sync::mpsc::Sender<()>>,
) -> Result<(), String> {
    let step = |what: &'static str| move |e: Error| format!("server: {what}: {e}");
    let channel = EventChannel::new().map_err(step("event channel"))?;
    let mut listener = CmId::new(&channel).map_err(step("cm_id"))?;
    listener.bind(addr).map_err(|e| {
        format!("server: binding {addr} (is RDMA_TEST_IP an address of the RDMA device?): {e}")
    })?;
    check_device(&listener, device, "server")?;
    listener.listen(4).map_err(step("listen"))?;
    if let Some(ready) = ready {
        let _ = ready.send(());
    }
    let request = listener
        .get_request(CONNECT_PATIENCE)
        .map_err(step("waiting for the client"))?;
    let mut conn = request.id;
    let pd = ProtectionDomain::new(&conn).map_err(step("protection domain"))?;
    let cq = CompletionQueue::new(&conn, 32).map_err(step("completion queue"))?;
    let mut qp = QueuePair::new(&mut conn, &pd, &cq, &cq, QpCapabilities::default())
        .map_err(step("queue pair"))?;
    let recv_mr =
        MemoryRegion::new(&pd, 2 * SLOT, Access::LOCAL_WRITE).map_err(step("receive region"))?;
    let target = MemoryRegion::new(&pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .map_err(step("write region"))?;
    for slot in 0..2 {
        // SAFETY: both regions live until the end of this function, after
        // the receives completed (or failed); the slots are read only after
        // their completion.
        unsafe { qp.post_recv(slot as u64, &recv_mr, slot * SLOT..(slot + 1) * SLOT) }
            .map_err(step("post_recv"))?;
    }
    // Registered zero-based: the peer writes at offsets, and learns
    // nothing of this process's addresses (rxe and mlx5 support it).
    if target.remote().addr != 0 {
        return Err(format!(
            "server: the remotely writable region is not zero-based: {:#x}",
            target.remote().addr
        ));
    }
    conn.accept(&target.remote().to_bytes(), STEP_TIMEOUT)
        .map_err(step("accept"))?;

    let first = cq.wait(STEP_TIMEOUT).map_err(step("first receive"))?;
    if first.wr_id != 0 || first.byte_len as usize != SEND_MESSAGE.len() {
        return Err(format!(
            "server: first receive: unexpected completion {first:?}"
        ));
    }
    let got = recv_mr.read_at(0, SEND_MESSAGE.len());
    if got != SEND_MESSAGE {
        return Err(format!(
            "server: SEND carried {:?}, expected {:?}",
            String::from_utf8_lossy(&got),
            SEND_MESSAGE
        ));
    }
    // The client sends DONE after its RDMA WRITE completed: on an RC QP the
    // written bytes are in place before this receive completes.
    let second = cq.wait(STEP_TIMEOUT).map_err(step("second receive"))?;
    if second.wr_id != 1 || recv_mr.read_at(SLOT, DONE_MESSAGE.len()) != DONE_MESSAGE {
        return Err(format!(
            "server: second receive: unexpected completion {second:?}"
        ));
    }
    let written = target.read_at(WRITE_OFFSET as usize, WRITE_LEN);
    if written != pattern(WRITE_LEN) {
        let first_bad = written
            .iter()
            .zip(pattern(WRITE_LEN))
            .position(|(a, b)| *a != b);
        return Err(format!(
            "server: RDMA WRITE data differs from what was sent (first bad byte at {first_bad:?})"
        ));
    }
    if target
        .read_at(0, WRITE_OFFSET as usize)
        .iter()
        .any(|b| *b != 0)
    {
        return Err("server: RDMA WRITE touched bytes before its offset".into());
    }
    let _ = conn.wait_disconnected(STEP_TIMEOUT);
    Ok(())
}

/// The client: connect (retrying until the server listens), SEND, RDMA
/// WRITE into the advertised region, SEND "done".
fn connect_and_write(server: SocketAddr, device: &str) -> Result<(), String> {
    let step = |what: &'static str| move |e: Error| format!("client: {what}: {e}");
    let started = Instant::now();
    let mut attempts = 0;
    let (mut conn, pd, cq, mut qp, remote) = loop {
        attempts += 1;
        match try_connect(server) {
            Ok(connected) => break connected,
            // Nobody listens yet, or the peer's link is not up yet.
            Err(e) if started.elapsed() < CONNECT_PATIENCE && is_retryable(&e) => {
                std::thread::sleep(Duration::from_millis(250));
            }
            Err(e) => {
                return Err(format!(
                    "client: connecting to {server} (attempt {attempts}): {e}"
                ))
            }
        }
    };
    check_device(&conn, device, "client")?;
    let remote = RemoteRegion::from_bytes(&remote)
        .ok_or("client: the server sent no region in its private data")?;
    if remote.len < WRITE_OFFSET + WRITE_LEN as u64 {
        return Err(format!(
            "client: the server's region is too small: {remote:?}"
        ));
    }
    // Not registered yet: inline sends need no lkey.
    let mr = MemoryRegion::unregistered(&pd, 8192, Access::LOCAL_WRITE);
    mr.write_at(0, SEND_MESSAGE);
    mr.write_at(1024, &pattern(WRITE_LEN));
    mr.write_at(4096, DONE_MESSAGE);
    if qp.max_inline_data() < SEND_MESSAGE.len() as u32 {
        return Err(format!(
            "client: the device granted {} bytes of inline data, asked for {INLINE_BYTES}",
            qp.max_inline_data()
        ));
    }
    // SAFETY: the SEND is inline: the provider copied its bytes when it was
    // posted, so writing them at once is allowed; `mr` lives until the end
    // of the function.
    unsafe { qp.post_send(10, &mr, 0..SEND_MESSAGE.len()) }.map_err(step("post SEND"))?;
    // The server must see the message as posted, not this.
    mr.write_at(0, &vec![b'!'; SEND_MESSAGE.len()]);
    expect_completion(&cq, 10, "SEND")?;
    // Anything longer needs the registration: refused until then.
    // SAFETY: refused, so nothing is queued.
    match unsafe { qp.queue_write(11, &mr, 1024..1024 + WRITE_LEN, remote, WRITE_OFFSET, false) } {
        Err(Error::NotRegistered { .. }) => {}
        other => {
            return Err(format!(
                "client: a {WRITE_LEN}-byte WRITE from unregistered memory: {other:?}"
            ))
        }
    }
    if qp.has_queued() || mr.is_registered() {
        return Err("client: a refused WRITE left something queued or registered".into());
    }
    mr.register().map_err(step("registering the send region"))?;
    // The WRITE and the SEND after it go in one post, linked; the WRITE
    // unsignaled, as the transport posts a region chunk's: the SEND's is
    // the next completion (the server checks the WRITE's bytes landed).
    // SAFETY: `mr` is not written again and lives until the SEND, which
    // completes after the WRITE, completed.
    unsafe { qp.queue_write(11, &mr, 1024..1024 + WRITE_LEN, remote, WRITE_OFFSET, false) }
        .map_err(step("queue RDMA WRITE"))?;
    // SAFETY: as above.
    unsafe { qp.queue_send(12, &mr, 4096..4096 + DONE_MESSAGE.len()) }
        .map_err(step("queue SEND"))?;
    qp.post_queued().map_err(step("post RDMA WRITE and SEND"))?;
    expect_completion(&cq, 12, "second SEND (after the unsignaled RDMA WRITE)")?;
    conn.disconnect().map_err(step("disconnect"))?;
    Ok(())
}

type Connected = (CmId, ProtectionDomain, CompletionQueue, QueuePair, Vec<u8>);

/// The client's connection-manager options (`rdma_set_option`): an ACK
/// timeout of 4.096 µs × 2^12 (~17 ms), and a type of service.
const CLIENT_ACK_TIMEOUT: u8 = 12;
const CLIENT_TOS: u8 = 32;

fn try_connect(server: SocketAddr) -> Result<Connected, Error> {
    let channel = EventChannel::new()?;
    let mut id = CmId::new(&channel)?;
    id.set_type_of_service(CLIENT_TOS)?;
    id.resolve(server, STEP_TIMEOUT)?;
    id.set_ack_timeout(CLIENT_ACK_TIMEOUT)?;
    let pd = ProtectionDomain::new(&id)?;
    let cq = CompletionQueue::new(&id, 32)?;
    let caps = QpCapabilities {
        max_inline_data: INLINE_BYTES,
        ..QpCapabilities::default()
    };
    let qp = QueuePair::new(&mut id, &pd, &cq, &cq, caps)?;
    let private = id.connect(&[], STEP_TIMEOUT)?;
    // The options took effect on the connected queue pair.
    let timeout = qp.ack_timeout()?;
    assert_eq!(timeout, CLIENT_ACK_TIMEOUT, "the QP's ACK timeout");
    Ok((id, pd, cq, qp, private))
}

fn is_retryable(e: &Error) -> bool {
    matches!(
        e,
        Error::UnexpectedCmEvent { .. }
            | Error::Rejected { .. }
            | Error::ResolveAddr { .. }
            | Error::Timeout { .. }
    )
}

fn expect_completion(cq: &CompletionQueue, wr_id: u64, what: &str) -> Result<(), String> {
    let wc = cq
        .wait(STEP_TIMEOUT)
        .map_err(|e| format!("client: {what}: {e}"))?;
    if wc.wr_id == wr_id {
        Ok(())
    } else {
        Err(format!(
            "client: {what}: completion for request {} instead of {wr_id}",
            wc.wr_id
        ))
    }
}

/// Fails when the address is on another device than the one asked for.
fn check_device(id: &CmId, device: &str, side: &str) -> Result<(), String> {
    let name = id.device_name().map_err(|e| format!("{side}: {e}"))?;
    if name == device {
        Ok(())
    } else {
        Err(format!(
            "{side}: the address is on device {name}, not RDMA_TEST_DEVICE={device}"
        ))
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + 3) as u8).collect()
}
