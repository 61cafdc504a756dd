//! Send credits and receive-slot accounting.

use super::ProtocolError;

/// The sender's credits: one per receive slot known free at the peer.
///
/// Data messages keep the last credit in reserve, so a `Credit` or `Close`
/// message can always go: two peers that both wait for credits can always
/// tell each other about the slots they freed.
#[derive(Debug, Clone)]
pub struct CreditWindow {
    credits: u32,
    limit: u32,
}

impl CreditWindow {
    /// Starts with `initial` credits (the slots the peer posted at first)
    /// of a ring of `slots`: the peer posts the rest as our traffic needs
    /// them, and returns them as credits then.
    pub fn new(initial: u32, slots: u32) -> CreditWindow {
        debug_assert!(initial <= slots);
        CreditWindow {
            credits: initial,
            limit: slots,
        }
    }

    /// Credits held now.
    pub fn available(&self) -> u32 {
        self.credits
    }

    /// The peer's ring size.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Takes a credit for a data message (`Inline` or `Chunk`), keeping one
    /// in reserve; false when there is none to take.
    #[must_use]
    pub fn take_data(&mut self) -> bool {
        if self.credits >= 2 {
            self.credits -= 1;
            true
        } else {
            false
        }
    }

    /// Takes a credit for a control message (`Credit`, `Close`), the
    /// reserved one included.
    #[must_use]
    pub fn take_control(&mut self) -> bool {
        if self.credits >= 1 {
            self.credits -= 1;
            true
        } else {
            false
        }
    }

    /// The peer returned `n` slots. More credits than the ring has slots is
    /// a protocol violation.
    pub fn grant(&mut self, n: u16) -> Result<(), ProtocolError> {
        let credits = self.credits + u32::from(n);
        if credits > self.limit {
            return Err(ProtocolError::new(format!(
                "peer returned {n} credits while {} of its {} slots were already free",
                self.credits, self.limit
            )));
        }
        self.credits = credits;
        Ok(())
    }
}

/// How a received inline frame goes up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// As `Bytes` pointing into the slot; the slot is reposted when it drops.
    ZeroCopy,
    /// Copied out, so the slot can be reposted at once (the application
    /// already holds many slots).
    Copy,
}

/// The receiver's view of its ring of posted receive slots.
///
/// Each slot in use is: posted (free for the peer), or *outstanding*:
/// consumed by a message and not yet returned to the peer as a credit
/// (being handled, held by the application, or reposted and waiting to be
/// reported).
///
/// The ring starts with a few slots in use (what an idle connection pins)
/// and doubles them, up to all of its slots, each time the peer's traffic
/// keeps half of those consumed ([`wants_growth`](Self::wants_growth),
/// [`grow`](Self::grow)): memory follows the calls a peer keeps in
/// flight, and the new slots go to it as credits it never had.
///
/// A grown ring shrinks back to its first slots once the peer's traffic
/// would not have grown them ([`shrink`](Self::shrink)): each slot past
/// the first ones is *retired* when its message is handled, neither
/// reposted nor returned as a credit, so the peer's window shrinks with
/// it; once all are retired their memory can go.
#[derive(Debug, Clone)]
pub struct RecvRing {
    /// Slots in use: the peer's window.
    slots: u32,
    /// The slots posted at first, which a shrink keeps.
    first: u32,
    /// The whole ring.
    max_slots: u32,
    /// Slots past the first ones not yet retired, while shrinking.
    retiring: u32,
    /// The most slots consumed and not yet reposted at once since the
    /// last [`shrink_due`](Self::shrink_due).
    peak: u32,
    /// Slots added by [`grow`](Self::grow), posted and not yet reported.
    fresh: u32,
    /// Slots consumed and not yet returned as credits.
    outstanding: u32,
    /// Of those, held by the application (zero-copy frames).
    held: u32,
    /// Of those, reposted and not yet reported to the peer.
    pending: u32,
}

impl RecvRing {
    /// A ring of `max_slots` slots of which the first `slots` (at least
    /// 4) are posted.
    pub fn new(slots: u32, max_slots: u32) -> RecvRing {
        assert!(
            (4..=max_slots).contains(&slots),
            "a receive ring starts with 4 to all of its {max_slots} slots, not {slots}"
        );
        RecvRing {
            slots,
            first: slots,
            max_slots,
            retiring: 0,
            peak: 0,
            fresh: 0,
            outstanding: 0,
            held: 0,
            pending: 0,
        }
    }

