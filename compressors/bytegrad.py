"""bytegrad: min-max 8-bit quantisation per chunk (Bagua's ByteGrad), docs/compression.md.

Payload (little-endian), ``C = ceil(numel / chunk)``, ``8 * C + numel`` bytes::

    C x (float32 lo, float32 hi)   each chunk's min and max (a -0.0 is stored as +0.0)
    numel x uint8                  the codes q, in element order

All arithmetic is float32, rounded to nearest after every operation (no fused
multiply-add), so any IEEE float32 implementation gives the same bytes. Per chunk of
``chunk`` elements (the last one may be shorter)::

    w = (hi - lo) / 256
    q = min(255, floor((x - lo) / w))      (q = 0 for every element where w == 0)
    y = lo + (q + 0.5) * w                 (decode; a chunk with hi == lo gives lo)

float16/bfloat16 inputs are widened to float32 (exactly), float64 ones rounded to
float32; decoded values are rounded to the tensor's dtype. A NaN or infinity in the
input raises NonFiniteError, and a chunk whose range ``hi - lo`` overflows float32
ValueError; either before anything is written (bytegrad keeps no state).

Example::

    >>> import torch
    >>> c = ByteGrad(numel=4, dtype=torch.float32, chunk=4)
    >>> c.decompress(c.compress(torch.tensor([0.0, 1.0, 2.0, 256.0])))
    tensor([  0.5000,   1.5000,   2.5000, 255.5000])
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from numba import njit

from bps.common.config import Key, integer

from .base import (
    KERNEL_FLOAT_DTYPES,
    Compressor,
    Description,
    NonFiniteError,
    Payload,
    payload_bytes,
    sub_array,
)
from .threads import MIN_CHUNK, THREADS, run_chunks

DEFAULT_CHUNK = 1024  # elements per (lo, hi) pair: 8 bytes per 1024 codes
MAX_CHUNK = 2**31 - 1
INV256 = np.float32(1.0 / 256.0)
OK, NOT_FINITE, RANGE_OVERFLOW = 0, 1, 2


@njit(nogil=True, cache=True)
def chunk_range(x):
    """(lo, hi, finite) of a float32 array: min and max with -0.0 as +0.0; ``finite`` is
    False if any element is NaN or infinite.

    The min and max are taken over the raw bits mapped to ordered int32 (integer
    min/max vectorise; float ones do not, even with fast math). The NaN/inf test adds
    one exponent step to the exponent bits: only an all-ones exponent reaches the sign
    bit."""
    bits = x.view(np.int32)
    low_bits = np.int32(0x7FFFFFFF)
    lo = low_bits
    hi = np.int32(-0x80000000)
    special = np.int32(0)
    for i in range(bits.size):
        b = bits[i]
        key = np.int32(b ^ np.int32(np.int32(b >> np.int32(31)) & low_bits))
        lo = key if key < lo else lo
        hi = key if key > hi else hi
        special |= np.int32(np.int32(b & np.int32(0x7F800000)) + np.int32(0x00800000))
    pair = np.empty(2, dtype=np.int32)
    pair[0] = lo ^ ((lo >> np.int32(31)) & low_bits)
    pair[1] = hi ^ ((hi >> np.int32(31)) & low_bits)
    floats = pair.view(np.float32)
    zero = np.float32(0.0)
    return floats[0] + zero, floats[1] + zero, special >= 0


@njit(nogil=True, cache=True)
def quantise(x, lo, w, codes):
    """codes[i] = min(255, floor((x[i] - lo) / w)), all in float32 (w > 0)."""
    top = np.float32(255.0)
    for i in range(x.size):
        t = (x[i] - lo) / w
        codes[i] = np.uint8(min(t, top))  # t >= 0: truncation is floor


@njit(nogil=True, cache=True)
def encode_chunks(x, chunk, first, ranges, codes):
    """Encode ``x`` (float32, starting at chunk number ``first``) into ``ranges`` (lo, hi
    per chunk, whole payload) and ``codes`` (this part's). Returns (status, chunk): OK,
    or the first chunk that is not finite or whose range overflows (nothing of it
    written)."""
    n = x.size
    for c in range((n + chunk - 1) // chunk):
        start = c * chunk
        stop = min(n, start + chunk)
        part = x[start:stop]
        lo, hi, finite = chunk_range(part)
        if not finite:
            return NOT_FINITE, first + c
        span = hi - lo
        if span == np.inf:
            return RANGE_OVERFLOW, first + c
        w = span * INV256
        ranges[2 * (first + c)] = lo
        ranges[2 * (first + c) + 1] = hi
        if w > np.float32(0.0):
            quantise(part, lo, w, codes[start:stop])
        else:
            codes[start:stop] = 0
    return OK, 0


@njit(nogil=True, cache=True)
def check_ranges(ranges):
    """Index of the first chunk whose (lo, hi) is not finite, has lo > hi or a range that
    overflows float32; -1 if all are valid."""
    for c in range(ranges.size // 2):
        lo = ranges[2 * c]
        hi = ranges[2 * c + 1]
        if not (lo <= hi) or not (hi - lo < np.inf) or not (lo > -np.inf):
            return c
    return -1


@njit(nogil=True, cache=True)
def decode_set(codes, lo, w, out):
    half = np.float32(0.5)
    for i in range(codes.size):
        out[i] = lo + (np.float32(codes[i]) + half) * w


@njit(nogil=True, cache=True)
def decode_add(codes, lo, w, out):
    half = np.float32(0.5)
    for i in range(codes.size):
        out[i] += lo + (np.float32(codes[i]) + half) * w


@njit(nogil=True, cache=True)
def decode_sub(codes, lo, w, out):
    half = np.float32(0.5)
    for i in range(codes.size):
        out[i] -= lo + (np.float32(codes[i]) + half) * w


@njit(nogil=True, cache=True)
def decode_chunks(ranges, codes, chunk, first, out, mode):
    """Per element ``y = lo + (q + 0.5) * w`` in float32; ``out[i] = y`` (mode 0),
    ``out[i] += y`` (mode 1) or ``out[i] -= y`` (mode 2), in out's dtype (float32 or
    float64). ``codes`` and ``out`` start at chunk number ``first``. One loop per mode,
    so each vectorises."""
    n = codes.size
    for c in range((n + chunk - 1) // chunk):
        start = c * chunk
        stop = min(n, start + chunk)
        lo = ranges[2 * (first + c)]
        w = (ranges[2 * (first + c) + 1] - lo) * INV256
        if mode == 0:
            decode_set(codes[start:stop], lo, w, out[start:stop])
        elif mode == 1:
            decode_add(codes[start:stop], lo, w, out[start:stop])
        else:
            decode_sub(codes[start:stop], lo, w, out[start:stop])


@njit(nogil=True, cache=True)
def sum_encode_chunks(ranges_in, codes_in, offset, ratio, error, out, chunk, first, ranges,
                      codes, scratch):
    """A server's bytegrad step with error feedback, chunk by chunk while each is in
    cache: ``g' = (y_0 + y_1 + ...) + ratio * error`` (node m's decoded values from its
    ``ranges_in[m]`` and ``codes_in[m]``, added in node order into ``out``, each operation
    rounded as ``decode_chunks`` and ``add_scaled_error`` round them), encoded into
    ``ranges`` and ``codes`` as ``encode_chunks`` encodes (from a float32 copy of the
    chunk in ``scratch``), and ``out -= decoded`` as ``decode_chunks`` mode 2,
    leaving the residual. ``out`` and ``error`` start at chunk ``first``, which is
    element ``offset`` of ``codes_in`` (whole: a 2-D slice would compile apart).
    Returns (status, chunk) as ``encode_chunks``, except that a chunk that is not finite
    wins over an earlier one whose range overflows (as error feedback's check of the
    whole ``g'`` comes before ``compress``)."""
    n = out.size
    overflow = -1
    for c in range((n + chunk - 1) // chunk):
        start = c * chunk
        stop = min(n, start + chunk)
        part = out[start:stop]
        at = 2 * (first + c)
        for m in range(codes_in.shape[0]):
            lo = ranges_in[m, at]
            w = (ranges_in[m, at + 1] - lo) * INV256
            pushed = codes_in[m, offset + start : offset + stop]
            if m == 0:
                decode_set(pushed, lo, w, part)
            else:
                decode_add(pushed, lo, w, part)
        bad = 0
        for i in range(stop - start):
            value = part[i] + ratio * error[start + i]
            part[i] = value
            bad |= not abs(value) < np.inf
        if bad:
            return NOT_FINITE, first + c
        if overflow >= 0:  # the payload is refused: only g' is still checked
            continue
        values = scratch[: stop - start]  # float32, as compress sees a float64 tensor
        for i in range(stop - start):
            values[i] = np.float32(part[i])
        lo, hi, finite = chunk_range(values)
        if not finite:  # a float64 value beyond float32's range
            return NOT_FINITE, first + c
        span = hi - lo
        if span == np.inf:
            overflow = first + c
            continue
        w = span * INV256
        ranges[at] = lo
        ranges[at + 1] = hi
        if w > np.float32(0.0):
            quantise(values, lo, w, codes[start:stop])
        else:
            codes[start:stop] = 0
        decode_sub(codes[start:stop], lo, w, part)
    if overflow >= 0:
        return RANGE_OVERFLOW, overflow
    return OK, 0


def split_chunks(numel: int, chunk: int) -> list[tuple[int, int]]:
    """Element ranges, on chunk boundaries, for at most THREADS threads of at least
    MIN_CHUNK elements each."""
    chunks = -(-numel // chunk)
    count = max(1, min(THREADS, numel // MIN_CHUNK, chunks))
    per = -(-chunks // count) * chunk
    return [(lo, min(numel, lo + per)) for lo in range(0, numel, per)]


class ByteGrad(Compressor):
    """Min-max 8-bit quantisation: one uint8 code per element, (lo, hi) per chunk."""

    keys: ClassVar[dict[str, Key]] = {
        "chunk": Key(integer(1, MAX_CHUNK + 1), fill=DEFAULT_CHUNK)}
    description: ClassVar[Description] = Description(
        examples=({"chunk": 16}, {"chunk": 7}), typical={}, label="8-bit min-max codes")

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32,
                 chunk: int = DEFAULT_CHUNK):
        super().__init__(numel, dtype)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"bytegrad needs an int chunk >= 1, got {chunk!r}")
        self.chunk = chunk
        self.num_chunks = -(-numel // chunk)
        self.payload_size = self.max_payload_bytes(numel, dtype, chunk)
        self.bounds = split_chunks(numel, chunk)

    @classmethod
    def options(cls, params: dict, numel: int) -> dict:
        return {"chunk": params["chunk"]}

    @classmethod
    def max_payload_bytes(cls, numel: int, dtype: torch.dtype = torch.float32,
                          chunk: int = DEFAULT_CHUNK, **options: object) -> int:
        """Every payload's size: a (lo, hi) float32 pair per chunk, one byte per element.

            >>> ByteGrad.max_payload_bytes(2500, torch.float32, chunk=1024)
            2524
        """
        return 8 * -(-numel // chunk) + numel

    def _float32(self, x: torch.Tensor) -> np.ndarray:
        return x.numpy() if x.dtype == torch.float32 else x.float().numpy()

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        values = self._float32(self.check_input(x))
        payload = torch.empty(self.payload_size, dtype=torch.uint8)
        buffer = payload.numpy()
        ranges = sub_array(buffer, 0, np.float32, 2 * self.num_chunks)
        codes = buffer[8 * self.num_chunks:]
        chunk = self.chunk
        results = run_chunks(
            lambda lo, hi: encode_chunks(values[lo:hi], chunk, lo // chunk, ranges,
                                         codes[lo:hi]),
            self.bounds)
        self._check_results(results)
        return payload

    def _check_results(self, results: list[tuple[int, int]]) -> None:
        """Raise for the first chunk an encoding refused (NonFiniteError, ValueError)."""
        chunk = self.chunk
        for status, index in results:
            if status == NOT_FINITE:
                raise NonFiniteError(f"bytegrad: chunk {index} (elements {index * chunk} to "
                                     f"{min(self.numel, (index + 1) * chunk) - 1}) holds inf or "
                                     "NaN entries; bytegrad compresses finite values only")
            if status == RANGE_OVERFLOW:
                raise ValueError(f"bytegrad: chunk {index}: max - min overflows float32 "
                                 "(values beyond +-1.7e38 of opposite signs)")

    def check_payload(self, payload: Payload) -> None:
        """Raise ValueError for a payload ``decompress`` refuses (decoding nothing)."""
        self._parse(payload)

    def compress_sum_residual(self, payloads: list[Payload], ratio: float,
                              error: np.ndarray, out: np.ndarray) -> torch.Tensor | None:
        """The payload of ``g' = (decompress(p_0) + decompress(p_1) + ...) + ratio *
        error`` (float32/float64 arrays) with ``out`` holding ``g' - decompress(payload)``:
        decoded, added, corrected, encoded and subtracted chunk by chunk, each chunk in
        cache. The same bits as those steps one pass each; None where a value of ``g'``
        is not finite (in float32), else ValueError where a chunk's range overflows.

            >>> import numpy as np, torch
            >>> c = ByteGrad(numel=4, chunk=4)
            >>> pushes = [c.compress(torch.tensor([0.0, 1.0, 2.0, 256.0]))] * 2
            >>> out = np.empty(4, dtype=np.float32)  # g' = [1, 3, 5, 511]
            >>> c.decompress(c.compress_sum_residual(pushes, 1.0, np.zeros(4, np.float32), out))
            tensor([  1.9961,   3.9883,   5.9805, 510.0039])
        """
        parsed = [self._parse(payload) for payload in payloads]
        ranges_in = np.stack([ranges for ranges, _ in parsed])
        codes_in = np.stack([codes for _, codes in parsed])
        payload = torch.empty(self.payload_size, dtype=torch.uint8)
        buffer = payload.numpy()
        ranges = sub_array(buffer, 0, np.float32, 2 * self.num_chunks)
        codes = buffer[8 * self.num_chunks:]
        factor, chunk = out.dtype.type(ratio), self.chunk
        results = run_chunks(lambda lo, hi: sum_encode_chunks(
            ranges_in, codes_in, lo, factor, error[lo:hi], out[lo:hi], chunk,
            lo // chunk, ranges, codes[lo:hi], np.empty(min(chunk, hi - lo), np.float32)),
            self.bounds)
        if any(status == NOT_FINITE for status, _ in results):
            return None
        self._check_results(results)
        return payload

    def _parse(self, payload: Payload) -> tuple[np.ndarray, np.ndarray]:
        buffer = payload_bytes(payload)
        self.check_size(buffer, self.payload_size)
        ranges = sub_array(buffer, 0, np.float32, 2 * self.num_chunks)
        bad = check_ranges(ranges)
        if bad >= 0:
            lo, hi = ranges[2 * bad], ranges[2 * bad + 1]
            raise self.bad_payload(f"chunk {bad} has lo={lo}, hi={hi}: expected finite "
                                   "lo <= hi with a finite hi - lo")
        return ranges, buffer[8 * self.num_chunks:]

    def _decode(self, payload: Payload, target: np.ndarray, mode: int) -> None:
        ranges, codes = self._parse(payload)
        chunk = self.chunk
        run_chunks(lambda lo, hi: decode_chunks(ranges, codes[lo:hi], chunk, lo // chunk,
                                                target[lo:hi], mode),
                   self.bounds)

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        out = self.output(out)
        if self.dtype in KERNEL_FLOAT_DTYPES:
            self._decode(payload, out.numpy(), 0)
            return out
        decoded = np.empty(self.numel, dtype=np.float32)
        self._decode(payload, decoded, 0)
        return out.copy_(torch.from_numpy(decoded))

    def decompress_add(self, payload: Payload, total: torch.Tensor,
                       scratch: torch.Tensor | None = None) -> torch.Tensor:
        """``total += decompress(payload)`` in one pass (float32/float64)."""
        if self.dtype not in KERNEL_FLOAT_DTYPES:
            return super().decompress_add(payload, total, scratch)
        self._decode(payload, self.output(total, "total").numpy(), 1)
        return total

    def fast_update_error(self, corrected: torch.Tensor, payload: Payload) -> torch.Tensor:
        """corrected -= decompress(payload), in one pass for float32/float64."""
        if self.dtype not in KERNEL_FLOAT_DTYPES:
            return corrected.sub_(self.decompress(payload))
        self._decode(payload, corrected.numpy(), 2)
        return corrected
