"""The device path: a codec thread sleeps while its device works; a randomk reply goes
up once, its indices drawn on the host, and decodes as the host decoder does.

Staged encodes and decodes of every compressor are tested in test_device_graphs.py (the
CPU path, as ``BPS_DEVICE_KERNELS=1`` forces it); what only a GPU shows is marked
``cuda``.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

from bps.worker.device_path import KeyStaging, on_side_stream, wait_side_stream


def test_on_the_cpu_waiting_is_a_no_op():
    device = torch.device("cpu")
    with on_side_stream(device, ready=None):
        x = torch.arange(3) * 2
    wait_side_stream(device)
    assert x.tolist() == [0, 2, 4]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_codec_thread_sleeps_while_it_waits_for_its_side_stream():
    # a spinning event (the default) burns a core for the whole wait
    device = torch.device("cuda", 0)
    with on_side_stream(device, ready=None):
        torch.cuda._sleep(200_000_000)  # some 0.1-0.2 s of GPU time
    wall, cpu = time.perf_counter(), time.thread_time()
    wait_side_stream(device)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall > 0.02, "the kernel ended before the wait: nothing measured"
    assert cpu < 0.5 * wall, f"the wait used {cpu:.3f} s of CPU in {wall:.3f} s"


def reply_frames(payload: np.ndarray) -> list[bytes]:
    data = payload.tobytes()
    return [data[:7], data[7:]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_a_staged_randomk_decode_is_the_host_decoders(dtype):
    # the indices are drawn on the host, where the reply is, and go up with it: the
    # result is the host (numba) decoder's, bit for bit, odd k and float16 included
    from bps.compressors.randomk import RandomK
    from bps.compressors.randomk_torch import RandomKTorch
    numel, k = 101, 13
    host = RandomK(numel, dtype, k=k, seed=5)
    device = RandomKTorch(numel, dtype, k=k, seed=5, device="cpu")
    staging = KeyStaging(torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        payload = host.compress(torch.randn(numel, generator=gen).to(dtype)).numpy().copy()
        expected = RandomK(numel, dtype, k=k, seed=5).decompress(payload.copy())
        out = torch.full((numel,), 7.0, dtype=dtype)
        assert staging.decode(device, reply_frames(payload), out) is out
        assert torch.equal(out.view(torch.int16 if dtype == torch.float16 else torch.int32),
                           expected.view(torch.int16 if dtype == torch.float16 else torch.int32))


def test_a_staged_randomk_decode_refuses_what_the_host_decoder_refuses():
    from bps.compressors.randomk import RandomK
    from bps.compressors.randomk_torch import RandomKTorch
    host = RandomK(50, torch.float32, k=5, seed=1)
    payload = host.compress(torch.randn(50)).numpy().copy()
    payload[16:20] = np.frombuffer(np.float32(np.nan).tobytes(), dtype=np.uint8)
    with pytest.raises(ValueError) as refused:
        host.decompress(payload.copy())
    device = RandomKTorch(50, torch.float32, k=5, seed=1, device="cpu")
    with pytest.raises(ValueError, match=re.escape(str(refused.value))):
        KeyStaging(torch.device("cpu")).decode(device, reply_frames(payload), None)
    with pytest.raises(ValueError, match="expected exactly"):
        KeyStaging(torch.device("cpu")).decode(device, reply_frames(payload[:-1]), None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_a_staged_dithering_decode_is_the_host_decoders(dtype):
    # decoded on the host, where the reply is, and only the values go up
    from bps.compressors.dithering import Dithering
    from bps.compressors.dithering_torch import DitheringTorch
    numel = 301
    host = Dithering(numel, dtype, levels=4, seed=3)
    device = DitheringTorch(numel, dtype, levels=4, seed=3, device="cpu")
    staging = KeyStaging(torch.device("cpu"))
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        payload = host.compress(torch.randn(numel, generator=gen).to(dtype)).numpy().copy()
        expected = Dithering(numel, dtype, levels=4, seed=3).decompress(payload.copy())
        out = torch.full((numel,), 7.0, dtype=dtype)
        assert staging.decode(device, reply_frames(payload), out) is out
        assert torch.equal(out.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                           expected.view(torch.int16 if dtype.itemsize == 2 else torch.int32))
        alone = staging.decode(device, reply_frames(payload), None)
        staging.decode(device, reply_frames(payload[:]), torch.empty(numel, dtype=dtype))
        assert torch.equal(alone, expected)  # not a view of the key's upload buffer


def test_a_staged_dithering_decode_refuses_what_the_host_decoder_refuses():
    from bps.compressors.dithering import Dithering
    from bps.compressors.dithering_torch import DitheringTorch
    host = Dithering(64, torch.float32, levels=4, seed=1)
    payload = host.compress(torch.randn(64)).numpy().copy()
    payload[-1] ^= 0x80  # the trailer's scale negated: refused by the host decoder
    with pytest.raises(ValueError) as refused:
        host.decompress(payload.copy())
    device = DitheringTorch(64, torch.float32, levels=4, seed=1, device="cpu")
    with pytest.raises(ValueError, match=re.escape(str(refused.value))):
        KeyStaging(torch.device("cpu")).decode(device, reply_frames(payload), None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_side_streams_are_bps_own_and_reused_once_given_back():
    # torch's pool hands its streams to any caller (NCCL, libraries): none of them
    import threading

    from bps.worker.device_path import _side_stream
    device = torch.device("cuda", 0)
    pool = {torch.cuda.Stream(device, priority=p).cuda_stream
            for p in (0, -1) for _ in range(80)}
    pool.add(torch.cuda.default_stream(device).cuda_stream)
    handles: list[int] = []

    def codec_thread() -> None:
        stream = _side_stream(device)
        handles.append(stream.cuda_stream)
        with torch.cuda.stream(stream):  # it works as a stream
            handles.append(int((torch.arange(4, device=device) * 2).sum().item()))

    for _ in range(2):
        thread = threading.Thread(target=codec_thread)
        thread.start()
        thread.join(timeout=30)
    assert handles[1] == handles[3] == 12
    assert handles[0] not in pool
    assert handles[0] == handles[2]  # the ended thread's stream, taken again
