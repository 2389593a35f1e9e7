"""dithering: stochastic quantisation to s levels, Elias-delta coded, docs/compression.md.

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
pass. Encoding: each chunk quantises with its generator jumped to its start
(:mod:`.dithering_quantiser`) and codes its levels on its own (:mod:`.elias_delta`);
the streams are then appended with each chunk's first gap re-coded. Decoding parses
bit ranges in parallel by speculation (:mod:`.dithering_decoder`).

Example::

    >>> import torch
    >>> c = Dithering(numel=4, dtype=torch.float32, levels=2, natural=False, l2=False, seed=1)
    >>> y = c.decompress(c.compress(torch.tensor([0.0, 1.0, -1.0, 0.25])))
    >>> y[:3].tolist()
    [0.0, 1.0, -1.0]
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from bps.common.config import Key, choice, fail, integer

from .base import (
    KERNEL_FLOAT_DTYPES,
    Compressor,
    Description,
    Payload,
    float_view,
    payload_bytes,
    sub_array,
)
from .bitstream import delta_length
from .dithering_decoder import ERRORS, TABLE_MAX_Q, decode_stream, entry_table, pair_table
from .dithering_quantiser import max_abs, quantise_range, sum_squares
from .elias_delta import (
    GAP_CODES,
    SMALL_CODES,
    WINDOW,
    WINDOW_CODES,
    code_chunk,
    code_windows,
    splice_chunk,
)
from .rng import SeededState, job_seed, jump, jump_table, new_state
from .threads import chunk_bounds, run_chunks

TRAILER = 16
# Implementation limits on the levels s, so that every q fits the Elias-delta coder's
# 32-bit fields (linear: u is a float32, exact up to 2**24).
MAX_LINEAR_LEVELS = 2**24
MAX_NATURAL_LEVELS = 31


def max_level(levels: int, natural: bool) -> int:
    """The largest level q a payload may hold: the divisor (s, or 2**(s-1) natural), or
    one level more where float rounding puts |x| / scale above 1 (natural: twice it)."""
    return 2 ** levels if natural else levels + 1


def bits_per_element(top: int) -> int:
    """Most stream bits per element: 2 bits of gap code (delta(2) = 4 bits per 2),
    the sign and delta(q) for q up to ``top``."""
    return 3 + delta_length(top)



class Dithering(SeededState, Compressor):
    """Stochastic rounding of |x|/scale onto s linear or 2**(s-1) natural levels."""

    description: ClassVar[Description] = Description(
        examples=({"k": 4, "seed": 7}, {"k": 3, "partition": "natural", "seed": 7}),
        typical={"k": 8}, label="stochastic levels, Elias-delta coded")
    keys: ClassVar[dict[str, Key]] = {
        "k": Key(integer(1), required="an int >= 1 (number of levels s)"),
        "partition": Key(choice("linear", "natural"), default="linear"),
        "normalize": Key(choice("max", "l2"), default="max"),
    }

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, levels: int = 2,
                 natural: bool = False, l2: bool = False, seed: int = 1):
        super().__init__(numel, dtype)
        self.levels, self.natural, self.l2 = levels, natural, l2
        self.rng = new_state(seed)
        self.divisor = float(2 ** (levels - 1)) if natural else float(levels)
        # a power of two: q * (scale / divisor) is exactly the decoded q * scale / divisor
        self.divisor_pow2 = math.frexp(self.divisor)[0] == 0.5
        self.max_level = max_level(levels, natural)
        self.table = entry_table(self.max_level)
        self.pairs = pair_table(self.max_level)
        self.bits_per_element = bits_per_element(self.max_level)
        self.max_stream_bytes = self.max_payload_bytes(numel, dtype, levels, natural) - TRAILER
        self.bounds = chunk_bounds(numel)
        # the narrowest signed levels (int8 ones code by windows and fit the residual table)
        self.level_dtype = np.int8 if self.max_level < 2**7 else (
            np.int32 if self.max_level < 2**31 else np.int64)
        self.buffers: dict = {}  # scratch arrays, allocated on first use
        self.undo: np.ndarray | None = None  # the RNG state before the last compress
        # a larger scale decodes its top level to inf in the dtype
        self.max_scale = float(torch.finfo(dtype).max) * self.divisor / self.max_level

    @classmethod
    def check_params(cls, params: dict) -> None:
        """``k`` (the levels s) within what the partition's coder holds."""
        natural = params["partition"] == "natural"
        hi = MAX_NATURAL_LEVELS if natural else MAX_LINEAR_LEVELS
        if params["k"] > hi:
            raise fail(ValueError, "k", params["k"],
                       f"an int in [1, {hi}] (levels s, {params['partition']} partition)")

    @classmethod
    def options(cls, params: dict, numel: int) -> dict:
        return {"levels": params["k"], "natural": params["partition"] == "natural",
                "l2": params["normalize"] == "l2", "seed": job_seed(params)}

    @classmethod
    def max_payload_bytes(cls, numel: int, dtype: torch.dtype = torch.float32, levels: int = 2,
                          natural: bool = False, **options: object) -> int:
        """The longest payload: every element coded at ``bits_per_element``, the stream
        padded to whole words, and the trailer.

            >>> Dithering.max_payload_bytes(1000, levels=4)
            1024
        """
        stream = (numel * bits_per_element(max_level(levels, natural)) + 7) // 8 + 8
        return stream + TRAILER

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
            raise self.nonfinite_input()
        self.undo = self.rng.copy()
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
        return self.finish(payload, nbits, scale)

    def finish(self, payload: torch.Tensor, nbits: int, scale: float) -> torch.Tensor:
        """The payload of an ``nbits`` stream at its start: the trailer written after it."""
        size = (nbits + 7) // 8
        buffer = payload.numpy()
        buffer[size : size + 8] = np.array([nbits], dtype=np.uint64).view(np.uint8)
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
        a, b = self.rng

        def work(lo: int, hi: int) -> tuple:
            quantise_range(values, lo, hi, a, b, scale, self.divisor, self.natural,
                           dequantised, unit, levels)
            return self.code_range(levels, lo, hi, words)

        return self.splice(run_chunks(work, self.bounds), words)

    def code_levels(self, levels: np.ndarray, words: np.ndarray) -> int:
        """Code signed ``levels`` (``level_dtype``, numel of them) into ``words``, one
        chunk per thread; returns the bit count (device chains quantise elsewhere)."""
        return self.splice(run_chunks(lambda lo, hi: self.code_range(levels, lo, hi, words),
                                      self.bounds), words)

    def code_range(self, levels: np.ndarray, lo: int, hi: int, words: np.ndarray) -> tuple:
        """Code ``levels[lo:hi]`` on its own: into ``words`` for the first chunk, else a
        scratch stream; returns (bits, first nonzero, last nonzero) as the coders do."""
        out = words if lo == 0 else self.buffer(
            f"stream{lo}", (hi - lo) * self.bits_per_element // 32 + 4, np.uint32)
        chunk = levels[lo:hi]
        if chunk.dtype != np.int8:
            return code_chunk(chunk, SMALL_CODES, out)
        windows = chunk[: chunk.size // WINDOW * WINDOW].view(np.uint32)
        return code_windows(chunk, windows, WINDOW_CODES, GAP_CODES, SMALL_CODES, out)

    def splice(self, results: list, words: np.ndarray) -> int:
        """Append the chunks' streams to the first one's in ``words``; the bit count."""
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
        if not (0.0 <= scale <= self.max_scale):  # also inf and NaN
            raise self.bad_payload(f"scale {scale} is not finite and >= 0, or decodes to "
                                   f"values beyond {self.dtype}")
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
        """Decode the stream into ``values`` up to its last entry; returns that index
        (:func:`.dithering_decoder.decode_stream`, one bit range per thread)."""
        error, index = decode_stream(words, nbits, args, values, self.bounds, self.buffer)
        if error:
            raise self.bad_payload(ERRORS[error])
        return index



