//! Handler tasks kept from call to call on a connection.
//!
//! A task spawned per call costs ~1,900 instructions of a unary call: tokio
//! allocates each task aligned to 128 bytes (a slow path of glibc's
//! allocator), registers, schedules, retires and frees it. A connection
//! keeps its handler tasks once their call ended, up to [`MAX_IDLE`], each
//! waiting for another call: handing one a call is a lock and a wake-up.
//! Every call still runs in a task of its own, polled by the
//! runtime on any worker, as with a fresh task. An aborted call (cancelled,
//! over a size limit, its connection gone) has its future dropped on its
//! task, as [`AbortHandle::abort`] did, and the task waits for the next call.

use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::transport::BoxFuture;

use super::connection::{run_call, ServerConn};

/// Idle handler tasks a connection keeps; more end with their call. As
/// many as calls commonly in flight on a busy connection: with 4 kept, 64
/// calls in flight spawned a task for nearly every call, and 64 made such
/// a call −2,000 instructions (11,353 → 9,331, `call-instructions rpc-64`).
/// An idle task is its 288-byte future in a task cell, ~0.5 KiB: ≤ 32 KiB
/// on a connection that once had 64 calls at once, until it closes.
const MAX_IDLE: usize = 64;

/// What runs a call's handler: a task of its own, or a kept one.
pub(super) enum CallTask {
    /// A task spawned for this call (one with tracing, or a handler that
    /// started on the reader).
    Spawned(AbortHandle),
    /// A kept task, running call `generation` of its own count.
    Kept(Arc<Runner>, u64),
}

impl CallTask {
    /// Stops the call's handler: its future is dropped on its task.
    pub(super) fn abort(&self) {
        match self {
            CallTask::Spawned(task) => task.abort(),
            CallTask::Kept(runner, generation) => runner.abort(*generation),
        }
    }
}

/// A call for a handler task: what `run_call` takes.
pub(super) struct Job {
    pub(super) conn: Arc<ServerConn>,
    pub(super) id: u64,
    pub(super) handler: BoxFuture<'static, ()>,
    pub(super) deadline: Option<Instant>,
}

/// A connection's idle handler tasks.
#[derive(Default)]
pub(super) struct Runners {
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    runners: Vec<Arc<Runner>>,
    /// The connection is gone: tasks end with their call.
    closed: bool,
}

impl Runners {
    fn idle(&self) -> MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `job` on an idle task, or on a new one.
    pub(super) fn start(self: &Arc<Self>, job: Job) -> CallTask {
        let idle = self.idle().runners.pop();
        let runner = match idle {
            Some(runner) => runner,
            None => {
                let runner = Arc::new(Runner::default());
                tokio::spawn(run(Arc::clone(&runner), Arc::clone(self)));
                runner
            }
        };
        let generation = runner.give(job);
        CallTask::Kept(runner, generation)
    }

    /// The connection is gone: idle tasks end now, busy ones after their call.
    pub(super) fn close(&self) {
        let idle = {
            let mut idle = self.idle();
            idle.closed = true;
            std::mem::take(&mut idle.runners)
        };
        for runner in idle {
            runner.close();
        }
    }

    /// Keeps `runner` for another call; `false` when it is to end.
    fn keep(&self, runner: &Arc<Runner>) -> bool {
        let mut idle = self.idle();
        if idle.closed || idle.runners.len() >= MAX_IDLE {
            return false;
        }
        idle.runners.push(Arc::clone(runner));
        true
    }
}

/// One kept handler task's mailbox.
#[derive(Default)]
pub(super) struct Runner {
    state: Mutex<RunnerState>,
}

#[derive(Default)]
struct RunnerState {
    /// The call given, until the task takes it.
    job: Option<Job>,
    /// Calls given so far: the latest one's number.
    generation: u64,
    /// The latest call was aborted.
    aborted: bool,
    /// The task ends (its connection is gone).
    closed: bool,
    /// The task, from its latest poll.
    waker: Option<Waker>,
}

impl Runner {
    fn state(&self) -> MutexGuard<'_, RunnerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives the task a call; returns the call's number.
    fn give(&self, job: Job) -> u64 {
        let mut state = self.state();
        state.generation += 1;
        state.job = Some(job);
        state.aborted = false;
        if let Some(waker) = &state.waker {
            waker.wake_by_ref();
        }
        state.generation
    }

    fn abort(&self, generation: u64) {
        let mut state = self.state();
        if state.generation == generation {
            state.aborted = true;
            if let Some(waker) = &state.waker {
                waker.wake_by_ref();
            }
        }
    }

    fn close(&self) {
        let mut state = self.state();
        state.closed = true;
        if let Some(waker) = &state.waker {
            waker.wake_by_ref();
        }
    }

