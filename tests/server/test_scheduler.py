"""The scheduler: stalls and silent peers told apart, last messages delivered, the
welcome's endpoints, a port in use."""

from __future__ import annotations

import pytest

from bps.common.env import ClusterEnv
from bps.common.protocol import (
    ClusterError,
    Op,
    decode,
)
from bps.common.striping import (
    server_endpoints,
)
from tests.harness.env_vars import BASE


def test_own_stall_is_not_taken_for_a_silent_peer() -> None:
    """After the scheduler's loop (or a node's I/O thread) did not run for a while, the
    heartbeats it missed do not make a peer dead; silence while it runs still does."""
    import time

    import zmq

    from bps.common.protocol import ClusterError
    from bps.common.scheduler_client import STALL_INTERVALS, SchedulerClient
    from bps.server.scheduler import Scheduler, _Node

    env = ClusterEnv.from_environ({**BASE, "DMLC_PS_ROOT_URI": "127.0.0.1"})
    silence = env.heartbeat_timeout + 20
    assert silence > STALL_INTERVALS * env.heartbeat_interval
    now = time.monotonic()
    scheduler = Scheduler(env)
    node = scheduler.nodes[b"w"] = _Node(b"w", "worker", 0, "", last_seen=now - silence)
    scheduler.loop_clock.last = now - silence  # the scheduler itself was paused
    assert scheduler._silent_node(now) is None and node.last_seen == pytest.approx(now)
    node.last_seen = now - silence  # the scheduler ran, the node did not report
    assert scheduler._silent_node(now + 0.5) is node
    # silent for 1 s before a pause of the scheduler: that second still counts after it
    # (a loop that stalls every few seconds must still see a dead peer)
    node.last_seen = now + 0.5 - 1.0
    scheduler.loop_clock.last = now + 0.5
    after = now + 0.5 + silence
    dead_at = after + env.heartbeat_timeout - 1.0
    for turn in range(int((dead_at - after) / 0.5)):  # the loop runs every 0.5 s again
        assert scheduler._silent_node(after + 0.5 * turn) is None
    assert scheduler._silent_node(dead_at + 0.1) is node
    node.finalized = True
    assert scheduler._silent_node(now + 1.0) is None

    client = SchedulerClient(zmq.Context.instance(), env, role="worker")
    try:
        client.tick()  # the scheduler never answered: its silence counts only from then
        client.heard = True
        client.last_seen = client.tick_clock.last = time.monotonic() - silence  # paused
        client.tick()
        client.last_seen = time.monotonic() - silence  # ticking, but the scheduler is silent
        with pytest.raises(ClusterError, match=r"tcp://127\.0\.0\.1:9000 unreachable"):
            client.tick()
    finally:
        client.close(linger=0)


def test_a_worker_that_stopped_stepping_is_named_whenever_its_step_was_reported() -> None:
    """The scheduler's stall rule: a worker behind the leader's step, pushing nothing for
    BPS_HEARTBEAT_TIMEOUT while the leader waits as long, is named, also where its last
    step's heartbeat arrived after the leader's (each node heartbeats in its own phase);
    one that pushed within the timeout is not, and neither is anyone before the leader
    has waited the timeout."""
    import time

    import zmq

    from bps.server.scheduler import Scheduler, _Node

    env = ClusterEnv.from_environ({**BASE, "DMLC_PS_ROOT_URI": "127.0.0.1"})
    timeout, start = env.heartbeat_timeout, time.monotonic()
    scheduler = Scheduler(env)
    scheduler.sock = zmq.Context.instance().socket(zmq.ROUTER)  # PEER_DEAD to nobody
    try:
        nodes = [_Node(f"w{rank}".encode(), "worker", rank, "127.0.0.1", last_seen=start)
                 for rank in range(3)]
        scheduler.nodes = {node.identity: node for node in nodes}
        steps = [(3, start), (2, start + 0.1), (2, start + 0.2)]  # 1 and 2 heard after 0
        for node, (step, since) in zip(nodes, steps, strict=True):
            node.step, node.step_since = step, since
        scheduler._check_stalls(start + timeout - 0.1)  # the leader has not waited enough
        assert scheduler.verdict is None
        nodes[2].step_since = start + timeout  # worker 2 pushed again since: not it
        scheduler._check_stalls(start + timeout + 0.5)
        assert scheduler.verdict is not None
        assert scheduler.verdict.startswith("worker 1 at 127.0.0.1 stopped stepping: its "
                                            "last push was of step 2"), scheduler.verdict
        assert "while worker 0 at 127.0.0.1 has waited" in scheduler.verdict
    finally:
        scheduler.sock.close(linger=0)


def one_worker_scheduler_env(cluster_key: str) -> ClusterEnv:
    """A scheduler's environment for one worker and one server, on a free loopback port."""
    from bps.launch.role import free_port

    return ClusterEnv.from_environ({**BASE, "DMLC_ROLE": "scheduler", "DMLC_NUM_WORKER": "1",
                                    "DMLC_NUM_SERVER": "1", "DMLC_WORKER_ID": "0",
                                    "DMLC_PS_ROOT_URI": "127.0.0.1",
                                    "DMLC_PS_ROOT_PORT": str(free_port()),
                                    "BPS_SECRET_FILE": cluster_key})


