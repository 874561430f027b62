#!/usr/bin/env bash
# An emulated cluster on one machine: N "hosts" are network namespaces, each with one veth
# link (its eth0) to a switch namespace that bridges them. Both directions of every link are
# shaped with tbf to OXCCL_CLUSTER_RATE (default 10gbit). Ranks run inside the host
# namespaces with OXCCL_HOSTID=hostK, so ranks of one namespace share memory and ranks of
# different namespaces talk TCP through the switch.
#
# Usage (as root, with `ip netns`):
#   scripts/cluster.sh test            correctness on 2 hosts x 2 ranks (block and cyclic rank
#                                      placement), 4 hosts x 1 rank and 2+1+1 ranks, every
#                                      collective with results checked; torchrun as the
#                                      launcher (if torch is installed); then a link cut
#                                      mid-run: every rank must exit with an error in a bound
#   scripts/cluster.sh bench [LO HI]   oxccl (tuned; also the flat ring on 2x2) and gloo side by side on the
#                                      same cluster, all_reduce 8 B and 64 MB .. 256 MB
#   scripts/cluster.sh cpu [SIZE]      CPU-seconds per GB all-reduced, oxccl and gloo side by
#                                      side in one run, at 2.5 and 10 Gbit/s (OXCCL_CPU_RATES),
#                                      on 2x1, 2x2 and 4x1 (OXCCL_CPU_SHAPES), in-place float
#                                      sum of SIZE bytes (default 64 MiB), and the system
#                                      (kernel) share of each library's CPU
#   scripts/cluster.sh iperf           iperf3 between two hosts (the link's TCP ceiling)
#   scripts/cluster.sh perf H L ARGS   one checked `oxccl perf ARGS` on H hosts x L ranks
#   scripts/cluster.sh cut H L         only the link-cut check
#   scripts/cluster.sh connect [SHAPES] TCP links made at init (OXCCL_TCP_CONNECT=eager) and on
#                                      first use (lazy), alternated in one run, on each shape
#                                      HxL (default "2x8 4x8"): sockets per rank after init and
#                                      after the first call, start to the first call's end, the
#                                      first call's time and the steady mean, for all_reduce,
#                                      all_gather and broadcast of OXCCL_CONNECT_BYTES (64K),
#                                      OXCCL_CONNECT_ROUNDS (2) rounds; runs the test binary
#                                      OXCCL_COST_BIN (`cargo test --release -p oxccl --test
#                                      tcp_lazy --no-run` prints it; its `cost_child`)
#   scripts/cluster.sh torchrun        only the torchrun launch
#
# Settings: OXCCL_BIN (default target/release/oxccl), OXCCL_CLUSTER_RATE (10gbit),
# OXCCL_CLUSTER_MTU (9000; 1500 for standard frames), OXCCL_CLUSTER_SSAI (when set, each host's
# net.ipv4.tcp_slow_start_after_idle: 0 keeps an idle connection's congestion window), GLOO_PY (python with torch; default
# ~/.cache/oxccl-anchors/venv/bin/python), ANCHORS (../shared/anchors),
# OXCCL_CLUSTER_CC (each host's net.ipv4.tcp_congestion_control; default: the machine's, which
# a new namespace inherits; only those of net.ipv4.tcp_allowed_congestion_control: reno and
# bbr on the test VM, not cubic), OXCCL_CLUSTER_SYSCTL (key=value words set in every host),
# OXCCL_CLUSTER_TBF (the tbf's parameters after its rate; default
# "burst 512k latency 2ms"), OXCCL_CLUSTER_HOST_QDISC and OXCCL_CLUSTER_PORT_QDISC (the root
# qdisc of each host's eth0 and of each switch port, as tc words, e.g. "fq maxrate 10gbit";
# none: the veth's default; default "tbf rate RATE OXCCL_CLUSTER_TBF"), OXCCL_CLUSTER_STATS=DIR (`perf` only: writes into DIR, after
# the run, each namespace's `tc -s qdisc` and `nstat -asz` (a namespace's counters start at
# zero when it is made), and during the run, every 100 ms, the machine's CPU line, context
# switches, softirq counts and ksoftirqd's CPU time with `ss -tin` of every host (ss.txt;
# scripts/cluster_probe.py samples and reads them)).
#
# Addresses are 10.77.0.K+1/24, inside namespaces this script creates (named oxc<pid>-...),
# so nothing outside them is touched; everything is removed on exit, also on failure.
# Every run is bounded by `timeout`.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${OXCCL_BIN:-target/release/oxccl}
RATE=${OXCCL_CLUSTER_RATE:-10gbit}
TBF=${OXCCL_CLUSTER_TBF:-burst 512k latency 2ms}
MTU=${OXCCL_CLUSTER_MTU:-9000}
P="oxc$$-"
NET=10.77.0
PORT=29611
SECRET=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
LOGS=$(mktemp -d /tmp/oxccl-cluster.XXXXXX)
HOSTS=0

