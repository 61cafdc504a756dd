//! Frames put back together from region chunks, under the frame limits.
//!
//! # Memory
//! What a peer announces never decides what we reserve: a frame's buffer
//! grows with the chunks that arrived (amortised doubling, so its capacity
//! stays under twice the bytes received), never to the `total` its first
//! chunk claims. Per connection, one frame is collected at a time and only
//! if its total is within `max_frame_len` (longer ones are skipped without
//! buffering), so a connection holds at most about `2 × max_frame_len`
//! bytes of partial frame; the process, that times its connections.
//!
//! A frame larger than [`KEPT_ABOVE`](rpc_core::kept::KEPT_ABOVE)
//! (32 MiB) is collected in a kept buffer (of up to twice its total) when
//! one is free ([`Reassembly::keep_buffers_in`]): memory the process holds
//! already, its pages mapped, that an earlier frame was collected in and
//! the application dropped. Its buffer goes back to the kept ones once the
//! frame is handed up. A peer that announces such a frame and stops holds
//! that buffer, nothing more.
//!
//! There is no separate per-process budget of partial-frame bytes: a
//! receiver over such a budget could only stop reading, and a partial frame
//! completes only by reading on, so connections each waiting for the budget
//! another one holds would deadlock. The bound is the one above; limiting
//! the number of connections (or `max_frame_len`) is how a process caps it.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use rpc_core::kept::KeptBuffers;

use super::header::{FIRST, LAST};
use super::ProtocolError;