    /// Slots in use (posted or outstanding).
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Whether more slots than the first ones are in use.
    pub fn grown(&self) -> bool {
        self.slots > self.first
    }

    /// Whether to grow the ring: the peer has half of the slots in use
    /// consumed (it keeps that many messages unanswered).
    pub fn wants_growth(&self) -> bool {
        self.retiring == 0 && self.slots < self.max_slots && self.outstanding >= self.slots / 2
    }

    /// The slots [`grow`](Self::grow) would take into use next: as many
    /// again as are in use, up to the whole ring.
    pub fn next_growth(&self) -> std::ops::Range<u32> {
        debug_assert_eq!(self.retiring, 0, "no growth while shrinking");
        self.slots..(2 * self.slots).min(self.max_slots)
    }

    /// Takes the slots of [`next_growth`](Self::next_growth) into use and
    /// returns them, to post. They go to the peer as credits with the next
    /// message.
    pub fn grow(&mut self) -> std::ops::Range<u32> {
        let new = self.next_growth();
        self.fresh += new.len() as u32;
        self.slots = new.end;
        new
    }

    /// Slots added by [`grow`](Self::grow) and not yet reported.
    pub fn fresh(&self) -> u32 {
        self.fresh
    }

    /// Slots held by the application.
    pub fn held(&self) -> u32 {
        self.held
    }

    /// Slots consumed and not yet returned to the peer.
    pub fn outstanding(&self) -> u32 {
        self.outstanding
    }

    /// A message arrived in a slot. An arrival while every slot is
    /// outstanding means the peer sent without a credit.
    pub fn on_arrival(&mut self) -> Result<(), ProtocolError> {
        if self.outstanding >= self.slots {
            return Err(ProtocolError::new(
                "peer sent a message without a credit (receive ring overrun)",
            ));
        }
        self.outstanding += 1;
        self.peak = self.peak.max(self.outstanding - self.pending);
        Ok(())
    }

    /// Whether to [`shrink`](Self::shrink), asked at each idle check: the
    /// ring has grown, and since the last check the peer's messages were
    /// never half of the first slots at once (consumed and not yet
    /// reposted), so the first slots would have done.
    pub fn shrink_due(&mut self) -> bool {
        let peak = std::mem::replace(&mut self.peak, self.outstanding - self.pending);
        self.shrinkable() && peak < self.first / 2
    }

    /// Grown, not shrinking already, and every growth reported.
    fn shrinkable(&self) -> bool {
        self.slots > self.first && self.retiring == 0 && self.fresh == 0
    }

    /// Starts retiring every slot past the first ones: from now on
    /// [`retires`](Self::retires) tells which slots to retire instead of
    /// reposting. Returns how many receives are posted now: once the peer
    /// sent that many more messages, each of them was consumed (receives
    /// complete in the order they were posted), so every slot to retire
    /// came back. Panics if there is nothing to shrink, or growth is
    /// unreported.
    pub fn shrink(&mut self) -> u32 {
        assert!(
            self.shrinkable(),
            "a shrink of a ring not grown ({} of {} first slots), shrinking ({} left) \
             or with growth unreported ({})",
            self.slots,
            self.first,
            self.retiring,
            self.fresh
        );
        self.retiring = self.slots - self.first;
        self.slots - self.outstanding + self.pending
    }

    /// Whether `slot` is to be retired (not reposted) once handled.
    pub fn retires(&self, slot: u32) -> bool {
        self.retiring > 0 && slot >= self.first
    }

    /// A consumed slot to retire was handled (or, with `released`, its
    /// zero-copy frame dropped): it leaves the ring and the peer's window.
    /// Returns whether it was the last one to retire: the ring is back to
    /// its first slots.
    pub fn on_retired(&mut self, released: bool) -> bool {
        debug_assert!(self.retiring > 0 && self.outstanding > 0);
        if released {
            debug_assert!(self.held > 0);
            self.held -= 1;
        }
        self.outstanding -= 1;
        self.slots -= 1;
        self.retiring -= 1;
        self.retiring == 0
    }

