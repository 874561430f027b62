//! [`Direct`] over shared memory: each rank of a host owns a small segment (a memfd, handed
//! to peers by [`handoff`]) with two event records and two data slots, mapped by
//! every other rank of the host; peers' buffers are read and written with `process_vm_readv` /
//! `process_vm_writev` (single copy, as Open MPI's CMA path) where the kernel allows it, and
//! peers' shared buffers ([`crate::direct::shared_buffer`]) are mapped here once (`pidfd_getfd` of
//! their memfd, at most [`PEER_MAPPINGS`] and [`PEER_MAPPED_BYTES`] per peer) and reached with
//! loads and stores.
//!
//! Layout: header (magic `"OXCCLDIR"`, version, owner pid and rank, slot size) at 0, the
//! owner's [`Doorbell`] at 128, the CPU the owner last published from at 256 (a hint for
//! waiters, [`Direct::peer_shares_cpu`]), the closed flag at 320, the event records of the two
//! parities at 384 and 640, the two slots from 4096 on.
//!
//! An event record holds everything a peer needs to see of an event besides bulk data, laid
//! out so that the line a peer polls carries the most: data of up to 160 bytes ends right
//! before the data's length, the two words of the call's header and, last, the event number,
//! in the record's third cache line; the four algorithm words follow in the fourth. An
//! 8-byte or 32-byte all_reduce thus crosses between cores as one cache line, data and flag
//! together as in NCCL's LL protocol, instead of one line for a counter, one for the words and
//! one for the data. Larger data goes to the slot.

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use rustix::fs::FallocateFlags;

use crate::base::cross_memory::{read_remote, write_remote};
use crate::base::wait::{Cadence, Doorbell};
use crate::direct::link::{Direct, EventRecord};
use crate::direct::shared_buffer::{PeerMapping, Region, PEER_MAPPED_BYTES, PEER_MAPPINGS};
use crate::fault::fingerprint::HEADER_BYTES;
use crate::transport::shm::handoff;
use crate::transport::shm::segment::{io_msg, map};
use crate::transport::LinkError;

const MAGIC: u64 = u64::from_le_bytes(*b"OXCCLDIR");
const VERSION: u32 = 2;
/// Bytes of one data slot.
pub(crate) const SLOT_BYTES: usize = 64 << 10;
// A tune file's one-shot threshold is bounded by a slot.
const _: () = assert!(SLOT_BYTES == crate::plan::tuning::Tuning::ONESHOT_MAX_LIMIT);
const BELL_OFF: usize = 128;
/// The owner's CPU at its last publish, plus one (0: unknown), in a line of its own: written
/// only when it changes, read only by a peer about to spin.
const CPU_OFF: usize = 256;
const CLOSED_OFF: usize = 320;
/// The owner's fork gate for its peers' writes (see [`close_peer_gates`]): closed (u32), then
/// the peers' writes in progress (u32, 8 bytes on).
const GATE_OFF: usize = 336;
const RECORDS_OFF: usize = 384;
/// Bytes of one event record (four cache lines).
const RECORD: usize = 256;
/// Data bytes an event record carries itself.
const INLINE: usize = 160;
/// Offsets inside an event record: the inline data ends at INLINE (right-aligned, so that a
/// small message shares the last line with the event number), then the data's length, the
/// words that carry the call's header, the event number; the other words in the next line.
const LEN_OFF: usize = INLINE;
const HEADER_WORDS_OFF: usize = LEN_OFF + 8;
const EVENT_OFF: usize = HEADER_WORDS_OFF + 16;
const WORDS_OFF: usize = EVENT_OFF + 8;
const _: () = assert!(
    EVENT_OFF + 8 == 3 * 64
        && WORDS_OFF + 4 * 8 <= RECORD
        && EventRecord::WORDS == 6
        && EventRecord::BUFFER_WORDS == 4
        && RECORDS_OFF.is_multiple_of(64)
        && RECORDS_OFF + 2 * RECORD <= SLOTS_OFF
);
const SLOTS_OFF: usize = 4096;
const TOTAL: usize = SLOTS_OFF + 2 * SLOT_BYTES;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    pid: AtomicU32,
    rank: AtomicU32,
    slot_bytes: AtomicU32,
}

