#!/usr/bin/env bash
# The checks and tests of oxccl, in tiers. Each tier is one command; several can be given
# together (`./scripts/test.sh fast procs`); with none, the tiers CI runs (.ci/run): fast,
# procs, cluster, torch, frameworks, in that order.
#
#   ./scripts/test.sh fast     formatting, clippy (warnings are errors), the library's unit
#                              tests, doc tests and the in-process test binaries (ranks as
#                              threads): a few minutes
#   ./scripts/test.sh procs    the multi-process Rust tests (rank processes launched by the
#                              tests or by `oxccl run`; the PROCS_TESTS binaries below)
#   ./scripts/test.sh cluster  the emulated cluster (scripts/cluster.sh test: hosts as network
#                              namespaces joined by 10 Gbit/s links); needs root for
#                              `ip netns`, and says why it skipped elsewhere
#   ./scripts/test.sh torch    the Python package and its torch backend: a virtual environment
#                              at .venv, the extension built in release mode, pytest, then
#                              PyTorch's own distributed suite (scripts/torch_suite.sh)
#   ./scripts/test.sh frameworks  Lightning, DeepSpeed (ZeRO 1-3), the HF Trainer and Ray Train
#                              over oxccl against gloo (installed into .venv from PyPI), and the
#                              launchers (scripts/launchers.sh: mpirun, torchrun, and as root
#                              a Slurm this tier installs from Debian and starts)
#   ./scripts/test.sh stress   not run by CI: the loom models (scripts/loom.sh), the tests that
#                              need a race to happen (`#[ignore]`d tests named `stress_*`,
#                              retried until they see it), the fuzz smoke test and the long
#                              kill and soak loops at their full counts (OXCCL_STRESS=1, read by
#                              the tests), the exit loop (scripts/exit_loop.sh) at
#                              EXIT_LOOP_RUNS runs (default 1000), and the torch property test
#                              and the allocator, form and p2p tests under AddressSanitizer,
#                              glibc's malloc checks and a guard allocator that makes freed
#                              memory inaccessible (scripts/sanitize_torch.sh: SANITIZE_CALLS
#                              calls per case, default 10000, for SANITIZE_SEEDS random seeds,
#                              default 3, and one fixed seed); hours on a 2-core machine
#
# No test here depends on the machine being quiet: wall-clock bounds are at least ten times
# what they measure on a quiet machine, and loops that need many random rounds to find a rare
# case run a few rounds in the normal tiers and their full count in the stress tier.
#
# A failing step ends its tier (the tests all run first: cargo's --no-fail-fast, and the fast
# tier's doc tests after its other tests), and the next tier runs. A summary ends the output,
# each tier's result and time, and last a line `tiers: N passed, N failed`; the exit status is
# 1 when any tier failed.
#
# Installs what it needs (the Rust components rustfmt and clippy; torch, numpy, pytest and
# maturin from PyPI into .venv) if they are missing. Disk: a clean run needs about 10 GB (the
# Rust build ~3 GB, torch with its CUDA libraries ~6 GB installed).
set -euo pipefail
cd "$(dirname "$0")/.."

# No incremental build artefacts (a clean clone never reuses them).
export CARGO_INCREMENTAL=0
# The tests' choices of algorithm are the built-in ones, not those `oxccl tune` saved on this
# machine (~/.cache/oxccl/tune.conf): a tune run under load once set cma_min past every
# size and processes.rs's shared-buffer tests failed. Tests of the tune file set their own.
export OXCCL_TUNE_FILE=

# The test binaries (crates/*/tests/*.rs, examples/tests/*.rs) whose tests start rank
# processes: the procs tier. Every other test binary runs in the fast tier (a new one that
# starts processes belongs here).
PROCS_TESTS=(
  exits flight_torch hostile kills shm_budget shm_process startup tcp_lazy
  c_example
  faults inject inputs processes sim status
  examples
)
# The procs tier's binaries with long random loops, run again with OXCCL_STRESS=1 (their full
# counts) by the stress tier.
STRESS_LOOPS=(kills startup faults processes)

ALL_TIERS=(fast procs cluster torch frameworks stress)
DEFAULT_TIERS=(fast procs cluster torch frameworks)
# The pytest files of the frameworks tier (the torch tier runs every other one).
FRAMEWORK_TESTS=(test_lightning.py test_deepspeed.py test_hf_trainer.py test_ray_train.py)

free_gb() { df -Pk . | awk 'NR==2 {printf "%d", $4 / 1048576}'; }

