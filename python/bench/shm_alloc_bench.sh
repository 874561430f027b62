#!/bin/bash
# The torch shared-memory allocator, side by side in one run: blocking all_reduce (fp32 sum,
# in place) at 32 and 128 MB on torch.empty tensors through the "oxccl" backend with the
# allocator on and off (OXCCL_TORCH_ALLOCATOR), gloo, and Open MPI (mpi_coll_bench, as
# ../shared/anchors/compare.sh runs it), then python/bench/ddp_bench.py's DDP step with the
# allocator on and off. ROUNDS rounds, alternating; medians, and ratios to Open MPI's busbw.
#
#   python/bench/shm_alloc_bench.sh [ROUNDS] [RANKS]
#
# Needs the Python package and its C++ torch backend built (.venv, see python/README.md) and
# the anchors (OXCCL_ANCHORS, default ~/.cache/oxccl-anchors/mpi_coll_bench; Open MPI's row is
# left out without it).
set -eu
rounds=${1:-3} n=${2:-2}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
mpi=${OXCCL_ANCHORS:-$HOME/.cache/oxccl-anchors}/mpi_coll_bench
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
run() { # ALLOC(0|1) SCRIPT ARGS...: n ranks of a torch script
  local a=$1; shift
  OXCCL_TORCH_ALLOCATOR=$a "$py" -m torch.distributed.run --nproc-per-node "$n" \
    --master-port $((29500 + RANDOM % 2000)) "$@" 2>/dev/null
}
for i in $(seq "$rounds"); do
  echo "# round $i/$rounds" >&2
  if [ -x "$mpi" ]; then
    mpirun --oversubscribe -n "$n" "$mpi" all_reduce 33554432 134217728 | awk '$1 ~ /^[0-9]+$/ {
      printf "{\"backend\": \"mpi\", \"alloc\": \"-\", \"bytes\": %d, \"time_us\": %s, \"busbw_gbps\": %s}\n", $1, $2, $4}' >> "$tmp/ar.jsonl"
  fi
  for a in 1 0; do run $a "$here/shm_alloc_worker.py" 32M 128M >> "$tmp/ar.jsonl"; done
  for a in 1 0; do
    run $a "$here/ddp_bench.py" --steps 3 --warmup 1 | awk -v a=$a '($1 == "oxccl" || $1 == "gloo") && $2 ~ /^[0-9.]+$/ {
      printf "{\"backend\": \"%s\", \"alloc\": \"%s\", \"step_s\": %s, \"ar_s\": %s}\n", $1, (a ? "on" : "off"), $2, $3}' >> "$tmp/ddp.jsonl"
  done
done
python3 - "$tmp" "$rounds" "$n" <<'PY'
import json, os, statistics, sys
tmp, rounds, n = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [json.loads(l) for l in open(os.path.join(tmp, "ar.jsonl"))]
def med(key, f):
    v = [r[key] for r in rows if f(r)]
    return (statistics.median(v), min(v), max(v)) if v else (float("nan"),) * 3
print(f"## all_reduce, {n} ranks, fp32 sum in place, {rounds} rounds: median busbw GB/s (min-max), ratio to Open MPI's median")
print(f"| {'bytes':>10} | {'what':<38} | {'busbw GB/s':>20} | {'x Open MPI':>10} |")
print(f"|{'-'*12}|{'-'*40}|{'-'*22}|{'-'*12}|")
for b in sorted({r["bytes"] for r in rows}):
    m = med("busbw_gbps", lambda r: r["bytes"] == b and r["backend"] == "mpi")[0]
    for label, f in (("torch oxccl, allocator on", lambda r: r["backend"] == "oxccl" and r["alloc"] == "on"),
                     ("torch oxccl, allocator off", lambda r: r["backend"] == "oxccl" and r["alloc"] == "off"),
                     ("torch gloo, allocator on", lambda r: r["backend"] == "gloo" and r["alloc"] == "on"),
                     ("torch gloo, allocator off", lambda r: r["backend"] == "gloo" and r["alloc"] == "off"),
                     ("Open MPI (mpi_coll_bench)", lambda r: r["backend"] == "mpi")):
        v, lo, hi = med("busbw_gbps", lambda r: r["bytes"] == b and f(r))
        shm = {r.get("shm") for r in rows if r["bytes"] == b and f(r)} - {None}
        tag = f" (shm={'/'.join(map(str, sorted(shm)))})" if shm else ""
        print(f"| {b:>10} | {label + tag:<38} | {v:7.2f} ({lo:.2f}-{hi:.2f}) | {v / m:10.2f} |")
ddp = [json.loads(l) for l in open(os.path.join(tmp, "ddp.jsonl"))] if os.path.exists(os.path.join(tmp, "ddp.jsonl")) else []
if ddp:
    print(f"\n## python/bench/ddp_bench.py (100M parameters, 25 MB buckets), {rounds} rounds: median (min-max) seconds")
    print("| backend | allocator | DDP step (s) | all_reduce of all gradients (s) |")
    print("|---|---|---|---|")
    for be in ("oxccl", "gloo"):
        for a in ("on", "off"):
            s = [r["step_s"] for r in ddp if r["backend"] == be and r["alloc"] == a]
            t = [r["ar_s"] for r in ddp if r["backend"] == be and r["alloc"] == a]
            if s:
                print(f"| {be} | {a} | {statistics.median(s):.3f} ({min(s):.3f}-{max(s):.3f}) | "
                      f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f}) |")
PY
