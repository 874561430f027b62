"""The rank side of the tests: each function runs in every rank process (see conftest.launch)."""

import os
import sys
import time

import numpy as np


def _ok(name):
    print(f"rank {os.environ['RANK']}: {name} ok", flush=True)


# ---------------------------------------------------------------------------------------------
# The plain API: numpy arrays and torch tensors.
# ---------------------------------------------------------------------------------------------
class pytest_raises:
    """``pytest.raises`` without pytest in the rank processes: the error and its text."""

    def __init__(self, cls, text):
        self.cls, self.text = cls, text

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        assert et is not None, f"expected {self.cls.__name__}"
        assert issubclass(et, self.cls) and self.text in str(e), (et, e)
        return True


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
        # bool (logical ops), uint16/uint32, bitwise ops, premul_sum
        bits = np.array([(r >> k) & 1 for k in range(3)] * 3, dtype=bool) if n > 1 else np.array([1, 0, 1] * 3, bool)
        every = [np.array([(q >> k) & 1 for k in range(3)] * 3, dtype=bool) if n > 1 else bits for q in range(n)]
        for op, ref in (("sum", np.logical_or), ("max", np.logical_or), ("prod", np.logical_and),
                        ("min", np.logical_and), ("band", np.logical_and), ("bor", np.logical_or),
                        ("bxor", np.logical_xor)):
            x = comm.all_reduce(arr(bits.copy(), bool), op=op)
            want = every[0]
            for q in range(1, n):
                want = ref(want, every[q])
            assert np.array_equal(npy(x), want), (lib, op, npy(x), want)
        with pytest_raises(oxccl.InvalidArgumentError, "avg is not defined on bool"):
            comm.all_reduce(arr(bits, bool), op="avg")
        with pytest_raises(oxccl.InvalidArgumentError, "bitwise"):
            comm.all_reduce(arr(np.ones(3), np.float32), op="bxor")
        for dtype in (np.uint16, np.uint32, np.uint64):
            v = (np.arange(10) * 37 + r * 11) % 4096
            x = comm.all_reduce(arr(v, dtype), op="bxor")
            want = np.zeros(10, np.int64)
            for q in range(n):
                want ^= (np.arange(10) * 37 + q * 11) % 4096
            assert np.array_equal(npy(x), want.astype(dtype)), (lib, dtype)
        x = comm.all_reduce(arr(np.arange(6) + r, np.float32), op=("premul_sum", 0.5 * (r + 1)))
        want = sum((np.arange(6) + q) * 0.5 * (q + 1) for q in range(n))
        assert np.array_equal(npy(x), want.astype(np.float32)), (npy(x), want)
        x = comm.all_reduce(arr(np.arange(6) + r, np.int32), op=("premul_sum", 3))
        assert np.array_equal(npy(x), sum((np.arange(6) + q) * 3 for q in range(n)).astype(np.int32))
        # point-to-point: send-first groups larger than the links' buffers, tags, any source
        if n > 1:
            big = 3 << 20  # float32 elements: 12 MiB
            ops = [("send", arr(np.full(big, r * 10 + p, np.float32), np.float32), p, 0) for p in range(n) if p != r]
            outs = {p: arr(np.zeros(big), np.float32) for p in range(n) if p != r}
            ops += [("recv", outs[p], p, 0) for p in outs]
            srcs = comm.p2p(ops)
            assert srcs[-len(outs):] == list(outs), srcs
            for p, o in outs.items():
                assert np.all(npy(o) == p * 10 + r)
            hs = [comm.send(arr(np.full(9, t, np.uint16), np.uint16), nxt, tag=t, async_op=True) for t in (1, 2, 3)]
            for t in (3, 1, 2):
                got = comm.recv(arr(np.zeros(9), np.uint16), prv, tag=t)
                assert np.all(npy(got) == t), (t, npy(got))
            for h in hs:
                h.wait()
            if r == 0:
                seen = set()
                for _ in range(n - 1):
                    buf = arr(np.zeros(4), np.int64)
                    src = comm.recv_any(buf, tag=7)
                    assert np.all(npy(buf) == src) and src not in seen, (src, npy(buf))
                    seen.add(src)
                assert seen == set(range(1, n))
            else:
                comm.send(arr(np.full(4, r), np.int64), 0, tag=7)
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
    raises(oxccl.InvalidArgumentError, comm.all_reduce, torch.ones(3, dtype=torch.complex64))
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
    # The native module reads every buffer itself (the buffer protocol) and checks it.
    a = np.ones(8, np.float32)
    msg = raises(oxccl.InvalidArgumentError, comm.all_reduce, a[:6], out=a[2:])
    assert "overlap" in msg, msg
    msg = raises(oxccl.InvalidArgumentError, comm.all_reduce, np.ones(3, ">f4"))
    assert "unsupported element type" in msg, msg
    raises(oxccl.InvalidArgumentError, comm.all_reduce, np.ones(3, np.int16))
    # a declared element type only reinterprets an integer buffer of the same item size
    raw = comm._raw
    raises(oxccl.InvalidArgumentError, raw.call, "all_reduce", "sum", 0, 0, None, np.ones(3, np.uint8), "float64")
    raises(oxccl.InvalidArgumentError, raw.call, "all_reduce", "sum", 0, 0, None, np.ones(3, np.float64), "float32")
    raises(oxccl.InvalidArgumentError, raw.call, "all_reduce", "sum", 0, 0, None, bytearray(4), "nonsense")
    raises(oxccl.InvalidArgumentError, raw.call, "all_reduce", "sum", 0, 0, None, b"abcd")  # read-only
    raises(oxccl.InvalidArgumentError, raw.call, "all_reduce", "sum", 0, 0, None, 12345)  # no buffer
    msg = raises(oxccl.InvalidArgumentError, comm.p2p, [("send", a, r, 0), ("recv", a[4:], r, 0)])
    assert "overlaps" in msg, msg
    # the same memory through two objects: in place
    a[:] = 1
    comm.all_reduce(a, out=a[:])
    assert np.all(a == n)
    tb = torch.ones(5, dtype=torch.bfloat16)
    comm.all_reduce(tb)
    assert torch.all(tb == n), tb
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


