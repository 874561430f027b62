#!/usr/bin/env bash
# A/B of fork_copy_bench.py (what a fork costs with tensors in oxccl's pool) between two
# Python environments with oxccl installed (e.g. before and after a change), and with the
# allocator off, in one run. Usage: python/bench/fork_copy_ab.sh PYTHON_A PYTHON_B [PORT]
set -euo pipefail
A=$1 B=$2 PORT=${3:-29633}
BENCH=$(cd "$(dirname "$0")" && pwd)/fork_copy_bench.py
export RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 OXCCL_TUNE_FILE=
run() { # label python args...
  local label=$1 py=$2; shift 2
  echo "== $label: $*"
  MASTER_PORT=$((PORT++)) timeout 300 "$py" "$BENCH" "$@" 2>&1 | grep -v "^oxccl: building"
}
for args in "--live 256 --freed 0 --size 1024" "--live 64 --freed 256 --size 1024" \
            "--live 4 --freed 0 --size 64 --sparse"; do
  # shellcheck disable=SC2086
  run A "$A" $args --forks 2
  # shellcheck disable=SC2086
  run B "$B" $args --forks 2
  # shellcheck disable=SC2086
  OXCCL_TORCH_ALLOCATOR=0 run "B, allocator off" "$B" $args --forks 2
done
