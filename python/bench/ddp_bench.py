"""DDP step time of a ~100M-parameter model, oxccl against gloo, in one run.

    oxccl run -n 2 -- .venv/bin/python python/bench/ddp_bench.py [--steps 5] [--warmup 2]
    torchrun --nproc-per-node 2 python/bench/ddp_bench.py

Both backends train the same model on the same data in the same processes: the default
group is gloo, the oxccl group is made with new_group(backend="oxccl"). Each step is
forward + backward (DDP all-reduces the gradients, 25 MB buckets) + SGD; the time reported is
the slowest rank's mean over the measured steps. Also reports the time of one all_reduce of
all gradients (fp32) alone.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import oxccl.torch  # noqa: F401

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--width", type=int, default=4096)
p.add_argument("--layers", type=int, default=6)
p.add_argument("--batch", type=int, default=8)
a = p.parse_args()

dist.init_process_group("gloo")
groups = {"gloo": dist.group.WORLD, "oxccl": dist.new_group(backend="oxccl")}
rank, n = dist.get_rank(), dist.get_world_size()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width) for _ in range(a.layers)])


nparams = sum(p.numel() for p in model().parameters())
if rank == 0:
    print(f"model: {a.layers} x Linear({a.width}, {a.width}) = {nparams / 1e6:.1f} M parameters; "
          f"{n} ranks, batch {a.batch}, {a.warmup} warm-up + {a.steps} measured steps, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads per rank", flush=True)

x = torch.randn(a.batch, a.width)
results = {}
for name in ("gloo", "oxccl", "gloo", "oxccl"):  # twice each, interleaved; the second run counts
    g = groups[name]
    m = DDP(model(), process_group=g)
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    times = []
    for step in range(a.warmup + a.steps):
        dist.barrier(group=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        m(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    mean = torch.tensor([sum(times[a.warmup:]) / a.steps])
    dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=groups["gloo"])
    # The gradient all_reduce alone.
    flat = torch.ones(nparams)
    dist.all_reduce(flat, group=g)
    dist.barrier(group=g)
    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(flat, group=g)
    ar = torch.tensor([(time.perf_counter() - t0) / 3])
    dist.all_reduce(ar, op=dist.ReduceOp.MAX, group=groups["gloo"])
    results[name] = (mean.item(), ar.item())
    del m, opt, flat

if rank == 0:
    print(f"{'backend':8} {'DDP step (s)':>13} {'all_reduce ' + format(nparams * 4 / 1e6, '.0f') + ' MB (s)':>24}")
    for name, (step, ar) in results.items():
        print(f"{name:8} {step:13.3f} {ar:24.3f}")
    s = results["gloo"][0] / results["oxccl"][0]
    r = results["gloo"][1] / results["oxccl"][1]
    print(f"oxccl speed-up over gloo: DDP step {s:.2f}x, all_reduce {r:.2f}x", flush=True)
dist.destroy_process_group()
