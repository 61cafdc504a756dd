//! [`FrameBytes`]: a chunked frame's bytes as the pieces they are in.

use std::ops::Range;

use bytes::Bytes;

/// A frame's bytes in order, as pieces: a large payload where the
/// application left it (a `Bytes` held by reference), the frame's head and
/// small fields beside it. A chunked frame goes from these into the
/// staging region chunk by chunk, so its payload is copied once, not first
/// into a buffer of the whole frame.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FrameBytes {
    pieces: Vec<Bytes>,
    len: usize,
}

impl FrameBytes {
    /// The bytes of `pieces`, in order (empty ones are dropped).
    pub fn new(mut pieces: Vec<Bytes>) -> FrameBytes {
        pieces.retain(|p| !p.is_empty());
        let len = pieces.iter().map(Bytes::len).sum();
        FrameBytes { pieces, len }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pieces, in order.
    pub fn pieces(&self) -> &[Bytes] {
        &self.pieces
    }

    /// Bytes `range`, as slices of the pieces (no copy). Panics if `range`
    /// is out of bounds.
    pub fn slice(&self, range: Range<usize>) -> FrameBytes {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "slice {range:?} of {} bytes",
            self.len
        );
        let mut out = Vec::new();
        let mut start = 0;
        for piece in &self.pieces {
            let end = start + piece.len();
            let (from, to) = (range.start.max(start), range.end.min(end));
            if from < to {
                out.push(piece.slice(from - start..to - start));
            }
            start = end;
        }
        FrameBytes {
            pieces: out,
            len: range.len(),
        }
    }

    /// Copies the bytes into `dst`, exactly as long.
    pub fn copy_to(&self, dst: &mut [u8]) {
        assert_eq!(dst.len(), self.len, "copying {} bytes", self.len);
        let mut at = 0;
        for piece in &self.pieces {
            dst[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
        }
    }
}

impl From<Bytes> for FrameBytes {
    fn from(bytes: Bytes) -> FrameBytes {
        FrameBytes::new(vec![bytes])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_across_pieces_copy_what_the_whole_would() {
        let whole: Vec<u8> = (0..100u8).collect();
        let pieces = vec![
            Bytes::copy_from_slice(&whole[..7]),
            Bytes::new(),
            Bytes::copy_from_slice(&whole[7..60]),
            Bytes::copy_from_slice(&whole[60..]),
        ];
        let bytes = FrameBytes::new(pieces);
        assert_eq!((bytes.len(), bytes.pieces().len()), (100, 3));
        for (start, end) in [
            (0, 100),
            (0, 7),
            (5, 9),
            (7, 60),
            (59, 61),
            (99, 100),
            (30, 30),
        ] {
            let slice = bytes.slice(start..end);
            let mut got = vec![0; end - start];
            slice.copy_to(&mut got);
            assert_eq!(got, whole[start..end], "{start}..{end}");
            assert!(slice.pieces().iter().all(|p| !p.is_empty()));
        }
        // A slice within one piece shares its memory.
        let inner = bytes.slice(10..20);
        assert_eq!(inner.pieces()[0].as_ptr(), bytes.pieces()[1][3..].as_ptr());
    }
}
