"""One rank of shm_alloc_bench.sh: blocking dist.all_reduce (sum, fp32, in place) on
torch.empty tensors, the buffers a DDP job uses, through the "oxccl" group and the gloo
group of the same processes. With the shared-memory allocator on (the default), the tensors
come from oxccl's pool of shared buffers; OXCCL_TORCH_ALLOCATOR=0 leaves them private.
Prints one JSON line per (backend, size) from rank 0: time per call and busbw
(2(n-1)/n * bytes / time, nccl-tests' definition).

    python -m torch.distributed.run --nproc-per-node 2 python/bench/shm_alloc_worker.py 32M 128M
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import oxccl.torch as ot


def parse(s):
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if scale > 1 else s) * scale


def in_shm(t):
    p = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:oxccl-buffer" in line:
                a, b = (int(x, 16) for x in line.split()[0].split("-"))
                if a <= p < b:
                    return True
    return False


def main(sizes):
    dist.init_process_group("gloo")
    groups = {"gloo": dist.group.WORLD, "oxccl": dist.new_group(backend="oxccl")}
    r, n = dist.get_rank(), dist.get_world_size()
    alloc = "on" if ot._shm_allocator_min_bytes() is not None else "off"
    for size in sizes:
        for name in ("oxccl", "gloo"):
            g = groups[name]
            t = torch.empty(size // 4)  # made after init_process_group, as DDP's buckets
            t.fill_(1.0)
            iters = 10 if size <= (32 << 20) else 5
            for _ in range(2):
                dist.all_reduce(t, group=g)
            dist.barrier(group=groups["gloo"])
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t, group=g)
            dt = torch.tensor([(time.perf_counter() - t0) / iters])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=groups["gloo"])
            sec = dt.item()
            if r == 0:
                print(json.dumps({"backend": name, "alloc": alloc, "bytes": size, "shm": in_shm(t),
                                  "time_us": sec * 1e6, "busbw_gbps": 2 * (n - 1) / n * size / sec / 1e9}), flush=True)
            del t
    dist.destroy_process_group()


if __name__ == "__main__":
    main([parse(s) for s in sys.argv[1:]] or [32 << 20, 128 << 20])
