"""Chains' states compared bit for bit: the tests of the device chains share these."""

from __future__ import annotations

import torch

from bps.compressors.device import int_view


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits on the CPU (signed zeros and NaN payloads compare as bits)."""
    return int_view(tensor.detach().cpu().contiguous())


def assert_same_state(host: dict, device: dict, path: str = "") -> None:
    """Two ``state_dict()``s alike: the same keys, tensors with the same bits, the same
    numbers; ``path`` names where they differ."""
    assert host.keys() == device.keys(), path
    for key in host:
        a, b = host[key], device[key]
        if isinstance(a, dict):
            assert_same_state(a, b, f"{path}.{key}")
        elif isinstance(a, torch.Tensor):
            assert torch.equal(bits(a), bits(b)), f"{path}.{key}"
        else:
            assert a == b, f"{path}.{key}"
