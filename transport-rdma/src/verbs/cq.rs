//! Completion queue.

use std::ffi::CStr;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use super::{errno_error, last_os_error, CmId, Error, LiveCount, Result, SharedCmId};

/// An `ibv_cq` on the device of a [`CmId`], polled, and reporting to a
/// [`CompletionChannel`] when armed if made [`with_channel`](Self::with_channel).
/// Cloning shares the same CQ.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

pub(crate) struct CqInner {
    pub(crate) raw: NonNull<ffi::ibv_cq>,
    /// The channel it reports to, if any (destroyed after the CQ).
    _channel: Option<CompletionChannel>,
    /// Keeps the device context alive.
    _id: SharedCmId,
}

// SAFETY: libibverbs calls on a CQ are thread-safe; the value only holds
// the pointer (destroyed once in Drop) and Send + Sync handles.
unsafe impl Send for CqInner {}
// SAFETY: as for Send.
unsafe impl Sync for CqInner {}

/// An `ibv_comp_channel`: a file descriptor that becomes readable when an
/// armed [`CompletionQueue`] gets a completion. Non-blocking. Cloning shares it.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<CompChannelInner>,
}

struct CompChannelInner {
    raw: NonNull<ffi::ibv_comp_channel>,
    /// Keeps the device context alive.
    _id: SharedCmId,
}

// SAFETY: libibverbs calls on a completion channel are thread-safe; the
// value only holds the pointer (destroyed once in Drop) and a `SharedCmId`.
unsafe impl Send for CompChannelInner {}
// SAFETY: as for Send.
unsafe impl Sync for CompChannelInner {}

impl CompletionChannel {
    /// Creates a channel on the id's device (`ibv_create_comp_channel`),
    /// with a non-blocking descriptor.
    pub fn new(id: &CmId) -> Result<Self> {
        let verbs = id.verbs()?;
        // SAFETY: `verbs` is the live context of the id's device.
        let raw = unsafe { ffi::ibv_create_comp_channel(verbs.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::CreateCompChannel(last_os_error()))?;
        LIVE_CHANNELS.created();
        let channel = Self {
            inner: Arc::new(CompChannelInner {
                raw,
                _id: id.share(),
            }),
        };
        let fd = channel.fd();
        // SAFETY: `fd` is the channel's open descriptor; F_GETFL/F_SETFL
        // only change its status flags.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(Error::CreateCompChannel(last_os_error()));
        }
        Ok(channel)
    }

    /// The descriptor to register with an event loop.
    pub fn fd(&self) -> libc::c_int {
        // SAFETY: `raw` points to the live channel this value shares.
        unsafe { self.inner.raw.as_ref().fd }
    }

    /// Takes one completion event if there is one (`ibv_get_cq_event`) and
    /// acknowledges it; true if one was taken. The CQ must be re-armed
    /// ([`CompletionQueue::arm`]) to get another.
    pub fn try_take_event(&self) -> Result<bool> {
        let mut cq = ptr::null_mut();
        let mut ctx = ptr::null_mut();
        // SAFETY: the channel is live; `cq` and `ctx` are valid out-pointers;
        // the descriptor is non-blocking.
        let ret = unsafe { ffi::ibv_get_cq_event(self.inner.raw.as_ptr(), &mut cq, &mut ctx) };
        if ret != 0 {
            let err = last_os_error();
            return if err.kind() == std::io::ErrorKind::WouldBlock {
                Ok(false)
            } else {
                Err(Error::GetCqEvent(err))
            };
        }
        // SAFETY: `cq` is the live CQ the event is for (it holds this
        // channel, and we hold the channel); one event is acknowledged.
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }
}

impl Drop for CompChannelInner {
    fn drop(&mut self) {
        // SAFETY: every CQ on this channel holds a clone, so none is left;
        // destroyed once.
        unsafe { ffi::ibv_destroy_comp_channel(self.raw.as_ptr()) };
        LIVE_CHANNELS.destroyed();
    }
}

