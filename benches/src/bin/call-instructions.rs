//! Instructions per unary echo call over `tcp://` (client and server in one
//! process, current-thread runtime), for `valgrind --tool=callgrind`:
//! `call-instructions CALLS SIZE`; per call = (count at 2,200 calls − count
//! at 200) / 2,000. See `docs/benchmarks.md`.
use bytes::Bytes;
use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
use rpc_core::{BytesCodec, Channel, Client, Request, Response, Server};

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
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let (calls, size) = (args[0], args[1]);
    transport_tcp::install();
    let server = Server::builder()
        .add_service(Echo)
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap();
    let address = server.local_addr().to_string();
    tokio::spawn(server.serve());
    let client = Client::new(Channel::connect(&address).await.unwrap());
    let payload = Bytes::from(vec![7u8; size]);
    for _ in 0..calls {
        let reply = client
            .unary::<BytesCodec>("/bench.Echo/Say", Request::new(payload.clone()))
            .await
            .unwrap();
        assert_eq!(reply.get_ref().len(), size);
    }
}
