#!/usr/bin/env bash
# Runs the fuzz targets for a bounded time each.
#
#   fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 60 s, every target)
#
# With a nightly toolchain and cargo-fuzz installed this is `cargo fuzz run TARGET --
# -max_total_time=SECONDS` (AddressSanitizer on). On stable it builds the same libFuzzer
# targets with the coverage instrumentation that cargo-fuzz uses, minus the sanitizer
# (`-Zsanitizer` is nightly-only; debug assertions and overflow checks stay on), and runs
# them with libFuzzer directly. Corpora grow in fuzz/corpus/TARGET, crashes land in
# fuzz/artifacts/TARGET; the script fails if any target crashes.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(call_header control_frame rendezvous_messages handshake)
fi
if rustc --version | grep -q nightly && cargo fuzz --version >/dev/null 2>&1; then
  for t in "${targets[@]}"; do
    cargo fuzz run "$t" -- -max_total_time="$secs"
  done
  exit 0
fi
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module \
  -Cllvm-args=-sanitizer-coverage-level=4 \
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
  -Cllvm-args=-sanitizer-coverage-pc-table \
  -Cllvm-args=-sanitizer-coverage-trace-compares"
# An explicit --target keeps the instrumentation off build scripts and proc macros.
host=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --bins --target "$host" -j "${FUZZ_JOBS:-2}"
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  echo "== $t: ${secs}s"
  "./target/$host/release/$t" "corpus/$t" -max_total_time="$secs" -rss_limit_mb=2048 \
    -max_len=65536 -artifact_prefix="artifacts/$t/" -print_final_stats=1
done
