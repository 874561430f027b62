"""The torch.distributed backend ``"oxccl"``.

    import torch.distributed as dist
    import oxccl.torch  # registers the backend
    dist.init_process_group("oxccl")               # or backend="cpu:oxccl"
    group = dist.new_group(ranks, backend="oxccl")

Rendezvous goes through the store torch hands in: group rank 0 makes an oxccl unique id
and ``store.set``s it; the others ``store.get`` it. Every call is queued on the
communicator's stream (oxccl's own thread) and returns a Work whose future that thread
completes; ``async_op=False`` simply waits for it. CPU tensors only; dtypes float32, float64,
float16, bfloat16, int8, uint8, int32, int64 (and uint32, uint64); ops SUM, PRODUCT, MIN,
MAX, AVG (others raise ``oxccl.InvalidArgumentError``). The collective timeout is the one
given to ``init_process_group``/``new_group`` unless ``OXCCL_TIMEOUT`` is set.

Point-to-point: ``batch_isend_irecv`` runs its operations as one group, in an order that
cannot deadlock (pairs of ranks in a fixed global order). Separate ``isend``/``irecv`` run in
the order they were issued, like NCCL outside a group: a rank whose ``isend`` is larger than
the transport's buffer waits for the matching ``irecv`` to start.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future

from . import Comm, InvalidArgumentError, _Buf, _oxccl

__all__ = ["ProcessGroupOxccl", "BACKEND_NAME"]

BACKEND_NAME = "oxccl"

_R = dist.ReduceOp
_OPS = [
    (_R.SUM, "sum"),
    (_R.PRODUCT, "prod"),
    (_R.MIN, "min"),
    (_R.MAX, "max"),
    (_R.AVG, "avg"),
]


def _op(op: Any) -> str:
    for t, name in _OPS:
        if op == t:
            return name
    name = getattr(op, "op", None) or getattr(op, "name", None) or op
    raise InvalidArgumentError(
        f"the oxccl backend supports ReduceOp SUM, PRODUCT, MIN, MAX and AVG, not {name}"
    )


class _Call:
    """One oxccl call of a batch: kind, checked buffers, arguments."""

    __slots__ = ("kind", "send", "recv", "kw")

    def __init__(self, kind: str, send: Any, recv: Any, **kw: Any):
        self.kind = kind
        self.send = None if send is None else _Buf(send, f"{kind} input", writable=False)
        self.recv = None if recv is None else _Buf(recv, f"{kind} output", writable=True)
        self.kw = kw


def _flat(ts: Sequence[torch.Tensor], what: str) -> None:
    for t in ts:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{what}: expected tensors, got {type(t).__name__}")


class _Work(dist.Work):
    """The Work of a queued call: its future is completed by oxccl's stream thread; `wait`
    raises the call's error (an ``oxccl.Error``)."""

    def __init__(self, fut: Future):
        super().__init__()
        self._fut = fut

    def wait(self, timeout: Any = None) -> bool:
        self._fut.wait()  # releases the GIL; raises the future's exception
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def exception(self) -> Any:
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as e:  # noqa: BLE001
            return e
        return None

    def get_future(self) -> Future:
        return self._fut

    def result(self) -> Any:
        return self._fut.value()

    def synchronize(self) -> None:
        pass


