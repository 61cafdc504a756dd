//! Connection set-up: the device objects of one connection, made in an
//! order that tears down safely, and the hello exchange.
//!
//! The set-ups are async: every wait for the connection manager (address
//! and route resolution, the server's answer, the client's confirmation)
//! awaits the set-up's own event channel on the runtime ([`CmEvents`]),
//! each step within `connect_timeout`, so no thread is held while a peer
//! takes its time. Dropping a set-up's future (cancelled, or timed out)
//! drops everything it made: the queue pair before its memory, then the
//! `cm_id` (whose unread events librdmacm discards with it) and, on a
//! server, the connection's admission lease.
//!
//! The device objects (PD, CQ, QP, the memory registrations) are made
//! synchronously on the task: each is one short system call that waits on
//! no peer, and their sizes are bounded by this side's settings and the
//! peer's hello within [`RdmaTransport::max_peer`] (milliseconds for the
//! defaults' few MiB). Sending them to `spawn_blocking` would make every
//! set-up depend on the blocking pool again, which is what this avoids.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};

use rpc_core::transport::{FrameLimits, TransportError, OVERSIZED_PREFIX_LEN};

use super::cm_events::{event, CmEvents, Event};
use super::first_slots::FirstSlots;
use super::io_error;
use super::payloads::PayloadPool;
use super::slots::{PartMemory, SlotMemory};
use super::state::{Buffers, Shared, State, FIRST_DATA_SLOTS};
use crate::admission::Lease;
use crate::proto::auth::{self, Challenge, Proven};
use crate::proto::{
    self, Hello, Refused, WorkKind, CTRL_SLOTS, HEADER_LEN, HEAP_SLOTS, REGION_FRAMES,
};
use crate::registry::Placement;
use crate::teardown::DropLater;
use crate::verbs::{
    Access, CmId, CompletionBatch, CompletionChannel, CompletionQueue, EventChannel, MemoryRegion,
    ProtectionDomain, QpCapabilities, QueuePair, SendBatch,
};
use crate::RdmaTransport;

/// The queue pair and the memory its receives use, in the one order they
/// may be destroyed: Rust drops fields in declaration order, so the QP
/// (which may have receives posted into `ring`) is destroyed before the
/// ring is deregistered and freed, on every path that drops this value
/// (set-up errors included). Nothing moves the QP or the ring out of it
/// separately.
struct Wired {
    /// Declared first: destroyed first.
    qp: QueuePair,
    ring: SlotMemory,
}

/// What a connection set-up produced, before its driver starts (all `Send`).
/// Dropped as a whole on an error before the start: the QP goes first
/// ([`Wired`]), then the memory only the local side uses.
pub(crate) struct Established {
    wired: Wired,
    send: SlotMemory,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    cc: CompletionChannel,
    id: CmId,
    own: Hello,
    peer: Hello,
    /// The data slots we send from.
    send_slots: SendSlots,
    peer_addr: String,
    /// A server's connection: its share of the listener's admission.
    lease: Option<Lease>,
    /// The peer proved the shared secret.
    authenticated: bool,
}

/// The device objects made before the hello exchange.
struct Half {
    wired: Wired,
    cq: CompletionQueue,
    cc: CompletionChannel,
    pd: ProtectionDomain,
    own: Hello,
    /// The data send slots the send queue is deep enough for.
    send_slots: u32,
}

/// Sends up to this many bytes (header included) go inline: the device
/// takes them from the work request, not by reading the slot (on a NIC,
/// one DMA read across PCIe less per small message). A 32-byte call with
/// its header and method name fits. Soft-RoCE grants up to 512, NICs
/// commonly a few hundred; a device that grants less gets none. The cost:
/// every send-queue entry grows by as much, ~33 KiB of queue memory per
/// connection at the default depth (Soft-RoCE, `many_connections`: 252
/// against 219 KiB of the machine's memory per connection; nothing more
/// pinned). On Soft-RoCE itself it changed no latency measurably.
const INLINE_SEND_BYTES: u32 = 256;

