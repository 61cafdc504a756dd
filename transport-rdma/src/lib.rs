//! RDMA transport for rdma-rpc: `rdma://IP:PORT`, on libibverbs and
//! librdmacm (through `rdma-sys`), over reliable-connected queue pairs.
//!
//! # Quick start
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! transport_rdma::install();
//! let channel = rpc_core::Channel::connect("rdma://10.77.0.1:50051").await?;
//! # drop(channel);
//! # Ok(()) }
//! ```
//!
//! A server listens the same way, on an address of the RDMA device's
//! network interface: `ServerBuilder::new(...).serve("rdma://10.77.0.1:50051")`
//! (IPv6: `rdma://[fd77::1]:50051`).
//! To change the defaults, register a configured transport instead; for
//! example, for MB-sized tensors and the lowest small-call latency (a
//! larger region moves more of a big frame at once; busy polling spins a
//! core per connection instead of sleeping until the completion event):
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use transport_rdma::RdmaTransport;
//!
//! rpc_core::transport::register(Arc::new(
//!     RdmaTransport::default()
//!         .ring(128, 16 * 1024)
//!         .region_len(4 << 20)
//!         .busy_poll(Some(Duration::from_micros(100))),
//! ));
//! ```
//!
//! Code that speaks TCP today runs over RDMA unchanged with
//! [`RdmaStream`] and [`RdmaListener`]: a tokio `AsyncRead + AsyncWrite`
//! byte stream over the same rings, credits and region (tonic, hyper and
//! `tokio::io::copy` included; see the [`stream`] module).
//!
//! # Features
//! - **Set-up** with librdmacm: `rdma_resolve_addr/route`, `rdma_connect`,
//!   `rdma_listen`/`rdma_accept`. The peers exchange a 32-byte hello in the
//!   connection manager's private data (magic, protocol version, ring slots
//!   and slot size, region length), each side validating
//!   the other's against its limits ([`proto::Hello`]). Set-ups are
//!   async: the connection manager's events are awaited on the tokio
//!   runtime (each set-up's event channel registered with it), so no
//!   thread waits for a peer, however many set-ups are under way. Once
//!   established, a connection's id moves to the event channel its
//!   device's watcher reads, so an open connection holds one descriptor
//!   (its completion channel).
//! - **One protection domain per device**, shared by its connections
//!   ([`RdmaTransport::shared_protection_domain`]). Memory the peer
//!   accesses is registered for local access and memory-window binding
//!   only, and reached through a type 2 memory window bound to the
//!   connection's own queue pair (the region for writes, rendezvous
//!   frames for reads), so a key one peer was told is worthless on every
//!   other connection of the domain; the window is deallocated when the
//!   access ends. A device that allocates no memory windows gets a domain
//!   per connection, whose registrations grant the peer's access
//!   themselves.
//! - **Small frames** (up to [`RdmaTransport::inline_threshold`], at most a
//!   slot minus the 32-byte header) travel by SEND into a ring of receive
//!   slots the peer keeps posted. A sender needs a credit per message;
//!   credits come back in every message's header, or in a `Credit` message
//!   when the peer runs low ([`proto::RecvRing::wants_credit_message`]);
//!   the last credit is kept for those, so the peers never deadlock, never
//!   cause an RNR, never overrun a ring.
//! - **Large frames** are encoded into a registered staging region and
//!   RDMA-written into the peer's region, at offsets
//!   from a ring allocator both sides run in lock-step
//!   ([`proto::RegionWriter`], [`proto::RegionReader`]); a `Chunk` SEND
//!   follows each WRITE, which goes unsignaled (the SEND's completion
//!   covers both: one completion per large frame or chunk, not two).
//!   Frames larger than half the region go in chunks of at most 64 KiB,
//!   each copied into staging from the frame's pieces (its large `Bytes`
//!   where the application left them: the tensor is copied once), four at
//!   most in flight; small frames of
//!   other calls pass such a frame between its chunks, so they wait behind
//!   at most 256 KiB of it in the send queue, not behind the whole tensor,
//!   and once one passed the chunks go one in flight while small frames
//!   keep coming (until 16 chunks went with none): each then waits behind
//!   at most one 64 KiB chunk, for some of the tensor's throughput.
//!   The receiver reports how far it has freed its region in every header.
//!   Neither exists until needed: the first frame too large for a slot
//!   asks for the peer's region (`RegionWanted`), which the peer registers
//!   then and grants with its address and rkey (`RegionGranted`); that
//!   frame waits one round trip and a registration, and staging is
//!   registered with it. A connection whose frames all fit a slot has no
//!   remotely writable memory at all, and one whose region frames stopped
//!   has none once the sender gives the region back
//!   ([`RdmaTransport::release_idle_memory`]).
//! - **Larger frames by rendezvous** (from
//!   [`RdmaTransport::rendezvous_threshold`], off by default for now): the
//!   sender registers the frame for that transfer only, readable by the
//!   peer and nothing else: each [`bytes::Bytes`] of at least
//!   [`REGISTER_IN_PLACE_MIN`] in it (a tensor field, a `Bytes` payload)
//!   where the application left it. It announces them (address, rkey,
//!   length of each) in a small SEND that carries the frame's head and
//!   small fields itself; the receiver copies the head and RDMA READs them
//!   into a destination from its pool ([`RdmaTransport::rendezvous_pool`],
//!   one the transport's connections share, never remotely writable), tells the sender `Done` (which deregisters
//!   them: the peer's access ends there) and hands the frame up as `Bytes`
//!   over the destination, with no copy of the payload on either side
//!   ([`rendezvous_bytes_sent`] counts what was copied). A destination the
//!   application drops stays registered for the next frame of its size
//!   while the pool's budget allows (fresh memory costs more to register
//!   than a copy of it). Several transfers run at once per connection,
//!   frames of other calls keep flowing while one is read (while they
//!   arrive, the receiver keeps one READ in flight, not 16, so that they
//!   do not queue behind READ responses on the sender's link), and a full
//!   pool makes transfers wait, first come first served across the
//!   connections.
//! - **Payload buffers** ([`rpc_core::Channel::payload_buffer`]): on a
//!   connection that sends by rendezvous, a buffer of at least the
//!   threshold comes from the connection's pool
//!   ([`RdmaTransport::payload_pool`]), registered once for local access
//!   and memory-window binding only. The application writes its tensor
//!   into it and freezes it into `Bytes`; a frame holding them is
//!   announced through a type 2 memory window bound over just those bytes
//!   on this connection's queue pair (the bind goes on the send queue
//!   ahead of the announcement, so the window is valid when the peer
//!   reads), and the window is deallocated at the transfer's end: the
//!   device refuses the peer any access outside that window and that
//!   time (Soft-RoCE checks a window's reads against its buffer's whole
//!   registration, one buffer, rather than the window:
//!   `tests/bad_peer.rs`), and the pool's memory is never remotely
//!   writable. No copy and
//!   no registration per call; a buffer whose last `Bytes` drops goes back
//!   to the pool for the next one of its size; a full pool makes the next
//!   buffer wait ([`rendezvous_bytes_sent_from_pool`] counts what went so).
//!   A device that allocates no memory windows gets payload buffers
//!   registered per transfer instead, as any `Bytes` (logged once).
//! - **Zero copy**: `poll_send` encodes each frame straight into registered
//!   memory (frames above half the peer's region are copied chunk by chunk
//!   from their pieces; by rendezvous a payload is not copied at all).
//!   Small received frames go up as
//!   [`bytes::Bytes`] pointing into their receive slot, reposted when the
//!   last reference drops; once the application holds half the ring, frames
//!   are copied out instead, so holding frames never stalls the connection.
//!   Region frames are copied out once, as they are read: the region is
//!   freed in order, so a held frame would block all later ones. A frame
//!   over 32 MiB is copied into the buffer of an earlier one the
//!   application dropped when one is free ([`RdmaTransport::kept_buffers`]),
//!   whose pages are mapped already.
//! - **Completions** arrive on a completion channel registered with tokio
//!   (`AsyncFd`) and are drained from the CQ in batches of 32, by the
//!   connection's driver task or by the receiver itself when it looks for
//!   its next frame. With a busy-poll window ([`RdmaTransport::busy_poll`],
//!   off by default) the receiver keeps polling instead of sleeping.
//! - **Failure**: a failed work request, a connection-manager event that
//!   ends the connection (the peer died or disconnected, device removal),
//!   a device async event (`ibv_get_async_event`) or a protocol violation
//!   fails the connection at once: both halves return errors, so rpc-core
//!   fails its calls with `Unavailable`, with a message naming the cause
//!   (e.g. `rxe0 port 1: IBV_EVENT_PORT_ERR (port went down)`). One
//!   watcher per device, running while connections on it exist, reads the
//!   async events: a QP error (`QP_FATAL`, `QP_REQ_ERR`, `QP_ACCESS_ERR`,
//!   `PATH_MIG_ERR`) fails the connection owning the QP, `CQ_ERR` the one
//!   owning the CQ, `PORT_ERR` every connection on the port and
//!   `DEVICE_FATAL` every connection on the device; the others are only
//!   logged. A peer whose link is cut (this side's port stays up) is
//!   noticed by rpc-core's keepalive on an idle connection, by RC retry
//!   exhaustion on one with sends outstanding. Every header field, chunk
//!   position and length from the peer is checked before use ([`proto`]).
//!
//! # Memory per connection
//! 8 receive slots at first, `ring_slots × slot_size` once the peer keeps
//! half of those consumed (many calls in flight, a stream); as much for
//! sending (the peer's ring, within this side's own) once this side sends
//! a frame too long to go inline (256 bytes with its header); the
//! connection's region length (the smaller of the two sides'
//! `region_len`) for the region once the peer first sends a frame too
//! large for a slot, and as much for staging once this side does. So a
//! peer's geometry never costs more than this side's own settings would.
//! All but the ring until
//! the sending side found them unused for
//! [`RdmaTransport::release_idle_memory`] (30 s).
//! Defaults: 64 × 8 KiB and
//! 1 MiB, so 64 KiB per connection end whose calls go one at a time and
//! inline, 512 KiB once many ran at once, 1.1 MiB once they needed slots,
//! up to 3.1 MiB once large ones went both ways (a listener's budget counts
//! 3.1 MiB each). Only the region is remotely
//! writable. Rendezvous memory
//! comes on top, while transfers run, and only on connections whose sides
//! both set [`RdmaTransport::rendezvous_threshold`]: on the receiving side
//! at most [`RdmaTransport::rendezvous_pool`] for all of the transport's
//! connections together (1 GiB by default, at least the frame limit; a
//! listener counts it once in [`RdmaTransport::max_pinned_bytes`];
//! destinations kept for reuse count in it too), on the sending side the frames of up to 8 transfers in
//! flight, their large `Bytes` pinned where they lie (not counted: the
//! application chose to send them), and the payload buffers it asked for
//! (at most [`RdmaTransport::payload_pool`], 128 MiB by default, not
//! counted by a listener's budget either). Peers announcing more than
//! [`RdmaTransport::max_peer`] allows are refused.
//!
//! A listener admits a client only within its limits, checked from the
//! client's hello before anything is allocated for it: connections
//! ([`RdmaTransport::max_connections`]), set-ups at once
//! ([`RdmaTransport::max_handshakes`]) and the memory its connections pin
//! ([`RdmaTransport::max_pinned_bytes`], 4 GiB by default). A refused
//! client's connect fails with `ConnectionRefused` saying which limit
//! ([`proto::Refused`], in the rejection's private data); the listener
//! serves the others. A closed connection gives its share back once its
//! memory is freed.
//!
//! # Authentication
//! RDMA has no TLS. A listener can admit only clients that prove a shared
//! secret ([`RdmaTransport::auth_secret`], on both sides) and only from
//! allowed addresses ([`RdmaTransport::allow_peers`]); both are checked
//! before anything is allocated for a client, and a refused client's
//! connect fails with `PermissionDenied` saying why:
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use transport_rdma::{RdmaTransport, SharedSecret};
//!
//! let secret = SharedSecret::from_file("/etc/my-service/rdma.secret")?;
//! let transport = RdmaTransport::default()
//!     .auth_secret(Some(secret))
//!     .allow_peers(["10.0.0.0/16".parse()?]);
//! rpc_core::transport::register(std::sync::Arc::new(transport));
//! # Ok(()) }
//! ```
//!
//! The proof is an HMAC challenge–response in the connection manager's
//! private data: the listener answers a first connect request with a
//! challenge (keeping no state for it), the client connects again with
//! the proof, and the listener's accept proves the secret back; each
//! challenge admits one connection, so a recorded exchange cannot be
//! replayed. It keeps clients without the secret from getting a connection
//! (no handler of theirs runs), and clients from talking to an endpoint
//! without it. It does not encrypt or sign what connections carry: an
//! attacker who can rewrite packets on the fabric can read and change
//! them, and an address on the allow-list can be spoofed on a network
//! that does not prevent it. See [`proto::auth`].
//!
//! # Thread safety
//! The sink is shared by every task sending on the connection (a mutex
//! guards the protocol state and the queue pair); each connection has one
//! driver task on the tokio runtime.
//!
//! # Resource cleanup
//! Dropping both halves of a connection sends `Close` once everything
//! queued is sent, then disconnects; the queue pair and memory are freed
//! when the last received frame pointing into them is dropped.
//!
//! # Testing
//! The protocol core ([`proto`]) is tested on any machine, including a
//! randomized two-endpoint simulation. The device tests (`tests/*.rs`)
//! need an RDMA device: they are `#[ignore]`d on a plain `cargo test` and
//! run in a Soft-RoCE guest by `cargo xtask test` (or by hand:
//! `cargo xtask rxe -- <test binary> --ignored --test-threads=1`).

