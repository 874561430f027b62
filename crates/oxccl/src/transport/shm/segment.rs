//! One rank's shared-memory segment: a file in `/dev/shm`, its layout and its validation.
//!
//! Layout (all offsets from the start of the mapping, little-endian, native atomics):
//!
//! | offset | size | content |
//! |---|---|---|
//! | 0 | 128 | [`Header`]: magic `"OXCCLSHM"`, version, owner pid and rank, ring count and capacity, total size, tag, budget, bytes allocated |
//! | 128 | 128 | the owner's [`Doorbell`] |
//! | 256 | 4 × nrings | ring directory: the producer rank of ring `i` |
//! | `rings_offset` (page aligned) | `stride` × nrings | rings: a 4 KiB page holding the [`RingCtrl`], then `cap` data bytes (rounded up to a page) |

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};

use rustix::fs::{FallocateFlags, Mode, OFlags};
use rustix::mm::{MapFlags, ProtFlags};

use super::handoff::{self, Sharing};
use super::ring::RingCtrl;
use crate::base::wait::Doorbell;

/// `"OXCCLSHM"` as a little-endian `u64`.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"OXCCLSHM");
/// Layout version; bump on any change of the layout or the ring protocol.
pub(crate) const VERSION: u32 = 2;
/// Where segments live.
pub(crate) const SHM_DIR: &str = "/dev/shm";
/// File-name prefix of every segment.
pub(crate) const PREFIX: &str = "oxccl-";

const PAGE: u64 = 4096;
pub(crate) const DOORBELL_OFFSET: usize = 128;
const DIR_OFFSET: u64 = 256;
/// Most rings one segment may hold (peers on one host).
pub(crate) const MAX_RINGS: u32 = 1 << 16;
/// Smallest ring capacity accepted.
pub(crate) const MIN_RING: u64 = 64;
/// Largest ring capacity accepted (1 TiB).
pub(crate) const MAX_RING: u64 = 1 << 40;

/// The segment header, at offset 0. Every field is an atomic because a peer process maps the
/// same bytes; the owner writes all fields and stores `magic` last (Release).
#[repr(C, align(128))]
pub(crate) struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    owner_pid: AtomicU32,
    owner_rank: AtomicU32,
    nrings: AtomicU32,
    ring_capacity: AtomicU64,
    total_bytes: AtomicU64,
    tag: AtomicU64,
    /// Most bytes the segment may allocate (`OXCCL_SHM_BUDGET_BYTES`; 0: no limit).
    budget: AtomicU64,
    /// Pages allocated (low 32 bits: the header and control pages by the owner, and the ring
    /// data its producers allocated, [`Segment::grow_ring`]) and rings with no data yet (high
    /// 32 bits), in one word so that producers in several processes growing rings at once
    /// update both by one compare-and-swap.
    state: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Header>() == DOORBELL_OFFSET);
const _: () = assert!(std::mem::size_of::<Doorbell>() <= 128);
const _: () = assert!(std::mem::size_of::<RingCtrl>() as u64 <= PAGE);
/// Where in a ring's control page, after the [`RingCtrl`], the owner's lending verdict about
/// the ring's producer lies (one byte: 1 when the owner could read the producer's memory,
/// `lend::Probe::check`): the producer reads it there instead of getting every rank's
/// verdicts through the bootstrap (docs/scale.md, "Start-up").
const VERDICT_OFFSET: usize = 2048;
const _: () = assert!(std::mem::size_of::<RingCtrl>() <= VERDICT_OFFSET);

/// Offsets and sizes of a segment with `nrings` rings of `cap` bytes each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SegLayout {
    /// Number of rings.
    pub nrings: u32,
    /// Capacity of each ring (a power of two).
    pub cap: u64,
    rings_offset: u64,
    stride: u64,
    /// Total size of the segment.
    pub total: u64,
}

fn align_up(x: u64, a: u64) -> Option<u64> {
    Some(x.checked_add(a - 1)? & !(a - 1))
}

impl SegLayout {
    /// The layout, or `None` if the numbers are out of range.
    pub(crate) fn new(nrings: u32, cap: u64) -> Option<SegLayout> {
        if nrings == 0
            || nrings > MAX_RINGS
            || !cap.is_power_of_two()
            || !(MIN_RING..=MAX_RING).contains(&cap)
        {
            return None;
        }
        let rings_offset = align_up(DIR_OFFSET + 4 * nrings as u64, PAGE)?;
        let stride = PAGE.checked_add(align_up(cap, PAGE)?)?;
        let total = rings_offset.checked_add(stride.checked_mul(nrings as u64)?)?;
        usize::try_from(total).ok()?;
        Some(SegLayout {
            nrings,
            cap,
            rings_offset,
            stride,
            total,
        })
    }

    /// Bytes the owner allocates when it makes the segment: the header and directory pages,
    /// and each ring's control page.
    pub(crate) fn meta_bytes(&self) -> u64 {
        self.rings_offset + PAGE * self.nrings as u64
    }

    /// Offset of ring `i`'s control block (its data follows one page later).
    fn ring_offset(&self, i: u32) -> u64 {
        self.rings_offset + self.stride * i as u64
    }
}

/// The header's allocation word: `pages` allocated (low 32 bits), `empty` rings (high 32).
fn pack(pages: u64, empty: u64) -> u64 {
    (empty << 32) | (pages & 0xffff_ffff)
}

/// `(pages, empty)` of [`pack`].
fn unpack(s: u64) -> (u64, u64) {
    (s & 0xffff_ffff, s >> 32)
}

/// Ring capacity for a requested size: the next power of two, at least [`MIN_RING`].
pub(crate) fn ring_capacity(requested: usize) -> Option<u64> {
    let c = (requested as u64)
        .max(MIN_RING)
        .checked_next_power_of_two()?;
    (c <= MAX_RING).then_some(c)
}

/// Smallest ring a producer makes when the segment's budget is short ([`Segment::grow_ring`]
/// fails below it): 16 KiB of data and its 4 KiB control page per peer, so that a call talking
/// to every peer fits the default 12 MiB budget up to about 600 local ranks.
pub(crate) const RING_MIN: u64 = 16 << 10;

