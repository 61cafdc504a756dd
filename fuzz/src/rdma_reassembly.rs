//! `Reassembly` fed arbitrary chunk sequences (flags, total, data), under
//! arbitrary frame limits.
//!
//! Properties: never panics; a delivered frame is exactly the concatenation
//! of its chunks, an oversized one reports its announced length and the
//! first bytes of its first chunk, a too-large one is over the skip limit;
//! and the memory the reassembly holds is bounded by the bytes fed, not by
//! what the peer announces (`total`): at most twice the bytes of the frame
//! being collected, plus a constant.

use arbitrary::Arbitrary;
use transport_rdma::proto::{Assembled, Reassembly, FIRST, LAST};

use crate::alloc_meter::{held_since, live_bytes};

/// One input: the limits and the chunks.
#[derive(Debug, Arbitrary)]
pub struct ReassemblyInput {
    /// Frames up to `max_frame_len % (64 MiB)` bytes are delivered.
    pub max_frame_len: u32,
    /// Up to `max_frame_len + skip_extra % (64 MiB)` skipped.
    pub skip_extra: u32,
    /// Bytes of an oversized frame reported.
    pub prefix_len: u8,
    /// The chunks, in order.
    pub chunks: Vec<Chunk>,
}

/// One chunk message.
#[derive(Debug, Arbitrary)]
pub struct Chunk {
    /// `FIRST` / `LAST` (other bits are refused by `Header::decode` first,
    /// and so are the inputs it refuses: see [`check`]).
    pub flags: u8,
    /// The frame's length (first chunk).
    pub total: u32,
    /// The chunk's bytes.
    pub data: Vec<u8>,
}

/// Constant slack in the memory bound (allocator rounding, the empty `Vec`s).
const SLACK: usize = 256;

/// Runs the checks on one input.
pub fn check(input: &ReassemblyInput) {
    let max_frame_len = (input.max_frame_len % (64 << 20)) as usize;
    let max_skip_len = max_frame_len + (input.skip_extra % (64 << 20)) as usize;
    let prefix_len = usize::from(input.prefix_len);
    let mut reassembly = Reassembly::new(max_frame_len, max_skip_len, prefix_len);
    // The frame under way: what it announced and the bytes fed so far.
    let mut total = 0usize;
    let mut collected: Vec<u8> = Vec::new();
    for chunk in &input.chunks {
        let flags = chunk.flags & (FIRST | LAST);
        let data = &chunk.data[..];
        // What `Header::decode` lets through: no empty chunk, a first
        // chunk no longer than its frame, no total on later chunks.
        let announced = if flags & FIRST != 0 { chunk.total } else { 0 };
        if data.is_empty() || (flags & FIRST != 0 && (announced as usize) < data.len()) {
            continue;
        }
        if flags & FIRST != 0 {
            total = announced as usize;
            collected.clear();
        }
        collected.extend_from_slice(data);
        let before = live_bytes();
        let result = reassembly.chunk(flags, announced, data);
        let held = held_since(before);
        assert!(
            held <= 2 * collected.len() + SLACK,
            "reassembly holds {held} bytes after {} bytes of a frame announcing {total}",
            collected.len()
        );
        let verdict = match result {
            Ok(verdict) => verdict,
            // A protocol error closes the connection: nothing more arrives.
            Err(_) => return,
        };
        match verdict {
            None => {}
            Some(Assembled::Frame(frame)) => {
                assert!(
                    flags & LAST != 0,
                    "a frame completed on a chunk not marked last"
                );
                assert_eq!(
                    frame.len(),
                    total,
                    "frame length is not the announced total"
                );
                assert!(frame.len() <= max_frame_len);
                assert_eq!(frame, collected, "frame is not its chunks' bytes");
            }
            Some(Assembled::Oversized { len, prefix }) => {
                assert!(flags & FIRST != 0, "oversized reported on a later chunk");
                assert_eq!(len, total);
                assert!(len > max_frame_len && len <= max_skip_len);
                assert_eq!(prefix[..], data[..prefix_len.min(data.len())]);
            }
            Some(Assembled::TooLarge { len }) => {
                assert!(flags & FIRST != 0, "too large reported on a later chunk");
                assert_eq!(len, total);
                assert!(len > max_skip_len);
                // The connection closes.
                return;
            }
        }
    }
}