# The in-process test binaries: every test file that PROCS_TESTS does not name.
fast_tests() {
  local f name p skip
  for f in crates/*/tests/*.rs examples/tests/*.rs; do
    name=$(basename "$f" .rs)
    skip=0
    for p in "${PROCS_TESTS[@]}"; do [ "$p" = "$name" ] && skip=1; done
    [ "$skip" = 1 ] || echo "$name"
  done
}

# `--test NAME` for each name given.
test_args() {
  local t
  for t in "$@"; do printf -- '--test\n%s\n' "$t"; done
}

tier_fast() {
  if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
    if command -v rustup >/dev/null; then rustup component add rustfmt clippy; fi
  fi
  echo "== cargo fmt --check"
  cargo fmt --all -- --check
  echo "== cargo clippy -D warnings"
  cargo clippy --workspace --all-targets --locked -- -D warnings
  local fast
  mapfile -t fast < <(fast_tests)
  echo "== cargo test: unit tests and the in-process test binaries (${fast[*]})"
  local args
  mapfile -t args < <(test_args "${fast[@]}")
  # Unit, in-process and doc tests all run before the tier reports a failure.
  local rc=0
  cargo test --workspace --locked --no-fail-fast --lib --bins "${args[@]}" -- --test-threads=2 || rc=$?
  echo "== cargo test --doc"
  cargo test --workspace --locked --no-fail-fast --doc -- --test-threads=2 || rc=$?
  return "$rc"
}

tier_procs() {
  echo "== cargo test: the multi-process test binaries (${PROCS_TESTS[*]})"
  local args
  mapfile -t args < <(test_args "${PROCS_TESTS[@]}")
  # Tests start up to 8 rank processes each: one test at a time per binary, two binaries'
  # worth of ranks at most, so that oversubscription stays bounded on small machines.
  cargo test --workspace --locked --no-fail-fast "${args[@]}" -- --test-threads=2
}

tier_cluster() {
  echo "== emulated cluster (scripts/cluster.sh test)"
  if [ "$(id -u)" = 0 ]; then
    cargo build --release --locked -p oxccl-cli
  fi
  ./scripts/cluster.sh test
}

# The virtual environment with torch, numpy, pytest and maturin from PyPI (CPU is enough),
# the extension built in release mode and the C++ torch backend: what the torch tier and the
# stress tier's exit loop run on.
python_env() {
  echo "== python: venv with torch, numpy, pytest, maturin, setuptools (for the C++ torch backend), expecttest (torch's test suite)"
  # Each step's failure is returned (`set -e` does not hold where this runs as a condition).
  if [ ! -x .venv/bin/python ]; then python3 -m venv .venv || return 1; fi
  if ! .venv/bin/python -c "import torch, numpy, pytest, maturin, setuptools, expecttest" 2>/dev/null; then
    # torch with its CUDA libraries takes ~6 GB installed, and pip unpacks the wheels first:
    # on a machine short of disk, drop the Rust debug build (rebuilt by the next Rust tier)
    # before installing.
    if [ "$(free_gb)" -lt 14 ] && [ -d target/debug ]; then
      echo "== disk: $(free_gb) GB free: removing target/debug to make room for torch"
      rm -rf target/debug
    fi
    echo "== disk: $(free_gb) GB free before pip install"
    # pip unpacks into TMPDIR: keep it on this disk (a small /tmp must not fail the install).
    mkdir -p target/pip-tmp
    if ! TMPDIR="$PWD/target/pip-tmp" .venv/bin/pip install -q --no-cache-dir torch numpy pytest maturin setuptools expecttest; then
      echo "pip install failed; disk now: $(free_gb) GB free on $(df -P . | awk 'NR==2 {print $6}') (torch needs ~6 GB installed + ~3.5 GB while unpacking)" >&2
      return 1
    fi
    rm -rf target/pip-tmp
  fi
  echo "== python: build (maturin develop --release)"
  VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" maturin develop --release -q -m python/Cargo.toml ||
    return 1
  echo "== python: the C++ torch backend (python -m oxccl.build_torch_ext)"
  .venv/bin/python -m oxccl.build_torch_ext || return 1
}

tier_torch() {
  echo "== python: fmt, clippy"
  cargo fmt --manifest-path python/Cargo.toml -- --check
  cargo clippy --manifest-path python/Cargo.toml --all-targets -- -D warnings
  python_env
  echo "== python: pytest"
  local rc=0 suite_rc=0
  local ignore=() f
  for f in "${FRAMEWORK_TESTS[@]}"; do ignore+=(--ignore "python/tests/$f"); done
  .venv/bin/python -m pytest -q -p no:cacheprovider "${ignore[@]}" python/tests || rc=$?
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests" >&2; fi
  echo "== python: PyTorch's own distributed test suite against oxccl (scripts/torch_suite.sh)"
  ./scripts/torch_suite.sh || suite_rc=$?
  if [ "$rc" -ne 0 ]; then return "$rc"; fi
  return "$suite_rc"
}

tier_frameworks() {
  python_env
  echo "== frameworks: lightning, deepspeed, transformers, accelerate, ray[train] (PyPI)"
  if ! .venv/bin/python -c "import lightning, deepspeed, transformers, accelerate, ray.train" 2>/dev/null; then
    mkdir -p target/pip-tmp
    TMPDIR="$PWD/target/pip-tmp" .venv/bin/pip install -q --no-cache-dir \
      lightning deepspeed transformers accelerate "ray[train]"
    rm -rf target/pip-tmp
  fi
  # DeepSpeed compiles its CPU shared-memory op at init_distributed whatever the backend
  # (minutes, once; torch caches it): compiled here so that no test's timeout includes it.
  echo "== frameworks: DeepSpeed's CPU op, built once"
  DS_ACCELERATOR=cpu PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -c \
    "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
  if [ "$(id -u)" = 0 ] && ! command -v slurmctld >/dev/null; then
    echo "== frameworks: Slurm from Debian (slurmd, slurmctld, slurm-client)"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmd slurmctld slurm-client >/dev/null; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends slurmd slurmctld slurm-client >/dev/null
    fi
  fi
  if [ "$(id -u)" = 0 ] && ! command -v mpirun >/dev/null; then
    echo "== frameworks: Open MPI from Debian"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin >/dev/null
  fi
  echo "== frameworks: pytest (${FRAMEWORK_TESTS[*]})"
  local rc=0 args=() f
  for f in "${FRAMEWORK_TESTS[@]}"; do args+=("python/tests/$f"); done
  .venv/bin/python -m pytest -q -p no:cacheprovider -rs "${args[@]}" || rc=$?
  echo "== frameworks: launchers (scripts/launchers.sh)"
  cargo build --release --locked -p oxccl-cli
  PYTHON=.venv/bin/python ./scripts/launchers.sh || rc=$?
  return "$rc"
}

tier_stress() {
  # Each step runs even when one before it failed; the tier fails if any did.
  local failed=()
  export OXCCL_STRESS=1
  echo "== stress: loom models (scripts/loom.sh)"
  ./scripts/loom.sh || failed+=(loom)
  echo "== stress: tests that need a race to happen (ignored tests named stress_*)"
  cargo test --workspace --locked --lib --bins -- --ignored stress_ --test-threads=1 --nocapture ||
    failed+=(races)
  echo "== stress: fuzz smoke at its full count"
  cargo test --workspace --locked --test fuzz_smoke || failed+=(fuzz_smoke)
  echo "== stress: kill and soak loops at their full counts (${STRESS_LOOPS[*]})"
  local args
  mapfile -t args < <(test_args "${STRESS_LOOPS[@]}")
  cargo test --workspace --locked --no-fail-fast "${args[@]}" -- --test-threads=1 || failed+=(loops)
  echo "== stress: exit loop (scripts/exit_loop.sh ${EXIT_LOOP_RUNS:-1000})"
  if python_env; then
    ./scripts/exit_loop.sh "${EXIT_LOOP_RUNS:-1000}" || failed+=(exit_loop)
    echo "== stress: the torch backend under ASan and glibc's malloc checks" \
      "(scripts/sanitize_torch.sh ${SANITIZE_CALLS:-10000} ${SANITIZE_SEEDS:-3})"
    ./scripts/sanitize_torch.sh "${SANITIZE_CALLS:-10000}" "${SANITIZE_SEEDS:-3}" || failed+=(sanitize)
  else
    failed+=(python_env)
  fi
  if [ "${#failed[@]}" -ne 0 ]; then
    echo "stress: failed: ${failed[*]}" >&2
    return 1
  fi
}

tiers=("$@")
if [ "${#tiers[@]}" -eq 0 ]; then tiers=("${DEFAULT_TIERS[@]}"); fi
for t in "${tiers[@]}"; do
  case " ${ALL_TIERS[*]} " in
    *" $t "*) ;;
    *)
      echo "usage: $0 [${ALL_TIERS[*]// /|}]... (no tier: ${DEFAULT_TIERS[*]})" >&2
      exit 2
      ;;
  esac
done

echo "== disk: $(free_gb) GB free on $(df -P . | awk 'NR==2 {print $6}'); tiers: ${tiers[*]}"
summary=()
passed=0
failed=0
for t in "${tiers[@]}"; do
  echo "==== tier $t"
  start=$SECONDS
  # A subshell outside any condition, so that `set -e` holds inside it: a failing step ends
  # the tier (not the script), and the next tier runs.
  set +e
  (
    set -euo pipefail
    "tier_$t"
  )
  rc=$?
  set -e
  took=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    summary+=("$(printf '%-8s passed  %4dm%02ds' "$t" $((took / 60)) $((took % 60)))")
  else
    failed=$((failed + 1))
    summary+=("$(printf '%-8s FAILED  %4dm%02ds (exit status %d)' "$t" $((took / 60)) $((took % 60)) "$rc")")
  fi
  echo "==== tier $t: exit status $rc after ${took} s"
done
echo "==== summary"
printf '%s\n' "${summary[@]}"
echo "tiers: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
