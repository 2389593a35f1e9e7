"""The node's sum of its local ranks' tensors, as the node agent takes it.

Each addition rounds to the tensors' dtype, in local-rank order
(``((x0 + x1) + x2) + ...``): float32 and float64 natively, float16 and bfloat16 by
widening both operands to float32, adding and rounding to nearest even (float32 holds
at least 2p + 2 bits of either, so this is the correctly rounded sum, as numpy's float16
and torch's bfloat16 arithmetic give, and as gloo's reduction of two ranks did).

    >>> import torch
    >>> a = torch.tensor([1.0, 2.0], dtype=torch.float16)
    >>> out = torch.empty_like(a)
    >>> sum_in_rank_order(out, [a, a, a]).tolist()
    [3.0, 6.0]

``make setup`` compiles the kernels into numba's cache (``python -m
bps.worker.local_sum``), so that the first node agent of several local ranks loads them:

    >>> warm_kernels()
    4
"""

from __future__ import annotations

import numba
import numpy as np
import torch

__all__ = ["SUMMABLE", "sum_in_rank_order", "warm_kernels"]

SUMMABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@numba.njit(nogil=True, cache=True)
def _add_float(acc: np.ndarray, x: np.ndarray) -> None:
    for i in range(acc.size):
        acc[i] += x[i]


@numba.njit(nogil=True, cache=True)
def _half_to_bits32(h: np.uint32) -> np.uint32:
    """float16 bits -> float32 bits (exact)."""
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = h & np.uint32(0x7C00)
    sig = h & np.uint32(0x03FF)
    if exp == 0:
        if sig == 0:
            return sign
        shift = np.uint32(0)
        sig <<= np.uint32(1)
        while (sig & np.uint32(0x0400)) == 0:
            sig <<= np.uint32(1)
            shift += np.uint32(1)
        return sign | ((np.uint32(112) - shift) << np.uint32(23)) | \
            ((sig & np.uint32(0x03FF)) << np.uint32(13))
    if exp == np.uint32(0x7C00):
        return sign | np.uint32(0x7F800000) | (sig << np.uint32(13))
    return sign | (((h & np.uint32(0x7FFF)) + np.uint32(0x1C000)) << np.uint32(13))


@numba.njit(nogil=True, cache=True)
def _bits32_to_half(f: np.uint32) -> np.uint32:
    """float32 bits -> float16 bits, rounded to nearest even (numpy's conversion)."""
    sign = (f & np.uint32(0x80000000)) >> np.uint32(16)
    exp = f & np.uint32(0x7F800000)
    if exp >= np.uint32(0x47800000):  # beyond float16's range, inf or NaN
        if exp == np.uint32(0x7F800000) and (f & np.uint32(0x007FFFFF)) != 0:
            half = np.uint32(0x7C00) + ((f & np.uint32(0x007FFFFF)) >> np.uint32(13))
            if half == np.uint32(0x7C00):
                half += np.uint32(1)  # still a NaN
            return sign + half
        return sign + np.uint32(0x7C00)
    if exp <= np.uint32(0x38000000):  # a subnormal float16, or zero
        if exp < np.uint32(0x33000000):
            return sign
        sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
        sig >>= np.uint32(113) - (exp >> np.uint32(23))
        if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000) or (f & np.uint32(0x07FF)) != 0:
            sig += np.uint32(0x1000)
        return sign + (sig >> np.uint32(13))
    half_exp = (exp - np.uint32(0x38000000)) >> np.uint32(13)
    sig = f & np.uint32(0x007FFFFF)
    if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
        sig += np.uint32(0x1000)
    return sign + half_exp + (sig >> np.uint32(13))


@numba.njit(nogil=True, cache=True)
def _add_half(acc: np.ndarray, x: np.ndarray) -> None:
    """``acc += x`` on float16 bits (uint16 arrays)."""
    bits = np.empty(3, dtype=np.uint32)
    floats = bits.view(np.float32)
    for i in range(acc.size):
        bits[0] = _half_to_bits32(np.uint32(acc[i]))
        bits[1] = _half_to_bits32(np.uint32(x[i]))
        floats[2] = floats[0] + floats[1]
        acc[i] = np.uint16(_bits32_to_half(bits[2]))


@numba.njit(nogil=True, cache=True)
def _add_bfloat(acc: np.ndarray, x: np.ndarray) -> None:
    """``acc += x`` on bfloat16 bits (uint16 arrays), rounded as torch rounds."""
    bits = np.empty(3, dtype=np.uint32)
    floats = bits.view(np.float32)
    for i in range(acc.size):
        bits[0] = np.uint32(acc[i]) << np.uint32(16)
        bits[1] = np.uint32(x[i]) << np.uint32(16)
        floats[2] = floats[0] + floats[1]
        if floats[2] != floats[2]:
            acc[i] = np.uint16(0x7FC0)
        else:
            total = bits[2]
            total += np.uint32(0x7FFF) + ((total >> np.uint32(16)) & np.uint32(1))
            acc[i] = np.uint16(total >> np.uint32(16))


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A flat numpy view of ``tensor`` (16-bit floats as their bits)."""
    flat = tensor.reshape(-1)
    if tensor.dtype in (torch.float16, torch.bfloat16):
        flat = flat.view(torch.int16)
        return flat.numpy().view(np.uint16)
    return flat.numpy()


def sum_in_rank_order(out: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """``out`` = the sum of ``parts`` (contiguous CPU tensors of ``out``'s dtype and
    numel, the local ranks' in order), one rounding per addition; returns ``out``."""
    if out.dtype not in SUMMABLE:
        raise TypeError(f"the node agent sums {SUMMABLE}, not {out.dtype}")
    if any(p.dtype != out.dtype or p.numel() != out.numel() for p in parts):
        raise TypeError(f"the local ranks' tensors differ from {out.numel()} x {out.dtype}")
    acc = _array(out)
    acc[:] = _array(parts[0])
    if out.dtype == torch.float16:
        add = _add_half
    elif out.dtype == torch.bfloat16:
        add = _add_bfloat
    else:
        add = _add_float
    for part in parts[1:]:
        add(acc, _array(part))
    return out


def warm_kernels() -> int:
    """Compile (or load from numba's cache) the kernels of every dtype in ``SUMMABLE``;
    returns how many dtypes ran."""
    for dtype in SUMMABLE:
        parts = [torch.linspace(-1.0, 1.0, 64).to(dtype) for _ in range(2)]
        sum_in_rank_order(torch.empty(64, dtype=dtype), parts)
    return len(SUMMABLE)


if __name__ == "__main__":
    import sys
    import time

    started = time.monotonic()
    count = warm_kernels()
    print(f"bps: the node agent's sums of local ranks ({count} dtypes) compiled or loaded "
          f"from numba's cache in {time.monotonic() - started:.1f} s", file=sys.stderr)
