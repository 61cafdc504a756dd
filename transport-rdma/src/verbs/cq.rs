//! Completion queue.

use std::ffi::CStr;
use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use super::{errno_error, last_os_error, CmId, Error, Result};

/// An `ibv_cq` on the device of a [`CmId`], polled (no completion channel
/// yet). Cloning shares the same CQ.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Rc<CqInner>,
}

pub(crate) struct CqInner {
    pub(crate) raw: NonNull<ffi::ibv_cq>,
    /// Keeps the device context alive.
    _id: CmId,
}

/// One work completion (the fields the layer uses so far).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The id given when posting.
    pub wr_id: u64,
    /// `ibv_wc_opcode` (`IBV_WC_SEND`, `IBV_WC_RECV`, `IBV_WC_RDMA_WRITE`, ...).
    pub opcode: u32,
    /// Bytes received (receive completions).
    pub byte_len: u32,
}

impl CompletionQueue {
    /// Creates a completion queue of at least `depth` entries on the id's
    /// device (`ibv_create_cq`).
    pub fn new(id: &CmId, depth: u32) -> Result<Self> {
        let verbs = id.verbs()?;
        let cqe = libc::c_int::try_from(depth).unwrap_or(libc::c_int::MAX);
        // SAFETY: `verbs` is the live context of the id's device; no
        // user context and no completion channel.
        let raw =
            unsafe { ffi::ibv_create_cq(verbs.as_ptr(), cqe, ptr::null_mut(), ptr::null_mut(), 0) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::CreateCq(last_os_error()))?;
        Ok(Self {
            inner: Rc::new(CqInner {
                raw,
                _id: id.clone(),
            }),
        })
    }

    /// Takes one completion if there is one (`ibv_poll_cq`). A completion
    /// with an error status is returned as [`Error::WorkCompletion`].
    pub fn poll(&self) -> Result<Option<WorkCompletion>> {
        let mut wc = std::mem::MaybeUninit::<ffi::ibv_wc>::zeroed();
        // SAFETY: the CQ is live; `wc` has room for the one entry asked for.
        let n = unsafe { ffi::ibv_poll_cq(self.inner.raw.as_ptr(), 1, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(Error::PollCq(errno_error(n)));
        }
        if n == 0 {
            return Ok(None);
        }
        // SAFETY: ibv_poll_cq filled the entry (n == 1); zeroed memory is a
        // valid ibv_wc too (plain integers and a union of integers).
        let wc = unsafe { wc.assume_init() };
        if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
            // SAFETY: ibv_wc_status_str returns a static NUL-terminated
            // string for any value.
            let name = unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(wc.status)) };
            return Err(Error::WorkCompletion {
                wr_id: wc.wr_id,
                status: wc.status,
                status_name: name.to_string_lossy().into_owned(),
                vendor_err: wc.vendor_err,
            });
        }
        Ok(Some(WorkCompletion {
            wr_id: wc.wr_id,
            opcode: wc.opcode,
            byte_len: wc.byte_len,
        }))
    }

    /// Polls until a completion arrives or `timeout` passes (sleeping a
    /// little between empty polls, to leave the CPU to the device when it
    /// is software).
    pub fn wait(&self, timeout: Duration) -> Result<WorkCompletion> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(wc) = self.poll()? {
                return Ok(wc);
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: "a work completion",
                    timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an `Rc` to it, so none is
        // left; the CQ is destroyed once.
        unsafe { ffi::ibv_destroy_cq(self.raw.as_ptr()) };
    }
}
