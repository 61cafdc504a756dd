//! `tls://`: calls over TLS, mutual TLS and the identity handlers see, and
//! every refusal with the error it gives (an untrusted CA, an expired
//! certificate, a client without a certificate or with one from another
//! CA: the call fails and no handler runs), a stalled handshake that does
//! not hold up other clients, configuration errors naming their file.
//!
//! Each test registers its own TLS configurations under schemes of its
//! own (`TlsTransportBuilder::scheme`), so tests running at once in this
//! process do not replace each other's; a client reaches a server's port
//! through its own scheme (`common::on`).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{on, Ca, Files, Leaf, Usage};
use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
use rpc_core::{BytesCodec, Channel, Client, Code, Endpoint, Request, Response};
use rpc_test_support::TestServer;
use tokio::io::AsyncReadExt;
use transport_tcp::tls::{TlsConfigError, TlsTransport, TlsTransportBuilder};

/// `auth.Who/Identity`: answers the caller's identity and counts its runs.
#[derive(Clone, Default)]
struct Who {
    runs: Arc<AtomicUsize>,
}

impl Service for Who {
    fn name(&self) -> &'static str {
        "auth.Who"
    }

    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
        let runs = Arc::clone(&self.runs);
        match method {
            "Identity" => codegen::unary::<BytesCodec, _, _>(
                call,
                move |request: Request<Bytes>| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let identity = request.peer().and_then(|p| p.identity()).unwrap_or("");
                    Ok(Response::new(Bytes::from(identity.to_string())))
                },
            ),
            _ => codegen::unimplemented(call),
        }
    }
}

/// Registers `builder` under `scheme`.
fn register(scheme: &'static str, builder: TlsTransportBuilder) {
    let tls = builder.scheme(scheme).build().expect("TLS configuration");
    rpc_core::transport::register(Arc::new(tls));
}

fn server_builder(ca: &Ca, server: &Leaf) -> TlsTransportBuilder {
    TlsTransport::builder()
        .ca_file(&ca.cert_file)
        .cert_file(&server.cert_file)
        .key_file(&server.key_file)
}

/// Starts `Who` on `scheme://127.0.0.1:0`; its address, runs and the server.
async fn start_who(scheme: &str) -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let who = Who::default();
    let runs = Arc::clone(&who.runs);
    let server = rpc_core::Server::builder()
        .add_service(who)
        .bind(&format!("{scheme}://127.0.0.1:0"))
        .await
        .expect("binds");
    let address = server.local_addr().to_string();
    let task = tokio::spawn(async move {
        let _ = server.serve().await;
    });
    (address, runs, task)
}

async fn identity_call(channel: Channel) -> Result<String, rpc_core::Status> {
    let reply = Client::new(channel)
        .unary::<BytesCodec>("/auth.Who/Identity", Request::new(Bytes::new()))
        .await?;
    Ok(String::from_utf8(reply.into_inner().to_vec()).unwrap())
}

#[tokio::test]
async fn a_call_over_tls_reaches_the_test_service_and_the_peer_address_says_tls() {
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    let server = ca.issue(&files, "server", &["127.0.0.1"], Usage::Server, false);
    register("tls-plain", server_builder(&ca, &server));

    let test_server = TestServer::start("tls-plain://127.0.0.1:0", |b| b).await;
    assert!(test_server.address.starts_with("tls-plain://127.0.0.1:"));
    let client = Client::new(Channel::connect(&test_server.address).await.unwrap());
    let reply = client
        .unary::<BytesCodec>(
            "/test.Test/Echo",
            Request::new(Bytes::from_static(b"sealed")),
        )
        .await
        .unwrap();
    assert_eq!(reply.into_inner(), "sealed");
    // Without client certificates, handlers see no identity.
    let identity = client
        .unary::<BytesCodec>("/test.Test/Identity", Request::new(Bytes::new()))
        .await
        .unwrap();
    assert_eq!(
        identity.into_inner(),
        "",
        "no client certificate, no identity"
    );
    let peer = client
        .unary::<BytesCodec>("/test.Test/Peer", Request::new(Bytes::new()))
        .await
        .unwrap();
    let peer = String::from_utf8(peer.into_inner().to_vec()).unwrap();
    assert!(peer.starts_with("tls-plain://127.0.0.1:"), "{peer}");
    test_server.stop().await;
}

