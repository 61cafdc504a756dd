//! Two endpoints driven against each other in memory, by a seeded PRNG:
//! random frame sizes around every threshold, random delivery and release
//! order, an application that keeps some frames forever. Checked at every
//! step: no send without a credit, no receive without a posted slot, no
//! region write into space not yet freed, credit conservation; at the end:
//! every frame delivered intact and in order, all region space returned.

use std::collections::VecDeque;

use super::*;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

const SLOTS: u32 = 8;
const SLOT_SIZE: usize = 96;
const INLINE_MAX: usize = SLOT_SIZE - HEADER_LEN;
const REGION: usize = 256;
const MAX_FRAME: usize = 1000;

/// A message on the wire: its header and inline body.
struct Msg {
    header: Header,
    body: Vec<u8>,
}

#[derive(Debug, PartialEq, Eq)]
enum Got {
    Frame(Vec<u8>),
    Oversized(usize),
}

/// One endpoint: its sending state towards the peer and its receiving state.
struct Side {
    // sending
    queue: VecDeque<(Vec<u8>, usize)>,
    credits: CreditWindow,
    writer: RegionWriter,
    // receiving
    ring: RecvRing,
    posted: u32,
    reader: RegionReader,
    region: Vec<u8>,
    occupied: Vec<bool>,
    reassembly: Reassembly,
    held: Vec<Vec<u8>>,
    kept_forever: usize,
    got: Vec<Got>,
}

impl Side {
    fn new() -> Side {
        Side {
            queue: VecDeque::new(),
            credits: CreditWindow::new(SLOTS),
            writer: RegionWriter::new(REGION as u64),
            ring: RecvRing::new(SLOTS),
            posted: SLOTS,
            reader: RegionReader::new(REGION as u64),
            region: vec![0; REGION],
            occupied: vec![false; REGION],
            reassembly: Reassembly::new(MAX_FRAME, 4 * MAX_FRAME, 20),
            held: Vec::new(),
            kept_forever: 0,
            got: Vec::new(),
        }
    }
}

fn stamp(h: &mut Header, me: &mut Side) {
    h.credits = me.ring.take_credits();
    h.freed_to = me.reader.report();
}

/// Sends what `me` may send to `peer` now; returns how many messages went.
fn pump(me: &mut Side, peer: &mut Side, wire: &mut VecDeque<Msg>) -> usize {
    let mut sent = 0;
    while let Some((frame, done)) = me.queue.front_mut() {
        let mut header;
        let body;
        match route(frame.len(), INLINE_MAX, me.writer.max_chunk() as usize) {
            Route::Inline => {
                if !me.credits.take_data() {
                    break;
                }
                header = Header::new(Kind::Inline);
                header.len = frame.len() as u32;
                body = frame.clone();
                *done = frame.len();
            }
            Route::Region | Route::Chunked => {
                let n = (frame.len() - *done).min(me.writer.max_chunk() as usize);
                if me.credits.available() < 2 {
                    break;
                }
                let Some(pos) = me.writer.alloc(n as u64) else {
                    break;
                };
                assert!(me.credits.take_data());
                // The RDMA WRITE: lands in the peer's region before the SEND.
                let off = me.writer.offset(pos);
                for i in off..off + n {
                    assert!(!peer.occupied[i], "region write into space not freed");
                    peer.occupied[i] = true;
                }
                peer.region[off..off + n].copy_from_slice(&frame[*done..*done + n]);
                header = Header::new(Kind::Chunk);
                header.len = n as u32;
                header.pos = pos;
                if *done == 0 {
                    header.flags |= FIRST;
                    header.total = frame.len() as u32;
                }
                *done += n;
                if *done == frame.len() {
                    header.flags |= LAST;
                }
                body = Vec::new();
            }
        }
        let complete = *done == frame.len();
        stamp(&mut header, me);
        wire.push_back(Msg { header, body });
        sent += 1;
        if complete {
            me.queue.pop_front();
        }
    }
    if (me.ring.wants_credit_message() || me.reader.wants_report()) && me.credits.take_control() {
        let mut header = Header::new(Kind::Credit);
        stamp(&mut header, me);
        wire.push_back(Msg {
            header,
            body: Vec::new(),
        });
        sent += 1;
    }
    sent
}

