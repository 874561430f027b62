//! A caching pool of [`SharedBuffer`]s for memory that no communicator asked for: the CPU
//! counterpart of NCCL's `ncclMemAlloc`/`ncclMemFree` (`oxcclMemAlloc`/`oxcclMemFree` in the
//! C ABI), and what the torch allocator of `oxccl.torch` serves large tensors from, so that
//! DDP's gradient buckets and FSDP's flat buffers are shared buffers (peers reach them with
//! loads and stores, see [`shared_buffer`](crate::direct::shared_buffer)) without the user
//! asking.
//!
//! - [`SharedPool::alloc`] rounds the size up to a size class (whole pages; above 16 pages,
//!   a multiple of a sixteenth of the next power of two, so under 12.5% more address space,
//!   and untouched pages of a memfd take no memory) and hands out a cached block of that
//!   class if there is one, else a fresh `SharedBuffer` (registered in the process's table).
//! - Requests up to [`SMALL_MAX`] bytes are carved from slabs instead: a slab is one
//!   [`SLAB_BYTES`] shared buffer cut into blocks of one power-of-two class, so that many
//!   small tensors cost one memfd (one file descriptor, one mapping, one peer mapping) per
//!   slab rather than each their own: a process may hold thousands of tensors of 64 KB-1 MB
//!   (activations), and a file descriptor each would exhaust `RLIMIT_NOFILE` (1024 by
//!   default) for the rest of the program. A block's region is its slab
//!   ([`region_of`](crate::direct::shared_buffer::region_of) finds the buffer that covers an
//!   address), so peers map a slab once for all its blocks.
//! - [`SharedPool::free`] puts the block back in the cache. A block allocated again keeps its
//!   region id, so the peers' mappings of it (cached per id) stay valid: a tensor freed and
//!   allocated again every step (a temporary, a bucket rebuilt) is mapped by each peer once.
//! - The cache holds at most a bound of bytes (`OXCCL_SHM_POOL_CACHE`, see
//!   [`crate::base::param::shm_pool_cache_bytes`]); beyond it the least recently freed blocks
//!   are unmapped (their memory returns to the system once the peers that mapped them evict
//!   their mappings too). Free blocks of a slab count as cached; a slab is unmapped when none
//!   of its blocks is live and the cache is over its bound (a slab with a live block stays).
//! - Every whole block and every slab keeps its memfd open (a peer takes its copy of the
//!   descriptor from this process), so the pool holds at most half of the process's limit of
//!   open files (`RLIMIT_NOFILE`, often 1024): past it, a fresh buffer first unmaps the least
//!   recently freed cached blocks, then is refused (torch's allocator then serves private
//!   memory), and the program keeps descriptors for its files, sockets and pipes.
//!
//! After `fork` the child holds private copies of the parent's live blocks as they were at
//! the fork (at the same addresses, see [`shared_buffer`](crate::direct::shared_buffer)'s fork
//! handlers), so neither sees the other's writes; the cached blocks and the free blocks of slabs are not copied
//! (`fork_live_ranges`: they read as zero pages there). Its pool forgets the cache and a block
//! it frees that the parent allocated is unmapped in the child, never cached (a copy is no
//! longer a shared buffer).
//! Thread-safe: one lock around the pool's tables, which `fork` takes for the process's pool
//! ([`SharedPool::global`], `pthread_atfork`), so that a child forked while another thread
//! allocates or frees finds it free.

use std::collections::{HashMap, VecDeque};
use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock};

use crate::base::error::{Error, Result};
use crate::direct::shared_buffer::{
    fork_generation, install_fork_handlers, set_fork_live_ranges, SharedBuffer,
};

/// A caching pool of shared buffers (see `direct/shared_pool.rs`); [`SharedPool::global`] is the
/// process's, which the C ABI and the torch allocator use.
pub struct SharedPool {
    state: Mutex<State>,
    /// Bytes the cache may hold.
    limit: usize,
}

/// Hashes block addresses and size classes (page multiples) with one multiplication: the
/// pool looks them up on every allocation and free, and the default SipHash costs more than
/// the rest.
#[derive(Clone, Copy, Default)]
struct AddrHash(u64);

