//! Non-blocking collectives: a per-communicator queue, run in order by one worker thread (what
//! a CUDA stream is to NCCL).
//!
//! [`Communicator::submit`] queues any work on the communicator and returns a [`Work`]
//! handle; the typed `*_async` methods ([`all_reduce_async`](Communicator::all_reduce_async)
//! and friends) take ownership of their buffers and give them back through
//! [`Work::wait`], so no buffer can be freed or touched while a call still uses it. They need
//! the communicator in an [`Arc`] (the queued work keeps it alive).
//!
//! Ordering: queued calls run one at a time, in the order they were queued. A blocking call
//! (`all_reduce`, ...) made by any thread other than the worker first waits until every call
//! queued before it has finished, so a thread's calls run in the order it made them, blocking
//! or not: `comm.all_reduce_async(a)` then `comm.broadcast(b)` reduces `a` first on every
//! rank. As with NCCL, every rank must queue the same calls in the same order.
//!
//! Where a call runs: on the worker, or on a thread that waits for it. [`Work::wait`] (and a
//! blocking call's wait for its turn) runs a call that has not started itself when nothing
//! queued before it is still to run: that spares the hand-over to the worker and back in the
//! common "queue, then wait at once" (torch's functional collectives, `async_op=True` then
//! `wait()`). Queuing does not wake the worker:
//! it takes a call that nobody has taken for [`HELP_GRACE`], checking the queue on a timer
//! while calls keep coming (every [`HELP_GRACE`] after it has run one, backing off to
//! [`WORKER_NAP_MAX`]) and sleeping for good only after [`WORKER_IDLE`] without calls, when
//! the next call queued wakes it. So a call nobody waits for still starts on its own, at most
//! about [`WORKER_NAP_MAX`] late, and a call waited for at once costs no thread wake-up. Calls
//! still run one at a time and in order.
//!
//! ```no_run
//! use std::sync::Arc;
//! use oxccl::{Communicator, ReduceOp};
//! # fn main() -> oxccl::Result<()> {
//! let comm = Arc::new(Communicator::from_env()?);
//! let work = comm.all_reduce_async(vec![1.0f32; 1 << 20], ReduceOp::Sum);
//! // ... compute something else meanwhile ...
//! let summed: Vec<f32> = work.wait()?;
//! # Ok(()) }
//! ```

use std::cell::Cell;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::base::dtype::{DataType, Element};
use crate::base::error::{Error, Result};
use crate::base::op::ReduceOp;
use crate::base::wait::{spin_until, WAIT_SPIN};
use crate::comm::{ByteBufs, Communicator};
use crate::sched::CollKind;

type Job = Box<dyn FnOnce() + Send>;

/// How the worker sleeps, for [`Stream::push`] to know whether to wake it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum WorkerSleep {
    /// Running a call, looking at the queue, or not started yet.
    #[default]
    Awake,
    /// Asleep until a timeout at most [`WORKER_NAP_MAX`] away: it will see a new call then.
    Napping,
    /// Asleep until woken: a new call must wake it.
    Parked,
}

