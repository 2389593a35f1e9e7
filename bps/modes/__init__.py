"""A trainer's step modes, one per file, behind :class:`bps.modes.base.StepMode`.

:func:`choose` is the one place that maps the trainer's arguments to a mode: a new
mode is a new file here and its line in :func:`choose`.
"""

from __future__ import annotations

from bps.core.frontend import FrontEndCore
from bps.core.grad_pipeline import GradTensor
from bps.modes.base import StepMode
from bps.modes.compressed_adam import CompressedAdamSteps
from bps.modes.delayed import DelayedUpdate
from bps.modes.periodic import OuterSpec, PeriodicAveraging
from bps.modes.streaming import StreamingAveraging
from bps.modes.synchronous import SynchronousSteps


def choose(core: FrontEndCore, runtime, tensors: list[GradTensor], *, staleness: int,
           sync_every: int, outer: OuterSpec | None,
           fragments: list[list[GradTensor]] | None = None, overlap: int = 0) -> StepMode:
    """The mode of checked arguments (see ``validate_staleness``, ``validate_sync_every``,
    ``validate_streaming``); ``fragments``: ``plan_fragments``' plan where the syncs
    stream. Every mode but the streaming one runs on the core's pipeline of
    ``tensors``, built here."""
    if fragments is not None:
        core.attach(runtime)
        return StreamingAveraging(core, fragments, sync_every, outer, overlap)
    # with the node agent, .grad is its shared buffer where the mode pushes it in place
    # (staleness=1 swaps .grad with the aggregate of the step before)
    core.build(runtime, tensors, grads_shared=not staleness)
    if outer is not None:
        return PeriodicAveraging(core, sync_every, outer)
    if staleness:
        return DelayedUpdate(core)
    if core.params.get("freeze_step") is not None:
        return CompressedAdamSteps(core)
    return SynchronousSteps(core)
