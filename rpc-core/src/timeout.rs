//! [`LazyTimeout`]: a future under a deadline, with a timer only if it waits.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep};

/// `future`, unless `deadline` passes first (then `Err(DeadlinePassed)`).
///
/// Unlike `tokio::time::timeout_at`, the timer is made (boxed: a future
/// holding one inline is larger wherever it is moved) only once `future`
/// has to wait: a handler that answers at its first poll costs no timer,
/// and while `covered` is set someone else ends `future` at the deadline,
/// so it waits with no timer of its own. A timer made stays until the end.
pub(crate) struct LazyTimeout<'a, F> {
    future: F,
    deadline: Instant,
    covered: Option<&'a AtomicBool>,
    timer: Option<Pin<Box<Sleep>>>,
}

/// The deadline passed before the future was done.
#[derive(Debug)]
pub(crate) struct DeadlinePassed;

impl<'a, F: Future + Unpin> LazyTimeout<'a, F> {
    pub(crate) fn new(future: F, deadline: Instant) -> Self {
        LazyTimeout {
            future,
            deadline,
            covered: None,
            timer: None,
        }
    }

    /// While `covered` is set, `future` is ended at the deadline by someone
    /// else: it needs no timer of its own.
    pub(crate) fn covered_by(mut self, covered: &'a AtomicBool) -> Self {
        self.covered = Some(covered);
        self
    }
}

impl<F: Future + Unpin> Future for LazyTimeout<'_, F> {
    type Output = Result<F::Output, DeadlinePassed>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Poll::Ready(output) = Pin::new(&mut this.future).poll(cx) {
            return Poll::Ready(Ok(output));
        }
        if this.timer.is_none() && this.covered.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Poll::Pending;
        }
        let deadline = this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        timer.as_mut().poll(cx).map(|()| Err(DeadlinePassed))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_future_is_cut_at_its_deadline_unless_covered_and_a_ready_one_makes_no_timer() {
        let start = Instant::now();
        let deadline = start + Duration::from_secs(2);
        let mut ready = LazyTimeout::new(std::future::ready(7), deadline);
        assert_eq!((&mut ready).await.unwrap(), 7);
        assert!(ready.timer.is_none(), "a future done at once made a timer");

        let never = LazyTimeout::new(std::future::pending::<()>(), deadline);
        assert!(never.await.is_err());
        assert_eq!(Instant::now() - start, Duration::from_secs(2));

        // Covered: no timer of its own, so it outlives the deadline (here
        // nothing else ends it, and a test's timeout does).
        let covered = AtomicBool::new(true);
        let mut waits =
            LazyTimeout::new(std::future::pending::<()>(), deadline).covered_by(&covered);
        let outlived = tokio::time::timeout(Duration::from_secs(5), &mut waits).await;
        assert!(outlived.is_err() && waits.timer.is_none());
        // Uncovered while it waits: a timer of its own, already past.
        covered.store(false, Ordering::Relaxed);
        assert!(waits.await.is_err());
    }
}