def exit_holding_comm():
    """Rank 0 ends the program right after a barrier while a daemon thread still holds its
    ``Comm`` (the interpreter's finalization cannot free it: as a communicator held by torch or
    a reference cycle); rank 2 waits in a receive from rank 1, which sends 1.5 s later: rank 2
    gets the data (rank 0 left with a goodbye from oxccl's exit hook; a rank lost would fail
    rank 2's receive)."""
    import threading

    import oxccl

    comm = oxccl.init()
    comm.barrier()
    if comm.rank == 0:
        threading.Thread(target=lambda c=comm: time.sleep(1e6), daemon=True).start()
        _ok("exit holding comm")
        return
    if comm.rank == 1:
        time.sleep(1.5)
        comm.send(np.arange(4, dtype=np.float32), 2)
    else:
        x = np.zeros(4, dtype=np.float32)
        comm.recv(x, 1)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0], x
    _ok("exit holding comm")


def forked_child_call():
    """A child forked from rank 0 calls ``all_reduce`` (and a barrier, a send) on the ``Comm``
    it inherited: each is refused with an error naming the fork, before anything moves, and
    its exit leaves the parent's communicator alone. Meanwhile rank 1 goes on at once to the
    all-reduce a call of the child would pair with: it gets the right sum, as do the calls
    after (unrefused, the child's call made rank 1's next call return 3.0 where 2.0 is right in
    131,072 elements)."""
    import oxccl

    comm = oxccl.init()
    r, n = comm.rank, comm.world_size
    comm.barrier()
    if r == 0:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for call in (
                    lambda: comm.all_reduce(np.ones(131072, np.float32)),
                    comm.barrier,
                    lambda: comm.send(np.ones(4, np.float32), 1),
                ):
                    try:
                        call()
                        code = 3
                    except oxccl.InvalidArgumentError as e:
                        if "forked child" not in str(e):
                            code = 4
                    except Exception:
                        code = 5
                del comm
            finally:
                # The exit hooks run (a normal exit), with the parent's communicator inherited.
                os._exit(code) if code else sys.exit(0)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        assert code == 0, f"the child's calls were not refused (exit {code}; 3: ran, 4/5: other error)"
    for it in range(3):
        x = np.full(131072, float(r + 1 + it), np.float32)
        comm.all_reduce(x)
        want = float(sum(q + 1 + it for q in range(n)))
        assert np.all(x == want), (it, x[:4], want, int(np.sum(x != want)))
    comm.barrier()
    _ok("forked child call")


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
        time.sleep(12)  # never calls; exits after rank 0 timed out
        return
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(8, np.float32), async_op=True).wait()
    except oxccl.TimeoutError as e:
        assert isinstance(e, TimeoutError)  # also the builtin
        # OXCCL_TIMEOUT=1 (test_api.py): ten times that.
        assert time.monotonic() - t0 < 10
        _ok("timeout")
        return
    raise AssertionError("no timeout")


