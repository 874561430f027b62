//! The goodbye of a communicator still alive when its process exits.
//!
//! A rank that drops (or closes) its communicator says goodbye, so that slower peers still
//! finishing calls it completed do not count it lost. A process that exits without dropping
//! it (`std::process::exit`, a Python program that ends with its `Comm` still referenced,
//! torch without `destroy_process_group`) would look to its peers like a killed one. So the
//! first communicator with a watchdog installs one `atexit` hook per process, which walks a
//! registry of weak references to the live communicators and, for each that is healthy and
//! idle (no call running, none queued, not closed, not failed), does what
//! [`Communicator::close`] does: marks it closed, says goodbye (waiting at most
//! [`EXIT_GOODBYE`] for all of them together) and frees its links.
//!
//! It never blocks the exit for long and never acts where it must not: every lock is only
//! tried (an exit from a signal handler, or while another thread is inside a call, finds
//! the state locked and leaves that communicator alone: its peers see it lost, as they
//! should for a rank that died in a call); a child forked from a process with
//! communicators inherits the registry and the hook, but an entry names the process that
//! made it, and the child leaves its parent's communicators alone. A killed process runs
//! no hook: it is still reported lost.

use std::sync::{Arc, Mutex, Once, TryLockError, Weak};
use std::time::{Duration, Instant};

use crate::comm::nonblocking::StreamProbe;
use crate::comm::{Communicator, State};
use crate::fault::control::Watchdog;
use crate::fault::health::Health;

/// How long the exit hook waits, in all, for the goodbyes to go out (one takes well under a
/// millisecond; one whose watchdog learns of a new hub as it leaves tries it for 300 ms).
pub(crate) const EXIT_GOODBYE: Duration = Duration::from_millis(500);

/// A live communicator, weakly.
struct Entry {
    /// The process that made it.
    pid: u32,
    rank: usize,
    state: Weak<Mutex<State>>,
    watchdog: Weak<Mutex<Option<Watchdog>>>,
    health: Weak<Health>,
    stream: StreamProbe,
}

static LIVE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static HOOK: Once = Once::new();

/// Adds `comm` to the registry (when it has a watchdog, that is peers to say goodbye to),
/// forgetting the communicators dropped since; installs the hook the first time.
pub(crate) fn register(comm: &Communicator) {
    let Some(watchdog) = comm.supervisor().watchdog_weak() else {
        return;
    };
    let entry = Entry {
        pid: std::process::id(),
        rank: comm.rank(),
        state: Arc::downgrade(&comm.state),
        watchdog,
        health: Arc::downgrade(comm.supervisor().health_arc()),
        stream: comm.stream.probe(),
    };
    {
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|e| e.state.strong_count() > 0);
        live.push(entry);
    }
    HOOK.call_once(|| {
        // SAFETY: `at_exit` takes no argument and never unwinds (it catches panics).
        if unsafe { libc::atexit(at_exit) } != 0 {
            tracing::warn!(
                "cannot install the exit hook: a process that exits without dropping its \
                 communicator will be reported lost"
            );
        }
    });
}

extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(leave_all);
}

/// The hook: every idle, healthy communicator of this process says goodbye and frees its
/// links; see the module documentation.
fn leave_all() {
    let pid = std::process::id();
    let live = match LIVE.try_lock() {
        Ok(l) => l,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => return,
    };
    let leaving: Vec<(Arc<Mutex<State>>, Watchdog)> = live
        .iter()
        .filter(|e| e.pid == pid)
        .filter_map(Entry::begin_leaving)
        .collect();
    drop(live);
    let by = Instant::now() + EXIT_GOODBYE;
    for (state, w) in leaving {
        let said = w.finish_leaving(by);
        if let Ok(mut st) = state.try_lock() {
            st.release();
        }
        tracing::debug!(said, "goodbye at exit");
    }
}

impl Entry {
    /// Marks the communicator closed and starts its goodbye, when it is this process's,
    /// alive, healthy and idle; returns its state (to free its links once the goodbye went
    /// out) and its watchdog.
    fn begin_leaving(&self) -> Option<(Arc<Mutex<State>>, Watchdog)> {
        let state = self.state.upgrade()?;
        let health = self.health.upgrade()?;
        let watchdog = self.watchdog.upgrade()?;
        let w = {
            // Locked: a call runs (the state is held through every call), or poisoned.
            let mut st = state.try_lock().ok()?;
            if st.closed || st.broken.is_some() || health.is_failed() || self.stream.busy() {
                return None;
            }
            let w = watchdog.try_lock().ok()?.take()?;
            st.closed = true;
            st.broken = Some(format!(
                "rank {} closed this communicator (its process exits)",
                self.rank
            ));
            w.begin_leaving();
            w
        };
        Some((state, w))
    }
}
