//! Completion events: one completion channel per device and tokio runtime,
//! read by one task on that runtime, instead of a channel (and a file
//! descriptor) per connection.
//!
//! A connection's completion queue reports to the channel of its device
//! and of the runtime that set it up ([`lease`]); the channel's reader, a
//! task on that runtime, takes each event, which calls the queue's
//! [`CompletionEvents`](crate::verbs::CompletionEvents) (no lookup: the
//! queue's context points at it): that wakes the connection's driver,
//! which re-arms the queue and takes the completions. The reader runs on the connections'
//! own runtime because a wake-up from another thread costs: read by the
//! device's watcher thread, event-driven 32 B calls took 1.7× as long in
//! the Soft-RoCE guest (`docs/benchmarks.md`). The reader stops when the
//! last connection holding a [`ChannelLease`] on it lets go.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rpc_core::transport::TransportError;
use tokio::io::unix::AsyncFd;
use tokio::runtime::{Handle, Id};
use tokio::sync::oneshot;

use crate::registry::{self, Target};
use crate::verbs::{CmId, CompletionChannel, DeviceId};

/// Keeps the reader of a channel running; the connection's completion
/// queue reports to [`channel`](Self::channel).
pub(crate) struct ChannelLease {
    reader: u64,
    channel: CompletionChannel,
}

impl ChannelLease {
    /// The channel to make the connection's completion queue on.
    pub(crate) fn channel(&self) -> &CompletionChannel {
        &self.channel
    }
}

/// A running reader: its device and runtime, how many leases hold it, its
/// channel, and its stop signal (it stops when this is dropped).
struct Reader {
    device: DeviceId,
    runtime: Id,
    id: u64,
    leases: usize,
    channel: CompletionChannel,
    _stop: oneshot::Sender<()>,
}

static READERS: Mutex<Vec<Reader>> = Mutex::new(Vec::new());
static NEXT_READER: AtomicU64 = AtomicU64::new(0);

fn readers() -> std::sync::MutexGuard<'static, Vec<Reader>> {
    READERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The completion channel of `id`'s device and the current runtime, and a
/// lease on its reader (started if none runs). Fails outside a tokio
/// runtime.
pub(crate) fn lease(id: &CmId) -> Result<ChannelLease, TransportError> {
    let context = "set up the device's completion channel";
    let verbs_error =
        |e: crate::verbs::Error| TransportError::io(context, std::io::Error::other(e));
    let device = id.device_id().map_err(verbs_error)?;
    let runtime = Handle::try_current()
        .map_err(|e| TransportError::io(context, std::io::Error::other(e)))?
        .id();
    let mut readers = readers();
    if let Some(r) = readers
        .iter_mut()
        .find(|r| r.device == device && r.runtime == runtime)
    {
        r.leases += 1;
        return Ok(ChannelLease {
            reader: r.id,
            channel: r.channel.clone(),
        });
    }
    let channel = CompletionChannel::new(id).map_err(verbs_error)?;
    // SAFETY: `ChannelFd` holds a clone of the channel, which keeps it and
    // its descriptor open: the descriptor it returns is always the same and
    // stays open until the AsyncFd (which owns it) drops.
    let fd = unsafe { AsyncFd::register(ChannelFd(channel.clone())) }
        .map_err(|e| TransportError::io(context, e.into_parts().1))?;
    let (stop, stopped) = oneshot::channel();
    let reader = NEXT_READER.fetch_add(1, Ordering::Relaxed);
    // It cannot leave the registry (below) before it is in: we hold the lock.
    tokio::spawn(read(fd, device, reader, stopped));
    readers.push(Reader {
        device,
        runtime,
        id: reader,
        leases: 1,
        channel: channel.clone(),
        _stop: stop,
    });
    Ok(ChannelLease { reader, channel })
}

impl Drop for ChannelLease {
    fn drop(&mut self) {
        let mut readers = readers();
        if let Some(i) = readers.iter().position(|r| r.id == self.reader) {
            readers[i].leases -= 1;
            if readers[i].leases == 0 {
                // Dropping its stop signal ends the reader.
                readers.swap_remove(i);
            }
        }
    }
}

/// The channel, registered with tokio.
struct ChannelFd(CompletionChannel);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.fd()
    }
}

/// The reader: takes the channel's events until stopped (or reading fails:
/// then it leaves the registry, so that the next connection starts a new
/// one, and the device's connections are failed, as nothing would wake
/// them).
async fn read(
    fd: AsyncFd<ChannelFd>,
    device: DeviceId,
    reader: u64,
    mut stop: oneshot::Receiver<()>,
) {
    let failed = 'reading: loop {
        tokio::select! {
            ready = fd.readable() => {
                match ready {
                    Ok(mut guard) => guard.clear_ready(),
                    Err(e) => break 'reading format!("waiting for completion events: {e}"),
                }
                loop {
                    // Each event wakes its queue's driver (`DriverWake`).
                    match fd.get_ref().0.try_take_event() {
                        Ok(true) => {}
                        Ok(false) => break,
                        Err(e) => break 'reading format!("reading completion events: {e}"),
                    }
                }
            }
            _ = &mut stop => return,
        }
    };
    readers().retain(|r| r.id != reader);
    give_up(device, &failed);
}

fn give_up(device: DeviceId, what: &str) {
    let failed = registry::fail_on_device(device, Target::Device, what);
    tracing::warn!("{what}: failed {failed} connection(s)");
}