#[tokio::test]
async fn with_mutual_tls_the_handler_sees_the_clients_certificate_name() {
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    let server = ca.issue(&files, "server", &["127.0.0.1"], Usage::Server, false);
    let worker = ca.issue(
        &files,
        "worker",
        &["worker-7.ml.internal", "worker-7"],
        Usage::Client,
        false,
    );
    register(
        "tls-mutual",
        server_builder(&ca, &server).require_client_cert(true),
    );
    register(
        "tls-mutual-client",
        TlsTransport::builder()
            .ca_file(&ca.cert_file)
            .cert_file(&worker.cert_file)
            .key_file(&worker.key_file),
    );
    let (address, runs, server_task) = start_who("tls-mutual").await;

    let channel = Channel::connect(&on("tls-mutual-client", &address))
        .await
        .unwrap();
    assert_eq!(
        identity_call(channel.clone()).await.unwrap(),
        "worker-7.ml.internal"
    );
    assert_eq!(
        identity_call(channel).await.unwrap(),
        "worker-7.ml.internal"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    server_task.abort();
}

#[tokio::test]
async fn a_client_trusting_another_ca_fails_saying_so_and_naming_its_ca_file() {
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    let other = Ca::new(&files, "other-ca");
    let server = ca.issue(&files, "server", &["127.0.0.1"], Usage::Server, false);
    register("tls-untrusted", server_builder(&ca, &server));
    register(
        "tls-untrusted-client",
        TlsTransport::builder().ca_file(&other.cert_file),
    );
    let (address, runs, server_task) = start_who("tls-untrusted").await;

    let error = Channel::connect(&on("tls-untrusted-client", &address))
        .await
        .expect_err("the server's certificate is not trusted")
        .to_string();
    let expected = format!(
        "the server's certificate is not signed by a trusted CA (tls-ca {})",
        other.cert_file.display()
    );
    assert!(error.contains(&expected), "{error}");
    assert!(
        error.contains("UnknownIssuer"),
        "rustls's words follow: {error}"
    );

    // A call on a lazily connected channel fails with the same reason.
    let channel = Endpoint::new(on("tls-untrusted-client", &address))
        .unwrap()
        .connect_lazy();
    let status = identity_call(channel).await.expect_err("not trusted");
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    assert!(status.message().contains(&expected), "{status}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    server_task.abort();
}

#[tokio::test]
async fn an_expired_server_certificate_fails_saying_it_expired_and_when() {
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    let expired = ca.issue(&files, "expired", &["127.0.0.1"], Usage::Server, true);
    register("tls-expired", server_builder(&ca, &expired));
    let (address, runs, server_task) = start_who("tls-expired").await;

    let error = Channel::connect(&address)
        .await
        .expect_err("the certificate expired")
        .to_string();
    assert!(
        error.contains(
            "the server's certificate expired (valid until 2021-01-01 00:00:00 UTC, now 20"
        ),
        "{error}"
    );
    assert!(error.contains("renew it"), "{error}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    server_task.abort();
}

#[tokio::test]
async fn a_certificate_for_another_host_fails_naming_both() {
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    let server = ca.issue(&files, "server", &["db.internal"], Usage::Server, false);
    register("tls-wrong-host", server_builder(&ca, &server));
    let (address, _, server_task) = start_who("tls-wrong-host").await;

    let error = Channel::connect(&address)
        .await
        .expect_err("the certificate names another host")
        .to_string();
    assert!(
        error.contains(
            "the server's certificate is not valid for 127.0.0.1 (it names DnsName(\"db.internal\")"
        ) || error.contains("the server's certificate is not valid for 127.0.0.1 (it names db.internal"),
        "{error}"
    );
    server_task.abort();
}

#[tokio::test]
async fn a_mutual_tls_server_refuses_a_client_without_a_certificate_before_any_handler() {
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    let server = ca.issue(&files, "server", &["127.0.0.1"], Usage::Server, false);
    register(
        "tls-requires",
        server_builder(&ca, &server).require_client_cert(true),
    );
    register(
        "tls-requires-anonymous",
        TlsTransport::builder().ca_file(&ca.cert_file),
    );
    let (address, runs, server_task) = start_who("tls-requires").await;
    let client_address = on("tls-requires-anonymous", &address);

    let error = Channel::connect(&client_address)
        .await
        .expect_err("no client certificate")
        .to_string();
    assert!(
        error.contains("the server requires a client certificate"),
        "{error}"
    );
    let channel = Endpoint::new(client_address).unwrap().connect_lazy();
    let status = identity_call(channel).await.expect_err("refused");
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    assert!(
        status
            .message()
            .contains("the server requires a client certificate"),
        "{status}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "no handler ran");
    server_task.abort();
}

#[tokio::test]
async fn a_mutual_tls_server_refuses_a_client_certificate_from_another_ca_before_any_handler() {
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    let rogue_ca = Ca::new(&files, "rogue-ca");
    let server = ca.issue(&files, "server", &["127.0.0.1"], Usage::Server, false);
    let rogue = rogue_ca.issue(
        &files,
        "rogue",
        &["worker-7.ml.internal"],
        Usage::Client,
        false,
    );
    register(
        "tls-guarded",
        server_builder(&ca, &server).require_client_cert(true),
    );
    register(
        "tls-guarded-rogue",
        TlsTransport::builder()
            .ca_file(&ca.cert_file)
            .cert_file(&rogue.cert_file)
            .key_file(&rogue.key_file),
    );
    let (address, runs, server_task) = start_who("tls-guarded").await;
    let client_address = on("tls-guarded-rogue", &address);

    let error = Channel::connect(&client_address)
        .await
        .expect_err("a certificate of another CA")
        .to_string();
    assert!(
        error.contains("the server refused this client's certificate"),
        "{error}"
    );
    let channel = Endpoint::new(client_address).unwrap().connect_lazy();
    let status = identity_call(channel).await.expect_err("refused");
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "no handler ran");
    server_task.abort();
}

#[tokio::test]
async fn a_client_stalling_its_handshake_does_not_hold_up_another_and_is_dropped_at_the_timeout() {
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    let server = ca.issue(&files, "server", &["127.0.0.1"], Usage::Server, false);
    register(
        "tls-stall",
        server_builder(&ca, &server).handshake_timeout(Duration::from_secs(2)),
    );
    let (address, runs, server_task) = start_who("tls-stall").await;
    let (_, authority) = address.split_once("://").unwrap();

    // Connected, then silent: no ClientHello. Another sends half of one.
    let mut silent = tokio::net::TcpStream::connect(authority).await.unwrap();
    let mut half = tokio::net::TcpStream::connect(authority).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut half, &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .unwrap();

    // Meanwhile a real client is served, well within the stalled ones' timeout.
    let served = tokio::time::timeout(Duration::from_millis(1500), async {
        identity_call(Channel::connect(&address).await.unwrap()).await
    })
    .await
    .expect("served while two handshakes stall");
    assert_eq!(served.unwrap(), "");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The stalled ones are closed at the handshake timeout.
    for stalled in [&mut silent, &mut half] {
        let mut byte = [0; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), stalled.read(&mut byte))
            .await
            .expect("closed at the handshake timeout");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    server_task.abort();
}

#[tokio::test]
async fn a_tls_client_of_a_plain_tcp_server_fails_at_its_handshake_timeout_saying_why() {
    transport_tcp::install();
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    register(
        "tls-to-tcp",
        TlsTransport::builder()
            .ca_file(&ca.cert_file)
            .handshake_timeout(Duration::from_millis(300)),
    );
    let test_server = TestServer::start("tcp://127.0.0.1:0", |b| b).await;

    let error = Channel::connect(&on("tls-to-tcp", &test_server.address))
        .await
        .expect_err("not a TLS server")
        .to_string();
    // The server reads the ClientHello's first bytes as a large frame's
    // length, and waits for the rest of that frame.
    assert!(
        error.contains(
            "the TLS handshake did not finish within 300ms (is the server a tls:// listener?"
        ),
        "{error}"
    );
    test_server.stop().await;
}

#[tokio::test]
async fn listening_without_a_certificate_and_connecting_without_a_ca_fail_saying_what_to_set() {
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    register(
        "tls-client-only",
        TlsTransport::builder().ca_file(&ca.cert_file),
    );
    let error = rpc_core::Server::builder()
        .add_service(Who::default())
        .bind("tls-client-only://127.0.0.1:0")
        .await
        .map(drop)
        .expect_err("no certificate to serve with")
        .to_string();
    assert!(
        error.contains("set TlsTransportBuilder::cert_file and key_file"),
        "{error}"
    );

    let server = ca.issue(&files, "server", &["127.0.0.1"], Usage::Server, false);
    register(
        "tls-server-only",
        TlsTransport::builder()
            .cert_file(&server.cert_file)
            .key_file(&server.key_file),
    );
    let error = Channel::connect("tls-server-only://127.0.0.1:1")
        .await
        .expect_err("no CA to trust")
        .to_string();
    assert!(
        error.contains("set TlsTransportBuilder::ca_file"),
        "{error}"
    );
}

#[test]
fn configuration_errors_name_the_file_or_the_missing_setting() {
    let files = Files::new();
    let ca = Ca::new(&files, "ca");
    let server = ca.issue(&files, "server", &["127.0.0.1"], Usage::Server, false);
    let other = ca.issue(&files, "other", &["127.0.0.1"], Usage::Server, false);
    let missing = files.path("missing.pem");
    let not_pem = files.write("notes.txt", "just text\n");
    let error = |builder: TlsTransportBuilder| builder.build().expect_err("invalid").to_string();

    let message = error(TlsTransport::builder().ca_file(&missing));
    assert!(
        message.starts_with(&format!("cannot read the CA file {}: ", missing.display())),
        "{message}"
    );
    let message = error(TlsTransport::builder().ca_file(&not_pem));
    assert_eq!(
        message,
        format!(
            "the CA file {} holds no certificate (no \"BEGIN CERTIFICATE\" section)",
            not_pem.display()
        )
    );
    let message = error(
        TlsTransport::builder()
            .cert_file(&server.cert_file)
            .key_file(&not_pem),
    );
    assert!(
        message.starts_with(&format!(
            "the key file {} holds no private key",
            not_pem.display()
        )),
        "{message}"
    );
    let message = error(
        TlsTransport::builder()
            .cert_file(&missing)
            .key_file(&server.key_file),
    );
    assert!(
        message.starts_with(&format!(
            "cannot read the certificate file {}",
            missing.display()
        )),
        "{message}"
    );
    // A key that is not the certificate's.
    let message = error(
        TlsTransport::builder()
            .cert_file(&server.cert_file)
            .key_file(&other.key_file),
    );
    assert!(
        message.starts_with(&format!(
            "the certificate {} with the key {}: ",
            server.cert_file.display(),
            other.key_file.display()
        )),
        "{message}"
    );
    assert!(matches!(
        TlsTransport::builder().cert_file(&server.cert_file).build(),
        Err(TlsConfigError::Missing(_))
    ));
    let message = error(
        TlsTransport::builder()
            .cert_file(&server.cert_file)
            .key_file(&server.key_file)
            .require_client_cert(true),
    );
    assert!(
        message.contains("a ca_file to check client certificates against"),
        "{message}"
    );
}
