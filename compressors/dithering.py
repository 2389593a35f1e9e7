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

Large inputs run on threads (``threads.chunk_bounds``) with the same bytes as one
pass. Encoding: each chunk jumps the generator to its start (``rng.jump``), draws
with 4 interleaved generators (lanes), quantises into a level array and codes it on
its own, the first gap counted from the chunk start; the streams are then appended
with each chunk's first gap re-coded (``splice_chunk``). Decoding: the format has no
chunk offsets, so the stream is cut at bit positions; the first range is decoded in
place, the others speculatively from an arbitrary bit with relative indices into
scratch arrays; the true parse then goes on until it meets an entry start recorded by
the next range's parse (from there both coincide) and copies that range's values in.
A speculation that fails only costs time: the true parse decodes the range itself,
so errors are always those of the sequential parse.

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

from .base import (
    KERNEL_FLOAT_DTYPES,
    Compressor,
    Payload,
    float_view,
    magnitude_bits,
    payload_bytes,
    sub_array,
)
from .bitstream import (
    MAX_CODE_BITS,
    MAX_HEAD_ZEROS,
    bit_length,
    byteswap,
    delta_code,
    delta_length,
)
from .rng import (
    LANES,
    UINT64_MAX_F64,
    VECTOR,
    draw_lanes,
    jump,
    jump_table,
    load_state_list,
    new_state,
    state_list,
    xorshift_step,
)
from .threads import chunk_bounds, copy_chunks, run_chunks

TRAILER = 16
ERRORS = {
    1: "malformed or truncated Elias-delta code",
    2: "an index runs past numel",
    3: "a level q exceeds the largest level",
    4: "the stream ends inside an entry",
}


@njit(nogil=True, cache=True)
def max_magnitude_bits(bits, magnitude_mask):
    """The largest ``bits[i] & magnitude_mask``: for the raw bits of floats without their
    sign, the bits of max|x|, with NaN above inf (integer max vectorises, float max with
    NaN rules does not: 2x faster)."""
    best = bits.dtype.type(0)
    for i in range(bits.size):
        magnitude = bits[i] & magnitude_mask
        best = magnitude if magnitude > best else best
    return best


def max_abs(values: np.ndarray, bounds: list[tuple[int, int]]) -> float:
    """max|values| (float32/float64) as float64, NaN if any value is NaN, on threads."""
    bits, mask = magnitude_bits(values)
    top = max(run_chunks(lambda lo, hi: max_magnitude_bits(bits[lo:hi], mask), bounds))
    return float(np.array([top], dtype=bits.dtype).view(values.dtype)[0])


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


def delta_bits(value: int) -> int:
    """The Elias-delta code of ``value`` as a Python int (for building tables)."""
    return int(delta_code(value)[0])


SMALL = 16  # gaps and levels below this encode by one lookup
LANE_MIN = 1 << 16  # chunks shorter than this use one generator (no jumps)
DRAWS = 512  # draws per lane per quantiser pass (LANES rows of them stay in L1)


def small_entry_codes() -> np.ndarray:
    """Entry codes for gap, q < SMALL and the sign at ``(gap * SMALL + q) * 2 + negative``,
    packed as ``code | bits << 32``."""
    table = np.zeros(SMALL * SMALL * 2, dtype=np.uint64)
    for gap in range(1, SMALL):
        for q in range(1, SMALL):
            for negative in (0, 1):
                q_bits = delta_length(q)
                bits = delta_length(gap) + 1 + q_bits
                code = (delta_bits(gap) << (1 + q_bits)) | negative << q_bits | delta_bits(q)
                table[(gap * SMALL + q) * 2 + negative] = code | bits << 32
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
def subtract_levels(values, levels, dequantised):
    """``values[i] -= dequantised[levels[i] + middle]`` with ``middle`` the index of level
    0: error feedback's ``e = g' - D(c)`` from the levels just drawn, without decoding."""
    middle = (dequantised.size - 1) // 2
    for i in range(values.size):
        values[np.uint64(i)] -= dequantised[np.uint64(levels[np.uint64(i)] + middle)]


@njit(nogil=True, cache=True)
def subtract_scaled(values, levels, unit):
    """``values[i] -= level * unit``, the product rounded to the values' dtype: error
    feedback's residual where the divisor is a power of two, for then ``q * (scale /
    divisor)`` in float64 is exactly ``q * scale / divisor``, the decoded value
    (vectorised arithmetic instead of ``subtract_levels``'s gathers: 4x faster)."""
    for i in range(values.size):
        values[i] -= values.dtype.type(np.float64(levels[i]) * unit)


