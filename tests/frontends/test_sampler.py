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


LEAVING_JOB = """
import os, signal, sys, torch, bps
bps.init()
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = bps.DistributedTrainer(model, optimizer, {"compressor": "onebit", "ef": "vanilla"})
sampler = bps.ElasticSampler(range(50), seed=3)
for step in range(5):
    if step == 2 and os.environ["DMLC_WORKER_ID"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.full((2, 8), (bps.rank() + step) / 8)
    trainer.zero_grad()
    model(x).sum().backward()
    trainer.step()
sampler.set_epoch(1)
total = sum(float(p.double().sum()) for p in model.parameters())
print("after", bps.size(), repr(total), len(sampler), *sampler, flush=True)
bps.shutdown()
"""


# under the node agent: tests/frontends/test_trainer_elastic.py has the same kill, exactly
@pytest.mark.parametrize("agent", ["0", pytest.param("1", marks=pytest.mark.slow)])
def test_after_a_node_leaves_every_local_rank_deals_over_the_survivors(agent) -> None:
    """3 worker nodes of 2 local ranks, node 1 killed at step 2 (--min-workers 2), with
    and without the node agent: every survivor, local rank 1 too, learns the members
    present; their models agree and their shards of the next epoch cover the data set
    once."""
    code, output = run_command(
        BPSLAUNCH + ["local", "--workers", "3", "--servers", "1", "--local-size", "2",
                     "--min-workers", "2", "--", sys.executable, "-c", LEAVING_JOB],
        {**TEST_ENV, "BPS_NODE_AGENT": agent}, timeout=150)
    assert code == 0, output[-4000:]
    lines = {line.split("] ")[0][1:]: line.split()[2:] for line in output.splitlines()
             if "] after " in line}
    assert sorted(lines) == ["worker0.0", "worker0.1", "worker2.0", "worker2.1"], output
    assert {tuple(f[:2]) for f in lines.values()} == {("4", lines["worker0.0"][1])}, lines
    shards = {name: [int(i) for i in f[3:]] for name, f in lines.items()}
    for position, name in enumerate(sorted(shards)):
        assert shards[name] == deal(50, position, 4, epoch=1, seed=3), name
        assert int(lines[name][2]) == len(shards[name]) == 13
