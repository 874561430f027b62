"""PyTorch's flight-recorder analyser reads oxccl's torch-format records (OXCCL_FR_DUMP)
unchanged: runs the Rust test crates/oxccl/tests/flight_torch.rs (a 3-rank job where rank 2
skips a collective) with this interpreter, which has torch, so that its analyser part runs
instead of being skipped."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torch_fr_trace_names_the_skipped_collective():
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("cargo is not on PATH")
    r = subprocess.run(
        [cargo, "test", "-q", "-p", "oxccl", "--test", "flight_torch", "--", "--nocapture"],
        cwd=REPO,
        env={**os.environ, "OXCCL_TEST_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "SKIPPED" not in out, out
    assert "Not all ranks joining collective, sequence number: 3" in out, out
    assert "missing ranks: {2}" in out, out
