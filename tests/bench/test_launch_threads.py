"""bench/launch_threads.py end to end: both jobs run, and the table shows the threads
torch used in each (the launcher's share of 2 workers + 1 server, then one per core)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bps.common.striping import host_cores
from tests.harness import paths


# two cluster launches (about 35 s of make test on 2 cores); the launcher's variable and
# torch's threads in every worker process are checked by tests/launch/test_cluster.py's
# test_local_job_gives_workers_torch_distributed_variables
@pytest.mark.slow
def test_the_table_names_the_threads_of_each_job():
    done = subprocess.run([sys.executable, str(paths.BENCH / "launch_threads.py"), "--rounds",
                           "1", "--steps", "5"], capture_output=True, text=True, timeout=240,
                          cwd=paths.ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| OMP")]
    cores = host_cores()
    assert [int(row[2]) for row in rows] == [max(1, cores // 3), cores], done.stdout