log() { printf '== %s\n' "$*"; }
die() {
  printf 'cluster.sh: FAILED: %s\n' "$*" >&2
  exit 1
}

can_run() {
  [ "$(id -u)" = 0 ] || {
    echo "not root"
    return 1
  }
  command -v ip >/dev/null && command -v tc >/dev/null || {
    echo "ip or tc (iproute2) missing"
    return 1
  }
  local t="oxc$$-probe"
  ip netns add "$t" 2>/dev/null || {
    echo "ip netns add fails here (no CAP_SYS_ADMIN or no netns support)"
    return 1
  }
  if ! ip link add a0 netns "$t" type veth peer name a1 netns "$t" 2>/dev/null ||
    ! tc -n "$t" qdisc add dev a0 root tbf rate 1gbit burst 64k latency 1ms 2>/dev/null; then
    ip netns del "$t" 2>/dev/null || true
    echo "veth links or tc tbf unavailable"
    return 1
  fi
  ip netns del "$t"
}

down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$P" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  HOSTS=0
}

cleanup() {
  local rc=$?
  [ -z "${SAMPLER:-}" ] || kill "$SAMPLER" 2>/dev/null || true
  down
  if [ "$rc" = 0 ]; then rm -rf "$LOGS"; else echo "cluster.sh: logs kept in $LOGS" >&2; fi
}

# up N: N hosts, addresses $NET.1 .. $NET.N
up() {
  down
  HOSTS=$1
  ip netns add "${P}sw"
  ip -n "${P}sw" link add br0 type bridge
  ip -n "${P}sw" link set br0 up
  local k
  for ((k = 0; k < HOSTS; k++)); do
    local h="${P}h$k"
    ip netns add "$h"
    ip link add eth0 netns "$h" mtu "$MTU" type veth peer name "p$k" netns "${P}sw" mtu "$MTU"
    ip -n "$h" link set lo up
    [ -z "${OXCCL_CLUSTER_SSAI:-}" ] ||
      ip netns exec "$h" sysctl -qw net.ipv4.tcp_slow_start_after_idle="$OXCCL_CLUSTER_SSAI"
    [ -z "${OXCCL_CLUSTER_CC:-}" ] ||
      ip netns exec "$h" sysctl -qw net.ipv4.tcp_congestion_control="$OXCCL_CLUSTER_CC"
    # shellcheck disable=SC2086 # a list of key=value words
    [ -z "${OXCCL_CLUSTER_SYSCTL:-}" ] || ip netns exec "$h" sysctl -qw $OXCCL_CLUSTER_SYSCTL
    ip -n "$h" addr add "$NET.$((k + 1))/24" dev eth0
    ip -n "$h" link set eth0 up
    ip -n "${P}sw" link set "p$k" master br0
    ip -n "${P}sw" link set "p$k" up
    # Shape both directions: host -> switch on eth0, switch -> host on p$k. The shapers run
    # on this machine's cores: a throttled tbf releases each packet from a timer softirq, so
    # a link shaped below the CPU's TCP rate costs more CPU per byte than an unshaped one
    # (10 Gbit/s on 2 cores: 34-37 core-ms per 16 MB ring against 27-32; docs/scale.md,
    # "Checked against emulated hosts").
    local hq=${OXCCL_CLUSTER_HOST_QDISC:-tbf rate $RATE $TBF} pq=${OXCCL_CLUSTER_PORT_QDISC:-tbf rate $RATE $TBF}
    # shellcheck disable=SC2086 # a qdisc is a list of tc words
    [ "$hq" = none ] || tc -n "$h" qdisc add dev eth0 root $hq
    # shellcheck disable=SC2086
    [ "$pq" = none ] || tc -n "${P}sw" qdisc add dev "p$k" root $pq
  done
  for ((k = 1; k < HOSTS; k++)); do
    # A refused connection proves the path works (no ping needed): only a timeout fails.
    local out
    out=$(ip netns exec "${P}h$k" timeout 3 bash -c "exec 3<>/dev/tcp/$NET.1/9" 2>&1) || true
    case "$out" in *refused*) ;; *) die "host $k cannot reach host 0: $out" ;; esac
  done
}

