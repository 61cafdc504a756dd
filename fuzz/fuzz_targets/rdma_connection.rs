#![no_main]

libfuzzer_sys::fuzz_target!(|input: rdma_rpc_fuzz::rdma_connection::ConnectionInput| {
    rdma_rpc_fuzz::rdma_connection::check(&input)
});
