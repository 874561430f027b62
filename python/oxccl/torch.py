"""The torch.distributed backend ``"oxccl"``.

    import torch.distributed as dist
    import oxccl.torch  # registers the backend
    dist.init_process_group("oxccl")               # or backend="cpu:oxccl"
    group = dist.new_group(ranks, backend="oxccl")

``BackendOxccl`` is a ``torch._C._distributed_c10d.Backend`` (the class behind
``ProcessGroupGloo``), registered with ``extended_api=True`` for the CPU device: torch builds
its own ``ProcessGroup`` around it, so the group keeps its name, device types and
bookkeeping, and DeviceMesh, FSDP2, DTensor, functional collectives, ``torch.compile``,
``monitored_barrier`` and ``split_group`` work as with gloo.

Rendezvous goes through the store torch hands in: group rank 0 makes an oxccl unique id and
``store.set``s it; the others ``store.get`` it.

Execution. Blocking collectives (``async_op=False``) of up to ``INLINE_MAX_BYTES`` run at once
on the calling thread (GIL released) and return a completed Work: no queue, no thread hop.
Larger ones, and asynchronous calls of every size (``async_op=True``, and torch's own callers
such as DDP and functional collectives, whose options ask for it: ``opts.asyncOp``), are
queued on the communicator's stream (oxccl's own thread), so they return before the peers
arrive, as gloo's; ``Work.wait`` waits for them directly. Futures
(``Work.get_future()``) are completed by separate completion threads, never by oxccl's
stream thread, so a ``.then()`` callback may itself run a blocking collective. Every wait
is bounded: by the call's own timeout (the group's ``timeout``, or ``OXCCL_TIMEOUT``), and
by ``work.wait(timeout=)`` when given (an ``oxccl.TimeoutError``). torch wraps a Python
backend's Work in its own object, whose ``is_completed()`` stays False: poll
``work.get_future().done()`` (the C++ backend answers it).

The C++ backend (``oxccl/csrc/backend.cpp``, built on first import) is what
``register_backend`` hands torch when it is built (see ``_wrap``): it holds this Python
backend, runs the hot collectives through the library's C ABI on this backend's
communicator, and delegates everything else here.

Point-to-point runs on the library's engine (``Comm.p2p``). ``isend``/``irecv`` (and
``batch_isend_irecv``, which issues them) are held until one of their Works is waited on (or
its future or ``is_completed`` asked for), the next collective starts, or the group shuts
down (``destroy_process_group``, process exit); then every held operation runs as one group,
whose sends and receives progress together: send-first exchanges of any size complete and no
set of ranks can wait on each other in a cycle. Holding is what makes that so: a send queued
alone on the communicator's one stream would block it, above the links' buffer size, until
the peer reads, and a receive issued after it could not run meanwhile. Messages are matched
by source and tag (a message of another tag waits in the receiver's stash), in send order per
tag, across groups; ``irecv``/``recv`` without a source take the first message of that tag
from any rank, and ``dist.recv`` returns its sender. A rank that issues an ``isend`` and never
waits sends it at its next collective or at shutdown; until then the peer's receive waits,
bounded by the group's timeout.

Data types: every dtype for the calls that only move data (broadcast, all_gather,
all_to_all, gather, scatter, send/recv: sent as bytes); reductions on float32, float64,
float16, bfloat16, int8, uint8, uint16, int32, int64, uint32, uint64 and bool (SUM and MAX
an or, PRODUCT and MIN an and). Ops: SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR (integers
and bool) and PREMUL_SUM (the library's op: each rank's input times its own factor, summed;
an integer factor for integer tensors); int16 reduces in int32 (wrapping as int16), complex
tensors as their real view (SUM, AVG, PREMUL_SUM with a real factor). Anything else is a clear
``oxccl.InvalidArgumentError``, raised before any data moves.

Call forms, as gloo's: several tensors in one ``allreduce`` are reduced together (locally
too) and each gets the result; several in one ``broadcast`` get the root's
``tensors[rootTensor]``; ``allgather_coalesced`` takes torch's ``[rank][tensor]`` outputs;
several ``allgather`` inputs land at ``r * k + j`` of every output list; a tensor repeated
(or overlapping) in ``allreduce_coalesced`` is reduced once per position; ``reduce_scatter``
blocks may differ in size per rank; sparse COO tensors all_reduce (SUM); non-contiguous and
lazily conjugated views go through contiguous temporaries, copied back. Empty lists and roots
outside the group raise at call time.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.abc
import importlib.util
import os
import queue
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch.futures import Future

from . import Comm, InvalidArgumentError, TimeoutError, _Buf, _oxccl

__all__ = [
    "BackendOxccl",
    "ProcessGroupOxccl",
    "BACKEND_NAME",
    "INLINE_MAX_BYTES",
    "inference_all_reduce",
    "inference_all_gather",
]

BACKEND_NAME = "oxccl"

#: Blocking collectives moving at most this many bytes (per rank) run inline on the caller's
#: thread.
INLINE_MAX_BYTES = 1 << 20

_R = dist.ReduceOp
_RT = _R.RedOpType
_SUM = _R.SUM
_STRIDED = torch.strided
_OPS = {
    _RT.SUM: "sum",
    _RT.PRODUCT: "prod",
    _RT.MIN: "min",
    _RT.MAX: "max",
    _RT.AVG: "avg",
    _RT.BAND: "band",
    _RT.BOR: "bor",
    _RT.BXOR: "bxor",
}

# oxccl's names of torch dtypes (bool and uint16 reach the library only where it has them).
_DTYPES: Dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _name


def _op(opts: Any) -> str:
    """oxccl's name of `opts.reduceOp` (a PREMUL_SUM as ``premul_sum:FACTOR``, the library's
    op: each rank's input times its own factor, then summed)."""
    if opts is None:
        return "sum"
    op = opts.reduceOp
    if op == _SUM:  # the common case, without the enum lookups below
        return "sum"
    kind = op.op if hasattr(op, "op") else op
    if kind == _RT.PREMUL_SUM:
        factor = op.__getstate__()[1]
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        return f"premul_sum:{float(factor)!r}"
    name = _OPS.get(kind)
    if name is None:
        raise InvalidArgumentError(f"the oxccl backend does not support ReduceOp {kind}")
    return name


def _async(opts: Any) -> bool:
    """Whether torch asks for an asynchronous call: ``opts.asyncOp``, which torch sets from
    ``async_op`` and which is true in options made by its own callers (DDP, functional
    collectives). Such a call is queued at every size, so that it returns before the peers
    arrive (as gloo's) and ``work.wait(timeout=)`` bounds it; no options: a blocking call."""
    return opts is not None and bool(getattr(opts, "asyncOp", False))


def _buf(t: Any, what: str, writable: bool, raw_bytes: bool = False) -> _Buf:
    """A checked view of a CPU tensor. `raw_bytes`: as uint8 (for calls that only move data,
    so any dtype works)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{what}: expected a tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise InvalidArgumentError(f"{what}: the tensor is on {t.device}; oxccl works on CPU tensors")
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"{what}: {t.layout} tensors are not supported")
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"{what}: the tensor is not contiguous (strides {tuple(t.stride())}); pass x.contiguous()"
        )
    if t.is_complex() and (t.is_conj() or t.is_neg()):
        raise InvalidArgumentError(f"{what}: lazily conjugated/negated tensors are not supported")
    b = _Buf.__new__(_Buf)
    b.obj = t
    b.addr = t.data_ptr()
    b.numel = t.numel()
    b.nbytes = t.nbytes
    if raw_bytes:
        b.dtype = "uint8"
    else:
        name = _DTYPES.get(t.dtype)
        if name is None:
            raise InvalidArgumentError(
                f"{what}: unsupported dtype {t.dtype} for a reduction "
                f"(supported: {', '.join(sorted(set(_DTYPES.values())))})"
            )
        b.dtype = name
    return b


class _Call:
    """One oxccl call: kind, checked buffers, arguments."""

    __slots__ = ("kind", "send", "recv", "op", "root", "peer", "in_place")

    def __init__(
        self,
        kind: str,
        send: Optional[_Buf],
        recv: Optional[_Buf],
        op: str = "sum",
        root: int = 0,
        peer: int = 0,
        in_place: bool = False,
    ):
        self.kind, self.send, self.recv = kind, send, recv
        self.op, self.root, self.peer, self.in_place = op, root, peer, in_place

    def args(self) -> tuple:
        ref = self.recv if self.recv is not None else self.send
        dtype = ref.dtype if ref is not None else "uint8"
        s = (0, 0) if self.send is None or self.in_place else (self.send.addr, self.send.nbytes)
        r = (0, 0) if self.recv is None else (self.recv.addr, self.recv.nbytes)
        return (self.kind, dtype, self.op, self.root, self.peer, s, r, self.in_place)

    def keep(self) -> tuple:
        return (None if self.send is None else self.send.obj, None if self.recv is None else self.recv.obj)

    def nbytes(self) -> int:
        return max(self.send.nbytes if self.send is not None else 0, self.recv.nbytes if self.recv is not None else 0)


#: Ops that act on a complex tensor as on its real and imaginary parts (gloo: SUM only).
_COMPLEX_OPS = ("sum", "avg")


#: Local reductions of several tensors of one rank (gloo's allreduce of a tensor list).
_LOCAL_OPS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add,
    "prod": torch.mul,
    "min": torch.minimum,
    "max": torch.maximum,
    "band": torch.bitwise_and,
    "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}


def _check_tensor(t: Any, what: str) -> None:
    """A clear error for what no call can take: not a tensor, not on the CPU, not strided."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{what}: expected a tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise InvalidArgumentError(f"{what}: the tensor is on {t.device}; oxccl works on CPU tensors")
    if t.layout != _STRIDED:
        raise InvalidArgumentError(f"{what}: {t.layout} tensors are not supported here")


