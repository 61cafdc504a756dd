//! [`Outgoing`]: bytes accepted for the socket and not yet written, as a
//! gather list: large payloads by reference, everything else copied.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::mem;
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use rpc_core::frame::{Gather, OutFrame, GATHER_THRESHOLD};

use crate::reader::{PIECE, PIECE_LEN};
use crate::WriteHalf;

/// Most `iovec`s handed to one vectored write (Linux takes up to 1024).
const MAX_SLICES: usize = 64;

/// Length-prefixed frames in the order they were accepted: `segments`
/// (large payload fields by reference, and the small bytes written before
/// each), then `tail`. A frame whose payload is under
/// [`GATHER_THRESHOLD`] is encoded into `tail`, copied, as before; a larger
/// one is gathered ([`OutFrame::gather`]), so its large [`Bytes`] fields
/// are written from where they are, with vectored writes.
#[derive(Debug, Default)]
pub(crate) struct Outgoing {
    segments: VecDeque<Bytes>,
    /// Total length of `segments`.
    segments_len: usize,
    tail: BytesMut,
}

impl Outgoing {
    /// `tail`'s bytes, then what is pushed; small frames are encoded into
    /// its capacity.
    pub(crate) fn with_tail(tail: BytesMut) -> Outgoing {
        Outgoing {
            segments: VecDeque::new(),
            segments_len: 0,
            tail,
        }
    }

