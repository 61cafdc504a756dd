//! Destinations of the peers' rendezvous transfers: registered memory the
//! receiving side RDMA READs a frame into and hands up as `Bytes` in
//! place ([`PoolBuffer`]), from one pool a transport's connections share
//! ([`RendezvousPool`]).
//!
//! The pool is a budget of bytes (charged in whole pages,
//! [`proto::pool_charge`]) given to the connections' transfers first come
//! first served: a transfer that does not fit waits, and so does every
//! transfer that arrives after it, on any connection, until the
//! application releases enough (no starvation, and no memory beyond the
//! budget). Each connection reaches the pool through a [`PoolShare`]
//! (what its protocol charges) and a [`PoolWait`] (how its driver learns
//! that room came). Destinations released are kept registered as spares
//! for later transfers of their size on the same protection domain (all
//! of a device's connections, by default); spares count in the budget and
//! are let go, oldest first, when a transfer needs their room.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::wake::DriverWake;
use crate::proto::{self, PoolRoom};
use crate::verbs::{Access, MemoryRegion, ProtectionDomain};

/// A rendezvous destination: registered memory for local write only (the
/// peer can never write it), known to [`pool_contains`] while it lives.
pub(crate) struct PoolBuffer {
    pub(super) mr: MemoryRegion,
}

/// Address ranges of the live rendezvous destinations (for tests proving
/// frames are handed up in place).
static POOL_RANGES: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

impl PoolBuffer {
    /// A destination for frames of up to `len` bytes, registered in whole
    /// pages (what the pool charges): a spare fits any frame of its charge.
    fn new(pd: &ProtectionDomain, len: usize) -> Result<PoolBuffer, crate::verbs::Error> {
        let whole_pages = proto::pool_charge(len) as usize;
        let mr = MemoryRegion::new(pd, whole_pages, Access::LOCAL_WRITE)?;
        // SAFETY: an empty slice at the start: covers no byte.
        let start = unsafe { mr.slice(0..0) }.as_ptr() as usize;
        POOL_RANGES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((start, start + mr.len()));
        Ok(PoolBuffer { mr })
    }
}

impl Drop for PoolBuffer {
    fn drop(&mut self) {
        // SAFETY: an empty slice at the start: covers no byte.
        let start = unsafe { self.mr.slice(0..0) }.as_ptr() as usize;
        let mut ranges = POOL_RANGES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = ranges.iter().position(|r| r.0 == start) {
            ranges.swap_remove(i);
        }
    }
}

/// Destinations the application released, kept registered for later
/// transfers of the same size: registering fresh memory for each costs
/// more than a copy of it (its pages are touched for the first time, then
/// pinned), and tensors of a workload come in a few sizes again and again.
/// They count against the pool's budget with the destinations in use
/// ([`trim`](Self::trim)), so the pool never pins more than it allows.
pub(super) struct SpareDestinations<B = PoolBuffer> {
    /// Oldest first.
    buffers: VecDeque<B>,
    bytes: u64,
}

impl<B> Default for SpareDestinations<B> {
    fn default() -> Self {
        SpareDestinations {
            buffers: Default::default(),
            bytes: 0,
        }
    }
}

/// A destination, as the pool charges it.
pub(super) trait Charged {
    /// Its length in whole pages.
    fn charge(&self) -> u64;
}

impl Charged for PoolBuffer {
    fn charge(&self) -> u64 {
        proto::pool_charge(self.mr.len())
    }
}

impl<B: Charged> SpareDestinations<B> {
    /// A spare for a frame of `len` bytes: one of the same pool charge.
    pub(super) fn take(&mut self, len: usize) -> Option<B> {
        self.take_where(len, |_| true)
    }

