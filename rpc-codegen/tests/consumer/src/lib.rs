//! A user's crate of rpc-codegen output: every test proto package is
//! included, every service is implemented, every client method is called.
//! Compiling this crate under its strict lints is the first test; the tests
//! at the bottom run calls through the generated code over `mem://`.

use futures::stream::{self, BoxStream, StreamExt as _};
use rpc_core::{Request, Response, Status, Streaming};

/// `package grpc.*`.
pub mod grpc {
    /// `package grpc.testing`: the interop test service.
    pub mod testing {
        rpc_core::include_proto!("grpc.testing");
    }
}

/// `package pkg_a.*`.
pub mod pkg_a {
    /// `package pkg_a.v1`: one `Thing`.
    pub mod v1 {
        rpc_core::include_proto!("pkg_a.v1");
    }
}

/// `package pkg_b`: another `Thing`, and a service using both.
pub mod pkg_b {
    rpc_core::include_proto!("pkg_b");
}

/// `package awkward`: names and types that are awkward in Rust.
pub mod awkward {
    rpc_core::include_proto!("awkward");
}

/// The file without a package.
pub mod nopkg {
    rpc_core::include_proto!("_");
}

use grpc::testing::test_service_server::TestService;
use grpc::testing::{
    Empty, Payload, SimpleRequest, SimpleResponse, StreamingInputCallRequest,
    StreamingInputCallResponse, StreamingOutputCallRequest, StreamingOutputCallResponse,
};

/// A payload of `size` zero bytes.
fn payload(size: i32) -> Payload {
    Payload {
        r#type: 0,
        body: vec![0; usize::try_from(size).unwrap_or(0)].into(),
    }
}

/// The `Status` a request asked for, if any.
fn echo_status(status: Option<&grpc::testing::EchoStatus>) -> Result<(), Status> {
    match status {
        Some(s) if s.code != 0 => Err(Status::new(
            rpc_core::Code::from_u32(u32::try_from(s.code).unwrap_or(2)),
            s.message.clone(),
        )),
        _ => Ok(()),
    }
}

/// The responses one streaming request asks for.
fn responses_for(
    request: &StreamingOutputCallRequest,
) -> Vec<Result<StreamingOutputCallResponse, Status>> {
    request
        .response_parameters
        .iter()
        .map(|p| {
            Ok(StreamingOutputCallResponse {
                payload: Some(payload(p.size)),
            })
        })
        .collect()
}

/// The interop `TestService`, as the gRPC interop server behaves.
#[derive(Debug, Default)]
pub struct Interop;

impl TestService for Interop {
    async fn empty_call(&self, _request: Request<Empty>) -> Result<Response<Empty>, Status> {
        Ok(Response::new(Empty {}))
    }

    async fn unary_call(
        &self,
        request: Request<SimpleRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        let request = request.into_inner();
        echo_status(request.response_status.as_ref())?;
        Ok(Response::new(SimpleResponse {
            payload: Some(payload(request.response_size)),
            username: if request.fill_username {
                "consumer".to_owned()
            } else {
                String::new()
            },
        }))
    }

    type StreamingOutputCallStream =
        stream::Iter<std::vec::IntoIter<Result<StreamingOutputCallResponse, Status>>>;

    async fn streaming_output_call(
        &self,
        request: Request<StreamingOutputCallRequest>,
    ) -> Result<Response<Self::StreamingOutputCallStream>, Status> {
        let request = request.into_inner();
        echo_status(request.response_status.as_ref())?;
        Ok(Response::new(stream::iter(responses_for(&request))))
    }

    async fn streaming_input_call(
        &self,
        request: Request<Streaming<StreamingInputCallRequest>>,
    ) -> Result<Response<StreamingInputCallResponse>, Status> {
        let mut requests = request.into_inner();
        let mut total = 0;
        while let Some(request) = requests.message().await? {
            total += request.payload.map_or(0, |p| p.body.len());
        }
        Ok(Response::new(StreamingInputCallResponse {
            aggregated_payload_size: i32::try_from(total)
                .map_err(|_| Status::out_of_range("payload too large"))?,
        }))
    }

    type FullDuplexCallStream = BoxStream<'static, Result<StreamingOutputCallResponse, Status>>;

    async fn full_duplex_call(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
    ) -> Result<Response<Self::FullDuplexCallStream>, Status> {
        let responses = request.into_inner().flat_map(|request| match request {
            Ok(request) => stream::iter(responses_for(&request)),
            Err(status) => stream::iter(vec![Err(status)]),
        });
        Ok(Response::new(responses.boxed()))
    }

