//! The shared cases again, over `mem://` and `tcp://`, with the servers'
//! handlers run on the connection's reader first
//! (`ServerBuilder::inline_handlers`): a process of its own, since the
//! setting applies to every test server the process starts.

/// Runs each named case once per transport, servers running handlers inline.
macro_rules! on_every_transport_inline {
    ($($case:ident),* $(,)?) => {
        mod mem {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    rpc_test_support::start_servers_with_inline_handlers();
                    let profile = rpc_test_support::cases::Profile::standard();
                    rpc_test_support::cases::$case(rpc_test_support::mem_address(), &profile).await
                }
            )*
        }
        mod tcp {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    rpc_test_support::start_servers_with_inline_handlers();
                    transport_tcp::install();
                    let profile = rpc_test_support::cases::Profile::standard();
                    rpc_test_support::cases::$case("tcp://127.0.0.1:0".to_string(), &profile).await
                }
            )*
        }
    };
}

rpc_test_support::for_each_case!(on_every_transport_inline);