/// `me` receives one message.
fn receive(me: &mut Side, msg: Msg) {
    assert!(
        me.posted > 0,
        "message arrived with no receive posted (RNR)"
    );
    me.posted -= 1;
    let mut bytes = msg.header.to_bytes().to_vec();
    bytes.extend_from_slice(&msg.body);
    let h = Header::decode(&bytes, bytes.len()).expect("valid header");
    me.ring.on_arrival().expect("credit held");
    // What the peer returns applies to `me`'s sending side.
    me.credits.grant(h.credits).expect("credits");
    me.writer.on_freed(h.freed_to).expect("freed_to");
    let repost = |me: &mut Side| {
        me.posted += 1;
        me.ring.on_reposted();
    };
    match h.kind {
        Kind::Inline => {
            let frame = msg.body;
            if let Some(v) = me.reassembly.check_len(frame.len(), &frame) {
                let Assembled::Oversized { len, .. } = v else {
                    panic!("too large inline")
                };
                me.got.push(Got::Oversized(len));
                repost(me);
            } else {
                match me.ring.deliver() {
                    Delivery::ZeroCopy => me.held.push(frame.clone()),
                    Delivery::Copy => repost(me),
                }
                me.got.push(Got::Frame(frame));
            }
        }
        Kind::Chunk => {
            // Zero-copy frames still held come first in order: "deliver" them.
            let off = me.reader.accept(h.pos, h.len.into()).expect("valid chunk");
            let n = h.len as usize;
            let data = me.region[off..off + n].to_vec();
            for o in &mut me.occupied[off..off + n] {
                *o = false;
            }
            me.reader.free_all();
            match me
                .reassembly
                .chunk(h.flags, h.total, &data)
                .expect("sequence")
            {
                Some(Assembled::Frame(f)) => me.got.push(Got::Frame(f)),
                Some(Assembled::Oversized { len, .. }) => me.got.push(Got::Oversized(len)),
                Some(Assembled::TooLarge { .. }) => panic!("too large"),
                None => {}
            }
            repost(me);
        }
        Kind::Credit | Kind::Close => repost(me),
    }
}

fn frame(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| (i * 31 + k * 7) as u8).collect()
}

fn pick_len(rng: &mut XorShift) -> usize {
    let thresholds = [0, INLINE_MAX, REGION / 2, REGION, MAX_FRAME, 2 * REGION];
    if rng.below(2) == 0 {
        let t = thresholds[rng.below(thresholds.len() as u64) as usize];
        (t + rng.below(3) as usize).saturating_sub(1)
    } else {
        rng.below(3 * REGION as u64 + 100) as usize
    }
}

