"""Truncated, oversized and corrupted payloads give ValueError, never a crash."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bps.compressors import build
from bps.compressors.base import payload_bytes
from tests.harness import reference_compressors as ref
from tests.harness.samples import (
    DTYPES,
)

PARAMS = {
    "onebit": {"compressor": "onebit", "scaling": True},
    "topk": {"compressor": "topk", "k": 0.1},
    "randomk": {"compressor": "randomk", "k": 0.1},
    "dithering": {"compressor": "dithering", "k": 4},
    "natural": {"compressor": "dithering", "k": 5, "partition": "natural"},
    "bytegrad": {"compressor": "bytegrad", "chunk": 64},
}
NUMEL = 301


def chain_and_payload(name: str, dtype=torch.float32):
    c = build(PARAMS[name], NUMEL, dtype)
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)).to(dtype)
    return c, c.compress(x).numpy().tobytes()


@pytest.mark.parametrize("name", PARAMS)
def test_truncated_and_oversized(name):
    c, payload = chain_and_payload(name)
    for bad in (b"", payload[:1], payload[:-1], payload + b"\0", payload + payload):
        with pytest.raises(ValueError, match="payload"):
            c.decompress(bad)


def test_onebit_header_fields():
    c, payload = chain_and_payload("onebit")
    for scale in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="scale"):
            c.decompress(payload[:-4] + np.float32(scale).tobytes())
    words = bytearray(payload)
    words[4 * (NUMEL // 32)] |= 1  # a padding bit of the last word (301 % 32 = 13 used)
    with pytest.raises(ValueError, match="padding"):
        c.decompress(bytes(words))


@pytest.mark.parametrize("bad_index", [-1, NUMEL, 2**31 - 1])
def test_topk_index_out_of_range(bad_index):
    c, payload = chain_and_payload("topk")
    corrupted = bytearray(payload)
    corrupted[4:8] = np.int32(bad_index).tobytes()
    out = torch.full((NUMEL,), 5.0)
    with pytest.raises(ValueError, match="index"):
        c.decompress(bytes(corrupted), out=out)
    assert (out == 5.0).all()  # checked before anything was written


@pytest.mark.parametrize("name", ["dithering", "natural"])
def test_dithering_header_fields(name):
    c, payload = chain_and_payload(name)
    nbits = int(np.frombuffer(payload[-16:-8], "<u8")[0])
    stream, scale = payload[:-16], payload[-8:]
    for bits in (nbits + 8, nbits - 8, 2**64 - 1, 0):
        with pytest.raises(ValueError, match="bit count"):
            c.decompress(stream + np.uint64(bits).tobytes() + scale)
    for value in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale"):
            c.decompress(stream + payload[-16:-8] + np.float64(value).tobytes())


def test_dithering_stream_errors():
    c = build(PARAMS["dithering"], 4)

    def payload(bits: str) -> bytes:
        padded = bits + "0" * (-len(bits) % 8)
        data = bytes(int(padded[i : i + 8], 2) for i in range(0, len(padded), 8))
        return data + np.uint64(len(bits)).tobytes() + np.float64(1.0).tobytes()

    # gap 1, sign +, q 1  -> ok; then variants
    assert c.decompress(payload("1" + "0" + "1")).tolist() == [0.25, 0, 0, 0]
    with pytest.raises(ValueError, match="past numel"):  # gap 5 > numel
        c.decompress(payload("01101" + "0" + "1"))
    with pytest.raises(ValueError, match="largest level"):  # q = 6 > s + 1
        c.decompress(payload("1" + "0" + "01110"))
    with pytest.raises(ValueError, match="inside an entry|Elias"):  # ends after the gap
        c.decompress(payload("1"))
    with pytest.raises(ValueError, match="Elias"):  # 40 zeros: a code longer than 32 bits
        c.decompress(payload("0" * 40))

    # two entries that one pair lookup would take: the second is checked like the first
    assert c.decompress(payload("101" + "0100" + "1" + "1")).tolist() == [0.25, 0, -0.25, 0]
    with pytest.raises(ValueError, match="past numel"):  # index 0, then gap 4 -> index 4
        c.decompress(payload("101" + "01100" + "0" + "1"))
    with pytest.raises(ValueError, match="inside an entry|Elias"):  # ends in the second
        c.decompress(payload("101" + "0100" + "0"))
    with pytest.raises(ValueError, match="largest level"):  # second q = 6
        c.decompress(payload("101" + "1" + "0" + "01110"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(list(PARAMS)), data=st.data())
def test_fuzz_corrupted_payloads_raise_value_error_or_decode_in_bounds(name, data):
    c, payload = chain_and_payload(name)
    corrupted = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(corrupted) - 1))
        corrupted[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, 3))
    if cut:
        corrupted = corrupted[: len(corrupted) - cut] if data.draw(st.booleans()) else (
            corrupted + bytes(cut))
    try:
        y = c.decompress(bytes(corrupted))
    except ValueError:
        return
    assert y.shape == (NUMEL,) and y.dtype == torch.float32


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(list(PARAMS)), blob=st.binary(max_size=400))
def test_fuzz_random_bytes(name, blob):
    c = build(PARAMS[name], 40)
    try:
        c.decompress(blob)
    except ValueError:
        pass


def test_wrong_payload_types():
    c, payload = chain_and_payload("onebit")
    with pytest.raises(ValueError, match="uint8"):
        c.decompress(torch.zeros(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="payload"):
        c.decompress("not bytes")
    with pytest.raises(ValueError, match="1-D"):
        c.compress(torch.zeros(2, NUMEL))


@pytest.mark.parametrize("params", [
    {"compressor": "onebit", "scaling": True}, {"compressor": "onebit", "scaling": False},
    {"compressor": "topk", "k": 3}, {"compressor": "randomk", "k": 3},
    {"compressor": "dithering", "k": 4}, {"compressor": "dithering", "k": 3,
                                          "partition": "natural", "normalize": "l2"},
    {"compressor": "bytegrad"}, {"compressor": "bytegrad", "chunk": 5},
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_input_decodes_to_zeros(params, dtype):
    c = build(params, 77, ref.TORCH_DTYPE[dtype])
    y = c.decompress(c.compress(torch.zeros(77, dtype=ref.TORCH_DTYPE[dtype])))
    assert y.dtype == ref.TORCH_DTYPE[dtype] and y.shape == (77,)
    assert not torch.isnan(y).any() and (y == 0).all()


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("form", ["tensor", "memoryview"])
def test_a_payload_at_any_address_decodes_as_an_aligned_one(name, form):
    # a received frame may start anywhere in ZeroMQ's buffer: the kernels view its
    # parts as wider words, on a copy aligned to 8 bytes (numba compiles apart for an
    # unaligned array), and decode it the same
    c, body = chain_and_payload(name)
    expected = c.decompress(body)
    for offset in range(1, 8):
        room = torch.zeros(len(body) + offset, dtype=torch.uint8)
        room[offset:] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        payload = room[offset:] if form == "tensor" else memoryview(room.numpy())[offset:]
        assert payload_bytes(payload).ctypes.data % 8 == 0, offset
        assert torch.equal(c.decompress(payload), expected), offset
