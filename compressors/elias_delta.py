"""Elias-delta coding of dithering's levels: the entries of a chunk into a bit stream.

An entry is delta(gap), a sign bit (1 = negative), delta(q), for each nonzero level q
in index order, the gap counted from the previous nonzero index (the first from -1).
Small entries code by one table lookup, int8 levels four at a time (``code_windows``);
chunks coded on their own are appended with their first gap re-coded
(``splice_chunk``)::

    >>> import numpy as np
    >>> words = np.zeros(4, dtype=np.uint32)
    >>> code_chunk(np.array([0, 2, 0, -1], dtype=np.int64), SMALL_CODES, words)
    (15, 1, 3)
    >>> format(int(words[0].byteswap()) >> 17, "015b")   # 0100 0 0100 | 0100 1 1
    '010000100010011'
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .bitstream import byteswap, delta_code, delta_length


def delta_bits(value: int) -> int:
    """The Elias-delta code of ``value`` >= 1 as a Python int, for building the tables at
    import in plain Python (calling ``bitstream.delta_code`` there would load numba's
    compiled kernels in every process that imports the package): ``b << (b - 1)`` with
    the low ``b - 1`` bits of ``value``, where ``b = bitlen(value)``.

        >>> format(delta_bits(5), "b"), delta_length(5)   # 0 11 01: b = 3 in 2 bits
        ('1101', 5)
    """
    top = int(value).bit_length() - 1
    return (top + 1) << top | (int(value) ^ 1 << top)


SMALL = 16  # gaps and levels below this encode by one lookup


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

