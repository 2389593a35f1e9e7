"""The scheduler's side of server replacement (``BPS_SPARE_SERVERS``), with real sockets
and the scheduler in a thread: a spare waits (STANDBY); a server whose connection closes
or that reports FAILED is replaced by the spare, or by the next server that registers;
the replacement gets WELCOME with the next generation, the other server MEMBERSHIP and
the workers REPLACED; a slot no server takes fails the job naming the dead server; a
client without the cluster key takes no slot."""

from __future__ import annotations

import time

import pytest

from bps.common.auth import load_key, write_key_file
from bps.common.env import ClusterEnv
from bps.common.protocol import Op, decode
from bps.common.scheduler_client import SchedulerClient
from bps.launch.role import free_port
from tests.harness.env_vars import BASE
from tests.harness.scheduler_job import SchedulerThread


def scheduler_env(cluster_key: str, spares: int, **extra: str) -> ClusterEnv:
    return ClusterEnv.from_environ({**BASE, "DMLC_ROLE": "scheduler", "DMLC_NUM_WORKER": "2",
                                    "DMLC_NUM_SERVER": "2", "DMLC_PS_ROOT_URI": "127.0.0.1",
                                    "DMLC_PS_ROOT_PORT": str(free_port()),
                                    "BPS_SECRET_FILE": cluster_key,
                                    "BPS_SPARE_SERVERS": str(spares),
                                    # the scheduler ends soon after a test's last step
                                    "BPS_HEARTBEAT_TIMEOUT": "3", **extra})


class Job(SchedulerThread):
    """A scheduler in a thread; two workers, two servers (ranks 0 and 1) and ``spares``
    spare servers (ids 2, ...) as bare clients; everyone but the spares welcomed."""

    def __init__(self, env: ClusterEnv, spares: int) -> None:
        super().__init__(env)
        self.env = env
        self.key = load_key(env)
        self.clients: list[SchedulerClient] = []
        self.workers = [self.client("worker") for _ in range(2)]
        self.servers = [self.client("server", f"tcp://127.0.0.1:{100 + i}") for i in range(2)]
        self.spares = [self.client("server", f"tcp://127.0.0.1:{200 + i}")
                       for i in range(spares)]
        for node, worker in enumerate(self.workers):
            self.hello(worker, node)
        for rank, server in enumerate(self.servers + self.spares):
            self.hello(server, rank)
        for spare in self.spares:
            assert self.next(spare)["op"] == Op.STANDBY
        for client in (*self.workers, *self.servers):
            assert self.next(client)["op"] == Op.WELCOME

    def client(self, role: str, addr: str = "127.0.0.1", key=None) -> SchedulerClient:
        client = SchedulerClient(self.ctx, self.env, role, addr, key=key or self.key)
        client.key_ok = key is None
        self.clients.append(client)
        return client

    def hello(self, client: SchedulerClient, rank: int) -> None:
        extra = {"endpoints": [client.addr]} if client.role == "server" else {}
        client.send(Op.HELLO, role=client.role, worker_id=rank, addr=client.addr,
                    token=client.token if client.role == "worker" else b"",
                    spare_servers=self.env.spare_servers, **extra)

    def next(self, client: SchedulerClient, timeout: float = 10.0) -> dict:
        """The scheduler's next message to ``client`` but heartbeats; meanwhile every
        live client heartbeats (the scheduler would find them silent otherwise)."""
        deadline = time.monotonic() + timeout
        while True:
            while not client.sock.poll(100):
                assert time.monotonic() < deadline, f"{client.role}: nothing from the scheduler"
                for other in self.clients:
                    if not other.sock.closed and other.key_ok:
                        other.send(Op.HEARTBEAT)
            msg = decode(client.sock.recv())
            if msg["op"] != Op.HEARTBEAT:
                return msg

    def quiet(self, client: SchedulerClient, seconds: float = 0.3) -> bool:
        """Whether ``client`` gets nothing for ``seconds`` (heartbeats aside)."""
        deadline = time.monotonic() + seconds
        while client.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            if decode(client.sock.recv())["op"] != Op.HEARTBEAT:
                return False
        return True

    @staticmethod
    def kill(client: SchedulerClient) -> None:
        client.sock.close(linger=0)  # a process killed: its connection closes

    def close(self) -> None:
        self.close_with(self.clients)


@pytest.fixture
def job(cluster_key: str):
    made: list[Job] = []

    def make(spares: int, **extra: str) -> Job:
        made.append(Job(scheduler_env(cluster_key, spares, **extra), spares))
        return made[-1]

    yield make
    for each in made:
        each.close()


def check_replaced(j: Job, new: SchedulerClient, why: str) -> None:
    """Slot 1 is now ``new``'s: it is welcomed with generation 1, server 0 and the
    workers are told."""
    welcome = j.next(new)
    assert welcome["op"] == Op.WELCOME, welcome
    assert (welcome["node_id"], welcome["generation"], welcome["present"]) == (1, 1, [0, 1])
    assert welcome["servers"] == ["tcp://127.0.0.1:100", new.addr]
    assert welcome["members"] == [w.token for w in j.workers]  # the workers' tokens
    told = j.next(j.servers[0])
    assert (told["op"], told["generation"], told["members"]) == (Op.MEMBERSHIP, 1, [0, 1])
    assert why in told["msg"] and f"server 1 is now served from {new.addr}" in told["msg"]
    for worker in j.workers:
        msg = j.next(worker)
        assert msg["op"] == Op.REPLACED, msg
        assert (msg["server"], msg["addr"], msg["endpoints"], msg["generation"]) == \
            (1, new.addr, [new.addr], 1)


