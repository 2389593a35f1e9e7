"""The parameter server: per key, sum the pushes of a step and hand back one aggregate.

Usage::

    from bps.common.env import ClusterEnv
    from bps.server.server import run_server
    exit_code = run_server(ClusterEnv.from_environ())       # DMLC_ROLE=server

One I/O thread owns the ROUTER socket and the scheduler link; it checks every header
(``bps.common.protocol.decode`` plus the payload frames' count and sizes,
``bps.common.protocol.check_payload``) and hands messages to
``BPS_SERVER_THREADS`` engine threads (default: the host's cores shared by the job's
servers on it), each owning a disjoint set of keys (a new key goes to the one with
the fewest elements so far, ``_LeastLoaded``), so different keys are decoded,
summed and re-encoded in parallel (torch ops and numba kernels release the GIL; a large
partition's kernels also run in chunks on ``bps.compressors.threads``' pool). Each step's
reply carries ``server_s``, the seconds the key's engine spent on it.
Engine threads send replies back through an inproc socket; the I/O thread forwards them.

Per key and step: each worker node's push is decompressed and added to the step's sum
(float32, float64 for float64 keys; a sum of two float16/bfloat16 pushes is taken in
that dtype, which rounds exactly as the float32 sum does) in worker-node order: a push
that arrives before those of lower-numbered nodes is acknowledged and kept (its frame,
undecoded) until they have been added. The sum's rounding, and with it a whole job's
results, then does not depend on which node was faster (a run is reproducible from its
seeds, as with DDP's fixed allreduce order). When all nodes
have pushed step s (and every earlier step is done), the server chain gets
``set_lr(lr)`` from the push header and compresses the sum once; every push and pull of
step s is answered with those same bytes. Pushes for later steps accumulate separately,
so a fast worker's step s+1 never mixes into s. A bad request gets an ERROR reply naming
the key and field; the server keeps serving everyone else.

Who may ask (see docs/runtime.md, "Security"): the ROUTER is a CURVE server
(:mod:`bps.common.auth`), so only holders of the cluster key connect at all. A request counts
as worker n's only on a connection whose routing id starts with the token the scheduler
gave worker n at rendezvous; REGISTER and PUSH must name that node, SET_STATE and
ABORT come from worker 0 only. A worker has at most one push per key waiting for its
step, and a step more than one away from the step in progress is refused. Every bound is checked
before anything is allocated: frame sizes (``BPS_MAX_MESSAGE_BYTES``, enforced by
ZeroMQ while it reads), a key's size (half of that), replies queued for one connection
(:data:`PEER_QUEUE`), requests queued for the engine threads (:data:`INBOX_BYTES`: the
server stops reading until they catch up), and warnings (rate-limited).

Non-finite gradients: a push whose values are inf or NaN is refused, naming the node
(workers never send one: they mark it, see ``bps.common.protocol``). A step of a key with a
``nonfinite`` mark is answered with a skip and nothing summed; the server chain then
stays as it was. So is a key whose finite pushes sum beyond its dtype's range (float16
raw keys; compressed keys once the server chain's error is added): ``skip_node`` -1.
Where a worker learns that the whole step is skipped (another key's mark), node 0 sends
``ABORT`` for its keys: a chain that compressed that step returns to its state before it
(error feedback keeps the previous error buffer for this, see ``Compressor.rollback``).
The ABORT travels on node 0's connection ahead of its next push, so it always arrives
before that key's next step can complete.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import zmq

from bps.common import trace
from bps.common.auth import Guard, load_key
from bps.common.env import ClusterEnv
from bps.common.memory import keep_buffers_in_heap
from bps.common.protocol import (
    TOKEN_BYTES,
    ClusterError,
    Op,
    ProtocolError,
    check_payload,
    decode,
    drain,
    dtype_name,
    encode,
    error_text,
    join_frames,
    new_socket,
    payload_frames,
    torch_dtype,
)
from bps.common.ratelimit import RateLimitedLog
from bps.common.scheduler_client import SchedulerClient, failure_reason
from bps.common.striping import (
    bind_per_io_thread,
    core_shares,
    default_connections,
    engine_threads,
    host_cores,
    io_thread_cpu_seconds,
    io_threads,
)
from bps.compressors.base import NonFiniteError
from bps.compressors.finite import frames_finite, join_finite, tensor_finite
from bps.compressors.threads import chunk_bounds, run_chunks
from bps.compressors.warm import load_soon

log = logging.getLogger("bps.server")
refusals = RateLimitedLog(log)

MAX_KEY = 2**63
MAX_NUMEL = 2**31 - 1
MAX_PENDING_STEPS = 16
KEY_COST = 65536  # a key-step's fixed Python work, in elements' worth of kernel time
STEP_WINDOW = 1  # a push's step may differ by at most this from the pending pushes' steps
PEER_QUEUE = 1024  # replies queued for one connection that does not read (then dropped)
PEER_INBOUND = 64  # requests ZeroMQ queues per connection before it stops reading it
INBOX_BYTES = 256 << 20  # payload bytes waiting for the engine threads: read no more
OPS_WITH_PAYLOAD = (Op.PUSH, Op.SET_STATE)
KEY_OPS = (Op.REGISTER, Op.PUSH, Op.PULL, Op.GET_STATE, Op.SET_STATE, Op.ABORT)


class RequestError(ValueError):
    """A request the server refuses; the message goes back in an ERROR reply."""


@dataclass
class _Step:
    """The sum of one step of one key while its pushes arrive."""

    total: torch.Tensor | None = None
    payloads: list[torch.Tensor] = field(default_factory=list)  # checked, summed at the end
    held: dict[int, tuple[bytes, dict, list[zmq.Frame]]] = field(default_factory=dict)  # not added
    summed: int = 0  # the pushes of nodes 0 .. summed - 1 are in total
    waiters: list[tuple[bytes, int]] = field(default_factory=list)
    lr: float = 0.0
    first_lr: tuple[int, float] | None = None  # (node, lr) of the first push to arrive
    first_push_ns: int = 0  # when traced (bps.common.trace): the first push's arrival
    busy_ns: int = 0  # spent decoding and adding this step's pushes
    nonfinite: tuple[int, str] | None = None  # (node, what) of the first nonfinite mark

    def pushed(self, node: int) -> bool:
        """Whether ``node``'s push of this step arrived (added, or held)."""
        return node < self.summed or node in self.held

    def started(self) -> bool:
        """Whether any push of this step arrived."""
        return self.summed > 0 or bool(self.held)

    def has_values(self) -> bool:
        """Whether a push with values (not a mark) was added."""
        return self.total is not None or bool(self.payloads)