# launch NAME HOSTS PER_HOST PLACEMENT -- ARGS...: starts world = HOSTS*PER_HOST ranks of
# `oxccl ARGS...`, rank r on host r/PER_HOST (block) or r%HOSTS (cyclic), in the background;
# sets PIDS and LOGDIR. Extra environment: EXTRA_ENV (array of NAME=VALUE).
launch() {
  local name=$1 hosts=$2 per=$3 place=$4
  shift 5
  local world=$((hosts * per)) r h lr
  LOGDIR="$LOGS/$name"
  mkdir -p "$LOGDIR"
  PIDS=()
  PORT=$((PORT + 1))
  for ((r = 0; r < world; r++)); do
    if [ "$place" = cyclic ]; then
      h=$((r % hosts)) lr=$((r / hosts))
    else
      h=$((r / per)) lr=$((r % per))
    fi
    ip netns exec "${P}h$h" env RANK=$r WORLD_SIZE=$world LOCAL_RANK=$lr LOCAL_WORLD_SIZE=$per \
      MASTER_ADDR=$NET.1 MASTER_PORT=$PORT OXCCL_SECRET="$SECRET" OXCCL_HOSTID="host$h" \
      "${EXTRA_ENV[@]}" timeout -k 5 "${LIMIT:-300}" "$BIN" "$@" >"$LOGDIR/rank$r.log" 2>&1 &
    PIDS+=($!)
  done
}

# Waits for every rank of the last launch; fails unless all exit 0.
wait_ok() {
  local r rc bad=0
  for r in "${!PIDS[@]}"; do
    rc=0
    wait "${PIDS[$r]}" || rc=$?
    if [ "$rc" != 0 ]; then
      echo "rank $r exited with $rc:" >&2
      tail -5 "$LOGDIR/rank$r.log" >&2
      bad=1
    fi
  done
  [ "$bad" = 0 ] || die "$(basename "$LOGDIR"): a rank failed"
}

# run NAME HOSTS PER PLACEMENT -- perf args: one checked perf run, rank 0's table printed.
run() {
  local name=$1
  EXTRA_ENV=(${EXTRA_ENV[@]+"${EXTRA_ENV[@]}"})
  launch "$@"
  wait_ok
  grep -q '# Out of bounds values : 0 OK' "$LOGDIR/rank0.log" || die "$name: results not checked OK"
  grep -v '^#  *iters\|^# *(B)' "$LOGDIR/rank0.log" | sed "s/^/[$name] /"
}

# stats_begin DIR: samples, every 100 ms until stats_end, the machine's CPU time (the `cpu`
# line of /proc/stat), context switches, softirq counts, the ksoftirqd threads' CPU time
# (/proc/PID/schedstat) and every host's TCP sockets
# (`ss -tin`: cwnd, rtt, pacing and delivery rate, the time limited by the receive window
# or the send buffer) into DIR/ss.txt.
stats_begin() {
  mkdir -p "$1"
  # One python process reads the /proc files itself: a shell loop forking a dozen
  # commands every 100 ms would take a noticeable share of the cores it measures.
  python3 scripts/cluster_probe.py --sample "$P" "$HOSTS" >"$1/ss.txt" &
  SAMPLER=$!
}

# stats_end DIR: stops the sampler; each namespace's qdisc counters (drops, overlimits) and
# each host's TCP counters (retransmits, loss probes) since it was made.
stats_end() {
  local dir=$1 k
  kill "$SAMPLER" 2>/dev/null || true
  wait "$SAMPLER" 2>/dev/null || true
  SAMPLER=
  for ((k = 0; k < HOSTS; k++)); do
    tc -s -n "${P}h$k" qdisc show dev eth0 >"$dir/tc-h$k.txt"
    tc -s -n "${P}sw" qdisc show dev "p$k" >"$dir/tc-p$k.txt"
    ip netns exec "${P}h$k" nstat -asz >"$dir/nstat-h$k.txt"
  done
}