/// Completion channels of this process not yet destroyed.
static LIVE_CHANNELS: LiveCount = LiveCount::new();

/// How many completion channels (each a file descriptor) this process
/// holds: one per connection end.
pub fn completion_channels() -> usize {
    LIVE_CHANNELS.get()
}

/// One work completion (the fields the layer uses so far).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The id given when posting.
    pub wr_id: u64,
    /// `ibv_wc_opcode` (`IBV_WC_SEND`, `IBV_WC_RECV`, `IBV_WC_RDMA_WRITE`, ...).
    pub opcode: u32,
    /// Bytes received (receive completions).
    pub byte_len: u32,
    /// `ibv_wc_status` (0 = `IBV_WC_SUCCESS`; [`poll`](CompletionQueue::poll)
    /// turns the others into errors, [`poll_batch`](CompletionQueue::poll_batch)
    /// returns them).
    pub status: u32,
}

/// Room for the completions one [`CompletionQueue::poll_batch`] takes,
/// kept by whoever polls and reused: zeroed once. A batch made for each
/// poll zeroed and copied its 1.5 KiB every time: 4,100 of the 34,600
/// instructions of a 32-byte echo over `rdma://`.
pub struct CompletionBatch {
    /// Always initialized: zeroed at first, then what the provider wrote.
    /// A provider may leave fields it does not report (an error
    /// completion's opcode and length, say) as they were; those are never
    /// read as meaningful, and are integers either way.
    raw: Box<[ffi::ibv_wc]>,
    /// Entries the last poll wrote.
    len: usize,
}

impl CompletionBatch {
    /// Completions one poll takes at most.
    pub const CAPACITY: usize = 32;

    /// An empty batch.
    pub fn new() -> CompletionBatch {
        let zeroed = || {
            // SAFETY: `ibv_wc` is plain integers and a union of integers:
            // all zeroes is a valid value.
            unsafe { std::mem::zeroed::<ffi::ibv_wc>() }
        };
        CompletionBatch {
            raw: std::iter::repeat_with(zeroed)
                .take(Self::CAPACITY)
                .collect(),
            len: 0,
        }
    }

    /// Whether the last poll filled the batch (more may be waiting).
    pub fn is_full(&self) -> bool {
        self.len == Self::CAPACITY
    }

    /// Completion `i` of the last poll (`i` below what it returned).
    pub fn get(&self, i: usize) -> WorkCompletion {
        WorkCompletion::of(&self.raw[..self.len][i])
    }
}

impl Default for CompletionBatch {
    fn default() -> CompletionBatch {
        CompletionBatch::new()
    }
}

impl WorkCompletion {
    /// The fields the layer uses of a polled `ibv_wc`.
    fn of(wc: &ffi::ibv_wc) -> WorkCompletion {
        WorkCompletion {
            wr_id: wc.wr_id,
            opcode: wc.opcode,
            byte_len: wc.byte_len,
            status: wc.status,
        }
    }

    /// True when the work request succeeded.
    pub fn is_ok(&self) -> bool {
        self.status == ffi::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// The status, as `ibv_wc_status_str` names it, with what it means
    /// where the name does not say (an RNR).
    pub fn status_name(&self) -> String {
        if self.status == ffi::ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR {
            return "RNR retry counter exceeded: the peer had no receive posted for a SEND \
                    (its credits allowed none: a peer that breaks the credit protocol)"
                .to_string();
        }
        // SAFETY: ibv_wc_status_str returns a static NUL-terminated string
        // for any value.
        unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(self.status)) }
            .to_string_lossy()
            .into_owned()
    }
}

impl CompletionQueue {
    /// Creates a completion queue of at least `depth` entries on the id's
    /// device (`ibv_create_cq`).
    pub fn new(id: &CmId, depth: u32) -> Result<Self> {
        Self::create(id, depth, None)
    }