def test_a_spare_takes_the_slot_of_a_server_whose_connection_closed(job) -> None:
    j = job(spares=1)
    j.kill(j.servers[1])
    check_replaced(j, j.spares[0], "server 1 at tcp://127.0.0.1:101 died: its connection "
                                   "to the scheduler closed")
    for worker in j.workers:  # the job goes on and ends as usual
        worker.send(Op.FINALIZE, step=9)
        assert j.next(worker)["op"] == Op.BYE
    assert j.next(j.servers[0])["op"] == Op.SHUTDOWN
    assert j.next(j.spares[0])["op"] == Op.SHUTDOWN
    j.thread.join(timeout=10)
    assert j.codes == [0]


def test_a_worker_node_joining_is_told_of_a_replacement_too(job) -> None:
    """``BPS_MIN_WORKERS=1``: worker 1 dies and starts again; while it is welcomed but
    not yet a member, server 1 dies: the joiner gets REPLACED as the members do (its
    WELCOME named the dead server), and its JOIN then takes the generation after."""
    j = job(spares=1, BPS_MIN_WORKERS="1")
    j.kill(j.workers[1])
    for client in (j.workers[0], *j.servers, j.spares[0]):  # the spare follows too
        msg = j.next(client)
        assert (msg["op"], msg["generation"]) == (Op.MEMBERSHIP, 1), msg
    again = j.client("worker")
    j.hello(again, 1)
    welcome = j.next(again)
    assert (welcome["op"], welcome["joining"]) == (Op.WELCOME, True), welcome
    j.kill(j.servers[1])
    assert j.next(j.spares[0])["op"] == Op.WELCOME
    for worker in (j.workers[0], again):
        msg = j.next(worker)
        assert (msg["op"], msg["server"], msg["addr"], msg["generation"]) == \
            (Op.REPLACED, 1, j.spares[0].addr, 2), msg


def test_a_server_that_registers_later_takes_the_slot_of_one_that_failed(job) -> None:
    """No spare: the slot waits; a server registering with BPS_SERVER_ID=1 takes it."""
    j = job(spares=0)
    j.servers[1].send(Op.FAILED, msg="RuntimeError: boom")
    assert j.next(j.servers[1])["op"] == Op.BYE
    for client in (*j.workers, j.servers[0]):  # nobody is told yet
        assert j.quiet(client)
    restarted = j.client("server", "tcp://127.0.0.1:300")
    j.hello(restarted, 1)
    check_replaced(j, restarted, "server 1 at tcp://127.0.0.1:101 failed: RuntimeError: boom")
    j.servers[1].send(Op.HEARTBEAT)  # the dead one is refused from now on
    refusal = j.next(j.servers[1])
    assert refusal["op"] == Op.ERROR and "HEARTBEAT refused: server 1 at " \
        "tcp://127.0.0.1:101 was replaced" in refusal["msg"], refusal


def test_a_slot_nobody_takes_fails_the_job_naming_the_dead_server(job, tmp_path) -> None:
    """A client with another cluster's key cannot take it (no handshake); after
    BPS_HEARTBEAT_TIMEOUT everyone is told which server died."""
    j = job(spares=0, BPS_HEARTBEAT_TIMEOUT="2")
    j.kill(j.servers[1])
    outsider = j.client("server", "tcp://127.0.0.1:400",
                        key=write_key_file(str(tmp_path / "other.key")))
    j.hello(outsider, 1)
    for client in (*j.workers, j.servers[0]):
        msg = j.next(client)
        assert msg["op"] == Op.PEER_DEAD, msg
        assert msg["msg"].startswith("server 1 at tcp://127.0.0.1:101 died: its connection "
                                     "to the scheduler closed; no server took its place "
                                     "within "), msg
    assert not outsider.sock.poll(100)  # it never got an answer
    j.thread.join(timeout=10)
    assert j.codes == [1]


def test_spares_beyond_the_count_are_refused_and_a_dead_spare_is_dropped(job) -> None:
    j = job(spares=1)
    extra = j.client("server", "tcp://127.0.0.1:500")
    j.hello(extra, -1)
    refusal = j.next(extra)
    assert refusal["op"] == Op.ERROR and "more servers than DMLC_NUM_SERVER=2 and " \
        "BPS_SPARE_SERVERS=1 spares" in refusal["msg"], refusal
    j.kill(j.spares[0])  # a dead spare: nobody is told, the job goes on
    for client in (*j.workers, *j.servers):
        assert j.quiet(client)
    j.kill(j.servers[0])  # no spare left now: the slot waits
    late = j.client("server", "tcp://127.0.0.1:600")
    j.hello(late, -1)  # no id: the oldest vacant slot
    welcome = j.next(late)
    if welcome["op"] == Op.STANDBY:  # it came before the death was seen: a spare first
        welcome = j.next(late)
    assert (welcome["op"], welcome["node_id"], welcome["generation"]) == (Op.WELCOME, 0, 1)


def test_a_hello_with_another_spare_count_is_refused_naming_both(job) -> None:
    j = job(spares=1)
    other = j.client("server", "tcp://127.0.0.1:700")
    other.send(Op.HELLO, role="server", worker_id=-1, addr=other.addr, token=b"",
               spare_servers=-1, endpoints=[other.addr])
    refusal = j.next(other)
    assert refusal["op"] == Op.ERROR
    assert "its BPS_SPARE_SERVERS=unset differs from the scheduler's BPS_SPARE_SERVERS=1" \
        in refusal["msg"], refusal