    /// A spare for a frame of `len` bytes, of the same pool charge, that
    /// `usable` accepts.
    fn take_where(&mut self, len: usize, usable: impl Fn(&B) -> bool) -> Option<B> {
        let charge = proto::pool_charge(len);
        let at = self
            .buffers
            .iter()
            .position(|b| b.charge() == charge && usable(b))?;
        let buffer = self.buffers.remove(at)?;
        self.bytes -= charge;
        Some(buffer)
    }

    /// Bytes of the spares kept.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keeps `buffer` (released by the application) for later.
    pub(super) fn keep(&mut self, buffer: B) {
        self.bytes += buffer.charge();
        self.buffers.push_back(buffer);
    }

    /// Lets go of the oldest spares until, with `in_use` bytes charged to
    /// destinations, they fit `budget`; returns them (to be freed where
    /// the caller chooses: outside a lock others wait on).
    #[must_use = "the spares let go are freed when dropped"]
    pub(super) fn trim(&mut self, in_use: u64, budget: u64) -> Vec<B> {
        let mut gone = Vec::new();
        while in_use + self.bytes > budget {
            let Some(oldest) = self.buffers.pop_front() else {
                break;
            };
            self.bytes -= oldest.charge();
            gone.push(oldest);
        }
        gone
    }

    /// Lets go of the spares `theirs` accepts; returns them.
    fn remove_where(&mut self, theirs: impl Fn(&B) -> bool) -> Vec<B> {
        let (gone, kept): (VecDeque<B>, VecDeque<B>) =
            self.buffers.drain(..).partition(|b| theirs(b));
        self.buffers = kept;
        self.bytes -= gone.iter().map(Charged::charge).sum::<u64>();
        gone.into()
    }
}

/// Whether `ptr` points into a live rendezvous destination.
pub(crate) fn pool_contains(ptr: *const u8) -> bool {
    let p = ptr as usize;
    POOL_RANGES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|&(start, end)| (start..end).contains(&p))
}

/// The rendezvous pool of a transport's connections.
pub(crate) struct RendezvousPool {
    state: Mutex<PoolState>,
}

struct PoolState {
    /// The most bytes charged to destinations and spares at once.
    budget: u64,
    /// Bytes charged to destinations (being read, or delivered and not
    /// yet released).
    in_use: u64,
    /// Connections whose oldest transfer waits for room, first come first.
    waiting: VecDeque<Arc<Waiter>>,
    spares: SpareDestinations,
    /// Connections with a share: the spares go with the last.
    shares: usize,
    /// When a transfer waiting was last logged.
    logged_wait: Option<std::time::Instant>,
}

/// A connection in the pool's queue.
struct Waiter {
    /// Told room may have come, not yet acted on by the driver.
    room: AtomicBool,
    /// The connection's driver ended: it takes nothing more.
    gone: AtomicBool,
    driver: Arc<DriverWake>,
}

impl PoolState {
    /// Says (at most once a minute) that a transfer waits: back pressure
    /// as designed, or an application that holds the frames it received
    /// while it waits for more, which then waits until its deadline.
    fn log_wait(&mut self, charge: u64) {
        const EVERY: std::time::Duration = std::time::Duration::from_secs(60);
        let now = std::time::Instant::now();
        if self
            .logged_wait
            .is_some_and(|at| now.duration_since(at) < EVERY)
        {
            return;
        }
        self.logged_wait = Some(now);
        tracing::warn!(
            "rdma: a rendezvous transfer of {charge} bytes waits for room in the pool: \
             {} of its {} bytes are in frames the application has not dropped yet \
             ({} connection(s) waiting; an application that keeps its frames while \
             it waits for more needs a larger RdmaTransport::rendezvous_pool)",
            self.in_use,
            self.budget,
            self.waiting.len()
        );
    }

    /// Tells the first connection waiting that room may have come.
    fn tell_first(&self) {
        if let Some(first) = self.waiting.front() {
            first.room.store(true, Ordering::Release);
            first.driver.notify();
        }
    }

