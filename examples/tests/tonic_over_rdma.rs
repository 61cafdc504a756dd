//! tonic over RDMA on a real device: the `tonic-rdma` example's server
//! (tonic's `Server` on an `RdmaListener`) and client (tonic's `Channel`
//! through a connector making `RdmaStream`s), every kind of call, long
//! streams and a 1 MiB message.
//!
//! Needs `RDMA_TEST_DEVICE` and `RDMA_TEST_IP` (run through `cargo xtask
//! rxe`, or see `docs/soft-roce.md`); fails without them. Server and client
//! run in this process on this host's `RDMA_TEST_IP`, whatever
//! `RDMA_TEST_ROLE` says; the two-host suite leaves it out (the wire is
//! crossed by `transport-rdma`'s `…_across_the_wire` tests).

use std::time::Duration;

use examples::tonic_rdma::helloworld::greeter_client::GreeterClient;
use examples::tonic_rdma::helloworld::HelloRequest;
use tokio::sync::oneshot;
use tonic::transport::Channel;
use transport_rdma::RdmaListener;

/// Messages in each streamed call.
const STREAMED: u32 = 100;
/// The name of the large unary call.
const LARGE: usize = 1 << 20;
/// A step that takes longer than this has hung.
const STEP: Duration = Duration::from_secs(60);

/// This host's address on the device, `RDMA_TEST_IP`; panics (fails the
/// test) when the environment names no device.
fn test_ip() -> String {
    let help = "run the device tests through `cargo xtask rxe -- <test binary> --ignored` \
                (Soft-RoCE in a VM), or on a machine with an RDMA NIC set RDMA_TEST_DEVICE \
                and RDMA_TEST_IP (an IPv4 address on it)";
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    var("RDMA_TEST_DEVICE").unwrap_or_else(|| panic!("RDMA_TEST_DEVICE is not set: {help}"));
    let ip = var("RDMA_TEST_IP").unwrap_or_else(|| panic!("RDMA_TEST_IP is not set: {help}"));
    ip.parse::<std::net::Ipv4Addr>()
        .unwrap_or_else(|e| panic!("RDMA_TEST_IP={ip:?} is not an IPv4 address: {e}"));
    ip
}

fn request(name: impl Into<String>, count: u32) -> HelloRequest {
    HelloRequest {
        name: name.into(),
        count,
    }
}

async fn within<T>(what: &str, step: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(STEP, step)
        .await
        .unwrap_or_else(|_| panic!("{what} took over {STEP:?}"))
}

async fn unary(client: &mut GreeterClient<Channel>) {
    let reply = within("SayHello", client.say_hello(request("world", 0)))
        .await
        .expect("SayHello succeeds")
        .into_inner();
    assert_eq!(reply.message, "Hello, world!");

    // The large path: HTTP/2 DATA frames of 16 KiB, which hyper writes
    // (vectored, gathered into one message each) above the 8 KiB receive
    // slot of the default settings, so they go by RDMA WRITE.
    let name: String = (0..LARGE)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let reply = within("SayHello of 1 MiB", client.say_hello(request(&*name, 0)))
        .await
        .expect("SayHello of 1 MiB succeeds")
        .into_inner();
    assert_eq!(reply.message.len(), LARGE + "Hello, !".len());
    assert!(
        reply.message == format!("Hello, {name}!"),
        "the 1 MiB greeting came back altered"
    );
}

async fn server_streaming(client: &mut GreeterClient<Channel>) {
    let mut replies = within(
        "LotsOfReplies",
        client.lots_of_replies(request("stream", STREAMED)),
    )
    .await
    .expect("LotsOfReplies starts")
    .into_inner();
    let mut got = Vec::new();
    while let Some(reply) = within("a reply", replies.message())
        .await
        .expect("every reply arrives")
    {
        got.push(reply.message);
    }
    let expected: Vec<String> = (1..=STREAMED)
        .map(|i| format!("Hello #{i}, stream!"))
        .collect();
    assert_eq!(got, expected);
}

async fn client_streaming(client: &mut GreeterClient<Channel>) {
    let names: Vec<String> = (0..STREAMED).map(|i| format!("n{i}")).collect();
    let requests = names.clone().into_iter().map(|name| request(name, 0));
    let reply = within(
        "GreetEveryone",
        client.greet_everyone(futures::stream::iter(requests)),
    )
    .await
    .expect("GreetEveryone succeeds")
    .into_inner();
    assert_eq!(reply.message, format!("Hello, {}!", names.join(", ")));
}

/// Each name is sent only after the previous reply arrived: replies come
/// while the request stream is still open.
async fn bidi_streaming(client: &mut GreeterClient<Channel>) {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let mut replies = within(
        "Chat",
        client.chat(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
    .await
    .expect("Chat starts")
    .into_inner();
    for i in 0..STREAMED {
        tx.send(request(format!("c{i}"), 0))
            .await
            .expect("the request stream is open");
        let reply = within("a Chat reply", replies.message())
            .await
            .expect("the reply arrives")
            .expect("the reply stream goes on while requests do");
        assert_eq!(reply.message, format!("Hello, c{i}!"));
    }
    drop(tx);
    let end = within("the end of Chat", replies.message())
        .await
        .expect("Chat ends cleanly");
    assert!(end.is_none(), "a reply without a request: {end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run through cargo xtask rxe"]
async fn every_kind_of_call_over_rdma() {
    let ip = test_ip();
    let listener = RdmaListener::bind(&format!("rdma://{ip}:0"))
        .await
        .expect("listens on RDMA_TEST_IP");
    let addr = listener.local_addr().to_string();
    assert!(
        addr.starts_with(&format!("rdma://{ip}:")) && !addr.ends_with(":0"),
        "local_addr {addr:?} names the port chosen"
    );
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(examples::tonic_rdma::serve(listener, async {
        stopped.await.ok();
    }));

    let mut client = within("connecting", examples::tonic_rdma::connect(&addr))
        .await
        .expect("connects over RDMA");
    unary(&mut client).await;
    server_streaming(&mut client).await;
    client_streaming(&mut client).await;
    bidi_streaming(&mut client).await;

    // The four kinds at once on the one connection.
    let (mut a, mut b, mut c, mut d) = (
        client.clone(),
        client.clone(),
        client.clone(),
        client.clone(),
    );
    tokio::join!(
        unary(&mut a),
        server_streaming(&mut b),
        client_streaming(&mut c),
        bidi_streaming(&mut d)
    );

    // A request over the handler's limit fails with its status, and the
    // connection carries on.
    let status = within(
        "LotsOfReplies over the limit",
        client.lots_of_replies(request("x", examples::tonic_rdma::MAX_REPLIES + 1)),
    )
    .await
    .expect_err("over the limit is refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    unary(&mut client).await;

    drop((client, a, b, c, d));
    stop.send(()).expect("the server is running");
    within("the server's shutdown", server)
        .await
        .expect("the server task did not panic")
        .expect("the server stops cleanly");
}
