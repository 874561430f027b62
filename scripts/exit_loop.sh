#!/usr/bin/env bash
# The clean-exit check: runs the `exit_queued` scenario of
# python/tests/torch_lifecycle_worker.py (queued > 1 MiB async all_reduces, then exit without
# waiting) N times with 2 ranks on the C++ backend, and counts how each rank exited. Every
# exit must be 0 with "exit_queued ok" printed; anything else (a signal such as SIGABRT from
# "terminate called without an active exception", a nonzero code, a run past the timeout) is
# a failure, and its output is kept under $LOG_DIR (with a py-spy dump of a rank past the
# timeout, when py-spy is installed).
#
#   scripts/exit_loop.sh 1000                   # prints a tally; exit status 1 on any failure
#
# Every rank here is a fresh interpreter (about 3 CPU-seconds of `import torch` each);
# scripts/exit_loop_fork.py runs the same scenario with the ranks forked from a parent that
# imported torch once, for counts in the thousands.
#
# Each run is bounded by EXIT_LOOP_TIMEOUT seconds (default 120). Needs the venv scripts/test.sh
# builds (.venv with torch and oxccl, the C++ backend built); PYTHON overrides the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: scripts/exit_loop.sh N}
PY=${PYTHON:-.venv/bin/python}
SPY=$(dirname "$PY")/py-spy
command -v "$SPY" >/dev/null 2>&1 || SPY=$(command -v py-spy || true)
TIMEOUT=${EXIT_LOOP_TIMEOUT:-120}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/oxccl-exit-loop.XXXXXX)}
mkdir -p "$LOG_DIR"
WORKER=python/tests/torch_lifecycle_worker.py
declare -A tally=()
failed=0
for ((i = 1; i <= N; i++)); do
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  pids=()
  for r in 0 1; do
    env RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
      OXCCL_SECRET=5f3c2a1b0e9d8c7b6a5f4e3d2c1b0a99 OXCCL_TIMEOUT="${OXCCL_TIMEOUT:-60}" OMP_NUM_THREADS=1 \
      PYTHONUNBUFFERED=1 \
      "$PY" "$WORKER" exit_queued >"$LOG_DIR/run$i.rank$r.log" 2>&1 &
    pids+=($!)
  done
  # Past the timeout: a py-spy dump of each rank still running, then SIGKILL.
  deadline=$((SECONDS + TIMEOUT))
  while kill -0 "${pids[0]}" 2>/dev/null || kill -0 "${pids[1]}" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      for r in 0 1; do
        if kill -0 "${pids[$r]}" 2>/dev/null; then
          { echo "=== past ${TIMEOUT} s: py-spy dump"; [ -n "$SPY" ] && "$SPY" dump --native --pid "${pids[$r]}"; } \
            >>"$LOG_DIR/run$i.rank$r.log" 2>&1
          kill -KILL "${pids[$r]}" 2>/dev/null
        fi
      done
      break
    fi
    sleep 0.2
  done
  bad=0
  for r in 0 1; do
    wait "${pids[$r]}" 2>/dev/null
    rc=$?
    echo "=== exit code $rc" >>"$LOG_DIR/run$i.rank$r.log"
    if [ "$rc" -eq 0 ] && grep -q "exit_queued ok" "$LOG_DIR/run$i.rank$r.log"; then
      key="0"
    elif [ "$rc" -eq 0 ]; then
      key="0 without 'exit_queued ok'"
    elif [ "$rc" -eq 137 ]; then
      key="137 (SIGKILL: past ${TIMEOUT} s)"
    else
      key="$rc"
    fi
    tally[$key]=$((${tally[$key]:-0} + 1))
    [ "$key" = "0" ] || bad=1
  done
  if [ "$bad" -eq 0 ]; then
    rm -f "$LOG_DIR/run$i".rank*.log
  else
    failed=$((failed + 1))
    echo "run $i failed: logs in $LOG_DIR/run$i.rank*.log" >&2
  fi
  if ((i % 10 == 0 || i == N)); then
    line="after $i runs (2 ranks each):"
    for k in "${!tally[@]}"; do line+=" [exit $k: ${tally[$k]}]"; done
    echo "$line"
  fi
done
echo "exit_loop: $failed of $N runs had a rank that did not exit 0 (logs of failures: $LOG_DIR)"
[ "$failed" -eq 0 ]
