//! Generates the health service's messages, client and server trait.

fn main() -> std::io::Result<()> {
    rpc_codegen::compile_protos(&["proto/health.proto"], &["proto"])
}
