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

# Disk: a clean run needs about 10 GB (the Rust build ~3 GB, torch from PyPI with its CUDA
# libraries ~6 GB installed). No incremental build artefacts (a clean clone never reuses them).
export CARGO_INCREMENTAL=0
# The tests' choices of algorithm are the built-in ones, not those `oxccl tune` saved on this
# machine (~/.cache/oxccl/tune.conf): a tune run under load once set cma_min past every
# size and processes.rs's shared-buffer tests failed. Tests of the tune file set their own.
export OXCCL_TUNE_FILE=
free_gb() { df -Pk . | awk 'NR==2 {printf "%d", $4 / 1048576}'; }
echo "== disk: $(free_gb) GB free on $(df -P . | awk 'NR==2 {print $6}')"

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
echo "== python: venv with torch, numpy, pytest, maturin, setuptools (for the C++ torch backend), expecttest (torch's test suite)"
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
if ! .venv/bin/python -c "import torch, numpy, pytest, maturin, setuptools, expecttest" 2>/dev/null; then
  # torch with its CUDA libraries takes ~6 GB installed, and pip unpacks the wheels first: on
  # a machine short of disk, drop the Rust debug build (its tests have run) before installing.
  if [ "$(free_gb)" -lt 14 ] && [ -d target/debug ]; then
    echo "== disk: $(free_gb) GB free: removing target/debug (the Rust tests are done) to make room for torch"
    rm -rf target/debug
  fi
  echo "== disk: $(free_gb) GB free before pip install"
  # pip unpacks into TMPDIR: keep it on this disk (a small /tmp must not fail the install).
  mkdir -p target/pip-tmp
  if ! TMPDIR="$PWD/target/pip-tmp" .venv/bin/pip install -q --no-cache-dir torch numpy pytest maturin setuptools expecttest; then
    echo "pip install failed; disk now: $(free_gb) GB free on $(df -P . | awk 'NR==2 {print $6}') (torch needs ~6 GB installed + ~3.5 GB while unpacking)" >&2
    exit 1
  fi
  rm -rf target/pip-tmp
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
echo "== python: PyTorch's own distributed test suite against oxccl (scripts/torch_suite.sh)"
suite_rc=0
./scripts/torch_suite.sh || suite_rc=$?
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
exit "$suite_rc"
