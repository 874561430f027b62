"""One rank of test_torch_lifecycle.py: `python torch_lifecycle_worker.py SCENARIO [ARGS]`.
Prints "<scenario> ok" when its checks pass (the test looks for it)."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import oxccl
import oxccl.torch as ot

SHM = "memfd:oxccl-buffer"


def in_shm(t):
    p = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            if SHM in line:
                a, b = (int(x, 16) for x in line.split()[0].split("-"))
                if a <= p < b:
                    return True
    return False


class _WritingDataset(torch.utils.data.Dataset):
    """Each item writes its row of a tensor in place (in the worker), then returns it."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, i):
        self.data[i] += 100.0
        return self.data[i].clone()


def fork():
    """A pool tensor written by a forked child (os.fork, DataLoader workers) keeps the parent's
    values in the parent; the child sees its own writes; collectives still work after."""
    dist.init_process_group("oxccl")
    r, n = dist.get_rank(), dist.get_world_size()
    assert ot._shm_allocator_min_bytes() is not None, "the allocator is off"
    t = torch.full((1 << 20,), float(r))  # 4 MiB: from the pool
    assert in_shm(t), "the tensor is not in the pool"
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if not torch.all(t == float(r)):
                code = 1
            t.fill_(-7.0)
            if not (torch.all(t == -7.0) and not in_shm(t)):
                code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child: exit {os.waitstatus_to_exitcode(status)}"
    assert torch.all(t == float(r)), "the child's write reached the parent"
    assert in_shm(t), "the parent's tensor is no longer shared"

    data = torch.zeros(64, 1 << 14)  # 4 MiB: from the pool
    assert in_shm(data)
    loader = torch.utils.data.DataLoader(_WritingDataset(data), batch_size=8, num_workers=2)
    rows = torch.cat(list(loader))
    assert torch.all(rows == 100.0), "a worker did not see its own write"
    assert torch.all(data == 0.0), "a DataLoader worker's write reached the parent"

    # Freed pool tensors (cached blocks, free blocks of slabs) are not copied into a child: it
    # copied all 128 MiB of them (Private_Dirty 130 MiB), now about what it writes itself.
    keep = [torch.full((1 << 14,), float(i)) for i in range(4)]  # 64 KiB each: slab blocks
    freed = [torch.full((1 << 18,), 5.0) for _ in range(64)]  # 64 MiB of 1 MiB blocks
    freed += [torch.full((1 << 14,), 5.0) for _ in range(1024)]  # 64 MiB of 64 KiB blocks
    assert all(in_shm(x) for x in keep + freed[:1] + freed[-1:])
    del freed
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            with open("/proc/self/smaps_rollup") as f:
                dirty = sum(int(line.split()[1]) for line in f if line.startswith("Private_Dirty"))
            ok = all(torch.all(x == float(i)) for i, x in enumerate(keep))
            print(f"rank {r}: a child with 128 MiB of pool tensors freed: Private_Dirty {dirty >> 10} MiB", flush=True)
            code = 0 if ok and dirty < (32 << 10) else (4 if ok else 5)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child: exit {os.waitstatus_to_exitcode(status)} (4: copied freed blocks, 5: wrong values)"

    dist.all_reduce(t)
    assert torch.all(t == float(sum(range(n)))), t[:4]
    small = torch.ones(4)
    dist.all_reduce(small)
    assert torch.all(small == float(n))

    # The cost: fork with a large pool tensor live (rank 0 only, FORK_MEASURE_MIB).
    mib = int(os.environ.get("FORK_MEASURE_MIB", "0"))
    if mib and r == 0:
        big = torch.ones(mib << 18)
        assert in_shm(big)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        took = time.monotonic() - start
        os.waitpid(pid, 0)
        print(f"fork with a {mib} MiB pool tensor live: {took:.3f} s in fork", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print("fork ok", flush=True)


def fork_after_destroy():
    """A child forked after its parent made and destroyed a group (env://) starts a thread and
    makes a group of its own, then exits normally: exit status 0. The parent's store, kept for
    the next init, is a TCPStore whose destructor detaches a thread that exists only in the
    parent (SIGABRT, "std::system_error ... Invalid argument", when the child freed it)."""
    import socket
    import threading

    dist.init_process_group("oxccl", init_method="env://")
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.destroy_process_group()
    pid = os.fork()
    if pid == 0:
        th = threading.Thread(target=time.sleep, args=(0.05,))
        th.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("oxccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        x = torch.ones(4)
        dist.all_reduce(x)
        dist.destroy_process_group()
        th.join()
        sys.exit(0 if torch.all(x == 1.0) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child died of signal {os.WTERMSIG(status)}"
    assert os.WEXITSTATUS(status) == 0, f"the child exited {os.WEXITSTATUS(status)}"
    print("fork after destroy ok", flush=True)


def timeouts():
    """Zero and negative timeouts expire at once: monitored_barrier and work.wait."""
    dist.init_process_group("oxccl", timeout=timedelta(seconds=30))
    r = dist.get_rank()
    big = torch.ones(1 << 19)  # 2 MiB: a queued call
    if r == 0:
        for to in (timedelta(0), timedelta(seconds=-1)):
            start = time.monotonic()
            try:
                dist.monitored_barrier(timeout=to)
                raise AssertionError("monitored_barrier(timeout=%s) passed" % to)
            except RuntimeError as e:
                assert "Rank 0 timed out in monitoredBarrier" in str(e), e
            # Quiet, milliseconds; a busy machine gets far more (rank 1 arrives after 8 s).
            assert time.monotonic() - start < 5.0, time.monotonic() - start
        work = dist.all_reduce(big, async_op=True)  # rank 1 joins 8 s later
        for to in (timedelta(0), timedelta(seconds=-1)):
            start = time.monotonic()
            try:
                work.wait(timeout=to)
                raise AssertionError("work.wait(timeout=%s) passed" % to)
            except oxccl.TimeoutError as e:
                assert "timeout" in str(e), e
            assert time.monotonic() - start < 5.0, time.monotonic() - start
        assert work.wait()
        assert work.wait(timeout=timedelta(0))  # finished: no error
    else:
        time.sleep(8)
        dist.all_reduce(big)
    assert torch.all(big == 2.0)
    dist.barrier()
    dist.destroy_process_group()
    print("timeouts ok", flush=True)


def async_small():
    """async_op=True is asynchronous at every size (as gloo's): a small all_reduce returns
    before the late peer (8 s) arrives; work.wait(timeout=1 s) raises an oxccl.TimeoutError
    against it and a later wait() gets the right result; "async collective on group A, send on
    group B, wait" against "recv on B, collective on A" completes (no deadlock)."""
    dist.init_process_group("oxccl", timeout=timedelta(seconds=30))
    r, n = dist.get_rank(), dist.get_world_size()
    for numel in (1, 4096):  # 4 B and 16 KiB: sizes that a blocking call runs inline
        t = torch.full((numel,), float(r + 1))
        dist.barrier()
        if r == 0:
            start = time.monotonic()
            work = dist.all_reduce(t, async_op=True)
            took = time.monotonic() - start
            # Quiet, milliseconds; blocking, it would wait for the peer's 8 s.
            assert took < 4.0, f"all_reduce(async_op=True) of {numel * 4} B took {took:.2f} s: not asynchronous"
            start = time.monotonic()
            try:
                work.wait(timeout=timedelta(seconds=1))
                raise AssertionError("work.wait(timeout=1 s) passed before the peer arrived")
            except oxccl.TimeoutError as e:
                assert "timeout" in str(e), e
            waited = time.monotonic() - start
            assert 0.9 < waited < 3.0, f"work.wait(timeout=1 s) raised after {waited:.2f} s"
            assert work.wait()
        else:
            time.sleep(8.0)
            dist.all_reduce(t)
        assert torch.all(t == float(sum(range(1, n + 1)))), (numel, t[:4])
    # Group A (the world) and group B, each an oxccl communicator of their own.
    group_b = dist.new_group(backend="oxccl")
    for numel in (1, 4096, 1 << 19):
        a = torch.full((numel,), float(r + 1))
        b = torch.full((numel,), float(r))
        start = time.monotonic()
        if r == 0:
            work = dist.all_reduce(a, async_op=True)
            dist.send(b, 1, group=group_b)
            work.wait()
        else:
            dist.recv(b, 0, group=group_b)
            dist.all_reduce(a)
            assert torch.all(b == 0.0), b[:4]
        took = time.monotonic() - start
        assert took < 10.0, f"A/B scenario ({numel * 4} B) took {took:.1f} s"
        assert torch.all(a == float(sum(range(1, n + 1)))), (numel, a[:4])
    # Every kind torch sends with async_op=True returns before a late peer arrives.
    x = torch.full((16,), float(r + 1))
    outs = [torch.empty(16) for _ in range(n)]
    calls = [
        ("broadcast", lambda: dist.broadcast(x, 1, async_op=True)),
        ("reduce", lambda: dist.reduce(x, 1, async_op=True)),
        ("all_gather", lambda: dist.all_gather(outs, x, async_op=True)),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(16 * n), x, async_op=True)),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(16 // n), x, async_op=True)),
        ("all_to_all_single", lambda: dist.all_to_all_single(torch.empty(16), x, async_op=True)),
        ("barrier", lambda: dist.barrier(async_op=True)),
    ]
    for name, call in calls:
        dist.barrier()
        if r == 0:
            start = time.monotonic()
            work = call()
            took = time.monotonic() - start
            # Quiet, milliseconds; blocking, it would wait for the peer's 3 s.
            assert took < 2.0, f"{name}(async_op=True) took {took:.2f} s: not asynchronous"
            work.wait()
        else:
            time.sleep(3.0)
            call().wait()
    dist.barrier()
    dist.destroy_process_group()
    print("async_small ok", flush=True)


def exit_queued():
    """Queued (> 1 MiB) async all_reduces, then exit without waiting."""
    dist.init_process_group("oxccl")
    ts = [torch.ones(1 << 19) for _ in range(4)]  # 2 MiB each
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    works[0].get_future().then(lambda f: f.value())
    print("exit_queued ok", flush=True)


def reinit(times):
    """init_process_group / destroy_process_group `times` times on the same MASTER_PORT. In
    odd rounds rank 0 (whose store is the server on MASTER_PORT) destroys its group late, so
    that the other ranks reach the next init while its server of this round still runs: it
    must go on serving them (it once closed under them, and rank 0's next server waited for
    them for torch's store timeout)."""
    for i in range(int(times)):
        dist.init_process_group("oxccl", init_method="env://")
        r, n = dist.get_rank(), dist.get_world_size()
        t = torch.full((8,), float(r + i))
        dist.all_reduce(t)
        assert torch.all(t == float(sum(range(n)) + n * i)), (i, t)
        if r == 0 and i % 2 == 1:
            time.sleep(1.0)
        dist.destroy_process_group()
    print("reinit ok", flush=True)


def peer_exit_ddp():
    """DDP backward with 4 MiB of gradients after the peer has exited: the survivor gets an
    exception naming the lost peer (no signal)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("oxccl")
    r = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(1024, 1024))  # 4 MiB of gradients
    x = torch.randn(4, 1024)
    for _ in range(3):  # past DDP's bucket rebuild: later steps only all-reduce in backward
        model(x).sum().backward()
    dist.barrier()
    if r == 1:
        os._exit(0)
    time.sleep(0.5)
    try:
        for _ in range(3):
            model(x).sum().backward()
        raise AssertionError("backward passed without the peer")
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - any error that names the lost peer
        msg = str(e)
        assert "rank 1" in msg or "peer" in msg.lower(), msg
        print(f"survivor raised {type(e).__name__}: {msg[:300]}", flush=True)
    print("peer_exit_ddp ok", flush=True)
    os._exit(0)


def shutdown():
    """destroy_process_group closes the communicator: rank 0 destroys its group with an
    asynchronous all_reduce in flight (the others join it 1 s later): the call completes with
    the right result first; then the communicator is closed (a call on it raises
    oxccl.AbortedError naming the close; closing and shutting down again do nothing), and the
    others, whose next call needs rank 0, fail within 3 s naming it (it left: its goodbye came,
    its links closed), not at their timeout (20 s)."""
    dist.init_process_group("oxccl", timeout=timedelta(seconds=20))
    r, n = dist.get_rank(), dist.get_world_size()
    b = dist.group.WORLD._get_backend(torch.device("cpu"))
    comm = b._state.comm
    t = torch.full((1 << 18,), float(r + 1))  # 1 MiB: queued
    if r != 0:
        time.sleep(1.0)
    work = dist.all_reduce(t, async_op=True)
    want = float(n * (n + 1) // 2)
    if r == 0:
        start = time.monotonic()
        dist.destroy_process_group()
        took = time.monotonic() - start
        # It waited for the queued call (the others joined it 1 s later), which completed.
        assert 0.5 < took < 10, f"destroy_process_group took {took:.2f} s"
        start = time.monotonic()
        work.wait()
        # Finished: quiet, microseconds.
        assert time.monotonic() - start < 5.0, "the queued call had not finished"
        assert torch.all(t == want), t[:4]
        try:
            comm.barrier()
            raise AssertionError("a call on the communicator passed after destroy_process_group")
        except oxccl.AbortedError as e:
            assert "closed" in str(e), e
        comm.close()
        b.shutdown()  # again: nothing more happens
    else:
        work.wait()
        assert torch.all(t == want), t[:4]
        time.sleep(0.5)  # rank 0 destroys its group meanwhile
        start = time.monotonic()
        try:
            comm.barrier()
            raise AssertionError("a barrier passed after rank 0 destroyed its group")
        except oxccl.Error as e:
            took = time.monotonic() - start
            # Quiet, a fraction of a second; far under the group's 30 s timeout.
            assert took < 10, f"the barrier failed after {took:.1f} s: {e}"
            assert "rank 0" in str(e), e
        dist.destroy_process_group()
    print("shutdown ok", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
