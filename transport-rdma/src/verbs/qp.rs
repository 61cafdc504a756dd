//! Queue pair (reliable connected), created through the connection manager.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::ptr;
use std::sync::Arc;

use rdma_sys as ffi;

use super::cq::CqInner;
use super::mr::BindTarget;
use super::pd::PdInner;
use super::Result;
use super::{
    errno_error, last_os_error, Access, CmId, CompletionQueue, Error, LiveCount, MemoryRegion,
    MemoryWindow, ProtectionDomain, RemoteRegion, SharedCmId,
};

/// Queue sizes of a [`QueuePair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCapabilities {
    /// Outstanding send-queue work requests.
    pub max_send_wr: u32,
    /// Outstanding receive-queue work requests.
    pub max_recv_wr: u32,
    /// Bytes a SEND or WRITE may carry inline (copied into the work
    /// request when posted, so the device need not read them from
    /// memory afterwards). A request the device refuses falls back to 0.
    pub max_inline_data: u32,
}

impl Default for QpCapabilities {
    fn default() -> Self {
        Self {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_inline_data: 0,
        }
    }
}

/// Work requests linked into one `ibv_post_send` at most (one doorbell;
/// on Soft-RoCE one system call).
const POST_BATCH: usize = 32;

/// A send-queue work request waiting for [`QueuePair::post_queued`]: plain
/// values (no pointers), so the queue pair stays `Send`.
#[derive(Clone, Copy)]
struct Queued {
    wr_id: u64,
    sge: ffi::ibv_sge,
    opcode: ffi::ibv_wr_opcode::Type,
    remote_addr: u64,
    rkey: u32,
    /// Whether its completion is reported (`IBV_SEND_SIGNALED`).
    signaled: bool,
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
    /// What the device granted of [`QpCapabilities::max_inline_data`].
    max_inline: u32,
    /// Send-queue requests queued, not yet posted.
    queued: Vec<Queued>,
}