/// One mapped direct segment (ours or a peer's).
struct Area {
    base: NonNull<u8>,
}

// SAFETY: the mapping lives until Drop; shared bytes are only accessed through atomics or
// under the event protocol of `transport::direct`.
unsafe impl Send for Area {}
// SAFETY: as above.
unsafe impl Sync for Area {}

impl Area {
    fn at<T>(&self, off: usize) -> &T {
        // SAFETY: every offset used is a constant below TOTAL, aligned for T (atomics at
        // multiples of 8, the Doorbell at 128), in a mapping of TOTAL bytes that lives as long
        // as `self`; all these types are valid for any bit pattern and used only atomically.
        unsafe { &*self.base.as_ptr().add(off).cast::<T>() }
    }
    fn header(&self) -> &Header {
        self.at(0)
    }
    fn bell(&self) -> &Doorbell {
        self.at(BELL_OFF)
    }
    fn closed(&self) -> &AtomicU32 {
        self.at(CLOSED_OFF)
    }
    fn gate_closed(&self) -> &AtomicU32 {
        self.at(GATE_OFF)
    }
    fn gate_writers(&self) -> &AtomicU32 {
        self.at(GATE_OFF + 8)
    }
    fn cpu(&self) -> &AtomicU32 {
        self.at(CPU_OFF)
    }
    fn record(&self, parity: usize) -> *mut u8 {
        // SAFETY: RECORDS_OFF + 2 * RECORD <= TOTAL (checked at compile time).
        unsafe { self.base.as_ptr().add(RECORDS_OFF + parity * RECORD) }
    }
    /// The number of the last event published in the record of `parity`.
    fn event_of(&self, parity: usize) -> &AtomicU64 {
        self.at(RECORDS_OFF + parity * RECORD + EVENT_OFF)
    }
    /// The length of the data published in the record of `parity`.
    fn len_of(&self, parity: usize) -> &AtomicU64 {
        self.at(RECORDS_OFF + parity * RECORD + LEN_OFF)
    }
    /// Word `i` of the encoded [`EventRecord`] in the record of `parity`: the buffer words in
    /// the fourth line, the header words in the third.
    fn word(&self, parity: usize, i: usize) -> &AtomicU64 {
        let off = if i < EventRecord::BUFFER_WORDS {
            WORDS_OFF + i * 8
        } else {
            HEADER_WORDS_OFF + (i - EventRecord::BUFFER_WORDS) * 8
        };
        self.at(RECORDS_OFF + parity * RECORD + off)
    }
    /// Asks for the record's data lines (the two before the polled one) with every poll,
    /// before the event number's line is read, so that data of 33-160 bytes, which the peer
    /// writes before its event number, arrives together with that number instead of one
    /// cross-core transfer after it (also when the event is there at the first check). Only
    /// a hint: what the reader uses is read after the event number (Acquire); lines the peer
    /// has not written are cache hits.
    fn prefetch_data(&self, parity: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let r = self.record(parity).cast_const().cast::<i8>();
            // SAFETY: a prefetch reads nothing architecturally and cannot fault; both
            // addresses lie in the mapped record anyway.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(r);
                _mm_prefetch::<_MM_HINT_T0>(r.add(64));
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = parity;
    }
    fn slot(&self, parity: usize) -> *mut u8 {
        // SAFETY: SLOTS_OFF + parity * SLOT_BYTES + SLOT_BYTES <= TOTAL for parity 0 and 1.
        unsafe { self.base.as_ptr().add(SLOTS_OFF + parity * SLOT_BYTES) }
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        // SAFETY: `base` came from mmap of TOTAL bytes and is unmapped exactly once.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), TOTAL) };
    }
}

/// The shared-memory [`Direct`] of one rank.
pub(crate) struct ShmDirect {
    rank: usize,
    areas: Vec<Option<Area>>,
    pids: Vec<Option<rustix::process::Pid>>,
    event: u64,
    cma: bool,
    /// Per peer: a pidfd (opened on first use) and the peer's shared buffers mapped here.
    mapped: Vec<(Option<std::os::fd::OwnedFd>, Vec<PeerMapping>)>,
    cadence: Cadence,
}

