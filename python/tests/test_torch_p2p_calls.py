"""Gather, scatter and uneven all_to_all (run as point-to-point messages) never hand their
messages to another call's receive, nor take another call's, also after a call refused on
one rank only; two different ones on two ranks raise a mismatch naming both; a
batch_isend_irecv refused at its second operation and retried sends its first once (see
torch_p2p_calls_worker.py). With 2 and 3 ranks."""

import os

import pytest

from conftest import HERE, launch

pytest.importorskip("torch")


@pytest.mark.parametrize("n", [2, 3])
def test_p2p_calls_keep_to_their_messages(n):
    env = {"OXCCL_TIMEOUT": "20"}
    res = launch(n, script=os.path.join(HERE, "torch_p2p_calls_worker.py"), env=env, timeout=240)
    for _, out in res:
        assert "torch p2p calls ok" in out, out
