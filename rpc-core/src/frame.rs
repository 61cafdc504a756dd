//! The wire format: one [`Frame`] per transport message, no I/O.
//!
//! Every frame starts with a fixed 20-byte head (integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | protocol version ([`PROTOCOL_VERSION`]) |
//! | 1 | 1 | kind ([`FrameKind`]) |
//! | 2 | 1 | flags: `END_STREAM` 1, `HAS_PAYLOAD` 2, `HAS_TIMEOUT` 4 |
//! | 3 | 1 | reserved, 0 |
//! | 4 | 8 | call id |
//! | 12 | 4 | length H of the kind's header fields |
//! | 16 | 4 | length P of the payload |
//! | 20 | H | header fields (below) |
//! | 20+H | P | payload: one encoded message |
//!
//! Header fields by kind (strings are UTF-8, `len` prefixes are u16 for the
//! method and metadata keys, u32 for messages and metadata values):
//! - `Request`: method (`/package.Service/Method`), u64 timeout in µs
//!   (meaningful with `HAS_TIMEOUT`), metadata.
//! - `Status`: u32 code, message, metadata (trailers).
//! - `WindowUpdate`: u32 bytes granted.
//! - `GoAway`: u32 code, message.
//! - `Message`, `Cancel`, `Ping`, `Pong`: none.
//!
//! Metadata is a u16 count, then per entry the key and the value.
//!
//! A transport carries whole frames; the frame's own lengths must add up to
//! the transport message's length, so a peer that lies about a length is
//! caught here before anything is read past the frame.

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};

use crate::metadata::{is_valid_key, MetadataMap};

mod gather;
use crate::status::{Code, Status};
pub use gather::{Gather, GATHER_THRESHOLD};

/// The protocol version this build speaks. A frame with another version is refused.
pub const PROTOCOL_VERSION: u8 = 1;

/// Size of the fixed head every frame starts with.
pub const HEAD_LEN: usize = 20;

/// Largest header-field section accepted (method, metadata, status message).
pub const MAX_HEADER_LEN: usize = 64 * 1024;

const END_STREAM: u8 = 1;
const HAS_PAYLOAD: u8 = 2;
const HAS_TIMEOUT: u8 = 4;
const KNOWN_FLAGS: u8 = END_STREAM | HAS_PAYLOAD | HAS_TIMEOUT;

/// What a frame is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Client → server: opens a call (method, deadline, metadata), maybe with its first message.
    Request = 1,
    /// Either way: a message of an open call, or just the end of the sender's stream.
    Message = 2,
    /// Server → client: the call's final status, maybe with its last message.
    Status = 3,
    /// Client → server: the client gave up on the call.
    Cancel = 4,
    /// Either way: the receiver grants the sender more bytes on a stream.
    WindowUpdate = 5,
    /// Either way, call id 0: no new calls on this connection (with an error code: the connection is failing).
    GoAway = 6,
    /// Either way, call id 0: are you there? Answered by `Pong`.
    Ping = 7,
    /// Either way, call id 0: the answer to `Ping`.
    Pong = 8,
}

impl FrameKind {
    fn from_u8(value: u8) -> Option<FrameKind> {
        Some(match value {
            1 => FrameKind::Request,
            2 => FrameKind::Message,
            3 => FrameKind::Status,
            4 => FrameKind::Cancel,
            5 => FrameKind::WindowUpdate,
            6 => FrameKind::GoAway,
            7 => FrameKind::Ping,
            8 => FrameKind::Pong,
            _ => return None,
        })
    }
}

/// A frame that breaks the protocol. The connection it came on is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The peer speaks another protocol version.
    #[error("peer speaks protocol version {got}, this build speaks version {PROTOCOL_VERSION}")]
    UnsupportedVersion {
        /// The version the peer sent.
        got: u8,
    },
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Unknown flag bits, or a non-zero reserved byte.
    #[error("frame has unknown flags {flags:#04x} or reserved byte {reserved:#04x}")]
    BadFlags {
        /// The flags byte.
        flags: u8,
        /// The reserved byte.
        reserved: u8,
    },
    /// The lengths in the head do not add up to the frame's length.
    #[error("frame lengths disagree: head says {header} + {payload} bytes after the head, frame has {actual}")]
    LengthMismatch {
        /// Header-field length from the head.
        header: u32,
        /// Payload length from the head.
        payload: u32,
        /// Bytes actually present after the head.
        actual: usize,
    },
    /// The frame is shorter than its head or one of its fields.
    #[error("frame truncated in {0}")]
    Truncated(&'static str),
    /// The header fields are larger than [`MAX_HEADER_LEN`].
    #[error("frame header fields of {0} bytes exceed the limit of {MAX_HEADER_LEN}")]
    HeaderTooLarge(usize),
    /// A string field is not UTF-8, or a metadata key has forbidden characters.
    #[error("invalid {0}")]
    Invalid(&'static str),
    /// The header fields have bytes left over after the last field.
    #[error("{0} trailing bytes after the header fields")]
    TrailingBytes(usize),
    /// A kind that never carries a payload or flags came with one.
    #[error("{kind:?} frame with unexpected payload or flags")]
    Unexpected {
        /// The frame's kind.
        kind: FrameKind,
    },
}

/// A decoded frame. Byte fields point into the received buffer (no copies).
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// The call this frame belongs to (0 for connection-level frames).
    pub call_id: u64,
    /// Whether the sender will send no more messages on this call.
    pub end_stream: bool,
    /// The encoded message the frame carries, if any.
    pub payload: Option<Bytes>,
    /// The kind and its fields.
    pub body: FrameBody,
}

