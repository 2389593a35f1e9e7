"""The server's sums on their own (:class:`bps.server.aggregator.Aggregator`), against
numpy references: raw pushes in every dtype, whole or in several buffers, compressed
pushes decoded and summed, pushes the server chain sums itself, each in worker-node order
whatever the arrival order, the server chain's error feedback step after step, and the
non-finite rules (a push refused, a mark or an overflowing sum skipping the step)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

import bps.server.aggregator
from bps.compressors import build
from bps.server.aggregator import Aggregator, Finished, RequestError
from tests.harness import reference_compressors as ref
from tests.harness.reference_compressors import ref_codec, value_bytes
from tests.harness.samples import DTYPES, as_values, sample

KEY = 3
DECODED = [  # compressed pushes decoded and added (in place, or widened first)
    pytest.param({"compressor": "topk", "k": 9, "ef": "vanilla"}, id="topk"),
    pytest.param({"compressor": "randomk", "k": 30, "seed": 9, "ef": "vanilla"},
                 id="randomk"),
    pytest.param({"compressor": "dithering", "k": 4, "seed": 5, "ef": "vanilla"},
                 id="dithering"),
]
SUMMED_BY_THE_CHAIN = [  # payloads summed in the server chain's error feedback pass
    pytest.param({"compressor": "onebit", "scaling": True, "ef": "vanilla"}, id="onebit"),
    pytest.param({"compressor": "bytegrad", "chunk": 16, "ef": "vanilla"}, id="bytegrad"),
]
SUMMED_PARAMS = [param.values[0] for param in SUMMED_BY_THE_CHAIN]


def reference_sum(pushes: list[np.ndarray], dtype: str) -> np.ndarray:
    """The documented sum of float64 arrays of ``dtype`` values, in node order: float64
    for float64 keys, else float32 rounding after each addition (two terms: the key's
    own dtype, which rounds the same), rounded to the dtype at the end."""
    total = pushes[0]
    for values in pushes[1:]:
        total = total + values if dtype == "float64" else ref.round_to(total + values,
                                                                      "float32")
    return ref.round_to(total, dtype)


def raw_push(values: np.ndarray, dtype: str, cuts: int = 0) -> list[bytearray]:
    """A raw push of float64 ``values`` (exact in ``dtype``): one writable buffer, or
    several of ``cuts`` bytes each (the last shorter)."""
    body = value_bytes(values, dtype)
    size = cuts or len(body)
    return [bytearray(body[i:i + size]) for i in range(0, len(body), size)]


def finish_step(sums: Aggregator, order: list[int], payloads: dict, step: int = 0,
                lr: float = 0.1) -> Finished:
    """Push ``payloads[node]`` in ``order``: only the last push completes the step; its
    answer goes to every pusher, in arrival order."""
    for n, node in enumerate(order):
        pushed = sums.push(KEY, node=node, step=step, payload=payloads[node], lr=lr,
                           waiter=f"node {node}")
        assert pushed.refused == []
        assert len(pushed.finished) == (n == len(order) - 1), (order, node)
    (answer,) = pushed.finished
    assert (answer.key, answer.step, answer.error) == (KEY, step, None)
    assert answer.waiters == [f"node {node}" for node in order]
    return answer


def aggregator(workers: int, numel: int, dtype: str, params: dict | None = None
               ) -> Aggregator:
    sums = Aggregator(workers)
    sums.register(KEY, numel, ref.TORCH_DTYPE[dtype], params, "w", node=0)
    return sums


def worker_pushes(params: dict, numel: int, dtype: str, workers: int, seed: int
                  ) -> list[bytes]:
    """Each node's payload: a worker chain of ``params`` (without error feedback) on a
    random gradient."""
    inner = {k: v for k, v in params.items() if k != "ef"}
    return [build(inner, numel, ref.TORCH_DTYPE[dtype]).compress(
        sample(numel, dtype, seed=seed + node)).numpy().tobytes() for node in range(workers)]


# ---- raw keys ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_raw_sum_is_the_reference_sum_in_node_order(dtype, workers):
    """Every arrival order gives the bits of the node-order sum, step after step (a
    step's sum taken in its first push's buffer must not leak into the next)."""
    numel = 101
    sums = aggregator(workers, numel, dtype)
    for step, order in enumerate(itertools.permutations(range(workers))):
        values = [as_values(sample(numel, dtype, seed=10 * step + node))
                  for node in range(workers)]
        answer = finish_step(sums, list(order), {n: raw_push(v, dtype)
                                                 for n, v in enumerate(values)}, step)
        assert answer.payload.dtype == ref.TORCH_DTYPE[dtype] and answer.skip == {}
        np.testing.assert_array_equal(as_values(answer.payload),
                                      reference_sum(values, dtype), err_msg=str(order))


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=str)
def test_an_early_push_waits_for_the_lower_numbered_nodes(order):
    """1e8 + 1 - 1e8 in float32 is 0 in node order (1e8 + 1 rounds to 1e8) and 1 in any
    order that adds the last two first: every arrival order gives 0."""
    sums = aggregator(3, 1, "float32")
    payloads = {node: raw_push(np.array([v]), "float32")
                for node, v in enumerate([1e8, 1.0, -1e8])}
    assert finish_step(sums, list(order), payloads).payload.tolist() == [0.0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("cut", ["whole elements", "inside an element"])
def test_a_raw_push_in_several_buffers_sums_as_one(dtype, workers, cut):
    """Buffers of whole elements are added where they lie, others joined first; either
    way the sum of the same values pushed whole."""
    numel, width = 300, ref.ITEMSIZE[dtype]
    cuts = 64 * width + (1 if cut == "inside an element" else 0)
    sums = aggregator(workers, numel, dtype)
    for step in range(2):
        values = [as_values(sample(numel, dtype, seed=7 * step + node))
                  for node in range(workers)]
        payloads = {n: raw_push(v, dtype, cuts) for n, v in enumerate(values)}
        assert len(payloads[0]) > 1
        answer = finish_step(sums, list(range(workers))[::-1], payloads, step)
        np.testing.assert_array_equal(as_values(answer.payload), reference_sum(values, dtype))


CUTS = pytest.mark.parametrize("cuts", [0, 64 * 4, 64 * 4 + 1], ids=["one buffer",
                                                                  "buffers", "cut"])
NAN_PUSH = r"key 3 \('w'\): the push of worker 1 has inf or NaN values"


def three_nodes_and_a_bad_push(numel: int) -> tuple[list[np.ndarray], np.ndarray]:
    values = [as_values(sample(numel, "float32", seed=node)) for node in range(3)]
    bad = values[1].copy()
    bad[-1] = np.nan
    bad[numel // 2] = np.inf
    return values, bad


@CUTS
def test_a_push_with_inf_or_nan_is_refused_and_adds_nothing(cuts):
    """Refused as it arrives (its turn has come), whole or in buffers (each checked
    before any is added); the node's next push completes the step with no trace of it."""
    numel = 200
    sums = aggregator(3, numel, "float32")
    values, bad = three_nodes_and_a_bad_push(numel)
    assert sums.push(KEY, 0, 0, raw_push(values[0], "float32", cuts), 0.1, "a").finished == []
    with pytest.raises(RequestError, match=NAN_PUSH):
        sums.push(KEY, 1, 0, raw_push(bad, "float32", cuts), 0.1, "b")
    assert sums.push(KEY, 2, 0, raw_push(values[2], "float32", cuts), 0.1, "c").finished == []
    (answer,) = sums.push(KEY, 1, 0, raw_push(values[1], "float32", cuts), 0.1, "b2").finished
    assert answer.waiters == ["a", "c", "b2"]
    np.testing.assert_array_equal(as_values(answer.payload), reference_sum(values, "float32"))


