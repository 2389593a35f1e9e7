"""Cutting tensors into partitions and placing partition keys on servers.

Usage::

    from bps.worker.partition import partition, Placement
    partition(10_000_000, 4, 4096000)   # -> [(0, 1024000), (1024000, 1024000), ...]
    placement = Placement(num_servers=2)
    placement.place(key=0, nbytes=4096000)   # -> 0
    placement.place(key=1, nbytes=4096000)   # -> 1

Placement is greedy least-loaded in declaration order (ties go to the lowest server
index): it needs no communication and is identical on every worker as long as the
workers declare the same keys with the same sizes in the same order, which the
trainer does (parameter order).
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


class Placement:
    """Deterministic, byte-balanced key -> server assignment."""

    def __init__(self, num_servers: int) -> None:
        if num_servers < 1:
            raise ValueError(f"num_servers={num_servers}: need at least one server")
        self.loads = [0] * num_servers
        self.servers: dict[int, int] = {}

    def place(self, key: int, nbytes: int) -> int:
        """The server index for ``key`` (stable: a key keeps its server once placed)."""
        if key not in self.servers:
            server = min(range(len(self.loads)), key=lambda s: (self.loads[s], s))
            self.loads[server] += nbytes
            self.servers[key] = server
        return self.servers[key]

    def unplace(self, key: int, nbytes: int) -> None:
        """Undo :meth:`place` (a declaration the server refused)."""
        server = self.servers.pop(key, None)
        if server is not None:
            self.loads[server] -= nbytes
