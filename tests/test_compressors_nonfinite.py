"""Non-finite inputs and one-step rollback of the compression chains."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from bps.compressors import build
from bps.compressors.base import NonFiniteError

CASES = {
    "onebit": {"compressor": "onebit", "scaling": True},
    "topk": {"compressor": "topk", "k": 0.1},
    "randomk": {"compressor": "randomk", "k": 0.1, "seed": 7},
    "dithering": {"compressor": "dithering", "k": 4, "seed": 7},
}
CHAINS = [{}, {"ef": "vanilla"}, {"momentum": "nesterov", "mu": 0.9},
          {"ef": "vanilla", "momentum": "nesterov", "mu": 0.9}]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def state_of(chain) -> dict:
    return copy.deepcopy(chain.state_dict())


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_same_state(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def grads(numel: int, dtype: torch.dtype, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(numel, generator=gen).to(dtype) for _ in range(steps)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chain", CHAINS, ids=["bare", "ef", "momentum", "ef+momentum"])
@pytest.mark.parametrize("name", CASES)
def test_rollback_makes_a_step_never_happen(name, chain, dtype):
    # chain A: steps 0, 1, (2 rolled back), 3; chain B: steps 0, 1, 3. Same payloads, state.
    params = {**CASES[name], **chain}
    numel, lrs = 300, [0.5, 0.25, 0.125, 0.25]
    a, b = build(params, numel, dtype), build(params, numel, dtype)
    xs = grads(numel, dtype, 4)
    for step, x in enumerate(xs):
        a.set_lr(lrs[step])
        pa = a.compress(x.clone())
        if step == 2:
            a.rollback()
            continue
        b.set_lr(lrs[step])
        pb = b.compress(x.clone())
        assert torch.equal(pa, pb), step
        assert_same_state(state_of(a), state_of(b))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chain", CHAINS, ids=["bare", "ef", "momentum", "ef+momentum"])
@pytest.mark.parametrize("name", CASES)
def test_nonfinite_input_is_refused_with_nothing_changed(name, chain, dtype, bad):
    params = {**CASES[name], **chain}
    numel = 300
    c = build(params, numel, dtype)
    xs = grads(numel, dtype, 2)
    c.set_lr(0.5)
    c.compress(xs[0])
    before = state_of(c)
    for index in (0, 123, numel - 1):  # randomk draws: the chains' passes see all
        x = xs[1].clone()
        x[index] = bad
        c.set_lr(0.25)
        if name == "randomk" and not chain:
            # bare randomk reads only its k draws: it refuses what it sends
            try:
                payload = c.compress(x)
            except NonFiniteError:
                assert_same_state(state_of(c), before)
                continue
            assert torch.isfinite(c.decompress(payload)).all()
            c.rollback()
            assert_same_state(state_of(c), before)
            continue
        with pytest.raises(NonFiniteError, match="inf or NaN"):
            c.compress(x)
        assert_same_state(state_of(c), before)


@pytest.mark.parametrize("name", CASES)
def test_decoders_refuse_nonfinite_values(name):
    import bps.compressors.base as base

    numel = 300
    c = build(CASES[name], numel)
    payload = c.compress(grads(numel, torch.float32, 1)[0]).clone()
    data = payload.numpy()
    if name == "onebit":
        data[-4:] = np.array([np.inf], dtype=np.float32).view(np.uint8)
    elif name == "topk":
        data[c.values_offset:c.values_offset + 4] = np.array([np.nan], np.float32).view(np.uint8)
    elif name == "randomk":
        data[16:20] = np.array([np.inf], dtype=np.float32).view(np.uint8)
    else:
        data[-8:] = np.array([np.inf], dtype=np.float64).view(np.uint8)
    with pytest.raises(ValueError, match="inf|NaN|finite"):
        c.decompress(payload)
    assert issubclass(base.NonFiniteError, ValueError)
