"""A ZeRO-style sharded optimizer on the "oxccl" torch backend: every rank keeps 1/n of the
parameters' optimizer state; gradients are reduce-scattered, each rank updates its shard,
and the parameters are all-gathered back.

    torchrun --nproc-per-node 2 examples/python/zero_sharded.py
"""

import torch
import torch.distributed as dist

import oxccl.torch  # noqa: F401

dist.init_process_group("oxccl")
rank, n = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
params = list(model.parameters())
numel = sum(p.numel() for p in params)
padded = (numel + n - 1) // n * n
shard = padded // n

# My shard of the flat parameters, and optimizer state for it only.
flat = torch.zeros(padded)
flat[:numel] = torch.nn.utils.parameters_to_vector(params).detach()
my_params = flat[rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
opt = torch.optim.Adam([my_params], lr=1e-2)

torch.manual_seed(100 + rank)
target = torch.nn.Linear(32, 1)
first = None
for step in range(60):
    x = torch.randn(64, 32)
    with torch.no_grad():
        y = torch.sin(target(x))
    loss = torch.nn.functional.mse_loss(model(x), y)
    model.zero_grad()
    loss.backward()
    grads = torch.zeros(padded)
    grads[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
    my_grad = torch.empty(shard)
    dist.reduce_scatter_tensor(my_grad, grads, op=dist.ReduceOp.AVG)  # my shard of the mean
    my_params.grad = my_grad
    opt.step()
    gathered = torch.empty(padded)
    dist.all_gather_into_tensor(gathered, my_params.detach())  # everyone's updated shard
    torch.nn.utils.vector_to_parameters(gathered[:numel], params)
    avg = loss.detach().clone()
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    first = first if first is not None else avg.item()
    if rank == 0 and step % 20 == 0:
        print(f"step {step}: loss {avg.item():.4f}")
assert avg.item() < first, (first, avg.item())
print(f"rank {rank}/{n}: loss {first:.4f} -> {avg.item():.4f}, state for {shard} of {numel} parameters; done")
dist.destroy_process_group()
