//! One call's waiting discipline ([`Waiter`]: spin, sleep in slices, check the deadline and
//! the peers between slices) and the sleep on sockets ([`poll_fds`]).

use std::os::fd::{BorrowedFd, RawFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

use super::spin::{Backoff, Spin};
use crate::base::error::{Error, Result};

/// How long one sleep lasts at most before a waiting call re-checks its deadline and that the
/// peers it waits for are alive.
pub(crate) const SLEEP_SLICE: Duration = Duration::from_millis(50);

/// How long a short sleep lasts: polling sockets while a doorbell is awaited too, or waiting
/// with nothing to sleep on.
pub(crate) const NAP: Duration = Duration::from_micros(200);

/// Which call waits: what the errors a wait ends with name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallId {
    /// This rank.
    pub rank: usize,
    /// The call's name.
    pub call: &'static str,
    /// The call's sequence number.
    pub seq: u64,
}

/// One call's waiting discipline, the same in every executor: spin ([`Backoff`]), then sleep
/// in slices of at most [`SLEEP_SLICE`]; between slices, once a slice has passed, the liveness
/// of the peers still awaited (a probe the caller passes) and the call's deadline.
///
/// The fast path costs what a bare [`Backoff`] does: no allocation, no clock read until the
/// spin budget of a wait is spent, no dynamic dispatch (the probe is a generic closure).
#[derive(Debug)]
pub(crate) struct Waiter {
    backoff: Backoff,
    /// The policy each wait starts with ([`rearm`](Self::rearm)).
    base: Spin,
    timeout: Duration,
    id: CallId,
    /// When the call started, for its deadline (`None`: not yet; it starts the first time
    /// the call sleeps).
    start: Option<Instant>,
    /// When this wait last checked (`None`: its spinning is not over yet).
    last_check: Option<Instant>,
    /// The call's hold on the fork gate ([`crate::base::fork_gate`]), let go of at each round
    /// of a wait.
    _busy: crate::base::fork_gate::Busy,
}

impl Waiter {
    /// A waiter for call `id`, spinning by `spin`, that fails the call once `timeout` has
    /// passed since it started: since now if `started`, else since its first sleep (a call
    /// done within its spin budget never reads the clock).
    pub(crate) fn new(id: CallId, spin: Spin, timeout: Duration, started: bool) -> Waiter {
        Waiter {
            backoff: Backoff::new(spin),
            base: spin,
            timeout,
            id,
            start: started.then(Instant::now),
            last_check: None,
            _busy: crate::base::fork_gate::Busy::enter(),
        }
    }

    /// The call this waiter waits for.
    pub(crate) fn id(&self) -> CallId {
        self.id
    }

    /// Begins another wait of the same call (the next event): spinning again, checking a
    /// slice after its first sleep; the deadline stays the call's.
    pub(crate) fn rearm(&mut self) {
        self.backoff = Backoff::new(self.base);
        self.last_check = None;
    }

    /// As [`rearm`](Self::rearm), spinning by `spin` from now on (the next step, whose links
    /// may all be sockets: [`Spin::for_sockets`]).
    pub(crate) fn rearm_spinning(&mut self, spin: Spin) {
        self.base = spin;
        self.rearm();
    }

    /// The policy each wait starts with.
    pub(crate) fn base(&self) -> Spin {
        self.base
    }

    /// Spins by `spin` for the rest of this wait only (the next [`rearm`](Self::rearm)
    /// returns to [`base`](Self::base)), counting afresh.
    pub(crate) fn spin_this_wait(&mut self, spin: Spin) {
        self.backoff = Backoff::new(spin);
    }

    /// What is left of the call's time: all of it while the call has not slept yet (its
    /// deadline counts from its first sleep).
    pub(crate) fn remaining(&self) -> Duration {
        self.timeout
            .saturating_sub(self.start.map_or(Duration::ZERO, |s| s.elapsed()))
    }

    /// Call after a round that made progress: spin afresh.
    #[inline]
    pub(crate) fn progressed(&mut self) {
        self.backoff.reset();
    }

    /// Call after a round without progress. True: spin on (the round spun or yielded);
    /// false: the spin budget is spent, sleep (and then [`check`](Self::check)).
    #[inline]
    pub(crate) fn spin(&mut self) -> bool {
        crate::base::fork_gate::pause_point();
        if !self.backoff.should_sleep() {
            return true;
        }
        if self.last_check.is_none() {
            let now = Instant::now();
            self.start.get_or_insert(now);
            self.last_check = Some(now);
        }
        false
    }

