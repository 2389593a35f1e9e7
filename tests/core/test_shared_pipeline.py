"""The gradient pipeline in the node agent (``BPS_NODE_AGENT=1``, one local rank) on real
clusters: ``.grad`` is a view into shared memory, pushes are announced in a few bytes,
and every way of training ends bit for bit where the pipeline in the training process
ends, and where the numpy replay of the pipeline says.

This module is also the worker program (``python -m tests.core.test_shared_pipeline
CONFIG_JSON``): one trainer per run, with the run's way of zeroing ``.grad`` and step mode.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness.trainer_job import (
    MOMENTUM,
    SHAPES,
    SIM_CASES,
    SIM_LRS,
    load_params,
    load_reports,
    make_model,
    simulate,
    targets,
    worker_main,
)
from tests.harness.trainer_job import launch as trainer_launch

COMMON = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}
ONEBIT = {**SIM_CASES["onebit"], **COMMON}
RUNS = [
    # .grad stays the shared buffer: trainer.zero_grad() fills it with zeros
    {"tag": "views", "params": ONEBIT, "zero": "trainer"},
    # .grad set to None each step: the push copies autograd's tensor into the buffer
    {"tag": "none", "params": ONEBIT, "zero": "optimizer"},
    # .grad replaced by a tensor of the script's: copied in, and the buffer is .grad again
    {"tag": "replaced", "params": ONEBIT, "zero": "replace"},
    # the modes that push copies or pseudo-gradients, and raw keys in float16
    {"tag": "delayed", "params": ONEBIT, "zero": "trainer", "staleness": 1},
    {"tag": "periodic", "params": {"momentum": "nesterov", "mu": 0.5}, "zero": "trainer",
     "sync_every": 2},
    {"tag": "fp16", "params": {"momentum": "nesterov", "fp16": True}, "zero": "trainer"},
]


# a node of two local ranks: the agent sums their shares in rank order in the node's dtype
LOCAL_RUNS = [
    {"tag": "local-fp16", "params": {**ONEBIT, "fp16": True, "min_compress_bytes": 600},
     "zero": "trainer"},
    {"tag": "local-bf16", "params": {"momentum": "nesterov", "comm_dtype": "bf16"},
     "zero": "optimizer"},
    {"tag": "local-fp32", "params": ONEBIT, "zero": "trainer", "staleness": 1},
]


# ----------------------------------------------------------------------------- worker side


def in_shared_memory(tensor) -> bool:
    """Whether ``tensor``'s first byte lies in a mapping of a node agent's segment."""
    if tensor is None:
        return False
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return len(fields) > 5 and fields[5].startswith("/dev/shm/bps-")
    return False


def train(cfg: dict, run: dict, rank: int, shapes: dict, out: Path) -> dict:
    import torch

    import bps

    model = make_model(rank, shapes)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lrs"][0], momentum=MOMENTUM)
    trainer = bps.DistributedTrainer(model, optimizer, run["params"],
                                     staleness=run.get("staleness", 0),
                                     sync_every=run.get("sync_every", 1))
    goal = {name: torch.from_numpy(t) for name, t in targets(rank, shapes).items()}
    params = dict(model.named_parameters())
    report = {"pipeline": type(trainer.core.pipeline).__name__, "views": [], "same": []}
    for lr in cfg["lrs"]:
        for group in optimizer.param_groups:
            group["lr"] = lr
        if run["zero"] == "trainer":
            trainer.zero_grad()
        elif run["zero"] == "optimizer":
            optimizer.zero_grad(set_to_none=True)
        else:
            for p in params.values():
                p.grad = torch.full_like(p, 0.0)
        before = {n: p.grad for n, p in params.items()}
        loss = sum((params[n] * (params[n].detach() - goal[n])).sum() for n in shapes)
        loss.backward()
        trainer.step()
        report["views"].append(all(in_shared_memory(p.grad) for p in params.values()))
        report["same"].append(all(p.grad is before[n] for n, p in params.items()))
    np.savez(out / f"params{run['tag']}{rank}.npz",
             **{n: p.detach().numpy() for n, p in params.items()})
    trainer.close()
    return report


# ----------------------------------------------------------------------------- test side


def run_both(tmp_path: Path, runs: list[dict], local_size: int = 1) -> tuple[dict, dict]:
    """The same job with the pipeline in the training processes, then in the node
    agents: ``{where: {tag: params by rank}}``, ``{where: reports}``."""
    results, reports = {}, {}
    ranks = 2 * local_size
    for where, env in (("process", {}), ("agent", {"BPS_NODE_AGENT": "1"})):
        out = tmp_path / where
        out.mkdir()
        result = trainer_launch({"runs": runs, "lrs": SIM_LRS}, out, workers=2, servers=1,
                                local_size=local_size, env=env, module=__name__, timeout=240)
        assert result.returncode == 0, result.stdout[-3000:]
        results[where] = {run["tag"]: load_params(out, ranks, run["tag"]) for run in runs}
        reports[where] = load_reports(out, ranks)
    for run in runs:
        for rank in range(ranks):
            for name in SHAPES:
                np.testing.assert_array_equal(results["agent"][run["tag"]][rank][name],
                                              results["process"][run["tag"]][rank][name],
                                              err_msg=f"{run['tag']} {name} rank {rank}")
    return results, reports


def test_every_way_of_training_ends_where_the_pipeline_in_process_does(tmp_path):
    results, reports = run_both(tmp_path, RUNS)
    for where in ("process", "agent"):
        for rank in range(2):
            report = reports[where][rank]
            if where == "agent":
                assert {r["pipeline"] for r in report.values()} == {"SharedPipeline"}
                # .grad is the buffer, the same tensor every step, where the trainer zeroes
                assert report["views"]["views"] == [True] * len(SIM_LRS)
                assert report["views"]["same"] == [True] * len(SIM_LRS)
                # a .grad set to None or replaced becomes the buffer at its push
                assert report["none"]["views"] == [True] * len(SIM_LRS)
                assert report["replaced"]["views"] == [True] * len(SIM_LRS)
                assert report["replaced"]["same"] == [False] * len(SIM_LRS)
            else:
                assert {r["pipeline"] for r in report.values()} == {"GradPipeline"}
                assert not any(report["views"]["views"])
    # and where numpy's replay of the pipeline says, for the synchronous runs
    expected = simulate(ONEBIT, 2, SIM_LRS)
    for tag in ("views", "none", "replaced"):
        for rank in range(2):
            for name in SHAPES:
                np.testing.assert_array_equal(results["agent"][tag][rank][name],
                                              expected[name], err_msg=f"{tag} {name}")


@pytest.mark.slow  # tests/worker/test_agent.py's two local ranks cover fp16 and bf16
def test_two_local_ranks_end_where_the_pipeline_in_process_does(tmp_path):
    # 2 nodes x 2 local ranks: one pipeline in each node's agent for both ranks, the
    # node's sum in float16, bfloat16 and float32 (gloo's, in process)
    _, reports = run_both(tmp_path, LOCAL_RUNS, local_size=2)
    for rank, report in enumerate(reports["agent"]):
        assert {r["pipeline"] for r in report.values()} == {"SharedPipeline"}, rank
        assert report["local-fp16"]["views"] == [True] * len(SIM_LRS), rank


if __name__ == "__main__":
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1]), train))