def _dense(t: Any, what: str, op: Optional[str], backs: Optional[list], read: bool = True) -> torch.Tensor:
    """`t` as the library can take it: itself when it is a contiguous tensor of a dtype the
    call takes, else a contiguous temporary (a copy of `t` when `read`) that is copied back
    into `t` after the call when `backs` is a list (pairs appended to it). `op` None: the call
    only moves data (any dtype, as bytes); else the reduction's name: complex tensors reduce
    as their real and imaginary parts (SUM, AVG only), int16 in int32."""
    _check_tensor(t, what)
    tmp = t
    if t.is_conj() or t.is_neg():
        tmp = t.resolve_conj().resolve_neg()
    if not tmp.is_contiguous():
        tmp = tmp.contiguous() if read else torch.empty(t.shape, dtype=t.dtype)
    lib = tmp
    if op is not None and t.dtype not in _DTYPES:
        if t.is_complex():
            if op.split(":")[0] not in _COMPLEX_OPS and not op.startswith("premul_sum"):
                raise InvalidArgumentError(
                    f"{what}: {op.upper()} is not defined on complex tensors ({t.dtype}): "
                    "only SUM, AVG and PREMUL_SUM (a real factor)"
                )
            lib = torch.view_as_real(tmp)
        elif t.dtype == torch.int16:
            tmp = tmp.to(torch.int32)
            lib = tmp
        else:
            raise InvalidArgumentError(
                f"{what}: unsupported dtype {t.dtype} for a reduction "
                f"(supported: {', '.join(sorted(set(_DTYPES.values())))}, int16, complex)"
            )
    if tmp is not t and backs is not None:
        backs.append((t, tmp))
    return lib


def _copy_back(backs: list) -> None:
    """Writes temporaries back into the caller's tensors, in call order."""
    for dst, src in backs:
        dst.copy_(src)


def _overlapping(tensors: Sequence[torch.Tensor]) -> List[int]:
    """Indices of the tensors whose bytes overlap those of an earlier one in the list."""
    spans = []
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        lo = t.data_ptr()
        hi = lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        spans.append((lo, hi, i))
    spans.sort()
    out, end = [], None
    for lo, hi, i in spans:
        if end is not None and lo < end:
            out.append(i)
        end = hi if end is None else max(end, hi)
    return out


def _coll(
    kind: str, send: Any, recv: Any, *, op: str = "sum", root: int = 0, raw_bytes: bool = False,
    backs: Optional[list] = None,
) -> _Call:
    """A collective on tensors: `send` None means in place on `recv`. Input and output views
    of one storage that overlap without being the same go through a copy of the input.
    `backs`: a list for temporaries (non-contiguous tensors, complex or int16 reductions) to
    copy back after the call; without it such tensors raise."""
    red = None if raw_bytes else op
    if send is not None and isinstance(send, torch.Tensor) and isinstance(recv, torch.Tensor) and send.dtype != recv.dtype:
        # torch's backends refuse it; compared before temporaries (int16 reduces as int32,
        # complex as its real view) and before raw bytes hide the types
        raise InvalidArgumentError(f"{kind}: input is {send.dtype} but output is {recv.dtype}")
    if backs is not None:
        recv = _dense(recv, f"{kind} output", red, backs, read=send is None)
        if send is not None:
            send = _dense(send, f"{kind} input", red, None)
    r = _buf(recv, f"{kind} output", True, raw_bytes)
    if send is None:
        return _Call(kind, None, r, op=op, root=root, in_place=True)
    s = _buf(send, f"{kind} input", False, raw_bytes)
    if s.dtype != r.dtype:
        raise InvalidArgumentError(f"{kind}: input is {send.dtype} but output is {recv.dtype}")
    if s.overlaps(r):
        if s.same(r) and kind in ("all_reduce", "broadcast", "reduce", "all_to_all"):
            return _Call(kind, None, r, op=op, root=root, in_place=True)
        s = _buf(send.clone(), f"{kind} input", False, raw_bytes)
    return _Call(kind, s, r, op=op, root=root)


# -------------------------------------------------------------------------------------------
# Completion of futures, away from oxccl's stream thread.
# -------------------------------------------------------------------------------------------
class _Completers:
    """Threads that wait for queued calls and complete their futures (so `.then()`
    callbacks never run on oxccl's stream thread). A backend call made from one of these
    threads (a callback running a collective) first starts another, which serves the queue
    meanwhile; threads beyond one end when the queue stays empty."""

    def __init__(self) -> None:
        self.q: "queue.SimpleQueue[_Job]" = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads = 0
        self.mine = threading.local()

    def put(self, job: "_Job") -> None:
        with self.lock:
            start = self.threads == 0 or getattr(self.mine, "completer", False)
            if start:
                self.threads += 1
        if start:
            threading.Thread(target=self._loop, name="oxccl-torch-futures", daemon=True).start()
        self.q.put(job)

    def _loop(self) -> None:
        self.mine.completer = True
        while True:
            try:
                job = self.q.get(timeout=1.0)
            except queue.Empty:
                with self.lock:
                    if self.threads > 1:
                        self.threads -= 1
                        return
                continue
            try:
                job.finish()
                job.settle()
            except BaseException:  # noqa: BLE001 - never let a completion thread die
                pass


_COMPLETERS = _Completers()


def _value_of(fut: Future) -> Any:
    """The value of a completed future, or its exception raised (which makes the error of a
    future chained with ``then``)."""
    return fut.value()


class _Job:
    """One backend call in flight: the oxccl handles it waits for, what it returns, `post`
    (copies out of temporaries) to run once they have finished, and its future."""

    __slots__ = (
        "backend", "what", "handles", "result", "post", "error", "done", "held", "lock", "fut", "fut_set", "sources",
        "chained", "__weakref__",
    )

    def __init__(
        self,
        backend: "BackendOxccl",
        what: str,
        handles: Sequence[Any] = (),
        result: Any = None,
        post: Optional[Callable[[], None]] = None,
    ):
        self.backend, self.what = backend, what
        self.handles = list(handles)
        self.result, self.post = result, post
        self.error: Optional[BaseException] = None
        self.done = False
        self.held = False  # point-to-point, not yet flushed
        self.sources: Any = None  # point-to-point: (the group's P2pSources, this job's index)
        self.lock = threading.Lock()
        self.fut: Optional[Future] = None
        self.chained: Optional[Future] = None
        self.fut_set = False

    def flush(self) -> None:
        if self.held:
            self.backend._flush_p2p()

    def finish(self) -> None:
        """Waits for the handles (each bounded by its call's timeout), runs `post`, once."""
        self.flush()
        with self.lock:
            if self.done:
                return
            try:
                for h in self.handles:
                    h.wait()
                if self.post is not None:
                    self.post()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                self.error = e
            self.handles = []
            self.post = None
            self.done = True

    def settle(self) -> None:
        with self.lock:
            fut = self.fut
            if fut is None or self.fut_set or not self.done:
                return
            self.fut_set = True
        if self.error is not None:
            fut.set_exception(self.error)
        else:
            fut.set_result(self.result)

    def future(self) -> Future:
        """The call's future, completed by a completion thread (or now, if done).

        What it returns is chained (``then``) on the future that `settle` sets: an error then
        reaches torch's C++ consumers (DDP's reducer) as the future's error, not as a value
        holding a Python exception that they would take for the result."""
        with self.lock:
            fresh = self.fut is None
            if fresh:
                self.fut = Future()
                self.chained = self.fut.then(_value_of)
            fut = self.chained
        if fresh:
            if self.done:
                self.settle()
            else:
                self.flush()
                _COMPLETERS.put(self)
        return fut

    def source_rank(self) -> int:
        """The rank a finished recv's message came from."""
        src = self.sources
        got = src[0].get() if isinstance(src, tuple) else None
        if got is None or got[src[1]] is None:
            raise InvalidArgumentError(f"{self.what}: not a finished recv, so no source rank")
        return got[src[1]]

    def polled(self) -> bool:
        """True once finished (never blocks on the calls)."""
        if not self.done:
            self.flush()
            if not all(h.is_completed() for h in list(self.handles)):
                return False
            self.finish()
        self.settle()
        return True

    def wait(self, timeout_s: float = 0.0) -> None:
        """Waits for the calls (up to `timeout_s` when positive: an ``oxccl.TimeoutError``
        after it) and raises their error, if any."""
        if timeout_s > 0:
            deadline = time.monotonic() + timeout_s
            pause = 2e-5
            while not self.polled():
                left = deadline - time.monotonic()
                if left <= 0:
                    b = self.backend
                    raise TimeoutError(
                        f"oxccl: rank {b.rank()} of group {b._group_id!r}: {self.what} did not "
                        f"complete within the {timeout_s:g} s given to work.wait(timeout=)"
                    )
                time.sleep(min(pause, left))
                pause = min(pause * 2, 1e-3)
        self.finish()
        self.settle()
        if self.error is not None:
            raise self.error


#: Per thread: the job whose Work was waited on last, weakly (see `_source_rank`; a strong
#: reference would keep its backend alive after destroy_process_group).
_WAITED = threading.local()
_C10D_SOURCE_RANK = dist.Work._source_rank


def _source_rank(work: Any) -> int:
    """``Work._source_rank`` (what ``dist.recv`` without a source returns) for this backend's
    Works too: torch wraps a Python backend's Work in a C++ one that forwards ``wait`` but not
    ``sourceRank``. Waiting again (a no-op once finished) tells which job the wrapper holds."""
    try:
        return _C10D_SOURCE_RANK(work)
    except RuntimeError:
        _WAITED.job = None
        work.wait()
        ref = getattr(_WAITED, "job", None)
        job = ref() if ref is not None else None
        if job is None:
            raise
        return job.source_rank()


dist.Work._source_rank = _source_rank

_C10D_WAIT = dist.Work.wait
#: Per thread: an explicit non-positive work.wait(timeout=) is in progress (see `_work_wait`).
_EXPIRED_WAIT = threading.local()


def _work_wait(work: Any, timeout: Any = None) -> bool:
    """``Work.wait``, where an explicit zero or negative timeout on a Work of this backend
    expires at once (torch passes "no timeout" as 0 to C++, so a C++ ``wait`` cannot tell an
    explicit 0 from none): the call's result if it has finished, else an
    ``oxccl.TimeoutError``. Other Works and other timeouts: torch's ``wait`` unchanged."""
    if timeout is None:
        return _C10D_WAIT(work)
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else None
    if secs is not None and secs <= 0:
        if isinstance(work, (_JobWork, _DoneWork)):
            return work.wait_now()
        if _CPP is not None:
            got = _CPP.wait_now(work)
            if got is not None:
                return got
        # Maybe torch's wrapper of a `_JobWork` (the Python backend alone): it forwards wait
        # with the timeout as 0 either way; the flag (this thread's) tells it the 0 is given.
        _EXPIRED_WAIT.on = True
        try:
            return _C10D_WAIT(work, timeout)
        finally:
            _EXPIRED_WAIT.on = False
    return _C10D_WAIT(work, timeout)


dist.Work.wait = _work_wait


