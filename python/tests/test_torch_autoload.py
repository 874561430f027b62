"""The backend name "oxccl" is known in any process that imports torch, with no import of
oxccl (torch's ``torch.backends`` entry point group, loaded at ``import torch``), and that
costs nothing heavy: oxccl's Rust extension and C++ backend load when a group is made."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, launch

pytest.importorskip("torch")

# No import of oxccl anywhere: the name comes from the entry point.
WORKER = r"""
import sys
import torch
import torch.distributed as dist
loaded = sorted(m for m in sys.modules if m == "oxccl" or m.startswith(("oxccl.", "oxccl_")))
assert loaded == ["oxccl_autoload"], loaded
dist.init_process_group("oxccl")
assert dist.get_backend() == "oxccl", dist.get_backend()
assert "oxccl._oxccl" in sys.modules
t = torch.arange(6, dtype=torch.float32) + dist.get_rank()
dist.all_reduce(t)
want = 2 * torch.arange(6, dtype=torch.float32) + 1
assert torch.equal(t, want), t
g = dist.new_group([0, 1], backend="oxccl")
u = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(u, group=g)
assert torch.equal(u, torch.full((3,), 3.0)), u
dist.destroy_process_group()
print("OK", flush=True)
"""


def _python(code, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], env=e, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_init_process_group_without_importing_oxccl(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    for rc, out in launch(2, script=str(script), env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}):
        assert rc == 0 and "OK" in out, out


def test_autoload_off_leaves_the_name_unknown():
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "assert 'oxccl_autoload' not in sys.modules\n"
        "assert not dist.is_backend_available('oxccl')\n"
        "try:\n"
        "    dist.init_process_group('oxccl', store=dist.HashStore(), rank=0, world_size=1)\n"
        "except Exception as e:\n"
        "    print('REFUSED', type(e).__name__, e)\n"
        "else:\n"
        "    print('MADE')\n"
    )
    r = _python(code, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "REFUSED" in r.stdout, r.stdout


def test_import_torch_loads_no_oxccl_extension():
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "assert dist.is_backend_available('oxccl')\n"
        "heavy = sorted(m for m in sys.modules if m == 'oxccl' or m.startswith('oxccl.'))\n"
        "print('HEAVY', heavy)\n"
    )
    r = _python(code, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HEAVY []" in r.stdout, r.stdout


def test_a_broken_autoload_does_not_break_import_torch(tmp_path):
    # torch turns an entry point's exception into a failed `import torch`: the entry point
    # must swallow its own failures. Here torch.distributed's register_backend raises.
    code = (
        "import torch.distributed.distributed_c10d as c10d\n"
        "def boom(*a, **k): raise RuntimeError('boom')\n"
        "import oxccl_autoload, torch.distributed as dist\n"
        "dist.Backend.register_backend = classmethod(boom)\n"
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    dist.Backend.backend_list[:] = [b for b in dist.Backend.backend_list if b != 'oxccl']\n"
        "    oxccl_autoload.register()\n"
        "print('WARNED', [str(x.message) for x in w])\n"
    )
    r = _python(code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "could not register" in r.stdout and "boom" in r.stdout, r.stdout
