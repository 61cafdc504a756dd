//! The verbs glue: one RC connection's queue pair, registered memory and
//! driver task, and the `FrameSink` / `FrameSource` over them.
//!
//! Split along its seams: [`setup`] (make the device objects, exchange
//! hellos, awaiting the connection manager's events through
//! [`cm_events`]), [`state`] (the memory and the queue pair, carrying out what
//! [`proto::Connection`](crate::proto::Connection) decides), [`io`] (the
//! sink and source halves the application uses), [`transfer`] (the
//! registrations of our rendezvous transfers), [`destinations`] (the
//! pool the peers' transfers are read into, shared by the transport's
//! connections), [`driver`] (the task
//! that feeds completions and connection-manager events in). The registry
//! of live connections that device events fail is [`crate::registry`].
//!
//! All protocol decisions are [`crate::proto`]'s; this module owns the
//! memory, posts the work requests the protocol allows, and turns
//! completions and connection-manager events into protocol inputs.
//!
//! Memory of one connection (all registered with the protection domain its
//! device's connections share, or its own: [`crate::verbs::ProtectionDomain::shared`]):
//! - `ring`: the receive ring, `ring_slots × slot_size`, local write only,
//!   every slot in use posted unless its message is being handled or
//!   held; its first slots a piece of a registration shared with the
//!   other connections on the protection domain ([`first_slots`]), then
//!   doubled each time the peer keeps half of those consumed, each
//!   doubling a registration of its own ([`slots`]);
//! - `region`: the large-payload region the peer RDMA-writes into (the
//!   only remotely writable memory: through a memory window bound to the
//!   connection's queue pair on a shared domain, else by the registration
//!   itself), registered when the peer asks for it and deregistered when
//!   the peer gives it back (idle);
//! - `send`: send slots (the peer's slot size, one per peer ring slot plus
//!   `CTRL_SLOTS` for control messages and `HEAP_SLOTS` for the chunks
//!   of heap-encoded frames); small frames are encoded into them. In
//!   parts ([`slots`]): the first 8 data slots with the control and chunk
//!   slots, then the other data slots in doublings (8, 16, 32, …: used
//!   only while that many frames are queued or in flight). Each part is
//!   registered with the first SEND from it too long to go inline (the
//!   device copies inline sends out of the work request): a connection
//!   whose frames all go inline pins none, one of a few frames at a time
//!   128 KiB by default; all are deregistered by the driver once no such
//!   SEND was posted for a while and none is in flight
//!   (`State::release_idle_send_slots`);
//! - `staging`: the source of RDMA WRITEs, as large as the peer's region and
//!   at the same offsets; region frames are encoded into it. Registered
//!   with the first frame that needs it: a connection that only carries
//!   small frames pins none; under the connection's lock, and let go by
//!   the driver once unused for a while (`State::release_idle_regions`).

mod cm_events;
mod destinations;
mod driver;
mod first_slots;
mod io;
mod payloads;
mod setup;
mod slots;
mod state;
mod transfer;
mod wake;

pub(crate) use destinations::{pool_contains, RendezvousPool};
pub(crate) use driver::{start, start_halves};
pub(crate) use io::{RdmaSink, RdmaSource};
pub(crate) use setup::Established;
pub(crate) use setup::{accept, connect, pinned_bytes};
pub use transfer::{rendezvous_bytes_sent, rendezvous_bytes_sent_from_pool, REGISTER_IN_PLACE_MIN};

use rpc_core::transport::TransportError;

pub(super) fn io_error(context: impl Into<String>, e: impl std::fmt::Display) -> TransportError {
    TransportError::io(context, std::io::Error::other(e.to_string()))
}