    /// Slots still to retire (0 unless shrinking).
    pub fn retiring(&self) -> u32 {
        self.retiring
    }

    /// How the inline frame that just arrived goes up: zero-copy while the
    /// application holds fewer than half the slots, copied above that, so a
    /// consumer that keeps its frames never stalls the connection.
    pub fn deliver(&mut self) -> Delivery {
        if self.held < self.slots / 2 {
            self.held += 1;
            Delivery::ZeroCopy
        } else {
            Delivery::Copy
        }
    }

    /// The application dropped a zero-copy frame and its slot was reposted.
    pub fn on_released(&mut self) {
        debug_assert!(self.held > 0);
        self.held -= 1;
        self.pending += 1;
    }

    /// A slot whose message was handled (copied out, or a control or chunk
    /// message) was reposted.
    pub fn on_reposted(&mut self) {
        self.pending += 1;
    }

    /// Takes the credits to return with the next message (piggybacked or
    /// a `Credit` message).
    pub fn take_credits(&mut self) -> u16 {
        let reposted = self.pending.min(u32::from(u16::MAX));
        self.pending -= reposted;
        self.outstanding -= reposted;
        let fresh = self.fresh.min(u32::from(u16::MAX) - reposted);
        self.fresh -= fresh;
        (reposted + fresh) as u16
    }

    /// Credits reposted or added by growth, and not yet reported.
    pub fn pending(&self) -> u32 {
        self.pending + self.fresh
    }

