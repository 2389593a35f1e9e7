"""Keep message-sized buffers in the heap: glibc ``mallopt`` for server and worker processes.

Every ZeroMQ message of a partition (4 MB by default) is a fresh ``malloc`` on the
context's I/O thread. With glibc's defaults such a block comes from that thread's own
arena, whose heaps are at most 64 MB and are unmapped as soon as they empty, or from
``mmap``; either way the I/O thread page-faults through every message it receives
(measured: 50,000-130,000 faults/s per process in ``bench/ps_throughput.py``, about
10% of the step time). One arena with a fixed mmap threshold above the largest partition
and no trimming makes those blocks reuse the same pages. The process keeps its peak heap.

Usage (the server and the worker engine call it before creating their sockets)::

    from bps.common.memory import keep_buffers_in_heap
    keep_buffers_in_heap()   # False where the C library is not glibc or BPS_MALLOC_TUNE=0
"""

from __future__ import annotations

import ctypes

from bps.common.env import malloc_tune

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: blocks below it come from the heap
TRIM_THRESHOLD_BYTES = 1 << 30  # give memory back only when this much is free at the top


def keep_buffers_in_heap() -> bool:
    """Set glibc's arena count and thresholds for this process; returns whether it did.

    Threads that already allocated keep their arena, so call it before the ZeroMQ
    context starts its I/O thread (its first socket)."""
    if not malloc_tune():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator alone
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all([mallopt(M_ARENA_MAX, 1), mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)])
