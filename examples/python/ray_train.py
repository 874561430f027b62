"""Ray Train over the "oxccl" backend: ``TorchTrainer`` with ``TorchConfig(backend="oxccl")``
trains a small regression model with DistributedDataParallel on 2 CPU workers.

    python examples/python/ray_train.py            # starts a local Ray cluster
    python examples/python/ray_train.py --workers 4

Needs ``pip install "ray[train]"``. Neither this script nor the training function imports
oxccl: installing the oxccl package makes the backend name known to every process that
imports torch (torch's ``torch.backends`` entry points), Ray's workers included.
"""

import argparse

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer


def train_fn(config):
    import torch
    import torch.distributed as dist

    import ray.train
    from ray.train.torch import prepare_model

    rank, n = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "oxccl", dist.get_backend()
    # A collective with a known answer: the sum of 1..n on every rank.
    t = torch.full((1024,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1024,), n * (n + 1) / 2)), t[:4]

    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    torch.manual_seed(rank)  # different data on every worker
    model = prepare_model(torch.nn.Linear(16, 1))  # DistributedDataParallel over oxccl
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(config["steps"]):
        x = torch.randn(32, 16)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
        opt.zero_grad()
        loss.backward()  # gradients averaged by oxccl's all_reduce
        opt.step()
    w = model.module.weight.detach().clone()
    dist.broadcast(w, 0)
    assert torch.equal(w, model.module.weight.detach())  # identical on every worker
    assert loss.item() < 1e-2, loss.item()
    # A failed assertion above fails trainer.fit(); the metrics are for the caller's log.
    ray.train.report({"sum": float(t[0]), "loss": loss.item()})
    if rank == 0:
        print(f"worker 0 of {n}: all_reduce sum {float(t[0]):g}, final loss {loss.item():.2e}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--storage", default=None, help="where Ray Train keeps its results (default: ~/ray_results)")
    args = parser.parse_args()
    ray.init(num_cpus=args.workers, include_dashboard=False)
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"steps": args.steps},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        torch_config=TorchConfig(backend="oxccl"),
        run_config=RunConfig(storage_path=args.storage),
    )
    result = trainer.fit()  # raises when a worker's function raised
    assert result.error is None, result.error
    print(f"{args.workers} workers over oxccl: done", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
