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


def test_tp_llama_example_matches_the_single_process_model():
    """The tensor-parallel decoder (examples/python/tp_llama.py): every way's float32 tokens equal the
    single-process model's (the script exits 1 otherwise), on a small model, 3 ranks."""
    small = ["--vocab", "384", "--dim", "192", "--heads", "6", "--hidden", "384", "--layers", "2",
             "--tokens", "6", "--check-tokens", "6", "--rounds", "1", "--ways", "oxccl_op,oxccl,gloo"]
    res = launch(3, script=os.path.join(REPO, "examples", "python", "tp_llama.py"), args=small)
    for _, out in res:
        assert "done" in out, out
    assert "float32 check: 6 tokens of every way equal" in res[0][1], res[0][1]


@pytest.mark.parametrize("script", ["zero_sharded.py", "ddp_train.py", "numpy_allreduce.py"])
def test_python_examples(script):
    res = launch(2, script=os.path.join(REPO, "examples", "python", script))
    for _, out in res:
        assert "done" in out, out


def test_set_default_timeout_bounds_later_calls():
    res = launch(2, "torch_set_default_timeout", timeout=120)
    assert "set default timeout ok" in res[0][1], res[0][1]
