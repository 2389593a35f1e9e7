"""A server's sums when worker nodes leave (:meth:`Aggregator.set_members`): the step in
flight is dropped and answered with the new membership once every present member pushed
it, later steps sum the members present in node order, a departed node's pushes are
refused, and a push of an older generation drops its step wherever it arrives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bps.compressors import build
from bps.server.aggregator import Aggregator, RequestError
from tests.harness.reference_compressors import ref_codec

KEY = 3
NUMEL = 5


def raw(values) -> list[bytearray]:
    return [bytearray(np.asarray(values, np.float32).tobytes())]


def grads(node: int, step: int) -> np.ndarray:
    return np.random.default_rng(100 * step + node).standard_normal(NUMEL).astype(np.float32)


def sums(workers: int = 4, params: dict | None = None) -> Aggregator:
    agg = Aggregator(workers)
    agg.register(KEY, NUMEL, torch.float32, params, "w", node=0)
    return agg


def push(agg: Aggregator, node: int, step: int, generation: int = 0, values=None):
    values = grads(node, step) if values is None else values
    return agg.push(KEY, node, step, raw(values), 0.1, waiter=f"w{node}",
                    generation=generation)


def test_the_step_in_flight_is_dropped_and_answered_once_every_member_pushed():
    agg = sums()
    push(agg, 0, 0)
    push(agg, 3, 0)  # held: nodes 1 and 2 come first
    assert agg.set_members(1, [0, 1, 3]).finished == []  # node 2 left: node 1 is missing
    done, = push(agg, 1, 0).finished
    assert done.step == 0 and sorted(done.waiters) == ["w0", "w1", "w3"]
    assert done.payload.numel() == 0
    assert done.skip == {"skip": "membership", "skip_node": -1, "skip_what": "",
                         "generation": 1, "members": [0, 1, 3]}
    # the next step sums the members present, in node order, each push as it came
    for node in (3, 1):
        assert push(agg, node, 1, generation=1).finished == []
    done, = push(agg, 0, 1, generation=1).finished
    expected = (grads(0, 1) + grads(1, 1)).astype(np.float32) + grads(3, 1)
    np.testing.assert_array_equal(done.payload.numpy(), expected.astype(np.float32))
    assert done.skip == {}


def test_a_step_waiting_only_for_the_departed_node_is_answered_at_the_change():
    agg = sums(workers=3)
    push(agg, 0, 0)
    push(agg, 1, 0)
    done, = agg.set_members(1, [0, 1]).finished
    assert done.skip["skip"] == "membership" and sorted(done.waiters) == ["w0", "w1"]


def test_a_departed_nodes_push_is_refused_naming_the_generation():
    agg = sums(workers=3)
    agg.set_members(1, [0, 2])
    with pytest.raises(RequestError, match=r"worker 1 left the job at membership "
                                           r"generation 1 \(now 1, members \[0, 2\]\)"):
        push(agg, 1, 0, generation=0)
    assert KEY in agg.keys and not agg.keys[KEY].steps  # nothing held for it


def test_a_push_of_an_older_generation_drops_its_step_where_it_arrives_later():
    """A server that learns of the change before any push of the step: the pushes,
    divided for the old membership, drop it."""
    agg = sums(workers=3)
    agg.set_members(1, [0, 1])
    push(agg, 1, 4, generation=0)
    done, = push(agg, 0, 4, generation=0).finished
    assert done.skip["skip"] == "membership" and done.skip["generation"] == 1


def test_pushes_of_the_new_generation_that_arrived_first_are_kept():
    """Workers that learned of the change from another server push the new generation
    before this server hears of it: the step waits for the departed node until the
    change, then completes from those pushes."""
    agg = sums(workers=3)
    push(agg, 0, 5, generation=1)
    push(agg, 1, 5, generation=1)
    done, = agg.set_members(1, [0, 1]).finished
    assert done.skip == {}
    np.testing.assert_array_equal(done.payload.numpy(),
                                  (grads(0, 5) + grads(1, 5)).astype(np.float32))


def test_a_dropped_step_leaves_the_server_chain_as_it_was():
    """topk with error feedback: the dropped step compresses nothing, so the next
    step's answer is the reference chain's over the present members' sum."""
    params = {"compressor": "topk", "k": 2, "ef": "vanilla"}
    agg = sums(workers=3, params=params)
    worker = build(params, NUMEL, torch.float32, role="worker")
    payload = lambda node, step: [bytearray(  # noqa: E731
        worker.compress(torch.from_numpy(grads(node, step))).numpy().tobytes())]
    agg.push(KEY, 0, 0, payload(0, 0), 0.1, "w0")
    agg.set_members(1, [0, 1])
    done, = agg.push(KEY, 1, 0, payload(1, 0), 0.1, "w1").finished
    assert done.skip["skip"] == "membership"
    first = {n: payload(n, 1) for n in (0, 1)}
    agg.push(KEY, 0, 1, first[0], 0.1, "w0", generation=1)
    done, = agg.push(KEY, 1, 1, first[1], 0.1, "w1", generation=1).finished
    encode, decode = ref_codec(params, NUMEL, "float32")
    total = sum(decode(bytes(first[n][0])).astype(np.float32) for n in (0, 1))
    expected = decode(encode(total.astype(np.float32)))  # a fresh server chain, one step
    np.testing.assert_array_equal(decode(done.payload.numpy().tobytes()), expected)


def test_an_older_or_repeated_generation_changes_nothing():
    agg = sums(workers=3)
    agg.set_members(2, [0, 1])
    assert agg.set_members(1, [0]).finished == [] and agg.members == (0, 1)
    assert agg.set_members(2, [0]).finished == [] and agg.members == (0, 1)