mod admission;
mod conn;
mod device_events;
pub mod proto;
mod registry;
mod stats;
pub mod stream;
mod teardown;
pub mod verbs;

pub use admission::IpPrefix;
pub use conn::{rendezvous_bytes_sent, rendezvous_bytes_sent_from_pool, REGISTER_IN_PLACE_MIN};
pub use proto::auth::{SecretError, SharedSecret};
pub use stream::{RdmaListener, RdmaReadHalf, RdmaStream, RdmaWriteHalf};

use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rpc_core::kept::{KeptBuffers, DEFAULT_KEPT};
use rpc_core::transport::{
    self, BoxFuture, Connection, FrameLimits, Listener, RefusalLog, Transport, TransportError,
};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::admission::{Admission, AdmissionLimits, Handshake, Lease};
use crate::proto::auth::{self, Gate, Proven};
use crate::proto::{Hello, HelloLimits, Refused, HEADER_LEN};
use crate::verbs::{CmId, EventChannel};

/// A one-line summary of each live connection's protocol state (credits,
/// queues, ring and region accounting), for diagnosing stalls.
#[doc(hidden)]
pub fn debug_dump() -> String {
    registry::debug_dump()
}

/// The [`RdmaTransport::rendezvous_threshold`] measured best on one host
/// (see there); not the default yet: between two Soft-RoCE guests READs
/// stalled (issue 10).
pub const MEASURED_RENDEZVOUS_THRESHOLD: usize = 128 << 10;

