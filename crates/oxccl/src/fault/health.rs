//! A communicator's health: whether it has failed, why, and how to wake a call that sleeps.
//!
//! One [`Health`] is shared by a communicator's calls, its watchdog ([`crate::fault::control`]) and
//! [`Communicator::abort`](crate::Communicator::abort). The first failure wins and is kept;
//! setting it wakes a call blocked in the executor, whether it sleeps on a futex doorbell
//! (the doorbell it sleeps on is registered here while it sleeps, and rung) or in `poll(2)`
//! (an eventfd of this struct is in every poll set). A call checks [`Health::is_failed`] when
//! it starts (one atomic load) and whenever it is about to sleep.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Weak};

use crate::base::error::{Error, FailureKind};
use crate::base::wait::Doorbell;

/// Why a communicator failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// A peer is gone (seen here, or reported by the watchdog).
    Lost {
        /// The lost rank.
        peer: usize,
        /// How it was seen.
        reason: String,
    },
    /// Another rank failed and said so.
    Remote {
        /// The rank that failed.
        origin: usize,
        /// Its kind of failure.
        kind: FailureKind,
        /// Its error.
        msg: String,
    },
    /// This rank failed in a call (the error was returned there).
    Local {
        /// The error.
        msg: String,
    },
    /// [`abort`](crate::Communicator::abort) was called.
    Aborted {
        /// Why.
        msg: String,
    },
}

/// Shared failure state; see the module documentation.
#[derive(Debug)]
pub struct Health {
    failed: AtomicBool,
    why: Mutex<Option<Failure>>,
    /// Every rank a [`Failure::Lost`] named, the first failure or a later one.
    lost: Mutex<Vec<usize>>,
    /// The doorbell a call sleeps on now (0: none), rung by [`Health::fail`].
    sleeping_on: Mutex<usize>,
    /// Readable once failed: in every `poll(2)` set of the executor.
    event: Option<OwnedFd>,
    /// Where the first failure is passed on ([`Health::pass_on`]).
    dependents: Dependents,
}

/// Maps a failure of one communicator to the failure of a dependent one, if it concerns it.
pub(crate) type MapFailure = Box<dyn Fn(&Failure) -> Option<Failure> + Send + Sync>;

/// The communicators a [`Health`]'s failures are passed on to.
#[derive(Default)]
struct Dependents(Mutex<Vec<(Weak<Health>, MapFailure)>>);

impl std::fmt::Debug for Dependents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |v| v.len());
        write!(f, "Dependents({n})")
    }
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

impl Health {
    /// A healthy state.
    pub fn new() -> Health {
        let event = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .ok();
        Health {
            failed: AtomicBool::new(false),
            why: Mutex::new(None),
            lost: Mutex::new(Vec::new()),
            sleeping_on: Mutex::new(0),
            event,
            dependents: Dependents::default(),
        }
    }

    /// True once any failure was recorded.
    #[inline]
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Records `f` unless a failure is already recorded, and wakes any sleeping call.
    /// Returns true if `f` is the first failure.
    pub fn fail(&self, f: Failure) -> bool {
        if let Failure::Lost { peer, .. } = f {
            let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
            if !lost.contains(&peer) {
                lost.push(peer);
            }
        }
        let first = {
            let mut w = self.why.lock().unwrap_or_else(|e| e.into_inner());
            if w.is_some() {
                false
            } else {
                *w = Some(f);
                true
            }
        };
        self.failed.store(true, Ordering::SeqCst);
        self.wake();
        if first {
            let deps =
                std::mem::take(&mut *self.dependents.0.lock().unwrap_or_else(|e| e.into_inner()));
            if let Some(why) = self.failure() {
                for (h, map) in deps {
                    if let (Some(h), Some(f)) = (h.upgrade(), map(&why)) {
                        h.fail(f);
                    }
                }
            }
        }
        first
    }

    /// Passes this communicator's first failure on to `to` (a communicator split from it), as
    /// `map` makes it (`None`: it does not concern `to`); at once if it has failed already.
    /// Entries of dropped communicators are forgotten.
    pub(crate) fn pass_on(&self, to: Weak<Health>, map: MapFailure) {
        let mut deps = self.dependents.0.lock().unwrap_or_else(|e| e.into_inner());
        // (`fail` records the failure before it takes the list: either it finds this entry,
        // or the failure is seen here.)
        if let Some(why) = self.failure() {
            drop(deps);
            if let (Some(h), Some(f)) = (to.upgrade(), map(&why)) {
                h.fail(f);
            }
            return;
        }
        deps.retain(|(h, _)| h.strong_count() > 0);
        deps.push((to, map));
    }