/// The device objects of one end, its send queue deep enough for
/// `send_slots` data slots: the most frames it keeps in flight, its own
/// ring's slots or the peer's if fewer ([`SendSlots`]). The server knows
/// both from the client's request; the client, which learns the server's
/// ring only from the reply, after its queue pair exists, sizes for its
/// own ring (within [`RdmaTransport::max_peer`]). At the default 64 slots
/// either end's queue is 114 deep (127 on Soft-RoCE, whose queues hold a
/// power of two less one), and its completion queue to match: 546 before
/// a client sized by its own ring, 162 before [`REGION_FRAMES`] bounded
/// the WRITEs.
fn make_half(
    id: &mut CmId,
    cfg: &RdmaTransport,
    send_slots: u32,
) -> Result<Half, crate::verbs::Error> {
    let shared = if cfg.shared_protection_domain {
        ProtectionDomain::shared(id)?
    } else {
        None
    };
    let pd = match shared {
        Some(pd) => pd,
        None => ProtectionDomain::new(id)?,
    };
    let cc = CompletionChannel::new(id)?;
    // Unsignaled binds of memory windows precede the announcements of our
    // transfers, each at most `MAX_SEGMENTS`: only a side that sends by
    // rendezvous binds any.
    let transfer_binds = if cfg.rendezvous_threshold.is_some() {
        crate::RENDEZVOUS_MAX_OUTGOING * crate::proto::MAX_SEGMENTS as u32
    } else {
        0
    };
    // On a shared domain the region the peer writes is reached through a
    // window too, bound ahead of its grant (one region at a time; two for
    // a grant that follows a release at once).
    let region_binds = if pd.is_shared() { 2 } else { 0 };
    let binds = transfer_binds + region_binds;
    // A SEND per data, chunk and control slot, a WRITE before the SEND of
    // each region frame and each chunk, the rendezvous READs, the binds.
    let writes = send_slots.min(REGION_FRAMES) + HEAP_SLOTS;
    let max_send_wr =
        send_slots + HEAP_SLOTS + CTRL_SLOTS + writes + crate::verbs::READ_DEPTH + binds + 4;
    let cq = CompletionQueue::with_channel(id, max_send_wr + cfg.ring_slots + 8, &cc)?;
    let qp = QueuePair::new(
        id,
        &pd,
        &cq,
        &cq,
        QpCapabilities {
            max_send_wr,
            max_recv_wr: cfg.ring_slots + 1,
            max_inline_data: INLINE_SEND_BYTES,
        },
    )?;
    let own = cfg.hello();
    // The first slots now, in a registration shared with the device's
    // other connections; doublings as the peer's traffic needs them.
    let slot = own.slot_size as usize;
    let ring = SlotMemory::new(
        PartMemory::Shared(FirstSlots::take(&pd, own.initial_slots as usize * slot)?),
        own.initial_slots,
        own.ring_slots,
        slot,
    );
    // Receives are posted only once the QP and the ring are in one `Wired`:
    // if a post fails, dropping `half` destroys the QP before the ring.
    let mut half = Half {
        wired: Wired { qp, ring },
        cq,
        cc,
        pd,
        own,
        send_slots,
    };
    let wired = &mut half.wired;
    for i in 0..own.initial_slots {
        let (mr, range) = wired.ring.slot(i);
        // SAFETY: the ring and the QP live in the same `Wired`, whose field
        // order destroys the QP first (then in `Shared`, likewise); slots
        // are read only after their receive completed and reposted only
        // once released.
        unsafe { wired.qp.post_recv(WorkKind::Recv.wr_id(i), mr, range)? };
    }
    Ok(half)
}

/// The data slots an end sends from (`count`, of `size` bytes): one per
/// slot of the peer's ring, as large as the peer's slots, but no more and
/// no larger than its own ring has (`own`). A peer announcing a larger ring costs this side no more
/// send slots, send queue or slot memory than its own ring would: it
/// takes frames as many at a time as this side's ring would let it send
/// back, and those too large for this side's slots by its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SendSlots {
    pub(crate) count: u32,
    pub(crate) size: u32,
}

