//! `transport_tcp::reader::FrameReader` fed what a writer sends — frames,
//! some over the limit and some past the skip limit, some sent whole and
//! some in the bulk stream's pieces between the others — cut into
//! arbitrary reads, followed by arbitrary raw bytes.
//!
//! Properties: never panics; the frames of the honest part come out whole,
//! byte-exact and, within each stream, in order (each frame starts with
//! its index, so the check knows which it is); a frame over
//! `max_frame_len` is reported once as `Oversized` with its first bytes
//! and skipped; `FrameTooLarge` only for a length past `max_skip_len`; the
//! buffers' capacity stays within the bound `reader.rs` documents (4 ×
//! bytes received + 2 × `READ_CHUNK` a stream: the connection's own and
//! the bulk one, which raw bytes may open with a piece header), whatever
//! lengths are announced; at the end of the honest part with no raw tail,
//! end-of-stream is an orderly `Ok(None)`.

use arbitrary::Arbitrary;
use rpc_core::transport::{FrameLimits, TransportError, OVERSIZED_PREFIX_LEN};
use transport_tcp::reader::{FrameReader, PIECE, READ_CHUNK};

/// One run: the limit, the frames' bodies, which of them go in pieces
/// (frame `i` if bit `i % 8` is set), the sizes of the reads the wire is
/// cut into and of the pieces (both cycled; 0 means 1), and raw bytes
/// after the frames.
#[derive(Debug, Arbitrary)]
pub struct Input {
    max_frame_len: u16,
    frames: Vec<Vec<u8>>,
    in_pieces: u8,
    pieces: Vec<u16>,
    tail: Vec<u8>,
}

/// Which stream a frame went in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    Own,
    Bulk,
}

/// Runs the checks on one input.
pub fn check(input: &Input) {
    let max = usize::from(input.max_frame_len).max(1);
    let limits = FrameLimits { max_frame_len: max };
    // Each frame starts with its index.
    let sent: Vec<(Stream, Vec<u8>)> = input
        .frames
        .iter()
        .enumerate()
        .map(|(i, body)| {
            let stream = if input.in_pieces & (1 << (i % 8)) != 0 {
                Stream::Bulk
            } else {
                Stream::Own
            };
            let mut tagged = (i as u16).to_le_bytes().to_vec();
            tagged.extend_from_slice(body);
            (stream, tagged)
        })
        .collect();
    let mut sizes = input.pieces.iter().cycle().map(|&p| usize::from(p).max(1));
    // A piece of the bulk stream after each frame sent whole, the rest in
    // pieces at the end.
    let (mut wire, mut bulk) = (Vec::new(), Vec::new());
    let put_piece = |wire: &mut Vec<u8>, bulk: &mut Vec<u8>, n: usize| {
        let n = n.min(bulk.len());
        if n > 0 {
            wire.extend_from_slice(&(n as u32 | PIECE).to_le_bytes());
            wire.extend(bulk.drain(..n));
        }
    };
    for (stream, body) in &sent {
        let out = match stream {
            Stream::Own => &mut wire,
            Stream::Bulk => &mut bulk,
        };
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(body);
        if *stream == Stream::Own {
            put_piece(&mut wire, &mut bulk, sizes.next().unwrap_or(usize::MAX));
        }
    }
    while !bulk.is_empty() {
        put_piece(&mut wire, &mut bulk, sizes.next().unwrap_or(usize::MAX));
    }
    wire.extend_from_slice(&input.tail);
    let mut reader = FrameReader::new(limits);
    // The next index expected of each stream.
    let next_of = |stream: Stream, from: usize| {
        (from..sent.len())
            .find(|&i| sent[i].0 == stream)
            .unwrap_or(sent.len())
    };
    let mut next = [next_of(Stream::Own, 0), next_of(Stream::Bulk, 0)];
    let honest = |next: &[usize; 2]| next[0] < sent.len() || next[1] < sent.len();
    // The honest frame `head` (a frame's first bytes) is, checked to be
    // the next of its stream.
    let take = |next: &mut [usize; 2], head: &[u8]| -> &[u8] {
        let index = usize::from(u16::from_le_bytes(
            head.get(..2)
                .expect("an index")
                .try_into()
                .expect("2 bytes"),
        ));
        let stream = sent.get(index).expect("an index sent").0;
        let at = &mut next[stream as usize];
        assert_eq!(index, *at, "frames of the {stream:?} stream out of order");
        *at = next_of(stream, index + 1);
        &sent[index].1
    };
    let mut fed = 0;
    let mut too_large = false;
    let mut reads = input.pieces.iter().rev().cycle();
    'feed: while fed < wire.len() {
        let read = reads.next().map_or(wire.len(), |&p| usize::from(p).max(1));
        let n = read.min(wire.len() - fed);
        reader.extend_from_slice(&wire[fed..fed + n]);
        fed += n;
        assert!(
            reader.capacity() <= 4 * fed + 4 * READ_CHUNK,
            "capacity {} after {fed} bytes received",
            reader.capacity()
        );
        loop {
            let was_honest = honest(&next);
            match reader.next_frame() {
                Ok(None) => break,
                Ok(Some(frame)) => {
                    assert!(frame.len() <= max, "a frame over the limit was delivered");
                    if was_honest {
                        let body = take(&mut next, &frame);
                        assert!(frame == body[..], "a frame differs from what was sent");
                    }
                }
                Err(TransportError::Oversized {
                    len,
                    max: limit,
                    prefix,
                }) => {
                    assert_eq!(limit, max);
                    assert!(len > max && len <= limits.max_skip_len());
                    if was_honest {
                        let body = take(&mut next, &prefix);
                        assert_eq!(len, body.len());
                        assert!(prefix == body[..OVERSIZED_PREFIX_LEN.min(len)]);
                    }
                }
                Err(TransportError::FrameTooLarge { len, .. }) => {
                    assert!(len > limits.max_skip_len());
                    too_large = true;
                    break 'feed; // the connection ends here
                }
                // Raw bytes may open a piece of zero bytes.
                Err(TransportError::Protocol(_)) if !was_honest => break 'feed,
                Err(other) => panic!("unexpected error {other}"),
            }
        }
    }
    if !too_large && input.tail.is_empty() {
        assert!(!honest(&next), "frames sent and not delivered");
        assert!(reader.is_caught_up(), "bytes left after the last frame");
        assert!(matches!(reader.end_of_stream(), Ok(None)));
    }
}
