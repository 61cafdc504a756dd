//! The live connections, with where each sits on its device: what device
//! async events ([`crate::device_events`]) fail, whom the connection
//! manager's events on a device's shared channel are about, and what the
//! debugging dump shows. Connections register themselves as [`LiveConnection`]s, so
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
    /// Its `cm_id`'s address ([`CmId::addr`]).
    pub(crate) cm_id: usize,
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
            cm_id: id.addr(),
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
    /// The connection manager reported the connection's end (`event`
    /// names it): its driver takes what arrived before it, then ends it.
    fn end_from_cm_event(&self, event: &str);
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

/// Ends the connection whose `cm_id` is at `cm_id` ([`CmId::addr`]) for
/// the connection manager's `event`; false if it is gone. The newest
/// entry with that address is the one: an id's address is reused only
/// once it was destroyed (with its unread events), which a failed
/// connection's halves may outlive, and the id that reuses it registers
/// its connection after.
pub(crate) fn end_by_cm_event(cm_id: usize, event: &str) -> bool {
    let hit = LIVE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .rev()
        .find(|(_, placement)| placement.cm_id == cm_id)
        .and_then(|(connection, _)| connection.upgrade());
    hit.map(|connection| connection.end_from_cm_event(event))
        .is_some()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{CqId, DeviceId};
    use std::sync::Arc;

    /// Records the connection manager event that ended it.
    #[derive(Default)]
    struct Recorder(Mutex<Option<String>>);

    impl LiveConnection for Recorder {
        fn fail_from_device(&self, _: &str) -> bool {
            false
        }
        fn end_from_cm_event(&self, event: &str) {
            *self.0.lock().unwrap() = Some(event.to_string());
        }
        fn summary(&self) -> String {
            String::new()
        }
    }

    fn register(connection: &Arc<Recorder>, cm_id: usize) {
        let live: Arc<dyn LiveConnection> = Arc::clone(connection) as _;
        add(
            Arc::downgrade(&live),
            Placement {
                device: DeviceId(0x3000),
                port: 1,
                qp_num: 0x21,
                cq: CqId(0xd0),
                cm_id,
            },
        );
    }

    #[test]
    fn a_cm_event_ends_the_newest_connection_at_its_ids_address() {
        const ID: usize = 0x7e57_0000;
        // A failed connection whose halves outlive its destroyed id, and
        // the connection whose id now has the same address.
        let failed = Arc::new(Recorder::default());
        let current = Arc::new(Recorder::default());
        register(&failed, ID);
        register(&current, ID);
        assert!(end_by_cm_event(ID, "RDMA_CM_EVENT_DISCONNECTED"));
        assert_eq!(
            current.0.lock().unwrap().as_deref(),
            Some("RDMA_CM_EVENT_DISCONNECTED")
        );
        assert_eq!(*failed.0.lock().unwrap(), None);
        // An id no connection has: nothing ended.
        assert!(!end_by_cm_event(ID + 8, "RDMA_CM_EVENT_DISCONNECTED"));
    }
}
