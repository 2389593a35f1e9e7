"""Chains with torch kernels against the numba chains: same payload bytes, same state.

Each test runs on CPU tensors (torch kernels forced by BPS_DEVICE_KERNELS=1) and, where
a GPU is present, on CUDA (marked ``cuda``). Every registered compressor with torch
kernels runs its described examples (``Compressor.description``). The only values
allowed to differ are a ``"scale_ulp"`` compressor's float32 scale (a float64 sum in
another order: within 1 ulp) and, on a GPU, powersgd's factors (matmuls and norms summed
in another order: POWERSGD_RTOL).
"""

from __future__ import annotations

import copy
import doctest
import importlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from bps.compressors import (
    build,
    description,
    register,
    registered_names,
    supports_device,
    unregister,
)
from bps.compressors.base import NonFiniteError
from bps.compressors.device import forced_by_env
from bps.compressors.topk import TopK
from tests.harness.chain_state import assert_same_state, bits

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]
# every compressor with torch kernels whose payloads are decoded one by one (powersgd's
# rounds are summed as they are: its own tests below), each described example; the
# first under the compressor's name, the others as name-1, name-2, ...
NAMES = [name for name in registered_names() if supports_device({"compressor": name, **(
    description(name).examples[0])}) and not description(name).payloads_sum]
CASES = {name if i == 0 else f"{name}-{i}": {"compressor": name, **example}
         for name in NAMES for i, example in enumerate(description(name).examples)}
CHAINS = {"bare": {}, "ef": {"ef": "vanilla"}, "momentum": {"momentum": "nesterov", "mu": 0.9},
          "ef+momentum": {"ef": "vanilla", "momentum": "nesterov", "mu": 0.9}}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LRS = [0.5, 0.25, 0.25, 0.125, 0.5, 0.5]
POWERSGD_RTOL = 1e-4  # of the largest magnitude of a round's vector, on a GPU


@pytest.fixture
def make(monkeypatch):
    """``make(params, numel, dtype, device)``: the host chain for device None, else the
    chain with torch kernels on ``device``."""

    def build_chain(params: dict, numel: int, dtype: torch.dtype, device: str | None):
        monkeypatch.setenv("BPS_DEVICE_KERNELS", "1" if device == "cpu" else "0")
        chain = build(params, numel, dtype, device=device or "cpu")
        monkeypatch.setenv("BPS_DEVICE_KERNELS", "0")
        return chain

    return build_chain


def innermost(chain):
    while hasattr(chain, "inner"):
        chain = chain.inner
    return chain


def scale_ulps(host: torch.Tensor, device: torch.Tensor) -> int:
    """How many float32 steps apart two payloads' scales (the last 4 bytes) are."""
    a = int(host[-4:].numpy().view(np.int32)[0])
    b = int(device[-4:].cpu().numpy().view(np.int32)[0])
    return abs(a - b)


def assert_same_payload(name: str, host: torch.Tensor, device: torch.Tensor) -> bool:
    """Byte-identical payloads, but for a ``"scale_ulp"`` compressor's float32 scale (the
    last 4 bytes, within 1 ulp); returns whether the bytes are identical."""
    assert device.dtype == torch.uint8 and device.numel() == host.numel()
    if torch.equal(host, device.cpu()):
        return True
    compressor = name.split("-")[0]
    assert description(compressor).tolerance == "scale_ulp", f"{name}: payloads differ"
    assert torch.equal(host[:-4], device.cpu()[:-4]), f"{name}: all but the scale differ"
    assert scale_ulps(host, device) <= 1, f"{name}: scales more than 1 ulp apart"
    return False


def gradients(numel: int, dtype: torch.dtype, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(numel, generator=gen) * 3 for _ in range(steps)]
    for x in xs:
        x[:: 5] = 0.0  # ties in magnitude and signed zeros
        x[1:: 11] = -0.0
    return [x.to(dtype) for x in xs]