@CUTS
def test_a_held_push_with_inf_or_nan_is_refused_when_its_turn_comes(cuts):
    """Held until node 0 pushes, then checked and refused: ``refused`` names its waiter
    and the push that let it in is taken; the node may push again."""
    numel = 200
    sums = aggregator(3, numel, "float32")
    values, bad = three_nodes_and_a_bad_push(numel)
    assert sums.push(KEY, 1, 0, raw_push(bad, "float32", cuts), 0.1, "early") \
        == bps.server.aggregator.Pushed()
    pushed = sums.push(KEY, 0, 0, raw_push(values[0], "float32", cuts), 0.1, "a")
    assert pushed.finished == [] and len(pushed.refused) == 1
    waiter, message = pushed.refused[0]
    assert waiter == "early" and "the push of worker 1 has inf or NaN values" in message
    sums.push(KEY, 2, 0, raw_push(values[2], "float32", cuts), 0.1, "c")
    (answer,) = sums.push(KEY, 1, 0, raw_push(values[1], "float32", cuts), 0.1, "b").finished
    assert answer.waiters == ["a", "c", "b"]
    np.testing.assert_array_equal(as_values(answer.payload), reference_sum(values, "float32"))


@pytest.mark.parametrize("marks", [{1: "nonfinite"}, {0: "zero", 1: "nonfinite"},
                                   {0: "zero", 1: "zero"}], ids=str)
