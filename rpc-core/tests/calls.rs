//! Every call kind and every failure a caller can see, over `mem://` and `tcp://`.
//! The cases live in `rpc-test-support`, shared with the other transports' suites.

/// Runs each named case once per transport.
macro_rules! on_every_transport {
    ($($case:ident),* $(,)?) => {
        mod mem {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let profile = rpc_test_support::cases::Profile::standard();
                    rpc_test_support::cases::$case(rpc_test_support::mem_address(), &profile).await
                }
            )*
        }
        mod tcp {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    transport_tcp::install();
                    let profile = rpc_test_support::cases::Profile::standard();
                    rpc_test_support::cases::$case("tcp://127.0.0.1:0".to_string(), &profile).await
                }
            )*
        }
    };
}

rpc_test_support::for_each_case!(on_every_transport);