@njit(nogil=True, cache=True)
def quantise_chunk(x, scale, top, natural, span, states, dequantised, unit, levels_out):
    """levels_out[i] = the signed q of x[i] (scale > 0), drawing from LANES generators;
    with ``unit`` > 0, x becomes the residual ``x - level * unit`` (``subtract_scaled``),
    else with a non-empty ``dequantised`` (the decoded value of each level, level 0 in
    the middle) ``x - dequantised[level]``, block by block while the block is in L1 (in
    ``quantise_block`` itself the loop would not vectorise).

    Lane l covers ``x[l * span : (l + 1) * span]`` and ``states[:, l]`` (a, b) is the
    generator state at its start (a jump ahead of the chunk's); with ``span >= x.size``
    lane 0 does everything, one draw at a time. Otherwise each pass steps all lanes
    DRAWS times side by side (``draw_lanes``), then quantises the lanes' blocks
    (vectorised). Draws past a lane's span are never used.
    """
    if states.shape != (2, LANES) or not states.flags.c_contiguous:
        raise ValueError("quantise_chunk: states must be a C-contiguous (2, LANES) array")
    n = x.size
    draws = np.empty((LANES, DRAWS), dtype=np.uint64)
    lanes = min(LANES, -(-n // span))
    a, b = states[0, 0], states[1, 0]
    for k0 in range(0, min(span, n), DRAWS):
        count = min(DRAWS, span - k0)
        if lanes == 1:
            for j in range(count):
                a, b, draws[0, j] = xorshift_step(a, b)
        else:
            draw_lanes(states, draws, -(-count // VECTOR))
        for lane in range(lanes):
            lo = lane * span + k0
            hi = min(lo + count, n, (lane + 1) * span)
            if lo < hi:
                quantise_block(x[lo:hi], scale, top, natural, draws[lane, : hi - lo],
                               levels_out[lo:hi])
                if unit > 0.0:
                    subtract_scaled(x[lo:hi], levels_out[lo:hi], unit)
                elif dequantised.size:
                    subtract_levels(x[lo:hi], levels_out[lo:hi], dequantised)


@njit(nogil=True, cache=True)
def swap32(value):
    """The low 32 bits of ``value`` byte-reversed, as uint32 (one bswap)."""
    return np.uint32(byteswap(np.uint64(value)) >> np.uint64(32))


@njit(nogil=True, cache=True)
def bits_at(code, low, count):
    """``count`` (<= 32) bits of ``code`` above its ``low`` lowest ones."""
    return (code >> np.uint64(low)) & ((np.uint64(1) << np.uint64(count)) - np.uint64(1))


@njit(nogil=True, cache=True)
def append_bits(acc, total, code, nbits, words):
    """Append ``nbits`` (<= 32) bits of ``code`` to a stream of ``total`` bits whose
    newest bits are the low bits of ``acc``; returns (acc, total).

    Stores the last complete 32-bit word (word 0 while none is complete: it is stored
    again once complete), so the only loop-carried work is one shift-or and one add."""
    acc = (acc << np.uint64(nbits)) | code
    total += nbits
    words[np.uint64(max((total >> 5) - 1, 0))] = swap32(acc >> np.uint64(total & 31))
    return acc, total


@njit(nogil=True, cache=True)
def append_code(acc, total, code, nbits, words):
    """``append_bits`` for a code of up to 64 bits, in pieces of at most 32."""
    while nbits:
        take = min(nbits, 32)
        nbits -= take
        acc, total = append_bits(acc, total, bits_at(code, nbits, take), take, words)
    return acc, total


@njit(nogil=True, cache=True)
def flush_bits(acc, total, words):
    """Store the last partial word, zero-padded; returns ``total``."""
    if total & 31:
        words[total >> 5] = swap32(acc << np.uint64(32 - (total & 31)))
    return total


@njit(nogil=True, cache=True, inline="always")
def append_entry(acc, total, gap, signed, small_codes, words):
    """Append one entry: delta(gap), the sign bit, delta(|signed|); returns (acc, total).
    With gap and q below SMALL (nearly always) the whole entry is one lookup."""
    q = abs(signed)
    if gap < SMALL and q < SMALL:
        packed = small_codes[np.uint64((gap * SMALL + q) * 2 + (signed < 0))]
        return append_bits(acc, total, packed & np.uint64(0xFFFFFFFF),
                           np.int64(packed >> np.uint64(32)), words)
    gap_code, gap_bits = delta_code(gap)
    q_code, q_bits = delta_code(q)
    acc, total = append_code(acc, total, gap_code, gap_bits, words)
    return append_code(acc, total, (np.uint64(signed < 0) << np.uint64(q_bits)) | q_code,
                       q_bits + 1, words)


CODE_BLOCK = 2048  # levels scanned for nonzeros before their entries are coded


@njit(nogil=True, cache=True)
def code_chunk(levels, small_codes, words):
    """Code the signed ``levels`` of one chunk into the uint32 ``words`` (stream byte
    order), the first gap counted from the chunk's start (``index + 1``).

    Returns (bits, first, last): the bit count and the chunk indices of the first and
    last nonzero level (-1 if none). Each block of levels is first scanned for its
    nonzeros (branch-free), then only those are coded, so zeros cost no coding work.
    Indices are cast to unsigned, so numba leaves out its negative-index wraparound
    (15% of this loop's time). For int8 levels ``code_windows`` is faster.
    """
    acc = np.uint64(0)  # the newest stream bits
    total = 0
    previous = -1
    first = -1
    nonzero = np.empty(CODE_BLOCK, dtype=np.int64)
    for start in range(0, levels.size, CODE_BLOCK):
        count = 0
        for i in range(start, min(start + CODE_BLOCK, levels.size)):
            nonzero[np.uint64(count)] = i
            count += levels[np.uint64(i)] != 0
        if first < 0 and count:
            first = nonzero[0]
        for j in range(count):
            i = nonzero[np.uint64(j)]
            acc, total = append_entry(acc, total, i - previous, np.int64(levels[np.uint64(i)]),
                                      small_codes, words)
            previous = i
    return flush_bits(acc, total, words), first, previous


WINDOW = 4  # int8 levels read as one uint32 and coded by one table lookup
WINDOW_LOW = -3  # window levels -3..4 (3 bits each once biased by 3) have table entries
REST_MASK = (1 << 40) - 1


def window_codes() -> np.ndarray:
    """For each 12-bit pattern of WINDOW levels (level - WINDOW_LOW, 3 bits each, the
    first level lowest) with a nonzero level: the window's code after its first gap
    (the first entry's sign and delta(q), then whole entries with gaps inside the
    window), packed as ``code | bits << 40 | first << 48 | last << 52`` with the
    positions of the first and last nonzero level."""
    table = np.zeros(1 << (3 * WINDOW), dtype=np.uint64)
    for pattern in range(table.size):
        levels = [((pattern >> (3 * k)) & 7) + WINDOW_LOW for k in range(WINDOW)]
        positions = [k for k, level in enumerate(levels) if level]
        if not positions:
            continue
        code, bits, previous = 0, 0, positions[0]
        for k in positions:
            if k != positions[0]:
                code, bits = code << delta_length(k - previous) | delta_bits(k - previous), (
                    bits + delta_length(k - previous))
            q = abs(levels[k])
            code = (code << 1 | (levels[k] < 0)) << delta_length(q) | delta_bits(q)
            bits += 1 + delta_length(q)
            previous = k
        table[pattern] = code | bits << 40 | positions[0] << 48 | positions[-1] << 52
    table.setflags(write=False)
    return table


def gap_codes() -> np.ndarray:
    """delta(gap) for gap < SMALL, packed as ``code | bits << 32``."""
    table = np.array([0] + [delta_bits(g) | delta_length(g) << 32 for g in range(1, SMALL)],
                     dtype=np.uint64)
    table.setflags(write=False)
    return table


WINDOW_CODES = window_codes()
GAP_CODES = gap_codes()


@njit(nogil=True, cache=True, inline="always")
def code_levels(levels, lo, hi, acc, total, first, previous, small_codes, words):
    """Code the nonzero ``levels[lo:hi]`` entry by entry after the last nonzero index
    ``previous`` (``first``: the first nonzero index so far, -1 if none); returns
    (acc, total, first, previous)."""
    for i in range(lo, hi):
        level = np.int64(levels[np.uint64(i)])
        if level:
            acc, total = append_entry(acc, total, i - previous, level, small_codes, words)
            first = i if first < 0 else first
            previous = i
    return acc, total, first, previous


@njit(nogil=True, cache=True)
def code_windows(levels, windows, window_codes, gap_codes, small_codes, words):
    """``code_chunk`` for int8 ``levels``, WINDOW levels at a time: ``windows`` is the
    whole windows of ``levels`` viewed as uint32 (little-endian: the first level in the
    low byte). An all-zero window costs one compare. Otherwise the levels are biased by
    -WINDOW_LOW with a byte-wise add that carries nothing across bytes; if each fits in
    3 bits, one lookup gives the window's code after its first gap, which is prepended
    (one more lookup when small), so a window costs one or two appends whatever its
    entries. Levels out of range and the tail are coded entry by entry.
    """
    acc = np.uint64(0)
    total = 0
    previous = -1
    first = -1
    bias = np.uint32(-WINDOW_LOW * 0x01010101)
    for w in range(windows.size):
        word = windows[np.uint64(w)]
        if word == 0:
            continue
        base = w * WINDOW
        biased = ((word & np.uint32(0x7F7F7F7F)) + bias) ^ (word & np.uint32(0x80808080))
        if biased & np.uint32(0xF8F8F8F8):  # a level outside WINDOW_LOW..WINDOW_LOW + 7
            acc, total, first, previous = code_levels(levels, base, base + WINDOW, acc, total,
                                                      first, previous, small_codes, words)
            continue
        spread = biased | (biased >> np.uint32(5))  # levels 1 and 3 next to 0 and 2
        pattern = (spread & np.uint32(0x3F)) | ((spread >> np.uint32(10)) & np.uint32(0xFC0))
        entry = window_codes[np.uint64(pattern)]
        start = base + np.int64((entry >> np.uint64(48)) & np.uint64(0xF))
        gap = start - previous
        first = start if first < 0 else first
        previous = base + np.int64(entry >> np.uint64(52))
        rest = entry & np.uint64(REST_MASK)
        rest_bits = np.int64((entry >> np.uint64(40)) & np.uint64(0xFF))
        if gap < SMALL:
            gap_entry = gap_codes[np.uint64(gap)]
            gap_bits = np.int64(gap_entry >> np.uint64(32))
            if gap_bits + rest_bits <= 32:
                code = ((gap_entry & np.uint64(0xFFFFFFFF)) << np.uint64(rest_bits)) | rest
                acc, total = append_bits(acc, total, code, gap_bits + rest_bits, words)
                continue
        gap_code, gap_bits = delta_code(gap)
        acc, total = append_code(acc, total, gap_code, gap_bits, words)
        acc, total = append_code(acc, total, rest, rest_bits, words)
    acc, total, first, previous = code_levels(levels, windows.size * WINDOW, levels.size, acc,
                                              total, first, previous, small_codes, words)
    return flush_bits(acc, total, words), first, previous


@njit(nogil=True, cache=True)
def read32(words, position):
    """The 32 stream bits from ``position`` of uint32 ``words`` in stream byte order
    (reads one word past them)."""
    w = position >> 5
    pair = (np.uint64(swap32(words[w])) << np.uint64(32)) | np.uint64(swap32(words[w + 1]))
    return (pair << np.uint64(position & 31)) >> np.uint64(32)


@njit(nogil=True, cache=True)
def shift_words(dst, src, shift):
    """``dst[k]`` = the 32 stream bits from bit ``shift`` (1..31) of ``src[k:k + 2]``;
    all uint32 in stream byte order (reads one word past them; vectorised)."""
    left = np.uint32(shift)
    right = np.uint32(32 - shift)
    for k in range(dst.size):
        high = swap32(src[np.uint64(k)])
        low = swap32(src[np.uint64(k + 1)])
        dst[np.uint64(k)] = swap32((high << left) | (low >> right))


@njit(nogil=True, cache=True)
def splice_chunk(dst, dst_bit, gap, src, src_bit, nbits):
    """Write delta(gap) then ``nbits`` bits of ``src`` from ``src_bit`` into ``dst`` at
    ``dst_bit`` (the bits of its word before it are kept; the last word zero-padded).
    Both hold uint32 words in stream byte order; returns the new end bit of ``dst``.

    Bits are appended until ``dst`` reaches a word boundary; from there whole words
    are copied (or shifted, ``shift_words``) at once, and the rest appended."""
    pos = dst_bit >> 5
    fill = dst_bit & 31
    acc = np.uint64(swap32(dst[pos])) >> np.uint64(32 - fill) if fill else np.uint64(0)
    if pos:  # append_bits restores the last complete word from acc, so acc must hold it
        acc |= np.uint64(swap32(dst[pos - 1])) << np.uint64(fill)
    code, length = delta_code(gap)
    acc, total = append_code(acc, dst_bit, code, length, dst)
    at, end = src_bit, src_bit + nbits
    head = min(-total & 31, end - at)
    if head:
        acc, total = append_bits(acc, total, bits_at(read32(src, at), 32 - head, head), head,
                                 dst)
        at += head
    words = (end - at) >> 5 if total & 31 == 0 else 0
    if words:
        out = dst[total >> 5 : (total >> 5) + words]
        if at & 31:
            shift_words(out, src[at >> 5 : (at >> 5) + words + 1], at & 31)
        else:
            out[:] = src[at >> 5 : (at >> 5) + words]
        acc = np.uint64(swap32(out[-1]))  # the last complete word, for the tail's append
        at += 32 * words
        total += 32 * words
    if at < end:
        left = end - at
        acc, total = append_bits(acc, total, bits_at(read32(src, at), 32 - left, left), left,
                                 dst)
    return flush_bits(acc, total, dst)


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


FIELD = 0xFF  # the pair table's fields are bytes
PAIR_REACH = 128  # a pair lookup moves the index by at most this (table gaps are < 64)
ZERO_BLOCK = 4096  # the decoder zeroes its output this many elements at a time, ahead of need


@functools.cache
def pair_table(max_level: int) -> np.ndarray:
    """For each TABLE_BITS-bit prefix: the one or two whole entries it starts with,
    packed as ``bits | gap1 << 8 | sign1 << 16 | gap2 << 24 | sign2 << 32`` with
    ``sign = 2 * q + negative`` (an index into the signed magnitudes). With one entry,
    gap2 = 0 and sign2 = sign1: writing the second repeats the first. 0: none fits."""
    single = entry_table(max_level)
    table = np.zeros(1 << TABLE_BITS, dtype=np.int64)
    for prefix in range(1 << TABLE_BITS):
        used, fields = 0, []
        while len(fields) < 4:  # an entry found in the known bits is determined by them
            entry = int(single[(prefix << used) & ((1 << TABLE_BITS) - 1)])
            bits = entry & 0xFF
            if not bits or used + bits > TABLE_BITS:
                break
            used += bits
            fields += [(entry >> 8) & 0xFFFF, 2 * ((entry >> 24) & 0xFFFF) + (entry >> 40)]
        if fields:
            gap1, sign1, gap2, sign2 = fields + [0, fields[1]] if len(fields) == 2 else fields
            table[prefix] = used | gap1 << 8 | sign1 << 16 | gap2 << 24 | sign2 << 32
    table.setflags(write=False)
    return table


@njit(nogil=True, cache=True, inline="always")
def window_at(words, position):
    """The 64 stream bits from bit ``position`` of ``words``, the stream's bytes viewed
    as uint64 (two byte-swapped loads; the second word is shifted in two steps so that
    a shift of 0 moves nothing)."""
    word = np.uint64(position >> 6)
    shift = np.uint64(position & 63)
    return (byteswap(words[word]) << shift) | (
        (byteswap(words[word + np.uint64(1)]) >> np.uint64(1)) >> (np.uint64(63) - shift))


@njit(nogil=True, cache=True)
def decode_entries(words, nbits, position, index, stop, sync, scale, divisor, max_level, table,
                   pairs, signed, out, marks):
    """Decode entries from bit ``position``, ``index`` being the last index written,
    into ``out`` (indices past ``out.size`` are an error), writing the zeros between
    entries; stop at an entry start >= ``stop`` (at most one entry past the first), or
    at one equal to a position of the sorted ``sync`` (then the parse joins the one
    that recorded them).

    Records the start positions and preceding indices of the first entries in the rows
    of ``marks`` (shape (2, count)). Returns (error, position, index, count): error 0 or
    an ERRORS code (position is then the failing entry's start); count is the number of
    marks or, when synchronised, the index in ``sync`` + 1 (else 0).

    ``words`` is the payload viewed as uint64, so the 64-bit window at any bit position
    is two loads; the trailer's 16 bytes are the words past the stream (bits past
    ``nbits`` are never decoded: every code is checked against the bits left).

    While it must record or meet entry starts, the parse goes entry by entry; then two
    entries per ``pairs`` lookup (nearly always), in an inner loop without checks, while
    none can fail: the stream has a whole table prefix left, the zeroed output reaches
    past any pair and the table holds only valid levels. Elsewhere (near either end, or
    no pair fits) one entry at a time: short entries by one ``table`` lookup, the rest
    code by code, each checked against the bits left, out.size and the largest level
    before it is used. Values come from ``signed[2 * q + negative] = ±q * scale /
    divisor`` (for the q the tables hold). The output is zeroed ZERO_BLOCK elements at a
    time ahead of the entries, so short gaps write nothing. The hot path's indices are
    unsigned, so numba leaves out its negative-index wraparound (6-8% of the time).
    """
    n = out.size
    window = np.uint64(0)  # the stream from `position` on, left-aligned
    valid = 0  # bits of `window` loaded (past the stream's end: the trailer's bytes)
    count = 0
    k = 0  # next candidate in `sync`
    cleared = index + 1  # out[index + 1 : cleared] are zeros
    fast_end = min(stop, nbits - TABLE_BITS + 1)  # a pair from before here is in the stream
    while position < nbits and position < stop:
        careful = k < sync.size or count < marks.shape[1]  # entry by entry
        if careful:
            while k < sync.size and sync[k] < position:
                k += 1
            if k < sync.size and sync[k] == position:
                return 0, position, index, k + 1
            if count < marks.shape[1]:
                marks[0, count] = position
                marks[1, count] = index
                count += 1
        if valid < TABLE_BITS:
            window, valid = window_at(words, position), 64
        if cleared <= index + PAIR_REACH and cleared < n:
            top = min(cleared + ZERO_BLOCK, n)
            out[cleared:top] = 0.0
            cleared = top
        if not careful:  # pairs while no check can fail: far from the stream's and zeros' ends
            start = position
            while position < fast_end and index < cleared - PAIR_REACH:
                if valid < TABLE_BITS:
                    window, valid = window_at(words, position), 64
                pair = pairs[window >> np.uint64(64 - TABLE_BITS)]
                bits = pair & FIELD
                if not bits:
                    break
                middle = index + ((pair >> 8) & FIELD)
                index = middle + ((pair >> 24) & FIELD)
                out[np.uint64(middle)] = signed[np.uint64((pair >> 16) & FIELD)]
                out[np.uint64(index)] = signed[np.uint64((pair >> 32) & FIELD)]
                position += bits
                window <<= np.uint64(bits)
                valid -= bits
            if position != start:
                continue  # else near an end, or no pair fits: one entry, checked
        entry = table[window >> np.uint64(64 - TABLE_BITS)]
        bits = entry & 0xFF
        if bits and bits <= nbits - position:
            gap = (entry >> 8) & 0xFFFF
            q = (entry >> 24) & 0xFFFF
            if gap > n - 1 - index:
                return 2, position, index, count
            if q > max_level:
                return 3, position, index, count
            index += gap
            out[index] = signed[2 * q + (entry >> 40)]
            position += bits
            window <<= np.uint64(bits)
            valid -= bits
            continue
        valid = 0  # the slow path moves `at` on its own
        at = position
        gap = 0
        for part in range(2):  # 0: the gap code; 1: the sign bit and the q code
            window = window_at(words, at)
            negative = False
            if part:
                if at >= nbits:
                    return 4, position, index, count
                negative = (window >> np.uint64(63)) != 0
                window <<= np.uint64(1)
                at += 1
            zeros = np.int64(leading_zeros(window))
            if zeros > MAX_HEAD_ZEROS:
                return 1, position, index, count
            head = 2 * zeros + 1
            b = np.int64(window >> np.uint64(64 - head))
            if b > MAX_CODE_BITS or head + b - 1 > nbits - at:
                return 1, position, index, count
            low = ((window << np.uint64(head)) >> np.uint64(1)) >> np.uint64(64 - b)
            value = (np.uint64(1) << np.uint64(b - 1)) | low
            at += head + b - 1
            if part == 0:
                if value > np.uint64(n - 1 - index):
                    return 2, position, index, count
                gap = np.int64(value)
        if value > np.uint64(max_level):
            return 3, position, index, count
        index += gap
        if index >= cleared:
            out[cleared:index] = 0.0
            cleared = index + 1
        magnitude = np.float64(value) * scale / divisor
        out[index] = -magnitude if negative else magnitude
        position = at
    return 0, position, index, count


MIN_SPLIT_BITS = 1 << 18  # shorter streams decode on one thread
MARKS = 256  # entry starts a speculative parse records for the true one to meet
NO_SYNC = np.empty(0, dtype=np.int64)
NO_MARKS = np.empty((2, 0), dtype=np.int64)
RESTART_BITS = 1 << 12  # a speculative parse hitting an error this close to its start retries


@njit(nogil=True, cache=True)
def speculate(words, nbits, start, stop, scale, divisor, max_level, table, pairs, signed,
              scratch, marks):
    """Decode the entries from an arbitrary bit ``start`` (not known to begin an entry)
    up to the first entry start >= ``stop``, with indices relative to an unknown
    offset, into ``scratch``; record the first entries' positions in ``marks``.

    A misaligned parse usually falls into step with the true one within a few entries;
    an error near ``start`` means a misaligned parse, so it retries one bit further on.
    Returns (error, position, index, count) of the final attempt (see decode_entries).
    """
    empty = np.empty(0, dtype=np.int64)
    while True:
        result = decode_entries(words, nbits, start, -1, stop, empty, scale, divisor, max_level,
                                table, pairs, signed, scratch, marks)
        if result[0] == 0 or result[1] - start >= RESTART_BITS or start + 1 >= stop:
            return result
        start = result[1] + 1


class Dithering(Compressor):
    """Stochastic rounding of |x|/scale onto s linear or 2**(s-1) natural levels."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, levels: int = 2,
                 natural: bool = False, l2: bool = False, seed: int = 1):
        super().__init__(numel, dtype)
        self.levels, self.natural, self.l2 = levels, natural, l2
        self.rng = new_state(seed)
        self.divisor = float(2 ** (levels - 1)) if natural else float(levels)
        # a power of two: q * (scale / divisor) is exactly the decoded q * scale / divisor
        self.divisor_pow2 = math.frexp(self.divisor)[0] == 0.5
        # q <= divisor, or one level more where float rounding puts |x| / scale above 1
        self.max_level = 2 * int(self.divisor) if natural else levels + 1
        self.table = entry_table(self.max_level)
        self.pairs = pair_table(self.max_level)
        # per element at most: 2 bits of gap code (delta(2) = 4 bits per 2), sign, q code
        self.bits_per_element = 3 + delta_length(self.max_level)
        self.max_stream_bytes = (numel * self.bits_per_element + 7) // 8 + 8
        self.bounds = chunk_bounds(numel)
        # the narrowest signed levels (int8 ones code by windows and fit the residual table)
        self.level_dtype = np.int8 if self.max_level < 2**7 else (
            np.int32 if self.max_level < 2**31 else np.int64)
        self.buffers: dict = {}  # scratch arrays, allocated on first use

    def buffer(self, name: str, shape: int | tuple, dtype: type) -> np.ndarray:
        """A scratch array kept for the next call (numel is fixed)."""
        if name not in self.buffers:
            self.buffers[name] = np.empty(shape, dtype=dtype)
        return self.buffers[name]

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode_payload(float_view(self.check_input(x)), residual=False)

    def compress_residual(self, corrected: torch.Tensor) -> torch.Tensor:
        """Compress ``corrected`` and leave ``corrected - decompress(payload)`` in it, as
        error feedback needs: for float32/float64 and levels below 128 in the quantiser's
        pass, each ``D(c)`` rounded as decoding rounds it; otherwise by decoding.

        Example::

            >>> import torch
            >>> c = Dithering(numel=3, levels=2, seed=1)
            >>> x = torch.tensor([0.5, -1.0, 0.2])
            >>> residual = x.clone()
            >>> payload = c.compress_residual(residual)
            >>> torch.equal(residual, x - c.decompress(payload))
            True
        """
        values = self.check_input(corrected)
        if (values is not corrected or self.dtype not in KERNEL_FLOAT_DTYPES
                or self.level_dtype != np.int8):
            payload = self.compress(corrected)
            corrected.sub_(self.decompress(payload))
            return payload
        return self.encode_payload(corrected.numpy(), residual=True)

    def encode_payload(self, values: np.ndarray, residual: bool) -> torch.Tensor:
        """The payload of ``values``; with ``residual``, ``values`` becomes the residual."""
        if self.l2:
            scale = math.sqrt(sum_squares(values))
        else:
            scale = max_abs(values, self.bounds)
        if not math.isfinite(scale):
            raise ValueError("dithering cannot encode a tensor with inf or NaN entries")
        payload = torch.empty(self.max_stream_bytes + TRAILER, dtype=torch.uint8)
        buffer = payload.numpy()
        words = sub_array(buffer, 0, np.uint32, buffer.size // 4)
        a, b = self.rng
        dequantised, unit = np.empty(0, dtype=values.dtype), 0.0
        if residual and self.divisor_pow2:
            unit = scale / self.divisor
        elif residual:
            magnitudes = self.level_magnitudes(scale, self.max_level)
            dequantised = np.concatenate([-magnitudes[:0:-1], magnitudes]).astype(values.dtype)
        # scale 0: every q is 0 and the residual is the input
        nbits = self.encode(values, scale, words, dequantised, unit) if scale > 0.0 else 0
        self.rng[0], self.rng[1] = jump(a, b, self.numel, jump_table())
        size = (nbits + 7) // 8
        trailer = np.array([nbits], dtype=np.uint64).view(np.uint8)
        buffer[size : size + 8] = trailer
        buffer[size + 8 : size + 16] = np.array([scale], dtype=np.float64).view(np.uint8)
        return payload[: size + TRAILER]

    def encode(self, values: np.ndarray, scale: float, words: np.ndarray,
               dequantised: np.ndarray, unit: float = 0.0) -> int:
        """Quantise and code ``values`` into ``words``; returns the bit count. With
        ``unit`` > 0 or a non-empty ``dequantised`` (``quantise_chunk``), ``values``
        becomes the residual.

        Each chunk (one per thread) quantises with its generators jumped to its start
        and codes its levels on its own, the first chunk straight into ``words``, the
        others into scratch arrays; their streams are then appended with the first gap
        re-coded relative to the last nonzero index before the chunk."""
        levels = self.buffer("levels", self.numel, self.level_dtype)
        top = float(2 ** (self.levels - 1)) if self.natural else float(self.levels)
        table = jump_table()
        a, b = self.rng

        def work(lo: int, hi: int) -> tuple:
            span = -(-(hi - lo) // LANES) if hi - lo >= LANE_MIN else hi - lo
            states = np.zeros((2, LANES), dtype=np.uint64)
            for lane in range(LANES if span < hi - lo else 1):
                states[:, lane] = jump(a, b, lo + lane * span, table)
            quantise_chunk(values[lo:hi], scale, top, self.natural, span, states, dequantised,
                           unit, levels[lo:hi])
            out = words if lo == 0 else self.buffer(
                f"stream{lo}", (hi - lo) * self.bits_per_element // 32 + 4, np.uint32)
            chunk = levels[lo:hi]
            if chunk.dtype != np.int8:
                return code_chunk(chunk, SMALL_CODES, out)
            windows = chunk[: chunk.size // WINDOW * WINDOW].view(np.uint32)
            return code_windows(chunk, windows, WINDOW_CODES, GAP_CODES, SMALL_CODES, out)

        results = run_chunks(work, self.bounds)
        nbits, _, last = results[0]
        for (lo, _), (bits, first, chunk_last) in zip(self.bounds[1:], results[1:], strict=True):
            if first >= 0:
                skip = delta_length(first + 1)  # the chunk's own code of its first gap
                nbits = splice_chunk(words, nbits, lo + first - last, self.buffers[f"stream{lo}"],
                                     skip, bits - skip)
                last = lo + chunk_last
        return nbits

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
        target = out if self.dtype in KERNEL_FLOAT_DTYPES else torch.empty(
            self.numel, dtype=torch.float32)
        words = buffer[: buffer.size // 8 * 8].view(np.uint64)  # read in place (aligned)
        values = target.numpy()
        index = self.decode(words, nbits, self.decode_args(scale), values)
        values[index + 1 :] = 0.0
        if target is not out:
            out.copy_(target)
        return out

    def level_magnitudes(self, scale: float, top: int) -> np.ndarray:
        """``q * scale / divisor`` in float64 for q = 0..top, rounded as decoding rounds
        each value (the decoder's tables and error feedback's levels both use these)."""
        return np.arange(top + 1.0) * scale / self.divisor

    def decode_args(self, scale: float) -> tuple:
        """The decode kernels' arguments from ``scale`` to ``signed``: the tables and
        ``signed[2 * q + negative] = ±q * scale / divisor`` for the levels they decode,
        rounded as in the kernel's code-by-code path."""
        magnitudes = self.level_magnitudes(scale, min(self.max_level, TABLE_MAX_Q))
        signed = np.repeat(magnitudes, 2)
        signed[1::2] *= -1.0
        return scale, self.divisor, self.max_level, self.table, self.pairs, signed

    def decode(self, words: np.ndarray, nbits: int, args: tuple, values: np.ndarray) -> int:
        """Decode the stream into ``values`` up to its last entry; returns that index.

        Large streams are cut into one bit range per thread. The first is decoded in
        place; the others speculatively, from an arbitrary bit, into scratch arrays with
        relative indices. Then the true parse goes on from the end of each range until
        it meets an entry start that the next range's parse recorded: from there both
        parses coincide, so that range's values are copied in at the offset found. A
        failed speculation (an error, or no meeting point) just means the true parse
        decodes that range itself: errors are always those of the sequential parse."""
        count = len(self.bounds)
        if count == 1 or nbits < MIN_SPLIT_BITS:
            error, _, index, _ = decode_entries(words, nbits, 0, -1, nbits, NO_SYNC, *args,
                                                values, NO_MARKS)
            if error:
                raise self.bad_payload(ERRORS[error])
            return index
        cuts = [nbits * k // count for k in range(count)] + [nbits]
        room = min(self.numel, 3 * self.numel // count + 4096)

        def work(k: int, _: int) -> tuple:
            if k == 0:
                return decode_entries(words, nbits, 0, -1, cuts[1], NO_SYNC, *args, values,
                                      NO_MARKS)
            # scratch arrays per range, not per bit cut: the cuts move with every payload
            scratch = self.buffer(f"scratch{k}", room, values.dtype)
            marks = self.buffer(f"marks{k}", (2, MARKS), np.int64)
            return speculate(words, nbits, cuts[k], cuts[k + 1], *args, scratch, marks)

        results = run_chunks(work, [(k, k + 1) for k in range(count)])
        error, position, index, _ = results[0]
        for k, (guess_error, end, guess_index, marked) in enumerate(results[1:], start=1):
            if error or position >= nbits:
                break
            marks = self.buffers[f"marks{k}"]
            sync = NO_SYNC if guess_error else marks[0, :marked]  # else: decode sequentially
            error, position, index, met = decode_entries(words, nbits, position, index, nbits,
                                                         sync, *args, values, NO_MARKS)
            if error or not met:
                continue  # an error, or the rest was decoded to the end
            offset = index - marks[1, met - 1]
            if guess_index + offset >= self.numel:
                error = 2  # where the sequential parse would stop: the rest is valid
                break
            start = marks[1, met - 1] + 1
            copy_chunks(values[index + 1 : guess_index + offset + 1],
                        self.buffers[f"scratch{k}"][start : guess_index + 1])
            position, index = end, guess_index + offset
        if error:
            raise self.bad_payload(ERRORS[error])
        return index

    def state_dict(self) -> dict:
        return {"rng": state_list(self.rng)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"rng"}:
            raise ValueError(f"Dithering state must be a dict with key 'rng', got {state!r}")
        load_state_list(self, self.rng, state["rng"])
