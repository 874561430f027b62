"""Random sequences of torch.distributed calls on oxccl and on gloo in the same processes,
compared (torch_prop_worker.py). The seed is random per run and printed; OXCCL_PROP_SEED
replays one. OXCCL_PROP_CALLS sets the calls per run (default 1500: 3000 in all here)."""

import os
import random

import pytest

from conftest import HERE, launch  # noqa: F401

pytest.importorskip("torch")

CALLS = int(os.environ.get("OXCCL_PROP_CALLS", "1500"))


@pytest.mark.parametrize("n", [2, 3])
def test_random_calls_match_gloo(n):
    seed = int(os.environ.get("OXCCL_PROP_SEED", random.randrange(1 << 30)))
    print(f"seed {seed}")
    res = launch(n, script=os.path.join(HERE, "torch_prop_run.py"), args=[CALLS, seed], timeout=600)
    for r, (_, out) in enumerate(res):
        assert "property test ok" in out, f"seed {seed} (OXCCL_PROP_SEED={seed} replays it), rank {r}:\n{out}"
