//! What the end-to-end benchmark measures: unary latency at concurrency 1
//! and throughput with many calls in flight on one connection.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;

use crate::client::{raw_frame, Client, RawConnection};
use crate::{Call, Error};

/// How long each measurement runs.
#[derive(Clone, Copy, Debug)]
pub struct Measure {
    /// Calls made and thrown away before each measurement.
    pub warmup: Duration,
    /// How long a latency measurement runs (it may stop earlier, see `max_latency_calls`).
    pub latency_time: Duration,
    /// A latency measurement stops after this many calls.
    pub max_latency_calls: u64,
    /// How long a throughput measurement counts completed calls (after its warm-up).
    pub throughput_time: Duration,
}

/// The outcome of a throughput measurement.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Throughput {
    /// Calls completed inside the measured window.
    pub calls: u64,
    /// The window's length.
    pub elapsed: Duration,
}

impl Throughput {
    /// Completed calls per second.
    pub fn calls_per_sec(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }

    /// Payload bytes per second one way (an echo carries as much back), in 10⁹ bytes.
    pub fn gb_per_sec(&self, payload_len: usize) -> f64 {
        self.calls_per_sec() * payload_len as f64 / 1e9
    }
}

/// A histogram of nanoseconds from 1 ns to 10 minutes, 3 significant digits.
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("valid histogram bounds")
}

impl Measure {
    /// Round-trip time of unary calls with `payload_len`-byte payloads, one
    /// at a time, in nanoseconds, after a warm-up.
    pub async fn latency(
        &self,
        client: &Client,
        payload_len: usize,
    ) -> Result<Histogram<u64>, Error> {
        let mut histogram = latency_histogram();
        let start = Instant::now();
        let measure_from = start + self.warmup;
        let until = measure_from + self.latency_time;
        let mut calls = 0u64;
        if let Client::Raw(authority) = client {
            let mut conn = RawConnection::connect(authority, payload_len).await?;
            while Instant::now() < until && calls < self.max_latency_calls {
                let began = Instant::now();
                conn.ping().await?;
                if began >= measure_from {
                    histogram.record(nanos(began.elapsed()))?;
                    calls += 1;
                }
            }
        } else {
            let mut client = client.clone();
            let payload = payload(payload_len);
            while Instant::now() < until && calls < self.max_latency_calls {
                let began = Instant::now();
                client.echo(&payload).await?;
                if began >= measure_from {
                    histogram.record(nanos(began.elapsed()))?;
                    calls += 1;
                }
            }
        }
        Ok(histogram)
    }

    /// Completed calls with `concurrency` unary calls kept in flight on one
    /// connection, counted over [`Measure::throughput_time`] after a warm-up.
    ///
    /// rdma-rpc and tonic run one task per call slot, each calling `call` in
    /// a loop on a shared channel; the raw system pipelines echoed frames on
    /// its connection (it has no [`Call::Sink`]).
    pub async fn throughput(
        &self,
        client: &Client,
        payload_len: usize,
        concurrency: usize,
        call: Call,
    ) -> Result<Throughput, Error> {
        let start = Instant::now();
        let count_from = start + self.warmup;
        let count_until = count_from + self.throughput_time;
        let calls = if let Client::Raw(authority) = client {
            if call != Call::Echo {
                return Err("the raw system only echoes".into());
            }
            let conn = RawConnection::connect(authority, payload_len).await?;
            conn.pipeline(concurrency, count_from, count_until).await?
        } else {
            let counted = Arc::new(AtomicU64::new(0));
            let payload = payload(payload_len);
            let mut tasks = Vec::with_capacity(concurrency);
            for _ in 0..concurrency {
                let (mut client, payload, counted) =
                    (client.clone(), payload.clone(), counted.clone());
                tasks.push(tokio::spawn(async move {
                    while Instant::now() < count_until {
                        client.call(call, &payload).await?;
                        let now = Instant::now();
                        if now >= count_from && now < count_until {
                            counted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Ok::<_, Error>(())
                }));
            }
            for task in tasks {
                task.await??;
            }
            counted.load(Ordering::Relaxed)
        };
        Ok(Throughput {
            calls,
            elapsed: count_until - count_from,
        })
    }
}

/// A payload of `len` bytes, shared (not copied) by every call that sends it.
pub fn payload(len: usize) -> Bytes {
    raw_frame(len)
        .expect("payload fits a u32 length")
        .slice(4..)
}

fn nanos(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX).max(1)
}
