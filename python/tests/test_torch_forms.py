"""Every call form torch can send a CPU backend, on the "oxccl" backend against gloo in the
same processes (see torch_forms_worker.py): all_gather_coalesced's [rank][tensor] outputs,
several tensors in one allreduce/broadcast (gloo's local reduction, rootTensor), aliased
tensors in a coalesced all_reduce, empty lists and bad roots (raised at call time, named),
non-contiguous views in every collective, sparse all_reduce, uneven reduce_scatter, several
inputs per rank in allgather, zero-element tensors, every CPU dtype (complex SUM, complex
MIN/MAX refused; int16, uint16..64, float8 where gloo has none), sequence numbers and object
collectives on subgroups under TORCH_DISTRIBUTED_DEBUG=DETAIL. One launch per world size."""

import os

import pytest

from conftest import HERE, launch

pytest.importorskip("torch")


@pytest.mark.parametrize("n", [2, 3])
def test_forms_match_gloo(n):
    res = launch(n, script=os.path.join(HERE, "torch_forms_worker.py"), timeout=240)
    for _, out in res:
        assert "torch forms ok" in out, out
