//! TCP's byte stream cut into frames, with no I/O in it.
//!
//! Each frame is a 4-byte little-endian length and that many bytes. A
//! frame larger than [`PIECE_LEN`] goes in pieces instead, so that small
//! frames can pass it: a piece is a 4-byte little-endian length with the
//! [`PIECE`] bit set and that many bytes of a second stream of frames,
//! the *bulk stream*, made the same way (length, frame). Pieces carry the
//! bulk stream in order; the connection's own frames go between them.
//! [`FrameReader`] holds what arrived, hands each whole frame out as a
//! [`Bytes`] (a slice of its buffer, no copy, above [`COPY_UP_TO`] bytes; a
//! copy of it up to that), skips frames over the limit as
//! they arrive, and decides how much to read next so that **memory follows
//! the bytes that arrived, never the length a peer announced**: each read
//! asks for at most as many bytes again as have arrived, so a partial
//! frame's buffer grows geometrically with real bytes (capacity ≤ 4 × bytes
//! received + 2 × [`READ_CHUNK`] for each of the two streams, and ≤ 2 ×
//! the frame's length) — unless
//! the caller, having claimed a large frame's length from a budget of its
//! own, has room made for all of it ([`FrameReader::reserve_frame`]).
//!
//! ```
//! use rpc_core::transport::FrameLimits;
//! use transport_tcp::reader::FrameReader;
//!
//! let mut reader = FrameReader::new(FrameLimits { max_frame_len: 1 << 20 });
//! reader.extend_from_slice(&[3, 0, 0, 0, b'a', b'b']);
//! assert_eq!(reader.next_frame().unwrap(), None); // one byte short
//! reader.extend_from_slice(b"c");
//! assert_eq!(reader.next_frame().unwrap().unwrap(), "abc");
//! ```

use std::sync::Arc;
use std::{io, mem};

use bytes::{Buf, Bytes, BytesMut};
use rpc_core::kept::KeptBuffers;
use rpc_core::transport::{FrameLimits, TransportError, OVERSIZED_PREFIX_LEN};

/// Bytes asked of the socket per read when no partial frame needs more.
/// Frames up to this size never need the process's read budget.
pub const READ_CHUNK: usize = 64 * 1024;

const PREFIX_LEN: usize = 4;

/// The bit of a length prefix that makes it a piece's header: its other
/// 31 bits are the piece's length.
pub const PIECE: u32 = 1 << 31;

/// Frames larger than this go in pieces: 64 KiB while small frames go
/// between them, 1 MiB while none do. A small frame waits behind at most
/// one piece or one frame this large (and what the socket holds unsent).
/// A receiver takes pieces of any length. Smaller pieces cost more reads
/// and writes: in 64 KiB pieces, a 1 MiB echo took 15× the user-space
/// instructions of one in 256 KiB pieces (hence the large pieces while
/// nothing needs to pass).
pub const PIECE_LEN: usize = 256 * 1024;

/// Frames up to this length are copied out of the buffer rather than
/// handed out as slices of it. A slice shares the buffer: while the frame
/// lives (a handler holds its request) the next read cannot reuse the
/// buffer and allocates a new one, and a small frame kept for long pins a
/// whole read buffer. Copying frames up to 4 KiB made a 1 KiB echo call
/// −420 instructions (18,598 → 18,177, `cargo xtask bench --instructions`),
/// hence 4096. The copies go into a small shared buffer of their own
/// ([`SMALL_FRAMES`]), not into an allocation each.
pub const COPY_UP_TO: usize = 4096;

/// Capacity of the buffer small frames are copied into, one after the
/// other: each frame is a shared slice of it (no allocation of its own,
/// nor when the application slices it again, as prost does for a `bytes`
/// field). Once every frame in it is dropped it is reused from the start;
/// a frame kept for long pins at most this much. An allocation per frame
/// and its sharing when sliced cost ~700 instructions a 32-byte echo call.
pub const SMALL_FRAMES: usize = 8 * 1024;

/// Cuts a connection's byte stream into frames under [`FrameLimits`]:
/// its own frames, and those of the bulk stream its pieces carry.
#[derive(Debug)]
pub struct FrameReader {
    main: FrameStream,
    bulk: FrameStream,
    /// Bytes of the current piece still to arrive; they belong to `bulk`.
    piece_left: usize,
    /// The stream whose large partial frame the caller claimed a budget
    /// for ([`reserve_frame`](Self::reserve_frame)), until it is handed up.
    reserved: Option<Lane>,
    /// The last frame handed up came from the bulk stream.
    after_bulk: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Main,
    Bulk,
}

impl FrameReader {
    /// An empty reader.
    pub fn new(limits: FrameLimits) -> FrameReader {
        FrameReader {
            main: FrameStream::new(limits),
            bulk: FrameStream::new(limits),
            piece_left: 0,
            reserved: None,
            after_bulk: false,
        }
    }

