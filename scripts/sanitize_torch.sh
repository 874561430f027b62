#!/usr/bin/env bash
# The torch backend under memory-error detectors: the property test
# (python/tests/test_torch_property.py: random torch.distributed calls on oxccl and gloo,
# compared) and the tests of the shared-memory allocator, of the call forms and of
# point-to-point calls, with
#
#   asan    the C++ backend built with AddressSanitizer (OXCCL_TORCH_EXT_SANITIZE=address, into
#           a cache of its own under target/: the normal build is left as it is) and the Rust
#           library (the Python extension) built with it too (-Zsanitizer=address, which this
#           stable toolchain takes under RUSTC_BOOTSTRAP=1; into target/asan-rs, loaded from a
#           copy of the package in target/asan-py put first on PYTHONPATH), ASan's runtime
#           preloaded into every process, so that its allocator serves every malloc of the
#           process (torch's, the Rust library's) and its checks cover the C++ backend, the
#           Rust library's own code (not std) and every memcpy/memset;
#   malloc  the normal build with glibc's heap checks: its own (they abort with "malloc(): ..."
#           or "free(): ..." on damaged heap metadata), libc_malloc_debug.so.0 with
#           MALLOC_CHECK_=3 (which glibc may leave off in a process whose libc allocated before
#           the library's start: python's does), and MALLOC_PERTURB_ (memory overwritten at
#           malloc and free, so that a use after free reads garbage the comparison with gloo
#           sees);
#   guard   scripts/guard_malloc.c, built into target/guard and preloaded: every allocation of
#           16 bytes or more gets pages of its own, ending against an inaccessible page, and
#           freed ones are made inaccessible (a quarantine of the last 20,000 frees). A use
#           after free or an overrun by any code of the rank (Rust, torch and gloo, which the
#           ASan build does not instrument) faults where it happens, and a peer's cross-memory
#           write into (or read of) freed memory, which no sanitizer of this process can see,
#           fails in the peer with EFAULT ("Bad address"). It raises vm.max_map_count as root
#           (each allocation is a mapping; torch's import alone makes 650,000), else guards
#           only allocations of 1 KiB or more. Its property runs are made twice, the second
#           with the shared-memory allocator off (OXCCL_TORCH_ALLOCATOR=0): the tensors are then
#           private heap memory, which peers write into with process_vm_writev.
#
#   scripts/sanitize_torch.sh [CALLS] [SEEDS]   # defaults: 10000 calls, 3 random seeds
#
# Each seed runs the property test's two cases (2 and 3 ranks) for CALLS calls each, under
# each tool; one more seed, 847752098 (where a rank once died with "malloc(): unaligned tcache
# chunk detected"), runs first. A run fails on a failing test, or on any report of the tools
# (ASan's report files, glibc's "malloc(): ..." or "free(): ..." messages in the output) even
# where the test passed; a failure prints the tool, the seed, each rank's last call (the
# property test's trace, OXCCL_PROP_TRACE) and the report. Logs stay under $LOG_DIR. Nothing
# here depends on timing: the ranks' calls are bounded by the tests' own timeouts.
#
# Needs the venv and the normal build that scripts/test.sh's python_env makes (.venv, the
# extension built, the C++ backend built); PYTHON overrides the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
CALLS=${1:-10000}
NSEEDS=${2:-3}
PY=${PYTHON:-.venv/bin/python}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/oxccl-sanitize.XXXXXX)}
mkdir -p "$LOG_DIR"
LIBASAN=$(gcc -print-file-name=libasan.so)
# Preloaded with ASan's runtime: its __cxa_throw interceptor finds the real one only in a
# library loaded at its start (python does not link libstdc++; without it, the first C++
# exception aborts the process with "CHECK failed ... real___cxa_throw").
LIBSTDCXX=$(gcc -print-file-name=libstdc++.so)
MALLOC_DEBUG=$(gcc -print-file-name=libc_malloc_debug.so.0)
if [ ! -e "$MALLOC_DEBUG" ]; then
  MALLOC_DEBUG=$(ldconfig -p | awk '/libc_malloc_debug.so.0/ {print $NF; exit}')
fi
ASAN_DIR=$PWD/target/torch-ext-asan
ASAN_PY=$PWD/target/asan-py
GUARD_SO=$PWD/target/guard/guard_malloc.so
GUARD_MIN=16
if [ "$(cat /proc/sys/vm/max_map_count)" -lt 4000000 ] && ! sysctl -q -w vm.max_map_count=4000000 2>/dev/null; then
  GUARD_MIN=1024
fi
# glibc prints its heap errors to the terminal unless told otherwise: into the ranks' output.
export LIBC_FATAL_STDERR_=1 OXCCL_TORCH_EXT_BUILD=0
# The tools slow the ranks down, and a loaded machine stalls them: a rank silent past the
# default heartbeat deadline (1.5 s) would be reported lost. This step looks for memory
# errors, not for lost peers: the deadline is far above any stall.
export OXCCL_HEARTBEAT_TIMEOUT=600
failed=()

