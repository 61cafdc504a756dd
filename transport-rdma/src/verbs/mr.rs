//! Registered memory.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use rdma_sys as ffi;

use super::pd::PdInner;
use super::{last_os_error, Error, LiveCount, ProtectionDomain, Result};

/// Access rights of a [`MemoryRegion`] (`ibv_access_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access(pub(crate) u32);

impl Access {
    /// The local device may write (needed to receive into it).
    pub const LOCAL_WRITE: Access = Access(ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    /// The peer may RDMA WRITE into it (needs `LOCAL_WRITE` too).
    pub const REMOTE_WRITE: Access = Access(ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0);
    /// The peer may RDMA READ from it.
    pub const REMOTE_READ: Access = Access(ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0);
    /// Memory windows may be bound to it ([`MemoryWindow`](super::MemoryWindow)):
    /// remote access to a part of it, for as long as the window is bound.
    pub const MW_BIND: Access = Access(ffi::ibv_access_flags::IBV_ACCESS_MW_BIND.0);
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// What a peer needs to RDMA into (or out of) a region: its address, key
/// and length. Send it over the connection (e.g. as private data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// The region's address in the peer's address space.
    pub addr: u64,
    /// Its remote key.
    pub rkey: u32,
    /// Its length in bytes.
    pub len: u64,
}

impl RemoteRegion {
    /// Encoded length of [`to_bytes`](Self::to_bytes).
    pub const ENCODED_LEN: usize = 20;

    /// Little-endian `addr, rkey, len`.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0; Self::ENCODED_LEN];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        b[12..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes) (extra bytes, e.g. the
    /// connection manager's zero padding, are ignored).
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let b = b.get(..Self::ENCODED_LEN)?;
        Some(Self {
            addr: u64::from_le_bytes(b[..8].try_into().ok()?),
            rkey: u32::from_le_bytes(b[8..12].try_into().ok()?),
            len: u64::from_le_bytes(b[12..].try_into().ok()?),
        })
    }

    /// Checks that `offset..offset + len` lies inside the region.
    pub(crate) fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                start: offset,
                end: offset.saturating_add(len),
                len: self.len,
            }),
        }
    }
}

/// A zeroed buffer of its own, registered with a protection domain
/// (`ibv_reg_mr`).
///
/// The device reads and writes the buffer behind the program's back. Data
/// goes in and out by raw copies ([`write_at`](Self::write_at),
/// [`read_at`](Self::read_at), [`read_into`](Self::read_into)) at moments
/// the protocol makes safe (after the completion of the operation that
/// filled it, before posting the one that reads it), or through the
/// `unsafe` [`slice`](Self::slice) / [`slice_mut`](Self::slice_mut), whose
/// callers state why nothing else touches the bytes while the slice lives.
/// A region the peer may write ([`Access::REMOTE_WRITE`]) is never
/// borrowed as a slice (those methods panic on it): the peer can write it
/// at any moment, whatever the protocol says, so only copies read it.
///
/// Dropping deregisters the region, then frees the buffer; if
/// `ibv_dereg_mr` fails the device may still use the buffer, so it is
/// leaked (and the failure logged) instead of freed.
///
/// A buffer made [`unregistered`](Self::unregistered) is registered by
/// [`register`](Self::register) when first needed: until then it can be
/// the source of inline sends only (the device copies those out of the
/// work request; their lkey is not used), and pins nothing. The transport
/// may deregister it again while no work request names it (its send slots
/// once idle) and keep its bytes.
pub struct MemoryRegion {
    /// Changed only through `&self` by [`register`](Self::register) and the
    /// `unsafe` [`deregister`](Self::deregister): the type is not `Sync`,
    /// and whoever shares it across threads anyway (the transport's
    /// connection memory) changes and reads a registration that can change
    /// under one lock.
    registration: UnsafeCell<Option<Registration>>,
    buf: NonNull<u8>,
    len: usize,
    access: Access,
    remote_write: bool,
    pub(crate) pd: Arc<PdInner>,
}

/// A [`MemoryRegion`]'s MR.
struct Registration {
    raw: NonNull<ffi::ibv_mr>,
    /// The address remote requests name the buffer's start by: 0 for a
    /// zero-based registration, else the buffer's own address.
    iova: u64,
}

// SAFETY: the MR handle is only passed to libibverbs, whose calls are
// thread-safe; it is freed once, by the owning `MemoryRegion`
// (`deregister` or Drop).
unsafe impl Send for Registration {}
// SAFETY: as for Send.
unsafe impl Sync for Registration {}

