//! The RDMA transport's whole protocol state machine, `proto::Connection`
//! as it ships, in two modes:
//!
//! - [`lying`]: one `Connection` fed what a lying peer and a broken verbs
//!   layer can make it see (headers with any fields or raw bytes in any
//!   receive slot, completions with any `wr_id`, failed completions,
//!   disconnection), between the application's sends, transmits,
//!   deliveries, releases, region returns and a close. Checked against a
//!   model of its own: no panic; work requests inside their slots and the
//!   peer's region; credits and ring occupancy as counted from outside;
//!   every lie it can tell from outside (a completion for nothing posted,
//!   credits over the ring, region space freed beyond what was written, a
//!   region returned that was not granted, a message into a full ring)
//!   fails it; every genuine completion is taken; heap held bounded; after
//!   a failure nothing goes out and nothing new comes in.
//! - [`pair`]: two honest `Connection`s wired through a simulated RC queue
//!   pair (a wire per direction executing work requests in posting order,
//!   separate send and receive completion queues polled in any interleaving)
//!   under arbitrary application sends of every size, pumps, deliveries,
//!   releases in any order, region returns and closes. Checked: no
//!   failure; credit conservation and no receive-ring overrun at every
//!   step; no send slot, staging byte or region byte reused while in use;
//!   and once both sides drain, every frame arrived exactly once, intact
//!   and in order, nothing is stuck, and both see the orderly end.

use arbitrary::Arbitrary;

pub mod lying;
pub mod pair;

/// Inline frames are at most this long (a 96-byte slot less the header),
/// region frames at most half the 256-byte region, delivered ones at most
/// 1000 bytes: the geometry both modes use.
const INLINE_MAX: usize = 64;
const CHUNK_MAX: usize = 128;
const FRAME_MAX: usize = 1000;

/// A frame length from a fuzzed `v`: its low two bits pick inline, region,
/// chunked within the frame limit, or anything up to `max`; the rest the
/// length within that. Each route is as likely as the others (a uniform
/// length would be inline or region one time in twenty).
pub fn frame_len(v: u16, max: usize) -> usize {
    let n = usize::from(v >> 2);
    match v & 3 {
        0 => n % (INLINE_MAX + 1),
        1 => INLINE_MAX + 1 + n % (CHUNK_MAX - INLINE_MAX),
        2 => CHUNK_MAX + 1 + n % (FRAME_MAX - CHUNK_MAX),
        _ => n % (max + 1),
    }
}

/// One input: which mode, and its events.
#[derive(Debug, Arbitrary)]
pub enum ConnectionInput {
    /// One connection against a lying peer.
    Lying(Vec<lying::Op>),
    /// Two honest connections against each other.
    Pair(pair::PairInput),
}

/// Runs the checks on one input.
pub fn check(input: &ConnectionInput) {
    match input {
        ConnectionInput::Lying(ops) => lying::check(ops),
        ConnectionInput::Pair(input) => {
            pair::check(input);
        }
    }
}
