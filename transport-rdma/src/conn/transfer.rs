//! The memory of our rendezvous transfers: what the peer RDMA READs,
//! registered for remote read (never write) until its `Done`.
//!
//! A frame handed to the sink as an [`OutFrame`] is gathered: each large
//! [`Bytes`] in it (a tensor field) is registered where the application
//! left it, with no copy; the frame's head and small fields before it go in
//! the announcement itself, small fields after one are copied into a
//! registration of their own; the announcement lists the pieces in order.
//! Other frames (a byte stream's, or one whose pieces would not fit an
//! announcement) are encoded into one registration.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{BufMut, Bytes};
use rpc_core::frame::{Gather, OutFrame, GATHER_THRESHOLD};

use super::payloads::PayloadPool;
use crate::proto::{
    announce_body_len, Announcement, FrameBytes, Segment, WorkKind, ANNOUNCE_PREFIX_LEN,
    MAX_SEGMENTS,
};
use crate::verbs::{
    self, Access, MemoryRegion, MemoryWindow, ProtectionDomain, QueuePair, RegisteredBytes,
};

/// `Bytes` of a frame at least this long are registered where they lie;
/// shorter ones are copied. The same as [`GATHER_THRESHOLD`]: every
/// `Bytes` a frame holds by reference. In a Soft-RoCE guest registering
/// 32 KiB in place took 52–76 µs against 82–107 µs for copying it into a
/// fresh registration, and the gap grows with the size
/// (`docs/benchmarks.md`).
pub const REGISTER_IN_PLACE_MIN: usize = GATHER_THRESHOLD;

/// Bytes of rendezvous frames this process sent from where the
/// application left them, and copied into registered memory first.
static SENT_IN_PLACE: AtomicU64 = AtomicU64::new(0);
static SENT_COPIED: AtomicU64 = AtomicU64::new(0);
/// Bytes of rendezvous frames read out of payload buffers (through a
/// memory window: neither copied nor registered for the call).
static SENT_FROM_POOL: AtomicU64 = AtomicU64::new(0);

/// Bytes of rendezvous frames this process has sent: `(in_place, copied)`.
/// `in_place` were read by the peer straight out of the application's own
/// `Bytes`, registered for the transfer (those in payload buffers are
/// counted by [`rendezvous_bytes_sent_from_pool`] instead); `copied` were copied into memory registered for the transfer
/// (frame heads and small fields, and frames not gathered).
pub fn rendezvous_bytes_sent() -> (u64, u64) {
    (
        SENT_IN_PLACE.load(Ordering::Relaxed),
        SENT_COPIED.load(Ordering::Relaxed),
    )
}

/// Bytes of rendezvous frames this process has sent out of payload
/// buffers ([`rpc_core::PayloadBuffer`] from a connection's pool), read by
/// the peer through a memory window: no copy and no registration per call.
pub fn rendezvous_bytes_sent_from_pool() -> u64 {
    SENT_FROM_POOL.load(Ordering::Relaxed)
}

/// A memory window on `pd`, or `None` (logged once per process) if the
/// device has none to give.
fn window_or_log(pd: &ProtectionDomain) -> Option<MemoryWindow> {
    static LOGGED: std::sync::Once = std::sync::Once::new();
    MemoryWindow::new(pd)
        .inspect_err(|e| {
            LOGGED.call_once(|| {
                tracing::warn!(
                    "payload buffers are registered per transfer instead of read through a \
                     memory window: {e}"
                )
            })
        })
        .ok()
}

/// How memory registered for a transfer on `pd` is made readable: on a
/// shared protection domain only through windows (bound to the
/// connection's queue pair), else by the registration itself.
fn read_access(pd: &ProtectionDomain) -> Access {
    if pd.is_shared() {
        Access::LOCAL_WRITE | Access::MW_BIND
    } else {
        Access::LOCAL_WRITE | Access::REMOTE_READ
    }
}