/// Creates this rank's area in a memfd (see [`handoff`]); returns it and the memfd,
/// which peers copy until it is closed.
fn create(name: &str, rank: usize) -> std::result::Result<(Area, OwnedFd), String> {
    crate::base::mem::check_fits(TOTAL as u64, "the shared-memory direct area")?;
    let fd = handoff::memfd(name)?;
    let path = PathBuf::from(format!("memfd:{name}"));
    let path = &path;
    if let Err(e) = rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, TOTAL as u64) {
        rustix::fs::ftruncate(&fd, TOTAL as u64).map_err(|_| io_msg("fallocate", path, e))?;
    }
    let base = map(fd.as_fd(), TOTAL as u64, path)?;
    let area = Area { base };
    let h = area.header();
    h.version.store(VERSION, Ordering::Relaxed);
    h.pid.store(std::process::id(), Ordering::Relaxed);
    h.rank.store(rank as u32, Ordering::Relaxed);
    h.slot_bytes.store(SLOT_BYTES as u32, Ordering::Relaxed);
    h.magic.store(MAGIC, Ordering::Release);
    Ok((area, fd))
}

fn open(path: &str, rank: usize, pid: u32) -> std::result::Result<Area, String> {
    let p = PathBuf::from(path);
    let fd = handoff::open_token(path, pid).map_err(|e| match e {
        handoff::OpenError::Refused(m) | handoff::OpenError::Failed(m) => {
            format!("rank {rank}'s direct area: {m}")
        }
        handoff::OpenError::Gone(m) => format!("lost peer rank {rank}: {m}"),
    })?;
    let st = rustix::fs::fstat(&fd).map_err(|e| io_msg("fstat", &p, e))?;
    if (st.st_size as u64) < TOTAL as u64 {
        return Err(format!("{path} is too small"));
    }
    let area = Area {
        base: map(fd.as_fd(), TOTAL as u64, &p)?,
    };
    let h = area.header();
    if h.magic.load(Ordering::Acquire) != MAGIC
        || h.version.load(Ordering::Relaxed) != VERSION
        || h.rank.load(Ordering::Relaxed) as usize != rank
        || h.pid.load(Ordering::Relaxed) != pid
        || h.slot_bytes.load(Ordering::Relaxed) as usize != SLOT_BYTES
    {
        return Err(format!("{path} does not hold rank {rank}'s direct area"));
    }
    Ok(area)
}

/// Sets up direct access among all `n` ranks of a single-host communicator, in steps around
/// two exchanges made elsewhere (`comm/init.rs` has them ride in the shared-memory
/// transport's): [`start`](Self::start) gives the first message, [`opened`](Self::opened)
/// takes every rank's and gives the second, [`finish`](Self::finish) takes every rank's second
/// and returns `None` (logging why) where some rank could not set it up; the ring algorithms
/// then do all the work. Collective: every rank of the host runs every step.
pub(crate) struct Setup {
    rank: usize,
    n: usize,
    tag: u64,
    pid_of: Vec<u32>,
    mine: std::result::Result<(Area, OwnedFd), String>,
    /// A value whose address peers read and write (the same bytes back), to learn whether
    /// CMA works. Atomic: peers write it behind the compiler's back.
    probe: Box<AtomicU64>,
    allow_cma: bool,
    /// After [`opened`](Self::opened): every rank's area, by rank.
    areas: Vec<Option<Area>>,
    pids: Vec<Option<rustix::process::Pid>>,
    failure: Option<String>,
    cma_ok: bool,
    /// The area's memfd stays open until every peer has copied it (the verdict).
    my_fd: Option<OwnedFd>,
}

