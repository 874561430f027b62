#!/usr/bin/env bash
# What bounds one all_reduce on the emulated cluster (scripts/cluster.sh) under several link
# settings, alternated in one run: each round runs one `cluster.sh perf` per setting, in turn,
# with OXCCL_CLUSTER_STATS, and prints per run the call's time, the ranks' CPU, the machine's
# busy cores and softirq share while data flowed, the tbf queues' drops and overlimits, the
# hosts' TCP retransmits and loss probes, and host 0's data socket as `ss -ti` saw it last
# (congestion window, RTT, the congestion control's bandwidth estimate, the time the sender
# was limited by the receive window or its send buffer). scripts/cluster_probe.py reads one
# run's files.
#
# Usage (root): scripts/cluster_probe.sh ROUNDS "NAME;VAR=VALUE;..." ...
#   e.g. scripts/cluster_probe.sh 3 "10g;OXCCL_CLUSTER_RATE=10gbit" "100g;OXCCL_CLUSTER_RATE=100gbit" \
#        "10g-deep;OXCCL_CLUSTER_RATE=10gbit;OXCCL_CLUSTER_TBF=burst 512k latency 20ms"
# Settings: SHAPE (2x1), SIZE (16M), ALGO (ring), ITERS (40), OUT (a new /tmp/oxccl-probe.*;
# kept: one folder per run, NAME-ROUND).
set -euo pipefail
[ $# -ge 2 ] || {
  sed -n 2,16p "$0"
  exit 2
}
cd "$(dirname "$0")/.."
rounds=$1
shift
OUT=${OUT:-$(mktemp -d /tmp/oxccl-probe.XXXXXX)}
shape=${SHAPE:-2x1}
echo "# $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg), files in $OUT"
python3 scripts/cluster_probe.py --header
for ((i = 1; i <= rounds; i++)); do
  for setting in "$@"; do
    IFS=';' read -r -a parts <<<"$setting"
    name=${parts[0]}
    dir="$OUT/$name-$i"
    rm -rf "$dir"
    mkdir -p "$dir"
    if ! env "${parts[@]:1}" OXCCL_CLUSTER_STATS="$dir" scripts/cluster.sh perf "${shape%x*}" "${shape#*x}" \
      all_reduce -b "${SIZE:-16M}" -e "${SIZE:-16M}" -n "${ITERS:-40}" -w 3 --algo "${ALGO:-ring}" \
      --json "$dir/perf.json" >"$dir/out.txt" 2>&1; then
      echo "$name round $i: FAILED" >&2
      tail -5 "$dir/out.txt" >&2
      continue
    fi
    python3 scripts/cluster_probe.py "$dir" "$name"
  done
done
echo "# $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
