"""dithering: stochastic quantisation to s levels, Elias-delta coded, SPEC §4.

Payload (little-endian), ``ceil(bits / 8) + 16`` bytes::

    ceil(bits/8) bytes  MSB-first bit stream; for each nonzero q in index order:
                        delta(gap) (first gap i + 1), sign bit (1 = negative), delta(q);
                        padding bits of the last byte are 0
    uint64              bits, the stream length in bits
    float64             scale: max|x| ("max") or sqrt(sum x^2) ("l2")

Quantisation draws exactly one xorshift128+ number per element, in index order,
zeros included, so the sender's RNG advances by numel per compress. Decoding needs
no RNG: ``sign * q * scale / s`` (natural partition: ``/ 2**(s-1)``).

Example::

    >>> import torch
    >>> c = Dithering(numel=4, dtype=torch.float32, levels=2, natural=False, l2=False, seed=1)
    >>> y = c.decompress(c.compress(torch.tensor([0.0, 1.0, -1.0, 0.25])))
    >>> y[:3].tolist()
    [0.0, 1.0, -1.0]
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

from .base import Compressor, Payload, float_view, payload_bytes
from .bitstream import MAX_CODE_BITS, MAX_HEAD_ZEROS, bit_length, delta_length, delta_parts
from .rng import UINT64_MAX_F64, load_state_list, new_state, next_random, state_list

TRAILER = 16
ERRORS = {
    1: "malformed or truncated Elias-delta code",
    2: "an index runs past numel",
    3: "a level q exceeds the largest level",
    4: "the stream ends inside an entry",
}


@njit(nogil=True, cache=True, fastmath=True)
def max_abs(x):
    best = 0.0
    for i in range(x.size):
        best = max(best, abs(np.float64(x[i])))
    return best


@njit(nogil=True, cache=True)
def sum_squares(x):
    total = 0.0
    for i in range(x.size):
        total += np.float64(x[i]) * np.float64(x[i])
    return total


@njit(nogil=True, cache=True)
def next_pow2(value):
    """Smallest power of two >= value, with next_pow2(0) = 0 and next_pow2(1) = 1."""
    if value <= 1:
        return value
    return np.int64(1) << bit_length(value - 1)


@njit(nogil=True, cache=True)
def delta_code(value):
    """The whole Elias-delta code of ``value`` as (bits, length <= 42)."""
    head, head_bits, tail, tail_bits = delta_parts(value)
    return (head << np.uint64(tail_bits)) | tail, head_bits + tail_bits


@njit(nogil=True, cache=True)
def dither_encode(x, scale, levels, natural, state, stream):
    """Quantise and code x into ``stream``; returns the bit count. Advances ``state``.

    One store site, no helper taking the array: numba calls that pass arrays cost
    reference-count updates, several times the work of this loop.
    """
    acc = np.uint64(0)  # pending bits, the newest in the low `fill` bits
    fill = 0
    pos = 0
    previous = -1
    top = np.float64(np.int64(1) << (levels - 1)) if natural else np.float64(levels)
    for i in range(x.size):
        r = next_random(state)
        if scale == 0.0:
            continue
        value = np.float64(x[i])
        if natural:
            u = abs(value) / scale * top
            f = next_pow2(np.int64(np.ceil(u))) >> 1
            length = f if f else 1
            q = f + length * np.int64(np.float64(r) < (u - f) / length * UINT64_MAX_F64)
        else:
            u = np.float32(abs(value) / scale * top)
            low = np.floor(u)
            q = np.int64(low) + np.int64(np.float64(r) < np.float64(u - low) * UINT64_MAX_F64)
        if q == 0:
            continue
        gap_code, gap_bits = delta_code(i - previous)
        q_code, q_bits = delta_code(q)
        signed_q = (np.uint64(value < 0) << np.uint64(q_bits)) | q_code
        entry_bits = gap_bits + 1 + q_bits
        long_entry = entry_bits > 64  # only for huge gaps or levels
        for part in range(2 if long_entry else 1):
            if not long_entry:
                code = (gap_code << np.uint64(1 + q_bits)) | signed_q
                nbits = entry_bits
            elif part == 0:
                code, nbits = gap_code, gap_bits
            else:
                code, nbits = signed_q, q_bits + 1
            while nbits > 0:  # append in pieces of <= 32 bits, flush whole 32-bit groups
                take = min(nbits, 32)
                nbits -= take
                mask = (np.uint64(1) << np.uint64(take)) - np.uint64(1)
                piece = (code >> np.uint64(nbits)) & mask
                acc = (acc << np.uint64(take)) | piece
                fill += take
                if fill >= 32:
                    fill -= 32
                    word = acc >> np.uint64(fill)
                    stream[pos] = np.uint8((word >> np.uint64(24)) & np.uint64(0xFF))
                    stream[pos + 1] = np.uint8((word >> np.uint64(16)) & np.uint64(0xFF))
                    stream[pos + 2] = np.uint8((word >> np.uint64(8)) & np.uint64(0xFF))
                    stream[pos + 3] = np.uint8(word & np.uint64(0xFF))
                    pos += 4
        previous = i
    if fill:  # the last partial group, zero-padded to whole bytes
        tail = (acc << np.uint64(32 - fill)) & np.uint64(0xFFFFFFFF)
        for j in range((fill + 7) // 8):
            stream[pos + j] = np.uint8((tail >> np.uint64(24 - 8 * j)) & np.uint64(0xFF))
    return pos * 8 + fill


@njit(nogil=True, cache=True)
def dither_decode(stream, nbits, scale, divisor, max_level, out):
    """Decode into zero-filled ``out``; returns 0, or an ERRORS code (checks every read)."""

    def refill(acc, avail, pos):  # top up the left-aligned reader word, a byte at a time
        while avail <= 56 and pos < stream.size:
            acc |= np.uint64(stream[pos]) << np.uint64(56 - avail)
            avail += 8
            pos += 1
        return acc, avail, pos

    def take(acc, avail, left, nbits):  # the next nbits (1..32), caller checked they exist
        value = acc >> np.uint64(64 - nbits)
        return value, acc << np.uint64(nbits), avail - nbits, left - nbits

    def get_delta(acc, avail, pos, left):  # value 0 means malformed or truncated
        acc, avail, pos = refill(acc, avail, pos)
        zeros = np.int64(leading_zeros(acc))
        head = 2 * zeros + 1
        if zeros > MAX_HEAD_ZEROS or head > avail or head > left:
            return np.uint64(0), acc, avail, pos, left
        b, acc, avail, left = take(acc, avail, left, head)
        if b > MAX_CODE_BITS:
            return np.uint64(0), acc, avail, pos, left
        value = np.uint64(1) << (b - np.uint64(1))
        if b > 1:
            acc, avail, pos = refill(acc, avail, pos)
            if b - 1 > avail or b - 1 > left:
                return np.uint64(0), acc, avail, pos, left
            low, acc, avail, left = take(acc, avail, left, b - 1)
            value |= low
        return value, acc, avail, pos, left

    acc = np.uint64(0)
    avail = 0
    pos = 0
    left = nbits
    index = -1
    n = out.size
    while left > 0:
        gap, acc, avail, pos, left = get_delta(acc, avail, pos, left)
        if gap == 0:
            return 1
        if gap > np.uint64(n - 1 - index):
            return 2
        index += np.int64(gap)
        if left < 1:
            return 4
        acc, avail, pos = refill(acc, avail, pos)
        negative, acc, avail, left = take(acc, avail, left, 1)
        q, acc, avail, pos, left = get_delta(acc, avail, pos, left)
        if q == 0:
            return 1
        if q > np.uint64(max_level):
            return 3
        magnitude = np.float64(q) * scale / divisor
        out[index] = -magnitude if negative else magnitude
    return 0


class Dithering(Compressor):
    """Stochastic rounding of |x|/scale onto s linear or 2**(s-1) natural levels."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, levels: int = 2,
                 natural: bool = False, l2: bool = False, seed: int = 1):
        super().__init__(numel, dtype)
        self.levels, self.natural, self.l2 = levels, natural, l2
        self.rng = new_state(seed)
        self.divisor = float(2 ** (levels - 1)) if natural else float(levels)
        # q <= divisor, or one level more where float rounding puts |x| / scale above 1
        self.max_level = 2 * int(self.divisor) if natural else levels + 1
        # per element at most: 2 bits of gap code (delta(2) = 4 bits per 2), sign, q code
        self.max_stream_bytes = (numel * (3 + delta_length(self.max_level)) + 7) // 8 + 8

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        values = float_view(self.check_input(x))
        scale = math.sqrt(sum_squares(values)) if self.l2 else max_abs(values)
        if not math.isfinite(scale):
            raise ValueError("dithering cannot encode a tensor with inf or NaN entries")
        payload = torch.empty(self.max_stream_bytes + TRAILER, dtype=torch.uint8)
        buffer = payload.numpy()
        nbits = dither_encode(values, scale, self.levels, self.natural, self.rng, buffer)
        size = (nbits + 7) // 8
        trailer = np.array([nbits], dtype=np.uint64).view(np.uint8)
        buffer[size : size + 8] = trailer
        buffer[size + 8 : size + 16] = np.array([scale], dtype=np.float64).view(np.uint8)
        return payload[: size + TRAILER]

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode; on a malformed payload raise ValueError (``out`` is then unspecified)."""
        buffer = payload_bytes(payload)
        if not TRAILER <= buffer.size <= self.max_stream_bytes + TRAILER:
            raise self.bad_payload(f"{buffer.size} bytes, expected 16 to "
                                   f"{self.max_stream_bytes + TRAILER}")
        size = buffer.size - TRAILER
        nbits = int(buffer[size : size + 8].copy().view(np.uint64)[0])
        scale = float(buffer[size + 8 :].copy().view(np.float64)[0])
        if (nbits + 7) // 8 != size:
            raise self.bad_payload(f"bit count {nbits} does not match {size} stream bytes")
        if not (math.isfinite(scale) and scale >= 0.0):
            raise self.bad_payload(f"scale {scale} is not finite and >= 0")
        if nbits % 8 and int(buffer[size - 1]) & ((1 << (8 - nbits % 8)) - 1):
            raise self.bad_payload("padding bits of the last stream byte are not zero")
        out = self.output(out)
        target = out if self.dtype in (torch.float32, torch.float64) else torch.empty(
            self.numel, dtype=torch.float32)
        target.zero_()
        code = dither_decode(buffer[:size], nbits, scale, self.divisor, self.max_level,
                             target.numpy())
        if code:
            raise self.bad_payload(ERRORS[code])
        if target is not out:
            out.copy_(target)
        return out

    def state_dict(self) -> dict:
        return {"rng": state_list(self.rng)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"rng"}:
            raise ValueError(f"Dithering state must be a dict with key 'rng', got {state!r}")
        load_state_list(self, self.rng, state["rng"])
