//! Queued work (from `oxcclGroupEnd`): test, wait with a timeout, a completion callback.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use oxccl::{spin_until, Communicator, WAIT_SPIN};

use crate::comm::Call;
use crate::result::{guard, oxcclResult_t, set_last_error, CError};

/// A completion callback: `cb(arg, result)`, on the thread that ran the work (the library's
/// stream thread, or a thread waiting for it that ran it itself, see [`oxcclWorkWait`]), or on
/// the registering thread if the work had already finished. `oxcclGetLastError` on that thread
/// gives the failure's text. It must return promptly, must not unwind, and must not wait on
/// work of the same communicator.
pub type oxcclWorkCallback = Option<extern "C" fn(arg: *mut c_void, result: oxcclResult_t)>;

/// What a work handle and its queued job share.
pub(crate) struct WorkState {
    inner: Mutex<Inner>,
    done: Condvar,
    /// The result is in (read without the lock by waiters that spin).
    finished: AtomicBool,
    rank: usize,
    timeout: Duration,
    /// Calls in the job: each is bounded by `timeout`.
    calls: usize,
}

#[derive(Default)]
struct Inner {
    result: Option<Result<(), CError>>,
    callback: Option<(extern "C" fn(*mut c_void, oxcclResult_t), usize)>,
    /// Threads asleep on `done`.
    waiters: usize,
}

/// A queued job's handle (`oxcclWork_t` points to one).
pub struct oxcclWork {
    state: Arc<WorkState>,
    /// The library's handle of the job (to run it on a waiting thread, see `wait`).
    work: oxccl::Work<()>,
}

impl WorkState {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `calls` as one job on `comm`'s stream.
    pub(crate) fn submit(comm: &Arc<Communicator>, calls: Vec<Call>) -> oxcclWork {
        let state = Arc::new(WorkState {
            inner: Mutex::new(Inner::default()),
            done: Condvar::new(),
            finished: AtomicBool::new(false),
            rank: comm.rank(),
            timeout: comm.timeout(),
            calls: calls.len(),
        });
        let job = Arc::clone(&state);
        let calls = SendCalls(calls);
        // The job reports to `state`; the library's handle only serves to run it early.
        let work = comm.submit(move |c| {
            let calls = calls;
            let r = catch_unwind(AssertUnwindSafe(|| {
                for call in calls.0 {
                    // SAFETY: the C caller keeps the buffers valid until the work completes
                    // (oxcclGroupEnd's contract).
                    unsafe { call.run(c) }?;
                }
                Ok::<(), oxccl::Error>(())
            }));
            let r = match r {
                Ok(r) => r.map_err(CError::from),
                Err(_) => Err(CError::new(
                    oxcclResult_t::oxcclInternalError,
                    "oxccl: internal error (a panic) in queued work",
                )),
            };
            job.finish(r);
            Ok(())
        });
        oxcclWork { state, work }
    }

    /// Stores the result, wakes waiters, runs the callback.
    fn finish(&self, r: Result<(), CError>) {
        let cb = {
            let mut g = self.lock();
            g.result = Some(r.clone());
            self.finished.store(true, Ordering::Release);
            if g.waiters > 0 {
                self.done.notify_all();
            }
            g.callback.take()
        };
        if let Some((f, arg)) = cb {
            call_back(f, arg, &r);
        }
    }
}

fn call_back(f: extern "C" fn(*mut c_void, oxcclResult_t), arg: usize, r: &Result<(), CError>) {
    let code = match r {
        Ok(()) => oxcclResult_t::oxcclSuccess,
        Err(e) => {
            set_last_error(&e.msg);
            e.code
        }
    };
    f(arg as *mut c_void, code);
}

/// The calls of a queued job: their raw pointers cross to the stream thread.
struct SendCalls(Vec<Call>);

// SAFETY: the calls hold plain addresses (RawBufs is Send) and enums; the C caller keeps the
// memory valid until the work completes.
unsafe impl Send for SendCalls {}

impl oxcclWork {
    /// Waits up to `timeout_s` (negative: the communicator's timeout) and returns the result.
    pub(crate) fn wait_raw(&self, timeout_s: f64) -> oxcclResult_t {
        guard(|| self.wait(timeout_s))
    }

