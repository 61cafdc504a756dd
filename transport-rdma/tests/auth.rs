//! The authenticated handshake on a real device: a listener with a shared
//! secret serves only clients that prove it (no handler of the others'
//! runs), a client with a secret talks only to servers that prove it, an
//! allow-list refuses other addresses, and a recorded proof cannot be
//! replayed. Refused clients fail with `PermissionDenied` saying why.
//!
//! In a two-host run the RPC test (`…_across_the_wire`) runs across the
//! hosts; the others use one device and the two-host suite leaves them out.

mod common;

use std::io::ErrorKind;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Role, TestEnv};
use rpc_core::{BytesCodec, Client, Endpoint, Request};
use rpc_test_support::TestServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport_rdma::proto::auth::{self, ProofRefused};
use transport_rdma::proto::{Hello, Refused};
use transport_rdma::verbs::{self, CmId, EventChannel};
use transport_rdma::{RdmaListener, RdmaTransport, SharedSecret};

const RPC_PORT: u16 = 7511;

fn secret(s: &str) -> SharedSecret {
    SharedSecret::new(s).expect("long enough")
}

fn with_secret(s: &str) -> RdmaTransport {
    RdmaTransport::default().auth_secret(Some(secret(s)))
}

fn register(transport: RdmaTransport) {
    rpc_core::transport::register(Arc::new(transport));
}

/// One call of `method` on a new channel to `address`.
async fn call(address: &str, method: &str) -> Result<Bytes, String> {
    let channel = Endpoint::new(address)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    Client::new(channel)
        .unary::<BytesCodec>(
            &format!("/test.Test/{method}"),
            Request::new(Bytes::from("hi")),
        )
        .await
        .map(|r| r.into_inner())
        .map_err(|s| s.to_string())
}

/// Clients without the secret, or with another, are refused; clients with
/// it are served, and their handler sees them as authenticated. The
/// server counts the calls that reached it: only the authenticated ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn only_clients_that_prove_the_secret_get_a_handler_to_run_across_the_wire() {
    let env = TestEnv::from_env();
    const KEY: &str = "the cluster's secret, 32 bytes..";
    let reached = Arc::new(AtomicUsize::new(0));
    let server = if env.role == Role::Client {
        None
    } else {
        register(with_secret(KEY));
        let port = if env.role == Role::Both { 0 } else { RPC_PORT };
        let reached = Arc::clone(&reached);
        Some(
            TestServer::start(&format!("rdma://{}:{port}", env.ip), move |b| {
                b.intercept(move |_: &mut rpc_core::intercept::CallHead<'_>| {
                    reached.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                })
            })
            .await,
        )
    };
    let authenticated_calls = 2;
    if env.role == Role::Server {
        let done = rpc_test_support::eventually(Duration::from_secs(120), || {
            reached.load(Ordering::SeqCst) >= authenticated_calls
        })
        .await;
        assert!(done, "the client's authenticated calls never came");
        // The client's refused attempts came before its last call.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(reached.load(Ordering::SeqCst), authenticated_calls);
        server.unwrap().stop().await;
        return;
    }
    let address = match &server {
        Some(server) => server.address.clone(),
        None => format!("rdma://{}:{RPC_PORT}", env.peer.expect("checked")),
    };
    // With the secret (retrying while a two-host server starts).
    register(with_secret(KEY));
    let identity = common::retrying(
        common::PEER_PATIENCE,
        "an authenticated client was not served",
        || call(&address, "Identity"),
    )
    .await;
    assert_eq!(
        &identity[..],
        b"rdma-secret",
        "the handler sees the proven peer"
    );
    // Without a secret, with another one: refused, saying why.
    for (client, says) in [
        (RdmaTransport::default(), "prove its shared secret"),
        (
            with_secret("another secret of 32 bytes......"),
            "wrong proof",
        ),
    ] {
        register(client);
        let err = call(&address, "Echo")
            .await
            .expect_err("served without the secret");
        assert!(err.contains(says), "{err:?} does not say {says:?}");
    }
    register(with_secret(KEY));
    assert_eq!(&call(&address, "Echo").await.unwrap()[..], b"hi");
    if let Some(server) = server {
        assert_eq!(
            reached.load(Ordering::SeqCst),
            authenticated_calls,
            "only the authenticated clients' calls reached the server"
        );
        server.stop().await;
    }
}

/// Connect requests this process's listeners refused for `reason`, as
/// the transport reports them for metrics.
fn refusals(reason: &str) -> u64 {
    use rpc_core::transport::Transport;
    RdmaTransport::default()
        .stats()
        .into_iter()
        .find(|s| {
            s.name == "rdma_connections_refused"
                && s.labels.contains(&("reason", reason.to_string()))
        })
        .unwrap_or_else(|| panic!("no rdma_connections_refused{{reason={reason:?}}}"))
        .value
}

