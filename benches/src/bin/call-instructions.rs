//! Unary echo calls, client and server in one process on a current-thread
//! runtime, for `valgrind --tool=callgrind` to count instructions:
//!
//! ```text
//! call-instructions SYSTEM CALLS SIZE
//! ```
//!
//! SYSTEM is `rpc` (rdma-rpc's generated `Echo` over `tcp://`), `rpc-64`
//! (the same, 64 tasks making calls at once on one channel),
//! `rpc-64-deadline` (`rpc-64` with a 10 s timeout on every call: 64
//! deadlines open at once on the connection's one timer), `rpc-mem`
//! (the same over `mem://`), `rpc-rdma` (the same over `rdma://` on the
//! device of `RDMA_TEST_IP`: in a Soft-RoCE guest, `cargo xtask rxe`),
//! `rpc-metrics` (`rpc` with `rpc-metrics`
//! recording on both sides), `rpc-intercept` (`rpc` with an interceptor
//! that does nothing on both sides: the hooks' own cost), `rpc-inline`
//! (`rpc` with the server's handlers run on the connection's reader:
//! `ServerBuilder::inline_handlers`), `rpc-deadline` (`rpc` with a 10 s
//! timeout on every call: the deadline's cost, both sides), `tonic` (tonic's generated `Echo`
//! over loopback TCP, the same proto) or `raw` (length-prefixed frames over loopback TCP,
//! no RPC: the floor). Per call = (count at 2,200 calls − count at 200) /
//! 2,000, so set-up cancels out; `cargo xtask bench --instructions` runs it.
use benches::client::{self, Client, RawConnection};
use benches::server::{self, RpcEcho};
use benches::{rpcbench, tcp_authority, Error, System, MAX_MESSAGE_SIZE};
use bytes::Bytes;
use prometheus_client::registry::Registry;
use rpc_core::intercept::CallHead;
use rpc_core::{Endpoint, Server, ServerBuilder};
use rpc_metrics::RpcMetrics;
use std::time::Duration;

const USAGE: &str = "usage: call-instructions \
    rpc|rpc-64|rpc-64-deadline|rpc-mem|rpc-rdma|rpc-metrics|rpc-intercept|rpc-inline|rpc-deadline|tonic|raw CALLS SIZE";

/// Calls `rpc-64` and `rpc-64-deadline` keep in flight.
const IN_FLIGHT: usize = 64;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [system, calls, size] = &args[..] else {
        return Err(USAGE.into());
    };
    let calls: usize = calls.parse().map_err(|_| USAGE)?;
    let payload = Bytes::from(vec![7u8; size.parse().map_err(|_| USAGE)?]);
    benches::install_transports();
    match system.as_str() {
        "rpc" => unary(System::Rpc, "tcp://127.0.0.1:0", calls, &payload).await,
        "rpc-mem" => unary(System::Rpc, "mem://call-instructions", calls, &payload).await,
        "rpc-rdma" => {
            let ip = std::env::var("RDMA_TEST_IP")
                .map_err(|_| "rpc-rdma needs RDMA_TEST_IP, an address on an RDMA device (cargo xtask rxe sets it)")?;
            unary(System::Rpc, &format!("rdma://{ip}:0"), calls, &payload).await
        }
        "tonic" => unary(System::Tonic, "tcp://127.0.0.1:0", calls, &payload).await,
        "rpc-metrics" => {
            let metrics = RpcMetrics::register(&mut Registry::default());
            let server = Server::builder().intercept(metrics.server());
            custom(server, |e| e.intercept(metrics.client()), calls, &payload).await
        }
        "rpc-intercept" => {
            let pass = |_: &mut CallHead<'_>| Ok(());
            let server = Server::builder().intercept(pass);
            custom(server, |e| e.intercept(pass), calls, &payload).await
        }
        "rpc-deadline" => {
            let endpoint = |e: Endpoint| e.timeout(Duration::from_secs(10));
            custom(Server::builder(), endpoint, calls, &payload).await
        }
        "rpc-inline" => {
            let server = Server::builder().inline_handlers(true);
            custom(server, |e| e, calls, &payload).await
        }
        "rpc-64" => pipelined(None, calls, &payload).await,
        "rpc-64-deadline" => pipelined(Some(Duration::from_secs(10)), calls, &payload).await,
        "raw" => {
            let (address, serving) = server::start(System::Raw, "tcp://127.0.0.1:0").await?;
            tokio::spawn(serving);
            let mut connection =
                RawConnection::connect(tcp_authority(&address)?, payload.len()).await?;
            for _ in 0..calls {
                connection.ping().await?;
            }
            Ok(())
        }
        _ => Err(USAGE.into()),
    }
}

/// `calls` echo calls to `system`'s server on `listen`, one at a time.
async fn unary(system: System, listen: &str, calls: usize, payload: &Bytes) -> Result<(), Error> {
    let (address, serving) = server::start(system, listen).await?;
    tokio::spawn(serving);
    let mut client = client::connect(system, &address).await?;
    for _ in 0..calls {
        client.echo(payload).await?;
    }
    Ok(())
}

/// `calls` echo calls from [`IN_FLIGHT`] tasks at once, each its share,
/// on one channel, each call with `timeout` if there is one.
async fn pipelined(timeout: Option<Duration>, calls: usize, payload: &Bytes) -> Result<(), Error> {
    let (address, serving) = server::start(System::Rpc, "tcp://127.0.0.1:0").await?;
    tokio::spawn(serving);
    // `client::connect`'s channel, with the timeout it has no setting for.
    let mut endpoint = Endpoint::new(&address)?.max_message_size(MAX_MESSAGE_SIZE);
    if let Some(timeout) = timeout {
        endpoint = endpoint.timeout(timeout);
    }
    let channel = endpoint.connect().await?;
    let client = Client::Rpc(rpcbench::bench_client::BenchClient::new(channel));
    let callers: Vec<_> = (0..IN_FLIGHT)
        .map(|i| {
            let (mut client, payload) = (client.clone(), payload.clone());
            let share = calls / IN_FLIGHT + usize::from(i < calls % IN_FLIGHT);
            tokio::spawn(async move {
                for _ in 0..share {
                    client.echo(&payload).await?;
                }
                Ok::<_, Error>(())
            })
        })
        .collect();
    for caller in callers {
        caller.await??;
    }
    Ok(())
}

/// As `rpc`, with the server built from `server` and the client's endpoint
/// configured by `endpoint`.
async fn custom(
    server: ServerBuilder,
    endpoint: impl FnOnce(Endpoint) -> Endpoint,
    calls: usize,
    payload: &Bytes,
) -> Result<(), Error> {
    let server = server
        .add_service(rpcbench::bench_server::BenchServer::new(RpcEcho))
        .bind("tcp://127.0.0.1:0")
        .await?;
    let address = server.local_addr().to_string();
    tokio::spawn(server.serve());
    let channel = endpoint(Endpoint::new(&address)?).connect().await?;
    let mut client = Client::Rpc(rpcbench::bench_client::BenchClient::new(channel));
    for _ in 0..calls {
        client.echo(payload).await?;
    }
    Ok(())
}
