"""The scheduler's side of worker nodes joining a running elastic job, with real sockets
and the scheduler in a thread: a node restarted with the id of one that died is
welcomed as a joiner, becomes a member with JOIN (everyone else gets the next
generation and its token; its answer waits for every server's confirmation) and gets
the state the lowest old member sends, in chunks; the connection of a node that left
stays refused, and so does a HELLO for a node present or a holder of another key."""

from __future__ import annotations

from bps.common.auth import load_key, write_key_file
from bps.common.protocol import STATE_CHUNK, Op
from bps.common.scheduler_client import SchedulerClient
from tests.harness.scheduler_job import Job


def hello(j: Job, node: int, key=None) -> SchedulerClient:
    """A new process of worker ``node`` (a fresh connection and token) says HELLO."""
    env = j.scheduler.env
    client = SchedulerClient(j.ctx, env, "worker", key=key or load_key(env))
    j.workers.append(client)  # closed with the job
    client.send(Op.HELLO, role="worker", worker_id=node, addr="127.0.0.1",
                token=client.token, num_workers=3, num_servers=1, min_workers=2)
    return client


def test_a_restarted_node_joins_and_gets_the_state_of_the_lowest_member(membership_job) -> None:
    j = membership_job(2)
    w0, w1, w2 = j.workers
    w2.sock.close(linger=0)  # killed
    for client in (w0, w1, j.server):
        assert j.next(client)["generation"] == 1
    again = hello(j, 2)
    welcome = j.next(again)
    assert (welcome["op"], welcome["node_id"], welcome["joining"]) == (Op.WELCOME, 2, True)
    again.send(Op.FETCH, generation=2, offset=0)  # before JOIN: refused
    assert j.next(again)["msg"] == "FETCH before JOIN"
    again.send(Op.JOIN)
    for client in (w0, w1, j.server):  # everyone else: the next generation, its token
        msg = j.next(client)
        assert (msg["op"], msg["generation"], msg["members"]) == (Op.MEMBERSHIP, 2, [0, 1, 2])
        assert msg["joined"] == [[2, again.token]], msg
        assert "worker 2 at 127.0.0.1 joined" in msg["msg"], msg
    # its answer waits until the server confirmed the generation
    assert not again.sock.poll(300)
    j.server.send(Op.HEARTBEAT, generation=2)
    assert j.next(j.server)["op"] == Op.HEARTBEAT
    joined = j.next(again)
    assert (joined["op"], joined["generation"], joined["members"], joined["source"]) == \
        (Op.JOIN, 2, [0, 1, 2], 0)
    # asked for before it is sent: answered once all of it arrived
    again.send(Op.FETCH, generation=2, offset=0)
    blob = bytes(range(256)) * (STATE_CHUNK // 256) + b"tail"
    for offset in (0, STATE_CHUNK):
        assert not again.sock.poll(0)
        w0.send(Op.STATE, generation=2, offset=offset, total=len(blob),
                data=blob[offset:offset + STATE_CHUNK])
        ack = j.next(w0)
        assert (ack["op"], ack["offset"], ack["data"]) == (Op.STATE, offset, b"")
    parts = [j.next(again)]
    again.send(Op.FETCH, generation=2, offset=STATE_CHUNK)
    parts.append(j.next(again))
    assert [(p["op"], p["generation"], p["offset"], p["total"]) for p in parts] == \
        [(Op.STATE, 2, 0, len(blob)), (Op.STATE, 2, STATE_CHUNK, len(blob))]
    assert parts[0]["data"] + parts[1]["data"] == blob
    # a member now: barriers count it, FINALIZE of all three ends the job
    for client in (w0, w1, again):
        client.send(Op.FINALIZE, step=9)
        assert j.next(client)["op"] == Op.BYE
    assert j.next(j.server)["op"] == Op.SHUTDOWN
    j.thread.join(timeout=10)
    assert j.codes == [0]


def test_a_node_that_left_stays_refused_and_a_present_id_cannot_join(membership_job) -> None:
    """The connection of a node that left (a stopped process that resumes) is refused,
    its HELLO too, naming the generation; a HELLO for a node present is refused; a
    joiner that goes away before JOIN changes nothing."""
    j = membership_job(2)
    w0, w1, w2 = j.workers
    w2.send(Op.FAILED, msg="stopped")
    assert j.next(w2)["op"] == Op.BYE
    for client in (w0, w1, j.server):
        assert j.next(client)["generation"] == 1
    w2.send(Op.HELLO, role="worker", worker_id=2, addr="127.0.0.1", token=w2.token)
    refusal = j.next(w2)
    assert refusal["op"] == Op.ERROR
    assert refusal["msg"] == ("HELLO as worker 2 to join: worker 2 at 127.0.0.1 left the job "
                              "at membership generation 1; a restarted process may join "
                              "again"), refusal
    twin = hello(j, 1)
    assert j.next(twin)["msg"] == ("HELLO as worker 1 to join: worker node 1 is present (or "
                                   "joining) already")
    late = hello(j, 2)
    assert j.next(late)["joining"] is True
    late.sock.close(linger=0)  # gone before JOIN: nobody hears of it
    for _ in range(100):  # the id is free again once the scheduler saw it go
        answer = j.next(hello(j, 2))
        if answer["op"] == Op.WELCOME:
            break
        assert "is present (or joining) already" in answer["msg"], answer
    assert answer["op"] == Op.WELCOME
    assert not any(c.sock.poll(200) for c in (w0, w1, j.server))


def test_a_holder_of_another_key_gets_nothing(membership_job, tmp_path) -> None:
    j = membership_job(2)
    j.workers[2].sock.close(linger=0)
    for client in (j.workers[0], j.workers[1], j.server):
        assert j.next(client)["generation"] == 1
    stranger = hello(j, 2, key=write_key_file(str(tmp_path / "other.key")))
    assert not stranger.sock.poll(1000)
    assert j.next(hello(j, 2))["joining"] is True  # the id was not taken