// SAFETY: the value owns its buffer and MR handle (libibverbs calls are
// thread-safe); moving it to another thread moves that ownership. It is not
// `Sync`: `write_at` through `&self` from two threads would race.
unsafe impl Send for MemoryRegion {}

impl MemoryRegion {
    /// Allocates `len` zeroed bytes on pages of their own and registers
    /// them on `pd`. Whole pages: registration pins whole pages, so the
    /// buffer shares none with other data and pins nothing beyond itself.
    pub fn new(pd: &ProtectionDomain, len: usize, access: Access) -> Result<Self> {
        let region = Self::unregistered(pd, len, access);
        region.register()?;
        Ok(region)
    }

    /// Allocates `len` zeroed bytes and registers them on `pd` for the
    /// peer to write through a memory window bound over them
    /// ([`QueuePair::post_bind`](super::QueuePair::post_bind) with
    /// [`Access::REMOTE_WRITE`]): the registration itself grants no remote
    /// access ([`Access::LOCAL_WRITE`] and [`Access::MW_BIND`]), and, as
    /// for a region registered [`Access::REMOTE_WRITE`], no slice is ever
    /// formed over its bytes.
    pub fn writable_through_windows(pd: &ProtectionDomain, len: usize) -> Result<Self> {
        let mut region = Self::unregistered(pd, len, Access::LOCAL_WRITE | Access::MW_BIND);
        region.remote_write = true;
        region.register()?;
        Ok(region)
    }

