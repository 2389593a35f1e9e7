"""The DDP peer of examples/mnist.py: same data, shards, model and metrics, torch DDP over gloo.

Run with torchrun's variables, for example on emulated hosts::

    bpslaunch netem --nodes 4 --rate 100mbit --torchrun -- \\
        python examples/ddp_mnist.py --hook powersgd --hidden 1100 --layers 2

``--model cnn`` trains mnist_job.py's CNN instead of the MLP (``--hidden``, ``--layers``).

``--hook``: ``none`` (plain allreduce), ``fp16`` (``fp16_compress_hook``),
``powersgd`` (``powerSGD_hook``, rank ``--powersgd-rank``, error feedback and warm
start) or ``bps`` (:func:`bps.ddp.ps_hook` through bps's servers, with the
compression flags of examples/mnist.py; run it under ``bpslaunch local`` or
``bpslaunch netem --servers N``, which export torch's variables too)::

    bpslaunch netem --nodes 4 --servers 4 --rate 100mbit -- python examples/ddp_mnist.py \
        --hook bps --compressor topk --k 0.01 --ef vanilla --momentum nesterov

With ``bps``, DDP's group is each node's own processes (``bps.ddp.init_process_group``):
DDP's collectives stay inside the node, the servers carry the gradients across nodes,
and the shards and metrics follow ``bps.rank()`` and ``bps.size()`` (docs/ddp.md).

All gradients go into one bucket (except with ``bps``, which keys each parameter
whatever the buckets): with several buckets the PowerSGD hook aborted on gloo with a
collective size mismatch. Rank 0 writes ``--metrics-json``
in examples/mnist.py's format (``steps[].time``, ``epochs[].test_accuracy`` /
``wall_time``), so bench/slow_network.py reads both alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

# imported before the group exists, as bps.init() does: imported after, it would keep the
# group alive past destroy_process_group() (docs/runtime.md, "Call bps.init() before")
import torch.distributed.nn.functional  # noqa: F401
import torch.nn.functional as F
from mnist_job import (
    LR_SCHEDULES,
    accuracy,
    add_compression_arguments,
    add_model_arguments,
    compression_params,
    epoch_batches,
    load_mnist,
    lr_schedule,
    make_model,
    make_optimizer,
    model_inputs,
    model_label,
    steps_per_epoch,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

SINGLE_BUCKET_MB = 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="MNIST data-parallel training with torch DDP")
    p.add_argument("--hook", choices=["none", "fp16", "powersgd", "bps"], default="none")
    add_compression_arguments(p)  # --hook bps: its compression_params; --mu: SGD momentum
    p.add_argument("--powersgd-rank", type=int, default=1)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant")
    p.add_argument("--batch-size", type=int, default=32, help="per worker process")
    add_model_arguments(p)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-json", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for any collective")
    return p.parse_args(argv)


def register_hook(model: DistributedDataParallel, hook: str, rank: int,
                  optimizer: torch.optim.Optimizer, args: argparse.Namespace):
    """Register ``--hook``; returns the bps hook's state (None for the others)."""
    if hook == "bps":
        import bps.ddp

        state = bps.ddp.HookState(compression_params(args), optimizer, model.module)
        model.register_comm_hook(state, bps.ddp.ps_hook)
        return state
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
            use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.hook == "bps":  # DDP's group within the node, bps's servers across the nodes
        import bps
        import bps.ddp

        bps.ddp.init_process_group("gloo", timeout=timeout)  # bps.init() first
        rank, size = bps.rank(), bps.size()
    else:
        dist.init_process_group("gloo", timeout=timeout)
        rank, size = dist.get_rank(), dist.get_world_size()
    (x_train, y_train), (x_test, y_test) = load_mnist(args.test_size, args.seed)
    x_train, x_test = model_inputs(x_train, args.model), model_inputs(x_test, args.model)

    torch.manual_seed(args.seed + rank)  # DDP broadcasts rank 0's parameters
    buckets = {} if args.hook == "bps" else {"bucket_cap_mb": SINGLE_BUCKET_MB}
    model = DistributedDataParallel(make_model(args.model, args.hidden, args.layers),
                                    **buckets)
    label = model_label(args.model, args.hidden, args.layers)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = make_optimizer(model, args.lr, args.mu, torch.device("cpu"))
    state = register_hook(model, args.hook, args.powersgd_rank, optimizer, args)
    scheduler = lr_schedule(optimizer, args.lr_schedule,
                            args.epochs * steps_per_epoch(len(y_train), size, args.batch_size))

    metrics: dict = {"args": vars(args), "model": label, "parameters": parameters,
                     "workers": size, "steps": [], "epochs": []}
    if rank == 0:
        print(f"ddp mnist: {size} workers, hook {args.hook}, model {label} "
              f"({parameters:,} parameters)", flush=True)
    generator = torch.Generator().manual_seed(args.seed)
    train_start = time.perf_counter()
    for epoch in range(args.epochs):
        # the same batches as examples/mnist.py
        for idx in epoch_batches(len(y_train), rank, size, args.batch_size, generator):
            t0 = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            metrics["steps"].append({"step": len(metrics["steps"]) + 1,
                                     "time": time.perf_counter() - t0, "loss": loss.item()})
        if rank == 0:
            acc = accuracy(model.module, x_test, y_test)
            metrics["epochs"].append({"epoch": epoch + 1, "test_accuracy": acc,
                                      "wall_time": time.perf_counter() - train_start})
            print(f"epoch {epoch + 1}/{args.epochs} test accuracy {acc:.2%} "
                  f"({time.perf_counter() - train_start:.1f}s)", flush=True)
    train_time = time.perf_counter() - train_start
    dist.barrier()
    if state is not None:
        metrics["stats"] = state.stats()
        state.close()
        import bps

        bps.shutdown()
    dist.destroy_process_group()
    if rank == 0 and args.metrics_json:
        metrics.update(test_accuracy=metrics["epochs"][-1]["test_accuracy"],
                       train_time=train_time)
        with open(args.metrics_json, "w") as f:
            json.dump(metrics, f, indent=1)
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalization: the DDP reducer still holds the gloo process
    # group, whose C++ threads are torn down there. Once in many runs that teardown
    # aborted a rank after all its output was written ("terminate called without an
    # active exception", exit 134), failing a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