/// The default [`RdmaTransport::rendezvous_pool`], 1 GiB: what an
/// application may hold at once of the frames its connections read by
/// rendezvous (a parameter-server worker with 4 workers pulling two
/// 64 MiB tensors each before it checks any holds 512 MiB). Registered
/// only as transfers need it; a listener counts it once.
pub const DEFAULT_RENDEZVOUS_POOL: u64 = 1 << 30;
/// Bytes per RDMA READ of a rendezvous. Between two Soft-RoCE guests,
/// READs of 256 KiB and more crawl (perftest `ib_read_bw`: 1.2-2.2 MB/s at
/// any depth, against 15-17 MB/s at 64 KiB and 16-20 MB/s for
/// `ib_write_bw`), and 1 MiB tensors by rendezvous with 256 KiB READs did
/// not move 25 MB in 36 s; with 64 KiB READs they move at 2-7 MB/s (still
/// a fifth of the same tensors through the region, 7-21 MB/s: rendezvous
/// stays off by default).
const RENDEZVOUS_READ_CHUNK: usize = 64 << 10;
/// Receive slots a connection posts at first (64 KiB at the default 8 KiB
/// slot): enough for calls one at a time and a few in flight. The ring
/// doubles (registered, posted, and given to the peer as credits: one
/// round trip) each time the peer keeps half of its slots in use consumed,
/// up to [`RdmaTransport::ring`]'s slots.
const INITIAL_RING_SLOTS: u32 = 8;
/// RDMA READs in flight per connection (the connection manager's
/// initiator depth is as deep).
const RENDEZVOUS_READ_DEPTH: u32 = verbs::READ_DEPTH;
/// Rendezvous transfers a connection sends at once.
const RENDEZVOUS_MAX_OUTGOING: u32 = 8;

/// Whether `ptr` points into a live rendezvous destination of this
/// process's pool (for tests proving a received frame was not copied).
#[doc(hidden)]
pub fn rendezvous_pool_contains(ptr: *const u8) -> bool {
    conn::pool_contains(ptr)
}

/// Makes `rdma://` addresses work in this process, with default settings.
pub fn install() {
    transport::register(Arc::new(RdmaTransport::default()));
}

/// The RDMA transport and its per-connection settings. Install it with
/// [`install`], or register a configured one with
/// [`rpc_core::transport::register`].
#[derive(Debug, Clone)]
pub struct RdmaTransport {
    ring_slots: u32,
    slot_size: u32,
    region_len: u32,
    inline_threshold: usize,
    max_peer_ring_slots: u32,
    max_peer_slot_size: u32,
    max_peer_region_len: u32,
    connect_timeout: Duration,
    busy_poll: Option<Duration>,
    rendezvous_threshold: Option<usize>,
    rendezvous_pool: Arc<conn::RendezvousPool>,
    payload_pool: u64,
    stream_keepalive: Option<Duration>,
    release_idle_memory: Option<Duration>,
    admission: AdmissionLimits,
    ack_timeout: Option<u8>,
    type_of_service: Option<u8>,
    source_address: Option<std::net::IpAddr>,
    auth_secret: Option<SharedSecret>,
    allowed_peers: Option<Arc<[IpPrefix]>>,
    kept: Arc<KeptBuffers>,
    shared_protection_domain: bool,
}

