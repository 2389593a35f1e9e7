"""powersgd on the gradient's device: powersgd.py's torch ops with its buffers there.

The rounds' float32 vectors, the aggregates the engine hands back and ``decompress``'s
output live on ``device``; the random Qs come from the same CPU ``torch.Generator``
draws as on the host and cross once (pinned, no host sync). ``compress`` syncs once,
for the non-finite check. On the CPU the bytes are the host's; on a GPU the matmuls and
norms sum in another order, so values differ by float32 rounding (docs/compression.md).

Example::

    >>> import torch
    >>> c = PowerSGDTorch(numel=6, shape=(3, 2), rank=1, ef=False, device="cpu")
    >>> x = torch.tensor([1.0, 2.0, 2.0, 4.0, 3.0, 6.0])      # rank one: exact
    >>> q = c.compress_round(1, c.compress(x).view(torch.float32))
    >>> [round(v, 5) for v in c.decompress(q.view(torch.float32)).tolist()]
    [1.0, 2.0, 2.0, 4.0, 3.0, 6.0]
"""

from __future__ import annotations

import torch

from .base import Payload
from .device import resolve_device, to_device_async
from .powersgd import PowerSGD


class PowerSGDTorch(PowerSGD):
    """PowerSGD with its matrix, factors and error on ``device``."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32,
                 shape: tuple | list | None = None, rank: int = 1, ef: bool = True,
                 warm_start: bool = True, epsilon: float = 0.0, seed: int = 1,
                 device: torch.device | str | None = None):
        super().__init__(numel, dtype, shape, rank, ef, warm_start, epsilon, seed)
        self.device = resolve_device(device)
        self.matrix = self.matrix.to(self.device)
        self.error = None if self.error is None else self.error.to(self.device)
        self.p = self.p.to(self.device)
        self.q = self.q.to(self.device)

    def random_q(self) -> torch.Tensor:
        """The host's next random Q (same draws), on the device."""
        return to_device_async(super().random_q(), self.device)

    def _values(self, payload: Payload | torch.Tensor, round_: int) -> torch.Tensor:
        """A round's summed float32 vector on the device (or its bytes there), checked."""
        if isinstance(payload, torch.Tensor) and payload.device != self.device:
            raise ValueError(f"powersgd round {round_}: the sum must be on {self.device}, "
                             f"got {payload.device}")
        if isinstance(payload, torch.Tensor) and payload.dtype == torch.uint8:
            if payload.dim() != 1 or payload.numel() % 4:
                raise self.bad_payload(f"round {round_}: {payload.numel()} bytes is not a "
                                       "whole number of float32 values")
            payload = payload.contiguous().view(torch.float32)
        return super()._values(payload, round_)
