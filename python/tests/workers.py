"""The rank side of the tests: each function runs in every rank process (see conftest.launch)."""

import os
import time

import numpy as np


def _ok(name):
    print(f"rank {os.environ['RANK']}: {name} ok", flush=True)


# ---------------------------------------------------------------------------------------------
# The plain API: numpy arrays and torch tensors.
# ---------------------------------------------------------------------------------------------
def api():
    import torch

    import oxccl

    comm = oxccl.init()  # from the launcher's environment
    r, n = comm.rank, comm.world_size
    assert (r, n) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))

    for lib in ("numpy", "torch"):
        def arr(vals, dtype):
            a = np.asarray(vals, dtype=dtype)
            return a if lib == "numpy" else torch.from_numpy(a)

        def npy(x):
            return x if isinstance(x, np.ndarray) else x.numpy()

        for dtype in (np.int8, np.uint8, np.int32, np.int64, np.uint64, np.float16, np.float32, np.float64):
            base = np.arange(12) % 5
            # all_reduce, in place and out of place, every op
            for op, ref in (
                ("sum", lambda: sum(base + k for k in range(n))),
                ("prod", lambda: np.prod([base % 2 + 1 for _ in range(n)], axis=0)),
                ("min", lambda: base + 0),
                ("max", lambda: base + n - 1),
            ):
                x = arr(base % 2 + 1 if op == "prod" else base + r, dtype).reshape(3, 4)
                y = comm.all_reduce(x, op=op)
                assert y is x
                assert np.array_equal(npy(x).reshape(-1), np.asarray(ref(), dtype=dtype)), (lib, dtype, op, x)
                out = arr(np.zeros(12), dtype)
                comm.all_reduce(arr(base + r, dtype), op="sum", out=out)
            # broadcast from the last rank
            x = arr(base * (r + 1), dtype)
            comm.broadcast(x, root=n - 1)
            assert np.array_equal(npy(x), np.asarray(base * n, dtype=dtype))
            # reduce to rank 0
            x = arr(base + r, dtype)
            comm.reduce(x, root=0, op="max")
            if r == 0:
                assert np.array_equal(npy(x), np.asarray(base + n - 1, dtype=dtype))
            # all_gather: allocated output, concatenated along the first axis
            g = comm.all_gather(arr(np.full((2, 3), r), dtype))
            assert tuple(g.shape) == (2 * n, 3)
            assert np.array_equal(npy(g)[::2, 0], np.arange(n).astype(dtype))
            # reduce_scatter
            rs = comm.reduce_scatter(arr(np.arange(4 * n), dtype), op="sum")
            assert np.array_equal(npy(rs), (np.arange(4 * n)[4 * r : 4 * r + 4] * n).astype(dtype))
            # all_to_all, out of place and in place
            x = arr(np.arange(2 * n) + 100 * r, dtype) if dtype not in (np.int8, np.uint8) else arr(np.arange(2 * n) + 10 * r, dtype)
            scale = 10 if dtype in (np.int8, np.uint8) else 100
            y = comm.all_to_all(x)
            expect = np.concatenate([np.arange(2 * r, 2 * r + 2) + scale * p for p in range(n)]).astype(dtype)
            assert np.array_equal(npy(y), expect), (npy(y), expect)
            comm.all_to_all(x, out=x)
            assert np.array_equal(npy(x), expect)
        # send / recv / sendrecv around a ring
        if n > 1:
            nxt, prv = (r + 1) % n, (r - 1) % n
            buf = arr(np.zeros(1000), np.float32)
            if r % 2 == 0:
                comm.send(arr(np.full(1000, r), np.float32), nxt)
                comm.recv(buf, prv)
            else:
                comm.recv(buf, prv)
                comm.send(arr(np.full(1000, r), np.float32), nxt)
            assert np.all(npy(buf) == prv)
            got = comm.sendrecv(arr(np.full(5, r), np.int32), nxt, arr(np.zeros(5), np.int32), prv)
            assert np.all(npy(got) == prv)
        comm.barrier()
    _ok("collectives")

    # bfloat16 through torch
    t = torch.full((7,), 1.5, dtype=torch.bfloat16)
    comm.all_reduce(t, op="avg")
    assert torch.equal(t, torch.full((7,), 1.5, dtype=torch.bfloat16))

    # async: handles, ordering with blocking calls, results
    big = np.ones(1 << 20, np.float32)
    h1 = comm.all_reduce(big, async_op=True)
    h2 = comm.all_gather(np.full(3, r, np.int64), async_op=True)
    small = np.full(4, r, np.int32)
    comm.all_reduce(small, op="max")  # runs after h1 and h2
    assert h1.is_completed() and h2.is_completed()
    assert h1.wait() is big and np.all(big == n)
    assert np.array_equal(h2.wait(), np.repeat(np.arange(n), 3))
    handles = [comm.all_reduce(torch.full((100,), float(i)), async_op=True) for i in range(50)]
    for i, h in enumerate(handles):
        assert torch.all(h.wait() == i * n)
    comm.barrier(async_op=True).wait()
    comm.synchronize()
    assert comm.pending() == 0
    _ok("async")

    # errors: arguments are checked before anything is sent
    def raises(cls, f, *a, **k):
        try:
            f(*a, **k)
        except cls as e:
            assert isinstance(e, oxccl.Error)
            return str(e)
        raise AssertionError(f"{f.__name__}{a} did not raise {cls.__name__}")

    raises(oxccl.InvalidArgumentError, comm.all_reduce, np.ones((4, 4), np.float32)[:, ::2])
    raises(oxccl.InvalidArgumentError, comm.all_reduce, torch.ones(4, 4).t())
    raises(oxccl.InvalidArgumentError, comm.all_reduce, np.ones(3, np.complex64))
    raises(oxccl.InvalidArgumentError, comm.all_reduce, torch.ones(3, dtype=torch.bool))
    raises(oxccl.InvalidArgumentError, comm.all_reduce, [1.0, 2.0])
    raises(oxccl.InvalidArgumentError, comm.all_reduce, np.ones(3, np.float32), op="xor")
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False
    raises(oxccl.InvalidArgumentError, comm.all_reduce, ro)
    raises(oxccl.InvalidArgumentError, comm.all_reduce, np.ones(3, np.float32), out=np.ones(3, np.float64))
    msg = raises(oxccl.InvalidArgumentError, comm.reduce_scatter, np.ones(5, np.float32), out=np.ones(1, np.float32))
    assert "reduce_scatter" in msg
    h = comm.all_gather(np.ones(2, np.float32), out=np.ones(3, np.float32), async_op=True)
    raises(oxccl.InvalidArgumentError, h.wait)
    if n > 1:
        raises(oxccl.InvalidArgumentError, comm.send, np.ones(2, np.float32), r)
    # still usable after rejected arguments
    x = np.ones(3, np.float32)
    comm.all_reduce(x)
    assert np.all(x == n)
    _ok("errors")

    # split: even and odd ranks, reversed order inside each group; the last rank opts out.
    color = None if (n > 2 and r == n - 1) else r % 2
    sub = comm.split(color, key=-r)
    if color is None:
        assert sub is None
    else:
        members = [p for p in range(n) if p % 2 == color and not (n > 2 and p == n - 1)]
        assert sub.world_size == len(members)
        assert sub.rank == sorted(members, reverse=True).index(r)
        g = sub.all_gather(np.array([r], np.int64))
        assert list(g) == sorted(members, reverse=True)
    comm.barrier()
    _ok("split")