impl Default for RdmaTransport {
    fn default() -> RdmaTransport {
        RdmaTransport {
            ring_slots: 64,
            slot_size: 8192,
            region_len: 1 << 20,
            inline_threshold: usize::MAX,
            max_peer_ring_slots: 256,
            max_peer_slot_size: 64 * 1024,
            max_peer_region_len: 16 << 20,
            connect_timeout: Duration::from_secs(10),
            busy_poll: None,
            rendezvous_threshold: None,
            rendezvous_pool: Arc::new(conn::RendezvousPool::new(DEFAULT_RENDEZVOUS_POOL)),
            payload_pool: 128 << 20,
            stream_keepalive: Some(Duration::from_secs(10)),
            release_idle_memory: Some(Duration::from_secs(30)),
            admission: AdmissionLimits {
                max_connections: 4096,
                max_handshakes: 64,
                max_pinned: 4 << 30,
            },
            ack_timeout: None,
            type_of_service: None,
            source_address: None,
            auth_secret: None,
            allowed_peers: None,
            kept: Arc::new(KeptBuffers::new(DEFAULT_KEPT)),
            shared_protection_domain: true,
        }
    }
}

impl RdmaTransport {
    /// Receive ring: `slots` slots (8..=4096, default 64) of `slot_size`
    /// bytes (header included; 96..=64 KiB, default 8 KiB). Panics outside
    /// those bounds. The first 8 are registered and posted at set-up, and
    /// doubled (up to `slots`) each time the peer keeps half of those in
    /// use consumed. Either side also keeps at most `slots` frames in
    /// flight into its peer's ring, however large: its send slots and
    /// send queue are sized by its own ring (a client makes its queue
    /// before it learns the server's ring).
    pub fn ring(mut self, slots: u32, slot_size: u32) -> RdmaTransport {
        assert!((8..=4096).contains(&slots), "ring slots: 8..=4096");
        assert!(
            (HEADER_LEN as u32 + 64..=64 * 1024).contains(&slot_size),
            "slot size: 96..=65536"
        );
        self.ring_slots = slots;
        self.slot_size = slot_size;
        self
    }

    /// The region the peer RDMA-writes large frames into (4 KiB..=1 GiB,
    /// default 1 MiB), registered when the peer first has one, and the
    /// staging this side writes the peer's region from: a connection's
    /// regions are the smaller of its two sides' settings, so set both
    /// sides to use a larger one. Frames over half of it go in chunks.
    pub fn region_len(mut self, bytes: u32) -> RdmaTransport {
        assert!((4096..=1 << 30).contains(&bytes), "region: 4 KiB..=1 GiB");
        self.region_len = bytes;
        self
    }

    /// Frames up to this many bytes go inline by SEND, larger ones by RDMA
    /// WRITE (default and maximum: the peer's slot size minus the header).
    ///
    /// The default is measured: `tests/perf.rs` echoes frames of 256 B to
    /// 8000 B both ways on the device, and on Soft-RoCE the inline path
    /// was faster at every size (busy-polling medians 64-291 us inline
    /// against 350-664 us through the region: a WRITE, a SEND and a copy
    /// out cost more than one larger SEND). So a frame goes inline whenever
    /// it fits a slot; raise the slot size ([`ring`](Self::ring)) to move
    /// the threshold up.
    pub fn inline_threshold(mut self, bytes: usize) -> RdmaTransport {
        self.inline_threshold = bytes;
        self
    }

    /// Largest ring (slots, slot size) and region a peer may announce
    /// (default 256 slots, 64 KiB, 16 MiB); a peer announcing more is
    /// refused. What it announces within them costs nothing past this
    /// side's own settings: send slots as many and as large as its ring's
    /// within this side's own, regions the smaller of the two sides'.
    pub fn max_peer(mut self, ring_slots: u32, slot_size: u32, region_len: u32) -> RdmaTransport {
        self.max_peer_ring_slots = ring_slots.max(8);
        self.max_peer_slot_size = slot_size;
        self.max_peer_region_len = region_len;
        self
    }

    /// Most connections a listener holds at once (default 4,096); a
    /// client beyond it is refused, and told why.
    pub fn max_connections(mut self, connections: usize) -> RdmaTransport {
        self.admission.max_connections = connections;
        self
    }

    /// Most connection set-ups a listener runs at once (default 64): a
    /// storm of connect requests is refused (told to try again) rather
    /// than queued. A set-up is a task on the runtime, holding no thread
    /// while it waits for the client (at most
    /// [`connect_timeout`](Self::connect_timeout) a step), but it holds
    /// the connection's memory meanwhile: this bounds that.
    pub fn max_handshakes(mut self, handshakes: usize) -> RdmaTransport {
        self.admission.max_handshakes = handshakes.max(1);
        self
    }

    /// Most memory a listener's connections pin (registered memory) at
    /// once, in bytes (default 4 GiB). Each connection's share is known
    /// from the client's hello before anything is allocated (this side's
    /// ring and region, send slots and staging sized by the client's, and
    /// the rendezvous pool when this side reads rendezvous transfers): a
    /// client whose connection does not fit is refused, and told why.
    pub fn max_pinned_bytes(mut self, bytes: u64) -> RdmaTransport {
        self.admission.max_pinned = bytes;
        self
    }

    /// The queue pairs' ACK timeout, 4.096 µs × 2^`exponent` per retry
    /// (0..=31; default: the connection manager's, 19 (~2 s) on Soft-RoCE):
    /// with the retry count of 7, how long a send to a peer that stopped
    /// answering takes to fail.
    pub fn ack_timeout(mut self, exponent: Option<u8>) -> RdmaTransport {
        self.ack_timeout = exponent.map(|e| e.min(31));
        self
    }

