"""The modern torch.distributed stack on the "oxccl" backend, each feature compared with gloo
in the same processes (see torch_features_worker.py): DeviceMesh 1-D and 2-D, FSDP2,
distributed checkpointing, DTensor, functional collectives (eager and compiled),
torch.compile(DDP), the PowerSGD hook, a blocking collective in a .then() callback,
gather/scatter and their object forms, monitored_barrier, split_group, send-first 16 MiB
isend/irecv, tags across groups, recv from any source, an isend not waited for,
work.wait(timeout=), dtypes (bool, uint16, uint32, uint64) and ops (BAND, BOR, BXOR,
PREMUL_SUM). One launch per world size runs
every check, with 2 and 3 ranks."""

import os

import pytest

from conftest import HERE, launch

pytest.importorskip("torch")


@pytest.mark.parametrize("n", [2, 3])
def test_features_match_gloo(n, tmp_path):
    """The backend (oxccl/csrc, which must be built: the worker asserts it is the one in
    use) against gloo."""
    env = {}
    res = launch(n, script=os.path.join(HERE, "torch_features_worker.py"), args=[str(tmp_path)], env=env, timeout=400)
    for _, out in res:
        assert "torch features ok" in out, out


def test_monitored_barrier_names_the_missing_rank():
    res = launch(2, script=os.path.join(HERE, "torch_features_worker.py"), args=["-", "missing_rank"], timeout=120)
    assert "monitored_barrier: rank(s) [1] did not reach the barrier" in res[0][1], res[0][1]
