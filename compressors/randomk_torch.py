"""randomk with torch kernels: the payload of randomk.py, gathered on the tensor's device.

The xorshift128+ draws stay on the host (numba, the same sequence as randomk.py); the
k indices cross to the device in one copy with the generator state, and the values are
gathered there. Decoding a payload on the device reads the 16-byte state back (with
the finite check's flag, one host sync), draws the same indices and scatters there. A
pulled aggregate, whose bytes arrive on the host (``bps.worker.device_path``), is
checked and its indices drawn there (``decode_key``, ``decode_upload``), and goes up
once with them: no copy back, no host sync. Bytes are exact.

Example::

    >>> import torch
    >>> c = RandomKTorch(numel=4, dtype=torch.float32, k=2, seed=1, device="cpu")
    >>> y = c.decompress(c.compress(torch.tensor([1.0, 2.0, 3.0, 4.0])))
    >>> int((y != 0).sum()) <= 2
    True
"""

from __future__ import annotations

import numpy as np
import torch

from .base import Payload, sub_array
from .device import INPUT_NONFINITE, TorchKernels, flag_status, int_view, to_device_async
from .randomk import RandomK, draw_indices
from .rng import SeededStaged
from .topk_torch import SparseTorchKernels, last_of_repeats, typed_part


def draw_on_host(state: np.ndarray, numel: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(16 bytes of ``state`` then k int64 indices ``randint(0, numel)``, as one uint8
    array; the state after the draws). ``state`` itself does not change.

        >>> head, after = draw_on_host(np.array([1, 1], dtype=np.uint64), 10, 3)
        >>> head.size, bool((head[16:].view(np.int64) < 10).all())
        (40, True)
    """
    head = np.empty(16 + 8 * k, dtype=np.uint8)
    sub_array(head, 0, np.uint64, 2)[:] = state
    after = state.copy()
    draw_indices(after, numel, sub_array(head, 16, np.uint64, k))
    return head, after


def scatter_last(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``out[indices[j]] = values[j]`` in order (a repeated index keeps its last value),
    on raw bits, deterministic on any device."""
    last = last_of_repeats(indices, out.numel())
    int_view(out)[indices] = int_view(values)[last]


class RandomKTorch(SeededStaged, SparseTorchKernels, RandomK):
    """RandomK on ``device`` with torch kernels (payload also on ``device``)."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, k: int = 1,
                 seed: int = 1, device: torch.device | str | None = None):
        RandomK.__init__(self, numel, dtype, k, seed)
        TorchKernels.__init__(self, numel, dtype, device)
        self.pending: np.ndarray | None = None  # the state after the last encode's draws

    def _encode(self, x: torch.Tensor) -> tuple:
        head, self.pending = draw_on_host(self.rng, self.numel, self.k)
        head = to_device_async(head, self.device)
        indices = head[16:].view(torch.int64)
        values = x[indices]
        payload = torch.empty(self.payload_size, dtype=torch.uint8, device=self.device)
        payload[:16] = head[:16]
        payload[16:] = values.view(torch.uint8)
        bad = ~torch.isfinite(values).all()
        return payload, flag_status(bad, INPUT_NONFINITE), indices

    def _parse_device(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """(the drawn indices on the device, the values); one host sync."""
        payload = self.device_payload(payload)
        values = typed_part(payload, 16, self.dtype, self.k)
        nonfinite = (~torch.isfinite(values).all()).to(torch.uint8).reshape(1)
        head = torch.cat([payload[:16], nonfinite]).cpu().numpy()
        if head[16]:
            raise self.bad_payload("a value is inf or NaN")
        drawn, _ = draw_on_host(head[:16].view(np.uint64), self.numel, self.k)
        indices = to_device_async(drawn, self.device)[16:].view(torch.int64)
        return indices, values

    def decode_key(self, payload: np.ndarray) -> tuple:
        RandomK._parse(self, payload)  # the host decoder's checks
        return ()

    def decode_upload(self, payload: np.ndarray) -> np.ndarray:
        """What goes up for :meth:`decode_checked`: the k int64 indices drawn from the
        payload's state, then the (checked) payload itself.

            >>> c = RandomKTorch(numel=10, k=3, seed=2, device="cpu")
            >>> payload = c.compress(torch.ones(10)).numpy()
            >>> c.decode_upload(payload).size == 8 * 3 + payload.size
            True
        """
        up = np.empty(8 * self.k + payload.size, dtype=np.uint8)
        state = sub_array(payload, 0, np.uint64, 2).copy()
        draw_indices(state, self.numel, sub_array(up, 0, np.uint64, self.k))
        up[8 * self.k:] = payload
        return up

    def decode_checked(self, payload: torch.Tensor, key: tuple) -> torch.Tensor:
        """The scatter of :meth:`decode_upload`'s bytes on the device: kernels only."""
        indices = payload[: 8 * self.k].view(torch.int64)
        values = typed_part(payload, 8 * self.k + 16, self.dtype, self.k)
        out = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        scatter_last(out, indices, values)
        return out

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        indices, values = self._parse_device(payload)
        out = self.output(out)
        out.zero_()
        scatter_last(out, indices, values)
        return out

    def fast_update_error(self, corrected: torch.Tensor, payload: Payload) -> torch.Tensor:
        """corrected -= decompress(payload): the drawn entries become 0, the rest stay."""
        indices, _ = self._parse_device(payload)
        corrected.index_fill_(0, indices, 0)
        return corrected

