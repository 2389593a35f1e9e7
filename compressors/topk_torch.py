"""topk with torch kernels: the payload of topk.py, selected on the tensor's device.

The same k entries as the numba selection: magnitudes compare as the raw bits without
the sign (NaN above inf above finite), and of the entries tied with the k-th largest
the first ones by index are taken. ``torch.topk`` finds the k-th largest magnitude, a
cumulative count picks the ties; ``nonzero_static`` lists the k indices ascending
(no sort of the tensor, no host sync).

Example::

    >>> import torch
    >>> c = TopKTorch(numel=5, dtype=torch.float32, k=2, device="cpu")
    >>> c.decompress(c.compress(torch.tensor([0.1, -3.0, 0.2, 2.0, 0.0])))
    tensor([ 0., -3.,  0.,  2.,  0.])
"""

from __future__ import annotations

import numpy as np
import torch

from .base import Payload
from .device import INPUT_NONFINITE, TorchKernels, flag_status, int_view
from .topk import TopK


def typed_part(payload: torch.Tensor, offset: int, dtype: torch.dtype,
               count: int) -> torch.Tensor:
    """``count`` elements of ``dtype`` at byte ``offset`` of a uint8 tensor (a view where
    the alignment allows, else a copy)."""
    part = payload[offset : offset + count * dtype.itemsize]
    try:
        return part.view(dtype)
    except RuntimeError:  # storage offset not a multiple of the item size
        return part.clone().view(dtype)


def magnitudes(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``x`` without the sign, as non-negative ints of the same width:
    they order as |x|, with NaN above inf."""
    bits = int_view(x)
    return bits & torch.iinfo(bits.dtype).max


def select_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (int64, ascending) of the k entries of largest magnitude; of those tied
    with the k-th largest, the first ones by index.

        >>> select_topk(torch.tensor([1.0, -2.0, 1.0, 1.0]), 2).tolist()
        [0, 1]
    """
    magnitude = magnitudes(x)
    cut = torch.topk(magnitude, k, sorted=False).values.amin()
    above = magnitude > cut
    ties = magnitude == cut
    ties_wanted = k - above.sum()
    take = above | (ties & (ties.cumsum(0, dtype=torch.int32) <= ties_wanted))
    return torch.nonzero_static(take, size=k).reshape(-1)


def last_of_repeats(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """For each j, the position of the last occurrence of ``indices[j]`` (decoding writes
    in order, so the last value of a repeated index wins); no sort, deterministic.

        >>> last_of_repeats(torch.tensor([3, 1, 3, 3]), 4).tolist()
        [3, 1, 3, 3]
    """
    positions = torch.arange(indices.numel(), dtype=torch.int32, device=indices.device)
    last = torch.empty(numel, dtype=torch.int32, device=indices.device)
    last.scatter_reduce_(0, indices, positions, "amax", include_self=False)
    return last[indices].long()


class SparseTorchKernels(TorchKernels):
    """A sparse compressor's two encodes from its ``_encode(x) -> (payload, status,
    indices)``: the entries it sends are the residual's zeros."""

    def _encode(self, x: torch.Tensor) -> tuple:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, status, _ = self._encode(self.check_input(x))
        return payload, status

    def encode_residual(self, corrected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, status, indices = self._encode(corrected)
        corrected.index_fill_(0, indices, 0)  # the sent entries become +0
        return payload, status


class TopKTorch(SparseTorchKernels, TopK):
    """TopK on ``device`` with torch kernels (payload also on ``device``)."""

    graphable = True

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, k: int = 1,
                 device: torch.device | str | None = None):
        TopK.__init__(self, numel, dtype, k)
        TorchKernels.__init__(self, numel, dtype, device)

    def _encode(self, x: torch.Tensor) -> tuple:
        indices = select_topk(x, self.k)
        values = x[indices]
        payload = torch.empty(self.payload_size, dtype=torch.uint8, device=self.device)
        payload[: 4 * self.k] = indices.to(torch.int32).view(torch.uint8)
        payload[4 * self.k : self.values_offset] = 0
        payload[self.values_offset :] = values.view(torch.uint8)
        bad = ~torch.isfinite(values).all()  # inf and NaN rank first: among the k if any
        return payload, flag_status(bad, INPUT_NONFINITE), indices

    def _parse_device(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(indices as int64, values, whether the indices ascend); one host sync."""
        payload = self.device_payload(payload)
        indices = typed_part(payload, 0, torch.int32, self.k)
        values = typed_part(payload, self.values_offset, self.dtype, self.k)
        flags = torch.stack([
            ((indices < 0) | (indices >= self.numel)).any(),
            ~torch.isfinite(values).all(),
            (indices[1:] > indices[:-1]).all(),
        ])
        out_of_range, nonfinite, ascending = flags.tolist()
        if out_of_range:
            raise self.bad_payload(f"an index is outside [0, {self.numel})")
        if nonfinite:
            raise self.bad_payload("a value is inf or NaN")
        return indices.long(), values, ascending

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        payload = self.device_payload(payload)
        _, _, ascending = self._parse_device(payload)
        decoded = self.decode_checked(payload, (ascending,))
        return self.output(out).copy_(decoded)

    def decode_key(self, payload: np.ndarray) -> tuple:
        indices, _ = self._parse(payload)  # the host decoder's checks
        return (bool(np.all(indices[1:] > indices[:-1])),)

    def decode_checked(self, payload: torch.Tensor, key: tuple) -> torch.Tensor:
        """``key``: (whether the indices ascend: else repeats may need the last value)."""
        indices = typed_part(payload, 0, torch.int32, self.k).long()
        values = typed_part(payload, self.values_offset, self.dtype, self.k)
        out = torch.zeros(self.numel, dtype=self.dtype, device=payload.device)
        if not key[0]:  # every write of an index writes its last value
            values = values[last_of_repeats(indices, self.numel)]
        int_view(out)[indices] = int_view(values)
        return out

    def fast_update_error(self, corrected: torch.Tensor, payload: Payload) -> torch.Tensor:
        """corrected -= decompress(payload): the sent entries become 0, the rest stay."""
        indices, _, _ = self._parse_device(payload)
        corrected.index_fill_(0, indices, 0)
        return corrected
