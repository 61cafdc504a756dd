//! Peers that try to exhaust a server's memory or descriptors: the server
//! refuses or bounds them and keeps serving everyone else.
//!
//! Two tests run the server in a child process (this test binary run again
//! with `--ignored --exact CHILD`) under a resource limit set with
//! `setrlimit`, so the limit never applies to the test process itself. A
//! child test run by hand, without its parent's environment, fails.

use rpc_test_support as support;

use std::future::poll_fn;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use rpc_core::transport::{FrameLimits, Transport};
use rpc_core::{BytesCodec, Channel, Client, Request};
use support::TestServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use transport_tcp::TcpTransport;

const CHILD_ENV: &str = "TCP_RESOURCE_LIMITS_CHILD";

/// Runs this binary's `child` test in a new process with `CHILD_ENV` set;
/// returns it and the address its server printed.
fn spawn_child(child: &str) -> (Child, String) {
    let mut process = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            child,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, child)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child server");
    let stdout = process.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let address = loop {
        let line = lines
            .next()
            .expect("the child prints its address")
            .expect("read the child's output");
        // The test harness prints the test's name on the same line.
        if let Some((_, address)) = line.split_once("listening on ") {
            break address.to_string();
        }
    };
    // Keep draining its output so that it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (process, address)
}

/// The child half: sets `resource` to `limit`, serves the test service over
/// TCP and prints its address, until the parent kills it.
async fn serve_limited(name: &str, resource: libc::__rlimit_resource_t, limit: u64) {
    assert_eq!(
        std::env::var(CHILD_ENV).as_deref(),
        Ok(name),
        "{name} is the child half of a test: its parent runs it"
    );
    let rlimit = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: `setrlimit` only reads the one valid `rlimit` it is given.
    let set = unsafe { libc::setrlimit(resource, &rlimit) };
    assert_eq!(set, 0, "setrlimit: {}", std::io::Error::last_os_error());
    transport_tcp::install();
    let server = TestServer::start("tcp://127.0.0.1:0", |b| b).await;
    println!("listening on {}", server.address);
    server.task.await.unwrap().unwrap();
}

async fn echo(address: &str) -> Result<Bytes, String> {
    let channel = Channel::connect(address).await.map_err(|e| e.to_string())?;
    Client::new(channel)
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from_static(b"alive")),
        )
        .await
        .map(|r| r.into_inner())
        .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "the child half of hundreds_of_maximal_frame_announcements_fit_in_1_gib_of_address_space"]
async fn child_server_in_1_gib_of_address_space() {
    serve_limited(
        "child_server_in_1_gib_of_address_space",
        libc::RLIMIT_AS,
        1 << 30,
    )
    .await;
}

/// Before frames' buffers grew with the bytes that arrived, each
/// announcement reserved 64 MiB and the child aborted after ~15. Now only
/// frames holding a claim on the read budget (256 MiB by default: four of
/// these) have room made for their whole length; the others wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_maximal_frame_announcements_fit_in_1_gib_of_address_space() {
    transport_tcp::install();
    let (mut child, address) = spawn_child("child_server_in_1_gib_of_address_space");
    let authority = address.strip_prefix("tcp://").unwrap();
    let announce = (rpc_core::DEFAULT_MAX_MESSAGE_SIZE as u32).to_le_bytes();
    let mut held = Vec::new();
    for i in 0..300 {
        let mut socket = TcpStream::connect(authority).await.expect("connects");
        socket.write_all(&announce).await.unwrap();
        if i % 10 == 0 {
            socket.write_all(&[7; 4096]).await.unwrap();
        }
        held.push(socket);
    }
    let reply = tokio::time::timeout(Duration::from_secs(20), echo(&address))
        .await
        .expect("the call is answered in time");
    let alive = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(alive, "the server died with 300 announcements held");
    assert_eq!(reply.expect("a normal call succeeds"), "alive");
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "the child half of at_the_descriptor_limit_new_clients_are_refused_at_once_and_served_again_later"]
async fn child_server_with_64_descriptors() {
    serve_limited("child_server_with_64_descriptors", libc::RLIMIT_NOFILE, 64).await;
}

/// Whether the server closed `socket` (EOF or reset) within `within`.
async fn closed_within(socket: &mut TcpStream, within: Duration) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(within, socket.read(&mut byte)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// Before the reserved descriptor, connections past the limit waited in the
/// backlog, unanswered, and the server logged ~50 warnings a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_descriptor_limit_new_clients_are_refused_at_once_and_served_again_later() {
    transport_tcp::install();
    let (mut child, address) = spawn_child("child_server_with_64_descriptors");
    let authority = address.strip_prefix("tcp://").unwrap();
    let mut held = Vec::new();
    for _ in 0..100 {
        held.push(TcpStream::connect(authority).await.expect("connects"));
    }
    // The last ones are past the limit: the server closes them at once.
    // (A generous bound: "at once" is a few milliseconds; waiting in the
    // backlog is forever.)
    let refused_promptly = closed_within(held.last_mut().unwrap(), Duration::from_secs(5)).await;
    // Free descriptors: the server sees these clients leave and accepts again.
    held.truncate(20);
    let reply = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match echo(&address).await {
                Ok(reply) => break reply,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await;
    let alive = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(alive, "the server died at its descriptor limit");
    assert!(refused_promptly, "a client past the limit was left waiting");
    assert_eq!(
        reply.expect("served again once descriptors are free"),
        "alive"
    );
}

/// Connections reset by their clients right after connecting (a storm of
/// them) never reach the server's accept loop as errors: before, each was a
/// failed accept followed by a 20 ms pause, and good clients queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_reset_before_accept_are_not_listener_errors() {
    let limits = FrameLimits {
        max_frame_len: 1 << 20,
    };
    let mut listener = TcpTransport::default()
        .listen("127.0.0.1:0", limits)
        .await
        .unwrap();
    let authority = listener
        .local_addr()
        .strip_prefix("tcp://")
        .unwrap()
        .to_string();
    // The storm, then a good client, while the listener accepts (the
    // backlog is finite: reset connections wait in it until accepted).
    let clients = tokio::task::spawn_blocking(move || {
        for _ in 0..300 {
            let socket = std::net::TcpStream::connect(&authority).unwrap();
            socket2::SockRef::from(&socket)
                .set_linger(Some(Duration::ZERO))
                .unwrap();
            drop(socket); // RST
        }
        let good = std::net::TcpStream::connect(&authority).unwrap();
        let peer = format!("tcp://{}", good.local_addr().unwrap());
        (good, peer)
    });
    let mut clients = std::pin::pin!(clients);
    let mut errors = Vec::new();
    let mut peers = Vec::new();
    let mut good = None;
    let accepted_good = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            tokio::select! {
                accepted = poll_fn(|cx| listener.poll_accept(cx)) => match accepted {
                    Ok(connection) => peers.push(connection.peer),
                    Err(error) => errors.push(error.to_string()),
                },
                done = &mut clients, if good.is_none() => good = Some(done.unwrap()),
            }
            if matches!(&good, Some((_, peer)) if peers.contains(peer)) {
                break;
            }
        }
    })
    .await;
    assert!(accepted_good.is_ok(), "the good client was never accepted");
    assert!(
        errors.is_empty(),
        "{} reset connections surfaced as accept errors, e.g. {:?}",
        errors.len(),
        errors.first()
    );
}
