//! Buffers that large frames were received into, kept for the next ones:
//! a transport reads a large frame into one whose frame the application
//! has dropped, with its pages mapped already, instead of fresh memory the
//! kernel faults in and zeroes as bytes arrive.

use std::sync::Mutex;

use bytes::BytesMut;

/// Frames larger than this have their buffers kept. glibc serves
/// allocations over 32 MiB (its largest `mmap` threshold) with `mmap` and
/// unmaps them on free, so each such frame's pages were faulted in and
/// zeroed afresh. Smaller ones come from its heap, which recycles freed
/// memory itself: buffers kept out of it made the process fault more (four
/// workers holding 256 MiB of 1 to 16 MiB tensors a round over loopback:
/// 1.3 to 2.5 times the page faults, the kept buffers at their limit and
/// churning), so they are left to it.
pub const KEPT_ABOVE: usize = 32 << 20;

/// What the transports keep by default: 256 MiB (four 64 MiB tensors).
pub const DEFAULT_KEPT: usize = 256 << 20;

/// Buffers of large frames handed up, kept (up to a total capacity) so the
/// next large frame is read into memory whose pages are mapped already.
///
/// A kept buffer is the empty remainder of the `BytesMut` a frame was
/// split from: it shares its allocation with that frame, and is reused
/// only once the application has dropped every view of the frame
/// (`BytesMut::try_reclaim`). So keeping costs no memory while the frame
/// lives, and a buffer is never handed out twice. Shared by a transport's
/// connections.
///
/// ```
/// use bytes::BytesMut;
/// use rpc_core::kept::{KeptBuffers, KEPT_ABOVE};
///
/// let kept = KeptBuffers::new(256 << 20);
/// let len = KEPT_ABOVE + 1;
/// // A transport reads a large frame into a buffer, splits the frame off
/// // to hand it up, and keeps the (empty) rest.
/// let mut buf = BytesMut::zeroed(len);
/// let frame = buf.split().freeze();
/// kept.keep(buf, len);
/// assert!(kept.take(len).is_none(), "the application holds the frame");
/// // Once the application dropped it, the next large frame reuses it.
/// let at = frame.as_ptr();
/// drop(frame);
/// let next = kept.take(len).expect("the frame is gone");
/// assert_eq!((next.as_ptr(), next.len()), (at, 0));
/// ```
#[derive(Debug)]
pub struct KeptBuffers {
    limit: usize,
    /// Oldest first, with each allocation's capacity (the remainder's own
    /// capacity is 0).
    kept: Mutex<Vec<(BytesMut, usize)>>,
}

impl KeptBuffers {
    /// Keeps buffers up to `limit` bytes of capacity in all (0: none).
    pub fn new(limit: usize) -> KeptBuffers {
        KeptBuffers {
            limit,
            kept: Mutex::new(Vec::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(BytesMut, usize)>> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty buffer with room for `len` bytes whose frame is gone: the
    /// smallest kept one of `len` to `2 × len` bytes (a larger one would
    /// pin more than the frame needs while the frame lives), if any.
    pub fn take(&self, len: usize) -> Option<BytesMut> {
        if len <= KEPT_ABOVE {
            return None;
        }
        let mut kept = self.lock();
        let mut best: Option<(usize, usize)> = None;
        for (i, (buf, capacity)) in kept.iter_mut().enumerate() {
            let smaller = best.is_none_or(|(_, best)| *capacity < best);
            // `try_reclaim` takes a unique buffer back whole; one whose
            // frame lives it leaves alone.
            if smaller && (len..=2 * len).contains(capacity) && buf.try_reclaim(len) {
                best = Some((i, *capacity));
            }
        }
        best.map(|(i, _)| kept.remove(i).0)
    }

    /// Keeps `buf`, the empty remainder of a buffer of `capacity` bytes
    /// whose frame was split off and handed up, forgetting the oldest kept
    /// ones if the total would pass the limit.
    pub fn keep(&self, buf: BytesMut, capacity: usize) {
        if capacity <= KEPT_ABOVE || capacity > self.limit || !buf.is_empty() {
            return;
        }
        let mut kept = self.lock();
        let mut total: usize = kept.iter().map(|(_, c)| c).sum::<usize>() + capacity;
        let mut forget = 0;
        while total > self.limit {
            total -= kept[forget].1;
            forget += 1;
        }
        kept.drain(..forget);
        kept.push((buf, capacity));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A size class above the threshold: `n` of them.
    fn big(n: usize) -> usize {
        n * (KEPT_ABOVE / 2)
    }

    /// A buffer of `capacity` bytes whose frame filled it was split off:
    /// the frame, and the rest to keep. Zeroed by `calloc`, so its pages
    /// are not touched.
    fn handed_up(capacity: usize) -> (bytes::Bytes, BytesMut) {
        let mut buf = BytesMut::zeroed(capacity);
        (buf.split().freeze(), buf)
    }

    #[test]
    fn a_kept_buffer_comes_back_whole_once_its_frame_is_dropped() {
        let kept = KeptBuffers::new(big(16));
        let (frame, rest) = handed_up(big(3));
        let start = frame.as_ptr();
        kept.keep(rest, big(3));
        let view = frame.slice(..);
        drop(frame);
        assert!(kept.take(big(3)).is_none(), "a view of the frame lives");
        drop(view);
        let buf = kept.take(big(3)).expect("the frame is gone");
        assert_eq!((buf.as_ptr(), buf.len()), (start, 0));
        assert!(buf.capacity() >= big(3));
        assert!(kept.take(big(3)).is_none(), "handed out once");
    }

    #[test]
    fn the_smallest_buffer_that_fits_is_taken_and_none_twice_the_frame() {
        let kept = KeptBuffers::new(big(40));
        for capacity in [big(12), big(5), big(8)] {
            kept.keep(handed_up(capacity).1, capacity);
        }
        assert!(kept.take(big(13)).is_none(), "none large enough");
        assert!(
            kept.take(big(2) + 1).is_none(),
            "5 pins over 2x a frame of 2"
        );
        assert_eq!(kept.take(big(4)).unwrap().capacity(), big(5));
        assert!(kept.take(big(3)).is_none(), "8 > 2 x 3");
        assert_eq!(kept.take(big(5)).unwrap().capacity(), big(8));
        assert_eq!(kept.take(big(7)).unwrap().capacity(), big(12));
        assert!(kept.take(KEPT_ABOVE).is_none(), "small frames: the heap's");
    }

    #[test]
    fn the_oldest_are_forgotten_past_the_limit_and_small_or_huge_never_kept() {
        let kept = KeptBuffers::new(big(10));
        for capacity in [big(4), big(5), big(6)] {
            kept.keep(handed_up(capacity).1, capacity);
        }
        kept.keep(handed_up(big(11)).1, big(11));
        kept.keep(handed_up(KEPT_ABOVE).1, KEPT_ABOVE);
        let capacities: Vec<usize> = kept.lock().iter().map(|(_, c)| *c).collect();
        assert_eq!(capacities, [big(6)], "4 + 5 + 6 pass 10");
    }
}
