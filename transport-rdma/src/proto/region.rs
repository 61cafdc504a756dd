//! The large-payload region: a ring allocator over the receiver's region,
//! allocating and freeing in order.
//!
//! Both sides count in *stream positions* (`u64`, never wrapping): a chunk
//! at position `pos` lies at offset `pos % len`. A chunk never wraps the
//! region's end: when it does not fit before the end, it starts at the next
//! multiple of `len`, and the bytes skipped count as used until freed. The
//! receiver frees in arrival order and reports how far it has freed
//! (`freed_to`); both sides apply the same rule, so the receiver knows
//! exactly where the next chunk must be and rejects anything else.

use super::ProtocolError;

/// Where a chunk of `n` bytes goes when the next free position is `head`.
fn place(head: u64, n: u64, len: u64) -> u64 {
    if head % len + n > len {
        head.next_multiple_of(len)
    } else {
        head
    }
}

/// The largest chunk for a region of `len` bytes: half of it, so that a
/// chunk always fits once everything before it is freed.
pub fn max_chunk(len: u64) -> u64 {
    len / 2
}

/// The sender's allocator over the peer's region (and its own staging
/// region of the same size, at the same offsets).
#[derive(Debug, Clone)]
pub struct RegionWriter {
    len: u64,
    head: u64,
    tail: u64,
}

impl RegionWriter {
    /// An empty region of `len` bytes.
    pub fn new(len: u64) -> RegionWriter {
        assert!(len >= 2, "region too small");
        RegionWriter {
            len,
            head: 0,
            tail: 0,
        }
    }

    /// The largest chunk [`alloc`](Self::alloc) accepts.
    pub fn max_chunk(&self) -> u64 {
        max_chunk(self.len)
    }

    /// Bytes allocated and not yet freed (skipped bytes included).
    pub fn in_use(&self) -> u64 {
        self.head - self.tail
    }

    /// Allocates `n` bytes (`1..=max_chunk`), returning the stream
    /// position, or `None` while there is not enough free space.
    pub fn alloc(&mut self, n: u64) -> Option<u64> {
        assert!(n > 0 && n <= self.max_chunk(), "chunk of {n} bytes");
        let pos = place(self.head, n, self.len);
        if pos + n - self.tail > self.len {
            return None;
        }
        self.head = pos + n;
        Some(pos)
    }

    /// Where the next allocation starts looking (the end of the newest
    /// one): pass it to [`roll_back_to`](Self::roll_back_to) to undo the
    /// allocations made after reading it.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Undoes the allocations made since [`head`](Self::head) returned
    /// `head` (the newest ones: allocation is in order, so they are the
    /// last bytes allocated). For space allocated to a frame that was never
    /// sent (its encoding panicked); nothing announced to the peer may lie
    /// beyond `head`. Panics if `head` is not between the freed and the
    /// allocated end.
    pub fn roll_back_to(&mut self, head: u64) {
        assert!(
            self.tail <= head && head <= self.head,
            "roll back to {head}, outside {}..={}",
            self.tail,
            self.head
        );
        self.head = head;
    }

    /// The offset in the region of stream position `pos`.
    pub fn offset(&self, pos: u64) -> usize {
        (pos % self.len) as usize
    }

    /// The peer freed its region up to `freed_to`; it may not go back, nor
    /// beyond what was allocated.
    pub fn on_freed(&mut self, freed_to: u64) -> Result<(), ProtocolError> {
        if freed_to < self.tail || freed_to > self.head {
            return Err(ProtocolError::new(format!(
                "peer freed its region to {freed_to}, outside {}..={}",
                self.tail, self.head
            )));
        }
        self.tail = freed_to;
        Ok(())
    }
}

/// The receiver's side of its region: validates each announced chunk
/// against the allocation rule and tracks what it freed.
#[derive(Debug, Clone)]
pub struct RegionReader {
    len: u64,
    head: u64,
    freed_to: u64,
    reported: u64,
}

impl RegionReader {
    /// A region of `len` bytes, all free.
    pub fn new(len: u64) -> RegionReader {
        RegionReader {
            len,
            head: 0,
            freed_to: 0,
            reported: 0,
        }
    }

