//! The link under the RDMA device going down mid-call (`ip link set dev
//! $RDMA_TEST_NETDEV down`): calls in flight fail with `Unavailable` within
//! a bounded time and nothing hangs.
//!
//! - `a_link_down_fails_calls_in_flight_and_the_device_recovers`: client
//!   and server in one process, over this host's device (the two-host
//!   suite leaves it out). Two connections: one idle (20 sleeping
//!   unary calls: nothing is posted on it after their requests) and one
//!   busy (an endless server stream, read as fast as it comes). The device
//!   reports `IBV_EVENT_PORT_ERR`; the test checks that the idle
//!   connection's calls fail on that async event (their status names it):
//!   nothing else could fail them before rpc-core's keepalive (20 s by
//!   default). The busy one must fail with `Unavailable` too, on whichever
//!   path comes first.
//! - `a_cut_mid_call_fails_both_ends_across_the_wire`: in a two-host run,
//!   the client guest cuts its own link mid-call. Its calls fail on the port error; the
//!   server, whose port stays up, hears nothing more and must notice by
//!   itself: its handlers on the idle connection must end within 10 s of
//!   all running (keepalive of 1 s + 1 s here). The client keeps its link
//!   down longer than that bound, so the server cannot learn of the failure
//!   from a disconnect after the link comes back. With one host the same
//!   client and server run in one process (both fail on the port error).
//! - `a_cut_fails_an_idle_stream_at_both_ends_across_the_wire`: the same cut under
//!   an idle `RdmaStream` (1 s stream keepalive): the client's stream fails
//!   on the port error, the server's when its keepalive probe goes
//!   unacknowledged (observed ~3 s after the last exchange). rxe's own RC
//!   retries never ended here: without the keepalive an idle stream waited
//!   past 60 s.
//!
//! Observed (Soft-RoCE, Linux 6.1 guest): the calls fail 0.2-0.7 s after
//! `ip link set down` returns, counted from just before it (the event is
//! read during the `ip` command; the rest is the calls' tasks winding down).
//! With the dummy netdev of a one-host run the port error failed both
//! connections first in every run; on the virtio `eth0` of a two-host run
//! the busy connection's sends sometimes fail first, with
//! `IBV_WC_LOC_QP_OP_ERR` (rxe's transmit on the downed netdev), a few
//! milliseconds before or after the event. Across the wire the server's
//! keepalive closed both connections ~2.4 s after the calls ran
//! (`client sent nothing for 2s, not even a pong`), the busy one too: its
//! ping finds the sink full (the dead client grants no credits) and is
//! skipped rather than waited for, so the silence is noticed.
//!
//! The RDMA work runs in child processes (the `child_*` tests, which do
//! nothing unless the parent set their environment variable): on this
//! kernel a link that went down under live RC connections leaves the
//! device's connection manager unable to complete any new connection, in
//! any process, until the Soft-RoCE device is re-created, and deleting it
//! waits for every process that has it open. So each test, once its child
//! is done (or failed), brings the link up, re-creates the device
//! ([`DeviceRestore`]) and checks that a new process connects and calls
//! over it, for the tests that run after it. Set `RUST_LOG` (default
//! `transport_rdma=debug,rpc_core=info`) to see which path failed each
//! connection.

mod common;
use rpc_test_support as support;

use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Role, TestEnv};
use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
use rpc_core::{BytesCodec, Client, Code, Endpoint, Request, Response, Server, Status};
use support::{count_request, Probes, TestService};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use transport_rdma::RdmaTransport;