#[derive(Default)]
struct Queue {
    /// Calls not started, each with the moment it was queued.
    jobs: VecDeque<(Job, Instant)>,
    /// Jobs queued since the communicator was made.
    submitted: u64,
    /// Jobs finished (in order: job k finishes before job k + 1 starts).
    done: u64,
    /// A job is running: on the worker, or on a thread that waits for it ([`Work::wait`]
    /// runs a job that has not started, when nothing runs before it, itself).
    running: bool,
    /// How the worker sleeps on [`Shared::work`] (push wakes it only when it is parked).
    worker: WorkerSleep,
    /// Threads asleep on [`Shared::progress`].
    progress_waiters: usize,
    /// Set when the communicator is dropped: the worker exits once the queue is empty.
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Signals the worker (a job was queued, a job run elsewhere finished, or the queue
    /// closed).
    work: Condvar,
    /// Signals waiters of [`Stream::wait_turn`] (a job finished).
    progress: Condvar,
}

thread_local! {
    /// The stream whose job this thread is running (its worker's whole life, or while it runs
    /// a job it waits for): its blocking calls are in their turn already.
    static RUNNING: Cell<*const Shared> = const { Cell::new(std::ptr::null()) };
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes job `k` to run on this thread if it is next and nothing runs (the worker has not
    /// taken it).
    fn take_if_next(&self, k: u64) -> Option<Job> {
        let mut q = self.lock();
        if q.running || q.done != k {
            return None;
        }
        // Jobs are taken in order and `done` counts those finished: with none running, job
        // `done` is at the front.
        let (job, _) = q.jobs.pop_front()?;
        q.running = true;
        Some(job)
    }

    /// Runs a job taken from the queue on this thread, then counts it done.
    fn run_taken(self: &Arc<Self>, job: Job) {
        let mine = Arc::as_ptr(self);
        let before = RUNNING.with(|r| r.replace(mine));
        // A job never unwinds (submit catches panics), but stay alive if one did.
        let _ = catch_unwind(AssertUnwindSafe(job));
        RUNNING.with(|r| r.set(before));
        let mut q = self.lock();
        q.running = false;
        q.done += 1;
        if q.progress_waiters > 0 {
            self.progress.notify_all();
        }
        if q.worker == WorkerSleep::Parked && q.closed {
            self.work.notify_one();
        }
    }
}

/// A communicator's queue of non-blocking calls and the worker thread that runs them; the
/// thread starts with the first queued call. Lives inside the [`Communicator`].
#[derive(Default)]
pub(crate) struct Stream {
    /// In an `Arc` for [`Stream::probe`].
    shared: Arc<OnceLock<Arc<Shared>>>,
}

/// A weak look at a [`Stream`]'s queue, for the exit hook ([`crate::comm::exit`]).
pub(crate) struct StreamProbe(Weak<OnceLock<Arc<Shared>>>);

impl StreamProbe {
    /// A call is queued or running (or the queue is locked by another thread): not idle.
    pub(crate) fn busy(&self) -> bool {
        let Some(cell) = self.0.upgrade() else {
            return false;
        };
        let Some(s) = cell.get() else {
            return false;
        };
        let busy = match s.queue.try_lock() {
            Ok(q) => q.running || q.done < q.submitted,
            Err(_) => true,
        };
        busy
    }
}

impl Stream {
    fn shared(&self, rank: usize) -> Result<&Arc<Shared>> {
        if let Some(s) = self.shared.get() {
            return Ok(s);
        }
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            work: Condvar::new(),
            progress: Condvar::new(),
        });
        // Two threads may race to start the queue: only the winner's worker is spawned.
        let mine = Arc::clone(&shared);
        if self.shared.set(shared).is_ok() {
            let s = Arc::clone(&mine);
            let spawned = std::thread::Builder::new()
                .name(format!("oxccl-stream-r{rank}"))
                .spawn(move || worker(s));
            if let Err(e) = spawned {
                // Leave the queue closed: every submit fails with this error.
                mine.lock().closed = true;
                return Err(Error::Io {
                    rank,
                    context: "starting the communicator's stream thread".into(),
                    source: e,
                });
            }
        }
        Ok(self.shared.get().expect("set above"))
    }

    /// Queues `job`; returns the queue and the job's number.
    fn push(&self, rank: usize, job: Job) -> Result<(Arc<Shared>, u64)> {
        let shared = self.shared(rank)?;
        let mut q = shared.lock();
        if q.closed {
            return Err(Error::Aborted {
                rank,
                msg: "the communicator's stream thread could not be started".into(),
            });
        }
        q.jobs.push_back((job, Instant::now()));
        let k = q.submitted;
        q.submitted += 1;
        // A napping worker sees the call at its next look; only a parked one needs waking.
        if q.worker == WorkerSleep::Parked {
            q.worker = WorkerSleep::Awake;
            shared.work.notify_one();
        }
        Ok((Arc::clone(shared), k))
    }

