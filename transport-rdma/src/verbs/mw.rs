//! Memory windows: remote access to a part of a registered region, granted
//! by a work request and revoked by deallocating the window.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use super::pd::PdInner;
use super::{last_os_error, Error, ProtectionDomain, Result};

/// A type 2 memory window (`ibv_alloc_mw`): once bound
/// ([`QueuePair::post_bind`](super::QueuePair::post_bind)) it lets the
/// peer of that one queue pair RDMA READ a range of a region registered
/// with [`Access::MW_BIND`](super::Access::MW_BIND), through the rkey
/// given at the bind; dropping it (`ibv_dealloc_mw`) ends that access. The
/// region itself grants no remote access at all: memory that stays
/// registered (a pool) is readable only while a window over it lives.
pub struct MemoryWindow {
    raw: NonNull<ffi::ibv_mw>,
    pub(crate) pd: Arc<PdInner>,
}

// SAFETY: the value owns its window handle; libibverbs calls on it are
// thread-safe, and nothing in it changes after `new`.
unsafe impl Send for MemoryWindow {}

impl MemoryWindow {
    /// Allocates an unbound type 2 window on `pd`.
    pub fn new(pd: &ProtectionDomain) -> Result<Self> {
        // SAFETY: the PD is live (we hold it).
        let raw =
            unsafe { ffi::ibv_alloc_mw(pd.inner.raw.as_ptr(), ffi::ibv_mw_type::IBV_MW_TYPE_2) };
        let raw = raw
            .and_then(NonNull::new)
            .ok_or_else(|| Error::AllocMw(last_os_error()))?;
        Ok(MemoryWindow {
            raw,
            pd: Arc::clone(&pd.inner),
        })
    }

    pub(crate) fn raw(&self) -> NonNull<ffi::ibv_mw> {
        self.raw
    }

    /// The rkey a bind gives the window: its allocated key with the low
    /// 8 bits (the consumer's part) stepped (`ibv_inc_rkey`).
    pub fn bound_rkey(&self) -> u32 {
        // SAFETY: the window is live; `rkey` is read once, before any bind.
        let rkey = unsafe { self.raw.as_ref().rkey };
        // SAFETY: plain arithmetic on the value.
        unsafe { ffi::ibv_inc_rkey(rkey) }
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: the live window this value owns, deallocated once.
        let ret = unsafe { ffi::ibv_dealloc_mw(self.raw.as_ptr()) };
        if ret != 0 {
            // The window may still be bound; its region then refuses to
            // be deregistered (`ibv_dereg_mr` fails while windows are bound
            // to it), and a region that cannot be deregistered leaks its
            // buffer rather than free memory the device may still read.
            tracing::error!(error = %super::errno_error(ret), "ibv_dealloc_mw failed");
        }
    }
}
