//! The `prost_build::ServiceGenerator` that writes clients and server traits.
//!
//! The output follows `docs/codegen-contract.md`. Every path in it is fully
//! qualified (`::core::result::Result`, `::rpc_core::codegen::Status`, ...), so
//! a service or rpc named like a prelude item (`Result`, `Option`, `Box`) cannot
//! shadow what the generated code means. Calls from the server glue into the
//! user's trait go through `<T as Trait>::method(&inner, request)`, so rpcs named
//! `Clone` or `Drop` cannot be confused with the std traits' methods.

use prost_build::{Comments, Method, Service, ServiceGenerator};

use crate::names::{MethodNames, ServiceNames};

/// Shorthand for the one module generated code imports from.
const CG: &str = "::rpc_core::codegen";

/// Lints allowed inside each generated module. The code is included into user
/// crates with `include!`, where the user's lint levels apply; rpc names are
/// chosen by the proto author, so style lints about them are not actionable.
const ALLOWS: &str = "#![allow(missing_docs, unreachable_pub, unused_qualifications, \
     clippy::all, clippy::pedantic, clippy::nursery, clippy::restriction)]";

/// Generates a client module and/or a server module per service.
#[derive(Debug, Clone)]
pub(crate) struct RpcServiceGenerator {
    pub(crate) build_client: bool,
    pub(crate) build_server: bool,
}

impl ServiceGenerator for RpcServiceGenerator {
    fn generate(&mut self, service: Service, buf: &mut String) {
        if self.build_client {
            write_client(&service, buf);
        }
        if self.build_server {
            write_server(&service, buf);
        }
    }
}

/// The four call kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallKind {
    Unary,
    ServerStreaming,
    ClientStreaming,
    Bidi,
}

impl CallKind {
    fn of(method: &Method) -> Self {
        match (method.client_streaming, method.server_streaming) {
            (false, false) => CallKind::Unary,
            (false, true) => CallKind::ServerStreaming,
            (true, false) => CallKind::ClientStreaming,
            (true, true) => CallKind::Bidi,
        }
    }

    /// The `rpc_core::codegen::Client` method and the server helper.
    fn helper(self) -> &'static str {
        match self {
            CallKind::Unary => "unary",
            CallKind::ServerStreaming => "server_streaming",
            CallKind::ClientStreaming => "client_streaming",
            CallKind::Bidi => "streaming",
        }
    }

    /// Type arguments after the codec in the server helper's turbofish.
    fn helper_infer_args(self) -> &'static str {
        match self {
            CallKind::Unary | CallKind::ClientStreaming => "_, _",
            CallKind::ServerStreaming | CallKind::Bidi => "_, _, _",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            CallKind::Unary => "Unary",
            CallKind::ServerStreaming => "Server-streaming",
            CallKind::ClientStreaming => "Client-streaming",
            CallKind::Bidi => "Bidirectional-streaming",
        }
    }

    fn streams_response(self) -> bool {
        matches!(self, CallKind::ServerStreaming | CallKind::Bidi)
    }
}

/// The Rust type of a request or response message, as seen from inside the
/// generated `*_client` / `*_server` module.
///
/// prost-build gives paths relative to the package module (`HelloRequest`,
/// `super::other::Thing`), absolute ones for extern paths
/// (`::rpc_core::codegen::prost_types::Timestamp`) and bare types for some
/// well-known types (`()` for `Empty`, `bool` for `BoolValue`).
fn message_type(rust_type: &str) -> String {
    const BARE: &[&str] = &["()", "bool", "f32", "f64", "i32", "i64", "u32", "u64"];
    if rust_type.starts_with("::") || rust_type.starts_with("crate::") || BARE.contains(&rust_type)
    {
        rust_type.to_owned()
    } else {
        format!("super::{rust_type}")
    }
}

/// `/package.Service/Method`, or `/Service/Method` without a package.
fn method_path(service: &Service, method: &Method) -> String {
    format!("/{}/{}", full_name(service), method.proto_name)
}

fn full_name(service: &Service) -> String {
    ServiceNames::new(&service.package, &service.proto_name).full_name
}

fn has_comments(comments: &Comments) -> bool {
    !comments.leading.is_empty() || !comments.trailing.is_empty()
}

