//! What every transport's test suite shares: a test service written against
//! `rpc_core::codegen` by hand (raw bytes, no protobuf), a test server, and
//! the integration [`cases`], listed once in [`for_each_case!`] so that each
//! suite runs all of them over its own addresses without copying the list.
//!
//! ```ignore
//! macro_rules! over_my_transport {
//!     ($($case:ident),* $(,)?) => {$(
//!         #[tokio::test]
//!         async fn $case() {
//!             my_transport::install();
//!             let profile = rpc_test_support::cases::Profile::standard();
//!             rpc_test_support::cases::$case("my://127.0.0.1:0".into(), &profile).await
//!         }
//!     )*};
//! }
//! rpc_test_support::for_each_case!(over_my_transport);
//! ```

pub mod cases;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use bytes::Bytes;
use futures::StreamExt;
use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
use rpc_core::{BytesCodec, Request, Response, ServerBuilder, Status, Streaming};

/// Counters the tests read to see what the server did; tests wait on them
/// with [`Probes::wait_until`], woken by each change (no polling).
#[derive(Default)]
pub struct Probes {
    /// Messages the `Count` stream has produced.
    pub produced: AtomicUsize,
    /// `Sleep` handlers that were dropped before finishing (cancelled).
    pub cancelled: AtomicUsize,
    /// `Sleep` handlers that started.
    pub sleeping: AtomicUsize,
    changed: Notify,
}

