"""A replacement server's ``Aggregator.restore``: the last answer of a key that a worker
got from the dead server. Where another worker missed that answer and pushes the step
again, it gets the same bytes, whether its push comes before or after the answer
arrives; an older answer changes nothing; a step nobody got is dropped (membership) and
the next one is summed as usual (numpy sums as the reference)."""

from __future__ import annotations

import numpy as np
import torch

from bps.server.aggregator import Aggregator

ANSWER = np.array([1.5, -2.0, 3.25], np.float32)  # the dead server's answer of step 4


def replacement() -> Aggregator:
    """A fresh aggregator of two workers, at membership generation 1, key 7 declared."""
    sums = Aggregator(workers=2)
    sums.set_members(1, [0, 1])
    sums.register(7, numel=3, dtype=torch.float32, params=None, name="w", node=0)
    return sums


def raw(values) -> list:
    return [bytearray(np.asarray(values, np.float32).tobytes())]


def test_a_push_of_the_missed_step_before_the_answer_gets_it() -> None:
    sums = replacement()
    pushed = sums.push(7, node=1, step=4, payload=raw([9, 9, 9]), lr=0.1, waiter="w1",
                       generation=0)
    assert pushed.finished == []  # dropped (an older generation), waiting
    done, = sums.restore(7, 4, raw(ANSWER), None)
    assert done.waiters == ["w1"] and not done.skip
    np.testing.assert_array_equal(done.payload.numpy().view(np.float32), ANSWER)


def test_a_push_of_the_missed_step_after_the_answer_gets_it() -> None:
    sums = replacement()
    assert sums.restore(7, 4, raw(ANSWER), None) == []
    done, = sums.push(7, node=1, step=4, payload=raw([9, 9, 9]), lr=0.1, waiter="w1",
                      generation=0).finished
    np.testing.assert_array_equal(done.payload.numpy().view(np.float32), ANSWER)
    # the next step is summed as usual, in node order
    a, b = np.float32([1, 2, 3]), np.float32([0.5, 0.25, 4])
    assert sums.push(7, node=1, step=5, payload=raw(b), lr=0.1, waiter="w1",
                     generation=1).finished == []
    done, = sums.push(7, node=0, step=5, payload=raw(a), lr=0.1, waiter="w0",
                      generation=1).finished
    np.testing.assert_array_equal(done.payload.numpy(), a + b)


def test_an_older_answer_changes_nothing_and_a_skip_is_kept() -> None:
    sums = replacement()
    skip = {"skip": "nonfinite", "skip_node": 1, "skip_what": "w"}
    assert sums.restore(7, 4, [], skip) == []
    assert sums.restore(7, 3, raw(ANSWER), None) == []  # another worker's older answer
    done, = sums.push(7, node=0, step=4, payload=raw([1, 1, 1]), lr=0.1, waiter="w0",
                      generation=0).finished
    assert done.skip == skip and done.payload.numel() == 0


def test_a_step_nobody_got_is_dropped_for_everyone() -> None:
    """Both workers' last answers are of step 3: their pushes of step 4 (the generation
    before the change) get a membership skip."""
    sums = replacement()
    sums.restore(7, 3, raw(ANSWER), None)
    sums.restore(7, 3, raw(ANSWER), None)
    assert sums.push(7, node=0, step=4, payload=raw([1, 1, 1]), lr=0.1, waiter="w0",
                     generation=0).finished == []
    done, = sums.push(7, node=1, step=4, payload=raw([2, 2, 2]), lr=0.1, waiter="w1",
                      generation=0).finished
    assert done.skip["skip"] == "membership" and done.skip["generation"] == 1
    assert sorted(done.waiters) == ["w0", "w1"]