echo "== sanitize: the C++ torch backend built with ASan into $ASAN_DIR (logs: $LOG_DIR)"
# Built when the cache holds no usable build (as `import oxccl.torch` would), with a failed
# build's record removed first: this step retries it.
rm -f "$ASAN_DIR"/*/build-failed.log
if ! OXCCL_TORCH_EXT_SANITIZE=address OXCCL_TORCH_EXT_DIR=$ASAN_DIR OXCCL_TORCH_EXT_BUILD=1 "$PY" -c \
  'from oxccl.build_torch_ext import find_or_build; print("   " + find_or_build())'; then
  echo "sanitize: the ASan build failed" >&2
  exit 1
fi

echo "== sanitize: the Rust library built with ASan into target/asan-rs, as the package in $ASAN_PY"
# --target: only the library is instrumented, not build scripts and proc macros (they would
# need the runtime at build time).
if ! RUSTC_BOOTSTRAP=1 RUSTFLAGS="-Zsanitizer=address" CARGO_TARGET_DIR="$PWD/target/asan-rs" \
  cargo build -q --release --target x86_64-unknown-linux-gnu --manifest-path python/Cargo.toml; then
  echo "sanitize: the Rust library's ASan build failed" >&2
  exit 1
fi
rm -rf "$ASAN_PY"
mkdir -p "$ASAN_PY/oxccl"
for f in python/oxccl/*; do
  case $(basename "$f") in _oxccl*.so | __pycache__) ;; *) ln -s "$PWD/$f" "$ASAN_PY/oxccl/" ;; esac
done
cp target/asan-rs/x86_64-unknown-linux-gnu/release/lib_oxccl.so "$ASAN_PY/oxccl/_oxccl.abi3.so"
# (Read whole first: `grep -q` would end the pipe early, and pipefail would count nm's SIGPIPE.)
if [[ "$(nm -D "$ASAN_PY/oxccl/_oxccl.abi3.so")" != *" U __asan_init"* ]]; then
  echo "sanitize: the Rust library's ASan build is not instrumented (no __asan_init import)" >&2
  exit 1
fi

echo "== sanitize: the guard allocator built into $GUARD_SO (allocations of $GUARD_MIN bytes and up)"
mkdir -p "$(dirname "$GUARD_SO")"
if ! gcc -O2 -Wall -shared -fPIC -o "$GUARD_SO" scripts/guard_malloc.c -ldl -lpthread; then
  echo "sanitize: the guard allocator's build failed" >&2
  exit 1
fi

# The environment of one tool, as `env` arguments, into the array `tool_env`.
set_tool_env() {
  case $1 in
    asan)
      tool_env=(LD_PRELOAD="$LIBASAN $LIBSTDCXX" OXCCL_TORCH_EXT_SANITIZE=address OXCCL_TORCH_EXT_DIR="$ASAN_DIR"
        PYTHONPATH="$ASAN_PY${PYTHONPATH:+:$PYTHONPATH}"
        ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$2/asan:print_legend=0")
      ;;
    malloc)
      tool_env=(LD_PRELOAD="$MALLOC_DEBUG" MALLOC_CHECK_=3 MALLOC_PERTURB_=165)
      ;;
    guard)
      # faulthandler: a rank's fault prints where it was.
      tool_env=(LD_PRELOAD="$GUARD_SO" GUARD_MALLOC_MIN=$GUARD_MIN PYTHONFAULTHANDLER=1)
      ;;
  esac
}

# The tools' reports in directory $1 and log $2: ASan's files (the first three, each cut to
# its first 40 lines; all are kept in $1), glibc's messages.
reports() {
  local f shown=0
  for f in "$1"/asan.*; do
    [ -e "$f" ] || continue
    shown=$((shown + 1))
    if [ "$shown" -le 3 ]; then
      echo "--- $f"
      head -n 40 "$f"
    else
      echo "--- $f (not shown)"
    fi
  done
  grep -E -n -m 20 "AddressSanitizer|malloc\(\)|free\(\)|double free|corrupted (size|double-linked)|memory corruption|tcache|malloc_consolidate|munmap_chunk|realloc\(\)|Segmentation fault|Bad address" "$2"
}

# Runs `pytest ARGS...` under tool $1 with name $2 (its logs in $LOG_DIR/$2); extra env after --.
run_one() {
  local tool=$1 name=$2
  shift 2
  local dir=$LOG_DIR/$name extra=()
  while [ "$#" -gt 0 ] && [ "$1" != -- ]; do extra+=("$1"); shift; done
  shift
  mkdir -p "$dir"
  set_tool_env "$tool" "$dir"
  local start=$SECONDS rc=0
  env "${tool_env[@]}" "${extra[@]}" OXCCL_PROP_TRACE="$dir/trace" \
    "$PY" -m pytest -q -p no:cacheprovider "$@" >"$dir/pytest.log" 2>&1 || rc=$?
  local found
  found=$(reports "$dir" "$dir/pytest.log")
  if [ "$rc" -ne 0 ] || [ -n "$found" ]; then
    failed+=("$name")
    echo "sanitize: FAILED: $name (tool $tool, pytest exit status $rc${found:+, a report of the tool})" >&2
    local t
    for t in "$dir"/trace.*; do
      [ -e "$t" ] && echo "  last call begun: $(tail -n 1 "$t")" >&2
    done
    if [ -n "$found" ]; then echo "$found" >&2; fi
    grep -E "FAILED|rank [0-9]+: seed|Error" "$dir/pytest.log" | head -n 20 >&2
    echo "  full output: $dir/pytest.log" >&2
  else
    echo "   $name: ok ($((SECONDS - start)) s)"
  fi
}

# Checks, under tool $1, that the ranks will load the C++ backend meant for it.
check_backend() {
  set_tool_env "$1" "$LOG_DIR"
  env "${tool_env[@]}" "$PY" -c '
import sys, oxccl._oxccl as lib, oxccl.torch as ot
path = getattr(ot._CPP, "__file__", None)
if path is None or (sys.argv[1] == "asan") != ("-address" in path):
    sys.exit(f"sanitize: the {sys.argv[1]} run would not use the C++ backend built for it (it found {path})")
if (sys.argv[1] == "asan") != ("asan-py" in lib.__file__):
    sys.exit(f"sanitize: the {sys.argv[1]} run would not use the Rust library built for it (it found {lib.__file__})")
print(f"   the C++ backend: {path}; the Rust library: {lib.__file__}")
' "$1"
}

# Checks that tool $1 reports a heap error and that reports() finds its report: a write
# past a malloc'd block (ASan), a double free (glibc), a cross-memory write into a freed
# block and then a write of this process into it (guard), on purpose.
self_check() {
  local dir=$LOG_DIR/$1-self-check
  mkdir -p "$dir"
  set_tool_env "$1" "$dir"
  # In a subshell (not the last command there: not exec'd), so that the shell's own line
  # about the abort goes to the log too.
  (env "${tool_env[@]}" "$PY" -c '
import ctypes, sys
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
p = libc.malloc(24)
if sys.argv[1] == "asan":
    ctypes.memset(p, 0, 64)
elif sys.argv[1] == "guard":
    import os
    class Iov(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    libc.free(p)
    src = ctypes.create_string_buffer(8)
    vm_writev = ctypes.CDLL(None, use_errno=True).process_vm_writev
    vm_writev.argtypes = [ctypes.c_int, ctypes.POINTER(Iov), ctypes.c_ulong, ctypes.POINTER(Iov), ctypes.c_ulong, ctypes.c_ulong]
    if vm_writev(os.getpid(), Iov(ctypes.addressof(src), 8), 1, Iov(p, 8), 1, 0) < 0:
        print("process_vm_writev into a freed block:", os.strerror(ctypes.get_errno()), flush=True)
    ctypes.memset(p, 0, 8)
else:
    libc.free(p)
    libc.free(p)
' "$1" || true) >"$dir/out.log" 2>&1
  if [ -z "$(reports "$dir" "$dir/out.log")" ] ||
    { [ "$1" = guard ] && ! { grep -q "Bad address" "$dir/out.log" && grep -q "Segmentation fault" "$dir/out.log"; }; }; then
    echo "sanitize: $1 did not report a heap error made on purpose (see $dir): its runs would prove nothing" >&2
    return 1
  fi
  echo "   $1 reports a heap error made on purpose"
}

seeds=(847752098)
for ((i = 0; i < NSEEDS; i++)); do
  seeds+=("$("$PY" -c 'import random; print(random.randrange(1 << 30))')")
done
for tool in asan malloc guard; do
  echo "== sanitize: $tool: the property test, ${#seeds[@]} seeds (${seeds[*]}), $CALLS calls per case"
  if ! self_check "$tool" || ! check_backend "$tool"; then
    failed+=("$tool")
    continue
  fi
  # guard: once more with the shared-memory allocator off, so that the tensors are private
  # heap memory that peers write into with process_vm_writev (single-copy calls).
  allocs=(1)
  if [ "$tool" = guard ]; then allocs=(1 0); fi
  for seed in "${seeds[@]}"; do
    echo "   seed $seed (replay: OXCCL_PROP_SEED=$seed OXCCL_PROP_CALLS=$CALLS)"
    for alloc in "${allocs[@]}"; do
      for n in 2 3; do
        suffix=""
        if [ "$alloc" = 0 ]; then suffix=-private; fi
        run_one "$tool" "$tool-prop-$seed-$n$suffix" OXCCL_TORCH_ALLOCATOR="$alloc" OXCCL_PROP_SEED="$seed" \
          OXCCL_PROP_CALLS="$CALLS" -- "python/tests/test_torch_property.py::test_random_calls_match_gloo[$n]"
      done
    done
  done
  echo "== sanitize: $tool: the allocator, call form and point-to-point tests"
  run_one "$tool" "$tool-tests" -- python/tests/test_torch_shm_allocator.py python/tests/test_torch_forms.py \
    python/tests/test_torch_p2p_calls.py
done

if [ "${#failed[@]}" -ne 0 ]; then
  echo "sanitize: failed: ${failed[*]} (logs: $LOG_DIR)" >&2
  exit 1
fi
echo "sanitize: no report (logs: $LOG_DIR)"
