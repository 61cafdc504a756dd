//! How messages become payload bytes. The core knows nothing of protobuf;
//! [`ProstCodec`] adapts prost, [`BytesCodec`] passes raw bytes through.

use std::marker::PhantomData;

use bytes::buf::UninitSlice;
use bytes::{Buf, BufMut, Bytes};

use crate::frame::{EncodePayload, Gather};
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
    /// As [`Codec::encode`], into a gather list: override it to hand large
    /// [`Bytes`] fields to [`bytes::BufMut::put`] on the concrete
    /// [`Gather`], which keeps them by reference instead of copying them.
    /// By default it calls [`Codec::encode`] (everything is copied).
    fn encode_gather(item: &Self::Encode, dst: &mut Gather) {
        Self::encode(item, dst);
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

    /// Through a small stage on the stack: prost writes a field's key and
    /// length a byte at a time, each a dynamic call on `dst` otherwise.
    fn encode(item: &E, dst: &mut dyn BufMut) {
        let mut coalesced = Coalesced::new(dst);
        item.encode_raw(&mut coalesced);
        coalesced.flush();
    }

    fn encode_to_slice(item: &E, mut dst: &mut [u8]) {
        item.encode_raw(&mut dst);
    }

    /// prost encodes a `bytes` field generated as [`Bytes`] with
    /// `put(field.clone())`: large ones become segments by reference.
    fn encode_gather(item: &E, dst: &mut Gather) {
        item.encode_raw(dst);
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

    fn encode_gather(item: &Bytes, dst: &mut Gather) {
        dst.put(item.clone());
    }

    fn decode(buf: Bytes) -> Result<Bytes, Status> {
        Ok(buf)
    }
}

/// A [`BufMut`] in front of a `dyn BufMut` that gathers small writes (a
/// field's key, a varint) on the stack and hands them on in one call, with
/// the slices too large to gather (a `bytes` field's contents) passed
/// straight through. Call [`flush`](Self::flush) when done.
struct Coalesced<'a> {
    dst: &'a mut dyn BufMut,
    staged: [u8; STAGE],
    len: usize,
}

/// Bytes [`Coalesced`] gathers before it writes them on.
const STAGE: usize = 64;

impl<'a> Coalesced<'a> {
    fn new(dst: &'a mut dyn BufMut) -> Self {
        Coalesced {
            dst,
            staged: [0; STAGE],
            len: 0,
        }
    }

    fn flush(&mut self) {
        if self.len > 0 {
            self.dst.put_slice(&self.staged[..self.len]);
            self.len = 0;
        }
    }
}

