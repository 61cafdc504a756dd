//! A listener's log of refused clients, at most one line a second.

use std::fmt;
use std::time::{Duration, Instant};

/// Logs refused clients at `warn`, at most one line a second, counting the
/// ones it left out: a storm of bad or over-limit clients does not flood
/// the log. One per listener (its accept loop owns it).
#[derive(Debug, Default)]
pub struct RefusalLog {
    last: Option<Instant>,
    left_out: u64,
}

impl RefusalLog {
    /// Logs `what`, unless a line was logged less than a second ago.
    pub fn note(&mut self, what: fmt::Arguments<'_>) {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < Duration::from_secs(1))
        {
            self.left_out += 1;
            return;
        }
        self.last = Some(now);
        match std::mem::take(&mut self.left_out) {
            0 => tracing::warn!("{what}"),
            n => tracing::warn!("{what} ({n} more refused since the last such line)"),
        }
    }
}
