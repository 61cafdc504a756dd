//! TCP's byte stream cut into frames, with no I/O in it.
//!
//! Each frame is a 4-byte little-endian length and that many bytes.
//! [`FrameReader`] holds what arrived, hands each whole frame out as a
//! [`Bytes`] (a slice of its buffer, no copy, above [`COPY_UP_TO`] bytes; a
//! copy of it up to that), skips frames over the limit as
//! they arrive, and decides how much to read next so that **memory follows
//! the bytes that arrived, never the length a peer announced**: each read
//! asks for at most as many bytes again as have arrived, so a partial
//! frame's buffer grows geometrically with real bytes (capacity ≤ 4 × bytes
//! received + 2 × [`READ_CHUNK`], and ≤ 2 × the frame's length) — unless
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

use std::io;

use bytes::{Buf, Bytes, BytesMut};
use rpc_core::transport::{FrameLimits, TransportError, OVERSIZED_PREFIX_LEN};

/// Bytes asked of the socket per read when no partial frame needs more.
/// Frames up to this size never need the process's read budget.
pub const READ_CHUNK: usize = 64 * 1024;

const PREFIX_LEN: usize = 4;

/// Frames up to this length are copied out of the buffer rather than
/// handed out as slices of it. A slice shares the buffer: making it
/// shareable allocates, and while the frame lives (a handler holds its
/// request) the next read cannot reuse the buffer and allocates a new one.
/// For a small frame one small allocation and a short copy cost less:
/// −1,000 instructions per 32-byte echo call. Once the runtime's own
/// per-call work shrank, the 64 KiB buffer a shared read buffer makes the
/// next read allocate outweighed copying 1 KiB too: copying frames up to
/// 4 KiB made a 1 KiB echo call −420 instructions (18,598 → 18,177,
/// `cargo xtask bench --instructions`), hence 4096. The other way round
/// when handlers run on the reader (`ServerBuilder::inline_handlers`):
/// the request is dropped before the next read, the buffer is reused, and
/// the copy costs +650 (15,179 → 15,826). The default is what counts here.
pub const COPY_UP_TO: usize = 4096;

/// Cuts a byte stream into frames under [`FrameLimits`].
#[derive(Debug)]
pub struct FrameReader {
    buf: BytesMut,
    limits: FrameLimits,
    /// Bytes of an oversized frame still to drop.
    skip: usize,
    /// The last frame handed up was larger than [`READ_CHUNK`].
    after_large: bool,
}

impl FrameReader {
    /// An empty reader.
    pub fn new(limits: FrameLimits) -> FrameReader {
        FrameReader {
            buf: BytesMut::new(),
            limits,
            skip: 0,
            after_large: false,
        }
    }

