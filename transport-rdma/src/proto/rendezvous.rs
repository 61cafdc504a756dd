//! The rendezvous for large frames: the wire format of an announcement,
//! the settings, and the accounting both ends keep (the state machine
//! itself is [`Connection`](super::Connection)'s).
//!
//! A frame at or above the sender's threshold starts with a *head* (at
//! least [`ANNOUNCE_PREFIX_LEN`] bytes: the frame's head and the small
//! fields before its first large payload) that travels in the
//! announcement; the rest lies in memory the sender registers for this
//! transfer only, with remote *read* access (never write), in up to
//! [`MAX_SEGMENTS`] segments: the rest of the frame encoded into one
//! registration, or each large payload registered where the application
//! left it (small fields after one copied into a registration of their
//! own). The sender SENDs an `Announce` message: the header (`len` = the
//! frame's length, `pos` = a transfer id the sender picks, unique among
//! its transfers in flight) and an [`Announcement`] body (the head's
//! length and the segment count, each segment's address, rkey and length
//! in the frame's order, then the head; all of it fits the receiver's
//! slot). The receiver takes a destination of `len` bytes from its own
//! bounded pool (local write only), copies the head to its start, RDMA
//! READs the segments into the rest in pieces of at most
//! [`RendezvousConfig::read_chunk`] (a READ never spans two segments),
//! [`RendezvousConfig::read_depth`] at a time, answers `Done` (`pos` = the
//! transfer id) once every READ completed, and hands the frame up over the
//! destination. On `Done` the sender deregisters the segments: remote
//! access to them ends.
//!
//! Bounds: the sender's device checks every READ against the rkey's
//! registration (its address range and its access rights), so a receiver
//! reads nothing else; the head and the segments must add up to the
//! announced length exactly, and the receiver's READs land in a
//! destination of that length, each within it. An announcement holds its
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

/// Bytes of the frame's start every announcement carries at least: they
/// name its call (the receiver orders and reports frames by them).
pub const ANNOUNCE_PREFIX_LEN: usize = 32;
/// Most segments an announcement lists.
pub const MAX_SEGMENTS: usize = 8;
/// Encoded length of one [`Segment`].
pub const SEGMENT_LEN: usize = 16;
/// Encoded length of the counts that start an announcement's body.
const COUNTS_LEN: usize = 8;
/// Length of an announcement's body listing `segments` segments and
/// carrying a head of `head` bytes: `head_len: u32, segments: u32`, each
/// segment's `addr: u64, rkey: u32, len: u32`, then the head.
pub const fn announce_body_len(segments: usize, head: usize) -> usize {
    COUNTS_LEN + segments * SEGMENT_LEN + head
}
/// The bytes of a received message the verbs layer copies out of its slot
/// for the protocol ([`Completion::header`](super::Completion::header)):
/// the header, and an announcement's counts, segments and prefix (the rest
/// of its head stays in the slot until it is copied into the frame's
/// destination).
pub const PEEK_LEN: usize =
    super::HEADER_LEN + announce_body_len(MAX_SEGMENTS, ANNOUNCE_PREFIX_LEN);
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

/// What an `Announce` message's body says: how many of the frame's first
/// bytes it carries itself (its *head*: the frame's head and small fields,
/// at least [`ANNOUNCE_PREFIX_LEN`] bytes), and where the rest lies in the
/// sender's memory, in order: one segment when the sender copied the frame
/// into memory of its own, several when it registered large payloads where
/// the application left them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Announcement {
    /// Bytes of the frame carried in the announcement, after the segments.
    pub head_len: u32,
    /// The frame's first bytes (the start of the head).
    pub prefix: [u8; ANNOUNCE_PREFIX_LEN],
    segments: [Segment; MAX_SEGMENTS],
    count: u8,
}

