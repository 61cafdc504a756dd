//! The rendezvous for large frames: the wire format of an announcement,
//! the settings, and the accounting both ends keep (the state machine
//! itself is [`Connection`](super::Connection)'s).
//!
//! A frame at or above the sender's threshold is encoded into memory the
//! sender registers for this transfer only, with remote *read* access
//! (never write). The sender SENDs an `Announce` message: the header
//! (`len` = the frame's length, `pos` = a transfer id the sender picks,
//! unique among its transfers in flight) and an [`Announcement`] body
//! (the segment's address and rkey, and the frame's first
//! [`ANNOUNCE_PREFIX_LEN`] bytes). The receiver takes a destination of
//! `len` bytes from its own bounded pool (local write only), RDMA READs
//! the segment into it in pieces of [`RendezvousConfig::read_chunk`],
//! [`RendezvousConfig::read_depth`] at a time, answers `Done` (`pos` =
//! the transfer id) once every READ completed, and hands the frame up over
//! the destination. On `Done` the sender deregisters the segment: remote
//! access to it ends.
//!
//! Bounds: the sender's device checks every READ against the rkey's
//! registration (its address range and its access rights), so a receiver
//! reads nothing else; the receiver's READs land in a destination of
//! exactly the announced length, each within it. An announcement holds its
//! receive slot until its frame is delivered, so a peer has at most a ring
//! of transfers announced; frames over the frame limit are skipped unread
//! (the prefix from the announcement is enough to report them).
//!
//! Ordering: a frame whose READs are still running does not hold up later
//! frames of *other* calls. Frames carry rpc-core's call id in bytes 4..12
//! ([`lane`]); a frame may be delivered before an earlier rendezvous frame
//! only if both have a call id and they differ. Region (chunked) frames
//! and the end of the stream never overtake anything (inline frames of
//! other calls pass chunked frames too: see `Connection`'s sending). That is the ordering
//! `rpc_core::transport::FrameSink` promises, and no more.

use super::ProtocolError;

/// Bytes of the frame's start carried in its announcement.
pub const ANNOUNCE_PREFIX_LEN: usize = 32;
/// Length of an announcement's body: `addr: u64, rkey: u32, reserved: u32
/// (0)`, then the prefix.
pub const ANNOUNCE_BODY_LEN: usize = 16 + ANNOUNCE_PREFIX_LEN;
/// The bytes of a received message the verbs layer copies out of its slot
/// for the protocol ([`Completion::header`](super::Completion::header)):
/// the header and an announcement's body.
pub const PEEK_LEN: usize = super::HEADER_LEN + ANNOUNCE_BODY_LEN;
/// Destinations are charged to the pool in whole pages.
pub const POOL_GRANULE: u64 = 4096;

/// What an `Announce` message's body says: where the frame lies in the
/// sender's memory, and its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Announcement {
    /// The segment's address, as the sender's registration names it.
    pub addr: u64,
    /// The segment's remote key (its registration, read access only).
    pub rkey: u32,
    /// The frame's first bytes.
    pub prefix: [u8; ANNOUNCE_PREFIX_LEN],
}

impl Announcement {
    /// Encodes into `out` (at least [`ANNOUNCE_BODY_LEN`] bytes).
    pub fn encode(&self, out: &mut [u8]) {
        out[..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        out[12..16].copy_from_slice(&0u32.to_le_bytes());
        out[16..ANNOUNCE_BODY_LEN].copy_from_slice(&self.prefix);
    }

    /// Decodes an announcement's body.
    pub fn decode(body: &[u8]) -> Result<Announcement, ProtocolError> {
        let body = body.get(..ANNOUNCE_BODY_LEN).ok_or_else(|| {
            ProtocolError::new(format!(
                "announcement body of {} bytes, shorter than {ANNOUNCE_BODY_LEN}",
                body.len()
            ))
        })?;
        if body[12..16] != [0; 4] {
            return Err(ProtocolError::new(
                "reserved announcement field is not zero",
            ));
        }
        Ok(Announcement {
            addr: u64::from_le_bytes(body[..8].try_into().expect("8 bytes")),
            rkey: u32::from_le_bytes(body[8..12].try_into().expect("4 bytes")),
            prefix: body[16..].try_into().expect("the prefix"),
        })
    }
}

/// The ordering key of a frame from its first bytes: rpc-core's call id
/// (bytes 4..12), `None` for a frame too short to have one (it keeps its
/// place behind everything).
pub fn lane(prefix: &[u8]) -> Option<u64> {
    prefix
        .get(4..12)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
}

/// What a frame of `len` bytes is charged to the receiver's pool.
pub fn pool_charge(len: usize) -> u64 {
    (len as u64).next_multiple_of(POOL_GRANULE)
}

/// The rendezvous settings of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// Frames at least this long (and longer than inline) are sent by
    /// rendezvous; `None`: never (frames go through the region).
    pub threshold: Option<usize>,
    /// Destinations registered for frames read and not yet released by
    /// the application, at most (raised to the frame limit, so that any
    /// frame fits once the others are released); 0: announcements are
    /// refused (a protocol violation).
    pub pool_bytes: u64,
    /// Bytes per RDMA READ.
    pub read_chunk: usize,
    /// READs in flight at once.
    pub read_depth: u32,
    /// Our transfers announced (or being encoded) and not yet `Done`.
    pub max_outgoing: u32,
}

impl RendezvousConfig {
    /// No rendezvous either way.
    pub const OFF: RendezvousConfig = RendezvousConfig {
        threshold: None,
        pool_bytes: 0,
        read_chunk: 1 << 20,
        read_depth: 1,
        max_outgoing: 1,
    };
}

/// Where one of our transfers stands (sending side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OutTransfer {
    /// Reserved; the application encodes it.
    Encoding,
    /// Encoded and queued behind earlier messages.
    Queued,
    /// Announced: the peer may be reading it.
    Announced,
}

/// Where one of the peer's transfers stands (receiving side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum InState {
    /// Waiting for room in the pool.
    WaitPool,
    /// Its destination is taken; READs are being posted and completed.
    Reading,
    /// Every READ completed: ready to deliver.
    Read,
    /// Over the frame limit: skipped unread.
    Skipped,
}

/// One of the peer's transfers (receiving side).
#[derive(Debug, Clone)]
pub(super) struct Incoming {
    pub(super) id: u64,
    pub(super) len: usize,
    pub(super) ann: Announcement,
    pub(super) lane: Option<u64>,
    pub(super) state: InState,
    /// Next byte to read.
    pub(super) next: usize,
    /// Bytes whose READ completed.
    pub(super) read: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcement_round_trip_and_checks() {
        let mut prefix = [0; ANNOUNCE_PREFIX_LEN];
        prefix[4] = 9;
        let a = Announcement {
            addr: 0x1234,
            rkey: 77,
            prefix,
        };
        let mut body = [0; ANNOUNCE_BODY_LEN];
        a.encode(&mut body);
        assert_eq!(Announcement::decode(&body), Ok(a));
        assert_eq!(lane(&a.prefix), Some(9));
        assert_eq!(lane(&[0; 11]), None);
        assert!(Announcement::decode(&body[..20]).is_err());
        body[13] = 1;
        assert!(Announcement::decode(&body).is_err());
        assert_eq!(pool_charge(1), 4096);
        assert_eq!(pool_charge(4096), 4096);
        assert_eq!(pool_charge(4097), 8192);
    }
}
