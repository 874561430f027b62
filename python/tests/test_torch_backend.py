"""The torch.distributed backend "oxccl" against gloo, with 2 and 3 processes; DDP; FSDP."""

import os

import pytest

from conftest import REPO, launch

pytest.importorskip("torch")


@pytest.mark.parametrize("n,default", [(2, "oxccl"), (3, "gloo")])
def test_every_call_matches_gloo(n, default):
    res = launch(n, "vs_gloo", args=[default], timeout=400)
    for _, out in res:
        assert "comparisons with gloo ok" in out, out


def test_ddp_same_parameters_as_gloo():
    res = launch(2, "ddp_vs_gloo")
    for _, out in res:
        assert "ddp oxccl == gloo ok" in out, out


def test_fsdp_cpu_trains():
    res = launch(2, "fsdp")
    for _, out in res:
        assert "fsdp ok" in out, out


@pytest.mark.parametrize("script", ["zero_sharded.py", "ddp_train.py", "numpy_allreduce.py"])
def test_python_examples(script):
    res = launch(2, script=os.path.join(REPO, "examples", "python", script))
    for _, out in res:
        assert "done" in out, out
