//! Interceptors on the server and the client: order, metadata, rejection
//! (the handler never runs, the call is never sent), per-service scope,
//! extensions and the peer as handlers see them, and `on_end` for every
//! way a call ends.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rpc_core::codegen::{self, BoxFuture, ServerCall, Service};
use rpc_core::intercept::{CallEnd, CallHead, Interceptor};
use rpc_core::{BytesCodec, Channel, Client, Code, Endpoint, Request, Response, Server, Status};
use rpc_test_support::mem_address;

/// What a handler saw, as its reply: the peer, the `Caller` extension and
/// the metadata an interceptor added.
struct Inspect(Arc<AtomicUsize>);

#[derive(Debug)]
struct Caller(String);

impl Service for Inspect {
    fn name(&self) -> &'static str {
        "inspect.Inspect"
    }

    fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
        let runs = Arc::clone(&self.0);
        match method {
            "Look" => codegen::unary::<BytesCodec, _, _>(
                call,
                move |request: Request<Bytes>| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let caller = request.extensions().get::<Caller>().map(|c| c.0.clone());
                    let seen = format!(
                        "peer={} caller={} tag={}",
                        request.peer().map_or("none", |p| p.address()),
                        caller.as_deref().unwrap_or("none"),
                        request.metadata().get_str("x-tag").unwrap_or("none"),
                    );
                    Ok(Response::new(Bytes::from(seen)))
                },
            ),
            "Slow" => codegen::unary::<BytesCodec, _, _>(
                call,
                move |_request: Request<Bytes>| async move {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    Ok(Response::new(Bytes::new()))
                },
            ),
            "Fail" => codegen::unary::<BytesCodec, _, _>(call, |_request: Request<Bytes>| async {
                Err::<Response<Bytes>, _>(Status::not_found("no such thing"))
            }),
            _ => codegen::unimplemented(call),
        }
    }
}

/// Records what it sees, in a log shared by several interceptors.
struct Recorder {
    name: &'static str,
    log: Arc<Mutex<Vec<String>>>,
    reject: bool,
}

impl Interceptor for Recorder {
    fn on_call(&self, call: &mut CallHead<'_>) -> Result<(), Status> {
        let tag = call
            .metadata()
            .get_str("x-tag")
            .unwrap_or("none")
            .to_string();
        self.log
            .lock()
            .unwrap()
            .push(format!("{} call {} tag={tag}", self.name, call.path()));
        call.metadata_mut().insert("x-tag", self.name);
        if self.reject {
            return Err(Status::permission_denied(format!("{} says no", self.name)));
        }
        call.extensions_mut().insert(Caller(self.name.into()));
        Ok(())
    }

    fn on_end(&self, call: &CallEnd<'_>) {
        self.log.lock().unwrap().push(format!(
            "{} end {} {:?}",
            self.name,
            call.path(),
            call.status().code()
        ));
    }
}

fn recorder(name: &'static str, log: &Arc<Mutex<Vec<String>>>, reject: bool) -> Recorder {
    Recorder {
        name,
        log: Arc::clone(log),
        reject,
    }
}

async fn serve(
    configure: impl FnOnce(rpc_core::ServerBuilder) -> rpc_core::ServerBuilder,
) -> (String, Arc<AtomicUsize>) {
    let address = mem_address();
    let runs = Arc::new(AtomicUsize::new(0));
    let server = configure(Server::builder().add_service(Inspect(Arc::clone(&runs))))
        .bind(&address)
        .await
        .unwrap();
    tokio::spawn(server.serve());
    (address, runs)
}

async fn look(client: &Client) -> Result<String, Status> {
    let reply = client
        .unary::<BytesCodec>("/inspect.Inspect/Look", Request::new(Bytes::new()))
        .await?;
    Ok(String::from_utf8(reply.into_inner().to_vec()).unwrap())
}

async fn client(address: &str) -> Client {
    Client::new(Channel::connect(address).await.unwrap())
}

fn taken(log: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

#[tokio::test]
async fn server_interceptors_run_in_order_and_hand_the_handler_extensions() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let (address, runs) = serve(|b| {
        b.intercept(recorder("first", &log, false))
            .intercept(recorder("second", &log, false))
    })
    .await;
    let seen = look(&client(&address).await).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The second saw the first's metadata; the handler sees the last
    // extension of its type, the metadata (both values: `get` gives the
    // first) and the client.
    assert_eq!(seen, "peer=mem://client caller=second tag=first");
    tokio::task::yield_now().await;
    assert_eq!(
        taken(&log),
        [
            "first call /inspect.Inspect/Look tag=none",
            "second call /inspect.Inspect/Look tag=first",
            "first end /inspect.Inspect/Look Ok",
            "second end /inspect.Inspect/Look Ok",
        ]
    );
}

