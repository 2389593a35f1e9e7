"""The side streams' waits: a codec thread sleeps while its device works.

The device path's staging and decodes are tested in test_device_graphs.py (the CPU path
forced with ``BPS_DEVICE_KERNELS=1``); what only a GPU shows is here, marked ``cuda``.
"""

from __future__ import annotations

import time

import pytest
import torch

from bps.worker.device_path import on_side_stream, wait_side_stream


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
