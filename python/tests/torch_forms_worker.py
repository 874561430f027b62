"""The rank side of test_torch_forms.py: every call form torch can send a CPU backend, run on a
gloo group and on an oxccl group in the same process, results compared (bitwise, or close
for float sums).

    python torch_forms_worker.py

Each check `fn(g, be)` runs on group `g` of backend `be` and returns a dict of named
tensors; a check that raises is recorded as raised. gloo is the reference: where it raises,
oxccl must raise too (before any data moves: the groups stay in step); where it answers,
oxccl must give the same answer. gloo is wrong on strided views (it reduces them as if
contiguous): `_nc` hands gloo contiguous copies, so the reference is the contiguous result.
Checks marked `oxccl_only` cover what gloo rejects (int16, uint16..64, float8, AVG): they
compare with a result computed locally.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist

import oxccl
import oxccl.torch  # noqa: F401 - registers "oxccl"

R = int(os.environ["RANK"])
N = int(os.environ["WORLD_SIZE"])
CPU = torch.device("cpu")
CHECKS = []
OXCCL_ONLY = []

warnings.filterwarnings("ignore")


def check(fn):
    CHECKS.append(fn)
    return fn


def oxccl_only(fn):
    OXCCL_ONLY.append(fn)
    return fn


def raised(fn):
    """The exception `fn()` raised (at call time or at wait), or None."""
    try:
        w = fn()
        if isinstance(w, (dist.Work,)) or hasattr(w, "wait"):
            w.wait()
    except Exception as e:  # noqa: BLE001 - recorded
        return e
    return None


def val(shape, r=R, dtype=torch.float32, k=1.0):
    """A tensor that differs per rank and position."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * k + 10 * (r + 1)).to(dtype)


def _nc(be, view, fn):
    """`fn(view)`; for gloo on a contiguous copy written back (gloo's reference)."""
    if be == "gloo" and not view.is_contiguous():
        tmp = view.contiguous()
        fn(tmp)
        view.copy_(tmp)
    else:
        fn(view)


# --- 1. all_gather_coalesced: outputs are [rank][tensor] ---------------------------------------
@check
def all_gather_coalesced(g, be):
    out = {}
    for k in (N, N + 1):  # as many inputs as ranks (was silently transposed), and not
        ins = [val((i + 1, 2), k=i + 1) for i in range(k)]
        outs = [[torch.zeros(i + 1, 2) for i in range(k)] for _ in range(N)]
        dist.all_gather_coalesced(outs, ins, group=g)
        out[f"k{k}"] = torch.cat([o.reshape(-1) for lst in outs for o in lst])
    return out


# --- 2. several tensors in one allreduce / broadcast (gloo's forms) ----------------------------
@check
def allreduce_list(g, be):
    out = {}
    for name, op, dtype in [("sum", dist.ReduceOp.SUM, torch.float32), ("max", dist.ReduceOp.MAX, torch.int64),
                            ("prod", dist.ReduceOp.PRODUCT, torch.int32), ("band", dist.ReduceOp.BAND, torch.int64)]:
        ts = [val((3,), dtype=dtype, k=j + 1) for j in range(3)]
        o = dist.AllreduceOptions()
        o.reduceOp = op
        g.allreduce(ts, o).wait()
        out[name] = torch.stack(ts)
    a = val((4,))
    g.allreduce([a, a]).wait()  # the same tensor twice: summed locally too (gloo: 2 * sum)
    out["alias"] = a
    return out


@check
def broadcast_list(g, be):
    out = {}
    for root, rt in [(0, 1), (N - 1, 2), (N - 1, 0)]:
        ts = [val((2, 3), k=j + 1) for j in range(3)]
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = root, rt
        g.broadcast(ts, o).wait()
        out[f"r{root}t{rt}"] = torch.stack(ts)
    return out


