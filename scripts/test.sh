#!/usr/bin/env bash
# Runs every check and test of oxccl on a fresh machine: formatting, clippy (warnings are
# errors), the library's unit and in-process tests, and the multi-process tests (every
# collective over shared memory and TCP with 1-8 ranks, launched by `oxccl run`), then the
# emulated cluster (scripts/cluster.sh: hosts as network namespaces joined by 10 Gbit/s
# links; it runs as root where `ip netns` works and says why it skipped elsewhere).
# Installs what it needs (the Rust components rustfmt and clippy) if they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  if command -v rustup >/dev/null; then rustup component add rustfmt clippy; fi
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test"
# Tests start up to 8 rank processes each: run test binaries one test at a time per binary
# so that oversubscription stays bounded on small machines.
cargo test --workspace --locked -- --test-threads=2
echo "== emulated cluster (scripts/cluster.sh test)"
if [ "$(id -u)" = 0 ]; then
  cargo build --release --locked -p oxccl-cli
fi
./scripts/cluster.sh test
