"""DistributedDataParallel over the "oxccl" backend: a small regression model.

    torchrun --nproc-per-node 2 examples/python/ddp_train.py
    oxccl run -n 2 -- python examples/python/ddp_train.py
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import oxccl.torch  # noqa: F401 - registers the backend

dist.init_process_group("oxccl")  # rendezvous through torch's store (env://)
rank, n = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
true_w = torch.randn(16, 1)
torch.manual_seed(rank)  # different data, and different initial weights, on every rank
model = DDP(torch.nn.Linear(16, 1))  # DDP broadcasts rank 0's weights
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100):
    x = torch.randn(32, 16)
    loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
    opt.zero_grad()
    loss.backward()  # gradients averaged by oxccl all_reduce, bucket by bucket
    opt.step()
    if rank == 0 and step % 25 == 0:
        print(f"step {step}: loss {loss.item():.5f}")
assert loss.item() < 1e-2, loss.item()
w = model.module.weight.detach().clone()
dist.broadcast(w, 0)
assert torch.equal(w, model.module.weight.detach())  # identical on every rank
print(f"rank {rank}/{n}: final loss {loss.item():.2e}; done")
dist.destroy_process_group()
