//! The shared integration cases again over `rdma://`, with the servers
//! serving each connection on one of two threads of their own, each a
//! current-thread runtime (`ServerBuilder::thread_per_core`): a
//! connection's calls run on a server thread while its transport's
//! driver stays on the runtime that listens. A process of its own, since
//! the setting applies to every test server the process starts.
//!
//! Needs `RDMA_TEST_DEVICE` / `RDMA_TEST_IP` (see `verbs_smoke.rs`).

mod common;
use rpc_test_support as support;

/// Runs each named case over RDMA, servers on threads of their own.
macro_rules! on_rdma_thread_per_core {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = "needs an RDMA device: run through cargo xtask rxe"]
            async fn $case() {
                support::start_servers_thread_per_core(2);
                let env = common::TestEnv::from_env();
                transport_rdma::install();
                support::cases::$case(env.local_listen(), &common::rdma_profile()).await
            }
        )*
    };
}

rpc_test_support::for_each_case!(on_rdma_thread_per_core);
