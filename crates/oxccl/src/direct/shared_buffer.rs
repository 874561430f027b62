//! Buffers in shared memory, the CPU counterpart of NCCL's `ncclMemAlloc` + buffer
//! registration: a [`SharedBuffer`] lives in a memfd that the other ranks of the host can map,
//! so the single-copy algorithms (`cma`, in `direct/`) reach a peer's buffer with
//! plain loads and stores instead of a kernel copy (`process_vm_readv`, about half of memcpy's
//! speed on the machines measured, see `docs/perf`).
//!
//! Nothing else changes for the caller: pass the buffer (or any part of it) to a collective as
//! any other slice. Every rank decides for itself, per peer and per buffer: a peer whose buffer
//! is shared is mapped (once; later calls reuse the mapping), any other is read and written
//! with cross-memory attach as before; results are the same bits either way.
//!
//! ```no_run
//! use oxccl::{Communicator, ReduceOp};
//! # fn main() -> oxccl::Result<()> {
//! let comm = Communicator::from_env()?;
//! let mut grads = comm.alloc_shared(1024 * 4)?;
//! grads.as_mut_slice::<f32>().fill(comm.rank() as f32);
//! comm.all_reduce_in_place(grads.as_mut_slice::<f32>(), ReduceOp::Sum)?;
//! # Ok(()) }
//! ```
//!
//! Each buffer is registered in a table of this process (its address, length, memfd and a
//! unique id); a collective looks its buffers up there and publishes the entry with its first
//! event. A peer maps the memfd after taking a copy of it with `pidfd_getfd` (which needs the
//! same permission as cross-memory attach). A peer keeps its mapping until the communicator
//! is dropped or the mapping is evicted (more than [`PEER_MAPPINGS`] buffers or
//! [`PEER_MAPPED_BYTES`] bytes of one peer), so
//! the memory of a freed buffer is returned to the system once its peers let go of it too.
//!
//! `fork` does not share them: the first registration installs `pthread_atfork` handlers (see
//! [`fork`](self#fork)) under which a forked child gets, in place of every registered buffer
//! (same address), private memory holding the buffer's bytes as they were when the process
//! forked, so a child (a DataLoader worker) writing a tensor the pool served changes its copy
//! only, never the parent's, and never sees a later write of the parent, its threads or its
//! peers, as with ordinary memory. The child's copies are no longer shared buffers
//! (collectives treat them as plain memory). Only live bytes are copied: the owner of a buffer
//! (the pool) tells which (`LiveRanges`; a freed block, a slab's free blocks: none), and of
//! those only the memfd's data extents; the rest reads as zero in the child and takes no
//! memory.
//!
//! The copies are made in the parent, in `prepare`, before the kernel forks: it first closes
//! the fork gates, so that no call of this process writes into a buffer (each pauses at its
//! next wait, `base::fork_gate`) and no peer does (each waits before its next write
//! into this process's memory, `direct::shm::close_peer_gates`), then copies, forks, and opens
//! the gates in `parent`; the child moves each copy onto its buffer's address (`mremap`, no
//! copy). A call in flight across the fork (`async_op=True`) just pauses; a peer's write that
//! comes during the fork lands after the copies, in the parent only. A copy-on-write mapping
//! of the memfd (`MAP_PRIVATE`) would be cheaper but wrong: the child would see the parent's
//! (and the peers') later writes to every page it has not written itself, and copying in the
//! child (after the fork) let those writes in while it copied.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use crate::base::error::{Error, Result};

/// How many buffers of one peer a rank keeps mapped before it unmaps the least recently used.
/// A DDP job all-reduces every bucket each step (a 100M-parameter model in 25 MB buckets has
/// 17), and its buffers come back every step: a cache smaller than that cycle would miss on
/// every call (LRU on a cyclic pattern), mapping and faulting in each bucket again.
pub const PEER_MAPPINGS: usize = 256;

/// How many bytes of one peer's buffers a rank keeps mapped at most (it unmaps the least
/// recently used beyond). A mapping of a live buffer costs no memory; one of a buffer its owner
/// has freed keeps that memory alive until it is evicted, which this bounds.
pub const PEER_MAPPED_BYTES: usize = 16 << 30;

