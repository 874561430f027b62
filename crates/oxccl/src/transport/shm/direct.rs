//! [`Direct`] over shared memory: each rank of a host owns a small segment
//! (`/dev/shm/oxccl-<tag>-d<rank>-<pid>`) with its event counter, two address records and two
//! data slots, mapped by every other rank of the host; peers' buffers are read with
//! `process_vm_readv` (single copy, as Open MPI's CMA path) where the kernel allows it.
//!
//! Layout: header (magic `"OXCCLDIR"`, version, owner pid and rank, slot size) at 0, the
//! owner's [`Doorbell`] at 128, the event counter at 256, the address records at 384, the two
//! slots from 4096 on.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid as NixPid;
use rustix::fs::{FallocateFlags, Mode, OFlags};

use super::segment::{free_bytes, io_msg, map, SHM_DIR};
use crate::bootstrap::Exchange;
use crate::error::Result;
use crate::transport::direct::{Direct, ADDRS};
use crate::transport::LinkError;
use crate::wait::Doorbell;

const MAGIC: u64 = u64::from_le_bytes(*b"OXCCLDIR");
const VERSION: u32 = 1;
/// Bytes of one data slot.
pub const SLOT_BYTES: usize = 64 << 10;
const BELL_OFF: usize = 128;
const PROGRESS_OFF: usize = 256;
const CLOSED_OFF: usize = 320;
const ADDRS_OFF: usize = 384;
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
    fn progress(&self) -> &AtomicU64 {
        self.at(PROGRESS_OFF)
    }
    fn closed(&self) -> &AtomicU32 {
        self.at(CLOSED_OFF)
    }
    fn addr(&self, parity: usize, i: usize) -> &AtomicU64 {
        self.at(ADDRS_OFF + (parity * ADDRS + i) * 8)
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
pub struct ShmDirect {
    rank: usize,
    areas: Vec<Option<Area>>,
    pids: Vec<Option<rustix::process::Pid>>,
    event: u64,
    cma: bool,
}

fn create(path: &PathBuf, rank: usize) -> std::result::Result<Area, String> {
    let free = free_bytes(SHM_DIR)?;
    if free < TOTAL as u64 {
        return Err(format!("{SHM_DIR} has {free} bytes free, {TOTAL} needed"));
    }
    let fd = rustix::fs::open(
        path,
        OFlags::CREATE | OFlags::EXCL | OFlags::RDWR | OFlags::CLOEXEC,
        Mode::RUSR | Mode::WUSR,
    )
    .map_err(|e| io_msg("create", path, e))?;
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
    Ok(area)
}

fn open(path: &str, rank: usize, pid: u32) -> std::result::Result<Area, String> {
    let p = PathBuf::from(path);
    if !path.starts_with(&format!("{SHM_DIR}/oxccl-")) || path.contains("..") {
        return Err(format!("refusing segment path {path}"));
    }
    let fd = rustix::fs::open(&p, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| io_msg("open", &p, e))?;
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

/// Sets up direct access among all `n` ranks of a single-host communicator: collective, every
/// rank calls it. `pid_of[r]` is rank r's process id. Returns `None` (and logs why) where it
/// cannot be set up on some rank; the ring algorithms then do all the work.
pub fn connect(
    ex: &mut dyn Exchange,
    pid_of: &[u32],
    tag: u64,
    allow_cma: bool,
) -> Result<Option<ShmDirect>> {
    let (rank, n) = (ex.rank(), ex.world_size());
    let path = PathBuf::from(format!(
        "{SHM_DIR}/oxccl-{tag:016x}-d{rank}-{}",
        std::process::id()
    ));
    let mine = create(&path, rank);
    // A probe value whose address peers read and write (the same bytes back), to learn whether
    // CMA works. Atomic: peers write it behind the compiler's back.
    let probe = Box::new(std::sync::atomic::AtomicU64::new(0x0c5a_u64 ^ tag));
    let msg = match &mine {
        Ok(_) => format!(
            "ok {} {} {}",
            probe.as_ptr() as usize,
            super::pid_namespace(),
            path.display()
        ),
        Err(e) => format!("err {e}"),
    };
    let all = ex.allgather(msg.as_bytes())?;
    let mut areas: Vec<Option<Area>> = (0..n).map(|_| None).collect();
    let mut failure = mine.as_ref().err().cloned();
    let mut cma_ok = allow_cma;
    let mut probes = vec![0u64; n];
    let my_ns = super::pid_namespace();
    // Pids mean something here only for peers in this pid namespace.
    let mut pids: Vec<Option<rustix::process::Pid>> = vec![None; n];
    for (r, m) in all.iter().enumerate() {
        let m = String::from_utf8_lossy(m);
        let mut it = m.splitn(4, ' ');
        match (it.next(), it.next(), it.next(), it.next()) {
            (Some("ok"), Some(addr), Some(ns), Some(p)) if r != rank => match open(p, r, pid_of[r])
            {
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
            },
            (Some("ok"), _, _, _) => {}
            _ => failure = failure.or(Some(format!("rank {r}: {m}"))),
        }
    }
    if let Ok(a) = mine {
        areas[rank] = Some(a);
    }
    if cma_ok {
        for (r, &addr) in probes.iter().enumerate() {
            if r == rank || failure.is_some() {
                continue;
            }
            let mut v = [0u8; 8];
            // Read the peer's probe, then write the same bytes back: both directions must work
            // (writing the value it already holds leaves it intact for the other readers).
            if read_remote(pid_of[r], addr, &mut v).is_err()
                || u64::from_ne_bytes(v) != 0x0c5a_u64 ^ tag
                || write_remote(pid_of[r], addr, &v).is_err()
            {
                cma_ok = false;
            }
        }
    }
    let verdict = [u8::from(failure.is_none()), u8::from(cma_ok)];
    let all = ex.allgather(&verdict)?;
    drop(probe);
    let _ = rustix::fs::unlink(&path);
    if let Some(f) = failure.or_else(|| {
        all.iter()
            .any(|v| v.first() != Some(&1))
            .then(|| "a peer failed".to_string())
    }) {
        tracing::warn!(rank, "shared-memory direct algorithms disabled: {f}");
        return Ok(None);
    }
    let cma = all.iter().all(|v| v.get(1) == Some(&1));
    tracing::info!(rank, cma, "shared-memory direct area ready");
    Ok(Some(ShmDirect {
        rank,
        areas,
        pids,
        event: 0,
        cma,
    }))
}

fn read_remote(pid: u32, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
    let len = dst.len();
    let mut done = 0;
    while done < len {
        let mut local = [IoSliceMut::new(&mut dst[done..])];
        let remote = [RemoteIoVec {
            base: addr as usize + done,
            len: len - done,
        }];
        let k = process_vm_readv(NixPid::from_raw(pid as i32), &mut local, &remote)
            .map_err(std::io::Error::from)?;
        if k == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "process_vm_readv read nothing",
            ));
        }
        done += k;
    }
    Ok(())
}

