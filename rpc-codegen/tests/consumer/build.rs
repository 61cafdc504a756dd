//! Generates code for every proto under `../protos`.

fn main() -> std::io::Result<()> {
    rpc_codegen::compile_protos(
        &[
            "../protos/grpc/testing/test.proto",
            "../protos/awkward.proto",
            "../protos/pkg_b/thing.proto",
            "../protos/nopkg.proto",
        ],
        &["../protos"],
    )
}
