"""Compile the host chains' numba kernels before a job: ``python -m bps.compressors.warm``.

numba keeps compiled kernels on disk (``cache=True``), but on a cold cache every process
of a job compiles the kernels it needs inside its first steps, each for itself: a
``bpslaunch local`` job with two workers and a server compiles the same kernels three
times over, on cores its training needs. :func:`warm_kernels` runs every call a step
makes through a throwaway worker chain and server chain of each configuration, so the
job's processes load the kernels instead. ``make setup`` runs it once.

Example::

    >>> from bps.compressors.warm import warm_kernels
    >>> warm_kernels([{"compressor": "onebit", "ef": "vanilla"}], numel=64)  # 3 dtypes
    3
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence

import torch

from .finite import tensor_finite
from .registry import build

# Every built-in host chain in the forms jobs use most: error feedback and the
# worker's Nesterov momentum around each compressor, and dithering's other options.
BUILTIN_CHAINS: tuple[dict, ...] = tuple(
    {**params, "ef": "vanilla", "momentum": "nesterov"} for params in (
        {"compressor": "onebit"},
        {"compressor": "onebit", "scaling": True},
        {"compressor": "topk", "k": 0.01},
        {"compressor": "randomk", "k": 0.01},
        {"compressor": "dithering", "k": 4},
        {"compressor": "dithering", "k": 4, "partition": "natural", "normalize": "l2"},
        {"compressor": "bytegrad"},
    ))
# bfloat16's bit kernels are float16's (16-bit words)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.float64)


def warm_kernels(chains: Iterable[dict] = BUILTIN_CHAINS, numel: int = 4096,
                 dtypes: Sequence[torch.dtype] = KERNEL_DTYPES) -> int:
    """Compile (or load from numba's cache) the kernels of each chain in ``chains``, a
    ``compression_params`` dict each, for partitions of each dtype in ``dtypes``; returns
    how many chains ran. PowerSGD has nothing to compile (torch matrix products)."""
    ran = 0
    for dtype in dtypes:
        tensor_finite(torch.ones(numel, dtype=dtype))  # the servers' check of raw pushes
        for params in chains:
            params = {**params, "mu": 0.9} if params.get("momentum") else params
            worker = build(params, numel, dtype)
            server = build(params, numel, dtype, role="server")
            out, total = torch.empty(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)
            for lr in (0.05, 0.04):  # the second step rescales error feedback's error
                worker.set_lr(lr)
                server.set_lr(lr)
                payload = worker.compress(torch.randn(numel, dtype=dtype))
                # a payload from a ZeroMQ frame is read-only: numba compiles that apart
                for form in (payload, payload.numpy().tobytes()):
                    server.decompress(form, total)
                    server.decompress_add(form, total, out)
                pulled = server.compress(total)
                for form in (pulled, pulled.numpy().tobytes()):
                    worker.decompress(form, out)
            ran += 1
    return ran


def main() -> int:
    started = time.monotonic()
    ran = warm_kernels()
    print(f"bps: the kernels of {ran} compressor chains compiled or loaded from numba's "
          f"cache in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
