//! The free send slots of a connection, handed out lowest first.
//!
//! The verbs layer registers send slots in parts (the first 8, then
//! doublings), each with the first SEND from it too long to go inline. A
//! sender that takes the lowest free slot uses slots `0..n` for `n`
//! messages in flight, so it pins only the parts its traffic needs, in
//! order. (A stack of freed slots does not: completions reorder it, and 16
//! messages in flight could take slot 40 and register the 32-slot part.)

/// A set of slot numbers `0..len`, taken lowest first.
#[derive(Debug, Clone)]
pub(super) struct FreeSlots {
    /// Bit `s % 64` of word `s / 64` is set when slot `s` is free.
    words: Vec<u64>,
    free: u32,
}

impl FreeSlots {
    /// Slots `0..len`, all free.
    pub(super) fn all(len: u32) -> FreeSlots {
        let mut words = vec![u64::MAX; len.div_ceil(64) as usize];
        if len % 64 != 0 {
            *words.last_mut().expect("len > 0") = (1 << (len % 64)) - 1;
        }
        FreeSlots { words, free: len }
    }

    /// Takes the lowest free slot, if any.
    pub(super) fn take(&mut self) -> Option<u32> {
        let (i, word) = self.words.iter_mut().enumerate().find(|(_, w)| **w != 0)?;
        let bit = word.trailing_zeros();
        *word &= !(1 << bit);
        self.free -= 1;
        Some(i as u32 * 64 + bit)
    }

    /// Gives `slot` back. Panics if it is free already (a slot released
    /// twice would be handed to two messages).
    pub(super) fn put(&mut self, slot: u32) {
        let word = &mut self.words[(slot / 64) as usize];
        let bit = 1 << (slot % 64);
        assert!(*word & bit == 0, "send slot {slot} released twice");
        *word |= bit;
        self.free += 1;
    }

    /// How many are free.
    pub(super) fn len(&self) -> u32 {
        self.free
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_taken_lowest_first_whatever_order_they_come_back_in() {
        let mut free = FreeSlots::all(130);
        let taken: Vec<u32> = (0..20).map(|_| free.take().unwrap()).collect();
        assert_eq!(taken, (0..20).collect::<Vec<_>>());
        // Completions give back 19, 3, 11 (a stack would hand out 11 next).
        for s in [19, 3, 11] {
            free.put(s);
        }
        assert_eq!(
            [free.take(), free.take(), free.take(), free.take()],
            [Some(3), Some(11), Some(19), Some(20)]
        );
        assert_eq!(free.len(), 130 - 21);
    }

    #[test]
    fn every_slot_once_then_none() {
        for len in [1, 63, 64, 65, 128, 200] {
            let mut free = FreeSlots::all(len);
            let taken: Vec<u32> = std::iter::from_fn(|| free.take()).collect();
            assert_eq!(taken, (0..len).collect::<Vec<_>>(), "{len} slots");
            assert_eq!(free.len(), 0);
            free.put(len - 1);
            assert_eq!(free.take(), Some(len - 1));
        }
    }

    #[test]
    #[should_panic(expected = "send slot 5 released twice")]
    fn a_slot_released_twice_is_a_bug_caught() {
        let mut free = FreeSlots::all(8);
        free.put(5);
    }
}
