//! [`Hedging`]: backup requests. When a call has not answered after a delay
//! (fixed, or a percentile of recent latencies), the same call goes out
//! again, to another replica on a balanced [`Channel`](crate::Channel), and
//! the first answer wins; the other call is dropped, which cancels it on its
//! server. A budget caps the extra load.
//!
//! ```
//! use std::time::Duration;
//! use rpc_core::hedging::Hedging;
//! use rpc_core::Status;
//!
//! # async fn infer(query: u32) -> Result<u32, Status> { Ok(query) }
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // Hedge calls slower than the 95th percentile, at most 10 % more calls.
//! let hedging = Hedging::at_percentile(95.0, Duration::from_millis(10)).budget(0.10);
//! let answer = hedging.call(|| infer(7)).await;
//! assert_eq!(answer.unwrap(), 7);
//! assert_eq!(hedging.stats().calls, 1);
//! # }
//! ```
//!
//! Only hedge calls that are safe to run twice (reads, idempotent writes):
//! both copies may reach a server. The closure makes one attempt each time it
//! is called; with generated clients, `|| client.infer(request.clone())`.

use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::status::Status;

/// Most latencies the percentile is taken over (the most recent).
const LATENCY_SAMPLES: usize = 1000;
/// The percentile is recomputed after this many new latencies.
const RECOMPUTE_EVERY: usize = 50;
/// Latencies needed before the percentile replaces the initial delay.
const MIN_SAMPLES: usize = 20;
/// The budget counts in thousandths of a hedge (exact, unlike floats).
const HEDGE: u64 = 1000;
/// Most unspent hedges the budget saves up.
const MAX_SAVED: u64 = 10 * HEDGE;

/// A hedging policy, its budget and its counters; clones share them.
#[derive(Clone)]
pub struct Hedging {
    shared: Arc<Shared>,
}

/// When to send the backup request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HedgeDelay {
    /// A fixed delay after the first attempt.
    Fixed(Duration),
    /// The given percentile (0–100) of the last 1,000 calls' latencies;
    /// `initial` until 20 calls have finished.
    Percentile {
        /// E.g. 95.0 to hedge the slowest 5 % of calls.
        percentile: f64,
        /// The delay before there are enough latencies.
        initial: Duration,
    },
}

/// What a [`Hedging`] policy has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HedgeStats {
    /// Calls made through it.
    pub calls: u64,
    /// Backup requests sent.
    pub hedges: u64,
    /// Calls whose answer came from the backup request.
    pub hedges_won: u64,
    /// Backup requests not sent because the budget was spent.
    pub over_budget: u64,
}

struct Shared {
    delay: HedgeDelay,
    state: Mutex<State>,
}

struct State {
    stats: HedgeStats,
    /// Thousandths of a hedge earned per call.
    earned_per_call: u64,
    /// Thousandths of hedges that may be sent now (each call adds
    /// `earned_per_call`, each hedge takes [`HEDGE`]).
    tokens: u64,
    latencies: Vec<Duration>,
    /// Where the next latency goes once `latencies` is full.
    next_sample: usize,
    since_recompute: usize,
    /// The percentile as last computed.
    percentile_delay: Option<Duration>,
}

impl Hedging {
    /// Hedges a call still unanswered after `delay`.
    pub fn after(delay: Duration) -> Hedging {
        Hedging::new(HedgeDelay::Fixed(delay))
    }

    /// Hedges a call slower than `percentile` (0–100) of recent calls;
    /// `initial` is the delay until 20 calls have finished.
    pub fn at_percentile(percentile: f64, initial: Duration) -> Hedging {
        Hedging::new(HedgeDelay::Percentile {
            percentile: percentile.clamp(0.0, 100.0),
            initial,
        })
    }

    /// A policy with `delay` and the default budget (10 % more calls).
    pub fn new(delay: HedgeDelay) -> Hedging {
        Hedging {
            shared: Arc::new(Shared {
                delay,
                state: Mutex::new(State {
                    stats: HedgeStats::default(),
                    earned_per_call: HEDGE / 10,
                    tokens: 0,
                    latencies: Vec::new(),
                    next_sample: 0,
                    since_recompute: 0,
                    percentile_delay: None,
                }),
            }),
        }
    }

