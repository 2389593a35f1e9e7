"""The per-parameter gradient pipeline: partition -> push -> pull -> broadcast.

The one code path behind every front end (:class:`bps.DistributedTrainer`, the DDP
communication hook :mod:`bps.ddp`): for each parameter the caller hands over a SOURCE
tensor (what this rank contributes: ``.grad``, a DDP bucket's slice, a copy of
``.grad``) and a DESTINATION tensor (where the average over every worker lands:
``.grad`` again, the bucket's slice, a buffer of its own). Then:

1. :meth:`GradPipeline.push` divides the source by the number of workers (flagging inf
   and NaN in the same pass) and queues it;
2. a reduce thread sums the node's shares into local rank 0 (in the ``comm_dtype``),
   where each partition is pushed (compressed where planned) to its server, small
   tensors fused into buckets (:mod:`bps.worker.planning` plans it all);
3. a broadcast thread waits for the pulled aggregates, broadcasts them within the
   node, writes the destination, applies the local Nesterov rule of raw parts and
   calls the parameter's ``done`` callback (then ``on_step_done`` after the last one);
4. :meth:`finish` (after :meth:`wait`) settles the step on every local rank: committed,
   or, where a worker had a non-finite gradient, rolled back everywhere with NaN in
   every destination; :meth:`end_step` counts it.

Usage (one step; every local rank pushes every parameter once per step)::

    >>> pipe = GradPipeline(bps.core.runtime.get(), validated_params,
    ...                     [GradTensor(n, p) for n, p in model.named_parameters()],
    ...                     lr=lambda group: optimizer.param_groups[group]["lr"])
    >>> loss.backward()
    >>> for i, (_, p) in enumerate(model.named_parameters()):
    ...     pipe.push(i, source=p.grad, dest=p.grad.view(-1))   # in place, as the trainer
    >>> pipe.wait()
    >>> applied = pipe.finish() is None
    >>> pipe.end_step(applied)

The source is consumed: the pipeline divides it in place and may decode aggregates into
it when it is a contiguous float32 CPU tensor on a node of one local rank, and it must
not be written until the parameter's ``done`` callback ran. A one-step-delayed update
pushes a copy of ``.grad`` and gives a destination of its own; the source may also be
the destination (then it holds the average afterwards). ``dest`` is a contiguous flat
tensor of the parameter's numel in any float dtype.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from bps.common.config import COMM_DTYPES
from bps.compressors.device import forced_by_env
from bps.compressors.finite import FLOAT16_LIMIT, divide_checked, tensor_finite
from bps.compressors.momentum import nesterov_step_torch
from bps.compressors.warm import load_soon
from bps.worker.device_path import dedicated_stream, record_ready, release_stream
from bps.worker.engine import Skipped
from bps.worker.planning import (
    Bucket,
    Part,
    plan_batches,
    plan_buckets,
    plan_key_servers,
    plan_tensor,
)

__all__ = ["PARAM_DTYPES", "GradPipeline", "GradTensor", "Skipped"]

log = logging.getLogger("bps")

_STOP = object()
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NO_LIMIT = np.float32(np.inf)  # a float32 share's magnitude bound: finite is enough


class _BucketSlice:
    """A member's share of its bucket's aggregate, with a future's ``result``."""

    def __init__(self, future: concurrent.futures.Future, offset: int, length: int) -> None:
        self.future, self.offset, self.length = future, offset, length

    def result(self, timeout: float | None = None) -> torch.Tensor | Skipped:
        result = self.future.result(timeout)
        if isinstance(result, Skipped):
            return result
        return result[self.offset:self.offset + self.length]

    def add_done_callback(self, fn: Callable[[_BucketSlice], None]) -> None:
        self.future.add_done_callback(lambda _: fn(self))


