//! Runs the whole pipeline (protox, prost-build, the service generator) on
//! the protos under `tests/protos` and on small broken ones.
//!
//! That the output compiles and works is checked by the consumer crate in
//! `tests/consumer`.

use std::fs;
use std::path::{Path, PathBuf};

const PROTOS: &[&str] = &[
    "grpc/testing/test.proto",
    "awkward.proto",
    "pkg_b/thing.proto",
    "nopkg.proto",
];

fn protos_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/protos")
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("rpc-codegen")
        .join(name);
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn generate(name: &str, builder: rpc_codegen::Builder) -> PathBuf {
    let out = scratch(name);
    let protos: Vec<PathBuf> = PROTOS.iter().map(|p| protos_dir().join(p)).collect();
    builder
        .out_dir(&out)
        .emit_rerun_if_changed(false)
        .compile(&protos, &[protos_dir()])
        .unwrap();
    out
}

fn read(dir: &Path, file: &str) -> String {
    fs::read_to_string(dir.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// `code` without any whitespace, for matching across prettyplease's line
/// breaks.
fn squash(code: &str) -> String {
    code.chars().filter(|c| !c.is_whitespace()).collect()
}

#[test]
fn one_file_per_package() {
    let out = generate("files", rpc_codegen::configure());
    let mut files: Vec<String> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    // google.protobuf is not generated: it maps to rpc_core's prost_types.
    assert_eq!(
        files,
        [
            "_.rs",
            "awkward.rs",
            "grpc.testing.rs",
            "pkg_a.v1.rs",
            "pkg_b.rs"
        ]
    );
}

#[test]
fn interop_service_all_call_kinds() {
    let out = generate("interop", rpc_codegen::configure());
    let code = read(&out, "grpc.testing.rs");
    assert!(code.contains("pub mod test_service_client {"));
    assert!(code.contains("pub struct TestServiceClient {"));
    assert!(code.contains("pub trait TestService:"));
    assert!(code.contains("pub mod unimplemented_service_server {"));
    assert!(code.contains("\"/grpc.testing.TestService/FullDuplexCall\""));
    assert!(code.contains("type StreamingOutputCallStream:"));
    assert!(code.contains("type FullDuplexCallStream:"));
    assert!(code.contains("type HalfDuplexCallStream:"));
    assert!(!code.contains("StreamingInputCallStream"));
    // Proto comments became docs, on the client struct and on the trait.
    assert_eq!(
        code.matches("/// A service to exercise every kind of call.")
            .count(),
        2
    );
    assert!(code.contains(
        "/// Requests and responses interleaved: each request gets its responses at once."
    ));
    // `bytes` fields are `Bytes` by default.
    assert!(code.contains("pub body: ::prost::bytes::Bytes,"));
}

#[test]
fn bytes_as_vec_switches_zero_copy_off() {
    let out = generate("vec", rpc_codegen::configure().bytes_as_vec());
    let code = read(&out, "grpc.testing.rs");
    assert!(code.contains("pub body: ::prost::alloc::vec::Vec<u8>,"));
}

#[test]
fn build_flags() {
    let out = generate("client-only", rpc_codegen::configure().build_server(false));
    let code = read(&out, "grpc.testing.rs");
    assert!(code.contains("test_service_client"));
    assert!(!code.contains("test_service_server"));
}

#[test]
fn awkward_names_and_well_known_types() {
    let out = generate("awkward", rpc_codegen::configure());
    let code = read(&out, "awkward.rs");
    for expected in [
        "pub async fn drop(",
        "pub async fn clone(",
        "pub async fn r#type(",
        "pub async fn r#async(",
        "pub async fn self_(",
        "pub async fn new_rpc(",
        "pub async fn connect_rpc(",
        "pub async fn channel_rpc(",
        "type AsyncStream:",
        "type ConnectStream:",
        "pub trait Option:",
        "pub trait Result:",
        "pub trait Future:",
        "type PollStream:",
        "pub trait Nothing: ::core::marker::Send + ::core::marker::Sync + 'static {}",
        "\"/awkward.Awkward/self\"",
        "\"/awkward.Result/Ok\"",
        // Well-known types through rpc-core's re-export; `Empty` is `()`.
        "::rpc_core::codegen::prost_types::Timestamp",
        "::rpc_core::codegen::prost_types::Any",
        "ProstCodec<(), ::rpc_core::codegen::prost_types::Timestamp",
        // Messages of other packages, seen from the nested module.
        "super::super::pkg_a::v1::Thing",
        "super::super::pkg_b::Thing",
    ] {
        assert!(
            squash(&code).contains(&squash(expected)),
            "missing {expected:?} in awkward.rs"
        );
    }
    assert!(
        !code
            .replace("::rpc_core::codegen::prost_types::", "")
            .contains("prost_types::"),
        "prost_types must come through rpc_core"
    );
}

#[test]
fn no_package() {
    let out = generate("nopkg", rpc_codegen::configure());
    let code = read(&out, "_.rs");
    assert!(code.contains("\"/Pinger/Ping\""));
    assert!(code.contains("\"Pinger\""));
}

fn compile_one(name: &str, source: &str) -> std::io::Error {
    let dir = scratch(name);
    fs::write(dir.join("bad.proto"), source).unwrap();
    rpc_codegen::configure()
        .out_dir(&dir)
        .emit_rerun_if_changed(false)
        .compile(&[dir.join("bad.proto")], &[&dir])
        .unwrap_err()
}

#[test]
fn parse_error_names_file_and_line() {
    let err = compile_one(
        "parse-error",
        "syntax = \"proto3\";\npackage p;\n\nmessage M {\n  string name = = 1;\n}\n",
    );
    let message = err.to_string();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{message}");
    assert!(message.starts_with("bad.proto:5:"), "{message}");
}

#[test]
fn missing_import_is_not_found() {
    let err = compile_one(
        "missing-import",
        "syntax = \"proto3\";\nimport \"nowhere.proto\";\npackage p;\n",
    );
    let message = err.to_string();
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{message}");
    assert!(message.contains("nowhere.proto"), "{message}");
    assert!(message.starts_with("bad.proto:2:"), "{message}");
}

#[test]
fn services_differing_in_case_are_an_error() {
    let err = compile_one(
        "service-case",
        "syntax = \"proto3\";\npackage p;\nmessage M {}\n\
         service Echo { rpc Say(M) returns (M); }\nservice echo { rpc Say(M) returns (M); }\n",
    );
    assert_eq!(
        err.to_string(),
        "service `Echo` and service `echo` in package `p` would both be named `Echo` in Rust; \
         rename one of them"
    );
}

#[test]
fn service_module_clashing_with_nested_types_module_is_an_error() {
    let err = compile_one(
        "module-clash",
        "syntax = \"proto3\";\npackage p;\nmessage M {}\n\
         message EchoClient { enum Kind { A = 0; } }\n\
         service Echo { rpc Say(M) returns (M); }\n",
    );
    assert_eq!(
        err.to_string(),
        "message `EchoClient` and service `Echo` in package `p` would both be named `echo_client` \
         in Rust; rename one of them"
    );
}

#[test]
fn map_fields_and_optional_make_no_module() {
    // `map` makes a nested entry message and proto3 `optional` a synthetic
    // oneof; neither makes prost write `pub mod echo_client`.
    let dir = scratch("no-module-clash");
    fs::write(
        dir.join("ok.proto"),
        "syntax = \"proto3\";\npackage p;\n\
         message EchoClient { map<string, string> m = 1; optional int32 x = 2; }\n\
         service Echo { rpc Say(EchoClient) returns (EchoClient); }\n",
    )
    .unwrap();
    rpc_codegen::configure()
        .out_dir(&dir)
        .emit_rerun_if_changed(false)
        .compile(&[dir.join("ok.proto")], &[&dir])
        .unwrap();
    let code = read(&dir, "p.rs");
    assert_eq!(code.matches("pub mod echo_client {").count(), 1);
}

#[test]
fn rpcs_differing_in_case_are_an_error() {
    let err = compile_one(
        "rpc-case",
        "syntax = \"proto3\";\npackage p;\nmessage M {}\n\
         service Echo { rpc GetThing(M) returns (M); rpc get_thing(M) returns (M); }\n",
    );
    assert!(
        err.to_string().starts_with(
            "rpcs `GetThing` and `get_thing` of service `p.Echo` would both be named `get_thing`"
        ),
        "{err}"
    );
}
