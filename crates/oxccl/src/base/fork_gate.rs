//! The fork gate of this process's own threads: lets `fork` copy the shared buffers (see
//! `direct::shared_buffer`) while no thread of this process is writing into them.
//!
//! A thread inside a call holds the gate (a [`Busy`]; the call's waiter holds one) and lets
//! go of it at every point where it only waits ([`pause_point`]: each round of a wait;
//! [`asleep`]: each sleep).
//! [`close`] (the fork's `prepare`) marks the gate closed and waits until every thread
//! inside a call is at such a point (or outside a call); a thread that reaches a pause
//! point or starts a call while the gate is closed waits there until [`open`]. So the
//! snapshot a fork takes holds no half-written chunk of a call of this process, and no
//! later write of one. (The peers' writes into this process's buffers have a gate of their
//! own, in the direct area: `direct::shm`.)
//!
//! The cost when no fork runs: one relaxed load per wait round, and an atomic add and
//! subtract per call.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Set from [`close`] to [`open`].
static CLOSED: AtomicBool = AtomicBool::new(false);
/// Threads inside a call and not at a pause point.
static BUSY: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// How many [`Busy`] this thread holds (nested waiters count once).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Waits while the gate is closed.
#[cold]
fn wait_open() {
    while CLOSED.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Counts this thread busy, once the gate is open.
fn acquire() {
    loop {
        BUSY.fetch_add(1, Ordering::SeqCst);
        if !CLOSED.load(Ordering::SeqCst) {
            return;
        }
        BUSY.fetch_sub(1, Ordering::SeqCst);
        wait_open();
    }
}

/// This thread is inside a call (may write into shared buffers) while it lives. Not `Send`:
/// it counts for the thread that made it.
#[derive(Debug)]
pub(crate) struct Busy(std::marker::PhantomData<*const ()>);

impl Busy {
    /// Enters (waiting while a fork copies the shared buffers).
    pub(crate) fn enter() -> Busy {
        DEPTH.with(|d| {
            if d.get() == 0 {
                acquire();
            }
            d.set(d.get() + 1);
        });
        Busy(std::marker::PhantomData)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        DEPTH.with(|d| {
            d.set(d.get() - 1);
            if d.get() == 0 {
                BUSY.fetch_sub(1, Ordering::SeqCst);
            }
        });
    }
}

/// A point inside a call where this thread writes nothing (it waits for peers): a fork in
/// progress may copy the shared buffers now; this returns once it is done.
#[inline]
pub(crate) fn pause_point() {
    if CLOSED.load(Ordering::Relaxed) {
        pause();
    }
}

#[cold]
fn pause() {
    if DEPTH.with(|d| d.get()) == 0 {
        return;
    }
    BUSY.fetch_sub(1, Ordering::SeqCst);
    wait_open();
    acquire();
}

/// Runs `sleep` (a blocking wait: a futex, `poll`) with this thread counted out of its call,
/// if it is in one: a fork may copy the shared buffers meanwhile, and a thread woken while it
/// does (a peer's event rang its doorbell) waits here until it is done before it goes on.
#[inline]
pub(crate) fn asleep<R>(sleep: impl FnOnce() -> R) -> R {
    if DEPTH.with(|d| d.get()) == 0 {
        return sleep();
    }
    BUSY.fetch_sub(1, Ordering::SeqCst);
    let r = sleep();
    acquire();
    r
}

/// Closes the gate and waits until no thread of this process is inside a call outside a
/// pause point; false if some still is after `bound` (a call that writes for that long
/// without waiting, or the forking thread itself inside a call): the gate stays closed.
pub(crate) fn close(bound: Duration) -> bool {
    CLOSED.store(true, Ordering::SeqCst);
    let start = Instant::now();
    while BUSY.load(Ordering::SeqCst) != 0 {
        if start.elapsed() > bound {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

/// Opens the gate (in the parent after `fork`, and in the child, whose copy of it is its
/// own).
pub(crate) fn open() {
    CLOSED.store(false, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    /// In a forked child, alone with the gate (other tests of this process fork and close it).
    fn held_while_closed() -> i32 {
        let stage = Arc::new(AtomicU64::new(0));
        let s = stage.clone();
        let t = std::thread::spawn(move || {
            let _b = Busy::enter();
            s.store(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(100)); // "writing"
            s.store(2, Ordering::SeqCst);
            pause_point();
            s.store(3, Ordering::SeqCst);
            asleep(|| std::thread::sleep(Duration::from_millis(100)));
            s.store(4, Ordering::SeqCst);
        });
        while stage.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        if !close(Duration::from_secs(10)) {
            return 2;
        }
        if stage.load(Ordering::SeqCst) != 2 {
            return 3; // closed while the thread was writing
        }
        std::thread::sleep(Duration::from_millis(20));
        if stage.load(Ordering::SeqCst) != 2 {
            return 4; // the thread went on while closed
        }
        open();
        while stage.load(Ordering::SeqCst) != 3 {
            std::thread::yield_now();
        }
        // Asleep: out of its call, so the gate closes at once; woken, it waits for `open`.
        if !close(Duration::from_millis(50)) {
            return 5;
        }
        std::thread::sleep(Duration::from_millis(200));
        if stage.load(Ordering::SeqCst) != 3 {
            return 6; // it went on after its sleep while closed
        }
        open();
        if t.join().is_err() || stage.load(Ordering::SeqCst) != 4 {
            return 7;
        }
        0
    }

    #[test]
    fn close_waits_for_a_busy_thread_to_pause_and_holds_it_there() {
        // SAFETY: the child runs `held_while_closed` (its own thread and statics) and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let code = std::panic::catch_unwind(held_while_closed).unwrap_or(9);
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "the child died of a signal");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "2: not closed in time, 3: closed while writing, 4: went on while closed, 5: a \
             sleeping thread held the gate, 6: went on after its sleep while closed, 7: did \
             not end"
        );
    }
}