def _flat(grad: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """A contiguous ``grad`` flat and outside autograd: ``dest`` itself where it is
    already that (a trainer hands ``.grad`` and its flat view), else a view. Every torch
    op releases the GIL, and a hook then waits to take it back from the threads that
    run Python meanwhile (docs/benchmarks.md, the GIL convoy); the checks here do not."""
    if (dest.dim() == 1 and dest.is_contiguous() and dest.numel() == grad.numel()
            and dest.dtype == grad.dtype and dest.device == grad.device
            and dest.data_ptr() == grad.data_ptr()
            and not (grad.requires_grad or dest.requires_grad)):
        return dest  # the same elements in the same order (grad is contiguous)
    return grad.detach().view(-1)


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
class GradTensor:
    """A tensor whose gradient the pipeline averages: ``param`` gives its shape, dtype and
    device (its values are not read); ``group`` is handed to the ``lr`` callable."""

    name: str
    param: torch.Tensor
    group: int = 0


@dataclass
class _Slot:
    """One parameter and its communication state."""

    name: str
    param: torch.Tensor
    group: int  # handed to lr(): the optimizer param group, for the learning rate
    parts: list[Part]
    send: torch.Tensor | None = None  # this rank's share, then the node's sum (local rank 0)
    recv: torch.Tensor | None = None  # the averaged gradient, broadcast within the node
    share: torch.Tensor | None = None  # what this step pushes: ``send`` or the source itself
    dest: torch.Tensor | None = None  # where this step's average lands (flat)
    done: Callable[[int], None] | None = None  # called once ``dest`` holds it
    wire: torch.dtype = torch.float32  # dtype of its raw keys
    local_momentum: torch.Tensor | None = None
    momentum_next: torch.Tensor | None = None  # this step's local momentum, until applied
    ready: bool = False  # pushed this step
    nonfinite: bool = False  # this step's gradient has inf or NaN entries
    divisor: float = 1.0  # what the chain divides ``share`` by (1: divided already)
    chain_divides: bool | None = None  # its compressed key's chain can (asked once)
    travelling: tuple[bool, list[Part]] | None = None  # (warm, its parts that travel then)
    skipped: Skipped | None = None  # the servers did not sum this step
    ready_event: torch.cuda.Event | None = None  # the device path: ``share`` is written
    reduced_event: torch.cuda.Event | None = None  # its reduce stream is done with ``send``
    futures: list = field(default_factory=list)


class SlotQueries:
    """What a front end asks of a pipeline's ``slots`` (each with ``name``, ``param``, ``ready``),
    whether it runs in this process or in the node agent."""

    slots: list
    _cond: threading.Condition
    _error: BaseException | None
    on_error: Callable[[BaseException], None] | None

    def _fail(self, exc: BaseException) -> None:
        """Record the pipeline's first failure, wake its waiters and report it
        (``on_error``); later failures change nothing."""
        with self._cond:
            if self._error is not None:
                return
            self._error = exc
            self._cond.notify_all()
        if self.on_error is not None:
            self.on_error(exc)

    @property
    def raw_bytes(self) -> int:
        """Bytes one step's gradients take uncompressed in float32."""
        return sum(s.param.numel() * 4 for s in self.slots)

    def pushed(self, index: int) -> bool:
        """Whether parameter ``index`` was pushed this step."""
        return self.slots[index].ready

    def pending(self) -> list[int]:
        """The parameters not pushed yet this step."""
        return [i for i, s in enumerate(self.slots) if not s.ready]

    def check_push(self, index: int, dest: torch.Tensor):
        """Parameter ``index``'s slot, where a push of it into ``dest`` may start: not
        pushed yet this step, ``dest`` contiguous with the parameter's numel."""
        slot = self.slots[index]
        if slot.ready:
            raise RuntimeError(f"gradient of {slot.name!r} pushed twice in one step")
        if dest.numel() != slot.param.numel() or not dest.is_contiguous():
            raise ValueError(f"dest of {slot.name!r} must be a contiguous tensor of "
                             f"{slot.param.numel()} elements")
        return slot


class GradPipeline(SlotQueries):
    """Averages gradients over every worker through the parameter servers, per parameter.

    Args:
        rt: the process's :class:`bps.core.runtime.Runtime`.
        params: validated compression_params (:func:`bps.compressors.validate_compression_params`)
            with ``seed`` (and, with momentum, ``mu``) filled in.
        tensors: the parameters, in model order (the same on every rank); their keys are
            planned and declared here, in this order, on every rank alike.
        lr: ``lr(group)``: the learning rate the chains get this step (error feedback's
            ``lr_prev / lr_now``; servers get it through the push header).
        rescale: the factor the momentum is multiplied by before this step's gradient is
            added, the local momentum of raw parts and the chains' of compressed ones (a
            GradScaler's change of scale; 1 without one).
        on_step_start: called with no argument at the first push of each step.
        on_step_done: called on the broadcast thread once every parameter's destination
            holds this step's average (before :meth:`finish`).
        on_error: called with the exception where a background thread fails (after it
            is recorded; :meth:`wait` then raises it).
        partition_bytes: the largest partition (default ``BYTEPS_PARTITION_BYTES``).
        inline: no reduce and broadcast threads (host chains only): :meth:`push` reduces
            and hands the parameter to the engine itself, and the thread that settles
            its last future writes the destination and calls ``done`` (the node agent,
            whose engine runs its chains inline too: one handoff per key, not five).

    Counters: ``step`` counts applied steps (warmup, local momentum), ``wire_step`` every
    step (the step number the pushes carry); :meth:`end_step` advances them.
    """

    shared_grads = False  # .grad is not in shared memory (bps.core.shared_pipeline)

    def __init__(self, rt, params: dict, tensors: list[GradTensor],
                 lr: Callable[[int], float], rescale: Callable[[], float] | None = None,
                 on_step_start: Callable[[], None] | None = None,
                 on_step_done: Callable[[], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 partition_bytes: int | None = None, inline: bool = False) -> None:
        self._rt = rt
        self.partition_bytes = partition_bytes or rt.env.partition_bytes
        self.params = params
        self._lr = lr
        self._rescale = rescale or (lambda: 1.0)
        self.on_step_start = on_step_start
        self.on_step_done = on_step_done
        self.on_error = on_error
        self.wire_dtype = getattr(torch, COMM_DTYPES[params["comm_dtype"]])
        self.step = 0  # steps applied
        self.wire_step = 0  # steps attempted: the step number the pushes carry
        self.started = False  # a push of this step happened
        self._error: BaseException | None = None
        self._done = 0
        self._cond = threading.Condition()
        self._tracer = rt.tracer
        self.buckets: list[Bucket] = []
        self.device = self._device_of(tensors)
        # the device path's number of workers: (as a number, as a tensor on the device)
        self._divisor: tuple[int, torch.Tensor] | None = None
        # CUDA gradients (or any, with BPS_DEVICE_KERNELS=1): the chains run on the
        # device and only payloads cross PCIe (bps.worker.device_path)
        self.on_device = self.device.type == "cuda" or forced_by_env()
        self.slots = self._build_slots(tensors)
        self._order = list(reversed(range(len(self.slots))))  # roughly backward order
        # Own channels: several pipelines in one process must not interleave collectives.
        self._reduce_ch = rt.group.channel(rt.unique_name("reduce"))
        self._bcast_ch = rt.group.channel(rt.unique_name("broadcast"))
        self._flag_ch = rt.group.channel(rt.unique_name("flags"))
        # the reduce thread's own stream: NCCL orders each collective after its caller's
        # stream, and reduce and broadcast queued on one shared stream in another order
        # on each rank wait for each other across ranks (a node of several GPUs)
        self._reduce_stream = dedicated_stream(self.device) \
            if self.on_device and rt.local_size > 1 else None
        self._reduce_q: queue.Queue = queue.Queue()
        self._bcast_q: queue.Queue = queue.Queue()
        self.inline = inline and not self.on_device
        self._threads = [] if self.inline else [
            threading.Thread(target=self._guarded, args=(self._reduce_loop,), daemon=True,
                             name="bps-reduce"),
            threading.Thread(target=self._guarded, args=(self._broadcast_loop,), daemon=True,
                             name="bps-broadcast"),
        ]
        for thread in self._threads:
            thread.start()

    # -- construction ----------------------------------------------------------------

    @staticmethod
    def _device_of(tensors: list[GradTensor]) -> torch.device:
        """The one device of every parameter (the device path needs them together)."""
        devices = {t.param.device for t in tensors}
        if len(devices) > 1:
            where = ", ".join(sorted(f"{t.name!r} on {t.param.device}" for t in tensors
                                     if t.param.device != tensors[0].param.device)[:3])
            raise ValueError(f"bps averages the gradients of parameters on one device; "
                             f"{tensors[0].name!r} is on {tensors[0].param.device}, {where}")
        return devices.pop() if devices else torch.device("cpu")

    def _build_slots(self, tensors: list[GradTensor]) -> list[_Slot]:
        """A slot per tensor; its keys planned (:mod:`bps.worker.planning`) and declared
        with their servers."""
        slots, keys = [], []
        small: dict[int, Part] = {}  # slot index -> its only part, raw and under the bound
        rt = self._rt
        node_dtype = self.wire_dtype if rt.local_size > 1 else torch.float32
        for tensor in tensors:
            name, p = tensor.name, tensor.param
            if p.dtype not in PARAM_DTYPES:
                raise TypeError(f"parameter {name!r} is {p.dtype}: bps trains float32, "
                                "float16 and bfloat16 parameters")
            # raw keys travel in 16 bits with fp16 on (bfloat16 parameters in their own
            # dtype, for its range), else in float32; compressed keys, and their chains'
            # error and momentum buffers, are float32 whatever the parameter's dtype
            half = self.wire_dtype == torch.float16
            wire = p.dtype if p.dtype == torch.bfloat16 and half else self.wire_dtype
            parts, tensor_keys, alone = plan_tensor(name, p.numel(), self.params, wire,
                                                    self.partition_bytes, tuple(p.shape))
            keys += tensor_keys
            if alone is not None:
                small[len(slots)] = alone
            slot = _Slot(name, p, tensor.group, parts, wire=wire)
            if rt.local_size > 1:
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
                                                self.partition_bytes,
                                                [s.param.numel() for s in slots])
            keys += bucket_keys
            self.buckets += buckets
        keys, batches = plan_batches(keys)  # powersgd: same-shape matrices on one key
        self.buckets += batches
        if self.on_device:
            for bucket in self.buckets:
                bucket.buffer = bucket.buffer.to(self.device)
        engine = rt.engine
        servers = plan_key_servers(keys, engine.num_servers) if engine else [None] * len(keys)
        for plan, server in zip(keys, servers, strict=True):
            key = rt.allocate_keys(1)
            if engine is not None:
                engine.declare(key, plan.numel, plan.dtype, plan.params, name=plan.name,
                               server=server,
                               device=self.device if self.on_device else None)
                if not self.on_device:  # the first push would wait for numba
                    load_soon(plan.params, plan.dtype)
            setattr(plan.part, plan.field, key)
        return slots

    # -- pushing -----------------------------------------------------------------------

    def push(self, index: int, source: torch.Tensor | None, dest: torch.Tensor,
             joined: bool = False, done: Callable[[int], None] | None = None) -> None:
        """Hand over parameter ``index``'s contribution for this step.

        ``source``: this rank's gradient (any shape, the parameter's numel; None: zeros),
        consumed (see the module's docs). ``dest``: a contiguous flat tensor of the same
        numel that receives the average over every worker (may be ``source``'s memory).
        ``joined``: this rank has no data (``join()``): a ``zero`` marker travels, no
        chain runs, nothing is added. ``done(index)`` runs on the broadcast thread once
        ``dest`` holds the average (the step may still be skipped: :meth:`finish`)."""
        slot = self._take(index, dest, done)
        grad = None if joined else source
        if grad is not None and grad.requires_grad:  # a create_graph backward's gradient
            grad = grad.detach()
        slot.nonfinite = False
        size = self._rt.size
        if joined:
            slot.share = None  # pushes zero markers
        elif self.on_device:
            slot.share = self._divide_on_device(slot, grad, size)
        elif self._rt.local_size == 1 and grad is not None and grad.is_contiguous() \
                and grad.dtype == torch.float32 and not grad.is_cuda:
            # A lone local rank pushes straight from the source: each partition's
            # result arrives (and may overwrite it) only after that partition was sent.
            flat = _flat(grad, slot.dest)
            if self._chain_divides(slot):  # in its first pass: one pass over it less
                slot.divisor = float(size)
            else:
                slot.nonfinite = not divide_checked(flat.numpy(), size,
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
                    torch.div(grad.detach().reshape(-1), size, out=slot.send)
                else:  # divide in float32 first, so the fp16 copy cannot overflow
                    slot.send.copy_(grad.detach().reshape(-1).float().div(size))
            elif grad.dtype == torch.float32 and grad.is_contiguous():
                slot.nonfinite = not divide_checked(
                    grad.detach().view(-1).numpy(), size, self._limit(slot),
                    slot.send.numpy())
            else:  # float16/bfloat16 (or strided): widen, then divide in float32
                slot.send.copy_(grad.detach().reshape(-1))
                slot.nonfinite = not divide_checked(slot.send.numpy(), size,
                                                    self._limit(slot))
            slot.share = slot.send
        if not self.inline:
            self._reduce_q.put(index)
        elif self._error is None:
            try:
                self._reduce_and_push(index)
            except BaseException as exc:  # noqa: BLE001 - reported by wait()
                self._fail(exc)

    def _take(self, index: int, dest: torch.Tensor,
              done: Callable[[int], None] | None) -> _Slot:
        """Parameter ``index``'s slot, taken for this step's push into ``dest`` (checked:
        :meth:`check_push`); the step starts with its first."""
        slot = self.check_push(index, dest)
        slot.ready, slot.divisor = True, 1.0
        slot.dest, slot.done = dest if dest.dim() == 1 else dest.view(-1), done
        if self._tracer is not None:
            self._tracer.instant("ready", slot.name, self.step)
        if not self.started:
            self.started = True
            if self.on_step_start is not None:
                self.on_step_start()
        return slot

    @staticmethod
    def _fused_bucket(slot: _Slot) -> Bucket | None:
        """The bucket the slot always travels in (a small raw tensor's), else None."""
        part = slot.parts[0]
        if len(slot.parts) == 1 and part.raw_key is None and part.compressed_key is None:
            return part.bucket
        return None

    def fused_groups(self) -> list[list[int]]:
        """The parameters of each bucket whose members always travel in it (small raw
        tensors), in model order: a caller that announces a bucket's members together
        hands them over with :meth:`push_fused`."""
        groups: dict[int, list[int]] = {}
        for index, slot in enumerate(self.slots):
            bucket = self._fused_bucket(slot)
            if bucket is not None:
                groups.setdefault(id(bucket), []).append(index)
        return [members for members in groups.values()
                if len(members) == self.slots[members[0]].parts[0].bucket.members]

    def push_fused(self, items: list[tuple[int, torch.Tensor | None, torch.Tensor, bool,
                                           Callable[[int], None] | None]]) -> None:
        """:meth:`push` of every member of one bucket (:meth:`fused_groups`), ``items``
        holding each push's arguments ``(index, source, dest, joined, done)`` in the
        order the members became final. Inline, on a node of one local rank, where each
        source is its flat float32 destination: the members are divided straight into a
        float32 bucket (a float16 or bfloat16 one: into its float32 copy, cast in one
        call), pushed with it, and land together (the same bits as :meth:`push` of each
        in turn; where the step is skipped, once :meth:`finish` filled the destinations).
        Otherwise each goes through :meth:`push`.

            >>> for members in pipe.fused_groups():   # once each is final
            ...     pipe.push_fused([(i, grads[i], grads[i], False, None) for i in members])
        """
        bucket = self._fusable(items)
        if bucket is None:
            for item in items:
                self.push(*item)
            return
        size = self._rt.size
        staged = self._float32_bucket(bucket)
        into = staged.numpy()
        mark = None
        for index, _, dest, _, done in items:
            slot = self._take(index, dest, done)
            part = slot.parts[0]
            slot.share = dest  # left undivided: its average lands in it
            # under the wire dtype's range (_limit), as push divides before _fuse casts
            slot.nonfinite = not divide_checked(
                dest.numpy(), size, self._limit(slot),
                into[part.bucket_offset:part.bucket_offset + part.length])
            if slot.nonfinite and mark is None:  # the first names the step's skip
                mark = ("nonfinite", slot.name)
        index = items[-1][0]  # the member that completed the bucket, as push's would
        lr = float(self._lr(self.slots[index].group))
        try:
            if mark is None and staged is not bucket.buffer:
                bucket.buffer.copy_(staged)
            if mark is not None:
                future = self._push_pull(bucket.key, None, lr, priority=-index,
                                         mark=mark[0], what=mark[1])
            else:
                future = self._push_pull(bucket.key, bucket.buffer, lr, priority=-index)
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self._fail(exc)
            return
        indices = [item[0] for item in items]
        for member in indices:
            self.slots[member].futures = [future]
        future.add_done_callback(lambda settled: self._land_fused(indices, settled))

    def _float32_bucket(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's buffer where it is float32, else a float32 buffer of its size
        (made once, zeros where no member lies: ``bucket.staged``) that
        :meth:`push_fused` divides into."""
        if bucket.buffer.dtype == torch.float32:
            return bucket.buffer
        if bucket.staged is None:
            bucket.staged = torch.zeros(bucket.buffer.numel())
        return bucket.staged

    def _fusable(self, items: list[tuple]) -> Bucket | None:
        """The bucket that :meth:`push_fused` can push ``items`` into in one pass, or
        None where each goes through :meth:`push`."""
        if not (self.inline and self._rt.local_size == 1 and self._rt.engine is not None
                and self._error is None and items):
            return None
        bucket = self._fused_bucket(self.slots[items[0][0]])
        if bucket is None or bucket.arrived or len(items) != bucket.members \
                or bucket.buffer.device.type != "cpu":
            return None
        for index, source, dest, joined, _ in items:
            if joined or source is not dest or self._fused_bucket(self.slots[index]) is not bucket \
                    or dest.dim() != 1 or dest.dtype != torch.float32 \
                    or dest.device.type != "cpu" or dest.requires_grad \
                    or not dest.is_contiguous():
                return None
        return bucket

    def _land_fused(self, indices: list[int], future: concurrent.futures.Future) -> None:
        """Land the members of a bucket that :meth:`push_fused` pushed: each one's share
        of the aggregate into its destination (nothing where the step was skipped)."""
        try:
            result = future.result()
            skipped = isinstance(result, Skipped)
            values = None
            if not skipped:  # widened in one call (numpy has no bfloat16)
                values = result.numpy() if result.dtype == torch.float32 else \
                    self._float32_bucket(self.slots[indices[0]].parts[0].bucket) \
                    .copy_(result).numpy()
            for index in indices:
                slot = self.slots[index]
                slot.futures = []
                slot.skipped = result if skipped else None
                if values is not None:
                    part = slot.parts[0]
                    np.copyto(slot.dest.numpy(),
                              values[part.bucket_offset:part.bucket_offset + part.length])
                self._landed(index, slot, slot.dest)
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self._fail(exc)

    def _divide_on_device(self, slot: _Slot, grad: torch.Tensor | None,
                          size: int) -> torch.Tensor:
        """This rank's share of a device-path gradient, divided by the number of workers on
        the stream that produced it; an event marks when it is ready. No host round trip:
        inf and NaN are found where each key is compressed or copied down."""
        numel = slot.param.numel()
        node_dtype = self._node_dtype(slot)
        # a tensor, not a Python number: CUDA multiplies by the reciprocal of a scalar
        # divisor, 1 ulp off a true division (which the host path and servers do)
        if self._divisor is None or self._divisor[0] != size:  # worker nodes left
            self._divisor = (size, torch.tensor(float(size), device=slot.param.device))
        divisor = self._divisor[1]
        if grad is not None and self._rt.local_size == 1 and grad.is_contiguous() \
                and grad.dtype == torch.float32:
            share = _flat(grad, slot.dest).div_(divisor)  # consumed in place, as on the host
        else:
            if slot.send is None:
                slot.send = torch.empty(numel, dtype=node_dtype, device=slot.param.device)
            share = slot.send
            if slot.reduced_event is not None:  # the last step's reduce of it, on its stream
                torch.cuda.current_stream(share.device).wait_event(slot.reduced_event)
            if grad is None:
                share.zero_()
            elif share.dtype == grad.dtype:
                torch.div(grad.detach().reshape(-1), divisor, out=share)
            else:  # divide in float32 first, so a float16 share cannot overflow
                share.copy_(grad.detach().reshape(-1).float().div(divisor))
        slot.ready_event = record_ready(share.device)
        return share

    def _chain_divides(self, slot: _Slot) -> bool:
        """Whether the slot travels as one compressed key this step whose chain divides
        the share by the number of workers in its first pass (it finds inf and NaN there
        too, and pushes a ``nonfinite`` marker naming the slot)."""
        if slot.chain_divides is None:
            parts = slot.parts
            divides = getattr(self._rt.engine, "divides_input", None)
            slot.chain_divides = len(parts) == 1 and parts[0].compressed_key is not None \
                and parts[0].bucket is None and divides is not None \
                and divides(parts[0].compressed_key)
        return slot.chain_divides and self.step >= self.params["warmup_steps"]

    def _node_dtype(self, slot: _Slot) -> torch.dtype:
        """The dtype the node's local ranks sum a slot in."""
        return slot.wire if self._rt.local_size > 1 and self.wire_dtype != torch.float32 \
            else torch.float32

    def _limit(self, slot: _Slot) -> np.float32:
        """The magnitude this step's gradient must stay under: float16's range where a
        part travels raw in float16 (beyond it the wire would carry inf), else inf."""
        if slot.wire == torch.float16:
            warm = self.step < self.params["warmup_steps"]
            if any(p.compressed_key is None or warm for p in slot.parts if p.travels(warm)):
                return np.float32(FLOAT16_LIMIT)
        return _NO_LIMIT

    def _guarded(self, loop) -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            if self.on_error is not None:
                self.on_error(exc)

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
        slot = self.slots[index]
        if self.on_device:
            self._reduce_and_push_on_device(index, slot)
            return
        if slot.share is not None:
            self._reduce_ch.reduce(slot.share)
        engine = self._rt.engine
        if engine is not None:
            lr = float(self._lr(slot.group))
            warm = self.step < self.params["warmup_steps"]
            if slot.share is None:
                mark = "zero"
            else:
                share = slot.share
                if self._rt.local_size > 1:  # the node's sum: every local rank's inf is in it
                    slot.nonfinite = not tensor_finite(share, self._limit(slot))
                mark = "nonfinite" if slot.nonfinite else None
            slot.futures = []
            for part in self._travelling(slot):
                piece = None if mark else share if part.length == share.shape[0] \
                    else share[part.offset:part.offset + part.length]  # no view of it all
                if part.bucket is not None and not (warm and part.raw_key is not None):
                    slot.futures.append(self._fuse(part, piece, lr, -index, mark, slot.name))
                    continue
                compressed = part.compressed_key is not None and not warm
                key = part.compressed_key if compressed else part.raw_key
                if mark:
                    slot.futures.append(self._push_pull(key, None, lr,
                                                         priority=-index, mark=mark,
                                                         what=slot.name))
                    continue
                # No copy where the dtype already fits: ``share`` is not written again
                # before this step's futures resolved.
                out = None
                if compressed:
                    tensor = self._converted(part, piece, torch.float32)
                    if self._rt.local_size == 1:  # decoded straight into the share
                        out = tensor
                else:
                    tensor = self._converted(part, piece, slot.wire)
                options = {"divisor": slot.divisor, "what": slot.name} \
                    if slot.divisor != 1.0 else {}
                slot.futures.append(self._push_pull(
                    key, tensor, lr, priority=-index, out=out,
                    momentum_scale=self._rescale() if compressed else 1.0, **options))
        if self.inline:
            self._land_when_settled(index, slot)
        else:
            self._bcast_q.put(index)

    def _reduce_and_push_on_device(self, index: int, slot: _Slot) -> None:
        """The device path of :meth:`_reduce_and_push`: the node's sum stays on the device
        (NCCL), each part is cast or handed to its chain there, and every push carries an
        event after which its input is ready; aggregates are decoded on the device straight
        into the destination (local rank 0's ``recv`` on a node of several)."""
        if self._reduce_stream is None:
            self._reduce_and_push_here(index, slot)
            return
        with torch.cuda.stream(self._reduce_stream):
            self._reduce_and_push_here(index, slot)
            # what read or wrote the share: its next division waits for it
            slot.reduced_event = record_ready(self.device)

    def _reduce_and_push_here(self, index: int, slot: _Slot) -> None:
        """:meth:`_reduce_and_push_on_device` on the current stream."""
        share = slot.share
        if share is not None and slot.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready_event)
        if share is not None:
            self._reduce_ch.reduce(share)
        engine = self._rt.engine
        if engine is not None:
            lr = float(self._lr(slot.group))
            warm = self.step < self.params["warmup_steps"]
            target = slot.dest if self._rt.local_size == 1 else slot.recv
            slot.futures = []
            pushes = []
            for part in self._travelling(slot):
                piece = None if share is None else share[part.offset:part.offset + part.length]
                if part.bucket is not None and not (warm and part.raw_key is not None):
                    slot.futures.append(self._fuse(part, piece, lr, -index,
                                                   None if piece is not None else "zero",
                                                   slot.name))
                    continue
                compressed = part.compressed_key is not None and not warm
                key = part.compressed_key if compressed else part.raw_key
                if piece is None:
                    slot.futures.append(self._push_pull(key, None, lr,
                                                         priority=-index, mark="zero",
                                                         what=slot.name))
                    continue
                tensor = self._converted(part, piece, torch.float32 if compressed
                                         else slot.wire)
                out = target[part.offset:part.offset + part.length]
                pushes.append((key, tensor, out, compressed))
            ready = record_ready(self.device)  # after the node's sum and the casts
            for key, tensor, out, compressed in pushes:
                slot.futures.append(self._push_pull(
                    key, tensor, lr, priority=-index, out=out, ready=ready,
                    what=slot.name, momentum_scale=self._rescale() if compressed else 1.0))
        self._bcast_q.put(index)

    def _push_pull(self, key: int, tensor: torch.Tensor | None, lr: float,
                   **options: object) -> concurrent.futures.Future:
        """The engine's push_pull of ``key`` in this step, with the membership generation
        whose members the shares were divided by (the runtime's: it changes only when a
        step is settled, so every push of a step carries the same, and another pipeline's
        steps do not change it for this one's)."""
        return self._rt.engine.push_pull(key, tensor, self.wire_step, lr,
                                         generation=self._rt.generation, **options)

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
            if part.in_bucket is None:  # the same view every step: made once
                part.in_bucket = bucket.buffer[part.bucket_offset:
                                               part.bucket_offset + part.length]
            part.in_bucket.copy_(piece)
        if mark is not None and (bucket.mark is None or bucket.mark[0] != "nonfinite"):
            bucket.mark = (mark, name)  # a joined worker marks every member zero
        bucket.arrived += 1
        share = _BucketSlice(bucket.future, part.bucket_offset, part.length)
        if bucket.arrived == bucket.members:
            bucket.arrived = 0
            if bucket.mark is not None:
                future = self._push_pull(bucket.key, None, lr,
                                          priority=priority, mark=bucket.mark[0],
                                          what=bucket.mark[1])
            elif self.on_device:  # the aggregate comes back into the bucket
                future = self._push_pull(bucket.key, bucket.buffer, lr,
                                          priority=priority, out=bucket.buffer,
                                          ready=record_ready(self.device))
            else:
                future = self._push_pull(bucket.key, bucket.buffer, lr,
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
        if part.converted is None or part.converted.dtype != dtype \
                or part.converted.device != piece.device:
            part.converted = torch.empty(part.length, dtype=dtype, device=piece.device)
        return part.converted.copy_(piece)

    def _land_when_settled(self, index: int, slot: _Slot) -> None:
        """Inline: :meth:`_land` the parameter on the thread that settles the last of its
        futures (this one, where they all are already)."""
        futures = list(slot.futures)
        if len(futures) <= 1:  # most parameters: nothing to count
            if futures:
                futures[0].add_done_callback(lambda _: self._land_or_fail(index))
            else:
                self._land_or_fail(index)
            return
        left = [len(futures) + 1]
        lock = threading.Lock()

        def settled(_: object = None) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            self._land_or_fail(index)

        for future in futures:
            future.add_done_callback(settled)
        settled()

    def _land_or_fail(self, index: int) -> None:
        try:
            self._land(index)
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self._fail(exc)

    def _broadcast_loop(self) -> None:
        while True:
            index = self._bcast_q.get()
            if index is _STOP:
                return
            self._land(index)

    def _land(self, index: int) -> None:
        """Parameter ``index``'s aggregates into its destination (after the node's
        broadcast), its local momentum, ``done``; ``on_step_done`` after the step's last."""
        timeout = self._rt.env.timeout * 2
        slot = self.slots[index]
        slot.skipped = None
        # A lone local rank writes the aggregates straight into dest (one copy less).
        dest = slot.dest if self._rt.local_size == 1 else slot.recv
        if self._rt.engine is not None:
            for part, fut in zip(self._travelling(slot), slot.futures, strict=True):
                try:
                    result = fut.result(timeout=timeout)
                except TimeoutError:
                    raise TimeoutError(f"no aggregate for {slot.name!r} (offset "
                                       f"{part.offset}) within {timeout:g}s") from None
                if isinstance(result, Skipped):  # this step is applied nowhere
                    slot.skipped = slot.skipped or result
                    continue
                target = dest if part.length == dest.shape[0] \
                    else dest[part.offset:part.offset + part.length]
                if result.data_ptr() != target.data_ptr():
                    target.copy_(result)
            slot.futures = []
        if dest is slot.recv:
            self._bcast_ch.broadcast(slot.recv)
            dest = slot.dest
            dest.copy_(slot.recv)
        self._landed(index, slot, dest)

    def _landed(self, index: int, slot: _Slot, dest: torch.Tensor) -> None:
        """The end of parameter ``index``'s landing, its average in ``dest``: its local
        momentum, ``done``, the count (``on_step_done`` after the step's last)."""
        self._apply_local_momentum(slot, dest)
        if slot.done is not None:
            slot.done(index)
        with self._cond:
            self._done += 1
            last = self._done == len(self.slots)
            if last:  # wait() waits for the step's last parameter only
                self._cond.notify_all()
        if last and self.on_step_done is not None:
            self.on_step_done()

    def _travelling(self, slot: _Slot) -> list[Part]:
        """The parts that carry the slot this step (a PowerSGD matrix: raw partitions
        during warmup, the whole matrix compressed after)."""
        warm = self.step < self.params["warmup_steps"]
        if slot.travelling is None or slot.travelling[0] != warm:
            slot.travelling = (warm, [part for part in slot.parts if part.travels(warm)])
        return slot.travelling[1]

    def _apply_local_momentum(self, slot: _Slot, grad: torch.Tensor) -> None:
        """Tensors that travel uncompressed get the chain's Nesterov rule here, into the
        second buffer: it becomes the momentum when the step is applied."""
        if slot.local_momentum is None or slot.skipped is not None:
            return
        mu = self.params["mu"]
        warm = self.step < self.params["warmup_steps"]
        rescale = self._rescale()
        for part in self._travelling(slot):
            if part.compressed_key is not None and not warm:
                continue
            g = grad[part.offset:part.offset + part.length]
            m = slot.local_momentum[part.offset:part.offset + part.length]
            m_next = slot.momentum_next[part.offset:part.offset + part.length]
            # the chain's rule and rounding; a GradScaler's new scale rescales the decay
            g.copy_(nesterov_step_torch(g, m, mu * rescale, mu, torch.empty_like(g), m_next))

    # -- settling a step -----------------------------------------------------------------

    def raise_pending_error(self) -> None:
        """Raise what a background thread failed with, if anything."""
        if self._error is not None:
            raise RuntimeError(f"bps communication failed: {self._error}") from self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block until every parameter pushed this step has its average in ``dest``
        (``timeout``: seconds, default twice ``BPS_TIMEOUT``; then TimeoutError naming
        what is still in flight). Every parameter must have been pushed."""
        timeout = self._rt.env.timeout * 2 if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._done < len(self.slots) and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [s.name for s in self.slots if s.futures or not s.ready]
                    raise TimeoutError(f"step {self.step}: gradients still in flight after "
                                       f"{timeout:g}s: {missing[:5]}")
                self._cond.wait(left)
        self.raise_pending_error()

    def finish(self) -> Skipped | None:
        """Settle the step once every destination is written (after :meth:`wait`, or in
        ``on_step_done``), on every local rank alike: None where it is applied (the
        local momentum of this step becomes current); else why not. A non-finite
        gradient on any worker returns every chain, on workers and servers, to its state
        before the step and fills every destination with NaN."""
        skips = [s.skipped for s in self.slots if s.skipped is not None]
        moved = max((s for s in skips if s.reason == "membership"),
                    key=lambda s: s.generation, default=None)
        skip = next((s for s in skips if s.reason == "nonfinite"),
                    moved or (skips[0] if skips else None))
        if self._rt.local_size > 1:
            skip, moved = self._share_skip(skip, moved)
        if moved is not None:  # worker nodes left: the next steps divide by those present
            self._rt.set_membership(moved.generation, list(moved.members))
        if skip is None:
            for slot in self.slots:  # the local momentum of this step becomes current
                if slot.local_momentum is not None:
                    slot.local_momentum, slot.momentum_next = (slot.momentum_next,
                                                               slot.local_momentum)
        elif skip.reason in ("nonfinite", "membership"):
            if self._rt.engine is not None:
                self._rt.engine.rollback(self.wire_step, self.compressed_keys())
            # a step dropped because worker nodes left averages nothing: zeros (a DDP
            # loop's optimizer.step() then steps on a zero gradient, on every node alike)
            fill = float("nan") if skip.reason == "nonfinite" else 0.0
            with torch.no_grad():
                for slot in self.slots:
                    if slot.dest is not None:
                        slot.dest.fill_(fill)
        return skip

    def _share_skip(self, skip: Skipped | None, moved: Skipped | None
                    ) -> tuple[Skipped | None, Skipped | None]:
        """The node root's verdict on this step, and the membership it learned (a
        ``"membership"`` skip: only its generation and its members travel, a mark per
        worker node the job started with), for every local rank."""
        names = [s.name for s in self.slots]
        reasons = ("nonfinite", "zero", "membership")
        flag = torch.zeros(4 + self._rt.env.num_workers, dtype=torch.float64)
        if self._rt.local_rank == 0 and skip is not None:
            flag[0] = 1 + reasons.index(skip.reason)
            flag[1] = skip.node
            flag[2] = names.index(skip.what) if skip.what in names else -1
        if self._rt.local_rank == 0 and moved is not None:
            flag[3] = moved.generation
            flag[4 + torch.tensor(moved.members, dtype=torch.long)] = 1
        self._flag_ch.broadcast(flag)
        if self._rt.local_rank == 0:
            return skip, moved
        if flag[3] > 0:
            members = tuple(int(i) for i in torch.nonzero(flag[4:]).flatten())
            moved = Skipped("membership", -1, "", "", int(flag[3]), members)
        if flag[0] == 0:
            return None, moved
        what = names[int(flag[2])] if flag[2] >= 0 else ""
        return Skipped(reasons[int(flag[0]) - 1], int(flag[1]), what, ""), moved

    def end_step(self, applied: bool) -> None:
        """Count the step (``applied``: also as an applied step) and get ready for the next."""
        for slot in self.slots:
            slot.ready, slot.skipped, slot.dest, slot.done = False, None, None, None
        self.started = False
        with self._cond:
            self._done = 0
        self.wire_step += 1
        if applied:
            self.step += 1

    # -- state ---------------------------------------------------------------------------

    def momentum_state(self) -> dict:
        """The local momentum buffers of raw parts, by parameter name."""
        return {s.name: s.local_momentum.clone() for s in self.slots
                if s.local_momentum is not None}

    def load_momentum_state(self, state: dict) -> None:
        for slot in self.slots:
            if slot.local_momentum is not None:
                if slot.name not in state:
                    raise KeyError(f"state_dict has no momentum buffer for {slot.name!r}")
                slot.local_momentum.copy_(state[slot.name])

    def compressed_keys(self) -> list[int]:
        """Every compressed key of these parameters."""
        return [part.compressed_key for slot in self.slots for part in slot.parts
                if part.compressed_key is not None]

    def close(self) -> None:
        """Stop the background threads (an inline pipeline has none)."""
        self._reduce_q.put(_STOP)
        self._bcast_q.put(_STOP)
        for bucket in self.buckets:  # a step left unfinished: members wait on no push
            if bucket.future is not None:
                bucket.future.cancel()
        for thread in self._threads:
            thread.join(timeout=5)
        if not self._threads or not self._threads[0].is_alive():
            release_stream(self._reduce_stream)
            self._reduce_stream = None
