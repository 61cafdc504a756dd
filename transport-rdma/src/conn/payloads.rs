//! Registered memory an application fills with a payload and sends with no
//! copy and no registration per call ([`rpc_core::PayloadBuffer`]).
//!
//! Each connection that sends by rendezvous has a bounded pool of such
//! buffers, registered on its protection domain for local access and
//! memory-window binding only: the peer can read none of it until a
//! transfer binds a [`MemoryWindow`] over the frame's bytes (ahead of the
//! announcement, on this connection's queue pair), and nothing once the
//! transfer ends (the window is deallocated). A buffer given back (its last
//! `Bytes` dropped) stays registered for a later one of the same size, as
//! long as the pool's budget allows.

use std::collections::BTreeMap;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use rpc_core::transport::TransportError;
use rpc_core::{PayloadBuffer, PayloadMemory};

use super::destinations::{Charged, SpareDestinations};
use crate::proto::{pool_charge, WorkKind};
use crate::verbs::{
    self, Access, MemoryRegion, MemoryWindow, ProtectionDomain, QueuePair, RemoteRegion,
};

/// A connection's pool of payload buffers.
#[derive(Clone)]
pub(crate) struct PayloadPool {
    inner: Arc<Mutex<PoolState>>,
    pd: ProtectionDomain,
}

struct PoolState {
    /// Most bytes (whole pages) of buffers handed out and spares.
    budget: u64,
    /// Bytes charged to buffers handed out and not yet given back.
    in_use: u64,
    /// Buffers handed out, by the address of their first byte.
    live: BTreeMap<usize, Registered>,
    spares: SpareDestinations<Registered>,
    /// Waiting for room.
    waiters: Vec<Waker>,
}

/// One buffer's registered memory.
struct Registered(MemoryRegion);

impl Charged for Registered {
    fn charge(&self) -> u64 {
        pool_charge(self.0.len())
    }
}

impl Registered {
    fn start(&self) -> usize {
        // SAFETY: an empty slice at the start: covers no byte.
        unsafe { self.0.slice(0..0) }.as_ptr() as usize
    }
}

impl PayloadPool {
    pub(crate) fn new(pd: &ProtectionDomain, budget: u64) -> PayloadPool {
        PayloadPool {
            inner: Arc::new(Mutex::new(PoolState {
                budget,
                in_use: 0,
                live: BTreeMap::new(),
                spares: SpareDestinations::default(),
                waiters: Vec::new(),
            })),
            pd: pd.clone(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of `len` bytes, or `Pending` while the pool has no
    /// room for it (woken when a buffer is given back). A buffer larger
    /// than the whole budget is refused.
    pub(crate) fn poll_buffer(
        &self,
        cx: &mut Context<'_>,
        len: usize,
    ) -> Poll<Result<PayloadBuffer, TransportError>> {
        let charge = pool_charge(len.max(1));
        let mut pool = self.lock();
        if charge > pool.budget {
            return Poll::Ready(Err(TransportError::Protocol(format!(
                "a payload buffer of {len} bytes is larger than the connection's pool \
                 ({} bytes: RdmaTransport::payload_pool)",
                pool.budget
            ))));
        }
        let memory = match pool.spares.take(len.max(1)) {
            // Not zeroed again: the application writes all of it.
            Some(spare) => spare,
            None => {
                let in_use = pool.in_use;
                let budget = pool.budget;
                drop(pool.spares.trim(in_use + charge, budget));
                if pool.in_use + charge + pool.spares.bytes() > pool.budget {
                    if !pool.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                        pool.waiters.push(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
                // Registered outside the lock would let two callers both
                // take the room; a registration is what a buffer costs.
                let access = Access::LOCAL_WRITE | Access::MW_BIND;
                match MemoryRegion::new(&self.pd, charge as usize, access) {
                    Ok(mr) => Registered(mr),
                    Err(e) => {
                        return Poll::Ready(Err(super::io_error("register a payload buffer", e)))
                    }
                }
            }
        };
        pool.in_use += memory.charge();
        let start = memory.start();
        let ptr = NonNull::new(start as *mut u8).expect("a registered buffer's address");
        pool.live.insert(start, memory);
        Poll::Ready(Ok(PayloadBuffer::new(Box::new(PooledPayload {
            ptr,
            len,
            pool: Arc::clone(&self.inner),
        }))))
    }

    /// Whether `bytes` lie in a buffer of this pool handed out.
    pub(crate) fn holds(&self, bytes: &[u8]) -> bool {
        self.lock().find(bytes).is_some()
    }

    /// Binds `window` over `bytes` (in a buffer of this pool) for the peer
    /// of `qp` to read; returns where and under which key the peer reads them.
    ///
    /// # Safety
    /// `bytes` must be of a frozen buffer ([`PayloadBuffer::freeze`]: never
    /// written again) kept alive, with `window`, until the window is dropped.
    pub(crate) unsafe fn bind(
        &self,
        qp: &mut QueuePair,
        window: &MemoryWindow,
        bytes: &[u8],
    ) -> Result<RemoteRegion, verbs::Error> {
        let pool = self.lock();
        let (memory, range) = pool.find(bytes).ok_or(verbs::Error::NotRegistered {
            len: bytes.len() as u32,
        })?;
        // SAFETY: the caller keeps the bytes (and so the buffer: it is
        // given back only when its last `Bytes` drops) unwritten while the
        // window lives; the region stays registered meanwhile.
        unsafe {
            qp.post_bind(
                WorkKind::Bind.wr_id(0),
                window,
                &memory.0,
                range,
                Access::REMOTE_READ,
            )
        }
    }
}

impl PoolState {
    /// The buffer handed out that holds `bytes`, and their range in it.
    fn find(&self, bytes: &[u8]) -> Option<(&Registered, Range<usize>)> {
        let start = bytes.as_ptr() as usize;
        let (&at, memory) = self.live.range(..=start).next_back()?;
        let range = start - at..start - at + bytes.len();
        (range.end <= memory.0.len()).then_some((memory, range))
    }

    /// Takes back the buffer starting at `start`.
    fn give_back(&mut self, start: usize) {
        let Some(memory) = self.live.remove(&start) else {
            return;
        };
        self.in_use -= memory.charge();
        self.spares.keep(memory);
        let in_use = self.in_use;
        let budget = self.budget;
        drop(self.spares.trim(in_use, budget));
        for waiter in self.waiters.drain(..) {
            waiter.wake();
        }
    }
}

/// A buffer handed out: its memory stays in the pool's `live` map (which
/// owns the registration) until this is dropped.
struct PooledPayload {
    ptr: NonNull<u8>,
    len: usize,
    pool: Arc<Mutex<PoolState>>,
}

// SAFETY: the value is the only one that reads or writes its buffer's
// bytes (the pool touches a buffer only once given back); the pointer
// stays valid while the buffer is in `live`, until our Drop.
unsafe impl Send for PooledPayload {}

impl PayloadMemory for PooledPayload {
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: see `Send`: the buffer is ours, of at least `len` bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn freeze(self: Box<Self>) -> Bytes {
        Bytes::from_owner(Frozen(*self))
    }
}

/// A buffer's bytes as `Bytes`: read-only from here on.
struct Frozen(PooledPayload);

impl AsRef<[u8]> for Frozen {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl Drop for PooledPayload {
    fn drop(&mut self) {
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .give_back(self.ptr.as_ptr() as usize);
    }
}
