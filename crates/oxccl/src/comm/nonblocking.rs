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

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use crate::base::dtype::{DataType, Element};
use crate::base::error::{Error, Result};
use crate::base::op::ReduceOp;
use crate::comm::{ByteBufs, Communicator};
use crate::sched::CollKind;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Jobs queued since the communicator was made.
    submitted: u64,
    /// Jobs finished (in order: job k finishes before job k + 1 starts).
    done: u64,
    /// Set when the communicator is dropped: the worker exits once the queue is empty.
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Signals the worker (a job was queued, or the queue closed).
    work: Condvar,
    /// Signals waiters of [`Stream::wait_turn`] (a job finished).
    progress: Condvar,
    worker: OnceLock<ThreadId>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A communicator's queue of non-blocking calls and the worker thread that runs them; the
/// thread starts with the first queued call. Lives inside the [`Communicator`].
#[derive(Default)]
pub(crate) struct Stream {
    shared: OnceLock<Arc<Shared>>,
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
            worker: OnceLock::new(),
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

    fn push(&self, rank: usize, job: Job) -> Result<()> {
        let shared = self.shared(rank)?;
        let mut q = shared.lock();
        if q.closed {
            return Err(Error::Aborted {
                rank,
                msg: "the communicator's stream thread could not be started".into(),
            });
        }
        q.jobs.push_back(job);
        q.submitted += 1;
        shared.work.notify_one();
        Ok(())
    }

    /// Waits until every call queued so far has finished. Returns at once on the worker
    /// thread itself (which runs the queued calls) and when nothing was ever queued.
    pub(crate) fn wait_turn(&self) {
        let Some(shared) = self.shared.get() else {
            return;
        };
        if shared.worker.get() == Some(&std::thread::current().id()) {
            return;
        }
        let mut q = shared.lock();
        let target = q.submitted;
        while q.done < target && !(q.closed && q.jobs.is_empty()) {
            q = shared.progress.wait(q).unwrap_or_else(|e| e.into_inner());
        }
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

fn worker(shared: Arc<Shared>) {
    let _ = shared.worker.set(std::thread::current().id());
    loop {
        let job = {
            let mut q = shared.lock();
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.closed {
                    return;
                }
                q = shared.work.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        // A job never unwinds (submit catches panics), but stay alive if one did.
        let _ = catch_unwind(AssertUnwindSafe(job));
        let mut q = shared.lock();
        q.done += 1;
        shared.progress.notify_all();
    }
}

/// What a [`Work`] and its job share.
struct Slot<T> {
    result: Mutex<Option<Result<T>>>,
    ready: Condvar,
}

/// The handle of a queued call ([`Communicator::submit`] and the `*_async` methods).
///
/// Dropping it does not cancel the call: it still runs, in its turn, and what it owns is
/// freed when it finishes.
#[must_use = "a Work handle carries the call's result and buffers"]
pub struct Work<T> {
    slot: Arc<Slot<T>>,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<T> Work<T> {
    fn lock(&self) -> MutexGuard<'_, Option<Result<T>>> {
        self.slot.result.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// True once the call has finished (successfully or not); never blocks.
    pub fn is_completed(&self) -> bool {
        self.lock().is_some()
    }

    /// Waits for the call to finish and returns its result (for the typed `*_async` calls,
    /// the buffers they took).
    pub fn wait(self) -> Result<T> {
        let mut r = self.lock();
        loop {
            if let Some(res) = r.take() {
                return res;
            }
            r = self.slot.ready.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits at most `timeout`: `Ok(result)` if the call finished, else `Err(self)` to wait
    /// again later.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<T>, Self> {
        let deadline = Instant::now() + timeout;
        {
            let mut r = self.lock();
            loop {
                if let Some(res) = r.take() {
                    return Ok(res);
                }
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                r = self
                    .slot
                    .ready
                    .wait_timeout(r, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
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
        let slot = Arc::new(Slot {
            result: Mutex::new(None),
            ready: Condvar::new(),
        });
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
            *done.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(res);
            done.ready.notify_all();
        });
        if let Err(e) = self.stream.push(rank, job) {
            *slot.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(Err(e));
        }
        Work { slot }
    }

    /// Waits until every call queued so far on this communicator has finished (as
    /// `cudaStreamSynchronize`). Results stay with their [`Work`] handles.
    pub fn synchronize(&self) {
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
