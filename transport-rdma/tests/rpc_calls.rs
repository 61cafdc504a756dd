//! rpc-core's integration cases (`rpc-core/tests/support/cases.rs`) over
//! `rdma://` on a real device: every call kind, failures, flow control,
//! kills, and payload sizes around every threshold of this transport.
//!
//! Needs `RDMA_TEST_DEVICE` / `RDMA_TEST_IP` (see `verbs_smoke.rs`); in a
//! two-host run each side runs these over its own device.

mod common;
#[path = "../../rpc-core/tests/support/mod.rs"]
mod support;

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

on_rdma!(
    unary_round_trips_message_and_metadata,
    handler_errors_arrive_with_code_message_and_trailers,
    server_streaming_delivers_every_message_in_order,
    client_streaming_sums_every_message,
    bidi_streaming_answers_each_message,
    thousands_of_concurrent_calls_on_one_channel_none_mixed_up,
    deadline_fails_the_call_and_cancels_the_handler,
    dropping_the_call_cancels_the_handler,
    unknown_service_and_method_are_unimplemented,
    panicking_handler_fails_only_its_call,
    oversized_messages_fail_with_resource_exhausted_and_the_connection_survives,
    slow_reader_holds_back_a_streaming_server,
    slow_handler_holds_back_a_streaming_client,
    killed_server_fails_pending_calls_and_the_channel_reconnects,
    graceful_shutdown_lets_calls_in_flight_finish,
    empty_and_large_messages_arrive_intact,
    keepalive_pings_do_not_disturb_a_slow_call,
    dropping_a_response_stream_stops_the_server_stream,
    calls_over_the_concurrency_limit_are_refused,
);
