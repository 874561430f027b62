#!/bin/bash
# Tiny all_reduce rows of one or more oxccl builds and Open MPI, alternated round by round in
# one run (2 ranks, 8-512 B), then per size: each tool's median and minimum over the rounds and
# the per-round ratio Open MPI / oxccl (median, and in how many rounds oxccl was at or ahead).
# The vCPUs of a VM can change placement every second or so (docs/performance.md,
# docs/perf/tiny_placement.txt), so only many alternations say anything.
#   scripts/tiny_vs_mpi.sh ROUNDS BIN [BIN...]    (needs ../shared/anchors/install.sh)
# With TINY_FLOOR=1, each round first runs the protocol's floor without the library
# (scripts/tiny_floor.c, built into target/tiny_floor: an 8-byte exchange of two pinned
# processes, the mean in ns) and the summary is given per placement: "near" rounds, whose
# floor is under TINY_FAR_NS (default 150), and "far" ones.
set -eu
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OXCCL_TUNE_FILE=
A=${OXCCL_ANCHORS:-$HOME/.cache/oxccl-anchors}
rounds=$1; shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
floor=
if [ "${TINY_FLOOR:-0}" = 1 ]; then
  floor=target/tiny_floor
  gcc -O2 -march=native -pthread "$(dirname "$0")/tiny_floor.c" -o "$floor"
fi
for r in $(seq 1 "$rounds"); do
  if [ -n "$floor" ]; then "$floor" 8 1 | awk '{print "floor", $2}'; fi
  for b in "$@"; do
    printf "%s" "$b"; "$b" perf all_reduce --ranks 2 -b 8 -e 512 -f 4 -d float -o sum 2>/dev/null | awk '/^ *[0-9]/{printf " %s", $7}'; echo
  done
  printf "mpi"; mpirun --oversubscribe -n 2 "$A/mpi_coll_bench" all_reduce 8 512 2>/dev/null | awk '/^ *[0-9]/{printf " %s", $2}'; echo
done | tee "$out"
python3 - "$out" "${TINY_FAR_NS:-150}" <<'PY'
import statistics as st, sys
rounds, cur = [], None
for line in open(sys.argv[1]):
    f = line.split()
    if f[0] == "floor" or cur is None or f[0] in cur["runs"]:
        cur = {"floor": None, "runs": {}}
        rounds.append(cur)
    if f[0] == "floor":
        cur["floor"] = float(f[1])
    else:
        cur["runs"][f[0]] = [float(x) for x in f[1:]]
sizes = ["8", "32", "128", "512"]
far_ns = float(sys.argv[2])
groups = [("", rounds)]
if all(r["floor"] is not None for r in rounds):
    groups = [(f"near (floor < {far_ns:g} ns), ", [r for r in rounds if r["floor"] < far_ns]),
              (f"far (floor >= {far_ns:g} ns), ", [r for r in rounds if r["floor"] >= far_ns])]
    fl = sorted(r["floor"] for r in rounds)
    print(f"floor: {len(rounds)} rounds, {fl[0]:g}-{fl[-1]:g} ns")
for label, rs in groups:
    if not rs:
        print(f"{label}no rounds")
        continue
    names = [n for n in rs[0]["runs"]]
    for name in names:
        cols = list(zip(*[r["runs"][name] for r in rs]))
        print(f"{label}{name}: " + ", ".join(f"{s} B {st.median(c):.3f} (min {min(c):.2f})" for s, c in zip(sizes, cols)))
    for name in names:
        if name == "mpi":
            continue
        for i, s in enumerate(sizes):
            q = [r["runs"]["mpi"][i] / r["runs"][name][i] for r in rs]
            print(f"{label}{name} {s} B: Open MPI / oxccl median {st.median(q):.2f}, "
                  f"oxccl at or ahead in {sum(x >= 1 for x in q)} of {len(q)}")
PY
