//! Per-link counters for the status agent: bytes sent and received on a link and when bytes
//! last moved on it, kept by a thin [`Link`] wrapper ([`Counted`]) so that no transport has
//! to count for itself.
//!
//! The counters are relaxed atomics written only by the thread that drives the link and read
//! by the status agent: a few nanoseconds per transfer that moved bytes (the clock is the
//! coarse monotonic one, a vDSO read), nothing on a transfer that moved none. One-shot and
//! single-copy calls through the direct area (`crate::direct`) do not use links and are not
//! counted here.
//!
//! ```
//! use oxccl::testing::transport::{counted, mem, Link};
//! let mut g = mem::group(2, 1024).into_iter();
//! let a = g.next().unwrap().pop().unwrap().1;
//! let b = g.next().unwrap().pop().unwrap().1;
//! let (mut a, sa) = counted(a);
//! let (mut b, sb) = counted(b);
//! assert_eq!(a.try_send(b"hello").unwrap(), 5);
//! let mut got = [0u8; 8];
//! assert_eq!(b.try_recv_into(&mut got).unwrap(), 5);
//! assert_eq!((sa.sent(), sb.received()), (5, 5));
//! assert!(sa.last_progress_ms_ago().is_some());
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Link, LinkError, TransportKind, WaitSource};

/// Counters of one link, shared with the status agent.
#[derive(Debug, Default)]
pub struct LinkStats {
    sent: AtomicU64,
    received: AtomicU64,
    /// Coarse monotonic time of the last transfer that moved bytes, in ms (0: never).
    last_ms: AtomicU64,
}

/// The coarse monotonic clock in ms, never 0.
fn now_ms() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    (t.tv_sec as u64)
        .saturating_mul(1000)
        .saturating_add(t.tv_nsec as u64 / 1_000_000)
        .max(1)
}

impl LinkStats {
    /// Bytes this rank has handed to the link.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Bytes this rank has taken from the link.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// How long ago bytes last moved on the link in either direction, in ms; `None` if never.
    pub fn last_progress_ms_ago(&self) -> Option<u64> {
        match self.last_ms.load(Ordering::Relaxed) {
            0 => None,
            t => Some(now_ms().saturating_sub(t)),
        }
    }

    fn add_sent(&self, n: usize) {
        if n > 0 {
            self.sent.fetch_add(n as u64, Ordering::Relaxed);
            self.last_ms.store(now_ms(), Ordering::Relaxed);
        }
    }

    fn add_received(&self, n: usize) {
        if n > 0 {
            self.received.fetch_add(n as u64, Ordering::Relaxed);
            self.last_ms.store(now_ms(), Ordering::Relaxed);
        }
    }
}

/// A link that counts what moves through it into a [`LinkStats`].
pub(crate) struct Counted {
    inner: Box<dyn Link>,
    stats: Arc<LinkStats>,
}

/// Wraps `link` so that it counts; returns the wrapped link and its counters.
pub fn counted(link: Box<dyn Link>) -> (Box<dyn Link>, Arc<LinkStats>) {
    let stats = Arc::new(LinkStats::default());
    (counted_into(link, stats.clone()), stats)
}

/// Wraps `link` so that it counts into `stats`, counters made before the link (a TCP link
/// made on first use, whose counters the status agent holds since init).
pub(crate) fn counted_into(link: Box<dyn Link>, stats: Arc<LinkStats>) -> Box<dyn Link> {
    Box::new(Counted { inner: link, stats })
}

impl Link for Counted {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize, LinkError> {
        let k = self.inner.try_send(data)?;
        self.stats.add_sent(k);
        Ok(k)
    }

    fn try_recv(&mut self, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize, LinkError> {
        let k = self.inner.try_recv(consume)?;
        self.stats.add_received(k);
        Ok(k)
    }

    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize, LinkError> {
        let k = self.inner.try_recv_into(dst)?;
        self.stats.add_received(k);
        Ok(k)
    }

    fn single_copy(&self, send: bool, len: usize) -> bool {
        self.inner.single_copy(send, len)
    }

    fn try_lend(&mut self, src: &[u8]) -> Result<bool, LinkError> {
        let done = self.inner.try_lend(src)?;
        if done {
            // The peer has copied all of it: count the loan as sent once it completes.
            self.stats.add_sent(src.len());
        }
        Ok(done)
    }

    fn try_copy_lent(&mut self, len: usize, off: usize, dst: &mut [u8]) -> Result<bool, LinkError> {
        let done = self.inner.try_copy_lent(len, off, dst)?;
        if done {
            self.stats.add_received(dst.len());
        }
        Ok(done)
    }

    fn withdraw(&mut self) {
        self.inner.withdraw()
    }

    fn send_wait(&self) -> WaitSource<'_> {
        self.inner.send_wait()
    }

    fn recv_wait(&self) -> WaitSource<'_> {
        self.inner.recv_wait()
    }

    fn check_alive(&mut self) -> Result<(), LinkError> {
        self.inner.check_alive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_both_directions_and_only_moved_bytes() {
        let mut g = crate::transport::mem::group(2, 1024).into_iter();
        let a = g.next().unwrap().pop().unwrap().1;
        let b = g.next().unwrap().pop().unwrap().1;
        let (mut a, sa) = counted(a);
        let (mut b, sb) = counted(b);
        assert_eq!(sa.last_progress_ms_ago(), None);
        assert_eq!(a.try_send(&[]).unwrap(), 0);
        assert_eq!(
            sa.last_progress_ms_ago(),
            None,
            "an empty send is no progress"
        );
        assert_eq!(a.try_send(&[7u8; 100]).unwrap(), 100);
        let mut taken = 0;
        let k = b
            .try_recv(&mut |d| {
                taken += d.len().min(60);
                d.len().min(60)
            })
            .unwrap();
        assert_eq!(k, 60);
        let mut rest = [0u8; 64];
        assert_eq!(b.try_recv_into(&mut rest).unwrap(), 40);
        assert_eq!((sa.sent(), sa.received()), (100, 0));
        assert_eq!((sb.sent(), sb.received()), (0, 100));
        assert!(sb.last_progress_ms_ago().unwrap() < 60_000);
        assert_eq!(b.kind(), TransportKind::Mem);
    }
}