/// The kind-specific part of a frame.
#[derive(Debug, Clone, PartialEq)]
pub enum FrameBody {
    /// See [`FrameKind::Request`].
    Request {
        /// `/package.Service/Method`.
        method: MethodPath,
        /// Time the client allows, measured from when it sent the frame.
        timeout: Option<Duration>,
        /// Request metadata.
        metadata: MetadataMap,
    },
    /// See [`FrameKind::Message`].
    Message,
    /// See [`FrameKind::Status`].
    Status(Status),
    /// See [`FrameKind::Cancel`].
    Cancel,
    /// See [`FrameKind::WindowUpdate`].
    WindowUpdate(u32),
    /// See [`FrameKind::GoAway`].
    GoAway(Status),
    /// See [`FrameKind::Ping`].
    Ping,
    /// See [`FrameKind::Pong`].
    Pong,
}

impl FrameBody {
    /// The kind of this body.
    pub fn kind(&self) -> FrameKind {
        match self {
            FrameBody::Request { .. } => FrameKind::Request,
            FrameBody::Message => FrameKind::Message,
            FrameBody::Status(_) => FrameKind::Status,
            FrameBody::Cancel => FrameKind::Cancel,
            FrameBody::WindowUpdate(_) => FrameKind::WindowUpdate,
            FrameBody::GoAway(_) => FrameKind::GoAway,
            FrameBody::Ping => FrameKind::Ping,
            FrameBody::Pong => FrameKind::Pong,
        }
    }
}

impl Frame {
    /// Decodes one whole frame.
    pub fn decode(mut frame: Bytes) -> Result<Frame, FrameError> {
        if frame.len() < HEAD_LEN {
            return Err(FrameError::Truncated("head"));
        }
        let version = frame.get_u8();
        if version != PROTOCOL_VERSION {
            return Err(FrameError::UnsupportedVersion { got: version });
        }
        let raw_kind = frame.get_u8();
        let kind = FrameKind::from_u8(raw_kind).ok_or(FrameError::UnknownKind(raw_kind))?;
        let flags = frame.get_u8();
        let reserved = frame.get_u8();
        if flags & !KNOWN_FLAGS != 0 || reserved != 0 {
            return Err(FrameError::BadFlags { flags, reserved });
        }
        let call_id = frame.get_u64_le();
        let header_len = frame.get_u32_le();
        let payload_len = frame.get_u32_le();
        if header_len as u64 + payload_len as u64 != frame.len() as u64 {
            return Err(FrameError::LengthMismatch {
                header: header_len,
                payload: payload_len,
                actual: frame.len(),
            });
        }
        if header_len as usize > MAX_HEADER_LEN {
            return Err(FrameError::HeaderTooLarge(header_len as usize));
        }
        let has_payload = flags & HAS_PAYLOAD != 0;
        if !has_payload && frame.len() != header_len as usize {
            return Err(FrameError::Unexpected { kind });
        }
        // Read in place: only metadata values become `Bytes` of the frame.
        let whole = &frame;
        let mut fields: &[u8] = &whole[..header_len as usize];
        let end_stream = flags & END_STREAM != 0;
        let unexpected = |allowed: u8| {
            if flags & !allowed != 0 {
                Err(FrameError::Unexpected { kind })
            } else {
                Ok(())
            }
        };

        let body = match kind {
            FrameKind::Request => {
                unexpected(END_STREAM | HAS_PAYLOAD | HAS_TIMEOUT)?;
                let method = MethodPath::of(whole, get_bytes(&mut fields, 2, "method")?)?;
                let micros = get_u64(&mut fields, "timeout")?;
                let timeout = (flags & HAS_TIMEOUT != 0).then(|| Duration::from_micros(micros));
                let metadata = get_metadata(whole, &mut fields)?;
                FrameBody::Request {
                    method,
                    timeout,
                    metadata,
                }
            }
            FrameKind::Message => {
                unexpected(END_STREAM | HAS_PAYLOAD)?;
                FrameBody::Message
            }
            FrameKind::Status => {
                unexpected(HAS_PAYLOAD)?;
                let code = Code::from_u32(get_u32(&mut fields, "status code")?);
                let message = get_string(&mut fields, 4, "status message")?;
                let metadata = get_metadata(whole, &mut fields)?;
                FrameBody::Status(Status::from_parts(code, message, metadata))
            }
            FrameKind::Cancel => {
                unexpected(0)?;
                FrameBody::Cancel
            }
            FrameKind::WindowUpdate => {
                unexpected(0)?;
                FrameBody::WindowUpdate(get_u32(&mut fields, "window increment")?)
            }
            FrameKind::Ping => {
                unexpected(0)?;
                FrameBody::Ping
            }
            FrameKind::Pong => {
                unexpected(0)?;
                FrameBody::Pong
            }
            FrameKind::GoAway => {
                unexpected(0)?;
                let code = Code::from_u32(get_u32(&mut fields, "go-away code")?);
                FrameBody::GoAway(Status::new(
                    code,
                    get_string(&mut fields, 4, "go-away message")?,
                ))
            }
        };
        if !fields.is_empty() {
            return Err(FrameError::TrailingBytes(fields.len()));
        }
        frame.advance(header_len as usize);
        let payload = has_payload.then_some(frame);
        Ok(Frame {
            call_id,
            end_stream,
            payload,
            body,
        })
    }
}

