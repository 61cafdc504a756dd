//! Frames put back together from region chunks, under the frame limits.

use super::header::{FIRST, LAST};
use super::ProtocolError;

/// What a received frame (or its last chunk) produces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assembled {
    /// A whole frame.
    Frame(Vec<u8>),
    /// A frame over `max_frame_len` was skipped; `prefix` is its first bytes.
    Oversized {
        /// Its length.
        len: usize,
        /// Its first bytes (at most `prefix_len`).
        prefix: Vec<u8>,
    },
    /// A frame too long even to skip: the connection must close.
    TooLarge {
        /// Its length.
        len: usize,
    },
}

#[derive(Debug, Clone)]
enum State {
    Idle,
    Collecting { total: usize, buf: Vec<u8> },
    Skipping { total: usize, got: usize },
}

/// Collects the chunks of one frame at a time (the sender never
/// interleaves frames' chunks).
#[derive(Debug, Clone)]
pub struct Reassembly {
    max_frame_len: usize,
    max_skip_len: usize,
    prefix_len: usize,
    state: State,
}

impl Reassembly {
    /// Frames up to `max_frame_len` are delivered, up to `max_skip_len`
    /// skipped (reported with their first `prefix_len` bytes).
    pub fn new(max_frame_len: usize, max_skip_len: usize, prefix_len: usize) -> Reassembly {
        Reassembly {
            max_frame_len,
            max_skip_len,
            prefix_len,
            state: State::Idle,
        }
    }

    /// True between the first and the last chunk of a frame.
    pub fn in_frame(&self) -> bool {
        !matches!(self.state, State::Idle)
    }

    /// Checks a frame of `len` bytes against the limits: `None` when it may
    /// be delivered.
    pub fn check_len(&self, len: usize, prefix: &[u8]) -> Option<Assembled> {
        if len > self.max_skip_len {
            Some(Assembled::TooLarge { len })
        } else if len > self.max_frame_len {
            Some(Assembled::Oversized {
                len,
                prefix: prefix[..self.prefix_len.min(prefix.len())].to_vec(),
            })
        } else {
            None
        }
    }

