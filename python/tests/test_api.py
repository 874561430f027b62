"""The Python API on numpy arrays and torch CPU tensors, with 1, 2 and 3 processes."""

import pytest

from conftest import launch


@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives_async_errors_split(n):
    res = launch(n, "api")
    for _, out in res:
        for what in ("collectives", "async", "errors", "split"):
            assert f"{what} ok" in out, out


@pytest.mark.parametrize("mode", ["addr", "unique_id"])
def test_init_without_launcher(mode, tmp_path):
    launch(2, "init_explicit", args=[mode], env={"OXCCL_TEST_DIR": str(tmp_path)})


def test_lost_peer_is_peer_lost_error():
    res = launch(2, "peer_lost")
    assert "peer lost ok" in res[0][1] and "aborted after ok" in res[0][1], res[0][1]


def test_a_rank_that_exits_holding_its_comm_leaves_rather_than_dies():
    res = launch(3, "exit_holding_comm")
    for _, out in res:
        assert "exit holding comm ok" in out, out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_forked_child_cannot_call_on_its_parents_comm(transport):
    res = launch(2, "forked_child_call", env={"OXCCL_TRANSPORT": transport, "OXCCL_TIMEOUT": "20"}, timeout=120)
    for _, out in res:
        assert "forked child call ok" in out, out


def test_timeout_is_timeout_error():
    res = launch(2, "timeout", env={"OXCCL_TIMEOUT": "1"})
    assert "timeout ok" in res[0][1], res[0][1]


def test_package_surface():
    import oxccl

    for name in ("Error", "TimeoutError", "PeerLostError", "MismatchError", "InvalidArgumentError", "AbortedError"):
        cls = getattr(oxccl, name)
        assert issubclass(cls, oxccl.Error)
    assert issubclass(oxccl.TimeoutError, TimeoutError)
    assert issubclass(oxccl.InvalidArgumentError, ValueError)
    with pytest.raises(oxccl.InvalidArgumentError):
        oxccl.init(rank=0)
    with pytest.raises(oxccl.InvalidArgumentError):
        oxccl.init(rank=0, world_size=1, unique_id="nonsense")


def test_error_classes_follow_the_c_headers_result_codes():
    """The native module and the C++ torch backend raise through ``_errors.for_result``: its
    codes must be oxccl.h's."""
    import re
    from pathlib import Path

    import oxccl
    from oxccl import _errors

    header = Path(__file__).resolve().parents[2] / "crates/oxccl-capi/include/oxccl.h"
    codes = dict((m[0], int(m[1])) for m in re.findall(r"\b(oxccl[A-Za-z]+) = (\d+)", header.read_text()))
    expect = {
        "oxcclInvalidArgument": oxccl.InvalidArgumentError,
        "oxcclTimeout": oxccl.TimeoutError,
        "oxcclPeerLost": oxccl.PeerLostError,
        "oxcclMismatch": oxccl.MismatchError,
        "oxcclAborted": oxccl.AbortedError,
        "oxcclRemoteError": oxccl.Error,
        "oxcclSystemError": oxccl.Error,
        "oxcclInternalError": oxccl.Error,
    }
    for name, cls in expect.items():
        assert _errors.for_result(codes[name]) is cls, name


@pytest.mark.parametrize("n", [2, 3])
def test_shared_arrays(n):
    res = launch(n, "shared", env={"OXCCL_DEBUG": "debug", "OXCCL_DEBUG_SUBSYS": "shm"})
    for _, out in res:
        assert "shared ok" in out, out
        # the large calls mapped the peers' arrays instead of copying through the kernel
        # (where ptrace rules allow it, as for cross-memory attach)
        if "cma=false" not in out:
            assert "mapped a peer's shared buffer" in out, out


def test_secret_empty_is_error_unset_warns(monkeypatch):
    import oxccl

    monkeypatch.setenv("OXCCL_SECRET", "")
    with pytest.raises(oxccl.InvalidArgumentError, match="OXCCL_SECRET is set but empty"):
        oxccl.init(rank=0, world_size=1, addr="127.0.0.1:1")
    with pytest.raises(oxccl.InvalidArgumentError, match="secret is set but empty"):
        oxccl.init(rank=0, world_size=1, addr="127.0.0.1:1", secret="")
    monkeypatch.delenv("OXCCL_SECRET")
    with pytest.warns(RuntimeWarning, match="OXCCL_SECRET is not set"):
        secret = oxccl._secret_for("127.0.0.1:1", 1, None)
    assert len(secret) == 32
