"""The scheduler: rendezvous, barriers, heartbeats (nodes reach it through
:class:`bps.common.scheduler_client.SchedulerClient`).

Usage::

    from bps.common.env import ClusterEnv
    from bps.server.scheduler import run_scheduler
    exit_code = run_scheduler(ClusterEnv.from_environ())    # DMLC_ROLE=scheduler

The scheduler binds a ROUTER at ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``. Servers and
worker nodes (local rank 0 only) say HELLO; once ``DMLC_NUM_WORKER`` workers and
``DMLC_NUM_SERVER`` servers are in, everyone gets a WELCOME with the server addresses
(in server-rank order), each server's endpoints (one per I/O thread), the counts and
the job seed. If that does not happen within ``BPS_TIMEOUT`` of the first HELLO,
everyone registered gets an error naming who is missing. Afterwards every node
heartbeats; a node silent for ``BPS_HEARTBEAT_TIMEOUT`` is declared dead, everyone
else gets PEER_DEAD naming it, and the scheduler exits non-zero; so does a node that
reports FAILED (an exception, a signal, an exit without ``bps.shutdown()``). When every
worker has said FINALIZE the servers get SHUTDOWN and the scheduler exits 0; workers
that finish after different numbers of steps, or a worker that pushes a step past the
last step of one that finished, end the job with an error naming both.

Elastic membership (``BPS_MIN_WORKERS=M``): a worker node that dies (its connection
closes, which is seen at once; it reports FAILED; or it goes silent for
``BPS_HEARTBEAT_TIMEOUT``) leaves the job instead of ending it while at least M worker
nodes are left: every remaining server and worker gets MEMBERSHIP with the next
generation number and the worker ids present, and from then on barriers, FINALIZE and
the step checks count only those. A message from a node that left is refused, naming
the generation it left at. Below M the job fails as without it, naming who died.

Server replacement (``BPS_SPARE_SERVERS=S``): servers that register once every server
slot is held wait as spares (STANDBY; at most S). A server that dies (its connection
closes, it reports FAILED, or it goes silent) leaves its slot vacant
(:class:`~bps.server.server_table.ServerTable`): the oldest spare takes it at once, or
else the next server that registers (one restarted with the same environment takes its
own slot). The replacement gets WELCOME with the next membership generation and the
workers present, the other servers MEMBERSHIP (the same workers, that generation: the
step in flight is dropped everywhere) and the workers REPLACED (the slot's new address).
A slot left vacant for ``BPS_HEARTBEAT_TIMEOUT`` fails the job, naming the dead server.

Joining (elastic jobs only): a worker HELLO after the rendezvous, for a node id in range
that is not present (a node restarted with its old id, or one started late), gets a
WELCOME marked ``joining`` at once, but is no member until it sends JOIN (its trainer is
ready): then everyone else gets MEMBERSHIP with the next generation and the joiner's
token, and once every server has confirmed that generation the joiner gets JOIN back,
naming the lowest-numbered old member as the ``source`` of its state. The source sends
the state in STATE chunks, which the scheduler keeps (the latest few) and hands to the
joiner's FETCHes (``bps.common.protocol``). A joiner that leaves before JOIN changes
nothing. A node that left stays refused: its connection is known, and a restarted
process opens a new one.

Membership: the ROUTER is a CURVE server (:mod:`bps.common.auth`), so only holders of the
cluster key reach it. A node id is bound to the connection that said HELLO first: a
second HELLO for a taken worker id or server rank, or with a taken token, is refused
and logged with the peer's address; messages from a connection that did not say HELLO
are refused the same way. So is a HELLO whose job-wide settings (``DMLC_NUM_WORKER``,
``DMLC_NUM_SERVER``, ``BPS_MIN_WORKERS``) differ from the scheduler's, naming both
values. The rendezvous timeout names, besides who is missing, the addresses whose
handshake (another cluster's key) or HELLO was refused, and why.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import zmq

from bps.common.auth import REFUSED_KEPT, Guard, load_key
from bps.common.env import ClusterEnv
from bps.common.protocol import (
    MAX_HEADER_BYTES,
    STATE_CHUNK,
    TOKEN_BYTES,
    Op,
    ProtocolError,
    decode,
    encode,
    error_text,
    new_socket,
    send_message,
)
from bps.common.ratelimit import RateLimitedLog
from bps.common.scheduler_client import LoopClock, failure_reason
from bps.common.striping import MAX_IO_THREADS

from .server_table import ServerTable, TableError

log = logging.getLogger("bps.scheduler")
refusals = RateLimitedLog(log)
# replies queued for one connection that does not read them: beyond this the ROUTER
# drops them (a node has at most a few requests out: HELLO, heartbeat, barrier, finalize)
PEER_QUEUE = 1000
STATES_KEPT = 3  # the joiners' states kept, the latest ones


@dataclass
class _Node:
    identity: bytes
    role: str
    rank: int
    addr: str
    last_seen: float
    token: bytes = b""
    peer: str = "?"  # the connection's IP address
    endpoints: list[str] | None = None  # a server's, one per I/O thread; else [addr]
    finalized: bool = False
    step: int = -1  # a worker's highest pushed step (heartbeats, FINALIZE)
    step_since: float = 0.0  # when that step was first reported
    fd: int = -1  # the scheduler's side of its connection (zmq.SRCFD), to see it close
    generation: int = 0  # a server's: the latest membership generation it confirmed

    @property
    def label(self) -> str:
        where = f" at {self.addr}" if self.addr else ""
        rank = f" {self.rank}" if self.rank >= 0 else ""
        role = "spare server" if self.role == "spare" else self.role
        return f"{role}{rank}{where}"


@dataclass
class Scheduler:
    """The rendezvous process; :meth:`run` returns the exit code."""

    env: ClusterEnv
    ctx: Any = None
    nodes: dict[bytes, _Node] = field(default_factory=dict)
    barrier_waiting: dict[int, set[bytes]] = field(default_factory=dict)
    loop_clock: LoopClock = field(init=False)
    verdict: str | None = None  # why the job must end now (a failed node, mismatched steps)
    # the latest HELLOs refused, "address (why)": the rendezvous timeout names them
    refused_hellos: deque = field(default_factory=lambda: deque(maxlen=REFUSED_KEPT))
    guard: Guard | None = None
    generation: int = 0  # the membership's: each worker node that leaves adds one
    left: dict[bytes, str] = field(default_factory=dict)  # connection -> why it left
    joining: dict[bytes, _Node] = field(default_factory=dict)  # welcomed, not members yet
    # admitted joiners waiting for every server to confirm: (connection, generation,
    # members, source)
    admitting: list[tuple[bytes, int, list[int], int]] = field(default_factory=list)
    # the joiners' states by the generation their source saw: {"total", "data", "got"}
    states: dict[int, dict] = field(default_factory=dict)
    fetches: list[tuple[bytes, int, int]] = field(default_factory=list)  # (who, gen, offset)
    servers: ServerTable = field(init=False)  # BPS_SPARE_SERVERS: slots, spares, vacancies
    tokens: list[bytes] = field(default_factory=list)  # the workers', in node order

    def __post_init__(self) -> None:
        self.loop_clock = LoopClock(self.env.heartbeat_interval)
        self.servers = ServerTable(self.env.num_servers, self.env.spare_servers)

    @property
    def watches_closes(self) -> bool:
        """Whether a closed connection is a death the job survives (a worker leaving,
        a server replaced), seen at once."""
        return self.env.elastic or self.env.replaces_servers

    def run(self) -> int:
        # Its own context unless given one: terminating it on the way out is what makes
        # ZeroMQ send the last SHUTDOWN/BYE/PEER_DEAD before the process exits (pyzmq
        # drops whatever is still queued at interpreter exit, lingering or not).
        key = load_key(self.env)
        ctx = self.ctx or zmq.Context()
        guard = self.guard = Guard(ctx, key)
        self.sock = new_socket(ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, PEER_QUEUE)
        self.sock.setsockopt(zmq.RCVHWM, PEER_QUEUE)
        guard.serve(self.sock, watch_closes=self.watches_closes)
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
            try:
                return self._loop()
            except BaseException as exc:  # an exception, Ctrl-C, SIGTERM: tell everyone
                msg = (f"scheduler at {self.env.scheduler_address} failed: "
                       f"{failure_reason(exc)}")
                log.error(msg)
                self._broadcast(Op.PEER_DEAD, msg=msg)  # sent in the linger below
                raise
        finally:
            self.sock.close(linger=1000)
            guard.close()
            if self.ctx is None:
                ctx.term()  # returns once the queued messages are sent, or after the linger

    def _send(self, identity: bytes, op: Op, **fields: Any) -> None:
        send_message(self.sock, [identity, encode(op, **fields)])

    def _broadcast(self, op: Op, exclude: bytes | None = None, **fields: Any) -> None:
        for node in self.nodes.values():
            if node.identity != exclude and not node.finalized:
                self._send(node.identity, op, **fields)

    def _complete(self) -> bool:
        spares = sum(n.role == "spare" for n in self.nodes.values())
        return len(self.nodes) - spares == self.env.num_workers + self.env.num_servers

    def _missing(self) -> str:
        workers = {n.rank for n in self.nodes.values() if n.role == "worker"}
        missing = [w for w in range(self.env.num_workers) if w not in workers]
        servers = sum(n.role == "server" for n in self.nodes.values())
        return (f"workers missing: {missing or 'none'}; servers registered: "
                f"{servers} of {self.env.num_servers}{self._refusals()}")

    def _refusals(self) -> str:
        """The handshakes (another key) and HELLOs (a bad setting) refused so far, each
        once: who may be missing because of them, and why."""
        refused = [*(self.guard.refused.summary() if self.guard is not None else ()),
                   *self.refused_hellos]
        if not refused:
            return ""
        return "; refused: " + "; ".join(dict.fromkeys(refused))

    def _loop(self) -> int:
        env = self.env
        start = time.monotonic()
        welcomed = False
        # elastic: a closed connection is a worker node leaving, seen within this poll
        poll_ms = int(env.heartbeat_interval * 1000)
        if self.watches_closes:
            poll_ms = min(poll_ms, 50)
        while True:
            if self.sock.poll(poll_ms):
                ident, *frames = self.sock.recv_multipart(copy=False)
                if not self.nodes:
                    start = time.monotonic()
                self._handle(ident.bytes, frames, welcomed)
            if self.verdict is not None:
                return 1
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
            if self.watches_closes:
                self._check_closed(welcomed)
                if self.verdict is not None:
                    return 1
            node = self._silent_node(now)
            if node is not None:
                msg = (f"{node.label} died: no heartbeat for {now - node.last_seen:.1f} s "
                       f"(BPS_HEARTBEAT_TIMEOUT={env.heartbeat_timeout:g})")
                if self._lost(node, msg, welcomed):
                    if self.verdict is not None:
                        return 1
                    continue
                log.error(msg)
                self._broadcast(Op.PEER_DEAD, exclude=node.identity, msg=msg)
                return 1
            if welcomed:
                self._check_stalls(now)
                self._check_vacancies(now)
                if self.verdict is not None:
                    return 1
            if welcomed and all(n.finalized for n in self.nodes.values() if n.role == "worker"):
                self._broadcast(Op.SHUTDOWN)
                log.info("all workers finished; servers shut down")
                return 0

    def _may_leave(self, node: _Node) -> bool:
        """Whether ``node`` may leave the job rather than end it: a worker of an elastic
        job (``BPS_MIN_WORKERS``) that has not finished; a server or the scheduler never."""
        return self.env.elastic and node.role == "worker" and not node.finalized

    def _lost(self, node: _Node, why: str, welcomed: bool) -> bool:
        """``node`` died (``why`` says how): whether the job goes on without it (a spare
        server; a server replaced, ``BPS_SPARE_SERVERS``; a worker leaving,
        ``BPS_MIN_WORKERS``); the caller ends the job otherwise. A worker's leaving may
        still fail the job (below the minimum: ``verdict``)."""
        if node.role == "spare":
            del self.nodes[node.identity]
            self.servers.drop_spare(node.identity)
            log.warning("%s; %d spare server(s) left", why, len(self.servers.waiting))
            return True
        if welcomed and node.role == "server" and self.servers.replaces:
            self._server_died(node, why)
            return True
        if welcomed and self._may_leave(node):
            self._leave(node, why)
            return True
        return False

    def _server_died(self, node: _Node, why: str) -> None:
        """A server of the running job died: a spare takes its slot now, or the slot
        waits for a server to register (:meth:`_check_vacancies`)."""
        del self.nodes[node.identity]
        self.left[node.identity] = f"{node.label} was replaced"
        spare = self.servers.vacate(node.rank, why, time.monotonic())
        if spare is None:
            log.warning("%s: its slot waits up to %g s (BPS_HEARTBEAT_TIMEOUT) for a "
                        "server to take its place (no spare server waits)", why,
                        self.env.heartbeat_timeout)
            return
        self._replace(node.rank, self.nodes[spare], why)

    def _replace(self, slot: int, node: _Node, why: str) -> None:
        """``node`` serves server slot ``slot`` from the next membership generation on:
        it gets WELCOME, the other servers MEMBERSHIP (the step in flight is dropped
        everywhere), the workers REPLACED, the joining ones too (their WELCOME named
        the dead server)."""
        node.role, node.rank = "server", slot
        self.generation += 1
        present = [n.rank for n in self._workers()]
        servers = sorted((n for n in self.nodes.values() if n.role == "server"),
                         key=lambda n: n.rank)
        msg = (f"{why}: server {slot} is now served from {node.addr} (membership "
               f"generation {self.generation})")
        log.warning(msg)
        self._send(node.identity, Op.WELCOME, node_id=slot,
                   servers=[n.addr for n in servers],
                   endpoints=[n.endpoints or [n.addr] for n in servers],
                   num_workers=self.env.num_workers, num_servers=self.env.num_servers,
                   seed=self.seed, members=self.tokens, generation=self.generation,
                   present=present)
        for other in (*self.nodes.values(), *self.joining.values()):
            if other.finalized or other is node:
                continue
            if other.role == "server":
                self._send(other.identity, Op.MEMBERSHIP, generation=self.generation,
                           members=present, msg=msg)
            elif other.role == "worker":
                self._send(other.identity, Op.REPLACED, server=slot, addr=node.addr,
                           endpoints=node.endpoints or [node.addr],
                           generation=self.generation, msg=msg)

    def _check_vacancies(self, now: float) -> None:
        """A server slot vacant for BPS_HEARTBEAT_TIMEOUT: the job fails, naming the
        server that died."""
        late = self.servers.overdue(now, self.env.heartbeat_timeout)
        if late is not None:
            slot, why, waited = late
            self._fail(f"{why}; no server took its place within {waited:.1f} s "
                       f"(BPS_SPARE_SERVERS={self.env.spare_servers} spare(s), all taken; "
                       f"a server started again with the same environment takes it too)")

    def _workers(self) -> list[_Node]:
        """The worker nodes present, in node order."""
        return sorted((n for n in self.nodes.values() if n.role == "worker"),
                      key=lambda n: n.rank)

    def _leave(self, node: _Node, why: str) -> None:
        """Worker ``node`` died (``why`` says how): it leaves, and everyone left gets the
        new membership; or, where fewer than BPS_MIN_WORKERS would be left, the job fails
        naming it, as without BPS_MIN_WORKERS."""
        left = [n for n in self._workers() if n.identity != node.identity]
        if len(left) < (self.env.min_workers or 0):
            self._fail(f"{why}; {len(left)} worker node(s) left, fewer than "
                       f"BPS_MIN_WORKERS={self.env.min_workers}", exclude=node.identity)
            return
        del self.nodes[node.identity]
        self.generation += 1
        self.left[node.identity] = (f"{node.label} left the job at membership generation "
                                    f"{self.generation}")
        members = [n.rank for n in left]
        msg = f"{why}: worker nodes {members} go on (membership generation {self.generation})"
        log.warning(msg)
        self._broadcast(Op.MEMBERSHIP, generation=self.generation, members=members, msg=msg)
        for seq, waiting in list(self.barrier_waiting.items()):
            waiting.discard(node.identity)
            if waiting and {n.identity for n in left} <= waiting:
                for other in left:
                    self._send(other.identity, Op.RELEASE, seq=seq)
                del self.barrier_waiting[seq]

    def _check_closed(self, welcomed: bool) -> None:
        """Worker nodes whose connection closed without FINALIZE or FAILED: dead (a
        process killed, a machine gone), seen at once; they leave. Before the rendezvous
        completes the closes are only taken (a file descriptor number is reused by later
        connections): a node lost then fails the job by the heartbeat rule."""
        for fd in self.guard.closed_connections() if self.guard is not None else ():
            joiner = next((n for n in self.joining.values() if n.fd == fd), None)
            if joiner is not None:
                self._drop_joiner(joiner, "its connection to the scheduler closed")
                continue
            node = next((n for n in self.nodes.values() if n.fd == fd), None)
            if node is None or node.finalized or (not welcomed and node.role != "spare"):
                continue
            # what the job cannot go on without: its heartbeats decide, as before
            self._lost(node, f"{node.label} died: its connection to the scheduler closed",
                       welcomed)
            if self.verdict is not None:
                return

    def _check_stalls(self, now: float) -> None:
        """A worker that has pushed before but stays behind another worker's step for
        BPS_HEARTBEAT_TIMEOUT, pushing nothing for as long, has stopped stepping (its main
        thread hangs, while its I/O thread still heartbeats): the others wait for a push
        that does not come. Of several, the one silent longest is named. Its last step may
        have been reported after the leader's (heartbeats are periodic, each node's in its
        own phase): it still counts from its own report."""
        workers = [n for n in self.nodes.values() if n.role == "worker" and not n.finalized]
        if len(workers) < 2:
            return
        timeout = self.env.heartbeat_timeout
        leader = max(workers, key=lambda n: (n.step, -n.step_since))
        waited = now - leader.step_since
        if waited <= timeout:
            return
        behind = [n for n in workers if 0 <= n.step < leader.step and now - n.step_since > timeout]
        if behind:
            node = min(behind, key=lambda n: n.step_since)
            self._fail(f"{node.label} stopped stepping: its last push was of step "
                       f"{node.step}, {now - node.step_since:.1f} s ago, while "
                       f"{leader.label} has waited {waited:.1f} s with step {leader.step} "
                       f"(BPS_HEARTBEAT_TIMEOUT={timeout:g})")

    def _silent_node(self, now: float) -> _Node | None:
        """A node not finished and silent for more than BPS_HEARTBEAT_TIMEOUT, or None.

        If this loop itself did not run for STALL_INTERVALS heartbeat intervals (the
        process or the machine paused), the heartbeats it missed prove nothing about the
        nodes: the time of the pause does not count as their silence (nor as a wait of
        the stall rule); the time before it does."""
        stall = self.loop_clock.stalled_for(now)
        if stall:
            for node in self.nodes.values():
                node.last_seen = min(now, node.last_seen + stall)
                node.step_since = min(now, node.step_since + stall)
        for node in self.nodes.values():
            if not node.finalized and now - node.last_seen > self.env.heartbeat_timeout:
                return node
        for node in list(self.joining.values()):
            node.last_seen = min(now, node.last_seen + stall)
            if now - node.last_seen > self.env.heartbeat_timeout:
                self._drop_joiner(node, f"no heartbeat for {now - node.last_seen:.1f} s")
        return None

    def _welcome(self) -> None:
        servers = [n for n in self.nodes.values() if n.role == "server"]
        free = iter(sorted(set(range(self.env.num_servers)) - {n.rank for n in servers}))
        for node in servers:  # registration order fills the ranks nobody asked for
            if node.rank < 0:
                node.rank = next(free)
        servers.sort(key=lambda n: n.rank)
        self.servers.fill({n.rank: n.identity for n in servers})
        addresses = [n.addr for n in servers]
        endpoints = [n.endpoints or [n.addr] for n in servers]
        tokens = self.tokens = [n.token for n in self._workers()]
        for node in self.nodes.values():
            if node.role == "spare":
                continue
            self._send(node.identity, Op.WELCOME, node_id=node.rank, servers=addresses,
                       endpoints=endpoints,
                       num_workers=self.env.num_workers, num_servers=self.env.num_servers,
                       seed=self.seed, members=tokens if node.role == "server" else [])
        log.info("rendezvous complete: servers %s, job seed %d", addresses, self.seed)

    def _refuse(self, ident: bytes, peer: str, msg: str, hello: bool = False) -> None:
        msg = error_text(msg)
        if hello:
            self.refused_hellos.append(f"{peer} ({msg})")
        refusals.warning("refused a message from %s: %s", peer, msg)
        self._send(ident, Op.ERROR, rid=-1, msg=msg)

    def _handle(self, ident: bytes, frames: list[zmq.Frame], welcomed: bool) -> None:
        peer = _peer(frames[0]) if frames else "?"
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected 1 frame, got {len(frames)}")
            header = decode(frames[0].bytes)
        except ProtocolError as exc:
            self._refuse(ident, peer, f"malformed message: {exc}")
            return
        op = header["op"]
        node = self.nodes.get(ident)
        if node is not None:
            node.last_seen = time.monotonic()
        if op == Op.HELLO:
            self._hello(ident, peer, header, welcomed)
            node = self.nodes.get(ident) or self.joining.get(ident)
            if node is not None and self.watches_closes:
                node.fd = _source_fd(frames[0])
        elif ident in self.joining:
            self._handle_joiner(self.joining[ident], op)
        elif node is None and ident in self.left:
            self._refuse(ident, peer, f"{op.name} refused: {self.left[ident]}")
        elif node is None:
            self._refuse(ident, peer, f"{op.name} before HELLO")
        elif op == Op.HEARTBEAT:
            self._send(ident, Op.HEARTBEAT)
            generation = header.get("generation")
            if node.role == "server" and type(generation) is int:
                node.generation = max(node.generation, generation)
                self._check_admitting()
            self._progress(node, header.get("step"))
        elif op == Op.STATE and node.role == "worker":
            self._store_state(node, header)
        elif op == Op.FETCH and node.role == "worker":
            self.fetches.append((ident, header["generation"], header["offset"]))
            self._serve_fetches()
        elif op == Op.BARRIER:
            if header["step"] > node.step:
                node.step, node.step_since = header["step"], time.monotonic()
            self._barrier(node, header["seq"])
        elif op == Op.FINALIZE:
            self._finalize(node, header["step"])
        elif op == Op.FAILED:
            self._send(ident, Op.BYE)  # the node may exit now: its report arrived
            why = f"{node.label} failed: {header['msg']}"
            if not self._lost(node, why, welcomed):
                self._fail(why, exclude=node.identity)
        else:
            self._refuse(ident, peer, f"unexpected op {op.name}")

    def _fail(self, msg: str, exclude: bytes | None = None) -> None:
        """End the job: everyone still running gets PEER_DEAD with ``msg``."""
        log.error(msg)
        self._broadcast(Op.PEER_DEAD, exclude=exclude, msg=msg)
        self.verdict = msg

    def _progress(self, node: _Node, step: object) -> None:
        """A worker's heartbeat step: past the last step of a worker that finished, the
        job cannot complete."""
        if node.role != "worker" or isinstance(step, bool) or not isinstance(step, int):
            return
        if step > node.step:
            node.step, node.step_since = step, time.monotonic()
        self._check_barriers()
        if self.verdict is not None:
            return
        for other in self.nodes.values():
            if other.role == "worker" and other.finalized and other.step < node.step:
                self._fail(f"{node.label} pushed step {node.step}, but {other.label} "
                           f"finished after step {other.step}: the workers ran different "
                           f"numbers of steps")
                return

    def _check_barriers(self) -> None:
        """A worker waiting in a barrier while another pushes a later step: they will
        never meet (a barrier is collective; the workers ran different numbers of steps)."""
        for seq, waiting in self.barrier_waiting.items():
            inside = [self.nodes[i] for i in waiting if i in self.nodes]
            for node in inside:
                ahead = [n for n in self.nodes.values() if n.role == "worker"
                         and n.identity not in waiting and n.step > node.step]
                if ahead:
                    self._fail(f"{node.label} waits in barrier {seq} after step {node.step}, "
                               f"but {ahead[0].label} pushed step {ahead[0].step}: the "
                               f"workers ran different numbers of steps")
                    return

    def _finalize(self, node: _Node, step: int) -> None:
        node.finalized = True
        node.step = step
        self._send(node.identity, Op.BYE)
        log.info("%s finished (last step %d)", node.label, step)
        workers = [n for n in self.nodes.values() if n.role == "worker"]
        done = {n.step for n in workers if n.finalized}
        ahead = [n for n in workers if n.step > step]
        if len(done) > 1 or ahead:
            steps = ", ".join(f"{n.label} {'finished after' if n.finalized else 'is at'} "
                              f"step {n.step}" for n in workers)
            self._fail(f"the workers ran different numbers of steps: {steps}")
            return
        for seq, waiting in list(self.barrier_waiting.items()):
            if waiting:  # a barrier that now can never complete
                labels = [self.nodes[i].label for i in waiting if i in self.nodes]
                self._fail(f"{node.label} finished while {', '.join(labels)} waited in "
                           f"barrier {seq}")
                return

    def _hello(self, ident: bytes, peer: str, header: dict, welcomed: bool) -> None:
        role, worker_id, addr = header["role"], header["worker_id"], header["addr"]
        token = header["token"]
        error = None
        if welcomed and role == "worker" and self.env.elastic and ident not in self.nodes:
            self._hello_joiner(ident, peer, header)
            return
        late_server = welcomed and role == "server" and self.servers.replaces
        if (welcomed and not late_server) or ident in self.nodes or ident in self.left:
            error = "rendezvous already complete" if welcomed else "duplicate HELLO"
        elif late_server:
            self._late_server(ident, peer, header)
            return
        elif settings := self._settings_error(header):
            error = settings
        elif role == "worker" and len(token) != TOKEN_BYTES:
            error = f"field 'token' has {len(token)} bytes, expected {TOKEN_BYTES}"
        elif role == "worker" and any(n.token == token for n in self.nodes.values()):
            error = "token already taken"
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
            full = len(servers) >= self.env.num_servers or rank >= self.env.num_servers or (
                rank >= 0 and any(n.rank == rank for n in servers))
            if rank >= self.env.num_servers + (self.env.spare_servers or 0):
                error = f"BPS_SERVER_ID={rank} out of range for DMLC_NUM_SERVER"
            elif full and self.servers.replaces:
                role = "spare"  # it waits for a server to die (STANDBY)
                try:
                    self.servers.spare(ident)
                except TableError as exc:
                    error = str(exc)
            elif len(servers) >= self.env.num_servers:
                error = f"more servers than DMLC_NUM_SERVER={self.env.num_servers}"
            elif rank >= 0 and any(n.rank == rank for n in servers):
                error = f"BPS_SERVER_ID={rank} registered twice"
            error = error or _endpoints_error(header.get("endpoints"))
            if error and role == "spare":
                self.servers.drop_spare(ident)
        else:
            error = f"unknown role {role!r}"
        if error:
            self._refuse(ident, peer, f"HELLO as {header['role']} {worker_id}: {error}",
                         hello=not welcomed)
            return
        self.nodes[ident] = _Node(ident, role, rank if role != "spare" else -1, addr,
                                  time.monotonic(), token=token if role == "worker" else b"",
                                  peer=peer,
                                  endpoints=header.get("endpoints") if role != "worker"
                                  else None)
        log.info("registered %s (connection from %s)", self.nodes[ident].label, peer)
        if role == "spare":
            self._send(ident, Op.STANDBY)

    def _late_server(self, ident: bytes, peer: str, header: dict) -> None:
        """A server's HELLO once the job runs (``BPS_SPARE_SERVERS``): it takes a vacant
        slot now (its own ``BPS_SERVER_ID``'s, else the oldest), or waits as a spare."""
        error = self._settings_error(header) or _endpoints_error(header.get("endpoints"))
        slot = None
        if error is None:
            try:
                slot = self.servers.admit(ident, header["worker_id"])
            except TableError as exc:
                error = str(exc)
        if error is not None:
            self._refuse(ident, peer, f"HELLO as server {header['worker_id']}: {error}")
            return
        node = self.nodes[ident] = _Node(ident, "spare", -1, header["addr"], time.monotonic(),
                                         peer=peer, endpoints=header.get("endpoints"))
        log.info("registered %s (connection from %s)", node.label, peer)
        if slot is None:
            self._send(ident, Op.STANDBY)
            return
        self._replace(slot, node, self.servers.died[slot])

    def _settings_error(self, header: dict) -> str | None:
        """A job-wide setting the HELLO carries that differs from the scheduler's (None:
        all agree). A HELLO without them (an older client) is not checked."""
        spares = self.env.spare_servers
        for name, variable, mine, unset in (
                ("num_workers", "DMLC_NUM_WORKER", self.env.num_workers, None),
                ("num_servers", "DMLC_NUM_SERVER", self.env.num_servers, None),
                ("min_workers", "BPS_MIN_WORKERS", self.env.min_workers or 0, 0),
                ("spare_servers", "BPS_SPARE_SERVERS", -1 if spares is None else spares, -1)):
            theirs = header.get(name)
            if theirs is None:
                continue
            if isinstance(theirs, bool) or not isinstance(theirs, int):
                return f"field {name!r} has type {type(theirs).__name__}"
            if theirs != mine:  # unset: 0 for BPS_MIN_WORKERS, -1 for BPS_SPARE_SERVERS
                return (f"its {variable}={'unset' if theirs == unset else theirs} differs "
                        f"from the scheduler's {variable}="
                        f"{'unset' if mine == unset else mine} (every node of a job needs "
                        f"the same)")
        return None

    def _barrier(self, node: _Node, seq: int) -> None:
        gone = [n.label for n in self.nodes.values() if n.role == "worker" and n.finalized]
        if gone:
            self._fail(f"{node.label} entered barrier {seq}, but {', '.join(gone)} already "
                       f"finished")
            return
        waiting = self.barrier_waiting.setdefault(seq, set())
        waiting.add(node.identity)
        self._check_barriers()
        if self.verdict is not None:
            return
        workers = {n.identity for n in self.nodes.values() if n.role == "worker"}
        if workers <= waiting:
            for identity in workers:
                self._send(identity, Op.RELEASE, seq=seq)
            del self.barrier_waiting[seq]

    # ---- worker nodes joining ----------------------------------------------------------

    def _hello_joiner(self, ident: bytes, peer: str, header: dict) -> None:
        """A worker's HELLO after the rendezvous of an elastic job: welcomed as a joiner
        (no member yet) where its node id is free; refused, naming why, where not."""
        worker_id, token = header["worker_id"], header["token"]
        present = {n.rank for n in self.nodes.values() if n.role == "worker"}
        error = self._settings_error(header)
        if ident in self.left:
            error = f"{self.left[ident]}; a restarted process may join again"
        elif error is None and len(token) != TOKEN_BYTES:
            error = f"field 'token' has {len(token)} bytes, expected {TOKEN_BYTES}"
        elif error is None and not 0 <= worker_id < self.env.num_workers:
            error = (f"DMLC_WORKER_ID={worker_id} out of range for "
                     f"DMLC_NUM_WORKER={self.env.num_workers}")
        elif error is None and (worker_id in present or ident in self.joining or any(
                n.rank == worker_id for n in self.joining.values())):
            error = f"worker node {worker_id} is present (or joining) already"
        elif error is None and any(n.token == token for n in (*self.nodes.values(),
                                                                *self.joining.values())):
            error = "token already taken"
        elif error is None and any(n.finalized for n in self.nodes.values()):
            error = "the job is finishing (a worker node has finished)"
        if error:
            self._refuse(ident, peer, f"HELLO as worker {worker_id} to join: {error}")
            return
        node = self.joining[ident] = _Node(ident, "worker", worker_id, header["addr"],
                                           time.monotonic(), token=token, peer=peer)
        servers = sorted((n for n in self.nodes.values() if n.role == "server"),
                         key=lambda n: n.rank)
        self._send(ident, Op.WELCOME, node_id=worker_id, servers=[n.addr for n in servers],
                   endpoints=[n.endpoints or [n.addr] for n in servers],
                   num_workers=self.env.num_workers, num_servers=self.env.num_servers,
                   seed=self.seed, members=[], joining=True)
        log.info("%s asks to join (connection from %s)", node.label, peer)

    def _handle_joiner(self, node: _Node, op: Op) -> None:
        """A message of a joiner that is no member yet."""
        node.last_seen = time.monotonic()
        if op == Op.HEARTBEAT:
            self._send(node.identity, Op.HEARTBEAT)
        elif op == Op.JOIN and any(n.finalized for n in self.nodes.values()):
            self._refuse(node.identity, node.peer, "JOIN refused: the job is finishing (a "
                         "worker node has finished)")
            self._drop_joiner(node, "the job is finishing")
        elif op == Op.JOIN:
            self._admit(node)
        elif op == Op.FAILED:
            self._send(node.identity, Op.BYE)
            self._drop_joiner(node, "it failed")
        elif op == Op.FINALIZE:
            self._send(node.identity, Op.BYE)
            self._drop_joiner(node, "it finished without joining")
        else:
            self._refuse(node.identity, node.peer, f"{op.name} before JOIN")

    def _drop_joiner(self, node: _Node, why: str) -> None:
        """A joiner that is no member yet went away: nothing changes for the job."""
        self.joining.pop(node.identity, None)
        log.warning("%s will not join: %s", node.label, why)

    def _admit(self, node: _Node) -> None:
        """The joiner is ready: it becomes a member of the next generation; everyone else
        gets MEMBERSHIP, the joiner its JOIN once every server confirmed it."""
        old = self._workers()
        del self.joining[node.identity]
        self.nodes[node.identity] = node
        if node.rank < len(self.tokens):  # what a replacement server will be told
            self.tokens[node.rank] = node.token
        self.generation += 1
        members = [n.rank for n in self._workers()]
        msg = (f"{node.label} joined: worker nodes {members} (membership generation "
               f"{self.generation}); worker {old[0].rank} sends it the state")
        log.warning(msg)
        self._broadcast(Op.MEMBERSHIP, exclude=node.identity, generation=self.generation,
                        members=members, msg=msg, joined=[[node.rank, node.token]])
        self.admitting.append((node.identity, self.generation, members, old[0].rank))
        self._check_admitting()

    def _check_admitting(self) -> None:
        """Answer the JOIN of every joiner whose generation all servers confirmed."""
        servers = [n for n in self.nodes.values() if n.role == "server"]
        waiting = []
        for ident, generation, members, source in self.admitting:
            if ident not in self.nodes:
                continue  # it left again
            if all(n.generation >= generation for n in servers):
                self._send(ident, Op.JOIN, generation=generation, members=members,
                           source=source)
            else:
                waiting.append((ident, generation, members, source))
        self.admitting = waiting

    def _store_state(self, node: _Node, header: dict) -> None:
        """A chunk of a joiner's state from its source: kept, and acknowledged."""
        generation, offset, total, data = (header["generation"], header["offset"],
                                           header["total"], header["data"])
        entry = self.states.get(generation)
        if entry is None or entry["total"] != total or offset == 0:
            entry = self.states[generation] = {"total": total, "data": bytearray(total),
                                               "got": 0}
            for old in sorted(self.states)[:-STATES_KEPT]:
                del self.states[old]
        if offset + len(data) > total:
            self._refuse(node.identity, node.peer, f"STATE of {offset + len(data)} bytes "
                         f"past its total {total}")
            return
        entry["data"][offset:offset + len(data)] = data
        entry["got"] = max(entry["got"], offset + len(data))
        self._send(node.identity, Op.STATE, generation=generation, offset=offset,
                   total=total, data=b"")
        if entry["got"] == total:
            log.info("%s sent the state of generation %d (%d bytes)", node.label,
                     generation, total)
            self._serve_fetches()

    def _serve_fetches(self) -> None:
        """Answer every FETCH whose state has arrived: the chunk at its offset of the first
        complete state of its generation or a later one."""
        waiting = []
        for ident, generation, offset in self.fetches:
            ready = [g for g, e in sorted(self.states.items())
                     if g >= generation and e["got"] == e["total"]]
            if not ready:
                waiting.append((ident, generation, offset))
                continue
            entry = self.states[ready[0]]
            self._send(ident, Op.STATE, generation=ready[0], offset=offset,
                       total=entry["total"],
                       data=bytes(entry["data"][offset:offset + STATE_CHUNK]))
        self.fetches = waiting


def _endpoints_error(endpoints: Any) -> str | None:
    """What is wrong with a server HELLO's optional ``endpoints`` (None if nothing)."""
    if endpoints is None:
        return None
    if (not isinstance(endpoints, list) or not 1 <= len(endpoints) <= MAX_IO_THREADS
            or not all(_is_tcp_address(e) for e in endpoints)):
        return (f"field 'endpoints' must be a list of 1 to {MAX_IO_THREADS} addresses "
                "tcp://host:port (one per I/O thread)")
    return None


def _is_tcp_address(value: Any) -> bool:
    """Whether ``value`` is ``tcp://host:port`` with a port in 1-65535."""
    if not isinstance(value, str) or len(value) > 256 or not value.startswith("tcp://"):
        return False
    try:
        parts = urlsplit(value)
        return bool(parts.hostname) and parts.port is not None and 0 < parts.port < 65536
    except ValueError:  # a port that is not a number, or out of range
        return False


def _source_fd(frame: zmq.Frame) -> int:
    """The file descriptor of the connection a message came on (-1: unknown)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return -1


def _peer(frame: zmq.Frame) -> str:
    """The IP address a message came from (ZeroMQ's Peer-Address property)."""
    try:
        return frame.get("Peer-Address") or "?"
    except zmq.ZMQError:
        return "?"


def run_scheduler(env: ClusterEnv) -> int:
    """Run the scheduler until the job ends; returns the process exit code."""
    return Scheduler(env).run()
