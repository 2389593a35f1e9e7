"""The inputs the compressor tests draw, in each dtype a tensor can have."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st

from tests.harness.reference_compressors import TORCH_DTYPE

DTYPES = ["float32", "float16", "bfloat16", "float64"]
SIZES = [1, 2, 31, 32, 33, 100, 1000, 4099]


def sample(numel: int, dtype: str, seed: int = 0, distinct: bool = False) -> torch.Tensor:
    """Random values in dtype; ``distinct``: no two magnitudes equal (for topk)."""
    gen = np.random.default_rng(seed)
    if distinct:
        mags = gen.permutation(numel) + 1.0  # exact in every dtype up to 256, scaled below
        values = mags / numel * np.where(gen.random(numel) < 0.5, -1, 1)
        if dtype in ("float16", "bfloat16") and numel > 256:
            values = values * 0  # caller avoids this
    else:
        values = gen.standard_normal(numel) * gen.choice([1e-3, 1.0, 30.0])
        values[gen.random(numel) < 0.1] = 0.0
    return torch.tensor(values).to(TORCH_DTYPE[dtype])


def as_values(t: torch.Tensor) -> np.ndarray:
    return t.double().numpy()


def payload_of(t: torch.Tensor) -> bytes:
    assert t.dtype == torch.uint8 and t.dim() == 1
    return t.numpy().tobytes()


# hypothesis' strategies for property tests of the compressors
FAST = settings(max_examples=30, deadline=None)
sizes = st.integers(min_value=1, max_value=700)
dtypes = st.sampled_from(DTYPES)
