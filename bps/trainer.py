"""DistributedTrainer: data-parallel training through the bps parameter servers.

One training step (SPEC §1): as soon as a parameter's gradient is ready during
backward, its hook divides it by the total number of workers and hands it to a
background thread that reduces it to local rank 0 (fp16 where on), where it is cut
into partitions and pushed (compressed where configured) to the servers; a second
thread waits for the pulled aggregates, broadcasts them within the node and writes
them into ``.grad``. ``step()`` waits only for what is still in flight and then
calls the optimizer.

Usage (every worker process runs the same script under ``bpslaunch``)::

    >>> import bps, torch
    >>> bps.init()
    >>> model = torch.nn.Linear(784, 10)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> trainer = bps.DistributedTrainer(model, optimizer, {
    ...     "compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov"})
    >>> for x, y in loader:
    ...     trainer.zero_grad()
    ...     torch.nn.functional.cross_entropy(model(x), y).backward()
    ...     trainer.step()
    >>> trainer.stats()["compression_ratio"]
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from bps import runtime as bps_runtime
from bps.config import resolve_k, validate_compression_params
from bps.worker.partition import partition, plan_servers

log = logging.getLogger("bps")

_STOP = object()


class ModelMismatchError(ValueError):
    """The model's parameters or buffers differ between workers."""


@dataclass
class _Part:
    offset: int
    length: int
    raw_key: int | None = None  # travels uncompressed (always, or during warmup)
    compressed_key: int | None = None
    converted: torch.Tensor | None = None  # the piece in its key's dtype, reused every step
    bucket: _Bucket | None = None  # travels fused with other small tensors, at bucket_offset
    bucket_offset: int = 0


@dataclass
class _Bucket:
    """Small tensors next to each other in backward order that travel as one raw key
    (DDP's buckets, Horovod's tensor fusion): one message instead of one per tensor."""

    name: str
    numel: int
    members: int
    key: int | None = None
    buffer: torch.Tensor | None = None  # in the wire dtype; written by the reduce thread
    arrived: int = 0  # members copied in this step
    future: concurrent.futures.Future | None = None  # this step's aggregate


class _BucketSlice:
    """A member's share of its bucket's aggregate, with a future's ``result``."""

    def __init__(self, future: concurrent.futures.Future, offset: int, length: int) -> None:
        self.future, self.offset, self.length = future, offset, length

    def result(self, timeout: float | None = None) -> torch.Tensor:
        return self.future.result(timeout)[self.offset:self.offset + self.length]


def _forward(source: concurrent.futures.Future, target: concurrent.futures.Future) -> None:
    """Settle ``target`` as ``source`` settles (unless ``target`` was cancelled)."""
    def done(_: concurrent.futures.Future) -> None:
        if target.done():
            return
        if source.cancelled():
            target.cancel()
        elif source.exception() is not None:
            target.set_exception(source.exception())
        else:
            target.set_result(source.result())
    source.add_done_callback(done)


@dataclass
class _KeyPlan:
    """A key to declare once every key's server is planned."""

    part: _Part | _Bucket
    field: str  # the attribute of ``part`` that receives the key
    name: str
    numel: int
    dtype: torch.dtype
    params: dict | None
    wire_bytes: int  # bytes one push carries (at most)
    warmup_only: bool = False


@dataclass
class _Slot:
    """One parameter and its communication state."""

    name: str
    param: torch.Tensor
    group: int  # index of its optimizer param group (for the learning rate)
    parts: list[_Part]
    send: torch.Tensor | None = None  # this rank's share, then the node's sum (local rank 0)
    recv: torch.Tensor | None = None  # the averaged gradient, broadcast within the node
    share: torch.Tensor | None = None  # what this step pushes: ``send`` or ``.grad`` itself
    local_momentum: torch.Tensor | None = None
    ready: bool = False
    futures: list = field(default_factory=list)


def payload_bound(params: dict, numel: int, itemsize: int = 4) -> int | None:
    """Most bytes a built-in compressor's payload can take for ``numel`` elements
    (SPEC §4); ``None`` for registered compressors, which are trusted to compress."""
    name = params["compressor"]
    if name == "onebit":
        return math.ceil(numel / 8) + 16
    if name == "topk":
        return resolve_k(params, numel) * (4 + itemsize) + 16
    if name == "randomk":
        return resolve_k(params, numel) * itemsize + 32
    if name == "dithering":
        # Per element at most 2 bits of gap code, a sign bit and the Elias-delta code of q.
        levels = params["k"] if params["partition"] == "linear" else 2 ** (params["k"] - 1)
        n = levels.bit_length() - 1
        q_bits = n + 2 * (n + 1).bit_length() - 1
        return math.ceil(numel * (3 + q_bits) / 8) + 16
    return None


