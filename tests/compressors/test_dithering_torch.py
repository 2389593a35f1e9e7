"""dithering's (and terngrad's) draws on the device: the host's bytes, in few kernels.

The device jumps a generator to each span of ``STEPS`` draws and steps them side by side
(``draw_all``); its payloads are compared, bit for bit, with the host chain's (numba),
over partitions of several host-jumped blocks and a partial last span.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bps.compressors.dithering import Dithering
from bps.compressors.dithering_torch import STEPS, SUB, DitheringTorch

NUMEL = 2 * SUB * STEPS + 3 * STEPS + 5  # three blocks, the last one partial


class CountKernels(TorchDispatchMode):
    """The aten ops run in its body that launch a kernel on a GPU (views and the
    like excepted)."""

    NO_KERNEL = {"detach", "lift_fresh", "empty", "t", "_unsafe_view"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func._opname not in self.NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("options", [{"levels": 4}, {"levels": 3, "natural": True},
                                     {"levels": 100}], ids=["4", "natural", "100"])
def test_device_payloads_are_the_hosts_over_several_blocks(options):
    # normalize="max": with "l2" the scale is a sum in torch's order (docs/compression.md)
    host = Dithering(NUMEL, torch.float32, seed=11, **options)
    device = DitheringTorch(NUMEL, torch.float32, seed=11, device="cpu", **options)
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):  # the generator moves on by NUMEL draws a step
        x = torch.randn(NUMEL, generator=gen, dtype=torch.float64).float()
        a = host.compress(x.clone())
        b = device.compress(x.clone())
        assert torch.equal(a, b)


def test_an_encode_launches_a_few_kernels_per_draw_step():
    # each sequential draw step is 10 kernels (STEPS of them, 16); the rest is some 40
    # (jumps, quantise, scale). It was some 770 with 64 steps of 12.
    device = DitheringTorch(NUMEL, torch.float32, levels=4, seed=3, device="cpu")
    x = torch.randn(NUMEL)
    device.compress(x)  # the shared images made
    with CountKernels() as kernels:
        device.encode(x)
    assert kernels.count <= 10 * STEPS + 50, kernels.count
