"""Run a nogil numba kernel over chunks of a large array on several threads.

numba's own ``parallel=True`` (workqueue layer) aborts when two Python threads launch
parallel kernels at once, and the worker engine compresses partitions on several
threads. Plain threads around ``nogil`` kernels are safe: the caller runs the first
chunk itself, the pool only ever runs leaf tasks, so nothing can deadlock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MIN_CHUNK = 1 << 20  # elements: below this, thread hand-off costs more than it saves
ALIGN = 32  # chunk bounds are multiples of 32 elements (one onebit word)
THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))  # the cores this process may run on
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def chunk_bounds(n: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into at most THREADS aligned chunks of at least MIN_CHUNK."""
    count = max(1, min(THREADS, n // MIN_CHUNK))
    step = -(-n // count)
    step = -(-step // ALIGN) * ALIGN
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def run_chunks(kernel: Callable, bounds: list[tuple[int, int]]) -> list:
    """``[kernel(lo, hi) for lo, hi in bounds]``, the chunks after the first on the pool."""
    global _pool
    if len(bounds) == 1:
        return [kernel(*bounds[0])]
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS - 1, thread_name_prefix="bps-kernel")
    futures = [_pool.submit(kernel, lo, hi) for lo, hi in bounds[1:]]
    first = kernel(*bounds[0])
    return [first] + [f.result() for f in futures]


def copy_chunks(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` in chunks on several threads (numpy releases the GIL while it
    copies): one core moves memory at well below the machine's bandwidth."""
    run_chunks(lambda lo, hi: np.copyto(dst[lo:hi], src[lo:hi]), chunk_bounds(dst.size))