#[cfg(test)]
thread_local! {
    /// Tests: this thread's ring allocations fail as with `/dev/shm` full.
    pub(crate) static FULL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Why [`Segment::grow_ring`] did not grow a ring.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum GrowError {
    /// The segment's budget would be exceeded: it has `allocated` of `budget` bytes and the
    /// growth needs `needed` more.
    Budget {
        /// Bytes the segment has allocated.
        allocated: u64,
        /// Its budget (`OXCCL_SHM_BUDGET_BYTES`).
        budget: u64,
        /// Bytes the growth would add.
        needed: u64,
    },
    /// The memory could not be had (`/dev/shm` full, the memory limit): the message.
    Memory(String),
}

/// Smallest capacity the per-rank budget shrinks a ring to (64 KiB). With more peers than
/// `budget / BUDGET_FLOOR` their rings could outgrow the budget if all were filled; the
/// allocation count ([`Segment::grow_ring`]) keeps them from it: rings stop growing (down to
/// [`RING_MIN`]) once the budget is spent.
pub(crate) const BUDGET_FLOOR: u64 = 64 << 10;

/// Capacity of each of a segment's `nrings` rings: `requested` rounded up to a power of two
/// ([`ring_capacity`]), halved while the rings' data (`nrings` × capacity) would exceed
/// `budget` bytes (`OXCCL_SHM_BUDGET_BYTES`; 0: no budget), but never below [`BUDGET_FLOOR`]
/// (nor above the requested capacity). This is the most a ring may grow to; what the rings
/// of a segment allocate together, with their control pages, is held within the budget by
/// [`Segment::grow_ring`]. Under the defaults (12 MiB, 4 MiB rings) 2 to 4 ranks keep 4 MiB
/// rings.
pub(crate) fn budgeted_capacity(nrings: u32, requested: usize, budget: u64) -> Option<u64> {
    let mut cap = ring_capacity(requested)?;
    if budget == 0 {
        return Some(cap);
    }
    while cap > BUDGET_FLOOR && cap.saturating_mul(nrings as u64) > budget {
        cap /= 2;
    }
    Some(cap)
}

/// The error message when `/dev/shm` lacks room: what is needed, what is free, what to do.
pub(crate) fn space_message(
    dir: &str,
    needed: u64,
    free: u64,
    ring_bytes: u64,
    nrings: u32,
) -> String {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    format!(
        "{dir} has {free} bytes ({:.1} MiB) free, but this rank needs {needed} bytes ({:.1} MiB) for \
         {nrings} ring(s) of {ring_bytes} bytes; enlarge {dir} (e.g. `docker run --shm-size=1g`, \
         or `mount -o remount,size=1G {dir}`), lower OXCCL_SHM_RING_BYTES or OXCCL_SHM_BUDGET_BYTES, or set \
         OXCCL_TRANSPORT=tcp",
        mib(free),
        mib(needed)
    )
}

/// `Err(message)` when `free` bytes cannot hold `needed`.
pub(crate) fn check_space(
    dir: &str,
    needed: u64,
    free: u64,
    ring_bytes: u64,
    nrings: u32,
) -> Result<(), String> {
    if free >= needed {
        Ok(())
    } else {
        Err(space_message(dir, needed, free, ring_bytes, nrings))
    }
}

/// Free bytes of the file system at `dir` available to an unprivileged process.
pub(crate) fn free_bytes(dir: &str) -> Result<u64, String> {
    let st = rustix::fs::statvfs(dir).map_err(|e| format!("statvfs({dir}): {e}"))?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// A mapped segment: ours (created, released once the peers have opened it) or a peer's.
pub(crate) struct Segment {
    base: NonNull<u8>,
    layout: SegLayout,
    /// Its file, or `memfd:NAME` for a memfd (for messages).
    path: PathBuf,
    owner_pid: u32,
    /// Set when this process created the file and has not unlinked it yet.
    to_unlink: AtomicBool,
    /// Ours, until released: the descriptor peers take a copy of ([`handoff`]).
    fd: std::sync::Mutex<Option<OwnedFd>>,
}

// SAFETY: the mapping is process-wide and lives until Drop; all shared bytes are accessed
// through atomics or under the ring protocol, never through `&mut`.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

pub(crate) fn io_msg(what: &str, path: &Path, e: rustix::io::Errno) -> String {
    let io = std::io::Error::from_raw_os_error(e.raw_os_error());
    format!(
        "{what} {}: {}",
        path.display(),
        crate::base::error::with_explanation(&io)
    )
}

/// Maps `len` bytes of `fd` shared, read-write, pre-faulted.
pub(crate) fn map(fd: impl AsFd, len: u64, path: &Path) -> Result<NonNull<u8>, String> {
    map_with(fd, len, path, MapFlags::POPULATE)
}

/// Maps `len` bytes of `fd` shared, read-write, with `flags` besides `MAP_SHARED`.
fn map_with(fd: impl AsFd, len: u64, path: &Path, flags: MapFlags) -> Result<NonNull<u8>, String> {
    // SAFETY: a fresh mapping at an address the kernel chooses does not alias anything; the
    // pointer is only used while the Segment that will own it lives (munmap in Drop).
    let p = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len as usize,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED | flags,
            fd,
            0,
        )
    }
    .map_err(|e| io_msg("mmap", path, e))?;
    NonNull::new(p.cast::<u8>()).ok_or_else(|| format!("mmap {}: null mapping", path.display()))
}

