"""Independent reference implementations of docs/compression.md, in plain Python/numpy loops.

Slow but obviously right: written from the spec text and bps's documented payload
layouts (docs/compressors.md), never calling bps.compressors. Values are handled as
float64 numpy arrays holding numbers exactly representable in the tensor dtype
(``dtype`` is a name: "float32", "float16", "bfloat16", "float64"). Other tests reuse
these, e.g. to check server aggregation::

    from tests.harness.reference_compressors import XorShift128Plus, ref_codec
"""

from __future__ import annotations

import importlib
import math
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

MASK64 = (1 << 64) - 1
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16,
               "bfloat16": torch.bfloat16, "float64": torch.float64}


class XorShift128Plus:
    """xorshift128+ exactly as docs/compression.md, on Python ints."""

    def __init__(self, seed: int = 1, state: tuple[int, int] | None = None):
        self.a, self.b = (seed, seed) if state is None else state

    def next(self) -> int:
        t, s = self.a, self.b
        self.a = s
        t ^= (t << 23) & MASK64
        t ^= t >> 17
        t ^= s ^ (s >> 26)
        self.b = t
        return (t + s) & MASK64

    def randint(self, lo: int, hi: int) -> int:
        return self.next() % (hi - lo) + lo

    def bernoulli(self, p: float) -> bool:
        return float(self.next()) < p * float(2**64 - 1)


