//! Fixed-size slots in a few registrations (parts), so that a connection
//! pins later parts only once its traffic needs them: the receive ring
//! (its first slots a piece of a registration the connections on its
//! protection domain share, [`FirstSlots`], each doubling allocated and
//! registered when the protocol grows the ring,
//! [`Transmit::RegisterRing`](crate::proto::Transmit::RegisterRing), and
//! deregistered when it shrinks back,
//! [`Transmit::DeregisterRing`](crate::proto::Transmit::DeregisterRing)) and
//! the send slots (every part allocated at set-up, each registered with
//! the first SEND from it too long to go inline, all deregistered once
//! idle).

use std::ops::Range;
use std::sync::OnceLock;

use super::first_slots::FirstSlots;
use crate::verbs::{Access, MemoryRegion, ProtectionDomain};

/// Most parts: the first, then doublings to the largest ring (4 slots
/// doubled to 4,096 take 10).
const MAX_PARTS: usize = 12;

/// Slots `0..slots`, each `slot_size` bytes, in parts that follow each
/// other: a part holds slots `first..first + count`, at
/// `slot_size × (slot − first)` in its memory. Local write only: the peer
/// can never write a slot.
pub(super) struct SlotMemory {
    /// In slot order; each set once, never removed while this lives.
    parts: [OnceLock<Part>; MAX_PARTS],
    slots: u32,
    slot_size: usize,
}

struct Part {
    first: u32,
    count: u32,
    memory: PartMemory,
}

/// Where a part's slots lie.
pub(super) enum PartMemory {
    /// A registration of its own, registered and deregistered as the
    /// connection's traffic needs it.
    Own(MemoryRegion),
    /// A piece of a registration shared with other connections, which
    /// stays registered while the piece is held.
    Shared(FirstSlots),
}

impl PartMemory {
    /// The registration the part lies in, and where in it the part starts.
    fn region(&self) -> (&MemoryRegion, usize) {
        match self {
            PartMemory::Own(mr) => (mr, 0),
            PartMemory::Shared(piece) => piece.region(),
        }
    }

    /// Its registration if it is its own: what registering and
    /// deregistering a part apply to.
    fn own(&self) -> Option<&MemoryRegion> {
        match self {
            PartMemory::Own(mr) => Some(mr),
            PartMemory::Shared(_) => None,
        }
    }

    /// Its length in bytes.
    fn len(&self) -> usize {
        match self {
            PartMemory::Own(mr) => mr.len(),
            PartMemory::Shared(piece) => piece.len(),
        }
    }
}

impl SlotMemory {
    /// `slots` slots of `slot_size` bytes, the first `first_slots` in
    /// `first`; the others come with [`add`](Self::add) or
    /// [`register`](Self::register).
    pub(super) fn new(
        first: PartMemory,
        first_slots: u32,
        slots: u32,
        slot_size: usize,
    ) -> SlotMemory {
        let memory = SlotMemory {
            parts: Default::default(),
            slots,
            slot_size,
        };
        memory.add(first_slots, first);
        memory
    }

    /// Adds the next `count` slots, in `memory`. Panics past the slots or
    /// the parts there are room for, or if `memory` is too short.
    pub(super) fn add(&self, count: u32, memory: PartMemory) {
        let next = self.parts.iter().position(|p| p.get().is_none());
        let first = self.end();
        assert!(
            first + count <= self.slots,
            "slots past the {} there are",
            self.slots
        );
        assert!(
            memory.len() >= count as usize * self.slot_size,
            "a part too short"
        );
        let part = Part {
            first,
            count,
            memory,
        };
        // Only the connection's state, under its lock, adds parts: never
        // two at once.
        let _ = self.parts[next.expect("room for another part")].set(part);
    }

    /// Allocates and registers slots `from..to` on `pd` as the next part,
    /// or registers them again if they are a part that exists (a ring that
    /// shrank grows into the parts it had). On an error nothing is kept.
    pub(super) fn register(
        &self,
        pd: &ProtectionDomain,
        from: u32,
        to: u32,
    ) -> Result<(), crate::verbs::Error> {
        if to <= self.end() {
            let part = self
                .parts
                .iter()
                .map_while(OnceLock::get)
                .find(|p| p.first == from)
                .expect("a ring grows by whole parts");
            assert_eq!(part.first + part.count, to, "a ring grows by whole parts");
            let mr = part
                .memory
                .own()
                .expect("a ring grows past its shared first slots");
            return mr.register();
        }
        assert_eq!(from, self.end(), "parts follow each other");
        let count = to - from;
        let mr = MemoryRegion::new(pd, count as usize * self.slot_size, Access::LOCAL_WRITE)?;
        self.add(count, PartMemory::Own(mr));
        Ok(())
    }

    /// Deregisters every part of its own (their bytes stay;
    /// `MemoryRegion::register` registers one again); returns the bytes
    /// let go. Stops at the first part the device refuses to deregister
    /// (it stays registered).
    ///
    /// # Safety
    /// As [`MemoryRegion::deregister`], for every part.
    pub(super) unsafe fn deregister(&self) -> Result<usize, crate::verbs::Error> {
        // SAFETY: as the caller guarantees.
        unsafe { self.deregister_from(0) }
    }

    /// Deregisters the parts of its own of slots `from..` (their bytes
    /// stay); returns the bytes let go. Stops at the first part the
    /// device refuses to deregister (it stays registered).
    ///
    /// # Safety
    /// As [`MemoryRegion::deregister`], for every part from `from` on: no
    /// receive posted in their slots.
    pub(super) unsafe fn deregister_from(&self, from: u32) -> Result<usize, crate::verbs::Error> {
        let mut released = 0;
        let parts = self.parts.iter().map_while(OnceLock::get);
        for mr in parts
            .filter(|p| p.first >= from)
            .filter_map(|p| p.memory.own())
        {
            if mr.is_registered() {
                // SAFETY: as the caller guarantees.
                unsafe { mr.deregister()? };
                released += mr.len();
            }
        }
        Ok(released)
    }

    /// The slots that exist: `0..end`.
    fn end(&self) -> u32 {
        self.parts
            .iter()
            .map_while(OnceLock::get)
            .last()
            .map_or(0, |p| p.first + p.count)
    }

    /// Whether `slot`'s memory exists.
    pub(super) fn has(&self, slot: u32) -> bool {
        slot < self.end()
    }

    pub(super) fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// The memory of `slot` and the slot's bytes in it. Panics for a slot
    /// whose part does not exist yet (the protocol uses those only once
    /// they do).
    pub(super) fn slot(&self, slot: u32) -> (&MemoryRegion, Range<usize>) {
        let part = self
            .parts
            .iter()
            .map_while(OnceLock::get)
            .find(|p| slot < p.first + p.count)
            .expect("a slot is used only once its part exists");
        let (mr, part_start) = part.memory.region();
        let start = part_start + (slot - part.first) as usize * self.slot_size;
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