impl SendSlots {
    pub(crate) fn new(own: &Hello, peer: &Hello) -> SendSlots {
        SendSlots {
            count: own.ring_slots.min(peer.ring_slots),
            size: own.slot_size.min(peer.slot_size),
        }
    }
}

/// Bytes a connection may pin with our settings and the peer's geometry:
/// our ring, the region the peer writes, send slots for the peer's ring
/// within our own ([`SendSlots`], plus control and chunk slots), staging
/// as large as the region (both [`Hello::region_with`]: no larger than
/// ours; registered with the first frame that needs it, which the peer's
/// requests can cause). Not the rendezvous pool: the transport's
/// connections share one, which a listener counts once.
pub(crate) fn pinned_bytes(cfg: &RdmaTransport, peer: &Hello) -> u64 {
    let own_hello = cfg.hello();
    let region = u64::from(own_hello.region_with(peer));
    let ring = u64::from(cfg.ring_slots) * u64::from(cfg.slot_size);
    let slots = SendSlots::new(&own_hello, peer);
    let send = u64::from(slots.count + CTRL_SLOTS + HEAP_SLOTS) * u64::from(slots.size);
    // The region the peer writes, and staging as large.
    ring + region + send + region
}

fn finish(
    id: CmId,
    half: Half,
    peer: Hello,
    peer_addr: String,
    lease: Option<Lease>,
    authenticated: bool,
) -> Established {
    // The first data slots with the control and chunk slots, then the
    // other data slots in doublings (see `Buffers::send_slot`): a sender
    // uses as many as it has frames queued or in flight, the lowest first.
    // Each part is registered with the first SEND from it too long to go
    // inline.
    let send_slots = SendSlots::new(&half.own, &peer);
    // A client's queue, made before it knew the server's ring, is sized
    // for its own ring (within the most it accepts), at least as many.
    debug_assert!(send_slots.count <= half.send_slots);
    let slot = send_slots.size as usize;
    let part = |n: u32| {
        let mr = MemoryRegion::unregistered(&half.pd, n as usize * slot, Access::LOCAL_WRITE);
        PartMemory::Own(mr)
    };
    let data_slots = send_slots.count;
    let mut data = FIRST_DATA_SLOTS.min(data_slots);
    let send = SlotMemory::new(
        part(data + CTRL_SLOTS + HEAP_SLOTS),
        data + CTRL_SLOTS + HEAP_SLOTS,
        data_slots + CTRL_SLOTS + HEAP_SLOTS,
        slot,
    );
    while data < data_slots {
        let count = data.min(data_slots - data);
        send.add(count, part(count));
        data += count;
    }
    Established {
        wired: half.wired,
        send,
        pd: half.pd,
        cq: half.cq,
        cc: half.cc,
        id,
        own: half.own,
        peer,
        send_slots,
        peer_addr,
        lease,
        authenticated,
    }
}

