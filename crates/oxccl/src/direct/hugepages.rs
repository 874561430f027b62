//! Transparent registration of large private buffers: huge pages for the memory the kernel's
//! cross-memory copies (`process_vm_readv`/`writev`, [`crate::direct::cma`]) walk.
//!
//! Those copies pin and map the peer's pages one by one; on 4 KiB pages that walk, not the
//! copy, is much of their cost. The first time a private buffer of at least [`MIN_BYTES`]
//! takes the single-copy path, the 2 MiB-aligned part of it is advised `MADV_HUGEPAGE` (later
//! faults get huge pages where THP is `madvise`) and `MADV_COLLAPSE`d (Linux 6.1+: its present
//! pages are moved into huge pages now, contents kept). A small cache of the (address, length)
//! pairs already registered makes a reused buffer (a DDP bucket, `oxccl perf`'s buffers) pay
//! once, as NCCL registers a user buffer once. Both calls are hints: any failure (an older
//! kernel, THP `never`, no free huge page) leaves the buffer as it was, at its former speed.
//! `OXCCL_HUGEPAGES=0` turns it off ([`crate::base::param::hugepages_allowed`]).
//!
//! The cache only remembers addresses: a buffer freed and allocated again at the same address
//! in a fresh mapping is not registered again (it runs, a little slower, on small pages).

use std::sync::Mutex;

/// Buffers from this many bytes on are registered.
pub(crate) const MIN_BYTES: usize = 4 << 20;

/// Size of a transparent huge page (x86-64, arm64 with 4 KiB pages).
const HUGE: usize = 2 << 20;

/// How many registered buffers are remembered (the oldest is forgotten first).
const REMEMBERED: usize = 256;

static REGISTERED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// Registers the private buffer `[ptr, ptr + len)` if it is large, new to the cache and huge
/// pages are allowed. The caller owns the buffer (the advice changes no byte of it).
pub(crate) fn register(ptr: *const u8, len: usize) {
    if len < MIN_BYTES || !crate::base::param::hugepages_allowed() {
        return;
    }
    let key = (ptr as usize, len);
    {
        let mut seen = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(&key) {
            return;
        }
        if seen.len() == REMEMBERED {
            seen.remove(0);
        }
        seen.push(key);
    }
    advise(ptr, len, true);
}

/// Advises huge pages for a library-owned allocation of `len` bytes at `ptr` (staging,
/// scratch) before it is filled, so that its first touches fault in huge pages; no cache and
/// no collapse (it has no pages yet, or they are about to be overwritten).
pub(crate) fn advise_fresh(ptr: *const u8, len: usize) {
    if len >= MIN_BYTES && crate::base::param::hugepages_allowed() {
        advise(ptr, len, false);
    }
}

/// `MADV_HUGEPAGE`, then `MADV_COLLAPSE` if `collapse`, on the 2 MiB-aligned part of the range.
fn advise(ptr: *const u8, len: usize, collapse: bool) {
    let start = (ptr as usize).next_multiple_of(HUGE);
    let end = (ptr as usize).saturating_add(len) / HUGE * HUGE;
    if end <= start {
        return;
    }
    let mut advice = vec![libc::MADV_HUGEPAGE];
    if collapse {
        advice.push(libc::MADV_COLLAPSE);
    }
    for a in advice {
        // SAFETY: `[start, end)` lies within the caller's buffer (aligned inwards), which it
        // owns; neither advice changes the contents of the memory (MADV_COLLAPSE copies the
        // present pages into huge pages), they only change how it is backed.
        let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, a) };
        if rc != 0 {
            // EINVAL (older kernel, not anonymous memory), EAGAIN, ENOMEM (no huge page
            // free), EPERM: the buffer stays on small pages.
            tracing::debug!(
                advice = a,
                bytes = end - start,
                "madvise for huge pages failed: {}",
                std::io::Error::last_os_error()
            );
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Registering changes no byte of the buffer, aligned or not, and a second registration
    /// of the same buffer is a cache hit.
    #[test]
    fn register_keeps_contents() {
        let len = 9 << 20;
        let mut v: Vec<u8> = (0..len + 1).map(|i| (i * 31 % 251) as u8).collect();
        let want = v.clone();
        let p = v[1..].as_mut_ptr();
        register(p, len);
        assert_eq!(v, want);
        if crate::base::param::hugepages_allowed() {
            assert!(REGISTERED.lock().unwrap().contains(&(p as usize, len)));
        }
        register(p, len);
        advise_fresh(v.as_ptr(), len);
        assert_eq!(v, want);
    }

    /// Small buffers are left alone.
    #[test]
    fn small_buffers_not_registered() {
        let v = vec![7u8; MIN_BYTES - 1];
        register(v.as_ptr(), v.len());
        assert!(!REGISTERED
            .lock()
            .unwrap()
            .contains(&(v.as_ptr() as usize, v.len())));
    }
}