    /// True once a failure named `peer` lost, whether or not it was the first: a later one
    /// (a second rank stopped) is not the communicator's failure, but it is known lost.
    pub(crate) fn is_lost(&self, peer: usize) -> bool {
        self.lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&peer)
    }

    /// True when [`abort`](crate::Communicator::abort) was called here.
    pub fn is_aborted(&self) -> bool {
        self.is_failed() && matches!(self.failure(), Some(Failure::Aborted { .. }))
    }

    /// The recorded failure.
    pub fn failure(&self) -> Option<Failure> {
        self.why.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Wakes a call sleeping in the executor (it then sees [`is_failed`](Self::is_failed)).
    pub fn wake(&self) {
        if let Some(fd) = &self.event {
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
        let bell = self.sleeping_on.lock().unwrap_or_else(|e| e.into_inner());
        if *bell != 0 {
            // SAFETY: the pointer is registered by `sleep_on` only while the doorbell is
            // alive (the executor's links outlive the registration, which it clears under
            // this lock before returning).
            unsafe { (*(*bell as *const Doorbell)).ring() };
        }
    }

    /// Registers the doorbell the executor is about to sleep on; `None` clears it.
    pub(crate) fn sleep_on(&self, bell: Option<&Doorbell>) {
        *self.sleeping_on.lock().unwrap_or_else(|e| e.into_inner()) =
            bell.map_or(0, |b| b as *const Doorbell as usize);
    }

    /// Registers `bell` (rung on failure) until the returned guard is dropped.
    pub(crate) fn sleeping_on<'h>(&'h self, bell: &'h Doorbell) -> SleepRegistration<'h> {
        self.sleep_on(Some(bell));
        SleepRegistration(self)
    }

    /// A descriptor that becomes readable when the communicator fails.
    pub fn poll_fd(&self) -> Option<BorrowedFd<'_>> {
        self.event.as_ref().map(|f| f.as_fd())
    }

    /// The error a call (`call`, number `seq`, on `rank`) returns because of the recorded
    /// failure.
    pub fn error(&self, rank: usize, call: &'static str, seq: u64) -> Error {
        match self.failure() {
            Some(Failure::Lost { peer, reason }) => Error::PeerLost {
                rank,
                peer,
                call,
                seq,
                reason,
            },
            Some(Failure::Remote { origin, kind, msg }) => Error::Remote {
                rank,
                call,
                seq,
                origin,
                kind,
                msg,
            },
            Some(Failure::Local { msg }) => Error::Aborted {
                rank,
                msg: format!("{call} (call #{seq}) after an earlier failure: {msg}"),
            },
            Some(Failure::Aborted { msg }) => Error::Aborted {
                rank,
                msg: format!("{call} (call #{seq}): {msg}"),
            },
            None => Error::Aborted {
                rank,
                msg: format!("{call} (call #{seq}): communicator failed"),
            },
        }
    }
}

/// While alive, failures ring the doorbell given to [`Health::sleeping_on`].
pub(crate) struct SleepRegistration<'h>(&'h Health);

impl Drop for SleepRegistration<'_> {
    fn drop(&mut self) {
        self.0.sleep_on(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn first_failure_wins_and_wakes_a_doorbell_sleeper() {
        let h = Arc::new(Health::new());
        let bell = Arc::new(Doorbell::new());
        h.sleep_on(Some(&bell));
        let (h2, start) = (h.clone(), Instant::now());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            assert!(h2.fail(Failure::Aborted { msg: "a".into() }));
            assert!(!h2.fail(Failure::Aborted { msg: "b".into() }));
        });
        while !h.is_failed() {
            let tok = bell.prepare();
            if h.is_failed() {
                bell.cancel(tok);
                break;
            }
            bell.wait(tok, Duration::from_secs(10));
        }
        h.sleep_on(None);
        assert!(start.elapsed() < Duration::from_secs(5));
        t.join().unwrap();
        assert_eq!(h.failure(), Some(Failure::Aborted { msg: "a".into() }));
        let e = h.error(3, "all_reduce", 7);
        assert!(e.to_string().contains("call #7"), "{e}");
    }

    fn lost(peer: usize) -> Failure {
        Failure::Lost {
            peer,
            reason: "gone".into(),
        }
    }

    /// A split communicator hears of the loss of one of its ranks from the communicator it
    /// was split from (registered before or after the failure), not of others' losses, and
    /// dropped ones are forgotten.
    #[test]
    fn failures_pass_on_to_dependents_that_they_concern() {
        // Ranks 1 and 3 of the parent are ranks 0 and 1 of the child.
        let map = || -> MapFailure {
            Box::new(|f| match f {
                Failure::Lost { peer, reason } => {
                    [1, 3]
                        .iter()
                        .position(|r| r == peer)
                        .map(|p| Failure::Lost {
                            peer: p,
                            reason: reason.clone(),
                        })
                }
                _ => None,
            })
        };
        let parent = Health::new();
        let (child, other) = (Arc::new(Health::new()), Arc::new(Health::new()));
        parent.pass_on(Arc::downgrade(&child), map());
        for _ in 0..100 {
            let gone = Arc::new(Health::new());
            parent.pass_on(Arc::downgrade(&gone), map());
        }
        assert!(format!("{:?}", parent.dependents).contains("Dependents(2)"));
        parent.fail(lost(3));
        assert_eq!(child.failure(), Some(lost(1)));
        parent.pass_on(Arc::downgrade(&other), map());
        assert_eq!(other.failure(), Some(lost(1)));
        let parent = Health::new();
        let child = Arc::new(Health::new());
        parent.pass_on(Arc::downgrade(&child), map());
        parent.fail(lost(2));
        assert!(!child.is_failed(), "rank 2 is not in the child");
    }
}