    /// Maps `len` zeroed bytes on pages of their own, to be registered on
    /// `pd` with `access` by [`register`](Self::register) when first
    /// needed. Pins nothing until then, and takes no memory until touched:
    /// an anonymous mapping, whose pages the kernel provides (zeroed) as
    /// they are first written or registered, so slots allocated ahead of
    /// their use (a connection's send slots) cost nothing while unused.
    pub fn unregistered(pd: &ProtectionDomain, len: usize, access: Access) -> Self {
        let len = len.max(1);
        let layout = Self::layout(len);
        // SAFETY: a new anonymous private mapping, placed by the kernel:
        // no memory of this process is affected.
        let mapped = unsafe {
            libc::mmap(
                ptr::null_mut(),
                layout.size(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        let buf = NonNull::new(mapped.cast::<u8>())
            .filter(|_| mapped != libc::MAP_FAILED)
            .unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self {
            registration: UnsafeCell::new(None),
            buf,
            len,
            access,
            remote_write: access.0 & Access::REMOTE_WRITE.0 != 0,
            pd: Arc::clone(&pd.inner),
        }
    }

    /// Registers the buffer (`ibv_reg_mr`), unless it is already. On an
    /// error it stays unregistered; a later call tries again.
    pub fn register(&self) -> Result<()> {
        if self.is_registered() {
            return Ok(());
        }
        let pd = ProtectionDomain {
            inner: Arc::clone(&self.pd),
        };
        if self.access.0 & (Access::LOCAL_WRITE.0 | Access::MW_BIND.0) == 0 {
            // Pinned for reading only, a page never touched would be the
            // kernel's shared zero page, which a later write by this
            // process replaces in its mapping but not in the device's.
            self.touch_pages();
        }
        // SAFETY: `buf..buf+len` is memory this value owns and frees only
        // after deregistering it (Drop).
        let (raw, iova) = unsafe { register(&pd, self.buf.as_ptr(), self.len, self.access)? };
        // Counted from here, so that `deregister` and `Drop` (which
        // subtract) pair with it.
        counted_registration(self.mapped_len() as u64);
        // SAFETY: no reference into the cell lives across this call: the
        // methods that read it copy what they need, and the value is not
        // `Sync` (see the field's docs for who shares it anyway).
        unsafe { *self.registration.get() = Some(Registration { raw, iova }) };
        Ok(())
    }

    /// Deregisters the buffer (`ibv_dereg_mr`) and keeps its bytes: it
    /// pins nothing until [`register`](Self::register)ed again. If the
    /// device refuses, it stays registered.
    ///
    /// # Safety
    /// No work request posted or queued names its keys (they become
    /// invalid), and no other thread reads or changes its registration
    /// meanwhile ([`register`](Self::register), [`lkey`](Self::lkey),
    /// [`remote`](Self::remote), an SGE).
    pub(crate) unsafe fn deregister(&self) -> Result<()> {
        let Some(registration) = self.registration() else {
            return Ok(());
        };
        // SAFETY: `raw` is the live MR this value owns; as the caller
        // guarantees, nothing uses its keys any more.
        let ret = unsafe { ffi::ibv_dereg_mr(registration.raw.as_ptr()) };
        if ret != 0 {
            return Err(Error::DeregMr {
                len: self.len,
                source: super::errno_error(ret),
            });
        }
        counted_deregistration(self.mapped_len() as u64);
        // SAFETY: as the caller guarantees, nothing else reads the cell;
        // `registration` (a copy's source) is not used after this.
        unsafe { *self.registration.get() = None };
        Ok(())
    }

    /// The registration, if any.
    fn registration(&self) -> Option<&Registration> {
        // SAFETY: the cell changes only in `register` and `deregister`,
        // never while a reference from here lives (see the field's docs).
        unsafe { (*self.registration.get()).as_ref() }
    }

    /// Whether the memory belongs to `pd` (works with its queue pairs).
    pub fn is_in(&self, pd: &ProtectionDomain) -> bool {
        Arc::ptr_eq(&self.pd, &pd.inner)
    }

    /// Whether the buffer is registered.
    pub fn is_registered(&self) -> bool {
        self.registration().is_some()
    }

    /// Writes one byte of each page back as it is, so that every page is
    /// this process's own. Only while unregistered: nothing else writes
    /// the buffer then, and the value is not `Sync`.
    fn touch_pages(&self) {
        for offset in (0..self.len).step_by(PAGE) {
            // SAFETY: inside the mapping this value owns; a volatile read
            // and write of the same byte changes nothing it holds.
            unsafe {
                let byte = self.buf.as_ptr().add(offset);
                byte.write_volatile(byte.read_volatile());
            }
        }
    }

    /// The mapping of a `len`-byte buffer: whole pages.
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.next_multiple_of(PAGE), PAGE)
            .expect("a memory region's size fits the address space")
    }

    /// Bytes of its mapping: what it pins while registered.
    fn mapped_len(&self) -> usize {
        Self::layout(self.len).size()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length region (never: [`new`](Self::new) rounds up
    /// to one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The local key, for scatter/gather entries. Panics if the buffer is
    /// not registered.
    pub fn lkey(&self) -> u32 {
        let registration = self.registration().expect("lkey of unregistered memory");
        // SAFETY: `raw` is the live MR this value owns.
        unsafe { registration.raw.as_ref().lkey }
    }

    /// What a peer needs to access the region remotely. Panics if the
    /// buffer is not registered.
    pub fn remote(&self) -> RemoteRegion {
        let registration = self
            .registration()
            .expect("remote access to unregistered memory");
        // SAFETY: `raw` is the live MR this value owns.
        let rkey = unsafe { registration.raw.as_ref().rkey };
        RemoteRegion {
            addr: registration.iova,
            rkey,
            len: self.len as u64,
        }
    }

    /// Checks `range` and returns its address and length for an SGE. An
    /// unregistered buffer gives ranges of at most `inline_max` bytes (a
    /// send the device copies inline; its lkey, 0, is not used) and
    /// refuses longer ones.
    pub(crate) fn sge(&self, range: Range<usize>, inline_max: u32) -> Result<ffi::ibv_sge> {
        self.check(&range)?;
        let length = u32::try_from(range.len()).map_err(|_| Error::OutOfBounds {
            start: range.start as u64,
            end: range.end as u64,
            len: u32::MAX.into(),
        })?;
        let lkey = match self.registration() {
            // SAFETY: `raw` is the live MR this value owns.
            Some(registration) => unsafe { registration.raw.as_ref().lkey },
            None if length <= inline_max => 0,
            None => return Err(Error::NotRegistered { len: length }),
        };
        Ok(ffi::ibv_sge {
            addr: self.buf.as_ptr() as u64 + range.start as u64,
            length,
            lkey,
        })
    }

    /// What a memory window over `range` of it is bound with. Fails if
    /// the range is outside it or it is not registered.
    pub(crate) fn bind_target(&self, range: Range<usize>) -> Result<BindTarget> {
        self.check(&range)?;
        let registration = self.registration().ok_or(Error::NotRegistered {
            len: u32::try_from(range.len()).unwrap_or(u32::MAX),
        })?;
        Ok(BindTarget {
            raw: registration.raw,
            addr: registration.iova + range.start as u64,
            len: range.len() as u64,
            pd: Arc::clone(&self.pd),
            peer_writes: self.remote_write,
        })
    }

    fn check(&self, range: &Range<usize>) -> Result<()> {
        if range.start <= range.end && range.end <= self.len {
            Ok(())
        } else {
            Err(Error::OutOfBounds {
                start: range.start as u64,
                end: range.end as u64,
                len: self.len as u64,
            })
        }
    }

    /// Panics if the peer may write this region: no slice is formed over
    /// memory that can change under it (read it with copies instead).
    fn assert_local_only(&self, what: &str) {
        assert!(
            !self.remote_write,
            "{what}: a remotely writable region is read by copies only"
        );
    }

    /// The bytes `range` of the buffer, borrowed.
    ///
    /// Panics if `range` is outside the region, or if the region is
    /// remotely writable (the peer could change the bytes under the slice).
    ///
    /// # Safety
    /// While the slice lives, nothing may write these bytes: no posted
    /// receive may target them, and no `write_at` or
    /// [`slice_mut`](Self::slice_mut) may cover them.
    pub unsafe fn slice(&self, range: Range<usize>) -> &[u8] {
        self.assert_local_only("slice");
        self.check(&range)
            .expect("slice: range outside the memory region");
        // SAFETY: the range is inside the buffer this value owns; the
        // caller guarantees nobody writes it while the slice lives.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().add(range.start), range.len()) }
    }

    /// The bytes `range` of the buffer, mutably borrowed (to encode into).
    ///
    /// Panics if `range` is outside the region, or if the region is
    /// remotely writable.
    ///
    /// # Safety
    /// While the slice lives, nothing else may read or write these bytes:
    /// no posted work request may use them, and no other slice,
    /// `read_at` or `write_at` may cover them.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, range: Range<usize>) -> &mut [u8] {
        self.assert_local_only("slice_mut");
        self.check(&range)
            .expect("slice_mut: range outside the memory region");
        // SAFETY: the range is inside the buffer this value owns; the
        // caller guarantees exclusive access while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_ptr().add(range.start), range.len()) }
    }

    /// Copies `data` into the region at `offset`. Panics if it does not fit.
    /// Do not call while a posted receive or a remote write may target
    /// these bytes, or a posted send may still read them.
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        let range = offset
            ..offset
                .checked_add(data.len())
                .expect("offset + len overflows");
        self.check(&range)
            .expect("write_at: range outside the memory region");
        // SAFETY: the range is inside the buffer this value owns; `data`
        // is a distinct Rust slice, so they do not overlap. No Rust
        // reference into the buffer exists (it is only accessed by copies).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.buf.as_ptr().add(offset), data.len())
        };
    }

