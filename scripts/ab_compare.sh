#!/usr/bin/env bash
# Before/after benchmark of two oxccl builds in one run: `oxccl perf` of each binary, alternated
# round by round (A B, B A, A B, ...) so that a shared machine's drift hits both alike, then one
# table per placement: each size's median time for A and B over the rounds, the run-to-run
# spread of each (max/min of its rounds) and the ratio B/A.
#
# Usage: scripts/ab_compare.sh A_BIN B_BIN ROUNDS PERF_ARGS...
#   e.g. scripts/ab_compare.sh ../oxccl-before/oxccl target/release/oxccl 3 \
#          all_reduce --ranks 2 -b 8 -e 128M -f 4 -R 1
# A row where B/A exceeds both binaries' spread is slower (or faster) beyond the noise.
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,11p "$0"; exit 2; }
a=$1 b=$2 rounds=$3
shift 3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then order="a b"; else order="b a"; fi
  for w in $order; do
    bin=$a
    [ "$w" = b ] && bin=$b
    echo "== round $r: $w ($bin)" >&2
    "$bin" perf "$@" --json "$tmp/$w.$r.jsonl" >/dev/null
  done
done
python3 - "$tmp" "$rounds" <<'PY'
import json, os, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
runs = {"a": {}, "b": {}}
for w in runs:
    for r in range(1, rounds + 1):
        for line in open(os.path.join(tmp, f"{w}.{r}.jsonl")):
            row = json.loads(line)
            key = ("in place" if row.get("in_place") else "out of place", row["bytes"])
            runs[w].setdefault(key, []).append(row["time_us"])
print(f"# {'placement':<12} {'bytes':>11} {'A us':>10} {'A spread':>9} {'B us':>10} {'B spread':>9} {'B/A':>6}")
for key in sorted(runs["a"]):
    if key not in runs["b"]:
        continue
    ta, tb = runs["a"][key], runs["b"][key]
    ma, mb = statistics.median(ta), statistics.median(tb)
    sa = max(ta) / min(ta) if min(ta) > 0 else float("nan")
    sb = max(tb) / min(tb) if min(tb) > 0 else float("nan")
    print(f"  {key[0]:<12} {key[1]:>11} {ma:>10.2f} {sa:>9.2f} {mb:>10.2f} {sb:>9.2f} {mb / ma:>6.2f}")
PY
