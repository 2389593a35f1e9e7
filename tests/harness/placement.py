"""Loads of a key-to-server assignment, and the best any assignment can do (brute force)."""

from __future__ import annotations

import itertools
import math


def optimal_max_load(sizes: list[int], servers: int, loads: list[int] | None = None) -> int:
    """The smallest possible largest load, by trying every assignment."""
    start = loads or [0] * servers
    best = math.inf
    for assignment in itertools.product(range(servers), repeat=len(sizes)):
        totals = list(start)
        for server, size in zip(assignment, sizes, strict=True):
            totals[server] += size
        best = min(best, max(totals))
    return best


def plan_loads(sizes: list[int], servers: list[int], count: int,
               loads: list[int] | None = None) -> list[int]:
    totals = list(loads or [0] * count)
    for server, size in zip(servers, sizes, strict=True):
        totals[server] += size
    return totals