    /// Checks an announced chunk (`pos`, `n` bytes) and returns its offset
    /// in the region: it must be exactly where the allocation rule puts the
    /// next chunk, at most [`max_chunk`] long, and inside free space.
    pub fn accept(&mut self, pos: u64, n: u64) -> Result<usize, ProtocolError> {
        if n == 0 || n > max_chunk(self.len) {
            return Err(ProtocolError::new(format!(
                "chunk of {n} bytes (region chunks are 1..={} bytes)",
                max_chunk(self.len)
            )));
        }
        let expected = place(self.head, n, self.len);
        if pos != expected {
            return Err(ProtocolError::new(format!(
                "chunk at region position {pos}, expected {expected}"
            )));
        }
        if pos + n - self.freed_to > self.len {
            return Err(ProtocolError::new(format!(
                "chunk at {pos} of {n} bytes overruns the region (freed to {})",
                self.freed_to
            )));
        }
        self.head = pos + n;
        let offset = (pos % self.len) as usize;
        debug_assert!(offset as u64 + n <= self.len);
        Ok(offset)
    }

    /// The chunks before stream position `end` (an accepted chunk's end)
    /// have been consumed: free them.
    pub fn free_through(&mut self, end: u64) {
        assert!(
            end >= self.freed_to && end <= self.head,
            "free_through({end}) outside {}..={}",
            self.freed_to,
            self.head
        );
        self.freed_to = end;
    }

    /// Everything accepted so far has been consumed: free it.
    pub fn free_all(&mut self) {
        self.freed_to = self.head;
    }

    /// Whether every chunk accepted so far has been freed.
    pub fn all_freed(&self) -> bool {
        self.freed_to == self.head
    }

    /// Whether freed space waits to be reported to the peer.
    pub fn wants_report(&self) -> bool {
        self.freed_to > self.reported
    }

    /// The position to report (`freed_to` of the next header).
    pub fn report(&mut self) -> u64 {
        self.reported = self.freed_to;
        self.freed_to
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rolling_back_the_newest_allocation_frees_its_space_and_its_skip() {
        let mut w = RegionWriter::new(100);
        assert_eq!(w.alloc(40), Some(0));
        assert_eq!(w.alloc(40), Some(40));
        w.on_freed(80).unwrap();
        let before = w.head();
        // 30 bytes do not fit before the end: the chunk skips to 100.
        assert_eq!(w.alloc(30), Some(100));
        assert_eq!(w.in_use(), 50, "the skipped 20 bytes count as used");
        w.roll_back_to(before);
        assert_eq!(w.in_use(), 0, "the chunk and its skip went back");
        // Placed exactly as before: the peer's reader sees no gap.
        assert_eq!(w.alloc(30), Some(100));
    }

    #[test]
    fn allocates_in_order_and_skips_the_tail() {
        let mut w = RegionWriter::new(100);
        let mut r = RegionReader::new(100);
        assert_eq!(w.alloc(40), Some(0));
        assert_eq!(w.alloc(40), Some(40));
        assert_eq!(w.alloc(30), None, "only 20 left");
        assert_eq!(r.accept(0, 40), Ok(0));
        assert_eq!(r.accept(40, 40), Ok(40));
        r.free_all();
        w.on_freed(r.report()).unwrap();
        // 30 does not fit in 80..100: skipped to 100.
        assert_eq!(w.alloc(30), Some(100));
        assert_eq!(w.offset(100), 0);
        assert_eq!(r.accept(100, 30), Ok(0));
        assert_eq!(w.in_use(), 50);
    }

    #[test]
    fn rejects_misplaced_and_oversized_chunks() {
        let mut r = RegionReader::new(100);
        assert!(r.accept(0, 0).is_err());
        assert!(r.accept(0, 51).is_err());
        assert!(r.accept(10, 20).is_err());
        assert_eq!(r.accept(0, 50), Ok(0));
        assert_eq!(r.accept(50, 50), Ok(50));
        assert!(r.accept(100, 10).is_err(), "nothing freed yet");
        let mut w = RegionWriter::new(100);
        assert!(w.on_freed(1).is_err(), "freed beyond allocation");
        w.alloc(10).unwrap();
        w.on_freed(10).unwrap();
        assert!(w.on_freed(5).is_err(), "went back");
    }

    #[test]
    fn half_region_chunk_always_fits_after_free() {
        for start in 0..100u64 {
            let mut w = RegionWriter::new(100);
            if start > 0 {
                w.alloc(start.min(50)).unwrap();
                let h = w.head;
                w.on_freed(h).unwrap();
            }
            assert!(w.alloc(50).is_some(), "after {start}");
        }
    }
}