    /// Makes room for large frames in buffers `kept` holds when one is
    /// free ([`reserve_frame`](Self::reserve_frame)), and gives it such a
    /// frame's buffer when the application still holds the frame as the
    /// next bytes arrive (a buffer it dropped by then is read into again).
    pub fn keeping_buffers_in(mut self, kept: Arc<KeptBuffers>) -> FrameReader {
        self.main.kept = Some(Arc::clone(&kept));
        self.bulk.kept = Some(kept);
        self
    }

    /// A frame of `lane` was handed up: the reservation ends if it was
    /// the one room was made for.
    fn reservation_ended(&mut self, lane: Lane) {
        if self.reserved == Some(lane) {
            self.reserved = None;
        }
    }

    fn stream(&mut self, lane: Lane) -> &mut FrameStream {
        match lane {
            Lane::Main => &mut self.main,
            Lane::Bulk => &mut self.bulk,
        }
    }

    /// The next whole frame from what arrived, of either stream; `Ok(None)`
    /// when more bytes are needed. A frame over the limit is reported once
    /// as [`TransportError::Oversized`] (with its head, to fail its call)
    /// and its bytes dropped as they arrive; one over
    /// [`FrameLimits::max_skip_len`] is [`TransportError::FrameTooLarge`]
    /// and ends the connection, as does a piece of zero bytes.
    #[inline]
    pub fn next_frame(&mut self) -> Result<Option<Bytes>, TransportError> {
        if self.piece_left == 0 && self.bulk.buf.is_empty() && self.main.piece_header().is_none() {
            // No piece under way nor at the front: the connection's own frame.
            return self.deliver_main();
        }
        self.next_frame_with_pieces()
    }

    /// [`next_frame`](Self::next_frame) when a piece is under way or at
    /// the front.
    #[inline(never)]
    fn next_frame_with_pieces(&mut self) -> Result<Option<Bytes>, TransportError> {
        loop {
            if self.piece_left > 0 && !self.main.buf.is_empty() {
                // Piece bytes read ahead with the connection's own.
                let n = self.piece_left.min(self.main.buf.len());
                self.bulk.extend_from_slice(&self.main.buf[..n]);
                self.main.buf.advance(n);
                self.piece_left -= n;
            }
            if !self.bulk.buf.is_empty() {
                if let Some(frame) = self.bulk.next_frame()? {
                    self.after_bulk = true;
                    self.reservation_ended(Lane::Bulk);
                    return Ok(Some(frame));
                }
            }
            if self.piece_left > 0 {
                return Ok(None);
            }
            match self.main.piece_header() {
                Some(0) => {
                    return Err(TransportError::Protocol(
                        "the peer sent a piece of zero bytes".into(),
                    ))
                }
                Some(len) => {
                    self.main.buf.advance(PREFIX_LEN);
                    self.piece_left = len;
                }
                None => return self.deliver_main(),
            }
        }
    }

    #[inline(always)]
    fn deliver_main(&mut self) -> Result<Option<Bytes>, TransportError> {
        let frame = self.main.next_frame()?;
        if frame.is_some() {
            self.after_bulk = false;
            self.reservation_ended(Lane::Main);
        }
        Ok(frame)
    }

    /// The length of a frame that is deliverable, larger than
    /// [`READ_CHUNK`] and not all here, when no budget is claimed yet
    /// ([`reserve_frame`](Self::reserve_frame)): the frames that need the
    /// process's read budget before more of them is read.
    pub fn large_partial_frame(&self) -> Option<usize> {
        if self.reserved.is_some() {
            return None;
        }
        self.main
            .large_partial_frame()
            .or_else(|| self.bulk.large_partial_frame())
    }

    /// Makes room for the whole of the large partial frame
    /// ([`large_partial_frame`](Self::large_partial_frame)), once the
    /// caller has claimed its length from a budget: the rest of it is then
    /// read in place, with one copy of what arrived before (about a
    /// [`READ_CHUNK`]) instead of a copy of everything so far each time
    /// the buffer doubles (as much again as the frame, in all). This
    /// reserves address space for the announced length; its pages are
    /// touched only as bytes arrive. The claim is the caller's until
    /// [`holds_reservation`](Self::holds_reservation) turns false.
    pub fn reserve_frame(&mut self) {
        if self.reserved.is_some() {
            return;
        }
        let lane = if self.main.large_partial_frame().is_some() {
            Lane::Main
        } else if self.bulk.large_partial_frame().is_some() {
            Lane::Bulk
        } else {
            return;
        };
        self.stream(lane).reserve_frame();
        self.reserved = Some(lane);
    }

    /// A frame room was made for is not handed up yet.
    pub fn holds_reservation(&self) -> bool {
        self.reserved.is_some()
    }

