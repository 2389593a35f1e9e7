"""Error feedback ("vanilla"), a decorator around any compressor (BytePS design).

``g' = g + (lr_prev / lr_now) * e``; ``c = C(g')``; ``e = g' - D(c)``. The ratio is 1
until ``set_lr`` has been called twice with different values; call ``set_lr`` once
per step, before ``compress``.

Example::

    >>> import torch
    >>> from bps.compressors.topk import TopK
    >>> chain = ErrorFeedback(TopK(numel=4, k=1))
    >>> chain.set_lr(0.1)
    >>> payload = chain.compress(torch.tensor([1.0, 0.5, 0.0, 0.0]))
    >>> chain.error          # what was not sent is carried to the next step
    tensor([0.0000, 0.5000, 0.0000, 0.0000])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
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
def add_scaled_error(x, ratio, error):
    """``error = x + ratio * error`` in place, rounded as torch rounds (ratio 1 is exact)."""
    for i in range(x.size):
        error[i] = x[i] + ratio * error[i]


class ErrorFeedback(Compressor):
    """Adds the compression error of the previous step before compressing."""

    def __init__(self, inner: Compressor):
        super().__init__(inner.numel, inner.dtype)
        self.inner = inner
        self.error = torch.zeros(inner.numel, dtype=inner.dtype)
        self.lr_prev: float | None = None
        self.lr_now: float | None = None

    def set_lr(self, lr: float) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (
            math.isfinite(lr) and lr > 0
        ):
            raise ValueError(f"learning rate must be a finite number > 0, got {lr!r}")
        self.lr_prev = float(lr) if self.lr_now is None else self.lr_now
        self.lr_now = float(lr)
        self.inner.set_lr(lr)

    @property
    def ratio(self) -> float:
        return 1.0 if self.lr_now is None else self.lr_prev / self.lr_now

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        x = self.check_input(x)
        if self.dtype in KERNEL_FLOAT_DTYPES:
            array = x.numpy()
            return self.compress_corrected(
                lambda error, ratio: add_scaled_error(array, array.dtype.type(ratio), error))
        # float16/bfloat16: torch rounds each op
        ratio = self.ratio
        return self._send(x + self.error if ratio == 1.0 else x + ratio * self.error)

    def compress_corrected(self, build: Callable[[np.ndarray, float], None]) -> torch.Tensor:
        """Compress ``g'`` that ``build(error, ratio)`` writes over the error buffer
        (a float32/float64 array holding ``e``), as ``g + ratio * e``. The decorator
        before this one (Nesterov momentum) builds ``g'`` in its own pass this way.

        Example::

            >>> import numpy as np, torch
            >>> from bps.compressors.topk import TopK
            >>> chain = ErrorFeedback(TopK(numel=2, k=1))
            >>> g = np.array([1.0, 0.5], dtype=np.float32)
            >>> payload = chain.compress_corrected(lambda e, ratio: np.add(g, ratio * e, out=e))
            >>> chain.error
            tensor([0.0000, 0.5000])
        """
        if self.dtype not in KERNEL_FLOAT_DTYPES:
            raise TypeError(f"compress_corrected needs a float32/float64 chain, not {self.dtype}")
        build(self.error.numpy(), self.ratio)
        return self._send(self.error)

    def _send(self, corrected: torch.Tensor) -> torch.Tensor:
        """Compress ``corrected`` and keep what it did not send as the next error."""
        fused = getattr(self.inner, "compress_residual", None)
        if fused is not None:
            payload = fused(corrected)
        else:
            payload = self.inner.compress(corrected)
            update = getattr(self.inner, "fast_update_error", None)
            if update is not None:
                update(corrected, payload)
            else:
                corrected.sub_(self.inner.decompress(payload))
        self.error = corrected
        return payload

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.decompress(payload, out)

    def decompress_add(self, payload: Payload, total: torch.Tensor,
                       scratch: torch.Tensor | None = None) -> torch.Tensor:
        return add_decompressed(self.inner, payload, total, scratch)

    def state_dict(self) -> dict:
        return {
            "error": self.error.clone(),
            "lr_prev": self.lr_prev,
            "lr_now": self.lr_now,
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        check_state_keys(self, state, ("error", "lr_prev", "lr_now", "inner"))
        for key in ("lr_prev", "lr_now"):
            value = state[key]
            if value is not None and not isinstance(value, float):
                raise ValueError(f"ErrorFeedback state {key!r} must be a float or None, "
                                 f"got {value!r}")
        self.inner.load_state_dict(state["inner"])
        load_buffer(self, "error", self.error, state["error"])
        self.lr_prev, self.lr_now = state["lr_prev"], state["lr_now"]
