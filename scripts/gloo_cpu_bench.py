"""CPU cost of torch.distributed's gloo all_reduce: one rank per process, started by a
launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (scripts/cluster.sh cpu).

Run:  python3 gloo_cpu_bench.py SIZE_BYTES [ITERS] [WARMUP]

All-reduces a float32 tensor of SIZE_BYTES in place ITERS times after WARMUP calls and
prints, on rank 0, one line: `gloo SIZE time_us cpu_us sys_us`, the slowest rank's wall time
per call, the CPU time (user + system, all threads: time.process_time) of all ranks together
per call, and the system (kernel) part of it (getrusage's ru_stime).
"""
import os
import resource
import sys
import time

import torch
import torch.distributed as dist


def main():
    size = int(sys.argv[1])
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    warmup = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(1)
    # Zeros: the sum stays finite however many calls run, and costs what any values cost.
    buf = torch.zeros(size // 4)
    for _ in range(warmup):
        dist.all_reduce(buf)
    dist.barrier()
    sys0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    t, c = time.perf_counter(), time.process_time()
    for _ in range(iters):
        dist.all_reduce(buf)
    t, c = (time.perf_counter() - t) / iters, (time.process_time() - c) / iters
    s = (resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0) / iters
    wall = torch.tensor([t], dtype=torch.float64)
    cpu = torch.tensor([c, s], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    if dist.get_rank() == 0:
        print(f"gloo {size} {wall.item() * 1e6:.2f} {cpu[0].item() * 1e6:.2f} "
              f"{cpu[1].item() * 1e6:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