impl Segment {
    /// Creates, sizes and maps a new segment, with one ring per
    /// entry of `producers` (the producer's rank), and fills its header: a memfd named `name`
    /// ([`Sharing::Memfd`]) or a file [`handoff::named_path`]`(name)` in `/dev/shm`, locked by
    /// this process while it exists ([`handoff::create_locked`]). Rings hold `ring_bytes`,
    /// less where the segment would exceed `budget` bytes ([`budgeted_capacity`]). Only the
    /// header and the rings' control pages are allocated (`fallocate`); ring data is
    /// allocated by producers ([`populate_ring`](Self::populate_ring)).
    pub(crate) fn create(
        sharing: Sharing,
        name: &str,
        tag: u64,
        owner_rank: usize,
        producers: &[usize],
        ring_bytes: usize,
        budget: u64,
    ) -> Result<Segment, String> {
        let nrings = u32::try_from(producers.len()).unwrap_or(u32::MAX);
        let cap = budgeted_capacity(nrings, ring_bytes, budget).ok_or_else(|| {
            format!("ring size {ring_bytes} is out of range ({MIN_RING}..={MAX_RING} bytes)")
        })?;
        let layout = SegLayout::new(nrings, cap).ok_or_else(|| {
            format!(
                "{} rings of {cap} bytes do not fit in one segment",
                producers.len()
            )
        })?;
        let owner_rank_u32 =
            u32::try_from(owner_rank).map_err(|_| format!("rank {owner_rank} is too large"))?;
        let meta = layout.meta_bytes();
        if budget > 0 && meta > budget {
            return Err(format!(
                "{nrings} shared-memory peers need {meta} bytes of control pages (4 KiB each, \
                 and the header) before any ring data, more than OXCCL_SHM_BUDGET_BYTES={budget}; \
                 raise OXCCL_SHM_BUDGET_BYTES (at least {}, or 0 for no limit) or set \
                 OXCCL_TRANSPORT=tcp",
                meta + nrings as u64 * RING_MIN.min(cap)
            ));
        }
        let all_peers = meta.saturating_add((nrings as u64).saturating_mul(RING_MIN.min(cap)));
        if budget > 0 && all_peers > budget {
            tracing::warn!(
                rank = owner_rank,
                "{nrings} shared-memory peers: a call that talks to all of them at once \
                 (all_to_all) needs {all_peers} bytes of this rank's segment ({} KiB per ring at \
                 least), more than OXCCL_SHM_BUDGET_BYTES={budget}, and will fail; raise it for \
                 such calls",
                RING_MIN.min(cap) >> 10
            );
        }
        crate::base::mem::check_fits(
            layout.total,
            &format!(
                "the shared-memory segment ({nrings} ring(s) of {cap} bytes, OXCCL_SHM_RING_BYTES)"
            ),
        )?;
        let (path, fd, guard) = match sharing {
            Sharing::Memfd => {
                let fd = handoff::memfd(name)?;
                (PathBuf::from(format!("memfd:{name}")), fd, None)
            }
            Sharing::Named => {
                handoff::remove_stale(Path::new(SHM_DIR));
                let dir = SHM_DIR;
                check_space(dir, layout.total, free_bytes(dir)?, cap, nrings)?;
                // Created under a fresh random name and locked for its lifetime (handoff.rs).
                let (fd, path) = handoff::create_locked(name)?;
                // From here on the file exists: the Segment (or this guard) removes it on
                // failure.
                let guard = UnlinkGuard(path.clone());
                (path, fd, Some(guard))
            }
        };
        let path = path.as_path();
        let dir = SHM_DIR;
        let pid = std::process::id();
        let no_space =
            || space_message(dir, layout.total, free_bytes(dir).unwrap_or(0), cap, nrings);
        // Sized, but only the header, the directory and the rings' control pages are
        // allocated here: a ring's data is allocated by its producer as it first writes
        // there ([`Segment::populate_ring`]), so a new communicator costs a few pages per
        // peer, not a full ring per peer (docs/scale.md, "New groups").
        rustix::fs::ftruncate(&fd, layout.total).map_err(|e| io_msg("ftruncate", path, e))?;
        let mut meta_parts = vec![(0, layout.rings_offset)];
        meta_parts.extend((0..nrings).map(|i| (layout.ring_offset(i), PAGE)));
        for (at, len) in meta_parts {
            match rustix::fs::fallocate(&fd, FallocateFlags::empty(), at, len) {
                Ok(()) | Err(rustix::io::Errno::OPNOTSUPP) => {}
                Err(rustix::io::Errno::NOSPC) => return Err(no_space()),
                Err(e) => return Err(io_msg("fallocate", path, e)),
            }
        }
        let base = map_with(&fd, layout.total, path, MapFlags::empty())?;
        // SAFETY: the header page lies inside the fresh mapping of `layout.total` bytes;
        // populating changes no byte.
        let probe = unsafe {
            rustix::mm::madvise(
                base.as_ptr().cast(),
                PAGE as usize,
                rustix::mm::Advice::LinuxPopulateWrite,
            )
        };
        let mut budget = budget;
        if probe.is_err() {
            // Everything is allocated below: nothing is left to charge (`grow_ring`).
            budget = 0;
            // A kernel without MADV_POPULATE_WRITE (before 5.14): producers could not
            // allocate ring memory with an error instead of SIGBUS, so allocate it all now.
            tracing::debug!(
                rank = owner_rank,
                "MADV_POPULATE_WRITE: {probe:?}; rings allocated up front"
            );
            match rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, layout.total) {
                Ok(()) | Err(rustix::io::Errno::OPNOTSUPP) => {}
                Err(rustix::io::Errno::NOSPC) => {
                    // SAFETY: `base` was mapped above with `layout.total` bytes, unused since.
                    let _ =
                        unsafe { rustix::mm::munmap(base.as_ptr().cast(), layout.total as usize) };
                    return Err(no_space());
                }
                Err(e) => {
                    // SAFETY: as above.
                    let _ =
                        unsafe { rustix::mm::munmap(base.as_ptr().cast(), layout.total as usize) };
                    return Err(io_msg("fallocate", path, e));
                }
            }
        }
        let named = guard.is_some();
        std::mem::forget(guard);
        let seg = Segment {
            base,
            layout,
            path: path.to_path_buf(),
            owner_pid: pid,
            to_unlink: AtomicBool::new(named),
            fd: std::sync::Mutex::new(Some(fd)),
        };
        let h = seg.header();
        h.version.store(VERSION, Ordering::Relaxed);
        h.owner_pid.store(pid, Ordering::Relaxed);
        h.owner_rank.store(owner_rank_u32, Ordering::Relaxed);
        h.nrings.store(nrings, Ordering::Relaxed);
        h.ring_capacity.store(cap, Ordering::Relaxed);
        h.total_bytes.store(layout.total, Ordering::Relaxed);
        h.tag.store(tag, Ordering::Relaxed);
        h.budget.store(budget, Ordering::Relaxed);
        h.state
            .store(pack(meta / PAGE, nrings as u64), Ordering::Relaxed);
        for (i, &p) in producers.iter().enumerate() {
            let p = u32::try_from(p).map_err(|_| format!("rank {p} is too large"))?;
            seg.directory(i as u32).store(p, Ordering::Relaxed);
        }
        h.magic.store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Opens and maps the segment at `path` that `expect_rank` created for communicator
    /// `tag`, checking everything in its header before trusting any of it.
    pub(crate) fn open(path: &Path, tag: u64, expect_rank: usize) -> Result<Segment, String> {
        let fd: OwnedFd = rustix::fs::open(path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| io_msg("cannot open", path, e))?;
        Self::open_fd(fd, path, tag, expect_rank)
    }

