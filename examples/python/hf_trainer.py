"""Hugging Face ``Trainer`` (and ``accelerate``) on CPU over the "oxccl" backend: a tiny GPT-2
built from a config (nothing downloaded) trained for a few steps with DistributedDataParallel.

    torchrun --nproc-per-node 2 examples/python/hf_trainer.py
    oxccl run -n 2 -- python examples/python/hf_trainer.py --backend gloo

Needs ``pip install transformers accelerate``. Neither takes the name "oxccl":
``TrainingArguments.ddp_backend`` is a closed list (``--ddp_backend oxccl`` is an argparse
error), and on CPU accelerate's ``PartialState`` turns any backend but "mpi" into "gloo", then
raises "Your assigned backend oxccl is not available". Both leave a process group that is
already initialized alone, so this script initializes the default group over oxccl first and
gives no ``ddp_backend``: the Trainer's DDP then runs over oxccl (accelerate still reports
``state.backend == "gloo"``, a name only). The script does not import oxccl: installing the
package registers the backend name at ``import torch``.
"""

import argparse
import tempfile

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="oxccl")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None, help="save the trained parameters here (rank 0)")
    args = parser.parse_args()

    # Before TrainingArguments or Accelerator: they keep an initialized default group.
    dist.init_process_group(args.backend)  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, n = dist.get_rank(), dist.get_world_size()

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (64, 16), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]

    with tempfile.TemporaryDirectory() as out_dir:
        targs = TrainingArguments(
            output_dir=out_dir,
            use_cpu=True,
            per_device_train_batch_size=4,
            max_steps=args.steps,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            seed=0,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            ddp_find_unused_parameters=False,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=data)
        result = trainer.train()

    # The Trainer trained over the group initialized above: DDP around the model, oxccl below.
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(trainer.model_wrapped)
    assert dist.get_backend() == args.backend, dist.get_backend()
    assert trainer.args.world_size == n, trainer.args.world_size
    w = torch.cat([p.detach().flatten() for p in model.parameters()])
    ws = [torch.empty_like(w) for _ in range(n)]
    dist.all_gather(ws, w)
    assert all(torch.equal(ws[0], v) for v in ws), "ranks disagree"
    if rank == 0:
        if args.out:
            torch.save(w, args.out)
        print(f"Trainer, {n} ranks over {dist.get_backend()}: loss {result.training_loss:.4e}; done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