    /// Whether connections share one protection domain per device
    /// (default `true`) rather than allocate one each: a kernel object
    /// less per connection, and memory registered once can serve them all.
    /// The peer of a connection then reaches its memory only through type
    /// 2 memory windows bound to that connection's queue pair (its region
    /// for writes, its rendezvous frames for reads), never through a
    /// registration's rkey, which any queue pair of the domain could use;
    /// a window is deallocated when the access ends. A device that
    /// allocates no memory windows gets a domain per connection anyway
    /// (logged once).
    pub fn shared_protection_domain(mut self, shared: bool) -> RdmaTransport {
        self.shared_protection_domain = shared;
        self
    }

    /// The type of service (IP ToS, RoCE traffic class) of connections
    /// made and accepted (default: the system's), to put RPC traffic in
    /// its own class on a fabric with QoS.
    pub fn type_of_service(mut self, tos: Option<u8>) -> RdmaTransport {
        self.type_of_service = tos;
        self
    }

    /// The local address connections are made from (default: the
    /// system's choice for the destination). On a host with several RDMA
    /// NICs (rails), the address of one picks its device and port.
    pub fn source_address(mut self, ip: Option<std::net::IpAddr>) -> RdmaTransport {
        self.source_address = ip;
        self
    }

    /// The secret clients and servers prove to each other when they
    /// connect (default: none). A listener with a secret admits only
    /// clients that prove the same one; a client with a secret connects
    /// only to servers that prove it. See [Authentication](crate#authentication).
    pub fn auth_secret(mut self, secret: Option<SharedSecret>) -> RdmaTransport {
        self.auth_secret = secret;
        self
    }

    /// The client addresses a listener admits (default: any); others are
    /// refused before anything is allocated for them. With
    /// [`auth_secret`](RdmaTransport::auth_secret) too, a client must pass
    /// both.
    pub fn allow_peers(mut self, peers: impl IntoIterator<Item = IpPrefix>) -> RdmaTransport {
        self.allowed_peers = Some(peers.into_iter().collect());
        self
    }

    /// Limit of each connection set-up step (default 10 s): address and
    /// route resolution, the server's answer, the client's confirmation.
    pub fn connect_timeout(mut self, timeout: Duration) -> RdmaTransport {
        self.connect_timeout = timeout;
        self
    }

    /// Busy polling (default: off): a receiver that finds no frame keeps
    /// polling the completion queue, until `window` has passed since its
    /// last frame; only then does it sleep until the completion channel's
    /// event. It spins inside its poll for up to 50 µs at a time and
    /// yields to the runtime's other tasks in between. Saves the event's
    /// wake-up on every message (on Soft-RoCE in a VM, the difference
    /// between `ib_send_lat -e` and `ib_send_lat`: about 10x), at the cost
    /// of a core spinning per busy connection. Make the window longer than
    /// the round trips it should catch (a reply that comes after it waits
    /// for the event after all): tens of microseconds on a NIC, a
    /// millisecond on Soft-RoCE in an emulated VM.
    ///
    /// Leave the spinning threads cores of their own: in a 2-vCPU guest,
    /// client and server each on tokio's default runtime (a worker per
    /// core, so four threads) had a 32 B p99 of 2-3 ms, against 0.6-0.8 ms
    /// with one worker each (`TOKIO_WORKER_THREADS=1`); p50 150 µs both.
    pub fn busy_poll(mut self, window: Option<Duration>) -> RdmaTransport {
        self.busy_poll = window;
        self
    }

    /// Memory a connection registers for its larger frames is let go once
    /// no frame used it for between `after` and twice that (default 30 s;
    /// `None`: kept while the connection lives), and registered again by
    /// the next frame that needs it:
    /// - the memory region-sized frames go through, staging (registered
    ///   here, copied into and RDMA-written from) and the peer's region
    ///   (registered by the peer, written into), 1 MiB each by default:
    ///   staging is deregistered, and the region given back
    ///   (`RegionReturned`, after the last WRITE into it; the peer
    ///   deregisters it). Registering both again takes a round trip, and
    ///   a millisecond or so a MiB on each side. The setting is the
    ///   writing side's: a peer's setting decides when our region goes
    ///   back.
    /// - the send slots (128 KiB by default, more if many frames were in
    ///   flight at once), registered for the first SEND too long to go
    ///   inline: deregistered once none is in flight.
    /// - the receive ring's slots past its first 8 (64 KiB by default),
    ///   registered in doublings (up to 448 KiB more) while the peer
    ///   keeps many messages in flight: once the peer never had half of
    ///   the first slots' worth at once for a period, the others are
    ///   retired as their messages are handled and deregistered (the peer
    ///   answers `RingShrinks` with as many `Credit` messages as it has
    ///   receives posted, so an idle peer consumes them too). This
    ///   setting is the receiving side's.
    ///
    /// So a connection that carried a tensor or many calls at once and
    /// then only a few calls at a time, or nothing, keeps pinned only its
    /// receive ring's first slots.
    pub fn release_idle_memory(mut self, after: Option<Duration>) -> RdmaTransport {
        self.release_idle_memory = after;
        self
    }

