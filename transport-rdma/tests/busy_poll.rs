//! The shared cases where the receiving side's polling matters (calls one
//! at a time and many at once, a caller reading its own answer, bursts
//! after lone calls, streams, cancellation) over `rdma://` with a
//! busy-poll window: a receiver that spins on the completion queue, yields
//! and spins again must lose no frame and no wake-up.
//!
//! Needs `RDMA_TEST_DEVICE` / `RDMA_TEST_IP` (see `verbs_smoke.rs`).

mod common;
use rpc_test_support as support;

use std::sync::Arc;
use std::time::Duration;

use support::cases::Profile;
use transport_rdma::RdmaTransport;

fn profile() -> Profile {
    Profile {
        concurrent_calls: 1_000,
        payload_sizes: vec![0, 1, 8_159, 8_160, 100_000, 1 << 20],
    }
}

macro_rules! busy_polling {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = "needs an RDMA device: run through cargo xtask rxe"]
            async fn $case() {
                let env = common::TestEnv::from_env();
                rpc_core::transport::register(Arc::new(
                    RdmaTransport::default().busy_poll(Some(Duration::from_millis(1))),
                ));
                support::cases::$case(env.local_listen(), &profile()).await
            }
        )*
    };
}

busy_polling!(
    unary_round_trips_message_and_metadata,
    server_streaming_delivers_every_message_in_order,
    bidi_streaming_answers_each_message,
    thousands_of_concurrent_calls_on_one_channel_none_mixed_up,
    deadline_fails_the_call_and_cancels_the_handler,
    dropping_the_call_cancels_the_handler,
    a_caller_that_read_for_itself_and_gave_up_hands_reading_back,
    bursts_after_a_lone_call_are_read,
    empty_and_large_messages_arrive_intact,
);