fn write_remote(pid: u32, addr: u64, src: &[u8]) -> std::io::Result<()> {
    let len = src.len();
    let mut done = 0;
    while done < len {
        let local = [IoSlice::new(&src[done..])];
        let remote = [RemoteIoVec {
            base: addr as usize + done,
            len: len - done,
        }];
        let k = process_vm_writev(NixPid::from_raw(pid as i32), &local, &remote)
            .map_err(std::io::Error::from)?;
        if k == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "process_vm_writev wrote nothing",
            ));
        }
        done += k;
    }
    Ok(())
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

    fn publish(&mut self, data: &[u8], addrs: [u64; ADDRS]) -> u64 {
        assert!(data.len() <= SLOT_BYTES, "direct slot overflow");
        self.event += 1;
        let e = self.event;
        let p = (e % 2) as usize;
        let me = self.area(self.rank);
        // SAFETY: the slot has SLOT_BYTES >= data.len() bytes; by the reuse rule no peer reads
        // slot p now (they finished event e - 2 before publishing e - 1, which we waited for).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), me.slot(p), data.len()) };
        for (i, a) in addrs.iter().enumerate() {
            me.addr(p, i).store(*a, Ordering::Relaxed);
        }
        me.progress().store(e, Ordering::Release);
        // Each ring() begins with the SeqCst fence the doorbell protocol needs after publishing.
        for r in 0..self.areas.len() {
            if r != self.rank {
                self.area(r).bell().ring();
            }
        }
        e
    }

    fn reached(&self, peer: usize, e: u64) -> bool {
        self.area(peer).progress().load(Ordering::Acquire) >= e
    }

    fn event(&self) -> u64 {
        self.event
    }

    fn peer_slot(&self, peer: usize, e: u64, len: usize) -> &[u8] {
        let len = len.min(SLOT_BYTES);
        // SAFETY: in bounds of the peer's slot; the peer wrote it before publishing e (seen
        // with Acquire by `reached`) and will not write it again before we publish e + 1.
        unsafe { std::slice::from_raw_parts(self.area(peer).slot((e % 2) as usize), len) }
    }

    fn peer_addrs(&self, peer: usize, e: u64) -> [u64; ADDRS] {
        let a = self.area(peer);
        std::array::from_fn(|i| a.addr((e % 2) as usize, i).load(Ordering::Relaxed))
    }

    fn read_peer(&self, peer: usize, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
        let pid = self.pids[peer].map_or(0, |p| p.as_raw_nonzero().get() as u32);
        read_remote(pid, addr, dst)
    }

    fn write_peer(&self, peer: usize, addr: u64, src: &[u8]) -> std::io::Result<()> {
        let pid = self.pids[peer].map_or(0, |p| p.as_raw_nonzero().get() as u32);
        write_remote(pid, addr, src)
    }

    fn can_read_peers(&self) -> bool {
        self.cma
    }

    fn doorbell(&self) -> &Doorbell {
        self.area(self.rank).bell()
    }

    fn check_alive(&self, peer: usize) -> std::result::Result<(), LinkError> {
        if self.area(peer).closed().load(Ordering::Acquire) != 0 {
            return Err(LinkError::Closed(format!(
                "rank {peer} closed its communicator"
            )));
        }
        match self.pids[peer] {
            Some(pid) if super::process_gone(pid) => Err(LinkError::Closed(format!(
                "process {} of rank {peer} exited",
                pid.as_raw_nonzero()
            ))),
            _ => Ok(()),
        }
    }
}

impl Drop for ShmDirect {
    fn drop(&mut self) {
        // Peers waiting for this rank's next event learn at their next liveness check that it
        // will never come.
        if let Some(me) = self.areas.get(self.rank).and_then(|a| a.as_ref()) {
            me.closed().store(1, Ordering::Release);
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