t_correctness() {
  EXTRA_ENV=()
  local c
  up 2
  log "2 hosts x 2 ranks, block placement (ranks 0,1 on host 0): every collective, checked"
  for c in all_reduce all_gather reduce_scatter broadcast reduce all_to_all sendrecv; do
    LIMIT=120 run "2x2-$c" 2 2 block -- perf "$c" -b 8 -e 4M -f 32 -n 3 -w 1 -c 1
  done
  LIMIT=120 run "2x2-dtypes" 2 2 block -- perf all_reduce -b 24 -e 1M -f 64 -n 2 -w 1 -d all -o all
  for a in ring hier tree hd; do
    LIMIT=120 run "2x2-$a" 2 2 block -- perf all_reduce -b 4 -e 8M -f 8 -n 2 -w 1 -o avg --algo "$a"
  done
  log "2 hosts x 2 ranks, TCP striped over 3 connections per pair"
  EXTRA_ENV=(OXCCL_TCP_STREAMS=3)
  LIMIT=120 run "2x2-streams3" 2 2 block -- perf all_reduce -b 8 -e 8M -f 32 -n 2 -w 1 --algo ring
  LIMIT=120 run "2x2-streams3-a2a" 2 2 block -- perf all_to_all -b 64 -e 4M -f 64 -n 2 -w 1
  EXTRA_ENV=()
  log "2 hosts x 2 ranks, cyclic placement (ranks 0,2 on host 0)"
  for a in ring hier tree hd; do
    LIMIT=120 run "2x2c-$a" 2 2 cyclic -- perf all_reduce -b 4 -e 8M -f 8 -n 2 -w 1 --algo "$a"
  done
  LIMIT=120 run "2x2c-ag" 2 2 cyclic -- perf all_gather -b 64 -e 4M -f 64 -n 2 -w 1
  LIMIT=120 run "2x2c-rs" 2 2 cyclic -- perf reduce_scatter -b 64 -e 4M -f 64 -n 2 -w 1
  up 4
  log "4 hosts x 1 rank: every collective, checked"
  for c in all_reduce all_gather reduce_scatter broadcast reduce all_to_all sendrecv; do
    LIMIT=120 run "4x1-$c" 4 1 block -- perf "$c" -b 8 -e 4M -f 32 -n 3 -w 1 -c 1
  done
  for a in ring hier tree hd; do
    LIMIT=120 run "4x1-$a" 4 1 block -- perf all_reduce -b 4 -e 8M -f 8 -n 2 -w 1 -o max --algo "$a"
  done
  log "3 hosts (2+1+1 ranks): uneven hosts"
  up 3
  launch_uneven
}

# 4 ranks on 3 hosts: 0,1 on host 0, 2 on host 1, 3 on host 2.
launch_uneven() {
  local r h lr place=(0 0 1 2)
  LOGDIR="$LOGS/uneven"
  mkdir -p "$LOGDIR"
  PIDS=()
  PORT=$((PORT + 1))
  for r in 0 1 2 3; do
    h=${place[$r]}
    ip netns exec "${P}h$h" env RANK=$r WORLD_SIZE=4 MASTER_ADDR=$NET.1 MASTER_PORT=$PORT \
      OXCCL_SECRET="$SECRET" OXCCL_HOSTID="host$h" \
      timeout -k 5 120 "$BIN" perf all_reduce -b 4 -e 4M -f 16 -n 2 -w 1 >"$LOGDIR/rank$r.log" 2>&1 &
    PIDS+=($!)
  done
  wait_ok
  grep -q '# Out of bounds values : 0 OK' "$LOGDIR/rank0.log" || die "uneven: results not OK"
  grep '^ ' "$LOGDIR/rank0.log" | sed 's/^/[3 hosts, 2+1+1] /'
}

