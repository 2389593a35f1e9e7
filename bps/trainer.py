"""DistributedTrainer: data-parallel training through the bps parameter servers.

One training step (docs/architecture.md): as soon as a parameter's gradient is ready during
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

What goes where is planned by :mod:`bps.worker.planning`; the model is checked and
copied from rank 0 by :mod:`bps.model_sync`; the figures come from
:mod:`bps.trainer_stats`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from bps import runtime as bps_runtime
from bps.config import validate_compression_params
from bps.model_sync import ModelMismatchError, broadcast_model, check_same_model
from bps.trainer_stats import StepStats
from bps.worker.planning import (
    Bucket,
    Part,
    plan_batches,
    plan_buckets,
    plan_key_servers,
    plan_tensor,
)

__all__ = ["DistributedTrainer", "ModelMismatchError"]

log = logging.getLogger("bps")

_STOP = object()
_COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


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
class _Slot:
    """One parameter and its communication state."""

    name: str
    param: torch.Tensor
    group: int  # index of its optimizer param group (for the learning rate)
    parts: list[Part]
    send: torch.Tensor | None = None  # this rank's share, then the node's sum (local rank 0)
    recv: torch.Tensor | None = None  # the averaged gradient, broadcast within the node
    share: torch.Tensor | None = None  # what this step pushes: ``send`` or ``.grad`` itself
    local_momentum: torch.Tensor | None = None
    ready: bool = False
    futures: list = field(default_factory=list)


class DistributedTrainer:
    """Wraps a model and its optimizer for data-parallel training with bps.

    Args:
        model: the module; rank 0's parameters and buffers are copied to every rank.
        optimizer: a ``torch.optim`` optimizer over the model's parameters.
        compression_params: docs/compression.md dict (``None``: uncompressed). Validated here, on
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
        # intra-node reduction and uncompressed traffic (docs/compression.md, comm_dtype)
        self._wire_dtype = _COMM_DTYPES[params["comm_dtype"]]
        self._step = 0
        self._error: BaseException | None = None
        self._done = 0
        self._cond = threading.Condition()
        self._stats = StepStats()
        self._engine_before: dict = {}
        self._step_started = False
        self._tracer = self._rt.tracer  # bps.trace: None unless BYTEPS_TRACE_ON=1
        self._last_step_end_ns: int | None = None
        self._buckets: list[Bucket] = []

        check_same_model(self._rt, model)
        broadcast_model(self._rt, model)
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

    def _build_slots(self) -> list[_Slot]:
        """A slot per trainable parameter; its keys planned (:mod:`bps.worker.planning`)
        and declared with their servers."""
        group_of = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                group_of[id(p)] = gi
        slots, seen, keys = [], set(), []
        small: dict[int, Part] = {}  # slot index -> its only part, raw and under the bound
        node_dtype = self._wire_dtype if self._rt.local_size > 1 else torch.float32
        for name, p in self.model.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) not in group_of:
                raise ValueError(f"parameter {name!r} is not in the optimizer")
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name!r} is {p.dtype}: bps trains float32 models")
            parts, tensor_keys, alone = plan_tensor(name, p.numel(), self.params,
                                                    self._wire_dtype,
                                                    self._rt.env.partition_bytes,
                                                    tuple(p.shape))
            keys += tensor_keys
            if alone is not None:
                small[len(slots)] = alone
            slot = _Slot(name, p, group_of[id(p)], parts)
            if self._rt.local_size > 1:
                slot.send = torch.zeros(p.numel(), dtype=node_dtype, device=p.device)
                slot.recv = torch.zeros(p.numel(), dtype=node_dtype, device=p.device)
            if self.params["momentum"] is not None:
                slot.local_momentum = torch.zeros(p.numel(), dtype=torch.float32,
                                                  device=p.device)
            slots.append(slot)
        bucket_keys, self._buckets = plan_buckets([s.name for s in slots], small,
                                                  self._wire_dtype,
                                                  self._rt.env.partition_bytes)
        keys += bucket_keys
        keys, batches = plan_batches(keys)  # powersgd: same-shape matrices on one key
        self._buckets += batches
        engine = self._rt.engine
        servers = plan_key_servers(keys, engine.num_servers) if engine else [None] * len(keys)
        for plan, server in zip(keys, servers, strict=True):
            key = self._rt.allocate_keys(1)
            if engine is not None:
                engine.declare(key, plan.numel, plan.dtype, plan.params, name=plan.name,
                               server=server)
            setattr(plan.part, plan.field, key)
        return slots

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
            self._engine_before = self._stats.snapshot(self._rt.engine)
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
                if part.bucket is not None and not (warm and part.raw_key is not None):
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

    def _fuse(self, part: Part, piece: torch.Tensor, lr: float, priority: int
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
    def _converted(part: Part, piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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
        self._stats.record(self._rt.engine, self._engine_before, self._step,
                           sum(s.param.numel() * 4 for s in self._slots),
                           (synced_ns - called_ns) / 1e9)
        self._step_started = False
        for slot in self._slots:
            slot.ready = False
        self._done = 0
        self._step += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- statistics -------------------------------------------------------------------

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
        return self._stats.report()

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
