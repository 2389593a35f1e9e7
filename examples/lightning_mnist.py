"""MNIST with PyTorch Lightning's DDPStrategy and the bps communication hook.

Lightning runs DDP; ``bps.ddp.ps_hook`` sends its gradient buckets through bps's
parameter servers (topk + error feedback + Nesterov by default). Every worker process
runs this script under ``bpslaunch``, which exports torch's variables (RANK,
WORLD_SIZE, LOCAL_RANK, GROUP_RANK, MASTER_*): Lightning then starts no processes of
its own::

    bpslaunch local --workers 2 --servers 1 -- python examples/lightning_mnist.py

It trains on the GPU where torch sees one (``--accelerator auto``; ``cpu`` forces the
host), each process on ``cuda:LOCAL_RANK``. DDP's own group is gloo by default, which
works for CUDA and CPU tensors and lets several nodes share one GPU; ``--backend nccl``
needs a GPU per process. Lightning registers ``ddp_comm_hook`` only where the root
device is CUDA; the callback ``bps.lightning.RegisterHook`` registers the same hook
and state on the CPU (and does nothing on CUDA, where Lightning did). It also hands the optimizer to
the hook's state, so the chains follow the learning rate; the state exists before
``configure_optimizers`` runs, so Nesterov's ``mu`` is given in compression_params
and the optimizer itself has no momentum.
"""

from __future__ import annotations

import argparse
import json
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from mnist_job import (
    accuracy,
    add_compression_arguments,
    build_model,
    compression_params,
    load_mnist,
)

import bps
import bps.ddp
import bps.lightning


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="MNIST with Lightning DDP and the bps hook")
    add_compression_arguments(p)
    p.set_defaults(compressor="topk", k=0.01, ef="vanilla", momentum="nesterov")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32, help="per worker process")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-json", default=None, help="each rank writes PATH.RANK")
    p.add_argument("--accelerator", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: the GPU where torch sees one")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="DDP's process group (nccl: one GPU per process)")
    return p.parse_args(argv)


class Classifier(L.LightningModule):
    def __init__(self, hidden: int, layers: int, lr: float) -> None:
        super().__init__()
        self.model = build_model(hidden, layers)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)  # Nesterov runs in bps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    bps.init()
    L.seed_everything(args.seed + bps.rank(), verbose=False)  # DDP syncs rank 0's model
    (x_train, y_train), (x_test, y_test) = load_mnist(args.test_size, args.seed)
    params = {**compression_params(args), "mu": args.mu}
    state = bps.ddp.HookState(params)
    strategy = DDPStrategy(ddp_comm_hook=bps.ddp.ps_hook, ddp_comm_state=state,
                           process_group_backend=args.backend)
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = L.Trainer(accelerator=accelerator, strategy=strategy, devices=bps.local_size(),
                        num_nodes=bps.size() // bps.local_size(), max_epochs=args.epochs,
                        max_steps=args.max_steps, callbacks=[bps.lightning.RegisterHook(state)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = Classifier(args.hidden, args.layers, args.lr)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train, y_train),
                                         batch_size=args.batch_size, shuffle=True)
    trainer.fit(module, loader)  # Lightning's DistributedSampler shards the digits
    device = next(module.model.parameters()).device  # Lightning may move it back after fit
    acc = accuracy(module.model, x_test.to(device), y_test.to(device))
    stats = state.stats()
    if bps.rank() == 0:
        print(f"lightning mnist: {trainer.global_step} steps on {trainer.strategy.root_device}, "
              f"test accuracy {acc:.2%}, "
              f"compression ratio {stats.get('compression_ratio', 0):.1f}", flush=True)
    if args.metrics_json:
        checksum = float(sum(p.detach().double().sum() for p in module.model.parameters()))
        with open(f"{args.metrics_json}.{bps.rank()}", "w") as f:
            json.dump({"steps": trainer.global_step, "test_accuracy": acc,
                       "device": str(trainer.strategy.root_device),
                       "hook_steps": stats.get("totals", {}).get("steps", 0),
                       "compression_ratio": stats.get("compression_ratio"),
                       "checksum": checksum}, f)
    state.close()
    if torch.distributed.is_initialized():  # now: left to the exit, gloo may abort (134)
        torch.distributed.destroy_process_group()
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
