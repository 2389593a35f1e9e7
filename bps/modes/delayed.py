"""One-step-delayed updates: ``DistributedTrainer(..., staleness=1)``.

The aggregate of the gradients computed at step t is applied at step t+1, so its push
and pull overlap the forward and backward of step t+1 instead of blocking ``step()``
(docs/trainer.md, "Delayed updates")::

    >>> trainer = bps.DistributedTrainer(model, optimizer, {"compressor": "topk", "k": 0.01,
    ...                                  "ef": "vanilla", "momentum": "nesterov"},
    ...                                  staleness=1)
    >>> for x, y in loader:                 # the loop does not change
    ...     trainer.zero_grad()
    ...     loss_fn(model(x), y).backward()
    ...     trainer.step()                  # applies step t-1's aggregate, pushes step t's

``step()`` at step t: waits for step t-1's aggregate (in flight since the last
``step()``), takes this step's ``.grad`` tensor as the source and destination of its
push (the pipeline divides it in place and the aggregate lands in it), makes the tensor
holding step t-1's aggregate the parameter's ``.grad`` and runs the optimizer: no copy,
and the next backward writes a fresh ``.grad`` (or, after ``zero_grad(set_to_none=
False)``, the tensor just applied), never the one in flight. The first step has no
aggregate yet: it pushes its gradient, applies nothing, leaves ``.grad`` None and
returns False.
The compressor chains, error feedback and momentum are those of synchronous training;
only the step that applies each aggregate moves.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from bps.core.frontend import FrontEndCore
from bps.modes.base import StepMode
from bps.worker.engine import Skipped


def validate_staleness(staleness: Any, sync_every: int) -> int:
    """``staleness`` (0: synchronous, 1: one-step-delayed updates), checked.

    >>> validate_staleness(1, 1)
    1
    """
    if isinstance(staleness, bool) or not isinstance(staleness, int) \
            or not 0 <= staleness <= 1:
        raise ValueError(f"staleness={staleness!r} is invalid: expected 0 (synchronous) or "
                         "1 (each step applies the aggregate of the step before)")
    if staleness and sync_every != 1:
        raise ValueError(f"staleness=1 with sync_every={sync_every} is not supported: "
                         "choose one of them")
    return staleness


class DelayedUpdate(StepMode):
    """The round in flight of ``staleness=1``: per parameter, the tensor that was its
    ``.grad`` when the round was pushed, source and destination of that push (divided
    in place by the pipeline, then the aggregate). Each ``step()`` settles the round in
    flight (as do ``state_dict()`` and ``close()``), pushes this step's gradients and
    applies the settled aggregate."""

    pushes_during_backward = False
    name = "staleness=1: step() applies the aggregate of the step before"

    def __init__(self, core: FrontEndCore) -> None:
        super().__init__(core)
        # per parameter, the round's tensor (flat): in flight, then the aggregate
        self.tensors: list[torch.Tensor | None] = [None] * len(core.pipeline.slots)
        self.lrs = [float(g["lr"]) for g in core.optimizer.param_groups]
        # the learning rate of the step that pushed the round in flight: the optimizer's
        # may change (a scheduler) while its partitions are still being pushed
        core.chain_lr_override = self.lrs.__getitem__
        self.in_flight = False  # a round was pushed and not settled
        self.ready = False  # the settled round's aggregate waits in ``tensors``
        self.skip: Skipped | None = None  # why the settled round is applied nowhere
        self.settled: tuple[dict, float] | None = None  # its stats, not yet recorded
        self.round_step = 0  # the settled round's step number (applied steps before it)

    def step(self, scaler: torch.amp.GradScaler | None = None) -> bool:
        """Settle the round in flight (its figures are this step's ``stats()``), push
        this step's gradients, apply the settled aggregate."""
        if scaler is not None:
            raise ValueError("step(scaler=...) is not supported with staleness=1: an "
                             "aggregate would be unscaled by the scale of the step after")
        core = self.core
        self.settle()
        skip = self.skip
        nonfinite = skip is not None and skip.reason == "nonfinite"
        dropped = skip is not None and skip.reason == "membership"  # worker nodes left
        before, wait = self.settled or (core.stats.snapshot(core.runtime.engine), 0.0)
        core.record(before, self.round_step, core.pipeline.raw_bytes if self.settled else 0,
                    wait, core.passes, nonfinite or dropped,
                    core.samples * core.runtime.local_size)
        step = self.round_step
        applied = self.push_and_apply()
        if nonfinite:
            error = core.nonfinite_error(skip, step)
            if error is not None:
                raise error
        return applied

    def settle(self) -> None:
        """Wait for the round in flight; its aggregate is then in the destinations."""
        if not self.in_flight:
            return
        pipe = self.core.pipeline
        started = time.monotonic()
        pipe.wait()
        self.skip = pipe.finish()
        self.round_step = pipe.step
        self.settled = (self.core.engine_before, time.monotonic() - started)
        pipe.end_step(self.skip is None)
        self.in_flight = False
        self.ready = self.skip is None

    def push_and_apply(self) -> bool:
        """After :meth:`settle`: push this step's gradients and apply the settled round's
        aggregate (NaN where the round was skipped); returns whether there was one to
        apply. The tensors swap roles: ``.grad`` goes on the wire, the aggregate
        becomes ``.grad``."""
        core, pipe = self.core, self.core.pipeline
        applied, settled = self.ready, self.ready or self.skip is not None
        self.ready, self.skip, self.settled = False, None, None
        with torch.no_grad():
            pushes = []
            for index, slot in enumerate(pipe.slots):
                p, aggregate = slot.param, self.tensors[index]
                grad = p.grad
                if grad is None:  # no gradient this step: zeros travel
                    tensor, source = torch.zeros(p.numel(), dtype=p.dtype, device=p.device), None
                else:
                    tensor = grad.detach().contiguous().view(-1)
                    source = tensor
                p.grad = aggregate.view_as(p) if settled and aggregate is not None else None
                self.tensors[index] = tensor
                pushes.append((index, source, tensor))
            self.lrs[:] = [float(g["lr"]) for g in core.optimizer.param_groups]
            for index, source, tensor in pushes:
                pipe.push(index, source, tensor)
        self.in_flight = True
        if applied:
            core.optimizer.step()
        return applied

    def before_checkpoint(self) -> None:
        self.settle()  # before anything else: the round changes the chains

    def close(self) -> None:
        """Wait for the round in flight, if any, and drop its aggregate."""
        self.settle()
        self.ready = False

    def state_dict(self) -> dict:
        """The aggregate that waits to be applied (the round in flight, settled here)."""
        self.settle()
        names = [s.name for s in self.core.pipeline.slots]
        return {"aggregate": {n: t.clone() for n, t in zip(names, self.tensors, strict=True)}
                if self.ready else None}

    def join_state(self) -> dict:
        """For a node joining now: nothing is settled. The round in flight is the one
        after the round the join dropped; it was divided by the new membership and waits
        for the joiner's push, so settling it here would wait for the joiner."""
        return {"in_flight": self.in_flight, "lrs": list(self.lrs),
                "round_step": self.round_step}

    def load_join_state(self, state: dict | None) -> None:
        """The joiner takes part in the round in flight with zero markers (it computed
        no gradient for it): its first ``step()`` settles that round's aggregate and
        applies it, as every other node does."""
        if state is None or "in_flight" not in state:
            raise ValueError("the joining state has no delayed-update state")
        self.lrs[:] = state["lrs"]
        self.round_step = int(state["round_step"])
        if not state["in_flight"]:
            return
        pipe = self.core.pipeline
        for index, slot in enumerate(pipe.slots):
            p = slot.param
            self.tensors[index] = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            pipe.push(index, None, self.tensors[index], joined=True)
        self.in_flight = True

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise ValueError("state_dict has no delayed-update state (saved by a trainer "
                             "without staleness=1?)")
        if self.in_flight:
            raise RuntimeError("load_state_dict() with staleness=1 must come before the "
                               "first step()")
        aggregate = state["aggregate"]
        self.ready = aggregate is not None
        if aggregate is not None:
            for index, slot in enumerate(self.core.pipeline.slots):
                self.tensors[index] = aggregate[slot.name].to(
                    slot.param.dtype, copy=True).reshape(-1)
