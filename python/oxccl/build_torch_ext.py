"""Builds oxccl's C++ torch backend (``oxccl/csrc/backend.cpp``, with the inference ops of
``oxccl/csrc/inference.cpp``) into a ``_torch_backend*.so``, with torch's own extension tooling
(``torch.utils.cpp_extension``; ninja is used when installed, else plain setuptools).

``import oxccl.torch`` does this by itself the first time it finds no usable build: it builds
once, for the torch installed then, into a cache (:func:`cache_dir`), with a one-line message
on stderr, under a file lock so that ranks importing at once build it once; when the build
fails (no compiler, no torch headers) it raises an ImportError that says why and how to fix it.

    python -m oxccl.build_torch_ext            # builds into the package (next to this file)
    python -m oxccl.build_torch_ext --cache    # builds into the cache import oxccl.torch uses

A wheel built by ``pip wheel --no-build-isolation ./python`` in a venv with torch carries a
build for that torch in the package, with its record: installed with that torch it serves
with no build; with another torch the first import builds one as above, or, where that
fails, the warning names both torch versions.

A build is usable only for the torch version, oxccl version, Python and C++ sources it was
built from, and only while the library is the file that was built (its size and sha256): all
recorded in ``_torch_backend.json`` beside it; anything else is rebuilt.

A build with AddressSanitizer, for finding memory errors (the stress tier's step, see
CONTRIBUTING.md): ``OXCCL_TORCH_EXT_SANITIZE=address`` adds ``-fsanitize=address`` to the
build and ``"sanitize": "address"`` to its key, so such a build and a plain one never stand
in for each other; it goes to the cache, never into the package (with ``OXCCL_TORCH_EXT_DIR``
naming a cache of its own, the plain build's cache is left as it is). A process that loads it
must have ASan's runtime loaded first, and libstdc++ with it (ASan's interceptor of C++
throws finds the real one only in a library loaded by then)::

    OXCCL_TORCH_EXT_SANITIZE=address OXCCL_TORCH_EXT_DIR=target/torch-ext-asan \
        python -m oxccl.build_torch_ext
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
        ASAN_OPTIONS=detect_leaks=0 OXCCL_TORCH_EXT_SANITIZE=address \
        OXCCL_TORCH_EXT_DIR=target/torch-ext-asan python ...

Environment: ``OXCCL_TORCH_EXT_BUILD=0`` turns the build on import off;
``OXCCL_TORCH_EXT_DIR`` is the cache's root (default ``$XDG_CACHE_HOME/oxccl/torch-ext`` or
``~/.cache/oxccl/torch-ext``); ``OXCCL_TORCH_EXT_TIMEOUT`` bounds the build and the wait for
another process's build (seconds, default 600); ``OXCCL_TORCH_EXT_SANITIZE`` (``address``
or unset) is the sanitizer the build has.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any, Dict, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "_torch_backend"
STAMP = NAME + ".json"
FAILED = "build-failed.log"
DEFAULT_TIMEOUT_S = 600.0


def target(into: str = HERE) -> str:
    """Where the built module goes in directory `into` (the package's by default)."""
    return os.path.join(into, NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def _sources_hash() -> str:
    h = hashlib.sha256()
    csrc = os.path.join(HERE, "csrc")
    for name in sorted(os.listdir(csrc)):
        path = os.path.join(csrc, name)
        if os.path.isfile(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


#: The sanitizers a build can have (``OXCCL_TORCH_EXT_SANITIZE``), with the compiler's flags.
SANITIZERS = {"address": ["-fsanitize=address", "-fno-omit-frame-pointer"]}


def sanitizer() -> Optional[str]:
    """``OXCCL_TORCH_EXT_SANITIZE``: the sanitizer of the build to use, or None (unset or
    empty: a plain build)."""
    raw = os.environ.get("OXCCL_TORCH_EXT_SANITIZE", "").strip().lower()
    if not raw:
        return None
    if raw not in SANITIZERS:
        raise ValueError(f"OXCCL_TORCH_EXT_SANITIZE={raw!r}: expected one of {', '.join(SANITIZERS)} or nothing")
    return raw


def key() -> Dict[str, str]:
    """What a build is usable for: torch's version, oxccl's, the Python ABI, the C++ sources,
    and its sanitizer if it has one (:func:`sanitizer`)."""
    import torch

    from . import _oxccl

    k = {
        "torch": str(torch.__version__),
        "oxccl": str(_oxccl.__version__),
        "python": sys.implementation.cache_tag + sysconfig.get_config_var("EXT_SUFFIX"),
        "sources": _sources_hash(),
    }
    sanitize = sanitizer()
    if sanitize:
        k["sanitize"] = sanitize
    return k


def cache_root() -> str:
    """``OXCCL_TORCH_EXT_DIR``, else ``$XDG_CACHE_HOME/oxccl/torch-ext``, else
    ``~/.cache/oxccl/torch-ext``."""
    root = os.environ.get("OXCCL_TORCH_EXT_DIR")
    if root:
        return os.path.abspath(os.path.expanduser(root))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "oxccl", "torch-ext")


def cache_dir(k: Optional[Dict[str, str]] = None) -> str:
    """The cache directory for build key `k` (this process's :func:`key` by default):
    ``<root>/<torch version>-<oxccl version>-<python tag>-<sources hash>``."""
    k = key() if k is None else k
    tag = sys.implementation.cache_tag
    name = f"{k['torch']}-{k['oxccl']}-{tag}-{k['sources'][:12]}"
    if k.get("sanitize"):
        name += f"-{k['sanitize']}"
    return os.path.join(cache_root(), name.replace(os.sep, "_"))


#: A stamp is a few hundred bytes; a larger file is not one (it is not read beyond this).
STAMP_MAX_BYTES = 64 * 1024


def _file_digest(path: str) -> Dict[str, Any]:
    """Size and sha256 of the file at `path`."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            size += len(chunk)
            h.update(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _read_stamp(into: str) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(into, STAMP), "rb") as f:
            raw = f.read(STAMP_MAX_BYTES + 1)
        if len(raw) > STAMP_MAX_BYTES:
            return None
        stamp = json.loads(raw)
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def usable(into: str, k: Dict[str, str]) -> Optional[str]:
    """The module built in `into` when its record matches key `k` and the module is the very
    file the record vouches for (size and sha256: a truncated or overwritten library would
    crash the process that maps it, with SIGBUS or SIGSEGV), else None."""
    stamp = _read_stamp(into)
    if stamp is None or stamp.get("key") != k:
        return None
    library = stamp.get("library")
    path = target(into)
    try:
        if not isinstance(library, dict) or os.stat(path).st_size != library.get("size"):
            return None
        return path if _file_digest(path) == library else None
    except OSError:
        return None


def build(verbose: bool = False, into: str = HERE, k: Optional[Dict[str, str]] = None) -> str:
    """Compiles the extension into directory `into`, records key `k` beside it (this
    process's :func:`key` by default), and returns the module's path. Replaces an older build
    atomically: a process that loaded it keeps its copy."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension, is_ninja_available

    k = key() if k is None else k
    csrc = os.path.join(HERE, "csrc")
    sanitize = SANITIZERS[k["sanitize"]] if k.get("sanitize") else []
    ext = CppExtension(
        name=f"oxccl.{NAME}",
        sources=[os.path.join(csrc, "backend.cpp"), os.path.join(csrc, "inference.cpp")],
        include_dirs=[csrc],
        # With a sanitizer: line numbers in its reports (-g), and its runtime linked.
        extra_compile_args=["-O2", "-g" if sanitize else "-g0", "-fvisibility=hidden"] + sanitize,
        extra_link_args=sanitize,
    )
    os.makedirs(into, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".oxccl-torch-ext-", dir=into) as tmp:
        lib = os.path.join(tmp, "lib")
        setup(
            name="oxccl-torch-backend",
            ext_modules=[ext],
            cmdclass={"build_ext": BuildExtension.with_options(use_ninja=is_ninja_available())},
            script_args=["-q" if not verbose else "-v", "build_ext", "--build-lib", lib, "--build-temp", tmp],
        )
        built = os.path.join(lib, "oxccl", os.path.basename(target(into)))
        # Remove the record first: between the two renames the directory holds no usable build.
        try:
            os.unlink(os.path.join(into, STAMP))
        except FileNotFoundError:
            pass
        library = _file_digest(built)
        os.replace(built, target(into))
        stamp_tmp = os.path.join(tmp, STAMP)
        with open(stamp_tmp, "w") as f:
            json.dump({"key": k, "library": library}, f)
        os.replace(stamp_tmp, os.path.join(into, STAMP))
    return target(into)


def _timeout_s() -> float:
    raw = os.environ.get("OXCCL_TORCH_EXT_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1e7:
        raise ValueError(f"OXCCL_TORCH_EXT_TIMEOUT={raw!r}: expected seconds above 0, at most 1e7")
    return value


def _auto_build_enabled() -> bool:
    raw = os.environ.get("OXCCL_TORCH_EXT_BUILD", "1").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"OXCCL_TORCH_EXT_BUILD={raw!r}: expected 0 or 1")


class BuildUnavailable(Exception):
    """No usable build, and none could be made: the message says why."""


def _lock(path: str, deadline: float) -> Any:
    """An exclusive ``flock`` on `path`, polled until `deadline` (``time.monotonic``)."""
    import fcntl

    f = open(path, "a+")
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.close()
                raise BuildUnavailable(
                    f"another process held {path} (building the C++ torch backend) for longer than "
                    "OXCCL_TORCH_EXT_TIMEOUT"
                ) from None
            time.sleep(0.05)


def _build_cmd(into: str, k: Dict[str, str], verbose: bool = False) -> list:
    # `python -c`, not the file's path: that would put this directory (with oxccl/torch.py)
    # first on sys.path, ahead of torch.
    code = (
        "import sys; sys.path[0] = sys.argv.pop(1); "
        "from oxccl.build_torch_ext import _main; _main(sys.argv[1:])"
    )
    cmd = [sys.executable, "-c", code, os.path.dirname(HERE), "--into", into, "--key", json.dumps(k)]
    return cmd + ["--parent", str(os.getpid())] + (["-v"] if verbose else [])


def _run_build(
    into: str, k: Dict[str, str], out: Any, deadline: float, timeout: float, log_path: str, verbose: bool = False
) -> Any:
    """Runs the build of module `k` into `into` in a child process, its output to `out` (a
    file, or None: this process's), bounded by `deadline`; returns ``(cmd, exit status)``.

    The child leads a process group of its own, with the compilers it starts: a timeout, an
    interrupt or any exception here kills that whole group, and so does the end of this
    process by any means, SIGKILL included (the child asks the kernel for SIGTERM when its
    parent dies and then kills its group: see :func:`_die_with_parent`)."""
    cmd = _build_cmd(into, k, verbose)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise BuildUnavailable(
            f"the build was not done within OXCCL_TORCH_EXT_TIMEOUT={timeout:g} s (log: {log_path})"
        ) from None
    except BaseException:  # interrupted (Ctrl-C): no compiler outlives the build
        _kill_group(proc)
        raise
    return cmd, rc


def _kill_group(proc: Any) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _die_with_parent(parent: int) -> None:
    """In the build's child process (the leader of its own process group): when the process
    that started it ends, by any means, this process and its whole group (the compilers)
    end too. Linux's PR_SET_PDEATHSIG delivers SIGTERM at the parent's death; the handler
    kills the group. Elsewhere the parent's own handling (timeout, interrupt) is all."""

    def kill_group(signum: int, frame: Any) -> None:
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, kill_group)
    signal.signal(signal.SIGHUP, kill_group)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        try:
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent was gone before the request took effect
        kill_group(signal.SIGTERM, None)


def _packaged_note(k: Dict[str, str]) -> str:
    """When the package holds a build (a wheel's) for another torch or Python than this
    process's: a sentence naming both and the fixes, to append to a :class:`BuildUnavailable`
    message; else ""."""
    stamp = _read_stamp(HERE)
    built = stamp.get("key") if stamp is not None else None
    if not isinstance(built, dict) or built == k:
        return ""
    fix = "a C++ compiler (then the first import builds it once)"
    if built.get("torch") != k["torch"]:
        return (
            f"; this oxccl package's prebuilt C++ torch backend is for torch {built.get('torch')}, "
            f"the installed torch is {k['torch']}: install torch {built.get('torch')}, or {fix}, or "
            f"an oxccl wheel built with torch {k['torch']} (`pip wheel --no-build-isolation ./python` "
            "in a venv that has it)"
        )
    differs = ", ".join(f"{n} {built.get(n)!r} (here {k[n]!r})" for n in sorted(k) if built.get(n) != k[n])
    return f"; this oxccl package's prebuilt C++ torch backend was built for {differs}: install {fix}"


def find_or_build() -> str:
    """The path of a usable built module: the package's, else the cache's, else one built now
    into the cache (once across processes: the others wait on a file lock, bounded by
    ``OXCCL_TORCH_EXT_TIMEOUT``). Raises :class:`BuildUnavailable` when there is none; its
    message names the versions a prebuilt module in the package (a wheel's) was made for
    when they are not this process's."""
    k = key()
    try:
        return _find_or_build(k)
    except BuildUnavailable as e:
        note = _packaged_note(k)
        if not note:
            raise
        raise BuildUnavailable(str(e) + note) from None


def _asan_loaded() -> bool:
    """Whether AddressSanitizer's runtime is mapped in this process (true where
    ``/proc/self/maps`` cannot be read: then the load says it)."""
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return True


def check_loadable() -> None:
    """Raises ValueError when this process could not load the build :func:`sanitizer` asks
    for: an ASan build where ASan's runtime is not loaded (loading it would end the process,
    the runtime must come first)."""
    if sanitizer() == "address" and not _asan_loaded():
        raise ValueError(
            "OXCCL_TORCH_EXT_SANITIZE=address: AddressSanitizer's runtime is not loaded in this process: run it "
            'with LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"'
        )


def _find_or_build(k: Dict[str, str]) -> str:
    found = usable(HERE, k) or usable(cache_dir(k), k)
    if found:
        return found
    if not _auto_build_enabled():
        raise BuildUnavailable(
            "not built for this torch and oxccl, and OXCCL_TORCH_EXT_BUILD=0: run `python -m oxccl.build_torch_ext`"
        )
    into = cache_dir(k)
    timeout = _timeout_s()
    deadline = time.monotonic() + timeout
    try:
        os.makedirs(into, exist_ok=True)
        lock = _lock(into + ".lock", deadline)
    except OSError as e:
        raise BuildUnavailable(f"cannot use the cache {into}: {e}") from e
    with lock:
        found = usable(into, k)
        if found:
            return found
        failed = os.path.join(into, FAILED)
        if os.path.exists(failed):
            raise BuildUnavailable(f"an earlier build failed (see {failed}; delete it to retry)")
        print(
            f"oxccl: building the C++ torch backend for torch {k['torch']} (once, ~1 min) into {into}",
            file=sys.stderr,
            flush=True,
        )
        log_path = os.path.join(into, "build.log")
        with open(log_path, "w") as log:
            cmd, rc = _run_build(into, k, log, deadline, timeout, log_path)
            why = f"exit status {rc}"
        found = usable(into, k)
        if rc == 0 and found:
            return found
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        with open(failed, "w") as f:
            f.write(f"{' '.join(cmd)}\n{why}\n{tail}")
        last = [line for line in tail.splitlines() if line.strip()][-1:] or [why]
        raise BuildUnavailable(f"the build failed ({why}: {last[0].strip()}; log: {failed}, delete it to retry)")


def _main(argv: list) -> None:
    verbose = "-v" in argv
    if "--into" in argv:
        # The build import oxccl.torch runs (a subprocess, so that a compiler's output and
        # failure stay out of the importing process).
        into = argv[argv.index("--into") + 1]
        k = json.loads(argv[argv.index("--key") + 1])
        if "--parent" in argv:
            _die_with_parent(int(argv[argv.index("--parent") + 1]))
        print(build(verbose=verbose, into=into, k=k))
        return
    # The command: the same child process, so that killing this one ends the compilers too.
    k = key()
    # A sanitized build is never the package's: it goes to the cache, as with --cache.
    into = cache_dir(k) if "--cache" in argv or k.get("sanitize") else HERE
    timeout = _timeout_s()
    _, rc = _run_build(into, k, None, time.monotonic() + timeout, timeout, "above", verbose=verbose)
    if rc != 0:
        sys.exit(f"oxccl: the build of the C++ torch backend failed (exit status {rc})")


if __name__ == "__main__":
    _main(sys.argv[1:])