impl Setup {
    /// Creates this rank's area; returns the setup and this rank's first message.
    pub(crate) fn start(
        rank: usize,
        pid_of: &[u32],
        tag: u64,
        allow_cma: bool,
    ) -> (Setup, Vec<u8>) {
        let n = pid_of.len();
        let mine = create(&format!("oxccl-{tag:016x}-d{rank}"), rank);
        let probe = Box::new(AtomicU64::new(0x0c5a_u64 ^ tag));
        let msg = match &mine {
            Ok((_, fd)) => format!(
                "ok {} {} {}",
                probe.as_ptr() as usize,
                crate::transport::shm::pid_namespace(),
                handoff::token(fd)
            ),
            Err(e) => format!("err {e}"),
        };
        let setup = Setup {
            rank,
            n,
            tag,
            pid_of: pid_of.to_vec(),
            mine,
            probe,
            allow_cma,
            areas: (0..n).map(|_| None).collect(),
            pids: vec![None; n],
            failure: None,
            cma_ok: false,
            my_fd: None,
        };
        (setup, msg.into_bytes())
    }

    /// Opens every peer's area from their first messages `all` and probes CMA; returns this
    /// rank's verdict (the second message).
    pub(crate) fn opened(&mut self, all: &[Vec<u8>]) -> Vec<u8> {
        let (rank, n, tag) = (self.rank, self.n, self.tag);
        let pid_of = &self.pid_of;
        let mut areas: Vec<Option<Area>> = (0..n).map(|_| None).collect();
        let mine = std::mem::replace(&mut self.mine, Err(String::new()));
        let mut failure = mine.as_ref().err().cloned();
        let mut cma_ok = self.allow_cma;
        let mut probes = vec![0u64; n];
        let my_ns = crate::transport::shm::pid_namespace();
        // Pids mean something here only for peers in this pid namespace.
        let mut pids: Vec<Option<rustix::process::Pid>> = vec![None; n];
        if all.len() != n {
            failure = failure.or(Some(format!("{} first messages for {n} ranks", all.len())));
        }
        for (r, m) in all.iter().enumerate().take(n) {
            let m = String::from_utf8_lossy(m);
            let mut it = m.splitn(4, ' ');
            match (it.next(), it.next(), it.next(), it.next()) {
                (Some("ok"), Some(addr), Some(ns), Some(p)) if r != rank => {
                    match open(p, r, pid_of[r]) {
                        Ok(a) => {
                            areas[r] = Some(a);
                            probes[r] = addr.parse().unwrap_or(0);
                            if ns == my_ns && !my_ns.is_empty() {
                                pids[r] = rustix::process::Pid::from_raw(pid_of[r] as i32);
                            } else {
                                cma_ok = false;
                            }
                        }
                        Err(e) => failure = failure.or(Some(e)),
                    }
                }
                (Some("ok"), _, _, _) => {}
                _ => failure = failure.or(Some(format!("rank {r}: {m}"))),
            }
        }
        if let Ok((a, fd)) = mine {
            own_areas().push(a.base.as_ptr() as usize);
            areas[rank] = Some(a);
            self.my_fd = Some(fd);
        }
        if cma_ok {
            for (r, &addr) in probes.iter().enumerate() {
                if r == rank || failure.is_some() {
                    continue;
                }
                let mut v = [0u8; 8];
                // Read the peer's probe, then write the same bytes back: both directions must
                // work (writing the value it already holds leaves it intact for the others).
                if read_remote(pid_of[r], addr, &mut v).is_err()
                    || u64::from_ne_bytes(v) != 0x0c5a_u64 ^ tag
                    || write_remote(pid_of[r], addr, &v).is_err()
                {
                    cma_ok = false;
                }
            }
        }
        let verdict = vec![u8::from(failure.is_none()), u8::from(cma_ok)];
        self.areas = areas;
        self.pids = pids;
        self.failure = failure;
        self.cma_ok = cma_ok;
        verdict
    }

