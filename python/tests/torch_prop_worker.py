"""A property test of the "oxccl" torch backend against gloo.

Every rank draws the same random sequence of torch.distributed calls (the call, its form,
sync or async, dtype, shape, view, root, op and group come from one generator seeded alike on
every rank; the data from a generator seeded per rank), runs each call on an oxccl group and on
the gloo group of the same ranks (on contiguous copies: views are drawn for oxccl only), in
the same process, and compares the results: bitwise, but
allclose for floating-point sums and averages (gloo and oxccl add in different orders). A
failure names the seed, the call's index and everything drawn for it, so
``OXCCL_PROP_SEED=S`` replays it.

Run as ranks by ``test_torch_property.py`` (``launch(n, "prop", args=[calls, seed])``).
"""

import os
import random
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import oxccl.torch  # noqa: F401 - registers "oxccl"

RED_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64]
MOVE_DTYPES = RED_DTYPES + [torch.bool, torch.complex64, torch.complex128]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
TRACE = os.environ.get("OXCCL_PROP_TRACE")  # a file prefix: every call is written to PREFIX.RANK before it runs
SHAPES = [(0,), (1,), (7,), (13,), (4, 6), (3, 5, 2), (1000,), (70_001,)]


class Case:
    """What was drawn for one call, printed on failure."""

    def __init__(self, index, **kw):
        self.index = index
        self.kw = kw

    def __str__(self):
        return f"call #{self.index}: " + ", ".join(f"{k}={v}" for k, v in self.kw.items())


def close(a, b, loose, what):
    if a.dtype == torch.int16 and b.dtype == torch.int32:  # the reference ran in int32
        b = b.to(torch.int16)
    if a.is_complex() and not b.is_complex():  # the reference ran on the real view
        b = torch.view_as_complex(b.contiguous())
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{what}: shape/dtype oxccl {tuple(a.shape)} {a.dtype} vs gloo {tuple(b.shape)} {b.dtype}")
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if loose and a.is_floating_point():
        tol = 2e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-5
        ok = torch.allclose(a.double(), b.double(), rtol=tol, atol=tol, equal_nan=True)
    else:
        ok = torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                   and torch.equal(a.nan_to_num(), b.nan_to_num()))
    if not ok:
        diff = (a.double() - b.double()).abs() if a.numel() else a
        where = int(diff.argmax()) if a.numel() else -1
        raise AssertionError(f"{what}: oxccl != gloo (first elements oxccl {a.reshape(-1)[:4].tolist()} "
                             f"gloo {b.reshape(-1)[:4].tolist()}; largest difference at flat index {where})")


