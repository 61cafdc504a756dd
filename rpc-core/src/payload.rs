//! Memory a transport hands out for a large payload, to fill and then send
//! with no copy.

use std::fmt;
use std::ops::{Deref, DerefMut};

use bytes::Bytes;

/// Memory for one large payload (a tensor), taken from the transport of the
/// connection it will be sent on: fill it, [`freeze`](Self::freeze) it into
/// [`Bytes`], put those in a message's `bytes` field, and the transport
/// sends them from where they lie. Over `rdma://` it is registered memory
/// from the connection's bounded pool, read by the peer's NIC with no copy
/// and no registration per call; over `tcp://` and `mem://` it is plain
/// heap memory (a socket copies it into the kernel either way).
///
/// ```
/// # async fn run(channel: rpc_core::Channel) -> Result<(), rpc_core::Status> {
/// let gradient: Vec<f32> = vec![0.5; 1 << 18];
/// let mut buffer = channel.payload_buffer(gradient.len() * 4).await?;
/// for (dst, x) in buffer.chunks_exact_mut(4).zip(&gradient) {
///     dst.copy_from_slice(&x.to_le_bytes());
/// }
/// let payload: bytes::Bytes = buffer.freeze();
/// # drop(payload);
/// # Ok(())
/// # }
/// ```
///
/// Its bytes are initialized but not necessarily zero: a transport may hand
/// out memory a previous payload of the connection used (so that nothing
/// touches a tensor's bytes twice); write all of it. Dropping it unfrozen,
/// or dropping the last `Bytes` of it, gives the memory back to the
/// transport's pool.
pub struct PayloadBuffer {
    memory: Box<dyn PayloadMemory>,
}

/// A transport's memory behind a [`PayloadBuffer`].
pub trait PayloadMemory: Send + 'static {
    /// The bytes, writable until frozen.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// The bytes, read-only.
    fn bytes(&self) -> &[u8];
    /// The bytes as [`Bytes`] that keep the memory until the last of them
    /// is dropped.
    fn freeze(self: Box<Self>) -> Bytes;
}

impl PayloadBuffer {
    /// `len` zeroed bytes on the heap: what a transport without memory of
    /// its own to offer hands out.
    pub fn heap(len: usize) -> PayloadBuffer {
        PayloadBuffer::new(Box::new(HeapMemory(vec![0; len])))
    }

    /// A buffer over a transport's memory.
    pub fn new(memory: Box<dyn PayloadMemory>) -> PayloadBuffer {
        PayloadBuffer { memory }
    }

    /// The filled bytes, to send: no copy is made.
    pub fn freeze(self) -> Bytes {
        self.memory.freeze()
    }
}

impl Deref for PayloadBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.memory.bytes()
    }
}

impl DerefMut for PayloadBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.memory.bytes_mut()
    }
}

impl fmt::Debug for PayloadBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PayloadBuffer")
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

struct HeapMemory(Vec<u8>);

impl PayloadMemory for HeapMemory {
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }

    fn bytes(&self) -> &[u8] {
        &self.0
    }

    fn freeze(self: Box<Self>) -> Bytes {
        Bytes::from(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heap_buffer_is_zeroed_and_freezes_into_what_was_written() {
        let mut buffer = PayloadBuffer::heap(5);
        assert_eq!(&buffer[..], &[0; 5]);
        buffer[1..4].copy_from_slice(b"abc");
        let ptr = buffer.as_ptr();
        let bytes = buffer.freeze();
        assert_eq!(&bytes[..], b"\0abc\0");
        assert_eq!(bytes.as_ptr(), ptr, "frozen where it was written");
    }
}
