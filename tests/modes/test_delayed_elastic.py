"""One-step-delayed updates (``staleness=1``) when a worker node leaves the job
(``bpslaunch local --min-workers``): the round in flight when it died is dropped on every
survivor (the next step applies nothing), later rounds average over the nodes present;
the survivors end bit-identical to each other and to a numpy simulation."""

from __future__ import annotations

import json

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


def simulate_stale(members: list[list[int] | None], lrs: list[float] = LRS,
                   joined: tuple[int, int] | None = None,
                   fresh_servers: tuple[int, list[int]] | None = None) -> dict:
    """Step t pushes round t (the gradients at w_t, divided by the nodes present, or
    nothing where ``members[t]`` is None: dropped) and applies round t-1's aggregate
    with step t's lr (plain SGD: the momentum runs in the chains). ``joined`` = (node,
    round): that node joined for that round: counted among the nodes present, it
    pushes zeros (no chain runs), and its chains start anew from the round after.
    ``fresh_servers`` = (round, partitions): those partitions' server chains start anew
    from that round (their server was replaced)."""
    f32 = np.float32
    w = initial_params(0, SHAPES)
    numel = int(np.prod(SHAPES["big"]))
    parts, workers, servers = big_chains(PARAMS, WORKERS, MOMENTUM)
    momentum = {n: np.zeros(s, f32) for n, s in SHAPES.items() if n != "big"}
    pending = None
    for t, lr in enumerate(lrs):
        present, aggregate = members[t], None
        if joined is not None and t == joined[1] + 1:  # the joiner's own chains: zero
            workers[joined[0]] = big_chains(PARAMS, WORKERS, MOMENTUM)[1][joined[0]]
        if fresh_servers is not None and t == fresh_servers[0]:
            for i in fresh_servers[1]:
                servers[i] = big_chains(PARAMS, WORKERS, MOMENTUM)[2][i]
        if present is not None:
            pushing = [r for r in present if joined is None or (r, t) != joined]
            shares = {r: {n: ((w[n] - targets(r, SHAPES)[n]).astype(f32)
                              / f32(len(present))).astype(f32) for n in SHAPES}
                      for r in pushing}
            aggregate = {}
            for n in momentum:
                summed = np.zeros(SHAPES[n], f32)
                for r in pushing:
                    summed = (summed + shares[r][n]).astype(f32)
                aggregate[n], momentum[n] = nesterov(f32(MOMENTUM), summed, momentum[n])
            big = np.zeros(numel, f32)
            for i, (offset, n) in enumerate(parts):
                summed = np.zeros(n, f32)
                for r in pushing:
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


def test_a_spare_takes_a_killed_servers_keys_and_the_round_in_flight_is_dropped(tmp_path):
    """``--spare-servers 1``, 2 nodes: server 1 is killed at the start of step 3, with
    round 2 in flight; the spare takes its keys. Round 2 (if the dead server had not
    answered it everywhere) or round 3 is dropped; the server chain of partition 1 of
    "big" (the one server 1 held) starts anew after it. Both nodes match the simulation
    of one of the two."""
    cfg = {"runs": [{"params": PARAMS, "mode": {"staleness": 1}}], "lrs": LRS,
           "stop": len(LRS), "kill_server": [1, AT]}
    result = launch(cfg, tmp_path, workers=2, servers=2, timeout=150,
                    options=("--spare-servers", "1"))
    assert result.returncode == 0, result.stdout[-4000:]
    assert "server 1 is now served from" in result.stdout, result.stdout[-4000:]
    finals = [np.load(tmp_path / f"params{r}.npz") for r in (0, 1)]
    for n in SHAPES:
        np.testing.assert_array_equal(finals[0][n], finals[1][n], err_msg=n)
    both = [0, 1]
    outcomes = {dropped: simulate_stale([both] * dropped + [None]
                                        + [both] * (len(LRS) - dropped - 1),
                                        fresh_servers=(dropped + 1, [1]))
                for dropped in (AT - 1, AT)}
    matches = [d for d, expected in outcomes.items()
               if all(np.array_equal(finals[0][n], expected[n]) for n in SHAPES)]
    assert len(matches) == 1, matches
    # the replay tells the reset apart
    dropped = matches[0]
    kept = simulate_stale([both] * dropped + [None] + [both] * (len(LRS) - dropped - 1))
    assert not np.array_equal(kept["big"], outcomes[dropped]["big"])


def test_a_restarted_worker_node_joins_in_the_round_in_flight(tmp_path):
    """``--max-restarts 1``: node 2 of 3 kills itself (SIGKILL) at the start of step 2,
    starts again and joins; the others wait at step 5 for the join. The join drops the
    round in flight; the next round, pushed after the others learned the membership,
    is divided by three and waits for the joiner, which takes part in it with zeros
    (it computed no gradient for it) and applies its aggregate with everyone. Every node
    ends bit-identical to the simulation of that membership."""
    lrs = LRS + [0.5, 0.25, 0.5]
    cfg = {"runs": [{"params": PARAMS, "mode": {"staleness": 1}}], "lrs": lrs,
           "stop": len(lrs), "kill": [2, 2], "wait_at": 5}
    result = launch(cfg, tmp_path, workers=WORKERS, servers=2, timeout=240,
                    options=("--min-workers", "2", "--max-restarts", "1"))
    assert result.returncode == 0, result.stdout[-6000:]
    assert "joined: worker nodes [0, 1, 2] (membership generation 2)" in result.stdout
    reports = [json.loads((tmp_path / f"report{r}.json").read_text())[""] for r in range(3)]
    start = reports[2]["start"]  # after the step whose settled round the join dropped
    left, dropped = reports[0]["skipped"]  # a step's figures are the round before's
    assert reports[1]["skipped"] == [left, dropped] and left in (2, 3), reports
    assert dropped == start - 1 and 5 <= dropped < len(lrs) - 1, reports
    assert reports[2]["skipped"] == [], reports
    everyone, survivors = list(range(WORKERS)), [0, 1]
    members = [everyone] * (left - 1) + [None] + [survivors] * (dropped - left - 1) + \
        [None] + [everyone] * (len(lrs) - dropped)
    expected = simulate_stale(members, lrs, joined=(2, dropped))
    admitted, history = np.load(tmp_path / "admitted2.npz"), np.load(tmp_path / "history0.npz")
    for rank in everyone:
        final = np.load(tmp_path / f"params{rank}.npz")
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")
            if rank == 2:
                np.testing.assert_array_equal(admitted[n], history[f"{n}@{start}"])