    /// Frames of at least this many bytes are sent by rendezvous (default
    /// `None`: never; [`MEASURED_RENDEZVOUS_THRESHOLD`], 128 KiB, is the
    /// measured crossover): the sender registers the encoded frame for
    /// remote read for this transfer only and announces it in a small
    /// SEND; the receiver RDMA READs it into a destination from its pool
    /// and hands it up there, with no copy on either side; the frames of
    /// other calls keep flowing meanwhile, several transfers in flight.
    /// Below it, frames go inline or through the region (copied out once
    /// on the receiving side). At least 4 KiB. Byte streams
    /// ([`RdmaStream`]) never use it.
    ///
    /// Set it on both sides: a side with a threshold says in its hello
    /// that it reads rendezvous transfers, and frames go by rendezvous only
    /// to a peer that said so; a side without one refuses announcements
    /// (the connection fails), so no peer can make it register memory. A
    /// listener counts the [`rendezvous_pool`](Self::rendezvous_pool), which
    /// its connections share, once in
    /// [`max_pinned_bytes`](Self::max_pinned_bytes).
    ///
    /// Not on by default: between two Soft-RoCE guests (`cargo xtask
    /// rxe --hosts 2`) large READs crawl — raw verbs too: `ib_read_bw -s
    /// 1048576 -n 64` across the two guests did 1.7 MB/s where
    /// `ib_write_bw` did 18.7 MB/s, and 4 MiB READs did not finish 64
    /// iterations in 120 s (64 KiB READs: 10.0 MB/s, writes 5.2 MB/s);
    /// a 3 MiB echo by rendezvous stalled there the same way. The threshold is
    /// measured (`tests/rendezvous.rs`,
    /// `measure_push_throughput`: one-way pushes of 64 KiB to 64 MiB
    /// frames with the rendezvous off and on, release build, Soft-RoCE in
    /// a TCG guest, three runs): the region won at 64 KiB (67 vs 64, 40 vs
    /// 36, 40 vs 39 MB/s), the two were even at 96 KiB, and the rendezvous
    /// won from 128 KiB on (72 vs 60, 50 vs 38, 49 vs 32 MB/s; 1.2-1.6x
    /// from 1 MiB up).
    pub fn rendezvous_threshold(mut self, bytes: Option<usize>) -> RdmaTransport {
        self.rendezvous_threshold = bytes.map(|b| b.max(4096));
        self
    }

    /// Most bytes of rendezvous destinations, read and not yet dropped by
    /// the application, across all of this transport's connections (and
    /// its clones'; default [`DEFAULT_RENDEZVOUS_POOL`], 1 GiB, raised to
    /// the frame limit so any frame fits on its own): registered as transfers need them (local write
    /// only, never remotely writable) and kept registered for a later
    /// frame of their size once the last `Bytes` of theirs drops, while
    /// the budget allows. When full, announced transfers wait for room
    /// (back pressure) first come first served, across the connections:
    /// a transfer that does not fit holds up those announced after it, so
    /// none starves. An application that keeps the frames it received
    /// while it waits for more needs a pool that holds them all: else its
    /// calls wait until their deadlines (a warning says so). A listener
    /// counts the pool once in [`max_pinned_bytes`](Self::max_pinned_bytes).
    pub fn rendezvous_pool(mut self, bytes: u64) -> RdmaTransport {
        self.rendezvous_pool = Arc::new(conn::RendezvousPool::new(bytes.max(4096)));
        self
    }

    /// Bytes of buffers that frames over 32 MiB were put back
    /// together in from region chunks, kept once the application drops
    /// them so the next such frame is collected in memory already mapped
    /// (default [`DEFAULT_KEPT`], 256 MiB; 0 keeps none), across all of
    /// this transport's connections. A kept buffer is reused for a frame
    /// of half its size up to its size, once every view of its last frame
    /// is dropped; past the limit the oldest are forgotten. Rendezvous
    /// frames have their own pool ([`rendezvous_pool`](Self::rendezvous_pool)).
    pub fn kept_buffers(mut self, bytes: usize) -> RdmaTransport {
        self.kept = Arc::new(KeptBuffers::new(bytes));
        self
    }

    /// Most bytes of a connection's payload buffers
    /// ([`Channel::payload_buffer`](rpc_core::Channel::payload_buffer)),
    /// handed out or kept for reuse (default 128 MiB): registered when
    /// first handed out (local access and memory-window binding only: the
    /// peer reads a buffer only through a window bound for one transfer,
    /// deallocated when the peer is done), given back when the last
    /// `Bytes` of one drops, and kept registered for a later buffer of the
    /// same size while the budget allows. When full, asking for a buffer
    /// waits until one is given back. Only connections that send by
    /// rendezvous ([`rendezvous_threshold`](Self::rendezvous_threshold),
    /// set on both sides) hand out pool buffers, and only of at least the
    /// threshold; others hand out heap memory.
    pub fn payload_pool(mut self, bytes: u64) -> RdmaTransport {
        self.payload_pool = bytes.max(4096);
        self
    }

    /// Whether this side reads its peers' rendezvous transfers (into a
    /// pool it counts in its pinned budget): when it sends by rendezvous
    /// itself.
    pub(crate) fn reads_rendezvous(&self) -> bool {
        self.rendezvous_threshold.is_some()
    }

    /// This side's hello: its geometry.
    pub(crate) fn hello(&self) -> Hello {
        Hello {
            ring_slots: self.ring_slots,
            initial_slots: self.ring_slots.min(INITIAL_RING_SLOTS),
            slot_size: self.slot_size,
            region_len: self.region_len,
            reads_rendezvous: self.reads_rendezvous(),
        }
    }

    /// A connection's rendezvous settings, from the hellos: frames go by
    /// rendezvous only to a peer that reads them, and announcements are
    /// taken (into a pool this side counted in its pinned budget) only when
    /// this side said it reads them. An announcement fills at most one of
    /// the `send_slot_size`-byte slots this side sends from.
    pub(crate) fn rendezvous_config(
        &self,
        own: &Hello,
        peer: &Hello,
        send_slot_size: usize,
    ) -> proto::RendezvousConfig {
        proto::RendezvousConfig {
            threshold: self.rendezvous_threshold.filter(|_| peer.reads_rendezvous),
            pool_bytes: if own.reads_rendezvous {
                self.rendezvous_pool.budget()
            } else {
                0
            },
            read_chunk: RENDEZVOUS_READ_CHUNK,
            read_depth: RENDEZVOUS_READ_DEPTH,
            max_outgoing: RENDEZVOUS_MAX_OUTGOING,
            announce_room: send_slot_size - HEADER_LEN,
        }
    }

    /// These settings with no rendezvous either way (byte streams: their
    /// writes are bounded, and nothing pins a pool for them).
    pub(crate) fn without_rendezvous(&self) -> RdmaTransport {
        self.clone().rendezvous_threshold(None)
    }

