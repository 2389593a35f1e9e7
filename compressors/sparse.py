"""Adding a sparse payload (indices, values) into a dense sum without decoding it.

Decoding writes ``y[indices[j]] = values[j]`` in order, so a repeated index keeps its
last value; ``total += y`` then touches every element. ``add_last_values`` gives the
same sum touching only the indexed elements: it stages the values (last one wins) in
an all-zero array, then adds each staged value once and clears it again.

Example::

    >>> import numpy as np
    >>> total, staging = np.ones(4, np.float32), np.zeros(4, np.float32)
    >>> add_last_values(np.array([2, 0, 2]), np.array([5, 7, 9], np.float32), staging, total)
    >>> total.tolist(), staging.tolist()
    ([8.0, 1.0, 10.0, 1.0], [0.0, 0.0, 0.0, 0.0])
"""

from __future__ import annotations

from numba import njit


@njit(nogil=True, cache=True)
def add_last_values(indices, values, staging, total):
    """``total[i] += v`` for each distinct ``i`` in ``indices``, ``v`` the value at its
    last occurrence; ``staging`` (same size as ``total``) is all zeros before and after.
    Indices must be in range (the callers have checked them)."""
    for j in range(indices.size):
        staging[indices[j]] = values[j]
    zero = staging.dtype.type(0)
    for j in range(indices.size):
        i = indices[j]
        total[i] += staging[i]  # a repeat adds the cleared 0: total[i] + 0 == total[i]
        staging[i] = zero
