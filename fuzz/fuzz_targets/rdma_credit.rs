#![no_main]

libfuzzer_sys::fuzz_target!(|input: rdma_rpc_fuzz::rdma_credit::CreditInput| {
    rdma_rpc_fuzz::rdma_credit::check(&input)
});
