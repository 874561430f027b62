"""The wheel that needs no compiler: ``pip wheel --no-build-isolation --no-deps ./python`` in a
venv with torch gives a wheel with the C++ torch backend built for that torch (and its
record) and the ``oxccl`` command. Installed into a fresh venv with that torch, on a PATH with
no C or C++ compiler, ``import oxccl.torch`` builds nothing and runs the C++ backend; with
another torch (a faked record) and no compiler, the ImportError names both torch versions
and the fix."""

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

import pytest

from conftest import REPO, free_port

torch = pytest.importorskip("torch")

BUILDING = "oxccl: building the C++ torch backend"
FAKE_TORCH = "0.0.1+wheeltest"

WORKER = r"""
import os, sys, time, warnings
warnings.simplefilter("always")
t0 = time.monotonic()
import torch, torch.distributed as dist
if os.environ.get("EXPECT_CPP") == "0":
    try:
        import oxccl.torch
    except ImportError as e:
        print("NO BACKEND:", e, flush=True)
        sys.exit(0)
    raise SystemExit("oxccl.torch imported without its C++ backend")
import oxccl.torch as ot
print("IMPORT %.2f" % (time.monotonic() - t0), flush=True)
assert ot._CPP is not None, "no C++ backend"
print("CPP", ot._CPP.__file__, flush=True)
dist.init_process_group("oxccl")
be = dist.group.WORLD._get_backend(torch.device("cpu"))
assert isinstance(be, ot._CPP.BackendOxcclCpp), type(be)
t = torch.arange(1000, dtype=torch.float32) * (dist.get_rank() + 1)
dist.all_reduce(t)
assert torch.equal(t, torch.arange(1000, dtype=torch.float32) * 3), t[:4]
dist.destroy_process_group()
print("OK cpp", flush=True)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel, built by the documented command with this Python's pip (no build isolation:
    this environment's torch and maturin)."""
    pytest.importorskip("maturin")
    pytest.importorskip("setuptools")
    for tool in ("c++", "cargo"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} to build the wheel")
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(out), "./python"],
        env=env, capture_output=True, text=True, timeout=1800, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (path,) = out.glob("oxccl-*.whl")
    print(f"pip wheel: {time.monotonic() - t0:.1f} s, {path.name}, {path.stat().st_size / 1e6:.1f} MB")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed (no dependencies: torch and numpy come from this
    environment through a .pth); returns (root, its python, its oxccl package directory)."""
    root = tmp_path_factory.mktemp("venv")
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
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300, cwd=str(root),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return root, str(py), os.path.join(site, "oxccl")


def _no_compiler_env(root, cache):
    """PATH with the venv's bin and an empty directory, no cc/c++/g++; CC and CXX unusable."""
    empty = root / "empty-bin"
    empty.mkdir(exist_ok=True)
    for name in ("cc", "c++", "g++", "gcc", "clang", "clang++"):
        assert not (empty / name).exists()
    return {
        "PATH": os.pathsep.join([str(root / "venv" / "bin"), str(empty)]),
        "CC": "/nonexistent", "CXX": "/nonexistent",
        "OXCCL_TORCH_EXT_DIR": str(cache),
    }


def run_ranks(py, cwd, n, env, timeout=300):
    port = free_port()
    procs = []
    for r in range(n):
        e = dict(os.environ)
        for name in ("PYTHONPATH", "VIRTUAL_ENV"):
            e.pop(name, None)
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


def test_wheel_carries_the_cpp_backend_and_the_command(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        stamp = json.loads(z.read("oxccl/_torch_backend.json"))
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
        script = next(n for n in names if n.endswith(".data/scripts/oxccl"))
        assert (z.getinfo(script).external_attr >> 16) & 0o111, "the command is not executable"
    modules = [n for n in names if n.startswith("oxccl/_torch_backend") and n.endswith(".so")]
    assert len(modules) == 1, names
    assert stamp["key"]["torch"] == str(torch.__version__), stamp
    for n in modules + ["oxccl/_torch_backend.json", script]:
        assert f"\n{n},sha256=" in "\n" + record, n


def test_import_builds_nothing_with_no_compiler(installed):
    root, py, pkg = installed
    cache = root / "cache"
    env = _no_compiler_env(root, cache)
    t0 = time.monotonic()
    outs = run_ranks(py, str(root), 2, env)
    took = time.monotonic() - t0
    print(f"2 ranks, import + init + all_reduce, no compiler: {took:.1f} s")
    for out in outs:
        assert "OK cpp" in out and BUILDING not in out and "not available" not in out, out
        assert f"CPP {pkg}{os.sep}_torch_backend" in out, out  # the wheel's module
        (imp,) = [float(line.split()[1]) for line in out.splitlines() if line.startswith("IMPORT ")]
        assert imp < 20, out
    assert not cache.exists(), list(cache.rglob("*"))  # nothing was built into the cache
    # The command the wheel installs.
    r = subprocess.run([str(root / "venv" / "bin" / "oxccl"), "--help"], env=dict(os.environ, **env),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "run" in r.stdout, r.stdout + r.stderr


def test_other_torch_with_no_compiler_names_both_versions(installed):
    root, py, pkg = installed
    stamp_path = os.path.join(pkg, "_torch_backend.json")
    with open(stamp_path) as f:
        original = f.read()
    stamp = json.loads(original)
    stamp["key"]["torch"] = FAKE_TORCH  # a wheel built with another torch than this one
    try:
        with open(stamp_path, "w") as f:
            json.dump(stamp, f)
        env = _no_compiler_env(root, root / "cache-other")
        env["EXPECT_CPP"] = "0"
        (out,) = run_ranks(py, str(root), 1, env)
    finally:
        with open(stamp_path, "w") as f:
            f.write(original)
    assert out.count(BUILDING) == 1 and "the build failed" in out, out
    assert f"prebuilt C++ torch backend is for torch {FAKE_TORCH}" in out, out
    assert f"the installed torch is {torch.__version__}" in out, out
    assert f"install torch {FAKE_TORCH}" in out and "C++ compiler" in out, out


# The build backend's wheel rewriting, on a small fake wheel (no build).


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "python", "build_backend"))
    pytest.importorskip("maturin")
    import oxccl_build_backend

    return oxccl_build_backend


