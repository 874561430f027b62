"""No hang and no crash reachable from torch: fork does not share a pool
tensor's writes, zero and negative timeouts expire at once, a process exits cleanly with
queued calls in flight, init/destroy repeats on one MASTER_PORT (rank 0 late to destroy in
odd rounds), async_op=True returns before a late peer at every size, the survivor of a
lost peer raises instead of crashing, and destroy_process_group
closes the communicator after its queued calls (see torch_lifecycle_worker.py)."""

import os
import signal

import pytest

from conftest import HERE, launch

pytest.importorskip("torch")

WORKER = os.path.join(HERE, "torch_lifecycle_worker.py")


def _run(n, scenario, args=(), env=None, timeout=90, expect_ok=True):
    res = launch(n, script=WORKER, args=[scenario, *args], env=env, timeout=timeout, expect_ok=expect_ok)
    return res


def test_fork_gives_the_child_private_copies_of_pool_tensors():
    env = {"OXCCL_TORCH_ALLOCATOR": "1"}
    for _, out in _run(2, "fork", env=env):
        assert "fork ok" in out, out


def test_a_child_forked_after_destroy_makes_its_own_group_and_exits_cleanly():
    for _, out in _run(2, "fork_after_destroy", timeout=120):
        assert "fork after destroy ok" in out, out


def test_zero_and_negative_timeouts_expire_at_once():
    for _, out in _run(2, "timeouts"):
        assert "timeouts ok" in out, out


def test_exit_with_queued_calls_in_flight_is_clean():
    """Every run of both ranks exits 0 (no "terminate called", no signal)."""
    runs = int(os.environ.get("OXCCL_EXIT_RUNS", "5"))
    failures = []
    for i in range(runs):
        res = _run(2, "exit_queued", timeout=60, expect_ok=False)
        for r, (rc, out) in enumerate(res):
            if rc != 0 or "exit_queued ok" not in out:
                failures.append((i, r, rc, out[-2000:]))
    assert not failures, f"{len(failures)} of {2 * runs} exits failed; first: {failures[0]}"


def test_async_op_is_asynchronous_at_every_size():
    """async_op=True returns before a late peer arrives (4 B and 16 KiB, which a blocking call
    runs inline; the peer 8 s late), work.wait(timeout=1 s) raises against it, and the group A/B scenario that
    deadlocked while small async calls ran inline completes."""
    # About 40 s of late peers (2 x 8 s, 8 x 3 s): room for a busy machine.
    for _, out in _run(2, "async_small", timeout=240):
        assert "async_small ok" in out, out


def test_reinit_on_the_same_master_port():
    for _, out in _run(2, "reinit", args=[5]):
        assert "reinit ok" in out, out


def test_ddp_survivor_of_a_lost_peer_raises():
    env = {"OXCCL_TIMEOUT": "20"}
    res = _run(2, "peer_exit_ddp", env=env, timeout=90, expect_ok=False)
    rc, out = res[0]
    assert rc == 0 and "peer_exit_ddp ok" in out, f"survivor rc {rc} (signal {-rc if rc < 0 else None})\n{out}"
    assert rc != -signal.SIGSEGV


def test_destroy_process_group_closes_the_communicator():
    """Rank 0's destroy_process_group waits for its queued call, then closes the communicator:
    later calls there raise, and the other ranks' next call fails within seconds naming rank 0
    (before: the communicator stayed open, and a call on it still ran)."""
    for _, out in _run(3, "shutdown", timeout=90):
        assert "shutdown ok" in out, out
