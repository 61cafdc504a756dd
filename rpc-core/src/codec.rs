//! How messages become payload bytes. The core knows nothing of protobuf;
//! [`ProstCodec`] adapts prost, [`BytesCodec`] passes raw bytes through.

use std::marker::PhantomData;

use bytes::{BufMut, Bytes};

use crate::frame::EncodePayload;
use crate::status::Status;

/// Encodes one message type and decodes another.
pub trait Codec: Send + Sync + 'static {
    /// What this side sends.
    type Encode: Send + Sync + 'static;
    /// What this side receives.
    type Decode: Send + 'static;
    /// Exact encoded length of `item`.
    fn encoded_len(item: &Self::Encode) -> usize;
    /// Writes exactly [`Codec::encoded_len`] bytes of `item` into `dst`.
    fn encode(item: &Self::Encode, dst: &mut dyn BufMut);
    /// As [`Codec::encode`], into a slice of exactly
    /// [`Codec::encoded_len`] bytes: small messages are encoded this way,
    /// where a codec's writes need no dynamic calls. Override it when the
    /// encoder is generic over its buffer (as prost's is); by default it
    /// calls [`Codec::encode`].
    fn encode_to_slice(item: &Self::Encode, mut dst: &mut [u8]) {
        Self::encode(item, &mut dst);
    }
    /// Decodes one message; fails with [`Status`] `Internal` on malformed input.
    fn decode(buf: Bytes) -> Result<Self::Decode, Status>;
}

/// Protobuf messages through prost: encodes `E`, decodes `D`.
///
/// With `bytes` fields generated as [`Bytes`] (rpc-codegen's default), decoding
/// a large tensor does not copy it: the field points into the received frame.
pub struct ProstCodec<E, D>(PhantomData<fn(E) -> D>);

impl<E, D> Codec for ProstCodec<E, D>
where
    E: prost::Message + Send + Sync + 'static,
    D: prost::Message + Default + Send + 'static,
{
    type Encode = E;
    type Decode = D;

    fn encoded_len(item: &E) -> usize {
        item.encoded_len()
    }

    fn encode(item: &E, mut dst: &mut dyn BufMut) {
        item.encode_raw(&mut dst);
    }

    fn encode_to_slice(item: &E, mut dst: &mut [u8]) {
        item.encode_raw(&mut dst);
    }

    fn decode(buf: Bytes) -> Result<D, Status> {
        D::decode(buf).map_err(|e| {
            Status::internal(format!(
                "failed to decode {}: {e}",
                std::any::type_name::<D>()
            ))
        })
    }
}

/// Raw bytes both ways: for benchmarks, tests and hand-rolled formats.
#[derive(Debug, Clone, Copy, Default)]
pub struct BytesCodec;

impl Codec for BytesCodec {
    type Encode = Bytes;
    type Decode = Bytes;

    fn encoded_len(item: &Bytes) -> usize {
        item.len()
    }

    fn encode(item: &Bytes, dst: &mut dyn BufMut) {
        dst.put_slice(item);
    }

    fn encode_to_slice(item: &Bytes, dst: &mut [u8]) {
        dst.copy_from_slice(item);
    }

    fn decode(buf: Bytes) -> Result<Bytes, Status> {
        Ok(buf)
    }
}

/// Messages up to this many bytes are encoded on the stack first (see
/// [`Codec::encode_to_slice`]); larger ones straight into the transport's buffer.
const STACKED_PAYLOAD: usize = 256;

/// A message ready to be written into a frame, with its length computed once.
pub(crate) struct Encodable<'a, C: Codec> {
    item: &'a C::Encode,
    len: usize,
}

impl<'a, C: Codec> Encodable<'a, C> {
    /// Measures `item`; fails with `ResourceExhausted` if it is over `max_len`.
    pub(crate) fn new(item: &'a C::Encode, max_len: usize) -> Result<Self, Status> {
        let len = C::encoded_len(item);
        if len > max_len {
            return Err(Status::resource_exhausted(format!(
                "message of {len} bytes is larger than the maximum message size of {max_len} bytes"
            )));
        }
        Ok(Encodable { item, len })
    }
}

impl<C: Codec> EncodePayload for Encodable<'_, C> {
    fn payload_len(&self) -> usize {
        self.len
    }

    fn encode_payload(&self, dst: &mut dyn BufMut) {
        if self.len <= STACKED_PAYLOAD {
            // Encoded on the stack with static calls, written with one.
            let mut stacked = [0u8; STACKED_PAYLOAD];
            C::encode_to_slice(self.item, &mut stacked[..self.len]);
            dst.put_slice(&stacked[..self.len]);
        } else {
            C::encode(self.item, dst);
        }
    }
}