impl Probes {
    fn bump(&self, counter: &AtomicUsize) {
        counter.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Waits until `condition` holds, checking it again at each change of a
    /// probe; false if `within` passes first (the bound only fails the
    /// test: it is never what the test waits for).
    pub async fn wait_until(&self, within: Duration, mut condition: impl FnMut() -> bool) -> bool {
        let wait = async {
            loop {
                let changed = self.changed.notified();
                let mut changed = std::pin::pin!(changed);
                // Registered before the check: a change between the check
                // and the await still wakes it.
                changed.as_mut().enable();
                if condition() {
                    return;
                }
                changed.await;
            }
        };
        tokio::time::timeout(within, wait).await.is_ok()
    }
}

/// `test.Test`: Echo, Peer (answers the client's address), Identity (the identity its transport proved), Fail, Sleep, Panic (unary); Count (server streaming);
/// Sum (client streaming); Chat (bidi); Hold (client streaming that waits before reading).
#[derive(Clone, Default)]
pub struct TestService {
    /// What the handlers did, for the tests to read.
    pub probes: Arc<Probes>,
}

struct CancelProbe(Arc<Probes>, bool);

impl Drop for CancelProbe {
    fn drop(&mut self) {
        if !self.1 {
            self.0.bump(&self.0.cancelled);
        }
    }
}

/// A `Sleep` request: the handler sleeps `millis` then answers.
pub fn sleep_request(millis: u32) -> Bytes {
    Bytes::copy_from_slice(&millis.to_le_bytes())
}

/// Request for `Count`: how many messages, and how large each.
pub fn count_request(messages: u32, size: u32) -> Bytes {
    let mut v = messages.to_le_bytes().to_vec();
    v.extend_from_slice(&size.to_le_bytes());
    v.into()
}

/// The `i`-th message of a `Count` stream of `size` bytes: its index, repeated.
pub fn count_message(i: u32, size: u32) -> Bytes {
    let bytes = i.to_le_bytes();
    (0..size as usize)
        .map(|k| bytes[k % 4])
        .collect::<Vec<u8>>()
        .into()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

impl Service for TestService {
    fn name(&self) -> &'static str {
        "test.Test"
    }

    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
        let probes = Arc::clone(&self.probes);
        match method {
            "Echo" => {
                codegen::unary::<BytesCodec, _, _>(call, |request: Request<Bytes>| async move {
                    let echo = request.metadata().get("x-echo").cloned();
                    let mut response = Response::new(request.into_inner());
                    if let Some(value) = echo {
                        response.metadata_mut().insert("x-echo", value);
                    }
                    Ok(response)
                })
            }
            // The request echoed from a payload buffer of the call's
            // connection.
            "EchoInPayloadBuffer" => {
                codegen::unary::<BytesCodec, _, _>(call, |request: Request<Bytes>| async move {
                    let mut buffer = request.payload_buffer(request.get_ref().len()).await?;
                    buffer.copy_from_slice(request.get_ref());
                    Ok(Response::new(buffer.freeze()))
                })
            }
            "Peer" => {
                codegen::unary::<BytesCodec, _, _>(call, |request: Request<Bytes>| async move {
                    let peer = request.peer().map(|p| p.address().to_string());
                    Ok(Response::new(Bytes::from(peer.unwrap_or_default())))
                })
            }
            "Thread" => {
                codegen::unary::<BytesCodec, _, _>(call, |_request: Request<Bytes>| async move {
                    let thread = std::thread::current().name().unwrap_or("").to_string();
                    Ok(Response::new(Bytes::from(thread)))
                })
            }
            "Identity" => {
                codegen::unary::<BytesCodec, _, _>(call, |request: Request<Bytes>| async move {
                    let identity = request
                        .peer()
                        .and_then(|p| p.identity().map(str::to_string));
                    Ok(Response::new(Bytes::from(identity.unwrap_or_default())))
                })
            }
            "Fail" => {
                codegen::unary::<BytesCodec, _, _>(call, |_request: Request<Bytes>| async move {
                    let mut status = Status::not_found("nothing here");
                    status.metadata_mut().insert("x-reason", "test");
                    Err::<Response<Bytes>, _>(status)
                })
            }
            "Sleep" => codegen::unary::<BytesCodec, _, _>(
                call,
                move |request: Request<Bytes>| async move {
                    probes.bump(&probes.sleeping);
                    let mut probe = CancelProbe(Arc::clone(&probes), false);
                    let millis = u32_at(&request.into_inner(), 0);
                    tokio::time::sleep(Duration::from_millis(millis.into())).await;
                    probe.1 = true;
                    Ok(Response::new(Bytes::from_static(b"slept")))
                },
            ),
            "Panic" => {
                codegen::unary::<BytesCodec, _, _>(call, |_request: Request<Bytes>| async move {
                    if true {
                        panic!("the handler was asked to panic");
                    }
                    Ok(Response::new(Bytes::new()))
                })
            }
            "Count" => codegen::server_streaming::<BytesCodec, _, _, _>(
                call,
                move |request: Request<Bytes>| async move {
                    let body = request.into_inner();
                    let (n, size) = (u32_at(&body, 0), u32_at(&body, 4));
                    let stream = futures::stream::iter(0..n).map(move |i| {
                        probes.bump(&probes.produced);
                        Ok(count_message(i, size))
                    });
                    Ok(Response::new(stream))
                },
            ),
            "Sum" => codegen::client_streaming::<BytesCodec, _, _>(
                call,
                |request: Request<Streaming<Bytes>>| async move {
                    let mut stream = request.into_inner();
                    let (mut messages, mut bytes) = (0u64, 0u64);
                    while let Some(message) = stream.message().await? {
                        messages += 1;
                        bytes += message.len() as u64;
                    }
                    let mut reply = messages.to_le_bytes().to_vec();
                    reply.extend_from_slice(&bytes.to_le_bytes());
                    Ok(Response::new(Bytes::from(reply)))
                },
            ),
            "Hold" => codegen::client_streaming::<BytesCodec, _, _>(
                call,
                |request: Request<Streaming<Bytes>>| async move {
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    let mut stream = request.into_inner();
                    let mut messages = 0u64;
                    while stream.message().await?.is_some() {
                        messages += 1;
                    }
                    Ok(Response::new(Bytes::from(messages.to_le_bytes().to_vec())))
                },
            ),
            "Chat" => codegen::streaming::<BytesCodec, _, _, _>(
                call,
                |request: Request<Streaming<Bytes>>| async move {
                    let replies = request
                        .into_inner()
                        .map(|m| m.map(|b| Bytes::from([&b[..], b"!"].concat())));
                    Ok(Response::new(replies))
                },
            ),
            _ => codegen::unimplemented(call),
        }
    }
}

/// Whether the [`TestServer`]s this process starts run their handlers on
/// the connection's reader first ([`ServerBuilder::inline_handlers`]).
static INLINE_HANDLERS: AtomicBool = AtomicBool::new(false);

