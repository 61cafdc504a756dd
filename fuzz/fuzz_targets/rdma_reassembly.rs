#![no_main]

libfuzzer_sys::fuzz_target!(|input: rdma_rpc_fuzz::rdma_reassembly::ReassemblyInput| {
    rdma_rpc_fuzz::rdma_reassembly::check(&input)
});