impl std::hash::Hasher for AddrHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = ((n as u64) >> 12 ^ n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type AddrMap<V> = HashMap<usize, V, std::hash::BuildHasherDefault<AddrHash>>;

/// Bytes of one slab (see the [module](self)).
pub(crate) const SLAB_BYTES: usize = 4 << 20;

/// The largest request served from a slab; larger ones get a shared buffer each.
pub(crate) const SMALL_MAX: usize = 512 << 10;

/// Words of a slab's mask of live blocks: one bit per block of the smallest class (a page,
/// at least 4 KiB).
const SLAB_MASK_WORDS: usize = SLAB_BYTES / 4096 / 64;

impl Slab {
    /// Marks the block at `addr` (in this slab) live or free.
    fn mark(&mut self, addr: usize, live: bool) {
        let i = (addr - self.buf.as_ptr() as usize) / self.class;
        let bit = 1u64 << (i % 64);
        if live {
            self.live += 1;
            self.live_mask[i / 64] |= bit;
        } else {
            self.live -= 1;
            self.live_mask[i / 64] &= !bit;
        }
    }
}

struct State {
    /// The fork generation the blocks were made in ([`fork_generation`]; a forked child
    /// starts afresh).
    generation: u64,
    /// Handed out, by address, with the fork generation that allocated them.
    live: AddrMap<Live>,
    /// Freed and kept, the most recently freed last.
    cached: VecDeque<SharedBuffer>,
    /// Bytes of `cached` and of the free blocks of this process's slabs.
    cached_bytes: usize,
    /// Slabs, by base address.
    slabs: AddrMap<Slab>,
    /// Free blocks of this process's slabs (address, slab), by class (a power of two), the
    /// most recently freed last.
    small_free: AddrMap<Vec<(usize, usize)>>,
    /// Shared buffers the pool holds (whole blocks live and cached, slabs), each a file
    /// descriptor, and those being made; at most [`fd_cap`].
    fds: usize,
}

impl State {
    /// Counts a descriptor for a shared buffer about to be made, unmapping the least recently
    /// freed cached blocks (returned, to be dropped outside the lock) if the pool holds
    /// [`fd_cap`] already; fails if it still does.
    fn reserve_fd(&mut self) -> Result<Vec<SharedBuffer>> {
        let cap = fd_cap();
        let mut evicted = Vec::new();
        while self.fds >= cap {
            let Some(old) = self.cached.pop_front() else {
                return Err(pool_error(format!(
                    "the pool holds {} shared buffers, each an open file descriptor: half of \
                     this process's limit of open files (RLIMIT_NOFILE {}); raise it (ulimit \
                     -n) to allocate more",
                    self.fds,
                    cap.saturating_mul(2)
                )));
            };
            self.cached_bytes -= old.len();
            self.fds -= 1;
            evicted.push(old);
        }
        self.fds += 1;
        Ok(evicted)
    }
}

/// A block handed out.
enum Live {
    /// A shared buffer of its own, with the fork generation that allocated it.
    Whole(SharedBuffer, u64),
    /// A block of the slab at `slab`, of `class` bytes, allocated in fork generation `generation`.
    Small {
        slab: usize,
        class: usize,
        generation: u64,
    },
}

impl Live {
    fn bytes(&self) -> usize {
        match self {
            Live::Whole(b, _) => b.len(),
            Live::Small { class, .. } => *class,
        }
    }
}

/// One slab: a shared buffer cut into blocks of one class.
struct Slab {
    /// The slab's memory, unmapped when the slab is dropped.
    buf: SharedBuffer,
    /// Its blocks' size (a power of two, at least a page).
    class: usize,
    /// Its blocks handed out.
    live: usize,
    /// Which of its blocks are handed out (bit `i`: the block at `i * class`), what a forked
    /// child copies of it (see [`fork_live_ranges`]).
    live_mask: [u64; SLAB_MASK_WORDS],
    /// Made by a parent process (this is a forked child): never handed out nor unmapped here,
    /// as blocks the parent allocated may still be in use.
    inherited: bool,
}

/// What a pool holds: blocks handed out and blocks cached, and their bytes (size classes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks handed out and not freed.
    pub live_blocks: usize,
    /// Their bytes.
    pub live_bytes: usize,
    /// Blocks freed and kept for reuse.
    pub cached_blocks: usize,
    /// Their bytes.
    pub cached_bytes: usize,
}

/// The size class of a `bytes`-byte request: whole pages, and above 16 pages a multiple of
/// a sixteenth of the next power of two. `None` if it overflows.
pub(crate) fn size_class(bytes: usize) -> Option<usize> {
    let page = rustix::param::page_size();
    let n = bytes.max(1).checked_next_multiple_of(page)?;
    if n <= 16 * page {
        return Some(n);
    }
    let step = n.checked_next_power_of_two()? / 16;
    n.checked_next_multiple_of(step)
}

/// How many file descriptors the pool may hold: half of the process's limit of open files
/// (`RLIMIT_NOFILE`, 1024 by default on many systems). Every whole block and every slab keeps
/// its memfd open (peers take their copy of it from this process); past the limit every
/// `open`, socket and pipe of the program would fail, so the pool refuses first (torch's
/// allocator then serves private memory).
fn fd_cap() -> usize {
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .map_or(usize::MAX, |n| usize::try_from(n / 2).unwrap_or(usize::MAX))
}

