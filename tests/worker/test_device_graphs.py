"""Device chains replayed from CUDA graphs: the same payloads and state as running eagerly.

The CPU tests check which chains may be replayed and the split of ``encode`` that a
replay relies on; the ``cuda`` test runs graphed chains against eager ones on a GPU.
"""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch

from bps.compressors import build, description, registered_names, supports_device
from bps.compressors.base import NonFiniteError
from bps.compressors.device import OK, TorchKernels
from bps.worker.device_graphs import KeyGraphs, enabled_by_env
from bps.worker.device_path import KeyStaging
from tests.harness.chain_state import assert_same_state
from tests.harness.graph_replay import RecordedGraphs


@pytest.fixture
def device_chain(monkeypatch):
    def make(params: dict, numel: int, dtype=torch.float32, device: str = "cpu"):
        monkeypatch.setenv("BPS_DEVICE_KERNELS", "1" if device == "cpu" else "0")
        return build(params, numel, dtype, device=device)
    return make


ONEBIT = {"compressor": "onebit", "scaling": True, "ef": "vanilla"}
GRAPHED = {
    "onebit": ONEBIT,
    "topk": {"compressor": "topk", "k": 0.05, "ef": "vanilla"},
    "bytegrad": {"compressor": "bytegrad", "chunk": 64, "ef": "vanilla"},
    "topk+momentum": {"compressor": "topk", "k": 0.05, "ef": "vanilla",
                      "momentum": "nesterov", "mu": 0.9},
}


def on_cuda(test):
    """Marked ``cuda``, and skipped without a CUDA device."""
    needs = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.cuda(needs(test))


def cuda_pair(name: str, make) -> tuple:
    """Two chains of ``GRAPHED[name]`` on the GPU and a staging with graphs on."""
    numel = 4000
    return (numel, make(GRAPHED[name], numel, device="cuda"),
            make(GRAPHED[name], numel, device="cuda"),
            KeyStaging(torch.device("cuda"), cuda_graphs=True, name=name))


def test_the_switch_is_0_or_1():
    assert enabled_by_env({}) and not enabled_by_env({"BPS_CUDA_GRAPHS": "0"})
    with pytest.raises(ValueError, match="BPS_CUDA_GRAPHS must be 0 or 1, got 'yes'"):
        enabled_by_env({"BPS_CUDA_GRAPHS": "yes"})


@pytest.mark.parametrize("params", [
    {"compressor": "randomk", "k": 0.1, "seed": 3, "ef": "vanilla"},  # host draws
    {"compressor": "dithering", "k": 4, "seed": 3},                     # host coding
], ids=["randomk", "dithering"])
def test_chains_that_cannot_be_replayed_say_so(device_chain, params):
    assert device_chain(params, 100).graph_key() is None


@pytest.mark.parametrize("name", ["onebit", "topk", "bytegrad"])
def test_bare_compressors_are_replayed_with_nothing_baked_in(device_chain, name):
    params = {k: v for k, v in GRAPHED[name].items() if k != "ef"}
    assert device_chain(params, 100).graph_key() == ()


def test_error_feedback_over_a_decorator_is_not_replayed(device_chain):
    # it decodes its inner chain's payload after encoding it: a host sync in the kernels
    from bps.compressors.error_feedback import ErrorFeedback
    from bps.compressors.momentum import Momentum
    from bps.compressors.onebit_torch import OneBitTorch
    inner = Momentum(OneBitTorch(100, torch.float32, scaling=True, device="cpu"), 0.9)
    assert inner.graph_key() is not None
    assert ErrorFeedback(inner).graph_key() is None


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the host chain's
@pytest.mark.parametrize("chain", ["ef", "momentum"])
def test_a_ratio_or_decay_beyond_float32_is_refused_as_the_host_refuses(device_chain, chain):
    # lr_prev / lr_now = 1e39 (or a momentum scale of 1e39): inf in float32, so g' has
    # inf or NaN and both chains refuse the step, changing nothing
    params = ONEBIT if chain == "ef" else GRAPHED["topk+momentum"]
    host = build(params, 64, torch.float32)
    device = device_chain(params, 64)
    staging = KeyStaging(torch.device("cpu"))
    x = torch.randn(64)
    for c in (host, device):
        c.set_lr(1.0)
    host.compress(x)
    payload, status = staging.encode(device, x)
    device.commit()
    for c in (host, device):
        c.set_lr(1e-39)
        c.scale_momentum(1e39 if chain == "momentum" else 1.0)
    with pytest.raises(NonFiniteError):
        host.compress(x)
    payload, status = staging.encode(device, x)
    assert status.tolist()[0] != OK
    device.discard()


