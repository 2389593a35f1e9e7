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

import functools
import math

import numpy as np
import torch
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

from .base import Compressor, Payload, float_view, payload_bytes, sub_array
from .bitstream import (
    MAX_CODE_BITS,
    MAX_HEAD_ZEROS,
    bit_length,
    byteswap,
    delta_code,
    delta_length,
)
from .rng import UINT64_MAX_F64, load_state_list, new_state, state_list, xorshift_step

TRAILER = 16
ERRORS = {
    1: "malformed or truncated Elias-delta code",
    2: "an index runs past numel",
    3: "a level q exceeds the largest level",
    4: "the stream ends inside an entry",
}


@njit(nogil=True, cache=True)
def max_abs(x):
    """max |x| as float64 (NaN ignored). Taken in x's dtype, exact as the conversion is
    monotonic; 16 running maxima let the loop vectorise."""
    lanes = np.zeros(16, dtype=x.dtype)
    whole = x.size // 16 * 16
    for i in range(0, whole, 16):
        for j in range(16):
            magnitude = abs(x[i + j])
            lanes[j] = magnitude if magnitude > lanes[j] else lanes[j]
    best = x.dtype.type(0)
    for i in range(whole, x.size):
        magnitude = abs(x[i])
        best = magnitude if magnitude > best else best
    for j in range(16):
        best = lanes[j] if lanes[j] > best else best
    return np.float64(best)


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
def push_bits(acc, fill, code, nbits):
    """Append ``nbits`` (<= 63) bits of ``code`` to the ``fill`` pending bits of ``acc``.

    Returns (acc, fill, word, full): when 64 bits are complete, ``word`` holds them and
    ``full`` is True (the caller stores it); ``acc`` keeps the remaining low bits."""
    total = fill + nbits
    if total < 64:
        return (acc << np.uint64(nbits)) | code, total, np.uint64(0), False
    rest = total - 64  # fill >= 1 here, so the shift below is < 64
    word = (acc << np.uint64(64 - fill)) | (code >> np.uint64(rest))
    return code & ((np.uint64(1) << np.uint64(rest)) - np.uint64(1)), rest, word, True


def delta_bits(value: int) -> int:
    """The Elias-delta code of ``value`` as a Python int (for building tables)."""
    return int(delta_code(value)[0])


BLOCK = 2048  # elements quantised per vectorised pass of the encoder
SMALL = 16  # gaps and levels below this encode by one lookup


def small_entry_codes() -> np.ndarray:
    """Entry codes for gap, q < SMALL at ``gap * SMALL + q``, packed as
    ``code (sign bit 0) | bits << 32 | position of the sign bit << 48``; q = 0: nothing."""
    table = np.zeros(SMALL * SMALL, dtype=np.uint64)
    for gap in range(1, SMALL):
        for q in range(1, SMALL):
            q_bits = delta_length(q)
            bits = delta_length(gap) + 1 + q_bits
            code = (delta_bits(gap) << (1 + q_bits)) | delta_bits(q)
            table[gap * SMALL + q] = code | bits << 32 | q_bits << 48
    table.setflags(write=False)
    return table


SMALL_CODES = small_entry_codes()


@njit(nogil=True, cache=True)
def quantise_block(x, scale, top, natural, draws, levels_out):
    """levels_out[j] = q of x[j] given its draw, negated where x[j] < 0 (vectorisable)."""
    for j in range(x.size):
        r = np.float64(draws[j])
        value = abs(np.float64(x[j]))
        if natural:
            u = value / scale * top
            f = next_pow2(np.int64(np.ceil(u))) >> 1
            length = max(f, 1)
            q = f + length * np.int64(r < (u - f) / length * UINT64_MAX_F64)
        else:
            u = np.float32(value / scale * top)
            low = np.floor(u)
            q = np.int64(low) + np.int64(r < np.float64(u - low) * UINT64_MAX_F64)
        levels_out[j] = -q if x[j] < 0 else q


