//! Admission control of a listener: what it lets a connecting client cost,
//! checked from the client's hello before anything is allocated for it.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use crate::conn::RendezvousPool;
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
    /// The rendezvous pool the connections share, if they read rendezvous
    /// transfers: pinned once, whatever their number.
    pool: Option<Arc<RendezvousPool>>,
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
    pub(crate) fn new(
        limits: AdmissionLimits,
        pool: Option<Arc<RendezvousPool>>,
    ) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            counts: Mutex::new(Counts::default()),
            pool,
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
        let pool = self.pool.as_ref().map_or(0, |p| p.budget());
        if counts.pinned.saturating_add(pool).saturating_add(pinned) > limits.max_pinned {
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

/// An address or a network (`10.0.0.5`, `10.0.0.0/24`) on a listener's
/// allow-list (see [`RdmaTransport::allow_peers`]).
///
/// [`RdmaTransport::allow_peers`]: crate::RdmaTransport::allow_peers
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpPrefix {
    addr: IpAddr,
    len: u8,
}

impl IpPrefix {
    /// Whether `ip` lies in this prefix.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl std::str::FromStr for IpPrefix {
    type Err = String;

    fn from_str(s: &str) -> Result<IpPrefix, String> {
        let bad =
            |why: &str| format!("{s:?} is not an address or a network like 10.0.0.0/24: {why}");
        let (addr, len) = match s.split_once('/') {
            Some((addr, len)) => (addr, Some(len)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|e| bad(&format!("{e}")))?;
        let addr = addr.to_canonical();
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => max,
            Some(len) => len
                .parse::<u8>()
                .ok()
                .filter(|&len| len <= max)
                .ok_or_else(|| bad(&format!("the prefix length is not 0..={max}")))?,
        };
        Ok(IpPrefix { addr, len })
    }
}

impl std::fmt::Display for IpPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_parse_and_match() {
        let net: IpPrefix = "10.77.0.0/16".parse().unwrap();
        assert!(net.contains("10.77.3.4".parse().unwrap()));
        assert!(!net.contains("10.78.0.1".parse().unwrap()));
        assert!(
            net.contains("::ffff:10.77.0.9".parse().unwrap()),
            "IPv4-mapped"
        );
        let one: IpPrefix = "10.77.0.2".parse().unwrap();
        assert_eq!(one.to_string(), "10.77.0.2/32");
        assert!(one.contains("10.77.0.2".parse().unwrap()));
        assert!(!one.contains("10.77.0.3".parse().unwrap()));
        let all: IpPrefix = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("192.168.1.1".parse().unwrap()));
        assert!(!all.contains("fe80::1".parse().unwrap()));
        let v6: IpPrefix = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        for bad in [
            "10.0.0.0/33",
            "10.0.0/8",
            "host",
            "10.0.0.0/x",
            "fd00::/129",
        ] {
            let err = bad.parse::<IpPrefix>().unwrap_err();
            assert!(err.contains(bad), "{err}");
        }
    }

    fn admission(max_connections: usize, max_handshakes: usize, max_pinned: u64) -> Arc<Admission> {
        let limits = AdmissionLimits {
            max_connections,
            max_handshakes,
            max_pinned,
        };
        Admission::new(limits, None)
    }

    #[test]
    fn the_shared_rendezvous_pool_is_counted_once() {
        let limits = AdmissionLimits {
            max_connections: 100,
            max_handshakes: 100,
            max_pinned: 1000,
        };
        let pool = Arc::new(RendezvousPool::new(400));
        let a = Admission::new(limits, Some(Arc::clone(&pool)));
        // 400 for the pool, then 200 a connection: three fit, not four.
        let leases: Vec<_> = (0..3).map(|_| a.admit(200).unwrap()).collect();
        assert_eq!(
            a.admit(200).unwrap_err(),
            Refused::OverPinnedBudget { limit: 1000 }
        );
        drop(leases);
        // A pool raised to fit a larger frame limit counts as raised.
        pool.fit(900);
        let _held = a.admit(100).unwrap();
        assert_eq!(
            a.admit(1).unwrap_err(),
            Refused::OverPinnedBudget { limit: 1000 }
        );
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