async fn refused(client: &RdmaTransport, addr: &str, says: &str) {
    let err = client.connect_stream(addr).await.expect_err("connected");
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    assert!(
        err.to_string().contains(says),
        "{err} does not say {says:?}"
    );
}

/// Connects, sends a message and reads it at the server; the server's
/// stream sees the client as `identity`.
async fn echo_once(
    listener: &mut RdmaListener,
    client: &RdmaTransport,
    addr: &str,
    identity: Option<&str>,
) {
    let (client, server) = tokio::join!(client.connect_stream(addr), listener.accept());
    let (mut client, mut server) = (client.expect("connects"), server.expect("accepts").0);
    assert_eq!(server.peer_identity(), identity);
    assert_eq!(
        client.peer_identity(),
        identity,
        "the client proved the server too"
    );
    client.write_all(b"ping").await.unwrap();
    let mut got = [0; 4];
    server.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"ping");
}

/// Every mismatch between the two sides' settings is refused, with a
/// reason naming it; matching sides connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn mismatched_secrets_and_addresses_off_the_allow_list_are_refused() {
    let env = TestEnv::from_env();
    let key = "sixteen byte key";
    let mut guarded = with_secret(key)
        .bind_stream(&env.local_listen())
        .await
        .unwrap();
    let addr = guarded.local_addr().to_string();
    let (proofs, addresses) = (refusals("proof_refused"), refusals("not_allowed"));
    refused(&RdmaTransport::default(), &addr, "prove its shared secret").await;
    refused(&with_secret("another key, 16b"), &addr, "wrong proof").await;
    assert_eq!(
        refusals("proof_refused"),
        proofs + 1,
        "a wrong proof is counted, a challenge is not"
    );
    let t = Instant::now();
    echo_once(&mut guarded, &with_secret(key), &addr, Some("rdma-secret")).await;
    eprintln!("authenticated connect and echo: {:?}", t.elapsed());

    let mut open = RdmaTransport::default()
        .bind_stream(&env.local_listen())
        .await
        .unwrap();
    let open_addr = open.local_addr().to_string();
    refused(&with_secret(key), &open_addr, "accepted without proving").await;
    // That client asked for a challenge without a queue pair; the open
    // listener's accept of it fails, and it hands out nothing.
    let t = Instant::now();
    echo_once(&mut open, &RdmaTransport::default(), &open_addr, None).await;
    eprintln!("plain connect and echo: {:?}", t.elapsed());

    let elsewhere = RdmaTransport::default()
        .allow_peers(["192.0.2.0/24".parse().unwrap()])
        .bind_stream(&env.local_listen())
        .await
        .unwrap();
    refused(
        &RdmaTransport::default(),
        elsewhere.local_addr(),
        "allow-list",
    )
    .await;
    assert_eq!(refusals("not_allowed"), addresses + 1);
    let ours = format!("{}/32", env.ip).parse().unwrap();
    let mut both = with_secret(key)
        .allow_peers([ours])
        .bind_stream(&env.local_listen())
        .await
        .unwrap();
    let both_addr = both.local_addr().to_string();
    refused(
        &RdmaTransport::default(),
        &both_addr,
        "prove its shared secret",
    )
    .await;
    echo_once(
        &mut both,
        &with_secret(key),
        &both_addr,
        Some("rdma-secret"),
    )
    .await;
}

/// A connect request with `private_data` and no queue pair: the listener's
/// answer (a rejection), or whatever else ended it.
fn raw_connect(addr: std::net::SocketAddr, private_data: &[u8]) -> Result<Vec<u8>, verbs::Error> {
    let channel = EventChannel::new()?;
    let mut id = CmId::new(&channel)?;
    id.resolve_from(None, addr, Duration::from_secs(5))?;
    id.connect(private_data, Duration::from_secs(5))
}

