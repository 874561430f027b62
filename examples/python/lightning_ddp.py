"""PyTorch Lightning over the "oxccl" backend: ``Trainer(accelerator="cpu", devices=2,
strategy=DDPStrategy(process_group_backend="oxccl"))`` trains a small regression model.

    python examples/python/lightning_ddp.py                       # 2 processes, oxccl
    python examples/python/lightning_ddp.py --backend gloo --out w_gloo.pt

Needs ``pip install lightning``. The script does not import oxccl: installing the oxccl
package makes the backend name known at ``import torch`` (torch's ``torch.backends`` entry
point), in the processes Lightning starts too. The data and the initial weights are fixed, so
the trained weights (``--out``) are the same under every backend that sums alike.
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the standalone package
    import pytorch_lightning as L
    from pytorch_lightning.strategies import DDPStrategy


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # an all_reduce of its own each step
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="oxccl")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=None, help="save the trained weights here (rank 0)")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(256, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)  # sharded by rank

    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=DDPStrategy(process_group_backend=args.backend),
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    model = Regression()
    trainer.fit(model, data)
    backend = dist.get_backend()
    # Every rank's weights, gathered: DDP keeps them identical.
    w = torch.cat([p.detach().flatten() for p in model.parameters()])
    ws = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(ws, w)
    assert all(torch.equal(ws[0], v) for v in ws), "ranks disagree"
    if trainer.global_rank == 0:
        if args.out:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
        loss = trainer.callback_metrics["loss"].item()
        print(f"{trainer.world_size} ranks over {backend}: final loss {loss:.4e}; done", flush=True)


if __name__ == "__main__":
    main()
