"""state_dict <-> msgpack-friendly objects (the server sends chain state over msgpack).

Tensors become ``{"__tensor__": dtype name, "shape": [...], "data": bytes}``; ints,
floats, strings, None, lists and dicts pass through.

    >>> import msgpack, torch
    >>> sd = {"error": torch.ones(2), "inner": {"rng": [1, 2]}}
    >>> back = state_from_wire(msgpack.unpackb(msgpack.packb(state_to_wire(sd))))
    >>> back["error"], back["inner"]["rng"]
    (tensor([1., 1.]), [1, 2])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .base import SUPPORTED_DTYPES, bit_view

_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in SUPPORTED_DTYPES}
TAG = "__tensor__"


def state_to_wire(state: Any) -> Any:
    """Convert tensors in a (nested) state dict to msgpack-able dicts."""
    if isinstance(state, torch.Tensor):
        name = str(state.dtype).removeprefix("torch.")
        if state.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"cannot send a {state.dtype} tensor: expected one of {list(_BY_NAME)}"
            )
        data = bit_view(state.detach().cpu().contiguous().reshape(-1)).tobytes()
        return {TAG: name, "shape": list(state.shape), "data": data}
    if isinstance(state, dict):
        return {key: state_to_wire(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return [state_to_wire(value) for value in state]
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    raise ValueError(f"cannot send a {type(state).__name__} in a state dict")


def state_from_wire(obj: Any) -> Any:
    """Inverse of :func:`state_to_wire`; checks dtype names and byte counts."""
    if isinstance(obj, dict) and TAG in obj:
        name, shape, data = obj.get(TAG), obj.get("shape"), obj.get("data")
        if name not in _BY_NAME:
            raise ValueError(f"state tensor has dtype {name!r}: expected one of {list(_BY_NAME)}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"state tensor has a bad shape {shape!r}")
        dtype = _BY_NAME[name]
        out = torch.empty(shape, dtype=dtype)
        size = out.numel() * out.element_size()
        if not isinstance(data, (bytes, bytearray)) or len(data) != size:
            got = len(data) if isinstance(data, (bytes, bytearray)) else repr(data)
            raise ValueError(f"state tensor {name}{shape} needs {size} bytes, got {got}")
        bits = bit_view(out.reshape(-1))
        bits[:] = np.frombuffer(data, dtype=bits.dtype)
        return out
    if isinstance(obj, dict):
        return {key: state_from_wire(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [state_from_wire(value) for value in obj]
    return obj
