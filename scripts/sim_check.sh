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
#   $OUT/tune.conf), CPUS the cores all emulated hosts share (default: nproc),
#   PATH_TCP_GBPS the TCP stack's GB/s per core on the emulated path for the prediction
#   (`oxccl sim --tcp-gbps`; default: the tune file's loopback rate; `calibrate`: the rate
#   at which the model's 2 x 1 ring of 16 MB takes the time one measured ring of 16 MB
#   between 2 emulated hosts takes, their links shaped to 100gbit so that the CPU and not
#   the link bounds it, then checked on every shape at RATE; `iperf`: the sum of both
#   directions of `IPERF_ARGS=--bidir scripts/cluster.sh iperf` over CPUS, which is bound
#   by iperf3's one thread per side and comes out lower than the library moves).
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
  # --force: the rates of this machine as loaded as the cluster's runs will find it, which
  # `oxccl tune`'s checks would otherwise refuse to save.
  "${OXCCL_BIN:-target/release/oxccl}" tune --ranks 2 --force --out "$TUNE" | tail -4
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
PATH_ARGS=()
if [ "${PATH_TCP_GBPS:-}" = calibrate ]; then
  # Links shaped to 100 Gbit/s, which neither the stack nor the tbf reaches here: the ring
  # is bound by the CPU that moves TCP through the path (veth, bridge, tbf), whatever RATE.
  echo "== $(date +%T) the path's TCP rate: one 2 x 1 ring of 16 MB at 100gbit, load $(cut -d' ' -f1-3 /proc/loadavg)"
  OXCCL_TUNE_FILE=$TUNE OXCCL_NET_GBPS=12.5 OXCCL_CLUSTER_RATE=100gbit LIMIT=600 \
    scripts/cluster.sh perf 2 1 all_reduce -b 16M -e 16M -n 10 -w 2 --algo ring >"$OUT/calibrate.txt"
  # The model's time is A + B / rate: two predictions give A and B; the rate is the one
  # whose prediction is the measured time (the faster of out-of-place and in-place).
  PATH_TCP_GBPS=$(python3 - "$OUT/calibrate.txt" "$TUNE" "$CPUS" 12.5 <<'PY'
import json, subprocess, sys
f, tune, cpus, gbps = sys.argv[1:]
rows = [l.split() for l in open(f) if len(l.split()) > 12 and l.split()[1] == "16777216"]
rows or sys.exit(f"no 16 MB row in {f}")
t = min(float(rows[0][7]), float(rows[0][12]))
def pred(rate):
    out = subprocess.run(["target/release/oxccl", "sim", "--hosts", "2", "-b", "16M", "-e", "16M",
                          "--json", "--tune-file", tune, "--cpus", cpus, "--net-gbps", gbps,
                          "--tcp-gbps", str(rate)], capture_output=True, text=True, check=True,
                         env={"OXCCL_TUNE_FILE": "", "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.splitlines()[0])["predicted_us"]["ring"]
# Two rates far below any link's, where the stack and not the link bounds the model's step.
r1, r2 = 0.001, 0.002
p1, p2 = pred(r1), pred(r2)
b = (p1 - p2) / (1 / r1 - 1 / r2)
a = p1 - b / r1
t > a or sys.exit(f"measured {t} us is below the model's fixed part {a:.0f} us")
print(round(b / (t - a), 3))
PY
)
  echo "# path TCP rate per core: $PATH_TCP_GBPS GB/s" | tee -a "$OUT/calibrate.txt"
elif [ "${PATH_TCP_GBPS:-}" = iperf ]; then
  echo "== $(date +%T) the path's TCP rate, both directions at once"
  OXCCL_CLUSTER_RATE=$RATE IPERF_ARGS=--bidir scripts/cluster.sh iperf | tee "$OUT/iperf.txt"
  # iperf3's last two receiver lines: one per direction, in Gbits/sec.
  PATH_TCP_GBPS=$(python3 -c "
import re,sys
r=[float(m[1])*{'G':1,'M':1e-3}[m[2]] for m in re.finditer(r'([0-9.]+) ([GM])bits/sec.*receiver', open('$OUT/iperf.txt').read())]
len(r)>=2 or sys.exit('no bidirectional receiver lines in $OUT/iperf.txt')
print(round(sum(r[-2:])/8/$CPUS, 3))")
  echo "# path TCP rate per core: $PATH_TCP_GBPS GB/s" | tee -a "$OUT/iperf.txt"
fi
[ -z "${PATH_TCP_GBPS:-}" ] || PATH_ARGS=(--tcp-gbps "$PATH_TCP_GBPS")
python3 scripts/sim_compare.py "$OUT" --net-gbps "$GBPS" --tune-file "$TUNE" --cpus "$CPUS" ${PATH_ARGS[@]+"${PATH_ARGS[@]}"}
