"""A scheduler in a thread with bare clients as its nodes (real sockets, the cluster
key): the scheduler tests of elastic membership and of nodes joining use it."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import zmq

from bps.common.auth import load_key
from bps.common.env import ClusterEnv
from bps.common.protocol import Op, decode
from bps.common.scheduler_client import SchedulerClient
from bps.launch.role import free_port
from bps.server.scheduler import Scheduler
from tests.harness.env_vars import BASE


def scheduler_env(cluster_key: str, min_workers: int) -> ClusterEnv:
    return ClusterEnv.from_environ({**BASE, "DMLC_ROLE": "scheduler", "DMLC_NUM_WORKER": "3",
                                    "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
                                    "DMLC_PS_ROOT_PORT": str(free_port()),
                                    "BPS_SECRET_FILE": cluster_key,
                                    "BPS_MIN_WORKERS": str(min_workers)})


class SchedulerThread:
    """A scheduler of ``env`` running in a thread (its exit code in ``codes`` once it
    ends), and a ZeroMQ context for the test's bare clients."""

    def __init__(self, env: ClusterEnv) -> None:
        self.scheduler = Scheduler(env)
        self.codes: list[int] = []
        self.thread = threading.Thread(target=lambda: self.codes.append(self.scheduler.run()),
                                       daemon=True)
        self.thread.start()
        self.ctx = zmq.Context()

    def close_with(self, clients: Iterable[SchedulerClient]) -> None:
        """Close ``clients`` (their handshake monitors too), wait for the scheduler's
        thread, end the context."""
        for client in clients:
            client.close(linger=0)
        self.thread.join(timeout=10)
        self.ctx.term()


class Job(SchedulerThread):
    """A scheduler in a thread, three workers and a server as bare clients, welcomed."""

    def __init__(self, env: ClusterEnv) -> None:
        super().__init__(env)
        key = load_key(env)
        self.workers = [SchedulerClient(self.ctx, env, "worker", key=key) for _ in range(3)]
        self.server = SchedulerClient(self.ctx, env, "server", "tcp://127.0.0.1:1", key=key)
        for node, worker in enumerate(self.workers):
            worker.send(Op.HELLO, role="worker", worker_id=node, addr="127.0.0.1",
                        token=worker.token)
        self.server.send(Op.HELLO, role="server", worker_id=-1, addr=self.server.addr,
                         token=b"")
        for client in (*self.workers, self.server):
            assert self.next(client)["op"] == Op.WELCOME

    @staticmethod
    def next(client: SchedulerClient) -> dict:
        assert client.sock.poll(10_000), f"{client.role}: nothing from the scheduler in 10 s"
        return decode(client.sock.recv())

    def close(self) -> None:
        self.close_with((*self.workers, self.server))
