"""Local SGD (``sync_every``) when a worker node dies and joins again
(``bpslaunch local --min-workers 2 --max-restarts 1``): the round after its death is
dropped, the next ones average over two nodes, the round after its join is dropped too
(every node back to the last sync's parameters), and the joiner starts there with node
0's anchor and optimizer state and its own error feedback at zero; every node ends
bit-identical to the others and to a numpy simulation."""

from __future__ import annotations

import json
import sys

import numpy as np

from tests.harness.trainer_job import (
    SHAPES,
    SIM_CASES,
    big_chains,
    initial_params,
    launch,
    local_step,
    outer_average,
    rejoin_train,
    worker_main,
)

PARAMS = {**SIM_CASES["topk"], "ef": "vanilla", "fp16": False, "min_compress_bytes": 1000}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25, 0.125, 0.0625, 0.25, 0.5, 0.25, 0.125,
       0.25, 0.5, 0.125, 0.25, 0.0625, 0.125]
EVERY, WORKERS, VICTIM = 3, 3, 2
KILLED_AT, WAIT_AT = 4, 9  # a local step of round 1; the others wait before round 3


def simulate(joined_round: int) -> dict:
    """Local SGD with momentum on each node's own target; every EVERY steps the deltas of
    the nodes present, divided by their number, go through topk with error feedback and
    the servers' sum, and the anchor moves by the mean. Round 1 is dropped (node 2
    died), the rounds up to ``joined_round`` average nodes 0 and 1, ``joined_round`` is
    dropped (node 2 joins: it starts from the anchor with node 0's momentum buffers and
    fresh chains), the later ones average all three."""
    anchor = initial_params(0, SHAPES)
    ws = {r: dict(anchor) for r in range(WORKERS)}
    bufs = {r: {n: None for n in SHAPES} for r in range(WORKERS)}
    parts, workers, servers = big_chains(PARAMS, WORKERS, None)
    present = list(range(WORKERS))
    for step, lr in enumerate(LRS):
        for r in present:
            local_step(ws[r], bufs[r], r, lr)
        if (step + 1) % EVERY:
            continue
        round_ = step // EVERY
        if round_ == 1:  # node 2 died in its local steps
            present = [0, 1]
        elif round_ == joined_round:  # node 2 joins with node 0's state
            bufs[VICTIM] = {n: b.copy() for n, b in bufs[0].items()}
            workers[VICTIM] = big_chains(PARAMS, 1, None)[1][0]
            present = list(range(WORKERS))
        else:
            outer_average(anchor, ws, present, parts, workers, servers)
        ws = {r: dict(anchor) for r in present}
    return ws[0]


def test_a_restarted_node_joins_local_sgd_at_a_dropped_round(tmp_path):
    cfg = {"runs": [{"params": PARAMS, "mode": {"sync_every": EVERY}}], "lrs": LRS,
           "stop": len(LRS), "kill": [VICTIM, KILLED_AT], "wait_at": WAIT_AT}
    result = launch(cfg, tmp_path, workers=WORKERS, servers=2, timeout=240,
                    module=__name__, options=("--min-workers", "2", "--max-restarts", "1"))
    out = result.stdout
    assert result.returncode == 0, out[-6000:]
    assert "restarting worker node 2" in out, out[-6000:]
    start = json.loads((tmp_path / f"report{VICTIM}.json").read_text())[""]["start"]
    assert start % EVERY == 0 and WAIT_AT < start < len(LRS) - EVERY, start
    admitted = np.load(tmp_path / f"admitted{VICTIM}.npz")
    history = np.load(tmp_path / "history0.npz")
    for n in SHAPES:  # the anchor node 0 went back to
        np.testing.assert_array_equal(admitted[n], history[f"{n}@{start}"], err_msg=n)
    expected = simulate(joined_round=start // EVERY - 1)
    for rank in range(WORKERS):
        final = np.load(tmp_path / f"params{rank}.npz")
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")


if __name__ == "__main__":
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1]), rejoin_train))