# --- 3. aliased tensors in one coalesced all_reduce ---------------------------------------------
@check
def allreduce_coalesced_alias(g, be):
    a = val((4,))
    dist.all_reduce_coalesced([a, a], group=g)
    x = val((8,))
    dist.all_reduce_coalesced([x[0:5], x[3:8], x[1:2]], group=g)  # overlapping views
    y = val((3,))
    z = val((3,), k=2.0)
    dist.all_reduce_coalesced([y, z, y], group=g)
    return {"same": a, "overlap": x, "ab_a": torch.cat([y, z])}


# --- 4. checks: empty lists, roots outside the group (at call time, named) -----------------------
@check
def empty_lists_and_roots(g, be):
    b = g._get_backend(CPU)
    out = {}
    cases = {
        "allreduce_empty": lambda: b.allreduce([]),
        "allreduce_coalesced_empty": lambda: b.allreduce_coalesced([]),
        "allgather_empty": lambda: b.allgather([], []),
        "broadcast_empty": lambda: b.broadcast([], dist.BroadcastOptions()),
    }
    for root in (N, -1):
        go, so, bo, ro = dist.GatherOptions(), dist.ScatterOptions(), dist.BroadcastOptions(), dist.ReduceOptions()
        go.rootRank = so.rootRank = bo.rootRank = ro.rootRank = root
        outs = [[torch.zeros(2) for _ in range(N)]] if R == 0 else []
        ins = [[torch.ones(2) for _ in range(N)]] if R == 0 else []
        cases[f"gather_root{root}"] = lambda go=go, outs=outs: b.gather(outs, [torch.ones(2)], go)
        cases[f"scatter_root{root}"] = lambda so=so, ins=ins: b.scatter([torch.zeros(2)], ins, so)
        cases[f"broadcast_root{root}"] = lambda bo=bo: b.broadcast([torch.zeros(2)], bo)
        cases[f"reduce_root{root}"] = lambda ro=ro: b.reduce([torch.zeros(2)], ro)
    for name, fn in cases.items():
        try:
            fn()  # must raise here, not at wait()
            out[name] = torch.tensor([0])
        except Exception as e:  # noqa: BLE001
            out[name] = torch.tensor([1])
            if be == "oxccl" and "root" in name:
                assert "root rank" in str(e) and f"group of {N}" in str(e), f"{name}: unclear error: {e}"
    return out


