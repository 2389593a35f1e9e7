"""topk: the k entries of largest magnitude, SPEC §4.

Payload (little-endian), ``k * (4 + itemsize) + pad`` bytes::

    k x int32        indices, ascending
    pad              0 or 4 zero bytes, so the values start 8-byte aligned
    k x dtype        the values x[index], bit-exact in the tensor's dtype

Selection is linear in numel (no sort of the whole tensor): a strided sample
estimates the magnitude threshold, one pass collects the candidates above it (about
2k), and a selection over the candidates fixes the set up to exactly k.

Example::

    >>> import torch
    >>> c = TopK(numel=5, dtype=torch.float32, k=2)
    >>> c.decompress(c.compress(torch.tensor([0.1, -3.0, 0.2, 2.0, 0.0])))
    tensor([ 0., -3.,  0.,  2.,  0.])
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from .base import Compressor, Payload, bit_view, float_view, payload_bytes, sub_array
from .threads import chunk_bounds, run_chunks

SAMPLE = 4096  # strided sample size for the threshold estimate
SLACK = 2.0  # aim for about SLACK * k candidates


@njit(nogil=True, cache=True)
def collect_above(x, threshold, candidates):
    """Indices i (ascending) with not |x[i]| < threshold, up to len(candidates).

    Returns the count, or -1 if there are more than len(candidates)."""
    count = 0
    cap = candidates.size
    for i in range(x.size):
        if not abs(x[i]) < threshold:
            if count == cap:
                return -1
            candidates[count] = i
            count += 1
    return count


@njit(nogil=True, cache=True)
def kth_largest(values, k):
    """The k-th largest of ``values`` (1-based, no NaN): quickselect, linear on average.
    Reorders ``values``."""
    lo, hi = 0, values.size - 1
    target = values.size - k  # position in ascending order
    while lo < hi:
        mid = (lo + hi) // 2
        pivot = values[mid]
        i, j = lo, hi
        while i <= j:
            while values[i] < pivot:
                i += 1
            while pivot < values[j]:
                j -= 1
            if i <= j:
                values[i], values[j] = values[j], values[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break
    return values[target]


@njit(nogil=True, cache=True)
def select_exact(x, candidates, k, indices):
    """Write exactly k of the candidates with the largest |x| into indices, ascending."""
    c = candidates.size
    mags = np.empty(c, dtype=np.float64)
    for j in range(c):
        magnitude = abs(np.float64(x[candidates[j]]))
        mags[j] = np.inf if magnitude != magnitude else magnitude  # NaN ranks first
    cut = kth_largest(mags, k)
    above = 0
    for j in range(c):
        magnitude = abs(np.float64(x[candidates[j]]))
        if magnitude > cut or (magnitude != magnitude and cut < np.inf):
            above += 1
    ties_wanted = k - above
    out = 0
    for j in range(c):
        magnitude = abs(np.float64(x[candidates[j]]))
        if magnitude != magnitude:
            magnitude = np.inf
        if magnitude > cut:
            indices[out] = candidates[j]
            out += 1
        elif magnitude == cut and ties_wanted > 0:
            indices[out] = candidates[j]
            out += 1
            ties_wanted -= 1
    return out


@njit(nogil=True, cache=True)
def gather(source, indices, values):
    for j in range(indices.size):
        values[j] = source[indices[j]]


@njit(nogil=True, cache=True)
def indices_valid(indices, n):
    for j in range(indices.size):
        if indices[j] < 0 or indices[j] >= n:
            return False
    return True


@njit(nogil=True, cache=True)
def scatter(indices, values, out):
    for j in range(indices.size):
        out[indices[j]] = values[j]


def collect_parallel(x: np.ndarray, threshold, cap: int) -> tuple[int, np.ndarray]:
    """collect_above over chunks on threads: (count or -1, candidate indices)."""
    bounds = chunk_bounds(x.size)
    buffers = [np.empty(min(cap, hi - lo), dtype=np.int32) for lo, hi in bounds]
    counts = run_chunks(
        lambda lo, hi: collect_above(x[lo:hi], threshold, buffers[bounds.index((lo, hi))]),
        bounds,
    )
    if min(counts) < 0 or sum(counts) > cap:
        return -1, buffers[0]
    parts = [buffer[:count] + lo for buffer, count, (lo, _) in zip(buffers, counts, bounds,
                                                                       strict=True)]
    return sum(counts), np.concatenate(parts).astype(np.int32, copy=False)


def select_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices (int32, ascending) of k entries of largest |x|, in time linear in x.size."""
    n = x.size
    indices = np.empty(k, dtype=np.int32)
    stride = max(1, n // SAMPLE)
    sample = np.abs(x[::stride].astype(np.float64))
    # each sample element stands for `stride` elements: aim for about 1.5 k above the cut
    rank = int(1.5 * k / stride)
    cap = min(n, int(SLACK * k) + 2 * stride + 64)
    while True:
        if rank >= sample.size:
            threshold, cap = 0.0, n  # everything is a candidate
        else:
            position = sample.size - 1 - rank
            threshold = float(np.partition(sample, position)[position])
        count, candidates = collect_parallel(x, x.dtype.type(threshold), cap)
        if count >= k:
            select_exact(x, candidates, k, indices)
            return indices
        if count < 0:  # too many candidates: raise the cut, allow more (cap reaches n)
            rank, cap = rank // 2, min(n, 2 * cap)
        else:  # too few: lower the cut (rank reaches the sample size, cut 0)
            rank = 2 * rank + 1


class TopK(Compressor):
    """Keeps the k entries of largest magnitude, as (int32 index, value) pairs."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, k: int = 1):
        super().__init__(numel, dtype)
        if not 1 <= k <= numel:
            raise ValueError(f"topk needs 1 <= k <= numel={numel}, got k={k}")
        self.k = k
        self.bits_dtype = bit_view(torch.empty(0, dtype=dtype)).dtype
        itemsize = self.bits_dtype.itemsize
        self.values_offset = -(-4 * k // 8) * 8
        self.payload_size = self.values_offset + k * itemsize

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        x = self.check_input(x)
        payload = torch.zeros(self.payload_size, dtype=torch.uint8)
        buffer = payload.numpy()
        bits = bit_view(x)
        indices = select_topk(float_view(x), self.k)
        sub_array(buffer, 0, np.int32, self.k)[:] = indices
        gather(bits, indices, sub_array(buffer, self.values_offset, bits.dtype, self.k))
        return payload

    def _parse(self, payload: Payload) -> tuple[np.ndarray, np.ndarray]:
        buffer = payload_bytes(payload)
        self.check_size(buffer, self.payload_size)
        indices = sub_array(buffer, 0, np.int32, self.k)
        if not indices_valid(indices, self.numel):
            raise self.bad_payload(f"an index is outside [0, {self.numel})")
        values = sub_array(buffer, self.values_offset, self.bits_dtype, self.k)
        return indices, values

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        indices, values = self._parse(payload)
        out = self.output(out)
        out.zero_()
        scatter(indices, values, bit_view(out))
        return out

    def fast_update_error(self, corrected: torch.Tensor, payload: Payload) -> torch.Tensor:
        """corrected -= decompress(payload): the sent entries become 0, the rest stay."""
        indices, _ = self._parse(payload)
        bits = bit_view(corrected)
        scatter(indices, np.zeros(indices.size, dtype=bits.dtype), bits)
        return corrected
