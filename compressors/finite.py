"""Finiteness checks fused into passes that already read a tensor.

``divide_finite`` is the trainer's divide of a gradient by the number of workers with
the check in the same pass (``divide_checked`` runs it on threads for large tensors);
``all_finite`` is the check alone (servers, raw pushes), ``no_max_exponent`` the same
on the bits of float16/bfloat16 values, and ``tensor_finite`` picks one for a tensor;
``join_finite`` checks a raw push as it joins its frames, ``frames_finite`` where they
lie.
Both keep the flag as an integer OR, so the loop still vectorises (a float reduction
would not, without reassociating the arithmetic). ``limit`` is the magnitude the
values must stay under: ``inf``, or 65520 where they travel as float16 (the smallest
magnitude that rounds to inf there).

Example::

    >>> import numpy as np
    >>> x = np.array([3.0, -6.0, np.inf], dtype=np.float32)
    >>> out = np.empty_like(x)
    >>> divide_finite(x[:2], np.float32(3.0), np.float32(np.inf), out[:2]), out[:2]
    (True, array([ 1., -2.], dtype=float32))
    >>> all_finite(x, np.float32(np.inf))
    False
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numba import njit

from .base import EXPONENT_MASK, KERNEL_FLOAT_DTYPES, NUMPY_FLOAT
from .threads import chunk_bounds, run_chunks

FLOAT16_LIMIT = 65520.0  # |x| >= this rounds to inf in float16
_HALF_EXPONENT = {dtype: EXPONENT_MASK[dtype] for dtype in (torch.float16, torch.bfloat16)}


@njit(nogil=True, cache=True)
def divide_finite(x, divisor, limit, out):
    """``out = x / divisor`` (rounded as torch rounds); whether every |out| < limit."""
    bad = 0
    for i in range(x.size):
        value = x[i] / divisor
        out[i] = value
        bad |= not abs(value) < limit
    return bad == 0


@njit(nogil=True, cache=True)
def divide_finite_inplace(x, divisor, limit):
    """``x /= divisor`` in place (a kernel of its own: with ``out`` aliasing ``x`` the
    loop above does not vectorise); whether every |x| < limit afterwards."""
    bad = 0
    for i in range(x.size):
        value = x[i] / divisor
        x[i] = value
        bad |= not abs(value) < limit
    return bad == 0


@njit(nogil=True, cache=True)
def all_finite(x, limit):
    """Whether every |x| < limit (NaN never is)."""
    bad = 0
    for i in range(x.size):
        bad |= not abs(x[i]) < limit
    return bad == 0


@njit(nogil=True, cache=True)
def no_max_exponent(bits, mask):
    """Whether no value's exponent bits (``mask``) are all set: float16/bfloat16 values
    given as raw uint16 bits are then all finite (numba has no 16-bit floats)."""
    bad = 0
    for i in range(bits.size):
        bad |= (bits[i] & mask) == mask
    return bad == 0


@njit(nogil=True, cache=True)
def copy_finite(source, limit, out):
    """``out[:] = source`` (float32/float64); whether every |value| < limit."""
    bad = 0
    for i in range(source.size):
        value = source[i]
        out[i] = value
        bad |= not abs(value) < limit
    return bad == 0


@njit(nogil=True, cache=True)
def copy_no_max_exponent(bits, mask, out):
    """``out[:] = bits`` (float16/bfloat16 values as raw uint16 bits); whether no value's
    exponent bits (``mask``) are all set."""
    bad = 0
    for i in range(bits.size):
        value = bits[i]
        out[i] = value
        bad |= (value & mask) == mask
    return bad == 0


def join_finite(buffers: Sequence[Any], out: torch.Tensor) -> bool:
    """Copy the bytes of ``buffers`` (a payload's frames, in order) into ``out`` (a
    contiguous CPU tensor of as many bytes) and say whether every value is finite, in one
    pass where each frame holds whole, aligned elements of a dtype with a kernel here
    (else a join, then a check).

        >>> out = torch.empty(3)
        >>> values = np.array([1.0, 2.0, np.inf], dtype=np.float32)
        >>> join_finite([values[:2].tobytes(), values[2:].tobytes()], out), out
        (False, tensor([1., 2., inf]))
    """
    target = out.reshape(-1).view(torch.uint8).numpy()
    kind = _element_kind(out.dtype)
    sources = None if kind is None else _whole_elements(buffers, out.element_size())
    if sources is None:
        np.concatenate([np.frombuffer(buffer, dtype=np.uint8) for buffer in buffers],
                       out=target)
        return tensor_finite(out)
    view, bound = kind
    copy = copy_no_max_exponent if view is np.uint16 else copy_finite
    finite, start = True, 0
    for part in sources:
        finite &= bool(copy(part.view(view), bound, target[start:start + part.size].view(view)))
        start += part.size
    return finite


def frames_finite(buffers: Sequence[Any], dtype: torch.dtype) -> bool | None:
    """Whether every ``dtype`` value of ``buffers`` (a payload's frames) is finite, each
    frame checked where it lies; None where a frame cuts an element in two or is not
    aligned to one (the payload is then joined first).

        >>> frames_finite([np.ones(2, np.float32).tobytes(), b"\\0\\0\\x80\\x7f"], torch.float32)
        False
    """
    kind = _element_kind(dtype)
    arrays = None if kind is None else _whole_elements(buffers, dtype.itemsize)
    if arrays is None:
        return None
    view, bound = kind
    check = no_max_exponent if view is np.uint16 else all_finite
    return all(check(array.view(view), bound) for array in arrays)


def _element_kind(dtype: torch.dtype) -> tuple[type, np.generic] | None:
    """(what the kernels here read ``dtype``'s values as, the bound they check: inf for
    float32/float64, the exponent mask for float16/bfloat16 bits); None for others."""
    if dtype in KERNEL_FLOAT_DTYPES:
        return NUMPY_FLOAT[dtype], NUMPY_FLOAT[dtype](np.inf)
    if dtype in _HALF_EXPONENT:
        return np.uint16, np.uint16(_HALF_EXPONENT[dtype])
    return None


def _whole_elements(buffers: Sequence[Any], width: int) -> list[np.ndarray] | None:
    """``buffers`` as uint8 arrays, or None where one does not hold whole elements of
    ``width`` bytes at an address aligned to them (numba would compile another kernel
    for unaligned arrays)."""
    arrays = [np.frombuffer(buffer, dtype=np.uint8) for buffer in buffers]
    if any(array.size % width or array.ctypes.data % width for array in arrays):
        return None
    return arrays


def divide_checked(x: np.ndarray, divisor: float, limit: float,
                   out: np.ndarray | None = None) -> bool:
    """``out = x / divisor`` (in place without ``out``) on threads for large arrays
    (``threads.chunk_bounds``); whether every result is below ``limit`` in magnitude."""
    divisor, limit = x.dtype.type(divisor), x.dtype.type(limit)
    bounds = chunk_bounds(x.size)
    if len(bounds) == 1:  # most tensors: the kernel here, no closure
        return divide_finite_inplace(x, divisor, limit) if out is None \
            else divide_finite(x, divisor, limit, out)
    if out is None:
        kernel = lambda lo, hi: divide_finite_inplace(x[lo:hi], divisor, limit)  # noqa: E731
    else:
        kernel = lambda lo, hi: divide_finite(x[lo:hi], divisor, limit, out[lo:hi])  # noqa: E731
    return all(run_chunks(kernel, bounds))



def tensor_finite(tensor: torch.Tensor, limit: float = np.inf) -> bool:
    """Whether every |value| of a tensor is < ``limit``: numba passes for contiguous CPU
    tensors (float16/bfloat16 on their bits, where ``limit`` must be inf), torch
    otherwise (CUDA, strided)."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        if tensor.dtype in (torch.float32, torch.float64):
            array = tensor.reshape(-1).numpy()
            return bool(all_finite(array, array.dtype.type(limit)))
        if tensor.dtype in _HALF_EXPONENT and limit == np.inf:
            bits = tensor.reshape(-1).view(torch.int16).numpy().view(np.uint16)
            return bool(no_max_exponent(bits, np.uint16(_HALF_EXPONENT[tensor.dtype])))
    if limit == np.inf:
        return bool(torch.isfinite(tensor).all())
    return bool((tensor.abs() < limit).all())
