"""terngrad: each element becomes -1, 0 or +1 times max|x|, docs/compression.md.

TernGrad (Wen et al. 2017): with ``s = max|x|``, element i decodes to ``sign(x_i) * s``
with probability ``p_i = |x_i| / s`` and to 0 otherwise, so the decoded tensor is an
unbiased estimate of ``x``. ``p_i`` is rounded to float32 and drawn as dithering draws
its levels (this is dithering's quantiser with one level): one xorshift128+ number per
element, in index order, zeros included; element i is kept where ``draw < p_i *
(2**64 - 1)`` (float64). The sender's RNG advances by numel per compress; the payload
carries no RNG state.

Payload (little-endian), ``8 + ceil(numel / 4)`` bytes::

    float64              s = max|x| (exact for every dtype; 0 for an all-zero input)
    ceil(numel/4) bytes  2-bit codes, element i at bits 2 (i % 4) .. 2 (i % 4) + 1 of
                         byte i // 4: 0 -> 0, 1 -> +s, 2 -> -s; 3 and padding codes
                         other than 0 are refused

Decoded values are exactly ``+-s`` or 0 in the tensor's dtype. An input with inf or NaN
entries raises NonFiniteError with the state unchanged.

:class:`TernGradTorch` builds the same bytes with torch kernels on the tensor's device
(the draws as dithering_torch draws them); its one host sync is the status read.

Example::

    >>> import torch
    >>> c = TernGrad(numel=4, dtype=torch.float32, seed=1)
    >>> y = c.decompress(c.compress(torch.tensor([0.0, 2.0, -2.0, 0.5])))
    >>> y[:3].tolist(), float(y[3]) in (0.0, 2.0)
    ([0.0, 2.0, -2.0], True)
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch
from numba import njit

from .base import (
    KERNEL_FLOAT_DTYPES,
    Compressor,
    Description,
    Payload,
    float_view,
    payload_bytes,
    sub_array,
)
from .device import INPUT_NONFINITE, TorchKernels, flag_status
from .dithering_quantiser import max_abs, quantise_range
from .dithering_torch import DeviceDraws, quantise
from .rng import SeededStaged, SeededState, job_seed, jump, jump_table, new_state
from .threads import chunk_bounds, run_chunks

HEADER = 8  # the float64 scale


@njit(nogil=True, cache=True)
def pack_codes(levels, codes):
    """codes[i // 4] holds the 2-bit code of levels[i] (-1, 0, +1 -> 2, 0, 1) at bit
    2 (i % 4); padding codes are 0."""
    codes[:] = 0
    for i in range(levels.size):
        level = levels[i]
        code = np.uint8(1) if level > 0 else (np.uint8(2) if level < 0 else np.uint8(0))
        codes[i >> 2] |= code << np.uint8(2 * (i & 3))


@njit(nogil=True, cache=True)
def unpack_codes(codes, scale, out):
    """out[i] = +scale, -scale or 0 as element i's code says; returns the first invalid
    code's element index (a code 3, or a nonzero padding code), else -1."""
    bad = -1
    n = out.size
    for i in range(codes.size * 4):
        code = (codes[i >> 2] >> np.uint8(2 * (i & 3))) & np.uint8(3)
        if i >= n:
            if code != 0 and bad < 0:
                bad = i
            continue
        if code == 3 and bad < 0:
            bad = i
        out[i] = scale if code == 1 else (-scale if code == 2 else 0.0)
    return bad


class TernGrad(SeededState, Compressor):
    """Stochastic ternary gradients: signs times max|x|, kept with probability |x|/max."""

    description: ClassVar[Description] = Description(
        examples=({"seed": 7},), typical={}, feedback=False,
        label="ternary signs times max magnitude, unbiased")

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, seed: int = 1):
        super().__init__(numel, dtype)
        self.rng = new_state(seed)
        self.payload_size = self.max_payload_bytes(numel, dtype)
        self.bounds = chunk_bounds(numel)  # a large input quantises on several threads
        self.levels = np.empty(numel, dtype=np.int8)
        self.undo: np.ndarray | None = None  # the RNG state before the last compress

    @classmethod
    def options(cls, params: dict, numel: int) -> dict:
        return {"seed": job_seed(params)}

    @classmethod
    def max_payload_bytes(cls, numel: int, dtype: torch.dtype = torch.float32,
                          **options: object) -> int:
        """Every payload's size: the float64 scale, then 2 bits an element.

            >>> TernGrad.max_payload_bytes(10)
            11
        """
        return HEADER + -(-numel // 4)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode_payload(float_view(self.check_input(x)), residual=False)

    def compress_residual(self, corrected: torch.Tensor) -> torch.Tensor:
        """Compress ``corrected`` and leave ``corrected - decompress(payload)`` in it (error
        feedback): float32/float64 in the quantiser's pass, others by decoding.

            >>> c = TernGrad(numel=2, seed=1)
            >>> x = torch.tensor([1.0, -1.0])
            >>> c.compress_residual(x)[HEADER:].tolist(), x.tolist()
            ([9], [0.0, 0.0])
        """
        values = self.check_input(corrected)
        if values is not corrected or self.dtype not in KERNEL_FLOAT_DTYPES:
            payload = self.compress(corrected)
            corrected.sub_(self.decompress(payload))
            return payload
        return self.encode_payload(corrected.numpy(), residual=True)

    def encode_payload(self, values: np.ndarray, residual: bool) -> torch.Tensor:
        """The payload of ``values``; with ``residual``, ``values`` becomes the residual."""
        scale = max_abs(values, self.bounds)
        if not math.isfinite(scale):
            raise self.nonfinite_input()
        a, b = self.rng
        levels = self.levels
        if scale > 0.0:  # scale 0: every level is 0 and the residual is the input
            unit = scale if residual else 0.0
            run_chunks(lambda lo, hi: quantise_range(
                values, lo, hi, a, b, scale, 1.0, False, np.empty(0, values.dtype), unit,
                levels), self.bounds)
        else:
            levels[:] = 0
        payload = torch.empty(self.payload_size, dtype=torch.uint8)
        buffer = payload.numpy()
        buffer[:HEADER] = np.array([scale], dtype=np.float64).view(np.uint8)
        pack_codes(levels, buffer[HEADER:])
        self.undo = self.rng.copy()
        self.rng[0], self.rng[1] = jump(a, b, self.numel, jump_table())
        return payload

    def parse(self, payload: Payload) -> tuple[float, np.ndarray]:
        """(the scale, the code bytes) of a payload of the right size."""
        buffer = payload_bytes(payload)
        self.check_size(buffer, self.payload_size)
        scale = float(sub_array(buffer, 0, np.float64, 1)[0])
        if not (math.isfinite(scale) and scale >= 0.0):
            raise self.bad_payload(f"scale {scale!r} is not a finite number >= 0")
        return scale, buffer[HEADER:]

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        scale, codes = self.parse(payload)
        out = self.output(out)
        direct = self.dtype in KERNEL_FLOAT_DTYPES  # others: through float32 (exact)
        values = out.numpy() if direct else np.empty(self.numel, dtype=np.float32)
        bad = unpack_codes(codes, values.dtype.type(scale), values)
        if bad >= 0:
            raise self.invalid_code(bad)
        if not direct:
            out.copy_(torch.from_numpy(values))
        return out

    def invalid_code(self, index: int) -> ValueError:
        where = "padding code" if index >= self.numel else "code"
        return self.bad_payload(f"{where} of element {index} is not 0, 1 or 2")




def code_shifts(device: torch.device) -> torch.Tensor:
    """0, 2, 4, 6 as uint8 on ``device`` (made there: no host transfer)."""
    return torch.arange(0, 8, 2, dtype=torch.uint8, device=device)


def pack_levels(levels: torch.Tensor, numel: int) -> torch.Tensor:
    """The code bytes of int64 ``levels`` (-1, 0, +1), as :func:`pack_codes` writes them.

        >>> pack_levels(torch.tensor([1, -1, 0, 0, 1]), 5).tolist()
        [9, 1]
    """
    codes = torch.zeros(-(-numel // 4) * 4, dtype=torch.uint8, device=levels.device)
    codes[:numel] = (levels > 0).to(torch.uint8) + 2 * (levels < 0).to(torch.uint8)
    return (codes.view(-1, 4) << code_shifts(levels.device)).sum(-1, dtype=torch.uint8)


def unpack_levels(codes: torch.Tensor) -> torch.Tensor:
    """Every 2-bit code of the bytes ``codes`` (uint8), padding included, in element order."""
    return ((codes.unsqueeze(-1) >> code_shifts(codes.device)) & 3).reshape(-1)


class TernGradTorch(SeededStaged, TorchKernels, TernGrad):
    """TernGrad on ``device`` with torch kernels (payload also on ``device``)."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, seed: int = 1,
                 device: torch.device | str | None = None):
        TernGrad.__init__(self, numel, dtype, seed)
        TorchKernels.__init__(self, numel, dtype, device)
        self.draws = DeviceDraws(numel, self.device)

    def _encode(self, x: torch.Tensor) -> tuple:
        values = x if x.dtype in KERNEL_FLOAT_DTYPES else x.float()
        scale = values.abs().amax().double()
        draws = self.draws(self.rng)
        levels = torch.where(scale > 0, quantise(values, scale, 1.0, False, draws), 0)
        payload = torch.cat([scale.reshape(1).view(torch.uint8),
                             pack_levels(levels, self.numel)])
        self.pending = jump(self.rng[0], self.rng[1], self.numel, jump_table())
        return payload, flag_status(~torch.isfinite(scale), INPUT_NONFINITE), levels, scale

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, status, _, _ = self._encode(self.check_input(x))
        return payload, status

    def encode_residual(self, corrected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, status, levels, scale = self._encode(corrected)
        corrected.sub_((levels.double() * scale).to(self.dtype))
        return payload, status

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decoded on the device; the checks' flags come back in one host sync."""
        payload = self.device_payload(payload)
        scale = payload[:HEADER].view(torch.float64)
        codes = unpack_levels(payload[HEADER:])
        bad = (codes == 3) | (torch.arange(codes.numel(), device=self.device) >= self.numel) & (
            codes != 0)
        first = torch.where(bad.any(), bad.to(torch.uint8).argmax(), -1).reshape(1)
        head = torch.cat([scale, first.double()]).cpu().numpy()
        if not (math.isfinite(head[0]) and head[0] >= 0.0):
            raise self.bad_payload(f"scale {float(head[0])!r} is not a finite number >= 0")
        if head[1] >= 0:
            raise self.invalid_code(int(head[1]))
        levels = codes[: self.numel].to(torch.int8)
        levels = torch.where(levels == 2, -1, levels)
        out = self.output(out)
        return out.copy_((levels.double() * scale).to(self.dtype))

