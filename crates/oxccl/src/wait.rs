//! Waiting without burning a core: spin briefly, then sleep on a futex ("doorbell") or on
//! sockets.
//!
//! A [`Doorbell`] is an event count in memory that may be shared between processes (a
//! shared-memory segment) or private (the in-memory transport). A rank owns one doorbell;
//! every peer that makes progress that rank may be waiting for (writes data into a ring the
//! rank reads, or frees space in a ring the rank writes) calls [`Doorbell::ring`]. A waiter
//! calls [`Doorbell::prepare`], re-checks its condition, then [`Doorbell::wait`]: the futex
//! only sleeps if nobody rang in between, so no wake-up is lost.
//!
//! Correctness argument (a Dekker handshake; every access below is `SeqCst` or separated by a
//! `SeqCst` fence): the waiter does `sleepers += 1`, fence, reads `seq`, then checks its
//! condition; the ringer publishes its data, fence, then reads `sleepers`, and only if it is
//! non-zero does `seq += 1` and `futex_wake`. The two fences order the two store-then-load
//! pairs, so at least one side sees the other's store: either the ringer sees a sleeper (and
//! bumps `seq` and wakes it: the waiter's `futex_wait(seq, old)` sees the changed value or is
//! woken), or the waiter's re-check sees the published data and it does not sleep. A ringer
//! with nobody asleep writes nothing to the shared line: one fence and one load.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use rustix::thread::futex;

/// An event count used to sleep until a peer makes progress. `repr(C)` so that it can live in
/// shared memory at a fixed layout.
#[repr(C)]
#[derive(Debug, Default)]
pub struct Doorbell {
    seq: AtomicU32,
    sleepers: AtomicU32,
}

/// What [`Doorbell::prepare`] returns: the count seen before re-checking the condition.
#[derive(Debug, Clone, Copy)]
#[must_use = "pass the token to Doorbell::wait or Doorbell::cancel"]
pub struct DoorbellToken(u32);

impl Doorbell {
    /// A new doorbell (all zero, which is also the state of fresh shared memory).
    pub const fn new() -> Self {
        Doorbell {
            seq: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
        }
    }

    /// Signals progress (to be called after publishing it); wakes the owner if it sleeps.
    /// Cheap when nobody sleeps: one fence and one load, no write, no system call.
    pub fn ring(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            self.seq.fetch_add(1, Ordering::SeqCst);
            // Errors from futex_wake cannot be acted upon (the memory is valid while `self`
            // is borrowed); a lost wake-up is bounded by the waiter's timeout slice.
            let _ = futex::wake(&self.seq, futex::Flags::empty(), i32::MAX as u32);
        }
    }

    /// Announces that the caller is about to sleep; call before re-checking the condition.
    pub fn prepare(&self) -> DoorbellToken {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        DoorbellToken(self.seq.load(Ordering::SeqCst))
    }

    /// Withdraws a [`prepare`](Self::prepare) without sleeping (the condition held).
    pub fn cancel(&self, _token: DoorbellToken) {
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Sleeps until the doorbell rings after `token` was taken, or `timeout` passes, or a
    /// spurious wake-up. The caller re-checks its condition afterwards either way.
    pub fn wait(&self, token: DoorbellToken, timeout: Duration) {
        let ts = rustix::time::Timespec {
            tv_sec: timeout.as_secs() as _,
            tv_nsec: timeout.subsec_nanos() as _,
        };
        // EAGAIN (value changed), ETIMEDOUT and EINTR all mean "re-check": ignore them.
        let _ = futex::wait(&self.seq, futex::Flags::empty(), token.0, Some(&ts));
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How long to spin before sleeping, shared by every wait loop.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    spins: u32,
    budget: u32,
}

impl Backoff {
    /// A backoff that spins `budget` rounds (a round is a cheap progress check) before
    /// [`should_sleep`](Self::should_sleep) says yes. Every 64 rounds it yields the core.
    pub fn new(budget: u32) -> Self {
        Backoff { spins: 0, budget }
    }

    /// Call after a round that made progress.
    pub fn reset(&mut self) {
        self.spins = 0;
    }

    /// Call after a round without progress. Returns true once the spin budget is spent.
    pub fn should_sleep(&mut self) -> bool {
        if self.spins >= self.budget {
            return true;
        }
        self.spins += 1;
        if self.spins % 64 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn ring_wakes_sleeper() {
        let bell = Arc::new(Doorbell::new());
        let flag = Arc::new(AtomicBool::new(false));
        let (b2, f2) = (bell.clone(), flag.clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            f2.store(true, Ordering::SeqCst);
            b2.ring();
        });
        let start = Instant::now();
        while !flag.load(Ordering::SeqCst) {
            let tok = bell.prepare();
            if flag.load(Ordering::SeqCst) {
                bell.cancel(tok);
                break;
            }
            bell.wait(tok, Duration::from_secs(10));
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "woken by the ring, not the timeout"
        );
        t.join().unwrap();
    }

    #[test]
    fn wait_times_out_without_ring() {
        let bell = Doorbell::new();
        let start = Instant::now();
        let tok = bell.prepare();
        bell.wait(tok, Duration::from_millis(20));
        assert!(start.elapsed() >= Duration::from_millis(15));
        assert_eq!(bell.sleepers.load(Ordering::SeqCst), 0);
    }
}
