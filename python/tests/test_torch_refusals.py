"""Clear errors, never a crash or a silent write: oxccl.torch.inference_all_reduce on a leaf tensor that requires grad (refused as torch's own
in-place ops refuse it) or on a meta tensor (no memory: the device is named)."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("torch")

ONE_RANK = r"""
import torch, torch.distributed as dist
import oxccl, oxccl.torch as ot
dist.init_process_group("oxccl", store=dist.HashStore(), rank=0, world_size=1)

def refused(fn, cls, text):
    try:
        fn()
    except cls as e:
        assert text in str(e), str(e)
    else:
        raise AssertionError(f"no {cls.__name__} ({text})")

leaf = torch.ones(4, requires_grad=True)
refused(lambda: ot.inference_all_reduce(leaf), RuntimeError,
        "a leaf Variable that requires grad is being used in an in-place operation")
assert leaf.grad is None and torch.equal(leaf.detach(), torch.ones(4))
with torch.no_grad():  # as torch's in-place ops: allowed without grad mode
    ot.inference_all_reduce(leaf)
y = leaf * 2  # not a leaf: autograd's rules apply through the operator
ot.inference_all_reduce(y)
meta = torch.empty(4, device="meta")
refused(lambda: ot.inference_all_reduce(meta), oxccl.InvalidArgumentError, "meta")
refused(lambda: ot.inference_all_gather(meta), oxccl.InvalidArgumentError, "meta")
x = torch.arange(4.0)
ot.inference_all_reduce(x)
assert torch.equal(x, torch.arange(4.0))
dist.destroy_process_group()
print("OK", flush=True)
"""


def _run(code, **env):
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_inference_all_reduce_refusals():
    r = _run(ONE_RANK, MASTER_ADDR="127.0.0.1")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
