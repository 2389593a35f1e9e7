"""How the compression chains follow a ``torch.amp.GradScaler``'s loss scale.

The chains see scaled gradients. Error feedback follows a change of scale through its
learning rate (``lr * first / scale``: its ``lr_prev / lr_now`` then rescales the
residual), and the Nesterov momentum is multiplied by ``scale / applied`` as the next
gradient is added. Both are measured from the last *applied* step: a skipped step
leaves every buffer at the scale it had. ``DistributedTrainer`` and the DDP hook keep
one each.

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
