"""bytegrad with torch kernels: the payload of bytegrad.py, quantised on the tensor's device.

Every operation is a separate float32 torch op rounded to nearest (no fused multiply-add),
as bytegrad.py specifies, so the bytes are exact on any device. Chunks are the rows of a
(chunks, chunk) view plus a shorter last one.

Example::

    >>> import torch
    >>> c = ByteGradTorch(numel=4, dtype=torch.float32, chunk=4, device="cpu")
    >>> c.decompress(c.compress(torch.tensor([0.0, 1.0, 2.0, 256.0])))
    tensor([  0.5000,   1.5000,   2.5000, 255.5000])
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .base import NonFiniteError, Payload
from .bytegrad import INV256, ByteGrad, check_ranges
from .device import INPUT_NONFINITE, OK, RANGE_OVERFLOW, TorchKernels
from .topk_torch import typed_part


def by_chunk(tensor: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """The whole chunks as rows of a 2-D view, then the shorter last chunk (if any) as a
    1-row view."""
    whole = tensor.numel() // chunk * chunk
    parts = [tensor[:whole].view(-1, chunk)] if whole else []
    if whole < tensor.numel():
        parts.append(tensor[whole:].view(1, -1))
    return parts


def per_chunk(tensor: torch.Tensor, chunk: int,
              reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``reduce(rows)`` (a reduction over dim 1) of every chunk, as one 1-D tensor."""
    return torch.cat([reduce(part) for part in by_chunk(tensor, chunk)])


def chunk_ranges(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lo, hi, code) per chunk of float32 ``x``: min and max with -0.0 as +0.0, and OK,
    INPUT_NONFINITE (an inf or NaN) or RANGE_OVERFLOW (hi - lo overflows float32).

        >>> chunk_ranges(torch.tensor([-0.0, 2.0, 1.0]), 2)[:2]
        (tensor([0., 1.]), tensor([2., 1.]))
    """
    lo = per_chunk(x, chunk, lambda rows: rows.amin(1)) + 0.0
    hi = per_chunk(x, chunk, lambda rows: rows.amax(1)) + 0.0
    finite = per_chunk(torch.isfinite(x), chunk, lambda rows: rows.all(1))
    code = torch.where(finite, torch.where(hi - lo == torch.inf, RANGE_OVERFLOW, OK),
                       INPUT_NONFINITE)
    return lo, hi, code


def quantise(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, chunk: int,
             codes: torch.Tensor) -> None:
    """codes = min(255, floor((x - lo) / w)), w = (hi - lo) / 256 per chunk (0 where w is
    0), every op in float32."""
    w = (hi - lo) * INV256
    first = 0
    for rows, part in zip(by_chunk(x, chunk), by_chunk(codes, chunk), strict=True):
        count = rows.shape[0]
        lo_c, w_c = lo[first : first + count, None], w[first : first + count, None]
        t = torch.where(w_c > 0, (rows - lo_c) / w_c, 0.0)
        part.copy_(t.clamp_max_(255.0))  # t >= 0: the conversion truncates, i.e. floors
        first += count


def dequantise(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
               chunk: int) -> torch.Tensor:
    """y = lo + (q + 0.5) * w per element, float32, each op rounded.

        >>> dequantise(torch.tensor([0, 255], dtype=torch.uint8), torch.tensor([0.0]),
        ...            torch.tensor([256.0]), 2)
        tensor([  0.5000, 255.5000])
    """
    w = (hi - lo) * INV256
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    first = 0
    for rows, part in zip(by_chunk(codes, chunk), by_chunk(out, chunk), strict=True):
        count = rows.shape[0]
        scaled = (rows.to(torch.float32) + 0.5) * w[first : first + count, None]
        torch.add(scaled, lo[first : first + count, None], out=part)
        first += count
    return out


class ByteGradTorch(TorchKernels, ByteGrad):
    """ByteGrad on ``device`` with torch kernels (payload also on ``device``)."""

    graphable = True

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, chunk: int = 1024,
                 device: torch.device | str | None = None):
        ByteGrad.__init__(self, numel, dtype, chunk)
        TorchKernels.__init__(self, numel, dtype, device)

    def _encode(self, x: torch.Tensor) -> tuple:
        values = x if x.dtype == torch.float32 else x.float()
        lo, hi, code = chunk_ranges(values, self.chunk)
        payload = torch.empty(self.payload_size, dtype=torch.uint8, device=self.device)
        payload[: 8 * self.num_chunks] = torch.stack([lo, hi], 1).reshape(-1).view(torch.uint8)
        quantise(values, lo, hi, self.chunk, payload[8 * self.num_chunks :])
        first = (code != OK).to(torch.uint8).argmax().reshape(1)  # the first refused (or 0)
        return payload, torch.cat([code[first].to(torch.int64), first]), lo, hi

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, status, _, _ = self._encode(self.check_input(x))
        return payload, status

    def encode_residual(self, corrected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, status, lo, hi = self._encode(corrected)
        decoded = dequantise(payload[8 * self.num_chunks :], lo, hi, self.chunk)
        corrected.sub_(decoded if self.dtype == torch.float32 else decoded.to(self.dtype))
        return payload, status

    def status_error(self, code: int, detail: int) -> Exception:
        chunk = self.chunk
        if code == RANGE_OVERFLOW:
            return ValueError(f"bytegrad: chunk {detail}: max - min overflows float32 "
                              "(values beyond +-1.7e38 of opposite signs)")
        return NonFiniteError(f"bytegrad: chunk {detail} (elements {detail * chunk} to "
                              f"{min(self.numel, (detail + 1) * chunk) - 1}) holds inf or "
                              "NaN entries; bytegrad compresses finite values only")

    def _decode_device(self, payload: Payload) -> torch.Tensor:
        """The values in the chain's dtype; the ranges are checked on the host (one host
        sync)."""
        payload = self.device_payload(payload)
        ranges = typed_part(payload, 0, torch.float32, 2 * self.num_chunks)
        host = np.ascontiguousarray(ranges.cpu().numpy())
        bad = check_ranges(host)
        if bad >= 0:
            lo, hi = host[2 * bad], host[2 * bad + 1]
            raise self.bad_payload(f"chunk {bad} has lo={lo}, hi={hi}: expected finite "
                                   "lo <= hi with a finite hi - lo")
        return self.decode_checked(payload, ())

    def decode_key(self, payload: np.ndarray) -> tuple:
        self.check_payload(payload)  # the host decoder's checks
        return ()

    def decode_checked(self, payload: torch.Tensor, key: tuple) -> torch.Tensor:
        pairs = typed_part(payload, 0, torch.float32, 2 * self.num_chunks).view(-1, 2)
        decoded = dequantise(payload[8 * self.num_chunks :], pairs[:, 0], pairs[:, 1],
                             self.chunk)
        return decoded if self.dtype == torch.float32 else decoded.to(self.dtype)

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(out).copy_(self._decode_device(payload))

    def fast_update_error(self, corrected: torch.Tensor, payload: Payload) -> torch.Tensor:
        """corrected -= decompress(payload)."""
        return corrected.sub_(self._decode_device(payload))