# --- 5. non-contiguous views, every collective ---------------------------------------------------
@check
def non_contiguous(g, be):
    out = {}
    x = val((3, 4))
    _nc(be, x.t(), lambda t: dist.all_reduce(t, group=g))
    out["all_reduce_t"] = x
    y = val((12,))
    _nc(be, y[::3], lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g))
    out["all_reduce_strided"] = y
    q = val((600, 700))  # 1.6 MB: queued, not inline; copied back once it has finished
    _nc(be, q.t(), lambda t: dist.all_reduce(t, group=g))
    out["all_reduce_t_queued"] = q
    z = val((4, 3))
    _nc(be, z[:, 1], lambda t: dist.broadcast(t, src=0, group=g))
    out["broadcast"] = z
    w = val((4, 3))
    _nc(be, w[:, ::2], lambda t: dist.reduce(t, dst=N - 1, group=g))
    out["reduce"] = w if R == N - 1 else torch.zeros(1)
    inp = val((3, 2)).t()  # (2, 3)
    bases = [torch.zeros(6, 2) for _ in range(N)]
    outs = [b_[::2].t() for b_ in bases]  # (2, 3) views
    if be == "gloo":
        tmp = [o.contiguous() for o in outs]
        dist.all_gather(tmp, inp.contiguous(), group=g)
        for o, t in zip(outs, tmp):
            o.copy_(t)
    else:
        dist.all_gather(outs, inp, group=g)
    out["all_gather"] = torch.stack(bases)
    ob = torch.zeros(2, 3 * N)
    src = val((2, 3)).t()  # (3, 2)
    _nc(be, ob.t(), lambda t: dist.all_gather_into_tensor(t, src.contiguous() if be == "gloo" else src, group=g))
    out["all_gather_into_tensor"] = ob
    rs_out_base = torch.zeros(3, 2)
    rs_ins = [val((2, 3), k=r + 1).t() for r in range(N)]
    rs_blocks = [i[:, 0].contiguous() if be == "gloo" else i[:, 0] for i in rs_ins]
    _nc(be, rs_out_base[:, 1], lambda t: dist.reduce_scatter(t, rs_blocks, group=g))
    out["reduce_scatter"] = rs_out_base
    a2a_base = torch.zeros(3, 2 * N)
    a2a_in = val((2 * N, 3)).t()  # (3, 2N) viewed as the input (2N, 3) below
    a2a_src = a2a_in.t().contiguous() if be == "gloo" else a2a_in.t()
    _nc(be, a2a_base.t(), lambda t: dist.all_to_all_single(t, a2a_src, group=g))
    out["all_to_all_single"] = a2a_base
    # gather / scatter with non-contiguous input and outputs
    gi = val((2, 3)).t()
    gbases = [torch.zeros(3, 4) for _ in range(N)]
    gouts = [b_[:, ::2] for b_ in gbases] if R == 0 else None
    if be == "gloo":
        tmp = [o.contiguous() for o in gouts] if R == 0 else None
        dist.gather(gi.contiguous(), tmp, dst=0, group=g)
        if R == 0:
            for o, t in zip(gouts, tmp):
                o.copy_(t)
    else:
        dist.gather(gi, gouts, dst=0, group=g)
    out["gather"] = torch.stack(gbases)
    sbase = torch.zeros(3, 4)
    sout = sbase[:, 1::2]
    sins = [val((2, 3), k=r + 1).t() for r in range(N)] if R == 0 else None
    if be == "gloo":
        tmp = sout.contiguous()
        dist.scatter(tmp, [s.contiguous() for s in sins] if R == 0 else None, src=0, group=g)
        sout.copy_(tmp)
    else:
        dist.scatter(sout, sins, src=0, group=g)
    out["scatter"] = sbase
    return out


@check
def lazy_conj(g, be):
    """Conjugated and negated views (torch's lazy bits) handed to the backend itself (through a
    ProcessGroup, torch's dispatcher hands any backend a resolved copy): reduced and moved as
    their values."""
    b = g._get_backend(CPU)
    bo = dist.BroadcastOptions()
    bo.rootRank = N - 1
    x = torch.complex(val((4,)), val((4,), k=-2.0))
    _nc_conj(be, x.conj(), lambda t: b.allreduce([t]).wait())
    y = torch.complex(val((3,)), val((3,), k=3.0))
    _nc_conj(be, y.conj(), lambda t: b.broadcast([t], bo).wait())
    z = val((5,))
    _nc_conj(be, torch._neg_view(z), lambda t: b.allreduce([t]).wait())
    return {"conj_all_reduce": torch.view_as_real(x), "conj_broadcast": torch.view_as_real(y), "neg_all_reduce": z}


def _nc_conj(be, view, fn):
    """`fn(view)`; for gloo on a resolved copy written back."""
    if be == "gloo":
        tmp = view.resolve_conj().resolve_neg()
        fn(tmp)
        view.copy_(tmp)
    else:
        fn(view)


# --- 6. missing forms ----------------------------------------------------------------------------
@check
def sparse_all_reduce(g, be):
    i = torch.tensor([[R, N, R + 1], [0, 1, 2]])
    v = torch.tensor([1.0, float(R + 1), 0.5])
    s = torch.sparse_coo_tensor(i, v, (N + 2, 3))
    dist.all_reduce(s, group=g)
    e = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64), torch.zeros(0), (5,))
    if R == 0:
        e = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.tensor([2.0, 4.0]), (5,))
    dist.all_reduce(e, group=g)  # nothing on some ranks
    return {"sparse": s.to_dense(), "sparse_some_empty": e.to_dense()}


