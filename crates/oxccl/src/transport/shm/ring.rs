//! The single-producer/single-consumer byte ring that lives in shared memory.
//!
//! A ring is a control block ([`RingCtrl`]) and a data area of `cap` bytes (a power of two).
//! `head` counts the bytes ever written (only the producer stores it) and `tail` the bytes
//! ever consumed (only the consumer stores it); each sits alone on a 128-byte line so that the
//! two sides do not invalidate each other's line on every update. The bytes `[tail, head)`
//! belong to the consumer, `[head, tail + cap)` to the producer; position `p` lives at data
//! offset `p & (cap - 1)`.
//!
//! - Producer: copy into `[head, head + n)` (up to the wrap, then the rest from offset 0),
//!   then `head.store(head + n, Release)`.
//! - Consumer: `head.load(Acquire)`, read `[tail, head)`, then `tail.store(.., Release)`.
//!
//! The Release/Acquire pairs order the data copies: the consumer sees every byte written
//! before the `head` it loaded, and the producer never overwrites bytes the consumer is still
//! reading, because it only reuses space after loading (Acquire) a `tail` stored (Release)
//! after those reads. Each side keeps its own index privately (the shared copy is only ever
//! stored, never trusted) and caches the other side's index, reloading it only when the cache
//! says the ring is full (producer) or empty (consumer). Values loaded from the other side are
//! checked (monotonic, never more than `cap` apart) and a violation is a
//! [`LinkError::Protocol`], never a panic or an out-of-bounds access.
//!
//! `u64` byte counters cannot wrap in practice (2^64 bytes is 584 years at 1 TB/s).
//!
//! **Shrinking once.** A producer that cannot have memory for the rest of the data area (the
//! segment's budget, `segment.rs`) may, while every byte it ever wrote lies below a power of
//! two `L < cap` (`head <= L` in the first pass), make `L` the ring's capacity for good
//! ([`Producer::limit_to`]): it stores `L` in the control block's `limit` before any `head`
//! beyond `L`, so a consumer that loads (Acquire) such a `head` then reads the new `limit`
//! too. Below `L` both capacities give every position the same offset, so bytes already
//! written stay where the consumer looks for them.

use std::ptr::NonNull;

// Under `--cfg loom` the ring indices and flags are loom's atomics, and the data area is an
// array of loom cells, so that the model checker sees every access (see `loom_tests`).
#[cfg(loom)]
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::transport::LinkError;

/// Size of one cache line as far as false sharing goes (two 64-byte lines: adjacent-line
/// prefetchers pair them).
pub(crate) const LINE: usize = 128;

#[repr(C, align(128))]
struct HeadLine {
    head: AtomicU64,
}

#[repr(C, align(128))]
struct TailLine {
    tail: AtomicU64,
}

/// Rarely written flags, on their own line so that checking them on every call costs a read
/// of a line both caches keep shared.
#[repr(C, align(128))]
struct FlagLine {
    producer_closed: AtomicU32,
    consumer_closed: AtomicU32,
    /// The capacity the producer shrank the ring to; 0: the capacity it was made with.
    limit: AtomicU64,
}

/// The control block of one ring, at a fixed `repr(C)` layout in shared memory: `head` at
/// offset 0, `tail` at 128, the two `closed` flags at 256 and 260, `limit` at 264. All zero
/// is the initial state (empty ring, both sides open, full capacity).
#[repr(C)]
pub(crate) struct RingCtrl {
    head: HeadLine,
    tail: TailLine,
    flags: FlagLine,
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<RingCtrl>() == 3 * LINE);
const _: () = assert!(std::mem::align_of::<RingCtrl>() == LINE);

/// Copies `src` to data offset `off`.
///
/// # Safety
/// `[off, off + src.len())` lies inside the live data area `data`, and the ring protocol
/// reserves it to the caller (no concurrent reader or writer).
#[cfg(not(loom))]
#[inline(always)]
unsafe fn copy_in(data: NonNull<u8>, off: u64, src: &[u8]) {
    // SAFETY: the caller's contract; `src` is local memory, disjoint from the mapping.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), data.as_ptr().add(off as usize), src.len())
    }
}