    fn wait(&self, timeout_s: f64) -> Result<(), CError> {
        let s = &self.state;
        let limit = if timeout_s.is_finite() && timeout_s >= 0.0 {
            Duration::from_secs_f64(timeout_s.min(1e9))
        } else {
            s.timeout
        };
        let start = Instant::now();
        let deadline = start + limit;
        // A wait that allows the job its whole bound (each call's timeout) runs a job that
        // has not started here, sparing the hand-over to the stream thread and back; a shorter
        // one must return on time, so it leaves the job to the stream.
        let bound = s
            .timeout
            .saturating_mul(u32::try_from(s.calls).unwrap_or(u32::MAX));
        let ran = limit >= bound && self.work.run_here();
        if !ran {
            spin_until(&s.finished, WAIT_SPIN.min(limit), start);
        }
        let mut g = s.lock();
        loop {
            if let Some(r) = &g.result {
                return r.clone();
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CError::new(
                    oxcclResult_t::oxcclTimeout,
                    format!(
                        "oxccl: rank {}: queued work did not complete within {:.3} s",
                        s.rank,
                        limit.as_secs_f64()
                    ),
                ));
            }
            g.waiters += 1;
            g = s
                .done
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            g.waiters -= 1;
        }
    }
}

fn work<'a>(w: *const oxcclWork) -> Result<&'a oxcclWork, CError> {
    // SAFETY: a non-null handle comes from oxcclGroupEnd and is alive until oxcclWorkFree.
    unsafe { w.as_ref() }.ok_or_else(|| CError::invalid("oxccl: the work is NULL"))
}

/// `oxcclWorkWait`: waits for the work, at most `timeout_s` seconds (negative: the
/// communicator's timeout); returns its result, or `oxcclTimeout` if it is still running (the
/// work stays valid: wait again or free it). A wait of at least the work's own bound (the
/// communicator's timeout per call in it) runs the work on the calling thread when it has not
/// started and nothing queued before it is still to run: its completion callback then runs on
/// this thread.
#[no_mangle]
pub extern "C" fn oxcclWorkWait(w: *const oxcclWork, timeout_s: f64) -> oxcclResult_t {
    guard(|| work(w)?.wait(timeout_s))
}

/// `oxcclWorkTest`: `*done` = 1 once the work has finished, then the work's result is
/// returned; 0 (and `oxcclSuccess`) while it runs. Never blocks.
#[no_mangle]
pub extern "C" fn oxcclWorkTest(w: *const oxcclWork, done: *mut i32) -> oxcclResult_t {
    guard(|| {
        let w = work(w)?;
        // SAFETY: a non-null output pointer (the caller's obligation).
        let done =
            unsafe { done.as_mut() }.ok_or_else(|| CError::invalid("oxccl: done is NULL"))?;
        let g = w.state.lock();
        *done = i32::from(g.result.is_some());
        g.result.clone().unwrap_or(Ok(()))
    })
}

/// `oxcclWorkOnComplete`: `cb(arg, result)` runs once the work has finished (see
/// [`oxcclWorkCallback`]); at once, on this thread, if it already has. One callback per work.
#[no_mangle]
pub extern "C" fn oxcclWorkOnComplete(
    w: *const oxcclWork,
    cb: oxcclWorkCallback,
    arg: *mut c_void,
) -> oxcclResult_t {
    guard(|| {
        let w = work(w)?;
        let f = cb.ok_or_else(|| CError::invalid("oxccl: the callback is NULL"))?;
        let now = {
            let mut g = w.state.lock();
            if g.callback.is_some() {
                return Err(CError::invalid("oxccl: the work already has a callback"));
            }
            match &g.result {
                Some(r) => Some(r.clone()),
                None => {
                    g.callback = Some((f, arg as usize));
                    None
                }
            }
        };
        if let Some(r) = now {
            call_back(f, arg as usize, &r);
        }
        Ok(())
    })
}

/// `oxcclWorkFree`: frees the handle (the work itself still runs to its end). NULL is a no-op.
#[no_mangle]
pub extern "C" fn oxcclWorkFree(w: *mut oxcclWork) -> oxcclResult_t {
    guard(|| {
        if !w.is_null() {
            // SAFETY: from oxcclGroupEnd, freed once (the caller's obligation).
            drop(unsafe { Box::from_raw(w) });
        }
        Ok(())
    })
}
