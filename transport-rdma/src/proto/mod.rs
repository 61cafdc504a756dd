//! The sans-I/O protocol core: everything the RDMA transport decides, with
//! no verbs and no async runtime in it.
//!
//! The verbs glue (the crate's private `conn` module) owns the registered memory and posts the
//! work requests; these state machines say what may be posted, validate
//! everything the peer sends, and keep the accounting that makes "no send
//! without a credit, no write outside free space" hold:
//!
//! - [`Header`]: the fixed header at the start of every SEND;
//! - [`Hello`]: what the peers exchange in the connection manager's private
//!   data (protocol version, ring geometry, the slots posted at first, and
//!   region length);
//! - [`Refused`]: why a server refused a connection (in its reject's
//!   private data);
//! - [`CreditWindow`]: the sender's credits for free receive slots at the peer;
//! - [`RecvRing`]: the receiver's slot accounting, when to return credits,
//!   and when to grow from its first slots to all of them;
//! - [`RegionWriter`] / [`RegionReader`]: the ring allocator over the peer's
//!   large-payload region (allocation in order, freeing in order) and its
//!   receiving side, which checks every offset and length;
//! - [`Reassembly`]: frames larger than one region chunk, put back together
//!   (or skipped when over the frame limit);
//! - [`route`]: the small / large / chunked decision for one frame;
//! - [`Connection`]: one connection's protocol built from the above, as a
//!   state machine (completions, sends, releases, close and disconnect in;
//!   work requests to post and frames to deliver out), which the verbs
//!   layer drives and the simulation tests.
//!
//! # Wire protocol (version 8)
//! Every message is one SEND into a receive slot, starting with a 32-byte
//! [`Header`]. An `Inline` message carries a whole frame after the header.
//! A `Chunk` message announces `len` bytes the sender has just RDMA-written
//! into the receiver's region at `pos` (a position in the region's infinite
//! byte stream: offset `pos % region_len`, `region_len` being the smaller
//! of the two hellos' regions); on an RC queue pair the WRITE is
//! in place before the SEND's receive completes. Each message also returns
//! `credits` receive slots and the sender's region `freed_to` position.
//! `Credit` messages carry only those; `Close` ends the stream. A
//! receiver posts the first slots its hello names, and doubles them (up to
//! its whole ring) each time the peer keeps half of those in use consumed:
//! the new slots come as
//! credits the peer never had (on any message; a `Credit` message goes at
//! once). The
//! receiver's region exists once the sender asked for it: `RegionWanted`
//! before its first `Chunk`, answered by `RegionGranted` (the region's
//! address and rkey); a sender that went idle with all of the region
//! freed gives it back (`RegionReturned`: the receiver deregisters it) and
//! asks again when a frame needs it. A receiver whose peer keeps few
//! messages in flight again shrinks its ring back to its first slots: it
//! retires the others as their messages are handled (no repost, no
//! credit) and asks the peer (`RingShrinks`) for as many messages as it
//! has receives posted, which the peer sends as `Credit` messages, so
//! every receive posted in a retired slot is consumed.
//! `Announce` and `Done` carry the rendezvous of large frames (the
//! receiver RDMA READs them out of the sender's memory): see the
//! `rendezvous` module's docs, [`Announcement`] and [`RendezvousConfig`].
//! (Version 2 added them; version 4 the region on request, where version 3
//! put its address and rkey in the hello; version 5 the ring's first slots,
//! where version 4 posted all of them; version 6 `RegionReturned`;
//! version 7 `RingShrinks`; version 8 regions the smaller of the two
//! sides', where version 7 took each side's own; a peer of another
//! version is refused at connect.)

pub mod auth;
mod connection;
mod credit;
mod frame_bytes;
mod free_slots;
mod header;
mod hello;
mod reassembly;
mod refusal;
mod region;
mod rendezvous;
#[cfg(test)]
mod sim;

pub use connection::{
    Completion, Config, Connection, Delivered, EncodeInto, Lifecycle, OwnClose, ReadReceived,
    Refusal, Reservation, SendDecision, Transmit, Wakeups, WorkKind, CTRL_SLOTS, HEAP_SLOTS,
    REGION_FRAMES,
};
pub use credit::{CreditWindow, Delivery, RecvRing};
pub use frame_bytes::FrameBytes;
pub use header::{Header, Kind, FIRST, HEADER_LEN, LAST};
pub use hello::{Hello, HelloLimits, FLAG_READS_RENDEZVOUS, HELLO_LEN, MAGIC, VERSION};
pub use reassembly::{Assembled, Reassembly};
pub use refusal::{Refused, REFUSED_LEN};
pub use region::{max_chunk, RegionReader, RegionWriter};
pub use rendezvous::{
    announce_body_len, lane, pool_charge, Announcement, OwnPool, PoolRoom, RendezvousConfig,
    Segment, ANNOUNCE_PREFIX_LEN, MAX_SEGMENTS, PEEK_LEN, POOL_GRANULE, SEGMENT_LEN,
};

/// The peer broke the protocol: the connection must be closed and its calls failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("RDMA transport protocol violation: {0}")]
pub struct ProtocolError(pub String);

impl ProtocolError {
    pub(crate) fn new(message: impl Into<String>) -> ProtocolError {
        ProtocolError(message.into())
    }
}

/// How one outgoing frame travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// In one SEND, after the header, into a receive slot.
    Inline,
    /// One RDMA WRITE into the peer's region, then a `Chunk` SEND.
    Region,
    /// Frame larger than one chunk: several WRITE + `Chunk` SEND pairs.
    Chunked,
}

/// Picks the route of a frame of `len` bytes: inline up to `inline_max`
/// (the small/large threshold, at most a slot minus the header), one region
/// chunk up to `max_chunk`, chunked above.
pub fn route(len: usize, inline_max: usize, max_chunk: usize) -> Route {
    if len <= inline_max {
        Route::Inline
    } else if len <= max_chunk {
        Route::Region
    } else {
        Route::Chunked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_thresholds() {
        assert_eq!(route(0, 100, 1000), Route::Inline);
        assert_eq!(route(100, 100, 1000), Route::Inline);
        assert_eq!(route(101, 100, 1000), Route::Region);
        assert_eq!(route(1000, 100, 1000), Route::Region);
        assert_eq!(route(1001, 100, 1000), Route::Chunked);
    }
}
