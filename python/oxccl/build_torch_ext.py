"""Builds oxccl's C++ torch backend (``oxccl/csrc/backend.cpp``, with the inference ops of
``oxccl/csrc/inference.cpp``) into a ``_torch_backend*.so``, with torch's own extension tooling
(``torch.utils.cpp_extension``; ninja is used when installed, else plain setuptools).

``import oxccl.torch`` does this by itself the first time it finds no usable build: it builds
once, for the torch installed then, into a cache (:func:`cache_dir`), with a one-line message
on stderr, under a file lock so that ranks importing at once build it once; when the build
fails (no compiler, no torch headers) it warns and the Python backend serves.

    python -m oxccl.build_torch_ext            # builds into the package (next to this file)
    python -m oxccl.build_torch_ext --cache    # builds into the cache import oxccl.torch uses

A build is usable only for the torch version, oxccl version, Python and C++ sources it was
built from (recorded in ``_torch_backend.json`` beside it); anything else is rebuilt.

Environment: ``OXCCL_TORCH_EXT_BUILD=0`` turns the build on import off;
``OXCCL_TORCH_EXT_DIR`` is the cache's root (default ``$XDG_CACHE_HOME/oxccl/torch-ext`` or
``~/.cache/oxccl/torch-ext``); ``OXCCL_TORCH_EXT_TIMEOUT`` bounds the build and the wait for
another process's build (seconds, default 600).
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


def key() -> Dict[str, str]:
    """What a build is usable for: torch's version, oxccl's, the Python ABI, the C++ sources."""
    import torch

    from . import _oxccl

    return {
        "torch": str(torch.__version__),
        "oxccl": str(_oxccl.__version__),
        "python": sys.implementation.cache_tag + sysconfig.get_config_var("EXT_SUFFIX"),
        "sources": _sources_hash(),
    }


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
    return os.path.join(cache_root(), name.replace(os.sep, "_"))


def usable(into: str, k: Dict[str, str]) -> Optional[str]:
    """The module built in `into` when its record matches key `k`, else None."""
    try:
        with open(os.path.join(into, STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    path = target(into)
    return path if stamp == k and os.path.isfile(path) else None


def build(verbose: bool = False, into: str = HERE, k: Optional[Dict[str, str]] = None) -> str:
    """Compiles the extension into directory `into`, records key `k` beside it (this
    process's :func:`key` by default), and returns the module's path. Replaces an older build
    atomically: a process that loaded it keeps its copy."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension, is_ninja_available

    k = key() if k is None else k
    csrc = os.path.join(HERE, "csrc")
    ext = CppExtension(
        name=f"oxccl.{NAME}",
        sources=[os.path.join(csrc, "backend.cpp"), os.path.join(csrc, "inference.cpp")],
        include_dirs=[csrc],
        extra_compile_args=["-O2", "-g0", "-fvisibility=hidden"],
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
        os.replace(built, target(into))
        stamp_tmp = os.path.join(tmp, STAMP)
        with open(stamp_tmp, "w") as f:
            json.dump(k, f)
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


def find_or_build() -> str:
    """The path of a usable built module: the package's, else the cache's, else one built now
    into the cache (once across processes: the others wait on a file lock, bounded by
    ``OXCCL_TORCH_EXT_TIMEOUT``). Raises :class:`BuildUnavailable` when there is none."""
    k = key()
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
        # `python -c`, not the file's path: that would put this directory (with oxccl/torch.py)
        # first on sys.path, ahead of torch.
        code = (
            "import sys; sys.path[0] = sys.argv.pop(1); "
            "from oxccl.build_torch_ext import _main; _main(sys.argv[1:])"
        )
        cmd = [sys.executable, "-c", code, os.path.dirname(HERE), "--into", into, "--key", json.dumps(k)]
        with open(log_path, "w") as log:
            # Its own process group, so that a timeout also ends the compilers it started.
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise BuildUnavailable(
                    f"the build was not done within OXCCL_TORCH_EXT_TIMEOUT={timeout:g} s (log: {log_path})"
                ) from None
            except BaseException:  # interrupted (Ctrl-C): no compiler outlives the import
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
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
        print(build(verbose=verbose, into=into, k=k))
        return
    k = key()
    into = cache_dir(k) if "--cache" in argv else HERE
    print(build(verbose=verbose, into=into, k=k))


if __name__ == "__main__":
    _main(sys.argv[1:])
