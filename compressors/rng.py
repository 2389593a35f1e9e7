"""xorshift128+ (SPEC §4), the RNG of randomk and dithering.

The state is a numpy ``uint64`` array ``[a, b]``, updated in place by the kernels;
every compressor instance starts from ``(seed, seed)``::

    >>> state = new_state(7)
    >>> draws = [int(next_random(state)) for _ in range(2)]   # advances the state
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