fn pool_error(msg: String) -> Error {
    Error::SharedPool { msg }
}

/// A fresh shared buffer of `bytes` bytes; an error names `what` was asked for.
fn fresh(bytes: usize, what: impl FnOnce() -> String) -> Result<SharedBuffer> {
    SharedBuffer::new(bytes, 0).map_err(|e| match e {
        Error::SharedMemory { msg, .. } => pool_error(format!("cannot allocate {}: {msg}", what())),
        other => other,
    })
}

impl SharedPool {
    /// An empty pool whose cache holds at most `cache_bytes` bytes.
    pub fn new(cache_bytes: usize) -> SharedPool {
        SharedPool {
            state: Mutex::new(State {
                generation: fork_generation(),
                live: AddrMap::default(),
                cached: VecDeque::new(),
                cached_bytes: 0,
                slabs: AddrMap::default(),
                small_free: AddrMap::default(),
                fds: 0,
            }),
            limit: cache_bytes,
        }
    }

    /// The process's pool (its cache bound read from `OXCCL_SHM_POOL_CACHE` on first use).
    pub fn global() -> &'static SharedPool {
        GLOBAL.get_or_init(|| {
            // The pool's fork handlers after the registry's: `fork` takes the pool's lock
            // first, as every thread does (see `held_over_fork`).
            install_fork_handlers();
            static ONCE: std::sync::Once = std::sync::Once::new();
            // SAFETY: the three handlers are `extern "C"` functions that never unwind.
            ONCE.call_once(|| unsafe {
                libc::pthread_atfork(
                    Some(held_over_fork::prepare),
                    Some(held_over_fork::release),
                    Some(held_over_fork::release),
                );
            });
            set_fork_live_ranges(fork_live_ranges);
            SharedPool::new(crate::base::param::shm_pool_cache_bytes())
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let me = fork_generation();
        if s.generation != me {
            // A forked child: the cached blocks are the parent's to hand out again. Dropping
            // them here unmaps them in this process only.
            s.generation = me;
            s.fds -= s.cached.len();
            s.cached.clear();
            s.cached_bytes = 0;
            s.small_free.clear();
            for slab in s.slabs.values_mut() {
                slab.inherited = true;
            }
        }
        s
    }

    /// A block of at least `bytes` bytes (page-aligned) in shared memory, its contents
    /// undefined (zero when fresh); `bytes == 0` gets a one-page block. Fails (nothing
    /// allocated) if the system cannot create or map the memfd.
    pub fn alloc(&self, bytes: usize) -> Result<NonNull<u8>> {
        let class = size_class(bytes)
            .ok_or_else(|| pool_error(format!("a shared block of {bytes} bytes is too large")))?;
        if class <= SMALL_MAX {
            return self.alloc_small(class.next_power_of_two());
        }
        let mut s = self.lock();
        let reuse = s.cached.iter().rposition(|b| b.len() == class);
        let block = match reuse {
            Some(i) => {
                s.cached_bytes -= class;
                s.cached.remove(i).expect("index from rposition")
            }
            None => {
                let evicted = s.reserve_fd()?;
                // Not under the lock: creating and mapping a memfd takes system calls.
                drop(s);
                drop(evicted);
                let b = self.fresh_reserved(class, || format!("{bytes} bytes"))?;
                s = self.lock();
                b
            }
        };
        let ptr = NonNull::new(block.as_ptr().cast_mut()).expect("a mapping is not null");
        let generation = s.generation;
        s.live
            .insert(ptr.as_ptr() as usize, Live::Whole(block, generation));
        Ok(ptr)
    }

    /// A block of `class` bytes (a power of two up to [`SMALL_MAX`]) from a slab.
    fn alloc_small(&self, class: usize) -> Result<NonNull<u8>> {
        let mut s = self.lock();
        let (addr, slab) = match s.small_free.get_mut(&class).and_then(Vec::pop) {
            Some(a) => {
                s.cached_bytes -= class;
                a
            }
            None => {
                let evicted = s.reserve_fd()?;
                // Not under the lock: creating and mapping a memfd takes system calls.
                drop(s);
                drop(evicted);
                let buf = self.fresh_reserved(SLAB_BYTES, || format!("a {class}-byte block"))?;
                let base = buf.as_ptr() as usize;
                s = self.lock();
                // The other blocks go to the free list, the lowest address handed out first.
                let free = s.small_free.entry(class).or_default();
                free.extend(
                    (1..SLAB_BYTES / class)
                        .rev()
                        .map(|i| (base + i * class, base)),
                );
                s.cached_bytes += SLAB_BYTES - class;
                s.slabs.insert(
                    base,
                    Slab {
                        buf,
                        class,
                        live: 0,
                        live_mask: [0; SLAB_MASK_WORDS],
                        inherited: false,
                    },
                );
                (base, base)
            }
        };
        s.slabs
            .get_mut(&slab)
            .expect("a free block's slab")
            .mark(addr, true);
        let generation = s.generation;
        s.live.insert(
            addr,
            Live::Small {
                slab,
                class,
                generation,
            },
        );
        Ok(NonNull::new(addr as *mut u8).expect("a mapping is not null"))
    }

    /// Returns the block at `ptr` (as [`alloc`](Self::alloc) gave it) to the cache; fails,
    /// changing nothing, if `ptr` is not a live block of this pool.
    pub fn free(&self, ptr: *const u8) -> Result<()> {
        let mut s = self.lock();
        let (block, generation) = match s.live.remove(&(ptr as usize)) {
            Some(Live::Whole(block, generation)) => (block, generation),
            Some(Live::Small {
                slab,
                class,
                generation,
            }) => {
                if generation != s.generation {
                    // The parent's block, in the parent's slab: never handed out here.
                    return Ok(());
                }
                let sl = s.slabs.get_mut(&slab).expect("a live block's slab");
                sl.mark(ptr as usize, false);
                let empty = sl.live == 0;
                s.cached_bytes += class;
                s.small_free
                    .entry(class)
                    .or_default()
                    .push((ptr as usize, slab));
                if !(empty && s.cached_bytes > self.limit) {
                    return Ok(());
                }
                // Over the bound with this slab unused: unmap it.
                s.small_free
                    .get_mut(&class)
                    .expect("pushed above")
                    .retain(|&(_, sb)| sb != slab);
                s.cached_bytes -= SLAB_BYTES;
                s.fds -= 1;
                let gone = s.slabs.remove(&slab).expect("a live block's slab");
                drop(s);
                drop(gone); // munmap outside the lock
                return Ok(());
            }
            None => {
                return Err(pool_error(format!(
                    "free of {ptr:?}, which is not a live block of the pool (freed twice, or \
                     not from oxcclMemAlloc)"
                )))
            }
        };
        if generation != s.generation {
            // The parent's block: still in use there; unmap it here only.
            s.fds -= 1;
            drop(s);
            drop(block);
            return Ok(());
        }
        s.cached_bytes += block.len();
        s.cached.push_back(block);
        let mut evicted = Vec::new();
        while s.cached_bytes > self.limit {
            let Some(old) = s.cached.pop_front() else {
                break;
            };
            s.cached_bytes -= old.len();
            s.fds -= 1;
            evicted.push(old);
        }
        drop(s);
        drop(evicted); // munmap outside the lock
        Ok(())
    }

    /// A fresh shared buffer for which [`State::reserve_fd`] counted a descriptor (given back
    /// if it cannot be made).
    fn fresh_reserved(&self, bytes: usize, what: impl FnOnce() -> String) -> Result<SharedBuffer> {
        fresh(bytes, what).inspect_err(|_| self.lock().fds -= 1)
    }

    /// Whether `ptr` is the start of a live block of this pool.
    pub fn owns(&self, ptr: *const u8) -> bool {
        self.lock().live.contains_key(&(ptr as usize))
    }

    /// What the pool holds now.
    pub fn stats(&self) -> PoolStats {
        let s = self.lock();
        PoolStats {
            live_blocks: s.live.len(),
            live_bytes: s.live.values().map(Live::bytes).sum(),
            cached_blocks: s.cached.len() + s.small_free.values().map(Vec::len).sum::<usize>(),
            cached_bytes: s.cached_bytes,
        }
    }
}

impl std::fmt::Debug for SharedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedPool")
            .field("limit", &self.limit)
            .field("stats", &self.stats())
            .finish()
    }
}