/// `frame`'s bytes as [`Gather`] keeps them: each large `Bytes` by
/// reference, the small bytes between them copied.
pub(crate) fn pieces(frame: &OutFrame<'_>) -> FrameBytes {
    let mut gather = Gather::new();
    frame.gather(&mut gather);
    let (mut pieces, tail) = gather.into_parts();
    pieces.push(tail.freeze());
    FrameBytes::new(pieces)
}

/// One of our transfers: its announcement, the head it carries, and the
/// registrations the peer reads the rest from.
pub(crate) struct OutgoingTransfer {
    /// The windows the peer reads through, bound once the frame is queued
    /// ([`bind_windows`](Self::bind_windows)): over the pieces in payload
    /// buffers, and on a shared protection domain over everything
    /// announced. Dropped first: deallocating them ends the peer's access,
    /// and a registration with a window bound to it cannot be deregistered.
    windows: Vec<WindowedPiece>,
    announcement: Announcement,
    /// The frame's first bytes, sent in the announcement.
    head: Vec<u8>,
    /// The bytes copied: the whole frame, or small fields after a large one.
    copied: Option<MemoryRegion>,
    /// Its large `Bytes`, registered where they lie.
    in_place: Vec<RegisteredBytes>,
}

/// An announced segment of a frame, and the window the peer reads it
/// through.
struct WindowedPiece {
    window: MemoryWindow,
    over: WindowOver,
    /// The announcement's segment for it.
    segment: usize,
}

/// What a window is bound over.
enum WindowOver {
    /// Bytes in a payload buffer (the piece less what went in the head);
    /// they keep the buffer out of the pool until the window is gone.
    Pool(Bytes),
    /// A range of the transfer's copied bytes.
    Copied(Range<usize>),
    /// A range of one of its in-place registrations.
    InPlace(usize, Range<usize>),
}

impl OutgoingTransfer {
    /// The frame of `len` bytes `encode` writes, copied into memory
    /// registered for this transfer (the announcement carries its prefix).
    pub(crate) fn encoded(
        pd: &ProtectionDomain,
        len: usize,
        encode: impl FnOnce(&mut dyn BufMut),
    ) -> Result<OutgoingTransfer, verbs::Error> {
        let mr = MemoryRegion::new(pd, len, read_access(pd))?;
        {
            // SAFETY: just registered and not announced: no request uses
            // it and no other slice covers it.
            let mut dst = unsafe { mr.slice_mut(0..len) };
            encode(&mut dst);
        }
        let mut prefix = [0; ANNOUNCE_PREFIX_LEN];
        mr.read_into(0, &mut prefix);
        let remote = mr.remote();
        let segment = Segment {
            addr: remote.addr + ANNOUNCE_PREFIX_LEN as u64,
            rkey: remote.rkey,
            len: u32::try_from(len - ANNOUNCE_PREFIX_LEN)
                .expect("a rendezvous frame's length fits its header"),
        };
        let windows = if pd.is_shared() {
            vec![WindowedPiece {
                window: MemoryWindow::new(pd)?,
                over: WindowOver::Copied(ANNOUNCE_PREFIX_LEN..len),
                segment: 0,
            }]
        } else {
            Vec::new()
        };
        SENT_COPIED.fetch_add(len as u64, Ordering::Relaxed);
        Ok(OutgoingTransfer {
            windows,
            announcement: Announcement::new(ANNOUNCE_PREFIX_LEN, prefix, &[segment]),
            head: prefix.to_vec(),
            copied: Some(mr),
            in_place: Vec::new(),
        })
    }

