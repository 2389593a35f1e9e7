"""Dithering's quantiser: stochastic rounding of |x| / scale onto s levels.

Each element draws exactly one xorshift128+ number, in index order, zeros included.
A large chunk draws with LANES interleaved generators, each jumped to the start of its
span (``rng.jump``), so the levels are those of one sequential pass::

    >>> import numpy as np
    >>> from bps.compressors.rng import new_state
    >>> x = np.array([0.0, 1.0, -1.0, 0.25], dtype=np.float32)
    >>> levels = np.empty(4, dtype=np.int8)
    >>> a, b = new_state(1)
    >>> quantise_range(x, 0, 4, a, b, 1.0, 2.0, False, np.empty(0, np.float32), 0.0, levels)
    >>> levels[:3].tolist()
    [0, 2, -2]
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .base import magnitude_bits
from .bitstream import bit_length
from .rng import LANES, UINT64_MAX_F64, VECTOR, draw_lanes, jump, jump_table, xorshift_step
from .threads import run_chunks


@njit(nogil=True, cache=True)
def max_magnitude_bits(bits, magnitude_mask):
    """The largest ``bits[i] & magnitude_mask``: for the raw bits of floats without their
    sign, the bits of max|x|, with NaN above inf (integer max vectorises, float max with
    NaN rules does not: 2x faster)."""
    best = bits.dtype.type(0)
    for i in range(bits.size):
        magnitude = bits[i] & magnitude_mask
        best = magnitude if magnitude > best else best
    return best


def max_abs(values: np.ndarray, bounds: list[tuple[int, int]]) -> float:
    """max|values| (float32/float64) as float64, NaN if any value is NaN, on threads."""
    bits, mask = magnitude_bits(values)
    top = max(run_chunks(lambda lo, hi: max_magnitude_bits(bits[lo:hi], mask), bounds))
    return float(np.array([top], dtype=bits.dtype).view(values.dtype)[0])


@njit(nogil=True, cache=True)
def sum_squares(x):
    total = 0.0
    for i in range(x.size):
        total += np.float64(x[i]) * np.float64(x[i])
    return total


@njit(nogil=True, cache=True)
def next_pow2(value):
    """Smallest power of two >= value, with next_pow2(0) = 0 and next_pow2(1) = 1."""
    if value <= 1:
        return value
    return np.int64(1) << bit_length(value - 1)


LANE_MIN = 1 << 16  # chunks shorter than this use one generator (no jumps)
DRAWS = 512  # draws per lane per quantiser pass (LANES rows of them stay in L1)


@njit(nogil=True, cache=True)
def quantise_block(x, scale, top, natural, draws, levels_out):
    """levels_out[j] = q of x[j] given its draw, negated where x[j] < 0 (vectorisable)."""
    for j in range(x.size):
        r = np.float64(draws[j])
        value = abs(np.float64(x[j]))
        if natural:
            u = value / scale * top
            f = next_pow2(np.int64(np.ceil(u))) >> 1
            length = max(f, 1)
            q = f + length * np.int64(r < (u - f) / length * UINT64_MAX_F64)
        else:
            u = np.float32(value / scale * top)
            low = np.floor(u)
            q = np.int64(low) + np.int64(r < np.float64(u - low) * UINT64_MAX_F64)
        levels_out[j] = -q if x[j] < 0 else q


@njit(nogil=True, cache=True)
def subtract_levels(values, levels, dequantised):
    """``values[i] -= dequantised[levels[i] + middle]`` with ``middle`` the index of level
    0: error feedback's ``e = g' - D(c)`` from the levels just drawn, without decoding."""
    middle = (dequantised.size - 1) // 2
    for i in range(values.size):
        values[np.uint64(i)] -= dequantised[np.uint64(levels[np.uint64(i)] + middle)]


@njit(nogil=True, cache=True)
def subtract_scaled(values, levels, unit):
    """``values[i] -= level * unit``, the product rounded to the values' dtype: error
    feedback's residual where the divisor is a power of two, for then ``q * (scale /
    divisor)`` in float64 is exactly ``q * scale / divisor``, the decoded value
    (vectorised arithmetic instead of ``subtract_levels``'s gathers: 4x faster)."""
    for i in range(values.size):
        values[i] -= values.dtype.type(np.float64(levels[i]) * unit)


@njit(nogil=True, cache=True)
def quantise_chunk(x, scale, top, natural, span, states, dequantised, unit, levels_out):
    """levels_out[i] = the signed q of x[i] (scale > 0), drawing from LANES generators;
    with ``unit`` > 0, x becomes the residual ``x - level * unit`` (``subtract_scaled``),
    else with a non-empty ``dequantised`` (the decoded value of each level, level 0 in
    the middle) ``x - dequantised[level]``, block by block while the block is in L1 (in
    ``quantise_block`` itself the loop would not vectorise).

    Lane l covers ``x[l * span : (l + 1) * span]`` and ``states[:, l]`` (a, b) is the
    generator state at its start (a jump ahead of the chunk's); with ``span >= x.size``
    lane 0 does everything, one draw at a time. Otherwise each pass steps all lanes
    DRAWS times side by side (``draw_lanes``), then quantises the lanes' blocks
    (vectorised). Draws past a lane's span are never used.
    """
    if states.shape != (2, LANES) or not states.flags.c_contiguous:
        raise ValueError("quantise_chunk: states must be a C-contiguous (2, LANES) array")
    n = x.size
    draws = np.empty((LANES, DRAWS), dtype=np.uint64)
    lanes = min(LANES, -(-n // span))
    a, b = states[0, 0], states[1, 0]
    for k0 in range(0, min(span, n), DRAWS):
        count = min(DRAWS, span - k0)
        if lanes == 1:
            for j in range(count):
                a, b, draws[0, j] = xorshift_step(a, b)
        else:
            draw_lanes(states, draws, -(-count // VECTOR))
        for lane in range(lanes):
            lo = lane * span + k0
            hi = min(lo + count, n, (lane + 1) * span)
            if lo < hi:
                quantise_block(x[lo:hi], scale, top, natural, draws[lane, : hi - lo],
                               levels_out[lo:hi])
                if unit > 0.0:
                    subtract_scaled(x[lo:hi], levels_out[lo:hi], unit)
                elif dequantised.size:
                    subtract_levels(x[lo:hi], levels_out[lo:hi], dequantised)


def quantise_range(values: np.ndarray, lo: int, hi: int, a: int, b: int, scale: float,
                   top: float, natural: bool, dequantised: np.ndarray, unit: float,
                   levels: np.ndarray) -> None:
    """``levels[lo:hi]`` = the signed levels of ``values[lo:hi]``, the generator (a, b)
    being the state at index 0 (``quantise_chunk`` for ``unit`` and ``dequantised``).
    Chunks of LANE_MIN elements or more draw with LANES generators."""
    span = -(-(hi - lo) // LANES) if hi - lo >= LANE_MIN else hi - lo
    states = np.zeros((2, LANES), dtype=np.uint64)
    table = jump_table()
    for lane in range(LANES if span < hi - lo else 1):
        states[:, lane] = jump(a, b, lo + lane * span, table)
    quantise_chunk(values[lo:hi], scale, top, natural, span, states, dequantised, unit,
                   levels[lo:hi])