/// A registered buffer as a peer needs to see it: its id (unique in its process), where it
/// starts and how long it is in its owner's address space, and the owner's descriptor of its
/// memfd. All zero: no buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Region {
    /// Unique in the owning process, never reused (a peer caches mappings by it).
    pub id: u64,
    /// Start in the owner's address space.
    pub base: u64,
    /// Mapped length in bytes (a multiple of the page size).
    pub len: u64,
    /// The owner's file descriptor of the memfd.
    pub fd: u64,
}

impl Region {
    /// The region as four words (as published in an event).
    pub fn to_words(self) -> [u64; 4] {
        [self.id, self.base, self.len, self.fd]
    }

    /// The region from four published words; `None` for the all-zero "no buffer".
    pub fn from_words(w: [u64; 4]) -> Option<Region> {
        (w[0] != 0).then_some(Region {
            id: w[0],
            base: w[1],
            len: w[2],
            fd: w[3],
        })
    }

    /// Whether `[addr, addr + len)` lies inside the region.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.base.saturating_add(self.len))
    }
}

struct Entry {
    id: u64,
    len: usize,
    /// The memfd, or -1 in a forked child once the mapping is the child's private copy.
    fd: i32,
}

/// The registered buffers of this process, by start address.
static REGISTRY: RwLock<BTreeMap<usize, Entry>> = RwLock::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The registered buffer that holds all of `[addr, addr + len)`, if any.
pub fn region_of(addr: *const u8, len: usize) -> Option<Region> {
    let addr = addr as usize;
    let reg = REGISTRY.read().unwrap_or_else(|e| e.into_inner());
    let (&base, e) = reg.range(..=addr).next_back()?;
    if e.fd < 0 {
        return None; // a forked child's private copy: plain memory
    }
    let r = Region {
        id: e.id,
        base: base as u64,
        len: e.len as u64,
        fd: e.fd as u64,
    };
    r.covers(addr as u64, len as u64).then_some(r)
}

/// A zeroed buffer in shared memory that the other ranks of this host can map: collectives on
/// it move bytes between processes with plain loads and stores (see the [module](self)).
pub struct SharedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    mapped: usize,
    fd: Option<OwnedFd>,
}

// SAFETY: the buffer owns its mapping like a Vec owns its allocation; access goes through
// `&self` / `&mut self`.
unsafe impl Send for SharedBuffer {}
// SAFETY: as above; `&SharedBuffer` only gives shared reads.
unsafe impl Sync for SharedBuffer {}

impl SharedBuffer {
    /// A zeroed buffer of `bytes` bytes (page-aligned), allocated by `rank` (named in errors:
    /// the system cannot create or map the memfd, e.g. out of memory). Communicators hand them
    /// out with [`Communicator::alloc_shared`](crate::Communicator::alloc_shared).
    pub fn new(bytes: usize, rank: usize) -> Result<SharedBuffer> {
        let shm_error = |msg: String| Error::SharedMemory { rank, msg };
        if bytes == 0 {
            return Ok(SharedBuffer {
                ptr: NonNull::<u64>::dangling().cast(),
                len: 0,
                mapped: 0,
                fd: None,
            });
        }
        let page = rustix::param::page_size();
        let mapped = bytes
            .checked_next_multiple_of(page)
            .ok_or_else(|| shm_error(format!("a shared buffer of {bytes} bytes is too large")))?;
        let fd = rustix::fs::memfd_create("oxccl-buffer", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| shm_error(format!("memfd_create: {e}")))?;
        rustix::fs::ftruncate(&fd, mapped as u64)
            .map_err(|e| shm_error(format!("ftruncate of a {mapped}-byte memfd: {e}")))?;
        // Unmapped once, in Drop.
        let ptr = map_shared(&fd, mapped)
            .map_err(|e| shm_error(format!("mmap of a {mapped}-byte shared buffer: {e}")))?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        fork::install();
        REGISTRY.write().unwrap_or_else(|e| e.into_inner()).insert(
            ptr.as_ptr() as usize,
            Entry {
                id,
                len: mapped,
                fd: fd.as_raw_fd(),
            },
        );
        Ok(SharedBuffer {
            ptr,
            len: bytes,
            mapped,
            fd: Some(fd),
        })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its bytes as elements of `T` (a trailing part smaller than one element is left out).
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        let n = self.len / std::mem::size_of::<T>().max(1);
        // SAFETY: the mapping is page-aligned (aligned for any T), valid for `len` bytes, and
        // every bit pattern is a valid T (Pod).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<T>(), n) }
    }

