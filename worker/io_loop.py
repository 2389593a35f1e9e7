"""The worker engine's I/O thread: the one owner of every socket of a worker node.

It holds ``BPS_CONNECTIONS_PER_SERVER`` connections to each server in a context of its
own with ``BPS_IO_THREADS`` I/O threads (:mod:`bps.common.striping`: libzmq encrypts each
connection in one I/O thread), each key on one of them so its requests stay in order.
It sends control requests (declare, state, barrier) ahead of data, pushes as their
server's send credit allows (:class:`~bps.worker.send_queues.SendQueues`), matches
replies to requests, heartbeats the scheduler and fails every pending request with a
:class:`bps.common.protocol.ClusterError` on a timeout, a dead peer or a lost scheduler.
Where the scheduler says a server slot is served by a replacement (``REPLACED``,
``BPS_SPARE_SERVERS``), it connects that slot to the replacement, declares the slot's
keys there again with the last answer it got of each (``LAST``) and sends again every
request the dead server had not answered::

    loop = IOLoop(env, ctx, link, servers, node_id, keys, count, tracer, pool.decompress)
    future = loop.request(Op.REGISTER, server, fields, None, "declare of key 0", info)
    loop.enqueue(info, payload, step, lr, order, future)      # a push
    loop.add_reader(sock.fileno(), on_readable)   # called on the I/O thread
    loop.stop(); loop.close()
"""

from __future__ import annotations

import collections
import concurrent.futures
import fcntl
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from bps.common.auth import ClusterKey, HandshakeWatch, connect_as_client
from bps.common.env import ClusterEnv
from bps.common.protocol import (
    ClusterError,
    Op,
    PeerFailure,
    ProtocolError,
    RemoteError,
    check_payload,
    decode,
    drain,
    dtype_name,
    encode,
    join_frames,
    new_socket,
    payload_frames,
    send_message,
    server_seconds,
)
from bps.common.scheduler_client import SchedulerClient
from bps.common.striping import (
    Stripes,
    affinity_mask,
    core_shares,
    default_connections,
    host_cores,
    io_threads,
    is_loopback,
    pinned_connection,
)
from bps.common.trace import Tracer
from bps.compressors.base import MultiRound
from bps.worker.send_queues import (
    KeyInfo,
    Request,
    SendQueues,
    Skipped,
    info_label,
    new_future,
    settle,
    trace_stage,
)

log = logging.getLogger("bps.engine")
# a DATA reply's fields that make it a skip (bps.common.protocol)
SKIP_FIELDS = ("skip", "skip_node", "skip_what", "generation", "members")


def _membership(header: dict) -> tuple[int, tuple[int, ...]]:
    """A membership skip's (generation, members); (0, ()) where it carries none."""
    generation, members = header.get("generation", 0), header.get("members", [])
    if type(generation) is not int or not isinstance(members, list) \
            or not all(type(n) is int for n in members):
        raise ProtocolError("DATA: a skip's fields 'generation' and 'members' must be an "
                            "int and a list of ints")
    return generation, tuple(members)


def striping(env: ClusterEnv, servers: list[str]) -> tuple[int, int]:
    """(connections per server, I/O threads) of a worker node: ``BPS_CONNECTIONS_PER_SERVER``
    and ``BPS_IO_THREADS``, else from its share of the host's cores (:mod:`bps.common.striping`)."""
    beside = sum(1 for a in servers
                 if a.split("://", 1)[-1].rsplit(":", 1)[0] == env.node_host or is_loopback(a))
    share, _ = core_shares(host_cores(), env.num_workers, len(servers), env.on_one_host,
                           beside)
    connections = env.connections_per_server or default_connections(share, len(servers))
    threads = env.io_threads or io_threads(share, connections * len(servers))
    return connections, threads


