#!/usr/bin/env bash
# oxccl under real launchers on this one host: Open MPI's mpirun, torchrun and (as root, with
# Debian's slurmd, slurmctld and slurm-client installed) Slurm's srun, with a slurmctld and a
# slurmd this script starts from a minimal slurm.conf in a temporary directory and always
# stops. Under each launcher:
#   - `oxccl perf all_reduce` runs as one rank per process and checks its results;
#   - examples/python/launchers_torch.py (DDP on a small model) runs once over gloo and once
#     over oxccl: the trained weights must be equal (to rounding beyond 2 ranks).
# A launcher that is missing is skipped with the reason; anything that fails is an error.
#
#   scripts/launchers.sh                  # oxccl from target/release, else target/debug
#   OXCCL_BIN=path/to/oxccl PYTHON=.venv/bin/python scripts/launchers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

BIN=${OXCCL_BIN:-}
if [ -z "$BIN" ]; then
  for b in target/release/oxccl target/debug/oxccl; do
    if [ -x "$b" ]; then BIN=$REPO/$b; break; fi
  done
fi
[ -n "$BIN" ] && [ -x "$BIN" ] || { echo "no oxccl binary: cargo build --release -p oxccl-cli, or set OXCCL_BIN" >&2; exit 1; }
PY=${PYTHON:-.venv/bin/python}
HAVE_TORCH=1
if ! "$PY" -c "import torch, oxccl" 2>/dev/null; then
  HAVE_TORCH=0
  echo "-- $PY cannot import torch and oxccl: the torch programs are skipped (build the package: scripts/test.sh)"
fi
export OXCCL_SECRET=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
TORCH_PROG=$REPO/examples/python/launchers_torch.py
PERF_ARGS=(all_reduce -b 8 -e 1M -f 32)
TMP=$(mktemp -d)
SLURM_PIDS=()
cleanup() {
  local p
  for p in "${SLURM_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${SLURM_PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM  # the EXIT trap then stops the daemons

port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null || echo $((20000 + RANDOM % 20000)); }

# check_perf LOG N: the perf table of N ranks with no wrong element.
check_perf() {
  grep -q "# oxccl all_reduce perf: $2 ranks" "$1" || { cat "$1"; echo "FAIL: no $2-rank perf table" >&2; exit 1; }
  grep -q "# Out of bounds values : 0 OK" "$1" || { cat "$1"; echo "FAIL: wrong elements" >&2; exit 1; }
}

