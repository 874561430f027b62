#!/usr/bin/env bash
# The long sweep of crates/oxccl/tests/kills.rs: every case of a rank SIGKILLed or SIGSTOPped
# mid-call (one-shot, ring, single-copy, hierarchical, TCP eager and lazy, split/destroy) and
# during the start-up, N rounds each with a random victim, signal and delay. Every survivor
# must fail naming the lost rank within seconds, a stopped rank continued must fail too, and
# nothing may stay in /dev/shm; the failures are listed at the end (exit status 1).
#
#   scripts/kill_loop.sh 50          # about 50 x 1.5 minutes on a loaded 2-core machine
#
# (test.sh runs one round of each.)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: scripts/kill_loop.sh ROUNDS}
export CARGO_INCREMENTAL=0
OXCCL_KILL_SWEEP="$N" cargo test --release -p oxccl --test kills -- --test-threads=1 --nocapture
