"""Which joining nodes refuse to join (:func:`bps.core.rejoin.join_refusal`): a node
that is no joiner never, a joiner with a mode that cannot take it, or under the node
agent, with a message naming the node and why."""

from __future__ import annotations

from types import SimpleNamespace

from bps.core.rejoin import join_refusal


def runtime(joining: bool, node_agent: bool = False) -> SimpleNamespace:
    """The runtime's fields join_refusal reads."""
    return SimpleNamespace(joining=joining, node_id=2, env=SimpleNamespace(node_agent=node_agent))


def test_only_a_joiner_with_a_mode_that_cannot_take_it_refuses() -> None:
    streaming = "streaming averaging (fragments, overlap)"
    assert join_refusal(runtime(False), streaming) is None
    assert join_refusal(runtime(True), None) is None
    assert join_refusal(runtime(True), streaming) == (
        "worker node 2 started after the job began, but a node can join a running job only "
        f"with synchronous steps, staleness=1, local SGD or compressed Adam, not with "
        f"{streaming}")
    assert join_refusal(runtime(True, node_agent=True), None) == (
        "worker node 2 started after the job began, but a node cannot join a running job "
        "with BPS_NODE_AGENT=1")