    /// The buffer the next read goes into, and at most how many bytes it
    /// may take; then [`received`](Self::received) says how many it did.
    /// The rest of a piece is read straight into the bulk stream's buffer
    /// (in place, for a frame room was made for). While a bulk frame is
    /// partial, and after one, the connection's own reads take at most
    /// [`COPY_UP_TO`] bytes, so what they read ahead of the next piece,
    /// and copy, stays small.
    #[inline]
    pub fn read_target(&mut self) -> (&mut BytesMut, usize) {
        if self.reading_piece() {
            let limit = self.piece_left.min(self.bulk.read_limit());
            return (self.bulk.read_buf(), limit);
        }
        let limit = if self.main.buf.is_empty() && (self.after_bulk || !self.bulk.buf.is_empty()) {
            COPY_UP_TO
        } else {
            self.main.read_limit()
        };
        (self.main.read_buf(), limit)
    }

    /// `n` bytes were read into the last [`read_target`](Self::read_target).
    pub fn received(&mut self, n: usize) {
        if self.reading_piece() {
            self.piece_left -= n;
        }
    }

    /// Reads go to the piece under way: [`next_frame`](Self::next_frame)
    /// moves what the connection's buffer holds of a piece to the bulk
    /// stream, so while a piece lacks bytes that buffer is empty.
    fn reading_piece(&self) -> bool {
        self.piece_left > 0 && self.main.buf.is_empty()
    }

    /// Appends bytes that arrived, as reads into
    /// [`read_target`](Self::read_target) would (for tests and fuzzing).
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while !rest.is_empty() {
            let (buf, limit) = self.read_target();
            // As a read does: at most the buffer's spare room.
            let n = limit.min(buf.capacity() - buf.len()).min(rest.len());
            buf.extend_from_slice(&rest[..n]);
            self.received(n);
            rest = &rest[n..];
        }
    }

    /// True when nothing is buffered: the reader has caught up with the peer.
    pub fn is_caught_up(&self) -> bool {
        self.main.buf.is_empty() && self.bulk.buf.is_empty() && self.piece_left == 0
    }

    /// Bytes buffered and not yet handed out.
    pub fn buffered(&self) -> usize {
        self.main.buf.len() + self.bulk.buf.len()
    }

    /// The buffers' capacity (what they hold in memory).
    pub fn capacity(&self) -> usize {
        self.main.buf.capacity() + self.bulk.buf.capacity()
    }

    /// What the peer closing its side now means: `Ok(None)` at a frame
    /// boundary of both streams (an orderly end), else an `UnexpectedEof`
    /// I/O error saying how much of which frame arrived.
    pub fn end_of_stream(&self) -> Result<Option<Bytes>, TransportError> {
        let what = if let Some(main) = self.main.unfinished() {
            main
        } else if self.piece_left > 0 {
            format!("with {} bytes of a piece not yet sent", self.piece_left)
        } else if let Some(bulk) = self.bulk.unfinished() {
            format!("{bulk} sent in pieces")
        } else {
            return Ok(None);
        };
        Err(TransportError::io(
            "read from peer",
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("peer closed the connection {what}"),
            ),
        ))
    }
}

/// One stream of length-prefixed frames: the connection's own bytes, or
/// the bulk stream its pieces carry.
#[derive(Debug)]
struct FrameStream {
    buf: BytesMut,
    /// Where frames up to [`COPY_UP_TO`] bytes are copied ([`SMALL_FRAMES`]).
    small: BytesMut,
    limits: FrameLimits,
    /// Bytes of an oversized frame still to drop.
    skip: usize,
    /// The last frame handed up was larger than [`READ_CHUNK`].
    after_large: bool,
    /// The capacity of the buffer room was last made in for a large
    /// frame, while `buf` is that buffer (0: it is not).
    room: usize,
    /// Where such buffers go when their frame outlives them as the read
    /// buffer, and come from.
    kept: Option<Arc<KeptBuffers>>,
}

impl FrameStream {
    fn new(limits: FrameLimits) -> FrameStream {
        FrameStream {
            buf: BytesMut::new(),
            small: BytesMut::new(),
            limits,
            skip: 0,
            after_large: false,
            room: 0,
            kept: None,
        }
    }

