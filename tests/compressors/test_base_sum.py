"""Summing pushes without decoding them: ``decompress_add`` against the reference
decoders, onebit's sum in the server's error feedback pass (``compress_sum``) against
the reference chain, and a server key engine summing real pushes (duplicate and
malformed pushes must leave the sum untouched; a sum beyond the dtype's range skips the
step and leaves the server chain as it was)."""

import struct

import numpy as np
import pytest
import torch
import zmq

from bps.common.protocol import Op, decode, encode
from bps.compressors import Compressor, build, description, registered_names
from bps.compressors.base import NonFiniteError
from bps.server.aggregator import RequestError
from tests.harness import reference_compressors as ref
from tests.harness.key_engine import serving_key_engine
from tests.harness.reference_compressors import ref_codec
from tests.harness.samples import DTYPES, as_values, sample

# every described example of each compressor whose payloads are decoded one by one
SUM_PARAMS = [{"compressor": name, **example} for name in registered_names()
              if not description(name).payloads_sum for example in description(name).examples]


def expected_sum(total: torch.Tensor, decoded: np.ndarray, dtype: str) -> np.ndarray:
    """``total + decoded`` rounded once to dtype (float64 holds either sum exactly enough:
    53 >= 2 * 24 + 2 bits, so rounding twice is the same as rounding once)."""
    return ref.round_to(as_values(total) + decoded, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", SUM_PARAMS, ids=lambda p: p["compressor"])
@pytest.mark.parametrize("chain", [False, True], ids=["bare", "ef-chain"])
def test_decompress_add_matches_reference_sum(params, dtype, chain):
    numel, torch_dtype = 97, ref.TORCH_DTYPE[dtype]
    full = dict(params, ef="vanilla") if chain else params
    c = build(full, numel, torch_dtype, role="server")
    _, ref_decode = ref_codec(params, numel, dtype)
    total = sample(numel, dtype, seed=1)
    for step in range(3):  # the staging array must be clean again for the next payload
        payload = c.compress(sample(numel, dtype, seed=10 + step)).numpy().tobytes()
        expected = expected_sum(total, ref_decode(payload), dtype)
        assert c.decompress_add(payload, total) is total
        np.testing.assert_array_equal(as_values(total), expected, err_msg=f"step {step}")
    inner = c.inner if chain else c
    if hasattr(inner, "_staging"):
        assert not inner.staging().any()


def topk_payload(indices: list[int], values: list[float]) -> bytes:
    k = len(indices)
    return struct.pack(f"<{k}i", *indices) + b"\0" * ((-4 * k) % 8) + \
        struct.pack(f"<{k}f", *values)


def test_topk_repeated_index_adds_its_last_value_once():
    # a compressor never sends an index twice, but a payload may: decoding keeps the last
    c = build({"compressor": "topk", "k": 4}, 6)
    payload = topk_payload([3, 1, 3, 3], [1.0, 2.0, 5.0, -7.0])
    total = torch.arange(6, dtype=torch.float32)
    c.decompress_add(payload, total)
    assert total.tolist() == [0.0, 3.0, 2.0, -4.0, 4.0, 5.0]
    assert torch.equal(total, torch.arange(6.0) + c.decompress(payload))


@pytest.mark.parametrize(("params", "payload", "match"), [
    ({"compressor": "topk", "k": 2}, topk_payload([1, 6], [1.0, 2.0]), "outside"),
    ({"compressor": "topk", "k": 2}, topk_payload([1], [1.0]), "bytes"),
    ({"compressor": "onebit"}, b"\0" * 7, "bytes"),
    ({"compressor": "randomk", "k": 2, "seed": 1}, b"\0" * 23, "bytes"),
    ({"compressor": "dithering", "k": 4}, b"\xff" * 24, "Elias|bits|stream"),
    ({"compressor": "bytegrad"}, b"\0" * 13, "bytes"),
    ({"compressor": "bytegrad"}, np.array([1, 0], "<f4").tobytes() + b"\0" * 6, "lo=1.0"),
])
def test_bad_payload_leaves_the_sum_untouched(params, payload, match):
    c = build(params, 6)
    total = torch.arange(6, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        c.decompress_add(payload, total)
    assert total.tolist() == list(range(6))
    with pytest.raises(ValueError, match="total must be"):
        c.decompress_add(c.compress(torch.ones(6)), torch.zeros(7))


def onebit_payload(numel: int, negative: list[int], scale: float) -> bytes:
    """A onebit payload: the sign bits of the indices in ``negative`` set, then the scale."""
    words = [0] * ((numel + 31) // 32)
    for i in negative:
        words[i // 32] |= 1 << (31 - i % 32)
    return struct.pack(f"<{len(words)}If", *words, scale)


def bytegrad_payload(numel: int, chunk: int, value: float) -> bytes:
    """A bytegrad payload that decodes to ``value`` everywhere: lo = hi = value."""
    chunks = -(-numel // chunk)
    return struct.pack(f"<{2 * chunks}f", *[value] * (2 * chunks)) + b"\0" * numel


ONEBIT_EF = {"compressor": "onebit", "scaling": True, "ef": "vanilla"}
BYTEGRAD_EF = {"compressor": "bytegrad", "chunk": 16, "ef": "vanilla"}
SUMMED_IN_ONE_PASS = [pytest.param(ONEBIT_EF, id="onebit"),
                      pytest.param(BYTEGRAD_EF, id="bytegrad")]


def worker_of(params: dict, numel: int, dtype: torch.dtype = torch.float32) -> Compressor:
    """A worker's chain of ``params`` without its error feedback (pushes of a step)."""
    return build({key: value for key, value in params.items() if key != "ef"}, numel, dtype)


HUGE = {  # compressor -> (params, numel) -> its push that huge_payload describes
    "onebit": lambda params, numel: onebit_payload(numel, [3], 3e38),
    "bytegrad": lambda params, numel: bytegrad_payload(numel, params["chunk"], 3e38),
    "topk": lambda params, numel: topk_payload([5, 9], [3e38, 1.0]),
}


def huge_payload(params: dict, numel: int) -> bytes:
    """A push whose values are finite, but twice which is beyond float32."""
    return HUGE[params["compressor"]](params, numel)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-pass", "chunks"])
@pytest.mark.parametrize("params", SUMMED_IN_ONE_PASS)
def test_a_server_chain_sums_pushes_in_its_error_feedback_pass(monkeypatch, params, dtype,
                                                                chunked):
    """``compress_sum``: 3 nodes' pushes decoded and added in node order, the error added
    (scaled as the learning rate changes), compressed and the residual kept: the
    payload and error of the reference chain given the reference sum, step after step,
    in one pass or in chunks on several threads (numel 1000 ends in a part word and a
    part chunk)."""
    from bps.compressors import bytegrad, threads

    if chunked:
        for module in (threads, bytegrad):
            monkeypatch.setattr(module, "MIN_CHUNK", 64)
            monkeypatch.setattr(module, "THREADS", 4)
    numel, torch_dtype = 1000, ref.TORCH_DTYPE[dtype]
    server = build(params, numel, torch_dtype, role="server")
    assert server.sums_payloads and len(server.inner.bounds) == (4 if chunked else 1)
    encode_ref, decode_ref = ref_codec(params, numel, dtype)
    reference = ref.RefChain(encode_ref, decode_ref, numel, dtype, ef=True, mu=None)
    workers = [worker_of(params, numel, torch_dtype) for _ in range(3)]
    # ratios 0.7, 0.43 and 1: a product that rounds, so a fused multiply-add would show
    for step, lr in enumerate([0.1, 0.07, 0.03, 0.03]):
        pushes = [w.compress(sample(numel, dtype, seed=10 * step + n))
                  for n, w in enumerate(workers)]
        total = np.zeros(numel)
        for push in pushes:
            total = ref.round_to(total + decode_ref(push.numpy().tobytes()), dtype)
        server.set_lr(lr)
        reference.set_lr(lr)
        payload = server.compress_sum(pushes)
        assert payload.numpy().tobytes() == reference.compress(total), f"step {step}"
        np.testing.assert_array_equal(as_values(server.error), reference.error,
                                      err_msg=f"step {step}")


@pytest.mark.parametrize("params", SUMMED_IN_ONE_PASS)
def test_a_server_sum_beyond_the_dtype_range_changes_nothing(params):
    """Finite pushes whose sum overflows float32: NonFiniteError, and the chain's error
    and learning rates stay as they were (the next step is the reference's, which never
    saw the refused one)."""
    numel = 40
    server = build(params, numel, role="server")
    encode_ref, decode_ref = ref_codec(params, numel, "float32")
    reference = ref.RefChain(encode_ref, decode_ref, numel, "float32", ef=True, mu=None)
    worker = worker_of(params, numel)

    def step(lr: float, seed: int) -> None:
        pushes = [worker.compress(sample(numel, "float32", seed=seed + n)) for n in range(2)]
        total = ref.round_to(decode_ref(pushes[0].numpy().tobytes())
                             + decode_ref(pushes[1].numpy().tobytes()), "float32")
        server.set_lr(lr)
        reference.set_lr(lr)
        assert server.compress_sum(pushes).numpy().tobytes() == reference.compress(total)

    step(0.1, seed=1)
    error = server.error.clone()
    huge = huge_payload(params, numel)
    server.set_lr(0.4)
    with pytest.raises(NonFiniteError, match="inf or NaN"):
        server.compress_sum([huge, huge])
    assert torch.equal(server.error, error) and server.ratio == 1.0
    step(0.05, seed=3)  # the ratio is 0.1 / 0.05, not 0.4 / 0.05
    np.testing.assert_array_equal(as_values(server.error), reference.error)


class PlainCodec(Compressor):
    """A registered-style compressor: only compress/decompress."""

    def __init__(self) -> None:
        super().__init__(3)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).view(torch.uint8).clone()

    def decompress(self, payload, out=None):
        values = torch.frombuffer(bytearray(bytes(payload)), dtype=torch.float32)
        return values if out is None else out.copy_(values)


def test_a_compressor_without_decompress_add_is_decoded_and_added():
    total = torch.ones(3)
    PlainCodec().decompress_add(PlainCodec().compress(torch.tensor([1.0, 2.0, 3.0])), total)
    assert total.tolist() == [3.0, 5.0, 7.0]


# ---- a server key engine summing in place --------------------------------------------

@pytest.fixture
def key_engine():
    """A real key engine whose replies go over a real inproc PUSH/PULL pair."""
    with serving_key_engine(3) as (engine, replies):
        yield (engine, *_requests(engine, replies))


def _requests(engine, replies):
    def reply() -> dict:
        """The next reply header, with its payload bytes under "body"."""
        frames = replies.recv_multipart() if replies.poll(10_000) else None
        assert frames is not None, "no reply from the key engine"
        header = decode(frames[1])
        header["body"] = b"".join(frames[2:]) if len(frames) > 2 else None
        return header

    def request(op: Op, payload: bytes | None = None, **fields) -> dict:
        """Handle one request as the engine's thread would (a payload of more than 8
        bytes in two frames, which the engine joins); returns the first reply, or raises
        the engine's RequestError."""
        header = decode(encode(op, rid=1, **fields))
        frames = None if payload is None else [zmq.Frame(payload)]
        if payload is not None and len(payload) > 8:
            frames = [zmq.Frame(payload[:8]), zmq.Frame(payload[8:])]
        engine.handle(b"peer", header, frames)
        return reply()

    return request, reply


def test_server_sums_compressed_pushes_in_place(key_engine):
    engine, request, reply = key_engine
    numel, params = 300, {"compressor": "topk", "k": 30, "ef": "vanilla"}
    request(Op.REGISTER, key=5, numel=numel, dtype="float32", name="w", params=params, node=0)
    workers = [build(params, numel, role="worker") for _ in range(3)]
    encode_ref, decode_ref = ref_codec(params, numel, "float32")
    server_ref = ref.RefChain(encode_ref, decode_ref, numel, "float32", ef=True, mu=None)
    for step in range(3):
        pushes = [w.compress(sample(numel, "float32", seed=100 * step + n)).numpy().tobytes()
                  for n, w in enumerate(workers)]
        total = np.zeros(numel, dtype=np.float32)

        def push(node: int, body: bytes, step: int = step) -> dict:
            return request(Op.PUSH, body, key=5, step=step, node=node, dtype="float32",
                           numel=numel, nbytes=len(body), lr=0.1)

        assert push(0, pushes[0])["op"] == Op.ACK
        assert push(1, pushes[1])["op"] == Op.ACK
        with pytest.raises(RequestError, match="worker 1 pushed step"):
            push(1, pushes[2])  # a duplicate must not be added
        with pytest.raises(RequestError, match="cannot decode payload"):
            push(2, topk_payload([0] * 29 + [numel], [1.0] * 30))  # nor a bad one
        assert push(2, pushes[2])["op"] == Op.ACK
        for body in pushes:
            total += decode_ref(body).astype(np.float32)
        server_ref.set_lr(0.1)
        expected = server_ref.compress(total.astype(np.float64))
        for _ in range(3):  # every push also waits for the step's aggregate
            data = reply()
            assert data["op"] == Op.DATA and bytes(data["body"]) == expected, f"step {step}"
    assert len(engine.keys[5].spare) == 1  # one sum buffer, reused every step


def pusher(request, key: int, numel: int):
    """``push(node, body, step)``: a float32 PUSH of ``key`` at learning rate 0.1."""
    def push(node: int, body: bytes, step: int) -> dict:
        return request(Op.PUSH, body, key=key, step=step, node=node, dtype="float32",
                       numel=numel, nbytes=len(body), lr=0.1)
    return push


def assert_first_step_of_reference(push, reply, params: dict, numel: int, step: int) -> None:
    """3 workers' pushes of ``step`` get the aggregate of a reference server chain whose
    first step this is (one that never saw the steps before)."""
    worker = worker_of(params, numel)
    encode_ref, decode_ref = ref_codec(params, numel, "float32")
    reference = ref.RefChain(encode_ref, decode_ref, numel, "float32", ef=True, mu=None)
    total = np.zeros(numel)
    for node in range(3):
        body = worker.compress(sample(numel, "float32", seed=node, distinct=True))
        body = body.numpy().tobytes()
        assert push(node, body, step=step)["op"] == Op.ACK
        total = ref.round_to(total + decode_ref(body), "float32")
    reference.set_lr(0.1)
    expected = reference.compress(total)
    for _ in range(3):
        data = reply()
        assert data["op"] == Op.DATA and "skip" not in data and data["body"] == expected


@pytest.mark.parametrize(("params", "at_the_end"), [
    pytest.param(ONEBIT_EF, True, id="onebit"), pytest.param(BYTEGRAD_EF, True, id="bytegrad"),
    pytest.param({"compressor": "topk", "k": 2, "ef": "vanilla"}, False, id="topk")])
def test_a_compressed_sum_beyond_the_dtype_range_skips_the_step(key_engine, params,
                                                                 at_the_end):
    """Finite pushes whose float32 sum overflows: every pusher gets the step's skip
    (``skip_node`` -1, as a float16 raw key's overflow), not an error to one of them and
    silence to the others, and the server chain is as before: the next step's aggregate
    is the reference's that never saw the skipped one. onebit and bytegrad sum in their
    error feedback pass, topk decodes and adds each push as it arrives."""
    engine, request, reply = key_engine
    numel = 64
    request(Op.REGISTER, key=8, numel=numel, dtype="float32", name="w", params=params, node=0)
    assert engine.keys[8].sums_at_the_end() == at_the_end
    huge = huge_payload(params, numel)
    push = pusher(request, 8, numel)
    for node in range(3):
        assert push(node, huge, step=0)["op"] == Op.ACK
    for _ in range(3):
        data = reply()
        assert (data["op"], data["skip"], data["skip_node"]) == (Op.DATA, "nonfinite", -1)
    assert_first_step_of_reference(push, reply, params, numel, step=1)


def test_a_sum_the_payload_cannot_carry_is_refused_with_nothing_changed():
    """Where the old passes refused a sum, so does the one pass, with the chain's error
    as before: a float64 onebit key whose finite sum has a mean |g'| beyond float32 (its
    scale's type) raises ValueError; a bytegrad sum with a chunk whose range overflows
    float32 and a later one that is not finite raises NonFiniteError, as error
    feedback's check of the whole sum comes first."""
    numel = 40
    onebit = build(ONEBIT_EF, numel, torch.float64, role="server")
    onebit.set_lr(0.1)
    huge = onebit_payload(numel, [3], 3e38)  # float64 holds 6e38; float32 does not
    with pytest.raises(ValueError, match="beyond float32's range"):
        onebit.compress_sum([huge, huge])
    assert not onebit.error.any()

    chunk = 16
    bytegrad = build({**BYTEGRAD_EF, "chunk": chunk}, 2 * chunk, role="server")
    bytegrad.set_lr(0.1)
    ranges = struct.pack("<4f", -1e38, 1e38, 2e38, 2e38)  # chunk 0 wide, chunk 1 huge
    wide_then_huge = ranges + bytes([0, 255] + [128] * (chunk - 2)) + bytes(chunk)
    with pytest.raises(NonFiniteError):
        bytegrad.compress_sum([wide_then_huge] * 3)
    assert not bytegrad.error.any()


def test_held_pushes_marks_and_abort_on_a_key_summed_at_the_end(key_engine):
    """A onebit key summed in its error feedback pass: pushes arriving as node 2, then a
    zero mark of node 1 (a joined worker), then node 0 are summed in node order without
    the mark; ABORT of that step returns the server chain to its state before it, so
    the next step is the first step of a fresh reference."""
    engine, request, reply = key_engine
    numel = 96
    request(Op.REGISTER, key=7, numel=numel, dtype="float32", name="w", params=ONEBIT_EF,
            node=0)
    assert engine.keys[7].sums_at_the_end()
    push = pusher(request, 7, numel)
    worker = worker_of(ONEBIT_EF, numel)
    encode_ref, decode_ref = ref_codec(ONEBIT_EF, numel, "float32")
    bodies = {node: worker.compress(sample(numel, "float32", seed=40 + node)).numpy().tobytes()
              for node in (0, 2)}
    assert push(2, bodies[2], step=0)["op"] == Op.ACK
    assert request(Op.PUSH, None, key=7, step=0, node=1, dtype="float32", numel=numel,
                   nbytes=0, lr=0.1, mark="zero")["op"] == Op.ACK
    assert push(0, bodies[0], step=0)["op"] == Op.ACK
    reference = ref.RefChain(encode_ref, decode_ref, numel, "float32", ef=True, mu=None)
    reference.set_lr(0.1)
    total = ref.round_to(decode_ref(bodies[0]) + decode_ref(bodies[2]), "float32")
    expected = reference.compress(total)
    for _ in range(3):
        data = reply()
        assert data["op"] == Op.DATA and data["body"] == expected
    assert request(Op.ABORT, key=7, step=0)["op"] == Op.OK
    assert_first_step_of_reference(push, reply, ONEBIT_EF, numel, step=1)


def test_a_server_chain_that_fails_on_the_sum_tells_every_waiter(key_engine):
    """bytegrad refuses a chunk whose max - min overflows float32 (ValueError), which
    finite pushes can sum to: each of the step's 3 pushers gets an ERROR naming the key,
    the step and the cause (none waits for its timeout), a late PULL of the step is
    refused, and the chain is as before: the next step is the reference's."""
    engine, request, reply = key_engine
    numel, chunk = 64, 16
    params = {**BYTEGRAD_EF, "chunk": chunk}
    request(Op.REGISTER, key=9, numel=numel, dtype="float32", name="w", params=params, node=0)
    codes = bytes([0, 255] + [128] * (numel - 2))  # about -1e38 and 1e38 in chunk 0
    wide = struct.pack(f"<{2 * numel // chunk}f", *[-1e38, 1e38] * (numel // chunk)) + codes
    push = pusher(request, 9, numel)
    for node in range(3):
        assert push(node, wide, step=0)["op"] == Op.ACK
    for _ in range(3):
        error = reply()
        assert error["op"] == Op.ERROR, error
        assert "key 9 ('w') step 0: the server chain failed" in error["msg"], error
        assert "max - min overflows float32" in error["msg"], error
    with pytest.raises(RequestError, match="already completed"):
        request(Op.PULL, key=9, step=0, node=0)
    assert_first_step_of_reference(push, reply, params, numel, step=1)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_large_partition_in_chunks_gives_the_bits_of_one_pass(monkeypatch, dtype):
    """The server's error feedback, onebit's sum and re-encode, and a raw sum run a large
    partition in chunks on several threads: the same bits as one pass, and the sum is
    the reference decoder's."""
    from bps.compressors import threads
    from bps.server.aggregator import add_in_chunks

    numel, torch_dtype = 1000, ref.TORCH_DTYPE[dtype]
    params = {"compressor": "onebit", "scaling": True, "ef": "vanilla"}
    one_pass = build(params, numel, torch_dtype, role="server")
    monkeypatch.setattr(threads, "MIN_CHUNK", 64)
    monkeypatch.setattr(threads, "THREADS", 4)
    chunked = build(params, numel, torch_dtype, role="server")
    assert len(chunked.bounds) == 4 and len(chunked.inner.bounds) == 4
    assert len(one_pass.bounds) == 1
    _, ref_decode = ref_codec({"compressor": "onebit", "scaling": True}, numel, dtype)
    totals = [sample(numel, dtype, seed=1) for _ in range(2)]
    for step, lr in enumerate([0.1, 0.05, 0.05]):  # a change of lr scales the error
        x = sample(numel, dtype, seed=20 + step)
        payloads = []
        for chain, total in zip((one_pass, chunked), totals, strict=True):
            chain.set_lr(lr)
            payloads.append(chain.compress(x.clone()).numpy().tobytes())
            expected = expected_sum(total, ref_decode(payloads[-1]), dtype)
            chain.decompress_add(payloads[-1], total)
            np.testing.assert_array_equal(as_values(total), expected, err_msg=f"step {step}")
        assert payloads[0] == payloads[1], f"step {step}"
        assert torch.equal(one_pass.error, chunked.error), f"step {step}"

    half = sample(numel, "float16", seed=4).to(torch.float16)
    for scratch in (None, torch.empty(numel, dtype=torch.float32)):
        total = sample(numel, "float32", seed=5) if scratch is not None else half.clone()
        expected = total + (half.float() if scratch is not None else half)
        add_in_chunks(total, half, scratch)
        assert torch.equal(total, expected)