// SAFETY: libibverbs calls on a QP are thread-safe; posting takes `&mut
// self`; the value holds only Send + Sync handles.
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// Creates the id's RC queue pair on `pd`, completing into `send_cq`
    /// and `recv_cq` (which may be the same). One scatter/gather entry per
    /// request; inline data up to `caps.max_inline_data` if the device
    /// allows it, else none.
    /// Takes `&mut` id: creating the QP sets the id's `qp` field.
    pub fn new(
        id: &mut CmId,
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCapabilities,
    ) -> Result<Self> {
        match Self::create(id, pd, send_cq, recv_cq, caps) {
            // Devices refuse more inline data than they support (EINVAL),
            // and none says beforehand how much that is.
            Err(Error::CreateQp(e))
                if caps.max_inline_data > 0 && e.raw_os_error() == Some(libc::EINVAL) =>
            {
                let caps = QpCapabilities {
                    max_inline_data: 0,
                    ..caps
                };
                Self::create(id, pd, send_cq, recv_cq, caps)
            }
            created => created,
        }
    }

    fn create(
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
                max_inline_data: caps.max_inline_data,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the id, PD and CQs are live and on the same device (all
        // were made from this id's context); `attr` is valid for the call.
        if unsafe { ffi::rdma_create_qp(id.as_ptr(), pd.inner.raw.as_ptr(), &mut attr) } != 0 {
            return Err(Error::CreateQp(last_os_error()));
        }
        LIVE.created();
        Ok(Self {
            id: id.share(),
            pd: Arc::clone(&pd.inner),
            _send_cq: Arc::clone(&send_cq.inner),
            _recv_cq: Arc::clone(&recv_cq.inner),
            // The provider writes back what it granted (at least what was
            // asked for).
            max_inline: attr.cap.max_inline_data.min(caps.max_inline_data),
            queued: Vec::with_capacity(POST_BATCH),
        })
    }

    /// Bytes a SEND or WRITE carries inline: those of that size or less
    /// are copied when posted.
    pub fn max_inline_data(&self) -> u32 {
        self.max_inline
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
        Ok(self.query(ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT)?.timeout)
    }

    /// Its state, retry settings and send queue depth as the device
    /// reports them (`ibv_query_qp`): `STATE, ack timeout T, retries R,
    /// RNR retries N, send queue D`, the state `RTS` on a working
    /// connection and `ERR` on a failed one; for debugging a stalled
    /// connection.
    pub fn describe(&self) -> String {
        use ffi::ibv_qp_attr_mask as M;
        let mask = M::IBV_QP_STATE
            | M::IBV_QP_TIMEOUT
            | M::IBV_QP_RETRY_CNT
            | M::IBV_QP_RNR_RETRY
            | M::IBV_QP_CAP;
        match self.query(mask) {
            Ok(attr) => {
                let state = ["RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"]
                    .get(attr.qp_state as usize)
                    .copied()
                    .unwrap_or("UNKNOWN");
                format!(
                    "{state}, ack timeout {}, retries {}, RNR retries {}, send queue {}",
                    attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.cap.max_send_wr
                )
            }
            Err(e) => e.to_string(),
        }
    }

    /// The attributes of `mask` (`ibv_query_qp`).
    fn query(&self, mask: ffi::ibv_qp_attr_mask) -> Result<ffi::ibv_qp_attr> {
        // SAFETY: plain C structs, for which all-zero bytes are valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the QP is live (destroyed only in Drop); both out-pointers
        // are valid for the call.
        if unsafe { ffi::ibv_query_qp(self.raw(), &mut attr, mask.0 as libc::c_int, &mut init) }
            != 0
        {
            return Err(Error::QueryQp(last_os_error()));
        }
        Ok(attr)
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
        let mut sge = mr.sge(range, 0)?;
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
    /// `IBV_WR_SEND`), with what was queued before it
    /// ([`queue_send`](Self::queue_send)).
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
        unsafe { self.queue_send(wr_id, mr, range)? };
        self.post_queued()
    }

    /// Queues a signaled SEND of `mr[range]` (`IBV_WR_SEND`) for the next
    /// [`post_queued`](Self::post_queued). Up to
    /// [`max_inline_data`](Self::max_inline_data) bytes are sent inline.
    ///
    /// # Safety
    /// As [`post_send`](Self::post_send), from this call on.
    pub unsafe fn queue_send(
        &mut self,
        wr_id: u64,
        mr: &MemoryRegion,
        range: Range<usize>,
    ) -> Result<()> {
        self.queue(
            wr_id,
            mr,
            range,
            ffi::ibv_wr_opcode::IBV_WR_SEND,
            (0, 0),
            true,
        )
    }

    /// Queues an RDMA WRITE of `mr[range]` to `remote` at `remote_offset`
    /// (`IBV_WR_RDMA_WRITE`) for the next [`post_queued`](Self::post_queued).
    /// The range is checked against `remote` here. An unsignaled WRITE
    /// (`signaled` false) reports a completion only if it fails; a
    /// signaled request queued after it completes after it (an RC send
    /// queue completes in order), and must follow it, or its send-queue
    /// entry is never reclaimed.
    ///
    /// # Safety
    /// As [`post_send`](Self::post_send), from this call on; unsignaled,
    /// until the completion of a signaled request queued after it.
    pub unsafe fn queue_write(
        &mut self,
        wr_id: u64,
        mr: &MemoryRegion,
        range: Range<usize>,
        remote: RemoteRegion,
        remote_offset: u64,
        signaled: bool,
    ) -> Result<()> {
        remote.check(remote_offset, range.len() as u64)?;
        let target = (remote.addr + remote_offset, remote.rkey);
        self.queue(
            wr_id,
            mr,
            range,
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            target,
            signaled,
        )
    }

    /// Queues a signaled RDMA READ of `range.len()` bytes of the peer's
    /// memory at `remote_addr` (its registration `rkey`) into `mr[range]`
    /// (`IBV_WR_RDMA_READ`) for the next [`post_queued`](Self::post_queued).
    /// Nothing is checked on the remote side here: the peer's device checks
    /// the read against the registration `rkey` names (bounds and
    /// remote-read access) and fails the request (`IBV_WC_REM_ACCESS_ERR`)
    /// otherwise.
    ///
    /// # Safety
    /// As [`post_recv`](Self::post_recv), from this call on: the device
    /// writes `mr[range]` until the completion, so `mr` must not be
    /// dropped, and `mr[range]` must not be read or written, until this
    /// request's completion has been polled (or the QP is destroyed).
    pub unsafe fn queue_read(
        &mut self,
        wr_id: u64,
        mr: &MemoryRegion,
        range: Range<usize>,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<()> {
        let target = (remote_addr, rkey);
        self.queue(
            wr_id,
            mr,
            range,
            ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
            target,
            true,
        )
    }

    fn queue(
        &mut self,
        wr_id: u64,
        mr: &MemoryRegion,
        range: Range<usize>,
        opcode: ffi::ibv_wr_opcode::Type,
        (remote_addr, rkey): (u64, u32),
        signaled: bool,
    ) -> Result<()> {
        self.check_pd(mr)?;
        // The poster sends up to `max_inline` bytes inline (not READs).
        let inline_max = if opcode == ffi::ibv_wr_opcode::IBV_WR_RDMA_READ {
            0
        } else {
            self.max_inline
        };
        let sge = mr.sge(range, inline_max)?;
        self.queued.push(Queued {
            wr_id,
            sge,
            opcode,
            remote_addr,
            rkey,
            signaled,
        });
        Ok(())
    }

    /// Binds `window` to `mr[range]` for remote reads or writes (`access`:
    /// [`Access::REMOTE_READ`] or [`Access::REMOTE_WRITE`]) through the
    /// window's [`bound_rkey`](MemoryWindow::bound_rkey) (`IBV_WR_BIND_MW`,
    /// unsignaled: it completes only if it fails), posted at once, not
    /// queued: a SEND posted after it reaches the peer after the bind took
    /// effect (an RC send queue executes in order), so a peer told the rkey
    /// in that SEND can use it. The window is bound to this queue pair:
    /// only its peer can use the rkey. Returns what the peer names
    /// `mr[range]` by (the address and the window's rkey). A signaled
    /// request must follow, or the bind's send-queue entry is never
    /// reclaimed. Writes need memory made
    /// [`writable_through_windows`](MemoryRegion::writable_through_windows).
    ///
    /// # Safety
    /// For reads, `mr[range]` must not be written until `window` is
    /// dropped (the peer may read it until then); `mr` must stay
    /// registered (it does: its deregistration fails while a window is
    /// bound to it).
    pub unsafe fn post_bind(
        &mut self,
        wr_id: u64,
        window: &MemoryWindow,
        mr: &MemoryRegion,
        range: Range<usize>,
        access: Access,
    ) -> Result<RemoteRegion> {
        let target = mr.bind_target(range)?;
        // SAFETY: as the caller guarantees.
        unsafe { self.bind(wr_id, window, target, access) }
    }

    /// [`post_bind`](Self::post_bind) over `target`.
    ///
    /// # Safety
    /// As [`post_bind`](Self::post_bind), for the memory `target` names.
    pub(crate) unsafe fn bind(
        &mut self,
        wr_id: u64,
        window: &MemoryWindow,
        target: BindTarget,
        access: Access,
    ) -> Result<RemoteRegion> {
        if !Arc::ptr_eq(&self.pd, &target.pd) || !Arc::ptr_eq(&self.pd, &window.pd) {
            return Err(Error::ForeignMemoryRegion);
        }
        assert!(
            access == Access::REMOTE_READ || (access == Access::REMOTE_WRITE && target.peer_writes),
            "a window grants remote reads, or writes of memory made writable through windows"
        );
        let remote = RemoteRegion {
            addr: target.addr,
            rkey: window.bound_rkey(),
            len: target.len,
        };
        let raw_mr = target.raw;
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
            opcode: ffi::ibv_wr_opcode::IBV_WR_BIND_MW,
            send_flags: 0,
            imm_data_invalidated_rkey_union: ffi::imm_data_invalidated_rkey_union_t { imm_data: 0 },
            wr: ffi::wr_t {
                rdma: ffi::rdma_t {
                    remote_addr: 0,
                    rkey: 0,
                },
            },
            qp_type: ffi::qp_type_t {
                xrc: ffi::xrc_t { remote_srqn: 0 },
            },
            bind_mw_tso_union: ffi::bind_mw_tso_union_t {
                bind_mw: ffi::bind_mw_t {
                    mw: window.raw().as_ptr(),
                    rkey: remote.rkey,
                    bind_info: ffi::ibv_mw_bind_info {
                        mr: raw_mr.as_ptr(),
                        addr: remote.addr,
                        length: remote.len,
                        mw_access_flags: access.0,
                    },
                },
            },
        };
        let mut bad = ptr::null_mut();
        // SAFETY: the QP, window and MR are live and on one PD (checked);
        // `wr` is valid for the call (the provider copies it); the range
        // lies inside the MR (checked by `sge`), and the caller keeps it
        // unwritten while the window lives.
        let ret = unsafe { ffi::ibv_post_send(self.raw(), &mut wr, &mut bad) };
        if ret == 0 {
            Ok(remote)
        } else {
            Err(Error::PostSend(errno_error(ret)))
        }
    }

    /// Posts every queued request, in order, linked
    /// into as few `ibv_post_send` calls as can be (32 requests each). On an
    /// error the requests before the failed one were posted; none after
    /// it was; the queue is empty either way.
    pub fn post_queued(&mut self) -> Result<()> {
        let mut batch = SendBatch::default();
        self.take_queued(&mut batch);
        // SAFETY: the queue pair is alive (we hold it), and `&mut self`
        // makes this the only poster.
        unsafe { self.poster().post(&mut batch) }
    }

    /// Whether requests are queued and not posted.
    pub fn has_queued(&self) -> bool {
        !self.queued.is_empty()
    }

    /// Bytes the queued requests move.
    pub fn queued_bytes(&self) -> u64 {
        self.queued.iter().map(|q| u64::from(q.sge.length)).sum()
    }

    /// Moves the queued requests into `batch` (empty), in order, to post
    /// them with a [`SendPoster`] without holding the queue pair.
    pub fn take_queued(&mut self, batch: &mut SendBatch) {
        debug_assert!(batch.0.is_empty(), "a batch not posted");
        std::mem::swap(&mut self.queued, &mut batch.0);
    }

    /// A handle that posts batches to this queue pair's send queue from
    /// any thread (`ibv_post_send` is thread-safe), so that a caller can
    /// post without holding the lock that guards the queue pair: on
    /// Soft-RoCE a post is a system call in which the kernel transmits
    /// the requests, for as long as that takes.
    pub fn poster(&self) -> SendPoster {
        SendPoster {
            qp: self.raw(),
            max_inline: self.max_inline,
        }
    }
}

