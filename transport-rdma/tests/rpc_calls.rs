//! The shared integration cases (`rpc-test-support`, all of them) over
//! `rdma://` on a real device: every call kind, failures, flow control,
//! kills, and payload sizes around every threshold of this transport.
//!
//! Needs `RDMA_TEST_DEVICE` / `RDMA_TEST_IP` (see `verbs_smoke.rs`). They
//! use one device, client and server in one process: the two-host suite
//! leaves them out (it runs the tests named `…_across_the_wire`).

mod common;
use rpc_test_support as support;

/// Runs each named case over RDMA.
macro_rules! on_rdma {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = "needs an RDMA device: run through cargo xtask rxe"]
            async fn $case() {
                let env = common::TestEnv::from_env();
                transport_rdma::install();
                support::cases::$case(env.local_listen(), &common::rdma_profile()).await
            }
        )*
    };
}

rpc_test_support::for_each_case!(on_rdma);
