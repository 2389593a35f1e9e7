"""Local SGD (``sync_every``) when a worker node leaves the job (``bpslaunch local
--min-workers``): the first outer round after its death is dropped on every survivor
(each goes back to the parameters of the last sync, as for a non-finite delta), the
later rounds average the deltas of the nodes present; the survivors end bit-identical to
each other and to a numpy simulation."""

from __future__ import annotations

import numpy as np

from tests.harness.trainer_job import (
    SHAPES,
    SIM_CASES,
    big_chains,
    initial_params,
    launch,
    local_step,
    outer_average,
)

PARAMS = {**SIM_CASES["topk"], "ef": "vanilla", "fp16": False, "min_compress_bytes": 1000}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25, 0.125, 0.0625, 0.25]
EVERY, WORKERS, VICTIM, AT = 3, 3, 1, 4  # killed in the second round's local steps


def simulate(dropped_round: int) -> dict:
    """Local SGD with momentum on each node's own target; every EVERY steps the deltas
    ``anchor - w`` of the nodes present, divided by their number, go through topk with
    error feedback (the chains' lr: the outer lr, 1) and the servers' sum in node order,
    and the anchor moves by the mean (outer "average"); round ``dropped_round`` is
    dropped: every survivor restarts from the anchor."""
    anchor = initial_params(0, SHAPES)
    survivors = [r for r in range(WORKERS) if r != VICTIM]
    ws = {r: dict(anchor) for r in range(WORKERS)}
    bufs = {r: {n: None for n in SHAPES} for r in range(WORKERS)}
    parts, workers, servers = big_chains(PARAMS, WORKERS, None)
    rounds = 0
    for step, lr in enumerate(LRS):
        for r in ws:
            local_step(ws[r], bufs[r], r, lr)
        if (step + 1) % EVERY:
            continue
        present = list(range(WORKERS)) if rounds < dropped_round else survivors
        if rounds != dropped_round:
            outer_average(anchor, ws, present, parts, workers, servers)
        rounds += 1
        ws = {r: dict(anchor) for r in (present if rounds > dropped_round else ws)}
    return ws[survivors[0]]


def test_the_round_after_a_worker_node_died_is_dropped(tmp_path):
    """Node 1 killed at the start of step 4 (a local step of the second round): rounds
    1 and 3 (steps 2 and 8) average over three and two nodes, round 2 (step 5) is
    dropped; the survivors match the simulation bit for bit."""
    cfg = {"runs": [{"params": PARAMS, "mode": {"sync_every": EVERY}}], "lrs": LRS,
           "stop": len(LRS), "leave": [VICTIM, AT, "SIGKILL"]}
    result = launch(cfg, tmp_path, workers=WORKERS, servers=2, timeout=150,
                    options=("--min-workers", "2"))
    assert result.returncode == 0, result.stdout[-4000:]
    expected = simulate(dropped_round=1)
    for rank in (0, 2):
        final = np.load(tmp_path / f"params{rank}.npz")
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")
    assert "membership generation 1" in result.stdout
