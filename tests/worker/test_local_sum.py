"""The node agent's sum of local ranks (``bps.worker.local_sum``) against numpy's float16
and float32 arithmetic and torch's bfloat16, one rounding per addition in rank order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bps.worker.local_sum import sum_in_rank_order


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bit for bit, any NaN equal to any NaN."""
    both_nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
    width = np.uint16 if got.itemsize == 2 else np.uint32 if got.itemsize == 4 else np.uint64
    return bool(np.all((got.view(width) == want.view(width)) | both_nan))


def test_float16_every_value_against_numpy():
    # every float16 (subnormals, inf, NaN, -0) added to a shuffled partner, then a third rank
    rng = np.random.default_rng(0)
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    partner, third = rng.permutation(every), rng.permutation(every)
    out = torch.empty(1 << 16, dtype=torch.float16)
    with np.errstate(all="ignore"):
        sum_in_rank_order(out, [torch.from_numpy(every.copy()), torch.from_numpy(partner)])
        assert same_bits(out.numpy(), every + partner)
        sum_in_rank_order(out, [torch.from_numpy(x) for x in (every.copy(), partner, third)])
        assert same_bits(out.numpy(), (every + partner) + third)


def test_bfloat16_against_torch():
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(1 << 16, generator=gen) * torch.exp(20 * torch.randn(1 << 16,
            generator=gen)) for _ in range(2))
    a, b = a.bfloat16(), b.bfloat16()
    a[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    b[:4] = torch.tensor([float("-inf"), 1.0, 2.0, -0.0])
    out = torch.empty_like(a)
    sum_in_rank_order(out, [a, b])
    want = (a.float() + b.float()).bfloat16()  # torch: float32 sum, rounded to nearest even
    assert same_bits(out.view(torch.int16).numpy().view(np.float16),
                     want.view(torch.int16).numpy().view(np.float16))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_wide_floats_in_rank_order(dtype):
    rng = np.random.default_rng(2)
    parts = [(rng.standard_normal(1000) * 10.0 ** rng.integers(-8, 8, 1000)).astype(dtype)
             for _ in range(4)]
    out = torch.empty(1000, dtype=torch.float32 if dtype == np.float32 else torch.float64)
    sum_in_rank_order(out, [torch.from_numpy(p) for p in parts])
    assert same_bits(out.numpy(), ((parts[0] + parts[1]) + parts[2]) + parts[3])


def test_other_dtypes_are_refused():
    with pytest.raises(TypeError, match="int64"):
        sum_in_rank_order(torch.zeros(2, dtype=torch.int64), [torch.zeros(2, dtype=torch.int64)])


def test_the_module_examples_run():
    import doctest

    import bps.worker.local_sum as module

    assert doctest.testmod(module).attempted > 0 and doctest.testmod(module).failed == 0


ONE_SUM = """
import sys, torch
from bps.worker.local_sum import sum_in_rank_order, warm_kernels
if sys.argv[1] == "warm":
    warm_kernels()
else:  # a node agent's first sum of two local ranks' shares, in each dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        parts = [torch.ones(1000, dtype=dtype), torch.full((1000,), 0.5, dtype=dtype)]
        assert sum_in_rank_order(torch.empty(1000, dtype=dtype), parts)[0].item() == 1.5
"""


def test_a_node_agent_after_make_setup_compiles_no_sum(tmp_path) -> None:
    """After ``python -m bps.worker.local_sum`` (which ``make setup`` runs) a node agent's
    first sums load every kernel from numba's cache and compile none; without it, the
    same sums compile (the check can fail)."""
    import os
    import subprocess
    import sys

    def run(*argv: str) -> str:
        env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_DEBUG_CACHE": "1"}
        result = subprocess.run([sys.executable, *argv], env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout + result.stderr

    assert "data saved" in run("-m", "bps.worker.local_sum")  # into this test's empty cache
    job = run("-c", ONE_SUM, "job")
    assert "data loaded" in job and "data saved" not in job, job[-2000:]
    cold = tmp_path / "cold"
    cold.mkdir()
    env_cold = {**os.environ, "NUMBA_CACHE_DIR": str(cold), "NUMBA_DEBUG_CACHE": "1"}
    fresh = subprocess.run([sys.executable, "-c", ONE_SUM, "job"], env=env_cold,
                           capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0 and "data saved" in fresh.stdout + fresh.stderr
