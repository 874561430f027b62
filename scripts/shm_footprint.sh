#!/usr/bin/env bash
# Peak shared memory (Shmem in /proc/meminfo) that `oxccl perf` adds, per rank count.
#
# Usage: scripts/shm_footprint.sh [BIN] [RANKS...] [-- PERF_ARGS...]
#   BIN defaults to target/release/oxccl, RANKS to "2 4 8 16 32", PERF_ARGS to
#   "all_reduce -b 8 -e 1M -c 1". Each run: Shmem before (baseline), then sampled every 50 ms
#   while `BIN perf PERF_ARGS --ranks N` runs; the table gives the peak increase over the
#   baseline (MiB), that divided by N, the run's wall time, its exit status and perf's count of
#   wrong elements (`Out of bounds values`; - when perf printed none). Other processes' shared memory
#   moves the numbers: run it on a quiet machine. OXCCL_* variables in the environment apply.
#   FOOTPRINT_TIMEOUT (seconds, default 600) bounds each run.
set -euo pipefail
bin=target/release/oxccl
if [ $# -gt 0 ] && [ "$1" != -- ] && ! [[ $1 =~ ^[0-9]+$ ]]; then bin=$1; shift; fi
ranks=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do ranks+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#ranks[@]} -gt 0 ] || ranks=(2 4 8 16 32)
perf_args=("$@")
[ ${#perf_args[@]} -gt 0 ] || perf_args=(all_reduce -b 8 -e 1M -c 1)
shmem_kib() { awk '/^Shmem:/ {print $2}' /proc/meminfo; }
printf '# %s perf %s --ranks N\n' "$bin" "${perf_args[*]}"
printf '%6s %14s %14s %10s %6s %6s\n' ranks peak_add_MiB per_rank_MiB wall_s rc wrong
for n in "${ranks[@]}"; do
  base=$(shmem_kib)
  peak=$base
  start=$(date +%s.%N)
  timeout "${FOOTPRINT_TIMEOUT:-600}" "$bin" perf "${perf_args[@]}" --ranks "$n" >/tmp/shm_footprint.$$.out 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    s=$(shmem_kib)
    [ "$s" -gt "$peak" ] && peak=$s
    sleep 0.05
  done
  rc=0
  wait "$pid" || rc=$?
  end=$(date +%s.%N)
  wrong=$(awk '/Out of bounds values/ {print $7; exit}' /tmp/shm_footprint.$$.out)
  awk -v n="$n" -v b="$base" -v p="$peak" -v s="$start" -v e="$end" -v rc="$rc" -v w="${wrong:--}" \
    'BEGIN { a = (p - b) / 1024; printf "%6d %14.1f %14.2f %10.1f %6d %6s\n", n, a, a / n, e - s, rc, w }'
  if [ "$rc" -ne 0 ]; then tail -5 /tmp/shm_footprint.$$.out >&2; fi
done
rm -f /tmp/shm_footprint.$$.out