    /// These settings, their rendezvous pool raised to hold any frame
    /// `limits` admit on its own (so a frame never waits for room that
    /// cannot come).
    fn pool_fitting(&self, limits: FrameLimits) -> &RdmaTransport {
        self.rendezvous_pool
            .fit(proto::pool_charge(limits.max_frame_len));
        self
    }

    fn hello_limits(&self) -> HelloLimits {
        HelloLimits {
            max_ring_slots: self.max_peer_ring_slots,
            max_slot_size: self.max_peer_slot_size,
            max_region_len: self.max_peer_region_len,
        }
    }
}

/// `IP:PORT`, `[IPv6]:PORT` or `NAME:PORT` as one address. A name is
/// looked up on tokio's blocking pool, never on the caller's thread (a
/// slow resolver would stall every task of a current-thread runtime).
async fn resolve(authority: &str) -> Result<SocketAddr, TransportError> {
    let invalid = |reason: &str| TransportError::InvalidAddress {
        address: format!("rdma://{authority}"),
        reason: reason.to_string(),
    };
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(authority)
        .await
        .map_err(|e| invalid(&format!("expected IP:PORT or [IPv6]:PORT: {e}")))?
        .collect();
    // A name with both kinds of address: IPv4 first, as before IPv6 was
    // supported.
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| invalid("the name has no address"))
}

impl RdmaTransport {
    /// Resolves, connects and exchanges hellos, awaiting the connection
    /// manager's steps on the runtime (no thread waits for them); each
    /// step within [`connect_timeout`](Self::connect_timeout). Dropping the
    /// future frees what it made.
    async fn establish(&self, addr: SocketAddr) -> Result<conn::Established, TransportError> {
        conn::connect(addr, self).await
    }

    /// Listens on `authority`; every connection set up there is turned
    /// into a `T` by `start` and queued for [`Accepting::poll_accept`].
    fn accept_with<T: Send + 'static>(
        &self,
        addr: SocketAddr,
        start: impl Fn(conn::Established, &RdmaTransport) -> Result<T, TransportError>
            + Send
            + Sync
            + 'static,
    ) -> Result<Accepting<T>, TransportError> {
        let ctx = format!("listen on rdma://{addr}");
        let e = |e: verbs::Error| TransportError::io(ctx.clone(), std::io::Error::other(e));
        let channel = EventChannel::new().map_err(e)?;
        let mut id = CmId::new(&channel).map_err(e)?;
        if let Some(tos) = self.type_of_service {
            id.set_type_of_service(tos).map_err(e)?;
        }
        id.bind(addr).map_err(e)?;
        id.listen(128).map_err(e)?;
        let local = format!("rdma://{}", SocketAddr::new(addr.ip(), id.local_port()));
        // SAFETY: `ListenFd` owns the listening id, which owns its event
        // channel: the descriptor it returns is always the same and stays
        // open until the AsyncFd (which owns the `ListenFd`) is dropped.
        let fd = unsafe { AsyncFd::register(ListenFd(id)) }
            .map_err(|err| TransportError::io(ctx.clone(), err.into_parts().1))?;
        let (tx, rx) = mpsc::channel(16);
        // The rendezvous pool is counted once, whatever the connections.
        let pool = self
            .reads_rendezvous()
            .then(|| Arc::clone(&self.rendezvous_pool));
        if let Some(pool) = &pool {
            if pool.budget() > self.admission.max_pinned {
                return Err(TransportError::io(
                    ctx,
                    std::io::Error::other(format!(
                        "the rendezvous pool ({} bytes, RdmaTransport::rendezvous_pool, \
                         at least the frame limit) is larger than the listener's pinned \
                         budget ({} bytes, RdmaTransport::max_pinned_bytes)",
                        pool.budget(),
                        self.admission.max_pinned
                    )),
                ));
            }
        }
        let admission = Admission::new(self.admission, pool);
        let gate = match &self.auth_secret {
            Some(secret) => Some(
                Gate::new(secret.clone(), Instant::now())
                    .map_err(|err| TransportError::io(format!("{ctx}: random key"), err))?,
            ),
            None => None,
        };
        let task = tokio::spawn(accept_loop(
            fd,
            tx,
            self.clone(),
            admission,
            gate,
            Arc::new(start),
        ));
        Ok(Accepting { rx, local, task })
    }
}

impl Transport for RdmaTransport {
    fn scheme(&self) -> &'static str {
        "rdma"
    }

    fn stats(&self) -> Vec<rpc_core::transport::stats::TransportStat> {
        stats::transport_stats()
    }

    fn connect<'a>(
        &'a self,
        authority: &'a str,
        limits: FrameLimits,
    ) -> BoxFuture<'a, Result<Connection, TransportError>> {
        Box::pin(async move {
            let cfg = self.pool_fitting(limits);
            let est = cfg.establish(resolve(authority).await?).await?;
            conn::start(est, limits, cfg)
        })
    }

    fn listen<'a>(
        &'a self,
        authority: &'a str,
        limits: FrameLimits,
    ) -> BoxFuture<'a, Result<Box<dyn Listener>, TransportError>> {
        Box::pin(async move {
            let addr = resolve(authority).await?;
            let accepting = self
                .pool_fitting(limits)
                .accept_with(addr, move |est, cfg| conn::start(est, limits, cfg))?;
            Ok(Box::new(accepting) as Box<dyn Listener>)
        })
    }
}

/// The listening id, registered with tokio through its channel's descriptor.
struct ListenFd(CmId);

impl std::os::fd::AsRawFd for ListenFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.channel().fd()
    }
}

/// Turns an established connection into what a listener hands out.
type Start<T> =
    dyn Fn(conn::Established, &RdmaTransport) -> Result<T, TransportError> + Send + Sync;

