//! The shared cases again, over `mem://` and `tcp://`, with the servers
//! serving each connection on one of two threads of their own, each a
//! current-thread runtime (`ServerBuilder::thread_per_core`): a process of
//! its own, since the setting applies to every test server the process
//! starts.

/// Runs each named case once per transport, servers on threads of their own.
macro_rules! on_every_transport_thread_per_core {
    ($($case:ident),* $(,)?) => {
        mod mem {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    rpc_test_support::start_servers_thread_per_core(2);
                    let profile = rpc_test_support::cases::Profile::standard();
                    rpc_test_support::cases::$case(rpc_test_support::mem_address(), &profile).await
                }
            )*
        }
        mod tcp {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    rpc_test_support::start_servers_thread_per_core(2);
                    transport_tcp::install();
                    let profile = rpc_test_support::cases::Profile::standard();
                    rpc_test_support::cases::$case("tcp://127.0.0.1:0".to_string(), &profile).await
                }
            )*
        }
    };
}

rpc_test_support::for_each_case!(on_every_transport_thread_per_core);

/// Each connection is served on one of the server's threads, always the
/// same one, and connections spread over the threads: they take turns at
/// the listener. (Turns, not a fixed rotation: a thread the OS has not run
/// yet has not queued for its turn, so the test connects until both threads
/// served one, at most 20 times, 20 ms apart.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_connection_stays_on_one_server_thread_and_connections_spread() {
    use std::collections::HashSet;
    use std::time::Duration;

    use bytes::Bytes;
    use rpc_core::{BytesCodec, Channel, Client, Request};

    rpc_test_support::start_servers_thread_per_core(2);
    transport_tcp::install();
    let server = rpc_test_support::TestServer::start("tcp://127.0.0.1:0", |b| b).await;
    let expected: HashSet<String> = ["rpc-server-0", "rpc-server-1"].map(String::from).into();
    let mut threads = HashSet::new();
    for connection in 0..20 {
        let client = Client::new(Channel::connect(&server.address).await.expect("connects"));
        let mut seen = HashSet::new();
        for _ in 0..10 {
            let thread = client
                .unary::<BytesCodec>("/test.Test/Thread", Request::new(Bytes::new()))
                .await
                .expect("the call")
                .into_inner();
            seen.insert(String::from_utf8(thread.to_vec()).expect("a thread name"));
        }
        assert_eq!(
            seen.len(),
            1,
            "connection {connection} was served on {seen:?}"
        );
        assert!(
            seen.is_subset(&expected),
            "connection {connection} was served on {seen:?}"
        );
        threads.extend(seen);
        if threads == expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        threads, expected,
        "20 connections were all served on one thread"
    );
    server.stop().await;
}