    /// Its bytes as mutable elements of `T`.
    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        let n = self.len / std::mem::size_of::<T>().max(1);
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<T>(), n) }
    }
}

impl std::ops::Deref for SharedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for SharedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        if self.fd.is_none() {
            return;
        }
        REGISTRY
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(self.ptr.as_ptr() as usize));
        // SAFETY: `ptr` came from mmap of `mapped` bytes and is unmapped exactly once; no
        // reference into it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.mapped) };
    }
}

/// Maps the first `len` bytes of the file behind `fd` (at least that long: callers sized or
/// checked it) readable and writable, shared, at an address the kernel picks. The caller
/// unmaps it.
fn map_shared(fd: &OwnedFd, len: usize) -> std::io::Result<NonNull<u8>> {
    // SAFETY: a fresh mapping at an address the kernel picks overlaps no Rust object; the file
    // holds `len` bytes, so every mapped page is backed.
    let p = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED,
            fd,
            0,
        )
    }?;
    Ok(NonNull::new(p.cast::<u8>()).expect("mmap returned null"))
}

/// Tells `fork` which bytes of the registered buffer `[base, base + len)` are live (its owner
/// may still read them, so the child must see the parent's values there): calls
/// `copy(from, to)` (offsets, page-aligned, ascending) for each live range and returns `true`,
/// or returns `false` if it does not know the buffer (then all of it is live). Bytes not
/// reported read as zero in the child and take no memory there. Runs in the `prepare`
/// handler of `fork`, with the pool's lock held: it takes no lock.
pub(crate) type LiveRanges =
    fn(base: usize, len: usize, copy: &mut dyn FnMut(usize, usize)) -> bool;

/// The owner's [`LiveRanges`] (the process's pool, which holds freed blocks and slabs whose
/// blocks are mostly free), set once.
static FORK_LIVE_RANGES: std::sync::OnceLock<LiveRanges> = std::sync::OnceLock::new();

/// Sets the process's [`LiveRanges`] (once; later calls change nothing).
pub(crate) fn set_fork_live_ranges(f: LiveRanges) {
    let _ = FORK_LIVE_RANGES.set(f);
}

/// Bytes of shared buffers copied for this process at the fork that made it.
#[cfg(test)]
pub(crate) use fork::copied_bytes as fork_copied_bytes;

/// `fork` with registered buffers: the child gets private copies of them (see the
/// [module](self)). Handlers run by `pthread_atfork`, installed once by the first registration.
/// The registry's write lock is taken in `prepare` (no thread changes the table while it is
/// copied and the child walks it) and released in both `parent` and `child`. The child's
/// handler is async-signal-safe: raw system calls only, no allocation.
pub(crate) use fork::generation as fork_generation;
/// Installs the fork handlers now (once per process; the first registration does otherwise):
/// handlers installed later run their `prepare` before these and their `child` and `parent`
/// after them (`pthread_atfork`'s order), so a lock they take is taken before the registry's.
pub(crate) use fork::install as install_fork_handlers;

