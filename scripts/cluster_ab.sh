#!/usr/bin/env bash
# Before/after CPU cost of oxccl builds on the emulated cluster, in one run: each round runs
# `scripts/cluster.sh perf H L all_reduce -b SIZE -e SIZE -n ITERS -w 2 -c 0` once per binary,
# in turn, and prints per binary and placement the wall time and the CPU time (user + system
# of all ranks) per call, CPU-seconds per GB all-reduced, busbw, and the time the ranks waited
# for a CPU (runq_wait_us: a shared machine). A binary may be a wrapper script that sets
# environment variables and execs the real one (to compare settings).
#
# Usage (root): scripts/cluster_ab.sh ROUNDS HxL RATE BIN...
#   e.g. scripts/cluster_ab.sh 3 2x1 10gbit ../oxccl-before/oxccl target/release/oxccl
# Settings: SIZE (64M), ITERS (10), OXCCL_CLUSTER_MTU as cluster.sh.
set -euo pipefail
[ $# -ge 4 ] || {
  sed -n 2,11p "$0"
  exit 2
}
cd "$(dirname "$0")/.."
rounds=$1 shape=$2 rate=$3
shift 3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for ((i = 1; i <= rounds; i++)); do
  for b in "$@"; do
    j="$tmp/row.json"
    rm -f "$j"
    OXCCL_CLUSTER_RATE=$rate OXCCL_BIN=$b scripts/cluster.sh perf "${shape%x*}" "${shape#*x}" \
      all_reduce -b "${SIZE:-64M}" -e "${SIZE:-64M}" -n "${ITERS:-10}" -w 2 -c 0 --json "$j" \
      >"$tmp/out" 2>&1 || {
      echo "round $i $b: FAILED" >&2
      tail -5 "$tmp/out" >&2
      continue
    }
    python3 - "$j" "$rate" "$shape" "$b" <<'PY'
import json, sys
path, rate, shape, b = sys.argv[1:]
for line in open(path):
    r = json.loads(line)
    wait = r.get("runq_wait_us", -1) / 1e3
    print(f"{rate:>8} {shape:>4} {b[-24:]:>24} {'in ' if r['in_place'] else 'out'} {r['algo']:>5} "
          f"time_ms {r['time_us'] / 1e3:7.1f}  cpu_ms {r['cpu_us'] / 1e3:7.1f}  "
          f"cpu-s/GB {r['cpu_us'] * 1e-6 / (r['bytes'] / 1e9):6.3f}  busbw {r['busbw_gbps']:.3f}  "
          f"wait_ms {wait:7.1f}", flush=True)
PY
  done
done