impl Announcement {
    /// An announcement of a frame whose first `head_len` bytes (at least
    /// [`ANNOUNCE_PREFIX_LEN`], starting with `prefix`) it carries, and the
    /// rest lies in `segments` (1 to [`MAX_SEGMENTS`], none empty). Panics
    /// otherwise.
    pub fn new(
        head_len: usize,
        prefix: [u8; ANNOUNCE_PREFIX_LEN],
        segments: &[Segment],
    ) -> Announcement {
        assert!(
            head_len >= ANNOUNCE_PREFIX_LEN,
            "an announcement carries at least the frame's prefix"
        );
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
            head_len: u32::try_from(head_len).expect("a head fits a slot"),
            prefix,
            segments: all,
            count: segments.len() as u8,
        }
    }

    /// Sets where segment `index` lies and under which key (the sender's
    /// memory windows are bound after the announcement is built). Panics
    /// if there is no such segment.
    pub fn bind_segment(&mut self, index: usize, addr: u64, rkey: u32) {
        let segment = &mut self.segments[..usize::from(self.count)][index];
        segment.addr = addr;
        segment.rkey = rkey;
    }

    /// The segments, in the frame's order (after the head).
    pub fn segments(&self) -> &[Segment] {
        &self.segments[..self.count as usize]
    }

    /// The frame's length: its head's and its segments' added up.
    pub fn frame_len(&self) -> u64 {
        u64::from(self.head_len)
            + self
                .segments()
                .iter()
                .map(|s| u64::from(s.len))
                .sum::<u64>()
    }

    /// Where the head starts in the body.
    pub fn head_offset(&self) -> usize {
        announce_body_len(self.count as usize, 0)
    }

    /// Length of the encoded body, head included.
    pub fn encoded_len(&self) -> usize {
        announce_body_len(self.count as usize, self.head_len as usize)
    }

    /// Encodes the counts and the segments into `out` (at least
    /// [`head_offset`](Self::head_offset) bytes); the head's bytes go
    /// after them, from `head_offset` on.
    pub fn encode(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&self.head_len.to_le_bytes());
        out[4..8].copy_from_slice(&u32::from(self.count).to_le_bytes());
        for (s, out) in self
            .segments()
            .iter()
            .zip(out[COUNTS_LEN..].chunks_exact_mut(SEGMENT_LEN))
        {
            out[..8].copy_from_slice(&s.addr.to_le_bytes());
            out[8..12].copy_from_slice(&s.rkey.to_le_bytes());
            out[12..16].copy_from_slice(&s.len.to_le_bytes());
        }
    }

    /// Decodes the body of an announcement `body_len` bytes long, of which
    /// `body` holds the first (at least the counts, segments and prefix).
    pub fn decode(body: &[u8], body_len: usize) -> Result<Announcement, ProtocolError> {
        let u32_at = |at: usize| {
            body.get(at..at + 4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
        };
        let (Some(head_len), Some(count)) = (u32_at(0), u32_at(4)) else {
            return Err(ProtocolError::new(format!(
                "announcement body of {body_len} bytes, too short for its counts"
            )));
        };
        let count = count as usize;
        if !(1..=MAX_SEGMENTS).contains(&count) {
            return Err(ProtocolError::new(format!(
                "announcement of {count} segments, not 1 to {MAX_SEGMENTS}"
            )));
        }
        if (head_len as usize) < ANNOUNCE_PREFIX_LEN
            || announce_body_len(count, head_len as usize) != body_len
        {
            return Err(ProtocolError::new(format!(
                "announcement body of {body_len} bytes, not {count} segments and a head of \
                 {head_len} bytes (at least {ANNOUNCE_PREFIX_LEN})"
            )));
        }
        let head_at = announce_body_len(count, 0);
        let Some(prefix) = body.get(head_at..head_at + ANNOUNCE_PREFIX_LEN) else {
            return Err(ProtocolError::new("announcement cut short of its prefix"));
        };
        let mut segments = [Segment::default(); MAX_SEGMENTS];
        for (s, b) in segments[..count]
            .iter_mut()
            .zip(body[COUNTS_LEN..head_at].chunks_exact(SEGMENT_LEN))
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
            head_len,
            prefix: prefix.try_into().expect("the prefix"),
            segments,
            count: count as u8,
        })
    }

    /// Where the frame's byte `offset` (past the head) lies: the sender's
    /// address of it, its segment's rkey, and how many bytes of that
    /// segment follow it (from it on). `None` in the head or past the
    /// frame's end.
    pub fn locate(&self, offset: usize) -> Option<(u64, u32, usize)> {
        let mut start = self.head_len as usize;
        if offset < start {
            return None;
        }
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

/// Where a connection's destinations for the peer's transfers are charged:
/// its own budget ([`OwnPool`], the default), or a pool its transport's
/// connections share (the transport's, in `conn`), first come first served.
pub trait PoolRoom: Send + std::fmt::Debug {
    /// Charges `charge` bytes if the pool has room for them now, for this
    /// connection's oldest transfer waiting. `false`: none yet; the
    /// connection tries again after [`room_freed`](Self::room_freed).
    fn try_take(&mut self, charge: u64) -> bool;
    /// Gives back `charge` bytes this connection took.
    fn give_back(&mut self, charge: u64);
    /// Room may have come since a [`try_take`](Self::try_take) failed.
    fn room_freed(&mut self) {}
    /// The most bytes the pool charges at once.
    fn budget(&self) -> u64;
}

/// A budget of the connection's own.
#[derive(Debug)]
pub struct OwnPool {
    budget: u64,
    in_use: u64,
}

impl OwnPool {
    /// A pool of `budget` bytes, none charged.
    pub fn new(budget: u64) -> OwnPool {
        OwnPool { budget, in_use: 0 }
    }
}

impl PoolRoom for OwnPool {
    fn try_take(&mut self, charge: u64) -> bool {
        let fits = self.in_use + charge <= self.budget;
        if fits {
            self.in_use += charge;
        }
        fits
    }

    fn give_back(&mut self, charge: u64) {
        self.in_use = self.in_use.saturating_sub(charge);
    }

    fn budget(&self) -> u64 {
        self.budget
    }
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
    /// Bytes of body an announcement of ours may take: what the peer's
    /// receive slot holds after the header.
    pub announce_room: usize,
}

impl RendezvousConfig {
    /// No rendezvous either way.
    pub const OFF: RendezvousConfig = RendezvousConfig {
        threshold: None,
        pool_bytes: 0,
        read_chunk: 1 << 20,
        read_depth: 1,
        max_outgoing: 1,
        announce_room: announce_body_len(1, ANNOUNCE_PREFIX_LEN),
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
    /// The receive slot holding its announcement (and head).
    pub(super) slot: u32,
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

    fn encoded(a: &Announcement, head: &[u8]) -> Vec<u8> {
        let mut body = vec![0; a.encoded_len()];
        a.encode(&mut body);
        body[a.head_offset()..].copy_from_slice(head);
        body
    }

    #[test]
    fn announcement_round_trip_and_checks() {
        let mut head = [0; 40];
        head[4] = 9;
        let segment = Segment {
            addr: 0x1234,
            rkey: 77,
            len: 4096,
        };
        let prefix = head[..ANNOUNCE_PREFIX_LEN].try_into().unwrap();
        let a = Announcement::new(40, prefix, &[segment]);
        let body = encoded(&a, &head);
        assert_eq!(body.len(), 8 + SEGMENT_LEN + 40);
        assert_eq!(Announcement::decode(&body, body.len()), Ok(a));
        assert_eq!(a.frame_len(), 4136);
        assert_eq!(lane(&a.prefix), Some(9));
        assert_eq!(lane(&[0; 11]), None);
        // Only the counts, segments and prefix need to have been peeked.
        assert_eq!(
            Announcement::decode(&body[..8 + 16 + 32], body.len()),
            Ok(a)
        );
        assert!(Announcement::decode(&body[..8 + 16 + 31], body.len()).is_err());
        assert!(Announcement::decode(&body[..6], body.len()).is_err());
        // The length must be the counts', no more, no less.
        assert!(Announcement::decode(&body, body.len() + 1).is_err());
        assert!(Announcement::decode(&body, body.len() - 1).is_err());
        let mut bad = body.clone();
        bad[4] = 0;
        assert!(Announcement::decode(&bad, bad.len()).is_err(), "no segment");
        bad[4] = MAX_SEGMENTS as u8 + 1;
        assert!(Announcement::decode(&bad, bad.len()).is_err(), "too many");
        let mut short_head = body.clone();
        short_head[..4].copy_from_slice(&31u32.to_le_bytes());
        assert!(
            Announcement::decode(&short_head, short_head.len() - 9).is_err(),
            "a head shorter than the prefix"
        );
        let mut empty = body.clone();
        empty[8 + 12..8 + 16].fill(0);
        assert!(
            Announcement::decode(&empty, empty.len()).is_err(),
            "an empty segment"
        );
        assert_eq!(pool_charge(1), 4096);
        assert_eq!(pool_charge(4096), 4096);
        assert_eq!(pool_charge(4097), 8192);
    }

    #[test]
    fn segments_round_trip_and_locate_the_bytes_past_the_head() {
        let segments = [
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
        let a = Announcement::new(40, [7; ANNOUNCE_PREFIX_LEN], &segments);
        let body = encoded(&a, &[7; 40]);
        let decoded = Announcement::decode(&body, body.len()).expect("decodes");
        assert_eq!(decoded.segments(), &segments);
        assert_eq!(decoded.frame_len(), 1043);
        assert_eq!(a.locate(0), None, "in the head");
        assert_eq!(a.locate(39), None, "in the head");
        assert_eq!(a.locate(40), Some((0x10_0000, 2, 1000)));
        assert_eq!(a.locate(1039), Some((0x10_0000 + 999, 2, 1)));
        assert_eq!(a.locate(1040), Some((40, 1, 3)));
        assert_eq!(a.locate(1042), Some((42, 1, 1)));
        assert_eq!(a.locate(1043), None);
        let most = [segments[0]; MAX_SEGMENTS];
        let a = Announcement::new(32, [0; ANNOUNCE_PREFIX_LEN], &most);
        let body = encoded(&a, &[0; 32]);
        assert_eq!(body.len() + super::super::HEADER_LEN, PEEK_LEN);
        assert!(Announcement::decode(&body, body.len()).is_ok());
    }
}