def test_scheduler_sends_its_last_messages_before_it_returns(cluster_key: str) -> None:
    """When every worker has said FINALIZE, the scheduler answers BYE, sends the servers
    SHUTDOWN and returns 0. By then it has terminated its own ZeroMQ context, which only
    returns once those last messages are sent: pyzmq drops what is still queued at
    interpreter exit, and a server that missed SHUTDOWN would fail the job 10 s later."""
    import threading

    import zmq

    from bps.common.auth import load_key
    from bps.common.scheduler_client import SchedulerClient
    from bps.server.scheduler import Scheduler

    env = one_worker_scheduler_env(cluster_key)
    scheduler = Scheduler(env)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(scheduler.run()), daemon=True)
    thread.start()
    ctx = zmq.Context()
    worker = SchedulerClient(ctx, env, "worker", key=load_key(env))
    server = SchedulerClient(ctx, env, "server", "tcp://127.0.0.1:1", key=load_key(env))

    def next_op(client: SchedulerClient) -> Op:
        assert client.sock.poll(10_000), f"{client.role}: nothing from the scheduler in 10 s"
        return client.receive()["op"]

    try:
        worker.send(Op.HELLO, role="worker", worker_id=0, addr="", token=worker.token)
        server.send(Op.HELLO, role="server", worker_id=-1, addr=server.addr, token=b"")
        assert (next_op(worker), next_op(server)) == (Op.WELCOME, Op.WELCOME)
        worker.send(Op.FINALIZE, step=-1)
        assert (next_op(worker), next_op(server)) == (Op.BYE, Op.SHUTDOWN)
        thread.join(timeout=10)
        assert not thread.is_alive() and codes == [0]
        assert scheduler.sock.closed and scheduler.sock.context.closed
    finally:
        worker.close(linger=0)
        server.close(linger=0)
        ctx.term()


def test_the_welcome_carries_each_servers_endpoints(cluster_key: str) -> None:
    """A server's HELLO lists its endpoints (one per I/O thread); the WELCOME hands them
    to the workers in server order. Malformed lists are refused, naming the field."""
    import threading

    import zmq

    from bps.common.auth import load_key
    from bps.common.scheduler_client import SchedulerClient
    from bps.server.scheduler import Scheduler

    env = one_worker_scheduler_env(cluster_key)
    scheduler = Scheduler(env)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    ctx = zmq.Context()
    clients = [SchedulerClient(ctx, env, role, addr, key=load_key(env))
               for role, addr in (("worker", ""), ("server", "tcp://127.0.0.1:1"))]
    worker, server = clients

    def answer(client: SchedulerClient) -> dict:
        assert client.sock.poll(10_000), f"{client.role}: nothing from the scheduler in 10 s"
        return decode(client.sock.recv())

    try:
        for bad in ([], "tcp://127.0.0.1:1", [7], ["udp://127.0.0.1:1"],
                    ["tcp://127.0.0.1:1"] * 65, ["tcp://127.0.0.1"], ["tcp://:5"],
                    ["tcp://127.0.0.1:port"], ["tcp://127.0.0.1:70000"]):
            server.send(Op.HELLO, role="server", worker_id=-1, addr=server.addr, token=b"",
                        endpoints=bad)
            refusal = answer(server)
            assert refusal["op"] == Op.ERROR and "field 'endpoints'" in refusal["msg"], bad
        ends = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        server.send(Op.HELLO, role="server", worker_id=-1, addr=server.addr, token=b"",
                    endpoints=ends)
        worker.send(Op.HELLO, role="worker", worker_id=0, addr="", token=worker.token)
        welcome = answer(worker)
        assert welcome["op"] == Op.WELCOME and welcome["endpoints"] == [ends]
        assert server_endpoints(welcome, welcome["servers"]) == [ends]
        assert answer(server)["op"] == Op.WELCOME
        worker.send(Op.FINALIZE, step=-1)
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        for client in clients:
            client.close(linger=0)
        ctx.term()


def test_a_welcome_without_endpoints_means_each_servers_address() -> None:
    servers = ["tcp://10.0.0.1:5", "tcp://10.0.0.2:5"]
    assert server_endpoints({}, servers) == [[servers[0]], [servers[1]]]
    for bad in ([["tcp://10.0.0.1:5"]], [["tcp://10.0.0.1:5"], []], "x",
                [["tcp://10.0.0.1:5"], [3]]):
        with pytest.raises(ClusterError, match="field 'endpoints'"):
            server_endpoints({"endpoints": bad}, servers)


def test_scheduler_port_in_use_is_a_clear_error(caplog, cluster_key: str) -> None:
    """A scheduler address that is taken names the address and the variables behind it,
    and the scheduler returns 1 instead of raising."""
    import socket

    from bps.server.scheduler import Scheduler

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = ClusterEnv.from_environ({**BASE, "DMLC_ROLE": "scheduler",
                                       "DMLC_PS_ROOT_URI": "127.0.0.1",
                                       "DMLC_PS_ROOT_PORT": str(port),
                                       "BPS_SECRET_FILE": cluster_key})
        assert Scheduler(env).run() == 1
    assert (f"scheduler cannot listen on tcp://127.0.0.1:{port} (DMLC_PS_ROOT_URI, "
            "DMLC_PS_ROOT_PORT): Address already in use") in caplog.text
