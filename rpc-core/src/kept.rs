//! Buffers that large frames were received into, kept for the next ones:
//! a transport reads a large frame into one whose frame the application
//! has dropped, with its pages mapped already, instead of fresh memory the
//! kernel faults in and zeroes as bytes arrive.

use std::sync::Mutex;

use bytes::BytesMut;

/// Frames this large and larger have their buffers kept. Smaller ones come
/// from the allocator's heap, whose freed memory it reuses with its pages
/// mapped; glibc serves chunks over 32 MiB with `mmap` and unmaps them on
/// free, so each such frame's pages were faulted in afresh (64 MiB pulls
/// over loopback ran at 0.75× the speed of a doubling buffer that was
/// reused). From 1 MiB up, a kept buffer's reuse saves at least the zeroed
/// pages a fresh one costs, and the list stays short (at most `limit` /
/// 1 MiB entries).
pub const KEPT_FROM: usize = 1 << 20;

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
        if len < KEPT_FROM {
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
        if capacity < KEPT_FROM || capacity > self.limit || !buf.is_empty() {
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

    const MIB: usize = 1 << 20;

    /// A buffer of `capacity` bytes whose frame of `capacity` bytes was
    /// split off: the frame, and the remainder to keep.
    fn handed_up(capacity: usize) -> (bytes::Bytes, BytesMut) {
        let mut buf = BytesMut::with_capacity(capacity);
        buf.resize(capacity, 7);
        let frame = buf.split_to(capacity).freeze();
        (frame, buf)
    }

    #[test]
    fn a_kept_buffer_comes_back_whole_once_its_frame_is_dropped() {
        let kept = KeptBuffers::new(64 * MIB);
        let (frame, rest) = handed_up(2 * MIB);
        let start = frame.as_ptr();
        kept.keep(rest, 2 * MIB);
        let view = frame.slice(10..20);
        drop(frame);
        assert!(kept.take(2 * MIB).is_none(), "a view of the frame lives");
        drop(view);
        let buf = kept.take(2 * MIB).expect("the frame is gone");
        assert_eq!((buf.as_ptr(), buf.len()), (start, 0));
        assert!(buf.capacity() >= 2 * MIB);
        assert!(kept.take(2 * MIB).is_none(), "handed out once");
    }

    #[test]
    fn the_smallest_buffer_that_fits_is_taken_and_none_twice_the_frame() {
        let kept = KeptBuffers::new(64 * MIB);
        for capacity in [8 * MIB, 3 * MIB, 5 * MIB] {
            kept.keep(handed_up(capacity).1, capacity);
        }
        assert!(kept.take(9 * MIB).is_none(), "none large enough");
        assert!(kept.take(MIB).is_none(), "3 MiB pins 3x a 1 MiB frame");
        assert_eq!(kept.take(2 * MIB).unwrap().capacity(), 3 * MIB);
        assert!(kept.take(2 * MIB).is_none(), "5 MiB > 2 x 2 MiB");
        assert_eq!(kept.take(4 * MIB).unwrap().capacity(), 5 * MIB);
        assert_eq!(kept.take(4 * MIB).unwrap().capacity(), 8 * MIB);
        assert!(
            kept.take(KEPT_FROM - 1).is_none(),
            "small frames: the heap's"
        );
    }

    #[test]
    fn the_oldest_are_forgotten_past_the_limit_and_small_or_huge_never_kept() {
        let kept = KeptBuffers::new(10 * MIB);
        for capacity in [4 * MIB, 5 * MIB, 6 * MIB] {
            kept.keep(handed_up(capacity).1, capacity);
        }
        kept.keep(handed_up(11 * MIB).1, 11 * MIB);
        kept.keep(handed_up(KEPT_FROM / 2).1, KEPT_FROM / 2);
        let capacities: Vec<usize> = kept.lock().iter().map(|(_, c)| *c).collect();
        assert_eq!(capacities, [6 * MIB], "4 + 5 + 6 MiB pass 10");
    }
}
