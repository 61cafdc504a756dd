//! The greeter binaries and generated stubs, end to end over TCP, including
//! a server process killed in the middle of a call.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use examples::helloworld::greeter_client::GreeterClient;
use examples::helloworld::HelloRequest;
use rpc_core::Code;

/// Starts the `greeter-server` binary on a free port; returns it and its address.
fn spawn_server() -> (Child, String) {
    let mut server = Command::new(env!("CARGO_BIN_EXE_greeter-server"))
        .args(["--addr", "tcp://127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("greeter-server starts");
    let mut line = String::new();
    std::io::BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .expect("greeter-server reports its address")
        .to_string();
    (server, addr)
}

fn request(name: &str, count: u32) -> HelloRequest {
    HelloRequest {
        name: name.into(),
        count,
    }
}

#[tokio::test]
async fn every_call_kind_through_generated_stubs() {
    examples::install_transports();
    let (mut server, addr) = spawn_server();
    let client = GreeterClient::connect(&addr).await.unwrap();

    assert_eq!(
        client
            .say_hello(request("Ada", 0))
            .await
            .unwrap()
            .into_inner()
            .message,
        "Hello, Ada!"
    );

    let mut replies = client
        .lots_of_replies(request("B", 3))
        .await
        .unwrap()
        .into_inner();
    let mut got = Vec::new();
    while let Some(reply) = replies.message().await.unwrap() {
        got.push(reply.message);
    }
    assert_eq!(got, ["Hello #1, B!", "Hello #2, B!", "Hello #3, B!"]);

    let status = client
        .lots_of_replies(request("B", 5000))
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);

    let names = futures::stream::iter([request("x", 0), request("y", 0)]);
    assert_eq!(
        client
            .greet_everyone(names)
            .await
            .unwrap()
            .into_inner()
            .message,
        "Hello, x, y!"
    );

    let mut chat = client
        .chat(futures::stream::iter([request("p", 0), request("q", 0)]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(chat.message().await.unwrap().unwrap().message, "Hello, p!");
    assert_eq!(chat.message().await.unwrap().unwrap().message, "Hello, q!");
    assert!(chat.message().await.unwrap().is_none());

    server.kill().unwrap();
    server.wait().unwrap();
}

#[tokio::test]
async fn server_process_killed_mid_call_fails_the_call_with_unavailable() {
    examples::install_transports();
    let (mut server, addr) = spawn_server();
    let client = GreeterClient::connect(&addr).await.unwrap();
    // A chat whose request stream stays open: the call is in flight until the server goes.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let outgoing =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut chat = client.chat(outgoing).await.unwrap().into_inner();
    tx.send(request("before", 0)).unwrap();
    assert_eq!(
        chat.message().await.unwrap().unwrap().message,
        "Hello, before!"
    );

    server.kill().unwrap(); // SIGKILL: no goodbye
    server.wait().unwrap();
    let killed = Instant::now();
    let status = tokio::time::timeout(Duration::from_secs(10), chat.message())
        .await
        .expect("the call must not hang")
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status}");
    assert!(killed.elapsed() < Duration::from_secs(5));
    // New calls fail fast too, naming the address.
    let status = client.say_hello(request("after", 0)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains(addr.trim_start_matches("tcp://")),
        "{status}"
    );
    drop(tx);
}