/// The global pool's [`LiveRanges`](crate::direct::shared_buffer::LiveRanges): what a forked
/// child must copy of the parent's buffer at `base`. A whole block handed out: all of it; a
/// slab: its blocks handed out, not the free ones; a cached block: nothing (the child's pool
/// forgets its cache, and the bytes of a freed block are nobody's). Any other buffer (one the
/// pool is still making, or not the pool's): unknown, all of it. The state is the parent's at
/// the instant of `fork` (its lock is held across it).
fn fork_live_ranges(base: usize, len: usize, copy: &mut dyn FnMut(usize, usize)) -> bool {
    held_over_fork::with_held(|s| {
        if let Some(slab) = s.slabs.get(&base) {
            if slab.buf.as_ptr() as usize != base || slab.buf.len() != len {
                return false;
            }
            for (w, &word) in slab.live_mask.iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let i = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    copy(i * slab.class, (i + 1) * slab.class);
                }
            }
            return true;
        }
        if s.live.contains_key(&base) {
            return false;
        }
        s.cached
            .iter()
            .any(|b| b.as_ptr() as usize == base && b.len() == len)
    })
    .unwrap_or(false)
}

/// The process's pool ([`SharedPool::global`]).
static GLOBAL: OnceLock<SharedPool> = OnceLock::new();

