//! What the RDMA transport reports for metrics
//! ([`Transport::stats`](rpc_core::transport::Transport::stats)): memory
//! pinned now, the verbs objects held (queue pairs, completion queues and
//! channels, protection domains), device async events seen, connect
//! requests refused, and
//! how rendezvous frames left (read in place, or copied first). rpc-core counts what every
//! transport has (connections, reconnects, sends that waited for credits).
//!
//! The values are kept where they happen, as the verbs layer sees them
//! ([`verbs::registered_bytes`], [`verbs::async_events_read`]): every
//! registered region counts, whatever made it (RPC connections,
//! [`RdmaStream`](crate::RdmaStream)s, set-ups under way), and every
//! event read. This module only reads them, at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};

use rpc_core::transport::stats::TransportStat;

use crate::proto::Refused;
use crate::verbs::{self, AsyncEventKind, DeviceEventCounts};

/// Why listeners refused connect requests: the `reason` label of each
/// counter in [`REFUSED`].
const REFUSAL_REASONS: [&str; 6] = [
    "too_many_connections",
    "too_many_handshakes",
    "over_pinned_budget",
    "bad_hello",
    "proof_refused",
    "not_allowed",
];

/// Connect requests refused by this process's listeners, by reason.
static REFUSED: [AtomicU64; REFUSAL_REASONS.len()] =
    [const { AtomicU64::new(0) }; REFUSAL_REASONS.len()];

/// Counts a listener's refusal (a challenge is not one: the client is
/// asked for its proof).
pub(crate) fn refused(why: &Refused) {
    let reason = match why {
        Refused::Challenge(_) => return,
        Refused::TooManyConnections { .. } => 0,
        Refused::TooManyHandshakes { .. } => 1,
        Refused::OverPinnedBudget { .. } => 2,
        Refused::BadHello => 3,
        Refused::Proof(_) => 4,
        Refused::NotAllowed => 5,
    };
    REFUSED[reason].fetch_add(1, Ordering::Relaxed);
}

/// Event kinds reported even before one is seen (those that fail
/// connections, and a port coming back), so that a rate of them starts
/// from zero; the others appear once seen.
const ALWAYS_REPORTED: &[AsyncEventKind] = &[
    AsyncEventKind::PortErr,
    AsyncEventKind::PortActive,
    AsyncEventKind::DeviceFatal,
    AsyncEventKind::QpFatal,
    AsyncEventKind::QpReqErr,
    AsyncEventKind::QpAccessErr,
    AsyncEventKind::PathMigErr,
    AsyncEventKind::CqErr,
];

/// The body of `RdmaTransport`'s [`Transport::stats`](rpc_core::transport::Transport::stats).
pub(crate) fn transport_stats() -> Vec<TransportStat> {
    let mut stats = stats_of(verbs::registered_bytes(), &verbs::async_events_read());
    for (reason, count) in REFUSAL_REASONS.iter().zip(&REFUSED) {
        stats.push(
            TransportStat::counter(
                "rdma_connections_refused",
                "Connect requests this process's listeners refused, by reason \
                 (limits, a bad hello, a refused proof of the shared secret, off the allow-list)",
                count.load(Ordering::Relaxed),
            )
            .with_label("reason", reason.to_string()),
        );
    }
    stats.extend(object_stats([
        ("queue_pair", verbs::queue_pairs()),
        ("completion_queue", verbs::completion_queues()),
        ("completion_channel", verbs::completion_channels()),
        ("protection_domain", verbs::protection_domains()),
        ("memory_registration", verbs::memory_registrations()),
    ]));
    let (in_place, copied) = crate::rendezvous_bytes_sent();
    let from_pool = crate::rendezvous_bytes_sent_from_pool();
    stats.extend(rendezvous_stats(in_place, copied, from_pool));
    stats
}

/// The verbs objects this process holds now, by kind: each connection end
/// holds a queue pair, a completion queue and its completion channel, and
/// shares its device's protection domain and the registrations its ring's
/// first slots lie in.
fn object_stats<const N: usize>(held: [(&str, usize); N]) -> [TransportStat; N] {
    held.map(|(kind, count)| {
        TransportStat::gauge(
            "rdma_verbs_objects",
            "Verbs objects held now, by kind (queue pairs, completion queues and completion \
             channels: one per connection end; protection domains: one per device unless \
             connections were told not to share; memory registrations: a few per device for \
             idle ends, more as traffic needs them)",
            count as u64,
        )
        .with_label("kind", kind.to_string())
    })
}

/// How this process's rendezvous frames left: `in_place` bytes read by
/// the peer where the application left them (registered for the
/// transfer), `copied` copied into registered memory first, `from_pool`
/// read out of payload buffers through a memory window.
fn rendezvous_stats(in_place: u64, copied: u64, from_pool: u64) -> [TransportStat; 3] {
    [
        ("in_place", in_place),
        ("copied", copied),
        ("payload_buffer", from_pool),
    ]
    .map(|(how, bytes)| {
        TransportStat::counter(
            "rdma_rendezvous_sent_bytes",
            "Bytes of rendezvous frames sent, by how: read by the peer where the application \
             left them, registered for the transfer (in_place), out of a payload buffer \
             through a memory window (payload_buffer), or copied into registered memory \
             first (copied)",
            bytes,
        )
        .with_label("how", how.to_string())
    })
}

