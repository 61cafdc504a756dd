//! Waiting for a connection set-up's connection-manager events on the
//! tokio runtime: the event channel's descriptor registered with tokio
//! (`AsyncFd`), every wait bounded by the set-up's time limit. No thread
//! is held while the peer (or the fabric) takes its time.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;

use crate::verbs::{Error, EventChannel, Result};

pub(super) use crate::verbs::ffi::rdma_cm_event_type as event;
pub(super) use crate::verbs::CmEventRecord as Event;

/// The events of one set-up's channel, as they arrive. Registered while
/// the set-up waits on it; the established connection's id then moves to
/// its device watcher's channel ([`crate::device_events`]).
pub(super) struct CmEvents {
    fd: AsyncFd<Arc<EventChannel>>,
    timeout: Duration,
}

impl CmEvents {
    /// Registers `channel` with the runtime; each wait gives up after
    /// `timeout`.
    pub(super) fn new(channel: &Arc<EventChannel>, timeout: Duration) -> Result<Self> {
        // SAFETY: the `Arc` keeps the channel, so the descriptor it returns
        // is always the same and stays open until the AsyncFd (which owns
        // the `Arc`, and deregisters before dropping it) is dropped.
        let fd = unsafe { AsyncFd::register(Arc::clone(channel)) }
            .map_err(|e| Error::GetCmEvent(e.into_parts().1))?;
        Ok(Self { fd, timeout })
    }

    /// The channel's next event (acknowledged already), or
    /// [`Error::Timeout`] when none came in time.
    pub(super) async fn next(&self) -> Result<Event> {
        let wait = async {
            loop {
                let mut guard = self.fd.readable().await.map_err(Error::GetCmEvent)?;
                match guard.get_inner().try_next()? {
                    Some(event) => return Ok(event),
                    // Drained: wait for the descriptor's next edge.
                    None => guard.clear_ready(),
                }
            }
        };
        tokio::time::timeout(self.timeout, wait)
            .await
            .unwrap_or(Err(Error::Timeout {
                what: "a connection manager event",
                timeout: self.timeout,
            }))
    }

    /// The next event, which must be `expected`.
    pub(super) async fn expect(&self, expected: event::Type) -> Result<Event> {
        self.next().await?.expect(expected)
    }
}
