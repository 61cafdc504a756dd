//! Instructions per unary echo call over `tcp://` (client and server in one
//! process, current-thread runtime), for `valgrind --tool=callgrind`:
//! `call-instructions CALLS SIZE [metrics]`; per call = (count at 2,200
//! calls − count at 200) / 2,000. With `metrics`, both sides record
//! `rpc-metrics` (an interceptor each). See `docs/benchmarks.md`.
use bytes::Bytes;
use prometheus_client::registry::Registry;
use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
use rpc_core::{BytesCodec, Client, Endpoint, Request, Response, Server};
use rpc_metrics::RpcMetrics;

struct Echo;

impl Service for Echo {
    fn name(&self) -> &'static str {
        "bench.Echo"
    }
    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
        match method {
            "Say" => codegen::unary::<BytesCodec, _, _>(call, |r: Request<Bytes>| async move {
                Ok(Response::new(r.into_inner()))
            }),
            _ => codegen::unimplemented(call),
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (calls, size): (usize, usize) = (args[0].parse().unwrap(), args[1].parse().unwrap());
    let metrics = match args.get(2).map(String::as_str) {
        None => None,
        Some("metrics") => Some(RpcMetrics::register(&mut Registry::default())),
        Some(other) => panic!("unknown option {other:?}: expected `metrics`"),
    };
    transport_tcp::install();
    let mut server = Server::builder().add_service(Echo);
    if let Some(metrics) = &metrics {
        server = server.intercept(metrics.server());
    }
    let server = server.bind("tcp://127.0.0.1:0").await.unwrap();
    let address = server.local_addr().to_string();
    tokio::spawn(server.serve());
    let mut endpoint = Endpoint::new(&address).unwrap();
    if let Some(metrics) = &metrics {
        endpoint = endpoint.intercept(metrics.client());
    }
    let client = Client::new(endpoint.connect().await.unwrap());
    let payload = Bytes::from(vec![7u8; size]);
    for _ in 0..calls {
        let reply = client
            .unary::<BytesCodec>("/bench.Echo/Say", Request::new(payload.clone()))
            .await
            .unwrap();
        assert_eq!(reply.get_ref().len(), size);
    }
}
