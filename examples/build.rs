//! Generates the example services' code from `proto/`: for rdma-rpc
//! (`rpc-codegen`, into `OUT_DIR`) and, for the tonic-over-RDMA example,
//! the greeter once more as tonic generates it (`tonic-prost-build`, fed by
//! protox so no `protoc` is needed, into `OUT_DIR/tonic`: the same proto
//! package would otherwise write the same file).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    rpc_codegen::compile_protos(
        &[
            "proto/helloworld.proto",
            "proto/shard.proto",
            "proto/ps.proto",
        ],
        &["proto"],
    )?;

    let tonic_out = PathBuf::from(std::env::var("OUT_DIR")?).join("tonic");
    std::fs::create_dir_all(&tonic_out)?;
    let fds = protox::compile(["proto/helloworld.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .out_dir(&tonic_out)
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