/// Send-queue requests taken out of a [`QueuePair`] to post
/// ([`QueuePair::take_queued`], [`SendPoster::post`]).
#[derive(Default)]
pub struct SendBatch(Vec<Queued>);

impl SendBatch {
    /// Whether it holds no request.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Posts [`SendBatch`]es to a queue pair's send queue ([`QueuePair::poster`]).
#[derive(Clone, Copy)]
pub struct SendPoster {
    qp: *mut ffi::ibv_qp,
    max_inline: u32,
}

// SAFETY: a plain handle; `post`'s contract says when it may be used, and
// libibverbs allows posting from any thread.
unsafe impl Send for SendPoster {}
// SAFETY: as above.
unsafe impl Sync for SendPoster {}

impl SendPoster {
    /// Posts `batch`'s requests in order, linked into as few
    /// `ibv_post_send` calls as can be (32 requests each), and empties it. On
    /// an error the requests before the failed one were posted; none after
    /// it was.
    ///
    /// # Safety
    /// The queue pair must be alive for the whole call. The requests'
    /// memory contracts were taken on when they were queued (`queue_*`).
    /// Requests are posted in the order of the calls: one poster at a
    /// time keeps the order they were queued in.
    pub unsafe fn post(&self, batch: &mut SendBatch) -> Result<()> {
        let mut result = Ok(());
        for chunk in batch.0.chunks(POST_BATCH) {
            // Only the entries used are written (no 4 KiB of zeroing per
            // post), all through one base pointer per array.
            let mut sges = [const { MaybeUninit::<ffi::ibv_sge>::uninit() }; POST_BATCH];
            let mut wrs = [const { MaybeUninit::<ffi::ibv_send_wr>::uninit() }; POST_BATCH];
            let sge_base = sges.as_mut_ptr().cast::<ffi::ibv_sge>();
            let wr_base = wrs.as_mut_ptr().cast::<ffi::ibv_send_wr>();
            for (i, q) in chunk.iter().enumerate() {
                let inline = q.opcode != ffi::ibv_wr_opcode::IBV_WR_RDMA_READ
                    && q.sge.length <= self.max_inline;
                let mut flags = if inline {
                    ffi::ibv_send_flags::IBV_SEND_INLINE.0
                } else {
                    0
                };
                if q.signaled {
                    flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                // SAFETY: `i < chunk.len() <= POST_BATCH`: within both
                // arrays (and `i + 1` at most one past the end, where
                // `next` is not used: the last request's is null).
                unsafe {
                    sge_base.add(i).write(q.sge);
                    wr_base.add(i).write(ffi::ibv_send_wr {
                        wr_id: q.wr_id,
                        next: if i + 1 < chunk.len() {
                            wr_base.add(i + 1)
                        } else {
                            ptr::null_mut()
                        },
                        sg_list: sge_base.add(i),
                        num_sge: 1,
                        opcode: q.opcode,
                        send_flags: flags,
                        imm_data_invalidated_rkey_union: ffi::imm_data_invalidated_rkey_union_t {
                            imm_data: 0,
                        },
                        wr: ffi::wr_t {
                            rdma: ffi::rdma_t {
                                remote_addr: q.remote_addr,
                                rkey: q.rkey,
                            },
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
                    });
                }
            }
            let mut bad = ptr::null_mut();
            // SAFETY: the QP is live (this function's contract); the
            // chunk's requests were all written above, linked in order, and
            // they and their SGEs are valid for the call (the provider
            // copies them, and inline data, before returning); each SGE
            // lies inside a region registered on the QP's PD (checked when
            // queued), and the callers of `queue_*` keep that memory alive
            // and as their contracts say until completion.
            let ret = unsafe { ffi::ibv_post_send(self.qp, wr_base, &mut bad) };
            if ret != 0 {
                result = Err(Error::PostSend(errno_error(ret)));
                break;
            }
        }
        batch.0.clear();
        result
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: the QP was created on this id in `new` and is destroyed
        // once; the id, PD and CQs it uses are still alive (we hold them).
        unsafe { ffi::rdma_destroy_qp(self.id.as_ptr()) };
        LIVE.destroyed();
    }
}

/// Queue pairs of this process not yet destroyed.
static LIVE: LiveCount = LiveCount::new();

/// How many queue pairs this process holds (one per connection end).
pub fn queue_pairs() -> usize {
    LIVE.get()
}