@check
def sparse_all_reduce_two(g, be):
    # gloo's form: several sparse tensors in one call, summed locally, then over the ranks.
    a = torch.sparse_coo_tensor(torch.tensor([[R, N]]), torch.tensor([1.0, float(R + 1)]), (N + 2,))
    b = torch.sparse_coo_tensor(torch.tensor([[0, R + 1]]), torch.tensor([0.5, 2.0]), (N + 2,))
    g.allreduce([a, b]).wait()
    return {"sparse_two_a": a.to_dense(), "sparse_two_b": b.to_dense()}


@check
def reduce_scatter_uneven(g, be):
    ins = [val((r + 1, 2), k=r + 1) for r in range(N)]
    out = torch.zeros(R + 1, 2)
    dist.reduce_scatter(out, ins, group=g)
    ins2 = [val((2 * r + 1,), dtype=torch.int64) for r in range(N)]
    out2 = torch.zeros(2 * R + 1, dtype=torch.int64)
    dist.reduce_scatter(out2, ins2, op=dist.ReduceOp.MAX, group=g)
    return {"uneven": out, "uneven_max": out2}


@check
def allgather_several_inputs(g, be):
    ins = [val((2, 2), k=j + 1) for j in range(3)]
    outs = [[torch.zeros(2, 2) for _ in range(3 * N)] for _ in range(3)]
    g.allgather(outs, ins).wait()
    return {"ag3": torch.stack([torch.stack(o) for o in outs])}


@check
def allgather_several_inputs_future(g, be):
    # The future's value has the outputs' shape: one list per input (k lists of k * N).
    ins = [val((2,), k=j + 1) for j in range(2)]
    outs = [[torch.zeros(2) for _ in range(2 * N)] for _ in range(2)]
    w = g.allgather(outs, ins)
    value = w.get_future().wait()
    shape = [len(value)] + [len(v) if isinstance(v, list) else -1 for v in value]
    flat = [t for v in value for t in (v if isinstance(v, list) else [v])]
    return {"ag_future_shape": torch.tensor(shape), "ag_future_value": torch.stack(flat)}


@check
def all_gather_in_inference_mode(g, be):
    # The outputs are inference tensors: the copies into them, made once the call has
    # finished (on another thread when queued), must run in inference mode too.
    got = {}
    for size in (4, 300_000):  # inline, and queued
        with torch.inference_mode():
            x = val((size,))
            outs = [torch.zeros(size) for _ in range(N)]
            w = dist.all_gather(outs, x, group=g, async_op=True)
            w.get_future().wait()
        got[f"inference_all_gather_{size}"] = torch.stack(outs).clone()
    return got


@check
def zero_elements(g, be):
    a = torch.zeros(0)
    dist.all_reduce(a, group=g)
    b_ = torch.zeros(0, 3)
    dist.broadcast(b_, src=0, group=g)
    outs = [torch.ones(0) for _ in range(N)]
    dist.all_gather(outs, torch.zeros(0), group=g)
    c = torch.zeros(0)
    dist.reduce_scatter(c, [torch.zeros(0) for _ in range(N)], group=g)
    return {"zero_all_reduce": a, "zero_broadcast": b_, "zero_all_gather": torch.stack(outs), "zero_rs": c}


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool, torch.complex64, torch.complex128]


def _dval(dtype, k=1.0):
    if dtype == torch.bool:
        return torch.tensor([R == 0, True, False, R % 2 == 1])
    if dtype.is_complex:
        return torch.complex(val((4,), k=k), val((4,), k=-k)).to(dtype)
    return val((4,), dtype=dtype, k=k)