    /// Whether to send a `Credit` message now, with no data to carry the
    /// credits: when the ring just grew (the peer is likely waiting for
    /// credits), the peer may be running low (a quarter of the slots in
    /// use or less left to it) or half of them wait to be reported.
    pub fn wants_credit_message(&self) -> bool {
        self.fresh > 0
            || self.pending > 0
                && (self.slots - self.outstanding <= self.slots / 4
                    || self.pending >= self.slots / 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_keeps_one_credit_for_control() {
        let mut w = CreditWindow::new(8, 8);
        for _ in 0..7 {
            assert!(w.take_data());
        }
        assert!(!w.take_data());
        assert!(w.take_control());
        assert!(!w.take_control());
        w.grant(8).unwrap();
        assert!(w.grant(1).is_err(), "over the ring size");
    }

    #[test]
    fn ring_overrun_is_a_protocol_error() {
        let mut r = RecvRing::new(8, 8);
        for _ in 0..8 {
            r.on_arrival().unwrap();
        }
        assert!(r.on_arrival().is_err());
    }

    #[test]
    fn copies_once_half_is_held() {
        let mut r = RecvRing::new(8, 8);
        for _ in 0..4 {
            r.on_arrival().unwrap();
            assert_eq!(r.deliver(), Delivery::ZeroCopy);
        }
        r.on_arrival().unwrap();
        assert_eq!(r.deliver(), Delivery::Copy);
        r.on_reposted();
        assert_eq!(r.take_credits(), 1);
        r.on_released();
        assert_eq!(r.held(), 3);
        assert_eq!(r.take_credits(), 1);
        assert_eq!(r.outstanding(), 3);
    }

    #[test]
    fn credit_message_when_peer_runs_low() {
        let mut r = RecvRing::new(16, 16);
        for _ in 0..11 {
            r.on_arrival().unwrap();
            r.on_reposted();
        }
        // 5 left to the peer: above a quarter, and 11 pending >= half.
        assert!(r.wants_credit_message());
        assert_eq!(r.take_credits(), 11);
        assert!(!r.wants_credit_message());
        for _ in 0..12 {
            r.on_arrival().unwrap();
        }
        r.on_reposted();
        assert!(r.wants_credit_message(), "4 left to the peer");
    }

    #[test]
    fn a_ring_grows_once_the_peer_fills_half_its_first_slots() {
        let mut r = RecvRing::new(8, 64);
        let mut w = CreditWindow::new(8, 64);
        // One call at a time: a slot is consumed and returned.
        for _ in 0..20 {
            assert!(w.take_data());
            r.on_arrival().unwrap();
            assert!(!r.wants_growth());
            r.on_reposted();
            w.grant(r.take_credits()).unwrap();
        }
        assert_eq!(w.available(), 8);
        // Four at once: half of the first slots.
        for _ in 0..4 {
            assert!(w.take_data());
            r.on_arrival().unwrap();
        }
        assert!(r.wants_growth());
        assert_eq!(r.grow(), 8..16);
        assert!(!r.wants_growth(), "4 of 16");
        assert_eq!(r.slots(), 16);
        assert!(r.wants_credit_message(), "the new slots go at once");
        assert_eq!(r.pending(), 8);
        w.grant(r.take_credits()).unwrap();
        assert_eq!(w.available(), 12, "4 still in flight");
        assert!(!r.wants_credit_message());
        // The four come back as any other.
        for _ in 0..4 {
            r.on_reposted();
        }
        w.grant(r.take_credits()).unwrap();
        assert_eq!(w.available(), 16);
        assert_eq!(r.outstanding(), 0);
        // Doubling again as the peer keeps more in flight, to the whole
        // ring and no further.
        for (unanswered, grown) in [(8, 16..32), (16, 32..64)] {
            for _ in 0..unanswered {
                assert!(w.take_data());
                r.on_arrival().unwrap();
            }
            assert!(r.wants_growth());
            assert_eq!(r.grow(), grown);
            for _ in 0..unanswered {
                r.on_reposted();
            }
            w.grant(r.take_credits()).unwrap();
        }
        assert_eq!(w.available(), 64);
        for _ in 0..63 {
            assert!(w.take_data() || w.take_control());
            r.on_arrival().unwrap();
        }
        assert!(!r.wants_growth(), "the whole ring is in use");
        for _ in 0..63 {
            r.on_reposted();
        }
        w.grant(r.take_credits()).unwrap();
        assert!(w.grant(1).is_err(), "over the whole ring");
    }

    #[test]
    fn a_grown_ring_shrinks_once_a_check_finds_the_peer_quiet() {
        let mut r = RecvRing::new(4, 16);
        assert!(!r.shrink_due(), "not grown");
        for _ in 0..2 {
            r.on_arrival().unwrap();
        }
        assert_eq!(r.grow(), 4..8);
        assert_eq!(r.take_credits(), 4);
        // Handled and reposted, the credits not yet returned.
        for _ in 0..2 {
            r.on_reposted();
        }
        assert!(!r.shrink_due(), "two consumed at once since the last check");
        r.on_arrival().unwrap();
        r.on_reposted();
        assert!(r.shrink_due(), "one at a time since the last check");
        // Receives posted: 8 slots, 3 reposted not yet reported among
        // them; the peer must send 8 messages to consume them all.
        assert_eq!(r.shrink(), 8);
        assert!(!r.shrink_due(), "already shrinking");
        assert!(!r.wants_growth());
        assert!(r.retires(4) && r.retires(7) && !r.retires(3));
        assert_eq!(r.take_credits(), 3);
        for slot in [0, 5, 6, 1, 4] {
            r.on_arrival().unwrap();
            if r.retires(slot) {
                assert!(!r.on_retired(false));
            } else {
                r.on_reposted();
            }
        }
        assert_eq!((r.slots(), r.retiring()), (5, 1));
        r.on_arrival().unwrap();
        assert_eq!(r.deliver(), Delivery::ZeroCopy);
        assert!(r.on_retired(true), "slot 7, released: the last");
        assert_eq!((r.slots(), r.retiring(), r.held()), (4, 0, 0));
        assert!(!r.retires(7));
        assert_eq!(r.take_credits(), 2, "the first slots' only");
        assert_eq!(r.outstanding(), 0);
        assert_eq!(r.next_growth(), 4..8);
    }

    #[test]
    fn a_grown_ring_is_overrun_only_past_all_its_slots() {
        let mut r = RecvRing::new(4, 8);
        for _ in 0..4 {
            r.on_arrival().unwrap();
        }
        assert!(r.on_arrival().is_err(), "the peer had 4 credits");
        let mut r = RecvRing::new(4, 8);
        for _ in 0..2 {
            r.on_arrival().unwrap();
        }
        let _ = r.grow();
        assert_eq!(r.take_credits(), 4);
        for _ in 0..6 {
            r.on_arrival().unwrap();
        }
        assert!(r.on_arrival().is_err());
    }
}
