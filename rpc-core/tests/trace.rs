//! W3C trace context across calls, over `mem://` and `tcp://`: a client's
//! trace reaches a front end, whose fan-out to two shards carries the same
//! trace id, one new span per hop; a front end called without a context
//! starts a trace its shards share; a malformed `traceparent` starts a new
//! trace instead of failing the call; without the interceptor nothing is
//! parsed.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
use rpc_core::fanout::FanOut;
use rpc_core::trace::{TraceContext, TracePropagation, TRACEPARENT};
use rpc_core::{BytesCodec, Channel, Client, Endpoint, Request, Response, Server, Status};
use rpc_test_support::mem_address;

/// Answers with the context its handler runs in (`none` without one).
struct Shard;

impl Service for Shard {
    fn name(&self) -> &'static str {
        "trace.Shard"
    }

    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
        match method {
            "Seen" => codegen::unary::<BytesCodec, _, _>(call, |_request: Request<Bytes>| async {
                Ok(Response::new(Bytes::from(current())))
            }),
            _ => codegen::unimplemented(call),
        }
    }
}

/// Fans out to its shards and answers with its own context, then theirs:
/// `front shard0 shard1`.
struct Front(Arc<Vec<Client>>);

impl Service for Front {
    fn name(&self) -> &'static str {
        "trace.Front"
    }

    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
        let shards = Arc::clone(&self.0);
        match method {
            "Ask" => codegen::unary::<BytesCodec, _, _>(
                call,
                move |_request: Request<Bytes>| async move {
                    let fan = FanOut::within(Duration::from_secs(5));
                    let results = fan
                        .run(
                            shards
                                .iter()
                                .map(|shard| seen(shard, fan.request(Bytes::new()))),
                        )
                        .await;
                    let mut answer = current();
                    for result in results.shards {
                        let shard = result
                            .ok()
                            .ok_or_else(|| Status::internal("a shard failed"))?;
                        answer = format!("{answer} {shard}");
                    }
                    Ok(Response::new(Bytes::from(answer)))
                },
            ),
            _ => codegen::unimplemented(call),
        }
    }
}

fn current() -> String {
    TraceContext::current().map_or_else(|| "none".to_string(), |c| c.to_string())
}

async fn seen(client: &Client, request: Request<Bytes>) -> Result<String, Status> {
    let reply = client
        .unary::<BytesCodec>("/trace.Shard/Seen", request)
        .await?;
    Ok(String::from_utf8(reply.into_inner().to_vec()).unwrap())
}

async fn serve(address: &str, service: impl Service, traced: bool) -> String {
    let mut builder = Server::builder().add_service(service);
    if traced {
        builder = builder.intercept(TracePropagation);
    }
    let server = builder.bind(address).await.unwrap();
    let address = server.local_addr().to_string();
    tokio::spawn(server.serve());
    address
}

async fn traced_client(address: &str) -> Client {
    Client::new(
        Endpoint::new(address)
            .unwrap()
            .intercept(TracePropagation)
            .connect()
            .await
            .unwrap(),
    )
}

/// A front end with two shards, all traced; the front end's client.
async fn deployment(address: impl Fn() -> String) -> Client {
    let mut shards = Vec::new();
    for _ in 0..2 {
        let shard = serve(&address(), Shard, true).await;
        shards.push(traced_client(&shard).await);
    }
    let front = serve(&address(), Front(Arc::new(shards)), true).await;
    traced_client(&front).await
}

async fn ask(front: &Client) -> Vec<TraceContext> {
    let reply = front
        .unary::<BytesCodec>("/trace.Front/Ask", Request::new(Bytes::new()))
        .await
        .unwrap();
    let reply = String::from_utf8(reply.into_inner().to_vec()).unwrap();
    reply
        .split(' ')
        .map(|c| TraceContext::parse(c).unwrap_or_else(|| panic!("no context in {reply:?}")))
        .collect()
}

fn addresses() -> [fn() -> String; 2] {
    transport_tcp::install();
    [mem_address, || "tcp://127.0.0.1:0".to_string()]
}

#[tokio::test]
async fn a_fan_out_carries_the_callers_trace_one_span_per_hop() {
    for address in addresses() {
        let front = deployment(address).await;
        let root = TraceContext::new_root();
        let seen = root.scope(ask(&front)).await;
        let [front_seen, shard0, shard1] = seen[..] else {
            panic!("{seen:?}")
        };
        for context in [front_seen, shard0, shard1] {
            assert_eq!(context.trace_id(), root.trace_id(), "{seen:?} in {root:?}");
        }
        let spans = [
            root.span_id(),
            front_seen.span_id(),
            shard0.span_id(),
            shard1.span_id(),
        ];
        for (i, a) in spans.iter().enumerate() {
            assert!(
                !spans[i + 1..].contains(a),
                "a span id repeats: {seen:?} in {root:?}"
            );
        }
    }
}

#[tokio::test]
async fn a_call_without_a_context_starts_a_trace_its_fan_out_shares() {
    for address in addresses() {
        let front = deployment(address).await;
        let first = ask(&front).await;
        let second = ask(&front).await;
        for seen in [&first, &second] {
            assert!(
                seen.iter().all(|c| c.trace_id() == seen[0].trace_id()),
                "{seen:?}"
            );
        }
        assert_ne!(
            first[0].trace_id(),
            second[0].trace_id(),
            "two calls, one trace"
        );
    }
}

#[tokio::test]
async fn a_malformed_traceparent_starts_a_new_trace() {
    for address in addresses() {
        let shard = serve(&address(), Shard, true).await;
        let plain = Client::new(Channel::connect(&shard).await.unwrap());
        let mut request = Request::new(Bytes::new());
        let bogus = "00-00000000000000000000000000000000-00f067aa0ba902b7-01";
        request.metadata_mut().insert(TRACEPARENT, bogus);
        let seen = seen(&plain, request).await.unwrap();
        let context = TraceContext::parse(&seen).unwrap_or_else(|| panic!("{seen:?}"));
        assert_ne!(context.span_id(), 0x00f067aa0ba902b7);

        // A valid one sent by hand is taken as it is.
        let mut request = Request::new(Bytes::new());
        let given = TraceContext::new_root();
        request
            .metadata_mut()
            .insert(TRACEPARENT, given.to_string());
        assert_eq!(seen_by(&plain, request).await, Some(given));
    }
}

#[tokio::test]
async fn without_the_interceptor_nothing_is_parsed() {
    for address in addresses() {
        let shard = serve(&address(), Shard, false).await;
        let plain = Client::new(Channel::connect(&shard).await.unwrap());
        let mut request = Request::new(Bytes::new());
        request
            .metadata_mut()
            .insert(TRACEPARENT, TraceContext::new_root().to_string());
        assert_eq!(seen(&plain, request).await.unwrap(), "none");
    }
}

async fn seen_by(client: &Client, request: Request<Bytes>) -> Option<TraceContext> {
    TraceContext::parse(&seen(client, request).await.unwrap())
}