    /// After a sleep: once a slice has passed since the last check, runs `probe` on the peers
    /// still awaited (`waiting()`, computed only then; an error from the probe ends the wait),
    /// then fails the call with [`Error::Timeout`] if its deadline has passed.
    pub(crate) fn check(
        &mut self,
        waiting: impl FnOnce() -> Vec<usize>,
        probe: impl FnOnce(&[usize]) -> Result<()>,
    ) -> Result<()> {
        crate::base::fork_gate::pause_point();
        let now = Instant::now();
        let last = *self.last_check.get_or_insert(now);
        if now.duration_since(last) < SLEEP_SLICE {
            return Ok(());
        }
        self.last_check = Some(now);
        let waiting = waiting();
        probe(&waiting)?;
        let elapsed = self.start.get_or_insert(now).elapsed();
        if elapsed > self.timeout {
            return Err(self.timed_out(waiting, elapsed));
        }
        Ok(())
    }

    /// The error of a call whose deadline passed while it waited for `waiting_on`.
    fn timed_out(&self, mut waiting_on: Vec<usize>, elapsed: Duration) -> Error {
        waiting_on.sort_unstable();
        waiting_on.dedup();
        Error::Timeout {
            rank: self.id.rank,
            call: self.id.call,
            seq: self.id.seq,
            waiting_on,
            elapsed,
        }
    }
}

/// Sleeps in `poll(2)` until one of `fds` is ready or `timeout` passes (a signal counts as
/// a wake-up): the socket half of the executors' waits. `Ok(())` says nothing about which fd
/// is ready; the caller retries its transfers.
///
/// # Safety
///
/// Every fd in `fds` must be open for the whole call (the executors pass the fds of links
/// and health state they borrow for the call).
pub(crate) unsafe fn poll_fds(
    fds: &[(RawFd, PollFlags)],
    timeout: Duration,
) -> rustix::io::Result<()> {
    // SAFETY: the caller keeps every fd open for this call.
    let borrowed: Vec<BorrowedFd<'_>> = fds
        .iter()
        .map(|(fd, _)| unsafe { BorrowedFd::borrow_raw(*fd) })
        .collect();
    let mut pfds: Vec<PollFd<'_>> = borrowed
        .iter()
        .zip(fds)
        .map(|(fd, (_, fl))| PollFd::from_borrowed_fd(*fd, *fl))
        .collect();
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    match crate::base::fork_gate::asleep(|| rustix::event::poll(&mut pfds, Some(&ts))) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waits_own_spinning_lasts_that_wait_only() {
        let id = CallId {
            rank: 0,
            call: "test",
            seq: 1,
        };
        let mut w = Waiter::new(id, Spin::new(3), Duration::from_secs(1), false);
        w.spin_this_wait(Spin::new(1));
        assert!(w.spin());
        assert!(!w.spin(), "one round of this wait's budget");
        w.rearm();
        assert_eq!(w.base(), Spin::new(3));
        assert!(
            w.spin() && w.spin() && w.spin() && !w.spin(),
            "the base budget again"
        );
        w.rearm_spinning(Spin::new(1));
        w.rearm();
        assert!(w.spin() && !w.spin(), "rearm_spinning sets the base");
    }

    #[test]
    fn waiter_checks_after_a_slice_and_times_out_naming_the_awaited_peers() {
        let id = CallId {
            rank: 3,
            call: "all_reduce",
            seq: 7,
        };
        let mut w = Waiter::new(id, Spin::new(2), Duration::ZERO, false);
        assert!(w.spin() && w.spin(), "spins its budget first");
        assert!(!w.spin(), "then sleeps");
        let mut probed = 0;
        // Within the first slice: neither the probe nor the deadline.
        w.check(
            || vec![1],
            |_| {
                probed += 1;
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(probed, 0);
        std::thread::sleep(SLEEP_SLICE);
        let err = w
            .check(
                || vec![5, 1, 5],
                |peers| {
                    assert_eq!(peers, &[5, 1, 5]);
                    probed += 1;
                    Ok(())
                },
            )
            .unwrap_err();
        assert_eq!(probed, 1);
        match err {
            Error::Timeout {
                rank,
                call,
                seq,
                waiting_on,
                ..
            } => assert_eq!(
                (rank, call, seq, waiting_on),
                (3, "all_reduce", 7, vec![1, 5])
            ),
            e => panic!("expected a timeout, got {e}"),
        }
        // A probe's error ends the wait before the deadline is looked at.
        w.rearm();
        assert!(w.spin() && w.spin() && !w.spin());
        std::thread::sleep(SLEEP_SLICE);
        let err = w
            .check(
                || vec![2],
                |_| {
                    Err(Error::Aborted {
                        rank: 3,
                        msg: "peer 2 lost".into(),
                    })
                },
            )
            .unwrap_err();
        assert!(err.to_string().contains("peer 2 lost"), "{err}");
    }
}
