//! A tonic service over RDMA (`examples::tonic_rdma`):
//!
//! ```text
//! tonic-rdma --serve rdma://IP:PORT     # tonic's server on an RdmaListener, until Ctrl-C
//! tonic-rdma --connect rdma://IP:PORT   # tonic's client: one call of each kind, checked
//! ```
//!
//! The server prints `listening on ADDRESS` once it accepts connections
//! (with port 0, ADDRESS has the port chosen). The client prints each
//! reply and exits non-zero if one is not the greeting expected.

use examples::tonic_rdma::helloworld::HelloRequest;
use transport_rdma::RdmaListener;

type Error = Box<dyn std::error::Error + Send + Sync>;

enum Mode {
    Serve(String),
    Connect(String),
}

fn mode_arg() -> Mode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, addr] if flag == "--serve" => Mode::Serve(addr.clone()),
        [flag, addr] if flag == "--connect" => Mode::Connect(addr.clone()),
        _ => {
            eprintln!("usage: tonic-rdma --serve rdma://IP:PORT | --connect rdma://IP:PORT");
            std::process::exit(2);
        }
    }
}

fn request(name: &str, count: u32) -> HelloRequest {
    HelloRequest {
        name: name.into(),
        count,
    }
}

fn check(call: &str, got: &str, expected: &str) -> Result<(), Error> {
    println!("{call}: {got}");
    if got == expected {
        Ok(())
    } else {
        Err(format!("{call}: expected {expected:?}, got {got:?}").into())
    }
}

async fn run_client(addr: &str) -> Result<(), Error> {
    let mut client = examples::tonic_rdma::connect(addr).await?;
    println!("connected to {addr}");

    let reply = client.say_hello(request("world", 0)).await?.into_inner();
    check("SayHello", &reply.message, "Hello, world!")?;

    let mut replies = client
        .lots_of_replies(request("stream", 3))
        .await?
        .into_inner();
    let mut n = 0;
    while let Some(reply) = replies.message().await? {
        n += 1;
        check(
            "LotsOfReplies",
            &reply.message,
            &format!("Hello #{n}, stream!"),
        )?;
    }
    if n != 3 {
        return Err(format!("LotsOfReplies: 3 replies expected, got {n}").into());
    }

    let names = ["Ada", "Grace", "Edsger"].map(|name| request(name, 0));
    let reply = client
        .greet_everyone(futures::stream::iter(names))
        .await?
        .into_inner();
    check(
        "GreetEveryone",
        &reply.message,
        "Hello, Ada, Grace, Edsger!",
    )?;

    let names = ["Barbara", "Leslie"];
    let mut replies = client
        .chat(futures::stream::iter(names.map(|name| request(name, 0))))
        .await?
        .into_inner();
    let mut n = 0;
    while let Some(reply) = replies.message().await? {
        let expected = names
            .get(n)
            .map(|name| format!("Hello, {name}!"))
            .ok_or("Chat: more replies than names")?;
        check("Chat", &reply.message, &expected)?;
        n += 1;
    }
    if n != names.len() {
        return Err(format!("Chat: {} replies expected, got {n}", names.len()).into());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    examples::init_logging();
    match mode_arg() {
        Mode::Serve(addr) => {
            let listener = RdmaListener::bind(&addr).await?;
            println!("listening on {}", listener.local_addr());
            examples::tonic_rdma::serve(listener, async {
                tokio::signal::ctrl_c().await.ok();
            })
            .await
        }
        Mode::Connect(addr) => run_client(&addr).await,
    }
}