/// Offers data bytes `[off, off + len)` to `consume`; returns what it took.
///
/// # Safety
/// `[off, off + len)` lies inside the live data area `data` and holds published bytes that
/// the protocol keeps from being written until the caller advances `tail` past them.
#[cfg(not(loom))]
#[inline(always)]
unsafe fn offer(
    data: NonNull<u8>,
    off: u64,
    len: u64,
    consume: &mut dyn FnMut(&[u8]) -> usize,
) -> usize {
    // SAFETY: the caller's contract: in bounds, mapped, and nobody writes these bytes while
    // the slice exists (a peer that breaks the protocol can only garble bytes, it cannot
    // move the slice). The slice does not outlive this call (`consume` cannot keep it).
    let chunk =
        unsafe { std::slice::from_raw_parts(data.as_ptr().add(off as usize), len as usize) };
    consume(chunk)
}

#[cfg(loom)]
unsafe fn copy_in(data: NonNull<u8>, off: u64, src: &[u8]) {
    let cells = data.as_ptr().cast::<loom::cell::UnsafeCell<u8>>();
    for (i, &b) in src.iter().enumerate() {
        // SAFETY: the caller's contract; loom checks that no other access races with this one.
        unsafe { (*cells.add(off as usize + i)).with_mut(|p| *p = b) }
    }
}

#[cfg(loom)]
unsafe fn offer(
    data: NonNull<u8>,
    off: u64,
    len: u64,
    consume: &mut dyn FnMut(&[u8]) -> usize,
) -> usize {
    let cells = data.as_ptr().cast::<loom::cell::UnsafeCell<u8>>();
    // SAFETY: the caller's contract; loom checks that no write races with these reads.
    let v: Vec<u8> = (0..len as usize)
        .map(|i| unsafe { (*cells.add(off as usize + i)).with(|p| *p) })
        .collect();
    consume(&v)
}

#[cfg(loom)]
impl RingCtrl {
    /// A fresh control block (loom atomics cannot be zero-initialized memory).
    fn new() -> Self {
        RingCtrl {
            head: HeadLine {
                head: AtomicU64::new(0),
            },
            tail: TailLine {
                tail: AtomicU64::new(0),
            },
            flags: FlagLine {
                producer_closed: AtomicU32::new(0),
                consumer_closed: AtomicU32::new(0),
                limit: AtomicU64::new(0),
            },
        }
    }
}

/// The writing end of a ring.
pub(crate) struct Producer {
    ctrl: NonNull<RingCtrl>,
    data: NonNull<u8>,
    cap: u64,
    /// Bytes ever written: the authoritative copy of `head`.
    head: u64,
    /// The last `tail` loaded from the consumer.
    cached_tail: u64,
}

/// The reading end of a ring.
pub(crate) struct Consumer {
    ctrl: NonNull<RingCtrl>,
    data: NonNull<u8>,
    cap: u64,
    /// Bytes ever consumed: the authoritative copy of `tail`.
    tail: u64,
    /// The last `head` loaded from the producer.
    cached_head: u64,
    /// Whether `cap` is final: the producer shrank the ring, or wrote past the first pass
    /// (after which it may not shrink it), so `limit` need not be loaded again.
    cap_final: bool,
}

// SAFETY: a Producer/Consumer only holds pointers into a mapping that its owner (ShmLink)
// keeps alive through an Arc, and touches the shared memory only through atomics and the
// ring protocol, which does not depend on the thread it runs on.
unsafe impl Send for Producer {}
// SAFETY: as for Producer.
unsafe impl Send for Consumer {}

impl Producer {
    /// The producer of a fresh ring (head = tail = 0).
    ///
    /// # Safety
    /// `ctrl` must point to a `RingCtrl` and `data` to `cap` bytes, both inside a mapping
    /// that stays valid for the life of the returned value; `cap` must be a power of two; at
    /// most one `Producer` may exist for a ring.
    pub(crate) unsafe fn new(ctrl: NonNull<RingCtrl>, data: NonNull<u8>, cap: u64) -> Self {
        debug_assert!(cap.is_power_of_two());
        Producer {
            ctrl,
            data,
            cap,
            head: 0,
            cached_tail: 0,
        }
    }