    /// Waits until every call queued so far has finished, running those not yet started on
    /// this thread when nothing runs before them. Returns at once on a thread running one of
    /// this stream's calls (its worker) and when nothing was ever queued.
    pub(crate) fn wait_turn(&self) {
        let Some(shared) = self.shared.get() else {
            return;
        };
        if RUNNING.with(|r| r.get()) == Arc::as_ptr(shared) {
            return;
        }
        let mut q = shared.lock();
        let target = q.submitted;
        while q.done < target && !(q.closed && q.jobs.is_empty()) {
            if !q.running {
                if let Some((job, _)) = q.jobs.pop_front() {
                    q.running = true;
                    drop(q);
                    shared.run_taken(job);
                    q = shared.lock();
                    continue;
                }
            }
            q.progress_waiters += 1;
            q = shared.progress.wait(q).unwrap_or_else(|e| e.into_inner());
            q.progress_waiters -= 1;
        }
    }

    /// A weak look at the queue ([`StreamProbe`]).
    pub(crate) fn probe(&self) -> StreamProbe {
        StreamProbe(Arc::downgrade(&self.shared))
    }

    /// Calls queued and not yet finished.
    fn pending(&self) -> u64 {
        self.shared.get().map_or(0, |s| {
            let q = s.lock();
            q.submitted - q.done
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // The worker holds no reference to the communicator: queued jobs do (each holds an
        // `Arc<Communicator>`), so by now the queue is empty. Let the worker exit; never join
        // (the last reference may be dropped by the worker itself).
        if let Some(s) = self.shared.get() {
            s.lock().closed = true;
            s.work.notify_all();
            s.progress.notify_all();
        }
    }
}

/// How long a queued call is left to a thread that may be about to wait for it (and then runs
/// it itself, [`Work::run_here`]) before the worker takes it. The common "queue a small call,
/// wait for it at once" then costs no hand-over to the worker and back (each a futex wake-up
/// and a thread to schedule: on a 2-core host whose cores run the ranks, 20-30 µs per call,
/// measured with python/bench/overhead_bench.py), while a call nobody waits for yet starts
/// this much later, or up to [`WORKER_NAP_MAX`] when the worker has been idle a while.
pub(crate) const HELP_GRACE: Duration = Duration::from_micros(30);

/// The longest the worker naps between looks at the queue while calls keep coming: its naps
/// start at [`HELP_GRACE`] after each call it runs and double up to this.
pub(crate) const WORKER_NAP_MAX: Duration = Duration::from_micros(500);

/// After this long without a call queued the worker sleeps until the next one wakes it.
pub(crate) const WORKER_IDLE: Duration = Duration::from_millis(50);

/// What the worker does next with the queue as it is (`q` not running a call elsewhere or
/// not): take the front call, or sleep for at most the returned time (`None`: until woken).
/// Pure, for the unit tests.
fn worker_step(
    front_age: Option<Duration>,
    running: bool,
    nap: Duration,
    idle: Duration,
) -> Result<(), Option<Duration>> {
    match front_age {
        Some(age) if !running && age >= HELP_GRACE => Ok(()),
        // Look again when its grace ends (or, while a call runs elsewhere, at the nap: that
        // call's end is the waiter's to follow with the next).
        Some(age) if !running => Err(Some(HELP_GRACE - age)),
        _ if idle >= WORKER_IDLE => Err(None),
        _ => Err(Some(nap)),
    }
}

fn worker(shared: Arc<Shared>) {
    RUNNING.with(|r| r.set(Arc::as_ptr(&shared)));
    let mut nap = HELP_GRACE;
    let mut last_seen = Instant::now();
    loop {
        let job = {
            let mut q = shared.lock();
            loop {
                if q.closed && q.jobs.is_empty() && !q.running {
                    return;
                }
                let now = Instant::now();
                let front_age = q
                    .jobs
                    .front()
                    .map(|(_, at)| now.saturating_duration_since(*at));
                if front_age.is_some() {
                    last_seen = now;
                }
                match worker_step(front_age, q.running, nap, now - last_seen) {
                    Ok(()) => {
                        let (j, _) = q.jobs.pop_front().expect("front checked");
                        q.running = true;
                        break j;
                    }
                    Err(Some(t)) => {
                        q.worker = WorkerSleep::Napping;
                        q = shared
                            .work
                            .wait_timeout(q, t)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                        if front_age.is_none() {
                            nap = (nap * 2).min(WORKER_NAP_MAX);
                        }
                    }
                    Err(None) => {
                        q.worker = WorkerSleep::Parked;
                        q = shared.work.wait(q).unwrap_or_else(|e| e.into_inner());
                        last_seen = Instant::now();
                    }
                }
                q.worker = WorkerSleep::Awake;
            }
        };
        nap = HELP_GRACE;
        shared.run_taken(job);
        // run_taken restored RUNNING to this stream (it was set on entry).
    }
}

/// What a [`Work`] and its job share.
struct Slot<T> {
    state: Mutex<SlotState<T>>,
    ready: Condvar,
    /// The result is in: read without the lock by waiters that spin.
    finished: AtomicBool,
}

struct SlotState<T> {
    result: Option<Result<T>>,
    /// Threads asleep on [`Slot::ready`] (the job notifies only then).
    waiters: usize,
}

impl<T> Slot<T> {
    fn new() -> Self {
        Slot {
            state: Mutex::new(SlotState {
                result: None,
                waiters: 0,
            }),
            ready: Condvar::new(),
            finished: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SlotState<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, res: Result<T>) {
        let mut g = self.lock();
        g.result = Some(res);
        self.finished.store(true, Ordering::Release);
        if g.waiters > 0 {
            self.ready.notify_all();
        }
    }
}

/// The handle of a queued call ([`Communicator::submit`] and the `*_async` methods).
///
/// Dropping it does not cancel the call: it still runs, in its turn, and what it owns is
/// freed when it finishes.
#[must_use = "a Work handle carries the call's result and buffers"]
pub struct Work<T> {
    slot: Arc<Slot<T>>,
    /// The stream and the job's number in it (None: it could not be queued).
    queued: Option<(Arc<Shared>, u64)>,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<T> Work<T> {
    /// True once the call has finished (successfully or not); never blocks.
    pub fn is_completed(&self) -> bool {
        self.slot.finished.load(Ordering::Acquire)
    }

    /// Runs the call on this thread now if it has not started and nothing queued before it is
    /// still to run (the stream thread has not taken it yet); true if it did. The call is
    /// then finished when this returns, bounded as any call by the communicator's timeout.
    /// A waiter that may wait that long calls this first to spare the hand-over to and from
    /// the stream thread ([`wait`](Self::wait) does).
    pub fn run_here(&self) -> bool {
        let Some((shared, k)) = &self.queued else {
            return false;
        };
        match shared.take_if_next(*k) {
            Some(job) => {
                shared.run_taken(job);
                true
            }
            None => false,
        }
    }

    /// Waits for the call to finish and returns its result (for the typed `*_async` calls,
    /// the buffers they took). A call that has not started when nothing runs before it is
    /// run on this thread ([`run_here`](Self::run_here)).
    pub fn wait(self) -> Result<T> {
        if !self.run_here() {
            spin_until(&self.slot.finished, WAIT_SPIN, Instant::now());
        }
        let mut g = self.slot.lock();
        loop {
            if let Some(res) = g.result.take() {
                return res;
            }
            g.waiters += 1;
            g = self.slot.ready.wait(g).unwrap_or_else(|e| e.into_inner());
            g.waiters -= 1;
        }
    }

    /// Waits at most `timeout`: `Ok(result)` if the call finished, else `Err(self)` to wait
    /// again later. Never runs the call on this thread.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<T>, Self> {
        let deadline = Instant::now() + timeout;
        spin_until(&self.slot.finished, WAIT_SPIN.min(timeout), Instant::now());
        {
            let mut g = self.slot.lock();
            loop {
                if let Some(res) = g.result.take() {
                    return Ok(res);
                }
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                g.waiters += 1;
                g = self
                    .slot
                    .ready
                    .wait_timeout(g, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                g.waiters -= 1;
            }
        }
        Err(self)
    }
}

impl Communicator {
    /// Queues `f` to run on this communicator's stream thread after every call queued before
    /// it, and returns its handle; [`Work::wait`] returns what `f` returned. `f` may call any
    /// blocking method of the communicator (it is already in its turn). A panic in `f` comes
    /// back as [`Error::Aborted`].
    ///
    /// Every rank must queue matching calls in the same order, as with blocking calls.
    pub fn submit<R, F>(self: &Arc<Self>, f: F) -> Work<R>
    where
        R: Send + 'static,
        F: FnOnce(&Communicator) -> Result<R> + Send + 'static,
    {
        let slot = Arc::new(Slot::new());
        if let Err(e) = self.own_process("submit") {
            // A forked child: the stream's worker runs only in the parent.
            slot.set(Err(e));
            return Work { slot, queued: None };
        }
        let done = Arc::clone(&slot);
        let comm = Arc::clone(self);
        let rank = self.rank();
        let job: Job = Box::new(move || {
            let res = catch_unwind(AssertUnwindSafe(|| f(&comm))).unwrap_or_else(|p| {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                Err(Error::Aborted {
                    rank,
                    msg: format!("a queued call panicked: {msg}"),
                })
            });
            // Release the communicator before reporting: whoever waits may drop its own
            // reference next and expects the communicator to go away.
            drop(comm);
            done.set(res);
        });
        match self.stream.push(rank, job) {
            Ok(queued) => Work {
                slot,
                queued: Some(queued),
            },
            Err(e) => {
                slot.set(Err(e));
                Work { slot, queued: None }
            }
        }
    }

    /// Waits until every call queued so far on this communicator has finished (as
    /// `cudaStreamSynchronize`). Results stay with their [`Work`] handles.
    /// In a forked child (which may not use its parent's communicator, see [`Communicator`])
    /// it returns at once.
    pub fn synchronize(&self) {
        if self.own_process("synchronize").is_err() {
            return;
        }
        self.stream.wait_turn();
    }

    /// Calls queued on this communicator and not yet finished.
    pub fn pending_calls(&self) -> u64 {
        self.stream.pending()
    }

    /// Queues a byte-level call ([`call_bytes`](Self::call_bytes)) on raw buffers: the entry
    /// for bindings (the Python package) that keep their buffers alive by other means.
    ///
    /// # Safety
    ///
    /// `bufs` must stay valid (allocated, not moved, and for the output not read or written
    /// by anyone else) until the returned [`Work`] reports completion, even if the handle is
    /// dropped before.
    pub unsafe fn call_bytes_async(
        self: &Arc<Self>,
        kind: CollKind,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        bufs: RawBufs,
    ) -> Work<()> {
        self.submit(move |c| {
            // SAFETY: the caller guarantees that the buffers outlive the call.
            let bufs = unsafe { bufs.as_byte_bufs() };
            c.call_bytes(kind, dtype, op, root, bufs)
        })
    }

    fn typed_async<T: Element>(
        self: &Arc<Self>,
        kind: CollKind,
        op: ReduceOp,
        root: usize,
        mut send: Vec<T>,
        recv_len: Option<usize>,
    ) -> Work<Vec<T>> {
        self.submit(move |c| match recv_len {
            None => {
                c.call_bytes(
                    kind,
                    T::DTYPE,
                    op,
                    root,
                    ByteBufs::InPlace(bytemuck::cast_slice_mut(&mut send)),
                )?;
                Ok(send)
            }
            Some(n) => {
                let mut recv = vec![T::zeroed(); n];
                c.call_bytes(
                    kind,
                    T::DTYPE,
                    op,
                    root,
                    ByteBufs::Separate {
                        send: bytemuck::cast_slice(&send),
                        recv: bytemuck::cast_slice_mut(&mut recv),
                    },
                )?;
                Ok(recv)
            }
        })
    }

    /// [`all_reduce_in_place`](Self::all_reduce_in_place), queued: `wait` returns `buf`
    /// holding the reduction.
    pub fn all_reduce_async<T: Element>(
        self: &Arc<Self>,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        self.typed_async(CollKind::AllReduce, op, 0, buf, None)
    }

    /// [`broadcast_in_place`](Self::broadcast_in_place), queued: `wait` returns `buf`
    /// holding the root's data.
    pub fn broadcast_async<T: Element>(self: &Arc<Self>, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        self.typed_async(CollKind::Broadcast, ReduceOp::Sum, root, buf, None)
    }

    /// [`reduce_in_place`](Self::reduce_in_place), queued: `wait` returns `buf`, holding the
    /// reduction on the root.
    pub fn reduce_async<T: Element>(
        self: &Arc<Self>,
        buf: Vec<T>,
        op: ReduceOp,
        root: usize,
    ) -> Work<Vec<T>> {
        self.typed_async(CollKind::Reduce, op, root, buf, None)
    }

    /// [`all_gather`](Self::all_gather), queued: `wait` returns every rank's `send`,
    /// concatenated in rank order.
    pub fn all_gather_async<T: Element>(self: &Arc<Self>, send: Vec<T>) -> Work<Vec<T>> {
        let n = send.len() * self.world_size();
        self.typed_async(CollKind::AllGather, ReduceOp::Sum, 0, send, Some(n))
    }

    /// [`reduce_scatter`](Self::reduce_scatter), queued: `wait` returns this rank's block of
    /// the reduction (`send.len() / world_size` elements; a length that does not divide is an
    /// error).
    pub fn reduce_scatter_async<T: Element>(
        self: &Arc<Self>,
        send: Vec<T>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        let n = send.len() / self.world_size();
        self.typed_async(CollKind::ReduceScatter, op, 0, send, Some(n))
    }

    /// [`all_to_all`](Self::all_to_all), queued: `wait` returns the received blocks.
    pub fn all_to_all_async<T: Element>(self: &Arc<Self>, send: Vec<T>) -> Work<Vec<T>> {
        let n = send.len();
        self.typed_async(CollKind::AllToAll, ReduceOp::Sum, 0, send, Some(n))
    }

    /// [`send`](Self::send), queued: `wait` gives `buf` back.
    pub fn send_async<T: Element>(self: &Arc<Self>, buf: Vec<T>, peer: usize) -> Work<Vec<T>> {
        self.submit(move |c| c.send(&buf, peer).map(|()| buf))
    }

    /// [`recv`](Self::recv), queued: `wait` returns `buf` filled with what `peer` sent.
    pub fn recv_async<T: Element>(self: &Arc<Self>, mut buf: Vec<T>, peer: usize) -> Work<Vec<T>> {
        self.submit(move |c| c.recv(&mut buf, peer).map(|()| buf))
    }

    /// [`barrier`](Self::barrier), queued.
    pub fn barrier_async(self: &Arc<Self>) -> Work<()> {
        self.submit(|c| c.barrier())
    }
}

/// Raw buffers of [`Communicator::call_bytes_async`].
#[derive(Copy, Clone, Debug)]
pub enum RawBufs {
    /// Separate input and output.
    Separate {
        /// Start of the input.
        send: *const u8,
        /// Input length in bytes.
        send_len: usize,
        /// Start of the output.
        recv: *mut u8,
        /// Output length in bytes.
        recv_len: usize,
    },
    /// One buffer, used in place.
    InPlace {
        /// Start of the buffer.
        buf: *mut u8,
        /// Length in bytes.
        len: usize,
    },
}

// SAFETY: RawBufs is plain addresses; whoever dereferences them (`as_byte_bufs`, an unsafe
// fn) takes on the obligation that the memory is valid on that thread.
unsafe impl Send for RawBufs {}

impl RawBufs {
    /// Views the buffers as slices.
    ///
    /// # Safety
    ///
    /// Every non-empty buffer must be valid for reads (the input) or reads and writes (the
    /// output, the in-place buffer) of its length for the life of the result, and the output
    /// must not overlap the input nor be accessed by anyone else meanwhile. Null or dangling
    /// pointers are allowed for empty buffers.
    pub unsafe fn as_byte_bufs<'a>(self) -> ByteBufs<'a> {
        unsafe fn ro<'a>(p: *const u8, len: usize) -> &'a [u8] {
            if len == 0 || p.is_null() {
                // An empty slice aligned for every element type (a `&[]` of bytes may not be).
                // SAFETY: zero-length slices need only a non-null, aligned pointer.
                unsafe { std::slice::from_raw_parts(NonNull::<u64>::dangling().as_ptr().cast(), 0) }
            } else {
                // SAFETY: non-empty and non-null; validity is the caller's contract.
                unsafe { std::slice::from_raw_parts(p, len) }
            }
        }
        unsafe fn rw<'a>(p: *mut u8, len: usize) -> &'a mut [u8] {
            if len == 0 || p.is_null() {
                // SAFETY: as above.
                unsafe {
                    std::slice::from_raw_parts_mut(NonNull::<u64>::dangling().as_ptr().cast(), 0)
                }
            } else {
                // SAFETY: non-empty and non-null; validity and exclusivity are the caller's
                // contract.
                unsafe { std::slice::from_raw_parts_mut(p, len) }
            }
        }
        // SAFETY: the caller's contract is that of `ro` and `rw`.
        unsafe {
            match self {
                RawBufs::Separate {
                    send,
                    send_len,
                    recv,
                    recv_len,
                } => ByteBufs::Separate {
                    send: ro(send, send_len),
                    recv: rw(recv, recv_len),
                },
                RawBufs::InPlace { buf, len } => ByteBufs::InPlace(rw(buf, len)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn the_worker_leaves_a_fresh_call_to_a_waiter_for_the_grace_then_takes_it() {
        let nap = WORKER_NAP_MAX;
        // Fresh: sleep out the rest of the grace, never longer.
        assert_eq!(
            worker_step(Some(10 * US), false, nap, Duration::ZERO),
            Err(Some(HELP_GRACE - 10 * US))
        );
        // Its grace over: take it, whatever the nap.
        assert_eq!(
            worker_step(Some(HELP_GRACE), false, nap, Duration::ZERO),
            Ok(())
        );
        assert_eq!(
            worker_step(Some(HELP_GRACE * 9), false, HELP_GRACE, Duration::ZERO),
            Ok(())
        );
        // A call running elsewhere (a waiter took it): nap, and never take one behind it.
        assert_eq!(
            worker_step(Some(HELP_GRACE * 9), true, nap, Duration::ZERO),
            Err(Some(nap))
        );
    }

    #[test]
    fn an_idle_worker_naps_then_sleeps_until_woken() {
        assert_eq!(
            worker_step(None, false, 60 * US, Duration::ZERO),
            Err(Some(60 * US))
        );
        assert_eq!(
            worker_step(None, false, 60 * US, WORKER_IDLE / 2),
            Err(Some(60 * US))
        );
        assert_eq!(worker_step(None, false, 60 * US, WORKER_IDLE), Err(None));
        assert_eq!(worker_step(None, true, 60 * US, WORKER_IDLE), Err(None));
    }
}