    /// Notes the task's waker, for `give`, `abort` and `close`.
    fn register(state: &mut RunnerState, cx: &Context<'_>) {
        if !state
            .waker
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            state.waker = Some(cx.waker().clone());
        }
    }

    /// The next call, with its number; `None` when the task is to end.
    fn poll_job(&self, cx: &Context<'_>) -> Poll<Option<(Job, u64)>> {
        let mut state = self.state();
        if let Some(job) = state.job.take() {
            return Poll::Ready(Some((job, state.generation)));
        }
        if state.closed {
            return Poll::Ready(None);
        }
        Runner::register(&mut state, cx);
        Poll::Pending
    }

    /// Whether call `generation` was aborted.
    fn poll_aborted(&self, generation: u64, cx: &Context<'_>) -> bool {
        let mut state = self.state();
        Runner::register(&mut state, cx);
        state.generation == generation && state.aborted
    }
}

/// A kept handler task: runs the calls it is given until its connection is
/// gone or enough others wait.
async fn run(runner: Arc<Runner>, runners: Arc<Runners>) {
    loop {
        let Some((job, generation)) = std::future::poll_fn(|cx| runner.poll_job(cx)).await else {
            return;
        };
        {
            let mut call = pin!(run_call(job.conn, job.id, job.handler, job.deadline));
            std::future::poll_fn(|cx| {
                if runner.poll_aborted(generation, cx) {
                    return Poll::Ready(()); // the call's future is dropped here
                }
                call.as_mut().poll(cx)
            })
            .await;
        }
        if !runners.keep(&runner) {
            return;
        }
        // Calls handed over back to back still let the worker's other tasks
        // run in between, as tasks of their own would.
        tokio::task::coop::consume_budget().await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use bytes::Bytes;

    use crate::codegen::{self, BoxFuture, ServerCall, Service};
    use crate::{BytesCodec, Client, Code, Endpoint, Request, Response, Server};

    /// `Hold` waits until dropped (counted), `Echo` answers at once.
    struct Test(Arc<AtomicUsize>);

    /// Counts a handler's future dropped before it finished.
    struct CountDrop(Arc<AtomicUsize>);

    impl Drop for CountDrop {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl Service for Test {
        fn name(&self) -> &'static str {
            "test.Runner"
        }

        fn call(&self, method: &str, call: ServerCall) -> BoxFuture<'static, ()> {
            let dropped = Arc::clone(&self.0);
            match method {
                "Hold" => {
                    codegen::unary::<BytesCodec, _, _>(call, |_: Request<Bytes>| async move {
                        let _guard = CountDrop(dropped);
                        std::future::pending::<Result<Response<Bytes>, crate::Status>>().await
                    })
                }
                "Echo" => {
                    codegen::unary::<BytesCodec, _, _>(call, |r: Request<Bytes>| async move {
                        Ok(Response::new(r.into_inner()))
                    })
                }
                _ => codegen::unimplemented(call),
            }
        }
    }

    /// Cancelled and timed-out calls drop their handler on its kept task,
    /// which then runs the next calls; many at once each get a task.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kept_tasks_drop_aborted_calls_and_run_the_next_ones() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let server = Server::builder()
            .add_service(Test(Arc::clone(&dropped)))
            .bind("mem://runner-kept-tasks")
            .await
            .unwrap();
        tokio::spawn(server.serve());
        let client = Client::new(
            Endpoint::new("mem://runner-kept-tasks")
                .unwrap()
                .connect()
                .await
                .unwrap(),
        );
        let echo = |n: u8| {
            let client = client.clone();
            async move {
                let reply = client
                    .unary::<BytesCodec>("/test.Runner/Echo", Request::new(Bytes::from(vec![n])))
                    .await
                    .unwrap();
                assert_eq!(reply.into_inner(), Bytes::from(vec![n]));
            }
        };
        for round in 1..=3 {
            // Cancelled by its caller going away.
            let hold = client.unary::<BytesCodec>("/test.Runner/Hold", Request::new(Bytes::new()));
            assert!(tokio::time::timeout(Duration::from_millis(50), hold)
                .await
                .is_err());
            // Ended by its deadline.
            let mut request = Request::new(Bytes::new());
            request.set_timeout(Duration::from_millis(20));
            let status = client
                .unary::<BytesCodec>("/test.Runner/Hold", request)
                .await
                .unwrap_err();
            assert_eq!(status.code(), Code::DeadlineExceeded);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while dropped.load(Ordering::SeqCst) < 2 * round {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "a held handler was not dropped"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            echo(round as u8).await;
        }
        // More calls at once than tasks are kept.
        let calls: Vec<_> = (0..2 * super::MAX_IDLE as u8)
            .map(|n| tokio::spawn(echo(n)))
            .collect();
        for call in calls {
            call.await.unwrap();
        }
    }
}
