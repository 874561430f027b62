"""The shared-memory CPU allocator of the torch backend (oxccl/csrc/backend.cpp,
ShmAllocator): large tensors come from oxccl's pool of shared buffers once an oxccl group
exists, collectives and DDP on them give the reference results, small tensors and a forked
child's allocations stay private, OXCCL_TORCH_ALLOCATOR=0 turns it off (see
shm_allocator_worker.py)."""

import os

import pytest

from conftest import HERE, launch

pytest.importorskip("torch")


@pytest.mark.parametrize("n,mode", [(2, "on"), (3, "on"), (2, "off")])
def test_large_tensors_in_shared_memory(n, mode):
    import oxccl.torch as ot

    if ot._CPP is None:
        pytest.skip("the C++ torch backend is not built (python -m oxccl.build_torch_ext)")
    env = {"OXCCL_TORCH_ALLOCATOR": "1" if mode == "on" else "0"}
    res = launch(n, script=os.path.join(HERE, "shm_allocator_worker.py"), args=[mode], env=env, timeout=240)
    for _, out in res:
        assert f"shm allocator {mode} ok" in out, out