@check
def dtypes(g, be):
    out = {}
    for dt in DTYPES + [torch.complex32]:
        name = str(dt).split(".")[1]
        for opname in ("SUM", "MAX", "PRODUCT"):
            if dt == torch.complex32 and opname != "SUM":
                continue
            t = _dval(dt)
            if dt in (torch.int8, torch.uint8):
                t = t % 7
            o = dist.AllreduceOptions()
            o.reduceOp = getattr(dist.ReduceOp, opname)
            e = raised(lambda: g.allreduce([t], o))  # the ProcessGroup call: complex reaches the backend
            t = torch.view_as_real(t).float() if dt.is_complex else t
            out[f"{name}_{opname}"] = torch.tensor([1]) if e is not None else t
        t = _dval(dt)
        dist.broadcast(t, src=N - 1, group=g)
        out[f"{name}_broadcast"] = torch.view_as_real(t).float() if dt.is_complex else t
        outs = [torch.zeros_like(t) for _ in range(N)]
        dist.all_gather(outs, _dval(dt), group=g)
        out[f"{name}_all_gather"] = torch.stack([torch.view_as_real(o).float() if dt.is_complex else o for o in outs])
    return out


@oxccl_only
def dtypes_gloo_rejects(g):
    """int16 reduces in int32 and wraps as int16; the unsigned ones; float8 moves as bytes and
    refuses to reduce; complex MIN/MAX refused with a clear error."""
    for dt in (torch.int16, torch.uint16, torch.uint32, torch.uint64):
        for op, ref in ((dist.ReduceOp.SUM, lambda xs: sum(xs)), (dist.ReduceOp.MAX, lambda xs: torch.stack(xs).max(0).values),
                        (dist.ReduceOp.PRODUCT, None), (dist.ReduceOp.BXOR, None)):
            xs = [(val((5,), r=r, dtype=torch.int64, k=3.0) * 1000).to(dt) for r in range(N)]
            t = xs[R].clone()
            dist.all_reduce(t, op=op, group=g)
            if ref is None:  # wrapping product / xor, computed in int64 and wrapped like the dtype
                acc = xs[0].to(torch.int64)
                for x in xs[1:]:
                    acc = acc * x.to(torch.int64) if op == dist.ReduceOp.PRODUCT else acc ^ x.to(torch.int64)
                want = acc.to(dt) if dt != torch.uint64 else None
            else:
                want = ref([x.to(torch.int64) for x in xs]).to(dt) if dt != torch.uint64 else None
            if want is not None:
                assert torch.equal(t, want), (dt, op, t, want)
    f8 = torch.tensor([0.5, 1.0, 2.0 * (R + 1)]).to(torch.float8_e4m3fn)
    dist.broadcast(f8, src=N - 1, group=g)
    assert torch.equal(f8.float(), torch.tensor([0.5, 1.0, 2.0 * N])), f8
    outs = [torch.zeros(3, dtype=torch.float8_e4m3fn) for _ in range(N)]
    dist.all_gather(outs, torch.full((3,), float(R + 1)).to(torch.float8_e4m3fn), group=g)
    assert [o.float()[0].item() for o in outs] == [float(r + 1) for r in range(N)]
    e = raised(lambda: dist.all_reduce(f8, group=g))
    assert e is not None and "float8" in str(e), e
    c = torch.ones(3, dtype=torch.complex64)
    for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        o = dist.AllreduceOptions()
        o.reduceOp = op
        e = raised(lambda: g.allreduce([c], o))
        assert e is not None and "complex" in str(e), e
    # AVG of complex, and of a strided view (gloo has no AVG)
    c = torch.complex(val((3,)), val((3,), k=-1.0))
    dist.all_reduce(c, op=dist.ReduceOp.AVG, group=g)
    want = sum(torch.complex(val((3,), r=r), val((3,), r=r, k=-1.0)) for r in range(N)) / N
    assert torch.allclose(c, want), (c, want)
    x = val((4, 4))
    dist.all_reduce(x[:, 1], op=dist.ReduceOp.AVG, group=g)
    want = val((4, 4))
    want[:, 1] = sum(val((4, 4), r=r)[:, 1] for r in range(N)) / N
    assert torch.allclose(x, want), (x, want)