    /// The ring's capacity now (its capacity at `new`, or what [`limit_to`](Self::limit_to)
    /// made it).
    pub(crate) fn capacity(&self) -> u64 {
        self.cap
    }

    /// Makes `limit` the ring's capacity for good, so that the data area beyond it is never
    /// touched. Only while every byte written lies below it: `limit` a power of two, at
    /// most the capacity, at least `head`; false (nothing changed) otherwise.
    pub(crate) fn limit_to(&mut self, limit: u64) -> bool {
        if !limit.is_power_of_two() || limit > self.cap || self.head > limit {
            return false;
        }
        if limit < self.cap {
            // Before any `head` beyond `limit` (Release below, in `write`): a consumer that
            // loads such a head sees this store.
            self.ctrl().flags.limit.store(limit, Ordering::Release);
            self.cap = limit;
        }
        true
    }

    fn ctrl(&self) -> &RingCtrl {
        // SAFETY: `new`'s contract: the control block stays mapped while `self` lives, and it
        // is only accessed through atomics.
        unsafe { self.ctrl.as_ref() }
    }

    /// Loads the consumer's `tail` and checks it: it never goes back and never passes `head`.
    fn reload_tail(&mut self) -> Result<(), LinkError> {
        let t = self.ctrl().tail.tail.load(Ordering::Acquire);
        if t < self.cached_tail || t > self.head {
            return Err(LinkError::Protocol(format!(
                "shared-memory ring: consumer tail {t} outside [{}, {}] (capacity {})",
                self.cached_tail, self.head, self.cap
            )));
        }
        self.cached_tail = t;
        Ok(())
    }

    /// Copies a prefix of `src` into the ring and publishes it; returns its length (0 when
    /// the ring is full or `src` is empty).
    pub(crate) fn write(&mut self, src: &[u8]) -> Result<usize, LinkError> {
        if src.is_empty() {
            return Ok(0);
        }
        let len = src.len() as u64;
        let mut free = self.cap - (self.head - self.cached_tail);
        if free < len.min(self.cap) {
            self.reload_tail()?;
            free = self.cap - (self.head - self.cached_tail);
        }
        let n = free.min(len);
        if n == 0 {
            return Ok(0);
        }
        let off = self.head & (self.cap - 1);
        let first = n.min(self.cap - off);
        // SAFETY: `off < cap` and `first <= cap - off`, so `[off, off + first)` is inside the
        // data area; `n <= free <= cap`, so `[0, n - first)` is too. The mapping outlives
        // `self` (contract of `new`). Positions `[head, head + n)` are within
        // `[head, tail + cap)`, which the protocol reserves to the producer: the consumer reads
        // them only after the `head` store below.
        unsafe {
            copy_in(self.data, off, &src[..first as usize]);
            copy_in(self.data, 0, &src[first as usize..n as usize]);
        }
        self.head += n;
        self.ctrl().head.head.store(self.head, Ordering::Release);
        Ok(n as usize)
    }

    /// Writes all of `src` or nothing (false: not enough room now).
    pub(crate) fn write_whole(&mut self, src: &[u8]) -> Result<bool, LinkError> {
        let len = src.len() as u64;
        if self.cap - (self.head - self.cached_tail) < len {
            self.reload_tail()?;
            if self.cap - (self.head - self.cached_tail) < len {
                return Ok(false);
            }
        }
        let n = self.write(src)?;
        debug_assert_eq!(n, src.len(), "room was checked");
        Ok(true)
    }

    /// Bytes ever written (the position after the last byte written).
    pub(crate) fn head(&self) -> u64 {
        self.head
    }

    /// Whether the consumer has consumed every byte before position `pos`.
    pub(crate) fn consumed_to(&mut self, pos: u64) -> Result<bool, LinkError> {
        if self.cached_tail < pos {
            self.reload_tail()?;
        }
        Ok(self.cached_tail >= pos)
    }

