//! Every call kind and every failure a caller can see, over `mem://` and `tcp://`.
//! The cases live in `support/cases.rs`, shared with the other transports' suites.

mod support;

/// Runs each named case once per transport.
macro_rules! on_every_transport {
    ($($case:ident),* $(,)?) => {
        mod mem {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let profile = super::support::cases::Profile::standard();
                    super::support::cases::$case(super::support::mem_address(), &profile).await
                }
            )*
        }
        mod tcp {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    transport_tcp::install();
                    let profile = super::support::cases::Profile::standard();
                    super::support::cases::$case("tcp://127.0.0.1:0".to_string(), &profile).await
                }
            )*
        }
    };
}

on_every_transport!(
    unary_round_trips_message_and_metadata,
    handler_errors_arrive_with_code_message_and_trailers,
    server_streaming_delivers_every_message_in_order,
    client_streaming_sums_every_message,
    bidi_streaming_answers_each_message,
    thousands_of_concurrent_calls_on_one_channel_none_mixed_up,
    deadline_fails_the_call_and_cancels_the_handler,
    zero_timeout_fails_at_once_without_sending,
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
