"""The parameter server: one process, its threads and sockets; per key, the pushes of a
step summed into one aggregate (:mod:`bps.server.aggregator`), the requests checked and
authorised (:mod:`bps.server.requests`).

Usage::

    from bps.common.env import ClusterEnv
    from bps.server.server import run_server
    exit_code = run_server(ClusterEnv.from_environ())       # DMLC_ROLE=server

One I/O thread owns the ROUTER socket and the scheduler link; it checks every header
(``bps.common.protocol.decode``, then :func:`bps.server.requests.check_request`: a
member's key request with the payload frames its header announces) and hands messages to
``BPS_SERVER_THREADS`` engine threads (:class:`KeyEngine`; default: the host's cores
shared by the job's servers on it), each owning a disjoint set of keys (a new key goes to
the one with the fewest elements so far, :class:`LeastLoaded`), so different keys are
decoded, summed and re-encoded in parallel (torch ops and numba kernels release the GIL;
a large partition's kernels also run in chunks on ``bps.compressors.threads``' pool).
Each engine thread serves its requests in arrival order (``Requests`` of
:mod:`bps.server.requests` on its own ``Aggregator``); each step's reply carries
``server_s``, the seconds the key's engine spent on it. Engine threads send replies back
through an inproc socket; the I/O thread forwards them. With one engine thread
(``BPS_SERVER_THREADS=1``, or a host with no more cores than servers) the I/O thread
serves the requests itself, in the same order, and replies on the ROUTER: a push then
crosses no thread (each hand-over costs a wake-up and the GIL changing hands twice).

Every bound is checked before anything is allocated: frame sizes
(``BPS_MAX_MESSAGE_BYTES``, enforced by ZeroMQ while it reads), a key's size (half of
that), replies queued for one connection (:data:`PEER_QUEUE`), requests queued for the
engine threads (:data:`INBOX_BYTES`: the server stops reading until they catch up), and
warnings (rate-limited). The ABORT of a skipped step travels on node 0's connection ahead
of its next push, so it always arrives before that key's next step can complete.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import torch
import zmq

from bps.common import trace
from bps.common.auth import Guard, load_key
from bps.common.env import ClusterEnv
from bps.common.memory import keep_buffers_in_heap
from bps.common.protocol import (
    ClusterError,
    Op,
    ProtocolError,
    decode,
    drain,
    encode,
    error_text,
    new_socket,
    send_message,
)
from bps.common.scheduler_client import SchedulerClient, StandbyOver, failure_reason
from bps.common.striping import (
    bind_per_io_thread,
    core_shares,
    default_connections,
    engine_threads,
    host_cores,
    io_thread_cpu_seconds,
    io_threads,
)
from bps.compressors.warm import load_soon

from .aggregator import Aggregator
from .requests import MAX_NUMEL, Requests, check_request, refusals, update_members

log = logging.getLogger("bps.server")

KEY_COST = 65536  # a key-step's fixed Python work, in elements' worth of kernel time
PEER_QUEUE = 1024  # replies queued for one connection that does not read (then dropped)
PEER_INBOUND = 64  # requests ZeroMQ queues per connection before it stops reading it
INBOX_BYTES = 256 << 20  # payload bytes waiting for the engine threads: read no more


class KeyEngine:
    """Owns a set of keys (an :class:`~bps.server.aggregator.Aggregator` of the server's
    workers). Once :meth:`start` ed, a thread of its own serves their requests from
    :attr:`inbox` in arrival order, replying on a PUSH socket connected to the server's
    ``replies_address``; ``None`` in the inbox ends it. A server of one engine serves
    its aggregator on the thread that reads the sockets, and starts none."""

    def __init__(self, server: ParameterServer, index: int) -> None:
        self.index, self.server = index, server
        self.thread: threading.Thread | None = None
        # put and get in C: a blocked get waits on one lock (queue.Queue runs a Python
        # Condition per get, a new lock each time)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.aggregator = Aggregator(server.num_workers, server.tracer)

    @property
    def keys(self) -> dict:
        """Its keys' states (:class:`~bps.server.aggregator.KeyState`), by key."""
        return self.aggregator.keys

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, daemon=True,
                                       name=f"bps-server-engine-{self.index}")
        self.thread.start()

    def run(self) -> None:
        out = new_socket(self.server.ctx, zmq.PUSH)
        out.connect(self.server.replies_address)
        requests = Requests(self.aggregator, out, self.server.env)
        try:
            while (item := self.inbox.get()) is not None:
                ident, header, payload = item
                if ident is None:  # a membership change, in order with the requests
                    requests.membership(header["generation"], header["members"])
                    continue
                self.server.dequeued(payload)
                requests.serve(ident, header, payload)
        finally:
            out.close()