def poisoned(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[::3] = torch.inf
    x[1] = torch.nan
    return x


def run_both(host, device, name: str, x: torch.Tensor, dev: str) -> None:
    """One compress of ``x`` by both chains, the payloads and decodings compared; where
    a scale differs by its allowed ulp, the device chain takes the host's state."""
    payload_host = host.compress(x)
    payload_device = device.compress(x.to(dev))
    out = torch.full((x.numel(),), 7.0, dtype=x.dtype, device=dev)
    assert device.decompress(payload_device.to(dev), out=out) is out
    if assert_same_payload(name, payload_host, payload_device):
        assert torch.equal(bits(host.decompress(payload_host)), bits(out))
    else:
        device.load_state_dict(host.state_dict())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("name", CASES)
def test_chain_matches_host(make, name, chain, dtype, device):
    # six steps with changing learning rates, a change of loss scale, a non-finite
    # input (refused by both, nothing changed) and a rolled-back step
    params = {**CASES[name], **CHAINS[chain]}
    numel = 1000  # not a multiple of 32 (onebit padding) nor of the bytegrad chunk
    host, dev = make(params, numel, dtype, None), make(params, numel, dtype, device)
    assert type(innermost(dev)).__name__.endswith("Torch")
    reads_all = description(params["compressor"]).reads_all
    for step, x in enumerate(gradients(numel, dtype, len(LRS))):
        # a compressor that samples (randomk) sees inf wherever it draws
        bad = poisoned(x) if reads_all else torch.full_like(x, torch.inf)
        if step == 2:
            host.scale_momentum(0.5)
            dev.scale_momentum(0.5)
        if step == 3:
            before = copy.deepcopy(host.state_dict())
            for c in (host, dev):
                c.set_lr(LRS[step])
                with pytest.raises(NonFiniteError):
                    c.compress(bad.to(device if c is dev else "cpu"))
                assert_same_state(before, c.state_dict())
        before = copy.deepcopy(host.state_dict())
        host.set_lr(LRS[step])
        dev.set_lr(LRS[step])
        if step == 4:  # a step, rolled back, then done again
            run_both(host, dev, name, x, device)
            host.rollback()
            dev.rollback()
            assert_same_state(before, host.state_dict())
            assert_same_state(host.state_dict(), dev.state_dict())
            host.set_lr(LRS[step])
            dev.set_lr(LRS[step])
        run_both(host, dev, name, x, device)
        assert_same_state(host.state_dict(), dev.state_dict())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("numel", [1, 2, 31, 33, 97])
@pytest.mark.parametrize("name", CASES)
def test_odd_sizes_and_small_options(make, name, numel, device):
    # each example: a count k of 1, a bytegrad chunk of 7, ... as the compressor describes
    params = {**CASES[name], "ef": "vanilla"}
    for dtype in (torch.float32, torch.float16):
        host, dev = make(params, numel, dtype, None), make(params, numel, dtype, device)
        for step, x in enumerate(gradients(numel, dtype, 3)):
            host.set_lr(LRS[step])
            dev.set_lr(LRS[step])
            run_both(host, dev, name, x, device)
            assert_same_state(host.state_dict(), dev.state_dict())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3, 50, 199, 200])
def test_topk_takes_the_first_of_tied_magnitudes(make, k, device):
    # magnitudes 0, 1 and 2 only (+-0.0 and +-1 tie among themselves), and an all-zero
    # input: the k-th largest magnitude is shared by many entries
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-2, 3, (200,), generator=gen).float()
    x[x.abs() == 2] = 0.0
    x[::7] = 2.0
    x[3::9] = -0.0
    params = {"compressor": "topk", "k": k}
    for value in (x, torch.zeros(200), -torch.zeros(200)):
        host, dev = make(params, 200, torch.float32, None), make(params, 200, torch.float32,
                                                                 device)
        run_both(host, dev, "topk", value, device)


@pytest.mark.parametrize("device", DEVICES)
def test_dithering_l2_scale_is_a_sum_in_another_order(make, device):
    # the l2 scale sums x**2 in torch's order: within a few float64 ulps of the host's,
    # and its payload decodes on the host as any other
    params = {"compressor": "dithering", "k": 3, "normalize": "l2", "seed": 7}
    host, dev = make(params, 5000, torch.float32, None), make(params, 5000, torch.float32,
                                                              device)
    x = gradients(5000, torch.float32, 1)[0]
    payload_host, payload_device = host.compress(x), dev.compress(x.to(device)).cpu()
    scales = [float(p[-8:].numpy().view(np.float64)[0]) for p in (payload_host, payload_device)]
    assert scales[0] == pytest.approx(scales[1], rel=1e-13)
    decoded = host.decompress(payload_device)
    assert int((decoded != 0).sum()) > 0 and bool(torch.isfinite(decoded).all())
    assert host.state_dict() == dev.state_dict()  # the generator advanced alike


