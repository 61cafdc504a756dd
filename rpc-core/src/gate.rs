//! Polling a rarely ready future only when it was woken.
//!
//! A connection reader's `select!` polls every branch each time its task
//! wakes, though nearly every wake-up comes from the socket: the keepalive
//! sleep and the shutdown watch would be polled for nothing, twice a call
//! (~150 and ~200 instructions a poll). A [`WakeGate`] hands its future a
//! waker of its own, which notes that the future was woken before waking the
//! task; the future is polled only after such a wake-up, or when forced: a
//! new or reset future must be polled once to register its waker.
//!
//! No wake-up is lost: the future always holds the gate's waker (the latest
//! one it was polled with), and the gate registers the task's waker before
//! it checks whether the future was woken.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures::task::AtomicWaker;

/// Polls one future (at a time) only when it was woken; see the module docs.
pub(crate) struct WakeGate {
    shared: Arc<GateShared>,
    /// The waker the gated future is polled with: wakes `shared`.
    waker: Waker,
}

struct GateShared {
    /// The gated future was woken (or must be polled anyway) since its last poll.
    woken: AtomicBool,
    /// The task polling the gate.
    task: AtomicWaker,
}

impl Wake for GateShared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl WakeGate {
    /// A gate whose first poll polls the future.
    pub(crate) fn new() -> WakeGate {
        let shared = Arc::new(GateShared {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        WakeGate {
            waker: Waker::from(Arc::clone(&shared)),
            shared,
        }
    }

    /// The next poll polls the future: it is new, or was reset (a reset
    /// `Sleep` must be polled to register its waker again).
    pub(crate) fn force(&self) {
        self.shared.woken.store(true, Ordering::Release);
    }

    /// Polls `future` if it was woken (or forced) since its last poll;
    /// `Pending` otherwise, with the task woken when the future is.
    pub(crate) fn poll<F: Future + ?Sized>(
        &self,
        cx: &mut Context<'_>,
        future: Pin<&mut F>,
    ) -> Poll<F::Output> {
        // Registered before the check: a wake-up in between wakes this task.
        self.shared.task.register(cx.waker());
        if !self.shared.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        future.poll(&mut Context::from_waker(&self.waker))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_gated_sleep_wakes_its_task_and_a_reset_one_too() {
        let gate = WakeGate::new();
        let mut sleep = Box::pin(tokio::time::sleep(Duration::from_secs(5)));
        let start = tokio::time::Instant::now();
        std::future::poll_fn(|cx| gate.poll(cx, sleep.as_mut())).await;
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        // A fired sleep, reset, holds no waker until polled again: forced.
        sleep.as_mut().reset(start + Duration::from_secs(8));
        gate.force();
        std::future::poll_fn(|cx| gate.poll(cx, sleep.as_mut())).await;
        assert_eq!(start.elapsed(), Duration::from_secs(8));
    }

    #[tokio::test]
    async fn an_unwoken_future_is_not_polled() {
        let gate = WakeGate::new();
        let polls = std::sync::atomic::AtomicUsize::new(0);
        let mut counted = Box::pin(std::future::poll_fn(|_| {
            polls.fetch_add(1, Ordering::SeqCst);
            Poll::<()>::Pending
        }));
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..3 {
            assert!(gate.poll(&mut cx, counted.as_mut()).is_pending());
        }
        assert_eq!(polls.load(Ordering::SeqCst), 1, "polled without a wake-up");
        gate.waker.wake_by_ref();
        assert!(gate.poll(&mut cx, counted.as_mut()).is_pending());
        assert_eq!(
            polls.load(Ordering::SeqCst),
            2,
            "not polled after its wake-up"
        );
    }
}
