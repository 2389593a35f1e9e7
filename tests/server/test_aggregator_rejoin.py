"""A server's sums when a worker node joins (again) (:meth:`Aggregator.set_members` with
a new member): a step dropped by the change waits for the old members only (the joiner
starts with the step after), a push of an older generation that arrives later drops its
step the same way, and the next steps sum every member, the joiner included, in node
order; a node that left and joined again is no longer refused."""

from __future__ import annotations

import numpy as np
import torch

from bps.server.aggregator import Aggregator

KEY = 3
NUMEL = 5


def grads(node: int, step: int) -> np.ndarray:
    return np.random.default_rng(100 * step + node).standard_normal(NUMEL).astype(np.float32)


def push(agg: Aggregator, node: int, step: int, generation: int):
    return agg.push(KEY, node, step, [bytearray(grads(node, step).tobytes())], 0.1,
                    waiter=f"w{node}", generation=generation)


def joined_again() -> Aggregator:
    """Three workers; node 2 left at generation 1 and joins again at generation 2."""
    agg = Aggregator(3)
    agg.register(KEY, NUMEL, torch.float32, None, "w", node=0)
    agg.set_members(1, [0, 1])
    return agg


def test_the_dropped_step_waits_for_the_old_members_only_then_all_three_sum() -> None:
    agg = joined_again()
    assert push(agg, 0, 4, generation=1).finished == []
    assert agg.set_members(2, [0, 1, 2]).finished == []  # step 4 dropped
    done, = push(agg, 1, 4, generation=1).finished  # node 2 is not waited for
    assert (done.step, done.skip["skip"], done.skip["generation"], done.skip["members"],
            done.waiters) == (4, "membership", 2, [0, 1, 2], ["w0", "w1"])
    assert push(agg, 2, 5, generation=2).finished == []  # the joiner's first step
    assert push(agg, 0, 5, generation=2).finished == []
    done, = push(agg, 1, 5, generation=2).finished
    expected = (grads(0, 5) + grads(1, 5)).astype(np.float32) + grads(2, 5)
    np.testing.assert_array_equal(done.payload.numpy(), expected)
    assert done.skip == {} and sorted(done.waiters) == ["w0", "w1", "w2"]


def test_an_older_push_after_the_change_drops_its_step_without_the_joiner() -> None:
    agg = joined_again()
    agg.set_members(2, [0, 1, 2])
    assert push(agg, 1, 7, generation=1).finished == []  # the old generation: dropped
    done, = push(agg, 0, 7, generation=1).finished
    assert (done.skip["skip"], sorted(done.waiters)) == ("membership", ["w0", "w1"])