fn rejection(result: Result<Vec<u8>, verbs::Error>) -> Refused {
    match result {
        Err(verbs::Error::Rejected { private_data, .. }) => {
            Refused::decode(&private_data).expect("a refusal of ours")
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// A proof recorded from a connect that was accepted does not admit a
/// second connection; a proof for a challenge from another listener, or
/// with a flipped bit, is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn a_recorded_proof_cannot_be_replayed() {
    let env = TestEnv::from_env();
    let key = secret("sixteen byte key");
    let listener = RdmaTransport::default()
        .auth_secret(Some(key.clone()))
        .connect_timeout(Duration::from_secs(2))
        .bind_stream(&env.local_listen())
        .await
        .unwrap();
    let addr: std::net::SocketAddr = listener
        .local_addr()
        .strip_prefix("rdma://")
        .unwrap()
        .parse()
        .unwrap();
    let hello = Hello {
        ring_slots: 64,
        initial_slots: 8,
        slot_size: 8192,
        region_len: 1 << 20,
        reads_rendezvous: false,
    }
    .to_bytes();
    let blocking = move |f: Box<dyn FnOnce() -> Result<Vec<u8>, verbs::Error> + Send>| {
        tokio::task::spawn_blocking(f)
    };
    let Refused::Challenge(challenge) = rejection(
        blocking(Box::new(move || raw_connect(addr, &hello)))
            .await
            .unwrap(),
    ) else {
        panic!("a request without a proof gets a challenge");
    };
    let request = auth::proven_request(&key, hello, &challenge);
    // Tampered: one bit of the proof flipped.
    let mut tampered = request;
    tampered[auth::PROVEN_REQUEST_LEN - 1] ^= 1;
    assert_eq!(
        rejection(
            blocking(Box::new(move || raw_connect(addr, &tampered)))
                .await
                .unwrap()
        ),
        Refused::Proof(ProofRefused::WrongProof)
    );
    // The genuine answer is accepted (this queue-pair-less client cannot
    // finish the connection; the listener gives up on it)...
    let first = blocking(Box::new(move || raw_connect(addr, &request)))
        .await
        .unwrap();
    assert!(
        !matches!(first, Err(verbs::Error::Rejected { .. })),
        "the genuine proof was refused: {first:?}"
    );
    // ... and the same bytes again are a replay.
    assert_eq!(
        rejection(
            blocking(Box::new(move || raw_connect(addr, &request)))
                .await
                .unwrap()
        ),
        Refused::Proof(ProofRefused::Replayed)
    );
    // A challenge issued by another listener does not count here.
    let other = RdmaTransport::default()
        .auth_secret(Some(key.clone()))
        .bind_stream(&env.local_listen())
        .await
        .unwrap();
    let other_addr: std::net::SocketAddr = other
        .local_addr()
        .strip_prefix("rdma://")
        .unwrap()
        .parse()
        .unwrap();
    let Refused::Challenge(foreign) = rejection(
        blocking(Box::new(move || raw_connect(other_addr, &hello)))
            .await
            .unwrap(),
    ) else {
        panic!("a request without a proof gets a challenge");
    };
    let request = auth::proven_request(&key, hello, &foreign);
    assert_eq!(
        rejection(
            blocking(Box::new(move || raw_connect(addr, &request)))
                .await
                .unwrap()
        ),
        Refused::Proof(ProofRefused::Forged)
    );
    drop(listener);
}

/// Many authenticated connects from one process at once all get in: each
/// challenge request (which has no queue pair) names the queue pair its
/// connection will use, so the connection manager never takes two of them
/// for one stale connection (they all named queue pair 0 before, and a
/// burst could be refused "reject status 10").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn concurrent_authenticated_connects_from_one_host_all_get_in() {
    const AT_ONCE: usize = 16;
    let env = TestEnv::from_env();
    let key = "sixteen byte key";
    let mut listener = with_secret(key)
        .bind_stream(&env.local_listen())
        .await
        .unwrap();
    let addr = listener.local_addr().to_string();
    let accepting = tokio::spawn(async move {
        let mut streams = Vec::new();
        while streams.len() < AT_ONCE {
            let (stream, _) = listener.accept().await.expect("accepts");
            streams.push(stream);
        }
        streams
    });
    let client = with_secret(key);
    let connects = (0..AT_ONCE).map(|_| client.connect_stream(&addr));
    let connected = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        futures::future::join_all(connects),
    )
    .await
    .unwrap_or_else(|_| {
        panic!(
            "{AT_ONCE} connects at once not all done within 60 s; the connections:\n{}",
            transport_rdma::debug_dump()
        )
    });
    for (i, stream) in connected.into_iter().enumerate() {
        let stream = stream.unwrap_or_else(|e| panic!("connect {i} of {AT_ONCE}: {e}"));
        assert_eq!(stream.peer_identity(), Some(auth::PROVEN_IDENTITY));
    }
    let streams = tokio::time::timeout(std::time::Duration::from_secs(60), accepting)
        .await
        .expect("the server accepted them all")
        .unwrap();
    assert!(streams
        .iter()
        .all(|s| s.peer_identity() == Some(auth::PROVEN_IDENTITY)));
}