/// Writes the proto comments as `///` lines, or `fallback` when there are none.
fn doc(buf: &mut String, indent: u8, comments: &Comments, fallback: &str) {
    if has_comments(comments) {
        // Only the comments attached to the element; detached blocks are
        // usually license headers or section separators.
        let attached = Comments {
            leading_detached: Vec::new(),
            leading: comments.leading.clone(),
            trailing: comments.trailing.clone(),
        };
        attached.append_with_indent(indent, buf);
    } else {
        for line in fallback.lines() {
            line_at(buf, indent, &format!("/// {line}"));
        }
    }
}

fn line_at(buf: &mut String, indent: u8, text: &str) {
    for _ in 0..indent {
        buf.push_str("    ");
    }
    buf.push_str(text);
    buf.push('\n');
}

fn write_client(service: &Service, buf: &mut String) {
    let names = ServiceNames::new(&service.package, &service.proto_name);
    let full = &names.full_name;
    let client = &names.client_struct;

    line_at(buf, 0, &format!("/// Client for the `{full}` service."));
    line_at(buf, 0, &format!("pub mod {} {{", names.client_mod));
    line_at(buf, 1, ALLOWS);
    doc(
        buf,
        1,
        &service.comments,
        &format!("Client for the `{full}` service."),
    );
    line_at(buf, 1, "///");
    line_at(
        buf,
        1,
        &format!("/// Cloning is cheap: clones share one [`{CG}::Channel`]."),
    );
    line_at(buf, 1, "#[derive(Clone, Debug)]");
    line_at(buf, 1, &format!("pub struct {client} {{"));
    line_at(buf, 2, &format!("inner: {CG}::Client,"));
    line_at(buf, 1, "}");
    line_at(buf, 1, &format!("impl {client} {{"));
    line_at(
        buf,
        2,
        "/// Connects to `addr` (`tcp://host:port`, `rdma://host:port`, ...).",
    );
    line_at(
        buf,
        2,
        &format!(
            "pub async fn connect(addr: impl ::core::convert::AsRef<str>) \
             -> ::core::result::Result<Self, {CG}::ConnectError> {{"
        ),
    );
    line_at(
        buf,
        3,
        &format!(
            "::core::result::Result::Ok(Self::new({CG}::Channel::connect(\
             ::core::convert::AsRef::<str>::as_ref(&addr)).await?))"
        ),
    );
    line_at(buf, 2, "}");
    line_at(buf, 2, "/// Makes a client that sends on `channel`.");
    line_at(
        buf,
        2,
        &format!("pub fn new(channel: {CG}::Channel) -> Self {{"),
    );
    line_at(
        buf,
        3,
        &format!("Self {{ inner: {CG}::Client::new(channel) }}"),
    );
    line_at(buf, 2, "}");
    line_at(buf, 2, "/// The channel this client sends on.");
    line_at(
        buf,
        2,
        &format!("pub fn channel(&self) -> &{CG}::Channel {{"),
    );
    line_at(buf, 3, "self.inner.channel()");
    line_at(buf, 2, "}");
    for method in &service.methods {
        write_client_method(service, method, buf);
    }
    line_at(buf, 1, "}");
    line_at(buf, 0, "}");
}

fn write_client_method(service: &Service, method: &Method, buf: &mut String) {
    let kind = CallKind::of(method);
    let names = MethodNames::new(&method.proto_name);
    let req = message_type(&method.input_type);
    let resp = message_type(&method.output_type);
    let path = method_path(service, method);

    doc(
        buf,
        2,
        &method.comments,
        &format!("{} call to `{path}`.", kind.describe()),
    );
    let request_arg = if method.client_streaming {
        format!("impl {CG}::IntoStreamingRequest<Message = {req}>")
    } else {
        format!("impl {CG}::IntoRequest<{req}>")
    };
    let response = if kind.streams_response() {
        format!("{CG}::Response<{CG}::Streaming<{resp}>>")
    } else {
        format!("{CG}::Response<{resp}>")
    };
    // `Client::client_streaming` and `Client::streaming` are also generic
    // over the request stream.
    let (into, stream_arg) = if method.client_streaming {
        ("into_streaming_request", ", _")
    } else {
        ("into_request", "")
    };
    line_at(
        buf,
        2,
        &format!(
            "pub async fn {}(&self, request: {request_arg}) \
             -> ::core::result::Result<{response}, {CG}::Status> {{",
            names.method
        ),
    );
    line_at(
        buf,
        3,
        &format!(
            "self.inner.{}::<{CG}::ProstCodec<{req}, {resp}>{stream_arg}>(\"{path}\", request.{into}()).await",
            kind.helper()
        ),
    );
    line_at(buf, 2, "}");
}

