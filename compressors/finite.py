"""Finiteness checks fused into passes that already read a tensor.

``divide_finite`` is the trainer's divide of a gradient by the number of workers with
the check in the same pass (``divide_checked`` runs it on threads for large tensors);
``all_finite`` is the check alone (servers, raw pushes), ``no_max_exponent`` the same
on the bits of float16/bfloat16 values, and ``tensor_finite`` picks one for a tensor.
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

import numpy as np
import torch
from numba import njit

from .threads import chunk_bounds, run_chunks

FLOAT16_LIMIT = 65520.0  # |x| >= this rounds to inf in float16


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


def divide_checked(x: np.ndarray, divisor: float, limit: float,
                   out: np.ndarray | None = None) -> bool:
    """``out = x / divisor`` (in place without ``out``) on threads for large arrays
    (``threads.chunk_bounds``); whether every result is below ``limit`` in magnitude."""
    divisor, limit = x.dtype.type(divisor), x.dtype.type(limit)
    if out is None:
        kernel = lambda lo, hi: divide_finite_inplace(x[lo:hi], divisor, limit)  # noqa: E731
    else:
        kernel = lambda lo, hi: divide_finite(x[lo:hi], divisor, limit, out[lo:hi])  # noqa: E731
    return all(run_chunks(kernel, chunk_bounds(x.size)))


_HALF_EXPONENT = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}


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