    /// Bytes not yet written.
    pub(crate) fn len(&self) -> usize {
        self.segments_len + self.tail.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets everything, keeping the tail's capacity.
    pub(crate) fn clear(&mut self) {
        self.segments.clear();
        self.segments_len = 0;
        self.tail.clear();
    }

    /// The tail's allocated capacity (the segments are not ours).
    pub(crate) fn capacity(&self) -> usize {
        self.tail.capacity()
    }

    /// The emptied tail, to keep its capacity for later frames.
    pub(crate) fn into_tail(mut self) -> BytesMut {
        self.tail.clear();
        self.tail
    }

    /// Appends `frame`, after its 4-byte length `prefix`.
    pub(crate) fn push_frame(&mut self, frame: &OutFrame<'_>, prefix: u32) {
        if frame.payload_len() < GATHER_THRESHOLD {
            self.tail.reserve(4 + frame.len());
            self.tail.put_u32_le(prefix);
            frame.encode(&mut self.tail);
            return;
        }
        self.gather(|gather| {
            gather.put_u32_le(prefix);
            frame.gather(gather);
        });
    }

    /// Appends what `fill` puts in a [`Gather`]: bytes copied, segments by
    /// reference.
    fn gather(&mut self, fill: impl FnOnce(&mut Gather)) {
        let mut gather = Gather::with_tail(mem::take(&mut self.tail));
        fill(&mut gather);
        let (segments, tail) = gather.into_parts();
        for segment in segments {
            self.segments_len += segment.len();
            self.segments.push_back(segment);
        }
        self.tail = tail;
    }

    /// Appends the first `n` bytes (at most [`len`](Self::len)) of `from`
    /// as a piece of the bulk stream: its header, then the bytes, moved by
    /// reference.
    pub(crate) fn push_piece(&mut self, from: &mut Outgoing, n: usize) {
        debug_assert!(n > 0 && n <= from.len() && n < PIECE as usize);
        self.gather(|gather| {
            gather.put_u32_le(n as u32 | PIECE);
            let mut left = n;
            while left > 0 {
                let part = match from.segments.front_mut() {
                    Some(front) if front.len() <= left => {
                        let part = from.segments.pop_front().expect("a front");
                        from.segments_len -= part.len();
                        part
                    }
                    Some(front) => {
                        from.segments_len -= left;
                        front.split_to(left)
                    }
                    None => from.tail.split_to(left).freeze(),
                };
                left -= part.len();
                gather.push_segment(part);
            }
        });
    }

    /// Writes as much as the socket takes without waiting, and forgets it.
    pub(crate) fn try_write<W: WriteHalf>(&mut self, socket: &W) -> io::Result<()> {
        while !self.is_empty() {
            let written = if self.segments.is_empty() {
                socket.try_write(&self.tail)
            } else {
                let mut slices = [IoSlice::new(&[]); MAX_SLICES];
                let mut count = 0;
                for segment in self.segments.iter().take(MAX_SLICES) {
                    slices[count] = IoSlice::new(segment);
                    count += 1;
                }
                if count < MAX_SLICES && !self.tail.is_empty() {
                    slices[count] = IoSlice::new(&self.tail);
                    count += 1;
                }
                socket.try_write_vectored(&slices[..count])
            };
            match written {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.advance(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Forgets the first `n` bytes (written), dropping written segments.
    fn advance(&mut self, mut n: usize) {
        debug_assert!(n <= self.len());
        while n > 0 {
            let Some(front) = self.segments.front_mut() else {
                if n == self.tail.len() {
                    // All written: `clear` keeps the buffer's start (and so
                    // its whole capacity) for the next frames; `advance`
                    // would move it past the bytes written.
                    self.tail.clear();
                } else {
                    self.tail.advance(n);
                }
                return;
            };
            let taken = n.min(front.len());
            front.advance(taken);
            self.segments_len -= taken;
            n -= taken;
            if front.is_empty() {
                self.segments.pop_front();
            }
        }
    }
}

/// How the writer cuts the bulk stream and how much the socket may hold
/// unsent (`TCP_NOTSENT_LOWAT`) for its next piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Step {
    pub(crate) piece: usize,
    pub(crate) unsent_limit: u32,
}

/// While small frames go between the pieces: a small frame waits behind
/// at most one 64 KiB piece and 64 KiB unsent. Against 256 KiB and
/// 128 KiB, small calls one at a time beside 64 MiB ones on their channel
/// (`hol-bench`, two sittings of 8 and 6 runs each, medians): p50 287 →
/// 200 and 297 → 206 µs, largest wait 10.3 → 4.8 and 8.1 → 4.8 ms, the
/// 64 MiB calls 2.20 → 2.47 and 2.05 → 2.40 GB/s; p99 914 → 654 and
/// 994 → 1,178 µs (it spreads 0.4–4 ms run to run either way).
pub(crate) const INTERLEAVED: Step = Step {
    piece: 64 << 10,
    unsent_limit: 64 << 10,
};

/// While only the bulk stream is sent: pieces and unsent bytes of 1 MiB.
/// Small pieces and a low mark cost a large frame wake-ups on both ends
/// for nothing to pass it (a 1 MiB echo over loopback, one at a time: p50
/// 1.00 ms in 256 KiB pieces with 128 KiB unsent, 0.75 ms in 1 MiB
/// steps); a small frame that comes now waits behind up to 2 MiB, once:
/// the steps turn small.
pub(crate) const QUIET: Step = Step {
    piece: 1 << 20,
    unsent_limit: 1 << 20,
};

/// How long after small frames last went between pieces the steps stay
/// small: a connection whose small calls come one after the other (each
/// waiting for its answer) keeps small steps through its large transfers.
pub(crate) const INTERLEAVED_FOR: Duration = Duration::from_millis(10);

/// Picks the [`Step`] for each piece of the bulk stream.
#[derive(Debug, Default)]
pub(crate) struct Pace {
    /// Until when the steps stay small.
    interleaved_until: Option<Instant>,
}

impl Pace {
    /// The step for the next piece, taken at `now`; `interleaved` when
    /// small frames were queued beside the bulk stream.
    pub(crate) fn step(&mut self, interleaved: bool, now: Instant) -> Step {
        if interleaved {
            self.interleaved_until = Some(now + INTERLEAVED_FOR);
        }
        match self.interleaved_until {
            Some(until) if now < until => INTERLEAVED,
            _ => QUIET,
        }
    }
}

/// The bulk stream: frames larger than [`PIECE_LEN`], and frames of calls
/// that have such a frame in it (a call's frames stay in order), sent in
/// pieces ([`Pace`]) between the connection's other frames.
#[derive(Debug, Default)]
pub(crate) struct Bulk {
    out: Outgoing,
    /// Bytes pushed into `out`, and taken out as pieces, so far.
    pushed: u64,
    taken: u64,
    /// Calls with frames not all taken, each with where its last frame ends.
    calls: VecDeque<(u64, u64)>,
    /// Where the last frame larger than a piece ends.
    large_end: u64,
}

impl Bulk {
    /// Bytes not yet taken.
    pub(crate) fn len(&self) -> usize {
        self.out.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.out.is_empty()
    }

    /// Whether `frame` goes in the bulk stream.
    pub(crate) fn takes(&self, frame: &OutFrame<'_>) -> bool {
        frame.len() > PIECE_LEN
            || (!self.calls.is_empty()
                && self.calls.iter().any(|&(call, _)| call == frame.call_id()))
    }

    /// Bytes that count against the high-water mark for `frame`: for a
    /// large frame all not yet taken, for a small one (queued behind its
    /// call's large frame) those queued behind the last large frame.
    pub(crate) fn queued_for(&self, frame: &OutFrame<'_>) -> usize {
        if frame.len() > PIECE_LEN {
            self.len()
        } else {
            (self.pushed - self.large_end.max(self.taken)) as usize
        }
    }

    /// Appends `frame`, after its 4-byte length `prefix`.
    pub(crate) fn push_frame(&mut self, frame: &OutFrame<'_>, prefix: u32) {
        self.out.push_frame(frame, prefix);
        self.pushed += 4 + frame.len() as u64;
        self.calls.push_back((frame.call_id(), self.pushed));
        if frame.len() > PIECE_LEN {
            self.large_end = self.pushed;
        }
    }

    /// Moves the next piece, up to `max` bytes, to the end of `to`.
    pub(crate) fn take_piece(&mut self, to: &mut Outgoing, max: usize) {
        let n = self.out.len().min(max);
        if n == 0 {
            return;
        }
        to.push_piece(&mut self.out, n);
        self.taken += n as u64;
        while self
            .calls
            .front()
            .is_some_and(|&(_, end)| end <= self.taken)
        {
            self.calls.pop_front();
        }
    }

    /// Forgets everything.
    pub(crate) fn clear(&mut self) {
        self.out.clear();
        self.calls.clear();
        self.taken = self.pushed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_small_while_small_frames_go_between_pieces_and_for_a_while_after() {
        let mut pace = Pace::default();
        let t0 = Instant::now();
        assert_eq!(pace.step(false, t0), QUIET, "nothing to let pass");
        assert_eq!(pace.step(true, t0), INTERLEAVED);
        let later = t0 + INTERLEAVED_FOR / 2;
        assert_eq!(
            pace.step(false, later),
            INTERLEAVED,
            "small frames just passed"
        );
        assert_eq!(
            pace.step(false, t0 + INTERLEAVED_FOR),
            QUIET,
            "none for a while"
        );
        assert_eq!(pace.step(true, t0 + INTERLEAVED_FOR * 3), INTERLEAVED);
    }

    fn bytes_of(out: &Outgoing) -> Vec<u8> {
        let mut all: Vec<u8> = out.segments.iter().flat_map(|s| s.to_vec()).collect();
        all.extend_from_slice(&out.tail);
        all
    }

    #[test]
    fn pieces_carry_the_bulk_stream_whole_and_a_call_stays_in_order_behind_its_large_frame() {
        use crate::reader::FrameReader;
        use rpc_core::frame::{Frame, OutBody};
        use rpc_core::transport::FrameLimits;
        let large = Bytes::from(
            (0..PIECE_LEN * 2 + 1000)
                .map(|i| i as u8)
                .collect::<Vec<_>>(),
        );
        let small = Bytes::from_static(b"small");
        let frame =
            |call, payload| OutFrame::control(call, OutBody::Message, false).with_payload(payload);
        let mut bulk = Bulk::default();
        let (large_frame, small_1, small_2) =
            (frame(1, &large), frame(1, &small), frame(2, &small));
        assert!(bulk.takes(&large_frame) && !bulk.takes(&small_1));
        bulk.push_frame(&large_frame, large_frame.len() as u32);
        // Call 1 has a frame in the bulk stream: its small frame follows it
        // there; call 2's does not.
        assert!(bulk.takes(&small_1) && !bulk.takes(&small_2));
        bulk.push_frame(&small_1, small_1.len() as u32);
        assert_eq!(bulk.queued_for(&small_1), 4 + small_1.len());
        // The wire: a piece, then call 2's frame (the connection's own),
        // then the other pieces.
        let mut wire = Outgoing::default();
        bulk.take_piece(&mut wire, PIECE_LEN);
        wire.push_frame(&small_2, small_2.len() as u32);
        while !bulk.is_empty() {
            bulk.take_piece(&mut wire, PIECE_LEN);
        }
        assert!(
            bulk.is_empty() && !bulk.takes(&small_1),
            "all taken: call 1 is free again"
        );
        let bytes = bytes_of(&wire);
        let mut reader = FrameReader::new(FrameLimits {
            max_frame_len: 16 << 20,
        });
        reader.extend_from_slice(&bytes);
        let mut calls = Vec::new();
        while let Some(frame) = reader.next_frame().unwrap() {
            let frame = Frame::decode(frame).unwrap();
            calls.push((frame.call_id, frame.payload.unwrap().len()));
        }
        assert_eq!(calls, [(2, 5), (1, large.len()), (1, 5)]);
        assert!(reader.is_caught_up());
    }

    #[test]
    fn large_payloads_are_queued_by_reference_small_ones_copied() {
        use rpc_core::frame::OutBody;
        let large = Bytes::from(vec![5u8; GATHER_THRESHOLD]);
        let small = Bytes::from(vec![6u8; GATHER_THRESHOLD - 1]);
        let mut out = Outgoing::default();
        let frame = |payload| OutFrame::control(1, OutBody::Message, false).with_payload(payload);
        out.push_frame(&frame(&small), 7);
        assert!(out.segments.is_empty());
        out.push_frame(&frame(&large), 8);
        out.push_frame(&frame(&small), 9);
        assert_eq!(out.segments.len(), 2);
        assert_eq!(out.segments[1].as_ptr(), large.as_ptr());
        let mut expected = BytesMut::new();
        for (payload, prefix) in [(&small, 7u32), (&large, 8), (&small, 9)] {
            expected.put_u32_le(prefix);
            expected.extend_from_slice(&frame(payload).to_bytes());
        }
        let mut all = BytesMut::new();
        out.segments.iter().for_each(|s| all.extend_from_slice(s));
        all.extend_from_slice(&out.tail);
        assert_eq!(all, expected);
        assert_eq!(out.len(), expected.len());
    }

    #[test]
    fn advances_across_segments_and_tail() {
        let mut out = Outgoing::default();
        out.segments.push_back(Bytes::from_static(b"abc"));
        out.segments.push_back(Bytes::from_static(b"defg"));
        out.segments_len = 7;
        out.tail.extend_from_slice(b"hij");
        out.advance(2);
        assert_eq!(out.len(), 8);
        out.advance(5);
        assert!(out.segments.is_empty());
        assert_eq!(&out.tail[..], b"hij");
        let capacity = out.capacity();
        out.advance(3);
        assert!(out.is_empty());
        assert_eq!(
            out.capacity(),
            capacity,
            "a written tail keeps its capacity"
        );
    }
}