    /// Bytes written and not yet consumed, as of a fresh load of `tail`.
    pub(crate) fn in_flight(&mut self) -> Result<u64, LinkError> {
        self.reload_tail()?;
        Ok(self.head - self.cached_tail)
    }

    /// Marks the producer side closed (no more data will come).
    pub(crate) fn close(&self) {
        self.ctrl()
            .flags
            .producer_closed
            .store(1, Ordering::Release);
    }

    /// True once the consumer has closed its side (nothing written will be read).
    pub(crate) fn consumer_closed(&self) -> bool {
        self.ctrl().flags.consumer_closed.load(Ordering::Acquire) != 0
    }
}

impl Consumer {
    /// The consumer of a fresh ring (head = tail = 0).
    ///
    /// # Safety
    /// As [`Producer::new`], with "at most one `Consumer`".
    pub(crate) unsafe fn new(ctrl: NonNull<RingCtrl>, data: NonNull<u8>, cap: u64) -> Self {
        debug_assert!(cap.is_power_of_two());
        Consumer {
            ctrl,
            data,
            cap,
            tail: 0,
            cached_head: 0,
            cap_final: false,
        }
    }

    fn ctrl(&self) -> &RingCtrl {
        // SAFETY: `new`'s contract: the control block stays mapped while `self` lives, and it
        // is only accessed through atomics.
        unsafe { self.ctrl.as_ref() }
    }

    /// Loads the producer's `head` and checks it: it never goes back and never gets more
    /// than `cap` ahead of `tail`.
    fn reload_head(&mut self) -> Result<(), LinkError> {
        let h = self.ctrl().head.head.load(Ordering::Acquire);
        if !self.cap_final {
            // After the Acquire of `head`: a limit stored before it is seen ("Shrinking once").
            let l = self.ctrl().flags.limit.load(Ordering::Acquire);
            if l != 0 {
                if !l.is_power_of_two() || l > self.cap || self.tail > l {
                    return Err(LinkError::Protocol(format!(
                        "shared-memory ring: producer limit {l} with tail {} (capacity {})",
                        self.tail, self.cap
                    )));
                }
                self.cap = l;
                self.cap_final = true;
            } else if h > self.cap {
                // Wrapped at the full capacity: the producer can no longer shrink it.
                self.cap_final = true;
            }
        }
        if h < self.cached_head || h - self.tail > self.cap {
            return Err(LinkError::Protocol(format!(
                "shared-memory ring: producer head {h} outside [{}, {}] (capacity {})",
                self.cached_head,
                self.tail + self.cap,
                self.cap
            )));
        }
        self.cached_head = h;
        Ok(())
    }

    /// Bytes readable now, reloading `head` if the cached value says none.
    pub(crate) fn available(&mut self) -> Result<u64, LinkError> {
        if self.cached_head == self.tail {
            self.reload_head()?;
        }
        Ok(self.cached_head - self.tail)
    }

    /// Bytes readable as of a fresh load of `head`.
    pub(crate) fn pending(&mut self) -> Result<u64, LinkError> {
        self.reload_head()?;
        Ok(self.cached_head - self.tail)
    }

    /// Copies the next `dst.len()` bytes into `dst` without consuming them; false (and `dst`
    /// untouched) while fewer have arrived.
    pub(crate) fn peek(&mut self, dst: &mut [u8]) -> Result<bool, LinkError> {
        let want = dst.len() as u64;
        if self.cached_head - self.tail < want {
            self.reload_head()?;
            if self.cached_head - self.tail < want {
                return Ok(false);
            }
        }
        let mut got = 0u64;
        while got < want {
            let off = (self.tail + got) & (self.cap - 1);
            let len = (want - got).min(self.cap - off);
            let to = &mut dst[got as usize..(got + len) as usize];
            // SAFETY: as in `read`: `[off, off + len)` is inside the data area and holds
            // published bytes (`tail + want <= head`), not written again before `tail` passes
            // them.
            unsafe {
                offer(self.data, off, len, &mut |b| {
                    to.copy_from_slice(b);
                    0
                })
            };
            got += len;
        }
        Ok(true)
    }