mod fork {
    use super::{Entry, LiveRanges, FORK_LIVE_RANGES, REGISTRY};
    use std::cell::UnsafeCell;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Once, RwLockWriteGuard};
    use std::time::Duration;

    type Guard = RwLockWriteGuard<'static, BTreeMap<usize, Entry>>;

    /// A registered buffer's copy for the child, made in `prepare`: the buffer's start and
    /// length, and the private mapping holding its live bytes (null: it could not be made).
    struct Snapshot {
        base: usize,
        len: usize,
        copy: *mut u8,
    }

    /// What `prepare` leaves for `parent`/`child`: the registry's guard and the snapshots.
    struct Held(UnsafeCell<Option<(Guard, Vec<Snapshot>)>>);
    // SAFETY: only the thread that holds the registry's write lock touches the cell (prepare
    // stores, parent/child take, all on the forking thread, in order).
    unsafe impl Sync for Held {}
    static HELD: Held = Held(UnsafeCell::new(None));

    /// How long `prepare` waits for this process's calls to pause and for the peers' writes
    /// in progress to end before it copies anyway (a call that writes that long without
    /// waiting; the forking thread inside a call).
    const GATE_WAIT: Duration = Duration::from_secs(10);

    /// Installs the handlers (once per process; a forked child inherits them).
    pub(crate) fn install() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            // SAFETY: the three handlers are `extern "C"` functions that never unwind.
            unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        });
    }

    /// Takes the snapshot of every registered buffer for the child, before the fork (see the
    /// [module](super)): closes the fork gates first (this process's calls pause at their next
    /// wait, the peers' writes into its buffers wait), so nothing writes into the buffers
    /// while they are copied, nor after, until `parent` opens the gates again.
    unsafe extern "C" fn prepare() {
        let any = REGISTRY
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .any(|e| e.fd >= 0);
        if any {
            // Before the registry's lock: a call may look its buffers up there.
            let own = crate::base::fork_gate::close(GATE_WAIT);
            let peers = crate::direct::shm::close_peer_gates(GATE_WAIT);
            if !(own && peers) {
                tracing::warn!(
                    own_calls_paused = own,
                    peer_writes_ended = peers,
                    "fork: writes into shared buffers still in progress after {GATE_WAIT:?}; \
                     the child's copies may hold some of them"
                );
            }
        }
        let guard = REGISTRY.write().unwrap_or_else(|e| e.into_inner());
        COPIED.store(0, Ordering::Relaxed);
        let live = FORK_LIVE_RANGES.get().copied();
        let mut snaps = Vec::with_capacity(guard.len());
        for (&base, e) in guard.iter() {
            if e.fd >= 0 {
                // SAFETY: `base` is the start of a live `e.len`-byte shared mapping of `e.fd`
                // (the table holds exactly the live buffers, under its lock).
                let copy = unsafe { snapshot(base, e.len, e.fd, live) };
                snaps.push(Snapshot {
                    base,
                    len: e.len,
                    copy,
                });
            }
        }
        // SAFETY: see `Held`; this thread holds the write lock.
        unsafe { *HELD.0.get() = Some((guard, snaps)) };
    }

    unsafe extern "C" fn parent() {
        // SAFETY: see `Held`; `prepare` ran on this thread.
        let held = unsafe { (*HELD.0.get()).take() };
        if let Some((guard, snaps)) = held {
            for s in &snaps {
                if !s.copy.is_null() {
                    // SAFETY: the snapshot's own mapping, unmapped once (the child has its own).
                    unsafe { libc::munmap(s.copy.cast(), s.len) };
                }
            }
            drop(guard);
        }
        crate::direct::shm::open_peer_gates();
        crate::base::fork_gate::open();
    }

    /// Forks survived, counted in the children (see [`generation`]).
    static FORKS: AtomicU64 = AtomicU64::new(0);

    /// How many forks made this process from the one that first created a shared buffer: a
    /// process's memory is shared with its peers only in the generation that made it. One
    /// atomic load, where `getpid` is a system call (the pool asks on every allocation).
    pub(crate) fn generation() -> u64 {
        FORKS.load(Ordering::Relaxed)
    }

    /// Moves each snapshot onto its buffer's address: the child's buffers are private memory
    /// holding the bytes they held when `prepare` copied them. The direct areas' gates are
    /// the parent's (shared): the child leaves them to it; its own calls' gate is its own.
    unsafe extern "C" fn child() {
        FORKS.fetch_add(1, Ordering::Relaxed);
        crate::base::fork_gate::open();
        // SAFETY: see `Held`; the child's only thread is the one that ran `prepare`.
        let slot = unsafe { &mut *HELD.0.get() };
        if let Some((guard, snaps)) = slot.as_mut() {
            for s in snaps.iter() {
                // SAFETY: `s.copy` is a private mapping of `s.len` bytes (the child's copy of
                // the parent's) and `s.base` the start of a registered `s.len`-byte mapping.
                if s.copy.is_null() || !unsafe { move_onto(s.copy, s.base, s.len) } {
                    let msg = b"oxccl: a forked child cannot copy a shared buffer (out of memory?); it would share its writes with the parent, exiting\n";
                    // SAFETY: raw write of a static message, then exit without unwinding.
                    unsafe {
                        libc::write(2, msg.as_ptr().cast(), msg.len());
                        libc::_exit(70);
                    }
                }
                if let Some(e) = guard.get_mut(&s.base) {
                    e.fd = -1;
                }
            }
        }
        drop(slot.take());
    }

    /// A private anonymous mapping of `len` bytes holding the live bytes of the shared mapping
    /// `[base, base + len)` of `fd`: the ranges `live` reports (all of it if `live` is `None`
    /// or does not know the buffer), and in them only the file's data extents (holes stay
    /// untouched zero pages); the rest reads as zero and takes no memory. Null if it cannot be
    /// made (out of memory).
    ///
    /// # Safety
    /// `base` must be the start of a `len`-byte shared mapping of `fd`.
    unsafe fn snapshot(base: usize, len: usize, fd: i32, live: Option<LiveRanges>) -> *mut u8 {
        // SAFETY: a fresh anonymous mapping at an address the kernel picks.
        let tmp = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if tmp == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        let tmp = tmp.cast::<u8>();
        let mut ok = true;
        let mut copy = |from: usize, to: usize| {
            // SAFETY: `tmp` is a fresh `len`-byte mapping; `copy_data` clamps to `len`.
            ok = ok && unsafe { copy_data(fd, tmp, len, from, to) };
        };
        if !live.is_some_and(|f| f(base, len, &mut copy)) {
            copy(0, len);
        }
        if !ok {
            // SAFETY: our fresh mapping, unmapped once.
            unsafe { libc::munmap(tmp.cast(), len) };
            return std::ptr::null_mut();
        }
        tmp
    }

    /// Moves the private mapping `from` onto `base` (`len` bytes), replacing the shared one
    /// atomically: every pointer into a live block stays valid. Async-signal-safe.
    ///
    /// # Safety
    /// `from` and `base` must be mappings of `len` bytes, `base` one nothing else uses.
    unsafe fn move_onto(from: *mut u8, base: usize, len: usize) -> bool {
        // SAFETY: per the contract.
        let moved = unsafe {
            libc::mremap(
                from.cast(),
                len,
                len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                base as *mut libc::c_void,
            )
        };
        moved != libc::MAP_FAILED
    }

    /// Copies the data extents of `fd` in `[from, to)` (clamped to `len`) into `tmp` at the
    /// same offsets, counting the bytes in [`copied_bytes`]. Raw system calls only.
    ///
    /// # Safety
    /// `tmp` must be a writable mapping of `len` bytes.
    unsafe fn copy_data(fd: i32, tmp: *mut u8, len: usize, from: usize, to: usize) -> bool {
        let to = to.min(len);
        let mut pos = from;
        while pos < to {
            // SAFETY: plain lseek on our descriptor.
            let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
            let (start, end) = if data < 0 {
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                    break; // no data past `pos`
                }
                (pos, to) // SEEK_DATA unsupported: copy all
            } else {
                // SAFETY: as above.
                let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
                let hole = if hole < 0 {
                    to
                } else {
                    (hole as usize).min(to)
                };
                ((data as usize).min(to), hole)
            };
            if end > start {
                // Faults the extent's pages in with one call rather than one fault per page
                // inside `pread` (an error, e.g. EINVAL before Linux 5.14, changes nothing).
                // SAFETY: a range inside our fresh mapping; only its pages' backing changes.
                unsafe {
                    libc::madvise(
                        tmp.add(start).cast(),
                        end - start,
                        libc::MADV_POPULATE_WRITE,
                    )
                };
            }
            let mut at = start;
            while at < end {
                // SAFETY: `tmp + at .. tmp + end` lies inside the `len`-byte mapping.
                let n = unsafe { libc::pread(fd, tmp.add(at).cast(), end - at, at as libc::off_t) };
                if n < 0 {
                    if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                        continue;
                    }
                    return false;
                }
                if n == 0 {
                    break; // the file ends (it never does before `len`)
                }
                at += n as usize;
                COPIED.fetch_add(n as u64, Ordering::Relaxed);
            }
            pos = end.max(pos + 1);
        }
        true
    }

    /// Bytes of shared buffers copied for the child at this process's last fork (in a child:
    /// at the fork that made it; 0 if there were none).
    static COPIED: AtomicU64 = AtomicU64::new(0);

    /// Bytes of shared buffers copied for this child when it was forked (see [`snapshot`]).
    #[cfg(test)]
    pub(crate) fn copied_bytes() -> u64 {
        COPIED.load(Ordering::Relaxed)
    }
}

