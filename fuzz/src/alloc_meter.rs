//! A global allocator that counts the bytes live on the heap, per thread,
//! so a target can check how much memory a state machine holds after an
//! input.
//!
//! Per thread, not per process: `cargo test` runs the checks on several
//! threads at once, and libFuzzer's own threads (its RSS watcher, its
//! timer) must not count against the input being run. An allocation is
//! counted on the thread that makes it and uncounted on the thread that
//! frees it, so a thread's count can drop below where it started (memory
//! handed over by another thread and freed here); [`held_since`] reads that
//! as nothing held.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counting live bytes per thread.
pub struct CountingAlloc;

thread_local! {
    // `const`-initialised, no destructor: reading it never allocates and
    // works during thread teardown.
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    // `try_with` cannot fail for a const, destructor-less local; it is
    // used anyway so a future change cannot make the allocator panic.
    let _ = LIVE.try_with(|live| live.set(live.get().wrapping_add(delta)));
}

// SAFETY: every call forwards to `System` with the caller's own arguments,
// so `System`'s guarantees carry over; the counter is only arithmetic on a
// thread-local that needs no allocation.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which is `System`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, i.e. from `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::realloc`'s contract, which is `System`'s.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Bytes this thread allocated and not freed, so far (a mark for
/// [`held_since`]).
pub fn live_bytes() -> isize {
    LIVE.with(Cell::get)
}

/// Bytes this thread allocated since `mark` (a [`live_bytes`] reading) and
/// still holds; 0 if it freed more than it allocated since.
pub fn held_since(mark: isize) -> usize {
    usize::try_from(live_bytes().wrapping_sub(mark)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_this_threads_allocations_only() {
        let mark = live_bytes();
        let mine = vec![0u8; 10_000];
        // Another thread's allocations, held while we read, do not count here.
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            let theirs = vec![0u8; 1 << 20];
            tx.send(()).unwrap();
            done_rx.recv().unwrap();
            drop(theirs);
        });
        rx.recv().unwrap();
        let held = held_since(mark);
        done_tx.send(()).unwrap();
        other.join().unwrap();
        assert!((10_000..1 << 20).contains(&held), "{held}");
        drop(mine);
        assert!(held_since(mark) < 10_000, "{}", held_since(mark));
    }
}
