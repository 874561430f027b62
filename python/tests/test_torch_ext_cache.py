"""The cached C++ torch backend is loaded only when it is the very library that was built
(size and sha256 in its stamp): a damaged one is rebuilt, or refused with a warning, never
mapped (a truncated library crashes the process with SIGBUS, overwritten bytes with SIGSEGV).
A build killed mid-way leaves no compiler running."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO

pytest.importorskip("torch")
from oxccl import build_torch_ext as bte  # noqa: E402

IMPORT = (
    "import sys, warnings; warnings.simplefilter('always')\n"
    "import oxccl\n"
    "print('FROM', oxccl.__file__.rsplit('/oxccl/', 1)[0], flush=True)\n"
    "try:\n"
    "    import oxccl.torch as ot\n"
    "except ImportError as e:\n"
    "    print('NONE', flush=True)\n"
    "    print(e, file=sys.stderr, flush=True)\n"
    "else:\n"
    "    print('CPP' if ot._CPP is not None else 'PYTHON', flush=True)\n"
)


@pytest.fixture(scope="module", autouse=True)
def package_copy(tmp_path_factory):
    """A copy of the oxccl package without any C++ backend built into it (scripts/test.sh
    builds one there, which would be found before the cache): the subprocesses import it."""
    import oxccl

    root = tmp_path_factory.mktemp("pkg")
    shutil.copytree(
        os.path.dirname(oxccl.__file__), root / "oxccl",
        ignore=shutil.ignore_patterns(bte.NAME + "*", "__pycache__"),
    )
    _PATH[:] = [str(root)]
    yield root
    _PATH.clear()


_PATH = []


def _env(root, **extra):
    e = dict(os.environ, OXCCL_TORCH_EXT_DIR=str(root))
    e["PYTHONPATH"] = os.pathsep.join(_PATH + [p for p in [os.environ.get("PYTHONPATH")] if p])
    e.update(extra)
    return e


def _import(root, timeout=600, **extra):
    return subprocess.run(
        [sys.executable, "-c", IMPORT], env=_env(root, **extra), cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache root holding a good build: a copy of the developer's cache when it has one,
    else built now (1-3 minutes)."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    k = bte.key()
    root = tmp_path_factory.mktemp("ext") / "good"
    mine = bte.cache_dir(k)
    if bte.usable(mine, k):
        shutil.copytree(mine, root / os.path.basename(mine))
    else:
        r = subprocess.run(
            [sys.executable, "-m", "oxccl.build_torch_ext", "--cache"], env=_env(root), cwd=REPO,
            capture_output=True, text=True, timeout=900,
        )
        assert r.returncode == 0, r.stdout + r.stderr
    d = root / os.path.basename(mine)
    assert bte.usable(str(d), k), list(d.iterdir())
    return root, d.name, k


def _copy(built, tmp_path):
    root, name, k = built
    dst = tmp_path / "cache"
    shutil.copytree(root, dst)
    d = dst / name
    return dst, d, bte.target(str(d))


def _truncate(path, size):
    os.truncate(path, size)


def _garbage_in_middle(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2 - 32 * 1024)
        f.write(os.urandom(64 * 1024))


def _oversized_stamp(d):
    stamp = d / bte.STAMP
    text = stamp.read_text()
    stamp.write_text(text + " " * (4 << 20))  # valid JSON, but no stamp is megabytes long


DAMAGE = {
    "truncated-300000": lambda d, so: _truncate(so, min(300000, os.path.getsize(so) // 2)),
    "truncated-4k": lambda d, so: _truncate(so, 4096),
    "garbage-in-middle": lambda d, so: _garbage_in_middle(so),
    "oversized-stamp": lambda d, so: _oversized_stamp(d),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_cache_is_refused_without_a_crash(built, tmp_path, damage):
    root, d, so = _copy(built, tmp_path)
    DAMAGE[damage](d, so)
    r = _import(root, OXCCL_TORCH_EXT_BUILD="0")
    assert r.returncode == 0, f"exit {r.returncode} (a negative one is a signal)\n{r.stdout}{r.stderr}"
    assert "NONE" in r.stdout and f"FROM {_PATH[0]}" in r.stdout, r.stdout
    assert "OXCCL_TORCH_EXT_BUILD=0" in r.stderr and "the torch backend (C++) is not available" in r.stderr, r.stderr


def test_damaged_cache_is_rebuilt(built, tmp_path):
    root, d, so = _copy(built, tmp_path)
    _truncate(so, min(300000, os.path.getsize(so) // 2))
    r = _import(root)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}{r.stderr}"
    assert "CPP" in r.stdout and "oxccl: building the C++ torch backend" in r.stderr, r.stdout + r.stderr
    stamp = json.loads((d / bte.STAMP).read_text())
    assert stamp["library"]["size"] == os.path.getsize(so)


def _descendants(pid):
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(name)] = int(fields[1])
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in found]
        found.update(kids)
        todo.extend(kids)
    return found


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["command", "import"])
def test_killed_build_leaves_no_compiler(tmp_path, how):
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    argv = [sys.executable, "-m", "oxccl.build_torch_ext", "--cache"] if how == "command" else [sys.executable, "-c", IMPORT]
    p = subprocess.Popen(argv, env=_env(tmp_path / "cache"), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = set()
    names = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and p.poll() is None:
            seen |= _descendants(p.pid)
            names.update({c: _comm(c) for c in seen if c not in names})
            if any(_comm(c) in ("cc1plus", "c++", "g++", "clang++", "ninja") for c in seen):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"no compiler seen running (exit {p.poll()})")
        seen |= _descendants(p.pid)
        p.send_signal(signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(c) for c in seen):
            time.sleep(0.2)
        left = {c: _comm(c) for c in seen if _alive(c)}
        assert not left, f"still running after the build was killed: {left}"
    finally:
        for c in seen:  # only what is still the process seen (no pid reused since)
            try:
                if _alive(c) and _comm(c) == names.get(c):
                    os.kill(c, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if p.poll() is None:
            p.kill()
            p.wait()


def test_sanitized_build_has_a_key_and_cache_of_its_own(monkeypatch):
    """A build with ASan (OXCCL_TORCH_EXT_SANITIZE=address) never stands in for a plain one,
    nor a plain one for it: their keys and cache directories differ."""
    monkeypatch.delenv("OXCCL_TORCH_EXT_SANITIZE", raising=False)
    plain = bte.key()
    assert "sanitize" not in plain
    monkeypatch.setenv("OXCCL_TORCH_EXT_SANITIZE", "address")
    asan = bte.key()
    assert asan == dict(plain, sanitize="address")
    assert bte.cache_dir(asan) != bte.cache_dir(plain)
    monkeypatch.setenv("OXCCL_TORCH_EXT_SANITIZE", "thread")
    with pytest.raises(ValueError, match="OXCCL_TORCH_EXT_SANITIZE"):
        bte.key()


def test_sanitized_build_without_asan_loaded_is_refused(tmp_path):
    """OXCCL_TORCH_EXT_SANITIZE=address in a process without ASan's runtime: a clear error at
    import, before any build is looked for or loaded (loading one would end the process)."""
    r = _import(tmp_path, OXCCL_TORCH_EXT_SANITIZE="address", OXCCL_TORCH_EXT_BUILD="0", LD_PRELOAD="")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "InvalidArgumentError" in r.stderr and "LD_PRELOAD" in r.stderr, r.stderr
    assert not any(tmp_path.iterdir()), "nothing is built or cached"
