"""One rank of test_torch_shm_allocator.py: `mode` is "on" (the default: large CPU tensors
come from oxccl's pool of shared buffers once an oxccl group exists) or "off"
(OXCCL_TORCH_ALLOCATOR=0). Checks where tensors live (/proc/self/maps), collectives on them
against a plain reference, DDP against gloo, fork, and tensors outliving the groups."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import oxccl.torch as ot

SHM = "memfd:oxccl-buffer"


def shm_maps():
    """(start, end) of every mapping of an oxccl shared buffer (this rank's and its peers')."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if SHM in line:
                a, b = line.split()[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    return out


def in_shm(t):
    p = t.untyped_storage().data_ptr()
    return any(a <= p < b for a, b in shm_maps())


def main(mode):
    on = mode == "on"
    before = torch.empty(1 << 20)  # made before any oxccl group: private
    dist.init_process_group("gloo")
    ox = dist.new_group(backend="oxccl")
    r, n = dist.get_rank(), dist.get_world_size()
    assert ot._shm_allocator_min_bytes() == ((8 << 10) if on else None), ot._shm_allocator_min_bytes()
    assert not in_shm(before)

    # Where tensors live: large ones in shared memory, small ones not; resize_ and views.
    x = torch.empty(1 << 20)  # 4 MiB
    assert in_shm(x) == on
    assert not in_shm(torch.empty(1000)) and not in_shm(torch.zeros(10, 100))
    s = torch.empty(10)
    assert not in_shm(s)
    s.resize_(1 << 20)
    assert in_shm(s) == on
    x.numpy()[:] = 3.0
    assert bool((x == 3).all())

    # From 8 KiB on (the default threshold), tensors live in shared memory, the small ones
    # carved from shared slabs: thousands of them take a few file descriptors, not one each
    # (the process's limit is usually 1024).
    assert in_shm(torch.empty(2048)) == on and not in_shm(torch.empty(2047))
    fds = len(os.listdir("/proc/self/fd"))
    many = [torch.empty(16 << 10) for _ in range(3000)]  # 3000 x 64 KiB
    assert all(in_shm(t) == on for t in many[:: 100])
    grown = len(os.listdir("/proc/self/fd")) - fds
    assert grown <= 3000 // 64 + 8, f"{grown} file descriptors for 3000 small tensors"
    del many
    # Collectives on small shared tensors of every size class against a plain reference
    # (blocks of one slab side by side: a call must touch only its own).
    for numel in (2048, 2049, 4097, 8191, 16 << 10, (16 << 10) + 1, 25_000, 65_537, 131_072 - 5):
        t = [torch.full((numel,), float(k + r)) for k in range(3)]
        for k in range(3):
            dist.all_reduce(t[k], group=ox)
        for k in range(3):
            assert torch.equal(t[k], torch.full((numel,), float(n * k + n * (n - 1) // 2))), (numel, k)
        g = torch.empty(n * numel)
        dist.all_gather_into_tensor(g, torch.full((numel,), float(r)), group=ox)
        assert torch.equal(g, torch.arange(n, dtype=torch.float32).repeat_interleave(numel)), numel

    # Collectives on them against a plain reference.
    N = (1 << 20) + 3
    base = torch.arange(N, dtype=torch.float32) % 101
    a = base + r
    assert in_shm(a) == on
    dist.all_reduce(a, group=ox)
    assert torch.equal(a, base * n + n * (n - 1) // 2)
    if on:
        # The peers' blocks of this size are mapped here: the shared path ran.
        size = a.untyped_storage().nbytes()
        mine = [m for m in shm_maps() if m[0] <= a.untyped_storage().data_ptr() < m[1]][0]
        same = [m for m in shm_maps() if m[1] - m[0] == mine[1] - mine[0]]
        assert len(same) >= n, (size, same)
    out = torch.empty(n * N)
    dist.all_gather_into_tensor(out, base + 10 * r, group=ox)
    assert torch.equal(out, torch.cat([base + 10 * k for k in range(n)]))
    rs = torch.empty(N)
    dist.reduce_scatter_tensor(rs, torch.cat([base + k for k in range(n)]) * (r + 1), group=ox)
    assert torch.equal(rs, (base + r) * (n * (n + 1) // 2))
    b = base * (r + 1)
    dist.broadcast(b, src=n - 1, group=ox)
    assert torch.equal(b, base * n)

    # DDP trains like gloo (its buckets, 1 MB cap, each weight 2 MiB: in shared memory with the
    # allocator on).
    final = {}
    for name, grp in (("oxccl", ox), ("gloo", dist.group.WORLD)):
        torch.manual_seed(100 + r)  # different on every rank: DDP broadcasts rank 0's
        model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 256))
        ddp = DDP(model, process_group=grp, bucket_cap_mb=1, gradient_as_bucket_view=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(7 + r)
        for _ in range(4):
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(ddp(torch.randn(8, 256, generator=g)), torch.randn(8, 256, generator=g)).backward()
            opt.step()
        assert in_shm(model[0].weight.grad) == on  # a view into its bucket
        final[name] = [p.detach().clone() for p in model.parameters()]
    for p, q in zip(final["oxccl"], final["gloo"]):
        if n == 2:  # a sum of two is the same bits in any order
            assert torch.equal(p, q), (p - q).abs().max()
        else:
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p - q).abs().max()

    # fork: the child's own allocations are private, and so are the blocks it inherited (it
    # writes its own copy, as with any memory; see test_torch_lifecycle.py).
    x.fill_(1.0)
    pid = os.fork()
    if pid == 0:
        ok = not in_shm(torch.empty(1 << 20))
        x.fill_(2.0)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's allocation was in the pool"
    assert float(x[0]) == 1.0, "the child's write reached the parent"

    # Tensors outlive the groups; the allocator still serves after they are gone.
    dist.destroy_process_group()
    x.add_(1.0)
    del x, a, s
    y = torch.empty(1 << 20)
    assert in_shm(y) == on
    y.fill_(5.0)
    assert float(y.sum()) == 5.0 * (1 << 20)
    print(f"rank {r}: shm allocator {mode} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
