"""onebit (signSGD with optional scaling), docs/compression.md.

Payload (little-endian), ``W = ceil(numel / 32)``, ``4 * W + 4`` bytes::

    W x uint32   sign words: bit i (x[i] < 0) is bit 31 - i % 32 of word i // 32
                 (MSB-first); padding bits are 0
    float32      scale: sum(|x|) / numel if scaling (the sum in float64; its
                 summation order is the vectorised kernel's, not fixed), else 1.0,
                 or 0.0 for an all-zero input (which must decode to zeros)

An input with inf or NaN entries raises NonFiniteError (their sum(|x|) is not finite:
the check costs nothing); a payload whose scale is not finite is refused.

Example::

    >>> import torch
    >>> c = OneBit(numel=3, dtype=torch.float32, scaling=False)
    >>> c.decompress(c.compress(torch.tensor([0.5, -2.0, 0.0])))
    tensor([ 1., -1.,  1.])
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch
from numba import njit

from bps.common.config import Key, boolean

from .base import (
    KERNEL_FLOAT_DTYPES,
    Compressor,
    Payload,
    bit_view,
    float_view,
    payload_bytes,
    sub_array,
)
from .threads import chunk_bounds, run_chunks


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz", "contract"})
def pack_signs(x, words):
    """Write the sign words of ``x`` (bit = x < 0, MSB-first); return sum(|x|) in float64."""
    n = x.size
    total = 0.0
    for w in range((n + 31) // 32):
        base = w * 32
        word = np.uint32(0)
        if base + 32 <= n:
            for j in range(32):
                value = x[base + j]
                word |= np.uint32(value < 0) << np.uint32(31 - j)
                total += abs(np.float64(value))
        else:
            for j in range(n - base):
                value = x[base + j]
                word |= np.uint32(value < 0) << np.uint32(31 - j)
                total += abs(np.float64(value))
        words[w] = word
    return total


@njit(nogil=True, cache=True)
def unpack_signs(words, scale_bits, sign_mask, out):
    """out[i] = scale's raw bits, with ``sign_mask`` set where bit i is set (any width)."""
    n = out.size
    zero = out.dtype.type(0)
    for w in range((n + 31) // 32):
        word = words[w]
        for j in range(min(32, n - w * 32)):
            negative = (word >> np.uint32(31 - j)) & np.uint32(1)
            out[w * 32 + j] = scale_bits | (sign_mask if negative else zero)


@njit(nogil=True, cache=True)
def subtract_signs(corrected, words, scale):
    """corrected[i] -= -scale if bit i else +scale (error feedback's fast path)."""
    n = corrected.size
    for w in range((n + 31) // 32):
        word = words[w]
        for j in range(min(32, n - w * 32)):
            negative = (word >> np.uint32(31 - j)) & np.uint32(1)
            corrected[w * 32 + j] -= -scale if negative else scale


class OneBit(Compressor):
    """Sign compression: 1 bit per element plus a float32 scale."""

    # True by default with onebit; BytePS's plain signs: False
    keys: ClassVar[dict[str, Key]] = {"scaling": Key(boolean, fill=True)}

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, scaling: bool = False):
        super().__init__(numel, dtype)
        self.scaling = scaling
        self.num_words = (numel + 31) // 32
        self.payload_size = self.max_payload_bytes(numel, dtype)
        self.bounds = chunk_bounds(numel)
        self.max_scale = float(torch.finfo(dtype).max)  # a larger one decodes to inf

    @classmethod
    def options(cls, params: dict, numel: int) -> dict:
        return {"scaling": params["scaling"]}

    @classmethod
    def max_payload_bytes(cls, numel: int, dtype: torch.dtype = torch.float32,
                          **options: object) -> int:
        """Every payload's size: one bit per element in whole uint32 words, the scale.

            >>> OneBit.max_payload_bytes(100)
            20
        """
        return 4 * ((numel + 31) // 32) + 4

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        values = float_view(self.check_input(x))
        payload = torch.empty(self.payload_size, dtype=torch.uint8)
        buffer = payload.numpy()
        words = sub_array(buffer, 0, np.uint32, self.num_words)
        sums = run_chunks(lambda lo, hi: pack_signs(values[lo:hi], words[lo // 32 :]),
                          self.bounds)
        total = sum(sums)
        if not math.isfinite(total):  # sum(|x|) in float64: inf or NaN only from the input
            raise self.nonfinite_input()
        if self.scaling:
            scale = total / self.numel
        else:  # docs/compression.md: an all-zero input decodes to zeros, so its unscaled scale is 0
            scale = 0.0 if total == 0.0 else 1.0
        sub_array(buffer, 4 * self.num_words, np.float32, 1)[0] = scale
        return payload

    def _parse(self, payload: Payload) -> tuple[np.ndarray, float]:
        buffer = payload_bytes(payload)
        self.check_size(buffer, self.payload_size)
        words = sub_array(buffer, 0, np.uint32, self.num_words)
        scale = float(sub_array(buffer, 4 * self.num_words, np.float32, 1)[0])
        if not (0.0 <= scale <= self.max_scale):  # also inf and NaN
            raise self.bad_payload(f"scale {scale} is not finite and >= 0 in {self.dtype}")
        tail = self.numel % 32
        if tail and int(words[-1]) & ((1 << (32 - tail)) - 1):
            raise self.bad_payload("padding bits of the last sign word are not zero")
        return words, scale

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        words, scale = self._parse(payload)
        out = self.output(out)
        scale_bits = bit_view(torch.tensor([scale], dtype=self.dtype))[0]
        bits = bit_view(out)
        sign_mask = bits.dtype.type(1 << (8 * bits.itemsize - 1))
        run_chunks(
            lambda lo, hi: unpack_signs(words[lo // 32 :], scale_bits, sign_mask, bits[lo:hi]),
            self.bounds,
        )
        return out

    def decompress_add(self, payload: Payload, total: torch.Tensor,
                       scratch: torch.Tensor | None = None) -> torch.Tensor:
        """``total += decompress(payload)`` in one pass, without decoding."""
        if self.dtype not in KERNEL_FLOAT_DTYPES:
            return super().decompress_add(payload, total, scratch)
        words, scale = self._parse(payload)
        array = self.output(total, "total").numpy()
        self._subtract_signs(array, words, -array.dtype.type(scale))  # adds -scale / +scale
        return total

    def _subtract_signs(self, array: np.ndarray, words: np.ndarray, scale: np.floating
                        ) -> None:
        """``subtract_signs`` over the chunks of a large array on several threads."""
        run_chunks(lambda lo, hi: subtract_signs(array[lo:hi], words[lo // 32 :], scale),
                   self.bounds)

    def fast_update_error(self, corrected: torch.Tensor, payload: Payload) -> torch.Tensor:
        """corrected -= decompress(payload), in one pass for float32/float64."""
        if self.dtype not in KERNEL_FLOAT_DTYPES:
            return corrected.sub_(self.decompress(payload))
        words, scale = self._parse(payload)
        array = corrected.numpy()
        self._subtract_signs(array, words, array.dtype.type(scale))
        return corrected
