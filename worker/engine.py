"""The worker engine: push/pull of partitions to the parameter servers.

Usage (local rank 0 of a worker node)::

    from bps.env import ClusterEnv
    from bps.worker.engine import WorkerEngine

    engine = WorkerEngine.connect(ClusterEnv.from_environ())   # rendezvous
    engine.declare(0, 1000, torch.float32, None, name="fc.bias")   # raw key
    engine.declare(1, 10**6, torch.float32, {"compressor": "onebit", ...}, name="fc.weight[0]")
    fut = engine.push_pull(1, grad_part, step=0, lr=0.1, priority=-1)
    averaged = fut.result()     # 1-D tensor, declared dtype: the decompressed aggregate
    engine.barrier()
    engine.close()

One I/O thread owns every socket (one DEALER per server, the scheduler link); a small
thread pool runs the compressor chains (numba kernels release the GIL). Each server has
at most ``BPS_MAX_INFLIGHT`` pushes not yet acknowledged (the server ACKs a push as soon
as its header checks pass, before it is summed in node order, so the credit never waits
on other workers and cannot deadlock; a push that then fails to decode gets an ERROR); the
rest wait in a per-server queue ordered by (step, -priority, arrival), so a larger
``priority`` goes out first (give the partitions needed first by the next forward pass
the largest priority).

A push is answered by the step's aggregate once every worker node pushed that step.
The tensor handed to ``push_pull`` must not be modified until its future resolves
(raw keys are sent straight from its memory). At most one push_pull per key may be in
flight. Every request has a ``BPS_TIMEOUT`` deadline; a timeout, a dead peer or a lost
scheduler fails every pending future with a :class:`bps.protocol.ClusterError` naming
the key, server or peer, and every later call raises it again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import fcntl
import heapq
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack
import torch
import zmq

from bps.env import ClusterEnv
from bps.memory import keep_buffers_in_heap
from bps.protocol import (
    ClusterError,
    Op,
    ProtocolError,
    RemoteError,
    decode,
    dtype_name,
    encode,
    new_socket,
)
from bps.server.scheduler import SchedulerClient
from bps.trace import Tracer
from bps.worker.partition import Placement

log = logging.getLogger("bps.engine")

MAX_KEY = 2**63
CODEC_THREADS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class EngineStats:
    """Cumulative counters; subtract two snapshots for per-step deltas.

    ``bytes_pushed`` / ``bytes_pulled``: header + payload bytes sent to / received from
    servers. ``compress_s`` / ``decompress_s``: seconds spent in the worker chains (summed
    over codec threads). ``comm_s``: wall seconds during which at least one push was in
    flight. ``pushes``: completed push_pulls.
    """

    bytes_pushed: int = 0
    bytes_pulled: int = 0
    compress_s: float = 0.0
    decompress_s: float = 0.0
    comm_s: float = 0.0
    pushes: int = 0

    def __sub__(self, other: EngineStats) -> EngineStats:
        return EngineStats(*(getattr(self, f.name) - getattr(other, f.name)
                             for f in fields(self)))


@dataclass
class _KeyInfo:
    key: int
    numel: int
    dtype: torch.dtype
    name: str
    server: int
    chain: Any
    busy: bool = False
    out: torch.Tensor | None = None  # where the in-flight push_pull decodes its aggregate


@dataclass(order=True)
class _Request:
    order: tuple
    rid: int = field(compare=False)
    op: Op = field(compare=False)
    server: int = field(compare=False)
    fields: dict = field(compare=False)
    payload: Any = field(compare=False)
    future: concurrent.futures.Future = field(compare=False)
    what: str = field(compare=False)
    info: _KeyInfo | None = field(compare=False, default=None)
    deadline: float = field(compare=False, default=0.0)
    acked: bool = field(compare=False, default=False)
    # monotonic_ns of its stages, for the timeline (bps.trace)
    queued_ns: int = field(compare=False, default=0)
    sent_ns: int = field(compare=False, default=0)
    acked_ns: int = field(compare=False, default=0)


def _new_future() -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()  # not cancellable: the I/O thread resolves it
    return future


def send_order(step: int, priority: int, seq: int) -> tuple[int, int, int]:
    """Sort key of waiting pushes: earlier steps, then larger priority, then arrival."""
    return (step, -priority, seq)


class SendQueues:
    """Per-server queues of pushes waiting for send credit; not thread-safe (the engine
    holds its lock). ``take`` hands out, per server, the waiting items of smallest
    ``order`` while fewer than ``credit`` are unacknowledged; ``release`` returns a credit.

        queues = SendQueues(num_servers=1, credit=1)
        queues.put(0, item_a); queues.take()      # -> [item_a]; the credit is used
        queues.put(0, item_b); queues.put(0, item_c)
        queues.release(0); queues.take()          # -> [min(item_b, item_c)]
    """

    def __init__(self, num_servers: int, credit: int) -> None:
        self.credit = credit
        self.heaps: list[list] = [[] for _ in range(num_servers)]
        self.unacked = [0] * num_servers

    def put(self, server: int, item: Any) -> None:
        heapq.heappush(self.heaps[server], item)

    def take(self) -> list:
        ready = []
        for server, heap in enumerate(self.heaps):
            while heap and self.unacked[server] < self.credit:
                ready.append(heapq.heappop(heap))
                self.unacked[server] += 1
        return ready

    def release(self, server: int) -> None:
        self.unacked[server] -= 1

    def clear(self) -> list:
        items = [item for heap in self.heaps for item in heap]
        for heap in self.heaps:
            heap.clear()
        return items


class WorkerEngine:
    """Push/pull engine of one worker node; create it with :meth:`connect`."""

    def __init__(self, env: ClusterEnv, ctx: Any, link: SchedulerClient, welcome: dict,
                 tracer: Tracer | None = None) -> None:
        self.env = env
        self.tracer = tracer
        self.node_id: int = welcome["node_id"]
        self.num_workers: int = welcome["num_workers"]
        self.num_servers: int = welcome["num_servers"]
        self.job_seed: int = welcome["seed"]
        self.servers: list[str] = list(welcome["servers"])
        self.placement = Placement(self.num_servers)
        self._link = link
        self._dealers = []
        for address in self.servers:
            dealer = new_socket(ctx, zmq.DEALER)
            dealer.connect(address)
            self._dealers.append(dealer)
        self._keys: dict[int, _KeyInfo] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        self._stopping = False
        self._rids = itertools.count()
        self._barrier_seq = itertools.count()
        self._control: collections.deque = collections.deque()
        self._queues = SendQueues(self.num_servers, env.max_inflight)
        self._pending: dict[int, _Request] = {}
        self._scheduler_waiters: dict[tuple, concurrent.futures.Future] = {}
        self._stats_lock = threading.Lock()
        self._stats = {f.name: f.default for f in fields(EngineStats)}
        self._busy_since = 0.0
        self._pushes_pending = 0
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self._pool = concurrent.futures.ThreadPoolExecutor(CODEC_THREADS, "bps-codec")
        self._io = threading.Thread(target=self._run, name="bps-engine-io", daemon=True)
        self._io.start()

    @classmethod
    def connect(cls, env: ClusterEnv, ctx: Any = None, tracer: Tracer | None = None
                ) -> WorkerEngine:
        """Rendezvous with the scheduler (blocks up to ``BPS_TIMEOUT``) and start the engine.
        ``tracer``: records each partition's stages (:mod:`bps.trace`)."""
        if env.role != "worker":
            raise ValueError(f"WorkerEngine needs DMLC_ROLE=worker, got {env.role!r}")
        ctx = ctx or zmq.Context.instance()
        keep_buffers_in_heap()
        link = SchedulerClient(ctx, env, "worker", env.node_host)
        try:
            welcome = link.rendezvous()
        except BaseException:
            link.close()
            raise
        return cls(env, ctx, link, welcome, tracer)

    # ------------------------------------------------------------------ public API

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the cumulative counters (see :class:`EngineStats`)."""
        with self._stats_lock:
            return EngineStats(**self._stats)

    def declare(self, key: int, numel: int, dtype: torch.dtype, params: dict | None,
                name: str = "", server: int | None = None) -> None:
        """Register ``key`` with its server (blocking). ``params`` None: raw key.
        ``server``: the server index to hold it (``plan_servers``; every worker must
        pass the same), else the least-loaded one by raw bytes in declaration order.

        Raises ValueError for bad arguments, RemoteError when the server refuses (for
        instance another worker declared the key with a different numel/dtype/params).
        """
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < MAX_KEY:
            raise ValueError(f"key {key!r} ({name!r}): keys are ints in [0, 2**63)")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"key {key} ({name!r}): numel={numel!r} must be an int >= 0")
        wire_dtype = dtype_name(dtype)
        if key in self._keys:
            raise ValueError(f"key {key} ({name!r}) declared twice")
        chain = None
        if params is not None:
            from bps.compressors import build

            chain = build(params, numel, dtype, role="worker")
        server = self.placement.place(key, numel * dtype.itemsize, server)
        info = _KeyInfo(key, numel, dtype, name, server, chain)
        fields_ = {"key": key, "numel": numel, "dtype": wire_dtype, "name": name,
                   "params": params, "node": self.node_id}
        try:
            self._wait(self._request(Op.REGISTER, server, fields_, None,
                                     f"declare of {info_label(info)}", info),
                       f"declare of {info_label(info)}")
        except BaseException:
            self.placement.unplace(key, numel * dtype.itemsize)
            raise
        self._keys[key] = info

    def push_pull(self, key: int, tensor: torch.Tensor, step: int, lr: float,
                  priority: int = 0, out: torch.Tensor | None = None
                  ) -> concurrent.futures.Future:
        """Push this node's (already averaged) partition; the future gives the aggregate.

        ``out`` (compressed keys): a contiguous CPU tensor of the declared numel and dtype,
        ``tensor`` itself allowed, into which the aggregate is decoded (no new tensor);
        the future then gives ``out``."""
        info = self._keys.get(key)
        if info is None:
            raise ValueError(f"key {key}: push_pull before declare")
        flat = tensor.reshape(-1)
        if flat.numel() != info.numel or flat.dtype != info.dtype:
            raise ValueError(f"{info_label(info)}: tensor has numel={flat.numel()} dtype="
                             f"{flat.dtype}, declared numel={info.numel} dtype={info.dtype}")
        if out is not None and (info.chain is None or out.numel() != info.numel
                                or out.dtype != info.dtype or out.device.type != "cpu"
                                or not out.is_contiguous()):
            raise ValueError(f"{info_label(info)}: out must be a contiguous CPU tensor of "
                             f"numel={info.numel} dtype={info.dtype}, for a compressed key")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{info_label(info)}: step={step!r} must be an int >= 0")
        self._raise_if_failed()
        with self._lock:
            if info.busy:
                raise RuntimeError(f"{info_label(info)}: a push_pull is already in flight")
            info.busy = True
            info.out = None if out is None else out.reshape(-1)
        future = _new_future()
        order = send_order(step, priority, next(self._rids))
        if info.chain is None:
            self._enqueue(info, flat.contiguous(), step, lr, order, future)
        else:
            self._pool.submit(self._compress, info, flat.contiguous(), step, lr, order, future)
        return future

    def barrier(self) -> None:
        """Block until every worker node called barrier (up to ``BPS_TIMEOUT``)."""
        seq = next(self._barrier_seq)
        self._wait(self._scheduler_request(Op.BARRIER, (Op.RELEASE, seq), seq=seq),
                   f"barrier {seq} (waiting for all {self.num_workers} worker nodes)")

    def state_dict(self) -> dict:
        """``{"worker": {key: chain state}, "server": {key: server chain state}}``."""
        from bps.compressors import state_from_wire

        compressed = [info for info in self._keys.values() if info.chain is not None]
        futures = [self._request(Op.GET_STATE, info.server, {"key": info.key}, None,
                                 f"GET_STATE of {info_label(info)}", info)
                   for info in compressed]
        server = {}
        for info, future in zip(compressed, futures, strict=True):
            blob = self._wait(future, f"GET_STATE of {info_label(info)}")
            server[info.key] = state_from_wire(msgpack.unpackb(blob, raw=False,
                                                               strict_map_key=False))
        worker = {info.key: copy.deepcopy(info.chain.state_dict()) for info in compressed}
        return {"worker": worker, "server": server}

    def load_state_dict(self, state: dict) -> None:
        """Restore worker chains; node 0 restores the server chains. Collective: every
        worker node calls it (it ends with a barrier)."""
        from bps.compressors import state_to_wire

        for key, sd in state.get("worker", {}).items():
            self._compressed_key(key).chain.load_state_dict(sd)
        if self.node_id == 0:
            futures = []
            for key, sd in state.get("server", {}).items():
                info = self._compressed_key(key)
                blob = msgpack.packb(state_to_wire(sd), use_bin_type=True)
                fields_ = {"key": key, "nbytes": len(blob)}
                futures.append(self._request(Op.SET_STATE, info.server, fields_, blob,
                                             f"SET_STATE of {info_label(info)}", info))
            for future in futures:
                self._wait(future, "SET_STATE")
        self.barrier()

    def close(self) -> None:
        """Tell the scheduler this node is done, stop the threads, close the sockets."""
        if self._closed:
            return
        if self._error is None:
            try:
                self._wait(self._scheduler_request(Op.FINALIZE, (Op.BYE,)), "finalize")
            except ClusterError as exc:
                log.warning("close: %s", exc)
        self._closed = True
        self._stopping = True
        self._wake()
        self._io.join(timeout=max(5.0, 2 * self.env.heartbeat_interval))
        self._fail(ClusterError("engine closed"))
        self._pool.shutdown(wait=True, cancel_futures=True)
        for sock in self._dealers:
            sock.close()
        self._link.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ------------------------------------------------------------------ callers' side

    def _compressed_key(self, key: int) -> _KeyInfo:
        info = self._keys.get(key)
        if info is None or info.chain is None:
            raise KeyError(f"key {key}: not declared as a compressed key on this worker")
        return info

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ClusterError("engine closed")

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full (already woken) or closed

    def _wait(self, future: concurrent.futures.Future, what: str) -> Any:
        try:
            return future.result(timeout=self.env.timeout + 2 * self.env.heartbeat_interval)
        except concurrent.futures.TimeoutError:
            raise ClusterError(f"{what}: no answer within {self.env.timeout:g} s "
                               f"(BPS_TIMEOUT)") from None

    def _request(self, op: Op, server: int, fields_: dict, payload: Any, what: str,
                 info: _KeyInfo | None) -> concurrent.futures.Future:
        """Queue a control request to a server (sent ahead of data, no credit limit)."""
        self._raise_if_failed()
        future = _new_future()
        self._control.append(_Request((), -1, op, server, fields_, payload, future, what, info))
        return self._wake_or_fail(future)

    def _scheduler_request(self, op: Op, reply: tuple, **fields: Any) -> concurrent.futures.Future:
        self._raise_if_failed()
        future = _new_future()
        self._control.append((op, reply, fields, future))
        return self._wake_or_fail(future)

    def _wake_or_fail(self, future: concurrent.futures.Future) -> concurrent.futures.Future:
        self._wake()
        if self._error is not None:  # the I/O thread may have stopped before our append
            _settle(None, future, error=self._error)
        return future

    def _compress(self, info: _KeyInfo, tensor: torch.Tensor, step: int, lr: float,
                  order: tuple, future: concurrent.futures.Future) -> None:
        try:
            start_ns = time.monotonic_ns()
            info.chain.set_lr(lr)
            payload = info.chain.compress(tensor)
            end_ns = time.monotonic_ns()
            self._add_stats(compress_s=(end_ns - start_ns) / 1e9)
            if self.tracer is not None:
                self.tracer.complete("compress", info.name, step, start_ns, end_ns,
                                     bytes=payload.numel() * payload.element_size())
            self._enqueue(info, payload, step, lr, order, future)
        except BaseException as exc:
            _settle(info, future, error=exc)

    def _enqueue(self, info: _KeyInfo, payload: torch.Tensor, step: int, lr: float,
                 order: tuple, future: concurrent.futures.Future) -> None:
        body = memoryview(payload.view(torch.uint8).numpy())
        fields_ = {"key": info.key, "step": step, "node": self.node_id,
                   "dtype": dtype_name(info.dtype), "numel": info.numel, "nbytes": body.nbytes,
                   "lr": float(lr)}
        request = _Request(order, -1, Op.PUSH, info.server, fields_, body, future,
                           f"push_pull of {info_label(info)} step {step}", info,
                           queued_ns=time.monotonic_ns())
        with self._lock:
            if self._error is not None:
                _settle(info, future, error=self._error)
                return
            self._queues.put(info.server, request)
        self._wake()

    def _decompress(self, request: _Request, frame: zmq.Frame) -> None:
        try:
            start_ns = time.monotonic_ns()
            data = torch.frombuffer(frame.buffer, dtype=torch.uint8) if len(frame) else \
                torch.zeros(0, dtype=torch.uint8)
            result = request.info.chain.decompress(data, request.info.out)
            end_ns = time.monotonic_ns()
            self._add_stats(decompress_s=(end_ns - start_ns) / 1e9, pushes=1)
            self._trace("decompress", request, start_ns, end_ns)
            _settle(request.info, request.future, result)
        except BaseException as exc:
            _settle(request.info, request.future, error=exc)

    def _trace(self, kind: str, request: _Request, start_ns: int, end_ns: int,
               **args: object) -> None:
        """A stage of a push_pull on the timeline (pushes only; no-op without a tracer)."""
        if self.tracer is not None and request.op == Op.PUSH and start_ns:
            self.tracer.complete(kind, request.info.name, request.fields["step"], start_ns,
                                 end_ns, **args)

    def _add_stats(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, value in deltas.items():
                self._stats[name] += value

    # ------------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._link.sock, zmq.POLLIN)
        for dealer in self._dealers:
            poller.register(dealer, zmq.POLLIN)
        timeout_ms = max(1, int(self.env.heartbeat_interval * 1000))
        next_check = 0.0
        try:
            while not self._stopping:
                ready = dict(poller.poll(timeout_ms))
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self._send_control()
                for server, dealer in enumerate(self._dealers):
                    if dealer in ready:
                        self._receive_replies(server, dealer)
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
            self._fail(exc)
        except Exception as exc:
            log.exception("engine I/O thread failed")
            self._fail(ClusterError(f"engine I/O thread failed: {type(exc).__name__}: {exc}"))

    def _fail(self, error: ClusterError) -> None:
        with self._lock:
            if self._error is None and not (self._closed and str(error) == "engine closed"):
                self._error = error
            error = self._error or error
            requests = list(self._pending.values()) + self._queues.clear()
            self._pending.clear()
            control = list(self._control)
            self._control.clear()
            waiters = list(self._scheduler_waiters.values())
            self._scheduler_waiters.clear()
        requests += [c for c in control if isinstance(c, _Request)]
        waiters += [c[3] for c in control if not isinstance(c, _Request)]
        for request in requests:
            _settle(request.info, request.future, error=error)
        for future in waiters:
            _settle(None, future, error=error)
        for info in list(self._keys.values()):
            info.busy = False

    def _send(self, request: _Request) -> None:
        request.rid = next(self._rids)
        header = encode(request.op, rid=request.rid, **request.fields)
        request.deadline = time.monotonic() + self.env.timeout
        request.sent_ns = time.monotonic_ns()
        self._trace("queued", request, request.queued_ns, request.sent_ns)
        self._pending[request.rid] = request
        if request.payload is None:
            self._dealers[request.server].send(header)
            size = 0
        else:
            self._dealers[request.server].send_multipart([header, request.payload], copy=False)
            size = memoryview(request.payload).nbytes
        self._add_stats(bytes_pushed=len(header) + size)

    def _send_control(self) -> None:
        while self._control:
            item = self._control.popleft()
            if isinstance(item, _Request):
                self._send(item)
            else:
                op, reply, fields_, future = item
                self._scheduler_waiters[reply] = future
                self._link.send(op, **fields_)

    def _send_queued(self) -> None:
        with self._lock:
            ready = self._queues.take()
        for request in ready:
            if self._pushes_pending == 0:
                self._busy_since = time.perf_counter()
            self._pushes_pending += 1
            self._send(request)

    def _receive_replies(self, server: int, dealer: Any) -> None:
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._add_stats(bytes_pulled=sum(len(f) for f in frames))
            try:
                header = decode(frames[0].bytes)
            except ProtocolError as exc:
                log.warning("server %d sent a malformed reply: %s", server, exc)
                continue
            request = self._pending.get(header.get("rid"))
            if request is None:
                log.warning("server %d: unmatched %s: %s", server, header["op"].name,
                            header.get("msg", ""))
                continue
            if request.op == Op.PUSH and not request.acked:
                # the server has the push: its credit frees, whatever other workers do
                request.acked = True
                request.acked_ns = time.monotonic_ns()
                self._trace("push", request, request.sent_ns, request.acked_ns,
                            bytes=request.fields["nbytes"])
                with self._lock:
                    self._queues.release(server)
            if header["op"] == Op.ACK:
                continue
            del self._pending[request.rid]
            if request.op == Op.PUSH:
                self._trace("aggregate", request, request.acked_ns, time.monotonic_ns(),
                            bytes=header.get("nbytes", 0))
                self._pushes_pending -= 1
                if self._pushes_pending == 0:
                    self._add_stats(comm_s=time.perf_counter() - self._busy_since)
            self._on_reply(request, header, frames[1:])

    def _on_reply(self, request: _Request, header: dict, payloads: list) -> None:
        where = f"server {request.server} ({self.servers[request.server]})"
        op = header["op"]
        info, future = request.info, request.future
        if op == Op.ERROR:
            _settle(info, future, error=RemoteError(f"{where}: {header['msg']}"))
        elif op == Op.OK:
            _settle(info, future, None)
        elif op != Op.DATA or len(payloads) != 1 or len(payloads[0]) != header["nbytes"]:
            _settle(info, future, error=ClusterError(f"{request.what}: malformed reply "
                                                     f"{op.name} from {where}"))
        elif request.op == Op.GET_STATE:
            _settle(info, future, payloads[0].bytes)
        elif info.chain is not None:
            self._pool.submit(self._decompress, request, payloads[0])
        elif header["nbytes"] != info.numel * info.dtype.itemsize:
            _settle(info, future, error=ClusterError(
                f"{request.what}: {where} answered {header['nbytes']} bytes"))
        else:
            result = torch.frombuffer(payloads[0].buffer, dtype=info.dtype) if info.numel \
                else torch.zeros(0, dtype=info.dtype)
            self._add_stats(pushes=1)
            _settle(info, future, result)

    def _on_scheduler(self, header: dict) -> None:
        op = header["op"]
        reply = (op, header["seq"]) if op == Op.RELEASE else (op,)
        future = self._scheduler_waiters.pop(reply, None)
        if future is not None:
            future.set_result(None)
        elif op == Op.BYE:
            pass
        elif op != Op.HEARTBEAT:
            log.warning("unexpected scheduler message %s", op.name)

    def _check_deadlines(self, now: float) -> None:
        for request in self._pending.values():
            if now > request.deadline:
                raise ClusterError(
                    f"{request.what}: no reply from server {request.server} "
                    f"({self.servers[request.server]}) within {self.env.timeout:g} s "
                    f"(BPS_TIMEOUT)")


def _settle(info: _KeyInfo | None, future: concurrent.futures.Future, result: Any = None,
            error: BaseException | None = None) -> None:
    """Resolve a future, first freeing its key for the next push_pull."""
    if info is not None:
        info.busy = False
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def info_label(info: _KeyInfo) -> str:
    """``key 3 ('fc.weight[0]')``: how errors name a key."""
    return f"key {info.key} ({info.name!r})" if info.name else f"key {info.key}"
