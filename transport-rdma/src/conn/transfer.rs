//! The memory of our rendezvous transfers: what the peer RDMA READs,
//! registered for remote read (never write) until its `Done`.
//!
//! A frame handed to the sink as an [`OutFrame`] is gathered: each large
//! [`Bytes`] in it (a tensor field) is registered where the application
//! left it, with no copy, and the frame's head and small fields are copied
//! into one registration of their own; the announcement lists the pieces in
//! order. Other frames (a byte stream's, or one whose pieces would not fit
//! an announcement) are encoded into one registration.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{BufMut, Bytes};
use rpc_core::frame::{Gather, OutFrame};

use crate::proto::{Announcement, Segment, ANNOUNCE_PREFIX_LEN};
use crate::verbs::{self, Access, MemoryRegion, ProtectionDomain, RegisteredBytes};

/// `Bytes` of a frame at least this long are registered where they lie;
/// shorter ones are copied with the frame's head. Registering costs a
/// system call and pins pages; below this a copy is cheaper.
pub const REGISTER_IN_PLACE_MIN: usize = 64 << 10;

/// Bytes of rendezvous frames this process sent from where the
/// application left them, and copied into registered memory first.
static SENT_IN_PLACE: AtomicU64 = AtomicU64::new(0);
static SENT_COPIED: AtomicU64 = AtomicU64::new(0);

/// Bytes of rendezvous frames this process has sent: `(in_place, copied)`.
/// `in_place` were read by the peer straight out of the application's own
/// `Bytes`; `copied` were copied into memory registered for the transfer
/// (frame heads and small fields, and frames not gathered).
pub fn rendezvous_bytes_sent() -> (u64, u64) {
    (
        SENT_IN_PLACE.load(Ordering::Relaxed),
        SENT_COPIED.load(Ordering::Relaxed),
    )
}

/// One of our transfers' registrations and its announcement.
pub(crate) struct OutgoingTransfer {
    /// The bytes copied: the whole frame, or its head and small fields.
    _copied: Option<MemoryRegion>,
    /// Its large `Bytes`, registered where they lie.
    _in_place: Vec<RegisteredBytes>,
    announcement: Announcement,
}

impl OutgoingTransfer {
    /// The frame of `len` bytes `encode` writes, copied into memory
    /// registered for this transfer.
    pub(crate) fn encoded(
        pd: &ProtectionDomain,
        len: usize,
        encode: impl FnOnce(&mut dyn BufMut),
    ) -> Result<OutgoingTransfer, verbs::Error> {
        let mr = MemoryRegion::new(pd, len, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
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
            addr: remote.addr,
            rkey: remote.rkey,
            len: u32::try_from(len).expect("a rendezvous frame's length fits its header"),
        };
        SENT_COPIED.fetch_add(len as u64, Ordering::Relaxed);
        Ok(OutgoingTransfer {
            _copied: Some(mr),
            _in_place: Vec::new(),
            announcement: Announcement::new(prefix, &[segment]),
        })
    }

    /// `frame` gathered: its large `Bytes` registered where they lie, the
    /// rest copied into one registration; encoded as a whole instead when
    /// it has no large `Bytes`, or its pieces would take more than
    /// `max_segments` segments.
    pub(crate) fn gathered(
        pd: &ProtectionDomain,
        frame: &OutFrame<'_>,
        max_segments: usize,
    ) -> Result<OutgoingTransfer, verbs::Error> {
        let mut gather = Gather::new();
        frame.gather(&mut gather);
        let (mut pieces, tail) = gather.into_parts();
        pieces.push(tail.freeze());
        pieces.retain(|p| !p.is_empty());
        let in_place = |p: &Bytes| p.len() >= REGISTER_IN_PLACE_MIN;
        // A segment per large piece and per run of small ones between.
        let segments = pieces
            .iter()
            .enumerate()
            .filter(|&(i, p)| in_place(p) || i == 0 || in_place(&pieces[i - 1]))
            .count();
        if !pieces.iter().any(in_place) || segments > max_segments {
            return Self::encoded(pd, frame.len(), |dst| frame.encode(dst));
        }
        let copied_len: usize = pieces.iter().filter(|p| !in_place(p)).map(Bytes::len).sum();
        let copied = if copied_len > 0 {
            Some(MemoryRegion::new(
                pd,
                copied_len,
                Access::LOCAL_WRITE | Access::REMOTE_READ,
            )?)
        } else {
            None
        };
        let mut registered = Vec::new();
        let mut listed: Vec<Segment> = Vec::with_capacity(segments);
        let mut prefix = [0; ANNOUNCE_PREFIX_LEN];
        let (mut at, mut sent) = (0, 0);
        let mut after_copied = false;
        for piece in &pieces {
            if sent < ANNOUNCE_PREFIX_LEN {
                let n = piece.len().min(ANNOUNCE_PREFIX_LEN - sent);
                prefix[sent..sent + n].copy_from_slice(&piece[..n]);
            }
            let len = u32::try_from(piece.len()).expect("a piece of a frame fits its header");
            if in_place(piece) {
                let bytes = RegisteredBytes::new(pd, piece.clone())?;
                let remote = bytes.remote();
                listed.push(Segment {
                    addr: remote.addr,
                    rkey: remote.rkey,
                    len,
                });
                registered.push(bytes);
                after_copied = false;
            } else {
                let mr = copied.as_ref().expect("registered for the small pieces");
                // Not announced yet: no request reads it.
                mr.write_at(at, piece);
                match listed.last_mut() {
                    Some(last) if after_copied => last.len += len,
                    _ => {
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
            sent += piece.len();
        }
        assert_eq!(sent, frame.len(), "a gathered frame's length");
        debug_assert_eq!(listed.len(), segments);
        SENT_COPIED.fetch_add(copied_len as u64, Ordering::Relaxed);
        SENT_IN_PLACE.fetch_add((sent - copied_len) as u64, Ordering::Relaxed);
        Ok(OutgoingTransfer {
            _copied: copied,
            _in_place: registered,
            announcement: Announcement::new(prefix, &listed),
        })
    }

    /// What the peer is told: the frame's prefix and where its bytes lie.
    pub(crate) fn announcement(&self) -> &Announcement {
        &self.announcement
    }
}
