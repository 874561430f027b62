#!/usr/bin/env bash
# What OXCCL_DETERMINISTIC=1 costs: all_reduce (float32 sum) with and without it, same sizes,
# one after the other in one run, per rank count; prints a Markdown table of times, the
# algorithm each picked and the ratio (deterministic / default; 1.00 = free). Also with
# OXCCL_CMA=0 (where reading peers' memory is not allowed, e.g. Yama ptrace_scope=1): there
# the middle and large sizes run the ring by default and the rank-ordered schedule when
# deterministic, which is what the mode costs where it costs something.
# Usage: scripts/bench_deterministic.sh [OUT.md]   (default docs/perf/deterministic.md)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/perf/deterministic.md}
cargo build --release -q -p oxccl-cli
ox=target/release/oxccl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for cma in 1 0; do
  for n in 2 4; do
    for det in 0 1; do
      OXCCL_CMA=$cma OXCCL_DETERMINISTIC=$det "$ox" perf all_reduce --ranks "$n" -b 8 -e 33554432 \
        -f 4 -d float --json "$tmp/$cma-$n-$det.jsonl" >/dev/null
    done
  done
done
python3 - "$tmp" <<'PY' | tee "$out"
import json, os, sys
tmp = sys.argv[1]
def rows(path):
    r = {}
    for line in open(path):
        j = json.loads(line)
        if not j["in_place"]:
            r[j["bytes"]] = (j["time_us"], j["algo"])
    return r
print("| OXCCL_CMA | ranks | bytes | default µs (algo) | deterministic µs (algo) | deterministic / default |")
print("|---|---|---|---|---|---|")
for cma in (1, 0):
    for n in (2, 4):
        a, b = rows(f"{tmp}/{cma}-{n}-0.jsonl"), rows(f"{tmp}/{cma}-{n}-1.jsonl")
        for size in sorted(a):
            (ta, aa), (tb, ab) = a[size], b[size]
            print(f"| {cma} | {n} | {size} | {ta:.2f} ({aa}) | {tb:.2f} ({ab}) | {tb / ta:.2f} |")
PY
