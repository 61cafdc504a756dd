//! `CreditWindow` (one side's send credits) and `RecvRing` (the other
//! side's receive slots) driven by an arbitrary interleaving of sends,
//! arrivals, deliveries, releases and credit returns, plus a lying peer's
//! grants and uncredited arrivals.
//!
//! Properties: nothing panics; while the peer is honest credits are
//! conserved (`available + in flight + outstanding + returning == slots`),
//! every honest grant and arrival is accepted, and when the sender is out
//! of data credits with nothing in flight the receiver wants to send a
//! `Credit` message (no deadlock); a grant over the ring size and an
//! arrival into a full ring are errors, and change nothing.

use arbitrary::Arbitrary;
use transport_rdma::proto::{CreditWindow, Delivery, RecvRing};

/// One input: a ring size and a sequence of events.
#[derive(Debug, Arbitrary)]
pub struct CreditInput {
    /// The ring has `8 + slots % 1017` slots (the hello accepts 8..=1024).
    pub slots: u16,
    /// What happens, in order.
    pub ops: Vec<CreditOp>,
}

/// One event.
#[derive(Debug, Arbitrary)]
pub enum CreditOp {
    /// The sender sends a data message if it has a data credit.
    SendData,
    /// The sender sends a control message if it has any credit.
    SendControl,
    /// The oldest message in flight lands in a slot; an inline frame is
    /// delivered (zero-copy or copied), anything else reposted at once.
    Arrive {
        /// Whether it carries an inline frame.
        inline: bool,
    },
    /// The application drops its oldest zero-copy frame.
    Release,
    /// The receiver takes its pending credits to piggyback them.
    TakeCredits,
    /// The credits taken reach the sender.
    Grant,
    /// A lying peer grants `n` credits.
    BogusGrant(u16),
    /// A message arrives that no credit allowed (a lying peer).
    BogusArrival,
}

/// Runs the checks on one input.
pub fn check(input: &CreditInput) {
    let slots = 8 + u32::from(input.slots) % 1017;
    let mut window = CreditWindow::new(slots, slots);
    let mut ring = RecvRing::new(slots, slots);
    let mut in_flight = 0u32;
    let mut zero_copy_held = 0u32;
    let mut returning: Vec<u16> = Vec::new();
    let mut honest = true;
    for op in &input.ops {
        match *op {
            CreditOp::SendData => {
                let before = window.available();
                if window.take_data() {
                    in_flight += 1;
                } else {
                    assert!(before < 2, "refused a data credit with {before} available");
                }
            }
            CreditOp::SendControl => {
                let before = window.available();
                if window.take_control() {
                    in_flight += 1;
                } else {
                    assert_eq!(
                        before, 0,
                        "refused a control credit with {before} available"
                    );
                }
            }
            CreditOp::Arrive { inline } => {
                if in_flight == 0 {
                    continue;
                }
                in_flight -= 1;
                let result = ring.on_arrival();
                if honest {
                    result.expect("a credited arrival was refused");
                } else if result.is_err() {
                    continue;
                }
                if inline {
                    match ring.deliver() {
                        Delivery::ZeroCopy => zero_copy_held += 1,
                        Delivery::Copy => ring.on_reposted(),
                    }
                } else {
                    ring.on_reposted();
                }
            }
            CreditOp::Release => {
                if zero_copy_held > 0 {
                    zero_copy_held -= 1;
                    ring.on_released();
                }
            }
            CreditOp::TakeCredits => {
                let outstanding = ring.outstanding();
                let n = ring.take_credits();
                assert_eq!(ring.outstanding(), outstanding - u32::from(n));
                if n > 0 {
                    returning.push(n);
                }
            }
            CreditOp::Grant => {
                if returning.is_empty() {
                    continue;
                }
                let n = returning.remove(0);
                let result = window.grant(n);
                if honest {
                    result.expect("an honest grant was refused");
                }
            }
            CreditOp::BogusGrant(n) => {
                let before = window.available();
                match window.grant(n) {
                    Ok(()) => {
                        assert_eq!(window.available(), before + u32::from(n));
                        if n > 0 {
                            honest = false;
                        }
                    }
                    Err(_) => {
                        assert!(
                            before + u32::from(n) > slots,
                            "a grant within the ring refused"
                        );
                        assert_eq!(
                            window.available(),
                            before,
                            "a refused grant changed credits"
                        );
                    }
                }
            }
            CreditOp::BogusArrival => {
                let outstanding = ring.outstanding();
                match ring.on_arrival() {
                    Ok(()) => {
                        assert!(outstanding < slots);
                        ring.on_reposted();
                        honest = false;
                    }
                    Err(_) => {
                        assert_eq!(outstanding, slots, "an arrival into a free slot refused");
                        assert_eq!(ring.outstanding(), outstanding);
                    }
                }
            }
        }
        assert!(window.available() <= window.limit());
        assert!(ring.outstanding() <= slots);
        assert!(ring.held() + ring.pending() <= ring.outstanding());
        assert_eq!(ring.held(), zero_copy_held);
        if honest {
            let returning_sum: u32 = returning.iter().map(|&n| u32::from(n)).sum();
            assert_eq!(
                window.available() + in_flight + ring.outstanding() + returning_sum,
                slots,
                "credits not conserved"
            );
            if in_flight == 0 && returning.is_empty() && window.available() < 2 {
                assert!(
                    ring.pending() == 0 || ring.wants_credit_message(),
                    "sender out of credits, {} pending, and no credit message wanted",
                    ring.pending()
                );
            }
        }
    }
}