    /// Copies `len` bytes out of the region at `offset`. Panics if the
    /// range is outside the region.
    pub fn read_at(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.read_into(offset, &mut out);
        out
    }

    /// Copies `dst.len()` bytes out of the region at `offset` into `dst`.
    /// Panics if the range is outside the region.
    ///
    /// A raw copy, never a slice of the region: safe on memory the peer
    /// may be writing (the bytes read are then whatever they were).
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) {
        let range = offset
            ..offset
                .checked_add(dst.len())
                .expect("offset + len overflows");
        self.check(&range)
            .expect("read_into: range outside the memory region");
        // SAFETY: the range is inside the buffer this value owns; `dst` is
        // a distinct Rust slice (no Rust reference into the buffer covers
        // a remotely writable region, and callers of `slice_mut` promise
        // no copy covers their bytes), so they do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.buf.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if let Some(registration) = self.registration() {
            // SAFETY: `raw` is the live MR this value owns, deregistered
            // once (here). Posting from or into it is `unsafe` and requires
            // the MR to outlive the operation (its completion, or the QP's
            // destruction), so no work request uses the buffer any more.
            let ret = unsafe { ffi::ibv_dereg_mr(registration.raw.as_ptr()) };
            if ret != 0 {
                // Still registered: the device may read or write the buffer
                // (a peer holding the rkey, too). Freeing it would hand
                // memory the device can change to the allocator: leak it
                // instead.
                tracing::error!(
                    len = self.len,
                    error = %super::errno_error(ret),
                    "ibv_dereg_mr failed: leaking the region's buffer rather than freeing memory the device may still access"
                );
                return;
            }
            // Still counted above when leaked: its pages stay pinned.
            counted_deregistration(self.mapped_len() as u64);
        }
        // SAFETY: `buf` was mapped in `unregistered` with this size and is
        // no longer registered (ibv_dereg_mr succeeded just above); no
        // reference into it outlives this value.
        let ret = unsafe { libc::munmap(self.buf.as_ptr().cast(), self.mapped_len()) };
        if ret != 0 {
            tracing::error!(len = self.len, error = %last_os_error(), "munmap of a region's buffer failed");
        }
    }
}

