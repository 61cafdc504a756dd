//! The per-transport metrics scraped over HTTP while a client and a server
//! talk over `tcp://`: connections opened and open move as they connect,
//! close and reconnect after the server restarts, and send stalls move
//! when a sender outruns what the connection takes.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use prometheus_client::registry::Registry;
use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
use rpc_core::{BytesCodec, Client, Endpoint, Request, Response, Server};
use rpc_metrics::{MetricsServer, TransportMetrics};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

struct Echo;

impl Service for Echo {
    fn name(&self) -> &'static str {
        "demo.Echo"
    }

    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
        match method {
            "Echo" => codegen::unary::<BytesCodec, _, _>(call, |r: Request<Bytes>| async move {
                Ok(Response::new(r.into_inner()))
            }),
            _ => codegen::unimplemented(call),
        }
    }
}

/// `GET /metrics` over a fresh connection: the body.
async fn scrape(address: std::net::SocketAddr) -> String {
    let mut stream = TcpStream::connect(address).await.unwrap();
    let request = "GET /metrics HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n";
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    body.to_string()
}

/// The value of the series `name{labels}` in a scrape (0 if absent: a
/// scheme has no series before its first connection).
fn value(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

const CLIENT_OPENED: &str = r#"rpc_transport_connections_opened_total{scheme="tcp",side="client"}"#;
const CLIENT_CLOSED: &str = r#"rpc_transport_connections_closed_total{scheme="tcp",side="client"}"#;
const CLIENT_OPEN: &str = r#"rpc_transport_connections_open{scheme="tcp",side="client"}"#;
const SERVER_OPENED: &str = r#"rpc_transport_connections_opened_total{scheme="tcp",side="server"}"#;
const SERVER_OPEN: &str = r#"rpc_transport_connections_open{scheme="tcp",side="server"}"#;
const RECONNECTS: &str = r#"rpc_transport_reconnects_total{scheme="tcp"}"#;
const CLIENT_STALLS: &str = r#"rpc_transport_send_stalls_total{scheme="tcp",side="client"}"#;

/// Scrapes until `done` holds of the scrape (the server side counts its
/// connections in its own tasks), for at most 5 s.
async fn scrape_until(at: std::net::SocketAddr, done: impl Fn(&str) -> bool) -> String {
    let mut last = String::new();
    for _ in 0..500 {
        last = scrape(at).await;
        if done(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the scrape never showed what was waited for:\n{last}");
}

/// A server on `address` until the returned sender fires; the future ends
/// once it has shut down (its connections closed).
async fn start_server(address: &str) -> (String, oneshot::Sender<()>, impl Future<Output = ()>) {
    let server = Server::builder()
        .add_service(Echo)
        .bind(address)
        .await
        .unwrap();
    let bound = server.local_addr().to_string();
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_with_shutdown(async {
        let _ = stopped.await;
    }));
    (bound, stop, async move { serving.await.unwrap().unwrap() })
}

#[tokio::test]
async fn connections_reconnects_and_stalls_move_in_the_scrape() {
    transport_tcp::install();
    let mut registry = Registry::default();
    TransportMetrics::register(&mut registry);
    let endpoint = MetricsServer::bind("127.0.0.1:0", registry).await.unwrap();
    let at = endpoint.local_addr();
    tokio::spawn(endpoint.serve());
    let before = scrape(at).await;
    let was = |series: &str| value(&before, series);
    for family in [
        "# TYPE rpc_transport_connections_opened counter",
        "# TYPE rpc_transport_connections_open gauge",
        "# TYPE rpc_transport_reconnects counter",
        "# TYPE rpc_transport_send_stalls counter",
    ] {
        assert!(before.contains(family), "no {family:?} in\n{before}");
    }

    // A connection: opened and open on both sides.
    let (address, stop, stopped) = start_server("tcp://127.0.0.1:0").await;
    let client = Client::new(Endpoint::new(&address).unwrap().connect().await.unwrap());
    let echo = |client: Client, len: usize| async move {
        client
            .unary::<BytesCodec>("/demo.Echo/Echo", Request::new(Bytes::from(vec![7u8; len])))
            .await
            .map(|r| r.into_inner().len())
    };
    assert_eq!(echo(client.clone(), 10).await.unwrap(), 10);
    let now = scrape_until(at, |s| value(s, SERVER_OPEN) == was(SERVER_OPEN) + 1.0).await;
    assert_eq!(
        value(&now, CLIENT_OPENED),
        was(CLIENT_OPENED) + 1.0,
        "{now}"
    );
    assert_eq!(value(&now, CLIENT_OPEN), was(CLIENT_OPEN) + 1.0, "{now}");
    assert_eq!(
        value(&now, SERVER_OPENED),
        was(SERVER_OPENED) + 1.0,
        "{now}"
    );
    assert_eq!(value(&now, RECONNECTS), was(RECONNECTS), "{now}");

    // The server restarts on the same address: the connection closes on
    // both sides, and the next call reconnects.
    stop.send(()).unwrap();
    stopped.await;
    let now = scrape_until(at, |s| value(s, CLIENT_OPEN) == was(CLIENT_OPEN)).await;
    assert_eq!(
        value(&now, CLIENT_CLOSED),
        was(CLIENT_CLOSED) + 1.0,
        "{now}"
    );
    assert_eq!(value(&now, SERVER_OPEN), was(SERVER_OPEN), "{now}");
    let (_, _keep_serving, _) = start_server(&address).await;
    assert_eq!(echo(client.clone(), 10).await.unwrap(), 10);
    let now = scrape_until(at, |s| value(s, SERVER_OPEN) == was(SERVER_OPEN) + 1.0).await;
    assert_eq!(value(&now, RECONNECTS), was(RECONNECTS) + 1.0, "{now}");
    assert_eq!(
        value(&now, CLIENT_OPENED),
        was(CLIENT_OPENED) + 2.0,
        "{now}"
    );
    assert_eq!(value(&now, CLIENT_OPEN), was(CLIENT_OPEN) + 1.0, "{now}");
    assert_eq!(
        value(&now, SERVER_OPENED),
        was(SERVER_OPENED) + 2.0,
        "{now}"
    );

    // Four 8 MiB requests at once: the first fills the connection's write
    // buffer far past its 1 MiB high-water mark (a socket takes a small
    // part of it at once), so the others find no room and wait.
    let stalls = value(&now, CLIENT_STALLS);
    let len = 8 << 20;
    let (a, b, c, d) = tokio::join!(
        echo(client.clone(), len),
        echo(client.clone(), len),
        echo(client.clone(), len),
        echo(client.clone(), len),
    );
    for echoed in [a, b, c, d] {
        assert_eq!(echoed.unwrap(), len);
    }
    let now = scrape(at).await;
    assert!(value(&now, CLIENT_STALLS) >= stalls + 1.0, "{now}");
    assert_eq!(value(&now, RECONNECTS), was(RECONNECTS) + 1.0, "{now}");
}
