//! The rendezvous for large frames: the wire format of an announcement,
//! the settings, and the accounting both ends keep (the state machine
//! itself is [`Connection`](super::Connection)'s).
//!
//! A frame at or above the sender's threshold lies in memory the sender
//! registers for this transfer only, with remote *read* access (never
//! write), in up to [`MAX_SEGMENTS`] segments: the whole frame encoded
//! into one registration, or its large payloads registered where the
//! application left them and the rest copied into one registration. The
//! sender SENDs an `Announce` message: the header (`len` = the frame's
//! length, `pos` = a transfer id the sender picks, unique among its
//! transfers in flight) and an [`Announcement`] body (the frame's first
//! [`ANNOUNCE_PREFIX_LEN`] bytes, then each segment's address, rkey and
//! length, in the frame's order; as many as fit the receiver's slot). The
//! receiver takes a destination of `len` bytes from its own bounded pool
//! (local write only), RDMA READs the segments into it in pieces of at
//! most [`RendezvousConfig::read_chunk`] (a READ never spans two
//! segments), [`RendezvousConfig::read_depth`] at a time, answers `Done`
//! (`pos` = the transfer id) once every READ completed, and hands the
//! frame up over the destination. On `Done` the sender deregisters the
//! segments: remote access to them ends.
//!
//! Bounds: the sender's device checks every READ against the rkey's
//! registration (its address range and its access rights), so a receiver
//! reads nothing else; the segments must add up to the announced length
//! exactly, and the receiver's READs land in a destination of that length,
//! each within it. An announcement holds its
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
/// Most segments an announcement lists.
pub const MAX_SEGMENTS: usize = 8;
/// Encoded length of one [`Segment`].
pub const SEGMENT_LEN: usize = 16;
/// Length of an announcement's body listing `segments` segments: the
/// prefix, then each segment's `addr: u64, rkey: u32, len: u32`.
pub const fn announce_body_len(segments: usize) -> usize {
    ANNOUNCE_PREFIX_LEN + segments * SEGMENT_LEN
}
/// The longest announcement body.
pub const ANNOUNCE_BODY_MAX: usize = announce_body_len(MAX_SEGMENTS);
/// The bytes of a received message the verbs layer copies out of its slot
/// for the protocol ([`Completion::header`](super::Completion::header)):
/// the header and an announcement's body.
pub const PEEK_LEN: usize = super::HEADER_LEN + ANNOUNCE_BODY_MAX;
/// Destinations are charged to the pool in whole pages.
pub const POOL_GRANULE: u64 = 4096;

/// One piece of a rendezvous frame in the sender's memory: `len` bytes at
/// `addr` under the registration `rkey` (read access only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Segment {
    /// The segment's address, as the sender's registration names it.
    pub addr: u64,
    /// The registration's remote key.
    pub rkey: u32,
    /// Its length in bytes (never 0).
    pub len: u32,
}

/// What an `Announce` message's body says: the frame's first bytes, and
/// where its bytes lie in the sender's memory, in order: one segment when
/// the sender encoded the frame into memory of its own, several when it
/// registered a large payload where the application left it (the frame's
/// head and small fields copied into one registration, each large `Bytes`
/// in its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Announcement {
    /// The frame's first bytes.
    pub prefix: [u8; ANNOUNCE_PREFIX_LEN],
    segments: [Segment; MAX_SEGMENTS],
    count: u8,
}

impl Announcement {
    /// An announcement of `segments` (1 to [`MAX_SEGMENTS`] of them, none
    /// empty: panics otherwise).
    pub fn new(prefix: [u8; ANNOUNCE_PREFIX_LEN], segments: &[Segment]) -> Announcement {
        assert!(
            (1..=MAX_SEGMENTS).contains(&segments.len()),
            "an announcement lists 1 to {MAX_SEGMENTS} segments, not {}",
            segments.len()
        );
        assert!(
            segments.iter().all(|s| s.len > 0),
            "an announced segment is never empty"
        );
        let mut all = [Segment::default(); MAX_SEGMENTS];
        all[..segments.len()].copy_from_slice(segments);
        Announcement {
            prefix,
            segments: all,
            count: segments.len() as u8,
        }
    }

