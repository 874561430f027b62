"""One rank of test_torch_shm_attack.py: attacks on the paths through shared tensors (the
shared-memory CPU allocator, one-shot and single-copy through the peers' shared buffers).

Modes:
- "diff": all_reduce, reduce_scatter_tensor and all_gather_into_tensor (in place and out of
  place) from 8 KB to 600 KB, every rank drawing where its tensors live on its own: a tensor
  of the shared allocator, a view at an offset into a larger shared tensor (a slab block's
  middle), a non-contiguous view, or private memory (torch.frombuffer); the same calls on
  gloo's contiguous copies are the reference (bitwise for integers and sums of two).
- "many": more whole shared blocks, and more slabs, than a peer keeps mapped (PEER_MAPPINGS,
  256), each all-reduced, then the first ones again (their peers' mappings evicted), results
  exact; a
  tensor freed right after an async call is queued (the call keeps it) and its block reused.
- "kill": rank n-1 SIGKILLs itself in the middle of a loop of one-shot all_reduces through
  shared buffers; the others must fail naming it within seconds, not hang.
- "fdlimit": with RLIMIT_NOFILE lowered to 512, 700 tensors of 600 KB (a file descriptor each
  in the pool) must leave the program able to open files.
"""

import os
import random
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import oxccl.torch  # noqa: F401 - registers "oxccl"
from torch_lifecycle_worker import in_shm  # where a tensor lives (/proc/self/maps)

INT = [torch.int64, torch.int32, torch.int8, torch.uint8]  # gloo has no int16
FLOAT = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SIZES = [8 << 10, 12 << 10, 16 << 10, 24 << 10, 32 << 10, 40 << 10, 64 << 10, 100 << 10, 300 << 10, 600 << 10]


def fail(msg):
    print(f"rank {dist.get_rank()}: FAILED {msg}", flush=True)
    os._exit(1)


def passed(what, detail=""):
    dist.barrier()
    print(f"rank {dist.get_rank()}: attack {what} ok {detail}", flush=True)
    dist.destroy_process_group()


def place(t, how, rng):
    """`t`'s values in a fresh tensor living as `how` says."""
    n = t.numel()
    if how == "shared":
        out = torch.empty_like(t)
    elif how == "private":
        out = torch.frombuffer(bytearray(max(1, t.nbytes)), dtype=t.dtype)[:n].view(t.shape)
    elif how == "offset":
        # a view into the middle of a larger shared tensor (its block's storage offset)
        pad = rng.randrange(1, 300)
        big = torch.empty(n + pad + rng.randrange(0, 300), dtype=t.dtype)
        out = big[pad:pad + n].view(t.shape)
    elif how == "strided":
        big = torch.empty(2 * n, dtype=t.dtype)
        out = big[::2].view(t.shape) if t.dim() == 1 else big[::2]
    else:
        raise ValueError(how)
    out.copy_(t)
    return out


def draw(shape, dtype, gen):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(0, 4, shape, generator=gen).to(dtype)


def same(a, b, dtype, n, what):
    if dtype.is_floating_point and (n > 2 or dtype.itemsize == 2):
        tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
        ok = torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)
    else:
        ok = torch.equal(a, b)
    if not ok:
        d = (a.double() - b.double()).abs()
        raise AssertionError(f"{what}: oxccl != gloo at flat index {int(d.argmax())} "
                             f"(oxccl {a.reshape(-1)[int(d.argmax())].item()}, gloo {b.reshape(-1)[int(d.argmax())].item()})")


