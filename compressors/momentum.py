"""Nesterov momentum inside the compression chain (workers only), BytePS design.

``m = g + mu * m``; ``g' = g + mu * m``; then the rest of the chain compresses ``g'``.

Example::

    >>> import torch
    >>> from bps.compressors.onebit import OneBit
    >>> chain = Momentum(OneBit(numel=2), mu=0.9)
    >>> _ = chain.compress(torch.tensor([1.0, -1.0]))
    >>> chain.momentum
    tensor([ 1., -1.])
"""

from __future__ import annotations

import torch
from numba import njit

from .base import (
    KERNEL_FLOAT_DTYPES,
    Compressor,
    Payload,
    add_decompressed,
    check_state_keys,
    load_buffer,
)


@njit(nogil=True, cache=True)
def nesterov_step(grad, momentum, mu, lookahead):
    """``momentum = mu * momentum + grad``; ``lookahead = grad + mu * momentum``, one pass,
    each operation rounded to the arrays' dtype as torch's element-wise ops round."""
    for i in range(grad.size):
        m = momentum[i] * mu + grad[i]
        momentum[i] = m
        lookahead[i] = grad[i] + mu * m


@njit(nogil=True, cache=True)
def nesterov_step_corrected(grad, momentum, mu, ratio, error):
    """nesterov_step with error feedback's ``g' = lookahead + ratio * error`` written over
    ``error`` in the same pass (one pass less, no lookahead array); rounded as the two
    separate kernels round."""
    for i in range(grad.size):
        m = momentum[i] * mu + grad[i]
        momentum[i] = m
        error[i] = (grad[i] + mu * m) + ratio * error[i]


class Momentum(Compressor):
    """Applies Nesterov momentum to the gradient, then the inner chain."""

    def __init__(self, inner: Compressor, mu: float):
        super().__init__(inner.numel, inner.dtype)
        if not 0.0 <= mu < 1.0:
            raise ValueError(f"momentum mu must be in [0, 1), got {mu!r}")
        self.inner = inner
        self.mu = float(mu)
        self.momentum = torch.zeros(inner.numel, dtype=inner.dtype)
        self.lookahead: torch.Tensor | None = None  # g' when the inner chain takes a tensor

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        x = self.check_input(x)
        if self.dtype not in KERNEL_FLOAT_DTYPES:  # float16/bfloat16: torch rounds each op
            self.momentum.mul_(self.mu).add_(x)
            return self.inner.compress(x + self.mu * self.momentum)
        grad, momentum = x.numpy(), self.momentum.numpy()
        mu = grad.dtype.type(self.mu)
        if hasattr(self.inner, "compress_corrected"):  # error feedback: one pass for both
            return self.inner.compress_corrected(lambda error, ratio: nesterov_step_corrected(
                grad, momentum, mu, grad.dtype.type(ratio), error))
        if self.lookahead is None:
            self.lookahead = torch.empty(self.numel, dtype=self.dtype)
        nesterov_step(grad, momentum, mu, self.lookahead.numpy())
        return self.inner.compress(self.lookahead)

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.decompress(payload, out)

    def decompress_add(self, payload: Payload, total: torch.Tensor,
                       scratch: torch.Tensor | None = None) -> torch.Tensor:
        return add_decompressed(self.inner, payload, total, scratch)

    def state_dict(self) -> dict:
        return {"momentum": self.momentum.clone(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state_keys(self, state, ("momentum", "inner"))
        self.inner.load_state_dict(state["inner"])
        load_buffer(self, "momentum", self.momentum, state["momentum"])