/// A call's method path, `/package.Service/Method`, as it arrived: UTF-8,
/// a slice of its frame's bytes when the frame is small (no allocation of
/// its own), a copy when it is not (so that the path, kept for the call's
/// life, does not keep a large first message alive with it). It reads as
/// a `str`:
///
/// ```
/// use rpc_core::frame::MethodPath;
///
/// let path = MethodPath::from_static("/greeter.Greeter/SayHello");
/// assert_eq!(path.split_once("/Say"), Some(("/greeter.Greeter", "Hello")));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct MethodPath(Bytes);

impl MethodPath {
    /// A path from a string known at compile time.
    pub fn from_static(path: &'static str) -> MethodPath {
        MethodPath(Bytes::from_static(path.as_bytes()))
    }

    /// `field`, a part of `frame`, as a path if it is UTF-8.
    fn of(frame: &Bytes, field: &[u8]) -> Result<MethodPath, FrameError> {
        check_utf8(field, "method")?;
        Ok(MethodPath(if frame.len() <= MethodPath::SHARE_UP_TO {
            frame.slice_ref(field)
        } else {
            Bytes::copy_from_slice(field)
        }))
    }

    /// Frames up to this length share their bytes with the path.
    const SHARE_UP_TO: usize = 4096;

    /// The path.
    pub fn as_str(&self) -> &str {
        // SAFETY: both constructors take UTF-8 only (`of` checks it), and
        // the bytes never change.
        unsafe { std::str::from_utf8_unchecked(&self.0) }
    }
}

impl From<String> for MethodPath {
    fn from(path: String) -> MethodPath {
        MethodPath(Bytes::from(path))
    }
}

impl std::ops::Deref for MethodPath {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Display for MethodPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for MethodPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

/// The call id and kind from the head of a frame that was not delivered
/// whole (see `TransportError::Oversized`).
pub fn peek_head(prefix: &[u8]) -> Result<(u64, FrameKind), FrameError> {
    if prefix.len() < HEAD_LEN {
        return Err(FrameError::Truncated("head"));
    }
    if prefix[0] != PROTOCOL_VERSION {
        return Err(FrameError::UnsupportedVersion { got: prefix[0] });
    }
    let kind = FrameKind::from_u8(prefix[1]).ok_or(FrameError::UnknownKind(prefix[1]))?;
    let call_id = u64::from_le_bytes(prefix[4..12].try_into().expect("8 bytes"));
    Ok((call_id, kind))
}

fn get_u32(buf: &mut &[u8], what: &'static str) -> Result<u32, FrameError> {
    if buf.remaining() < 4 {
        return Err(FrameError::Truncated(what));
    }
    Ok(buf.get_u32_le())
}

fn get_u64(buf: &mut &[u8], what: &'static str) -> Result<u64, FrameError> {
    if buf.remaining() < 8 {
        return Err(FrameError::Truncated(what));
    }
    Ok(buf.get_u64_le())
}

/// A length-prefixed byte string; the prefix is `prefix` (2 or 4) bytes wide.
fn get_bytes<'a>(
    buf: &mut &'a [u8],
    prefix: usize,
    what: &'static str,
) -> Result<&'a [u8], FrameError> {
    if buf.remaining() < prefix {
        return Err(FrameError::Truncated(what));
    }
    let len = if prefix == 2 {
        buf.get_u16_le() as usize
    } else {
        buf.get_u32_le() as usize
    };
    if buf.remaining() < len {
        return Err(FrameError::Truncated(what));
    }
    let (bytes, rest) = buf.split_at(len);
    *buf = rest;
    Ok(bytes)
}

