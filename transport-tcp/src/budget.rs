//! The process's budget for large frames being received.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

/// Bytes that large frames still arriving may claim, shared by every
/// connection of a [`TcpTransport`](crate::TcpTransport).
///
/// A connection claims a frame's whole announced length before it reads
/// more of that frame than [`READ_CHUNK`](crate::reader::READ_CHUNK), and
/// gives it back when the frame is handed up (or the connection ends).
/// Claiming whole frames rather than each read means a frame that has its
/// claim always completes as its bytes arrive: connections never wait on
/// each other's half-received frames. A frame larger than the whole budget
/// still goes when nothing else holds a claim.
#[derive(Debug)]
pub(crate) struct ReadBudget {
    limit: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    claimed: usize,
    waiting: Vec<Waker>,
}

impl ReadBudget {
    pub(crate) fn new(limit: usize) -> Arc<ReadBudget> {
        Arc::new(ReadBudget {
            limit,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Claims `bytes`, or registers `cx` to be woken when claims are given back.
    pub(crate) fn poll_claim(&self, cx: &Context<'_>, bytes: usize) -> Poll<()> {
        let mut state = self.lock();
        if state.claimed == 0 || state.claimed.saturating_add(bytes) <= self.limit {
            state.claimed += bytes;
            return Poll::Ready(());
        }
        if !state.waiting.iter().any(|w| w.will_wake(cx.waker())) {
            state.waiting.push(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Gives back a claim of `bytes`, waking the connections waiting for one.
    pub(crate) fn release(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let waiting = {
            let mut state = self.lock();
            state.claimed -= bytes;
            std::mem::take(&mut state.waiting)
        };
        for waker in waiting {
            waker.wake();
        }
    }

    #[cfg(test)]
    pub(crate) fn claimed(&self) -> usize {
        self.lock().claimed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct CountWakes(AtomicUsize);

    impl Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn claims_wait_for_room_and_are_woken_when_it_is_given_back() {
        let budget = ReadBudget::new(100);
        let wakes = Arc::new(CountWakes(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&wakes));
        let cx = Context::from_waker(&waker);
        assert!(budget.poll_claim(&cx, 60).is_ready());
        assert!(budget.poll_claim(&cx, 40).is_ready());
        assert!(budget.poll_claim(&cx, 1).is_pending());
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
        budget.release(40);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        assert!(budget.poll_claim(&cx, 30).is_ready());
        assert_eq!(budget.claimed(), 90);
    }

    #[test]
    fn a_frame_larger_than_the_budget_goes_alone() {
        let budget = ReadBudget::new(100);
        let cx = Context::from_waker(Waker::noop());
        assert!(budget.poll_claim(&cx, 500).is_ready());
        assert!(budget.poll_claim(&cx, 1).is_pending());
        budget.release(500);
        assert_eq!(budget.claimed(), 0);
    }
}