    /// Creates a completion queue of at least `depth` entries reporting to
    /// `channel` when armed ([`arm`](Self::arm)).
    pub fn with_channel(id: &CmId, depth: u32, channel: &CompletionChannel) -> Result<Self> {
        Self::create(id, depth, Some(channel))
    }

    fn create(id: &CmId, depth: u32, channel: Option<&CompletionChannel>) -> Result<Self> {
        let verbs = id.verbs()?;
        let cqe = libc::c_int::try_from(depth).unwrap_or(libc::c_int::MAX);
        let channel_raw = channel.map_or(ptr::null_mut(), |c| c.inner.raw.as_ptr());
        // SAFETY: `verbs` is the live context of the id's device, and the
        // channel, if any, was made on the same device; no user context.
        let raw =
            unsafe { ffi::ibv_create_cq(verbs.as_ptr(), cqe, ptr::null_mut(), channel_raw, 0) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::CreateCq(last_os_error()))?;
        LIVE_CQS.created();
        Ok(Self {
            inner: Arc::new(CqInner {
                raw,
                _channel: channel.cloned(),
                _id: id.share(),
            }),
        })
    }

    /// Asks for an event on the channel at the next completion
    /// (`ibv_req_notify_cq`). Poll once more after arming: a completion
    /// that came just before is not announced.
    pub fn arm(&self) -> Result<()> {
        // SAFETY: the CQ is live.
        let ret = unsafe { ffi::ibv_req_notify_cq(self.inner.raw.as_ptr(), 0) };
        if ret == 0 {
            Ok(())
        } else {
            Err(Error::ReqNotifyCq(errno_error(ret)))
        }
    }

    /// Takes up to [`CompletionBatch::CAPACITY`] completions
    /// (`ibv_poll_cq`) into `batch`, error completions included (see
    /// [`WorkCompletion::status`]); returns how many.
    pub fn poll_batch(&self, batch: &mut CompletionBatch) -> Result<usize> {
        batch.len = 0;
        // SAFETY: the CQ is live; `batch.raw` has room for CAPACITY entries.
        let n = unsafe {
            ffi::ibv_poll_cq(
                self.inner.raw.as_ptr(),
                CompletionBatch::CAPACITY as libc::c_int,
                batch.raw.as_mut_ptr(),
            )
        };
        if n < 0 {
            return Err(Error::PollCq(errno_error(n)));
        }
        batch.len = n as usize;
        Ok(batch.len)
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
        Ok(Some(WorkCompletion::of(&wc)))
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
        // SAFETY: every QP using this CQ holds an `Arc` to it, so none is
        // left; the CQ is destroyed once.
        unsafe { ffi::ibv_destroy_cq(self.raw.as_ptr()) };
        LIVE_CQS.destroyed();
    }
}

/// Completion queues of this process not yet destroyed.
static LIVE_CQS: LiveCount = LiveCount::new();

/// How many completion queues this process holds (one per connection end).
pub fn completion_queues() -> usize {
    LIVE_CQS.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_hands_out_what_the_last_poll_wrote_and_nothing_past_it() {
        let mut batch = CompletionBatch::new();
        assert!(!batch.is_full());
        assert!(std::panic::catch_unwind(|| batch.get(0)).is_err());
        // As `poll_batch` leaves it after a poll that returned two.
        batch.raw[0].wr_id = 7;
        batch.raw[1].wr_id = 9;
        batch.raw[1].byte_len = 32;
        batch.raw[2].wr_id = 11; // a stale entry from an earlier poll
        batch.len = 2;
        assert_eq!(batch.get(0).wr_id, 7);
        assert_eq!((batch.get(1).wr_id, batch.get(1).byte_len), (9, 32));
        assert!(std::panic::catch_unwind(|| batch.get(2)).is_err());
        batch.len = CompletionBatch::CAPACITY;
        assert!(batch.is_full());
    }
}