@pytest.mark.parametrize("params", [None, *SUMMED_BY_THE_CHAIN, *DECODED[:1]])
def test_a_marked_step_is_skipped_and_the_chain_stays_as_it_was(params, marks):
    """A nonfinite mark skips the step, naming the node and tensor (``skip_node``,
    ``skip_what``); only zero marks skip it as ``zero``; nothing is summed and the server
    chain is untouched: the next step's aggregate is a fresh reference chain's."""
    numel, dtype = 64, "float32"
    sums = aggregator(2, numel, dtype, params)
    bodies = (worker_pushes(params, numel, dtype, 2, seed=1) if params
              else [value_bytes(as_values(sample(numel, dtype, seed=n)), dtype)
                    for n in range(2)])
    for node in (1, 0):
        mark = marks.get(node)
        pushed = sums.push(KEY, node, 0, [] if mark else [bytearray(bodies[node])], 0.1,
                           node, mark=mark, what="fc.weight" if mark else "")
    (answer,) = pushed.finished
    assert answer.payload.numel() == 0
    if "nonfinite" in marks.values():
        assert answer.skip == {"skip": "nonfinite", "skip_node": 1, "skip_what": "fc.weight"}
    else:
        assert answer.skip == {"skip": "zero", "skip_node": -1, "skip_what": ""}
    assert_next_step_is_a_fresh_reference(sums, params, numel, step=1)


def assert_next_step_is_a_fresh_reference(sums: Aggregator, params: dict | None, numel: int,
                                          step: int, workers: int = 2) -> None:
    """Step ``step`` of ``workers`` nodes (float32) is answered as by a server chain that
    never saw a step before."""
    dtype = "float32"
    if params is None:
        values = [as_values(sample(numel, dtype, seed=50 + n)) for n in range(workers)]
        answer = finish_step(sums, list(range(workers)),
                             {n: raw_push(v, dtype) for n, v in enumerate(values)}, step)
        np.testing.assert_array_equal(as_values(answer.payload), reference_sum(values, dtype))
        return
    bodies = worker_pushes(params, numel, dtype, workers, seed=50)
    encode_ref, decode_ref = ref_codec(params, numel, dtype)
    reference = ref.RefChain(encode_ref, decode_ref, numel, dtype, ef=True, mu=None)
    reference.set_lr(0.1)
    expected = reference.compress(reference_sum([decode_ref(b) for b in bodies], dtype))
    answer = finish_step(sums, list(range(workers)),
                         {n: [bytearray(b)] for n, b in enumerate(bodies)}, step)
    assert answer.skip == {} and answer.payload.numpy().tobytes() == expected