@njit(nogil=True, cache=True)
def dither_encode(x, scale, levels, natural, state, small_codes, words):
    """Quantise and code x into the uint64 ``words`` (stream order, see bitstream);
    returns the bit count. Advances ``state`` by x.size draws.

    Per block: the xorshift draws (a sequential chain), the quantisation (vectorised),
    then the coding of the nonzero levels into a 64-bit accumulator flushed word-wise;
    entries with gap and q below SMALL come whole from ``small_codes``.
    """
    a = state[0]
    b = state[1]
    acc = np.uint64(0)  # pending bits, the newest in the low `fill` bits
    fill = 0
    pos = 0
    previous = -1
    top = np.float64(np.int64(1) << (levels - 1)) if natural else np.float64(levels)
    draws = np.empty(BLOCK, dtype=np.uint64)
    q_block = np.empty(BLOCK, dtype=np.int64)
    for start in range(0, x.size, BLOCK):
        count = min(BLOCK, x.size - start)
        for j in range(count):
            a, b, draws[j] = xorshift_step(a, b)
        if scale == 0.0:
            continue
        quantise_block(x[start : start + count], scale, top, natural, draws[:count],
                       q_block[:count])
        for j in range(count):
            signed = q_block[j]
            q = abs(signed)
            i = start + j
            gap = i - previous
            if gap < SMALL and q < SMALL:  # nearly always: one lookup, no branch on q == 0
                packed = small_codes[gap * SMALL + q]  # q == 0: no bits
                code = (packed & np.uint64(0xFFFFFFFF)) | (
                    np.uint64(signed < 0) << (packed >> np.uint64(48)))
                previous = i if q else previous
                acc, fill, word, full = push_bits(
                    acc, fill, code, np.int64((packed >> np.uint64(32)) & np.uint64(0xFFFF)))
            elif q == 0:
                continue
            else:
                gap_code, gap_bits = delta_code(gap)
                q_code, q_bits = delta_code(q)
                previous = i
                signed_q = (np.uint64(signed < 0) << np.uint64(q_bits)) | q_code
                if gap_bits + 1 + q_bits <= 63:  # one append; two for huge gaps or levels
                    code = (gap_code << np.uint64(1 + q_bits)) | signed_q
                    acc, fill, word, full = push_bits(acc, fill, code, gap_bits + 1 + q_bits)
                else:
                    acc, fill, word, full = push_bits(acc, fill, gap_code, gap_bits)
                    if full:
                        words[pos] = byteswap(word)
                        pos += 1
                    acc, fill, word, full = push_bits(acc, fill, signed_q, q_bits + 1)
            if full:
                words[pos] = byteswap(word)
                pos += 1
    state[0] = a
    state[1] = b
    if fill:  # the last partial word, zero-padded
        words[pos] = byteswap(acc << np.uint64(64 - fill))
    return pos * 64 + fill


TABLE_BITS = 12  # entries whose whole code fits in this many bits decode by one lookup
TABLE_MAX_Q = (1 << TABLE_BITS) - 1  # larger levels never fit


@functools.cache
def entry_table(max_level: int) -> np.ndarray:
    """For each TABLE_BITS-bit prefix: the entry it starts with, packed as
    ``bits | gap << 8 | q << 24 | negative << 40`` (0 where it does not fit)."""
    table = np.zeros(1 << TABLE_BITS, dtype=np.int64)
    for gap in range(1, 1 << TABLE_BITS):
        for q in range(1, min(max_level, TABLE_MAX_Q) + 1):
            bits = delta_length(gap) + 1 + delta_length(q)
            if bits > TABLE_BITS:
                break
            for negative in (0, 1):
                code = (delta_bits(gap) << (1 + delta_length(q))) | (negative << delta_length(q))
                code |= delta_bits(q)
                prefix = code << (TABLE_BITS - bits)
                packed = bits | gap << 8 | q << 24 | negative << 40
                table[prefix : prefix + (1 << (TABLE_BITS - bits))] = packed
    table.setflags(write=False)  # shared by every instance with this max_level
    return table


