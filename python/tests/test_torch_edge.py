"""Call forms that test_torch_forms.py does not cover, each compared with a reference computed
in plain torch (see torch_edge_worker.py): storage offsets, channels_last, transposed outputs,
0-dim and zero-size tensors, all_to_all_single without split sizes where dim 0 does not divide
(refused), mixed dtypes (refused where input and output differ), overlapping input and output,
uneven tensor forms (refused), uneven and zero all-to-all splits and splits the ranks disagree
on (refused), complex, bool, unsigned, integer AVG on every path, float8, premul_sum with a
tensor factor, batch_isend_irecv with several peers and tags, the coalescing manager,
subgroups in reversed rank order and split_group, inference_all_reduce on views under
torch.compile. One launch per world size (about 30 s each on a loaded 2-core machine)."""

import os

import pytest

from conftest import HERE, launch

pytest.importorskip("torch")


@pytest.mark.parametrize("n", [2, 3])
def test_edges_match_torch(n):
    env = {"OXCCL_TIMEOUT": "20"}
    res = launch(n, script=os.path.join(HERE, "torch_edge_worker.py"), env=env, timeout=240)
    for _, out in res:
        assert "torch edges ok" in out, out