/// Makes every [`TestServer`] this process starts from now on run its
/// handlers on the connection's reader first
/// ([`ServerBuilder::inline_handlers`]): for a suite that runs the shared
/// cases that way, in a test binary (a process) of its own.
pub fn start_servers_with_inline_handlers() {
    INLINE_HANDLERS.store(true, Ordering::Relaxed);
}

/// Threads the [`TestServer`]s this process starts serve their connections
/// on ([`ServerBuilder::thread_per_core`]); 0 for the caller's runtime.
static THREAD_PER_CORE: AtomicUsize = AtomicUsize::new(0);

/// Makes every [`TestServer`] this process starts from now on serve each
/// connection on one of `threads` threads of its own
/// ([`ServerBuilder::thread_per_core`]): for a suite that runs the shared
/// cases that way, in a test binary (a process) of its own.
pub fn start_servers_thread_per_core(threads: usize) {
    THREAD_PER_CORE.store(threads, Ordering::Relaxed);
}

/// A builder serving `service` as this process's settings say.
fn server_builder(service: TestService) -> ServerBuilder {
    let builder = rpc_core::Server::builder()
        .inline_handlers(INLINE_HANDLERS.load(Ordering::Relaxed))
        .add_service(service);
    match THREAD_PER_CORE.load(Ordering::Relaxed) {
        0 => builder,
        threads => builder.thread_per_core(threads),
    }
}

/// A running test server; dropping the handle does not stop it, `stop` does.
pub struct TestServer {
    /// The address it listens on, port chosen.
    pub address: String,
    /// Its service's probes.
    pub probes: Arc<Probes>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    /// The serving task: it ends when the server stops.
    pub task: tokio::task::JoinHandle<Result<(), rpc_core::ServeError>>,
}

impl TestServer {
    /// Starts `TestService` on `address` (port 0 / any free name) with `configure` applied.
    pub async fn start(
        address: &str,
        configure: impl FnOnce(ServerBuilder) -> ServerBuilder,
    ) -> TestServer {
        let service = TestService::default();
        let probes = Arc::clone(&service.probes);
        let server = configure(server_builder(service))
            .bind(address)
            .await
            .expect("test server binds");
        let address = server.local_addr().to_string();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server.serve_with_shutdown(async {
            let _ = rx.await;
        }));
        TestServer {
            address,
            probes,
            shutdown: Some(tx),
            task,
        }
    }

    /// [`start`](Self::start), but served from a current-thread runtime
    /// in a thread of its own, which ends, and drops the runtime with every
    /// task still on it, as soon as `serve_with_shutdown` returns: as a
    /// `main` that returns after serving does. ([`kill`](Self::kill) does
    /// not stop it.)
    pub async fn start_on_own_runtime(
        address: &str,
        configure: impl FnOnce(ServerBuilder) -> ServerBuilder,
    ) -> TestServer {
        let service = TestService::default();
        let probes = Arc::clone(&service.probes);
        let builder = configure(server_builder(service));
        let address = address.to_string();
        let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::task::spawn_blocking(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the test server");
            runtime.block_on(async move {
                let server = builder.bind(&address).await.expect("test server binds");
                let _ = bound_tx.send(server.local_addr().to_string());
                server
                    .serve_with_shutdown(async {
                        let _ = rx.await;
                    })
                    .await
            })
        });
        let address = bound_rx.await.expect("the test server's thread bound it");
        TestServer {
            address,
            probes,
            shutdown: Some(tx),
            task,
        }
    }

    /// Graceful shutdown; waits until the server has drained, a minute at
    /// most (a call or connection that never ends fails the test instead of
    /// hanging it).
    pub async fn stop(mut self) {
        let _ = self.shutdown.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(60), &mut self.task)
            .await
            .expect("the server drained within a minute (a call or connection never ended?)")
            .unwrap()
            .unwrap();
    }

    /// Kills the server: its serve future is dropped mid-flight.
    pub async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// A unique `mem://` address.
pub fn mem_address() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "mem://test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Polls `condition` every 10 ms until it holds or `within` passes: only for
/// conditions no event announces (an operating-system counter); wait on the
/// service's [`Probes::wait_until`] instead.
pub async fn eventually(within: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if condition() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    condition()
}
