"""The interface of a trainer's step mode.

``DistributedTrainer`` chooses one mode from its arguments (:func:`bps.modes.choose`)
and hands every ``step()``, ``synchronize()``, checkpoint and ``close()`` to it. A mode
gets the front-end core (:class:`bps.core.frontend.FrontEndCore`: the pipeline, the
runtime, the optimizer, the model, the figures), never the trainer. A new mode is one
file with a subclass, plus its line in :func:`bps.modes.choose`::

    >>> class EveryOtherStep(StepMode):
    ...     pushes_during_backward = False
    ...     def step(self, scaler=None) -> bool:
    ...         ...
"""

from __future__ import annotations

import torch

from bps.core.frontend import FrontEndCore


class StepMode:
    """One way of stepping: what ``step()`` does with the gradients of a step.

    ``pushes_during_backward``: the trainer's gradient hooks push each gradient as
    backward produces it (else the mode pushes from ``step()``). ``supports_join``:
    ``trainer.join()`` may run (uneven inputs)."""

    pushes_during_backward = True
    supports_join = False
    name = "step mode"

    def __init__(self, core: FrontEndCore) -> None:
        self.core = core

    def step(self, scaler: torch.amp.GradScaler | None = None) -> bool:
        """The trainer's ``step()``: returns whether an update was applied."""
        raise NotImplementedError

    def synchronize(self) -> bool:
        """The trainer's ``synchronize()``: wait for this step's aggregates."""
        raise RuntimeError(f"synchronize() has no step to wait for with {self.name}")

    def state_dict(self) -> dict | None:
        """What the mode needs to continue exactly (None: nothing)."""
        return None

    def load_state_dict(self, state: dict | None) -> None:
        """Restore :meth:`state_dict`'s."""

    def join_state(self) -> dict | None:
        """What a worker node joining the job loads (:mod:`bps.core.rejoin`), sent at the
        step boundary after the step the join dropped: :meth:`state_dict` unless the
        mode has something in flight that must wait for the joiner."""
        return self.state_dict()

    def load_join_state(self, state: dict | None) -> None:
        """On the joiner, before its first step: load :meth:`join_state`'s."""
        self.load_state_dict(state)

    def before_checkpoint(self) -> None:
        """Settle what is in flight before the trainer reads the chains' state."""

    def close(self) -> None:
        """Stop: wait for what is in flight (it is not applied)."""
