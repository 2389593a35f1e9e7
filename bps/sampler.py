"""A sampler that deals a data set over the worker processes present, epoch by epoch.

torch's ``DistributedSampler`` fixes its shard when it is made: after a worker node leaves
the job (``BPS_MIN_WORKERS``, docs/runtime.md "Elastic membership") the shards of the
nodes that left are never read again. :class:`ElasticSampler` deals anew at the start of
each epoch over the worker processes present then, the way ``DistributedSampler`` deals
over a fixed world: with every node present the two give the same indices.

Example::

    sampler = bps.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch

from bps.core import runtime as bps_runtime


def deal(length: int, position: int, count: int, *, epoch: int = 0, seed: int = 0,
         shuffle: bool = True, drop_last: bool = False) -> list[int]:
    """The indices of ``range(length)`` that process ``position`` of ``count`` reads in
    ``epoch``: a permutation seeded by ``seed + epoch`` (or the identity), cut to a
    multiple of ``count`` (``drop_last``) or padded from its start, every ``count``-th
    from ``position``. The same indices as ``DistributedSampler(num_replicas=count,
    rank=position)`` of that epoch.

        >>> deal(5, 0, 2, shuffle=False), deal(5, 1, 2, shuffle=False)
        ([0, 2, 4], [1, 3, 0])
    """
    if not 0 <= position < count:
        raise ValueError(f"position {position} is not one of {count} processes")
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(length, generator=generator).tolist()
    else:
        order = list(range(length))
    if drop_last:
        total = length // count * count
        order = order[:total]
    else:
        total = math.ceil(length / count) * count
        while len(order) < total:
            order += order[:total - len(order)]
    return order[position:total:count]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Deals ``dataset``'s indices over the worker processes present when each epoch
    starts (its iterator is made): the nodes present in worker-id order, each node's local
    ranks in order. Call :meth:`set_epoch` before each epoch, as with
    ``DistributedSampler``; iterate after ``bps.init()``.

    Args:
        dataset: anything with ``len()``.
        shuffle: a fresh permutation each epoch, seeded by ``seed + epoch`` (the same on
            every process).
        seed: the permutation's seed.
        drop_last: cut the epoch to a multiple of the processes present, instead of
            padding it with its first indices.
    """

    def __init__(self, dataset: Sized, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        self.length = len(dataset)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iterator deals (its permutation)."""
        self.epoch = epoch

    def _placement(self) -> tuple[int, int]:
        """(this process's position, the processes present)."""
        rt = bps_runtime.get()
        return (rt.members.index(rt.node_id) * rt.local_size + rt.local_rank,
                len(rt.members) * rt.local_size)

    def __iter__(self) -> Iterator[int]:
        position, count = self._placement()
        return iter(deal(self.length, position, count, epoch=self.epoch, seed=self.seed,
                         shuffle=self.shuffle, drop_last=self.drop_last))

    def __len__(self) -> int:
        _, count = self._placement()
        return self.length // count if self.drop_last else math.ceil(self.length / count)
