//! The metrics endpoint scraped over HTTP while calls run over `tcp://`:
//! the counters, the status codes, the histogram and the in-flight gauge
//! move with the calls, on the server and the client.

use std::time::Duration;

use bytes::Bytes;
use prometheus_client::registry::Registry;
use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
use rpc_core::{BytesCodec, Client, Code, Endpoint, Request, Response, Server, Status};
use rpc_metrics::{MetricsServer, RpcMetrics};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// `Echo` answers; `Missing` fails with `NotFound`; `Hold` answers once told to.
struct Demo(std::sync::Mutex<Option<oneshot::Receiver<()>>>);

impl Service for Demo {
    fn name(&self) -> &'static str {
        "demo.Demo"
    }

    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
        match method {
            "Echo" => codegen::unary::<BytesCodec, _, _>(call, |r: Request<Bytes>| async move {
                Ok(Response::new(r.into_inner()))
            }),
            "Missing" => codegen::unary::<BytesCodec, _, _>(call, |_r: Request<Bytes>| async {
                Err::<Response<Bytes>, _>(Status::not_found("no such thing"))
            }),
            "Hold" => {
                let release = self.0.lock().unwrap().take();
                codegen::unary::<BytesCodec, _, _>(call, move |r: Request<Bytes>| async move {
                    if let Some(release) = release {
                        let _ = release.await;
                    }
                    Ok(Response::new(r.into_inner()))
                })
            }
            _ => codegen::unimplemented(call),
        }
    }
}

/// `GET path` over a fresh connection: the status line and the body.
async fn get(address: std::net::SocketAddr, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(address).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// The value of the series `name{labels}` in a scrape.
fn value(scrape: &str, series: &str) -> Option<f64> {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn counters_move_with_the_calls_and_the_endpoint_serves_them() {
    transport_tcp::install();
    let mut registry = Registry::default();
    let metrics = RpcMetrics::register(&mut registry);
    let (release, held) = oneshot::channel();
    let server = Server::builder()
        .intercept(metrics.server())
        .add_service(Demo(std::sync::Mutex::new(Some(held))))
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap();
    let address = server.local_addr().to_string();
    tokio::spawn(server.serve());
    let client = Client::new(
        Endpoint::new(&address)
            .unwrap()
            .intercept(metrics.client())
            .connect()
            .await
            .unwrap(),
    );
    let endpoint = MetricsServer::bind("127.0.0.1:0", registry).await.unwrap();
    let scrape_at = endpoint.local_addr();
    tokio::spawn(endpoint.serve());

    for _ in 0..3 {
        client
            .unary::<BytesCodec>("/demo.Demo/Echo", Request::new(Bytes::from("hi")))
            .await
            .unwrap();
    }
    let status = client
        .unary::<BytesCodec>("/demo.Demo/Missing", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);

    // One call held in its handler while the endpoint is scraped.
    let held_call = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .unary::<BytesCodec>("/demo.Demo/Hold", Request::new(Bytes::new()))
                .await
        }
    });
    let echo = r#"{service="demo.Demo",method="Echo"}"#;
    let hold = r#"{service="demo.Demo",method="Hold"}"#;
    let mut scrape = String::new();
    for _ in 0..100 {
        let (status_line, body) = get(scrape_at, "/metrics").await;
        assert_eq!(status_line, "HTTP/1.1 200 OK", "{body}");
        scrape = body;
        if value(&scrape, &format!("rpc_server_in_flight{hold}")) == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let at = |series: &str| value(&scrape, series);
    assert_eq!(
        at(&format!("rpc_server_in_flight{hold}")),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        at(&format!("rpc_server_started_total{echo}")),
        Some(3.0),
        "{scrape}"
    );
    assert_eq!(
        at(r#"rpc_server_handled_total{service="demo.Demo",method="Echo",code="OK"}"#),
        Some(3.0),
        "{scrape}"
    );
    assert_eq!(
        at(r#"rpc_server_handled_total{service="demo.Demo",method="Missing",code="NOT_FOUND"}"#),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        at(&format!("rpc_server_handling_seconds_count{echo}")),
        Some(3.0),
        "{scrape}"
    );
    assert_eq!(
        at(&format!("rpc_server_in_flight{echo}")),
        Some(0.0),
        "{scrape}"
    );
    assert_eq!(
        at(&format!("rpc_client_started_total{echo}")),
        Some(3.0),
        "{scrape}"
    );
    assert_eq!(
        at(r#"rpc_client_handled_total{service="demo.Demo",method="Missing",code="NOT_FOUND"}"#),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        at(&format!("rpc_client_handling_seconds_count{echo}")),
        Some(3.0),
        "{scrape}"
    );
    assert!(scrape.ends_with("# EOF\n"), "{scrape}");

    // Released, the held call ends: the gauge falls, the counters rise (the
    // server records the end once its final status is sent: poll for it).
    release.send(()).unwrap();
    held_call.await.unwrap().unwrap();
    let mut scrape = String::new();
    for _ in 0..100 {
        scrape = get(scrape_at, "/metrics").await.1;
        if value(&scrape, &format!("rpc_server_in_flight{hold}")) == Some(0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let at = |series: &str| value(&scrape, series);
    assert_eq!(
        at(&format!("rpc_server_in_flight{hold}")),
        Some(0.0),
        "{scrape}"
    );
    assert_eq!(
        at(r#"rpc_server_handled_total{service="demo.Demo",method="Hold",code="OK"}"#),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        at(&format!("rpc_client_handling_seconds_count{hold}")),
        Some(1.0),
        "{scrape}"
    );

    let (status_line, _) = get(scrape_at, "/other").await;
    assert_eq!(status_line, "HTTP/1.1 404 Not Found");
}
