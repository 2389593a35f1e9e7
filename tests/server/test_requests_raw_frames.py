"""Raw pushes in several frames on a real key engine: each frame is checked where it
lies (or as it is joined) before anything is added, and the sum is the one of the same
values pushed whole."""

from __future__ import annotations

import pytest
import torch
import zmq

from bps.common.protocol import Op, decode, dtype_name, encode
from bps.server.aggregator import RequestError
from tests.harness.key_engine import serving_key_engine

NUMEL = 3000


def frames(values: torch.Tensor, frame_bytes: int) -> list[zmq.Frame]:
    raw = values.view(torch.uint8).numpy().tobytes()
    return [zmq.Frame(raw[i:i + frame_bytes]) for i in range(0, len(raw), frame_bytes)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("cut", ["whole elements", "inside an element"])
def test_a_bad_frame_adds_nothing_and_the_sum_is_exact(dtype, workers, cut) -> None:
    """Worker 1's first push has a NaN in its last frame: refused, naming the worker,
    and nothing of it reaches the sum; its second push completes the step, whose sum is
    the float32 sum of the workers' values in node order, rounded to the key's dtype
    (for two terms that is the key's own dtype's addition, as docs/runtime.md says)."""
    width = torch.finfo(dtype).bits // 8
    frame_bytes = 1024 * width + (1 if cut == "inside an element" else 0)
    gen = torch.Generator().manual_seed(3)
    pushes = [(torch.randn(NUMEL, generator=gen) * 100).to(dtype) for _ in range(workers)]
    bad = pushes[1].clone()
    bad[-1] = float("nan")
    with serving_key_engine(workers) as (engine, replies):
        def request(op: Op, payload: list[zmq.Frame] | None, **fields) -> list[tuple]:
            engine.handle(b"peer", decode(encode(op, rid=1, **fields)), payload)
            got = []
            while replies.poll(100):
                parts = replies.recv_multipart()
                got.append((decode(parts[1]), b"".join(parts[2:])))
            return got

        def push(node: int, values: torch.Tensor) -> list[tuple]:
            return request(Op.PUSH, frames(values, frame_bytes), key=1, step=0, node=node,
                           dtype=dtype_name(dtype), numel=NUMEL,
                           nbytes=NUMEL * width, lr=0.1)

        request(Op.REGISTER, None, key=1, numel=NUMEL, dtype=dtype_name(dtype), name="w",
                params=None, node=0)
        push(0, pushes[0])
        with pytest.raises(RequestError, match="the push of worker 1 has inf or NaN"):
            push(1, bad)
        replies_ = [push(node, pushes[node]) for node in range(1, workers)][-1]
    data = [payload for header, payload in replies_ if header["op"] == Op.DATA]
    assert len(data) == workers
    expected = pushes[0].float()
    for values in pushes[1:]:  # in node order
        expected = expected + values.float()
    summed = torch.frombuffer(bytearray(data[0]), dtype=dtype)
    assert torch.equal(summed.view(torch.uint8), expected.to(dtype).view(torch.uint8))