/// Calls in flight when the link goes down (besides one endless stream).
const CALLS: usize = 20;
/// How soon calls in flight must fail once the link is down.
const FAIL_WITHIN: Duration = Duration::from_secs(10);
/// The server of the two-host test (other files use 7471, 7481, 7491).
const WIRE_PORT: u16 = 7501;
/// Server keepalive in the two-host test: ping after 1 s of silence, give
/// up 1 s later.
const KEEPALIVE: Duration = Duration::from_secs(1);
/// How soon the two-host server must see its handlers end, from the moment
/// they all run (the client cuts its link right after).
const SERVER_NOTICES_WITHIN: Duration = Duration::from_secs(10);
/// How long the two-host client keeps its link down: longer than the
/// server's bound, so the server notices while the link is down.
const LINK_DOWN_FOR: Duration = Duration::from_secs(12);

/// Set for the child processes that run the `child_*` tests.
const CHILD: &str = "RDMA_LINK_DOWN_CHILD";

/// Runs the test `name` (a `child_*` one) in a child process of this
/// binary, its output passed through; fails if it fails or runs over 300 s.
fn run_child(name: &str) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .spawn()
        .expect("spawn the child");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{name} still ran after 300 s: killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "{name} failed in the child process: {status}"
    );
}

/// How long `ip` or `rdma` may take before [`run`] gives up on it.
const COMMAND_WITHIN: Duration = Duration::from_secs(60);

/// Runs a command (`ip`, `rdma`) and fails with its stderr if it fails, or
/// with what holds it up if it still runs after [`COMMAND_WITHIN`]:
/// `rdma link delete` waits in the kernel for every process that has the
/// device open, and once did not return in a CI run.
fn run(args: &[&str]) -> Result<(), String> {
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running {args:?}: {e}"))?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("{args:?}: {e}"))? {
            break status;
        }
        if started.elapsed() > COMMAND_WITHIN {
            let stuck = stuck_report(child.id());
            let _ = child.kill();
            return Err(format!(
                "{args:?} still ran after {COMMAND_WITHIN:?} (killed):\n{stuck}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if status.success() {
        return Ok(());
    }
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
    }
    Err(format!("{args:?}: {status} {stderr}"))
}