fn write_server(service: &Service, buf: &mut String) {
    let names = ServiceNames::new(&service.package, &service.proto_name);
    let full = &names.full_name;
    let tr = &names.server_trait;
    let server = &names.server_struct;
    // The generic parameter must not be spelled like the trait.
    let t = if tr == "T" { "U" } else { "T" };

    line_at(
        buf,
        0,
        &format!("/// Server trait and glue for the `{full}` service."),
    );
    line_at(buf, 0, &format!("pub mod {} {{", names.server_mod));
    line_at(buf, 1, ALLOWS);

    // The trait.
    doc(buf, 1, &service.comments, &format!("The `{full}` service."));
    line_at(buf, 1, "///");
    line_at(
        buf,
        1,
        &format!("/// Implement this, wrap it in [`{server}`] and add that to a server."),
    );
    line_at(
        buf,
        1,
        &format!("pub trait {tr}: ::core::marker::Send + ::core::marker::Sync + 'static {{"),
    );
    for method in &service.methods {
        write_trait_method(service, method, buf);
    }
    line_at(buf, 1, "}");

    // The glue struct.
    line_at(
        buf,
        1,
        &format!("/// Serves a [`{tr}`] implementation as the `{full}` service."),
    );
    line_at(buf, 1, &format!("pub struct {server}<{t}> {{"));
    line_at(buf, 2, &format!("inner: {CG}::Arc<{t}>,"));
    line_at(buf, 1, "}");
    line_at(buf, 1, &format!("impl<{t}: {tr}> {server}<{t}> {{"));
    line_at(buf, 2, "/// Serves `inner`.");
    line_at(buf, 2, &format!("pub fn new(inner: {t}) -> Self {{"));
    line_at(buf, 3, &format!("Self::from_arc({CG}::Arc::new(inner))"));
    line_at(buf, 2, "}");
    line_at(
        buf,
        2,
        "/// Serves an `inner` that is shared with other code.",
    );
    line_at(
        buf,
        2,
        &format!("pub fn from_arc(inner: {CG}::Arc<{t}>) -> Self {{"),
    );
    line_at(buf, 3, "Self { inner }");
    line_at(buf, 2, "}");
    line_at(buf, 1, "}");
    line_at(
        buf,
        1,
        &format!("impl<{t}> ::core::clone::Clone for {server}<{t}> {{"),
    );
    line_at(buf, 2, "fn clone(&self) -> Self {");
    line_at(
        buf,
        3,
        &format!("Self {{ inner: {CG}::Arc::clone(&self.inner) }}"),
    );
    line_at(buf, 2, "}");
    line_at(buf, 1, "}");
    line_at(
        buf,
        1,
        &format!("impl<{t}> ::core::fmt::Debug for {server}<{t}> {{"),
    );
    line_at(
        buf,
        2,
        "fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {",
    );
    line_at(
        buf,
        3,
        &format!("f.debug_struct(\"{server}\").finish_non_exhaustive()"),
    );
    line_at(buf, 2, "}");
    line_at(buf, 1, "}");

    // Dispatch.
    line_at(
        buf,
        1,
        &format!("impl<{t}: {tr}> {CG}::Service for {server}<{t}> {{"),
    );
    line_at(buf, 2, "fn name(&self) -> &'static str {");
    line_at(buf, 3, &format!("\"{full}\""));
    line_at(buf, 2, "}");
    line_at(
        buf,
        2,
        &format!("fn call(&self, method: &str, call: {CG}::ServerCall) -> {CG}::BoxFuture<'static, ()> {{"),
    );
    if service.methods.is_empty() {
        line_at(buf, 3, "let _ = method;");
    } else {
        line_at(
            buf,
            3,
            &format!("let inner = {CG}::Arc::clone(&self.inner);"),
        );
        line_at(buf, 3, "match method {");
        for method in &service.methods {
            let kind = CallKind::of(method);
            let names = MethodNames::new(&method.proto_name);
            let req = message_type(&method.input_type);
            let resp = message_type(&method.output_type);
            line_at(
                buf,
                4,
                &format!(
                    "\"{}\" => {CG}::{}::<{CG}::ProstCodec<{resp}, {req}>, {}>(call, \
                     move |request| async move {{ <{t} as {tr}>::{}(&inner, request).await }}),",
                    method.proto_name,
                    kind.helper(),
                    kind.helper_infer_args(),
                    names.method
                ),
            );
        }
        line_at(buf, 4, &format!("_ => {CG}::unimplemented(call),"));
        line_at(buf, 3, "}");
    }
    if service.methods.is_empty() {
        line_at(buf, 3, &format!("{CG}::unimplemented(call)"));
    }
    line_at(buf, 2, "}");
    line_at(buf, 1, "}");
    line_at(buf, 0, "}");
}

