"""Cutting tensors into partitions and placing partition keys on servers.

Usage::

    from bps.worker.partition import partition, Placement
    partition(10_000_000, 4, 4096000)   # -> [(0, 1024000), (1024000, 1024000), ...]
    placement = Placement(num_servers=2)
    placement.place(key=0, nbytes=4096000)   # -> 0
    placement.place(key=1, nbytes=4096000)   # -> 1
    plan_servers([15_000, 40_000, 22_000, 40_000], num_servers=2)   # -> [1, 0, 0, 1]

Placement is greedy least-loaded in declaration order (ties go to the lowest server
index): it needs no communication and is identical on every worker as long as the
workers declare the same keys with the same sizes in the same order, which the
trainer does (parameter order). ``plan_servers`` does better when all sizes are known
up front, as in the trainer: largest first (LPT), so a small key cannot land on top
of a large one that a later, equally large key then has to match.
"""

from __future__ import annotations


def partition(numel: int, itemsize: int, partition_bytes: int) -> list[tuple[int, int]]:
    """Cut ``numel`` elements into ``(offset, length)`` slices of at most ``partition_bytes``.

    Every slice but the last holds ``partition_bytes // itemsize`` elements.
    """
    if numel < 0 or itemsize < 1:
        raise ValueError(f"bad numel={numel} or itemsize={itemsize}")
    per_part = max(1, partition_bytes // itemsize)
    if numel == 0:
        return [(0, 0)]
    return [(start, min(per_part, numel - start)) for start in range(0, numel, per_part)]


def least_loaded(loads: list[int]) -> int:
    """The index of the smallest load (ties: the lowest index)."""
    return min(range(len(loads)), key=lambda s: (loads[s], s))


def plan_servers(sizes: list[int], num_servers: int,
                 loads: list[int] | None = None) -> list[int]:
    """A server index for each of ``sizes``: largest first onto the least-loaded server
    (ties: the earlier size, the lower server), starting from ``loads`` (zeros if None).

    Deterministic: the same sizes in the same order give the same plan on every worker.
    Its largest load is at most 4/3 of the optimum (Graham's LPT bound).
    """
    if num_servers < 1:
        raise ValueError(f"num_servers={num_servers}: need at least one server")
    loads = [0] * num_servers if loads is None else list(loads)
    if len(loads) != num_servers:
        raise ValueError(f"{len(loads)} loads for {num_servers} servers")
    servers = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        servers[i] = least_loaded(loads)
        loads[servers[i]] += sizes[i]
    return servers


class Placement:
    """Deterministic, byte-balanced key -> server assignment."""

    def __init__(self, num_servers: int) -> None:
        if num_servers < 1:
            raise ValueError(f"num_servers={num_servers}: need at least one server")
        self.loads = [0] * num_servers
        self.servers: dict[int, int] = {}

    def place(self, key: int, nbytes: int, server: int | None = None) -> int:
        """The server index for ``key`` (stable: a key keeps its server once placed):
        ``server`` if given (a plan made elsewhere), else the least-loaded one."""
        if server is not None and not 0 <= server < len(self.loads):
            raise ValueError(f"key {key}: server {server} out of range "
                             f"(there are {len(self.loads)} servers)")
        if key not in self.servers:
            if server is None:
                server = least_loaded(self.loads)
            self.loads[server] += nbytes
            self.servers[key] = server
        return self.servers[key]

    def unplace(self, key: int, nbytes: int) -> None:
        """Undo :meth:`place` (a declaration the server refused)."""
        server = self.servers.pop(key, None)
        if server is not None:
            self.loads[server] -= nbytes