/// Client side: resolve, create, connect, exchange hellos. With a shared
/// secret, a first connect request without a queue pair fetches the
/// listener's challenge (nothing is allocated for a request the listener
/// refuses), and the real one carries the proof.
pub(crate) async fn connect(
    addr: SocketAddr,
    cfg: &RdmaTransport,
) -> Result<Established, TransportError> {
    let ctx = format!("connect to rdma://{addr}");
    let e = |e: crate::verbs::Error| io_error(ctx.clone(), e);
    let (mut id, events) = resolved_id(addr, cfg).await.map_err(e)?;
    let most_send_slots = cfg.ring_slots.min(cfg.max_peer_ring_slots);
    let half = make_half(&mut id, cfg, most_send_slots).map_err(e)?;
    // The challenge request names this connection's queue pair: unique
    // among this host's connections, and not connected until the
    // challenge was answered.
    let challenge = match &cfg.auth_secret {
        Some(_) => Some(fetch_challenge(addr, cfg, &ctx, half.wired.qp.qp_num()).await?),
        None => None,
    };
    let request = match (&cfg.auth_secret, &challenge) {
        (Some(secret), Some(challenge)) => {
            auth::proven_request(secret, half.own.to_bytes(), challenge).to_vec()
        }
        _ => half.own.to_bytes().to_vec(),
    };
    id.start_connect(&request).map_err(e)?;
    let reply = match events.next().await.and_then(Event::connect_reply) {
        Ok(reply) => reply,
        Err(crate::verbs::Error::Rejected {
            status,
            private_data,
        }) => return Err(rejected(&ctx, status, &private_data)),
        Err(other) => return Err(e(other)),
    };
    // The connection's driver registers the channel next.
    drop(events);
    if let Some(secret) = &cfg.auth_secret {
        let request = request[..].try_into().expect("a proven request");
        if let Err(why) = auth::check_reply(secret, request, &reply) {
            let _ = id.disconnect();
            return Err(denied(&ctx, why.to_string()));
        }
    }
    let peer = Hello::decode(&reply, &cfg.hello_limits()).map_err(|p| {
        let _ = id.disconnect();
        TransportError::Protocol(format!("{ctx}: {p}"))
    })?;
    let authenticated = cfg.auth_secret.is_some();
    Ok(finish(
        id,
        half,
        peer,
        format!("rdma://{addr}"),
        None,
        authenticated,
    ))
}

/// A connection manager id bound to a route to `addr`, with the
/// connection settings, and its channel's events.
async fn resolved_id(
    addr: SocketAddr,
    cfg: &RdmaTransport,
) -> Result<(CmId, CmEvents), crate::verbs::Error> {
    let channel = EventChannel::new()?;
    let events = CmEvents::new(&channel, cfg.connect_timeout)?;
    let mut id = CmId::new(&channel)?;
    if let Some(tos) = cfg.type_of_service {
        id.set_type_of_service(tos)?;
    }
    id.start_resolve_addr(cfg.source_address, addr, cfg.connect_timeout)?;
    events.expect(event::RDMA_CM_EVENT_ADDR_RESOLVED).await?;
    id.start_resolve_route(cfg.connect_timeout)?;
    events.expect(event::RDMA_CM_EVENT_ROUTE_RESOLVED).await?;
    if let Some(exponent) = cfg.ack_timeout {
        id.set_ack_timeout(exponent)?;
    }
    Ok((id, events))
}

/// The listener's challenge: a connect request with this side's geometry,
/// no proof and no queue pair (naming `qp_num`, the queue pair the real
/// request will bring: see [`CmId::start_connect_naming_qp`]), which a
/// listener with a secret refuses with a challenge. One that accepts it instead has no secret, and this side,
/// which has one, will not use it (its id is destroyed unconnected).
async fn fetch_challenge(
    addr: SocketAddr,
    cfg: &RdmaTransport,
    ctx: &str,
    qp_num: u32,
) -> Result<Challenge, TransportError> {
    let e = |e: crate::verbs::Error| io_error(ctx.to_string(), e);
    let (mut id, events) = resolved_id(addr, cfg).await.map_err(e)?;
    id.start_connect_naming_qp(&cfg.hello().to_bytes(), qp_num)
        .map_err(e)?;
    match events.next().await.and_then(Event::connect_reply) {
        Err(crate::verbs::Error::Rejected {
            status,
            private_data,
        }) => match Refused::decode(&private_data) {
            Some(Refused::Challenge(challenge)) => Ok(challenge),
            _ => Err(rejected(ctx, status, &private_data)),
        },
        // Accepted (established, or the connect response a queue-pair-less
        // id gets): the listener asked for no proof.
        Ok(_) | Err(crate::verbs::Error::UnexpectedCmEvent { .. }) => {
            Err(denied(ctx, auth::UNPROVEN_SERVER.to_string()))
        }
        Err(other) => Err(e(other)),
    }
}

/// A connect `PermissionDenied` for `why`.
fn denied(ctx: &str, why: String) -> TransportError {
    TransportError::io(
        ctx.to_string(),
        io::Error::new(io::ErrorKind::PermissionDenied, why),
    )
}

