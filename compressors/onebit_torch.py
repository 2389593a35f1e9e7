"""onebit with torch kernels: the payload of onebit.py, built on the tensor's device.

Same bytes as the numba kernels, except where the scale's float64 sum of magnitudes,
added in another order, rounds differently: the float32 scale is then 1 ulp apart
(docs/compression.md). Signs, padding and the unscaled scale are exact.

Example::

    >>> import torch
    >>> c = OneBitTorch(numel=3, dtype=torch.float32, scaling=False, device="cpu")
    >>> c.decompress(c.compress(torch.tensor([0.5, -2.0, 0.0])))
    tensor([ 1., -1.,  1.])
"""

from __future__ import annotations

import numpy as np
import torch

from .base import Payload
from .device import INPUT_NONFINITE, RANGE_OVERFLOW, TorchKernels, first_bad, flag_status
from .onebit import OneBit


def msb_first_shifts(device: torch.device) -> torch.Tensor:
    """7, 6, ..., 0 as uint8 on ``device`` (made there: no host transfer). A byte holds 8
    sign bits MSB-first; a little-endian uint32 word holds its 4 bytes last-first."""
    return torch.arange(7, -1, -1, dtype=torch.uint8, device=device)


def pack_signs(x: torch.Tensor, num_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sign words as 4 * num_words little-endian bytes, bit i = x[i] < 0 MSB-first with
    zero padding; the negative mask of x).

        >>> pack_signs(torch.tensor([-1.0] + [1.0] * 31), 1)[0].tolist()
        [0, 0, 0, 128]
    """
    negative = x < 0
    if x.numel() == 32 * num_words:
        bits = negative.view(torch.uint8)
    else:
        bits = torch.zeros(32 * num_words, dtype=torch.uint8, device=x.device)
        bits[: x.numel()] = negative
    weights = torch.ones(8, dtype=torch.uint8, device=x.device) << msb_first_shifts(x.device)
    packed = (bits.view(num_words, 4, 8) * weights).sum(-1, dtype=torch.uint8)
    return packed.flip(1).reshape(-1), negative


def unpack_signs(words: torch.Tensor, numel: int) -> torch.Tensor:
    """The negative mask (bool, numel elements) that ``words`` (uint8 bytes) encode.

        >>> unpack_signs(torch.tensor([0, 0, 0, 128], dtype=torch.uint8), 2).tolist()
        [True, False]
    """
    shifts = msb_first_shifts(words.device)
    msb_first = words.view(-1, 4).flip(1).unsqueeze(-1)
    return ((msb_first >> shifts) & 1).reshape(-1)[:numel].bool()


def sign_scale(x: torch.Tensor, scaling: bool, max_scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 scale as onebit stores it, status): INPUT_NONFINITE where sum |x| is not
    finite, else RANGE_OVERFLOW where the scale is beyond ``max_scale`` (a float64 input's
    can be), its detail the float64 mean's bits. The sum is float64; its order is torch's.

        >>> sign_scale(torch.tensor([1.0, -2.0, 0.0]), True, 3.4e38)
        (tensor(1.), tensor([ 0, -1]))
    """
    total = x.abs().sum(dtype=torch.float64)
    nonfinite = flag_status(~torch.isfinite(total), INPUT_NONFINITE)
    if not scaling:  # an all-zero input decodes to zeros; the scale is 0 or 1
        return (total != 0).to(torch.float32), nonfinite
    mean = total / x.numel()
    scale = mean.to(torch.float32)
    beyond = ~(torch.isfinite(scale) & (scale <= max_scale))  # max_scale: inf as float32
    return scale, first_bad(nonfinite, flag_status(beyond, RANGE_OVERFLOW,
                                                   mean.view(torch.int64)))


class OneBitTorch(TorchKernels, OneBit):
    """OneBit on ``device`` with torch kernels (payload also on ``device``)."""

    graphable = True

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, scaling: bool = False,
                 device: torch.device | str | None = None):
        OneBit.__init__(self, numel, dtype, scaling)
        TorchKernels.__init__(self, numel, dtype, device)

    def _encode(self, x: torch.Tensor) -> tuple:
        words, negative = pack_signs(x, self.num_words)
        scale, status = sign_scale(x, self.scaling, self.max_scale)
        payload = torch.empty(self.payload_size, dtype=torch.uint8, device=self.device)
        payload[: 4 * self.num_words] = words
        payload[4 * self.num_words :] = scale.reshape(1).view(torch.uint8)
        return payload, status, negative, scale

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, status, _, _ = self._encode(self.check_input(x))
        return payload, status

    def encode_residual(self, corrected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, status, negative, scale = self._encode(corrected)
        step = scale.to(self.dtype)
        corrected.sub_(torch.where(negative, -step, step))
        return payload, status

    def status_error(self, code: int, detail: int) -> Exception:
        if code == RANGE_OVERFLOW:
            return self.scale_out_of_range(float(np.int64(detail).view(np.float64)))
        return self.nonfinite_input()

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        payload = self.device_payload(payload)
        head = payload[4 * self.num_words - 4 :].cpu().numpy()  # last word, scale: 8 bytes
        self._check_scale_and_padding(float(head[4:].view(np.float32)[0]),
                                      int(head[:4].view(np.uint32)[0]))
        return self.output(out).copy_(self.decode_checked(payload, ()))

    def decode_key(self, payload: np.ndarray) -> tuple:
        self.check_payload(payload)  # the host decoder's checks
        return ()

    def decode_checked(self, payload: torch.Tensor, key: tuple) -> torch.Tensor:
        """+scale or -scale by each sign bit (the scale checked >= 0: negating it sets
        the sign bit alone, as the host decoder does)."""
        scale = payload[4 * self.num_words :].view(torch.float32)[0].to(self.dtype)
        return torch.where(unpack_signs(payload[: 4 * self.num_words], self.numel),
                           -scale, scale)

    def fast_update_error(self, corrected: torch.Tensor, payload: Payload) -> torch.Tensor:
        """corrected -= decompress(payload)."""
        return corrected.sub_(self.decompress(payload))
