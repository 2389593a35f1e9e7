"""What the sparse compressors (topk, randomk) share: their key ``k`` and adding a sparse
payload (indices, values) into a dense sum without decoding it.

``k`` is a count (an int >= 1) or a fraction of the partition (a float in (0, 1)):
:func:`resolve_k` turns it into the partition's count.

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
    >>> resolve_k({"k": 0.01}, 1000), resolve_k({"k": 50}, 10)
    (10, 10)
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from numba import njit

from bps.common.config import Key, fail, is_int, is_real

from .base import Compressor, float_view, nonfinite_bits

COUNT_OR_FRACTION = "an int >= 1 (count) or a float in (0, 1) (fraction of the partition)"


def count_or_fraction(key: str, value: Any) -> int | float:
    """The rule of ``k``: an int >= 1 or a float in (0, 1)."""
    if is_int(value):
        if value < 1:
            raise fail(ValueError, key, value, COUNT_OR_FRACTION)
        return int(value)
    if is_real(value):
        if not 0.0 < float(value) < 1.0:  # also rejects NaN
            raise fail(ValueError, key, value, COUNT_OR_FRACTION)
        return float(value)
    raise fail(TypeError, key, value, COUNT_OR_FRACTION)


def resolve_k(params: dict, numel: int) -> int:
    """The element count of topk/randomk for a partition of ``numel`` elements.

    An int ``k`` is a count, a float a fraction: ``max(1, int(k * numel))``; either is
    clamped to ``numel``.
    """
    k = params["k"]
    count = k if is_int(k) else max(1, int(k * numel))
    return int(min(count, numel))


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


class SparseCompressor(Compressor):
    """Base of topk and randomk: ``k`` entries of the partition travel as their values."""

    keys: ClassVar[dict[str, Key]] = {"k": Key(count_or_fraction, required=COUNT_OR_FRACTION)}

    def staging(self) -> np.ndarray:
        """An all-zero float32/float64 array of numel elements, made on first use, for
        ``add_last_values`` (which leaves it all zero again)."""
        staging = getattr(self, "_staging", None)
        if staging is None:
            staging = self._staging = torch.zeros(self.numel, dtype=self.dtype).numpy()
        return staging

    def add_entries(self, indices: np.ndarray, raw_values: np.ndarray,
                    total: torch.Tensor) -> torch.Tensor:
        """``total += y`` for the sparse ``y`` that decoding writes (zeros, then
        ``y[indices[j]] = value j`` in order, so a repeated index keeps its last value),
        touching only the indexed elements; ``raw_values`` are the values' raw bits and
        the indices are checked. float32/float64 only."""
        target = float_view(self.output(total, "total"))
        add_last_values(indices, raw_values.view(target.dtype), self.staging(), target)
        return total

    def check_finite_values(self, bits: np.ndarray) -> None:
        """Refuse a payload whose values (raw bits of the dtype) hold an inf or NaN."""
        if nonfinite_bits(bits, self.dtype):
            raise self.bad_payload("a value is inf or NaN")