@dataclass
class _Key:
    key: int
    numel: int
    dtype: torch.dtype
    params: dict | None
    name: str
    node: int
    chain: Any
    steps: dict[int, _Step] = field(default_factory=dict)
    last_step: int = -1
    last_payload: torch.Tensor | None = None
    last_skip: dict | None = None  # the skip fields of the last step's DATA, if skipped
    committed_step: int = -1  # the step the chain compressed last (ABORT can undo it)
    last_server_s: float = 0.0  # seconds the last step took to decode, sum and re-encode
    scratch: torch.Tensor | None = None  # a push widened for the sum, reused every step
    decoded: torch.Tensor | None = None  # a compressed push decoded for the sum, reused
    joined: torch.Tensor | None = None  # a raw push in several frames joined, reused
    spare: list[torch.Tensor] = field(default_factory=list)  # sums of finished steps
    state_blob: bytes | None = None  # GET_STATE's answer until the state changes

    def sums_at_the_end(self) -> bool:
        """Compressed pushes are checked as they arrive and summed in the server chain's
        error feedback pass once the last one is in (``compress_sum``: one pass where
        decoding, adding and correcting take three)."""
        return self.chain is not None and getattr(self.chain, "sums_payloads", False)

    def sums_in_place(self) -> bool:
        """Compressed pushes are summed in the key's own dtype (decoded into a reused
        buffer, then added with ``decompress_add``)."""
        return self.chain is not None and self.accumulate_dtype(2 ** 31) == self.dtype

    def join_buffer(self) -> torch.Tensor:
        """Where a raw push that came in several frames is joined to be added (reused)."""
        if self.joined is None:
            self.joined = torch.empty(self.numel, dtype=self.dtype)
        return self.joined

    def spare_sum(self) -> torch.Tensor:
        """A buffer for a step's sum: one a finished step gave back, or a new one (a new
        tensor every step would cost a page fault per 4 KiB)."""
        return self.spare.pop() if self.spare else torch.empty(self.numel, dtype=self.dtype)

    def accumulate_dtype(self, terms: int) -> torch.dtype:
        """float32 (float64 for float64 keys); with at most two terms the key's own dtype,
        which is exact: float16/bfloat16 addition computes in float32 and rounds once,
        just as a float32 sum rounded at the end does."""
        if terms <= 2:
            return self.dtype
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def describe(self) -> str:
        return (f"numel={self.numel}, dtype={dtype_name(self.dtype)}, "
                f"params={self.params}")


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a payload still refers to the sum it was compressed from (a registered
    compressor may return a view of its input)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _add_in_chunks(total: torch.Tensor, values: torch.Tensor,
                   scratch: torch.Tensor | None = None) -> None:
    """``total += values`` (widened into ``scratch`` first where given), a large tensor in
    chunks on several threads (torch releases the GIL; the server runs torch on one
    thread). Elementwise, so the result is the same bits as one ``add_``."""
    def add(lo: int, hi: int) -> None:
        part = values[lo:hi] if scratch is None else scratch[lo:hi].copy_(values[lo:hi])
        total[lo:hi].add_(part)

    run_chunks(add, chunk_bounds(total.numel()))