class _DoneWork(dist.Work):
    """The Work of a call that has already finished (inline): nothing to wait for."""

    def __init__(self, result: Any):
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def wait_now(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_result(self._result)
        return fut

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        pass


class _JobWork(dist.Work):
    """torch's Work for a :class:`_Job`: ``wait`` (and ``get_future``) first run held
    point-to-point operations; ``wait(timeout=)`` raises an ``oxccl.TimeoutError`` on time.

    torch wraps the Work of a Python backend in its own object, which forwards ``wait`` and
    ``get_future`` here but answers ``is_completed`` from its own flag (never set): poll
    ``work.get_future().done()`` instead."""

    def __init__(self, job: _Job):
        super().__init__()
        self._job = job

    def wait(self, timeout: Any = None) -> bool:
        t = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
        expired = getattr(_EXPIRED_WAIT, "on", False)
        _EXPIRED_WAIT.on = False
        if t < 0 or expired:  # 0 is torch's "none given"; an explicit 0: see `_work_wait`
            return self.wait_now()
        self._job.wait(t)
        _WAITED.job = weakref.ref(self._job)
        return True

    def wait_now(self) -> bool:
        """wait() with an expired timeout: True (or the call's error) if finished, else an
        ``oxccl.TimeoutError``."""
        if not self._job.polled():
            b = self._job.backend
            raise TimeoutError(
                f"oxccl: rank {b.rank()} of group {b._group_id!r}: {self._job.what} did not complete "
                f"within the non-positive timeout given to work.wait(timeout=): Timed out waiting for it"
            )
        self._job.wait()
        _WAITED.job = weakref.ref(self._job)
        return True

    def is_completed(self) -> bool:
        return self._job.polled()

    def is_success(self) -> bool:
        return self._job.polled() and self._job.error is None

    def exception(self) -> Any:
        return self._job.error if self._job.polled() else None

    def get_future(self) -> Future:
        return self._job.future()

    def result(self) -> Any:
        self._job.wait()
        return self._job.result

    def _source_rank(self) -> int:
        """The rank a recv's message came from (once waited for)."""
        self._job.wait()
        return self._job.source_rank()

    source_rank = _source_rank

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<oxccl Work {self._job.what} completed={self._job.done}>"


def _in_callers_mode(post: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
    """`post` as it must run on the completion thread: under torch.inference_mode when the
    call was made under it (a thread-local mode; copies into inference tensors outside it
    are refused), as gloo's work carries its caller's thread-local state."""
    if post is None or not torch.is_inference_mode_enabled():
        return post

    def in_mode() -> None:
        with torch.inference_mode():
            post()

    return in_mode


class BackendOxccl(_C10dBackend):
    """torch's CPU Backend for a group, running its calls on an oxccl communicator."""

    def __init__(
        self,
        comm: Comm,
        rank: int,
        size: int,
        store: Any = None,
        timeout: Optional[timedelta] = None,
        group_id: Any = None,
    ):
        """A backend for ranks ``rank`` of ``size`` on ``comm``, made by torch through the
        registered creator (``dist.init_process_group(backend="oxccl")``), not by users."""
        super().__init__(rank, size)
        self.comm = comm
        self._raw = comm._raw
        self._store = store
        self._timeout = timeout
        self._group_id = group_id
        self._held: List[tuple] = []  # (kind, peer or None, tag, _Buf)
        self._held_jobs: List[_Job] = []
        # The batch_isend_irecv whose operations are being held (its frame) and, per held
        # job, the number of its batch (0: none), the index of its first operation.
        self._batch: Any = None
        self._batches = 0
        self._held_batch: List[Tuple[int, int]] = []
        self._barriers = 0
        self._seq = 0  # collectives called (see _get_sequence_number_for_group)
        self._shut = False  # shutdown() ran: the communicator is closed
        _BACKENDS.add(self)

    # -- identity -----------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The backend's name, ``"oxccl"`` (torch's spelling of the method)."""
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        """The backend's name, ``"oxccl"``."""
        return BACKEND_NAME

    @property
    def supports_coalescing(self) -> bool:
        """False: torch cannot pass a coalescing block's start and end to a Python backend."""
        # torch's ProcessGroup cannot forward start/end of coalescing to a Python backend;
        # batch_isend_irecv then issues plain isend/irecv, which this backend holds and runs
        # as one group at the first wait: the same effect.
        return False

    @property
    def supports_splitting(self) -> bool:
        """True: torch may split this group (``dist.split_group``); each new group gets a
        backend of its own."""
        return True

    @property
    def options(self) -> Any:
        """The group's options (torch asks for them, e.g. to split the group). Defined here:
        without it torch's binding calls itself back for them without end."""
        return _C10dBackend.Options(BACKEND_NAME, self._timeout or timedelta(minutes=30))

    def __repr__(self) -> str:
        return f"BackendOxccl(rank={self.rank()}, size={self.size()}, transport={self.comm.transport})"

    # -- the engine ---------------------------------------------------------------------------
    def _run(
        self,
        what: str,
        calls: List[_Call],
        result: Any,
        post: Optional[Callable[[], None]] = None,
        inline: Optional[bool] = None,
        backs: Optional[list] = None,
        opts: Any = None,
    ) -> Any:
        """Runs `calls` in order: inline when small and blocking (or `inline`), else queued:
        an asynchronous call (`opts.asyncOp`, see `_async`) returns before the peers arrive
        at every size, as gloo's. The Work returns `result` once the last has finished,
        `backs` (temporaries, see `_dense`) have been copied back and `post` has run."""
        if backs:
            then = post

            def post() -> None:
                _copy_back(backs)
                if then is not None:
                    then()

        if self._held:
            self._flush_p2p()
        if inline is None:
            inline = not _async(opts) and sum(c.nbytes() for c in calls) <= INLINE_MAX_BYTES
        try:
            if inline:
                raw = self._raw
                for c in calls:
                    raw.call(*c.args())  # GIL released; raises the call's oxccl error
                if post is not None:
                    post()
                return _DoneWork(result)
            post = _in_callers_mode(post)
            handles = [self._raw.call_async(*c.args(), c.keep(), None) for c in calls]
        except InvalidArgumentError as e:
            if "unknown" not in str(e):
                raise
            # an op or dtype this build of the library lacks: say which torch call asked
            raise InvalidArgumentError(f"the oxccl backend's {what}: {e}") from None
        return _JobWork(_Job(self, what, handles, result, post))

    # -- collectives --------------------------------------------------------------------------
    def _invalid(self, msg: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"oxccl: rank {self.rank()}: {msg}")

    def _check_root(self, what: str, root: int) -> None:
        n = self.size()
        if not 0 <= root < n:
            raise self._invalid(f"{what}: root rank {root} is not in this group of {n} (ranks 0 .. {n - 1})")

    def _nonempty(self, what: str, tensors: Sequence[Any]) -> None:
        if len(tensors) == 0:
            raise self._invalid(f"{what}: requires a non-empty tensor list")

    def _same_kind(self, what: str, tensors: Sequence[torch.Tensor]) -> None:
        """gloo's rule for several tensors in one allreduce or broadcast: one dtype, one shape."""
        first = tensors[0]
        for t in tensors:
            _check_tensor(t, what)
            if t.dtype != first.dtype or t.shape != first.shape:
                raise self._invalid(
                    f"{what}: every tensor of the list must have one dtype and shape "
                    f"({first.dtype} {tuple(first.shape)} and {t.dtype} {tuple(t.shape)})"
                )

    # -- sequence numbers (gloo's: every collective call counts, from 0 on every rank) -----------
    def _get_sequence_number_for_group(self) -> int:
        """How many collectives this backend has been called for (the same on every rank of
        a group that makes the same calls; TORCH_DISTRIBUTED_DEBUG=DETAIL checks it)."""
        return self._seq

    def _set_sequence_number_for_group(self) -> None:
        """Nothing to agree on: the numbers start at 0 on every rank (as torch's own backends)."""

    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        """``dist.all_reduce``: each tensor becomes the element-wise reduction (``opts.reduceOp``,
        default sum) over the group."""
        self._seq += 1
        if len(tensors) == 1 and not self._held and (opts is None or opts.reduceOp == _SUM):
            # fast path (a tensor-parallel step's small sums, DDP's buckets): the checks of
            # _buf; inline when blocking and small, else queued as `_run` does
            t = tensors[0]
            dt = _DTYPES.get(t.dtype)
            if dt is not None and t.layout == _STRIDED and t.is_cpu and t.is_contiguous():
                n = t.nbytes
                queue = opts is not None and opts.asyncOp
                try:
                    if not queue and n <= INLINE_MAX_BYTES:
                        self._raw.call("all_reduce", dt, "sum", 0, 0, (0, 0), (t.data_ptr(), n), True)
                        return _DoneWork(tensors)
                    if queue:
                        h = self._raw.call_async("all_reduce", dt, "sum", 0, 0, (0, 0), (t.data_ptr(), n), True, t, None)
                        return _JobWork(_Job(self, "all_reduce", (h,), tensors))
                except InvalidArgumentError:
                    pass  # the general path below says which call failed
        self._nonempty("allreduce", tensors)
        if any(isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, opts)
        op = _op(opts)
        backs: list = []
        if len(tensors) == 1:
            calls = [_coll("all_reduce", None, tensors[0], op=op, backs=backs)]
            return self._run("all_reduce", calls, list(tensors), backs=backs, opts=opts)
        # gloo's form: the tensors of every rank reduced together, the result in each of them
        self._same_kind("allreduce", tensors)
        combine = _LOCAL_OPS.get(op)
        if combine is None:
            raise self._invalid(f"allreduce: {op.upper()} of several tensors in one call is not supported (gloo: neither)")
        if tensors[0].is_complex() and op != "sum":
            raise self._invalid(f"allreduce: {op.upper()} is not defined on complex tensors ({tensors[0].dtype})")
        acc = tensors[0].resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
        for t in tensors[1:]:
            acc = combine(acc, t)
        calls = [_coll("all_reduce", None, acc, op=op, backs=backs)]

        def post() -> None:
            for t in tensors:
                t.copy_(acc)

        return self._run("all_reduce", calls, list(tensors), post, backs=backs, opts=opts)

    def _sparse_allreduce(self, tensors: List[torch.Tensor], opts: Any) -> Any:
        """gloo's sparse all_reduce: every rank's (coalesced) indices and values gathered,
        summed by coalescing; the result written into the tensor. SUM only. Several sparse
        tensors of one shape and dtype (gloo's form) are summed locally first, and every one
        receives the result."""
        first = tensors[0]
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.layout != torch.sparse_coo:
                raise self._invalid("allreduce: sparse and dense tensors cannot be mixed in one call")
            if t.shape != first.shape or t.dtype != first.dtype:
                raise self._invalid(
                    "allreduce: every sparse tensor of the list must have one dtype and shape "
                    f"({first.dtype} {tuple(first.shape)} and {t.dtype} {tuple(t.shape)})"
                )
        op = _op(opts)
        if op != "sum":
            raise self._invalid(f"allreduce: sparse tensors support only SUM, not {op.upper()}")
        n = self.size()
        s = first.coalesce()
        for other in tensors[1:]:
            s = (s + other).coalesce()
        idx, val = s.indices().contiguous(), s.values().contiguous()
        nnz = idx.shape[1]
        counts = torch.empty(n, dtype=torch.int64)
        self._run("all_reduce (sparse)", [_coll("all_gather", torch.tensor([nnz]), counts, raw_bytes=True)], None, inline=True)
        m = int(counts.max())
        if m > 0:
            pi = torch.zeros((idx.shape[0], m), dtype=idx.dtype)
            pi[:, :nnz] = idx
            pv = torch.zeros((m,) + tuple(val.shape[1:]), dtype=val.dtype)
            pv[:nnz] = val
            gi = torch.empty((n,) + tuple(pi.shape), dtype=pi.dtype)
            gv = torch.empty((n,) + tuple(pv.shape), dtype=pv.dtype)
            calls = [_coll("all_gather", pi, gi, raw_bytes=True), _coll("all_gather", pv, gv, raw_bytes=True)]
            self._run("all_reduce (sparse)", calls, None, inline=True)
            c = counts.tolist()
            i_all = torch.cat([gi[r][:, : c[r]] for r in range(n)], 1)
            v_all = torch.cat([gv[r][: c[r]] for r in range(n)])
            total = torch.sparse_coo_tensor(i_all, v_all, first.shape).coalesce()
            for t in tensors:
                t.copy_(total)
        return _DoneWork(list(tensors))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        """Each tensor reduced across ranks on its own. A tensor that shares memory with an
        earlier one of the list is reduced from a copy taken before the call (gloo's result:
        as if every position were reduced once)."""
        self._seq += 1
        self._nonempty("allreduce_coalesced", tensors)
        op = _op(opts)
        backs: list = []
        calls = []
        for t in tensors:
            _check_tensor(t, "allreduce_coalesced")
        aliased = set(_overlapping(tensors)) if len(tensors) > 1 else ()
        for i, t in enumerate(tensors):
            if i in aliased:
                c = t.clone(memory_format=torch.contiguous_format)
                calls.append(_coll("all_reduce", None, c, op=op, backs=backs))
                backs.append((t, c))
            else:
                calls.append(_coll("all_reduce", None, t, op=op, backs=backs))
        return self._run("all_reduce", calls, list(tensors), backs=backs, opts=opts)

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        """``dist.broadcast``: each rank's tensor becomes the root's (``opts.rootRank``)."""
        self._seq += 1
        root = opts.rootRank if opts is not None else 0
        root_tensor = opts.rootTensor if opts is not None else 0
        self._check_root("broadcast", root)
        self._nonempty("broadcast", tensors)
        if not 0 <= root_tensor < len(tensors):
            raise self._invalid(f"broadcast: root tensor {root_tensor} is not in the list of {len(tensors)} tensors")
        if len(tensors) > 1:
            self._same_kind("broadcast", tensors)
        backs: list = []
        src = tensors[root_tensor]
        calls = [_coll("broadcast", None, src, root=root, raw_bytes=True, backs=backs)]
        post = None
        if len(tensors) > 1:  # gloo's form: tensors[rootTensor] of the root, into every tensor

            def post() -> None:
                for i, t in enumerate(tensors):
                    if i != root_tensor:
                        t.copy_(src)

        return self._run("broadcast", calls, list(tensors), post, backs=backs, opts=opts)

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        """``dist.reduce``: the root's tensor (``opts.rootRank``) becomes the element-wise
        reduction over the group; the others' are left as they were."""
        self._seq += 1
        root = opts.rootRank if opts is not None else 0
        self._check_root("reduce", root)
        if len(tensors) != 1:
            raise self._invalid(f"reduce: requires exactly one tensor, got {len(tensors)}")
        if opts is not None and opts.rootTensor != 0:
            raise self._invalid(f"reduce: root tensor {opts.rootTensor} is not in the list of 1 tensor")
        backs: list = []
        calls = [_coll("reduce", None, tensors[0], op=_op(opts), root=root, backs=backs)]
        return self._run("reduce", calls, list(tensors), backs=backs, opts=opts)

    def _gather_each(
        self, what: str, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> Any:
        """inputs[i] of every rank into output_lists[i] (one tensor per rank), each through a
        flat buffer."""
        n = self.size()
        calls, posts = [], []
        for outs, inp in zip(output_lists, inputs):
            if len(outs) != n:
                raise self._invalid(f"{what}: {len(outs)} output tensors for a group of {n}")
            _check_tensor(inp, f"{what} input")
            for o in outs:
                _check_tensor(o, f"{what} output")
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise self._invalid(
                        f"{what}: every output tensor must have the input's size and dtype "
                        f"({inp.numel()} x {inp.dtype}, got {o.numel()} x {o.dtype})"
                    )
            flat = torch.empty((n, inp.numel()), dtype=inp.dtype)
            calls.append(_coll("all_gather", _dense(inp, f"{what} input", None, None), flat, raw_bytes=True))
            posts.append((flat, outs))

        def post() -> None:
            for flat, outs in posts:
                for i, o in enumerate(outs):
                    o.copy_(flat[i].view(o.shape))

        return self._run(what, calls, [o for outs in output_lists for o in outs], post, opts=opts)

    def allgather(
        self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Any:
        """``dist.all_gather``: ``output_tensors[0][r]`` becomes rank ``r``'s input tensor."""
        self._seq += 1
        n, k = self.size(), len(input_tensors)
        self._nonempty("allgather", input_tensors)
        if len(output_tensors) != k:
            raise self._invalid(f"allgather: {len(output_tensors)} output lists for {k} input tensors")
        if k == 1:
            return self._gather_each("all_gather", output_tensors, input_tensors, opts)
        # gloo's form: several inputs per rank; every output list gets input j of rank r at r*k + j
        self._same_kind("allgather", input_tensors)
        first = input_tensors[0]
        for outs in output_tensors:
            if len(outs) != k * n:
                raise self._invalid(f"allgather: {len(outs)} tensors in an output list, expected {k} inputs x {n} ranks")
            for o in outs:
                _check_tensor(o, "allgather output")
                if o.numel() != first.numel() or o.dtype != first.dtype:
                    raise self._invalid("allgather: every output tensor must have the inputs' size and dtype")
        send = torch.stack([t.reshape(-1) for t in input_tensors])
        flat = torch.empty((n * k, first.numel()), dtype=first.dtype)

        def post() -> None:
            for outs in output_tensors:
                for i, o in enumerate(outs):
                    o.copy_(flat[i].view(o.shape))

        calls = [_coll("all_gather", _dense(send, "allgather input", None, None), flat, raw_bytes=True)]
        # The future's value is the output lists, as gloo's (not one flat list).
        return self._run("all_gather", calls, [list(outs) for outs in output_tensors], post, opts=opts)

    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any = None) -> Any:
        """torch's form: output_lists[rank][i] receives input_list[i] of that rank."""
        self._seq += 1
        n, k = self.size(), len(input_list)
        self._nonempty("allgather_coalesced", input_list)
        if len(output_lists) != n:
            raise self._invalid(f"allgather_coalesced: {len(output_lists)} output lists for a group of {n} (one per rank)")
        for r, outs in enumerate(output_lists):
            if len(outs) != k:
                raise self._invalid(f"allgather_coalesced: output list {r} has {len(outs)} tensors for {k} inputs")
        per_input = [[output_lists[r][i] for r in range(n)] for i in range(k)]
        return self._gather_each("all_gather_coalesced", per_input, input_list, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._seq += 1
        backs: list = []
        calls = [_coll("all_gather", input, output, raw_bytes=True, backs=backs)]
        return self._run("all_gather_into_tensor", calls, [output], backs=backs, opts=opts)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        """``dist.all_gather_into_tensor`` of several pairs at once: each output holds every
        rank's input, concatenated in rank order."""
        self._seq += 1
        backs: list = []
        calls = [_coll("all_gather", i, o, raw_bytes=True, backs=backs) for o, i in zip(outputs, inputs)]
        return self._run("all_gather_into_tensor", calls, list(outputs), backs=backs, opts=opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(
        self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
        """input_tensors[i][r] of every rank reduced into output_tensors[i] of rank r; the
        blocks may differ in size per rank (gloo's uneven form: through blocks padded to the
        largest)."""
        self._seq += 1
        n, me = self.size(), self.rank()
        op = _op(opts)
        self._nonempty("reduce_scatter", output_tensors)
        if len(input_tensors) != len(output_tensors):
            raise self._invalid(f"reduce_scatter: {len(input_tensors)} input lists for {len(output_tensors)} outputs")
        calls, backs, posts = [], [], []
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != n:
                raise self._invalid(f"reduce_scatter: {len(ins)} input tensors for a group of {n}")
            _check_tensor(out, "reduce_scatter output")
            for i in ins:
                _check_tensor(i, "reduce_scatter input")
                if i.dtype != out.dtype:
                    raise self._invalid(f"reduce_scatter: input {i.dtype} and output {out.dtype} differ")
            if ins[me].numel() != out.numel():
                raise self._invalid(
                    f"reduce_scatter: this rank's block has {ins[me].numel()} elements but the output {out.numel()}"
                )
            m = max(i.numel() for i in ins)
            if all(i.numel() == m for i in ins):
                flat = torch.stack([i.reshape(-1) for i in ins])
                calls.append(_coll("reduce_scatter", flat, out, op=op, backs=backs))
            else:
                flat = torch.zeros((n, m), dtype=out.dtype)
                for r, i in enumerate(ins):
                    flat[r, : i.numel()] = i.reshape(-1)
                block = torch.empty(m, dtype=out.dtype)
                calls.append(_coll("reduce_scatter", flat, block, op=op, backs=backs))
                posts.append((out, block))

        def post() -> None:
            for out, block in posts:
                out.copy_(block[: out.numel()].view(out.shape))

        return self._run("reduce_scatter", calls, list(output_tensors), post if posts else None, backs=backs, opts=opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._seq += 1
        backs: list = []
        calls = [_coll("reduce_scatter", input, output, op=_op(opts), backs=backs)]
        return self._run("reduce_scatter_tensor", calls, [output], backs=backs, opts=opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        """``dist.reduce_scatter_tensor`` of several pairs at once: each output becomes this
        rank's block of the element-wise reduction of the inputs."""
        self._seq += 1
        op = _op(opts)
        backs: list = []
        calls = [_coll("reduce_scatter", i, o, op=op, backs=backs) for o, i in zip(outputs, inputs)]
        return self._run("reduce_scatter_tensor", calls, list(outputs), backs=backs, opts=opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall(
        self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Any:
        """``dist.all_to_all``: ``output_tensors[r]`` becomes rank ``r``'s
        ``input_tensors[rank]``."""
        self._seq += 1
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise InvalidArgumentError(f"alltoall: expected {n} input and {n} output tensors")
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in list(output_tensors) + list(input_tensors)):
            raise InvalidArgumentError("alltoall: every tensor must have one dtype")
        send = torch.cat([t.reshape(-1) for t in input_tensors])
        recv = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype)

        def post() -> None:
            off = 0
            for t in output_tensors:
                t.copy_(recv[off : off + t.numel()].view(t.shape))
                off += t.numel()

        counts = ([t.numel() for t in output_tensors], [t.numel() for t in input_tensors])
        return self._alltoallv("all_to_all", send, recv, *counts, list(output_tensors), post, opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: List[int],
        input_split_sizes: List[int],
        opts: Any = None,
    ) -> Any:
        """``dist.all_to_all_single``: block ``p`` of ``input`` goes to rank ``p``, which
        stores it as block ``rank`` of ``output``; the split sizes (empty: equal blocks) give
        each block's length along the first dimension."""
        self._seq += 1
        n = self.size()
        out_counts = self._a2a_counts("output", output, output_split_sizes)
        in_counts = self._a2a_counts("input", input, input_split_sizes)
        backs: list = []
        send = _dense(input, "all_to_all_single input", None, None)
        recv = _dense(output, "all_to_all_single output", None, backs, read=False)
        post = (lambda: _copy_back(backs)) if backs else None
        return self._alltoallv("all_to_all_single", send, recv, out_counts, in_counts, [output], post, opts)

    all_to_all_single = alltoall_base

    def _a2a_counts(self, what: str, t: torch.Tensor, splits: List[int]) -> List[int]:
        """Elements per peer of all_to_all_single's `t`, split along dim 0 by `splits` (none:
        equal blocks); torch's rules (gloo's and NCCL's checkSplitSizes): a 0-dim tensor, a
        dim 0 that does not divide by the group size, split sizes that are negative or do not
        add up to dim 0 raise, before any data moves."""
        n = self.size()
        _check_tensor(t, f"all_to_all_single {what}")
        if t.dim() == 0:
            raise self._invalid(f"all_to_all_single: the {what} is a 0-dim tensor: it has no dim 0 to split")
        rows, row = t.shape[0], 1
        for d in t.shape[1:]:
            row *= d
        if not splits:
            if rows % n:
                raise self._invalid(
                    f"all_to_all_single: the {what}'s dim 0 ({rows}) does not divide equally across group size {n}"
                )
            return [rows // n * row] * n
        if len(splits) != n:
            raise self._invalid(f"all_to_all_single: {len(splits)} {what} split sizes for a group of {n}")
        if any(s < 0 for s in splits) or sum(splits) != rows:
            raise self._invalid(
                f"all_to_all_single: {what} split sizes {list(splits)} are not {n} non-negative sizes "
                f"adding up to its dim 0 ({rows})"
            )
        return [s * row for s in splits]

    def _alltoallv(
        self,
        what: str,
        send: torch.Tensor,
        recv: torch.Tensor,
        out_counts: List[int],
        in_counts: List[int],
        result: Any,
        post: Optional[Callable[[], None]] = None,
        opts: Any = None,
    ) -> Any:
        """All-to-all with per-peer element counts: one oxccl all_to_all when the blocks are
        equal, else one point-to-point group (a send and a recv per peer)."""
        n, me = self.size(), self.rank()
        if send.dtype != recv.dtype:
            raise InvalidArgumentError(f"{what}: input and output dtypes differ")
        if len(set(out_counts)) <= 1 and out_counts == in_counts:
            return self._run(what, [_coll("all_to_all", send, recv, raw_bytes=True)], result, post, opts=opts)
        if _overlapping([send, recv]):  # in place: the sends read a copy (receives land meanwhile)
            send = send.clone()
        s, r = send.reshape(-1), recv.reshape(-1)
        s_off = [sum(in_counts[:p]) for p in range(n)]
        r_off = [sum(out_counts[:p]) for p in range(n)]
        ops: List[tuple] = []
        for p in range(n):
            sblk = s[s_off[p] : s_off[p] + in_counts[p]]
            rblk = r[r_off[p] : r_off[p] + out_counts[p]]
            ops += [("copy", sblk, rblk)] if p == me else [("send", p, sblk), ("recv", p, rblk)]
        return self._p2p_group(what, ops, result, post, call="all_to_allv")

    def _p2p_group(
        self,
        what: str,
        ops: List[tuple],
        result: Any,
        post: Optional[Callable[[], None]] = None,
        *,
        call: str,
    ) -> Any:
        """Runs ``(kind, peer, tensor)`` sends and recvs as one collective of the library's
        point-to-point engine (`call`: "gather", "scatter" or "all_to_allv",
        ``Communicator::group_p2p_as``: its messages are numbered as the group's collectives
        and no other call's receive takes them), queued (after any held operations);
        ``("copy", src, dst)`` (this rank's own block) once the group has finished, so after
        the calls before it, then `post`."""
        self._flush_p2p()
        copies = [(op[1], op[2]) for op in ops if op[0] == "copy"]
        bufs = [(k, p, _buf(t, f"{what} {k} buffer", k == "recv", True)) for k, p, t in ops if k != "copy"]
        raw = [(kind, peer, 0, "uint8", b.addr, b.nbytes) for kind, peer, b in bufs]
        handle, _ = self._raw.p2p_async(raw, [b.obj for _, _, b in bufs], None, call=call)

        def finish() -> None:
            for src, dst in copies:
                dst.copy_(src.reshape(dst.shape))
            if post is not None:
                post()

        return _JobWork(_Job(self, what, [handle], result, _in_callers_mode(finish)))

    def gather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None) -> Any:
        """``dist.gather``: the root's ``output_tensors[0][r]`` becomes rank ``r``'s input
        tensor."""
        self._seq += 1
        root, me, n = opts.rootRank, self.rank(), self.size()
        self._check_root("gather", root)
        if len(input_tensors) != 1:
            raise self._invalid(f"gather: requires exactly one input tensor, got {len(input_tensors)}")
        inp = _dense(input_tensors[0], "gather input", None, None)
        if me != root:
            return self._p2p_group("gather", [("send", root, inp)], [], call="gather")
        outs = output_tensors[0] if output_tensors else []
        if len(outs) != n:
            raise InvalidArgumentError(f"gather: {len(outs)} output tensors on the root for a group of {n}")
        if any(o.numel() != inp.numel() or o.dtype != inp.dtype for o in outs):
            raise InvalidArgumentError("gather: every output tensor must have the input's size and dtype")
        backs: list = []
        tmps = [_dense(o, "gather output", None, backs, read=False) for o in outs]
        if any(_overlapping([inp, o]) for o in tmps):  # the root's own block is copied after the receives
            inp = inp.clone()
        ops = [("copy", inp, o) if p == me else ("recv", p, o) for p, o in enumerate(tmps)]
        return self._p2p_group("gather", ops, list(outs), lambda: _copy_back(backs), call="gather")

    def scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]], opts: Any = None) -> Any:
        """``dist.scatter``: each rank's output tensor becomes the root's
        ``input_tensors[0][rank]``."""
        self._seq += 1
        root, me, n = opts.rootRank, self.rank(), self.size()
        self._check_root("scatter", root)
        if len(output_tensors) != 1:
            raise self._invalid(f"scatter: requires exactly one output tensor, got {len(output_tensors)}")
        backs: list = []
        user_out = output_tensors[0]
        out = _dense(user_out, "scatter output", None, backs, read=False)
        if me != root:
            return self._p2p_group("scatter", [("recv", root, out)], [user_out], lambda: _copy_back(backs), call="scatter")
        ins = input_tensors[0] if input_tensors else []
        if len(ins) != n:
            raise InvalidArgumentError(f"scatter: {len(ins)} input tensors on the root for a group of {n}")
        if any(i.numel() != out.numel() or i.dtype != out.dtype for i in ins):
            raise InvalidArgumentError("scatter: every input tensor must have the output's size and dtype")
        ins = [_dense(i, "scatter input", None, None) for i in ins]
        ops = [("copy", i, out) if p == me else ("send", p, i) for p, i in enumerate(ins)]
        return self._p2p_group("scatter", ops, [user_out], lambda: _copy_back(backs), call="scatter")

    def barrier(self, opts: Any = None) -> Any:
        """``dist.barrier``: returns (or its Work completes) once every rank has called it."""
        self._seq += 1
        return self._run("barrier", [_Call("barrier", None, None)], [], inline=not _async(opts))

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier, through the store: rank 0 waits (up to `timeout`) for
        every rank to arrive and names the ones that did not; the others wait for rank 0."""
        if self._store is None:
            raise InvalidArgumentError("monitored_barrier: this group has no store")
        timeout = opts if isinstance(opts, timedelta) else getattr(opts, "timeout", None)  # BarrierOptions
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = timedelta(seconds=timeout)
        # No timeout given: the group's. A zero or negative one is a timeout too (as gloo's):
        # it expires at once rather than falling back on the group's.
        t = timeout if isinstance(timeout, timedelta) else (self._timeout or timedelta(minutes=30))
        ms = int(t.total_seconds() * 1000)
        self._barriers += 1
        key = f"oxccl/monitored_barrier/{self._barriers}"
        me, n = self.rank(), self.size()
        store = self._store
        # The errors carry gloo's phrases too ("Rank 1 failed to pass monitoredBarrier", ...),
        # which code and tests written for gloo look for.
        if me != 0:
            store.set(f"{key}/{me}", "1")
            try:
                if t.total_seconds() <= 0:
                    if not store.check([f"{key}/done"]):
                        raise TimeoutError(f"the timeout ({t.total_seconds():g} s) is not positive")
                else:
                    store.wait([f"{key}/done"], t)
            except Exception as e:
                raise TimeoutError(
                    f"oxccl: rank {me}: monitored_barrier: rank 0 did not release the barrier "
                    f"within {t.total_seconds():g} s ({e}); Rank {me} successfully reached "
                    f"monitoredBarrier, but received errors while waiting for send/recv from rank 0"
                ) from None
            return
        if t.total_seconds() <= 0:
            raise TimeoutError(
                f"oxccl: rank 0: monitored_barrier: the timeout ({t.total_seconds():g} s) is not "
                f"positive: Rank 0 timed out in monitoredBarrier after {ms} ms"
            )
        deadline = time.monotonic() + t.total_seconds()
        missing = []
        for p in range(1, n):
            left = max(deadline - time.monotonic(), 0.001)
            try:
                store.wait([f"{key}/{p}"], timedelta(seconds=left))
            except Exception:
                missing.append(p)
                if not wait_all_ranks:
                    break
        if missing:
            gloo = (
                f"Rank {missing[0]} failed to pass monitoredBarrier"
                if len(missing) == 1
                else f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier"
            )
            raise TimeoutError(
                f"oxccl: rank 0: monitored_barrier: rank(s) {missing} did not reach the barrier "
                f"within {t.total_seconds():g} s ({gloo} in {ms} ms)"
            )
        store.set(f"{key}/done", "1")

    # -- point to point -----------------------------------------------------------------------
    def _hold(self, kind: str, tensors: List[torch.Tensor], peer: Optional[int], tag: int) -> Any:
        """Holds a send or recv (``peer`` None: from any rank) until a wait, a future, the
        next collective or shutdown runs every held one as one group."""
        batch = _batch_frame()
        if batch is not None and batch is not self._batch:
            self._batch, self._batches = batch, self._batches + 1
        serial = self._batches if batch is not None else 0
        try:
            if not 0 <= tag < 1 << 32:
                raise InvalidArgumentError(f"{kind}: tag {tag} is outside 0 .. 2**32-1")
            if peer is not None and not 0 <= peer < self.size():
                raise InvalidArgumentError(f"{kind}: rank {peer} is not in this group of {self.size()}")
            what = f"{kind} {'to' if kind == 'send' else 'from'} {'any rank' if peer is None else f'rank {peer}'} (tag {tag})"
            job = _Job(self, what, result=list(tensors))
            bufs = [_buf(t, f"{kind} buffer", kind == "recv", True) for t in tensors]  # checked now
        except BaseException as e:
            if serial:
                self._drop_batch(serial, e)
            raise
        job.held = True
        self._held_batch.append((serial, len(self._held)))
        for b in bufs:
            job.sources = len(self._held)  # the index of its (last) operation in the group
            self._held.append((kind, peer, tag, b))
        self._held_jobs.append(job)
        return _JobWork(job)

    def _drop_batch(self, serial: int, why: BaseException) -> None:
        """A batch_isend_irecv refused at one of its operations: its operations held before
        that one are dropped, not sent at the next flush (torch raises without returning their
        Works, and a retry of the batch would send them twice: a later recv of the peer
        would take the extra copy, another call's data)."""
        while self._held_jobs and self._held_batch[-1][0] == serial:
            job = self._held_jobs.pop()
            _, first = self._held_batch.pop()
            del self._held[first:]
            job.error, job.done, job.held = why, True, False

    def _flush_p2p(self) -> None:
        """Runs every held send and recv as one group of the library's point-to-point engine:
        its operations progress together (so no set of ranks waits on each other in a
        cycle, and send-first exchanges of any size complete), and messages are matched by
        source and tag, in send order per tag, across groups."""
        if not self._held:
            return
        held, jobs = self._held, self._held_jobs
        self._held, self._held_jobs, self._held_batch, self._batch = [], [], [], None
        try:
            ops = [(kind, peer, tag, "uint8", b.addr, b.nbytes) for kind, peer, tag, b in held]
            handle, sources = self._raw.p2p_async(ops, [b.obj for _, _, _, b in held], None)
        except BaseException as e:  # noqa: BLE001 - every held job reports it
            for j in jobs:
                j.error, j.done, j.held = e, True, False
            return
        for j in jobs:
            j.handles = [handle]
            j.sources = (sources, j.sources)
            j.held = False

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Any:
        """``dist.send``/``isend`` to ``dst`` with ``tag``: held until a held operation's Work
        is waited on, the next collective starts or the group shuts down, then run with every
        held operation as one group (see the module's docstring)."""
        return self._hold("send", tensors, dst, tag)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Any:
        """``dist.recv``/``irecv`` from ``src`` with ``tag``, held as ``send`` is."""
        return self._hold("recv", tensors, src, tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Any:
        """A recv from whichever rank sends with ``tag`` first; ``work._source_rank()`` (what
        ``dist.recv`` returns) says which."""
        return self._hold("recv", tensors, None, tag)

    # -- groups -------------------------------------------------------------------------------
    def split(self, store: Any, ranks: List[int], opts: Any = None) -> Optional["BackendOxccl"]:
        """A backend for `ranks` (ranks of this group), rendezvousing through `store`."""
        me = self.rank()
        if me not in ranks:
            if _CPP is None:
                # torch's binding of a Python backend crashes (SIGSEGV) on a None here:
                # `_split_group` turns this into torch's None (the rank is not a member)
                raise _NotAMember()
            return None
        timeout = getattr(opts, "_timeout", None) or self._timeout
        return _make(store, ranks.index(me), len(ranks), timeout, getattr(opts, "group_name", None), (self.comm, ranks))

    def shutdown(self) -> None:
        """torch's ``destroy_process_group`` (and ``ProcessGroup.shutdown``): held sends and
        receives go out, queued calls (``async_op=True``, of this backend and of the C++ one
        over it) are waited for, each bounded by its timeout, then the communicator is closed
        (``Comm.close``: the other ranks see this rank leave, its links and shared memory are
        freed); a later call on this backend raises ``oxccl.AbortedError``. Idempotent."""
        if self._shut:
            return
        self._shut = True
        try:
            self._flush_p2p()
        finally:
            # Waits for the queued calls, then closes (even when the flush failed).
            self.comm.close()
        _WRAPPED_BY_TORCH.discard(self)
        if _WATCHER and _WATCHER[0]() is self.comm:
            # A group made later (after a new init_process_group) is not this one's to watch.
            _WATCHER.clear()
        # The store goes to `_PREVIOUS_STORE`, which keeps it until the next backend is made
        # (see there): not with this backend, whose lifetime is not the group's.
        if self._store is not None:
            _keep_store(self._store)
        self._store = None

    def abort(self) -> None:
        """torch's ``abort``: every blocked and queued call fails at once (here and, told by
        the watchdog, on the other ranks), then the communicator is closed."""
        self.comm.abort()
        self.shutdown()


def _batch_frame() -> Any:
    """The frame of torch's ``batch_isend_irecv`` that the current isend/irecv is part of
    (torch issues a batch's operations one by one to a backend without coalescing), or None."""
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return None
        if f.f_code.co_name == "batch_isend_irecv" and f.f_globals.get("__name__") == dist.distributed_c10d.__name__:
            return f
        f = f.f_back
    return None


#: How long the exit hook waits for queued calls of the C++ backend to complete (each is
#: bounded by its group's timeout; this bounds the exit).
_EXIT_DRAIN_S = 60.0


def _drain_at_exit() -> None:
    """At interpreter exit (before finalization): lets queued calls of the C++ backend complete
    and their completion threads let go of tensors and futures, so that none is still running
    while the interpreter tears down. `_CPP` is unset when the import failed before it
    (``OXCCL_TORCH_BACKEND=garbage``): then there is nothing to drain."""
    cpp = globals().get("_CPP")
    if cpp is not None:
        cpp.drain_completions(_EXIT_DRAIN_S)


atexit.register(_drain_at_exit)  # before _flush_at_exit, so it runs after it

_BACKENDS: "weakref.WeakSet[BackendOxccl]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    # Held sends of a rank that never waited go out before the process ends (registered after
    # oxccl's own drain, so it runs before it).
    for b in list(_BACKENDS):
        try:
            b._flush_p2p()
        except Exception:  # pragma: no cover - best effort at exit
            pass


#: The name this class had when it was a ProcessGroup.
ProcessGroupOxccl = BackendOxccl


def _timeout_s(timeout: Any) -> Optional[float]:
    if os.environ.get("OXCCL_TIMEOUT"):
        return None
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return None


#: How many backends this process has made per group name: the n-th of a group publishes its
#: unique id under its own key. torch names groups the same again after
#: destroy_process_group ("0", ...), and rank 0's store server on MASTER_PORT may be the
#: previous one (torch reuses a live server of the process on that port) still holding the
#: previous id: a rank that runs ahead must not read that one (it would dial a listener that
#: is gone while rank 0 waits for it). Every member makes its group's backends in the same order.
_MADE: Dict[Any, int] = {}


#: The store of the backend shut down last, with the id of the process that kept it (held by
#: `_keep_store`, let go of by `_make`).
_PREVIOUS_STORE: List[Tuple[int, Any]] = []

#: Stores a forked child inherited from its parent: never freed (see `_leak_parents_store`).
_PARENTS_STORES: List[Any] = []


def _leak_parents_store() -> None:
    """In a forked child, leaks the store its parent kept (`_keep_store`): it is never freed,
    not by `_make`, not at exit. torch's TCPStore destructor detaches a thread that exists
    only in the parent (``std::thread::detach``: "terminate called after throwing an instance
    of 'std::system_error' what(): Invalid argument", SIGABRT), and the server it may hold is
    the parent's. Runs after ``os.fork`` in the child, at exit, and in `_make` (a child forked
    without Python's handlers)."""
    me = os.getpid()
    mine = [(pid, store) for pid, store in _PREVIOUS_STORE if pid == me]
    for pid, store in _PREVIOUS_STORE:
        if pid != me:
            _PARENTS_STORES.append(store)
            # One reference more than any owner gives back: the interpreter's finalization
            # clears this module's lists, and the store must outlive that too.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))
    _PREVIOUS_STORE[:] = mine


os.register_at_fork(after_in_child=_leak_parents_store)
atexit.register(_leak_parents_store)


def _keep_store(store: Any) -> None:
    """Keeps `store` alive after its group's shutdown, until the next backend of this process
    is made (or the process exits).

    Why: with ``env://`` (and ``tcp://``) global rank 0's store is the TCPStore server on
    MASTER_PORT. After ``destroy_process_group`` a fast rank starts the next
    ``init_process_group`` and connects to that port at once. If rank 0 has not torn its
    server down yet, the fast rank is served by the old server, which then closes under it
    ("Failed to recv, got 0 bytes") while rank 0's new server waits for it until torch's store
    timeout (30 min by default). Kept alive, the server on the port never goes away between
    two inits: rank 0's next TCPStore on that port reuses it (torch's ``multi_tenant``
    stores, as env:// makes them), so every rank reaches the same server whenever it comes.
    Keys of the old group that remain there are not read: each backend of a group publishes
    its unique id under its own key (see `_MADE`)."""
    _PREVIOUS_STORE[:] = [(os.getpid(), store)]


#: The default group's communicator (a weak reference), made by the last `_create` for a
#: default group: it watches the init of every group made after it (`_make`'s `watch`).
_WATCHER: List[Any] = []


def _make(
    store: Any, rank: int, size: int, timeout: Any, group_id: Any, watch: Optional[Tuple[Comm, List[int]]] = None
) -> BackendOxccl:
    """A backend for rank `rank` of `size`. With `watch` = (communicator, ranks there of the new
    group's ranks), that communicator watches the init: a member it loses meanwhile fails the
    init at once instead of after the timeout, and, later, the new group."""
    # The new group's store exists (torch made it first, reusing a kept server on its port):
    # the previous one need not be kept any longer (unless a parent process kept it).
    _leak_parents_store()
    _PREVIOUS_STORE.clear()
    n = _MADE.get(group_id, 0)
    _MADE[group_id] = n + 1
    key = f"oxccl/unique_id/{n}"
    if rank == 0:
        uid = _oxccl.new_unique_id(os.environ.get("OXCCL_ROOT_IP"))
        store.set(key, uid)
    else:
        uid = store.get(key).decode()
    if watch is None:
        raw = _oxccl.init_with_id(uid, rank, size, _timeout_s(timeout))
    else:
        raw = _oxccl.init_with_id(uid, rank, size, _timeout_s(timeout), watch[0]._raw, list(watch[1]))
    return BackendOxccl(Comm(raw), rank, size, store, timeout if isinstance(timeout, timedelta) else None, group_id)


_TRACE_RULES = "torch._dynamo.trace_rules"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once the module `name` has been imported (once): used to tell
    dynamo about oxccl when it is imported, since importing it here would cost seconds."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None) if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, then = loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            run(module)
            then(module)

        loader.exec_module = exec_module
        return spec


def _skip_in_dynamo(trace_rules: Any) -> None:
    try:
        trace_rules.add(__name__.split(".")[0])
    except Exception:  # noqa: BLE001 - a private API: without it, compile still works (slower)
        pass


if _TRACE_RULES in sys.modules:
    _skip_in_dynamo(sys.modules[_TRACE_RULES])
else:
    # The oxccl package is code for torch.compile to run, not trace: torch calls this backend
    # from C++ (e.g. DDP's reducer, inside a compiled forward), and dynamo would otherwise
    # trace it and break its graph on the native calls.
    sys.meta_path.insert(0, _AfterImport(_TRACE_RULES, _skip_in_dynamo))


def _c_api_version() -> int:
    """The version of the library's C function table (``oxcclApi_t.version``, its first field),
    read from the capsule ``oxccl._oxccl._C_API`` the C++ backend is handed."""
    import ctypes

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    table = get(_oxccl._C_API, b"oxccl._C_API")
    return int(ctypes.c_uint32.from_address(table).value)


def _load_cpp() -> Any:
    """The C++ backend's module (oxccl/csrc/backend.cpp), or None: then a one-line warning,
    and the Python backend serves. The module is the one built for this torch and oxccl in the
    package (``python -m oxccl.build_torch_ext``) or in the cache, else it is built into the
    cache now, once (see :mod:`oxccl.build_torch_ext`). ``OXCCL_TORCH_BACKEND=python`` chooses
    the Python backend without a warning."""
    choice = os.environ.get("OXCCL_TORCH_BACKEND", "cpp").lower()
    if choice == "python":
        return None
    if choice != "cpp":
        raise InvalidArgumentError(f"OXCCL_TORCH_BACKEND={choice!r}: expected 'cpp' or 'python'")
    import warnings

    from . import build_torch_ext

    name = f"{__package__}.{build_torch_ext.NAME}"
    try:
        build_torch_ext.check_loadable()
        path = build_torch_ext.find_or_build()
    except build_torch_ext.BuildUnavailable as e:
        why = str(e)
    except OSError as e:  # the cache cannot be written (a full disk, a read-only home)
        why = f"cannot build it into the cache {build_torch_ext.cache_root()}: {e}"
    except ValueError as e:  # a malformed OXCCL_TORCH_EXT_BUILD, _TIMEOUT or _SANITIZE; ASan not loaded
        raise InvalidArgumentError(str(e)) from None
    else:
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except ImportError as e:
            sys.modules.pop(name, None)
            why = f"{path} does not load: {e}"
        else:
            have, want = _c_api_version(), getattr(module, "API_VERSION", None)
            if have == want:
                return module
            why = f"{path} was built for the C API version {want}, the library has {have}: rebuild it"
    warnings.warn(
        f"oxccl: the C++ torch backend is not available ({why}); using the Python backend, which "
        "costs ~30 us more per call",
        stacklevel=3,
    )
    return None


_CPP = _load_cpp()


class _NotAMember(Exception):
    """The Python backend's split on a rank outside the new group (see `_split_group`)."""


_C10D_SPLIT_GROUP = dist.ProcessGroup.split_group


def _split_group(pg: Any, *args: Any, **kwargs: Any) -> Any:
    """``ProcessGroup.split_group``, where the Python backend alone says "not a member" by an
    exception (torch's binding of a Python backend's split crashes on the None a C++ backend
    returns): torch's answer for a rank outside the split, None (``dist.split_group`` then
    returns ``GroupMember.NON_GROUP_MEMBER``)."""
    try:
        return _C10D_SPLIT_GROUP(pg, *args, **kwargs)
    except _NotAMember:
        return None


if _CPP is None:
    dist.ProcessGroup.split_group = _split_group


def _wrap(backend: Optional[BackendOxccl]) -> Any:
    """The C++ backend over `backend` (its hot calls go to the library through the C ABI, the
    rest to `backend`), when built."""
    if _CPP is None or backend is None:
        return backend
    timeout = backend._timeout.total_seconds() if backend._timeout is not None else -1.0
    return _CPP.BackendOxcclCpp(backend, backend.comm.c_comm(), _oxccl._C_API, timeout, _wrap)


# -------------------------------------------------------------------------------------------
# Inference ops: all_reduce and all_gather for tensor-parallel inference, without c10d.
# -------------------------------------------------------------------------------------------
#: oxccl's op numbers (oxcclRedOp_t) of torch's ReduceOps.
_OP_CODES: Dict[Any, int] = {
    _RT.SUM: 0, _RT.PRODUCT: 1, _RT.MAX: 2, _RT.MIN: 3, _RT.AVG: 4, _RT.BAND: 5, _RT.BOR: 6, _RT.BXOR: 7,
}
_OP_NAMES = ("sum", "prod", "max", "min", "avg", "band", "bor", "bxor")
_OP_BY_NAME = {**{n: i for i, n in enumerate(_OP_NAMES)}, "product": 1}

#: id(ProcessGroup) -> (weak reference to it, its handle, its size): the groups the inference
#: ops have been called on.
_GROUPS: Dict[int, Tuple[Any, int, int]] = {}

#: The Python backend's groups by handle (when the C++ backend is not built; its groups are in
#: csrc/inference.cpp's table).
_PY_GROUPS: Dict[int, "weakref.ref[BackendOxccl]"] = {}

_WORLD = dist.distributed_c10d._world
#: The attribute behind torch's ``_world.default_pg`` property (read per call: 5x faster).
_DEFAULT_PG = "_default_pg" if "_default_pg" in vars(_WORLD) else "default_pg"
_TENSOR = torch.Tensor


def _op_code(op: Any) -> int:
    if isinstance(op, str):
        code = _OP_BY_NAME.get(op.lower())
    else:
        code = _OP_CODES.get(op)
        if code is None:
            code = _OP_CODES.get(getattr(op, "op", None))
    if code is None:
        raise InvalidArgumentError(
            f"inference_all_reduce: ReduceOp {op} is not supported (SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR)"
        )
    return code


def _group(group: Any) -> Tuple[Any, int, int]:
    """(weakref, handle, size) of `group` (None: the default group), an oxccl group."""
    if group is None:
        group = _WORLD.default_pg
        if group is None:
            raise InvalidArgumentError("oxccl inference op: no default group (call dist.init_process_group first)")
    # under torch.compile, a ProcessGroup reaches the fake kernel as torch's FakeScriptObject
    group = getattr(group, "real_obj", group)
    entry = _GROUPS.get(id(group))
    if entry is not None and entry[0]() is group:
        return entry
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception as e:  # noqa: BLE001 - torch says why (e.g. no CPU backend)
        raise InvalidArgumentError(f"oxccl inference op: the group has no oxccl CPU backend ({e})") from None
    if _CPP is not None and isinstance(backend, _CPP.BackendOxcclCpp):
        handle = backend.inference_handle
    elif isinstance(backend, BackendOxccl):
        handle = getattr(backend, "_inference_handle", None)
        if handle is None:
            handle = backend._inference_handle = len(_PY_GROUPS) + 1
            _PY_GROUPS[handle] = weakref.ref(backend)
    else:
        raise InvalidArgumentError(
            f"oxccl inference op: the group's CPU backend is {type(backend).__name__}, not oxccl's "
            "(make the group with backend='oxccl')"
        )
    entry = (weakref.ref(group, lambda _r, key=id(group): _GROUPS.pop(key, None)), handle, backend.size())
    _GROUPS[id(group)] = entry
    return entry


def _check_inference_tensor(tensor: Any, what: str) -> None:
    """A clear error for a tensor whose memory the library cannot use (a meta tensor has
    none; a GPU tensor's is not host memory). Fake tensors under torch.compile report the
    device of the tensor they stand for."""
    if isinstance(tensor, torch.Tensor) and not tensor.is_cpu:
        raise InvalidArgumentError(f"{what}: the tensor is on {tensor.device}; oxccl works on CPU tensors")


def inference_all_reduce(tensor: torch.Tensor, op: Any = _SUM, group: Any = None) -> torch.Tensor:
    """All-reduces `tensor` in place over `group` (an oxccl group; None: the default group)
    and returns it: the op of tensor-parallel inference, as DeepSpeed's
    ``inference_all_reduce`` and vLLM's/SGLang's shared-memory all-reduce, on any oxccl group,
    for every ReduceOp the backend has but PREMUL_SUM and every dtype it reduces.

    Eager calls go straight to the library on the calling thread (no c10d Work, no
    dispatcher); under ``torch.compile`` (also ``fullgraph=True``) the call is the operator
    ``torch.ops.oxccl.inference_all_reduce_``: there give `op` by name (``"max"``; also
    accepted eagerly), since dynamo cannot put a ReduceOp into a graph. Bounded by the
    group's timeout; raises oxccl's
    errors (``oxccl.TimeoutError``, ``oxccl.PeerLostError``, ...). Non-contiguous tensors go
    through a contiguous copy. Point-to-point operations held by the group (isend/irecv not
    yet waited on) are not flushed first, and the call does not count in the group's
    sequence numbers."""
    _check_inference_tensor(tensor, "inference_all_reduce")
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and tensor.is_leaf and torch.is_grad_enabled():
        # What torch's own in-place ops raise: writing into it would lose its gradient.
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    g = group if group is not None else getattr(_WORLD, _DEFAULT_PG)
    entry = _GROUPS.get(id(g))
    if entry is None or entry[0]() is not g:
        entry = _group(group)
    code = 0 if op is _SUM else _op_code(op)
    if _CPP is not None and type(tensor) is _TENSOR:
        _CPP.inference_all_reduce_(tensor, entry[1], code)
    else:  # a tensor subclass (fake, functional, ...: torch.compile), or the Python backend
        torch.ops.oxccl.inference_all_reduce_(tensor, entry[1], code)
    return tensor


def inference_all_gather(tensor: torch.Tensor, group: Any = None, dim: int = 0) -> torch.Tensor:
    """The tensors of every rank of `group` (an oxccl group; None: the default group), in rank
    order, concatenated along `dim` (as ``torch.cat``; a 0-d tensor counts as one element):
    the vocabulary-parallel logits' gather of tensor-parallel inference. Any dtype; the shapes
    must be the same on every rank. Eager calls go straight to the library; under
    ``torch.compile`` the call is the operator ``torch.ops.oxccl.inference_all_gather``
    (concatenating along dim 0), then a view. Bounded by the group's timeout; raises oxccl's
    errors."""
    _check_inference_tensor(tensor, "inference_all_gather")
    g = group if group is not None else getattr(_WORLD, _DEFAULT_PG)
    entry = _GROUPS.get(id(g))
    if entry is None or entry[0]() is not g:
        entry = _group(group)
    if _CPP is not None and type(tensor) is _TENSOR:
        out = _CPP.inference_all_gather(tensor, entry[1])
    else:
        out = torch.ops.oxccl.inference_all_gather(tensor, entry[1])
    if dim == 0 or tensor.dim() == 0:
        return out
    # out is [n * d0, ...]: rank blocks along dim 0; move them to `dim`
    n = entry[2]
    d = dim % tensor.dim()
    shape = tensor.shape
    blocks = out.view((n,) + tuple(shape))
    return blocks.movedim(0, d).reshape(shape[:d] + (n * shape[d],) + shape[d + 1 :])


def _py_group(handle: int, what: str) -> "BackendOxccl":
    ref = _PY_GROUPS.get(handle)
    backend = ref() if ref is not None else None
    if backend is None:
        raise InvalidArgumentError(f"oxccl: {what}: group handle {handle} is not a live oxccl group of this process")
    return backend


def _py_all_reduce_(tensor: torch.Tensor, group: int, op: int = 0) -> None:
    """The Python backend's kernel of ``torch.ops.oxccl.inference_all_reduce_``."""
    backend = _py_group(group, "inference_all_reduce")
    if not 0 <= op < len(_OP_NAMES):
        raise InvalidArgumentError(f"oxccl: inference_all_reduce: op {op} is not one of oxccl's (0 SUM .. 7 BXOR)")
    if tensor.dtype not in _DTYPES:  # as the C++ kernel: only what the library reduces
        raise InvalidArgumentError(
            f"oxccl: rank {backend.rank()}: inference_all_reduce: dtype {tensor.dtype} cannot be reduced "
            f"(oxccl reduces {', '.join(sorted(set(_DTYPES.values())))})"
        )
    backs: list = []
    call = _coll("all_reduce", None, tensor, op=_OP_NAMES[op], backs=backs)
    backend._raw.call(*call.args())
    _copy_back(backs)


def _py_all_reduce(tensor: torch.Tensor, group: int, op: int = 0) -> torch.Tensor:
    out = tensor.clone(memory_format=torch.contiguous_format)
    _py_all_reduce_(out, group, op)
    return out


def _gathered_shape(tensor: torch.Tensor, n: int) -> List[int]:
    shape = list(tensor.shape) or [1]
    shape[0] *= n
    return shape


def _py_all_gather(tensor: torch.Tensor, group: int) -> torch.Tensor:
    backend = _py_group(group, "inference_all_gather")
    src = tensor.resolve_conj().resolve_neg().contiguous()
    out = torch.empty(_gathered_shape(tensor, backend.size()), dtype=tensor.dtype)
    call = _coll("all_gather", src, out, raw_bytes=True)
    backend._raw.call(*call.args())
    return out


def _define_python_ops() -> Any:
    """Registers the inference operators with the Python backend's kernels (the C++ backend's
    module registers its own when it is loaded)."""
    lib = torch.library.Library("oxccl", "DEF")
    lib.define("inference_all_reduce_(Tensor(a!) self, int group, int op=0) -> ()")
    lib.define("inference_all_reduce(Tensor self, int group, int op=0) -> Tensor")
    lib.define("inference_all_gather(Tensor self, int group) -> Tensor")
    lib.impl("inference_all_reduce_", _py_all_reduce_, "CPU")
    lib.impl("inference_all_reduce", _py_all_reduce, "CPU")
    lib.impl("inference_all_gather", _py_all_gather, "CPU")
    lib.impl("inference_all_reduce_", lambda t, group, op=0: None, "Meta")
    lib.impl("inference_all_reduce", lambda t, group, op=0: torch.empty_like(t, memory_format=torch.contiguous_format), "Meta")
    lib.impl(
        "inference_all_gather",
        lambda t, group: t.new_empty(_gathered_shape(t, _py_group(group, "inference_all_gather").size())),
        "Meta",
    )
    return lib


def _allow_in_graph(dynamo: Any) -> None:
    """torch.compile writes calls of the inference ops into its graph as they are (AOT
    autograd then traces them into the operators): the oxccl package is otherwise code that
    dynamo skips, which would break the graph."""
    try:
        dynamo.allow_in_graph(inference_all_reduce)
        dynamo.allow_in_graph(inference_all_gather)
    except Exception:  # noqa: BLE001 - a compile without it breaks the graph, still correct
        pass


_PY_OPS = _define_python_ops() if _CPP is None else None
_DYNAMO = "torch._dynamo"
if _DYNAMO in sys.modules and hasattr(sys.modules[_DYNAMO], "allow_in_graph"):
    _allow_in_graph(sys.modules[_DYNAMO])
else:
    sys.meta_path.insert(0, _AfterImport(_DYNAMO, _allow_in_graph))


def _shm_allocator_settings() -> Optional[int]:
    """The threshold of the shared-memory CPU allocator in bytes (``OXCCL_TORCH_SHM_MIN``,
    default 8 KiB; a number with an optional K/M/G suffix), or None when
    ``OXCCL_TORCH_ALLOCATOR=0`` turns it off."""
    on = os.environ.get("OXCCL_TORCH_ALLOCATOR", "1").strip().lower()
    if on in ("0", "false", "off", "no"):
        return None
    if on not in ("1", "true", "on", "yes"):
        raise InvalidArgumentError(f"OXCCL_TORCH_ALLOCATOR={on!r}: expected 0 or 1")
    text = os.environ.get("OXCCL_TORCH_SHM_MIN", "8K").strip()
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    try:
        value = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        value = -1
    if not 0 <= value <= 1 << 40:
        raise InvalidArgumentError(f"OXCCL_TORCH_SHM_MIN={text!r}: expected bytes from 0 to 1024G, e.g. 1M")
    return value


def _install_shm_allocator() -> None:
    """Makes large CPU tensors come from oxccl's pool of shared buffers (with the C++ backend,
    once per process, unless turned off): DDP's buckets and FSDP's flat buffers, made after
    ``init_process_group``, then take the shared-buffer path."""
    min_bytes = _shm_allocator_settings()
    if _CPP is not None and min_bytes is not None:
        _CPP.install_shm_allocator(_oxccl._C_API, min_bytes)


def _shm_allocator_min_bytes() -> Optional[int]:
    """The threshold of the shared-memory CPU allocator if it serves torch's CPU allocations,
    else None (a hidden query for tests)."""
    return None if _CPP is None else _CPP.shm_allocator_min_bytes()


#: Python backends that only C++ holds (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps them in torch's
#: ProcessGroupWrapper): without a Python reference their methods would no longer be found.
_WRAPPED_BY_TORCH: "set[BackendOxccl]" = set()


def _create(dist_opts: Any, backend_options: Any = None) -> Any:
    # torch gives a new group's ranks in the default group (empty for the default group).
    ranks = list(getattr(dist_opts, "global_ranks_in_group", None) or [])
    world = _WATCHER[0]() if _WATCHER and ranks else None
    made = _make(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.timeout,
        dist_opts.group_id,
        (world, ranks) if world is not None else None,
    )
    if not ranks:
        _WATCHER[:] = [weakref.ref(made.comm)]
    backend = _wrap(made)
    if isinstance(backend, BackendOxccl) and dist.get_debug_level() == dist.DebugLevel.DETAIL:
        _WRAPPED_BY_TORCH.add(backend)
    _install_shm_allocator()
    return backend


dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])

# oxccl keeps its own flight records (OXCCL_FLIGHT_RECORDER): torch need not hook every call
# to record it (that hook costs more than the call itself for small messages).
_FR_SELF = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
if isinstance(_FR_SELF, set):
    _FR_SELF.add(BACKEND_NAME)
