//! `RegionReader` (the receiving side of the large-payload region, which
//! checks every chunk the peer announces) against arbitrary announcements
//! and frees, next to a `RegionWriter` that plays an honest peer.
//!
//! Properties: nothing panics; every accepted chunk lies inside the region
//! (`offset + len <= region_len`, `offset == pos % region_len`) and does
//! not overlap any accepted chunk not yet freed; while only the honest
//! writer's chunks were accepted, the reader accepts everything the writer
//! allocates and the writer accepts every `freed_to` the reader reports;
//! `RegionWriter::on_freed` turns any bogus position into an error.

use std::collections::VecDeque;

use arbitrary::Arbitrary;
use transport_rdma::proto::{max_chunk, RegionReader, RegionWriter};

/// One input: a region size and a sequence of events.
#[derive(Debug, Arbitrary)]
pub struct RegionInput {
    /// Region length is `2 + region_len % 8192` (small, so the sequence wraps it often).
    pub region_len: u16,
    /// What happens, in order.
    pub ops: Vec<RegionOp>,
}

/// One event.
#[derive(Debug, Arbitrary)]
pub enum RegionOp {
    /// The honest writer allocates `1 + n % max_chunk` bytes and, when it
    /// gets space, announces the chunk to the reader.
    Write(u32),
    /// The peer announces an arbitrary chunk.
    Announce {
        /// Stream position.
        pos: u64,
        /// Length.
        len: u64,
    },
    /// The peer announces a chunk near where the reader expects the next one.
    AnnounceNear {
        /// Offset from the reader's last accepted end.
        delta: i16,
        /// Length.
        len: u16,
    },
    /// The application consumed the oldest accepted chunk: free through its end.
    FreeOldest,
    /// Everything accepted was consumed.
    FreeAll,
    /// The reader reports `freed_to` to the writer (if it wants to).
    Report,
    /// The writer receives an arbitrary `freed_to` from a lying peer.
    BogusFreed(u64),
}

/// Runs the checks on one input.
pub fn check(input: &RegionInput) {
    let len = 2 + u64::from(input.region_len) % 8192;
    let mut writer = RegionWriter::new(len);
    let mut reader = RegionReader::new(len);
    // Accepted, not yet freed: (pos, n), in arrival order.
    let mut unfreed: VecDeque<(u64, u64)> = VecDeque::new();
    let mut accepted_end = 0u64;
    let mut honest = true;
    let mut writer_head = 0u64;
    for op in &input.ops {
        match *op {
            RegionOp::Write(n) => {
                let n = 1 + u64::from(n) % writer.max_chunk();
                let Some(pos) = writer.alloc(n) else {
                    continue;
                };
                assert!(pos >= writer_head, "writer went back");
                writer_head = pos + n;
                assert!(
                    writer.offset(pos) as u64 + n <= len,
                    "writer chunk past the end"
                );
                assert!(writer.in_use() <= len);
                let verdict = accept(&mut reader, &mut unfreed, &mut accepted_end, len, pos, n);
                if honest {
                    assert!(
                        verdict,
                        "reader refused the honest writer's chunk {pos}+{n}"
                    );
                }
            }
            RegionOp::Announce { pos, len: n } => {
                if accept(&mut reader, &mut unfreed, &mut accepted_end, len, pos, n) {
                    honest = false;
                }
            }
            RegionOp::AnnounceNear { delta, len: n } => {
                let pos = accepted_end.saturating_add_signed(delta.into());
                if accept(
                    &mut reader,
                    &mut unfreed,
                    &mut accepted_end,
                    len,
                    pos,
                    n.into(),
                ) {
                    honest = false;
                }
            }
            RegionOp::FreeOldest => {
                if let Some((pos, n)) = unfreed.pop_front() {
                    reader.free_through(pos + n);
                }
            }
            RegionOp::FreeAll => {
                reader.free_all();
                unfreed.clear();
            }
            RegionOp::Report => {
                if reader.wants_report() {
                    let freed_to = reader.report();
                    let result = writer.on_freed(freed_to);
                    if honest {
                        result.expect("writer refused the reader's honest report");
                    }
                }
            }
            RegionOp::BogusFreed(freed_to) => {
                let before = writer.in_use();
                if writer.on_freed(freed_to).is_ok() {
                    assert!(writer.in_use() <= before, "a free grew the allocation");
                } else {
                    assert_eq!(writer.in_use(), before, "a refused free changed the writer");
                }
                // The writer now thinks space is free that the reader has not freed.
                honest = false;
            }
        }
    }
}

/// Announces (pos, n) to the reader and checks its verdict; true if accepted.
fn accept(
    reader: &mut RegionReader,
    unfreed: &mut VecDeque<(u64, u64)>,
    accepted_end: &mut u64,
    len: u64,
    pos: u64,
    n: u64,
) -> bool {
    let Ok(offset) = reader.accept(pos, n) else {
        return false;
    };
    let offset = offset as u64;
    assert!(
        n >= 1 && n <= max_chunk(len),
        "accepted a chunk of {n} bytes"
    );
    assert_eq!(offset, pos % len, "offset is not the position's");
    assert!(
        offset + n <= len,
        "accepted chunk {offset}+{n} past the region's end {len}"
    );
    assert!(pos >= *accepted_end, "accepted a chunk behind the last one");
    for &(p, m) in unfreed.iter() {
        let o = p % len;
        assert!(
            offset + n <= o || o + m <= offset,
            "accepted chunk {pos}+{n} (offset {offset}) overlaps unfreed chunk {p}+{m} (offset {o})"
        );
    }
    unfreed.push_back((pos, n));
    *accepted_end = pos + n;
    true
}