/// The global pool's lock is held across `fork`: a thread other than the forking one that
/// holds it when the process forks does not exist in the child, so the child's first use of
/// the pool (a DataLoader worker freeing a tensor it inherited, through torch's allocator)
/// would wait for ever on a lock nobody releases. `prepare` takes it (after any allocation or
/// free in flight), `release` (in parent and child) drops it. Lock order: the pool's, then the
/// registry's (the child's pool unmaps inherited blocks under its lock), which `fork` keeps:
/// these handlers are installed after the registry's, so their `prepare` runs first.
mod held_over_fork {
    use super::{State, GLOBAL};
    use std::cell::UnsafeCell;
    use std::sync::MutexGuard;

    struct Held(UnsafeCell<Option<MutexGuard<'static, State>>>);
    // SAFETY: only the forking thread touches the cell, in order: `prepare` stores, `release`
    // (parent or child, the same thread) takes; the pool's lock serializes forks.
    unsafe impl Sync for Held {}
    static HELD: Held = Held(UnsafeCell::new(None));

    pub(super) unsafe extern "C" fn prepare() {
        if let Some(pool) = GLOBAL.get() {
            let guard = pool.state.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: see `Held`.
            unsafe { *HELD.0.get() = Some(guard) };
        }
    }

    /// Runs `f` on the global pool's state while `fork` holds its lock (between `prepare` and
    /// `release`, on the forking thread: in the registry's `prepare` handler, which runs after
    /// this one's); `None` at any other time or if the pool did not exist at `prepare`.
    pub(super) fn with_held<R>(f: impl FnOnce(&State) -> R) -> Option<R> {
        // SAFETY: see `Held`; only the forking thread calls this, between `prepare` and
        // `release` (elsewhere the cell is `None`: `release` emptied it), and reads only.
        unsafe { (*HELD.0.get()).as_deref().map(f) }
    }

    pub(super) unsafe extern "C" fn release() {
        // SAFETY: see `Held`; `prepare` ran on this thread.
        drop(unsafe { (*HELD.0.get()).take() });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::direct::shared_buffer::{child_exit_code, region_of};

    #[test]
    fn size_classes_cover_the_request_with_little_slack() {
        let page = rustix::param::page_size();
        assert_eq!(size_class(0), Some(page));
        assert_eq!(size_class(1), Some(page));
        assert_eq!(size_class(16 * page), Some(16 * page));
        for bytes in [
            16 * page + 1,
            1 << 20,
            (1 << 20) + 1,
            25 << 20,
            26_214_400,
            1 << 30,
        ] {
            let c = size_class(bytes).unwrap();
            assert!(c >= bytes && c.is_multiple_of(page), "{bytes} -> {c}");
            assert!(c - bytes <= bytes / 8 + page, "{bytes} -> {c}");
        }
        assert_eq!(size_class(usize::MAX), None);
    }

    #[test]
    fn a_freed_block_is_reused_with_its_region_id_and_contents_are_shared_memory() {
        let pool = SharedPool::new(64 << 20);
        let p = pool.alloc(3 << 20).unwrap();
        // SAFETY: the block holds at least 3 MiB.
        let block = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), 3 << 20) };
        assert!(block.iter().all(|&b| b == 0), "fresh blocks are zero");
        block.fill(5);
        let r = region_of(p.as_ptr(), 3 << 20).expect("registered as a shared buffer");
        assert!(pool.owns(p.as_ptr()));
        assert_eq!(pool.stats().live_blocks, 1);
        pool.free(p.as_ptr()).unwrap();
        assert!(!pool.owns(p.as_ptr()));
        assert_eq!(pool.stats().cached_blocks, 1);
        // Same class: the same block, same region id; a different class: a fresh block.
        let q = pool.alloc((3 << 20) - 100).unwrap();
        assert_eq!(q, p);
        assert_eq!(region_of(q.as_ptr(), 1).unwrap().id, r.id);
        let other = pool.alloc(8 << 20).unwrap();
        assert_ne!(region_of(other.as_ptr(), 1).unwrap().id, r.id);
        assert_eq!(
            pool.stats(),
            PoolStats {
                live_blocks: 2,
                live_bytes: size_class(3 << 20).unwrap() + size_class(8 << 20).unwrap(),
                cached_blocks: 0,
                cached_bytes: 0
            }
        );
        pool.free(q.as_ptr()).unwrap();
        pool.free(other.as_ptr()).unwrap();
    }

    #[test]
    fn bad_frees_fail_with_the_pointer_and_change_nothing() {
        let pool = SharedPool::new(1 << 20);
        let p = pool.alloc(10).unwrap();
        let inner = p.as_ptr().wrapping_add(8);
        let e = pool.free(inner).unwrap_err();
        assert!(matches!(e, Error::SharedPool { .. }), "{e}");
        assert!(e.to_string().contains("not a live block"), "{e}");
        assert!(pool.owns(p.as_ptr()));
        pool.free(p.as_ptr()).unwrap();
        let e = pool.free(p.as_ptr()).unwrap_err();
        assert!(e.to_string().contains("freed twice"), "{e}");
        let v = [0u8; 8];
        assert!(pool.free(v.as_ptr()).is_err());
        assert!(pool.alloc(usize::MAX).is_err());
    }

    #[test]
    fn the_cache_keeps_at_most_its_bound_evicting_the_oldest() {
        let mib = 1 << 20;
        let pool = SharedPool::new(5 * mib);
        let blocks: Vec<_> = (0..4).map(|_| pool.alloc(2 * mib).unwrap()).collect();
        for b in &blocks {
            pool.free(b.as_ptr()).unwrap();
        }
        let s = pool.stats();
        assert_eq!((s.cached_blocks, s.cached_bytes), (2, 4 * mib));
        // The oldest two were unmapped and unregistered; the newest two are kept.
        assert!(region_of(blocks[0].as_ptr(), 1).is_none());
        assert!(region_of(blocks[3].as_ptr(), 1).is_some());
        let again = pool.alloc(2 * mib).unwrap();
        assert_eq!(again, blocks[3], "the most recently freed first");
        pool.free(again.as_ptr()).unwrap();
        // A zero bound caches nothing.
        let none = SharedPool::new(0);
        let p = none.alloc(mib).unwrap();
        none.free(p.as_ptr()).unwrap();
        assert_eq!(none.stats(), PoolStats::default());
        assert!(region_of(p.as_ptr(), 1).is_none());
    }

    #[test]
    fn small_blocks_share_a_slab_and_its_region_and_come_back_in_their_class() {
        let page = rustix::param::page_size();
        let pool = SharedPool::new(64 << 20);
        // 64 blocks of 64 KiB fill one 4 MiB slab: one region, one memfd, for all of them.
        let blocks: Vec<_> = (0..64).map(|_| pool.alloc(60 << 10).unwrap()).collect();
        let r0 = region_of(blocks[0].as_ptr(), 64 << 10).expect("a shared buffer");
        assert_eq!(r0.len as usize, SLAB_BYTES);
        for (i, b) in blocks.iter().enumerate() {
            let r = region_of(b.as_ptr(), 64 << 10).expect("a shared buffer");
            assert_eq!(r.id, r0.id, "block {i} in another slab");
            assert_eq!(b.as_ptr() as usize % page, 0);
        }
        // Distinct, non-overlapping blocks: each keeps what is written into it.
        for (i, b) in blocks.iter().enumerate() {
            // SAFETY: each block holds 64 KiB and is this test's alone.
            unsafe { std::ptr::write_bytes(b.as_ptr(), i as u8, 64 << 10) };
        }
        for (i, b) in blocks.iter().enumerate() {
            // SAFETY: as above.
            let s = unsafe { std::slice::from_raw_parts(b.as_ptr(), 64 << 10) };
            assert!(s.iter().all(|&x| x == i as u8), "block {i} overwritten");
        }
        // The 65th opens a second slab; other classes have slabs of their own.
        let more = pool.alloc(64 << 10).unwrap();
        assert_ne!(region_of(more.as_ptr(), 1).unwrap().id, r0.id);
        let small = pool.alloc(100).unwrap();
        assert_ne!(region_of(small.as_ptr(), 1).unwrap().id, r0.id);
        let st = pool.stats();
        assert_eq!(st.live_blocks, 66);
        assert_eq!(st.live_bytes, 65 * (64 << 10) + page);
        // A freed block is handed out again for its class (most recently freed first).
        pool.free(blocks[7].as_ptr()).unwrap();
        assert_eq!(pool.alloc(33 << 10).unwrap(), blocks[7]);
        for b in blocks.iter().chain([&more, &small]) {
            pool.free(b.as_ptr()).unwrap();
        }
        assert_eq!(pool.stats().live_blocks, 0);
        // A block freed twice is refused, as a whole block is.
        assert!(pool.free(blocks[0].as_ptr()).is_err());
    }

    #[test]
    fn an_unused_slab_is_unmapped_over_the_bound_and_a_used_one_stays() {
        let pool = SharedPool::new(0);
        let a = pool.alloc(128 << 10).unwrap();
        let b = pool.alloc(128 << 10).unwrap();
        pool.free(a.as_ptr()).unwrap();
        // b still lives in the slab: it stays mapped and registered.
        assert!(region_of(b.as_ptr(), 128 << 10).is_some());
        assert!(region_of(a.as_ptr(), 1).is_some());
        pool.free(b.as_ptr()).unwrap();
        assert!(
            region_of(b.as_ptr(), 1).is_none(),
            "the empty slab stays mapped"
        );
        assert_eq!(pool.stats(), PoolStats::default());
        // Under the bound an empty slab is kept, its blocks counted as cached.
        let keep = SharedPool::new(64 << 20);
        let c = keep.alloc(256 << 10).unwrap();
        keep.free(c.as_ptr()).unwrap();
        let st = keep.stats();
        assert_eq!((st.cached_blocks, st.cached_bytes), (16, SLAB_BYTES));
        assert_eq!(keep.alloc(256 << 10).unwrap(), c);
        keep.free(c.as_ptr()).unwrap();
    }

    /// Another thread holds the pool's lock (an allocation or free in flight) when this one
    /// forks: the child's pool must still work (it did not: the child waited for ever on a
    /// lock whose holder does not exist there; here a 10 s alarm ends such a child).
    #[test]
    fn a_fork_while_another_thread_is_in_the_pool_leaves_the_child_a_working_pool() {
        let pool = SharedPool::global();
        let inherited = pool.alloc(100).unwrap();
        let (held, hold) = std::sync::mpsc::channel();
        let holder = std::thread::spawn(move || {
            let g = SharedPool::global().state.lock().unwrap();
            held.send(()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(g);
        });
        hold.recv().unwrap();
        // SAFETY: the child only uses the pool (glibc's malloc is fork-safe) and `_exit`s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: plain system calls; SIGALRM's default action ends a child that hangs.
            unsafe { libc::alarm(10) };
            let ok = pool.free(inherited.as_ptr()).is_ok()
                && pool.alloc(100).is_ok_and(|p| pool.free(p.as_ptr()).is_ok());
            // SAFETY: ends the child without running the test harness's code.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let code = child_exit_code(pid);
        holder.join().unwrap();
        assert_eq!(code, 0, "the child's pool failed");
        pool.free(inherited.as_ptr()).unwrap();
    }

    /// Blocks above SMALL_MAX take a file descriptor each: the pool must leave the program
    /// open files (it did not: 1000 tensors of 600 KB made every later `open` fail with
    /// EMFILE). In a forked child, whose limit of open files is lowered.
    #[test]
    fn the_pool_leaves_half_the_open_file_limit_to_the_program() {
        // SAFETY: the child makes system calls and uses the pool (glibc's malloc is
        // fork-safe), then `_exit`s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: plain system calls.
            let code = unsafe {
                libc::alarm(30);
                // The descriptors the test process had open, inherited.
                let base = (0..65_536)
                    .filter(|&fd| libc::fcntl(fd, libc::F_GETFD) >= 0)
                    .count() as u64;
                let mut lim = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
                lim.rlim_cur = (2 * base + 200).min(lim.rlim_max);
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
                let pool = SharedPool::new(1 << 30);
                let mut got = Vec::new();
                while got.len() < 4 * lim.rlim_cur as usize {
                    match pool.alloc(600 << 10) {
                        Ok(p) => got.push(p),
                        Err(_) => break,
                    }
                }
                let opened: Vec<i32> = (0..40)
                    .map(|_| libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY))
                    .collect();
                // A freed block is handed out again at the bound.
                let again = !got.is_empty()
                    && pool.free(got[0].as_ptr()).is_ok()
                    && pool.alloc(600 << 10).is_ok();
                if opened.iter().any(|&fd| fd < 0) {
                    1
                } else if got.len() != (lim.rlim_cur / 2) as usize {
                    2
                } else if !again {
                    3
                } else {
                    0
                }
            };
            // SAFETY: ends the child without running the test harness's code.
            unsafe { libc::_exit(code) };
        }
        assert_eq!(
            child_exit_code(pid),
            0,
            "1: the program could not open files, 2: the pool held other than half the limit, \
             3: a freed block was not handed out again"
        );
    }

    /// A child forked from a process whose pool holds freed blocks copies only the live ones
    /// (it copied every registered buffer's written pages: with 2 MiB live, a 4 MiB cached
    /// block and a slab written all over, 10551296 bytes for 2162688 live), and still sees the
    /// parent's values at fork time, not the parent's later writes, nor the parent its own.
    /// Run in a forked "driver" process (single-threaded: the other tests' buffers there are
    /// private copies already) so that the count of copied bytes is this test's alone.
    #[test]
    fn a_forked_child_copies_only_the_live_blocks_and_sees_them_as_at_fork() {
        fn fill(p: NonNull<u8>, n: usize, v: u8) {
            // SAFETY: the caller's live block of at least `n` bytes.
            unsafe { std::ptr::write_bytes(p.as_ptr(), v, n) };
        }
        fn all(p: NonNull<u8>, n: usize, v: u8) -> bool {
            // SAFETY: the caller's live block of at least `n` bytes.
            unsafe { std::slice::from_raw_parts(p.as_ptr(), n) }
                .iter()
                .all(|&x| x == v)
        }
        // SAFETY: the driver uses the pool (glibc's malloc is fork-safe), forks, makes system
        // calls and `_exit`s.
        let driver = unsafe { libc::fork() };
        assert!(driver >= 0, "fork failed");
        if driver == 0 {
            // SAFETY: plain system call; SIGALRM's default action ends a driver that hangs.
            unsafe { libc::alarm(30) };
            let pool = SharedPool::global();
            let (mib, blk) = (1usize << 20, 32usize << 10);
            // Live: a whole block, and two blocks of a slab whose other blocks were written
            // and freed. Freed: a whole block (cached) and a slab with no live block.
            let whole = pool.alloc(2 * mib).unwrap();
            fill(whole, 2 * mib, 1);
            let cached = pool.alloc(4 * mib).unwrap();
            fill(cached, 4 * mib, 2);
            pool.free(cached.as_ptr()).unwrap();
            let slab: Vec<_> = (0..SLAB_BYTES / blk)
                .map(|_| pool.alloc(blk).unwrap())
                .collect();
            for (i, &b) in slab.iter().enumerate() {
                fill(b, blk, i as u8);
            }
            let (a, b) = (slab[5], slab[77]);
            for &p in slab.iter().filter(|&&p| p != a && p != b) {
                pool.free(p.as_ptr()).unwrap();
            }
            let empty = pool.alloc(64 << 10).unwrap();
            fill(empty, 64 << 10, 3);
            pool.free(empty.as_ptr()).unwrap();
            let mut fds = [-1i32; 2];
            // SAFETY: room for two descriptors.
            assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
            // SAFETY: as the driver.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let copied = crate::direct::shared_buffer::fork_copied_bytes();
                let at_fork = all(whole, 2 * mib, 1) && all(a, blk, 5) && all(b, blk, 77);
                let mut x = 0u8;
                // SAFETY: one byte into `x` once the driver has written its blocks.
                unsafe { libc::read(fds[0], (&mut x as *mut u8).cast(), 1) };
                let after = all(whole, 2 * mib, 1) && all(a, blk, 5) && all(b, blk, 77);
                fill(whole, 2 * mib, 9);
                fill(a, blk, 9);
                let private =
                    region_of(whole.as_ptr(), 1).is_none() && region_of(a.as_ptr(), 1).is_none();
                let works = pool.alloc(blk).is_ok_and(|p| {
                    fill(p, blk, 4);
                    pool.free(p.as_ptr()).is_ok()
                }) && pool
                    .alloc(4 * mib)
                    .is_ok_and(|p| pool.free(p.as_ptr()).is_ok());
                let code = if copied != (2 * mib + 2 * blk) as u64 {
                    let msg = format!("copied {copied} bytes, live {}\n", 2 * mib + 2 * blk);
                    // SAFETY: raw write to stderr (the harness's capture ends with the child).
                    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
                    1
                } else if !at_fork {
                    2
                } else if !after {
                    3
                } else if !private {
                    4
                } else if !works {
                    5
                } else {
                    0
                };
                // SAFETY: ends the child without running the test harness's code.
                unsafe { libc::_exit(code) };
            }
            fill(whole, 2 * mib, 7);
            fill(b, blk, 7);
            // SAFETY: one byte from a static to our pipe.
            unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) };
            let mut code = if pid < 0 { 10 } else { child_exit_code(pid) };
            if code == 0 && !(all(whole, 2 * mib, 7) && all(a, blk, 5) && all(b, blk, 7)) {
                code = 6;
            }
            // SAFETY: ends the driver without running the test harness's code.
            unsafe { libc::_exit(code) };
        }
        assert_eq!(
            child_exit_code(driver),
            0,
            "1: the child copied other than its live blocks (see stderr), 2: saw other values \
             than at fork, 3: saw the parent's later writes, 4: still shared, 5: its pool \
             failed, 6: the parent saw the child's writes"
        );
    }

    #[test]
    fn threads_allocate_and_free_concurrently() {
        let pool = SharedPool::new(64 << 20);
        std::thread::scope(|sc| {
            for t in 0..4u8 {
                let pool = &pool;
                sc.spawn(move || {
                    for i in 0..20 {
                        let n = (1 + (i % 3)) << 20;
                        let p = pool.alloc(n).unwrap();
                        // SAFETY: this thread's block of at least n bytes.
                        let s = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), n) };
                        s.fill(t);
                        assert!(s.iter().all(|&b| b == t), "another thread wrote my block");
                        pool.free(p.as_ptr()).unwrap();
                    }
                });
            }
        });
        assert_eq!(pool.stats().live_blocks, 0);
    }
}
