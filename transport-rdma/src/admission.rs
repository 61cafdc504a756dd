//! Admission control of a listener: what it lets a connecting client cost,
//! checked from the client's hello before anything is allocated for it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::proto::Refused;

/// A listener's limits (see [`RdmaTransport::max_connections`]).
///
/// [`RdmaTransport::max_connections`]: crate::RdmaTransport::max_connections
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AdmissionLimits {
    pub(crate) max_connections: usize,
    pub(crate) max_handshakes: usize,
    pub(crate) max_pinned: u64,
}

#[derive(Debug, Default)]
struct Counts {
    connections: usize,
    handshakes: usize,
    pinned: u64,
}

/// One listener's admitted connections and what they pin.
#[derive(Debug)]
pub(crate) struct Admission {
    limits: AdmissionLimits,
    counts: Mutex<Counts>,
}

/// An admitted connection's share (a connection and its pinned bytes),
/// given back when dropped: when the connection's memory is freed.
#[derive(Debug)]
pub(crate) struct Lease {
    admission: Arc<Admission>,
    pinned: u64,
}

/// A connection set-up under way, given back when dropped.
#[derive(Debug)]
pub(crate) struct Handshake {
    admission: Arc<Admission>,
}

impl Admission {
    pub(crate) fn new(limits: AdmissionLimits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            counts: Mutex::new(Counts::default()),
        })
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a connection that will pin `pinned` bytes, or says why not.
    pub(crate) fn admit(self: &Arc<Self>, pinned: u64) -> Result<(Lease, Handshake), Refused> {
        let limits = self.limits;
        let mut counts = self.counts();
        if counts.connections >= limits.max_connections {
            return Err(Refused::TooManyConnections {
                limit: limits.max_connections as u64,
            });
        }
        if counts.handshakes >= limits.max_handshakes {
            return Err(Refused::TooManyHandshakes {
                limit: limits.max_handshakes as u64,
            });
        }
        if counts.pinned.saturating_add(pinned) > limits.max_pinned {
            return Err(Refused::OverPinnedBudget {
                limit: limits.max_pinned,
            });
        }
        counts.connections += 1;
        counts.handshakes += 1;
        counts.pinned += pinned;
        let lease = Lease {
            admission: Arc::clone(self),
            pinned,
        };
        let handshake = Handshake {
            admission: Arc::clone(self),
        };
        Ok((lease, handshake))
    }

    /// Connections admitted and not yet given back, and their pinned bytes.
    #[cfg(test)]
    fn in_use(&self) -> (usize, u64) {
        let counts = self.counts();
        (counts.connections, counts.pinned)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut counts = self.admission.counts();
        counts.connections -= 1;
        counts.pinned -= self.pinned;
    }
}

impl Drop for Handshake {
    fn drop(&mut self) {
        self.admission.counts().handshakes -= 1;
    }
}

/// Logs refused connections at most once a second (a connect storm
/// must not flood the log), counting the ones it left out.
#[derive(Debug, Default)]
pub(crate) struct RefusalLog {
    last: Option<Instant>,
    left_out: u64,
}

impl RefusalLog {
    /// Logs `why` `peer` was refused, unless a refusal was logged less
    /// than a second ago.
    pub(crate) fn refused(&mut self, peer: &str, why: &dyn std::fmt::Display) {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < Duration::from_secs(1))
        {
            self.left_out += 1;
            return;
        }
        let more = std::mem::take(&mut self.left_out);
        let more = if more > 0 {
            format!(" ({more} more refused since the last such line)")
        } else {
            String::new()
        };
        tracing::warn!("rdma: refused a connection from {peer}: {why}{more}");
        self.last = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max_connections: usize, max_handshakes: usize, max_pinned: u64) -> Arc<Admission> {
        Admission::new(AdmissionLimits {
            max_connections,
            max_handshakes,
            max_pinned,
        })
    }

    #[test]
    fn each_limit_refuses_with_its_reason_and_leases_give_back() {
        let a = admission(2, 10, 1000);
        let (first, h1) = a.admit(400).unwrap();
        let (second, h2) = a.admit(400).unwrap();
        assert_eq!(
            a.admit(1).unwrap_err(),
            Refused::TooManyConnections { limit: 2 }
        );
        drop((h1, h2));
        drop(first);
        // Room for a connection again, but not for its memory.
        assert_eq!(
            a.admit(601).unwrap_err(),
            Refused::OverPinnedBudget { limit: 1000 }
        );
        let (third, _h3) = a.admit(600).unwrap();
        assert_eq!(a.in_use(), (2, 1000));
        drop((second, third));
        assert_eq!(a.in_use(), (0, 0));

        let a = admission(10, 1, u64::MAX);
        let (_lease, handshake) = a.admit(1).unwrap();
        assert_eq!(
            a.admit(1).unwrap_err(),
            Refused::TooManyHandshakes { limit: 1 }
        );
        drop(handshake);
        assert!(a.admit(1).is_ok(), "a finished handshake makes room");
    }
}
