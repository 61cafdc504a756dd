//! Fixed-size slots in two registrations, the first ones and the rest, so
//! that a connection pins the rest only once its traffic needs them: the
//! receive ring (its first slots registered at set-up, the rest allocated
//! and registered when the protocol grows the ring,
//! [`Transmit::RegisterRing`](crate::proto::Transmit::RegisterRing)) and
//! the send slots (each part registered with the first SEND from it too
//! long to go inline).

use std::ops::Range;
use std::sync::OnceLock;

use crate::verbs::{Access, MemoryRegion, ProtectionDomain};

/// Slots `0..first_slots` live in `first`, the others in `rest`, each
/// `slot_size` bytes at `slot_size × (slot − start)`. Local write only:
/// the peer can never write a slot.
pub(super) struct SlotMemory {
    first: MemoryRegion,
    /// Slots `first_slots..slots`, once they exist.
    rest: OnceLock<MemoryRegion>,
    first_slots: u32,
    slots: u32,
    slot_size: usize,
}

impl SlotMemory {
    /// `slots` slots of `slot_size` bytes, the first `first_slots` in
    /// `first`, the others in `rest` (or, when `None`, in what
    /// [`register_rest`](Self::register_rest) makes).
    pub(super) fn new(
        first: MemoryRegion,
        rest: Option<MemoryRegion>,
        first_slots: u32,
        slots: u32,
        slot_size: usize,
    ) -> SlotMemory {
        debug_assert!(first_slots <= slots);
        debug_assert!(first.len() >= first_slots as usize * slot_size);
        SlotMemory {
            first,
            rest: rest.map(OnceLock::from).unwrap_or_default(),
            first_slots,
            slots,
            slot_size,
        }
    }

    /// Allocates and registers the slots after the first on `pd` (once; a
    /// second call finds them). On an error nothing is kept.
    pub(super) fn register_rest(&self, pd: &ProtectionDomain) -> Result<(), crate::verbs::Error> {
        if self.rest.get().is_none() {
            let len = (self.slots - self.first_slots) as usize * self.slot_size;
            let rest = MemoryRegion::new(pd, len, Access::LOCAL_WRITE)?;
            // Only the connection's state, under its lock, makes it:
            // never two at once.
            let _ = self.rest.set(rest);
        }
        Ok(())
    }

    /// Whether `slot`'s memory exists (a first slot, or one of the rest
    /// once they do).
    pub(super) fn has(&self, slot: u32) -> bool {
        slot < self.first_slots || (slot < self.slots && self.rest.get().is_some())
    }

    pub(super) fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// The memory of `slot` and the slot's bytes in it. Panics for a slot
    /// after the first ones before they exist (the protocol uses those
    /// only once they do).
    pub(super) fn slot(&self, slot: u32) -> (&MemoryRegion, Range<usize>) {
        let (mr, index) = if slot < self.first_slots {
            (&self.first, slot)
        } else {
            let rest = self
                .rest
                .get()
                .expect("a slot after the first ones is used only once they exist");
            (rest, slot - self.first_slots)
        };
        let start = index as usize * self.slot_size;
        (mr, start..start + self.slot_size)
    }

    /// Bytes `within` of `slot`, in their memory. Panics past the slot.
    fn bytes(&self, slot: u32, within: Range<usize>) -> (&MemoryRegion, Range<usize>) {
        let (mr, range) = self.slot(slot);
        assert!(within.end <= range.len(), "bytes past a slot");
        (mr, range.start + within.start..range.start + within.end)
    }

    /// Copies `dst.len()` bytes of `slot` from byte `offset` (a raw copy).
    pub(super) fn read_into(&self, slot: u32, offset: usize, dst: &mut [u8]) {
        let (mr, range) = self.bytes(slot, offset..offset + dst.len());
        mr.read_into(range.start, dst);
    }

    /// Bytes `within` of `slot`, borrowed. Panics past the slot.
    ///
    /// # Safety
    /// As [`MemoryRegion::slice`]: while the slice lives, nothing may write
    /// these bytes (no receive posted into the slot, no mutable slice).
    pub(super) unsafe fn slice(&self, slot: u32, within: Range<usize>) -> &[u8] {
        let (mr, range) = self.bytes(slot, within);
        // SAFETY: as the caller guarantees.
        unsafe { mr.slice(range) }
    }

    /// Bytes `within` of `slot`, mutably borrowed. Panics past the slot.
    ///
    /// # Safety
    /// As [`MemoryRegion::slice_mut`]: while the slice lives, nothing else
    /// may read or write these bytes (no posted work request, no other
    /// slice).
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slice_mut(&self, slot: u32, within: Range<usize>) -> &mut [u8] {
        let (mr, range) = self.bytes(slot, within);
        // SAFETY: as the caller guarantees.
        unsafe { mr.slice_mut(range) }
    }
}
