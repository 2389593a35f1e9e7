"""topk against the independent reference of tests/harness/reference_compressors.py."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bps.compressors import build, topk
from bps.compressors.base import NonFiniteError
from tests.harness import reference_compressors as ref
from tests.harness.samples import (
    DTYPES,
    FAST,
    as_values,
    dtypes,
    payload_of,
    sample,
    sizes,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel, k",
                         [(1, 1), (5, 5), (33, 3), (200, 0.05), (256, 17), (255, 0.5)])
def test_topk_matches_reference(dtype, numel, k):
    x = sample(numel, dtype, seed=numel, distinct=True)
    c = build({"compressor": "topk", "k": k}, numel, ref.TORCH_DTYPE[dtype])
    count = max(1, int(k * numel)) if isinstance(k, float) else min(k, numel)
    payload = payload_of(c.compress(x))
    assert payload == ref.topk_encode(as_values(x), count, dtype)
    assert len(payload) <= count * (4 + ref.ITEMSIZE[dtype]) + 16
    np.testing.assert_array_equal(as_values(c.decompress(payload)),
                                  ref.topk_decode(payload, numel, count, dtype))


def test_topk_large_uses_selection_and_finds_exact_set():
    gen = np.random.default_rng(5)
    numel, k = 300_000, 3000
    x = torch.tensor(gen.standard_normal(numel), dtype=torch.float32)
    c = build({"compressor": "topk", "k": k}, numel)
    y = c.decompress(c.compress(x))
    expected = np.sort(np.argsort(-np.abs(x.numpy()), kind="stable")[:k])
    np.testing.assert_array_equal(np.flatnonzero(y.numpy()), expected)
    np.testing.assert_array_equal(y.numpy()[expected], x.numpy()[expected])


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 1000, 4097])
def test_topk_candidate_scan_against_numpy(size):
    # magnitudes as unsigned bits (NaN > inf > finite), ascending indices plus the
    # offset, the count or -1 past the cap; groups of 64 and the tail alike
    gen = np.random.default_rng(size)
    x = gen.standard_normal(size).astype(np.float32)
    x[gen.random(size) < 0.05] = np.nan
    x[gen.random(size) < 0.05] = -np.inf
    bits = x.view(np.uint32)
    mask = np.uint32(0x7FFFFFFF)
    for threshold in (np.float32(1.5), np.float32(np.inf), np.float32(0.0)):
        cut = np.array([threshold]).view(np.uint32)[0]
        expected = np.flatnonzero((bits & mask) >= cut)
        for cap in {expected.size, expected.size + 3, max(expected.size - 1, 0)}:
            indices = np.full(cap, -7, dtype=np.int32)
            values = np.zeros(cap, dtype=np.uint32)
            count = topk.collect_above(bits, cut, mask, 1000, indices, values)
            if cap < expected.size:
                assert count == -1
                continue
            assert count == expected.size
            np.testing.assert_array_equal(indices[:count], expected + 1000)
            np.testing.assert_array_equal(values[:count], bits[expected])


@pytest.mark.parametrize("order", ["ascending", "ascending with repeats", "shuffled"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_decodes_any_index_order(order, dtype):
    # compress writes ascending indices; a payload from elsewhere may repeat or shuffle
    # them: the block-by-block decoder must still give the reference (last value wins)
    gen = np.random.default_rng(len(order))
    numel, k = 30_000, 700  # several of the decoder's zeroing blocks
    indices = np.sort(gen.choice(numel, k, replace=False))
    indices[[0, -1]] = [0, numel - 1]
    if order == "ascending with repeats":
        indices = np.sort(np.r_[indices[: k - 10], indices[100:110]])
    elif order == "shuffled":
        indices[:20] = indices[5]  # repeats out of order too
        gen.shuffle(indices)
    values = torch.tensor(gen.standard_normal(k), dtype=ref.TORCH_DTYPE[dtype])
    raw = values.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()])
    payload = (indices.astype("<i4").tobytes() + bytes((-4 * k) % 8)
               + raw.numpy().astype(raw.numpy().dtype.newbyteorder("<")).tobytes())
    c = build({"compressor": "topk", "k": k}, numel, ref.TORCH_DTYPE[dtype])
    out = torch.full((numel,), 5.0, dtype=ref.TORCH_DTYPE[dtype])
    decoded = c.decompress(torch.frombuffer(bytearray(payload), dtype=torch.uint8), out=out)
    np.testing.assert_array_equal(as_values(decoded), ref.topk_decode(payload, numel, k, dtype))


@pytest.mark.parametrize("nonzeros", [40_000, 3000, 2999, 500])
def test_topk_mostly_zero_input_matches_reference(nonzeros):
    """A server's sum of sparse pushes: the sampled threshold is 0, so the nonzeros are
    collected first; with fewer than k of them, zeros fill up the k (the first ones)."""
    gen = np.random.default_rng(nonzeros)
    numel, k = 300_000, 3000
    values = np.zeros(numel, dtype=np.float32)
    values[gen.choice(numel, nonzeros, replace=False)] = gen.standard_normal(nonzeros)
    c = build({"compressor": "topk", "k": k}, numel)
    payload = payload_of(c.compress(torch.tensor(values)))
    assert payload == ref.topk_encode(values, k, "float32")


@pytest.mark.parametrize("values", [
    np.ones(5000), np.zeros(5000), np.r_[np.ones(10), np.zeros(4990)],
])
def test_topk_ties_and_zeros_still_give_exactly_k(values):
    c = build({"compressor": "topk", "k": 50}, values.size)
    payload = c.compress(torch.tensor(values, dtype=torch.float32))
    indices = payload[:200].view(torch.int32).numpy()
    assert len(set(indices.tolist())) == 50 and indices.min() >= 0 and indices.max() < values.size


def test_topk_refuses_nan_which_ranks_first():
    # NaN ranks above every magnitude, so it is among the k: compress refuses the input
    # (tests/compressors/test_finite.py checks every compressor, chain and dtype)
    c = build({"compressor": "topk", "k": 50}, 5000)
    with pytest.raises(NonFiniteError, match="inf or NaN"):
        c.compress(torch.tensor(np.r_[np.full(100, np.nan), np.ones(4900)], dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decompress_into_out_and_from_bytes_views(dtype):
    torch_dtype = ref.TORCH_DTYPE[dtype]
    c = build({"compressor": "topk", "k": 4}, 40, torch_dtype)
    x = sample(40, dtype, distinct=True)
    payload = c.compress(x)
    out = torch.full((40,), 7.0, dtype=torch_dtype)
    assert c.decompress(payload, out=out) is out
    expected = c.decompress(payload)
    raw = payload.numpy().tobytes()
    for form in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8)):
        assert torch.equal(c.decompress(form), expected)
    with pytest.raises(ValueError, match="out"):
        c.decompress(payload, out=torch.empty(41, dtype=torch_dtype))


@FAST
@given(numel=sizes, dtype=dtypes, data=st.data())
def test_topk_idempotent_on_k_sparse_input(numel, dtype, data):
    k = data.draw(st.integers(1, numel))
    x = sample(numel, dtype, seed=numel)
    keep = torch.zeros(numel, dtype=torch.bool)
    keep[data.draw(st.permutations(range(numel)))[:k]] = True
    x = torch.where(keep, x, torch.zeros_like(x))
    c = build({"compressor": "topk", "k": k}, numel, ref.TORCH_DTYPE[dtype])
    payload = c.compress(x)
    assert payload.numel() <= k * (4 + ref.ITEMSIZE[dtype]) + 16
    assert torch.equal(c.decompress(payload), x)
