//! The receive ring's memory: its first slots registered at set-up, the
//! rest allocated and registered when the protocol grows the ring
//! ([`Transmit::RegisterRing`](crate::proto::Transmit::RegisterRing)), so
//! an idle connection pins only its first slots.

use std::ops::Range;
use std::sync::OnceLock;

use crate::verbs::{Access, MemoryRegion, ProtectionDomain};

/// Slots `0..first_slots` live in `first`, the others in `rest`, each
/// `slot_size` bytes at `slot_size × (slot − start)`. Local write only:
/// the peer can never write a slot, only SEND into a posted one.
pub(super) struct RingMemory {
    first: MemoryRegion,
    /// Slots `first_slots..slots`: set once, registered, when the ring
    /// grows.
    rest: OnceLock<MemoryRegion>,
    first_slots: u32,
    slots: u32,
    slot_size: usize,
}

impl RingMemory {
    /// The ring's first `first_slots` slots, registered on `pd`; the other
    /// `slots - first_slots` come with [`register_rest`](Self::register_rest).
    pub(super) fn new(
        pd: &ProtectionDomain,
        slots: u32,
        first_slots: u32,
        slot_size: usize,
    ) -> Result<RingMemory, crate::verbs::Error> {
        debug_assert!(first_slots <= slots);
        Ok(RingMemory {
            first: MemoryRegion::new(pd, first_slots as usize * slot_size, Access::LOCAL_WRITE)?,
            rest: OnceLock::new(),
            first_slots,
            slots,
            slot_size,
        })
    }

    /// Allocates and registers the slots after the first (once; a second
    /// call finds them registered). On an error nothing is kept, and the
    /// ring stays at its first slots.
    pub(super) fn register_rest(&self, pd: &ProtectionDomain) -> Result<(), crate::verbs::Error> {
        if self.rest.get().is_none() {
            let len = (self.slots - self.first_slots) as usize * self.slot_size;
            let rest = MemoryRegion::new(pd, len, Access::LOCAL_WRITE)?;
            // Only the connection's state, under its lock, registers it:
            // never two at once.
            let _ = self.rest.set(rest);
        }
        Ok(())
    }

    /// The ring's slot count, grown or not (the receive slots a completion
    /// may name).
    pub(super) fn slots(&self) -> u32 {
        self.slots
    }

    pub(super) fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// The memory of `slot` and its bytes in it. Panics for a slot after
    /// the first ones before [`register_rest`](Self::register_rest): the
    /// protocol posts those only once registered.
    pub(super) fn slot(&self, slot: u32) -> (&MemoryRegion, Range<usize>) {
        let (mr, index) = if slot < self.first_slots {
            (&self.first, slot)
        } else {
            let rest = self
                .rest
                .get()
                .expect("a slot after the first ones is used only once registered");
            (rest, slot - self.first_slots)
        };
        let start = index as usize * self.slot_size;
        (mr, start..start + self.slot_size)
    }

    /// Copies `dst.len()` bytes of `slot` from byte `offset` (a raw copy).
    pub(super) fn read_into(&self, slot: u32, offset: usize, dst: &mut [u8]) {
        let (mr, range) = self.slot(slot);
        assert!(offset + dst.len() <= range.len(), "read past a slot");
        mr.read_into(range.start + offset, dst);
    }

    /// Bytes `within` of `slot`, borrowed. Panics past the slot.
    ///
    /// # Safety
    /// As [`MemoryRegion::slice`]: while the slice lives, no receive may be
    /// posted into the slot.
    pub(super) unsafe fn slice(&self, slot: u32, within: Range<usize>) -> &[u8] {
        let (mr, range) = self.slot(slot);
        assert!(within.end <= range.len(), "slice past a slot");
        // SAFETY: as the caller guarantees; the range lies in the slot.
        unsafe { mr.slice(range.start + within.start..range.start + within.end) }
    }
}
