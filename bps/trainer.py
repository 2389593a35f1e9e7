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
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from bps import runtime as bps_runtime
from bps.compressors.base import NonFiniteError
from bps.compressors.finite import FLOAT16_LIMIT, divide_checked, tensor_finite
from bps.config import validate_compression_params
from bps.model_sync import ModelMismatchError, broadcast_model, check_same_model
from bps.periodic import PeriodicAveraging, validate_sync_every
from bps.trainer_stats import StepStats
from bps.worker.engine import Skipped
from bps.worker.planning import (
    Bucket,
    Part,
    plan_batches,
    plan_buckets,
    plan_key_servers,
    plan_tensor,
)

__all__ = ["DistributedTrainer", "ModelMismatchError", "NonFiniteGradientError"]

log = logging.getLogger("bps")

_STOP = object()
_COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NonFiniteGradientError(NonFiniteError):
    """A worker's gradient had inf or NaN entries: the step was applied on no worker.

    ``step()`` raises it on every worker at that step (``compression_params['nonfinite']
    = 'raise'``, the default), naming the parameter, the worker node and the step.
    Parameters, optimizer, error-feedback and momentum buffers, RNG streams and the
    servers' state are as before the step, so training may go on after catching it."""


class _BucketSlice:
    """A member's share of its bucket's aggregate, with a future's ``result``."""

    def __init__(self, future: concurrent.futures.Future, offset: int, length: int) -> None:
        self.future, self.offset, self.length = future, offset, length

    def result(self, timeout: float | None = None) -> torch.Tensor | Skipped:
        result = self.future.result(timeout)
        if isinstance(result, Skipped):
            return result
        return result[self.offset:self.offset + self.length]


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
    wire: torch.dtype = torch.float32  # dtype of its raw keys
    local_momentum: torch.Tensor | None = None
    momentum_next: torch.Tensor | None = None  # this step's local momentum, until applied
    passes: int = 0  # backward passes that made its gradient ready this step
    ready: bool = False  # pushed this step
    nonfinite: bool = False  # this step's gradient has inf or NaN entries
    skipped: Skipped | None = None  # the servers did not sum this step
    futures: list = field(default_factory=list)


