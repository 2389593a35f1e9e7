"""Send credit per server and the order waiting pushes go out in."""

from __future__ import annotations

from bps.worker.send_queues import SendQueues, send_order


def test_waiting_pushes_go_out_by_step_then_priority_within_credit() -> None:
    queues = SendQueues(num_servers=2, credit=2)
    seq = iter(range(100))
    item = {}

    def put(server: int, step: int, priority: int, name: str) -> None:
        order = send_order(step, priority, next(seq))
        item[order] = name
        queues.put(server, order)

    put(0, 0, 0, "first")
    put(0, 0, -5, "low")
    put(0, 0, 7, "high")
    put(0, 1, 100, "next-step")
    put(0, 0, 7, "high-later")
    put(1, 0, 0, "other-server")
    assert [item[o] for o in queues.take()] == ["high", "high-later", "other-server"]
    assert queues.take() == []  # server 0 has no credit left
    queues.release(0)
    assert [item[o] for o in queues.take()] == ["first"]
    queues.release(0)
    queues.release(0)
    assert [item[o] for o in queues.take()] == ["low", "next-step"]
    assert queues.clear() == []
