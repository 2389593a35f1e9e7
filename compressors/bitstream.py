"""Elias-delta codes on an MSB-first bit stream, for the dithering payload.

Stream bit j is bit ``7 - j % 8`` of byte ``j // 8``. Elias-delta of N >= 1 (here
N < 2**32): with ``b = bitlen(N)``, ``lb = bitlen(b)``: ``lb - 1`` zeros, ``b`` in ``lb``
bits, then the low ``b - 1`` bits of N.

The kernels move 64 stream bits at a time: a big-endian uint64 word holds stream bits
``64 w .. 64 w + 63`` MSB-first, so ``byteswap`` turns a little-endian word load or
store into the stream's order. Only scalar helpers live here: the writer and reader
loops are written inside the dithering kernels, because a numba call that passes an
array costs reference-count updates (measured ~30x slower on this hot path).
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
def delta_code(value):
    """The whole Elias-delta code of ``value`` >= 1 as (bits, length <= 42 for < 2**32):
    ``b << (b - 1) | (value - 2**(b-1))``, its lb - 1 leading zeros implied by length."""
    b = bit_length(value)
    lb = bit_length(b)
    top = np.uint64(b - 1)
    code = (np.uint64(b) << top) | (np.uint64(value) ^ (np.uint64(1) << top))
    return code, 2 * lb - 1 + b - 1


@njit(nogil=True, cache=True)
def byteswap(word):
    """Reverse the bytes of a uint64 (LLVM turns this into one bswap)."""
    word = ((word & np.uint64(0x00FF00FF00FF00FF)) << np.uint64(8)) | (
        (word >> np.uint64(8)) & np.uint64(0x00FF00FF00FF00FF))
    word = ((word & np.uint64(0x0000FFFF0000FFFF)) << np.uint64(16)) | (
        (word >> np.uint64(16)) & np.uint64(0x0000FFFF0000FFFF))
    return (word << np.uint64(32)) | (word >> np.uint64(32))


def delta_length(value: int) -> int:
    """Bits of the Elias-delta code of ``value`` (Python ints)."""
    b = int(value).bit_length()
    return 2 * b.bit_length() - 1 + b - 1
