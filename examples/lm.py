"""A byte-level GPT trained data-parallel with AdamW through bps: the transformer job.

Run it on a local cluster::

    bpslaunch local --workers 2 --servers 1 -- python examples/lm.py \\
        --compressor onebit --ef vanilla --freeze-step 60      # compressed Adam

The text is the Python standard library's own ``.py`` sources (found through
``sysconfig``, site-packages left out, sorted by path), their first ``--data-bytes``
bytes, split 90/10 by position; rank 0 prints their SHA-256 so runs on other hosts can
tell whether they trained on the same bytes. The model (:class:`GPT`) is a small
pre-norm transformer over bytes whose causal mask is a ``-inf`` buffer; AdamW with a
linear warm-up and a cosine decay to a tenth. Each worker draws its own windows of
``--context + 1`` bytes every step (seeded by seed, rank and step).

The compression flags are examples/mnist.py's (examples/mnist_job.py), plus
``--freeze-step`` (compressed Adam: compression_params ``freeze_step``) and
``--sync-every`` (local steps with AdamW inside). ``--ddp allreduce|powersgd`` trains
the same job with DDP over gloo instead (run it under ``torchrun`` or ``bpslaunch netem
--torchrun``): plain allreduce, or PyTorch's PowerSGD hook (rank ``--powersgd-rank``,
error feedback, warm start, from step 2), the peer that bench/slow_network.py's
``--model lm`` measures bps against. Rank 0 reports the validation loss
(nats and bits per byte) on the held-out tenth, the bytes on the wire (in total, per
step, and before and after the freeze) and the time; ``--metrics-json PATH`` writes
them with every step's figures.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from mnist_job import add_compression_arguments, compression_params

import bps

START = time.perf_counter()


def stdlib_bytes(limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's ``.py`` files (site-packages
    and dist-packages left out), concatenated in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    text = b"".join(chunks)[:limit]
    if len(text) < limit:
        raise ValueError(f"--data-bytes {limit}: the standard library at {root} has only "
                         f"{len(text)} bytes of .py sources")
    return text


def load_text(limit: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train, validation, sha256): the bytes as int64 tokens, split 90/10 by position."""
    text = stdlib_bytes(limit)
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    cut = len(tokens) * 9 // 10
    return tokens[:cut], tokens[cut:], hashlib.sha256(text).hexdigest()


class Block(torch.nn.Module):
    """Pre-norm attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads)) + mask[:t, :t]
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(torch.nn.Module):
    """A byte-level GPT: token and position embeddings, ``layers`` blocks, a final norm
    and an untied head; the causal mask is a buffer of ``-inf`` above the diagonal.

        >>> sum(p.numel() for p in GPT(96, 2, 64).parameters())
        279424
    """

    def __init__(self, width: int, layers: int, context: int, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(256, width), torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, 256)
        self.register_buffer("mask", torch.full((context, context), float("-inf")).triu(1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln(x))


def windows(tokens: torch.Tensor, starts: torch.Tensor, context: int) -> tuple:
    """(inputs, targets) of the windows of ``context + 1`` bytes at ``starts``."""
    rows = torch.stack([tokens[s:s + context + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def batch(tokens: torch.Tensor, size: int, context: int, seed: int, rank: int,
          step: int) -> tuple:
    """This rank's batch of ``step``: random windows, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    return windows(tokens, torch.randint(len(tokens) - context - 1, (size,), generator=gen),
                   context)


def validation_loss(model: GPT, tokens: torch.Tensor, context: int, count: int) -> float:
    """Mean cross-entropy (nats per byte) over ``count`` evenly spaced windows."""
    starts = torch.linspace(0, len(tokens) - context - 2, count).long()
    model.eval()
    with torch.no_grad():
        total = 0.0
        for chunk in starts.split(64):
            x, y = windows(tokens, chunk, context)
            total += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
    model.train()
    return total / (count * context)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over ``--warmup`` steps, then a cosine decay to ``lr / 10``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="byte-level GPT data-parallel training with bps")
    add_compression_arguments(p)
    p.add_argument("--freeze-step", type=int, default=None,
                   help="compressed Adam: plain AdamW steps before the variance freezes "
                        "and the momentum travels compressed")
    p.add_argument("--sync-every", type=int, default=1,
                   help="local AdamW steps per sync (periodic averaging; 1: every step)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="windows per worker and step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30, help="learning-rate warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--data-bytes", type=int, default=2_000_000)
    p.add_argument("--val-windows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--target", type=float, default=None,
                   help="also report the wall time at which the validation loss (every "
                        "--eval-every steps) first reached this many nats")
    p.add_argument("--eval-every", type=int, default=0, help="0: only at the end")
    p.add_argument("--metrics-json", default=None, help="write figures to this file (rank 0)")
    p.add_argument("--ddp", choices=["none", "allreduce", "powersgd"], default="none",
                   help="train with DDP over gloo instead of bps (under torchrun)")
    p.add_argument("--powersgd-rank", type=int, default=1)
    return p.parse_args(argv)


