"""Elastic membership with the trainer (``bpslaunch local --min-workers``): a worker node
killed at a given step leaves the job, and the others finish it, bit-identical to each
other and to the numpy replay of the same membership change: the step in flight is
dropped everywhere, and the later steps average over the nodes present."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness.trainer_job import (
    SHAPES,
    SIM_CASES,
    launch,
    load_params,
    plain,
    replay,
)

COMMON = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}
PARAMS = {**SIM_CASES["topk"], **COMMON}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25]  # powers of two: lr * g is exact everywhere
WORKERS = 3
LEAVES = 2  # the worker node that dies
AT = 2  # at the start of this step, before it pushes any of it


def run(tmp_path, signal: str, min_workers: int, env: dict | None = None,
        where: str = "start", victim: int = LEAVES):
    cfg = {"runs": [{"params": PARAMS}], "lrs": LRS, "stop": len(LRS),
           "leave": [victim, AT, signal, where]}
    return launch(cfg, tmp_path, workers=WORKERS, servers=2, env=env, timeout=150,
                  options=("--min-workers", str(min_workers)))


def expected_after_leaving(dropped: int = AT, victim: int = LEAVES) -> dict:
    """Steps before ``dropped`` over every node; ``dropped`` dropped everywhere; the
    rest over the survivors."""
    survivors = [r for r in range(WORKERS) if r != victim]
    members = [list(range(WORKERS))] * dropped + [None] + \
        [survivors] * (len(LRS) - dropped - 1)
    return replay(PARAMS, WORKERS, LRS, plain(SHAPES), members=members)


def check_survivors(tmp_path, victim: int = LEAVES) -> None:
    expected = expected_after_leaving(victim=victim)
    for rank in range(WORKERS):
        if rank == victim:
            assert not (tmp_path / f"params{rank}.npz").exists()
            continue
        final = np.load(tmp_path / f"params{rank}.npz")
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")


# node 0: the lowest node left then rolls the servers back and restores in its place
@pytest.mark.parametrize("victim", [LEAVES, 0])
def test_a_killed_worker_node_leaves_and_the_others_match_the_replay(tmp_path, victim):
    """kill -9 at the start of step 2 with --min-workers 2: the job exits 0, its
    connection closing is the news; survivors bit-identical to the replay."""
    result = run(tmp_path, "SIGKILL", min_workers=2, victim=victim)
    assert result.returncode == 0, result.stdout[-4000:]
    check_survivors(tmp_path, victim)
    out = result.stdout
    assert f"worker {victim} at 127.0.0.1 died: its connection to the scheduler closed" \
        in out, out
    assert "membership generation 1" in out
    # the survivors were not told that anyone failed
    assert "PEER_DEAD" not in out and "ClusterError" not in out, out[-4000:]


def test_under_the_node_agent_a_killed_worker_node_leaves_too(tmp_path):
    """BPS_NODE_AGENT=1: the pipelines in the agents follow the membership change; the
    survivors match the same replay."""
    result = run(tmp_path, "SIGKILL", min_workers=2, env={"BPS_NODE_AGENT": "1"})
    assert result.returncode == 0, result.stdout[-4000:]
    check_survivors(tmp_path)
    assert "membership generation 1" in result.stdout


def test_a_worker_node_that_fails_leaves_at_once(tmp_path):
    """An exception at the start of step 2: its FAILED report is the news; the job
    exits 0 and the survivors match the replay."""
    result = run(tmp_path, "raise", min_workers=2)
    assert result.returncode == 0, result.stdout[-4000:]
    check_survivors(tmp_path)
    assert "worker 2 at 127.0.0.1 failed: RuntimeError: boom: worker nodes [0, 1] go on " \
        "(membership generation 1)" in result.stdout, result.stdout[-4000:]


def test_a_worker_node_killed_with_its_pushes_on_the_way_ends_one_of_two_ways(tmp_path):
    """kill -9 right after its backward at step 2: its pushes of step 2 may have reached
    some servers, all or none. Either step 2 is dropped everywhere (a key lacks its push:
    the whole step is skipped, the keys it completed rolled back), or every key has it
    and step 3 is dropped; the survivors are bit-identical to one of the two replays."""
    result = run(tmp_path, "SIGKILL", min_workers=2, where="backward")
    assert result.returncode == 0, result.stdout[-4000:]
    finals = load_params(tmp_path, WORKERS - 1)
    for n in SHAPES:
        np.testing.assert_array_equal(finals[0][n], finals[1][n], err_msg=n)
    outcomes = {dropped: expected_after_leaving(dropped) for dropped in (AT, AT + 1)}
    matches = [dropped for dropped, expected in outcomes.items()
               if all(np.array_equal(finals[0][n], expected[n]) for n in SHAPES)]
    assert len(matches) == 1, {n: (finals[0][n].ravel()[:3], {d: e[n].ravel()[:3] for d, e
                                                             in outcomes.items()})
                               for n in SHAPES}


def test_a_stopped_worker_node_leaves_and_is_refused_when_it_resumes(tmp_path):
    """SIGSTOP at step 2: the heartbeat timeout removes it; survivors as the replay; once
    resumed (a survivor sends SIGCONT after training), what it sends is refused naming
    the generation it left at, and it fails alone (a 6 s timeout: long enough that no
    starved survivor of a loaded host misses it first)."""
    result = run(tmp_path, "SIGSTOP", min_workers=2,
                 env={"BPS_HEARTBEAT_TIMEOUT": "6", "BPS_HEARTBEAT_INTERVAL": "0.5"})
    assert result.returncode == 0, result.stdout[-4000:]
    check_survivors(tmp_path)
    out = result.stdout
    assert "worker 2 at 127.0.0.1 died: no heartbeat" in out, out[-4000:]
    assert "left the job at membership generation 1" in out, out[-4000:]
    assert "still running after the job ended" not in out, out[-4000:]


def test_below_min_workers_the_job_fails_naming_the_dead_node(tmp_path):
    result = run(tmp_path, "SIGKILL", min_workers=3)
    assert result.returncode != 0
    assert "worker 2 at 127.0.0.1 died" in result.stdout, result.stdout[-4000:]
    assert "fewer than BPS_MIN_WORKERS=3" in result.stdout, result.stdout[-4000:]
