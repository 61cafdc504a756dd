//! What the device tests share: the environment they run in.
#![allow(dead_code, unreachable_pub)]

use std::net::IpAddr;
use std::time::Duration;

/// Which side(s) of a two-host test this process plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Server and client in this process, over the one device.
    Both,
    /// The server of a two-host run.
    Server,
    /// The client of a two-host run.
    Client,
}

/// The device the tests were asked to use, from the environment.
pub struct TestEnv {
    /// `RDMA_TEST_DEVICE`.
    pub device: String,
    /// `RDMA_TEST_IP`: this side's address on the device.
    pub ip: IpAddr,
    /// `RDMA_TEST_ROLE`.
    pub role: Role,
    /// `RDMA_TEST_PEER_IP` (the server, for a client).
    pub peer: Option<IpAddr>,
}

impl TestEnv {
    /// Reads the variables; panics (fails the test) when they are missing.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let help = "run the device tests through `cargo xtask rxe -- <test binary> --ignored` (Soft-RoCE in a VM), \
                    or on a machine with an RDMA NIC set RDMA_TEST_DEVICE and RDMA_TEST_IP (an IPv4 address on it)";
        let device = var("RDMA_TEST_DEVICE")
            .unwrap_or_else(|| panic!("RDMA_TEST_DEVICE is not set: {help}"));
        let ip = var("RDMA_TEST_IP").unwrap_or_else(|| panic!("RDMA_TEST_IP is not set: {help}"));
        let ip: IpAddr = ip
            .parse()
            .unwrap_or_else(|e| panic!("RDMA_TEST_IP={ip:?} is not an IP address: {e}"));
        let role = match var("RDMA_TEST_ROLE").as_deref() {
            None | Some("both") => Role::Both,
            Some("server") => Role::Server,
            Some("client") => Role::Client,
            Some(other) => panic!("RDMA_TEST_ROLE={other:?}: expected both, server or client"),
        };
        let peer = var("RDMA_TEST_PEER_IP").map(|p| {
            p.parse()
                .unwrap_or_else(|e| panic!("RDMA_TEST_PEER_IP={p:?} is not an IP address: {e}"))
        });
        if role == Role::Client && peer.is_none() {
            panic!("RDMA_TEST_ROLE=client needs RDMA_TEST_PEER_IP (the server's address)");
        }
        Self {
            device,
            ip,
            role,
            peer,
        }
    }

    /// `rdma://IP:0` on this side's address: a listener picks its port.
    pub fn local_listen(&self) -> String {
        format!("rdma://{}:0", self.ip)
    }

    /// Listens with `transport` on this host's test address, on a free port;
    /// returns the listener and the authority (`IP:PORT`) to connect to.
    pub async fn listen_here(
        &self,
        transport: &transport_rdma::RdmaTransport,
        limits: rpc_core::transport::FrameLimits,
    ) -> (Box<dyn rpc_core::transport::Listener>, String) {
        use rpc_core::transport::Transport;
        let listener = transport
            .listen(&format!("{}:0", self.ip), limits)
            .await
            .expect("listens on the test address");
        let target = listener
            .local_addr()
            .strip_prefix("rdma://")
            .expect("an rdma:// address")
            .to_string();
        (listener, target)
    }

    /// Both ends of one connection over this host's device, made with
    /// `transport`: (the client's, the server's).
    pub async fn pair(
        &self,
        transport: &transport_rdma::RdmaTransport,
        limits: rpc_core::transport::FrameLimits,
    ) -> (
        rpc_core::transport::Connection,
        rpc_core::transport::Connection,
    ) {
        self.pair_between(transport, transport, limits).await
    }

    /// Both ends of one connection over this host's device, the client's
    /// made with `client`, the server's with `server`.
    pub async fn pair_between(
        &self,
        client: &transport_rdma::RdmaTransport,
        server: &transport_rdma::RdmaTransport,
        limits: rpc_core::transport::FrameLimits,
    ) -> (
        rpc_core::transport::Connection,
        rpc_core::transport::Connection,
    ) {
        use rpc_core::transport::Transport;
        let (mut listener, target) = self.listen_here(server, limits).await;
        // A set-up that fails on one side leaves the other waiting.
        let (client, server) = within(SET_UP_LIMIT, "connecting and accepting", async {
            tokio::join!(
                client.connect(&target, limits),
                std::future::poll_fn(|cx| listener.poll_accept(cx))
            )
        })
        .await;
        (client.expect("connects"), server.expect("accepts"))
    }

    /// The client of a two-host run: connects to `port` on the server
    /// guest, retrying while that guest's test has yet to listen (the
    /// guests run at their own pace); fails the test after [`PEER_PATIENCE`].
    pub async fn connect_to_peer(
        &self,
        transport: &transport_rdma::RdmaTransport,
        port: u16,
        limits: rpc_core::transport::FrameLimits,
    ) -> rpc_core::transport::Connection {
        use rpc_core::transport::Transport;
        let target = format!("{}:{port}", self.peer.expect("a client has a peer"));
        retrying(PEER_PATIENCE, &format!("connecting to {target}"), || {
            transport.connect(&target, limits)
        })
        .await
    }
}