/// Registers `len` bytes at `buf` on `pd` (`ibv_reg_mr`); returns the MR
/// and the address remote requests name `buf` by.
///
/// Memory the peer writes or reads, directly or through a memory window,
/// is registered zero-based (its remote
/// addresses are offsets, so the hello or an announcement tells the peer
/// nothing of this process's address space), where the device allows it.
/// Either way the device allows remote access only inside
/// `iova..iova + len`, and only of the kinds asked for.
///
/// # Safety
/// `buf..buf + len` must stay allocated, and be written only as `access`
/// allows the device to expect, until the MR is deregistered.
unsafe fn register(
    pd: &ProtectionDomain,
    buf: *mut u8,
    len: usize,
    access: Access,
) -> Result<(NonNull<ffi::ibv_mr>, u64)> {
    let remote =
        access.0 & (Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0 | Access::MW_BIND.0) != 0;
    let mut iova = buf as u64;
    let mut raw = ptr::null_mut();
    if remote {
        // SAFETY: the PD is live; the caller keeps the memory valid.
        raw = unsafe { ffi::ibv_reg_mr_iova2(pd.inner.raw.as_ptr(), buf.cast(), len, 0, access.0) };
        if raw.is_null() {
            tracing::debug!(
                "zero-based registration refused ({}); registering at the buffer's address",
                last_os_error()
            );
        } else {
            iova = 0;
        }
    }
    if raw.is_null() {
        let access = libc::c_int::try_from(access.0).expect("access flags fit in c_int");
        // SAFETY: as above.
        raw = unsafe { ffi::ibv_reg_mr(pd.inner.raw.as_ptr(), buf.cast(), len, access) };
    }
    match NonNull::new(raw) {
        Some(raw) => Ok((raw, iova)),
        None => Err(Error::RegMr {
            len,
            source: last_os_error(),
        }),
    }
}

/// What a memory window is bound over: registered memory, and the range
/// of it as remote requests name it.
pub(crate) struct BindTarget {
    pub(crate) raw: NonNull<ffi::ibv_mr>,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) pd: Arc<PdInner>,
    /// The memory is never sliced (a window may let the peer write it).
    pub(crate) peer_writes: bool,
}

/// Bytes the program already holds, registered where they lie for the peer
/// to RDMA READ ([`Access::REMOTE_READ`] only, or through memory windows
/// only): a payload sent with no copy.
///
/// Holds its [`Bytes`] while registered, so the memory stays allocated and
/// unchanged (`Bytes` are immutable); dropping deregisters, then lets the
/// `Bytes` go. If `ibv_dereg_mr` fails the peer may still read the memory,
/// so the `Bytes` are leaked (and the failure logged) rather than freed.
/// Registration pins the pages the bytes lie on; remote access covers the
/// bytes only, not the rest of those pages.
pub struct RegisteredBytes {
    raw: NonNull<ffi::ibv_mr>,
    bytes: Bytes,
    iova: u64,
    _pd: Arc<PdInner>,
}

// SAFETY: the value owns its MR handle (libibverbs calls are thread-safe)
// and a `Bytes` (itself `Send`); nothing in it is written after `new`.
unsafe impl Send for RegisteredBytes {}

impl RegisteredBytes {
    /// Registers `bytes` on `pd` for remote reads (panics if empty).
    pub fn new(pd: &ProtectionDomain, bytes: Bytes) -> Result<Self> {
        Self::register_with(pd, bytes, Access::REMOTE_READ)
    }

    /// Registers `bytes` on `pd` for remote reads through memory windows
    /// only ([`Access::MW_BIND`]; the transport binds them over it): the
    /// registration's own rkey grants nothing, so another queue pair on a
    /// shared protection domain cannot use it (panics if empty).
    pub fn readable_through_windows(pd: &ProtectionDomain, bytes: Bytes) -> Result<Self> {
        Self::register_with(pd, bytes, Access::MW_BIND)
    }

    fn register_with(pd: &ProtectionDomain, bytes: Bytes, access: Access) -> Result<Self> {
        assert!(!bytes.is_empty(), "registering no bytes");
        // SAFETY: the memory is the `Bytes`' own: it stays allocated and
        // unchanged while the value holds it, which it does until after
        // deregistering (Drop). The device only reads it (no LOCAL_WRITE).
        let (raw, iova) = unsafe { register(pd, bytes.as_ptr().cast_mut(), bytes.len(), access)? };
        counted_registration(pages_spanned(&bytes));
        Ok(RegisteredBytes {
            raw,
            bytes,
            iova,
            _pd: Arc::clone(&pd.inner),
        })
    }