@pytest.mark.parametrize("params", [ONEBIT, GRAPHED["topk+momentum"]], ids=["ef", "momentum"])
def test_float16_decorators_are_not_replayed(device_chain, params):
    # their ratio and decay round as float32 scalars, which float16 device scalars would not
    assert device_chain(params, 100, torch.float16).graph_key() is None


@pytest.mark.parametrize("name", GRAPHED)
def test_error_feedback_alternates_between_two_graph_keys(device_chain, name):
    chain = device_chain(GRAPHED[name], 200)
    keys = []
    for step in range(4):
        chain.set_lr(0.1 * (step + 1))  # the ratio changes: not part of the key
        keys.append(chain.graph_key())
        payload, status = chain.encode(torch.randn(200))
        assert status.tolist()[0] == OK
        chain.commit()
    assert keys[0] != keys[1] and keys[0] == keys[2] and keys[1] == keys[3]


@pytest.mark.parametrize("name", GRAPHED)
def test_prepare_then_kernels_is_encode(device_chain, name):
    # a replay runs prepare() in Python and the kernels from the graph: the ratio must
    # reach them through the device scalar that prepare writes
    eager, split = device_chain(GRAPHED[name], 300), device_chain(GRAPHED[name], 300)
    gen = torch.Generator().manual_seed(5)
    for lr, scale in ((0.5, 1.0), (0.2, 0.5), (0.3, 1.0)):
        x = torch.randn(300, generator=gen)
        for chain in (eager, split):
            chain.set_lr(lr)
            chain.scale_momentum(scale)  # a loss scale's change: the decay is mu * scale
        a, _ = eager.encode(x)
        split.prepare()
        b, _ = split.encode_kernels(x)
        assert torch.equal(a, b)
        eager.commit()
        split.commit()
        assert_same_state(eager.state_dict(), split.state_dict())


def test_the_ratio_and_decay_reach_the_kernels_as_device_scalars(device_chain):
    chain = device_chain(GRAPHED["topk+momentum"], 300)
    chain.set_lr(0.5)
    chain.encode(torch.randn(300))
    chain.commit()
    chain.set_lr(0.25)
    chain.scale_momentum(0.5)
    chain.prepare()
    assert float(chain.inner.ratio_on_device) == 2.0  # lr_prev / lr_now
    assert float(chain.decay) == pytest.approx(0.45)  # mu * scale, in float32
    assert chain.factor == 1.0  # used up by this step


def test_on_the_cpu_nothing_is_captured(device_chain):
    chain = device_chain(ONEBIT, 64)
    staging = KeyStaging(torch.device("cpu"), cuda_graphs=True, name="w")
    assert not staging.encode_graphs.enabled  # CUDA graphs need a CUDA device
    chain.set_lr(0.1)
    payload, status = staging.encode(chain, torch.randn(64))
    assert staging.encode_graphs.captures == 0 and payload.numel() == 12


def staged_step(encode, chain, x):
    """What the codec thread does: encode, read the status, commit, or discard and
    cancel; the payload copied (a graph's output is overwritten by its next replay)."""
    payload, status = encode(x)
    if status.tolist()[0] != OK:
        chain.discard()
        chain.cancel()
        return None
    chain.commit()
    return payload.clone()