@oxccl_only
def gather_scatter_empty_list_on_the_root(g):
    """An empty gather_list (scatter_list) on the root fails on every rank at the call, not at
    wait(), before any data moves, and the group stays in step: the next collective works.
    The other ranks cannot see the root's list: the root tells them in a message of the call
    itself, and each raises the root's reason; so does a tensor of the root's own that no call
    can take. (gloo raises on the root only; its peers wait in the call.)"""
    b = g._get_backend(CPU)
    for root in (0, N - 1):
        for empty in ([], [[]]):
            go = dist.GatherOptions()
            go.rootRank = root
            try:
                b.gather(empty if R == root else [], [torch.full((2,), float(R))], go)
            except oxccl.InvalidArgumentError as e:
                msg = str(e)
                assert f"rank {R}" in msg and "gather" in msg and f"0 output tensors on the root for a group of {N}" in msg, msg
                assert R == root or f"the root (rank {root}) refused" in msg, msg
            else:
                raise AssertionError(f"gather with an empty list on root {root}: accepted on rank {R}")
            so = dist.ScatterOptions()
            so.rootRank = root
            out = torch.full((2,), -1.0)
            try:
                b.scatter([out], empty if R == root else [], so)
            except oxccl.InvalidArgumentError as e:
                msg = str(e)
                assert f"rank {R}" in msg and "scatter" in msg and f"0 input tensors on the root for a group of {N}" in msg, msg
                assert R == root or f"the root (rank {root}) refused" in msg, msg
            else:
                raise AssertionError(f"scatter with an empty list on root {root}: accepted on rank {R}")
            assert torch.equal(out, torch.full((2,), -1.0)), f"the refused scatter wrote {out}"
            t = torch.full((3,), float(R + 1))
            dist.all_reduce(t, group=g)
            assert torch.equal(t, torch.full((3,), float(N * (N + 1) // 2))), t
            # and the same calls, well formed, still work
            outs = [torch.zeros(2) for _ in range(N)] if R == root else None
            dist.gather(torch.full((2,), float(R)), outs, dst=root, group=g)
            if R == root:
                assert torch.equal(torch.stack(outs), torch.arange(N, dtype=torch.float32)[:, None].expand(N, 2)), outs
            dist.scatter(out, [torch.full((2,), float(p)) for p in range(N)] if R == root else None, src=root, group=g)
            assert torch.equal(out, torch.full((2,), float(R))), out
        # The root's own tensor refused (a meta tensor has no memory): every rank raises too.
        go = dist.GatherOptions()
        go.rootRank = root
        mine = torch.empty(2, device="meta") if R == root else torch.full((2,), float(R))
        outs = [[torch.zeros(2) for _ in range(N)]] if R == root else []
        try:
            b.gather(outs, [mine], go)
        except oxccl.InvalidArgumentError as e:
            msg = str(e)
            assert "gather input: the tensor is on meta" in msg, msg
            assert R == root or f"the root (rank {root}) refused" in msg, msg
        else:
            raise AssertionError(f"gather with a meta input on root {root}: accepted on rank {R}")
        so = dist.ScatterOptions()
        so.rootRank = root
        out = torch.empty(2, device="meta") if R == root else torch.full((2,), -1.0)
        try:
            b.scatter([out], [[torch.ones(2) for _ in range(N)]] if R == root else [], so)
        except oxccl.InvalidArgumentError as e:
            msg = str(e)
            assert "scatter output: the tensor is on meta" in msg, msg
            assert R == root or f"the root (rank {root}) refused" in msg, msg
        else:
            raise AssertionError(f"scatter with a meta output on root {root}: accepted on rank {R}")
        t = torch.ones(2)
        dist.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((2,), float(N))), t


@check
def sequence_numbers(g, be):
    s0 = g._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(1), group=g)
    dist.broadcast(torch.ones(1), src=0, group=g)
    dist.all_gather([torch.ones(1) for _ in range(N)], torch.ones(1), group=g)
    dist.reduce_scatter_tensor(torch.ones(1), torch.ones(N), group=g)  # (gloo counts its list form twice)
    dist.all_reduce_coalesced([torch.ones(1), torch.ones(2)], group=g)
    dist.all_to_all_single(torch.ones(N), torch.ones(N), group=g)
    dist.gather(torch.ones(1), [torch.ones(1) for _ in range(N)] if R == 0 else None, dst=0, group=g)
    dist.barrier(group=g)
    s1 = g._get_sequence_number_for_group()
    return {"seq_delta": torch.tensor([s1 - s0]), "seq_positive": torch.tensor([s1 > 0])}


def detail_subgroup_objects():
    """Object collectives on a subgroup under TORCH_DISTRIBUTED_DEBUG=DETAIL (a wrapper that
    compares sequence numbers across ranks)."""
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        sub = dist.new_group(list(range(N)), backend="oxccl")
        sub2 = dist.new_group([0, 1], backend="oxccl")
        objs = [None] * N
        dist.all_gather_object(objs, {"rank": R}, group=sub)
        assert objs == [{"rank": r} for r in range(N)], objs
        lst = [R * 10 if R == 0 else None]
        dist.broadcast_object_list(lst, src=0, group=sub)
        assert lst == [0], lst
        if R < 2:
            got = [None, None]
            dist.all_gather_object(got, R, group=sub2)
            assert got == [0, 1], got
        t = torch.ones(2)
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((2,), float(N)))
        assert sub._get_sequence_number_for_group() > 0
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)


