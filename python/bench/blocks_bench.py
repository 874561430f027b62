"""Time of the collectives whose blocks may differ in size, as torch code calls them on an
oxccl group: ``dist.gather``, ``dist.scatter`` and an uneven ``dist.all_to_all_single``
(``Communicator::group_p2p_as`` in the library: gather, scatter, all_to_allv). For each size
(bytes of one rank's block; the uneven all_to_all gives rank ``r``'s block for peer ``p``
``(1 + (r + p) % 3) / 2`` times that), each call runs ``--warmup`` times, then ``--iters``
times between barriers, ``--rounds`` rounds; rank 0 prints the best round's mean, in
microseconds per call.

    torchrun --nproc-per-node 3 python/bench/blocks_bench.py [--backend oxccl|gloo]
        [--sizes 8,4096,262144,4194304] [--iters 200] [--rounds 5]
"""

import argparse
import time

import torch
import torch.distributed as dist

import oxccl.torch  # noqa: F401  (registers the "oxccl" backend)


def timed(fn, warmup: int, iters: int, rounds: int) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        dist.barrier()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="oxccl")
    ap.add_argument("--sizes", default="8,4096,262144,4194304", help="bytes of one block, comma-separated")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", default="gather,scatter,all_to_allv")
    a = ap.parse_args()
    dist.init_process_group(a.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    ops = a.ops.split(",")
    if rank == 0:
        print(f"# backend {a.backend}, {n} ranks; microseconds per call, best of {a.rounds} rounds")
        print(f"{'op':>12} {'bytes':>10} {'us':>12}")
    for size in (int(s) for s in a.sizes.split(",")):
        numel = max(1, size // 4)
        x = torch.full((numel,), float(rank))
        for op in ops:
            if op == "gather":
                outs = [torch.empty(numel) for _ in range(n)] if rank == 0 else None
                us = timed(lambda: dist.gather(x, outs, dst=0), a.warmup, a.iters, a.rounds)
            elif op == "scatter":
                ins = [torch.full((numel,), float(p)) for p in range(n)] if rank == 0 else None
                out = torch.empty(numel)
                us = timed(lambda: dist.scatter(out, ins, src=0), a.warmup, a.iters, a.rounds)
            elif op == "all_to_allv":
                def split(r: int, p: int) -> int:
                    return max(1, numel * (1 + (r + p) % 3) // 2)

                ins = [split(rank, p) for p in range(n)]
                outs = [split(p, rank) for p in range(n)]
                send = torch.full((sum(ins),), float(rank))
                recv = torch.empty(sum(outs))
                us = timed(
                    lambda: dist.all_to_all_single(recv, send, outs, ins),
                    a.warmup,
                    a.iters,
                    a.rounds,
                )
            else:
                raise SystemExit(f"unknown op {op!r} (gather, scatter, all_to_allv)")
            if rank == 0:
                print(f"{op:>12} {numel * 4:>10} {us:>12.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
