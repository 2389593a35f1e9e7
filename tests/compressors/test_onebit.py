"""onebit against the independent reference of tests/harness/reference_compressors.py."""

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
    SIZES,
    as_values,
    dtypes,
    payload_of,
    sample,
    sizes,
)


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
