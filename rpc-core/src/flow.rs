//! Per-stream flow control: bytes the peer has granted this side
//! ([`SendWindow`]), and bytes this side has granted the peer, which the
//! connection reader holds the peer's sends to.
//!
//! The receiver starts each stream with a window of `stream_window` bytes and
//! grants more as its application consumes messages (see `RecvWindow`). A
//! sender may start a message whenever the window is positive, so a message
//! larger than the whole window still goes through, alone; what a receiver
//! buffers per stream is thus bounded by window + one maximum message.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use tokio::sync::Notify;

/// Window every stream starts with, before the receiver grants its configured window.
pub(crate) const INITIAL_STREAM_WINDOW: u32 = 64 * 1024;

/// Default per-stream receive window.
pub const DEFAULT_STREAM_WINDOW: u32 = 8 * 1024 * 1024;

/// Bytes a stream's sender may still send. One sender, many granters.
///
/// It also records what this side granted the peer on the call's other
/// stream (`granted_to_peer`), so that the reader, which sees the peer's
/// messages, can check them against it without a second allocation per call.
#[derive(Debug)]
pub(crate) struct SendWindow {
    available: AtomicI64,
    closed: AtomicBool,
    changed: Notify,
    granted_to_peer: AtomicU64,
}

/// The call ended while a sender waited for window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowClosed;

impl SendWindow {
    pub(crate) fn new(initial: u32) -> SendWindow {
        SendWindow {
            available: AtomicI64::new(initial.into()),
            closed: AtomicBool::new(false),
            changed: Notify::new(),
            // Both directions of a stream start at the same initial window.
            granted_to_peer: AtomicU64::new(initial.into()),
        }
    }

    /// A window of `initial` bytes plus `granted` the peer granted already.
    pub(crate) fn with_grants(initial: u32, granted: u64) -> SendWindow {
        let window = SendWindow::new(initial);
        let granted = i64::try_from(granted).unwrap_or(i64::MAX);
        window.available.fetch_add(granted, Ordering::AcqRel);
        window
    }

    /// This side decided to grant the peer `bytes` more (recorded before the
    /// grant is sent, so a peer using it at once is never judged over).
    pub(crate) fn record_grant_to_peer(&self, bytes: u32) {
        self.granted_to_peer
            .fetch_add(bytes.into(), Ordering::AcqRel);
    }

    /// Bytes granted to the peer so far, the protocol's initial window included.
    pub(crate) fn granted_to_peer(&self) -> u64 {
        self.granted_to_peer.load(Ordering::Acquire)
    }

    /// Waits until the window is positive, then takes `len` bytes of it.
    pub(crate) async fn reserve(&self, len: usize) -> Result<(), WindowClosed> {
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(WindowClosed);
            }
            if self.available.load(Ordering::Acquire) > 0 {
                self.available
                    .fetch_sub(len.min(i64::MAX as usize) as i64, Ordering::AcqRel);
                return Ok(());
            }
            // `notify_one` stores a permit, so a grant between the check and here is not lost.
            self.changed.notified().await;
        }
    }

    /// The peer granted `bytes` more.
    pub(crate) fn grant(&self, bytes: u32) {
        self.available.fetch_add(bytes.into(), Ordering::AcqRel);
        self.changed.notify_one();
    }

    /// Wakes a waiting sender for good: the call is over.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.changed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn a_sender_waits_for_a_grant_and_may_overshoot_once() {
        let window = Arc::new(SendWindow::new(10));
        window.reserve(25).await.unwrap(); // larger than the window: goes, alone
        let waiter = tokio::spawn({
            let window = Arc::clone(&window);
            async move { window.reserve(1).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "sent with a window of -15");
        window.grant(15); // back to 0: still not positive
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "sent with a window of 0");
        window.grant(1);
        assert_eq!(waiter.await.unwrap(), Ok(()));
    }

    #[tokio::test]
    async fn closing_wakes_a_waiting_sender_with_an_error() {
        let window = Arc::new(SendWindow::new(0));
        let waiter = tokio::spawn({
            let window = Arc::clone(&window);
            async move { window.reserve(1).await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        window.close();
        assert_eq!(waiter.await.unwrap(), Err(WindowClosed));
    }
}
