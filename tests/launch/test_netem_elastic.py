"""A worker host's cable pulled for 10 s on ``bpslaunch netem --min-workers``: the node is
dropped (its heartbeat timeout is shorter than the cut) or waited for (longer), and either
way the job ends, exactly: never a hang, never two memberships at once. The survivors are
bit-identical to the numpy replay of what happened; a dropped node applies nothing after
it was dropped."""

from __future__ import annotations

import numpy as np
import pytest

from bps.launch.netns import support_problem
from tests.harness.netem_runs import netem_runs
from tests.harness.trainer_job import SHAPES, SIM_CASES, check_rejoin, launch, plain, replay

PARAMS = {**SIM_CASES["topk"], "ef": "vanilla", "momentum": "nesterov", "fp16": False,
          "min_compress_bytes": 1000}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25]  # powers of two: lr * g is exact everywhere
WORKERS = 3
CUT = 2  # the worker node whose cable is pulled
AT = 2  # at the start of this step, before it pushes any of it
SECONDS = 10

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module", autouse=True)
def netns_allowed():
    with netem_runs():  # the probe removes a dead run's namespaces, as a run does
        problem = support_problem()
    if problem:
        pytest.skip(f"network namespaces not usable here: {problem}")


@pytest.fixture(autouse=True)
def netem_run(netns_allowed):
    """The test's run starts with removing a dead run's namespaces: not while
    another test process leaves some for its own run (tests/harness/netem_runs.py)."""
    with netem_runs():
        yield


def run(tmp_path, heartbeat_timeout: float):
    cfg = {"runs": [{"params": PARAMS}], "lrs": LRS, "stop": len(LRS),
           "leave": [CUT, AT, "cut", "start", SECONDS]}
    env = {"BPS_HEARTBEAT_TIMEOUT": str(heartbeat_timeout),
           "BPS_TIMEOUT": str(max(20, 2 * heartbeat_timeout))}
    return launch(cfg, tmp_path, workers=WORKERS, servers=2, env=env, timeout=150,
                  options=("--min-workers", "2"), netem=True)


def final_params(tmp_path, rank: int) -> dict:
    return dict(np.load(tmp_path / f"params{rank}.npz"))


# tests/frontends/test_trainer_elastic.py's stopped worker node: the same heartbeat rule drops
# a silent node, the survivors match the same replay, the node is refused when it comes back
@pytest.mark.slow
def test_a_cut_longer_than_the_heartbeat_timeout_drops_the_node(tmp_path):
    """Silent for 3 s: the scheduler drops node 2 (one membership change, generation 1),
    step 2 is dropped everywhere and the two others finish over themselves; node 2 fails
    alone, having applied no step after it was dropped."""
    result = run(tmp_path, heartbeat_timeout=3)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert f"worker {CUT} at 10.77.0." in out and "died: no heartbeat" in out, out[-4000:]
    assert "membership generation 1" in out and "membership generation 2" not in out, out
    assert not (tmp_path / f"params{CUT}.npz").exists()
    survivors = [r for r in range(WORKERS) if r != CUT]
    members = [list(range(WORKERS))] * AT + [None] + [survivors] * (len(LRS) - AT - 1)
    expected = replay(PARAMS, WORKERS, LRS, plain(SHAPES), members=members)
    for rank in survivors:
        final = final_params(tmp_path, rank)
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")


def test_a_cut_shorter_than_the_heartbeat_timeout_is_waited_for(tmp_path):
    """Silent for 10 s of a 30 s timeout: nobody is dropped; once the cable is back every
    node finishes, bit-identical to the replay without a failure."""
    result = run(tmp_path, heartbeat_timeout=30)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert "membership generation" not in out and "died" not in out, out[-4000:]
    expected = replay(PARAMS, WORKERS, LRS, plain(SHAPES))
    for rank in range(WORKERS):
        final = final_params(tmp_path, rank)
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")


def test_a_killed_worker_host_is_restarted_and_joins_again(tmp_path):
    """``--max-restarts 1``: node 2's process kills itself (SIGKILL) at the start of step
    2; bpslaunch netem starts it again on its host, it joins, and every node ends as the
    replay of that membership (as ``bpslaunch local``'s, tests/frontends/test_trainer_rejoin.py)."""
    lrs = LRS + [0.5, 0.25]
    cfg = {"runs": [{"params": PARAMS}], "lrs": lrs, "stop": len(lrs),
           "kill": [CUT, AT], "wait_at": 4}
    result = launch(cfg, tmp_path, workers=WORKERS, servers=2, timeout=240, netem=True,
                    options=("--min-workers", "2", "--max-restarts", "1"))
    assert result.returncode == 0, result.stdout[-6000:]
    check_rejoin(tmp_path, PARAMS, WORKERS, lrs, CUT, AT, 4, result.stdout)