# same_weights NAME N CMD...: runs CMD... --backend gloo, then --backend oxccl; both must
# report N ranks, and the trained weights must agree: bit for bit at 2 ranks, to rounding at
# more (gloo and oxccl add the ranks' gradients in different orders).
same_weights() {
  local name=$1 n=$2 b d rc
  shift 2
  for b in gloo oxccl; do
    rc=0
    rm -f "$TMP/w.$b.pt"
    "$@" --backend "$b" --out "$TMP/w.$b.pt" > "$TMP/out.$b" 2>&1 || rc=$?
    d=$(sed -n "s/^$n ranks over $b (.*): weights \([0-9a-f]*\); done$/\1/p" "$TMP/out.$b")
    # The reference only: torch 2.15's gloo at times aborts a rank at interpreter exit, after
    # destroy_process_group returned on every rank ("terminate called without an active
    # exception"; seen in 1-4 of 20 runs on the 2-core VM, in a venv without oxccl too). Its
    # weights are saved and its digest printed by then, so its run still serves.
    if [ "$rc" -ne 0 ] && [ "$b" = gloo ] && [ -n "$d" ] && [ -s "$TMP/w.gloo.pt" ] &&
      grep -q "^terminate called without an active exception" "$TMP/out.$b"; then
      echo "note: $name over gloo: a rank aborted at exit after its run (torch's gloo teardown)"
      rc=0
    fi
    [ "$rc" -eq 0 ] || { cat "$TMP/out.$b"; echo "FAIL: $name over $b" >&2; exit 1; }
    [ -n "$d" ] || { cat "$TMP/out.$b"; echo "FAIL: $name over $b: no digest" >&2; exit 1; }
  done
  "$PY" - "$TMP/w.gloo.pt" "$TMP/w.oxccl.pt" "$n" "$name" <<'PYEOF' || exit 1
import sys, torch
a, b, n, name = torch.load(sys.argv[1]), torch.load(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
d = (a - b).abs().max().item()
if n == 2 and not torch.equal(a, b):
    sys.exit(f"FAIL: {name}: gloo and oxccl weights differ at 2 ranks (max {d:.3g})")
if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
    sys.exit(f"FAIL: {name}: gloo and oxccl weights differ by up to {d:.3g}")
print(f"ok: {name}: {n} ranks, gloo and oxccl weights " + ("equal" if d == 0 else f"within {d:.2g}"))
PYEOF
}

echo "== mpirun"
if command -v mpirun >/dev/null; then
  MPI=(timeout 300 mpirun -n 4)
  [ "$(id -u)" = 0 ] && MPI+=(--allow-run-as-root)
  MPI+=(--oversubscribe --bind-to none -x OXCCL_SECRET -x OMP_NUM_THREADS -x PYTHONUNBUFFERED)
  P=$(port)
  "${MPI[@]}" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$P" "$BIN" perf "${PERF_ARGS[@]}" > "$TMP/mpi.perf" 2>&1 \
    || { cat "$TMP/mpi.perf"; echo "FAIL: oxccl perf under mpirun" >&2; exit 1; }
  check_perf "$TMP/mpi.perf" 4
  echo "ok: mpirun -n 4 oxccl perf ${PERF_ARGS[*]}"
  if [ $HAVE_TORCH = 1 ]; then
    P=$(port)
    same_weights "mpirun -n 4 python launchers_torch.py" 4 \
      "${MPI[@]}" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$P" "$PY" "$TORCH_PROG"
  fi
else
  echo "-- skipped: no mpirun (apt-get install openmpi-bin)"
fi

echo "== torchrun"
if [ $HAVE_TORCH = 1 ]; then
  TR=(timeout 300 "$PY" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1)
  P=$(port)
  "${TR[@]}" --master-port "$P" --no-python "$BIN" perf "${PERF_ARGS[@]}" > "$TMP/torchrun.perf" 2>&1 \
    || { cat "$TMP/torchrun.perf"; echo "FAIL: oxccl perf under torchrun" >&2; exit 1; }
  check_perf "$TMP/torchrun.perf" 2
  echo "ok: torchrun --nproc-per-node 2 --no-python oxccl perf ${PERF_ARGS[*]}"
  P=$(port)
  same_weights "torchrun --nproc-per-node 2 launchers_torch.py" 2 "${TR[@]}" --master-port "$P" "$TORCH_PROG"
else
  echo "-- skipped: no torch"
fi

echo "== slurm (srun)"
slurm_skip=""
if [ "$(id -u)" != 0 ]; then
  slurm_skip="not root (this script starts its own slurmctld and slurmd)"
else
  for c in slurmctld slurmd srun scontrol; do
    command -v $c >/dev/null || { slurm_skip="no $c (apt-get install slurmd slurmctld slurm-client)"; break; }
  done
fi
if [ -z "$slurm_skip" ] && [ -e /run/slurmctld.pid ] || pgrep -x slurmctld >/dev/null 2>&1; then
  [ -z "$slurm_skip" ] && slurm_skip="a slurmctld already runs on this host: not starting a second"
fi
AUTH_DIR=$(ls -d /usr/lib/*/slurm-wlm /usr/lib/slurm 2>/dev/null | head -n1 || true)
if [ -z "$slurm_skip" ] && [ ! -e "$AUTH_DIR/auth_none.so" ]; then
  slurm_skip="Slurm's auth/none plugin is missing from $AUTH_DIR (this script does not set up munge)"
fi
if [ -n "$slurm_skip" ]; then
  echo "-- skipped: $slurm_skip"
else
  S=$TMP/slurm
  mkdir -p "$S/spool" "$S/state"
  HOST=$(hostname -s)
  CPUS=$(nproc)
  CTLD_PORT=$(port)
  SLURMD_PORT=$(port)
  cat > "$S/slurm.conf" <<EOF
ClusterName=oxccl
SlurmctldHost=$HOST
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd.pid
SlurmctldLogFile=$S/slurmctld.log
SlurmdLogFile=$S/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/linear
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$HOST CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST OverSubscribe=FORCE:8 Default=YES MaxTime=10 State=UP
EOF
  export SLURM_CONF=$S/slurm.conf
  slurmctld -D -i -f "$S/slurm.conf" > "$S/ctld.out" 2>&1 &
  SLURM_PIDS+=($!)
  slurmd -D -f "$S/slurm.conf" > "$S/slurmd.out" 2>&1 &
  SLURM_PIDS+=($!)
  up=0
  for _ in $(seq 60); do
    if sinfo -h -o %t 2>/dev/null | grep -q idle; then up=1; break; fi
    sleep 0.5
  done
  if [ $up = 0 ]; then
    tail -n 20 "$S/slurmctld.log" "$S/slurmd.log" "$S/ctld.out" "$S/slurmd.out" 2>/dev/null || true
    echo "FAIL: slurmctld and slurmd did not come up" >&2
    exit 1
  fi
  # --overcommit: 4 tasks on a host with fewer CPUs; timeout: a job that never starts fails.
  SR=(timeout 300 srun -n 4 --overcommit --time 5)
  P=$(port)
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$P "${SR[@]}" "$BIN" perf "${PERF_ARGS[@]}" > "$TMP/srun.perf" 2>&1 \
    || { cat "$TMP/srun.perf"; tail -n 20 "$S/slurmctld.log" "$S/slurmd.log"; echo "FAIL: oxccl perf under srun" >&2; exit 1; }
  check_perf "$TMP/srun.perf" 4
  echo "ok: srun -n 4 oxccl perf ${PERF_ARGS[*]}"
  if [ $HAVE_TORCH = 1 ]; then
    P=$(port)
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$P same_weights "srun -n 4 python launchers_torch.py" 4 "${SR[@]}" "$PY" "$TORCH_PROG"
  fi
fi
echo "== launchers: done"