fn write_trait_method(service: &Service, method: &Method, buf: &mut String) {
    let kind = CallKind::of(method);
    let names = MethodNames::new(&method.proto_name);
    let req = message_type(&method.input_type);
    let resp = message_type(&method.output_type);
    let path = method_path(service, method);

    let request = if method.client_streaming {
        format!("{CG}::Request<{CG}::Streaming<{req}>>")
    } else {
        format!("{CG}::Request<{req}>")
    };
    let response = if kind.streams_response() {
        let stream = &names.stream_type;
        // rustdoc cannot link to a raw identifier (`Self::r#async`).
        let method_ref = if names.method.starts_with("r#") {
            format!("`{}`", names.method)
        } else {
            format!("[`Self::{}`]", names.method)
        };
        line_at(
            buf,
            2,
            &format!("/// The stream of responses that {method_ref} returns."),
        );
        line_at(
            buf,
            2,
            &format!(
                "type {stream}: {CG}::Stream<Item = ::core::result::Result<{resp}, {CG}::Status>> \
                 + ::core::marker::Send + 'static;"
            ),
        );
        format!("{CG}::Response<Self::{stream}>")
    } else {
        format!("{CG}::Response<{resp}>")
    };
    doc(
        buf,
        2,
        &method.comments,
        &format!("{} call to `{path}`.", kind.describe()),
    );
    line_at(
        buf,
        2,
        &format!(
            "fn {}(&self, request: {request}) -> impl {CG}::Future<Output = \
             ::core::result::Result<{response}, {CG}::Status>> + ::core::marker::Send;",
            names.method
        ),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn method(proto_name: &str, input: &str, output: &str, cs: bool, ss: bool) -> Method {
        Method {
            name: String::new(), // unused: we derive names from proto_name
            proto_name: proto_name.to_owned(),
            comments: Comments::default(),
            input_type: input.to_owned(),
            output_type: output.to_owned(),
            input_proto_type: String::new(),
            output_proto_type: String::new(),
            options: Default::default(),
            client_streaming: cs,
            server_streaming: ss,
        }
    }

    fn greeter() -> Service {
        let mut say_hello = method("SayHello", "HelloRequest", "HelloReply", false, false);
        say_hello.comments.leading = vec![" Sends a greeting.".to_owned()];
        Service {
            name: "Greeter".to_owned(),
            proto_name: "Greeter".to_owned(),
            package: "helloworld".to_owned(),
            comments: Comments {
                leading_detached: vec![vec![" Copyright header".to_owned()]],
                leading: vec![" The greeting service.".to_owned()],
                trailing: Vec::new(),
            },
            methods: vec![
                say_hello,
                method("LotsOfReplies", "HelloRequest", "HelloReply", false, true),
                method("LotsOfGreetings", "HelloRequest", "HelloReply", true, false),
                method("BidiHello", "HelloRequest", "HelloReply", true, true),
                method(
                    "Type",
                    "()",
                    "::rpc_core::codegen::prost_types::Timestamp",
                    false,
                    false,
                ),
                method("Connect", "super::other::Thing", "bool", false, false),
            ],
            options: Default::default(),
        }
    }

    fn generate(service: Service, client: bool, server: bool) -> String {
        let mut buf = String::new();
        RpcServiceGenerator {
            build_client: client,
            build_server: server,
        }
        .generate(service, &mut buf);
        buf
    }

    #[test]
    fn client_and_server_modules_and_names() {
        let code = generate(greeter(), true, true);
        assert!(code.contains("pub mod greeter_client {"));
        assert!(code.contains("pub struct GreeterClient {"));
        assert!(code.contains("pub mod greeter_server {"));
        assert!(code.contains(
            "pub trait Greeter: ::core::marker::Send + ::core::marker::Sync + 'static {"
        ));
        assert!(code.contains("pub struct GreeterServer<T> {"));
        assert!(
            code.contains("fn name(&self) -> &'static str {\n            \"helloworld.Greeter\"")
        );
    }

    #[test]
    fn build_flags_select_modules() {
        let client_only = generate(greeter(), true, false);
        assert!(client_only.contains("pub mod greeter_client"));
        assert!(!client_only.contains("greeter_server"));
        let server_only = generate(greeter(), false, true);
        assert!(!server_only.contains("greeter_client"));
        assert!(server_only.contains("pub mod greeter_server"));
    }

    #[test]
    fn client_methods_per_call_kind() {
        let code = generate(greeter(), true, false);
        assert!(code.contains(
            "pub async fn say_hello(&self, request: impl ::rpc_core::codegen::IntoRequest<super::HelloRequest>) \
             -> ::core::result::Result<::rpc_core::codegen::Response<super::HelloReply>, ::rpc_core::codegen::Status> {"
        ));
        assert!(code.contains(
            "self.inner.unary::<::rpc_core::codegen::ProstCodec<super::HelloRequest, super::HelloReply>>(\
             \"/helloworld.Greeter/SayHello\", request.into_request()).await"
        ));
        assert!(code.contains(
            "pub async fn lots_of_replies(&self, request: impl ::rpc_core::codegen::IntoRequest<super::HelloRequest>) \
             -> ::core::result::Result<::rpc_core::codegen::Response<::rpc_core::codegen::Streaming<super::HelloReply>>"
        ));
        assert!(code.contains("self.inner.server_streaming::<"));
        assert!(code.contains(
            "pub async fn lots_of_greetings(&self, request: impl ::rpc_core::codegen::IntoStreamingRequest<Message = super::HelloRequest>)"
        ));
        assert!(code.contains(
            "self.inner.client_streaming::<::rpc_core::codegen::ProstCodec<super::HelloRequest, super::HelloReply>, _>(\
             \"/helloworld.Greeter/LotsOfGreetings\", request.into_streaming_request()).await"
        ));
        assert!(code.contains("self.inner.streaming::<"));
    }

    #[test]
    fn message_paths_seen_from_the_nested_module() {
        assert_eq!(message_type("HelloRequest"), "super::HelloRequest");
        assert_eq!(
            message_type("super::other::Thing"),
            "super::super::other::Thing"
        );
        assert_eq!(message_type("outer::Inner"), "super::outer::Inner");
        assert_eq!(message_type("()"), "()");
        assert_eq!(message_type("bool"), "bool");
        assert_eq!(
            message_type("::rpc_core::codegen::prost_types::Timestamp"),
            "::rpc_core::codegen::prost_types::Timestamp"
        );
        let code = generate(greeter(), true, true);
        assert!(code.contains("ProstCodec<(), ::rpc_core::codegen::prost_types::Timestamp>"));
        assert!(code.contains("ProstCodec<bool, super::super::other::Thing>"));
    }

    #[test]
    fn keyword_and_helper_rpc_names() {
        let code = generate(greeter(), true, true);
        // `rpc Type` -> raw identifier, proto name kept on the wire.
        assert!(code.contains("pub async fn r#type(&self"));
        assert!(code.contains("fn r#type(&self, request: ::rpc_core::codegen::Request<()>)"));
        assert!(code.contains("\"/helloworld.Greeter/Type\""));
        assert!(code.contains("\"Type\" => ::rpc_core::codegen::unary::<"));
        assert!(code.contains("<T as Greeter>::r#type(&inner, request)"));
        // `rpc Connect` must not clash with `GreeterClient::connect`.
        assert!(code.contains("pub async fn connect(addr: impl"));
        assert!(code.contains("pub async fn connect_rpc(&self"));
        assert!(code.contains("fn connect_rpc(&self, request:"));
        assert!(code.contains("\"Connect\" => "));
    }

    #[test]
    fn server_trait_and_dispatch() {
        let code = generate(greeter(), false, true);
        assert!(code.contains(
            "fn say_hello(&self, request: ::rpc_core::codegen::Request<super::HelloRequest>) \
             -> impl ::rpc_core::codegen::Future<Output = ::core::result::Result<\
             ::rpc_core::codegen::Response<super::HelloReply>, ::rpc_core::codegen::Status>> + ::core::marker::Send;"
        ));
        assert!(code.contains(
            "type LotsOfRepliesStream: ::rpc_core::codegen::Stream<Item = ::core::result::Result<super::HelloReply, \
             ::rpc_core::codegen::Status>> + ::core::marker::Send + 'static;"
        ));
        assert!(code.contains("Response<Self::LotsOfRepliesStream>"));
        assert!(code.contains("type BidiHelloStream:"));
        assert!(!code.contains("SayHelloStream"));
        assert!(!code.contains("LotsOfGreetingsStream"));
        assert!(code.contains(
            "fn lots_of_greetings(&self, request: ::rpc_core::codegen::Request<::rpc_core::codegen::Streaming<super::HelloRequest>>)"
        ));
        // The server codec encodes the response and decodes the request.
        assert!(code.contains(
            "\"SayHello\" => ::rpc_core::codegen::unary::<::rpc_core::codegen::ProstCodec<super::HelloReply, super::HelloRequest>, _, _>(call, \
             move |request| async move { <T as Greeter>::say_hello(&inner, request).await }),"
        ));
        assert!(code.contains("\"LotsOfReplies\" => ::rpc_core::codegen::server_streaming::<"));
        assert!(code.contains("\"LotsOfGreetings\" => ::rpc_core::codegen::client_streaming::<"));
        assert!(code.contains("\"BidiHello\" => ::rpc_core::codegen::streaming::<"));
        assert!(code.contains("_ => ::rpc_core::codegen::unimplemented(call),"));
        // Clone without a `T: Clone` bound, never through `self.inner.clone()`.
        assert!(code.contains("impl<T> ::core::clone::Clone for GreeterServer<T> {"));
        assert!(code.contains("::rpc_core::codegen::Arc::clone(&self.inner)"));
        assert!(!code.contains("self.inner.clone()"));
    }

    #[test]
    fn doc_comments_from_proto_or_fallback() {
        let code = generate(greeter(), true, true);
        // Service comment on the client struct and on the trait; no detached
        // comment (the copyright header).
        assert_eq!(code.matches("/// The greeting service.").count(), 2);
        assert!(!code.contains("Copyright"));
        // Method comment on the client method and on the trait method.
        assert_eq!(code.matches("/// Sends a greeting.").count(), 2);
        // Methods without comments get one that names the call.
        assert!(code.contains("/// Server-streaming call to `/helloworld.Greeter/LotsOfReplies`."));
        assert!(
            code.contains("/// Bidirectional-streaming call to `/helloworld.Greeter/BidiHello`.")
        );
    }

    #[test]
    fn stream_type_docs_link_to_the_method() {
        let mut svc = greeter();
        svc.methods
            .push(method("async", "HelloRequest", "HelloReply", false, true));
        let code = generate(svc, false, true);
        assert!(code.contains(
            "/// The stream of responses that [`Self::lots_of_replies`] returns.\n        type LotsOfRepliesStream:"
        ));
        // rustdoc cannot resolve `Self::r#async`: no link.
        assert!(code.contains(
            "/// The stream of responses that `r#async` returns.\n        type AsyncStream:"
        ));
    }

    #[test]
    fn no_package_and_trait_named_t() {
        let mut svc = greeter();
        svc.package = String::new();
        svc.proto_name = "T".to_owned();
        let code = generate(svc, true, true);
        assert!(code.contains("\"/T/SayHello\""));
        assert!(code.contains("pub trait T:"));
        assert!(code.contains("pub struct TServer<U> {"));
        assert!(code.contains("<U as T>::say_hello(&inner, request)"));
    }
}
