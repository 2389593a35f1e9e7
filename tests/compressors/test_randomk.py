"""randomk against the independent reference of tests/harness/reference_compressors.py."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bps.compressors import build
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