fn get_string(buf: &mut &[u8], prefix: usize, what: &'static str) -> Result<String, FrameError> {
    match get_bytes(buf, prefix, what)? {
        [] => Ok(String::new()), // an OK status's message
        bytes => std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| FrameError::Invalid(what)),
    }
}

/// Checks that a field is UTF-8; names and most messages are ASCII, which
/// is checked a word at a time (`from_utf8` goes byte by byte on short
/// strings: ~100 instructions for a method name).
fn check_utf8(bytes: &[u8], what: &'static str) -> Result<(), FrameError> {
    if bytes.is_ascii() || std::str::from_utf8(bytes).is_ok() {
        Ok(())
    } else {
        Err(FrameError::Invalid(what))
    }
}

/// Metadata from `buf`, a part of `frame`: values are `Bytes` of the frame.
fn get_metadata(frame: &Bytes, buf: &mut &[u8]) -> Result<MetadataMap, FrameError> {
    if buf.remaining() < 2 {
        return Err(FrameError::Truncated("metadata count"));
    }
    let count = buf.get_u16_le();
    let mut metadata = MetadataMap::new();
    for _ in 0..count {
        let key = get_string(buf, 2, "metadata key")?;
        if !is_valid_key(&key) {
            return Err(FrameError::Invalid("metadata key"));
        }
        let value = get_bytes(buf, 4, "metadata value")?;
        metadata.push_unchecked(key, frame.slice_ref(value));
    }
    Ok(metadata)
}

/// A message that can write itself into a frame.
pub trait EncodePayload: Sync {
    /// Exact number of bytes [`EncodePayload::encode_payload`] writes.
    fn payload_len(&self) -> usize;
    /// Writes exactly [`EncodePayload::payload_len`] bytes.
    fn encode_payload(&self, dst: &mut dyn BufMut);
    /// Writes the same bytes as [`EncodePayload::encode_payload`] into a
    /// gather list, handing large [`Bytes`] to [`BufMut::put`] on the
    /// concrete [`Gather`] so that they are kept by reference. By default
    /// it calls `encode_payload` (everything is copied).
    fn gather_payload(&self, dst: &mut Gather) {
        self.encode_payload(dst);
    }
}

impl EncodePayload for Bytes {
    fn payload_len(&self) -> usize {
        self.len()
    }
    fn encode_payload(&self, dst: &mut dyn BufMut) {
        dst.put_slice(self);
    }
    fn gather_payload(&self, dst: &mut Gather) {
        dst.put(self.clone());
    }
}

/// The kind-specific part of a frame to send; borrows what it encodes.
#[derive(Debug, Clone, Copy)]
pub enum OutBody<'a> {
    /// See [`FrameKind::Request`].
    Request {
        /// `/package.Service/Method`.
        method: &'a str,
        /// Time the server has for the call.
        timeout: Option<Duration>,
        /// Request metadata.
        metadata: &'a MetadataMap,
    },
    /// See [`FrameKind::Message`].
    Message,
    /// See [`FrameKind::Status`].
    Status(&'a Status),
    /// See [`FrameKind::Cancel`].
    Cancel,
    /// See [`FrameKind::WindowUpdate`].
    WindowUpdate(u32),
    /// See [`FrameKind::GoAway`].
    GoAway(&'a Status),
    /// See [`FrameKind::Ping`].
    Ping,
    /// See [`FrameKind::Pong`].
    Pong,
}

/// A frame to send: it knows its length up front and encodes straight into
/// whatever buffer the transport hands it (for RDMA: registered memory).
pub struct OutFrame<'a> {
    call_id: u64,
    end_stream: bool,
    body: OutBody<'a>,
    payload: Option<&'a dyn EncodePayload>,
    header_len: usize,
    payload_len: usize,
}

