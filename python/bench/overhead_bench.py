"""Per-call cost of a blocking all_reduce through torch.distributed: the "oxccl" backend vs
gloo vs oxccl's own Python API (``oxccl.Comm``) vs the bare binding, in one run.

    python python/bench/overhead_bench.py [--iters 2000] [--rounds 5]
    python python/bench/overhead_bench.py --layers     # one rank: the cost of each layer
    python python/bench/overhead_bench.py --async-op   # dist.all_reduce(x, async_op=True).wait()
    python python/bench/overhead_bench.py --both --paths "oxccl,gloo"   # sync and async side by side

Starts 2 ranks on this host (subprocesses), one TCPStore, a gloo default group, an "oxccl"
group, and, on its communicator, the plain API. For each size (4 B, 16 KB, 4 MB of float32)
the paths take turns in rounds; every call is timed on its own and rank 0 prints the median
(and 10th/90th percentiles) in microseconds per call.

Paths:
  gloo            dist.all_reduce(x, group=gloo)
  oxccl           dist.all_reduce(x, group=oxccl)   (calls up to 1 MiB inline)
  oxccl.Comm      comm.all_reduce(x)                (the library's Python API)
  binding         comm._raw.call(...)               (the PyO3 call alone)
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

SIZES = [("4 B", 1), ("16 KB", 4096), ("4 MB", 1 << 20)]


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def rank_main(iters, rounds, async_op=False, both=False, only=None):
    import torch
    import torch.distributed as dist

    import oxccl.torch  # noqa: F401 - registers "oxccl"

    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n, r == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=r, world_size=n)
    gloo = dist.group.WORLD
    ox = dist.new_group(backend="oxccl")
    backend = ox._get_backend(torch.device("cpu"))
    comm = backend._state.comm

    def torch_path(group, async_=async_op):
        if async_:  # queued at every size (torch's opts.asyncOp), then waited for

            def f(x):
                dist.all_reduce(x, group=group, async_op=True).wait()

        else:

            def f(x):
                dist.all_reduce(x, group=group)

        return f

    def comm_path(x):
        comm.all_reduce(x)

    views = {}

    def binding_path(x):
        # the binding takes an object with a buffer: the tensor's numpy view, made once
        v = views.get(id(x))
        if v is None:
            v = views[id(x)] = x.numpy()
        comm._raw.call("all_reduce", "sum", 0, 0, None, v)

    torch_paths = [("gloo", gloo), ("oxccl", ox)]
    if both:  # each torch path blocking, then with async_op=True and wait()
        paths = []
        for name, group in torch_paths:
            paths.append((name, torch_path(group, False)))
            paths.append((name + " async", torch_path(group, True)))
    else:
        paths = [(name, torch_path(group)) for name, group in torch_paths]
    paths += [("oxccl.Comm", comm_path), ("binding", binding_path)]
    if only:  # --paths: the named ones (by prefix), in this order
        paths = [p for p in paths if any(p[0].startswith(o) for o in only)]
    rows = []
    for label, numel in SIZES:
        x = torch.ones(numel, dtype=torch.float32)
        k = iters if numel < (1 << 18) else max(20, iters // 20)
        samples = {name: [] for name, _ in paths}
        for name, f in paths:  # warm up
            for _ in range(20):
                f(x)
        for _ in range(rounds):
            for name, f in paths:
                dist.barrier(group=gloo)
                s = samples[name]
                for _ in range(k):
                    t0 = time.perf_counter_ns()
                    f(x)
                    s.append(time.perf_counter_ns() - t0)
        rows.append((label, {name: [v / 1000 for v in s] for name, s in samples.items()}))
    if r == 0:
        names = [p[0] for p in paths]
        kind = "all_reduce(async_op=True).wait() (torch paths)" if async_op else "blocking all_reduce"
        if both:
            kind = "all_reduce, blocking and (async) with async_op=True then wait()"
        print(f"median µs per {kind} (p10-p90), 2 ranks, {rounds} rounds x {iters} calls (4 MB: fewer)")
        print("| size | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for label, d in rows:
            cells = [f"{statistics.median(d[nm]):.1f} ({_pct(d[nm], 0.1):.1f}-{_pct(d[nm], 0.9):.1f})" for nm in names]
            print(f"| {label} | " + " | ".join(cells) + " |")
        med = statistics.median
        if both or only:
            pairs = [(nm, nm + " async") for nm in names if nm + " async" in names]
            if pairs:
                print("async/blocking (median): " + "; ".join(
                    f"{label}: " + ", ".join(f"{a} {med(d[b]) / med(d[a]):.2f}x" for a, b in pairs) for label, d in rows
                ))
            dist.destroy_process_group()
            return
        c = names[1]
        print("ratios (median): " + "; ".join(
            f"{label}: gloo/oxccl {med(d['gloo']) / med(d[c]):.1f}x, "
            f"oxccl minus oxccl.Comm {med(d[c]) - med(d['oxccl.Comm']):.1f} µs"
            for label, d in rows
        ))
    dist.destroy_process_group()


def layers(iters):
    """One rank (no peer to wait for): where the time of a 4-byte all_reduce through torch
    goes, layer by layer."""
    import torch
    import torch.distributed as dist

    import oxccl.torch  # noqa: F401 - registers "oxccl"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("oxccl", store=store, rank=0, world_size=1)
    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    comm = backend._state.comm
    x = torch.ones(1)
    xv = x.numpy()  # the binding takes an object with a buffer
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # as dist.all_reduce(x) sets it (the default, True, queues the call)
    kind = type(backend).__name__
    steps = [
        (f"dist.all_reduce(x, group=pg)  (torch's Python API, {kind})", lambda: dist.all_reduce(x, group=pg)),
        (f"pg.allreduce([x], opts).wait()  (torch's C++ ProcessGroup, {kind})", lambda: pg.allreduce([x], opts).wait()),
        (f"backend.allreduce([x], opts).wait()  ({kind})", lambda: backend.allreduce([x], opts).wait()),
        ("comm.all_reduce(x)  (oxccl.Comm)", lambda: comm.all_reduce(x)),
        ("comm._raw.call(...)  (the binding)", lambda: comm._raw.call("all_reduce", "sum", 0, 0, None, xv)),
    ]
    res = {name: [] for name, _ in steps}
    for _ in range(5):
        for name, f in steps:
            for _ in range(100):
                f()
            t0 = time.perf_counter_ns()
            for _ in range(iters):
                f()
            res[name].append((time.perf_counter_ns() - t0) / iters / 1000)
    print("one rank, 4-byte all_reduce, µs per call (median of 5 rounds)")
    print("| layer | µs |\n|---|---|")
    for name, _ in steps:
        print(f"| {name} | {statistics.median(res[name]):.1f} |")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", action="store_true", help="one rank: the cost of each layer")
    ap.add_argument("--async-op", action="store_true", help="the torch paths with async_op=True, then wait()")
    ap.add_argument("--both", action="store_true", help="every torch path blocking and with async_op=True")
    ap.add_argument("--paths", default="", help="comma-separated path names (prefixes) to run, e.g. 'oxccl C++,oxccl Python'")
    ap.add_argument("--sizes", default="", help="comma-separated size labels to run, e.g. '4 B,16 KB'")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.layers:
        layers(a.iters)
        return
    if a.rank:
        only = [p.strip() for p in a.paths.split(",") if p.strip()]
        if a.sizes:
            keep = [z.strip() for z in a.sizes.split(",")]
            SIZES[:] = [z for z in SIZES if z[0] in keep]
        rank_main(a.iters, a.rounds, a.async_op, a.both, only)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        extra = ["--async-op"] if a.async_op else []
        extra += ["--both"] if a.both else []
        extra += ["--paths", a.paths, "--sizes", a.sizes]
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank", "--iters", str(a.iters), "--rounds", str(a.rounds), *extra], env=env))
    rc = [p.wait(timeout=1800) for p in procs]
    sys.exit(max(rc))


if __name__ == "__main__":
    main()
