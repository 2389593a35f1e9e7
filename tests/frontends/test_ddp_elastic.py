"""Elastic membership with the DDP hook (``bpslaunch local --min-workers``): a worker
node killed at a given step leaves the job; the others go on, their parameters
bit-identical to each other and to the numpy replay (the step in flight dropped: its
buckets come back as zeros, on which the SGD step without momentum changes nothing;
later steps average over the nodes present).

This module is also the worker program (``python -m tests.frontends.test_ddp_elastic
CONFIG_JSON``), DDP over a gloo group of every node: DDP itself issues no collective
during the steps (no buffers to broadcast), so the dead node's absence from the group
is never noticed there."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from tests.harness.trainer_job import (
    MOMENTUM,
    SHAPES,
    SIM_CASES,
    closed_form,
    load_params,
    plain,
    replay,
    resume_stopped,
    step_faults,
    targets,
)
from tests.harness.trainer_job import launch as trainer_launch

PARAMS = {**SIM_CASES["topk"], "ef": "vanilla", "momentum": "nesterov", "fp16": False,
          "min_compress_bytes": 1000}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25]
WORKERS, LEAVES, AT = 3, 2, 2


def worker_main(cfg: dict) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import bps
    import bps.ddp

    torch.set_num_threads(1)
    bps.init()
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(cfg["out"])

    module = closed_form(rank, SHAPES)
    ddp = DistributedDataParallel(module)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LRS[0], momentum=MOMENTUM)
    state = bps.ddp.HookState(PARAMS, optimizer=optimizer, module=module)
    ddp.register_comm_hook(state, bps.ddp.ps_hook)
    goals = {n: torch.from_numpy(t) for n, t in targets(rank, SHAPES).items()}
    for step, lr in enumerate(LRS):
        step_faults(cfg, rank, step, out)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        ddp(goals).backward()
        optimizer.step()
    np.savez(out / f"params{rank}.npz",
             **{n: getattr(module, n).detach().numpy() for n in SHAPES})
    (out / f"report{rank}.json").write_text(json.dumps(state.stats()["totals"]))
    resume_stopped(out)
    state.close()
    bps.shutdown()
    sys.stdout.flush()
    os._exit(0)  # no gloo teardown: a member of its group is gone


def test_a_killed_worker_node_leaves_a_ddp_job_and_the_others_match_the_replay(tmp_path):
    cfg = {"leave": [LEAVES, AT, "SIGKILL"]}
    result = trainer_launch(cfg, tmp_path, workers=WORKERS, servers=2, timeout=150,
                            module=__name__, options=("--min-workers", "2"))
    assert result.returncode == 0, result.stdout[-4000:]
    members = [list(range(WORKERS))] * AT + [None] + [[0, 1]] * (len(LRS) - AT - 1)
    expected = replay(PARAMS, WORKERS, LRS, plain(SHAPES), members=members)
    for rank, final in enumerate(load_params(tmp_path, WORKERS - 1)):
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")
        totals = json.loads((tmp_path / f"report{rank}.json").read_text())
        assert totals["skipped_steps"] == 1, totals
    assert "membership generation 1" in result.stdout


def test_a_spare_takes_a_killed_servers_keys_in_a_ddp_job(tmp_path):
    """``--spare-servers 1``, 2 nodes: server 1 is killed at the start of step 2 and a
    spare takes its keys; that step's buckets come back as zeros on both nodes (one
    skipped step), and the server chain of the partition server 1 held (partition 1
    of "big") starts anew; both match the replay bit for bit."""
    result = trainer_launch({"kill_server": [1, AT]}, tmp_path, workers=2, servers=2,
                            timeout=150, module=__name__, options=("--spare-servers", "1"))
    assert result.returncode == 0, result.stdout[-4000:]
    assert "server 1 is now served from" in result.stdout, result.stdout[-4000:]
    members = [[0, 1]] * AT + [None] + [[0, 1]] * (len(LRS) - AT - 1)
    expected = replay(PARAMS, 2, LRS, plain(SHAPES), members=members,
                      fresh_servers={AT + 1: [1]})
    kept = replay(PARAMS, 2, LRS, plain(SHAPES), members=members)
    assert not np.array_equal(kept["big"], expected["big"])
    for rank, final in enumerate(load_params(tmp_path, 2)):
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")
        totals = json.loads((tmp_path / f"report{rank}.json").read_text())
        assert totals["skipped_steps"] == 1, totals


if __name__ == "__main__":
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1])))