@on_cuda
@pytest.mark.parametrize("name", GRAPHED)
def test_graphs_give_the_eager_payloads_and_state(device_chain, name):
    numel, eager, graphed, staging = cuda_pair(name, device_chain)
    side = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(3)
    with torch.cuda.stream(side):
        for step in range(9):
            x = (torch.randn(numel, generator=gen) * 3).cuda()
            if step == 5:
                x[7] = torch.nan  # refused by both: nothing changes
            lr = [0.5, 0.4, 0.4, 0.1, 0.3, 0.3, 0.2, 0.6, 0.6][step]
            before = copy.deepcopy(graphed.state_dict())  # a rollback undoes set_lr too
            eager.set_lr(lr)
            graphed.set_lr(lr)
            a = staged_step(eager.encode, eager, x)
            b = staged_step(lambda x: staging.encode(graphed, x), graphed, x)
            assert (a is None) == (b is None) == (step == 5), step
            if a is not None:
                assert torch.equal(a, b), f"{name}: step {step}: payloads differ"
            if step == 6:  # rolled back, then done again
                eager.rollback()
                graphed.rollback()
                assert_same_state(graphed.state_dict(), before)
                eager.set_lr(lr)
                graphed.set_lr(lr)
                a = staged_step(eager.encode, eager, x)
                b = staged_step(lambda x: staging.encode(graphed, x), graphed, x)
                assert torch.equal(a, b), f"{name}: step {step} again: payloads differ"
            assert_same_state(eager.state_dict(), graphed.state_dict())
    graphs = staging.encode_graphs
    assert graphs.enabled and graphs.captures == 2 and graphs.replays >= 6


def aggregates(chain, numel: int, steps: int) -> list[torch.Tensor]:
    """Payloads as a server sends them: a topk one with repeated, unordered indices."""
    gen = torch.Generator().manual_seed(9)
    payloads = []
    for _ in range(steps):
        chain.set_lr(0.1)
        payload = chain.compress(torch.randn(numel, generator=gen).to(chain.device))
        payloads.append(payload.cpu().clone())
    if "TopK" in type(chain.inner).__name__:
        k = chain.inner.k
        indices = payloads[-1][: 4 * k].view(torch.int32)
        indices[0], indices[1] = indices[1].clone(), indices[1].clone()  # repeat, not ascending
    return payloads


def frames_of(payload: torch.Tensor) -> list[bytes]:
    data = payload.numpy().tobytes()
    return [data[:5], data[5:]]  # a reply in two frames


# every described compressor with torch kernels (its first example with error feedback),
# GRAPHED's cases for those it has
DECODED = {**{name: {"compressor": name, **description(name).examples[0], "ef": "vanilla"}
              for name in registered_names() if not description(name).payloads_sum
              and supports_device({"compressor": name, **description(name).examples[0]})},
           **GRAPHED}


def decodes_in_graphs(chain) -> bool:
    """Whether the chain's compressor checks payloads on the host (``decode_key``), so
    that its decodes can be captured (randomk: its indices drawn on the host too;
    dithering: decoded there, its values copied on the device; not terngrad)."""
    while hasattr(chain, "inner"):
        chain = chain.inner
    return type(chain).decode_key is not TorchKernels.decode_key


@pytest.mark.parametrize("name", DECODED)
def test_staged_decode_is_decompress(device_chain, name):
    numel = 300
    params = DECODED[name]
    chain = device_chain(params, numel)
    staging = KeyStaging(torch.device("cpu"), name=name)
    for payload in aggregates(device_chain(params, numel), numel, 3):
        expected = chain.decompress(payload.clone())
        out = torch.full((numel,), 5.0)
        assert staging.decode(chain, frames_of(payload), out) is out
        assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
        assert torch.equal(staging.decode(chain, frames_of(payload), None), expected)


@pytest.mark.parametrize("name", GRAPHED)
def test_staged_decode_refuses_what_decompress_refuses(device_chain, name):
    numel = 300
    chain = device_chain(GRAPHED[name], numel)
    payload = aggregates(device_chain(GRAPHED[name], numel), numel, 1)[0]
    broken = {"onebit": lambda p: p[-4:].copy_(torch.tensor([-1.0]).view(torch.uint8)),
              "topk": lambda p: p[:4].copy_(torch.tensor([numel]).int().view(torch.uint8)),
              "bytegrad": lambda p: p[:4].copy_(torch.tensor([9.0]).view(torch.uint8))}
    bad = payload.clone()
    broken[name.split("+")[0]](bad)
    with pytest.raises(ValueError) as refused:
        chain.decompress(bad.clone())
    with pytest.raises(ValueError, match=re.escape(str(refused.value))):
        KeyStaging(torch.device("cpu")).decode(chain, frames_of(bad), torch.empty(numel))
    with pytest.raises(ValueError, match="expected exactly"):
        KeyStaging(torch.device("cpu")).decode(chain, frames_of(payload[:-1]), None)