def round_to(values, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype`` (returned as float64)."""
    values = torch.tensor(np.asarray(values, dtype=np.float64))
    return values.to(TORCH_DTYPE[dtype]).double().numpy()


def value_bytes(values, dtype: str) -> bytes:
    """Little-endian bytes of values (exactly representable in dtype)."""
    values = np.asarray(values, dtype=np.float64)
    if dtype == "bfloat16":
        bits = np.asarray(values, dtype=np.float32).view(np.uint32) >> 16
        return bits.astype("<u2").tobytes()
    return values.astype({"float32": "<f4", "float16": "<f2", "float64": "<f8"}[dtype]).tobytes()


def values_from_bytes(data: bytes, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    code = {"float32": "<f4", "float16": "<f2", "float64": "<f8"}[dtype]
    return np.frombuffer(data, dtype=code).astype(np.float64)


# ---- onebit --------------------------------------------------------------------------

def onebit_scale(x, scaling: bool) -> float:
    """float32 scale: mean |x| (exactly rounded sum), or 1 (0 for an all-zero x)."""
    if not scaling:
        return 0.0 if all(v == 0 for v in x) else 1.0
    return float(np.float32(math.fsum(abs(float(v)) for v in x) / len(x)))


def onebit_encode(x, scaling: bool, scale: float | None = None) -> bytes:
    n = len(x)
    words = []
    for w in range((n + 31) // 32):
        word = 0
        for j in range(32):
            i = w * 32 + j
            bit = 1 if i < n and x[i] < 0 else 0
            word = (word << 1) | bit
        words.append(word)
    if scale is None:
        scale = onebit_scale(x, scaling)
    return struct.pack(f"<{len(words)}I", *words) + struct.pack("<f", scale)


def onebit_decode(payload: bytes, numel: int, dtype: str) -> np.ndarray:
    nw = (numel + 31) // 32
    words = struct.unpack_from(f"<{nw}I", payload)
    (scale,) = struct.unpack_from("<f", payload, 4 * nw)
    scale = float(round_to([scale], dtype)[0])
    out = np.empty(numel)
    for i in range(numel):
        bit = (words[i // 32] >> (31 - i % 32)) & 1
        out[i] = -scale if bit else scale
    return out


# ---- topk ----------------------------------------------------------------------------

def topk_indices(x, k: int) -> list[int]:
    """Indices of the k largest |x| (the test data has no ties), ascending."""
    order = sorted(range(len(x)), key=lambda i: -abs(float(x[i])))
    return sorted(order[:k])


def topk_encode(x, k: int, dtype: str) -> bytes:
    indices = topk_indices(x, k)
    pad = b"\0" * ((-4 * k) % 8)
    return struct.pack(f"<{k}i", *indices) + pad + value_bytes([x[i] for i in indices], dtype)


def topk_decode(payload: bytes, numel: int, k: int, dtype: str) -> np.ndarray:
    indices = struct.unpack_from(f"<{k}i", payload)
    offset = 4 * k + (-4 * k) % 8
    values = values_from_bytes(payload[offset:], dtype)
    out = np.zeros(numel)
    for i, v in zip(indices, values, strict=True):
        out[i] = v
    return out


# ---- randomk -------------------------------------------------------------------------

def randomk_encode(x, k: int, dtype: str, rng: XorShift128Plus) -> bytes:
    header = struct.pack("<QQ", rng.a, rng.b)
    values = [x[rng.randint(0, len(x))] for _ in range(k)]
    return header + value_bytes(values, dtype)


def randomk_decode(payload: bytes, numel: int, k: int, dtype: str) -> np.ndarray:
    a, b = struct.unpack_from("<QQ", payload)
    rng = XorShift128Plus(state=(a, b))
    values = values_from_bytes(payload[16:], dtype)
    out = np.zeros(numel)
    for j in range(k):
        out[rng.randint(0, numel)] = values[j]
    return out


# ---- dithering -----------------------------------------------------------------------

def elias_delta(n: int) -> str:
    b = n.bit_length()
    lb = b.bit_length()
    return "0" * (lb - 1) + format(b, "b") + format(n, "b")[1:]


def next_pow2(c: int) -> int:
    if c <= 1:
        return c
    p = 1
    while p < c:
        p *= 2
    return p


def dithering_scale(x, normalize: str) -> float:
    if normalize == "max":
        return max(abs(float(v)) for v in x)
    return math.sqrt(math.fsum(float(v) * float(v) for v in x))


def dithering_levels(x, s: int, partition: str, scale: float, rng: XorShift128Plus) -> list[int]:
    """q for every element; exactly one RNG draw per element."""
    qs = []
    top = 2 ** (s - 1) if partition == "natural" else s
    for v in x:
        r = rng.next()
        if scale == 0:
            qs.append(0)
            continue
        if partition == "linear":
            u = np.float32(abs(float(v)) / scale * s)
            low = np.floor(u)
            p = float(u - low)
            q = int(low) + (1 if float(r) < p * float(2**64 - 1) else 0)
        else:
            u = abs(float(v)) / scale * top
            f = next_pow2(math.ceil(u)) >> 1
            length = f or 1
            q = f + length * (1 if float(r) < (u - f) / length * float(2**64 - 1) else 0)
        qs.append(q)
    return qs


def dithering_encode(x, s: int, partition: str, normalize: str, rng: XorShift128Plus,
                     scale: float | None = None) -> bytes:
    if scale is None:
        scale = dithering_scale(x, normalize)
    bits = []
    previous = -1
    for i, q in enumerate(dithering_levels(x, s, partition, scale, rng)):
        if q:
            bits.append(elias_delta(i - previous))
            bits.append("1" if x[i] < 0 else "0")
            bits.append(elias_delta(q))
            previous = i
    stream = "".join(bits)
    nbits = len(stream)
    stream += "0" * (-nbits % 8)
    data = bytes(int(stream[j : j + 8], 2) for j in range(0, len(stream), 8))
    return data + struct.pack("<Qd", nbits, scale)


def dithering_decode(payload: bytes, numel: int, s: int, partition: str) -> np.ndarray:
    nbits, scale = struct.unpack_from("<Qd", payload, len(payload) - 16)
    stream = "".join(format(byte, "08b") for byte in payload[: len(payload) - 16])[:nbits]
    divisor = 2 ** (s - 1) if partition == "natural" else s
    pos = 0

    def read_delta() -> int:
        nonlocal pos
        zeros = 0
        while stream[pos] == "0":
            zeros += 1
            pos += 1
        b = int(stream[pos : pos + zeros + 1], 2)
        pos += zeros + 1
        n = int("1" + stream[pos : pos + b - 1], 2)
        pos += b - 1
        return n

    out = np.zeros(numel)
    index = -1
    while pos < nbits:
        index += read_delta()
        negative = stream[pos] == "1"
        pos += 1
        q = read_delta()
        magnitude = q * scale / divisor
        out[index] = -magnitude if negative else magnitude
    return out


# ---- bytegrad ------------------------------------------------------------------------

def bytegrad_encode(x, chunk: int) -> bytes:
    """Per chunk, in float32 numpy arithmetic (one rounding per op): lo = min, hi = max
    (+0.0 for a zero), w = (hi - lo) / 256, q = min(255, floor((x - lo) / w)), q = 0
    where w == 0. Payload: the (lo, hi) pairs, then the codes."""
    x32 = np.asarray(x, dtype=np.float64).astype(np.float32)
    if not np.isfinite(x32).all():
        raise ValueError("bytegrad input holds a NaN or an infinity")
    ranges, codes = [], []
    for start in range(0, len(x32), chunk):
        part = x32[start:start + chunk]
        lo = np.float32(part.min()) + np.float32(0.0)
        hi = np.float32(part.max()) + np.float32(0.0)
        with np.errstate(over="ignore"):
            span = np.float32(hi - lo)
        if not np.isfinite(span):
            raise ValueError("bytegrad chunk range overflows float32")
        w = np.float32(span / np.float32(256.0))
        if w == 0:
            q = np.zeros(len(part), dtype=np.uint8)
        else:
            t = np.floor((part - lo) / w)
            q = np.minimum(t, np.float32(255.0)).astype(np.uint8)
        ranges += [lo, hi]
        codes.append(q)
    return np.array(ranges, dtype="<f4").tobytes() + np.concatenate(codes).tobytes()


def bytegrad_decode(payload: bytes, numel: int, chunk: int, dtype: str) -> np.ndarray:
    """y = lo + (q + 0.5) * w in float32, rounded to dtype."""
    count = -(-numel // chunk)
    ranges = np.frombuffer(payload[:8 * count], dtype="<f4")
    codes = np.frombuffer(payload[8 * count:], dtype=np.uint8)
    assert len(payload) == 8 * count + numel
    out = np.empty(numel, dtype=np.float32)
    for c in range(count):
        lo, hi = ranges[2 * c], ranges[2 * c + 1]
        w = np.float32(np.float32(hi - lo) / np.float32(256.0))
        q = codes[c * chunk:(c + 1) * chunk].astype(np.float32)
        out[c * chunk:(c + 1) * chunk] = lo + (q + np.float32(0.5)) * w
    return round_to(out.astype(np.float64), dtype)


# ---- the chain -----------------------------------------------------------------------

class RefChain:
    """Momentum(ErrorFeedback(C)) on float64 arrays rounded to dtype after every op.

    ``encode(x) -> payload`` and ``decode(payload) -> values`` define C.
    """

    def __init__(self, encode, decode, numel: int, dtype: str, ef: bool, mu: float | None):
        self.encode, self.decode, self.dtype = encode, decode, dtype
        self.ef, self.mu = ef, mu
        self.error = np.zeros(numel)
        self.momentum = np.zeros(numel)
        self.lr_prev = self.lr_now = None

    def set_lr(self, lr: float) -> None:
        self.lr_prev = lr if self.lr_now is None else self.lr_now
        self.lr_now = lr

    def compress(self, g) -> bytes:
        r = lambda v: round_to(v, self.dtype)  # noqa: E731
        g = np.asarray(g, dtype=np.float64)
        if self.mu is not None:
            mu = float(np.float32(self.mu)) if self.dtype != "float64" else self.mu
            self.momentum = r(g + r(mu * self.momentum))
            g = r(g + r(mu * self.momentum))
        if not self.ef:
            return self.encode(g)
        ratio = 1.0 if self.lr_now is None else self.lr_prev / self.lr_now
        if ratio != 1.0:
            ratio = float(np.float32(ratio)) if self.dtype != "float64" else ratio
            corrected = r(g + r(ratio * self.error))
        else:
            corrected = r(g + self.error)
        payload = self.encode(corrected)
        self.error = r(corrected - self.decode(payload))
        return payload


Codec = tuple[Callable[[np.ndarray], bytes], Callable[[bytes], np.ndarray]]
# compressor name -> codec(params, numel, dtype): (encode, decode), encode carrying the RNG
REFERENCES: dict[str, Callable[[dict, int, str], Codec]] = {}


def reference(name: str) -> Callable:
    """Register the decorated ``codec(params, numel, dtype) -> (encode, decode)`` as the
    reference of compressor ``name``. Those of this module's compressors are below; any
    other's lives in the compressor's own test file, ``test_<name>.py`` anywhere under
    tests/, which :func:`ref_codec` imports to find it (the one import of a test module
    by another module of tests/: a compressor is its source file and its test file)."""

    def add(codec: Callable[[dict, int, str], Codec]) -> Callable[[dict, int, str], Codec]:
        REFERENCES[name] = codec
        return codec

    return add


def own_test_module(name: str) -> str | None:
    """The dotted name of compressor ``name``'s own test file (``test_<name>.py`` under
    tests/), or None."""
    tests = Path(__file__).resolve().parents[1]
    found = sorted(tests.rglob(f"test_{name}.py"))
    if not found:
        return None
    return ".".join(found[0].relative_to(tests.parent).with_suffix("").parts)


def ref_codec(params: dict, numel: int, dtype: str) -> Codec:
    """(encode, decode) of the reference for ``params["compressor"]`` (encode carries the
    RNG); decode gives float64 values exactly representable in ``dtype``."""
    name = params["compressor"]
    module = None if name in REFERENCES else own_test_module(name)
    if module is not None:
        importlib.import_module(module)
    if name not in REFERENCES:
        raise LookupError(f"compressor {name!r} has no reference codec: its own test file "
                          f"(test_{name}.py under tests/) registers one with "
                          f"@reference({name!r}) (tests/harness/reference_compressors.py)")
    return REFERENCES[name](params, numel, dtype)


def count_of(k: int | float | None, numel: int) -> int:
    """k as a count of elements: a fraction of numel (at least 1), else at most numel."""
    if not k:
        return 0
    return max(1, int(k * numel)) if isinstance(k, float) else min(k, numel)


@reference("onebit")
def onebit_codec(params: dict, numel: int, dtype: str) -> Codec:
    # encode(x, scale): a "scale_ulp" compressor's reference takes the scale it compares
    return (lambda x, scale=None: onebit_encode(x, params.get("scaling", True), scale),
            lambda p: onebit_decode(p, numel, dtype))


@reference("topk")
def topk_codec(params: dict, numel: int, dtype: str) -> Codec:
    count = count_of(params.get("k"), numel)
    return (lambda x: topk_encode(x, count, dtype),
            lambda p: topk_decode(p, numel, count, dtype))


@reference("bytegrad")
def bytegrad_codec(params: dict, numel: int, dtype: str) -> Codec:
    chunk = params.get("chunk", 1024)
    return (lambda x: bytegrad_encode(x, chunk),
            lambda p: bytegrad_decode(p, numel, chunk, dtype))


@reference("randomk")
def randomk_codec(params: dict, numel: int, dtype: str) -> Codec:
    count, rng = count_of(params.get("k"), numel), XorShift128Plus(params.get("seed", 1))
    return (lambda x: randomk_encode(x, count, dtype, rng),
            lambda p: randomk_decode(p, numel, count, dtype))


@reference("dithering")
def dithering_codec(params: dict, numel: int, dtype: str) -> Codec:
    k, rng = params.get("k"), XorShift128Plus(params.get("seed", 1))
    partition = params.get("partition", "linear")
    return (lambda x: dithering_encode(x, k, partition, params.get("normalize", "max"), rng),
            lambda p: round_to(dithering_decode(p, numel, k, partition), dtype))
