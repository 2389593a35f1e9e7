"""Run the scheduler or a server in this process, as ``DMLC_ROLE`` names it.

``bpslaunch`` calls :func:`serve` for those two roles; ``python -m bps.server`` runs
:func:`main`::

    DMLC_ROLE=server DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=1 \\
        DMLC_PS_ROOT_URI=10.0.0.1 DMLC_PS_ROOT_PORT=9000 python -m bps.server
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from bps.common.auth import AuthError
from bps.common.cpu_policy import use_batch_policy
from bps.common.env import ClusterEnv, EnvError

EXIT_BAD_ENV = 2


def setup_process() -> None:
    """Log to stderr with timestamps; the first SIGTERM exits with 128 + SIGTERM."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # One SystemExit is enough: a second SIGTERM (bpslaunch stopping a role that is
    # already on its way out) must not interrupt the cleanup or the atexit callbacks.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signal.SIGTERM)


def server_batch_policy(env: ClusterEnv) -> bool:
    """Whether this role runs under ``SCHED_BATCH`` (:mod:`bps.common.cpu_policy`): a
    server of a job whose workers run node agents (``BPS_NODE_AGENT=1``), unless
    ``BPS_SCHED_BATCH=0``. Not for workers that run the engine in process: their engine
    threads wait for the server's replies while the training loop keeps the cores busy,
    and a server that waits for its turn slowed their step by a seventh.

        >>> from types import SimpleNamespace as Env
        >>> server_batch_policy(Env(role="server", node_agent=True, sched_batch=True))
        True
        >>> server_batch_policy(Env(role="server", node_agent=False, sched_batch=True))
        False
    """
    return env.role == "server" and env.node_agent and env.sched_batch


def serve(env: ClusterEnv) -> int:
    """Run the scheduler or the server of ``env`` until the job ends; returns the exit code."""
    use_batch_policy(server_batch_policy(env))
    try:
        if env.role == "scheduler":
            from bps.server.scheduler import run_scheduler
            return run_scheduler(env)
        if env.role == "server":
            # torch and numba's objects live as long as the process: collections that
            # walk them again and again took a tenth of a server's CPU
            # (docs/benchmarks.md, "The main job"), so none runs while they are
            # imported, and they are kept out of the collector's sight afterwards
            gc.disable()
            try:
                from bps.server.server import run_server
                gc.freeze()
            finally:
                gc.enable()
            logging.getLogger("bps.server").info(
                "%d objects from start-up kept out of the garbage collector",
                gc.get_freeze_count())
            return run_server(env)
        raise ValueError(f"DMLC_ROLE={env.role!r}: bps.server runs the scheduler or a server")
    finally:
        # The role has finished; what is left is the interpreter's exit, which a SIGTERM
        # from the launcher stopping everyone would only turn into a traceback.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def end_process(code: int) -> NoReturn:
    """Leave a role process that has finished: flush the logs and the output, then exit
    with ``code`` without the interpreter's finalization.

    A role keeps nothing to finalize (its sockets and threads are closed when
    :func:`serve` returns), and after ``import torch`` CPython's finalization takes
    0.3-0.5 s of CPU, which at a job's end competes with the workers for the cores.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nobody is left to read it
    os._exit(code)


def main(args: Sequence[str] = ()) -> int:
    """``python -m bps.server``: the role of the environment; returns the exit code."""
    try:
        env = ClusterEnv.from_environ()
    except EnvError as exc:
        print(f"bps.server: error: {exc}", file=sys.stderr)
        return EXIT_BAD_ENV
    if env.role == "worker":
        print("bps.server: error: DMLC_ROLE=worker: run workers with bpslaunch",
              file=sys.stderr)
        return EXIT_BAD_ENV
    setup_process()
    try:
        return serve(env)
    except AuthError as exc:
        print(f"bps.server: error: {exc}", file=sys.stderr)
        return EXIT_BAD_ENV
