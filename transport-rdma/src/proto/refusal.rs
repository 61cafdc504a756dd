//! Why a server refused a connection, sent back in the connection
//! manager's reject private data so the client can say why.

use super::auth::{Challenge, ProofRefused, CHALLENGE_LEN};
use super::hello::MAGIC;

/// Encoded length of a [`Refused`].
pub const REFUSED_LEN: usize = 16 + CHALLENGE_LEN;

/// Marks a refusal (where a [`Hello`](super::Hello) has its version).
const REFUSAL_MARK: u16 = 0xFFFF;

/// Why a server refused a connection, and the limit that was hit.
///
/// Layout (little-endian): `magic: u32, mark: u16 (0xFFFF), reason: u16,
/// limit: u64, challenge: [u8; 16]` (the limit, or the reason code of a
/// refused proof; the challenge zero but in [`Refused::Challenge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The listener has as many connections as it admits.
    TooManyConnections {
        /// Its limit.
        limit: u64,
    },
    /// As many connection set-ups are under way as the listener runs at
    /// once; try again.
    TooManyHandshakes {
        /// Its limit.
        limit: u64,
    },
    /// The memory this connection would pin (for the geometry the client
    /// announced) does not fit the listener's pinned-memory budget.
    OverPinnedBudget {
        /// The budget, in bytes.
        limit: u64,
    },
    /// The client's hello was malformed, of another version or beyond the
    /// server's limits (the server logs which).
    BadHello,
    /// The listener admits only clients that prove its shared secret:
    /// connect again with the proof for this challenge (see
    /// [`auth`](super::auth)).
    Challenge(Challenge),
    /// The client's proof of the shared secret was refused.
    Proof(ProofRefused),
    /// The client's address is not on the listener's allow-list.
    NotAllowed,
}

impl Refused {
    /// Encodes the refusal.
    pub fn to_bytes(self) -> [u8; REFUSED_LEN] {
        let mut b = [0; REFUSED_LEN];
        let (reason, limit): (u16, u64) = match self {
            Refused::TooManyConnections { limit } => (1, limit),
            Refused::TooManyHandshakes { limit } => (2, limit),
            Refused::OverPinnedBudget { limit } => (3, limit),
            Refused::BadHello => (4, 0),
            Refused::Challenge(challenge) => {
                b[16..].copy_from_slice(&challenge.0);
                (5, 0)
            }
            Refused::Proof(why) => (6, why.code()),
            Refused::NotAllowed => (7, 0),
        };
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&REFUSAL_MARK.to_le_bytes());
        b[6..8].copy_from_slice(&reason.to_le_bytes());
        b[8..16].copy_from_slice(&limit.to_le_bytes());
        b
    }

    /// Decodes a server's reject private data; `None` if it is not a
    /// refusal of ours (trailing bytes, e.g. zero padding, are ignored).
    pub fn decode(b: &[u8]) -> Option<Refused> {
        let b = b.get(..REFUSED_LEN)?;
        let u16_at = |at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
        if b[0..4] != MAGIC.to_le_bytes() || u16_at(4) != REFUSAL_MARK {
            return None;
        }
        let limit = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        Some(match u16_at(6) {
            1 => Refused::TooManyConnections { limit },
            2 => Refused::TooManyHandshakes { limit },
            3 => Refused::OverPinnedBudget { limit },
            4 => Refused::BadHello,
            5 => Refused::Challenge(Challenge(b[16..].try_into().expect("16 bytes"))),
            6 => Refused::Proof(ProofRefused::from_code(limit)?),
            7 => Refused::NotAllowed,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::TooManyConnections { limit } => {
                write!(f, "the server has its maximum of {limit} connections")
            }
            Refused::TooManyHandshakes { limit } => write!(
                f,
                "the server is setting up its maximum of {limit} connections at once; try again"
            ),
            Refused::OverPinnedBudget { limit } => write!(
                f,
                "the memory the connection would pin does not fit the server's budget of \
                 {limit} bytes (announce a smaller ring or region, or try later)"
            ),
            Refused::BadHello => write!(
                f,
                "the server did not accept this side's hello (protocol version or ring and \
                 region sizes beyond its limits)"
            ),
            Refused::Challenge(_) => write!(
                f,
                "the server admits only clients that prove its shared secret \
                 (RdmaTransport::auth_secret), and this side has none"
            ),
            Refused::Proof(why) => write!(f, "the server refused this side's proof: {why}"),
            Refused::NotAllowed => write!(
                f,
                "this side's address is not on the server's allow-list (RdmaTransport::allow_peers)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Hello, HelloLimits};

    #[test]
    fn refusals_round_trip_and_are_not_hellos() {
        let all = [
            Refused::TooManyConnections { limit: 7 },
            Refused::TooManyHandshakes { limit: 64 },
            Refused::OverPinnedBudget { limit: 1 << 31 },
            Refused::BadHello,
            Refused::Challenge(Challenge([7; CHALLENGE_LEN])),
            Refused::Proof(ProofRefused::Replayed),
            Refused::NotAllowed,
        ];
        for refused in all {
            let mut padded = refused.to_bytes().to_vec();
            padded.resize(148, 0);
            assert_eq!(Refused::decode(&padded), Some(refused));
            let limits = HelloLimits {
                max_ring_slots: u32::MAX,
                max_slot_size: u32::MAX,
                max_region_len: u32::MAX,
            };
            assert!(Hello::decode(&padded, &limits).is_err());
        }
        // Not ours: empty, short, another magic, a hello, an unknown reason.
        assert_eq!(Refused::decode(&[]), None);
        assert_eq!(Refused::decode(&Refused::BadHello.to_bytes()[..31]), None);
        let mut other = Refused::BadHello.to_bytes();
        other[0] ^= 1;
        assert_eq!(Refused::decode(&other), None);
        let hello = Hello {
            ring_slots: 8,
            initial_slots: 8,
            slot_size: 4096,
            region_len: 4096,
            reads_rendezvous: false,
        };
        assert_eq!(Refused::decode(&hello.to_bytes()), None);
        let mut unknown = Refused::BadHello.to_bytes();
        unknown[6] = 9;
        assert_eq!(Refused::decode(&unknown), None);
    }
}