#[tokio::test]
async fn a_rejecting_interceptor_stops_the_call_before_the_handler() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let (address, runs) = serve(|b| {
        b.intercept(recorder("gate", &log, true))
            .intercept(recorder("after", &log, false))
    })
    .await;
    let client = client(&address).await;
    let status = look(&client).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert_eq!(status.message(), "gate says no");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler ran");
    assert_eq!(
        taken(&log),
        [
            "gate call /inspect.Inspect/Look tag=none",
            "gate end /inspect.Inspect/Look PermissionDenied",
        ],
        "interceptors after the rejecting one do not run"
    );
    // The connection goes on: the next call is refused the same way, not broken.
    assert_eq!(
        look(&client).await.unwrap_err().code(),
        Code::PermissionDenied
    );
}

#[tokio::test]
async fn an_interceptor_scoped_to_a_service_leaves_the_others_alone() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let (address, runs) =
        serve(|b| b.intercept_service("other.Service", recorder("other", &log, true))).await;
    let seen = look(&client(&address).await).await.unwrap();
    assert_eq!(seen, "peer=mem://client caller=none tag=none");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(taken(&log).is_empty());
}

#[tokio::test]
async fn on_end_hears_errors_deadlines_and_cancellations() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let (address, _) = serve(|b| b.intercept(recorder("obs", &log, false))).await;
    let client = client(&address).await;
    let status = client
        .unary::<BytesCodec>("/inspect.Inspect/Fail", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);

    let mut request = Request::new(Bytes::new());
    request.set_timeout(Duration::from_millis(50));
    let status = client
        .unary::<BytesCodec>("/inspect.Inspect/Slow", request)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);

    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        client.unary::<BytesCodec>("/inspect.Inspect/Slow", Request::new(Bytes::new())),
    )
    .await;
    assert!(dropped.is_err(), "the slow call answered");

    let ends = async {
        loop {
            let ends: Vec<String> = log
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.starts_with("obs end"))
                .cloned()
                .collect();
            if ends.len() == 3 {
                return ends;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let ends = tokio::time::timeout(Duration::from_secs(5), ends)
        .await
        .unwrap_or_else(|_| panic!("not every end was heard: {:?}", log.lock().unwrap()));
    assert_eq!(
        ends,
        [
            "obs end /inspect.Inspect/Fail NotFound",
            // Both sides ran out of time; the server's own deadline ends it.
            "obs end /inspect.Inspect/Slow DeadlineExceeded",
            "obs end /inspect.Inspect/Slow Cancelled",
        ]
    );
}

#[tokio::test]
async fn a_client_interceptor_adds_metadata_or_refuses_to_send() {
    let (address, runs) = serve(|b| b).await;
    let tagging = Endpoint::new(&address)
        .unwrap()
        .intercept(|call: &mut CallHead<'_>| {
            assert_eq!(call.peer().address(), call_address(call));
            call.metadata_mut().insert("x-tag", "from-client");
            Ok(())
        })
        .connect()
        .await
        .unwrap();
    let seen = look(&Client::new(tagging)).await.unwrap();
    assert_eq!(seen, "peer=mem://client caller=none tag=from-client");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let log = Arc::new(Mutex::new(Vec::new()));
    let refusing = Endpoint::new(&address)
        .unwrap()
        .intercept(recorder("local", &log, true))
        .connect()
        .await
        .unwrap();
    let status = look(&Client::new(refusing)).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the refused call reached the server"
    );
    assert_eq!(
        taken(&log),
        [
            "local call /inspect.Inspect/Look tag=none",
            "local end /inspect.Inspect/Look PermissionDenied",
        ]
    );
}

fn call_address(call: &CallHead<'_>) -> String {
    call.peer().address().to_string()
}

#[tokio::test]
async fn a_client_interceptor_times_its_calls() {
    let (address, _) = serve(|b| b).await;
    let log = Arc::new(Mutex::new(Vec::new()));
    let channel = Endpoint::new(&address)
        .unwrap()
        .intercept(recorder("timer", &log, false))
        .connect()
        .await
        .unwrap();
    let client = Client::new(channel);
    look(&client).await.unwrap();
    let status = client
        .unary::<BytesCodec>("/inspect.Inspect/Fail", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert_eq!(
        taken(&log),
        [
            "timer call /inspect.Inspect/Look tag=none",
            "timer end /inspect.Inspect/Look Ok",
            "timer call /inspect.Inspect/Fail tag=none",
            "timer end /inspect.Inspect/Fail NotFound",
        ]
    );
}
