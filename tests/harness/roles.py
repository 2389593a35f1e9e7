r"""Roles started one by one as real processes (no fail-fast launcher in between), for
the failure and security tests: each process's output read line by line as it comes,
waits on it with a deadline (no polling), and every process killed in teardown.

Example (a test that takes the ``cluster`` fixture of tests/conftest.py)::

    c = cluster(workers=1, servers=1)
    c.start("scheduler", [sys.executable, "-m", "bps.launch.cli"], DMLC_ROLE="scheduler")
    address = c.wait_for_line("server0", r"server listening on (tcp://\S+)").group(1)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bps.launch.role import free_port
from tests.harness.ps_job import JOB, TEST_ENV, default_sigint

HEARTBEAT_TIMEOUT = 4.0


class Output:
    """A process's output, read line by line as it comes: written to its log file, and
    each line kept with the moment it arrived (time.monotonic)."""

    def __init__(self, proc: subprocess.Popen, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[float, str]] = []
        self.ended = False  # the process closed its output
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        with open(self.path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                with self.changed:
                    self.lines.append((time.monotonic(), line))
                    self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def first(self, *texts: str) -> float | None:
        """When the first line containing all of ``texts`` arrived, or None."""
        with self.changed:
            return next((when for when, line in self.lines
                         if all(text in line for text in texts)), None)

    def wait_for(self, text: str, timeout: float) -> bool:
        """Wait up to ``timeout`` for a line containing ``text``; False at EOF/timeout."""
        with self.changed:
            return self.changed.wait_for(
                lambda: any(text in line for _, line in self.lines) or self.ended,
                timeout) and self.first(text) is not None

    def search(self, pattern: str, timeout: float) -> re.Match | None:
        """Wait up to ``timeout`` for a line matching the regex ``pattern``; its match, or
        None at EOF/timeout."""
        def found() -> re.Match | None:
            return next((m for _, line in self.lines if (m := re.search(pattern, line))),
                        None)

        with self.changed:
            self.changed.wait_for(lambda: found() is not None or self.ended, timeout)
            return found()


class Cluster:
    """Processes of one test; every one of them is killed in teardown."""

    def __init__(self, tmp_path: Path, workers: int, servers: int, timeout: float,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT) -> None:
        self.tmp_path = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}
        self.outputs: dict[str, Output] = {}
        self.port = free_port()  # the scheduler's
        self.env = {**os.environ, **TEST_ENV, "DMLC_NUM_WORKER": str(workers),
                    "DMLC_NUM_SERVER": str(servers), "DMLC_PS_ROOT_URI": "127.0.0.1",
                    "DMLC_PS_ROOT_PORT": str(self.port), "BPS_TIMEOUT": str(timeout),
                    "BPS_HEARTBEAT_TIMEOUT": str(heartbeat_timeout)}

    def start(self, name: str, argv: list[str], **env: str) -> subprocess.Popen:
        self.procs[name] = subprocess.Popen(argv, env={**self.env, **env},
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True, start_new_session=True,
                                            preexec_fn=default_sigint)
        self.outputs[name] = Output(self.procs[name], self.tmp_path / f"{name}.log")
        return self.procs[name]

    def worker(self, node: int, *args: str) -> subprocess.Popen:
        return self.start(f"worker{node}", [sys.executable, JOB, "--out", str(self.tmp_path),
                                            "--case", "loop", *args],
                          DMLC_ROLE="worker", DMLC_WORKER_ID=str(node))

    def log(self, name: str) -> str:
        """The output of ``name`` so far (all of it, once it has exited)."""
        if self.procs[name].poll() is not None:
            self.outputs[name].thread.join(timeout=10)
        with self.outputs[name].changed:
            return "".join(line for _, line in self.outputs[name].lines)

    def wait(self, name: str, timeout: float) -> tuple[int, str]:
        code = self.procs[name].wait(timeout=timeout)
        return code, self.log(name)

    def wait_all(self, timeout: float) -> dict[str, int]:
        """Every process's exit code (each waited for up to ``timeout``)."""
        return {name: proc.wait(timeout=timeout) for name, proc in self.procs.items()}

    def wait_for_line(self, name: str, pattern: str, timeout: float = 60.0) -> re.Match:
        """The match of the first line of ``name`` matching ``pattern``; fails if the
        process ends or ``timeout`` passes first."""
        match = self.outputs[name].search(pattern, timeout)
        assert match is not None, f"{name}: no line matching {pattern!r}:\n{self.log(name)}"
        return match

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