def test_a_float16_sum_beyond_its_range_skips_the_step():
    """Finite float16 pushes whose sum overflows: skipped as if inf had been pushed,
    ``skip_node`` -1 and the key's name; the next step sums as usual."""
    sums = aggregator(2, 4, "float16")
    big = np.array([60000.0, 1.0, -60000.0, 2.0])
    answer = finish_step(sums, [0, 1], {n: raw_push(big, "float16") for n in range(2)})
    assert answer.payload.numel() == 0
    assert answer.skip == {"skip": "nonfinite", "skip_node": -1, "skip_what": "w"}
    answer = finish_step(sums, [1, 0], {n: raw_push(big / 4, "float16") for n in range(2)},
                         step=1)
    assert answer.payload.tolist() == [30000.0, 0.5, -30000.0, 1.0]


def huge_push(params: dict, numel: int) -> bytes:
    """A payload of finite values, twice which is beyond float32: the compressor's own
    encoding of 3e38 at every element."""
    huge = torch.full((numel,), 3e38)
    return build(params, numel).compress(huge).numpy().tobytes()


@pytest.mark.parametrize("params", [*SUMMED_BY_THE_CHAIN, *DECODED[:1]])
def test_a_compressed_sum_beyond_the_range_skips_the_step(params):
    """Finite pushes whose float32 sum (with the server chain's error) overflows: a skip
    with ``skip_node`` -1, and the server chain as before."""
    numel = 64
    sums = aggregator(2, numel, "float32", params)
    body = huge_push(params, numel)
    answer = finish_step(sums, [1, 0], {n: [bytearray(body)] for n in range(2)})
    assert (answer.skip["skip"], answer.skip["skip_node"]) == ("nonfinite", -1)
    assert_next_step_is_a_fresh_reference(sums, params, numel, step=1)


# ---- compressed keys -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("params", [*DECODED, *SUMMED_BY_THE_CHAIN])
def test_compressed_pushes_sum_and_recompress_as_the_reference(params, workers, dtype):
    """Each node's payload decoded by the reference decoder, summed in node order
    (arriving in reverse), then compressed by a reference server chain with error
    feedback, step after step as the learning rate changes: the same bytes to every
    pusher. onebit and bytegrad float32/float64 keys sum in the chain's own pass, the
    others decode each push: added in place (float32/float64), or in the key's dtype
    (float16/bfloat16 of 2 nodes), or widened to float32 (of 3)."""
    numel = 97
    sums = aggregator(workers, numel, dtype, params)
    wide = dtype in ("float32", "float64")
    assert sums.keys[KEY].sums_at_the_end() == (wide and params in SUMMED_PARAMS)
    assert sums.keys[KEY].sums_in_place() == wide
    encode_ref, decode_ref = ref_codec(params, numel, dtype)
    reference = ref.RefChain(encode_ref, decode_ref, numel, dtype, ef=True, mu=None)
    for step, lr in enumerate([0.1, 0.07, 0.07]):
        bodies = worker_pushes(params, numel, dtype, workers, seed=10 * step)
        total = reference_sum([decode_ref(b) for b in bodies], dtype)
        reference.set_lr(lr)
        expected = reference.compress(total)
        answer = finish_step(sums, list(range(workers))[::-1],
                             {n: [bytearray(b)] for n, b in enumerate(bodies)}, step, lr)
        assert answer.skip == {} and answer.payload.numpy().tobytes() == expected, step


def test_a_compressed_push_in_several_buffers_is_joined():
    params = DECODED[0].values[0]
    numel = 97
    sums = aggregator(2, numel, "float32", params)
    encode_ref, decode_ref = ref_codec(params, numel, "float32")
    reference = ref.RefChain(encode_ref, decode_ref, numel, "float32", ef=True, mu=None)
    bodies = worker_pushes(params, numel, "float32", 2, seed=3)
    reference.set_lr(0.1)
    expected = reference.compress(reference_sum([decode_ref(b) for b in bodies], "float32"))
    split = {n: [bytearray(b[:10]), bytearray(b[10:])] for n, b in enumerate(bodies)}
    assert finish_step(sums, [0, 1], split).payload.numpy().tobytes() == expected