async fn accept_loop<T: Send + 'static>(
    fd: AsyncFd<ListenFd>,
    tx: mpsc::Sender<Result<T, TransportError>>,
    cfg: RdmaTransport,
    admission: Arc<Admission>,
    mut gate: Option<Gate>,
    start: Arc<Start<T>>,
) {
    let mut refusals = RefusalLog::default();
    loop {
        let mut guard = tokio::select! {
            guard = fd.readable() => match guard {
                Ok(guard) => guard,
                Err(e) => {
                    let _ = tx.send(Err(TransportError::io("listener", e))).await;
                    return;
                }
            },
            () = tx.closed() => return,
        };
        guard.clear_ready();
        loop {
            let request = match fd.get_ref().0.try_get_request() {
                Ok(Some(request)) => request,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!("rdma listener: {e}");
                    break;
                }
            };
            let Some(Admitted {
                id,
                peer,
                proven,
                lease,
                handshake,
            }) = admit(
                request.id,
                &request.private_data,
                &cfg,
                &admission,
                gate.as_mut(),
                &mut refusals,
            )
            else {
                continue;
            };
            let cfg = cfg.clone();
            let tx = tx.clone();
            let start = Arc::clone(&start);
            // The set-up runs as a task of its own (no thread waits for
            // the client); its `handshake` is given back when it ends, and
            // its `lease` with its memory if it fails. Once the listener is
            // dropped nobody can take its connection: it ends at once
            // (dropping it frees what it made) instead of at its time limit.
            tokio::spawn(async move {
                let accepted = tokio::select! {
                    accepted = conn::accept(id, peer, proven, lease, &cfg) => accepted,
                    () = tx.closed() => return,
                };
                drop(handshake);
                let connection = accepted.and_then(|est| start(est, &cfg));
                match connection {
                    Ok(connection) => {
                        let _ = tx.send(Ok(connection)).await;
                    }
                    // One client's failed set-up does not stop the listener.
                    Err(e) => tracing::warn!("rdma: refused a connection: {e}"),
                }
            });
        }
    }
}

/// A connect request the listener admitted: what its set-up needs.
struct Admitted {
    id: CmId,
    peer: Hello,
    /// The client's proof of the shared secret, if the listener has one.
    proven: Option<Proven>,
    lease: Lease,
    handshake: Handshake,
}

/// Checks a connect request before anything is allocated for it: its
/// hello, its address against the allow-list, its proof of the shared
/// secret (a request without one is sent a challenge), then the
/// listener's limits. Refuses it (telling the client why) and returns
/// `None`, or returns what the set-up needs.
fn admit(
    mut id: CmId,
    private_data: &[u8],
    cfg: &RdmaTransport,
    admission: &Arc<Admission>,
    gate: Option<&mut Gate>,
    log: &mut RefusalLog,
) -> Option<Admitted> {
    let peer_ip = id.peer_addr().map(|a| a.ip());
    let peer_addr = || peer_ip.map_or_else(|| "?".to_string(), |ip| ip.to_string());
    let refused = match check_request(private_data, peer_ip, cfg, gate) {
        Err(Refused::Challenge(challenge)) => Refused::Challenge(challenge),
        Err(refused) => {
            log.note(format_args!(
                "rdma: refused a connection from {}: {refused}",
                peer_addr()
            ));
            refused
        }
        Ok((peer, proven)) => match admission.admit(conn::pinned_bytes(cfg, &peer)) {
            Ok((lease, handshake)) => {
                return Some(Admitted {
                    id,
                    peer,
                    proven,
                    lease,
                    handshake,
                })
            }
            Err(refused) => {
                log.note(format_args!(
                    "rdma: refused a connection from {}: {refused}",
                    peer_addr()
                ));
                refused
            }
        },
    };
    stats::refused(&refused);
    if let Err(e) = id.reject(&refused.to_bytes()) {
        tracing::warn!("rdma: rejecting {}: {e}", peer_addr());
    }
    None
}

/// The hello, allow-list and proof checks of [`admit`].
fn check_request(
    private_data: &[u8],
    peer_ip: Option<std::net::IpAddr>,
    cfg: &RdmaTransport,
    gate: Option<&mut Gate>,
) -> Result<(Hello, Option<Proven>), Refused> {
    let peer = Hello::decode(private_data, &cfg.hello_limits()).map_err(|e| {
        tracing::debug!("rdma: a client's hello: {e}");
        Refused::BadHello
    })?;
    if let Some(allowed) = &cfg.allowed_peers {
        if !peer_ip.is_some_and(|ip| allowed.iter().any(|net| net.contains(ip))) {
            return Err(Refused::NotAllowed);
        }
    }
    let Some(gate) = gate else {
        return Ok((peer, None));
    };
    let ip = peer_ip.ok_or(Refused::NotAllowed)?;
    let now = Instant::now();
    if auth::flags(private_data) & auth::FLAG_PROOF == 0 {
        return Err(Refused::Challenge(gate.challenge(ip, now)));
    }
    let proven = gate.check(private_data, ip, now).map_err(Refused::Proof)?;
    Ok((peer, Some(proven)))
}

/// A listening id's accepted connections, made into `T`s by its accept loop.
struct Accepting<T> {
    rx: mpsc::Receiver<Result<T, TransportError>>,
    local: String,
    task: tokio::task::JoinHandle<()>,
}

impl<T> Accepting<T> {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<T, TransportError>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(result)) => Poll::Ready(result),
            Poll::Ready(None) => Poll::Ready(Err(TransportError::Closed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Listener for Accepting<Connection> {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Connection, TransportError>> {
        Accepting::poll_accept(self, cx)
    }

    fn local_addr(&self) -> String {
        self.local.clone()
    }
}

impl<T> Drop for Accepting<T> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn names_resolve_and_prefer_ipv4() {
        let addr = resolve("localhost:4791").await.expect("localhost resolves");
        assert_eq!(addr, "127.0.0.1:4791".parse().unwrap());
        let addr = resolve("[::1]:4791").await.expect("an IPv6 literal");
        assert_eq!(addr, "[::1]:4791".parse().unwrap());
    }

    #[tokio::test]
    async fn a_bad_address_is_refused_with_its_name() {
        for bad in ["no-port", "10.0.0.1:notaport"] {
            match resolve(bad).await {
                Err(TransportError::InvalidAddress { address, .. }) => {
                    assert_eq!(address, format!("rdma://{bad}"));
                }
                other => panic!("{bad}: expected InvalidAddress, got {other:?}"),
            }
        }
    }
}
