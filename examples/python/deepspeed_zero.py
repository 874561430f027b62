"""DeepSpeed ZeRO (stage 1, 2 or 3) on CPU over the "oxccl" backend:
``deepspeed.init_distributed(dist_backend="oxccl")``, then ``deepspeed.initialize`` with a
torch optimizer (no compiled DeepSpeed op is needed).

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/python/deepspeed_zero.py --stage 3
    DS_ACCELERATOR=cpu oxccl run -n 2 -- python examples/python/deepspeed_zero.py --stage 1 2 3

Needs ``pip install deepspeed``. ``DS_ACCELERATOR=cpu`` makes DeepSpeed use torch on the CPU
(without it DeepSpeed looks for a GPU). The script does not import oxccl: installing the
package registers the backend name at ``import torch``. The data and the initial weights are
fixed, so the trained parameters (``--out``) are the same under every backend that sums alike.
"""

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def train(stage, steps, rank, n):
    """Trains a fresh model under ZeRO `stage`; returns the last loss and the full parameters."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # a torch optimizer under ZeRO
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    g = torch.Generator().manual_seed(1)
    true_w = torch.randn(16, 1, generator=g)
    for step in range(steps):
        # Each rank its own batch of the step's data.
        x = torch.randn(n, 8, 16, generator=g)[rank]
        loss = torch.nn.functional.mse_loss(engine(x), x @ true_w)
        engine.backward(loss)  # gradients reduced (stage 2, 3: reduce-scattered) over the backend
        engine.step()  # stage 1-3: each rank steps its shard; the parameters are all-gathered

    # The full parameters on every rank (stage 3 keeps only shards: gather them).
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        w = torch.cat([p.detach().flatten().clone() for p in params])
    ws = [torch.empty_like(w) for _ in range(n)]
    dist.all_gather(ws, w)
    assert all(torch.equal(ws[0], v) for v in ws), "ranks disagree"
    return loss.item(), w


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="oxccl")
    parser.add_argument("--stage", type=int, nargs="+", default=[3], choices=[0, 1, 2, 3], help="one or more, in turn")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None, help="save the trained parameters here (rank 0)")
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend=args.backend)  # env:// (RANK, MASTER_ADDR, ...)
    rank, n = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == args.backend, dist.get_backend()

    trained = {}
    for stage in args.stage:
        loss, trained[stage] = train(stage, args.steps, rank, n)
        if rank == 0:
            print(f"ZeRO stage {stage}, {n} ranks over {dist.get_backend()}: loss {loss:.4e}; done", flush=True)
    if rank == 0 and args.out:
        torch.save(trained, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