    /// The segments, in the frame's order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments[..self.count as usize]
    }

    /// The frame's length: its segments' lengths added up.
    pub fn frame_len(&self) -> u64 {
        self.segments().iter().map(|s| u64::from(s.len)).sum()
    }

    /// Length of the encoded body.
    pub fn encoded_len(&self) -> usize {
        announce_body_len(self.count as usize)
    }

    /// Encodes into `out` (at least [`encoded_len`](Self::encoded_len) bytes).
    pub fn encode(&self, out: &mut [u8]) {
        out[..ANNOUNCE_PREFIX_LEN].copy_from_slice(&self.prefix);
        for (s, out) in self
            .segments()
            .iter()
            .zip(out[ANNOUNCE_PREFIX_LEN..].chunks_exact_mut(SEGMENT_LEN))
        {
            out[..8].copy_from_slice(&s.addr.to_le_bytes());
            out[8..12].copy_from_slice(&s.rkey.to_le_bytes());
            out[12..16].copy_from_slice(&s.len.to_le_bytes());
        }
    }

    /// Decodes an announcement's body (exactly the body: its length says
    /// how many segments it lists).
    pub fn decode(body: &[u8]) -> Result<Announcement, ProtocolError> {
        let listed = body.len().checked_sub(ANNOUNCE_PREFIX_LEN);
        let count = match listed {
            Some(n) if n % SEGMENT_LEN == 0 && (1..=MAX_SEGMENTS).contains(&(n / SEGMENT_LEN)) => {
                n / SEGMENT_LEN
            }
            _ => {
                return Err(ProtocolError::new(format!(
                    "announcement body of {} bytes: not a prefix and 1 to {MAX_SEGMENTS} segments",
                    body.len()
                )))
            }
        };
        let mut segments = [Segment::default(); MAX_SEGMENTS];
        for (s, b) in segments
            .iter_mut()
            .zip(body[ANNOUNCE_PREFIX_LEN..].chunks_exact(SEGMENT_LEN))
        {
            *s = Segment {
                addr: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
                rkey: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
                len: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
            };
            if s.len == 0 {
                return Err(ProtocolError::new("announced segment of 0 bytes"));
            }
        }
        Ok(Announcement {
            prefix: body[..ANNOUNCE_PREFIX_LEN].try_into().expect("the prefix"),
            segments,
            count: count as u8,
        })
    }

    /// Where the frame's byte `offset` lies: the sender's address of it,
    /// its segment's rkey, and how many bytes of that segment follow it
    /// (from it on). `None` past the frame's end.
    pub fn locate(&self, offset: usize) -> Option<(u64, u32, usize)> {
        let mut start = 0usize;
        for s in self.segments() {
            let end = start + s.len as usize;
            if offset < end {
                let into = offset - start;
                return Some((s.addr.wrapping_add(into as u64), s.rkey, end - offset));
            }
            start = end;
        }
        None
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
    /// Segments an announcement of ours may list: as many as fit the
    /// peer's receive slot after the header ([`max_segments_in_slot`]).
    pub max_segments: usize,
}

/// How many segments an announcement in a receive slot of `slot_size`
/// bytes may list: at most [`MAX_SEGMENTS`], at least one (a slot holds a
/// header and 64 bytes).
pub fn max_segments_in_slot(slot_size: usize) -> usize {
    (slot_size.saturating_sub(super::HEADER_LEN + ANNOUNCE_PREFIX_LEN) / SEGMENT_LEN)
        .clamp(1, MAX_SEGMENTS)
}

impl RendezvousConfig {
    /// No rendezvous either way.
    pub const OFF: RendezvousConfig = RendezvousConfig {
        threshold: None,
        pool_bytes: 0,
        read_chunk: 1 << 20,
        read_depth: 1,
        max_outgoing: 1,
        max_segments: 1,
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
        let a = Announcement::new(
            prefix,
            &[Segment {
                addr: 0x1234,
                rkey: 77,
                len: 4096,
            }],
        );
        let mut body = [0; ANNOUNCE_BODY_MAX];
        a.encode(&mut body);
        assert_eq!(a.encoded_len(), ANNOUNCE_PREFIX_LEN + SEGMENT_LEN);
        assert_eq!(Announcement::decode(&body[..a.encoded_len()]), Ok(a));
        assert_eq!(lane(&a.prefix), Some(9));
        assert_eq!(lane(&[0; 11]), None);
        assert!(Announcement::decode(&body[..20]).is_err(), "no segment");
        assert!(
            Announcement::decode(&body[..ANNOUNCE_PREFIX_LEN]).is_err(),
            "no segment"
        );
        assert!(
            Announcement::decode(&body[..a.encoded_len() + 1]).is_err(),
            "part of a segment"
        );
        body[ANNOUNCE_PREFIX_LEN + 12..ANNOUNCE_PREFIX_LEN + 16].fill(0);
        assert!(
            Announcement::decode(&body[..a.encoded_len()]).is_err(),
            "an empty segment"
        );
        assert_eq!(pool_charge(1), 4096);
        assert_eq!(pool_charge(4096), 4096);
        assert_eq!(pool_charge(4097), 8192);
    }

    #[test]
    fn segments_round_trip_and_locate_the_frame_bytes() {
        let segments = [
            Segment {
                addr: 0,
                rkey: 1,
                len: 40,
            },
            Segment {
                addr: 0x10_0000,
                rkey: 2,
                len: 1000,
            },
            Segment {
                addr: 40,
                rkey: 1,
                len: 3,
            },
        ];
        let a = Announcement::new([7; ANNOUNCE_PREFIX_LEN], &segments);
        let mut body = vec![0; a.encoded_len()];
        a.encode(&mut body);
        let decoded = Announcement::decode(&body).expect("decodes");
        assert_eq!(decoded.segments(), &segments);
        assert_eq!(decoded.frame_len(), 1043);
        assert_eq!(a.locate(0), Some((0, 1, 40)));
        assert_eq!(a.locate(39), Some((39, 1, 1)));
        assert_eq!(a.locate(40), Some((0x10_0000, 2, 1000)));
        assert_eq!(a.locate(1039), Some((0x10_0000 + 999, 2, 1)));
        assert_eq!(a.locate(1040), Some((40, 1, 3)));
        assert_eq!(a.locate(1042), Some((42, 1, 1)));
        assert_eq!(a.locate(1043), None);
        let most = [segments[0]; MAX_SEGMENTS];
        let mut body = vec![0; announce_body_len(MAX_SEGMENTS + 1)];
        Announcement::new([0; ANNOUNCE_PREFIX_LEN], &most).encode(&mut body);
        assert!(Announcement::decode(&body[..ANNOUNCE_BODY_MAX]).is_ok());
        assert!(
            Announcement::decode(&body).is_err(),
            "more than {MAX_SEGMENTS} segments"
        );
    }
}