class ProcessGroupOxccl(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on an oxccl communicator."""

    def __init__(self, comm: Comm, rank: int, size: int):
        super().__init__(rank, size)
        self.comm = comm
        self._batch: Optional[List[_Call]] = None
        self._batch_result: List[torch.Tensor] = []

    # -- identity ---------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    @property
    def supports_coalescing(self) -> bool:
        return True

    def _get_backend(self, device: Any = None) -> "ProcessGroupOxccl":
        # A Python ProcessGroup has no C++ backend per device: this object is its own (torch
        # asks it, e.g., whether it groups point-to-point calls in batch_isend_irecv).
        return self

    def __repr__(self) -> str:
        return f"ProcessGroupOxccl(rank={self.rank()}, size={self.size()}, transport={self.comm.transport})"

    # -- the engine -------------------------------------------------------------------------
    def _submit(
        self,
        calls: List[_Call],
        result: Any,
        post: Optional[Callable[[], None]] = None,
    ) -> Any:
        """Queues `calls` in order; the returned Work's future gets `result` once the last
        has finished and `post` (copies out of temporaries) has run, on oxccl's thread."""
        fut: Future = Future()
        errors: List[BaseException] = []

        def record(err: Optional[BaseException]) -> None:
            if err is not None:
                errors.append(err)

        def finish(err: Optional[BaseException]) -> None:
            record(err)
            if errors:
                fut.set_exception(errors[0])
                return
            try:
                if post is not None:
                    post()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)
                return
            fut.set_result(result)

        if not calls:
            finish(None)
            return _Work(fut)
        last = len(calls) - 1
        for i, c in enumerate(calls):
            self.comm._run(
                c.kind,
                c.send,
                c.recv,
                async_op=True,
                callback=finish if i == last else record,
                **c.kw,
            )
        return _Work(fut)

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        op = _op(opts.reduceOp) if opts is not None else "sum"
        _flat(tensors, "allreduce")
        calls = [_Call("all_reduce", None, t, op=op, in_place=True) for t in tensors]
        return self._submit(calls, list(tensors))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        _flat(tensors, "broadcast")
        calls = [_Call("broadcast", None, t, root=root, in_place=True) for t in tensors]
        return self._submit(calls, list(tensors))

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        op = _op(opts.reduceOp) if opts is not None else "sum"
        root = opts.rootRank if opts is not None else 0
        _flat(tensors, "reduce")
        calls = [_Call("reduce", None, t, op=op, root=root, in_place=True) for t in tensors]
        return self._submit(calls, list(tensors))

    def allgather(
        self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Any:
        calls, posts = [], []
        for outs, inp in zip(output_tensors, input_tensors):
            _flat(outs, "allgather output")
            if len(outs) != self.size():
                raise InvalidArgumentError(
                    f"allgather: {len(outs)} output tensors for a group of {self.size()}"
                )
            if any(o.numel() != inp.numel() or o.dtype != inp.dtype for o in outs):
                raise InvalidArgumentError(
                    "allgather: every output tensor must have the input's size and dtype"
                )
            flat = torch.empty((self.size(), inp.numel()), dtype=inp.dtype)
            calls.append(_Call("all_gather", inp, flat))
            posts.append((flat, outs))

        def post() -> None:
            for flat, outs in posts:
                for i, o in enumerate(outs):
                    o.copy_(flat[i].view(o.shape))

        return self._submit(calls, output_tensors, post)

    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any = None) -> Any:
        return self.allgather(output_lists, input_list, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._submit([_Call("all_gather", input, output)], [output])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        calls = [_Call("all_gather", i, o) for o, i in zip(outputs, inputs)]
        return self._submit(calls, list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(
        self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = _op(opts.reduceOp) if opts is not None else "sum"
        calls = []
        for out, ins in zip(output_tensors, input_tensors):
            _flat(ins, "reduce_scatter input")
            if len(ins) != self.size():
                raise InvalidArgumentError(
                    f"reduce_scatter: {len(ins)} input tensors for a group of {self.size()}"
                )
            if any(i.numel() != out.numel() or i.dtype != out.dtype for i in ins):
                raise InvalidArgumentError(
                    "reduce_scatter: every input tensor must have the output's size and dtype"
                )
            flat = torch.stack([i.reshape(-1) for i in ins])
            calls.append(_Call("reduce_scatter", flat, out, op=op))
        return self._submit(calls, list(output_tensors))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = _op(opts.reduceOp) if opts is not None else "sum"
        return self._submit([_Call("reduce_scatter", input, output, op=op)], [output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        op = _op(opts.reduceOp) if opts is not None else "sum"
        calls = [_Call("reduce_scatter", i, o, op=op) for o, i in zip(outputs, inputs)]
        return self._submit(calls, list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall(
        self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Any:
        n = self.size()
        _flat(output_tensors, "alltoall output")
        _flat(input_tensors, "alltoall input")
        if len(output_tensors) != n or len(input_tensors) != n:
            raise InvalidArgumentError(f"alltoall: expected {n} input and {n} output tensors")
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in list(output_tensors) + list(input_tensors)):
            raise InvalidArgumentError("alltoall: every tensor must have one dtype")
        send = torch.cat([t.reshape(-1) for t in input_tensors]) if n else torch.empty(0, dtype=dtype)
        recv = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype)
        calls = self._alltoallv(
            send, recv, [t.numel() for t in output_tensors], [t.numel() for t in input_tensors]
        )

        def post() -> None:
            off = 0
            for t in output_tensors:
                t.copy_(recv[off : off + t.numel()].view(t.shape))
                off += t.numel()

        return self._submit(calls, list(output_tensors), post)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: List[int],
        input_split_sizes: List[int],
        opts: Any = None,
    ) -> Any:
        n = self.size()
        row_out = output[0].numel() if output.dim() > 0 and output.shape[0] else 0
        row_in = input[0].numel() if input.dim() > 0 and input.shape[0] else 0
        if output_split_sizes:
            out_counts = [s * row_out for s in output_split_sizes]
        else:
            out_counts = [output.numel() // n] * n
        if input_split_sizes:
            in_counts = [s * row_in for s in input_split_sizes]
        else:
            in_counts = [input.numel() // n] * n
        if len(out_counts) != n or len(in_counts) != n:
            raise InvalidArgumentError(f"all_to_all_single: split sizes must have {n} entries")
        if sum(out_counts) != output.numel() or sum(in_counts) != input.numel():
            raise InvalidArgumentError(
                "all_to_all_single: split sizes do not add up to the tensors' first dimension"
            )
        calls = self._alltoallv(input, output, out_counts, in_counts)
        return self._submit(calls, [output])

    all_to_all_single = alltoall_base

    def _alltoallv(
        self, send: torch.Tensor, recv: torch.Tensor, out_counts: List[int], in_counts: List[int]
    ) -> List[_Call]:
        """All-to-all with per-peer element counts: one oxccl all_to_all when the blocks are
        equal, else pairwise send/recv in a deadlock-free order."""
        n, me = self.size(), self.rank()
        if send.dtype != recv.dtype:
            raise InvalidArgumentError("all_to_all: input and output dtypes differ")
        if len(set(out_counts)) <= 1 and out_counts == in_counts:
            return [_Call("all_to_all", send, recv)]
        s, r = send.reshape(-1), recv.reshape(-1)
        s_off = [sum(in_counts[:p]) for p in range(n)]
        r_off = [sum(out_counts[:p]) for p in range(n)]
        ops: List[tuple] = []
        for p in range(n):
            sblk = s[s_off[p] : s_off[p] + in_counts[p]]
            rblk = r[r_off[p] : r_off[p] + out_counts[p]]
            if p == me:
                ops.append(("copy", sblk, rblk))
            else:
                ops.append(("send", p, sblk))
                ops.append(("recv", p, rblk))
        return self._p2p_calls(ops)

    def _p2p_calls(self, ops: List[tuple]) -> List[_Call]:
        """Orders point-to-point operations so that no set of ranks can wait on each other in
        a cycle: peers in ascending order (so every rank visits the pairs (a, b), a < b, in
        one global order); with each peer, the lower rank sends first. Sends to and receives
        from one peer keep their relative order."""
        me = self.rank()
        calls: List[_Call] = []
        copies = [op for op in ops if op[0] == "copy"]
        for _, src, dst in copies:
            if src.numel():
                calls.append(_Call("sendrecv", src, dst, peer=me, root=me))
        peers = sorted({op[1] for op in ops if op[0] != "copy"})
        for p in peers:
            sends = [_Call("send", op[2], None, peer=p) for op in ops if op[0] == "send" and op[1] == p]
            recvs = [_Call("recv", None, op[2], peer=p) for op in ops if op[0] == "recv" and op[1] == p]
            calls.extend(sends + recvs if me < p else recvs + sends)
        return calls

    # -- point to point ---------------------------------------------------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        self._batch = []
        self._batch_result = []

    def _end_coalescing(self, device: Any = None) -> Any:
        batch, self._batch = self._batch or [], None
        result, self._batch_result = self._batch_result, []
        return self._submit(self._p2p_calls(batch), result)

    def _p2p(self, kind: str, tensors: List[torch.Tensor], peer: int) -> Any:
        _flat(tensors, kind)
        if self._batch is not None:
            for t in tensors:
                # Check now, while the caller can see the error.
                _Buf(t, f"{kind} buffer", writable=kind == "recv")
                self._batch.append((kind, peer, t))
                self._batch_result.append(t)
            fut: Future = Future()
            fut.set_result(list(tensors))
            return _Work(fut)
        if kind == "send":
            calls = [_Call("send", t, None, peer=peer) for t in tensors]
        else:
            calls = [_Call("recv", None, t, peer=peer) for t in tensors]
        return self._submit(calls, list(tensors))

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._p2p("send", tensors, dst)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._p2p("recv", tensors, src)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        raise InvalidArgumentError("the oxccl backend needs the source rank of every recv")

    def barrier(self, opts: Any = None) -> Any:
        return self._submit([_Call("barrier", None, None)], [])

    # -- not provided -----------------------------------------------------------------------
    def gather(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidArgumentError("the oxccl backend has no gather; use all_gather")

    def scatter(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidArgumentError("the oxccl backend has no scatter; use broadcast or all_to_all")


def _timeout_s(timeout: Any) -> Optional[float]:
    if os.environ.get("OXCCL_TIMEOUT"):
        return None
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return None


def _create(store: Any, rank: int, size: int, timeout: Any) -> ProcessGroupOxccl:
    key = "oxccl/unique_id"
    if rank == 0:
        uid = _oxccl.new_unique_id(os.environ.get("OXCCL_ROOT_IP"))
        store.set(key, uid)
    else:
        uid = store.get(key).decode()
    raw = _oxccl.init_with_id(uid, rank, size, _timeout_s(timeout))
    return ProcessGroupOxccl(Comm(raw), rank, size)


dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
