#!/usr/bin/env bash
# The loom models of the lock-free shared-memory ring (every interleaving of producer and
# consumer within loom's bounds: wrap with partial consumes, exact fill, a ring shrunk to the
# budget while it is read). Run by `scripts/test.sh stress`, not by CI: the library builds
# once more under `--cfg loom` (about 8 minutes on 2 cores), in target/loom. Extra arguments go to the test
# binary (e.g. a test name).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_INCREMENTAL=0
RUSTFLAGS="--cfg loom" cargo test -p oxccl --lib --release --locked --target-dir target/loom loom_ -- --test-threads=2 "$@"
