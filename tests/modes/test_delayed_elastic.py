"""One-step-delayed updates (``staleness=1``) when a worker node leaves the job
(``bpslaunch local --min-workers``): the round in flight when it died is dropped on every
survivor (the next step applies nothing), later rounds average over the nodes present;
the survivors end bit-identical to each other and to a numpy simulation."""

from __future__ import annotations

import numpy as np

from tests.harness.trainer_job import (
    MOMENTUM,
    SHAPES,
    SIM_CASES,
    big_chains,
    initial_params,
    launch,
    nesterov,
    targets,
)

PARAMS = {**SIM_CASES["topk"], "ef": "vanilla", "momentum": "nesterov", "fp16": False,
          "min_compress_bytes": 1000}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25, 0.125]
WORKERS, VICTIM, AT = 3, 1, 3


def simulate_stale(members: list[list[int] | None]) -> dict:
    """Step t pushes round t (the gradients at w_t, divided by the nodes present, or
    nothing where ``members[t]`` is None: dropped) and applies round t-1's aggregate
    with step t's lr (plain SGD: the momentum runs in the chains)."""
    f32 = np.float32
    w = initial_params(0, SHAPES)
    numel = int(np.prod(SHAPES["big"]))
    parts, workers, servers = big_chains(PARAMS, WORKERS, MOMENTUM)
    momentum = {n: np.zeros(s, f32) for n, s in SHAPES.items() if n != "big"}
    pending = None
    for t, lr in enumerate(LRS):
        present, aggregate = members[t], None
        if present is not None:
            shares = {r: {n: ((w[n] - targets(r, SHAPES)[n]).astype(f32)
                              / f32(len(present))).astype(f32) for n in SHAPES}
                      for r in present}
            aggregate = {}
            for n in momentum:
                summed = np.zeros(SHAPES[n], f32)
                for r in present:
                    summed = (summed + shares[r][n]).astype(f32)
                aggregate[n], momentum[n] = nesterov(f32(MOMENTUM), summed, momentum[n])
            big = np.zeros(numel, f32)
            for i, (offset, n) in enumerate(parts):
                summed = np.zeros(n, f32)
                for r in present:
                    workers[r][i].set_lr(lr)
                    share = shares[r]["big"].reshape(-1)[offset:offset + n]
                    summed = (summed + workers[r][i].decode(
                        workers[r][i].compress(share)).astype(f32)).astype(f32)
                servers[i].set_lr(lr)
                big[offset:offset + n] = servers[i].decode(servers[i].compress(summed))
            aggregate["big"] = big.reshape(SHAPES["big"])
        if pending is not None:
            for n in SHAPES:
                w[n] = (w[n] - f32(lr) * pending[n]).astype(f32)
        pending = aggregate
    return w


def test_a_killed_worker_node_drops_the_round_in_flight(tmp_path):
    """Node 1 killed at the start of step 3: its round 2 (pushed by its step() at step
    2) either all reached the servers, and round 3 is dropped, or not, and round 2 is;
    the survivors match the simulation of one of the two."""
    cfg = {"runs": [{"params": PARAMS, "mode": {"staleness": 1}}], "lrs": LRS,
           "stop": len(LRS), "leave": [VICTIM, AT, "SIGKILL"]}
    result = launch(cfg, tmp_path, workers=WORKERS, servers=2, timeout=150,
                    options=("--min-workers", "2"))
    assert result.returncode == 0, result.stdout[-4000:]
    survivors = [r for r in range(WORKERS) if r != VICTIM]
    finals = {r: np.load(tmp_path / f"params{r}.npz") for r in survivors}
    for n in SHAPES:
        np.testing.assert_array_equal(finals[0][n], finals[2][n], err_msg=n)
    everyone = list(range(WORKERS))
    outcomes = {dropped: simulate_stale([everyone] * dropped + [None]
                                        + [survivors] * (len(LRS) - dropped - 1))
                for dropped in (AT - 1, AT)}
    matches = [d for d, expected in outcomes.items()
               if all(np.array_equal(finals[0][n], expected[n]) for n in SHAPES)]
    assert len(matches) == 1, matches
    assert "membership generation 1" in result.stdout
