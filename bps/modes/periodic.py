"""Periodic averaging (local SGD, DiLoCo): ``DistributedTrainer(..., sync_every=H)``.

Each worker takes ``H`` optimizer steps on its own shard with nothing on the wire. At
the ``H``-th step, after its own optimizer step, it pushes the pseudo-gradient
``delta = w_at_last_sync - w_now`` through the trainer's usual pipeline (divided by
the number of workers, compressor chain, error feedback, servers that sum), and every
worker applies the same outer update to ``w_at_last_sync`` (docs/trainer.md,
"Periodic averaging")::

    >>> trainer = bps.DistributedTrainer(model, optimizer, {"compressor": "topk", "k": 0.01,
    ...                                  "ef": "vanilla"}, sync_every=8,
    ...                                  outer={"optimizer": "nesterov", "lr": 0.7,
    ...                                         "momentum": 0.9})
    >>> for x, y in loader:           # the loop does not change
    ...     trainer.zero_grad()
    ...     loss_fn(model(x), y).backward()
    ...     trainer.step()            # every 8th step also syncs

``outer``: ``None`` or ``{"optimizer": "average"}`` (the mean of the workers'
parameters, with compression the compressed mean of their deltas), ``{"optimizer":
"sgd", "lr": a, "momentum": b}`` (heavy ball) or ``{"optimizer": "nesterov", "lr": a,
"momentum": b}`` (DiLoCo's outer Nesterov SGD; defaults lr 0.7, momentum 0.9).
Floating-point buffers are averaged at each sync (uncompressed), except their inf and
NaN entries (a ``-inf`` causal mask), which stay as they are; integer buffers stay as
they are on each worker. A buffer average that a membership change drops (it travels
after its round, apart from it) leaves each worker's buffers as they are, as between
syncs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bps.core.frontend import FrontEndCore
from bps.core.grad_pipeline import Skipped
from bps.modes.base import StepMode
from bps.worker.partition import partition

log = logging.getLogger("bps")

OUTER_OPTIMIZERS = ("average", "sgd", "nesterov")
_OUTER_DEFAULTS = {"average": {"lr": 1.0, "momentum": 0.0},
                   "sgd": {"lr": 1.0, "momentum": 0.0},
                   "nesterov": {"lr": 0.7, "momentum": 0.9}}


@dataclass(frozen=True)
class OuterSpec:
    """The outer update: ``w = anchor - lr * step(avg_delta)`` (see :func:`outer_update`)."""

    optimizer: str = "average"
    lr: float = 1.0
    momentum: float = 0.0
    defaulted: bool = field(default=False, compare=False, repr=False)  # lr, momentum unset

    @property
    def nesterov(self) -> bool:
        return self.optimizer == "nesterov"


def validate_sync_every(sync_every: Any, outer: Any) -> OuterSpec | None:
    """The outer update of ``sync_every`` / ``outer`` (None: synchronous training, H = 1).

    Raises ``ValueError`` / ``TypeError`` naming the argument or ``outer``'s key.

    >>> validate_sync_every(4, {"optimizer": "nesterov", "lr": 0.5})
    OuterSpec(optimizer='nesterov', lr=0.5, momentum=0.9)
    >>> validate_sync_every(1, None) is None
    True
    """
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every={sync_every!r} is invalid: expected an int >= 1 "
                         "(1: synchronize every step)")
    if sync_every == 1:
        if outer is not None:
            raise ValueError(f"outer={outer!r} needs sync_every > 1 (an outer update "
                             "applies to the parameters averaged every sync_every steps)")
        return None
    if outer is None:
        return OuterSpec()
    if not isinstance(outer, dict):
        raise TypeError(f"outer={outer!r} is invalid: expected None or a dict such as "
                        "{'optimizer': 'nesterov', 'lr': 0.7, 'momentum': 0.9}")
    name = outer.get("optimizer", "average")
    if name not in OUTER_OPTIMIZERS:
        raise ValueError(f"outer['optimizer']={name!r} is unknown: expected one of "
                         f"{OUTER_OPTIMIZERS}")
    unknown = sorted(set(outer) - {"optimizer", "lr", "momentum"})
    if unknown:
        raise ValueError(f"outer has unknown key(s) {unknown}: expected 'optimizer', 'lr', "
                         "'momentum'")
    values = dict(_OUTER_DEFAULTS[name])
    for key in ("lr", "momentum"):
        if key not in outer:
            continue
        value = outer[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"outer[{key!r}]={value!r} is invalid: expected a number")
        if name == "average":
            raise ValueError(f"outer[{key!r}] is set but outer['optimizer'] is 'average' "
                             "(the plain mean takes no lr or momentum): use 'sgd' or "
                             "'nesterov'")
        values[key] = float(value)
    if not values["lr"] > 0:
        raise ValueError(f"outer['lr']={values['lr']!r} is invalid: expected > 0")
    if not 0 <= values["momentum"] < 1:
        raise ValueError(f"outer['momentum']={values['momentum']!r} is invalid: expected "
                         "0 <= momentum < 1")
    return OuterSpec(name, values["lr"], values["momentum"],
                     defaulted=not {"lr", "momentum"} & set(outer))


def outer_update(anchor: torch.Tensor, avg: torch.Tensor, momentum: torch.Tensor | None,
                 spec: OuterSpec) -> None:
    """In place: ``momentum = mu * momentum + avg``; the step is ``avg + mu * momentum``
    (nesterov), ``momentum`` (sgd with momentum) or ``avg``; ``anchor -= lr * step``.
    Every operation rounds to float32 on its own (no fused multiply-add), so a numpy
    reference of the same formulas is bit-identical.

    >>> a, d = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -0.5])
    >>> outer_update(a, d, None, OuterSpec()); a
    tensor([0.5000, 2.5000])
    """
    step = avg
    if momentum is not None and spec.momentum:
        momentum.mul_(spec.momentum).add_(avg)
        step = torch.mul(momentum, spec.momentum).add_(avg) if spec.nesterov else momentum
    if spec.lr != 1.0:
        step = torch.mul(step, spec.lr)
    anchor.sub_(step)


@dataclass
class PendingBuffers:
    """One push of the buffers: their values at the push (``start``), the node's share
    being averaged (``mean``: the servers' mean once pulled) and the futures of its keys
    (local rank 0; empty once pulled)."""

    start: torch.Tensor
    mean: torch.Tensor
    futures: list = field(default_factory=list)


class BufferAverage:
    """The mean over every worker of a model's floating-point buffers, in float32 and
    uncompressed, on raw keys of their own (the partitions of the buffers' concatenation)
    and a node channel; its push and its pull may be steps apart (streaming syncs)::

        pending = average.push(step)      # this worker's buffers, summed over the node
        mean = average.mean(pending)      # the servers' mean, on every local rank
    """

    def __init__(self, core: FrontEndCore) -> None:
        rt = self.runtime = core.runtime
        self.tensors = [b for _, b in core.model.named_buffers() if b.dtype.is_floating_point]
        numel = sum(b.numel() for b in self.tensors)
        self.parts = partition(numel, 4, rt.env.partition_bytes) if numel else []
        self.keys = []
        for offset, length in self.parts:
            key = rt.allocate_keys(1)
            if rt.engine is not None:
                rt.engine.declare(key, length, torch.float32, None,
                                  name=f"buffers[{offset}:{offset + length}]")
            self.keys.append(key)
        self.channel = rt.group.channel(rt.unique_name("buffers")) if numel else None

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def push(self, step: int) -> PendingBuffers:
        """Every buffer divided by the workers, summed over the node and pushed raw (for
        the membership generation those workers make)."""
        rt = self.runtime
        start = torch.cat([b.detach().reshape(-1).float() for b in self.tensors])
        # inf and NaN entries (a -inf causal mask) stay as they are: pushed as zeros
        share = torch.where(torch.isfinite(start), torch.div(start, rt.size), 0.0)
        pending = PendingBuffers(start, share)
        self.channel.reduce(pending.mean)
        if rt.engine is not None:
            pending.futures = [rt.engine.push_pull(key, pending.mean[o:o + n], step, 0.0,
                                                   generation=rt.generation)
                               for key, (o, n) in zip(self.keys, self.parts, strict=True)]
        return pending

    def pull(self, pending: PendingBuffers) -> None:
        """The servers' mean into ``pending.mean`` (local rank 0; once); NaN in a
        partition the servers dropped (a membership change: no mean)."""
        timeout = self.runtime.env.timeout * 2
        for (offset, length), future in zip(self.parts if pending.futures else [],
                                            pending.futures, strict=True):
            mean = future.result(timeout=timeout)
            if isinstance(mean, Skipped):
                pending.mean[offset:offset + length].fill_(float("nan"))
            else:
                pending.mean[offset:offset + length].copy_(mean)
        pending.futures.clear()

    def mean(self, pending: PendingBuffers) -> torch.Tensor:
        """The servers' mean of ``pending``, pulled and shared with every local rank;
        where there is none (an entry not finite at the push, or a partition a
        membership change dropped), each worker's own value at the push."""
        self.pull(pending)
        self.channel.broadcast(pending.mean)
        averaged = torch.isfinite(pending.start) & ~torch.isnan(pending.mean)
        return torch.where(averaged, pending.mean, pending.start)


def warn_outer_defaults(core: FrontEndCore, every: int, spec: OuterSpec) -> None:
    """One warning (rank 0) where DiLoCo's outer Nesterov defaults meet few local steps."""
    if spec.nesterov and spec.defaulted and every < 16 and core.runtime.rank == 0:
        log.warning("bps: outer Nesterov at its defaults (lr %g, momentum %g, DiLoCo's, "
                    "for hundreds of local steps) overshoots with sync_every=%d; "
                    "lr 1.0 and momentum 0.5 match the plain mean there "
                    "(docs/trainer.md, periodic averaging)", spec.lr, spec.momentum, every)


class PeriodicAveraging(StepMode):
    """The local steps and the outer update of a trainer with ``sync_every > 1``.

    The trainer's gradient hooks are off: nothing travels during local steps. At a
    sync the pseudo-gradient goes into ``.grad``, every parameter's ``.grad`` travels
    through the pipeline and comes back averaged, and the outer update applies it and
    averages the buffers.
    """

    pushes_during_backward = False
    name = "sync_every > 1"

    def __init__(self, core: FrontEndCore, every: int, spec: OuterSpec) -> None:
        super().__init__(core)
        self.every, self.spec = every, spec
        core.chain_lr_override = lambda group: spec.lr  # error feedback's ratio: the outer lr
        warn_outer_defaults(core, every, spec)
        self.local = 0  # local steps taken since the last sync
        slots = core.pipeline.slots
        self.anchor = {s.name: s.param.detach().reshape(-1).float().clone() for s in slots}
        self.momentum = {name: torch.zeros_like(a) for name, a in self.anchor.items()} \
            if spec.momentum else {}
        self.buffers = BufferAverage(core)

    def synchronize(self) -> bool:
        raise RuntimeError("synchronize() is not for sync_every > 1: step() syncs the "
                           "parameters every sync_every steps")

    def step(self, scaler: torch.amp.GradScaler | None = None) -> bool:
        """A local step; every ``every``-th also syncs: returns whether a sync that
        was skipped everywhere (a non-finite delta) left the step unapplied."""
        core, pipe = self.core, self.core.pipeline
        called = time.monotonic_ns()
        if not self._local_step(scaler):  # nothing travels
            core.record(core.stats.snapshot(core.runtime.engine), pipe.step, 0, 0.0,
                        core.passes, False, core.samples * core.runtime.local_size)
            return True
        for index in range(len(pipe.slots)):
            core.push_grad(index)
        pipe.wait()
        skip = pipe.finish()
        synced = time.monotonic_ns()
        self._apply(skip is None)
        nonfinite = skip is not None and skip.reason == "nonfinite"
        dropped = skip is not None and skip.reason == "membership"  # worker nodes left
        core.record(core.engine_before, pipe.step, pipe.raw_bytes, (synced - called) / 1e9,
                    core.passes, nonfinite or dropped, core.samples * core.runtime.local_size)
        step = pipe.step
        pipe.end_step(skip is None)
        if nonfinite:
            error = core.nonfinite_error(skip, step)
            if error is not None:
                raise error
        return skip is None

    def _local_step(self, scaler: torch.amp.GradScaler | None) -> bool:
        """One optimizer step on this worker's gradient; True where this step syncs (the
        pseudo-gradient is then in ``.grad``, for the pipeline)."""
        optimizer = self.core.optimizer
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        self.local += 1
        if self.local < self.every:
            return False
        self.local = 0
        with torch.no_grad():
            for slot in self.core.pipeline.slots:
                p = slot.param
                delta = torch.sub(self.anchor[slot.name], p.detach().reshape(-1).float())
                if p.grad is None or not p.grad.is_contiguous():
                    p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                p.grad.view(-1).copy_(delta)
        return True

    def _apply(self, applied: bool) -> None:
        """The outer update from the averaged delta in ``.grad`` (every worker the same),
        or, for a round skipped everywhere (a non-finite delta, or a round dropped because
        worker nodes left), every worker back to the parameters of the last sync."""
        with torch.no_grad():
            for slot in self.core.pipeline.slots:
                anchor = self.anchor[slot.name]
                if applied:
                    avg = slot.param.grad.detach().reshape(-1).float()
                    outer_update(anchor, avg, self.momentum.get(slot.name), self.spec)
                slot.param.view(-1).copy_(anchor)
            if applied:
                self._average_buffers()

    def _average_buffers(self) -> None:
        """The mean of every worker's floating-point buffers (float32, uncompressed)."""
        if not self.buffers:
            return
        mean = self.buffers.mean(self.buffers.push(self.core.pipeline.wire_step))
        offset = 0
        for buffer in self.buffers.tensors:
            buffer.copy_(mean[offset:offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()

    def state_dict(self) -> dict:
        return {"local": self.local, "anchor": {n: a.clone() for n, a in self.anchor.items()},
                "momentum": {n: m.clone() for n, m in self.momentum.items()}}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise ValueError("state_dict has no periodic averaging state (saved by a "
                             "trainer without sync_every?)")
        self.local = int(state["local"])
        for name, anchor in self.anchor.items():
            anchor.copy_(state["anchor"][name])
            if name in self.momentum:
                self.momentum[name].copy_(state["momentum"][name])
