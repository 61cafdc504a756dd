//! [`FanOut`]: one request to N shards at once, under one deadline, with
//! partial results.
//!
//! ```
//! use std::time::Duration;
//! use rpc_core::fanout::{FanOut, ShardResult};
//! use rpc_core::{Request, Status};
//!
//! # async fn ask(shard: usize, request: Request<u32>) -> Result<u32, Status> {
//! #     Ok(*request.get_ref() + shard as u32)
//! # }
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // Answer with what 3 of 4 shards said within 50 ms; the rest are cancelled.
//! let fan = FanOut::within(Duration::from_millis(50)).quorum(3);
//! let results = fan
//!     .run((0..4).map(|shard| ask(shard, fan.request(7))))
//!     .await;
//! assert!(results.answered() >= 3);
//! for (shard, result) in results.shards.iter().enumerate() {
//!     if let ShardResult::Ok(answer) = result {
//!         assert_eq!(*answer, 7 + shard as u32); // in shard order
//!     }
//! }
//! # }
//! ```
//!
//! The calls are any futures, so any generated client's methods (and any
//! mix of them) fan out: `fan.run(shards.iter().map(|s| s.infer(fan.request(query.clone()))))`.
//! [`FanOut::request`] gives each request the fan-out's deadline, so each
//! shard's server sees the time left; when the fan-out finishes early (all
//! answered, quorum, fail limit, deadline) the calls still running are
//! dropped, which cancels them on their servers.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;

use crate::message::Request;
use crate::status::{Code, Status};

/// How a fan-out ends: when all shards answered, or earlier.
#[derive(Debug, Clone, Default)]
pub struct FanOut {
    deadline: Option<Instant>,
    quorum: Option<usize>,
    fail_limit: Option<usize>,
}

/// One shard's outcome.
#[derive(Debug)]
pub enum ShardResult<T> {
    /// It answered.
    Ok(T),
    /// It failed, with its status (the server's, or the transport's).
    Failed(Status),
    /// It had not answered when the fan-out finished (its call was cancelled).
    NotAnswered,
}

impl<T> ShardResult<T> {
    /// The answer, if there is one.
    pub fn ok(self) -> Option<T> {
        match self {
            ShardResult::Ok(value) => Some(value),
            _ => None,
        }
    }

    /// Whether the shard answered.
    pub fn is_ok(&self) -> bool {
        matches!(self, ShardResult::Ok(_))
    }
}

/// Why a fan-out finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// Every shard answered or failed.
    AllDone,
    /// The quorum of answers arrived.
    Quorum,
    /// More shards failed than the fail limit allows, or so many failed that
    /// the quorum can no longer be reached.
    TooManyFailed,
    /// The deadline passed.
    Deadline,
}

/// Every shard's outcome, in shard order, and why the fan-out finished.
pub struct FanOutResults<T> {
    /// One entry per call given to [`FanOut::run`], in the same order.
    pub shards: Vec<ShardResult<T>>,
    /// Why it finished.
    pub finished: Finished,
    /// How long it took.
    pub elapsed: Duration,
}

impl<T> FanOutResults<T> {
    /// Shards that answered.
    pub fn answered(&self) -> usize {
        self.shards.iter().filter(|s| s.is_ok()).count()
    }

    /// Shards that failed.
    pub fn failed(&self) -> usize {
        self.count(|s| matches!(s, ShardResult::Failed(_)))
    }

    /// Shards that had not answered when the fan-out finished.
    pub fn not_answered(&self) -> usize {
        self.count(|s| matches!(s, ShardResult::NotAnswered))
    }

    /// Whether some shard did not answer.
    pub fn is_partial(&self) -> bool {
        self.answered() < self.shards.len()
    }

    fn count(&self, which: impl Fn(&ShardResult<T>) -> bool) -> usize {
        self.shards.iter().filter(|s| which(s)).count()
    }
}

impl<T> fmt::Debug for FanOutResults<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FanOutResults")
            .field("answered", &self.answered())
            .field("failed", &self.failed())
            .field("not_answered", &self.not_answered())
            .field("finished", &self.finished)
            .field("elapsed", &self.elapsed)
            .finish()
    }
}

impl FanOut {
    /// A fan-out that waits for every shard, without a deadline.
    pub fn new() -> FanOut {
        FanOut::default()
    }

    /// A fan-out due `timeout` from now.
    pub fn within(timeout: Duration) -> FanOut {
        FanOut::new().deadline(Instant::now() + timeout)
    }

    /// Finish at `deadline` with what has arrived (a `std::time::Instant`
    /// converts with `.into()`).
    pub fn deadline(mut self, deadline: Instant) -> FanOut {
        self.deadline = Some(deadline);
        self
    }

    /// Finish as soon as `answers` shards answered (k of n).
    pub fn quorum(mut self, answers: usize) -> FanOut {
        self.quorum = Some(answers);
        self
    }

    /// Finish as soon as more than `failures` shards failed.
    pub fn fail_limit(mut self, failures: usize) -> FanOut {
        self.fail_limit = Some(failures);
        self
    }

    /// The deadline, if any: what each shard's request should carry.
    pub fn get_deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// A request for one shard, carrying the fan-out's deadline.
    pub fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        if let Some(deadline) = self.deadline {
            request.set_deadline(deadline);
        }
        request
    }

    /// Runs `calls` concurrently (one per shard) until the fan-out finishes,
    /// then drops the calls still running (which cancels them on their
    /// servers). Shard `i`'s result is `shards[i]`.
    pub async fn run<T, F>(&self, calls: impl IntoIterator<Item = F>) -> FanOutResults<T>
    where
        F: Future<Output = Result<T, Status>>,
    {
        let started = Instant::now();
        let mut running: FuturesUnordered<_> = calls
            .into_iter()
            .enumerate()
            .map(|(shard, call)| async move { (shard, call.await) })
            .collect();
        let n = running.len();
        let mut shards: Vec<ShardResult<T>> = (0..n).map(|_| ShardResult::NotAnswered).collect();
        let (mut answered, mut failed) = (0, 0);
        let deadline = async {
            match self.deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        let mut deadline = std::pin::pin!(deadline);
        let finished = loop {
            if running.is_empty() {
                // Calls that ran out of the deadline themselves end here too.
                break if answered + failed == n {
                    Finished::AllDone
                } else {
                    Finished::Deadline
                };
            }
            if self.quorum.is_some_and(|k| answered >= k) {
                break Finished::Quorum;
            }
            let quorum_lost = self.quorum.is_some_and(|k| n - failed < k);
            if quorum_lost || self.fail_limit.is_some_and(|limit| failed > limit) {
                break Finished::TooManyFailed;
            }
            tokio::select! {
                // Answers that arrived by the deadline count, even when both are ready.
                biased;
                Some((shard, outcome)) = running.next() => {
                    shards[shard] = match outcome {
                        Ok(value) => {
                            answered += 1;
                            ShardResult::Ok(value)
                        }
                        // A call that ran out of the fan-out's own time did not answer
                        // by the deadline: it did not fail.
                        Err(status) if status.code() == Code::DeadlineExceeded
                            && self.deadline.is_some_and(|d| Instant::now() >= d) =>
                        {
                            ShardResult::NotAnswered
                        }
                        Err(status) => {
                            failed += 1;
                            ShardResult::Failed(status)
                        }
                    };
                }
                () = &mut deadline => break Finished::Deadline,
            }
        };
        drop(running); // cancels the stragglers
        FanOutResults {
            shards,
            finished,
            elapsed: started.elapsed(),
        }
    }
}
