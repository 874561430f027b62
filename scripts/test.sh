#!/usr/bin/env bash
# Runs every check and test of oxccl on a fresh machine: formatting, clippy (warnings are
# errors), the library's unit and in-process tests, and the multi-process tests (every
# collective over shared memory and TCP with 1-8 ranks, launched by `oxccl run`), then the
# emulated cluster (scripts/cluster.sh: hosts as network namespaces joined by 10 Gbit/s
# links; it runs as root where `ip netns` works and says why it skipped elsewhere), then the
# Python package and its torch backend (pytest, in a virtual environment at .venv).
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

# The Python package and the torch backend: a virtual environment with torch, numpy, pytest
# and maturin from PyPI (CPU is enough), the extension built in release mode, then pytest.
echo "== python: fmt, clippy"
cargo fmt --manifest-path python/Cargo.toml -- --check
cargo clippy --manifest-path python/Cargo.toml --all-targets -- -D warnings
echo "== python: venv with torch, numpy, pytest, maturin, setuptools (for the C++ torch backend)"
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
if ! .venv/bin/python -c "import torch, numpy, pytest, maturin, setuptools" 2>/dev/null; then
  .venv/bin/pip install -q torch numpy pytest maturin setuptools
fi
echo "== python: build (maturin develop --release)"
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" maturin develop --release -q -m python/Cargo.toml
echo "== python: the C++ torch backend (python -m oxccl.build_torch_ext)"
.venv/bin/python -m oxccl.build_torch_ext
echo "== python: pytest"
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider python/tests
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"