fn run(seed: u64, steps: usize) {
    let mut rng = XorShift(seed | 1);
    let mut a = Side::new();
    let mut b = Side::new();
    // Messages on the wire towards b and towards a.
    let mut to_b: VecDeque<Msg> = VecDeque::new();
    let mut to_a: VecDeque<Msg> = VecDeque::new();
    let mut expect_b = Vec::new();
    let mut expect_a = Vec::new();
    let mut next = 0;
    b.kept_forever = rng.below(4) as usize;
    let check = |a: &Side, b: &Side, to_b: &VecDeque<Msg>, to_a: &VecDeque<Msg>| {
        // Credit conservation, and: posted slots cover every credit and message in flight.
        // (credits returned travel on the other direction's wire).
        let carried =
            |w: &VecDeque<Msg>| w.iter().map(|m| u32::from(m.header.credits)).sum::<u32>();
        assert_eq!(
            a.credits.available() + to_b.len() as u32 + b.ring.outstanding() + carried(to_a),
            SLOTS
        );
        assert_eq!(
            b.credits.available() + to_a.len() as u32 + a.ring.outstanding() + carried(to_b),
            SLOTS
        );
        assert!(b.posted >= a.credits.available() + to_b.len() as u32);
        assert!(a.posted >= b.credits.available() + to_a.len() as u32);
    };
    for _ in 0..steps {
        match rng.below(10) {
            0 | 1 => {
                let len = pick_len(&mut rng);
                let f = frame(next, len);
                next += 1;
                let want = if len > MAX_FRAME {
                    Got::Oversized(len)
                } else {
                    Got::Frame(f.clone())
                };
                if rng.below(3) == 0 {
                    b.queue.push_back((f, 0));
                    expect_a.push(want);
                } else {
                    a.queue.push_back((f, 0));
                    expect_b.push(want);
                }
            }
            2 => {
                pump(&mut a, &mut b, &mut to_b);
            }
            3 => {
                pump(&mut b, &mut a, &mut to_a);
            }
            4 | 5 => {
                if let Some(m) = to_b.pop_front() {
                    receive(&mut b, m);
                }
            }
            6 | 7 => {
                if let Some(m) = to_a.pop_front() {
                    receive(&mut a, m);
                }
            }
            _ => {
                for side in [&mut a, &mut b] {
                    let keep = side.kept_forever;
                    if side.held.len() > keep {
                        let i = keep + rng.below((side.held.len() - keep) as u64) as usize;
                        side.held.remove(i);
                        side.posted += 1;
                        side.ring.on_released();
                    }
                }
            }
        }
        check(&a, &b, &to_b, &to_a);
    }
    // Drain: the application releases what it does not keep forever; the
    // peers pump until nothing moves.
    for _ in 0..100_000 {
        let mut moved = pump(&mut a, &mut b, &mut to_b) + pump(&mut b, &mut a, &mut to_a);
        while let Some(m) = to_b.pop_front() {
            receive(&mut b, m);
            moved += 1;
        }
        while let Some(m) = to_a.pop_front() {
            receive(&mut a, m);
            moved += 1;
        }
        for side in [&mut a, &mut b] {
            while side.held.len() > side.kept_forever {
                side.held.pop().expect("held");
                side.posted += 1;
                side.ring.on_released();
                moved += 1;
            }
        }
        check(&a, &b, &to_b, &to_a);
        if moved == 0 {
            break;
        }
    }
    assert!(
        a.queue.is_empty() && b.queue.is_empty(),
        "seed {seed}: stalled"
    );
    for (side, expect, name) in [(&a, expect_a, "a"), (&b, expect_b, "b")] {
        assert!(
            side.got == expect,
            "seed {seed}: {name} frames differ or out of order"
        );
        assert_eq!(
            side.writer.in_use(),
            0,
            "seed {seed}: region space not returned"
        );
    }
}

#[test]
fn randomized_two_endpoints() {
    for seed in 1..=300u64 {
        run(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), 2000);
    }
}

#[test]
fn one_way_bulk_with_stingy_app() {
    let mut a = Side::new();
    let mut b = Side::new();
    b.kept_forever = (SLOTS / 2) as usize;
    let mut to_b = VecDeque::new();
    let mut to_a = VecDeque::new();
    let frames: Vec<_> = (0..500)
        .map(|i| frame(i, (i * 37) % (3 * REGION)))
        .collect();
    for f in &frames {
        a.queue.push_back((f.clone(), 0));
    }
    for _ in 0..100_000 {
        let moved = pump(&mut a, &mut b, &mut to_b) + pump(&mut b, &mut a, &mut to_a);
        let mut got = 0;
        while let Some(m) = to_b.pop_front() {
            receive(&mut b, m);
            got += 1;
        }
        while let Some(m) = to_a.pop_front() {
            receive(&mut a, m);
            got += 1;
        }
        if moved + got == 0 {
            break;
        }
    }
    assert!(a.queue.is_empty(), "the sender stalled");
    let want: Vec<_> = frames.into_iter().map(Got::Frame).collect();
    assert!(b.got == want, "frames differ or out of order");
}