/// What a received frame (or its last chunk) produces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assembled {
    /// A whole frame.
    Frame(Bytes),
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
    Collecting { total: usize, buf: BytesMut },
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
    kept: Option<Arc<KeptBuffers>>,
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
            kept: None,
        }
    }

    /// Collects frames larger than [`KEPT_ABOVE`](rpc_core::kept::KEPT_ABOVE) in buffers `kept`
    /// holds when one is free, and gives it their buffers once handed up.
    pub fn keep_buffers_in(&mut self, kept: Arc<KeptBuffers>) {
        self.kept = Some(kept);
    }

    /// The largest frame delivered.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
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

    /// As [`check_len`](Self::check_len), for a chunk of `len` bytes that
    /// `read` copies out (only the prefix of an oversized frame is read).
    fn check_len_from(
        &self,
        total: usize,
        len: usize,
        read: &mut impl FnMut(usize, &mut [u8]),
    ) -> Option<Assembled> {
        if total > self.max_skip_len {
            Some(Assembled::TooLarge { len: total })
        } else if total > self.max_frame_len {
            let mut prefix = vec![0; self.prefix_len.min(len)];
            read(0, &mut prefix);
            Some(Assembled::Oversized { len: total, prefix })
        } else {
            None
        }
    }

    /// Bytes reserved for the frame being collected (its buffer's capacity).
    pub fn buffered_capacity(&self) -> usize {
        match &self.state {
            State::Collecting { buf, .. } => buf.capacity(),
            State::Idle | State::Skipping { .. } => 0,
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
        self.chunk_from(flags, total, data.len(), |offset, dst| {
            dst.copy_from_slice(&data[offset..offset + dst.len()]);
        })
    }

    /// One chunk of `len` bytes that `read` copies out: `read(offset, dst)`
    /// fills `dst` with the chunk's bytes `offset..offset + dst.len()`.
    /// For chunks in memory that may not be borrowed as a slice (the
    /// remotely writable region, read by raw copies).
    pub fn chunk_from(
        &mut self,
        flags: u8,
        total: u32,
        len: usize,
        mut read: impl FnMut(usize, &mut [u8]),
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
            if let Some(verdict) = self.check_len_from(total, len, &mut read) {
                if let Assembled::TooLarge { .. } = verdict {
                    return Ok(Some(verdict));
                }
                if len == total {
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
                self.state = State::Skipping { total, got: len };
                return Ok(Some(verdict));
            }
            if last {
                if len != total {
                    return Err(ProtocolError::new("last chunk before the frame's end"));
                }
                let mut frame = BytesMut::new();
                append(&mut frame, len, &mut read);
                return Ok(Some(Assembled::Frame(frame.freeze())));
            }
            if len >= total {
                return Err(ProtocolError::new(
                    "frame complete but chunk not marked last",
                ));
            }
            // Not `with_capacity(total)`: the peer's claim reserves nothing
            // (a kept buffer is memory held already).
            let mut buf = (self.kept.as_deref())
                .and_then(|kept| kept.take(total))
                .unwrap_or_default();
            append(&mut buf, len, &mut read);
            self.state = State::Collecting { total, buf };
            return Ok(None);
        }
        let (total, got) = match &self.state {
            State::Collecting { total, buf } => (*total, buf.len()),
            State::Skipping { total, got } => (*total, *got),
            State::Idle => unreachable!("checked above"),
        };
        let got = got + len;
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
                append(buf, len, &mut read);
                if last {
                    let State::Collecting { mut buf, .. } =
                        std::mem::replace(&mut self.state, State::Idle)
                    else {
                        unreachable!()
                    };
                    let frame = buf.split().freeze();
                    if let Some(kept) = &self.kept {
                        // The rest shares the frame's allocation: reused
                        // once the application drops the frame.
                        let capacity = frame.len() + buf.capacity();
                        kept.keep(buf, capacity);
                    }
                    return Ok(Some(Assembled::Frame(frame)));
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

/// Appends `len` bytes that `read` copies out to `buf`, growing it by the
/// amortised doubling of `Vec` (capacity under twice its length).
fn append(buf: &mut BytesMut, len: usize, read: &mut impl FnMut(usize, &mut [u8])) {
    let start = buf.len();
    buf.resize(start + len, 0);
    read(0, &mut buf[start..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_and_multi_chunk_frames() {
        let mut r = Reassembly::new(100, 400, 4);
        assert_eq!(
            r.chunk(FIRST | LAST, 3, b"abc"),
            Ok(Some(Assembled::Frame(Bytes::from_static(b"abc"))))
        );
        assert_eq!(r.chunk(FIRST, 6, b"ab"), Ok(None));
        assert!(r.in_frame());
        assert_eq!(r.chunk(0, 0, b"cd"), Ok(None));
        assert_eq!(
            r.chunk(LAST, 0, b"ef"),
            Ok(Some(Assembled::Frame(Bytes::from_static(b"abcdef"))))
        );
        assert!(!r.in_frame());
    }

    #[test]
    fn a_first_chunk_announcing_a_huge_frame_reserves_only_what_arrived() {
        let max = 64 << 20;
        let mut r = Reassembly::new(max, 2 * max, 4);
        assert_eq!(r.chunk(FIRST, max as u32, b"abcd"), Ok(None));
        assert!(r.in_frame());
        assert!(
            r.buffered_capacity() < 4096,
            "a 64 MiB announcement with 4 bytes reserved {} bytes",
            r.buffered_capacity()
        );
        // It grows with what arrives, within twice the bytes received.
        for _ in 0..100 {
            assert_eq!(r.chunk(0, 0, &[7; 1000]), Ok(None));
        }
        let got = 4 + 100 * 1000;
        assert!(r.buffered_capacity() >= got && r.buffered_capacity() <= 2 * got);
    }

    #[test]
    fn a_large_frame_is_collected_in_the_buffer_of_one_the_application_dropped() {
        let (total, chunk) = (33 << 20, 512 << 10);
        let mut r = Reassembly::new(64 << 20, 128 << 20, 4);
        // Room for both frames' buffers: the first one's is kept, never freed
        // (so another allocation cannot land where it was).
        r.keep_buffers_in(Arc::new(KeptBuffers::new(256 << 20)));
        let mut collect = |byte: u8| {
            let data = vec![byte; chunk];
            let mut frame = None;
            for i in 0..total / chunk {
                let first = if i == 0 { FIRST } else { 0 };
                let last = if i == total / chunk - 1 { LAST } else { 0 };
                frame = r.chunk(first | last, total as u32, &data).unwrap();
            }
            let Some(Assembled::Frame(frame)) = frame else {
                panic!("no frame: {frame:?}")
            };
            assert!(frame.len() == total && frame.iter().all(|&b| b == byte));
            frame
        };
        let first = collect(1);
        let second = collect(2);
        assert_ne!(first.as_ptr(), second.as_ptr(), "the first frame lived");
        let first_at = first.as_ptr();
        drop(first);
        assert_eq!(collect(3).as_ptr(), first_at, "the first frame's buffer");
    }

    #[test]
    fn chunks_read_by_copy_match_chunks_given_as_slices() {
        let src = b"0123456789";
        let mut r = Reassembly::new(100, 400, 4);
        let read = |from: usize| {
            move |off: usize, dst: &mut [u8]| {
                dst.copy_from_slice(&src[from + off..from + off + dst.len()])
            }
        };
        assert_eq!(r.chunk_from(FIRST, 10, 4, read(0)), Ok(None));
        assert_eq!(
            r.chunk_from(LAST, 0, 6, read(4)),
            Ok(Some(Assembled::Frame(Bytes::from_static(src))))
        );
        let mut r = Reassembly::new(4, 400, 3);
        assert_eq!(
            r.chunk_from(FIRST | LAST, 10, 10, read(0)),
            Ok(Some(Assembled::Oversized {
                len: 10,
                prefix: b"012".to_vec()
            }))
        );
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
            Ok(Some(Assembled::Frame(Bytes::from_static(b"ok"))))
        );
        assert_eq!(
            r.chunk(FIRST, 11, b"x"),
            Ok(Some(Assembled::TooLarge { len: 11 }))
        );
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
