#![no_main]

libfuzzer_sys::fuzz_target!(|input: rdma_rpc_fuzz::rdma_region::RegionInput| {
    rdma_rpc_fuzz::rdma_region::check(&input)
});