    /// One chunk (`flags`, `total` from its header, `data` its bytes);
    /// returns what completes with it.
    pub fn chunk(
        &mut self,
        flags: u8,
        total: u32,
        data: &[u8],
    ) -> Result<Option<Assembled>, ProtocolError> {
        let first = flags & FIRST != 0;
        let last = flags & LAST != 0;
        if first == self.in_frame() {
            return Err(ProtocolError::new(if first {
                "a frame's first chunk inside another frame"
            } else {
                "a continuation chunk outside any frame"
            }));
        }
        if first {
            let total = total as usize;
            if let Some(verdict) = self.check_len(total, data) {
                if let Assembled::TooLarge { .. } = verdict {
                    return Ok(Some(verdict));
                }
                if data.len() == total {
                    return if last {
                        Ok(Some(verdict))
                    } else {
                        Err(ProtocolError::new(
                            "frame complete but chunk not marked last",
                        ))
                    };
                }
                if last {
                    return Err(ProtocolError::new("last chunk before the frame's end"));
                }
                self.state = State::Skipping {
                    total,
                    got: data.len(),
                };
                return Ok(Some(verdict));
            }
            if last {
                if data.len() != total {
                    return Err(ProtocolError::new("last chunk before the frame's end"));
                }
                return Ok(Some(Assembled::Frame(data.to_vec())));
            }
            if data.len() >= total {
                return Err(ProtocolError::new(
                    "frame complete but chunk not marked last",
                ));
            }
            // Only the bytes that arrived: the peer's `total` must not
            // decide how much memory is reserved (the buffer grows with the chunks).
            let buf = data.to_vec();
            self.state = State::Collecting { total, buf };
            return Ok(None);
        }
        let (total, got) = match &self.state {
            State::Collecting { total, buf } => (*total, buf.len()),
            State::Skipping { total, got } => (*total, *got),
            State::Idle => unreachable!("checked above"),
        };
        let got = got + data.len();
        if got > total {
            return Err(ProtocolError::new(format!(
                "chunks carry more than the frame's {total} bytes"
            )));
        }
        if last != (got == total) {
            return Err(ProtocolError::new(if last {
                "last chunk before the frame's end"
            } else {
                "frame complete but chunk not marked last"
            }));
        }
        match &mut self.state {
            State::Collecting { buf, .. } => {
                buf.extend_from_slice(data);
                if last {
                    let State::Collecting { buf, .. } =
                        std::mem::replace(&mut self.state, State::Idle)
                    else {
                        unreachable!()
                    };
                    return Ok(Some(Assembled::Frame(buf)));
                }
            }
            State::Skipping { got: g, .. } => {
                *g = got;
                if last {
                    self.state = State::Idle;
                }
            }
            State::Idle => unreachable!("checked above"),
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_and_multi_chunk_frames() {
        let mut r = Reassembly::new(100, 400, 4);
        assert_eq!(
            r.chunk(FIRST | LAST, 3, b"abc"),
            Ok(Some(Assembled::Frame(b"abc".to_vec())))
        );
        assert_eq!(r.chunk(FIRST, 6, b"ab"), Ok(None));
        assert!(r.in_frame());
        assert_eq!(r.chunk(0, 0, b"cd"), Ok(None));
        assert_eq!(
            r.chunk(LAST, 0, b"ef"),
            Ok(Some(Assembled::Frame(b"abcdef".to_vec())))
        );
        assert!(!r.in_frame());
    }

    #[test]
    fn oversized_is_skipped_and_too_large_reported() {
        let mut r = Reassembly::new(4, 10, 2);
        assert_eq!(
            r.chunk(FIRST, 8, b"abcd"),
            Ok(Some(Assembled::Oversized {
                len: 8,
                prefix: b"ab".to_vec()
            }))
        );
        assert_eq!(r.chunk(LAST, 0, b"efgh"), Ok(None));
        assert_eq!(
            r.chunk(FIRST | LAST, 2, b"ok"),
            Ok(Some(Assembled::Frame(b"ok".to_vec())))
        );
        assert_eq!(
            r.chunk(FIRST, 11, b"x"),
            Ok(Some(Assembled::TooLarge { len: 11 }))
        );
    }

    /// Found by the `rdma_reassembly` fuzz target: a 1-byte first chunk
    /// announcing a 32 MiB frame reserved the 32 MiB at once.
    #[test]
    fn memory_held_follows_the_bytes_that_arrived_not_the_announced_total() {
        let mut r = Reassembly::new(64 << 20, 64 << 20, 4);
        assert_eq!(r.chunk(FIRST, 32 << 20, b"x"), Ok(None));
        let State::Collecting { buf, .. } = &r.state else {
            panic!("not collecting: {:?}", r.state);
        };
        assert!(buf.capacity() < 4096, "holds {} bytes", buf.capacity());
    }

    #[test]
    fn broken_sequences_are_protocol_errors() {
        let mut r = Reassembly::new(100, 400, 4);
        assert!(r.chunk(0, 0, b"x").is_err(), "continuation first");
        assert!(r.chunk(LAST, 0, b"x").is_err());
        assert!(r.chunk(FIRST | LAST, 5, b"abc").is_err(), "short last");
        assert!(r.chunk(FIRST, 3, b"abc").is_err(), "complete, not last");
        let mut r = Reassembly::new(100, 400, 4);
        r.chunk(FIRST, 5, b"ab").unwrap();
        assert!(r.chunk(FIRST, 5, b"ab").is_err(), "first inside a frame");
        let mut r = Reassembly::new(100, 400, 4);
        r.chunk(FIRST, 5, b"ab").unwrap();
        assert!(r.chunk(0, 0, b"abcd").is_err(), "too many bytes");
        let mut r = Reassembly::new(100, 400, 4);
        r.chunk(FIRST, 5, b"ab").unwrap();
        assert!(r.chunk(0, 0, b"abc").is_err(), "complete, not last");
    }
}