/// What a stuck command waits for: its kernel stack, the processes that
/// have an RDMA device file open, and the kernel log's tail.
fn stuck_report(pid: u32) -> String {
    let stack = std::fs::read_to_string(format!("/proc/{pid}/stack"))
        .unwrap_or_else(|e| format!("(unreadable: {e})\n"));
    let mut holders = String::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(other) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let files: Vec<String> = std::fs::read_dir(entry.path().join("fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .map(|target| target.display().to_string())
            .filter(|target| target.starts_with("/dev/infiniband/"))
            .collect();
        if !files.is_empty() {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            holders += &format!("  pid {other} ({}): {}\n", cmdline.trim(), files.join(", "));
        }
    }
    if holders.is_empty() {
        holders = "  none\n".into();
    }
    let dmesg = Command::new("dmesg")
        .output()
        .map(|out| {
            let log = String::from_utf8_lossy(&out.stdout).into_owned();
            let lines: Vec<&str> = log.lines().collect();
            lines[lines.len().saturating_sub(30)..].join("\n")
        })
        .unwrap_or_else(|e| format!("(dmesg: {e})"));
    format!(
        "its kernel stack:\n{stack}processes with /dev/infiniband/* open:\n{holders}\
         the kernel log's last lines:\n{dmesg}"
    )
}

/// Restores the device after a link cut: link up, and the Soft-RoCE device
/// deleted and added again (`rdma link`), then waits for its port to be
/// active. On the guest's kernel (6.1) a link that went down under live RC
/// connections leaves the device's connection manager unable to complete
/// any new connection (not even `ib_send_lat -R` in a new process) until
/// the device is re-created. Deleting it waits for every process that has
/// it open: this process never opens it (the `child_*` tests do).
/// Also runs when dropped (a test that failed), so later tests find a
/// working device.
struct DeviceRestore {
    netdev: String,
    device: String,
    done: bool,
}

impl DeviceRestore {
    fn new(env: &TestEnv) -> DeviceRestore {
        DeviceRestore {
            netdev: LinkCut::new(env).netdev.clone(),
            device: env.device.clone(),
            done: false,
        }
    }

    fn now(&mut self) -> Result<(), String> {
        self.done = true;
        let started = Instant::now();
        run(&["ip", "link", "set", "dev", &self.netdev, "up"])?;
        run(&["rdma", "link", "delete", &self.device])?;
        run(&[
            "rdma",
            "link",
            "add",
            &self.device,
            "type",
            "rxe",
            "netdev",
            &self.netdev,
        ])?;
        let state = format!("/sys/class/infiniband/{}/ports/1/state", self.device);
        loop {
            let now = std::fs::read_to_string(&state).unwrap_or_default();
            if now.contains("ACTIVE") {
                eprintln!(
                    "{} re-created on {}, port active, in {:?}",
                    self.device,
                    self.netdev,
                    started.elapsed()
                );
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(20) {
                return Err(format!("{state}: {} 20 s after re-creating", now.trim()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for DeviceRestore {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = self.now() {
                eprintln!("restoring the device: {e}");
            }
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "transport_rdma=debug,rpc_core=info".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// The device's netdev, taken down by [`LinkCut::down`] and brought back
/// up (waiting for the port to be active) by [`LinkCut::up`] or on drop.
struct LinkCut {
    netdev: String,
    device: String,
    is_down: bool,
}

impl LinkCut {
    fn new(env: &TestEnv) -> LinkCut {
        let netdev = std::env::var("RDMA_TEST_NETDEV")
            .ok()
            .filter(|v| !v.is_empty())
            .expect("RDMA_TEST_NETDEV is not set: run through cargo xtask rxe");
        LinkCut {
            netdev,
            device: env.device.clone(),
            is_down: false,
        }
    }

    fn set(&self, state: &str) -> Result<(), String> {
        run(&["ip", "link", "set", "dev", &self.netdev, state])
    }

    fn down(&mut self) {
        self.is_down = true;
        self.set("down").unwrap();
        eprintln!("link {} ({}) down", self.netdev, self.device);
    }

    /// Brings the link up and waits (up to 20 s) for port 1 to be active.
    fn up(&mut self) -> Result<(), String> {
        self.set("up")?;
        self.is_down = false;
        let ctx = transport_rdma::verbs::Context::open(&self.device)
            .map_err(|e| format!("opening {}: {e}", self.device))?;
        let started = Instant::now();
        loop {
            let port = ctx
                .port(1)
                .map_err(|e| format!("querying port 1 of {}: {e}", self.device))?;
            if port.is_active() {
                eprintln!(
                    "link {} up, port 1 active after {:?}",
                    self.netdev,
                    started.elapsed()
                );
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(20) {
                return Err(format!(
                    "port 1 of {} still {} 20 s after the link came up",
                    self.device, port.state_name
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for LinkCut {
    fn drop(&mut self) {
        if self.is_down {
            if let Err(e) = self.up() {
                eprintln!("bringing the link back up: {e}");
            }
        }
    }
}

/// `test.Probe/Sleeping`: how many `Sleep` handlers run now, so that a
/// client on another host knows its calls arrived.
#[derive(Clone)]
struct ProbeService(Arc<Probes>);

impl Service for ProbeService {
    fn name(&self) -> &'static str {
        "test.Probe"
    }

    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
        let probes = Arc::clone(&self.0);
        match method {
            "Sleeping" => codegen::unary::<BytesCodec, _, _>(call, move |_: Request<Bytes>| {
                let running = probes.sleeping.load(Ordering::SeqCst)
                    - probes.cancelled.load(Ordering::SeqCst);
                async move { Ok(Response::new(Bytes::from(running.to_le_bytes().to_vec()))) }
            }),
            _ => codegen::unimplemented(call),
        }
    }
}

/// The test service (and the probe) on `address`; stops when the sender
/// is dropped or sent to.
async fn start_server(
    address: &str,
    keepalive: Option<Duration>,
) -> (Arc<Probes>, String, oneshot::Sender<()>, JoinHandle<()>) {
    let probes = Arc::new(Probes::default());
    // Without keepalive, calls stuck on a connection cut off would keep a
    // graceful stop waiting: do not wait for them. With keepalive, the
    // cut connections must be gone by the stop (see `wire_server`).
    let grace = if keepalive.is_some() {
        Duration::from_secs(30)
    } else {
        Duration::from_secs(1)
    };
    let mut builder = Server::builder()
        .shutdown_grace(grace)
        .add_service(TestService {
            probes: Arc::clone(&probes),
        })
        .add_service(ProbeService(Arc::clone(&probes)));
    if let Some(k) = keepalive {
        builder = builder.keepalive(k, k);
    }
    let server = builder.bind(address).await.expect("the server binds");
    let address = server.local_addr().to_string();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        server
            .serve_with_shutdown(async {
                let _ = stopped.await;
            })
            .await
            .expect("the server serves");
    });
    (probes, address, stop, task)
}

/// What a client has in flight: `CALLS` sleeping unary calls on an idle
/// connection, and one endless server stream on a busy one, read as fast
/// as it comes.
struct InFlight {
    sleeps: Vec<JoinHandle<Result<Response<Bytes>, Status>>>,
    stream: JoinHandle<(usize, Status)>,
}

/// A client of `address`, retrying for up to `patience` (the server may
/// not listen yet: in a two-host run the guests run at their own pace).
async fn connect(address: &str, patience: Duration) -> Client {
    let failing = format!("the server at {address} never answered");
    let channel = common::retrying(patience, &failing, || {
        Endpoint::new(address).unwrap().connect()
    })
    .await;
    Client::new(channel)
}

/// Starts the sleeping calls on `idle` and the stream on `busy` (two
/// connections): after their requests nothing is posted on `idle`, so only
/// an async event can fail it promptly, while `busy` keeps sending and
/// receiving.
async fn start_calls(idle: &Client, busy: &Client) -> InFlight {
    let sleeps = (0..CALLS)
        .map(|_| {
            let client = idle.clone();
            tokio::spawn(async move {
                client
                    .unary::<BytesCodec>(
                        "/test.Test/Sleep",
                        Request::new(support::sleep_request(600_000)),
                    )
                    .await
            })
        })
        .collect();
    let (first_tx, first_rx) = oneshot::channel();
    let stream = {
        let client = busy.clone();
        tokio::spawn(async move {
            let mut stream = match client
                .server_streaming::<BytesCodec>(
                    "/test.Test/Count",
                    Request::new(count_request(u32::MAX, 1024)),
                )
                .await
            {
                Ok(response) => response.into_inner(),
                Err(status) => return (0, status),
            };
            let mut first = Some(first_tx);
            let mut received = 0;
            loop {
                match stream.message().await {
                    Ok(Some(_)) => {
                        received += 1;
                        if let Some(first) = first.take() {
                            let _ = first.send(());
                        }
                    }
                    Ok(None) => return (received, Status::ok("the endless stream ended")),
                    Err(status) => return (received, status),
                }
            }
        })
    };
    tokio::time::timeout(Duration::from_secs(30), first_rx)
        .await
        .expect("the stream's first message came within 30 s")
        .expect("the stream delivered a message");
    InFlight { sleeps, stream }
}

/// Waits for every call of `calls`: each must fail with `Unavailable`
/// within `FAIL_WITHIN` of `cut`, the sleeping ones (idle connection) on
/// the port error event.
async fn expect_all_fail(calls: InFlight, cut: Instant) {
    let deadline = tokio::time::Instant::from_std(cut + FAIL_WITHIN);
    let mut messages = Vec::new();
    for call in calls.sleeps {
        let result = tokio::time::timeout_at(deadline, call)
            .await
            .unwrap_or_else(|_| {
                panic!("a sleeping call still pending {FAIL_WITHIN:?} after the cut")
            })
            .expect("the call task");
        let status = result.expect_err("a 600 s call cannot succeed");
        assert_eq!(status.code(), Code::Unavailable, "{status}");
        assert!(
            status.message().contains("IBV_EVENT_PORT_ERR"),
            "the idle connection did not fail on the port error event: {status}"
        );
        messages.push(status.message().to_string());
    }
    eprintln!(
        "the sleeping calls (idle connection) failed {:?} after the cut: {}",
        cut.elapsed(),
        messages[0]
    );
    let (received, status) = tokio::time::timeout_at(deadline, calls.stream)
        .await
        .unwrap_or_else(|_| panic!("the stream still flowing {FAIL_WITHIN:?} after the cut"))
        .expect("the stream task");
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    eprintln!(
        "the stream (busy connection) failed {:?} after the cut, after {received} messages: {}",
        cut.elapsed(),
        status.message()
    );
}

/// Child: calls in flight on a local connection, the link goes down:
/// every call fails with `Unavailable`, on the device's port error, within
/// 10 s, and the server's handlers are cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn child_link_down() {
    assert!(
        std::env::var_os(CHILD).is_some(),
        "the child half of a test: its parent runs it"
    );
    init_tracing();
    let env = TestEnv::from_env();
    transport_rdma::install();
    let mut link = LinkCut::new(&env);
    let (probes, address, stop, server) = start_server(&env.local_listen(), None).await;
    let idle = connect(&address, Duration::from_secs(10)).await;
    let busy = connect(&address, Duration::from_secs(10)).await;
    let calls = start_calls(&idle, &busy).await;
    assert!(
        probes
            .wait_until(Duration::from_secs(30), || probes
                .sleeping
                .load(Ordering::SeqCst)
                == CALLS)
            .await,
        "the sleeping calls never all reached the server: {} of {CALLS} in 30 s (the stream \
         produced {}); the connections:\n{}",
        probes.sleeping.load(Ordering::SeqCst),
        probes.produced.load(Ordering::SeqCst),
        transport_rdma::debug_dump()
    );
    let cut = Instant::now();
    link.down();
    expect_all_fail(calls, cut).await;
    // The server side of the connection failed the same way.
    assert!(
        probes
            .wait_until(FAIL_WITHIN.saturating_sub(cut.elapsed()), || probes
                .cancelled
                .load(Ordering::SeqCst)
                == CALLS)
            .await,
        "the server's handlers were not all cancelled {FAIL_WITHIN:?} after the cut: {} of {CALLS}",
        probes.cancelled.load(Ordering::SeqCst)
    );
    link.up().unwrap();
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("the server stops")
        .unwrap();
}

/// Child: a server and a client on this host's device, one call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn child_fresh_connection() {
    assert!(
        std::env::var_os(CHILD).is_some(),
        "the child half of a test: its parent runs it"
    );
    let env = TestEnv::from_env();
    transport_rdma::install();
    let (_, address, stop, server) = start_server(&env.local_listen(), None).await;
    let client = Client::new(
        Endpoint::new(&address)
            .unwrap()
            .connect()
            .await
            .expect("a new connection on the device"),
    );
    let reply = client
        .unary::<BytesCodec>("/test.Test/Echo", Request::new(Bytes::from_static(b"new")))
        .await
        .expect("a call on a new connection");
    assert_eq!(reply.into_inner(), "new");
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("the server stops")
        .unwrap();
}

/// The link goes down under calls in flight (in a child process): they
/// fail promptly on the port error; then, with the device restored, a new
/// process connects and calls.
#[test]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
fn a_link_down_fails_calls_in_flight_and_the_device_recovers() {
    let env = TestEnv::from_env();
    let mut restore = DeviceRestore::new(&env);
    run_child("child_link_down");
    restore.now().unwrap();
    run_child("child_fresh_connection");
}

/// The server side of the wire cut: waits for the client's calls, then
/// for its handlers to end with the silent client (keepalive or retry
/// exhaustion).
async fn wire_server(address: &str) {
    let (probes, _, stop, server) = start_server(address, Some(KEEPALIVE)).await;
    assert!(
        probes
            .wait_until(Duration::from_secs(180), || probes
                .sleeping
                .load(Ordering::SeqCst)
                == CALLS)
            .await,
        "the client's calls never all arrived: {} of {CALLS}",
        probes.sleeping.load(Ordering::SeqCst)
    );
    let running = Instant::now();
    assert!(
        probes
            .wait_until(SERVER_NOTICES_WITHIN, || probes
                .cancelled
                .load(Ordering::SeqCst)
                == CALLS)
            .await,
        "the server's handlers still ran {SERVER_NOTICES_WITHIN:?} after the client's calls \
         arrived (its link was cut right after): {} of {CALLS} ended",
        probes.cancelled.load(Ordering::SeqCst)
    );
    eprintln!(
        "server: the handlers ended {:?} after the client's calls all ran",
        running.elapsed()
    );
    // The busy connection's endless stream ends with its connection too:
    // its keepalive ping finds the sink full (the dead client grants no
    // credits), is not sent, and the silence declares the client dead. A
    // graceful stop then has no call to wait for.
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect(
            "the server still had calls in flight 5 s after the stop: the busy connection's \
             endless stream outlived the cut",
        )
        .unwrap();
}

/// The client side of the wire cut: starts calls, waits until the server
/// runs them all, cuts its own link; its calls fail on the port error.
async fn wire_client(env: &TestEnv, address: &str) {
    let mut link = LinkCut::new(env);
    let idle = connect(address, Duration::from_secs(180)).await;
    let busy = connect(address, Duration::from_secs(30)).await;
    let calls = start_calls(&idle, &busy).await;
    // Until the server runs every sleeping call (asked over the wire).
    let started = Instant::now();
    loop {
        let reply = busy
            .unary::<BytesCodec>("/test.Probe/Sleeping", Request::new(Bytes::new()))
            .await
            .expect("the probe answers")
            .into_inner();
        let running = usize::from_le_bytes(reply[..].try_into().expect("a usize"));
        if running == CALLS {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the server runs {running} of the {CALLS} calls after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cut = Instant::now();
    link.down();
    expect_all_fail(calls, cut).await;
    // Keep the link down until the server must have noticed by itself.
    tokio::time::sleep(LINK_DOWN_FOR.saturating_sub(cut.elapsed())).await;
    link.up().unwrap();
}

/// Child: the two-host wire cut, as this host's role says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn child_wire_cut() {
    assert!(
        std::env::var_os(CHILD).is_some(),
        "the child half of a test: its parent runs it"
    );
    init_tracing();
    let env = TestEnv::from_env();
    transport_rdma::install();
    match env.role {
        Role::Server => wire_server(&format!("rdma://{}:{WIRE_PORT}", env.ip)).await,
        Role::Client => {
            let peer = env.peer.expect("checked in from_env");
            wire_client(&env, &format!("rdma://{peer}:{WIRE_PORT}")).await;
        }
        Role::Both => {
            let address = format!("rdma://{}:{WIRE_PORT}", env.ip);
            let server = tokio::spawn({
                let address = address.clone();
                async move { wire_server(&address).await }
            });
            wire_client(&env, &address).await;
            server.await.expect("the server side");
        }
    }
}

/// The client's link is cut mid-call (two hosts: the client guest cuts its
/// own; in a child process): its calls fail promptly, and the server's
/// handlers end within a bound though the server hears nothing more.
#[test]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
fn a_cut_mid_call_fails_both_ends_across_the_wire() {
    let env = TestEnv::from_env();
    // The server of a two-host run keeps its link up.
    let mut restore = (env.role != Role::Server).then(|| DeviceRestore::new(&env));
    run_child("child_wire_cut");
    if let Some(restore) = &mut restore {
        restore.now().unwrap();
        run_child("child_fresh_connection");
    }
}

/// The server of the two-host stream test.
const STREAM_WIRE_PORT: u16 = 7503;

/// The server side of the stream wire cut: an idle stream whose client's
/// link is cut must fail by itself, through the stream's keepalive.
async fn stream_wire_server(address: &str) {
    let cfg = RdmaTransport::default().stream_keepalive(Some(KEEPALIVE));
    let mut listener = cfg.bind_stream(address).await.expect("listens");
    let (mut stream, _) = tokio::time::timeout(Duration::from_secs(180), listener.accept())
        .await
        .expect("the client never came")
        .expect("accepts");
    let mut ready = [0; 5];
    stream.read_exact(&mut ready).await.expect("reads ready");
    stream.write_all(b"go").await.expect("writes go");
    // The client cuts its link once it reads "go"; nothing else is sent.
    let idle = Instant::now();
    let err = tokio::time::timeout(SERVER_NOTICES_WITHIN, stream.read(&mut [0; 16]))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the server's idle stream still waited {SERVER_NOTICES_WITHIN:?} after the \
                 client's link was cut (keepalive {KEEPALIVE:?})"
            )
        })
        .expect_err("an idle stream to a cut client read data or EOF");
    eprintln!(
        "server: the idle stream failed {:?} after go: {err}",
        idle.elapsed()
    );
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
}

/// The client side: says ready, reads go, cuts its own link; its own
/// stream fails on the port error.
async fn stream_wire_client(env: &TestEnv, address: &str) {
    let mut link = LinkCut::new(env);
    let cfg = RdmaTransport::default().stream_keepalive(Some(KEEPALIVE));
    let failing = format!("connecting to {address}");
    let mut stream = common::retrying(Duration::from_secs(180), &failing, || {
        cfg.connect_stream(address)
    })
    .await;
    stream.write_all(b"ready").await.expect("writes ready");
    let mut go = [0; 2];
    stream.read_exact(&mut go).await.expect("reads go");
    let cut = Instant::now();
    link.down();
    let err = tokio::time::timeout(FAIL_WITHIN, stream.read(&mut [0; 16]))
        .await
        .expect("the client's stream outlived its link")
        .expect_err("a stream over a downed link read data or EOF");
    eprintln!(
        "client: its stream failed {:?} after the cut: {err}",
        cut.elapsed()
    );
    tokio::time::sleep(LINK_DOWN_FOR.saturating_sub(cut.elapsed())).await;
    link.up().unwrap();
}

/// Child: the stream wire cut, as this host's role says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn child_stream_wire_cut() {
    assert!(
        std::env::var_os(CHILD).is_some(),
        "the child half of a test: its parent runs it"
    );
    init_tracing();
    let env = TestEnv::from_env();
    match env.role {
        Role::Server => stream_wire_server(&format!("rdma://{}:{STREAM_WIRE_PORT}", env.ip)).await,
        Role::Client => {
            let peer = env.peer.expect("checked in from_env");
            stream_wire_client(&env, &format!("rdma://{peer}:{STREAM_WIRE_PORT}")).await;
        }
        Role::Both => {
            let address = format!("rdma://{}:{STREAM_WIRE_PORT}", env.ip);
            let server = tokio::spawn({
                let address = address.clone();
                async move { stream_wire_server(&address).await }
            });
            stream_wire_client(&env, &address).await;
            server.await.expect("the server side");
        }
    }
}

/// An idle `RdmaStream` whose peer's link is cut (two hosts: the client
/// guest cuts its own) fails at both ends: the client's on the port error,
/// the server's (whose port stays up, and who hears nothing more) through
/// its keepalive's probe running out of retries.
#[test]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
fn a_cut_fails_an_idle_stream_at_both_ends_across_the_wire() {
    let env = TestEnv::from_env();
    let mut restore = (env.role != Role::Server).then(|| DeviceRestore::new(&env));
    run_child("child_stream_wire_cut");
    if let Some(restore) = &mut restore {
        restore.now().unwrap();
        run_child("child_fresh_connection");
    }
}