def _payload_data(payload: list[zmq.Frame]) -> torch.Tensor:
    """A compressed push's bytes: a view of its frame, or its frames joined."""
    if len(payload) > 1:
        return torch.from_numpy(join_frames(payload))
    return torch.frombuffer(payload[0].buffer, dtype=torch.uint8)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous tensor, for ``send(copy=False)``."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy())


class _KeyEngine(threading.Thread):
    """Owns a set of keys; processes their requests in arrival order."""

    def __init__(self, server: ParameterServer, index: int) -> None:
        super().__init__(name=f"bps-server-engine-{index}", daemon=True)
        self.server = server
        self.inbox: queue.Queue = queue.Queue()
        self.keys: dict[int, _Key] = {}

    def run(self) -> None:
        self.out = new_socket(self.server.ctx, zmq.PUSH)
        self.out.connect(self.server.replies_address)
        try:
            while (item := self.inbox.get()) is not None:
                ident, header, payload = item
                self.server.dequeued(payload)
                try:
                    self._handle(ident, header, payload)
                except RequestError as exc:
                    self._error(ident, header, str(exc))
                except Exception as exc:  # a codec failure must not kill the server
                    log.exception("key %s: %s failed", header.get("key"), header["op"].name)
                    self._error(ident, header, f"key {header.get('key')}: {header['op'].name} "
                                f"failed: {type(exc).__name__}: {exc}")
        finally:
            self.out.close()

    def _error(self, ident: bytes, header: dict, msg: str) -> None:
        msg = error_text(msg)
        refusals.warning("refused %s from %s: %s", header["op"].name, header.get("peer", "?"),
                         msg)
        self._send_error(ident, header["rid"], msg)

    def _send_error(self, ident: bytes, rid: int, msg: str) -> None:
        """An ERROR reply to request ``rid``; ``msg`` as ``error_text`` bounds it."""
        self.out.send_multipart([ident, encode(Op.ERROR, rid=rid, msg=msg)])

    def _reply(self, ident: bytes, header: bytes, payload: Any = None) -> None:
        """Send a reply; ``payload`` (a buffer) in frames of BPS_FRAME_BYTES."""
        frames = [ident, header]
        if payload is not None:
            frames += payload_frames(memoryview(payload), self.server.env.frame_bytes)
        self.out.send_multipart(frames, copy=False)

    def _handle(self, ident: bytes, header: dict, payload: list[zmq.Frame] | None) -> None:
        op, key = header["op"], header["key"]
        if op == Op.REGISTER:
            self._register(header)
            self._reply(ident, encode(Op.OK, rid=header["rid"]))
            return
        state = self.keys.get(key)
        if state is None:
            raise RequestError(f"key {key}: unknown key (not declared)")
        if op == Op.PUSH:
            self._push(state, ident, header, payload)
        elif op == Op.PULL:
            self._pull(state, ident, header)
        elif op == Op.GET_STATE:
            if state.state_blob is None:  # every GET_STATE until the next step shares it
                sd = {} if state.chain is None else state.chain.state_dict()
                from bps.compressors import state_to_wire

                state.state_blob = msgpack.packb(state_to_wire(sd), use_bin_type=True)
            blob = state.state_blob
            self._reply(ident, encode(Op.DATA, rid=header["rid"], key=key, step=state.last_step,
                                      nbytes=len(blob)), blob)
        elif op == Op.SET_STATE:
            self._set_state(state, payload)
            self._reply(ident, encode(Op.OK, rid=header["rid"]))
        elif op == Op.ABORT:
            if state.chain is not None and state.committed_step == header["step"]:
                state.chain.rollback()
                state.committed_step = -1
                state.state_blob = None
            self._reply(ident, encode(Op.OK, rid=header["rid"]))

    def _register(self, header: dict) -> None:
        key, numel, name = header["key"], header["numel"], header["name"]
        if not 0 <= key < MAX_KEY:
            raise RequestError(f"key {key} ({name!r}): key out of range [0, 2**63)")
        if not 0 <= numel <= MAX_NUMEL:
            raise RequestError(f"key {key} ({name!r}): numel={numel} out of range")
        try:
            dtype = torch_dtype(header["dtype"])
        except ValueError as exc:
            raise RequestError(f"key {key} ({name!r}): {exc}") from None
        largest = (self.server.env.max_message_bytes - 64) // 2
        if numel * dtype.itemsize > largest:
            raise RequestError(f"key {key} ({name!r}): numel={numel} ({numel * dtype.itemsize} "
                               f"bytes) is larger than a key may be ({largest} bytes: half of "
                               f"BPS_MAX_MESSAGE_BYTES={self.server.env.max_message_bytes})")
        params = header["params"]
        existing = self.keys.get(key)
        if existing is not None:
            if (existing.numel, existing.dtype, existing.params) != (numel, dtype, params):
                probe = _Key(key, numel, dtype, params, name, header["node"], None)
                raise RequestError(
                    f"key {key} declared differently by worker nodes: worker {header['node']} "
                    f"declared {name!r} with {probe.describe()}, but worker {existing.node} "
                    f"declared {existing.name!r} with {existing.describe()}")
            return
        chain = None
        if params is not None:
            from bps.compressors import build

            try:
                chain = build(params, numel, dtype, role="server")
            except (TypeError, ValueError) as exc:
                raise RequestError(f"key {key} ({name!r}): {exc}") from None
        self.keys[key] = _Key(key, numel, dtype, params, name, header["node"], chain)
        load_soon(params, dtype)  # numba's start-up, beside the rest of the rendezvous

    def _decode(self, state: _Key, payload: list[zmq.Frame], node: int,
                out: torch.Tensor | None = None, add_to: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The push's values: a view of its frame (raw keys; a payload in several frames
        is joined into ``out``, a new tensor if None), or decoded into ``out`` (a new
        tensor if None), or with ``add_to``: decoded and added to it in place. Values
        that are inf or NaN are refused before anything is added."""
        if state.chain is None:
            if not state.numel:
                values = torch.zeros(0, dtype=state.dtype)
            elif len(payload) == 1:
                values = torch.frombuffer(payload[0].buffer, dtype=state.dtype)
                finite = tensor_finite(values)
            else:  # joined and checked in one pass
                values = torch.empty(state.numel, dtype=state.dtype) if out is None else out
                finite = join_finite([frame.buffer for frame in payload], values)
            if not finite:
                raise self._nonfinite_push(state, node)
            return values
        data = _payload_data(payload)
        try:
            if add_to is not None:
                if state.decoded is None:
                    state.decoded = torch.empty(state.numel, dtype=state.dtype)
                values = state.chain.decompress_add(data, add_to, state.decoded)
            else:
                values = state.chain.decompress(data, out)
        except Exception as exc:
            raise RequestError(f"key {state.key} ({state.name!r}): cannot decode payload "
                               f"from worker {node}: {type(exc).__name__}: {exc}") from None
        if values.numel() != state.numel:
            raise RequestError(f"key {state.key} ({state.name!r}): payload decodes to "
                               f"{values.numel()} values, expected {state.numel}")
        return values

    @staticmethod
    def _nonfinite_push(state: _Key, node: int) -> RequestError:
        return RequestError(f"key {state.key} ({state.name!r}): the push of worker {node} "
                            "has inf or NaN values")

    def _add_frames(self, state: _Key, payload: list[zmq.Frame], node: int,
                    total: torch.Tensor) -> bool:
        """Add a raw push of several frames to ``total`` (of the key's dtype) where each
        frame lies, with no join; every frame is checked before anything is added. False,
        with nothing done, where a frame does not hold whole elements (it is joined)."""
        buffers = [frame.buffer for frame in payload]
        finite = frames_finite(buffers, state.dtype)
        if finite is None:
            return False
        if not finite:
            raise self._nonfinite_push(state, node)
        start = 0
        for buffer in filter(len, buffers):
            part = torch.frombuffer(buffer, dtype=state.dtype)
            total[start:start + part.numel()].add_(part)
            start += part.numel()
        return True

    def _check_step(self, state: _Key, step: int) -> None:
        if step <= state.last_step:
            raise RequestError(f"key {state.key} ({state.name!r}): step {step} already "
                               f"completed (last completed step {state.last_step})")
        if step not in state.steps and len(state.steps) >= MAX_PENDING_STEPS:
            raise RequestError(f"key {state.key} ({state.name!r}): step {step} is too far "
                               f"ahead: {MAX_PENDING_STEPS} steps already pending")

    def _check_push(self, state: _Key, pending: _Step | None, node: int, step: int,
                    lr: float | None) -> None:
        """A push of ``step`` by worker ``node`` is neither stale nor a repeat, the node
        has no other push of this key waiting, the step is within STEP_WINDOW of the
        other pending pushes' steps, and its learning rate (``None``: a marker's, not
        checked) is that of the step's first push with values."""
        where = f"key {state.key} ({state.name!r})"
        self._check_step(state, step)
        if pending is not None and pending.pushed(node):
            raise RequestError(f"{where}: worker {node} pushed step {step} twice")
        for other, waiting in state.steps.items():
            if other == step or not waiting.started():
                continue
            if waiting.pushed(node):
                raise RequestError(f"{where}: worker {node} pushed step {step} while its "
                                   f"push of step {other} still waits for the other workers")
            if abs(step - other) > STEP_WINDOW:
                raise RequestError(f"{where}: step {step} is more than {STEP_WINDOW} step "
                                   f"away from step {other}, which other workers pushed")
        if (lr is not None and pending is not None and pending.first_lr is not None
                and pending.first_lr[1] != lr):
            first_node, first_lr = pending.first_lr
            raise RequestError(f"{where} step {step}: worker {node} pushed learning rate "
                               f"{lr!r}, but worker {first_node} pushed {first_lr!r} for the "
                               f"same step (the workers' learning rates differ)")

    def _push(self, state: _Key, ident: bytes, header: dict, payload: list[zmq.Frame]
              ) -> None:
        node, step = header["node"], header["step"]
        where = f"key {state.key} ({state.name!r})"
        if header["dtype"] != dtype_name(state.dtype):
            raise RequestError(f"{where}: push dtype {header['dtype']!r} differs from the "
                               f"declared {dtype_name(state.dtype)!r}")
        if header["numel"] != state.numel:
            raise RequestError(f"{where}: push numel {header['numel']} differs from the "
                               f"declared {state.numel}")
        if not 0 <= node < self.server.num_workers:
            raise RequestError(f"{where}: field 'node'={node} out of range")
        if header["lr"] < 0:
            raise RequestError(f"{where}: field 'lr'={header['lr']} is negative")
        raw_bytes = state.numel * state.dtype.itemsize
        if "mark" in header:  # no payload (the protocol checked nbytes == 0)
            pass
        elif state.chain is None and header["nbytes"] != raw_bytes:
            raise RequestError(f"{where}: raw payload of {header['nbytes']} bytes, expected "
                               f"{raw_bytes}")
        if state.chain is not None and header["nbytes"] > 2 * raw_bytes + 64:
            raise RequestError(f"{where}: compressed payload of {header['nbytes']} bytes is "
                               "larger than any encoding")
        # a marker carries no gradient, so its learning rate is not the step's (a joined
        # worker's optimizer no longer steps)
        lr = None if "mark" in header else float(header["lr"])
        self._check_push(state, state.steps.get(step), node, step, lr)
        pending = state.steps.setdefault(step, _Step())
        if pending.first_lr is None and lr is not None:
            pending.first_lr = (node, lr)
        tracer = self.server.tracer
        if tracer is not None and tracer.at(step):
            pending.first_push_ns = pending.first_push_ns or time.monotonic_ns()
            tracer.instant("push", state.name, step, node=node)
        pending.held[node] = (ident, header, payload)
        pending.waiters.append((ident, header["rid"]))
        refused = self._sum_held(state, pending)
        if not pending.started() and not pending.waiters:  # a refused push holds no slot
            del state.steps[step]
        if refused is not None:
            refused_node, refused_ident, refused_header, error = refused
            if refused_node == node:
                raise error
            self._error(refused_ident, refused_header, str(error))  # after its ACK
        self._reply(ident, encode(Op.ACK, rid=header["rid"]))  # added, or held
        self._finish_ready_steps(state)

    def _sum_held(self, state: _Key, pending: _Step) -> tuple | None:
        """Add the held pushes to the sum in node order, as far as every lower-numbered
        node has pushed. A push that cannot be decoded is dropped (the nodes after it
        wait for that node to push again) and returned as (node, ident, header, error)."""
        while pending.summed in pending.held:
            node = pending.summed
            ident, header, payload = pending.held.pop(node)
            try:
                self._add_push(state, pending, header, payload)
            except RequestError as exc:
                pending.waiters.remove((ident, header["rid"]))
                return node, ident, header, exc
            pending.summed += 1
        return None

    def _add_push(self, state: _Key, pending: _Step, header: dict,
                  payload: list[zmq.Frame]) -> None:
        """Decode a push and add it to the step's sum; the time goes to ``busy_ns``."""
        start_ns = time.monotonic_ns()
        self._add_values(state, pending, header, payload)
        end_ns = time.monotonic_ns()
        pending.busy_ns += end_ns - start_ns
        if self.server.tracer is not None and pending.first_push_ns:
            self.server.tracer.complete("decode", state.name, header["step"], start_ns, end_ns,
                                        node=header["node"])

    def _add_values(self, state: _Key, pending: _Step, header: dict,
                    payload: list[zmq.Frame]) -> None:
        node = header["node"]
        if "mark" in header:  # nothing to add
            if header["mark"] == "nonfinite" and pending.nonfinite is None:
                pending.nonfinite = (node, header.get("what", ""))
            return
        if state.sums_at_the_end():
            data = _payload_data(payload)
            try:
                state.chain.check_payload(data)
            except ValueError as exc:
                raise RequestError(f"key {state.key} ({state.name!r}): cannot decode payload "
                                   f"from worker {node}: {exc}") from None
            if not pending.payloads:
                pending.lr = float(header["lr"])
            pending.payloads.append(data)
            return
        if pending.total is not None and state.sums_in_place():
            # a compressed push adds into the sum directly (a sparse payload touches only
            # its k elements); it is decoded before anything is added
            self._decode(state, payload, node, add_to=pending.total)
            return
        if state.chain is None and len(payload) > 1 and pending.total is not None \
                and pending.total.dtype == state.dtype \
                and self._add_frames(state, payload, node, pending.total):
            return
        # the step's first push becomes its sum: a compressed one is decoded into a reused
        # buffer, a raw one is the frame itself (or its widened copy; a raw push in
        # several frames is joined into a new buffer that becomes the sum, or into the
        # key's reused one where it is widened, or added with frames that cut elements)
        out = state.spare_sum() if state.sums_in_place() else None
        if state.chain is None and len(payload) > 1 and (
                pending.total is not None
                or state.accumulate_dtype(self.server.num_workers) != state.dtype):
            out = state.join_buffer()
        try:
            values = self._decode(state, payload, node, out)
        except RequestError:
            if out is not None and state.sums_in_place():  # not the raw key's join buffer
                state.spare.append(out)
            raise
        if pending.total is None:
            pending.total = values.to(state.accumulate_dtype(self.server.num_workers))
            pending.lr = float(header["lr"])
        elif values.dtype == pending.total.dtype:
            _add_in_chunks(pending.total, values)
        else:  # widen first: torch's mixed-dtype add_ is ~4x slower than copy + add_
            if state.scratch is None:
                state.scratch = torch.empty(state.numel, dtype=pending.total.dtype)
            _add_in_chunks(pending.total, values, state.scratch)

    def _pull(self, state: _Key, ident: bytes, header: dict) -> None:
        step = header["step"]
        if step == state.last_step and state.last_payload is not None:
            self._send_data(state, step, [(ident, header["rid"])])
            return
        self._check_step(state, step)
        pending = state.steps.get(step)
        if (pending is None or not pending.started()) and step != state.last_step + 1:
            # only a step in progress or the next one: PULLs cannot park future steps
            raise RequestError(f"key {state.key} ({state.name!r}): PULL of step {step}, "
                               f"which nobody pushed (last completed step "
                               f"{state.last_step})")
        state.steps.setdefault(step, _Step()).waiters.append((ident, header["rid"]))

    def _finish_ready_steps(self, state: _Key) -> None:
        while state.steps:
            step = min(state.steps)
            pending = state.steps[step]
            if pending.summed < self.server.num_workers:
                return
            del state.steps[step]
            state.last_step = step
            state.last_server_s = pending.busy_ns / 1e9
            if pending.nonfinite is not None or not pending.has_values():
                self._skip(state, step, pending)
                continue
            summed_ns = time.monotonic_ns()
            total = None if pending.payloads else pending.total.to(state.dtype)
            if state.chain is None and state.dtype == torch.float16 and not tensor_finite(total):
                # finite pushes whose sum overflows float16: skipped like an inf pushed
                pending.nonfinite = (-1, state.name)
                self._skip(state, step, pending)
                continue
            if state.chain is not None:
                try:
                    total = self._compress(state, pending, total)
                except NonFiniteError:  # finite pushes whose sum (with the error) overflows
                    pending.nonfinite = (-1, state.name)
                    self._skip(state, step, pending)
                    continue
                except Exception as exc:  # every waiter hears of it, not only the last pusher
                    self._fail_step(state, step, pending, exc)
                    continue
                state.committed_step = step
            encoded_ns = time.monotonic_ns()
            state.last_server_s += (encoded_ns - summed_ns) / 1e9
            tracer = self.server.tracer
            if tracer is not None and pending.first_push_ns:
                tracer.complete("sum", state.name, step, pending.first_push_ns, summed_ns,
                                server_s=state.last_server_s)
                if state.chain is not None:
                    tracer.complete("compress", state.name, step, summed_ns, encoded_ns,
                                    bytes=total.numel() * total.element_size())
            state.last_payload, state.last_skip = total, None
            state.state_blob = None
            self._send_data(state, step, pending.waiters)

    def _compress(self, state: _Key, pending: _Step, total: torch.Tensor | None
                  ) -> torch.Tensor:
        """The server chain's payload of the step's sum (``total``, or the checked
        ``pending.payloads`` where the chain sums them itself). Raises what the chain
        raised (NonFiniteError, ...), its learning rate as before."""
        chain = state.chain
        if pending.lr > 0:
            chain.set_lr(pending.lr)
        try:
            if pending.payloads:
                return chain.compress_sum(pending.payloads)
            payload = chain.compress(total)
        except Exception:
            chain.cancel()
            raise
        if state.sums_in_place() and not _shares_memory(total, payload):
            state.spare.append(total)
        return payload

    def _fail_step(self, state: _Key, step: int, pending: _Step, exc: Exception) -> None:
        """The server chain failed on the step's sum: an ERROR to every push and PULL of
        the step, which no later PULL can fetch either."""
        msg = error_text(f"key {state.key} ({state.name!r}) step {step}: the server chain "
                         f"failed on the sum: {type(exc).__name__}: {exc}")
        log.error(msg)
        self._release(state, pending)
        state.last_payload, state.last_skip, state.state_blob = None, None, None
        for ident, rid in pending.waiters:
            self._send_error(ident, rid, msg)

    def _release(self, state: _Key, pending: _Step) -> None:
        """Give a step's sum buffer back to the key, where it owns one."""
        if pending.total is not None and state.sums_in_place():
            state.spare.append(pending.total)

    def _skip(self, state: _Key, step: int, pending: _Step) -> None:
        """Answer a step that is not summed: a non-finite mark, or only zero marks."""
        self._release(state, pending)
        node, what = pending.nonfinite if pending.nonfinite is not None else (-1, "")
        state.last_payload = torch.zeros(0, dtype=torch.uint8)
        state.last_skip = {"skip": "nonfinite" if pending.nonfinite else "zero",
                           "skip_node": node, "skip_what": what}
        self._send_data(state, step, pending.waiters)

    def _send_data(self, state: _Key, step: int, waiters: list[tuple[bytes, int]]) -> None:
        body = _as_bytes(state.last_payload)
        skip = state.last_skip or {}
        for ident, rid in waiters:
            self._reply(ident, encode(Op.DATA, rid=rid, key=state.key, step=step,
                                      nbytes=body.nbytes, server_s=state.last_server_s,
                                      **skip), body)

    def _set_state(self, state: _Key, payload: list[zmq.Frame]) -> None:
        if any(s.started() for s in state.steps.values()):
            raise RequestError(f"key {state.key} ({state.name!r}): SET_STATE while a step "
                               f"is in progress")
        if state.chain is not None:
            from bps.compressors import state_from_wire

            try:
                sd = state_from_wire(msgpack.unpackb(join_frames(payload), raw=False,
                                                     strict_map_key=False))
                state.chain.load_state_dict(sd)
            except Exception as exc:
                raise RequestError(f"key {state.key} ({state.name!r}): bad state: "
                                   f"{type(exc).__name__}: {exc}") from None
        state.steps.clear()
        state.last_step, state.last_payload, state.last_skip = -1, None, None
        state.committed_step = -1
        state.last_server_s = 0.0
        state.state_blob = None


