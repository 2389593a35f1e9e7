"""bps.ElasticSampler: dealing a data set over the worker processes present."""

from __future__ import annotations

import doctest
import itertools
import sys

import pytest
from torch.utils.data import DistributedSampler

import bps.sampler
from bps.sampler import deal
from tests.harness.ps_job import BPSLAUNCH, TEST_ENV, run_command


@pytest.mark.parametrize("length,count", [(0, 2), (1, 3), (5, 2), (12, 4), (13, 4), (100, 7)])
@pytest.mark.parametrize("shuffle,drop_last", list(itertools.product([False, True], repeat=2)))
def test_a_fixed_membership_deals_as_torch_distributed_sampler(length, count, shuffle,
                                                               drop_last) -> None:
    data = range(length)
    for position, epoch in itertools.product(range(count), (0, 3)):
        reference = DistributedSampler(data, num_replicas=count, rank=position,
                                       shuffle=shuffle, seed=11, drop_last=drop_last)
        reference.set_epoch(epoch)
        assert deal(length, position, count, epoch=epoch, seed=11, shuffle=shuffle,
                    drop_last=drop_last) == list(reference)


def test_after_a_node_leaves_the_survivors_read_every_index_once() -> None:
    # 4 worker nodes of 2 local ranks; node 2 left: 6 processes deal the epoch
    members, local_size, length = [0, 1, 3], 2, 60
    shards = [deal(length, members.index(node) * local_size + rank, len(members) * local_size,
                   epoch=5, seed=1) for node in members for rank in range(local_size)]
    assert sorted(i for shard in shards for i in shard) == list(range(length))
    assert {len(shard) for shard in shards} == {10}


def test_a_position_outside_the_processes_is_refused() -> None:
    with pytest.raises(ValueError, match="position 2 is not one of 2 processes"):
        deal(10, 2, 2)


def test_docstring_examples() -> None:
    assert doctest.testmod(bps.sampler).failed == 0


def test_each_process_of_a_job_reads_its_own_shard() -> None:
    script = ("import bps\nbps.init()\n"
              "sampler = bps.ElasticSampler(range(23), seed=4)\nsampler.set_epoch(2)\n"
              "print('shard', bps.rank(), len(sampler), *sampler)\nbps.shutdown()\n")
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", "--servers", "1",
                                            "--local-size", "2", "--", sys.executable, "-c",
                                            script], TEST_ENV, timeout=120)
    assert code == 0, output
    shards = {int(f[2]): [int(i) for i in f[3:]] for f in
              (line.split() for line in output.splitlines()) if len(f) > 2 and f[1] == "shard"}
    assert sorted(shards) == [0, 1, 2, 3], output
    for rank, shard in shards.items():
        assert shard[1:] == deal(23, rank, 4, epoch=2, seed=4)
        assert shard[0] == 6
