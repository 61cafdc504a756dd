//! [`DeadlineTimer`]: one timer for the deadlines of a connection's calls.
//!
//! A call waiting for its single response is ended at its deadline by its
//! connection's reader task, which holds one timer set no later than the
//! earliest deadline of the calls open. A call that ends leaves the timer
//! where it is: when it fires and finds nothing due, it moves on to the
//! earliest deadline still open. With every call on a channel given the
//! same timeout, each new deadline is later than the one the timer is
//! set to, so a call pays a comparison where a timer of its own cost an
//! insertion into and a removal from tokio's wheel and a poll of it
//! (~800 instructions a call, callgrind).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::runtime::Handle;
use tokio::time::{Instant, Sleep};

/// A connection's timer for its calls' deadlines: set, while armed, no
/// later than the earliest deadline of the calls open (see the module docs).
#[derive(Default)]
pub(super) struct DeadlineTimer {
    /// Made when first armed: a channel whose calls have no deadline has none.
    sleep: Option<Pin<Box<Sleep>>>,
    /// When `sleep` fires. `None`: disarmed, no open call has a deadline.
    armed: Option<Instant>,
    /// The reader task's waker, from its latest poll: the one the timer wakes.
    reader: Option<Waker>,
}

impl DeadlineTimer {
    /// Makes the timer fire no later than `deadline`. A timer is made on
    /// `runtime`, the reader task's: the caller's may end before it.
    pub(super) fn arm(&mut self, deadline: Instant, runtime: &Handle) {
        if self.armed.is_some_and(|armed| armed <= deadline) {
            return;
        }
        self.armed = Some(deadline);
        let sleep = match &mut self.sleep {
            Some(sleep) => {
                sleep.as_mut().reset(deadline);
                sleep
            }
            None => {
                let _in_runtime = runtime.enter();
                self.sleep
                    .insert(Box::pin(tokio::time::sleep_until(deadline)))
            }
        };
        // A timer's waker is the last one it was polled with: polled here
        // with the reader task's, it wakes the reader task, not this caller
        // (outside this caller's budget, which is not the reader's).
        // Before the reader task's first poll there is none: that poll
        // polls the timer.
        if let Some(reader) = &self.reader {
            let mut cx = Context::from_waker(reader);
            if poll_unconstrained(sleep.as_mut(), &mut cx).is_ready() {
                reader.wake_by_ref();
            }
        }
    }

    /// The reader task's poll: `Ready` once the armed timer fired; it is
    /// then disarmed, for the reader task to end the calls due and arm it
    /// for the next deadline.
    pub(super) fn poll_fired(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self
            .reader
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            self.reader = Some(cx.waker().clone());
        }
        let (Some(_), Some(sleep)) = (self.armed, &mut self.sleep) else {
            return Poll::Pending;
        };
        // Unconstrained: the reader task's budget may be spent on frames,
        // and a timer polled past it reports `Pending` whatever the time.
        std::task::ready!(poll_unconstrained(sleep.as_mut(), cx));
        self.armed = None;
        Poll::Ready(())
    }
}

/// Polls `sleep` outside the task's tokio budget.
fn poll_unconstrained(sleep: Pin<&mut Sleep>, cx: &mut Context<'_>) -> Poll<()> {
    Pin::new(&mut tokio::task::coop::unconstrained(sleep)).poll(cx)
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;

    /// A reader task: polls the timer until it fires; returns when it did.
    fn reader(timer: &Arc<Mutex<DeadlineTimer>>) -> tokio::task::JoinHandle<Instant> {
        let timer = Arc::clone(timer);
        tokio::spawn(async move {
            poll_fn(|cx| timer.lock().unwrap().poll_fired(cx)).await;
            Instant::now()
        })
    }

    #[tokio::test(start_paused = true)]
    async fn callers_bring_the_timer_forward_and_later_deadlines_leave_it() {
        let timer = Arc::new(Mutex::new(DeadlineTimer::default()));
        let reader = reader(&timer);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!reader.is_finished(), "a disarmed timer fired");
        // Armed by callers while the reader task waits on the timer.
        let armed_at = Instant::now();
        for after in [10, 3, 5] {
            timer
                .lock()
                .unwrap()
                .arm(armed_at + Duration::from_secs(after), &Handle::current());
        }
        let fired = reader.await.unwrap();
        assert_eq!(fired - armed_at, Duration::from_secs(3));
        assert!(
            timer.lock().unwrap().armed.is_none(),
            "fired, and still armed"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_timer_armed_before_the_readers_first_poll_or_once_due_still_wakes_it() {
        let timer = Arc::new(Mutex::new(DeadlineTimer::default()));
        let armed_at = Instant::now();
        timer
            .lock()
            .unwrap()
            .arm(armed_at + Duration::from_secs(2), &Handle::current());
        assert_eq!(
            reader(&timer).await.unwrap() - armed_at,
            Duration::from_secs(2)
        );

        // Fired, then armed again for a deadline already past.
        let reader = reader(&timer);
        tokio::task::yield_now().await; // the reader task polls and waits
        timer.lock().unwrap().arm(armed_at, &Handle::current());
        let woken = tokio::time::timeout(Duration::from_secs(1), reader).await;
        assert!(
            woken.is_ok(),
            "a deadline already past did not wake the reader task"
        );
    }
}