impl<'a> OutFrame<'a> {
    /// A frame for `call_id`; fails if its header fields exceed [`MAX_HEADER_LEN`]
    /// (too much metadata, an absurd method name).
    pub fn new(
        call_id: u64,
        body: OutBody<'a>,
        payload: Option<&'a dyn EncodePayload>,
        end_stream: bool,
    ) -> Result<OutFrame<'a>, FrameError> {
        let header_len = header_fields_len(&body);
        if header_len > MAX_HEADER_LEN {
            return Err(FrameError::HeaderTooLarge(header_len));
        }
        if let OutBody::Request { method, .. } = body {
            if method.len() > u16::MAX as usize {
                return Err(FrameError::Invalid("method"));
            }
        }
        let payload_len = payload.map_or(0, |p| p.payload_len());
        Ok(OutFrame {
            call_id,
            end_stream,
            body,
            payload,
            header_len,
            payload_len,
        })
    }

    /// A frame with no payload and no metadata (cancel, window update, end of stream).
    pub fn control(call_id: u64, body: OutBody<'a>, end_stream: bool) -> OutFrame<'a> {
        OutFrame {
            call_id,
            end_stream,
            body,
            payload: None,
            header_len: header_fields_len(&body),
            payload_len: 0,
        }
    }

    /// The same frame carrying `payload` (a message frame, say).
    pub fn with_payload(mut self, payload: &'a dyn EncodePayload) -> OutFrame<'a> {
        self.payload_len = payload.payload_len();
        self.payload = Some(payload);
        self
    }

    /// The call this frame belongs to (0: the connection's own frames).
    /// Transports that let frames pass each other keep each call's in order.
    pub fn call_id(&self) -> u64 {
        self.call_id
    }

    /// The encoded length of the whole frame.
    #[allow(clippy::len_without_is_empty)] // never empty: every frame has its head
    pub fn len(&self) -> usize {
        HEAD_LEN + self.header_len + self.payload_len
    }

    /// Length of the payload alone.
    pub fn payload_len(&self) -> usize {
        self.payload_len
    }

    /// Writes exactly [`OutFrame::len`] bytes into `dst`.
    pub fn encode(&self, dst: &mut dyn BufMut) {
        let fields = HEAD_LEN + self.header_len;
        if fields <= STACKED_FIELDS {
            // Assembled here, written with one call: through `dyn BufMut`
            // each small field would be a call and a copy of its own.
            let mut stacked = [0u8; STACKED_FIELDS];
            let mut cursor = &mut stacked[..fields];
            self.encode_fields(&mut cursor);
            debug_assert!(cursor.is_empty(), "header fields shorter than announced");
            dst.put_slice(&stacked[..fields]);
        } else {
            self.encode_fields(dst);
        }
        if let Some(payload) = self.payload {
            payload.encode_payload(dst);
        }
    }

    /// Appends the same bytes as [`OutFrame::encode`] to `dst`: the head and
    /// header fields copied, the payload's large [`Bytes`] by reference (see
    /// [`EncodePayload::gather_payload`]).
    pub fn gather(&self, dst: &mut Gather) {
        self.encode_fields(dst);
        if let Some(payload) = self.payload {
            payload.gather_payload(dst);
        }
    }

    /// Writes the head and the header fields.
    fn encode_fields<B: BufMut + ?Sized>(&self, dst: &mut B) {
        let kind = match self.body {
            OutBody::Request { .. } => FrameKind::Request,
            OutBody::Message => FrameKind::Message,
            OutBody::Status(_) => FrameKind::Status,
            OutBody::Cancel => FrameKind::Cancel,
            OutBody::WindowUpdate(_) => FrameKind::WindowUpdate,
            OutBody::GoAway(_) => FrameKind::GoAway,
            OutBody::Ping => FrameKind::Ping,
            OutBody::Pong => FrameKind::Pong,
        };
        let mut flags = 0;
        if self.end_stream {
            flags |= END_STREAM;
        }
        if self.payload.is_some() {
            flags |= HAS_PAYLOAD;
        }
        if let OutBody::Request {
            timeout: Some(_), ..
        } = self.body
        {
            flags |= HAS_TIMEOUT;
        }
        dst.put_u8(PROTOCOL_VERSION);
        dst.put_u8(kind as u8);
        dst.put_u8(flags);
        dst.put_u8(0);
        dst.put_u64_le(self.call_id);
        dst.put_u32_le(self.header_len as u32);
        dst.put_u32_le(self.payload_len as u32);
        match self.body {
            OutBody::Request {
                method,
                timeout,
                metadata,
            } => {
                dst.put_u16_le(method.len() as u16);
                dst.put_slice(method.as_bytes());
                let micros = timeout.map_or(0, |t| t.as_micros().min(u64::MAX as u128) as u64);
                dst.put_u64_le(micros);
                put_metadata(dst, metadata);
            }
            OutBody::Status(status) => {
                dst.put_u32_le(status.code() as u32);
                put_str32(dst, status.message());
                put_metadata(dst, status.metadata());
            }
            OutBody::GoAway(status) => {
                dst.put_u32_le(status.code() as u32);
                put_str32(dst, status.message());
            }
            OutBody::WindowUpdate(increment) => dst.put_u32_le(increment),
            OutBody::Message | OutBody::Cancel | OutBody::Ping | OutBody::Pong => {}
        }
    }

    /// Encodes into a new buffer (tests, and transports without their own buffers).
    pub fn to_bytes(&self) -> Bytes {
        let mut buf = bytes::BytesMut::with_capacity(self.len());
        self.encode(&mut buf);
        debug_assert_eq!(
            buf.len(),
            self.len(),
            "payload wrote a different length than it announced"
        );
        buf.freeze()
    }
}

/// Frames whose head and header fields are at most this long are assembled
/// on the stack (a unary call's request and status are ~30–60 bytes).
const STACKED_FIELDS: usize = 128;

fn put_str32<B: BufMut + ?Sized>(dst: &mut B, s: &str) {
    // Status messages are truncated to what a header section can carry.
    let bytes = truncate_utf8(s, MAX_STATUS_MESSAGE_LEN);
    dst.put_u32_le(bytes.len() as u32);
    dst.put_slice(bytes.as_bytes());
}

/// Status messages longer than this are cut (on a character boundary) when sent.
const MAX_STATUS_MESSAGE_LEN: usize = 16 * 1024;

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn put_metadata<B: BufMut + ?Sized>(dst: &mut B, metadata: &MetadataMap) {
    dst.put_u16_le(metadata.len() as u16);
    for (key, value) in metadata.iter() {
        dst.put_u16_le(key.len() as u16);
        dst.put_slice(key.as_bytes());
        dst.put_u32_le(value.len() as u32);
        dst.put_slice(value);
    }
}

fn metadata_len(metadata: &MetadataMap) -> usize {
    if metadata.len() > u16::MAX as usize {
        return usize::MAX / 2; // reported as HeaderTooLarge
    }
    2 + metadata
        .iter()
        .map(|(k, v)| 2 + k.len() + 4 + v.len())
        .sum::<usize>()
}

fn header_fields_len(body: &OutBody<'_>) -> usize {
    match body {
        OutBody::Request {
            method, metadata, ..
        } => 2 + method.len() + 8 + metadata_len(metadata),
        OutBody::Status(status) => {
            4 + 4
                + truncate_utf8(status.message(), MAX_STATUS_MESSAGE_LEN).len()
                + metadata_len(status.metadata())
        }
        OutBody::GoAway(status) => {
            4 + 4 + truncate_utf8(status.message(), MAX_STATUS_MESSAGE_LEN).len()
        }
        OutBody::WindowUpdate(_) => 4,
        OutBody::Message | OutBody::Cancel | OutBody::Ping | OutBody::Pong => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(frame: &OutFrame<'_>) -> Frame {
        let bytes = frame.to_bytes();
        assert_eq!(bytes.len(), frame.len());
        Frame::decode(bytes).expect("decodes")
    }

    #[test]
    fn request_round_trips_with_payload_timeout_and_metadata() {
        let mut metadata = MetadataMap::new();
        metadata.insert("x-trace", "abc");
        metadata.insert("bin", vec![0u8, 255, 7]);
        let payload = Bytes::from_static(b"hello");
        let frame = OutFrame::new(
            7 << 32 | 3,
            OutBody::Request {
                method: "/pkg.Svc/Do",
                timeout: Some(Duration::from_millis(1500)),
                metadata: &metadata,
            },
            Some(&payload),
            true,
        )
        .unwrap();
        let decoded = round_trip(&frame);
        assert_eq!(decoded.call_id, 7 << 32 | 3);
        assert!(decoded.end_stream);
        assert_eq!(decoded.payload.as_deref(), Some(&b"hello"[..]));
        assert_eq!(
            decoded.body,
            FrameBody::Request {
                method: MethodPath::from_static("/pkg.Svc/Do"),
                timeout: Some(Duration::from_millis(1500)),
                metadata
            }
        );
    }

    #[test]
    fn empty_message_differs_from_no_message() {
        let empty = Bytes::new();
        let with = round_trip(&OutFrame::new(1, OutBody::Message, Some(&empty), false).unwrap());
        assert_eq!(with.payload, Some(Bytes::new()));
        let without = round_trip(&OutFrame::control(1, OutBody::Message, true));
        assert_eq!(without.payload, None);
        assert!(without.end_stream);
    }

    #[test]
    fn status_and_control_frames_round_trip() {
        let mut status = Status::not_found("no such key: ü");
        status.metadata_mut().insert("retry-after", "3");
        assert_eq!(
            round_trip(&OutFrame::new(9, OutBody::Status(&status), None, false).unwrap()).body,
            FrameBody::Status(status.clone())
        );
        assert_eq!(
            round_trip(&OutFrame::control(9, OutBody::Cancel, false)).body,
            FrameBody::Cancel
        );
        assert_eq!(
            round_trip(&OutFrame::control(9, OutBody::WindowUpdate(65536), false)).body,
            FrameBody::WindowUpdate(65536)
        );
        let bye = Status::unavailable("shutting down");
        assert_eq!(
            round_trip(&OutFrame::control(0, OutBody::Ping, false)).body,
            FrameBody::Ping
        );
        assert_eq!(
            round_trip(&OutFrame::control(0, OutBody::Pong, false)).body,
            FrameBody::Pong
        );
        assert_eq!(
            round_trip(&OutFrame::control(0, OutBody::GoAway(&bye), false)).body,
            FrameBody::GoAway(bye)
        );
    }

    #[test]
    fn other_versions_are_refused_by_name() {
        let mut bytes = OutFrame::control(1, OutBody::Cancel, false)
            .to_bytes()
            .to_vec();
        bytes[0] = 2;
        let err = Frame::decode(bytes.into()).unwrap_err();
        assert_eq!(err, FrameError::UnsupportedVersion { got: 2 });
        assert!(err.to_string().contains("version 2"), "{err}");
    }

    #[test]
    fn lengths_that_disagree_with_the_frame_are_refused() {
        let payload = Bytes::from_static(b"abc");
        let good = OutFrame::new(1, OutBody::Message, Some(&payload), false)
            .unwrap()
            .to_bytes();
        // Cut one byte off: the head still claims 3 payload bytes.
        let err = Frame::decode(good.slice(..good.len() - 1)).unwrap_err();
        assert!(
            matches!(
                err,
                FrameError::LengthMismatch {
                    payload: 3,
                    actual: 2,
                    ..
                }
            ),
            "{err:?}"
        );
        // Claim a header length far past the end.
        let mut lying = good.to_vec();
        lying[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Frame::decode(lying.into()),
            Err(FrameError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn truncated_fields_inside_a_consistent_frame_are_refused() {
        // A Request whose fields claim a 200-byte method but hold 3 bytes.
        let mut bytes = vec![PROTOCOL_VERSION, FrameKind::Request as u8, 0, 0];
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&5u32.to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&200u16.to_le_bytes());
        bytes.extend_from_slice(b"abc");
        assert_eq!(
            Frame::decode(bytes.into()),
            Err(FrameError::Truncated("method"))
        );
    }

    #[test]
    fn a_method_path_is_checked_utf8_and_shares_its_frame() {
        let request = |method: &[u8]| {
            let mut bytes = vec![PROTOCOL_VERSION, FrameKind::Request as u8, 0, 0];
            bytes.extend_from_slice(&1u64.to_le_bytes());
            let header = 2 + method.len() + 8 + 2;
            bytes.extend_from_slice(&(header as u32).to_le_bytes());
            bytes.extend_from_slice(&0u32.to_le_bytes());
            bytes.extend_from_slice(&(method.len() as u16).to_le_bytes());
            bytes.extend_from_slice(method);
            bytes.extend_from_slice(&[0; 10]); // no timeout, no metadata
            Bytes::from(bytes)
        };
        let frame = request(b"/pkg.Svc/Do");
        let range = frame.as_ptr_range();
        let Ok(Frame {
            body: FrameBody::Request { method, .. },
            ..
        }) = Frame::decode(frame)
        else {
            panic!("a well-formed request");
        };
        assert_eq!(&*method, "/pkg.Svc/Do");
        assert!(range.contains(&method.as_ptr()), "copied out of its frame");
        // A large frame (a large first message) is not kept alive by its path.
        let mut large = request(b"/pkg.Svc/Do").to_vec();
        large[2] = HAS_PAYLOAD;
        large[16..20].copy_from_slice(&8192u32.to_le_bytes());
        large.resize(large.len() + 8192, 7);
        let large = Bytes::from(large);
        let range = large.as_ptr_range();
        let Ok(Frame {
            body: FrameBody::Request { method, .. },
            ..
        }) = Frame::decode(large)
        else {
            panic!("a well-formed request with a payload");
        };
        assert_eq!(&*method, "/pkg.Svc/Do");
        assert!(
            !range.contains(&method.as_ptr()),
            "a slice of a large frame"
        );
        assert_eq!(
            Frame::decode(request(b"/pkg.Svc/\xff")),
            Err(FrameError::Invalid("method"))
        );
    }

    #[test]
    fn unknown_kinds_and_flags_are_refused() {
        let good = OutFrame::control(1, OutBody::Cancel, false)
            .to_bytes()
            .to_vec();
        let mut kind = good.clone();
        kind[1] = 99;
        assert_eq!(Frame::decode(kind.into()), Err(FrameError::UnknownKind(99)));
        let mut flags = good.clone();
        flags[2] = 0x80;
        assert!(matches!(
            Frame::decode(flags.into()),
            Err(FrameError::BadFlags { .. })
        ));
        let mut end_on_cancel = good;
        end_on_cancel[2] = END_STREAM;
        assert!(matches!(
            Frame::decode(end_on_cancel.into()),
            Err(FrameError::Unexpected { .. })
        ));
    }

    #[test]
    fn too_much_metadata_is_refused_before_sending() {
        let mut metadata = MetadataMap::new();
        metadata.insert("big", vec![0u8; MAX_HEADER_LEN]);
        let body = OutBody::Request {
            method: "/a/b",
            timeout: None,
            metadata: &metadata,
        };
        assert!(matches!(
            OutFrame::new(1, body, None, true),
            Err(FrameError::HeaderTooLarge(_))
        ));
    }

    #[test]
    fn long_status_messages_are_cut_on_a_char_boundary() {
        let status = Status::internal("é".repeat(MAX_STATUS_MESSAGE_LEN));
        let decoded = round_trip(&OutFrame::new(1, OutBody::Status(&status), None, false).unwrap());
        let FrameBody::Status(got) = decoded.body else {
            panic!("not a status")
        };
        assert_eq!(got.message().len(), MAX_STATUS_MESSAGE_LEN);
        assert!(got.message().chars().all(|c| c == 'é'));
    }

    /// Random valid frames of every kind decode to exactly what was encoded.
    #[test]
    fn random_frames_round_trip() {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move |below: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % below.max(1)
        };
        for _ in 0..5_000 {
            let call_id = next(u64::MAX);
            let end_stream = next(2) == 1;
            let mut metadata = MetadataMap::new();
            for k in 0..next(4) {
                metadata.insert(
                    format!("k{k}-{}", next(100)),
                    vec![next(256) as u8; next(40) as usize],
                );
            }
            let message: String = (0..next(30))
                .map(|_| char::from_u32(0x41 + next(0x3000) as u32).unwrap_or('?'))
                .collect();
            let mut status = Status::new(Code::from_u32(next(17) as u32), message.clone());
            *status.metadata_mut() = metadata.clone();
            let payload = Bytes::from(vec![next(256) as u8; next(300) as usize]);
            let with_payload = next(2) == 1;
            let timeout = (next(2) == 1).then(|| Duration::from_micros(next(1 << 40)));
            let method = format!("/p{}.S/M{}", next(1000), message.len());
            let (body, end) = match next(8) {
                0 => (
                    OutBody::Request {
                        method: &method,
                        timeout,
                        metadata: &metadata,
                    },
                    end_stream,
                ),
                1 => (OutBody::Message, end_stream),
                2 => (OutBody::Status(&status), false),
                3 => (OutBody::Cancel, false),
                4 => (OutBody::WindowUpdate(next(u32::MAX as u64) as u32), false),
                5 => (OutBody::GoAway(&status), false),
                6 => (OutBody::Ping, false),
                _ => (OutBody::Pong, false),
            };
            let carries = matches!(
                body,
                OutBody::Request { .. } | OutBody::Message | OutBody::Status(_)
            ) && with_payload;
            let frame = OutFrame::new(
                call_id,
                body,
                carries.then_some(&payload as &dyn EncodePayload),
                end,
            )
            .unwrap();
            let decoded = round_trip(&frame);
            assert_eq!(decoded.call_id, call_id);
            assert_eq!(decoded.end_stream, end);
            assert_eq!(decoded.payload, carries.then(|| payload.clone()));
            let expected = match body {
                OutBody::Request { .. } => FrameBody::Request {
                    method: MethodPath::from(method.clone()),
                    timeout,
                    metadata: metadata.clone(),
                },
                OutBody::Message => FrameBody::Message,
                OutBody::Status(_) => FrameBody::Status(status.clone()),
                OutBody::Cancel => FrameBody::Cancel,
                OutBody::WindowUpdate(n) => FrameBody::WindowUpdate(n),
                OutBody::GoAway(_) => {
                    FrameBody::GoAway(Status::new(status.code(), message.clone()))
                }
                OutBody::Ping => FrameBody::Ping,
                OutBody::Pong => FrameBody::Pong,
            };
            assert_eq!(decoded.body, expected);
        }
    }

    /// Random corruptions of a valid frame never panic the decoder.
    #[test]
    fn decoder_survives_arbitrary_input() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let sample = Bytes::from_static(b"payload");
        let mut metadata = MetadataMap::new();
        metadata.insert("k", "v");
        let valid = OutFrame::new(
            5,
            OutBody::Request {
                method: "/s/m",
                timeout: None,
                metadata: &metadata,
            },
            Some(&sample),
            false,
        )
        .unwrap()
        .to_bytes();
        let mut decoded_ok = 0;
        for _ in 0..20_000 {
            let mut bytes = valid.to_vec();
            for _ in 0..(next() % 4 + 1) {
                let i = (next() as usize) % bytes.len();
                bytes[i] = next() as u8;
            }
            bytes.truncate(HEAD_LEN.min(bytes.len()) + (next() as usize) % (bytes.len() + 1));
            if Frame::decode(bytes.into()).is_ok() {
                decoded_ok += 1;
            }
        }
        // Mutating only the payload leaves a valid frame, so some decode; most must not.
        assert!(
            decoded_ok > 0 && decoded_ok < 20_000,
            "{decoded_ok} of 20000 decoded"
        );
    }
}