    /// `frame` gathered: its head and small fields up to its first large
    /// `Bytes` sent in the announcement, each large `Bytes` registered
    /// where it lies, small fields after one copied into a registration of
    /// their own. Copied whole into one registration instead when it has no
    /// large `Bytes`, or the announcement would not fit `room` bytes (the
    /// peer's slot). A large `Bytes` in a buffer of `pool` is not
    /// registered: a window over it is bound before the announcement goes
    /// ([`bind_windows`](Self::bind_windows)).
    pub(crate) fn gathered(
        pd: &ProtectionDomain,
        pool: Option<&PayloadPool>,
        frame: &OutFrame<'_>,
        room: usize,
    ) -> Result<OutgoingTransfer, verbs::Error> {
        let gathered = pieces(frame);
        let pieces = gathered.pieces();
        // Copied as gathered, not encoded again.
        let copy_all = |dst: &mut dyn BufMut| {
            for piece in pieces {
                dst.put_slice(piece);
            }
        };
        let in_place = |p: &Bytes| p.len() >= REGISTER_IN_PLACE_MIN;
        let Some(first_large) = pieces.iter().position(in_place) else {
            return Self::encoded(pd, frame.len(), copy_all);
        };
        let head_len = pieces[..first_large]
            .iter()
            .map(Bytes::len)
            .sum::<usize>()
            .max(ANNOUNCE_PREFIX_LEN);
        let rest = &pieces[first_large..];
        // A segment per large piece and per run of small ones after one.
        let segments = rest
            .iter()
            .enumerate()
            .filter(|&(i, p)| in_place(p) || in_place(&rest[i - 1]))
            .count();
        if segments > MAX_SEGMENTS || announce_body_len(segments, head_len) > room {
            return Self::encoded(pd, frame.len(), copy_all);
        }
        let copied_len: usize = rest.iter().filter(|p| !in_place(p)).map(Bytes::len).sum();
        let copied = if copied_len > 0 {
            Some(MemoryRegion::new(pd, copied_len, read_access(pd))?)
        } else {
            None
        };
        let mut head = Vec::with_capacity(head_len);
        for piece in pieces[..first_large].iter() {
            head.extend_from_slice(piece);
        }
        let mut registered = Vec::new();
        let mut windows = Vec::new();
        let mut listed: Vec<Segment> = Vec::with_capacity(segments);
        let (mut at, mut after_copied) = (0, false);
        // The copied runs' segments, and where each starts in `copied`.
        let mut copied_segments = Vec::new();
        for piece in rest {
            if in_place(piece) {
                // A head shorter than the prefix takes the first bytes of
                // the first large piece (it is far longer than that).
                let skip = head_len - head.len();
                head.extend_from_slice(&piece[..skip]);
                let len = u32::try_from(piece.len() - skip).expect("a piece fits a frame");
                // A device without memory windows reads payload buffers
                // as any `Bytes`: registered for the transfer.
                let window = pool
                    .filter(|pool| pool.holds(piece))
                    .and_then(|_| window_or_log(pd));
                if let Some(window) = window {
                    windows.push(WindowedPiece {
                        window,
                        over: WindowOver::Pool(piece.slice(skip..)),
                        segment: listed.len(),
                    });
                    // Where and under which key: once bound.
                    listed.push(Segment {
                        addr: 0,
                        rkey: 0,
                        len,
                    });
                } else if pd.is_shared() {
                    let bytes = RegisteredBytes::readable_through_windows(pd, piece.clone())?;
                    windows.push(WindowedPiece {
                        window: MemoryWindow::new(pd)?,
                        over: WindowOver::InPlace(registered.len(), skip..piece.len()),
                        segment: listed.len(),
                    });
                    listed.push(Segment {
                        addr: 0,
                        rkey: 0,
                        len,
                    });
                    registered.push(bytes);
                } else {
                    let bytes = RegisteredBytes::new(pd, piece.clone())?;
                    let remote = bytes.remote();
                    listed.push(Segment {
                        addr: remote.addr + skip as u64,
                        rkey: remote.rkey,
                        len,
                    });
                    registered.push(bytes);
                }
                after_copied = false;
            } else {
                let mr = copied.as_ref().expect("registered for the small pieces");
                // Not announced yet: no request reads it.
                mr.write_at(at, piece);
                let len = u32::try_from(piece.len()).expect("a piece fits a frame");
                match listed.last_mut() {
                    Some(last) if after_copied => last.len += len,
                    _ => {
                        copied_segments.push((listed.len(), at));
                        let remote = mr.remote();
                        listed.push(Segment {
                            addr: remote.addr + at as u64,
                            rkey: remote.rkey,
                            len,
                        });
                    }
                }
                at += piece.len();
                after_copied = true;
            }
        }
        if pd.is_shared() {
            for (segment, start) in copied_segments {
                windows.push(WindowedPiece {
                    window: MemoryWindow::new(pd)?,
                    over: WindowOver::Copied(start..start + listed[segment].len as usize),
                    segment,
                });
            }
        }
        let prefix = head[..ANNOUNCE_PREFIX_LEN].try_into().expect("the prefix");
        let announcement = Announcement::new(head_len, prefix, &listed);
        assert_eq!(
            announcement.frame_len(),
            frame.len() as u64,
            "a gathered frame's length"
        );
        let copied_bytes = (head_len + copied_len) as u64;
        SENT_COPIED.fetch_add(copied_bytes, Ordering::Relaxed);
        let from_pool = windows
            .iter()
            .map(|w| match &w.over {
                WindowOver::Pool(bytes) => bytes.len() as u64,
                _ => 0,
            })
            .sum::<u64>();
        SENT_IN_PLACE.fetch_add(
            frame.len() as u64 - copied_bytes - from_pool,
            Ordering::Relaxed,
        );
        SENT_FROM_POOL.fetch_add(from_pool, Ordering::Relaxed);
        Ok(OutgoingTransfer {
            windows,
            announcement,
            head,
            copied,
            in_place: registered,
        })
    }

