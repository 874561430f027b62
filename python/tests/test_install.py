"""One-step install: ``.venv/bin/pip install --no-build-isolation ./python`` (as python/README.md
gives it, in a venv that is not activated) in a fresh venv, here with the wheel's prebuilt
C++ torch backend and command left out (``OXCCL_WHEEL_TORCH_EXT=0``, ``OXCCL_WHEEL_CLI=0``: as
a build with no torch in its environment gives; test_wheel.py covers the wheel with them),
gives the C++ torch backend with no second command (built once, on first
``import oxccl.torch``, into the cache), and an ImportError naming the reason and the fix
when it cannot be built."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO, free_port

torch = pytest.importorskip("torch")

BUILDING = "oxccl: building the C++ torch backend"

WORKER = r"""
import os, sys, warnings
warnings.simplefilter("always")
import torch, torch.distributed as dist
import oxccl
if os.environ.get("EXPECT_CPP") == "0":
    try:
        import oxccl.torch
    except ImportError as e:
        print("NO BACKEND:", e, flush=True)
        sys.exit(0)
    raise SystemExit("oxccl.torch imported without its C++ backend")
import oxccl.torch as ot
print("FILE", oxccl.__file__, flush=True)
assert ot._CPP is not None, "no C++ backend"
print("CPP", ot._CPP.__file__, flush=True)
dist.init_process_group("oxccl")
be = dist.group.WORLD._get_backend(torch.device("cpu"))
assert isinstance(be, ot._CPP.BackendOxcclCpp), type(be)
t = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((1000,), 3.0)), t[:4]
x = torch.full((64,), float(dist.get_rank() + 1), dtype=torch.bfloat16)
ot.inference_all_reduce(x)
assert torch.equal(x, torch.full((64,), 3.0, dtype=torch.bfloat16)), x[:4]
dist.destroy_process_group()
print("OK cpp", flush=True)
"""


def _without_maturin_on_path(path):
    """PATH as in a shell where no venv with maturin is activated: the documented command
    must find maturin by itself."""
    keep = [d for d in path.split(os.pathsep) if d and not os.path.exists(os.path.join(d, "maturin"))]
    return os.pathsep.join(keep)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv reusing this one's packages (torch, maturin) through a .pth, with ./python
    installed by the command python/README.md gives, run as written: the venv's own pip, not
    activated, no build isolation (the Rust build reuses python/target)."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    pytest.importorskip("maturin")
    root = tmp_path_factory.mktemp("install")
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(os.path.join(p, "torch"))]
    with open(os.path.join(site, "zz_reuse.pth"), "w") as f:
        f.write("\n".join(ours) + "\n")
    assert not (env_dir / "bin" / "maturin").exists()
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(REPO, "python", "target"))
    env["PATH"] = _without_maturin_on_path(env.get("PATH", ""))
    env.update(OXCCL_WHEEL_TORCH_EXT="0", OXCCL_WHEEL_CLI="0")
    for name in ("PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(name, None)
    t0 = time.monotonic()
    r = subprocess.run(
        [str(env_dir / "bin" / "pip"), "install", "--no-build-isolation", "./python"],
        env=env, capture_output=True, text=True, timeout=900, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"pip install: {time.monotonic() - t0:.1f} s")
    assert not [n for n in os.listdir(os.path.join(site, "oxccl")) if n.startswith("_torch_backend")]
    # The torch entry point (the backend name with no import of oxccl) is in the wheel.
    eps = subprocess.run(
        [str(py), "-c", "from importlib.metadata import entry_points as e; "
         "print([(x.name, x.value) for x in e(group='torch.backends')])"],
        check=True, capture_output=True, text=True, timeout=60, cwd=str(root),
    ).stdout
    assert "('oxccl', 'oxccl_autoload:register')" in eps, eps
    assert os.path.isfile(os.path.join(site, "oxccl_autoload", "__init__.py"))
    return root, str(py)


def run_ranks(py, cwd, n, env, timeout=600):
    port = free_port()
    procs = []
    for r in range(n):
        e = dict(os.environ)
        e.pop("PYTHONPATH", None)
        e.update(
            RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OXCCL_TIMEOUT="60", OMP_NUM_THREADS="1",
            OXCCL_SECRET="5f3c2a1b0e9d8c7b6a5f4e3d2c1b0a99",
        )
        e.update(env)
        procs.append(subprocess.Popen([py, "-c", WORKER], env=e, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        outs.append((p.returncode, out))
    for r, (rc, out) in enumerate(outs):
        assert rc == 0, f"rank {r} exit {rc}:\n{out}"
    return [out for _, out in outs]


def test_pip_install_builds_the_cpp_backend_once(venv):
    root, py = venv
    cache = root / "cache"
    env = {"OXCCL_TORCH_EXT_DIR": str(cache)}
    t0 = time.monotonic()
    outs = run_ranks(py, str(root), 2, env)
    print(f"first import (2 ranks, one build): {time.monotonic() - t0:.1f} s")
    text = "".join(outs)
    assert text.count(BUILDING) == 1, text
    for out in outs:
        assert "OK cpp" in out and "not available" not in out, out
        assert f"FILE {root}" in out, out  # the fresh venv's oxccl, not this one's
        assert f"CPP {cache}" in out, out
    built = [d for d in cache.iterdir() if d.is_dir()]
    assert len(built) == 1 and any(n.name.startswith("_torch_backend") for n in built[0].iterdir()), built
    # Again: the cache serves, with no build.
    outs = run_ranks(py, str(root), 2, env)
    text = "".join(outs)
    assert BUILDING not in text and text.count("OK cpp") == 2, text


def test_fallbacks_warn(venv):
    root, py = venv
    # Auto-build off, empty cache: no backend, an ImportError that says why.
    outs = run_ranks(py, str(root), 1, {"OXCCL_TORCH_EXT_DIR": str(root / "off"), "OXCCL_TORCH_EXT_BUILD": "0", "EXPECT_CPP": "0"})
    assert "OXCCL_TORCH_EXT_BUILD=0" in outs[0] and "the torch backend (C++) is not available" in outs[0], outs[0]
    assert not (root / "off").exists()
    # A failing compiler: one failed build, an ImportError naming it; the next import
    # does not retry.
    env = {"OXCCL_TORCH_EXT_DIR": str(root / "broken"), "CXX": "/bin/false", "CC": "/bin/false", "EXPECT_CPP": "0"}
    outs = run_ranks(py, str(root), 1, env, timeout=300)
    assert outs[0].count(BUILDING) == 1 and "the build failed" in outs[0], outs[0]
    outs = run_ranks(py, str(root), 1, env, timeout=300)
    assert BUILDING not in outs[0] and "an earlier build failed" in outs[0], outs[0]