/// The error of a rejected connect request: the listener's refusal
/// (`PermissionDenied` for authentication, `ConnectionRefused` for its
/// limits), or nothing listening.
fn rejected(ctx: &str, status: i32, private_data: &[u8]) -> TransportError {
    let refused = |why: String| {
        TransportError::io(
            ctx.to_string(),
            io::Error::new(io::ErrorKind::ConnectionRefused, why),
        )
    };
    match Refused::decode(private_data) {
        Some(refused @ (Refused::Challenge(_) | Refused::Proof(_) | Refused::NotAllowed)) => {
            denied(ctx, format!("refused by the server: {refused}"))
        }
        Some(other) => refused(format!("refused by the server: {other}")),
        None => refused(format!(
            "connection refused (reject status {status}): nothing listens there, \
             or it is not an rdma-rpc server"
        )),
    }
}

/// Server side: move the request's id to its own channel, create,
/// accept, wait for the client's confirmation. The client's hello was
/// validated, its proof checked (`proven`, when the listener has a
/// secret), and the connection admitted (`lease`), by the listener.
///
/// The accepted id's events come on its own channel from here on (moved
/// off the listener's with `rdma_migrate_id`, events still queued for it
/// included): `RDMA_CM_EVENT_ESTABLISHED` when the client confirms, an
/// error event (or nothing, until the time limit) when it does not.
pub(crate) async fn accept(
    mut id: CmId,
    peer: Hello,
    proven: Option<Proven>,
    lease: Lease,
    cfg: &RdmaTransport,
) -> Result<Established, TransportError> {
    let peer_addr = id
        .peer_addr()
        .map_or_else(|| "rdma://?".to_string(), |a| format!("rdma://{a}"));
    let ctx = format!("accept from {peer_addr}");
    let e = |e: crate::verbs::Error| io_error(ctx.clone(), e);
    let channel = EventChannel::new().map_err(e)?;
    id.migrate(&channel).map_err(e)?;
    let events = CmEvents::new(&channel, cfg.connect_timeout).map_err(e)?;
    if let Some(exponent) = cfg.ack_timeout {
        id.set_ack_timeout(exponent).map_err(e)?;
    }
    let send_slots = SendSlots::new(&cfg.hello(), &peer).count;
    let half = make_half(&mut id, cfg, send_slots).map_err(e)?;
    let mut est = finish(id, half, peer, peer_addr, Some(lease), proven.is_some());
    let own = est.own.to_bytes();
    let reply = match (proven, &cfg.auth_secret) {
        (Some(proven), Some(secret)) => proven.reply(secret, own).to_vec(),
        _ => own.to_vec(),
    };
    est.id.start_accept(&reply).map_err(e)?;
    events
        .expect(event::RDMA_CM_EVENT_ESTABLISHED)
        .await
        .map_err(e)?;
    Ok(est)
}