@pytest.mark.parametrize("device", DEVICES)
def test_onebit_all_zero_input_decodes_to_zeros(make, device):
    params = {"compressor": "onebit", "ef": "vanilla"}
    host, dev = make(params, 40, torch.float32, None), make(params, 40, torch.float32, device)
    x = -torch.zeros(40)
    host.set_lr(0.1)
    dev.set_lr(0.1)
    run_both(host, dev, "onebit", x, device)
    assert torch.equal(dev.decompress(dev.compress(x.to(device))).cpu(), torch.zeros(40))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chain", ["bare", "ef", "ef+momentum"])
def test_onebit_scale_beyond_float32_refused_as_the_host_does(make, chain, device):
    """A float64 input whose mean |x| is finite but beyond float32: the host refuses it
    with a ValueError naming the mean, and so does the device chain, keeping its state;
    its next finite input then gives the host's payload."""
    params = {**CASES["onebit"], **CHAINS[chain]}
    host, dev = make(params, 3, torch.float64, None), make(params, 3, torch.float64, device)
    huge = torch.tensor([1e300, -1e300, 3.0], dtype=torch.float64)
    for chain_ in (host, dev):
        chain_.set_lr(0.5)
    with pytest.raises(ValueError, match="beyond float32") as host_error:
        host.compress(huge)
    with pytest.raises(ValueError) as device_error:
        dev.compress(huge.to(device))
    assert not isinstance(device_error.value, NonFiniteError)
    assert str(device_error.value) == str(host_error.value)
    host.cancel()
    dev.cancel()
    run_both(host, dev, "onebit", torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), device)


def patched(payload: torch.Tensor, start: int, end: int | None, values) -> torch.Tensor:
    """A copy of ``payload`` with bytes ``[start:end]`` replaced by those of ``values``."""
    bad = payload.clone()
    bad[start:end] = torch.from_numpy(np.asarray(values).view(np.uint8))
    return bad


