"""Elias-delta codes on an MSB-first bit stream, for the dithering payload.

Stream bit j is bit ``7 - j % 8`` of byte ``j // 8``. Elias-delta of N >= 1 (here
N < 2**32): with ``b = bitlen(N)``, ``lb = bitlen(b)``: ``lb - 1`` zeros, ``b`` in ``lb``
bits, then the low ``b - 1`` bits of N.

Only scalar helpers live here: the stream writer and reader are written inside the
dithering kernels, because a numba call that passes an array costs reference-count
updates (measured ~30x slower than inlined code on this hot path).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

MAX_CODE_BITS = 32  # largest b the reader accepts (values < 2**32)
MAX_HEAD_ZEROS = 5  # lb - 1 for b <= 32


@njit(nogil=True, cache=True)
def bit_length(value):
    """Number of significant bits of a non-negative int (0 for 0)."""
    return 64 - np.int64(leading_zeros(np.uint64(value)))


@njit(nogil=True, cache=True)
def delta_parts(value):
    """Elias-delta of ``value`` as (head, head_bits, tail, tail_bits), each <= 32 bits."""
    b = bit_length(value)
    lb = bit_length(b)
    tail = np.uint64(value) & ((np.uint64(1) << np.uint64(b - 1)) - np.uint64(1))
    return np.uint64(b), 2 * lb - 1, tail, b - 1


def delta_length(value: int) -> int:
    """Bits of the Elias-delta code of ``value`` (Python ints)."""
    b = int(value).bit_length()
    return 2 * b.bit_length() - 1 + b - 1