    /// Binds each window on `qp`, and puts where the peer reads its bytes
    /// in the announcement. Call once the frame is queued, before its
    /// announcement is encoded and posted: the binds go first on the send
    /// queue.
    pub(crate) fn bind_windows(
        &mut self,
        pool: Option<&PayloadPool>,
        qp: &mut QueuePair,
    ) -> Result<(), verbs::Error> {
        let wr_id = WorkKind::Bind.wr_id(0);
        for piece in &self.windows {
            // SAFETY: each window is over bytes never written again: a
            // frozen payload buffer (`Bytes`, immutable), the copy made for
            // this transfer (written before it is announced), or `Bytes`
            // registered where they lie; this transfer holds them and the
            // windows, dropping the windows first.
            let remote = unsafe {
                match &piece.over {
                    WindowOver::Pool(bytes) => pool
                        .expect("pieces in payload buffers come with their pool")
                        .bind(qp, &piece.window, bytes)?,
                    WindowOver::Copied(range) => qp.post_bind(
                        wr_id,
                        &piece.window,
                        self.copied.as_ref().expect("a copy to bind over"),
                        range.clone(),
                        Access::REMOTE_READ,
                    )?,
                    WindowOver::InPlace(registered, range) => qp.bind(
                        wr_id,
                        &piece.window,
                        self.in_place[*registered].bind_target(range.clone())?,
                        Access::REMOTE_READ,
                    )?,
                }
            };
            self.announcement
                .bind_segment(piece.segment, remote.addr, remote.rkey);
        }
        Ok(())
    }

    /// What the peer is told: where the frame's bytes lie.
    pub(crate) fn announcement(&self) -> &Announcement {
        &self.announcement
    }

    /// Writes the announcement's body (its counts, segments and the
    /// frame's head) into `body`, of exactly its encoded length.
    pub(crate) fn encode_announcement(&self, body: &mut [u8]) {
        let at = self.announcement.head_offset();
        self.announcement.encode(&mut body[..at]);
        body[at..].copy_from_slice(&self.head);
    }
}
