//! Generates the echo service twice from identical protos: for rdma-rpc
//! (`rpc-codegen`) and for tonic (`tonic-prost-build`, fed by protox so no
//! `protoc` is needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    rpc_codegen::compile_protos(&["proto/rpcbench.proto"], &["proto"])?;

    let fds = protox::compile(["proto/tonicbench.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_transport(false)
        .bytes(".tonicbench")
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
