//! Noticing a peer that went silent, on any transport.
//!
//! A call waiting for its response sends nothing, so a transport may never
//! learn that the peer's host died (an RDMA RC queue pair with no work posted,
//! a TCP peer that is up but stuck). Each connection's reader therefore runs a
//! [`KeepaliveTimer`]: any received frame proves the peer alive; after
//! `interval` of silence it sends a `Ping` (answered by `Pong`), and after a
//! further `timeout` of silence the connection fails, ending its calls with
//! `Unavailable`.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use crate::gate::WakeGate;

/// When to ping a quiet connection, and how long to wait for an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Keepalive {
    pub(crate) interval: Duration,
    pub(crate) timeout: Duration,
}

/// The default: ping after 20 s of silence, give up 20 s later.
pub(crate) const DEFAULT_KEEPALIVE: Keepalive = Keepalive {
    interval: Duration::from_secs(20),
    timeout: Duration::from_secs(20),
};

/// What the reader should do when the timer fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tick {
    /// Send a `Ping`.
    Ping,
    /// Nothing arrived for this long, a ping included: the peer is gone.
    Dead(Duration),
}

/// A reader's keepalive state. Costs nothing per frame: the reader counts
/// frames, and the timer compares counts when it fires. Its sleep is polled
/// only when the timer woke it (or it was reset), not at every wake-up of
/// the reader's task.
pub(crate) struct KeepaliveTimer {
    config: Option<Keepalive>,
    sleep: Pin<Box<Sleep>>,
    gate: WakeGate,
    /// Frames received when the timer last fired.
    seen: u64,
    pinged: bool,
    /// Whether the peer can answer a ping (see [`probe_only`](Self::probe_only)).
    answers: bool,
}

impl KeepaliveTimer {
    pub(crate) fn new(config: Option<Keepalive>) -> KeepaliveTimer {
        let first = config.map_or(Duration::from_secs(86_400 * 365), |c| c.interval);
        KeepaliveTimer {
            config,
            sleep: Box::pin(tokio::time::sleep(first)),
            gate: WakeGate::new(),
            seen: 0,
            pinged: false,
            answers: true,
        }
    }

    /// For a peer that can send nothing more (it shut down its sending
    /// side): pings go on every `interval` and silence is never fatal. A
    /// ping is then a probe of the way back: written to a peer whose host
    /// closed the socket, it fails (TCP's first write draws a reset, the
    /// next one fails), and the caller learns the peer left.
    pub(crate) fn probe_only(&mut self) {
        self.answers = false;
    }

    /// Whether keepalive is on (select on [`KeepaliveTimer::tick`] only then).
    pub(crate) fn enabled(&self) -> bool {
        self.config.is_some()
    }

    /// Waits until the reader must act; `received` counts the connection's
    /// frames so far (read when the timer fires: whoever reads frames
    /// counts them, the reader or a caller reading for itself).
    pub(crate) async fn tick(&mut self, received: &AtomicU64) -> Tick {
        let Some(config) = self.config else {
            return std::future::pending().await;
        };
        loop {
            let (gate, sleep) = (&self.gate, &mut self.sleep);
            std::future::poll_fn(|cx| gate.poll(cx, sleep.as_mut())).await;
            let now = Instant::now();
            let received = received.load(Ordering::Relaxed);
            // A fired sleep holds no waker: each reset is polled again (forced).
            if received != self.seen {
                self.seen = received;
                self.pinged = false;
                self.sleep.as_mut().reset(now + config.interval);
                self.gate.force();
            } else if !self.pinged || !self.answers {
                self.pinged = true;
                let next = if self.answers {
                    config.timeout
                } else {
                    config.interval
                };
                self.sleep.as_mut().reset(now + next);
                self.gate.force();
                return Tick::Ping;
            } else {
                return Tick::Dead(config.interval + config.timeout);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: Keepalive = Keepalive {
        interval: Duration::from_secs(10),
        timeout: Duration::from_secs(5),
    };

    #[tokio::test(start_paused = true)]
    async fn silence_pings_then_declares_the_peer_dead() {
        let mut timer = KeepaliveTimer::new(Some(CONFIG));
        let start = Instant::now();
        assert_eq!(timer.tick(&AtomicU64::new(0)).await, Tick::Ping);
        assert_eq!(start.elapsed(), Duration::from_secs(10));
        assert_eq!(
            timer.tick(&AtomicU64::new(0)).await,
            Tick::Dead(Duration::from_secs(15))
        );
        assert_eq!(start.elapsed(), Duration::from_secs(15));
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_cannot_answer_is_probed_every_interval_and_never_declared_dead() {
        let mut timer = KeepaliveTimer::new(Some(CONFIG));
        timer.probe_only();
        let start = Instant::now();
        for n in 1..=4 {
            assert_eq!(timer.tick(&AtomicU64::new(0)).await, Tick::Ping);
            assert_eq!(start.elapsed(), n * CONFIG.interval);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn any_frame_resets_the_timer() {
        let mut timer = KeepaliveTimer::new(Some(CONFIG));
        let start = Instant::now();
        assert_eq!(timer.tick(&AtomicU64::new(0)).await, Tick::Ping);
        // The pong (a frame) arrived: the next ping comes a full interval after the check.
        assert_eq!(timer.tick(&AtomicU64::new(1)).await, Tick::Ping);
        assert_eq!(start.elapsed(), Duration::from_secs(10 + 5 + 10));
    }

    #[tokio::test(start_paused = true)]
    async fn disabled_never_fires() {
        let mut timer = KeepaliveTimer::new(None);
        assert!(!timer.enabled());
        let fired = tokio::time::timeout(
            Duration::from_secs(1_000_000),
            timer.tick(&AtomicU64::new(0)),
        )
        .await;
        assert!(fired.is_err());
    }
}