impl Established {
    /// Who the peer proved to be: [`auth::PROVEN_IDENTITY`] when it proved
    /// the shared secret.
    pub(crate) fn peer_identity(&self) -> Option<&'static str> {
        self.authenticated.then_some(auth::PROVEN_IDENTITY)
    }

    /// Where the connection sits on its device (what async events name).
    pub(super) fn placement(&self) -> Result<Placement, crate::verbs::Error> {
        Placement::of(&self.id, &self.wired.qp, &self.cq)
    }

    /// Moves the connection's objects into its shared state (the QP into
    /// the state, the memory after it: see [`Shared`]); returns what the
    /// driver registers with tokio. Infallible, so nothing is dropped
    /// half-moved.
    pub(super) fn into_shared(
        self,
        limits: FrameLimits,
        cfg: &RdmaTransport,
    ) -> (Arc<Shared>, CmId, CompletionChannel) {
        let Established {
            wired: Wired { qp, ring },
            send,
            pd,
            cq,
            cc,
            id,
            own,
            peer,
            send_slots,
            peer_addr,
            lease,
            authenticated: _,
        } = self;
        let rendezvous = cfg.rendezvous_config(&own, &peer, send_slots.size as usize);
        let payloads = rendezvous
            .threshold
            .map(|threshold| (PayloadPool::new(&pd, cfg.payload_pool), threshold));
        let inline_max = cfg
            .inline_threshold
            .min(send_slots.size as usize - HEADER_LEN);
        let mut proto = proto::Connection::new(proto::Config {
            ring_slots: own.ring_slots,
            initial_ring_slots: own.initial_slots,
            slot_size: own.slot_size as usize,
            region_len: own.region_with(&peer).into(),
            peer_ring_slots: peer.ring_slots,
            peer_initial_ring_slots: peer.initial_slots,
            send_slots: send_slots.count,
            peer_region_len: own.region_with(&peer).into(),
            inline_max,
            max_frame_len: limits.max_frame_len,
            max_skip_len: limits.max_skip_len(),
            prefix_len: OVERSIZED_PREFIX_LEN,
            rendezvous,
        });
        proto.keep_buffers_in(Arc::clone(&cfg.kept));
        let wake_task = Arc::new(super::wake::DriverWake::default());
        let pool_wait = own.reads_rendezvous.then(|| {
            let own_pd = (!pd.is_shared()).then(|| pd.clone());
            let (share, wait) = cfg.rendezvous_pool.share(Arc::clone(&wake_task), own_pd);
            proto.charge_pool_to(Box::new(share));
            wait
        });
        let state = State {
            qp,
            proto,
            send_waiters: Vec::new(),
            close_waiters: Vec::new(),
            recv_waker: None,
            max_frame_len: limits.max_frame_len,
            handles: 2,
            completions: 0,
            out_transfers: HashMap::new(),
            destinations: HashMap::new(),
            rendezvous_pool: Arc::clone(&cfg.rendezvous_pool),
            posting: false,
            batch: SendBatch::default(),
            completed: CompletionBatch::new(),
            staging: None,
            staging_used: false,
            send_slots_registered: false,
            send_slots_used: false,
            region: None,
        };
        let shared = Arc::new(Shared {
            state: DropLater::new(Mutex::new(state)),
            mem: DropLater::new(Buffers::new(ring, send, send_slots.count, pd, own, peer)),
            cq: DropLater::new(cq),
            released: Mutex::new(Vec::new()),
            pool_released: Mutex::new(Vec::new()),
            wake_task,
            pool_wait,
            payloads,
            ended_by_cm: OnceLock::new(),
            peer: peer_addr,
            _lease: DropLater::new(lease),
        });
        (shared, id, cc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_costs_a_listener_no_more_than_its_own_settings() {
        let cfg = RdmaTransport::default();
        let own = cfg.hello();
        // The ring (64 × 8 KiB), the region and staging (1 MiB each), 64
        // data, 4 control and 4 chunk send slots of 8 KiB.
        let default = 64 * 8192 + 2 * (1 << 20) + 72 * 8192;
        assert_eq!(pinned_bytes(&cfg, &own), default);
        // The largest geometry `max_peer` admits by default cost 34 MiB
        // when the listener mirrored it (264 send slots of 64 KiB and a
        // 16 MiB staging region).
        let largest = Hello {
            ring_slots: 256,
            initial_slots: 8,
            slot_size: 64 << 10,
            region_len: 16 << 20,
            reads_rendezvous: false,
        };
        assert_eq!(pinned_bytes(&cfg, &largest), default);
        assert_eq!(
            SendSlots::new(&own, &largest),
            SendSlots {
                count: 64,
                size: 8192
            }
        );
        // A smaller peer costs less: send slots and regions as its own.
        let small = Hello {
            ring_slots: 8,
            initial_slots: 4,
            slot_size: 512,
            region_len: 8192,
            reads_rendezvous: false,
        };
        assert_eq!(pinned_bytes(&cfg, &small), 64 * 8192 + 2 * 8192 + 16 * 512);
    }
}
