"""Dithering's decoder: table-driven Elias-delta parsing, in parallel by speculation.

The stream has no chunk offsets, so a long one is cut at bit positions; the first range
is decoded in place, the others speculatively from an arbitrary bit with relative
indices into scratch arrays; the true parse then goes on until it meets an entry start
recorded by the next range's parse (from there both coincide) and copies that range's
values in. A speculation that fails only costs time: the true parse decodes the range
itself, so errors are always those of the sequential parse::

    error, last = decode_stream(words, nbits, args, values, bounds, scratch)
    # error: 0 or a key of ERRORS; values[: last + 1] decoded, the rest not written
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

from .bitstream import MAX_CODE_BITS, MAX_HEAD_ZEROS, byteswap, delta_length
from .elias_delta import delta_bits
from .threads import copy_chunks, run_chunks

ERRORS = {
    1: "malformed or truncated Elias-delta code",
    2: "an index runs past numel",
    3: "a level q exceeds the largest level",
    4: "the stream ends inside an entry",
}
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


def decode_stream(words: np.ndarray, nbits: int, args: tuple, values: np.ndarray,
                  bounds: list[tuple[int, int]],
                  scratch: Callable[[str, int | tuple, type], np.ndarray]) -> tuple[int, int]:
    """Decode the stream into ``values`` up to its last entry; returns (error, index):
    an ERRORS code or 0, and the index of the last entry written.

    ``args``: ``decode_entries``'s arguments from ``scale`` to ``signed``; one bit range
    per chunk of ``bounds``; ``scratch(name, shape, dtype)``: an array kept between calls.
    The first range is decoded in place; the others speculatively, from an arbitrary bit,
    into scratch arrays with relative indices. Then the true parse goes on from the end
    of each range until it meets an entry start that the next range's parse recorded:
    from there both parses coincide, so that range's values are copied in at the offset
    found. A failed speculation (an error, or no meeting point) just means the true
    parse decodes that range itself: errors are always those of the sequential parse."""
    count = len(bounds)
    numel = values.size
    if count == 1 or nbits < MIN_SPLIT_BITS:
        error, _, index, _ = decode_entries(words, nbits, 0, -1, nbits, NO_SYNC, *args,
                                            values, NO_MARKS)
        return error, index
    cuts = [nbits * k // count for k in range(count)] + [nbits]
    room = min(numel, 3 * numel // count + 4096)

    def work(k: int, _: int) -> tuple:
        if k == 0:
            return decode_entries(words, nbits, 0, -1, cuts[1], NO_SYNC, *args, values,
                                  NO_MARKS)
        # scratch arrays per range, not per bit cut: the cuts move with every payload
        guess = scratch(f"scratch{k}", room, values.dtype)
        marks = scratch(f"marks{k}", (2, MARKS), np.int64)
        return speculate(words, nbits, cuts[k], cuts[k + 1], *args, guess, marks)

    results = run_chunks(work, [(k, k + 1) for k in range(count)])
    error, position, index, _ = results[0]
    for k, (guess_error, end, guess_index, marked) in enumerate(results[1:], start=1):
        if error or position >= nbits:
            break
        marks = scratch(f"marks{k}", (2, MARKS), np.int64)
        sync = NO_SYNC if guess_error else marks[0, :marked]  # else: decode sequentially
        error, position, index, met = decode_entries(words, nbits, position, index, nbits,
                                                     sync, *args, values, NO_MARKS)
        if error or not met:
            continue  # an error, or the rest was decoded to the end
        offset = index - marks[1, met - 1]
        if guess_index + offset >= numel:
            error = 2  # where the sequential parse would stop: the rest is valid
            break
        start = marks[1, met - 1] + 1
        copy_chunks(values[index + 1 : guess_index + offset + 1],
                    scratch(f"scratch{k}", room, values.dtype)[start : guess_index + 1])
        position, index = end, guess_index + offset
    return error, index
