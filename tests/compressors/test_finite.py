"""Non-finite inputs and one-step rollback of the compression chains."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from bps.compressors import build, description, registered_names
from bps.compressors.base import NonFiniteError

# every registered compressor's first described example (powersgd, whose rounds are
# summed as they are, has its own run below)
CASES = {name: {"compressor": name, **description(name).examples[0]}
         for name in registered_names() if not description(name).payloads_sum}
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
        if not description(name).reads_all and not chain:
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


# where a payload of 300 float32 elements holds a value or scale: (start, non-finite value)
NONFINITE_AT = {
    "onebit": lambda c: (-4, np.float32(np.inf)),
    "topk": lambda c: (c.values_offset, np.float32(np.nan)),
    "randomk": lambda c: (16, np.float32(np.inf)),
    "bytegrad": lambda c: (4, np.float32(np.inf)),  # chunk 0's hi
    "dithering": lambda c: (-8, np.float64(np.inf)),
}


@pytest.mark.parametrize("name", NONFINITE_AT)
def test_decoders_refuse_nonfinite_values(name):
    import bps.compressors.base as base

    numel = 300
    c = build(CASES[name], numel)
    payload = c.compress(grads(numel, torch.float32, 1)[0]).clone()
    data = payload.numpy()
    start, value = NONFINITE_AT[name](c)
    data[start:start + value.itemsize or None] = np.array([value]).view(np.uint8)
    with pytest.raises(ValueError, match="inf|NaN|finite"):
        c.decompress(payload)
    assert issubclass(base.NonFiniteError, ValueError)


def powersgd_run(x_steps: list[torch.Tensor], rollback_at: int | None, ef: bool,
                 warm_start: bool) -> tuple:
    """Two workers' PowerSGD chains through both rounds; the step ``rollback_at`` is
    compressed, summed and decoded, then rolled back on both."""
    from bps.compressors.powersgd import PowerSGD

    chains = [PowerSGD(24, shape=(6, 4), rank=2, ef=ef, warm_start=warm_start, seed=5)
              for _ in range(2)]
    for chain in chains:
        chain.set_workers(2)
    outputs = []
    for step, xs in enumerate(x_steps):
        p = sum(c.compress(x).view(torch.float32) for c, x in zip(chains, xs, strict=True))
        q = sum(c.compress_round(1, p).view(torch.float32) for c in chains)
        outs = [c.decompress(q) for c in chains]
        if step == rollback_at:
            for chain in chains:
                chain.rollback()
            continue
        outputs.append(outs)
    return outputs, [state_of(c) for c in chains]


@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("warm_start", [True, False])
def test_powersgd_rollback_makes_a_step_never_happen(ef, warm_start):
    gen = torch.Generator().manual_seed(11)
    steps = [[torch.randn(24, generator=gen) for _ in range(2)] for _ in range(4)]
    with_skip, state_a = powersgd_run(steps, 2, ef, warm_start)
    without, state_b = powersgd_run(steps[:2] + steps[3:], None, ef, warm_start)
    for outs_a, outs_b in zip(with_skip, without, strict=True):
        for a, b in zip(outs_a, outs_b, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(state_a, state_b, strict=True):
        assert_same_state(a, b)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_powersgd_refuses_nonfinite_input_with_nothing_changed(bad):
    from bps.compressors.powersgd import PowerSGD

    chain = PowerSGD(24, shape=(6, 4), rank=1, seed=5)
    x = torch.randn(24, generator=torch.Generator().manual_seed(2))
    chain.decompress(chain.compress_round(1, chain.compress(x).view(torch.float32)))
    before = state_of(chain)
    x[7] = bad
    with pytest.raises(NonFiniteError, match="inf or NaN"):
        chain.compress(x)
    assert_same_state(state_of(chain), before)


def frames_of(values: torch.Tensor, cuts: list[int]) -> list[bytes]:
    """The raw bytes of ``values`` cut at byte offsets ``cuts``, as a push's frames."""
    raw = values.view(torch.uint8).numpy().tobytes()
    bounds = [0, *cuts, len(raw)]
    return [raw[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", [0, 1000, 2999])
@pytest.mark.parametrize("cut", ["whole elements", "inside an element"])
def test_a_push_joined_from_its_frames_is_checked_as_it_is_copied(dtype, bad, where, cut):
    """join_finite against numpy: the joined bytes are the frames', and it is False
    exactly where a value is inf or NaN, in any frame; frames that cut an element in two
    (BPS_FRAME_BYTES not a multiple of the width) take the join-then-check path."""
    from bps.compressors.finite import join_finite

    values = torch.linspace(-60000, 60000, 3000).to(dtype)
    if bad is not None:
        values[where] = bad
    width = values.element_size()
    step = 1024 * width + (1 if cut == "inside an element" else 0)
    frames = frames_of(values, list(range(step, values.numel() * width, step)))
    out = torch.full_like(values, 7)
    finite = join_finite(frames, out)
    assert torch.equal(out.view(torch.uint8), values.view(torch.uint8))
    assert finite == bool(np.isfinite(values.double().numpy()).all())
    assert finite == (bad is None)
