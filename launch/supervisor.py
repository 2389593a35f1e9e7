"""Child processes: prefixed output, stop-everything-on-failure, clean teardown.

Usage::

    from bps.launch.supervisor import Supervisor
    with Supervisor() as sup:
        sup.spawn([sys.executable, "-m", "bps.launch.cli"], env_s, "scheduler", service=True)
        sup.spawn(["ip", "netns", "exec", "ns0", "python", "train.py"], env_w, "worker0")
        exit_code = sup.wait()

Each child runs in its own process group, so the whole tree under it (for instance
``ip netns exec NS cmd``) is signalled together. Output lines (stdout and stderr merged)
are written to our stdout prefixed with ``[name]``. :meth:`wait` returns 0 when every
non-service child exited 0 (service children, such as the scheduler and the servers, are
then given ``grace`` seconds to exit on their own before being stopped); as soon as any
child fails, the others get ``report`` seconds to exit on their own (the cluster tells its
processes, and each names the failure as it exits), the rest are stopped, and it returns
that child's exit code (128 + signal for a child killed by a signal). With
``spare_nodes`` (``bpslaunch local|netem --min-workers``), that many worker nodes may fail
first: the rest of a failed node's processes are stopped and the job goes on (the
scheduler tells the others; it fails the job itself where too few are left). With
``max_restarts`` (``bpslaunch local --max-restarts``), a child that fails is started
again with the same command and environment instead, up to that many times in all for
the job, as torchrun's agent does: a worker process with every other process of its
node (they are stopped first; the node then joins the job again), a service (a server)
on its own. With ``replace_servers`` (``bpslaunch local --spare-servers``), server
processes may fail: the scheduler moves their keys to a replacement, or fails the job
itself. Leaving the
``with`` block, an exception or Ctrl-C stops every child: SIGTERM, then SIGKILL after
``grace`` seconds. Children get SIGKILL if the supervisor itself dies.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

# set by `bpslaunch local`: a directory where each worker process that joins the cluster
# (bps.init()) leaves a file, so a script without bps.init() ends without waiting
JOINED_DIR_VARIABLE = "BPS_JOINED_DIR"


def mark_joined(rank: int) -> None:
    """Leave this worker process's file in ``BPS_JOINED_DIR`` (under ``bpslaunch local``;
    nothing elsewhere): the launcher then waits for the scheduler and servers to end on
    their own once the workers have exited, instead of stopping them at once."""
    joined_dir = os.environ.get(JOINED_DIR_VARIABLE)
    if joined_dir and os.path.isdir(joined_dir):
        with open(os.path.join(joined_dir, str(rank)), "w"):
            pass


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    service: bool
    output: threading.Thread
    node: str | None = None  # the worker node it belongs to (its processes fail together)
    argv: tuple[str, ...] = ()  # what started it, to start it again
    env: dict | None = None
    server: bool = False  # a server (replace_servers: may fail with the job going on)


def add_min_workers_option(parser: argparse.ArgumentParser) -> None:
    """``--min-workers M``, read by :func:`min_workers` (``bpslaunch local`` and ``netem``)."""
    parser.add_argument("--min-workers", type=int, default=None,
                        help="worker nodes the job needs: a worker node that dies leaves "
                        "the job while at least this many are left (default: all; "
                        "BPS_MIN_WORKERS)")


def min_workers(parser: argparse.ArgumentParser, given: int | None, workers: int,
                workers_flag: str) -> int | None:
    """``--min-workers`` (else ``BPS_MIN_WORKERS``, else None), checked against the job's
    ``workers`` worker nodes; a bad value is a usage error naming the flag or variable."""
    flag = "--min-workers"
    if given is None and os.environ.get("BPS_MIN_WORKERS", "").strip():
        raw = os.environ["BPS_MIN_WORKERS"].strip()
        if not raw.isdigit():
            parser.error(f"BPS_MIN_WORKERS={raw!r} is not an integer")
        given, flag = int(raw), "BPS_MIN_WORKERS"
    if given is not None and not 1 <= given <= workers:
        parser.error(f"{flag}={given} out of range: expected 1 to {workers_flag} ({workers})")
    return given


def add_max_restarts_option(parser: argparse.ArgumentParser) -> None:
    """``--max-restarts N``, checked by :func:`check_max_restarts` (``bpslaunch local``
    and ``netem``)."""
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="start a failed worker node or server again, with the same "
                        "command, environment and id, up to this many times in all for "
                        "the job (default 0); needs --min-workers below the worker nodes: "
                        "the job goes on without the node until it joins again")


def check_max_restarts(parser: argparse.ArgumentParser, restarts: int,
                       min_workers_: int | None, workers: int, workers_flag: str) -> None:
    """A usage error where ``--max-restarts`` is negative, or set without a
    ``--min-workers`` below ``workers`` (a restarted node joins a job that went on)."""
    if restarts < 0:
        parser.error(f"--max-restarts={restarts} must be >= 0")
    if restarts and (min_workers_ is None or min_workers_ >= workers):
        parser.error(f"--max-restarts={restarts} needs --min-workers (or BPS_MIN_WORKERS) "
                     f"below {workers_flag} ({workers}): a restarted worker node joins a "
                     "job that went on without it")


def command_problem(argv: Sequence[str], path: str | None = None) -> str | None:
    """Why ``argv`` cannot be started (``None``: it can), said before anything starts.

        >>> command_problem(["sh", "-c", "true"]) is None
        True
        >>> command_problem(["/no/such/pyhton", "x.py"]).split(" (")[0]
        "command not found: '/no/such/pyhton'"
    """
    program = argv[0]
    if shutil.which(program, path=path) is not None:
        return None
    if os.sep in program and os.path.exists(program):
        return f"command is not executable: {program!r}"
    hint = "no such file" if os.sep in program else \
        "not on PATH; for the project's .venv: . .venv/bin/activate"
    return f"command not found: {program!r} ({hint}; a typo?)"


def exit_code(returncode: int) -> int:
    """Shell convention: a child killed by signal N gives 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Starts children and watches them; see the module docstring."""

    def __init__(self, grace: float = 5.0, out: IO[str] | None = None,
                 report: float = 2.0, spare_nodes: int = 0, max_restarts: int = 0,
                 replace_servers: bool = False) -> None:
        self.grace = grace
        self.spare_nodes = spare_nodes  # worker nodes that may fail with the job going on
        self.restarts_left = max_restarts  # failed children started again, in all
        self.restarted: list[str] = []  # the names of the children started again
        self._replaced: set[int] = set()  # processes stopped to restart their node
        self.replace_servers = replace_servers  # servers may fail so (the scheduler decides)
        self.lost_nodes: list[str] = []
        self.report = report  # seconds the others get to name a failure and exit
        self.out = out or sys.stdout
        self.children: list[Child] = []
        self._exits: queue.Queue = queue.Queue()
        self._write_lock = threading.Lock()
        self._muted: set[str] = set()  # children whose output is dropped from now on
        self._out_closed = False  # ``out`` refused a write: output is dropped from now on

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], name: str,
              service: bool = False, node: str | None = None, server: bool = False) -> Child:
        """Start ``argv`` with exactly ``env``; its output lines get ``[name]`` in front.
        ``node``: the worker node it belongs to (``spare_nodes``); ``server``: a server
        process (``replace_servers``)."""
        process = subprocess.Popen(
            list(argv), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        output = threading.Thread(target=self._pump, args=(name, process), daemon=True)
        child = Child(name, process, service, output, node, tuple(argv), dict(env), server)
        self.children.append(child)
        output.start()
        return child

    def _pump(self, name: str, process: subprocess.Popen) -> None:
        """Copy the child's lines to ``out``; its exit is queued whatever happens to
        ``out`` (a reader that went away, as ``bpslaunch ... | head``: the child's
        output is then drained and dropped, and the job still ends)."""
        try:
            for raw in iter(process.stdout.readline, b""):
                if name in self._muted or self._out_closed:
                    continue
                line = raw.decode("utf-8", "replace").rstrip("\n")
                try:
                    with self._write_lock:
                        self.out.write(f"[{name}] {line}\n")
                        self.out.flush()
                except (OSError, ValueError):  # a broken pipe, a closed file
                    self._out_closed = True
        finally:
            process.wait()
            self._exits.put(process)

    def wait(self, joined: Callable[[], bool] | None = None) -> int:
        """Block until the job ends; returns the exit code (see the module docstring).

        ``joined``: whether any worker joined the cluster; where none did once every
        worker exited 0 (a script without ``bps.init()``), the services, which would wait
        for them, are stopped at once and their output dropped."""
        by_process = {id(c.process): c for c in self.children}
        running = {id(c.process) for c in self.children}
        workers = {id(c.process) for c in self.children if not c.service}
        services = {id(c.process) for c in self.children if c.service}
        while running:
            if workers and not (workers & running) and joined is not None and not joined():
                self._log("no worker called bps.init(); stopping the scheduler and servers")
                self._muted.update(c.name for c in self.children if c.service)
                self.stop_all()
                return 0
            # spare nodes: the services end once every worker present finished, so a worker
            # process still running then is one that left the job (stopped, not dead)
            ended = bool(self.spare_nodes and services and not (services & running))
            timeout = self.grace if not (workers & running) or ended else None
            try:
                process = self._exits.get(timeout=timeout) if timeout else self._get()
            except queue.Empty:
                if ended:
                    self._log("worker processes still running after the job ended (they "
                              "left it); stopping them")
                    self._muted.update(c.name for c in self.children if not c.service)
                else:
                    self._log("services still running after the workers finished; "
                              "stopping them")
                self.stop_all()
                return 0
            running.discard(id(process))
            if id(process) in self._replaced:  # stopped to restart its node
                continue
            code = exit_code(process.returncode)
            if code != 0 and self.restarts_left > 0:
                for child in self._restart(by_process[id(process)], code):
                    by_process[id(child.process)] = child
                    running.add(id(child.process))
                    (services if child.service else workers).add(id(child.process))
                continue
            if code != 0 and self._may_lose(by_process[id(process)], code):
                continue
            if code != 0:
                self._log(f"{by_process[id(process)].name} exited with code {code}; "
                          "stopping all processes")
                self._let_exit(running)
                self.stop_all()
                return code
        return 0

    def _may_lose(self, child: Child, code: int) -> bool:
        """Whether the job goes on without ``child``'s worker node (``spare_nodes``); if
        so, the node's other processes are stopped."""
        node = child.node
        if child.server and self.replace_servers:
            self._log(f"{child.name} exited with code {code}; the scheduler moves its keys "
                      "to a replacement, or ends the job")
            return True
        if child.service or node is None:
            return False
        if node not in self.lost_nodes:
            if len(self.lost_nodes) >= self.spare_nodes:
                return False
            self.lost_nodes.append(node)
            self._log(f"{child.name} exited with code {code}; worker node {node} leaves the "
                      f"job, the others go on ({len(self.lost_nodes)} of "
                      f"{self.spare_nodes} that may)")
            for other in self.children:
                if other.node == node and other.process.poll() is None:
                    _signal_group(other.process, signal.SIGTERM)
        return True

    def _restart(self, child: Child, code: int) -> list[Child]:
        """Start ``child`` again, with every other process of its worker node (stopped
        first, SIGTERM then SIGKILL after ``grace``); returns the new children."""
        self.restarts_left -= 1
        latest = {child.name: child}  # of each process name, its latest start
        for other in self.children:
            if child.node is not None and other.node == child.node:
                latest[other.name] = other
        group = list(latest.values())
        what = f"worker node {child.node}" if child.node is not None else child.name
        self._log(f"{child.name} exited with code {code}; restarting {what} "
                  f"({self.restarts_left} restart(s) left)")
        for other in group:
            if other is not child:
                self._replaced.add(id(other.process))
                _signal_group(other.process, signal.SIGTERM)
        for other in group:
            if other is not child and not self._reaped(other):
                _signal_group(other.process, signal.SIGKILL)
                self._reaped(other)
        started = []
        for old in group:
            started.append(self.spawn(old.argv, old.env or {}, old.name, old.service,
                                      old.node, old.server))
            self.restarted.append(old.name)
        return started

    def _let_exit(self, running: set[int]) -> None:
        """Give the children in ``running`` up to ``report`` seconds to exit on their own
        after another failed: the cluster tells its processes of a failure, and each
        names it as it exits (a signal at once would cut those reports short). A child
        that is not a cluster process is told nothing: it waits that long to be stopped."""
        deadline = time.monotonic() + self.report
        while running and (left := deadline - time.monotonic()) > 0:
            try:  # short waits keep Ctrl-C responsive
                running.discard(id(self._exits.get(timeout=min(left, 0.5))))
            except queue.Empty:
                continue

    def _get(self) -> subprocess.Popen:
        # short timeouts keep Ctrl-C (KeyboardInterrupt) responsive in the main thread
        while True:
            try:
                return self._exits.get(timeout=0.5)
            except queue.Empty:
                continue

    def _log(self, message: str) -> None:
        # bounded: a SIGTERM's SystemExit may have left the lock held by this thread
        locked = self._write_lock.acquire(timeout=1.0)
        try:
            self.out.write(f"[bpslaunch] {message}\n")
            self.out.flush()
        finally:
            if locked:
                self._write_lock.release()

    def stop_all(self) -> None:
        """SIGTERM every live child's process group, SIGKILL what is left after ``grace``.
        Every wait is bounded: a child that cannot be reaped is named and left behind."""
        live = [c for c in self.children if c.process.poll() is None]
        for child in live:
            _signal_group(child.process, signal.SIGTERM)
        for child in live:
            if self._reaped(child):
                continue
            _signal_group(child.process, signal.SIGKILL)
            if not self._reaped(child):
                self._log(f"{child.name} (pid {child.process.pid}) was not reaped within "
                          f"{self.grace:g}s of SIGKILL; leaving it")
        for child in self.children:
            # a group may outlive its leader (e.g. processes that ignore SIGTERM)
            _signal_group(child.process, signal.SIGKILL)
            child.output.join(timeout=1.0)

    def _reaped(self, child: Child) -> bool:
        # With a timeout Popen.wait only tries its lock, never blocks on it: a SIGTERM
        # (sys.exit in the launcher) that struck while this thread held that lock would
        # otherwise make the teardown wait for itself forever.
        try:
            child.process.wait(timeout=self.grace)
        except subprocess.TimeoutExpired:
            return False
        return True


def _die_with_parent() -> None:
    """In the child: get SIGKILL if the supervisor dies, so even a SIGKILLed launcher
    leaves no orphans (Linux prctl PR_SET_PDEATHSIG; bound to the spawning thread)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