# torchrun as the launcher: one torchrun per host (--nnodes 2 --nproc-per-node 2), ranks
# checked; skipped where torch is not installed.
t_torchrun() {
  local tr
  tr=$(dirname "${GLOO_PY:-$HOME/.cache/oxccl-anchors/venv/bin/python}")/torchrun
  if [ ! -x "$tr" ]; then
    echo "(torchrun launch skipped: $tr not found; ../shared/anchors/install.sh installs torch)"
    return 0
  fi
  up 2
  log "torchrun on 2 hosts x 2 ranks (one torchrun per host)"
  LOGDIR="$LOGS/torchrun"
  mkdir -p "$LOGDIR"
  PIDS=()
  PORT=$((PORT + 2))
  local k
  for k in 0 1; do
    ip netns exec "${P}h$k" env OXCCL_SECRET="$SECRET" OXCCL_HOSTID="host$k" \
      timeout -k 5 180 "$tr" --nnodes 2 --nproc-per-node 2 --node-rank $k \
      --master-addr $NET.1 --master-port $PORT --no-python \
      "$(realpath "$BIN")" perf all_reduce -b 8 -e 4M -f 32 -n 2 -w 1 >"$LOGDIR/node$k.log" 2>&1 &
    PIDS+=($!)
  done
  wait_ok
  grep -q '# Out of bounds values : 0 OK' "$LOGDIR/node0.log" || die "torchrun: results not checked OK"
  grep -q 'transport shm+tcp' "$LOGDIR/node0.log" || die "torchrun: expected shm+tcp links"
  grep '^ \|transport' "$LOGDIR/node0.log" | sed 's/^/[torchrun] /'
}

# A link cut mid-run: every rank must exit non-zero, with an error message, within BOUND s.
t_cut() {
  local hosts=$1 per=$2 bound=${CUT_BOUND:-90}
  up "$hosts"
  log "link cut: $hosts hosts x $per ranks, host 1's link goes down mid-run"
  EXTRA_ENV=()
  LIMIT=600 launch "cut-${hosts}x$per" "$hosts" "$per" block -- perf all_reduce -b 16M -e 16M -n 100000 -w 1 -c 0
  sleep 4
  local r
  for r in "${!PIDS[@]}"; do
    kill -0 "${PIDS[$r]}" 2>/dev/null || die "rank $r ended before the cut"
  done
  ip -n "${P}sw" link set p1 down
  local t0=$SECONDS
  for r in "${!PIDS[@]}"; do
    local rc=0 left=$((bound - (SECONDS - t0)))
    while kill -0 "${PIDS[$r]}" 2>/dev/null && [ $left -gt 0 ]; do
      sleep 1
      left=$((bound - (SECONDS - t0)))
    done
    if kill -0 "${PIDS[$r]}" 2>/dev/null; then
      die "rank $r still running ${bound}s after the cut (a hang)"
    fi
    wait "${PIDS[$r]}" || rc=$?
    [ "$rc" != 0 ] || die "rank $r exited 0 after the cut"
    [ "$rc" != 124 ] && [ "$rc" != 137 ] || die "rank $r was killed by timeout"
    local msg
    msg=$(grep -m1 'oxccl perf:' "$LOGDIR/rank$r.log" || true)
    [ -n "$msg" ] || die "rank $r exited $rc without an error message"
    echo "[cut] rank $r (host $((r / per))): exit $rc after $((SECONDS - t0))s: ${msg:0:200}"
  done
}

# cpu_oxccl NAME HOSTS PER SIZE ITERS: one unchecked in-place row; prints "time_us cpu_us algbw
# busbw algo runq_wait_us sys_us" (-1: not measured).
cpu_oxccl() {
  local name=$1 hosts=$2 per=$3 size=$4 iters=$5
  EXTRA_ENV=()
  LIMIT=300 launch "$name" "$hosts" "$per" block -- perf all_reduce -b "$size" -e "$size" \
    -n "$iters" -w 2 -c 0 --json "$LOGS/$name.json"
  wait_ok
  python3 -c '
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r["in_place"]:
        print(r["time_us"], r["cpu_us"], r["algbw_gbps"], r["busbw_gbps"], r["algo"],
              r.get("runq_wait_us", -1), r.get("sys_us", -1))' "$LOGS/$name.json"
}