@on_cuda
@pytest.mark.parametrize("name", GRAPHED)
def test_graphed_decode_is_decompress(device_chain, name):
    numel, chain, sender, staging = cuda_pair(name, device_chain)
    payloads = aggregates(sender, numel, 6)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for payload in payloads:
            expected = chain.decompress(payload.cuda())
            out = torch.full((numel,), 5.0, device="cuda")
            staging.decode(chain, frames_of(payload), out)
            side.synchronize()
            assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    graphs = staging.decode_graphs
    assert graphs.enabled and graphs.captures >= 1 and graphs.replays >= 3


@on_cuda
def test_codec_threads_never_share_a_side_stream():
    # a graph captures whatever runs on its stream: two codec threads on one would mix
    import threading

    from bps.worker.device_path import _side_stream, _taken
    handles, together = [], threading.Barrier(12)

    def codec_thread() -> None:
        handles.append(_side_stream(torch.device("cuda", 0)).cuda_stream)
        together.wait(timeout=30)  # all alive at once, each holding its stream

    for _ in range(3):  # streams of ended threads are free again
        threads = [threading.Thread(target=codec_thread) for _ in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(set(handles[-12:])) == 12
    assert not _taken.intersection(handles)


REPLAYED = {
    **GRAPHED,
    "onebit+momentum": {"compressor": "onebit", "scaling": True, "ef": "vanilla",
                        "momentum": "nesterov", "mu": 0.9},
    "bytegrad+momentum": {"compressor": "bytegrad", "chunk": 64, "ef": "vanilla",
                          "momentum": "nesterov", "mu": 0.9},
    "onebit-unscaled+momentum": {"compressor": "onebit", "momentum": "nesterov", "mu": 0.5},
}


def step_both(eager, replayed, staging, x, lr: float, scale: float):
    """One codec-thread step of each chain; their payloads (None where refused)."""
    payloads = []
    for chain, encode in ((eager, eager.encode),
                          (replayed, lambda x: staging.encode(replayed, x))):
        chain.set_lr(lr)
        chain.scale_momentum(scale)
        payloads.append(staged_step(encode, chain, x))
    return payloads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", REPLAYED)
def test_replays_give_the_eager_bytes_whatever_the_steps(device_chain, name, dtype):
    # kernels recorded once and replayed without Python (tests/harness/graph_replay.py)
    # against the same chain run eagerly: learning rates and loss scales that change,
    # refused steps, rollbacks, checkpoints loaded, skipped steps
    rng = random.Random(name)
    gen = torch.Generator().manual_seed(4)
    numel = 257
    eager, replayed = device_chain(REPLAYED[name], numel, dtype), \
        device_chain(REPLAYED[name], numel, dtype)
    staging = KeyStaging(torch.device("cpu"))
    staging.encode_graphs = RecordedGraphs(name)
    saved = None
    for step in range(30):
        x = (torch.randn(numel, generator=gen) * rng.choice([1, 3, 100])).to(dtype)
        if rng.random() < 0.1:
            x[rng.randrange(numel)] = float("nan")
        a, b = step_both(eager, replayed, staging, x, rng.choice([0.1, 0.3, 0.7, 1.3]),
                         rng.choice([1.0, 1.0, 0.5, 2.0]))
        assert (a is None) == (b is None), step
        assert a is None or torch.equal(a, b), f"step {step}: payloads differ"
        assert_same_state(eager.state_dict(), replayed.state_dict())
        event = rng.random()
        if event < 0.15 and a is not None:
            eager.rollback()
            replayed.rollback()
        elif event < 0.25:
            saved = copy.deepcopy(eager.state_dict())
        elif event < 0.35 and saved is not None:
            eager.load_state_dict(copy.deepcopy(saved))
            replayed.load_state_dict(copy.deepcopy(saved))
        elif event < 0.4:  # a step the chains skip (warm-up, a marker): set_lr undone
            for chain in (eager, replayed):
                chain.set_lr(0.2)
                chain.cancel()
    graphs = staging.encode_graphs
    assert graphs.enabled and 2 <= graphs.captures <= 4 and graphs.replays >= 15


def test_a_python_number_baked_into_the_kernels_is_caught(device_chain, monkeypatch):
    # the stand-in is strict: error feedback reading its ratio as a Python number
    # (as before it had a device scalar) gives other bytes once the ratio changes
    from bps.compressors.error_feedback import ErrorFeedback
    monkeypatch.setattr(ErrorFeedback, "prepare",
                        lambda self: (setattr(self, "undo", None), self.inner.prepare()))
    eager, replayed = device_chain(ONEBIT, 64), device_chain(ONEBIT, 64)
    staging = KeyStaging(torch.device("cpu"))
    staging.encode_graphs = RecordedGraphs("baked")
    gen = torch.Generator().manual_seed(1)
    differ = False
    for lr in (0.5, 0.5, 0.5, 0.1, 0.9, 0.3):
        a, b = step_both(eager, replayed, staging, torch.randn(64, generator=gen), lr, 1.0)
        differ |= not torch.equal(a, b)
    assert differ


@pytest.mark.parametrize("name", DECODED)
def test_replayed_decodes_are_decompress(device_chain, name):
    numel = 300
    params = DECODED[name]
    chain = device_chain(params, numel)
    staging = KeyStaging(torch.device("cpu"))
    staging.decode_graphs = RecordedGraphs(name)
    for payload in aggregates(device_chain(params, numel), numel, 5):
        expected = chain.decompress(payload.clone())
        out = torch.full((numel,), 5.0)
        staging.decode(chain, frames_of(payload), out)
        assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    replays = staging.decode_graphs.replays
    assert replays >= 2 if decodes_in_graphs(chain) else replays == 0


def launches(x: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` small kernels: a capture long enough for another thread to run into."""
    for _ in range(count):
        x = x + 1
    return x


@on_cuda
def test_a_capture_leaves_random_numbers_to_the_other_threads():
    # torch marks the generator state registered with a capture "capturing" until it
    # ends: were it the shared state, a draw on another thread while the capture records
    # its kernels would fail. The capturing thread waits, mid-recording, for the main
    # thread's draws.
    import threading
    graphs = KeyGraphs(enabled=True, name="w")
    x = torch.zeros(16, device="cuda")
    side = torch.cuda.Stream()
    recording, drawn, failures = threading.Event(), threading.Event(), []

    def kernels(v: torch.Tensor) -> torch.Tensor:
        v = launches(v, 50)
        recording.set()
        assert drawn.wait(timeout=30), "the main thread never drew"
        return launches(v, 50)

    def capture() -> None:
        try:
            with torch.cuda.stream(side):
                graphs.record(kernels, (x,))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        finally:
            recording.set()

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        assert recording.wait(timeout=30)
        masked = torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.5)
        drawn_values = torch.rand(8, device="cuda")
    finally:
        drawn.set()
        thread.join(timeout=60)
    assert not failures, failures
    assert 1000 < int((masked == 0).sum()) < 3096  # a real mask, drawn
    assert bool(((drawn_values >= 0) & (drawn_values < 1)).all())


@on_cuda
def test_after_a_failed_capture_the_device_is_usable_and_graphs_capture_again():
    # a host sync fails the capture; its pool is handed back through the handle taken
    # before it (the graph's own pool() raises by then)
    staging = KeyStaging(torch.device("cuda"), cuda_graphs=True, name="w")
    graphs = staging.encode_graphs
    side = torch.cuda.Stream()
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    with torch.cuda.stream(side):
        assert torch.equal(graphs.run((), (x,), lambda v: v * float(v.sum())), x * 28)
        assert torch.equal(graphs.run((), (x,), lambda v: v * float(v.sum())), x * 28)
        assert not graphs.enabled  # the second run captured, and failed
        y = torch.full((4,), 2.0, device="cuda")  # allocations work after it
        fresh = KeyGraphs(enabled=True, name="v", pool=torch.cuda.graph_pool_handle())
        for value in (1.0, 2.0, 3.0):
            out = fresh.run((), (y * value,), lambda v: v * 3)
            assert out.tolist() == [6.0 * value] * 4
    assert fresh.enabled and fresh.captures == 1 and fresh.replays == 2


def test_a_failed_capture_runs_eagerly_from_then_on():
    calls = []

    class Failing(KeyGraphs):
        def record(self, fn, inputs):
            raise RuntimeError("operation not permitted when stream is capturing")

    graphs = Failing(enabled=True, name="w")
    x = torch.arange(4.0)
    for _ in range(3):
        assert torch.equal(graphs.run((), (x,), lambda v: calls.append(1) or v * 2), x * 2)
    assert len(calls) == 3 and not graphs.enabled and graphs.captures == 0