    /// As [`open`](Self::open), for a descriptor already open (`path` names it in messages).
    pub(crate) fn open_fd(
        fd: OwnedFd,
        path: &Path,
        tag: u64,
        expect_rank: usize,
    ) -> Result<Segment, String> {
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| io_msg("fstat", path, e))?
            .st_size;
        let size = u64::try_from(size).unwrap_or(0);
        let bad = |what: String| format!("{}: bad segment header: {what}", path.display());
        if size < PAGE {
            return Err(bad(format!(
                "file is {size} bytes, smaller than a header page"
            )));
        }
        // Map the header page first, validate, then map the whole.
        let head = Segment {
            base: map(&fd, PAGE, path)?,
            // A one-page pseudo-layout: Drop unmaps exactly `total` bytes.
            layout: SegLayout {
                nrings: 0,
                cap: 0,
                rings_offset: PAGE,
                stride: 0,
                total: PAGE,
            },
            path: path.to_path_buf(),
            owner_pid: 0,
            to_unlink: AtomicBool::new(false),
            fd: std::sync::Mutex::new(None),
        };
        let h = head.header();
        let magic = h.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(bad(format!("magic {magic:#018x}, expected {MAGIC:#018x}")));
        }
        let version = h.version.load(Ordering::Relaxed);
        if version != VERSION {
            return Err(bad(format!(
                "layout version {version}, this build speaks {VERSION} (mixed oxccl versions?)"
            )));
        }
        let got_tag = h.tag.load(Ordering::Relaxed);
        if got_tag != tag {
            return Err(bad(format!(
                "communicator tag {got_tag:#x}, expected {tag:#x}"
            )));
        }
        let owner = h.owner_rank.load(Ordering::Relaxed);
        if owner as usize != expect_rank {
            return Err(bad(format!("owner rank {owner}, expected {expect_rank}")));
        }
        let nrings = h.nrings.load(Ordering::Relaxed);
        let cap = h.ring_capacity.load(Ordering::Relaxed);
        let total = h.total_bytes.load(Ordering::Relaxed);
        let owner_pid = h.owner_pid.load(Ordering::Relaxed);
        let layout = SegLayout::new(nrings, cap).ok_or_else(|| {
            bad(format!(
                "{nrings} rings of {cap} bytes is not a valid layout"
            ))
        })?;
        if layout.total != total {
            return Err(bad(format!(
                "total size {total}, the layout needs {}",
                layout.total
            )));
        }
        if size < total {
            return Err(bad(format!(
                "file is {size} bytes, the header says {total}"
            )));
        }
        drop(head);
        // Not pre-faulted: a rank writes into one ring of a peer's segment (and rings its
        // doorbell), which `prefault_ring` maps in; pre-faulting whole peer segments would
        // cost every rank page tables for every peer's segment (O(n^2) per host).
        Ok(Segment {
            base: map_with(&fd, total, path, MapFlags::empty())?,
            layout,
            path: path.to_path_buf(),
            owner_pid,
            to_unlink: AtomicBool::new(false),
            fd: std::sync::Mutex::new(None),
        })
    }

    fn header(&self) -> &Header {
        // SAFETY: every mapping is at least one page (validated or created so), page aligned
        // (so aligned for Header), and lives as long as `self`; Header is all atomics.
        unsafe { self.base.cast::<Header>().as_ref() }
    }

    fn directory(&self, i: u32) -> &AtomicU32 {
        assert!(i < self.layout.nrings);
        // SAFETY: `i < nrings`, and the directory (4 bytes per ring from offset 256) ends
        // before `rings_offset` by construction of the validated layout; 4-byte aligned.
        unsafe {
            &*self
                .base
                .as_ptr()
                .add(DIR_OFFSET as usize + 4 * i as usize)
                .cast::<AtomicU32>()
        }
    }

    /// The owner's doorbell.
    pub(crate) fn doorbell(&self) -> &Doorbell {
        // SAFETY: offset 128 is inside the first page of a live mapping, aligned for
        // Doorbell (two AtomicU32); Doorbell is only accessed through atomics.
        unsafe { &*self.base.as_ptr().add(DOORBELL_OFFSET).cast::<Doorbell>() }
    }

    /// The ring whose producer is `producer_rank`, as an index, if there is one.
    pub(crate) fn find_ring(&self, producer_rank: usize) -> Option<u32> {
        (0..self.layout.nrings)
            .find(|&i| self.directory(i).load(Ordering::Relaxed) as usize == producer_rank)
    }

    /// Pointers to ring `i`'s control block and data (`cap` bytes), and `cap`.
    pub(crate) fn ring(&self, i: u32) -> (NonNull<RingCtrl>, NonNull<u8>, u64) {
        assert!(i < self.layout.nrings);
        let off = self.layout.ring_offset(i) as usize;
        // SAFETY: ring `i < nrings` occupies `[off, off + PAGE + cap)`, inside the mapping of
        // `layout.total` bytes (validated layout); `off` is page aligned, so aligned for
        // RingCtrl.
        unsafe {
            let ctrl = NonNull::new_unchecked(self.base.as_ptr().add(off)).cast::<RingCtrl>();
            let data = NonNull::new_unchecked(self.base.as_ptr().add(off + PAGE as usize));
            (ctrl, data, self.layout.cap)
        }
    }

    fn verdict_cell(&self, i: u32) -> &AtomicU8 {
        assert!(i < self.layout.nrings);
        let off = self.layout.ring_offset(i) as usize + VERDICT_OFFSET;
        // SAFETY: ring `i < nrings` has its 4 KiB control page at `ring_offset(i)` (validated
        // layout, allocated at creation); `VERDICT_OFFSET` lies inside it, after the
        // RingCtrl; the byte is only accessed through atomics.
        unsafe { &*self.base.as_ptr().add(off).cast::<AtomicU8>() }
    }

    /// The owner's side: records in ring `i`'s control page whether the owner could read its
    /// producer's memory (`lend::Probe::check`). Stored before the exchange that follows the
    /// probe, read by the producer ([`verdict`](Self::verdict)) after it.
    pub(crate) fn set_verdict(&self, i: u32, readable: bool) {
        self.verdict_cell(i)
            .store(u8::from(readable), Ordering::Release);
    }

    /// The producer's side: what the owner recorded with [`set_verdict`](Self::set_verdict)
    /// in ring `i` (false until it did).
    pub(crate) fn verdict(&self, i: u32) -> bool {
        self.verdict_cell(i).load(Ordering::Acquire) == 1
    }

    /// Allocates and maps in (`MADV_POPULATE_WRITE`) bytes `[from, to)` of ring `i`'s data,
    /// and with `from == 0` also the header page and the ring's control page: what a
    /// producer does before it first writes there. Memory that cannot be had is an error
    /// here (`/dev/shm` or the memory limit full), never a SIGBUS on a later write. `Ok` on
    /// a kernel without `MADV_POPULATE_WRITE`, where [`create`](Self::create) allocated
    /// every ring up front.
    pub(crate) fn populate_ring(&self, i: u32, from: u64, to: u64) -> Result<(), String> {
        assert!(i < self.layout.nrings && from <= to && to <= self.layout.cap);
        #[cfg(test)]
        if FULL.with(std::cell::Cell::get) {
            return Err(format!(
                "cannot allocate {} bytes of the ring in {}: /dev/shm full (test)",
                to - from,
                self.path.display()
            ));
        }
        let off = self.layout.ring_offset(i);
        let mut parts = vec![(off + PAGE + from, to - from)];
        if from == 0 {
            parts.extend([(0, PAGE), (off, PAGE)]);
        }
        for (at, n) in parts {
            if n == 0 {
                continue;
            }
            // SAFETY: `[at, at + n)` lies inside this live mapping (the header page, or ring
            // `i`'s control page or data, inside the validated layout); populating pages of a
            // shared file mapping changes no byte.
            let r = unsafe {
                rustix::mm::madvise(
                    self.base.as_ptr().add(at as usize).cast(),
                    n as usize,
                    rustix::mm::Advice::LinuxPopulateWrite,
                )
            };
            match r {
                Ok(()) => {}
                // Not supported: the owner found so too and allocated everything.
                Err(rustix::io::Errno::INVAL) => return Ok(()),
                Err(e) => {
                    return Err(format!(
                        "cannot allocate {} bytes of the ring in {} (MADV_POPULATE_WRITE: {e}): \
                         shared memory is exhausted (/dev/shm full or the memory limit reached); \
                         lower OXCCL_SHM_RING_BYTES or OXCCL_SHM_BUDGET_BYTES, free memory, or \
                         set OXCCL_TRANSPORT=tcp",
                        to - from,
                        self.path.display()
                    ))
                }
            }
        }
        Ok(())
    }

    /// Allocates bytes `[from, to)` of ring `i`'s data as [`populate_ring`](Self::populate_ring)
    /// does, after charging them (whole pages) to the segment's budget, which the producers of
    /// all its rings share: a compare-and-swap on the header's count, so that producers in
    /// several processes growing rings at once never take it past the budget together.
    ///
    /// Growth keeps room for the rings that have no data yet: it is refused where it would
    /// leave less than [`RING_MIN`] for each of them, so that the first rings written cannot
    /// take what the others need to work at all. A ring's first [`RING_MIN`] bytes (`from ==
    /// 0`) need only the budget itself.
    pub(crate) fn grow_ring(&self, i: u32, from: u64, to: u64) -> Result<(), GrowError> {
        let pages = |x: u64| align_up(x, PAGE).unwrap_or(u64::MAX) / PAGE;
        let needed = pages(to).saturating_sub(pages(from));
        let first = from == 0 && to > 0;
        self.charge(needed, first, pages(RING_MIN.min(self.layout.cap)))?;
        self.populate_ring(i, from, to).map_err(|m| {
            let _ = self
                .header()
                .state
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                    let (p, e) = unpack(s);
                    Some(pack(p.saturating_sub(needed), e + first as u64))
                });
            GrowError::Memory(m)
        })
    }

    /// Adds `n` pages to the header's count of pages allocated (and, for a ring's `first`
    /// data, takes it off the count of rings with none), unless that would exceed the budget
    /// or, beyond a first `min` pages, leave less than `min` pages for each ring with none.
    fn charge(&self, n: u64, first: bool, min: u64) -> Result<(), GrowError> {
        let h = self.header();
        let budget = h.budget.load(Ordering::Relaxed) / PAGE;
        let unlimited = h.budget.load(Ordering::Relaxed) == 0;
        h.state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                let (p, e) = unpack(s);
                let e = e.checked_sub(first as u64)?;
                let p = p.checked_add(n).filter(|&p| p < 1 << 32)?;
                let fair = p.saturating_add(e.saturating_mul(min)) <= budget;
                let minimum = first && n <= min && p <= budget;
                (unlimited || fair || minimum).then_some(pack(p, e))
            })
            .map(|_| ())
            .map_err(|s| GrowError::Budget {
                allocated: unpack(s).0 * PAGE,
                budget: h.budget.load(Ordering::Relaxed),
                needed: n * PAGE,
            })
    }

    /// The segment's ring count, and the bytes it allocates when every ring has
    /// [`RING_MIN`] bytes of data (what a call talking to all peers at once needs).
    pub(crate) fn all_rings_minimum(&self) -> (u32, u64) {
        let l = &self.layout;
        (
            l.nrings,
            l.meta_bytes() + l.nrings as u64 * align_up(RING_MIN.min(l.cap), PAGE).unwrap_or(0),
        )
    }

    /// Bytes the segment has allocated (header, control pages and ring data) and its budget
    /// (0: none).
    pub(crate) fn allocation(&self) -> (u64, u64) {
        let h = self.header();
        (
            unpack(h.state.load(Ordering::Acquire)).0 * PAGE,
            h.budget.load(Ordering::Relaxed),
        )
    }

    /// The pid its creator wrote into the header.
    pub(crate) fn owner_pid(&self) -> u32 {
        self.owner_pid
    }

    /// Its file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// What peers need to open it: the token of its memfd ([`handoff::token`]) or its path.
    pub(crate) fn token(&self) -> String {
        match &*self.fd.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(fd) if !self.to_unlink.load(Ordering::Acquire) => handoff::token(fd),
            _ => self.path.display().to_string(),
        }
    }

    /// Removes the named file of a peer's segment, once every rank has opened it (the
    /// mapping stays): one that is gone already (its creator or another peer removed it) is
    /// no error. Not for memfd segments, which have no file.
    pub(crate) fn remove_peers_file(&self) {
        if self.path.parent() == Some(Path::new(SHM_DIR)) {
            match rustix::fs::unlink(&self.path) {
                Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                Err(e) => {
                    tracing::debug!(path = %self.path.display(), "cannot remove a peer's segment file: {e}")
                }
            }
        }
    }

    /// Removes the file and closes the descriptor peers copied (the mapping stays). Only
    /// the creator does, once; a file already gone was removed by a peer
    /// ([`Segment::remove_peers_file`]).
    pub(crate) fn unlink(&self) -> Result<(), String> {
        self.fd.lock().unwrap_or_else(|e| e.into_inner()).take();
        if self.to_unlink.swap(false, Ordering::AcqRel) {
            match rustix::fs::unlink(&self.path) {
                Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                Err(e) => return Err(io_msg("unlink", &self.path, e)),
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("path", &self.path)
            .field("layout", &self.layout)
            .finish()
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        let _ = self.unlink();
        // SAFETY: `base` came from mmap of exactly `layout.total` bytes; no reference into
        // the mapping outlives the Segment (links hold an Arc to it).
        let _ =
            unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.layout.total as usize) };
    }
}

