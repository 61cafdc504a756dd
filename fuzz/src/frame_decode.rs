//! `rpc_core::frame::Frame::decode` and `peek_head` on arbitrary bytes.
//!
//! Properties: neither panics; whatever decodes has a head `peek_head`
//! reads the same way (whole, or from its first `HEAD_LEN` bytes alone, as
//! for an oversized frame); re-encoding a decoded frame gives a frame of
//! the same length that decodes to the same value, and is a fixed point
//! (the format has two non-canonical spots: the timeout field without
//! `HAS_TIMEOUT`, and status codes outside gRPC's range, which decode as
//! `Unknown`, so the bytes themselves may differ there).

use bytes::Bytes;
use rpc_core::frame::{peek_head, EncodePayload, Frame, FrameBody, OutBody, OutFrame, HEAD_LEN};

/// Runs the checks on one input.
pub fn check(data: &[u8]) {
    let peeked = peek_head(data);
    let Ok(frame) = Frame::decode(Bytes::copy_from_slice(data)) else {
        return;
    };
    let head = (frame.call_id, frame.body.kind());
    assert_eq!(
        peeked.as_ref().ok(),
        Some(&head),
        "peek_head disagrees with decode"
    );
    assert_eq!(
        peek_head(&data[..HEAD_LEN]).ok(),
        Some(head),
        "peek_head on the head alone disagrees with decode"
    );
    let encoded = encode(&frame);
    assert_eq!(encoded.len(), data.len(), "re-encoded length differs");
    let again = Frame::decode(encoded.clone()).expect("a re-encoded frame decodes");
    assert_eq!(again, frame, "re-encoded frame decodes differently");
    assert_eq!(encode(&again), encoded, "encoding is not a fixed point");
}

/// Encodes a decoded frame with the encoder the runtime uses.
pub fn encode(frame: &Frame) -> Bytes {
    let body = match &frame.body {
        FrameBody::Request {
            method,
            timeout,
            metadata,
        } => OutBody::Request {
            method,
            timeout: *timeout,
            metadata,
        },
        FrameBody::Message => OutBody::Message,
        FrameBody::Status(status) => OutBody::Status(status),
        FrameBody::Cancel => OutBody::Cancel,
        FrameBody::WindowUpdate(n) => OutBody::WindowUpdate(*n),
        FrameBody::GoAway(status) => OutBody::GoAway(status),
        FrameBody::Ping => OutBody::Ping,
        FrameBody::Pong => OutBody::Pong,
    };
    let payload = frame.payload.as_ref().map(|p| p as &dyn EncodePayload);
    OutFrame::new(frame.call_id, body, payload, frame.end_stream)
        .expect("a decoded frame's header fields are within the limit")
        .to_bytes()
}
