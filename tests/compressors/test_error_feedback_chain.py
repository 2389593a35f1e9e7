"""The EF / Nesterov chain against the reference, state round-trips, wire, registry."""

import doctest
import importlib
import os

import msgpack
import numpy as np
import pytest
import torch

from bps.compressors import (
    Compressor,
    ErrorFeedback,
    Momentum,
    build,
    description,
    register,
    registered_names,
    state_from_wire,
    state_to_wire,
    unregister,
)
from bps.compressors.base import NonFiniteError
from tests.harness import reference_compressors as ref
from tests.harness.paths import ROOT
from tests.harness.reference_compressors import ref_codec
from tests.harness.samples import DTYPES, as_values, payload_of, sample

LRS = [0.1, 0.1, 0.05, 0.05, 0.2, 0.01]


# every described example of each compressor whose payloads are decoded one by one
CHAIN_PARAMS = [{"compressor": name, **example} for name in registered_names()
                if not description(name).payloads_sum for example in description(name).examples]


def compare_payload(mine: bytes, theirs: bytes, params: dict) -> None:
    if description(params["compressor"]).tolerance == "scale_ulp":
        # the float32 scale (the last 4 bytes) may differ by the float64 sum order
        assert mine[:-4] == theirs[:-4]
        np.testing.assert_allclose(np.frombuffer(mine[-4:], "<f4"),
                                   np.frombuffer(theirs[-4:], "<f4"), rtol=2e-7)
    else:
        assert mine == theirs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", CHAIN_PARAMS, ids=lambda p: p["compressor"])
