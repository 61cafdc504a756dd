//! What wakes a connection's driver task.

use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;

/// Wakes a connection's driver: a flag, and the driver's waker while it
/// waits. As `tokio::sync::Notify::notify_one` with its one waiter (a
/// wake-up that comes while the driver works is kept for its next wait),
/// without a list of waiters that the driver joins and leaves at every
/// wait.
#[derive(Default)]
pub(super) struct DriverWake {
    pending: AtomicBool,
    waker: AtomicWaker,
}

impl DriverWake {
    /// Wakes the driver, or has its next wait end at once.
    pub(super) fn notify(&self) {
        self.pending.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Ready once [`notify`](Self::notify) was called since this last
    /// returned ready; the driver's waker stays until
    /// [`stop_waiting`](Self::stop_waiting).
    pub(super) fn poll_notified(&self, cx: &Context<'_>) -> Poll<()> {
        if self.pending.swap(false, Ordering::Acquire) {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        // A notification between the look above and the registration
        // found no waker to wake: it is seen here.
        if self.pending.swap(false, Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// The driver works: notifications until its next wait only set the
    /// flag.
    pub(super) fn stop_waiting(&self) {
        drop(self.waker.take());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    use super::*;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_notification_wakes_a_waiting_driver_once_and_is_kept_for_a_working_one() {
        let wake = DriverWake::default();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&count));
        let cx = Context::from_waker(&waker);
        let woken = || count.0.load(Ordering::SeqCst);

        // Waiting: a notification wakes it, and the wait ends.
        assert!(wake.poll_notified(&cx).is_pending());
        wake.notify();
        wake.notify();
        assert_eq!(woken(), 1, "woken once for two notifications");
        assert!(wake.poll_notified(&cx).is_ready());
        assert!(wake.poll_notified(&cx).is_pending());

        // Working (stopped waiting): nothing is woken, and the next wait
        // ends at once.
        wake.stop_waiting();
        wake.notify();
        assert_eq!(woken(), 1);
        assert!(wake.poll_notified(&cx).is_ready());
        assert!(wake.poll_notified(&cx).is_pending());
    }
}
