"""A worker node that dies and is started again joins the job again
(``bpslaunch local --min-workers 2 --max-restarts 1``): node 2 of 3 kills itself at the
start of step 2, the launcher starts it again with the same worker id, and it joins at
a step boundary with the state of node 0. Every node ends bit-identical, the joiner
starts from node 0's parameters at that step, and all match the numpy replay of the
membership: step 2 dropped, two nodes until the join, the step the join dropped, then
three nodes again, node 2's error feedback and momentum starting at zero."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from tests.harness.trainer_job import (
    MOMENTUM,
    SHAPES,
    SIM_CASES,
    launch,
    make_model,
    plain,
    replay,
    targets,
    worker_main,
)

COMMON = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}
PARAMS = {**SIM_CASES["topk"], **COMMON}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25, 0.5, 0.25]  # powers of two: lr * g is exact
WORKERS = 3
VICTIM, KILLED_AT = 2, 2  # node 2 kills itself at the start of step 2
WAIT_AT = 4  # the others wait at the start of step 4 until the scheduler announced the join


def rejoin_train(cfg: dict, run: dict, rank: int, shapes: dict, out: Path) -> dict:
    """Train the closed-form model; the victim kills itself once; a node that joins
    saves the parameters it started from; every node saves its parameters at the start
    of each step."""
    import torch

    import bps

    model = make_model(rank, shapes)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lrs"][0], momentum=MOMENTUM)
    trainer = bps.DistributedTrainer(model, optimizer, run["params"])
    start = trainer.step_count
    params = lambda: {n: getattr(model, n).detach().numpy().copy() for n in shapes}  # noqa: E731
    if start:
        np.savez(out / f"admitted{rank}.npz", **params())
    goal = {n: torch.from_numpy(t) for n, t in targets(rank, shapes).items()}
    engine = bps.core.runtime.get().engine
    history, skipped = {}, []
    for step in range(start, cfg["stop"]):
        marker = out / f"killed{rank}"
        if (rank, step) == tuple(cfg["kill"]) and not marker.exists():
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        if step == cfg["wait_at"] and rank != cfg["kill"][0]:
            deadline = time.monotonic() + 90  # the victim starts again: seconds
            while engine.announced_generation < 2:
                assert time.monotonic() < deadline, "the restarted node never joined"
                time.sleep(0.01)
        history.update({f"{n}@{step}": v for n, v in params().items()})
        for group in optimizer.param_groups:
            group["lr"] = cfg["lrs"][step]
        trainer.zero_grad()
        sum((getattr(model, n) * (getattr(model, n).detach() - goal[n])).sum()
            for n in shapes).backward()  # grad = w - t_rank exactly
        trainer.step()
        if trainer.stats()["skipped"]:
            skipped.append(step)
    np.savez(out / f"params{rank}.npz", **params())
    np.savez(out / f"history{rank}.npz", **history)
    trainer.close()
    return {"start": start, "skipped": skipped}


def test_a_killed_worker_node_restarts_joins_and_matches_the_replay(tmp_path):
    cfg = {"runs": [{"params": PARAMS}], "lrs": LRS, "stop": len(LRS),
           "kill": [VICTIM, KILLED_AT], "wait_at": WAIT_AT}
    result = launch(cfg, tmp_path, workers=WORKERS, servers=2, timeout=240,
                    module=__name__, options=("--min-workers", "2", "--max-restarts", "1"))
    out = result.stdout
    assert result.returncode == 0, out[-6000:]
    assert "restarting worker node 2" in out, out[-6000:]
    assert "worker 2 at 127.0.0.1 joined: worker nodes [0, 1, 2] (membership generation 2)" \
        in out, out[-6000:]
    reports = [json.loads((tmp_path / f"report{r}.json").read_text())[""]
               for r in range(WORKERS)]
    start = reports[VICTIM]["start"]
    dropped = start - 1  # the step the join dropped, on the nodes present
    assert WAIT_AT <= dropped < len(LRS) - 1, reports
    for rank in (0, 1):
        assert reports[rank] == {"start": 0, "skipped": [KILLED_AT, dropped]}, reports
    assert reports[VICTIM]["skipped"] == [], reports
    # the joiner started from node 0's parameters at that step
    admitted = np.load(tmp_path / f"admitted{VICTIM}.npz")
    history = np.load(tmp_path / "history0.npz")
    for n in SHAPES:
        np.testing.assert_array_equal(admitted[n], history[f"{n}@{start}"], err_msg=n)
    # every node alike, and as the numpy replay of the membership
    everyone, survivors = list(range(WORKERS)), [0, 1]
    members = [everyone] * KILLED_AT + [None] + [survivors] * (dropped - KILLED_AT - 1) + \
        [None] + [everyone] * (len(LRS) - dropped - 1)
    expected = replay(PARAMS, WORKERS, LRS, plain(SHAPES), members=members,
                      fresh={VICTIM: start})
    for rank in range(WORKERS):
        final = np.load(tmp_path / f"params{rank}.npz")
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")


if __name__ == "__main__":
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1]), rejoin_train))