    /// Consumes `n` bytes that [`peek`](Self::peek) saw (`n` at most what it saw).
    pub(crate) fn skip(&mut self, n: u64) {
        debug_assert!(self.tail + n <= self.cached_head, "skipping bytes not seen");
        self.tail += n;
        self.ctrl().tail.tail.store(self.tail, Ordering::Release);
    }

    /// Offers the readable bytes to `consume` (the part before the wrap, then the part after,
    /// stopping as soon as `consume` takes less than offered), frees what it took and returns
    /// that many.
    pub(crate) fn read(
        &mut self,
        consume: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<usize, LinkError> {
        let avail = self.available()?;
        let mut taken = 0u64;
        while taken < avail {
            let off = (self.tail + taken) & (self.cap - 1);
            let len = (avail - taken).min(self.cap - off);
            // SAFETY: `off < cap` and `len <= cap - off`: the region is inside the data area,
            // which stays mapped while `self` lives. Positions `[tail, head)` were published
            // by the producer's Release store of `head`, loaded with Acquire, and the
            // producer does not write them again until our `tail` store passes them.
            let took = (unsafe { offer(self.data, off, len, consume) } as u64).min(len);
            taken += took;
            if took < len {
                break;
            }
        }
        if taken > 0 {
            self.tail += taken;
            self.ctrl().tail.tail.store(self.tail, Ordering::Release);
        }
        Ok(taken as usize)
    }

    /// Marks the consumer side closed (nothing more will be read).
    pub(crate) fn close(&self) {
        self.ctrl()
            .flags
            .consumer_closed
            .store(1, Ordering::Release);
    }

    /// True once the producer has closed its side. Load it *before* draining: bytes written
    /// before the close are then visible.
    pub(crate) fn producer_closed(&self) -> bool {
        self.ctrl().flags.producer_closed.load(Ordering::Acquire) != 0
    }
}

#[cfg(all(test, not(loom)))]
pub(crate) mod tests {
    use super::*;
    use std::alloc::{alloc_zeroed, dealloc, Layout};

    /// A ring in ordinary heap memory, for tests.
    pub(crate) struct HeapRing {
        ptr: NonNull<u8>,
        layout: Layout,
        cap: u64,
    }

    // SAFETY: only raw memory; the tests synchronize through the ring protocol.
    unsafe impl Send for HeapRing {}
    // SAFETY: as above.
    unsafe impl Sync for HeapRing {}

