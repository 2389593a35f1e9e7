"""How the compression chains follow a ``torch.amp.GradScaler``'s loss scale.

The chains see scaled gradients. Error feedback follows a change of scale through its
learning rate (``lr * first / scale``: its ``lr_prev / lr_now`` then rescales the
residual), and the Nesterov momentum is multiplied by ``scale / applied`` as the next
gradient is added. Both are measured from the last *applied* step: a skipped step
leaves every buffer at the scale it had. ``DistributedTrainer`` and the DDP hook keep
one each.

A step's scale is read where it is first needed (:class:`ScaleReading`): by the
pipeline's reduce thread as it hands the first gradient to the chains, not in the
first gradient hook, where a read (``scaler.get_scale()``) would stop the thread that
runs the model until the device has caught up with it.

Example::

    >>> follow = LossScale()
    >>> follow.settle(1024.0, applied=True)      # the first step, at scale 1024
    >>> follow.lr_factor(2048.0), follow.change(2048.0)
    (0.5, 2.0)
    >>> follow.settle(2048.0, applied=False)     # skipped: the buffers keep 1024
    >>> follow.change(1024.0)
    1.0
"""

from __future__ import annotations

import threading


class LossScale:
    """The first scale and the scale of the last applied step (None before any)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.applied: float | None = None

    def lr_factor(self, scale: float | None) -> float:
        """What the chains' learning rate is multiplied by at ``scale`` (None: no
        scaler)."""
        return 1.0 if scale is None or self.first is None else self.first / scale

    def change(self, scale: float | None) -> float:
        """What the momentum is multiplied by at ``scale``."""
        return 1.0 if scale is None or self.applied is None else scale / self.applied

    def settle(self, scale: float, applied: bool) -> None:
        """A step at ``scale`` ended, applied or skipped."""
        if self.first is None:
            self.first = scale
        if applied:
            self.applied = scale

    def state(self) -> tuple[float | None, float | None]:
        return self.first, self.applied

    def load(self, state: tuple[float | None, float | None]) -> None:
        self.first, self.applied = state


class ScaleReading:
    """A GradScaler's scale for one step, read on first use (once, on any thread) and
    not when the step starts: on CUDA a read waits for the device.

        >>> import torch
        >>> reading = ScaleReading()
        >>> reading.start(torch.amp.GradScaler("cpu", init_scale=8.0))  # nothing read yet
        >>> reading.value
        8.0
        >>> reading.start(None); reading.value is None
        True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scaler = None
        self._value: float | None = None

    def start(self, scaler) -> None:
        """A step starts with ``scaler`` (None: none); its scale is read on first use."""
        with self._lock:
            self._scaler, self._value = scaler, None

    @property
    def value(self) -> float | None:
        """The scale (None without a scaler), read from the scaler the first time."""
        with self._lock:
            if self._scaler is not None:
                self._value = self._scaler.get_scale()
                self._scaler = None
            return self._value