def lm_params(args: argparse.Namespace) -> dict | None:
    """The compression_params of the flags: mnist_job's, plus ``freeze_step``."""
    params = compression_params(args)
    if args.freeze_step is not None:
        params["freeze_step"] = args.freeze_step
    return params


class DDPTrainer:
    """The trainer's calls the loop makes, for DDP over gloo (``--ddp``): backward
    averages through DDP's hook, ``step()`` is the optimizer's."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 hook: str, rank: int) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        # one bucket: with several the PowerSGD hook aborted on gloo (examples/ddp_mnist.py)
        self.model = DistributedDataParallel(model, bucket_cap_mb=64)
        self.optimizer = optimizer
        if hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                use_error_feedback=True, warm_start=True)
            self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        self.steps = 0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()
        self.steps += 1

    def stats(self) -> dict:
        return {"bytes_pushed": 0, "bytes_pulled": 0, "raw_bytes": 0,
                "totals": {"raw_bytes": 0, "steps": self.steps}}

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    params = lm_params(args) if args.ddp == "none" else None
    train, val, digest = load_text(args.data_bytes)
    if args.ddp == "none":
        bps.init()
        rank, size = bps.rank(), bps.size()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)  # the trainer (DDP) gives every rank rank 0's model
    model = GPT(args.width, args.layers, args.context)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99),
                                  weight_decay=args.weight_decay)
    if args.ddp == "none":
        extra = {"sync_every": args.sync_every} if args.sync_every > 1 else {}
        trainer = bps.DistributedTrainer(model, optimizer, params, **extra)
    else:
        trainer = DDPTrainer(model, optimizer, args.ddp, args.powersgd_rank)
    if rank == 0:
        print(f"bps lm: {size} workers, stdlib .py bytes {len(train)} train / {len(val)} "
              f"validation, sha256 {digest}, GPT width {args.width} x {args.layers} layers, "
              f"context {args.context} ({parameters:,} parameters), compression "
              f"{json.dumps(params)}, sync every {args.sync_every}, ddp {args.ddp}", flush=True)
    metrics: dict = {"args": vars(args), "sha256": digest, "parameters": parameters,
                     "compression_params": params, "workers": size, "steps": [], "evals": []}
    reached = None
    train_start = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        started = time.perf_counter()
        x, y = batch(train, args.batch_size, args.context, args.seed, rank, step)
        trainer.zero_grad()
        forward = model if args.ddp == "none" else trainer.model
        loss = F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
        loss.backward()
        trainer.step()
        stats = trainer.stats()
        metrics["steps"].append({"loss": loss.item(), "bytes": stats["bytes_pushed"]
                                 + stats["bytes_pulled"], "raw_bytes": stats["raw_bytes"],
                                 "time": time.perf_counter() - started})
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            value = validation_loss(model, val, args.context, args.val_windows)
            now = time.perf_counter() - train_start
            metrics["evals"].append({"step": step + 1, "val_loss": value, "time": now})
            if reached is None and args.target is not None and value <= args.target:
                reached = now
    train_time = time.perf_counter() - train_start
    final = validation_loss(model, val, args.context, args.val_windows)
    metrics["evals"].append({"step": args.steps, "val_loss": final, "time": train_time})
    if reached is None and args.target is not None and final <= args.target:
        reached = train_time
    totals = trainer.stats()["totals"]
    trainer.close()
    if args.ddp == "none":
        bps.shutdown()
    if rank != 0:
        return 0
    sent = [s["bytes"] for s in metrics["steps"]]
    freeze = args.freeze_step or 0
    after = sent[freeze:] if freeze else sent
    fp32 = 2 * totals["raw_bytes"] / max(1, totals["steps"]) or math.nan  # DDP: not counted
    metrics.update(val_loss=final, bits_per_byte=final / math.log(2), train_time=train_time,
                   wall_time=time.perf_counter() - START, totals=totals,
                   bytes_per_step=sum(sent) / len(sent), fp32_bytes_per_step=fp32,
                   bytes_per_step_after_freeze=sum(after) / max(1, len(after)),
                   target=args.target, time_to_target=reached)
    print(f"validation loss {final:.4f} nats ({final / math.log(2):.4f} bits/byte); "
          f"{sum(sent) / len(sent):,.0f} B/step on the wire (fp32: {fp32:,.0f}), "
          f"{sum(after) / max(1, len(after)):,.0f} B/step after step {freeze}; "
          f"training {train_time:.1f} s" + (f"; target {args.target} reached at "
                                             f"{reached:.1f} s" if reached else ""), flush=True)
    if args.metrics_json:
        with open(args.metrics_json, "w") as f:
            json.dump(metrics, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
