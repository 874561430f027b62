"""One torch program under any launcher: torchrun, ``oxccl run``, Open MPI's ``mpirun`` or
Slurm's ``srun``. Trains a small model with DistributedDataParallel and prints a digest of the
trained weights (``--out`` saves them): at 2 ranks the same under every backend, at more ranks
equal to rounding (backends add the ranks' gradients in different orders).

    torchrun --nproc-per-node 2 examples/python/launchers_torch.py
    mpirun -n 4 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29511 python examples/python/launchers_torch.py
    srun -n 4 --export=ALL,MASTER_ADDR=node0,MASTER_PORT=29511 python examples/python/launchers_torch.py

torch's ``env://`` rendezvous reads ``RANK`` and ``WORLD_SIZE``, which only torchrun and
``oxccl run`` set: under mpirun and srun this script takes them from the launcher's own
variables (``OMPI_COMM_WORLD_*``, ``SLURM_*``, ``PMI_*``), as oxccl's own ``from_env`` does.
``MASTER_ADDR`` and ``MASTER_PORT`` must be exported to every rank (``mpirun -x``, or the
environment ``srun`` passes on). The script does not import oxccl: installing the package
registers the backend name at ``import torch``.
"""

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# (rank, world size, local rank) variables of each launcher, torchrun's first.
LAUNCHERS = [
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("PMI_RANK", "PMI_SIZE", None),
]


def launcher_env():
    """Sets RANK, WORLD_SIZE and LOCAL_RANK from the launcher's variables; returns its name."""
    for rank, size, local in LAUNCHERS:
        if rank in os.environ and size in os.environ:
            os.environ.setdefault("RANK", os.environ[rank])
            os.environ.setdefault("WORLD_SIZE", os.environ[size])
            if local and local in os.environ:
                os.environ.setdefault("LOCAL_RANK", os.environ[local])
            return rank
    raise SystemExit("no launcher: start under torchrun, oxccl run, mpirun or srun")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="oxccl")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="save the trained weights here (rank 0)")
    args = parser.parse_args()
    via = launcher_env()
    dist.init_process_group(args.backend)  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, n = dist.get_rank(), dist.get_world_size()

    t = torch.full((4096,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4096,), n * (n + 1) / 2)), t[:4]

    torch.manual_seed(0)  # the same initial weights everywhere
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    true_w = torch.randn(16, 1, generator=g)
    for _ in range(args.steps):
        x = torch.randn(n, 8, 16, generator=g)[rank]  # each rank its part of the step's data
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = torch.cat([p.detach().flatten() for p in model.parameters()])
    ws = [torch.empty_like(w) for _ in range(n)]
    dist.all_gather(ws, w)
    assert all(torch.equal(ws[0], v) for v in ws), "ranks disagree"
    if rank == 0:
        if args.out:
            torch.save(w, args.out)
        digest = hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]
        print(f"{n} ranks over {dist.get_backend()} ({via}): weights {digest}; done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
