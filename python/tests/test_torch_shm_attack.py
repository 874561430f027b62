"""Attacks on the paths through shared tensors (shm_attack_worker.py): views, offsets and
private tensors on some ranks against gloo; more shared blocks than a peer keeps mapped; a
peer SIGKILLed mid-call on the mapped path; the pool under a low limit of open files."""

import os

import pytest

from conftest import HERE, launch

pytest.importorskip("torch")
SCRIPT = os.path.join(HERE, "shm_attack_worker.py")


def cpp_backend():
    import oxccl.torch as ot

    if ot._CPP is None:
        pytest.skip("the C++ torch backend is not built (python -m oxccl.build_torch_ext)")
    return {}


@pytest.mark.parametrize("n", [2, 3])
def test_views_and_mixed_placements_match_gloo(n):
    env = cpp_backend()
    res = launch(n, script=SCRIPT, args=["diff", 400], env=env, timeout=300)
    for _, out in res:
        print(out.strip().splitlines()[-1])
        assert "attack diff ok" in out, out


def test_more_blocks_than_peers_keep_mapped_and_async_frees():
    res = launch(2, script=SCRIPT, args=["many"], env=cpp_backend(), timeout=300)
    for _, out in res:
        assert "attack many ok" in out, out


def test_a_peer_killed_on_the_mapped_path_is_named_by_the_survivors():
    res = launch(3, script=SCRIPT, args=["kill"], env=cpp_backend(), timeout=120, expect_ok=False)
    for rank, (rc, out) in enumerate(res[:2]):
        print(out.strip())
        assert rc == 0 and "attack kill ok" in out, f"rank {rank} (rc {rc}):\n{out}"


def test_the_pool_leaves_open_files_to_the_program():
    res = launch(2, script=SCRIPT, args=["fdlimit"], env=cpp_backend(), timeout=240)
    for _, out in res:
        print(out.strip().splitlines()[-1])
        assert "attack fdlimit ok" in out, out


@pytest.mark.parametrize("text,want", [("8K", 8 << 10), ("0", 0), ("1G", 1 << 30), ("1024G", 1 << 40),
                                       ("-1", None), ("-1K", None), ("2048G", None), ("1.5M", None), ("", None)])
def test_shm_min_is_bytes_from_0_to_1024g(monkeypatch, text, want):
    import oxccl
    import oxccl.torch as ot

    monkeypatch.setenv("OXCCL_TORCH_ALLOCATOR", "1")
    monkeypatch.setenv("OXCCL_TORCH_SHM_MIN", text)
    if want is None:
        # was: -1 passed on, and pybind's "incompatible function arguments" TypeError from
        # install_shm_allocator at the first group
        with pytest.raises(oxccl.InvalidArgumentError, match="OXCCL_TORCH_SHM_MIN"):
            ot._shm_allocator_settings()
    else:
        assert ot._shm_allocator_settings() == want
