"""Checkpoints as the docs show them: docs/trainer.md's and docs/ddp.md's snippets, run
as typed, resume exactly, whatever the order of loading the optimizer and building the
trainer or the hook's state.

This module is also the worker program (``python -m tests.frontends.test_trainer_checkpoints
CONFIG_JSON`` under ``bpslaunch local``): the model is tests/harness/trainer_job.py's
(loss ``0.5 * ||w - t||^2``, gradient ``w - t`` exactly), so the uninterrupted runs are
also checked against the numpy replay of the same partitions through the reference
chains; the resumed runs must end bit for bit where the uninterrupted ones end.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from tests.harness.doc_snippets import checkpoint_snippet
from tests.harness.trainer_job import (
    MOMENTUM,
    SHAPES,
    SIM_CASES,
    SIM_LRS,
    closed_form,
    launch,
    load_params,
    make_model,
    plain,
    replay,
    targets,
)

PARAMS = {**SIM_CASES["randomk"], "ef": "vanilla", "momentum": "nesterov", "fp16": False,
          "min_compress_bytes": 1000}  # no mu: it comes from the optimizer's momentum
SAVE_AT = 3

# ----------------------------------------------------------------------------- worker side


def train_trainer(run: dict, rank: int) -> None:
    """DistributedTrainer; resumed with docs/trainer.md's snippet (``order: docs``) or
    with the optimizer loaded last (``order: optimizer-last``)."""
    import torch

    import bps

    save, resume = checkpoint_snippet("trainer.md")
    model = make_model(rank, SHAPES)
    optimizer = torch.optim.SGD(model.parameters(), lr=SIM_LRS[0], momentum=MOMENTUM)
    names = {"bps": bps, "torch": torch, "model": model, "optimizer": optimizer,
             "compression_params": dict(PARAMS)}
    start = run.get("start", 0)
    if not start:
        trainer = bps.DistributedTrainer(model, optimizer, dict(PARAMS))
    elif run["order"] == "docs":
        exec(resume, names)
        trainer = names["trainer"]
    else:  # the trainer first, the optimizer loaded after everything else
        trainer = bps.DistributedTrainer(model, optimizer, dict(PARAMS))
        checkpoint = torch.load(f"ckpt{bps.rank()}.pt", weights_only=False)
        trainer.load_state_dict(checkpoint["trainer"])
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    goal = {n: torch.from_numpy(t) for n, t in targets(rank, SHAPES).items()}
    for step in range(start, len(SIM_LRS)):
        for group in optimizer.param_groups:
            group["lr"] = SIM_LRS[step]
        trainer.zero_grad()
        sum((getattr(model, n) * (getattr(model, n).detach() - goal[n])).sum()
            for n in SHAPES).backward()
        trainer.step()
        if step + 1 == run.get("save_at"):
            exec(save, {**names, "trainer": trainer})
    np.savez(f"params{rank}.npz", **{n: getattr(model, n).detach().numpy() for n in SHAPES})
    trainer.close()


def train_ddp(run: dict, rank: int) -> None:
    """DDP with the hook as docs/ddp.md's "Usage" builds it (``module=model``), resumed
    with its checkpoint snippet (no ``module=``, the optimizer loaded first)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import bps.ddp

    save, resume = checkpoint_snippet("ddp.md")
    model = closed_form(rank, SHAPES)
    names = {"bps": bps, "torch": torch, "dist": dist, "model": model,
             "DistributedDataParallel": DistributedDataParallel,
             "compression_params": dict(PARAMS)}
    start = run.get("start", 0)
    if start:
        exec(resume, names)
        ddp, optimizer, state = names["ddp"], names["optimizer"], names["state"]
    else:
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=SIM_LRS[0], momentum=MOMENTUM)
        state = bps.ddp.HookState(dict(PARAMS), optimizer=optimizer, module=model)
        ddp.register_comm_hook(state, bps.ddp.ps_hook)
    goals = {n: torch.from_numpy(t) for n, t in targets(rank, SHAPES).items()}
    for step in range(start, len(SIM_LRS)):
        for group in optimizer.param_groups:
            group["lr"] = SIM_LRS[step]
        optimizer.zero_grad()
        ddp(goals).backward()
        optimizer.step()
        if step + 1 == run.get("save_at"):
            exec(save, {**names, "optimizer": optimizer, "state": state})
    np.savez(f"params{rank}.npz", **{n: getattr(model, n).detach().numpy() for n in SHAPES})
    state.close()


def worker_main(cfg: dict) -> int:
    import torch
    import torch.distributed as dist

    import bps

    torch.set_num_threads(1)
    bps.init()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for run in cfg["runs"]:
        os.chdir(Path(cfg["out"]) / run["tag"])  # the snippets' files: ckpt{rank}.pt
        (train_ddp if run["front"] == "ddp" else train_trainer)(run, rank)
    dist.barrier()  # neither rank tears gloo down while the other still talks
    bps.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: gloo's destructors may abort a finished run


# ----------------------------------------------------------------------------- test side


def run_job(runs: list[dict], out: Path, seed: str) -> None:
    for run in runs:
        (out / run["tag"]).mkdir(parents=True, exist_ok=True)
    result = launch({"runs": runs}, out, env={"BPS_JOB_SEED": seed, "BPS_TIMEOUT": "60"},
                    timeout=150, module=__name__)
    assert result.returncode == 0, result.stdout[-3000:]


def test_the_docs_checkpoint_snippets_resume_exactly_in_any_order(tmp_path):
    """Uninterrupted: 5 steps of randomk + error feedback + Nesterov (``mu`` from the
    optimizer), a checkpoint after step 3 by the docs' snippets, equal to the replay.
    Resumed in fresh processes with another job seed: docs/trainer.md's snippet (the
    optimizer loaded before the trainer is built), the trainer built and loaded first
    and the optimizer last, and docs/ddp.md's snippet (the optimizer loaded before the
    state is built, no ``module=``): each ends bit for bit where the uninterrupted run
    ends."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_job([{"tag": "trainer", "front": "trainer", "save_at": SAVE_AT},
             {"tag": "ddp", "front": "ddp", "save_at": SAVE_AT}], whole, "4242")
    expected = replay(PARAMS, 2, SIM_LRS, plain(SHAPES))
    for front in ("trainer", "ddp"):
        for final in load_params(whole / front, 2):
            for n in SHAPES:
                np.testing.assert_array_equal(final[n], expected[n], err_msg=f"{front}: {n}")
    runs = [{"tag": "trainer-docs", "front": "trainer", "order": "docs", "start": SAVE_AT},
            {"tag": "trainer-optimizer-last", "front": "trainer", "order": "optimizer-last",
             "start": SAVE_AT},
            {"tag": "ddp-docs", "front": "ddp", "start": SAVE_AT}]
    for run in runs:
        shutil.copytree(whole / run["front"], resumed / run["tag"],
                        ignore=shutil.ignore_patterns("params*"))
    run_job(runs, resumed, "999")
    for run in runs:
        for r, final in enumerate(load_params(resumed / run["tag"], 2)):
            for n in SHAPES:
                np.testing.assert_array_equal(final[n], expected[n],
                                              err_msg=f"{run['tag']} rank {r}: {n}")


if __name__ == "__main__":
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1])))