def _fake_wheel(directory, name="oxccl-0.1.0-cp39-abi3-manylinux_2_17_x86_64.whl"):
    with zipfile.ZipFile(directory / name, "w") as z:
        z.writestr("oxccl/__init__.py", "x = 1\n")
        z.writestr("oxccl-0.1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: cp39-abi3-manylinux_2_17_x86_64\n")
        z.writestr("oxccl-0.1.0.dist-info/RECORD", "stale\n")
    return name


def test_added_files_are_recorded_and_retagged(backend, tmp_path):
    import base64
    import hashlib

    name = _fake_wheel(tmp_path)
    (tmp_path / "m.so").write_bytes(b"module")
    (tmp_path / "exe").write_bytes(b"#!/bin/sh\n")
    new = backend._add_to_wheel(str(tmp_path / name), {"oxccl/_torch_backend.x.so": str(tmp_path / "m.so")},
                                {"oxccl": str(tmp_path / "exe")}, 34, True)
    assert new == "oxccl-0.1.0-cp39-abi3-manylinux_2_34_x86_64.whl" and not (tmp_path / name).exists()
    with zipfile.ZipFile(tmp_path / new) as z:
        names = z.namelist()
        assert names[-1].endswith("/RECORD") and names.index("oxccl-0.1.0.data/scripts/oxccl") < names.index("oxccl-0.1.0.dist-info/WHEEL")
        assert (z.getinfo("oxccl-0.1.0.data/scripts/oxccl").external_attr >> 16) & 0o777 == 0o755
        assert "Tag: cp39-abi3-manylinux_2_34_x86_64" in z.read("oxccl-0.1.0.dist-info/WHEEL").decode()
        rows = [r.split(",") for r in z.read("oxccl-0.1.0.dist-info/RECORD").decode().split()]
        assert sorted(r[0] for r in rows) == sorted(names)
        for path, digest, size in rows:
            if path.endswith("RECORD"):
                continue
            data = z.read(path)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={want}" and int(size) == len(data), path
    # No newer need than the Rust module's tag keeps it; an unreadable need gives `linux`.
    assert backend._retag(new, b"Tag: cp39-abi3-manylinux_2_34_x86_64\n", 28)[0] == new
    assert backend._retag(new, b"", None)[0] == "oxccl-0.1.0-cp39-abi3-linux_x86_64.whl"


def test_a_failed_optional_part_is_left_out(backend, tmp_path, monkeypatch):
    monkeypatch.setattr(backend._maturin, "build_wheel", lambda d, settings, meta: _fake_wheel(tmp_path))

    def fail(tmp):
        raise RuntimeError("the build of the C++ torch backend failed (exit status 1)")

    monkeypatch.setattr(backend, "_torch_ext_files", fail)
    monkeypatch.setattr(backend, "_cli_file", lambda: None)
    for var in ("OXCCL_WHEEL_TORCH_EXT", "OXCCL_WHEEL_CLI", "MATURIN_PEP517_ARGS"):
        monkeypatch.delenv(var, raising=False)
    name = backend.build_wheel(str(tmp_path))  # by default: left out, the wheel is made
    with zipfile.ZipFile(tmp_path / name) as z:
        assert not [n for n in z.namelist() if "_torch_backend" in n]
    with pytest.raises(RuntimeError, match="C\\+\\+ torch backend failed"):
        backend.build_wheel(str(tmp_path), {"torch-ext": "1"})
    with pytest.raises(ValueError, match="expected 0 or 1"):
        backend.build_wheel(str(tmp_path), {"cli": "maybe"})