    /// The next whole frame from what arrived; `Ok(None)` when more bytes
    /// are needed. A frame over the limit is reported once as
    /// [`TransportError::Oversized`] (with its head, to fail its call) and
    /// its bytes dropped as they arrive; one over
    /// [`FrameLimits::max_skip_len`] is [`TransportError::FrameTooLarge`]
    /// and ends the connection.
    #[inline(always)]
    fn next_frame(&mut self) -> Result<Option<Bytes>, TransportError> {
        if self.skip > 0 {
            let dropped = self.skip.min(self.buf.len());
            self.buf.advance(dropped);
            self.skip -= dropped;
            if self.skip > 0 {
                return Ok(None);
            }
        }
        let Some(len) = self.announced() else {
            return Ok(None);
        };
        let max = self.limits.max_frame_len;
        if len > self.limits.max_skip_len() {
            return Err(TransportError::FrameTooLarge { len, max });
        }
        if len > max {
            let prefix_len = OVERSIZED_PREFIX_LEN.min(len);
            if self.buf.len() < PREFIX_LEN + prefix_len {
                return Ok(None);
            }
            let prefix = Bytes::copy_from_slice(&self.buf[PREFIX_LEN..PREFIX_LEN + prefix_len]);
            self.skip = PREFIX_LEN + len;
            return Err(TransportError::Oversized { len, max, prefix });
        }
        if self.buf.len() < PREFIX_LEN + len {
            return Ok(None);
        }
        self.after_large = len > READ_CHUNK;
        if len <= COPY_UP_TO {
            // Copied: the read buffer stays unshared, so the next read reuses it.
            if self.small.capacity() < len {
                // Reuses the buffer if no frame in it is alive, else a new one.
                self.small.reserve(SMALL_FRAMES);
            }
            self.small
                .extend_from_slice(&self.buf[PREFIX_LEN..PREFIX_LEN + len]);
            self.buf.advance(PREFIX_LEN + len);
            return Ok(Some(self.small.split().freeze()));
        }
        self.buf.advance(PREFIX_LEN);
        Ok(Some(self.buf.split_to(len).freeze()))
    }

    /// The length the frame at the front announces, once its prefix arrived
    /// (and no oversized frame is being dropped).
    fn announced(&self) -> Option<usize> {
        if self.skip > 0 || self.buf.len() < PREFIX_LEN {
            return None;
        }
        let prefix = self.buf[..PREFIX_LEN].try_into().expect("4 bytes");
        Some(u32::from_le_bytes(prefix) as usize)
    }

    /// The length of the frame at the front when it is deliverable, larger
    /// than [`READ_CHUNK`] and not all here: the frames that need the
    /// process's read budget before more of them is read.
    fn large_partial_frame(&self) -> Option<usize> {
        let len = self.announced()?;
        let incomplete = self.buf.len() < PREFIX_LEN + len;
        (len > READ_CHUNK && len <= self.limits.max_frame_len && incomplete).then_some(len)
    }

    /// Makes room for the whole of the large partial frame at the front
    /// ([`large_partial_frame`](Self::large_partial_frame)), once the
    /// caller has claimed its length from a budget: the rest of it is then
    /// read in place, with one copy of what arrived before (about a
    /// [`READ_CHUNK`]) instead of a copy of everything so far each time
    /// the buffer doubles (as much again as the frame, in all). This
    /// reserves address space for the announced length; its pages are
    /// touched only as bytes arrive.
    fn reserve_frame(&mut self) {
        let Some(len) = self.large_partial_frame() else {
            return;
        };
        // The buffer's own allocation if no frame shares it any more and it
        // is large enough; else a kept one whose frame is gone; else a new
        // one. The first two are earlier frames' buffers, their pages
        // mapped already. Not `reserve`: growing in place (`realloc`)
        // copies the old buffer's whole capacity, not only the bytes in it.
        let need = PREFIX_LEN + len;
        if !self.buf.try_reclaim(need - self.buf.len()) {
            let mut room = (self.kept.as_deref())
                .and_then(|kept| kept.take(need))
                .unwrap_or_else(|| BytesMut::with_capacity(need));
            room.extend_from_slice(&self.buf);
            self.buf = room;
        }
        self.room = self.buf.capacity();
    }

    /// Before the first read after a frame room was made for: if the
    /// application dropped that frame, its buffer stays the read buffer
    /// (and the next large frame's room); if it holds it still, what is
    /// left of the buffer (nothing, read in place as it was) goes to the
    /// kept ones, reused once the frame is dropped, where `reserve` would
    /// let it go.
    #[cold]
    fn settle_room(&mut self, want: usize) {
        let capacity = mem::take(&mut self.room);
        if !self.buf.is_empty() || self.buf.try_reclaim(want) {
            return;
        }
        if let Some(kept) = &self.kept {
            kept.keep(mem::take(&mut self.buf), capacity);
        }
    }

    /// How many bytes the next read should ask for: what the frame at the
    /// front still lacks if the buffer has room for it (it is read in
    /// place); else [`READ_CHUNK`], or for a large partial frame what it
    /// still lacks, but at most as much again as has arrived (so the
    /// buffer grows geometrically with real bytes).
    fn wanted(&self) -> usize {
        let Some(len) = self.announced().filter(|&l| l <= self.limits.max_frame_len) else {
            return READ_CHUNK;
        };
        let missing = (PREFIX_LEN + len).saturating_sub(self.buf.len());
        if missing > 0 && missing <= self.buf.capacity() - self.buf.len() {
            return missing;
        }
        missing.min(self.buf.len()).max(READ_CHUNK)
    }

