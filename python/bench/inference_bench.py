"""Per-call time of oxccl.torch.inference_all_reduce next to dist.all_reduce on the same oxccl
group and the operator through torch's dispatcher, in the same processes, alternating.

    torchrun --nproc-per-node N python/bench/inference_bench.py [calls per round]

Prints, per size and dtype, the median over 7 rounds of rank 0's mean time per call.
With one rank it shows the cost of the call path itself (the library's call on one rank
moves nothing)."""

import statistics
import sys
import time

import torch
import torch.distributed as dist

import oxccl.torch as oxt


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("oxccl")
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    handle = oxt._group(None)[1]
    for nbytes in (8, 1024, 32768):
        for dt in (torch.bfloat16, torch.float32):
            t = torch.ones(nbytes // dt.itemsize, dtype=dt)
            forms = {
                "dist.all_reduce": lambda: dist.all_reduce(t),
                "inference_all_reduce": lambda: oxt.inference_all_reduce(t),
                "torch.ops.oxccl": lambda: torch.ops.oxccl.inference_all_reduce_(t, handle, 0),
            }
            rounds: dict = {k: [] for k in forms}
            for _ in range(7):
                for name, f in forms.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        f()
                    rounds[name].append((time.perf_counter() - t0) / calls)
            med = {k: statistics.median(v) for k, v in rounds.items()}
            if dist.get_rank() == 0:
                cols = "  ".join(f"{k} {v * 1e6:8.2f} us" for k, v in med.items())
                ratio = med["inference_all_reduce"] / med["dist.all_reduce"]
                print(f"{nbytes:>6} B {str(dt)[6:]:>9}: {cols}  inference/dist {ratio:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