    /// The direct area from every rank's verdict `all`, or `None` (logged) if any rank failed.
    pub(crate) fn finish(self, all: &[Vec<u8>]) -> Option<ShmDirect> {
        let rank = self.rank;
        drop(self.probe);
        drop(self.my_fd);
        if let Some(f) = self.failure.or_else(|| {
            (all.len() != self.n || all.iter().any(|v| v.first() != Some(&1)))
                .then(|| "a peer failed".to_string())
        }) {
            tracing::warn!(rank, "shared-memory direct algorithms disabled: {f}");
            return None;
        }
        let cma = all.iter().all(|v| v.get(1) == Some(&1));
        tracing::info!(rank, cma, "shared-memory direct area ready");
        Some(ShmDirect {
            rank,
            areas: self.areas,
            pids: self.pids,
            event: 0,
            cma,
            mapped: (0..self.n).map(|_| (None, Vec::new())).collect(),
            cadence: Cadence::new(),
        })
    }
}

impl ShmDirect {
    fn area(&self, r: usize) -> &Area {
        self.areas[r]
            .as_ref()
            .expect("every rank's area is mapped (checked in connect)")
    }
}

impl Direct for ShmDirect {
    fn slot_bytes(&self) -> usize {
        SLOT_BYTES
    }

    fn publish(&mut self, data: &[u8], record: &EventRecord) -> u64 {
        assert!(data.len() <= SLOT_BYTES, "direct slot overflow");
        self.event += 1;
        let e = self.event;
        let p = (e % 2) as usize;
        let me = self.area(self.rank);
        if data.len() <= INLINE {
            // Small data travels in the record, right before the event number (see the layout).
            // SAFETY: INLINE - len .. INLINE lies in the record; by the reuse rule no peer reads
            // record p now (they finished event e - 2 before publishing e - 1, which we waited
            // for).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr(),
                    me.record(p).add(INLINE - data.len()),
                    data.len(),
                )
            };
        } else {
            // SAFETY: the slot has SLOT_BYTES >= data.len() bytes; no peer reads slot p now
            // (as above).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), me.slot(p), data.len()) };
        }
        me.len_of(p).store(data.len() as u64, Ordering::Relaxed);
        // The CPU this publish runs on, for peers deciding how to wait for this rank's next
        // event. Relaxed: a hint that any value, stale or new, leaves correct (it only picks
        // between spinning and yielding); stored only when changed, so that the line stays
        // in this core's cache. glibc reads it from the rseq area (about 1-5 ns here).
        // SAFETY: sched_getcpu has no preconditions.
        let cpu = (unsafe { libc::sched_getcpu() } + 1).max(0) as u32;
        if me.cpu().load(Ordering::Relaxed) != cpu {
            me.cpu().store(cpu, Ordering::Relaxed);
        }
        for (i, a) in record.encode().into_iter().enumerate() {
            let w = me.word(p, i);
            // The buffer words sit in a line of their own, which small calls leave at zero:
            // writing only changed values keeps that line out of the peers' way.
            if i >= EventRecord::BUFFER_WORDS || w.load(Ordering::Relaxed) != a {
                w.store(a, Ordering::Relaxed);
            }
        }
        // SeqCst: the store is a full barrier, which orders the publish before the reads of
        // the peers' sleeper counts (one barrier for every peer, see crate::base::wait).
        me.event_of(p).store(e, Ordering::SeqCst);
        for r in 0..self.areas.len() {
            if r != self.rank {
                self.area(r).bell().ring_after_seqcst_store();
            }
        }
        e
    }

    fn reached(&self, peer: usize, e: u64) -> bool {
        // The line of e's parity holds e - 2, e, or nothing newer: the peer cannot publish
        // e + 2 before this rank publishes e + 1 (the reuse rule).
        let area = self.area(peer);
        let p = (e % 2) as usize;
        area.prefetch_data(p);
        area.event_of(p).load(Ordering::Acquire) >= e
    }

    fn event(&self) -> u64 {
        self.event
    }

    fn peer_slot(&self, peer: usize, e: u64, len: usize) -> &[u8] {
        let len = len.min(SLOT_BYTES);
        let p = (e % 2) as usize;
        let area = self.area(peer);
        // Where the peer put it depends on how much it published (a reader may want less:
        // all_to_all reads a prefix).
        let total = area.len_of(p).load(Ordering::Relaxed) as usize;
        // Every reader asks for at most what the peer published: the call's header, checked
        // before any slot is read, fixes the lengths on both sides.
        debug_assert!(len <= total, "reading {len} bytes of {total} published");
        let at = if total <= INLINE {
            // SAFETY: `INLINE - total` lies within the record (total <= INLINE).
            unsafe { area.record(p).add(INLINE - total).cast_const() }
        } else {
            area.slot(p).cast_const()
        };
        // SAFETY: `len` bytes at `at` lie in the peer's record or slot; the peer wrote them
        // before publishing e (seen with Acquire by `reached`) and will not write them again
        // before we publish e + 1.
        unsafe { std::slice::from_raw_parts(at, len) }
    }

    fn peer_header(&self, peer: usize, e: u64) -> [u8; HEADER_BYTES] {
        // Both words in the line `reached` polled: no further transfer between cores.
        let a = self.area(peer);
        let w = [0, 1].map(|i| {
            a.word((e % 2) as usize, EventRecord::BUFFER_WORDS + i)
                .load(Ordering::Relaxed)
        });
        EventRecord::header_of_words(w)
    }

    fn peer_record(&self, peer: usize, e: u64) -> EventRecord {
        let a = self.area(peer);
        EventRecord::decode(std::array::from_fn(|i| {
            a.word((e % 2) as usize, i).load(Ordering::Relaxed)
        }))
    }

    fn read_peer(&self, peer: usize, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
        let pid = self.pids[peer].map_or(0, |p| p.as_raw_nonzero().get() as u32);
        read_remote(pid, addr, dst)
    }

    fn write_peer(&self, peer: usize, addr: u64, src: &[u8]) -> std::io::Result<()> {
        let pid = self.pids[peer].map_or(0, |p| p.as_raw_nonzero().get() as u32);
        write_remote(pid, addr, src)
    }

    fn enter_peer_writes(&self, peer: usize) {
        let Some(a) = self.areas.get(peer).and_then(|a| a.as_ref()) else {
            return;
        };
        let start = std::time::Instant::now();
        loop {
            a.gate_writers().fetch_add(1, Ordering::SeqCst);
            // A peer that died forking leaves its gate closed: go on after a bound (the
            // call's liveness checks find it gone).
            if a.gate_closed().load(Ordering::SeqCst) == 0 || start.elapsed() > PEER_GATE_WAIT {
                return;
            }
            a.gate_writers().fetch_sub(1, Ordering::SeqCst);
            while a.gate_closed().load(Ordering::SeqCst) != 0 && start.elapsed() <= PEER_GATE_WAIT {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    fn leave_peer_writes(&self, peer: usize) {
        if let Some(a) = self.areas.get(peer).and_then(|a| a.as_ref()) {
            a.gate_writers().fetch_sub(1, Ordering::Release);
        }
    }

    fn map_peer(&mut self, peer: usize, region: &Region) -> std::io::Result<Option<NonNull<u8>>> {
        let Some(pid) = self.pids[peer].filter(|_| self.cma) else {
            return Ok(None);
        };
        let now = self.event;
        let (pidfd, maps) = &mut self.mapped[peer];
        // The region's length decides which offsets callers use: a cached mapping serves only
        // if it is at least that long (it is: ids are never reused for another buffer).
        if let Some(m) = maps
            .iter_mut()
            .find(|m| m.id == region.id && m.len as u64 >= region.len)
        {
            m.used = now;
            return Ok(Some(m.local));
        }
        if pidfd.is_none() {
            *pidfd = Some(rustix::process::pidfd_open(
                pid,
                rustix::process::PidfdFlags::empty(),
            )?);
        }
        let m = PeerMapping::map(pidfd.as_ref().expect("opened above"), region, now)?;
        let mut bytes: usize = maps.iter().map(|m| m.len).sum::<usize>() + m.len;
        while maps.len() >= PEER_MAPPINGS || bytes > PEER_MAPPED_BYTES {
            // The least recently used, but not one of this event's (those carry `now`, and a
            // call maps at most two buffers per peer).
            let Some((i, _)) = maps
                .iter()
                .enumerate()
                .filter(|(_, m)| m.used < now)
                .min_by_key(|(_, m)| m.used)
            else {
                break;
            };
            bytes -= maps.swap_remove(i).len;
        }
        let local = m.local;
        maps.push(m);
        tracing::debug!(
            rank = self.rank,
            peer,
            id = region.id,
            len = region.len,
            "mapped a peer's shared buffer"
        );
        Ok(Some(local))
    }

    fn can_read_peers(&self) -> bool {
        self.cma
    }

    fn doorbell(&self) -> &Doorbell {
        self.area(self.rank).bell()
    }

    fn peer_shares_cpu(&self, peer: usize) -> bool {
        // Relaxed: a hint (see publish).
        let mine = self.area(self.rank).cpu().load(Ordering::Relaxed);
        mine != 0 && self.area(peer).cpu().load(Ordering::Relaxed) == mine
    }

    fn cadence(&mut self) -> &mut Cadence {
        &mut self.cadence
    }

    fn check_alive(&self, peer: usize) -> std::result::Result<(), LinkError> {
        if self.area(peer).closed().load(Ordering::Acquire) != 0 {
            return Err(LinkError::Closed(format!(
                "rank {peer} closed its communicator"
            )));
        }
        match self.pids[peer] {
            Some(pid) if crate::transport::shm::process_gone(pid) => Err(LinkError::Closed(
                format!("process {} of rank {peer} exited", pid.as_raw_nonzero()),
            )),
            _ => Ok(()),
        }
    }
}

/// How long a rank waits at most for a peer's fork to open its gate.
const PEER_GATE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The direct areas of this process (their addresses), whose gates a fork closes.
fn own_areas() -> std::sync::MutexGuard<'static, Vec<usize>> {
    static OWN: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());
    OWN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Closes the fork gate of every direct area of this process, so that no peer writes into
/// its buffers from now on, and waits until the peers' writes in progress are done (at most
/// `bound`; false if some still were). For `fork`'s `prepare` (the snapshot of the shared
/// buffers for the child); [`open_peer_gates`] opens them in the parent. The areas stay
/// mapped meanwhile: an area is unmapped only after its entry is gone, under the same lock.
pub(crate) fn close_peer_gates(bound: std::time::Duration) -> bool {
    let own = own_areas();
    let area = |b: usize| Area {
        base: NonNull::new(b as *mut u8).expect("an area's address"),
    };
    for &b in own.iter() {
        let a = std::mem::ManuallyDrop::new(area(b));
        a.gate_closed().store(1, Ordering::SeqCst);
    }
    let start = std::time::Instant::now();
    for &b in own.iter() {
        let a = std::mem::ManuallyDrop::new(area(b));
        while a.gate_writers().load(Ordering::SeqCst) != 0 {
            if start.elapsed() > bound {
                return false;
            }
            std::thread::yield_now();
        }
    }
    true
}

/// Opens the gates [`close_peer_gates`] closed (in the parent after `fork`: the child must not
/// write into the areas, which are its parent's).
pub(crate) fn open_peer_gates() {
    let own = own_areas();
    for &b in own.iter() {
        let a = std::mem::ManuallyDrop::new(Area {
            base: NonNull::new(b as *mut u8).expect("an area's address"),
        });
        a.gate_closed().store(0, Ordering::SeqCst);
    }
}

impl Drop for ShmDirect {
    fn drop(&mut self) {
        // Peers waiting for this rank's next event learn at their next liveness check that it
        // will never come.
        if let Some(me) = self.areas.get(self.rank).and_then(|a| a.as_ref()) {
            me.closed().store(1, Ordering::Release);
            let base = me.base.as_ptr() as usize;
            own_areas().retain(|&b| b != base);
        }
        fence(Ordering::SeqCst);
        for (r, a) in self.areas.iter().enumerate() {
            if let (true, Some(a)) = (r != self.rank, a) {
                a.bell().ring();
            }
        }
    }
}

impl std::fmt::Debug for ShmDirect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmDirect")
            .field("rank", &self.rank)
            .field("event", &self.event)
            .field("cma", &self.cma)
            .finish()
    }
}
