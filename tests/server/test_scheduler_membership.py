"""The scheduler's side of elastic membership (``BPS_MIN_WORKERS``), with real sockets
and the scheduler in a thread: a worker whose connection closes, or that reports FAILED,
leaves; everyone left gets MEMBERSHIP with the next generation and the workers present;
a message from a node that left is refused naming the generation; barriers and
FINALIZE count only the workers present; below the minimum the job fails as before."""

from __future__ import annotations

from bps.common.protocol import Op


def test_closed_connection_and_failure_each_make_a_new_generation(membership_job) -> None:
    j = membership_job(1)
    w0, w1, w2 = j.workers
    w0.send(Op.BARRIER, seq=0, step=5)  # waits for w1 and w2
    w2.sock.close(linger=0)  # a process killed: its connection closes
    for client in (w0, w1, j.server):
        msg = j.next(client)
        assert (msg["op"], msg["generation"], msg["members"]) == (Op.MEMBERSHIP, 1, [0, 1])
        assert "worker 2 at 127.0.0.1 died: its connection to the scheduler closed" \
            in msg["msg"], msg
    w1.send(Op.FAILED, msg="RuntimeError: boom")
    assert j.next(w1)["op"] == Op.BYE
    for client in (w0, j.server):
        msg = j.next(client)
        assert (msg["op"], msg["generation"], msg["members"]) == (Op.MEMBERSHIP, 2, [0])
        assert "worker 1 at 127.0.0.1 failed: RuntimeError: boom" in msg["msg"], msg
    # the barrier w0 waits in now counts w0 alone
    assert (j.next(w0)["op"]) == Op.RELEASE
    w1.send(Op.HEARTBEAT, step=6)  # a node that left is refused, naming the generation
    refusal = j.next(w1)
    assert refusal["op"] == Op.ERROR
    assert refusal["msg"] == ("HEARTBEAT refused: worker 1 at 127.0.0.1 left the job at "
                              "membership generation 2"), refusal
    w0.send(Op.FINALIZE, step=9)  # the last worker present: the job is complete
    assert j.next(w0)["op"] == Op.BYE and j.next(j.server)["op"] == Op.SHUTDOWN
    j.thread.join(timeout=10)
    assert j.codes == [0]


def test_below_min_workers_everyone_is_told_who_died(membership_job) -> None:
    j = membership_job(3)
    j.workers[1].sock.close(linger=0)
    for client in (j.workers[0], j.workers[2], j.server):
        msg = j.next(client)
        assert msg["op"] == Op.PEER_DEAD, msg
        assert msg["msg"] == ("worker 1 at 127.0.0.1 died: its connection to the scheduler "
                              "closed; 2 worker node(s) left, fewer than BPS_MIN_WORKERS=3")
    j.thread.join(timeout=10)
    assert j.codes == [1]