def test_abort_returns_the_server_chain_to_its_state_before_the_step():
    """ABORT of the step the chain compressed last: the next step is a fresh chain's;
    ABORT of another step changes nothing (the chain keeps the step's error)."""
    params = SUMMED_BY_THE_CHAIN[0].values[0]
    numel = 96
    bodies = worker_pushes(params, numel, "float32", 2, seed=20)
    aborted, kept = (aggregator(2, numel, "float32", params) for _ in range(2))
    for sums in (aborted, kept):
        finish_step(sums, [0, 1], {n: [bytearray(b)] for n, b in enumerate(bodies)})
    kept.abort(KEY, 5)
    with pytest.raises(AssertionError):
        assert_next_step_is_a_fresh_reference(kept, params, numel, step=1)
    aborted.abort(KEY, 0)
    assert_next_step_is_a_fresh_reference(aborted, params, numel, step=1)


# ---- steps, pulls and the server chain's state --------------------------------------------

def test_steps_accumulate_apart_and_pulls_get_the_same_answer():
    """A fast node's next step never mixes into the step in progress; a PULL of the step
    in progress waits for it, one of the last finished step is answered at once with the
    same payload, one of an older step is refused."""
    sums = aggregator(2, 3, "float32")
    ones = np.ones(3)
    assert sums.pull(KEY, 0, "puller") is None
    sums.push(KEY, 0, 0, raw_push(ones, "float32"), 0.1, "a")
    (first,) = sums.push(KEY, 1, 0, raw_push(2 * ones, "float32"), 0.1, "b").finished
    assert first.waiters == ["puller", "a", "b"] and first.payload.tolist() == [3.0] * 3
    sums.push(KEY, 1, 1, raw_push(10 * ones, "float32"), 0.1, "b1")
    again = sums.pull(KEY, 0, "late")
    assert again.waiters == ["late"] and again.payload.tolist() == [3.0] * 3
    (second,) = sums.push(KEY, 0, 1, raw_push(ones, "float32"), 0.1, "a1").finished
    assert second.step == 1 and second.payload.tolist() == [11.0] * 3
    with pytest.raises(RequestError, match="step 0 already completed"):
        sums.pull(KEY, 0, "too late")
    sums.push(KEY, 1, 2, raw_push(ones, "float32"), 0.1, "x")
    with pytest.raises(RequestError, match="worker 1 pushed step 2 twice"):
        sums.push(KEY, 1, 2, raw_push(ones, "float32"), 0.1, "y")


def test_a_key_declared_differently_is_refused():
    sums = aggregator(2, 8, "float32")
    assert sums.register(KEY, 8, torch.float32, None, "w", node=1) is sums.keys[KEY]
    with pytest.raises(RequestError, match="key 3 declared differently by worker nodes: "
                                           "worker 1 declared 'v' with numel=9"):
        sums.register(KEY, 9, torch.float32, None, "v", node=1)
    with pytest.raises(RequestError, match="unknown key"):
        sums.push(KEY + 1, 0, 0, [], 0.1, "x")


def test_the_server_chain_state_goes_out_and_comes_back():
    """get_state after a step, set_state on a fresh aggregator: the next step's answers
    are the same bytes."""
    params = DECODED[0].values[0]
    numel = 97
    first, second = (aggregator(2, numel, "float32", params) for _ in range(2))
    bodies = worker_pushes(params, numel, "float32", 2, seed=1)
    finish_step(first, [0, 1], {n: [bytearray(b)] for n, b in enumerate(bodies)})
    step, blob = first.get_state(KEY)
    assert step == 0 and first.get_state(KEY)[1] is blob
    second.set_state(KEY, [blob[:5], blob[5:]])
    bodies = worker_pushes(params, numel, "float32", 2, seed=2)
    pushes = {n: [bytearray(b)] for n, b in enumerate(bodies)}
    after = finish_step(first, [0, 1], pushes, step=1).payload.numpy().tobytes()
    pushes = {n: [bytearray(b)] for n, b in enumerate(bodies)}
    assert finish_step(second, [0, 1], pushes, step=0).payload.numpy().tobytes() == after


def test_the_aggregator_imports_no_sockets_threads_or_cluster():
    tree = ast.parse(Path(bps.server.aggregator.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {"zmq", "threading", "bps.common.env", "bps.common.scheduler_client"} \
        & imported, imported
