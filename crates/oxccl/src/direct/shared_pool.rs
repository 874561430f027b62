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
//! - [`SharedPool::free`] puts the block back in the cache. A block allocated again keeps its
//!   region id, so the peers' mappings of it (cached per id) stay valid: a tensor freed and
//!   allocated again every step (a temporary, a bucket rebuilt) is mapped by each peer once.
//! - The cache holds at most a bound of bytes (`OXCCL_SHM_POOL_CACHE`, see
//!   [`crate::base::param::shm_pool_cache_bytes`]); beyond it the least recently freed blocks
//!   are unmapped (their memory returns to the system once the peers that mapped them evict
//!   their mappings too).
//!
//! After `fork` the child holds private copies of the parent's blocks (at the same addresses,
//! see [`shared_buffer`](crate::direct::shared_buffer)'s fork handler), so neither sees the
//! other's writes; its pool forgets the cache and a block it frees that the parent allocated
//! is unmapped in the child, never cached (a copy is no longer a shared buffer).
//! Thread-safe: one lock around the pool's tables.

use std::collections::{HashMap, VecDeque};
use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock};

use crate::base::error::{Error, Result};
use crate::direct::shared_buffer::SharedBuffer;

/// A caching pool of shared buffers (see the [module](self)); [`SharedPool::global`] is the
/// process's, which the C ABI and the torch allocator use.
pub struct SharedPool {
    state: Mutex<State>,
    /// Bytes the cache may hold.
    limit: usize,
}

struct State {
    /// The process the blocks were made in (a forked child starts afresh).
    pid: u32,
    /// Handed out, by address, with the process that allocated them.
    live: HashMap<usize, (SharedBuffer, u32)>,
    /// Freed and kept, the most recently freed last.
    cached: VecDeque<SharedBuffer>,
    cached_bytes: usize,
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

fn pool_error(msg: String) -> Error {
    Error::SharedPool { msg }
}

impl SharedPool {
    /// An empty pool whose cache holds at most `cache_bytes` bytes.
    pub fn new(cache_bytes: usize) -> SharedPool {
        SharedPool {
            state: Mutex::new(State {
                pid: std::process::id(),
                live: HashMap::new(),
                cached: VecDeque::new(),
                cached_bytes: 0,
            }),
            limit: cache_bytes,
        }
    }

    /// The process's pool (its cache bound read from `OXCCL_SHM_POOL_CACHE` on first use).
    pub fn global() -> &'static SharedPool {
        static POOL: OnceLock<SharedPool> = OnceLock::new();
        POOL.get_or_init(|| SharedPool::new(crate::base::param::shm_pool_cache_bytes()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let me = std::process::id();
        if s.pid != me {
            // A forked child: the cached blocks are the parent's to hand out again. Dropping
            // them here unmaps them in this process only.
            s.pid = me;
            s.cached.clear();
            s.cached_bytes = 0;
        }
        s
    }

    /// A block of at least `bytes` bytes (page-aligned) in shared memory, its contents
    /// undefined (zero when fresh); `bytes == 0` gets a one-page block. Fails (nothing
    /// allocated) if the system cannot create or map the memfd.
    pub fn alloc(&self, bytes: usize) -> Result<NonNull<u8>> {
        let class = size_class(bytes)
            .ok_or_else(|| pool_error(format!("a shared block of {bytes} bytes is too large")))?;
        let mut s = self.lock();
        let reuse = s.cached.iter().rposition(|b| b.len() == class);
        let block = match reuse {
            Some(i) => {
                s.cached_bytes -= class;
                s.cached.remove(i).expect("index from rposition")
            }
            None => {
                // Not under the lock: creating and mapping a memfd takes system calls.
                drop(s);
                let b = SharedBuffer::new(class, 0).map_err(|e| match e {
                    Error::SharedMemory { msg, .. } => {
                        pool_error(format!("cannot allocate {bytes} bytes: {msg}"))
                    }
                    other => other,
                })?;
                s = self.lock();
                b
            }
        };
        let ptr = NonNull::new(block.as_ptr().cast_mut()).expect("a mapping is not null");
        let pid = s.pid;
        s.live.insert(ptr.as_ptr() as usize, (block, pid));
        Ok(ptr)
    }

    /// Returns the block at `ptr` (as [`alloc`](Self::alloc) gave it) to the cache; fails,
    /// changing nothing, if `ptr` is not a live block of this pool.
    pub fn free(&self, ptr: *const u8) -> Result<()> {
        let mut s = self.lock();
        let Some((block, pid)) = s.live.remove(&(ptr as usize)) else {
            return Err(pool_error(format!(
                "free of {ptr:?}, which is not a live block of the pool (freed twice, or not \
                 from oxcclMemAlloc)"
            )));
        };
        if pid != s.pid {
            // The parent's block: still in use there; unmap it here only.
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
            evicted.push(old);
        }
        drop(s);
        drop(evicted); // munmap outside the lock
        Ok(())
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
            live_bytes: s.live.values().map(|(b, _)| b.len()).sum(),
            cached_blocks: s.cached.len(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::direct::shared_buffer::region_of;

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
