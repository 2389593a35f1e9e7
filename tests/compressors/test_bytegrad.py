"""bytegrad bit for bit against the numpy reference of docs/compression.md, its edge
cases (constant chunks, zeros of either sign, subnormal and huge ranges, the element
equal to the max), refused inputs and payloads, and the threaded split."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bps.compressors import build, validate_compression_params
from bps.compressors.base import NonFiniteError
from bps.compressors.bytegrad import ByteGrad, split_chunks
from tests.harness import reference_compressors as ref
from tests.harness.samples import DTYPES, SIZES, as_values, payload_of, sample


def check(x: torch.Tensor, chunk: int) -> bytes:
    """Compress ``x``; payload and decoded values must equal the reference's."""
    dtype = str(x.dtype).removeprefix("torch.")
    c = ByteGrad(x.numel(), x.dtype, chunk=chunk)
    payload = payload_of(c.compress(x))
    assert payload == ref.bytegrad_encode(as_values(x), chunk)
    expected = ref.bytegrad_decode(payload, x.numel(), chunk, dtype)
    np.testing.assert_array_equal(as_values(c.decompress(payload)), expected)
    return payload


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("chunk", [1, 7, 32, 1024])
def test_matches_reference(dtype, numel, chunk):
    check(sample(numel, dtype, seed=numel + chunk), chunk)


def test_default_chunk_and_payload_size():
    params = validate_compression_params({"compressor": "bytegrad"})
    assert params["chunk"] == 1024
    c = build(params, 2500)
    assert c.compress(torch.randn(2500)).numel() == 8 * 3 + 2500
    assert ByteGrad.max_payload_bytes(2500, chunk=1024) == 2524


def test_rule_on_a_hand_computed_chunk():
    # lo = -1, hi = 1: w = 2 / 256; x = 0 -> floor(128) = 128 -> -1 + 128.5 / 128
    payload = check(torch.tensor([-1.0, 0.0, 1.0, 0.999]), chunk=4)
    assert list(payload[8:]) == [0, 128, 255, 255]
    y = ByteGrad(4, chunk=4).decompress(payload)
    assert y.tolist() == [-1 + 0.5 / 128, 0.5 / 128 + 0.0, 1 - 0.5 / 128, 1 - 0.5 / 128]


@pytest.mark.parametrize("value", [0.0, -0.0, 3.5, -1e-42, 2.5e38])
def test_constant_chunk_decodes_to_lo_exactly(value):
    x = torch.full((10,), value)
    payload = check(x, chunk=4)
    assert not any(payload[3 * 8:])  # every code 0
    y = ByteGrad(10, chunk=4).decompress(payload)
    assert torch.equal(y, x + 0.0)  # -0.0 is stored and decoded as +0.0
    assert not torch.signbit(y[y == 0]).any()


@pytest.mark.parametrize("values", [
    [-0.0, 0.0, -0.0, 1.0],           # zeros of either sign as min
    [1e-45, 3e-45, 0.0, 1.4e-43],     # subnormals: w rounds to 0 or a few ulps
    [-1.5e38, 3e37, 1e38, 1.6e38],    # huge but finite range
    [1.0, 1.0000001, 1.0, 1.0000001],  # a one-ulp range
    [5.0, -5.0, 5.0, -5.0],           # max elements code to 255
])
def test_edge_ranges_match_reference(values):
    check(torch.tensor(values, dtype=torch.float32), chunk=4)
    check(torch.tensor(values, dtype=torch.float64), chunk=3)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False,
                                 min_value=-2.0**126, max_value=2.0**126), min_size=1, max_size=40),
       chunk=st.integers(1, 12))
def test_any_finite_float32_matches_reference(values, chunk):
    check(torch.tensor(values, dtype=torch.float32), chunk)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_refused_naming_the_chunk(bad):
    x = torch.ones(10)
    x[6] = bad
    with pytest.raises(NonFiniteError, match=r"chunk 1 \(elements 4 to 7\).*inf or NaN"):
        ByteGrad(10, chunk=4).compress(x)
    with pytest.raises(ValueError):
        ref.bytegrad_encode(as_values(x), 4)


def test_range_overflow_is_refused():
    with pytest.raises(ValueError, match="chunk 0: max - min overflows float32"):
        ByteGrad(2, chunk=2).compress(torch.tensor([-3e38, 3e38]))


@pytest.mark.parametrize("lo, hi", [(1.0, 0.0), (float("nan"), 1.0), (0.0, float("inf")),
                                    (-3e38, 3e38)])
def test_bad_ranges_in_a_payload_are_refused(lo, hi):
    c = ByteGrad(6, chunk=4)
    payload = bytearray(payload_of(c.compress(torch.arange(6.0))))
    payload[8:16] = np.array([lo, hi], "<f4").tobytes()
    with pytest.raises(ValueError, match="chunk 1 has lo="):
        c.decompress(bytes(payload))


def test_large_input_split_over_threads_matches_reference(monkeypatch):
    monkeypatch.setattr("bps.compressors.bytegrad.MIN_CHUNK", 1000)
    monkeypatch.setattr("bps.compressors.bytegrad.THREADS", 2)
    assert split_chunks(10_000, 300) == [(0, 5100), (5100, 10_000)]
    x = sample(10_000, "float32", seed=4)
    c = ByteGrad(10_000, chunk=300)
    assert len(c.bounds) == 2
    check(x, 300)
    payload = payload_of(c.compress(x))
    assert payload == ref.bytegrad_encode(as_values(x), 300)
    total = sample(10_000, "float32", seed=5)
    expected = as_values(total) + ref.bytegrad_decode(payload, 10_000, 300, "float32")
    c.decompress_add(payload, total)
    np.testing.assert_array_equal(as_values(total), ref.round_to(expected, "float32"))
    bad = x.clone()
    bad[9000] = float("nan")
    with pytest.raises(ValueError, match="chunk 30 "):
        c.compress(bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_update_error_is_input_minus_decoded(dtype):
    torch_dtype = ref.TORCH_DTYPE[dtype]
    c = ByteGrad(300, torch_dtype, chunk=64)
    x = sample(300, dtype, seed=8)
    payload = c.compress(x)
    corrected = x.clone()
    c.fast_update_error(corrected, payload)
    assert torch.equal(corrected, x - c.decompress(payload))