    impl HeapRing {
        pub(crate) fn new(cap: u64) -> Self {
            let layout = Layout::from_size_align(LINE * 3 + cap as usize, LINE).unwrap();
            // SAFETY: non-zero size.
            let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).unwrap();
            HeapRing { ptr, layout, cap }
        }
        fn ctrl(&self) -> NonNull<RingCtrl> {
            self.ptr.cast()
        }
        fn data(&self) -> NonNull<u8> {
            // SAFETY: inside the allocation.
            unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(LINE * 3)) }
        }
        pub(crate) fn ends(&self) -> (Producer, Consumer) {
            // SAFETY: the allocation outlives the ends in every test (they are dropped first).
            unsafe {
                (
                    Producer::new(self.ctrl(), self.data(), self.cap),
                    Consumer::new(self.ctrl(), self.data(), self.cap),
                )
            }
        }
        fn ctrl_ref(&self) -> &RingCtrl {
            // SAFETY: valid allocation.
            unsafe { self.ctrl().as_ref() }
        }
    }

    impl Drop for HeapRing {
        fn drop(&mut self) {
            // SAFETY: allocated with this layout.
            unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
        }
    }

    fn read_all(c: &mut Consumer) -> (Vec<u8>, Vec<usize>) {
        let mut out = Vec::new();
        let mut calls = Vec::new();
        c.read(&mut |b| {
            calls.push(b.len());
            out.extend_from_slice(b);
            b.len()
        })
        .unwrap();
        (out, calls)
    }

    #[test]
    fn wrap_around() {
        let r = HeapRing::new(64);
        let (mut p, mut c) = r.ends();
        let a: Vec<u8> = (0..40).collect();
        assert_eq!(p.write(&a).unwrap(), 40);
        assert_eq!(read_all(&mut c), (a, vec![40]));
        let b: Vec<u8> = (100..150).collect();
        assert_eq!(p.write(&b).unwrap(), 50);
        let (got, calls) = read_all(&mut c);
        assert_eq!(got, b);
        assert_eq!(
            calls,
            vec![24, 26],
            "offered up to the wrap, then from the start"
        );
        // The bytes really landed on both sides of the wrap.
        // SAFETY: test-local memory, no concurrent writer.
        let first = unsafe { *r.data().as_ptr().add(40) };
        assert_eq!(first, 100);
    }

    #[test]
    fn exact_fill_and_oversized_write() {
        let r = HeapRing::new(64);
        let (mut p, mut c) = r.ends();
        let a: Vec<u8> = (0..200).map(|i| i as u8).collect();
        assert_eq!(
            p.write(&a).unwrap(),
            64,
            "a write larger than the ring fills it"
        );
        assert_eq!(p.write(&a[64..]).unwrap(), 0, "full");
        assert_eq!(p.in_flight().unwrap(), 64);
        assert_eq!(read_all(&mut c).0, &a[..64]);
        assert_eq!(
            p.write(&a[64..128]).unwrap(),
            64,
            "exactly the capacity fits again"
        );
        assert_eq!(read_all(&mut c).0, &a[64..128]);
        assert_eq!(c.read(&mut |b| b.len()).unwrap(), 0, "empty");
        assert_eq!(p.write(&[]).unwrap(), 0);
    }

    #[test]
    fn partial_consume() {
        let r = HeapRing::new(64);
        let (mut p, mut c) = r.ends();
        let a: Vec<u8> = (0..56).collect();
        p.write(&a).unwrap();
        read_all(&mut c);
        // Now 56 is the tail; write 30 bytes: 8 before the wrap, 22 after.
        let b: Vec<u8> = (0..30).map(|i| 200 - i).collect();
        assert_eq!(p.write(&b).unwrap(), 30);
        // Take 5 of the first 8: the second region must not be offered.
        let mut offers = 0;
        let took = c
            .read(&mut |x| {
                offers += 1;
                assert_eq!(x, &b[..8]);
                5
            })
            .unwrap();
        assert_eq!((took, offers), (5, 1));
        // Take the rest of the first region and 10 of the second.
        let mut seen = Vec::new();
        let took = c
            .read(&mut |x| {
                seen.push(x.to_vec());
                if x.len() == 3 {
                    3
                } else {
                    10
                }
            })
            .unwrap();
        assert_eq!(took, 13);
        assert_eq!(seen, vec![b[5..8].to_vec(), b[8..30].to_vec()]);
        // Consume claiming more than offered is clamped.
        let took = c.read(&mut |x| x.len() + 1000).unwrap();
        assert_eq!(took, 12);
        assert_eq!(p.in_flight().unwrap(), 0);
    }

    #[test]
    fn closed_flags() {
        let r = HeapRing::new(64);
        let (p, c) = r.ends();
        assert!(!c.producer_closed() && !p.consumer_closed());
        p.close();
        assert!(c.producer_closed());
        c.close();
        assert!(p.consumer_closed());
    }

    #[test]
    fn bogus_indices_are_protocol_errors() {
        let r = HeapRing::new(64);
        let (mut p, mut c) = r.ends();
        // Head more than a capacity ahead.
        r.ctrl_ref().head.head.store(65, Ordering::Relaxed);
        assert!(matches!(
            c.read(&mut |b| b.len()),
            Err(LinkError::Protocol(_))
        ));
        // Tail beyond head.
        p.write(&[0; 64]).unwrap();
        r.ctrl_ref().tail.tail.store(100, Ordering::Relaxed);
        assert!(matches!(p.write(&[1]), Err(LinkError::Protocol(_))));
        // Tail going back.
        r.ctrl_ref().tail.tail.store(64, Ordering::Relaxed);
        assert_eq!(p.write(&[1; 10]).unwrap(), 10);
        r.ctrl_ref().tail.tail.store(10, Ordering::Relaxed);
        assert!(matches!(p.write(&[1; 64]), Err(LinkError::Protocol(_))));
        // Head going back.
        let r = HeapRing::new(64);
        let (mut p, mut c) = r.ends();
        p.write(&[7; 20]).unwrap();
        c.read(&mut |_| 0).unwrap();
        r.ctrl_ref().head.head.store(5, Ordering::Relaxed);
        c.read(&mut |b| b.len()).unwrap(); // served from the cached head
        assert!(matches!(c.pending(), Err(LinkError::Protocol(_))));
    }

    /// Two threads, random write sizes and random partial consumption, every byte checked.
    #[test]
    fn threaded_spsc_random() {
        let r = std::sync::Arc::new(HeapRing::new(256));
        let (mut p, mut c) = r.ends();
        const TOTAL: u64 = 4 << 20;
        let t = std::thread::spawn(move || {
            let mut rng = 0x9e37_79b9_7f4a_7c15u64;
            let mut sent = 0u64;
            let mut buf = Vec::new();
            while sent < TOTAL {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let n = (rng % 700 + 1).min(TOTAL - sent);
                buf.clear();
                buf.extend((sent..sent + n).map(|i| (i * 31 % 251) as u8));
                let mut off = 0;
                while off < buf.len() {
                    let k = p.write(&buf[off..]).unwrap();
                    if k == 0 {
                        std::thread::yield_now();
                    }
                    off += k;
                }
                sent += n;
            }
            p
        });
        let mut got = 0u64;
        let mut rng = 12345u64;
        while got < TOTAL {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let limit = (rng % 300) as usize;
            let mut budget = limit;
            let k = c
                .read(&mut |b| {
                    let take = b.len().min(budget);
                    for (i, &x) in b[..take].iter().enumerate() {
                        assert_eq!(x, ((got + i as u64) * 31 % 251) as u8);
                    }
                    budget -= take;
                    got += take as u64;
                    take
                })
                .unwrap();
            if k == 0 {
                std::thread::yield_now();
            }
        }
        let mut p = t.join().unwrap();
        assert_eq!(p.in_flight().unwrap(), 0);
    }

    /// A ring shrunk in its first pass, while the consumer reads concurrently: every byte
    /// arrives in order and nothing beyond the new capacity is ever written; shrinking below
    /// what was written, to a non-power of two, or above the capacity is refused.
    #[test]
    fn a_ring_shrunk_in_its_first_pass_keeps_every_byte_and_its_bounds() {
        let r = std::sync::Arc::new(HeapRing::new(1024));
        // SAFETY: the data area has 1024 bytes; nobody else touches it yet.
        unsafe { std::ptr::write_bytes(r.data().as_ptr(), 0xEE, 1024) };
        let (mut p, mut c) = r.ends();
        const TOTAL: u64 = 1 << 20;
        let byte = |i: u64| (i * 31 % 251) as u8;
        let first: Vec<u8> = (0..100).map(byte).collect();
        assert_eq!(p.write(&first).unwrap(), 100);
        assert!(!p.limit_to(64), "100 bytes written: 64 would move them");
        assert!(!p.limit_to(192) && !p.limit_to(2048));
        let t = std::thread::spawn(move || {
            assert!(p.limit_to(128));
            assert_eq!(p.capacity(), 128);
            let mut sent = 100u64;
            let mut rng = 0x9e37_79b9_7f4a_7c15u64;
            while sent < TOTAL {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let n = (rng % 300 + 1).min(TOTAL - sent);
                let buf: Vec<u8> = (sent..sent + n).map(byte).collect();
                let mut off = 0;
                while off < buf.len() {
                    let k = p.write(&buf[off..]).unwrap();
                    if k == 0 {
                        std::thread::yield_now();
                    }
                    off += k;
                }
                sent += n;
            }
            p
        });
        let mut got = 0u64;
        while got < TOTAL {
            let k = c
                .read(&mut |b| {
                    for (i, &x) in b.iter().enumerate() {
                        assert_eq!(x, byte(got + i as u64), "byte {}", got + i as u64);
                    }
                    got += b.len() as u64;
                    b.len()
                })
                .unwrap();
            if k == 0 {
                std::thread::yield_now();
            }
        }
        let mut p = t.join().unwrap();
        assert_eq!(p.in_flight().unwrap(), 0);
        // SAFETY: both ends are idle; the area has 1024 bytes.
        let rest = unsafe { std::slice::from_raw_parts(r.data().as_ptr().add(128), 1024 - 128) };
        assert!(
            rest.iter().all(|&b| b == 0xEE),
            "bytes beyond the limit written"
        );
    }
}

