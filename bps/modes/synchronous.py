"""Synchronous steps, the default: each gradient is pushed as backward produces it, and
``step()`` waits for the averages, then runs the optimizer::

    >>> trainer = bps.DistributedTrainer(model, optimizer, {"compressor": "onebit",
    ...                                  "ef": "vanilla"})    # staleness=0, sync_every=1
"""

from __future__ import annotations

import time

import torch

from bps.core.frontend import FrontEndCore
from bps.core.join import UnevenInputs
from bps.modes.base import StepMode
from bps.worker.engine import Skipped


class SynchronousSteps(StepMode):
    """Every step's aggregate is applied in that step; ``trainer.join()`` works here."""

    supports_join = True
    name = "synchronous steps"

    def __init__(self, core: FrontEndCore) -> None:
        super().__init__(core)
        self.uneven = UnevenInputs(core)
        core.chain_lr_override = self.uneven.chain_lr
        self.synced: bool | None = None  # this step's outcome, once synchronize() ran
        self.skip: Skipped | None = None  # why this step is skipped (None: applied)
        self.tracer = core.runtime.tracer  # bps.common.trace: None unless BYTEPS_TRACE_ON=1
        self.last_step_end_ns: int | None = None

    def push(self, index: int) -> None:
        """A gradient is final: push it (a zero marker once this node has joined)."""
        self.core.push_grad(index, absent=self.uneven.joined,
                            node_joined=self.uneven.node_joined())

    def synchronize(self) -> bool:
        """Wait until every gradient of this step is averaged and in ``.grad``."""
        if self.synced is not None:
            return self.synced
        pipe = self.core.pipeline
        for index in pipe.pending():  # no gradient this step (unused): push zeros
            self.push(index)
        self.uneven.push_flag(pipe.wire_step)
        pipe.wait()
        skip = pipe.finish()
        self.uneven.count_active()
        self.skip = skip
        self.synced = skip is None
        return self.synced

    def step(self, scaler: torch.amp.GradScaler | None = None) -> bool:
        core, pipe = self.core, self.core.pipeline
        called_ns = time.monotonic_ns()
        if scaler is not None:
            core.scaler = scaler
        applied = self.synchronize()
        synced_ns = time.monotonic_ns()
        skip, joined = self.skip, self.uneven.joined
        if scaler is not None:
            scale = scaler.get_scale()
            # NaN .grad: the scaler skips the step (a joined worker steps nothing)
            if not joined and (skip is None or skip.reason == "nonfinite"):
                scaler.step(core.optimizer)
                scaler.update()
            core.loss_scale.settle(scale, applied=skip is None and not joined)
        elif applied and not joined:
            core.optimizer.step()
        end_ns = time.monotonic_ns()
        self._trace(pipe.step, called_ns, synced_ns, end_ns)
        nonfinite = skip is not None and skip.reason == "nonfinite"
        dropped = skip is not None and skip.reason == "membership"  # worker nodes left
        core.record(core.engine_before, pipe.step, pipe.raw_bytes,
                    (synced_ns - called_ns) / 1e9, core.passes, nonfinite or dropped,
                    core.samples * core.runtime.local_size)
        step = pipe.step
        self.uneven.end_step()
        pipe.end_step(skip is None)
        self.synced, self.skip = None, None
        if nonfinite and scaler is None:
            error = core.nonfinite_error(skip, step)
            if error is not None:
                raise error
        return applied

    def _trace(self, step: int, called_ns: int, synced_ns: int, end_ns: int) -> None:
        if self.tracer is not None:
            if self.last_step_end_ns is not None:
                self.tracer.complete("compute", "", step, self.last_step_end_ns, called_ns)
            self.tracer.complete("wait", "", step, called_ns, synced_ns)
            self.tracer.complete("update", "", step, synced_ns, end_ns)
        self.last_step_end_ns = end_ns