class IOLoop:
    """Sockets, pending requests and the thread that serves them; ``lock`` guards the
    queues and the keys' ``busy`` flags."""

    def __init__(self, env: ClusterEnv, ctx: Any, link: SchedulerClient, servers: list[str],
                 node_id: int, keys: dict[int, KeyInfo], count: Callable[..., None],
                 tracer: Tracer | None,
                 decode_reply: Callable[[Request, list[zmq.Frame]], None],
                 key: ClusterKey | None = None,
                 endpoints: list[list[str]] | None = None) -> None:
        self.env = env
        self.node_id = node_id
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.closed = False
        self._keys = keys
        self._count = count
        self._tracer = tracer
        self._decode_reply = decode_reply
        self._link = link
        # the membership the pushes carry: the job's first (0), until a skip of a step
        # dropped for a membership change names a later one
        self.generation = 0
        # (step, generation): the later pushes of the step whose skip named a new
        # generation, and of earlier steps, still carry the one before (below)
        self._until: tuple[int, int] | None = None
        self.members: tuple[int, ...] = tuple(range(env.num_workers))
        self.announced = 0  # the latest generation the scheduler announced
        self.connections, self.io_threads = striping(env, servers)
        # its own context: I/O threads are fixed when a context's first socket is made
        self._data_ctx = zmq.Context(io_threads=self.io_threads)
        self.stripes = Stripes(len(servers), self.connections)
        self._dealers: list[list[Any]] = []  # [server][connection]
        self._server_of: dict[Any, int] = {}
        self._where: dict[Any, str] = {}  # a connection as errors name it
        self._watch = HandshakeWatch(env, "worker")
        self._key = key
        # key -> (server, REGISTER fields) of every declared key: a replacement server
        # gets them again
        self._registered: dict[int, tuple[int, dict]] = {}
        # key -> (step, skip fields or None, payload bytes) of the last answer to a push,
        # kept where servers may be replaced (BPS_SPARE_SERVERS): a replacement gets it
        self._last: dict[int, tuple[int, dict | None, bytes]] = {}
        self._poller: Any = None  # the I/O thread's
        try:
            for server, address in enumerate(servers):
                self._dealers.append(self._connect(
                    server, endpoints[server] if endpoints else [address]))
        except BaseException:  # an endpoint libzmq refuses: nothing of ours stays open
            self._watch.close()
            for dealer in self._server_of:
                dealer.close(linger=0)
            self._data_ctx.term()
            raise
        log.info("node %d: %d connection(s) to each of %d server(s), %d ZeroMQ I/O "
                 "thread(s)", node_id, self.connections, len(servers), self.io_threads)
        self._stopping = False
        self._rids = itertools.count()
        self._control: collections.deque = collections.deque()
        self._queues = SendQueues(len(servers), env.max_inflight)
        self._pending: dict[int, Request] = {}
        self._scheduler_waiters: dict[tuple, concurrent.futures.Future] = {}
        self._busy_since = 0.0
        self._pushes_pending = 0
        self._readers: dict[int, Callable[[], None]] = {}  # fd -> called when readable
        self._new_readers: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        self._woken = False  # a wake is written and the I/O thread has not taken it yet
        self._again = False  # the I/O thread queued work for itself: poll without waiting
        for fd in (self._wake_r, self._wake_w):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="bps-engine-io", daemon=True)
        self._thread.start()

    def _connect(self, server: int, ends: list[str]) -> list[Any]:
        """Open this node's connections to ``server`` (its endpoints ``ends``), each
        pinned to one of our I/O threads and dealt over the server's endpoints."""
        dealers = []
        for stripe in range(self.connections):
            dealer = new_socket(self._data_ctx, zmq.DEALER)
            self._server_of[dealer] = server
            # the token prefix makes this connection this node's on the server
            dealer.setsockopt(zmq.ROUTING_ID, self._link.token + b"engine%d" % stripe)
            connect_as_client(dealer, self._key)
            end, thread = pinned_connection(self.node_id, server, stripe, self.connections,
                                            len(ends), self.io_threads)
            dealer.setsockopt(zmq.AFFINITY, affinity_mask(thread))
            self._where[dealer] = f"server {server} ({ends[end]}" + (
                f", connection {stripe + 1} of {self.connections})" if self.connections > 1
                else ")")
            self._watch.add(dealer, self._where[dealer])
            dealer.connect(ends[end])
            dealers.append(dealer)
        return dealers

    def _replaced(self, header: dict) -> None:
        """Server slot ``header["server"]`` is served by a replacement (the scheduler's
        REPLACED): its connections go there, its keys are declared there again with
        their last answers (for a node that missed one), and the requests the dead server
        left unanswered are sent again, in their order, after
        them. A push of the step in flight carries the generation before the change, so
        the servers answer that step with a ``"membership"`` skip on every node."""
        slot = header["server"]
        if not 0 <= slot < len(self._dealers) or not header["endpoints"]:
            log.warning("node %d: REPLACED names server %d of %d", self.node_id, slot,
                        len(self._dealers))
            return
        for dealer in self._dealers[slot]:
            for monitor in self._watch.forget(dealer):
                self._poller.unregister(monitor)
            self._poller.unregister(dealer)
            del self._server_of[dealer]
            dealer.close(linger=0)
        watched = set(self._watch.sockets())
        self._dealers[slot] = self._connect(slot, header["endpoints"])
        for sock in [*self._dealers[slot], *(set(self._watch.sockets()) - watched)]:
            self._poller.register(sock, zmq.POLLIN)
        unanswered = sorted((r for r in self._pending.values() if r.server == slot),
                            key=lambda r: r.rid)
        declaring = {r.fields["key"] for r in unanswered if r.op == Op.REGISTER}
        again = [(key, fields_) for key, (server, fields_) in self._registered.items()
                 if server == slot and key not in declaring]
        log.warning("node %d: %s; %d key(s) declared there again, %d request(s) sent again",
                    self.node_id, header["msg"], len(again), len(unanswered))
        for key, fields_ in again:  # no KeyInfo: settling these must not free the key
            what = f"key {key} ({fields_['name']!r}) on the replacement of server {slot}"
            future = new_future()
            future.add_done_callback(self._redeclared)
            self._send(Request((), -1, Op.REGISTER, slot, fields_, None, future,
                               f"declare of {what}", None))
            if key in self._last:  # the dead server's last answer: for a node that missed it
                step, skip, body = self._last[key]
                future = new_future()
                future.add_done_callback(self._redeclared)
                self._send(Request((), -1, Op.LAST, slot,
                                   {"key": key, "step": step, "skip": skip,
                                    "nbytes": len(body)}, body, future,
                                   f"last answer of {what}", None))
        for request in unanswered:
            del self._pending[request.rid]
            self._send(request)

    def _redeclared(self, future: concurrent.futures.Future) -> None:
        """A key declared again on a replacement server: an error there is logged (the
        key's next push then fails, naming it)."""
        error = future.exception()
        if error is not None and self.error is None:
            log.error("node %d: %s", self.node_id, error)

    # ------------------------------------------------------------------ callers' side

    def next_rid(self) -> int:
        """A fresh sequence number (request ids and arrival order share one counter)."""
        return next(self._rids)

    def told_by_scheduler(self) -> bool:
        """Whether the failure that stopped this loop came from the scheduler (a peer
        died or failed), which then needs no report from this node."""
        return isinstance(self.error, PeerFailure)

    def report_failure(self, reason: str, timeout: float) -> None:
        """Send FAILED to the scheduler and wait (up to ``timeout``) for its BYE, which
        says the report arrived; through the I/O thread while it runs, else directly."""
        if self._thread.is_alive():
            future = new_future()
            self._control.append((Op.FAILED, (Op.BYE,), {"msg": reason}, future))
            self._wake()
            future.result(timeout=timeout)
            return
        self._link.report_failure(reason, timeout)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error
        if self.closed:
            raise ClusterError("engine closed")

    def request(self, op: Op, server: int, fields_: dict, payload: Any, what: str,
                info: KeyInfo | None) -> concurrent.futures.Future:
        """Queue a control request to a server (sent ahead of data, no credit limit)."""
        self.raise_if_failed()
        future = new_future()
        self._control.append(Request((), -1, op, server, fields_, payload, future, what, info))
        return self._wake_or_fail(future)

    def scheduler_request(self, op: Op, reply: tuple, **fields: Any
                          ) -> concurrent.futures.Future:
        """Send ``op`` to the scheduler; the future resolves when ``reply`` arrives."""
        self.raise_if_failed()
        future = new_future()
        self._control.append((op, reply, fields, future))
        return self._wake_or_fail(future)

    def push_generation(self, step: int) -> int:
        """The membership generation a push of ``step`` carries where its caller names
        none: the one its step began with. A skip that names a new generation may come
        back while keys of the same step are still to be pushed; were those to carry the
        new one, a server would count a joined node in a step the joiner never pushes,
        and wait for it. Call with ``lock`` held."""
        until = self._until
        if until is None:
            return self.generation
        if step <= until[0]:
            return until[1]
        self._until = None  # a later step began: every push carries the new one
        return self.generation

    def set_generation(self, generation: int, members: tuple[int, ...]) -> None:
        """Push with membership ``generation`` from now on, in every step (a joiner's)."""
        with self.lock:
            self.generation, self.members, self._until = generation, members, None

    def enqueue(self, info: KeyInfo, payload: torch.Tensor, step: int, lr: float,
                order: tuple, future: concurrent.futures.Future, extra: dict | None = None
                ) -> None:
        """Queue a push of ``payload`` for ``info``'s server, in ``order``; ``extra``:
        more header fields (a marker's ``mark`` and ``what``)."""
        body = memoryview(payload.numpy() if payload.dtype == torch.uint8  # a payload
                          else payload.view(torch.uint8).numpy())
        fields_ = {"key": info.key, "step": step, "node": self.node_id,
                   "dtype": dtype_name(info.dtype), "numel": info.numel, "nbytes": body.nbytes,
                   "lr": float(lr), **(extra or {})}
        if info.generation:  # the membership this push was divided for
            fields_["gen"] = info.generation
        request = Request(order, -1, Op.PUSH, info.server, fields_, body, future,
                          f"push_pull of {info_label(info)} step {step}", info,
                          queued_ns=time.monotonic_ns())
        with self.lock:
            if self.error is not None:
                settle(info, future, error=self.error)
                return
            self._queues.put(info.server, order, request)
        self._wake()

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the I/O thread whenever ``fd`` is readable, before the
        pushes it queued are sent (the node agent reads its training process's frames
        so: no thread hands each key to the next). ``callback`` must not block, nor
        raise; :meth:`remove_reader` (on the I/O thread) stops it."""
        self._new_readers.append((fd, callback))
        self._wake()

    def remove_reader(self, fd: int) -> None:
        """Stop calling the reader of ``fd`` (on the I/O thread, from its callback)."""
        self._new_readers.append((fd, None))

    def flush(self) -> None:
        """Send the pushes queued so far, now (on the I/O thread only, from a reader's
        callback: its first push leaves before it makes the next)."""
        if self._queues.waiting and threading.get_ident() == self._thread.ident:
            self._send_queued()

    @property
    def running(self) -> bool:
        """Whether the I/O thread is still serving (not stopped, not failed)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop the thread and fail whatever is still pending with "engine closed"."""
        self.closed = True
        self._stopping = True
        self._wake()
        self._thread.join(timeout=max(5.0, 2 * self.env.heartbeat_interval))
        self.fail(ClusterError("engine closed"))

    def close(self) -> None:
        """Close the sockets and the wake-up pipe (after :meth:`stop`)."""
        self._watch.close()
        for dealers in self._dealers:
            for sock in dealers:
                sock.close()
        self._data_ctx.term()
        self._link.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def fail(self, error: ClusterError) -> None:
        """Fail every pending and queued request with ``error`` (the first error sticks)."""
        with self.lock:
            if self.error is None and not (self.closed and str(error) == "engine closed"):
                self.error = error
            error = self.error or error
            requests = list(self._pending.values()) + self._queues.clear()
            self._pending.clear()
            control = list(self._control)
            self._control.clear()
            waiters = list(self._scheduler_waiters.values())
            self._scheduler_waiters.clear()
        requests += [c for c in control if isinstance(c, Request)]
        waiters += [c[3] for c in control if not isinstance(c, Request)]
        for request in requests:
            settle(request.info, request.future, error=error)
        for future in waiters:
            settle(None, future, error=error)
        for info in list(self._keys.values()):
            info.busy = False

    def _wake(self) -> None:
        """Wake the I/O thread, unless a wake it has not taken yet is on its way (a write
        lets go of the GIL, which beside a busy thread can cost milliseconds), or this is
        the I/O thread, which sends what was queued before it polls again."""
        if threading.get_ident() == self._thread.ident:
            self._again = True  # the next poll does not wait
            return
        if self._woken:
            return
        self._woken = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # closed: the loop has stopped

    def _wake_or_fail(self, future: concurrent.futures.Future) -> concurrent.futures.Future:
        self._wake()
        if self.error is not None:  # the I/O thread may have stopped before our append
            settle(None, future, error=self.error)
        return future

    # ------------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._link.sock, zmq.POLLIN)
        for dealer in self._server_of:
            poller.register(dealer, zmq.POLLIN)
        for monitor in self._watch.sockets():
            poller.register(monitor, zmq.POLLIN)
        timeout_ms = max(1, int(self.env.heartbeat_interval * 1000))
        next_check = 0.0
        try:
            while not self._stopping:
                ready = dict(poller.poll(0 if self._again else timeout_ms))
                self._again = False
                if self._wake_r in ready:
                    try:  # one read takes the few bytes there (a failed read costs the GIL)
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    # after the read, which may take the byte of a wake asked meanwhile;
                    # what that wake queued is sent below, and later wakes write again
                    self._woken = False
                if self._watch.watching():  # raises if a server refused our key
                    for monitor in self._watch.check(ready):
                        poller.unregister(monitor)
                self._send_control()
                for dealer in ready:
                    server = self._server_of.get(dealer)
                    if server is not None:
                        self._receive_replies(server, dealer)
                while self._new_readers:
                    fd, callback = self._new_readers.popleft()
                    if callback is None:
                        if self._readers.pop(fd, None) is not None:
                            poller.unregister(fd)
                        continue
                    if fd not in self._readers:
                        poller.register(fd, zmq.POLLIN)
                    self._readers[fd] = callback
                for fd, callback in list(self._readers.items()):
                    if fd in ready:
                        callback()
                self._send_queued()
                if self._link.sock in ready:
                    while self._link.sock.poll(0):
                        self._on_scheduler(self._link.receive())
                self._link.tick()
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + min(1.0, self.env.heartbeat_interval)
                    self._check_deadlines(now)
        except ClusterError as exc:
            log.error("node %d: %s", self.node_id, exc)
            self.fail(exc)
        except Exception as exc:
            log.exception("engine I/O thread failed")
            self.fail(ClusterError(f"engine I/O thread failed: {type(exc).__name__}: {exc}"))

    def _send(self, request: Request) -> None:
        request.rid = self.next_rid()
        header = encode(request.op, rid=request.rid, **request.fields)
        request.deadline = time.monotonic() + self.env.timeout
        request.sent_ns = time.monotonic_ns()
        trace_stage(self._tracer, "queued", request, request.queued_ns, request.sent_ns)
        self._pending[request.rid] = request
        dealer = self._dealer(request)
        if request.payload is None:
            dealer.send(header)
            size = 0
        else:
            body = memoryview(request.payload)
            # frames of BPS_FRAME_BYTES: libzmq's CURVE encrypts smaller frames faster
            frames = payload_frames(body, self.env.frame_bytes)
            send_message(dealer, [header, *frames], copy=False)
            size = body.nbytes
        self._count(bytes_pushed=len(header) + size)

    def _dealer(self, request: Request) -> Any:
        """The connection of the request's key to its server (the same one every time)."""
        info = request.info
        nbytes = info.numel * info.dtype.itemsize if info is not None else 0
        stripe = self.stripes.of(request.server, request.fields["key"], nbytes)
        return self._dealers[request.server][stripe]

    def _send_control(self) -> None:
        while self._control:
            item = self._control.popleft()
            if isinstance(item, Request):
                self._send(item)
            else:
                op, reply, fields_, future = item
                self._scheduler_waiters[reply] = future
                self._link.send(op, **fields_)

    def _send_queued(self) -> None:
        with self.lock:
            ready = self._queues.take()
        for request in ready:
            if self._pushes_pending == 0:
                self._busy_since = time.perf_counter()
            self._pushes_pending += 1
            self._send(request)

    def _receive_replies(self, server: int, dealer: Any) -> None:
        pulled = 0  # bytes not counted yet: an ACK's wait for the next reply's count
        for frames in drain(dealer):
            pulled = self._receive_reply(server, dealer, frames,
                                         pulled + sum(map(len, frames)))
        if pulled:
            self._count(bytes_pulled=pulled)

    def _receive_reply(self, server: int, dealer: Any, frames: list, pulled: int) -> int:
        """Handle one reply of ``server``, ``pulled`` bytes not counted yet with it; returns
        those still not counted (a reply that settles a future counts them first, in one
        locked call with the server's seconds)."""
        try:
            header = decode(frames[0].bytes)
        except ProtocolError as exc:
            log.warning("server %d sent a malformed reply: %s", server, exc)
            return pulled
        request = self._pending.get(header.get("rid"))
        if request is None:
            log.warning("server %d: unmatched %s: %s", server, header["op"].name,
                        header.get("msg", ""))
            return pulled
        if request.op == Op.PUSH and not request.acked:
            # the server has the push: its credit frees, whatever other workers do
            request.acked = True
            request.acked_ns = time.monotonic_ns()
            trace_stage(self._tracer, "push", request, request.sent_ns, request.acked_ns,
                        bytes=request.fields["nbytes"])
            with self.lock:
                self._queues.release(server)
        if header["op"] == Op.ACK:
            return pulled
        del self._pending[request.rid]
        if request.op == Op.PUSH:
            trace_stage(self._tracer, "aggregate", request, request.acked_ns,
                        time.monotonic_ns(), bytes=header.get("nbytes", 0))
            self._count(bytes_pulled=pulled, server_s=server_seconds(header))
            self._pushes_pending -= 1
            if self._pushes_pending == 0:
                self._count(comm_s=time.perf_counter() - self._busy_since)
        else:
            self._count(bytes_pulled=pulled)
        self._on_reply(request, header, frames[1:], self._where[dealer])
        return 0

    def _on_reply(self, request: Request, header: dict, payloads: list, where: str) -> None:
        op = header["op"]
        info, future = request.info, request.future
        if op == Op.ERROR:
            settle(info, future, error=RemoteError(f"{where}: {header['msg']}"))
            return
        if op == Op.OK:
            if request.op == Op.REGISTER:  # a replacement server gets it again
                self._registered[request.fields["key"]] = (request.server, request.fields)
            settle(info, future, None)
            return
        try:
            if op != Op.DATA:
                raise ProtocolError(f"op {op.name}")
            check_payload("DATA", header["nbytes"], [len(frame) for frame in payloads])
        except ProtocolError as exc:
            settle(info, future, error=ClusterError(f"{request.what}: malformed reply "
                                                    f"{op.name} from {where}: {exc}"))
            return
        if request.op == Op.GET_STATE:
            settle(info, future, join_frames(payloads).tobytes() if len(payloads) > 1
                   else payloads[0].bytes)
            return
        if self.env.replaces_servers and request.op == Op.PUSH:  # a copy: decoded in place
            skip = {f: header[f] for f in SKIP_FIELDS if f in header} or None
            self._last[request.fields["key"]] = (
                header["step"], skip, b"".join(frame.bytes for frame in payloads))
        if "skip" in header:  # the server did not sum this step
            self._count(pushes=1)
            skipped = Skipped(str(header["skip"]), int(header.get("skip_node", -1)),
                              str(header.get("skip_what", "")), info_label(info),
                              *_membership(header))
            if skipped.generation > self.generation:  # later pushes divide by the members
                with self.lock:
                    step, before = header["step"], self.generation
                    if self._until is not None:  # two changes in one step: the first counts
                        step, before = max(step, self._until[0]), self._until[1]
                    self._until = (step, before)
                    self.generation, self.members = skipped.generation, skipped.members
                log.warning("node %d: membership generation %d, worker nodes %s",
                            self.node_id, self.generation, list(self.members))
                for other in list(self._keys.values()):  # powersgd: e = M - P Q^T / W
                    if isinstance(other.chain, MultiRound):
                        other.chain.set_workers(len(self.members))
            settle(info, future, skipped)
        elif info.chain is not None or info.staging is not None:  # decoded on a codec thread
            self._decode_reply(request, payloads)
        elif header["nbytes"] != info.numel * info.dtype.itemsize:
            settle(info, future, error=ClusterError(
                f"{request.what}: {where} answered {header['nbytes']} bytes"))
        else:
            if not info.numel:
                result = torch.zeros(0, dtype=info.dtype)
            elif len(payloads) == 1:  # zero-copy: a view of the frame
                result = torch.frombuffer(payloads[0].buffer, dtype=info.dtype)
            else:  # several frames: joined into a new tensor, one copy
                result = torch.empty(info.numel, dtype=info.dtype)
                join_frames(payloads, result.view(torch.uint8).numpy())
            self._count(pushes=1)
            settle(info, future, result)

    def _on_scheduler(self, header: dict) -> None:
        op = header["op"]
        if op == Op.MEMBERSHIP:  # the servers answer the step in flight with its skip
            self.announced = max(self.announced, header["generation"])
            log.warning("node %d: %s", self.node_id, header["msg"])
            return
        if op == Op.REPLACED:
            self.announced = max(self.announced, header["generation"])
            self._replaced(header)
            return
        reply = (op, header["seq"]) if op == Op.RELEASE else \
            (op, header["offset"]) if op == Op.STATE else (op,)
        future = self._scheduler_waiters.pop(reply, None)
        if future is not None:
            future.set_result(header)
        elif op == Op.BYE:
            pass
        elif op != Op.HEARTBEAT:
            log.warning("unexpected scheduler message %s", op.name)

    def _check_deadlines(self, now: float) -> None:
        for request in self._pending.values():
            if now > request.deadline:
                raise ClusterError(
                    f"{request.what}: no reply from {self._where[self._dealer(request)]} "
                    f"within {self.env.timeout:g} s (BPS_TIMEOUT)")
