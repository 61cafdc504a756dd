//! The live connections, with where each sits on its device: what device
//! async events ([`crate::device_events`]) fail, and what the debugging
//! dump shows. Connections register themselves as [`LiveConnection`]s, so
//! neither the events nor this registry depend on the connection's module.

use std::sync::{Mutex, Weak};

use crate::verbs::{CmId, CompletionQueue, CqId, DeviceId, QueuePair};

/// The connections an event fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// The one that owns this queue pair.
    Qp(u32),
    /// The one that owns this completion queue.
    Cq(CqId),
    /// Every connection on this port of the device.
    Port(u8),
    /// Every connection on the device.
    Device,
}

/// Where a connection sits on its device: what async events name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) device: DeviceId,
    pub(crate) port: u8,
    pub(crate) qp_num: u32,
    pub(crate) cq: CqId,
}

impl Placement {
    /// The placement of the connection of `id`, `qp` and `cq`.
    pub(crate) fn of(
        id: &CmId,
        qp: &QueuePair,
        cq: &CompletionQueue,
    ) -> Result<Placement, crate::verbs::Error> {
        Ok(Placement {
            device: id.device_id()?,
            port: id.port_num(),
            qp_num: qp.qp_num(),
            cq: cq.id(),
        })
    }

    /// Whether an event of `device` aimed at `target` fails this connection.
    pub(crate) fn is_hit(&self, device: DeviceId, target: Target) -> bool {
        self.device == device
            && match target {
                Target::Qp(qp) => self.qp_num == qp,
                Target::Cq(cq) => self.cq == cq,
                Target::Port(port) => self.port == port,
                Target::Device => true,
            }
    }
}

/// A registered connection, as device events and the debugging dump see it.
pub(crate) trait LiveConnection: Send + Sync {
    /// Fails the connection for a device event; false if it had failed
    /// already.
    fn fail_from_device(&self, reason: &str) -> bool;
    /// One line about its protocol state.
    fn summary(&self) -> String;
}

/// Every connection started; dead entries are swept at each addition.
static LIVE: Mutex<Vec<(Weak<dyn LiveConnection>, Placement)>> = Mutex::new(Vec::new());

/// Registers a started connection.
pub(crate) fn add(connection: Weak<dyn LiveConnection>, placement: Placement) {
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|(w, _)| w.strong_count() > 0);
    live.push((connection, placement));
}

/// Fails the live connections on `device` that `target` names (an async
/// event's, see [`crate::device_events`]); returns how many were not failed
/// yet.
pub(crate) fn fail_on_device(device: DeviceId, target: Target, reason: &str) -> usize {
    let hit: Vec<_> = LIVE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(_, placement)| placement.is_hit(device, target))
        .filter_map(|(connection, _)| connection.upgrade())
        .collect();
    hit.iter()
        .filter(|connection| connection.fail_from_device(reason))
        .count()
}

/// A summary of every live connection's protocol state, for debugging stalls.
pub(crate) fn debug_dump() -> String {
    let live: Vec<_> = LIVE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(|(connection, _)| connection.upgrade())
        .collect();
    live.iter().map(|c| c.summary() + "\n").collect()
}
