//! The shared integration cases (`rpc-test-support`, all of them) over
//! `rdma://` on a real device: every call kind, failures, flow control,
//! kills, and payload sizes around every threshold of this transport.
//!
//! Needs `RDMA_TEST_DEVICE` / `RDMA_TEST_IP` (see `verbs_smoke.rs`); in a
//! two-host run each side runs these over its own device.

mod common;
use rpc_test_support as support;

use support::cases::Profile;

/// Fewer concurrent calls than on TCP (the emulated device is slow), and
/// payloads swept one byte below, at and above the inline limit (an 8 KiB
/// slot less its 32-byte header), one region chunk (512 KiB) and the whole
/// region (1 MiB); a frame adds its head and header fields, hence the range.
fn rdma_profile() -> Profile {
    let mut payload_sizes = vec![0usize, 1, 4095, 4096, 4097, 65_535, 65_536, 65_537];
    for limit in [8160usize, 512 << 10, 1 << 20] {
        payload_sizes.extend(limit - 80..limit + 8);
    }
    payload_sizes.extend([4 << 20, 16 << 20, (64 << 20) - 64]);
    Profile {
        concurrent_calls: 3_000,
        payload_sizes,
    }
}

/// Runs each named case over RDMA.
macro_rules! on_rdma {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = "needs an RDMA device: run through cargo xtask rxe"]
            async fn $case() {
                let env = common::TestEnv::from_env();
                transport_rdma::install();
                support::cases::$case(env.local_listen(), &rdma_profile()).await
            }
        )*
    };
}

rpc_test_support::for_each_case!(on_rdma);