# payloads the host decoder refuses, made from a good one of the compressor's first
# example (numel 45), beyond the generic ones (one byte short, one byte over, every byte
# 0xff where the host refuses that)
SPECIFIC_BAD = {
    "onebit": lambda p, n: [
        *(patched(p, -4, None, np.array([s], np.float32)) for s in (np.inf, np.nan, -1.0)),
        patched(p, 4 * ((n + 31) // 32) - 4, 4 * ((n + 31) // 32) - 3,  # lowest padding bit
                np.array([int(p[4 * ((n + 31) // 32) - 4]) | 1], np.uint8))],
    "topk": lambda p, n: [
        *(patched(p, 0, 4, np.array([index], np.int32)) for index in (n, -1)),
        patched(p, -4, None, np.array([np.nan], np.float32))],
    "randomk": lambda p, n: [patched(p, -4, None, np.array([np.inf], np.float32))],
    "bytegrad": lambda p, n: [patched(p, 0, 8, np.array([2.0, 1.0], np.float32))],
    "dithering": lambda p, n: [patched(p, -8, None, np.array([np.nan])),
                               patched(p, -16, -8, np.array([1], np.uint64))],
}


def bad_payloads(name: str, payload: torch.Tensor, numel: int, host) -> list[torch.Tensor]:
    """Payloads the host decoder refuses, made from a good one."""
    cases = [payload[:-1].clone(), torch.cat([payload, payload[:1]])]
    ones = torch.full_like(payload, 0xFF)
    try:
        host.decompress(ones)
    except ValueError:
        cases.append(ones)
    return cases + SPECIFIC_BAD.get(name, lambda p, n: [])(payload, numel)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_bad_payloads_refused_as_the_host_does(make, name, device):
    numel = 45
    host = make(CASES[name], numel, torch.float32, None)
    dev = make(CASES[name], numel, torch.float32, device)
    payload = host.compress(gradients(numel, torch.float32, 1)[0])
    for bad in bad_payloads(name, payload, numel, host):
        with pytest.raises(ValueError) as expected:
            host.decompress(bad)
        with pytest.raises(ValueError) as got:
            dev.decompress(bad.to(device))
        assert str(got.value) == str(expected.value)
    with pytest.raises(ValueError, match="payload tensor must be 1-D torch.uint8"):
        dev.decompress(payload.float().to(device))
    with pytest.raises(ValueError, match="out must be"):
        dev.decompress(payload.to(device), out=torch.empty(numel + 1, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "reorder"), [("topk", True), ("randomk", False)])
def test_repeated_indices_decode_last_value(make, name, reorder, device):
    # randomk draws with replacement (k = numel: many repeats); a topk payload from
    # elsewhere may repeat and reorder indices: the last value of an index wins
    numel = 64
    params = {**CASES[name], "k": numel}
    host, dev = make(params, numel, torch.float32, None), make(params, numel, torch.float32,
                                                               device)
    payload = host.compress(gradients(numel, torch.float32, 1)[0])
    if reorder:  # topk's int32 indices come first
        indices = payload[: 4 * numel].view(torch.int32)
        indices.copy_(torch.arange(numel, dtype=torch.int32).flip(0) % 13)
    expected = host.decompress(payload)
    assert torch.equal(bits(expected), bits(dev.decompress(payload.to(device))))


@pytest.mark.parametrize("device", DEVICES)
def test_state_moves_between_host_and_device_chains(make, device):
    params = {**CASES["randomk"], "ef": "vanilla", "momentum": "nesterov", "mu": 0.5}
    numel = 200
    xs = gradients(numel, torch.float32, 4)
    host, dev = make(params, numel, torch.float32, None), make(params, numel, torch.float32,
                                                               device)
    dev.set_lr(0.5)
    dev.compress(xs[0].to(device))
    host.load_state_dict(dev.state_dict())  # device state into a host chain
    for step in (1, 2):
        host.set_lr(0.25)
        dev.set_lr(0.25)
        run_both(host, dev, "randomk", xs[step], device)
    fresh = make(params, numel, torch.float32, device)
    fresh.load_state_dict(host.state_dict())  # host state into a device chain
    for chain in (host, fresh):
        chain.set_lr(0.25)
    run_both(host, fresh, "randomk", xs[3], device)
    assert_same_state(host.state_dict(), fresh.state_dict())


def test_supports_device_and_refusals(monkeypatch):
    for params in CASES.values():
        assert supports_device(params)
    assert supports_device({"compressor": "powersgd", "rank": 1})
    register("host-only", lambda params, numel, dtype: TopK(numel, dtype, k=1))
    try:
        assert not supports_device({"compressor": "host-only"})
        with pytest.raises(TypeError, match="'host-only' has no torch kernels"):
            build({"compressor": "host-only"}, 10, device="meta")
        monkeypatch.setenv("BPS_DEVICE_KERNELS", "1")
        chain = build({"compressor": "host-only", "ef": "vanilla"}, 10)
        assert type(chain.inner) is TopK  # the switch keeps the host kernels there
    finally:
        unregister("host-only")
    server = build(CASES["topk"], 10, role="server")
    assert type(server) is TopK
    monkeypatch.setenv("BPS_DEVICE_KERNELS", "2")
    with pytest.raises(ValueError, match="BPS_DEVICE_KERNELS must be 0 or 1"):
        forced_by_env()


def test_input_on_another_device_refused(make):
    chain = make(CASES["topk"], 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="compress expects a 1-D torch.float32 tensor"):
        chain.compress(torch.zeros(9))
    with pytest.raises(ValueError, match="compress expects a CPU tensor, got meta"):
        chain.compress(torch.zeros(8, device="meta"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("decorators", ["bare", "ef+momentum"])
@pytest.mark.parametrize("name", NAMES)
def test_one_host_sync_per_compress_and_decompress(make, name, decorators):
    # a compressor whose payload comes back on the host (dithering: coded there) syncs
    # for it; with error feedback or momentum it reads their flags in a second
    params = {**CASES[name], **CHAINS[decorators]}
    numel = 1 << 16
    chain = make(params, numel, torch.float32, "cuda")
    xs = [x.cuda() for x in gradients(numel, torch.float32, 3)]
    chain.set_lr(0.1)
    payload = chain.compress(xs[0])  # buffers made, kernels loaded
    out = torch.empty(numel, device="cuda")
    chain.decompress(payload.to("cuda"), out=out)
    torch.cuda.synchronize()
    for x in xs[1:]:
        chain.set_lr(0.1)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                payload = chain.compress(x)
            payload_on_host = payload.device.type == "cpu"
            compress_syncs = [w for w in caught if "synchroniz" in str(w.message)]
            torch.cuda.set_sync_debug_mode("default")
            payload = payload.to("cuda")  # dithering's is on the host: the engine copies it
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                chain.decompress(payload, out=out)
            decompress_syncs = [w for w in caught if "synchroniz" in str(w.message)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        allowed = 2 if decorators != "bare" and payload_on_host else 1
        assert len(compress_syncs) <= allowed, [str(w.message) for w in compress_syncs]
        assert len(decompress_syncs) <= 1, [str(w.message) for w in decompress_syncs]


def assert_powersgd_close(host: torch.Tensor, device: torch.Tensor, where: str) -> None:
    """Exact on the CPU; within POWERSGD_RTOL of the largest magnitude on a GPU."""
    device = device.cpu()
    if where == "cpu":
        assert torch.equal(bits(host), bits(device))
    else:
        host, device = host.view(torch.float32), device.view(torch.float32)
        scale = float(host.abs().max()) or 1.0
        assert float((host - device).abs().max()) <= POWERSGD_RTOL * scale


def powersgd_step(chain, x: torch.Tensor, workers: int = 2) -> tuple:
    """One step of ``workers`` identical workers: (round 0, round 1, decoded) payloads."""
    where = chain.device
    p = chain.compress(x.to(where))
    q = chain.compress_round(1, p.view(torch.float32) * workers)
    out = torch.empty(x.numel(), device=where)
    assert chain.decompress(q.view(torch.float32) * workers, out) is out
    return p, q, out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [
    {"rank": 1}, {"rank": 2, "warm_start": False}, {"rank": 3, "ef": None},
    {"rank": 2, "orthogonalization_epsilon": 1e-8}], ids=["r1", "r2-cold", "r3-no-ef", "eps"])
def test_powersgd_matches_host(make, options, device):
    params = {"compressor": "powersgd", "ef": "vanilla", "shape": [30, 20], **options}
    host, dev = make(params, 600, torch.float32, None), make(params, 600, torch.float32,
                                                             device)
    assert type(dev).__name__ == "PowerSGDTorch"
    for chain in (host, dev):
        chain.set_workers(2)
    for step, x in enumerate(gradients(600, torch.float32, 5)):
        if step == 2:  # refused with nothing changed
            before = copy.deepcopy(host.state_dict())
            for chain in (host, dev):
                with pytest.raises(NonFiniteError):
                    chain.compress(poisoned(x).to(chain.device))
                assert_same_state(before, chain.state_dict())
        if step == 3:  # a step rolled back
            before = copy.deepcopy(host.state_dict())
            for chain in (host, dev):
                powersgd_step(chain, x)
                chain.rollback()
                assert_same_state(before, chain.state_dict())
        for a, b in zip(powersgd_step(host, x), powersgd_step(dev, x), strict=True):
            assert_powersgd_close(a, b, device)
        if device == "cpu":
            assert_same_state(host.state_dict(), dev.state_dict())
        else:
            dev.load_state_dict(host.state_dict())  # no drift from rounding


@pytest.mark.parametrize("module", ["device", "onebit_torch", "topk_torch", "randomk_torch",
                                    "bytegrad_torch", "powersgd_torch", "dithering_torch"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(f"bps.compressors.{module}"))
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_powersgd_syncs_once_per_step(make):
    params = {"compressor": "powersgd", "rank": 2, "ef": "vanilla", "shape": [300, 200]}
    chain = make(params, 60000, torch.float32, "cuda")
    xs = [x.cuda() for x in gradients(60000, torch.float32, 3)]
    powersgd_step(chain, xs[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            powersgd_step(chain, xs[1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, syncs  # the non-finite check of round 0


FIRST_QR_IN_THREADS = """
import sys, threading, torch
from bps.compressors import build
device, errors = sys.argv[1], []
barrier = threading.Barrier(8)
def codec_thread():
    barrier.wait()  # every thread builds and runs its chain at once, as codec threads do
    try:
        chain = build({"compressor": "powersgd", "rank": 4, "shape": [64, 32]}, 2048,
                      device=device)
        q = chain.compress_round(1, chain.compress(torch.randn(2048, device=device)))
        assert q.numel() == 32 * 4 * 4, q.numel()
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=codec_thread) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors or "ok")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_codec_threads_make_their_first_qr_together():
    """torch loads its CUDA linalg library on the first linalg call, and two threads making
    that call at once fail ("lazy wrapper should be called at most once"): a fresh process,
    so that nothing has loaded it yet."""
    done = subprocess.run([sys.executable, "-c", FIRST_QR_IN_THREADS, "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
