"""oxccl: collective communication for numpy arrays and torch CPU tensors.

    import numpy as np, oxccl
    comm = oxccl.init()                      # under torchrun, `oxccl run`, srun, mpirun
    x = np.full(1024, comm.rank, np.float32)
    comm.all_reduce(x, op="sum")             # in place, like NCCL
    h = comm.all_gather(x, async_op=True)    # queued; runs on oxccl's stream thread
    everyone = h.wait()

Every collective takes C-contiguous numpy arrays or contiguous torch CPU tensors of int8,
uint8, uint16, int32, uint32, int64, uint64, float16, bfloat16 (torch, or numpy with
ml_dtypes), float32, float64 or bool; anything else raises ``oxccl.InvalidArgumentError``. Calls release the
GIL while they run. ``import oxccl.torch`` registers the torch.distributed backend "oxccl".
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import warnings
import weakref
from typing import Any, Optional

import numpy as np

from . import _oxccl
from ._errors import (
    AbortedError,
    Error,
    InvalidArgumentError,
    MismatchError,
    PeerLostError,
    TimeoutError,
)

__version__ = _oxccl.__version__

__all__ = [
    "init",
    "new_unique_id",
    "Comm",
    "Handle",
    "Error",
    "TimeoutError",
    "PeerLostError",
    "MismatchError",
    "InvalidArgumentError",
    "AbortedError",
    "OPS",
    "DTYPES",
]

#: Reduction ops, by name (``"product"`` and ``"mean"`` are accepted as aliases). The bitwise
#: ops take integers and bool only; on bool, sum and max are a logical or, prod and min a
#: logical and, and avg is refused. ``op=("premul_sum", s)`` is NCCL's
#: ``ncclRedOpCreatePreMulSum``: each rank's input times its own scalar ``s``, then summed
#: (for integer and bool tensors ``s`` must be an integer).
OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor", "premul_sum")

#: Element types, by oxccl's name.
DTYPES = (
    "int8",
    "uint8",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "bool",
)

def _op_name(op: Any) -> str:
    """The op as the native side reads it: a name, or ``premul_sum:SCALAR`` for
    ``("premul_sum", scalar)``."""
    if isinstance(op, tuple) and len(op) == 2 and isinstance(op[0], str) and op[0].lower() == "premul_sum":
        scalar = op[1]
        item = getattr(scalar, "item", None)  # a 0-d tensor or numpy scalar
        if item is not None:
            scalar = item()
        if isinstance(scalar, (int, float)) and not isinstance(scalar, bool):
            return f"premul_sum:{float(scalar)!r}"
    elif isinstance(op, str):
        o = op.lower()
        o = {"product": "prod", "mean": "avg", "average": "avg"}.get(o, o)
        if o in OPS and o != "premul_sum":
            return o
    raise InvalidArgumentError(
        f"unsupported reduction op {op!r}: expected one of {', '.join(OPS[:-1])} or ('premul_sum', scalar)"
    )


class _Buf:
    """An array or tensor as the native module takes it: ``view``, an object with a buffer
    (the array itself, or a numpy view of the tensor's memory), whose memory, contiguity,
    writability and element type the native module checks; ``declared``, the element type
    where the buffer's format cannot say it (bfloat16, seen as 16-bit integers); ``obj``,
    what the caller passed."""

    __slots__ = ("obj", "view", "declared", "numel")

    def __init__(self, obj: Any, what: str):
        self.obj = obj
        self.declared: Optional[str] = None
        if isinstance(obj, np.ndarray):
            self.view = obj
            self.numel = obj.size
            if obj.dtype.name == "bfloat16" and obj.dtype.itemsize == 2:  # ml_dtypes.bfloat16
                self.view = obj.view(np.uint16)
                self.declared = "bfloat16"
            return
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:
                raise InvalidArgumentError(f"{what}: {obj.layout} tensors are not supported")
            if obj.device.type != "cpu":
                raise InvalidArgumentError(
                    f"{what}: the tensor is on {obj.device}; oxccl works on CPU tensors"
                )
            if not obj.is_contiguous():
                raise InvalidArgumentError(
                    f"{what}: the tensor is not contiguous (strides {tuple(obj.stride())}); "
                    "pass x.contiguous()"
                )
            if obj.is_conj() or obj.is_neg():
                raise InvalidArgumentError(f"{what}: lazily conjugated/negated tensors are not supported")
            t = obj.detach()
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)
                self.declared = "bfloat16"
            try:
                self.view = t.numpy()
            except (TypeError, RuntimeError) as e:
                raise InvalidArgumentError(
                    f"{what}: unsupported dtype {obj.dtype} (supported: {', '.join(DTYPES)})"
                ) from e
            self.numel = obj.numel()
            return
        raise InvalidArgumentError(
            f"{what}: expected a numpy array or a torch CPU tensor, got {type(obj).__module__}.{type(obj).__name__}"
        )


def _empty(like: Any, shape: tuple) -> Any:
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=like.dtype)
    torch = sys.modules["torch"]
    return torch.empty(shape, dtype=like.dtype, device="cpu")


class Handle:
    """A queued call (``async_op=True``). ``wait()`` returns the call's result (the output
    array) or raises its error; ``is_completed()`` never blocks."""

    __slots__ = ("_raw", "_result")

    def __init__(self, raw: Any, result: Any):
        """Wraps ``raw`` (the extension's queued-call handle) and the output it will fill;
        made by the calls, not by users."""
        self._raw = raw
        self._result = result

    def wait(self) -> Any:
        """Blocks (GIL released) until the call has finished; returns its output."""
        self._raw.wait()
        return self._result

    def is_completed(self) -> bool:
        """True once the call has finished, successfully or not."""
        return self._raw.is_completed()

    def __repr__(self) -> str:
        return f"<oxccl.Handle completed={self.is_completed()}>"


class _P2pHandle(Handle):
    """A queued point-to-point group: ``wait()`` returns each operation's source rank."""

    __slots__ = ()

    def wait(self) -> Any:
        self._raw.wait()
        return self._result.get()


_LIVE: "weakref.WeakSet[Comm]" = weakref.WeakSet()


@atexit.register
def _drain() -> None:
    # Queued calls take the GIL when they finish: let them finish before the interpreter goes
    # (a thread that takes the GIL during finalization is ended mid-call, which aborts the
    # process). Also those of communicators whose Python object is already gone.
    for c in list(_LIVE):
        try:
            c.synchronize()
        except Exception:  # pragma: no cover - best effort at exit
            pass
    _oxccl.wait_inflight(60.0)


class Comm:
    """A communicator: the ranks of a job that call collectives together.

    Every rank must make the same calls, with matching arguments, in the same order.
    Blocking and queued (``async_op=True``) calls of one communicator run in the order they
    were made. Use :func:`init` to make one.
    """

    def __init__(self, raw: Any):
        """Wraps ``raw``, the extension's ``RawComm``; made by :func:`init` (and
        :meth:`split`), not by users."""
        self._raw = raw
        _LIVE.add(self)

    # -- properties -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank."""
        return self._raw.rank

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self._raw.world_size

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks of its host."""
        return self._raw.local_rank

    @property
    def local_size(self) -> int:
        """How many ranks share this host."""
        return self._raw.local_size

    @property
    def transport(self) -> str:
        """The transports in use: ``"shm"``, ``"tcp"``, ``"shm+tcp"`` or ``"none"``."""
        return self._raw.transport

    def c_comm(self) -> int:
        """A new C handle of this communicator (``oxcclComm_t`` of ``oxccl.h``, as an
        address), for C/C++ code calling the library through the capsule
        ``oxccl._oxccl._C_API``; that code frees it with the table's ``comm_destroy``."""
        return self._raw.c_comm()

    def __repr__(self) -> str:
        return f"<oxccl.Comm rank={self.rank} world_size={self.world_size} transport={self.transport}>"

    # -- the engine -------------------------------------------------------------------------
    def _run(
        self,
        kind: str,
        send: Optional[_Buf],
        recv: Optional[_Buf],
        *,
        op: str = "sum",
        root: int = 0,
        peer: int = 0,
        async_op: bool = False,
        result: Any = None,
        callback: Any = None,
    ) -> Any:
        """One call: from ``send`` into ``recv``, or on ``recv`` in place (``send`` None)."""
        if root < 0 or peer < 0:
            raise InvalidArgumentError(f"{kind}: negative rank")
        if send is not None and recv is not None and send.declared != recv.declared:
            raise InvalidArgumentError(
                f"{kind}: input is {send.declared or send.view.dtype} but output is {recv.declared or recv.view.dtype}"
            )
        b = recv if recv is not None else send
        dtype = b.declared if b is not None else None
        s = send.view if send is not None else None
        r = recv.view if recv is not None else None
        if not async_op:
            self._raw.call(kind, op, root, peer, s, r, dtype)
            return result
        return Handle(self._raw.call_async(kind, op, root, peer, s, r, dtype, callback), result)

    # -- collectives ------------------------------------------------------------------------
    def empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A zeroed numpy array in shared memory (``Communicator::alloc_shared``, as NCCL's
        ``ncclMemAlloc``): collectives on it, or on ``torch.from_numpy`` of it, reach the other
        ranks of this host with plain loads and stores instead of kernel copies (large calls
        about twice as fast). The memory lives as long as the array (and views of it)."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        nbytes = n * dt.itemsize
        if nbytes == 0:
            return np.zeros(shape, dt)
        mem = self._raw.alloc_shared(nbytes)
        # The array's base is `mem` (its buffer), which keeps the memory.
        return np.frombuffer(mem, dtype=dt, count=n).reshape(shape)

    def all_reduce(self, x: Any, op: str = "sum", out: Any = None, async_op: bool = False) -> Any:
        """Element-wise reduction of every rank's ``x``: into ``x`` (in place, the default) or
        into ``out`` (same size). Returns the array holding the result."""
        op = _op_name(op)
        b = _Buf(x, "all_reduce input")
        if out is None or out is x:
            return self._run("all_reduce", None, b, op=op, async_op=async_op, result=x)
        o = _Buf(out, "all_reduce output")
        return self._run("all_reduce", b, o, op=op, async_op=async_op, result=out)

    def broadcast(self, x: Any, root: int = 0, async_op: bool = False) -> Any:
        """``root``'s ``x`` into every rank's ``x`` (in place). Returns ``x``."""
        b = _Buf(x, "broadcast buffer")
        return self._run("broadcast", None, b, root=root, async_op=async_op, result=x)

    def reduce(self, x: Any, root: int = 0, op: str = "sum", out: Any = None, async_op: bool = False) -> Any:
        """Element-wise reduction of every rank's ``x`` on ``root``: into ``x`` there (in place,
        the default) or into ``out`` (needed on the root only). Other ranks' ``x`` is only
        read. Returns the result array on the root (``x``/``out``), ``x`` elsewhere."""
        op = _op_name(op)
        b = _Buf(x, "reduce input")
        if out is None or out is x:
            return self._run("reduce", None, b, op=op, root=root, async_op=async_op, result=x)
        o = _Buf(out, "reduce output")
        return self._run("reduce", b, o, op=op, root=root, async_op=async_op, result=out)

    def all_gather(self, x: Any, out: Any = None, async_op: bool = False) -> Any:
        """Every rank's ``x``, concatenated in rank order (along the first axis), into ``out``
        (allocated when not given; ``world_size`` times ``x``'s size). Returns ``out``."""
        b = _Buf(x, "all_gather input")
        if out is None:
            shape = tuple(x.shape)
            shape = (self.world_size * shape[0],) + shape[1:] if shape else (self.world_size,)
            out = _empty(x, shape)
        o = _Buf(out, "all_gather output")
        return self._run("all_gather", b, o, async_op=async_op, result=out)

    def reduce_scatter(self, x: Any, op: str = "sum", out: Any = None, async_op: bool = False) -> Any:
        """Block ``rank`` (of ``world_size`` equal blocks) of the element-wise reduction of every
        rank's ``x``, into ``out`` (allocated when not given). Returns ``out``."""
        op = _op_name(op)
        b = _Buf(x, "reduce_scatter input")
        if out is None:
            n = self.world_size
            shape = tuple(x.shape)
            if shape and shape[0] % n == 0:
                shape = (shape[0] // n,) + shape[1:]
            else:
                shape = (b.numel // n,)
            out = _empty(x, shape)
        o = _Buf(out, "reduce_scatter output")
        return self._run("reduce_scatter", b, o, op=op, async_op=async_op, result=out)

    def all_to_all(self, x: Any, out: Any = None, async_op: bool = False) -> Any:
        """Block p of ``x`` (``world_size`` equal blocks) goes to rank p, which stores it as
        block ``rank`` of its ``out`` (allocated when not given; ``x``'s size). ``out=x`` runs
        in place. Returns ``out``."""
        if out is x:
            b = _Buf(x, "all_to_all buffer")
            return self._run("all_to_all", None, b, async_op=async_op, result=x)
        b = _Buf(x, "all_to_all input")
        if out is None:
            out = _empty(x, tuple(x.shape))
        o = _Buf(out, "all_to_all output")
        return self._run("all_to_all", b, o, async_op=async_op, result=out)

    def send(self, x: Any, peer: int, tag: int = 0, async_op: bool = False) -> Any:
        """Sends ``x`` to ``peer``, which must ``recv`` the same number of bytes with the same
        ``tag`` (messages of different tags may be received in any order)."""
        if tag:
            h = self.p2p([("send", x, peer, tag)], async_op=async_op)
            return Handle(h._raw, None) if async_op else None
        b = _Buf(x, "send buffer")
        return self._run("send", b, None, peer=peer, async_op=async_op, result=None)

    def recv(self, x: Any, peer: int, tag: int = 0, async_op: bool = False) -> Any:
        """Receives into ``x`` the first message ``peer`` sent with ``tag``. Returns ``x``."""
        if tag:
            h = self.p2p([("recv", x, peer, tag)], async_op=async_op)
            return Handle(h._raw, x) if async_op else x
        b = _Buf(x, "recv buffer")
        return self._run("recv", None, b, peer=peer, async_op=async_op, result=x)

    def recv_any(self, x: Any, tag: int = 0, async_op: bool = False) -> Any:
        """Receives into ``x`` a message sent with ``tag`` by any other rank (gloo's
        ``recvFromAny``); returns that rank (``wait()`` returns it for ``async_op``)."""
        r = self.p2p([("recv", x, None, tag)], async_op=async_op)
        return r if async_op else r[0]

    def p2p(self, ops: Any, async_op: bool = False) -> Any:
        """Sends and receives that progress together (NCCL's group of ``ncclSend`` and
        ``ncclRecv``): any mix completes at any size, two ranks that both send first included.
        ``ops`` is a list of ``("send", x, peer, tag)`` and ``("recv", x, peer, tag)``, where a
        recv's peer may be None (any rank). Returns the source rank of each operation (None
        for sends); with ``async_op`` a handle whose ``wait()`` returns that list."""
        raw_ops = []
        for op in ops:
            if not (isinstance(op, tuple) and len(op) == 4 and op[0] in ("send", "recv")):
                raise InvalidArgumentError(f"p2p: expected ('send' | 'recv', array, peer, tag), got {op!r}")
            kind, x, peer, tag = op
            if (peer is None and kind == "send") or (peer is not None and peer < 0) or tag < 0:
                raise InvalidArgumentError(f"p2p: bad peer {peer!r} or tag {tag!r} in {kind}")
            b = _Buf(x, f"p2p {kind} buffer")
            raw_ops.append((kind, peer, int(tag), b.view, b.declared))
        if not async_op:
            return self._raw.p2p(raw_ops)
        raw, sources = self._raw.p2p_async(raw_ops, None)
        return _P2pHandle(raw, sources)

    def sendrecv(self, send: Any, to: int, recv: Any, from_: int, async_op: bool = False) -> Any:
        """Sends ``send`` to ``to`` while receiving ``recv`` from ``from_`` (same size), as
        ``MPI_Sendrecv``. Returns ``recv``."""
        s = _Buf(send, "sendrecv input")
        r = _Buf(recv, "sendrecv output")
        return self._run("sendrecv", s, r, peer=to, root=from_, async_op=async_op, result=recv)

    def barrier(self, async_op: bool = False) -> Any:
        """Returns once every rank has called it."""
        return self._run("barrier", None, None, async_op=async_op)

    # -- communicator management ------------------------------------------------------------
    def split(self, color: Optional[int], key: Optional[int] = None) -> Optional["Comm"]:
        """``ncclCommSplit``: every rank calls it; ranks with the same ``color`` form a new
        communicator, ordered by ``key`` (default: this rank) then rank. ``color=None`` or a
        negative color joins none and returns None."""
        raw = self._raw.split(color, self.rank if key is None else int(key))
        return None if raw is None else Comm(raw)

    def synchronize(self) -> None:
        """Waits until every queued call has finished."""
        self._raw.synchronize()

    def pending(self) -> int:
        """Queued calls not yet finished."""
        return self._raw.pending()

    def close(self) -> None:
        """Closes the communicator (as ``ncclCommFinalize`` then ``ncclCommDestroy``): waits
        until every queued call has finished (each bounded by its timeout), says goodbye to
        the other ranks (they see this rank leave, not fail) and frees its links and shared
        memory, even while C handles of it are alive. Later calls raise
        ``oxccl.AbortedError``; closing again does nothing."""
        self._raw.close()

    def abort(self) -> None:
        """Fails every blocked and later call at once, here and (through the watchdog) on
        the other ranks."""
        self._raw.abort()


def new_unique_id(ip: Optional[str] = None) -> str:
    """A fresh id (as ``ncclGetUniqueId``), listening on ``ip`` (default: this host's default
    address). The process that makes it must be rank 0; hand the string to the others."""
    return _oxccl.new_unique_id(ip)


def _derived_secret(addr: str, world_size: int) -> str:
    h = hashlib.sha256(f"oxccl-python-addr-secret-v1\0{addr}\0{world_size}".encode())
    return h.hexdigest()[:32]


def _secret_for(addr: str, world_size: int, secret: Optional[str]) -> str:
    """The secret of an ``addr=`` rendezvous: ``secret``, else ``OXCCL_SECRET``, else derived
    from the address (with a warning: anyone who can reach the address can compute it). An
    empty secret is an error, as in the library, not a silent fallback."""
    if secret is None:
        secret = os.environ.get("OXCCL_SECRET")
        if secret is None:
            warnings.warn(
                f"oxccl: OXCCL_SECRET is not set: the communicator secret is derived from the "
                f"rendezvous address {addr}, so anyone who can reach it can join the job; set "
                f"OXCCL_SECRET (32 hex digits) to the same value on every rank",
                RuntimeWarning,
                stacklevel=3,
            )
            return _derived_secret(addr, world_size)
        what = "OXCCL_SECRET"
    else:
        what = "secret"
    if not secret:
        raise InvalidArgumentError(f"init: {what} is set but empty; give 32 hex digits or leave it unset")
    return secret


def init(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    addr: Optional[str] = None,
    *,
    unique_id: Optional[str] = None,
    secret: Optional[str] = None,
) -> Comm:
    """Joins a communicator.

    - ``init()``: from a launcher's environment (torchrun, ``oxccl run``, Slurm, Open MPI,
      PMI; ``MASTER_ADDR``/``MASTER_PORT`` or ``OXCCL_ROOT``, ``OXCCL_SECRET``).
    - ``init(rank=, world_size=, addr="host:port")``: rank 0 hosts the rendezvous at ``addr``;
      the secret is ``secret`` (32 hex digits), else ``OXCCL_SECRET``, else derived from
      ``addr`` (which keeps jobs apart but does not stop a hostile peer).
    - ``init(rank=, world_size=, unique_id=s)``: NCCL's model, ``s`` from
      :func:`new_unique_id` on rank 0.
    """
    if rank is None and world_size is None and addr is None and unique_id is None:
        return Comm(_oxccl.init_from_env())
    if rank is None or world_size is None:
        raise InvalidArgumentError("init: pass both rank and world_size (or nothing, to read a launcher's environment)")
    if (addr is None) == (unique_id is None):
        raise InvalidArgumentError("init: pass exactly one of addr='host:port' and unique_id=")
    if unique_id is None:
        secret = _secret_for(addr, int(world_size), secret)
        unique_id = _oxccl.unique_id_for(addr, secret)
    return Comm(_oxccl.init_with_id(unique_id, int(rank), int(world_size)))
