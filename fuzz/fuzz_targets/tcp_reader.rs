#![no_main]

libfuzzer_sys::fuzz_target!(|input: rdma_rpc_fuzz::tcp_reader::Input| {
    rdma_rpc_fuzz::tcp_reader::check(&input)
});
