"""PyTorch Lightning's Trainer(accelerator="cpu", devices=2,
strategy=DDPStrategy(process_group_backend=...)) on examples/python/lightning_ddp.py, once
with gloo and once with oxccl: the same data and initial weights give the same trained weights.
The script imports no oxccl; the backend name comes from the package's torch entry point."""

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import REPO

torch = pytest.importorskip("torch")
if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("PyTorch Lightning is not installed (pip install lightning)", allow_module_level=True)

SCRIPT = os.path.join(REPO, "examples", "python", "lightning_ddp.py")


def train(backend, tmp_path):
    out = tmp_path / f"w_{backend}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MASTER_PORT", None)  # Lightning picks a free port
    r = subprocess.run(
        [sys.executable, SCRIPT, "--backend", backend, "--out", str(out)],
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    assert f"2 ranks over {backend}: final loss" in log, log[-3000:]
    return torch.load(out)


def test_lightning_ddp_same_weights_as_gloo(tmp_path):
    ref = train("gloo", tmp_path)
    got = train("oxccl", tmp_path)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), (k, (ref[k] - got[k]).abs().max())
    # The weights moved: the comparison is not of two untouched initializations.
    torch.manual_seed(0)
    init = torch.nn.Linear(16, 32)
    assert not torch.equal(init.weight, got["net.0.weight"])
