"""The engine's I/O thread is woken for every push it is handed.

It sleeps in a poll of its sockets and its wake-up pipe, for up to
``BPS_HEARTBEAT_INTERVAL``. A wake it never gets leaves the step's pushes queued until
that poll times out, or a reply comes. Between steps no reply is on its way, so with an
interval of 10 s a lost wake makes a step last about 10 s. Every step of the job must
take less than half of that: 40 steps of 22 pushes each, on one worker and one server.
"""

from __future__ import annotations

import re
import sys

from tests.harness.ps_job import BPSLAUNCH, TEST_ENV, run_command

INTERVAL_S = 10.0

JOB = """
import sys
import time

import torch

import bps

limit = float(sys.argv[1])
bps.init()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(20)])
trainer = bps.DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                 {"compressor": "onebit", "ef": "vanilla"})
x = torch.randn(4, 256)
worst, before = 0.0, trainer.core.runtime.engine.stats.pushes
for step in range(40):
    start = time.monotonic()
    trainer.zero_grad()
    model(x).square().mean().backward()
    trainer.step()
    worst = max(worst, time.monotonic() - start)
    if worst > limit:  # no need to wait for every later step to stall too
        sys.exit(f"step {step} took {worst:.1f} s")
pushes = trainer.core.runtime.engine.stats.pushes - before
trainer.close()
bps.shutdown()
print(f"worst step {worst:.3f} s, {pushes} pushes", flush=True)
"""


def test_no_step_waits_for_the_io_threads_poll_to_time_out(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**TEST_ENV, "BPS_HEARTBEAT_INTERVAL": str(INTERVAL_S),
           "BPS_HEARTBEAT_TIMEOUT": str(6 * INTERVAL_S), "BPS_TIMEOUT": "120",
           "OMP_NUM_THREADS": "1"}
    env.pop("BYTEPS_PARTITION_BYTES")  # each 256 KiB weight its own key
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "1", "--servers", "1", "--",
                                            sys.executable, str(script), str(INTERVAL_S / 2)],
                               env, timeout=240)
    assert code == 0, output
    found = re.search(r"worst step ([\d.]+) s, (\d+) pushes", output)
    assert found, output
    # 20 weights; the 20 biases fuse into 2 buckets, each within a 4 MB span of gradients
    assert int(found[2]) == 40 * 22, output
