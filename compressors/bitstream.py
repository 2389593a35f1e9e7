"""MSB-first bit stream with Elias-delta codes, for the dithering payload.

A writer or reader is a handful of scalars threaded through small inlined numba
functions (numba has no mutable structs without overhead). Stream bit j is bit
``7 - j % 8`` of byte ``j // 8``.

Elias-delta of N >= 1 (here N < 2**32): with ``b = bitlen(N)``, ``lb = bitlen(b)``:
``lb - 1`` zeros, ``b`` in ``lb`` bits, then the low ``b - 1`` bits of N.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

MAX_CODE_BITS = 32  # largest b accepted by the reader (values < 2**32)


@njit(nogil=True, cache=True)
def bit_length(value):
    """Number of significant bits of a uint64 (0 for 0)."""
    return 64 - np.int64(leading_zeros(np.uint64(value)))


@njit(nogil=True, cache=True)
def put_bits(stream, acc, fill, pos, value, nbits):
    """Append the low ``nbits`` (<= 32) of ``value``; flushes whole 32-bit groups."""
    acc = (acc << np.uint64(nbits)) | np.uint64(value)
    fill += nbits
    if fill >= 32:
        fill -= 32
        word = acc >> np.uint64(fill)
        stream[pos] = np.uint8((word >> np.uint64(24)) & np.uint64(0xFF))
        stream[pos + 1] = np.uint8((word >> np.uint64(16)) & np.uint64(0xFF))
        stream[pos + 2] = np.uint8((word >> np.uint64(8)) & np.uint64(0xFF))
        stream[pos + 3] = np.uint8(word & np.uint64(0xFF))
        pos += 4
    return acc, fill, pos


@njit(nogil=True, cache=True)
def put_delta(stream, acc, fill, pos, value):
    """Append the Elias-delta code of ``value`` (1 <= value < 2**32)."""
    b = bit_length(value)
    lb = bit_length(b)
    acc, fill, pos = put_bits(stream, acc, fill, pos, b, 2 * lb - 1)
    if b > 1:
        low = np.uint64(value) & ((np.uint64(1) << np.uint64(b - 1)) - np.uint64(1))
        acc, fill, pos = put_bits(stream, acc, fill, pos, low, b - 1)
    return acc, fill, pos


@njit(nogil=True, cache=True)
def finish_bits(stream, acc, fill, pos):
    """Flush the last partial group; returns the total number of bits."""
    if fill:
        tail = (acc << np.uint64(32 - fill)) & np.uint64(0xFFFFFFFF)
        for j in range((fill + 7) // 8):
            stream[pos + j] = np.uint8((tail >> np.uint64(24 - 8 * j)) & np.uint64(0xFF))
    return pos * 8 + fill


@njit(nogil=True, cache=True)
def refill(stream, acc, avail, pos):
    """Top up the left-aligned reader word from the stream, a byte at a time."""
    while avail <= 56 and pos < stream.size:
        acc |= np.uint64(stream[pos]) << np.uint64(56 - avail)
        avail += 8
        pos += 1
    return acc, avail, pos


@njit(nogil=True, cache=True)
def get_delta(stream, acc, avail, pos, left):
    """Read one Elias-delta code with at most ``left`` bits remaining.

    Returns (value, acc, avail, pos, left); value 0 means a malformed or truncated code.
    """
    acc, avail, pos = refill(stream, acc, avail, pos)
    zeros = np.int64(leading_zeros(acc))
    head = 2 * zeros + 1
    if zeros > 5 or head > avail or head > left:  # b would exceed 32, or truncated
        return np.uint64(0), acc, avail, pos, left
    b = np.int64(acc >> np.uint64(64 - head))
    acc <<= np.uint64(head)
    avail -= head
    left -= head
    if b > MAX_CODE_BITS:
        return np.uint64(0), acc, avail, pos, left
    value = np.uint64(1) << np.uint64(b - 1)
    if b > 1:
        acc, avail, pos = refill(stream, acc, avail, pos)
        if b - 1 > avail or b - 1 > left:
            return np.uint64(0), acc, avail, pos, left
        value |= acc >> np.uint64(65 - b)
        acc <<= np.uint64(b - 1)
        avail -= b - 1
        left -= b - 1
    return value, acc, avail, pos, left
