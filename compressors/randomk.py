"""randomk: k entries drawn uniformly with replacement, docs/compression.md.

Payload (little-endian), ``16 + k * itemsize`` bytes::

    2 x uint64   the xorshift128+ state (a, b) before the draws
    k x dtype    the values x[index_j] in draw order, bit-exact

The receiver regenerates the indices ``randint(0, numel)`` from the state, so no
index travels. The sender's state advances by k draws per compress. A drawn value
that is inf or NaN makes ``compress`` raise NonFiniteError with the state unchanged
(only the drawn entries are read: error feedback's pass, or the trainer's divide,
checks the others); decoding refuses such values.

Example::

    >>> import torch
    >>> c = RandomK(numel=4, dtype=torch.float32, k=2, seed=1)
    >>> y = c.decompress(c.compress(torch.tensor([1.0, 2.0, 3.0, 4.0])))
    >>> int((y != 0).sum()) <= 2
    True
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from numba import njit

from .base import (
    KERNEL_FLOAT_DTYPES,
    Description,
    Payload,
    bit_view,
    nonfinite_bits,
    payload_bytes,
    sub_array,
)
from .rng import SeededState, job_seed, new_state, xorshift_step
from .sparse import SparseCompressor, resolve_k

BLOCK = 4096  # indices drawn ahead of the memory accesses that use them


@njit(nogil=True, cache=True)
def draw_indices(state, n, indices):
    """indices[j] = randint(0, n) for j in order; advances ``state``.

    Drawing a block before touching memory keeps the sequential xorshift chain apart
    from the cache misses of the scattered accesses, so both overlap better."""
    a = state[0]
    b = state[1]
    for j in range(indices.size):
        a, b, draw = xorshift_step(a, b)
        indices[j] = draw % np.uint64(n)
    state[0] = a
    state[1] = b


@njit(nogil=True, cache=True)
def gather_random(state, source, values):
    """values[j] = source[randint(0, n)] for j in order; advances ``state``."""
    indices = np.empty(min(BLOCK, values.size), dtype=np.uint64)
    for start in range(0, values.size, BLOCK):
        count = min(BLOCK, values.size - start)
        draw_indices(state, source.size, indices[:count])
        for j in range(count):
            values[start + j] = source[indices[j]]


@njit(nogil=True, cache=True)
def scatter_random(state, values, out):
    """out[randint(0, n)] = values[j] in draw order, from ``state`` (advanced)."""
    indices = np.empty(min(BLOCK, values.size), dtype=np.uint64)
    for start in range(0, values.size, BLOCK):
        count = min(BLOCK, values.size - start)
        draw_indices(state, out.size, indices[:count])
        for j in range(count):
            out[indices[j]] = values[start + j]


@njit(nogil=True, cache=True)
def zero_random(state, count, out):
    """out[randint(0, n)] = 0 for ``count`` draws from ``state`` (advanced)."""
    indices = np.empty(min(BLOCK, count), dtype=np.uint64)
    zero = out.dtype.type(0)
    for start in range(0, count, BLOCK):
        block = min(BLOCK, count - start)
        draw_indices(state, out.size, indices[:block])
        for j in range(block):
            out[indices[j]] = zero


class RandomK(SeededState, SparseCompressor):
    """Keeps k uniformly drawn entries; the payload carries the RNG state, not indices."""

    description: ClassVar[Description] = Description(
        examples=({"k": 0.1, "seed": 7}, {"k": 1, "seed": 3},
                  {"k": 300, "seed": 9}),  # k clamped to numel: many repeated draws
        typical={"k": 0.01},
        reads_all=False, label="k entries drawn at random")


    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, k: int = 1,
                 seed: int = 1):
        super().__init__(numel, dtype)
        if not 1 <= k <= numel:
            raise ValueError(f"randomk needs 1 <= k <= numel={numel}, got k={k}")
        self.k = k
        self.rng = new_state(seed)
        self.bits_dtype = bit_view(torch.empty(0, dtype=dtype)).dtype
        self.payload_size = self.max_payload_bytes(numel, dtype, k)
        self.indices: np.ndarray | None = None  # decompress_add's, kept for the next call
        self.undo: np.ndarray | None = None  # the RNG state before the last compress

    @classmethod
    def options(cls, params: dict, numel: int) -> dict:
        return {"k": resolve_k(params, numel), "seed": job_seed(params)}

    @classmethod
    def max_payload_bytes(cls, numel: int, dtype: torch.dtype = torch.float32, k: int = 1,
                          **options: object) -> int:
        """Every payload's size: the 16-byte generator state, then k values.

            >>> RandomK.max_payload_bytes(1000, torch.float16, k=3)
            22
        """
        return 16 + k * dtype.itemsize

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        bits = bit_view(self.check_input(x))
        payload = torch.empty(self.payload_size, dtype=torch.uint8)
        buffer = payload.numpy()
        state = sub_array(buffer, 0, np.uint64, 2)
        state[:] = self.rng
        values = sub_array(buffer, 16, self.bits_dtype, self.k)
        gather_random(self.rng, bits, values)
        if nonfinite_bits(values, self.dtype):
            self.rng[:] = state  # nothing changed
            raise self.nonfinite_input()
        self.undo = state.copy()
        return payload


    def _parse(self, payload: Payload) -> tuple[np.ndarray, np.ndarray]:
        buffer = payload_bytes(payload)
        self.check_size(buffer, self.payload_size)
        state = sub_array(buffer, 0, np.uint64, 2).copy()
        values = sub_array(buffer, 16, self.bits_dtype, self.k)
        self.check_finite_values(values)
        return state, values

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        state, values = self._parse(payload)
        out = self.output(out)
        out.zero_()
        scatter_random(state, values, bit_view(out))
        return out

    def decompress_add(self, payload: Payload, total: torch.Tensor,
                       scratch: torch.Tensor | None = None) -> torch.Tensor:
        """``total += decompress(payload)`` touching only the drawn elements."""
        if self.dtype not in KERNEL_FLOAT_DTYPES:
            return super().decompress_add(payload, total, scratch)
        state, values = self._parse(payload)
        if self.indices is None:
            self.indices = np.empty(self.k, dtype=np.uint64)
        draw_indices(state, self.numel, self.indices)
        return self.add_entries(self.indices, values, total)

    def fast_update_error(self, corrected: torch.Tensor, payload: Payload) -> torch.Tensor:
        """corrected -= decompress(payload): the drawn entries become 0, the rest stay."""
        state, _ = self._parse(payload)
        zero_random(state, self.k, bit_view(corrected))
        return corrected

