#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_rpc_fuzz::rdma_header::check(data));
