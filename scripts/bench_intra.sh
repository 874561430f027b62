#!/usr/bin/env bash
# Intra-host benchmark beside the anchors, in one run per collective: oxccl, Open MPI and gloo
# on the same sizes (../shared/anchors/compare.sh), then a plot of bus bandwidth against size.
# Usage: scripts/bench_intra.sh [OUTDIR]   (default docs/perf; run ../shared/anchors/install.sh first)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/perf}
anchors=${OXCCL_ANCHORS_DIR:-../shared/anchors}
mkdir -p "$out"
cargo build --release -q -p oxccl-cli
ox=target/release/oxccl
# Memory bandwidth of one core in the same run: "half the memcpy bandwidth" targets refer to it.
cargo bench -q -p oxccl --bench reduce -- memcpy 2>/dev/null | tee "$out/memcpy.txt"
for coll in all_reduce all_gather reduce_scatter broadcast; do
  bash "$anchors/compare.sh" "$ox" "$coll" 2 8 134217728 | tee "$out/$coll-2.txt"
done
# The anchors have no reduce row: scripts/anchors/compare_reduce.sh runs MPI_Reduce beside it.
bash scripts/anchors/compare_reduce.sh "$ox" 2 8 134217728 | tee "$out/reduce-2.txt"
# Shared buffers (`Communicator::alloc_shared`, `oxccl perf -R 1`): peers reach each other's
# buffers with loads and stores. Same anchors (their buffers are private), large sizes.
mkdir -p "$out/shared"
for coll in all_reduce all_gather reduce_scatter broadcast; do
  OXCCL_PERF_REGISTER=1 bash "$anchors/compare.sh" "$ox" "$coll" 2 32768 134217728 | tee "$out/shared/$coll-2.txt"
done
OXCCL_PERF_REGISTER=1 bash scripts/anchors/compare_reduce.sh "$ox" 2 32768 134217728 | tee "$out/shared/reduce-2.txt"
for n in 4 8; do
  bash "$anchors/compare.sh" "$ox" all_reduce "$n" 8 33554432 | tee "$out/all_reduce-$n.txt"
done
py=.venv/bin/python
[ -x "$py" ] || py=python3
"$py" -c "import matplotlib" 2>/dev/null || "$py" -m pip install -q matplotlib
"$py" scripts/plot_perf.py "$out"