fn stats_of(pinned: u64, events: &[DeviceEventCounts]) -> Vec<TransportStat> {
    let mut stats = vec![TransportStat::gauge(
        "rdma_pinned_bytes",
        "Memory registered (pinned) with RDMA devices now, bytes (whole pages)",
        pinned,
    )];
    for device in events {
        let event = |label: String, value: u64| {
            TransportStat::counter(
                "rdma_device_events",
                "Device async events read (port up/down, queue pair and device errors), by device and event",
                value,
            )
            .with_label("device", device.device.clone())
            .with_label("event", label)
        };
        for (kind, count) in device.by_kind() {
            if count > 0 || ALWAYS_REPORTED.contains(&kind) {
                stats.push(event(event_label(kind), count));
            }
        }
        if device.unknown > 0 {
            stats.push(event("unknown".to_string(), device.unknown));
        }
    }
    stats
}

/// `IBV_EVENT_PORT_ERR` -> `port_err`.
fn event_label(kind: AsyncEventKind) -> String {
    let name = kind.name();
    name.strip_prefix("IBV_EVENT_")
        .unwrap_or(name)
        .to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use rpc_core::transport::stats::StatKind;

    use super::*;

    #[test]
    fn rendezvous_bytes_are_counted_by_how_they_left() {
        let stats = rendezvous_stats(10, 3, 7);
        let by_how: Vec<_> = stats
            .iter()
            .map(|s| {
                assert_eq!(
                    (s.name, s.kind),
                    ("rdma_rendezvous_sent_bytes", StatKind::Counter)
                );
                (s.labels[0].1.as_str(), s.value)
            })
            .collect();
        assert_eq!(
            by_how,
            [("in_place", 10), ("copied", 3), ("payload_buffer", 7)]
        );
        assert!(transport_stats()
            .iter()
            .any(|s| s.name == "rdma_rendezvous_sent_bytes"));
    }

    #[test]
    fn verbs_objects_are_gauges_by_kind() {
        let stats = object_stats([("queue_pair", 4), ("protection_domain", 1)]);
        let by_kind: Vec<_> = stats
            .iter()
            .map(|s| {
                assert_eq!((s.name, s.kind), ("rdma_verbs_objects", StatKind::Gauge));
                (s.labels[0].0, s.labels[0].1.as_str(), s.value)
            })
            .collect();
        assert_eq!(
            by_kind,
            [("kind", "queue_pair", 4), ("kind", "protection_domain", 1)]
        );
        let kinds: Vec<_> = transport_stats()
            .into_iter()
            .filter(|s| s.name == "rdma_verbs_objects")
            .map(|s| s.labels[0].1.clone())
            .collect();
        assert_eq!(
            kinds,
            [
                "queue_pair",
                "completion_queue",
                "completion_channel",
                "protection_domain",
                "memory_registration"
            ]
        );
    }

    #[test]
    fn event_labels_are_the_short_lower_case_names() {
        assert_eq!(event_label(AsyncEventKind::PortErr), "port_err");
        assert_eq!(event_label(AsyncEventKind::DeviceFatal), "device_fatal");
    }

    #[test]
    fn pinned_bytes_and_events_by_device_and_kind() {
        let mut rxe0 = DeviceEventCounts {
            device: "rxe0".into(),
            known: vec![0; AsyncEventKind::KNOWN.len()],
            unknown: 2,
        };
        let at = |kind| {
            AsyncEventKind::KNOWN
                .iter()
                .position(|&k| k == kind)
                .unwrap()
        };
        rxe0.known[at(AsyncEventKind::PortErr)] = 3;
        rxe0.known[at(AsyncEventKind::LidChange)] = 1;
        let stats = stats_of(1 << 20, &[rxe0]);

        assert_eq!(stats[0].name, "rdma_pinned_bytes");
        assert_eq!((stats[0].kind, stats[0].value), (StatKind::Gauge, 1 << 20));
        assert!(stats[0].labels.is_empty());
        let event = |name: &str| {
            stats
                .iter()
                .find(|s| s.labels.iter().any(|(k, v)| *k == "event" && v == name))
                .map(|s| {
                    assert_eq!((s.name, s.kind), ("rdma_device_events", StatKind::Counter));
                    assert_eq!(s.labels[0], ("device", "rxe0".to_string()));
                    s.value
                })
        };
        assert_eq!(event("port_err"), Some(3));
        assert_eq!(event("lid_change"), Some(1), "seen: reported");
        assert_eq!(event("unknown"), Some(2));
        assert_eq!(
            event("device_fatal"),
            Some(0),
            "reported before one is seen"
        );
        assert_eq!(
            event("sm_change"),
            None,
            "not seen and not among the always reported"
        );
        assert_eq!(stats.len(), 1 + ALWAYS_REPORTED.len() + 2);
    }
}