// SAFETY: `chunk_mut` is the unused part of `staged`, initialised memory
// this adapter owns; `advance_mut` moves `len` within it (checked).
unsafe impl BufMut for Coalesced<'_> {
    fn remaining_mut(&self) -> usize {
        self.dst.remaining_mut().saturating_sub(self.len)
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        assert!(cnt <= STAGE - self.len, "advanced past the stage");
        self.len += cnt;
    }

    fn chunk_mut(&mut self) -> &mut UninitSlice {
        if self.len == STAGE {
            self.flush();
        }
        UninitSlice::new(&mut self.staged[self.len..])
    }

    #[inline]
    fn put_slice(&mut self, src: &[u8]) {
        if src.len() <= STAGE - self.len {
            self.staged[self.len..self.len + src.len()].copy_from_slice(src);
            self.len += src.len();
        } else {
            self.flush();
            self.dst.put_slice(src);
        }
    }

    /// Chunk by chunk through [`put_slice`](Self::put_slice) (the default
    /// would copy through `chunk_mut`, a stage at a time): a large `Bytes`
    /// field goes to `dst` in one call.
    fn put<T: Buf>(&mut self, mut src: T)
    where
        Self: Sized,
    {
        while src.has_remaining() {
            let chunk = src.chunk();
            let len = chunk.len();
            self.put_slice(chunk);
            src.advance(len);
        }
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

    fn gather_payload(&self, dst: &mut Gather) {
        if self.len <= STACKED_PAYLOAD {
            self.encode_payload(dst);
        } else {
            C::encode_gather(self.item, dst);
        }
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::frame::{Frame, OutBody, OutFrame, GATHER_THRESHOLD};
    use crate::metadata::MetadataMap;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Tensor {
        #[prost(string, tag = "1")]
        name: String,
        #[prost(bytes = "bytes", tag = "2")]
        data: Bytes,
        #[prost(uint64, repeated, tag = "3")]
        shape: Vec<u64>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct Push {
        #[prost(uint32, tag = "1")]
        step: u32,
        #[prost(message, repeated, tag = "2")]
        tensors: Vec<Tensor>,
        #[prost(bytes = "bytes", repeated, tag = "3")]
        blobs: Vec<Bytes>,
        #[prost(message, optional, tag = "4")]
        first: Option<Tensor>,
        #[prost(bytes = "vec", tag = "5")]
        copied: Vec<u8>,
    }

    fn pattern(len: usize, seed: u8) -> Bytes {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<u8>>()
            .into()
    }

    fn tensor(name: &str, len: usize, seed: u8) -> Tensor {
        Tensor {
            name: name.into(),
            data: pattern(len, seed),
            shape: vec![len as u64, 1, 7],
        }
    }

    fn push() -> Push {
        Push {
            step: 9,
            tensors: vec![
                tensor("w0", 1 << 20, 1),
                tensor("b0", 100, 2),
                tensor("w1", GATHER_THRESHOLD, 3),
                tensor("b1", GATHER_THRESHOLD - 1, 4),
            ],
            blobs: vec![pattern(70_000, 5), pattern(3, 6), pattern(200_000, 7)],
            first: Some(tensor("nested", 500_000, 8)),
            copied: pattern(100_000, 9).to_vec(),
        }
    }

    /// Whether `field` is one of `gather`'s segments, by reference.
    fn by_reference(gather: &Gather, field: &Bytes) -> bool {
        gather
            .segments()
            .iter()
            .any(|s| s.as_ptr() == field.as_ptr() && s.len() == field.len())
    }

    #[test]
    fn prost_large_bytes_fields_are_gathered_by_reference() {
        let message = push();
        let mut gather = Gather::new();
        ProstCodec::<Push, Push>::encode_gather(&message, &mut gather);
        assert_eq!(gather.to_bytes(), message.encode_to_vec());
        assert_eq!(gather.len(), message.encoded_len());
        for large in [
            &message.tensors[0].data,
            &message.tensors[2].data,
            &message.blobs[0],
            &message.blobs[2],
            &message.first.as_ref().unwrap().data,
        ] {
            assert!(by_reference(&gather, large), "{} bytes copied", large.len());
        }
        for small in [
            &message.tensors[1].data,
            &message.tensors[3].data,
            &message.blobs[1],
        ] {
            assert!(!by_reference(&gather, small));
        }
        // The five large fields and the small bytes before each; then the
        // `Vec<u8>` field's key and, copied (`put` of a slice), its bytes.
        assert_eq!(gather.segments().len(), 12);
        let last = &gather.segments()[11];
        assert_eq!(last[..], message.copied[..]);
        assert_ne!(last.as_ptr(), message.copied.as_ptr());
        assert!(gather.tail().is_empty());
    }

    fn assert_frame_gathers_as_it_encodes(frame: &OutFrame<'_>) -> Gather {
        let mut gather = Gather::new();
        frame.gather(&mut gather);
        assert_eq!(gather.to_bytes(), frame.to_bytes());
        assert_eq!(gather.len(), frame.len());
        gather
    }

    #[test]
    fn frames_gather_the_bytes_they_encode() {
        let message = push();
        let payload = Encodable::<ProstCodec<Push, Push>>::new(&message, usize::MAX).unwrap();
        let mut metadata = MetadataMap::new();
        metadata.insert("k", "v");
        let request = OutFrame::new(
            3,
            OutBody::Request {
                method: "/ps.Ps/Push",
                timeout: Some(std::time::Duration::from_millis(5)),
                metadata: &metadata,
            },
            Some(&payload),
            true,
        )
        .unwrap();
        let gather = assert_frame_gathers_as_it_encodes(&request);
        assert!(by_reference(&gather, &message.tensors[0].data));

        let raw = pattern(3 << 20, 11);
        let raw_payload = Encodable::<BytesCodec>::new(&raw, usize::MAX).unwrap();
        let reply = OutFrame::control(3, OutBody::Message, false).with_payload(&raw_payload);
        let gather = assert_frame_gathers_as_it_encodes(&reply);
        assert!(by_reference(&gather, &raw));
        let bare = OutFrame::control(3, OutBody::Message, false).with_payload(&raw);
        assert!(by_reference(
            &assert_frame_gathers_as_it_encodes(&bare),
            &raw
        ));

        let small = Bytes::from_static(b"hi");
        let small_payload = Encodable::<BytesCodec>::new(&small, usize::MAX).unwrap();
        let tiny = OutFrame::control(4, OutBody::Message, true).with_payload(&small_payload);
        assert!(assert_frame_gathers_as_it_encodes(&tiny)
            .segments()
            .is_empty());
        assert_frame_gathers_as_it_encodes(&OutFrame::control(0, OutBody::Ping, false));
    }

    /// A `BufMut` that records the length of each write it is handed.
    #[derive(Default)]
    struct Writes {
        bytes: Vec<u8>,
        lens: Vec<usize>,
    }

    // SAFETY: `chunk_mut` and `advance_mut` are the `Vec`'s own.
    unsafe impl BufMut for Writes {
        fn remaining_mut(&self) -> usize {
            self.bytes.remaining_mut()
        }

        unsafe fn advance_mut(&mut self, cnt: usize) {
            self.lens.push(cnt);
            // SAFETY: forwarded, the caller initialised `cnt` bytes.
            unsafe { self.bytes.advance_mut(cnt) }
        }

        fn chunk_mut(&mut self) -> &mut UninitSlice {
            self.bytes.chunk_mut()
        }

        fn put_slice(&mut self, src: &[u8]) {
            self.lens.push(src.len());
            self.bytes.extend_from_slice(src);
        }
    }

    #[test]
    fn prost_encodes_into_a_dyn_buf_mut_in_few_writes() {
        let message = push();
        let mut writes = Writes::default();
        ProstCodec::<Push, Push>::encode(&message, &mut writes);
        assert_eq!(writes.bytes, message.encode_to_vec());
        // Keys and lengths go in groups, never a byte at a time; each
        // field over the stage goes in one write of its own.
        assert!(writes.lens.iter().all(|&len| len > 1), "{:?}", writes.lens);
        for large in [&message.tensors[0].data, &message.blobs[2]] {
            assert!(
                writes.lens.contains(&large.len()),
                "{} bytes split",
                large.len()
            );
        }
        // Many small fields, more than a stage's worth: all of them, in order.
        let shape: Vec<u64> = (0..200).map(|i| i * 1_000_003).collect();
        let small = Tensor {
            name: "s".repeat(STAGE - 1),
            data: pattern(STAGE + 1, 3),
            shape,
        };
        let mut writes = Writes::default();
        ProstCodec::<Tensor, Tensor>::encode(&small, &mut writes);
        assert_eq!(writes.bytes, small.encode_to_vec());
        assert!(writes.lens.iter().all(|&len| len <= STAGE + 1));
    }

    #[test]
    fn decoding_a_received_frame_keeps_bytes_fields_in_it() {
        let message = push();
        let payload = Encodable::<ProstCodec<Push, Push>>::new(&message, usize::MAX).unwrap();
        let frame = OutFrame::control(5, OutBody::Message, false).with_payload(&payload);
        let mut gather = Gather::new();
        frame.gather(&mut gather);
        let received = gather.to_bytes(); // as a transport hands it up
        let range = received.as_ptr_range();
        let payload = Frame::decode(received.clone()).unwrap().payload.unwrap();
        let decoded = ProstCodec::<Push, Push>::decode(payload).unwrap();
        assert_eq!(decoded, message);
        let data = &decoded.tensors[0].data;
        assert!(range.contains(&data.as_ptr()), "the tensor was copied");
        assert!(range.contains(&decoded.first.unwrap().data.as_ptr()));
        assert!(range.contains(&decoded.blobs[2].as_ptr()));
    }
}
