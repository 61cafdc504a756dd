//! The first slots of receive rings: pieces of a few registrations shared
//! by the connections of a protection domain, instead of a registration
//! per connection end.
//!
//! An idle end keeps its ring's first slots (64 KiB by default) and
//! nothing else registered; with a registration each, a thousand ends
//! held a thousand MRs. Here an end takes a piece of a chunk, one
//! registration holding up to [`MAX_PIECES`] pieces, and gives it back
//! when its memory is freed (after its queue pair is destroyed, so no
//! receive is posted into it). A chunk is made when every piece of the
//! others is taken, as large as they are together (1, 1, 2, 4, … pieces,
//! up to `MAX_PIECES`), so what is registered stays under twice the most
//! pieces ever taken at once (two set-ups at once may each make a chunk);
//! a chunk is deregistered when its last piece comes back. One end alone
//! registers exactly its piece, as before. Admission
//! ([`RdmaTransport::max_pinned_bytes`](crate::RdmaTransport::max_pinned_bytes))
//! counts each end's piece; the free pieces of chunks still in use are
//! not counted against it.
//!
//! Receives need only local write: no peer can reach a chunk, so sharing
//! one registration between connections hands no peer anything (the
//! peer-reachable memory goes through windows bound to one queue pair:
//! see [`ProtectionDomain::shared`]).

use std::sync::{Arc, Mutex};

use crate::verbs::{Access, MemoryRegion, ProtectionDomain, PAGE};

/// Most pieces in one chunk (1 MiB of the default 64 KiB pieces).
const MAX_PIECES: u32 = 16;

/// One registration, cut into pieces of `piece_len` bytes.
struct Chunk(MemoryRegion);

// SAFETY: the registration is made before the chunk is shared and
// undone only when the last reference drops (it is never
// `deregister`ed), so nothing changes it while it is shared; its bytes
// are read and written only through raw copies and the `unsafe` slices
// of `SlotMemory`, each piece by the one connection that took it (see
// `Buffers`' own `Sync`), and pieces do not overlap.
unsafe impl Sync for Chunk {}

/// A chunk in the pool, with the pieces not taken.
struct Pooled {
    /// The protection domain's address (the pool's key, with
    /// `piece_len`; a chunk holds its domain, so the address is not reused
    /// while the chunk lives).
    pd: usize,
    piece_len: usize,
    chunk: Arc<Chunk>,
    pieces: u32,
    free: Vec<u32>,
}

/// Every chunk of the process, in the order they were made: a piece is
/// taken from the oldest (smallest) chunk with one free, so the later,
/// larger chunks empty first when connections close.
static POOL: Mutex<Vec<Pooled>> = Mutex::new(Vec::new());

fn pool() -> std::sync::MutexGuard<'static, Vec<Pooled>> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// How many pieces the next chunk holds, with `capacity` pieces in the
/// chunks there are (all taken): as many again, at least one, at most
/// [`MAX_PIECES`].
fn next_chunk_pieces(capacity: u32) -> u32 {
    capacity.clamp(1, MAX_PIECES)
}

/// The first slots of one connection end's receive ring: `len` bytes of
/// a registration shared with other ends on the same protection domain,
/// given back when dropped.
pub(super) struct FirstSlots {
    chunk: Arc<Chunk>,
    index: u32,
    /// Where the piece starts in the chunk (`index` × the pieces'
    /// length, kept: every slot lookup on the call path reads it).
    offset: usize,
    len: usize,
}

impl FirstSlots {
    /// A piece of `len` bytes on `pd` (registered for local write),
    /// from a chunk with one free or a new chunk. Fails only if the
    /// device or the locked-memory limit refuses a new chunk's
    /// registration.
    pub(super) fn take(
        pd: &ProtectionDomain,
        len: usize,
    ) -> Result<FirstSlots, crate::verbs::Error> {
        // Pieces start on pages of their own, as a registration of its own
        // would: no piece shares a page with another connection's.
        let piece_len = len.next_multiple_of(PAGE);
        let key = Arc::as_ptr(&pd.inner) as usize;
        let pieces = {
            let mut pool = pool();
            let mut capacity = 0;
            for pooled in pool
                .iter_mut()
                .filter(|p| p.pd == key && p.piece_len == piece_len)
            {
                if let Some(index) = pooled.free.pop() {
                    return Ok(FirstSlots {
                        chunk: Arc::clone(&pooled.chunk),
                        index,
                        offset: index as usize * piece_len,
                        len,
                    });
                }
                capacity += pooled.pieces;
            }
            next_chunk_pieces(capacity)
        };
        // Registered without the lock: other ends' set-ups and closes go
        // on meanwhile (two set-ups at once may each make a chunk).
        let mr = MemoryRegion::new(pd, pieces as usize * piece_len, Access::LOCAL_WRITE)?;
        let chunk = Arc::new(Chunk(mr));
        pool().push(Pooled {
            pd: key,
            piece_len,
            chunk: Arc::clone(&chunk),
            pieces,
            // Index 0 is taken now; the lowest free index is taken first.
            free: (1..pieces).rev().collect(),
        });
        Ok(FirstSlots {
            chunk,
            index: 0,
            offset: 0,
            len,
        })
    }

    /// The registration the piece lies in, and where in it the piece
    /// starts.
    pub(super) fn region(&self) -> (&MemoryRegion, usize) {
        (&self.chunk.0, self.offset)
    }

    /// Its length in bytes.
    pub(super) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for FirstSlots {
    fn drop(&mut self) {
        let emptied = {
            let mut pool = pool();
            let Some(at) = pool.iter().position(|p| Arc::ptr_eq(&p.chunk, &self.chunk)) else {
                unreachable!("a chunk stays in the pool while a piece of it is taken");
            };
            let pooled = &mut pool[at];
            pooled.free.push(self.index);
            (pooled.free.len() == pooled.pieces as usize).then(|| pool.remove(at))
        };
        // The last piece back: the chunk is deregistered (when this
        // piece's reference drops too), outside the pool's lock.
        drop(emptied);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunks made for `ends` pieces taken one after another, none
    /// given back.
    fn chunks_for(ends: u32) -> Vec<u32> {
        let mut chunks = Vec::new();
        let mut capacity = 0;
        for taken in 0..ends {
            if taken == capacity {
                chunks.push(next_chunk_pieces(capacity));
                capacity += chunks.last().unwrap();
            }
        }
        chunks
    }

    #[test]
    fn one_end_registers_its_piece_alone() {
        assert_eq!(chunks_for(1), [1]);
        assert_eq!(chunks_for(2), [1, 1]);
    }

    #[test]
    fn chunks_double_up_to_their_largest() {
        assert_eq!(chunks_for(32), [1, 1, 2, 4, 8, 16]);
        let two_hundred = chunks_for(200);
        assert_eq!(two_hundred.len(), 17);
        assert_eq!(two_hundred.iter().sum::<u32>(), 208);
        assert!(two_hundred[5..].iter().all(|&n| n == MAX_PIECES));
    }

    #[test]
    fn what_is_registered_stays_under_twice_what_is_taken() {
        for ends in 1..2_000 {
            let registered: u32 = chunks_for(ends).iter().sum();
            assert!(registered < 2 * ends, "{ends} ends: {registered} pieces");
        }
    }
}
