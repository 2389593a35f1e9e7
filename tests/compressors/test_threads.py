"""Inputs split over the chunk threads give what the vectorised references give."""

import numpy as np
import pytest
import torch

from bps.compressors import build


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