    type HalfDuplexCallStream =
        stream::Iter<std::vec::IntoIter<Result<StreamingOutputCallResponse, Status>>>;

    async fn half_duplex_call(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
    ) -> Result<Response<Self::HalfDuplexCallStream>, Status> {
        let mut requests = request.into_inner();
        let mut responses = Vec::new();
        while let Some(request) = requests.message().await? {
            responses.extend(responses_for(&request));
        }
        Ok(Response::new(stream::iter(responses)))
    }

    async fn unimplemented_call(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<Empty>, Status> {
        Err(Status::unimplemented(
            "UnimplementedCall is not implemented",
        ))
    }
}

/// Implements every rpc of the `awkward` services with their Rust names.
#[derive(Debug, Default)]
pub struct Awkward;

/// The messages `awkward` uses.
type Outer = awkward::Outer;
type Inner = awkward::outer::Inner;
type Timestamp = rpc_core::codegen::prost_types::Timestamp;
type Duration = rpc_core::codegen::prost_types::Duration;

impl awkward::awkward_server::Awkward for Awkward {
    async fn drop(&self, request: Request<Outer>) -> Result<Response<Outer>, Status> {
        Ok(Response::new(request.into_inner()))
    }

    async fn clone(&self, request: Request<Outer>) -> Result<Response<Outer>, Status> {
        Ok(Response::new(request.into_inner()))
    }

    async fn r#type(&self, _request: Request<()>) -> Result<Response<Timestamp>, Status> {
        Ok(Response::new(Timestamp {
            seconds: 1,
            nanos: 2,
        }))
    }

    type AsyncStream = stream::Iter<std::vec::IntoIter<Result<Inner, Status>>>;

    async fn r#async(
        &self,
        request: Request<Inner>,
    ) -> Result<Response<Self::AsyncStream>, Status> {
        let inner = request.into_inner();
        Ok(Response::new(stream::iter(vec![Ok(inner), Ok(inner)])))
    }

    async fn self_(
        &self,
        request: Request<Streaming<Outer>>,
    ) -> Result<Response<Duration>, Status> {
        let mut count = 0;
        let mut requests = request.into_inner();
        while requests.message().await?.is_some() {
            count += 1;
        }
        Ok(Response::new(Duration {
            seconds: count,
            nanos: 0,
        }))
    }

    async fn new_rpc(&self, _request: Request<()>) -> Result<Response<()>, Status> {
        Ok(Response::new(()))
    }

    type ConnectStream = Streaming<()>;

    async fn connect_rpc(
        &self,
        request: Request<Streaming<()>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        // Echo the request stream straight back.
        Ok(Response::new(request.into_inner()))
    }

    async fn channel_rpc(&self, _request: Request<()>) -> Result<Response<()>, Status> {
        Ok(Response::new(()))
    }
}

impl awkward::option_server::Option for Awkward {
    async fn some(&self, request: Request<Outer>) -> Result<Response<Outer>, Status> {
        Ok(Response::new(request.into_inner()))
    }

    async fn none(&self, _request: Request<()>) -> Result<Response<()>, Status> {
        Ok(Response::new(()))
    }
}

impl awkward::result_server::Result for Awkward {
    async fn ok(
        &self,
        request: Request<pkg_a::v1::Thing>,
    ) -> Result<Response<pkg_b::Thing>, Status> {
        Ok(Response::new(pkg_b::Thing {
            id: request.into_inner().name.len() as u64,
        }))
    }
}

impl awkward::future_server::Future for Awkward {
    type PollStream = stream::Iter<std::vec::IntoIter<Result<(), Status>>>;

    async fn poll(&self, _request: Request<()>) -> Result<Response<Self::PollStream>, Status> {
        Ok(Response::new(stream::iter(vec![Ok(())])))
    }
}

impl awkward::nothing_server::Nothing for Awkward {}

impl pkg_b::converter_server::Converter for Awkward {
    async fn a_to_b(
        &self,
        request: Request<pkg_a::v1::Thing>,
    ) -> Result<Response<pkg_b::Thing>, Status> {
        Ok(Response::new(pkg_b::Thing {
            id: request.into_inner().name.len() as u64,
        }))
    }

    type BToAStream = BoxStream<'static, Result<pkg_a::v1::Thing, Status>>;

