"""Time of a blocking all_reduce (2 ranks, float32 sum, in place) by where the buffer starts in
its page: the kernel's cross-memory copies of the single-copy path are several times slower at
some relative placements of source and destination (see crates/oxccl/src/direct/cma/
placement.rs), so a size can be fast for one buffer and slow for the next.

    python python/bench/offset_bench.py [--bytes 4M] [--step 16] [--iters 5] [--passes 2]

Starts 2 ranks on this host (subprocesses) with oxccl.init. Each rank allocates one buffer
and, for every start offset 0, step, 2*step, ... below 4096 bytes into a page (the same on both
ranks), times `iters` calls on the view that starts there; the offsets are visited in `passes`
passes, forward then backward. Rank 0 prints, by each offset's fastest call and by its median
call and by its call of least CPU time on the calling thread (which runs the copies), the
median over all offsets, the slowest offsets, and the ratio of the slowest to the median.
"""

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time

PAGE = 4096


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def rank_main(a):
    import numpy as np

    import oxccl

    r = int(os.environ["RANK"])
    comm = oxccl.init(r, 2, addr=os.environ["OFFSET_BENCH_ADDR"], secret=os.environ["OXCCL_SECRET"])
    raw = np.zeros(a.bytes + 2 * PAGE, dtype=np.uint8)
    base = (-raw.ctypes.data) % PAGE  # raw[base] starts a page
    offsets = list(range(0, PAGE, a.step))
    times = {o: [] for o in offsets}
    cpu = {o: [] for o in offsets}
    views = {o: raw[base + o : base + o + a.bytes].view(np.float32) for o in offsets}
    for o in offsets[:4]:  # warm up
        comm.all_reduce(views[o])
    for p in range(a.passes):
        for o in offsets if p % 2 == 0 else offsets[::-1]:
            x = views[o]
            for _ in range(a.iters):
                x.fill(1.0)
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                comm.all_reduce(x)
                times[o].append((time.perf_counter_ns() - t0) / 1000)
                cpu[o].append((time.thread_time_ns() - c0) / 1000)
            if x[0] != 2.0 or x[-1] != 2.0:
                raise SystemExit(f"rank {r}: wrong result at offset {o}: {x[0]}, {x[-1]}")
    if r == 0:
        print(
            f"all_reduce {a.bytes} B float32 sum in place, 2 ranks, {len(offsets)} page offsets "
            f"(step {a.step}) x {a.passes} passes x {a.iters} calls"
        )
        # The fastest call of each offset shows what its copies cost when both ranks ran at
        # once (robust on a loaded machine); the median adds the scheduling noise.
        # The calling thread's CPU time: the copies and reductions themselves (and its spinning).
        for label, pick, what in (
            ("fastest call", min, times),
            ("median call", statistics.median, times),
            ("least CPU time of a call", min, cpu),
        ):
            per = {o: pick(v) for o, v in what.items()}
            mid = statistics.median(per.values())
            worst = sorted(offsets, key=lambda o: -per[o])[:5]
            print(
                f"{label} per offset: median over offsets {mid:.1f} µs, slowest offsets "
                + ", ".join(f"{o}: {per[o]:.1f}" for o in worst)
                + f" µs; slowest / median {per[worst[0]] / mid:.2f}x"
            )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=parse_bytes, default=4 << 20)
    ap.add_argument("--step", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        rank_main(a)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OFFSET_BENCH_ADDR=f"127.0.0.1:{port}", OXCCL_SECRET=secrets.token_hex(16))
    args = [sys.executable, __file__, "--rank", "--bytes", str(a.bytes), "--step", str(a.step),
            "--iters", str(a.iters), "--passes", str(a.passes)]
    procs = [subprocess.Popen(args, env=dict(env, RANK=str(r))) for r in range(2)]
    sys.exit(max(p.wait(timeout=1800) for p in procs))


if __name__ == "__main__":
    main()