def plan_key_servers(keys: list[_KeyPlan], num_servers: int) -> list[int]:
    """A server for each key, balancing the bytes a step pushes (payload bounds for
    compressed keys): by raw bytes, a 2 MB partition that compresses to 40 KB would
    weigh as much as 50 small tensors that travel uncompressed. Keys that carry traffic
    only during warmup are balanced among themselves, on top of the raw keys that
    travel in both phases.

    Example::

        >>> part = _Part(0, 512000)
        >>> keys = [_KeyPlan(part, "compressed_key", "w[0]", 512000, torch.float32, {}, 40976),
        ...         _KeyPlan(part, "raw_key", "b", 11000, torch.float16, None, 22000),
        ...         _KeyPlan(part, "compressed_key", "w[1]", 512000, torch.float32, {}, 40976)]
        >>> plan_key_servers(keys, 2)
        [0, 0, 1]
    """
    steady = [i for i, k in enumerate(keys) if not k.warmup_only]
    warmup = [i for i, k in enumerate(keys) if k.warmup_only]
    servers = [0] * len(keys)
    plan = plan_servers([keys[i].wire_bytes for i in steady], num_servers)
    loads = [0] * num_servers
    for i, server in zip(steady, plan, strict=True):
        servers[i] = server
        if keys[i].params is None:
            loads[server] += keys[i].wire_bytes
    plan = plan_servers([keys[i].wire_bytes for i in warmup], num_servers, loads)
    for i, server in zip(warmup, plan, strict=True):
        servers[i] = server
    return servers