    /// At most `ratio` backup requests per call (0.10: 10 % more calls at
    /// most; the default). Each call earns `ratio` of a hedge and each hedge
    /// spends one, so over any run hedges ≤ `ratio` × calls; up to 10
    /// unspent hedges are saved for a burst of slow calls.
    pub fn budget(self, ratio: f64) -> Hedging {
        self.state().earned_per_call = (ratio.clamp(0.0, 10.0) * HEDGE as f64).round() as u64;
        self
    }

    /// What it has done so far.
    pub fn stats(&self) -> HedgeStats {
        self.state().stats
    }

    /// The delay after which a call made now would be hedged.
    pub fn current_delay(&self) -> Duration {
        let state = self.state();
        match self.shared.delay {
            HedgeDelay::Fixed(delay) => delay,
            HedgeDelay::Percentile { initial, .. } => state.percentile_delay.unwrap_or(initial),
        }
    }

    /// Makes a call with `attempt`; if it has not answered after the hedge
    /// delay and the budget allows, makes a second one, and returns the
    /// first success (or, if both fail, the last failure). An attempt that
    /// fails before the delay is returned as is: hedging is not retrying.
    pub async fn call<T, F, Fut>(&self, mut attempt: F) -> Result<T, Status>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let started = Instant::now();
        let delay = {
            let mut state = self.state();
            state.stats.calls += 1;
            state.tokens = (state.tokens + state.earned_per_call).min(MAX_SAVED);
            drop(state);
            self.current_delay()
        };
        let mut first = pin!(attempt());
        let early = tokio::select! {
            outcome = &mut first => Some(outcome),
            () = tokio::time::sleep(delay) => None,
        };
        if let Some(outcome) = early {
            return self.finished(started, outcome);
        }
        if !self.take_token() {
            let outcome = first.await;
            return self.finished(started, outcome);
        }
        let mut second = pin!(attempt());
        let mut first_failed: Option<Status> = None;
        let mut second_failed: Option<Status> = None;
        loop {
            tokio::select! {
                outcome = &mut first, if first_failed.is_none() => match outcome {
                    Ok(value) => return self.finished(started, Ok(value)),
                    Err(status) if second_failed.is_some() => return self.finished(started, Err(status)),
                    Err(status) => first_failed = Some(status),
                },
                outcome = &mut second, if second_failed.is_none() => match outcome {
                    Ok(value) => {
                        self.state().stats.hedges_won += 1;
                        return self.finished(started, Ok(value));
                    }
                    Err(status) if first_failed.is_some() => return self.finished(started, Err(status)),
                    Err(status) => second_failed = Some(status),
                },
            }
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Spends a hedge from the budget, if there is one.
    fn take_token(&self) -> bool {
        let mut state = self.state();
        if state.tokens >= HEDGE {
            state.tokens -= HEDGE;
            state.stats.hedges += 1;
            true
        } else {
            state.stats.over_budget += 1;
            false
        }
    }

    /// Records a successful call's latency (for the percentile delay).
    fn finished<T>(&self, started: Instant, outcome: Result<T, Status>) -> Result<T, Status> {
        let HedgeDelay::Percentile { percentile, .. } = self.shared.delay else {
            return outcome;
        };
        // A failure's latency says nothing about slowness.
        let Ok(value) = outcome else { return outcome };
        let latency = started.elapsed();
        let mut state = self.state();
        if state.latencies.len() < LATENCY_SAMPLES {
            state.latencies.push(latency);
        } else {
            let at = state.next_sample;
            state.latencies[at] = latency;
            state.next_sample = (at + 1) % LATENCY_SAMPLES;
        }
        state.since_recompute += 1;
        let samples = state.latencies.len();
        if samples >= MIN_SAMPLES
            && (state.since_recompute >= RECOMPUTE_EVERY || state.percentile_delay.is_none())
        {
            let mut sorted = state.latencies.clone();
            sorted.sort_unstable();
            let rank = ((percentile / 100.0) * (samples - 1) as f64).round() as usize;
            state.percentile_delay = Some(sorted[rank.min(samples - 1)]);
            state.since_recompute = 0;
        }
        Ok(value)
    }
}

impl std::fmt::Debug for Hedging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hedging")
            .field("delay", &self.shared.delay)
            .field("stats", &self.stats())
            .finish()
    }
}
