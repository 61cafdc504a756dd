//! Protection domain.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use rdma_sys as ffi;

use super::{last_os_error, CmId, Error, LiveCount, Result, SharedCmId};

/// An `ibv_pd` on the device of a [`CmId`]: memory regions and queue pairs
/// must share one to work together.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pub(crate) raw: NonNull<ffi::ibv_pd>,
    /// Shared by the connections on its device ([`ProtectionDomain::shared`]).
    shared: bool,
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
        Self::alloc(id, false)
    }

    /// The protection domain of every connection on the id's device that
    /// asks for it, allocated by the first: one per device and process
    /// while any of them lives, instead of one each. Only on a device that
    /// allocates type 2 memory windows, through which alone the peers of
    /// a shared domain's queue pairs reach its memory (a window is bound to
    /// one queue pair; a registration's rkey would be good on all of them):
    /// `None` on a device without (checked once per device and process).
    /// The domain keeps the id it was allocated from (and so its device's
    /// context) until the last connection on the device lets it go.
    pub fn shared(id: &CmId) -> Result<Option<Self>> {
        /// Per device context: its shared domain, while one lives, and
        /// whether the device has windows.
        static DEVICES: Mutex<Vec<(usize, Weak<PdInner>, bool)>> = Mutex::new(Vec::new());
        let device = id.verbs()?.as_ptr() as usize;
        let mut devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
        devices.retain(|(_, pd, windows)| pd.strong_count() > 0 || !windows);
        if let Some((_, pd, windows)) = devices.iter().find(|(d, ..)| *d == device) {
            return Ok(pd
                .upgrade()
                .map(|inner| ProtectionDomain { inner })
                .filter(|_| *windows));
        }
        let pd = Self::alloc(id, true)?;
        let windows = match super::MemoryWindow::new(&pd) {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(
                    "one protection domain per connection on this device: it allocates no \
                     memory windows to share one safely ({e})"
                );
                false
            }
        };
        devices.push((device, Arc::downgrade(&pd.inner), windows));
        Ok(windows.then_some(pd))
    }

    /// Whether this domain is shared by the connections on its device.
    pub fn is_shared(&self) -> bool {
        self.inner.shared
    }

    fn alloc(id: &CmId, shared: bool) -> Result<Self> {
        let verbs = id.verbs()?;
        // SAFETY: `verbs` is the live context of the id's device.
        let raw = unsafe { ffi::ibv_alloc_pd(verbs.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::AllocPd(last_os_error()))?;
        LIVE.created();
        Ok(Self {
            inner: Arc::new(PdInner {
                raw,
                shared,
                _id: id.share(),
            }),
        })
    }
}

/// Protection domains of this process not yet deallocated.
static LIVE: LiveCount = LiveCount::new();

/// How many protection domains this process holds: one per device for
/// connections that share theirs ([`ProtectionDomain::shared`]), plus one
/// per connection that does not.
pub fn protection_domains() -> usize {
    LIVE.get()
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR and QP on this PD holds an `Arc` to it, so none is
        // left; the PD is deallocated once, before its context's id.
        unsafe { ffi::ibv_dealloc_pd(self.raw.as_ptr()) };
        LIVE.destroyed();
    }
}