class DistributedTrainer:
    """Wraps a model and its optimizer for data-parallel training with bps.

    Args:
        model: the module; rank 0's parameters and buffers are copied to every rank.
        optimizer: a ``torch.optim`` optimizer over the model's parameters.
        compression_params: docs/compression.md dict (``None``: uncompressed). Validated here, on
            every rank, before any communication: a bad dict raises ``ValueError`` /
            ``TypeError`` naming the key.
        backward_passes_per_step: ``backward()`` calls per ``step()`` (gradient
            accumulation, Horovod's option of that name): gradients add up in ``.grad``
            as in plain PyTorch, and each partition is pushed once, during the last pass.
        sync_every: ``H > 1``: periodic averaging (:mod:`bps.periodic`): ``H`` local
            optimizer steps, then the pseudo-gradient travels and ``outer`` applies it.
        outer: the outer update of periodic averaging (``None``: the plain mean; see
            :func:`bps.periodic.validate_sync_every`).

    Each gradient is pushed once per step. Every rank saves its own ``state_dict()``
    (error-feedback state is per node). docs/trainer.md shows the training loops:
    accumulation, mixed precision with a GradScaler, non-finite gradients, ``join()``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 compression_params: dict | None = None,
                 backward_passes_per_step: int = 1, *, sync_every: int = 1,
                 outer: dict | None = None) -> None:
        outer_spec = validate_sync_every(sync_every, outer)
        if (isinstance(backward_passes_per_step, bool)
                or not isinstance(backward_passes_per_step, int)
                or backward_passes_per_step < 1):
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} is "
                             "invalid: expected an int >= 1")
        self._passes = backward_passes_per_step
        self._periodic: PeriodicAveraging | None = None
        self._sync_every = sync_every
        params = validate_compression_params(compression_params)
        if sync_every > 1 and params["momentum"] is not None and params["mu"] is None:
            raise ValueError(
                "compression_params['momentum'] = 'nesterov' with sync_every > 1 needs "
                "compression_params['mu']: that momentum acts on the pseudo-gradient, "
                "and the optimizer keeps its own for the local steps")
        self._rt = bps_runtime.get()
        self.model = model
        self.optimizer = optimizer
        self._fill_run_defaults(params)
        self.params = params
        self._compress = params["compressor"] is not None
        # intra-node reduction and uncompressed traffic (docs/compression.md, comm_dtype)
        self._wire_dtype = _COMM_DTYPES[params["comm_dtype"]]
        self._step = 0  # steps applied
        self._wire_step = 0  # steps attempted: the step number the pushes carry
        self._synced: bool | None = None  # this step's outcome, once synchronize() ran
        self._skip: Skipped | None = None  # why this step is skipped (None: applied)
        self._scaler = None  # the GradScaler that step() was given
        self._scale_ref: float | None = None  # its scale at the first step
        self._last_scale: float | None = None  # its scale at the step before
        self._joining = False  # inside join(): each step counts the nodes with data
        self._joined = False  # this worker ran out of data: it pushes zero markers
        self._join_future: concurrent.futures.Future | None = None
        self._active: list[int] = []  # the nodes with data this step (in join())
        self._last_active = 0  # the lowest of them in the last step any node had data
        self._error: BaseException | None = None
        self._done = 0
        self._cond = threading.Condition()
        self._stats = StepStats()
        self._engine_before: dict = {}
        self._step_started = False
        self._tracer = self._rt.tracer  # bps.trace: None unless BYTEPS_TRACE_ON=1
        self._last_step_end_ns: int | None = None
        self._buckets: list[Bucket] = []
        self._samples = 0  # samples this process's training forwards took this step

        check_same_model(self._rt, model)
        broadcast_model(self._rt, model)
        self._slots = self._build_slots()
        self._join_key = self._declare_join_key()
        if outer_spec is not None:
            self._periodic = PeriodicAveraging(self, sync_every, outer_spec)
        self._order = list(reversed(range(len(self._slots))))  # roughly backward order
        # Own channels: several trainers in one process must not interleave collectives.
        self._reduce_ch = self._rt.group.channel(self._rt.unique_name("reduce"))
        self._bcast_ch = self._rt.group.channel(self._rt.unique_name("broadcast"))
        self._flag_ch = self._rt.group.channel(self._rt.unique_name("flags"))
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
        self._sample_hook = model.register_forward_pre_hook(self._count_samples,
                                                            with_kwargs=True)
        self._hooks = [  # periodic averaging pushes from step() only
            slot.param.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, slot in enumerate(self._slots)
        ] if self._periodic is None else []

    # -- construction ----------------------------------------------------------------

    def _fill_run_defaults(self, params: dict) -> None:
        """Fill ``seed`` (job seed) and ``mu`` (optimizer momentum); turn that momentum off."""
        if params["seed"] is None:
            params["seed"] = int(self._rt.job_seed)
        if params["momentum"] is None:
            return
        if self._sync_every > 1:  # the chain's momentum acts on the pseudo-gradient
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
            if p.dtype not in PARAM_DTYPES:
                raise TypeError(f"parameter {name!r} is {p.dtype}: bps trains float32, "
                                "float16 and bfloat16 parameters")
            # raw keys travel in 16 bits with fp16 on (bfloat16 parameters in their own
            # dtype, for its range), else in float32; compressed keys, and their chains'
            # error and momentum buffers, are float32 whatever the parameter's dtype
            half = self._wire_dtype == torch.float16
            wire = p.dtype if p.dtype == torch.bfloat16 and half else self._wire_dtype
            parts, tensor_keys, alone = plan_tensor(name, p.numel(), self.params, wire,
                                                    self._rt.env.partition_bytes,
                                                    tuple(p.shape))
            keys += tensor_keys
            if alone is not None:
                small[len(slots)] = alone
            slot = _Slot(name, p, group_of[id(p)], parts, wire=wire)
            if self._rt.local_size > 1:
                node = wire if node_dtype != torch.float32 else node_dtype
                slot.send = torch.zeros(p.numel(), dtype=node, device=p.device)
                slot.recv = torch.zeros(p.numel(), dtype=node, device=p.device)
            if self.params["momentum"] is not None:
                slot.local_momentum = torch.zeros(p.numel(), dtype=torch.float32,
                                                  device=p.device)
                slot.momentum_next = torch.zeros_like(slot.local_momentum)
            slots.append(slot)
        for wire in dict.fromkeys(s.wire for s in slots):  # buckets hold one dtype each
            mine = {i: part for i, part in small.items() if slots[i].wire == wire}
            bucket_keys, buckets = plan_buckets([s.name for s in slots], mine, wire,
                                                self._rt.env.partition_bytes)
            keys += bucket_keys
            self._buckets += buckets
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

    def _declare_join_key(self) -> int:
        """A raw key of one float32 per worker node: in ``join()`` each step sums which
        nodes still have data (declared always: every worker declares the same keys)."""
        key = self._rt.allocate_keys(1)
        engine = self._rt.engine
        if engine is not None:
            engine.declare(key, engine.num_workers, torch.float32, None, name="join")
        return key

    # -- the step pipeline ------------------------------------------------------------

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._ready(index)
        return hook

    def _ready(self, index: int) -> None:
        """A backward pass finished this gradient; the last pass of the step pushes it."""
        slot = self._slots[index]
        slot.passes += 1
        if slot.passes > self._passes or slot.ready:
            raise RuntimeError(
                f"gradient of {slot.name!r} became ready {slot.passes} times in one step: "
                f"this trainer takes backward_passes_per_step={self._passes} backward() "
                "per trainer.step() (set it to accumulate gradients over several passes)")
        if slot.passes == self._passes:
            self._push(index)

    def _push(self, index: int) -> None:
        """A gradient is final: take this rank's share, check it, queue it for reduction."""
        slot = self._slots[index]
        slot.ready = True
        if self._tracer is not None:
            self._tracer.instant("ready", slot.name, self._step)
        if not self._step_started:  # stats count this step's traffic only
            self._step_started = True
            self._engine_before = self._stats.snapshot(self._rt.engine)
        grad = None if self._joined else slot.param.grad
        slot.nonfinite = False
        with torch.no_grad():
            if self._joined:
                slot.share = None  # pushes zero markers
            elif self._rt.local_size == 1 and grad is not None and grad.is_contiguous() \
                    and grad.dtype == torch.float32 and not grad.is_cuda:
                # A lone local rank pushes straight from .grad: each partition's result
                # arrives (and overwrites it) only after that partition was sent.
                flat = grad.detach().view(-1)
                slot.nonfinite = not divide_checked(flat.numpy(), self._rt.size,
                                                    self._limit(slot))
                slot.share = flat
            else:
                if slot.send is None:
                    slot.send = torch.empty(slot.param.numel(), dtype=torch.float32,
                                            device=slot.param.device)
                if grad is None:
                    slot.send.zero_()
                elif self._rt.local_size > 1:
                    # the node's root checks the node's sum, which any inf or NaN reaches
                    if slot.send.dtype == grad.dtype:
                        torch.div(grad.detach().reshape(-1), self._rt.size, out=slot.send)
                    else:  # divide in float32 first, so the fp16 copy cannot overflow
                        slot.send.copy_(grad.detach().reshape(-1).float().div(self._rt.size))
                elif grad.is_cuda:
                    slot.send.copy_(grad.detach().reshape(-1)).div_(self._rt.size)
                    slot.nonfinite = not tensor_finite(slot.send, self._limit(slot))
                elif grad.dtype == torch.float32 and grad.is_contiguous():
                    slot.nonfinite = not divide_checked(
                        grad.detach().view(-1).numpy(), self._rt.size, self._limit(slot),
                        slot.send.numpy())
                else:  # float16/bfloat16 (or strided): widen, then divide in float32
                    slot.send.copy_(grad.detach().reshape(-1))
                    slot.nonfinite = not divide_checked(slot.send.numpy(), self._rt.size,
                                                        self._limit(slot))
                slot.share = slot.send
        self._reduce_q.put(index)

    def _limit(self, slot: _Slot) -> np.float32:
        """The magnitude this step's gradient must stay under: float16's range where a
        part travels raw in float16 (beyond it the wire would carry inf), else inf."""
        if slot.wire == torch.float16:
            warm = self._step < self.params["warmup_steps"]
            if any(p.compressed_key is None or warm for p in slot.parts):
                return np.float32(FLOAT16_LIMIT)
        return np.float32(np.inf)

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
        if slot.share is not None:
            self._reduce_ch.reduce(slot.share)
        engine = self._rt.engine
        if engine is not None:
            lr = self._chain_lr(slot.group)
            warm = self._step < self.params["warmup_steps"]
            if slot.share is None:
                mark = "zero"
            else:
                share = slot.share.cpu() if slot.share.is_cuda else slot.share
                if self._rt.local_size > 1:  # the node's sum: every local rank's inf is in it
                    slot.nonfinite = not tensor_finite(share, self._limit(slot))
                mark = "nonfinite" if slot.nonfinite else None
            slot.futures = []
            for part in slot.parts:
                piece = None if mark else share[part.offset:part.offset + part.length]
                if part.bucket is not None and not (warm and part.raw_key is not None):
                    slot.futures.append(self._fuse(part, piece, lr, -index, mark, slot.name))
                    continue
                compressed = part.compressed_key is not None and not warm
                key = part.compressed_key if compressed else part.raw_key
                if mark:
                    slot.futures.append(engine.push_pull(key, None, self._wire_step, lr,
                                                         priority=-index, mark=mark,
                                                         what=slot.name))
                    continue
                # No copy where the dtype already fits: ``share`` is not written again
                # before step() has waited for these futures.
                out = None
                if compressed:
                    tensor = self._converted(part, piece, torch.float32)
                    if self._rt.local_size == 1:  # decoded straight into .grad (or its copy)
                        out = tensor
                else:
                    tensor = self._converted(part, piece, slot.wire)
                slot.futures.append(engine.push_pull(key, tensor, self._wire_step, lr,
                                                     priority=-index, out=out))
        self._bcast_q.put(index)

    def _chain_lr(self, group: int) -> float:
        """The group's learning rate, over the GradScaler's scale relative to its first
        one: the chains see scaled gradients, so error feedback's ``lr_prev / lr_now``
        then also rescales its residual when the scale changes."""
        if self._periodic is not None:  # the outer update's
            return self._periodic.lr
        lr = float(self.optimizer.param_groups[group]["lr"])
        if self._scaler is not None and self._scale_ref is not None:
            lr *= self._scale_ref / self._scaler.get_scale()
        return lr

    def _fuse(self, part: Part, piece: torch.Tensor | None, lr: float, priority: int,
              mark: str | None, name: str) -> _BucketSlice:
        """Copy ``piece`` into its bucket; the last member of the step pushes the bucket
        (a marker instead where a member has one: non-finite first, zero only where
        every member is zero). Returns the member's share of the aggregate. Runs on the
        reduce thread only."""
        bucket = part.bucket
        if bucket.arrived == 0:
            bucket.future = concurrent.futures.Future()
            bucket.mark = None
        if mark is None:
            bucket.buffer[part.bucket_offset:part.bucket_offset + part.length].copy_(piece)
        if mark is not None and (bucket.mark is None or bucket.mark[0] != "nonfinite"):
            bucket.mark = (mark, name)  # a joined worker marks every member zero
        bucket.arrived += 1
        share = _BucketSlice(bucket.future, part.bucket_offset, part.length)
        if bucket.arrived == bucket.members:
            bucket.arrived = 0
            engine = self._rt.engine
            if bucket.mark is not None:
                future = engine.push_pull(bucket.key, None, self._wire_step, lr,
                                          priority=priority, mark=bucket.mark[0],
                                          what=bucket.mark[1])
            else:
                future = engine.push_pull(bucket.key, bucket.buffer, self._wire_step, lr,
                                          priority=priority)
            _forward(future, bucket.future)
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
            slot.skipped = None
            # A lone local rank writes the aggregates straight into .grad (one copy less).
            dest = self._grad_view(slot) if self._rt.local_size == 1 else slot.recv
            if self._rt.engine is not None:
                for part, fut in zip(slot.parts, slot.futures, strict=True):
                    try:
                        result = fut.result(timeout=timeout)
                    except TimeoutError:
                        raise TimeoutError(f"no aggregate for {slot.name!r} (offset "
                                           f"{part.offset}) within {timeout:g}s") from None
                    if isinstance(result, Skipped):  # this step is applied nowhere
                        slot.skipped = slot.skipped or result
                        continue
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
        """``param.grad`` as a flat view (allocated where missing or strided)."""
        p = slot.param
        if p.grad is None or not p.grad.is_contiguous():
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return p.grad.view(-1)

    def _apply_local_momentum(self, slot: _Slot, grad: torch.Tensor) -> None:
        """Tensors that travel uncompressed get the chain's Nesterov rule here, into the
        second buffer: it becomes the momentum when the step is applied."""
        if slot.local_momentum is None or slot.skipped is not None:
            return
        mu = self.params["mu"]
        warm = self._step < self.params["warmup_steps"]
        rescale = self._scale_change()
        for part in slot.parts:
            if part.compressed_key is not None and not warm:
                continue
            g = grad[part.offset:part.offset + part.length]
            m = slot.local_momentum[part.offset:part.offset + part.length]
            m_next = slot.momentum_next[part.offset:part.offset + part.length]
            torch.mul(m, mu, out=m_next)
            if rescale != 1.0:  # a GradScaler's new scale: the momentum follows it
                m_next.mul_(rescale)
            m_next.add_(g)
            g.add_(m_next * mu)

    def _scale_change(self) -> float:
        """The GradScaler's scale over its scale at the step before (1 without one)."""
        if self._scaler is None or self._last_scale is None:
            return 1.0
        return self._scaler.get_scale() / self._last_scale

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"bps communication failed: {self._error}") from self._error

    def synchronize(self) -> bool:
        """Wait until every gradient of this step is averaged and written into ``.grad``.

        Returns whether the step is applied: False where a worker's gradient had inf or
        NaN entries (every worker returns False for the same step), and then ``.grad``
        holds NaN and every chain, on workers and servers, is back to its state before
        the step. ``step()`` calls it; call it yourself to clip gradients before."""
        if self._synced is not None:
            return self._synced
        for index, slot in enumerate(self._slots):
            if not slot.ready:  # no gradient this step (unused parameter): push zeros
                self._push(index)
        if self._joining and self._rt.engine is not None:
            flag = torch.zeros(self._rt.engine.num_workers, dtype=torch.float32)
            flag[self._rt.node_id] = 0.0 if self._joined else 1.0
            self._join_future = self._rt.engine.push_pull(self._join_key, flag,
                                                          self._wire_step, 0.0)
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
        skips = [s.skipped for s in self._slots if s.skipped is not None]
        skip = next((s for s in skips if s.reason == "nonfinite"), skips[0] if skips else None)
        if self._rt.local_size > 1:
            skip = self._share_skip(skip)
        if self._join_future is not None:
            counts = self._join_future.result(timeout=self._rt.env.timeout * 2)
            self._join_future = None
            self._active = [node for node, c in enumerate(counts.tolist()) if c]
            if self._active:
                self._last_active = self._active[0]
        self._skip = skip
        if skip is None:
            for slot in self._slots:  # the local momentum of this step becomes current
                if slot.local_momentum is not None:
                    slot.local_momentum, slot.momentum_next = (slot.momentum_next,
                                                               slot.local_momentum)
        elif skip.reason == "nonfinite":
            if self._rt.engine is not None:
                self._rt.engine.rollback(self._wire_step, [
                    part.compressed_key for slot in self._slots for part in slot.parts
                    if part.compressed_key is not None])
            with torch.no_grad():
                for slot in self._slots:
                    if slot.param.grad is not None:
                        slot.param.grad.fill_(float("nan"))
        self._synced = skip is None
        return self._synced

    def _share_skip(self, skip: Skipped | None) -> Skipped | None:
        """The node root's verdict on this step, for every local rank."""
        names = [s.name for s in self._slots]
        flag = torch.zeros(3, dtype=torch.float64)
        if self._rt.local_rank == 0 and skip is not None:
            flag[0] = 1 if skip.reason == "nonfinite" else 2
            flag[1] = skip.node
            flag[2] = names.index(skip.what) if skip.what in names else -1
        self._flag_ch.broadcast(flag)
        if flag[0] == 0:
            return None
        if self._rt.local_rank == 0:
            return skip
        what = names[int(flag[2])] if flag[2] >= 0 else ""
        return Skipped("nonfinite" if flag[0] == 1 else "zero", int(flag[1]), what, "")

    def step(self, scaler: torch.amp.GradScaler | None = None) -> bool:
        """Wait for the averaged gradients, then run ``optimizer.step()``; returns whether
        the step was applied.

        ``scaler``: a ``torch.amp.GradScaler`` whose ``scale(loss)`` the backward passes
        used; ``scaler.step`` unscales the aggregated gradient and skips the update where
        it is not finite (on every rank alike), then ``scaler.update()``. A step with a
        non-finite gradient on any worker is skipped everywhere; without a scaler,
        ``compression_params['nonfinite']`` says whether that raises
        :class:`NonFiniteGradientError` (``"raise"``, the default) or logs a warning."""
        called_ns = time.monotonic_ns()
        if self._periodic is not None:
            if not self._periodic.local_step(scaler):  # a local step: nothing travels
                self._stats.record(self._rt.engine, self._stats.snapshot(self._rt.engine),
                                   self._step, 0, 0.0, self._passes, False,
                                   self._samples * self._rt.local_size)
                self._samples = 0
                return True
            scaler = None  # the pseudo-gradient is not scaled
        if scaler is not None:
            self._scaler = scaler
            if self._scale_ref is None:
                self._scale_ref = scaler.get_scale()
        applied = self.synchronize()
        synced_ns = time.monotonic_ns()
        skip = self._skip
        if scaler is not None and not self._joined:
            scale = scaler.get_scale()
            if skip is None or skip.reason == "nonfinite":  # NaN .grad: the scaler skips
                scaler.step(self.optimizer)
                scaler.update()
            self._last_scale = scale
        elif self._periodic is not None:
            self._periodic.apply(applied)
        elif applied and not self._joined:
            self.optimizer.step()
        end_ns = time.monotonic_ns()
        if self._tracer is not None:
            if self._last_step_end_ns is not None:
                self._tracer.complete("compute", "", self._step, self._last_step_end_ns,
                                      called_ns)
            self._tracer.complete("wait", "", self._step, called_ns, synced_ns)
            self._tracer.complete("update", "", self._step, synced_ns, end_ns)
        self._last_step_end_ns = end_ns
        nonfinite = skip is not None and skip.reason == "nonfinite"
        self._stats.record(self._rt.engine, self._engine_before, self._step,
                           sum(s.param.numel() * 4 for s in self._slots),
                           (synced_ns - called_ns) / 1e9, self._passes, nonfinite,
                           self._samples * self._rt.local_size)
        self._samples = 0
        step = self._step
        self._step_started = False
        for slot in self._slots:
            slot.ready, slot.passes, slot.skipped = False, 0, None
        self._done = 0
        self._wire_step += 1
        if skip is None:
            self._step += 1
        self._synced, self._skip = None, None
        if nonfinite and scaler is None:
            beyond = " (or values beyond float16's range, which fp16 sends)" \
                if self._wire_dtype == torch.float16 else ""
            if skip.node < 0:  # the server's float16 sum of finite pushes
                what = f"the sum over the workers of {skip.what!r} overflows float16"
            else:
                what = (f"the gradient of {skip.what!r} on worker node {skip.node} has inf "
                        f"or NaN entries{beyond}")
            message = f"step {step}: {what}; the step was applied on no worker"
            if self.params["nonfinite"] == "raise":
                raise NonFiniteGradientError(
                    f"{message} (compression_params['nonfinite'] = 'skip' skips such steps)")
            log.warning("bps: %s: skipped (compression_params['nonfinite'] = 'skip')", message)
        return applied

    @contextlib.contextmanager
    def join(self):
        """Train on uneven inputs (DDP's ``Join``): a worker whose loop inside the block
        ends joins, and takes part in the steps the others still run with a zero
        contribution, until every worker has joined. The divisor stays the number of
        workers (``bps.size()``), as DDP's ``divide_by_initial_world_size``. Then every
        worker takes the parameters and buffers of the one that stepped last (the
        lowest node among them), so all leave with the same model.

        Example::

            >>> with trainer.join():
            ...     for x, y in my_shard:           # shards of different lengths
            ...         trainer.zero_grad()
            ...         loss_fn(model(x), y).backward()
            ...         trainer.step()
        """
        if self._rt.local_size > 1:
            raise NotImplementedError("trainer.join() needs one process per worker node "
                                      "(BYTEPS_LOCAL_SIZE=1)")
        if self._periodic is not None:
            raise NotImplementedError("trainer.join() is not supported with sync_every > 1")
        if self._step_started or any(s.passes for s in self._slots):
            raise RuntimeError("trainer.join() must be entered between steps")
        self._joining, self._active = True, []
        try:
            yield self
            self._joined = True
            while True:
                try:
                    self.step()
                except NonFiniteGradientError as exc:  # every worker raised it: go on
                    log.warning("bps: while joined: %s", exc)
                if not self._active:
                    break
            broadcast_model(self._rt, self.model, source=self._last_active)
        finally:
            self._joining = self._joined = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- statistics -------------------------------------------------------------------

    def _count_samples(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A training forward (grad on, module in train mode) adds the first dimension of
        its first tensor input (an argument, or a value of a dict, list or tuple one) to
        this step's samples."""
        if not (module.training and torch.is_grad_enabled()):
            return
        for arg in (*args, *kwargs.values()):
            inner = arg.values() if isinstance(arg, dict) else \
                arg if isinstance(arg, (list, tuple)) else (arg,)
            first = next((t for t in inner if isinstance(t, torch.Tensor) and t.dim() > 0),
                         None)
            if first is not None:
                self._samples += int(first.shape[0])
                return

    def stats(self) -> dict:
        """Figures of the last step, on local rank 0 (other local ranks report zero bytes).

        ``bytes_pushed`` / ``bytes_pulled``: payload bytes this node sent to and received
        from the servers; ``raw_bytes``: what one direction would carry uncompressed in
        float32; ``compression_ratio``: ``2 * raw_bytes / (pushed + pulled)``;
        ``compress_time``: seconds spent compressing and decompressing on this node;
        ``comm_time``: wall seconds during which at least one push was in flight;
        ``wait_time``: seconds ``step()`` blocked; ``backward_passes``: backward passes
        per step (each partition travels once per step however many passes);
        ``samples``: the node's samples in the step (the first dimension of the model's
        first tensor input, summed over this process's training forwards, times the
        local ranks); ``bytes_per_sample``: ``(pushed + pulled) / samples``; ``skipped``:
        a non-finite gradient made every worker skip the step. ``totals`` sums the byte
        counts, the steps and the skipped steps so far.
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
            "wire_step": self._wire_step,
            "scale": (self._scale_ref, self._last_scale),
            "rank": self._rt.rank,
            "optimizer": self.optimizer.state_dict(),
            "local_momentum": {s.name: s.local_momentum.clone() for s in self._slots
                               if s.local_momentum is not None},
            "engine": engine.state_dict() if engine is not None else None,
            "periodic": self._periodic.state_dict() if self._periodic is not None else None,
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
        self._wire_step = int(state.get("wire_step", self._step))
        self._scale_ref, self._last_scale = state.get("scale", (None, None))
        if self._periodic is not None:
            self._periodic.load_state_dict(state.get("periodic"))

    def close(self) -> None:
        """Stop the background threads and remove the gradient hooks."""
        for hook in self._hooks:
            hook.remove()
        self._sample_hook.remove()
        self._reduce_q.put(_STOP)
        self._bcast_q.put(_STOP)
        for bucket in self._buckets:  # a step left unfinished: members wait on no push
            if bucket.future is not None:
                bucket.future.cancel()
        for thread in self._threads:
            thread.join(timeout=5)
