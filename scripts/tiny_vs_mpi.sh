#!/bin/bash
# Tiny all_reduce rows of one or more oxccl builds and Open MPI, alternated round by round in
# one run (2 ranks, 8-512 B), then per size: each tool's median and minimum over the rounds and
# the per-round ratio Open MPI / oxccl (median, and in how many rounds oxccl was at or ahead).
# The vCPUs of a VM can change placement every second or so (docs/performance.md,
# docs/perf/tiny_placement.txt), so only many alternations say anything.
#   scripts/tiny_vs_mpi.sh ROUNDS BIN [BIN...]    (needs ../shared/anchors/install.sh)
set -eu
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OXCCL_TUNE_FILE=
A=${OXCCL_ANCHORS:-$HOME/.cache/oxccl-anchors}
rounds=$1; shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  for b in "$@"; do
    printf "%s" "$b"; "$b" perf all_reduce --ranks 2 -b 8 -e 512 -f 4 -d float -o sum 2>/dev/null | awk '/^ *[0-9]/{printf " %s", $7}'; echo
  done
  printf "mpi"; mpirun --oversubscribe -n 2 "$A/mpi_coll_bench" all_reduce 8 512 2>/dev/null | awk '/^ *[0-9]/{printf " %s", $2}'; echo
done | tee "$out"
python3 - "$out" <<'PY'
import statistics as st, sys
d = {}
for line in open(sys.argv[1]):
    f = line.split()
    d.setdefault(f[0], []).append([float(x) for x in f[1:]])
sizes = ["8", "32", "128", "512"]
for name, runs in d.items():
    cols = list(zip(*runs))
    print(f"{name}: " + ", ".join(f"{s} B {st.median(c):.3f} (min {min(c):.2f})" for s, c in zip(sizes, cols)))
m = d.pop("mpi")
for name, runs in d.items():
    for i, s in enumerate(sizes):
        r = [mm[i] / o[i] for o, mm in zip(runs, m)]
        print(f"{name} {s} B: Open MPI / oxccl median {st.median(r):.2f}, oxccl at or ahead in {sum(x >= 1 for x in r)} of {len(r)}")
PY
