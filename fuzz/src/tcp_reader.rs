//! `transport_tcp::reader::FrameReader` fed what a writer sends — frames,
//! some over the limit and some past the skip limit — cut into arbitrary
//! pieces, followed by arbitrary raw bytes.
//!
//! Properties: never panics; the frames of the honest part come out whole,
//! in order and byte-exact; a frame over `max_frame_len` is reported once
//! as `Oversized` with its first bytes and skipped; `FrameTooLarge` only
//! for a length past `max_skip_len`; the buffer's capacity stays within
//! the bound `reader.rs` documents (4 × bytes received + 2 × `READ_CHUNK`
//! a stream: the connection's own and the bulk one, which raw bytes may
//! open with a piece header),
//! whatever lengths are announced; at the end of the honest part with no
//! raw tail, end-of-stream is an orderly `Ok(None)`.

use arbitrary::Arbitrary;
use rpc_core::transport::{FrameLimits, TransportError, OVERSIZED_PREFIX_LEN};
use transport_tcp::reader::{FrameReader, READ_CHUNK};

/// One run: the limit, the frames' bodies, the piece sizes the stream is
/// cut into (cycled; 0 means 1), and raw bytes after the frames.
#[derive(Debug, Arbitrary)]
pub struct Input {
    max_frame_len: u16,
    frames: Vec<Vec<u8>>,
    pieces: Vec<u16>,
    tail: Vec<u8>,
}

/// Runs the checks on one input.
pub fn check(input: &Input) {
    let max = usize::from(input.max_frame_len).max(1);
    let limits = FrameLimits { max_frame_len: max };
    let mut wire = Vec::new();
    for body in &input.frames {
        wire.extend_from_slice(&(body.len() as u32).to_le_bytes());
        wire.extend_from_slice(body);
    }
    wire.extend_from_slice(&input.tail);
    let mut reader = FrameReader::new(limits);
    let mut expected = input.frames.iter();
    let mut honest = true; // every frame so far was one of `frames`
    let mut fed = 0;
    let mut too_large = false;
    let mut pieces = input.pieces.iter().cycle();
    'feed: while fed < wire.len() {
        let piece = pieces.next().map_or(wire.len(), |&p| usize::from(p).max(1));
        let n = piece.min(wire.len() - fed);
        reader.extend_from_slice(&wire[fed..fed + n]);
        fed += n;
        assert!(
            reader.capacity() <= 4 * fed + 4 * READ_CHUNK,
            "capacity {} after {fed} bytes received",
            reader.capacity()
        );
        loop {
            let next = reader.next_frame();
            let body = match &next {
                Ok(None) => break,
                _ if !honest => None,
                _ => {
                    let body = expected.next();
                    honest = body.is_some();
                    body
                }
            };
            match next {
                Ok(None) => unreachable!("handled above"),
                Ok(Some(frame)) => {
                    assert!(frame.len() <= max, "a frame over the limit was delivered");
                    if let Some(body) = body {
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
                    if let Some(body) = body {
                        assert_eq!(len, body.len());
                        assert!(prefix == body[..OVERSIZED_PREFIX_LEN.min(len)]);
                    }
                }
                Err(TransportError::FrameTooLarge { len, .. }) => {
                    assert!(len > limits.max_skip_len());
                    if let Some(body) = body {
                        assert_eq!(len, body.len());
                    }
                    too_large = true;
                    break 'feed; // the connection ends here
                }
                // Raw bytes may open a piece of zero bytes.
                Err(TransportError::Protocol(_)) if !honest => break 'feed,
                Err(other) => panic!("unexpected error {other}"),
            }
        }
    }
    if honest && !too_large && input.tail.is_empty() && expected.next().is_none() {
        assert!(reader.is_caught_up(), "bytes left after the last frame");
        assert!(matches!(reader.end_of_stream(), Ok(None)));
    }
}