    async fn b_to_a(
        &self,
        request: Request<Streaming<pkg_b::Thing>>,
    ) -> Result<Response<Self::BToAStream>, Status> {
        let things = request.into_inner().map(|thing| {
            thing.map(|thing| pkg_a::v1::Thing {
                name: thing.id.to_string(),
            })
        });
        Ok(Response::new(things.boxed()))
    }
}

impl nopkg::pinger_server::Pinger for Awkward {
    async fn ping(&self, request: Request<nopkg::Ping>) -> Result<Response<nopkg::Ping>, Status> {
        Ok(Response::new(request.into_inner()))
    }
}

/// A server builder with every generated service added.
pub fn all_services() -> rpc_core::ServerBuilder {
    rpc_core::Server::builder()
        .add_service(grpc::testing::test_service_server::TestServiceServer::new(
            Interop,
        ))
        .add_service(awkward::awkward_server::AwkwardServer::new(Awkward))
        .add_service(awkward::option_server::OptionServer::new(Awkward))
        .add_service(awkward::result_server::ResultServer::new(Awkward))
        .add_service(awkward::future_server::FutureServer::new(Awkward))
        .add_service(awkward::nothing_server::NothingServer::new(Awkward))
        .add_service(pkg_b::converter_server::ConverterServer::new(Awkward))
        .add_service(nopkg::pinger_server::PingerServer::new(Awkward))
}

