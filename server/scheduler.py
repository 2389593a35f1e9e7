"""The scheduler: rendezvous, barriers, heartbeats (nodes reach it through
:class:`bps.scheduler_client.SchedulerClient`).

Usage::

    from bps.env import ClusterEnv
    from bps.server.scheduler import run_scheduler
    exit_code = run_scheduler(ClusterEnv.from_environ())    # DMLC_ROLE=scheduler

The scheduler binds a ROUTER at ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``. Servers and
worker nodes (local rank 0 only) say HELLO; once ``DMLC_NUM_WORKER`` workers and
``DMLC_NUM_SERVER`` servers are in, everyone gets a WELCOME with the server addresses
(in server-rank order), the counts and the job seed. If that does not happen within
``BPS_TIMEOUT`` of the first HELLO, everyone registered gets an error naming who is
missing. Afterwards every
node heartbeats; a node silent for ``BPS_HEARTBEAT_TIMEOUT`` is declared dead, everyone
else gets PEER_DEAD naming it, and the scheduler exits non-zero. When every worker has
said FINALIZE the servers get SHUTDOWN and the scheduler exits 0.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from bps.env import ClusterEnv
from bps.protocol import Op, ProtocolError, decode, encode, new_socket
from bps.scheduler_client import LoopClock

log = logging.getLogger("bps.scheduler")


@dataclass
class _Node:
    identity: bytes
    role: str
    rank: int
    addr: str
    last_seen: float
    finalized: bool = False

    @property
    def label(self) -> str:
        where = f" at {self.addr}" if self.addr else ""
        rank = f" {self.rank}" if self.rank >= 0 else ""
        return f"{self.role}{rank}{where}"


@dataclass
class Scheduler:
    """The rendezvous process; :meth:`run` returns the exit code."""

    env: ClusterEnv
    ctx: Any = None
    nodes: dict[bytes, _Node] = field(default_factory=dict)
    barrier_waiting: dict[int, set[bytes]] = field(default_factory=dict)
    loop_clock: LoopClock = field(init=False)

    def __post_init__(self) -> None:
        self.loop_clock = LoopClock(self.env.heartbeat_interval)

    def run(self) -> int:
        # Its own context unless given one: terminating it on the way out is what makes
        # ZeroMQ send the last SHUTDOWN/BYE/PEER_DEAD before the process exits (pyzmq
        # drops whatever is still queued at interpreter exit, lingering or not).
        ctx = self.ctx or zmq.Context()
        self.sock = new_socket(ctx, zmq.ROUTER)
        try:
            try:
                self.sock.bind(self.env.scheduler_address)
            except zmq.ZMQError as exc:
                log.error("scheduler cannot listen on %s (DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT): "
                          "%s", self.env.scheduler_address, exc.strerror)
                return 1
            log.info("scheduler listening on %s for %d workers, %d servers",
                     self.env.scheduler_address, self.env.num_workers, self.env.num_servers)
            self.seed = self.env.job_seed or random.SystemRandom().randrange(1, 2**63)
            return self._loop()
        finally:
            self.sock.close(linger=1000)
            if self.ctx is None:
                ctx.term()  # returns once the queued messages are sent, or after the linger

    def _send(self, identity: bytes, op: Op, **fields: Any) -> None:
        self.sock.send_multipart([identity, encode(op, **fields)])

    def _broadcast(self, op: Op, exclude: bytes | None = None, **fields: Any) -> None:
        for node in self.nodes.values():
            if node.identity != exclude and not node.finalized:
                self._send(node.identity, op, **fields)

    def _complete(self) -> bool:
        return len(self.nodes) == self.env.num_workers + self.env.num_servers

    def _missing(self) -> str:
        workers = {n.rank for n in self.nodes.values() if n.role == "worker"}
        missing = [w for w in range(self.env.num_workers) if w not in workers]
        servers = sum(n.role == "server" for n in self.nodes.values())
        return (f"workers missing: {missing or 'none'}; servers registered: "
                f"{servers} of {self.env.num_servers}")

    def _loop(self) -> int:
        env = self.env
        start = time.monotonic()
        welcomed = False
        while True:
            if self.sock.poll(int(env.heartbeat_interval * 1000)):
                ident, *frames = self.sock.recv_multipart()
                if not self.nodes:
                    start = time.monotonic()
                self._handle(ident, frames, welcomed)
            now = time.monotonic()
            if not welcomed:
                if self._complete():
                    self._welcome()
                    welcomed = True
                elif now - start > env.timeout:  # start: the first HELLO, if any
                    msg = (f"rendezvous timed out after {env.timeout:g} s (BPS_TIMEOUT): "
                           f"{self._missing()}")
                    log.error(msg)
                    self._broadcast(Op.ERROR, rid=-1, msg=msg)
                    return 1
            node = self._silent_node(now)
            if node is not None:
                msg = (f"{node.label} died: no heartbeat for {now - node.last_seen:.1f} s "
                       f"(BPS_HEARTBEAT_TIMEOUT={env.heartbeat_timeout:g})")
                log.error(msg)
                self._broadcast(Op.PEER_DEAD, exclude=node.identity, msg=msg)
                return 1
            if welcomed and all(n.finalized for n in self.nodes.values() if n.role == "worker"):
                self._broadcast(Op.SHUTDOWN)
                log.info("all workers finished; servers shut down")
                return 0

    def _silent_node(self, now: float) -> _Node | None:
        """A node not finished and silent for more than BPS_HEARTBEAT_TIMEOUT, or None.

        If this loop itself did not run for STALL_INTERVALS heartbeat intervals (the
        process or the machine paused), the heartbeats it missed prove nothing about the
        nodes: their silence is counted afresh from now."""
        if self.loop_clock.resumed_after_stall(now):
            for node in self.nodes.values():
                node.last_seen = now
        for node in self.nodes.values():
            if not node.finalized and now - node.last_seen > self.env.heartbeat_timeout:
                return node
        return None

    def _welcome(self) -> None:
        servers = [n for n in self.nodes.values() if n.role == "server"]
        free = iter(sorted(set(range(self.env.num_servers)) - {n.rank for n in servers}))
        for node in servers:  # registration order fills the ranks nobody asked for
            if node.rank < 0:
                node.rank = next(free)
        servers.sort(key=lambda n: n.rank)
        addresses = [n.addr for n in servers]
        for node in self.nodes.values():
            self._send(node.identity, Op.WELCOME, node_id=node.rank, servers=addresses,
                       num_workers=self.env.num_workers, num_servers=self.env.num_servers,
                       seed=self.seed)
        log.info("rendezvous complete: servers %s, job seed %d", addresses, self.seed)

    def _handle(self, ident: bytes, frames: list[bytes], welcomed: bool) -> None:
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected 1 frame, got {len(frames)}")
            header = decode(frames[0])
        except ProtocolError as exc:
            log.warning("dropping malformed message: %s", exc)
            self._send(ident, Op.ERROR, rid=-1, msg=f"malformed message: {exc}")
            return
        op = header["op"]
        node = self.nodes.get(ident)
        if node is not None:
            node.last_seen = time.monotonic()
        if op == Op.HELLO:
            self._hello(ident, header, welcomed)
        elif node is None:
            self._send(ident, Op.ERROR, rid=-1, msg=f"{op.name} before HELLO")
        elif op == Op.HEARTBEAT:
            self._send(ident, Op.HEARTBEAT)
        elif op == Op.BARRIER:
            self._barrier(node, header["seq"])
        elif op == Op.FINALIZE:
            node.finalized = True
            self._send(ident, Op.BYE)
            log.info("%s finished", node.label)
        else:
            self._send(ident, Op.ERROR, rid=-1, msg=f"unexpected op {op.name}")

    def _hello(self, ident: bytes, header: dict, welcomed: bool) -> None:
        role, worker_id, addr = header["role"], header["worker_id"], header["addr"]
        error = None
        if welcomed or ident in self.nodes:
            error = "rendezvous already complete" if welcomed else "duplicate HELLO"
        elif role == "worker":
            if not 0 <= worker_id < self.env.num_workers:
                error = (f"DMLC_WORKER_ID={worker_id} out of range for "
                         f"DMLC_NUM_WORKER={self.env.num_workers}")
            elif any(n.role == "worker" and n.rank == worker_id for n in self.nodes.values()):
                error = f"DMLC_WORKER_ID={worker_id} registered twice"
            rank = worker_id
        elif role == "server":
            rank = worker_id  # BPS_SERVER_ID or -1: a rank is given at WELCOME
            servers = [n for n in self.nodes.values() if n.role == "server"]
            if len(servers) >= self.env.num_servers:
                error = f"more servers than DMLC_NUM_SERVER={self.env.num_servers}"
            elif rank >= self.env.num_servers:
                error = f"BPS_SERVER_ID={rank} out of range for DMLC_NUM_SERVER"
            elif rank >= 0 and any(n.rank == rank for n in servers):
                error = f"BPS_SERVER_ID={rank} registered twice"
        else:
            error = f"unknown role {role!r}"
        if error:
            log.error("refusing %s: %s", role, error)
            self._send(ident, Op.ERROR, rid=-1, msg=error)
            return
        self.nodes[ident] = _Node(ident, role, rank, addr, time.monotonic())
        log.info("registered %s", self.nodes[ident].label)

    def _barrier(self, node: _Node, seq: int) -> None:
        waiting = self.barrier_waiting.setdefault(seq, set())
        waiting.add(node.identity)
        workers = {n.identity for n in self.nodes.values() if n.role == "worker"}
        if workers <= waiting:
            for identity in workers:
                self._send(identity, Op.RELEASE, seq=seq)
            del self.barrier_waiting[seq]


def run_scheduler(env: ClusterEnv) -> int:
    """Run the scheduler until the job ends; returns the process exit code."""
    return Scheduler(env).run()
