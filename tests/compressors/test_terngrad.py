"""terngrad bit for bit against a plain-Python reference of docs/compression.md (registered
here for the generic tests: ``tests/harness/reference_compressors.py``), its
unbiasedness, its edge cases (all zeros, the element equal to the max, the threaded
split), refused inputs and payloads, and the draws reproduced from the seed."""

from __future__ import annotations

import doctest
import importlib
import math
import struct

import numpy as np
import pytest
import torch

from bps.compressors import build
from bps.compressors.base import NonFiniteError
from bps.compressors.terngrad import TernGrad, TernGradTorch
from tests.harness import reference_compressors as ref
from tests.harness.samples import DTYPES, SIZES, as_values, payload_of, sample

UINT64_MAX = float(2**64 - 1)


def terngrad_encode(x, rng: ref.XorShift128Plus) -> bytes:
    """docs/compression.md: s = max|x|; element i draws one number r (index order, zeros
    included) and is kept, as sign(x_i) * s, where r < float32(|x_i| / s) * (2**64 - 1)."""
    x = np.asarray(x, dtype=np.float64)
    scale = max((abs(float(v)) for v in x), default=0.0)
    codes = bytearray(-(-x.size // 4))
    for i, v in enumerate(x):
        r = float(rng.next())
        kept = False
        if scale > 0.0:
            u = float(np.float32(abs(float(v)) / scale))
            low = math.floor(u)
            kept = low + (1 if r < (u - low) * UINT64_MAX else 0) > 0
        if kept:
            codes[i // 4] |= (2 if v < 0 else 1) << (2 * (i % 4))
    return struct.pack("<d", scale) + bytes(codes)


def terngrad_decode(payload: bytes, numel: int, dtype: str) -> np.ndarray:
    (scale,) = struct.unpack_from("<d", payload, 0)
    out = np.zeros(numel)
    for i in range(numel):
        code = (payload[8 + i // 4] >> (2 * (i % 4))) & 3
        assert code in (0, 1, 2)
        out[i] = {0: 0.0, 1: scale, 2: -scale}[code]
    return ref.round_to(out, dtype)


@ref.reference("terngrad")
def terngrad_codec(params: dict, numel: int, dtype: str) -> ref.Codec:
    rng = ref.XorShift128Plus(params.get("seed", 1))
    return (lambda x: terngrad_encode(x, rng), lambda p: terngrad_decode(p, numel, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
def test_matches_reference_over_steps(dtype, numel):
    c = TernGrad(numel, ref.TORCH_DTYPE[dtype], seed=numel)
    encode, decode = terngrad_codec({"seed": numel}, numel, dtype)
    for step in range(3):  # the generator advances numel draws per compress
        x = sample(numel, dtype, seed=numel + step)
        payload = payload_of(c.compress(x))
        assert payload == encode(as_values(x)), f"step {step}"
        assert len(payload) == TernGrad.max_payload_bytes(numel) == 8 + -(-numel // 4)
        np.testing.assert_array_equal(as_values(c.decompress(payload)), decode(payload))


def test_threaded_split_and_lanes_give_the_bytes_of_one_pass(monkeypatch):
    # 70,000 elements: the quantiser's interleaved generators (from 65,536) on 3 threads
    from bps.compressors import threads

    monkeypatch.setattr(threads, "MIN_CHUNK", 20_000)
    monkeypatch.setattr(threads, "THREADS", 3)
    numel = 70_000
    c = TernGrad(numel, torch.float32, seed=3)
    assert len(c.bounds) == 3
    encode, _ = terngrad_codec({"seed": 3}, numel, "float32")
    x = sample(numel, "float32", seed=1)
    assert payload_of(c.compress(x)) == encode(as_values(x))


def test_unbiased():
    # E[D(C(x))] = x: the mean of 400 steps' decodings is within 5 standard errors of x
    numel, steps = 512, 400
    x = torch.linspace(-1.0, 1.0, numel) ** 3
    c = TernGrad(numel, torch.float32, seed=11)
    total = torch.zeros(numel, dtype=torch.float64)
    for _ in range(steps):
        total += c.decompress(c.compress(x)).double()
    scale = float(x.abs().max())
    p = (x.abs() / scale).double()
    stderr = scale * torch.sqrt(p * (1 - p) / steps)
    assert bool(((total / steps - x.double()).abs() <= 5 * stderr + 1e-12).all())


def test_edge_values():
    c = TernGrad(6, torch.float32, seed=1)
    x = torch.tensor([0.0, -0.0, 3.0, -3.0, 0.0, 0.0])
    payload = c.compress(x)  # |x| = max: kept for sure; zeros never
    assert c.decompress(payload).tolist() == [0.0, 0.0, 3.0, -3.0, 0.0, 0.0]
    before = c.rng.copy()
    zeros = c.compress(torch.zeros(6))  # scale 0: all codes 0, the numel draws still made
    assert payload_of(zeros) == bytes(8 + 2)
    rng = ref.XorShift128Plus(state=(int(before[0]), int(before[1])))
    for _ in range(6):
        rng.next()
    assert (int(c.rng[0]), int(c.rng[1])) == (rng.a, rng.b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_refused_with_state_unchanged(dtype):
    c = TernGrad(5, ref.TORCH_DTYPE[dtype], seed=2)
    state = c.state_dict()
    for bad in (np.nan, np.inf, -np.inf):
        x = torch.ones(5, dtype=ref.TORCH_DTYPE[dtype])
        x[3] = bad
        with pytest.raises(NonFiniteError, match="TernGrad: compress input"):
            c.compress(x)
        assert c.state_dict() == state


def test_rollback_and_state_round_trip():
    c = TernGrad(40, torch.float32, seed=9)
    x = sample(40, "float32", seed=4)
    first = payload_of(c.compress(x))
    c.rollback()
    assert payload_of(c.compress(x)) == first
    other = TernGrad(40, torch.float32, seed=1)
    other.load_state_dict(c.state_dict())
    assert payload_of(other.compress(x)) == payload_of(c.compress(x))
    with pytest.raises(ValueError, match="TernGrad state must be a dict with key 'rng'"):
        other.load_state_dict({"rng": [1, 2], "extra": 0})


def bad(payload: bytes, offset: int, value: bytes) -> bytes:
    return payload[:offset] + value + payload[offset + len(value):]


@pytest.mark.parametrize("torch_kernels", [False, True], ids=["host", "torch"])
def test_bad_payloads_refused(torch_kernels):
    numel = 5  # 2 code bytes: elements 5-7 are padding
    c = (TernGradTorch(numel, seed=1, device="cpu") if torch_kernels
         else TernGrad(numel, seed=1))
    good = payload_of(TernGrad(numel, seed=1).compress(torch.arange(5.0)))
    cases = [
        (good[:-1], "9 bytes, expected exactly 10"),
        (good + b"\0", "11 bytes, expected exactly 10"),
        (bad(good, 0, struct.pack("<d", np.nan)), "scale nan is not a finite number >= 0"),
        (bad(good, 0, struct.pack("<d", np.inf)), "scale inf is not a finite number >= 0"),
        (bad(good, 0, struct.pack("<d", -1.0)), "scale -1.0 is not a finite number >= 0"),
        (bad(good, 8, bytes([good[8] | 0b11000000])), "code of element 3 is not 0, 1 or 2"),
        (bad(good, 9, bytes([good[9] | 0b00000100])), "padding code of element 5 is not"),
    ]
    for payload, message in cases:
        with pytest.raises(ValueError, match=f"TernGrad payload for numel=5, dtype=torch.float32 "
                                             f"is invalid: {message}"):
            c.decompress(payload)


def test_error_feedback_residual_in_the_quantiser_pass():
    # compress_residual: corrected - D(payload) left in place, as decoding rounds it
    for dtype in (torch.float32, torch.float64, torch.float16):
        c = TernGrad(300, dtype, seed=5)
        x = sample(300, str(dtype).removeprefix("torch."), seed=8)
        residual = x.clone()
        payload = c.compress_residual(residual)
        assert torch.equal(residual, x - c.decompress(payload))
    chain = build({"compressor": "terngrad", "ef": "vanilla", "seed": 5}, 300)
    chain.set_lr(0.1)
    x = sample(300, "float32", seed=8)
    payload = chain.compress(x)
    assert torch.equal(chain.error, x - chain.decompress(payload))


def test_module_examples():
    module = importlib.import_module("bps.compressors.terngrad")
    assert doctest.testmod(module).failed == 0
