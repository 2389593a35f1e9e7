"""Each compressor against the independent references of
tests/harness/reference_compressors.py."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bps.compressors import build, topk
from bps.compressors.base import NonFiniteError
from tests.harness import reference_compressors as ref
from tests.harness.samples import DTYPES, SIZES, as_values, payload_of, sample

FAST = settings(max_examples=30, deadline=None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("scaling", [False, True])
def test_onebit_matches_reference(dtype, numel, scaling):
    x = sample(numel, dtype, seed=numel)
    c = build({"compressor": "onebit", "scaling": scaling}, numel, ref.TORCH_DTYPE[dtype])
    payload = payload_of(c.compress(x))
    values = as_values(x)
    expected = ref.onebit_encode(values, scaling)
    assert len(payload) == len(expected) <= (numel + 7) // 8 + 16
    assert payload[:-4] == expected[:-4]  # sign words bit-exact
    mine, theirs = np.frombuffer(payload[-4:], "<f4")[0], np.frombuffer(expected[-4:], "<f4")[0]
    assert mine == pytest.approx(theirs, rel=2e-7)  # float64 sum order may differ: <= 1 ulp
    y = c.decompress(c.compress(x))
    np.testing.assert_array_equal(as_values(y), ref.onebit_decode(payload, numel, dtype))


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
    # (tests/compressors/test_nonfinite.py checks every compressor, chain and dtype)
    c = build({"compressor": "topk", "k": 50}, 5000)
    with pytest.raises(NonFiniteError, match="inf or NaN"):
        c.compress(torch.tensor(np.r_[np.full(100, np.nan), np.ones(4900)], dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel, k", [(1, 1), (7, 7), (100, 0.1), (1000, 13), (4099, 0.01)])
@pytest.mark.parametrize("seed", [1, 2**64 - 1])
def test_randomk_matches_reference_over_steps(dtype, numel, k, seed):
    c = build({"compressor": "randomk", "k": k, "seed": seed}, numel, ref.TORCH_DTYPE[dtype])
    rng = ref.XorShift128Plus(seed)
    count = max(1, int(k * numel)) if isinstance(k, float) else min(k, numel)
    for step in range(3):  # the state advances across compress calls
        x = sample(numel, dtype, seed=step)
        payload = payload_of(c.compress(x))
        assert payload == ref.randomk_encode(as_values(x), count, dtype, rng)
        assert len(payload) <= count * ref.ITEMSIZE[dtype] + 32
        np.testing.assert_array_equal(as_values(c.decompress(payload)),
                                      ref.randomk_decode(payload, numel, count, dtype))


def test_xorshift_first_draws():
    from bps.compressors.rng import new_state, next_random

    rng, state = ref.XorShift128Plus(12345), new_state(12345)
    assert [int(next_random(state)) for _ in range(5)] == [rng.next() for _ in range(5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 33, 1000])
@pytest.mark.parametrize("s, partition", [(1, "linear"), (4, "linear"), (127, "linear"),
                                          (1, "natural"), (3, "natural"), (8, "natural")])
@pytest.mark.parametrize("normalize", ["max", "l2"])
def test_dithering_matches_reference(dtype, numel, s, partition, normalize):
    params = {"compressor": "dithering", "k": s, "partition": partition,
              "normalize": normalize, "seed": 42}
    c = build(params, numel, ref.TORCH_DTYPE[dtype])
    rng = ref.XorShift128Plus(42)
    for step in range(2):
        x = sample(numel, dtype, seed=step + numel)
        values = as_values(x)
        payload = payload_of(c.compress(x))
        scale = float(np.frombuffer(payload[-8:], "<f8")[0])
        assert scale == pytest.approx(ref.dithering_scale(values, normalize), rel=1e-13)
        # the float64 sum order of "l2" is the kernel's: feed its scale to the reference
        assert payload == ref.dithering_encode(values, s, partition, normalize, rng, scale=scale)
        nbits = int(np.frombuffer(payload[-16:-8], "<u8")[0])
        assert len(payload) == (nbits + 7) // 8 + 16
        expected = ref.round_to(ref.dithering_decode(payload, numel, s, partition), dtype)
        np.testing.assert_array_equal(as_values(c.decompress(payload)), expected)


def test_dithering_draws_one_number_per_element_even_for_zeros():
    c = build({"compressor": "dithering", "k": 2, "seed": 9}, 50)
    c.compress(torch.zeros(50))
    rng = ref.XorShift128Plus(9)
    for _ in range(50):
        rng.next()
    assert c.state_dict() == {"rng": [rng.a, rng.b]}


@pytest.mark.parametrize("params", [
    {"compressor": "onebit", "scaling": True}, {"compressor": "onebit", "scaling": False},
    {"compressor": "topk", "k": 3}, {"compressor": "randomk", "k": 3},
    {"compressor": "dithering", "k": 4}, {"compressor": "dithering", "k": 3,
                                          "partition": "natural", "normalize": "l2"},
    {"compressor": "bytegrad"}, {"compressor": "bytegrad", "chunk": 5},
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_input_decodes_to_zeros(params, dtype):
    c = build(params, 77, ref.TORCH_DTYPE[dtype])
    y = c.decompress(c.compress(torch.zeros(77, dtype=ref.TORCH_DTYPE[dtype])))
    assert y.dtype == ref.TORCH_DTYPE[dtype] and y.shape == (77,)
    assert not torch.isnan(y).any() and (y == 0).all()


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


# ---- properties ----------------------------------------------------------------------

sizes = st.integers(min_value=1, max_value=700)
dtypes = st.sampled_from(DTYPES)


@FAST
@given(numel=sizes, dtype=dtypes, seed=st.integers(0, 2**32 - 1), scaling=st.booleans())
def test_onebit_keeps_signs_and_bounds(numel, dtype, seed, scaling):
    x = sample(numel, dtype, seed=seed)
    c = build({"compressor": "onebit", "scaling": scaling}, numel, ref.TORCH_DTYPE[dtype])
    payload = c.compress(x)
    assert payload.numel() <= (numel + 7) // 8 + 16
    y = c.decompress(payload)
    assert y.shape == (numel,) and y.dtype == x.dtype
    assert torch.equal(y < 0, x < 0)


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


@FAST
@given(numel=sizes, dtype=dtypes, k=st.one_of(st.integers(1, 2000),
                                              st.floats(1e-4, 0.999)))
def test_randomk_length_and_bound(numel, dtype, k):
    c = build({"compressor": "randomk", "k": k}, numel, ref.TORCH_DTYPE[dtype])
    count = max(1, int(k * numel)) if isinstance(k, float) else min(k, numel)
    x = sample(numel, dtype)
    payload = c.compress(x)
    assert payload.numel() == 16 + count * ref.ITEMSIZE[dtype] <= count * ref.ITEMSIZE[dtype] + 32
    y = c.decompress(payload)
    sent = y != 0
    assert torch.equal(y[sent], x[sent]) and int(sent.sum()) <= count


@FAST
@given(numel=sizes, dtype=dtypes, s=st.integers(1, 16), natural=st.booleans(),
       l2=st.booleans(), seed=st.integers(1, 2**64 - 1))
def test_dithering_bounds_and_error(numel, dtype, s, natural, l2, seed):
    params = {"compressor": "dithering", "k": s, "partition": "natural" if natural else "linear",
              "normalize": "l2" if l2 else "max", "seed": seed}
    c = build(params, numel, ref.TORCH_DTYPE[dtype])
    x = sample(numel, dtype, seed=seed % 2**32)
    payload = c.compress(x).numpy().tobytes()
    nbits = int(np.frombuffer(payload[-16:-8], "<u8")[0])
    assert len(payload) == (nbits + 7) // 8 + 16
    y = c.decompress(payload)
    scale = float(np.frombuffer(payload[-8:], "<f8")[0])
    divisor = 2 ** (s - 1) if natural else s
    step = scale / divisor * (2 ** (s - 1) if natural else 1)  # one level (natural: widest)
    err = (y.double() - x.double()).abs().max().item()
    assert err <= step * 1.01 + 1e-30
    assert torch.equal(torch.sign(y[y != 0]), torch.sign(x[y != 0]))


def test_large_inputs_split_over_threads_match_vectorised_references():
    """Above 2M elements the kernels run in chunks on threads: same bytes as one pass."""
    from bps.compressors.threads import MIN_CHUNK, chunk_bounds

    numel = 2 * MIN_CHUNK + 45
    assert len(chunk_bounds(numel)) > 1 or chunk_bounds(numel) == [(0, numel)]
    gen = np.random.default_rng(3)
    x = torch.tensor(gen.standard_normal(numel), dtype=torch.float32)
    signs = np.r_[(x.numpy() < 0), np.zeros(-numel % 32, dtype=bool)].reshape(-1, 32)
    words = signs.astype(np.uint64) @ (np.uint64(1) << np.arange(31, -1, -1, dtype=np.uint64))
    c = build({"compressor": "onebit", "scaling": True}, numel)
    payload = c.compress(x).numpy()
    np.testing.assert_array_equal(payload[:-4].view("<u4"), words.astype(np.uint32))
    scale = payload[-4:].view("<f4")[0]
    assert scale == pytest.approx(np.abs(x.numpy().astype(np.float64)).mean(), rel=2e-7)
    y = c.decompress(payload)
    assert torch.equal(y, torch.where(x < 0, -torch.tensor(scale), torch.tensor(scale)))

    k = 20_000
    t = build({"compressor": "topk", "k": k}, numel)
    y = t.decompress(t.compress(x))
    expected = np.sort(np.argsort(-np.abs(x.numpy()), kind="stable")[:k])
    np.testing.assert_array_equal(np.flatnonzero(y.numpy()), expected)
