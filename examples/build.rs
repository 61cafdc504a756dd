//! Generates the example services' code from `proto/`.

fn main() -> std::io::Result<()> {
    rpc_codegen::compile_protos(&["proto/helloworld.proto", "proto/shard.proto"], &["proto"])
}