def diff(calls):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    ox = dist.new_group(backend="oxccl", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    seed = int(os.environ.get("OXCCL_ATTACK_SEED", "12345"))
    alike = random.Random(seed)  # the same draws on every rank
    mine = random.Random(seed * 1000 + r)  # where this rank's tensors live
    gen = torch.Generator().manual_seed(seed * 7 + r)
    shared_seen = private_seen = 0
    for i in range(int(calls)):
        kind = alike.choice(["all_reduce", "rs_out", "rs_in", "ag_out", "ag_in"])
        dtype = alike.choice(INT + FLOAT)
        size = alike.choice(SIZES)
        count = max(1, size // dtype.itemsize // n)  # elements per rank
        hows = ["shared", "shared", "offset", "private"]
        if kind == "all_reduce":
            hows.append("strided")  # the *_tensor forms take contiguous tensors only
        how_in, how_out = mine.choice(hows), mine.choice(hows)
        asy = alike.random() < 0.3
        case = f"seed {seed} call #{i}: {kind} {dtype} {count}x{n} elements, input {how_in}, output {how_out}, async {asy}"
        try:
            if kind == "all_reduce":
                x = draw((count * n,), dtype, gen)
                t = place(x, how_in, mine)
                shared_seen += in_shm(t)
                private_seen += not in_shm(t)
                ref = x.clone()
                w = dist.all_reduce(t, group=ox, async_op=asy)
                if asy:
                    w.wait()
                dist.all_reduce(ref)
                same(t, ref, dtype, n, case)
            elif kind in ("rs_out", "rs_in"):
                x = draw((count * n,), dtype, gen)
                inp = place(x, how_in, mine)
                if kind == "rs_in":
                    out = inp[r * count:(r + 1) * count]  # in place: my block of the input
                else:
                    out = place(torch.zeros(count, dtype=dtype), how_out, mine)
                ref = torch.zeros(count, dtype=dtype)
                w = dist.reduce_scatter_tensor(out, inp, group=ox, async_op=asy)
                if asy:
                    w.wait()
                dist.reduce_scatter_tensor(ref, x.clone())
                same(out, ref, dtype, n, case)
            else:
                x = draw((count,), dtype, gen)
                if kind == "ag_in":
                    out = place(torch.zeros(count * n, dtype=dtype), how_out, mine)
                    inp = out[r * count:(r + 1) * count]
                    inp.copy_(x)
                else:
                    inp = place(x, how_in, mine)
                    out = place(torch.zeros(count * n, dtype=dtype), how_out, mine)
                w = dist.all_gather_into_tensor(out, inp, group=ox, async_op=asy)
                if asy:
                    w.wait()
                ref = torch.zeros(count * n, dtype=dtype)
                dist.all_gather_into_tensor(ref, x.clone())
                same(out, ref, dtype, n, case)
        except Exception as e:  # noqa: BLE001
            fail(f"{case}: {type(e).__name__}: {e}")
    passed("diff", f"({calls} calls, {shared_seen} shared and {private_seen} private all_reduce inputs)")


def many():
    dist.init_process_group("oxccl", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    count = (600 << 10) // 8  # 600 KB of int64: a whole block each (above the slabs' 512 KiB)
    ts = [torch.empty(count, dtype=torch.int64) for _ in range(300)]
    assert all(in_shm(t) for t in ts[::37])
    expect = lambda j: sum((p + 1) * 1000 + j for p in range(n))  # noqa: E731
    for rounds in range(2):
        for j, t in enumerate(ts if rounds == 0 else ts[:40]):
            t.fill_((r + 1) * 1000 + j)
            dist.all_reduce(t)
            if not bool((t == expect(j)).all()):
                fail(f"tensor {j} round {rounds}: {t[:4].tolist()} != {expect(j)}")
    # one 512 KiB block in each of 260 slabs (a slab holds 8 of them; the other 7 freed): a
    # peer maps a slab once for its blocks and keeps 256 mapped, so the first ones are evicted
    # and mapped again
    blocks = [torch.empty((512 << 10) // 8, dtype=torch.int64) for _ in range(8 * 260)]
    kept = blocks[::8]
    del blocks
    with open("/proc/self/maps") as f:
        maps = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f if "memfd:oxccl-buffer" in line]
    slabs = {a for t in kept for a, b in maps if a <= t.data_ptr() < b}
    if len(slabs) < 257 or not all(in_shm(t) for t in kept):
        fail(f"the 260 kept 512 KiB tensors lie in {len(slabs)} shared slabs, not 260")
    for rounds in range(2):
        for j, t in enumerate(kept if rounds == 0 else kept[:40]):
            t.fill_((r + 1) * 1000 + j)
            dist.all_reduce(t)
            if not bool((t == expect(j)).all()):
                fail(f"slab block {j} round {rounds}: {t[:4].tolist()} != {expect(j)}")
    del kept
    # freed right after an async call: the call keeps it; its block is not handed out meanwhile
    for j in range(50):
        t = torch.full((count,), r + 1 + j, dtype=torch.int64)
        w = dist.all_reduce(t, async_op=True)
        del t
        other = torch.full((count,), -7, dtype=torch.int64)  # may reuse a freed block of the class
        w.wait()
        res = w.result()[0]
        want = sum(p + 1 + j for p in range(n))
        if not bool((res == want).all()) or not bool((other == -7).all()):
            fail(f"async {j}: {res[:4].tolist()} != {want} or other {other[:4].tolist()}")
    passed("many")


def kill():
    dist.init_process_group("oxccl", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.empty(4096, dtype=torch.float32)  # 16 KB: one-shot through shared buffers
    assert in_shm(t)
    start = None
    try:
        for i in range(100000):
            if r == n - 1 and i == 500:
                os.kill(os.getpid(), signal.SIGKILL)
            if i == 499:
                start = time.monotonic()
            t.fill_(1.0)
            dist.all_reduce(t)
            if float(t[0]) != n:
                fail(f"wrong result {float(t[0])} at call {i}")
    except Exception as e:  # noqa: BLE001
        took = time.monotonic() - (start or time.monotonic())
        print(f"rank {r}: error after {took:.1f} s: {type(e).__name__}: {e}", flush=True)
        named = f"rank {n - 1}" in str(e)
        print(f"rank {r}: attack kill {'ok' if named and took < 20 else 'BAD'}", flush=True)
        os._exit(0)
    fail("no error after the peer was killed")


def fdlimit():
    dist.init_process_group("oxccl", timeout=timedelta(seconds=60))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, hard), hard))
    ts = [torch.empty((600 << 10) // 4) for _ in range(700)]
    opened = []
    try:
        for _ in range(40):
            opened.append(open(os.devnull))
    except OSError as e:
        fail(f"to open a file after 700 tensors: {e}")
    for f in opened:
        f.close()
    shared = sum(in_shm(t) for t in ts[::50])
    for t in ts[::10]:
        t.fill_(1.0)
        dist.all_reduce(t)
        assert float(t[0]) == dist.get_world_size()
    del ts
    passed("fdlimit", f"({shared} of 14 sampled tensors shared)")


if __name__ == "__main__":
    {"diff": diff, "many": many, "kill": kill, "fdlimit": fdlimit}[sys.argv[1]](*sys.argv[2:])