def _cmp(k, o, gl):
    if o.dtype.is_floating_point:  # half types: gloo rounds after every step, oxccl may not
        rtol = 2e-2 if o.dtype in (torch.float16, torch.bfloat16) else 1e-5
        return o.shape == gl.shape and torch.allclose(o.double(), gl.double(), rtol=rtol, atol=1e-5)
    return o.shape == gl.shape and torch.equal(o, gl)


def main():
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    ox = dist.new_group(list(range(N)), backend="oxccl")
    gl = dist.new_group(list(range(N)), backend="gloo")
    kind = type(ox._get_backend(CPU)).__name__
    want = "BackendOxcclCpp"
    assert kind == want, f"the oxccl backend in use is {kind}, expected {want}"
    bad, n = [], 0
    for fn in CHECKS:
        res = {}
        for be, g in (("gloo", gl), ("oxccl", ox)):
            try:
                res[be] = fn(g, be)
            except Exception as e:  # noqa: BLE001
                res[be] = e
            dist.barrier()  # the default group: the two groups' checks stay apart
        a, b = res["gloo"], res["oxccl"]
        if isinstance(a, Exception) or isinstance(b, Exception):
            bad.append(f"{fn.__name__}: gloo {a!r} / oxccl {b!r}")
            continue
        for k in a:
            n += 1
            if k not in b:
                bad.append(f"{fn.__name__}.{k}: not returned by oxccl")
            elif not _cmp(k, b[k], a[k]):
                bad.append(f"{fn.__name__}.{k}: oxccl {b[k]} vs gloo {a[k]}")
    for fn in OXCCL_ONLY:
        try:
            fn(ox)
        except Exception as e:  # noqa: BLE001
            bad.append(f"{fn.__name__}: {e!r}")
        dist.barrier()
    try:
        detail_subgroup_objects()
    except Exception as e:  # noqa: BLE001
        bad.append(f"detail_subgroup_objects: {e!r}")
    for line in bad:
        print(f"rank {R}: MISMATCH {line}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        sys.exit(1)
    print(f"rank {R}: {n} forms equal to gloo, {len(OXCCL_ONLY)} oxccl-only checks: torch forms ok", flush=True)


if __name__ == "__main__":
    main()