/// Awaits `attempt()` again every [`PEER_RETRY`] while it fails, for up to
/// `patience`: a client whose server (in the other guest, or a child
/// process) may not listen yet. Then fails the test with `failing` and
/// the last error.
pub async fn retrying<T, E: std::fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
    patience: Duration,
    failing: &str,
    mut attempt: impl FnMut() -> F,
) -> T {
    let started = std::time::Instant::now();
    let mut said = false;
    loop {
        match attempt().await {
            Ok(done) => return done,
            Err(e) if started.elapsed() < patience => {
                if !std::mem::replace(&mut said, true) {
                    eprintln!("{e}: retrying every {PEER_RETRY:?} for up to {patience:?}");
                }
                tokio::time::sleep(PEER_RETRY).await;
            }
            Err(e) => panic!("{failing}: {e}"),
        }
    }
}

/// How long a two-host client retries while its server guest catches up.
pub const PEER_PATIENCE: Duration = Duration::from_secs(90);
/// Between a two-host client's attempts.
pub const PEER_RETRY: Duration = Duration::from_millis(100);

/// Longer than a connection's set-up takes at its own limits (10 s a step).
pub const SET_UP_LIMIT: Duration = Duration::from_secs(60);

/// Awaits `work`, or fails the test after `limit` with what it was doing
/// and the state of every RDMA connection: a transfer that stalls fails
/// with the protocol's counts instead of hanging the suite.
pub async fn within<T>(
    limit: Duration,
    doing: &str,
    work: impl std::future::Future<Output = T>,
) -> T {
    match tokio::time::timeout(limit, work).await {
        Ok(done) => done,
        Err(_) => panic!(
            "{doing}: not done within {limit:?}; every connection's state:\n{}",
            transport_rdma::debug_dump()
        ),
    }
}

/// Registered bytes of one connection end with the default settings on
/// both sides, once frames too large for a slot went both ways: receive
/// ring 64 x 8 KiB, send slots for the peer's ring plus 8 control and
/// chunk slots, the 1 MiB region and a 1 MiB staging region.
pub const PINNED_PER_END: u64 = pinned_per_end(64, 8192, 1 << 20);

/// [`PINNED_PER_END`] while only frames that go inline went (up to 256
/// bytes with their header), a few at a time: the receive ring's first 8
/// slots alone.
pub const IDLE_PER_END: u64 = pages(8 * 8192);

/// [`PINNED_PER_END`] once frames too long to go inline went, but none too
/// large for a slot, a few at a time: the ring's first slots and the first
/// part of the send slots (8 data, 4 control and 4 chunk slots).
pub const SMALL_FRAMES_PER_END: u64 = IDLE_PER_END + pages(16 * 8192);

/// What the default ring registers as it grows, by steps: as many slots
/// again each time the peer keeps half of those in use consumed (8 → 16
/// → 32 → 64 slots of 8 KiB). The send slots after the first 8 data slots
/// come in the same steps, each with the first frame too long to go
/// inline sent from it (that many frames at once).
pub const GROWN_PER_END: [u64; 4] = [
    0,
    pages(8 * 8192),
    pages(8 * 8192) + pages(16 * 8192),
    pages(8 * 8192) + pages(16 * 8192) + pages(32 * 8192),
];

/// `VmPin` of this process (memory pinned by verbs registrations), bytes.
pub fn pinned_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmPin:"))
        .expect("/proc/self/status has VmPin");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("unreadable {line:?}"));
    kib * 1024
}

