"""A rank stopped while the others make torch groups (`dist.new_group`) on oxccl: the group's
init is watched by the default group's communicator (`Communicator::init_watched`), so the
survivors raise within seconds, naming the stopped rank, instead of after OXCCL_TIMEOUT.
Both torch backends (C++ and Python), 3 ranks."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, free_port

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
    os._exit(0)
"""

# What names the lost rank in an oxccl error (as test_torch_inference.py's _BLAME).
_BLAME = r"(lost peer rank {v}\b|cannot connect to rank {v}\b|rank {v} failed: |waiting on rank\(s\) \[{v}\b)"


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_rank_stopped_while_groups_are_made_is_named_within_seconds(backend):
    n, victim, timeout = 3, 1, 60
    port = free_port()
    secret = os.urandom(16).hex()
    procs = []
    for r in range(n):
        e = dict(os.environ)
        e.update(
            RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OXCCL_SECRET=secret,
            OXCCL_TIMEOUT=str(timeout), OXCCL_HEARTBEAT_TIMEOUT="1", OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1", OXCCL_TORCH_BACKEND=backend,
        )
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=REPO))
    try:
        deadline = time.monotonic() + 240
        for r, p in enumerate(procs):
            while True:
                line = p.stdout.readline()
                assert line and time.monotonic() < deadline, f"rank {r} ended before its loop"
                if line.strip() == "ready":
                    break
        time.sleep(0.5)  # most of a loop turn is the new group's init
        os.kill(procs[victim].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        for r, p in enumerate(procs):
            if r == victim:
                continue
            out, _ = p.communicate(timeout=timeout + 30)
            took = time.monotonic() - stopped
            assert p.returncode == 0, f"rank {r} rc {p.returncode}: {out}"
            m = re.search(r"raised (\w+) after ([0-9.]+) s: (.*)", out)
            assert m and m.group(1) in ("PeerLostError", "AbortedError"), f"rank {r}: {out}"
            assert re.search(_BLAME.format(v=victim), m.group(3)), f"rank {r} does not name rank {victim}: {out}"
            # The heartbeat timeout is 1 s; before the watch, the init waited OXCCL_TIMEOUT.
            assert took < 15, f"rank {r} raised only after {took:.1f} s: {out}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.communicate()
