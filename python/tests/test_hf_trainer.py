"""Hugging Face Trainer on CPU over oxccl (examples/python/hf_trainer.py): transformers and
accelerate refuse the name "oxccl" (a closed list of `ddp_backend` choices; accelerate's CPU
path turns every backend but "mpi" into "gloo"), and keep a default process group that is
already initialized. The workaround the docs give, initializing the group over oxccl before
the Trainer, trains a tiny GPT-2 built from a config to the same parameters as gloo."""

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import REPO, launch

torch = pytest.importorskip("torch")
for _mod in ("transformers", "accelerate"):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"{_mod} is not installed (pip install transformers accelerate)", allow_module_level=True)

SCRIPT = os.path.join(REPO, "examples", "python", "hf_trainer.py")


def train(backend, tmp_path):
    out = tmp_path / f"p_{backend}.pt"
    results = launch(2, script=SCRIPT, args=["--backend", backend, "--out", out], timeout=300)
    assert f"Trainer, 2 ranks over {backend}: loss" in results[0][1], results[0][1][-3000:]
    return torch.load(out)


def test_trainer_over_a_group_initialized_first_same_parameters_as_gloo(tmp_path):
    ref = train("gloo", tmp_path)
    got = train("oxccl", tmp_path)
    assert torch.equal(ref, got), (ref - got).abs().max()


def test_upstream_refuses_the_name():
    # What docs/torch.md says about the two frameworks: when either accepts the name, the
    # docs' workaround is no longer needed there and this test says so.
    code = r"""
import accelerate
from transformers import HfArgumentParser, TrainingArguments
try:
    accelerate.PartialState(cpu=True, backend="oxccl")
    print("accelerate accepted oxccl")
except ValueError as e:
    print("accelerate:", e)
try:
    HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(["--output_dir", "x", "--ddp_backend", "oxccl"])
    print("transformers accepted oxccl")
except SystemExit:
    print("transformers: invalid choice")
"""
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "accelerate: Your assigned backend oxccl is not available, please use gloo" in out, out[-3000:]
    assert "transformers: invalid choice" in out and "invalid choice: 'oxccl'" in out, out[-3000:]