    /// At most how many bytes the next read should take: [`COPY_UP_TO`]
    /// when nothing is buffered and the last frame was larger than
    /// [`READ_CHUNK`], else no limit. When large frames follow each other,
    /// what arrives of one before room is made for all of it
    /// ([`reserve_frame`](Self::reserve_frame)) is copied once: reading
    /// only its head first keeps that copy to 4 KiB instead of 64 KiB (all
    /// of a 64 KiB frame), for one more read when a small frame follows.
    fn read_limit(&self) -> usize {
        if self.after_large && self.buf.is_empty() {
            COPY_UP_TO
        } else {
            usize::MAX
        }
    }

    /// Appends bytes, growing the buffer as reads would.
    fn extend_from_slice(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = self.wanted().min(self.read_limit()).min(rest.len());
            self.read_buf().extend_from_slice(&rest[..n]);
            rest = &rest[n..];
        }
    }

    /// The length of the piece whose header is at the front, if one is.
    fn piece_header(&self) -> Option<usize> {
        if self.skip > 0 || self.buf.len() < PREFIX_LEN {
            return None;
        }
        let prefix = u32::from_le_bytes(self.buf[..PREFIX_LEN].try_into().expect("4 bytes"));
        (prefix & PIECE != 0).then_some((prefix & !PIECE) as usize)
    }

    /// The buffer to read into, with room for [`wanted`](Self::wanted) bytes.
    fn read_buf(&mut self) -> &mut BytesMut {
        let want = self.wanted();
        if self.room > 0 && self.announced().is_none() {
            self.settle_room(want);
        }
        self.buf.reserve(want);
        &mut self.buf
    }

    /// Where this stream stands if the peer closes now: `None` at a frame
    /// boundary, else how much of which frame arrived.
    fn unfinished(&self) -> Option<String> {
        if self.buf.is_empty() && self.skip == 0 {
            return None;
        }
        Some(match self.announced() {
            Some(len) => format!(
                "after {} of the {len} bytes of a frame",
                self.buf.len() - PREFIX_LEN
            ),
            None if self.skip > 0 => format!(
                "with {} bytes of an oversized frame not yet sent",
                self.skip - self.buf.len()
            ),
            None => format!("after {} of a frame's 4 length bytes", self.buf.len()),
        })
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = 64 << 20;

    fn reader() -> FrameReader {
        FrameReader::new(FrameLimits { max_frame_len: MAX })
    }

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut v = (body.len() as u32).to_le_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    /// The peer closing now is an `UnexpectedEof` I/O error that says `what`.
    fn assert_unexpected_eof(r: &FrameReader, what: &str) {
        match r.end_of_stream() {
            Err(TransportError::Io { source, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof);
                assert!(source.to_string().contains(what), "{source}");
            }
            other => panic!("expected an I/O error, got {other:?}"),
        }
    }

    fn piece(bytes: &[u8]) -> Vec<u8> {
        let mut v = (bytes.len() as u32 | PIECE).to_le_bytes().to_vec();
        v.extend_from_slice(bytes);
        v
    }

    /// Two large frames in pieces of `PIECE_LEN` with a small frame after
    /// each piece (as a busy writer sends them): the wire, and the frames
    /// in the order they must come out.
    fn interleaved(large: usize) -> (Vec<u8>, Vec<Vec<u8>>) {
        let bodies: Vec<Vec<u8>> = (0..2u8)
            .map(|f| (0..large).map(|i| (i % 251) as u8 ^ f).collect())
            .collect();
        let bulk: Vec<u8> = bodies.iter().flat_map(|b| framed(b)).collect();
        let (mut wire, mut expected) = (Vec::new(), Vec::new());
        let mut sent = 0;
        for (i, chunk) in bulk.chunks(PIECE_LEN).enumerate() {
            wire.extend_from_slice(&piece(chunk));
            sent += chunk.len();
            // A frame is out once its last piece is.
            for (f, body) in bodies.iter().enumerate() {
                let end = (f + 1) * (PREFIX_LEN + large);
                if sent >= end && sent - chunk.len() < end {
                    expected.push(body.clone());
                }
            }
            let small = vec![i as u8; 1 + i % 40];
            wire.extend_from_slice(&framed(&small));
            expected.push(small);
        }
        (wire, expected)
    }

    #[test]
    fn small_frames_between_the_pieces_of_large_ones_come_out_first_and_whole() {
        let (wire, expected) = interleaved(3 * PIECE_LEN + 1000);
        for split in [1, 7, 4096, 100_003, wire.len()] {
            let mut r = reader();
            let mut frames = Vec::new();
            for bytes in wire.chunks(split) {
                r.extend_from_slice(bytes);
                if r.large_partial_frame().is_some() {
                    r.reserve_frame();
                }
                while let Some(frame) = r.next_frame().unwrap() {
                    frames.push(frame.to_vec());
                }
            }
            assert_eq!(frames.len(), expected.len(), "split {split}");
            assert!(frames == expected, "split {split}: frames differ");
            assert!(r.is_caught_up() && !r.holds_reservation());
            assert!(matches!(r.end_of_stream(), Ok(None)));
        }
    }

    #[test]
    fn random_pieces_and_frames_cut_anywhere_come_out_whole_and_each_stream_in_order() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move |below: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % below as u64) as usize
        };
        for _ in 0..20 {
            // Frames tagged by stream and number in their first 3 bytes.
            let body = |stream: u8, n: u16, len: usize| {
                let mut b = vec![stream, (n >> 8) as u8, n as u8];
                b.extend((0..len).map(|i| (i % 241) as u8));
                b
            };
            let bulk: Vec<Vec<u8>> = (0..1 + next(4) as u16)
                .map(|n| body(1, n, next(300_000)))
                .collect();
            let bulk_wire: Vec<u8> = bulk.iter().flat_map(|b| framed(b)).collect();
            let (mut wire, mut main_sent, mut at) = (Vec::new(), Vec::new(), 0);
            while at < bulk_wire.len() {
                for _ in 0..next(3) {
                    let frame = body(0, main_sent.len() as u16, next(5000));
                    wire.extend_from_slice(&framed(&frame));
                    main_sent.push(frame);
                }
                let n = (1 + next(2 * PIECE_LEN)).min(bulk_wire.len() - at);
                wire.extend_from_slice(&piece(&bulk_wire[at..at + n]));
                at += n;
            }
            let mut r = reader();
            let mut got: [Vec<Vec<u8>>; 2] = [Vec::new(), Vec::new()];
            let mut fed = 0;
            while fed < wire.len() {
                let n = (1 + next(200_000)).min(wire.len() - fed);
                r.extend_from_slice(&wire[fed..fed + n]);
                fed += n;
                if next(2) == 0 && r.large_partial_frame().is_some() {
                    r.reserve_frame();
                }
                while let Some(frame) = r.next_frame().unwrap() {
                    got[usize::from(frame[0])].push(frame.to_vec());
                }
            }
            assert!(got[0] == main_sent, "the connection's own frames");
            assert!(got[1] == bulk, "the bulk stream's frames");
            assert!(r.is_caught_up() && !r.holds_reservation());
        }
    }

    #[test]
    fn pieces_are_read_in_place_into_the_frame_room_was_made_for() {
        let len = 1 << 20;
        let body: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        let mut wire = Vec::new();
        for chunk in framed(&body).chunks(PIECE_LEN) {
            wire.extend_from_slice(&piece(chunk));
            wire.extend_from_slice(&framed(b"small"));
        }
        let mut r = reader();
        let (mut at, mut copied, mut start) = (0, 0, None);
        let mut frames = Vec::new();
        while at < wire.len() {
            if r.large_partial_frame().is_some() {
                r.reserve_frame();
                start = Some(r.bulk.buf.as_ptr());
            }
            let piece_bytes = r.piece_left > 0 && r.main.buf.is_empty();
            let (buf, limit) = r.read_target();
            // As a read does: at most the buffer's spare room.
            let n = limit.min(wire.len() - at).min(buf.capacity() - buf.len());
            buf.extend_from_slice(&wire[at..at + n]);
            r.received(n);
            if !piece_bytes {
                copied += n;
            }
            at += n;
            while let Some(frame) = r.next_frame().unwrap() {
                frames.push(frame);
            }
        }
        assert_eq!(frames.len(), len / PIECE_LEN + 2);
        let large = frames
            .iter()
            .find(|f| f.len() == len)
            .expect("the large frame");
        assert!(large == &body[..]);
        assert_eq!(
            large.as_ptr(),
            start.expect("room made").wrapping_add(PREFIX_LEN)
        );
        // Read ahead with the connection's own frames, and copied: at
        // most a `COPY_UP_TO` a piece.
        assert!(
            copied <= (len / PIECE_LEN + 1) * COPY_UP_TO + READ_CHUNK,
            "{copied} bytes read outside the pieces' buffer"
        );
    }

    #[test]
    fn an_oversized_frame_in_pieces_is_reported_and_dropped_while_small_ones_pass() {
        let mut r = FrameReader::new(FrameLimits { max_frame_len: 100 });
        let body: Vec<u8> = (0..150u8).collect();
        let bulk = framed(&body);
        r.extend_from_slice(&piece(&bulk[..60]));
        r.extend_from_slice(&framed(b"one"));
        r.extend_from_slice(&piece(&bulk[60..]));
        r.extend_from_slice(&framed(b"two"));
        assert!(matches!(
            r.next_frame(),
            Err(TransportError::Oversized {
                len: 150,
                max: 100,
                ..
            })
        ));
        assert_eq!(r.next_frame().unwrap().unwrap(), "one");
        assert_eq!(r.next_frame().unwrap().unwrap(), "two");
        assert!(r.is_caught_up());
    }

    #[test]
    fn a_piece_of_zero_bytes_ends_the_connection_and_an_unfinished_piece_is_an_unexpected_eof() {
        let mut r = reader();
        r.extend_from_slice(&PIECE.to_le_bytes());
        assert!(matches!(r.next_frame(), Err(TransportError::Protocol(_))));
        let mut r = reader();
        r.extend_from_slice(&piece(&framed(b"abcdef"))[..9]);
        assert_eq!(r.next_frame().unwrap(), None);
        assert_unexpected_eof(&r, "5 bytes of a piece");
    }

    #[test]
    fn an_announced_maximal_frame_reserves_nothing_for_bytes_not_sent() {
        let mut r = reader();
        r.extend_from_slice(&(MAX as u32).to_le_bytes());
        r.extend_from_slice(&[7; 100]);
        assert_eq!(r.next_frame().unwrap(), None);
        let _ = r.read_target();
        assert!(
            r.capacity() <= 2 * READ_CHUNK,
            "capacity {} for 104 bytes received",
            r.capacity()
        );
        assert_eq!(r.large_partial_frame(), Some(MAX));
    }

    #[test]
    fn a_reserved_frame_is_read_in_place() {
        let len = 4 << 20;
        let body: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let wire = framed(&body);
        let mut r = reader();
        r.extend_from_slice(&wire[..READ_CHUNK]);
        assert_eq!(r.large_partial_frame(), Some(len));
        r.reserve_frame();
        assert!(
            r.capacity() >= PREFIX_LEN + len,
            "capacity {}",
            r.capacity()
        );
        let start = r.read_target().0.as_ptr();
        for piece in wire[READ_CHUNK..].chunks(100_003) {
            r.extend_from_slice(piece);
        }
        let frame = r.next_frame().unwrap().unwrap();
        assert_eq!(frame, body);
        // Where the buffer started after the reservation: never moved
        // (copied) as the rest arrived.
        assert_eq!(frame.as_ptr(), start.wrapping_add(PREFIX_LEN));
    }

    #[test]
    fn a_large_frame_is_read_into_the_buffer_of_one_the_application_dropped() {
        let len = 33 << 20;
        // Room for every buffer: a kept one is never freed (so another
        // allocation cannot land where it was and pass for it).
        let kept = Arc::new(KeptBuffers::new(256 << 20));
        let mut r = reader().keeping_buffers_in(Arc::clone(&kept));
        let receive = |r: &mut FrameReader, byte: u8| {
            let wire = framed(&vec![byte; len]);
            r.extend_from_slice(&wire[..READ_CHUNK]);
            r.reserve_frame();
            r.extend_from_slice(&wire[READ_CHUNK..]);
            let frame = r.next_frame().unwrap().unwrap();
            assert!(frame.iter().all(|&b| b == byte));
            frame
        };
        let first = receive(&mut r, 1);
        let second = receive(&mut r, 2);
        assert_ne!(first.as_ptr(), second.as_ptr(), "the first frame lived");
        let first_at = first.as_ptr();
        drop(first);
        // The second lives on: its buffer is kept, the first's taken.
        let third = receive(&mut r, 3);
        assert_eq!(third.as_ptr(), first_at, "the first frame's buffer");
        // Dropped before the next bytes: the reader reads into it again.
        let third_at = third.as_ptr();
        drop(third);
        let fourth = receive(&mut r, 4);
        assert_eq!(fourth.as_ptr(), third_at, "the third frame's buffer");
        drop(second);
        assert!(kept.take(len).is_some(), "the second frame's buffer, kept");
        assert!(kept.take(len).is_none());
    }

    #[test]
    fn after_a_large_frame_only_the_head_of_the_next_is_read_before_room_is_made() {
        let mut r = reader();
        let large = READ_CHUNK + 1;
        r.extend_from_slice(&framed(&[1; 100]));
        r.next_frame().unwrap().unwrap();
        assert_eq!(r.read_target().1, usize::MAX, "after a small frame");
        let mut wire = framed(&vec![2; large]);
        wire.extend_from_slice(&framed(&vec![3; large]));
        r.extend_from_slice(&wire[..READ_CHUNK]);
        assert_eq!(r.read_target().1, usize::MAX, "inside a frame");
        r.reserve_frame();
        r.extend_from_slice(&wire[READ_CHUNK..PREFIX_LEN + large]);
        assert_eq!(r.next_frame().unwrap().unwrap().len(), large);
        assert_eq!(r.read_target().1, COPY_UP_TO, "after a large frame");
        // The next frame's head arrives with no room made yet: only that
        // much is copied when room is.
        let head = r.read_target().1;
        r.extend_from_slice(&wire[PREFIX_LEN + large..][..head]);
        assert_eq!(r.buffered(), COPY_UP_TO);
        r.reserve_frame();
        r.extend_from_slice(&wire[2 * PREFIX_LEN + large + COPY_UP_TO - PREFIX_LEN..]);
        assert_eq!(r.next_frame().unwrap().unwrap(), vec![3; large]);
    }

    #[test]
    fn capacity_grows_with_the_bytes_that_arrived() {
        let mut r = reader();
        r.extend_from_slice(&(MAX as u32).to_le_bytes());
        let mut received = 4;
        for _ in 0..200 {
            let (buf, _) = r.read_target();
            let n = (buf.capacity() - buf.len()).min(37_000);
            buf.extend_from_slice(&vec![1; n]);
            r.received(n);
            received += n;
            assert!(
                r.capacity() <= 4 * received + 2 * READ_CHUNK,
                "capacity {} after {received} bytes",
                r.capacity()
            );
        }
    }

    #[test]
    fn a_maximal_frame_fed_in_pieces_arrives_intact() {
        let body: Vec<u8> = (0..MAX).map(|i| (i * 31 % 251) as u8).collect();
        let mut wire = framed(&body);
        wire.extend_from_slice(&framed(b"next"));
        let mut r = reader();
        let mut frames = Vec::new();
        for piece in wire.chunks(1_000_003) {
            r.extend_from_slice(piece);
            while let Some(frame) = r.next_frame().unwrap() {
                frames.push(frame);
            }
        }
        assert_eq!(frames.len(), 2);
        assert!(frames[0] == body[..], "the 64 MiB frame differs");
        assert_eq!(frames[1], "next");
        assert!(r.is_caught_up());
    }

    #[test]
    fn frames_split_at_every_byte_arrive_whole_and_in_order() {
        let wire: Vec<u8> = [framed(b""), framed(b"a"), framed(&[9; 300])].concat();
        let mut r = reader();
        let mut frames = Vec::new();
        for byte in &wire {
            r.extend_from_slice(std::slice::from_ref(byte));
            while let Some(frame) = r.next_frame().unwrap() {
                frames.push(frame);
            }
        }
        assert_eq!(frames, [&b""[..], b"a", &[9; 300]]);
    }

    #[test]
    fn small_frames_share_one_buffer_reused_only_once_none_of_them_is_alive() {
        let mut r = reader();
        let mut next = |byte: u8| {
            r.extend_from_slice(&framed(&[byte; 1000]));
            r.next_frame().unwrap().expect("a whole frame")
        };
        // Copied one after the other into one buffer.
        let first = next(1);
        let second = next(2);
        assert_eq!(second.as_ptr(), first.as_ptr().wrapping_add(1000));
        // Kept: frames after it never overwrite it, however many pass.
        let start = first.as_ptr();
        drop(second);
        for byte in 3..40 {
            let frame = next(byte);
            assert_eq!(frame, vec![byte; 1000]);
        }
        assert_eq!(first, vec![1; 1000]);
        // Once none is alive, the buffer frames go into is reused from its start.
        let mut reused = false;
        for byte in 40..60 {
            reused |= next(byte).as_ptr() == start;
        }
        assert!(!reused, "reused while a frame in it was alive");
        drop(first);
        let mut r = reader();
        let mut next = |byte: u8| {
            r.extend_from_slice(&framed(&[byte; 1000]));
            let frame = r.next_frame().unwrap().expect("a whole frame");
            assert_eq!(frame, vec![byte; 1000]);
            frame.as_ptr()
        };
        let start = next(0);
        // Eight fit: the ninth starts over at the front.
        assert!((1..9).any(|byte| next(byte) == start), "not reused");
    }

    #[test]
    fn an_oversized_frame_is_reported_with_its_head_then_dropped() {
        let mut r = FrameReader::new(FrameLimits { max_frame_len: 100 });
        let body: Vec<u8> = (0..150u8).collect();
        r.extend_from_slice(&framed(&body));
        r.extend_from_slice(&framed(b"ok"));
        match r.next_frame() {
            Err(TransportError::Oversized { len, max, prefix }) => {
                assert_eq!((len, max), (150, 100));
                assert_eq!(prefix[..], body[..OVERSIZED_PREFIX_LEN]);
            }
            other => panic!("expected Oversized, got {other:?}"),
        }
        assert_eq!(r.next_frame().unwrap().unwrap(), "ok");
    }

    #[test]
    fn a_frame_past_the_skip_limit_ends_the_connection() {
        let mut r = FrameReader::new(FrameLimits { max_frame_len: 100 });
        r.extend_from_slice(&401u32.to_le_bytes());
        assert!(matches!(
            r.next_frame(),
            Err(TransportError::FrameTooLarge { len: 401, max: 100 })
        ));
    }

    #[test]
    fn end_of_stream_inside_a_frame_is_an_unexpected_eof_not_a_protocol_error() {
        let mut r = reader();
        assert!(matches!(r.end_of_stream(), Ok(None)));
        r.extend_from_slice(&framed(b"abcdef")[..7]);
        assert_unexpected_eof(&r, "after 3 of the 6 bytes");
    }
}