class Prop:
    def __init__(self, seed):
        self.r, self.n = dist.get_rank(), dist.get_world_size()
        self.seed = seed
        self.calls = random.Random(seed)  # the same on every rank
        self.data = torch.Generator().manual_seed(seed * 1000 + self.r)
        world = list(range(self.n))
        # groups: the whole world on both backends, and (n > 2) the last two ranks (torch
        # sorts a group's ranks: group rank i is the i-th smallest global rank)
        to = timedelta(seconds=60)
        self.groups = [("world", world, dist.new_group(world, backend="oxccl", timeout=to),
                        dist.new_group(world, backend="gloo", timeout=to))]
        if self.n > 2:
            sub = [self.n - 2, self.n - 1]
            self.groups.append(("sub", sub, dist.new_group(sub, backend="oxccl", timeout=to),
                                dist.new_group(sub, backend="gloo", timeout=to)))
        self.checked = 0

    # ---- drawing -------------------------------------------------------------------------
    def tensor(self, shape, dtype, op="SUM"):
        g = self.data
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=g).bool()
        if dtype.is_complex:
            re = torch.randn(shape, generator=g, dtype=torch.float64)
            im = torch.randn(shape, generator=g, dtype=torch.float64)
            return torch.complex(re, im).to(dtype)
        if dtype.is_floating_point:
            if op == "PRODUCT":
                return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
            return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        hi = {torch.uint8: 4, torch.int8: 4}.get(dtype, 50)
        if op == "PRODUCT":
            hi = 3
        return torch.randint(0, hi, shape, generator=g).to(dtype)

    def view(self, t, kind):
        """`t`'s values as the view `kind` (a fresh buffer each time, same values)."""
        if kind == "contiguous" or t.numel() == 0:
            return t.clone()
        if kind == "transposed" and t.dim() >= 2:
            return t.clone().transpose(0, 1).contiguous().transpose(0, 1)
        if kind == "strided":
            flat = t.reshape(-1)
            big = torch.zeros(flat.numel() * 2, dtype=t.dtype)
            big[::2] = flat
            return big[::2].reshape(t.shape)
        if kind == "offset":
            flat = t.reshape(-1)
            big = torch.zeros(flat.numel() + 3, dtype=t.dtype)
            big[3:] = flat
            return big[3:].reshape(t.shape)
        return t.clone()

    # ---- running -------------------------------------------------------------------------
    def both(self, case, fn):
        """Runs fn(group, async_op) on oxccl and on gloo; returns both results."""
        _, ranks, ox, gl = case.kw["group"]
        asy = case.kw["async"]
        out, errs = [], []
        for grp in (ox, gl):
            try:
                res, works = fn(grp, asy)
                for w in works:
                    if w is not None:
                        w.wait()
                out.append(res)
                errs.append(None)
            except (RuntimeError, ValueError, TypeError) as e:
                out.append(None)
                errs.append(e)
        if errs[0] is not None and errs[1] is None:
            raise AssertionError(f"oxccl raised where gloo did not: {type(errs[0]).__name__}: {errs[0]}")
        if errs[1] is not None:
            # the reference must not fail: an error of gloo's at wait() leaves its group broken
            raise AssertionError(f"gloo (the reference) raised: {type(errs[1]).__name__}: {errs[1]}; "
                                 f"oxccl {'raised ' + str(errs[0]) if errs[0] else 'did not raise'}")
        return out

    def run(self, index):
        c = self.calls
        gname, ranks, ox, gl = c.choice(self.groups)
        kind = c.choice(["all_reduce", "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                         "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                         "gather", "scatter", "all_gather_coalesced", "coalesced_all_reduce", "p2p", "barrier"])
        op = c.choice(OPS)
        dtypes = RED_DTYPES if kind in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                                        "coalesced_all_reduce") else MOVE_DTYPES
        dtype = c.choice(dtypes)
        if kind == "all_reduce" and c.random() < 0.15:
            dtype = c.choice([torch.complex64, torch.complex128])
            op = c.choice(["SUM", "AVG"])
        shape = c.choice(SHAPES)
        view = c.choice(["contiguous", "contiguous", "transposed", "strided", "offset"])
        root_i = c.randrange(len(ranks))
        asy = c.random() < 0.5
        alias = c.random() < 0.3
        uneven = c.random() < 0.5
        base = c.randrange(3)
        case = Case(index, seed=self.seed, kind=kind, group=(gname, ranks, ox, gl), op=op, dtype=dtype,
                    shape=shape, view=view, root=ranks[root_i], alias=alias, uneven=uneven, base=base)
        case.kw["async"] = asy
        if self.r not in ranks:
            return None
        if TRACE:
            with open(f"{TRACE}.{self.r}", "a") as f:
                f.write(f"rank {self.r}: {case}\n")
        try:
            self.one(case, kind, ranks, op, dtype, shape, view, ranks[root_i])
        except Exception as e:  # noqa: BLE001 - reported with the case
            shown = {k: (v[:2] if k == "group" else v) for k, v in case.kw.items()}
            raise AssertionError(f"rank {self.r}: seed {self.seed}: call #{index}: {shown}: {type(e).__name__}: {e}") from e
        return case

    def one(self, case, kind, ranks, op, dtype, shape, view, root):
        k = len(ranks)
        me = ranks.index(self.r)
        rop = getattr(dist.ReduceOp, op)

        def on_gloo(grp):
            return grp is case.kw["group"][3]

        # gloo lacks int16 and, in most calls, complex types (its error comes at wait() and
        # leaves the group broken): the reference runs int16 in int32 (the values fit) and
        # complex tensors as their real views (torch.view_as_real); close() maps back.
        def cv(x, grp):
            if on_gloo(grp) and x.dtype == torch.int16:
                return x.to(torch.int32)
            if on_gloo(grp) and x.is_complex():
                return torch.view_as_real(x).clone()
            return x.clone()

        def z(shape, grp):
            return cv(torch.zeros(shape, dtype=dtype), grp)

        def vk(grp):
            """The view drawn, on oxccl; gloo, the reference, gets contiguous tensors (it
            reduce_scatters into a non-contiguous output wrongly: seen with torch 2.15)."""
            return view if grp is case.kw["group"][2] else "contiguous"
        loose = op in ("SUM", "AVG", "PRODUCT") and (dtype.is_floating_point or dtype.is_complex)

        def gl_op(grp, t):
            """gloo has no AVG: SUM, then divide as oxccl documents (float: /n; int: trunc)."""
            return op == "AVG" and grp is case.kw["group"][3]

        def fix_avg(grp, t):
            if gl_op(grp, t):
                if t.is_floating_point() or t.is_complex():
                    t.div_(k)
                else:
                    t.copy_(torch.div(t, k, rounding_mode="trunc"))
            return t

        def red_op(grp):
            return dist.ReduceOp.SUM if gl_op(grp, None) else rop

        if kind == "all_reduce":
            x = self.tensor(shape, dtype, op)

            def f(grp, asy):
                t = self.view(cv(x, grp), vk(grp))
                w = dist.all_reduce(t, op=red_op(grp), group=grp, async_op=asy)
                return t, [w]
            a, b = self.both(case, f)
            if case.kw["group"][3] is not None:
                fix_avg(case.kw["group"][3], b)
            close(a, b, loose, "all_reduce")
        elif kind == "coalesced_all_reduce":
            xs = [self.tensor(s, dtype, op) for s in (shape, (3,), shape)]

            def f(grp, asy):
                ts = [self.view(cv(x, grp), vk(grp)) for x in xs]
                if case.kw["alias"]:
                    ts[2] = ts[0]  # the same tensor twice: as gloo, as if reduced once per position
                with dist._coalescing_manager(group=grp, async_ops=True) as cm:
                    for t in ts:
                        dist.all_reduce(t, op=red_op(grp), group=grp)
                cm.wait()
                return ts, []
            a, b = self.both(case, f)
            fixed = set()
            for p, q in zip(a, b):
                if id(q) not in fixed:  # an aliased tensor is divided once
                    fix_avg(case.kw["group"][3], q)
                    fixed.add(id(q))
                close(p, q, loose, "coalesced all_reduce")
        elif kind == "broadcast":
            x = self.tensor(shape, dtype)

            def f(grp, asy):
                t = self.view(cv(x, grp), vk(grp))
                return t, [dist.broadcast(t, src=root, group=grp, async_op=asy)]
            a, b = self.both(case, f)
            close(a, b, False, "broadcast")
        elif kind == "reduce":
            x = self.tensor(shape, dtype, op)

            def f(grp, asy):
                t = self.view(cv(x, grp), vk(grp))
                return t, [dist.reduce(t, dst=root, op=red_op(grp), group=grp, async_op=asy)]
            a, b = self.both(case, f)
            if self.r == root:
                close(a, fix_avg(case.kw["group"][3], b), loose, "reduce")
        elif kind == "all_gather":
            x = self.tensor(shape, dtype)

            def f(grp, asy):
                outs = [self.view(z(shape, grp), vk(grp)) for _ in range(k)]
                return outs, [dist.all_gather(outs, self.view(cv(x, grp), vk(grp)), group=grp, async_op=asy)]
            a, b = self.both(case, f)
            for p, q in zip(a, b):
                close(p, q, False, "all_gather")
        elif kind == "all_gather_into_tensor":
            x = self.tensor(shape, dtype)

            def f(grp, asy):
                out = z((k * shape[0],) + tuple(shape[1:]), grp)
                return out, [dist.all_gather_into_tensor(out, cv(x, grp), group=grp, async_op=asy)]
            a, b = self.both(case, f)
            close(a, b, False, "all_gather_into_tensor")
        elif kind == "reduce_scatter":
            xs = [self.tensor(shape, dtype, op) for _ in range(k)]

            def f(grp, asy):
                out = self.view(z(shape, grp), vk(grp))
                w = dist.reduce_scatter(out, [self.view(cv(x, grp), vk(grp)) for x in xs], op=red_op(grp), group=grp, async_op=asy)
                return out, [w]
            a, b = self.both(case, f)
            close(a, fix_avg(case.kw["group"][3], b), loose, "reduce_scatter")
        elif kind == "reduce_scatter_tensor":
            x = self.tensor((k * shape[0],) + tuple(shape[1:]), dtype, op)

            def f(grp, asy):
                out = z(shape, grp)
                w = dist.reduce_scatter_tensor(out, cv(x, grp), op=red_op(grp), group=grp, async_op=asy)
                return out, [w]
            a, b = self.both(case, f)
            close(a, fix_avg(case.kw["group"][3], b), loose, "reduce_scatter_tensor")
        elif kind == "all_to_all":
            xs = [self.tensor(shape, dtype) for _ in range(k)]

            def f(grp, asy):
                outs = [z(shape, grp) for _ in range(k)]
                return outs, [dist.all_to_all(outs, [self.view(cv(x, grp), vk(grp)) for x in xs], group=grp, async_op=asy)]
            a, b = self.both(case, f)
            for p, q in zip(a, b):
                close(p, q, False, "all_to_all")
        elif kind == "all_to_all_single":
            rows = shape[0]
            # every rank derives every rank's splits from the shared draw
            uneven, base = case.kw["uneven"], case.kw["base"]
            if uneven:
                insz = [(me + p + base) % 3 for p in range(k)]
                outsz = [(p + me + base) % 3 for p in range(k)]
                x = self.tensor((sum(insz),) + tuple(shape[1:]), dtype)
                out_shape = (sum(outsz),) + tuple(shape[1:])
            else:
                insz = outsz = None
                x = self.tensor((k * rows,) + tuple(shape[1:]), dtype)
                out_shape = x.shape

            def f(grp, asy):
                out = z(out_shape, grp)
                return out, [dist.all_to_all_single(out, cv(x, grp), outsz, insz, group=grp, async_op=asy)]
            a, b = self.both(case, f)
            close(a, b, False, "all_to_all_single")
        elif kind == "gather":
            x = self.tensor(shape, dtype)

            def f(grp, asy):
                outs = [z(shape, grp) for _ in range(k)] if self.r == root else None
                return outs, [dist.gather(cv(x, grp), outs, dst=root, group=grp, async_op=asy)]
            a, b = self.both(case, f)
            if self.r == root:
                for p, q in zip(a, b):
                    close(p, q, False, "gather")
        elif kind == "scatter":
            xs = [self.tensor(shape, dtype) for _ in range(k)]

            def f(grp, asy):
                out = z(shape, grp)
                ins = [cv(x, grp) for x in xs] if self.r == root else None
                return out, [dist.scatter(out, ins, src=root, group=grp, async_op=asy)]
            a, b = self.both(case, f)
            close(a, b, False, "scatter")
        elif kind == "all_gather_coalesced":
            xs = [self.tensor(s, dtype) for s in (shape, (2, 3))]

            def f(grp, asy):
                outs = [[z(x.shape, grp) for x in xs] for _ in range(k)]
                return outs, [dist.all_gather_coalesced(outs, [cv(x, grp) for x in xs], group=grp, async_op=asy)]
            a, b = self.both(case, f)
            for pa, pb in zip(a, b):
                for p, q in zip(pa, pb):
                    close(p, q, False, "all_gather_coalesced")
        elif kind == "p2p":
            # a ring over the group's ranks, with batch_isend_irecv (both directions at once)
            x = self.tensor(shape, dtype)
            nxt, prv = ranks[(me + 1) % k], ranks[(me - 1) % k]
            if k == 1:
                return
            def f(grp, asy):
                y = z(shape, grp)
                ops = [dist.P2POp(dist.isend, cv(x, grp), nxt, group=grp), dist.P2POp(dist.irecv, y, prv, group=grp)]
                return y, dist.batch_isend_irecv(ops)
            a, b = self.both(case, f)
            close(a, b, False, "p2p")
        elif kind == "barrier":
            self.both(case, lambda grp, asy: (None, [dist.barrier(group=grp, async_op=asy)]))
        self.checked += 1


def prop(calls, seed):
    calls = int(calls)
    seed = int(os.environ.get("OXCCL_PROP_SEED", seed))  # the same on every rank
    dist.init_process_group("oxccl")
    p = Prop(seed)
    if p.r == 0:
        print(f"property test: seed {seed} (replay with OXCCL_PROP_SEED={seed}), {calls} calls", flush=True)
    try:
        for i in range(calls):
            p.run(i)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print(f"rank {p.r}: FAILED with seed {seed} (replay with OXCCL_PROP_SEED={seed})", flush=True)
        sys.stdout.flush()
        os._exit(1)
    dist.barrier()
    print(f"rank {p.r}: property test ok: {p.checked} calls compared with gloo, seed {seed}", flush=True)
    dist.destroy_process_group()
