#!/usr/bin/env bash
# reduce beside Open MPI in one run (the anchors' compare.sh has no reduce): oxccl perf reduce
# and mpi_reduce_bench.c on the same sizes, then MPI time / oxccl time per size (out of place).
# Usage: scripts/anchors/compare_reduce.sh OXCCL_BIN RANKS MIN_BYTES MAX_BYTES
set -euo pipefail
ox=$1 n=$2 lo=$3 hi=$4
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mpicc -O3 -o "$tmp/mpi_reduce_bench" "$here/mpi_reduce_bench.c"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$ox" perf reduce --ranks "$n" -b "$lo" -e "$hi" -f 4 -d float -o sum --json "$tmp/ox.jsonl" | tee "$tmp/ox.txt"
mpirun --oversubscribe -n "$n" "$tmp/mpi_reduce_bench" "$lo" "$hi" | tee "$tmp/mpi.txt"
python3 - "$tmp" <<'PY'
import json, os, sys
tmp = sys.argv[1]
ox = {}
for line in open(os.path.join(tmp, "ox.jsonl")):
    r = json.loads(line)
    if not r.get("in_place"):
        ox[r["bytes"]] = r["time_us"]
mpi = {}
for line in open(os.path.join(tmp, "mpi.txt")):
    f = line.split()
    if len(f) >= 4 and f[0].isdigit():
        mpi[int(f[0])] = float(f[1])
print(f"#{'bytes':>12} {'oxccl us':>10} {'mpi us':>10} {'mpi/ox time':>12}")
for b in sorted(ox):
    m = mpi.get(b, float("nan"))
    print(f" {b:>12} {ox[b]:>10.2f} {m:>10.2f} {m / ox[b]:>12.2f}")
PY