/// Calls every rpc of the `awkward` package once through its client, and
/// checks the answers.
///
/// # Errors
///
/// The first call that fails.
///
/// # Panics
///
/// When an answer is not what the server should have sent.
pub async fn call_awkward(channel: rpc_core::Channel) -> Result<(), Status> {
    let client = awkward::awkward_client::AwkwardClient::new(channel.clone());
    let outer = Outer {
        r#type: "keyword field".to_owned(),
        choice: Some(awkward::outer::Choice::Number(7)),
        ..Outer::default()
    };
    assert_eq!(client.drop(outer.clone()).await?.into_inner(), outer);
    assert_eq!(client.clone(outer.clone()).await?.into_inner(), outer);
    // The client itself still clones, through the trait.
    let client = Clone::clone(&client);
    assert_eq!(client.r#type(()).await?.into_inner().nanos, 2);
    let mut replies = client.r#async(Inner::default()).await?.into_inner();
    let mut count = 0;
    while replies.message().await?.is_some() {
        count += 1;
    }
    assert_eq!(count, 2);
    let three = stream::iter(vec![outer.clone(), outer.clone(), outer]);
    assert_eq!(client.self_(three).await?.into_inner().seconds, 3);
    client.new_rpc(()).await?;
    client.channel_rpc(()).await?;
    let mut echoed = client
        .connect_rpc(stream::iter(vec![(), ()]))
        .await?
        .into_inner();
    let mut count = 0;
    while echoed.message().await?.is_some() {
        count += 1;
    }
    assert_eq!(count, 2);
    assert_eq!(client.channel().address(), channel.address());

    let option = awkward::option_client::OptionClient::new(channel.clone());
    option.none(()).await?;
    let result = awkward::result_client::ResultClient::new(channel.clone());
    let thing = pkg_a::v1::Thing {
        name: "four".to_owned(),
    };
    assert_eq!(result.ok(thing.clone()).await?.into_inner().id, 4);

    let future = awkward::future_client::FutureClient::new(channel.clone());
    let mut polled = future.poll(()).await?.into_inner();
    assert_eq!(polled.message().await?, Some(()));
    assert_eq!(polled.message().await?, None);
    // A service without rpcs still has a client (with no calls on it).
    let _nothing = awkward::nothing_client::NothingClient::new(channel.clone());

    let converter = pkg_b::converter_client::ConverterClient::new(channel.clone());
    assert_eq!(converter.a_to_b(thing).await?.into_inner().id, 4);
    let mut names = converter
        .b_to_a(stream::iter(vec![
            pkg_b::Thing { id: 1 },
            pkg_b::Thing { id: 22 },
        ]))
        .await?
        .into_inner();
    assert_eq!(names.message().await?.map(|t| t.name).as_deref(), Some("1"));
    assert_eq!(
        names.message().await?.map(|t| t.name).as_deref(),
        Some("22")
    );
    assert!(names.message().await?.is_none());

    let pinger = nopkg::pinger_client::PingerClient::new(channel);
    assert_eq!(
        pinger.ping(nopkg::Ping { seq: 9 }).await?.into_inner().seq,
        9
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use grpc::testing::test_service_client::TestServiceClient;
    use grpc::testing::unimplemented_service_client::UnimplementedServiceClient;
    use grpc::testing::ResponseParameters;

    /// Serves every service on `mem://{name}` and connects a channel to it.
    async fn serve(name: &str) -> rpc_core::Channel {
        let address = format!("mem://{name}");
        let server = all_services().bind(&address).await.unwrap();
        tokio::spawn(server.serve());
        rpc_core::Channel::connect(&address).await.unwrap()
    }

    fn streaming_request(sizes: &[i32]) -> StreamingOutputCallRequest {
        StreamingOutputCallRequest {
            response_parameters: sizes
                .iter()
                .map(|&size| ResponseParameters {
                    size,
                    interval_us: 0,
                })
                .collect(),
            ..StreamingOutputCallRequest::default()
        }
    }

    async fn body_sizes(mut responses: Streaming<StreamingOutputCallResponse>) -> Vec<usize> {
        let mut sizes = Vec::new();
        while let Some(response) = responses.message().await.unwrap() {
            sizes.push(response.payload.unwrap().body.len());
        }
        sizes
    }

    #[tokio::test]
    async fn empty_and_unary() {
        let client = TestServiceClient::connect("mem://consumer-unary").await;
        assert!(client.is_err(), "nothing listens there yet");
        let client = TestServiceClient::new(serve("consumer-unary").await);

        client.empty_call(Empty {}).await.unwrap();
        let response = client
            .unary_call(SimpleRequest {
                response_size: 314_159,
                fill_username: true,
                ..SimpleRequest::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(response.payload.unwrap().body.len(), 314_159);
        assert_eq!(response.username, "consumer");
    }

    #[tokio::test]
    async fn connect_through_the_generated_client() {
        let _channel = serve("consumer-connect").await;
        let client = TestServiceClient::connect("mem://consumer-connect")
            .await
            .unwrap();
        client.empty_call(Request::new(Empty {})).await.unwrap();
    }

    #[tokio::test]
    async fn statuses_come_back() {
        let channel = serve("consumer-status").await;
        let client = TestServiceClient::new(channel.clone());
        let status = client
            .unary_call(SimpleRequest {
                response_status: Some(grpc::testing::EchoStatus {
                    code: 9,
                    message: "echoed".to_owned(),
                }),
                ..SimpleRequest::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), rpc_core::Code::FailedPrecondition);
        assert_eq!(status.message(), "echoed");

        let status = client.unimplemented_call(Empty {}).await.unwrap_err();
        assert_eq!(status.code(), rpc_core::Code::Unimplemented);
        // A method the generated dispatch does not know.
        let status = rpc_core::Client::new(channel.clone())
            .unary::<rpc_core::ProstCodec<Empty, Empty>>(
                "/grpc.testing.TestService/NoSuchCall",
                Request::new(Empty {}),
            )
            .await
            .unwrap_err();
        assert_eq!(status.code(), rpc_core::Code::Unimplemented);
        // A service the server does not have at all.
        let status = UnimplementedServiceClient::new(channel)
            .unimplemented_call(Empty {})
            .await
            .unwrap_err();
        assert_eq!(status.code(), rpc_core::Code::Unimplemented);
    }

    #[tokio::test]
    async fn server_streaming() {
        let client = TestServiceClient::new(serve("consumer-server-streaming").await);
        let responses = client
            .streaming_output_call(streaming_request(&[31_415, 9, 2_653, 58_979]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(body_sizes(responses).await, [31_415, 9, 2_653, 58_979]);
    }

    #[tokio::test]
    async fn client_streaming() {
        let client = TestServiceClient::new(serve("consumer-client-streaming").await);
        let requests = [27_182, 8, 1_828, 45_904].map(|size| StreamingInputCallRequest {
            payload: Some(payload(size)),
        });
        let response = client
            .streaming_input_call(stream::iter(requests))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(response.aggregated_payload_size, 74_922);
    }

    #[tokio::test]
    async fn bidi_streaming() {
        let client = TestServiceClient::new(serve("consumer-bidi").await);
        let requests = vec![streaming_request(&[1, 2]), streaming_request(&[3])];
        let full = client
            .full_duplex_call(stream::iter(requests.clone()))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(body_sizes(full).await, [1, 2, 3]);
        let half = client
            .half_duplex_call(Request::new(stream::iter(requests)))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(body_sizes(half).await, [1, 2, 3]);
    }

    #[tokio::test]
    async fn awkward_names_work_end_to_end() {
        call_awkward(serve("consumer-awkward").await).await.unwrap();
    }
}