@pytest.mark.parametrize("role", ["worker", "server"])
def test_chain_matches_reference_over_steps_with_changing_lr(params, dtype, role):
    told = description(params["compressor"])
    numel = 97 if told.ties else 40  # without defined ties: distinct magnitudes
    full = dict(params, ef="vanilla", momentum="nesterov", mu=0.9)
    chain = build(full, numel, ref.TORCH_DTYPE[dtype], role=role)
    assert isinstance(chain, Momentum if role == "worker" else ErrorFeedback)
    encode, decode = ref_codec(params, numel, dtype)
    ulp_scale = told.tolerance == "scale_ulp"
    if ulp_scale:  # the reference must use our scale (1-ulp sums)
        scales, encode_with = [], encode
        encode = lambda x: encode_with(x, scale=scales[-1])  # noqa: E731
    mine = ref.RefChain(encode, decode, numel, dtype, ef=True,
                        mu=0.9 if role == "worker" else None)
    for step, lr in enumerate(LRS):
        x = sample(numel, dtype, seed=100 + step, distinct=not told.ties)
        chain.set_lr(lr)
        mine.set_lr(lr)
        payload = payload_of(chain.compress(x))
        if ulp_scale:
            scales.append(float(np.frombuffer(payload[-4:], "<f4")[0]))
        compare_payload(payload, mine.compress(as_values(x)), params)
        error = chain.error if role == "server" else chain.inner.error
        np.testing.assert_array_equal(as_values(error), mine.error, err_msg=f"step {step}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("momentum", [True, False], ids=["nesterov", "ef"])
@pytest.mark.parametrize("compressor", [{"compressor": "onebit", "scaling": True},
                                        {"compressor": "topk", "k": 0.25}],
                         ids=lambda p: p["compressor"])
def test_a_divided_input_matches_the_reference_on_the_quotient(compressor, momentum, dtype):
    # the worker's average over nodes, divided in the chain's first pass: the reference
    # divides first (rounded to the dtype), then runs the chain on the quotient
    numel, divisor = 96, 3.0
    full = dict(compressor, ef="vanilla", **({"momentum": "nesterov", "mu": 0.9}
                                            if momentum else {}))
    chain = build(full, numel, ref.TORCH_DTYPE[dtype])
    assert chain.divides_input
    encode, decode = ref_codec(compressor, numel, dtype)
    scales, encode_with = [], encode
    if description(compressor["compressor"]).tolerance == "scale_ulp":
        encode = lambda x: encode_with(x, scale=scales[-1])  # noqa: E731
    mine = ref.RefChain(encode, decode, numel, dtype, ef=True,
                        mu=0.9 if momentum else None)
    for step, lr in enumerate(LRS):
        x = sample(numel, dtype, seed=300 + step, distinct=True)
        chain.set_lr(lr)
        mine.set_lr(lr)
        chain.divide_input(divisor)
        payload = payload_of(chain.compress(x))
        scales.append(float(np.frombuffer(payload[-4:], "<f4")[0]))
        quotient = ref.round_to(as_values(x) / divisor, dtype)
        compare_payload(payload, mine.compress(quotient), compressor)
        error = chain.inner.error if momentum else chain.error
        np.testing.assert_array_equal(as_values(error), mine.error, err_msg=f"step {step}")
        if momentum:
            np.testing.assert_array_equal(as_values(chain.momentum), mine.momentum)


@pytest.mark.parametrize(("numel", "scaling", "dtype"), [
    *[(97, scaling, dtype) for scaling in (True, False) for dtype in ("float32", "float64")],
    ((1 << 21) + 40, True, "float32"),  # two chunks: the same kernel on each (2 s)
])
def test_onebit_builds_the_error_feedback_input_in_its_kernel_as_the_reference(
        numel, scaling, dtype):
    # error feedback alone around onebit: g' is built in onebit's kernel call, not in
    # error feedback's pass (on two threads where the partition spans two chunks)
    params = {"compressor": "onebit", "scaling": scaling}
    chain = build(dict(params, ef="vanilla"), numel, ref.TORCH_DTYPE[dtype])
    assert chain.error_in_pass
    encode, decode = ref_codec(params, numel, dtype)
    scales, encode_with = [], encode
    mine = ref.RefChain(lambda x: encode_with(x, scale=scales[-1]), decode, numel, dtype,
                        ef=True, mu=None)
    for step, lr in enumerate(LRS[:4]):
        x = sample(numel, dtype, seed=500 + step)
        chain.set_lr(lr)
        mine.set_lr(lr)
        payload = payload_of(chain.compress(x))
        scales.append(float(np.frombuffer(payload[-4:], "<f4")[0]))
        compare_payload(payload, mine.compress(as_values(x)), params)
        np.testing.assert_array_equal(as_values(chain.error), mine.error, err_msg=f"step {step}")


def test_onebit_refuses_a_non_finite_input_with_nothing_changed():
    chain, twin = (build({"compressor": "onebit", "scaling": True, "ef": "vanilla"}, 40)
                   for _ in range(2))
    for c, lr in ((chain, 0.1), (twin, 0.1), (chain, 0.05), (twin, 0.05)):
        c.set_lr(lr)
        c.compress(sample(40, "float32", seed=7))
    chain.set_lr(0.2)
    with pytest.raises(NonFiniteError):
        chain.compress(torch.tensor([1.0, float("nan")] + [0.0] * 38))
    assert torch.equal(chain.error, twin.error)
    for c in (chain, twin):  # the refused step's learning rate is forgotten
        c.set_lr(0.2)
    x = sample(40, "float32", seed=8)
    assert payload_of(chain.compress(x)) == payload_of(twin.compress(x))
    assert torch.equal(chain.error, twin.error)


def test_a_refused_divided_input_changes_nothing_and_the_next_is_not_divided():
    chain = build({"compressor": "topk", "k": 0.5, "ef": "vanilla", "momentum": "nesterov",
                   "mu": 0.9}, 4)
    twin = build({"compressor": "topk", "k": 0.5, "ef": "vanilla", "momentum": "nesterov",
                  "mu": 0.9}, 4)
    for c in (chain, twin):
        c.set_lr(0.1)
        c.compress(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    chain.set_lr(0.1)
    chain.divide_input(2.0)
    with pytest.raises(NonFiniteError):
        chain.compress(torch.tensor([1.0, float("inf"), 0.0, 0.0]))
    chain.cancel()
    x = torch.tensor([0.25, 1.0, -4.0, 2.0])
    for c in (chain, twin):
        c.set_lr(0.1)
    assert payload_of(chain.compress(x)) == payload_of(twin.compress(x))
    assert torch.equal(chain.momentum, twin.momentum)
    assert torch.equal(chain.inner.error, twin.inner.error)


def test_only_host_kernel_chains_divide_their_input():
    half = build({"compressor": "onebit", "ef": "vanilla"}, 8, torch.float16)
    assert not half.divides_input
    with pytest.raises(TypeError, match="cannot divide"):
        half.divide_input(2.0)
    assert not build({"compressor": "onebit"}, 8).divides_input  # no decorator
    assert not build({"compressor": "topk", "k": 0.5, "momentum": "nesterov", "mu": 0.9},
                     8).divides_input  # momentum without error feedback


@pytest.mark.parametrize("dtype", DTYPES)
def test_momentum_without_error_feedback_matches_reference(dtype):
    # with error feedback, Nesterov's pass also builds g' (the test above); without it
    # the inner compressor gets the lookahead tensor
    params = {"compressor": "topk", "k": 0.1}
    chain = build(dict(params, momentum="nesterov", mu=0.9), 40, ref.TORCH_DTYPE[dtype])
    assert isinstance(chain, Momentum) and not isinstance(chain.inner, ErrorFeedback)
    encode, decode = ref_codec(params, 40, dtype)
    mine = ref.RefChain(encode, decode, 40, dtype, ef=False, mu=0.9)
    for step, lr in enumerate(LRS):
        x = sample(40, dtype, seed=200 + step, distinct=True)
        chain.set_lr(lr)
        assert payload_of(chain.compress(x)) == mine.compress(as_values(x)), f"step {step}"
        np.testing.assert_array_equal(as_values(chain.momentum), mine.momentum)


def test_error_feedback_lr_ratio_rule():
    chain = build({"compressor": "topk", "k": 1, "ef": "vanilla"}, 2)
    assert chain.ratio == 1.0
    chain.set_lr(0.5)
    assert chain.ratio == 1.0
    chain.set_lr(0.5)
    assert chain.ratio == 1.0
    chain.set_lr(0.25)
    assert chain.ratio == 2.0
    chain.compress(torch.tensor([1.0, 0.5]))  # error [0, 0.5]
    chain.set_lr(0.25)
    torch.testing.assert_close(chain.compress(torch.tensor([0.0, 0.0])),
                               build({"compressor": "topk", "k": 1}, 2)
                               .compress(torch.tensor([0.0, 0.5])))
    with pytest.raises(ValueError, match="learning rate"):
        chain.set_lr(0.0)


def test_momentum_needs_mu_and_server_chain_has_none():
    params = {"compressor": "onebit", "momentum": "nesterov", "ef": "vanilla"}
    with pytest.raises(ValueError, match="mu"):
        build(params, 10)
    assert isinstance(build(params, 10, role="server"), ErrorFeedback)
    with pytest.raises(ValueError, match="role"):
        build(dict(params, mu=0.5), 10, role="client")
    with pytest.raises(ValueError, match="compressor"):
        build({"ef": "vanilla"}, 10)


@pytest.mark.parametrize("params", CHAIN_PARAMS, ids=lambda p: p["compressor"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_round_trip_continues_bit_identically(params, dtype):
    torch_dtype = ref.TORCH_DTYPE[dtype]
    full = dict(params, ef="vanilla", momentum="nesterov", mu=0.8)
    original = build(full, 300, torch_dtype)
    for step in range(3):
        original.set_lr(0.1 / (step + 1))
        original.compress(sample(300, dtype, seed=step))
    wire = msgpack.unpackb(msgpack.packb(state_to_wire(original.state_dict())))
    restored = build(full, 300, torch_dtype)
    restored.load_state_dict(state_from_wire(wire))
    for step in range(3, 6):
        x = sample(300, dtype, seed=step)
        for chain in (original, restored):
            chain.set_lr(0.1 / (step + 1))
        assert torch.equal(original.compress(x), restored.compress(x))


def test_load_state_dict_rejects_mismatches():
    chain = build({"compressor": "randomk", "k": 2, "ef": "vanilla"}, 10)
    state = chain.state_dict()
    with pytest.raises(ValueError, match="error"):
        chain.load_state_dict(dict(state, error=torch.zeros(11)))
    with pytest.raises(ValueError, match="keys"):
        chain.load_state_dict({"error": state["error"]})
    with pytest.raises(ValueError, match="rng"):
        chain.load_state_dict(dict(state, inner={"rng": [1, -1]}))
    with pytest.raises(ValueError, match="dtype"):
        state_from_wire({"__tensor__": "int8", "shape": [1], "data": b"\0"})
    with pytest.raises(ValueError, match="bytes"):
        state_from_wire({"__tensor__": "float32", "shape": [2], "data": b"\0" * 7})


# ---- a user compressor in under 30 lines (the one in docs/compressors.md) -------------

def docs_example_source() -> str:
    text = (ROOT / "docs" / "compressors.md").read_text()
    start = text.index("```python\n# add-your-own") + len("```python\n")
    return text[start : text.index("```", start)]


def test_docs_example_registers_a_working_compressor():
    source = docs_example_source()
    assert len(source.strip().splitlines()) < 30
    try:
        exec(compile(source, "docs/compressors.md", "exec"), {})
        chain = build({"compressor": "scaled_fp16", "ef": "vanilla"}, 5)
        x = torch.tensor([1.0, -2.0, 3.0, 1e-4, 0.0])
        payload = chain.compress(x)
        assert payload.dtype == torch.uint8 and payload.numel() == 5 * 2 + 4
        torch.testing.assert_close(chain.decompress(payload), x, rtol=1e-3, atol=1e-6)
        raw = payload.numpy().tobytes()
        assert torch.equal(chain.decompress(raw), chain.decompress(memoryview(raw)))
        with pytest.raises(ValueError, match="expected 14 bytes"):
            chain.decompress(raw[:-1])
        with pytest.raises(ValueError, match="already registered"):
            exec(compile(source, "docs/compressors.md", "exec"), {})
    finally:
        unregister("scaled_fp16")


def test_register_validates():
    with pytest.raises(ValueError, match="already"):
        register("onebit", lambda p, n, dt: None)
    register("broken", lambda p, n, dt: object())
    try:
        with pytest.raises(TypeError, match="Compressor"):
            build({"compressor": "broken"}, 4)
    finally:
        unregister("broken")
    assert issubclass(ErrorFeedback, Compressor)


MODULES = ["bps.common.config", "bps.compressors", "bps.compressors.onebit", "bps.compressors.topk",
           "bps.compressors.randomk", "bps.compressors.dithering", "bps.compressors.rng",
           "bps.compressors.dithering_quantiser", "bps.compressors.elias_delta",
           "bps.compressors.error_feedback", "bps.compressors.momentum",
           "bps.compressors.registry", "bps.compressors.wire", "bps.compressors.base",
           "bps.compressors.sparse", "bps.compressors.bytegrad", "bps.compressors.powersgd",
           "bps.compressors.warm"]


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


# bps.trainer's module example needs a running cluster (bps.init()); the examples of
# its planning functions run on their own
FUNCTIONS = ["bps.worker.planning.plan_key_servers"]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_docstring_examples(name):
    module_name, attribute = name.rsplit(".", 1)
    module = importlib.import_module(module_name)
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(getattr(module, attribute), name,
                                             globs=dict(vars(module))):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted > 0


ONE_STEP = """
import sys, torch
from bps.compressors import build
from bps.compressors.warm import warm_kernels
params = {"compressor": "onebit", "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}
if sys.argv[1] == "warm":
    warm_kernels([params], numel=1000, dtypes=(torch.float32,))
else:  # one step of a job's own chains, as a worker and a server make it
    worker, server = build(params, 1000), build(params, 1000, role="server")
    worker.set_lr(0.1)
    server.set_lr(0.1)
    worker.decompress(server.compress(server.decompress(worker.compress(torch.ones(1000)))))
"""


def test_a_job_after_warm_kernels_compiles_nothing(tmp_path) -> None:
    """After ``bps.compressors.warm`` (which ``make setup`` runs) a job's process loads
    every kernel of its chain's step from numba's cache and compiles none; without it,
    the same step compiles (the check can fail)."""
    import subprocess
    import sys

    def step(mode: str) -> str:
        env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_DEBUG_CACHE": "1"}
        result = subprocess.run([sys.executable, "-c", ONE_STEP, mode], env=env,
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        return result.stdout + result.stderr

    assert "data saved" in step("warm")  # into the empty cache of this test
    job = step("job")
    assert "data loaded" in job and "data saved" not in job, job[-2000:]


LOAD_SOON = """
import torch
from bps.compressors.finite import divide_finite_inplace, all_finite
from bps.compressors.onebit import (add_error_and_pack, subtract_signs, sum_signs_and_pack,
                                    unpack_signs)
from bps.compressors.warm import load_soon, wait_loaded
torch.manual_seed(5)
before = torch.get_rng_state()
load_soon({"compressor": "onebit", "ef": "vanilla"}, torch.float32)
load_soon({"compressor": "onebit", "ef": "vanilla"}, torch.float32)  # once per process
# a chain whose size its options fix (a key's matrix shape) loads with its first step
load_soon({"compressor": "powersgd", "rank": 1, "shape": [1, 150, 150]}, torch.float32)
# a trainer's construction: the job's params, no shape yet, on the wire's float16
load_soon({"compressor": "powersgd", "rank": 1}, torch.float16)
assert wait_loaded(timeout=240)
assert torch.equal(torch.get_rng_state(), before), "the load drew random numbers"
print(len(divide_finite_inplace.signatures), len(all_finite.signatures),
      len(add_error_and_pack.signatures), len(subtract_signs.signatures),
      len(unpack_signs.signatures), len(sum_signs_and_pack.signatures))
"""


def test_load_soon_loads_a_chains_kernels_without_touching_the_job() -> None:
    """``load_soon`` (a trainer's construction, a server's declaration) leaves the
    kernels of the declared chain and of the inf/NaN checks loaded, read-only payloads
    and the server's sum in its error feedback pass included, once per process, draws
    nothing from torch's random generator, and passes over a chain it cannot build at
    its size without a word."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", LOAD_SOON], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "not loaded ahead" not in result.stderr, result.stderr
    # payloads are decoded both as a chain's own (writable) and as a frame's (read-only):
    # numba keeps a signature for each; the server's sum stacks them into one array
    assert result.stdout.split() == ["1", "1", "1", "2", "2", "1"], result.stdout