def _signature(model: torch.nn.Module) -> list:
    entries = [["param", n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]
    entries += [["buffer", n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()]
    return entries


def _first_difference(mine: list, reference: list) -> int:
    """1 + index of the first entry of ``reference`` that ``mine`` lacks or changes; 0 if equal."""
    for i, entry in enumerate(reference):
        if i >= len(mine) or mine[i] != entry:
            return i + 1
    return len(reference) + 1 if len(mine) > len(reference) else 0


class DistributedTrainer:
    """Wraps a model and its optimizer for data-parallel training with bps.

    Args:
        model: the module; rank 0's parameters and buffers are copied to every rank.
        optimizer: a ``torch.optim`` optimizer over the model's parameters.
        compression_params: SPEC §3 dict (``None``: uncompressed). Validated here, on
            every rank, before any communication: a bad dict raises ``ValueError`` /
            ``TypeError`` naming the key.

    One ``backward()`` per ``step()``: each gradient is pushed once per step. Every
    rank saves its own ``state_dict()`` (error-feedback state is per node).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 compression_params: dict | None = None) -> None:
        params = validate_compression_params(compression_params)
        self._rt = bps_runtime.get()
        self.model = model
        self.optimizer = optimizer
        self._fill_run_defaults(params)
        self.params = params
        self._compress = params["compressor"] is not None
        self._fp16 = params["fp16"]
        self._wire_dtype = torch.float16 if self._fp16 else torch.float32
        self._step = 0
        self._error: BaseException | None = None
        self._done = 0
        self._cond = threading.Condition()
        self._stats: dict = {}
        self._engine_before: dict = {}
        self._step_started = False
        self._tracer = self._rt.tracer  # bps.trace: None unless BYTEPS_TRACE_ON=1
        self._last_step_end_ns: int | None = None
        self._totals = {"steps": 0, "bytes_pushed": 0, "bytes_pulled": 0, "raw_bytes": 0}
        self._buckets: list[_Bucket] = []

        self._check_same_model()
        self._broadcast_model()
        self._slots = self._build_slots()
        self._order = list(reversed(range(len(self._slots))))  # roughly backward order
        # Own channels: several trainers in one process must not interleave collectives.
        self._reduce_ch = self._rt.group.channel(self._rt.unique_name("reduce"))
        self._bcast_ch = self._rt.group.channel(self._rt.unique_name("broadcast"))
        self._reduce_q: queue.Queue = queue.Queue()
        self._bcast_q: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._guarded, args=(self._reduce_loop,), daemon=True,
                             name="bps-reduce"),
            threading.Thread(target=self._guarded, args=(self._broadcast_loop,), daemon=True,
                             name="bps-broadcast"),
        ]
        for thread in self._threads:
            thread.start()
        self._hooks = [
            slot.param.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, slot in enumerate(self._slots)
        ]

    # -- construction ----------------------------------------------------------------

    def _fill_run_defaults(self, params: dict) -> None:
        """Fill ``seed`` (job seed) and ``mu`` (optimizer momentum); turn that momentum off."""
        if params["seed"] is None:
            params["seed"] = int(self._rt.job_seed)
        if params["momentum"] is None:
            return
        optimizer_mu = float(self.optimizer.param_groups[0].get("momentum", 0.0) or 0.0)
        if params["mu"] is None:
            if optimizer_mu == 0.0:
                raise ValueError(
                    "compression_params['momentum'] = 'nesterov' needs a coefficient: set "
                    "compression_params['mu'] or give the optimizer a nonzero momentum"
                )
            params["mu"] = optimizer_mu
        turned_off = False
        for group in self.optimizer.param_groups:
            if group.get("momentum"):
                group["momentum"] = 0.0
                turned_off = True
            if group.get("nesterov"):
                group["nesterov"] = False
        if turned_off and self._rt.rank == 0:
            log.warning("bps: the optimizer's momentum is turned off; Nesterov momentum "
                        "(mu=%g) runs in the compression chain instead", params["mu"])

    def _root_push_pull_from_node0(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """On local rank 0: node 0's ``flat`` (raw, summed with zeros from other nodes)."""
        engine = self._rt.engine
        pieces = partition(flat.numel(), flat.element_size(), self._rt.env.partition_bytes)
        first = self._rt.allocate_keys(len(pieces))
        source = flat if self._rt.node_id == 0 else torch.zeros_like(flat)
        for i, (_, length) in enumerate(pieces):
            engine.declare(first + i, length, flat.dtype, None, name=f"{name}[{i}]")
        futures = [
            engine.push_pull(first + i, source[offset:offset + length].contiguous(), 0, 0.0)
            for i, (offset, length) in enumerate(pieces)
        ]
        out = torch.empty_like(flat)
        for (offset, length), fut in zip(pieces, futures, strict=True):
            out[offset:offset + length].copy_(fut.result(timeout=self._rt.env.timeout * 2))
        return out

    def _node0_to_all(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank gets rank 0's ``flat`` (same shape and dtype on every rank)."""
        if self._rt.local_rank == 0:
            flat = self._root_push_pull_from_node0(flat, name)
        else:
            pieces = partition(flat.numel(), flat.element_size(), self._rt.env.partition_bytes)
            self._rt.allocate_keys(len(pieces))
        self._rt.setup_channel.broadcast(flat)
        return flat

    def _check_same_model(self) -> None:
        """Compare every rank's parameter/buffer names, shapes and dtypes with rank 0's."""
        mine = _signature(self.model)
        encoded = json.dumps(mine).encode()
        length = self._node0_to_all(torch.tensor([len(encoded)], dtype=torch.float64), "sig.len")
        raw = torch.zeros(int(length.item()), dtype=torch.float32)
        if self._rt.rank == 0:
            raw.copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
        reference = json.loads(bytes(self._node0_to_all(raw, "sig").to(torch.uint8).tolist()))
        # Every rank reports its first difference; all ranks learn all verdicts.
        verdict = torch.zeros(self._rt.size, dtype=torch.float64)
        verdict[self._rt.rank] = _first_difference(mine, reference)
        self._rt.setup_channel.reduce(verdict)
        verdict = self._sum_over_nodes(verdict, "sig.verdict")
        self._rt.setup_channel.broadcast(verdict)
        bad = [(r, int(v)) for r, v in enumerate(verdict.tolist()) if v]
        if bad:
            rank, index = bad[0]
            if index > len(reference):
                what = f"rank {rank} has more parameters/buffers than rank 0"
            else:
                kind, name, shape, dtype = reference[index - 1]
                detail = ""
                if rank == self._rt.rank and len(mine) >= index:
                    _, my_name, my_shape, my_dtype = mine[index - 1]
                    detail = (f"; rank {rank} has {my_name!r} with shape {tuple(my_shape)}, "
                              f"{my_dtype}")
                what = (f"{kind} {name!r} (shape {tuple(shape)}, {dtype} on rank 0) is missing "
                        f"or different on rank {rank}{detail}")
            raise ModelMismatchError(f"the model differs across workers: {what}")

    def _sum_over_nodes(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        engine = self._rt.engine
        key = self._rt.allocate_keys(1)
        if engine is None:
            return tensor
        engine.declare(key, tensor.numel(), tensor.dtype, None, name=name)
        return engine.push_pull(key, tensor, 0, 0.0).result(timeout=self._rt.env.timeout * 2)

    def _broadcast_model(self) -> None:
        """Overwrite every rank's parameters and buffers with rank 0's."""
        tensors = [p.data for p in self.model.parameters()] + list(self.model.buffers())
        for dtype in (torch.float32, torch.float64):
            # float64 carries float64 and integer tensors exactly (|x| < 2**53).
            chosen = [t for t in tensors if (t.dtype == torch.float64 or not t.is_floating_point())
                      == (dtype == torch.float64)]
            if not chosen:
                continue
            flat = torch.cat([t.detach().reshape(-1).to("cpu", dtype) for t in chosen])
            flat = self._node0_to_all(flat, f"init.{dtype}")
            offset = 0
            with torch.no_grad():
                for t in chosen:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _build_slots(self) -> list[_Slot]:
        group_of = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                group_of[id(p)] = gi
        slots, seen, keys = [], set(), []
        small: dict[int, _Part] = {}  # slot index -> its only part, raw and under the bound
        wire_dtype = self._wire_dtype
        node_dtype = torch.float16 if self._fp16 and self._rt.local_size > 1 else torch.float32
        for name, p in self.model.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) not in group_of:
                raise ValueError(f"parameter {name!r} is not in the optimizer")
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name!r} is {p.dtype}: bps trains float32 models")
            compress = self._compress and p.numel() * 4 >= self.params["min_compress_bytes"]
            parts = []
            pieces = partition(p.numel(), 4, self._rt.env.partition_bytes)
            for offset, length in pieces:
                part = _Part(offset, length)
                raw_bytes = length * wire_dtype.itemsize
                bound = payload_bound(self.params, length) if compress else None
                part_compressed = compress and (bound is None or bound < raw_bytes)
                label = f"{name}[{len(parts)}]"
                if (not part_compressed and len(pieces) == 1
                        and p.numel() * 4 < self.params["min_compress_bytes"]):
                    small[len(slots)] = part  # fused below, or a raw key of its own
                elif not part_compressed or self.params["warmup_steps"] > 0:
                    # a raw key of a compressed part carries traffic only during warmup
                    keys.append(_KeyPlan(part, "raw_key", label, length, wire_dtype, None,
                                         raw_bytes, warmup_only=part_compressed))
                if part_compressed:
                    keys.append(_KeyPlan(part, "compressed_key", label, length, torch.float32,
                                         self.params, raw_bytes if bound is None else bound))
                parts.append(part)
            slot = _Slot(name, p, group_of[id(p)], parts)
            if self._rt.local_size > 1:
                slot.send = torch.zeros(p.numel(), dtype=node_dtype, device=p.device)
                slot.recv = torch.zeros(p.numel(), dtype=node_dtype, device=p.device)
            if self.params["momentum"] is not None:
                slot.local_momentum = torch.zeros(p.numel(), dtype=torch.float32,
                                                  device=p.device)
            slots.append(slot)
        keys += self._plan_buckets(slots, small)
        engine = self._rt.engine
        servers = plan_key_servers(keys, engine.num_servers) if engine else [None] * len(keys)
        for plan, server in zip(keys, servers, strict=True):
            key = self._rt.allocate_keys(1)
            if engine is not None:
                engine.declare(key, plan.numel, plan.dtype, plan.params, name=plan.name,
                               server=server)
            setattr(plan.part, plan.field, key)
        return slots

    def _plan_buckets(self, slots: list[_Slot], parts: dict[int, _Part]) -> list[_KeyPlan]:
        """Key plans for the small tensors: runs of them next to each other in backward
        order share a bucket of up to BYTEPS_PARTITION_BYTES on the wire; one alone keeps
        a raw key of its own."""
        wire = self._wire_dtype
        capacity = max(1, self._rt.env.partition_bytes // wire.itemsize)
        runs: list[list[int]] = []
        run: list[int] | None = None  # the open run; a tensor that is not small ends it
        filled = 0  # elements in the open run
        for index in reversed(range(len(slots))):  # backward order
            if index not in parts:
                run = None
                continue
            if run is None or filled + parts[index].length > capacity:
                run, filled = [], 0
                runs.append(run)
            run.append(index)
            filled += parts[index].length
        plans = []
        for run in runs:
            if len(run) == 1:
                part = parts[run[0]]
                plans.append(_KeyPlan(part, "raw_key", f"{slots[run[0]].name}[0]", part.length,
                                      wire, None, part.length * wire.itemsize))
                continue
            numel = sum(parts[i].length for i in run)
            bucket = _Bucket("fused(" + ", ".join(slots[i].name for i in run) + ")", numel,
                             len(run), buffer=torch.zeros(numel, dtype=wire))
            self._buckets.append(bucket)
            offset = 0
            for i in run:
                parts[i].bucket, parts[i].bucket_offset = bucket, offset
                offset += parts[i].length
            plans.append(_KeyPlan(bucket, "key", bucket.name, numel, wire, None,
                                  numel * wire.itemsize))
        return plans

    # -- the step pipeline ------------------------------------------------------------

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._ready(index)
        return hook

    def _ready(self, index: int) -> None:
        """A gradient is final: take this rank's share and queue it for reduction."""
        slot = self._slots[index]
        if slot.ready:
            raise RuntimeError(
                f"gradient of {slot.name!r} became ready twice in one step: bps supports one "
                "backward() per trainer.step()"
            )
        slot.ready = True
        if self._tracer is not None:
            self._tracer.instant("ready", slot.name, self._step)
        if not self._step_started:  # stats count this step's traffic only
            self._step_started = True
            self._engine_before = self._engine_stats()
        grad = slot.param.grad
        with torch.no_grad():
            if self._rt.local_size == 1 and grad is not None and grad.is_contiguous() \
                    and not grad.is_cuda:
                # A lone local rank pushes straight from .grad: each partition's result
                # arrives (and overwrites it) only after that partition was sent.
                slot.share = grad.detach().view(-1).div_(self._rt.size)
            else:
                if slot.send is None:
                    slot.send = torch.empty(slot.param.numel(), dtype=torch.float32,
                                            device=slot.param.device)
                if grad is None:
                    slot.send.zero_()
                elif slot.send.dtype == grad.dtype:
                    torch.div(grad.detach().reshape(-1), self._rt.size, out=slot.send)
                else:  # divide in float32 first, so the fp16 copy cannot overflow
                    slot.send.copy_(grad.detach().reshape(-1).div(self._rt.size))
                slot.share = slot.send
        self._reduce_q.put(index)

    def _guarded(self, loop) -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - reported by step()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _reduce_loop(self) -> None:
        # With several local ranks the collectives must be issued in the same order on
        # all of them: parameters go through in a fixed order (self._order).
        ordered = self._rt.local_size > 1
        waiting: set[int] = set()
        position = 0
        while True:
            item = self._reduce_q.get()
            if item is _STOP:
                return
            if not ordered:
                self._reduce_and_push(item)
                continue
            waiting.add(item)
            while position < len(self._order) and self._order[position] in waiting:
                index = self._order[position]
                waiting.discard(index)
                self._reduce_and_push(index)
                position += 1
            if position == len(self._order):
                position = 0

    def _reduce_and_push(self, index: int) -> None:
        slot = self._slots[index]
        self._reduce_ch.reduce(slot.share)
        engine = self._rt.engine
        if engine is not None:
            lr = float(self.optimizer.param_groups[slot.group]["lr"])
            warm = self._step < self.params["warmup_steps"]
            share = slot.share.cpu() if slot.share.is_cuda else slot.share
            slot.futures = []
            for part in slot.parts:
                piece = share[part.offset:part.offset + part.length]
                if part.bucket is not None:
                    slot.futures.append(self._fuse(part, piece, lr, -index))
                    continue
                # No copy where the dtype already fits: ``share`` is not written again
                # before step() has waited for these futures.
                out = None
                if part.compressed_key is not None and not warm:
                    key, tensor = part.compressed_key, self._converted(part, piece,
                                                                       torch.float32)
                    if self._rt.local_size == 1:  # decoded straight into .grad (or its copy)
                        out = tensor
                else:
                    key, tensor = part.raw_key, self._converted(part, piece, self._wire_dtype)
                slot.futures.append(engine.push_pull(key, tensor, self._step, lr,
                                                     priority=-index, out=out))
        self._bcast_q.put(index)

    def _fuse(self, part: _Part, piece: torch.Tensor, lr: float, priority: int
              ) -> _BucketSlice:
        """Copy ``piece`` into its bucket; the last member of the step pushes the bucket.
        Returns the member's share of the aggregate. Runs on the reduce thread only."""
        bucket = part.bucket
        if bucket.arrived == 0:
            bucket.future = concurrent.futures.Future()
        bucket.buffer[part.bucket_offset:part.bucket_offset + part.length].copy_(piece)
        bucket.arrived += 1
        share = _BucketSlice(bucket.future, part.bucket_offset, part.length)
        if bucket.arrived == bucket.members:
            bucket.arrived = 0
            _forward(self._rt.engine.push_pull(bucket.key, bucket.buffer, self._step, lr,
                                               priority=priority), bucket.future)
        return share

    @staticmethod
    def _converted(part: _Part, piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``piece`` in ``dtype``: itself, or a copy in the part's own buffer. The buffer is
        free again, as the last step's push of this part has completed; a fresh tensor
        every step would cost a page fault per 4 KiB."""
        if piece.dtype == dtype:
            return piece
        if part.converted is None or part.converted.dtype != dtype:
            part.converted = torch.empty(part.length, dtype=dtype)
        return part.converted.copy_(piece)

    def _broadcast_loop(self) -> None:
        timeout = self._rt.env.timeout * 2
        while True:
            index = self._bcast_q.get()
            if index is _STOP:
                return
            slot = self._slots[index]
            # A lone local rank writes the aggregates straight into .grad (one copy less).
            dest = self._grad_view(slot) if self._rt.local_size == 1 else slot.recv
            if self._rt.engine is not None:
                for part, fut in zip(slot.parts, slot.futures, strict=True):
                    try:
                        result = fut.result(timeout=timeout)
                    except TimeoutError:
                        raise TimeoutError(f"no aggregate for {slot.name!r} (offset "
                                           f"{part.offset}) within {timeout:g}s") from None
                    target = dest[part.offset:part.offset + part.length]
                    if result.data_ptr() != target.data_ptr():
                        target.copy_(result)
                slot.futures = []
            if dest is slot.recv:
                self._bcast_ch.broadcast(slot.recv)
                dest = self._grad_view(slot)
                dest.copy_(slot.recv)
            self._apply_local_momentum(slot, dest)
            with self._cond:
                self._done += 1
                self._cond.notify_all()

    @staticmethod
    def _grad_view(slot: _Slot) -> torch.Tensor:
        """``param.grad`` as a flat float32 view (allocated where missing or strided)."""
        p = slot.param
        if p.grad is None or not p.grad.is_contiguous():
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return p.grad.view(-1)

    def _apply_local_momentum(self, slot: _Slot, grad: torch.Tensor) -> None:
        """Tensors that travel uncompressed get the chain's Nesterov rule here."""
        if slot.local_momentum is None:
            return
        mu = self.params["mu"]
        warm = self._step < self.params["warmup_steps"]
        for part in slot.parts:
            if part.compressed_key is not None and not warm:
                continue
            g = grad[part.offset:part.offset + part.length]
            m = slot.local_momentum[part.offset:part.offset + part.length]
            m.mul_(mu).add_(g)
            g.add_(m * mu)

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"bps communication failed: {self._error}") from self._error

    def synchronize(self) -> None:
        """Wait until every gradient of this step is averaged and written into ``.grad``."""
        for index, slot in enumerate(self._slots):
            if not slot.ready:  # no gradient this step (unused parameter): push zeros
                self._ready(index)
        deadline = time.monotonic() + self._rt.env.timeout * 2
        with self._cond:
            while self._done < len(self._slots) and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [s.name for s in self._slots if s.futures or not s.ready]
                    raise TimeoutError(f"step {self._step}: gradients still in flight after "
                                       f"{self._rt.env.timeout * 2:g}s: {missing[:5]}")
                self._cond.wait(left)
        self._raise_pending_error()

    def step(self) -> None:
        """Wait for the averaged gradients, then run ``optimizer.step()``."""
        called_ns = time.monotonic_ns()
        self.synchronize()
        synced_ns = time.monotonic_ns()
        self.optimizer.step()
        end_ns = time.monotonic_ns()
        if self._tracer is not None:
            if self._last_step_end_ns is not None:
                self._tracer.complete("compute", "", self._step, self._last_step_end_ns,
                                      called_ns)
            self._tracer.complete("wait", "", self._step, called_ns, synced_ns)
            self._tracer.complete("update", "", self._step, synced_ns, end_ns)
        self._last_step_end_ns = end_ns
        self._record_stats(self._engine_before, (synced_ns - called_ns) / 1e9)
        self._step_started = False
        for slot in self._slots:
            slot.ready = False
        self._done = 0
        self._step += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- statistics -------------------------------------------------------------------

    def _engine_stats(self) -> dict:
        engine = self._rt.engine
        if engine is None:
            return {}
        snapshot = engine.stats
        return {"bytes_pushed": snapshot.bytes_pushed, "bytes_pulled": snapshot.bytes_pulled,
                "compress_time": snapshot.compress_s + snapshot.decompress_s,
                "comm_time": snapshot.comm_s}

    def _record_stats(self, before: dict, wait: float) -> None:
        after = self._engine_stats()

        def delta(key: str) -> float:
            return after.get(key, 0) - before.get(key, 0)

        raw = sum(s.param.numel() * 4 for s in self._slots)
        pushed, pulled = int(delta("bytes_pushed")), int(delta("bytes_pulled"))
        self._stats = {
            "step": self._step,
            "bytes_pushed": pushed,
            "bytes_pulled": pulled,
            "raw_bytes": raw,
            "compression_ratio": (2 * raw / (pushed + pulled)) if pushed + pulled else 0.0,
            "compress_time": float(delta("compress_time")),
            "comm_time": float(delta("comm_time")),
            "wait_time": wait,
        }
        self._totals["steps"] += 1
        self._totals["bytes_pushed"] += pushed
        self._totals["bytes_pulled"] += pulled
        self._totals["raw_bytes"] += raw

    def stats(self) -> dict:
        """Figures of the last step, on local rank 0 (other local ranks report zero bytes).

        ``bytes_pushed`` / ``bytes_pulled``: payload bytes this node sent to and received
        from the servers; ``raw_bytes``: what one direction would carry uncompressed in
        float32; ``compression_ratio``: ``2 * raw_bytes / (pushed + pulled)``;
        ``compress_time``: seconds spent compressing and decompressing on this node;
        ``comm_time``: wall seconds during which at least one push was in flight;
        ``wait_time``: seconds ``step()`` blocked. ``totals`` sums the byte counts over
        all steps so far.
        """
        return dict(self._stats, totals=dict(self._totals))

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: step counter, optimizer state, local
        momentum buffers and (on local rank 0) every worker and server compressor's
        error, momentum and RNG state. Each rank saves its own."""
        engine = self._rt.engine
        return {
            "step": self._step,
            "rank": self._rt.rank,
            "optimizer": self.optimizer.state_dict(),
            "local_momentum": {s.name: s.local_momentum.clone() for s in self._slots
                               if s.local_momentum is not None},
            "engine": engine.state_dict() if engine is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (on the same rank of the same cluster shape)."""
        if state.get("rank") != self._rt.rank:
            raise ValueError(f"state_dict was saved by rank {state.get('rank')}, "
                             f"this is rank {self._rt.rank}")
        self.optimizer.load_state_dict(state["optimizer"])
        for slot in self._slots:
            if slot.local_momentum is not None:
                if slot.name not in state["local_momentum"]:
                    raise KeyError(f"state_dict has no momentum buffer for {slot.name!r}")
                slot.local_momentum.copy_(state["local_momentum"][slot.name])
        if self._rt.engine is not None:
            if state["engine"] is None:
                raise ValueError("state_dict has no engine state (saved on another local rank?)")
            self._rt.engine.load_state_dict(state["engine"])
        self._step = int(state["step"])

    def close(self) -> None:
        """Stop the background threads and remove the gradient hooks."""
        for hook in self._hooks:
            hook.remove()
        self._reduce_q.put(_STOP)
        self._bcast_q.put(_STOP)
        for bucket in self._buckets:  # a step left unfinished: members wait on no push
            if bucket.future is not None:
                bucket.future.cancel()
        for thread in self._threads:
            thread.join(timeout=5)