/// Model checking of the index protocol with loom: every interleaving (up to a preemption
/// bound) of one producer and one consumer, with loom's cells standing in for the data
/// area so that an unsynchronized data access is reported as a race.
/// `RUSTFLAGS="--cfg loom" cargo test -p oxccl --lib --release --target-dir target/loom loom_`
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    struct LoomRing {
        ctrl: Box<RingCtrl>,
        data: Box<[UnsafeCell<u8>]>,
    }

    // SAFETY: accessed only through loom atomics and loom cells, which check the accesses.
    unsafe impl Send for LoomRing {}
    // SAFETY: as above.
    unsafe impl Sync for LoomRing {}

    impl LoomRing {
        fn new(cap: u64) -> Arc<Self> {
            Arc::new(LoomRing {
                ctrl: Box::new(RingCtrl::new()),
                data: (0..cap).map(|_| UnsafeCell::new(0)).collect(),
            })
        }
        fn ends(&self) -> (Producer, Consumer) {
            let ctrl = NonNull::from(&*self.ctrl);
            let data = NonNull::new(self.data.as_ptr() as *mut u8).unwrap();
            let cap = self.data.len() as u64;
            // SAFETY: the ring (kept alive by an Arc in each thread) outlives both ends.
            unsafe {
                (
                    Producer::new(ctrl, data, cap),
                    Consumer::new(ctrl, data, cap),
                )
            }
        }
    }

    /// The producer writes `total` bytes in writes of up to `chunk` and then closes; the
    /// consumer takes at most `take` bytes per call and must get every byte, in order, before
    /// it sees the close.
    fn model(cap: u64, total: u8, chunk: usize, take: usize) {
        model_shrunk(cap, total, chunk, take, None)
    }

    /// As [`model`]; with `shrink = Some((k, l))` the producer first writes `k` bytes whole,
    /// then shrinks the ring to `l` ([`Producer::limit_to`]) while the consumer reads.
    fn model_shrunk(cap: u64, total: u8, chunk: usize, take: usize, shrink: Option<(usize, u64)>) {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(move || {
            let ring = LoomRing::new(cap);
            let (mut p, mut c) = ring.ends();
            let r2 = ring.clone();
            let t = loom::thread::spawn(move || {
                let _keep = r2;
                let src: Vec<u8> = (1..=total).collect();
                let mut sent = 0;
                if let Some((k, l)) = shrink {
                    assert_eq!(p.write(&src[..k]).unwrap(), k);
                    sent = k;
                    assert!(p.limit_to(l));
                }
                while sent < src.len() {
                    let end = (sent + chunk).min(src.len());
                    let n = p.write(&src[sent..end]).unwrap();
                    if n == 0 {
                        loom::thread::yield_now();
                    }
                    sent += n;
                }
                p.close();
            });
            let mut got = Vec::new();
            loop {
                let closed = c.producer_closed();
                let n = c
                    .read(&mut |b| {
                        let k = b.len().min(take);
                        got.extend_from_slice(&b[..k]);
                        k
                    })
                    .unwrap();
                if n == 0 {
                    if closed {
                        break;
                    }
                    loom::thread::yield_now();
                }
            }
            assert_eq!(got, (1..=total).collect::<Vec<u8>>());
            t.join().unwrap();
        });
    }

    #[test]
    fn loom_ring_wraps_with_partial_consume() {
        model(4, 7, 3, 2);
    }

    #[test]
    fn loom_ring_exact_fill() {
        model(2, 5, 2, 2);
    }

    #[test]
    fn loom_ring_shrunk_while_read() {
        model_shrunk(8, 6, 2, 1, Some((2, 2)));
    }
}
