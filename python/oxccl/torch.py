"""The torch.distributed backend ``"oxccl"``.

    import torch.distributed as dist
    import oxccl.torch  # registers the backend
    dist.init_process_group("oxccl")               # or backend="cpu:oxccl"
    group = dist.new_group(ranks, backend="oxccl")

The backend is C++ (``oxccl/csrc/backend.cpp``, built on first import, see
:mod:`oxccl.build_torch_ext`): a ``c10d::Backend`` registered with ``extended_api=True`` for
the CPU device, so torch builds its own ``ProcessGroup`` around it and the group keeps its
name, device types and bookkeeping; DeviceMesh, FSDP2, DTensor, functional collectives,
``torch.compile``, ``monitored_barrier`` and ``split_group`` work as with gloo. It calls the
library through its C ABI on a communicator this module makes; every call form torch sends is
its own (``docs/torch.md`` lists them). What stays here: the factory torch calls
(``_create``), which makes the communicator and hands its C handle to the C++ backend; the
store and re-initialization handling; closing, aborting and splitting a group's communicator
(``_Group``, which the backend calls); the inference ops' wrappers; the shared-memory
allocator's installation.

Rendezvous goes through the store torch hands in: group rank 0 makes an oxccl unique id and
``store.set``s it; the others ``store.get`` it.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.abc
import importlib.util
import os
import sys
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import Comm, InvalidArgumentError, _oxccl

__all__ = [
    "BACKEND_NAME",
    "inference_all_reduce",
    "inference_all_gather",
]

BACKEND_NAME = "oxccl"

_R = dist.ReduceOp
_RT = _R.RedOpType
_SUM = _R.SUM

_C10D_WAIT = dist.Work.wait


def _work_wait(work: Any, timeout: Any = None) -> bool:
    """``Work.wait``, where an explicit zero or negative timeout on a Work of this backend
    expires at once (torch passes "no timeout" as 0 to C++, so a C++ ``wait`` cannot tell an
    explicit 0 from none): the call's result if it has finished, else an
    ``oxccl.TimeoutError``. Other Works and other timeouts: torch's ``wait`` unchanged."""
    if timeout is None:
        return _C10D_WAIT(work)
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else None
    if secs is not None and secs <= 0:
        got = _CPP.wait_now(work)
        if got is not None:
            return got
    return _C10D_WAIT(work, timeout)


dist.Work.wait = _work_wait


#: How long the exit hook waits for queued calls of the C++ backend to complete (each is
#: bounded by its group's timeout; this bounds the exit).
_EXIT_DRAIN_S = 60.0


def _drain_at_exit() -> None:
    """At interpreter exit (before finalization): lets queued calls of the C++ backend complete
    and their completion threads let go of tensors and futures, so that none is still running
    while the interpreter tears down. `_CPP` is unset when the import failed before it: then
    there is nothing to drain."""
    cpp = globals().get("_CPP")
    if cpp is not None:
        cpp.drain_completions(_EXIT_DRAIN_S)


atexit.register(_drain_at_exit)  # before _flush_at_exit, so it runs after it


@atexit.register
def _flush_at_exit() -> None:
    # Held sends of a rank that never waited go out before the process ends (registered after
    # the drain, so it runs before it).
    cpp = globals().get("_CPP")
    if cpp is not None:
        try:
            cpp.flush_held()
        except Exception:  # pragma: no cover - best effort at exit
            pass


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


class _Group:
    """A group's communicator and store, as its C++ backend sees them from here: the backend
    calls ``close`` (torch's shutdown, ``destroy_process_group``), ``abort`` and ``split``,
    which need the Python module (the store's re-initialization handling, the rendezvous of
    a new communicator)."""

    __slots__ = ("comm", "rank", "store", "timeout", "__weakref__")

    def __init__(self, comm: Comm, rank: int, store: Any, timeout: Optional[timedelta]):
        self.comm, self.rank, self.store, self.timeout = comm, rank, store, timeout

    def close(self) -> None:
        """Waits for the queued calls (each bounded by its timeout), then closes the
        communicator (``Comm.close``: the other ranks see this rank leave, its links and
        shared memory are freed); later calls raise ``oxccl.AbortedError``."""
        self.comm.close()
        if _WATCHER and _WATCHER[0]() is self.comm:
            # A group made later (after a new init_process_group) is not this one's to watch.
            _WATCHER.clear()
        # The store goes to `_PREVIOUS_STORE`, which keeps it until the next backend is made
        # (see there): not with the backend, whose lifetime is not the group's.
        if self.store is not None:
            _keep_store(self.store)
        self.store = None

    def abort(self) -> None:
        """Every blocked and queued call fails at once (here and, told by the watchdog, on
        the other ranks)."""
        self.comm.abort()

    def split(self, store: Any, ranks: List[int], opts: Any, timeout_s: float) -> Any:
        """The backend of a group of `ranks` (ranks of this group, this rank among them),
        rendezvousing through `store`; this group's communicator watches its init."""
        timeout = timedelta(seconds=timeout_s) if timeout_s > 0 else None
        name = getattr(opts, "group_name", None)
        return _make(store, ranks.index(self.rank), len(ranks), timeout, name, (self.comm, list(ranks)))[1]


