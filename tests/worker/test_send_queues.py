"""Send credit per server and the order waiting pushes go out in."""

from __future__ import annotations

from bps.worker.send_queues import SendQueues, send_order


def test_waiting_pushes_go_out_by_step_then_priority_within_credit() -> None:
    queues = SendQueues(num_servers=2, credit=2)
    seq = iter(range(100))

    def put(server: int, step: int, priority: int, name: str) -> None:
        queues.put(server, send_order(step, priority, next(seq)), name)

    assert not queues.waiting
    put(0, 0, 0, "first")
    put(0, 0, -5, "low")
    put(0, 0, 7, "high")
    put(0, 1, 100, "next-step")
    put(0, 0, 7, "high-later")
    put(1, 0, 0, "other-server")
    assert queues.take() == ["high", "high-later", "other-server"]
    assert queues.take() == []  # server 0 has no credit left
    assert queues.waiting
    queues.release(0)
    assert queues.take() == ["first"]
    queues.release(0)
    queues.release(0)
    assert queues.take() == ["low", "next-step"]
    assert not queues.waiting
    assert queues.clear() == []