/// Waits for a test's forked child `pid` and returns its exit code; fails the test if it died
/// of a signal (14, SIGALRM: the alarm that a child that may hang sets itself).
#[cfg(test)]
pub(crate) fn child_exit_code(pid: libc::pid_t) -> i32 {
    let mut status = 0;
    // SAFETY: waits for the caller's own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status),
        "the child died of signal {} (14: the alarm of a child that hung)",
        libc::WTERMSIG(status)
    );
    libc::WEXITSTATUS(status)
}

/// A peer's shared buffer mapped into this process.
pub(crate) struct PeerMapping {
    /// The buffer's id in the peer's process.
    pub id: u64,
    /// Where it starts here.
    pub local: NonNull<u8>,
    /// Mapped bytes.
    pub len: usize,
    /// When it was last used (the user's event counter), for eviction.
    pub used: u64,
}

// SAFETY: the mapping is owned by this value (unmapped in Drop); access to the bytes follows
// the algorithms' event protocol.
unsafe impl Send for PeerMapping {}

impl PeerMapping {
    /// Maps `region` of the process behind `pidfd` (a copy of its memfd is taken with
    /// `pidfd_getfd`, checked to be at least as long as the region, mapped, then closed).
    pub(crate) fn map(pidfd: &OwnedFd, region: &Region, used: u64) -> std::io::Result<PeerMapping> {
        let len = usize::try_from(region.len)
            .map_err(|_| std::io::Error::other("region length does not fit"))?;
        let fd = rustix::process::pidfd_getfd(
            pidfd,
            region.fd as i32,
            rustix::process::PidfdGetfdFlags::empty(),
        )?;
        let st = rustix::fs::fstat(&fd)?;
        if (st.st_size as u64) < region.len || len == 0 {
            return Err(std::io::Error::other(format!(
                "peer's descriptor {} holds {} bytes, the region {}",
                region.fd, st.st_size, region.len
            )));
        }
        // Unmapped once, in Drop.
        let local = map_shared(&fd, len)?;
        Ok(PeerMapping {
            id: region.id,
            local,
            len,
            used,
        })
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        // SAFETY: `local` came from mmap of `len` bytes and is unmapped exactly once.
        let _ = unsafe { rustix::mm::munmap(self.local.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_while_alive_and_looked_up_by_any_inner_range() {
        let mut b = SharedBuffer::new(10_000, 0).unwrap();
        assert!(b.iter().all(|&x| x == 0));
        b[9_999] = 7;
        let base = b.as_ptr();
        let r = region_of(base, 10_000).expect("registered");
        assert_eq!(r.base, base as u64);
        assert!(r.len >= 10_000 && r.len.is_multiple_of(rustix::param::page_size() as u64));
        // SAFETY: within the buffer.
        let inner = unsafe { base.add(100) };
        assert_eq!(region_of(inner, 500), Some(r));
        // A range running past the mapping is not inside it.
        assert_eq!(region_of(inner, r.len as usize), None);
        assert_eq!(Region::from_words(r.to_words()), Some(r));
        assert_eq!(Region::from_words([0; 4]), None);
        let other = SharedBuffer::new(1, 0).unwrap();
        assert_ne!(region_of(other.as_ptr(), 1).unwrap().id, r.id);
        drop(b);
        assert_eq!(region_of(base, 1), None);
        let v = [0u8; 64];
        assert_eq!(region_of(v.as_ptr(), 64), None);
        let empty = SharedBuffer::new(0, 0).unwrap();
        assert!(empty.is_empty() && empty.as_slice::<f32>().is_empty());
    }

    #[test]
    fn a_mapping_by_pidfd_sees_the_owners_stores_and_the_owner_sees_its_stores() {
        let mut b = SharedBuffer::new(8192, 0).unwrap();
        b.as_mut_slice::<u32>()[5] = 0xdead_beef;
        let r = region_of(b.as_ptr(), 8192).unwrap();
        let me = rustix::process::getpid();
        let pidfd = rustix::process::pidfd_open(me, rustix::process::PidfdFlags::empty()).unwrap();
        let m = PeerMapping::map(&pidfd, &r, 0).unwrap();
        assert_ne!(m.local.as_ptr(), b.as_mut_ptr());
        // SAFETY: within the second mapping of the same 8192 bytes.
        let seen = unsafe { m.local.as_ptr().cast::<u32>().add(5).read_volatile() };
        assert_eq!(seen, 0xdead_beef);
        // SAFETY: as above.
        unsafe { m.local.as_ptr().add(8191).write_volatile(9) };
        assert_eq!(b[8191], 9);
        // A region claiming more bytes than the file holds is refused.
        let bad = Region {
            len: r.len * 2,
            ..r
        };
        assert!(PeerMapping::map(&pidfd, &bad, 0).is_err());
    }

    #[test]
    fn a_forked_child_writes_its_own_copy_and_the_parent_keeps_its_values() {
        let page = rustix::param::page_size();
        // A buffer with data and holes (only the first and last pages written), and a pool block.
        let mut b = SharedBuffer::new(64 * page, 0).unwrap();
        b[0] = 1;
        b[64 * page - 1] = 2;
        let pool = crate::direct::shared_pool::SharedPool::global();
        let block = pool.alloc(3 * page).unwrap();
        // SAFETY: the block holds at least 3 pages.
        let blk = unsafe { std::slice::from_raw_parts_mut(block.as_ptr(), 3 * page) };
        blk.fill(5);
        let base = b.as_ptr();
        // SAFETY: the child only touches memory and makes raw system calls before `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // The child: sees the parent's values at the same addresses, writes its own.
            let ok =
                b[0] == 1 && b[64 * page - 1] == 2 && b[page] == 0 && blk.iter().all(|&x| x == 5);
            b[0] = 10;
            b[page] = 11;
            b[64 * page - 1] = 12;
            blk.fill(9);
            let own =
                b[0] == 10 && b[page] == 11 && b[64 * page - 1] == 12 && blk[3 * page - 1] == 9;
            let private = region_of(base, 1).is_none() && region_of(block.as_ptr(), 1).is_none();
            let code = if !ok {
                1
            } else if !own {
                2
            } else if !private {
                3
            } else {
                0
            };
            // SAFETY: ends the child without running the test harness's code.
            unsafe { libc::_exit(code) };
        }
        assert_eq!(
            child_exit_code(pid),
            0,
            "1: child saw wrong values, 2: lost its writes, 3: still shared"
        );
        assert_eq!((b[0], b[page], b[64 * page - 1]), (1, 0, 2));
        assert!(blk.iter().all(|&x| x == 5));
        assert!(
            region_of(base, 1).is_some(),
            "the parent's buffer stays shared"
        );
        pool.free(block.as_ptr()).unwrap();
    }
}