    /// The bytes registered.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// What a memory window over `range` of them is bound with (for
    /// reads: the device never writes them). Fails if the range is
    /// outside them.
    pub(crate) fn bind_target(&self, range: Range<usize>) -> Result<BindTarget> {
        if range.start > range.end || range.end > self.bytes.len() {
            return Err(Error::OutOfBounds {
                start: range.start as u64,
                end: range.end as u64,
                len: self.bytes.len() as u64,
            });
        }
        Ok(BindTarget {
            raw: self.raw,
            addr: self.iova + range.start as u64,
            len: range.len() as u64,
            pd: Arc::clone(&self._pd),
            peer_writes: false,
        })
    }

    /// What the peer needs to read them.
    pub fn remote(&self) -> RemoteRegion {
        // SAFETY: `raw` is the live MR this value owns.
        let rkey = unsafe { self.raw.as_ref().rkey };
        RemoteRegion {
            addr: self.iova,
            rkey,
            len: self.bytes.len() as u64,
        }
    }
}

impl Drop for RegisteredBytes {
    fn drop(&mut self) {
        // SAFETY: `raw` is the live MR this value owns, deregistered once.
        let ret = unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
        if ret != 0 {
            tracing::error!(
                len = self.bytes.len(),
                error = %super::errno_error(ret),
                "ibv_dereg_mr failed: leaking the registered bytes rather than freeing memory the device may still read"
            );
            std::mem::forget(std::mem::take(&mut self.bytes));
            return;
        }
        counted_deregistration(pages_spanned(&self.bytes));
    }
}

/// Bytes of the whole pages `bytes` lie on (what registering them pins).
fn pages_spanned(bytes: &[u8]) -> u64 {
    let start = bytes.as_ptr() as usize;
    let first = start - start % PAGE;
    ((start + bytes.len()).next_multiple_of(PAGE) - first) as u64
}

/// Registration pins whole pages of this size.
pub(crate) const PAGE: usize = 4096;

/// Bytes registered by the [`MemoryRegion`]s and [`RegisteredBytes`] of
/// this process now.
static REGISTERED: AtomicU64 = AtomicU64::new(0);

/// Their registrations (MRs).
static REGISTRATIONS: LiveCount = LiveCount::new();

/// Counts a registration just made that pins `pinned` bytes (whole pages).
fn counted_registration(pinned: u64) {
    REGISTERED.fetch_add(pinned, Ordering::Relaxed);
    REGISTRATIONS.created();
}

/// Counts a registration of `pinned` bytes just deregistered. A
/// registration whose deregistration failed stays counted: its pages
/// stay pinned.
fn counted_deregistration(pinned: u64) {
    REGISTERED.fetch_sub(pinned, Ordering::Relaxed);
    REGISTRATIONS.destroyed();
}

/// Bytes of memory this process has registered (pinned) through
/// [`MemoryRegion`]s and [`RegisteredBytes`] and not yet deregistered,
/// counting whole pages (what registration pins); a region whose
/// deregistration failed stays counted, as its pages stay pinned. One
/// relaxed atomic, updated as regions are registered and dropped: for
/// metrics.
pub fn registered_bytes() -> u64 {
    REGISTERED.load(Ordering::Relaxed)
}

/// How many memory registrations (`ibv_mr`s) this process holds, counted
/// as [`registered_bytes`] counts their bytes.
pub fn memory_registrations() -> usize {
    REGISTRATIONS.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_bytes_count_whole_pages() {
        assert_eq!(MemoryRegion::layout(1).size(), 4096);
        assert_eq!(MemoryRegion::layout(4097).size(), 8192);
        #[repr(align(4096))]
        struct Pages([u8; 3 * PAGE]);
        let pages = Pages([0; 3 * PAGE]);
        let page = PAGE as u64;
        assert_eq!(pages_spanned(&pages.0[..1]), page);
        assert_eq!(pages_spanned(&pages.0[..PAGE]), page);
        assert_eq!(pages_spanned(&pages.0[1..PAGE + 1]), 2 * page);
        assert_eq!(pages_spanned(&pages.0[PAGE - 1..PAGE + 1]), 2 * page);
    }
}
