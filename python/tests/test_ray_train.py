"""Ray Train's TorchTrainer with TorchConfig(backend="oxccl") on a local Ray cluster: the
training function (examples/python/ray_train.py) imports no oxccl; the backend name comes
from the package's torch entry point in every Ray worker."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO

pytest.importorskip("torch")
if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
    pytest.skip('Ray Train is not installed (pip install "ray[train]")', allow_module_level=True)


def test_torch_trainer_over_oxccl(tmp_path):
    # Ray's socket paths must stay under 107 bytes: a short temporary root.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1", RAY_TMPDIR=ray_tmp)
    script = os.path.join(REPO, "examples", "python", "ray_train.py")
    try:
        r = subprocess.run(
            [sys.executable, script, "--workers", "2", "--storage", str(tmp_path / "results")],
            env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    out = r.stdout + r.stderr
    assert "2 workers over oxccl: done" in out, out[-3000:]
    assert "worker 0 of 2: all_reduce sum 3," in out, out[-3000:]