def _make(
    store: Any, rank: int, size: int, timeout: Any, group_id: Any, watch: Optional[Tuple[Comm, List[int]]] = None
) -> Tuple[_Group, Any]:
    """The communicator and C++ backend of rank `rank` of `size`. With `watch` =
    (communicator, ranks there of the new group's ranks), that communicator watches the init:
    a member it loses meanwhile fails the init at once instead of after the timeout, and,
    later, the new group."""
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
    comm = Comm(raw)
    t = timeout if isinstance(timeout, timedelta) else None
    state = _Group(comm, rank, store, t)
    backend = _CPP.BackendOxcclCpp(
        comm.c_comm(), _oxccl._C_API, rank, size, t.total_seconds() if t is not None else -1.0, store, state
    )
    return state, backend


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
    """The C++ backend's module (oxccl/csrc/backend.cpp): the one built for this torch and
    oxccl in the package (``python -m oxccl.build_torch_ext``) or in the cache, else it is
    built into the cache now, once (see :mod:`oxccl.build_torch_ext`). Without it there is no
    backend: an ImportError that says why and how to build it."""
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
    raise ImportError(
        f"oxccl: the torch backend (C++) is not available: {why}. Build it with "
        "`python -m oxccl.build_torch_ext` (a C++ compiler and torch's headers are needed)"
    )


_CPP = _load_cpp()


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
    if isinstance(backend, _CPP.BackendOxcclCpp):
        handle = backend.inference_handle
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
    if type(tensor) is _TENSOR:
        _CPP.inference_all_reduce_(tensor, entry[1], code)
    else:  # a tensor subclass (fake, functional, ...: torch.compile)
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
    if type(tensor) is _TENSOR:
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


def _allow_in_graph(dynamo: Any) -> None:
    """torch.compile writes calls of the inference ops into its graph as they are (AOT
    autograd then traces them into the operators): the oxccl package is otherwise code that
    dynamo skips, which would break the graph."""
    try:
        dynamo.allow_in_graph(inference_all_reduce)
        dynamo.allow_in_graph(inference_all_gather)
    except Exception:  # noqa: BLE001 - a compile without it breaks the graph, still correct
        pass


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
    if min_bytes is not None:
        _CPP.install_shm_allocator(_oxccl._C_API, min_bytes)


def _shm_allocator_min_bytes() -> Optional[int]:
    """The threshold of the shared-memory CPU allocator if it serves torch's CPU allocations,
    else None (a hidden query for tests)."""
    return _CPP.shm_allocator_min_bytes()


def _create(dist_opts: Any, backend_options: Any = None) -> Any:
    """The backend torch asks for when it makes an oxccl group (registered below)."""
    # torch gives a new group's ranks in the default group (empty for the default group).
    ranks = list(getattr(dist_opts, "global_ranks_in_group", None) or [])
    world = _WATCHER[0]() if _WATCHER and ranks else None
    state, backend = _make(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.timeout,
        dist_opts.group_id,
        (world, ranks) if world is not None else None,
    )
    if not ranks:
        _WATCHER[:] = [weakref.ref(state.comm)]
    _install_shm_allocator()
    return backend


dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])

# oxccl keeps its own flight records (OXCCL_FLIGHT_RECORDER): torch need not hook every call
# to record it (that hook costs more than the call itself for small messages).
_FR_SELF = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
if isinstance(_FR_SELF, set):
    _FR_SELF.add(BACKEND_NAME)
