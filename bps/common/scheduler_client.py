"""A node's link to the scheduler: rendezvous, heartbeats, the scheduler's messages.

Servers and worker engines each hold one, used only from their I/O thread::

    from bps.common.env import ClusterEnv
    from bps.common.scheduler_client import SchedulerClient

    env = ClusterEnv.from_environ()
    key = bps.common.auth.load_key(env)         # the cluster's CURVE key (None: BPS_INSECURE=1)
    link = SchedulerClient(zmq.Context.instance(), env, role="server", addr="tcp://10.0.0.2:4000",
                           key=key)
    welcome = link.rendezvous()          # waits up to BPS_TIMEOUT, also for a late scheduler
    # in the I/O loop: poll link.sock; header = link.receive(); link.tick()

:class:`LoopClock` tells a stall of a heartbeat loop itself from silent peers (the
scheduler uses it too).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from bps.common.auth import ClusterKey, HandshakeWatch, connect_as_client
from bps.common.env import ClusterEnv
from bps.common.protocol import (
    ClusterError,
    Op,
    PeerFailure,
    RemoteError,
    decode,
    encode,
    new_socket,
    new_token,
)

STALL_INTERVALS = 3  # no loop/tick for this many heartbeat intervals: our own stall


def failure_reason(exc: BaseException) -> str:
    """What a FAILED report says about ``exc``: ``RuntimeError: boom``,
    ``KeyboardInterrupt``, ``terminated by SIGTERM`` (``SystemExit(143)``)."""
    if isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM:
        return "terminated by SIGTERM"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@dataclass
class LoopClock:
    """When a heartbeat loop last ran, to tell a stall of the loop itself (the process
    or the machine paused) from silent peers: the heartbeats it missed prove nothing."""

    interval: float  # the heartbeat interval
    last: float = field(default_factory=time.monotonic)

    def stalled_for(self, now: float) -> float:
        """How long the loop did not run before ``now`` (which becomes its last run),
        where that was more than STALL_INTERVALS intervals; else 0. Silence of peers
        during that time proves nothing, but the silence before it still counts: shift
        their last-heard times by this much (resetting them to ``now`` instead would let
        a loop that stalls every few seconds, on a loaded machine, never see a dead peer)."""
        gap = now - self.last
        self.last = now
        return gap if gap > STALL_INTERVALS * self.interval else 0.0


class StandbyOver(Exception):
    """The job ended (``SHUTDOWN``) while this server waited as a spare."""


class SchedulerClient:
    """A node's link to the scheduler; used only from its owner's I/O thread.

    Usage (inside a node)::

        link = SchedulerClient(ctx, env, role="server", addr="tcp://10.0.0.2:4000")
        welcome = link.rendezvous()          # blocks up to BPS_TIMEOUT
        # in the I/O loop: poll link.sock; header = link.receive(); link.tick()
    """

    def __init__(self, ctx: Any, env: ClusterEnv, role: str, addr: str = "",
                 key: ClusterKey | None = None, endpoints: list[str] | None = None) -> None:
        self.env = env
        self.role = role
        self.addr = addr
        self.endpoints = endpoints  # a server's: one per I/O thread (bps.common.striping)
        self.token = new_token()  # this node's connections to servers carry it
        self.sock = new_socket(ctx, zmq.DEALER)
        connect_as_client(self.sock, key)
        # a scheduler that refuses our key fails the rendezvous in seconds, not BPS_TIMEOUT
        self._watch = HandshakeWatch(env, role)
        self._watch.add(self.sock, f"the scheduler at {env.scheduler_address}")
        self.sock.connect(env.scheduler_address)
        self.last_seen = time.monotonic()
        self.last_sent = 0.0
        self.heard = False  # whether the scheduler ever answered
        self.step = -1  # a worker's highest pushed step, in its heartbeats
        self.tick_clock = LoopClock(env.heartbeat_interval)

    def send(self, op: Op, **fields: Any) -> None:
        self.sock.send(encode(op, **fields))
        self.last_sent = time.monotonic()

    def rendezvous(self) -> dict:
        """Say HELLO and wait for WELCOME; raises ClusterError on error or timeout. A
        scheduler that starts late is waited for up to ``BPS_TIMEOUT``; the heartbeat
        rule applies once it has answered. A server the scheduler keeps as a spare
        (``STANDBY``, ``BPS_SPARE_SERVERS``) waits without a deadline, until it takes a
        dead server's slot (WELCOME) or the job ends (:class:`StandbyOver`)."""
        worker_id = self.env.worker_id if self.role == "worker" else self.env.server_id
        extra = {"endpoints": self.endpoints} if self.endpoints else {}
        # the job-wide settings the scheduler checks against its own
        self.send(Op.HELLO, role=self.role, worker_id=worker_id, addr=self.addr,
                  token=self.token, num_workers=self.env.num_workers,
                  num_servers=self.env.num_servers, min_workers=self.env.min_workers or 0,
                  spare_servers=-1 if self.env.spare_servers is None
                  else self.env.spare_servers, **extra)
        # the scheduler's own rendezvous timeout (which names who is missing) comes first
        deadline = time.monotonic() + self.env.timeout + self.env.heartbeat_timeout
        self.last_seen = time.monotonic()
        poller = zmq.Poller()
        for sock in (self.sock, *self._watch.sockets()):
            poller.register(sock, zmq.POLLIN)
        while time.monotonic() < deadline:
            self.tick()
            ready = dict(poller.poll(int(self.env.heartbeat_interval * 1000)))
            for monitor in self._watch.check(ready):
                poller.unregister(monitor)
            if self.sock in ready:
                header = self.receive()
                if header["op"] == Op.WELCOME:
                    self._watch.close()
                    return header
                if header["op"] == Op.STANDBY:  # a spare server: it waits for a slot
                    deadline = float("inf")
                elif header["op"] == Op.SHUTDOWN:  # the job ended while it waited
                    raise StandbyOver("the job ended while this server waited as a spare")
        never = "" if self.heard else (" (it never answered: is it running, and does "
                                       "BPS_SECRET_FILE hold this cluster's key?)")
        raise ClusterError(f"rendezvous with scheduler at {self.env.scheduler_address} "
                           f"did not complete within {self.env.timeout:g} s (BPS_TIMEOUT)"
                           f"{never}")

    def receive(self) -> dict:
        """Read one scheduler message; raises ClusterError for ERROR / PEER_DEAD."""
        header = decode(self.sock.recv())
        self.last_seen = time.monotonic()
        self.heard = True
        if header["op"] == Op.ERROR:
            raise RemoteError(f"scheduler: {header['msg']}")
        if header["op"] == Op.PEER_DEAD:
            raise PeerFailure(header["msg"])
        return header

    def tick(self) -> None:
        """Heartbeat if due; raises ClusterError if the scheduler went silent. Silence
        during a stall of this thread itself (no tick for STALL_INTERVALS heartbeat
        intervals) is not held against the scheduler."""
        now = time.monotonic()
        self.last_seen = min(now, self.last_seen + self.tick_clock.stalled_for(now))
        if now - self.last_sent >= self.env.heartbeat_interval:
            self.send(Op.HEARTBEAT, step=self.step)
        silent = now - self.last_seen
        if self.heard and silent > self.env.heartbeat_timeout:
            raise ClusterError(f"scheduler at {self.env.scheduler_address} unreachable: "
                               f"no heartbeat for {silent:.1f} s")

    def report_failure(self, reason: str, timeout: float) -> None:
        """Send FAILED (this node gives up, and why) and wait up to ``timeout`` for the
        scheduler's BYE, which says the report arrived; raises ClusterError otherwise.
        The scheduler then fails the job naming this node, at once."""
        self.send(Op.FAILED, msg=reason[:2000])
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(max(1, int(left * 1000))) and \
                    decode(self.sock.recv())["op"] == Op.BYE:
                return
        raise ClusterError(f"no answer from the scheduler within {timeout:g} s")

    def close(self, linger: int | None = None) -> None:
        """Close the socket (and the monitor that watches its handshake)."""
        self._watch.close()
        self.sock.close(linger=linger)