# cpu_gloo NAME HOSTS PER SIZE ITERS: prints "time_us cpu_us sys_us" (scripts/gloo_cpu_bench.py).
cpu_gloo() {
  local name=$1 hosts=$2 per=$3 size=$4 iters=$5 world=$(($2 * $3)) r
  LOGDIR="$LOGS/$name"
  mkdir -p "$LOGDIR"
  PIDS=()
  PORT=$((PORT + 1))
  for ((r = 0; r < world; r++)); do
    ip netns exec "${P}h$((r / per))" env RANK=$r WORLD_SIZE=$world MASTER_ADDR=$NET.1 \
      MASTER_PORT=$PORT GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
      timeout -k 5 300 "$GLOO_PY" scripts/gloo_cpu_bench.py "$size" "$iters" 2 \
      >"$LOGDIR/rank$r.log" 2>&1 &
    PIDS+=($!)
  done
  wait_ok
  awk '$1 == "gloo" { print $3, $4, $5 }' "$LOGDIR/rank0.log"
}

# cpu [SIZE]: CPU-seconds (user + system of all ranks) per GB all-reduced (SIZE bytes per
# call), oxccl and gloo one after the other on the same cluster, for every rate and shape.
# "link %" is the time the link bound allows over the time measured, the same for both
# libraries: an all_reduce of SIZE bytes among H hosts must send at least 2(H-1)/H x SIZE
# over each host's link (each host's contribution must leave it and the result must come
# back, whatever the algorithm), so link % = algbw x 2(H-1)/H / line rate. (For one rank
# per host that is busbw over line rate; on 2x2 a flat ring, as gloo runs, sends 1.5 x SIZE
# over each link and can reach at most 67%.)
t_cpu() {
  local size=${1:-67108864} iters=${OXCCL_CPU_ITERS:-10} rate shape hosts per
  GLOO_PY=${GLOO_PY:-$HOME/.cache/oxccl-anchors/venv/bin/python}
  [ -x "$GLOO_PY" ] || die "GLOO_PY=$GLOO_PY: not found (a python with torch)"
  printf '#%7s %5s %6s %10s %10s %7s %10s %10s %7s %9s %8s %7s %7s\n' rate shape algo "ox us" "ox cpu-s/GB" "ox link%" \
    "gloo us" "gloo cpu-s/GB" "gloo %" "cpu ox/gl" "ox wait%" "ox sys%" "gl sys%"
  for rate in ${OXCCL_CPU_RATES:-2500mbit 10gbit}; do
    RATE=$rate
    local gbps=${rate%mbit}
    if [ "$gbps" != "$rate" ]; then gbps=$(awk "BEGIN{print $gbps / 1000}"); else gbps=${rate%gbit}; fi
    for shape in ${OXCCL_CPU_SHAPES:-2x1 2x2 4x1}; do
      hosts=${shape%x*} per=${shape#*x}
      up "$hosts"
      # (Not in $(...): launch counts ports up in this shell.)
      cpu_oxccl "cpu-$rate-$shape-oxccl" "$hosts" "$per" "$size" "$iters" >"$LOGS/ox.out"
      cpu_gloo "cpu-$rate-$shape-gloo" "$hosts" "$per" "$size" "$iters" >"$LOGS/gloo.out"
      local ox gl
      ox=$(cat "$LOGS/ox.out") gl=$(cat "$LOGS/gloo.out")
      python3 - "$rate" "$shape" "$size" "$gbps" "$ox" "$gl" <<'PY'
import sys
rate, shape, size, gbps, ox, gl = sys.argv[1:]
size, line = int(size), float(gbps) / 8
ot, oc, alg, bus, algo, wait, osys = ox.split()
gt, gc, gsys = map(float, gl.split())
ot, oc, alg, bus, wait, osys = map(float, (ot, oc, alg, bus, wait, osys))
# The kernel's (system) share of each library's CPU time.
sys_share = lambda s, c: f"{s / c * 100:.0f}%" if s >= 0 and c > 0 else "-"
world = eval(shape.replace("x", "*"))
# Share of the ranks' time spent runnable but waiting for a CPU (a shared machine).
waits = f"{wait / (ot * world) * 100:.0f}%" if wait >= 0 else "-"
hosts = int(shape.split("x")[0])
# Bytes each host's link must carry per byte all-reduced (the link bound, see above).
bound = 2 * (hosts - 1) / hosts
link = lambda algbw: algbw * bound / line * 100
per_gb = lambda cpu_us: cpu_us * 1e-6 / (size / 1e9)
print(f" {rate:>7} {shape:>5} {algo:>6} {ot:>10.0f} {per_gb(oc):>10.3f} {link(alg):>7.0f}% "
      f"{gt:>10.0f} {per_gb(gc):>10.3f} {link(size / gt / 1e3):>6.0f}% {oc / gc:>9.2f} {waits:>8} "
      f"{sys_share(osys, oc):>7} {sys_share(gsys, gc):>7}",
      flush=True)
PY
    done
  done
}

# connect [SHAPES]: eager against lazy TCP connection (see the usage above).
t_connect() {
  local shapes=${1:-2x8 4x8} bytes=${OXCCL_CONNECT_BYTES:-65536} rounds=${OXCCL_CONNECT_ROUNDS:-2}
  local bin=${OXCCL_COST_BIN:?set OXCCL_COST_BIN to the tcp_lazy test binary}
  local shape h per round mode coll
  echo "# load: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# shape mode coll round | sockets/rank init first (mean) | to_first_ms max | first_ms rank0 | steady_us median | init's TCP phase ms max | links on first use ms max"
  for shape in $shapes; do
    h=${shape%x*} per=${shape#*x}
    up "$h"
    for ((round = 0; round < rounds; round++)); do
      for coll in all_reduce all_gather broadcast; do
        # Alternated: eager first in even rounds, lazy first in odd ones.
        local modes="eager lazy"
        ((round % 2 == 0)) || modes="lazy eager"
        for mode in $modes; do
          EXTRA_ENV=(OXCCL_TCP_CONNECT=$mode OXCCL_COST_CHILD=$coll:$bytes:30 OXCCL_TIMEOUT=120 OXCCL_DEBUG=debug)
          BIN=$bin LIMIT=300 launch "connect-$shape-$coll-$mode-$round" "$h" "$per" block -- \
            --exact cost_child --ignored --nocapture
          wait_ok
          local costs med tcp_init first_use
          costs=$(cat "$LOGDIR"/rank*.log | grep '^COST ')
          # From the debug lines: init's TCP phase (the port exchange, and under eager every
          # link) and the first call's link making under lazy, the slowest rank's.
          tcp_init=$({ cat "$LOGDIR"/rank*.log | grep 'init phases' || true; } | sed 's/.*shm_us=\([0-9]*\) tcp_us=\([0-9]*\).*/\1 \2/' |
            awk '{ d = ($2 - $1) / 1000; if (d > m) m = d } END { printf "%.1f", m }')
          first_use=$({ cat "$LOGDIR"/rank*.log | grep 'made on first use' | grep ' seq=1 ' || true; } | sed 's/.* us=\([0-9]*\).*/\1/' |
            awk '{ d = $1 / 1000; if (d > m) m = d } END { printf "%.1f", m }')
          med=$(echo "$costs" | awk '{ for (i = 1; i < NF; i++) if ($i == "steady_us") print $(i + 1) }' |
            sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
          echo "$costs" | awk -v tag="$shape $mode $coll $round" -v med="$med" -v ti="$tcp_init" -v fu="$first_use" '
            { for (i = 1; i < NF; i++) v[$i] = $(i + 1)
              n++; si += v["sockets_init"]; sf += v["sockets_first"]
              if (v["to_first_ms"] + 0 > tf) tf = v["to_first_ms"] + 0
              if (v["rank"] == 0) f0 = v["first_ms"] }
            END { printf "%s | %.1f %.1f | %.1f | %.2f | %s | %s | %s\n", tag, si / n, sf / n, tf, f0, med, ti, fu }'
        done
      done
    done
  done
  log "the load after: $(cut -d' ' -f1-3 /proc/loadavg)"
}

t_iperf() {
  up 2
  command -v iperf3 >/dev/null || die "iperf3 not installed"
  ip netns exec "${P}h0" iperf3 -s -1 -D
  sleep 1
  ip netns exec "${P}h1" timeout 30 iperf3 -c "$NET.1" -t 5 ${IPERF_ARGS:-} | tail -8
}

# gloo_run NAME HOSTS PER LO HI: gloo_coll_bench.py, one process per rank, in the namespaces.
gloo_run() {
  local name=$1 hosts=$2 per=$3 lo=$4 hi=$5 world=$(($2 * $3)) r h
  LOGDIR="$LOGS/$name"
  mkdir -p "$LOGDIR"
  PIDS=()
  PORT=$((PORT + 1))
  for ((r = 0; r < world; r++)); do
    h=$((r / per))
    ip netns exec "${P}h$h" env RANK=$r WORLD_SIZE=$world MASTER_ADDR=$NET.1 MASTER_PORT=$PORT \
      GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
      timeout -k 5 900 "$GLOO_PY" "$ANCHORS/gloo_coll_bench.py" "$world" all_reduce "$lo" "$hi" \
      >"$LOGDIR/rank$r.log" 2>&1 &
    PIDS+=($!)
  done
  wait_ok
  grep -v '^\[W' "$LOGDIR/rank0.log" | sed "s/^/[$name] /"
}

# bench [LO HI]: oxccl and gloo side by side, all_reduce float sum, in one run, on 2 hosts x
# 1 rank, 4 x 1 and 2 x 2: 8 B and LO..HI (default 64 MB..256 MB); on 2 x 2 also the flat
# ring at LO. Prints the load average before each shape (the machine may be shared).
t_bench() {
  local lo=${1:-67108864} hi=${2:-268435456}
  GLOO_PY=${GLOO_PY:-$HOME/.cache/oxccl-anchors/venv/bin/python}
  ANCHORS=${ANCHORS:-../shared/anchors}
  EXTRA_ENV=()
  local shape hosts per
  for shape in 2x1 4x1 2x2; do
    hosts=${shape%x*} per=${shape#*x}
    up "$hosts"
    log "$shape: all_reduce float sum, rate $RATE, mtu $MTU, load average $(cut -d' ' -f1-3 /proc/loadavg)"
    LIMIT=600 run "$shape-oxccl" "$hosts" "$per" block -- perf all_reduce -b 8 -e 8 -n 500 -w 50
    LIMIT=600 run "$shape-oxccl" "$hosts" "$per" block -- perf all_reduce -b "$lo" -e "$hi" -f 2 -n 5 -w 2
    if [ "$per" -gt 1 ]; then
      LIMIT=600 run "$shape-oxccl-ring" "$hosts" "$per" block -- perf all_reduce -b "$lo" -e "$lo" -n 5 -w 2 --algo ring
    fi
    if [ -x "$GLOO_PY" ]; then
      gloo_run "$shape-gloo" "$hosts" "$per" 8 8
      gloo_run "$shape-gloo" "$hosts" "$per" "$lo" "$hi"
    else
      echo "(gloo skipped: $GLOO_PY not found; run ../shared/anchors/install.sh)"
    fi
  done
}

cmd=${1:-test}
shift || true
if ! why=$(can_run); then
  echo "cluster.sh: SKIPPED ($why): the emulated cluster needs root and ip netns"
  exit 0
fi
[ "$cmd" = iperf ] || [ "$cmd" = connect ] || [ -x "$BIN" ] || die "$BIN not built (cargo build --release -p oxccl-cli)"
trap cleanup EXIT
trap 'exit 130' INT TERM
case "$cmd" in
test)
  t_correctness
  t_torchrun
  t_cut 2 1
  t_cut 4 1
  t_cut 2 2
  log "cluster tests passed"
  ;;
perf)
  # perf HOSTS PER_HOST [OXCCL_PERF_ARGS...]: one checked run, e.g. `perf 2 2 all_reduce -b 64M`
  up "$1"
  EXTRA_ENV=()
  h=$1 per=$2
  shift 2
  [ -z "${OXCCL_CLUSTER_STATS:-}" ] || stats_begin "$OXCCL_CLUSTER_STATS"
  run "perf-${h}x$per" "$h" "$per" block -- perf "$@"
  [ -z "${OXCCL_CLUSTER_STATS:-}" ] || stats_end "$OXCCL_CLUSTER_STATS"
  ;;
cut) t_cut "${1:-2}" "${2:-1}" ;;
torchrun) t_torchrun ;;
bench) t_bench "$@" ;;
cpu) t_cpu "$@" ;;
iperf) t_iperf ;;
connect) t_connect "$@" ;;
*) die "unknown command $cmd (test, bench, cpu, cut, iperf, connect)" ;;
esac
