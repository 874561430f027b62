#!/usr/bin/env bash
# Predicted (`oxccl sim`) against measured all_reduce on the emulated cluster
# (scripts/cluster.sh, as root): for each shape HxL, one checked `oxccl perf` with the
# library's own choice and one per forced algorithm (ring, tree, hd; hier where hosts hold
# several ranks), then scripts/sim_compare.py prints each row's measured and predicted time.
#
# Usage: sudo scripts/sim_check.sh [RATE [SHAPES [PERF_ARGS...]]]
#   RATE    tbf rate of every link (default 1gbit; kbit, mbit, gbit), also the model's
#           --net-gbps for the comparison and OXCCL_NET_GBPS for the ranks
#   SHAPES  e.g. "2x1 4x1 8x1 2x2 4x2" (the default)
#   PERF_ARGS default: -b 8 -e 16M -f 8 -n 10 -w 2
# Settings: ALGOS (default "auto ring tree hd", plus hier where hosts hold several ranks),
#   TUNE a tune file with the model's rates (default: `oxccl tune` is run first and writes
#   $OUT/tune.conf), CPUS the cores all emulated hosts share (default: nproc).
# The ranks read TUNE (OXCCL_TUNE_FILE), so their choice is the one predicted with it; the
# prediction is `oxccl sim --tune-file TUNE --cpus CPUS --net-gbps RATE`.
# Output: the raw perf tables in $OUT (default /tmp/oxccl-sim-check-RATE), then the table.
# Results depend on the CPU: every emulated host runs on this machine's cores (docs/scale.md,
# "Predicting larger clusters").
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
SHAPES=${2:-"2x1 4x1 8x1 2x2 4x2"}
shift $(($# > 2 ? 2 : $#))
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(-b 8 -e 16M -f 8 -n 10 -w 2)
GBPS=$(python3 -c "
import re,sys
m=re.fullmatch(r'([0-9.]+)(k|m|g)bit','$RATE') or sys.exit('rate must look like 1gbit, 250mbit')
print(float(m[1])*{'k':1e3,'m':1e6,'g':1e9}[m[2]]/8e9)")
OUT=${OUT:-/tmp/oxccl-sim-check-$RATE}
mkdir -p "$OUT"
CPUS=${CPUS:-$(nproc)}
if [ -z "${TUNE:-}" ]; then
  TUNE=$OUT/tune.conf
  echo "== $(date +%T) oxccl tune, load $(cut -d' ' -f1-3 /proc/loadavg)"
  "${OXCCL_BIN:-target/release/oxccl}" tune --ranks 2 --out "$TUNE" | tail -3
fi
for shape in $SHAPES; do
  h=${shape%x*} l=${shape#*x}
  algos=${ALGOS:-auto ring tree hd}
  [ "$l" = 1 ] || [ -n "${ALGOS:-}" ] || algos="$algos hier"
  for a in $algos; do
    extra=()
    [ "$a" = auto ] || extra=(--algo "$a")
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    echo "== $(date +%T) ${h}x$l $a, load $load"
    echo "# load average before the run: $load" >"$OUT/${h}x$l-$a.txt"
    OXCCL_TUNE_FILE=$TUNE OXCCL_NET_GBPS=$GBPS OXCCL_CLUSTER_RATE=$RATE LIMIT=600 \
      scripts/cluster.sh perf "$h" "$l" all_reduce "${ARGS[@]}" ${extra[@]+"${extra[@]}"} >>"$OUT/${h}x$l-$a.txt"
    tail -1 "$OUT/${h}x$l-$a.txt"
  done
done
python3 scripts/sim_compare.py "$OUT" --net-gbps "$GBPS" --tune-file "$TUNE" --cpus "$CPUS"