def torch_set_default_timeout():
    """``dist.set_timeout`` (``ProcessGroup.set_timeout``, as gloo's): the group was made
    with a 600 s timeout; after it is set to 2 s, a call that rank 1 never joins fails on
    rank 0 with a timeout error well before 600 s (the test's 120 s bound catches a value
    left ignored)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import oxccl

    dist.init_process_group("oxccl", timeout=timedelta(seconds=600))
    pg = dist.group.WORLD
    with pytest_raises(Exception, "not positive"):
        pg.set_timeout(timedelta(0))
    dist.set_timeout(timedelta(seconds=2))
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        store.wait(["timed out"], timedelta(seconds=100))  # never calls; alive meanwhile
        return
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8))
    except oxccl.TimeoutError as e:
        print(f"rank 0: timed out after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        assert "all_reduce" in str(e), e
        _ok("set default timeout")
        return
    finally:
        store.set("timed out", "1")
    raise AssertionError("no timeout")


# ---------------------------------------------------------------------------------------------
# The torch backend, against gloo.
# ---------------------------------------------------------------------------------------------
def _setup_torch(default):
    import torch.distributed as dist

    import oxccl.torch  # noqa: F401 - registers "oxccl"

    dist.init_process_group(default)
    other = "gloo" if default == "oxccl" else "oxccl"
    sub = dist.new_group(backend=other)
    groups = {default: dist.group.WORLD, other: sub}
    assert dist.get_backend(groups["oxccl"]) == "oxccl"
    return groups["oxccl"], groups["gloo"]


def _close(a, b, what):
    import torch

    if a.dtype in (torch.float16, torch.bfloat16):
        ok = torch.allclose(a.double(), b.double(), rtol=2e-2, atol=2e-2)
    elif a.dtype.is_floating_point:
        ok = torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
        ok = torch.equal(a, b)
    assert ok and a.shape == b.shape, f"{what}: oxccl {a} vs gloo {b}"


def vs_gloo(default):
    import torch
    import torch.distributed as dist

    ox, gl = _setup_torch(default)
    r, n = dist.get_rank(), dist.get_world_size()
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64]
    shapes = [(1,), (13,), (4, 6), (2049,)]
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.AVG]
    g = torch.Generator().manual_seed(1234 + r)

    def rand(shape, dtype, small=False):
        if dtype.is_floating_point:
            t = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5 if small else torch.randn(shape, generator=g, dtype=torch.float64)
            return t.to(dtype)
        hi = 3 if small else 50
        return torch.randint(0, hi, shape, generator=g).to(dtype)

    checked = 0
    for dtype in dtypes:
        for shape in shapes:
            numel = int(torch.tensor(shape).prod())
            # all_reduce, every op (gloo has no AVG: compare with SUM / n)
            for op in ops:
                x = rand(shape, dtype, small=op == dist.ReduceOp.PRODUCT)
                a, b = x.clone(), x.clone()
                w = dist.all_reduce(a, op=op, group=ox, async_op=True)
                w.wait()
                # once wait() has returned, the future is done too (as gloo's)
                assert w.get_future().done()
                if op == dist.ReduceOp.AVG:
                    dist.all_reduce(b, op=dist.ReduceOp.SUM, group=gl)
                    b = (b.double() / n).to(dtype) if dtype.is_floating_point else torch.div(b, n, rounding_mode="trunc")
                else:
                    dist.all_reduce(b, op=op, group=gl)
                _close(a, b, f"all_reduce {op} {dtype} {shape}")
                checked += 1
            # broadcast, reduce from/to the last rank
            x = rand(shape, dtype)
            a, b = x.clone(), x.clone()
            dist.broadcast(a, src=n - 1, group=ox)
            dist.broadcast(b, src=n - 1, group=gl)
            _close(a, b, f"broadcast {dtype}")
            a, b = x.clone(), x.clone()
            dist.reduce(a, dst=n - 1, op=dist.ReduceOp.MAX, group=ox)
            dist.reduce(b, dst=n - 1, op=dist.ReduceOp.MAX, group=gl)
            if r == n - 1:
                _close(a, b, f"reduce {dtype}")
            # all_gather (list) and all_gather_into_tensor
            la = [torch.empty(shape, dtype=dtype) for _ in range(n)]
            lb = [torch.empty(shape, dtype=dtype) for _ in range(n)]
            dist.all_gather(la, x, group=ox)
            dist.all_gather(lb, x, group=gl)
            for p in range(n):
                _close(la[p], lb[p], f"all_gather {dtype}")
            oa = torch.empty((n * shape[0],) + shape[1:], dtype=dtype)
            ob = torch.empty_like(oa)
            dist.all_gather_into_tensor(oa, x, group=ox)
            dist.all_gather_into_tensor(ob, x, group=gl)
            _close(oa, ob, f"all_gather_into_tensor {dtype}")
            # reduce_scatter (list) and reduce_scatter_tensor
            ins = [rand(shape, dtype) for _ in range(n)]
            a, b = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            dist.reduce_scatter(a, [t.clone() for t in ins], op=dist.ReduceOp.SUM, group=ox)
            dist.reduce_scatter(b, [t.clone() for t in ins], op=dist.ReduceOp.SUM, group=gl)
            _close(a, b, f"reduce_scatter {dtype}")
            big = torch.cat([t.reshape(-1) for t in ins])
            a, b = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
            dist.reduce_scatter_tensor(a, big, op=dist.ReduceOp.MIN, group=ox)
            dist.reduce_scatter_tensor(b, big, op=dist.ReduceOp.MIN, group=gl)
            _close(a, b, f"reduce_scatter_tensor {dtype}")
            # all_to_all (list), all_to_all_single even and with split sizes
            la = [torch.empty(shape, dtype=dtype) for _ in range(n)]
            lb = [torch.empty(shape, dtype=dtype) for _ in range(n)]
            dist.all_to_all(la, [t.clone() for t in ins], group=ox)
            dist.all_to_all(lb, [t.clone() for t in ins], group=gl)
            for p in range(n):
                _close(la[p], lb[p], f"all_to_all {dtype}")
            a, b = torch.empty_like(big), torch.empty_like(big)
            dist.all_to_all_single(a, big, group=ox)
            dist.all_to_all_single(b, big, group=gl)
            _close(a, b, f"all_to_all_single {dtype}")
            # uneven: rank r sends (r + p + k) % 3 rows of `shape[1:]` to rank p
            k = shape[0] % 3
            insz = [(r + p + k) % 3 for p in range(n)]
            outsz = [(p + r + k) % 3 for p in range(n)]
            src = rand((sum(insz),) + shape[1:], dtype)
            a = torch.empty((sum(outsz),) + shape[1:], dtype=dtype)
            b = torch.empty_like(a)
            dist.all_to_all_single(a, src, outsz, insz, group=ox)
            dist.all_to_all_single(b, src, outsz, insz, group=gl)
            _close(a, b, f"all_to_all_single splits {dtype}")
            checked += 10
        # point to point: a ring, as send/recv, isend/irecv and batch_isend_irecv
        if n > 1:
            nxt, prv = (r + 1) % n, (r - 1) % n
            x = rand((1000,), dtype)
            big = rand((600_000,), dtype)  # larger than a transport buffer, both ways at once
            res = {}
            for name, grp in (("ox", ox), ("gl", gl)):
                y = torch.empty_like(x)
                if r % 2 == 0:
                    dist.send(x, dst=nxt, group=grp)
                    dist.recv(y, src=prv, group=grp)
                else:
                    dist.recv(y, src=prv, group=grp)
                    dist.send(x, dst=nxt, group=grp)
                z = torch.empty_like(x)
                reqs = [dist.isend(x, dst=nxt, group=grp), dist.irecv(z, src=prv, group=grp)] if r % 2 == 0 else [dist.irecv(z, src=prv, group=grp), dist.isend(x, dst=nxt, group=grp)]
                for q in reqs:
                    q.wait()
                w = torch.empty_like(big)
                ops2 = [dist.P2POp(dist.isend, big, nxt, group=grp), dist.P2POp(dist.irecv, w, prv, group=grp)]
                for q in dist.batch_isend_irecv(ops2):
                    q.wait()
                res[name] = (y, z, w)
            for ya, yb in zip(res["ox"], res["gl"]):
                _close(ya, yb, f"p2p {dtype}")
    dist.barrier(group=ox)
    dist.barrier(group=gl)
    # Bitwise ops: as gloo where the oxccl library has them, else a clear error.
    import oxccl

    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        a = torch.arange(6, dtype=torch.int32) * 7 + r
        b = a.clone()
        try:
            dist.all_reduce(a, op=op, group=ox)
        except oxccl.InvalidArgumentError as e:
            assert "unknown reduction op" in str(e) and "all_reduce" in str(e), e
        else:
            dist.all_reduce(b, op=op, group=gl)
            _close(a, b, f"all_reduce {op}")
    # A non-contiguous view: reduced through a contiguous temporary (test_torch_forms.py has
    # every collective), as gloo on a contiguous copy.
    a = (torch.arange(16.0) + r).reshape(4, 4)
    b = a.clone()
    dist.all_reduce(a.t(), group=ox)
    bt = b.t().contiguous()
    dist.all_reduce(bt, group=gl)
    b.t().copy_(bt)
    _close(a, b, "all_reduce of a transposed view")
    # async: a Work whose future oxccl's thread completes
    t = torch.ones(1 << 18)
    w = dist.all_reduce(t, group=ox, async_op=True)
    fut = w.get_future()
    v = fut.wait()
    assert torch.all(v[0] == n) and fut.done()
    print(f"rank {r}: {checked} comparisons with gloo ok", flush=True)
    dist.destroy_process_group()


def _model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    )


def ddp_vs_gloo():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    ox, gl = _setup_torch("gloo")
    r = dist.get_rank()
    final = {}
    for name, grp in (("oxccl", ox), ("gloo", gl)):
        model = _model(seed=100 + r)  # different on every rank: DDP broadcasts rank 0's
        ddp = DDP(model, process_group=grp, bucket_cap_mb=0.01)  # several buckets
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(7 + r)
        for _ in range(8):
            x = torch.randn(16, 32, generator=g)
            y = torch.randn(16, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        final[name] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(final["oxccl"], final["gloo"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    # and every rank holds the same parameters
    for p in final["oxccl"]:
        q = p.clone()
        dist.broadcast(q, 0, group=ox)
        assert torch.equal(p, q)
    print(f"rank {r}: ddp oxccl == gloo ok", flush=True)
    dist.destroy_process_group()


def fsdp():
    import torch
    import torch.distributed as dist

    import oxccl.torch  # noqa: F401

    dist.init_process_group("oxccl")
    r = dist.get_rank()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_model(seed=5), device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3 + r)
    x = torch.randn(64, 32, generator=g)
    y = torch.randn(64, 4, generator=g)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    with FSDP.summon_full_params(model):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    other = flat.clone()
    dist.broadcast(other, 0)
    assert torch.equal(flat, other)
    print(f"rank {r}: fsdp ok, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Shared-memory arrays (Comm.empty): large calls on them map peers' buffers.
# ---------------------------------------------------------------------------------------------
def shared():
    import torch

    import oxccl

    comm = oxccl.init()
    r, n = comm.rank, comm.world_size
    count = 300_001  # above the single-copy threshold, not divisible by the rank count
    x = comm.empty(count, np.float32)
    assert x.shape == (count,) and x.dtype == np.float32 and x.flags.writeable
    assert not x.any()
    x[:] = np.arange(count, dtype=np.float32) % 7 + r
    comm.all_reduce(x)
    want = (np.arange(count) % 7) * n + n * (n - 1) / 2
    assert np.array_equal(x, want.astype(np.float32)), x[:8]
    # out of place, as torch tensors viewing shared arrays
    src = comm.empty((count,), np.float64)
    src[:] = r + 1
    out = torch.from_numpy(comm.empty(count, np.float64))
    comm.all_reduce(torch.from_numpy(src), op="max", out=out)
    assert bool((out == n).all())
    g = comm.all_gather(comm.empty((2, 50_000), np.int32) + 0)  # a private copy: mixed use
    assert g.shape == (2 * n, 50_000)
    b = comm.empty(count, np.int64)
    if r == n - 1:
        b[:] = 42
    comm.broadcast(b, root=n - 1)
    assert bool((b == 42).all())
    assert comm.empty(0, np.float32).size == 0
    del x, src, out, b
    comm.barrier()
    _ok("shared")