    /// The next whole frame from what arrived; `Ok(None)` when more bytes
    /// are needed. A frame over the limit is reported once as
    /// [`TransportError::Oversized`] (with its head, to fail its call) and
    /// its bytes dropped as they arrive; one over
    /// [`FrameLimits::max_skip_len`] is [`TransportError::FrameTooLarge`]
    /// and ends the connection.
    pub fn next_frame(&mut self) -> Result<Option<Bytes>, TransportError> {
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
        self.buf.advance(PREFIX_LEN);
        self.after_large = len > READ_CHUNK;
        if len <= COPY_UP_TO {
            // Copied: the buffer stays unshared, so the next read reuses it.
            let frame = Bytes::copy_from_slice(&self.buf[..len]);
            self.buf.advance(len);
            return Ok(Some(frame));
        }
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
    pub fn large_partial_frame(&self) -> Option<usize> {
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
    pub fn reserve_frame(&mut self) {
        let Some(len) = self.large_partial_frame() else {
            return;
        };
        // The buffer's own allocation if no frame shares it any more and it
        // is large enough (a previous frame's: its pages are mapped
        // already); else a new one, the frame's alone once handed up (so an
        // application can take it over, `Bytes::try_into_mut`). Not
        // `reserve`: growing in place (`realloc`) copies the old buffer's
        // whole capacity, not only the bytes in it.
        if !self.buf.try_reclaim(PREFIX_LEN + len - self.buf.len()) {
            let mut room = BytesMut::with_capacity(PREFIX_LEN + len);
            room.extend_from_slice(&self.buf);
            self.buf = room;
        }
    }

    /// How many bytes the next read should ask for: what the frame at the
    /// front still lacks if the buffer has room for it (it is read in
    /// place); else [`READ_CHUNK`], or for a large partial frame what it
    /// still lacks, but at most as much again as has arrived (so the
    /// buffer grows geometrically with real bytes).
    pub fn wanted(&self) -> usize {
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
    pub fn read_limit(&self) -> usize {
        if self.after_large && self.buf.is_empty() {
            COPY_UP_TO
        } else {
            usize::MAX
        }
    }

    /// The buffer to read into, with room for [`wanted`](Self::wanted) bytes.
    pub fn read_buf(&mut self) -> &mut BytesMut {
        let want = self.wanted();
        self.buf.reserve(want);
        &mut self.buf
    }

    /// Appends bytes that arrived (what a read into
    /// [`read_buf`](Self::read_buf) does; for tests and fuzzing).
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = self.wanted().min(self.read_limit()).min(rest.len());
            self.read_buf().extend_from_slice(&rest[..n]);
            rest = &rest[n..];
        }
    }

    /// True when nothing is buffered: the reader has caught up with the peer.
    pub fn is_caught_up(&self) -> bool {
        self.buf.is_empty()
    }

    /// Bytes buffered and not yet handed out.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The buffer's capacity (what it holds in memory).
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// What the peer closing its side now means: `Ok(None)` at a frame
    /// boundary (an orderly end), else an `UnexpectedEof` I/O error saying
    /// how much of which frame arrived.
    pub fn end_of_stream(&self) -> Result<Option<Bytes>, TransportError> {
        if self.buf.is_empty() && self.skip == 0 {
            return Ok(None);
        }
        let what = match self.announced() {
            Some(len) => format!(
                "after {} of the {len} bytes of a frame",
                self.buf.len() - PREFIX_LEN
            ),
            None if self.skip > 0 => format!(
                "with {} bytes of an oversized frame not yet sent",
                self.skip - self.buf.len()
            ),
            None => format!("after {} of a frame's 4 length bytes", self.buf.len()),
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

    #[test]
    fn an_announced_maximal_frame_reserves_nothing_for_bytes_not_sent() {
        let mut r = reader();
        r.extend_from_slice(&(MAX as u32).to_le_bytes());
        r.extend_from_slice(&[7; 100]);
        assert_eq!(r.next_frame().unwrap(), None);
        let _ = r.read_buf();
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
        let start = r.read_buf().as_ptr();
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
    fn after_a_large_frame_only_the_head_of_the_next_is_read_before_room_is_made() {
        let mut r = reader();
        let large = READ_CHUNK + 1;
        r.extend_from_slice(&framed(&[1; 100]));
        r.next_frame().unwrap().unwrap();
        assert_eq!(r.read_limit(), usize::MAX, "after a small frame");
        let mut wire = framed(&vec![2; large]);
        wire.extend_from_slice(&framed(&vec![3; large]));
        r.extend_from_slice(&wire[..READ_CHUNK]);
        assert_eq!(r.read_limit(), usize::MAX, "inside a frame");
        r.reserve_frame();
        r.extend_from_slice(&wire[READ_CHUNK..PREFIX_LEN + large]);
        assert_eq!(r.next_frame().unwrap().unwrap().len(), large);
        assert_eq!(r.read_limit(), COPY_UP_TO, "after a large frame");
        // The next frame's head arrives with no room made yet: only that
        // much is copied when room is.
        r.extend_from_slice(&wire[PREFIX_LEN + large..][..r.read_limit()]);
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
            let n = r.wanted().min(37_000);
            r.read_buf().extend_from_slice(&vec![1; n]);
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
        match r.end_of_stream() {
            Err(TransportError::Io { source, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof);
                assert!(
                    source.to_string().contains("after 3 of the 6 bytes"),
                    "{source}"
                );
            }
            other => panic!("expected an I/O error, got {other:?}"),
        }
    }
}
