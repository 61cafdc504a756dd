//! What the server writes to its log about clients that misbehave or vanish:
//! a log line is an interface too (operators grep and alert on them). A
//! client that disconnects mid-frame is not a protocol error, a silent client
//! is described as such, and no reason is prefixed twice.

use rpc_test_support as support;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::TestServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing_subscriber::fmt::MakeWriter;

/// Every line the `tracing` subscriber formats, kept for the test to read.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    /// Captures what this thread logs (at every level) until the guard drops.
    /// The tests run on a current-thread runtime, so this covers the server.
    fn install() -> (Captured, tracing::subscriber::DefaultGuard) {
        let captured = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(captured.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .finish();
        (captured, tracing::subscriber::set_default(subscriber))
    }

    fn lines(&self) -> Vec<String> {
        let bytes = self.0.lock().unwrap();
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Waits (up to 10 s) for a line containing `needle`, and returns it.
    async fn wait_for(&self, needle: &str) -> String {
        let found = async {
            loop {
                if let Some(line) = self.lines().into_iter().find(|l| l.contains(needle)) {
                    return line;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        match tokio::time::timeout(Duration::from_secs(10), found).await {
            Ok(line) => line,
            Err(_) => panic!(
                "no log line containing {needle:?}; the log was:\n{}",
                self.lines().join("\n")
            ),
        }
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

async fn server(
    configure: impl FnOnce(rpc_core::ServerBuilder) -> rpc_core::ServerBuilder,
) -> (TestServer, String) {
    transport_tcp::install();
    let server = TestServer::start("tcp://127.0.0.1:0", configure).await;
    let authority = server.address.strip_prefix("tcp://").unwrap().to_string();
    (server, authority)
}

fn level(line: &str) -> &str {
    line.split_whitespace().nth(1).unwrap_or("")
}

#[tokio::test]
async fn a_client_gone_mid_frame_is_a_disconnect_not_a_protocol_error() {
    let (captured, _guard) = Captured::install();
    let (_server, authority) = server(|b| b).await;
    let mut raw = TcpStream::connect(&authority).await.unwrap();
    // A frame announced as 100 bytes, 10 of them sent, then the socket closes.
    raw.write_all(&100u32.to_le_bytes()).await.unwrap();
    raw.write_all(&[0u8; 10]).await.unwrap();
    drop(raw);

    let line = captured
        .wait_for("client disconnected in the middle of a frame")
        .await;
    assert_eq!(level(&line), "DEBUG", "{line}");
    captured.wait_for("connection closed").await;
    let lines = captured.lines();
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("protocol error") || matches!(level(l), "WARN" | "ERROR")),
        "a disconnect is logged as a failure:\n{}",
        lines.join("\n")
    );
}

#[tokio::test]
async fn a_silent_client_is_described_as_silent() {
    let (captured, _guard) = Captured::install();
    let (_server, authority) =
        server(|b| b.keepalive(Duration::from_millis(100), Duration::from_millis(100))).await;
    let mut raw = TcpStream::connect(&authority).await.unwrap();
    // Half a frame, then silence: the client never answers the ping.
    raw.write_all(&100u32.to_le_bytes()).await.unwrap();

    let line = captured.wait_for("no complete frame from the client").await;
    assert!(line.contains("and no answer to a ping: closing"), "{line}");
    assert_eq!(level(&line), "INFO", "{line}");
    // The server did close: reading ends (after the ping and the GoAway).
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), raw.read_to_end(&mut rest))
        .await
        .expect("the server closed the silent connection")
        .unwrap();
}

#[tokio::test]
async fn a_malformed_frame_is_logged_once_with_one_prefix() {
    let (captured, _guard) = Captured::install();
    let (_server, authority) = server(|b| b).await;
    let mut raw = TcpStream::connect(&authority).await.unwrap();
    let garbage = b"not a frame at all, just bytes";
    raw.write_all(&(garbage.len() as u32).to_le_bytes())
        .await
        .unwrap();
    raw.write_all(garbage).await.unwrap();

    let line = captured
        .wait_for("closing connection: malformed frame")
        .await;
    assert_eq!(level(&line), "WARN", "{line}");
    captured.wait_for("connection closed").await;
    let lines = captured.lines();
    let warnings: Vec<_> = lines.iter().filter(|l| level(l) == "WARN").collect();
    assert_eq!(
        warnings.len(),
        1,
        "one warning per violation: {warnings:#?}"
    );
    for l in &lines {
        assert!(
            l.matches("protocol error").count() <= 1 && l.matches("malformed frame").count() <= 1,
            "a reason prefixed twice: {l}"
        );
    }
}
