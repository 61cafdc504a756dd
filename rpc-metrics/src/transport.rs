//! Per-transport metrics: a collector that reads rpc-core's connection
//! counters and each installed transport's own values at scrape time.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use rpc_core::transport::stats::{self, ConnectionStats, StatKind, TransportStat};

/// The transport metric families (see the [crate docs](crate#per-transport));
/// [`register`](Self::register) them in a registry.
///
/// Nothing is recorded on any call's path for them: rpc-core keeps the
/// connection counters (relaxed atomics, touched per connection and per
/// send that finds no room) and each transport its own; a scrape reads
/// them. The counters are process-wide, so every registry they are
/// registered in shows the same values.
#[derive(Debug, Clone, Copy, Default)]
pub struct TransportMetrics;

impl TransportMetrics {
    /// Registers the `rpc_transport_*` families in `registry`.
    pub fn register(registry: &mut Registry) -> TransportMetrics {
        registry.register_collector(Box::new(TransportMetrics));
        TransportMetrics
    }
}

/// A family of the connection counters: its name (without `_total`),
/// help, type, the labels it has and how its value is read.
struct ConnectionFamily {
    name: &'static str,
    help: &'static str,
    kind: StatKind,
    client_only: bool,
    value: fn(&ConnectionStats) -> u64,
}

const CONNECTION_FAMILIES: &[ConnectionFamily] = &[
    ConnectionFamily {
        name: "rpc_transport_connections_opened",
        help: "Connections established, by scheme and side",
        kind: StatKind::Counter,
        client_only: false,
        value: |s| s.opened,
    },
    ConnectionFamily {
        name: "rpc_transport_connections_closed",
        help: "Connections ended (closed, broken or found dead), by scheme and side",
        kind: StatKind::Counter,
        client_only: false,
        value: |s| s.closed,
    },
    ConnectionFamily {
        name: "rpc_transport_connections_open",
        help: "Connections open now, by scheme and side",
        kind: StatKind::Gauge,
        client_only: false,
        value: ConnectionStats::open,
    },
    ConnectionFamily {
        name: "rpc_transport_reconnects",
        help: "Connections a client made to replace one it had lost, by scheme",
        kind: StatKind::Counter,
        client_only: true,
        value: |s| s.reconnects,
    },
    ConnectionFamily {
        name: "rpc_transport_connect_failures",
        help: "Client connection attempts that failed or timed out, by scheme",
        kind: StatKind::Counter,
        client_only: true,
        value: |s| s.connect_failures,
    },
    ConnectionFamily {
        name: "rpc_transport_send_stalls",
        help: "Sends that found no room in the transport (peer's credits or socket buffer exhausted) and waited, by scheme and side",
        kind: StatKind::Counter,
        client_only: false,
        value: |s| s.send_stalls,
    },
];

fn metric_type(kind: StatKind) -> MetricType {
    match kind {
        StatKind::Gauge => MetricType::Gauge,
        _ => MetricType::Counter,
    }
}

/// One series `labels` of `family`, of `kind`, at `value`.
fn encode_series(
    family: &mut MetricEncoder<'_>,
    labels: &[(&str, &str)],
    kind: StatKind,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let series = family.encode_family(&labels)?;
    match kind {
        StatKind::Gauge => ConstGauge::new(value).encode(series),
        _ => ConstCounter::new(value).encode(series),
    }
}

impl Collector for TransportMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let connections = stats::connection_stats();
        for family in CONNECTION_FAMILIES {
            let mut metric = encoder.encode_descriptor(
                family.name,
                family.help,
                None,
                metric_type(family.kind),
            )?;
            for s in &connections {
                let labels = if family.client_only {
                    if s.side != stats::Side::Client {
                        continue;
                    }
                    vec![("scheme", s.scheme)]
                } else {
                    vec![("scheme", s.scheme), ("side", s.side.as_str())]
                };
                encode_series(&mut metric, &labels, family.kind, (family.value)(s))?;
            }
        }

        // Each installed transport's own values, grouped into families by name.
        let mut own: Vec<(&'static str, TransportStat)> = Vec::new();
        for scheme in rpc_core::transport::registered_schemes() {
            if let Some(transport) = rpc_core::transport::lookup(scheme) {
                own.extend(transport.stats().into_iter().map(|stat| (scheme, stat)));
            }
        }
        let mut names: Vec<&'static str> = Vec::new();
        for (_, stat) in &own {
            if !names.contains(&stat.name) {
                names.push(stat.name);
            }
        }
        for name in names {
            let mut members = own.iter().filter(|(_, stat)| stat.name == name).peekable();
            let Some((_, first)) = members.peek() else {
                continue;
            };
            // Members must agree on help and type: the first one's are used.
            let (help, kind) = (first.help, first.kind);
            let full_name = format!("rpc_transport_{name}");
            let mut metric =
                encoder.encode_descriptor(&full_name, help, None, metric_type(kind))?;
            for (scheme, stat) in members {
                let mut labels = vec![("scheme", *scheme)];
                labels.extend(stat.labels.iter().map(|(k, v)| (*k, v.as_str())));
                encode_series(&mut metric, &labels, kind, stat.value)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rpc_core::transport::{
        BoxFuture, Connection, FrameLimits, Listener, Transport, TransportError,
    };

    use super::*;

    /// A transport that connects nowhere and reports two families of its own.
    struct Reporting;

    impl Transport for Reporting {
        fn scheme(&self) -> &'static str {
            "reporting"
        }

        fn connect<'a>(
            &'a self,
            _authority: &'a str,
            _limits: FrameLimits,
        ) -> BoxFuture<'a, Result<Connection, TransportError>> {
            Box::pin(async { Err(TransportError::Closed) })
        }

        fn listen<'a>(
            &'a self,
            _authority: &'a str,
            _limits: FrameLimits,
        ) -> BoxFuture<'a, Result<Box<dyn Listener>, TransportError>> {
            Box::pin(async { Err(TransportError::Closed) })
        }

        fn stats(&self) -> Vec<TransportStat> {
            vec![
                TransportStat::gauge("demo_pinned_bytes", "Bytes pinned", 4096),
                TransportStat::counter("demo_events", "Events", 2).with_label("event", "port_err"),
                TransportStat::counter("demo_events", "Events", 1)
                    .with_label("event", "port_active"),
            ]
        }
    }

    #[tokio::test]
    async fn a_transports_own_values_and_its_failed_connects_are_scraped() {
        rpc_core::transport::register(Arc::new(Reporting));
        let mut registry = Registry::default();
        TransportMetrics::register(&mut registry);
        let failed = rpc_core::Channel::connect("reporting://nowhere").await;
        assert!(failed.is_err());

        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "# TYPE rpc_transport_demo_pinned_bytes gauge\n",
            "rpc_transport_demo_pinned_bytes{scheme=\"reporting\"} 4096\n",
            "# TYPE rpc_transport_demo_events counter\n",
            "rpc_transport_demo_events_total{scheme=\"reporting\",event=\"port_err\"} 2\n",
            "rpc_transport_demo_events_total{scheme=\"reporting\",event=\"port_active\"} 1\n",
            "rpc_transport_connect_failures_total{scheme=\"reporting\"} 1\n",
            "rpc_transport_connections_opened_total{scheme=\"reporting\",side=\"client\"} 0\n",
            "rpc_transport_connections_open{scheme=\"reporting\",side=\"client\"} 0\n",
            "# TYPE rpc_transport_send_stalls counter\n",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
        assert!(
            !text.contains("rpc_transport_reconnects_total{scheme=\"reporting\",side="),
            "{text}"
        );
    }
}
