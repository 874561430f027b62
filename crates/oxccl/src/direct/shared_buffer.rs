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
        assert!(r.len >= 10_000 && r.len % rustix::param::page_size() as u64 == 0);
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
}