@njit(nogil=True, cache=True)
def dither_decode(words, nbits, scale, divisor, max_level, table, magnitudes, out):
    """Decode into zero-filled ``out``; returns 0, or an ERRORS code.

    ``words`` holds the stream as native uint64 in stream order plus one zero word, so
    the 64-bit window at any bit position is two loads. Short entries (nearly all)
    decode by one ``table`` lookup and take ``magnitudes[q] = q * scale / divisor``
    (for the q the table holds); the rest code by code. Every entry is checked
    against the bits left, numel and the largest level before it is used.
    """
    n = out.size
    position = 0  # bit position in the stream
    index = -1
    window = np.uint64(0)  # the stream from `position` on, left-aligned
    valid = 0  # bits of `window` loaded from the stream (past its end they are zeros)
    while position < nbits:
        if valid < TABLE_BITS:
            word = position >> 6
            shift = np.uint64(position & 63)
            window = (words[word] << shift) | ((words[word + 1] >> np.uint64(1)) >> (
                np.uint64(63) - shift))
            valid = 64
        entry = table[window >> np.uint64(64 - TABLE_BITS)]
        bits = entry & 0xFF
        if bits and bits <= nbits - position:
            gap = (entry >> 8) & 0xFFFF
            q = (entry >> 24) & 0xFFFF
            if gap > n - 1 - index:
                return 2
            if q > max_level:
                return 3
            index += gap
            position += bits
            window <<= np.uint64(bits)
            valid -= bits
            out[index] = -magnitudes[q] if entry >> 40 else magnitudes[q]
            continue
        valid = 0  # the slow path moves `position` on its own
        for part in range(2):  # 0: the gap code; 1: the sign bit and the q code
            word = position >> 6
            shift = np.uint64(position & 63)
            window = (words[word] << shift) | ((words[word + 1] >> np.uint64(1)) >> (
                np.uint64(63) - shift))
            negative = False
            if part:
                if position >= nbits:
                    return 4
                negative = (window >> np.uint64(63)) != 0
                window <<= np.uint64(1)
                position += 1
            zeros = np.int64(leading_zeros(window))
            if zeros > MAX_HEAD_ZEROS:
                return 1
            head = 2 * zeros + 1
            b = np.int64(window >> np.uint64(64 - head))
            if b > MAX_CODE_BITS or head + b - 1 > nbits - position:
                return 1
            low = ((window << np.uint64(head)) >> np.uint64(1)) >> np.uint64(64 - b)
            value = (np.uint64(1) << np.uint64(b - 1)) | low
            position += head + b - 1
            if part == 0:
                if value > np.uint64(n - 1 - index):
                    return 2
                index += np.int64(value)
        if value > np.uint64(max_level):
            return 3
        magnitude = np.float64(value) * scale / divisor
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
        self.table = entry_table(self.max_level)
        # per element at most: 2 bits of gap code (delta(2) = 4 bits per 2), sign, q code
        self.max_stream_bytes = (numel * (3 + delta_length(self.max_level)) + 7) // 8 + 8

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        values = float_view(self.check_input(x))
        scale = math.sqrt(sum_squares(values)) if self.l2 else max_abs(values)
        if not math.isfinite(scale):
            raise ValueError("dithering cannot encode a tensor with inf or NaN entries")
        payload = torch.empty(self.max_stream_bytes + TRAILER, dtype=torch.uint8)
        buffer = payload.numpy()
        words = sub_array(buffer, 0, np.uint64, -(-self.max_stream_bytes // 8))
        nbits = dither_encode(values, scale, self.levels, self.natural, self.rng, SMALL_CODES,
                              words)
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
        words = np.zeros(size // 8 + 2, dtype=np.uint64)  # a zero word past the stream
        words.view(np.uint8)[:size] = buffer[:size]
        words.byteswap(inplace=True)  # big-endian words in stream order -> native
        target.zero_()
        # q * scale / divisor for the levels the table decodes, rounded as in the kernel
        magnitudes = np.arange(min(self.max_level, TABLE_MAX_Q) + 1.0) * scale / self.divisor
        code = dither_decode(words, nbits, scale, self.divisor, self.max_level, self.table,
                             magnitudes, target.numpy())
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
