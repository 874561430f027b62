"""oxccl.torch.inference_all_reduce and inference_all_gather (torch_inference_worker.py):
every dtype and op at sizes 0, 1, odd and large against references, a subgroup, the refused
forms; torch.compile(fullgraph=True) of a tensor-parallel step using both; a rank that exits
makes the others raise within the timeout. With 2 and 3 ranks."""

import os
import re
import signal
import sys

import pytest

from conftest import HERE, launch, signal_one

torch = pytest.importorskip("torch")

WORKER = os.path.join(HERE, "torch_inference_worker.py")


@pytest.mark.parametrize("n", [2, 3])
def test_eager_matches_reference(n):
    res = launch(n, script=WORKER, args=["eager"], timeout=300)
    for _, out in res:
        assert "inference eager ok" in out, out


def _compile_available():
    try:
        torch.compile(lambda x: x + 1, fullgraph=True, backend="eager")(torch.ones(1))
    except Exception as e:  # noqa: BLE001 - any reason compile cannot run here
        return str(e)
    return None


@pytest.mark.parametrize("n,compiler", [(2, "inductor"), (3, "aot_eager")])
def test_compiled_matches_eager(n, compiler):
    why = _compile_available()
    if why is not None:
        pytest.skip(f"torch.compile is not available here: {why}")
    env = {"INFER_COMPILE_BACKEND": compiler}
    res = launch(n, script=WORKER, args=["compile"], env=env, timeout=600)
    for _, out in res:
        assert "inference compile ok" in out, out


@pytest.mark.parametrize("n", [3])  # 3 ranks: two survivors; 2 ranks (~16 s) adds nothing more
def test_peer_exit_raises_within_timeout(n):
    timeout = 10
    res = launch(n, script=WORKER, args=["dies"], env={"OXCCL_TIMEOUT": str(timeout)}, timeout=120, expect_ok=False)
    for rank, (rc, out) in enumerate(res[:-1]):
        assert rc == 0, f"rank {rank} rc {rc}: {out}"
        m = re.search(r"raised (\w+) after ([0-9.]+) s", out)
        assert m, out
        assert m.group(1) in ("PeerLostError", "TimeoutError", "AbortedError", "Error"), out
        assert float(m.group(2)) < timeout + 5, out


# What names the lost rank in an oxccl error (as oxccl::blamed_rank reads it).
_BLAME = r"(lost peer rank {v}\b|cannot connect to rank {v}\b|protocol error from rank {v}\b|rank {v} failed: |waiting on rank\(s\) \[{v}\b)"


@pytest.mark.parametrize("sig,numel", [(signal.SIGKILL, 1024), (signal.SIGSTOP, 1 << 20)])
def test_killed_or_stopped_peer_raises_naming_it(sig, numel):
    """3 ranks loop checked inference_all_reduce calls (4 KiB: one-shot; 4 MiB: single-copy);
    rank 1 is SIGKILLed or SIGSTOPped mid-loop: ranks 0 and 2 must raise an oxccl error naming
    rank 1 within seconds (a stopped rank through the watchdog's heartbeats)."""
    victim, timeout = 1, 40
    env = {"OXCCL_TIMEOUT": str(timeout), "INFER_KILL_NUMEL": str(numel)}
    for r, rc, out, took in signal_one(3, [sys.executable, WORKER, "killed"], env, victim, sig, 0.02, timeout + 30):
        assert rc == 0, f"rank {r} rc {rc}: {out}"
        m = re.search(r"raised (\w+) after ([0-9.]+) s: (.*)", out)
        # PeerLostError, or AbortedError where another rank's word of the loss came first
        assert m and m.group(1) in ("PeerLostError", "AbortedError"), f"rank {r}: {out}"
        assert re.search(_BLAME.format(v=victim), m.group(3)), f"rank {r} does not name rank {victim}: {out}"
        # Quiet, the heartbeat's 1 s at most; ten times that, far under the timeout.
        assert took < 15, f"rank {r} raised only after {took:.1f} s: {out}"
