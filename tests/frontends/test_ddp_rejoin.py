"""A worker node joins a running job through the DDP hook (``bpslaunch local
--min-workers 2 --max-restarts 1``): DDP runs over a group of each node's own processes
(``bps.ddp.init_process_group``), so a restarted node can build its DDP; its
``HookState(module=...)`` joins and loads the model, the optimizer's state and the
counters of node 0. Node 2 of 3 kills itself at the start of step 2, bpslaunch starts
it again, it joins at a step boundary, and every node ends bit-identical to the numpy
replay of that membership (node 2's error feedback and momentum from zero), each node
starting from node 0's parameters (``HookState`` gives every node node 0's model: DDP's
own broadcast stays in the node). Where DDP's group spans the nodes a joiner refuses,
saying what to use instead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bps.ddp import group_refusal
from tests.harness.trainer_job import SIM_CASES, check_rejoin, launch

PARAMS = {**SIM_CASES["topk"], "ef": "vanilla", "momentum": "nesterov", "fp16": False,
          "min_compress_bytes": 1000}
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25, 0.5, 0.25]  # powers of two: lr * g is exact
WORKERS = 3
VICTIM, KILLED_AT = 2, 2  # node 2 kills itself at the start of step 2
WAIT_AT = 4  # the others wait at the start of step 4 until the scheduler announced the join


@pytest.mark.parametrize("local_size, agent", [
    (2, False),  # the node's group of two (a TCPStore at the node's local master), both load
    pytest.param(1, False, marks=pytest.mark.slow),  # a group of one: the same join, cheaper
    # under the node agent (its store served by local rank 0): the agent's side of a join
    # is the trainer's agent rejoin test's, the hook's side the case above
    pytest.param(2, True, marks=pytest.mark.slow),
])
def test_a_killed_worker_node_restarts_joins_through_the_ddp_hook_and_matches_the_replay(
        tmp_path, local_size, agent):
    """With two local ranks a node, node 2's local rank 0 (rank 4) kills itself;
    bpslaunch stops rank 5 and starts both again, and both load the state: all six
    ranks end bit-identical and equal the replay."""
    cfg = {"runs": [{"params": PARAMS}], "lrs": LRS, "stop": len(LRS), "frontend": "ddp",
           "kill": [VICTIM * local_size, KILLED_AT], "wait_at": WAIT_AT}
    result = launch(cfg, tmp_path, workers=WORKERS, servers=2, local_size=local_size,
                    timeout=240, env={"BPS_NODE_AGENT": "1"} if agent else None,
                    options=("--min-workers", "2", "--max-restarts", "1"))
    assert result.returncode == 0, result.stdout[-6000:]
    check_rejoin(tmp_path, PARAMS, WORKERS, LRS, VICTIM, KILLED_AT, WAIT_AT, result.stdout,
                 local_size=local_size)


def joiner(local_size: int, joining: bool = True) -> SimpleNamespace:
    """The runtime's fields group_refusal reads: worker node 2, ``local_size`` ranks."""
    return SimpleNamespace(joining=joining, node_id=2, local_size=local_size)


def test_a_joiner_refuses_where_ddp_s_group_spans_the_nodes() -> None:
    assert group_refusal(joiner(2), 2) is None  # the node's own group: it joins
    assert group_refusal(joiner(2, joining=False), 6) is None  # no joiner
    advice = ("a node joins a running job through the DDP hook only where DDP's group is "
              "its own node's processes: call bps.ddp.init_process_group() instead of "
              "dist.init_process_group() on every node, before HookState (docs/ddp.md, "
              "'Elastic jobs')")
    assert group_refusal(joiner(2), 6) == (
        "worker node 2 started after the job began, but DDP's process group spans 6 "
        f"processes, not this node's 2: {advice}")
    assert group_refusal(joiner(1), None) == (
        "worker node 2 started after the job began, but torch.distributed is not "
        f"initialised: {advice}")
