"""A worker node that dies and is started again joins the job again
(``bpslaunch local --min-workers 2 --max-restarts 1``): node 2 of 3 kills itself at the
start of step 2, the launcher starts it again with the same worker id, and it joins at
a step boundary with the state of node 0. Every node ends bit-identical, the joiner
starts from node 0's parameters at that step, and all match the numpy replay of the
membership: step 2 dropped, two nodes until the join, the step the join dropped, then
three nodes again, node 2's error feedback and momentum starting at zero."""

from __future__ import annotations

import json
import sys

import numpy as np

from tests.harness.trainer_job import (
    SHAPES,
    SIM_CASES,
    launch,
    plain,
    rejoin_train,
    replay,
    worker_main,
)

COMMON = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}
PARAMS = {**SIM_CASES["topk"], **COMMON}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25, 0.5, 0.25]  # powers of two: lr * g is exact
WORKERS = 3
VICTIM, KILLED_AT = 2, 2  # node 2 kills itself at the start of step 2
WAIT_AT = 4  # the others wait at the start of step 4 until the scheduler announced the join


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
                      fresh_workers={VICTIM: start})
    for rank in range(WORKERS):
        final = np.load(tmp_path / f"params{rank}.npz")
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")


if __name__ == "__main__":
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1]), rejoin_train))
