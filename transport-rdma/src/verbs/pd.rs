//! Protection domain.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use super::{last_os_error, CmId, Error, Result, SharedCmId};

/// An `ibv_pd` on the device of a [`CmId`]: memory regions and queue pairs
/// must share one to work together.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pub(crate) raw: NonNull<ffi::ibv_pd>,
    /// Keeps the device context (owned through the id) alive.
    _id: SharedCmId,
}

// SAFETY: libibverbs calls on a PD are thread-safe; the value only holds
// the pointer (deallocated once in Drop) and a Send + Sync `SharedCmId`.
unsafe impl Send for PdInner {}
// SAFETY: as for Send.
unsafe impl Sync for PdInner {}

impl ProtectionDomain {
    /// Allocates a protection domain on the id's device (`ibv_alloc_pd`).
    /// The id must be bound to a device (after resolve, or from a connect
    /// request).
    pub fn new(id: &CmId) -> Result<Self> {
        let verbs = id.verbs()?;
        // SAFETY: `verbs` is the live context of the id's device.
        let raw = unsafe { ffi::ibv_alloc_pd(verbs.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::AllocPd(last_os_error()))?;
        Ok(Self {
            inner: Arc::new(PdInner {
                raw,
                _id: id.share(),
            }),
        })
    }
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR and QP on this PD holds an `Arc` to it, so none is
        // left; the PD is deallocated once, before its context's id.
        unsafe { ffi::ibv_dealloc_pd(self.raw.as_ptr()) };
    }
}
