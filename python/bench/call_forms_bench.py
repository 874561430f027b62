"""Per-call cost of the forms in which torch code reaches a small all_reduce (or all_gather) on
an oxccl group: oxccl's op, ``dist.all_reduce`` blocking and ``async_op=True`` then
``wait()``, torch's functional collectives (``torch.ops._c10d_functional``, what DTensor's
tensor parallelism and ``torch.compile``d collectives call) and their Python wrapper
(``torch.distributed._functional_collectives``). Each form runs 2000 times to warm up, then
5 times 20000 calls; rank 0 prints the best of the 5 means, in microseconds per call.
``--backend fake`` runs the forms on torch's fake process group, which moves nothing: torch's
own share of each form's cost.

    torchrun --nproc-per-node 2 python/bench/call_forms_bench.py [--backend oxccl|gloo|fake] [--numel 2]
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

import oxccl
import oxccl.torch as oxt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="oxccl")
    ap.add_argument("--numel", type=int, default=2, help="float32 elements per call")
    ap.add_argument("--iters", type=int, default=20000)
    a = ap.parse_args()
    if a.backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    else:
        dist.init_process_group(a.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"# {a.backend}, {n} ranks, {a.numel} float32; oxccl from {oxccl.__file__}", flush=True)
    t = torch.ones(a.numel)
    g = dist.group.WORLD
    name = g.group_name
    f = torch.ops._c10d_functional

    def bench(label, call):
        for _ in range(2000):
            call()
        dist.barrier()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(a.iters):
                call()
            best = min(best, (time.perf_counter_ns() - t0) / a.iters / 1e3)
        if rank == 0:
            print(f"{label:55s} {best:8.2f} us", flush=True)

    if a.backend == "oxccl":
        bench("oxccl.torch.inference_all_reduce(x)", lambda: oxt.inference_all_reduce(t))
    bench("dist.all_reduce(x)", lambda: dist.all_reduce(t))
    bench("dist.all_reduce(x, async_op=True).wait()", lambda: dist.all_reduce(t, async_op=True).wait())
    bench("_c10d_functional: wait_tensor(all_reduce_(x))", lambda: f.wait_tensor(f.all_reduce_(t, "sum", name)))
    bench("funcol.all_reduce(x, 'sum', group).wait()", lambda: fc.all_reduce(t, "sum", g).wait())
    out = torch.empty(n * a.numel)
    bench("dist.all_gather_into_tensor(out, x)", lambda: dist.all_gather_into_tensor(out, t))
    bench(
        "_c10d_functional: wait_tensor(all_gather_into_tensor(x))",
        lambda: f.wait_tensor(f.all_gather_into_tensor(t, n, name)),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
