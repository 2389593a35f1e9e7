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


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_decode_lands_in_the_tensor_it_is_given(dtype):
    # a chain decodes each step into the same tensor; another tensor, even one that
    # takes the address of a freed one, must get its own values and leave the first alone
    numel = 100
    c = build({"compressor": "onebit", "scaling": True}, numel, ref.TORCH_DTYPE[dtype])
    payloads = [payload_of(c.compress(sample(numel, dtype, seed=seed))) for seed in (1, 2, 3)]
    first = torch.empty(numel, dtype=ref.TORCH_DTYPE[dtype])
    second = torch.empty_like(first)
    expected = [ref.onebit_decode(p, numel, dtype) for p in payloads]
    c.decompress(payloads[0], first)
    c.decompress(payloads[1], second)
    np.testing.assert_array_equal(as_values(first), expected[0])
    np.testing.assert_array_equal(as_values(second), expected[1])
    c.decompress(payloads[2], first)
    np.testing.assert_array_equal(as_values(first), expected[2])
    np.testing.assert_array_equal(as_values(second), expected[1])
    del first, second
    third = torch.empty(numel, dtype=ref.TORCH_DTYPE[dtype])
    c.decompress(payloads[0], third)
    np.testing.assert_array_equal(as_values(third), expected[0])


@pytest.mark.parametrize("checked", [[], [0], [0, 1], [1, 0, 2]])
def test_a_server_sums_each_payload_it_is_given_whatever_it_checked(checked):
    # check_payload keeps its parse for the step's sum: the sum must read each payload
    # given, never one checked before in its place
    numel = 70
    worker = build({"compressor": "onebit", "scaling": True}, numel)
    pushes = [worker.compress(sample(numel, "float32", seed=seed)) for seed in (4, 5, 6)]
    server = build({"compressor": "onebit", "scaling": True}, numel)
    for index in checked:
        server.check_payload(pushes[index])
    given = [pushes[2], pushes[1].clone()]  # the clone: the same bytes, another object
    error = np.linspace(-1, 1, numel, dtype=np.float32)
    out = np.empty(numel, dtype=np.float32)
    payload = server.compress_sum_residual(given, 0.5, error, out)
    decoded = [ref.onebit_decode(payload_of(p), numel, "float32").astype(np.float32)
               for p in given]
    corrected = (decoded[0] + decoded[1]) + np.float32(0.5) * error
    assert payload_of(payload)[:-4] == ref.onebit_encode(corrected, True)[:-4]
    sent = ref.onebit_decode(payload_of(payload), numel, "float32").astype(np.float32)
    np.testing.assert_array_equal(out, corrected - sent)
