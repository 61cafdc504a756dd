//! Queue pair (reliable connected), created through the connection manager.

use std::ops::Range;
use std::ptr;
use std::sync::Arc;

use rdma_sys as ffi;

use super::cq::CqInner;
use super::pd::PdInner;
use super::Result;
use super::{
    errno_error, last_os_error, CmId, CompletionQueue, Error, MemoryRegion, ProtectionDomain,
    RemoteRegion, SharedCmId,
};

/// Queue sizes of a [`QueuePair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCapabilities {
    /// Outstanding send-queue work requests.
    pub max_send_wr: u32,
    /// Outstanding receive-queue work requests.
    pub max_recv_wr: u32,
}

impl Default for QpCapabilities {
    fn default() -> Self {
        Self {
            max_send_wr: 16,
            max_recv_wr: 16,
        }
    }
}

/// An RC `ibv_qp` bound to a [`CmId`] (`rdma_create_qp`): the connection
/// manager moves it through its states on connect/accept.
///
/// Posting takes `&mut self`, and is `unsafe`: the device uses the posted
/// memory after the call returns (see each method's `# Safety`).
pub struct QueuePair {
    id: SharedCmId,
    pd: Arc<PdInner>,
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
}

// SAFETY: libibverbs calls on a QP are thread-safe; posting takes `&mut
// self`; the value holds only Send + Sync handles.
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// Creates the id's RC queue pair on `pd`, completing into `send_cq`
    /// and `recv_cq` (which may be the same). One scatter/gather entry per
    /// request, no inline data.
    /// Takes `&mut` id: creating the QP sets the id's `qp` field.
    pub fn new(
        id: &mut CmId,
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCapabilities,
    ) -> Result<Self> {
        let mut attr = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.inner.raw.as_ptr(),
            recv_cq: recv_cq.inner.raw.as_ptr(),
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the id, PD and CQs are live and on the same device (all
        // were made from this id's context); `attr` is valid for the call.
        if unsafe { ffi::rdma_create_qp(id.as_ptr(), pd.inner.raw.as_ptr(), &mut attr) } != 0 {
            return Err(Error::CreateQp(last_os_error()));
        }
        Ok(Self {
            id: id.share(),
            pd: Arc::clone(&pd.inner),
            _send_cq: Arc::clone(&send_cq.inner),
            _recv_cq: Arc::clone(&recv_cq.inner),
        })
    }

    fn raw(&self) -> *mut ffi::ibv_qp {
        // SAFETY: the id is live, and its `qp` was set by rdma_create_qp in
        // `new` and is destroyed only in our Drop.
        unsafe { (*self.id.as_ptr()).qp }
    }

    /// The queue pair's number, as async events name it
    /// ([`EventElement::Qp`](super::EventElement::Qp)).
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP is live (destroyed only in Drop).
        unsafe { (*self.raw()).qp_num }
    }

    /// The queue pair's ACK timeout exponent (`ibv_query_qp`,
    /// `IBV_QP_TIMEOUT`): 4.096 µs × 2^timeout per retry, 0 forever.
    pub fn ack_timeout(&self) -> Result<u8> {
        // SAFETY: plain C structs, for which all-zero bytes are valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT.0 as libc::c_int;
        // SAFETY: the QP is live (destroyed only in Drop); both out-pointers
        // are valid for the call.
        if unsafe { ffi::ibv_query_qp(self.raw(), &mut attr, mask, &mut init) } != 0 {
            return Err(Error::QueryQp(last_os_error()));
        }
        Ok(attr.timeout)
    }

    fn check_pd(&self, mr: &MemoryRegion) -> Result<()> {
        if Arc::ptr_eq(&self.pd, &mr.pd) {
            Ok(())
        } else {
            Err(Error::ForeignMemoryRegion)
        }
    }

    /// Posts a receive into `mr[range]` (`ibv_post_recv`).
    ///
    /// # Safety
    /// `mr` must not be dropped, and `mr[range]` must not be read or
    /// written, until this request's completion has been polled (or the QP
    /// is destroyed).
    pub unsafe fn post_recv(
        &mut self,
        wr_id: u64,
        mr: &MemoryRegion,
        range: Range<usize>,
    ) -> Result<()> {
        self.check_pd(mr)?;
        let mut sge = mr.sge(range)?;
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is live; `wr` and `sge` are valid for the call (the
        // provider copies them); the SGE lies inside `mr`, registered on
        // the QP's PD, and the caller keeps that memory alive and untouched
        // until completion.
        let ret = unsafe { ffi::ibv_post_recv(self.raw(), &mut wr, &mut bad) };
        if ret == 0 {
            Ok(())
        } else {
            Err(Error::PostRecv(errno_error(ret)))
        }
    }

    /// Posts a signaled SEND of `mr[range]` (`ibv_post_send`,
    /// `IBV_WR_SEND`).
    ///
    /// # Safety
    /// `mr` must not be dropped, and `mr[range]` must not be written, until
    /// this request's completion has been polled (or the QP is destroyed).
    pub unsafe fn post_send(
        &mut self,
        wr_id: u64,
        mr: &MemoryRegion,
        range: Range<usize>,
    ) -> Result<()> {
        // SAFETY: forwarded: the caller upholds this function's contract.
        unsafe { self.post(wr_id, mr, range, ffi::ibv_wr_opcode::IBV_WR_SEND, None) }
    }

    /// Posts a signaled RDMA WRITE of `mr[range]` to `remote` at
    /// `remote_offset` (`ibv_post_send`, `IBV_WR_RDMA_WRITE`). The range is
    /// checked against `remote` before posting.
    ///
    /// # Safety
    /// As [`post_send`](Self::post_send).
    pub unsafe fn post_write(
        &mut self,
        wr_id: u64,
        mr: &MemoryRegion,
        range: Range<usize>,
        remote: RemoteRegion,
        remote_offset: u64,
    ) -> Result<()> {
        remote.check(remote_offset, range.len() as u64)?;
        let target = (remote.addr + remote_offset, remote.rkey);
        // SAFETY: forwarded: the caller upholds this function's contract.
        unsafe {
            self.post(
                wr_id,
                mr,
                range,
                ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                Some(target),
            )
        }
    }

    /// Posts a signaled RDMA READ of `range.len()` bytes of the peer's
    /// memory at `remote_addr` (its registration `rkey`) into `mr[range]`
    /// (`ibv_post_send`, `IBV_WR_RDMA_READ`). Nothing is checked on the
    /// remote side here: the peer's device checks the read against the
    /// registration `rkey` names (bounds and remote-read access) and fails
    /// the request (`IBV_WC_REM_ACCESS_ERR`) otherwise.
    ///
    /// # Safety
    /// As [`post_recv`](Self::post_recv): the device writes `mr[range]`
    /// until the completion, so `mr` must not be dropped, and `mr[range]`
    /// must not be read or written, until this request's completion has
    /// been polled (or the QP is destroyed).
    pub unsafe fn post_read(
        &mut self,
        wr_id: u64,
        mr: &MemoryRegion,
        range: Range<usize>,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<()> {
        // SAFETY: forwarded: the caller upholds this function's contract
        // (for a READ, the local range is written, as a receive's is).
        unsafe {
            self.post(
                wr_id,
                mr,
                range,
                ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
                Some((remote_addr, rkey)),
            )
        }
    }

    /// # Safety
    /// As [`post_send`](Self::post_send); for a READ, as
    /// [`post_read`](Self::post_read).
    unsafe fn post(
        &mut self,
        wr_id: u64,
        mr: &MemoryRegion,
        range: Range<usize>,
        opcode: ffi::ibv_wr_opcode::Type,
        remote: Option<(u64, u32)>,
    ) -> Result<()> {
        self.check_pd(mr)?;
        let mut sge = mr.sge(range)?;
        let (remote_addr, rkey) = remote.unwrap_or((0, 0));
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            imm_data_invalidated_rkey_union: ffi::imm_data_invalidated_rkey_union_t { imm_data: 0 },
            wr: ffi::wr_t {
                rdma: ffi::rdma_t { remote_addr, rkey },
            },
            qp_type: ffi::qp_type_t {
                xrc: ffi::xrc_t { remote_srqn: 0 },
            },
            bind_mw_tso_union: ffi::bind_mw_tso_union_t {
                tso: ffi::tso_t {
                    hdr: ptr::null_mut(),
                    hdr_sz: 0,
                    mss: 0,
                },
            },
        };
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is live; `wr` and `sge` are valid for the call (the
        // provider copies them); the SGE lies inside `mr`, registered on
        // the QP's PD, and the caller keeps that memory alive and unchanged
        // until completion.
        let ret = unsafe { ffi::ibv_post_send(self.raw(), &mut wr, &mut bad) };
        if ret == 0 {
            Ok(())
        } else {
            Err(Error::PostSend(errno_error(ret)))
        }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: the QP was created on this id in `new` and is destroyed
        // once; the id, PD and CQs it uses are still alive (we hold them).
        unsafe { ffi::rdma_destroy_qp(self.id.as_ptr()) };
    }
}
