"""The worker engine: push/pull of partitions to the parameter servers.

Usage (local rank 0 of a worker node)::

    from bps.common.env import ClusterEnv
    from bps.worker.engine import WorkerEngine

    engine = WorkerEngine.connect(ClusterEnv.from_environ())   # rendezvous
    engine.declare(0, 1000, torch.float32, None, name="fc.bias")   # raw key
    engine.declare(1, 10**6, torch.float32, {"compressor": "onebit", ...}, name="fc.weight[0]")
    fut = engine.push_pull(1, grad_part, step=0, lr=0.1, priority=-1)
    averaged = fut.result()     # 1-D tensor, declared dtype: the decompressed aggregate
    engine.barrier()
    engine.close()

A key whose compressor takes several rounds (``MultiRound``, powersgd: 2) is one
push_pull for the caller; round r travels as the raw float32 key ``key + r * 2**60`` on
the key's server, cut into pieces ``+ j * 2**40`` where it is larger than a key may be;
the next round is computed on a codec thread once every piece of the previous sum
arrived (docs/compression.md, "Rounds").

One I/O thread owns every socket (one DEALER per server, the scheduler link;
:mod:`bps.worker.io_loop`); a small thread pool runs the compressor chains
(:mod:`bps.worker.codec_pool`; numba kernels release the GIL). Each server has
at most ``BPS_MAX_INFLIGHT`` pushes not yet acknowledged (the server ACKs a push as soon
as its header checks pass, before it is summed in node order, so the credit never waits
on other workers and cannot deadlock; a push that then fails to decode gets an ERROR); the
rest wait in a per-server queue (:mod:`bps.worker.send_queues`) ordered by (step,
-priority, arrival), so a larger ``priority`` goes out first (give the partitions needed
first by the next forward pass the largest priority).

A push is answered by the step's aggregate once every worker node pushed that step.
The tensor handed to ``push_pull`` must not be modified until its future resolves
(raw keys are sent straight from its memory). At most one push_pull per key may be in
flight. Every request has a ``BPS_TIMEOUT`` deadline; a timeout, a dead peer or a lost
scheduler fails every pending future with a :class:`bps.common.protocol.ClusterError` naming
the key, server or peer, and every later call raises it again.

Skipped steps: ``push_pull(key, None, step, lr, mark="nonfinite", what=name)`` pushes a
marker instead of values (``"zero"``: this node contributes nothing); a compressed key
whose chain refuses its input as non-finite is pushed as such a marker too. The future
of a step that the server did not sum gives a :class:`Skipped` instead of a tensor;
``rollback(step)`` then returns every worker chain that compressed that step, and
(node 0, or the lowest-numbered node present) every server chain, to its state before it.
A step that the servers dropped because worker nodes left (``BPS_MIN_WORKERS``) gives a
:class:`Skipped` of reason ``"membership"`` with the new ``generation`` and ``members``;
the pushes of the steps after that one carry that generation (``engine.generation``).
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import torch
import zmq

from bps.common.auth import ClusterKey, load_key
from bps.common.env import ClusterEnv
from bps.common.memory import keep_buffers_in_heap
from bps.common.protocol import MARKS, STATE_CHUNK, ClusterError, Op, dtype_name
from bps.common.scheduler_client import SchedulerClient
from bps.common.striping import server_endpoints
from bps.common.trace import Tracer
from bps.compressors.base import MultiRound
from bps.worker.codec_pool import CODEC_THREADS, CodecPool
from bps.worker.device_graphs import enabled_by_env
from bps.worker.device_path import KeyStaging, decode_into, on_side_stream, wait_side_stream
from bps.worker.io_loop import IOLoop, log
from bps.worker.partition import Placement, partition
from bps.worker.send_queues import KeyInfo, Skipped, info_label, new_future, send_order

__all__ = ["EngineStats", "Skipped", "WorkerEngine"]

MAX_KEY = 2**63
STATE_WINDOW = 16  # GET_STATE / SET_STATE requests out at a time
# round r >= 1 of a key whose compressor takes several rounds travels on this key
ROUND_KEY_STRIDE = 2**60
# piece j >= 1 of a round larger than a key may be travels on the round's key plus this
PIECE_KEY_STRIDE = 2**40


@dataclass(frozen=True)
class EngineStats:
    """Cumulative counters; subtract two snapshots for per-step deltas.

    ``bytes_pushed`` / ``bytes_pulled``: header + payload bytes sent to / received from
    servers. ``compress_s`` / ``decompress_s``: seconds spent in the worker chains (summed
    over codec threads). ``comm_s``: wall seconds during which at least one push was in
    flight. ``pushes``: completed push_pulls. ``pcie_bytes``: bytes the device path
    copied between a GPU and the host (payloads down, aggregates up). ``server_s``:
    seconds the servers spent decoding, summing and re-encoding this node's keys (their
    replies' ``server_s``, summed over keys: engine-thread seconds, which run in
    parallel, not wall time).
    """

    bytes_pushed: int = 0
    bytes_pulled: int = 0
    compress_s: float = 0.0
    decompress_s: float = 0.0
    comm_s: float = 0.0
    pushes: int = 0
    pcie_bytes: int = 0
    server_s: float = 0.0

    def __sub__(self, other: EngineStats) -> EngineStats:
        return EngineStats(*(getattr(self, f.name) - getattr(other, f.name)
                             for f in fields(self)))


class WorkerEngine:
    """Push/pull engine of one worker node; create it with :meth:`connect`."""

    def __init__(self, env: ClusterEnv, ctx: Any, link: SchedulerClient, welcome: dict,
                 tracer: Tracer | None = None, key: ClusterKey | None = None,
                 codec_threads: int = CODEC_THREADS) -> None:
        self.env = env
        self.tracer = tracer
        self.key = key  # the cluster key (None: BPS_INSECURE=1)
        self.token = link.token  # the prefix of this node's connections to the servers
        self._link = link
        self._last_step = -1
        self.node_id: int = welcome["node_id"]
        self.num_workers: int = welcome["num_workers"]
        self.num_servers: int = welcome["num_servers"]
        self.job_seed: int = welcome["seed"]
        # a node started after the rendezvous (BPS_MIN_WORKERS): no member until join()
        self.joining: bool = bool(welcome.get("joining", False))
        self.servers: list[str] = list(welcome["servers"])
        self.endpoints = server_endpoints(welcome, self.servers)
        self.placement = Placement(self.num_servers)
        self._keys: dict[int, KeyInfo] = {}
        # multi-round keys: for each round the raw keys of its pieces
        self._rounds: dict[int, list[list[KeyInfo]]] = {}
        self.barriers = 0  # barriers entered: the next one's sequence number
        self._host_chain_logged: set[str] = set()
        self._cuda_graphs = enabled_by_env()  # device chains replay CUDA graphs
        self._stats_lock = threading.Lock()
        self._stats = {f.name: f.default for f in fields(EngineStats)}
        self._codec = CodecPool(self._add_stats, tracer, codec_threads)
        self._io = IOLoop(env, ctx, link, self.servers, self.node_id, self._keys,
                          self._add_stats, tracer, self._codec.decompress, key,
                          endpoints=self.endpoints)

    @classmethod
    def connect(cls, env: ClusterEnv, ctx: Any = None, tracer: Tracer | None = None,
                codec_threads: int = CODEC_THREADS) -> WorkerEngine:
        """Rendezvous with the scheduler (blocks up to ``BPS_TIMEOUT``) and start the engine.
        ``tracer``: records each partition's stages (:mod:`bps.common.trace`);
        ``codec_threads``: 0 runs each chain on the thread that pushes (compress) and on
        the I/O thread (decode), as the node agent does (:mod:`bps.worker.codec_pool`)."""
        if env.role != "worker":
            raise ValueError(f"WorkerEngine needs DMLC_ROLE=worker, got {env.role!r}")
        key = load_key(env)
        ctx = ctx or zmq.Context.instance()
        keep_buffers_in_heap()
        link = SchedulerClient(ctx, env, "worker", env.node_host, key=key)
        try:
            welcome = link.rendezvous()
            return cls(env, ctx, link, welcome, tracer, key, codec_threads)
        except BaseException:
            link.close()
            raise

    # ------------------------------------------------------------------ public API

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the cumulative counters (see :class:`EngineStats`)."""
        with self._stats_lock:
            return EngineStats(**self._stats)

    def declare(self, key: int, numel: int, dtype: torch.dtype, params: dict | None,
                name: str = "", server: int | None = None,
                device: torch.device | None = None) -> None:
        """Register ``key`` with its server (blocking). ``params`` None: raw key.
        ``server``: the server index to hold it (``plan_servers``; every worker must
        pass the same), else the least-loaded one by raw bytes in declaration order.
        ``device``: the key's tensors live there (a GPU, or the CPU on the forced device
        path): its chain is built there where the compressor has device kernels, and
        payloads cross to the host through the key's staging buffers
        (:mod:`bps.worker.device_path`).

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
        staging = None if device is None else KeyStaging(torch.device(device),
                                                         self._cuda_graphs, name)
        if params is not None:
            chain = self._build_chain(params, numel, dtype, staging)
            if isinstance(chain, MultiRound):  # only its rounds travel (each declared)
                chain.set_workers(self.num_workers)
                self._declare_rounds(key, chain, name, server)
                self._keys[key] = KeyInfo(key, numel, dtype, name,
                                          self._rounds[key][0][0].server, chain,
                                          staging=staging)
                return
        largest = self._largest_key_bytes()
        if numel * dtype.itemsize > largest:
            raise ValueError(f"key {key} ({name!r}): {numel * dtype.itemsize} bytes is larger "
                             f"than a key may be ({largest} bytes: half of "
                             f"BPS_MAX_MESSAGE_BYTES, which follows BYTEPS_PARTITION_BYTES)")
        server = self.placement.place(key, numel * dtype.itemsize, server)
        info = KeyInfo(key, numel, dtype, name, server, chain, staging=staging)
        fields_ = {"key": key, "numel": numel, "dtype": wire_dtype, "name": name,
                   "params": params, "node": self.node_id}
        try:
            self._wait(self._io.request(Op.REGISTER, server, fields_, None,
                                     f"declare of {info_label(info)}", info),
                       f"declare of {info_label(info)}")
        except BaseException:
            self.placement.unplace(key, numel * dtype.itemsize)
            raise
        self._keys[key] = info

    def _build_chain(self, params: dict, numel: int, dtype: torch.dtype,
                     staging: KeyStaging | None) -> Any:
        """The key's worker chain: on the staging's device where the compressor has device
        kernels, else on the host (a registered compressor without them: logged once)."""
        from bps.compressors import build, supports_device

        if staging is None:
            return build(params, numel, dtype, role="worker")
        if supports_device(params):
            return build(params, numel, dtype, role="worker", device=staging.device)
        staging.host_chain = True
        if params["compressor"] not in self._host_chain_logged:
            self._host_chain_logged.add(params["compressor"])
            log.warning("compressor %r has no device kernels: its keys are copied to the "
                        "host uncompressed and compressed there", params["compressor"])
        return build(params, numel, dtype, role="worker")

    def _largest_key_bytes(self) -> int:
        """The most bytes one key's push may carry: half a message (its reply comes back
        in one too)."""
        return (self.env.max_message_bytes - 64) // 2

    def _declare_rounds(self, key: int, chain: MultiRound, name: str,
                        server: int | None) -> None:
        """A compressor with several rounds: round r travels as raw float32 keys of
        ``chain.round_numel(r)`` elements in all (``key + r * ROUND_KEY_STRIDE``), cut
        into pieces no larger than a key may be (piece j: ``+ j * PIECE_KEY_STRIDE``),
        all on one server, which sums each like any float32 key. A float32 sum element
        by element is the same whichever piece holds the element."""
        if key >= PIECE_KEY_STRIDE:
            raise ValueError(f"key {key} ({name!r}): a key whose compressor takes "
                             f"{chain.rounds} rounds must be below 2**40")
        rounds: list[list[KeyInfo]] = []
        try:
            for round_ in range(chain.rounds):
                cuts = partition(chain.round_numel(round_), 4, self._largest_key_bytes())
                pieces: list[KeyInfo] = []
                rounds.append(pieces)
                for index, (_, length) in enumerate(cuts):
                    wire_key = key + round_ * ROUND_KEY_STRIDE + index * PIECE_KEY_STRIDE
                    label = f"{name} round {round_}" + (f" piece {index}" if index else "")
                    self.declare(wire_key, length, torch.float32, None, name=label,
                                 server=server)
                    pieces.append(self._keys.pop(wire_key))
                    server = pieces[0].server
        finally:
            self._rounds[key] = rounds

    def _push_pieces(self, pieces: list[KeyInfo], payload: torch.Tensor, step: int,
                     lr: float, order: tuple, extra: dict | None
                     ) -> concurrent.futures.Future:
        """Push a round: each piece its slice of ``payload`` (a marker, ``extra``: each
        the marker). The future gives the pieces' sums in order, else the first
        :class:`Skipped` among them, else fails with the first error."""
        gathered = new_future()
        done: list[concurrent.futures.Future | None] = [None] * len(pieces)
        lock = threading.Lock()

        def arrived(index: int, future: concurrent.futures.Future) -> None:
            with lock:
                done[index] = future
                if any(f is None for f in done):
                    return
            error = next((f.exception() for f in done if f.exception() is not None), None)
            if error is not None:
                gathered.set_exception(error)
                return
            sums = [f.result() for f in done]
            gathered.set_result(next((s for s in sums if isinstance(s, Skipped)), sums))

        data = payload.reshape(-1).view(torch.uint8)
        offset = 0
        for index, wire in enumerate(pieces):
            piece = data if extra is not None else data[offset:offset + 4 * wire.numel]
            offset += 4 * wire.numel
            wire.busy = True
            inner = new_future()
            inner.add_done_callback(functools.partial(arrived, index))
            self._io.enqueue(wire, piece, step, lr, order, inner, extra)
        return gathered

    def _push_round(self, info: KeyInfo, round_: int, payload: torch.Tensor, step: int,
                    lr: float, order: tuple, future: concurrent.futures.Future,
                    extra: dict | None = None) -> None:
        """Push round ``round_`` of a multi-round key; its sum feeds the next round (on a
        codec thread), the last one is decoded into ``future``. ``extra``: a round-0
        non-finite mark; a skipped round settles ``future`` with its :class:`Skipped`."""
        for piece in self._rounds[info.key][round_]:
            piece.generation = info.generation
        inner = self._push_pieces(self._rounds[info.key][round_], payload, step, lr, order,
                                  extra)

        def next_round(sums: list[torch.Tensor] | Skipped) -> torch.Tensor | Skipped | None:
            if isinstance(sums, Skipped):
                return sums
            summed = sums[0] if len(sums) == 1 else torch.cat(sums)
            staging = info.staging
            if staging is None or staging.host_chain:
                if round_ + 1 == info.chain.rounds:
                    return decode_into(info.chain, summed, info.out)
                payload = info.chain.compress_round(round_ + 1, summed)
            else:  # up to the device, the next round's payload back down
                with on_side_stream(staging.device, None):
                    summed = staging.to_device(summed.view(torch.uint8).numpy(),
                                               torch.float32)
                    if round_ + 1 == info.chain.rounds:
                        result = decode_into(info.chain, summed, info.out)
                        wait_side_stream(staging.device)
                        return result
                    payload = staging.to_host(info.chain.compress_round(round_ + 1, summed))
                    wait_side_stream(staging.device)
            self._push_round(info, round_ + 1, payload, step, lr, order, future)
            return None

        inner.add_done_callback(lambda done: self._codec.then(info, future, done, next_round))

    def push_pull(self, key: int, tensor: torch.Tensor | None, step: int, lr: float,
                  priority: int = 0, out: torch.Tensor | None = None,
                  mark: str | None = None, what: str = "",
                  momentum_scale: float = 1.0, ready: torch.cuda.Event | None = None,
                  generation: int | None = None, divisor: float = 1.0
                  ) -> concurrent.futures.Future:
        """Push this node's (already averaged) partition; the future gives the aggregate,
        or a :class:`Skipped` where the server did not sum the step.

        ``out`` (compressed keys): a contiguous CPU tensor of the declared numel and dtype,
        ``tensor`` itself allowed, into which the aggregate is decoded (no new tensor);
        the future then gives ``out``. ``mark`` (``"nonfinite"`` or ``"zero"``, with
        ``tensor`` None): push that marker instead of values; ``what`` names the tensor
        in the skip every node then receives. ``momentum_scale``: the factor the chain's
        momentum is multiplied by first (a GradScaler's change of scale; compressed keys).

        A key declared with a ``device`` takes its ``tensor`` there, and ``out`` (raw keys
        too) is any float tensor of the declared numel on that device, cast into;
        ``ready``: a CUDA event after which ``tensor`` holds its values (the work is done
        on a side stream of a codec thread, never on the caller's).

        ``generation``: the membership generation whose members ``tensor`` was divided by
        (``BPS_MIN_WORKERS``; a pipeline's, which learns a new one when a step of it is
        skipped); None: the one this step number began with on this node's pushes.

        ``divisor`` (a key whose chain :meth:`divides_input`): ``tensor`` is not divided
        yet; the chain divides it by ``divisor`` in its first pass.
        """
        info = self._keys.get(key)
        if info is None:
            raise ValueError(f"key {key}: push_pull before declare")
        if mark is not None and mark not in MARKS:
            raise ValueError(f"{info_label(info)}: mark={mark!r}, expected one of {MARKS}")
        flat = torch.zeros(0, dtype=torch.uint8) if mark is not None else \
            tensor if tensor.dim() == 1 else tensor.reshape(-1)  # a torch op less
        if mark is None and (flat.numel() != info.numel or flat.dtype != info.dtype):
            raise ValueError(f"{info_label(info)}: tensor has numel={flat.numel()} dtype="
                             f"{flat.dtype}, declared numel={info.numel} dtype={info.dtype}")
        if out is not None and info.staging is not None:
            if out.numel() != info.numel or not out.is_floating_point() \
                    or out.device != info.staging.device or not out.is_contiguous():
                raise ValueError(f"{info_label(info)}: out must be a contiguous float tensor "
                                 f"of numel={info.numel} on {info.staging.device}")
        elif out is not None and (info.chain is None or out.numel() != info.numel
                                  or out.dtype != info.dtype or out.device.type != "cpu"
                                  or not out.is_contiguous()):
            raise ValueError(f"{info_label(info)}: out must be a contiguous CPU tensor of "
                             f"numel={info.numel} dtype={info.dtype}, for a compressed key")
        if mark is None and info.staging is not None and flat.device != info.staging.device:
            raise ValueError(f"{info_label(info)}: tensor is on {flat.device}, the key was "
                             f"declared on {info.staging.device}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{info_label(info)}: step={step!r} must be an int >= 0")
        if divisor != 1.0 and (mark is not None or not self.divides_input(key)):
            raise ValueError(f"{info_label(info)}: divisor={divisor!r}, but its chain does "
                             "not divide its input")
        self._io.raise_if_failed()
        if step > self._last_step:  # heartbeats carry it (the scheduler compares workers)
            self._last_step = self._link.step = step
        with self._io.lock:
            if info.busy:
                raise RuntimeError(f"{info_label(info)}: a push_pull is already in flight")
            info.busy = True
            info.out = None if out is None else out if out.dim() == 1 else out.reshape(-1)
            info.generation = self._io.push_generation(step) if generation is None \
                else generation
        future = new_future()
        order = send_order(step, priority, self._io.next_rid())
        if mark is not None and key in self._rounds:  # the marker travels as round 0
            self._push_round(info, 0, flat, step, lr, order, future,
                             {"mark": mark, "what": what})
        elif mark is not None:
            self._io.enqueue(info, flat, step, lr, order, future, {"mark": mark, "what": what})
        elif info.staging is not None and key in self._rounds:
            self._codec.compress_device(info, flat.contiguous(), ready, step, lr, future,
                                        lambda payload, extra: self._push_round(
                                            info, 0, payload, step, lr, order, future, extra),
                                        momentum_scale, what)
        elif info.staging is not None:
            self._codec.compress_device(info, flat.contiguous(), ready, step, lr, future,
                                        lambda payload, extra: self._io.enqueue(
                                            info, payload, step, lr, order, future, extra),
                                        momentum_scale, what)
        elif info.chain is None:
            self._io.enqueue(info, flat.contiguous(), step, lr, order, future)
        elif key in self._rounds:
            self._codec.compress(info, flat.contiguous(), step, lr, future,
                                 lambda payload, extra: self._push_round(
                                     info, 0, payload, step, lr, order, future, extra),
                                 momentum_scale)
        else:
            self._codec.compress(info, flat.contiguous(), step, lr, future,
                                 lambda payload, extra: self._io.enqueue(
                                     info, payload, step, lr, order, future, extra),
                                 momentum_scale, divisor, what)
        return future

    def divides_input(self, key: int) -> bool:
        """Whether ``push_pull(key, ..., divisor=d)`` works: a compressed key of one
        round whose host chain divides its input (``Compressor.divide_input``)."""
        info = self._keys[key]
        return info.chain is not None and info.staging is None \
            and key not in self._rounds and info.chain.divides_input

    def rollback(self, step: int, keys: list[int]) -> None:
        """Undo ``step`` on the compressed ``keys`` (one trainer's): each worker chain
        that compressed it returns to its state before; node 0 has each server do the
        same (``ABORT``, blocking). Call it once every push_pull of ``step`` has resolved
        and before any of the next step; every worker node calls it for the same steps.
        Node 0's ABORTs leave on its connections ahead of its next pushes, so a server
        always undoes a step before it can complete that key's next one."""
        compressed = [self._compressed_key(key) for key in keys]
        for info in compressed:
            if info.compressed_step == step:
                info.chain.rollback()
                info.compressed_step = -1
        if self.node_id != min(self.members):  # the lowest-numbered node present
            return
        futures = [self._io.request(Op.ABORT, info.server, {"key": info.key, "step": step},
                                    None, f"ABORT of {info_label(info)} step {step}", info)
                   for info in compressed]
        for info, future in zip(compressed, futures, strict=True):
            self._wait(future, f"ABORT of {info_label(info)} step {step}")

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the I/O thread whenever ``fd`` is readable, until
        :meth:`remove_reader`; it must neither block nor raise, and the pushes it makes
        leave in the same turn of the thread (the node agent reads its training
        process's frames so, :mod:`bps.worker.agent`)."""
        self._io.add_reader(fd, callback)

    def flush(self) -> None:
        """From a reader's callback: send the pushes it queued so far, before it goes on."""
        self._io.flush()

    def remove_reader(self, fd: int) -> None:
        """Stop the reader of ``fd`` (from its callback)."""
        self._io.remove_reader(fd)

    @property
    def io_running(self) -> bool:
        """Whether the I/O thread serves (False once the engine closed or failed)."""
        return self._io.running

    @property
    def generation(self) -> int:
        """The membership generation this node's pushes carry (0: the job's first)."""
        return self._io.generation

    @property
    def announced_generation(self) -> int:
        """The latest membership generation the scheduler announced to this node (its
        pushes take it up once the servers answer a step with it)."""
        return self._io.announced

    @property
    def members(self) -> tuple[int, ...]:
        """The worker nodes present in that generation."""
        return self._io.members

    def set_membership(self, generation: int, members: list[int]) -> None:
        """Push with membership ``generation`` of worker nodes ``members`` from now on (a
        joiner's, from its JOIN or the state it loaded); an older one changes nothing."""
        if generation > self._io.generation:
            self._io.set_generation(generation, tuple(sorted(members)))

    def join(self) -> tuple[int, list[int], int]:
        """A joining node becomes a member: (generation, members, source), ``source`` the
        worker node that sends it the training state (:meth:`fetch_state`)."""
        reply = self._wait(self._io.scheduler_request(Op.JOIN, (Op.JOIN,)),
                           f"JOIN of worker node {self.node_id}")
        self.joining = False
        self.set_membership(reply["generation"], list(reply["members"]))
        return reply["generation"], list(reply["members"]), int(reply["source"])

    def publish_state(self, generation: int, blob: bytes) -> None:
        """Send the training state a node joining at ``generation`` (or earlier) loads,
        through the scheduler, in chunks of STATE_CHUNK bytes."""
        for offset in range(0, max(len(blob), 1), STATE_CHUNK):
            self._wait(self._io.scheduler_request(
                Op.STATE, (Op.STATE, offset), generation=generation, offset=offset,
                total=len(blob), data=blob[offset:offset + STATE_CHUNK]),
                f"sending the joining node's state ({offset} of {len(blob)} bytes)")

    def fetch_state(self, generation: int, source: int) -> tuple[int, bytes]:
        """The state that worker node ``source`` sent for ``generation`` or a later one:
        (the generation it was sent for, the bytes). Waits up to BPS_TIMEOUT for each
        chunk (the source sends it at its next step boundary)."""
        what = f"state from worker node {source} (membership generation {generation})"
        first = self._wait(self._io.scheduler_request(
            Op.FETCH, (Op.STATE, 0), generation=generation, offset=0), what)
        total, sent_for = first["total"], first["generation"]
        parts = [first["data"]]
        for offset in range(STATE_CHUNK, total, STATE_CHUNK):
            parts.append(self._wait(self._io.scheduler_request(
                Op.FETCH, (Op.STATE, offset), generation=sent_for, offset=offset),
                what)["data"])
        blob = b"".join(parts)
        if len(blob) != total:
            raise ClusterError(f"{what}: {len(blob)} bytes arrived, expected {total}")
        return sent_for, blob

    def barrier(self) -> None:
        """Block until every worker node called barrier (up to ``BPS_TIMEOUT``)."""
        seq = self.barriers
        self.barriers += 1
        self._wait(self._io.scheduler_request(Op.BARRIER, (Op.RELEASE, seq), seq=seq,
                                              step=self._last_step),
                   f"barrier {seq} (waiting for all {self.num_workers} worker nodes)")

    def state_dict(self) -> dict:
        """``{"worker": {key: chain state}, "server": {key: server chain state}}``."""
        from bps.compressors import state_from_wire

        compressed = [info for info in self._keys.values() if info.chain is not None]
        server = {}
        # STATE_WINDOW requests out at a time: the server queues a bounded number of
        # replies for a connection (bps.server.server.PEER_QUEUE)
        for first in range(0, len(compressed), STATE_WINDOW):
            window = compressed[first:first + STATE_WINDOW]
            futures = [self._io.request(Op.GET_STATE, info.server, {"key": info.key}, None,
                                        f"GET_STATE of {info_label(info)}", info)
                       for info in window]
            for info, future in zip(window, futures, strict=True):
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
            items = list(state.get("server", {}).items())
            for first in range(0, len(items), STATE_WINDOW):
                futures = []
                for key, sd in items[first:first + STATE_WINDOW]:
                    info = self._compressed_key(key)
                    blob = msgpack.packb(state_to_wire(sd), use_bin_type=True)
                    fields_ = {"key": key, "nbytes": len(blob)}
                    futures.append(self._io.request(Op.SET_STATE, info.server, fields_, blob,
                                                    f"SET_STATE of {info_label(info)}", info))
                for future in futures:
                    self._wait(future, "SET_STATE")
        self.barrier()

    def close(self, failure: str | None = None) -> None:
        """Tell the scheduler this node is done (``failure``: that it gives up, and why;
        the scheduler then fails the job naming this node), stop the threads, close the
        sockets."""
        if self._io.closed:
            return
        if self._io.error is None and failure is None:
            try:
                self._wait(self._io.scheduler_request(Op.FINALIZE, (Op.BYE,),
                                                      step=self._last_step), "finalize")
            except ClusterError as exc:
                log.warning("close: %s", exc)
        elif failure is not None and not self._io.told_by_scheduler():
            # the scheduler answers BYE once it has it: the report is out before we exit
            try:
                # a scheduler that is there answers in milliseconds; one being stopped
                # with everything else must not hold the exit up
                self._io.report_failure(failure[:2000], min(2.0, self.env.heartbeat_timeout))
            except Exception as exc:  # noqa: BLE001 - best effort: the heartbeat rule remains
                log.warning("could not report the failure to the scheduler: %s", exc)
        self._io.stop()
        self._codec.shutdown()
        self._io.close()

    # ------------------------------------------------------------------ callers' side

    def _compressed_key(self, key: int) -> KeyInfo:
        info = self._keys.get(key)
        if info is None or info.chain is None:
            raise KeyError(f"key {key}: not declared as a compressed key on this worker")
        return info

    def _wait(self, future: concurrent.futures.Future, what: str) -> Any:
        try:
            return future.result(timeout=self.env.timeout + 2 * self.env.heartbeat_interval)
        except concurrent.futures.TimeoutError:
            raise ClusterError(f"{what}: no answer within {self.env.timeout:g} s "
                               f"(BPS_TIMEOUT)") from None

    def _add_stats(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, value in deltas.items():
                self._stats[name] += value

