//! The greeter client: `greeter-client --addr tcp://127.0.0.1:50051` (or `rdma://...`).
//!
//! Makes one call of each kind and prints the replies.

use std::time::Duration;

use examples::helloworld::greeter_client::GreeterClient;
use examples::helloworld::HelloRequest;
use rpc_core::Request;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    examples::init_logging();
    examples::install_transports();
    let addr = examples::addr_arg("greeter-client", "tcp://127.0.0.1:50051");
    let client = GreeterClient::connect(&addr).await?;
    println!("connected to {addr}");

    let mut request = Request::new(HelloRequest {
        name: "world".into(),
        count: 0,
    });
    request.set_timeout(Duration::from_secs(10));
    let reply = client.say_hello(request).await?;
    println!("SayHello: {}", reply.get_ref().message);

    let mut replies = client
        .lots_of_replies(HelloRequest {
            name: "stream".into(),
            count: 3,
        })
        .await?
        .into_inner();
    while let Some(reply) = replies.message().await? {
        println!("LotsOfReplies: {}", reply.message);
    }

    let names = ["Ada", "Grace", "Edsger"].map(|name| HelloRequest {
        name: name.into(),
        count: 0,
    });
    let reply = client.greet_everyone(futures::stream::iter(names)).await?;
    println!("GreetEveryone: {}", reply.get_ref().message);

    let names = ["Barbara", "Leslie"].map(|name| HelloRequest {
        name: name.into(),
        count: 0,
    });
    let mut replies = client
        .chat(futures::stream::iter(names))
        .await?
        .into_inner();
    while let Some(reply) = replies.message().await? {
        println!("Chat: {}", reply.message);
    }
    Ok(())
}