def init_explicit(mode):
    """oxccl.init with an explicit address or unique id (no launcher variables used)."""
    import oxccl

    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr = f"127.0.0.1:{os.environ['MASTER_PORT']}"
    if mode == "addr":
        comm = oxccl.init(rank=r, world_size=n, addr=addr, secret="0123456789abcdef0123456789abcdef")
    else:
        # Rank 0 makes the id and passes it on through a file.
        path = os.path.join(os.environ["OXCCL_TEST_DIR"], "uid")
        if r == 0:
            uid = oxccl.new_unique_id("127.0.0.1")
            with open(path + ".tmp", "w") as f:
                f.write(uid)
            os.rename(path + ".tmp", path)
        else:
            while not os.path.exists(path):
                time.sleep(0.01)
            uid = open(path).read()
        comm = oxccl.init(rank=r, world_size=n, unique_id=uid)
    x = np.full(3, r + 1.0)
    comm.all_reduce(x)
    assert np.all(x == n * (n + 1) / 2)
    _ok("init " + mode)


def peer_lost():
    import oxccl

    comm = oxccl.init()
    if comm.rank == 1:
        os._exit(0)
    try:
        comm.all_reduce(np.ones(1 << 20, np.float32))
    except oxccl.PeerLostError as e:
        assert "lost peer rank 1" in str(e), e
        _ok("peer lost")
        # Anything later says the communicator is unusable.
        try:
            comm.barrier()
        except oxccl.Error as e2:
            assert isinstance(e2, oxccl.AbortedError), type(e2)
            _ok("aborted after")
        return
    raise AssertionError("no error")


def timeout():
    import oxccl

    comm = oxccl.init()
    if comm.rank == 1:
        time.sleep(6)  # never calls; exits after rank 0 timed out
        return
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(8, np.float32), async_op=True).wait()
    except oxccl.TimeoutError as e:
        assert isinstance(e, TimeoutError)  # also the builtin
        assert time.monotonic() - t0 < 5.5
        _ok("timeout")
        return
    raise AssertionError("no timeout")
