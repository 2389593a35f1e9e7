"""A worker node that dies and is started again joins the job again
(``bpslaunch local --min-workers 2 --max-restarts 1``): node 2 of 3 kills itself at the
start of step 2, the launcher starts it again with the same worker id, and it joins at
a step boundary with the state of node 0. Every node ends bit-identical, the joiner
starts from node 0's parameters at that step, and all match the numpy replay of the
membership: step 2 dropped, two nodes until the join, the step the join dropped, then
three nodes again, node 2's error feedback and momentum starting at zero. The same
with two local ranks a node: bpslaunch restarts both, and both get the state."""

from __future__ import annotations

import pytest

from tests.harness.trainer_job import SIM_CASES, check_rejoin, launch

COMMON = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}
PARAMS = {**SIM_CASES["topk"], **COMMON}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25, 0.5, 0.25]  # powers of two: lr * g is exact
WORKERS = 3
VICTIM, KILLED_AT = 2, 2  # node 2 kills itself at the start of step 2
WAIT_AT = 4  # the others wait at the start of step 4 until the scheduler announced the join


# in process: the same restart, join and check_rejoin with two local ranks a node (below)
# and tests/launch/test_netem_elastic.py's restarted host (one rank a node)
@pytest.mark.parametrize("agent", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_killed_worker_node_restarts_joins_and_matches_the_replay(tmp_path, agent):
    """One rank a node, in process or under the node agent (``BPS_NODE_AGENT=1``: the
    joiner's agent joins, fetches the state and pushes with the new membership)."""
    cfg = {"runs": [{"params": PARAMS}], "lrs": LRS, "stop": len(LRS),
           "kill": [VICTIM, KILLED_AT], "wait_at": WAIT_AT}
    result = launch(cfg, tmp_path, workers=WORKERS, servers=2, timeout=240,
                    env={"BPS_NODE_AGENT": "1"} if agent else None,
                    options=("--min-workers", "2", "--max-restarts", "1"))
    assert result.returncode == 0, result.stdout[-6000:]
    check_rejoin(tmp_path, PARAMS, WORKERS, LRS, VICTIM, KILLED_AT, WAIT_AT, result.stdout)


def test_a_node_of_two_local_ranks_restarts_joins_and_matches_the_replay(tmp_path):
    """Two local ranks a node: node 2's local rank 0 (rank 4) kills itself at the start
    of step 2, bpslaunch stops rank 5 and starts both again, and the state reaches both
    (over the node's setup channel): all 6 ranks end bit-identical and equal the replay,
    each node's share the float32 sum of its two ranks'."""
    cfg = {"runs": [{"params": PARAMS}], "lrs": LRS, "stop": len(LRS),
           "kill": [VICTIM * 2, KILLED_AT], "wait_at": WAIT_AT}
    result = launch(cfg, tmp_path, workers=WORKERS, servers=2, local_size=2, timeout=240,
                    options=("--min-workers", "2", "--max-restarts", "1"))
    assert result.returncode == 0, result.stdout[-6000:]
    check_rejoin(tmp_path, PARAMS, WORKERS, LRS, VICTIM, KILLED_AT, WAIT_AT, result.stdout,
                 local_size=2)
