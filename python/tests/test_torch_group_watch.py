"""A rank stopped while the others make torch groups (`dist.new_group`) on oxccl: the group's
init is watched by the default group's communicator (`Communicator::init_watched`), so the
survivors raise within seconds, naming the stopped rank, instead of after OXCCL_TIMEOUT.
3 ranks."""

import re
import signal
import sys

import pytest

from conftest import signal_one

torch = pytest.importorskip("torch")

# Each rank loops: a new group of every rank, one all_reduce on it (checked), its destroy.
_WORKER = r"""
import os, time
import torch, torch.distributed as dist
import oxccl.torch  # noqa: F401
dist.init_process_group("oxccl")
r, n = dist.get_rank(), dist.get_world_size()
print("ready", flush=True)
t0 = time.monotonic()
try:
    for i in range(100000):
        g = dist.new_group(list(range(n)), backend="oxccl")
        x = torch.ones(16)
        dist.all_reduce(x, group=g)
        assert x.eq(n).all(), x
        dist.destroy_process_group(g)
except Exception as e:
    print(f"raised {type(e).__name__} after {time.monotonic() - t0:.2f} s: {e}", flush=True)
    # Rank 0 hosts torch's store: leaving at once would fail a slower survivor's next store
    # call (torch's DistNetworkError, "connection reset") before oxccl could name the
    # stopped rank to it (a race the suite has hit). Every survivor stays 4 s.
    time.sleep(4)
    os._exit(0)
"""

# What names the lost rank in an oxccl error (as test_torch_inference.py's _BLAME).
_BLAME = r"(lost peer rank {v}\b|cannot connect to rank {v}\b|rank {v} failed: |waiting on rank\(s\) \[{v}\b)"


def test_rank_stopped_while_groups_are_made_is_named_within_seconds():
    victim, timeout = 1, 60
    env = {"OXCCL_TIMEOUT": str(timeout)}
    # 0.5 s: most of a loop turn is the new group's init
    for r, rc, out, took in signal_one(3, [sys.executable, "-c", _WORKER], env, victim, signal.SIGSTOP, 0.5, timeout + 30):
        assert rc == 0, f"rank {r} rc {rc}: {out}"
        m = re.search(r"raised (\w+) after ([0-9.]+) s: (.*)", out)
        assert m and m.group(1) in ("PeerLostError", "AbortedError"), f"rank {r}: {out}"
        assert re.search(_BLAME.format(v=victim), m.group(3)), f"rank {r} does not name rank {victim}: {out}"
        # The heartbeat timeout is 1 s; before the watch, the init waited OXCCL_TIMEOUT.
        assert took < 15, f"rank {r} raised only after {took:.1f} s: {out}"
