//! [`Gather`]: an encoded frame as a list of segments, large `Bytes` by reference.

use bytes::buf::UninitSlice;
use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Chunks of at least this many bytes that a [`Gather`] is handed as a
/// [`Buf`] (a prost `bytes` field generated as [`Bytes`], a [`Bytes`]
/// payload) become segments of their own, by reference; smaller ones are
/// copied into its small-bytes buffer. 32 KiB: below it, a segment's
/// bookkeeping and the extra `iovec` cost about what the copy saves.
pub const GATHER_THRESHOLD: usize = 32 * 1024;

/// Bytes to send, as a list of segments: small bytes (a frame's head, a
/// message's small fields) copied into a buffer of its own, and every large
/// [`Bytes`] handed to [`BufMut::put`] kept as a segment by reference,
/// without copying it. A transport writes the segments in order, with
/// vectored writes.
///
/// Large fields are taken by reference only through [`BufMut::put`] on the
/// concrete type (prost encodes a `Bytes` field that way when it is given a
/// `&mut Gather`); through `&mut dyn BufMut`, `put` falls back to copying.
///
/// The segments, in order, are [`Gather::segments`] followed by
/// [`Gather::tail`] (small bytes written since the last large segment).
#[derive(Debug, Default)]
pub struct Gather {
    segments: Vec<Bytes>,
    /// Total length of `segments`.
    segments_len: usize,
    tail: BytesMut,
}

impl Gather {
    /// An empty gather list.
    pub fn new() -> Gather {
        Gather::default()
    }

    /// A gather list whose small bytes continue `tail` (bytes already
    /// encoded there come first).
    pub fn with_tail(tail: BytesMut) -> Gather {
        Gather {
            segments: Vec::new(),
            segments_len: 0,
            tail,
        }
    }

    /// Bytes gathered so far.
    pub fn len(&self) -> usize {
        self.segments_len + self.tail.len()
    }

    /// Whether nothing was gathered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The finished segments, before [`Gather::tail`].
    pub fn segments(&self) -> &[Bytes] {
        &self.segments
    }

    /// Small bytes written since the last large segment, after
    /// [`Gather::segments`].
    pub fn tail(&self) -> &[u8] {
        &self.tail
    }

    /// The finished segments and the small-bytes tail that follows them.
    pub fn into_parts(self) -> (Vec<Bytes>, BytesMut) {
        (self.segments, self.tail)
    }

    /// Every byte gathered, copied into one buffer (tests, diagnostics).
    pub fn to_bytes(&self) -> Bytes {
        let mut all = BytesMut::with_capacity(self.len());
        for segment in &self.segments {
            all.extend_from_slice(segment);
        }
        all.extend_from_slice(&self.tail);
        all.freeze()
    }

    /// Appends `segment` by reference, after the small bytes written so far.
    pub fn push_segment(&mut self, segment: Bytes) {
        if segment.is_empty() {
            return;
        }
        if !self.tail.is_empty() {
            let small = self.tail.split().freeze();
            self.segments_len += small.len();
            self.segments.push(small);
        }
        self.segments_len += segment.len();
        self.segments.push(segment);
    }
}

// SAFETY: every method forwards to the `BytesMut` tail, whose own
// implementation upholds `BufMut`'s contract; `put` only appends whole
// segments besides, never touching the tail's uninitialised bytes.
unsafe impl BufMut for Gather {
    fn remaining_mut(&self) -> usize {
        self.tail.remaining_mut()
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        // SAFETY: the caller initialised `cnt` bytes of `chunk_mut`, which
        // is the tail's `chunk_mut`, as the tail's `advance_mut` requires.
        unsafe { self.tail.advance_mut(cnt) }
    }

    fn chunk_mut(&mut self) -> &mut UninitSlice {
        self.tail.chunk_mut()
    }

    /// Takes each chunk of `src` of at least [`GATHER_THRESHOLD`] bytes
    /// with `copy_to_bytes` (no copy when `src` is a [`Bytes`]) as a
    /// segment of its own; copies smaller chunks.
    fn put<T: Buf>(&mut self, mut src: T)
    where
        Self: Sized,
    {
        while src.has_remaining() {
            let len = src.chunk().len();
            if len >= GATHER_THRESHOLD {
                let segment = src.copy_to_bytes(len);
                self.push_segment(segment);
            } else {
                self.tail.extend_from_slice(src.chunk());
                src.advance(len);
            }
        }
    }

    fn put_slice(&mut self, src: &[u8]) {
        self.tail.extend_from_slice(src);
    }

    fn put_bytes(&mut self, val: u8, cnt: usize) {
        self.tail.put_bytes(val, cnt);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_bytes_are_segments_small_ones_are_copied() {
        let large = Bytes::from(vec![7u8; GATHER_THRESHOLD]);
        let small = Bytes::from_static(b"small");
        let mut gather = Gather::new();
        gather.put_u32_le(1);
        gather.put(large.clone());
        gather.put(small.clone());
        gather.put(large.clone());
        assert_eq!(gather.segments().len(), 4);
        assert_eq!(gather.segments()[0][..], 1u32.to_le_bytes());
        assert_eq!(gather.segments()[1].as_ptr(), large.as_ptr());
        assert_eq!(gather.segments()[2][..], b"small"[..]);
        assert_eq!(gather.segments()[3].as_ptr(), large.as_ptr());
        assert!(gather.tail().is_empty());
        assert_eq!(gather.len(), 4 + 2 * GATHER_THRESHOLD + 5);
    }

    #[test]
    fn segments_are_in_write_order() {
        let large = Bytes::from((0..100_000u32).map(|i| i as u8).collect::<Vec<_>>());
        let mut gather = Gather::with_tail(BytesMut::from(&b"before"[..]));
        gather.put(large.clone());
        gather.put_slice(b"after");
        let mut expected = b"before".to_vec();
        expected.extend_from_slice(&large);
        expected.extend_from_slice(b"after");
        assert_eq!(gather.len(), expected.len());
        assert_eq!(gather.to_bytes(), expected);
        assert_eq!(gather.segments()[1].as_ptr(), large.as_ptr());
        assert_eq!(gather.tail(), b"after");
    }
}
