"""xorshift128+ (SPEC §4), the RNG of randomk and dithering.

The state is a numpy ``uint64`` array ``[a, b]``, updated in place by the kernels;
every compressor instance starts from ``(seed, seed)``::

    >>> state = new_state(7)
    >>> draws = [int(next_random(state)) for _ in range(2)]   # advances the state

The step is linear over GF(2) on the 128-bit state, so ``jump`` advances a state by any
number of steps in at most 64 matrix-vector products (``jump_table`` holds the
matrices of 2**k steps), letting threads start their chunk of draws at once::

    >>> a, b = jump(np.uint64(7), np.uint64(7), 2, jump_table())  # == after 2 draws
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

DEFAULT_SEED = 1  # used when compression_params["seed"] is None (not set by a trainer)
UINT64_MAX_F64 = float(2**64 - 1)  # bernoulli threshold factor, compared in float64


def new_state(seed: int) -> np.ndarray:
    return np.array([seed, seed], dtype=np.uint64)


@njit(nogil=True, cache=True)
def xorshift_step(a, b):
    """One xorshift128+ step on a state held in registers: returns (a', b', draw).
    ``t=a; s=b; a=s; t^=t<<23; t^=t>>17; t^=s^(s>>26); b=t; draw=t+s``."""
    t = a
    s = b
    t ^= t << uint64(23)
    t ^= t >> uint64(17)
    t ^= s ^ (s >> uint64(26))
    return s, t, t + s


@njit(nogil=True, cache=True)
def next_random(state):
    """One xorshift128+ step on ``state`` (updated in place); returns the draw."""
    state[0], state[1], draw = xorshift_step(state[0], state[1])
    return draw


@njit(nogil=True, cache=True)
def apply_matrix(columns, a, b):
    """The state ``(a, b)`` times a 128x128 GF(2) matrix given by its ``columns``
    (shape (128, 2): column j is the image of state bit j; bits 0-63 are a's)."""
    ra = uint64(0)
    rb = uint64(0)
    for j in range(64):
        if (a >> uint64(j)) & uint64(1):
            ra ^= columns[j, 0]
            rb ^= columns[j, 1]
        if (b >> uint64(j)) & uint64(1):
            ra ^= columns[64 + j, 0]
            rb ^= columns[64 + j, 1]
    return ra, rb


@njit(nogil=True, cache=True)
def power_columns():
    """Columns of the step matrix M^(2**k) for k = 0..63 (shape (64, 128, 2))."""
    table = np.empty((64, 128, 2), dtype=np.uint64)
    for j in range(128):  # M: one step applied to each basis state
        a = uint64(1) << uint64(j) if j < 64 else uint64(0)
        b = uint64(1) << uint64(j - 64) if j >= 64 else uint64(0)
        table[0, j, 0], table[0, j, 1], _ = xorshift_step(a, b)
    for k in range(1, 64):  # M^(2**k) = M^(2**(k-1)) squared
        for j in range(128):
            table[k, j, 0], table[k, j, 1] = apply_matrix(
                table[k - 1], table[k - 1, j, 0], table[k - 1, j, 1])
    return table


_JUMP_TABLE: list = []


def jump_table() -> np.ndarray:
    """The (64, 128, 2) table of ``power_columns``, computed once (~1 ms)."""
    if not _JUMP_TABLE:
        table = power_columns()
        table.setflags(write=False)
        _JUMP_TABLE.append(table)
    return _JUMP_TABLE[0]


@njit(nogil=True, cache=True)
def jump(a, b, distance, table):
    """The state ``(a, b)`` advanced by ``distance`` >= 0 steps, as (a', b')."""
    a = uint64(a)
    b = uint64(b)
    for k in range(64):
        if (uint64(distance) >> uint64(k)) & uint64(1):
            a, b = apply_matrix(table[k], a, b)
    return a, b


def state_list(state: np.ndarray) -> list:
    return [int(state[0]), int(state[1])]


def load_state_list(owner: object, state: np.ndarray, value: object) -> None:
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64 for v in value)
    )
    if not ok:
        raise ValueError(
            f"{type(owner).__name__} state 'rng' must be a list of two ints in [0, 2**64), "
            f"got {value!r}"
        )
    state[0], state[1] = value
