//! The greeter server: `greeter-server --addr tcp://0.0.0.0:50051` (or `rdma://...`).
//!
//! Prints `listening on ADDRESS` once it accepts connections (with port 0,
//! ADDRESS has the port chosen), and shuts down gracefully on Ctrl-C.

use examples::helloworld::greeter_server::{Greeter, GreeterServer};
use examples::helloworld::{HelloReply, HelloRequest};
use futures::{Stream, StreamExt};
use rpc_core::{Request, Response, Status, Streaming};
use std::pin::Pin;

#[derive(Debug, Default)]
struct Greetings;

fn greet(name: &str) -> HelloReply {
    HelloReply {
        message: format!("Hello, {name}!"),
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<HelloReply, Status>> + Send>>;

impl Greeter for Greetings {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        Ok(Response::new(greet(&request.get_ref().name)))
    }

    type LotsOfRepliesStream = ReplyStream;

    async fn lots_of_replies(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<ReplyStream>, Status> {
        let HelloRequest { name, count } = request.into_inner();
        if count > 1000 {
            return Err(Status::invalid_argument(format!(
                "count {count} is over 1000"
            )));
        }
        let replies = futures::stream::iter(1..=count).map(move |i| {
            Ok(HelloReply {
                message: format!("Hello #{i}, {name}!"),
            })
        });
        Ok(Response::new(Box::pin(replies)))
    }

    async fn greet_everyone(
        &self,
        request: Request<Streaming<HelloRequest>>,
    ) -> Result<Response<HelloReply>, Status> {
        let mut names = Vec::new();
        let mut requests = request.into_inner();
        while let Some(request) = requests.message().await? {
            names.push(request.name);
        }
        Ok(Response::new(greet(&names.join(", "))))
    }

    type ChatStream = ReplyStream;

    async fn chat(
        &self,
        request: Request<Streaming<HelloRequest>>,
    ) -> Result<Response<ReplyStream>, Status> {
        let replies = request
            .into_inner()
            .map(|request| request.map(|r| greet(&r.name)));
        Ok(Response::new(Box::pin(replies)))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    examples::init_logging();
    examples::install_transports();
    let addr = examples::addr_arg("greeter-server", "tcp://127.0.0.1:50051");
    let server = rpc_core::Server::builder()
        .add_service(GreeterServer::new(Greetings))
        .bind(&addr)
        .await?;
    println!("listening on {}", server.local_addr());
    server
        .serve_with_shutdown(async {
            tokio::signal::ctrl_c().await.ok();
        })
        .await?;
    Ok(())
}