/// Bytes one connection end registers when both sides use a ring of
/// `ring_slots` x `slot_size` and a region of `region_len`, once frames too
/// large for a slot went both ways: the receive ring, send slots for the
/// peer's ring plus 8 control and chunk slots, the region (the peer asked
/// for it) and a staging region as large as the peer's region (for its
/// own), each rounded up to whole pages (what registration pins; see
/// `transport_rdma::verbs::registered_bytes`).
pub const fn pinned_per_end(ring_slots: u64, slot_size: u64, region_len: u64) -> u64 {
    // The ring and the send slots in parts: the first 8 slots (for
    // sending, with 8 control and chunk slots), then doublings.
    let mut grown = 0;
    let mut slots = 8;
    while slots < ring_slots {
        let part = if 2 * slots < ring_slots {
            slots
        } else {
            ring_slots - slots
        };
        grown += pages(part * slot_size);
        slots += part;
    }
    let ring = pages(8 * slot_size) + grown;
    let send = pages(16 * slot_size) + grown;
    ring + send + 2 * pages(region_len)
}

const fn pages(bytes: u64) -> u64 {
    bytes.div_ceil(4096) * 4096
}

/// File descriptors open in this process now.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("read /proc/self/fd")
        .count()
}

/// Raises this process's open-file limit to at least `want` descriptors
/// (the soft limit up to the hard one; the hard one too where allowed, as
/// for root in the test guest); returns the soft limit now in force.
pub fn raise_fd_limit(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the call to fill.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    assert_eq!(rc, 0, "getrlimit: {}", std::io::Error::last_os_error());
    if lim.rlim_cur >= want {
        return lim.rlim_cur;
    }
    let raised = libc::rlimit {
        rlim_cur: want,
        rlim_max: lim.rlim_max.max(want),
    };
    // SAFETY: `raised` is a valid rlimit; the call only reads it.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        return want;
    }
    // Not allowed to raise the hard limit: take what it allows.
    let soft = libc::rlimit {
        rlim_cur: lim.rlim_max,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: as above.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &soft) };
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
    lim.rlim_max
}

/// `MemAvailable` of the machine (`/proc/meminfo`), bytes.
pub fn mem_available() -> u64 {
    proc_kib("/proc/meminfo", "MemAvailable:") * 1024
}

/// The value of the `field:` line (in kB) of a `/proc` file such as
/// `/proc/meminfo` or `/proc/self/status`, in KiB.
pub fn proc_kib(file: &str, field: &str) -> u64 {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("read {file}: {e}"));
    let line = text
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("{file} has no {field}"));
    line.split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("unreadable {line:?}"))
}

/// A child process, killed and reaped when dropped: also when its test
/// fails, so a failed test never leaves a process holding the device open
/// (deleting a Soft-RoCE device, as `link_down` does, waits for every
/// process that has it open).
pub struct ChildGuard(pub std::process::Child);

impl ChildGuard {
    /// Kills the child (if it still runs) and waits for it to end.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The shared cases' load and payload sizes over `rdma://`: fewer
/// concurrent calls than on TCP (the emulated device is slow), and
/// payloads swept one byte below, at and above the inline limit (an 8 KiB
/// slot less its 32-byte header), one region chunk (512 KiB) and the whole
/// region (1 MiB); a frame adds its head and header fields, hence the range.
pub fn rdma_profile() -> rpc_test_support::cases::Profile {
    let mut payload_sizes = vec![0usize, 1, 4095, 4096, 4097, 65_535, 65_536, 65_537];
    for limit in [8160usize, 512 << 10, 1 << 20] {
        payload_sizes.extend(limit - 80..limit + 8);
    }
    payload_sizes.extend([4 << 20, 16 << 20, (64 << 20) - 64]);
    rpc_test_support::cases::Profile {
        concurrent_calls: 3_000,
        payload_sizes,
    }
}

/// The send queue depth, as the device reports it, of the client's end
/// (`client_end`) or the server's end of the one connection to
/// `server_address` in `dump` ([`transport_rdma::debug_dump`]): each end's
/// line starts with its peer's address and ends with `send queue N`.
pub fn send_queue_depth(dump: &str, server_address: &str, client_end: bool) -> u32 {
    let line = dump
        .lines()
        .find(|l| l.starts_with(server_address) == client_end)
        .unwrap_or_else(|| panic!("both ends in the dump: {dump}"));
    let depth = line.rsplit("send queue ").next().unwrap_or_default();
    depth.parse().unwrap_or_else(|e| panic!("{e}: {line}"))
}
