"""Which joining nodes refuse to join (:func:`bps.core.rejoin.join_refusal`): a node
that is no joiner never, a joiner under the node agent, with a message naming the node
and why."""

from __future__ import annotations

from types import SimpleNamespace

from bps.core.rejoin import join_refusal


def runtime(joining: bool, node_agent: bool = False) -> SimpleNamespace:
    """The runtime's fields join_refusal reads."""
    return SimpleNamespace(joining=joining, node_id=2, env=SimpleNamespace(node_agent=node_agent))


def test_only_a_joiner_under_the_node_agent_refuses() -> None:
    assert join_refusal(runtime(False)) is None
    assert join_refusal(runtime(False, node_agent=True)) is None
    assert join_refusal(runtime(True)) is None
    assert join_refusal(runtime(True, node_agent=True)) == (
        "worker node 2 started after the job began, but a node cannot join a running job "
        "with BPS_NODE_AGENT=1")
