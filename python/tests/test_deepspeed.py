"""DeepSpeed on CPU: deepspeed.init_distributed(dist_backend=...) and ZeRO stages 1, 2 and 3
(examples/python/deepspeed_zero.py, a torch optimizer, DS_ACCELERATOR=cpu), once with gloo and
once with oxccl: the same data and initial weights give the same trained parameters at every
stage. The script imports no oxccl; the backend name comes from the package's torch entry point."""

import importlib.util
import os
import sys

import pytest

from conftest import REPO, launch

torch = pytest.importorskip("torch")
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed (pip install deepspeed)", allow_module_level=True)

SCRIPT = os.path.join(REPO, "examples", "python", "deepspeed_zero.py")
STAGES = (1, 2, 3)


def train(backend, tmp_path, attempts=1):
    out = tmp_path / f"p_{backend}.pt"
    for attempt in range(attempts):
        results = launch(
            2, script=SCRIPT, args=["--backend", backend, "--stage", *STAGES, "--out", out],
            # DeepSpeed's cpu accelerator compiles its shared-memory op at init_distributed
            # (whatever the backend; once, cached by torch) and wants ninja on PATH: the venv's.
            env={"DS_ACCELERATOR": "cpu", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")},
            timeout=600,
            expect_ok=attempt == attempts - 1,
        )
        if all(rc == 0 for rc, _ in results):
            break
        # Only the gloo reference gets a second run: under load its non-root rank has been seen
        # to abort in teardown ("terminate called without an active exception") after every
        # collective had completed. Whatever oxccl's run does is the product and is judged once.
        print(f"{backend} reference run {attempt} failed, rerunning: {[rc for rc, _ in results]}\n{results[1][1][-2000:]}")
    for s in STAGES:
        assert f"ZeRO stage {s}, 2 ranks over {backend}: loss" in results[0][1], results[0][1][-3000:]
    return torch.load(out)


def test_zero_stages_same_parameters_as_gloo(tmp_path):
    ref = train("gloo", tmp_path, attempts=2)
    got = train("oxccl", tmp_path)
    for s in STAGES:
        assert torch.equal(ref[s], got[s]), (s, (ref[s] - got[s]).abs().max())
    # The stages agree with one another (ZeRO shards the same computation), and training moved
    # the parameters away from their initialization.
    torch.manual_seed(0)
    init = torch.cat([p.detach().flatten() for p in torch.nn.Linear(16, 64).parameters()])
    assert not torch.equal(got[1][: init.numel()], init)
    for s in STAGES[1:]:
        assert torch.allclose(got[s], got[1], rtol=1e-5, atol=1e-6), s