class _LeastLoaded:
    """Picks the engine thread of a new key: the one with the least work so far, in
    elements plus :data:`KEY_COST` per key, ties to the lowest-numbered. Keys of
    different sizes (a tensor's last partition, small raw tensors) then spread evenly.

        >>> pick = _LeastLoaded(["e0", "e1"])
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
        self._queued = 0  # payload bytes in the engines' inboxes
        self._queued_lock = threading.Lock()

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
        engines: list[_KeyEngine] = []
        try:
            welcome = link.rendezvous()
            threads = self.env.server_threads or engine_threads(host_cores(),
                                                                welcome["servers"], address)
            engines += [_KeyEngine(self, i) for i in range(threads)]
            self.num_workers = welcome["num_workers"]
            self.members = {bytes(token): node for node, token in enumerate(welcome["members"])}
            self.tracer = trace.from_env(self.env, f"server{welcome['node_id']}")
            log.info("server %d serving on %s, engine threads: %d", welcome["node_id"],
                     address, threads)
            for engine in engines:
                engine.start()
            return self._loop(router, replies, link, engines)
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
            for engine in engines:
                engine.inbox.put(None)
            for engine in engines:
                if engine.is_alive():
                    engine.join(timeout=5)
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
              engines: list[_KeyEngine]) -> int:
        owner: dict[int, _KeyEngine] = {}
        next_engine = _LeastLoaded(engines)
        poller = zmq.Poller()
        for sock in (router, replies, link.sock):
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
                        router.send_multipart(frames, copy=False)
                elif sock is router:
                    for frames in drain(router):
                        self._dispatch(router, frames, owner, next_engine)
                        if self._queued > INBOX_BYTES:
                            break
                elif link.receive()["op"] == Op.SHUTDOWN:
                    log.info("shutdown requested by the scheduler")
                    return 0
            link.tick()

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
            op = header["op"]
            if op not in KEY_OPS:
                raise ProtocolError(f"op {op.name} is not a server request")
            self._check_member(ident, header)
            header["peer"] = peer
            payloads = frames[2:]
            if header["op"] in OPS_WITH_PAYLOAD:
                check_payload(f"{op.name} key {header['key']}", header["nbytes"],
                              [len(frame) for frame in payloads], self.env.max_message_bytes)
            elif payloads:
                raise ProtocolError(f"{op.name}: {len(payloads)} payload frames, expected 0")
            engine = owner.get(header["key"])
            if engine is None:
                if header["op"] != Op.REGISTER:
                    raise ProtocolError(f"key {header['key']}: unknown key (not declared)")
                engine = owner[header["key"]] = next_engine(header)
        except ProtocolError as exc:
            msg = error_text(str(exc))
            refusals.warning("refused a message from %s: %s", peer, msg)
            rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else -1
            router.send_multipart([ident, encode(Op.ERROR, rid=rid, msg=msg)])
            return
        if payloads:
            with self._queued_lock:
                self._queued += sum(len(frame) for frame in payloads)
        engine.inbox.put((ident, header, payloads or None))

    def _check_member(self, ident: bytes, header: dict) -> None:
        """The request comes from a connection of the worker it speaks for."""
        op, key = header["op"], header["key"]
        node = self.members.get(ident[:TOKEN_BYTES])
        if node is None:
            raise ProtocolError(f"{op.name} key {key}: this connection belongs to no worker "
                                f"of this job")
        claimed = header.get("node", node)
        if op in (Op.REGISTER, Op.PUSH) and claimed != node:
            raise ProtocolError(f"{op.name} key {key} as worker {claimed!r} on a connection "
                                f"of worker {node}")
        if op == Op.SET_STATE and node != 0:
            raise ProtocolError(f"SET_STATE key {key} from worker {node}: only worker 0 "
                                f"restores the servers' state (load_state_dict)")
        if op == Op.ABORT and node != 0:
            raise ProtocolError(f"ABORT key {key} from worker {node}: only worker 0 "
                                f"rolls back a skipped step")


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
