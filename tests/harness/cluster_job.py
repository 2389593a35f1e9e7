"""The worker program of the cluster-launch tests (tests/launch/test_cluster.py).

Not a test module. Every process calls ``bps.init()`` and torch's
``dist.init_process_group("gloo")`` with nothing else (the rendezvous comes from the
variables the launcher exported; gloo named, since on a GPU host the default is NCCL
alone, which refuses these CPU tensors), checks that both see the same job
(rank, size), takes two DistributedTrainer steps and checks each against the mean
gradient that the user's own torch.distributed group computes (an independent
all-reduce). Once the script has destroyed its group and left bps, no gloo thread may
be left: a group still alive is torn down with the interpreter, where gloo now and then
aborts the finished process. Prints ``cluster-job ok RANK SIZE NODE LOCAL_RANK OMP_NUM_THREADS
TORCH_THREADS PIPELINE`` at the end (PIPELINE: ``agent`` where the node agent ran the
gradient pipeline, ``BPS_NODE_AGENT=1``, else ``process``)::

    bpslaunch local --workers 2 --local-size 2 -- python tests/harness/cluster_job.py
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

import bps
from bps.common.striping import proc_threads

OK = "cluster-job ok "  # the start of each rank's last line


def ok_fields(output: str) -> list[list[str]]:
    """The fields of each rank's ``cluster-job ok`` line in ``output``, in the order
    printed (RANK first, PIPELINE last)."""
    return [line.split(OK)[1].split() for line in output.splitlines() if OK in line]


def gloo_threads() -> list[str]:
    """The names of this process's threads that gloo started (its loop and workers)."""
    return [name for _, name, _ in proc_threads() if "gloo" in name]


def main() -> None:
    bps.init()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    assert (dist.get_rank(), dist.get_world_size()) == (bps.rank(), bps.size()), \
        (dist.get_rank(), dist.get_world_size(), bps.rank(), bps.size())
    torch.manual_seed(0)  # the same initial model everywhere
    model = torch.nn.Linear(8, 1)
    lr = 0.1
    trainer = bps.DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=lr))
    for step in range(2):
        value = float(bps.rank() + 1 + step)
        before = [p.detach().clone() for p in model.parameters()]
        trainer.zero_grad()
        model(torch.full((4, 8), value)).sum().backward()
        # this process's gradient of the summed outputs over 4 rows: weight 4 x value,
        # bias 4; the reference mean comes from the user's default group
        grads = [torch.full((1, 8), 4 * value), torch.full((1,), 4.0)]
        for grad in grads:
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
        trainer.step()
        for param, old, grad in zip(model.parameters(), before, grads, strict=True):
            torch.testing.assert_close(param.detach(), old - lr * grad, rtol=2e-3, atol=2e-3)
    pipeline = "agent" if trainer.core.pipeline.shared_grads else "process"
    trainer.close()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered), "models diverged"
    dist.destroy_process_group()
    bps.shutdown()
    assert not gloo_threads(), f"process groups left alive: threads {gloo_threads()}"
    # one write of one line: several processes share the launcher's unbuffered pipe
    fields = ("RANK", "WORLD_SIZE", "DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK")
    values = [os.environ[f] for f in fields]
    values += [os.environ.get("OMP_NUM_THREADS", "-"), str(torch.get_num_threads()), pipeline]
    sys.stdout.write(OK + " ".join(values) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
