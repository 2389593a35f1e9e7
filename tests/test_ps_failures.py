"""Failure behaviour with real processes started one by one (no fail-fast launcher in
between): a dead worker, a dead server or a node that never arrives makes every other
process exit non-zero with an error naming it, within the heartbeat timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bps.launch.role import free_port
from tests.ps_job import TEST_ENV

JOB = str(Path(__file__).with_name("ps_job.py"))
ROLE = [sys.executable, "-m", "bps.launch.cli"]
HEARTBEAT_TIMEOUT = 4.0


class Cluster:
    """Processes of one test; every one of them is killed in teardown."""

    def __init__(self, tmp_path: Path, workers: int, servers: int, timeout: float) -> None:
        self.tmp_path = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, **TEST_ENV, "DMLC_NUM_WORKER": str(workers),
                    "DMLC_NUM_SERVER": str(servers), "DMLC_PS_ROOT_URI": "127.0.0.1",
                    "DMLC_PS_ROOT_PORT": str(free_port()), "BPS_TIMEOUT": str(timeout),
                    "BPS_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT)}

    def start(self, name: str, argv: list[str], **env: str) -> subprocess.Popen:
        log = open(self.tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed by the OS
        self.procs[name] = subprocess.Popen(argv, env={**self.env, **env}, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        return self.procs[name]

    def worker(self, node: int, *args: str) -> subprocess.Popen:
        return self.start(f"worker{node}", [sys.executable, JOB, "--out", str(self.tmp_path),
                                            "--case", "loop", *args],
                          DMLC_ROLE="worker", DMLC_WORKER_ID=str(node))

    def wait(self, name: str, timeout: float) -> tuple[int, str]:
        code = self.procs[name].wait(timeout=timeout)
        return code, (self.tmp_path / f"{name}.log").read_text()

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator:
    made: list[Cluster] = []

    def make(workers: int, servers: int, timeout: float = 30.0) -> Cluster:
        made.append(Cluster(tmp_path, workers, servers, timeout))
        return made[-1]

    yield make
    for c in made:
        c.kill_all()


# startup (imports) + heartbeat timeout + slack for a loaded 2-core machine
EXIT_WITHIN = 60.0


def test_killed_worker_fails_everyone_naming_it(cluster) -> None:
    c = cluster(workers=2, servers=1)
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    c.start("server0", ROLE, DMLC_ROLE="server")
    c.worker(0)
    c.worker(1, "--kill-at", "3")
    code, out = c.wait("worker1", EXIT_WITHIN)
    assert code == -signal.SIGKILL, out
    for name in ("scheduler", "server0", "worker0"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "worker 1 at 127.0.0.1 died: no heartbeat" in out, (name, out)


def test_killed_server_fails_everyone_naming_it(cluster) -> None:
    c = cluster(workers=2, servers=2)
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    c.start("server0", ROLE, DMLC_ROLE="server", BPS_SERVER_ID="0")
    victim = c.start("server1", ROLE, DMLC_ROLE="server", BPS_SERVER_ID="1")
    c.worker(0, "--kill-pid", str(victim.pid), "--kill-at", "3")
    c.worker(1)
    for name in ("scheduler", "server0", "worker0", "worker1"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "server 1 at tcp://127.0.0.1:" in out and "died" in out, (name, out)


def test_missing_worker_times_out_naming_it(cluster) -> None:
    c = cluster(workers=2, servers=1, timeout=8.0)
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    c.start("server0", ROLE, DMLC_ROLE="server")
    c.worker(0)
    for name in ("scheduler", "server0", "worker0"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "rendezvous timed out" in out and "workers missing: [1]" in out, (name, out)


def train_job(c, failing: int, how: str, at: int = 3) -> None:
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    c.start("server0", ROLE, DMLC_ROLE="server")
    for node in range(2):
        c.start(f"worker{node}", [sys.executable, JOB, "--out", str(c.tmp_path), "--case",
                                  "train", "--fail", str(failing), how, str(at)],
                DMLC_ROLE="worker", DMLC_WORKER_ID=str(node))


@pytest.mark.parametrize(("how", "named"), [
    ("raise", "worker 1 at 127.0.0.1 failed: RuntimeError: boom at step 3"),
    ("exit", "worker 1 at 127.0.0.1 failed: the process exited without calling bps.shutdown()"),
    ("interrupt", "worker 1 at 127.0.0.1 failed: KeyboardInterrupt"),
])
def test_a_worker_that_fails_is_named_by_everyone(cluster, how: str, named: str) -> None:
    """An exception, sys.exit(3) or Ctrl-C in worker 1 outside bpslaunch local: it tells
    the scheduler it failed (not that it finished), and every other process stops at once
    with an error naming it, instead of waiting for its next push."""
    c = cluster(workers=2, servers=1)
    train_job(c, 1, how)
    code, out = c.wait("worker1", EXIT_WITHIN)
    assert code != 0, out
    for name in ("scheduler", "server0", "worker0"):
        code, out = c.wait(name, HEARTBEAT_TIMEOUT + 30)
        assert code != 0, (name, out)
        assert named in out, (name, out)
    scheduler_log = c.wait("scheduler", 1)[1]
    assert "worker 0 at 127.0.0.1 died" not in scheduler_log  # never the healthy one
    assert "worker 0 at 127.0.0.1 failed" not in scheduler_log


def test_a_stopped_worker_is_named_by_everyone(cluster) -> None:
    """SIGSTOP: the process stays but sends nothing; the heartbeat rule names it."""
    c = cluster(workers=2, servers=1)
    train_job(c, 1, "stop")
    for name in ("scheduler", "server0", "worker0"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "worker 1 at 127.0.0.1 died: no heartbeat" in out, (name, out)


def test_a_worker_whose_main_thread_hangs_is_named(cluster) -> None:
    """Its I/O thread heartbeats on, but its steps stop while worker 0 waits."""
    c = cluster(workers=2, servers=1)
    train_job(c, 1, "hang")
    for name in ("scheduler", "server0", "worker0"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "worker 1 at 127.0.0.1 stopped stepping: its last push was of step 2" in out, \
            (name, out)


def test_workers_that_run_different_numbers_of_steps_get_a_clear_error(cluster) -> None:
    c = cluster(workers=2, servers=1)
    train_job(c, 1, "finish")
    for name in ("scheduler", "worker0", "worker1"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "the workers ran different numbers of steps" in out, (name, out)


def test_workers_with_different_learning_rates_get_a_clear_error(cluster) -> None:
    c = cluster(workers=2, servers=1)
    train_job(c, 1, "lr")
    for name in ("scheduler", "server0", "worker0", "worker1"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "the workers' learning rates differ" in out, (name, out)


def test_a_late_scheduler_is_waited_for(cluster) -> None:
    """Servers and workers started well before the scheduler (longer than the heartbeat
    timeout) wait for it up to BPS_TIMEOUT, as documented, and the job completes."""
    import subprocess

    c = cluster(workers=2, servers=1)
    c.start("server0", ROLE, DMLC_ROLE="server")
    for node in range(2):
        c.start(f"worker{node}", [sys.executable, JOB, "--out", str(c.tmp_path), "--case",
                                  "raw"], DMLC_ROLE="worker", DMLC_WORKER_ID=str(node))
    with pytest.raises(subprocess.TimeoutExpired):  # alive after the heartbeat timeout
        c.procs["worker1"].wait(timeout=HEARTBEAT_TIMEOUT + 2)
    c.start("scheduler", ROLE, DMLC_ROLE="scheduler")
    for name in ("scheduler", "server0", "worker0", "worker1"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code == 0, (name, out)


def wait_for_line(c, name: str, text: str, timeout: float = EXIT_WITHIN) -> None:
    import time

    deadline = time.monotonic() + timeout
    while text not in (c.tmp_path / f"{name}.log").read_text():
        assert time.monotonic() < deadline and c.procs[name].poll() is None, \
            (name, (c.tmp_path / f"{name}.log").read_text())
        time.sleep(0.05)  # polling a log file for a line, with a deadline


def test_a_stopped_server_is_named_by_everyone(cluster) -> None:
    c = cluster(workers=2, servers=1)
    train_job(c, 1, "none", at=-1)
    wait_for_line(c, "worker0", "worker 0: training")
    os.kill(c.procs["server0"].pid, signal.SIGSTOP)
    for name in ("scheduler", "worker0", "worker1"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert "server 0 at tcp://127.0.0.1:" in out and "died: no heartbeat" in out, \
            (name, out)


def test_a_killed_scheduler_is_named_by_everyone(cluster) -> None:
    c = cluster(workers=2, servers=1)
    train_job(c, 1, "none", at=-1)
    wait_for_line(c, "worker0", "worker 0: training")
    os.kill(c.procs["scheduler"].pid, signal.SIGKILL)
    for name in ("server0", "worker0", "worker1"):
        code, out = c.wait(name, EXIT_WITHIN)
        assert code != 0, (name, out)
        assert (f"scheduler at tcp://127.0.0.1:{c.env['DMLC_PS_ROOT_PORT']} unreachable: "
                "no heartbeat") in out, (name, out)
