"""The rank side of test_torch_features.py: every check runs once under gloo and once under
oxccl, in one process (two process groups in turn, on one TCPStore), and the results are
compared.

    python torch_features_worker.py TMPDIR [CHECK ...]

Each check returns a dict of named tensors (or numbers); the comparison needs every name
equal (integers, bools) or close (floats) between the two backends. Checks that test
oxccl-only behaviour (errors, timeouts) assert by themselves.
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import oxccl
import oxccl.torch  # noqa: F401 - registers "oxccl"

R = int(os.environ["RANK"])
N = int(os.environ["WORLD_SIZE"])
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(step):
    g = torch.Generator().manual_seed(100 * step + R)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _train(model, steps=3, opt=None):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for s in range(steps):
        x, y = _batch(s)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
@check
def device_mesh(be):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (N,))
    g = mesh.get_group()
    assert g.group_name and torch.device("cpu") in g._device_types, (g.group_name, g._device_types)
    assert dist.get_backend(g) == be
    x = torch.arange(4.0) + R
    dist.all_reduce(x, group=g)
    # 2-D: (1, N) so the "tp" dimension spans every rank and "dp" is one rank per group
    mesh2 = init_device_mesh("cpu", (1, N), mesh_dim_names=("dp", "tp"))
    y = torch.arange(3.0) * (R + 1)
    dist.all_reduce(y, group=mesh2.get_group("tp"))
    z = y.clone()
    dist.all_reduce(z, group=mesh2.get_group("dp"))
    assert mesh2["tp"].size() == N and mesh2["dp"].size() == 1
    return {"mesh1d": x, "mesh2d_tp": y, "mesh2d_dp": z}


@check
def fsdp2_and_dcp(be, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (N,))
    model = _model(1)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = _train(model, steps=3)
    # distributed checkpoint: save the sharded state, spoil it, load it back
    sd = model.state_dict()
    saved = {k: v.full_tensor().clone() for k, v in sd.items()}
    path = os.path.join(tmp, f"dcp_{be}")
    dcp.save(sd, checkpoint_id=path)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sd2 = model.state_dict()
    dcp.load(sd2, checkpoint_id=path)
    model.load_state_dict(sd2)
    loaded = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    return {"fsdp2_losses": losses, "dcp_loaded": torch.cat([v.reshape(-1) for v in loaded.values()])}


@check
def dtensor(be):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (N,))
    full = torch.arange(6.0 * N).reshape(2 * N, 3)
    d = distribute_tensor(full, mesh, [Shard(0)])
    rep = d.redistribute(mesh, [Replicate()])
    back = rep.redistribute(mesh, [Shard(0)])
    assert torch.equal(rep.to_local(), full)
    # a local shard that differs per rank, summed by a Partial -> Replicate
    local = torch.full((2, 3), float(R + 1))
    from torch.distributed.tensor import DTensor, Partial

    p = DTensor.from_local(local, mesh, [Partial()]).redistribute(mesh, [Replicate()])
    return {"replicated": rep.to_local(), "shard": back.to_local(), "partial_sum": p.to_local()}


@check
def functional(be):
    import torch.distributed._functional_collectives as funcol

    g = dist.group.WORLD

    def f(x):
        a = funcol.all_reduce(x, "sum", g)
        b = funcol.all_gather_tensor(x * 2, 0, g)
        c = funcol.reduce_scatter_tensor(b, "sum", 0, g)
        return a + 1, b, c

    x = torch.arange(4.0 * N) + R
    eager = f(x)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)
    return {"funcol_eager": torch.cat([t.reshape(-1) for t in eager]), "funcol_compiled": torch.cat([t.reshape(-1) for t in compiled])}


@check
def compiled_ddp(be):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    model = torch.compile(DDP(_model(2)), backend="aot_eager")
    return {"compiled_ddp_losses": _train(model, steps=3)}


@check
def powersgd(be):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(3))
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5)
    model.register_comm_hook(state, psgd.powerSGD_hook)
    return {"powersgd_losses": _train(model, steps=4)}


@check
def then_blocking(be):
    """A blocking collective inside a .then() callback, small and queued (large) sizes."""
    out = {}
    for numel in (4, 1 << 19):
        x = torch.ones(numel) * (R + 1)
        y = torch.ones(numel) * (R + 2)  # the large one is queued: its wait needs another completion thread

        def cb(f, y=y):
            dist.all_reduce(y)  # blocking, in the callback
            return f.value()[0][:2] + y[0]

        fut = dist.all_reduce(x, async_op=True).get_future().then(cb)
        out[f"then_{numel}"] = fut.wait()
    # is_completed(): True once waited for
    w = dist.all_reduce(torch.ones(1 << 19), async_op=True)
    w.wait()
    out["is_completed_after_wait"] = torch.tensor([int(w.is_completed())])
    return out


@check
def gather_scatter(be):
    out = {}
    x = torch.arange(5, dtype=torch.int64) * (R + 1)
    root = N - 1
    gl = [torch.empty(5, dtype=torch.int64) for _ in range(N)] if R == root else None
    dist.gather(x, gl, dst=root)
    if R == root:
        out["gather"] = torch.stack(gl)
    sl = [torch.full((3,), float(10 * p + 1)) for p in range(N)] if R == 0 else None
    y = torch.empty(3)
    dist.scatter(y, sl, src=0)
    out["scatter"] = y
    objs = [None] * N if R == 0 else None
    dist.gather_object({"rank": R, "s": "x" * R}, objs, dst=0)
    if R == 0:
        out["gather_object"] = torch.tensor([len(o["s"]) * 10 + o["rank"] for o in objs])
    recv = [None]
    dist.scatter_object_list(recv, [f"obj{p}" * (p + 1) for p in range(N)] if R == 0 else None, src=0)
    out["scatter_object_list"] = torch.tensor(list(recv[0].encode()))
    return out


@check
def barriers_and_split(be):
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    split = [[0, 1]] if N == 2 else [[0, 2], [1]]
    sub = dist.split_group(split_ranks=split)
    assert sub is not None and sub.group_name and dist.get_backend(sub) == be
    x = torch.tensor([float(R + 1)])
    dist.all_reduce(x, group=sub)
    return {"split_group": x}


@check
def p2p(be):
    out = {}
    nxt, prv = (R + 1) % N, (R - 1) % N
    # send first, 16 MiB each way around the ring
    big = torch.full((4 << 20,), float(R), dtype=torch.float32)
    got = torch.empty_like(big)
    s = dist.isend(big, nxt)
    q = dist.irecv(got, prv)
    s.wait()
    q.wait()
    out["send_first_16MiB"] = got[::65536].clone()
    # tags: each of ranks 0 and 1 sends tag 1 then tag 2 and receives tag 2, then tag 1, in
    # two blocking recvs (separate groups): the messages must not be swapped
    if R < 2:
        peer = 1 - R
        a, b = torch.full((3,), 10.0 + R), torch.full((5,), 20.0 + R)
        ra, rb = torch.empty(3), torch.empty(5)
        ws = [dist.isend(a, peer, tag=1), dist.isend(b, peer, tag=2)]
        dist.recv(rb, peer, tag=2)
        dist.recv(ra, peer, tag=1)
        for w in ws:
            w.wait()
        out["tags"] = torch.cat([ra, rb])
    # recv from any source: rank 0 takes one message of tag 3 from each other rank, in
    # whatever order they come; dist.recv returns the sender
    if R == 0:
        got = {}
        for _ in range(N - 1):
            t = torch.empty(4)
            src = dist.recv(t, tag=3)
            got[src] = t
        out["anysource"] = torch.stack([torch.cat([torch.tensor([float(s)]), got[s]]) for s in sorted(got)])
    else:
        dist.send(torch.full((4,), 100.0 + R), 0, tag=3)
    # an isend not waited for goes at the sender's next collective: the recv completes
    # (its Work is kept: gloo drops a send whose Work is gone)
    t, w = torch.zeros(2), None
    if R == 1:
        w = dist.isend(torch.full((2,), 5.0), 0, tag=4)
    elif R == 0:
        dist.recv(t, 1, tag=4)
    dist.barrier()
    if w is not None:
        w.wait()
    out["unwaited_isend"] = t
    # wait(timeout=) raises on time; with oxccl the recv still completes afterwards (gloo
    # closes the pair on a timeout: its group is a throwaway one, and the data goes by WORLD)
    tg = dist.new_group([0, 1], backend=be)
    if R < 2:
        t = torch.zeros(4)
        if R == 0:
            w = dist.irecv(t, 1, group=tg)
            try:
                w.wait(timeout=timedelta(milliseconds=300))
            except RuntimeError as e:
                out["wait_timeout_raised"] = torch.tensor([1])
                if be == "oxccl":
                    assert isinstance(e, oxccl.TimeoutError) and "work.wait(timeout=)" in str(e), e
            else:
                out["wait_timeout_raised"] = torch.tensor([0])
            dist.barrier(group=_pair_group)  # lets rank 1 send now
            if be == "oxccl":
                w.wait()
            else:
                dist.recv(t, 1)
        else:
            dist.barrier(group=_pair_group)
            dist.send(torch.full((4,), 7.0), 0, group=tg if be == "oxccl" else None)
        out["after_timeout"] = t if R == 0 else torch.zeros(4)
    return out


@check
def dtypes_ops(be):
    out = {}
    # calls that move data take any dtype
    for dt in (torch.bool, torch.uint16, torch.complex64, torch.uint32, torch.uint64):
        x = (torch.arange(6) % 2 == R % 2) if dt == torch.bool else (torch.arange(6) + R).to(dt)
        g = torch.empty(N * 6, dtype=dt)
        try:
            dist.broadcast(x, src=N - 1)
            dist.all_gather_into_tensor(g, x.contiguous())
        except RuntimeError:
            if be == "oxccl":
                raise
            # gloo lacks the dtype: the reference is the same data moved as bytes
            xb = x.view(torch.uint8)
            dist.broadcast(xb, src=N - 1)
            dist.all_gather_into_tensor(g.view(torch.uint8), xb)
        out[f"move_{dt}"] = g.to(torch.complex128) if dt == torch.complex64 else g
    # reductions: equal to gloo where gloo has the dtype and op, else to a plain torch
    # reference over every rank's input (each rank's input is a function of its rank)
    def inp(dt, r):
        return (torch.arange(8) % (r + 2) == 0) if dt == torch.bool else ((torch.arange(8) * 37 + r * 11) % 200).to(dt)

    RO = dist.ReduceOp
    folds = {
        RO.SUM: lambda a, b: a + b, RO.PRODUCT: lambda a, b: a * b, RO.MIN: torch.minimum, RO.MAX: torch.maximum,
        RO.BAND: torch.bitwise_and, RO.BOR: torch.bitwise_or, RO.BXOR: torch.bitwise_xor,
    }

    def reference(dt, op):
        acc = None
        for r in range(N):
            v = inp(dt, r).to(torch.int64)  # exact; .to(dt) wraps as the typed arithmetic does
            acc = v if acc is None else folds[op](acc, v)
        return acc.to(dt)

    cases = [(torch.bool, op) for op in folds] + [
        (torch.int32, RO.BAND), (torch.int64, RO.BOR), (torch.uint8, RO.BXOR), (torch.int8, RO.BXOR),
        (torch.uint16, RO.SUM), (torch.uint16, RO.MAX), (torch.uint16, RO.BAND),
        (torch.uint32, RO.SUM), (torch.uint32, RO.MIN), (torch.uint32, RO.BOR),
        (torch.uint64, RO.SUM), (torch.uint64, RO.PRODUCT), (torch.uint64, RO.BXOR),
    ]
    for dt, op in cases:
        x, ref = inp(dt, R), reference(dt, op)
        try:
            dist.all_reduce(x, op=op)
        except RuntimeError:
            if be == "oxccl":
                raise
            x = ref  # gloo lacks it
            print(f"rank {R}: gloo lacks all_reduce {op} on {dt}: compared with torch", flush=True)
        if be == "oxccl":
            assert torch.equal(x, ref), (dt, op, x, ref)
        out[f"reduce_{dt}_{op}"] = x
    # PREMUL_SUM (NCCL's; gloo has none: a SUM of the inputs each rank scaled is the
    # reference): one factor for all, a factor per rank, an integer tensor, reduce_scatter
    for name, dt, factor in (("premul_sum", torch.float32, 2.5), ("premul_sum_per_rank", torch.float64, R + 0.5),
                             ("premul_sum_int", torch.int32, 3)):
        x = torch.arange(4 * N).to(dt) + R
        if be == "oxccl":
            dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor))
        else:
            x = x * factor
            dist.all_reduce(x)
        out[name] = x
    x = torch.arange(4.0 * N) * (R + 1)
    y = torch.empty(4)
    if be == "oxccl":
        dist.reduce_scatter_tensor(y, x, op=dist._make_nccl_premul_sum(0.25))
    else:
        dist.reduce_scatter_tensor(y, x * 0.25)
    out["premul_sum_reduce_scatter"] = y
    return out


def missing_rank(be):
    """Rank 1 stays away: rank 0's monitored_barrier names it once the timeout has passed
    (oxccl only: gloo's pairs are left unusable after such a timeout)."""
    raised = 0
    g = dist.new_group(backend=be)  # throwaway: gloo closes its pairs on the timeout
    if R == 0:
        try:
            dist.monitored_barrier(group=g, timeout=timedelta(seconds=1))
        except RuntimeError as e:
            raised = 1
            print(f"rank 0: {be}: {e}", flush=True)
    return {"monitored_barrier_raised": torch.tensor([raised])}


CHECKS_ON_REQUEST = {"missing_rank": missing_rank}


_pair_group = None


def run(be, store, tmp, names):
    global _pair_group
    dist.init_process_group(be, store=dist.PrefixStore(be, store), rank=R, world_size=N, timeout=timedelta(seconds=60))
    _pair_group = dist.new_group([0, 1], backend="gloo")
    w = dist.group.WORLD
    assert w.group_name and torch.device("cpu") in w._device_types, (w.group_name, w._device_types)
    if be == "oxccl":  # the C++ backend (oxccl/csrc) unless the Python one was asked for
        kind = type(w._get_backend(torch.device("cpu"))).__name__
        want = "BackendOxcclCpp"
        assert kind == want, f"the oxccl backend in use is {kind}, expected {want}"
    results, times = {}, {}
    for name in names:
        fn = CHECKS.get(name) or CHECKS_ON_REQUEST[name]
        t0 = time.monotonic()
        res = fn(be, tmp) if fn.__code__.co_argcount == 2 else fn(be)
        times[name] = time.monotonic() - t0
        for k, v in res.items():
            results[k] = v
        print(f"rank {R}: {be} {name} done in {times[name]:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return results


def main(tmp, *names):
    names = names or tuple(CHECKS)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), N, R == 0, timeout=timedelta(seconds=120))
    if set(names) <= set(CHECKS_ON_REQUEST):  # oxccl's own behaviour: no comparison
        run("oxccl", store, tmp, names)
        print(f"rank {R}: torch features ok", flush=True)
        return
    res = {be: run(be, store, tmp, names) for be in ("gloo", "oxccl")}
    bad = []
    for k, o in res["oxccl"].items():
        g = res["gloo"].get(k, "not run")
        if isinstance(o, str) or isinstance(g, str):
            print(f"rank {R}: {k}: oxccl {o!r} (gloo: {g!r})", flush=True)
            continue
        same = (
            torch.allclose(o.double(), g.double(), rtol=1e-5, atol=1e-6)
            if g.dtype.is_floating_point
            else torch.equal(o, g)
        )
        if not (same and o.shape == g.shape):
            bad.append(f"{k}: oxccl {o} vs gloo {g}")
    missing = sorted(set(res["gloo"]) - set(res["oxccl"]))
    assert not missing, f"not checked under oxccl: {missing}"
    assert not bad, "\n".join(bad)
    print(f"rank {R}: {len(res['gloo'])} results equal to gloo: {', '.join(sorted(res['gloo']))}", flush=True)
    print(f"rank {R}: torch features ok", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