class LeastLoaded:
    """Picks the engine thread of a new key: the one with the least work so far, in
    elements plus :data:`KEY_COST` per key, ties to the lowest-numbered. Keys of
    different sizes (a tensor's last partition, small raw tensors) then spread evenly.

        >>> pick = LeastLoaded(["e0", "e1"])
        >>> [pick({"numel": n}) for n in (1_000_000, 10, 10, 10, 1_000_000)]
        ['e0', 'e1', 'e1', 'e1', 'e1']
        >>> pick.loads
        [1065536, 1262174]
    """

    def __init__(self, engines: list) -> None:
        self.engines = engines
        self.loads = [0] * len(engines)

    def __call__(self, header: dict) -> Any:
        index = min(range(len(self.loads)), key=self.loads.__getitem__)
        numel = header.get("numel", 0)  # refused later if out of range: clamped here
        self.loads[index] += KEY_COST + min(max(numel, 0), MAX_NUMEL)
        return self.engines[index]


class ParameterServer:
    """One server process; :meth:`run` returns the exit code."""

    def __init__(self, env: ClusterEnv, ctx: Any = None) -> None:
        self.env = env
        # CURVE encrypts and decrypts each connection in one of ZeroMQ's I/O threads:
        # enough of them let the workers' connections run in parallel (bps.common.striping)
        self.ctx = ctx or zmq.Context.instance(io_threads=server_io_threads(env))
        self.num_workers = env.num_workers
        self.tracer: trace.Tracer | None = None  # set at rendezvous where BYTEPS_TRACE_ON=1
        self.replies_address = f"inproc://bps-server-replies-{id(self)}"
        self.members: dict[bytes, int] = {}  # worker token -> node id (from WELCOME)
        self.left: dict[bytes, str] = {}  # a worker that left the job: token -> why
        self._queued = 0  # payload bytes in the engines' inboxes
        self._queued_lock = threading.Lock()
        # one engine thread: this thread serves its requests itself (set at rendezvous)
        self.inline: Requests | None = None

    def dequeued(self, payload: list[zmq.Frame] | None) -> None:
        """An engine took a request off its inbox (called from engine threads)."""
        if payload:
            with self._queued_lock:
                self._queued -= sum(len(frame) for frame in payload)

    def run(self) -> int:
        # parallelism comes from the engine threads; torch's own thread pool would only
        # add spinning OpenMP workers competing for the same cores
        torch.set_num_threads(1)
        keep_buffers_in_heap()
        key = load_key(self.env)
        guard = Guard(self.ctx, key)
        router = new_socket(self.ctx, zmq.ROUTER)
        router.setsockopt(zmq.MAXMSGSIZE, self.env.max_message_bytes)
        router.setsockopt(zmq.SNDHWM, PEER_QUEUE)
        router.setsockopt(zmq.RCVHWM, PEER_INBOUND)
        guard.serve(router)
        # one endpoint per I/O thread: each thread encrypts the connections of its own
        endpoints = bind_per_io_thread(router, self.env.node_host, self.ctx.get(zmq.IO_THREADS))
        address = endpoints[0]
        replies = new_socket(self.ctx, zmq.PULL)
        replies.bind(self.replies_address)
        link = SchedulerClient(self.ctx, self.env, "server", address, key=key,
                               endpoints=endpoints)
        log.info("server listening on %s (%s), waiting for the rendezvous", address,
                 "CURVE" if key is not None else "INSECURE: plain TCP")
        log.info("server at %s: %d ZeroMQ I/O thread(s), one endpoint each: ports %s", address,
                 len(endpoints), ", ".join(e.rsplit(":", 1)[1] for e in endpoints))
        engines: list[KeyEngine] = []
        if self.env.replaces_servers:
            # a spare may take a slot mid-job: numba's code generator (0.4 s and more, a
            # stall of the first step it serves) starts now, while the job starts
            load_soon(None, torch.float32)
        try:
            welcome = link.rendezvous()
            threads = self.env.server_threads or engine_threads(host_cores(),
                                                                welcome["servers"], address)
            self.num_workers = welcome["num_workers"]
            self.members = {bytes(token): node for node, token in enumerate(welcome["members"])}
            self.tracer = trace.from_env(self.env, f"server{welcome['node_id']}")
            engines += [KeyEngine(self, i) for i in range(threads)]
            if threads == 1:  # its replies go out on the ROUTER directly
                self.inline = Requests(engines[0].aggregator, router, self.env)
            log.info("server %d serving on %s, engine threads: %d", welcome["node_id"],
                     address, threads)
            if welcome.get("generation"):  # a replacement: the job's membership now
                self._membership({"generation": welcome["generation"],
                                  "members": welcome["present"],
                                  "msg": f"taking the place of server {welcome['node_id']}"},
                                 engines)
            for engine in engines if self.inline is None else ():
                engine.start()
            return self._loop(router, replies, link, engines)
        except StandbyOver as exc:
            log.info("spare server at %s stopping: %s", address, exc)
            return 0
        except ClusterError as exc:
            log.error("server at %s stopping: %s", address, exc)
            return 1
        except BaseException as exc:  # an exception, Ctrl-C, SIGTERM: say so, then go
            reason = failure_reason(exc)
            log.error("server at %s failed: %s", address, reason)
            if link.heard:  # the scheduler knows us: it names this server to everyone now
                try:
                    link.report_failure(reason, min(2.0, self.env.heartbeat_timeout))
                except Exception as report_exc:  # noqa: BLE001 - the heartbeat rule remains
                    log.warning("could not report the failure to the scheduler: %s",
                                report_exc)
            raise
        finally:
            started = [engine.thread for engine in engines if engine.thread is not None]
            for engine in engines:  # each ends after the requests already in its inbox
                engine.inbox.put(None)
            for thread in started:
                thread.join(timeout=5)
            link.close()
            replies.close()
            router.close()
            guard.close()
            if self.tracer is not None:
                self.tracer.save()
            log.info("server at %s: peak resident memory %.0f MB; ZeroMQ I/O threads' CPU "
                     "seconds: %s", address, peak_rss_mb(),
                     ", ".join(f"{s:.2f}" for s in io_thread_cpu_seconds()) or "n/a")

    def _loop(self, router: Any, replies: Any, link: SchedulerClient,
              engines: list[KeyEngine]) -> int:
        owner: dict[int, KeyEngine] = {}
        next_engine = LeastLoaded(engines)
        poller = zmq.Poller()
        # the scheduler's messages first: a membership change reaches the engines ahead
        # of the requests that arrived with it (a rollback by the new lowest member)
        for sock in (link.sock, router, replies):
            poller.register(sock, zmq.POLLIN)
        timeout_ms = int(self.env.heartbeat_interval * 1000)
        reading = True
        while True:
            # the engines are INBOX_BYTES behind: stop reading (ZeroMQ then stops reading
            # the connections) until they catch up; replies and heartbeats go on
            behind = self._queued > INBOX_BYTES
            if behind == reading:
                reading = not behind
                poller.modify(router, zmq.POLLIN if reading else 0)
            for sock, _ in poller.poll(timeout_ms if reading else 10):
                if sock is replies:
                    for frames in drain(replies):
                        send_message(router, frames, copy=False)
                elif sock is router:
                    for frames in drain(router):
                        self._dispatch(router, frames, owner, next_engine)
                        if self._queued > INBOX_BYTES:
                            break
                        if self.inline is not None:  # served here: heartbeats go on
                            link.tick()
                else:
                    header = link.receive()
                    if header["op"] == Op.SHUTDOWN:
                        log.info("shutdown requested by the scheduler")
                        return 0
                    if header["op"] == Op.MEMBERSHIP:
                        self._membership(header, engines)
                        # confirmed: a joiner's requests may come (their order after it
                        # is the inbox's)
                        link.send(Op.HEARTBEAT, generation=header["generation"])
            link.tick()

    def _membership(self, header: dict, engines: list[KeyEngine]) -> None:
        """Worker nodes left the job: their connections are refused from now on, and every
        engine thread learns the members after the requests already queued. A node that
        joins (``joined``: its node id and token) is a member from now on; the token of
        a node's earlier incarnation stays refused."""
        update_members(self.members, self.left, header)
        log.warning("membership generation %d: worker nodes %s (%s)", header["generation"],
                    sorted(set(header["members"])), header["msg"])
        if self.inline is not None:
            self.inline.membership(header["generation"], header["members"])
            return
        for engine in engines:
            engine.inbox.put((None, header, None))

    def _dispatch(self, router: Any, frames: list[zmq.Frame], owner: dict,
                  next_engine: Any) -> None:
        ident = frames[0].bytes
        peer = _peer(frames[-1])
        rid = -1
        try:
            if len(frames) < 2:
                raise ProtocolError("message without header frame")
            header = decode(frames[1].bytes)
            rid = header.get("rid", -1)
            payloads = frames[2:]
            check_request(ident, header, [len(frame) for frame in payloads], self.members,
                          self.env.max_message_bytes, self.left)
            header["peer"] = peer
            engine = owner.get(header["key"])
            if engine is None:
                if header["op"] != Op.REGISTER:
                    raise ProtocolError(f"key {header['key']}: unknown key (not declared)")
                engine = owner[header["key"]] = next_engine(header)
        except ProtocolError as exc:
            msg = error_text(str(exc))
            refusals.warning("refused a message from %s: %s", peer, msg)
            rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else -1
            send_message(router, [ident, encode(Op.ERROR, rid=rid, msg=msg)])
            return
        if self.inline is not None:
            self.inline.serve(ident, header, payloads or None)
            return
        if payloads:
            with self._queued_lock:
                self._queued += sum(len(frame) for frame in payloads)
        engine.inbox.put((ident, header, payloads or None))


def server_io_threads(env: ClusterEnv) -> int:
    """``BPS_IO_THREADS``, else one per connection the workers open (``num_workers *
    BPS_CONNECTIONS_PER_SERVER``, the workers' default where not set) up to this
    server's share of the host's cores (:mod:`bps.common.striping`), and at least two (where
    it holds two connections) as before striping."""
    if env.io_threads is not None:
        return env.io_threads
    cores = host_cores()
    worker_share, share = core_shares(cores, env.num_workers, env.num_servers,
                                      env.on_one_host)
    if not env.on_one_host:
        worker_share = cores  # the workers' hosts are not known here: as large as ours
    per_worker = env.connections_per_server or default_connections(worker_share, env.num_servers)
    connections = env.num_workers * per_worker
    return max(min(2, connections), io_threads(share, connections))


def _peer(frame: zmq.Frame) -> str:
    """The IP address a message came from (ZeroMQ's Peer-Address property)."""
    try:
        return frame.get("Peer-Address") or "?"
    except zmq.ZMQError:
        return "?"


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_server(env: ClusterEnv) -> int:
    """Run one parameter server until the scheduler shuts the job down."""
    return ParameterServer(env).run()
