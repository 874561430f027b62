"""What `fork` costs a rank whose tensors live in oxccl's shared pool (DataLoader workers with
the fork start method, multiprocessing, subprocess): the parent's fork time and each child's
Private_Dirty/RSS, for LIVE MiB of live tensors and FREED MiB of tensors made and freed
(cached pool blocks), in tensors of SIZE KiB (up to 512 KiB: slab blocks, larger: whole
blocks). With --sparse, only every 64th small tensor stays live (the rest freed): slabs with
few live blocks. A child checks that it sees the parent's values at fork time.

Run (one rank, real processes; OXCCL_TORCH_ALLOCATOR=0 for the allocator off):
  RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29631 \
    python python/bench/fork_copy_bench.py --live 256 --freed 256 --size 1024 --forks 2
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

import oxccl.torch  # noqa: F401  (registers the backend)


def mem():
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            k = line.split(":")[0]
            if k in ("Rss", "Private_Dirty"):
                out[k] = int(line.split()[1]) >> 10
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--live", type=int, default=256, help="MiB of live tensors")
    ap.add_argument("--freed", type=int, default=256, help="MiB of tensors made and freed")
    ap.add_argument("--size", type=int, default=1024, help="KiB per tensor")
    ap.add_argument("--sparse", action="store_true", help="keep 1 in 64 small tensors live")
    ap.add_argument("--forks", type=int, default=2)
    a = ap.parse_args()
    dist.init_process_group("oxccl")
    n = a.size * 256  # float32 elements
    per_mib = max(1, 1024 // a.size)
    live = []
    if a.sparse:
        made = [torch.full((n,), 1.0) for _ in range(a.live * per_mib * 64)]
        live = made[::64]
        del made
    else:
        live = [torch.full((n,), float(i % 7)) for i in range(a.live * per_mib)]
    freed = [torch.full((n,), 3.0) for _ in range(a.freed * per_mib)]
    del freed
    expect = [float(t[0]) for t in live]
    before = mem()
    for w in range(a.forks):
        r, wr = os.pipe()
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.close(wr)
            m = mem()
            ok = all(float(t[0]) == e and float(t[-1]) == e for t, e in zip(live, expect))
            os.read(r, 1)  # the parent has overwritten its tensors
            ok = ok and all(float(t[-1]) == e for t, e in zip(live, expect))
            print(f"  child {w}: Private_Dirty {m['Private_Dirty']} MiB, Rss {m['Rss']} MiB, "
                  f"values {'ok' if ok else 'WRONG'}", flush=True)
            os._exit(0 if ok else 1)
        ms = 1e3 * (time.perf_counter() - t0)
        os.close(r)
        for t in live:
            t[-1] = -1.0
        os.write(wr, b"x")
        os.close(wr)
        _, st = os.waitpid(pid, 0)
        for t, e in zip(live, expect):
            t[-1] = e
        print(f"fork {w}: {ms:.0f} ms, child exit {os.waitstatus_to_exitcode(st)}", flush=True)
    print(f"parent before forks: Private_Dirty {before['Private_Dirty']} MiB, Rss {before['Rss']} MiB; "
          f"live {a.live} MiB{' (sparse)' if a.sparse else ''}, freed {a.freed} MiB, "
          f"{a.size} KiB tensors, allocator {os.environ.get('OXCCL_TORCH_ALLOCATOR', '1')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