    /// Takes `waiter` out of the queue, and tells the first one left (it
    /// may be first now, or room may have come with the leaver's bytes).
    fn leave_queue(&mut self, waiter: &Arc<Waiter>) {
        self.waiting.retain(|w| !Arc::ptr_eq(w, waiter));
        self.tell_first();
    }
}

impl std::fmt::Debug for RendezvousPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.lock();
        f.debug_struct("RendezvousPool")
            .field("budget", &st.budget)
            .field("in_use", &st.in_use)
            .field("spares", &st.spares.bytes())
            .field("waiting", &st.waiting.len())
            .finish()
    }
}

impl RendezvousPool {
    /// A pool of `budget` bytes.
    pub(crate) fn new(budget: u64) -> RendezvousPool {
        RendezvousPool {
            state: Mutex::new(PoolState {
                budget,
                in_use: 0,
                waiting: VecDeque::new(),
                spares: SpareDestinations::default(),
                shares: 0,
                logged_wait: None,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most bytes it charges at once.
    pub(crate) fn budget(&self) -> u64 {
        self.lock().budget
    }

    /// Raises the budget to at least `charge` (a frame the limits admit
    /// fits on its own: it never waits for room that cannot come).
    pub(crate) fn fit(&self, charge: u64) {
        let mut st = self.lock();
        st.budget = st.budget.max(charge);
    }

    /// A connection's share of the pool, and its driver's end of the queue
    /// (`driver` is woken when room may have come). A connection on a
    /// domain of its own (`own_pd`: one not shared) takes its spares with
    /// it when its share is dropped.
    pub(super) fn share(
        self: &Arc<Self>,
        driver: Arc<DriverWake>,
        own_pd: Option<ProtectionDomain>,
    ) -> (PoolShare, PoolWait) {
        self.lock().shares += 1;
        let waiter = Arc::new(Waiter {
            room: AtomicBool::new(false),
            gone: AtomicBool::new(false),
            driver,
        });
        let share = PoolShare {
            pool: Arc::clone(self),
            waiter: Arc::clone(&waiter),
            held: 0,
            queued: false,
            told: false,
            own_pd,
        };
        let wait = PoolWait {
            pool: Arc::clone(self),
            waiter,
        };
        (share, wait)
    }

    /// A destination on `pd` for a frame of `len` bytes, already charged
    /// ([`PoolShare`]): a spare of its size, else fresh memory, registered
    /// once spares were let go to make its room.
    pub(super) fn destination(
        &self,
        pd: &ProtectionDomain,
        len: usize,
    ) -> Result<PoolBuffer, crate::verbs::Error> {
        let gone = {
            let mut st = self.lock();
            if let Some(spare) = st.spares.take_where(len, |b| b.mr.is_in(pd)) {
                return Ok(spare);
            }
            let (in_use, budget) = (st.in_use, st.budget);
            st.spares.trim(in_use, budget)
        };
        // Deregistered without the pool's lock.
        drop(gone);
        PoolBuffer::new(pd, len)
    }

    /// Keeps a destination the application released as a spare, before
    /// its charge is given back ([`PoolShare::give_back`], which lets
    /// spares go while they do not fit): so the first connection waiting,
    /// told of the room then, finds it.
    pub(super) fn keep(&self, destination: PoolBuffer) {
        self.lock().spares.keep(destination);
    }
}

/// What a connection's protocol charges to the pool ([`PoolRoom`]).
pub(super) struct PoolShare {
    pool: Arc<RendezvousPool>,
    waiter: Arc<Waiter>,
    /// Bytes charged to this connection's destinations.
    held: u64,
    /// In the pool's queue.
    queued: bool,
    /// Told room may have come since it last tried.
    told: bool,
    /// The connection's own domain, if not shared: its spares are of use
    /// to no other connection.
    own_pd: Option<ProtectionDomain>,
}

impl std::fmt::Debug for PoolShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolShare")
            .field("held", &self.held)
            .field("queued", &self.queued)
            .field("pool", &self.pool)
            .finish()
    }
}

impl PoolRoom for PoolShare {
    fn try_take(&mut self, charge: u64) -> bool {
        // Queued, it waits to be told (so a pass with no input to this
        // connection takes nothing: the protocol's `settled` holds).
        if self.queued && !std::mem::take(&mut self.told) {
            return false;
        }
        if self.waiter.gone.load(Ordering::Acquire) {
            return false;
        }
        let mut st = self.pool.lock();
        let first = st
            .waiting
            .front()
            .is_none_or(|w| Arc::ptr_eq(w, &self.waiter));
        if first && st.in_use + charge <= st.budget {
            st.in_use += charge;
            self.held += charge;
            if self.queued {
                st.waiting.pop_front();
                self.queued = false;
                // The next may fit in what is left.
                st.tell_first();
            }
            return true;
        }
        if !self.queued {
            st.waiting.push_back(Arc::clone(&self.waiter));
            self.queued = true;
            st.log_wait(charge);
        }
        false
    }

    fn give_back(&mut self, charge: u64) {
        let charge = charge.min(self.held);
        self.held -= charge;
        let gone = {
            let mut st = self.pool.lock();
            st.in_use -= charge;
            let (in_use, budget) = (st.in_use, st.budget);
            let gone = st.spares.trim(in_use, budget);
            st.tell_first();
            gone
        };
        // Deregistered without the pool's lock.
        drop(gone);
    }

    fn room_freed(&mut self) {
        self.told = true;
    }

    fn budget(&self) -> u64 {
        self.pool.budget()
    }
}

impl Drop for PoolShare {
    fn drop(&mut self) {
        let gone = {
            let mut st = self.pool.lock();
            st.in_use -= self.held;
            st.leave_queue(&self.waiter);
            st.shares -= 1;
            match &self.own_pd {
                // No connection left to use them: memory back to what it
                // was before the first.
                _ if st.shares == 0 => st.spares.remove_where(|_| true),
                Some(pd) => st.spares.remove_where(|b| b.mr.is_in(pd)),
                None => Vec::new(),
            }
        };
        drop(gone);
    }
}

/// A connection driver's end of the pool's queue.
pub(super) struct PoolWait {
    pool: Arc<RendezvousPool>,
    waiter: Arc<Waiter>,
}

impl PoolWait {
    /// Whether the connection was told room may have come since last asked.
    pub(super) fn room_came(&self) -> bool {
        self.waiter.room.load(Ordering::Relaxed) && self.waiter.room.swap(false, Ordering::Acquire)
    }

    /// The driver ends: the connection takes nothing more, and leaves the
    /// queue to the others.
    pub(super) fn leave(&self) {
        self.waiter.gone.store(true, Ordering::Release);
        self.pool.lock().leave_queue(&self.waiter);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(u64);

    impl Charged for Fake {
        fn charge(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn spares_are_taken_by_charge_and_trimmed_oldest_first_to_the_budget() {
        let mut spares = SpareDestinations::default();
        spares.keep(Fake(8192));
        spares.keep(Fake(4096));
        spares.keep(Fake(8192));
        assert!(spares.take(100_000).is_none(), "no spare of that size");
        assert_eq!(
            spares.take(5000).map(|b| b.0),
            Some(8192),
            "8192 bytes charged"
        );
        assert_eq!(spares.bytes, 4096 + 8192);
        // 4096 in use and a budget of 12288: the oldest spare goes.
        let gone = spares.trim(4096, 12288);
        assert_eq!(gone.iter().map(|b| b.0).collect::<Vec<_>>(), [4096]);
        assert_eq!(spares.bytes, 8192);
        assert_eq!(
            spares.take(4096).map(|b| b.0),
            None,
            "the 4096 one was the oldest"
        );
        assert_eq!(spares.trim(12288, 12288).len(), 1);
        assert_eq!(spares.bytes, 0);
        assert!(spares.take(8192).is_none());
    }

    /// A connection's two ends of the pool, and its driver's wake.
    fn connection(pool: &Arc<RendezvousPool>) -> (PoolShare, PoolWait, Arc<DriverWake>) {
        let driver = Arc::new(DriverWake::default());
        let (share, wait) = pool.share(Arc::clone(&driver), None);
        (share, wait, driver)
    }

    /// Whether a driver was notified (its next wait would end at once).
    fn notified(driver: &DriverWake) -> bool {
        let cx = std::task::Context::from_waker(std::task::Waker::noop());
        driver.poll_notified(&cx).is_ready()
    }

    #[test]
    fn connections_share_the_pool_first_come_first_served() {
        let pool = Arc::new(RendezvousPool::new(10 * 4096));
        let (mut a, wait_a, driver_a) = connection(&pool);
        let (mut b, wait_b, driver_b) = connection(&pool);
        let (mut c, wait_c, driver_c) = connection(&pool);
        assert!(a.try_take(8 * 4096));
        // B's transfer does not fit: it waits, and C's, which would fit,
        // waits behind it.
        assert!(!b.try_take(4 * 4096));
        assert!(!c.try_take(4096));
        // Not told yet: B does not even look (a pass with no input takes
        // nothing).
        b.room_freed();
        assert!(!b.try_take(4 * 4096), "still no room");
        assert!(!notified(&driver_b) && !wait_b.room_came());
        // A gives back: B, first, is told; C is not.
        a.give_back(8 * 4096);
        assert!(notified(&driver_b) && wait_b.room_came());
        assert!(!wait_b.room_came(), "told once");
        assert!(!notified(&driver_c) && !wait_c.room_came());
        assert!(!c.try_take(4096), "C waits to be told");
        b.room_freed();
        assert!(b.try_take(4 * 4096));
        // B took its room: C, now first, is told and takes what is left.
        assert!(wait_c.room_came());
        c.room_freed();
        assert!(c.try_take(4096));
        assert!(!notified(&driver_a) && !wait_a.room_came());
        // A new transfer of A's fits in what is left, no one waiting.
        assert!(a.try_take(5 * 4096));
        assert!(!a.try_take(4096), "full");
        assert_eq!(pool.lock().in_use, 10 * 4096);
        drop(wait_a);
        drop(wait_b);
        drop(wait_c);
        drop(driver_a);
        drop(driver_b);
        drop(driver_c);
        // Dropped shares give back what their connections held, and a
        // share waiting leaves the queue.
        drop(b);
        drop(c);
        assert_eq!(pool.lock().in_use, 5 * 4096);
        assert_eq!(pool.lock().waiting.len(), 1, "A waits");
        drop(a);
        let st = pool.lock();
        assert_eq!((st.in_use, st.waiting.len()), (0, 0));
    }

    #[test]
    fn a_connection_whose_driver_ended_leaves_the_queue_to_the_next() {
        let pool = Arc::new(RendezvousPool::new(4 * 4096));
        let (mut a, _wait_a, _driver_a) = connection(&pool);
        let (mut b, wait_b, _driver_b) = connection(&pool);
        let (mut c, wait_c, _driver_c) = connection(&pool);
        assert!(a.try_take(3 * 4096));
        assert!(!b.try_take(2 * 4096));
        assert!(!c.try_take(4096));
        // B's connection fails while first in the queue: C is told, and
        // takes the room B would have held it up for.
        wait_b.leave();
        assert!(wait_c.room_came());
        c.room_freed();
        assert!(c.try_take(4096));
        // B takes nothing more, told or not.
        a.give_back(3 * 4096);
        b.room_freed();
        assert!(!b.try_take(2 * 4096));
        assert_eq!(pool.lock().in_use, 4096);
    }
}