/// Removes its path when dropped unless forgotten: cleans up a half-created segment.
struct UnlinkGuard(PathBuf);
impl Drop for UnlinkGuard {
    fn drop(&mut self) {
        let _ = rustix::fs::unlink(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp_path(name: &str) -> PathBuf {
        let nonce = u64::from_le_bytes(rand8());
        PathBuf::from(format!(
            "{SHM_DIR}/{PREFIX}unittest-{name}-{}-{nonce:x}",
            std::process::id()
        ))
    }

    fn tmp_name(name: &str) -> String {
        format!("unittest-{name}-{:x}", u64::from_le_bytes(rand8()))
    }

    fn rand8() -> [u8; 8] {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).unwrap();
        b
    }

    #[test]
    fn layout_numbers() {
        let l = SegLayout::new(3, 4096).unwrap();
        assert_eq!(l.ring_offset(0) % PAGE, 0);
        assert_eq!(l.total, PAGE + 3 * (PAGE + 4096));
        assert!(SegLayout::new(0, 4096).is_none());
        assert!(SegLayout::new(1, 4095).is_none());
        assert!(SegLayout::new(1, 1 << 41).is_none());
        assert_eq!(ring_capacity(5000), Some(8192));
        assert_eq!(ring_capacity(1), Some(MIN_RING));
        assert_eq!(ring_capacity(usize::MAX), None);
    }

    #[test]
    fn the_budget_shrinks_rings_to_keep_a_segment_in_it() {
        let (m, k) = (1u64 << 20, 1u64 << 10);
        let budget = 12 * m;
        // 2 to 4 ranks keep 4 MiB rings; then the ring halves as the peers double.
        for (peers, cap) in [
            (1, 4 * m),
            (3, 4 * m),
            (4, 2 * m),
            (7, m),
            (15, 512 * k),
            (31, 256 * k),
            (63, 128 * k),
            (127, 64 * k),
            (192, 64 * k),
        ] {
            assert_eq!(
                budgeted_capacity(peers, 4 << 20, budget),
                Some(cap),
                "{peers}"
            );
            assert!(peers as u64 * cap <= budget, "{peers} peers");
        }
        // Past the floor the rings outgrow the budget, at the floor's size per peer.
        assert_eq!(budgeted_capacity(1000, 4 << 20, budget), Some(BUDGET_FLOOR));
        // Smaller requests are kept; no budget keeps the request.
        assert_eq!(budgeted_capacity(127, 4096, budget), Some(4096));
        assert_eq!(budgeted_capacity(127, 4 << 20, 0), Some(4 * m));
        assert_eq!(budgeted_capacity(3, 1 << 40, budget), Some(4 * m));
        assert_eq!(budgeted_capacity(3, usize::MAX, budget), None);
    }

    #[test]
    fn space_check_message() {
        assert!(check_space("/dev/shm", 100, 100, 64, 1).is_ok());
        let msg = check_space("/dev/shm", 64 << 20, 1 << 20, 4 << 20, 15).unwrap_err();
        for want in [
            "/dev/shm has 1048576 bytes (1.0 MiB) free",
            "needs 67108864 bytes (64.0 MiB)",
            "--shm-size",
            "OXCCL_SHM_RING_BYTES",
            "OXCCL_TRANSPORT=tcp",
        ] {
            assert!(msg.contains(want), "{want:?} missing from: {msg}");
        }
    }

    #[test]
    fn create_open_roundtrip_and_unlink() {
        let name = tmp_name("rt");
        let own = Segment::create(Sharing::Named, &name, 0xabc, 2, &[0, 5], 4096, 0).unwrap();
        let path = own.path().to_path_buf();
        assert!(path.starts_with(SHM_DIR) && path.exists(), "{path:?}");
        let peer = Segment::open(&path, 0xabc, 2).unwrap();
        assert_eq!(peer.owner_pid(), std::process::id());
        assert_eq!(peer.find_ring(5), Some(1));
        assert_eq!(peer.find_ring(0), Some(0));
        assert_eq!(peer.find_ring(2), None);
        assert_eq!(peer.ring(1).2, 4096);
        // The two mappings see the same bytes.
        own.doorbell().ring();
        let tok = peer.doorbell().prepare();
        own.doorbell().cancel(tok);
        assert!(Segment::open(&path, 0xabd, 2).unwrap_err().contains("tag"));
        assert!(Segment::open(&path, 0xabc, 3)
            .unwrap_err()
            .contains("owner rank"));
        // A second create for the same name gets a file of its own.
        let other = Segment::create(Sharing::Named, &name, 0xabc, 2, &[0], 4096, 0).unwrap();
        assert_ne!(other.path(), own.path());
        drop(other);
        own.unlink().unwrap();
        assert!(!path.exists());
        drop(own);
        drop(peer);
    }

    #[test]
    fn drop_removes_file() {
        let own = Segment::create(Sharing::Named, &tmp_name("drop"), 1, 0, &[1], 64, 0).unwrap();
        let path = own.path().to_path_buf();
        assert!(path.exists());
        drop(own);
        assert!(!path.exists());
    }

    #[test]
    fn a_memfd_segment_has_no_file_and_opens_by_token() {
        let before = std::fs::read_dir(SHM_DIR).unwrap().count();
        let own = Segment::create(Sharing::Memfd, &tmp_name("memfd"), 9, 1, &[0], 4096, 0).unwrap();
        assert!(own.path().to_string_lossy().starts_with("memfd:"));
        let tok = own.token();
        assert!(tok.starts_with("fd:"), "{tok}");
        let fd = handoff::open_token(&tok, std::process::id()).unwrap();
        let peer = Segment::open_fd(fd, Path::new(&tok), 9, 1).unwrap();
        assert_eq!(peer.find_ring(0), Some(0));
        own.doorbell().ring();
        let t = peer.doorbell().prepare();
        own.doorbell().cancel(t);
        // Released: the descriptor is closed, no token any more.
        own.unlink().unwrap();
        assert!(!own.token().starts_with("fd:"));
        assert!(std::fs::read_dir(SHM_DIR).unwrap().count() <= before);
    }

    /// A new segment allocates its header and control pages only; a producer's
    /// `populate_ring` allocates ring data, in the owner's file, as far as it asks.
    #[test]
    fn ring_data_is_allocated_by_its_producer_as_far_as_it_asks() {
        let cap: u64 = 1 << 20;
        let own = Segment::create(
            Sharing::Memfd,
            &tmp_name("lazy"),
            7,
            0,
            &[1, 2],
            cap as usize,
            0,
        )
        .unwrap();
        let allocated = |s: &Segment| {
            let g = s.fd.lock().unwrap();
            rustix::fs::fstat(g.as_ref().unwrap()).unwrap().st_blocks as u64 * 512
        };
        let meta = 3 * PAGE;
        // Whether this kernel has MADV_POPULATE_WRITE, asked of a page of anonymous memory.
        let f = rustix::fs::memfd_create("probe", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&f, PAGE).unwrap();
        let m = map_with(&f, PAGE, Path::new("probe"), MapFlags::empty()).unwrap();
        // SAFETY: `m` is a fresh mapping of one page, unmapped right after.
        let lazy = unsafe {
            let r = rustix::mm::madvise(
                m.as_ptr().cast(),
                PAGE as usize,
                rustix::mm::Advice::LinuxPopulateWrite,
            );
            let _ = rustix::mm::munmap(m.as_ptr().cast(), PAGE as usize);
            r.is_ok()
        };
        if !lazy {
            // A kernel without it: everything was allocated up front.
            assert!(allocated(&own) >= 2 * cap);
            return;
        }
        assert_eq!(allocated(&own), meta);
        let fd = handoff::open_token(&own.token(), std::process::id()).unwrap();
        let peer = Segment::open_fd(fd, Path::new("peer"), 7, 0).unwrap();
        let ring = peer.find_ring(2).unwrap();
        peer.populate_ring(ring, 0, 64 << 10).unwrap();
        assert_eq!(allocated(&own), meta + (64 << 10));
        peer.populate_ring(ring, 64 << 10, cap).unwrap();
        assert_eq!(allocated(&own), meta + cap);
    }

    /// Eight producers (threads, each with its own mapping of the segment, as peers in other
    /// processes have) make their rings and then grow them a page at a time until the budget
    /// refuses: together they allocate exactly the budget, never more, and the header's count
    /// matches the memory the segment really holds.
    #[test]
    fn producers_growing_rings_at_once_never_take_the_segment_past_its_budget() {
        let cap: u64 = 1 << 20;
        let producers: Vec<usize> = (1..=8).collect();
        let meta = SegLayout::new(8, cap).unwrap().meta_bytes();
        assert_eq!(meta, PAGE + 8 * PAGE);
        // Room for 37 pages of ring data, shared by 8 rings of 256 pages each.
        let budget = meta + 37 * PAGE;
        let own = Segment::create(
            Sharing::Memfd,
            &tmp_name("budget"),
            9,
            0,
            &producers,
            cap as usize,
            budget,
        )
        .unwrap();
        if own.allocation().1 == 0 {
            return; // no MADV_POPULATE_WRITE: everything was allocated up front
        }
        assert_eq!(own.allocation(), (meta, budget));
        let token = own.token();
        let started = std::sync::Barrier::new(producers.len());
        let grown: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = producers
                .iter()
                .map(|&p| {
                    let (token, started) = (&token, &started);
                    s.spawn(move || {
                        let fd = handoff::open_token(token, std::process::id()).unwrap();
                        let seg = Segment::open_fd(fd, Path::new("peer"), 9, 0).unwrap();
                        let ring = seg.find_ring(p).unwrap();
                        // Every ring first gets a page: then none is kept room for.
                        seg.grow_ring(ring, 0, PAGE).unwrap();
                        started.wait();
                        let mut ready = PAGE;
                        // The budget shrank the rings to 64 KiB (16 pages) each.
                        assert_eq!(seg.layout.cap, BUDGET_FLOOR);
                        while ready < seg.layout.cap {
                            match seg.grow_ring(ring, ready, ready + PAGE) {
                                Ok(()) => ready += PAGE,
                                Err(GrowError::Budget {
                                    allocated,
                                    budget: b,
                                    needed,
                                }) => {
                                    assert_eq!((b, needed), (budget, PAGE));
                                    assert!(allocated + needed > budget);
                                    return ready;
                                }
                                Err(e) => panic!("{e:?}"),
                            }
                        }
                        ready
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(grown.iter().sum::<u64>(), 37 * PAGE, "{grown:?}");
        assert_eq!(own.allocation(), (budget, budget));
        let g = own.fd.lock().unwrap();
        let held = rustix::fs::fstat(g.as_ref().unwrap()).unwrap().st_blocks as u64 * 512;
        assert_eq!(held, budget, "memory the segment holds");
    }

    /// Growth keeps 16 KiB for each ring that has nothing yet; a ring's first 16 KiB need only
    /// the budget.
    #[test]
    fn growth_leaves_room_for_the_rings_not_written_yet() {
        let k = 1u64 << 10;
        let meta = SegLayout::new(3, 1 << 20).unwrap().meta_bytes();
        let budget = meta + 96 * k;
        let own = Segment::create(
            Sharing::Memfd,
            &tmp_name("fair"),
            3,
            0,
            &[1, 2, 3],
            1 << 20,
            budget,
        )
        .unwrap();
        if own.allocation().1 == 0 {
            return;
        }
        // Ring 0 may take 64 KiB (32 left for rings 1 and 2), not 128 nor 80.
        assert!(matches!(
            own.grow_ring(0, 0, 128 * k),
            Err(GrowError::Budget { .. })
        ));
        assert!(matches!(
            own.grow_ring(0, 0, 80 * k),
            Err(GrowError::Budget { .. })
        ));
        own.grow_ring(0, 0, 64 * k).unwrap();
        assert!(matches!(
            own.grow_ring(0, 64 * k, 68 * k),
            Err(GrowError::Budget { .. })
        ));
        // Ring 1 gets its 16 KiB, but not 20: ring 2's 16 are kept.
        assert!(matches!(
            own.grow_ring(1, 0, 20 * k),
            Err(GrowError::Budget { .. })
        ));
        own.grow_ring(1, 0, 16 * k).unwrap();
        own.grow_ring(2, 0, 16 * k).unwrap();
        assert_eq!(own.allocation(), (budget, budget));
        assert_eq!(
            own.grow_ring(2, 16 * k, 20 * k),
            Err(GrowError::Budget {
                allocated: budget,
                budget,
                needed: 4 * k
            })
        );
    }

    #[test]
    fn a_budget_below_the_control_pages_is_an_error_naming_it() {
        let e = Segment::create(
            Sharing::Memfd,
            &tmp_name("tiny"),
            1,
            0,
            &[1, 2, 3],
            1 << 20,
            3 * PAGE,
        )
        .unwrap_err();
        for want in [
            "3 shared-memory peers need 16384 bytes of control pages",
            "OXCCL_SHM_BUDGET_BYTES=12288",
            "at least 65536",
        ] {
            assert!(e.contains(want), "{want:?} missing from: {e}");
        }
        // Exactly the control pages: made, with nothing left for ring data.
        let s = Segment::create(
            Sharing::Memfd,
            &tmp_name("tiny"),
            1,
            0,
            &[1, 2, 3],
            1 << 20,
            4 * PAGE,
        )
        .unwrap();
        if s.allocation().1 > 0 {
            let r = s.find_ring(2).unwrap();
            assert_eq!(
                s.grow_ring(r, 0, PAGE),
                Err(GrowError::Budget {
                    allocated: 4 * PAGE,
                    budget: 4 * PAGE,
                    needed: PAGE
                })
            );
        }
    }

    #[test]
    fn an_absurd_ring_is_an_error_before_anything_is_allocated() {
        let e = Segment::create(
            Sharing::Memfd,
            &tmp_name("huge"),
            1,
            0,
            &[1, 2, 3],
            1 << 40,
            0,
        )
        .unwrap_err();
        assert!(
            e.contains("OXCCL_SHM_RING_BYTES") && e.contains("requested"),
            "{e}"
        );
    }

    /// Writes `bytes` (then zero padding to `len`) to a fresh file and tries to open it.
    fn open_forged(name: &str, bytes: &[u8], len: usize) -> String {
        let path = tmp_path(name);
        let mut v = bytes.to_vec();
        v.resize(len, 0);
        std::fs::write(&path, &v).unwrap();
        let r = Segment::open(&path, 7, 1);
        std::fs::remove_file(&path).unwrap();
        match r {
            Ok(_) => panic!("forged header {name} accepted"),
            Err(e) => e,
        }
    }

    fn header_bytes(version: u32, nrings: u32, cap: u64, total: u64) -> Vec<u8> {
        let mut h = Vec::new();
        h.extend_from_slice(&MAGIC.to_le_bytes());
        h.extend_from_slice(&version.to_le_bytes());
        h.extend_from_slice(&123u32.to_le_bytes()); // pid
        h.extend_from_slice(&1u32.to_le_bytes()); // rank
        h.extend_from_slice(&nrings.to_le_bytes());
        h.extend_from_slice(&cap.to_le_bytes());
        h.extend_from_slice(&total.to_le_bytes());
        h.extend_from_slice(&7u64.to_le_bytes()); // tag
        h
    }

    #[test]
    fn bad_headers_rejected() {
        let good = SegLayout::new(1, 4096).unwrap().total;
        assert!(open_forged("short", b"xx", 10).contains("smaller than a header"));
        assert!(open_forged("magic", b"NOTOXCCL", 4096).contains("magic"));
        assert!(
            open_forged("version", &header_bytes(99, 1, 4096, good), good as usize)
                .contains("version")
        );
        assert!(
            open_forged("cap", &header_bytes(VERSION, 1, 5000, good), good as usize)
                .contains("valid layout")
        );
        assert!(open_forged(
            "rings",
            &header_bytes(VERSION, 0, 4096, good),
            good as usize
        )
        .contains("valid layout"));
        assert!(open_forged(
            "total",
            &header_bytes(VERSION, 1, 4096, good + 1),
            good as usize
        )
        .contains("total size"));
        // The header claims more than the file holds: mapping it would SIGBUS on access.
        assert!(
            open_forged("trunc", &header_bytes(VERSION, 1, 4096, good), 4096)
                .contains("file is 4096 bytes")
        );
        // The forged-but-valid header opens.
        let path = tmp_path("valid");
        let mut v = header_bytes(VERSION, 1, 4096, good);
        v.resize(good as usize, 0);
        std::fs::write(&path, &v).unwrap();
        let s = Segment::open(&path, 7, 1).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(s.owner_pid(), 123);
    }
}
